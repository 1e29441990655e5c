//! The ticket queue in front of a named lock file: how the local backend makes `ccci-run lock
//! NAME` fair and bounded.
//!
//! A bare `flock --wait` starves under continuous arrivals: a waiter that re-enters the kernel's
//! queue loses its place, and a wait budget bounds one attempt, not the wait. Here every waiter
//! takes a ticket in `ccci-<NAME>.lock.queue/`:
//!
//! - `rank-seq-pid`: the sequence number comes from a counter file incremented under its own
//!   flock, and the ticket is published before that flock is released, so a later ticket is never
//!   visible while an earlier one is not. Fast tickets (rank 0) precede normal ones (rank 1); a
//!   normal ticket that waited past `--promote-after` is renamed into the fast class, keeping its
//!   sequence number.
//! - Only the head ticket enters ONE blocking flock on `ccci-<NAME>.lock` for its remaining
//!   budget; everyone else sleeps until the queue directory changes (inotify, no polling) or the
//!   owner of the ticket right ahead dies (its pidfd). Where the host has no inotify instance or
//!   watch left for us (EMFILE, ENOSPC: the user's share is used up), the waiter looks at the
//!   queue every 20–50 ms instead (jittered, so waiters do not look in step) and says so once;
//!   order and fairness are the tickets', not the wake-up's, so they hold either way.
//! - A ticket holds its owner's identity ([`ProcessIdentity`]): a ticket whose owner is judged
//!   dead (gone, or its pid now names another process) is removed by whoever looks, at once.
//!   Every waiter touches its ticket every 2 s (the head too, while parked — from the main
//!   thread, which holds no lock and never recreates a removed ticket); a ticket whose owner
//!   cannot be judged from here (another pid namespace's, or one that never wrote itself in)
//!   and that is older than 10 s, or any ticket older than 1800 s, is removed too. Removing a
//!   live waiter's ticket costs it its place, never the lock's exclusion: it takes a new one.
//!
//! Invariant: the ticket is gone as soon as its owner holds the lock, gives up, or dies (the
//! latter at the next look, which the death itself wakes); the lock itself is released only by
//! process exit.

use std::io::{self, Read, Seek, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use inotify::{Inotify, WatchMask};
use nix::errno::Errno;
use nix::sys::signal::Signal;
use nix::sys::stat::{UtimensatFlags, utimensat};
use nix::sys::time::TimeSpec;
use nix::unistd::Pid;
use rand::RngExt;

use crate::config::Class;
use crate::lock::backend::{Taken, Wait};
use crate::lock::local::FileLease;
use crate::lock::{self, HeldLock, LockError, LockFile, TryLock};
use crate::names::LockName;
use crate::report;
use crate::supervise::identity::{Judge, ProcessIdentity, Verdict};
use crate::supervise::linux;
use crate::supervise::shutdown::Event;
use crate::supervise::signals::{Awaited, SignalFunnel, shutdown_events};

/// A ticket whose owner cannot be judged is removed once it is this old (untouched that long).
const UNJUDGED_OWNER_AGE: Duration = Duration::from_secs(10);
/// Any ticket this old is stale: its owner stopped touching it (or its pid was recycled).
const STALE_AGE: Duration = Duration::from_secs(1800);
/// How often a waiter touches its own ticket.
const KEEPALIVE: Duration = Duration::from_secs(2);
/// How soon a waiter looks again when the owner of the ticket ahead is already gone.
const DEAD_AHEAD_RETRY: Duration = Duration::from_millis(20);
/// Without inotify, a waiter looks at the queue again after a pause drawn from this range
/// (milliseconds): short enough for a prompt handoff, jittered so waiters spread their looks.
const POLL_MS: std::ops::RangeInclusive<u64> = 20..=50;
/// How often a waiter repeats its waiting line.
const REPORT_EVERY: Duration = Duration::from_secs(60);

/// A place in the queue; its file name is `rank-seq-pid`, so names sort in queue order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub(crate) struct Ticket {
    pub class: Class,
    pub seq: u64,
    pub pid: i32,
}

