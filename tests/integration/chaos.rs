//! The chaos harness: randomized schedules of concurrent runs over a few domains, with janitors
//! at random moments and faults injected at the points where they hurt — SIGKILL or SIGTERM of a
//! run as its command starts, while it is parked on the app lock, and in the middle of its
//! teardown; deadlines; janitors killed mid-sweep; reboots (every process killed, the lock
//! dir emptied); runs in a pid namespace of their own (a container sharing the directories and
//! the cgroup tree); a second configuration on the host with a dead run of its own; and SIGKILL
//! of a run whose command's child keeps writing. Beside a one-host schedule, users of their own
//! meet a thread limit (a `run`, `lock` or `janitor` under an RLIMIT_NPROC another of their
//! processes fills) and used-up inotify instances (named-lock waiters in line). Every schedule
//! comes from a printed seed, so a failure replays the same plan.
//!
//! After each schedule and a final janitor sweep it checks the promise:
//! - no live run's app was removed while it ran (each command checks its own `.env` at its end);
//! - no live run's process was killed (each command checks its daemon at its end; exit codes);
//! - no two runs of one domain overlapped (from the commands' own timestamps);
//! - nothing of a dead run acts after the next holder of its domain starts (a SIGKILLed run's
//!   writer never writes after the next run's start);
//! - nothing of a dead run is left: `.env` files, lock files, state files, processes;
//! - the other configuration's dead run was left alone, and its own janitor clears it;
//! - every exit code is one the contract allows;
//! - a limited subcommand works or ends with its documented code naming the limit; waiters
//!   without inotify are served in order; nothing of either user is left.
//!
//! In its two-host mode (with the etcd backend) the runs are spread over two "hosts" (directories
//! of their own) sharing a real 3-member etcd cluster, and a schedule may also kill the cluster's
//! leader or stop every member past the lease TTL (a partition as the runs see it): a holder
//! that loses its lease must stop (76), and still no two runs of one domain overlap.
//!
//! CI runs a bounded slice; the soak runs as many schedules as asked:
//!
//! ```sh
//! CCCI_CHAOS_SCHEDULES=1000 CCCI_CHAOS_SEED=1 cargo test --release --test integration chaos -- --nocapture
//! ```

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

use crate::etcd_cluster::Cluster as EtcdCluster;
use crate::util::{Sandbox, list, process_alive, sh_quote};

/// The fault a run meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    None,
    TermAtStart,
    KillAtStart,
    TermWhileParked,
    KillWhileParked,
    KillInTeardown,
    Deadline,
    /// The teardown hook hangs: the teardown budget must end it.
    HangingHook,
    /// The run lives in a pid namespace of its own (a container sharing our directories and
    /// the cgroup tree): janitors and other runs' sweeps on the host must judge it alive.
    InPidNamespace,
    /// SIGKILL of the run as its command starts, while a child of the command writes to the
    /// log every 100 ms: nothing of it may write once the next run of its domain has started.
    KillWriter,
}

const FAULTS: [Fault; 8] = [
    Fault::None,
    Fault::TermAtStart,
    Fault::KillAtStart,
    Fault::TermWhileParked,
    Fault::KillWhileParked,
    Fault::KillInTeardown,
    Fault::Deadline,
    Fault::HangingHook,
];

#[derive(Debug, Clone)]
struct RunPlan {
    id: String,
    pr: u8,
    fault: Fault,
    hold_ms: u64,
    /// Which host it runs on (two-host mode), else 0.
    host: usize,
}

/// What happens to the etcd cluster in a two-host schedule, after so many events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EtcdFault {
    None,
    KillLeader {
        after: usize,
    },
    /// Every member stopped for the lease TTL and two seconds more.
    Partition {
        after: usize,
    },
}

/// The lease TTL of two-host schedules, seconds.
const CHAOS_TTL: u32 = 5;

#[derive(Debug, Clone)]
struct Plan {
    seed: u64,
    /// Apps are also a small real Docker resource: a labelled volume of the run's stack.
    docker: bool,
    runs: Vec<RunPlan>,
    /// Chance, after each event, that a janitor starts.
    janitor_chance: f64,
    /// Chance that a janitor is SIGKILLed as soon as it reports anything.
    kill_janitor_chance: f64,
    /// After this many events, every process is killed and the lock dir emptied.
    reboot_after: Option<usize>,
    /// Two hosts on etcd, and what befalls the cluster.
    etcd: Option<EtcdFault>,
    /// A second configuration on the host (a sandbox of its own) with a dead run whose daemon
    /// this schedule's janitors and runs must never touch.
    other_config: bool,
}

impl Plan {
    fn new(seed: u64, docker: bool, etcd: bool) -> Self {
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut runs: Vec<RunPlan> = (0..rng.random_range(3..=7))
            .map(|i| RunPlan {
                id: format!("chaos-{seed}-{i}"),
                pr: rng.random_range(1..=3),
                fault: FAULTS[rng.random_range(0..FAULTS.len())],
                hold_ms: rng.random_range(20..=250),
                host: 0,
            })
            .collect();
        let mut plan = Self {
            seed,
            docker,
            janitor_chance: rng.random_range(0.0..0.3),
            kill_janitor_chance: rng.random_range(0.0..0.5),
            reboot_after: rng.random_bool(0.15).then(|| rng.random_range(3..30)),
            runs: Vec::new(),
            etcd: None,
            other_config: false,
        };
        if !etcd {
            // Drawn from a generator of their own, so the rest of a plan stays as its seed made
            // it. (On etcd a lock forgets its holder with its lease: there a dead holder's
            // leftovers are the janitor's, not the next holder's.)
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x1d3a);
            for run in &mut runs {
                match rng.random_range(0..8) {
                    0 => run.fault = Fault::InPidNamespace,
                    1 => run.fault = Fault::KillWriter,
                    _ => {}
                }
            }
            plan.other_config = rng.random_bool(0.5);
        }
        if etcd {
            // Drawn from a generator of their own: one-host schedules replay as before.
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0xe7cd);
            for run in &mut runs {
                run.host = rng.random_range(0..2);
            }
            plan.reboot_after = None;
            plan.etcd = Some(match rng.random_range(0..3) {
                0 => EtcdFault::None,
                1 => EtcdFault::KillLeader {
                    after: rng.random_range(3..15),
                },
                _ => EtcdFault::Partition {
                    after: rng.random_range(3..15),
                },
            });
        }
        plan.runs = runs;
        plan
    }
}

