//! Under the limits a busy CI host hits: no run without its bound, no misleading exit code.
//! The limits are real (`prlimit --nproc` on an unprivileged user, whom it binds: root is exempt).
//! RLIMIT_NPROC counts every process of the user, so each test has a uid of its own that no
//! other process uses.

use std::path::Path;
use std::process::Command;

use crate::util::{BIN, Proc, Stream, run};

/// A scratch host owned by user `uid`: its runs, locks and state directories.
pub(crate) fn host_of(uid: u32) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for sub in ["runs", "abra", "locks", "state"] {
        std::fs::create_dir_all(dir.path().join(sub)).unwrap();
    }
    let status = Command::new("chown")
        .args(["-R", &format!("{uid}:{uid}")])
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(status.success());
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    dir
}

/// `ccci-run run` as user `uid` with at most `nproc` processes and threads.
fn limited_run(uid: u32, dir: &Path, nproc: u32, run_id: &str, script: &str) -> Command {
    let mut cmd = limited(uid, dir, nproc, None);
    cmd.args(["run", "--recipe", "custom-html", "--no-fetch"])
        .args(["--run-id", run_id, "--", "sh", "-c", script]);
    cmd
}

/// `ccci-run` with the global options of host `dir` (and etcd at `etcd`, if any), as user
/// `uid` with at most `nproc` processes and threads; the subcommand is for the caller to add.
pub(crate) fn limited(uid: u32, dir: &Path, nproc: u32, etcd: Option<&str>) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args([
        &format!("--reuid={uid}"),
        &format!("--regid={uid}"),
        "--clear-groups",
        "prlimit",
        &format!("--nproc={nproc}"),
        BIN,
        "--runs-dir",
    ])
    .arg(dir.join("runs"))
    .arg("--abra-home")
    .arg(dir.join("abra"))
    .arg("--lock-dir")
    .arg(dir.join("locks"))
    .arg("--state-dir")
    .arg(dir.join("state"))
    .args(["--docker", "off"]);
    if let Some(endpoints) = etcd {
        cmd.args(["--etcd-endpoints", endpoints]);
    }
    crate::util::without_ccci_env(&mut cmd);
    cmd.env("CCCI_CONFIG", "/dev/null").env("HOME", dir);
    cmd
}

fn record(dir: &Path, run_id: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join(format!("runs/{run_id}/run.json"))).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The app lock of every run here is free (nothing was taken, or it was let go).
fn no_lock_held(dir: &Path) {
    for entry in std::fs::read_dir(dir.join("locks")).unwrap() {
        let path = entry.unwrap().path();
        assert!(
            crate::util::lock_is_free(&path),
            "{} is held",
            path.display()
        );
    }
}

/// When the watchdog thread (the run's last-resort bound) cannot be started, the run does not
/// start: 125, naming the limit, no lock taken, the command never run.
#[test]
fn no_run_starts_without_its_watchdog() {
    let dir = host_of(61_001);
    let done = run(limited_run(
        61_001,
        dir.path(),
        1,
        "nowatch",
        "echo command-ran",
    ));
    done.assert_code(125);
    done.assert_stderr_has("failed to start the watchdog thread");
    done.assert_stderr_has("RLIMIT_NPROC");
    assert!(!done.out.iter().any(|l| l == "command-ran"));
    let record = record(dir.path(), "nowatch");
    assert_eq!(record["exit_code"], 125, "{record:#}");
    assert!(
        !record["phases"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "app-lock"),
        "no lock may be taken: {record:#}"
    );
    no_lock_held(dir.path());
}

/// A command that cannot be forked for want of processes is tried again with backoff, then the
/// run gives up with 125 naming the limit (126 and 127 stay the command's own).
#[test]
fn a_fork_that_keeps_failing_is_125_naming_the_limit_not_126() {
    let dir = host_of(61_002);
    let done = run(limited_run(
        61_002,
        // Main thread, watchdog and the run's dead-man (its fence): no room for the command.
        dir.path(),
        3,
        "nofork",
        "echo command-ran",
    ));
    done.assert_code(125);
    done.assert_stderr_has("retrying for up to 5s");
    done.assert_stderr_has("a limit on the processes or threads this user may have");
    assert!(!done.out.iter().any(|l| l == "command-ran"));
    assert_eq!(record(dir.path(), "nofork")["exit_code"], 125);
    no_lock_held(dir.path());
}

