//! The configuration file is held to the rules of the directories it names: a file anyone else
//! could have written, a device, a FIFO or a huge file is refused with exit 2, naming the file
//! and the rule, before anything is done.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::util::{BIN, Finished, Proc, Sandbox, run};

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// `ccci-run --config FILE config` with nothing else from the environment.
fn show_config(config: &Path) -> Finished {
    let mut cmd = Command::new(BIN);
    cmd.env_remove("CCCI_CONFIG")
        .arg("--config")
        .arg(config)
        .arg("config");
    run(cmd)
}

/// As `uid` (setpriv), `ccci-run --config FILE config`.
fn show_config_as(uid: u32, config: &Path) -> Finished {
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .args(["--clear-groups", "--"])
        .arg(BIN)
        .env_remove("CCCI_CONFIG")
        .arg("--config")
        .arg(config)
        .arg("config");
    run(cmd)
}

#[track_caller]
fn assert_refused(done: &Finished, config: &Path, rule: &str) {
    done.assert_code(2);
    done.assert_stderr_has(&format!(
        "invalid configuration file \"{}\": ",
        config.display()
    ));
    done.assert_stderr_has(rule);
    done.assert_stderr_has("(--config, CCCI_CONFIG)");
    assert!(done.out.is_empty(), "{}", done.transcript());
}

/// A world-writable config file repointed two root runs' `lock_dir` between them, and they
/// overlapped: now a root run refuses it before its command starts, as does every command; a
/// group-writable one too. The same file with mode 0644 is read.
#[test]
fn config_files_others_could_have_written_are_refused() {
    let sandbox = Sandbox::new();
    let config = sandbox.path().join("config.toml");
    let elsewhere = sandbox.path().join("elsewhere-locks");
    std::fs::write(&config, format!("lock_dir = \"{}\"\n", elsewhere.display())).unwrap();
    for (mode, rule) in [
        (
            0o666,
            "mode 666 lets others rewrite it (writable by group or others)",
        ),
        (0o646, "mode 646 lets others rewrite it"),
        (0o664, "mode 664 lets others rewrite it"),
        (0o620, "mode 620 lets others rewrite it"),
    ] {
        chmod(&config, mode);
        assert_refused(&show_config(&config), &config, rule);
        // A run through CCCI_CONFIG, as a Drone step sets it: refused, its command never runs.
        let mut cmd = Command::new(BIN);
        cmd.env("CCCI_CONFIG", &config)
            .arg("--runs-dir")
            .arg(sandbox.runs())
            .args([
                "--docker",
                "off",
                "run",
                "--recipe",
                "custom-html",
                "--run-id",
                "cf",
            ])
            .args(["--no-fetch", "--", "sh", "-c", "echo command-ran"]);
        let done = run(cmd);
        assert_refused(&done, &config, rule);
        assert!(!sandbox.runs().exists() && !elsewhere.exists());
    }
    chmod(&config, 0o644);
    let done = show_config(&config);
    done.assert_code(0);
    assert!(
        done.out
            .iter()
            .any(|l| l.contains(&*elsewhere.to_string_lossy())),
        "{}",
        done.transcript()
    );
}

/// Owned by another user: root refuses a file of uid 65534; uid 65534 (setpriv) reads its own
/// file and root's, and refuses one of a third user.
#[test]
fn config_files_of_other_users_are_refused() {
    let sandbox = Sandbox::new();
    chmod(sandbox.path(), 0o755);
    let config = sandbox.path().join("config.toml");
    std::fs::write(&config, "docker = \"off\"\n").unwrap();
    chmod(&config, 0o644);

    std::os::unix::fs::chown(&config, Some(65534), Some(65534)).unwrap();
    assert_refused(
        &show_config(&config),
        &config,
        "it is owned by uid 65534, neither us (uid 0) nor root",
    );
    show_config_as(65534, &config).assert_code(0);

    std::os::unix::fs::chown(&config, Some(0), Some(0)).unwrap();
    show_config_as(65534, &config).assert_code(0);
    show_config(&config).assert_code(0);

    std::os::unix::fs::chown(&config, Some(4242), Some(4242)).unwrap();
    assert_refused(
        &show_config_as(65534, &config),
        &config,
        "it is owned by uid 4242, neither us (uid 65534) nor root",
    );
}