/// Faults injected and schedules run, for the soak's report.
#[derive(Debug, Default)]
struct Tally {
    schedules: usize,
    faults: BTreeMap<String, usize>,
}

impl Tally {
    fn count(&mut self, what: &str) {
        *self.faults.entry(what.to_owned()).or_default() += 1;
    }
}

enum Msg {
    Line(usize, String),
    Closed(usize),
}

struct Spawned {
    child: Child,
    kind: Kind,
    open_streams: u8,
    status: Option<std::process::ExitStatus>,
    killed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Run(usize),
    Janitor,
}

impl Spawned {
    fn is_run(&self) -> bool {
        matches!(self.kind, Kind::Run(_))
    }
}

fn spawn(cmd: &mut Command, index: usize, tx: &Sender<Msg>) -> Child {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out: Box<dyn std::io::Read + Send> = Box::new(child.stdout.take().unwrap());
    let err: Box<dyn std::io::Read + Send> = Box::new(child.stderr.take().unwrap());
    for stream in [out, err] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(Msg::Line(index, line));
            }
            let _ = tx.send(Msg::Closed(index));
        });
    }
    child
}

/// Signal a child that has not been waited for yet (a waited-for pid may already be reused).
fn kill(spawned: &mut Spawned, sig: Signal) {
    spawned.killed = true;
    if spawned.status.is_none() {
        let pid = nix::unistd::Pid::from_raw(spawned.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, sig);
    }
}

/// What a schedule left for the checks.
struct Outcome {
    transcript: Vec<String>,
    /// Run index → exit status (None: killed by a signal).
    run_codes: HashMap<usize, Option<i32>>,
    janitor_codes: Vec<Option<i32>>,
    command_pids: Vec<i32>,
    /// When the reboot was (the commands' clock), if there was one.
    rebooted_at: Option<u128>,
}

/// The other configuration's dead run: its daemon, and its cgroup when it had one.
struct OtherConfig {
    sandbox: Sandbox,
    daemon: i32,
    cgroup: Option<String>,
}

impl OtherConfig {
    /// A run of another configuration whose supervisor and dead-man were SIGKILLed: its daemon
    /// lives on.
    fn plant(seed: u64) -> Self {
        let sandbox = Sandbox::new();
        let script = "setsid sh -c 'exec sleep 100000' </dev/null >/dev/null 2>&1 & \
                      echo daemon $!; echo ready $$; exec sleep 100000";
        let mut proc =
            crate::util::Proc::spawn(sandbox.run_sh(&format!("other-{seed}"), &[], script));
        let line = proc.wait_for(crate::util::Stream::Out, "daemon ");
        let daemon = line.trim_start_matches("daemon ").trim().parse().unwrap();
        proc.wait_ready();
        // Its supervisor and its dead-man at once: what is left is its own janitor's to clear.
        crate::util::kill_supervisor_and_its_dead_man(proc.pid());
        drop(proc);
        let cgroup = sandbox.record(&format!("other-{seed}"))["cgroup"]
            .as_str()
            .map(str::to_owned);
        Self {
            sandbox,
            daemon,
            cgroup,
        }
    }
}

