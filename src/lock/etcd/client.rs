//! The etcd client every lock of this process shares: one runtime thread, one client per
//! endpoint asked in turn ([`Pool`]), and the blocking calls the main thread makes through it,
//! each within a time limit (a member that hangs never hangs a run).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, GetOptions, GetResponse, Txn, TxnResponse};
use tokio::sync::watch;

use crate::lock::file::LockError;

/// How long connecting, and any one request of the main thread, may take.
pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a release may take: a holder whose etcd is gone must still tear down promptly
/// (its lease runs out on its own).
pub(super) const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one member may take to answer one request before the next member is asked: a
/// member that is stopped or cut off accepts connections and never answers.
pub(super) const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(1500);
/// A pause before retrying after a failed watch or keepalive, so a dead member is not hammered.
pub(super) const RETRY_PAUSE: Duration = Duration::from_millis(100);
/// How long a request goes on asking while every member refuses the connection (nothing
/// listens there): long enough for a member that is restarting, short of [`REQUEST_TIMEOUT`],
/// so that the answer is "refused" rather than "no answer".
pub(super) const REFUSED_PATIENCE: Duration = Duration::from_secs(1);

/// The one thread that drives the runtime (its I/O, timers and tasks: the keepalive, the
/// guards); the main thread's own calls go through [`Driver::handle`].
///
/// The thread is ours rather than the runtime's, so that a thread the host will not let us
/// have (RLIMIT_NPROC, pids.max, RLIMIT_AS) is an error to report, not a panic inside the
/// runtime's builder.
pub(super) struct Driver {
    pub(super) handle: tokio::runtime::Handle,
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Driver {
    /// Build the runtime and start its thread; the error says which limit was reached.
    pub(super) fn start() -> Result<Self, (&'static str, String)> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| {
                (
                    "build the etcd client runtime",
                    format!("{e}{}", crate::supervise::threads::thread_limit_hint(&e)),
                )
            })?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = crate::supervise::threads::room_for_thread()
            .and_then(|()| {
                std::thread::Builder::new()
                    .name("etcd".to_owned())
                    .spawn(move || {
                        // Signals are the main thread's: the funnel must see every one of them.
                        crate::supervise::threads::block_all_signals_but_kick();
                        let _ = runtime.block_on(stopped);
                        runtime.shutdown_timeout(RELEASE_TIMEOUT);
                    })
            })
            .map_err(|e| {
                (
                    "start the etcd client thread",
                    format!("{e}{}", crate::supervise::threads::thread_limit_hint(&e)),
                )
            })?;
        Ok(Self {
            handle,
            stop,
            thread,
        })
    }

    /// Stop the runtime (its tasks are dropped) and wait for its thread.
    pub(super) fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.thread.join();
    }
}

/// The addresses of `endpoints` (validated `http://HOST:PORT`), resolved here on
/// the calling thread, one `http://ADDRESS:PORT` per address.
///
/// Left to the client, a host name is looked up on the runtime's blocking pool, which needs a
/// thread of its own at every (re)connect: where the host will not give one (RLIMIT_NPROC,
/// pids.max) the runtime panics inside the connecting task and the lock sees only "service was
/// not ready". An endpoint that is already an address is kept as given; one whose name does not
/// resolve is left out (as a member that is down would only be skipped), unless none resolves.
pub(super) fn resolve(endpoints: &[String]) -> Result<Vec<String>, String> {
    use std::net::{IpAddr, ToSocketAddrs};
    let mut resolved = Vec::new();
    let mut failures = Vec::new();
    for endpoint in endpoints {
        let authority = endpoint
            .strip_prefix("http://")
            .unwrap_or(endpoint)
            .trim_end_matches('/');
        let Some((host, port)) = authority.rsplit_once(':') else {
            resolved.push(endpoint.clone());
            continue;
        };
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let Ok(port) = port.parse::<u16>() else {
            resolved.push(endpoint.clone());
            continue;
        };
        if bare.parse::<IpAddr>().is_ok() {
            resolved.push(endpoint.clone());
            continue;
        }
        match (bare, port).to_socket_addrs() {
            Ok(addrs) => {
                let before = resolved.len();
                for addr in addrs {
                    let url = format!("http://{addr}");
                    if !resolved[before..].contains(&url) {
                        resolved.push(url);
                    }
                }
                if resolved.len() == before {
                    failures.push(format!("{host}: no address"));
                }
            }
            Err(err) => failures.push(format!("{host}: {err}")),
        }
    }
    if resolved.is_empty() {
        return Err(failures.join("; "));
    }
    for failure in &failures {
        tracing::warn!("etcd endpoint host left out: {failure}");
    }
    Ok(resolved)
}

