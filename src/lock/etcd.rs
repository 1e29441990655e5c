//! Locks beyond one host: etcd keeps them, as keys bound to leases (`--etcd-endpoints`).
//!
//! A lease is etcd's answer to "the kernel releases a flock when its holder dies": every key a
//! process writes is bound to the one lease it keeps alive, so when the process dies (or is cut
//! off from etcd for the lease's TTL) its keys vanish and its locks are free. Each lock is a key
//! directory (see [`crate::names::etcd`]):
//!
//! - `queue/<lease>`: a waiter. Waiters are served fast class first, then by the revision that
//!   created their key (FIFO across the fleet); a normal waiter that waited past
//!   `--promote-after` rewrites its key as fast and keeps its place.
//! - `owner`: the holder's line. Only the head waiter may create it, in one transaction that
//!   also requires it absent and removes the waiter's key. The revision that created it is the
//!   lock's **fencing token**: larger for every later holder, cluster-wide.
//!
//! A waiter waits on a watch (no polling) of the one key whose change can make it the owner:
//! the owner key for the head, the waiter just ahead for anyone else; it re-reads the directory
//! when that key changes. The lease is kept alive by a task on a runtime thread of its own; if no
//! keepalive has been answered for a whole TTL, the lease counts as lost (another host may hold
//! the lock by then) and [`Lease::lost_fd`] turns readable, which the holder's signal funnel
//! turns into a teardown (`lock-lost`, exit 76).
//!
//! Nothing here falls back to the local flock: an unreachable etcd is an error, since a flock
//! would exclude nobody on another host.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant, SystemTime};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, GetResponse, KeyValue, PutOptions,
    SortOrder, SortTarget, Txn, TxnOp, TxnResponse, WatchOptions,
};
use serde::{Deserialize, Serialize};

use crate::config::EtcdSettings;
use crate::lock::backend::{Attempt, Lease, LockBackend, LockKey, PROGRESS_EVERY, Taken, Wait};
use crate::lock::list::{LockInfo, LockKind};
use crate::lock::queue::{Class, QueuedTicket, Ticket};
use crate::lock::{Holder, LockError};
use crate::names::AppDomain;
use crate::names::etcd as keys;
use crate::report;
use crate::supervise::linux;
use crate::supervise::signals::Awaited;
use crate::supervise::worker::Awaitable;

/// How long connecting, and any one request of the main thread, may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a release may take: a holder whose etcd is gone must still tear down promptly
/// (its lease runs out on its own).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one member may take to answer one request before the next member is asked: a
/// member that is stopped or cut off accepts connections and never answers.
const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(1500);
/// How often a waiter reads its queue again even though its watch said nothing.
const RECHECK_EVERY: Duration = Duration::from_secs(3);
/// A pause before retrying after a failed watch or keepalive, so a dead member is not hammered.
const RETRY_PAUSE: Duration = Duration::from_millis(100);

/// Locks as etcd keys bound to this process's lease.
pub(crate) struct Etcd {
    shared: Arc<Shared>,
}

/// What the backend and every lock it handed out share; the last of them to go revokes the
/// lease and stops the runtime.
struct Shared {
    runtime: Option<tokio::runtime::Runtime>,
    pool: Arc<Pool>,
    /// The endpoints, comma-separated, for messages.
    endpoints: String,
    ttl: Duration,
    handle: tokio::runtime::Handle,
    /// This process's lease, granted at the first lock it takes or waits for.
    session: Mutex<Option<Arc<Session>>>,
    host: String,
}

/// One client per endpoint, asked in turn: a request that fails or hangs on one member is
/// asked again of the next, and the member that answered is asked first next time. (The
/// client's own balancing keeps sending to a member that is down.)
struct Pool {
    clients: Vec<Client>,
    next: AtomicUsize,
}

