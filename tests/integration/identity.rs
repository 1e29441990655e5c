//! Whose is it: nothing is killed unless it is provably a dead run of our own configuration.
//! Runs in another pid namespace (`unshare --pid --fork --mount-proc`, sharing the lock, runs
//! and state dirs and the cgroup tree, as a container would) and in a time namespace
//! (`unshare --time --boottime`), judged from the host and judging it: by a janitor, a run's
//! start-of-run sweep and `locks`. Two configurations on one host. A SIGKILLed holder whose
//! command's child keeps writing, and the next holder's command, which must see no write after
//! it starts. A rerun of a finished run's id while a probe holds its guard.

use std::os::fd::AsFd;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rstest::rstest;
use serde_json::Value;

use crate::util::{
    PATIENCE, Proc, Sandbox, Stream, candidate, kill_supervisor_and_its_dead_man, process_alive,
    run, signal, wait_exited,
};

/// `cmd`, run by `prefix` (with the same environment).
pub fn wrapped(prefix: &[&str], cmd: &Command) -> Command {
    let mut out = Command::new(prefix[0]);
    out.args(&prefix[1..])
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (key, value) in cmd.get_envs() {
        match value {
            Some(value) => out.env(key, value),
            None => out.env_remove(key),
        };
    }
    out
}

/// `cmd` in a pid namespace of its own with its own `/proc` (a container sharing our
/// directories and cgroup tree), two shells deep so that its parent is not the namespace's
/// init; the namespace dies with `unshare`.
pub fn in_pid_namespace(cmd: &Command) -> Command {
    wrapped(
        &[
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child",
            "--",
            "sh",
            "-c",
            r#"sh -c '"$@"; exit $?' inner "$@"; exit $?"#,
            "outer",
        ],
        cmd,
    )
}

/// `cmd` in a time namespace whose boot time is 100000 s earlier (`unshare` execs it: the
/// process is ccci-run itself).
fn in_time_namespace(cmd: &Command) -> Command {
    wrapped(&["unshare", "--time", "--boottime", "100000", "--"], cmd)
}

fn with_cgroup(mut cmd: Command, mode: &str) -> Command {
    cmd.env("CCCI_CGROUP", mode);
    cmd
}

/// A command that starts a daemon (its own session, a marked process outside its group), says
/// `daemon <pid>` and `ready <pid>`, waits for its stdin to close, and says whether its daemon
/// survived until then.
const LIVE: &str = "setsid sh -c 'exec sleep 100000' </dev/null >/dev/null 2>&1 & d=$!; \
    echo daemon $d; echo ready $$; read line || :; \
    if kill -0 $d 2>/dev/null; then echo SURVIVED; kill $d; else echo DAEMON-KILLED; fi";

/// The dead cgroups a sweep reported of this test's own runs (`ccci-run-<id>-…`). A sweep
/// reports every dead cgroup of its configuration's scope (the runs dir's device and inode),
/// and a sandbox's runs dir may get the inode of another test's deleted one, whose SIGKILLed
/// holders' cgroups are then dead cgroups of the same scope: not this test's to judge.
fn dead_cgroups_of(report: &Value, run_ids: &[&str]) -> Vec<Value> {
    report["dead_cgroups"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| {
            let path = c["path"].as_str().unwrap_or_default();
            let name = path.rsplit('/').next().unwrap_or_default();
            run_ids
                .iter()
                .any(|id| name.starts_with(&format!("ccci-run-{id}-")))
        })
        .cloned()
        .collect()
}

/// A dead run's app (an `.env` whose lock nobody holds): its reap makes a run's start-of-run
/// sweep hunt for leftover processes by their environment as well.
fn plant_dead_app(sandbox: &Sandbox, pr: &str) -> std::path::PathBuf {
    let domain = sandbox.domain("gone", Some(pr));
    sandbox.plant_env("ci", &domain, "x")
}

