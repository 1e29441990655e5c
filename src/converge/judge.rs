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
mod tests {
    use super::*;
    use crate::config::DEFAULT_STABLE;
    use rstest::rstest;

    fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1000)
    }

    fn service(mode: Mode, update: Option<UpdateState>) -> Service {
        Service {
            id: "s1".into(),
            name: "st_app".into(),
            mode,
            update,
            update_message: "update paused due to failure".into(),
            spec_since: Some(SystemTime::UNIX_EPOCH + Duration::from_secs(100)),
            constraints: Vec::new(),
            job_iteration: 0,
            labels: Default::default(),
        }
    }

    fn task(slot: u64, desired_live: bool, phase: TaskPhase) -> Task {
        Task {
            id: format!("t{slot}{phase:?}"),
            service_id: "s1".into(),
            slot: Some(slot),
            node_id: "n1".into(),
            desired_live,
            phase,
            err: String::new(),
            exit_code: None,
            at: Some(SystemTime::UNIX_EPOCH + Duration::from_secs(200)),
            job_iteration: 0,
        }
    }

    fn node(id: &str, role: &str) -> Node {
        Node {
            id: id.into(),
            hostname: format!("host-{id}"),
            role: role.into(),
            ready: true,
            active: true,
            ..Node::default()
        }
    }

    const R2: Mode = Mode::Replicated { replicas: 2 };
    use TaskPhase::{Complete, Failed, Gone, Pending, Running};

    #[rstest]
    #[case::all_running(R2, None, vec![(1, true, Running), (2, true, Running)], "converged")]
    #[case::one_starting(R2, None, vec![(1, true, Running), (2, true, Pending)], "1/2 running")]
    // N/N running in the middle of a stop-first update: not converged.
    #[case::n_of_n_mid_update(R2, Some(UpdateState::Updating), vec![(1, true, Running), (2, true, Running)], "2/2 running; update updating")]
    #[case::n_of_n_mid_rollback(R2, Some(UpdateState::RollbackStarted), vec![(1, true, Running), (2, true, Running)], "2/2 running; update rollback_started")]
    #[case::update_done(R2, Some(UpdateState::Completed), vec![(1, true, Running), (2, true, Running)], "converged")]
    // A task still running but already told to stop does not count (`docker service ls` counts it).
    #[case::stopping_task_not_counted(R2, None, vec![(1, true, Running), (2, false, Running)], "1/2 running")]
    #[case::extra_task_still_there(R2, None, vec![(1, true, Running), (2, true, Running), (3, true, Running)], "3/2 running")]
    #[case::paused_is_settled(R2, Some(UpdateState::Paused), vec![(1, true, Pending), (2, false, Failed)], "paused")]
    #[case::rollback_paused_is_settled(R2, Some(UpdateState::RollbackPaused), vec![], "paused")]
    #[case::rolled_back(R2, Some(UpdateState::RollbackCompleted), vec![(1, true, Running), (2, true, Running)], "rolled back")]
    #[case::rolled_back_not_yet_running(R2, Some(UpdateState::RollbackCompleted), vec![(1, true, Running)], "1/2 running")]
    #[case::zero_replicas(Mode::Replicated { replicas: 0 }, None, vec![(1, false, Gone)], "converged")]
    #[case::job_done(Mode::ReplicatedJob { completions: 2 }, None, vec![(1, true, Complete), (2, true, Complete)], "converged")]
    #[case::job_running(Mode::ReplicatedJob { completions: 2 }, None, vec![(1, true, Complete), (2, true, Running)], "1/2 completed")]
    fn services_are_judged(
        #[case] mode: Mode,
        #[case] update: Option<UpdateState>,
        #[case] tasks: Vec<(u64, bool, TaskPhase)>,
        #[case] want: &str,
    ) {
        let state = StackState {
            services: vec![service(mode, update)],
            tasks: tasks
                .into_iter()
                .map(|(slot, live, phase)| task(slot, live, phase))
                .collect(),
            nodes: None,
        };
        let report = &judge(&state, now(), DEFAULT_STABLE)[0];
        let got = match &report.standing {
            Standing::Converged => "converged".to_owned(),
            Standing::Waiting(why) => why.clone(),
            Standing::Paused => "paused".to_owned(),
            Standing::RolledBack => "rolled back".to_owned(),
        };
        assert_eq!(got, want);
    }

    #[test]
    fn a_job_counts_only_its_current_iteration() {
        let mut s = service(Mode::ReplicatedJob { completions: 1 }, None);
        s.job_iteration = 7;
        let old = task(1, true, Complete);
        let state = StackState {
            services: vec![s],
            tasks: vec![old.clone()],
            nodes: None,
        };
        assert_eq!(judge(&state, now(), DEFAULT_STABLE)[0].running, 0);
        let mut new = old;
        new.job_iteration = 7;
        let state = StackState {
            tasks: vec![new],
            ..state
        };
        assert_eq!(
            judge(&state, now(), DEFAULT_STABLE)[0].standing,
            Standing::Converged
        );
    }

    #[test]
    fn global_services_need_a_running_task_on_every_eligible_node() {
        let mut s = service(Mode::Global, None);
        s.constraints = vec!["node.role == manager".into()];
        let mut drained = node("n3", "manager");
        drained.active = false;
        let nodes = vec![node("n1", "manager"), node("n2", "worker"), drained];
        let on = |n: &str, phase| Task {
            node_id: n.into(),
            slot: None,
            ..task(0, true, phase)
        };
        let state = StackState {
            services: vec![s],
            tasks: vec![on("n2", Running)],
            nodes: Some(nodes),
        };
        let r = &judge(&state, now(), DEFAULT_STABLE)[0];
        assert_eq!((r.running, r.desired), (0, 1));
        let state = StackState {
            tasks: vec![on("n1", Running)],
            ..state
        };
        assert_eq!(
            judge(&state, now(), DEFAULT_STABLE)[0].standing,
            Standing::Converged
        );
    }

    #[rstest]
    #[case("node.role==manager", true)]
    #[case("node.role == Manager", true)]
    #[case("node.role != manager", false)]
    #[case("node.hostname==host-n1", true)]
    #[case("node.id!=n2", true)]
    #[case("node.labels.Zone==eu", true)]
    #[case("node.labels.zone==eu", false)]
    #[case("node.labels.missing!=x", true)]
    #[case("engine.labels.disk==ssd", true)]
    #[case("node.platform.os==linux", true)]
    #[case("garbage", false)]
    #[case("node.unknown==x", false)]
    fn constraints_are_matched_as_swarm_matches_them(#[case] c: &str, #[case] want: bool) {
        let mut n = node("n1", "manager");
        n.labels.insert("Zone".into(), "eu".into());
        n.engine_labels.insert("disk".into(), "ssd".into());
        n.os = "linux".into();
        assert_eq!(placeable(&n, &[c.to_owned()]), want, "{c}");
    }

    #[test]
    fn failed_tasks_of_the_current_spec_are_named_newest_first() {
        let mut before = task(1, false, Failed);
        before.at = Some(SystemTime::UNIX_EPOCH + Duration::from_secs(50));
        before.err = "old".into();
        let mut a = task(1, false, Failed);
        a.err = "task: non-zero exit (1)".into();
        a.id = "a".into();
        let mut b = task(1, false, Failed);
        b.at = Some(SystemTime::UNIX_EPOCH + Duration::from_secs(300));
        b.exit_code = Some(3);
        b.id = "b".into();
        let state = StackState {
            services: vec![service(R2, None)],
            tasks: vec![before, a, b, task(2, true, Pending)],
            nodes: None,
        };
        let r = &judge(&state, now(), DEFAULT_STABLE)[0];
        assert_eq!(r.errors, vec!["task st_app.1 failed: exit 3".to_owned()]);
        assert_eq!(
            describe(std::slice::from_ref(r), "st"),
            "app 0/2 running (task app.1 failed: exit 3)"
        );
    }

    /// A crash-looping task is running for a moment each restart: after a failure of the
    /// current spec, a running task counts only once it has stayed up long enough.
    #[rstest]
    #[case::just_restarted(2, "0/1 running (1 more up 2.0s < 5s after a failure)")]
    #[case::stayed_up(6, "converged")]
    fn after_a_failure_a_running_task_must_stay_up(#[case] up_for: u64, #[case] want: &str) {
        let mut failed = task(1, false, Failed);
        failed.err = "task: non-zero exit (3)".into();
        let mut restarted = task(1, true, Running);
        restarted.at = Some(now() - Duration::from_secs(up_for));
        let state = StackState {
            services: vec![service(Mode::Replicated { replicas: 1 }, None)],
            tasks: vec![failed, restarted],
            nodes: None,
        };
        let r = &judge(&state, now(), DEFAULT_STABLE)[0];
        match &r.standing {
            Standing::Converged => assert_eq!(want, "converged"),
            Standing::Waiting(why) => assert_eq!(why, want),
            other => panic!("{other:?}"),
        }
    }

    /// A task's first start is `running` for a moment too, before any failure exists: every
    /// running task counts only once it has been up for the stable window; a window of zero
    /// counts it at once.
    #[rstest]
    #[case::just_started(300, DEFAULT_STABLE, "0/1 running (1 more up 0.3s < 1s)")]
    #[case::up_the_window(1000, DEFAULT_STABLE, "converged")]
    #[case::up_longer(1700, DEFAULT_STABLE, "converged")]
    #[case::zero_window_counts_at_once(0, Duration::ZERO, "converged")]
    #[case::longer_window(1700, Duration::from_secs(3), "0/1 running (1 more up 1.7s < 3s)")]
    fn a_running_task_must_stay_up_for_the_stable_window(
        #[case] up_ms: u64,
        #[case] stable: Duration,
        #[case] want: &str,
    ) {
        let mut started = task(1, true, Running);
        started.at = Some(now() - Duration::from_millis(up_ms));
        let state = StackState {
            services: vec![service(Mode::Replicated { replicas: 1 }, None)],
            tasks: vec![started],
            nodes: None,
        };
        let r = &judge(&state, now(), stable)[0];
        match &r.standing {
            Standing::Converged => assert_eq!(want, "converged"),
            Standing::Waiting(why) => assert_eq!(why, want),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_timestamp_ahead_of_this_host_is_up_for_nothing_yet() {
        let mut ahead = task(1, true, Running);
        ahead.at = Some(now() + Duration::from_secs(2));
        let state = StackState {
            services: vec![service(Mode::Replicated { replicas: 1 }, None)],
            tasks: vec![ahead],
            nodes: None,
        };
        let r = &judge(&state, now(), DEFAULT_STABLE)[0];
        assert_eq!(
            r.standing,
            Standing::Waiting("0/1 running (1 more up 0.0s < 1s)".into())
        );
    }

    #[rstest]
    #[case(&[], false, Outcome::NoStack)]
    #[case(&[Standing::Converged], false, Outcome::Converged)]
    #[case(&[Standing::Converged, Standing::Waiting("x".into())], false, Outcome::Waiting)]
    #[case(&[Standing::Paused, Standing::Waiting("x".into())], true, Outcome::Waiting)]
    #[case(&[Standing::Paused, Standing::Converged], false, Outcome::Paused)]
    #[case(&[Standing::Paused, Standing::Converged], true, Outcome::Converged)]
    #[case(&[Standing::RolledBack, Standing::Paused], true, Outcome::Failed)]
    fn the_stack_outcome(
        #[case] standings: &[Standing],
        #[case] allow_paused: bool,
        #[case] want: Outcome,
    ) {
        let reports: Vec<ServiceReport> = standings
            .iter()
            .map(|s| ServiceReport {
                name: "x".into(),
                mode: "replicated",
                running: 0,
                desired: 0,
                update_state: None,
                errors: Vec::new(),
                standing: s.clone(),
                update_message: String::new(),
                failures: Vec::new(),
            })
            .collect();
        assert_eq!(outcome(&reports, allow_paused), want);
    }
}
