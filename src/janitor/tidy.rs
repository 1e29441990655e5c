//! Tidying after a sweep: unheld lock files no candidate stands behind, and the state files of
//! dead runs. Only ever what this user owns, of this configuration (the scope in the name), and
//! never anything a live run holds.

use std::collections::BTreeMap;
use std::io;

use crate::config::dirs::{self, Dir};
use crate::config::{Global, Hunt, SweepOptions};
use crate::janitor::sweep_report::SweepReport;
use crate::names::RunId;
use crate::rundir::{self, Liveness};
use crate::supervise::identity::Scope;

/// Remove the state files of this configuration's runs that are dead: their run's guard lock is
/// free (or gone), or held by a later run with the same id under another pid. A SIGKILLed run
/// cannot remove its own. Another configuration's files (another scope in the name, or none)
/// are never judged: its run ids mean nothing in our runs dir.
pub(super) fn tidy_state_files(
    global: &Global,
    scope: Option<Scope>,
    opts: &SweepOptions,
    report: &mut SweepReport,
) {
    let entries = match std::fs::read_dir(&global.state_dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            // A run's own sweep comes before it makes the state dir: only the janitor says so.
            if opts.hunt == Hunt::Everywhere {
                report
                    .warnings
                    .push(dirs::missing_line(Dir::State, &global.state_dir));
            }
            return;
        }
        Err(err) => {
            report.errors.push(format!(
                "failed to list state dir {} (--state-dir, CCCI_STATE_DIR): {err}",
                global.state_dir.display()
            ));
            return;
        }
    };
    // Without a runs dir, this configuration has no runs, and no state file is ours.
    let Some(scope) = scope.map(|s| s.to_string()) else {
        return;
    };
    let us = nix::unistd::Uid::effective().as_raw();
    let mut runs: BTreeMap<String, RunState> = BTreeMap::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((theirs, run_id, pid)) =
            name.to_str().and_then(crate::names::parse_state_file_name)
        else {
            continue;
        };
        if theirs != scope {
            continue;
        }
        if !entry
            .file_type()
            .is_ok_and(|t| t.is_file() || t.is_symlink())
        {
            continue;
        }
        // Only our own files: in a shared /tmp a name alone proves nothing.
        if std::fs::symlink_metadata(entry.path())
            .map(|m| {
                let owner = std::os::unix::fs::MetadataExt::uid(&m);
                owner != us && !crate::trust::ours(owner)
            })
            .unwrap_or(true)
        {
            continue;
        }
        let state = *runs
            .entry(run_id.as_str().to_owned())
            .or_insert_with(|| run_state(global, &run_id));
        let dead = match state {
            RunState::Dead => true,
            // A later run with the same id (Drone reuses build numbers) under another pid.
            RunState::Live(holder) => holder != pid,
            RunState::Unknown => false,
        };
        if !dead {
            continue;
        }
        let path = entry.path();
        if opts.dry_run {
            report.tidied.push(path);
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => report.tidied.push(path),
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => report.errors.push(format!(
                "failed to remove state file {}: {err}",
                path.display()
            )),
        }
    }
}

/// Whether a run id has a live run, judged by its guard lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunState {
    /// No run with this id is live.
    Dead,
    /// The live run with this id has this pid.
    Live(u32),
    /// Live (or unreadable) but its pid unknown: keep everything rather than guess.
    Unknown,
}

fn run_state(global: &Global, run_id: &RunId) -> RunState {
    match rundir::probe(&global.runs_dir.join(run_id.as_str()), false) {
        Liveness::NoGuard | Liveness::Free { .. } => RunState::Dead,
        live @ Liveness::Live { .. } => live
            .holder()
            .map_or(RunState::Unknown, |h| RunState::Live(h.pid)),
        Liveness::Unreadable(_) => RunState::Unknown,
    }
}