fn json(done: &crate::util::Finished) -> Value {
    serde_json::from_str(&done.out.join("\n"))
        .unwrap_or_else(|e| panic!("no JSON ({e})\n{}", done.transcript()))
}

fn janitor_in(wrap: fn(&Command) -> Command, sandbox: &Sandbox) -> Value {
    let mut cmd = sandbox.ccci();
    cmd.args(["janitor", "--json"]);
    let done = run(wrap(&cmd));
    done.assert_code(0);
    json(&done)
}

fn locks_in(wrap: fn(&Command) -> Command, sandbox: &Sandbox) -> Value {
    let mut cmd = sandbox.ccci();
    cmd.args(["locks", "--json"]);
    let done = run(wrap(&cmd));
    done.assert_code(0);
    json(&done)["locks"].clone()
}

/// `cmd` as it is, on the host.
fn here(cmd: &Command) -> Command {
    wrapped(&["env", "--"], cmd)
}

/// The app lock of `domain` as `locks --json` lists it.
fn app_lock<'a>(locks: &'a Value, domain: &str) -> &'a Value {
    locks
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "app" && l["name"] == domain)
        .unwrap_or_else(|| panic!("no app lock of {domain} in {locks:#}"))
}

/// The first pid on a line `<prefix> <pid>`.
fn pid_line(proc: &mut Proc, prefix: &str) -> i32 {
    let line = proc.wait_for(Stream::Out, prefix);
    line.trim_start_matches(prefix).trim().parse().unwrap()
}

fn finish_survived(mut proc: Proc) {
    proc.close_stdin();
    let done = proc.finish();
    done.assert_code(0);
    assert!(
        done.out.iter().any(|l| l == "SURVIVED"),
        "a live run's daemon was killed\n{}",
        done.transcript()
    );
}

/// A host janitor, a host run's start-of-run sweep and host `locks` meet a live run in another
/// pid namespace: its supervisor is found (by its namespace and its pid there) and judged
/// alive; nothing of it is killed. Before, its cgroup name's pid 3 was looked up in the host's
/// `/proc` and the run was killed (137).
#[rstest]
#[case::cgroup("auto")]
#[case::fallback("off")]
fn a_live_run_in_a_pid_namespace_is_never_killed_from_the_host(#[case] cgroup: &str) {
    let sandbox = Sandbox::new();
    let domain = sandbox.domain("custom-html", Some("1"));
    let mut inner = Proc::spawn(in_pid_namespace(&with_cgroup(
        sandbox.run_sh("ns1", &["--pr", "1"], LIVE),
        cgroup,
    )));
    inner.wait_ready();

    let dead = plant_dead_app(&sandbox, "7");
    let report = janitor_in(here, &sandbox);
    assert_eq!(
        candidate(&report, &sandbox.domain("gone", Some("7")))["decision"],
        "reap"
    );
    assert_eq!(
        dead_cgroups_of(&report, &["ns1"]),
        Vec::<Value>::new(),
        "{report:#}"
    );
    assert_eq!(
        report["leftover_processes"],
        serde_json::json!([]),
        "{report:#}"
    );
    assert!(!dead.exists());

    // A host run's sweep: reaping a dead app, it hunts by environment too.
    let dead = plant_dead_app(&sandbox, "8");
    run(with_cgroup(
        sandbox.run_sh("h1", &["--pr", "2"], "true"),
        cgroup,
    ))
    .assert_code(0);
    assert!(!dead.exists(), "the host run's sweep did not reap");

    let locks = locks_in(here, &sandbox);
    let lock = app_lock(&locks, &domain);
    assert_eq!(lock["held"], true, "{lock:#}");
    assert_eq!(lock["holder_is"], "alive", "{lock:#}");

    finish_survived(inner);
}

