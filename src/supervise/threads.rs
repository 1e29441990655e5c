//! Helper threads as the kernel sees them: the real-time signal that kicks one out of a
//! blocking call, the signal mask that leaves it only that one, and the room a new thread
//! needs before it is started.
//!
//! Floor: mechanisms (docs/architecture.md): imports the ground and the mechanisms, nothing above.

use std::io;

use nix::libc;

/// The real-time signal used to interrupt a helper thread parked in a blocking call. Nothing
/// outside this process sends it; its handler does nothing but make the call return `EINTR`.
pub(crate) fn kick_signal() -> libc::c_int {
    libc::SIGRTMIN()
}

/// In the calling thread, block every signal but [`kick_signal`]: process-directed signals then
/// go to the main thread, and only a deliberate kick interrupts this one.
pub(crate) fn block_all_signals_but_kick() {
    // SAFETY: sigset manipulation on a local set, then a per-thread mask change.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        libc::sigdelset(&mut set, kick_signal());
        libc::pthread_sigmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
    }
}

/// The address space a new thread needs to be had first: its stack (std's 2 MiB), the signal
/// stack std maps for it, and what it and the rest of the process allocate as it starts, with
/// room to spare.
const THREAD_ROOM: usize = 8 << 20;

/// Whether a thread can start in the address space left (RLIMIT_AS): one started in too
/// little gets its stack and then fails in std's own set-up ("failed to allocate an
/// alternative stack") or at its first allocation, which is a panic or an abort, not an error.
/// The probe is an inaccessible, unreserved mapping of [`THREAD_ROOM`] given back at once: it
/// costs no memory, only address space for a moment.
pub(crate) fn room_for_thread() -> io::Result<()> {
    // SAFETY: a new private anonymous mapping that nothing refers to, unmapped at once.
    unsafe {
        let at = libc::mmap(
            std::ptr::null_mut(),
            THREAD_ROOM,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        );
        if at == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        libc::munmap(at, THREAD_ROOM);
    }
    Ok(())
}

/// What a failure to create a thread or map its stack points at, for its message.
pub(crate) fn thread_limit_hint(err: &io::Error) -> &'static str {
    match err.raw_os_error() {
        Some(libc::EAGAIN | libc::ENOMEM) => {
            " — a limit on the processes or threads this user may have (RLIMIT_NPROC, \
             pids.max) or on memory (RLIMIT_AS) was reached"
        }
        _ => "",
    }
}

/// Interrupt the thread `thread` with [`kick_signal`].
pub(crate) fn kick_thread(thread: libc::pthread_t) {
    // SAFETY: the caller keeps the thread joinable (not yet joined), so the id is valid.
    unsafe {
        libc::pthread_kill(thread, kick_signal());
    }
}
