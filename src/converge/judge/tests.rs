//! The unit tests of `converge/judge.rs`.

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
