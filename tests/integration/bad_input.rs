//! Rows of docs/bad-input.md that no other module covers: a full disk under the run record and an
//! unusable runs dir. Every other row names its test in the table.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use crate::util::{Sandbox, run};

/// A 16 KiB tmpfs, unmounted when dropped.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    fn mount() -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=16k", "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            crate::util::skip(
                "a tmpfs cannot be mounted here",
                "run the suite as root, where mount(8) may mount a tmpfs",
            );
            return None;
        }
        Some(Self { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Leave exactly `pages` 4 KiB pages free.
    fn fill_leaving(&self, pages: u64) {
        let data = vec![0u8; ((4 - pages) * 4096) as usize];
        std::fs::write(self.path().join("fill"), data).unwrap();
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

fn run_on(sandbox: &Sandbox, runs_dir: &Path, run_id: &str) -> crate::util::Finished {
    let mut cmd = sandbox.ccci();
    cmd.args(["--runs-dir"]).arg(runs_dir).args([
        "run",
        "--recipe",
        "x",
        "--run-id",
        run_id,
        "--no-fetch",
        "--",
        "echo",
        "must-not-run",
    ]);
    run(cmd)
}

#[test]
fn full_disk_for_the_run_record_is_125_and_leaves_no_temp_file() {
    let sandbox = Sandbox::new();
    let Some(disk) = SmallDisk::mount() else {
        return;
    };
    // Room for the run's guard lock, none for its record.
    disk.fill_leaving(1);
    let runs = disk.path().join("runs");
    let done = run_on(&sandbox, &runs, "full");
    done.assert_code(125);
    done.assert_stderr_has("failed to write run record");
    done.assert_stderr_has("No space left on device");
    assert!(done.out.is_empty(), "the command ran");
    let left = crate::util::list(&runs.join("full"));
    assert_eq!(left, ["run.lock"], "a temp file was left behind: {left:?}");
    // No room at all: the guard's metadata cannot be written either.
    std::fs::remove_dir_all(&runs).unwrap();
    disk.fill_leaving(0);
    let done = run_on(&sandbox, &runs, "full");
    done.assert_code(125);
    done.assert_stderr_has("No space left on device");
}

/// The disk fills after the run's first record write: the command does not start without a
/// durable record (125), and the record on disk stays whole at its last durable phase.
#[test]
fn full_disk_after_the_first_record_write_stops_the_run_before_its_command() {
    let sandbox = Sandbox::new();
    let Some(disk) = SmallDisk::mount() else {
        return;
    };
    // Room for the guard's metadata and one record: the next write has nowhere to go.
    disk.fill_leaving(2);
    let runs = disk.path().join("runs");
    let done = run_on(&sandbox, &runs, "later");
    done.assert_code(125);
    done.assert_stderr_has("failed to write run record");
    assert!(
        done.out.is_empty(),
        "the command ran without a durable record"
    );
    let text = std::fs::read_to_string(runs.join("later/run.json")).unwrap();
    let record: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(record["phases"][0]["name"], "guards", "{record:#}");
    assert!(sandbox.state_files().is_empty());
}

#[test]
fn unusable_runs_dir_is_125_naming_it() {
    let sandbox = Sandbox::new();
    let file = sandbox.path().join("runs-is-a-file");
    std::fs::write(&file, "").unwrap();
    let done = run_on(&sandbox, &file, "r1");
    done.assert_code(125);
    done.assert_stderr_has(&format!(
        "failed to create run directory {}/r1",
        file.display()
    ));

    let frozen = sandbox.path().join("frozen-runs");
    std::fs::create_dir(&frozen).unwrap();
    let chattr = |flag: &str| {
        assert!(
            Command::new("chattr")
                .arg(flag)
                .arg(&frozen)
                .status()
                .unwrap()
                .success()
        );
    };
    chattr("+i");
    let done = run_on(&sandbox, &frozen, "r2");
    chattr("-i");
    done.assert_code(125);
    done.assert_stderr_has("failed to create run directory");
    assert!(done.out.is_empty());
}

/// Durations no arithmetic on instants could survive are refused when parsed (exit 2, nothing
/// written): `--kill-grace=9223372036854775807` used to panic in the middle of a teardown. Every
/// duration option speaks one syntax, and a refusal names its accepted forms.
#[rstest::rstest]
#[case::kill_grace_overflow("--kill-grace=9223372036854775807", "too long: at most 365d")]
#[case::kill_grace_nan("--kill-grace=NaN", "or a number with units (90s, 5m, 1h30m, 14d)")]
#[case::teardown_timeout_zero("--teardown-timeout=0", "too short: at least 1s")]
#[case::teardown_timeout_huge("--teardown-timeout=1e30", "is not a duration")]
#[case::lock_wait_huge("--lock-wait=99999999999", "too long")]
#[case::deadline_huge("--deadline=99999999999", "--deadline")]
#[case::deadline_unit(
    "--deadline=5x",
    "is not a duration: \"x\" is not a unit; write seconds (90, 1.5)"
)]
#[case::deadline_month(
    "--deadline=1M",
    "months are not a unit (1M would be read as 30d 10h 33m 36s): write 1m for a minute, or days (30d)"
)]
#[case::kill_grace_word_unit(
    "--kill-grace=90min",
    "\"min\" is not a unit; write seconds (90, 1.5) or a number with units (90s, 5m, 1h30m, 14d): the units are ms, s, m, h, d and w"
)]
#[case::lock_wait_years("--lock-wait=1y", "years are not a unit: write days (365d)")]
#[case::deadline_negative("--deadline=-5m", "is not a duration")]
#[case::deadline_empty("--deadline=", "an empty value is not a duration")]
#[case::deadline_zero("--deadline=0s", "too short: at least 1s")]
#[case::kill_grace_words("--kill-grace=soon", "is not a duration")]
fn absurd_durations_are_refused_at_parse_time(#[case] flag: &str, #[case] message: &str) {
    let sandbox = Sandbox::new();
    let done = run(sandbox.run_sh("absurd", &[flag], "echo command-ran"));
    done.assert_code(2);
    done.assert_stderr_has(message);
    assert!(done.out.is_empty());
    assert!(!sandbox.runs().exists(), "nothing may be written");
}

