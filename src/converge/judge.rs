//! Whether a stack has converged, from one poll's plain data: no I/O, table-tested.
//!
//! A service is converged when it has what its mode asks for — replicated: as many tasks
//! running (desired running, state running, on any node) as replicas; global: one running task
//! on every eligible node; a job: its completions of the current iteration — and no update is
//! in progress. The two rules a replica count alone gets wrong: N/N running during a rolling
//! update is not converged while `UpdateStatus.State` is `updating` or `rollback_started`; and
//! `paused` / `rollback_paused` (swarm's default failure action pauses) last until somebody
//! acts, so they are settled, never waited for.
//!
//! And one a single look gets wrong: a crash-looping task is `running` for a moment every
//! time it restarts, its first start included, before any failure exists. So a running task
//! counts only once it has stayed up for the stable window (`converge_stable`, default
//! [`crate::config::DEFAULT_STABLE`]; zero counts it at once), and for at least [`STABLE_AFTER_FAILURE`] once
//! a task of the service's current spec has failed.
//!
//! How long a task has been up is `now` (this host's clock at the poll) minus the task's status
//! timestamp, which swarm stamps with the clock of the engine that reports the task. On one
//! host both are the same clock. Across hosts the two clocks differ by their skew: a worker
//! whose clock runs ahead makes a task look younger (the wait is longer by the skew, never
//! wrong), one that runs behind makes it look older (it counts early by the skew), so the
//! window means what it says only as far as the nodes' clocks agree (NTP keeps them within
//! milliseconds).

use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::docker::swarm::{Mode, Node, Service, StackState, Task, TaskPhase, UpdateState};

/// Where one service stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Standing {
    Converged,
    /// Still moving; why, in words (`1/2 running; update updating`).
    Waiting(String),
    /// An update or rollback paused: it stays so until somebody acts.
    Paused,
    /// The update failed and was rolled back: the stack runs the previous spec.
    RolledBack,
}

/// One service, as the report shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct ServiceReport {
    pub name: String,
    pub mode: &'static str,
    /// Tasks running (a job: completed) that count towards `desired`.
    pub running: u64,
    pub desired: u64,
    pub update_state: Option<UpdateState>,
    /// Failed or rejected tasks of the current spec, newest first.
    pub errors: Vec<String>,
    #[serde(skip)]
    pub standing: Standing,
    #[serde(skip)]
    pub update_message: String,
    /// The failed tasks behind `errors`: (task id, line).
    #[serde(skip)]
    pub failures: Vec<(String, String)>,
}

/// How the stack stands as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Converged,
    Waiting,
    /// Every service settled, some paused (and pausing is not allowed).
    Paused,
    /// Every service settled, some rolled back.
    Failed,
    /// The stack has no services.
    NoStack,
}

/// How long a task must have been running to count, once a task of the same spec has failed.
pub(crate) const STABLE_AFTER_FAILURE: Duration = Duration::from_secs(5);

/// How many failed tasks a service's report names.
const ERRORS_SHOWN: usize = 3;

/// Judge every service of one poll, seen at `now`: a running task counts once it has been up
/// for `stable` (for at least [`STABLE_AFTER_FAILURE`] after a failure).
pub(crate) fn judge(state: &StackState, now: SystemTime, stable: Duration) -> Vec<ServiceReport> {
    let mut reports: Vec<ServiceReport> = state
        .services
        .iter()
        .map(|service| judge_service(service, state, now, stable))
        .collect();
    reports.sort_by(|a, b| a.name.cmp(&b.name));
    reports
}

/// The stack's outcome from its services' reports.
pub(crate) fn outcome(reports: &[ServiceReport], allow_paused: bool) -> Outcome {
    if reports.is_empty() {
        return Outcome::NoStack;
    }
    let any = |f: fn(&Standing) -> bool| reports.iter().any(|r| f(&r.standing));
    if any(|s| matches!(s, Standing::Waiting(_))) {
        Outcome::Waiting
    } else if any(|s| *s == Standing::RolledBack) {
        Outcome::Failed
    } else if any(|s| *s == Standing::Paused) && !allow_paused {
        Outcome::Paused
    } else {
        Outcome::Converged
    }
}

