//! Reaped means gone on every node: run apps' stacks on a real two-node swarm, reaped by the
//! janitor pointed at the manager, checked through each node's own engine.
//!
//! The swarm is `scripts/swarm-two-node.sh start`'s: a manager and a worker, each a dockerd in a
//! network namespace of its own on this machine, whose sockets `start` prints as
//! `CCCI_SWARM_MANAGER=unix://…` and `CCCI_SWARM_WORKER=unix://…` for the suite's environment.
//! Without them these tests skip (under `CI=true` that fails: `.ci/run` starts the swarm).
//!
//! The stack (tests/fixtures/two-node-stack.yml) runs two replicas, at most one per node, with a
//! named volume, a secret, a config and an overlay network, so each node holds a task's
//! container and its own copy of the volume. The manager's API can neither list nor remove the
//! worker's containers and volumes: what the worker still holds is seen only through the
//! worker's own socket, and that is where these tests look. Each test prints, past the janitor,
//! when each node's container and volume were gone, so a failure says what was left and for
//! how long.
//!
//! Every test uses the one shared swarm; the test that cuts the worker off takes it for itself
//! ([`exclusive`]), the others share it ([`shared`]).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::docker::domain;
use crate::util::{Finished, PATIENCE, Proc, Sandbox, Stream, candidate, list, run, skip};

/// The stack of a run app on two nodes; `@COMMAND@` and `@INIT@` are filled in per test.
const STACK: &str = include_str!("../fixtures/two-node-stack.yml");

/// How long the tests watch the nodes after a janitor is done, to say when (if ever) each
/// node's leftovers went: past swarm's own removal of a task container on another node (4-7 s,
/// 16 s for an app that ignores SIGTERM).
const WATCH: Duration = Duration::from_secs(25);

/// The exit code of a janitor pointed at a worker: invalid input, as for a `DOCKER_HOST` the
/// janitor cannot work with (the engine answers, but cannot list or remove a stack's services).
const JANITOR_ON_A_WORKER: i32 = 2;

/// The two engines of the test swarm.
pub(crate) struct Swarm {
    /// `unix://…` of the manager's engine (node 1).
    manager: String,
    /// `unix://…` of the worker's engine (node 2).
    worker: String,
    /// The worker's node name, as the manager's node list shows it.
    worker_name: String,
    /// `CCCI_SWARM_BASE` of the script that made the swarm, when it can be told from the
    /// manager's socket path (`BASE/n1/docker.sock`): what `cut` and `heal` need.
    base: Option<PathBuf>,
}

/// The node a command is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Node {
    Manager,
    Worker,
}

const NODES: [Node; 2] = [Node::Manager, Node::Worker];

impl Swarm {
    /// The swarm of `CCCI_SWARM_MANAGER` and `CCCI_SWARM_WORKER`, once both answer as a
    /// manager with two ready nodes and a worker of that swarm; otherwise `None`, the test
    /// skipped (failed in CI) saying why.
    fn get() -> Option<&'static Swarm> {
        static SWARM: OnceLock<Result<Swarm, String>> = OnceLock::new();
        match SWARM.get_or_init(Swarm::find) {
            Ok(swarm) => Some(swarm),
            Err(why) => {
                skip(
                    why,
                    "start it with `scripts/swarm-two-node.sh start` as root and export the two \
                     lines it prints (CCCI_SWARM_MANAGER, CCCI_SWARM_WORKER)",
                );
                None
            }
        }
    }

    fn find() -> Result<Swarm, String> {
        let var = |name: &str| {
            std::env::var(name)
                .ok()
                .filter(|v| !v.is_empty())
                .ok_or_else(|| format!("no two-node swarm: {name} is not set"))
        };
        let manager = var("CCCI_SWARM_MANAGER")?;
        let worker = var("CCCI_SWARM_WORKER")?;
        let info = |host: &str, format: &str| {
            let out = docker_output(host, &["info", "--format", format]);
            if out.status.success() {
                Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
            } else {
                Err(format!(
                    "no two-node swarm: the engine at {host} does not answer ({})",
                    String::from_utf8_lossy(&out.stderr).trim()
                ))
            }
        };
        if info(&manager, "{{.Swarm.ControlAvailable}}")? != "true" {
            return Err(format!(
                "no two-node swarm: the engine at {manager} is not a swarm manager"
            ));
        }
        let worker_id = info(&worker, "{{.Swarm.NodeID}}")?;
        let worker_name = info(&worker, "{{.Name}}")?;
        let ready = docker_at(&manager, &["node", "ls", "--format", "{{.ID}} {{.Status}}"]);
        let ready: Vec<&str> = ready
            .lines()
            .filter(|l| l.ends_with(" Ready"))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        if ready.len() != 2 || !ready.contains(&worker_id.as_str()) {
            return Err(format!(
                "no two-node swarm: the manager at {manager} lists {ready:?} as ready, not \
                 itself and the worker {worker_id}"
            ));
        }
        let base = manager
            .strip_prefix("unix://")
            .map(Path::new)
            .and_then(|sock| Some(sock.parent()?.parent()?.to_path_buf()))
            .filter(|base| base.join("n2").is_dir());
        Ok(Swarm {
            manager,
            worker,
            worker_name,
            base,
        })
    }

    /// Point a ccci-run command at `host`, whatever `DOCKER_HOST` the suite has, with what it
    /// needs to sweep this swarm's nodes: the image with a docker CLI that the script imported
    /// on each node, and the socket path every node's engine also listens on.
    fn aim<'c>(&self, cmd: &'c mut Command, host: &str) -> &'c mut Command {
        cmd.env("CCCI_NODE_SWEEP_IMAGE", "ccci-test/docker-cli:latest");
        if let Some(base) = &self.base {
            cmd.env("CCCI_NODE_DOCKER_SOCKET", base.join("node/docker.sock"));
        }
        cmd.env("DOCKER_HOST", host)
            .env_remove("DOCKER_TLS_VERIFY")
            .env_remove("DOCKER_CERT_PATH")
    }

    fn host(&self, node: Node) -> &str {
        match node {
            Node::Manager => &self.manager,
            Node::Worker => &self.worker,
        }
    }

    /// The docker CLI against `node`'s own engine; panics with its output when it fails.
    fn docker(&self, node: Node, args: &[&str]) -> String {
        docker_at(self.host(node), args)
    }

    /// Containers of `stack` on `node`, in any state.
    fn containers(&self, node: Node, stack: &str) -> Vec<String> {
        let filter = format!("label=com.docker.stack.namespace={stack}");
        lines(&self.docker(node, &["ps", "-aq", "--filter", &filter]))
    }

    /// Running containers of `stack` on `node`.
    fn running(&self, node: Node, stack: &str) -> Vec<String> {
        let filter = format!("label=com.docker.stack.namespace={stack}");
        lines(&self.docker(node, &["ps", "-q", "--filter", &filter]))
    }

    /// Volumes of `stack` on `node`: labelled with it, or named after it.
    fn volumes(&self, node: Node, stack: &str) -> Vec<String> {
        let mut found = Vec::new();
        for filter in [
            format!("label=com.docker.stack.namespace={stack}"),
            format!("name={stack}_"),
        ] {
            for name in lines(&self.docker(node, &["volume", "ls", "-q", "--filter", &filter])) {
                if !found.contains(&name) {
                    found.push(name);
                }
            }
        }
        found
    }

    /// What the manager still lists of `stack` besides containers and volumes.
    fn swarm_objects(&self, stack: &str) -> Vec<String> {
        let label = format!("label=com.docker.stack.namespace={stack}");
        let mut found = Vec::new();
        for kind in ["service", "network", "secret", "config"] {
            for id in lines(&self.docker(Node::Manager, &[kind, "ls", "-q", "--filter", &label])) {
                found.push(format!("{kind} {id}"));
            }
        }
        found
    }

    /// `scripts/swarm-two-node.sh ACTION [ARG]` for this swarm (`cut`, `heal`).
    fn script(&self, args: &[&str]) -> Result<(), String> {
        let base = self
            .base
            .as_ref()
            .ok_or("the swarm was not made by scripts/swarm-two-node.sh")?;
        let out = Command::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/swarm-two-node.sh"
        ))
        .args(args)
        .env("CCCI_SWARM_BASE", base)
        .output()
        .map_err(|e| format!("swarm-two-node.sh {args:?}: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "swarm-two-node.sh {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// Whether the manager lists the worker in `state` (`ready`, `down`) now.
    fn worker_is(&self, state: &str) -> bool {
        let out = docker_output(
            &self.manager,
            &[
                "node",
                "inspect",
                "--format",
                "{{.Status.State}}",
                &self.worker_name,
            ],
        );
        String::from_utf8_lossy(&out.stdout).trim() == state
    }
}

/// The docker CLI against `host`, whatever `DOCKER_HOST` the suite has.
fn docker_output(host: &str, args: &[&str]) -> Output {
    Command::new("docker")
        .arg("--host")
        .arg(host)
        .args(args)
        .env_remove("DOCKER_TLS_VERIFY")
        .env_remove("DOCKER_CERT_PATH")
        .env_remove("DOCKER_CONTEXT")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("docker {args:?}: {e}"))
}

/// [`docker_output`]; panics with the CLI's output when it fails.
fn docker_at(host: &str, args: &[&str]) -> String {
    let out = docker_output(host, args);
    assert!(
        out.status.success(),
        "docker --host {host} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn lines(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Wait until `done` holds, polling: a node's engine offers no event for another node's
/// removals. Bounded by [`PATIENCE`].
#[track_caller]
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every test shares the swarm, but for the one that cuts the worker off.
static GATE: RwLock<()> = RwLock::new(());

fn shared() -> RwLockReadGuard<'static, ()> {
    GATE.read().unwrap_or_else(|e| e.into_inner())
}

fn exclusive() -> RwLockWriteGuard<'static, ()> {
    GATE.write().unwrap_or_else(|e| e.into_inner())
}

/// Whether the app stops on SIGTERM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum App {
    /// `sleep` under `init: true`: stops at once.
    StopsOnTerm,
    /// A shell that traps TERM away, as PID 1: only SIGKILL stops it.
    IgnoresTerm,
}