/// The forms operators write elsewhere (`timeout 5m`, `TimeoutStopSec=90s`) are accepted by
/// every duration option, fractions of seconds too; the run's record shows what was meant.
#[test]
fn durations_with_units_and_fractions_are_accepted_everywhere() {
    let sandbox = Sandbox::new();
    let done = run(sandbox.run_sh(
        "units",
        &[
            "--deadline",
            "5m",
            "--kill-grace",
            "1.5",
            "--teardown-timeout",
            "90s",
            "--lock-wait",
            "1h30m",
        ],
        "echo command-ran",
    ));
    done.assert_code(0);
    let mut cmd = sandbox.ccci();
    cmd.args([
        "janitor",
        "--long-held",
        "2h",
        "--reap-budget",
        "2m",
        "--keep-runs",
        "14d",
    ]);
    run(cmd).assert_code(0);
    let mut cmd = sandbox.ccci();
    cmd.args(["locks", "--long-held", "90m"]);
    run(cmd).assert_code(0);
}

/// `--keep-runs` is bounded too, and a bare number (which used to mean days) is refused rather
/// than read as seconds: `--keep-runs 14` never deletes every run directory older than 14 s.
/// Under an hour is refused: `--keep-runs 0d` would remove a run's directory as it finishes.
#[rstest::rstest]
#[case::overflow("18446744073709551615", "has no unit")]
#[case::bare("14", "14d")]
#[case::past_a_century("36501d", "too long")]
#[case::nothing("0d", "too short: at least 1h")]
#[case::minutes("59m", "too short: at least 1h")]
fn absurd_retention_is_refused_at_parse_time(#[case] value: &str, #[case] message: &str) {
    let sandbox = Sandbox::new();
    let mut cmd = sandbox.ccci();
    cmd.args(["janitor", "--keep-runs", value]);
    let done = run(cmd);
    done.assert_code(2);
    done.assert_stderr_has("--keep-runs");
    done.assert_stderr_has(message);
}

