//! The local lock backend: the kernel keeps the locks, as flocks on files in the lock dir.
//!
//! An app lock is two lock files, taken always in this order: `<lock-dir>/cc-ci-app-<domain>.lock`
//! and the same name in `<runs-dir>/.domains/`. The second is defense in depth: a lock file
//! deleted by hand, or a lock dir that differs between runs (or between a run and the janitor),
//! can neither let two runs of one domain overlap nor a probe take a live run's domain for dead.
//! A named lock is `<lock-dir>/ccci-<NAME>.lock` behind its ticket queue
//! ([`crate::lock::queue`]).
//!
//! A flock is never lost while its holder lives, and always released when it dies.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::config::dirs::{self, Dir};
use crate::lock::backend::LockInfo;
use crate::lock::backend::{Attempt, LockBackend, LockKey, PROGRESS_EVERY, Taken, Wait};
use crate::lock::file::{HeldLock, LockError, LockFile, TryLock};
use crate::lock::file_lease::{FileLease, file_token};
use crate::lock::holder::Holder;
use crate::lock::list;
use crate::names::{self, AppDomain, RunAppPattern};
use crate::supervise::leftovers::remains;
use crate::supervise::linux;
use crate::supervise::signals::Awaited;

/// Locks as flocks on files.
#[derive(Debug, Clone)]
pub(crate) struct Local {
    lock_dir: PathBuf,
    domains_dir: PathBuf,
    pattern: RunAppPattern,
}

impl Local {
    pub(crate) fn new(lock_dir: &Path, runs_dir: &Path, pattern: &RunAppPattern) -> Self {
        Self {
            lock_dir: lock_dir.to_owned(),
            domains_dir: names::domains_dir(runs_dir),
            pattern: pattern.clone(),
        }
    }

    fn path(&self, key: LockKey<'_>) -> PathBuf {
        match key {
            LockKey::App(domain) => self.lock_dir.join(domain.lock_file_name()),
            LockKey::Named(name) => self.lock_dir.join(name.file_name()),
        }
    }

    /// The run that owns `domain` by the runs dir's account, if any. A try that finds that
    /// lock free lets go at once.
    fn owner_by_runs_dir(&self, domain: &AppDomain) -> Option<String> {
        let path = self.domains_dir.join(domain.lock_file_name());
        match LockFile::open_existing(&path) {
            Ok(Some(file)) => match file.try_lock() {
                Ok(TryLock::Busy(mut file)) => Some(
                    Holder::parse(&file.read_holder()).map_or_else(|| "?".to_owned(), |h| h.run_id),
                ),
                // Free, or unreadable: the lock dir's verdict stands.
                _ => None,
            },
            _ => None,
        }
    }

