//! Every way out funnels into one teardown: signals, the deadline, the parent dying.

use nix::sys::signal::Signal;
use rstest::rstest;

use crate::util::{
    Proc, Sandbox, Stream, group_alive, process_alive, sh_quote, signal, wait_exited,
};

/// A command that announces itself and then waits until it is killed.
const WAIT_FOREVER: &str = "echo ready $$; exec sleep 1000";

#[rstest]
#[case::term(Signal::SIGTERM, 143)]
#[case::int(Signal::SIGINT, 130)]
#[case::hup(Signal::SIGHUP, 129)]
fn signal_tears_down_and_exits_128_plus_n(#[case] sig: Signal, #[case] code: i32) {
    let sandbox = Sandbox::new();
    let hook = sandbox.path().join("hook-ran");
    let teardown = format!("echo \"$CCCI_APP_DOMAIN\" > {}", sh_quote(&hook));
    let mut run = Proc::spawn(sandbox.run_sh("10", &["--on-teardown", &teardown], WAIT_FOREVER));
    let pgid = run.wait_ready();
    assert!(
        !sandbox.state_files().is_empty(),
        "state files exist while live"
    );
    signal(run.pid(), sig);
    let done = run.finish();
    done.assert_code(code);
    done.assert_stderr_has(&format!("== {sig} received — tearing down =="));
    assert!(!group_alive(pgid), "the command's process group survived");
    let hook_saw = std::fs::read_to_string(&hook).expect("hook ran");
    assert!(
        hook_saw.ends_with(".ci.commoninternet.net\n"),
        "hook env: {hook_saw:?}"
    );
    assert!(
        sandbox.state_files().is_empty(),
        "{:?}",
        sandbox.state_files()
    );
    let record = sandbox.record("10");
    assert_eq!(record["shutdown_reason"], sig.as_str());
    assert_eq!(record["exit_code"], code);
}

#[test]
fn second_signal_during_a_slow_teardown_is_ignored() {
    let sandbox = Sandbox::new();
    let gate = sandbox.path().join("gate");
    nix::unistd::mkfifo(&gate, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let hook = format!(
        "echo hook-started >&2; read line < {}; echo hook-done >&2",
        sh_quote(&gate)
    );
    let mut run = Proc::spawn(sandbox.run_sh("11", &["--on-teardown", &hook], WAIT_FOREVER));
    run.wait_ready();
    signal(run.pid(), Signal::SIGTERM);
    run.wait_for(Stream::Err, "hook-started");
    signal(run.pid(), Signal::SIGINT);
    run.wait_for(
        Stream::Err,
        "== SIGINT received during teardown — ignored ==",
    );
    std::fs::write(&gate, "go\n").unwrap();
    let done = run.finish();
    // The first reason decides: SIGTERM, not SIGINT, and the hook ran to its end.
    done.assert_code(143);
    done.assert_stderr_has("hook-done");
}

#[test]
fn group_that_ignores_sigterm_is_killed_after_the_grace() {
    let sandbox = Sandbox::new();
    // `read` blocks on the test's stdin pipe; when the test closes it, a sleep that inherited
    // the ignored TERM takes over: only SIGKILL ends this, whenever the pipe closes.
    let script = "trap '' TERM; echo ready $$; read line; exec sleep 100000";
    let mut run = Proc::spawn(sandbox.run_sh("12", &["--kill-grace", "0.3"], script));
    let pgid = run.wait_ready();
    signal(run.pid(), Signal::SIGTERM);
    run.wait_for(Stream::Err, "sending SIGKILL");
    let done = run.finish();
    done.assert_code(143);
    assert!(!group_alive(pgid));
    let record = sandbox.record("12");
    assert_eq!(record["killed_after_grace"], true);
    assert_eq!(record["command_status"]["kind"], "signaled");
    assert_eq!(record["command_status"]["value"], 9);
}

#[test]
fn hard_deadline_tears_down_with_142() {
    let sandbox = Sandbox::new();
    let mut run = Proc::spawn(sandbox.run_sh("13", &["--deadline", "1"], WAIT_FOREVER));
    let pgid = run.wait_ready();
    let done = run.finish();
    done.assert_code(142);
    done.assert_stderr_has("== run exceeded 1s hard deadline — tearing down ==");
    assert!(!group_alive(pgid));
    assert_eq!(sandbox.record("13")["shutdown_reason"], "deadline");
}

/// Drone's exec runner cancels a build by SIGKILL to the step shell only: the parent-death
/// signal must still bring the run down through its teardown.
#[test]
fn parent_shell_sigkilled_tears_down_through_the_parent_death_signal() {
    let sandbox = Sandbox::new();
    let hook = sandbox.path().join("hook-ran");
    let teardown = format!("touch {}", sh_quote(&hook));
    let ccci = sandbox.run_sh("14", &["--on-teardown", &teardown], WAIT_FOREVER);
    let mut shell = std::process::Command::new("sh");
    // The trailing `echo` keeps sh from exec-ing ccci-run: sh stays its parent.
    shell
        .args(["-c", "\"$0\" \"$@\"; echo shell-survived"])
        .arg(ccci.get_program())
        .args(ccci.get_args());
    let mut step = Proc::spawn(shell);
    let pgid = step.wait_ready();
    signal(step.pid(), Signal::SIGKILL);
    // Output ends once ccci-run and everything it started are gone.
    let done = step.finish();
    done.assert_stderr_has("== parent process died — tearing down ==");
    assert!(!done.out.iter().any(|l| l.contains("shell-survived")));
    assert!(!group_alive(pgid));
    assert!(
        hook.exists(),
        "teardown hook did not run\n{}",
        done.transcript()
    );
    let record = sandbox.record("14");
    assert_eq!(record["exit_code"], 143);
    assert_eq!(record["shutdown_reason"], "parent-died");
    assert!(sandbox.state_files().is_empty());
}

/// If ccci-run itself is SIGKILLed, its command dies through its own parent-death signal.
#[test]
fn command_dies_with_a_sigkilled_supervisor() {
    let sandbox = Sandbox::new();
    let mut run = Proc::spawn(sandbox.run_sh("15", &[], WAIT_FOREVER));
    let command = run.wait_ready();
    signal(run.pid(), Signal::SIGKILL);
    // The command holds our stdout; it closes when the command dies.
    let done = run.finish();
    assert_eq!(done.status.code(), None);
    assert!(
        wait_exited(command),
        "command {command} outlived its supervisor: {:?}",
        std::fs::read_to_string(format!("/proc/{command}/stat"))
    );
}

/// A descendant that left the group (setsid + fork) is still found and killed at teardown.
#[test]
fn daemonised_grandchild_is_killed_at_teardown() {
    let sandbox = Sandbox::new();
    let pidfile = sandbox.path().join("daemon.pid");
    let script = "setsid sh -c 'echo $$ > \"$PIDFILE\"; exec sleep 1000' </dev/null >/dev/null 2>&1 & \
         while [ ! -s \"$PIDFILE\" ]; do :; done; echo ready $$";
    let mut cmd = sandbox.run_sh("16", &[], script);
    cmd.env("PIDFILE", &pidfile);
    let mut run = Proc::spawn(cmd);
    run.wait_ready();
    let daemon: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let done = run.finish();
    done.assert_code(0);
    assert!(!process_alive(daemon), "daemon {daemon} survived the run");
}
