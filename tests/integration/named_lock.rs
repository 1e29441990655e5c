//! `ccci-run lock NAME`: the fair ticket queue, with real waiters, real flocks and real signals.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

use nix::sys::signal::Signal;
use rstest::rstest;

use crate::util::{Proc, Sandbox, Stream, list, run, sh_quote, signal, wait_exited};

const WAITING: &str = "waiting as queue ticket";

fn lock_cmd(sandbox: &Sandbox, extra: &[&str], script: &str) -> Command {
    let mut cmd = sandbox.ccci();
    cmd.args(["lock", "shared"])
        .args(extra)
        .args(["--", "sh", "-c", script]);
    cmd
}

fn queue(sandbox: &Sandbox) -> PathBuf {
    sandbox.locks().join("ccci-shared.lock.queue")
}

fn tickets(sandbox: &Sandbox) -> Vec<String> {
    list(&queue(sandbox))
        .into_iter()
        .filter(|n| !n.starts_with('.'))
        .collect()
}

/// A holder whose command waits on its stdin: close it to release the lock.
fn holder(sandbox: &Sandbox) -> Proc {
    let mut h = Proc::spawn(lock_cmd(sandbox, &[], "echo ready $$; read line || :"));
    h.wait_ready();
    h
}

/// Start a waiter whose command appends `id` to `log`; returns once it printed its waiting line.
fn waiter(sandbox: &Sandbox, log: &Path, id: &str, extra: &[&str]) -> Proc {
    let script = format!("echo {id} >> {}", sh_quote(log));
    let mut w = Proc::spawn(lock_cmd(sandbox, extra, &script));
    w.wait_for(Stream::Err, WAITING);
    w
}

/// Wait until the process `pid` is blocked in the kernel on a flock: a `->` line of
/// /proc/locks names it. The waiting line comes before that, so a test of what a parked head
/// keeps must wait for this instead.
fn wait_parked(pid: i32) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let locks = std::fs::read_to_string("/proc/locks").unwrap();
        let parked = locks.lines().any(|line| {
            let mut fields = line.split_whitespace().skip(1);
            fields.next() == Some("->") && fields.nth(3) == Some(pid.to_string().as_str())
        });
        if parked {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "waiter {pid} did not block on the lock within 10 s:\n{locks}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn set_age(path: &Path, age: Duration) {
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(SystemTime::now() - age)
        .unwrap();
}

/// Release the holder, let every waiter finish, and return the order they were served in.
fn release_and_serve(holder: Proc, waiters: Vec<Proc>, log: &Path) -> Vec<String> {
    let mut holder = holder;
    holder.close_stdin();
    holder.finish().assert_code(0);
    for w in waiters {
        w.finish().assert_code(0);
    }
    order(log)
}

