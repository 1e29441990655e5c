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
use crate::lock::backend::{LockKey, Wait};
use crate::lock::queue::Class;
use crate::lock::{Holder, LockError};
use crate::names::etcd as keys;
use crate::report;
use crate::supervise::worker::Awaitable;

/// How often a waiter reads its queue again even though its watch said nothing.
pub(super) const RECHECK_EVERY: Duration = Duration::from_secs(3);

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
    /// An owner key without a lease: removed, then claimed over.
    JunkOwner(&'s KeyValue),
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
            Self::Lineage { .. } | Self::JunkOwner(_) => None,
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
            if kv.lease() == 0 {
                snap.junk.push(kv.clone());
            } else if key == owner_key.as_bytes() {
                snap.owner = Some(kv.clone());
            } else if key.starts_with(tenure_prefix.as_bytes()) {
                snap.tenures.push(kv.clone());
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
        let kv = self.owner.as_ref().or_else(|| self.tenures.first())?;
        Holder::parse(&String::from_utf8_lossy(kv.value()))
    }

    /// The owner key, when it is junk.
    fn junk_owner(&self) -> Option<&KeyValue> {
        let owner = keys::owner_key(&self.dir);
        self.junk.iter().find(|kv| kv.key() == owner.as_bytes())
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
        self.junk_owner().map(Obstacle::JunkOwner)
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
) -> Result<Option<Claimed>, etcd_client::Error> {
    let owner = keys::owner_key(dir);
    let bound = || Some(PutOptions::new().with_lease(lease));
    let mut when = vec![
        Compare::create_revision(owner.as_str(), CompareOp::Equal, 0),
        // Every tenure key, if any, is junk (a range compare holds for every key in it, and
        // for an empty range as for an absent key).
        Compare::lease(keys::tenure_prefix(dir), CompareOp::Equal, 0).with_prefix(),
        Compare::lease(keys::SETTLING, CompareOp::Equal, 0),
        Compare::mod_revision(keys::LINEAGE, CompareOp::Equal, lineage.mod_revision),
    ];
    let mut then = vec![
        TxnOp::put(owner.as_str(), holder_line, bound()),
        TxnOp::put(keys::tenure_key(dir, lease), holder_line, bound()),
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
        Obstacle::JunkOwner(kv) => {
            let removed = remove_junk(pool, kv).await?;
            if removed {
                report::line(&format!(
                    "== etcd: removed {}, an owner key without a lease (written by hand?): it \
                     held nobody's lock ==",
                    String::from_utf8_lossy(kv.key())
                ));
            }
        }
        _ => {}
    }
    Ok(())
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
}

/// Wait in line for the lock, as waiter key `turn.waiter` (already written), until we own it.
pub(super) async fn wait_turn(pool: Arc<Pool>, mut turn: Turn) -> Result<Claimed, String> {
    let waiter = turn.waiter.clone();
    // The holder that lost its key we last said we wait for.
    let mut told: Option<Vec<u8>> = None;
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
                )
                .await;
                match claimed {
                    Ok(Some(claimed)) => return Ok(claimed),
                    Ok(None) => {}
                    Err(_) => tokio::time::sleep(RETRY_PAUSE).await,
                }
                continue;
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
            if told.as_deref() != Some(kv.key()) {
                told = Some(kv.key().to_vec());
                let holder = Holder::parse(&String::from_utf8_lossy(kv.value()));
                report::line(&format!(
                    "== {}: its last holder, {}, lost the lock but has not ended yet; waiting \
                     until it has ==",
                    turn.label,
                    Holder::describe(holder.as_ref())
                ));
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
                    let claimed = claim(pool, &dir, lineage, Some(&waiter), id, &holder_line);
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
