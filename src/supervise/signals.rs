//! The signal funnel: SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGALRM (the hard deadline) and SIGCHLD
//! are caught once, recorded in flags and announced through a self-pipe, so the supervisor waits
//! for "something happened" with a timeout and then reads what. The exit of a `--tie-to`
//! process (a pidfd) is one more thing the same wait watches.
//!
//! No signal may end the process without a teardown: every other signal whose default action
//! is to terminate (SIGUSR1, SIGUSR2, SIGPWR, the real-time signals, ...) is caught too, reported
//! and ignored. Only SIGKILL (and a fault) can still end it abruptly; what a run leaves then is
//! the janitor's.
//!
//! Handlers are installed without `SA_RESTART` (see `linux::clear_sa_restart`): a blocking call
//! such as a parked `flock` returns `EINTR` when one of these signals arrives, and its caller
//! checks [`SignalFunnel::pending`]. Every blocking call in the process must therefore handle
//! `EINTR`.

use std::cell::{Cell, RefCell};
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::libc;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use signal_hook::iterator::SignalsInfo;
use signal_hook::iterator::exfiltrator::WithRawSiginfo;

use crate::report;
use crate::supervise::identity::ProcessIdentity;
use crate::supervise::linux::{self, readable_now};
use crate::supervise::shutdown::{Event, Requester};
use crate::supervise::worker::Awaitable;

/// The signals the funnel catches and acts on, in the order they are reported when several
/// are pending. SIGQUIT is a request to stop like the others; SIGALRM is the hard deadline;
/// SIGCHLD only wakes the supervisor up.
const CAUGHT: [Signal; 6] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGALRM,
    Signal::SIGCHLD,
];

/// Signals whose default action would end the process without a teardown, and that nobody
/// sends to stop a run: caught, reported and otherwise ignored. (The real-time signals above
/// the kick are added at install time; SIGPIPE is already ignored by the Rust runtime.)
const IGNORED: [Signal; 9] = [
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGVTALRM,
    Signal::SIGPROF,
    Signal::SIGIO,
    Signal::SIGPWR,
    Signal::SIGSTKFLT,
    Signal::SIGXCPU,
    Signal::SIGXFSZ,
];

/// How early a SIGALRM may come and still be the hard deadline's.
const ALARM_SLACK: std::time::Duration = std::time::Duration::from_millis(50);

/// One flag per signal number; statics because the handlers outlive any value we could own.
const MAX_SIGNAL: usize = 65;
static FLAGS: [AtomicBool; MAX_SIGNAL] = [const { AtomicBool::new(false) }; MAX_SIGNAL];
static KICKED: AtomicBool = AtomicBool::new(false);

/// What happened since the last look: signals in [`CAUGHT`] order, and whether the tied
/// process or our parent died.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Arrived {
    signals: Vec<Signal>,
    /// A `--tie-to` process exited: the first one seen (each is reported once).
    pub tied_pid_died: Option<i32>,
    /// The parent died: the parent-death SIGTERM arrived and we were re-parented.
    pub parent_died: bool,
    /// A held lock was lost (reported once).
    pub lock_lost: bool,
    /// The SIGTERM was `ccci-run stop`'s, sent by this requester.
    pub stopped: Option<Requester>,
}

impl Arrived {
    pub(crate) fn iter(&self) -> impl Iterator<Item = Signal> + '_ {
        self.signals.iter().copied()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.signals.is_empty()
            && self.tied_pid_died.is_none()
            && !self.parent_died
            && !self.lock_lost
            && self.stopped.is_none()
    }

    pub(crate) fn contains(&self, signal: Signal) -> bool {
        self.signals.contains(&signal)
    }
}

/// A descriptor that turns readable once, when something the run depends on is gone: the
/// process it is tied to (`--tie-to`, a pidfd), or a lock it holds (the lease's loss).
#[derive(Debug)]
struct Watched {
    fd: OwnedFd,
    reported: Cell<bool>,
}

impl Watched {
    fn new(fd: OwnedFd) -> Self {
        Self {
            fd,
            reported: Cell::new(false),
        }
    }

    /// True the first time it is seen readable.
    fn fired(&self) -> bool {
        if self.reported.get() || !readable_now(self.fd.as_fd()) {
            return false;
        }
        self.reported.set(true);
        true
    }
}