fn order(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn waiters_are_served_in_arrival_order() {
    let sandbox = Sandbox::new();
    let log = sandbox.path().join("order.log");
    let mut h = holder(&sandbox);
    let waiters: Vec<Proc> = (1..=5)
        .map(|n| waiter(&sandbox, &log, &format!("w{n}"), &[]))
        .collect();
    h.close_stdin();
    h.finish().assert_code(0);
    for w in waiters {
        w.finish().assert_code(0);
    }
    assert_eq!(order(&log), ["w1", "w2", "w3", "w4", "w5"]);
    assert!(tickets(&sandbox).is_empty(), "{:?}", tickets(&sandbox));
}

/// A fast ticket goes before normal tickets still waiting. A normal head already parked in the
/// kernel is not overtaken for certain: the fast ticket, now the queue's head, blocks on the same
/// flock, and at the release the kernel wakes both, so either may go first; what holds is that
/// the fast one waits one holder more at most and the normal ticket still queued goes last.
#[test]
fn fast_ticket_overtakes_waiting_normal_ones_behind_a_parked_head() {
    let sandbox = Sandbox::new();
    let log = sandbox.path().join("order.log");
    let h = holder(&sandbox);
    let n1 = waiter(&sandbox, &log, "n1", &[]);
    wait_parked(n1.pid());
    let n2 = waiter(&sandbox, &log, "n2", &[]);
    let f = waiter(&sandbox, &log, "f", &["--class", "fast"]);
    // Both the parked head and the fast ticket are in the kernel before the release.
    wait_parked(f.pid());
    let served = release_and_serve(h, vec![n1, n2, f], &log);
    assert_eq!(served.len(), 3, "{served:?}");
    assert_eq!(
        served[2], "n2",
        "a normal ticket still queued went before the fast one: {served:?}"
    );
    let mut first_two = served[..2].to_vec();
    first_two.sort();
    assert_eq!(first_two, ["f", "n1"], "{served:?}");
}

/// A normal ticket that waited past --promote-after goes before a fast one that came later.
#[test]
fn promoted_normal_ticket_goes_before_a_later_fast_one() {
    let sandbox = Sandbox::new();
    let log = sandbox.path().join("order.log");
    let h = holder(&sandbox);
    let n1 = waiter(&sandbox, &log, "n1", &[]);
    wait_parked(n1.pid());
    let mut n2 = waiter(&sandbox, &log, "n2", &["--promote-after", "0.5"]);
    n2.wait_for(Stream::Err, "promoted to the fast class");
    let f = waiter(&sandbox, &log, "f", &["--class", "fast"]);
    assert_eq!(
        release_and_serve(h, vec![n1, n2, f], &log),
        ["n1", "n2", "f"]
    );
}

/// The parked head keeps touching its ticket, so another waiter's reaper never takes it for
/// stale and jumps the queue.
#[test]
fn parked_head_s_ticket_survives_another_waiter_s_reaper() {
    let sandbox = Sandbox::new();
    let log = sandbox.path().join("order.log");
    let mut h = holder(&sandbox);
    let n1 = waiter(&sandbox, &log, "n1", &[]);
    let head = queue(&sandbox).join(tickets(&sandbox)[0].clone());
    // Make it look abandoned, then wait (inotify, not a sleep) for its keepalive to touch it.
    let mut watch = inotify::Inotify::init().unwrap();
    watch
        .watches()
        .add(&head, inotify::WatchMask::ATTRIB)
        .unwrap();
    set_age(&head, Duration::from_secs(7200));
    let mut buf = [0u8; 1024];
    let _ = watch.read_events(&mut buf); // the ATTRIB of our own set_age
    let mut fds = [nix::poll::PollFd::new(
        watch.as_fd(),
        nix::poll::PollFlags::POLLIN,
    )];
    let n = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(10_000u16)).unwrap();
    assert_eq!(n, 1, "the parked head did not touch its ticket within 10 s");
    let n2 = waiter(&sandbox, &log, "n2", &[]);
    assert!(
        head.exists(),
        "another waiter reaped the parked head's ticket"
    );
    h.close_stdin();
    h.finish().assert_code(0);
    for w in [n1, n2] {
        w.finish().assert_code(0);
    }
    assert_eq!(order(&log), ["n1", "n2"]);
}