fn judge_service(
    service: &Service,
    state: &StackState,
    now: SystemTime,
    stable: Duration,
) -> ServiceReport {
    let tasks: Vec<&Task> = state
        .tasks
        .iter()
        .filter(|t| t.service_id == service.id)
        .collect();
    let failures = failed_tasks(service, &tasks);
    let window = if failures.is_empty() {
        stable
    } else {
        stable.max(STABLE_AFTER_FAILURE)
    };
    // Up for how long, by the task's own status timestamp; a timestamp ahead of `now` (clock
    // skew) is up for nothing yet, a missing one (never seen from swarm) for no known time.
    let up_for = |t: &Task| t.at.map(|at| now.duration_since(at).unwrap_or_default());
    let stable = |t: &Task| window.is_zero() || up_for(t).is_some_and(|up| up >= window);
    let nodes = state.nodes.as_deref().unwrap_or_default();
    let eligible = || {
        nodes
            .iter()
            .filter(|n| n.ready && n.active && placeable(n, &service.constraints))
    };
    let up = |t: &&&Task| t.desired_live && t.phase == TaskPhase::Running;
    let running = |t: &&&Task| up(t) && stable(t);
    let completed =
        |t: &&&Task| t.phase == TaskPhase::Complete && t.job_iteration == service.job_iteration;
    let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    let (done, desired) = match service.mode {
        Mode::Replicated { replicas } => (count(tasks.iter().filter(running).count()), replicas),
        Mode::ReplicatedJob { completions } => {
            (count(tasks.iter().filter(completed).count()), completions)
        }
        Mode::Global | Mode::GlobalJob => {
            let on_node = |node: &Node| {
                tasks.iter().any(|t| {
                    t.node_id == node.id
                        && if service.mode == Mode::Global {
                            running(&t)
                        } else {
                            completed(&t)
                        }
                })
            };
            (
                count(eligible().filter(|n| on_node(n)).count()),
                count(eligible().count()),
            )
        }
    };
    let verb = match service.mode {
        Mode::ReplicatedJob { .. } | Mode::GlobalJob => "completed",
        Mode::Replicated { .. } | Mode::Global => "running",
    };
    let counted = match service.mode {
        Mode::Replicated { .. } => done == desired,
        _ => done >= desired,
    };
    let standing = match service.update {
        Some(UpdateState::Paused | UpdateState::RollbackPaused) => Standing::Paused,
        Some(state @ (UpdateState::Updating | UpdateState::RollbackStarted)) => Standing::Waiting(
            format!("{done}/{desired} {verb}; update {}", state.as_str()),
        ),
        _ if !counted => {
            let young = || tasks.iter().filter(up).filter(|t| !stable(t));
            let unsteady = count(young().count());
            // The youngest of them, to say how far it is from counting.
            let least = young().filter_map(|t| up_for(t)).min().unwrap_or_default();
            Standing::Waiting(if unsteady > 0 && verb == "running" {
                format!(
                    "{done}/{desired} {verb} ({unsteady} more up {:.1}s < {}{})",
                    least.as_secs_f64(),
                    crate::duration::show(window),
                    if failures.is_empty() {
                        ""
                    } else {
                        " after a failure"
                    }
                )
            } else {
                format!("{done}/{desired} {verb}")
            })
        }
        Some(UpdateState::RollbackCompleted) => Standing::RolledBack,
        _ => Standing::Converged,
    };
    let failures = if standing == Standing::Converged {
        Vec::new()
    } else {
        failures
    };
    ServiceReport {
        name: service.name.clone(),
        mode: service.mode.name(),
        running: done,
        desired,
        update_state: service.update,
        errors: failures.iter().map(|(_, line)| line.clone()).collect(),
        standing,
        update_message: service.update_message.clone(),
        failures,
    }
}

