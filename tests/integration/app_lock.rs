//! The app-domain lock inside `run`: serialisation, budgets, signals while parked, unsafe files.

use std::os::unix::fs::PermissionsExt;

use nix::sys::signal::Signal;

use crate::util::{Proc, Sandbox, Stream, run, sh_quote, signal};

const WAITING: &str = "== app lock: another run of";

/// Two runs of one domain: the second waits visibly and runs strictly after the first.
#[test]
fn same_domain_runs_serialise_with_the_waiting_line() {
    let sandbox = Sandbox::new();
    let log = sandbox.path().join("order.log");
    let script = format!(
        "echo \"$CCCI_RUN_ID start\" >> {log}; echo ready $$; read line || :; echo \"$CCCI_RUN_ID end\" >> {log}",
        log = sh_quote(&log)
    );
    let mut first = Proc::spawn(sandbox.run_sh("a", &[], &script));
    first.wait_ready();
    let mut second = Proc::spawn(sandbox.run_sh("b", &[], &script));
    second.wait_for(Stream::Err, WAITING);
    first.close_stdin();
    first.finish().assert_code(0);
    second.wait_ready();
    second.close_stdin();
    let done = second.finish();
    done.assert_code(0);
    let order = std::fs::read_to_string(&log).unwrap();
    assert_eq!(order, "a start\na end\nb start\nb end\n");
}

#[test]
fn first_run_does_not_print_the_waiting_line() {
    let sandbox = Sandbox::new();
    let done = run(sandbox.run_sh("1", &[], "exit 0"));
    done.assert_code(0);
    assert!(!done.stderr().contains(WAITING), "{}", done.transcript());
}

#[test]
fn different_domains_run_in_parallel() {
    let sandbox = Sandbox::new();
    let mut first =
        Proc::spawn(sandbox.run_sh("a", &["--pr", "1"], "echo ready $$; read line || :"));
    first.wait_ready();
    // Finishes while the first is still live: it never waited for it.
    let other = run(sandbox.run_sh("b", &["--pr", "2"], "echo other-ran"));
    other.assert_code(0);
    assert!(!other.stderr().contains(WAITING));
    assert_eq!(other.out, vec!["other-ran"]);
    first.close_stdin();
    first.finish().assert_code(0);
}

/// Run "a" of custom-html, live (its command waits on stdin), with its app's .env deployed.
fn live_run_with_app(sandbox: &Sandbox) -> (Proc, std::path::PathBuf) {
    let script =
        "echo x > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\"; echo ready $$; read line || :";
    std::fs::create_dir_all(sandbox.abra_home().join("servers/ci")).unwrap();
    let mut holder = Proc::spawn(sandbox.run_sh("a", &[], script));
    holder.wait_ready();
    let domain = sandbox.domain("custom-html", None);
    (
        holder,
        sandbox.abra_home().join(format!("servers/ci/{domain}.env")),
    )
}

#[test]
fn lock_wait_budget_ends_with_75_and_leaves_the_holder_s_app_alone() {
    let sandbox = Sandbox::new();
    let (mut holder, env) = live_run_with_app(&sandbox);
    let hook = sandbox.path().join("hook-ran");
    let late = run(sandbox.run_sh(
        "b",
        &[
            "--lock-wait",
            "0.5",
            "--on-teardown",
            &format!("touch {}", sh_quote(&hook)),
        ],
        "echo must-not-run",
    ));
    late.assert_code(75);
    late.assert_stderr_has("not acquired within 0.5 s; held by run a");
    assert!(!late.out.iter().any(|l| l == "must-not-run"));
    assert!(env.exists(), "the waiting run removed the live run's app");
    assert!(
        !hook.exists(),
        "the teardown hook ran for an app this run never held"
    );
    holder.close_stdin();
    holder.finish().assert_code(0);
}