/// A fork that fails for a moment (another process of the user holds the last slot, then
/// goes) is retried: the command starts and the run ends as the command does.
#[test]
fn a_fork_that_fails_for_a_moment_is_retried_and_the_command_runs() {
    let dir = host_of(61_003);
    let mut blocker = Blocker(
        Command::new("setpriv")
            .args(["--reuid=61003", "--regid=61003", "--clear-groups"])
            .args(["sleep", "100000"])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    // Main thread, watchdog, the run's dead-man (its fence) and the command make four; the
    // blocker takes the fourth slot.
    let mut proc = Proc::spawn(limited_run(
        61_003,
        dir.path(),
        4,
        "later",
        "echo command-ran",
    ));
    proc.wait_for(Stream::Err, "retrying for up to 5s");
    blocker.0.kill().unwrap();
    blocker.0.wait().unwrap();
    let done = proc.finish();
    done.assert_code(0);
    assert!(
        done.out.iter().any(|l| l == "command-ran"),
        "{}",
        done.transcript()
    );
    assert_eq!(record(dir.path(), "later")["exit_code"], 0);
}

/// A run parked on its app lock, and `lock` at the head of its queue, wait for the flock on a
/// helper thread: one that cannot be had is 125 naming the limit (before, a bare "Resource
/// temporarily unavailable"), the command never runs, and no ticket is left in the queue.
#[test]
fn waiting_for_a_held_lock_without_a_spare_thread_is_125_naming_the_limit() {
    const UID: u32 = 61_021;
    let dir = host_of(UID);
    // With room, once: the app lock file and the named lock's queue exist, owned by the user.
    for args in [
        &["lock", "cache", "--", "true"][..],
        &[
            "run",
            "--recipe",
            "custom-html",
            "--no-fetch",
            "--run-id",
            "room",
            "--",
            "true",
        ],
    ] {
        let mut cmd = limited(UID, dir.path(), 64, None);
        cmd.args(args);
        run(cmd).assert_code(0);
    }
    let locks = dir.path().join("locks");
    let app_lock = crate::util::list(&locks)
        .into_iter()
        .find(|n| n.starts_with("cc-ci-app-") && n.ends_with(".lock"))
        .expect("the run's app lock file");
    for (file, args, nproc) in [
        (
            "ccci-cache.lock",
            &["lock", "cache", "--", "echo", "command-ran"][..],
            // The main thread and the fence, forked at the start.
            2,
        ),
        (
            app_lock.as_str(),
            &[
                "run",
                "--recipe",
                "custom-html",
                "--no-fetch",
                "--run-id",
                "parked",
                "--",
                "echo",
                "command-ran",
            ],
            // The main thread, the fence and the watchdog.
            3,
        ),
    ] {
        // Root holds the lock: root's processes do not count against the user's limit.
        let mut holder = Proc::spawn({
            let mut cmd = Command::new("flock");
            cmd.arg(locks.join(file))
                .args(["sh", "-c", "echo ready $$; read line || :"]);
            cmd
        });
        holder.wait_ready();
        let mut cmd = limited(UID, dir.path(), nproc, None);
        cmd.args(args);
        let done = run(cmd);
        done.assert_code(125);
        done.assert_stderr_has("failed to wait for lock file");
        done.assert_stderr_has("RLIMIT_NPROC");
        assert!(
            !done.stderr().contains("panicked") && !done.out.iter().any(|l| l == "command-ran"),
            "{}",
            done.transcript()
        );
        holder.close_stdin();
        holder.finish();
        assert!(crate::util::lock_is_free(&locks.join(file)));
    }
    let tickets: Vec<String> = crate::util::list(&locks.join("ccci-cache.lock.queue"))
        .into_iter()
        .filter(|t| !t.starts_with('.'))
        .collect();
    assert!(tickets.is_empty(), "tickets left: {tickets:?}");
    assert_eq!(record(dir.path(), "parked")["exit_code"], 125);
}

/// A process of the test's user, killed however the test ends.
pub(crate) struct Blocker(pub(crate) std::process::Child);

impl Drop for Blocker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// With etcd, every subcommand that takes or reads locks needs a thread for the etcd client:
/// one that cannot be had is the subcommand's documented error naming the limit (125 for `run`
/// and `lock`, 1 for `janitor` and `locks`), never the runtime's panic (101), and nothing is
/// left in etcd or on disk. One process and no more: the main thread is all there is.
#[cfg(feature = "etcd")]
#[test]
fn with_etcd_a_thread_that_cannot_be_created_is_an_error_naming_the_limit_not_a_panic() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let endpoints = cluster.endpoints();
    let dir = host_of(61_010);
    let cases: [(&[&str], i32); 4] = [
        (
            &[
                "run",
                "--recipe",
                "custom-html",
                "--no-fetch",
                "--run-id",
                "nothread",
                "--",
                "echo",
                "command-ran",
            ],
            125,
        ),
        (&["lock", "cache", "--", "echo", "command-ran"], 125),
        (&["janitor"], 1),
        (&["locks"], 1),
    ];
    for (args, code) in cases {
        let mut cmd = limited(61_010, dir.path(), 1, Some(&endpoints));
        cmd.args(args);
        let done = run(cmd);
        done.assert_code(code);
        // The janitor reports its errors in its report, on stdout.
        let said = format!("{}\n{}", done.out.join("\n"), done.stderr());
        assert!(
            said.contains("failed to start the etcd client thread")
                && said.contains("RLIMIT_NPROC"),
            "{args:?}: {}",
            done.transcript()
        );
        assert!(
            !said.contains("panicked"),
            "{args:?}: {}",
            done.transcript()
        );
        assert!(
            !done.out.iter().any(|l| l == "command-ran"),
            "{args:?}: {}",
            done.transcript()
        );
    }
    // Refused before it began, as when etcd cannot be reached: no run directory.
    assert!(!dir.path().join("runs/nothread").exists());
    assert_eq!(cluster.keys(), "", "nothing may be left in etcd");
    no_lock_held(dir.path());

    // The same host with room for the threads: every one of them works, so the errors above
    // were the limit's.
    for (args, _) in cases {
        let args: Vec<&str> = args
            .iter()
            .map(|a| if *a == "nothread" { "withroom" } else { a })
            .collect();
        let mut cmd = limited(61_010, dir.path(), 64, Some(&endpoints));
        cmd.args(&args);
        run(cmd).assert_code(0);
    }
    leased_keys_go(&cluster);
}

