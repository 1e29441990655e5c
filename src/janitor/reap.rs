//! Reaping what dead runs left: their processes (cgroups first, then the environment scan), and,
//! once an app's Docker resources are confirmed gone, its `.env`, its lock file (still held)
//! and a note in the dead run's record.

use std::time::{Duration, SystemTime};

use crate::app;
use crate::config::Global;
use crate::janitor::Candidate;
use crate::janitor::decide::Decision;
use crate::janitor::report::CandidateReport;
use crate::lock::Holder;
use crate::lock::backend::Lease;
use crate::names::{AppDomain, RunId};
use crate::report;
use crate::run::record::{self, RunRecord};
use crate::run::rundir::{self, Liveness};
use crate::supervise::{cgroup, leftovers};

/// After its Docker resources are gone: remove the app's `.env`, unlink the lock file (still
/// holding it), and mark the dead run's record.
pub(super) fn finish_reap(
    global: &Global,
    candidate: &Candidate,
    lock: &dyn Lease,
    line: &mut CandidateReport,
) {
    let domain = &candidate.domain;
    let holder = lock.holder();
    match app::remove(&global.abra_home, domain) {
        Ok(gone) => line.removed.env_files = gone.env_files,
        Err(err) => {
            line.error = Some(err.to_string());
            return;
        }
    }
    match lock.remove() {
        Ok(unlinked) => line.removed.lock_file = unlinked,
        Err(err) => line.error = Some(err.to_string()),
    }
    if line.removed.nothing_but_lock_file() {
        // Everything was already gone: another janitor reaped it between our look and our lock.
        line.decision = Decision::Raced;
        return;
    }
    report::line(&format!("== janitor: reaped orphaned app {domain} =="));
    if let Some(holder) = holder {
        mark_run_reaped(global, &holder, domain);
    }
}

/// How long the Docker side of a reap may take by default, confirmation included.
pub(crate) const DEFAULT_REAP_BUDGET: Duration = Duration::from_secs(120);

/// How long killing the processes of dead runs may take in one sweep.
const DEAD_RUN_KILL_BUDGET: Duration = Duration::from_secs(10);

/// Kill (unless `dry_run`) every process of a dead run or `lock` command: their cgroups first,
/// then whatever the environment scan finds. Failures go to `errors`.
pub(crate) fn reap_dead_runs_processes(
    errors: &mut Vec<String>,
    dry_run: bool,
) -> (Vec<cgroup::Orphan>, Vec<leftovers::Leftover>) {
    let orphans = reap_dead_runs_cgroups(errors, dry_run, false);
    (orphans, reap_leftovers(dry_run))
}

/// Kill (unless `dry_run`) the processes of dead runs and `lock` commands in their cgroups,
/// everywhere in the hierarchy or only beside our own (`nearby`).
pub(crate) fn reap_dead_runs_cgroups(
    errors: &mut Vec<String>,
    dry_run: bool,
    nearby: bool,
) -> Vec<cgroup::Orphan> {
    let orphans = cgroup::reap_orphans(dry_run, nearby, DEAD_RUN_KILL_BUDGET);
    for orphan in &orphans {
        match &orphan.error {
            Some(err) => errors.push(err.clone()),
            None if !dry_run && orphan.processes > 0 => report::line(&format!(
                "== janitor: killed {} process(es) of a dead run in {} ==",
                orphan.processes,
                orphan.path.display()
            )),
            None => {}
        }
    }
    orphans
}

/// Kill (unless `dry_run`) the processes of dead supervisors found by their environment.
pub(crate) fn reap_leftovers(dry_run: bool) -> Vec<leftovers::Leftover> {
    let found = leftovers::reap(dry_run);
    if !found.is_empty() && !dry_run {
        report::line(&format!(
            "== janitor: killed {} leftover process(es) of dead runs ==",
            found.len()
        ));
    }
    found
}

/// Note in the dead run's `run.json` that its app was reaped — only if that record is really
/// the holder's (same pid and domain) and no run with that id is live now.
fn mark_run_reaped(global: &Global, holder: &Holder, domain: &AppDomain) {
    let Ok(run_id) = RunId::parse(&holder.run_id) else {
        return;
    };
    let dir = global.runs_dir.join(run_id.as_str());
    // Holding the run's guard keeps a new run with the same id from writing meanwhile.
    let Liveness::Free { guard: _guard, .. } = rundir::probe(&dir, false) else {
        return;
    };
    let path = dir.join(crate::names::RUN_RECORD_FILE);
    let Ok(mut record) = RunRecord::read(&path) else {
        return;
    };
    if record.pid != holder.pid || record.domain != domain.as_str() || record.reaped.is_some() {
        return;
    }
    record.reaped = Some(record::timestamp(SystemTime::now()));
    if let Err(err) = record.write(&path) {
        tracing::warn!(path = %path.display(), "failed to mark run record reaped: {err}");
    }
}