fn execute(
    plan: &Plan,
    hosts: &[Sandbox],
    cluster: Option<&EtcdCluster>,
    log: &Path,
    tally: &mut Tally,
) -> Outcome {
    let sandbox = &hosts[0];
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(plan.seed ^ 0x5eed);
    let (tx, rx): (Sender<Msg>, Receiver<Msg>) = channel();
    let mut procs: Vec<Spawned> = Vec::new();
    let mut transcript = Vec::new();
    let mut command_pids = Vec::new();
    let mut daemon_pids: Vec<i32> = Vec::new();
    let mut events = 0usize;
    let mut next_run = 0usize;
    let mut rebooted = false;
    let mut rebooted_at = None;
    let started = Instant::now();
    for host in hosts {
        std::fs::create_dir_all(host.abra_home().join("servers/ci")).unwrap();
    }
    let mut partition_until: Option<Instant> = None;
    let mut etcd_fault_done = false;
    let compose = sandbox.path().join("chaos-stack.yml");
    std::fs::write(&compose, include_str!("../fixtures/chaos-stack.yml")).unwrap();

    let start_run = |i: usize, procs: &mut Vec<Spawned>, tally: &mut Tally| {
        let run = &plan.runs[i];
        // The app: an .env (and in Docker mode a volume labelled as the stack's) that says whose
        // it is; at its end the command checks it is still there and still its own.
        // In Docker mode the app is a real stack deployed by the command, right after whatever
        // run of the domain came before was reaped: a deploy into a stack that is still going
        // away fails, and that is logged as a violation.
        let (deploy, owned) = if plan.docker {
            (
                "docker stack deploy --resolve-image never -c \"$CHAOS_COMPOSE\" \"$CCCI_STACK_NAME\" >/dev/null 2>\"$ABRA_DIR/deploy.err\" \
                 || { echo \"$(date +%s%N) DEPLOYFAIL $CCCI_RUN_ID $CCCI_APP_DOMAIN\" >> \"$CHAOS_LOG\"; \
                       sed 's/^/deploy: /' \"$ABRA_DIR/deploy.err\" >&2; }; ",
                " && [ \"$(docker network inspect -f '{{index .Labels \"ccci.run\"}}' \"${CCCI_STACK_NAME}_internal\" 2>/dev/null)\" = \"$CCCI_RUN_ID\" ]",
            )
        } else {
            ("", "")
        };
        // A writer keeps acting for as long as it lives: once its run is SIGKILLed, only the
        // next holder of the domain (or a janitor) can stop it.
        let writer = if run.fault == Fault::KillWriter {
            format!(
                "(while :; do echo \"$(date +%s%N) write $CCCI_RUN_ID $CCCI_APP_DOMAIN\" >> {log}; \
                 sleep 0.1; done) </dev/null >/dev/null 2>&1 & echo writer $!; ",
                log = sh_quote(log)
            )
        } else {
            String::new()
        };
        let script = format!(
            "echo \"$(date +%s%N) start $CCCI_RUN_ID $CCCI_APP_DOMAIN\" >> {log}; \
             echo \"$CCCI_RUN_ID\" > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\"; {deploy}\
             setsid sh -c 'exec sleep 100000' </dev/null >/dev/null 2>&1 & d=$!; echo daemon $d; \
             {writer}echo ready $$; sleep {hold}; \
             if [ \"$(cat \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\" 2>/dev/null)\" = \"$CCCI_RUN_ID\" ]{owned}; \
             then if kill -0 $d 2>/dev/null; then r=ok; else r=KILLED; fi; else r=LOST; fi; \
             echo \"$(date +%s%N) $r $CCCI_RUN_ID $CCCI_APP_DOMAIN\" >> {log}",
            log = sh_quote(log),
            hold = if run.fault == Fault::Deadline {
                "3".to_owned()
            } else {
                format!("{:.3}", run.hold_ms as f64 / 1000.0)
            },
        );
        let mut extra = vec![
            "--pr".to_owned(),
            run.pr.to_string(),
            "--kill-grace".into(),
            "1".into(),
        ];
        if run.fault == Fault::Deadline {
            extra.extend(["--deadline".into(), "1".into()]);
        }
        if run.fault == Fault::HangingHook {
            extra.extend([
                "--on-teardown".into(),
                "echo hook-hangs; exec sleep 100000".into(),
                "--teardown-timeout".into(),
                "1".into(),
            ]);
            tally.count("HangingHook");
        }
        if run.fault == Fault::KillInTeardown {
            extra.extend([
                "--on-teardown".into(),
                "echo teardown-hook; sleep 0.2".into(),
            ]);
        }
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let mut cmd = hosts[run.host].run_sh(&run.id, &extra, &script);
        cmd.env("CHAOS_LOG", log).env("CHAOS_COMPOSE", &compose);
        if run.fault == Fault::InPidNamespace {
            cmd = crate::identity::in_pid_namespace(&cmd);
            tally.count("InPidNamespace");
        }
        let index = procs.len();
        let child = spawn(&mut cmd, index, &tx);
        procs.push(Spawned {
            child,
            kind: Kind::Run(i),
            open_streams: 2,
            status: None,
            killed: false,
        });
        tally.count("runs");
        if run.fault == Fault::Deadline {
            tally.count("Deadline");
        }
    };

    loop {
        if started.elapsed() > Duration::from_secs(120) {
            for p in &mut procs {
                kill(p, Signal::SIGKILL);
            }
            panic!(
                "seed {}: the schedule hung\n{}",
                plan.seed,
                transcript.join("\n")
            );
        }
        // Start the next run once the previous one has shown it is under way.
        let everyone_done = procs.iter().all(|p| p.open_streams == 0);
        if next_run < plan.runs.len() && (events >= next_run * 2 || everyone_done) {
            start_run(next_run, &mut procs, tally);
            next_run += 1;
            continue;
        }
        if next_run == plan.runs.len() && everyone_done {
            break;
        }
        if partition_until.is_some_and(|until| Instant::now() >= until) {
            partition_until = None;
            transcript.push("-- etcd members continued --".to_owned());
            if let Some(cluster) = cluster {
                cluster.signal_all(Signal::SIGCONT);
            }
        }
        let wait = partition_until.map_or(Duration::from_secs(5), |until| {
            until
                .saturating_duration_since(Instant::now())
                .min(Duration::from_secs(5))
        });
        let msg = match rx.recv_timeout(wait) {
            Ok(msg) => msg,
            Err(_) => continue,
        };
        events += 1;
        // Janitors start on what runs do, never on what janitors say (that would feed itself).
        let from_run = matches!(&msg, Msg::Line(i, _) | Msg::Closed(i) if procs[*i].is_run());
        match msg {
            Msg::Closed(i) => {
                procs[i].open_streams -= 1;
                if procs[i].open_streams == 0 {
                    procs[i].status = Some(procs[i].child.wait().unwrap());
                }
            }
            Msg::Line(i, line) => {
                transcript.push(format!("[{i} {:?}] {line}", procs[i].kind));
                match procs[i].kind {
                    Kind::Run(r) => {
                        let fault = plan.runs[r].fault;
                        // The command and the daemon (and writer) it starts: nothing of a run
                        // may outlive the final sweep, however the run ended. (A namespaced
                        // run's pids are its namespace's, and the namespace dies with it.)
                        if let Some(pid) = line
                            .strip_prefix("ready ")
                            .or_else(|| line.strip_prefix("daemon "))
                            .or_else(|| line.strip_prefix("writer "))
                            .and_then(|p| p.trim().parse().ok())
                            .filter(|_| fault != Fault::InPidNamespace)
                        {
                            command_pids.push(pid);
                            if !line.starts_with("ready ") {
                                daemon_pids.push(pid);
                            }
                        }
                        let trigger = match fault {
                            Fault::TermAtStart | Fault::KillAtStart | Fault::KillWriter => {
                                line.starts_with("ready ")
                            }
                            Fault::TermWhileParked | Fault::KillWhileParked => {
                                line.contains("== app lock: another run of")
                            }
                            Fault::KillInTeardown => line == "teardown-hook",
                            _ => false,
                        };
                        if trigger && !procs[i].killed {
                            let sig = match fault {
                                Fault::TermAtStart | Fault::TermWhileParked => Signal::SIGTERM,
                                _ => Signal::SIGKILL,
                            };
                            tally.count(&format!("{fault:?}"));
                            kill(&mut procs[i], sig);
                        }
                    }
                    Kind::Janitor => {
                        if !procs[i].killed && rng.random_bool(plan.kill_janitor_chance) {
                            tally.count("KillJanitor");
                            kill(&mut procs[i], Signal::SIGKILL);
                        }
                    }
                }
            }
        }
        let janitors = procs.iter().filter(|p| p.kind == Kind::Janitor).count();
        if from_run && janitors < 2 * plan.runs.len() && rng.random_bool(plan.janitor_chance) {
            let mut cmd = hosts[rng.random_range(0..hosts.len())].ccci();
            cmd.args(["janitor", "--json"]);
            let index = procs.len();
            let child = spawn(&mut cmd, index, &tx);
            procs.push(Spawned {
                child,
                kind: Kind::Janitor,
                open_streams: 2,
                status: None,
                killed: false,
            });
            tally.count("janitors");
        }
        if let (Some(cluster), Some(fault), false) = (cluster, plan.etcd, etcd_fault_done) {
            match fault {
                EtcdFault::KillLeader { after } if events >= after => {
                    etcd_fault_done = true;
                    tally.count("KillLeader");
                    transcript.push("-- the etcd leader killed --".to_owned());
                    cluster.signal_member(cluster.leader(), Signal::SIGKILL);
                }
                EtcdFault::Partition { after } if events >= after => {
                    etcd_fault_done = true;
                    tally.count("Partition");
                    transcript.push("-- every etcd member stopped --".to_owned());
                    cluster.signal_all(Signal::SIGSTOP);
                    partition_until =
                        Some(Instant::now() + Duration::from_secs(u64::from(CHAOS_TTL) + 2));
                }
                _ => {}
            }
        }
        if !rebooted && plan.reboot_after.is_some_and(|n| events >= n) {
            rebooted = true;
            rebooted_at = Some(now_ns());
            tally.count("Reboot");
            transcript.push("-- reboot: everything killed, lock dir emptied --".to_owned());
            for p in procs.iter_mut().filter(|p| p.open_streams > 0) {
                kill(p, Signal::SIGKILL);
            }
            // A reboot ends the daemons too; commands die by their own parent-death signal.
            for pid in &daemon_pids {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), Signal::SIGKILL);
            }
            for pid in &command_pids {
                crate::util::wait_exited(*pid);
            }
            while procs.iter().any(|p| p.open_streams > 0) {
                if let Ok(Msg::Closed(i)) = rx.recv_timeout(Duration::from_secs(30)) {
                    procs[i].open_streams -= 1;
                    if procs[i].open_streams == 0 {
                        procs[i].status = Some(procs[i].child.wait().unwrap());
                    }
                }
            }
            for name in list(&sandbox.locks()) {
                let path = sandbox.locks().join(name);
                let _ = std::fs::remove_file(&path).or_else(|_| std::fs::remove_dir_all(&path));
            }
        }
    }
    if partition_until.is_some() {
        if let Some(cluster) = cluster {
            cluster.signal_all(Signal::SIGCONT);
        }
    }
    let mut run_codes = HashMap::new();
    let mut janitor_codes = Vec::new();
    for p in &procs {
        let code = p.status.expect("every process was waited for").code();
        match p.kind {
            Kind::Run(r) => {
                run_codes.insert(r, code);
            }
            Kind::Janitor => janitor_codes.push(code),
        }
    }
    Outcome {
        transcript,
        run_codes,
        janitor_codes,
        command_pids,
        rebooted_at,
    }
}