/// What `ccci-run stop` writes into a run directory (`stop.json`) before it sends its SIGTERM:
/// who asks, as it sees itself, and which supervisor it verified. The supervisor takes a
/// SIGTERM for a stop only when the request names it and the SIGTERM's sender is the requester;
/// any other SIGTERM is the plain SIGTERM it always was.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct StopRequest {
    /// The requester's real uid.
    pub uid: u32,
    /// The requester's pid in its own pid namespace, and that namespace.
    pub pid: i32,
    pub pid_ns: u64,
    /// The supervisor the requester checked (its guard, its start time) before signalling.
    pub supervisor: ProcessIdentity,
    pub at: String,
}

/// A signal's sender as the kernel told the receiver (`si_pid`, `si_uid`): the pid in the
/// receiver's pid namespace, 0 when the sender is in an enclosing one the receiver cannot see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sender {
    pub pid: i32,
    pub uid: u32,
}

impl StopRequest {
    /// Whether a SIGTERM from `sender`, received by the supervisor `own`, is this request's.
    pub(crate) fn sent_by(&self, sender: Sender, own: &ProcessIdentity) -> bool {
        if self.supervisor != *own || self.uid != sender.uid {
            return false;
        }
        if sender.pid == 0 {
            // Sent from an enclosing pid namespace: so must the request have been.
            self.pid_ns != own.pid_ns
        } else {
            self.pid_ns == own.pid_ns && self.pid == sender.pid
        }
    }

    pub(crate) fn requester(&self) -> Requester {
        Requester {
            uid: self.uid,
            pid: self.pid,
        }
    }
}

/// Whether process `pid` runs the program we run, by its command name (world-readable, unlike
/// its executable, and not the sender's to choose: a forger picks the request, not the sender).
fn same_program(pid: i32) -> bool {
    let comm = |p: &str| crate::files::kernel_text(format!("/proc/{p}/comm")).ok();
    match (comm("self"), comm(&pid.to_string())) {
        (Some(ours), Some(theirs)) => ours == theirs,
        _ => false,
    }
}

/// Where a supervisor that takes stop requests finds them.
struct StopRequests {
    path: std::path::PathBuf,
    own: ProcessIdentity,
}

/// The installed funnel. There is one per process.
pub(crate) struct SignalFunnel {
    wake: UnixStream,
    /// Our parent when we started: a SIGTERM that arrives once it changed is the parent-death
    /// signal, not somebody's request.
    start_ppid: Pid,
    /// The `--tie-to` ancestors, each with its pid.
    tie: Vec<(i32, Watched)>,
    /// Held locks that can be lost behind our back.
    losses: Vec<Watched>,
    /// When the hard deadline's alarm is due; a SIGALRM before it is somebody else's.
    deadline: Option<std::time::Instant>,
    /// Who sent each SIGTERM (signal-hook's raw `siginfo_t`, kept for us by its own handler,
    /// which runs before the flag's). `None` in tests that install no handlers.
    senders: Option<RefCell<SignalsInfo<WithRawSiginfo>>>,
    /// The last SIGTERM sender seen, until a SIGTERM is taken with it.
    last_sender: Cell<Option<Sender>>,
    /// Where `ccci-run stop` leaves its request, for a run.
    stop: Option<StopRequests>,
}

#[derive(Debug, thiserror::Error)]
#[error("failed to install the {signal} handler: {source}")]
pub(crate) struct InstallError {
    signal: String,
    source: io::Error,
}

impl SignalFunnel {
    /// Install the handlers. Call once, before any child is spawned. `start_ppid` is the
    /// parent as read first thing in `main`.
    pub(crate) fn install(start_ppid: Pid) -> Result<Self, InstallError> {
        let fail = |signal: libc::c_int| {
            move |source| InstallError {
                signal: signal_name(signal),
                source,
            }
        };
        let (wake, notify) = UnixStream::pair().map_err(fail(libc::SIGTERM))?;
        wake.set_nonblocking(true).map_err(fail(libc::SIGTERM))?;
        // A full socket must never block a handler: a wake-up already pending is enough.
        notify.set_nonblocking(true).map_err(fail(libc::SIGTERM))?;
        // The handlers' end lives as long as the process (one funnel per process).
        let notify = std::os::fd::IntoRawFd::into_raw_fd(notify);
        // Registered before the flags' actions, so that a SIGTERM's sender is kept before its
        // flag can be seen (a signal's actions run in the order they were registered).
        let senders =
            SignalsInfo::<WithRawSiginfo>::new([libc::SIGTERM]).map_err(fail(libc::SIGTERM))?;
        let kick = crate::supervise::threads::kick_signal();
        let realtime = (kick + 1)..=libc::SIGRTMAX();
        let watched = CAUGHT
            .iter()
            .chain(&IGNORED)
            .map(|s| *s as libc::c_int)
            .chain(realtime);
        for signal in watched {
            let Some(flag) = FLAGS.get(signal as usize) else {
                continue;
            };
            // One action a signal: raise its flag, then wake the funnel (the flag first, so a
            // wake-up always finds it). write(2) is async-signal-safe; errno is kept for the
            // interrupted code.
            let action = move || {
                flag.store(true, Ordering::SeqCst);
                let saved = Errno::last_raw();
                // SAFETY: writes one byte from a static buffer to a descriptor we own.
                unsafe { libc::write(notify, [1u8].as_ptr().cast(), 1) };
                Errno::set_raw(saved);
            };
            // SAFETY: the action only stores to an atomic and calls write(2).
            unsafe { signal_hook::low_level::register(signal, action) }.map_err(fail(signal))?;
            linux::clear_sa_restart(signal).map_err(fail(signal))?;
        }
        // The kick only has to interrupt a helper thread's blocking call: a flag nobody reads.
        signal_hook::flag::register(kick, &KICKED).map_err(fail(kick))?;
        linux::clear_sa_restart(kick).map_err(fail(kick))?;
        Ok(Self {
            wake,
            start_ppid,
            tie: Vec::new(),
            losses: Vec::new(),
            deadline: None,
            senders: Some(RefCell::new(senders)),
            last_sender: Cell::new(None),
            stop: None,
        })
    }

