//! A runner with a user of its own (`drone`, as the NixOS module advises), and root for the
//! janitor's timer and the operator: the configuration names the runner's user
//! (`runner_user`), and root takes that user's lock dir, lock files and run directories as its
//! own, and hands it what it creates in the lock dir. Steps run as one user, the janitor as
//! another, on real files.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use nix::sys::signal::Signal;

use crate::util::{Finished, Proc, Sandbox, run, signal, wait_exited};

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
    if !nix::unistd::Uid::effective().is_root() {
        crate::util::skip(
            "needs root",
            "run the suite as root to switch to another user",
        );
        return;
    }
    let sandbox = Sandbox::new();
    std::fs::set_permissions(sandbox.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let servers = sandbox.abra_home().join("servers/ci");
    std::fs::create_dir_all(&servers).unwrap();
    for dir in [
        sandbox.locks(),
        sandbox.runs(),
        sandbox.state(),
        sandbox.abra_home(),
        sandbox.abra_home().join("servers"),
        servers.clone(),
    ] {
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
}
