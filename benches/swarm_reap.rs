//! Reaping a run app's stack on a two-node swarm (`scripts/swarm-two-node.sh start`, whose two
//! lines CCCI_SWARM_MANAGER and CCCI_SWARM_WORKER must be in the environment): the janitor
//! pointed at the manager, beside what an operator does by hand — `docker stack rm`, polling
//! each node's own engine until the stack's container is gone there, then `docker volume rm`
//! on each node — in the same run, round after round.
//!
//! The stack: two replicas at most one per node, a named volume, a secret, a config and an
//! overlay network (tests/fixtures/two-node-stack.yml). Every time is from the start of the
//! removal until the node's own engine no longer lists the stack's container (volume); what is
//! still there after WATCH is reported as such. The janitor reports an app gone when it exits,
//! so "until it exits" and "until gone on every node" must agree.
//!
//! `cargo bench --bench swarm_reap [-- ROUNDS]` (default 3)

// A bench prints its report and reads its own files; clippy.toml keeps print! and eprintln!, and
// raw file reads, out of src/ only.
#![allow(clippy::disallowed_macros, clippy::disallowed_methods)]

#[path = "support/ratio.rs"]
mod ratio;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ccci-run");
const SUFFIX: &str = "swbench.test";
const STACK: &str = include_str!("../tests/fixtures/two-node-stack.yml");
/// How long a node is watched for leftovers after each removal.
const WATCH: Duration = Duration::from_secs(30);

struct Swarm {
    manager: String,
    worker: String,
}

fn docker_output(host: &str, args: &[&str]) -> Output {
    Command::new("docker")
        .arg("--host")
        .arg(host)
        .args(args)
        .env_remove("DOCKER_TLS_VERIFY")
        .env_remove("DOCKER_CERT_PATH")
        .stdin(Stdio::null())
        .output()
        .expect("docker CLI")
}