/// A run parked on the lock ends at once on a signal or its deadline, while the holder still
/// holds the lock, and touches nothing of the holder's app.
#[test]
fn signal_and_deadline_end_a_parked_wait() {
    let sandbox = Sandbox::new();
    let (mut holder, env) = live_run_with_app(&sandbox);

    let mut parked = Proc::spawn(sandbox.run_sh("b", &[], "echo must-not-run"));
    parked.wait_for(Stream::Err, WAITING);
    signal(parked.pid(), Signal::SIGTERM);
    let done = parked.finish();
    done.assert_code(143);
    done.assert_stderr_has("== SIGTERM received — tearing down ==");

    let mut parked = Proc::spawn(sandbox.run_sh("c", &["--deadline", "1"], "echo must-not-run"));
    parked.wait_for(Stream::Err, WAITING);
    let done = parked.finish();
    done.assert_code(142);
    done.assert_stderr_has("hard deadline — tearing down");

    assert!(env.exists(), "a parked run removed the live run's app");
    assert_eq!(sandbox.record("c")["exit_code"], 142);
    holder.close_stdin();
    holder.finish().assert_code(0);
}

/// The unlink/recreate race: a waiter that wins the lock on an inode a reaper unlinked must
/// retry on the live path, or two runs would hold "the same" lock.
#[test]
fn waiter_that_wins_an_unlinked_inode_retries_on_the_live_path() {
    let sandbox = Sandbox::new();
    let domain = sandbox.domain("custom-html", None);
    let lock = sandbox.lock_file(&domain);
    std::fs::create_dir_all(sandbox.locks()).unwrap();
    std::fs::write(&lock, "").unwrap();
    std::fs::set_permissions(&lock, std::fs::Permissions::from_mode(0o600)).unwrap();
    // A reaper's pattern: hold the lock, unlink the file, then release.
    let mut reaper = std::process::Command::new("flock");
    reaper.arg(&lock).args([
        "sh",
        "-c",
        "echo ready $$; read line || :; rm -f \"$0\"; echo unlinked",
        lock.to_str().unwrap(),
    ]);
    let mut reaper = Proc::spawn(reaper);
    reaper.wait_ready();

    let mut waiter = Proc::spawn(sandbox.run_sh("w", &[], "echo ready $$; read line || :"));
    waiter.wait_for(Stream::Err, WAITING);
    reaper.close_stdin();
    reaper.finish().assert_code(0);
    waiter.wait_ready();
    // The waiter now holds a lock on a file at the live path, not on the unlinked inode:
    // had it kept the old inode, the path would be gone (the reaper removed it).
    let text = std::fs::read_to_string(&lock).expect("the waiter recreated the lock file");
    assert!(text.contains("\"run_id\":\"w\""), "{text}");
    let probe = std::process::Command::new("flock")
        .args(["-n"])
        .arg(&lock)
        .arg("true")
        .status()
        .unwrap();
    assert_eq!(
        probe.code(),
        Some(1),
        "the live lock file must be held by the waiter"
    );
    waiter.close_stdin();
    let done = waiter.finish();
    done.assert_code(0);
    // The wait begun again on the live path is the same wait: said once.
    assert_eq!(
        done.err.iter().filter(|l| l.contains(WAITING)).count(),
        1,
        "{}",
        done.transcript()
    );
}

/// A run waiting for its app lock is in phase `waiting` from the moment it begins to wait, with
/// that moment in its record (`runs RUN_ID` lists it); killed while it waits, it still says so.
#[test]
fn a_waiter_s_record_says_it_waits_and_since_when_also_once_it_is_killed() {
    let sandbox = Sandbox::new();
    let mut holder = Proc::spawn(sandbox.run_sh("h", &[], "echo ready $$; read line || :"));
    holder.wait_ready();
    let mut waiter = Proc::spawn(sandbox.run_sh("w", &[], "echo must-not-run"));
    waiter.wait_for(Stream::Err, WAITING);
    let runs = |args: &[&str]| {
        let mut cmd = sandbox.ccci();
        cmd.arg("runs").args(args).arg("--json");
        let done = run(cmd);
        done.assert_code(0);
        serde_json::from_str::<serde_json::Value>(&done.out.join("\n")).unwrap()
    };
    let one = runs(&["w"]);
    assert_eq!(one["run"]["phase"], "waiting", "{one:#}");
    let phases = one["run"]["phases"].as_array().unwrap();
    let waiting = phases
        .iter()
        .find(|p| p["name"] == "waiting")
        .unwrap_or_else(|| panic!("no waiting phase: {one:#}"));
    assert!(
        waiting["at"].as_str().is_some_and(|at| at.ends_with('Z')),
        "{one:#}"
    );
    let mut table = sandbox.ccci();
    table.args(["runs", "w"]);
    let text = run(table).out.join("\n");
    assert!(text.contains("waiting"), "{text}");
    // Killed while waiting (its supervisor, as the OOM killer does): still `waiting`.
    signal(waiter.pid(), Signal::SIGKILL);
    let _ = waiter.finish();
    let one = runs(&["w"]);
    assert_eq!(one["run"]["state"], "dead", "{one:#}");
    assert_eq!(one["run"]["phase"], "waiting", "{one:#}");
    holder.close_stdin();
    holder.finish().assert_code(0);
}

