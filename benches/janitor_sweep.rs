//! How the janitor's sweep scales: N stale (unheld) lock files plus N/5 orphaned `.env` files,
//! Docker off, dry run and real, against `find -delete` of the same files as a floor (the least
//! any tool must do to remove them), measured in the same run.
//!
//! Target: a real sweep of 10k lock files + 2k orphans under 1 s, growing linearly.
//!
//! `cargo bench --bench janitor_sweep [-- SIZES...]` (default 1000 10000 50000)

// A bench prints its report and reads its own files; clippy.toml keeps print! and eprintln!, and
// raw file reads, out of src/ only.
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ccci-run");

fn domain(n: usize) -> String {
    format!("orph-{n:06x}.ci.commoninternet.net")
}

/// N lock files, every fifth with an orphaned `.env` (spread over four servers).
fn populate(root: &Path, n: usize) {
    let locks = root.join("locks");
    std::fs::create_dir_all(&locks).unwrap();
    for s in 0..4 {
        std::fs::create_dir_all(root.join(format!("abra/servers/server{s}"))).unwrap();
    }
    for i in 0..n {
        let d = domain(i);
        std::fs::write(locks.join(format!("cc-ci-app-{d}.lock")), "").unwrap();
        if i % 5 == 0 {
            let env = root.join(format!("abra/servers/server{}/{d}.env", i % 4));
            std::fs::write(env, "SECRET=x\n").unwrap();
        }
    }
}

fn janitor(root: &Path, dry_run: bool) -> Duration {
    let mut cmd = Command::new(BIN);
    cmd.arg("--lock-dir")
        .arg(root.join("locks"))
        .arg("--abra-home")
        .arg(root.join("abra"))
        .arg("--runs-dir")
        .arg(root.join("runs"))
        .args(["--docker", "off", "janitor", "--json"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if dry_run {
        cmd.arg("--dry-run");
    }
    let start = Instant::now();
    let status = cmd.status().unwrap();
    let elapsed = start.elapsed();
    assert!(status.success(), "janitor failed: {status}");
    elapsed
}

fn find_delete(root: &Path) -> Duration {
    let start = Instant::now();
    let status = Command::new("find")
        .arg(root.join("locks"))
        .arg(root.join("abra/servers"))
        .args(["-type", "f", "-delete"])
        .status()
        .unwrap();
    let elapsed = start.elapsed();
    assert!(status.success());
    elapsed
}

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![1_000, 10_000, 50_000]
    } else {
        sizes
    };
    println!("janitor_sweep: N stale lock files + N/5 orphaned .env files, Docker off");
    println!(
        "{:>7} {:>8} {:>12} {:>12} {:>14} {:>12} {:>9}",
        "locks", "orphans", "dry-run s", "real s", "real µs/cand", "find -delete", "ratio"
    );
    for n in sizes {
        let root = tempfile::tempdir().unwrap();
        populate(root.path(), n);
        let dry = janitor(root.path(), true);
        let real = janitor(root.path(), false);
        let left = std::fs::read_dir(root.path().join("locks"))
            .unwrap()
            .count();
        assert_eq!(left, 0, "the sweep left {left} lock files");
        let floor_root = tempfile::tempdir().unwrap();
        populate(floor_root.path(), n);
        let floor = find_delete(floor_root.path());
        println!(
            "{:>7} {:>8} {:>12.3} {:>12.3} {:>14.1} {:>12.3} {:>8.1}x",
            n,
            n / 5,
            dry.as_secs_f64(),
            real.as_secs_f64(),
            real.as_secs_f64() * 1e6 / n as f64,
            floor.as_secs_f64(),
            real.as_secs_f64() / floor.as_secs_f64()
        );
    }
}
