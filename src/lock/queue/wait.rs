//! The wait in the queue: the head ticket's one blocking flock, everyone else asleep until the
//! queue changes or the owner ahead dies, promotion, the wait's bound and its reports; and the
//! record of how long the last holder waited.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use inotify::{Inotify, WatchMask};
use nix::sys::signal::Signal;
use rand::RngExt;

use crate::config::Class;
use crate::lock::backend::{Taken, Wait};
use crate::lock::file::{HeldLock, LockError, LockFile, TryLock};
use crate::lock::file_lease::FileLease;
use crate::lock::queue::ticket::{QueuedTicket, Ticket};
use crate::lock::queue::{DEAD_AHEAD_RETRY, KEEPALIVE, OwnerWatch, POLL_MS, Queue, REPORT_EVERY};
use crate::names::LockName;
use crate::report;
use crate::supervise::shutdown::Event;
use crate::supervise::signals::{Awaited, SignalFunnel, shutdown_events};

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
    if matches!(taken, Ok(Taken::Held(_))) {
        // Closing an inotify instance waits for the kernel's grace period on its marks (often
        // 10–20 ms): once the lock is ours, that wait would come between the handoff and the
        // command. The watch is left open instead, and goes with the process.
        std::mem::forget(inotify);
    }
    taken
}

/// Note that the holder of lock `name` waited `waited` for it, for the metrics: beside the lock
/// file (`<lock-dir>/ccci-<NAME>.lock.last-wait`), outside the queue directory its waiters
/// watch, replaced whole so that a reader never sees half a number.
pub(crate) fn record_last_wait(
    lock_dir: &Path,
    name: &LockName,
    waited: Duration,
) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let line = format!("{:.3}", waited.as_secs_f64().min(99_999_999_999.0));
    let path = last_wait_path(lock_dir, name);
    // One writer: ours. Another user's record (or anything but a regular file, a FIFO planted
    // there) is left alone and never written into; ours is replaced whole, through a file
    // made exclusively beside it, so no reader sees half a line.
    match std::fs::symlink_metadata(&path) {
        Ok(meta) if !meta.is_file() => {
            return Err(io::Error::other(format!(
                "it is {}, not a regular file; left alone",
                crate::files::kind_name(meta.file_type())
            )));
        }
        Ok(meta) if !crate::trust::ours(meta.uid()) => {
            return Err(io::Error::other(format!(
                "it is owned by uid {}, not {}; left alone",
                meta.uid(),
                crate::trust::who()
            )));
        }
        _ => {}
    }
    let write = || {
        crate::files::write_atomically(&path, line.as_bytes(), false, crate::files::Mode::Umasked)
    };
    match write() {
        // A lock kept elsewhere (etcd) leaves the lock dir to be made here, on first use, as
        // the local locks would have made it.
        Err(err) if err.kind() == io::ErrorKind::NotFound && !lock_dir.exists() => {
            crate::lock::file::prepare_dir(lock_dir).map_err(io::Error::other)?;
            write()?;
        }
        done => done?,
    }
    Ok(())
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
    let text = crate::files::read_text(
        path,
        &crate::files::Rules::small(64).trusted(crate::trust::runner().map(|(uid, _)| uid)),
    )
    .ok()?;
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
}

/// An inotify instance watching the queue directory `dir` for tickets coming and going.
pub(super) fn watch_queue(dir: &Path) -> io::Result<Inotify> {
    let inotify = Inotify::init()?;
    inotify.watches().add(
        dir,
        WatchMask::CREATE | WatchMask::DELETE | WatchMask::MOVED_FROM | WatchMask::MOVED_TO,
    )?;
    Ok(inotify)
}

/// The host will not give us an instance or a watch (the user's share, or memory): the queue
/// can still be looked at, only not waited on.
pub(super) fn inotify_exhausted(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(nix::libc::EMFILE | nix::libc::ENFILE | nix::libc::ENOSPC | nix::libc::ENOMEM)
    )
}

/// One waiter's place in the queue while it waits.
pub(super) struct Waiter<'a> {
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
pub(super) enum Round {
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
            // Sleep until something that concerns us: the ticket ahead or ours gone or renamed,
            // the owner ahead dead, the timeout. A ticket that comes or goes anywhere else in
            // the line can only put someone ahead of us (a newcomer: it only delays us), so it
            // wakes nobody but the one behind it to look at the whole queue again.
            let until = Instant::now() + timeout;
            loop {
                let left = until.saturating_duration_since(Instant::now());
                let fds: Vec<BorrowedFd<'_>> = inotify
                    .as_ref()
                    .map(|i| i.as_fd())
                    .into_iter()
                    .chain(owner.map(AsFd::as_fd))
                    .collect();
                let (arrived, _) = self.wait.funnel.wait_on(&fds, Some(left));
                drop(fds);
                if let Some(event) = shutdown_events(&arrived).next() {
                    return Ok(Taken::Stopped(event));
                }
                let owner_died =
                    owner.is_some_and(|fd| crate::supervise::linux::readable_now(fd.as_fd()));
                if !arrived.is_empty() || owner_died || Instant::now() >= until {
                    break;
                }
                match inotify.as_mut() {
                    Some(i) => {
                        if self.concerns_us(i, &mut buffer) {
                            break;
                        }
                    }
                    None => break,
                }
            }
        }
    }

    /// Read what inotify has to say: whether any of it names the ticket ahead of ours or ours
    /// (or may have: events lost, the directory gone). Without a ticket ahead, everything
    /// does.
    fn concerns_us(&self, inotify: &mut Inotify, buffer: &mut [u8]) -> bool {
        let Some(ahead) = self.ahead else {
            return true;
        };
        let (ahead, ours) = (ahead.file_name(), self.ticket.file_name());
        let mut concerns = false;
        loop {
            let events = match inotify.read_events(buffer) {
                Ok(events) => events,
                Err(err) if err.kind() == io::ErrorKind::WouldBlock => return concerns,
                Err(_) => return true,
            };
            let mut any = false;
            for event in events {
                any = true;
                concerns |= !event.mask.intersects(
                    inotify::EventMask::CREATE
                        | inotify::EventMask::DELETE
                        | inotify::EventMask::MOVED_FROM
                        | inotify::EventMask::MOVED_TO,
                ) || event
                    .name
                    .and_then(|name| name.to_str())
                    .is_some_and(|name| name == ahead || name == ours);
            }
            if !any {
                return concerns;
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
        let before = crate::lock::holder::Holder::parse(&lock.read_holder());
        lock.write_holder(&crate::lock::holder::Holder::taken_now(
            &self.wait.holder.to_line(),
        ))?;
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
                crate::lock::holder::Holder::describe(
                    crate::lock::holder::Holder::of_file_settled(self.path).as_ref()
                )
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

pub(super) fn first_shutdown(funnel: &SignalFunnel) -> Event {
    shutdown_events(&funnel.pending())
        .next()
        .unwrap_or(Event::Signal(Signal::SIGTERM))
}

/// A non-blocking try; a lock on an inode that is no longer at the path does not count.
pub(super) fn try_lock_live(path: &Path) -> Result<Option<HeldLock>, LockError> {
    match LockFile::open(path)?.try_lock()? {
        TryLock::Acquired(lock) if lock.identity_matches()? => Ok(Some(lock)),
        _ => Ok(None),
    }
}
