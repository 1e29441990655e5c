//! The line in front of an etcd lock: a lock directory read at one revision ([`Snapshot`]),
//! joining the line, the head's claim, and the wait on the runtime for our turn
//! ([`wait_turn`], watched by the signal funnel through [`PendingTake`]).

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    WatchOptions,
};
use serde::{Deserialize, Serialize};

use super::Etcd;
use super::client::{Pool, RELEASE_TIMEOUT, REQUEST_TIMEOUT, RETRY_PAUSE, Shared};
use super::lease::Session;
use crate::lock::backend::{LockKey, Wait};
use crate::lock::queue::Class;
use crate::lock::{Holder, LockError};
use crate::names::etcd as keys;
use crate::supervise::worker::Awaitable;

/// How often a waiter reads its queue again even though its watch said nothing.
pub(super) const RECHECK_EVERY: Duration = Duration::from_secs(3);

/// What a waiter's key holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct WaiterValue {
    pub(super) holder: Holder,
    pub(super) class: Class,
}

/// One lock's key directory, as read at one revision.
pub(super) struct Snapshot {
    pub(super) revision: i64,
    pub(super) owner: Option<KeyValue>,
    /// Waiters in service order: fast first, then by creation.
    pub(super) queue: Vec<(KeyValue, Option<WaiterValue>)>,
}

impl Snapshot {
    /// Lock directory `dir` from its keys as read at `revision`, in creation order.
    pub(super) fn of<'k>(
        dir: &str,
        revision: i64,
        kvs: impl IntoIterator<Item = &'k KeyValue>,
    ) -> Self {
        let owner_key = keys::owner_key(dir);
        let queue_prefix = keys::queue_prefix(dir);
        let mut owner = None;
        let mut queue = Vec::new();
        for kv in kvs {
            if kv.key() == owner_key.as_bytes() {
                owner = Some(kv.clone());
            } else if kv.key().starts_with(queue_prefix.as_bytes()) {
                let value = serde_json::from_slice::<WaiterValue>(kv.value()).ok();
                queue.push((kv.clone(), value));
            }
        }
        // Stable: within a class, creation order (the read's order) stands.
        queue.sort_by_key(|(_, v)| v.as_ref().map_or(Class::Normal, |v| v.class));
        Self {
            revision,
            owner,
            queue,
        }
    }

    pub(super) fn holder(&self) -> Option<Holder> {
        let owner = self.owner.as_ref()?;
        Holder::parse(&String::from_utf8_lossy(owner.value()))
    }

    pub(super) fn head_is(&self, key: &str) -> bool {
        self.queue
            .first()
            .is_some_and(|(kv, _)| kv.key() == key.as_bytes())
    }
}

impl Shared {
    pub(super) fn snapshot(&self, dir: &str) -> Result<Snapshot, LockError> {
        self.block_on("read the lock", REQUEST_TIMEOUT, snapshot(&self.pool, dir))
    }
}

/// Read one lock's key directory at one revision.
pub(super) async fn snapshot(pool: &Pool, dir: &str) -> Result<Snapshot, etcd_client::Error> {
    let response = pool
        .call(|mut c| async move {
            let options = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend);
            c.get(dir, Some(options)).await
        })
        .await?;
    let revision = response.header().map_or(0, |h| h.revision());
    Ok(Snapshot::of(dir, revision, response.kvs()))
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

