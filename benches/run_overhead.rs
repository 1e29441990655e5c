//! What supervision costs: `ccci-run run --no-fetch -- true` against `flock <file> true`,
//! `timeout 3600 true` (the smallest supervisor with a deadline: fork, exec, a timer, a wait)
//! and a plain `true`, timed in one run, interleaved so machine noise hits all alike. Run it as
//! `cargo bench --profile dist --features vendored --bench run_overhead` for the binary that
//! ships.
//!
//! Prints median and p90 wall time, median CPU time (user + system) and peak RSS (from
//! `wait4`) of each, and the differences. Targets: at most 2.5 ms median wall time more than
//! flock(1), at most twice its CPU time, under 10 MB peak RSS. The summary holds each ratio
//! against the one recorded in `benches/baselines.json`.
//!
//! `cargo bench --bench run_overhead [-- ITERATIONS]`

// A bench prints its report and reads its own files; clippy.toml keeps print! and eprintln!, and
// raw file reads, out of src/ only.
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use std::process::Command;
use std::time::{Duration, Instant};

use nix::libc;

#[path = "support/ratio.rs"]
mod ratio;

const BIN: &str = env!("CARGO_BIN_EXE_ccci-run");

struct Sample {
    wall: Duration,
    /// User and system time.
    cpu: Duration,
    max_rss_kib: i64,
}

/// Spawn, wait with `wait4`, and return wall time and the child's peak RSS.
#[expect(
    clippy::zombie_processes,
    reason = "reaped by wait4, which also reports its rusage"
)]
fn measure(cmd: &mut Command) -> Sample {
    let start = Instant::now();
    let child = cmd.spawn().expect("spawn");
    let mut status = 0;
    // SAFETY: rusage is plain old data, filled in by the kernel.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = child.id() as libc::pid_t;
    let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    let wall = start.elapsed();
    assert_eq!(rc, pid, "wait4: {}", std::io::Error::last_os_error());
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{cmd:?} failed: status {status:#x}"
    );
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    Sample {
        wall,
        cpu: tv(usage.ru_utime) + tv(usage.ru_stime),
        max_rss_kib: usage.ru_maxrss,
    }
}

struct Series {
    name: &'static str,
    samples: Vec<Sample>,
}

impl Series {
    fn median(&self) -> Duration {
        self.quantile(0.5)
    }

    fn quantile(&self, q: f64) -> Duration {
        let mut walls: Vec<Duration> = self.samples.iter().map(|s| s.wall).collect();
        walls.sort();
        walls[((walls.len() - 1) as f64 * q).round() as usize]
    }

    fn median_cpu(&self) -> Duration {
        let mut cpu: Vec<Duration> = self.samples.iter().map(|s| s.cpu).collect();
        cpu.sort();
        cpu[(cpu.len() - 1) / 2]
    }

    fn peak_rss_kib(&self) -> i64 {
        self.samples
            .iter()
            .map(|s| s.max_rss_kib)
            .max()
            .unwrap_or(0)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    let iterations: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(200);
    let dir = tempfile::tempdir().expect("tempdir");
    let lock = dir.path().join("bench.lock");
    let base = dir.path().to_owned();

    let mut plain = Command::new("true");
    let mut flock = Command::new("flock");
    flock.arg(&lock).arg("true");
    let mut timeout = Command::new("timeout");
    timeout.args(["3600", "true"]);
    let mut ccci = Command::new(BIN);
    ccci.arg("--runs-dir")
        .arg(base.join("runs"))
        .arg("--abra-home")
        .arg(base.join("abra"))
        .arg("--lock-dir")
        .arg(base.join("locks"))
        .arg("--state-dir")
        .arg(&base)
        .args([
            "--docker", "off", "run", "--recipe", "bench", "--run-id", "bench",
        ])
        .args(["--no-fetch", "--", "true"])
        .stderr(std::process::Stdio::null());

    let mut series = [
        (
            Series {
                name: "true",
                samples: Vec::new(),
            },
            &mut plain,
        ),
        (
            Series {
                name: "flock(1) true",
                samples: Vec::new(),
            },
            &mut flock,
        ),
        (
            Series {
                name: "timeout(1) true",
                samples: Vec::new(),
            },
            &mut timeout,
        ),
        (
            Series {
                name: "ccci-run run -- true",
                samples: Vec::new(),
            },
            &mut ccci,
        ),
    ];
    // Warm the page cache and the binaries before measuring.
    for (_, cmd) in series.iter_mut() {
        measure(cmd);
    }
    for _ in 0..iterations {
        for (s, cmd) in series.iter_mut() {
            s.samples.push(measure(cmd));
        }
    }

    println!("run_overhead: {iterations} iterations each, interleaved");
    println!(
        "{:<22} {:>10} {:>10} {:>10} {:>14}",
        "command", "median ms", "p90 ms", "CPU ms", "peak RSS KiB"
    );
    for (s, _) in &series {
        println!(
            "{:<22} {:>10.3} {:>10.3} {:>10.3} {:>14}",
            s.name,
            ms(s.median()),
            ms(s.quantile(0.9)),
            ms(s.median_cpu()),
            s.peak_rss_kib()
        );
    }
    let [(plain, _), (flock, _), (timeout, _), (ccci, _)] = &series;
    let over_flock = ms(ccci.median()) - ms(flock.median());
    let over_true = ms(ccci.median()) - ms(plain.median());
    let over_timeout = ms(ccci.median()) - ms(timeout.median());
    println!("ccci-run − flock(1): {over_flock:+.3} ms median (target ≤ 2.5 ms)");
    println!("ccci-run − timeout(1): {over_timeout:+.3} ms median");
    println!("ccci-run − true:     {over_true:+.3} ms median");
    println!(
        "ccci-run peak RSS:   {:.1} MB (target < 10 MB)",
        ccci.peak_rss_kib() as f64 / 1024.0
    );
    ratio::summary(
        "run_overhead",
        &[
            ratio::Figure::new(
                "ccci-run run -- true, median wall",
                ms(ccci.median()),
                "flock(1) true + 2.5 ms, median wall",
                ms(flock.median()) + 2.5,
                "ms",
            )
            .goal(1.0),
            ratio::Figure::new(
                "ccci-run run -- true, median CPU",
                ms(ccci.median_cpu()),
                "flock(1) true, median CPU",
                ms(flock.median_cpu()),
                "ms",
            )
            .goal(2.0),
        ],
    );
}
