//! Reaping what dead runs of this configuration left: their processes (cgroups first, then the
//! environment scan; a leftover whose supervisor cannot be judged is left alone and reported), and,
//! once an app's Docker resources are confirmed gone, its `.env`, its lock file (still held)
//! and a note in the dead run's record.

use std::collections::HashSet;
use std::time::{Instant, SystemTime};

use crate::app;
use crate::config::Global;
use crate::janitor::candidate::Candidate;
use crate::janitor::decide::{self, Decision, LeftoverDecision};
use crate::janitor::sweep_report::{CandidateReport, DeadCgroup, LeftoverProcess};
use crate::lock::Holder;
use crate::lock::backend::Lease;
use crate::names::{AppDomain, RunId};
use crate::report;
use crate::rundir::record::RunRecord;
use crate::rundir::{self, Liveness};
use crate::supervise::identity::{Judge, Scope};
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
    // Confirmed gone on every node: no sweep need come back for it.
    app::clear_unreaped(global, domain);
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
    // A recorded reap finished here is this sweep's work, even when what went was only on
    // another node (a node sweep's removals are not in `removed`).
    let recorded = candidate
        .sources
        .contains(&crate::janitor::sweep_report::Source::Unreaped);
    if line.removed.nothing_but_lock_file() && line.removed.docker.nodes.is_empty() && !recorded {
        // Everything was already gone: another janitor reaped it between our look and our lock.
        line.decision = Decision::Raced;
        return;
    }
    report::line(&format!("== janitor: reaped orphaned app {domain} =="));
    if let Some(holder) = holder {
        mark_run_reaped(global, &holder, domain);
    }
}

/// How many scans for marked processes a sweep makes (a leftover may fork while it is killed).
const LEFTOVER_ROUNDS: usize = 20;

/// Kill (unless `dry_run`) every process of a dead run or `lock` command of the configuration
/// `scope`: their cgroups first, then whatever the environment scan finds. Failures go to
/// `errors`.
pub(crate) fn reap_dead_runs_processes(
    scope: Scope,
    errors: &mut Vec<String>,
    dry_run: bool,
) -> (Vec<DeadCgroup>, Vec<LeftoverProcess>) {
    let cgroups = reap_dead_runs_cgroups(scope, errors, dry_run, false);
    (cgroups, reap_leftovers(scope, errors, dry_run))
}

/// Kill (unless `dry_run`) the processes of dead runs and `lock` commands of the configuration
/// `scope` in their cgroups, everywhere in the hierarchy or only beside our own (`nearby`).
/// A cgroup whose supervisor cannot be judged is left alone and reported.
pub(crate) fn reap_dead_runs_cgroups(
    scope: Scope,
    errors: &mut Vec<String>,
    dry_run: bool,
    nearby: bool,
) -> Vec<DeadCgroup> {
    let (found, ownerless) = cgroup::find(scope, nearby);
    // After the cgroups were listed: each supervisor started before the look at it.
    let judge = Judge::new();
    let until = Instant::now() + leftovers::KILL_BUDGET;
    for path in ownerless {
        // Not ours to judge, and not necessarily dead (an older ccci-run may be running it).
        tracing::info!(
            cgroup = %path.display(),
            "left alone: its name carries no owner (an older ccci-run made it)"
        );
    }
    let mut reported = Vec::new();
    for found in found {
        let mut line = DeadCgroup {
            path: found.path.clone(),
            supervisor: found.owner.to_string(),
            processes: cgroup::population(&found.path),
            removed: false,
            error: None,
            unresolvable: None,
        };
        match decide::leftover(&judge.judge(&found.owner.process), dry_run) {
            LeftoverDecision::Spare => continue,
            LeftoverDecision::WouldKill => {}
            LeftoverDecision::Unresolvable(why) => {
                tracing::info!(cgroup = %found.path.display(), "left alone: {why}");
                line.unresolvable = Some(why);
            }
            LeftoverDecision::Kill => {
                let left = until.saturating_duration_since(Instant::now());
                match cgroup::reap_dead(&found.path, left) {
                    Ok(()) => {
                        line.removed = true;
                        if line.processes > 0 {
                            report::line(&format!(
                                "== janitor: killed {} process(es) of a dead run in {} ==",
                                line.processes,
                                found.path.display()
                            ));
                        }
                    }
                    Err(err) => {
                        errors.push(err.to_string());
                        line.error = Some(err.to_string());
                    }
                }
            }
        }
        reported.push(line);
    }
    reported
}

/// `found` without the processes a dry run already lists in a dead run's cgroup it would kill:
/// a real sweep kills the cgroup first, so its environment scan never meets them again; one
/// process is listed once.
pub(crate) fn not_in_cgroups(
    found: Vec<LeftoverProcess>,
    cgroups: &[DeadCgroup],
) -> Vec<LeftoverProcess> {
    let listed: HashSet<i32> = cgroups
        .iter()
        .filter(|c| c.unresolvable.is_none())
        .flat_map(|c| cgroup::member_pids(&c.path))
        .collect();
    found
        .into_iter()
        .filter(|p| !listed.contains(&p.pid))
        .collect()
}