impl Pool {
    /// The member to ask now, and its index for [`Pool::fail_over`].
    fn current(&self) -> (usize, Client) {
        let at = self.next.load(Ordering::SeqCst);
        (at, self.clients[at % self.clients.len()].clone())
    }

    /// The member at `at` failed us: ask the next one from now on (unless another request
    /// already moved on).
    fn fail_over(&self, at: usize) {
        let _ =
            self.next
                .compare_exchange(at, at.wrapping_add(1), Ordering::SeqCst, Ordering::SeqCst);
    }

    /// `request`, asked of each member in turn until one answers (within about
    /// [`REQUEST_TIMEOUT`]).
    async fn call<T, F, Fut>(&self, request: F) -> Result<T, etcd_client::Error>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        // A cluster between leaders refuses on every member for a moment: go round until one
        // answers or the time for a request is up.
        let started = tokio::time::Instant::now();
        let mut last = None;
        for round in 0.. {
            if round > 0 && round % self.clients.len() == 0 {
                if started.elapsed() >= REQUEST_TIMEOUT {
                    break;
                }
                tokio::time::sleep(RETRY_PAUSE).await;
            }
            let (at, client) = self.current();
            match tokio::time::timeout(ATTEMPT_TIMEOUT, request(client)).await {
                Ok(Ok(answer)) => return Ok(answer),
                Ok(Err(err)) if !member_failed(&err) => return Err(err),
                Ok(Err(err)) => last = Some(err),
                Err(_) => {
                    last = Some(etcd_client::Error::IoError(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no answer",
                    )));
                }
            }
            self.fail_over(at);
        }
        Err(last.expect("at least one endpoint"))
    }
}

/// Whether `err` says the member could not serve us (down, stopped, without a leader), as
/// opposed to an answer (a lease that does not exist, a request it refuses).
fn member_failed(err: &etcd_client::Error) -> bool {
    match err {
        etcd_client::Error::GRpcStatus(status) => {
            // NOT_FOUND, INVALID_ARGUMENT, FAILED_PRECONDITION, PERMISSION_DENIED,
            // UNAUTHENTICATED, OUT_OF_RANGE: the cluster answered.
            !matches!(i32::from(status.code()), 3 | 5 | 7 | 9 | 11 | 16)
        }
        _ => true,
    }
}

/// A granted lease and its keepalive.
struct Session {
    id: i64,
    /// Readable once the lease counts as lost.
    lost: UnixStream,
    keeper: tokio::task::JoinHandle<()>,
}

/// What a waiter's key holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct WaiterValue {
    holder: Holder,
    class: Class,
}

/// One lock's key directory, as read at one revision.
struct Snapshot {
    revision: i64,
    owner: Option<KeyValue>,
    /// Waiters in service order: fast first, then by creation.
    queue: Vec<(KeyValue, Option<WaiterValue>)>,
}

impl Snapshot {
    /// Lock directory `dir` from its keys as read at `revision`, in creation order.
    fn of<'k>(dir: &str, revision: i64, kvs: impl IntoIterator<Item = &'k KeyValue>) -> Self {
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

    fn holder(&self) -> Option<Holder> {
        let owner = self.owner.as_ref()?;
        Holder::parse(&String::from_utf8_lossy(owner.value()))
    }

    fn head_is(&self, key: &str) -> bool {
        self.queue
            .first()
            .is_some_and(|(kv, _)| kv.key() == key.as_bytes())
    }
}