    /// Take a SIGTERM whose sender left a [`StopRequest`] naming `own` at `path` for
    /// `ccci-run stop`'s: reported as [`Arrived::stopped`].
    pub(crate) fn accept_stop_requests(&mut self, path: std::path::PathBuf, own: ProcessIdentity) {
        self.stop = Some(StopRequests { path, own });
    }

    /// The sender of the last SIGTERM, drained from signal-hook's record of them.
    fn note_senders(&self) {
        let Some(senders) = &self.senders else { return };
        for info in senders.borrow_mut().pending() {
            // si_pid and si_uid are there for a signal a process sent (si_code <= 0: kill,
            // tgkill, sigqueue, pidfd_send_signal); a kernel-made one has neither.
            if info.si_code <= 0 {
                // SAFETY: a user-sent signal's siginfo carries the kill fields.
                let (pid, uid) = unsafe { (info.si_pid(), info.si_uid()) };
                self.last_sender.set(Some(Sender { pid, uid }));
            } else {
                self.last_sender.set(None);
            }
        }
    }

    /// The requester, when the SIGTERM that arrived (from `sender`) was `ccci-run stop`'s; its
    /// request is consumed.
    fn stop_requested(&self, sender: Option<Sender>) -> Option<Requester> {
        let stop = self.stop.as_ref()?;
        let sender = sender?;
        // Written by `ccci-run stop`, but in a directory the run's own command can write to: a
        // FIFO or a link planted there must not hold the teardown up. A requester is us or root
        // (only they may signal us), and so is the request's owner.
        let text = crate::files::read(&stop.path, &crate::files::Rules::small(4096).ours())
            .map_err(|err| {
                if !err.is_missing() {
                    tracing::warn!("not a stop request: {err}");
                }
            })
            .ok()?;
        let request: StopRequest = serde_json::from_slice(&text).ok()?;
        if !request.sent_by(sender, &stop.own) {
            tracing::debug!(
                ?request,
                ?sender,
                "a SIGTERM that is not the stop request's"
            );
            return None;
        }
        // The request is in a directory the run's own command can write to: one naming the
        // process that is about to send a plain SIGTERM (Drone's runner, systemd) would relabel
        // it. A real one is sent by a ccci-run, which waits for the end, so it is there to see.
        if sender.pid != 0 && !same_program(sender.pid) {
            tracing::warn!(
                ?sender,
                "a stop request names the sender of a SIGTERM, but the sender is not ccci-run: \
                 taken as a plain SIGTERM"
            );
            return None;
        }
        let _ = std::fs::remove_file(&stop.path);
        Some(request.requester())
    }

    /// The hard deadline was armed to fire at `at`: a SIGALRM that comes earlier (sent by
    /// someone else) is reported and ignored rather than taken for it.
    pub(crate) fn expect_deadline_at(&mut self, at: std::time::Instant) {
        self.deadline = Some(at);
    }

    /// Watch process `pid` through `fd` (a pidfd on an ancestor, `--tie-to`): its exit is
    /// reported as [`Arrived::tied_pid_died`].
    pub(crate) fn tie_to(&mut self, pid: i32, fd: OwnedFd) {
        self.tie.push((pid, Watched::new(fd)));
    }