/// Try to become the owner as the head waiter: the owner key must be absent and our waiter
/// key still ours. Returns the fencing token when we are the owner now.
pub(super) async fn claim(
    pool: &Pool,
    dir: &str,
    waiter: &str,
    lease: i64,
    holder_line: &str,
) -> Result<Option<i64>, etcd_client::Error> {
    let owner = keys::owner_key(dir);
    let txn = Txn::new()
        .when([
            Compare::create_revision(owner.as_str(), CompareOp::Equal, 0),
            Compare::lease(waiter, CompareOp::Equal, lease),
        ])
        .and_then([
            TxnOp::put(
                owner.as_str(),
                holder_line,
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::delete(waiter, None),
        ]);
    let response = pool
        .call(|mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await?;
    Ok(response
        .succeeded()
        .then(|| response.header().map_or(0, |h| h.revision())))
}

/// Wait in line for the lock whose directory is `dir`, as waiter key `waiter` (already
/// written), until we own it. A normal waiter joins the fast class at `promote_at`.
pub(super) async fn wait_turn(
    pool: Arc<Pool>,
    dir: String,
    waiter: String,
    lease: i64,
    holder_line: String,
    mut promote: Option<(tokio::time::Instant, String)>,
) -> Result<i64, String> {
    loop {
        let snap = match snapshot(&pool, &dir).await {
            Ok(snap) => snap,
            Err(_) => {
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
        };
        if let Some(owner) = snap.owner.as_ref().filter(|o| o.lease() == lease) {
            // Our claim went through though its answer was lost (a member died meanwhile).
            return Ok(owner.create_revision());
        }
        if !snap
            .queue
            .iter()
            .any(|(kv, _)| kv.key() == waiter.as_bytes())
        {
            return Err("our place in the queue is gone (the lease expired)".to_owned());
        }
        if snap.owner.is_none() && snap.head_is(&waiter) {
            match claim(&pool, &dir, &waiter, lease, &holder_line).await {
                Ok(Some(token)) => return Ok(token),
                Ok(None) => continue,
                Err(_) => {
                    tokio::time::sleep(RETRY_PAUSE).await;
                    continue;
                }
            }
        }
        // Wait for the one change that can make us the owner: the head waits for the owner key,
        // anyone else for the waiter just ahead of it (so a handoff wakes two waiters, not the
        // whole line). A newcomer that goes ahead of us only delays us: no need to wake.
        let ahead = snap
            .queue
            .iter()
            .take_while(|(kv, _)| kv.key() != waiter.as_bytes())
            .last()
            .map(|(kv, _)| kv.key().to_vec());
        let watched = ahead.unwrap_or_else(|| keys::owner_key(&dir).into_bytes());
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
            let promote_at = promote.as_ref().map(|(at, _)| *at);
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
                    let (_, fast_line) = promote.take().expect("only armed while set");
                    // Keeps its creation revision: a promoted waiter keeps its place.
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
    pub(super) outcome: mpsc::Receiver<Result<i64, String>>,
    pub(super) task: tokio::task::JoinHandle<()>,
}

impl Awaitable for PendingTake {
    type Output = Result<i64, String>;

    fn ready_fd(&self) -> BorrowedFd<'_> {
        self.ready.as_fd()
    }

    fn try_finish(&mut self) -> Option<Self::Output> {
        self.outcome.try_recv().ok()
    }

    fn cancel(self) {
        self.task.abort();
        // Leave the line, and let go of the lock if it was got meanwhile.
        let owner = keys::owner_key(&self.dir);
        let txn = Txn::new()
            .when([Compare::lease(owner.as_str(), CompareOp::Equal, self.lease)])
            .and_then([TxnOp::delete(owner.as_str(), None)]);
        let leave = Txn::new().and_then([TxnOp::delete(self.waiter.as_str(), None)]);
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
    /// Join the line for `dir` as `holder`, and try once.
    pub(super) fn enqueue(
        &self,
        session: &Session,
        dir: &str,
        value: &WaiterValue,
    ) -> Result<(String, Option<i64>, Snapshot), LockError> {
        let waiter = keys::queue_key(dir, session.id);
        let line = serde_json::to_string(value).expect("a waiter always serialises");
        let holder_line = value.holder.to_line();
        let id = session.id;
        let pool = &self.shared.pool;
        let (token, snap) = self.shared.block_on("join the queue", REQUEST_TIMEOUT, {
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
                if snap.owner.is_none() && snap.head_is(&waiter) {
                    if let Some(token) = claim(pool, &dir, &waiter, id, &holder_line).await? {
                        return Ok((Some(token), snap));
                    }
                }
                Ok((None, snap))
            }
        })?;
        Ok((waiter, token, snap))
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
        let held_by = Holder::describe(snap.holder().as_ref());
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