impl Etcd {
    /// Set up a client of `settings.endpoints`; whether one of them answers is for
    /// [`LockBackend::prepare`] to find out.
    pub(crate) fn connect(settings: &EtcdSettings) -> Result<Self, LockError> {
        let endpoints = settings.endpoints.join(",");
        let fail = |what: &str, detail: String| LockError::Etcd {
            endpoints: endpoints.clone(),
            what: what.to_owned(),
            detail,
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("etcd")
            .enable_all()
            // Signals are the main thread's: the funnel must see every one of them.
            .on_thread_start(linux::block_all_signals_but_kick)
            .build()
            .map_err(|e| fail("start the etcd client", e.to_string()))?;
        let options = ConnectOptions::new()
            .with_connect_timeout(ATTEMPT_TIMEOUT)
            .with_keep_alive(Duration::from_secs(1), Duration::from_secs(1))
            // A member cut off from the others refuses at once instead of waiting.
            .with_require_leader(true);
        let clients = runtime
            .block_on(async {
                let mut clients = Vec::new();
                for endpoint in &settings.endpoints {
                    // One endpoint per client: connects lazily, so a member that is down now
                    // is only skipped.
                    clients.push(Client::connect([endpoint], Some(options.clone())).await?);
                }
                Ok::<_, etcd_client::Error>(clients)
            })
            .map_err(|e| fail("connect", e.to_string()))?;
        Ok(Self {
            shared: Arc::new(Shared {
                handle: runtime.handle().clone(),
                runtime: Some(runtime),
                pool: Arc::new(Pool {
                    clients,
                    next: AtomicUsize::new(0),
                }),
                endpoints,
                ttl: settings.lease_ttl,
                session: Mutex::new(None),
                host: nix::unistd::gethostname()
                    .map(|h| h.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            }),
        })
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.end_session();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(RELEASE_TIMEOUT);
        }
    }
}

impl Shared {
    fn error(&self, what: &str, detail: impl ToString) -> LockError {
        LockError::Etcd {
            endpoints: self.endpoints.clone(),
            what: what.to_owned(),
            detail: detail.to_string(),
        }
    }

    /// Run `work` on the runtime, from the main thread, within `limit`.
    fn block_on<T>(
        &self,
        what: &str,
        limit: Duration,
        work: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, LockError> {
        // The timer is made inside the runtime: it needs the runtime's clock.
        self.handle
            .block_on(async move { tokio::time::timeout(limit, work).await })
            .map_err(|_| self.error(what, format!("no answer within {} s", limit.as_secs())))?
            .map_err(|e| self.error(what, e))
    }

    /// One transaction, through whichever member answers.
    fn txn(&self, what: &str, limit: Duration, txn: Txn) -> Result<TxnResponse, LockError> {
        self.block_on(
            what,
            limit,
            self.pool.call(|mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            }),
        )
    }

    /// The keys at `key` (or under it, with the prefix option).
    fn get(
        &self,
        what: &str,
        key: &str,
        options: Option<GetOptions>,
    ) -> Result<GetResponse, LockError> {
        self.block_on(
            what,
            REQUEST_TIMEOUT,
            self.pool.call(|mut c| {
                let options = options.clone();
                async move { c.get(key, options).await }
            }),
        )
    }

    /// This process's lease, granted (and kept alive) on first use.
    fn session(&self) -> Result<Arc<Session>, LockError> {
        let mut slot = self.session.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(session) = slot.as_ref() {
            return Ok(session.clone());
        }
        let ttl_secs = i64::try_from(self.ttl.as_secs()).unwrap_or(i64::MAX);
        let asked = tokio::time::Instant::now();
        let granted = self.block_on(
            "grant a lease",
            REQUEST_TIMEOUT,
            self.pool
                .call(|mut c| async move { c.lease_grant(ttl_secs, None).await }),
        )?;
        let (lost, notify) =
            UnixStream::pair().map_err(|e| self.error("make the lease-loss pipe", e))?;
        let keeper = self.handle.spawn(keep_alive(
            self.pool.clone(),
            granted.id(),
            self.ttl,
            asked,
            notify,
        ));
        tracing::debug!(lease = format!("{:x}", granted.id()), ttl = ?self.ttl, "lease granted");
        let session = Arc::new(Session {
            id: granted.id(),
            lost,
            keeper,
        });
        *slot = Some(session.clone());
        Ok(session)
    }