    /// Watch a held lock: `fd` turns readable when it is lost; that is reported as
    /// [`Arrived::lock_lost`].
    pub(crate) fn watch_loss(&mut self, fd: OwnedFd) {
        self.losses.push(Watched::new(fd));
    }

    /// The first tied process that has exited, without consuming anything pending.
    pub(crate) fn tied_pid_exited(&self) -> Option<i32> {
        self.tie
            .iter()
            .find(|(_, t)| readable_now(t.fd.as_fd()))
            .map(|(pid, _)| *pid)
    }

    /// Signals (and deaths) that have arrived since the last call, without waiting.
    pub(crate) fn pending(&self) -> Arrived {
        self.drain_wake_pipe();
        self.note_senders();
        for signal in IGNORED
            .iter()
            .map(|s| *s as libc::c_int)
            .chain((crate::supervise::threads::kick_signal() + 1)..=libc::SIGRTMAX())
        {
            if FLAGS
                .get(signal as usize)
                .is_some_and(|f| f.swap(false, Ordering::SeqCst))
            {
                crate::supervise::ignored::ignored_signal(signal, ignored_name(signal), "");
            }
        }
        let mut arrived = Arrived {
            signals: CAUGHT
                .iter()
                .filter(|s| FLAGS[**s as usize].swap(false, Ordering::SeqCst))
                .copied()
                .collect(),
            ..Arrived::default()
        };
        if arrived.contains(Signal::SIGALRM) {
            // The alarm's clock started just after `deadline` was computed, so a real expiry
            // is never early; allow for nothing but scheduling noise.
            let due = self
                .deadline
                .is_some_and(|at| std::time::Instant::now() + ALARM_SLACK >= at);
            if !due {
                arrived.signals.retain(|s| *s != Signal::SIGALRM);
                report::line("== SIGALRM received before the hard deadline — ignored ==");
            }
        }
        if arrived.contains(Signal::SIGTERM) && nix::unistd::getppid() != self.start_ppid {
            arrived.signals.retain(|s| *s != Signal::SIGTERM);
            arrived.parent_died = true;
        }
        if arrived.contains(Signal::SIGTERM) {
            if let Some(by) = self.stop_requested(self.last_sender.take()) {
                arrived.signals.retain(|s| *s != Signal::SIGTERM);
                arrived.stopped = Some(by);
            }
        }
        // Every tie is looked at (and marked); the first that fired is the one named.
        let fired: Vec<i32> = self
            .tie
            .iter()
            .filter(|(_, w)| w.fired())
            .map(|(pid, _)| *pid)
            .collect();
        arrived.tied_pid_died = fired.first().copied();
        // Every watch is looked at (and marked), not just the first that fired.
        arrived.lock_lost = self.losses.iter().filter(|w| w.fired()).count() > 0;
        if !arrived.is_empty() {
            tracing::trace!(?arrived, "arrived");
        }
        arrived
    }

