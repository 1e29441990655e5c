//! The lock-backend seam: what `run`, `lock`, `locks` and the janitor need of a lock, whoever
//! keeps it. On one host the kernel keeps it ([`Local`](crate::lock::local::Local): flock on
//! files); a backend beyond one host adds a module that implements [`LockBackend`] and
//! [`Lease`], and none of the users changes.
//!
//! The contract every backend keeps:
//! - a lock is held by a live process only: when the holder dies, however it dies, the lock is
//!   free (or, for a backend that can lose it behind the holder's back, the holder is told:
//!   [`Lease::lost_fd`]);
//! - waiting is interruptible: a stop signal, the hard deadline or the budget ends a wait at
//!   once, and a lock got meanwhile is let go;
//! - a look ([`LockBackend::try_take`] with `create: false`, [`LockBackend::list`]) changes
//!   nothing.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::config::Class;
use crate::lock::list::LockInfo;
use crate::lock::{Holder, LockError};
use crate::names::{AppDomain, LockName};
use crate::supervise::fence;
use crate::supervise::shutdown::Event;
use crate::supervise::signals::SignalFunnel;

/// How often a long wait for a lock gives a sign of life.
pub(crate) const PROGRESS_EVERY: Duration = Duration::from_secs(30);

/// Which lock.
#[derive(Debug, Clone, Copy)]
pub(crate) enum LockKey<'a> {
    /// The lock of one app domain: held by its run for as long as the run lives, probed by the
    /// janitor.
    App(&'a AppDomain),
    /// A named host lock (`ccci-run lock NAME`).
    Named(&'a LockName),
}

/// What one non-blocking try saw.
pub(crate) enum Attempt {
    /// We hold it now. `current`: the lock still names what it locked (a lock whose record was
    /// removed and recreated meanwhile protects nothing).
    Taken {
        lease: Box<dyn Lease>,
        current: bool,
    },
    /// Nothing names this lock, so nobody can hold it (only when asked not to create it).
    Missing,
    /// Someone holds it: since `age` (when the backend knows), `holder` as the lock names it
    /// (on any host), with `note` when the verdict came from a second account of ownership
    /// rather than the lock itself.
    Held {
        age: Option<Duration>,
        holder: Option<Holder>,
        note: Option<String>,
    },
}

/// How to wait for a lock.
pub(crate) struct Wait<'a> {
    /// Who we are, recorded as the holder once the lock is ours.
    pub holder: &'a Holder,
    /// Stop signals and the deadline end the wait.
    pub funnel: &'a SignalFunnel,
    /// Give up at this instant (`None`: wait as long as it takes).
    pub until: Option<Instant>,
    /// Named locks: the queue class, and when a normal waiter joins the fast class.
    pub class: Class,
    pub promote_after: Duration,
    /// How long the holder may take to stop its command once it must (its kill grace and
    /// [`crate::config::KILL_MARGIN`]): a lock that can lapse behind its holder's back (a
    /// lease) counts as lost that long before it may lapse, and the next holder waits that
    /// long after a lapse.
    #[cfg_attr(
        not(feature = "etcd"),
        expect(dead_code, reason = "only a lock that can lapse needs it")
    )]
    pub stop_budget: Duration,
}

/// How a wait for a lock ended.
pub(crate) enum Taken {
    Held(Box<dyn Lease>),
    /// A way out arrived first; nothing is held.
    Stopped(Event),
    /// The budget ran out after `waited`, on `lock` (named as messages name it); `detail` says
    /// who holds it, or where in line we were.
    TimedOut {
        waited: Duration,
        lock: String,
        detail: String,
    },
}

/// A lock we hold. Dropping it releases it.
pub(crate) trait Lease {
    /// The holder line recorded with the lock, as read back now.
    fn holder(&self) -> Option<Holder>;
    /// Names this very lock instance, for a child that inherits it (`CCCI_HELD_LOCKS`): no
    /// commas, no newlines.
    fn token(&self) -> Result<String, LockError>;
    /// Readable once the lock was lost behind the holder's back (an expired or revoked lease,
    /// the lock's record deleted or replaced, the store wiped or restored from before);
    /// `None` for a backend where only the holder's exit ends a lock, as with the kernel's
    /// flock. The holder watches it next to its signals: a loss is a teardown (`lock-lost`, 76)
    /// that leaves the app alone, since someone else may hold it by then.
    fn lost_fd(&self) -> Option<BorrowedFd<'_>>;
    /// Remove what names the lock while still holding it (after a reap: the app is gone);
    /// whether it was removed. The lock is released when the lease is dropped.
    fn remove(&self) -> Result<bool, LockError>;
    /// A number larger for every later holder of this lock, on every host (for etcd: the
    /// lineage's base plus the owner key's creation revision, so also across a wipe; for a
    /// named lock on one host: its counter, [`crate::lock::queue`]): what a shared resource
    /// can check to refuse a holder that lost its lock, or one that came before. `None` where
    /// no token is kept (an app lock on one host).
    fn fencing_token(&self) -> Option<i64> {
        None
    }
    /// The holder lines found in the lock when we took it: a holder that let go cleanly
    /// leaves none, so a line names one that died holding it. Whoever takes the lock clears
    /// what that one left before its own command starts. Empty where the backend forgets a
    /// holder with its lock (an etcd key goes with its lease).
    fn predecessors(&self) -> Vec<Holder> {
        Vec::new()
    }
    /// Whether the lock can lapse behind its holder's back while the holder lives (a lease
    /// that expires when it is not renewed), so that a fence must guard what runs under it.
    fn lapses(&self) -> bool {
        false
    }
    /// For a lock that can lapse behind its holder's back (a lease that expires when it is not
    /// renewed): call `feed` at once, on the calling thread, and after every renewal with the earliest instant the lock
    /// may lapse, by this host's monotonic clock, until the lock is released or lost. What
    /// the holder started must be gone before then, whatever the holder itself is doing
    /// ([`crate::supervise::fence`]). `false`: the lock cannot lapse while its holder lives
    /// (the kernel's flock), and `feed` is never called.
    fn feed_expiry(&self, feed: Box<dyn FnMut(Instant) + Send>) -> bool {
        drop(feed);
        false
    }
    /// Until when, as things stand, the lock is safely ours: for a lock that can lapse, its
    /// earliest lapse less the holder's stop budget (later once the lease is renewed). `None`:
    /// for as long as we hold it.
    fn safe_until(&self) -> Option<Instant> {
        None
    }
    /// Whether the lock is provably still ours, now, with its stop budget still ahead: asked
    /// of the store (for etcd, a transaction on the owner key's revision and lease) right
    /// before a step that acts on what the lock protects (the teardown hook, the app's
    /// removal). `Err` says why not, or why it could not be proven.
    fn confirm(&self) -> Result<(), String> {
        Ok(())
    }
}

