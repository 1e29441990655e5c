//! Signals and events that came once a run was already on its way out: each reported once,
//! a flood of one signal summarised, and the totals said at the end.
//!
//! Floor: mechanisms (docs/architecture.md): imports the ground and the mechanisms, nothing above.

use std::time::{Duration, Instant};

use crate::report;
use crate::supervise::shutdown::Event;

/// The line for a signal or deadline that arrived once teardown had begun. A signal that keeps
/// coming is summarised ([`ignored_signal`]): its first arrival has a line, later ones at most
/// one line a second, and [`summarise_ignored`] gives the total at the end.
pub(crate) fn report_ignored(event: Event) {
    match event {
        Event::Signal(signal) => {
            ignored_signal(signal as i32, signal.as_str(), "during teardown");
        }
        Event::Deadline => report::line("== hard deadline passed during teardown — ignored =="),
        Event::ParentDied => report::line("== parent process died during teardown — ignored =="),
        Event::TiedPidDied(pid) => {
            report::line(&format!(
                "== tied process {pid} exited (--tie-to) during teardown — ignored =="
            ));
        }
        Event::LockLost => report::line("== the lock was lost during teardown — ignored =="),
        Event::Stopped(by) => report::line(&format!(
            "== ccci-run stop (uid {}, pid {}) during teardown — ignored ==",
            by.uid, by.pid
        )),
        _ => {}
    }
}

/// How often an ignored signal has come: per signal number, since its last line and in all.
struct Tally {
    unreported: [u64; 65],
    total: [u64; 65],
    last_line: [Option<Instant>; 65],
    /// The name and the words of each signal's line, for the summary.
    names: [Option<(&'static str, &'static str)>; 65],
}

static TALLY: std::sync::Mutex<Tally> = std::sync::Mutex::new(Tally {
    unreported: [0; 65],
    total: [0; 65],
    last_line: [None; 65],
    names: [None; 65],
});

/// How often a flood of one ignored signal may add a line.
const IGNORED_LINE_EVERY: Duration = Duration::from_secs(1);

/// Note that signal `number` (`name`) arrived and was ignored (`context`: "during teardown",
/// or empty): the first one is reported, then at most one "N more" line a second.
pub(crate) fn ignored_signal(number: i32, name: &'static str, context: &'static str) {
    let Ok(at) = usize::try_from(number) else {
        return;
    };
    let mut tally = TALLY
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if at >= tally.total.len() {
        return;
    }
    let now = Instant::now();
    tally.total[at] += 1;
    tally.names[at] = Some((name, context));
    let spaced = if context.is_empty() { "" } else { " " };
    if tally.total[at] == 1 {
        tally.last_line[at] = Some(now);
        report::line(&format!("== {name} received{spaced}{context} — ignored =="));
        return;
    }
    tally.unreported[at] += 1;
    if tally.last_line[at].is_none_or(|t| now.duration_since(t) >= IGNORED_LINE_EVERY) {
        let more = std::mem::take(&mut tally.unreported[at]);
        tally.last_line[at] = Some(now);
        report::line(&format!(
            "== {more} more {name} received{spaced}{context} — ignored =="
        ));
    }
}

/// At the end: for each signal that came more than once, the total.
pub(crate) fn summarise_ignored() {
    let mut tally = TALLY
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for at in 0..tally.total.len() {
        let total = tally.total[at];
        if total > 1 {
            if let Some((name, context)) = tally.names[at] {
                let spaced = if context.is_empty() { "" } else { " " };
                report::line(&format!(
                    "== {name} received {total} times{spaced}{context} — all ignored =="
                ));
            }
        }
        tally.unreported[at] = 0;
        tally.total[at] = 0;
    }
}