#[test]
fn foreign_or_odd_lock_files_refuse_the_run_with_125() {
    let sandbox = Sandbox::new();
    let domain = sandbox.domain("custom-html", None);
    let lock = sandbox.lock_file(&domain);
    std::fs::create_dir_all(sandbox.locks()).unwrap();

    std::fs::write(&lock, "").unwrap();
    nix::unistd::chown(&lock, Some(nix::unistd::Uid::from_raw(65534)), None).unwrap();
    let done = run(sandbox.run_sh("1", &[], "echo must-not-run"));
    done.assert_code(125);
    done.assert_stderr_has(&format!(
        "refusing lock file {}: it is owned by uid 65534",
        lock.display()
    ));
    std::fs::remove_file(&lock).unwrap();

    let target = sandbox.path().join("target-file");
    std::fs::write(&target, "keep").unwrap();
    std::os::unix::fs::symlink(&target, &lock).unwrap();
    let done = run(sandbox.run_sh("2", &[], "echo must-not-run"));
    done.assert_code(125);
    done.assert_stderr_has("it is a symbolic link");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
    std::fs::remove_file(&lock).unwrap();

    std::fs::create_dir(&lock).unwrap();
    let done = run(sandbox.run_sh("3", &[], "echo must-not-run"));
    done.assert_code(125);
    done.assert_stderr_has("it is not a regular file");
}

