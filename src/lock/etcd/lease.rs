//! This process's lease and the locks held under it: the lease is granted at the first lock
//! taken or waited for and kept alive by a task on the runtime; a held lock is an
//! [`EtcdLease`], released (its owner key deleted) when it is dropped.

use std::io::Write as _;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};

use super::Etcd;
use super::client::{ATTEMPT_TIMEOUT, Pool, RELEASE_TIMEOUT, REQUEST_TIMEOUT, RETRY_PAUSE, Shared};
use crate::lock::backend::Lease;
use crate::lock::{Holder, LockError};
use crate::names::etcd as keys;

/// A granted lease and its keepalive.
pub(super) struct Session {
    pub(super) id: i64,
    /// Readable once the lease counts as lost.
    pub(super) lost: UnixStream,
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
/// the lease is gone), write to `lost` and stop. The TTL is counted from when the last
/// answered keepalive was *sent*: the server renewed the lease no earlier than that, so this
/// side gives up no later than the server expires it.
pub(super) async fn keep_alive(
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
    pub(super) fn lease(&self, session: Arc<Session>, dir: &str, token: i64) -> Box<dyn Lease> {
        Box::new(EtcdLease {
            shared: self.shared.clone(),
            session,
            owner: keys::owner_key(dir),
            token,
        })
    }
}
