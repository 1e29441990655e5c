//! Waiting for a deployed stack to converge, on a real engine: `ccci-run converge` beside
//! what a deploy script does today — `docker stack deploy --detach=false` (the CLI's own wait)
//! and a `docker service ls` loop until every service shows N/N — on the same stacks.
//!
//! "Real convergence" is taken from the engine's event stream, not from the service and task
//! logic under test: for a fresh deploy, the moment the last of the stack's containers started
//! (`docker events`, container `start`, by the stack label); for a rolling update, the moment
//! swarm announced the service's `updatestate.new=completed`. Each wait is timed from that
//! moment to its return, negative when it returned before the stack had converged. Goal for
//! ccci-run: p95 < 250 ms past its stable window, never early. A fresh deploy's tasks must be
//! up for the stable window ([`STABLE`], `--stable`) before they count, so its fresh-deploy
//! figures are shown raw and minus the window; after an update the tasks have been up through
//! the update monitor, longer than the window, so those are raw only.
//!
//! The stack: `app` (2 replicas, stop-first updates, a 3 s update monitor) and `worker`.
//! Needs an engine at DOCKER_HOST (`scripts/docker-engine.sh start`).
//!
//! `cargo bench --bench converge [-- ROUNDS]` (default 5 fresh deploys and 3 updates per waiter)

// A bench prints its report and reads its own files; clippy.toml keeps print! and eprintln!, and
// raw file reads, out of src/ only.
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const BIN: &str = env!("CARGO_BIN_EXE_ccci-run");

