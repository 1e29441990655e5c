//! What `ccci-run stop` costs: from the command's start to the end of the run it stops (the
//! supervisor's exit, its command gone with it), against, in the same run and interleaved so
//! machine noise hits all alike:
//!
//! - `kill -TERM <supervisor pid>` until the supervisor has exited (no proof at all: the
//!   baseline of a signal sent by number), and
//! - `ccci-run stop` of a run that already finished (the same process start and record read, no
//!   proof and no signal: what the binary spends before it proves anything).
//!
//! Each live run is `ccci-run run -- sh -c 'echo ready; exec sleep 600'`, started and waited for
//! (its `ready` line) before it is stopped; its exit is awaited with `waitpid`. Prints medians,
//! p90s and the differences; the target is a live stop within 50 ms (median) of the stop of a
//! finished run. Not a timed test: the machines are shared and noisy.
//!
//! `cargo bench --bench stop [-- ITERATIONS]` (default 30)

// A bench prints its report and reads its own files; clippy.toml keeps print! and eprintln!, and
// raw file reads, out of src/ only.
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ccci-run");

/// `ccci-run` with the global options of the bench's host `base`.
fn ccci(base: &Path) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.arg("--runs-dir")
        .arg(base.join("runs"))
        .arg("--abra-home")
        .arg(base.join("abra"))
        .arg("--lock-dir")
        .arg(base.join("locks"))
        .arg("--state-dir")
        .arg(base.join("state"))
        .args(["--docker", "off"])
        .env("CCCI_CONFIG", "/dev/null")
        .env_remove("DRONE_REPO")
        .env_remove("DRONE_BUILD_NUMBER");
    cmd
}

/// A live run `id`, once its command said it is ready.
fn live_run(base: &Path, id: &str) -> Child {
    let mut cmd = ccci(base);
    cmd.args(["run", "--recipe", "bench", "--run-id", id, "--no-fetch"])
        .args(["--", "sh", "-c", "echo ready; exec sleep 600"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().expect("start a run");
    let mut lines = BufReader::new(child.stdout.take().expect("piped"));
    let mut line = String::new();
    while line.trim_end() != "ready" {
        line.clear();
        let read = lines.read_line(&mut line).expect("read the run's output");
        assert!(read > 0, "run {id} ended before its command was ready");
    }
    child
}

/// `ccci-run stop id`, waited for; its exit code must be `code`.
fn stop(base: &Path, id: &str, code: i32) {
    let status = ccci(base)
        .args(["stop", id])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("start ccci-run stop");
    assert_eq!(status.code(), Some(code), "ccci-run stop {id}: {status}");
}

fn quantile(samples: &[Duration], q: f64) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    let iterations: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(30)
        .max(1);
    let dir = tempfile::tempdir().expect("tempdir");
    let base = dir.path();

    // The finished run the baseline stops, every time.
    let status = ccci(base)
        .args(["run", "--recipe", "bench", "--run-id", "done", "--no-fetch"])
        .args(["--", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("start a run");
    assert!(status.success(), "the finished run failed: {status}");

    let mut live = Vec::new();
    let mut finished = Vec::new();
    let mut by_number = Vec::new();
    for i in 0..=iterations {
        // A stop of the run that finished: exit 1, nothing signalled.
        let start = Instant::now();
        stop(base, "done", 1);
        let finished_took = start.elapsed();

        // ccci-run stop of a live run, until the supervisor has exited.
        let id = format!("live{i}");
        let mut run = live_run(base, &id);
        let start = Instant::now();
        stop(base, &id, 0);
        let status = run.wait().expect("wait for the run");
        let live_took = start.elapsed();
        assert!(
            status.code().is_some(),
            "run {id} ended by a signal: {status}"
        );

        // A signal by number, until the supervisor has exited.
        let id = format!("kill{i}");
        let mut run = live_run(base, &id);
        let start = Instant::now();
        let killed = Command::new("kill")
            .args(["-TERM", &run.id().to_string()])
            .status()
            .expect("start kill(1)");
        assert!(killed.success(), "kill(1): {killed}");
        run.wait().expect("wait for the run");
        let kill_took = start.elapsed();

        // The first round warms the page cache and the binaries.
        if i > 0 {
            finished.push(finished_took);
            live.push(live_took);
            by_number.push(kill_took);
        }
    }

    println!("stop: {iterations} iterations each, interleaved");
    println!(
        "{:<44} {:>10} {:>10}",
        "until the run has ended", "median ms", "p90 ms"
    );
    for (name, samples) in [
        ("kill -TERM <pid> (no proof)", &by_number),
        ("ccci-run stop of a finished run", &finished),
        ("ccci-run stop of a live run", &live),
    ] {
        println!(
            "{name:<44} {:>10.1} {:>10.1}",
            ms(quantile(samples, 0.5)),
            ms(quantile(samples, 0.9))
        );
    }
    let over_finished = ms(quantile(&live, 0.5)) - ms(quantile(&finished, 0.5));
    let over_kill = ms(quantile(&live, 0.5)) - ms(quantile(&by_number, 0.5));
    println!("live stop − stop of a finished run: {over_finished:+.1} ms median (target < 50 ms)");
    println!("live stop − kill(1):                {over_kill:+.1} ms median");
    println!(
        "live stop / kill(1):                {:.2}×",
        ms(quantile(&live, 0.5)) / ms(quantile(&by_number, 0.5)).max(f64::MIN_POSITIVE)
    );
}
