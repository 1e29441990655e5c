//! This process's lease and the locks held under it: the lease is granted at the first lock
//! taken or waited for and kept alive by a task on the runtime; a held lock is an
//! [`EtcdLease`], watched by its guard ([`super::guard`]) and released when it is dropped: its
//! owner key deleted if it is still ours, its tenure key in any case (by then its holder's
//! command has ended, which is what the tenure key stands for).

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use tokio::sync::watch;

use super::client::{
    ATTEMPT_TIMEOUT, Pool, RELEASE_TIMEOUT, REQUEST_TIMEOUT, RETRY_PAUSE, Session, Shared,
};
use super::guard::{self, Watched};
use super::queue::{Claimed, Line, follow_line, hand_over};
use crate::lock::backend::Lease;
use crate::lock::file::LockError;
use crate::lock::holder::Holder;
use crate::names::etcd as keys;

/// How long a release may try to hand the lock over before it releases it plainly.
const HANDOVER_TIMEOUT: Duration = Duration::from_millis(500);

/// This process's lease, granted (and kept alive) on first use.
pub(super) fn session(shared: &Shared) -> Result<Arc<Session>, LockError> {
    let mut slot = shared.session.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(session) = slot.as_ref() {
        return Ok(session.clone());
    }
    let ttl_secs = i64::try_from(shared.ttl.as_secs()).unwrap_or(i64::MAX);
    let asked = tokio::time::Instant::now();
    let granted = shared.block_on(
        "grant a lease",
        REQUEST_TIMEOUT,
        shared
            .pool
            .call(|mut c| async move { c.lease_grant(ttl_secs, None).await }),
    )?;
    let (notify, lost) = watch::channel(None);
    let (renewed, expiry) = watch::channel(asked + shared.ttl);
    let keeper = shared.handle.spawn(keep_alive(
        Keeper {
            pool: shared.pool.clone(),
            id: granted.id(),
            ttl: shared.ttl,
            stop_budget: shared.stop_budget.clone(),
        },
        asked,
        notify,
        renewed,
    ));
    tracing::debug!(lease = format!("{:x}", granted.id()), ttl = ?shared.ttl, "lease granted");
    let session = Arc::new(Session {
        id: granted.id(),
        lost,
        expiry,
        keeper,
    });
    *slot = Some(session.clone());
    Ok(session)
}

/// The lease a keepalive task keeps alive.
pub(super) struct Keeper {
    pub(super) pool: Arc<Pool>,
    pub(super) id: i64,
    pub(super) ttl: Duration,
    /// The holders' stop budget, in nanoseconds ([`Shared::stop_budget`]).
    pub(super) stop_budget: Arc<AtomicU64>,
}

impl Keeper {
    fn stop_budget(&self) -> Duration {
        Duration::from_nanos(self.stop_budget.load(Ordering::SeqCst))
    }
}

