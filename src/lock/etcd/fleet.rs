//! The fleet record ([`keys::FLEET`]): the longest lease TTL and stop budget any host of the
//! fleet holds its locks with. A host raises it before it claims a lock (never lowers it), so
//! that what one host may still hold is known to every other.
//!
//! Its use is the longest a holder under the old data may still run when a lineage begins
//! ([`longest_hold`]): a connected holder stops within its stop budget of seeing its keys gone,
//! and a cut-off one is gone by the end of its lease, which lasts at most its TTL. The record
//! itself goes with a wipe of the prefix; the leases of the holders do not (`etcdctl del` deletes
//! keys, not leases), so the longest TTL still granted to a live lease is counted as well.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, KeyValue, Txn, TxnOp};
use serde::{Deserialize, Serialize};

use super::client::Pool;
use crate::names::etcd as keys;

/// The record's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Bound {
    pub(super) ttl_ms: u64,
    pub(super) stop_budget_ms: u64,
}

impl Bound {
    pub(super) fn of(ttl: Duration, stop_budget: Duration) -> Self {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        Self {
            ttl_ms: ms(ttl),
            stop_budget_ms: ms(stop_budget),
        }
    }

    /// The record `kv`, if a host can have written it: a TTL or stop budget above what any
    /// configuration gives is junk (it would hold every new lineage for centuries), and the
    /// next claim writes the record afresh.
    pub(super) fn parse(kv: &KeyValue) -> Option<Self> {
        serde_json::from_slice::<Self>(kv.value())
            .ok()
            .filter(Self::plausible)
    }

    /// Whether a configuration can give it.
    pub(super) fn plausible(&self) -> bool {
        self.ttl() <= crate::config::MAX_LEASE_TTL
            && Duration::from_millis(self.stop_budget_ms) <= crate::config::MAX_STOP_BUDGET
    }

    pub(super) fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms)
    }

    /// Whether it covers `other`.
    pub(super) fn covers(&self, other: &Self) -> bool {
        self.ttl_ms >= other.ttl_ms && self.stop_budget_ms >= other.stop_budget_ms
    }

    fn max(&self, other: &Self) -> Self {
        Self {
            ttl_ms: self.ttl_ms.max(other.ttl_ms),
            stop_budget_ms: self.stop_budget_ms.max(other.stop_budget_ms),
        }
    }
}

/// Raise the fleet record to cover `ours` (a record unreadable or absent is written afresh),
/// before a claim: in one transaction that names the record it read.
pub(super) async fn raise(pool: &Pool, ours: Bound) -> Result<(), etcd_client::Error> {
    // More changes than that meanwhile are other hosts raising it too: theirs is read next time.
    for _ in 0..5 {
        let response = pool
            .call(|mut c| async move { c.get(keys::FLEET, None).await })
            .await?;
        let kv = response.kvs().first();
        let seen = kv.and_then(Bound::parse);
        if seen.is_some_and(|seen| seen.covers(&ours)) {
            return Ok(());
        }
        let new = seen.map_or(ours, |seen| seen.max(&ours));
        let value = serde_json::to_string(&new).expect("a fleet record always serialises");
        let txn = Txn::new()
            .when([Compare::mod_revision(
                keys::FLEET,
                CompareOp::Equal,
                kv.map_or(0, KeyValue::mod_revision),
            )])
            .and_then([TxnOp::put(keys::FLEET, value, None)]);
        let response = pool.txn(&txn).await?;
        if response.succeeded() {
            tracing::info!(
                ttl_ms = new.ttl_ms,
                stop_budget_ms = new.stop_budget_ms,
                "fleet record raised"
            );
            return Ok(());
        }
    }
    Err(etcd_client::Error::InvalidArgs(format!(
        "the fleet record {} kept changing while we raised it",
        keys::FLEET
    )))
}

/// The longest any holder may still run after its keys are gone, at least `own`: the fleet
/// record's TTL, and the longest TTL granted to any lease that is still alive.
pub(super) async fn longest_hold(
    pool: &Pool,
    own: Duration,
) -> Result<Duration, etcd_client::Error> {
    let mut longest = own;
    let response = pool
        .call(|mut c| async move { c.get(keys::FLEET, None).await })
        .await?;
    if let Some(bound) = response.kvs().first().and_then(Bound::parse) {
        longest = longest.max(bound.ttl());
    }
    let leases = pool.call(|mut c| async move { c.leases().await }).await?;
    for id in leases.leases().iter().map(etcd_client::LeaseStatus::id) {
        let alive = pool
            .call(|mut c| async move { c.lease_time_to_live(id, None).await })
            .await?;
        if alive.ttl() > 0 {
            longest = longest.max(Duration::from_secs(alive.granted_ttl().unsigned_abs()));
        }
    }
    Ok(longest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_covers_only_what_is_no_longer_in_either_part() {
        let a = Bound::of(Duration::from_secs(15), Duration::from_millis(10_500));
        let b = Bound::of(Duration::from_secs(3), Duration::from_millis(1_500));
        assert!(a.covers(&b) && !b.covers(&a));
        let c = Bound::of(Duration::from_secs(20), Duration::from_millis(500));
        assert!(!a.covers(&c) && !c.covers(&a));
        assert_eq!(
            a.max(&c),
            Bound::of(Duration::from_secs(20), Duration::from_millis(10_500))
        );
    }
}
