//! Handover across hosts through etcd, on a fleet of network namespaces (the suite's
//! `tests/integration/netfleet.rs`: three etcd members and two runner hosts behind a bridge,
//! partitions made with nftables): how long after one holder's last write the next holder's
//! command first writes, after a clean release and after a lease lapse (the holder cut off from
//! every member), and how long the next holder starts after etcd deleted the lost holder's key
//! (the extra wait the proof of the lost holder's end costs, beside etcd's own expiry sweep).
//! A handover after a lapse is held against its bound: the lease TTL, the stop budget and 1 s
//! from the cut.
//!
//! Each holder's command appends `$EPOCHREALTIME host token` to one shared log every 50 ms, as
//! in the partition tests. Contenders, in the same run on the same cluster, round by round in turn: `ccci-run lock` and
//! `ccci-run run` (lease TTL 6 s, kill grace 2 s) and `etcdctl lock --ttl 6` (etcd's own lock
//! recipe and client: the baseline). Not a timed test: it prints medians, p90s and ratios.
//!
//! `etcdctl lock` does not stop its command when its session is lost: after a lapse its holder
//! writes on until the bench ends it, so its overlap is whatever the bench allows and is not
//! reported; its handover after a lapse is reported from the cut and from the key's deletion.
//!
//! Needs root, `ip`, `nft`, `etcd`, `etcdctl`, `bash` and a build with the etcd backend:
//! `cargo bench --features etcd --bench etcd_handover [-- ROUNDS] [--clean]` (default 5 rounds;
//! `--clean`: the clean releases only, no lapses). The summary holds each clean handover's
//! median against `etcdctl lock`'s (goal: at most 1.2 times) and against the ratio recorded
//! in `benches/baselines.json`.
// A bench prints its report and reads its own files; clippy.toml keeps print! and eprintln!, and
// raw file reads, out of src/ only.
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// The suite's fleet (it allows what the bench leaves unused).
#[path = "../tests/integration/netfleet.rs"]
mod netfleet;
#[path = "support/ratio.rs"]
mod ratio;

use netfleet::{Fleet, Host};

const BIN: &str = env!("CARGO_BIN_EXE_ccci-run");
const TTL: &str = "6";
const KILL_GRACE: &str = "2";
/// How long any wait may take before the bench gives up.
const PATIENCE: Duration = Duration::from_secs(60);
/// The named lock (ccci-run) and lock name (etcdctl) the contenders take.
const LOCK: &str = "handover";

/// Every holder's command: a line to `$LOG` every 50 ms until `$STOP` exists; it dies at
/// SIGTERM. The token is ccci-run's fencing token, or etcdctl's lock revision.
const HOLDER: &str = r#"
write() { echo "$EPOCHREALTIME $TAG ${CCCI_FENCING_TOKEN:-$ETCD_LOCK_REV}" >> "$LOG"; }
write
echo "ready $$"
while [ ! -e "$STOP" ]; do sleep 0.05; write; done
"#;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Contender {
    CcciLock,
    CcciRun,
    Etcdctl,
}

impl Contender {
    fn name(self) -> &'static str {
        match self {
            Contender::CcciLock => "ccci-run lock",
            Contender::CcciRun => "ccci-run run",
            Contender::Etcdctl => "etcdctl lock (baseline)",
        }
    }

    fn slug(self) -> &'static str {
        match self {
            Contender::CcciLock => "ccci-lock",
            Contender::CcciRun => "ccci-run",
            Contender::Etcdctl => "etcdctl",
        }
    }

    /// The prefix of the keys whose deletion hands the lock on.
    fn owner_prefix(self, domain: &str) -> String {
        match self {
            Contender::CcciLock => format!("/ccci-run/named/{LOCK}/owner"),
            Contender::CcciRun => format!("/ccci-run/app/{domain}/owner"),
            Contender::Etcdctl => format!("{LOCK}/"),
        }
    }
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// A spawned process and its output lines, as they come.
struct Spawned {
    child: Child,
    lines: Receiver<String>,
    cmdline: String,
}

