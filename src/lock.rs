//! Lock files: the only module that calls `flock` (clippy's `disallowed-methods` enforces it).
//!
//! A lock file is opened `O_RDWR|O_CREAT|O_NOFOLLOW|O_CLOEXEC` with mode 0600 and refused when it
//! is a symlink, not a regular file, or owned by another user: nobody else can park our runs by
//! pre-creating and holding a lock file, nor make us write through a link. Locks are released
//! only by closing the descriptor (process exit included); a holder's lock never outlives it.
#![allow(clippy::disallowed_methods)]

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg, OFlag};
use nix::sys::stat::{fstat, stat};
use nix::unistd::Uid;

/// Why a lock file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("refusing lock file {path}: it is a symbolic link")]
    Symlink { path: PathBuf },
    #[error("refusing lock file {path}: it is not a regular file")]
    NotRegular { path: PathBuf },
    #[error("refusing lock file {path}: it is owned by uid {owner}, not by us (uid {us})")]
    ForeignOwner { path: PathBuf, owner: u32, us: u32 },
    #[error("failed to {what} lock file {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
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
    pub fn is_foreign(&self) -> bool {
        !matches!(self, Self::Io { .. })
    }
}

/// An open, safe, not yet locked lock file.
#[derive(Debug)]
pub struct LockFile {
    file: File,
    path: PathBuf,
}

/// A lock file we hold an exclusive flock on. Dropping it releases the lock.
#[derive(Debug)]
pub struct HeldLock {
    lock: Flock<File>,
    path: PathBuf,
}

/// Outcome of a non-blocking attempt.
#[derive(Debug)]
pub enum TryLock {
    Acquired(HeldLock),
    /// Someone else holds it; the file is handed back for reading its holder metadata.
    Busy(LockFile),
}

impl LockFile {
    /// Open (creating if needed) the lock file at `path`, refusing anything unsafe.
    pub fn open(path: &Path) -> Result<Self, LockError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
            .open(path)
            .map_err(
                |err| match Errno::from_raw(err.raw_os_error().unwrap_or(0)) {
                    // O_NOFOLLOW on a symlink fails with ELOOP.
                    Errno::ELOOP => LockError::Symlink {
                        path: path.to_owned(),
                    },
                    Errno::EISDIR => LockError::NotRegular {
                        path: path.to_owned(),
                    },
                    _ => LockError::io("open", path, err),
                },
            )?;
        let meta = file
            .metadata()
            .map_err(|err| LockError::io("inspect", path, err))?;
        if !meta.file_type().is_file() {
            return Err(LockError::NotRegular {
                path: path.to_owned(),
            });
        }
        let us = Uid::effective().as_raw();
        if meta.uid() != us {
            return Err(LockError::ForeignOwner {
                path: path.to_owned(),
                owner: meta.uid(),
                us,
            });
        }
        Ok(Self {
            file,
            path: path.to_owned(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Try to take the exclusive lock without waiting.
    pub fn try_lock(self) -> Result<TryLock, LockError> {
        let path = self.path;
        match Flock::lock(self.file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(TryLock::Acquired(HeldLock { lock, path })),
            Err((file, Errno::EWOULDBLOCK)) => Ok(TryLock::Busy(Self { file, path })),
            Err((_, errno)) => Err(LockError::io("lock", &path, errno)),
        }
    }

    /// The holder metadata a holder wrote into the file (at most 4 KiB, lossily decoded).
    pub fn read_holder(&mut self) -> String {
        let mut buf = Vec::new();
        let _ = (&self.file).take(4096).read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).trim().to_owned()
    }
}

impl HeldLock {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True when the locked descriptor is still the inode the path names. A lock on an unlinked
    /// (or replaced) inode protects nothing: the next opener gets a fresh file.
    pub fn identity_matches(&self) -> Result<bool, LockError> {
        let held = fstat(self.lock.as_fd()).map_err(|e| LockError::io("inspect", &self.path, e))?;
        match stat(&self.path) {
            Ok(now) => Ok(now.st_dev == held.st_dev && now.st_ino == held.st_ino),
            Err(Errno::ENOENT) => Ok(false),
            Err(err) => Err(LockError::io("inspect", &self.path, err)),
        }
    }

    /// Replace the file's contents with `holder` (run id, pid, start time, host ...).
    pub fn write_holder(&mut self, holder: &str) -> Result<(), LockError> {
        let file: &File = &self.lock;
        file.set_len(0)
            .and_then(|()| {
                let mut writer = file;
                std::io::Seek::rewind(&mut writer)?;
                writer.write_all(holder.as_bytes())
            })
            .map_err(|err| LockError::io("write holder metadata to", &self.path, err))
    }
}
