//! Lock files: the only module that calls `flock` (clippy's `disallowed-methods` enforces it).
//!
//! A lock file is opened `O_RDWR|O_CREAT|O_NOFOLLOW|O_CLOEXEC` with mode 0600 and refused when it
//! is a symlink, not a regular file, or owned by another user: nobody else can park our runs by
//! pre-creating and holding a lock file, nor make us write through a link. A lock directory that
//! others may write to without the sticky bit is refused too (they could swap our files).
//!
//! Acquisition follows flopen(3): open, lock, then compare `(dev, ino)` of the locked descriptor
//! with what the path names now; a lock on an unlinked inode protects nothing. Locks are released
//! only by closing the descriptor (process exit included), so a lock never outlives its holder.
//!
//! A blocking acquisition is ONE blocking `flock` call: the kernel queues blocked waiters, and
//! re-entering the call loses the place. It runs on a [`Worker`] thread ([`PendingLock`]) so that
//! the main thread can keep watching signals and budgets without a window in which a signal goes
//! unnoticed; cancelling it interrupts the call with the kick signal.
#![allow(clippy::disallowed_methods)]

use std::fs::File;
use std::io::{self, Read, Seek, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg, OFlag};
use nix::sys::stat::{fstat, stat};
use nix::unistd::Uid;

use crate::supervise::worker::{Awaitable, Worker};

/// Why a lock file (or its directory) could not be used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LockError {
    #[error("refusing lock file {path}: it is a symbolic link")]
    Symlink { path: PathBuf },
    #[error("refusing lock file {path}: it is not a regular file")]
    NotRegular { path: PathBuf },
    #[error("refusing lock file {path}: it is owned by uid {owner}, not by us (uid {us})")]
    ForeignOwner { path: PathBuf, owner: u32, us: u32 },
    #[error(
        "refusing lock file {path}: it has {links} hard links (a lock file has exactly one; \
         another name could make us write through it)"
    )]
    HardLinked { path: PathBuf, links: u64 },
    #[error("refusing lock directory {path}: {why}")]
    UnsafeDir { path: PathBuf, why: String },
    #[error("failed to {what} in queue {dir}: {source}")]
    Queue {
        what: &'static str,
        dir: PathBuf,
        source: io::Error,
    },
    #[cfg(feature = "etcd")]
    #[error("etcd at {endpoints}: failed to {what}: {detail}")]
    Etcd {
        endpoints: String,
        what: String,
        detail: String,
    },
    #[cfg(not(feature = "etcd"))]
    #[error(
        "etcd endpoints are set (--etcd-endpoints, CCCI_ETCD_ENDPOINTS, etcd_endpoints) but this \
         build has no etcd backend (build it with --features etcd); refusing to fall back to \
         this host's flock, which excludes nobody on another host"
    )]
    NoEtcd,
    #[error("failed to {what} lock file {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl From<LockError> for crate::error::Error {
    fn from(err: LockError) -> Self {
        Self::command(err, crate::exit::FAILURE)
    }
}

impl LockError {
    fn io(what: &'static str, path: &Path, source: impl Into<io::Error>) -> Self {
        Self::Io {
            what,
            path: path.to_owned(),
            source: source.into(),
        }
    }

    /// True when the file is not ours to touch (the janitor's `foreign` decision).
    pub(crate) fn is_foreign(&self) -> bool {
        matches!(
            self,
            Self::Symlink { .. }
                | Self::NotRegular { .. }
                | Self::ForeignOwner { .. }
                | Self::HardLinked { .. }
        )
    }

    /// True when the file is another user's, or closed to us: whether it is held is not ours
    /// to know.
    pub(crate) fn is_not_ours(&self) -> bool {
        match self {
            Self::ForeignOwner { .. } => true,
            Self::Io { source, .. } => source.kind() == io::ErrorKind::PermissionDenied,
            _ => false,
        }
    }
}

