//! The wait for our turn, on the runtime: watching what stands in the way, promotion, the
//! claim when it is our turn; and how the signal funnel awaits it ([`PendingTake`]).

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, WatchOptions};

use crate::config::Class;
use crate::lock::backend::LockKey;
use crate::lock::etcd::client::Session;
use crate::lock::etcd::client::{Pool, RELEASE_TIMEOUT, REQUEST_TIMEOUT, RETRY_PAUSE, Shared};
use crate::lock::etcd::queue::claim::{
    Claimed, Tenure, claim, clear, end_tenure, lapse, lapsed_line, proven_line,
};
use crate::lock::etcd::queue::look::LeaseWatch;
use crate::lock::etcd::queue::snapshot::{
    Obstacle, RECHECK_EVERY, Snapshot, TenureValue, WaiterValue, describe_waiter, read_snapshot,
    snapshot, tenure_lease,
};
use crate::lock::file::LockError;
use crate::lock::holder::Holder;
use crate::names::etcd as keys;
use crate::report;
use crate::supervise::worker::Awaitable;

/// How a waiter waits for its turn.
pub(in crate::lock::etcd) struct Turn {
    pub(in crate::lock::etcd) dir: String,
    pub(in crate::lock::etcd) waiter: String,
    pub(in crate::lock::etcd) lease: i64,
    pub(in crate::lock::etcd) holder_line: String,
    /// Our waiter key's value, as written (again, if the key goes).
    pub(in crate::lock::etcd) waiter_line: String,
    /// When a normal waiter joins the fast class, and its key's value then.
    pub(in crate::lock::etcd) promote: Option<(tokio::time::Instant, String)>,
    /// The lease TTL: how long a lineage that begins here settles.
    pub(in crate::lock::etcd) ttl: Duration,
    /// The lock, as messages name it.
    pub(in crate::lock::etcd) label: String,
    /// How long our holder may take to stop its command, for our tenure record.
    pub(in crate::lock::etcd) stop_budget: Duration,
    /// Who we are, for the record of a lapsed tenure we find.
    pub(in crate::lock::etcd) who: String,
    /// Our lease's earliest expiry, by our clock ([`Session::expiry`]).
    pub(in crate::lock::etcd) expiry: tokio::sync::watch::Receiver<tokio::time::Instant>,
}

