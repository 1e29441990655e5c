//! The watchdog: the last line of defence of a run's whole-life bound.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

use nix::sys::signal::Signal;

use crate::exit;
use crate::report;
use crate::supervise::{cgroup, linux};

/// The last line of defence of the whole-run bound: a thread that, should the main thread
/// still be running at the hard end (stuck in a call that never returns), kills everything the
/// run started, records `teardown-timeout` and ends the process. The app lock goes with it.
#[derive(Debug)]
pub(crate) struct Watchdog {
    code: Arc<AtomicU8>,
}

impl Watchdog {
    /// Arm it: at `hard_end`, kill `cgroup` and every descendant, call `last_words` with the
    /// exit code (the run records how it ended there) and `_exit` with that code.
    pub(crate) fn arm(
        hard_end: Instant,
        cgroup: Option<PathBuf>,
        last_words: impl FnOnce(u8) + Send + 'static,
    ) -> Self {
        let code = Arc::new(AtomicU8::new(exit::INTERNAL));
        let exit_code = Arc::clone(&code);
        let span = tracing::Span::current();
        let spawned = std::thread::Builder::new()
            .name("watchdog".to_owned())
            .spawn(move || {
                let _in_span = span.enter();
                linux::block_all_signals_but_kick();
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
                let me = nix::unistd::getpid();
                for pid in linux::living_descendants(me).unwrap_or_default() {
                    let _ = linux::signal_process(pid, Signal::SIGKILL);
                }
                last_words(code);
                // SAFETY: ends the process at once; nothing of ours must run after this.
                unsafe { nix::libc::_exit(i32::from(code)) }
            });
        if let Err(err) = spawned {
            tracing::warn!("failed to start the watchdog thread: {err}");
        }
        Self { code }
    }

    /// The code to exit with if the watchdog has to end the run.
    pub(crate) fn set_exit_code(&self, code: u8) {
        self.code.store(code, Ordering::SeqCst);
    }
}