/// Make sure `dir` exists and is safe to keep lock files in: a directory owned by us or root,
/// and not writable by others unless sticky (as `/run/lock` is). A missing one is made (0755
/// under the usual umask), in its parent only: a missing parent is a setting to fix
/// (`config::dirs`), never made.
pub(crate) fn prepare_dir(dir: &Path) -> Result<(), LockError> {
    match std::fs::DirBuilder::new().create(dir) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {}
        Err(err) => {
            return Err(LockError::UnsafeDir {
                path: dir.to_owned(),
                why: format!("cannot create it: {err}"),
            });
        }
    }
    check_dir(dir)
}

/// Make sure `dir` exists as a private directory of ours (mode 0700 when created): a real
/// directory, not a link, owned by us, writable by nobody else.
pub(crate) fn prepare_private_dir(dir: &Path) -> Result<(), LockError> {
    let unsafe_dir = |why: String| LockError::UnsafeDir {
        path: dir.to_owned(),
        why,
    };
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {}
        Err(err) => return Err(unsafe_dir(format!("cannot create it: {err}"))),
    }
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| unsafe_dir(format!("cannot inspect it: {e}")))?;
    if !meta.file_type().is_dir() {
        return Err(unsafe_dir(
            "it is not a directory (or is a symbolic link)".to_owned(),
        ));
    }
    if !crate::trust::ours(meta.uid()) {
        return Err(unsafe_dir(format!(
            "it is owned by uid {}, not by {}",
            meta.uid(),
            crate::trust::who()
        )));
    }
    if meta.permissions().mode() & 0o022 != 0 {
        return Err(unsafe_dir(format!(
            "mode {:o} lets others add or remove entries",
            meta.permissions().mode() & 0o7777
        )));
    }
    Ok(())
}

/// The safety rules of [`prepare_dir`], without creating anything.
pub(crate) fn check_dir(dir: &Path) -> Result<(), LockError> {
    let unsafe_dir = |why: String| LockError::UnsafeDir {
        path: dir.to_owned(),
        why,
    };
    let meta = std::fs::metadata(dir).map_err(|e| unsafe_dir(format!("cannot inspect it: {e}")))?;
    if !meta.is_dir() {
        return Err(unsafe_dir("it is not a directory".to_owned()));
    }
    if !crate::trust::ours(meta.uid()) && meta.uid() != 0 {
        return Err(unsafe_dir(format!(
            "it is owned by uid {}, neither {} nor root{}",
            meta.uid(),
            crate::trust::who(),
            if Uid::effective().is_root() && crate::trust::runner().is_none() {
                " (a runner of its own user: name it as runner_user in the configuration file)"
            } else {
                ""
            }
        )));
    }
    let mode = meta.permissions().mode();
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(unsafe_dir(format!(
            "mode {:o} lets others replace lock files (writable without the sticky bit)",
            mode & 0o7777
        )));
    }
    Ok(())
}

/// An open, safe, not yet locked lock file.
#[derive(Debug)]
pub(crate) struct LockFile {
    file: File,
    path: PathBuf,
}

/// A lock file we hold an exclusive flock on. Dropping it releases the lock, after clearing the
/// holder line we wrote: a line left in a free lock file is then the sign of a holder that
/// died holding it, whose leftovers the next holder clears.
#[derive(Debug)]
pub(crate) struct HeldLock {
    lock: Flock<File>,
    path: PathBuf,
    /// We wrote a holder line into it.
    wrote_holder: bool,
}

impl Drop for HeldLock {
    fn drop(&mut self) {
        if self.wrote_holder {
            // Before the flock goes (the field is dropped after this): nobody else writes
            // while we hold it.
            let file: &File = &self.lock;
            if let Err(err) = file.set_len(0) {
                tracing::warn!(path = %self.path.display(), "failed to clear the holder line: {err}");
            }
        }
    }
}

/// Outcome of a non-blocking attempt.
#[derive(Debug)]
pub(crate) enum TryLock {
    Acquired(HeldLock),
    /// Someone else holds it; the file is handed back for reading its holder metadata.
    Busy(LockFile),
}