fn docker(host: &str, args: &[&str]) -> String {
    let out = docker_output(host, args);
    assert!(
        out.status.success(),
        "docker --host {host} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn count(host: &str, args: &[&str]) -> usize {
    docker(host, args).lines().filter(|l| !l.is_empty()).count()
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !done() {
        assert!(Instant::now() < deadline, "timed out: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Swarm {
    fn hosts(&self) -> [&str; 2] {
        [&self.manager, &self.worker]
    }

    fn containers(&self, node: usize, stack: &str) -> usize {
        let filter = format!("label=com.docker.stack.namespace={stack}");
        count(self.hosts()[node], &["ps", "-aq", "--filter", &filter])
    }

    fn volumes(&self, node: usize, stack: &str) -> usize {
        count(
            self.hosts()[node],
            &["volume", "ls", "-q", "--filter", &format!("name={stack}_")],
        )
    }

    /// Deploy `stack` through the manager and wait until each node runs its task.
    fn deploy(&self, dir: &Path, stack: &str) {
        let compose = dir.join("stack.yml");
        let out = Command::new("docker")
            .arg("--host")
            .arg(&self.manager)
            .args(["stack", "deploy", "--resolve-image", "never", "-c"])
            .arg(&compose)
            .arg(stack)
            .env("RUN", "1")
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "deploy {stack}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let filter = format!("label=com.docker.stack.namespace={stack}");
        wait_until("a running task on each node", || {
            self.hosts()
                .iter()
                .all(|h| count(h, &["ps", "-q", "--filter", &filter]) == 1)
        });
    }

    /// Watch both nodes from `start` until the stack's containers and volumes are gone on each
    /// (or WATCH has passed): [[container, volume]; node] in seconds, None if still there.
    fn watch(&self, stack: &str, start: Instant) -> [[Option<f64>; 2]; 2] {
        let mut gone = [[None; 2]; 2];
        let deadline = Instant::now() + WATCH;
        loop {
            for (node, times) in gone.iter_mut().enumerate() {
                if times[0].is_none() && self.containers(node, stack) == 0 {
                    times[0] = Some(start.elapsed().as_secs_f64());
                }
                if times[1].is_none() && self.volumes(node, stack) == 0 {
                    times[1] = Some(start.elapsed().as_secs_f64());
                }
            }
            if gone.iter().flatten().all(Option::is_some) || Instant::now() >= deadline {
                return gone;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Remove whatever a round left of `stack` on both nodes.
    fn clean(&self, stack: &str) {
        let _ = docker_output(&self.manager, &["stack", "rm", stack]);
        let filter = format!("label=com.docker.stack.namespace={stack}");
        for host in self.hosts() {
            for id in docker(host, &["ps", "-aq", "--filter", &filter]).lines() {
                let _ = docker_output(host, &["rm", "-f", id]);
            }
            for v in docker(
                host,
                &["volume", "ls", "-q", "--filter", &format!("name={stack}_")],
            )
            .lines()
            {
                let _ = docker_output(host, &["volume", "rm", "-f", v]);
            }
        }
        wait_until("the stack's network gone", || {
            count(&self.manager, &["network", "ls", "-q", "--filter", &filter]) == 0
        });
    }
}

fn show(t: Option<f64>) -> String {
    t.map_or_else(
        || format!("> {:.0} s (still there)", WATCH.as_secs_f64()),
        |t| format!("{t:.2} s"),
    )
}

fn main() {
    let (Ok(manager), Ok(worker)) = (
        std::env::var("CCCI_SWARM_MANAGER"),
        std::env::var("CCCI_SWARM_WORKER"),
    ) else {
        eprintln!(
            "swarm_reap: no two-node swarm; start one with `scripts/swarm-two-node.sh start` and \
             export the two lines it prints"
        );
        return;
    };
    // The node-local socket path of scripts/swarm-two-node.sh: BASE/node/docker.sock beside
    // the manager's BASE/n1/docker.sock.
    let node_socket = manager
        .strip_prefix("unix://")
        .map(Path::new)
        .and_then(|sock| Some(sock.parent()?.parent()?.join("node/docker.sock")));
    let swarm = Swarm { manager, worker };
    let mut ratios = Vec::new();
    let mut everywhere = Vec::new();
    let mut baseline = Vec::new();
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(3);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("secret.txt"), "s3cret\n").unwrap();
    std::fs::write(dir.path().join("conf.txt"), "conf\n").unwrap();
    std::fs::write(
        dir.path().join("stack.yml"),
        STACK
            .replace(
                "@COMMAND@",
                "date > /data/written-by-$${RUN}; exec sleep 100000",
            )
            .replace("@INIT@", "true"),
    )
    .unwrap();
    println!(
        "swarm_reap: one run app's stack on two nodes (one task each, a volume on each), {rounds} rounds"
    );
    for round in 0..rounds {
        let domain = format!("swb-{round:06x}.{SUFFIX}");
        let stack = domain.replace('.', "_");

        swarm.deploy(dir.path(), &stack);
        let home = dir.path().join(format!("r{round}"));
        let servers = home.join("abra/servers/ci");
        std::fs::create_dir_all(&servers).unwrap();
        std::fs::write(servers.join(format!("{domain}.env")), "X=1\n").unwrap();
        let start = Instant::now();
        let mut janitor_cmd = Command::new(BIN);
        if let Some(socket) = &node_socket {
            janitor_cmd.env("CCCI_NODE_DOCKER_SOCKET", socket);
        }
        let out = janitor_cmd
            .env("CCCI_NODE_SWEEP_IMAGE", "ccci-test/docker-cli:latest")
            .env("DOCKER_HOST", &swarm.manager)
            .env("CCCI_CONFIG", "/dev/null")
            .arg("--lock-dir")
            .arg(home.join("locks"))
            .arg("--abra-home")
            .arg(home.join("abra"))
            .arg("--runs-dir")
            .arg(home.join("runs"))
            .arg("--state-dir")
            .arg(&home)
            .args(["--domain-suffix", SUFFIX, "--docker", "required", "janitor"])
            .arg("--json")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let exited = start.elapsed().as_secs_f64();
        let janitor = swarm.watch(&stack, start);
        swarm.clean(&stack);

        swarm.deploy(dir.path(), &stack);
        let start = Instant::now();
        docker(&swarm.manager, &["stack", "rm", &stack]);
        let mut by_hand = [[None; 2]; 2];
        wait_until("stack rm: the container gone on each node", || {
            for (node, times) in by_hand.iter_mut().enumerate() {
                if times[0].is_none() && swarm.containers(node, &stack) == 0 {
                    times[0] = Some(start.elapsed().as_secs_f64());
                }
            }
            by_hand.iter().all(|t| t[0].is_some())
        });
        for (node, host) in swarm.hosts().into_iter().enumerate() {
            docker(host, &["volume", "rm", &format!("{stack}_data")]);
            by_hand[node][1] = Some(start.elapsed().as_secs_f64());
        }
        swarm.clean(&stack);

        println!(
            "round {round}: janitor exit {} after {exited:.2} s; gone: manager container {}, volume {}; worker container {}, volume {}",
            out.status
                .code()
                .map_or("by signal".into(), |c| c.to_string()),
            show(janitor[0][0]),
            show(janitor[0][1]),
            show(janitor[1][0]),
            show(janitor[1][1]),
        );
        println!(
            "round {round}: stack rm, poll each node, volume rm on each: manager container {}, volume {}; worker container {}, volume {}",
            show(by_hand[0][0]),
            show(by_hand[0][1]),
            show(by_hand[1][0]),
            show(by_hand[1][1]),
        );
        // Until gone on every node: the last of the four (never, if any is still there).
        let last = |times: [[Option<f64>; 2]; 2]| {
            times
                .iter()
                .flatten()
                .try_fold(0.0_f64, |max, t| t.map(|t| max.max(t)))
        };
        match (last(janitor), last(by_hand)) {
            (Some(j), Some(b)) => {
                println!(
                    "round {round}: until gone on every node: janitor {j:.2} s (exited {exited:.2} s), by hand {b:.2} s, ratio {:.2}",
                    j / b
                );
                everywhere.push(j);
                baseline.push(b);
                ratios.push(j / b);
            }
            (j, b) => println!(
                "round {round}: not gone on every node within {} s: janitor {j:?}, by hand {b:?}",
                WATCH.as_secs()
            ),
        }
    }
    if ratios.is_empty() {
        return;
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (janitor, by_hand) = (median(&mut everywhere), median(&mut baseline));
    println!(
        "swarm_reap: until gone on every node, median of {} rounds: janitor {:.2} s, stack rm + poll + volume rm {:.2} s; ratio {:.2} (min {:.2}, max {:.2})",
        ratios.len(),
        janitor,
        by_hand,
        median(&mut ratios.clone()),
        ratios.iter().copied().fold(f64::INFINITY, f64::min),
        ratios.iter().copied().fold(0.0, f64::max),
    );
    ratio::summary(
        "swarm_reap",
        &[
            ratio::Figure::new(
                "janitor until gone on both nodes, median",
                janitor,
                "stack rm + polling each node + volume rm, median",
                by_hand,
                "s",
            ),
            ratio::Figure::new(
                "janitor until gone on both nodes, median (target)",
                janitor,
                "the 3.5 s target",
                3.5,
                "s",
            )
            .goal(1.0),
        ],
    );
}