/// A place that keeps locks.
pub(crate) trait LockBackend {
    /// How to name the lock in messages (a path, a key).
    fn describe(&self, key: LockKey<'_>) -> String;
    /// Make sure locks can be kept (`create`) or looked at (a look creates nothing).
    fn prepare(&self, create: bool) -> Result<(), LockError>;
    /// Where the locks are kept, for messages (a directory, endpoints).
    fn describe_store(&self) -> String;
    /// A warning when the place the locks are kept does not exist (only a look leaves it so):
    /// most often a typo, and nothing there was looked at.
    fn missing_store(&self) -> Option<String>;
    /// Try once without waiting; `create: false` only looks.
    fn try_take(&self, key: LockKey<'_>, create: bool) -> Result<Attempt, LockError>;
    /// Take it within the wait's budget, interruptibly. If the lock is busy, `on_wait` is
    /// called when the wait begins and then every [`PROGRESS_EVERY`] while it lasts, with the
    /// holder when known and how long we have waited.
    fn take(
        &self,
        key: LockKey<'_>,
        wait: &Wait<'_>,
        on_wait: &mut dyn FnMut(Option<&Holder>, Duration),
    ) -> Result<Taken, LockError>;
    /// Whether process `pid` holds the lock instance `token` names.
    fn is_held_by(&self, key: LockKey<'_>, pid: i32, token: &str) -> bool;
    /// Every lock this backend keeps, held or not.
    fn list(&self, long_held: Duration) -> std::io::Result<Vec<LockInfo>>;
    /// Remove the records of free app locks that no app stands behind (`keep` says which do);
    /// returns what was (or, in a dry run, would be) removed, and what failed.
    fn tidy(&self, keep: &dyn Fn(&AppDomain) -> bool, dry_run: bool)
    -> (Vec<PathBuf>, Vec<String>);
}

/// True when `lease` has been lost by now.
pub(crate) fn is_lost(lease: &dyn Lease) -> bool {
    lease
        .lost_fd()
        .is_some_and(crate::supervise::signals::readable_now)
}

/// For a held lock: start the run's fence for `target`, its dead-man (it kills what the run
/// started should this process die). For a lock that can lapse behind its holder's back, also
/// feed it every renewal of `lease` (the first before this returns), and have `funnel` take the
/// fence's end as the lock's loss.
pub(crate) fn arm_fence(
    lease: &dyn Lease,
    funnel: &mut SignalFunnel,
    target: &fence::Target<'_>,
) -> std::io::Result<fence::Fence> {
    arm_started_fence(start_fence(target)?, lease, funnel)
}

/// As [`arm_fence`], for a `fence` started for the lock's target before the lock was taken, so
/// that its start is not on the way from the lock to the command.
pub(crate) fn arm_started_fence(
    mut fence: fence::Fence,
    lease: &dyn Lease,
    funnel: &mut SignalFunnel,
) -> std::io::Result<fence::Fence> {
    if lease.lapses() {
        let feed = fence.feed();
        lease.feed_expiry(Box::new(move |expiry| feed.expires_at(expiry)));
        funnel.watch_loss(fence.ended_fd()?);
        fence.guard_lease();
    }
    Ok(fence)
}

/// Start a fence for `target` that guards no lock: a dead-man only.
pub(crate) fn start_fence(target: &fence::Target<'_>) -> std::io::Result<fence::Fence> {
    fence::Fence::spawn(target, crate::report::is_json()).map_err(|err| {
        let hint = crate::supervise::linux::thread_limit_hint(&err);
        std::io::Error::new(err.kind(), format!("{err}{hint}"))
    })
}

/// A descriptor of our own on `lease`'s loss, for the signal funnel to watch; `None` when it
/// cannot be lost.
pub(crate) fn loss_watch(lease: &dyn Lease) -> std::io::Result<Option<OwnedFd>> {
    lease
        .lost_fd()
        .map(|fd| fd.try_clone_to_owned())
        .transpose()
}
