//! Locks beyond one host, measured against one host's: handoffs of the app lock (`run`) and of
//! a named lock (`lock`) through a 3-member etcd cluster on loopback, 20 waiters spread over two
//! "hosts" (directories of their own), against the same through the local flock and against
//! `etcdctl lock` (etcd's own lock recipe and client), in one run. Then the janitor's sweep
//! cost per candidate with etcd against the local flock.
//!
//! A handoff is the time from one holder's end to the next one's start (both logged by the
//! holders themselves); p50 and p99 over every handoff of a round. Target: etcd handoff p99
//! under 50 ms on loopback.
//!
//! Needs `etcd`, `etcdctl` and a build with the etcd backend:
//! `cargo bench --features etcd --bench etcd_lock [-- WAITERS]` (default 20)

// A bench prints its report and reads its own files; clippy.toml keeps print! and eprintln!, and
// raw file reads, out of src/ only.
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ccci-run");

/// What each holder runs: log start and end, hold 10 ms in between.
const WORK: &str = r#"echo "$ID start $(date +%s%N)" >> "$LOG"; sleep 0.01; echo "$ID end $(date +%s%N)" >> "$LOG""#;

// The suite's cluster: 3 members on free loopback ports, started and waited for.
#[allow(dead_code)]
#[path = "../tests/integration/etcd_cluster.rs"]
mod etcd_cluster;

use etcd_cluster::Cluster;

/// How many keys live under `prefix`.
fn count(cluster: &Cluster, prefix: &str) -> usize {
    let out = cluster.etcdctl(&["get", "--prefix", "--keys-only", prefix]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.is_empty())
        .count()
}

/// Where one round happens: two hosts' directories, the log, and (with etcd) the endpoints.
struct Round {
    dir: tempfile::TempDir,
    endpoints: Option<String>,
}

impl Round {
    fn new(endpoints: Option<&str>) -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            endpoints: endpoints.map(str::to_owned),
        }
    }

    fn log(&self) -> std::path::PathBuf {
        self.dir.path().join("log")
    }

    /// `ccci-run` as host `host` (0 or 1).
    fn ccci(&self, host: usize) -> Command {
        let root = self.dir.path().join(format!("host{host}"));
        let mut c = Command::new(BIN);
        c.env("CCCI_CONFIG", "/dev/null")
            .arg("--lock-dir")
            // One host's flock: a shared lock dir; with etcd the lock dirs differ, as on two
            // machines.
            .arg(if self.endpoints.is_some() {
                root.join("locks")
            } else {
                self.dir.path().join("locks")
            })
            .arg("--runs-dir")
            .arg(root.join("runs"))
            .arg("--abra-home")
            .arg(root.join("abra"))
            .arg("--state-dir")
            .arg(self.dir.path())
            .args(["--docker", "off", "--cgroup", "off"]);
        if let Some(endpoints) = &self.endpoints {
            c.args(["--etcd-endpoints", endpoints]);
        }
        c.env("LOG", self.log());
        c
    }
}

/// What is measured: which lock, and how a waiter is started.
#[derive(Clone, Copy)]
enum Kind {
    App,
    Named,
}

fn waiter(round: &Round, kind: Kind, host: usize, id: &str, script: &str) -> Command {
    let mut c = round.ccci(host);
    match kind {
        Kind::App => c.args([
            "run",
            "--recipe",
            "bench",
            "--pr",
            "1",
            "--run-id",
            id,
            "--no-fetch",
            "--",
            "sh",
            "-c",
            script,
        ]),
        Kind::Named => c.args(["lock", "bench", "--", "sh", "-c", script]),
    };
    c.env("ID", id);
    c
}

/// Spawn and wait for a line on stderr containing `needle`.
fn start(mut cmd: Command, needle: &str) -> Child {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    loop {
        let line = lines.next().expect("ended before the line").unwrap();
        if line.contains(needle) {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    child
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Handoffs (ms) from the log: each end to the next start.
fn handoffs(log: &Path) -> Vec<f64> {
    let mut events: Vec<(u128, bool)> = std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[2].parse().unwrap(), f[1] == "start")
        })
        .collect();
    events.sort();
    let mut h: Vec<f64> = events
        .windows(2)
        .filter(|w| !w[0].1 && w[1].1)
        .map(|w| (w[1].0 - w[0].0) as f64 / 1e6)
        .collect();
    h.sort_by(f64::total_cmp);
    h
}