impl Spawned {
    fn spawn(mut cmd: Command) -> Self {
        let cmdline = format!("{cmd:?}");
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let (tx, lines) = channel();
        let out: Box<dyn std::io::Read + Send> = Box::new(child.stdout.take().unwrap());
        let err: Box<dyn std::io::Read + Send> = Box::new(child.stderr.take().unwrap());
        for stream in [out, err] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            });
        }
        Self {
            child,
            lines,
            cmdline,
        }
    }

    fn wait_for(&self, needle: &str) {
        let deadline = Instant::now() + PATIENCE;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return,
                Ok(line) => seen.push(line),
                Err(e) => panic!(
                    "{}: no line with {needle:?} ({e}); it printed:\n{}",
                    self.cmdline,
                    seen.join("\n")
                ),
            }
        }
    }
}

/// DELETE events under a prefix, as `etcdctl watch` from the observer reports them, timed.
struct Watch {
    child: Child,
    deletes: Arc<Mutex<Vec<(f64, String)>>>,
}

impl Watch {
    fn start(fleet: &Fleet, prefix: &str) -> Self {
        let mut cmd = Command::new("etcdctl");
        cmd.env("ETCDCTL_API", "3").args([
            "--endpoints",
            &fleet.endpoints(),
            "watch",
            "--prefix",
            prefix,
        ]);
        // The observer runs it: no cut ever touches it.
        let mut child = fleet
            .on_observer(&cmd)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deletes = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().unwrap();
        let seen = deletes.clone();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(out).lines().map_while(Result::ok);
            while let Some(line) = lines.next() {
                if line == "DELETE" {
                    let at = now();
                    let key = lines.next().unwrap_or_default();
                    seen.lock().unwrap().push((at, key));
                }
            }
        });
        Self { child, deletes }
    }

    /// The first deletion at or after `since`.
    fn deleted_after(&self, since: f64) -> Option<f64> {
        let deletes = self.deletes.lock().unwrap();
        deletes.iter().map(|(at, _)| *at).find(|at| *at >= since)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One holder's writes: (first, last).
fn tenures(log: &Path) -> Vec<(String, f64, f64)> {
    let mut tenures: Vec<(String, f64, f64)> = Vec::new();
    for line in std::fs::read_to_string(log).unwrap_or_default().lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let (time, tag): (f64, &str) = (words[0].parse().unwrap(), words[1]);
        match tenures.iter_mut().find(|t| t.0 == tag) {
            Some(t) => {
                t.1 = t.1.min(time);
                t.2 = t.2.max(time);
            }
            None => tenures.push((tag.to_owned(), time, time)),
        }
    }
    tenures.sort_by(|a, b| a.1.total_cmp(&b.1));
    tenures
}

/// What one hand-off measured, in seconds.
struct Handoff {
    /// Next holder's first write minus the last holder's last write.
    handover: f64,
    /// Next holder's first write after the cut (lapses only).
    after_cut: Option<f64>,
    /// Next holder's first write after etcd deleted the last holder's key (lapses only).
    after_expiry: Option<f64>,
}

struct Bench {
    fleet: Fleet,
    dir: tempfile::TempDir,
    domain: String,
}

impl Bench {
    fn host_dir(&self, host: Host) -> PathBuf {
        self.dir.path().join(host.tag())
    }

    /// `ccci-run` on `host` with the host's own directories and the fleet's etcd.
    fn ccci(&self, host: Host) -> Command {
        let root = self.host_dir(host);
        std::fs::create_dir_all(root.join("state")).unwrap();
        let mut c = Command::new(BIN);
        c.env("CCCI_CONFIG", "/dev/null")
            .arg("--runs-dir")
            .arg(root.join("runs"))
            .arg("--abra-home")
            .arg(root.join("abra"))
            .arg("--lock-dir")
            .arg(root.join("locks"))
            .arg("--state-dir")
            .arg(root.join("state"))
            .args(["--docker", "off", "--lease-ttl", TTL])
            .args(["--etcd-endpoints", &self.fleet.endpoints()]);
        c
    }

    fn holder(&self, who: Contender, host: Host, id: &str, log: &Path, stop: &Path) -> Command {
        let mut cmd = match who {
            Contender::CcciLock => {
                let mut c = self.ccci(host);
                c.args(["lock", LOCK, "--kill-grace", KILL_GRACE, "--"]);
                c
            }
            Contender::CcciRun => {
                let mut c = self.ccci(host);
                c.args([
                    "run",
                    "--recipe",
                    "custom-html",
                    "--pr",
                    "1",
                    "--run-id",
                    id,
                ])
                .args(["--no-fetch", "--kill-grace", KILL_GRACE, "--"]);
                c
            }
            Contender::Etcdctl => {
                let mut c = Command::new("etcdctl");
                c.env("ETCDCTL_API", "3")
                    .args(["--endpoints", &self.fleet.endpoints()])
                    .args(["lock", "--ttl", TTL, LOCK, "--"]);
                c
            }
        };
        cmd.args(["bash", "-c", HOLDER])
            .env("LOG", log)
            .env("STOP", stop)
            .env("TAG", host.tag());
        self.fleet.on_host(host, &cmd)
    }

