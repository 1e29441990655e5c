//! The run's exit code is the command's, and teardown runs however the command ended.

use std::os::unix::fs::PermissionsExt;

use rstest::rstest;

use crate::util::{Sandbox, run, sh_quote};

#[rstest]
#[case::success("exit 0", 0)]
#[case::failure("exit 3", 3)]
#[case::killed_by_signal("kill -9 $$", 137)]
#[case::terminated_by_signal("kill -TERM $$", 143)]
fn exit_code_is_the_command_s(#[case] script: &str, #[case] code: i32) {
    let sandbox = Sandbox::new();
    let hook = sandbox.path().join("hook-ran");
    let teardown = format!("touch {}", sh_quote(&hook));
    let done = run(sandbox.run_sh("1", &["--on-teardown", &teardown], script));
    done.assert_code(code);
    assert!(
        hook.exists(),
        "teardown hook did not run\n{}",
        done.transcript()
    );
    assert!(
        sandbox.state_files().is_empty(),
        "{:?}",
        sandbox.state_files()
    );
    let record = sandbox.record("1");
    assert_eq!(record["exit_code"], code);
    assert_eq!(record["shutdown_reason"], "command-ended");
    assert_eq!(
        record["phases"].as_array().unwrap().last().unwrap()["name"],
        "finished"
    );
}

#[test]
fn missing_command_is_127_and_still_tears_down() {
    let sandbox = Sandbox::new();
    let hook = sandbox.path().join("hook-ran");
    let mut cmd = sandbox.ccci();
    cmd.args(["run", "--recipe", "x", "--run-id", "2", "--no-fetch"])
        .args(["--on-teardown", &format!("touch {}", sh_quote(&hook))])
        .args(["--", "/nonexistent/ccci-no-such-command"]);
    let done = run(cmd);
    done.assert_code(127);
    done.assert_stderr_has("failed to execute \"/nonexistent/ccci-no-such-command\"");
    assert!(hook.exists());
    assert!(sandbox.state_files().is_empty());
    assert_eq!(sandbox.record("2")["command_status"]["value"], 127);
}

#[test]
fn non_executable_command_is_126() {
    let sandbox = Sandbox::new();
    let script = sandbox.path().join("not-executable.sh");
    std::fs::write(&script, "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut cmd = sandbox.ccci();
    cmd.args(["run", "--recipe", "x", "--run-id", "3", "--no-fetch", "--"])
        .arg(&script);
    let done = run(cmd);
    done.assert_code(126);
    done.assert_stderr_has("failed to execute");
}

#[test]
fn failing_teardown_hook_is_recorded_but_keeps_the_exit_code() {
    let sandbox = Sandbox::new();
    let done = run(sandbox.run_sh("4", &["--on-teardown", "exit 9"], "exit 5"));
    done.assert_code(5);
    done.assert_stderr_has("!! teardown: --on-teardown command failed with exit code 9");
    let errors = sandbox.record("4")["teardown_errors"].clone();
    assert_eq!(errors.as_array().unwrap().len(), 1, "{errors}");
}

/// A run starts with a line that says its bounds (deadline, kill grace, lock wait), and ends
/// with a line that says how it ended and where its record is.
#[test]
fn a_run_ends_saying_its_exit_code_and_where_its_record_is() {
    let sandbox = Sandbox::new();
    let done = run(sandbox.run_sh("closing", &[], "exit 3"));
    done.assert_code(3);
    done.assert_stderr_has("; deadline 1h, kill grace 10s, lock wait until the deadline ==");
    let done_bounded = run(sandbox.run_sh(
        "bounded",
        &[
            "--deadline",
            "90m",
            "--kill-grace",
            "2",
            "--lock-wait",
            "5m",
        ],
        "true",
    ));
    done_bounded.assert_stderr_has("; deadline 1h30m, kill grace 2s, lock wait 5m ==");
    done.assert_stderr_has(&format!(
        "== run closing: finished, exit 3; record {} ==",
        sandbox.runs().join("closing/run.json").display()
    ));
}