impl Ticket {
    pub(crate) fn file_name(&self) -> String {
        format!("{}-{:012}-{}", self.class.rank(), self.seq, self.pid)
    }

    /// Parse a queue entry's name; anything else in the directory is not a ticket.
    pub(crate) fn parse(name: &str) -> Option<Self> {
        let mut parts = name.split('-');
        let class = match parts.next()? {
            "0" => Class::Fast,
            "1" => Class::Normal,
            _ => return None,
        };
        let seq = parts.next()?;
        let pid = parts.next()?;
        // Only canonical names are tickets: a ticket is removed by the name it formats to, so
        // `1-…-01` taken for pid 1 could never be removed and would wedge the queue.
        if parts.next().is_some()
            || seq.len() != 12
            || !seq.bytes().all(|b| b.is_ascii_digit())
            || pid.is_empty()
            || pid.starts_with('0')
            || !pid.bytes().all(|b| b.is_ascii_digit())
        {
            return None;
        }
        let pid: i32 = pid.parse().ok().filter(|p| *p > 0)?;
        Some(Self {
            class,
            seq: seq.parse().ok()?,
            pid,
        })
    }

    /// "12 (normal, pid 4242)"
    fn describe(&self) -> String {
        format!("{} ({}, pid {})", self.seq, self.class.as_str(), self.pid)
    }
}

/// A ticket seen in the queue directory, with its age.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct QueuedTicket {
    pub ticket: Ticket,
    pub age_s: u64,
}

/// The queue directory of one named lock.
#[derive(Debug)]
pub(crate) struct Queue {
    dir: PathBuf,
}

impl Queue {
    pub(crate) fn dir_for(lock_dir: &Path, name: &LockName) -> PathBuf {
        lock_dir.join(name.queue_dir_name())
    }

    /// The queue of an existing directory, for looking only.
    pub(crate) fn existing(dir: PathBuf) -> Self {
        Self { dir }
    }

    pub(crate) fn open(lock_dir: &Path, name: &LockName) -> Result<Self, LockError> {
        let dir = Self::dir_for(lock_dir, name);
        lock::prepare_private_dir(&dir)?;
        Ok(Self { dir })
    }

    fn io_err(&self, what: &'static str) -> impl FnOnce(io::Error) -> LockError + '_ {
        move |source| LockError::Queue {
            what,
            dir: self.dir.clone(),
            source,
        }
    }

    fn path(&self, ticket: &Ticket) -> PathBuf {
        self.dir.join(ticket.file_name())
    }

    /// Take the next sequence number and publish the ticket, both under the counter's flock.
    fn take_ticket(
        &self,
        class: Class,
        funnel: &SignalFunnel,
    ) -> Result<Option<Ticket>, LockError> {
        let mut counter = LockFile::open(&self.dir.join(crate::names::QUEUE_COUNTER_FILE))?;
        let held = loop {
            match counter.lock_briefly() {
                Ok(held) => break held,
                Err((file, LockError::Io { source, .. }))
                    if source.raw_os_error() == Some(Errno::EINTR as i32) =>
                {
                    if !funnel_has_shutdown(funnel) {
                        counter = file;
                        continue;
                    }
                    return Ok(None);
                }
                Err((_, err)) => return Err(err),
            }
        };
        let (mut file, text) = counter_text(&held);
        // A garbled counter must not send sequence numbers backwards: never below a live ticket.
        let floor = self
            .scan()
            .iter()
            .map(|t| t.ticket.seq + 1)
            .max()
            .unwrap_or(0);
        let seq = text.trim().parse::<u64>().unwrap_or(0).max(floor);
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(format!("{}\n", seq + 1).as_bytes()))
            .map_err(self.io_err("advance the counter"))?;
        let ticket = Ticket {
            class,
            seq,
            pid: std::process::id() as i32,
        };
        // The owner's identity goes in the ticket, so whoever looks, in whatever namespace,
        // can tell a dead owner (or a recycled pid) at once.
        let identity = ProcessIdentity::own()
            .ok()
            .and_then(|me| serde_json::to_string(me).ok())
            .unwrap_or_default();
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(self.path(&ticket))
            .and_then(|mut file| file.write_all(format!("{identity}\n").as_bytes()))
            .map_err(self.io_err("publish a ticket"))?;
        drop(held);
        Ok(Some(ticket))
    }

