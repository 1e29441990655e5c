//! The line in front of an etcd lock: a lock directory read at one revision ([`Snapshot`]),
//! what stands between a waiter and the lock ([`Obstacle`]), joining the line, the claim, and
//! the wait on the runtime for our turn ([`wait_turn`], watched by the signal funnel through
//! [`PendingTake`]).
//!
//! Only keys bound to a lease count: a key that ccci-run always binds to one, found without
//! (written by hand with `etcdctl put`), is junk. Waiters and claims look past it, `locks`
//! shows it, the janitor removes it; an owner key that is junk is removed by the claim that
//! finds it. A claim also waits for every tenure key (a holder that lost its owner key but has
//! not ended yet, whose command may still act) and for a settling lineage.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse, WatchOptions,
};
use serde::{Deserialize, Serialize};

use super::Etcd;
use super::client::{Pool, RELEASE_TIMEOUT, REQUEST_TIMEOUT, RETRY_PAUSE, Shared};
use super::lease::Session;
use super::lineage::{self, Lineage};
use crate::config::Class;
use crate::lock::backend::{LockKey, Wait};
use crate::lock::{Holder, LockError};
use crate::names::etcd as keys;
use crate::report;
use crate::supervise::worker::Awaitable;

/// How often a waiter reads its queue again even though its watch said nothing.
pub(super) const RECHECK_EVERY: Duration = Duration::from_secs(3);

/// What a tenure key holds: the holder's line, and how long it may take to stop its command
/// once its lease is at risk (its kill grace and the kill margin). Written without a lease, so
/// that it outlives a lease that expires: then whoever finds it first binds it to a lease of
/// that length of its own ([`lapse`]), and nobody takes the lock until it is gone.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct TenureValue {
    pub(super) holder: String,
    pub(super) stop_budget_ms: u64,
    /// Once the holder's lease was found expired: who found it, and when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) lapsed: Option<String>,
}

impl TenureValue {
    pub(super) fn parse(kv: &KeyValue) -> Option<Self> {
        serde_json::from_slice(kv.value()).ok()
    }

    pub(super) fn stop_budget(&self) -> Duration {
        Duration::from_millis(self.stop_budget_ms)
    }
}

/// The lease a tenure key names (`tenure/<lease id>`).
fn tenure_lease(kv: &KeyValue) -> Option<i64> {
    let key = std::str::from_utf8(kv.key()).ok()?;
    let (_, id) = key.rsplit_once('/')?;
    i64::from_str_radix(id, 16).ok()
}

/// What a waiter's key holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct WaiterValue {
    pub(super) holder: Holder,
    pub(super) class: Class,
}

/// One lock's key directory, as read at one revision, with the lineage beside it.
pub(super) struct Snapshot {
    /// The lock's key directory.
    dir: String,
    pub(super) revision: i64,
    /// The cluster that answered.
    pub(super) cluster: u64,
    /// The owner key, when it is bound to a lease.
    pub(super) owner: Option<KeyValue>,
    /// Holders that have not ended yet (their tenure keys), in creation order.
    pub(super) tenures: Vec<KeyValue>,
    /// Waiters in service order: fast first, then by creation.
    pub(super) queue: Vec<(KeyValue, Option<WaiterValue>)>,
    /// Keys of the directory found without a lease: ignored.
    pub(super) junk: Vec<KeyValue>,
    pub(super) lineage: lineage::State,
    /// The settling key, while a new lineage settles.
    pub(super) settling: Option<KeyValue>,
}