    /// Take the lock file at `path` in `dir` for `wait.holder`, waiting in ONE blocking flock
    /// (the kernel's queue) within the budget; a file replaced meanwhile is retried on the
    /// live path.
    fn take_file(
        &self,
        dir: &Path,
        path: &Path,
        wait: &Wait<'_>,
        on_wait: &mut dyn FnMut(Option<&Holder>, Duration),
    ) -> Result<Result<(HeldLock, Option<Holder>), Taken>, LockError> {
        crate::lock::file::prepare_dir(dir)?;
        let started = Instant::now();
        let mut announced = false;
        let mut unsigned_since: Option<Instant> = None;
        loop {
            let mut lock = match LockFile::open(path)?.try_lock()? {
                TryLock::Acquired(lock) => lock,
                TryLock::Busy(mut file) => {
                    if !announced {
                        let holder = Holder::parse(&file.read_holder());
                        // No line: the lock is changing hands (one holder has cleared its line,
                        // the next not yet written its own), or a janitor holds it for a moment
                        // to judge it, and may unlink it. Look again, at the path, until a line
                        // shows or the grace is over: neither is a holder without a line.
                        let unsigned = *unsigned_since.get_or_insert_with(Instant::now);
                        let polled = Instant::now() + crate::lock::holder::HANDOFF_POLL;
                        if holder.is_none()
                            && unsigned.elapsed() < crate::lock::holder::HANDOFF_GRACE
                            && wait.until.is_none_or(|until| polled < until)
                        {
                            drop(file);
                            std::thread::sleep(crate::lock::holder::HANDOFF_POLL);
                            continue;
                        }
                        announced = true;
                        on_wait(holder.as_ref(), Duration::ZERO);
                    }
                    let mut progress =
                        || on_wait(Holder::of_file_settled(path).as_ref(), started.elapsed());
                    let keepalive: Option<(Duration, &mut dyn FnMut())> =
                        Some((PROGRESS_EVERY, &mut progress));
                    match wait
                        .funnel
                        .await_work(file.lock_in_background()?, wait.until, keepalive)
                    {
                        Awaited::Done(outcome) => outcome?,
                        Awaited::Stopped(event) => return Ok(Err(Taken::Stopped(event))),
                        Awaited::TimedOut => {
                            return Ok(Err(Taken::TimedOut {
                                waited: started.elapsed(),
                                lock: path.display().to_string(),
                                detail: format!(
                                    "held by {}",
                                    Holder::describe(Holder::of_file_settled(path).as_ref())
                                ),
                            }));
                        }
                    }
                }
            };
            // A janitor may have reaped and unlinked the file while we waited on it.
            if !lock.identity_matches()? {
                tracing::info!(path = %path.display(), "lock file was replaced; retrying on the live path");
                continue;
            }
            // A line left in it names a holder that died holding it.
            let before = Holder::parse(&lock.read_holder());
            lock.write_holder(&Holder::taken_now(&wait.holder.to_line()))?;
            tracing::debug!(path = %path.display(), waited = ?started.elapsed(), "lock taken");
            return Ok(Ok((lock, before)));
        }
    }

    /// Unlink the unheld run-app lock files in `dir` that `keep` does not stand behind.
    fn tidy_dir(
        &self,
        dir: &Path,
        keep: &dyn Fn(&AppDomain) -> bool,
        dry_run: bool,
        tidied: &mut Vec<PathBuf>,
        errors: &mut Vec<String>,
    ) {
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return,
            Err(err) => {
                errors.push(format!("failed to list lock dir {}: {err}", dir.display()));
                return;
            }
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(domain) = name
                .to_str()
                .and_then(|n| self.pattern.domain_of_lock_file(n))
            else {
                continue;
            };
            if keep(&domain) {
                continue;
            }
            let path = entry.path();
            let file = match LockFile::open_existing(&path) {
                Ok(Some(file)) => file,
                Ok(None) => continue,
                Err(err) => {
                    tracing::warn!("janitor: not tidying {}: {err}", path.display());
                    continue;
                }
            };
            // Held: a live run that has not created its app yet. Leave it.
            let Ok(TryLock::Acquired(lock)) = file.try_lock() else {
                continue;
            };
            // A line naming a holder that died holding the lock, with something of it still
            // there: the line is how the next holder of the domain finds and clears that.
            if Holder::parse(&lock.read_holder()).is_some_and(|h| remains(&h.predecessor())) {
                tracing::info!(path = %path.display(), "not tidying: its last holder's leftovers are still there");
                continue;
            }
            if dry_run {
                if lock.identity_matches().unwrap_or(false) {
                    tidied.push(path);
                }
                continue;
            }
            match lock.unlink() {
                Ok(true) => tidied.push(path),
                Ok(false) => {}
                Err(err) => errors.push(err.to_string()),
            }
        }
    }
}

impl LockBackend for Local {
    fn describe(&self, key: LockKey<'_>) -> String {
        self.path(key).display().to_string()
    }

    fn prepare(&self, create: bool) -> Result<(), LockError> {
        if create {
            return crate::lock::file::prepare_dir(&self.lock_dir);
        }
        crate::lock::file::check_dir(&self.lock_dir).or_else(|err| match err {
            // A look creates nothing: a missing lock dir simply holds no locks.
            _ if !self.lock_dir.exists() => Ok(()),
            err => Err(err),
        })
    }

    fn describe_store(&self) -> String {
        self.lock_dir.display().to_string()
    }

    fn missing_store(&self) -> Option<String> {
        (!self.lock_dir.exists()).then(|| dirs::missing_line(Dir::Lock, &self.lock_dir))
    }

