//! How fast a run is really over when its world ends, measured until nothing of it is left.
//!
//! 1. **Runner cancel.** The pipeline's step as drone-runner-exec starts it (`/bin/sh -e` on
//!    `CCCI_TIE_TO=$$ exec sh ci/recipe-ci-step.sh`), its command deploying "for a long time"
//!    with a daemon beside it; SIGKILL to the step shell alone, then the clock runs until the
//!    step's output pipe is closed by every process that held it (the supervisor, the command,
//!    the daemon) and the run record says `finished`. `--kill-grace 1` (CCCI_KILL_GRACE).
//!    Baseline in the same run: the same step cancelled by a TERM to ccci-run directly.
//! 2. **Supervisor SIGKILL.** A run whose command daemonised N processes loses its supervisor
//!    to SIGKILL; the clock runs over the next `ccci-run janitor` until every leftover is gone.
//!    Baseline in the same run: the same janitor sweep with nothing to kill.
//!
//! `cargo bench --bench lifetime [-- ITERATIONS]` (default 10). Docker is off: this measures
//! the process side of the bound; `docker_reap` measures removal.

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

const COMMAND: &str = "setsid sh -c 'exec sleep 100000' </dev/null & \
                       echo ready $$; exec sleep 100000";

/// One cancelled step; returns the time from the cancel to "nothing of the run left".
fn cancelled_step(dir: &Path, build: u32, via_runner_kill: bool) -> Duration {
    let script = dir.join(format!("step-{build}"));
    std::fs::write(
        &script,
        "\nset -e\n\necho + \"CCCI_TIE_TO=\\$\\$ exec sh ci/recipe-ci-step.sh sh -c \\\"\\$STEP_COMMAND\\\"\"\n\
         CCCI_TIE_TO=$$ exec sh ci/recipe-ci-step.sh sh -c \"$STEP_COMMAND\"\n",
    )
    .unwrap();
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-e").arg(&script).current_dir(repo());
    host_env(&mut cmd, dir);
    cmd.env("CCCI_BIN", BIN)
        .env("DRONE_REPO_NAME", "custom-html")
        .env("DRONE_PULL_REQUEST", build.to_string())
        .env("DRONE_BUILD_NUMBER", build.to_string())
        .env("CCCI_KILL_GRACE", "1")
        .env("STEP_COMMAND", COMMAND)
        .env("CCCI_RECIPE_URL_TEMPLATE", "/nonexistent/{recipe}")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    // No fetch: the staged recipe is copied.
    std::fs::create_dir_all(dir.join("abra/recipes/custom-html/.git")).unwrap();
    cmd.env("CCCI_SKIP_FETCH", "1");
    let mut step = cmd.spawn().unwrap();
    let mut out = step.stdout.take().unwrap();
    read_until(&mut out, "ready ");
    let record = dir.join(format!("runs/{build}/run.json"));
    let supervisor: i32 = {
        let text = std::fs::read_to_string(&record).unwrap();
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        value["pid"].as_i64().unwrap() as i32
    };
    let started = Instant::now();
    if via_runner_kill {
        step.kill().unwrap();
    } else {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(supervisor),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
    }
    // EOF: every process that held the step's pipe is gone.
    let mut rest = Vec::new();
    out.read_to_end(&mut rest).unwrap();
    let text = std::fs::read_to_string(&record).unwrap();
    let elapsed = started.elapsed();
    assert!(text.contains("\"finished\""), "record not finished: {text}");
    step.wait().unwrap();
    elapsed
}

/// A run whose supervisor is SIGKILLed with `daemons` daemonised processes left; returns the
/// janitor's wall time and whether every leftover was gone after it.
fn sweep_after_supervisor_kill(dir: &Path, id: u32, daemons: usize) -> Duration {
    let script = format!(
        "for i in $(seq {daemons}); do setsid sh -c 'exec sleep 100000' </dev/null >/dev/null 2>&1 & echo d $!; done; \
         echo ready $$; exec sleep 100000"
    );
    let mut cmd = Command::new(BIN);
    host_env(&mut cmd, dir);
    cmd.args(["run", "--recipe", "custom-html", "--no-fetch", "--run-id"])
        .arg(format!("k{id}"))
        .args(["--", "sh", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut run = cmd.spawn().unwrap();
    let mut out = run.stdout.take().unwrap();
    let mut pids: Vec<i32> = (0..daemons)
        .map(|_| read_until(&mut out, "d ").trim().parse().unwrap())
        .collect();
    pids.push(read_until(&mut out, "ready ").trim().parse().unwrap());
    run.kill().unwrap();
    run.wait().unwrap();
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
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let alive = state
            .rsplit_once(')')
            .and_then(|(_, t)| t.split_whitespace().next())
            .is_some_and(|s| s != "Z" && s != "X");
        assert!(!alive, "leftover {pid} survived the sweep");
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
    let mut term = Vec::new();
    for i in 0..iterations {
        cancel.push(cancelled_step(dir.path(), 1000 + 2 * i, true));
        term.push(cancelled_step(dir.path(), 1001 + 2 * i, false));
    }
    report(
        "runner cancel (SIGKILL to the step shell) → nothing of the run left, --kill-grace 1:",
        &cancel,
        "TERM to ccci-run itself",
        &term,
    );

    let daemons = 8;
    let mut reap = Vec::new();
    let mut empty = Vec::new();
    for i in 0..iterations {
        reap.push(sweep_after_supervisor_kill(dir.path(), i, daemons));
        empty.push(empty_sweep(dir.path()));
    }
    report(
        &format!(
            "supervisor SIGKILL with {daemons} daemonised processes → janitor sweep until every leftover is gone:"
        ),
        &reap,
        "the same sweep with nothing to kill",
        &empty,
    );
}