/// One test's run app on the swarm: its sandbox, domain and stack, and the clean-up of that
/// stack on both nodes when the test ends (also when it fails).
struct Case {
    swarm: &'static Swarm,
    sandbox: Sandbox,
    domain: String,
    stack: String,
}

impl Case {
    /// The app `<prefix>-0d0c4e.<suffix>`: `prefix` is four characters, as in every run-app
    /// domain (a longer one is not a run app, and the janitor never looks at it).
    fn new(swarm: &'static Swarm, prefix: &str) -> Self {
        let sandbox = Sandbox::with_engine_of_its_own();
        let domain = domain(&sandbox, prefix);
        Self::with_domain(swarm, sandbox, domain)
    }

    /// The app of `ccci-run run --recipe custom-html` in a sandbox of its own: the stack its
    /// command deploys.
    fn for_run(swarm: &'static Swarm) -> Self {
        let sandbox = Sandbox::with_engine_of_its_own();
        let domain = sandbox.domain("custom-html", None);
        Self::with_domain(swarm, sandbox, domain)
    }

    fn with_domain(swarm: &'static Swarm, sandbox: Sandbox, domain: String) -> Self {
        let stack = Sandbox::stack(&domain);
        std::fs::write(sandbox.path().join("secret.txt"), "s3cret\n").unwrap();
        std::fs::write(sandbox.path().join("conf.txt"), "conf\n").unwrap();
        Self {
            swarm,
            sandbox,
            domain,
            stack,
        }
    }

    /// The compose file of run `run` of the stack (beside its secret and config files).
    fn compose(&self, run: u32, app: App) -> PathBuf {
        let (command, init) = match app {
            App::StopsOnTerm => ("date > /data/written-by-$${RUN}; exec sleep 100000", "true"),
            App::IgnoresTerm => (
                "trap '' TERM; date > /data/written-by-$${RUN}; while :; do sleep 1; done",
                "false",
            ),
        };
        let compose = self.sandbox.path().join(format!("stack-{run}.yml"));
        std::fs::write(
            &compose,
            STACK.replace("@COMMAND@", command).replace("@INIT@", init),
        )
        .unwrap();
        compose
    }

    /// Deploy the stack through the manager as run `run` (its tasks write
    /// `/data/written-by-RUN`) and wait until each node runs one task; returns how long that
    /// took.
    fn deploy(&self, run: u32, app: App) -> Duration {
        let compose = self.compose(run, app);
        let start = Instant::now();
        let out = Command::new("docker")
            .arg("--host")
            .arg(&self.swarm.manager)
            .args(["stack", "deploy", "--resolve-image", "never", "-c"])
            .arg(&compose)
            .arg(&self.stack)
            .env("RUN", run.to_string())
            .env_remove("DOCKER_TLS_VERIFY")
            .env_remove("DOCKER_CERT_PATH")
            .current_dir(self.sandbox.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "deploy of {}: {}",
            self.stack,
            String::from_utf8_lossy(&out.stderr)
        );
        eventually(
            &format!("{}: run {run}'s task running on each node", self.stack),
            || {
                NODES.iter().all(|&node| {
                    let running = self.swarm.running(node, &self.stack);
                    running.len() == 1 && self.has_file(node, &running[0], run)
                })
            },
        );
        start.elapsed()
    }

    /// Whether `container` on `node` sees `/data/written-by-RUN`.
    fn has_file(&self, node: Node, container: &str, run: u32) -> bool {
        docker_output(
            self.swarm.host(node),
            &[
                "exec",
                container,
                "test",
                "-e",
                &format!("/data/written-by-{run}"),
            ],
        )
        .status
        .success()
    }

    /// What `/data` holds in the task running on `node`.
    fn data_on(&self, node: Node) -> Vec<String> {
        let running = self.swarm.running(node, &self.stack);
        assert_eq!(running.len(), 1, "{node:?}: {running:?}");
        lines(
            &self
                .swarm
                .docker(node, &["exec", &running[0], "ls", "/data"]),
        )
    }

    /// The run is dead and its app left: its `.env`, no lock held.
    fn plant_dead_run(&self) -> PathBuf {
        self.sandbox.plant_env("ci", &self.domain, "X=1\n")
    }

    /// `ccci-run janitor --json [extra...]` against the engine at `host`; its report (when it
    /// printed one), the finished process and how long it took.
    fn janitor(&self, host: &str, extra: &[&str]) -> (Option<Value>, Finished, Duration) {
        let mut cmd = self.sandbox.ccci();
        self.swarm
            .aim(&mut cmd, host)
            .args(["janitor", "--json"])
            .args(extra);
        let start = Instant::now();
        let done = run(cmd);
        let took = start.elapsed();
        let report = serde_json::from_str(&done.out.join("\n")).ok();
        (report, done, took)
    }

