//! How fast a run is really over when its world ends, measured until nothing of it is left.
//!
//! 1. **Runner cancel.** The pipeline's step as drone-runner-exec starts it: the runner
//!    stand-in (`tests/integration/drone_runner.py`) runs `/bin/sh -e` on the script of
//!    `.drone.yml`'s commands (`exec sh ci/recipe-ci-step.sh`), its command deploying "for a
//!    long time" with a daemon beside it. SIGINT to the runner, which SIGKILLs the step shell
//!    alone; the clock runs until the supervisor is gone (it is the last of the run to go: it
//!    kills its command, the daemon and its cgroup first) and the run record says `finished`.
//! 2. **Runner SIGKILL.** The same, but the runner itself dies (SIGKILL): the step shell lives
//!    on, re-parented; the run is tied to the runner too.
//!
//!    Both with `--kill-grace 1` (CCCI_KILL_GRACE). Baseline in the same run: the same step
//!    cancelled by a TERM to ccci-run directly.
//! 3. **Supervisor SIGKILL, the run's dead-man.** A run whose command daemonised N processes,
//!    each holding the run's output (as a Drone step's would), loses its supervisor to SIGKILL
//!    (the OOM killer); the clock runs from the kill until the output's end (nothing holds it)
//!    and every process of the run is gone: the run's own dead-man (its fence) did it, no
//!    janitor. With cgroups (`cgroup.kill`) and without (the marker scan). Baseline in the same
//!    run: the same run ended by a TERM to ccci-run.
//! 4. **Supervisor and dead-man SIGKILL.** The same, but the dead-man is killed with the
//!    supervisor (a crash of both); the clock runs over the next `ccci-run janitor` until every
//!    leftover is gone. Baseline in the same run: the same janitor sweep with nothing to kill.
//!
//! `cargo bench --bench lifetime [-- ITERATIONS]` (default 10). Docker is off: this measures
//! the process side of the bound; `docker_reap` measures removal. The host's settings reach
//! ccci-run through its environment here, which a real runner would not pass: the timing is
//! the same either way, and `tests/integration/drone.rs` proves the real path.

// A bench prints its report and reads its own files; clippy.toml keeps print! and eprintln!, and
// raw file reads, out of src/ only.
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ccci-run");

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

fn max(xs: &[Duration]) -> Duration {
    xs.iter().copied().max().unwrap_or_default()
}

/// The global options of a scratch host under `dir`, as environment variables.
fn host_env(cmd: &mut Command, dir: &Path) {
    for (key, _) in std::env::vars() {
        if key.starts_with("CCCI_") {
            cmd.env_remove(key);
        }
    }
    cmd.env("CCCI_RUNS_DIR", dir.join("runs"))
        .env("CCCI_ABRA_HOME", dir.join("abra"))
        .env("CCCI_APP_LOCK_DIR", dir.join("locks"))
        .env("CCCI_STATE_DIR", dir.join("state"))
        .env("CCCI_DOCKER", "off");
}

/// Read a child's stdout line by line until one starts with `prefix`; returns the rest.
fn read_until(out: &mut impl Read, prefix: &str) -> String {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        assert_eq!(
            out.read(&mut byte).unwrap(),
            1,
            "output ended before {prefix:?}"
        );
        if byte[0] == b'\n' {
            let text = String::from_utf8_lossy(&line).into_owned();
            if let Some(rest) = text.strip_prefix(prefix) {
                return rest.to_owned();
            }
            line.clear();
        } else {
            line.push(byte[0]);
        }
    }
}

const COMMAND: &str = "setsid sh -c 'exec sleep 100000' </dev/null & echo daemon $!; \
                       echo ready $$; exec sleep 100000";

/// How a step is ended.
#[derive(Clone, Copy)]
enum End {
    /// SIGINT to the runner: its cancel, SIGKILL to the step shell.
    RunnerCancel,
    /// SIGKILL to the runner itself.
    RunnerDeath,
    /// SIGTERM to ccci-run itself.
    Term,
}