#[test]
fn dead_and_stale_tickets_are_reaped_by_whoever_looks() {
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(queue(&sandbox)).unwrap();
    std::fs::set_permissions(
        queue(&sandbox),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let mut gone = Command::new("true").spawn().unwrap();
    let dead_pid = gone.id();
    gone.wait().unwrap();
    let dead = queue(&sandbox).join(format!("1-000000000000-{dead_pid}"));
    std::fs::write(&dead, "").unwrap();
    set_age(&dead, Duration::from_secs(20));
    // Alive (pid 1 never dies) but untouched for two hours: a recycled pid.
    let stale = queue(&sandbox).join("0-000000000001-1");
    std::fs::write(&stale, "").unwrap();
    set_age(&stale, Duration::from_secs(7200));
    let done = run(lock_cmd(&sandbox, &["--wait", "30"], "echo got-it"));
    done.assert_code(0);
    assert_eq!(done.out, ["got-it"]);
    assert!(tickets(&sandbox).is_empty(), "{:?}", tickets(&sandbox));
}

#[test]
fn timeout_names_the_ticket_and_the_head_exits_75_and_cleans_up() {
    let sandbox = Sandbox::new();
    let log = sandbox.path().join("order.log");
    let mut h = holder(&sandbox);
    // The only ticket queued: it is the head itself.
    let done = run(lock_cmd(&sandbox, &["--wait", "0.3"], "echo must-not-run"));
    done.assert_code(75);
    done.assert_stderr_has(
        "lock shared not acquired within 0.3 s as queue ticket 1 (normal); (no other ticket queued)",
    );
    // Behind a parked head.
    let n1 = waiter(&sandbox, &log, "n1", &[]);
    let done = run(lock_cmd(
        &sandbox,
        &["--wait", "0.3", "--class", "normal"],
        "echo must-not-run",
    ));
    done.assert_code(75);
    done.assert_stderr_has(
        "not acquired within 0.3 s as queue ticket 3 (normal); head of queue is 2 (normal, pid",
    );
    assert!(done.out.is_empty());
    assert_eq!(
        tickets(&sandbox).len(),
        1,
        "only the parked head's ticket is left"
    );
    h.close_stdin();
    h.finish().assert_code(0);
    n1.finish().assert_code(0);
    assert!(tickets(&sandbox).is_empty());
}

#[rstest]
#[case(Signal::SIGTERM, 143)]
#[case(Signal::SIGINT, 130)]
#[case(Signal::SIGHUP, 129)]
fn signal_while_waiting_removes_the_ticket(#[case] sig: Signal, #[case] code: i32) {
    let sandbox = Sandbox::new();
    let log = sandbox.path().join("order.log");
    let mut h = holder(&sandbox);
    let parked = waiter(&sandbox, &log, "parked", &[]);
    let behind = waiter(&sandbox, &log, "behind", &[]);
    for w in [parked, behind] {
        signal(w.pid(), sig);
        w.finish().assert_code(code);
    }
    assert!(tickets(&sandbox).is_empty(), "{:?}", tickets(&sandbox));
    assert!(order(&log).is_empty());
    h.close_stdin();
    h.finish().assert_code(0);
}

/// SIGKILL at any point never wedges the queue: the lock is the kernel's, and a dead owner's
/// ticket goes (at once, by its start time; aged here by hand as well, so the 10 s expiry that
/// covers a ticket without one would also let it go).
#[test]
fn sigkilled_waiters_never_wedge_the_queue() {
    let sandbox = Sandbox::new();
    let log = sandbox.path().join("order.log");
    // Killed while holding: its command dies with it and the kernel releases the lock.
    let h = holder(&sandbox);
    signal(h.pid(), Signal::SIGKILL);
    h.finish();
    // Killed while parked and while waiting behind it.
    let mut h = holder(&sandbox);
    let parked = waiter(&sandbox, &log, "parked", &[]);
    let behind = waiter(&sandbox, &log, "behind", &[]);
    for w in [parked, behind] {
        let pid = w.pid();
        signal(pid, Signal::SIGKILL);
        w.finish();
        assert!(wait_exited(pid));
    }
    for t in tickets(&sandbox) {
        set_age(&queue(&sandbox).join(t), Duration::from_secs(20));
    }
    let next = waiter(&sandbox, &log, "next", &[]);
    h.close_stdin();
    h.finish().assert_code(0);
    next.finish().assert_code(0);
    // Killed before publishing, while holding the counter's flock.
    let counter = queue(&sandbox).join(".seq");
    let mut stuck = sandbox.hold_with_flock(&counter);
    let mut late = Proc::spawn(lock_cmd(&sandbox, &[], "echo late"));
    let stuck_pid = stuck.pid();
    signal(stuck_pid, Signal::SIGKILL);
    stuck.close_stdin();
    let _ = stuck.finish();
    late.wait_for(Stream::Out, "late");
    late.finish().assert_code(0);
    assert_eq!(order(&log), ["next"]);
    assert!(tickets(&sandbox).is_empty(), "{:?}", tickets(&sandbox));
}

#[test]
fn command_status_passes_through_and_signals_are_forwarded() {
    let sandbox = Sandbox::new();
    run(lock_cmd(&sandbox, &[], "exit 3")).assert_code(3);
    let mut h = Proc::spawn(lock_cmd(
        &sandbox,
        &[],
        "trap 'echo got-INT; exit 7' INT; echo ready $$; while :; do read line || :; done",
    ));
    h.wait_ready();
    signal(h.pid(), Signal::SIGINT);
    h.wait_for(Stream::Out, "got-INT");
    h.finish().assert_code(130);
}

#[test]
fn reentrant_for_descendants_and_refused_behind_a_dead_ancestor() {
    let sandbox = Sandbox::new();
    let nested = format!(
        "{} --lock-dir {} lock shared -- sh -c 'echo nested \"$CCCI_HELD_LOCKS\"'",
        crate::util::BIN,
        sh_quote(sandbox.locks())
    );
    let done = run(lock_cmd(&sandbox, &[], &nested));
    done.assert_code(0);
    assert!(
        done.out[0].starts_with("nested shared:"),
        "{}",
        done.transcript()
    );
    assert!(
        done.out[0].ends_with(":2"),
        "depth 2 expected: {}",
        done.transcript()
    );
    assert!(!done.stderr().contains(WAITING));

    // An entry whose holder is not holding it (this test process is no holder).
    let mut cmd = lock_cmd(&sandbox, &[], "echo must-not-run");
    cmd.env(
        "CCCI_HELD_LOCKS",
        format!("shared:{}:0:0:1:1", std::process::id()),
    );
    let done = run(cmd);
    done.assert_code(125);
    done.assert_stderr_has("no longer does; refusing to take it behind its back");
}

#[test]
fn command_holds_no_lock_descriptor_and_locks_lists_the_queue() {
    let sandbox = Sandbox::new();
    let log = sandbox.path().join("order.log");
    let mut h = Proc::spawn(lock_cmd(
        &sandbox,
        &[],
        "echo ready $$; ls /proc/$$/fd; echo fds-done; read line || :",
    ));
    h.wait_ready();
    h.wait_for(Stream::Out, "fds-done");
    let w = waiter(&sandbox, &log, "w", &["--class", "fast"]);
    let mut cmd = sandbox.ccci();
    cmd.args(["locks", "--json"]);
    let listing = run(cmd);
    listing.assert_code(0);
    let locks: serde_json::Value =
        serde_json::from_str::<serde_json::Value>(&listing.out.join("\n")).unwrap()["locks"]
            .clone();
    let shared = locks
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "shared")
        .expect("the named lock is listed");
    assert_eq!(shared["kind"], "named");
    assert_eq!(shared["held"], true);
    assert_eq!(shared["holder_pids"], serde_json::json!([h.pid()]));
    let queue = shared["queue"].as_array().unwrap();
    assert_eq!(queue.len(), 1, "{shared:#}");
    assert_eq!(queue[0]["ticket"]["class"], "fast");
    assert_eq!(queue[0]["ticket"]["pid"], w.pid());
    h.close_stdin();
    let done = h.finish();
    done.assert_code(0);
    let begin = done
        .out
        .iter()
        .position(|l| l.starts_with("ready"))
        .unwrap();
    let end = done.out.iter().position(|l| l == "fds-done").unwrap();
    assert_eq!(
        done.out[begin + 1..end],
        ["0", "1", "2"],
        "{}",
        done.transcript()
    );
    w.finish().assert_code(0);
}