#[test]
fn world_writable_lock_dir_without_sticky_bit_is_refused() {
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.locks()).unwrap();
    std::fs::set_permissions(sandbox.locks(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let done = run(sandbox.run_sh("1", &[], "echo must-not-run"));
    done.assert_code(125);
    done.assert_stderr_has("lets others replace lock files");
    // Sticky, like /run/lock: fine.
    std::fs::set_permissions(sandbox.locks(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    run(sandbox.run_sh("2", &[], "true")).assert_code(0);
}

#[test]
fn holder_metadata_is_written_into_the_lock_file() {
    let sandbox = Sandbox::new();
    let mut live = Proc::spawn(sandbox.run_sh("meta", &[], "echo ready $PPID; read line || :"));
    let pid = live.wait_ready();
    let domain = sandbox.domain("custom-html", None);
    let text = std::fs::read_to_string(sandbox.lock_file(&domain)).unwrap();
    let holder: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(holder["run_id"], "meta");
    assert_eq!(holder["pid"], pid);
    assert!(holder["started_at"].as_str().unwrap().ends_with('Z'));
    live.close_stdin();
    live.finish().assert_code(0);
    // The run never unlinks its own lock file; a later janitor tidies it.
    assert!(sandbox.lock_file(&domain).exists());
}

/// A run that dies while the next run of its domain is parked on the lock leaves its app after
/// that run's start sweep: the new holder clears it before its command starts, so it never
/// deploys over a dead run's leftovers.
#[test]
fn leftovers_of_a_holder_that_died_while_we_waited_are_cleared_before_our_command() {
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.abra_home().join("servers/ci")).unwrap();
    let first_script = "echo first > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\"; echo ready $$; exec sleep 1000";
    let mut first = Proc::spawn(sandbox.run_sh("a", &[], first_script));
    let command = first.wait_ready();
    let check = "if [ -e \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\" ]; then echo dirty; else echo clean; fi";
    let mut second = Proc::spawn(sandbox.run_sh("b", &[], check));
    second.wait_for(Stream::Err, WAITING);
    signal(first.pid(), Signal::SIGKILL);
    first.finish();
    let done = second.finish();
    done.assert_code(0);
    assert!(crate::util::wait_exited(command));
    done.assert_stderr_has("removed what a previous run of");
    assert_eq!(done.out, ["clean"], "{}", done.transcript());
}

/// A held app lock file deleted by hand: the next run of the domain takes a fresh lock file,
/// but still waits (visibly) for the live run — its domain lock in the runs dir — and runs
/// after it, never beside it.
#[test]
fn deleted_lock_file_never_lets_two_runs_of_a_domain_overlap() {
    let sandbox = Sandbox::new();
    let (mut holder, _env) = live_run_with_app(&sandbox);
    let domain = sandbox.domain("custom-html", None);
    std::fs::remove_file(sandbox.lock_file(&domain)).unwrap();
    let mut next = Proc::spawn(sandbox.run_sh("b", &[], "echo next-ran"));
    next.wait_for(Stream::Err, "== app lock: another run of");
    assert!(
        next.out.is_empty(),
        "the second run ran beside the live one"
    );
    holder.close_stdin();
    holder.finish().assert_code(0);
    let done = next.finish();
    done.assert_code(0);
    assert_eq!(done.out, ["next-ran"]);
}

/// The waiting line names who holds the lock: the run, its supervisor's pid, the host and
/// since when.
#[test]
fn the_waiting_line_names_the_holder() {
    let sandbox = Sandbox::new();
    let (mut holder, _env) = live_run_with_app(&sandbox);
    let mut waiter = Proc::spawn(sandbox.run_sh("b", &[], "echo b-ran"));
    let line = waiter.wait_for(Stream::Err, WAITING);
    assert!(
        line.contains(&format!("held by run a (pid {} on ", holder.pid())),
        "{line}"
    );
    holder.close_stdin();
    holder.finish().assert_code(0);
    waiter.wait_for(Stream::Out, "b-ran");
    waiter.finish().assert_code(0);
}

/// Runs of one domain handing the lock on to each other, over and over, with more arriving
/// while it changes hands: a waiter that looks while one holder has cleared its line and the
/// next has not yet written its own says who holds it once the new line is there, never that
/// a holder wrote no line (the lock has a holder that simply has not signed yet).
#[test]
fn a_lock_changing_hands_is_never_shown_as_a_holder_without_a_line() {
    let sandbox = Sandbox::new();
    let mut lines = Vec::new();
    for round in 0..6 {
        let runs: Vec<Proc> = (0..6)
            .map(|i| {
                Proc::spawn(sandbox.run_sh(
                    &format!("h{round}-{i}"),
                    &["--pr", "77"],
                    "sleep 0.0$(( $$ % 7 ))",
                ))
            })
            .collect();
        for run in runs {
            let done = run.finish();
            done.assert_code(0);
            lines.extend(done.err.clone());
        }
    }
    let waits = lines.iter().filter(|l| l.contains("held by")).count();
    assert!(waits > 0, "no run ever waited: {lines:#?}");
    let wrong: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains("wrote no holder line") || l.contains("no metadata"))
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// With Docker, the holder's teardown reaps its app and unlinks its lock file while the next
/// run waits on it: the waiter's wait begins again on the live path, and is still said once.
#[test]
fn a_hand_off_with_docker_says_the_waiting_line_once() {
    let Some(sandbox) = Sandbox::with_docker() else {
        return;
    };
    for round in 0..2 {
        let mut first =
            Proc::spawn(sandbox.run_sh(&format!("a{round}"), &[], "echo ready $$; read line || :"));
        first.wait_ready();
        let mut second = Proc::spawn(sandbox.run_sh(&format!("b{round}"), &[], "echo ready $$"));
        second.wait_for(Stream::Err, WAITING);
        first.close_stdin();
        first.finish().assert_code(0);
        second.wait_ready();
        let done = second.finish();
        done.assert_code(0);
        assert_eq!(
            done.err.iter().filter(|l| l.contains(WAITING)).count(),
            1,
            "{}",
            done.transcript()
        );
    }
}