const COMPOSE: &str = "version: \"3.8\"
services:
  app:
    image: ccci-test/busybox:latest
    command: [\"sleep\", \"100000\"]
    init: true
    environment: {ROUND: \"ROUND_VALUE\"}
    deploy:
      replicas: 2
      endpoint_mode: dnsrr
      update_config: {order: stop-first, parallelism: 1, delay: 0s, monitor: 3s}
  worker:
    image: ccci-test/busybox:latest
    command: [\"sleep\", \"100000\"]
    init: true
    deploy: {endpoint_mode: dnsrr}
";

/// Containers the stack runs once converged.
const CONTAINERS: usize = 3;

fn docker(args: &[&str]) -> String {
    let out = Command::new("docker")
        .args(args)
        .output()
        .expect("docker CLI");
    assert!(
        out.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn now_ns() -> i128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i128
}

/// The engine's events matching `filters`, as (time in ns, attributes JSON), from now on.
struct Events {
    child: Child,
    lines: Receiver<(i128, String)>,
}

impl Events {
    fn watch(filters: &[&str]) -> Self {
        let mut cmd = Command::new("docker");
        cmd.args([
            "events",
            "--format",
            "{{.TimeNano}} {{json .Actor.Attributes}}",
        ]);
        for f in filters {
            cmd.args(["--filter", f]);
        }
        let mut child = cmd.stdout(Stdio::piped()).spawn().expect("docker events");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some((t, attrs)) = line.split_once(' ') {
                    let _ = tx.send((t.parse().unwrap_or(0), attrs.to_owned()));
                }
            }
        });
        // `docker events` subscribes after it starts; an event sent before is not seen.
        std::thread::sleep(Duration::from_millis(300));
        Self { child, lines: rx }
    }

    /// The time of the `n`-th event whose attributes contain `needle`.
    fn nth(&mut self, n: usize, needle: &str) -> i128 {
        let mut seen = 0;
        loop {
            let (t, attrs) = self
                .lines
                .recv_timeout(Duration::from_secs(120))
                .expect("the engine announced the convergence within 120 s");
            if attrs.contains(needle) {
                seen += 1;
                if seen == n {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return t;
                }
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Waiter {
    Converge,
    DeployDetachFalse,
    ServiceLsLoop,
}

impl Waiter {
    fn name(self) -> &'static str {
        match self {
            Waiter::Converge => "ccci-run converge",
            Waiter::DeployDetachFalse => "docker stack deploy --detach=false",
            Waiter::ServiceLsLoop => "docker service ls loop (1 s)",
        }
    }
}

/// One wait: how late it returned after real convergence (negative: early), and for
/// converge its polls and Docker calls.
struct Sample {
    late_ms: f64,
    polls: u64,
    calls: u64,
}

fn compose_file(dir: &std::path::Path, round: &str) -> String {
    let path = dir.join(format!("stack-{round}.yml"));
    std::fs::write(&path, COMPOSE.replace("ROUND_VALUE", round)).unwrap();
    path.to_string_lossy().into_owned()
}

fn deploy_cmd(file: &str, stack: &str, detach: bool) -> Command {
    let mut cmd = Command::new("docker");
    cmd.args([
        "stack",
        "deploy",
        "--resolve-image",
        "never",
        &format!("--detach={detach}"),
        "-c",
        file,
        stack,
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    cmd
}

/// Deploy (`file` onto `stack`) and wait the way `waiter` waits; returns when it returned
/// (ns since the epoch) and converge's counts.
fn deploy_and_wait(waiter: Waiter, file: &str, stack: &str) -> (i128, u64, u64) {
    match waiter {
        Waiter::DeployDetachFalse => {
            let status = deploy_cmd(file, stack, false).status().unwrap();
            assert!(status.success(), "stack deploy --detach=false failed");
            (now_ns(), 0, 0)
        }
        Waiter::Converge => {
            assert!(deploy_cmd(file, stack, true).status().unwrap().success());
            let out = Command::new(BIN)
                .env("CCCI_CONFIG", "/dev/null")
                .args(["converge", "--stack", stack, "--json", "--timeout", "120"])
                .arg("--stable")
                .arg(format!("{}ms", STABLE.as_millis()))
                .stderr(Stdio::null())
                .output()
                .unwrap();
            let returned = now_ns();
            assert!(out.status.success(), "converge failed: {out:?}");
            let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            (
                returned,
                report["polls"].as_u64().unwrap(),
                report["docker_calls"].as_u64().unwrap(),
            )
        }
        Waiter::ServiceLsLoop => {
            assert!(deploy_cmd(file, stack, true).status().unwrap().success());
            let script = format!(
                "while :; do out=$(docker service ls --filter label=com.docker.stack.namespace={stack} --format '{{{{.Replicas}}}}'); \
                 [ -n \"$out\" ] && ! printf '%s\\n' \"$out\" | grep -qv '^\\([0-9]*\\)/\\1$' && break; sleep 1; done"
            );
            let status = Command::new("sh").args(["-c", &script]).status().unwrap();
            assert!(status.success());
            (now_ns(), 0, 0)
        }
    }
}

fn remove(stack: &str) {
    let _ = Command::new("docker")
        .args(["stack", "rm", stack])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

fn wait_gone(prefix: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !docker(&["ps", "-aq", "--filter", &format!("name={prefix}")])
        .trim()
        .is_empty()
        || !docker(&["network", "ls", "-q", "--filter", &format!("name={prefix}")])
            .trim()
            .is_empty()
    {
        assert!(Instant::now() < deadline, "bench stacks not gone");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A fresh deploy: truth is the last container's start.
fn fresh(waiter: Waiter, dir: &std::path::Path, round: usize) -> Sample {
    let stack = format!("bcv{}f{round}", waiter as u8);
    let file = compose_file(dir, "0");
    let mut events = Events::watch(&[
        "type=container",
        "event=start",
        &format!("label=com.docker.stack.namespace={stack}"),
    ]);
    let (returned, polls, calls) = deploy_and_wait(waiter, &file, &stack);
    let truth = events.nth(CONTAINERS, "");
    remove(&stack);
    Sample {
        late_ms: (returned - truth) as f64 / 1e6,
        polls,
        calls,
    }
}

/// A stop-first rolling update of a converged stack: truth is swarm's `completed`.
fn update(waiter: Waiter, dir: &std::path::Path, round: usize) -> Sample {
    let stack = format!("bcv{}u{round}", waiter as u8);
    deploy_and_wait(Waiter::Converge, &compose_file(dir, "0"), &stack);
    let file = compose_file(dir, &format!("{}", round + 1));
    let mut events = Events::watch(&["type=service", &format!("service={stack}_app")]);
    let (returned, polls, calls) = deploy_and_wait(waiter, &file, &stack);
    let truth = events.nth(1, "\"updatestate.new\":\"completed\"");
    remove(&stack);
    Sample {
        late_ms: (returned - truth) as f64 / 1e6,
        polls,
        calls,
    }
}

/// The stable window the bench gives `converge`.
const STABLE: Duration = Duration::from_secs(1);

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// One row; `minus_ms` is taken off every sample (the stable window), named in the row.
fn summarise(scenario: &str, waiter: Waiter, samples: &[Sample], minus_ms: f64) {
    let mut late: Vec<f64> = samples.iter().map(|s| s.late_ms - minus_ms).collect();
    late.sort_by(f64::total_cmp);
    let early = late.iter().filter(|l| **l < 0.0).count();
    let per_poll = {
        let (polls, calls): (u64, u64) = samples
            .iter()
            .fold((0, 0), |(p, c), s| (p + s.polls, c + s.calls));
        if polls == 0 {
            "—".to_owned()
        } else {
            format!("{:.2} ({polls} polls)", calls as f64 / polls as f64)
        }
    };
    println!(
        "{scenario:<15} {:<36} n={:<2} early={early:<2} p50={:>8.0} ms p95={:>8.0} ms min={:>8.0} max={:>8.0} ms  calls/poll={per_poll}",
        if minus_ms > 0.0 {
            format!("{} - {minus_ms:.0} ms window", waiter.name())
        } else {
            waiter.name().to_owned()
        },
        late.len(),
        percentile(&late, 0.5),
        percentile(&late, 0.95),
        late[0],
        late[late.len() - 1],
    );
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(5);
    if Command::new("docker")
        .args(["version", "--format", "{{.Server.APIVersion}}"])
        .output()
        .map_or(true, |o| !o.status.success())
    {
        eprintln!(
            "converge bench: no Docker engine at DOCKER_HOST; start one with scripts/docker-engine.sh start"
        );
        std::process::exit(1);
    }
    let dir = tempfile::tempdir().unwrap();
    println!(
        "time from real convergence (engine events) to return; negative = returned before the stack converged"
    );
    for waiter in [
        Waiter::Converge,
        Waiter::DeployDetachFalse,
        Waiter::ServiceLsLoop,
    ] {
        let samples: Vec<Sample> = (0..rounds).map(|r| fresh(waiter, dir.path(), r)).collect();
        summarise("fresh deploy", waiter, &samples, 0.0);
        if waiter == Waiter::Converge {
            summarise(
                "fresh deploy",
                waiter,
                &samples,
                STABLE.as_secs_f64() * 1000.0,
            );
        }
        let updates = rounds.div_ceil(2).max(1);
        let samples: Vec<Sample> = (0..updates)
            .map(|r| update(waiter, dir.path(), r))
            .collect();
        summarise("stop-first upd", waiter, &samples, 0.0);
        wait_gone("bcv");
    }
}
