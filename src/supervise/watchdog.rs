//! The watchdog: the last line of defence of a run's whole-life bound.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

use nix::sys::signal::Signal;

use crate::supervise::{cgroup, linux};
use crate::{exit, report};

/// The last line of defence of the whole-run bound: a thread that, should the main thread
/// still be running at the hard end (stuck in a call that never returns), kills everything the
/// run started, records `teardown-timeout` and ends the process. The app lock goes with it.
#[derive(Debug)]
pub(crate) struct Watchdog {
    code: Arc<AtomicU8>,
    /// Why the thread could not be started: then the run must not start either.
    failed: Option<std::io::Error>,
}

/// The watchdog could not be started: a run without its last-resort bound does not start.
#[derive(Debug, thiserror::Error)]
#[error(
    "failed to start the watchdog thread: {0} — a limit on the processes or threads this user \
     may have (RLIMIT_NPROC, pids.max) or on memory (RLIMIT_AS) was reached; a run does not \
     start without its last-resort bound"
)]
pub(crate) struct WatchdogError(std::io::Error);

impl Watchdog {
    /// Arm it: at `hard_end`, kill `cgroup` and every descendant, call `last_words` with the
    /// exit code (the run records how it ended there) and `_exit` with that code.
    pub(crate) fn arm(
        hard_end: Instant,
        cgroup: Option<PathBuf>,
        last_words: impl FnOnce(u8) + Send + 'static,
    ) -> Self {
        // Until the main thread names a reason, the deadline is the first: the hard end comes
        // only after it, so a main thread that never saw it (stopped, or stuck) ends with its
        // code. (Not INTERNAL: which code a stopped supervisor ends with must not depend on
        // which thread runs first once it is continued.)
        let code = Arc::new(AtomicU8::new(exit::DEADLINE));
        let exit_code = Arc::clone(&code);
        let span = tracing::Span::current();
        let spawned = crate::supervise::threads::room_for_thread().and_then(|()| {
            std::thread::Builder::new()
            .name("watchdog".to_owned())
            .spawn(move || {
                let _in_span = span.enter();
                crate::supervise::threads::block_all_signals_but_kick();
                loop {
                    let left = hard_end.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    std::thread::sleep(left);
                }
                let code = exit_code.load(Ordering::SeqCst);
                report::line(
                    "!! teardown budget exhausted — killing what is left of the run and exiting",
                );
                if let Some(dir) = cgroup {
                    let _ = cgroup::kill_path(&dir);
                }
                for descendant in linux::living_descendants().unwrap_or_default() {
                    let _ = descendant.dir.signal(Signal::SIGKILL);
                }
                last_words(code);
                // SAFETY: ends the process at once; nothing of ours must run after this.
                unsafe { nix::libc::_exit(i32::from(code)) }
            })
        });
        Self {
            code,
            failed: spawned.err(),
        }
    }

    /// Whether it runs; the error says why not (taken once).
    pub(crate) fn check(&mut self) -> Result<(), WatchdogError> {
        self.failed
            .take()
            .map_or(Ok(()), |err| Err(WatchdogError(err)))
    }

    /// The code to exit with if the watchdog has to end the run.
    pub(crate) fn set_exit_code(&self, code: u8) {
        self.code.store(code, Ordering::SeqCst);
    }
}