/// The other way round: a janitor, a run's sweep and `locks` inside a pid namespace meet the
/// host's live run, whose namespace they cannot see into. Its cgroup is left alone and
/// reported unresolvable, with the reason; `locks` says it is held and that its holder cannot
/// be judged there. Before, the host run's pid was not in the namespace's `/proc`, and it was
/// killed.
#[rstest]
#[case::cgroup("auto")]
#[case::fallback("off")]
fn a_run_in_a_pid_namespace_never_kills_the_host_s_live_runs(#[case] cgroup: &str) {
    let sandbox = Sandbox::new();
    let domain = sandbox.domain("custom-html", Some("1"));
    let mut host = Proc::spawn(with_cgroup(
        sandbox.run_sh("h1", &["--pr", "1"], LIVE),
        cgroup,
    ));
    let daemon = pid_line(&mut host, "daemon ");
    host.wait_ready();

    let report = janitor_in(in_pid_namespace, &sandbox);
    let cgroups = report["dead_cgroups"].as_array().unwrap();
    match sandbox.record("h1")["cgroup"].as_str() {
        Some(path) => {
            assert_eq!(cgroups.len(), 1, "{report:#}");
            assert_eq!(cgroups[0]["path"], path, "{report:#}");
            assert_eq!(cgroups[0]["removed"], false, "{report:#}");
            let why = cgroups[0]["unresolvable"].as_str().unwrap_or_default();
            assert!(
                why.contains("cannot see into"),
                "no reason given: {report:#}"
            );
            assert!(Path::new(path).exists());
        }
        None => assert!(cgroups.is_empty(), "{report:#}"),
    }
    assert_eq!(
        report["leftover_processes"],
        serde_json::json!([]),
        "{report:#}"
    );

    let dead = plant_dead_app(&sandbox, "8");
    run(in_pid_namespace(&with_cgroup(
        sandbox.run_sh("ns2", &["--pr", "2"], "true"),
        cgroup,
    )))
    .assert_code(0);
    assert!(!dead.exists(), "the namespaced run's sweep did not reap");

    let locks = locks_in(in_pid_namespace, &sandbox);
    let lock = app_lock(&locks, &domain);
    assert_eq!(lock["held"], true, "{lock:#}");
    assert_eq!(lock["holder_is"], "unresolvable", "{lock:#}");

    assert!(process_alive(daemon));
    finish_survived(host);
}

/// A run in a time namespace (`unshare --time --boottime 100000`: its `/proc` start times are
/// shifted by 100000 s) and a host run: a host janitor and a time-namespaced one judge both
/// alive, and a SIGKILLed time-namespaced run dead, since the start times are compared with each
/// reader's boottime offset taken out. Before, the offset made every start time differ and the
/// live run was killed.
#[rstest]
#[case::cgroup("auto")]
#[case::fallback("off")]
fn runs_in_a_time_namespace_are_judged_alive_and_dead_like_any_other(#[case] cgroup: &str) {
    let sandbox = Sandbox::new();
    let timed = Proc::spawn(in_time_namespace(&with_cgroup(
        sandbox.run_sh("t1", &["--pr", "1"], LIVE),
        cgroup,
    )));
    let host = Proc::spawn(with_cgroup(
        sandbox.run_sh("h1", &["--pr", "2"], LIVE),
        cgroup,
    ));
    let (mut timed, mut host) = (timed, host);
    timed.wait_ready();
    host.wait_ready();

    for wrap in [here as fn(&Command) -> Command, in_time_namespace] {
        let report = janitor_in(wrap, &sandbox);
        assert_eq!(
            dead_cgroups_of(&report, &["t1", "h1"]),
            Vec::<Value>::new(),
            "{report:#}"
        );
        assert_eq!(
            report["leftover_processes"],
            serde_json::json!([]),
            "{report:#}"
        );
    }
    let locks = locks_in(here, &sandbox);
    let lock = app_lock(&locks, &sandbox.domain("custom-html", Some("1")));
    assert_eq!(lock["holder_is"], "alive", "{lock:#}");

    // Dead is still dead: the supervisor of a third run, in the time namespace, SIGKILLed.
    let mut killed = Proc::spawn(in_time_namespace(&with_cgroup(
        sandbox.run_sh("t2", &["--pr", "3"], LIVE),
        cgroup,
    )));
    let daemon = pid_line(&mut killed, "daemon ");
    killed.wait_ready();
    // Its dead-man too: what is left to clear is what this test is about.
    kill_supervisor_and_its_dead_man(killed.pid());
    assert!(wait_exited(killed.pid()));
    let report = janitor_in(here, &sandbox);
    assert!(
        !process_alive(daemon),
        "the dead run's daemon survived\n{report:#}"
    );
    let found = report["dead_cgroups"].as_array().unwrap().len()
        + report["leftover_processes"].as_array().unwrap().len();
    assert!(found > 0, "{report:#}");
    drop(killed);

    finish_survived(timed);
    finish_survived(host);
}

