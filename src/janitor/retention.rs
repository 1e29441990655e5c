//! Run-dir retention: `janitor --keep-runs DAYS` removes per-run directories older than DAYS
//! whose run is not live.
//!
//! Invariant: a directory is removed only while we hold its guard lock (`run.lock`), so a live
//! run's directory — its guard is held for the run's whole life — is never touched.

use std::io;
use std::path::Path;
use std::time::{Duration, SystemTime};

use crate::janitor::report::SweepReport;
use crate::names::RunId;
use crate::run::rundir::{self, Liveness};

/// Remove (or, in a dry run, list) finished run directories older than `keep`.
pub(crate) fn sweep(runs_dir: &Path, keep: Duration, dry_run: bool, report: &mut SweepReport) {
    let removed = report.runs_removed.get_or_insert_with(Vec::new);
    let entries = match std::fs::read_dir(runs_dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return,
        Err(err) => {
            report.errors.push(format!(
                "failed to list runs dir {}: {err}",
                runs_dir.display()
            ));
            return;
        }
    };
    let now = SystemTime::now();
    for entry in entries.flatten() {
        // Only real directories named like a run id: nothing followed, nothing foreign.
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Some(_) = entry
            .file_name()
            .to_str()
            .and_then(|n| RunId::parse(n).ok())
        else {
            continue;
        };
        let dir = entry.path();
        // A run's last record write is when it finished; a directory without one, its own time.
        let last = std::fs::metadata(dir.join(crate::names::RUN_RECORD_FILE))
            .or_else(|_| std::fs::metadata(&dir))
            .and_then(|m| m.modified());
        let Ok(last) = last else { continue };
        if now.duration_since(last).unwrap_or_default() <= keep {
            continue;
        }
        // Nothing is removed without holding the run's guard: a directory without one may be a
        // run's that is being created right now, so the guard is made (a dry run changes
        // nothing and only looks).
        let _held = match rundir::probe(&dir, !dry_run) {
            // The path must still name the inode we locked (another janitor may have removed
            // the directory, and a new run made it anew).
            Liveness::Free { current: false, .. } => continue,
            Liveness::Free { guard, .. } => Some(guard),
            // Held: the run is live, however old its directory looks.
            Liveness::Live { .. } => continue,
            Liveness::NoGuard => None,
            Liveness::Unreadable(err) => {
                report
                    .errors
                    .push(format!("not removing {}: {err}", dir.display()));
                continue;
            }
        };
        if dry_run {
            removed.push(dir);
            continue;
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => removed.push(dir),
            Err(err) => report
                .errors
                .push(format!("failed to remove run dir {}: {err}", dir.display())),
        }
    }
}