    /// The next holder's fencing token: above the last one given out here, and at least the
    /// wall clock in microseconds since the epoch. The counter is read and rewritten under its
    /// own flock, so no two holders get the same token even if exclusion broke (a lock file
    /// replaced by hand); the clock is the floor for a counter lost with the lock dir (a tmpfs
    /// after a reboot, the queue directory removed), so the next token is still above every
    /// earlier one unless the clock was set back past it.
    fn next_fencing_token(&self) -> Result<i64, LockError> {
        let path = self.dir.join(crate::names::FENCING_COUNTER_FILE);
        let mut counter = LockFile::open(&path)?;
        let held = loop {
            match counter.lock_briefly() {
                Ok(held) => break held,
                // Held for an instant by whoever writes it: a signal is seen once we hold the
                // lock, by the command's supervision.
                Err((file, LockError::Io { source, .. }))
                    if source.raw_os_error() == Some(Errno::EINTR as i32) =>
                {
                    counter = file;
                }
                Err((_, err)) => return Err(err),
            }
        };
        let (mut file, text) = counter_text(&held);
        let last = text.trim().parse::<i64>().unwrap_or(0);
        let clock = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
        // A counter that cannot rise is refused, never reused: the same token for two holders
        // is what fencing exists to prevent.
        let token = last
            .checked_add(1)
            .ok_or_else(|| {
                io::Error::other(format!(
                    "the fencing counter {} stands at {last}, the largest token there is: no \
                     later holder can be given a larger one; every consumer that remembers \
                     tokens of this lock must be reset before the counter is",
                    path.display()
                ))
            })
            .map_err(self.io_err("advance the fencing counter"))?
            .max(clock);
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(format!("{token}\n").as_bytes()))
            .and_then(|()| file.sync_data())
            .map_err(self.io_err("advance the fencing counter"))?;
        Ok(token)
    }

    /// Every ticket in the queue, in queue order.
    pub(crate) fn scan(&self) -> Vec<QueuedTicket> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let now = SystemTime::now();
        let mut tickets: Vec<QueuedTicket> = entries
            .flatten()
            .filter_map(|e| {
                let ticket = Ticket::parse(e.file_name().to_str()?)?;
                // Not followed: a FIFO, a link or a directory named like a ticket is nobody's
                // place in line (any process of the lock's user can make one).
                let meta = e.metadata().ok()?;
                if !meta.is_file() {
                    tracing::info!(
                        "not a ticket: {} is {}",
                        e.path().display(),
                        crate::files::kind_name(meta.file_type())
                    );
                    return None;
                }
                let modified = meta.modified().ok()?;
                Some(QueuedTicket {
                    ticket,
                    age_s: now.duration_since(modified).unwrap_or_default().as_secs(),
                })
            })
            .collect();
        tickets.sort_by_key(|t| t.ticket);
        tickets
    }

    /// Remove dead and stale tickets (never `mine`); returns the live ones, in queue order.
    fn reap(&self, mine: &Ticket) -> Vec<QueuedTicket> {
        self.sweep(Some(mine), false).0
    }

    /// For the janitor: remove (unless `dry_run`) every dead or stale ticket, and say which. A
    /// waiter that died last in line has nobody behind it to look, so its ticket would
    /// otherwise stay (and `locks` list a dead waiter) until the next waiter of the name came.
    pub(crate) fn tidy_dead(&self, dry_run: bool) -> Vec<PathBuf> {
        self.sweep(None, dry_run).1
    }

    /// The live tickets, in queue order, and the dead and stale ones, removed unless `dry_run`.
    fn sweep(&self, mine: Option<&Ticket>, dry_run: bool) -> (Vec<QueuedTicket>, Vec<PathBuf>) {
        let mut live = Vec::new();
        let mut removed = Vec::new();
        let tickets = self.scan();
        // Judged after they were listed: a ticket's owner is older than the look at it.
        let judge = Judge::new();
        for queued in tickets {
            let t = &queued.ticket;
            let age = Duration::from_secs(queued.age_s);
            let dead = Some(t) != mine
                && (age > STALE_AGE
                    || match self.owner(t).map(|o| judge.judge(&o)) {
                        Some(Verdict::Dead) => true,
                        Some(Verdict::Alive) => false,
                        // An owner that cannot be judged from here (another pid namespace's,
                        // or one that never wrote its identity) is known by its keepalive: a
                        // waiter touches its ticket every few seconds.
                        Some(Verdict::Unresolvable(_)) | None => age > UNJUDGED_OWNER_AGE,
                    });
            if dead {
                tracing::info!(ticket = t.file_name(), "removing a dead ticket");
                if dry_run || std::fs::remove_file(self.path(t)).is_ok() {
                    removed.push(self.path(t));
                }
            } else {
                live.push(queued);
            }
        }
        (live, removed)
    }

    /// The owner the ticket names, when it wrote itself in (a ticket is published an instant
    /// before its owner writes it) and its pid is the ticket's.
    /// Read as [`crate::files`] reads: a FIFO or a link named like a ticket is no ticket's
    /// owner, and never blocks the queue.
    fn owner(&self, ticket: &Ticket) -> Option<ProcessIdentity> {
        let text = crate::files::read_text(&self.path(ticket), &crate::files::Rules::small(512))
            .map_err(|err| {
                if !err.is_missing() {
                    tracing::info!("{err}");
                }
            })
            .ok()?;
        serde_json::from_str::<ProcessIdentity>(text.trim())
            .ok()
            .filter(|o| o.pid == ticket.pid)
    }

    /// How to wake up the moment the ticket's owner dies.
    fn watch_owner(&self, ticket: &Ticket) -> OwnerWatch {
        let Some(owner) = self.owner(ticket) else {
            return OwnerWatch::Unwatchable;
        };
        // A pidfd names a pid of our own namespace; an owner elsewhere is watched by its
        // keepalive alone.
        if ProcessIdentity::own().map_or(true, |me| me.pid_ns != owner.pid_ns) {
            return OwnerWatch::Unwatchable;
        }
        let Ok(fd) = linux::pidfd_open(Pid::from_raw(ticket.pid)) else {
            return OwnerWatch::Gone;
        };
        // With the pidfd open the pid cannot be recycled: check it is still the owner.
        match owner.judge() {
            Verdict::Dead => OwnerWatch::Gone,
            Verdict::Alive => OwnerWatch::Pidfd(fd),
            Verdict::Unresolvable(_) => OwnerWatch::Unwatchable,
        }
    }

    /// Touch our ticket; false when it is gone (it is never recreated).
    fn touch(&self, ticket: &Ticket) -> bool {
        let now = TimeSpec::UTIME_NOW;
        utimensat(
            nix::fcntl::AT_FDCWD,
            &self.path(ticket),
            &now,
            &now,
            UtimensatFlags::NoFollowSymlink,
        )
        .is_ok()
    }

    fn remove(&self, ticket: &Ticket) {
        let _ = std::fs::remove_file(self.path(ticket));
    }

    /// Move a normal ticket into the fast class, keeping its sequence number.
    fn promote(&self, ticket: &Ticket) -> Option<Ticket> {
        let promoted = Ticket {
            class: Class::Fast,
            ..*ticket
        };
        std::fs::rename(self.path(ticket), self.path(&promoted)).ok()?;
        Some(promoted)
    }
}

