//! `janitor --keep-runs` on a runs dir that holds more than run directories: what is not provably
//! a run directory of ours is reported and left exactly as it was, and a runs dir that is a
//! system directory is refused before anything looks in it.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::util::{BIN, Sandbox, age, run};

const OLD: Duration = Duration::from_secs(20 * 86_400);

/// Every path under `dir` (itself included) with its contents, owner and mode: a fingerprint
/// that any write, removal or new file changes.
fn fingerprint(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(path) = stack.pop() {
        let meta = std::fs::symlink_metadata(&path).unwrap();
        let contents = if meta.is_file() {
            std::fs::read_to_string(&path).unwrap_or_default()
        } else {
            String::new()
        };
        out.push(format!(
            "{} {:o} {} {contents}",
            path.display(),
            meta.mode(),
            meta.uid()
        ));
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path).unwrap() {
                stack.push(entry.unwrap().path());
            }
        }
    }
    out.sort();
    out
}

/// The reason `report` gives for leaving `path` alone.
fn why_kept(report: &Value, path: &Path) -> String {
    report["runs_kept"]
        .as_array()
        .unwrap_or_else(|| panic!("no runs_kept in {report:#}"))
        .iter()
        .find(|k| k["path"] == path.display().to_string())
        .unwrap_or_else(|| panic!("{} not reported as kept in {report:#}", path.display()))["why"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// A `runs_dir` that is a typo for `/var/lib` (`etc/`, `usr/`, `var/`, `home/` beside the runs),
/// shared and sticky, where another user ran too. Before, every directory named like a run id
/// was taken for a run's, got a `run.lock` written into it and was removed, and root removed
/// another user's `myproject/`. Now only the old finished run of ours goes; every other entry is
/// reported with its reason, byte for byte as it was, and without a `run.lock` of ours.
#[test]
fn foreign_directories_in_the_runs_dir_are_reported_and_never_touched() {
    let sandbox = Sandbox::new();
    let runs = sandbox.runs();
    std::fs::create_dir_all(&runs).unwrap();
    // A runs dir shared with another user: sticky and writable by all, as `run` accepts.
    std::fs::set_permissions(sandbox.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&runs, std::fs::Permissions::from_mode(0o1777)).unwrap();

    // Another user's genuine run, made in a runs dir of its own and moved into ours (the
    // `.domains/` of a runs dir serves one user).
    let theirs = sandbox.path().join("nobody");
    std::fs::create_dir(&theirs).unwrap();
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(BIN)
        .env("CCCI_CONFIG", "/dev/null")
        .arg("--runs-dir")
        .arg(theirs.join("runs"))
        .arg("--lock-dir")
        .arg(theirs.join("locks"))
        .arg("--state-dir")
        .arg(theirs.join("state"))
        .arg("--abra-home")
        .arg(theirs.join("abra"))
        .args([
            "--docker",
            "off",
            "--cgroup",
            "off",
            "run",
            "--recipe",
            "custom-html",
            "--pr",
            "77",
        ])
        .args(["--run-id", "their-run", "--no-fetch", "--", "true"]);
    run(cmd).assert_code(0);
    std::fs::rename(theirs.join("runs/their-run"), runs.join("their-run")).unwrap();
    assert_eq!(
        std::fs::metadata(runs.join("their-run/run.lock"))
            .unwrap()
            .uid(),
        65534
    );
    age(&runs.join("their-run/run.json"), OLD);
    // Ours: an old finished run (removed) and a fresh one (kept silently).
    run(sandbox.run_sh("old", &[], "true")).assert_code(0);
    run(sandbox.run_sh("recent", &[], "true")).assert_code(0);
    age(&runs.join("old/run.json"), OLD);
    // Ours, but moved: its record names "donor", not the directory's name.
    run(sandbox.run_sh("donor", &[], "true")).assert_code(0);
    std::fs::rename(runs.join("donor"), runs.join("renamed")).unwrap();
    age(&runs.join("renamed/run.json"), OLD);

    let myproject = runs.join("myproject");
    std::fs::create_dir(&myproject).unwrap();
    std::fs::write(myproject.join("notes.txt"), "theirs\n").unwrap();
    std::os::unix::fs::chown(myproject.join("notes.txt"), Some(65534), Some(65534)).unwrap();
    std::os::unix::fs::chown(&myproject, Some(65534), Some(65534)).unwrap();

    // What a typo for /var/lib finds: system-looking trees, named like run ids.
    for (dir, file) in [
        ("etc", "passwd"),
        ("usr", "bin-sh"),
        ("var", "log"),
        ("home", "alice"),
    ] {
        std::fs::create_dir(runs.join(dir)).unwrap();
        std::fs::write(runs.join(dir).join(file), format!("{dir}\n")).unwrap();
    }
    // Named like a run id, no record; a record naming another id; odd entries.
    std::fs::create_dir(runs.join("12345")).unwrap();
    std::fs::write(runs.join("12345/data"), "x\n").unwrap();
    std::fs::create_dir(runs.join("other-id")).unwrap();
    let mut record = sandbox.record("recent");
    record["run_id"] = "someone-else".into();
    std::fs::write(runs.join("other-id/run.json"), record.to_string()).unwrap();
    std::fs::write(runs.join("other-id/run.lock"), "").unwrap();
    std::fs::create_dir(runs.join("not a run id")).unwrap();
    std::os::unix::fs::symlink(sandbox.abra_home(), runs.join("link")).unwrap();
    std::fs::write(runs.join("stray-file"), "").unwrap();
    for entry in [
        "etc",
        "usr",
        "var",
        "home",
        "12345",
        "myproject",
        "not a run id",
        "other-id/run.json",
        "other-id",
        "stray-file",
    ] {
        age(&runs.join(entry), OLD);
    }

    let foreign = [
        "etc",
        "usr",
        "var",
        "home",
        "12345",
        "other-id",
        "renamed",
        "their-run",
        "myproject",
        "not a run id",
        "link",
        "stray-file",
    ];
    let before: Vec<_> = foreign.iter().map(|f| fingerprint(&runs.join(f))).collect();
    for dry_run in [true, false] {
        let args: &[&str] = if dry_run {
            &["--keep-runs", "14d", "--dry-run"]
        } else {
            &["--keep-runs", "14d"]
        };
        let (report, done) = sandbox.janitor(args);
        done.assert_code(0);
        assert_eq!(
            report["runs_removed"],
            serde_json::json!([runs.join("old")]),
            "{report:#}"
        );
        assert_eq!(runs.join("old").exists(), dry_run);
        for (name, why) in [
            ("etc", "has no run.json"),
            ("usr", "has no run.json"),
            ("var", "has no run.json"),
            ("home", "has no run.json"),
            ("12345", "has no run.json"),
            ("other-id", "names run \"someone-else\", not \"other-id\""),
            ("renamed", "names run \"donor\", not \"renamed\""),
            ("their-run", "owned by uid 65534, not by us (uid 0)"),
            ("myproject", "owned by uid 65534, not by us (uid 0)"),
            ("not a run id", "its name is not a run id"),
            ("link", "it is a symbolic link"),
            ("stray-file", "it is not a directory"),
        ] {
            let said = why_kept(&report, &runs.join(name));
            assert!(said.contains(why), "{name}: {said}");
        }
        assert_eq!(
            report["runs_kept"].as_array().unwrap().len(),
            foreign.len(),
            "only what is not ours is reported (not .domains, not the recent run): {report:#}"
        );
        let after: Vec<_> = foreign.iter().map(|f| fingerprint(&runs.join(f))).collect();
        assert_eq!(
            before, after,
            "retention changed something that is not its own"
        );
    }
    for dir in ["etc", "usr", "var", "home", "12345", "myproject"] {
        assert!(
            !runs.join(dir).join("run.lock").exists(),
            "{dir} got a run.lock"
        );
    }
    let left = crate::util::list(&runs);
    assert!(left.contains(&"recent".to_owned()) && left.contains(&".domains".to_owned()));

    // The text report says the same, one line per entry.
    let mut cmd = sandbox.ccci();
    cmd.args(["janitor", "--keep-runs", "14d"]);
    let done = run(cmd);
    done.assert_code(0);
    let line = format!(
        "left alone {}: not a run directory of ours: it has no run.json",
        runs.join("etc").display()
    );
    assert!(done.out.contains(&line), "{}", done.transcript());
}

/// A runs dir that is `/` or a system directory — directly, through `..`, or through a symbolic
/// link — is refused with exit 2 before anything is looked at or written, by `janitor
/// --keep-runs` (a dry run here, so that a regression could not remove anything) and by `run`.
#[test]
fn system_directories_are_refused_as_runs_dirs() {
    let sandbox = Sandbox::new();
    let to_root = sandbox.path().join("to-root");
    std::os::unix::fs::symlink("/", &to_root).unwrap();
    let via_dots = "/var/lib/cc-ci-runs-none/..".to_owned();
    for (dir, named) in [
        ("/", "/ is a system directory"),
        ("/var/lib", "/var/lib is a system directory"),
        ("/var/lib/", "/var/lib is a system directory"),
        ("/etc", "/etc is a system directory"),
        ("/home", "/home is a system directory"),
        ("/proc/self", "is under the kernel's /proc"),
        (to_root.to_str().unwrap(), "/ is a system directory"),
        (&via_dots, "is a system directory"),
    ] {
        let mut cmd = sandbox.ccci();
        cmd.arg("--runs-dir")
            .arg(dir)
            .args(["janitor", "--keep-runs", "1h", "--dry-run"]);
        let done = run(cmd);
        done.assert_code(2);
        done.assert_stderr_has("invalid runs dir (--runs-dir, CCCI_RUNS_DIR, runs_dir)");
        done.assert_stderr_has(named);
        assert!(done.out.is_empty(), "{}", done.transcript());
    }
    // Through the environment as well, and for `run`: its command never starts, and it makes
    // no directory there.
    let mut bare = Command::new(BIN);
    bare.env("CCCI_CONFIG", "/dev/null")
        .env("CCCI_RUNS_DIR", "/var/lib")
        .arg("--lock-dir")
        .arg(sandbox.locks())
        .arg("--state-dir")
        .arg(sandbox.state())
        .arg("--abra-home")
        .arg(sandbox.abra_home())
        .args(["--docker", "off", "run", "--recipe", "custom-html"])
        .args(["--run-id", "ccci-refused-runs-dir", "--no-fetch", "--"])
        .args(["sh", "-c", "echo command-ran"]);
    let done = run(bare);
    let made = Path::new("/var/lib/ccci-refused-runs-dir");
    if made.exists() {
        let _ = std::fs::remove_dir_all(made);
    }
    done.assert_code(2);
    done.assert_stderr_has("invalid runs dir (--runs-dir, CCCI_RUNS_DIR, runs_dir) \"/var/lib\"");
    assert!(!done.out.iter().any(|l| l == "command-ran"));
    assert!(!made.exists());

    // A directory of its own below them is fine.
    let mut cmd = sandbox.ccci();
    cmd.args(["janitor", "--keep-runs", "1h", "--dry-run"]);
    run(cmd).assert_code(0);
}