/// A stray file that looks like a ticket but is not in canonical form (`…-01`) was taken for a
/// live ticket of pid 1 at the head of the queue, which nobody could remove by its name: every
/// waiter queued behind it (found by fuzzing the ticket parser). It is not a ticket at all.
#[test]
fn non_canonical_ticket_file_never_wedges_the_queue() {
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(queue(&sandbox)).unwrap();
    std::fs::set_permissions(
        queue(&sandbox),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let stray = queue(&sandbox).join("0-000000000000-01");
    std::fs::write(&stray, "").unwrap();
    let done = run(lock_cmd(&sandbox, &["--wait", "5"], "echo got-it"));
    done.assert_code(0);
    assert_eq!(done.out, ["got-it"]);
}

/// A `CCCI_HELD_LOCKS` entry naming a process that is not our ancestor (forged, or leaked into
/// an unrelated environment) is never a grant, and never a reason to refuse: the lock is
/// queued for normally, and the forged entry is not passed on.
#[test]
fn forged_held_locks_entry_of_a_non_ancestor_queues_normally() {
    let sandbox = Sandbox::new();
    let mut stranger = std::process::Command::new("sleep")
        .arg("100000")
        .spawn()
        .unwrap();
    let mut cmd = lock_cmd(&sandbox, &[], "echo ran \"$CCCI_HELD_LOCKS\"");
    cmd.env(
        "CCCI_HELD_LOCKS",
        format!("shared:{}:0:0:1:1", stranger.id()),
    );
    let done = run(cmd);
    stranger.kill().unwrap();
    stranger.wait().unwrap();
    done.assert_code(0);
    done.assert_stderr_has("ignoring CCCI_HELD_LOCKS entry");
    let line = done
        .out
        .iter()
        .find(|l| l.starts_with("ran "))
        .expect("the command ran");
    assert!(
        !line.contains(&format!(":{}:", stranger.id())),
        "the forged entry was passed on: {line}"
    );
}

/// `--wait 0` is a try, as with `flock -w 0`: a free lock is taken, a held one is not.
#[test]
fn wait_zero_takes_a_free_lock_and_gives_up_on_a_held_one() {
    let sandbox = Sandbox::new();
    let took = run(lock_cmd(&sandbox, &["--wait", "0"], "echo took-it"));
    took.assert_code(0);
    assert_eq!(took.out, ["took-it"]);
    let mut h = holder(&sandbox);
    let done = run(lock_cmd(&sandbox, &["--wait", "0"], "echo must-not-run"));
    done.assert_code(75);
    assert!(done.out.is_empty());
    h.close_stdin();
    h.finish().assert_code(0);
    assert!(tickets(&sandbox).is_empty(), "{:?}", tickets(&sandbox));
}

/// Who holds a named lock is written down: `locks` shows it, and a waiter that times out names
/// it.
#[test]
fn the_holder_of_a_named_lock_is_named_by_locks_and_by_a_timeout() {
    let sandbox = Sandbox::new();
    let mut h = holder(&sandbox);
    let holder_pid = h.pid();
    let out = run({
        let mut c = sandbox.ccci();
        c.args(["locks", "--json"]);
        c
    });
    out.assert_code(0);
    let locks: serde_json::Value =
        serde_json::from_str::<serde_json::Value>(&out.out.join("\n")).unwrap()["locks"].clone();
    let named = locks
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "shared")
        .expect("the named lock is listed");
    assert_eq!(named["holder"]["pid"], holder_pid, "{named}");
    let done = run(lock_cmd(&sandbox, &["--wait", "0.2"], "echo must-not-run"));
    done.assert_code(75);
    done.assert_stderr_has(&format!("held by pid {holder_pid} on "));
    h.close_stdin();
    h.finish().assert_code(0);
}