/// Nothing is left in etcd once the leases of runs that worked have had their time: a release
/// that a busy cluster did not answer within its bound leaves the keys to their lease, which
/// takes them within its TTL; a key bound to no lease would stay for good.
#[cfg(feature = "etcd")]
fn leased_keys_go(cluster: &crate::etcd_cluster::Cluster) {
    // The default lease TTL, and etcd's expiry sweep on a busy host.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut left = cluster.keys();
    while !left.is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(200));
        left = cluster.keys();
    }
    assert_eq!(left, "", "nothing may be left in etcd");
}

/// An etcd endpoint given by host name is looked up before the client's runtime has it: left to
/// the runtime, the lookup needs a blocking-pool thread the limit does not allow, and that was a
/// panic inside the client ("OS can't spawn worker thread") reported as "service was not ready"
/// or "no answer within 5 s". With room for exactly the etcd client thread and no more, `locks`
/// and `janitor` work, and `lock` and `run` (with their fence, forked at their start) reach their
/// lock and fail only at the fork of the command, with 125 naming the limit.
#[cfg(feature = "etcd")]
#[test]
fn an_etcd_endpoint_by_host_name_under_a_thread_limit_is_looked_up_without_a_thread() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let endpoints = cluster.endpoints().replace("127.0.0.1", "localhost");
    assert!(endpoints.contains("localhost"), "{endpoints}");
    let dir = host_of(61_020);
    // Processes and threads each needs: main and etcd; `lock` and `run` also their fence,
    // forked at the start, and `run` its watchdog.
    let cases: [(&[&str], u32, i32); 4] = [
        (&["locks"], 2, 0),
        (&["janitor"], 2, 0),
        (&["lock", "cache", "--", "echo", "command-ran"], 3, 125),
        (
            &[
                "run",
                "--recipe",
                "custom-html",
                "--no-fetch",
                "--run-id",
                "byname",
                "--",
                "echo",
                "command-ran",
            ],
            4,
            125,
        ),
    ];
    for (args, nproc, code) in cases {
        let mut cmd = limited(61_020, dir.path(), nproc, Some(&endpoints));
        cmd.args(args);
        let done = run(cmd);
        let said = format!("{}\n{}", done.out.join("\n"), done.stderr());
        for wrong in [
            "panicked",
            "can't spawn",
            "not ready",
            "no answer",
            "failed to reach",
        ] {
            assert!(!said.contains(wrong), "{args:?}: {}", done.transcript());
        }
        done.assert_code(code);
        if code == 125 {
            // The lock was had: only the fork of the command met the limit.
            done.assert_stderr_has("failed to start the command");
            done.assert_stderr_has("RLIMIT_NPROC");
            assert!(!done.out.iter().any(|l| l == "command-ran"));
        }
    }
    assert_eq!(record(dir.path(), "byname")["exit_code"], 125);
    leased_keys_go(&cluster);
    no_lock_held(dir.path());
}

