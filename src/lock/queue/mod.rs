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
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use nix::errno::Errno;
use nix::sys::stat::{UtimensatFlags, utimensat};
use nix::sys::time::TimeSpec;
use nix::unistd::Pid;

use crate::config::Class;
use crate::lock::file::{HeldLock, LockError, LockFile};
use crate::names::LockName;
use crate::supervise::identity::{Judge, ProcessIdentity, Verdict};
use crate::supervise::linux;
use crate::supervise::signals::{SignalFunnel, shutdown_events};

pub(crate) mod ticket;
pub(crate) mod wait;

pub(crate) use ticket::{QueuedTicket, Ticket};

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
        crate::lock::file::prepare_private_dir(&dir)?;
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
    #[expect(
        clippy::disallowed_methods,
        reason = "a ticket in the lock room's own queue directory, made with O_EXCL"
    )]
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