/// A waiter SIGKILLed in the queue leaves its ticket behind; the waiter behind it notices the
/// death through the ticket's owner (pid and start time) and goes on at once, well inside a
/// budget shorter than the ten seconds after which a dead owner's ticket is expired anyway.
#[test]
fn a_sigkilled_waiter_s_ticket_is_skipped_at_once() {
    let sandbox = Sandbox::new();
    let log = sandbox.path().join("order.log");
    let mut h = holder(&sandbox);
    let parked = waiter(&sandbox, &log, "parked", &[]);
    let behind = waiter(&sandbox, &log, "behind", &["--wait", "5"]);
    let pid = parked.pid();
    signal(pid, Signal::SIGKILL);
    parked.finish();
    assert!(wait_exited(pid));
    h.close_stdin();
    h.finish().assert_code(0);
    behind.finish().assert_code(0);
    assert_eq!(order(&log), ["behind"]);
    assert!(tickets(&sandbox).is_empty(), "{:?}", tickets(&sandbox));
}

/// flock(1)'s -n, -w and -E: a lock not acquired ends in exit 75 (or -E's code) at once with
/// -n, after the budget with -w, and the command never runs; a free lock is taken with -n.
#[test]
fn flock_s_nonblock_timeout_and_conflict_exit_code_are_understood() {
    let sandbox = Sandbox::new();
    let ran = sandbox.path().join("ran");
    let script = format!("echo ran >> {}", sh_quote(&ran));
    run(lock_cmd(&sandbox, &["-n"], &script)).assert_code(0);
    assert_eq!(std::fs::read_to_string(&ran).unwrap(), "ran\n");
    let mut h = holder(&sandbox);
    let cases: [(&[&str], i32, f64); 6] = [
        (&["-n"], 75, 0.0),
        (&["--nonblock", "-E", "9"], 9, 0.0),
        (&["--nb", "--conflict-exit-code=100"], 100, 0.0),
        (&["-w", "0.3", "-E", "9"], 9, 0.3),
        (&["--timeout", "0.3"], 75, 0.3),
        (&["--wait", "0.2", "-E", "1"], 1, 0.2),
    ];
    for (extra, code, budget) in cases {
        let started = std::time::Instant::now();
        let done = run(lock_cmd(&sandbox, extra, &script));
        let took = started.elapsed().as_secs_f64();
        done.assert_code(code);
        done.assert_stderr_has("ccci-run: error: lock shared not acquired within");
        assert!(took >= budget, "{extra:?}: gave up after {took} s");
        assert!(took < budget + 5.0, "{extra:?}: waited {took} s");
    }
    assert_eq!(std::fs::read_to_string(&ran).unwrap(), "ran\n");
    h.close_stdin();
    h.finish().assert_code(0);
    assert!(tickets(&sandbox).is_empty(), "{:?}", tickets(&sandbox));
}