    /// Wait until the waiter is in line behind the holder.
    fn wait_queued(&self, who: Contender, waiter: &Spawned) {
        match who {
            Contender::CcciLock => waiter.wait_for("waiting as queue ticket"),
            Contender::CcciRun => waiter.wait_for("waiting; held by"),
            Contender::Etcdctl => {
                // etcdctl says nothing while it waits: its key in etcd says it is in line.
                let deadline = Instant::now() + PATIENCE;
                while self.fleet.keys(&format!("{LOCK}/")).len() < 2 {
                    assert!(Instant::now() < deadline, "the etcdctl waiter never queued");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }

    /// One hand-off from host A to host B: a clean release, or a lapse (A cut off).
    fn handoff(&self, who: Contender, round: usize, lapse: bool) -> Handoff {
        let dir = self
            .dir
            .path()
            .join(format!("{}-{round}-{lapse}", who.slug()));
        std::fs::create_dir_all(&dir).unwrap();
        let (log, stop_a, stop_b) = (dir.join("log"), dir.join("stop-a"), dir.join("stop-b"));
        let id = |host: Host| format!("{}{round}{}", host.tag(), u8::from(lapse));
        let watch = Watch::start(&self.fleet, &who.owner_prefix(&self.domain));
        let mut a = Spawned::spawn(self.holder(who, Host::A, &id(Host::A), &log, &stop_a));
        a.wait_for("ready");
        let mut b = Spawned::spawn(self.holder(who, Host::B, &id(Host::B), &log, &stop_b));
        self.wait_queued(who, &b);
        let cut_at = now();
        if lapse {
            self.fleet.cut_off(Host::A);
            b.wait_for("ready");
            std::thread::sleep(Duration::from_millis(500));
            self.fleet.heal();
            std::fs::write(&stop_a, "").unwrap();
            let _ = a.child.wait();
        } else {
            std::fs::write(&stop_a, "").unwrap();
            let _ = a.child.wait();
            b.wait_for("ready");
        }
        std::fs::write(&stop_b, "").unwrap();
        let _ = b.child.wait();
        let t = tenures(&log);
        assert!(
            t.len() == 2 && t[0].0 == "a" && t[1].0 == "b",
            "{}: the log {} shows {t:?}",
            who.name(),
            log.display()
        );
        let b_first = t[1].1;
        Handoff {
            handover: b_first - t[0].2,
            after_cut: lapse.then_some(b_first - cut_at),
            after_expiry: if lapse {
                watch.deleted_after(cut_at).map(|at| b_first - at)
            } else {
                None
            },
        }
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// (median, p90) in ms, or None for no values.
fn stats(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let mut v: Vec<f64> = values.map(|s| s * 1000.0).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some((quantile(&v, 0.5), quantile(&v, 0.9)))
}

fn cell(s: Option<(f64, f64)>) -> String {
    s.map_or("-".to_owned(), |(m, p)| format!("{m:>8.0} {p:>8.0}"))
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(5);
    let clean_only = std::env::args().any(|a| a == "--clean");
    assert!(
        nix::unistd::geteuid().is_root(),
        "the fleet's network namespaces need root"
    );
    let fleet = Fleet::start().unwrap_or_else(|why| panic!("no fleet here: {why}"));
    let dir = tempfile::tempdir().unwrap();
    let domain = {
        let out = Command::new(BIN)
            .env("CCCI_CONFIG", "/dev/null")
            .args(["app-domain", "--recipe", "custom-html", "--pr", "1"])
            .output()
            .unwrap();
        // The domain, then the stack name.
        let text = String::from_utf8(out.stdout).unwrap();
        text.lines().next().expect("an app domain").to_owned()
    };
    let bench = Bench { fleet, dir, domain };
    println!(
        "etcd handover on a fleet of network namespaces: lease TTL {TTL} s, kill grace \
         {KILL_GRACE} s, {rounds} rounds (A holds, B waits; A releases or is cut off)"
    );
    let contenders = [Contender::CcciLock, Contender::CcciRun, Contender::Etcdctl];
    // Round by round, each contender in turn: the machine's noise, which drifts over a run,
    // falls on all three alike, as their ratios assume.
    let mut results: Vec<(Contender, Vec<Handoff>, Vec<Handoff>)> = contenders
        .iter()
        .map(|who| (*who, Vec::new(), Vec::new()))
        .collect();
    for lapse in [false, true] {
        if lapse && clean_only {
            break;
        }
        for r in 0..rounds {
            for (who, clean, lapsed) in &mut results {
                let handoff = bench.handoff(*who, r, lapse);
                if lapse { lapsed } else { clean }.push(handoff);
            }
        }
    }
    println!(
        "\n{:<26} {:>17} {:>17} {:>17} {:>17}",
        "median/p90 (ms)", "clean handover", "lapse handover", "lapse from cut", "after expiry"
    );
    for (who, clean, lapsed) in &results {
        let lapse_handover = if *who == Contender::Etcdctl {
            None
        } else {
            stats(lapsed.iter().map(|h| h.handover))
        };
        println!(
            "{:<26} {:>17} {:>17} {:>17} {:>17}",
            who.name(),
            cell(stats(clean.iter().map(|h| h.handover))),
            cell(lapse_handover),
            cell(stats(lapsed.iter().filter_map(|h| h.after_cut))),
            cell(stats(lapsed.iter().filter_map(|h| h.after_expiry))),
        );
    }
    let median = |who: Contender, pick: &dyn Fn(&Handoff) -> Option<f64>, lapse: bool| {
        results
            .iter()
            .find(|r| r.0 == who)
            .and_then(|r| stats(if lapse { &r.2 } else { &r.1 }.iter().filter_map(pick)))
            .map(|s| s.0)
    };
    println!();
    for who in [Contender::CcciLock, Contender::CcciRun] {
        let ratio = |pick: &dyn Fn(&Handoff) -> Option<f64>, lapse: bool| match (
            median(who, pick, lapse),
            median(Contender::Etcdctl, pick, lapse),
        ) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
            _ => "-".to_owned(),
        };
        let extra = match (
            median(who, &|h| h.after_expiry, true),
            median(Contender::Etcdctl, &|h| h.after_expiry, true),
        ) {
            (Some(a), Some(b)) => format!("{:+.0} ms", a - b),
            _ => "-".to_owned(),
        };
        println!(
            "{} / etcdctl lock: clean handover {}, lapse from cut {}, after expiry {} \
             (the extra wait for the lost holder's end: {extra})",
            who.name(),
            ratio(&|h| Some(h.handover), false),
            ratio(&|h| h.after_cut, true),
            ratio(&|h| h.after_expiry, true),
        );
    }
    // The bound a handover after a lapse is held to: TTL + stop budget (grace + 0.5 s) + 1 s.
    let ttl: f64 = TTL.parse().expect("a TTL in seconds");
    let grace: f64 = KILL_GRACE.parse().expect("a kill grace in seconds");
    let bound = ttl + grace + 0.5 + 1.0;
    for who in [Contender::CcciLock, Contender::CcciRun] {
        let worst = results
            .iter()
            .find(|r| r.0 == who)
            .and_then(|r| r.2.iter().filter_map(|h| h.after_cut).reduce(f64::max));
        if let Some(worst) = worst {
            println!(
                "{}: slowest lapse from cut {worst:.2} s, bound TTL + stop budget + 1 s = \
                 {bound:.1} s: {}",
                who.name(),
                if worst <= bound { "within" } else { "OVER" }
            );
        }
    }
    let anchor = median(Contender::Etcdctl, &|h| Some(h.handover), false);
    let figures: Vec<ratio::Figure> = [Contender::CcciLock, Contender::CcciRun]
        .into_iter()
        .filter_map(|who| {
            Some(
                ratio::Figure::new(
                    format!("{} clean handover, median", who.name()),
                    median(who, &|h| Some(h.handover), false)?,
                    "etcdctl lock clean handover, median",
                    anchor?,
                    "ms",
                )
                .goal(1.2),
            )
        })
        .collect();
    ratio::summary("etcd_handover", &figures);
}
