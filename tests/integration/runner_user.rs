//! A runner with a user of its own (`drone`, as the NixOS module advises), and root for the
//! janitor's timer and the operator: the configuration names the runner's user
//! (`runner_user`), and root becomes that user before it writes anything, so what it makes is
//! the runner's by construction; root's read-only commands stay root. Steps run as the runner's
//! user, the janitor is started as root, on real files.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use nix::sys::signal::Signal;

use crate::util::{Finished, Proc, Sandbox, list, run, signal, wait_exited};

const RUNNER: u32 = 65534;

/// `cmd`, as the runner's user.
fn as_runner(cmd: &Command) -> Command {
    crate::util::as_user(RUNNER, cmd)
}

fn give_to_runner(path: &Path) {
    std::os::unix::fs::chown(path, Some(RUNNER), Some(RUNNER)).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A configuration file naming the runner's user (or not).
fn config(sandbox: &Sandbox, runner_user: bool) -> std::path::PathBuf {
    let file = sandbox.path().join(format!("config-{runner_user}.toml"));
    std::fs::write(
        &file,
        if runner_user {
            "runner_user = \"nobody\"\n"
        } else {
            ""
        },
    )
    .unwrap();
    file
}

fn with_config(sandbox: &Sandbox, file: &Path, args: &[&str]) -> Command {
    let mut cmd = sandbox.ccci();
    cmd.env("CCCI_CONFIG", file).args(args);
    cmd
}

#[test]
fn a_root_janitor_sweeps_retains_and_reaps_a_runner_of_its_own_user() {
    if !crate::util::is_root_or_skip("run the suite as root to switch to another user") {
        return;
    }
    let sandbox = Sandbox::owned_by(RUNNER);
    let servers = sandbox.abra_home().join("servers/ci");
    for dir in [sandbox.abra_home().join("servers"), servers.clone()] {
        std::fs::create_dir_all(&dir).unwrap();
        give_to_runner(&dir);
    }
    let with_user = config(&sandbox, true);
    let without = config(&sandbox, false);

    // The runner's runs: one finished, one whose supervisor dies (SIGKILL) with its app up.
    let done: Finished = run(as_runner(&with_config(
        &sandbox,
        &with_user,
        &[
            "run",
            "--recipe",
            "custom-html",
            "--run-id",
            "f1",
            "--no-fetch",
            "--",
            "true",
        ],
    )));
    done.assert_code(0);
    let script =
        "echo x > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\"; echo ready $$; exec sleep 1000";
    let mut dead = Proc::spawn(as_runner(&with_config(
        &sandbox,
        &with_user,
        &[
            "run",
            "--recipe",
            "custom-html",
            "--pr",
            "3",
            "--run-id",
            "d1",
            "--no-fetch",
            "--",
            "sh",
            "-c",
            script,
        ],
    )));
    let command = dead.wait_ready();
    signal(dead.pid(), Signal::SIGKILL);
    dead.finish();
    let domain = sandbox.domain("custom-html", Some("3"));
    let env = servers.join(format!("{domain}.env"));
    assert!(env.exists());

    // Root, without the runner's user named: the runner's lock dir is refused, and the message
    // says what to configure.
    let refused = run(with_config(&sandbox, &without, &["janitor", "--json"]));
    refused.assert_code(1);
    assert!(
        refused
            .out
            .join("\n")
            .contains("name it as runner_user in the configuration file"),
        "{}",
        refused.transcript()
    );
    assert!(env.exists());

    // Root, with it: the dead run's processes and app are reaped, the finished run retained
    // no longer than asked.
    crate::util::age(
        &sandbox.runs().join("f1").join("run.json"),
        std::time::Duration::from_secs(7200),
    );
    let swept = run(with_config(
        &sandbox,
        &with_user,
        &["janitor", "--json", "--keep-runs", "1h"],
    ));
    swept.assert_code(0);
    let report: serde_json::Value = serde_json::from_str(&swept.out.join("\n"))
        .unwrap_or_else(|e| panic!("no JSON ({e})\n{}", swept.transcript()));
    assert_eq!(
        crate::util::candidate(&report, &domain)["decision"],
        "reap",
        "{report:#}"
    );
    assert!(wait_exited(command), "the dead run's command lives on");
    assert!(!env.exists(), "the dead run's .env was left");
    assert!(
        !sandbox.runs().join("f1").exists(),
        "the finished run's directory was kept: {report:#}"
    );

    // What root makes in the lock dir is the runner's: a named lock taken by root first, then
    // by the runner.
    run(with_config(
        &sandbox,
        &with_user,
        &["lock", "shared", "--", "true"],
    ))
    .assert_code(0);
    let after = run(as_runner(&with_config(
        &sandbox,
        &with_user,
        &["lock", "shared", "--", "echo", "held"],
    )));
    after.assert_code(0);
    assert!(
        after.out.contains(&"held".to_owned()),
        "{}",
        after.transcript()
    );
    let lock = std::fs::metadata(sandbox.locks().join("ccci-shared.lock")).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&lock), RUNNER);
    // The dead run's record, noted by the janitor, keeps its owner and mode: the runner's own
    // `runs` still reads it.
    let record = std::fs::metadata(sandbox.runs().join("d1/run.json")).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&record), RUNNER);
    let listed = run(as_runner(&with_config(
        &sandbox,
        &with_user,
        &["runs", "--all", "--json"],
    )));
    listed.assert_code(0);
    assert!(
        listed.out.join("\n").contains("\"d1\""),
        "{}",
        listed.transcript()
    );
    // Root's read-only commands keep working as root, and make nothing.
    for args in [
        &["runs", "--all"][..],
        &["locks"],
        &["janitor", "--dry-run"],
    ] {
        run(with_config(&sandbox, &with_user, args)).assert_code(0);
    }
    assert_nothing_of_root_s(&sandbox);
    // And the runner's next run of the reaped domain starts as usual.
    run(as_runner(&with_config(
        &sandbox,
        &with_user,
        &[
            "run",
            "--recipe",
            "custom-html",
            "--pr",
            "3",
            "--run-id",
            "n2",
            "--no-fetch",
            "--",
            "true",
        ],
    )))
    .assert_code(0);
    assert_nothing_of_root_s(&sandbox);
}