    /// The janitor against the manager must reap the app: exit 0, decision `reap`.
    #[track_caller]
    fn janitor_reaps(&self) -> Duration {
        let (report, done, took) = self.janitor(&self.swarm.manager, &[]);
        done.assert_code(0);
        let report = report.expect("a JSON report");
        assert_eq!(
            candidate(&report, &self.domain)["decision"],
            "reap",
            "{report:#}"
        );
        took
    }

    /// What each node holds of the stack right now: `node: containers [...] volumes [...]`,
    /// only for nodes that hold something.
    fn left_now(&self) -> Vec<String> {
        NODES
            .iter()
            .filter_map(|&node| {
                let containers = self.swarm.containers(node, &self.stack);
                let volumes = self.swarm.volumes(node, &self.stack);
                (!containers.is_empty() || !volumes.is_empty())
                    .then(|| format!("{node:?}: containers {containers:?} volumes {volumes:?}"))
            })
            .collect()
    }

    /// Watch both nodes for up to [`WATCH`] from now: when each node's containers and volumes
    /// of the stack were gone (seconds from `since`), or that they were still there. Printed,
    /// and returned for a failure message.
    fn watch_until_gone(&self, since: Instant) -> String {
        let mut gone: [[Option<f64>; 2]; 2] = [[None; 2]; 2];
        let deadline = Instant::now() + WATCH;
        loop {
            for (n, &node) in NODES.iter().enumerate() {
                if gone[n][0].is_none() && self.swarm.containers(node, &self.stack).is_empty() {
                    gone[n][0] = Some(since.elapsed().as_secs_f64());
                }
                if gone[n][1].is_none() && self.swarm.volumes(node, &self.stack).is_empty() {
                    gone[n][1] = Some(since.elapsed().as_secs_f64());
                }
            }
            if gone.iter().flatten().all(Option::is_some) || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let at = |t: Option<f64>| match t {
            Some(t) => format!("gone at {t:.1} s"),
            None => format!("still there at {:.0} s", since.elapsed().as_secs_f64()),
        };
        let text = NODES
            .iter()
            .enumerate()
            .map(|(n, node)| {
                format!(
                    "{node:?}: container {}, volume {}",
                    at(gone[n][0]),
                    at(gone[n][1])
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        eprintln!("{}: {text}", self.stack);
        text
    }
}

impl Drop for Case {
    fn drop(&mut self) {
        let stack = &self.stack;
        let label = format!("label=com.docker.stack.namespace={stack}");
        let _ = docker_output(&self.swarm.manager, &["stack", "rm", stack]);
        for node in NODES {
            let host = self.swarm.host(node);
            let ids = lines(&String::from_utf8_lossy(
                &docker_output(host, &["ps", "-aq", "--filter", &label]).stdout,
            ));
            if !ids.is_empty() {
                let mut args = vec!["rm", "-f"];
                args.extend(ids.iter().map(String::as_str));
                let _ = docker_output(host, &args);
            }
            for volume in lines(&String::from_utf8_lossy(
                &docker_output(
                    host,
                    &["volume", "ls", "-q", "--filter", &format!("name={stack}_")],
                )
                .stdout,
            )) {
                let _ = docker_output(host, &["volume", "rm", "-f", &volume]);
            }
        }
        for kind in ["network", "secret", "config"] {
            for name in lines(&String::from_utf8_lossy(
                &docker_output(
                    &self.swarm.manager,
                    &[kind, "ls", "-q", "--filter", &format!("name={stack}_")],
                )
                .stdout,
            )) {
                let _ = docker_output(&self.swarm.manager, &[kind, "rm", &name]);
            }
        }
    }
}

/// A dead run's app on both nodes: once the janitor against the manager reports it reaped,
/// neither node holds a container or a volume of its stack.
#[test]
fn dead_run_s_app_is_gone_from_every_node_when_the_janitor_reports_it_reaped() {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    let _gate = shared();
    let case = Case::new(swarm, "mgon");
    case.deploy(1, App::StopsOnTerm);
    case.plant_dead_run();
    let start = Instant::now();
    let took = case.janitor_reaps();
    let left = case.left_now();
    let objects = swarm.swarm_objects(&case.stack);
    let watched = case.watch_until_gone(start);
    assert!(
        left.is_empty() && objects.is_empty(),
        "the janitor reported {} reaped after {:.1} s, but at that moment the nodes held {left:?} \
         and the manager listed {objects:?}; afterwards: {watched}",
        case.domain,
        took.as_secs_f64()
    );
}

/// On a node the manager cannot list, an unlabelled volume is the stack's only by a name its
/// app gives (as its runs recorded): the worker's unlabelled `<stack>_cache` goes with the
/// reap; `<stack>_example_org_data`, an app's whose domain extends the run app's and whose
/// services are gone, stays.
#[test]
fn the_node_sweep_takes_an_unlabelled_volume_only_by_a_name_the_app_gives() {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    let _gate = shared();
    let case = Case::new(swarm, "mext");
    case.deploy(1, App::StopsOnTerm);
    let given = format!("{}_cache", case.stack);
    let theirs = format!("{}_example_org_data", case.stack);
    for volume in [&given, &theirs] {
        swarm.docker(Node::Worker, &["volume", "create", volume]);
    }
    case.sandbox
        .plant_given_names(&case.domain, &[("volume", &given)]);
    case.plant_dead_run();
    case.janitor_reaps();
    let left = swarm.volumes(Node::Worker, &case.stack);
    assert_eq!(left, vec![theirs.clone()], "on the worker");
}

/// The same stack deployed again at once after the sweep starts with a fresh volume on every
/// node: no file the dead run wrote is there for the next one.
#[test]
fn redeploy_straight_after_the_sweep_mounts_a_fresh_volume_on_every_node() {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    let _gate = shared();
    let case = Case::new(swarm, "mfre");
    case.deploy(1, App::StopsOnTerm);
    case.plant_dead_run();
    case.janitor_reaps();
    let took = case.deploy(2, App::StopsOnTerm);
    let mut stale = Vec::new();
    for node in NODES {
        let data = case.data_on(node);
        eprintln!(
            "{}: {node:?} /data after the redeploy: {data:?}",
            case.stack
        );
        if data.iter().any(|f| f == "written-by-1") {
            stale.push(format!("{node:?}: {data:?}"));
        }
    }
    assert!(
        stale.is_empty(),
        "run 2 mounted run 1's volume (redeployed, both tasks running, after {:.1} s): {stale:?}",
        took.as_secs_f64()
    );
}

/// The janitor pointed at a worker says at once that it needs a manager, with its documented
/// exit code; it removes nothing and leaves no lock file.
#[test]
fn janitor_against_a_worker_needs_a_manager_and_touches_nothing() {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    let _gate = shared();
    let case = Case::new(swarm, "mwrk");
    case.deploy(1, App::StopsOnTerm);
    let env = case.plant_dead_run();
    let before: Vec<(Vec<String>, Vec<String>)> = NODES
        .iter()
        .map(|&n| (swarm.running(n, &case.stack), swarm.volumes(n, &case.stack)))
        .collect();
    let objects = swarm.swarm_objects(&case.stack);
    let (_, done, took) = case.janitor(&swarm.worker, &[]);
    eprintln!(
        "{}: janitor against the worker: {:?} after {:.1} s\n{}",
        case.stack,
        done.status.code(),
        took.as_secs_f64(),
        done.stderr()
    );
    done.assert_code(JANITOR_ON_A_WORKER);
    assert!(
        done.err.iter().any(|l| l.contains("manager")),
        "the message does not say a manager is needed\n{}",
        done.transcript()
    );
    assert!(
        took < Duration::from_secs(5),
        "took {:.1} s",
        took.as_secs_f64()
    );
    assert!(env.exists(), "the .env was removed");
    assert!(
        list(&case.sandbox.locks()).is_empty(),
        "lock files left: {:?}",
        list(&case.sandbox.locks())
    );
    let after: Vec<(Vec<String>, Vec<String>)> = NODES
        .iter()
        .map(|&n| (swarm.running(n, &case.stack), swarm.volumes(n, &case.stack)))
        .collect();
    assert_eq!(after, before, "containers and volumes on the nodes changed");
    assert_eq!(swarm.swarm_objects(&case.stack), objects);
}

/// An app whose PID 1 ignores SIGTERM: still gone from every node when the janitor reports it
/// reaped (swarm alone takes the full stop grace on the worker).
#[test]
fn app_that_ignores_sigterm_is_gone_from_every_node_when_reported_reaped() {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    let _gate = shared();
    let case = Case::new(swarm, "mtrm");
    case.deploy(1, App::IgnoresTerm);
    case.plant_dead_run();
    let start = Instant::now();
    let took = case.janitor_reaps();
    let left = case.left_now();
    let watched = case.watch_until_gone(start);
    assert!(
        left.is_empty(),
        "the janitor reported {} reaped after {:.1} s, but at that moment the nodes held {left:?}; \
         afterwards: {watched}",
        case.domain,
        took.as_secs_f64()
    );
}

/// Heals the worker's link when the test ends, however it ends.
struct Heal(&'static Swarm);

impl Drop for Heal {
    fn drop(&mut self) {
        // Never a panic here (the test may be unwinding already): a failure is printed, and the
        // next test that needs the worker skips or fails on its own.
        if let Err(e) = self.0.script(&["heal"]) {
            eprintln!("heal: {e}");
            return;
        }
        let deadline = Instant::now() + PATIENCE;
        while !self.0.worker_is("ready") && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The worker cut off (its link down) during the reap: the app is not reported gone but
/// `reap-incomplete`, naming the worker; its `.env` and lock file stay. Once the link is back,
/// the next sweep reaps it and every node is clean.
#[test]
fn worker_cut_off_during_the_reap_is_named_and_cleaned_by_the_next_sweep() {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    if swarm.base.is_none() {
        skip(
            "the two-node swarm was not made by scripts/swarm-two-node.sh (no BASE/n2 beside \
             the manager's socket), so it cannot be cut",
            "start it with `scripts/swarm-two-node.sh start`",
        );
        return;
    }
    let _gate = exclusive();
    let case = Case::new(swarm, "mcut");
    case.deploy(1, App::StopsOnTerm);
    let env = case.plant_dead_run();
    swarm.script(&["cut", "link"]).unwrap();
    let heal = Heal(swarm);
    let (report, done, took) = case.janitor(&swarm.manager, &["--reap-budget", "20s"]);
    eprintln!(
        "{}: janitor with the worker cut off: {:?} after {:.1} s\n{}",
        case.stack,
        done.status.code(),
        took.as_secs_f64(),
        done.transcript()
    );
    done.assert_code(1);
    let report = report.expect("a JSON report");
    let c = candidate(&report, &case.domain);
    assert_eq!(c["decision"], "reap-incomplete", "{report:#}");
    let error = c["error"].as_str().unwrap_or_default();
    assert!(
        error.contains(&swarm.worker_name),
        "the error does not name the worker {}: {report:#}",
        swarm.worker_name
    );
    assert!(env.exists(), "the .env must stay for the next sweep");
    assert!(
        case.sandbox.lock_file(&case.domain).exists(),
        "the lock file must stay"
    );
    drop(heal);
    let took = case.janitor_reaps();
    let left = case.left_now();
    eprintln!(
        "{}: the next sweep after the heal reaped it in {:.1} s; left: {left:?}",
        case.stack,
        took.as_secs_f64()
    );
    assert!(
        left.is_empty(),
        "after the heal, the next sweep reported the app reaped, but the nodes held {left:?}"
    );
    assert!(!env.exists());
}

/// A run deploys its app's stack on both nodes and ends; its own teardown leaves nothing of it
/// on any node by the time the run exits.
#[test]
fn run_teardown_leaves_nothing_on_any_node() {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    let _gate = shared();
    let case = Case::for_run(swarm);
    let compose = case.compose(1, App::StopsOnTerm);
    std::fs::create_dir_all(case.sandbox.abra_home().join("servers/ci")).unwrap();
    // The command deploys through the manager (its DOCKER_HOST) and waits until the worker too
    // runs the task, as a recipe's test would before it probes the app.
    let script = "docker stack deploy --resolve-image never -c \"$COMPOSE\" \"$CCCI_STACK_NAME\" >/dev/null \
        && echo X=1 > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\" \
        && f=label=com.docker.stack.namespace=$CCCI_STACK_NAME \
        && until [ -n \"$(docker ps -q --filter $f)\" ] && [ -n \"$(docker --host \"$WORKER\" ps -q --filter $f)\" ]; do sleep 0.1; done \
        && echo \"deployed $CCCI_STACK_NAME\"";
    let mut cmd = case.sandbox.run_sh("mn1", &[], script);
    swarm
        .aim(&mut cmd, &swarm.manager)
        .env("WORKER", &swarm.worker)
        .env("COMPOSE", &compose)
        .env("RUN", "1");
    let start = Instant::now();
    let done = run(cmd);
    done.assert_code(0);
    let took = start.elapsed();
    assert!(
        done.out
            .iter()
            .any(|l| l == &format!("deployed {}", case.stack)),
        "the command did not deploy {}\n{}",
        case.stack,
        done.transcript()
    );
    let left = case.left_now();
    let objects = swarm.swarm_objects(&case.stack);
    let watched = case.watch_until_gone(start);
    assert!(
        left.is_empty() && objects.is_empty(),
        "the run ended after {:.1} s (teardown errors: {}), but the nodes held {left:?} and the \
         manager listed {objects:?}; afterwards: {watched}",
        took.as_secs_f64(),
        case.sandbox.record("mn1")["teardown_errors"]
    );
}

/// `ccci-run run` pointed at a worker: its command never starts, it says a manager is needed,
/// exits 125 (ccci-run failed) and leaves no lock file.
#[test]
fn run_against_a_worker_needs_a_manager_and_never_starts_its_command() {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    let _gate = shared();
    let case = Case::for_run(swarm);
    let mut cmd = case.sandbox.run_sh("mnw", &[], "echo command-started");
    swarm.aim(&mut cmd, &swarm.worker);
    let done = run(cmd);
    eprintln!(
        "run against the worker: {:?}\n{}",
        done.status.code(),
        done.transcript()
    );
    assert!(
        !done.out.iter().any(|l| l == "command-started"),
        "the command ran against a worker\n{}",
        done.transcript()
    );
    done.assert_code(125);
    assert!(
        done.err.iter().any(|l| l.contains("manager")),
        "the message does not say a manager is needed\n{}",
        done.transcript()
    );
    assert!(
        list(&case.sandbox.locks()).is_empty(),
        "lock files left: {:?}",
        list(&case.sandbox.locks())
    );
}

/// `ccci-run converge` pointed at a worker says at once that it needs a manager (125), rather
/// than poll a stack the worker can never show until its timeout.
#[test]
fn converge_against_a_worker_needs_a_manager() {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    let _gate = shared();
    let case = Case::new(swarm, "mcvg");
    let mut cmd = case.sandbox.ccci();
    swarm.aim(&mut cmd, &swarm.worker).args([
        "converge",
        "--stack",
        &case.stack,
        "--timeout",
        "60s",
    ]);
    let start = Instant::now();
    let done = run(cmd);
    done.assert_code(125);
    assert!(
        done.err.iter().any(|l| l.contains("manager")),
        "the message does not say a manager is needed\n{}",
        done.transcript()
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:.1} s",
        start.elapsed().as_secs_f64()
    );
}

/// What a teardown that removed only what the manager sees left: the stack gone through the
/// manager, the manager's copy of the volume removed, the worker's copy (holding run 1's file)
/// still there, and no `.env` to lead a sweep to it.
fn leave_a_volume_on_the_worker_only(case: &Case) {
    case.deploy(1, App::StopsOnTerm);
    docker_at(&case.swarm.manager, &["stack", "rm", &case.stack]);
    eventually(&format!("{}: both containers gone", case.stack), || {
        NODES
            .iter()
            .all(|&node| case.swarm.containers(node, &case.stack).is_empty())
    });
    for volume in case.swarm.volumes(Node::Manager, &case.stack) {
        docker_at(&case.swarm.manager, &["volume", "rm", &volume]);
    }
    assert_eq!(
        case.swarm.volumes(Node::Worker, &case.stack).len(),
        1,
        "the worker's copy of the volume should be there"
    );
}

/// Run 2's command (`$COMPOSE` for `$CCCI_STACK_NAME`, the worker at `$WORKER`): deploy the
/// stack, wait until its task on the worker has written its file, and list the worker's `/data`
/// on a `worker data: ` line.
const REDEPLOY_ON_THE_WORKER: &str = "docker stack deploy --resolve-image never -c \"$COMPOSE\" \"$CCCI_STACK_NAME\" >/dev/null \
    && f=label=com.docker.stack.namespace=$CCCI_STACK_NAME \
    && until c=$(docker --host \"$WORKER\" ps -q --filter $f) && [ -n \"$c\" ] \
         && docker --host \"$WORKER\" exec $c test -e /data/written-by-2 2>/dev/null; do sleep 0.1; done \
    && echo \"worker data: $(docker --host \"$WORKER\" exec $c ls /data | tr '\\n' ' ')\"";

/// The run of [`REDEPLOY_ON_THE_WORKER`] ended 0, its task on the worker saw only run 2's file
/// (a fresh volume, not run 1's), and nothing of the app is left.
fn ran_on_a_fresh_worker_volume(case: &Case, done: &Finished) {
    done.assert_code(0);
    let data = done
        .out
        .iter()
        .find_map(|l| l.strip_prefix("worker data: "))
        .unwrap_or_else(|| {
            panic!(
                "the command did not list the worker's /data\n{}",
                done.transcript()
            )
        });
    assert!(
        !data.contains("written-by-1"),
        "run 2's task on the worker mounted run 1's volume: /data holds {data}"
    );
    assert!(data.contains("written-by-2"), "{data}");
    assert!(
        case.left_now().is_empty(),
        "left after the run: {:?}",
        case.left_now()
    );
}

/// The next run of the same domain, whose command deploys the same stack straight away: the
/// run sweeps the stack off every node before its command, so the task on the worker mounts a
/// fresh volume, not the one an earlier run left there with its data.
#[test]
fn a_run_s_command_never_mounts_a_volume_an_earlier_run_left_on_another_node() {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    let _gate = shared();
    let case = Case::for_run(swarm);
    leave_a_volume_on_the_worker_only(&case);
    let compose = case.compose(2, App::StopsOnTerm);
    let mut cmd = case
        .sandbox
        .run_sh("mnv", &["--deadline", "120s"], REDEPLOY_ON_THE_WORKER);
    swarm
        .aim(&mut cmd, &swarm.manager)
        .env("WORKER", &swarm.worker)
        .env("COMPOSE", &compose)
        .env("RUN", "2");
    let done = run(cmd);
    eprintln!("{}", done.transcript());
    ran_on_a_fresh_worker_volume(&case, &done);
}

/// A node that may hold an earlier run's volume is cut off when the next run starts: the run
/// waits (its lock wait) for the node, then stops with 125 naming it, and never starts its
/// command. Once the link is back, a run of the same domain goes on and finds nothing old.
#[test]
fn a_run_whose_stack_may_be_on_a_node_cut_off_stops_naming_the_node() {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    if swarm.base.is_none() {
        skip(
            "the two-node swarm was not made by scripts/swarm-two-node.sh, so it cannot be cut",
            "start it with `scripts/swarm-two-node.sh start`",
        );
        return;
    }
    let _gate = exclusive();
    let case = Case::for_run(swarm);
    leave_a_volume_on_the_worker_only(&case);
    swarm.script(&["cut", "link"]).unwrap();
    let heal = Heal(swarm);
    let mut cmd = case
        .sandbox
        .run_sh("mnc", &["--lock-wait", "4s"], "echo command-started");
    swarm.aim(&mut cmd, &swarm.manager);
    let start = Instant::now();
    let done = run(cmd);
    let took = start.elapsed();
    eprintln!(
        "run with the worker cut off: {:?} after {:.1} s\n{}",
        done.status.code(),
        took.as_secs_f64(),
        done.transcript()
    );
    done.assert_code(125);
    assert!(
        !done.out.iter().any(|l| l == "command-started"),
        "the command started\n{}",
        done.transcript()
    );
    assert!(
        done.err
            .iter()
            .any(|l| l.contains(&swarm.worker_name) && l.contains("not starting the command")),
        "the error does not name the node {}\n{}",
        swarm.worker_name,
        done.transcript()
    );
    assert_eq!(
        case.sandbox.record("mnc")["exit_code"],
        125,
        "{}",
        case.sandbox.record("mnc")
    );
    drop(heal);
    let mut cmd = case.sandbox.run_sh("mnd", &[], "echo command-started");
    swarm.aim(&mut cmd, &swarm.manager);
    let done = run(cmd);
    done.assert_code(0);
    assert!(
        case.left_now().is_empty(),
        "after the heal, the next run left {:?}",
        case.left_now()
    );
}

/// `doctor` against the manager names both nodes and reaches each with a node sweep; with an
/// image no node has, it fails naming the nodes and the image.
#[test]
fn doctor_names_the_nodes_and_whether_a_sweep_reaches_each() {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    let _gate = shared();
    let case = Case::new(swarm, "mdoc");
    let doctor = |image: &str| {
        let mut cmd = case.sandbox.ccci();
        swarm
            .aim(&mut cmd, &swarm.manager)
            .env("CCCI_NODE_SWEEP_IMAGE", image)
            .args(["doctor", "--json"]);
        let done = run(cmd);
        let report: Value = serde_json::from_str(&done.out.join("\n"))
            .unwrap_or_else(|e| panic!("no JSON ({e})\n{}", done.transcript()));
        report["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "docker nodes")
            .cloned()
            .unwrap_or_else(|| panic!("no docker nodes check: {report:#}"))
    };
    let ok = doctor("ccci-test/docker-cli:latest");
    eprintln!("{ok:#}");
    assert_eq!(ok["state"], "ok", "{ok:#}");
    let message = ok["detail"].as_str().unwrap();
    assert!(
        message.contains("2 nodes") && message.contains(&swarm.worker_name),
        "{ok:#}"
    );
    let bad = doctor("ccci-test/no-such-image:latest");
    eprintln!("{bad:#}");
    assert_eq!(bad["state"], "fail", "{bad:#}");
    let message = bad["detail"].as_str().unwrap();
    assert!(
        message.contains(&swarm.worker_name)
            && bad["fix"].as_str().unwrap().contains("no-such-image"),
        "{bad:#}"
    );
}

/// How a node sweep is kept from reaching its own node's engine.
#[derive(Clone, Copy, Debug)]
enum Unreachable {
    /// An image with no docker CLI.
    NoCli,
    /// A socket path nobody listens on.
    DeadSocket,
    /// A socket path that reaches the manager's engine from every node.
    OtherNode,
    /// An image whose user may not open the node's socket.
    Denied,
}

/// `ccci-test/docker-cli-nobody:latest` on both nodes: the CLI image, run as nobody.
fn nobody_image(swarm: &Swarm) -> &'static str {
    const IMAGE: &str = "ccci-test/docker-cli-nobody:latest";
    for node in NODES {
        let host = swarm.host(node);
        if docker_output(host, &["image", "inspect", IMAGE])
            .status
            .success()
        {
            continue;
        }
        let name = format!("ccci-nobody-{}", rand_suffix());
        docker_at(
            host,
            &[
                "create",
                "--name",
                &name,
                "ccci-test/docker-cli:latest",
                "true",
            ],
        );
        let _ = docker_output(host, &["commit", "--change", "USER 65534", &name, IMAGE]);
        let _ = docker_output(host, &["rm", "-f", &name]);
        assert!(
            docker_output(host, &["image", "inspect", IMAGE])
                .status
                .success(),
            "{node:?}: no {IMAGE}"
        );
    }
    IMAGE
}

fn rand_suffix() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

/// A node sweep that cannot reach its own node's engine (no docker CLI in its image, a socket
/// nobody listens on, the manager's engine reached from the worker, a socket its user may not
/// open) never calls the worker clean: the janitor says `reap-incomplete` within seconds,
/// naming the worker and the setting to fix, the worker keeps what it holds (left for the next
/// sweep, never taken as gone), and `doctor` fails the same way.
#[rstest::rstest]
#[case::no_cli(Unreachable::NoCli, "mncl")]
#[case::dead_socket(Unreachable::DeadSocket, "mnds")]
#[case::other_node(Unreachable::OtherNode, "mnon")]
#[case::denied(Unreachable::Denied, "mnpd")]
fn a_node_sweep_that_cannot_reach_its_own_engine_is_reap_incomplete_naming_the_setting(
    #[case] how: Unreachable,
    #[case] prefix: &str,
) {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    let Some(base) = swarm.base.clone() else {
        skip(
            "the two-node swarm was not made by scripts/swarm-two-node.sh (no node socket path)",
            "start it with `scripts/swarm-two-node.sh start`",
        );
        return;
    };
    let _gate = shared();
    let case = Case::new(swarm, prefix);
    let dead = case.sandbox.path().join("dead.sock");
    let (env, setting): ((&str, String), &str) = match how {
        Unreachable::NoCli => (
            (
                "CCCI_NODE_SWEEP_IMAGE",
                "ccci-test/busybox:latest".to_owned(),
            ),
            "node_sweep_image",
        ),
        Unreachable::DeadSocket => {
            drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
            (
                ("CCCI_NODE_DOCKER_SOCKET", dead.display().to_string()),
                "node_docker_socket",
            )
        }
        Unreachable::OtherNode => (
            (
                "CCCI_NODE_DOCKER_SOCKET",
                base.join("n1/docker.sock").display().to_string(),
            ),
            "node_docker_socket",
        ),
        Unreachable::Denied => (
            ("CCCI_NODE_SWEEP_IMAGE", nobody_image(swarm).to_owned()),
            "node_sweep_image",
        ),
    };
    case.deploy(1, App::StopsOnTerm);
    case.plant_dead_run();
    let mut cmd = case.sandbox.ccci();
    swarm
        .aim(&mut cmd, &swarm.manager)
        .env(env.0, &env.1)
        .args(["janitor", "--json"]);
    let start = Instant::now();
    let done = run(cmd);
    let took = start.elapsed();
    eprintln!("{how:?}: janitor took {took:?}");
    done.assert_code(1);
    let report: Value = serde_json::from_str(&done.out.join("\n"))
        .unwrap_or_else(|e| panic!("no JSON ({e})\n{}", done.transcript()));
    let c = candidate(&report, &case.domain);
    assert_eq!(c["decision"], "reap-incomplete", "{report:#}");
    let error = c["error"].as_str().unwrap_or_default();
    assert!(
        error.contains(&swarm.worker_name) && error.contains(setting),
        "the error names neither the worker {} nor {setting}: {report:#}",
        swarm.worker_name
    );
    assert!(
        took < Duration::from_secs(20),
        "{how:?}: {took:?}, not seconds"
    );
    assert!(
        !swarm.volumes(Node::Worker, &case.stack).is_empty(),
        "the worker's volume went, yet the sweep could not look there"
    );

    let mut doctor = case.sandbox.ccci();
    swarm
        .aim(&mut doctor, &swarm.manager)
        .env(env.0, &env.1)
        .args(["doctor", "--json"]);
    let done = run(doctor);
    let report: Value = serde_json::from_str(&done.out.join("\n"))
        .unwrap_or_else(|e| panic!("no JSON ({e})\n{}", done.transcript()));
    let check = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "docker nodes")
        .cloned()
        .unwrap_or_else(|| panic!("no docker nodes check: {report:#}"));
    assert_eq!(check["state"], "fail", "{check:#}");
    let detail = check["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains(&swarm.worker_name) && detail.contains(setting),
        "{check:#}"
    );
}

/// A way the worker is out of service for a while, as operators and networks do it.
#[derive(Clone, Copy, Debug)]
enum Maintenance {
    /// `docker node update --availability drain`.
    Drain,
    /// Its dockerd stopped (a reboot, an upgrade).
    Stop,
    /// Its link down.
    Cut,
}

/// The worker out of service: `begin` returns once the manager lists it so; `end` (or the
/// guard's drop, however the test ends) brings it back and waits until it is listed ready and
/// active.
struct OutOfService {
    swarm: &'static Swarm,
    how: Maintenance,
    ended: bool,
}

impl OutOfService {
    fn begin(swarm: &'static Swarm, how: Maintenance) -> Self {
        let guard = Self {
            swarm,
            how,
            ended: false,
        };
        match how {
            Maintenance::Drain => {
                swarm.docker(
                    Node::Manager,
                    &[
                        "node",
                        "update",
                        "--availability",
                        "drain",
                        &swarm.worker_name,
                    ],
                );
                eventually("the worker listed as drained", || {
                    swarm.worker_availability() == "drain"
                });
            }
            Maintenance::Stop => {
                swarm.script(&["stop-worker"]).unwrap();
                eventually("the worker listed as down", || swarm.worker_is("down"));
            }
            Maintenance::Cut => {
                swarm.script(&["cut", "link"]).unwrap();
                eventually("the worker listed as down", || swarm.worker_is("down"));
            }
        }
        guard
    }

    /// Bring the worker back; a failure is said, never a panic (a drop may be unwinding).
    fn back(&mut self) -> Result<(), String> {
        if std::mem::replace(&mut self.ended, true) {
            return Ok(());
        }
        match self.how {
            Maintenance::Drain => {
                let out = docker_output(
                    &self.swarm.manager,
                    &[
                        "node",
                        "update",
                        "--availability",
                        "active",
                        &self.swarm.worker_name,
                    ],
                );
                if !out.status.success() {
                    return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
                }
            }
            Maintenance::Stop => self.swarm.script(&["start"])?,
            Maintenance::Cut => self.swarm.script(&["heal"])?,
        }
        let deadline = Instant::now() + PATIENCE;
        while !(self.swarm.worker_is("ready") && self.swarm.worker_availability() == "active") {
            if Instant::now() >= deadline {
                return Err(format!("the worker is not back within {PATIENCE:?}"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    #[track_caller]
    fn end(mut self) {
        self.back().unwrap();
    }
}

impl Drop for OutOfService {
    fn drop(&mut self) {
        if let Err(e) = self.back() {
            eprintln!("bringing the worker back ({:?}): {e}", self.how);
        }
    }
}

impl Swarm {
    /// The worker's availability as the manager lists it now (`active`, `drain`, `pause`).
    fn worker_availability(&self) -> String {
        let out = docker_output(
            &self.manager,
            &[
                "node",
                "inspect",
                "--format",
                "{{.Spec.Availability}}",
                &self.worker_name,
            ],
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

/// The worker out of service (`how`): a run of an app nothing of which is on record anywhere
/// (never deployed: no `.env`, no task or volume the manager knows of) starts its command at
/// once, neither waiting for the worker nor failing.
fn a_node_out_of_service_never_holds_up_a_run_that_never_deployed_there(how: Maintenance) {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    if swarm.base.is_none() {
        skip(
            "the two-node swarm was not made by scripts/swarm-two-node.sh, so its worker cannot \
             be stopped or cut",
            "start it with `scripts/swarm-two-node.sh start`",
        );
        return;
    }
    let _gate = exclusive();
    let case = Case::for_run(swarm);
    let out = OutOfService::begin(swarm, how);
    let mut cmd = case
        .sandbox
        .run_sh("mdr", &["--lock-wait", "60s"], "echo command-started");
    swarm.aim(&mut cmd, &swarm.manager);
    let start = Instant::now();
    let done = run(cmd);
    let took = start.elapsed();
    eprintln!(
        "run with the worker out of service ({how:?}): {:?} after {:.1} s\n{}",
        done.status.code(),
        took.as_secs_f64(),
        done.transcript()
    );
    done.assert_code(0);
    assert!(
        done.out.iter().any(|l| l == "command-started"),
        "the command did not start\n{}",
        done.transcript()
    );
    assert!(
        !done.stderr().contains("waiting up to") && !done.stderr().contains("may have left"),
        "the run waited for a node its app never ran on\n{}",
        done.transcript()
    );
    out.end();
}

#[test]
fn a_drained_node_never_holds_up_a_run_that_never_deployed_there() {
    a_node_out_of_service_never_holds_up_a_run_that_never_deployed_there(Maintenance::Drain);
}

#[test]
fn a_stopped_node_never_holds_up_a_run_that_never_deployed_there() {
    a_node_out_of_service_never_holds_up_a_run_that_never_deployed_there(Maintenance::Stop);
}

#[test]
fn a_cut_node_never_holds_up_a_run_that_never_deployed_there() {
    a_node_out_of_service_never_holds_up_a_run_that_never_deployed_there(Maintenance::Cut);
}

/// The app was deployed on both nodes (its `.env` on record, each node with its copy of the
/// volume holding run 1's file) when the worker goes out of service (`how`). The next run of the
/// domain says it waits for the worker, within its lock wait; once the worker is back, the run
/// sweeps it and starts its command, whose redeploy of the same stack mounts a fresh volume on
/// the worker.
fn a_run_whose_app_was_on_a_node_out_of_service_waits_for_it_then_runs_on_fresh_volumes(
    how: Maintenance,
) {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    if swarm.base.is_none() {
        skip(
            "the two-node swarm was not made by scripts/swarm-two-node.sh, so its worker cannot \
             be stopped or cut",
            "start it with `scripts/swarm-two-node.sh start`",
        );
        return;
    }
    let _gate = exclusive();
    let case = Case::for_run(swarm);
    case.deploy(1, App::StopsOnTerm);
    case.sandbox.plant_env("ci", &case.domain, "X=1\n");
    let mut out = OutOfService::begin(swarm, how);
    let compose = case.compose(2, App::StopsOnTerm);
    let mut cmd = case.sandbox.run_sh(
        "mdw",
        &["--lock-wait", "120s", "--deadline", "240s"],
        REDEPLOY_ON_THE_WORKER,
    );
    swarm
        .aim(&mut cmd, &swarm.manager)
        .env("WORKER", &swarm.worker)
        .env("COMPOSE", &compose)
        .env("RUN", "2");
    let mut proc = Proc::spawn(cmd);
    let waiting = proc.wait_for(Stream::Err, "waiting up to");
    eprintln!("{how:?}: {waiting}");
    assert!(
        waiting.contains(&swarm.worker_name),
        "the waiting line does not name the worker {}: {waiting}",
        swarm.worker_name
    );
    assert!(
        !proc_out_has(&proc, "worker data: "),
        "the command started while the worker was out of service"
    );
    let back = Instant::now();
    out.back().unwrap();
    let done = proc.finish();
    eprintln!(
        "{how:?}: the run went on {:.1} s after the worker was back\n{}",
        back.elapsed().as_secs_f64(),
        done.transcript()
    );
    ran_on_a_fresh_worker_volume(&case, &done);
}

/// What `proc` printed on stdout so far holds a line starting with `prefix`.
fn proc_out_has(proc: &Proc, prefix: &str) -> bool {
    proc.out_so_far().iter().any(|l| l.starts_with(prefix))
}

#[test]
fn a_run_whose_app_was_on_a_drained_node_waits_for_it_then_runs_on_fresh_volumes() {
    a_run_whose_app_was_on_a_node_out_of_service_waits_for_it_then_runs_on_fresh_volumes(
        Maintenance::Drain,
    );
}

#[test]
fn a_run_whose_app_was_on_a_stopped_node_waits_for_it_then_runs_on_fresh_volumes() {
    a_run_whose_app_was_on_a_node_out_of_service_waits_for_it_then_runs_on_fresh_volumes(
        Maintenance::Stop,
    );
}

#[test]
fn a_run_whose_app_was_on_a_cut_node_waits_for_it_then_runs_on_fresh_volumes() {
    a_run_whose_app_was_on_a_node_out_of_service_waits_for_it_then_runs_on_fresh_volumes(
        Maintenance::Cut,
    );
}

/// The engine API at `host` (`unix://…`): `GET path`, as JSON.
fn api(host: &str, path: &str) -> Value {
    let out = Command::new("curl")
        .args(["-sf", "--unix-socket"])
        .arg(host.strip_prefix("unix://").unwrap_or(host))
        .arg(format!("http://localhost{path}"))
        .output()
        .unwrap();
    assert!(out.status.success(), "GET {path} at {host}: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// What node sweeps whose service is gone left: the tasks the manager still lists, and the
/// containers each node keeps (another test's sweep under way is not counted).
fn sweep_leftovers(swarm: &Swarm) -> (usize, [usize; 2]) {
    let services: Vec<String> = api(&swarm.manager, "/services")
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["ID"].as_str().map(str::to_owned))
        .collect();
    let gone = |id: &Value| !services.iter().any(|s| Some(s.as_str()) == id.as_str());
    let tasks = api(&swarm.manager, "/tasks")
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| {
            t["Spec"]["ContainerSpec"]["Labels"]
                .get("io.ccci-run.node-sweep")
                .is_some()
                && gone(&t["ServiceID"])
        })
        .count();
    let containers = NODES.map(|node| {
        api(
            swarm.host(node),
            "/containers/json?all=1&filters=%7B%22label%22%3A%5B%22io.ccci-run.node-sweep%22%5D%7D",
        )
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| gone(&c["Labels"]["com.docker.swarm.service.id"]))
        .count()
    });
    (tasks, containers)
}

/// Node sweeps leave the swarm as they found it: after several sweeps of a dead run's app
/// (each a service with a task on both nodes), the manager lists no more tasks of removed
/// sweeps than before, and no node keeps more of their containers.
#[test]
fn the_manager_s_task_list_does_not_grow_with_sweeps() {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    let _gate = exclusive();
    let case = Case::new(swarm, "mtsk");
    let before = sweep_leftovers(swarm);
    for _ in 0..3 {
        case.plant_dead_run();
        case.janitor_reaps();
    }
    // Swarm removes a removed service's tasks and containers on its own, seconds later.
    let deadline = Instant::now() + PATIENCE;
    let mut after = sweep_leftovers(swarm);
    let grew = |after: &(usize, [usize; 2])| {
        after.0 > before.0 || after.1[0] > before.1[0] || after.1[1] > before.1[1]
    };
    while grew(&after) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        after = sweep_leftovers(swarm);
    }
    eprintln!("sweep leftovers (tasks, containers per node): before {before:?}, after {after:?}");
    assert!(
        !grew(&after),
        "three sweeps left tasks or containers: (tasks in the manager's list, containers on \
         each node) {before:?} before, {after:?} after"
    );
}

/// A run deploys its stack on both nodes, then the worker is cut off; its teardown hook removes
/// the app's `.env` (as `abra app rm` does), and the teardown cannot confirm the worker clean.
/// The reap is recorded where no hook reaches: the janitor's dry run lists it, and once the link
/// is back, one sweep removes the worker's copy of the volume.
#[test]
fn a_reap_a_hook_took_the_env_of_is_finished_by_the_next_sweep_after_the_heal() {
    let Some(swarm) = Swarm::get() else {
        return;
    };
    let Some(base) = swarm.base.clone() else {
        skip(
            "the two-node swarm was not made by scripts/swarm-two-node.sh, so it cannot be cut",
            "start it with `scripts/swarm-two-node.sh start`",
        );
        return;
    };
    let _gate = exclusive();
    let case = Case::for_run(swarm);
    let compose = case.compose(1, App::StopsOnTerm);
    std::fs::create_dir_all(case.sandbox.abra_home().join("servers/ci")).unwrap();
    let heal = Heal(swarm);
    let script = "docker stack deploy --resolve-image never -c \"$COMPOSE\" \"$CCCI_STACK_NAME\" >/dev/null \
        && echo X=1 > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\" \
        && f=label=com.docker.stack.namespace=$CCCI_STACK_NAME \
        && until [ -n \"$(docker ps -q --filter $f)\" ] && [ -n \"$(docker --host \"$WORKER\" ps -q --filter $f)\" ]; do sleep 0.1; done \
        && \"$SWARM_SCRIPT\" cut link >/dev/null 2>&1 \
        && echo \"deployed and cut $CCCI_STACK_NAME\"";
    let hook = "rm -f \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\"";
    let mut cmd = case.sandbox.run_sh(
        "mnh",
        &["--teardown-timeout", "8s", "--on-teardown", hook],
        script,
    );
    swarm
        .aim(&mut cmd, &swarm.manager)
        .env("WORKER", &swarm.worker)
        .env("COMPOSE", &compose)
        .env("RUN", "1")
        .env(
            "SWARM_SCRIPT",
            concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/swarm-two-node.sh"),
        )
        .env("CCCI_SWARM_BASE", &base);
    let done = run(cmd);
    eprintln!("{}", done.transcript());
    assert!(
        done.out
            .iter()
            .any(|l| l == &format!("deployed and cut {}", case.stack)),
        "the command did not deploy and cut\n{}",
        done.transcript()
    );
    let env = case
        .sandbox
        .abra_home()
        .join(format!("servers/ci/{}.env", case.domain));
    assert!(!env.exists(), "the hook did not remove the .env");
    assert!(
        !swarm.volumes(Node::Worker, &case.stack).is_empty(),
        "the worker's volume went while it was cut off"
    );

    let (report, _, _) = case.janitor(&swarm.manager, &["--dry-run"]);
    let report = report.expect("a JSON report");
    let c = candidate(&report, &case.domain);
    assert_eq!(c["decision"], "would-reap", "{report:#}");
    assert!(
        c["sources"]
            .as_array()
            .is_some_and(|s| s.iter().any(|s| s == "unreaped")),
        "{report:#}"
    );

    drop(heal);
    let (report, done, took) = case.janitor(&swarm.manager, &[]);
    done.assert_code(0);
    let report = report.expect("a JSON report");
    let c = candidate(&report, &case.domain);
    assert_eq!(c["decision"], "reap", "{report:#}");
    let left = case.left_now();
    eprintln!(
        "{}: one sweep after the heal took {:.1} s; left: {left:?}; removed {}",
        case.stack,
        took.as_secs_f64(),
        c["removed"]
    );
    // The worker's copy of the volume, removed by the node sweep, is named with the node.
    let worker_id = swarm.docker(Node::Worker, &["info", "--format", "{{.Swarm.NodeID}}"]);
    let on_worker = c["removed"]["nodes"]
        .as_array()
        .and_then(|nodes| nodes.iter().find(|n| n["id"] == worker_id.trim()))
        .unwrap_or_else(|| panic!("the worker is not named in what was removed: {report:#}"));
    assert_eq!(
        on_worker["hostname"],
        swarm.worker_name.as_str(),
        "{report:#}"
    );
    assert!(
        on_worker["volumes"].as_array().is_some_and(|v| v
            .iter()
            .any(|v| v.as_str().is_some_and(|v| v.starts_with(&case.stack)))),
        "{report:#}"
    );
    assert!(
        left.is_empty(),
        "one sweep after the heal reported the app reaped, but the nodes held {left:?}"
    );
    let (report, _, _) = case.janitor(&swarm.manager, &["--dry-run"]);
    let report = report.expect("a JSON report");
    assert!(
        report["candidates"]
            .as_array()
            .is_none_or(|all| !all.iter().any(|c| c["domain"] == case.domain.as_str())),
        "the finished reap is still listed: {report:#}"
    );
}
