//! Status lines for the people and programs watching a run: the waiting line, the teardown
//! lines, refusals. They go to stderr verbatim, apart from `tracing` diagnostics, so an operator
//! can read them in a Drone log and a test can wait for them.

use std::io::Write;

/// Write one status line to stderr, unbuffered, whatever the log level.
pub(crate) fn line(text: &str) {
    let mut err = std::io::stderr().lock();
    // A closed stderr must not turn into a panic in the middle of a teardown.
    let _ = writeln!(err, "{text}");
    let _ = err.flush();
}