/// Wait until `pid` has exited (a pidfd: the kernel says so, no polling); false after `limit`.
fn wait_gone(pid: i32, limit: Duration) -> bool {
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return true;
    }
    // SAFETY: the descriptor was just returned to us and is owned here alone.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
    let mut fds = [nix::poll::PollFd::new(
        std::os::fd::AsFd::as_fd(&fd),
        nix::poll::PollFlags::POLLIN,
    )];
    let ms = u16::try_from(limit.as_millis()).unwrap_or(u16::MAX);
    matches!(nix::poll::poll(&mut fds, ms), Ok(n) if n > 0)
}

fn alive(pid: i32) -> bool {
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    state
        .rsplit_once(')')
        .and_then(|(_, t)| t.split_whitespace().next())
        .is_some_and(|s| s != "Z" && s != "X")
}

/// One step under the runner stand-in, ended as `end` says; returns the time from the signal
/// to "nothing of the run left".
fn ended_step(dir: &Path, build: u32, end: End) -> Duration {
    let root = dir.join(format!("ws-{build}"));
    // The repository the runner's clone step clones: the step's scripts, committed (once).
    let origin = dir.join("pipeline.git");
    if !origin.exists() {
        std::fs::create_dir_all(origin.join("ci")).unwrap();
        for file in ["ci/recipe-ci-step.sh", "ci/recipe-tests.sh"] {
            std::fs::copy(repo().join(file), origin.join(file)).unwrap();
        }
        for args in [
            &["init", "-q", "-b", "main"][..],
            &["add", "-A"],
            &[
                "-c",
                "user.name=b",
                "-c",
                "user.email=b@b",
                "commit",
                "-q",
                "-m",
                "p",
            ],
        ] {
            assert!(
                Command::new("git")
                    .arg("-C")
                    .arg(&origin)
                    .args(args)
                    .status()
                    .unwrap()
                    .success()
            );
        }
    }
    let script = "\nset -e\n\necho + \"exec sh ci/recipe-ci-step.sh sh -c \\\"\\$STEP_COMMAND\\\"\"\n\
                  exec sh ci/recipe-ci-step.sh sh -c \"$STEP_COMMAND\"\n";
    let mut env = serde_json::Map::new();
    let mut put = |k: &str, v: String| {
        env.insert(k.to_owned(), serde_json::Value::String(v));
    };
    put("PATH", std::env::var("PATH").unwrap_or_default());
    put("USER", "root".into());
    put("CCCI_BIN", BIN.into());
    put("DRONE_REPO_NAME", "custom-html".into());
    put("DRONE_PULL_REQUEST", build.to_string());
    put("DRONE_BUILD_NUMBER", build.to_string());
    put("CCCI_KILL_GRACE", "1".into());
    put("STEP_COMMAND", COMMAND.into());
    put("CCCI_SKIP_FETCH", "1".into());
    for (key, value) in [
        ("CCCI_RUNS_DIR", "runs"),
        ("CCCI_ABRA_HOME", "abra"),
        ("CCCI_APP_LOCK_DIR", "locks"),
        ("CCCI_STATE_DIR", "state"),
    ] {
        put(key, dir.join(value).display().to_string());
    }
    put("CCCI_DOCKER", "off".into());
    // No fetch: the staged recipe is copied.
    std::fs::create_dir_all(dir.join("abra/recipes/custom-html/.git")).unwrap();
    let mut runner = Command::new("python3")
        .arg(repo().join("tests/integration/drone_runner.py"))
        .arg(&root)
        .arg(&origin)
        .arg("recipe-ci")
        .arg(script)
        .arg(serde_json::Value::Object(env).to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = runner.stdout.take().unwrap();
    let daemon: i32 = read_until(&mut out, "daemon ").trim().parse().unwrap();
    let command: i32 = read_until(&mut out, "ready ").trim().parse().unwrap();
    let record = dir.join(format!("runs/{build}/run.json"));
    let supervisor: i32 = {
        let text = std::fs::read_to_string(&record).unwrap();
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        value["pid"].as_i64().unwrap() as i32
    };
    let kill = |pid: i32, signal| {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal).unwrap();
    };
    use nix::sys::signal::Signal;
    let started = Instant::now();
    match end {
        End::RunnerCancel => kill(runner.id() as i32, Signal::SIGINT),
        End::RunnerDeath => kill(runner.id() as i32, Signal::SIGKILL),
        End::Term => kill(supervisor, Signal::SIGTERM),
    }
    assert!(
        wait_gone(supervisor, Duration::from_secs(60)),
        "the supervisor outlived its step by a minute"
    );
    let elapsed = started.elapsed();
    let text = std::fs::read_to_string(&record).unwrap();
    assert!(text.contains("\"finished\""), "record not finished: {text}");
    for pid in [daemon, command] {
        assert!(
            !alive(pid),
            "process {pid} of the run outlived its supervisor"
        );
    }
    drop(out);
    runner.wait().unwrap();
    let _ = std::fs::remove_dir_all(&root);
    elapsed
}