/// In a directory others can write to without the sticky bit, anyone can swap the file for
/// theirs: refused, whether the file is named there or a symbolic link leads there. Sticky
/// (as `/tmp`, or the Nix store), the file is read; a link from a safe directory into a safe
/// one (as NixOS's `/etc` is made) is read too.
#[test]
fn config_files_in_directories_others_can_write_are_refused() {
    let sandbox = Sandbox::new();
    let open = sandbox.path().join("open");
    std::fs::create_dir(&open).unwrap();
    let config = open.join("config.toml");
    std::fs::write(&config, "docker = \"off\"\n").unwrap();
    chmod(&config, 0o644);
    let link = sandbox.path().join("link.toml");
    std::os::unix::fs::symlink(&config, &link).unwrap();

    chmod(&open, 0o777);
    let rule = format!(
        "its directory {} has mode 777, which lets others replace the file",
        open.display()
    );
    assert_refused(&show_config(&config), &config, &rule);
    assert_refused(&show_config(&link), &link, &rule);
    chmod(&open, 0o775);
    assert_refused(&show_config(&config), &config, "has mode 775");

    chmod(&open, 0o1777);
    show_config(&config).assert_code(0);
    show_config(&link).assert_code(0);
    chmod(&open, 0o755);
    show_config(&link).assert_code(0);
}

/// `--config /dev/zero` grew memory by about 1 GB/s without bound, a FIFO hung for ever, a
/// 2 MiB file was read whole: each is refused at once, under an address-space limit that
/// reading without bound would break, and a FIFO with no writer never blocks the open. A file of
/// exactly 1 MiB is still read; `/dev/null` reads as an empty file.
#[test]
fn devices_fifos_and_huge_files_are_refused_at_once() {
    let sandbox = Sandbox::new();
    let fifo = sandbox.path().join("config.fifo");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    chmod(&fifo, 0o600);
    let big = sandbox.path().join("big.toml");
    std::fs::write(&big, "#".repeat(2 << 20)).unwrap();
    let limit = sandbox.path().join("limit.toml");
    let mut text = "#".repeat((1 << 20) - 1);
    text.push('\n');
    std::fs::write(&limit, &text).unwrap();
    let over = sandbox.path().join("over.toml");
    text.push('#');
    std::fs::write(&over, &text).unwrap();

    for (config, rule) in [
        (
            Path::new("/dev/zero"),
            "it is a character device, not a regular file",
        ),
        (
            Path::new("/dev/urandom"),
            "it is a character device, not a regular file",
        ),
        (&fifo, "it is a FIFO, not a regular file"),
        (&big, "it is larger than 1024 KiB"),
        (&over, "it is larger than 1024 KiB"),
        (sandbox.path(), "it is a directory, not a regular file"),
    ] {
        // 256 MiB of address space: plenty for ccci-run, a few tenths of a second of reading
        // /dev/zero without a bound. A hang is killed after 10 s and fails the test.
        let mut cmd = Command::new("timeout");
        cmd.args(["-s", "KILL", "10", "prlimit", "--as=268435456"])
            .arg("--")
            .arg(BIN)
            .env_remove("CCCI_CONFIG")
            .arg("--config")
            .arg(config)
            .arg("config");
        let started = Instant::now();
        let proc = Proc::spawn(cmd);
        let done = proc.finish();
        let took = started.elapsed();
        assert_refused(&done, config, rule);
        assert!(
            took < Duration::from_secs(5),
            "{} took {took:?}",
            config.display()
        );
    }
    let done = show_config(&limit);
    done.assert_code(0);
    let done = show_config(Path::new("/dev/null"));
    done.assert_code(0);
}

/// A link in a sticky directory others may write to (as `/tmp`), planted where the default or a
/// configured file is looked for, is never followed, whatever file it leads to: whoever planted
/// it would choose our lock and runs dirs. The file itself there is read.
#[test]
fn a_config_file_is_never_followed_through_a_link_in_a_sticky_shared_directory() {
    let sandbox = Sandbox::new();
    let safe = sandbox.path().join("safe.toml");
    std::fs::write(&safe, "docker = \"off\"\n").unwrap();
    chmod(&safe, 0o644);
    let shared = sandbox.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    chmod(&shared, 0o1777);
    let link = shared.join("config.toml");
    std::os::unix::fs::symlink(&safe, &link).unwrap();
    assert_refused(
        &show_config(&link),
        &link,
        &format!(
            "it is a symbolic link in {}, a directory others may write to",
            shared.display()
        ),
    );
    std::fs::remove_file(&link).unwrap();
    std::fs::copy(&safe, &link).unwrap();
    chmod(&link, 0o644);
    show_config(&link).assert_code(0);
}