/// Everything under the lock, runs and state dirs is the runner's.
#[track_caller]
fn assert_nothing_of_root_s(sandbox: &Sandbox) {
    fn walk(dir: &Path, found: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if std::os::unix::fs::MetadataExt::uid(&meta) != RUNNER {
                found.push(path.display().to_string());
            }
            if meta.is_dir() {
                walk(&path, found);
            }
        }
    }
    let mut found = Vec::new();
    for dir in [sandbox.locks(), sandbox.runs(), sandbox.state()] {
        if dir.exists() {
            walk(&dir, &mut found);
        }
    }
    assert!(found.is_empty(), "not the runner's: {found:?}");
}

/// After a reboot the lock dir is gone and a dead run's `.env` is left: a janitor started as
/// root makes the lock dir the runner's, reaps the app, and the runner's next run of that domain
/// starts. A lock file the janitor cannot open (root's, 0600) is a candidate it could not act
/// on: exit 1, and the metrics say the sweep failed.
#[test]
fn after_a_reboot_a_root_janitor_leaves_the_runner_a_lock_dir_of_its_own() {
    if !crate::util::is_root_or_skip("run the suite as root to switch to another user") {
        return;
    }
    let sandbox = Sandbox::new();
    // The lock dir's parent is the runner's (as a tmpfs of its own would be, or /run/lock,
    // sticky and open to all): after a reboot the lock dir is gone.
    give_to_runner(sandbox.path());
    let servers = sandbox.abra_home().join("servers/ci");
    std::fs::create_dir_all(&servers).unwrap();
    std::fs::create_dir_all(sandbox.runs()).unwrap();
    std::fs::create_dir_all(sandbox.state()).unwrap();
    for dir in [
        sandbox.runs(),
        sandbox.state(),
        sandbox.abra_home(),
        sandbox.abra_home().join("servers"),
        servers.clone(),
    ] {
        give_to_runner(&dir);
    }
    // The configuration stays where only root could replace it.
    let etc = tempfile::tempdir().unwrap();
    let with_user = etc.path().join("config.toml");
    std::fs::write(&with_user, "runner_user = \"nobody\"\n").unwrap();
    let domain = sandbox.domain("custom-html", Some("8"));
    let env = servers.join(format!("{domain}.env"));
    std::fs::write(&env, "x\n").unwrap();
    give_to_runner(&env);
    assert!(!sandbox.locks().exists());
    let metrics = sandbox.path().join("metrics");
    std::fs::create_dir(&metrics).unwrap();
    give_to_runner(&metrics);
    let prom = metrics.join("ccci-run.prom");
    let swept = run(with_config(
        &sandbox,
        &with_user,
        &[
            "janitor",
            "--json",
            "--metrics-file",
            prom.to_str().unwrap(),
        ],
    ));
    swept.assert_code(0);
    assert!(!env.exists(), "{}", swept.transcript());
    let locks = std::fs::metadata(sandbox.locks()).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&locks), RUNNER);
    assert!(
        std::fs::read_to_string(&prom)
            .unwrap()
            .contains("ccci_janitor_sweep_failed 0")
    );
    run(as_runner(&with_config(
        &sandbox,
        &with_user,
        &[
            "run",
            "--recipe",
            "custom-html",
            "--pr",
            "8",
            "--run-id",
            "r8",
            "--no-fetch",
            "--",
            "true",
        ],
    )))
    .assert_code(0);
    assert_nothing_of_root_s(&sandbox);

    // A lock file of root's, closed to the runner (as an older janitor left them).
    let stuck = sandbox.domain("custom-html", Some("9"));
    let stuck_env = servers.join(format!("{stuck}.env"));
    std::fs::write(&stuck_env, "x\n").unwrap();
    let lock = sandbox.locks().join(format!("cc-ci-app-{stuck}.lock"));
    std::fs::write(&lock, "").unwrap();
    std::fs::set_permissions(&lock, std::fs::Permissions::from_mode(0o600)).unwrap();
    let failed = run(with_config(
        &sandbox,
        &with_user,
        &[
            "janitor",
            "--json",
            "--metrics-file",
            prom.to_str().unwrap(),
        ],
    ));
    failed.assert_code(1);
    let report: serde_json::Value = serde_json::from_str(&failed.out.join("\n"))
        .unwrap_or_else(|e| panic!("no JSON ({e})\n{}", failed.transcript()));
    let decision = crate::util::candidate(&report, &stuck)["decision"].clone();
    assert!(
        decision == "unreadable" || decision == "foreign",
        "{report:#}"
    );
    assert!(stuck_env.exists());
    let text = std::fs::read_to_string(&prom).unwrap();
    assert!(text.contains("ccci_janitor_sweep_failed 1"), "{text}");
}