/// Kill (unless `dry_run`) the processes of dead supervisors of the configuration `scope`
/// found by their environment, and wait until they are gone. A process whose supervisor
/// cannot be judged is left alone and reported.
pub(crate) fn reap_leftovers(
    scope: Scope,
    errors: &mut Vec<String>,
    dry_run: bool,
) -> Vec<LeftoverProcess> {
    let until = Instant::now() + leftovers::KILL_BUDGET;
    let mut reported: Vec<LeftoverProcess> = Vec::new();
    let mut seen = HashSet::new();
    let mut killed = 0;
    for _ in 0..LEFTOVER_ROUNDS {
        let found = leftovers::scan(scope);
        // Judged after the scan: each supervisor started before the look at its process.
        let verdicts = leftovers::judge_all(&found);
        let mut doomed = Vec::new();
        for (process, verdict) in found.iter().zip(verdicts) {
            let unresolvable = match decide::leftover(&verdict, dry_run) {
                LeftoverDecision::Spare => continue,
                LeftoverDecision::Kill => {
                    doomed.push(process);
                    None
                }
                LeftoverDecision::WouldKill => None,
                LeftoverDecision::Unresolvable(why) => Some(why),
            };
            if seen.insert(process.pid) {
                reported.push(LeftoverProcess {
                    pid: process.pid,
                    supervisor: process.owner.process.pid,
                    marker: process.owner.to_string(),
                    unresolvable,
                });
            }
        }
        if doomed.is_empty() {
            break;
        }
        killed += doomed.len();
        let running = leftovers::kill_and_wait(&doomed, until);
        if !running.is_empty() {
            errors.push(format!(
                "leftover processes {running:?} of dead runs still run after SIGKILL"
            ));
            break;
        }
    }
    if killed > 0 {
        report::line(&format!(
            "== janitor: killed {killed} leftover process(es) of dead runs =="
        ));
    }
    reported
}

/// Note in each dead run's `run.json` whose cgroup a sweep emptied and removed what it killed
/// (perhaps nothing: the fence often ends a dead supervisor's command first) and when — only in
/// the record of the very run whose cgroup it was (its supervisor's marker), unfinished.
pub(super) fn mark_runs_swept(global: &Global, cgroups: &[DeadCgroup]) {
    for found in cgroups.iter().filter(|c| c.removed) {
        let run_id = found
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(crate::names::run_of_cgroup);
        let Some(Ok(run_id)) = run_id.map(RunId::parse) else {
            continue;
        };
        note_in_record(global, &run_id, "swept", |record| {
            let ours = record.exit_code.is_none()
                && record.swept.is_none()
                && record.marker.as_deref() == Some(found.supervisor.as_str());
            if ours {
                record.swept = Some(crate::rundir::record::Swept {
                    at: crate::duration::timestamp(SystemTime::now()),
                    killed: found.processes,
                });
            }
            ours
        });
    }
}

/// Note in the dead run's `run.json` that its app was reaped — only if that record is really
/// the holder's (same pid and domain).
fn mark_run_reaped(global: &Global, holder: &Holder, domain: &AppDomain) {
    let Ok(run_id) = RunId::parse(&holder.run_id) else {
        return;
    };
    note_in_record(global, &run_id, "reaped", |record| {
        let ours =
            record.pid == holder.pid && record.domain == domain.as_str() && record.reaped.is_none();
        if ours {
            record.reaped = Some(crate::duration::timestamp(SystemTime::now()));
        }
        ours
    });
}

/// Write into the record of run `run_id` what `note` sets, when `note` finds it the record it
/// means, holding the run's guard: no run with that id is live meanwhile, and no new one writes
/// its record under ours.
fn note_in_record(
    global: &Global,
    run_id: &RunId,
    what: &str,
    note: impl FnOnce(&mut RunRecord) -> bool,
) {
    let dir = global.runs_dir.join(run_id.as_str());
    let Liveness::Free { guard: _guard, .. } = rundir::probe(&dir, false) else {
        return;
    };
    let path = dir.join(crate::names::RUN_RECORD_FILE);
    let Ok(mut record) = RunRecord::read(&path) else {
        return;
    };
    if note(&mut record) {
        if let Err(err) = record.write_keeping_mode(&path) {
            tracing::warn!(path = %path.display(), "failed to mark run record {what}: {err}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leftover(pid: i32) -> LeftoverProcess {
        LeftoverProcess {
            pid,
            supervisor: 1,
            marker: "1-2-3-c1.2".to_owned(),
            unresolvable: None,
        }
    }

    /// A dry run lists a process of a dead run's cgroup with the cgroup it would kill, never a
    /// second time as a leftover found by its environment; one in a cgroup left alone (its
    /// supervisor not judged) is still listed.
    #[test]
    fn a_process_in_a_dead_cgroup_is_listed_once() {
        let dir = tempfile::tempdir().unwrap();
        let (doomed, spared) = (dir.path().join("doomed"), dir.path().join("spared"));
        for (cgroup, pids) in [(&doomed, "11\n12\n"), (&spared, "21\n")] {
            std::fs::create_dir_all(cgroup.join("child")).unwrap();
            std::fs::write(cgroup.join("cgroup.procs"), pids).unwrap();
            std::fs::write(cgroup.join("child/cgroup.procs"), "13\n").unwrap();
        }
        let cgroup = |path: &std::path::Path, unresolvable: Option<&str>| DeadCgroup {
            path: path.to_owned(),
            supervisor: "1-2-3-c1.2".to_owned(),
            processes: 3,
            removed: false,
            error: None,
            unresolvable: unresolvable.map(str::to_owned),
        };
        let cgroups = [
            cgroup(&doomed, None),
            cgroup(&spared, Some("another pid namespace")),
        ];
        let found = [11, 13, 21, 99].map(leftover).to_vec();
        let listed: Vec<i32> = not_in_cgroups(found, &cgroups)
            .iter()
            .map(|p| p.pid)
            .collect();
        assert_eq!(listed, [21, 99]);
    }
}