/// Opens inotify instances until the kernel refuses one, prints `ready <count> <errno>`, and
/// holds them until its stdin closes.
pub(crate) const EXHAUST_INOTIFY: &str = r#"
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
held = []
while True:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    held.append(fd)
print("ready", len(held), ctypes.get_errno(), flush=True)
sys.stdin.read()
"#;

/// With the user's inotify instances used up by another of its processes, the named lock
/// still works: every waiter says once that it looks at the queue instead of watching it, and
/// 50 of them are served one at a time, in the order they arrived.
#[test]
fn without_inotify_the_named_lock_queue_is_polled_and_serves_every_waiter_in_order() {
    const UID: u32 = 61_011;
    const WAITERS: usize = 50;
    let dir = host_of(UID);
    let mut exhaust = Proc::spawn({
        let mut cmd = Command::new("setpriv");
        cmd.args([
            &format!("--reuid={UID}"),
            &format!("--regid={UID}"),
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            EXHAUST_INOTIFY,
        ]);
        cmd
    });
    let ready = exhaust.wait_for(Stream::Out, "ready");
    let fields: Vec<&str> = ready.split_whitespace().collect();
    assert_eq!(fields[2], "24", "the instances end in EMFILE: {ready}");
    assert!(fields[1].parse::<u32>().unwrap() > 0, "{ready}");

    let log = dir.path().join("order.log");
    let lock = |script: &str| {
        let mut cmd = limited(UID, dir.path(), 1000, None);
        cmd.args(["lock", "shared", "--", "sh", "-c", script]);
        cmd
    };
    let mut holder = Proc::spawn(lock("echo ready $$; read line || :"));
    holder.wait_ready();
    let waiters: Vec<Proc> = (1..=WAITERS)
        .map(|n| {
            let mut w = Proc::spawn(lock(&format!("echo w{n} >> '{}'", log.display())));
            w.wait_for(Stream::Err, "looking at it every 20–50 ms instead");
            w.wait_for(Stream::Err, "waiting as queue ticket");
            w
        })
        .collect();
    holder.close_stdin();
    holder.finish().assert_code(0);
    for w in waiters {
        let done = w.finish();
        done.assert_code(0);
        let said = done
            .err
            .iter()
            .filter(|l| l.contains("cannot watch the queue"))
            .count();
        assert_eq!(said, 1, "said once: {}", done.transcript());
        done.assert_stderr_has("inotify instances or watches are used up");
    }
    let served: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    let arrived: Vec<String> = (1..=WAITERS).map(|n| format!("w{n}")).collect();
    assert_eq!(served, arrived);
    exhaust.close_stdin();
    exhaust.finish();
}