/// The fences (dead-men) `supervisor` started: its children whose first argument is the tag.
fn fences_of(supervisor: i32) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let ppid = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')?
                        .1
                        .split_whitespace()
                        .nth(1)?
                        .parse()
                        .ok()
                });
            let tag = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            ppid == Some(supervisor)
                && tag.split(|b| *b == 0).nth(1) == Some(b"__ccci-run-fence".as_slice())
        })
        .collect()
}

/// Start a run whose command daemonised `daemons` processes that hold its stdout; returns the
/// run, its stdout and the pids of its processes.
fn daemonised_run(
    dir: &Path,
    id: &str,
    daemons: usize,
    cgroup: &str,
) -> (std::process::Child, std::process::ChildStdout, Vec<i32>) {
    let script = format!(
        "for i in $(seq {daemons}); do setsid sh -c 'exec sleep 100000' </dev/null & echo d $!; done; \
         echo ready $$; exec sleep 100000"
    );
    let mut cmd = Command::new(BIN);
    host_env(&mut cmd, dir);
    cmd.env("CCCI_CGROUP", cgroup)
        .args([
            "run",
            "--recipe",
            "custom-html",
            "--no-fetch",
            "--run-id",
            id,
        ])
        .args(["--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut run = cmd.spawn().unwrap();
    let mut out = run.stdout.take().unwrap();
    let mut pids: Vec<i32> = (0..daemons)
        .map(|_| read_until(&mut out, "d ").trim().parse().unwrap())
        .collect();
    pids.push(read_until(&mut out, "ready ").trim().parse().unwrap());
    (run, out, pids)
}

/// A run with `daemons` daemonised processes holding its output, ended by `signal` to its
/// supervisor; returns the time from the signal until its output ended and every process of
/// it was gone.
fn supervisor_end(dir: &Path, id: &str, daemons: usize, cgroup: &str, signal: i32) -> Duration {
    let (mut run, mut out, pids) = daemonised_run(dir, id, daemons, cgroup);
    let started = Instant::now();
    // SAFETY: kill(2) of our own unreaped child.
    unsafe { nix::libc::kill(run.id() as i32, signal) };
    let mut rest = Vec::new();
    out.read_to_end(&mut rest).unwrap();
    for pid in &pids {
        assert!(
            wait_gone(*pid, Duration::from_secs(10)),
            "{pid} outlived its run"
        );
    }
    let elapsed = started.elapsed();
    run.wait().unwrap();
    elapsed
}

/// A run whose supervisor and dead-man are SIGKILLed with `daemons` daemonised processes left;
/// returns the janitor's wall time, once every leftover was gone after it.
fn sweep_after_supervisor_kill(dir: &Path, id: u32, daemons: usize) -> Duration {
    let (mut run, out, pids) = daemonised_run(dir, &format!("k{id}"), daemons, "auto");
    drop(out);
    let fences = fences_of(run.id() as i32);
    for fence in &fences {
        // SAFETY: kill(2) of a process this bench just found; a stopped fence never acts.
        unsafe { nix::libc::kill(*fence, nix::libc::SIGSTOP) };
    }
    run.kill().unwrap();
    run.wait().unwrap();
    for fence in &fences {
        // SAFETY: as above; it is stopped, so still that process.
        unsafe { nix::libc::kill(*fence, nix::libc::SIGKILL) };
        assert!(wait_gone(*fence, Duration::from_secs(10)));
    }
    let mut janitor = Command::new(BIN);
    host_env(&mut janitor, dir);
    janitor
        .arg("janitor")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let started = Instant::now();
    let status = janitor.status().unwrap();
    let elapsed = started.elapsed();
    assert!(status.success());
    for pid in pids {
        assert!(!alive(pid), "leftover {pid} survived the sweep");
    }
    elapsed
}

fn empty_sweep(dir: &Path) -> Duration {
    let mut janitor = Command::new(BIN);
    host_env(&mut janitor, dir);
    janitor
        .arg("janitor")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let started = Instant::now();
    assert!(janitor.status().unwrap().success());
    started.elapsed()
}

/// Print a measurement's median and max against its baseline's median, and their ratio.
fn report(title: &str, measured: &[Duration], baseline_name: &str, baseline: &[Duration]) {
    let (m, b) = (median(measured.to_vec()), median(baseline.to_vec()));
    println!("{title}");
    println!(
        "  median {:.1} ms, max {:.1} ms   (baseline, {baseline_name}: median {:.1} ms) → {:.2}×",
        m.as_secs_f64() * 1e3,
        max(measured).as_secs_f64() * 1e3,
        b.as_secs_f64() * 1e3,
        m.as_secs_f64() / b.as_secs_f64()
    );
}

fn main() {
    let iterations: u32 = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(10);
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("state")).unwrap();

    let mut cancel = Vec::new();
    let mut death = Vec::new();
    let mut term = Vec::new();
    for i in 0..iterations {
        cancel.push(ended_step(dir.path(), 1000 + 3 * i, End::RunnerCancel));
        death.push(ended_step(dir.path(), 1001 + 3 * i, End::RunnerDeath));
        term.push(ended_step(dir.path(), 1002 + 3 * i, End::Term));
    }
    report(
        "runner cancel (SIGKILL to the step shell) → nothing of the run left, --kill-grace 1:",
        &cancel,
        "TERM to ccci-run itself",
        &term,
    );
    report(
        "runner SIGKILL (the runner itself dies) → nothing of the run left, --kill-grace 1 (goal < 2 s):",
        &death,
        "TERM to ccci-run itself",
        &term,
    );

    let daemons = 8;
    for cgroup in ["auto", "off"] {
        let mut dead_man = Vec::new();
        let mut term = Vec::new();
        for i in 0..iterations {
            dead_man.push(supervisor_end(
                dir.path(),
                &format!("dm-{cgroup}-{i}"),
                daemons,
                cgroup,
                nix::libc::SIGKILL,
            ));
            term.push(supervisor_end(
                dir.path(),
                &format!("tm-{cgroup}-{i}"),
                daemons,
                cgroup,
                nix::libc::SIGTERM,
            ));
        }
        report(
            &format!(
                "supervisor SIGKILL with {daemons} daemonised processes holding the output → the \
                 run's dead-man leaves nothing (cgroup {cgroup}; goal < 1 s):"
            ),
            &dead_man,
            "TERM to ccci-run itself",
            &term,
        );
    }

    let mut reap = Vec::new();
    let mut empty = Vec::new();
    for i in 0..iterations {
        reap.push(sweep_after_supervisor_kill(dir.path(), i, daemons));
        empty.push(empty_sweep(dir.path()));
    }
    report(
        &format!(
            "supervisor and dead-man SIGKILL with {daemons} daemonised processes → janitor sweep until every leftover is gone:"
        ),
        &reap,
        "the same sweep with nothing to kill",
        &empty,
    );
}
