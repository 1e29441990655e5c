//! Every file ccci-run reads or writes on a shared host, met as it may be: another
//! configuration's, planted by another process of the same user.

use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use nix::sys::signal::Signal;

use crate::util::{
    Finished, PATIENCE, Proc, Sandbox, list, process_alive, run, signal, wait_exited,
};

/// Two configurations share one state dir (`/tmp` is every configuration's default), and Drone
/// build numbers make their run ids collide. Configuration B's janitor sweeps and runs — each
/// with a start-of-run sweep, one with A's very run id — never remove A's live run's state
/// files: the scope in their names says whose they are. B's own files go with B's runs.
#[test]
fn another_configuration_never_removes_a_live_run_s_state_files() {
    let a = Sandbox::new();
    let b = Sandbox::new();
    std::fs::remove_dir(b.state()).unwrap();
    std::os::unix::fs::symlink(a.state(), b.state()).unwrap();
    let script = "printf important > \"$CCCI_DEPLOYS_FILE\"; echo ready $$; read line || :";
    let mut live = Proc::spawn(a.run_sh("7", &["--pr", "1"], script));
    live.wait_ready();
    let files = list(&a.state());
    assert_eq!(files.len(), 4, "{files:?}");
    let deploys = files
        .iter()
        .find(|f| f.starts_with("ccci-deploys-"))
        .map(|f| a.state().join(f))
        .unwrap();

    let (_, done) = b.janitor(&[]);
    done.assert_code(0);
    for run_id in ["7", "8"] {
        run(b.run_sh(run_id, &["--pr", "2"], "test -n \"$CCCI_DEPLOYS_FILE\"")).assert_code(0);
    }
    let (_, done) = b.janitor(&[]);
    done.assert_code(0);
    assert_eq!(
        std::fs::read_to_string(&deploys).ok().as_deref(),
        Some("important"),
        "configuration B removed or changed A's live run's file"
    );
    assert_eq!(list(&a.state()), files, "A's state files changed");

    live.close_stdin();
    live.finish().assert_code(0);
    assert!(list(&a.state()).is_empty(), "{:?}", list(&a.state()));
}

/// Run `cmd` to its end, which must come within [`crate::util::PATIENCE`]: a product that hangs
/// fails the test (and is killed) instead of hanging the suite.
fn bounded(cmd: std::process::Command) -> Finished {
    let proc_ = Proc::spawn(cmd);
    let pid = proc_.pid();
    if !wait_exited(pid) {
        signal(pid, Signal::SIGKILL);
        let done = proc_.finish();
        panic!("hung: killed after {:?}\n{}", PATIENCE, done.transcript());
    }
    proc_.finish()
}

fn mkfifo(path: &Path) {
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
}

/// A FIFO named like a ticket in a named lock's queue (any process of the lock's user can make
/// one): `lock` takes the lock and runs its command, and the janitor sweeps, each at once —
/// neither blocks opening it.
#[test]
fn a_fifo_named_like_a_ticket_wedges_neither_lock_nor_janitor() {
    let sandbox = Sandbox::new();
    let queue = sandbox.locks().join("ccci-shared.lock.queue");
    std::fs::create_dir_all(&queue).unwrap();
    // A live pid (ours), so that its owner is looked up rather than its pid judged dead.
    mkfifo(&queue.join(format!("1-000000000001-{}", std::process::id())));
    let mut cmd = sandbox.ccci();
    cmd.args(["lock", "shared", "--wait", "5", "--", "echo", "held"]);
    let done = bounded(cmd);
    done.assert_code(0);
    assert!(
        done.out.iter().any(|l| l == "held"),
        "{}",
        done.transcript()
    );
    let mut cmd = sandbox.ccci();
    cmd.args(["janitor", "--json"]);
    bounded(cmd).assert_code(0);
}