/// How a waiter watches the owner of the ticket ahead.
enum OwnerWatch {
    /// Readable once it dies.
    Pidfd(OwnedFd),
    /// It is gone already.
    Gone,
    /// It cannot be watched from here: the queue directory and the keepalive tell.
    Unwatchable,
}

fn funnel_has_shutdown(funnel: &SignalFunnel) -> bool {
    shutdown_events(&funnel.pending()).next().is_some()
}

/// Wait in the queue of `name` (its lock file at `path`) until we hold the lock, the budget
/// runs out, or a way out arrives. The ticket is gone whichever way this ends.
pub(crate) fn acquire(
    name: &LockName,
    path: &Path,
    lock_dir: &Path,
    wait: &Wait<'_>,
) -> Result<Taken, LockError> {
    let queue = Queue::open(lock_dir, name)?;
    let mut inotify = match watch_queue(&queue.dir) {
        Ok(inotify) => Some(inotify),
        Err(err) if inotify_exhausted(&err) => {
            report::line(&format!(
                "== lock {name}: cannot watch the queue {} ({err}: this user's inotify \
                 instances or watches are used up, fs.inotify.max_user_instances, \
                 max_user_watches); looking at it every {}–{} ms instead ==",
                queue.dir.display(),
                POLL_MS.start(),
                POLL_MS.end()
            ));
            None
        }
        Err(err) => return Err(queue.io_err("watch")(err)),
    };
    let Some(ticket) = queue.take_ticket(wait.class, wait.funnel)? else {
        return Ok(Taken::Stopped(first_shutdown(wait.funnel)));
    };
    let mut waiter = Waiter {
        name,
        path,
        wait,
        queue: &queue,
        ticket,
        ahead: None,
        started: Instant::now(),
        last_report: None,
    };
    let taken = waiter.run(inotify.as_mut());
    // Held, timed out, stopped or failed: the ticket goes (a second removal is harmless).
    queue.remove(&waiter.ticket);
    taken
}

