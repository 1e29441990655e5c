//! Blocking work the main thread must be able to walk away from: a parked `flock`, a recipe
//! fetch that hangs on a silent server.
//!
//! The work runs on a helper thread that blocks every signal but the kick, so process-directed
//! signals keep going to the main thread, which waits on [`Worker::ready_fd`] and the signal
//! funnel together — no window in which a signal goes unnoticed. To stop the work, [`cancel`]
//! raises a flag the work checks and kicks the thread until it answers, which interrupts a
//! blocking system call with `EINTR` (the kick's handler has no `SA_RESTART`).
//!
//! [`cancel`]: Worker::cancel

use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::thread::JoinHandleExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, TryRecvError};
use std::thread::JoinHandle;
use std::time::Duration;

/// How long [`Worker::cancel`] keeps kicking before it leaves the thread to the process's exit.
const CANCEL_PATIENCE: Duration = Duration::from_secs(5);
const KICK_INTERVAL: Duration = Duration::from_millis(5);

/// Work the main thread waits for next to the signal funnel
/// ([`SignalFunnel::await_work`](crate::supervise::signals::SignalFunnel::await_work)).
pub(crate) trait Awaitable {
    type Output;
    /// Becomes readable once the work is done.
    fn ready_fd(&self) -> BorrowedFd<'_>;
    /// The outcome, if the work is done.
    fn try_finish(&mut self) -> Option<Self::Output>;
    /// Stop the work and let go of whatever it got meanwhile.
    fn cancel(self);
}

impl<T: Send + 'static> Awaitable for Worker<T> {
    type Output = T;

    fn ready_fd(&self) -> BorrowedFd<'_> {
        Worker::ready_fd(self)
    }

    fn try_finish(&mut self) -> Option<T> {
        Worker::try_finish(self)
    }

    fn cancel(self) {
        drop(Worker::cancel(self));
    }
}

/// Set once the owner wants the work to stop; the work checks it whenever it can.
#[derive(Debug, Clone, Default)]
pub(crate) struct CancelFlag(Arc<AtomicBool>);

impl CancelFlag {
    pub(crate) fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    fn cancel(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Work under way on a helper thread, producing a `T`.
#[derive(Debug)]
pub(crate) struct Worker<T> {
    outcome: Receiver<T>,
    ready: UnixStream,
    thread: Option<JoinHandle<()>>,
    flag: CancelFlag,
    name: &'static str,
}

impl<T: Send + 'static> Worker<T> {
    /// Start `work` on a thread called `name`.
    pub(crate) fn spawn(
        name: &'static str,
        work: impl FnOnce(&CancelFlag) -> T + Send + 'static,
    ) -> std::io::Result<Self> {
        // The error says which limit stood in the way: callers only add what they were doing.
        let hinted = |e: std::io::Error| {
            std::io::Error::new(
                e.kind(),
                format!("{e}{}", crate::supervise::threads::thread_limit_hint(&e)),
            )
        };
        crate::supervise::threads::room_for_thread().map_err(hinted)?;
        let (ready, notify) = UnixStream::pair()?;
        let (tx, rx) = mpsc::channel();
        let flag = CancelFlag::default();
        let thread_flag = flag.clone();
        let span = tracing::Span::current();
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let _in_span = span.enter();
                crate::supervise::threads::block_all_signals_but_kick();
                let outcome = work(&thread_flag);
                // The outcome first: when `ready` turns readable, it is there to take.
                let _ = tx.send(outcome);
                let _ = (&notify).write_all(&[1]);
            })
            .map_err(hinted)?;
        Ok(Self {
            outcome: rx,
            ready,
            thread: Some(thread),
            flag,
            name,
        })
    }

    /// Becomes readable once the work is done.
    pub(crate) fn ready_fd(&self) -> BorrowedFd<'_> {
        self.ready.as_fd()
    }

    /// The outcome, if the work is done.
    pub(crate) fn try_finish(&mut self) -> Option<T> {
        match self.outcome.try_recv() {
            Ok(outcome) => {
                self.join();
                Some(outcome)
            }
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => {
                self.join();
                None
            }
        }
    }

    /// Stop the work: raise the flag and kick the thread until it answers. Returns what it
    /// produced, if it got that far (a lock it acquired meanwhile, say: dropping it lets go).
    pub(crate) fn cancel(mut self) -> Option<T> {
        self.flag.cancel();
        let thread = self.thread.take()?;
        let id = thread.as_pthread_t();
        let rounds = CANCEL_PATIENCE.as_millis() / KICK_INTERVAL.as_millis();
        for _ in 0..rounds {
            crate::supervise::threads::kick_thread(id);
            match self.outcome.recv_timeout(KICK_INTERVAL) {
                Ok(outcome) => {
                    let _ = thread.join();
                    return Some(outcome);
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let _ = thread.join();
                    return None;
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
        tracing::warn!(
            thread = self.name,
            "helper thread did not stop within {CANCEL_PATIENCE:?}; leaving it to the process's exit"
        );
        None
    }

    fn join(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