/// A FIFO where a named lock's holder records how long it waited: `lock` runs its command at
/// once (opening it for writing would block until someone reads), warns, and leaves it alone.
#[test]
fn a_fifo_at_the_last_wait_record_never_holds_up_the_holder() {
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.locks()).unwrap();
    let planted = sandbox.locks().join("ccci-shared.lock.last-wait");
    mkfifo(&planted);
    let mut cmd = sandbox.ccci();
    cmd.args(["lock", "shared", "--wait", "5", "--", "echo", "held"]);
    let done = bounded(cmd);
    done.assert_code(0);
    assert!(
        done.out.iter().any(|l| l == "held"),
        "{}",
        done.transcript()
    );
    assert!(
        std::fs::symlink_metadata(&planted)
            .unwrap()
            .file_type()
            .is_fifo(),
        "the FIFO was replaced"
    );
}

/// The run's own command plants a FIFO (or a link to /dev/zero) where `ccci-run stop` leaves its
/// request; a plain SIGTERM, as Drone or systemd sends, still tears the run down at once (143),
/// and is not taken for a stop request.
#[rstest::rstest]
#[case::fifo(true)]
#[case::dev_zero(false)]
fn a_planted_stop_request_never_holds_up_a_plain_sigterm(#[case] fifo: bool) {
    let sandbox = Sandbox::new();
    let stop = sandbox.runs().join("st").join("stop.json");
    let plant = if fifo {
        format!("mkfifo {}", crate::util::sh_quote(&stop))
    } else {
        format!("ln -s /dev/zero {}", crate::util::sh_quote(&stop))
    };
    let mut live = Proc::spawn(sandbox.run_sh(
        "st",
        &["--kill-grace", "1"],
        &format!("{plant} && echo ready $$; exec sleep 1000"),
    ));
    live.wait_ready();
    signal(live.pid(), Signal::SIGTERM);
    assert!(
        wait_exited(live.pid()),
        "the run did not end within {PATIENCE:?} of a SIGTERM"
    );
    let done = live.finish();
    done.assert_code(143);
    let record = sandbox.record("st");
    assert_eq!(record["shutdown_reason"], "SIGTERM", "{record:#}");
    assert!(record.get("stopped_by").is_none(), "{record:#}");
}

/// A run's record replaced by a FIFO, a link to /dev/zero, or a huge sparse file: `runs`,
/// `runs --json` and `stop` end at once, naming what they refused, and list the other runs.
#[rstest::rstest]
#[case::fifo("fifo")]
#[case::dev_zero("zero")]
#[case::huge("huge")]
fn a_hostile_run_record_is_refused_and_the_other_runs_listed(#[case] kind: &str) {
    let sandbox = Sandbox::new();
    for id in ["ok", "bad"] {
        run(sandbox.run_sh(id, &[], "true")).assert_code(0);
    }
    let record = sandbox.runs().join("bad").join("run.json");
    std::fs::remove_file(&record).unwrap();
    match kind {
        "fifo" => mkfifo(&record),
        "zero" => std::os::unix::fs::symlink("/dev/zero", &record).unwrap(),
        _ => std::fs::File::create(&record)
            .unwrap()
            .set_len(3 << 30)
            .unwrap(),
    }
    for args in [
        &["runs", "--all"][..],
        &["runs", "--all", "--json"],
        &["stop", "bad"],
    ] {
        let mut cmd = sandbox.ccci();
        cmd.args(args);
        let done = bounded(cmd);
        let text = done.transcript();
        if args[0] == "runs" {
            assert!(
                text.contains("ok"),
                "{args:?}: the other run is not listed\n{text}"
            );
        }
        assert!(
            text.contains("run.json") || text.contains("bad"),
            "{args:?}: nothing said of the refused record\n{text}"
        );
    }
}

/// The metrics target in a shared textfile dir is a FIFO when a failed sweep looks for the last
/// success time in it: the janitor ends at once, and the metrics file is written in its place.
#[test]
fn a_fifo_at_the_metrics_target_never_hangs_the_janitor() {
    let sandbox = Sandbox::new();
    let metrics = sandbox.path().join("ccci.prom");
    mkfifo(&metrics);
    // A failed sweep: a state dir that is a regular file.
    let file = sandbox.path().join("not-a-dir");
    std::fs::write(&file, "").unwrap();
    let mut cmd = sandbox.ccci();
    cmd.arg("--state-dir")
        .arg(&file)
        .args(["janitor", "--metrics-file"])
        .arg(&metrics);
    let done = bounded(cmd);
    done.assert_code(1);
    assert!(
        std::fs::symlink_metadata(&metrics).is_ok_and(|m| m.is_file()),
        "the metrics file was not written"
    );
}

