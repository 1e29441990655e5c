//! Status lines for the people and programs watching a run: the waiting line, the teardown
//! lines, refusals. In text mode they go to stderr verbatim, apart from `tracing` diagnostics,
//! so an operator can read them in a Drone log and a test can wait for them. With
//! `--log-format json` everything on stderr is JSON, one object per line: status lines too are
//! events then (`"status": true`), carrying the run's id and domain like every other event.
//!
//! This module owns the process's stdout and stderr: every byte ccci-run writes goes through
//! [`Stderr`] (status lines and `tracing` events) or [`stdout`] (documents and tables). A write
//! to a closed pipe (EPIPE: the reader died) or a full disk (ENOSPC) is dropped here and never
//! becomes a panic, so it cannot change the exit code a run records. `clippy.toml` keeps
//! `print!`, `eprintln!` and `std::io::stdout()`/`stderr()` out of every other module.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.
#![expect(
    clippy::disallowed_methods,
    reason = "the one module that writes to stdout and stderr"
)]

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
    let mut line = String::with_capacity(text.len() + 1);
    line.push_str(text);
    line.push('\n');
    let _ = Stderr.write_all(line.as_bytes());
}

/// stderr for `tracing` and status lines: one line a write, and a write that fails (a closed
/// pipe, a full disk, anything) is dropped and counted as written. `tracing_subscriber`'s fmt
/// layer reports a failed write with `eprintln!`, which panics when stderr fails: a closed
/// stderr turned the first event after it into exit 101 (run.json saying otherwise), and in
/// the etcd guard's task (JSON logs, where its loss line is an event) a panic before it could
/// tell the run its lock was lost. This writer never gives it an error to report.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Stderr;

impl Write for Stderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // One locked write_all a line, so that lines of several threads never interleave.
        let _ = std::io::stderr().lock().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().lock().flush();
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Stderr {
    type Writer = Stderr;

    fn make_writer(&'a self) -> Self::Writer {
        Stderr
    }
}

/// Whether stderr is a terminal (for colour).
pub(crate) fn stderr_is_terminal() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr())
}

/// Write `bytes` to stdout and flush. A closed stdout (`| head`) ends the output quietly, as
/// coreutils do; any other error (a full disk) is returned for the caller to judge. Never a
/// panic.
pub(crate) fn stdout(bytes: &[u8]) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
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

/// The version of every `--json` document; raised when a field changes meaning or goes away
/// (new fields may come without it).
pub(crate) const JSON_VERSION: u32 = 1;

/// Every `--json` document: `{"version": 1, <what the command reports>, "errors": [...]}`,
/// the report's own fields beside the version, and the errors met on the way (each one a
/// sentence; an empty list when there were none). A report that keeps its own `errors` (the
/// janitor's) gets the version only.
#[derive(Debug, serde::Serialize)]
pub(crate) struct Envelope<'a, T: serde::Serialize> {
    pub version: u32,
    #[serde(flatten)]
    pub report: &'a T,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub errors: Option<Vec<String>>,
}

impl<'a, T: serde::Serialize> Envelope<'a, T> {
    pub(crate) fn new(report: &'a T, errors: Vec<String>) -> Self {
        Self {
            version: JSON_VERSION,
            report,
            errors: Some(errors),
        }
    }

    /// For a report with an `errors` list of its own.
    pub(crate) fn versioned(report: &'a T) -> Self {
        Self {
            version: JSON_VERSION,
            report,
            errors: None,
        }
    }
}

/// The width every default table fits (`runs`, `locks`, `janitor`); `-o wide` cuts nothing.
pub(crate) const TABLE_WIDTH: usize = 100;

/// `text` cut to `width` characters, its last one `…` when cut.
pub(crate) fn fit(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(width.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// One column of a [`table`]: its header, the most characters it takes in the default table
/// (longer values are cut with `…`), and whether it is aligned right.
pub(crate) struct Column {
    pub header: &'static str,
    pub cap: usize,
    pub right: bool,
}

/// A table: the columns as wide as their widest value (in the default table, at most their
/// cap), one space apart, then two spaces and the last, free column (`last`, with each row's
/// last cell), cut so that every line fits [`TABLE_WIDTH`] unless `wide`. Lines end without
/// trailing spaces.
pub(crate) fn table(columns: &[Column], last: &str, rows: &[Vec<String>], wide: bool) -> String {
    let widths: Vec<usize> = columns
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let widest = rows
                .iter()
                .filter_map(|row| row.get(i))
                .map(|cell| cell.chars().count())
                .chain([c.header.chars().count()])
                .max()
                .unwrap_or(0);
            if wide { widest } else { widest.min(c.cap) }
        })
        .collect();
    let line = |cells: &mut dyn Iterator<Item = &str>, rest: &str| {
        let front: Vec<String> = columns
            .iter()
            .zip(&widths)
            .zip(cells)
            .map(|((c, &w), text)| {
                let text = if wide { text.to_owned() } else { fit(text, w) };
                if c.right {
                    format!("{text:>w$}")
                } else {
                    format!("{text:<w$}")
                }
            })
            .collect();
        let front = front.join(" ");
        let rest = if wide {
            rest.to_owned()
        } else {
            fit(rest, TABLE_WIDTH.saturating_sub(front.chars().count() + 2))
        };
        format!("{front}  {rest}").trim_end().to_owned() + "\n"
    };
    let mut out = line(&mut columns.iter().map(|c| c.header), last);
    for row in rows {
        let n = columns.len();
        let rest = row.get(n).map(String::as_str).unwrap_or_default();
        out.push_str(&line(&mut row.iter().take(n).map(String::as_str), rest));
    }
    out
}

/// Pretty JSON of a report made of plain data.
pub(crate) fn json(value: &impl serde::Serialize) -> String {
    // No control or bidi character reaches a reader of any document, raw or decoded.
    crate::names::visible_json(
        &serde_json::to_string_pretty(value).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}")),
    )
}

/// Set up logging once: the level from `-q`/`-v` (or `RUST_LOG`), status lines always shown,
/// text or JSON on stderr.
pub(crate) fn init_logging(quiet: u8, verbose: u8, format: crate::config::LogFormat) {
    let level = match (quiet, verbose) {
        (q, _) if q > 0 => "error",
        (_, 0) => "warn",
        (_, 1) => "info",
        (_, 2) => "debug",
        _ => "trace",
    };
    // Status lines are always shown, whatever the level or RUST_LOG says.
    let status = format!("{}=info", STATUS_TARGET)
        .parse()
        .expect("a valid directive");
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("ccci_run={level}")))
        .add_directive(status);
    // Colour only for a person at a terminal, and never when NO_COLOR says so.
    let colour = stderr_is_terminal() && !crate::config::env::no_color();
    // A stderr nobody reads any more (or a full disk) drops the event, never a panic.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(Stderr)
        .with_ansi(colour)
        .with_target(false);
    let _ = match format {
        crate::config::LogFormat::Text => builder.without_time().try_init(),
        crate::config::LogFormat::Json => {
            use_json();
            builder
                .json()
                .with_current_span(true)
                .with_span_list(false)
                .try_init()
        }
    };
}