/// Note that the holder of lock `name` waited `waited` for it, for the metrics: beside the lock
/// file (`<lock-dir>/ccci-<NAME>.lock.last-wait`), outside the queue directory its waiters
/// watch, written in place at a fixed width so that a reader never sees half a number.
pub(crate) fn record_last_wait(
    lock_dir: &Path,
    name: &LockName,
    waited: Duration,
) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let line = format!("{:015.3}\n", waited.as_secs_f64().min(99_999_999_999.0));
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        // Without blocking: a FIFO planted there (any process of the lock's user can) must not
        // hold up the holder's command; and only a regular file is written to.
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC | nix::libc::O_NONBLOCK)
        .open(last_wait_path(lock_dir, name))
        .and_then(|file| {
            let kind = file.metadata()?.file_type();
            if !kind.is_file() {
                return Err(io::Error::other(format!(
                    "it is {}, not a regular file; left alone",
                    crate::files::kind_name(kind)
                )));
            }
            file.write_all_at(line.as_bytes(), 0)
        })
}

/// Where the last wait for lock `name` is recorded.
pub(crate) fn last_wait_path(lock_dir: &Path, name: &LockName) -> PathBuf {
    lock_dir.join(format!(
        "{}{}",
        name.file_name(),
        crate::names::LAST_WAIT_SUFFIX
    ))
}

/// The last holder's wait recorded at `path`, in seconds.
pub(crate) fn last_wait(path: &Path) -> Option<f64> {
    let text = crate::files::read_text(path, &crate::files::Rules::small(64)).ok()?;
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
}