/// Run X's own command (same user) rewrites X's record and guard holder line to name run V's
/// supervisor: `stop X --kill` refuses, naming the mismatch the kernel's lock table shows, and
/// signals nobody — V and X both run on.
#[test]
fn stop_is_never_redirected_by_a_record_and_holder_line_that_name_another_run() {
    let sandbox = Sandbox::new();
    let script = "echo ready $$; read line || :";
    let mut victim = Proc::spawn(sandbox.run_sh("v", &["--pr", "1"], script));
    victim.wait_ready();
    let mut forger = Proc::spawn(sandbox.run_sh("x", &["--pr", "2"], script));
    forger.wait_ready();
    let v_dir = sandbox.runs().join("v");
    let x_dir = sandbox.runs().join("x");
    let v_record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(v_dir.join("run.json")).unwrap()).unwrap();
    let mut x_record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(x_dir.join("run.json")).unwrap()).unwrap();
    x_record["supervisor"] = v_record["supervisor"].clone();
    std::fs::write(x_dir.join("run.json"), x_record.to_string()).unwrap();
    // In place: the same inode, still flocked by X's supervisor.
    std::fs::write(
        x_dir.join("run.lock"),
        std::fs::read(v_dir.join("run.lock")).unwrap(),
    )
    .unwrap();

    let mut cmd = sandbox.ccci();
    cmd.args(["stop", "x", "--kill", "--wait", "2"]);
    let done = bounded(cmd);
    done.assert_code(1);
    assert!(
        done.err
            .iter()
            .any(|l| l.contains("is not provably that run")
                && l.contains("no open descriptor on the guard")),
        "{}",
        done.transcript()
    );
    assert!(process_alive(victim.pid()), "run V was signalled");
    assert!(process_alive(forger.pid()), "run X was signalled");
    for p in [victim, forger] {
        let mut p = p;
        p.close_stdin();
        p.finish().assert_code(0);
    }
}

/// A run dir planted as a link to another configuration's live run: `stop` refuses it, naming
/// what it is, and the other run goes on.
#[test]
fn stop_never_follows_a_run_dir_planted_as_a_link() {
    let other = Sandbox::new();
    let mut live = Proc::spawn(other.run_sh("v", &[], "echo ready $$; read line || :"));
    live.wait_ready();
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.runs()).unwrap();
    std::os::unix::fs::symlink(other.runs().join("v"), sandbox.runs().join("v")).unwrap();
    let mut cmd = sandbox.ccci();
    cmd.args(["stop", "v", "--kill", "--wait", "2"]);
    let done = bounded(cmd);
    done.assert_code(1);
    done.assert_stderr_has("a symbolic link, not a run directory");
    assert!(
        process_alive(live.pid()),
        "the other configuration's run was signalled"
    );
    live.close_stdin();
    live.finish().assert_code(0);
}

/// A named lock's fencing counter at the largest token there is: `lock` refuses loudly (125)
/// and never runs its command with a token another holder had, nor the same one twice.
#[test]
fn a_saturated_fencing_counter_is_refused_never_reused() {
    let sandbox = Sandbox::new();
    let queue = sandbox.locks().join("ccci-fenced.lock.queue");
    std::fs::create_dir_all(&queue).unwrap();
    std::fs::write(queue.join(".fencing"), format!("{}\n", i64::MAX)).unwrap();
    for _ in 0..2 {
        let mut cmd = sandbox.ccci();
        cmd.args([
            "lock",
            "fenced",
            "--",
            "sh",
            "-c",
            "echo token $CCCI_FENCING_TOKEN",
        ]);
        let done = bounded(cmd);
        done.assert_code(125);
        assert!(
            !done.out.iter().any(|l| l.starts_with("token")),
            "the command ran\n{}",
            done.transcript()
        );
        done.assert_stderr_has("the largest token there is");
    }
}