/// A supervisor SIGSTOPped past its whole bound (deadline + kill grace + teardown timeout) and
/// then continued wakes its main thread and its watchdog at once: whichever ends the process,
/// the exit is the deadline's 142 (the first reason: the hard end comes only after it), the
/// record says so with `teardown-timeout`, and nothing is left. Before, 1 run in 6 was 125.
/// Several stop lengths, so SIGCONT lands at different points of the watchdog's clock.
#[test]
fn a_supervisor_stopped_past_its_whole_bound_ends_142_teardown_timeout_every_time() {
    use nix::sys::signal::Signal;

    use crate::util::{Sandbox, process_alive, signal, wait_exited};

    for (round, stop_ms) in [4_100u64, 4_300, 4_700, 5_200, 6_000, 4_050, 4_500, 5_600]
        .into_iter()
        .enumerate()
    {
        let sandbox = Sandbox::new();
        let run_id = format!("stopped{round}");
        let mut cmd = sandbox.run_sh(
            &run_id,
            &[
                "--deadline",
                "2",
                "--kill-grace",
                "1",
                "--teardown-timeout",
                "1",
            ],
            "echo ready $$; exec sleep 100000",
        );
        cmd.env_remove("CCCI_TIE_TO");
        let mut proc = Proc::spawn(cmd);
        let command = proc.wait_ready();
        signal(proc.pid(), Signal::SIGSTOP);
        // The length of the stop is what this test varies.
        std::thread::sleep(std::time::Duration::from_millis(stop_ms));
        signal(proc.pid(), Signal::SIGCONT);
        let done = proc.finish();
        assert_eq!(
            done.status.code(),
            Some(142),
            "round {round} (stopped {stop_ms} ms): {}",
            done.transcript()
        );
        let record = sandbox.record(&run_id);
        assert_eq!(record["exit_code"], 142, "round {round}: {record:#}");
        assert_eq!(
            record["shutdown_reason"], "teardown-timeout",
            "round {round}: {record:#}"
        );
        assert!(wait_exited(command), "round {round}: the command lives on");
        assert!(!process_alive(command));
        let domain = record["domain"].as_str().unwrap();
        assert!(
            crate::util::lock_is_free(&sandbox.lock_file(domain)),
            "round {round}: the app lock must be free"
        );
        // The hard end leaves the run's emptied cgroup to the next sweep; it must take it, so
        // that nothing of this run is found by a later configuration on a reused inode.
        let (_, swept) = sandbox.janitor(&[]);
        swept.assert_code(0);
        if let Some(cgroup) = record["cgroup"].as_str() {
            assert!(
                !std::path::Path::new(cgroup).exists(),
                "round {round}: the sweep left the cgroup {cgroup}"
            );
        }
    }
}

/// `cmd` (a `ccci-run` command line) with at most `bytes` of address space (RLIMIT_AS binds
/// root as it binds anyone).
fn under_address_space(cmd: &Command, bytes: u64) -> Command {
    crate::identity::wrapped(&["prlimit", &format!("--as={bytes}")], cmd)
}