/// An inotify instance watching the queue directory `dir` for tickets coming and going.
fn watch_queue(dir: &Path) -> io::Result<Inotify> {
    let inotify = Inotify::init()?;
    inotify.watches().add(
        dir,
        WatchMask::CREATE | WatchMask::DELETE | WatchMask::MOVED_FROM | WatchMask::MOVED_TO,
    )?;
    Ok(inotify)
}

/// The host will not give us an instance or a watch (the user's share, or memory): the queue
/// can still be looked at, only not waited on.
fn inotify_exhausted(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(nix::libc::EMFILE | nix::libc::ENFILE | nix::libc::ENOSPC | nix::libc::ENOMEM)
    )
}

/// One waiter's place in the queue while it waits.
struct Waiter<'a> {
    name: &'a LockName,
    path: &'a Path,
    wait: &'a Wait<'a>,
    queue: &'a Queue,
    ticket: Ticket,
    /// The ticket right ahead of ours: its owner's death wakes us at once.
    ahead: Option<Ticket>,
    started: Instant,
    last_report: Option<Instant>,
}

/// What one round in the queue came to.
enum Round {
    Done(Taken),
    /// Not at the head yet, or the head lost the file to a replacement: look again.
    Again,
}

impl Waiter<'_> {
    /// Wait in line; without `inotify`, by looking again every [`POLL_MS`].
    fn run(&mut self, mut inotify: Option<&mut Inotify>) -> Result<Taken, LockError> {
        let mut buffer = [0u8; 4096];
        let mut watch: Option<(Ticket, OwnerWatch)> = None;
        loop {
            // Drain what changed so far; whatever changes after this wakes the wait below.
            while inotify.as_mut().is_some_and(|i| {
                i.read_events(&mut buffer)
                    .is_ok_and(|mut e| e.next().is_some())
            }) {}
            if let Round::Done(taken) = self.round()? {
                return Ok(taken);
            }
            // Watch the owner of the ticket ahead: when it dies (a SIGKILLed waiter), nothing
            // in the queue directory changes, so its pidfd is what wakes us.
            if watch.as_ref().map(|(t, _)| *t) != self.ahead {
                watch = self.ahead.map(|t| (t, self.queue.watch_owner(&t)));
            }
            let owner = match &watch {
                Some((_, OwnerWatch::Pidfd(fd))) => Some(fd),
                _ => None,
            };
            let mut timeout = self.remaining().map_or(KEEPALIVE, |l| l.min(KEEPALIVE));
            if matches!(watch, Some((_, OwnerWatch::Gone))) {
                // Its owner is gone already: look again soon, without spinning.
                timeout = timeout.min(DEAD_AHEAD_RETRY);
            }
            if inotify.is_none() {
                timeout = timeout.min(Duration::from_millis(
                    rand::rng().random_range(POLL_MS.clone()),
                ));
            }
            let fds: Vec<BorrowedFd<'_>> = inotify
                .as_ref()
                .map(|i| i.as_fd())
                .into_iter()
                .chain(owner.map(AsFd::as_fd))
                .collect();
            let (arrived, _) = self.wait.funnel.wait_on(&fds, Some(timeout));
            if let Some(event) = shutdown_events(&arrived).next() {
                return Ok(Taken::Stopped(event));
            }
        }
    }

    /// One look at the queue: promote, keep the ticket alive, clear the dead, and, at the head,
    /// try the lock and park on it.
    fn round(&mut self) -> Result<Round, LockError> {
        self.promote_when_due();
        if !self.queue.touch(&self.ticket) {
            // Someone removed our ticket (an operator, or a reaper that took us for dead):
            // take a new one rather than wait outside the queue.
            tracing::warn!(
                ticket = self.ticket.file_name(),
                "our ticket vanished; taking a new one"
            );
            match self
                .queue
                .take_ticket(self.ticket.class, self.wait.funnel)?
            {
                Some(t) => self.ticket = t,
                None => {
                    return Ok(Round::Done(Taken::Stopped(first_shutdown(
                        self.wait.funnel,
                    ))));
                }
            }
        }
        let live = self.queue.reap(&self.ticket);
        self.ahead = live
            .iter()
            .map(|t| t.ticket)
            .take_while(|t| *t < self.ticket)
            .last();
        let at_head = live.first().map(|t| t.ticket) == Some(self.ticket);
        // The head tries before the budget is looked at: `--wait 0` takes a free lock.
        if at_head {
            if let Some(lock) = try_lock_live(self.path)? {
                return Ok(Round::Done(self.held(lock)?));
            }
        }
        if self.remaining() == Some(Duration::ZERO) {
            return Ok(Round::Done(self.give_up(&live)));
        }
        if !at_head {
            self.report_wait(&live, false);
            return Ok(Round::Again);
        }
        self.report_wait(&live, true);
        self.park()
    }

    /// A normal ticket that waited past `--promote-after` joins the fast class.
    fn promote_when_due(&mut self) {
        if self.wait.class != Class::Normal
            || self.ticket.class != Class::Normal
            || self.started.elapsed() < self.wait.promote_after
        {
            return;
        }
        if let Some(promoted) = self.queue.promote(&self.ticket) {
            report::line(&format!(
                "== lock {}: ticket {} promoted to the fast class after {} s ==",
                self.name,
                self.ticket.seq,
                self.started.elapsed().as_secs()
            ));
            self.ticket = promoted;
        }
    }

    fn remaining(&self) -> Option<Duration> {
        self.wait
            .until
            .map(|until| until.saturating_duration_since(Instant::now()))
    }

    /// The head's wait: ONE blocking flock on a worker for the remaining budget, while the main
    /// thread keeps the ticket alive and watches for signals.
    fn park(&mut self) -> Result<Round, LockError> {
        let pending = LockFile::open(self.path)?.lock_in_background()?;
        let (queue, ticket) = (self.queue, self.ticket);
        // The keepalive: by path, never through the lock's descriptor, never recreating.
        let mut touch = || {
            queue.touch(&ticket);
        };
        Ok(
            match self.wait.funnel.await_work(
                pending,
                self.wait.until,
                Some((KEEPALIVE, &mut touch)),
            ) {
                Awaited::Done(outcome) => {
                    let lock = outcome?;
                    if lock.identity_matches()? {
                        Round::Done(self.held(lock)?)
                    } else {
                        // The file was replaced while we waited: go round again on the live path.
                        Round::Again
                    }
                }
                Awaited::Stopped(event) => Round::Done(Taken::Stopped(event)),
                Awaited::TimedOut => Round::Done(self.give_up(&self.queue.scan())),
            },
        )
    }

    /// Ours: say who holds it, for `locks` and for whoever times out behind us; a line found
    /// in it names a holder that died holding it.
    fn held(&self, mut lock: HeldLock) -> Result<Taken, LockError> {
        let before = lock::Holder::parse(&lock.read_holder());
        lock.write_holder(&self.wait.holder.to_line())?;
        let token = self.queue.next_fencing_token()?;
        Ok(Taken::Held(Box::new(
            FileLease::taken_over(lock, before).with_fencing_token(token),
        )))
    }

    /// Leave the queue and say where we were, and who holds the lock.
    fn give_up(&self, live: &[QueuedTicket]) -> Taken {
        self.queue.remove(&self.ticket);
        let head = live
            .iter()
            .find(|t| t.ticket != self.ticket)
            .map(|t| format!("head of queue is {}", t.ticket.describe()))
            .unwrap_or_else(|| "(no other ticket queued)".to_owned());
        Taken::TimedOut {
            waited: self.wait.until.map_or(Duration::ZERO, |u| {
                u.saturating_duration_since(self.started)
            }),
            lock: self.name.to_string(),
            detail: format!(
                "as queue ticket {} ({}); {head}; held by {}",
                self.ticket.seq,
                self.ticket.class.as_str(),
                crate::lock::Holder::describe(crate::lock::Holder::of_file(self.path).as_ref())
            ),
        }
    }

    /// The waiting line: before blocking, then at most once a minute.
    fn report_wait(&mut self, live: &[QueuedTicket], parking: bool) {
        if self.last_report.is_some_and(|t| t.elapsed() < REPORT_EVERY) {
            return;
        }
        self.last_report = Some(Instant::now());
        let budget = self.remaining().map_or("no time limit".to_owned(), |l| {
            format!("{:.1} s of budget left", l.as_secs_f64())
        });
        let position = if parking {
            "head of the queue, waiting for the holder".to_owned()
        } else {
            let ahead = live.iter().take_while(|t| t.ticket < self.ticket).count();
            let head = live.first().map_or("-".to_owned(), |t| t.ticket.describe());
            format!("{ahead} ticket(s) ahead, head is {head}")
        };
        report::line(&format!(
            "== lock {}: waiting as queue ticket {} ({}), {budget}; {position} ==",
            self.name,
            self.ticket.seq,
            self.ticket.class.as_str()
        ));
    }
}

