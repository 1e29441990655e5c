//! Nothing of another user's steers or stops a build: the default state dir is the runs' user's
//! own (never a directory others may write to), a lock's last-wait record and the janitor's
//! metrics file are believed and written only when they are ours, and a time they carry is
//! believed only when it can have been.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::Command;

use crate::util::{BIN, Sandbox, run};

const OTHER: u32 = 65534;

/// Left without `--state-dir`, a run keeps its state files in `<runs-dir>/.state`, a directory
/// of its own user's, mode 0700: a flood of files in `/tmp` (another user's) cannot touch it.
#[test]
fn the_default_state_dir_is_the_runs_users_own_beside_its_runs() {
    let sandbox = Sandbox::new();
    let state = sandbox.runs().join(".state");
    let mut cmd = Command::new(BIN);
    cmd.env("CCCI_CONFIG", "/dev/null")
        .env_remove("CCCI_STATE_DIR")
        .arg("--runs-dir")
        .arg(sandbox.runs())
        .arg("--abra-home")
        .arg(sandbox.abra_home())
        .arg("--lock-dir")
        .arg(sandbox.locks())
        .args(["--docker", "off"]);
    let mut config = Command::new(cmd.get_program());
    config
        .args(cmd.get_args())
        .env("CCCI_CONFIG", "/dev/null")
        .env_remove("CCCI_STATE_DIR")
        .args(["config", "--json"]);
    let shown = run(config);
    shown.assert_code(0);
    assert!(
        shown
            .out
            .join("\n")
            .contains(&format!("\"{}\"", state.display())),
        "{}",
        shown.transcript()
    );
    cmd.args([
        "run",
        "--recipe",
        "custom-html",
        "--run-id",
        "st",
        "--no-fetch",
        "--",
        "sh",
        "-c",
    ])
    .arg(format!("ls {}", crate::util::sh_quote(&state)));
    let done = run(cmd);
    done.assert_code(0);
    assert!(
        done.out.iter().any(|l| l.starts_with("ccci-")),
        "no state file in {}\n{}",
        state.display(),
        done.transcript()
    );
    let meta = std::fs::metadata(&state).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o700);
    assert_eq!(meta.uid(), nix::unistd::Uid::effective().as_raw());
}

/// Another user's last-wait record (mode 0666, in a lock dir everyone may write to) is never
/// written into: the lock's command runs, the file says what it said. Our own is replaced whole.
#[test]
fn another_user_s_last_wait_record_is_never_written_into() {
    if !crate::util::is_root_or_skip("run the suite as root to make another user's file") {
        return;
    }
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.locks()).unwrap();
    std::fs::set_permissions(sandbox.locks(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let record = sandbox.locks().join("ccci-steer.lock.last-wait");
    std::fs::write(&record, "theirs\n").unwrap();
    std::os::unix::fs::chown(&record, Some(OTHER), Some(OTHER)).unwrap();
    std::fs::set_permissions(&record, std::fs::Permissions::from_mode(0o666)).unwrap();
    let lock = || {
        let mut cmd = sandbox.ccci();
        cmd.args(["lock", "steer", "--", "true"]);
        run(cmd)
    };
    lock().assert_code(0);
    assert_eq!(std::fs::read_to_string(&record).unwrap(), "theirs\n");
    assert_eq!(std::fs::metadata(&record).unwrap().uid(), OTHER);

    std::fs::remove_file(&record).unwrap();
    std::fs::write(&record, "0.5\n").unwrap();
    lock().assert_code(0);
    let ours = std::fs::read_to_string(&record).unwrap();
    assert!(
        ours.trim().parse::<f64>().is_ok_and(|w| w < 0.5),
        "{ours:?}"
    );
}

/// A failed sweep carries the last success time forward from the previous metrics file only
/// when that file is ours and the time can have been: never NaN, an infinity, a time to come,
/// nor what another user's file says.
#[rstest::rstest]
#[case::nan("NaN", false)]
#[case::infinite("+Inf", false)]
#[case::year_2100("4102444800", false)]
#[case::another_user_s("1700000000", true)]
fn a_failed_sweep_carries_no_last_success_time_it_cannot_have_had(
    #[case] planted: &str,
    #[case] theirs: bool,
) {
    if theirs && !crate::util::is_root_or_skip("run the suite as root to make another user's file")
    {
        return;
    }
    let sandbox = Sandbox::new();
    let metrics = sandbox.path().join("ccci.prom");
    std::fs::write(
        &metrics,
        format!("ccci_janitor_last_success_timestamp_seconds {planted}\n"),
    )
    .unwrap();
    if theirs {
        std::os::unix::fs::chown(&metrics, Some(OTHER), Some(OTHER)).unwrap();
    }
    // A failed sweep: a state dir that is a regular file.
    let file = sandbox.path().join("not-a-dir");
    std::fs::write(&file, "").unwrap();
    let mut cmd = sandbox.ccci();
    cmd.arg("--state-dir")
        .arg(&file)
        .args(["janitor", "--metrics-file"])
        .arg(&metrics);
    let done = run(cmd);
    done.assert_code(1);
    let written = std::fs::read_to_string(&metrics).unwrap();
    assert!(
        !written.contains(planted),
        "carried {planted:?} forward:\n{written}"
    );
    assert!(written.contains("ccci_janitor_sweep_failed 1"), "{written}");
}