/// A holder and `waiters` waiters queued behind it, alternating hosts; returns the handoffs.
fn ccci_round(kind: Kind, endpoints: Option<&str>, waiters: usize) -> Vec<f64> {
    let round = Round::new(endpoints);
    let (held, waiting) = match kind {
        Kind::App => ("held", "in flight — waiting"),
        Kind::Named => ("held", "waiting as queue ticket"),
    };
    let mut holder = start(
        waiter(
            &round,
            kind,
            0,
            "holder",
            "echo held >&2; read line || true",
        ),
        held,
    );
    let children: Vec<Child> = (0..waiters)
        .map(|i| start(waiter(&round, kind, i % 2, &format!("w{i}"), WORK), waiting))
        .collect();
    drop(holder.stdin.take());
    assert!(holder.wait().unwrap().success());
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    handoffs(&round.log())
}

/// The same with `etcdctl lock`: a waiter has arrived once its key is in etcd.
fn etcdctl_round(cluster: &Cluster, waiters: usize) -> Vec<f64> {
    let round = Round::new(None);
    let name = format!("bench-{}", std::process::id());
    let lock = |script: &str| {
        let mut c = Command::new("etcdctl");
        c.env("ETCDCTL_API", "3")
            .env("LOG", round.log())
            .args(["--endpoints", &cluster.endpoints(), "lock", &name, "--"])
            .args(["sh", "-c", script])
            .stdin(Stdio::piped())
            .stdout(Stdio::null());
        c
    };
    // etcdctl gives its command no stdin: the holder waits for a file instead.
    let release = round.dir.path().join("release");
    let mut holder = lock("while [ ! -e \"$RELEASE\" ]; do sleep 0.01; done")
        .env("RELEASE", &release)
        .spawn()
        .unwrap();
    while count(cluster, &name) < 1 {
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut children = Vec::new();
    for i in 0..waiters {
        let mut c = lock(WORK);
        c.env("ID", format!("w{i}"));
        children.push(c.spawn().unwrap());
        while count(cluster, &name) < i + 2 {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    std::fs::write(&release, "").unwrap();
    assert!(holder.wait().unwrap().success());
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    handoffs(&round.log())
}

fn row(name: &str, h: &[f64]) {
    println!(
        "{name:<40} {:>10.2} {:>10.2} {:>10.2}",
        quantile(h, 0.5),
        quantile(h, 0.99),
        h[h.len() - 1]
    );
}

/// A real sweep (Docker off) over `n` candidates (orphaned `.env` files), etcd or flock.
fn sweep(endpoints: Option<&str>, n: usize) -> Duration {
    let round = Round::new(endpoints);
    let servers = round.dir.path().join("host0/abra/servers/ci");
    std::fs::create_dir_all(&servers).unwrap();
    for i in 0..n {
        std::fs::write(
            servers.join(format!("orph-{i:06x}.ci.commoninternet.net.env")),
            "X=1\n",
        )
        .unwrap();
    }
    let mut c = round.ccci(0);
    c.args(["janitor", "--json"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let started = Instant::now();
    assert!(c.status().unwrap().success());
    started.elapsed()
}

fn main() {
    let waiters: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(20);
    let cluster = Cluster::start().expect("etcd and etcdctl (apt install etcd-server etcd-client)");
    let endpoints = cluster.endpoints();
    let etcd = Some(endpoints.as_str());
    println!(
        "etcd_lock: {waiters} waiters over two hosts, each holding 10 ms; handoff in ms \
         (3-member etcd on loopback)"
    );
    println!("{:<40} {:>10} {:>10} {:>10}", "lock", "p50", "p99", "max");
    for (name, h) in [
        (
            "app lock, local flock (one host)",
            ccci_round(Kind::App, None, waiters),
        ),
        (
            "app lock, etcd (two hosts)",
            ccci_round(Kind::App, etcd, waiters),
        ),
        (
            "named lock, local flock (one host)",
            ccci_round(Kind::Named, None, waiters),
        ),
        (
            "named lock, etcd (two hosts)",
            ccci_round(Kind::Named, etcd, waiters),
        ),
        ("etcdctl lock (baseline)", etcdctl_round(&cluster, waiters)),
    ] {
        row(name, &h);
    }
    println!("target: etcd handoff p99 < 50 ms");
    let n = 200;
    let local = sweep(None, n);
    let remote = sweep(etcd, n);
    println!(
        "janitor sweep of {n} candidates (Docker off): flock {:.2} ms/candidate, etcd {:.2} \
         ms/candidate ({:.1}x)",
        local.as_secs_f64() * 1e3 / n as f64,
        remote.as_secs_f64() * 1e3 / n as f64,
        remote.as_secs_f64() / local.as_secs_f64()
    );
}