/// A granted lease and its keepalive.
pub(super) struct Session {
    pub(super) id: i64,
    /// Why the lease counts as lost, once it does.
    pub(super) lost: watch::Receiver<Option<String>>,
    /// The earliest instant etcd may expire the lease, by this host's monotonic clock: the send
    /// time of the last answered keepalive (or of the grant) plus the TTL.
    pub(super) expiry: watch::Receiver<tokio::time::Instant>,
    pub(super) keeper: tokio::task::JoinHandle<()>,
}

/// What the backend and every lock it handed out share; the last of them to go revokes the
/// lease and stops the runtime.
pub(super) struct Shared {
    pub(super) driver: Option<Driver>,
    pub(super) pool: Arc<Pool>,
    /// The endpoints, comma-separated, for messages.
    pub(super) endpoints: String,
    pub(super) ttl: Duration,
    pub(super) handle: tokio::runtime::Handle,
    /// This process's lease, granted at the first lock it takes or waits for.
    pub(super) session: Mutex<Option<Arc<Session>>>,
    pub(super) host: String,
    /// How long before its lease may expire a holder of this process must begin to stop its
    /// command (its kill grace and [`crate::config::KILL_MARGIN`]), in nanoseconds: the
    /// keepalive counts the lease at risk, and the lock lost, that long before.
    pub(super) stop_budget: Arc<std::sync::atomic::AtomicU64>,
}

impl Shared {
    /// The stop budget of this process's holders.
    pub(super) fn stop_budget(&self) -> Duration {
        Duration::from_nanos(self.stop_budget.load(Ordering::SeqCst))
    }

    /// Who this process is, in records others read: "pid N on HOST".
    pub(super) fn who(&self) -> String {
        format!("pid {} on {}", std::process::id(), self.host)
    }

    /// A holder of this process needs `budget` to stop its command: keep the largest asked.
    pub(super) fn need_stop_budget(&self, budget: Duration) {
        let nanos = u64::try_from(budget.as_nanos()).unwrap_or(u64::MAX);
        self.stop_budget.fetch_max(nanos, Ordering::SeqCst);
    }
}

/// One client per endpoint, asked in turn: a request that fails or hangs on one member is
/// asked again of the next, and the member that answered is asked first next time. (The
/// client's own balancing keeps sending to a member that is down.)
pub(super) struct Pool {
    pub(super) clients: Vec<Client>,
    pub(super) next: AtomicUsize,
}

impl Pool {
    /// The member to ask now, and its index for [`Pool::fail_over`].
    pub(super) fn current(&self) -> (usize, Client) {
        let at = self.next.load(Ordering::SeqCst);
        (at, self.clients[at % self.clients.len()].clone())
    }