/// The first thing between a claim and the lock.
pub(super) enum Obstacle<'s> {
    /// No valid lineage: a new one must begin.
    Lineage {
        why: &'s str,
        mod_revision: i64,
        floor: i64,
    },
    /// Held.
    Owner(&'s KeyValue),
    /// An owner or tenure key without a lease (or, for a tenure key, without a tenure record):
    /// removed, then claimed over.
    Junk(&'s KeyValue),
    /// A holder that lost its owner key and has not ended yet.
    Tenure(&'s KeyValue),
    /// A new lineage settles.
    Settling(&'s KeyValue),
    /// Another waiter is served first.
    Ahead(&'s KeyValue),
}

impl Obstacle<'_> {
    /// The key whose change may clear it, when waiting is the way past it.
    pub(super) fn watched(&self) -> Option<&[u8]> {
        match self {
            Self::Owner(kv) | Self::Tenure(kv) | Self::Settling(kv) | Self::Ahead(kv) => {
                Some(kv.key())
            }
            Self::Lineage { .. } | Self::Junk(_) => None,
        }
    }
}

impl Snapshot {
    /// Lock directory `dir` from its keys as read at `revision` from `cluster`, in creation
    /// order, beside the lineage record and the settling key as read with them.
    pub(super) fn of<'k>(
        dir: &str,
        (revision, cluster): (i64, u64),
        kvs: impl IntoIterator<Item = &'k KeyValue>,
        lineage: Option<&KeyValue>,
        settling: Option<&KeyValue>,
    ) -> Self {
        let owner_key = keys::owner_key(dir);
        let queue_prefix = keys::queue_prefix(dir);
        let tenure_prefix = keys::tenure_prefix(dir);
        let mut snap = Self {
            dir: dir.to_owned(),
            revision,
            cluster,
            owner: None,
            tenures: Vec::new(),
            queue: Vec::new(),
            junk: Vec::new(),
            lineage: lineage::State::of(lineage, cluster),
            settling: settling.filter(|kv| kv.lease() != 0).cloned(),
        };
        for kv in kvs {
            let key = kv.key();
            let ours = key == owner_key.as_bytes()
                || key.starts_with(queue_prefix.as_bytes())
                || key.starts_with(tenure_prefix.as_bytes());
            if !ours {
                continue;
            }
            let tenure = key.starts_with(tenure_prefix.as_bytes());
            if tenure && TenureValue::parse(kv).is_some() {
                // Bound to no lease while its holder lives, to one of its own once it lapsed.
                snap.tenures.push(kv.clone());
            } else if kv.lease() == 0 || tenure {
                snap.junk.push(kv.clone());
            } else if key == owner_key.as_bytes() {
                snap.owner = Some(kv.clone());
            } else {
                let value = serde_json::from_slice::<WaiterValue>(kv.value()).ok();
                snap.queue.push((kv.clone(), value));
            }
        }
        // Stable: within a class, creation order (the read's order) stands.
        snap.queue
            .sort_by_key(|(_, v)| v.as_ref().map_or(Class::Normal, |v| v.class));
        snap
    }

    /// Who holds the lock: the owner, else a holder that lost its key but has not ended.
    pub(super) fn holder(&self) -> Option<Holder> {
        if let Some(kv) = &self.owner {
            return Holder::parse(&String::from_utf8_lossy(kv.value()));
        }
        let tenure = TenureValue::parse(self.tenures.first()?)?;
        Holder::parse(&tenure.holder)
    }

    /// A junk owner or tenure key: it would fail a claim's transaction, so it goes first.
    fn junk_in_the_way(&self) -> Option<&KeyValue> {
        let owner = keys::owner_key(&self.dir);
        let tenure = keys::tenure_prefix(&self.dir);
        self.junk
            .iter()
            .find(|kv| kv.key() == owner.as_bytes() || kv.key().starts_with(tenure.as_bytes()))
    }

    /// What stands between `waiter` (or, without one, a claim from outside the line) and the
    /// lock; `None`: claim it now.
    pub(super) fn obstacle(&self, waiter: Option<&str>) -> Option<Obstacle<'_>> {
        let ahead = match waiter {
            Some(waiter) => self
                .queue
                .iter()
                .take_while(|(kv, _)| kv.key() != waiter.as_bytes())
                .last(),
            None => self.queue.first(),
        };
        if let Some((kv, _)) = ahead {
            return Some(Obstacle::Ahead(kv));
        }
        if let Some(kv) = &self.owner {
            return Some(Obstacle::Owner(kv));
        }
        if let Some(kv) = self.tenures.first() {
            return Some(Obstacle::Tenure(kv));
        }
        if let lineage::State::Ended {
            why,
            mod_revision,
            floor,
        } = &self.lineage
        {
            return Some(Obstacle::Lineage {
                why,
                mod_revision: *mod_revision,
                floor: *floor,
            });
        }
        if let Some(kv) = &self.settling {
            return Some(Obstacle::Settling(kv));
        }
        self.junk_in_the_way().map(Obstacle::Junk)
    }

    /// Whether the lock is held back for the lineage (one to begin, or settling), not by a
    /// holder.
    pub(super) fn settles(&self) -> bool {
        self.owner.is_none()
            && self.tenures.is_empty()
            && (self.settling.is_some() || self.lineage.valid().is_none())
    }
}

impl Shared {
    pub(super) fn snapshot(&self, dir: &str) -> Result<Snapshot, LockError> {
        self.block_on("read the lock", REQUEST_TIMEOUT, snapshot(&self.pool, dir))
    }
}

/// Read one lock's key directory, the lineage and the settling key, at one revision.
pub(super) async fn snapshot(pool: &Pool, dir: &str) -> Result<Snapshot, etcd_client::Error> {
    let txn = Txn::new().and_then([
        TxnOp::get(
            dir,
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Create, SortOrder::Ascend),
            ),
        ),
        TxnOp::get(keys::LINEAGE, None),
        TxnOp::get(keys::SETTLING, None),
    ]);
    let response = pool
        .call(|mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await?;
    let header = response
        .header()
        .map_or((0, 0), |h| (h.revision(), h.cluster_id()));
    let gets: Vec<_> = response
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get),
            _ => None,
        })
        .collect();
    let [dir_keys, lineage, settling] = gets.as_slice() else {
        return Err(etcd_client::Error::InvalidArgs(
            "a read of a lock directory answered without its three parts".to_owned(),
        ));
    };
    Ok(Snapshot::of(
        dir,
        header,
        dir_keys.kvs(),
        lineage.kvs().first(),
        settling.kvs().first(),
    ))
}

