//! `ccci-run doctor` against the real things it checks: configuration files with bad modes and
//! owners, lock dirs on and off tmpfs, the cgroup hierarchy, unit files with bad settings, a
//! user whose inotify instances are used up, the shared Docker engine and a real etcd cluster.
//! And the metrics files `lock --metrics-file` and the janitor write, read back by Prometheus's
//! own text parser.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::util::{BIN, Finished, Proc, Sandbox, Stream, run, signal, skip, wait_exited};

/// Every check doctor makes, whatever the host: none is ever left out.
const EVERY_CHECK: [&str; 22] = [
    "config-file",
    "settings",
    "dir lock_dir",
    "dir runs_dir",
    "dir state_dir",
    "dir abra_home",
    "lock_dir on tmpfs",
    "cgroup v2",
    "unit Delegate",
    "unit KillMode",
    "unit TimeoutStopSec",
    "unit User",
    "docker",
    "docker swarm",
    "docker api",
    "docker nodes",
    "inotify instances",
    "inotify watches",
    "step PATH ccci-run",
    "step PATH abra",
    "step PATH git",
    "step PATH setsid",
];

/// A sandbox whose four directories exist.
fn host() -> Sandbox {
    let sandbox = Sandbox::new();
    for dir in [sandbox.runs(), sandbox.abra_home(), sandbox.locks()] {
        std::fs::create_dir_all(dir).unwrap();
    }
    sandbox
}

/// `ccci-run doctor --json [args]` of `sandbox`: the report and the process.
fn doctor(sandbox: &Sandbox, args: &[&str]) -> (Value, Finished) {
    let mut cmd = sandbox.ccci();
    cmd.args(["doctor", "--json"]).args(args);
    doctor_of(cmd)
}

fn doctor_of(cmd: Command) -> (Value, Finished) {
    let done = run(cmd);
    let report: Value = serde_json::from_str(&done.out.join("\n"))
        .unwrap_or_else(|e| panic!("doctor printed no JSON ({e})\n{}", done.transcript()));
    let names: Vec<&str> = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    for name in EVERY_CHECK {
        assert!(names.contains(&name), "{name} missing: {report:#}");
    }
    assert!(names.iter().any(|n| n.starts_with("etcd")), "{report:#}");
    for c in report["checks"].as_array().unwrap() {
        let state = c["state"].as_str().unwrap();
        assert!(["ok", "warn", "fail", "skip"].contains(&state), "{c:#}");
        if state != "ok" {
            assert!(c["fix"].is_string(), "a {state} without a fix: {c:#}");
        }
    }
    let failed = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| c["state"] == "fail");
    assert_eq!(report["ok"], !failed, "{report:#}");
    done.assert_code(i32::from(failed));
    (report, done)
}

/// The check called `name`.
fn check<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name}: {report:#}"))
}

fn assert_state(report: &Value, name: &str, state: &str, needle: &str) {
    let c = check(report, name);
    assert_eq!(c["state"], state, "{name}: {report:#}");
    assert!(
        c["detail"].as_str().unwrap().contains(needle),
        "{name} does not say {needle:?}: {c:#}"
    );
}