/// Keep the lease alive, publishing on `renewed` the earliest instant etcd may expire it after
/// each answered keepalive. Once less than the stop budget is left until that instant (or etcd
/// says the lease is gone), say why on `lost` and stop: the lease is at risk, and a holder
/// that began stopping its command any later could still be stopping it when etcd expires the
/// lease and hands the lock to the next holder.
///
/// The earliest expiry is counted from when the last answered keepalive was *sent*: etcd
/// renewed the lease no earlier than that, so it cannot expire it before then plus the TTL.
/// Keepalives go out often enough that a member that does not answer is given up for another
/// well within the TTL less the stop budget ([`crate::config::LEASE_HEADROOM`] at least).
pub(super) async fn keep_alive(
    keeper: Keeper,
    granted: tokio::time::Instant,
    lost: watch::Sender<Option<String>>,
    renewed: watch::Sender<tokio::time::Instant>,
) {
    let Keeper { pool, id, ttl, .. } = &keeper;
    let (id, ttl) = (*id, *ttl);
    let mut good_until = granted + ttl;
    let mut last_answer = granted;
    // The keepalive stream, and the member it goes to.
    let mut stream = None;
    let why = loop {
        let budget = keeper.stop_budget();
        let headroom = ttl.saturating_sub(budget);
        // A few tries within the headroom, each given up on in time for the next.
        // Often enough that the last answered keepalive is at most half a second old when a
        // leader dies: what an election leaves of the headroom goes to the election.
        let every = (headroom / 7).clamp(Duration::from_millis(100), ttl / 3);
        let attempt = (headroom / 4).clamp(Duration::from_millis(200), ATTEMPT_TIMEOUT);
        let at_risk = good_until.checked_sub(budget).unwrap_or(good_until);
        let now = tokio::time::Instant::now();
        if now >= at_risk {
            break format!(
                "no keepalive answered for {:.1} s: etcd may expire the lease {:.1} s from now, \
                 within the {:.1} s a holder needs to stop its command",
                now.duration_since(last_answer).as_secs_f64(),
                good_until.saturating_duration_since(now).as_secs_f64(),
                budget.as_secs_f64()
            );
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
        let limit = at_risk.min(now + attempt);
        match tokio::time::timeout_at(limit, round).await {
            Ok(Ok(Some(answer))) if answer.ttl() > 0 => {
                let granted_ttl = Duration::from_secs(answer.ttl().unsigned_abs()).min(ttl);
                // Never earlier than before: an answer to an older request (a slow member)
                // must not shorten what a newer one already proved.
                if sent + granted_ttl > good_until {
                    good_until = sent + granted_ttl;
                    renewed.send_replace(good_until);
                }
                last_answer = tokio::time::Instant::now();
                let next = (sent + every).min(good_until.checked_sub(budget).unwrap_or(sent));
                tokio::time::sleep_until(next).await;
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
    tracing::warn!(lease = format!("{id:x}"), "etcd lease at risk: {why}");
    lost.send_replace(Some(why));
}

/// An etcd lock we hold: the owner key last written at `claimed.revision` (our claim, or the
/// handover to us).
struct EtcdLease {
    shared: Arc<Shared>,
    session: Arc<Session>,
    /// The lock's key directory.
    dir: String,
    owner: String,
    tenure: String,
    claimed: Claimed,
    /// Readable once the guard saw the lock lost.
    lost: UnixStream,
    guard: tokio::task::JoinHandle<()>,
    /// The lock's directory as last read, for the release to hand the lock over by.
    line: Line,
    follower: tokio::task::JoinHandle<()>,
    /// The tasks that pass the lease's renewals on ([`Lease::feed_expiry`]).
    feeders: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Lease for EtcdLease {
    fn holder(&self) -> Option<Holder> {
        let response = self.shared.get("read the lock", &self.owner, None).ok()?;
        let kv = response.kvs().first()?;
        (kv.mod_revision() == self.claimed.revision)
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

    fn lapses(&self) -> bool {
        true
    }

    fn feed_expiry(&self, mut feed: Box<dyn FnMut(Instant) + Send>) -> bool {
        let mut expiry = self.session.expiry.clone();
        feed(expiry.borrow_and_update().into_std());
        let task = self.shared.handle.spawn(async move {
            loop {
                // The keepalive ended (the lease is lost): nothing will renew it again.
                if expiry.changed().await.is_err() {
                    break;
                }
                let at = *expiry.borrow_and_update();
                feed(at.into_std());
            }
        });
        self.feeders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(task);
        true
    }

    fn safe_until(&self) -> Option<Instant> {
        let expiry = self.session.expiry.borrow().into_std();
        Some(
            expiry
                .checked_sub(self.shared.stop_budget())
                .unwrap_or(expiry),
        )
    }

    fn confirm(&self) -> Result<(), String> {
        let at_risk = || {
            let expiry = self.session.expiry.borrow().into_std();
            let left = expiry.saturating_duration_since(Instant::now());
            (left <= self.shared.stop_budget()).then(|| {
                format!(
                    "its lease may expire {:.1} s from now, within the {:.1} s its holder needs \
                     to stop",
                    left.as_secs_f64(),
                    self.shared.stop_budget().as_secs_f64()
                )
            })
        };
        if crate::supervise::linux::readable_now(self.lost.as_fd()) {
            return Err("the lock was lost".to_owned());
        }
        if let Some(why) = at_risk() {
            return Err(why);
        }
        let owner = self.owner.as_str();
        let txn = Txn::new().when([
            Compare::mod_revision(owner, CompareOp::Equal, self.claimed.revision),
            Compare::lease(owner, CompareOp::Equal, self.session.id),
        ]);
        let response = self
            .shared
            .txn("confirm the lock is ours", RELEASE_TIMEOUT, txn)
            .map_err(|e| format!("it could not be proven: {e}"))?;
        if !response.succeeded() {
            return Err(format!(
                "etcd says its owner key {owner} is no longer ours (revision {}, lease {:x})",
                self.claimed.revision, self.session.id
            ));
        }
        // The answer may have come late: it proves nothing past the lease's safe time.
        at_risk().map_or(Ok(()), Err)
    }
}

impl Drop for EtcdLease {
    fn drop(&mut self) {
        // A guard that saw the lock lost may still be at work on the lineage (a rewound
        // cluster): let it finish, briefly. Otherwise our own release is no loss: stop it.
        if crate::supervise::linux::readable_now(self.lost.as_fd()) {
            let guard = &mut self.guard;
            let _ = self
                .shared
                .handle
                .block_on(async move { tokio::time::timeout(RELEASE_TIMEOUT, guard).await });
        }
        self.guard.abort();
        for feeder in self
            .feeders
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain(..)
        {
            feeder.abort();
        }
        let owner = self.owner.as_str();
        let txn = Txn::new()
            .when([
                Compare::mod_revision(owner, CompareOp::Equal, self.claimed.revision),
                Compare::lease(owner, CompareOp::Equal, self.session.id),
            ])
            .and_then([
                TxnOp::delete(owner, None),
                TxnOp::delete(self.tenure.as_str(), None),
            ])
            .or_else([TxnOp::delete(self.tenure.as_str(), None)]);
        // Handed to the head waiter if it can take it so; else released as it always is (a
        // handover whose answer was lost leaves the owner key another's: the release then
        // ends only our tenure, which the handover ended too).
        self.follower.abort();
        let seen = self
            .line
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let pool = &self.shared.pool;
        let (dir, lease, claimed) = (self.dir.as_str(), self.session.id, &self.claimed);
        // The handover is given a short time of its own, so that a member that does not
        // answer leaves the plain release the whole of its own.
        let handed = self.shared.handle.block_on(async {
            tokio::time::timeout(HANDOVER_TIMEOUT, hand_over(pool, dir, lease, claimed, seen)).await
        });
        if let Ok(Ok(true)) = handed {
            tracing::debug!("lock handed over");
            return;
        }
        match self.shared.txn("release the lock", RELEASE_TIMEOUT, txn) {
            Ok(_) => tracing::debug!("lock released"),
            Err(err) => tracing::warn!("{err}; the lock frees when the lease expires"),
        }
    }
}

/// The lock on `dir` we just claimed, with its guard watching it.
pub(super) fn lease(
    shared: &Arc<Shared>,
    session: Arc<Session>,
    dir: &str,
    claimed: Claimed,
) -> Result<Box<dyn Lease>, LockError> {
    let (lost, notify) =
        UnixStream::pair().map_err(|e| shared.error("make the lock-loss pipe", e))?;
    let owner = keys::owner_key(dir);
    let guard = shared.handle.spawn(guard::guard(
        Watched {
            pool: shared.pool.clone(),
            owner: owner.clone(),
            lease: session.id,
            claimed,
            ttl: shared.ttl,
        },
        session.lost.clone(),
        notify,
    ));
    let line = Line::default();
    let follower = shared.handle.spawn(follow_line(
        shared.pool.clone(),
        dir.to_owned(),
        line.clone(),
    ));
    Ok(Box::new(EtcdLease {
        line,
        follower,
        shared: shared.clone(),
        tenure: keys::tenure_key(dir, session.id),
        dir: dir.to_owned(),
        session,
        owner,
        claimed,
        lost,
        guard,
        feeders: std::sync::Mutex::new(Vec::new()),
    }))
}