/// Two configurations on one host (two sandboxes: runs, locks and state dirs of their own). The
/// janitor of one kills its own dead run's processes and never the other's, nor its cgroup;
/// that one's janitor then does. Before, a janitor swept every cgroup in the hierarchy and every
/// process's environment.
#[rstest]
#[case::cgroup("auto")]
#[case::fallback("off")]
fn a_janitor_never_touches_another_configuration_s_dead_runs(#[case] cgroup: &str) {
    let ours = Sandbox::new();
    let theirs = Sandbox::new();
    let kill_a_run = |sandbox: &Sandbox, id: &str| {
        let mut proc = Proc::spawn(with_cgroup(sandbox.run_sh(id, &[], LIVE), cgroup));
        let daemon = pid_line(&mut proc, "daemon ");
        proc.wait_ready();
        // Its dead-man too: what is left to clear is what this test is about.
        kill_supervisor_and_its_dead_man(proc.pid());
        assert!(wait_exited(proc.pid()));
        let cgroup = sandbox.record(id)["cgroup"].as_str().map(str::to_owned);
        (daemon, cgroup, proc)
    };
    let (our_daemon, our_cgroup, _a) = kill_a_run(&ours, "dead-a");
    let (their_daemon, their_cgroup, _b) = kill_a_run(&theirs, "dead-b");

    let (report, done) = ours.janitor(&[]);
    done.assert_code(0);
    assert!(!process_alive(our_daemon), "{report:#}");
    assert!(
        process_alive(their_daemon),
        "another configuration's process was killed\n{report:#}"
    );
    if let Some(path) = &their_cgroup {
        assert!(
            Path::new(path).exists(),
            "another configuration's cgroup went"
        );
    }
    if let Some(path) = &our_cgroup {
        assert!(!Path::new(path).exists(), "{report:#}");
    }
    let text = report.to_string();
    assert!(
        !text.contains("dead-b") && !text.contains(&format!("\"pid\":{their_daemon},")),
        "the report names another configuration's leftovers\n{report:#}"
    );

    let (report, done) = theirs.janitor(&[]);
    done.assert_code(0);
    assert!(!process_alive(their_daemon), "{report:#}");
    if let Some(path) = &their_cgroup {
        assert!(!Path::new(path).exists(), "{report:#}");
    }
}

/// The writer a holder's command leaves: a child that appends a timestamp to `$MARKS` every
/// 100 ms for as long as it lives, while the command itself sleeps.
const WRITER: &str = "(while :; do date +%s%N >> \"$MARKS\"; sleep 0.1; done) & \
    echo ready $$; exec sleep 100000";

/// The next holder's command: when it started, then a second for a dead writer to show itself.
const NEXT: &str = "date +%s%N > \"$STARTED\"; sleep 1; echo next-done";

