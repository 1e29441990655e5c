//! A lock held through lock files: the held file (and any second account of it), released when
//! the lease is dropped, with the fencing token a named lock's queue gave it.
//!
//! Floor: backends (docs/architecture.md): imports the floors below and the other backends, never a
//! command.

use std::os::fd::BorrowedFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use crate::lock::backend::Lease;
use crate::lock::file::{HeldLock, LockError};
use crate::lock::holder::Holder;

/// Held lock files; the first is the lock itself, any other its second account.
#[derive(Debug)]
pub(crate) struct FileLease {
    pub(crate) locks: Vec<HeldLock>,
    /// The holder lines found when they were taken.
    pub(crate) predecessors: Vec<Holder>,
    /// A named lock's fencing token ([`crate::lock::queue`]); app locks on one host keep none.
    pub(crate) fencing: Option<i64>,
}

impl FileLease {
    pub(crate) fn one(lock: HeldLock) -> Self {
        Self {
            locks: vec![lock],
            predecessors: Vec::new(),
            fencing: None,
        }
    }

    /// One lock file, taken over from the holder its line named.
    pub(crate) fn taken_over(lock: HeldLock, before: Option<Holder>) -> Self {
        Self {
            locks: vec![lock],
            predecessors: before.into_iter().collect(),
            fencing: None,
        }
    }

    pub(crate) fn with_fencing_token(self, token: i64) -> Self {
        Self {
            fencing: Some(token),
            ..self
        }
    }
}

impl Lease for FileLease {
    fn holder(&self) -> Option<Holder> {
        Holder::parse(&self.locks.first()?.read_holder())
    }

    fn token(&self) -> Result<String, LockError> {
        let Some(lock) = self.locks.first() else {
            return Ok(String::new());
        };
        let meta = lock.file().metadata().map_err(|source| LockError::Io {
            what: "inspect",
            path: PathBuf::new(),
            source,
        })?;
        Ok(file_token(&meta))
    }

    fn lost_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }

    fn remove(&self) -> Result<bool, LockError> {
        match self.locks.first() {
            Some(lock) => lock.unlink(),
            None => Ok(false),
        }
    }

    fn predecessors(&self) -> Vec<Holder> {
        self.predecessors.clone()
    }

    fn fencing_token(&self) -> Option<i64> {
        self.fencing
    }
}

/// `MAJOR:MINOR:INODE` of a lock file: names the very file a flock is on.
pub(crate) fn file_token(meta: &std::fs::Metadata) -> String {
    format!(
        "{}:{}:{}",
        crate::supervise::procfs::dev_major(meta.dev()),
        crate::supervise::procfs::dev_minor(meta.dev()),
        meta.ino()
    )
}
