//! A real 3-member etcd cluster on loopback ports, for the tests of locks beyond one host, the
//! chaos harness's two-host mode and the etcd benchmark (which includes this file: it depends
//! on nothing else of the suite). Members are stopped with SIGSTOP (a partition as a client
//! sees it: connections open, nobody answering) and killed with SIGKILL.
// Only the etcd backend's tests start clusters.
#![cfg_attr(not(feature = "etcd"), allow(dead_code))]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::Value;

/// How long a cluster may take to become healthy.
const PATIENCE: Duration = Duration::from_secs(60);

fn signal(pid: u32, sig: Signal) {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).expect("a pid"));
    // A member that already died (and is not yet reaped) still takes signals.
    let _ = nix::sys::signal::kill(pid, sig);
}

/// A 3-member etcd cluster of this test's own.
pub(crate) struct Cluster {
    members: Vec<Child>,
    clients: Vec<String>,
    _dir: tempfile::TempDir,
}

/// Whether `etcd` can be started here; outside CI a missing server skips the test (with a
/// message), in CI it fails it.
pub(crate) fn etcd_available() -> bool {
    let found = Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but no etcd server is installed: the etcd tests must run in CI"
        );
        eprintln!("skipping an etcd test: no etcd server (apt install etcd-server)");
    }
    found
}

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

impl Cluster {
    pub(crate) fn start() -> Option<Self> {
        if !etcd_available() {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let peers: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let clients: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let initial: Vec<String> = peers
            .iter()
            .enumerate()
            .map(|(i, p)| format!("m{i}=http://127.0.0.1:{p}"))
            .collect();
        let members = (0..3)
            .map(|i| {
                let log = std::fs::File::create(dir.path().join(format!("m{i}.log"))).unwrap();
                Command::new("etcd")
                    .args(["--name", &format!("m{i}")])
                    .arg("--data-dir")
                    .arg(dir.path().join(format!("m{i}")))
                    .args([
                        "--listen-client-urls",
                        &format!("http://127.0.0.1:{}", clients[i]),
                        "--advertise-client-urls",
                        &format!("http://127.0.0.1:{}", clients[i]),
                        "--listen-peer-urls",
                        &format!("http://127.0.0.1:{}", peers[i]),
                        "--initial-advertise-peer-urls",
                        &format!("http://127.0.0.1:{}", peers[i]),
                        "--initial-cluster",
                        &initial.join(","),
                        "--initial-cluster-state",
                        "new",
                        "--initial-cluster-token",
                        &format!("ccci-test-{}", std::process::id()),
                    ])
                    .stdout(Stdio::null())
                    .stderr(log)
                    .spawn()
                    .expect("start etcd")
            })
            .collect();
        let cluster = Self {
            members,
            clients: clients
                .iter()
                .map(|p| format!("http://127.0.0.1:{p}"))
                .collect(),
            _dir: dir,
        };
        let deadline = Instant::now() + PATIENCE;
        while !cluster.healthy() {
            assert!(
                Instant::now() < deadline,
                "etcd cluster never became healthy"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(cluster)
    }

    pub(crate) fn endpoints(&self) -> String {
        self.clients.join(",")
    }

    pub(crate) fn etcdctl(&self, args: &[&str]) -> std::process::Output {
        Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg("--endpoints")
            .arg(self.endpoints())
            .args(["--dial-timeout", "1s", "--command-timeout", "2s"])
            .args(args)
            .output()
            .expect("run etcdctl")
    }

    /// Every member answers and the cluster has a leader.
    fn healthy(&self) -> bool {
        self.etcdctl(&["endpoint", "health"]).status.success()
    }

    /// The member that leads now.
    pub(crate) fn leader(&self) -> usize {
        let out = self.etcdctl(&["endpoint", "status", "-w", "json"]);
        let statuses: Vec<Value> = serde_json::from_slice(&out.stdout).expect("status JSON");
        let leader = &statuses[0]["Status"]["leader"];
        statuses
            .iter()
            .position(|s| &s["Status"]["header"]["member_id"] == leader)
            .expect("a leader among the members")
    }

    pub(crate) fn signal_member(&self, i: usize, sig: Signal) {
        signal(self.members[i].id(), sig);
    }

    pub(crate) fn signal_all(&self, sig: Signal) {
        for i in 0..self.members.len() {
            self.signal_member(i, sig);
        }
    }

    /// The keys under ccci-run's prefix, with their values.
    pub(crate) fn keys(&self) -> String {
        let out = self.etcdctl(&["get", "--prefix", "/ccci-run/"]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for member in &mut self.members {
            signal(member.id(), Signal::SIGCONT);
            let _ = member.kill();
            let _ = member.wait();
        }
    }
}