/// Wait in line for the lock, as waiter key `turn.waiter` (already written), until we own it.
pub(in crate::lock::etcd) async fn wait_turn(
    pool: Arc<Pool>,
    mut turn: Turn,
) -> Result<Claimed, String> {
    let waiter = turn.waiter.clone();
    // The holder that lost its key we last said we wait for.
    let mut told: Option<(Vec<u8>, bool)> = None;
    // The head's looks at its holder's lease ([`LeaseWatch`]).
    let mut looking: Option<LeaseWatch> = None;
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
                // Or the last holder handed it to us ([`super::hand_over`]): the revision
                // that last wrote the owner key is ours either way.
                Some(lineage) if lineage.mod_revision < owner.mod_revision() => Ok(Claimed {
                    revision: owner.mod_revision(),
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
            // Our key went while our lease lives (a lock's keys or the whole prefix deleted by
            // hand): queue again, at the back. Only a lease that is gone ends the wait.
            let (lease, line) = (turn.lease, turn.waiter_line.clone());
            let put = pool
                .call(|mut c| {
                    let (waiter, line) = (waiter.clone(), line.clone());
                    async move {
                        c.put(waiter, line, Some(PutOptions::new().with_lease(lease)))
                            .await
                    }
                })
                .await;
            match put {
                Ok(_) => report::line(&format!(
                    "== {}: our place in its queue was removed (by hand?) while our lease lives: \
                     queueing again ==",
                    turn.label
                )),
                // NOT_FOUND: etcd knows our lease no more.
                Err(etcd_client::Error::GRpcStatus(status)) if i32::from(status.code()) == 5 => {
                    return Err("our place in the queue is gone with our lease".to_owned());
                }
                Err(_) => tokio::time::sleep(RETRY_PAUSE).await,
            }
            continue;
        }
        let obstacle = snap.obstacle(Some(&waiter));
        // Whose lease the head looks at: the holder's that stands in its way, while it lives.
        let holder_lease = match &obstacle {
            Some(Obstacle::Owner(kv)) => Some(kv.lease()),
            Some(Obstacle::Tenure(kv)) => tenure_lease(kv),
            _ => None,
        };
        if holder_lease != looking.as_ref().map(|l| l.lease) {
            looking = holder_lease.and_then(|lease| {
                let tenure = snap.tenure_of(lease)?;
                LeaseWatch::new(lease, tenure.stop_budget())
            });
        }
        let proof = looking.as_ref().and_then(|l| l.proof);
        let watched = match &obstacle {
            Some(Obstacle::Tenure(kv)) if proof.is_some() => {
                // A look proved the holder's command gone by then: its tenure ends there,
                // whatever ended its lease.
                let proof = proof.expect("just checked");
                if told.as_ref().map(|(key, _)| key) != Some(&kv.key().to_vec()) {
                    told = Some((kv.key().to_vec(), true));
                    report::line(&proven_line(&turn.label, kv, &proof));
                }
                tokio::time::sleep_until(proof.gone_by).await;
                if end_tenure(&pool, kv).await.is_err() {
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                continue;
            }
            None => {
                let claimed = claim(
                    &pool,
                    &turn.dir,
                    &snap,
                    false,
                    Some(&waiter),
                    turn.lease,
                    &turn.holder_line,
                    turn.ttl,
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
                match lapse(&pool, kv, &turn.who, turn.ttl).await {
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
                        report::line(&lapsed_line(&turn.label, &value, turn.ttl));
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
            let look_at = looking.as_ref().and_then(LeaseWatch::due);
            tokio::select! {
                () = async {
                    match look_at {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {
                    let watch = looking.as_mut().expect("only armed while set");
                    if !watch.look(&pool).await || watch.proof.is_some() {
                        break;
                    }
                }
                answer = watch.message() => match answer {
                    Ok(Some(resp)) if resp.events().is_empty() && !resp.canceled() => {}
                    Ok(Some(resp)) => {
                        if let Some(claimed) = handed(&resp, &turn, &snap, &waiter) {
                            return Ok(claimed);
                        }
                        // The head saw the owner key go, and nothing else stood in its way:
                        // claim at once. The claim requires all it would have read unchanged
                        // (and nobody queued since); if anything did change, read again.
                        let owner = keys::owner_key(&turn.dir);
                        let owner_went = resp.events().iter().any(|e| {
                            e.event_type() == etcd_client::EventType::Delete
                                && e.kv().is_some_and(|kv| kv.key() == owner.as_bytes())
                        });
                        if owner_went && snap.only_owner_in_the_way(&waiter) {
                            let claimed = claim(
                                &pool,
                                &turn.dir,
                                &snap,
                                true,
                                Some(&waiter),
                                turn.lease,
                                &turn.holder_line,
                                turn.ttl,
                                turn.stop_budget,
                            )
                            .await;
                            if let Ok(Some(claimed)) = claimed {
                                return Ok(claimed);
                            }
                        }
                        break;
                    }
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
                    turn.waiter_line = fast_line.clone();
                    // Keeps its creation revision: a promoted waiter keeps its place. Only our
                    // key as read is rewritten: one that went meanwhile (a handover to us
                    // removes it) is not written again.
                    let lease = turn.lease;
                    let ticket = snap
                        .queue
                        .iter()
                        .find(|(kv, _)| kv.key() == waiter.as_bytes())
                        .map_or(0, |(kv, _)| kv.create_revision());
                    let promote = Txn::new()
                        .when([
                            Compare::create_revision(waiter.as_str(), CompareOp::Equal, ticket),
                            Compare::lease(waiter.as_str(), CompareOp::Equal, lease),
                        ])
                        .and_then([TxnOp::put(
                            waiter.as_str(),
                            fast_line,
                            Some(PutOptions::new().with_lease(lease)),
                        )]);
                    if ticket != 0 {
                        let _ = pool
                            .txn(&promote)
                            .await;
                    }
                    break;
                }
            }
        }
    }
}

/// Whether `resp`, the first answer of the head's watch on the owner key since `snap` (which
/// found the owner key all that stood in the way), is the last holder handing the lock to us
/// ([`super::hand_over`]): its one event writes the owner key bound to our lease. The lineage
/// is then the one `snap` read: the handover required the record unchanged since the last
/// holder's claim, which was before `snap` (the owner key did not change between them).
///
/// Only while our lease is safe by our own clock (more than our stop budget left before its
/// earliest expiry): an event is as old as the time it waited for us (a waiter stopped, or
/// starved, while the lock was handed to it), and by then etcd may have expired our lease and
/// given the lock to the next. A handover seen later is read again, which finds the owner key
/// still ours or not.
fn handed(
    resp: &etcd_client::WatchResponse,
    turn: &Turn,
    snap: &Snapshot,
    waiter: &str,
) -> Option<Claimed> {
    let [event] = resp.events() else {
        return None;
    };
    let kv = event.kv()?;
    let owner = keys::owner_key(&turn.dir);
    let cluster = resp.header().map_or(0, |h| h.cluster_id());
    let lineage = snap.lineage.valid()?;
    let safe = tokio::time::Instant::now()
        .checked_add(turn.stop_budget)
        .is_some_and(|at| at < *turn.expiry.borrow());
    (safe
        && event.event_type() == etcd_client::EventType::Put
        && kv.key() == owner.as_bytes()
        && kv.lease() == turn.lease
        && cluster == snap.cluster
        && lineage.mod_revision < kv.mod_revision()
        && snap.only_owner_in_the_way(waiter))
    .then(|| Claimed {
        revision: kv.mod_revision(),
        cluster,
        lineage,
    })
}

/// A wait in line under way on the runtime, for the signal funnel to wait on.
pub(in crate::lock::etcd) struct PendingTake {
    pub(in crate::lock::etcd) shared: Arc<Shared>,
    pub(in crate::lock::etcd) dir: String,
    pub(in crate::lock::etcd) waiter: String,
    pub(in crate::lock::etcd) lease: i64,
    pub(in crate::lock::etcd) ready: UnixStream,
    pub(in crate::lock::etcd) outcome: mpsc::Receiver<Result<Claimed, String>>,
    pub(in crate::lock::etcd) task: tokio::task::JoinHandle<()>,
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
        // One transaction: a handover to us between two would leave the owner key ours.
        let owner = keys::owner_key(&self.dir);
        let leave = || {
            [
                TxnOp::delete(self.waiter.as_str(), None),
                TxnOp::delete(keys::tenure_key(&self.dir, self.lease), None),
            ]
        };
        let txn = Txn::new()
            .when([Compare::lease(owner.as_str(), CompareOp::Equal, self.lease)])
            .and_then([vec![TxnOp::delete(owner.as_str(), None)], leave().to_vec()].concat())
            .or_else(leave());
        let result = self.shared.txn(
            "let go of the lock and leave the queue",
            RELEASE_TIMEOUT,
            txn,
        );
        if let Err(err) = result {
            tracing::debug!("{err}; the lease takes our keys with it");
        }
    }
}

/// Join the line for `dir` as `holder`, and claim the lock at once if nothing stands in the
/// way.
pub(in crate::lock::etcd) fn enqueue(
    shared: &Shared,
    session: &Session,
    dir: &str,
    value: &WaiterValue,
) -> Result<(String, Option<Claimed>, Snapshot), LockError> {
    let waiter = keys::queue_key(dir, session.id);
    let line = serde_json::to_string(value).expect("a waiter always serialises");
    let holder_line = value.holder.to_line();
    let id = session.id;
    let stop_budget = shared.stop_budget();
    let ttl = shared.ttl;
    let pool = &shared.pool;
    let (claimed, snap) = shared.block_on("join the queue", REQUEST_TIMEOUT, {
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
            if let (None, Some(_)) = (snap.obstacle(Some(&waiter)), snap.lineage.valid()) {
                let claimed = claim(
                    pool,
                    &dir,
                    &snap,
                    false,
                    Some(&waiter),
                    id,
                    &holder_line,
                    ttl,
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
pub(in crate::lock::etcd) fn timed_out_detail(
    shared: &Shared,
    key: LockKey<'_>,
    dir: &str,
    ticket: i64,
    class: Class,
) -> String {
    let Ok(snap) = read_snapshot(shared, dir) else {
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