impl LockFile {
    /// Open (creating if needed) the lock file at `path`, refusing anything unsafe.
    pub(crate) fn open(path: &Path) -> Result<Self, LockError> {
        Self::open_with(path, true).map(|f| f.expect("created when missing"))
    }

    /// Open the lock file at `path` if it exists (`None` when it does not): a probe that must
    /// change nothing, like a dry run, never creates one.
    pub(crate) fn open_existing(path: &Path) -> Result<Option<Self>, LockError> {
        Self::open_with(path, false)
    }

    fn open_with(path: &Path, create: bool) -> Result<Option<Self>, LockError> {
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .mode(0o600)
            .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK).bits())
            .open(path);
        let file = match opened {
            Ok(file) => file,
            Err(err) => {
                return match Errno::from_raw(err.raw_os_error().unwrap_or(0)) {
                    Errno::ENOENT if !create => Ok(None),
                    // O_NOFOLLOW on a symlink fails with ELOOP.
                    Errno::ELOOP => Err(LockError::Symlink {
                        path: path.to_owned(),
                    }),
                    // A directory, or a socket (ENXIO) where the file should be.
                    Errno::EISDIR | Errno::ENXIO => Err(LockError::NotRegular {
                        path: path.to_owned(),
                    }),
                    _ => Err(LockError::io("open", path, err)),
                };
            }
        };
        let meta = file
            .metadata()
            .map_err(|err| LockError::io("inspect", path, err))?;
        if !meta.file_type().is_file() {
            return Err(LockError::NotRegular {
                path: path.to_owned(),
            });
        }
        let us = Uid::effective().as_raw();
        if !crate::trust::ours(meta.uid()) {
            return Err(LockError::ForeignOwner {
                path: path.to_owned(),
                owner: meta.uid(),
                us,
            });
        }
        // Checked on the opened descriptor: a second name for the inode (a hard link planted in
        // a world-writable lock dir, where fs.protected_hardlinks is off) would have us write
        // holder metadata into whatever file it really is.
        if meta.nlink() > 1 {
            return Err(LockError::HardLinked {
                path: path.to_owned(),
                links: meta.nlink(),
            });
        }
        // Anyone who can open a lock file can flock it: keep our own files private. A probe
        // (`create == false`) must change nothing, so only a would-be holder fixes this.
        if create && meta.permissions().mode() & 0o077 != 0 {
            file.set_permissions(std::fs::Permissions::from_mode(0o600))
                .map_err(|err| LockError::io("restrict permissions of", path, err))?;
        }
        Ok(Some(Self {
            file,
            path: path.to_owned(),
        }))
    }

    /// Try to take the exclusive lock without waiting.
    pub(crate) fn try_lock(self) -> Result<TryLock, LockError> {
        let path = self.path;
        match Flock::lock(self.file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(TryLock::Acquired(HeldLock {
                lock,
                path,
                wrote_holder: false,
            })),
            Err((file, Errno::EWOULDBLOCK)) => Ok(TryLock::Busy(Self { file, path })),
            Err((_, errno)) => Err(LockError::io("lock", &path, errno)),
        }
    }

    /// Take the lock, blocking in this thread. Only for locks held for an instant (a counter's
    /// read-increment-write): a signal makes it return `EINTR` with the file handed back.
    pub(crate) fn lock_briefly(self) -> Result<HeldLock, (LockFile, LockError)> {
        let path = self.path;
        match Flock::lock(self.file, FlockArg::LockExclusive) {
            Ok(lock) => Ok(HeldLock {
                lock,
                path,
                wrote_holder: false,
            }),
            Err((file, errno)) => {
                let err = LockError::io("lock", &path, errno);
                Err((Self { file, path }, err))
            }
        }
    }

    /// Start ONE blocking exclusive flock on a helper thread.
    pub(crate) fn lock_in_background(self) -> Result<PendingLock, LockError> {
        let path = self.path;
        let file = self.file;
        let worker = Worker::spawn("flock", move |cancel| {
            let mut file = file;
            loop {
                if cancel.is_cancelled() {
                    return Err(Errno::ECANCELED);
                }
                match Flock::lock(file, FlockArg::LockExclusive) {
                    Ok(lock) => return Ok(lock),
                    // Only a kick interrupts this thread, and a kick means "look at the flag".
                    Err((again, Errno::EINTR)) => file = again,
                    Err((_, errno)) => return Err(errno),
                }
            }
        })
        .map_err(|e| LockError::io("wait for", &path, e))?;
        Ok(PendingLock { worker, path })
    }

    /// The holder metadata a holder wrote into the file (at most 4 KiB, lossily decoded).
    pub(crate) fn read_holder(&mut self) -> String {
        read_holder(&self.file)
    }

    /// Seconds since the file was last modified (a holder touches it when it acquires).
    pub(crate) fn age(&self) -> Option<Duration> {
        age_of(&self.file)
    }
}