/// A configuration file others may rewrite, or another user's, fails its check with the rule
/// config reading enforces; every other check still runs (on the settings without the file),
/// and the exit code is 1. The safe file passes.
#[test]
fn doctor_fails_a_config_file_others_may_rewrite_or_another_user_owns() {
    let sandbox = host();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.toml");
    std::fs::write(&file, "kill_grace = \"5s\"\n").unwrap();
    let file_arg = file.to_str().unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o664)).unwrap();
    let (report, _) = doctor(&sandbox, &["--config", file_arg]);
    assert_state(&report, "config-file", "fail", "mode 664");
    assert_eq!(report["ok"], false);

    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    nix::unistd::chown(&file, Some(nix::unistd::Uid::from_raw(61_030)), None).unwrap();
    let (report, _) = doctor(&sandbox, &["--config", file_arg]);
    assert_state(&report, "config-file", "fail", "owned by uid 61030");

    nix::unistd::chown(&file, Some(nix::unistd::Uid::from_raw(0)), None).unwrap();
    let (report, _) = doctor(&sandbox, &["--config", file_arg]);
    assert_state(&report, "config-file", "ok", "mode-safe");

    std::fs::write(&file, "kill_grace = \"soon\"\n").unwrap();
    let (report, _) = doctor(&sandbox, &["--config", file_arg]);
    assert_state(&report, "config-file", "fail", "kill_grace");
    // The text report: one line per check, the fix on it.
    let mut cmd = sandbox.ccci();
    cmd.args(["doctor", "--config", file_arg]);
    let done = run(cmd);
    done.assert_code(1);
    let line = done
        .out
        .iter()
        .find(|l| l.starts_with("fail  config-file"))
        .unwrap_or_else(|| panic!("{}", done.transcript()));
    assert!(line.contains("— fix: "), "{line}");
}