/// A conflict exit code ccci-run already gives a meaning to (success, invalid input, a lost
/// lock, its own failure, a command not found, a signal), or no exit code at all, is refused
/// before anything is waited for.
#[rstest]
#[case("0", "0 would say the command ran and succeeded")]
#[case("2", "2 means invalid input")]
#[case("76", "76 means a held lock was lost")]
#[case("125", "125 means ccci-run itself failed")]
#[case("127", "126 and 127 mean the command could not be executed or found")]
#[case("143", "128-255 mean a signal")]
#[case("256", "exit codes go up to 255")]
#[case("x", "is not an exit code")]
fn conflict_exit_codes_already_taken_are_refused(#[case] code: &str, #[case] why: &str) {
    let sandbox = Sandbox::new();
    let ran = sandbox.path().join("ran");
    let script = format!("echo ran >> {}", sh_quote(&ran));
    let done = run(lock_cmd(&sandbox, &["-E", code], &script));
    done.assert_code(2);
    done.assert_stderr_has(&format!(
        "invalid value '{code}' for '--conflict-exit-code <CODE>'"
    ));
    done.assert_stderr_has(why);
    done.assert_stderr_has("choose 1, 3-75 or 77-124");
    assert!(!ran.exists());
    let done = run(lock_cmd(&sandbox, &["-n", "--wait", "5"], &script));
    done.assert_code(2);
    done.assert_stderr_has("cannot be used with");
    assert!(!ran.exists());
}

/// The fencing token a holder's command was given, from its `token=N` line.
fn fencing_token(line: &str) -> i64 {
    line.trim()
        .strip_prefix("token=")
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no fencing token in {line:?}"))
}

/// Successive holders of a named lock get strictly increasing fencing tokens
/// (`CCCI_FENCING_TOKEN`): one after another, through the queue, after the lock file is
/// removed, after the queue directory (and its counter) is gone as after a reboot with the lock
/// dir on tmpfs, and when the counter is ahead of the clock.
#[test]
fn successive_holders_see_strictly_increasing_fencing_tokens() {
    let sandbox = Sandbox::new();
    let token = || {
        let done = run(lock_cmd(&sandbox, &[], "echo token=$CCCI_FENCING_TOKEN"));
        done.assert_code(0);
        fencing_token(&done.out[0])
    };
    let mut seen: Vec<i64> = (0..3).map(|_| token()).collect();

    // Holders served through the queue, in the order they held it.
    let log = sandbox.path().join("tokens.log");
    let mut h = Proc::spawn(lock_cmd(
        &sandbox,
        &[],
        "echo ready $$; echo token=$CCCI_FENCING_TOKEN; read line || :",
    ));
    h.wait_ready();
    seen.push(fencing_token(&h.wait_for(Stream::Out, "token=")));
    let waiters: Vec<Proc> = (0..3)
        .map(|_| {
            let script = format!("echo token=$CCCI_FENCING_TOKEN >> {}", sh_quote(&log));
            let mut w = Proc::spawn(lock_cmd(&sandbox, &[], &script));
            w.wait_for(Stream::Err, WAITING);
            w
        })
        .collect();
    h.close_stdin();
    h.finish().assert_code(0);
    for w in waiters {
        w.finish().assert_code(0);
    }
    seen.extend(order(&log).iter().map(|l| fencing_token(l)));

    // The lock file removed (by hand: nothing of ccci-run removes a named lock's files): the
    // counter beside it carries on.
    std::fs::remove_file(sandbox.locks().join("ccci-shared.lock")).unwrap();
    let before = std::fs::read_to_string(queue(&sandbox).join(".fencing")).unwrap();
    seen.push(token());
    assert_eq!(before.trim().parse::<i64>().unwrap(), seen[seen.len() - 2]);

    // The queue directory gone with its counter: the next token is still above the last.
    std::fs::remove_dir_all(queue(&sandbox)).unwrap();
    seen.push(token());

    // A counter ahead of the clock (tokens given faster than one a microsecond) still rules.
    let ahead = seen.last().unwrap() + 10_000_000_000;
    std::fs::write(queue(&sandbox).join(".fencing"), format!("{ahead}\n")).unwrap();
    assert_eq!(token(), ahead + 1);
    assert_eq!(token(), ahead + 2);
    // A nested `lock` of the same name is granted its ancestor's hold, and its token.
    let nested = format!(
        "echo token=$CCCI_FENCING_TOKEN; {} --lock-dir {} lock shared -- sh -c 'echo token=$CCCI_FENCING_TOKEN'",
        crate::util::BIN,
        sh_quote(sandbox.locks())
    );
    let done = run(lock_cmd(&sandbox, &[], &nested));
    done.assert_code(0);
    let tokens: Vec<i64> = done.out.iter().map(|l| fencing_token(l)).collect();
    assert_eq!(tokens, [ahead + 3, ahead + 3], "{}", done.transcript());
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "tokens must rise with every holder: {seen:?}"
    );
}

