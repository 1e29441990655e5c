//! The head of the line looks at its holder's lease now and then: how long etcd will still
//! keep it. One look that finds less than the holder's stop budget left proves the holder's
//! own clock had already put its lease at risk, so its command is gone by that look's expiry
//! whatever ends the lease afterwards. Without such a look, a lapse is waited out in full
//! ([`super::lapse`]).
//!
//! Why one look is enough. A holder counts its lease as good until the send time of its last
//! answered keepalive plus its TTL, and begins stopping its command once less than its stop
//! budget is left of that (its fence kills what is left by then); it never renews after that
//! point. etcd renewed the lease no earlier than that keepalive was sent. So when the leader
//! says, at some instant, that less than the stop budget is left, the holder's own deadline was
//! no later than the leader's expiry, its stop had begun by that instant, and its command is
//! gone by the expiry the look saw. etcd rounds the time left down to whole seconds: a look
//! that says `n` proves less than `n + 1` seconds were left.
//!
//! The answer must be the leader's: a member that was leader once and has not yet learned it
//! was deposed keeps a lessor that no longer sees the holder's renewals. So a look is bracketed
//! by two linearizable reads through the same member, and counts only when all three answers
//! carry that member and one raft term: the second read proves the leader of that term still
//! led after the look was answered.

use std::time::Duration;

use etcd_client::{Client, GetOptions};
use tokio::time::Instant;

use crate::lock::etcd::client::Pool;
use crate::names::etcd as keys;

/// On top of what a look proves: two hosts' clock rates, a fence that is late on a busy host.
const SLACK: Duration = Duration::from_millis(500);
/// How often the head looks once the holder's lease may be within its stop budget.
const CLOSE_LOOK_EVERY: Duration = Duration::from_millis(300);
/// The longest gap between two looks.
const LONGEST_GAP: Duration = Duration::from_secs(10);
/// How long one request of a look may take.
const LOOK_TIMEOUT: Duration = Duration::from_secs(1);

/// What a look at a holder's lease proved.
#[derive(Debug, Clone, Copy)]
pub(in crate::lock::etcd) struct Proof {
    /// The time left that etcd's leader gave, in whole seconds rounded down.
    pub(in crate::lock::etcd) left_s: i64,
    /// When the look was answered.
    pub(in crate::lock::etcd) at: std::time::SystemTime,
    /// The holder's command is gone by then, at the latest.
    pub(in crate::lock::etcd) gone_by: Instant,
}

/// The head's watch on its holder's lease.
#[derive(Debug)]
pub(in crate::lock::etcd) struct LeaseWatch {
    /// The holder's lease.
    pub(in crate::lock::etcd) lease: i64,
    /// The holder's stop budget, as its tenure record says.
    budget: Duration,
    /// When to look next.
    next: Instant,
    /// Once proven: when the holder's command is gone by.
    pub(in crate::lock::etcd) proof: Option<Proof>,
}

/// What one look found.
enum Found {
    /// Whole seconds left, answered at that instant by the leader of the term.
    Left(i64, Instant),
    /// The lease is gone.
    Gone,
    /// Nothing proven (no answer in time, a term or member that changed).
    Unproven,
}

impl LeaseWatch {
    /// A watch on `lease`, whose holder's stop budget is `budget`; `None` when no look could
    /// ever prove anything (a stop budget under one second: etcd's whole seconds are too coarse).
    pub(in crate::lock::etcd) fn new(lease: i64, budget: Duration) -> Option<Self> {
        (budget >= Duration::from_secs(1)).then(|| Self {
            lease,
            budget,
            next: Instant::now(),
            proof: None,
        })
    }

    /// When the next look is due; `None` once proven (nothing more to learn).
    pub(in crate::lock::etcd) fn due(&self) -> Option<Instant> {
        self.proof.is_none().then_some(self.next)
    }

