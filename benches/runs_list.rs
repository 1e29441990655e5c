//! How `ccci-run runs` scales: N finished runs in the runs dir (each a directory with a
//! realistic `run.json`), listed as a table (the default: the last 24 h) and as JSON with
//! `--all`, against `ls -l` of the same directory as a floor (one stat a run, no record read),
//! measured in the same run, best of three.
//!
//! Target: 10,000 finished runs answered in under 1 s. Measured on a shared 2-core machine
//! under load: 0.46-0.52 s (table) and 0.45-0.48 s (`--all --json`) against 0.23 s for `ls -l`,
//! 2.0-2.3 times as long.
//!
//! `cargo bench --bench runs_list [-- SIZES...]` (default 1000 10000)

// A bench prints its report and reads its own files; clippy.toml keeps print! and eprintln!, and
// raw file reads, out of src/ only.
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ccci-run");

/// A finished run's record as a run writes it (eight phases, a command status, a cgroup).
fn record(n: usize, at: &str) -> String {
    let id = format!("{}", 100_000 + n);
    let phases: Vec<String> = [
        "guards", "abra-dir", "fetch", "janitor", "app-lock", "command", "teardown", "finished",
    ]
    .iter()
    .map(|p| format!(r#"{{"name": "{p}", "at": "{at}"}}"#))
    .collect();
    format!(
        r#"{{
  "run_id": "{id}",
  "recipe": "custom-html",
  "pr": "{n}",
  "ref": null,
  "domain": "cust-{n:06x}.ci.commoninternet.net",
  "stack": "cust-{n:06x}_ci_commoninternet_net",
  "pid": {pid},
  "host": "runner-1",
  "abra_dir": "/var/lib/cc-ci-runs/{id}/abra",
  "recipe_url": "https://git.coopcloud.tech/coop-cloud/custom-html.git",
  "commit": "0123456789abcdef0123456789abcdef01234567",
  "command": ["sh", "-c", "abra app deploy && ./tests/run.sh"],
  "tied_to": [],
  "cgroup": "/sys/fs/cgroup/system.slice/drone-runner-exec.service/ccci-run-{id}-{pid}-123456-4026531836-c2049.1234",
  "supervisor": {{"pid": {pid}, "start_ticks": 123456, "pid_ns": 4026531836, "boot_id": "00000000-0000-0000-0000-000000000000"}},
  "scope": "c2049.1234",
  "marker": "{pid}-123456-4026531836-c2049.1234",
  "phases": [{phases}],
  "shutdown_reason": "command-ended",
  "command_status": {{"kind": "exited", "value": 0}},
  "killed_after_grace": false,
  "exit_code": 0,
  "teardown_errors": [],
  "reaped": null,
  "error": null
}}
"#,
        pid = 1000 + n,
        phases = phases.join(", ")
    )
}

fn populate(runs: &Path, n: usize) {
    let now = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
    for i in 0..n {
        let dir = runs.join(format!("{}", 100_000 + i));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("run.lock"), "").unwrap();
        std::fs::write(dir.join("run.json"), record(i, &now)).unwrap();
    }
}

/// Best of three runs of `cmd` (output discarded).
fn best_of_three(mut cmd: impl FnMut() -> Command) -> Duration {
    (0..3)
        .map(|_| {
            let mut cmd = cmd();
            cmd.stdout(Stdio::null()).stderr(Stdio::null());
            let start = Instant::now();
            let status = cmd.status().unwrap();
            let elapsed = start.elapsed();
            assert!(status.success(), "{cmd:?} failed: {status}");
            elapsed
        })
        .min()
        .unwrap()
}

fn runs<'a>(root: &'a Path, args: &'static [&'static str]) -> impl FnMut() -> Command + 'a {
    move || {
        let mut cmd = Command::new(BIN);
        cmd.env("CCCI_CONFIG", "/dev/null")
            .arg("--runs-dir")
            .arg(root.join("runs"))
            .arg("--lock-dir")
            .arg(root.join("locks"))
            .args(["--docker", "off", "runs"])
            .args(args);
        cmd
    }
}

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![1_000, 10_000]
    } else {
        sizes
    };
    println!("runs_list: N finished runs, best of 3; ratio to `ls -l` of the runs dir");
    println!(
        "{:>7} {:>10} {:>16} {:>10} {:>8} {:>8}",
        "runs", "runs s", "--all --json s", "ls -l s", "ratio", "--all"
    );
    for n in sizes {
        let root = tempfile::tempdir().unwrap();
        populate(&root.path().join("runs"), n);
        // Every one is listed: they all ended just now.
        let out = runs(root.path(), &["--json"])().output().unwrap();
        let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(listed["runs"].as_array().unwrap().len(), n);
        let table = best_of_three(runs(root.path(), &[]));
        let json = best_of_three(runs(root.path(), &["--all", "--json"]));
        let ls = best_of_three(|| {
            let mut cmd = Command::new("ls");
            cmd.arg("-l").arg(root.path().join("runs"));
            cmd
        });
        println!(
            "{:>7} {:>10.3} {:>16.3} {:>10.3} {:>7.1}x {:>7.1}x",
            n,
            table.as_secs_f64(),
            json.as_secs_f64(),
            ls.as_secs_f64(),
            table.as_secs_f64() / ls.as_secs_f64(),
            json.as_secs_f64() / ls.as_secs_f64()
        );
    }
}
