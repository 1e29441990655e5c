//! Exit codes: every status `ccci-run` itself can end with, in one place.
//!
//! Apart from these, `run` passes the command's own status through (128+N when a signal N
//! killed it). Operators and Drone steps branch on these numbers; the README documents them.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

/// The janitor's sweep did not complete, or a reap failed.
pub(crate) const FAILURE: u8 = 1;
/// Usage error or invalid input (also what clap uses for a bad command line).
pub(crate) const USAGE: u8 = 2;
/// A lock (the app lock or a named lock) was not acquired within its budget.
pub(crate) const LOCK_TIMEOUT: u8 = 75;
/// `converge`: the stack did not converge within `--timeout`.
pub(crate) const CONVERGE_TIMEOUT: u8 = 75;
/// A held lock was lost behind its holder's back (a lease that expired or was revoked); after
/// teardown.
pub(crate) const LOCK_LOST: u8 = 76;
/// ccci-run itself failed: setup, unsafe lock file, Docker required but unreachable, orphaned start.
pub(crate) const INTERNAL: u8 = 125;
/// The command was found but could not be executed.
pub(crate) const NOT_EXECUTABLE: u8 = 126;
/// The command was not found.
pub(crate) const NOT_FOUND: u8 = 127;
/// Offset added to a signal number: the shell's convention for "killed by signal N".
pub(crate) const SIGNAL_BASE: u8 = 128;
/// The run's hard deadline fired (128 + SIGALRM).
pub(crate) const DEADLINE: u8 = 142;

/// `128 + signal`, the code a run ends with after tearing down on that signal.
pub(crate) fn for_signal(signal: nix::sys::signal::Signal) -> u8 {
    SIGNAL_BASE.saturating_add(signal as u8)
}
