//! The unit tests of `docker/nodes.rs`.

use super::*;
use crate::docker::node_job::{Cause, ForGood, JobTask, SCRIPT, job_spec, reason};
use bollard::models::{MountType, TaskSpecRestartPolicyConditionEnum};

#[test]
fn the_sweep_runs_once_on_every_node_with_the_node_socket_and_no_stack_label() {
    let settings = NodeSweepSettings {
        image: "docker:27-cli".to_owned(),
        socket: "/run/docker.sock".into(),
    };
    let spec = job_spec(
        &settings,
        &["ab-000000_x_test", "cd-000000_x_test"],
        &["ab-000000_x_test_db".to_owned()],
        1_700_000_000,
    );
    assert!(
        spec.name
            .as_deref()
            .unwrap()
            .starts_with("ccci-run-node-sweep-")
    );
    let mode = spec.mode.unwrap();
    assert!(mode.global.is_some() && mode.replicated.is_none() && mode.global_job.is_none());
    let policy = spec
        .task_template
        .as_ref()
        .unwrap()
        .restart_policy
        .clone()
        .unwrap();
    assert_eq!(
        policy.condition,
        Some(TaskSpecRestartPolicyConditionEnum::NONE)
    );
    let labels = spec.labels.unwrap();
    assert_eq!(
        labels.get(SWEEP_LABEL).map(String::as_str),
        Some("1700000000")
    );
    assert!(!labels.contains_key(STACK_LABEL));
    let container = spec.task_template.unwrap().container_spec.unwrap();
    assert!(!container.labels.unwrap().contains_key(STACK_LABEL));
    assert_eq!(container.image.as_deref(), Some("docker:27-cli"));
    let env = container.env.unwrap();
    assert!(env.contains(&"CCCI_STACKS=ab-000000_x_test cd-000000_x_test".to_owned()));
    assert!(env.contains(&"CCCI_VOLUMES=ab-000000_x_test_db".to_owned()));
    let mount = &container.mounts.unwrap()[0];
    assert_eq!(mount.source.as_deref(), Some("/run/docker.sock"));
    assert_eq!(mount.target.as_deref(), Some("/var/run/docker.sock"));
    assert_eq!(mount.typ, Some(MountType::BIND));
}

fn node(ready: bool, active: bool) -> Node {
    Node {
        id: "n2".to_owned(),
        hostname: "worker-2".to_owned(),
        ready,
        active,
        ..Node::default()
    }
}

#[test]
fn a_node_not_confirmed_says_why() {
    let assigned = JobTask {
        state: Some(ApiTaskState::ASSIGNED),
        ..JobTask::default()
    };
    let rejected = JobTask {
        state: Some(ApiTaskState::REJECTED),
        err: "No such image: x".to_owned(),
        ..JobTask::default()
    };
    let s = &NodeSweepSettings::default();
    assert_eq!(
        reason(None, None, false, s),
        "no longer a node of the swarm"
    );
    assert!(reason(Some(&node(false, true)), None, false, s).starts_with("the node is down"));
    assert!(reason(Some(&node(true, false)), None, false, s).starts_with("the node is drained"));
    assert_eq!(
        reason(Some(&node(true, true)), Some(&assigned), true, s),
        "the manager still lists a task of the stack there as not stopped; its node sweep \
         task is assigned"
    );
    assert_eq!(
        reason(Some(&node(true, true)), Some(&rejected), false, s),
        "its node sweep task is rejected: No such image: x"
    );
    let denied = JobTask {
        state: Some(ApiTaskState::FAILED),
        for_good: Some(ForGood::Exit(Cause::Denied)),
        ..JobTask::default()
    };
    let why = reason(Some(&node(true, true)), Some(&denied), false, s);
    assert!(
        why.contains("may not open") && why.contains("node_docker_socket"),
        "{why}"
    );
}

/// The script against a stand-in `docker` on its PATH: each way of not reaching its own
/// node's engine, or of a listing failing, is its own exit code, never "clean".
#[rstest::rstest]
#[case::no_cli(None, 3)]
#[case::no_engine(Some("echo 'Cannot connect to the Docker daemon' >&2; exit 1"), 4)]
#[case::denied(
    Some("echo 'permission denied while trying to connect' >&2; exit 1"),
    5
)]
#[case::other_node(Some("echo n1"), 6)]
#[case::not_a_swarm(Some("echo"), 6)]
#[case::listing_fails(Some("[ \"$1\" = info ] && { echo n2; exit 0; }; exit 1"), 7)]
#[case::clean(Some("[ \"$1\" = info ] && echo n2; exit 0"), 0)]
#[case::a_longer_stack_s_unlabelled_volume_is_not_the_stack_s(
    Some(
        "case \"$1 $2\" in info*) echo n2 ;; 'volume ls') printf '%s\\n' \
         'ab-000000_x_test_example_org_data ' 'x ab-000000_x_test_example_org' ;; esac"
    ),
    0
)]
fn the_script_fails_closed(#[case] docker: Option<&str>, #[case] code: i32) {
    let (out, _) = run_script(docker);
    assert_eq!(
        out.status.code(),
        Some(code),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An unlabelled volume is taken only by a name the app gives, exactly: the stack's given
/// `…_data` goes, `…_other` (no name it gives) and the longer stack's stay.
#[test]
fn the_script_takes_an_unlabelled_volume_only_by_a_given_name() {
    let docker = "case \"$1 $2\" in info*) echo n2 ;; \
         'volume ls') [ -f \"${0%/docker}/removed\" ] || echo 'ab-000000_x_test_data '; \
           printf '%s\\n' 'ab-000000_x_test_other ' 'ab-000000_x_test_example_org_data ' ;; \
         'volume rm') echo \"$*\" >> \"${0%/docker}/removed\" ;; esac";
    let (out, bin) = run_script(Some(docker));
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let removed = crate::files::read_text(
        &bin.path().join("removed"),
        &crate::files::Rules::small(1 << 10),
    )
    .unwrap();
    assert_eq!(removed, "volume rm ab-000000_x_test_data\n");
}

/// The node sweep's script with a stand-in `docker` whose body is `docker` (none: no CLI).
fn run_script(docker: Option<&str>) -> (std::process::Output, tempfile::TempDir) {
    use std::os::unix::fs::PermissionsExt;
    let bin = tempfile::tempdir().unwrap();
    for tool in ["sh", "date", "sleep"] {
        let found = ["/bin", "/usr/bin"]
            .iter()
            .map(|d| std::path::Path::new(d).join(tool))
            .find(|p| p.exists())
            .unwrap();
        std::os::unix::fs::symlink(found, bin.path().join(tool)).unwrap();
    }
    if let Some(body) = docker {
        let path = bin.path().join("docker");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let out = std::process::Command::new(bin.path().join("sh"))
        .args(["-c", SCRIPT])
        .env_clear()
        .env("PATH", bin.path())
        .env("CCCI_STACKS", "ab-000000_x_test")
        .env("CCCI_VOLUMES", "ab-000000_x_test_data")
        .env("CCCI_NODE", "n2")
        .env("SWEEP_LABEL", SWEEP_LABEL)
        .output()
        .unwrap();
    (out, bin)
}