/// A run setting from the environment or the file is checked like the flag, and the error
/// names where the bad value came from.
#[rstest::rstest]
#[case::env_unit("CCCI_DEADLINE", "5x", "CCCI_DEADLINE")]
#[case::env_empty("CCCI_KILL_GRACE", "", "CCCI_KILL_GRACE")]
#[case::env_keep_bare("CCCI_KEEP_RUNS", "14", "14d")]
fn a_bad_run_setting_in_the_environment_is_refused_naming_it(
    #[case] var: &str,
    #[case] value: &str,
    #[case] message: &str,
) {
    let sandbox = Sandbox::new();
    let mut cmd = sandbox.run_sh("envbad", &[], "echo command-ran");
    cmd.env(var, value);
    let done = run(cmd);
    done.assert_code(2);
    done.assert_stderr_has(message);
    assert!(done.out.is_empty());
}

/// `ccci-run ARGS` with this sandbox's directories and stdout on `stdout`.
fn with_stdout(
    sandbox: &Sandbox,
    args: &[&str],
    stdout: std::process::Stdio,
) -> std::process::Output {
    let mut cmd = sandbox.ccci();
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .stdout(stdout)
        .stderr(std::process::Stdio::piped());
    cmd.output().unwrap()
}

/// Every subcommand that prints, against a stdout whose reader is already gone (`| head -c0`)
/// and against a full disk (`> /dev/full`): a closed pipe ends quietly, a write error is a
/// clear error with exit 1 — never a panic (exit 101).
#[rstest::rstest]
#[case::locks(&["locks"])]
#[case::locks_json(&["locks", "--json"])]
#[case::app_domain(&["app-domain", "--recipe", "custom-html"])]
#[case::janitor(&["janitor"])]
#[case::janitor_json(&["janitor", "--json"])]
#[case::completions(&["completions", "bash"])]
#[case::man(&["man"])]
fn closed_or_full_stdout_is_never_a_panic(#[case] args: &[&str]) {
    let sandbox = Sandbox::new();
    // A pipe whose read end is closed before the process starts: every write gets EPIPE.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let closed = with_stdout(&sandbox, args, writer.into());
    let stderr = String::from_utf8_lossy(&closed.stderr);
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert_eq!(
        closed.status.code(),
        Some(0),
        "{args:?} into a closed pipe: {stderr}"
    );

    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let done = with_stdout(&sandbox, args, full.into());
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    assert_eq!(
        done.status.code(),
        Some(1),
        "{args:?} into /dev/full: {stderr}"
    );
    assert!(stderr.contains("failed to write to stdout"), "{stderr}");
}

/// Names planted in a world-writable lock dir reach the operator's terminal only escaped: no
/// escape sequence, no raw newline, and a name that is not UTF-8 is shown, not dropped.
#[test]
fn planted_lock_file_names_are_escaped_in_every_listing() {
    use std::os::unix::ffi::OsStrExt;
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.locks()).unwrap();
    for name in [
        &b"cc-ci-app-\x1b[31mevil\nline.lock"[..],
        &b"ccci-bad\xffname.lock"[..],
    ] {
        std::fs::write(sandbox.locks().join(std::ffi::OsStr::from_bytes(name)), "").unwrap();
    }
    let mut cmd = sandbox.ccci();
    cmd.arg("locks");
    let table = run(cmd);
    table.assert_code(0);
    let text = table.out.join("\n");
    assert!(!text.contains('\x1b'), "{text:?}");
    assert_eq!(
        table.out.len(),
        3,
        "one header and one line per file, no raw newline: {text:?}"
    );
    assert!(text.contains("\\u{1b}[31mevil\\nline"), "{text}");
    assert!(text.contains("bad\\xffname"), "{text}");
    let mut cmd = sandbox.ccci();
    cmd.args(["locks", "--json"]);
    let json = run(cmd);
    json.assert_code(0);
    let listed: serde_json::Value =
        serde_json::from_str::<serde_json::Value>(&json.out.join("\n")).unwrap()["locks"].clone();
    assert_eq!(listed.as_array().unwrap().len(), 2, "{listed:#}");
}