/// The smallest address space (to 64 KiB) in which `ccci-run --version` starts and exits 0:
/// below it the loader or the runtime's own start-up fails, before any code of ours runs.
fn smallest_address_space_that_starts() -> u64 {
    let starts = |bytes: u64| {
        let mut cmd = Command::new("prlimit");
        cmd.arg(format!("--as={bytes}"))
            .args([BIN, "--version"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        cmd.status().unwrap().success()
    };
    let (mut low, mut high) = (1u64 << 20, 1u64 << 30);
    assert!(
        !starts(low) && starts(high),
        "no start-up threshold in 1 MiB..1 GiB"
    );
    while high - low > 64 << 10 {
        let mid = (low + high) / 2;
        if starts(mid) {
            high = mid;
        } else {
            low = mid;
        }
    }
    high
}

/// How one subcommand ended in a given address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// It did its work (and its command ran).
    Worked,
    /// The documented exit code, naming the limit, and no command.
    LimitNamed,
    /// Memory ran out for an allocation: Rust's "memory allocation of N bytes failed" (or
    /// glibc's "... out of memory" for its own) and SIGABRT, which is how an allocation that
    /// cannot be had ends a process (what it held is a dead process's).
    AllocationFailed,
}

/// Under an address-space limit every subcommand that starts threads (`run` for its watchdog;
/// with etcd, all four for the client's thread) either works, or fails at a thread with its documented
/// code naming the limit, or meets an allocation that cannot be had and says so (SIGABRT):
/// never a panic (101) or a crash, never a misleading message; and above the first clean
/// refusal no allocation fails. The threshold depends on the build, so it is measured: from the smallest space `--version` starts in, up in 128 KiB
/// steps until the subcommand has worked three times running. Each subcommand must have met
/// the documented failure at least once and worked at least once, so the sweep did cross the
/// band where thread creation fails. Afterwards a janitor with room clears whatever an aborted
/// run left, and nothing stays held, in etcd or on disk.
#[test]
fn under_an_address_space_limit_every_threaded_subcommand_fails_at_its_code_or_works() {
    use crate::util::Sandbox;

    let floor = smallest_address_space_that_starts();
    // Only an etcd build adds to these.
    #[cfg_attr(not(feature = "etcd"), allow(unused_mut))]
    let mut sandbox = Sandbox::new();
    let plain = Sandbox::new();
    #[cfg_attr(not(feature = "etcd"), allow(unused_mut))]
    let mut cases: Vec<(&str, bool, i32)> = vec![("run", false, 125)];
    #[cfg(feature = "etcd")]
    let cluster = crate::util::etcd_cluster();
    #[cfg(feature = "etcd")]
    if let Some(cluster) = &cluster {
        sandbox.set_etcd(cluster.endpoints(), 4);
        cases.extend([
            ("run", true, 125),
            ("lock", true, 125),
            ("janitor", true, 1),
            ("locks", true, 1),
        ]);
    }
    let mut attempt = 0u32;
    for (sub, etcd, code) in cases {
        let host = if etcd { &sandbox } else { &plain };
        let mut endings: Vec<(u64, Ending)> = Vec::new();
        let mut bytes = floor;
        let mut worked_in_a_row = 0;
        while worked_in_a_row < 3 {
            assert!(
                bytes < floor + (96 << 20),
                "{sub} (etcd {etcd}) never worked up to {} KiB: {endings:?}",
                bytes >> 10
            );
            attempt += 1;
            let mut cmd = host.ccci();
            match sub {
                "run" => cmd
                    .args(["run", "--recipe", "custom-html", "--no-fetch"])
                    .args([
                        "--pr",
                        &attempt.to_string(),
                        "--run-id",
                        &format!("as{attempt}"),
                        "--",
                        "/bin/echo",
                        "command-ran",
                    ]),
                "lock" => cmd
                    .args(["lock", &format!("as{attempt}"), "--"])
                    .args(["/bin/echo", "command-ran"]),
                _ => cmd.arg(sub),
            };
            let done = run(under_address_space(&cmd, bytes));
            let said = format!("{}\n{}", done.out.join("\n"), done.stderr());
            let ran = done.out.iter().any(|l| l == "command-ran");
            let ending = if done.status.success() && (ran || !matches!(sub, "run" | "lock")) {
                Ending::Worked
            } else if done.status.code() == Some(code) && said.contains("RLIMIT_AS") && !ran {
                Ending::LimitNamed
            } else if std::os::unix::process::ExitStatusExt::signal(&done.status)
                == Some(nix::libc::SIGABRT)
                && (said.contains("memory allocation of") || said.contains("out of memory"))
                && !said.contains("panicked")
            {
                Ending::AllocationFailed
            } else {
                panic!(
                    "{sub} (etcd {etcd}) in {} KiB ended neither with its work, nor with {code} \
                     naming the limit, nor with a failed allocation:\n{}",
                    bytes >> 10,
                    done.transcript()
                );
            };
            worked_in_a_row = if ending == Ending::Worked {
                worked_in_a_row + 1
            } else {
                0
            };
            endings.push((bytes >> 10, ending));
            bytes += 128 << 10;
        }
        let first_limit = endings.iter().position(|(_, e)| *e == Ending::LimitNamed);
        assert!(
            first_limit.is_some(),
            "{sub} (etcd {etcd}) never met the limit at a thread (from {} KiB): {endings:?}",
            floor >> 10
        );
        // A thread starts only with room to spare for its set-up and what follows it: once
        // the space is enough to be refused a thread cleanly, no allocation fails above it
        // (before, std's signal stack or glibc's TLS bookkeeping aborted the process there).
        assert!(
            !endings[first_limit.unwrap()..]
                .iter()
                .any(|(_, e)| *e == Ending::AllocationFailed),
            "{sub} (etcd {etcd}): an allocation failed above a clean refusal: {endings:?}"
        );
        eprintln!("{sub} (etcd {etcd}), KiB from {}: {endings:?}", floor >> 10);
    }
    // Whatever aborted left (a run's cgroup, its state files) is a dead run's: one sweep with
    // room clears it, and every lease of an aborted holder runs out.
    for host in [&sandbox, &plain] {
        let (report, done) = host.janitor(&[]);
        assert_eq!(done.status.code(), Some(0), "{report:#}");
        assert!(host.state_files().is_empty(), "{:?}", host.state_files());
    }
    #[cfg(feature = "etcd")]
    if let Some(cluster) = &cluster {
        let deadline = std::time::Instant::now() + crate::util::PATIENCE;
        while !cluster.keys().is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "keys stayed: {}",
                cluster.keys()
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }
    for name in crate::util::list(&plain.locks()) {
        let path = plain.locks().join(name);
        assert!(
            crate::util::lock_is_free(&path),
            "{} is held",
            path.display()
        );
    }
}