/// A directory others may write to without the sticky bit fails; with it, it passes; a lock
/// dir on tmpfs passes its file-system check, one elsewhere warns (nothing reaps it at boot).
#[test]
fn doctor_judges_directory_modes_and_warns_of_a_lock_dir_not_on_tmpfs() {
    let sandbox = host();
    std::fs::set_permissions(sandbox.locks(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let (report, done) = doctor(&sandbox, &[]);
    assert_state(&report, "dir lock_dir", "fail", "mode 777");
    // A failed check fails the command, said on stderr under the one prefix and in errors.
    done.assert_code(1);
    done.assert_stderr_has("ccci-run: error: doctor: ");
    done.assert_stderr_has("dir lock_dir");
    assert!(
        !report["errors"].as_array().unwrap().is_empty(),
        "{report:#}"
    );
    std::fs::set_permissions(sandbox.locks(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let (report, _) = doctor(&sandbox, &[]);
    assert_state(&report, "dir lock_dir", "ok", "mode 1777");

    let on_disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let on_tmpfs = tempfile::tempdir_in("/dev/shm").unwrap();
    let fs_type = |p: &Path| nix::sys::statfs::statfs(p).unwrap().filesystem_type();
    assert_eq!(fs_type(on_tmpfs.path()), nix::sys::statfs::TMPFS_MAGIC);
    assert_ne!(
        fs_type(on_disk.path()),
        nix::sys::statfs::TMPFS_MAGIC,
        "the target dir must be on a disk for this test"
    );
    let lock_dir = |dir: &Path| {
        let mut cmd = sandbox.ccci();
        cmd.args(["doctor", "--json", "--lock-dir"]).arg(dir);
        doctor_of(cmd).0
    };
    assert_state(
        &lock_dir(on_disk.path()),
        "lock_dir on tmpfs",
        "warn",
        "not on tmpfs",
    );
    assert_state(
        &lock_dir(on_tmpfs.path()),
        "lock_dir on tmpfs",
        "ok",
        "on tmpfs",
    );
    // A lock dir yet to be made is judged where it would be made.
    let later = lock_dir(&on_tmpfs.path().join("later"));
    assert_state(&later, "lock_dir on tmpfs", "ok", "on tmpfs");
    assert_state(&later, "lock_dir on tmpfs", "ok", "later is missing;");
    assert_state(&later, "dir lock_dir", "warn", "it is made at first use");
    // A missing one is said to be missing, not to be off tmpfs.
    let missing = lock_dir(&on_disk.path().join("later"));
    assert_state(&missing, "lock_dir on tmpfs", "warn", "later is missing;");
    let detail = check(&missing, "lock_dir on tmpfs")["detail"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        !detail.contains("later is not on tmpfs"),
        "a missing lock dir is missing: {detail}"
    );
    // One whose parent is missing is never made: what every command refuses, doctor fails.
    let never = lock_dir(&on_tmpfs.path().join("no/locks"));
    assert_state(
        &never,
        "dir lock_dir",
        "fail",
        "(--lock-dir, CCCI_APP_LOCK_DIR, lock_dir) does not exist, nor does its parent",
    );
}

/// As root, a cgroup can be made under our own, it has cgroup.kill, and doctor leaves nothing
/// behind; as a user with no delegated subtree, runs fall back, and doctor says so.
#[test]
fn doctor_makes_a_real_cgroup_and_removes_it() {
    let sandbox = host();
    let Some(test_cgroup) = crate::util::TestCgroup::create("doctor") else {
        return;
    };
    drop(test_cgroup);
    let (report, _) = doctor(&sandbox, &[]);
    assert_state(&report, "cgroup v2", "ok", "has cgroup.kill");
    let detail = check(&report, "cgroup v2")["detail"].as_str().unwrap();
    let own = detail
        .split('(')
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap();
    let left: Vec<String> = std::fs::read_dir(own)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("ccci-run-doctor-"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");

    let (report, _) = doctor(&sandbox, &["--cgroup", "off"]);
    assert_eq!(check(&report, "cgroup v2")["state"], "skip");
}

/// The step's PATH and variables are what the runner is told to pass, wherever it is told:
/// `DRONE_RUNNER_PATH` in the runner's own configuration file (named by its `ExecStart=`)
/// replaces the unit's PATH; `DRONE_RUNNER_ENVIRON` and `DRONE_RUNNER_ENVFILE` (here from an
/// `EnvironmentFile=`) pass variables to every step, and a `CCCI_*` among them is a warning.
#[test]
fn doctor_reads_the_runner_s_own_environment_for_its_step_checks() {
    let sandbox = host();
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    for program in ["abra", "git", "setsid", "ccci-run"] {
        let path = bin.join(program);
        std::fs::write(&path, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let config = dir.path().join("runner-config");
    std::fs::write(
        &config,
        format!(
            "# the runner's own file\nDRONE_RUNNER_CAPACITY=2\nDRONE_RUNNER_PATH={}\n\
             DRONE_RUNNER_ENVIRON=CCCI_CGROUP:off,LANG:C.UTF-8\n",
            bin.display()
        ),
    )
    .unwrap();
    let envfile = dir.path().join("unit-env");
    let step_vars = dir.path().join("step-vars");
    std::fs::write(&step_vars, "export FOO=\"bar\"\n").unwrap();
    std::fs::write(
        &envfile,
        format!("DRONE_RUNNER_ENVFILE={}\n", step_vars.display()),
    )
    .unwrap();
    let unit = dir.path().join("drone-runner-exec.service");
    std::fs::write(
        &unit,
        format!(
            "[Service]\nExecStart=/usr/bin/drone-runner-exec daemon {}\n\
             Environment=PATH=/nonexistent\nEnvironmentFile={}\n\
             EnvironmentFile=-/nonexistent/optional\n",
            config.display(),
            envfile.display()
        ),
    )
    .unwrap();
    let unit_arg = unit.to_str().unwrap();
    let (report, _) = doctor(&sandbox, &["--unit-file", unit_arg]);
    for program in ["abra", "git", "setsid", "ccci-run"] {
        assert_state(
            &report,
            &format!("step PATH {program}"),
            "ok",
            "DRONE_RUNNER_PATH",
        );
    }
    assert_state(
        &report,
        "step environment",
        "warn",
        "CCCI_CGROUP (by DRONE_RUNNER_ENVIRON)",
    );

    // Without the CCCI_ variable: every variable passed is named; without DRONE_RUNNER_PATH
    // the unit's PATH is the step's, where nothing is.
    std::fs::write(&config, "DRONE_RUNNER_ENVIRON=LANG:C.UTF-8\n").unwrap();
    let (report, _) = doctor(&sandbox, &["--unit-file", unit_arg]);
    assert_state(
        &report,
        "step environment",
        "ok",
        "LANG (by DRONE_RUNNER_ENVIRON)",
    );
    assert_state(
        &report,
        "step environment",
        "ok",
        "FOO (by DRONE_RUNNER_ENVFILE)",
    );
    assert_state(&report, "step PATH abra", "fail", "the runner's PATH");

    // A file the runner is told to read that is not there fails the check.
    std::fs::remove_file(&step_vars).unwrap();
    let (report, _) = doctor(&sandbox, &["--unit-file", unit_arg]);
    assert_state(&report, "step environment", "fail", "DRONE_RUNNER_ENVFILE");
}

/// A runner unit without delegation, with another kill mode and a stop timeout shorter than a
/// teardown fails each check; the shipped drop-in over a bare unit passes them all, until the
/// teardown timeout outgrows its TimeoutStopSec. The step's PATH is the unit's.
#[test]
fn doctor_judges_the_runner_unit_file_and_its_drop_ins() {
    let sandbox = host();
    let dir = tempfile::tempdir().unwrap();
    let unit = dir.path().join("drone-runner-exec.service");
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    for program in ["abra", "git", "setsid", "ccci-run"] {
        let path = bin.join(program);
        std::fs::write(&path, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::write(
        &unit,
        format!(
            "[Unit]\nDescription=Drone exec runner\n\n[Service]\n\
             ExecStart=/usr/bin/drone-runner-exec\nDelegate=no\nKillMode=process\n\
             TimeoutStopSec=90\nEnvironment=PATH={}\n",
            bin.display()
        ),
    )
    .unwrap();
    let unit_arg = unit.to_str().unwrap();
    let (report, _) = doctor(&sandbox, &["--unit-file", unit_arg]);
    assert_state(&report, "unit Delegate", "fail", "Delegate=no");
    assert_state(&report, "unit KillMode", "fail", "KillMode=process");
    assert_state(&report, "unit TimeoutStopSec", "fail", "shorter than");
    for program in ["abra", "git", "setsid", "ccci-run"] {
        assert_state(
            &report,
            &format!("step PATH {program}"),
            "ok",
            &bin.display().to_string(),
        );
    }

    // The bare unit with the drop-in this project ships.
    std::fs::write(
        &unit,
        "[Service]\nExecStart=/usr/bin/drone-runner-exec\nKillMode=process\n",
    )
    .unwrap();
    let dropins = dir.path().join("drone-runner-exec.service.d");
    std::fs::create_dir_all(&dropins).unwrap();
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("systemd/drone-runner-exec.service.d/ccci-run.conf");
    std::fs::copy(&shipped, dropins.join("ccci-run.conf")).unwrap();
    std::fs::write(dropins.join("00-kill.conf"), "[Service]\nKillMode=\n").unwrap();
    let (report, _) = doctor(&sandbox, &["--unit-file", unit_arg]);
    assert_state(&report, "unit Delegate", "ok", "ccci-run.conf");
    assert_state(&report, "unit KillMode", "ok", "control-group");
    assert_state(&report, "unit TimeoutStopSec", "ok", "6m");
    // No PATH in the unit: systemd's default, where no abra is.
    assert_state(&report, "step PATH abra", "fail", "systemd's default PATH");

    let mut cmd = sandbox.ccci();
    cmd.env("CCCI_TEARDOWN_TIMEOUT", "10m")
        .args(["doctor", "--json", "--unit-file", unit_arg]);
    let (report, _) = doctor_of(cmd);
    assert_state(&report, "unit TimeoutStopSec", "fail", "shorter than");

    let (report, _) = doctor(&sandbox, &["--unit-file", "/nonexistent/runner.service"]);
    assert_state(
        &report,
        "unit Delegate",
        "fail",
        "/nonexistent/runner.service",
    );
}

/// With a user's inotify instances used up by another of its processes, doctor run as that
/// user fails the instance check and names the sysctl; once they are given back, it passes.
#[test]
fn doctor_fails_when_the_users_inotify_instances_are_used_up() {
    const UID: u32 = 61_031;
    let dir = tempfile::tempdir().unwrap();
    let status = Command::new("chown")
        .arg(format!("{UID}:{UID}"))
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(status.success());
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let as_user = |program: &str| {
        let mut cmd = Command::new("setpriv");
        cmd.args([
            &format!("--reuid={UID}"),
            &format!("--regid={UID}"),
            "--clear-groups",
            program,
        ]);
        cmd
    };
    let doctor_as_user = || {
        let mut cmd = as_user(BIN);
        crate::util::without_ccci_env(&mut cmd);
        cmd.env("CCCI_CONFIG", "/dev/null")
            .args(["doctor", "--json", "--docker", "off", "--lock-dir"])
            .arg(dir.path())
            .arg("--runs-dir")
            .arg(dir.path())
            .arg("--abra-home")
            .arg(dir.path());
        doctor_of(cmd).0
    };
    let mut exhaust = as_user("/usr/bin/python3");
    exhaust.args(["-c", crate::limits::EXHAUST_INOTIFY]);
    let mut exhaust = Proc::spawn(exhaust);
    let ready = exhaust.wait_for(Stream::Out, "ready");
    assert!(
        ready.ends_with(" 24"),
        "the instances end in EMFILE: {ready}"
    );
    let report = doctor_as_user();
    assert_state(&report, "inotify instances", "fail", "used up");
    assert!(
        check(&report, "inotify instances")["fix"]
            .as_str()
            .unwrap()
            .contains("fs.inotify.max_user_instances")
    );
    exhaust.close_stdin();
    exhaust.finish();
    let report = doctor_as_user();
    assert_state(&report, "inotify instances", "ok", "left");
    // Not root, with no delegated subtree: runs cannot have cgroups, and are told so.
    assert_eq!(check(&report, "cgroup v2")["state"], "warn", "{report:#}");
}

/// The shared engine answers, its swarm is active and it speaks API 1.41; an engine that is
/// not there fails all three within the bound, and doctor exits 1.
#[test]
fn doctor_asks_the_docker_engine_and_fails_a_missing_one_promptly() {
    let Some(mut sandbox) = Sandbox::with_docker() else {
        return;
    };
    std::fs::create_dir_all(sandbox.abra_home()).unwrap();
    sandbox.set_docker("required");
    let (report, _) = doctor(&sandbox, &[]);
    assert_state(&report, "docker", "ok", "answers at");
    assert_state(&report, "docker swarm", "ok", "active");
    assert_state(&report, "docker api", "ok", "engine API 1.");
    assert_state(&report, "docker nodes", "ok", "one node");

    let gone = tempfile::tempdir().unwrap();
    let mut cmd = sandbox.ccci();
    cmd.env(
        "DOCKER_HOST",
        format!("unix://{}/docker.sock", gone.path().display()),
    )
    .args(["doctor", "--json"]);
    let started = Instant::now();
    let (report, _) = doctor_of(cmd);
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_state(&report, "docker", "fail", "docker.sock");
    assert_eq!(check(&report, "docker swarm")["state"], "fail");
    assert_eq!(report["ok"], false);
}

/// Each member of a real 3-member cluster answers, they are one cluster with a leader, and the
/// TTL is granted as asked; `lock --metrics-file` on etcd writes a file the parser reads, whose
/// last wait is the settling TTL of a new cluster's first lock and nothing for the next; an
/// endpoint nobody listens on fails alone; with two members killed the last one knows no
/// leader, and doctor says so within its bounds.
#[cfg(feature = "etcd")]
#[test]
fn doctor_asks_each_etcd_member_for_its_cluster_and_leader() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let mut sandbox = host();
    sandbox.set_etcd(cluster.endpoints(), 5);
    let (report, _) = doctor(&sandbox, &[]);
    for endpoint in cluster.endpoints().split(',') {
        assert_state(&report, &format!("etcd {endpoint}"), "ok", "member");
    }
    assert_state(&report, "etcd cluster", "ok", "one cluster");
    assert_state(&report, "etcd leader", "ok", "leads");
    assert_state(&report, "etcd lease ttl", "ok", "5 s, as asked");
    assert_state(&report, "etcd stop budget", "ok", "kill grace");
    // A kill grace the lease cannot hold: what run and lock would refuse, doctor fails.
    let mut cmd = sandbox.ccci();
    cmd.env("CCCI_KILL_GRACE", "10s").args(["doctor", "--json"]);
    let (report, _) = doctor_of(cmd);
    assert_state(
        &report,
        "etcd stop budget",
        "fail",
        "the smallest lease TTL that works is 14 s",
    );
    assert_eq!(cluster.keys(), "", "doctor leaves nothing in etcd");
    // The named locks kept in etcd, in a metrics file the Prometheus parser reads. The first
    // lock on a new cluster waits one TTL for its lineage to settle; the next one does not.
    // With the locks in etcd, the lock dir is made for the record of the last wait where it
    // is missing, as the local locks would have made it: never a warning.
    std::fs::remove_dir_all(sandbox.locks()).unwrap();
    let metrics = sandbox.path().join("lock.prom");
    let lock_and_read = || {
        let mut cmd = sandbox.ccci();
        cmd.args(["lock", "fleet", "--metrics-file"])
            .arg(&metrics)
            .args(["--", "true"]);
        let done = run(cmd);
        done.assert_code(0);
        assert!(
            !done
                .err
                .iter()
                .any(|l| l.contains("failed to record the wait")),
            "{}",
            done.transcript()
        );
        assert!(sandbox.locks().join("ccci-fleet.lock.last-wait").is_file());
        parse_metrics(&metrics)
    };
    if let Some(samples) = lock_and_read() {
        let depth = "ccci_named_lock_queue_depth{class=fast,lock=fleet,source=lock}";
        assert_eq!(sample(&samples, depth), 0.0);
        assert_eq!(sample(&samples, "ccci_host_metrics_complete{"), 1.0);
        let waited = sample(&samples, "ccci_named_lock_last_wait_seconds{lock=fleet");
        assert!((5.0..15.0).contains(&waited), "first wait {waited} s");
    }
    if let Some(samples) = lock_and_read() {
        let waited = sample(&samples, "ccci_named_lock_last_wait_seconds{lock=fleet");
        assert!(waited < 2.0, "second wait {waited} s");
    }

    let dead = format!("http://127.0.0.1:{}", crate::etcd_cluster::free_port());
    sandbox.set_etcd(format!("{},{dead}", cluster.endpoints()), 5);
    let (report, _) = doctor(&sandbox, &[]);
    assert_eq!(check(&report, &format!("etcd {dead}"))["state"], "fail");
    assert_state(&report, "etcd cluster", "ok", "one cluster");

    let leader = cluster.leader();
    let others: Vec<usize> = (0..3).filter(|i| *i != leader).collect();
    cluster.signal_member(leader, nix::sys::signal::Signal::SIGKILL);
    cluster.signal_member(others[0], nix::sys::signal::Signal::SIGKILL);
    sandbox.set_etcd(cluster.endpoints(), 5);
    let started = Instant::now();
    let (report, _) = doctor(&sandbox, &[]);
    assert!(started.elapsed() < Duration::from_secs(60));
    assert_eq!(report["ok"], false);
    let leader_check = check(&report, "etcd leader");
    assert_ne!(leader_check["state"], "ok", "{report:#}");
}

/// Parse a metrics file with Prometheus's own text parser (Debian's python3-prometheus-client);
/// every sample as `name{labels} value`, one a line. A missing parser skips here and fails in
/// CI, where .ci/run installs it.
fn parse_metrics(path: &Path) -> Option<Vec<String>> {
    const PARSE: &str = r#"
import sys
from prometheus_client.parser import text_string_to_metric_families
for family in text_string_to_metric_families(open(sys.argv[1]).read()):
    for s in family.samples:
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
        print(f"{s.name}{{{labels}}} {s.value}")
"#;
    let has = Command::new("/usr/bin/python3")
        .args(["-c", "import prometheus_client.parser"])
        .status()
        .is_ok_and(|s| s.success());
    if !has {
        skip(
            "Prometheus's text parser is not installed",
            "apt install python3-prometheus-client",
        );
        return None;
    }
    let out = Command::new("/usr/bin/python3")
        .args(["-c", PARSE])
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the Prometheus parser refused {}: {}\n{}",
        path.display(),
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(path).unwrap_or_default()
    );
    Some(
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect(),
    )
}

fn sample(samples: &[String], prefix: &str) -> f64 {
    let line = samples
        .iter()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no sample {prefix}: {samples:#?}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// With a holder and two waiters (one fast, one normal) on a named lock, a `lock` that gives
/// up writes a file the Prometheus parser reads: one of each class waiting, the oldest waiting
/// for as long as it has, and (once the waiters are served) the last wait. A live run and a run
/// SIGKILLed with its app deployed are counted, in the lock's file and the janitor's, until the
/// janitor reaps the dead one.
#[test]
fn lock_and_janitor_metrics_parse_and_count_queues_waits_and_runs() {
    let sandbox = host();
    let metrics = sandbox.path().join("lock.prom");
    let lock = |args: &[&str], script: &str| {
        let mut cmd = sandbox.ccci();
        cmd.args(["lock", "m"])
            .args(args)
            .args(["--", "sh", "-c", script]);
        cmd
    };
    let mut holder = Proc::spawn(lock(&[], "echo ready $$; read line || :"));
    holder.wait_ready();
    let waiters: Vec<Proc> = ["normal", "fast"]
        .iter()
        .map(|class| {
            let mut w = Proc::spawn(lock(&["--class", class], "true"));
            w.wait_for(Stream::Err, "waiting as queue ticket");
            w
        })
        .collect();
    let waiting_since = Instant::now();
    // A run that stays live, and one whose supervisor dies with its app deployed.
    std::fs::create_dir_all(sandbox.abra_home().join("servers/ci")).unwrap();
    let mut live = Proc::spawn(sandbox.run_sh("81", &[], "echo ready $$; read line || :"));
    live.wait_ready();
    let script =
        "echo x > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\"; echo ready $$; exec sleep 1000";
    let mut dying = Proc::spawn({
        let mut cmd = sandbox.ccci();
        cmd.args(["run", "--recipe", "other", "--run-id", "82", "--no-fetch"])
            .args(["--", "sh", "-c", script]);
        cmd
    });
    let command = dying.wait_ready();
    signal(dying.pid(), nix::sys::signal::Signal::SIGKILL);
    dying.finish();
    assert!(wait_exited(command));

    let gave_up = run(lock(
        &["--wait", "0.3", "--metrics-file", metrics.to_str().unwrap()],
        "true",
    ));
    gave_up.assert_code(75);
    let Some(samples) = parse_metrics(&metrics) else {
        return;
    };
    let depth = "ccci_named_lock_queue_depth{class=";
    assert_eq!(
        sample(&samples, &format!("{depth}fast,lock=m,source=lock}}")),
        1.0
    );
    assert_eq!(
        sample(&samples, &format!("{depth}normal,lock=m,source=lock}}")),
        1.0
    );
    let oldest = sample(&samples, "ccci_named_lock_oldest_waiter_age_seconds{lock=m");
    assert!(
        oldest >= 0.3 && oldest <= waiting_since.elapsed().as_secs_f64() + 1.0,
        "oldest waiter {oldest} s: {samples:#?}"
    );
    assert_eq!(
        sample(&samples, "ccci_host_runs_live{"),
        1.0,
        "{samples:#?}"
    );
    assert_eq!(
        sample(&samples, "ccci_host_runs_dead_unswept{"),
        1.0,
        "{samples:#?}"
    );
    assert_eq!(sample(&samples, "ccci_host_metrics_complete{"), 1.0);

    holder.close_stdin();
    holder.finish().assert_code(0);
    for w in waiters {
        w.finish().assert_code(0);
    }
    let served_after = waiting_since.elapsed().as_secs_f64();
    let (_, done) = sandbox.janitor(&["--metrics-file", metrics.to_str().unwrap()]);
    done.assert_code(0);
    let Some(samples) = parse_metrics(&metrics) else {
        return;
    };
    assert_eq!(
        sample(
            &samples,
            "ccci_named_lock_queue_depth{class=fast,lock=m,source=janitor}"
        ),
        0.0
    );
    let last = sample(
        &samples,
        "ccci_named_lock_last_wait_seconds{lock=m,source=janitor}",
    );
    assert!(
        last > 0.3 && last <= served_after + 1.0,
        "last wait {last} s"
    );
    assert_eq!(
        sample(&samples, "ccci_host_runs_live{"),
        1.0,
        "{samples:#?}"
    );
    // The sweep reaped the dead run's app: nothing is left awaiting one.
    assert_eq!(
        sample(&samples, "ccci_host_runs_dead_unswept{"),
        0.0,
        "{samples:#?}"
    );
    assert!(
        samples
            .iter()
            .any(|l| l.starts_with("ccci_janitor_candidates{"))
    );
    live.close_stdin();
    live.finish().assert_code(0);
}

/// A metrics file that cannot be written costs the lock nothing: its command runs under it and
/// its status is the exit code; the failure is a warning naming the file.
#[test]
fn a_metrics_file_that_cannot_be_written_warns_and_the_command_runs() {
    let sandbox = host();
    let path = sandbox.path().join("no-such-dir/lock.prom");
    let mut cmd = sandbox.ccci();
    cmd.args(["lock", "m", "--metrics-file"]).arg(&path).args([
        "--",
        "sh",
        "-c",
        "echo ran; exit 3",
    ]);
    let done = run(cmd);
    done.assert_code(3);
    assert!(
        done.out.contains(&"ran".to_owned()),
        "{}",
        done.transcript()
    );
    done.assert_stderr_has(&format!(
        "warning: failed to write metrics file {}",
        path.display()
    ));
}

/// The runner's `User=` against `runner_user`: a runner of its own user whose user the
/// configuration does not name fails the check with what the root janitor would then do and the
/// line to add; named, it passes; root needs nothing.
#[test]
fn doctor_checks_the_runner_s_user_against_runner_user() {
    let sandbox = Sandbox::new();
    let dir = tempfile::tempdir().unwrap();
    let unit = dir.path().join("drone-runner-exec.service");
    let unit_arg = unit.to_str().unwrap();
    std::fs::write(
        &unit,
        "[Service]\nExecStart=/usr/bin/drone-runner-exec\nUser=nobody\n",
    )
    .unwrap();
    let (report, _) = doctor(&sandbox, &["--unit-file", unit_arg]);
    assert_state(&report, "unit User", "fail", "runner_user is not set");
    let config = dir.path().join("config.toml");
    std::fs::write(&config, "runner_user = \"nobody\"\n").unwrap();
    let mut cmd = sandbox.ccci();
    cmd.env("CCCI_CONFIG", &config)
        .args(["doctor", "--json", "--unit-file", unit_arg]);
    let (report, _) = doctor_of(cmd);
    assert_state(&report, "unit User", "ok", "named by runner_user");
    std::fs::write(&unit, "[Service]\nExecStart=/usr/bin/drone-runner-exec\n").unwrap();
    let (report, _) = doctor(&sandbox, &["--unit-file", unit_arg]);
    assert_state(&report, "unit User", "ok", "runs as root");
    std::fs::write(
        &unit,
        "[Service]\nExecStart=/usr/bin/drone-runner-exec\nUser=no-such-runner-user\n",
    )
    .unwrap();
    let (report, _) = doctor(&sandbox, &["--unit-file", unit_arg]);
    assert_state(&report, "unit User", "fail", "no such user");
}