/// Remove `kv`, a key found without a lease, if it is still the one seen; whether it went.
pub(super) async fn remove_junk(pool: &Pool, kv: &KeyValue) -> Result<bool, etcd_client::Error> {
    let txn = Txn::new()
        .when([
            Compare::lease(kv.key(), CompareOp::Equal, 0),
            Compare::mod_revision(kv.key(), CompareOp::Equal, kv.mod_revision()),
        ])
        .and_then([TxnOp::delete(kv.key(), None)]);
    let response = pool
        .call(|mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await?;
    Ok(response.succeeded())
}

/// "ticket 41 (normal, pid 7 on host-b)".
pub(super) fn describe_waiter(kv: &KeyValue, value: Option<&WaiterValue>) -> String {
    match value {
        Some(v) => format!(
            "{} ({}, pid {} on {})",
            kv.create_revision(),
            v.class.as_str(),
            v.holder.pid,
            v.holder.host
        ),
        None => kv.create_revision().to_string(),
    }
}

/// A named lock's waiting line, as on one host: our ticket, the budget, our place in line.
pub(super) fn waiting_line(
    name: &crate::names::LockName,
    snap: &Snapshot,
    waiter: &str,
    ticket: i64,
    wait: &Wait<'_>,
) -> String {
    let budget = wait.until.map_or("no time limit".to_owned(), |until| {
        format!(
            "{:.1} s of budget left",
            until
                .saturating_duration_since(Instant::now())
                .as_secs_f64()
        )
    });
    let ahead = snap
        .queue
        .iter()
        .take_while(|(kv, _)| kv.key() != waiter.as_bytes())
        .count();
    let position = if ahead == 0 {
        "head of the queue, waiting for the holder".to_owned()
    } else {
        let head = snap
            .queue
            .first()
            .map_or("-".to_owned(), |(kv, v)| describe_waiter(kv, v.as_ref()));
        format!("{ahead} ticket(s) ahead, head is {head}")
    };
    format!(
        "== lock {name}: waiting as queue ticket {ticket} ({}), {budget}; {position} ==",
        wait.class.as_str()
    )
}

/// A claim that went through: the owner key's revision, the cluster, the lineage it is in.
#[derive(Debug, Clone, Copy)]
pub(super) struct Claimed {
    pub(super) revision: i64,
    pub(super) cluster: u64,
    pub(super) lineage: Lineage,
}

impl Claimed {
    /// The fencing token: above every earlier holder's, in this lineage and any before it.
    pub(super) fn token(&self) -> i64 {
        self.lineage.base.saturating_add(self.revision)
    }
}

/// Try to become the owner, as `waiter` (which must still be ours and is removed) or, without
/// one, from outside the line: in one transaction that requires the owner key absent, no
/// holder that has not ended, no settling lineage and `lineage` still the lineage. Writes the
/// owner key and our tenure key. `None`: something changed; read again.
pub(super) async fn claim(
    pool: &Pool,
    dir: &str,
    lineage: Lineage,
    waiter: Option<&str>,
    lease: i64,
    holder_line: &str,
    stop_budget: Duration,
) -> Result<Option<Claimed>, etcd_client::Error> {
    let owner = keys::owner_key(dir);
    let bound = || Some(PutOptions::new().with_lease(lease));
    let tenure = TenureValue {
        holder: holder_line.to_owned(),
        stop_budget_ms: u64::try_from(stop_budget.as_millis()).unwrap_or(u64::MAX),
        lapsed: None,
    };
    let tenure = serde_json::to_string(&tenure).expect("a tenure record always serialises");
    let mut when = vec![
        Compare::create_revision(owner.as_str(), CompareOp::Equal, 0),
        // No tenure key at all (a range compare holds for every key in it, and for an empty
        // range as for an absent key).
        Compare::create_revision(keys::tenure_prefix(dir), CompareOp::Equal, 0).with_prefix(),
        Compare::lease(keys::SETTLING, CompareOp::Equal, 0),
        Compare::mod_revision(keys::LINEAGE, CompareOp::Equal, lineage.mod_revision),
    ];
    let mut then = vec![
        TxnOp::put(owner.as_str(), holder_line, bound()),
        // Bound to no lease: it outlives ours if ours expires, and says how long we may take
        // to stop (see [`lapse`]).
        TxnOp::put(keys::tenure_key(dir, lease), tenure, None),
    ];
    if let Some(waiter) = waiter {
        when.push(Compare::lease(waiter, CompareOp::Equal, lease));
        then.push(TxnOp::delete(waiter, None));
    }
    let txn = Txn::new().when(when).and_then(then);
    let response = pool
        .call(|mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await?;
    Ok(response.succeeded().then(|| Claimed {
        revision: response.header().map_or(0, |h| h.revision()),
        cluster: response.header().map_or(0, |h| h.cluster_id()),
        lineage,
    }))
}

/// What a waiter (or a claim from outside the line) does about `obstacle` that is not waiting:
/// begin a lineage, remove a junk owner key. `Err` when etcd did not answer.
pub(super) async fn clear(
    pool: &Pool,
    snap: &Snapshot,
    obstacle: &Obstacle<'_>,
    ttl: Duration,
) -> Result<(), etcd_client::Error> {
    match obstacle {
        Obstacle::Lineage {
            why,
            mod_revision,
            floor,
        } => {
            if let Some(line) =
                lineage::begin(pool, snap.cluster, ttl, why, *mod_revision, *floor).await?
            {
                report::line(&line);
            }
        }
        Obstacle::Junk(kv) => {
            let removed = remove_junk(pool, kv).await?;
            if removed {
                report::line(&format!(
                    "== etcd: removed {}, a key without a lease or record (written by hand?): it \
                     held nobody's lock ==",
                    String::from_utf8_lossy(kv.key())
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

/// What a look at a tenure key found.
pub(super) enum Tenure {
    /// Its holder's lease lives: the holder is stopping its command, and removes the key when
    /// it has.
    Alive,
    /// Its holder's lease expired without a release (cut off, stalled or killed): the key was
    /// just bound to a lease of the holder's stop budget, or already was; nobody takes the lock
    /// until it is gone.
    Lapsed(TenureValue),
    /// It changed meanwhile: read again.
    Changed,
}

/// Look at tenure key `kv`: a key bound to no lease whose holder's lease is gone (etcd expired
/// it) is rebound to a lease of its own that lasts the holder's stop budget, from now: the
/// holder may have begun stopping its command no earlier than etcd could expire its lease, and
/// has that long to finish. `who` says who found it.
pub(super) async fn lapse(
    pool: &Pool,
    kv: &KeyValue,
    who: &str,
) -> Result<Tenure, etcd_client::Error> {
    let Some(value) = TenureValue::parse(kv) else {
        return Ok(Tenure::Changed);
    };
    if kv.lease() != 0 {
        return Ok(Tenure::Lapsed(value));
    }
    if let Some(id) = tenure_lease(kv) {
        let alive = pool
            .call(|mut c| async move { c.lease_time_to_live(id, None).await })
            .await?;
        if alive.ttl() > 0 {
            return Ok(Tenure::Alive);
        }
    }
    let budget = value.stop_budget();
    let ttl = budget.as_secs() + u64::from(budget.subsec_nanos() > 0);
    let ttl = i64::try_from(ttl.max(1)).unwrap_or(i64::MAX);
    let grant = pool
        .call(|mut c| async move { c.lease_grant(ttl, None).await })
        .await?;
    let lapsed = TenureValue {
        lapsed: Some(format!(
            "found expired by {who} at {}",
            humantime::format_rfc3339_millis(std::time::SystemTime::now())
        )),
        ..value.clone()
    };
    let line = serde_json::to_string(&lapsed).expect("a tenure record always serialises");
    let txn = Txn::new()
        .when([
            Compare::mod_revision(kv.key(), CompareOp::Equal, kv.mod_revision()),
            Compare::lease(kv.key(), CompareOp::Equal, 0),
        ])
        .and_then([TxnOp::put(
            kv.key(),
            line,
            Some(PutOptions::new().with_lease(grant.id())),
        )]);
    let response = pool
        .call(|mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await?;
    Ok(if response.succeeded() {
        Tenure::Lapsed(lapsed)
    } else {
        Tenure::Changed
    })
}

/// The line a waiter says once about a holder that lost its lease without a release.
pub(super) fn lapsed_line(label: &str, value: &TenureValue) -> String {
    let holder = Holder::parse(&value.holder);
    format!(
        "== {label}: its last holder, {}, lost its lease without releasing the lock (cut off, \
         stalled or killed): its command may still be stopping, so the lock is taken only \
         once its stop budget of {:.1} s has passed ==",
        Holder::describe(holder.as_ref()),
        value.stop_budget().as_secs_f64()
    )
}

/// How a waiter waits for its turn.
pub(super) struct Turn {
    pub(super) dir: String,
    pub(super) waiter: String,
    pub(super) lease: i64,
    pub(super) holder_line: String,
    /// When a normal waiter joins the fast class, and its key's value then.
    pub(super) promote: Option<(tokio::time::Instant, String)>,
    /// The lease TTL: how long a lineage that begins here settles.
    pub(super) ttl: Duration,
    /// The lock, as messages name it.
    pub(super) label: String,
    /// How long our holder may take to stop its command, for our tenure record.
    pub(super) stop_budget: Duration,
    /// Who we are, for the record of a lapsed tenure we find.
    pub(super) who: String,
}

/// Wait in line for the lock, as waiter key `turn.waiter` (already written), until we own it.
pub(super) async fn wait_turn(pool: Arc<Pool>, mut turn: Turn) -> Result<Claimed, String> {
    let waiter = turn.waiter.clone();
    // The holder that lost its key we last said we wait for.
    let mut told: Option<(Vec<u8>, bool)> = None;
    loop {
        let snap = match snapshot(&pool, &turn.dir).await {
            Ok(snap) => snap,
            Err(_) => {
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
        };
        if let Some(owner) = snap.owner.as_ref().filter(|o| o.lease() == turn.lease) {
            // Our claim went through though its answer was lost (a member died meanwhile).
            return match snap.lineage.valid() {
                Some(lineage) if lineage.mod_revision < owner.create_revision() => Ok(Claimed {
                    revision: owner.create_revision(),
                    cluster: snap.cluster,
                    lineage,
                }),
                _ => Err("the lock lineage changed as we took the lock".to_owned()),
            };
        }
        if !snap
            .queue
            .iter()
            .any(|(kv, _)| kv.key() == waiter.as_bytes())
        {
            return Err("our place in the queue is gone (the lease expired)".to_owned());
        }
        let obstacle = snap.obstacle(Some(&waiter));
        let watched = match &obstacle {
            None => {
                let lineage = snap.lineage.valid().expect("no obstacle: a valid lineage");
                let claimed = claim(
                    &pool,
                    &turn.dir,
                    lineage,
                    Some(&waiter),
                    turn.lease,
                    &turn.holder_line,
                    turn.stop_budget,
                )
                .await;
                match claimed {
                    Ok(Some(claimed)) => return Ok(claimed),
                    Ok(None) => {}
                    Err(_) => tokio::time::sleep(RETRY_PAUSE).await,
                }
                continue;
            }
            Some(Obstacle::Tenure(kv)) if kv.lease() == 0 => {
                match lapse(&pool, kv, &turn.who).await {
                    Ok(Tenure::Alive) => kv.key().to_vec(),
                    Ok(_) => continue,
                    Err(_) => {
                        tokio::time::sleep(RETRY_PAUSE).await;
                        continue;
                    }
                }
            }
            Some(obstacle) => match obstacle.watched() {
                Some(key) => key.to_vec(),
                None => {
                    if clear(&pool, &snap, obstacle, turn.ttl).await.is_err() {
                        tokio::time::sleep(RETRY_PAUSE).await;
                    }
                    continue;
                }
            },
        };
        if let Some(Obstacle::Tenure(kv)) = &obstacle {
            let lapsed = kv.lease() != 0;
            if told.as_ref() != Some(&(kv.key().to_vec(), lapsed)) {
                told = Some((kv.key().to_vec(), lapsed));
                let value = TenureValue::parse(kv);
                match value {
                    Some(value) if lapsed => {
                        report::line(&lapsed_line(&turn.label, &value));
                    }
                    _ => {
                        let holder = value.and_then(|v| Holder::parse(&v.holder));
                        report::line(&format!(
                            "== {}: its last holder, {}, lost the lock but has not ended yet; \
                             waiting until it has ==",
                            turn.label,
                            Holder::describe(holder.as_ref())
                        ));
                    }
                }
            }
        }
        // Wait for the one change that can make us the owner: the head waits for what stands
        // in its way (the owner key, a holder that has not ended, a settling lineage), anyone
        // else for the waiter just ahead of it (so a handoff wakes two waiters, not the whole
        // line). A newcomer that goes ahead of us only delays us: no need to wake.
        let options = WatchOptions::new().with_start_revision(snap.revision + 1);
        let (at, mut client) = pool.current();
        let mut watch = match client.watch(watched, Some(options)).await {
            Ok(watch) => watch,
            Err(_) => {
                pool.fail_over(at);
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
        };
        // A watch on a member that stops answering says nothing at all: read the queue again
        // now and then whatever the watch says (through a member that answers).
        let recheck = tokio::time::sleep(RECHECK_EVERY);
        tokio::pin!(recheck);
        loop {
            let promote_at = turn.promote.as_ref().map(|(at, _)| *at);
            tokio::select! {
                answer = watch.message() => match answer {
                    Ok(Some(resp)) if resp.events().is_empty() && !resp.canceled() => {}
                    Ok(Some(_)) => break,
                    Ok(None) | Err(_) => {
                        pool.fail_over(at);
                        tokio::time::sleep(RETRY_PAUSE).await;
                        break;
                    }
                },
                () = &mut recheck => break,
                () = async {
                    match promote_at {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {
                    let (_, fast_line) = turn.promote.take().expect("only armed while set");
                    // Keeps its creation revision: a promoted waiter keeps its place.
                    let lease = turn.lease;
                    let _ = pool
                        .call(|mut c| {
                            let line = fast_line.clone();
                            let waiter = waiter.clone();
                            let options = PutOptions::new().with_lease(lease);
                            async move { c.put(waiter, line, Some(options)).await }
                        })
                        .await;
                    break;
                }
            }
        }
    }
}

/// A wait in line under way on the runtime, for the signal funnel to wait on.
pub(super) struct PendingTake {
    pub(super) shared: Arc<Shared>,
    pub(super) dir: String,
    pub(super) waiter: String,
    pub(super) lease: i64,
    pub(super) ready: UnixStream,
    pub(super) outcome: mpsc::Receiver<Result<Claimed, String>>,
    pub(super) task: tokio::task::JoinHandle<()>,
}

impl Awaitable for PendingTake {
    type Output = Result<Claimed, String>;

    fn ready_fd(&self) -> BorrowedFd<'_> {
        self.ready.as_fd()
    }

    fn try_finish(&mut self) -> Option<Self::Output> {
        self.outcome.try_recv().ok()
    }

    fn cancel(self) {
        self.task.abort();
        // Leave the line, and let go of the lock if it was got meanwhile (no command of ours
        // ever ran under it, so our tenure ends too).
        let owner = keys::owner_key(&self.dir);
        let txn = Txn::new()
            .when([Compare::lease(owner.as_str(), CompareOp::Equal, self.lease)])
            .and_then([TxnOp::delete(owner.as_str(), None)]);
        let leave = Txn::new().and_then([
            TxnOp::delete(self.waiter.as_str(), None),
            TxnOp::delete(keys::tenure_key(&self.dir, self.lease), None),
        ]);
        let result = self
            .shared
            .txn("let go of the lock", RELEASE_TIMEOUT, txn)
            .and_then(|_| self.shared.txn("leave the queue", RELEASE_TIMEOUT, leave));
        if let Err(err) = result {
            tracing::debug!("{err}; the lease takes our keys with it");
        }
    }
}

impl Etcd {
    /// Join the line for `dir` as `holder`, and claim the lock at once if nothing stands in the
    /// way.
    pub(super) fn enqueue(
        &self,
        session: &Session,
        dir: &str,
        value: &WaiterValue,
    ) -> Result<(String, Option<Claimed>, Snapshot), LockError> {
        let waiter = keys::queue_key(dir, session.id);
        let line = serde_json::to_string(value).expect("a waiter always serialises");
        let holder_line = value.holder.to_line();
        let id = session.id;
        let stop_budget = self.shared.stop_budget();
        let pool = &self.shared.pool;
        let (claimed, snap) = self.shared.block_on("join the queue", REQUEST_TIMEOUT, {
            let (dir, waiter) = (dir.to_owned(), waiter.clone());
            async move {
                pool.call(|mut c| {
                    let (waiter, line) = (waiter.clone(), line.clone());
                    async move {
                        let options = PutOptions::new().with_lease(id);
                        c.put(waiter, line, Some(options)).await
                    }
                })
                .await?;
                let snap = snapshot(pool, &dir).await?;
                if let (None, Some(lineage)) = (snap.obstacle(Some(&waiter)), snap.lineage.valid())
                {
                    let claimed = claim(
                        pool,
                        &dir,
                        lineage,
                        Some(&waiter),
                        id,
                        &holder_line,
                        stop_budget,
                    );
                    if let Some(claimed) = claimed.await? {
                        return Ok((Some(claimed), snap));
                    }
                }
                Ok((None, snap))
            }
        })?;
        Ok((waiter, claimed, snap))
    }

    /// Why a wait for `dir` timed out: where we were in line (`ticket`, the revision that
    /// created our waiter key), who is ahead, who holds it.
    pub(super) fn timed_out_detail(
        &self,
        key: LockKey<'_>,
        dir: &str,
        ticket: i64,
        class: Class,
    ) -> String {
        let Ok(snap) = self.shared.snapshot(dir) else {
            return "etcd did not answer".to_owned();
        };
        let held_by = if snap.settles() {
            "nobody: a new etcd lock lineage is settling".to_owned()
        } else {
            Holder::describe(snap.holder().as_ref())
        };
        match key {
            LockKey::App(_) => format!("held by {held_by}"),
            LockKey::Named(_) => {
                let head = snap.queue.first().map_or_else(
                    || "(no other ticket queued)".to_owned(),
                    |(kv, v)| format!("head of queue is {}", describe_waiter(kv, v.as_ref())),
                );
                format!(
                    "as queue ticket {ticket} ({}); {head}; held by {held_by}",
                    class.as_str()
                )
            }
        }
    }
}
