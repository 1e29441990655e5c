//! This process's lease and the locks held under it: the lease is granted at the first lock
//! taken or waited for and kept alive by a task on the runtime; a held lock is an
//! [`EtcdLease`], watched by its guard ([`super::guard`]) and released when it is dropped: its
//! owner key deleted if it is still ours, its tenure key in any case (by then its holder's
//! command has ended, which is what the tenure key stands for).

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use tokio::sync::watch;

use super::Etcd;
use super::client::{ATTEMPT_TIMEOUT, Pool, RELEASE_TIMEOUT, REQUEST_TIMEOUT, RETRY_PAUSE, Shared};
use super::guard::{self, Watched};
use super::queue::Claimed;
use crate::lock::backend::Lease;
use crate::lock::{Holder, LockError};
use crate::names::etcd as keys;

/// A granted lease and its keepalive.
pub(super) struct Session {
    pub(super) id: i64,
    /// Why the lease counts as lost, once it does.
    pub(super) lost: watch::Receiver<Option<String>>,
    pub(super) keeper: tokio::task::JoinHandle<()>,
}

impl Shared {
    /// This process's lease, granted (and kept alive) on first use.
    pub(super) fn session(&self) -> Result<Arc<Session>, LockError> {
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
        let (notify, lost) = watch::channel(None);
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
}

/// Keep lease `id` alive; once no keepalive has been answered for a whole TTL (or etcd says
/// the lease is gone), say why on `lost` and stop. The TTL is counted from when the last
/// answered keepalive was *sent*: the server renewed the lease no earlier than that, so this
/// side gives up no later than the server expires it.
pub(super) async fn keep_alive(
    pool: Arc<Pool>,
    id: i64,
    ttl: Duration,
    granted: tokio::time::Instant,
    lost: watch::Sender<Option<String>>,
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
    lost.send_replace(Some(why));
}

/// An etcd lock we hold: the owner key created at `claimed.revision`.
struct EtcdLease {
    shared: Arc<Shared>,
    session: Arc<Session>,
    owner: String,
    tenure: String,
    claimed: Claimed,
    /// Readable once the guard saw the lock lost.
    lost: UnixStream,
    guard: tokio::task::JoinHandle<()>,
}

impl Lease for EtcdLease {
    fn holder(&self) -> Option<Holder> {
        let response = self.shared.get("read the lock", &self.owner, None).ok()?;
        let kv = response.kvs().first()?;
        (kv.create_revision() == self.claimed.revision)
            .then(|| Holder::parse(&String::from_utf8_lossy(kv.value())))
            .flatten()
    }

    fn token(&self) -> Result<String, LockError> {
        Ok(format!(
            "etcd:{:x}:{}",
            self.session.id, self.claimed.revision
        ))
    }

    fn lost_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.lost.as_fd())
    }

    fn remove(&self) -> Result<bool, LockError> {
        // The owner key is all that names the lock, and it goes with the release.
        Ok(false)
    }

    fn fencing_token(&self) -> Option<i64> {
        Some(self.claimed.token())
    }
}

impl Drop for EtcdLease {
    fn drop(&mut self) {
        // A guard that saw the lock lost may still be at work on the lineage (a rewound
        // cluster): let it finish, briefly. Otherwise our own release is no loss: stop it.
        if crate::supervise::signals::readable_now(self.lost.as_fd()) {
            let guard = &mut self.guard;
            let _ = self
                .shared
                .handle
                .block_on(async move { tokio::time::timeout(RELEASE_TIMEOUT, guard).await });
        }
        self.guard.abort();
        let owner = self.owner.as_str();
        let txn = Txn::new()
            .when([
                Compare::create_revision(owner, CompareOp::Equal, self.claimed.revision),
                Compare::lease(owner, CompareOp::Equal, self.session.id),
            ])
            .and_then([
                TxnOp::delete(owner, None),
                TxnOp::delete(self.tenure.as_str(), None),
            ])
            .or_else([TxnOp::delete(self.tenure.as_str(), None)]);
        if let Err(err) = self.shared.txn("release the lock", RELEASE_TIMEOUT, txn) {
            tracing::warn!("{err}; the lock frees when the lease expires");
        }
    }
}

impl Etcd {
    /// The lock on `dir` we just claimed, with its guard watching it.
    pub(super) fn lease(
        &self,
        session: Arc<Session>,
        dir: &str,
        claimed: Claimed,
    ) -> Result<Box<dyn Lease>, LockError> {
        let (lost, notify) =
            UnixStream::pair().map_err(|e| self.shared.error("make the lock-loss pipe", e))?;
        let owner = keys::owner_key(dir);
        let guard = self.shared.handle.spawn(guard::guard(
            Watched {
                pool: self.shared.pool.clone(),
                owner: owner.clone(),
                lease: session.id,
                claimed,
                ttl: self.shared.ttl,
            },
            session.lost.clone(),
            notify,
        ));
        Ok(Box::new(EtcdLease {
            shared: self.shared.clone(),
            tenure: keys::tenure_key(dir, session.id),
            session,
            owner,
            claimed,
            lost,
            guard,
        }))
    }
}