/// A waiter SIGKILLed last in line has nobody behind it to remove its ticket: the janitor's
/// sweep does (and says so), so `locks` lists no dead waiter and nothing of it is left. The
/// live holder's lock and a live waiter's ticket are left alone.
#[test]
fn a_dead_waiter_s_ticket_with_nobody_behind_it_is_tidied_by_the_janitor() {
    let sandbox = Sandbox::new();
    let log = sandbox.path().join("order.log");
    let mut h = holder(&sandbox);
    let alive = waiter(&sandbox, &log, "alive", &[]);
    let last = waiter(&sandbox, &log, "last", &[]);
    let pid = last.pid();
    signal(pid, Signal::SIGKILL);
    last.finish();
    assert!(wait_exited(pid));
    assert_eq!(tickets(&sandbox).len(), 2, "{:?}", tickets(&sandbox));
    let dead = queue(&sandbox).join(
        tickets(&sandbox)
            .into_iter()
            .find(|t| t.ends_with(&format!("-{pid}")))
            .expect("the dead waiter's ticket"),
    );
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    let tidied: Vec<&str> = report["tidied"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p.as_str())
        .collect();
    assert_eq!(tidied, [dead.to_str().unwrap()], "{report:#}");
    let left = tickets(&sandbox);
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].ends_with(&format!("-{}", alive.pid())), "{left:?}");
    h.close_stdin();
    h.finish().assert_code(0);
    alive.finish().assert_code(0);
    assert_eq!(order(&log), ["alive"]);
    assert!(tickets(&sandbox).is_empty(), "{:?}", tickets(&sandbox));
}

/// `locks` says since when a holder holds the lock, not since when it began to wait: a waiter
/// that took the lock after the first holder let go shows a time after that moment. While it
/// waits, the table's WAITERS column counts it.
#[test]
fn a_holder_s_since_is_when_it_took_the_lock() {
    let sandbox = Sandbox::new();
    let first = holder(&sandbox);
    let mut second = Proc::spawn(lock_cmd(
        &sandbox,
        &["--wait", "60"],
        "echo ready $$; read line || :",
    ));
    second.wait_for(Stream::Err, WAITING);
    // The table counts the waiter in a column of its own.
    let mut cmd = sandbox.ccci();
    cmd.arg("locks");
    let table = run(cmd);
    assert!(table.out[0].contains(" WAITERS "), "{}", table.transcript());
    let row = table
        .out
        .iter()
        .find(|l| l.starts_with("named shared "))
        .unwrap_or_else(|| panic!("{}", table.transcript()));
    assert_eq!(row.split_whitespace().nth(5), Some("1"), "{row}");
    let released = std::time::SystemTime::now();
    let mut first = first;
    first.close_stdin();
    first.finish().assert_code(0);
    second.wait_ready();
    let mut cmd = sandbox.ccci();
    cmd.args(["locks", "--json"]);
    let done = run(cmd);
    done.assert_code(0);
    let listing: serde_json::Value =
        serde_json::from_str::<serde_json::Value>(&done.out.join("\n")).unwrap()["locks"].clone();
    let lock = listing
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "shared")
        .unwrap_or_else(|| panic!("{listing:#}"));
    let since = lock["holder"]["started_at"]
        .as_str()
        .unwrap_or_else(|| panic!("{lock:#}"));
    let since = humantime::parse_rfc3339(since).unwrap();
    // The timestamp has milliseconds: allow for the truncation.
    assert!(
        since + Duration::from_millis(1) >= released,
        "since {since:?} is before the first holder let go at {released:?}: {lock:#}"
    );
    second.close_stdin();
    second.finish().assert_code(0);
}