/// A control character in a configured path (from the configuration file, where TOML escapes
/// can put one) is a usage error naming the key, escaped, before anything is done.
#[test]
fn a_control_character_in_a_configured_path_is_refused() {
    let sandbox = Sandbox::new();
    let config = sandbox.path().join("config.toml");
    std::fs::write(&config, "runs_dir = \"/tmp/runs\\nforged line\"\n").unwrap();
    // Not the sandbox's command line: its own --runs-dir would win over the file's.
    let mut cmd = std::process::Command::new(crate::util::BIN);
    crate::util::without_ccci_env(&mut cmd)
        .env("CCCI_CONFIG", &config)
        .arg("config");
    let done = bounded(cmd);
    done.assert_code(2);
    done.assert_stderr_has("control character");
    assert!(
        !done.err.iter().any(|l| l.starts_with("forged line")),
        "the newline reached the output raw\n{}",
        done.transcript()
    );
}

/// A record whose fields hold bidirectional and terminal control characters (the run's own
/// command can rewrite its record): `runs` shows them escaped.
#[test]
fn runs_shows_control_and_bidi_characters_escaped() {
    let sandbox = Sandbox::new();
    run(sandbox.run_sh("esc", &[], "true")).assert_code(0);
    let path = sandbox.runs().join("esc").join("run.json");
    let mut record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    record["recipe"] = "evil\u{202e}txt.exe\u{1b}[2J".into();
    std::fs::write(&path, record.to_string()).unwrap();
    let mut cmd = sandbox.ccci();
    cmd.args(["runs", "--all"]);
    let done = bounded(cmd);
    done.assert_code(0);
    let text = done.out.join("\n");
    assert!(
        !text.contains('\u{202e}') && !text.contains('\u{1b}'),
        "raw control characters in the listing: {text:?}"
    );
    assert!(text.contains("\\u{202e}"), "{text}");
}

/// `doctor --unit-file` pointed at a FIFO or at /dev/zero ends at once, its unit checks saying
/// why the file was not read.
#[rstest::rstest]
#[case::fifo(true)]
#[case::dev_zero(false)]
fn doctor_reads_no_unit_file_that_is_a_fifo_or_a_device(#[case] fifo: bool) {
    let sandbox = Sandbox::new();
    let unit = sandbox.path().join("drone-runner-exec.service");
    if fifo {
        mkfifo(&unit);
    } else {
        std::os::unix::fs::symlink("/dev/zero", &unit).unwrap();
    }
    let mut cmd = sandbox.ccci();
    cmd.args(["doctor", "--json", "--unit-file"]).arg(&unit);
    let done = bounded(cmd);
    let text = done.out.join("\n");
    let expected = if fifo { "a FIFO" } else { "a character device" };
    assert!(text.contains(expected), "{}", done.transcript());
}

/// `stop` by a user who may not look at a live run says so ("not yours to read"), never "no
/// live run", and signals nothing: whether the record itself is closed to them, or only the
/// run's guard.
#[rstest::rstest]
#[case::record_closed(false)]
#[case::guard_closed(true)]
fn stop_by_another_user_says_not_yours_never_no_live_run(#[case] record_readable: bool) {
    use std::os::unix::fs::PermissionsExt;
    if !crate::util::is_root_or_skip("run the suite as root to switch to another user") {
        return;
    }
    let sandbox = Sandbox::new();
    let mut live = Proc::spawn(sandbox.run_sh("9", &[], "echo ready $$; read line || :"));
    live.wait_ready();
    let open = std::fs::Permissions::from_mode(0o755);
    std::fs::set_permissions(sandbox.path(), open.clone()).unwrap();
    std::fs::set_permissions(sandbox.runs(), open.clone()).unwrap();
    if record_readable {
        let dir = sandbox.runs().join("9");
        std::fs::set_permissions(&dir, open).unwrap();
        std::fs::set_permissions(dir.join("run.json"), std::fs::Permissions::from_mode(0o644))
            .unwrap();
    }
    let mut ours = sandbox.ccci();
    ours.args(["stop", "9", "--kill"]);
    let done = bounded(crate::util::as_user(65534, &ours));
    done.assert_code(1);
    done.assert_stderr_has("run 9 is not yours to read");
    assert!(
        !done.stderr().contains("no live run"),
        "{}",
        done.transcript()
    );
    assert!(process_alive(live.pid()), "the run was signalled");
    live.close_stdin();
    live.finish().assert_code(0);
}