fn wait_for_marks(marks: &Path) {
    let until = Instant::now() + PATIENCE;
    while std::fs::read_to_string(marks).map_or(true, |t| t.lines().count() < 2) {
        assert!(Instant::now() < until, "the writer never wrote");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// No write of the dead holder's writer is stamped at or after the next command's start.
fn assert_no_write_after_start(sandbox: &Sandbox, done: &crate::util::Finished) {
    let started: u128 = std::fs::read_to_string(sandbox.path().join("started"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let marks: Vec<u128> = std::fs::read_to_string(sandbox.path().join("marks"))
        .unwrap()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    assert!(!marks.is_empty());
    let after: Vec<&u128> = marks.iter().filter(|m| **m >= started).collect();
    assert!(
        after.is_empty(),
        "the dead holder's writer wrote {} time(s) after the next command started\n{}",
        after.len(),
        done.transcript()
    );
}

fn marked(sandbox: &Sandbox, mut cmd: Command) -> Command {
    cmd.env("MARKS", sandbox.path().join("marks"))
        .env("STARTED", sandbox.path().join("started"));
    cmd
}

/// A run's supervisor SIGKILLed (as the OOM killer does) while its command's child writes every
/// 100 ms, and no app trace left (no `.env`, no Docker resource). The next run of the domain,
/// parked on the app lock, takes it over from the dead holder its lock line names, kills its
/// cgroup and every process marked with it, waits until they are gone, says so, and only then
/// starts its command, which sees no write. Before, leftovers were only cleared when an app
/// was there.
#[rstest]
#[case::cgroup("auto")]
#[case::fallback("off")]
fn a_sigkilled_run_s_writer_is_gone_before_the_next_run_s_command_starts(#[case] cgroup: &str) {
    let sandbox = Sandbox::new();
    let mut holder = Proc::spawn(with_cgroup(
        marked(&sandbox, sandbox.run_sh("writer", &[], WRITER)),
        cgroup,
    ));
    holder.wait_ready();
    wait_for_marks(&sandbox.path().join("marks"));
    let mut next = Proc::spawn(with_cgroup(
        marked(&sandbox, sandbox.run_sh("next", &[], NEXT)),
        cgroup,
    ));
    next.wait_for(Stream::Err, "== app lock: another run of");
    // Its dead-man too: what is left to clear is what this test is about.
    kill_supervisor_and_its_dead_man(holder.pid());
    assert!(wait_exited(holder.pid()));
    let done = next.finish();
    assert_no_write_after_start(&sandbox, &done);
    done.assert_code(0);
    done.assert_stderr_has("its previous holder, run writer");
    done.assert_stderr_has("died holding it; killed the");
    drop(holder);
}

/// The same for `ccci-run lock`: the next holder of the named lock clears what the dead one
/// left before its command starts. Before, `lock` never did.
#[rstest]
#[case::cgroup("auto")]
#[case::fallback("off")]
fn a_sigkilled_lock_holder_s_writer_is_gone_before_the_next_holder_s_command_starts(
    #[case] cgroup: &str,
) {
    let sandbox = Sandbox::new();
    let lock = |script: &str| {
        let mut cmd = sandbox.ccci();
        cmd.args(["lock", "shared", "--", "sh", "-c", script]);
        with_cgroup(marked(&sandbox, cmd), cgroup)
    };
    let mut holder = Proc::spawn(lock(WRITER));
    holder.wait_ready();
    wait_for_marks(&sandbox.path().join("marks"));
    let mut next = Proc::spawn(lock(NEXT));
    next.wait_for(Stream::Err, "waiting as queue ticket");
    // Its dead-man too: what is left to clear is what this test is about.
    kill_supervisor_and_its_dead_man(holder.pid());
    assert!(wait_exited(holder.pid()));
    let done = next.finish();
    assert_no_write_after_start(&sandbox, &done);
    done.assert_code(0);
    done.assert_stderr_has("== lock shared: its previous holder");
    done.assert_stderr_has("died holding it; killed the");
    drop(holder);
}

/// Wait (at most [`PATIENCE`]) for `count` opens of `path` after this call; false when `rerun`
/// ended first.
fn wait_for_opens(path: &Path, count: usize, rerun: &mut Proc) -> bool {
    let mut inotify = inotify::Inotify::init().unwrap();
    inotify
        .watches()
        .add(path, inotify::WatchMask::OPEN)
        .unwrap();
    let until = Instant::now() + PATIENCE;
    let mut seen = 0;
    let mut buffer = [0u8; 1024];
    while seen < count {
        assert!(
            Instant::now() < until,
            "the rerun did not come back to its guard"
        );
        if matches!(rerun.child.try_wait(), Ok(Some(_))) {
            return false;
        }
        let mut fds = [nix::poll::PollFd::new(
            inotify.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(100u8));
        if let Ok(events) = inotify.read_events(&mut buffer) {
            seen += events.count();
        }
    }
    true
}

/// A run's id is run again while a janitor's probe (retention, the record of a reap) holds its
/// guard for a moment: the rerun waits for the probe and runs. The finished run cleared its
/// holder line before it let go of the guard; a SIGKILLed one could not, and is judged dead.
/// Before, the line a finished run left made the rerun fail at once (125, "already live").
#[rstest]
#[case::finished(false)]
#[case::sigkilled(true)]
fn a_finished_run_s_id_is_never_refused_while_a_probe_holds_its_guard(#[case] sigkill: bool) {
    let sandbox = Sandbox::new();
    let mut first = Proc::spawn(sandbox.run_sh("again", &[], "echo ready $$; read line || :"));
    first.wait_ready();
    if sigkill {
        signal(first.pid(), Signal::SIGKILL);
        assert!(wait_exited(first.pid()));
        drop(first);
    } else {
        first.close_stdin();
        first.finish().assert_code(0);
    }
    let guard = sandbox.runs().join("again/run.lock");
    let mut probe = sandbox.hold_with_flock(&guard);
    let mut rerun = Proc::spawn(sandbox.run_sh("again", &[], "echo rerun-ran"));
    // Two looks at the guard: the rerun found it held and came back, waiting.
    if !wait_for_opens(&guard, 2, &mut rerun) {
        panic!(
            "the rerun ended instead of waiting for the probe\n{}",
            rerun.finish().transcript()
        );
    }
    probe.close_stdin();
    probe.finish().assert_code(0);
    let done = rerun.finish();
    done.assert_code(0);
    assert_eq!(done.out, ["rerun-ran"], "{}", done.transcript());
}

/// Waiters of one named lock in two pid namespaces keep their places: each judges the ticket
/// ahead by its owner's identity, which the host resolves in the namespace and the namespace
/// cannot (then the owner's keepalive speaks for it). Before, the pid in a ticket was looked up
/// in the reader's own `/proc`, a live waiter's ticket was removed as dead and its owner went to
/// the back of the queue.
#[rstest]
#[case::namespaced_waiter_first(true)]
#[case::host_waiter_first(false)]
fn named_lock_waiters_in_two_pid_namespaces_are_served_in_order(#[case] namespaced_first: bool) {
    let sandbox = Sandbox::new();
    let log = sandbox.path().join("order.log");
    let lock = |script: &str| {
        let mut cmd = sandbox.ccci();
        cmd.args(["lock", "shared", "--", "sh", "-c", script]);
        cmd
    };
    let mut holder = Proc::spawn(lock("echo ready $$; read line || :"));
    holder.wait_ready();
    let waiter = |id: &str, namespaced: bool| {
        let cmd = lock(&format!("echo {id} >> {}", crate::util::sh_quote(&log)));
        let mut w = Proc::spawn(if namespaced {
            in_pid_namespace(&cmd)
        } else {
            cmd
        });
        let line = w.wait_for(Stream::Err, "waiting as queue ticket");
        (w, line)
    };
    // The head waits in the kernel's flock queue; the two behind it only by their tickets,
    // and each sees who is ahead.
    let (head, _) = waiter("head", false);
    let (first, line) = waiter("first", namespaced_first);
    assert!(line.contains("1 ticket(s) ahead"), "{line}");
    let (second, line) = waiter("second", !namespaced_first);
    assert!(line.contains("2 ticket(s) ahead"), "{line}");
    holder.close_stdin();
    holder.finish().assert_code(0);
    for w in [head, first, second] {
        let done = w.finish();
        done.assert_code(0);
        assert!(
            !done.err.iter().any(|l| l.contains("our ticket vanished")),
            "a live waiter's ticket was removed\n{}",
            done.transcript()
        );
    }
    let order: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(order, ["head", "first", "second"]);
}

/// A janitor whose runs dir does not exist (a typo, a configuration not set up) has no
/// configuration to judge leftovers for: it kills nothing of anyone's, and says so.
#[test]
fn a_janitor_without_its_runs_dir_judges_no_one_s_leftovers() {
    let sandbox = Sandbox::new();
    let mut proc = Proc::spawn(sandbox.run_sh("dead", &[], LIVE));
    let daemon = pid_line(&mut proc, "daemon ");
    proc.wait_ready();
    // Its dead-man too: what is left to clear is what this test is about.
    kill_supervisor_and_its_dead_man(proc.pid());
    assert!(wait_exited(proc.pid()));
    let mut cmd = sandbox.ccci();
    cmd.arg("--runs-dir")
        .arg(sandbox.path().join("no-such-runs"))
        .args(["janitor", "--json"]);
    let done = run(cmd);
    done.assert_code(0);
    done.assert_stderr_has(
        "(--runs-dir, CCCI_RUNS_DIR, runs_dir) does not exist: nothing there yet",
    );
    assert!(process_alive(daemon), "{}", done.transcript());
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert!(!process_alive(daemon), "{report:#}");
    drop(proc);
}

/// The next holder runs in a pid namespace and the dead one ran on the host, which it cannot
/// see: the holder line left in the lock proves the holder let go of it (a holder clears its line
/// first, and lets go only at its exit), so its cgroup, reachable through the shared cgroup tree,
/// is killed and removed before the command starts, and what might run outside it is said to be
/// out of sight. Without cgroups nothing of it can be reached from the namespace: it says so.
#[rstest]
#[case::cgroup("auto")]
#[case::fallback("off")]
fn a_namespaced_next_holder_clears_what_it_can_reach_of_a_host_holder(#[case] cgroup: &str) {
    let sandbox = Sandbox::new();
    let mut holder = Proc::spawn(with_cgroup(
        marked(&sandbox, sandbox.run_sh("writer", &[], WRITER)),
        cgroup,
    ));
    holder.wait_ready();
    wait_for_marks(&sandbox.path().join("marks"));
    let mut next = Proc::spawn(in_pid_namespace(&with_cgroup(
        marked(&sandbox, sandbox.run_sh("next", &[], NEXT)),
        cgroup,
    )));
    next.wait_for(Stream::Err, "== app lock: another run of");
    // Its dead-man too: what is left to clear is what this test is about.
    kill_supervisor_and_its_dead_man(holder.pid());
    assert!(wait_exited(holder.pid()));
    let done = next.finish();
    done.assert_code(0);
    if cgroup == "auto" {
        assert_no_write_after_start(&sandbox, &done);
        done.assert_stderr_has("let go of it without clearing its line; killed the");
        done.assert_stderr_has("cannot be seen from here");
    } else {
        done.assert_stderr_has("nothing of it was within reach");
        // The host's janitor can see it, and clears it.
        let (report, janitor) = sandbox.janitor(&[]);
        janitor.assert_code(0);
        assert!(
            !report["leftover_processes"].as_array().unwrap().is_empty(),
            "{report:#}"
        );
    }
    drop(holder);
}