/// Started as root with `runner_user` set but without the right to switch (the shipped unit's
/// capability bounding set and system call filter forbid it), a command that writes refuses
/// before it touches anything, naming what to do; a read-only one works as root.
#[test]
fn a_root_command_that_cannot_become_the_runner_refuses_and_touches_nothing() {
    if !crate::util::is_root_or_skip("run the suite as root to switch to another user") {
        return;
    }
    let sandbox = Sandbox::new();
    let with_user = config(&sandbox, true);
    let confined = |args: &[&str]| {
        let ccci = with_config(&sandbox, &with_user, args);
        let mut cmd = Command::new("setpriv");
        cmd.args([
            "--bounding-set=-all,+kill,+dac_override,+sys_ptrace",
            "--inh-caps=-all",
            "--",
        ])
        .arg(ccci.get_program())
        .args(ccci.get_args());
        for (key, value) in ccci.get_envs() {
            match value {
                Some(value) => cmd.env(key, value),
                None => cmd.env_remove(key),
            };
        }
        run(cmd)
    };
    let tree = || -> Vec<String> {
        let mut found = Vec::new();
        for dir in [sandbox.locks(), sandbox.runs(), sandbox.state()] {
            found.push(format!(
                "{}: {:?}",
                dir.display(),
                dir.exists().then(|| list(&dir))
            ));
        }
        found
    };
    let before = tree();
    let refused = confined(&["janitor"]);
    refused.assert_code(125);
    refused.assert_stderr_has("cannot act as the runner's user (uid 65534, runner_user)");
    assert_eq!(tree(), before, "the refused janitor made something");
    confined(&["janitor", "--dry-run"]).assert_code(0);
    confined(&["runs", "--all"]).assert_code(0);
}

/// Root that becomes the runner's user leaves nothing of root's running either: a `run` and a
/// `lock` started as root with `runner_user` set are the runner's in every process, their
/// fence (forked as they start) included, and a SIGKILLed supervisor's fence, the runner's,
/// still takes the run with it.
#[test]
fn a_root_run_or_lock_that_becomes_the_runner_keeps_no_process_of_root_s() {
    if !crate::util::is_root_or_skip("run the suite as root to switch to another user") {
        return;
    }
    let sandbox = Sandbox::owned_by(RUNNER);
    let with_user = config(&sandbox, true);
    let uids = |pid: i32| -> Vec<u32> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .unwrap()
            .split_whitespace()
            .map(|u| u.parse().unwrap())
            .collect()
    };
    let script =
        "setsid sh -c 'echo daemon $$; exec sleep 100000' & echo ready $$; exec sleep 100000";
    for args in [
        &[
            "run",
            "--recipe",
            "custom-html",
            "--run-id",
            "r1",
            "--no-fetch",
            "--",
            "sh",
            "-c",
            script,
        ][..],
        &["lock", "shared", "--", "sh", "-c", script],
    ] {
        let mut proc = Proc::spawn(with_config(&sandbox, &with_user, args));
        let pids = crate::util::pids_by_prefix(&mut proc, &["daemon ", "ready "]);
        let supervisor = proc.pid();
        let fences = crate::util::fences_of(supervisor);
        assert_eq!(fences.len(), 1, "{args:?}: one dead-man per run");
        for pid in [supervisor, fences[0]].iter().chain(&pids) {
            assert_eq!(
                uids(*pid),
                vec![RUNNER; 4],
                "{args:?}: process {pid} is not the runner's alone"
            );
        }
        signal(supervisor, Signal::SIGKILL);
        let done = proc.finish();
        for pid in &pids {
            assert!(
                wait_exited(*pid),
                "{args:?}: process {pid} outlived its supervisor\n{}",
                done.transcript()
            );
        }
        done.assert_stderr_has("!! dead-man of");
    }
}
