//! `ccci-run lock NAME`: a fair, bounded, observable named lock for host-shared resources.
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
//!   budget; everyone else sleeps until the queue directory changes (inotify, no polling).
//! - Every waiter touches its ticket every 2 s (the head too, while parked — from the main
//!   thread, which holds no lock and never recreates a removed ticket). A ticket whose owner is
//!   dead and that is older than 10 s, or any ticket older than 1800 s, is removed by whoever looks.
//!
//! Invariant: the ticket is gone as soon as its owner holds the lock, gives up, or dies (the
//! latter within 10 s of the next look); the lock itself is released only by process exit.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use inotify::{Inotify, WatchMask};
use nix::errno::Errno;
use nix::sys::signal::Signal;
use nix::sys::stat::{UtimensatFlags, utimensat};
use nix::sys::time::TimeSpec;
use nix::unistd::Pid;

use crate::cli::CgroupMode;
use crate::exit;
use crate::linux;
use crate::lock::{self, HeldLock, LockError, LockFile, TryLock};
use crate::names::LockName;
use crate::process::CommandSpec;
use crate::report;
use crate::shutdown::Event;
use crate::signals::SignalFunnel;
use crate::supervise::{self, GuardOptions, Supervisor, shutdown_events};

/// A ticket whose owner is dead is removed once it is this old.
const DEAD_OWNER_AGE: Duration = Duration::from_secs(10);
/// Any ticket this old is stale: its owner stopped touching it (or its pid was recycled).
const STALE_AGE: Duration = Duration::from_secs(1800);
/// How often a waiter touches its own ticket.
const KEEPALIVE: Duration = Duration::from_secs(2);
/// How often a waiter repeats its waiting line.
const REPORT_EVERY: Duration = Duration::from_secs(60);
/// The variable that carries the locks an ancestor holds: `NAME:PID:MAJOR:MINOR:INODE:DEPTH`,
/// comma-separated.
pub const HELD_VAR: &str = "CCCI_HELD_LOCKS";

/// Fast tickets go before normal ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    Fast,
    Normal,
}

impl Class {
    fn rank(self) -> u8 {
        match self {
            Class::Fast => 0,
            Class::Normal => 1,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Class::Fast => "fast",
            Class::Normal => "normal",
        }
    }
}

/// A place in the queue; its file name is `rank-seq-pid`, so names sort in queue order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct Ticket {
    pub class: Class,
    pub seq: u64,
    pub pid: i32,
}

impl Ticket {
    pub fn file_name(&self) -> String {
        format!("{}-{:012}-{}", self.class.rank(), self.seq, self.pid)
    }

    /// Parse a queue entry's name; anything else in the directory is not a ticket.
    pub fn parse(name: &str) -> Option<Self> {
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
pub struct QueuedTicket {
    pub ticket: Ticket,
    pub age_s: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum NamedLockError {
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("failed to {what} in queue {dir}: {source}")]
    Queue {
        what: &'static str,
        dir: PathBuf,
        source: io::Error,
    },
    #[error(
        "lock {name}: an ancestor (pid {pid}) says it holds it, but it no longer does; refusing to take it behind its back"
    )]
    StaleAncestor { name: LockName, pid: i32 },
    #[error("failed to set up signal handling: {0}")]
    Guards(String),
}

/// The queue directory of one named lock.
#[derive(Debug)]
pub struct Queue {
    dir: PathBuf,
}

impl Queue {
    pub fn dir_for(lock_dir: &Path, name: &LockName) -> PathBuf {
        lock_dir.join(format!("ccci-{name}.lock.queue"))
    }

    /// The queue of an existing directory, for looking only.
    pub fn existing(dir: PathBuf) -> Self {
        Self { dir }
    }

    pub fn open(lock_dir: &Path, name: &LockName) -> Result<Self, NamedLockError> {
        let dir = Self::dir_for(lock_dir, name);
        lock::prepare_private_dir(&dir)?;
        Ok(Self { dir })
    }