/// A hard link planted as an app lock file (a world-writable lock dir, fs.protected_hardlinks
/// off) is refused like a symlink: 125 for a run, `foreign` for the janitor, and the file it
/// points at is never written through.
#[test]
fn hard_linked_lock_file_is_refused_and_never_written_through() {
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.locks()).unwrap();
    let victim = sandbox.path().join("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    let domain = sandbox.domain("custom-html", None);
    std::fs::hard_link(&victim, sandbox.lock_file(&domain)).unwrap();
    let done = run(sandbox.run_sh("hl", &[], "echo command-ran"));
    done.assert_code(125);
    done.assert_stderr_has("hard links");
    assert!(!done.out.iter().any(|l| l == "command-ran"));
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    sandbox.plant_env("ci", &domain, "X=1\n");
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert_eq!(
        crate::util::candidate(&report, &domain)["decision"],
        "foreign",
        "{report:#}"
    );
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
}

/// `<runs-dir>/<run-id>` planted as a symlink: refused (125), nothing deleted or written under
/// the link's target.
#[test]
fn symlinked_run_dir_is_refused_and_its_target_untouched() {
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.runs()).unwrap();
    let target = sandbox.path().join("target");
    std::fs::create_dir_all(target.join("abra")).unwrap();
    std::fs::write(target.join("abra/keep"), "mine\n").unwrap();
    std::os::unix::fs::symlink(&target, sandbox.runs().join("sl")).unwrap();
    let done = run(sandbox.run_sh("sl", &[], "echo command-ran"));
    done.assert_code(125);
    done.assert_stderr_has("refusing run directory");
    done.assert_stderr_has("symbolic link");
    assert_eq!(
        std::fs::read_to_string(target.join("abra/keep")).unwrap(),
        "mine\n"
    );
    assert!(!target.join("run.json").exists() && !target.join("run.lock").exists());
}