/// Now, on the commands' clock (`date +%s%N`).
fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// Check the promise after a schedule; returns what was violated.
fn check(
    plan: &Plan,
    hosts: &[Sandbox],
    cluster: Option<&EtcdCluster>,
    log: &Path,
    outcome: &Outcome,
    other: Option<&OtherConfig>,
) -> Vec<String> {
    let mut violations = Vec::new();
    if let Some(cluster) = cluster {
        // Every process is gone: every lease runs out, and with it every key but the tenure
        // record of a holder that died holding its lock, which a janitor sweep (or the next
        // waiter) binds to a lease of that holder's stop budget: it goes after that.
        let deadline = Instant::now() + crate::util::PATIENCE;
        let mut swept = Instant::now();
        while !cluster.keys().is_empty() {
            if Instant::now() > deadline {
                violations.push(format!("keys of dead runs stayed: {}", cluster.keys()));
                break;
            }
            if swept.elapsed() > Duration::from_secs(u64::from(CHAOS_TTL)) {
                let _ = hosts[0].janitor(&[]);
                swept = Instant::now();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    // A final sweep on every host: nothing of a dead run may survive it.
    for sandbox in hosts {
        let (report, done) = sandbox.janitor(&[]);
        if done.status.code() != Some(0) {
            violations.push(format!("final janitor exited {:?}: {report}", done.status));
        }
    }
    // Another configuration's dead run is its own janitor's: nothing of this schedule may
    // have touched it. Then its janitor clears it.
    if let Some(other) = other {
        if !process_alive(other.daemon) {
            violations.push(format!(
                "the other configuration's dead run's daemon {} was killed by this one",
                other.daemon
            ));
        }
        if let Some(cgroup) = other.cgroup.as_deref().filter(|c| !Path::new(c).exists()) {
            violations.push(format!(
                "the other configuration's cgroup {cgroup} was removed"
            ));
        }
        let (report, done) = other.sandbox.janitor(&[]);
        if done.status.code() != Some(0) || process_alive(other.daemon) {
            violations.push(format!(
                "the other configuration's janitor did not clear its dead run: {report}"
            ));
        }
    }
    let sandbox = &hosts[0];
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut intervals: BTreeMap<String, BTreeMap<String, (u128, u128)>> = BTreeMap::new();
    // Per domain: each run's start, and each writer's writes.
    let mut starts: BTreeMap<String, BTreeMap<String, u128>> = BTreeMap::new();
    let mut writes: BTreeMap<String, BTreeMap<String, Vec<u128>>> = BTreeMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [at, what, run, domain] = f[..] else {
            violations.push(format!("garbled log line {line:?}"));
            continue;
        };
        let at: u128 = at.parse().unwrap_or(0);
        if what == "DEPLOYFAIL" {
            violations.push(format!(
                "{run}: deploying its stack failed: the previous one of {domain} was not gone"
            ));
        }
        if what == "LOST" {
            violations.push(format!(
                "{run}: its app was removed while it ran ({domain})"
            ));
        }
        if what == "KILLED" && outcome.rebooted_at.is_none_or(|r| at < r) {
            violations.push(format!(
                "{run}: a process of it (its daemon) was killed while it ran ({domain})"
            ));
        }
        if what == "start" {
            starts
                .entry(domain.to_owned())
                .or_default()
                .insert(run.to_owned(), at);
        }
        if what == "write" {
            // Checked against the next holders' starts below, not as the run's own span.
            writes
                .entry(domain.to_owned())
                .or_default()
                .entry(run.to_owned())
                .or_default()
                .push(at);
            continue;
        }
        let span = intervals
            .entry(domain.to_owned())
            .or_default()
            .entry(run.to_owned())
            .or_insert((at, at));
        span.0 = span.0.min(at);
        span.1 = span.1.max(at);
    }
    for (domain, runs) in &intervals {
        let spans: Vec<(&String, &(u128, u128))> = runs.iter().collect();
        for (i, (a, sa)) in spans.iter().enumerate() {
            for (b, sb) in &spans[i + 1..] {
                if sa.0 <= sb.1 && sb.0 <= sa.1 {
                    violations.push(format!("{a} and {b} overlapped on {domain}: {sa:?} {sb:?}"));
                }
            }
        }
    }
    // Nothing of a dead run acts after the next holder of its domain starts.
    for (domain, writers) in &writes {
        let Some(runs) = starts.get(domain) else {
            continue;
        };
        for (writer, stamps) in writers {
            let Some(own_start) = runs.get(writer) else {
                continue;
            };
            for (next, next_start) in runs.iter().filter(|(r, s)| *r != writer && *s > own_start) {
                let late = stamps.iter().filter(|w| *w >= next_start).count();
                if late > 0 {
                    violations.push(format!(
                        "{writer}'s writer (its run SIGKILLed) wrote {late} time(s) after {next}, \
                         the next holder of {domain}, started"
                    ));
                }
            }
        }
    }
    for host in hosts {
        let envs = list(&host.abra_home().join("servers/ci"));
        if !envs.is_empty() {
            violations.push(format!(".env files left: {envs:?}"));
        }
        let locks: Vec<String> = list(&host.locks())
            .into_iter()
            .filter(|n| n.starts_with("cc-ci-app-"))
            .collect();
        if !locks.is_empty() {
            violations.push(format!("lock files left: {locks:?}"));
        }
        let states = host.state_files();
        if !states.is_empty() {
            violations.push(format!("state files left: {states:?}"));
        }
    }
    // On etcd a holder that cannot keep its lease stops (76); when the cluster itself was hurt,
    // a run may also fail to reach it (125) and a janitor decline to decide (1).
    let hurt = matches!(
        plan.etcd,
        Some(EtcdFault::KillLeader { .. } | EtcdFault::Partition { .. })
    );
    if plan.docker {
        let prefix = format!("name={}", sandbox.suffix().replace('.', "_"));
        for kind in ["service", "network", "volume"] {
            let left = crate::util::docker(&[kind, "ls", "-q", "--filter", &prefix]);
            if !left.trim().is_empty() {
                violations.push(format!("Docker {kind}s left: {left:?}"));
            }
        }
    }
    for pid in &outcome.command_pids {
        if process_alive(*pid) {
            violations.push(format!(
                "process {pid} of a run (its command or its daemon) survived the final sweep"
            ));
        }
    }
    for (r, code) in &outcome.run_codes {
        let allowed = matches!(code, None | Some(0) | Some(142) | Some(143))
            || plan.etcd.is_some() && *code == Some(76)
            || hurt && *code == Some(125);
        if !allowed {
            violations.push(format!("{} exited {code:?}", plan.runs[*r].id));
        }
    }
    for code in &outcome.janitor_codes {
        let allowed = matches!(code, None | Some(0)) || hurt && *code == Some(1);
        if !allowed {
            violations.push(format!("a janitor exited {code:?}"));
        }
    }
    violations
}

fn run_schedules(first_seed: u64, count: u64, docker: bool, etcd: bool) -> Tally {
    let mut tally = Tally::default();
    for seed in first_seed..first_seed + count {
        let plan = Plan::new(seed, docker, etcd);
        let mut sandbox = if docker {
            Sandbox::with_docker().expect("a Docker engine")
        } else {
            Sandbox::new()
        };
        // Each two-host schedule gets a cluster of its own: it may kill or stop members.
        let cluster = etcd.then(|| EtcdCluster::start().expect("an etcd server"));
        if let Some(cluster) = &cluster {
            sandbox.set_etcd(cluster.endpoints(), CHAOS_TTL);
        }
        let mut hosts = vec![sandbox];
        if etcd {
            hosts.push(Sandbox::beside(&hosts[0]));
        }
        let log = hosts[0].path().join("events.log");
        let other = plan.other_config.then(|| {
            tally.count("OtherConfiguration");
            OtherConfig::plant(seed)
        });
        // Beside the schedule (one host only: they need no etcd), the faults of users of
        // their own, each at a moment of its own.
        let user = if etcd {
            Vec::new()
        } else {
            user_faults(seed, docker)
        };
        let beside: Vec<_> = user
            .iter()
            .copied()
            .map(|(fault, uid)| {
                let delay = Duration::from_millis(seed.wrapping_mul(7919) % 1_500);
                std::thread::spawn(move || {
                    std::thread::sleep(delay);
                    meet_user_fault(seed, fault, uid)
                })
            })
            .collect();
        let outcome = execute(&plan, &hosts, cluster.as_ref(), &log, &mut tally);
        let mut violations = check(
            &plan,
            &hosts,
            cluster.as_ref(),
            &log,
            &outcome,
            other.as_ref(),
        );
        for thread in beside {
            match thread.join() {
                Ok((label, found)) => {
                    tally.count(&label);
                    violations.extend(found);
                }
                Err(_) => violations.push("a user fault's harness panicked".to_owned()),
            }
        }
        assert!(
            violations.is_empty(),
            "chaos seed {seed} (replay: CCCI_CHAOS_SEED={seed} CCCI_CHAOS_SCHEDULES=1)\nplan: {plan:#?}\nuser faults: {user:?}\nviolations:\n  {}\nevents log:\n{}\ntranscript:\n{}",
            violations.join("\n  "),
            std::fs::read_to_string(&log).unwrap_or_default(),
            outcome.transcript.join("\n")
        );
        tally.schedules += 1;
    }
    tally
}

/// The CI slice (or, with CCCI_CHAOS_SCHEDULES, the soak).
#[test]
fn chaos_schedules_keep_every_invariant() {
    let count = std::env::var("CCCI_CHAOS_SCHEDULES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    let seed = std::env::var("CCCI_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let started = Instant::now();
    let tally = run_schedules(seed, count, false, false);
    eprintln!(
        "chaos: {} schedules from seed {seed} in {:.1} s, 0 violations; injected: {:?}",
        tally.schedules,
        started.elapsed().as_secs_f64(),
        tally.faults
    );
}

/// A few schedules whose apps are real Docker resources too.
#[test]
fn chaos_schedules_with_docker_keep_every_invariant() {
    if !crate::util::docker_available() {
        return;
    }
    let count = std::env::var("CCCI_CHAOS_DOCKER_SCHEDULES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let started = Instant::now();
    let tally = run_schedules(10_000, count, true, false);
    eprintln!(
        "chaos (Docker): {} schedules in {:.1} s, 0 violations; injected: {:?}",
        tally.schedules,
        started.elapsed().as_secs_f64(),
        tally.faults
    );
}

/// Schedules on two hosts sharing one etcd cluster, which may lose its leader or stop
/// altogether for longer than a lease lives.
#[cfg(feature = "etcd")]
#[test]
fn chaos_schedules_on_two_hosts_over_etcd_keep_every_invariant() {
    if crate::util::etcd_cluster().is_none() {
        return;
    }
    let count = std::env::var("CCCI_CHAOS_ETCD_SCHEDULES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let seed = std::env::var("CCCI_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    let started = Instant::now();
    let tally = run_schedules(seed, count, false, true);
    eprintln!(
        "chaos (two hosts, etcd): {} schedules from seed {seed} in {:.1} s, 0 violations; \
         injected: {:?}",
        tally.schedules,
        started.elapsed().as_secs_f64(),
        tally.faults
    );
}

/// A fault that needs a user of its own, met beside a schedule: RLIMIT_NPROC binds only a user
/// other than root and counts all of that user's processes, and inotify instances are counted
/// per user too, so neither can be put on root's runs without starving the whole machine.
#[derive(Debug, Clone, Copy)]
enum UserFault {
    /// `sub` started under RLIMIT_NPROC with `headroom` processes or threads to spare past its
    /// main thread and those the user already has (one process that fills the rest); that
    /// process goes after `release_ms`, if ever, so a retried fork may then succeed.
    ThreadLimit {
        sub: Limited,
        headroom: u32,
        release_ms: Option<u64>,
        /// A `run` or `lock` finds its lock held (by root) for so long, so it waits for it on
        /// a helper thread.
        parked_ms: Option<u64>,
    },
    /// Another process of the user holds every inotify instance it may have; `waiters` queue
    /// on one named lock behind a holder, and waiter `kill` (if any) is SIGKILLed while it
    /// waits.
    InotifyExhausted { waiters: usize, kill: Option<usize> },
}

#[derive(Debug, Clone, Copy)]
enum Limited {
    Run,
    Lock,
    Janitor,
}

/// The user faults of a one-host schedule, drawn from a generator of their own (the rest of a
/// plan stays as its seed made it), and the uid each fault's processes run as: one per fault
/// and per mode, since the one-host and Docker-mode tests run at the same time.
fn user_faults(seed: u64, docker: bool) -> Vec<(UserFault, u32)> {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x7f1a);
    let base = if docker { 61_110 } else { 61_100 };
    let mut faults = Vec::new();
    if rng.random_bool(0.4) {
        let sub = [Limited::Run, Limited::Lock, Limited::Janitor][rng.random_range(0..3)];
        let headroom = rng.random_range(0..=2);
        let release_ms = rng.random_bool(0.5).then(|| rng.random_range(0..3_000));
        let parked_ms = rng.random_bool(0.5).then(|| rng.random_range(0..2_000));
        faults.push((
            UserFault::ThreadLimit {
                sub,
                headroom,
                release_ms,
                parked_ms,
            },
            base,
        ));
    }
    if rng.random_bool(0.3) {
        let waiters = rng.random_range(3..=8);
        let kill = rng.random_bool(0.5).then(|| rng.random_range(1..=waiters));
        faults.push((UserFault::InotifyExhausted { waiters, kill }, base + 1));
    }
    faults
}

/// The pids of the living processes whose real uid is `uid`. A zombie is left out: it never acts
/// again and holds nothing, and one whose parent died is reaped when init gets to it (a fence
/// that ended with its SIGKILLed supervisor, here a waiter of a lock, is one until then; this
/// machine's init reaps orphans a moment later).
fn processes_of(uid: u32) -> Vec<i32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        let real = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|u| u.parse::<u32>().ok());
        let zombie = status
            .lines()
            .find_map(|l| l.strip_prefix("State:"))
            .is_some_and(|state| state.trim_start().starts_with('Z'));
        if real == Some(uid) && !zombie {
            pids.push(pid);
        }
    }
    pids
}

/// A process of user `uid` that sleeps until it is killed (whichever way the fault ends).
fn occupant(uid: u32) -> crate::limits::Blocker {
    let child = Command::new("setpriv")
        .args([
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
            "sleep",
            "100000",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // It counts against the user once setpriv has become it (and execs in place).
    let pid = child.id() as i32;
    let deadline = Instant::now() + crate::util::PATIENCE;
    while !processes_of(uid).contains(&pid) {
        assert!(Instant::now() < deadline, "setpriv never became uid {uid}");
        std::thread::sleep(Duration::from_millis(5));
    }
    crate::limits::Blocker(child)
}

/// What a user fault leaves behind after a sweep of the user's own janitor (with room, which
/// must succeed) must be nothing: every lock file in `locks` free and every queue without a
/// ticket, no process of the user but `except`, no state file.
fn user_leftovers(uid: u32, dir: &Path, except: &[i32], violations: &mut Vec<String>) {
    // What is dead is the sweep's to clear (a waiter SIGKILLed last in line has nobody behind
    // it to remove its ticket): checked after it.
    let mut janitor = crate::limits::limited(uid, dir, 1000, None);
    janitor.args(["janitor", "--json"]);
    let done = crate::util::run(janitor);
    if done.status.code() != Some(0) {
        violations.push(format!(
            "uid {uid}: its janitor exited {:?}: {}",
            done.status,
            done.transcript()
        ));
    }
    let locks = dir.join("locks");
    for name in list(&locks) {
        let path = locks.join(&name);
        if path.is_dir() {
            let tickets: Vec<String> = list(&path)
                .into_iter()
                .filter(|t| !t.starts_with('.'))
                .collect();
            if !tickets.is_empty() {
                violations.push(format!("uid {uid}: tickets left in {name}: {tickets:?}"));
            }
        } else if !crate::util::lock_is_free(&path) {
            violations.push(format!("uid {uid}: {name} is still held"));
        }
    }
    let left: Vec<i32> = processes_of(uid)
        .into_iter()
        .filter(|p| !except.contains(p))
        .collect();
    if !left.is_empty() {
        violations.push(format!("uid {uid}: processes left: {left:?}"));
    }
    let states = list(&dir.join("state"));
    if !states.is_empty() {
        violations.push(format!("uid {uid}: state files left: {states:?}"));
    }
}

/// One user fault, start to end; what it came to (for the tally) and what it violated.
fn meet_user_fault(seed: u64, fault: UserFault, uid: u32) -> (String, Vec<String>) {
    let mut violations = Vec::new();
    let before = processes_of(uid);
    if !before.is_empty() {
        violations.push(format!(
            "uid {uid}: processes of an earlier fault: {before:?}"
        ));
        return ("none".to_owned(), violations);
    }
    let dir = crate::limits::host_of(uid);
    let label = match fault {
        UserFault::ThreadLimit {
            sub,
            headroom,
            release_ms,
            parked_ms,
        } => thread_limit(
            seed,
            uid,
            dir.path(),
            (sub, headroom),
            (release_ms, parked_ms),
            &mut violations,
        ),
        UserFault::InotifyExhausted { waiters, kill } => {
            inotify_exhausted(uid, dir.path(), waiters, kill, &mut violations)
        }
    };
    (label, violations)
}

/// `sub` under RLIMIT_NPROC: its work, or its documented code naming the limit (125 for `run`
/// and `lock`, 1 for `janitor`); never a panic, the command only if it worked.
fn thread_limit(
    seed: u64,
    uid: u32,
    dir: &Path,
    (sub, headroom): (Limited, u32),
    (release_ms, parked_ms): (Option<u64>, Option<u64>),
    violations: &mut Vec<String>,
) -> String {
    let script = "echo command-ran; exec sleep 0.3";
    let run_id = format!("limited-{seed}");
    let args: Vec<&str> = match sub {
        Limited::Run => vec![
            "run",
            "--recipe",
            "custom-html",
            "--no-fetch",
            "--run-id",
            &run_id,
            "--",
            "sh",
            "-c",
            script,
        ],
        Limited::Lock => vec!["lock", "chaos-limited", "--", "sh", "-c", script],
        Limited::Janitor => vec!["janitor", "--json"],
    };
    // Root holds the lock the limited one will want (root's processes are not the user's),
    // after a first go with room has made its file, the user's.
    let parked = parked_ms
        .filter(|_| !matches!(sub, Limited::Janitor))
        .map(|ms| {
            let mut prime = crate::limits::limited(uid, dir, 1000, None);
            let first: Vec<&str> = args
                .iter()
                .map(|a| if *a == run_id.as_str() { "priming" } else { a })
                .collect();
            prime.args(&first);
            let done = crate::util::run(prime);
            assert_eq!(done.status.code(), Some(0), "{}", done.transcript());
            let file = list(&dir.join("locks"))
                .into_iter()
                .find(|n| n.ends_with(".lock"))
                .expect("a lock file");
            let mut holder = crate::util::Proc::spawn({
                let mut cmd = Command::new("flock");
                cmd.arg(dir.join("locks").join(file)).args([
                    "sh",
                    "-c",
                    "echo ready $$; read line || :",
                ]);
                cmd
            });
            holder.wait_ready();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(ms));
                holder.finish()
            })
        });
    let occupant = occupant(uid);
    let occupant_pid = occupant.0.id() as i32;
    // The occupant and our main thread, and the headroom.
    let mut cmd = crate::limits::limited(uid, dir, 2 + headroom, None);
    cmd.args(&args);
    let proc = crate::util::Proc::spawn(cmd);
    let releaser = std::thread::spawn(move || {
        if let Some(ms) = release_ms {
            std::thread::sleep(Duration::from_millis(ms));
            drop(occupant);
            None
        } else {
            Some(occupant)
        }
    });
    let done = proc.finish();
    let occupant = releaser.join().unwrap();
    let was_parked = parked.is_some();
    if let Some(holder) = parked {
        holder.join().unwrap();
    }
    let code = done.status.code();
    let said = format!("{}\n{}", done.out.join("\n"), done.stderr());
    let ran = done.out.iter().any(|l| l == "command-ran");
    let (documented, works_alone) = match sub {
        Limited::Run | Limited::Lock => (125, false),
        Limited::Janitor => (1, true),
    };
    let fine = match code {
        Some(0) => works_alone || ran,
        Some(c) if c == documented => said.contains("RLIMIT_NPROC") && !ran,
        _ => false,
    };
    if !fine || said.contains("panicked") {
        violations.push(format!(
            "{sub:?} under RLIMIT_NPROC (headroom {headroom}) ended neither with its work nor \
             with {documented} naming the limit:\n{}",
            done.transcript()
        ));
    }
    if let Limited::Run = sub {
        let record = dir.join(format!("runs/{run_id}/run.json"));
        let recorded = std::fs::read_to_string(&record)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|r| r["exit_code"].as_i64());
        if recorded != code.map(i64::from) {
            violations.push(format!(
                "the limited run exited {code:?} but its record says {recorded:?}"
            ));
        }
    }
    let except: Vec<i32> = occupant.iter().map(|_| occupant_pid).collect();
    user_leftovers(uid, dir, &except, violations);
    drop(occupant);
    format!(
        "ThreadLimit {sub:?}{} exit {}",
        if was_parked { " parked" } else { "" },
        code.unwrap_or(-1)
    )
}