    fn try_take(&self, key: LockKey<'_>, create: bool) -> Result<Attempt, LockError> {
        let path = self.path(key);
        let opened = if create {
            LockFile::open(&path).map(Some)?
        } else {
            LockFile::open_existing(&path)?
        };
        let attempt = match opened {
            None => Attempt::Missing,
            Some(file) => match file.try_lock()? {
                TryLock::Busy(mut file) => {
                    return Ok(Attempt::Held {
                        age: file.age(),
                        holder: Holder::parse(&file.read_holder()),
                        note: None,
                    });
                }
                TryLock::Acquired(lock) => Attempt::Taken {
                    current: lock.identity_matches()?,
                    lease: Box::new(FileLease::one(lock)),
                },
            },
        };
        // Free here: the runs dir may still say a live run owns the domain.
        if let LockKey::App(domain) = key {
            if let Some(run_id) = self.owner_by_runs_dir(domain) {
                return Ok(Attempt::Held {
                    age: None,
                    holder: None,
                    note: Some(format!("held by run {run_id} under another lock dir")),
                });
            }
        }
        Ok(attempt)
    }

    fn take(
        &self,
        key: LockKey<'_>,
        wait: &Wait<'_>,
        on_wait: &mut dyn FnMut(Option<&Holder>, Duration),
    ) -> Result<Taken, LockError> {
        let domain = match key {
            LockKey::Named(name) => {
                crate::lock::file::prepare_dir(&self.lock_dir)?;
                return crate::lock::queue::wait::acquire(
                    name,
                    &self.path(key),
                    &self.lock_dir,
                    wait,
                );
            }
            LockKey::App(domain) => domain,
        };
        let mut held = Vec::new();
        let mut predecessors: Vec<Holder> = Vec::new();
        for dir in [&self.lock_dir, &self.domains_dir] {
            let path = dir.join(domain.lock_file_name());
            match self.take_file(dir, &path, wait, on_wait)? {
                Ok((lock, before)) => {
                    held.push(lock);
                    // Both files name the same holder, unless one was lost (a lock dir
                    // emptied by a reboot, a file deleted by hand).
                    predecessors.extend(before.filter(|b| !predecessors.contains(b)));
                }
                Err(taken) => return Ok(taken),
            }
        }
        Ok(Taken::Held(Box::new(FileLease {
            locks: held,
            predecessors,
            fencing: None,
        })))
    }

    fn is_held_by(&self, key: LockKey<'_>, pid: i32, token: &str) -> bool {
        let Ok(meta) = std::fs::metadata(self.path(key)) else {
            return false;
        };
        if token != file_token(&meta) {
            return false;
        }
        let (major, minor) = (
            crate::supervise::procfs::dev_major(meta.dev()),
            crate::supervise::procfs::dev_minor(meta.dev()),
        );
        linux::proc_locks().is_ok_and(|locks| {
            locks.iter().any(|l| {
                !l.waiting
                    && l.pid == pid
                    && l.inode == meta.ino()
                    && l.major == major
                    && l.minor == minor
            })
        })
    }

    fn list(&self, long_held: Duration) -> io::Result<Vec<LockInfo>> {
        list::list(&self.lock_dir, long_held)
    }

    fn tidy(
        &self,
        keep: &dyn Fn(&AppDomain) -> bool,
        dry_run: bool,
    ) -> (Vec<PathBuf>, Vec<String>) {
        let (mut tidied, mut errors) = (Vec::new(), Vec::new());
        for dir in [&self.lock_dir, &self.domains_dir] {
            self.tidy_dir(dir, keep, dry_run, &mut tidied, &mut errors);
        }
        // The named locks' queues: tickets of waiters that died with nobody behind them.
        for entry in std::fs::read_dir(&self.lock_dir)
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name();
            let is_queue = name
                .as_encoded_bytes()
                .strip_suffix(b".queue")
                .and_then(crate::names::named_lock_of_file)
                .is_some();
            if is_queue && entry.file_type().is_ok_and(|t| t.is_dir()) {
                let queue = crate::lock::queue::Queue::existing(entry.path());
                tidied.extend(queue.tidy_dead(dry_run));
            }
        }
        (tidied, errors)
    }
}