/// The janitor tidies only its own state files: another user's file with a state-file name
/// stays; a state dir that is a regular file is a clear error (exit 1), not silence.
#[test]
fn state_files_of_others_stay_and_an_unusable_state_dir_is_an_error() {
    let sandbox = Sandbox::new();
    // Named as our own configuration's would be: only the owner tells it apart.
    let theirs = sandbox
        .state()
        .join(format!("ccci-deploys-{}-someone-4242", sandbox.scope()));
    std::fs::write(&theirs, "").unwrap();
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    let (_, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert!(theirs.exists(), "another user's file was removed");

    let file = sandbox.path().join("not-a-dir");
    std::fs::write(&file, "").unwrap();
    let mut cmd = sandbox.ccci();
    cmd.arg("--state-dir")
        .arg(&file)
        .args(["janitor", "--json"]);
    let done = run(cmd);
    done.assert_code(1);
    assert!(
        done.out.join("\n").contains("failed to list state dir"),
        "{}",
        done.transcript()
    );
}

/// Small things that must just work: CCCI_SKIP_FETCH=0/false/empty beside `--no-fetch` is no
/// usage error, and `--pr 00001` is PR 1 (same domain, so the two serialise).
#[test]
fn skip_fetch_env_and_padded_pr_numbers_are_understood() {
    let sandbox = Sandbox::new();
    for value in ["0", "false", "", "1"] {
        let mut cmd = sandbox.run_sh(&format!("sf{}", value.len()), &[], "true");
        cmd.env("CCCI_SKIP_FETCH", value);
        run(cmd).assert_code(0);
    }
    let mut cmd = sandbox.run_sh("sfbad", &[], "true");
    cmd.env("CCCI_SKIP_FETCH", "maybe");
    let done = run(cmd);
    done.assert_code(2);
    done.assert_stderr_has("invalid CCCI_SKIP_FETCH \"maybe\"");
    assert_eq!(
        sandbox.domain("custom-html", Some("00001")),
        sandbox.domain("custom-html", Some("1"))
    );
}

/// A runs dir others can write to without the sticky bit would let them swap a run's directory
/// for a link after we looked: refused (125), naming the option.
#[test]
fn runs_dir_writable_by_others_without_sticky_bit_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.runs()).unwrap();
    std::fs::set_permissions(sandbox.runs(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let done = run(sandbox.run_sh("ww", &[], "echo command-ran"));
    done.assert_code(125);
    done.assert_stderr_has("lets others replace run directories (--runs-dir, CCCI_RUNS_DIR)");
    std::fs::set_permissions(sandbox.runs(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    run(sandbox.run_sh("ww", &[], "true")).assert_code(0);
}

/// As an unprivileged user on a host set up by root: a root-owned 0755 lock dir (NixOS's
/// `/run/lock`) and runs dir refuse us, and the error names the option that sets each path. With
/// `HOME` unset, the abra home is the user's own, not root's.
#[test]
fn an_unprivileged_user_is_told_which_option_names_the_path() {
    let sandbox = Sandbox::new();
    let root_only = sandbox.path().join("root-only");
    std::fs::create_dir(&root_only).unwrap();
    std::fs::set_permissions(sandbox.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&root_only, std::fs::Permissions::from_mode(0o755)).unwrap();
    let as_nobody = |args: &[&str]| {
        let mut cmd = Command::new("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(crate::util::BIN)
            .env("CCCI_CONFIG", "/dev/null")
            .env_remove("HOME")
            .args(args);
        run(cmd)
    };
    let dir = |name: &str| root_only.join(name).display().to_string();

    let done = as_nobody(&[
        "--runs-dir",
        &dir("runs"),
        "--lock-dir",
        &dir("locks"),
        "--state-dir",
        "/tmp",
        "--docker",
        "off",
        "run",
        "--recipe",
        "custom-html",
        "--no-fetch",
        "--",
        "true",
    ]);
    done.assert_code(125);
    done.assert_stderr_has("(the directory is set by --runs-dir / CCCI_RUNS_DIR)");

    let done = as_nobody(&["--lock-dir", &dir("locks"), "lock", "x", "--", "true"]);
    done.assert_code(125);
    done.assert_stderr_has("(the directory is set by --lock-dir / CCCI_APP_LOCK_DIR)");

    let done = as_nobody(&["config"]);
    done.assert_code(0);
    assert!(
        done.out
            .iter()
            .any(|l| l.starts_with("abra_home") && l.contains("/nonexistent/.abra")),
        "nobody's home (/nonexistent), not root's: {}",
        done.transcript()
    );
}

/// Every line of stderr parsed as JSON; panics (with the transcript) on a line that is not.
fn json_lines(done: &crate::util::Finished) -> Vec<serde_json::Value> {
    done.err
        .iter()
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}\n{}", done.transcript()))
        })
        .collect()
}

/// The one error event a refused command line or configuration leaves in JSON mode: the
/// shape of every other event (timestamp, level, fields), with the kind and the exit code.
#[track_caller]
fn assert_one_json_error(done: &crate::util::Finished, kind: &str, needle: &str) -> String {
    done.assert_code(2);
    assert!(done.out.is_empty(), "{}", done.transcript());
    let events = json_lines(done);
    assert_eq!(events.len(), 1, "{}", done.transcript());
    let event = &events[0];
    assert_eq!(event["level"], "ERROR", "{event}");
    assert!(event["timestamp"].is_string(), "{event}");
    assert_eq!(event["fields"]["status"], true, "{event}");
    assert_eq!(event["fields"]["kind"], kind, "{event}");
    assert_eq!(event["fields"]["exit_code"], 2, "{event}");
    let message = event["fields"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains(needle), "{message}");
    message
}

/// A bad command line under `--log-format json` was clap's plain text, whatever the format
/// asked for: now it is one JSON event, whether the format comes before the bad argument,
/// after it, from the environment or from the configuration file.
#[rstest::rstest]
#[case::flag_before(&["--log-format", "json", "janitor", "--bogus"], None, false)]
#[case::flag_after(&["janitor", "--bogus", "--log-format=json"], None, false)]
#[case::environment(&["janitor", "--bogus"], Some("json"), false)]
#[case::file(&["janitor", "--bogus"], None, true)]
fn command_line_errors_follow_log_format_json(
    #[case] args: &[&str],
    #[case] env: Option<&str>,
    #[case] file: bool,
) {
    let sandbox = Sandbox::new();
    let mut cmd = sandbox.ccci();
    if let Some(format) = env {
        cmd.env("CCCI_LOG_FORMAT", format);
    }
    if file {
        let config = sandbox.path().join("config.toml");
        std::fs::write(&config, "log_format = \"json\"\n").unwrap();
        cmd.env("CCCI_CONFIG", &config);
    }
    cmd.args(args);
    let done = run(cmd);
    let message = assert_one_json_error(&done, "unknown-argument", "unexpected argument '--bogus'");
    assert!(message.contains("Usage: ccci-run janitor"), "{message}");
}

/// Without JSON asked for, clap's text stays text, under the one prefix of every error
/// (`ccci-run: error:`); `--help` is help, on stdout, exit 0.
#[test]
fn command_line_errors_stay_text_unless_json_is_asked_for() {
    let sandbox = Sandbox::new();
    let mut cmd = sandbox.ccci();
    cmd.args(["janitor", "--bogus"]);
    let done = run(cmd);
    done.assert_code(2);
    assert!(
        done.err[0].starts_with("ccci-run: error: unexpected argument '--bogus'"),
        "{}",
        done.transcript()
    );
    let mut cmd = sandbox.ccci();
    cmd.args(["--log-format", "json", "janitor", "--help"]);
    let done = run(cmd);
    done.assert_code(0);
    assert!(done.err.is_empty(), "{}", done.transcript());
    assert!(
        done.out[0].contains("Probe every run app's lock"),
        "{}",
        done.transcript()
    );
}

/// A mistyped key in the configuration file: the parser's snippet stays on its own lines, the
/// nearest key is named; under JSON (flag or environment) it is one event whose message holds
/// the same lines.
#[test]
fn a_configuration_file_error_keeps_its_snippet_names_the_key_and_follows_json() {
    let sandbox = Sandbox::new();
    let config = sandbox.path().join("config.toml");
    std::fs::write(&config, "docker = \"off\"\nrun_dir = \"/srv/runs\"\n").unwrap();
    let text = |extra: &[&str], env: Option<&str>| {
        let mut cmd = sandbox.ccci();
        cmd.env("CCCI_CONFIG", &config);
        if let Some(format) = env {
            cmd.env("CCCI_LOG_FORMAT", format);
        }
        cmd.args(extra).arg("config");
        run(cmd)
    };
    let done = text(&[], None);
    done.assert_code(2);
    let lines = [
        "  |",
        "2 | run_dir = \"/srv/runs\"",
        "  | ^^^^^^^",
        "did you mean `runs_dir`?",
    ];
    for line in lines {
        assert!(
            done.err.iter().any(|l| l == line),
            "no line {line:?}\n{}",
            done.transcript()
        );
    }
    done.assert_stderr_has(&format!(
        "ccci-run: error: invalid configuration file \"{}\": TOML parse error at line 2, column 1",
        config.display()
    ));
    done.assert_stderr_has("unknown field `run_dir`, expected one of `lock_dir`");
    for done in [
        text(&["--log-format", "json"], None),
        text(&[], Some("json")),
    ] {
        let message = assert_one_json_error(&done, "invalid-input", "did you mean `runs_dir`?");
        for line in lines {
            assert!(message.lines().any(|l| l == line), "{line:?}: {message}");
        }
    }
}

/// A file that parses but holds a bad value says so in the format the file itself asks for.
#[test]
fn a_bad_value_in_a_json_configuration_file_is_reported_as_json() {
    let sandbox = Sandbox::new();
    let config = sandbox.path().join("config.toml");
    std::fs::write(&config, "log_format = \"json\"\ndeadline = \"5x\"\n").unwrap();
    let mut cmd = sandbox.ccci();
    cmd.env("CCCI_CONFIG", &config).arg("config");
    assert_one_json_error(&run(cmd), "invalid-input", "invalid deadline \"5x\"");
}

/// A lease TTL too short for the kill grace could let a holder cut off from etcd still be
/// stopping its command when etcd hands the lock to another host: `run` and `lock` refuse it
/// with 2 before anything runs, naming the smallest TTL that works and the longest kill grace
/// the TTL allows; one that fits (TTL = grace + 4 s) passes the check.
#[test]
fn a_lease_ttl_too_short_for_the_kill_grace_is_refused_naming_the_smallest_that_works() {
    let sandbox = Sandbox::new();
    // Nothing listens there: a refusal must come before any attempt to reach it.
    let etcd = ["--etcd-endpoints", "http://127.0.0.1:9", "--lease-ttl", "5"];
    let run_cmd = |grace: &str| {
        let mut cmd = sandbox.ccci();
        cmd.args(etcd).args([
            "run",
            "--recipe",
            "custom-html",
            "--run-id",
            "ttl",
            "--no-fetch",
            "--kill-grace",
            grace,
            "--",
            "true",
        ]);
        run(cmd)
    };
    let refused = run_cmd("4");
    refused.assert_code(2);
    refused.assert_stderr_has("invalid lease TTL \"5s\"");
    refused.assert_stderr_has("the smallest lease TTL that works is 8 s");
    refused.assert_stderr_has("a kill grace of at most 1s");
    assert!(
        !sandbox.runs().join("ttl").exists(),
        "{}",
        refused.transcript()
    );

    let mut lock = sandbox.ccci();
    lock.env("CCCI_KILL_GRACE", "10s")
        .args(etcd)
        .args(["lock", "cache", "--", "true"]);
    let refused = run(lock);
    refused.assert_code(2);
    refused.assert_stderr_has("the smallest lease TTL that works is 14 s");

    // Grace + 4 s fits: the run goes on past the check (and fails only at the endpoint, or in
    // a build without etcd at the missing backend, both with their own codes).
    let fits = run_cmd("1");
    assert!(
        !fits.stderr().contains("invalid lease TTL"),
        "{}",
        fits.transcript()
    );
}

/// A configured lock, runs or state dir whose parent is missing (`--lock-dir /nonexistent/locks`,
/// a typo) is refused by every command that keeps or reads it, with one exit code (2) and one
/// message naming the setting, and nothing is made: `run` and `lock` once made `/nonexistent`
/// and all, while `locks` said it did not exist and exited 0. A missing dir whose parent exists
/// is made, one level, by the commands that keep something there, and read as empty, in one
/// line, by those that only look.
#[test]
fn a_missing_dir_is_refused_alike_by_every_command_and_only_made_where_its_parent_is() {
    let sandbox = Sandbox::new();
    let base = sandbox.path().join("nonexistent");
    let commands: [&[&str]; 7] = [
        &[
            "run",
            "--recipe",
            "custom-html",
            "--no-fetch",
            "--",
            "echo",
            "command-ran",
        ],
        &["lock", "x", "--", "echo", "command-ran"],
        &["locks"],
        &["runs"],
        &["stop", "r1"],
        &["janitor"],
        &["janitor", "--dry-run"],
    ];
    let settings = [
        (
            "--lock-dir",
            "lock dir",
            "--lock-dir, CCCI_APP_LOCK_DIR, lock_dir",
        ),
        (
            "--runs-dir",
            "runs dir",
            "--runs-dir, CCCI_RUNS_DIR, runs_dir",
        ),
        (
            "--state-dir",
            "state dir",
            "--state-dir, CCCI_STATE_DIR, state_dir",
        ),
    ];
    // Which command keeps or reads which dir: the others never look at it.
    let uses = |flag: &str, command: &str| match flag {
        "--lock-dir" => ["run", "lock", "locks", "janitor"].contains(&command),
        "--runs-dir" => ["run", "lock", "runs", "stop", "janitor"].contains(&command),
        _ => ["run", "janitor"].contains(&command),
    };
    for (flag, kind, sources) in settings {
        let dir = base.join("dir");
        for command in commands {
            if !uses(flag, command[0]) {
                continue;
            }
            let mut cmd = sandbox.ccci();
            cmd.arg(flag).arg(&dir).args(command);
            let done = run(cmd);
            done.assert_code(2);
            done.assert_stderr_has(&format!(
                "ccci-run: error: {kind} {} ({sources}) does not exist, nor does its parent {}: \
                 ccci-run makes a missing {kind} only in a directory that exists; create it \
                 (mkdir -p {}), or set the {kind} this host uses",
                dir.display(),
                base.display(),
                dir.display()
            ));
            assert!(!done.out.join("\n").contains("command-ran"));
            assert!(!base.exists(), "{command:?} made {}", base.display());
        }
        // Its parent there: made by those that keep something in it, looked at by the others.
        let dir = sandbox
            .path()
            .join(format!("fresh{}", flag.trim_start_matches('-')));
        for command in commands {
            if !uses(flag, command[0]) {
                continue;
            }
            let mut cmd = sandbox.ccci();
            cmd.arg(flag).arg(&dir).args(command);
            let done = run(cmd);
            let makes = matches!(
                (flag, command),
                (_, ["run", ..])
                    | ("--lock-dir" | "--runs-dir", ["lock", ..])
                    | ("--lock-dir", ["janitor"])
            );
            assert_eq!(dir.is_dir(), makes, "{command:?} {}", done.transcript());
            if makes {
                done.assert_code(0);
                std::fs::remove_dir_all(&dir).unwrap();
            } else {
                done.assert_code(if command[0] == "stop" { 1 } else { 0 });
                done.assert_stderr_has(&format!(
                    "{kind} {} ({sources}) does not exist: nothing there yet",
                    dir.display()
                ));
            }
        }
    }
}

/// Every error ccci-run ends with starts `ccci-run: error:`, clap's (a bad command line, a bad
/// value) as well as its own; a negative `--wait` is a value that is no duration, never an
/// argument to put after `--` (which would make `-1` the run id).
#[test]
fn every_error_has_one_prefix_and_a_negative_wait_is_no_duration() {
    let sandbox = Sandbox::new();
    for (args, first) in [
        (
            &["janitor", "--bogus"][..],
            "ccci-run: error: unexpected argument '--bogus' found",
        ),
        (
            &["stop", "r1", "--wait", "-1"],
            "ccci-run: error: invalid value '-1' for '--wait <DURATION>': \"-1\" is not a \
             duration: a duration is never negative; write seconds (90, 1.5)",
        ),
        (
            &["stop", "--wait", "-1", "r1"],
            "ccci-run: error: invalid value '-1' for '--wait <DURATION>'",
        ),
        (
            &["lock", "x", "-w", "-5m", "--", "true"],
            "ccci-run: error: invalid value '-5m' for '--wait <DURATION>'",
        ),
        (
            &["--deadline", "5x"][..],
            "ccci-run: error: invalid value '5x' for '--deadline",
        ),
        (
            &["stop", "../1"],
            "ccci-run: error: invalid run id \"../1\"",
        ),
    ] {
        let mut cmd = sandbox.ccci();
        if args[0] == "--deadline" {
            cmd.args(["run", "--recipe", "r"])
                .args(args)
                .args(["--", "true"]);
        } else {
            cmd.args(args);
        }
        let done = run(cmd);
        done.assert_code(2);
        assert!(
            done.err[0].starts_with(first),
            "{args:?}\n{}",
            done.transcript()
        );
        assert!(!done.stderr().contains("'-- -"), "{}", done.transcript());
    }
}