    fn io_err(&self, what: &'static str) -> impl FnOnce(io::Error) -> NamedLockError + '_ {
        move |source| NamedLockError::Queue {
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
    ) -> Result<Option<Ticket>, NamedLockError> {
        let mut counter = LockFile::open(&self.dir.join(".seq"))?;
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
                Err((_, err)) => return Err(err.into()),
            }
        };
        let mut file = held.file();
        let mut text = String::new();
        let _ = file
            .rewind()
            .and_then(|_| file.take(64).read_to_string(&mut text));
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
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(self.path(&ticket))
            .map_err(self.io_err("publish a ticket"))?;
        drop(held);
        Ok(Some(ticket))
    }

    /// Every ticket in the queue, in queue order.
    pub fn scan(&self) -> Vec<QueuedTicket> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let now = SystemTime::now();
        let mut tickets: Vec<QueuedTicket> = entries
            .flatten()
            .filter_map(|e| {
                let ticket = Ticket::parse(e.file_name().to_str()?)?;
                let modified = e.metadata().ok()?.modified().ok()?;
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
        let mut live = Vec::new();
        for queued in self.scan() {
            let t = &queued.ticket;
            let age = Duration::from_secs(queued.age_s);
            let dead =
                t != mine && (age > STALE_AGE || (age > DEAD_OWNER_AGE && !process_exists(t.pid)));
            if dead {
                tracing::info!(ticket = t.file_name(), "removing a dead ticket");
                let _ = std::fs::remove_file(self.path(t));
            } else {
                live.push(queued);
            }
        }
        live
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

fn process_exists(pid: i32) -> bool {
    !matches!(
        nix::sys::signal::kill(Pid::from_raw(pid), None),
        Err(Errno::ESRCH)
    )
}

fn funnel_has_shutdown(funnel: &SignalFunnel) -> bool {
    shutdown_events(&funnel.pending()).next().is_some()
}

/// Options of one `lock` invocation.
#[derive(Debug, Clone)]
pub struct LockOptions {
    pub name: LockName,
    pub wait: Option<Duration>,
    pub class: Class,
    pub promote_after: Duration,
    pub kill_grace: Duration,
    pub teardown_timeout: Duration,
    pub tie_to: Option<i32>,
    pub cgroup: CgroupMode,
    pub command: Vec<OsString>,
}

enum Acquired {
    Held(HeldLock),
    TimedOut(String),
    Stopped(Event),
}

/// Run `ccci-run lock`; returns the exit code.
pub fn run(lock_dir: &Path, opts: &LockOptions, start_ppid: Pid) -> Result<u8, NamedLockError> {
    let guards = GuardOptions {
        tie_to: opts.tie_to,
        ..GuardOptions::default()
    };
    let funnel = supervise::install_guards(start_ppid, &guards)
        .map_err(|e| NamedLockError::Guards(e.to_string()))?;
    lock::prepare_dir(lock_dir)?;
    let path = lock_dir.join(format!("ccci-{}.lock", opts.name));

    let inherited = std::env::var(HELD_VAR).unwrap_or_default();
    let mut held_entries: Vec<String> = inherited
        .split(',')
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .collect();
    let mut mine = held_entries
        .iter()
        .position(|e| e.split(':').next() == Some(opts.name.as_str()));
    // An entry whose pid is not even our ancestor was not inherited from a holder: it says
    // nothing about us (forged, or leaked into an unrelated environment). Queue normally.
    if let Some(i) = mine {
        let claimed: Option<i32> = held_entries[i]
            .split(':')
            .nth(1)
            .and_then(|p| p.parse().ok());
        let ancestor = claimed
            .filter(|p| *p > 1)
            .is_some_and(|p| linux::is_ancestor(Pid::from_raw(p)));
        if !ancestor {
            report::line(&format!(
                "!! lock {}: ignoring {HELD_VAR} entry {:?}: its pid is not an ancestor of this \
                 process; queueing normally",
                opts.name,
                crate::names::escape_outside(held_entries[i].as_bytes())
            ));
            held_entries.remove(i);
            mine = None;
        }
    }
    let depth = match mine {
        Some(i) => {
            let (pid, depth) = verify_ancestor(&held_entries[i], &path).ok_or_else(|| {
                NamedLockError::StaleAncestor {
                    name: opts.name.clone(),
                    pid: held_entries[i]
                        .split(':')
                        .nth(1)
                        .and_then(|p| p.parse().ok())
                        .unwrap_or(0),
                }
            })?;
            tracing::info!(
                holder = pid,
                depth,
                "lock already held by an ancestor; granted"
            );
            held_entries[i] = replace_depth(&held_entries[i], depth + 1);
            Some(depth + 1)
        }
        None => None,
    };

    let mut _lock = None;
    if depth.is_none() {
        let queue = Queue::open(lock_dir, &opts.name)?;
        match acquire(&funnel, &queue, &path, opts)? {
            Acquired::Held(lock) => {
                let meta = std::fs::metadata(&path).map_err(|e| NamedLockError::Queue {
                    what: "inspect the lock file",
                    dir: path.clone(),
                    source: e,
                })?;
                use std::os::unix::fs::MetadataExt;
                held_entries.push(format!(
                    "{}:{}:{}:{}:{}:1",
                    opts.name,
                    std::process::id(),
                    linux::dev_major(meta.dev()),
                    linux::dev_minor(meta.dev()),
                    meta.ino()
                ));
                _lock = Some(lock);
            }
            Acquired::TimedOut(message) => {
                report::line(&format!("ccci-run: {message}"));
                return Ok(exit::LOCK_TIMEOUT);
            }
            Acquired::Stopped(event) => {
                return Ok(match event {
                    Event::Signal(signal) => {
                        report::line(&format!(
                            "== {signal} received while waiting for lock {} — giving up ==",
                            opts.name
                        ));
                        exit::for_signal(signal)
                    }
                    _ => exit::INTERNAL,
                });
            }
        }
    }

    let (program, args) = opts.command.split_first().expect("clap requires a command");
    let spec = CommandSpec {
        program: program.clone(),
        args: args.to_vec(),
        env: vec![(HELD_VAR.to_owned(), held_entries.join(",").into())],
        cwd: None,
    };
    let cgroups = supervise::run_cgroup(opts.cgroup, "lock", opts.name.as_str());
    let supervisor = Supervisor {
        funnel: &funnel,
        kill_grace: opts.kill_grace,
        deadline: Duration::ZERO,
        forward_signals: true,
        teardown_timeout: opts.teardown_timeout,
        hard_end: None,
        leaf: cgroups.as_ref().map(|c| &c.command),
    };
    let stopped = supervisor.start_and_stop(&spec, VecDeque::new(), &mut |_| {});
    for err in stopped.errors {
        report::line(&format!("!! lock {}: {err}", opts.name));
    }
    if let Err(err) =
        supervisor.kill_leftovers(cgroups.as_ref().map(|c| &c.command), stopped.teardown_until)
    {
        report::line(&format!("!! lock {}: {err}", opts.name));
    }
    if let Some(Err(err)) = cgroups.as_ref().map(|c| c.cgroup.remove()) {
        report::line(&format!("!! lock {}: {err}", opts.name));
    }
    Ok(stopped.reason.exit_code())
}

/// An inherited entry is good when its pid is our ancestor and `/proc/locks` shows that pid
/// holding the very inode the lock path names. Returns the holder's pid and the depth.
fn verify_ancestor(entry: &str, path: &Path) -> Option<(i32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let mut f = entry.split(':');
    let (_, pid, major, minor, inode, depth) = (
        f.next()?,
        f.next()?,
        f.next()?,
        f.next()?,
        f.next()?,
        f.next()?,
    );
    let pid: i32 = pid.parse().ok()?;
    let (major, minor, inode): (u32, u32, u64) = (
        major.parse().ok()?,
        minor.parse().ok()?,
        inode.parse().ok()?,
    );
    let depth: u32 = depth.parse().ok()?;
    let meta = std::fs::metadata(path).ok()?;
    let same_file = meta.ino() == inode
        && linux::dev_major(meta.dev()) == major
        && linux::dev_minor(meta.dev()) == minor;
    let held = linux::proc_locks().ok()?.iter().any(|l| {
        !l.waiting && l.pid == pid && l.inode == inode && l.major == major && l.minor == minor
    });
    let ancestor = linux::is_ancestor(Pid::from_raw(pid));
    (same_file && held && ancestor).then_some((pid, depth))
}

fn replace_depth(entry: &str, depth: u32) -> String {
    match entry.rsplit_once(':') {
        Some((head, _)) => format!("{head}:{depth}"),
        None => entry.to_owned(),
    }
}

/// Wait in the queue until we hold the lock, the budget runs out, or a signal says stop.
fn acquire(
    funnel: &SignalFunnel,
    queue: &Queue,
    path: &Path,
    opts: &LockOptions,
) -> Result<Acquired, NamedLockError> {
    let started = Instant::now();
    let remaining = |now: Instant| opts.wait.map(|w| w.saturating_sub(now - started));
    let mut inotify = Inotify::init().map_err(queue.io_err("watch"))?;
    inotify
        .watches()
        .add(
            &queue.dir,
            WatchMask::CREATE | WatchMask::DELETE | WatchMask::MOVED_FROM | WatchMask::MOVED_TO,
        )
        .map_err(queue.io_err("watch"))?;
    let Some(mut ticket) = queue.take_ticket(opts.class, funnel)? else {
        return Ok(Acquired::Stopped(first_shutdown(funnel)));
    };
    let mut last_report: Option<Instant> = None;
    let mut buffer = [0u8; 4096];
    let give_up = |ticket: &Ticket, live: &[QueuedTicket]| {
        queue.remove(ticket);
        let head = live
            .iter()
            .find(|t| t.ticket != *ticket)
            .map(|t| format!("head of queue is {}", t.ticket.describe()))
            .unwrap_or_else(|| "(no other ticket queued)".to_owned());
        let waited = opts.wait.unwrap_or_default().as_secs_f64();
        format!(
            "lock {} not acquired within {} s as queue ticket {} ({}); {head}",
            opts.name,
            (waited * 10.0).round() / 10.0,
            ticket.seq,
            ticket.class.as_str()
        )
    };
    loop {
        // Drain what changed so far; whatever changes after this wakes the wait below.
        while inotify
            .read_events(&mut buffer)
            .is_ok_and(|mut e| e.next().is_some())
        {}
        if opts.class == Class::Normal
            && ticket.class == Class::Normal
            && started.elapsed() >= opts.promote_after
        {
            if let Some(promoted) = queue.promote(&ticket) {
                report::line(&format!(
                    "== lock {}: ticket {} promoted to the fast class after {} s ==",
                    opts.name,
                    ticket.seq,
                    started.elapsed().as_secs()
                ));
                ticket = promoted;
            }
        }
        if !queue.touch(&ticket) {
            // Someone removed our ticket (an operator, or a reaper that took us for dead):
            // take a new one rather than wait outside the queue.
            tracing::warn!(
                ticket = ticket.file_name(),
                "our ticket vanished; taking a new one"
            );
            match queue.take_ticket(ticket.class, funnel)? {
                Some(t) => ticket = t,
                None => return Ok(Acquired::Stopped(first_shutdown(funnel))),
            }
        }
        let live = queue.reap(&ticket);
        let head = live.first().map(|t| t.ticket);
        let now = Instant::now();
        if remaining(now) == Some(Duration::ZERO) {
            return Ok(Acquired::TimedOut(give_up(&ticket, &live)));
        }
        if head == Some(ticket) {
            match try_lock_live(path)? {
                Some(lock) => {
                    queue.remove(&ticket);
                    return Ok(Acquired::Held(lock));
                }
                None => {
                    report_wait(opts, &ticket, &live, remaining(now), &mut last_report, true);
                    match park(funnel, queue, &ticket, path, opts, started)? {
                        Parked::Held(lock) => {
                            queue.remove(&ticket);
                            return Ok(Acquired::Held(lock));
                        }
                        Parked::Retry => continue,
                        Parked::TimedOut => {
                            let live = queue.scan();
                            return Ok(Acquired::TimedOut(give_up(&ticket, &live)));
                        }
                        Parked::Stopped(event) => {
                            queue.remove(&ticket);
                            return Ok(Acquired::Stopped(event));
                        }
                    }
                }
            }
        }
        report_wait(
            opts,
            &ticket,
            &live,
            remaining(now),
            &mut last_report,
            false,
        );
        let timeout = match remaining(now) {
            Some(left) => left.min(KEEPALIVE),
            None => KEEPALIVE,
        };
        let (arrived, _) = funnel.wait_or(Some(inotify.as_fd()), Some(timeout));
        if let Some(event) = shutdown_events(&arrived).next() {
            queue.remove(&ticket);
            return Ok(Acquired::Stopped(event));
        }
    }
}

fn first_shutdown(funnel: &SignalFunnel) -> Event {
    shutdown_events(&funnel.pending())
        .next()
        .unwrap_or(Event::Signal(Signal::SIGTERM))
}

/// A non-blocking try; a lock on an inode that is no longer at the path does not count.
fn try_lock_live(path: &Path) -> Result<Option<HeldLock>, NamedLockError> {
    match LockFile::open(path)?.try_lock()? {
        TryLock::Acquired(lock) if lock.identity_matches()? => Ok(Some(lock)),
        _ => Ok(None),
    }
}

enum Parked {
    Held(HeldLock),
    Retry,
    TimedOut,
    Stopped(Event),
}

/// The head's wait: ONE blocking flock on a worker for the remaining budget, while the main
/// thread keeps the ticket alive and watches for signals.
fn park(
    funnel: &SignalFunnel,
    queue: &Queue,
    ticket: &Ticket,
    path: &Path,
    opts: &LockOptions,
    started: Instant,
) -> Result<Parked, NamedLockError> {
    let mut pending = LockFile::open(path)?.lock_in_background()?;
    loop {
        let left = opts.wait.map(|w| w.saturating_sub(started.elapsed()));
        if left == Some(Duration::ZERO) {
            pending.cancel();
            return Ok(Parked::TimedOut);
        }
        let timeout = left.map_or(KEEPALIVE, |l| l.min(KEEPALIVE));
        let (arrived, ready) = funnel.wait_or(Some(pending.ready_fd()), Some(timeout));
        if let Some(event) = shutdown_events(&arrived).next() {
            pending.cancel();
            return Ok(Parked::Stopped(event));
        }
        // The keepalive: by path, never through the lock's descriptor, never recreating.
        queue.touch(ticket);
        if ready {
            if let Some(outcome) = pending.try_finish() {
                let lock = outcome?;
                if lock.identity_matches()? {
                    return Ok(Parked::Held(lock));
                }
                // The file was replaced while we waited: go round again on the live path.
                return Ok(Parked::Retry);
            }
        }
    }
}

/// The waiting line: before blocking, then at most once a minute.
fn report_wait(
    opts: &LockOptions,
    ticket: &Ticket,
    live: &[QueuedTicket],
    left: Option<Duration>,
    last: &mut Option<Instant>,
    parking: bool,
) {
    if last.is_some_and(|t| t.elapsed() < REPORT_EVERY) {
        return;
    }
    *last = Some(Instant::now());
    let budget = left.map_or("no time limit".to_owned(), |l| {
        format!("{} s of budget left", l.as_secs())
    });
    let position = if parking {
        "head of the queue, waiting for the holder".to_owned()
    } else {
        let ahead = live.iter().take_while(|t| t.ticket < *ticket).count();
        let head = live.first().map_or("-".to_owned(), |t| t.ticket.describe());
        format!("{ahead} ticket(s) ahead, head is {head}")
    };
    report::line(&format!(
        "== lock {}: waiting as queue ticket {} ({}), {budget}; {position} ==",
        opts.name,
        ticket.seq,
        ticket.class.as_str()
    ));
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
