//! The lifetime guards refuse a run whose parent is already gone.

use crate::util::{Proc, Sandbox, run};

/// A run started after its parent died would never receive the parent-death signal: refused.
#[test]
fn orphaned_start_is_refused() {
    let sandbox = Sandbox::new();
    let ccci = sandbox.run_sh("20", &[], "echo command-ran");
    // The subshell waits until its parent shell is gone (re-parented to pid 1), then becomes
    // ccci-run: an orphan from its first instruction.
    let mut shell = std::process::Command::new("sh");
    shell
        .args([
            "-c",
            "parent=$$; (while kill -0 \"$parent\" 2>/dev/null; do :; done; \
             read -r _ _ _ ppid _ < /proc/self/stat; echo \"orphan-ppid $ppid\" >&2; exec \"$0\" \"$@\") & exit 0",
        ])
        .arg(ccci.get_program())
        .args(ccci.get_args());
    let mut step = Proc::spawn(shell);
    // Reap the shell so it is really gone, not a zombie the subshell still sees.
    step.child.wait().unwrap();
    let done = step.finish();
    let ppid_line = done
        .err
        .iter()
        .find(|l| l.starts_with("orphan-ppid"))
        .expect("the subshell reports its parent");
    assert_eq!(
        ppid_line, "orphan-ppid 1",
        "precondition: orphans are re-parented to pid 1 here"
    );
    done.assert_stderr_has("refusing to run: parent process is gone");
    assert!(!done.out.iter().any(|l| l == "command-ran"));
    assert!(
        !sandbox.runs().exists(),
        "an orphaned start must leave nothing on disk"
    );
}

#[test]
fn expect_parent_mismatch_is_refused_with_125() {
    let sandbox = Sandbox::new();
    let done = run(sandbox.run_sh("21", &["--expect-parent", "1"], "echo command-ran"));
    done.assert_code(125);
    done.assert_stderr_has("not the expected 1 (--expect-parent)");
    assert!(done.out.is_empty());
    assert!(!sandbox.runs().exists());
}

#[test]
fn expect_parent_match_runs() {
    let sandbox = Sandbox::new();
    let ccci = sandbox.run_sh("22", &["--expect-parent", "PARENT"], "echo command-ran");
    // Substitute the real parent: the shell's own pid, as a Drone step passes `$$`.
    let mut shell = std::process::Command::new("sh");
    shell
        .args(["-c", "for a; do [ \"$a\" = PARENT ] && a=$$; set -- \"$@\" \"$a\"; shift; done; \"$0\" \"$@\"; exit $?"])
        .arg(ccci.get_program())
        .args(ccci.get_args());
    let done = run(shell);
    done.assert_code(0);
    assert_eq!(done.out, vec!["command-ran"]);
}