/// The failed and rejected tasks of the service's current spec (none from before its last
/// update), newest first, one per slot (or node), at most [`ERRORS_SHOWN`].
fn failed_tasks(service: &Service, tasks: &[&Task]) -> Vec<(String, String)> {
    let since = service.spec_since.unwrap_or(SystemTime::UNIX_EPOCH);
    let mut failed: Vec<&&Task> = tasks
        .iter()
        .filter(|t| matches!(t.phase, TaskPhase::Failed | TaskPhase::Rejected))
        .filter(|t| t.at.is_none_or(|at| at >= since))
        .collect();
    failed.sort_by_key(|t| std::cmp::Reverse(t.at));
    let mut seen: Vec<String> = Vec::new();
    let mut out = Vec::new();
    for t in failed {
        let name = task_name(&service.name, t);
        if seen.contains(&name) {
            continue;
        }
        seen.push(name.clone());
        let what = if t.phase == TaskPhase::Rejected {
            "rejected"
        } else {
            "failed"
        };
        let why = match (t.err.is_empty(), t.exit_code) {
            (false, _) => t.err.clone(),
            (true, Some(code)) => format!("exit {code}"),
            (true, None) => "no reason given".to_owned(),
        };
        out.push((t.id.clone(), format!("task {name} {what}: {why}")));
        if out.len() == ERRORS_SHOWN {
            break;
        }
    }
    out
}

/// Swarm's own name of a task: `<service>.<slot>`, or `<service>.<node id>` for one per node.
fn task_name(service: &str, task: &Task) -> String {
    match task.slot {
        Some(slot) if slot > 0 => format!("{service}.{slot}"),
        _ => format!("{service}.{}", task.node_id),
    }
}

/// Whether `node` meets every placement constraint (`key==value`, `key!=value`), compared
/// as swarm compares them: keys and values without regard to case.
pub(crate) fn placeable(node: &Node, constraints: &[String]) -> bool {
    constraints.iter().all(|c| meets(node, c))
}

const NODE_LABELS: &str = "node.labels.";
const ENGINE_LABELS: &str = "engine.labels.";

fn meets(node: &Node, constraint: &str) -> bool {
    let (key, want, equal) = if let Some((k, v)) = constraint.split_once("!=") {
        (k, v, false)
    } else if let Some((k, v)) = constraint.split_once("==") {
        (k, v, true)
    } else {
        return false;
    };
    // Keys without regard to case; label names as written.
    let key = key.trim();
    let lower = key.to_ascii_lowercase();
    let have = match lower.as_str() {
        "node.id" => Some(&node.id),
        "node.hostname" => Some(&node.hostname),
        "node.role" => Some(&node.role),
        "node.platform.os" => Some(&node.os),
        "node.platform.arch" => Some(&node.arch),
        _ if lower.starts_with(NODE_LABELS) => node.labels.get(&key[NODE_LABELS.len()..]),
        _ if lower.starts_with(ENGINE_LABELS) => {
            node.engine_labels.get(&key[ENGINE_LABELS.len()..])
        }
        _ => return false,
    };
    let matched = have.is_some_and(|have| have.eq_ignore_ascii_case(want.trim()));
    matched == equal
}

/// One line of what is not converged: `app 1/2 running; update updating`, services by their
/// name within the stack, failed tasks with their error.
pub(crate) fn describe(reports: &[ServiceReport], stack: &str) -> String {
    let short = |name: &str| {
        name.strip_prefix(stack)
            .and_then(|n| n.strip_prefix('_'))
            .unwrap_or(name)
            .to_owned()
    };
    reports
        .iter()
        .filter_map(|r| {
            let what = match &r.standing {
                Standing::Converged => return None,
                Standing::Waiting(why) => why.clone(),
                Standing::Paused => format!(
                    "update {}: {}",
                    r.update_state.map_or("paused", UpdateState::as_str),
                    r.update_message
                ),
                Standing::RolledBack => format!("update rolled back: {}", r.update_message),
            };
            let mut line = format!("{} {what}", short(&r.name));
            if let Some(first) = r.errors.first() {
                line.push_str(&format!(
                    " ({})",
                    first.replacen(&r.name, &short(&r.name), 1)
                ));
            }
            Some(line)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests;