    /// The descriptor that turns readable when a signal arrives, for a wait that cannot be
    /// [`wait`](Self::wait) (an engine request in flight); [`pending`](Self::pending) then says
    /// what came.
    pub(crate) fn wake_fd(&self) -> BorrowedFd<'_> {
        self.wake.as_fd()
    }

    /// Wait until at least one signal arrives or `timeout` passes (`None`: no limit).
    pub(crate) fn wait(&self, timeout: Option<Duration>) -> Arrived {
        self.wait_on(&[], timeout).0
    }

    /// Like [`wait`](Self::wait), but also return when one of `others` becomes readable; the
    /// flag says whether any of them is.
    pub(crate) fn wait_on(
        &self,
        others: &[BorrowedFd<'_>],
        timeout: Option<Duration>,
    ) -> (Arrived, bool) {
        let arrived = self.pending();
        if !arrived.is_empty() {
            return (arrived, others.iter().any(|fd| readable_now(*fd)));
        }
        let timeout = match timeout {
            None => PollTimeout::NONE,
            // Round up so a short remaining grace does not spin with zero-length polls.
            Some(t) => PollTimeout::try_from(t.as_millis().saturating_add(1).min(i32::MAX as u128))
                .unwrap_or(PollTimeout::MAX),
        };
        let mut fds = vec![PollFd::new(self.wake.as_fd(), PollFlags::POLLIN)];
        fds.extend(others.iter().map(|fd| PollFd::new(*fd, PollFlags::POLLIN)));
        for watched in self.tie.iter().map(|(_, w)| w).chain(&self.losses) {
            if !watched.reported.get() {
                fds.push(PollFd::new(watched.fd.as_fd(), PollFlags::POLLIN));
            }
        }
        // EINTR is the expected way to be woken here; either way the flags below tell what.
        let _ = poll(&mut fds, timeout);
        let other_ready = fds[1..=others.len()]
            .iter()
            .any(|fd| fd.revents().is_some_and(|r| !r.is_empty()));
        (self.pending(), other_ready)
    }

    /// Wait for `work` until it is done, a way out arrives (a stop signal, the deadline, the
    /// parent or the tied process dying), or `until` passes; a `keepalive` `(every, tick)` calls
    /// `tick` each time `every` has passed while waiting. This is the one loop in which the main
    /// thread waits on a helper: the funnel and the work share one `poll`, so no signal goes
    /// unnoticed. On any outcome but `Done` the work is cancelled, and whatever it got is let go.
    pub(crate) fn await_work<W: Awaitable>(
        &self,
        mut work: W,
        until: Option<Instant>,
        mut keepalive: Option<(Duration, &mut dyn FnMut())>,
    ) -> Awaited<W::Output> {
        let mut next_tick = keepalive.as_ref().map(|(every, _)| Instant::now() + *every);
        loop {
            let now = Instant::now();
            let left = until.map(|u| u.saturating_duration_since(now));
            if left == Some(Duration::ZERO) {
                work.cancel();
                return Awaited::TimedOut;
            }
            let to_tick = next_tick.map(|at| at.saturating_duration_since(now));
            let timeout = match (left, to_tick) {
                (Some(left), Some(to_tick)) => Some(left.min(to_tick)),
                (left, to_tick) => left.or(to_tick),
            };
            let (arrived, ready) = self.wait_on(&[work.ready_fd()], timeout);
            if let Some(event) = shutdown_events(&arrived).next() {
                work.cancel();
                return Awaited::Stopped(event);
            }
            if let (Some(at), Some((every, tick))) = (next_tick, keepalive.as_mut()) {
                if Instant::now() >= at {
                    tick();
                    next_tick = Some(Instant::now() + *every);
                }
            }
            if ready {
                if let Some(outcome) = work.try_finish() {
                    return Awaited::Done(outcome);
                }
            }
        }
    }

    fn drain_wake_pipe(&self) {
        let mut buf = [0u8; 64];
        // Non-blocking: stops at WouldBlock; the pipe only ever holds wake-up bytes.
        while matches!((&self.wake).read(&mut buf), Ok(n) if n > 0) {}
    }
}

/// Turn caught signals into supervision events (SIGCHLD only wakes the loop up).
pub(crate) fn shutdown_events(arrived: &Arrived) -> impl Iterator<Item = Event> + '_ {
    let deaths = [
        arrived.tied_pid_died.map(Event::TiedPidDied),
        arrived.parent_died.then_some(Event::ParentDied),
        arrived.lock_lost.then_some(Event::LockLost),
        arrived.stopped.map(Event::Stopped),
    ];
    deaths
        .into_iter()
        .flatten()
        .chain(arrived.iter().filter_map(|signal| match signal {
            Signal::SIGALRM => Some(Event::Deadline),
            Signal::SIGCHLD => None,
            other => Some(Event::Signal(other)),
        }))
}

/// How a wait for a helper's work ended.
#[derive(Debug)]
pub(crate) enum Awaited<T> {
    Done(T),
    /// A way out arrived first; the work was cancelled.
    Stopped(Event),
    /// The budget ran out first; the work was cancelled.
    TimedOut,
}

/// The name of an ignored signal, for a status line that outlives this call: a known
/// signal's own name, `SIGRTMIN+N` for a real-time one (named once per number, for the process).
fn ignored_name(signal: libc::c_int) -> &'static str {
    match Signal::try_from(signal) {
        Ok(known) => known.as_str(),
        Err(_) => {
            static NAMES: std::sync::OnceLock<Vec<&'static str>> = std::sync::OnceLock::new();
            let names = NAMES.get_or_init(|| {
                (0..=libc::SIGRTMAX() - libc::SIGRTMIN())
                    .map(|n| &*format!("SIGRTMIN+{n}").leak())
                    .collect()
            });
            usize::try_from(signal - libc::SIGRTMIN())
                .ok()
                .and_then(|n| names.get(n).copied())
                .unwrap_or("a real-time signal")
        }
    }
}

/// `SIGUSR1`, or `SIGRTMIN+3` for a real-time signal.
fn signal_name(signal: libc::c_int) -> String {
    match Signal::try_from(signal) {
        Ok(known) => known.as_str().to_owned(),
        Err(_) => format!("SIGRTMIN+{}", signal - libc::SIGRTMIN()),
    }
}

#[cfg(test)]
mod tests;