/// Named-lock waiters with the user's inotify instances used up: each says once that it looks
/// at the queue instead, and they are served one at a time in the order they came, past a
/// waiter SIGKILLed in the line.
fn inotify_exhausted(
    uid: u32,
    dir: &Path,
    waiters: usize,
    kill: Option<usize>,
    violations: &mut Vec<String>,
) -> String {
    use crate::util::{Proc, Stream};

    let mut exhaust = Proc::spawn({
        let mut cmd = Command::new("setpriv");
        cmd.args([
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            crate::limits::EXHAUST_INOTIFY,
        ]);
        cmd
    });
    let ready = exhaust.wait_for(Stream::Out, "ready");
    if ready.split_whitespace().nth(2) != Some("24") {
        violations.push(format!(
            "the inotify instances did not run out in EMFILE: {ready}"
        ));
    }
    let log = dir.join("served.log");
    let lock = |script: &str| {
        let mut cmd = crate::limits::limited(uid, dir, 1000, None);
        cmd.args(["lock", "chaos-queue", "--", "sh", "-c", script]);
        cmd
    };
    let mut holder = Proc::spawn(lock("echo ready $$; read line || :"));
    holder.wait_ready();
    let mut line = Vec::new();
    for n in 1..=waiters {
        let mut w = Proc::spawn(lock(&format!(
            "echo \"$(date +%s%N) start w{n}\" >> {log}; sleep 0.02; \
             echo \"$(date +%s%N) end w{n}\" >> {log}",
            log = sh_quote(&log)
        )));
        w.wait_for(Stream::Err, "looking at it every");
        w.wait_for(Stream::Err, "waiting as queue ticket");
        if kill == Some(n) {
            crate::util::signal(w.pid(), Signal::SIGKILL);
        }
        line.push((n, w));
    }
    holder.close_stdin();
    let done = holder.finish();
    if done.status.code() != Some(0) {
        violations.push(format!("the holder exited {:?}", done.status));
    }
    for (n, w) in line {
        let done = w.finish();
        if kill == Some(n) {
            continue;
        }
        let said = done
            .err
            .iter()
            .filter(|l| l.contains("cannot watch the queue"))
            .count();
        if done.status.code() != Some(0) || said != 1 || done.stderr().contains("panicked") {
            violations.push(format!(
                "waiter w{n} without inotify (said so {said} times):\n{}",
                done.transcript()
            ));
        }
    }
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let events: Vec<(u128, &str, &str)> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((f.first()?.parse().ok()?, *f.get(1)?, *f.get(2)?))
        })
        .collect();
    let mut served = Vec::new();
    for pair in events.chunks(2) {
        match pair {
            [(_, "start", a), (_, "end", b)] if a == b => served.push((*a).to_owned()),
            _ => violations.push(format!("waiters overlapped or broke off: {text}")),
        }
    }
    let arrived: Vec<String> = (1..=waiters)
        .filter(|n| kill != Some(*n))
        .map(|n| format!("w{n}"))
        .collect();
    if served != arrived {
        violations.push(format!("served {served:?}, arrived {arrived:?}"));
    }
    user_leftovers(uid, dir, &[exhaust.pid()], violations);
    exhaust.close_stdin();
    exhaust.finish();
    format!(
        "InotifyExhausted {} waiters{}",
        waiters,
        if kill.is_some() { ", one killed" } else { "" }
    )
}
