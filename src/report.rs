//! Status lines for the people and programs watching a run: the waiting line, the teardown
//! lines, refusals. In text mode they go to stderr verbatim, apart from `tracing` diagnostics,
//! so an operator can read them in a Drone log and a test can wait for them. With
//! `--log-format json` everything on stderr is JSON, one object per line: status lines too are
//! events then (`"status": true`), carrying the run's id and domain like every other event.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

/// The `tracing` target of status lines; the log filter always lets it through.
pub(crate) const STATUS_TARGET: &str = "ccci_run::status";

static JSON: AtomicBool = AtomicBool::new(false);

/// From now on, status lines are JSON events.
pub(crate) fn use_json() {
    JSON.store(true, Ordering::SeqCst);
}

/// Whether status lines are JSON events.
pub(crate) fn is_json() -> bool {
    JSON.load(Ordering::SeqCst)
}

/// Write one status line to stderr, unbuffered, whatever the log level.
pub(crate) fn line(text: &str) {
    if JSON.load(Ordering::SeqCst) {
        tracing::info!(target: STATUS_TARGET, status = true, "{text}");
        return;
    }
    plain(text);
}

/// Write the error a command ends with: like [`line`], at error level in JSON mode, where the
/// event also says what kind of error it was and the exit code it ends with, for a script to
/// branch on.
pub(crate) fn failure(text: &str, kind: &str, exit_code: u8) {
    if JSON.load(Ordering::SeqCst) {
        tracing::error!(target: STATUS_TARGET, status = true, kind, exit_code, "{text}");
        return;
    }
    plain(text);
}

fn plain(text: &str) {
    let mut err = std::io::stderr().lock();
    // A closed stderr must not turn into a panic in the middle of a teardown.
    let _ = writeln!(err, "{text}");
    let _ = err.flush();
}

/// Send one line to the system journal (identifier `ccci-run`), for what must reach the
/// operator even when stderr no longer does: the outcome of a run whose build log was closed
/// by the runner's cancel. Where no journal socket exists this does nothing, quietly.
pub(crate) fn journal(text: &str) {
    use tracing_subscriber::layer::SubscriberExt;
    let Ok(layer) = tracing_journald::layer() else {
        tracing::debug!("no system journal to send the outcome to");
        return;
    };
    let layer = layer.with_syslog_identifier("ccci-run".to_owned());
    let subscriber = tracing_subscriber::registry().with(layer);
    tracing::subscriber::with_default(subscriber, || {
        tracing::info!(target: JOURNAL_TARGET, "{text}");
    });
}

/// The `tracing` target of journal lines.
const JOURNAL_TARGET: &str = "ccci_run::journal";
