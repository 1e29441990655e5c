//! The signal funnel: SIGTERM, SIGINT, SIGHUP, SIGALRM (the hard deadline) and SIGCHLD are
//! caught once, recorded in flags and announced through a self-pipe, so the supervisor waits for
//! "something happened" with a timeout and then reads what.
//!
//! Handlers are installed without `SA_RESTART` (see `linux::clear_sa_restart`): a blocking call
//! such as a parked `flock` returns `EINTR` when one of these signals arrives, and its caller
//! checks [`SignalFunnel::pending`]. Every blocking call in the process must therefore handle
//! `EINTR`.

use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::Signal;

use crate::linux;

/// The signals the funnel catches, in the order they are reported when several are pending.
const CAUGHT: [Signal; 5] = [
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGHUP,
    Signal::SIGALRM,
    Signal::SIGCHLD,
];

// One flag per caught signal; statics because the handlers outlive any value we could own.
static FLAGS: [AtomicBool; CAUGHT.len()] = [const { AtomicBool::new(false) }; CAUGHT.len()];
static KICKED: AtomicBool = AtomicBool::new(false);

/// Signals that arrived since the last look, in [`CAUGHT`] order.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Arrived(Vec<Signal>);

impl Arrived {
    pub fn iter(&self) -> impl Iterator<Item = Signal> + '_ {
        self.0.iter().copied()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn contains(&self, signal: Signal) -> bool {
        self.0.contains(&signal)
    }
}

/// The installed funnel. There is one per process.
pub struct SignalFunnel {
    wake: UnixStream,
}

#[derive(Debug, thiserror::Error)]
#[error("failed to install the {signal} handler: {source}")]
pub struct InstallError {
    signal: Signal,
    source: io::Error,
}

impl SignalFunnel {
    /// Install the handlers. Call once, before any child is spawned.
    pub fn install() -> Result<Self, InstallError> {
        let (wake, notify) = UnixStream::pair().map_err(|source| InstallError {
            signal: Signal::SIGTERM,
            source,
        })?;
        wake.set_nonblocking(true).map_err(|source| InstallError {
            signal: Signal::SIGTERM,
            source,
        })?;
        for (signal, flag) in CAUGHT.iter().zip(&FLAGS) {
            let err = |source| InstallError {
                signal: *signal,
                source,
            };
            signal_hook::flag::register(*signal as i32, flag).map_err(err)?;
            let notify = notify.try_clone().map_err(err)?;
            signal_hook::low_level::pipe::register(*signal as i32, notify).map_err(err)?;
            linux::clear_sa_restart(*signal as i32).map_err(err)?;
        }
        // The kick only has to interrupt a helper thread's blocking call: a flag nobody reads.
        let kick = linux::kick_signal();
        let err = |source| InstallError {
            signal: Signal::SIGALRM,
            source,
        };
        signal_hook::flag::register(kick, &KICKED).map_err(err)?;
        linux::clear_sa_restart(kick).map_err(err)?;
        Ok(Self { wake })
    }

    /// Signals that have arrived since the last call, without waiting.
    pub fn pending(&self) -> Arrived {
        self.drain_wake_pipe();
        Arrived(
            CAUGHT
                .iter()
                .zip(&FLAGS)
                .filter(|(_, flag)| flag.swap(false, Ordering::SeqCst))
                .map(|(signal, _)| *signal)
                .collect(),
        )
    }

    /// Wait until at least one signal arrives or `timeout` passes (`None`: no limit).
    pub fn wait(&self, timeout: Option<Duration>) -> Arrived {
        self.wait_or(None, timeout).0
    }

    /// Like [`wait`](Self::wait), but also return when `other` becomes readable; the flag
    /// says whether it is.
    pub fn wait_or(
        &self,
        other: Option<BorrowedFd<'_>>,
        timeout: Option<Duration>,
    ) -> (Arrived, bool) {
        let arrived = self.pending();
        if !arrived.is_empty() {
            return (arrived, other.is_some_and(readable_now));
        }
        let timeout = match timeout {
            None => PollTimeout::NONE,
            // Round up so a short remaining grace does not spin with zero-length polls.
            Some(t) => PollTimeout::try_from(t.as_millis().saturating_add(1).min(i32::MAX as u128))
                .unwrap_or(PollTimeout::MAX),
        };
        let mut fds = vec![PollFd::new(self.wake.as_fd(), PollFlags::POLLIN)];
        fds.extend(other.map(|fd| PollFd::new(fd, PollFlags::POLLIN)));
        // EINTR is the expected way to be woken here; either way the flags below tell what.
        let _ = poll(&mut fds, timeout);
        let other_ready = fds
            .get(1)
            .and_then(PollFd::revents)
            .is_some_and(|r| !r.is_empty());
        (self.pending(), other_ready)
    }

    fn drain_wake_pipe(&self) {
        let mut buf = [0u8; 64];
        // Non-blocking: stops at WouldBlock; the pipe only ever holds wake-up bytes.
        while matches!((&self.wake).read(&mut buf), Ok(n) if n > 0) {}
    }
}

fn readable_now(fd: BorrowedFd<'_>) -> bool {
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
}