    /// The member at `at` failed us: ask the next one from now on (unless another request
    /// already moved on).
    pub(super) fn fail_over(&self, at: usize) {
        let _ =
            self.next
                .compare_exchange(at, at.wrapping_add(1), Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Transaction `txn`, asked of each member in turn until one answers ([`Pool::call`]).
    pub(super) async fn txn(&self, txn: &Txn) -> Result<TxnResponse, etcd_client::Error> {
        self.call(|mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await
    }

    /// `request`, asked of each member in turn until one answers (within about
    /// [`REQUEST_TIMEOUT`]).
    pub(super) async fn call<T, F, Fut>(&self, request: F) -> Result<T, etcd_client::Error>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        // A cluster between leaders refuses on every member for a moment: go round until one
        // answers or the time for a request is up.
        let started = tokio::time::Instant::now();
        let mut last = None;
        // Whether every member asked so far refused the connection.
        let mut all_refused = true;
        for round in 0.. {
            if round > 0 && round % self.clients.len() == 0 {
                if all_refused && started.elapsed() >= REFUSED_PATIENCE {
                    return Err(etcd_client::Error::IoError(std::io::Error::new(
                        std::io::ErrorKind::ConnectionRefused,
                        REFUSED,
                    )));
                }
                if started.elapsed() >= REQUEST_TIMEOUT {
                    break;
                }
                tokio::time::sleep(RETRY_PAUSE).await;
            }
            let (at, client) = self.current();
            match tokio::time::timeout(ATTEMPT_TIMEOUT, request(client)).await {
                Ok(Ok(answer)) => return Ok(answer),
                Ok(Err(err)) if !member_failed(&err) => return Err(err),
                Ok(Err(err)) => {
                    all_refused &= refused(&err);
                    last = Some(err);
                }
                Err(_) => {
                    all_refused = false;
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

/// What a request that every member refused says.
pub(super) const REFUSED: &str =
    "every endpoint refused the connection: nothing listens there (is etcd running, on that port?)";

/// Whether `err` is a refused connection: nothing listens at the endpoint. The client keeps
/// the kernel's error at the bottom of its chain of sources.
pub(super) fn refused(err: &etcd_client::Error) -> bool {
    // Its gRPC status does not say it has a source: start from the status itself.
    let mut source: Option<&(dyn std::error::Error + 'static)> = match err {
        etcd_client::Error::GRpcStatus(status) => Some(status),
        etcd_client::Error::IoError(io) => Some(io),
        etcd_client::Error::TransportError(transport) => Some(transport),
        err => Some(err),
    };
    while let Some(err) = source {
        if err
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            return true;
        }
        source = err.source();
    }
    false
}

/// Whether `err` says the member could not serve us (down, stopped, without a leader), as
/// opposed to an answer (a lease that does not exist, a request it refuses).
pub(super) fn member_failed(err: &etcd_client::Error) -> bool {
    match err {
        etcd_client::Error::GRpcStatus(status) => {
            // NOT_FOUND, INVALID_ARGUMENT, FAILED_PRECONDITION, PERMISSION_DENIED,
            // UNAUTHENTICATED, OUT_OF_RANGE: the cluster answered.
            !matches!(i32::from(status.code()), 3 | 5 | 7 | 9 | 11 | 16)
        }
        _ => true,
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.end_session();
        if let Some(driver) = self.driver.take() {
            driver.stop();
        }
    }
}

impl Shared {
    /// Stop keeping the lease alive and revoke it: every key it still holds goes at once.
    pub(super) fn end_session(&self) {
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

    pub(super) fn error(&self, what: &str, detail: impl ToString) -> LockError {
        LockError::Etcd {
            endpoints: self.endpoints.clone(),
            what: what.to_owned(),
            detail: detail.to_string(),
        }
    }

    /// Run `work` on the runtime, from the main thread, within `limit`.
    pub(super) fn block_on<T>(
        &self,
        what: &str,
        limit: Duration,
        work: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, LockError> {
        // The timer is made inside the runtime: it needs the runtime's clock.
        self.handle
            .block_on(async move { tokio::time::timeout(limit, work).await })
            .map_err(|_| self.error(what, format!("no answer within {} s", limit.as_secs())))?
            .map_err(|e| {
                if refused(&e) {
                    self.error(what, REFUSED)
                } else {
                    self.error(what, e)
                }
            })
    }

    /// One transaction, through whichever member answers.
    pub(super) fn txn(
        &self,
        what: &str,
        limit: Duration,
        txn: Txn,
    ) -> Result<TxnResponse, LockError> {
        self.block_on(what, limit, self.pool.txn(&txn))
    }

    /// The keys at `key` (or under it, with the prefix option).
    pub(super) fn get(
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
}

#[cfg(test)]
mod tests {
    use super::resolve;

    fn owned(endpoints: &[&str]) -> Vec<String> {
        endpoints.iter().map(|e| (*e).to_owned()).collect()
    }

    #[test]
    fn addresses_are_kept_and_names_become_addresses() {
        let got = resolve(&owned(&[
            "http://127.0.0.1:2379",
            "http://10.0.0.2:2379/",
            "http://[::1]:2379",
            "http://localhost:2380/",
        ]))
        .unwrap();
        assert_eq!(
            got[..3],
            owned(&[
                "http://127.0.0.1:2379",
                "http://10.0.0.2:2379/",
                "http://[::1]:2379"
            ])
        );
        assert!(got.len() > 3, "{got:?}");
        for url in &got[3..] {
            let authority = url.strip_prefix("http://").unwrap();
            let addr: std::net::SocketAddr = authority.parse().unwrap();
            assert!(addr.ip().is_loopback() && addr.port() == 2380, "{got:?}");
        }
    }

    /// `.invalid` never resolves (RFC 6761): left out beside one that does, an error alone.
    #[test]
    fn a_name_that_does_not_resolve_is_left_out_unless_it_is_all_there_is() {
        let got = resolve(&owned(&[
            "http://nohost.invalid:2379",
            "http://127.0.0.1:2379",
        ]))
        .unwrap();
        assert_eq!(got, owned(&["http://127.0.0.1:2379"]));
        let err = resolve(&owned(&["http://nohost.invalid:2379"])).unwrap_err();
        assert!(err.starts_with("nohost.invalid: "), "{err}");
    }
}