    /// Stop keeping the lease alive and revoke it: every key it still holds goes at once.
    fn end_session(&self) {
        let session = self
            .session
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(session) = session {
            session.keeper.abort();
            let id = session.id;
            if let Err(err) = self.block_on(
                "revoke the lease",
                RELEASE_TIMEOUT,
                self.pool
                    .call(|mut c| async move { c.lease_revoke(id).await }),
            ) {
                tracing::debug!("{err}; it expires on its own");
            }
        }
    }

    fn snapshot(&self, dir: &str) -> Result<Snapshot, LockError> {
        self.block_on("read the lock", REQUEST_TIMEOUT, snapshot(&self.pool, dir))
    }
}

/// Read one lock's key directory at one revision.
async fn snapshot(pool: &Pool, dir: &str) -> Result<Snapshot, etcd_client::Error> {
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

/// Keep lease `id` alive; once no keepalive has been answered for a whole TTL (or etcd says
/// the lease is gone), write to `lost` and stop. The TTL is counted from when the last
/// answered keepalive was *sent*: the server renewed the lease no earlier than that, so this
/// side gives up no later than the server expires it.
async fn keep_alive(
    pool: Arc<Pool>,
    id: i64,
    ttl: Duration,
    granted: tokio::time::Instant,
    mut lost: UnixStream,
) {
    let every = (ttl / 3).max(Duration::from_millis(500));
    let mut good_until = granted + ttl;
    // The keepalive stream, and the member it goes to.
    let mut stream = None;
    let why = loop {
        let now = tokio::time::Instant::now();
        if now >= good_until {
            break format!("no keepalive answered for {} s", ttl.as_secs_f64().round());
        }
        let sent = now;
        let round = async {
            if stream.is_none() {
                let (at, mut client) = pool.current();
                stream = Some((at, client.lease_keep_alive(id).await.map_err(|e| (at, e))?));
            }
            let (at, (keeper, answers)) = stream.as_mut().expect("just set");
            let at = *at;
            keeper.keep_alive().await.map_err(|e| (at, e))?;
            answers.message().await.map_err(|e| (at, e))
        };
        let limit = good_until.min(now + ATTEMPT_TIMEOUT);
        match tokio::time::timeout_at(limit, round).await {
            Ok(Ok(Some(answer))) if answer.ttl() > 0 => {
                let renewed = Duration::from_secs(answer.ttl().unsigned_abs()).min(ttl);
                good_until = sent + renewed;
                tokio::time::sleep(every).await;
            }
            Ok(Ok(Some(_))) => break "etcd says the lease has expired or was revoked".to_owned(),
            Ok(Ok(None)) => {
                stream = None;
                tokio::time::sleep(RETRY_PAUSE).await;
            }
            Ok(Err((at, _))) => {
                pool.fail_over(at);
                stream = None;
                tokio::time::sleep(RETRY_PAUSE).await;
            }
            Err(_) => {
                // The member did not answer in time: ask another.
                if let Some((at, _)) = stream.take() {
                    pool.fail_over(at);
                } else {
                    pool.fail_over(pool.current().0);
                }
            }
        }
    };
    tracing::warn!(lease = format!("{id:x}"), "etcd lease lost: {why}");
    let _ = lost.write_all(&[1]);
}

/// Which lock, as keys.
fn lock_dir(key: LockKey<'_>) -> String {
    match key {
        LockKey::App(domain) => keys::lock_dir(keys::APP, domain.as_str()),
        LockKey::Named(name) => keys::lock_dir(keys::NAMED, name.as_str()),
    }
}

/// How long ago a holder line says it started.
fn age_of(holder: &Holder) -> Option<Duration> {
    let since = humantime::parse_rfc3339_weak(&holder.started_at).ok()?;
    SystemTime::now().duration_since(since).ok()
}

/// "ticket 41 (normal, pid 7 on host-b)".
fn describe_waiter(kv: &KeyValue, value: Option<&WaiterValue>) -> String {
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
fn waiting_line(
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
async fn claim(
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
async fn wait_turn(
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
struct PendingTake {
    shared: Arc<Shared>,
    dir: String,
    waiter: String,
    lease: i64,
    ready: UnixStream,
    outcome: mpsc::Receiver<Result<i64, String>>,
    task: tokio::task::JoinHandle<()>,
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

/// An etcd lock we hold: the owner key created at `token`.
struct EtcdLease {
    shared: Arc<Shared>,
    session: Arc<Session>,
    owner: String,
    token: i64,
}

impl Lease for EtcdLease {
    fn holder(&self) -> Option<Holder> {
        let response = self.shared.get("read the lock", &self.owner, None).ok()?;
        let kv = response.kvs().first()?;
        (kv.create_revision() == self.token)
            .then(|| Holder::parse(&String::from_utf8_lossy(kv.value())))
            .flatten()
    }

    fn token(&self) -> Result<String, LockError> {
        Ok(format!("etcd:{:x}:{}", self.session.id, self.token))
    }

    fn lost_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.session.lost.as_fd())
    }

    fn remove(&self) -> Result<bool, LockError> {
        // The owner key is all that names the lock, and it goes with the release.
        Ok(false)
    }

    fn fencing_token(&self) -> Option<i64> {
        Some(self.token)
    }
}

impl Drop for EtcdLease {
    fn drop(&mut self) {
        let txn = Txn::new()
            .when([Compare::create_revision(
                self.owner.as_str(),
                CompareOp::Equal,
                self.token,
            )])
            .and_then([TxnOp::delete(self.owner.as_str(), None)]);
        if let Err(err) = self.shared.txn("release the lock", RELEASE_TIMEOUT, txn) {
            tracing::warn!("{err}; the lock frees when the lease expires");
        }
    }
}

impl Etcd {
    fn lease(&self, session: Arc<Session>, dir: &str, token: i64) -> Box<dyn Lease> {
        Box::new(EtcdLease {
            shared: self.shared.clone(),
            session,
            owner: keys::owner_key(dir),
            token,
        })
    }

    /// Join the line for `dir` as `holder`, and try once.
    fn enqueue(
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
    fn timed_out_detail(&self, key: LockKey<'_>, dir: &str, ticket: i64, class: Class) -> String {
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

impl LockBackend for Etcd {
    fn describe(&self, key: LockKey<'_>) -> String {
        format!("etcd key {}", keys::owner_key(&lock_dir(key)))
    }

    /// Whether etcd answers: a lock kept in an etcd nobody can reach protects nothing.
    fn prepare(&self, _create: bool) -> Result<(), LockError> {
        self.shared
            .block_on(
                "reach any endpoint",
                REQUEST_TIMEOUT,
                self.shared
                    .pool
                    .call(|mut c| async move { c.status().await }),
            )
            .map(drop)
    }

    fn describe_store(&self) -> String {
        format!("etcd at {}", self.shared.endpoints)
    }

    fn missing_store(&self) -> Option<String> {
        None
    }

    fn try_take(&self, key: LockKey<'_>, create: bool) -> Result<Attempt, LockError> {
        let dir = lock_dir(key);
        let snap = self.shared.snapshot(&dir)?;
        if snap.owner.is_some() {
            let holder = snap.holder();
            return Ok(Attempt::Held {
                age: holder.as_ref().and_then(age_of),
                holder,
                note: None,
            });
        }
        if let Some((_, value)) = snap.queue.first() {
            // A live waiter is about to take it (its key lives only as long as its lease).
            return Ok(Attempt::Held {
                age: None,
                holder: value.as_ref().map(|v| v.holder.clone()),
                note: None,
            });
        }
        if !create {
            return Ok(Attempt::Missing);
        }
        let session = self.shared.session()?;
        let owner = keys::owner_key(&dir);
        let holder = Holder::this_process("");
        let txn = Txn::new()
            .when([Compare::create_revision(
                owner.as_str(),
                CompareOp::Equal,
                0,
            )])
            .and_then([TxnOp::put(
                owner.as_str(),
                holder.to_line(),
                Some(PutOptions::new().with_lease(session.id)),
            )]);
        let response = self.shared.txn("take the lock", REQUEST_TIMEOUT, txn)?;
        if !response.succeeded() {
            return Ok(Attempt::Held {
                age: None,
                holder: None,
                note: None,
            });
        }
        let token = response.header().map_or(0, |h| h.revision());
        Ok(Attempt::Taken {
            lease: self.lease(session, &dir, token),
            current: true,
        })
    }

    fn take(
        &self,
        key: LockKey<'_>,
        wait: &Wait<'_>,
        on_wait: &mut dyn FnMut(Option<&Holder>, Duration),
    ) -> Result<Taken, LockError> {
        let dir = lock_dir(key);
        let session = self.shared.session()?;
        let started = Instant::now();
        let value = WaiterValue {
            holder: wait.holder.clone(),
            class: wait.class,
        };
        let (waiter, token, snap) = self.enqueue(&session, &dir, &value)?;
        let ticket = snap
            .queue
            .iter()
            .find(|(kv, _)| kv.key() == waiter.as_bytes())
            .map_or(0, |(kv, _)| kv.create_revision());
        if let Some(token) = token {
            return Ok(Taken::Held(self.lease(session, &dir, token)));
        }
        on_wait(snap.holder().as_ref(), Duration::ZERO);
        let say_where = |snap: &Snapshot| {
            if let LockKey::Named(name) = key {
                report::line(&waiting_line(name, snap, &waiter, ticket, wait));
            }
        };
        say_where(&snap);
        let promote = (wait.class == Class::Normal)
            .then(|| started.checked_add(wait.promote_after))
            .flatten()
            .map(|at| {
                let fast = WaiterValue {
                    class: Class::Fast,
                    ..value.clone()
                };
                let line = serde_json::to_string(&fast).expect("a waiter always serialises");
                (tokio::time::Instant::from_std(at), line)
            });
        let (ready, notify) = UnixStream::pair().map_err(|e| self.shared.error("wait", e))?;
        let (tx, rx) = mpsc::channel();
        let task = self.shared.handle.spawn({
            let work = wait_turn(
                self.shared.pool.clone(),
                dir.clone(),
                waiter.clone(),
                session.id,
                wait.holder.to_line(),
                promote,
            );
            let mut notify = notify;
            async move {
                let outcome = work.await;
                let _ = tx.send(outcome);
                let _ = notify.write_all(&[1]);
            }
        });
        let pending = PendingTake {
            shared: self.shared.clone(),
            dir: dir.clone(),
            waiter: waiter.clone(),
            lease: session.id,
            ready,
            outcome: rx,
            task,
        };
        let shared = &self.shared;
        let mut progress = || {
            let snap = shared.snapshot(&dir).ok();
            if let Some(snap) = &snap {
                say_where(snap);
            }
            on_wait(snap.and_then(|s| s.holder()).as_ref(), started.elapsed());
        };
        let keepalive: Option<(Duration, &mut dyn FnMut())> = Some((PROGRESS_EVERY, &mut progress));
        let lost = wait.funnel.await_work(pending, wait.until, keepalive);
        match lost {
            Awaited::Done(Ok(token)) => Ok(Taken::Held(self.lease(session, &dir, token))),
            Awaited::Done(Err(why)) => Err(self.shared.error("wait for the lock", why)),
            Awaited::Stopped(event) => Ok(Taken::Stopped(event)),
            Awaited::TimedOut => Ok(Taken::TimedOut {
                waited: started.elapsed(),
                lock: match key {
                    LockKey::App(_) => self.describe(key),
                    LockKey::Named(name) => name.to_string(),
                },
                detail: self.timed_out_detail(key, &dir, ticket, wait.class),
            }),
        }
    }

    fn is_held_by(&self, key: LockKey<'_>, pid: i32, token: &str) -> bool {
        let Some((lease, revision)) = token
            .strip_prefix("etcd:")
            .and_then(|t| t.split_once(':'))
            .and_then(|(l, r)| Some((i64::from_str_radix(l, 16).ok()?, r.parse::<i64>().ok()?)))
        else {
            return false;
        };
        let Ok(snap) = self.shared.snapshot(&lock_dir(key)) else {
            return false;
        };
        let (Some(owner), Some(holder)) = (snap.owner.as_ref(), snap.holder()) else {
            return false;
        };
        owner.lease() == lease
            && owner.create_revision() == revision
            && i64::from(holder.pid) == i64::from(pid)
            && holder.host == self.shared.host
    }

    fn list(&self, long_held: Duration) -> std::io::Result<Vec<LockInfo>> {
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        let response = self
            .shared
            .get("list the locks", keys::PREFIX, Some(options))
            .map_err(std::io::Error::other)?;
        let revision = response.header().map_or(0, |h| h.revision());
        let mut dirs: BTreeMap<(LockKind, String), Vec<&KeyValue>> = BTreeMap::new();
        for kv in response.kvs() {
            let Some((kind, name, _)) =
                std::str::from_utf8(kv.key()).ok().and_then(keys::key_parts)
            else {
                continue;
            };
            let kind = match kind {
                keys::APP => LockKind::App,
                keys::NAMED => LockKind::Named,
                _ => continue,
            };
            dirs.entry((kind, name.to_owned())).or_default().push(kv);
        }
        let mut found = Vec::new();
        for ((kind, name), kvs) in dirs {
            let dir = keys::lock_dir(
                match kind {
                    LockKind::App => keys::APP,
                    LockKind::Named => keys::NAMED,
                },
                &name,
            );
            let snap = Snapshot::of(&dir, revision, kvs);
            let holder = snap.holder();
            let age = holder.as_ref().and_then(age_of);
            found.push(LockInfo {
                path: PathBuf::from(keys::owner_key(&dir)),
                kind,
                name: crate::names::escape_outside(name.as_bytes()),
                held: snap.owner.is_some(),
                holder_pids: holder
                    .iter()
                    .map(|h| i32::try_from(h.pid).unwrap_or(i32::MAX))
                    .collect(),
                waiters: snap.queue.len(),
                holder_raw: match (&snap.owner, &holder) {
                    (Some(kv), None) => Some(String::from_utf8_lossy(kv.value()).into_owned()),
                    _ => None,
                },
                holder,
                holder_is: None,
                holder_unresolvable: None,
                age_s: age.map(|a| a.as_secs()),
                long_held: age.is_some_and(|a| a > long_held),
                problem: None,
                queue: (kind == LockKind::Named).then(|| {
                    snap.queue
                        .iter()
                        .map(|(kv, v)| QueuedTicket {
                            ticket: Ticket {
                                class: v.as_ref().map_or(Class::Normal, |v| v.class),
                                seq: kv.create_revision().unsigned_abs(),
                                pid: v
                                    .as_ref()
                                    .map_or(0, |v| i32::try_from(v.holder.pid).unwrap_or(0)),
                            },
                            age_s: v
                                .as_ref()
                                .and_then(|v| age_of(&v.holder))
                                .map_or(0, |a| a.as_secs()),
                        })
                        .collect()
                }),
            });
        }
        Ok(found)
    }

    fn tidy(
        &self,
        _keep: &dyn Fn(&AppDomain) -> bool,
        _dry_run: bool,
    ) -> (Vec<PathBuf>, Vec<String>) {
        // Keys go with their leases: nothing is ever left behind to tidy.
        (Vec::new(), Vec::new())
    }
}