fn read_holder(mut file: &File) -> String {
    let mut buf = Vec::new();
    let _ = file.rewind();
    let _ = file.take(4096).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).trim().to_owned()
}

fn age_of(file: &File) -> Option<Duration> {
    let modified = file.metadata().and_then(|m| m.modified()).ok()?;
    Some(
        SystemTime::now()
            .duration_since(modified)
            .unwrap_or_default(),
    )
}

impl HeldLock {
    /// True when the locked descriptor is still the inode the path names. A lock on an unlinked
    /// (or replaced) inode protects nothing: the next opener gets a fresh file.
    pub(crate) fn identity_matches(&self) -> Result<bool, LockError> {
        let held = fstat(self.lock.as_fd()).map_err(|e| LockError::io("inspect", &self.path, e))?;
        match stat(&self.path) {
            Ok(now) => Ok(now.st_dev == held.st_dev && now.st_ino == held.st_ino),
            Err(Errno::ENOENT) => Ok(false),
            Err(err) => Err(LockError::io("inspect", &self.path, err)),
        }
    }

    /// Replace the file's contents with `holder` (run id, pid, start time, host ...); this also
    /// touches its mtime, which is what lock ages are measured from.
    pub(crate) fn write_holder(&mut self, holder: &str) -> Result<(), LockError> {
        self.wrote_holder = true;
        let mut file: &File = &self.lock;
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(format!("{holder}\n").as_bytes()))
            .map_err(|err| LockError::io("write holder metadata to", &self.path, err))
    }

    pub(crate) fn read_holder(&self) -> String {
        read_holder(&self.lock)
    }

    /// The locked file, for reading and writing what it holds.
    pub(crate) fn file(&self) -> &File {
        &self.lock
    }

    /// Unlink the lock file while still holding it, but only if the path still names our inode
    /// (otherwise it is someone else's newer file). Returns whether it was unlinked.
    pub(crate) fn unlink(&self) -> Result<bool, LockError> {
        if !self.identity_matches()? {
            return Ok(false);
        }
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(true),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(err) => Err(LockError::io("unlink", &self.path, err)),
        }
    }
}

/// A blocking flock under way on a helper thread.
#[derive(Debug)]
pub(crate) struct PendingLock {
    worker: Worker<Result<Flock<File>, Errno>>,
    path: PathBuf,
}

impl Awaitable for PendingLock {
    type Output = Result<HeldLock, LockError>;

    /// Becomes readable when the flock call has returned.
    fn ready_fd(&self) -> BorrowedFd<'_> {
        self.worker.ready_fd()
    }

    /// The outcome, if the call has returned.
    fn try_finish(&mut self) -> Option<Result<HeldLock, LockError>> {
        Some(match self.worker.try_finish()? {
            Ok(lock) => Ok(HeldLock {
                lock,
                path: self.path.clone(),
                wrote_holder: false,
            }),
            Err(errno) => Err(LockError::io("lock", &self.path, errno)),
        })
    }

    /// Stop waiting: interrupt the call and let go of whatever it got.
    fn cancel(self) {
        drop(self.worker.cancel());
    }
}