/// A counter file's descriptor, rewound, and its first bytes (empty when unreadable: the caller
/// floors a garbled counter).
fn counter_text(held: &HeldLock) -> (&std::fs::File, String) {
    let mut file = held.file();
    let mut text = String::new();
    let _ = file
        .rewind()
        .and_then(|_| file.take(64).read_to_string(&mut text));
    (file, text)
}

fn first_shutdown(funnel: &SignalFunnel) -> Event {
    shutdown_events(&funnel.pending())
        .next()
        .unwrap_or(Event::Signal(Signal::SIGTERM))
}

/// A non-blocking try; a lock on an inode that is no longer at the path does not count.
fn try_lock_live(path: &Path) -> Result<Option<HeldLock>, LockError> {
    match LockFile::open(path)?.try_lock()? {
        TryLock::Acquired(lock) if lock.identity_matches()? => Ok(Some(lock)),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rstest::rstest;

    #[rstest]
    #[case("0-000000000012-42", Some((Class::Fast, 12, 42)))]
    #[case("1-000000000000-1", Some((Class::Normal, 0, 1)))]
    #[case("2-000000000012-42", None)]
    #[case("1-12-42", None)]
    #[case("1-000000000012-0", None)]
    #[case("1-000000000012-", None)]
    #[case("1-000000000012-42-9", None)]
    #[case(".seq", None)]
    #[case("1-00000000001a-42", None)]
    #[case::leading_zero_pid_would_never_be_removable("1-000000000000-01", None)]
    #[case("1-000000000000-+1", None)]
    fn ticket_names(#[case] name: &str, #[case] want: Option<(Class, u64, i32)>) {
        assert_eq!(Ticket::parse(name).map(|t| (t.class, t.seq, t.pid)), want);
    }

    #[test]
    fn names_sort_in_queue_order() {
        let fast_late = Ticket {
            class: Class::Fast,
            seq: 9,
            pid: 5,
        };
        let normal_early = Ticket {
            class: Class::Normal,
            seq: 1,
            pid: 5,
        };
        let fast_early = Ticket {
            class: Class::Fast,
            seq: 2,
            pid: 5,
        };
        let mut names = [normal_early, fast_late, fast_early].map(|t| t.file_name());
        names.sort();
        assert_eq!(
            names,
            [fast_early, fast_late, normal_early].map(|t| t.file_name())
        );
    }

    proptest! {
        #[test]
        fn ticket_names_round_trip(fast: bool, seq in 0u64..999_999_999_999, pid in 1i32..i32::MAX) {
            let t = Ticket { class: if fast { Class::Fast } else { Class::Normal }, seq, pid };
            prop_assert_eq!(Ticket::parse(&t.file_name()), Some(t));
        }

        #[test]
        fn any_name_parses_without_panicking(name in "\\PC{0,40}") {
            let _ = Ticket::parse(&name);
        }
    }
}