    /// Look once, through `pool`'s current member. `false`: the lease is gone (read the lock
    /// again).
    pub(in crate::lock::etcd) async fn look(&mut self, pool: &Pool) -> bool {
        let (_, client) = pool.current();
        match look_once(client, self.lease).await {
            Found::Gone => return false,
            Found::Unproven => self.next = Instant::now() + CLOSE_LOOK_EVERY,
            Found::Left(left_s, answered) => self.saw(left_s, answered),
        }
        true
    }

    /// What etcd's leader said: `left_s` whole seconds left, answered at `answered`.
    fn saw(&mut self, left_s: i64, answered: Instant) {
        let left = Duration::from_secs(left_s.unsigned_abs());
        let under = left + Duration::from_secs(1);
        if under <= self.budget {
            self.proof = Some(Proof {
                left_s,
                at: std::time::SystemTime::now(),
                gone_by: answered + under + SLACK,
            });
        } else {
            // Next, just before less than the budget (in etcd's whole seconds) can be left if
            // no keepalive renews it meanwhile; then often, until it is renewed or gone.
            let whole = Duration::from_secs(self.budget.as_secs());
            let gap = left.saturating_sub(whole).min(LONGEST_GAP);
            self.next = answered + gap.max(CLOSE_LOOK_EVERY);
        }
    }
}

/// One bracketed look at `lease` through `client`.
async fn look_once(mut client: Client, lease: i64) -> Found {
    let read = || GetOptions::new().with_count_only();
    let before = tokio::time::timeout(LOOK_TIMEOUT, client.get(keys::LINEAGE, Some(read())));
    let Ok(Ok(before)) = before.await else {
        return Found::Unproven;
    };
    let look = tokio::time::timeout(LOOK_TIMEOUT, client.lease_time_to_live(lease, None));
    let Ok(Ok(look)) = look.await else {
        return Found::Unproven;
    };
    let answered = Instant::now();
    let after = tokio::time::timeout(LOOK_TIMEOUT, client.get(keys::LINEAGE, Some(read())));
    let Ok(Ok(after)) = after.await else {
        return Found::Unproven;
    };
    let of = |h: Option<&etcd_client::ResponseHeader>| h.map(|h| (h.member_id(), h.raft_term()));
    let terms = [of(before.header()), of(look.header()), of(after.header())];
    if terms[0].is_none() || terms.iter().any(|t| *t != terms[0]) {
        return Found::Unproven;
    }
    match look.ttl() {
        left if left >= 0 => Found::Left(left, answered),
        _ => Found::Gone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_look_proves_only_less_than_the_stop_budget_left() {
        let budget = Duration::from_millis(2500);
        let at = Instant::now();
        // "1 s left" is less than 2 s: within the budget, gone by then plus the slack.
        let mut watch = LeaseWatch::new(7, budget).expect("a watch");
        watch.saw(1, at);
        let proof = watch.proof.expect("proven");
        assert_eq!(proof.gone_by, at + Duration::from_secs(2) + SLACK);
        assert_eq!(watch.due(), None);
        // "2 s left" may be 2.9 s: more than the budget. Look again soon.
        let mut watch = LeaseWatch::new(7, budget).expect("a watch");
        watch.saw(2, at);
        assert!(watch.proof.is_none());
        assert_eq!(watch.due(), Some(at + CLOSE_LOOK_EVERY));
        // A renewed lease: look again just before the budget can be reached.
        watch.saw(5, at);
        assert_eq!(watch.due(), Some(at + Duration::from_secs(3)));
        watch.saw(600, at);
        assert_eq!(watch.due(), Some(at + LONGEST_GAP));
        // A budget of exactly 2 s: "1 s left" proves it, "2 s left" does not.
        let mut watch = LeaseWatch::new(7, Duration::from_secs(2)).expect("a watch");
        watch.saw(2, at);
        assert!(watch.proof.is_none());
        watch.saw(1, at);
        assert!(watch.proof.is_some());
    }

    #[test]
    fn no_watch_where_whole_seconds_can_prove_nothing() {
        assert!(LeaseWatch::new(1, Duration::from_millis(999)).is_none());
        let watch = LeaseWatch::new(1, Duration::from_millis(2500)).expect("a watch");
        assert!(watch.due().is_some());
    }
}
