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
    peers: Vec<u16>,
    dir: tempfile::TempDir,
}

/// Whether an etcd cluster can be started and read here: `etcd` and `etcdctl` installed. The
/// suite asks `util::etcd_cluster`, which says why it skips.
pub(crate) fn etcd_available() -> bool {
    [("etcd", "--version"), ("etcdctl", "version")]
        .iter()
        .all(|(tool, version)| {
            Command::new(tool)
                .arg(version)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
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
        let mut cluster = Self {
            members: Vec::new(),
            clients: Vec::new(),
            peers: Vec::new(),
            dir: tempfile::tempdir().unwrap(),
        };
        // A port found free may be taken by another test's cluster before a member binds it:
        // such a member exits at once, and the cluster starts again on other ports.
        for _ in 0..5 {
            cluster.peers = (0..3).map(|_| free_port()).collect();
            cluster.clients = (0..3)
                .map(|_| format!("http://127.0.0.1:{}", free_port()))
                .collect();
            cluster.members = (0..3).map(|i| cluster.spawn_member(i)).collect();
            if cluster.wait_healthy() {
                return Some(cluster);
            }
            cluster.kill_all();
            for i in 0..3 {
                let _ = std::fs::remove_dir_all(cluster.data_dir(i));
            }
        }
        panic!("etcd cluster never started: a member exited each time (its log is m<i>.log)");
    }

    fn initial_cluster(&self) -> String {
        let members: Vec<String> = self
            .peers
            .iter()
            .enumerate()
            .map(|(i, p)| format!("m{i}=http://127.0.0.1:{p}"))
            .collect();
        members.join(",")
    }

    fn token() -> String {
        format!("ccci-test-{}", std::process::id())
    }

    fn data_dir(&self, i: usize) -> std::path::PathBuf {
        self.dir.path().join(format!("m{i}"))
    }

    /// Start member `i` on its data dir (a new cluster's member when the dir is empty).
    fn spawn_member(&self, i: usize) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("m{i}.log")))
            .unwrap();
        Command::new("etcd")
            .args(["--name", &format!("m{i}")])
            .arg("--data-dir")
            .arg(self.data_dir(i))
            .args([
                "--listen-client-urls",
                &self.clients[i],
                "--advertise-client-urls",
                &self.clients[i],
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{}", self.peers[i]),
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{}", self.peers[i]),
                "--initial-cluster",
                &self.initial_cluster(),
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                &Self::token(),
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd")
    }

    /// Wait until the cluster is healthy: `false` when a member exited first.
    fn wait_healthy(&mut self) -> bool {
        let deadline = Instant::now() + PATIENCE;
        while !self.healthy() {
            if self
                .members
                .iter_mut()
                .any(|m| m.try_wait().ok().flatten().is_some())
            {
                return false;
            }
            assert!(
                Instant::now() < deadline,
                "etcd cluster never became healthy"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        true
    }

    fn kill_all(&mut self) {
        for member in &mut self.members {
            signal(member.id(), Signal::SIGCONT);
            let _ = member.kill();
            let _ = member.wait();
        }
    }

    /// Kill every member, give each `data` (empty: none), start them again on the same
    /// addresses with the same configuration (hence the same cluster id), and wait until the
    /// cluster is healthy again.
    fn restart_with(&mut self, data: impl Fn(&Self, usize)) {
        self.kill_all();
        for i in 0..3 {
            let _ = std::fs::remove_dir_all(self.data_dir(i));
            data(self, i);
        }
        self.members = (0..3).map(|i| self.spawn_member(i)).collect();
        assert!(self.wait_healthy(), "an etcd member exited on restart");
    }

    /// The cluster wiped: every member killed and started again with an empty data dir.
    pub(crate) fn wipe(&mut self) {
        self.restart_with(|_, _| {});
    }

    /// A snapshot of the cluster's data now, in the test's directory.
    pub(crate) fn save_snapshot(&self) -> std::path::PathBuf {
        let path = self.dir.path().join("snapshot.db");
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.clients[0], "snapshot", "save"])
            .arg(&path)
            .output()
            .expect("run etcdctl");
        assert!(out.status.success(), "snapshot save: {out:?}");
        path
    }

    /// The cluster restored from `snapshot` on every member, as etcd's disaster-recovery
    /// guide does it (same members, same token: the same cluster id).
    pub(crate) fn restore(&mut self, snapshot: &std::path::Path) {
        self.restart_with(|cluster, i| {
            let out = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .args(["snapshot", "restore"])
                .arg(snapshot)
                .args(["--name", &format!("m{i}")])
                .arg("--data-dir")
                .arg(cluster.data_dir(i))
                .args([
                    "--initial-cluster",
                    &cluster.initial_cluster(),
                    "--initial-cluster-token",
                    &Self::token(),
                    "--initial-advertise-peer-urls",
                    &format!("http://127.0.0.1:{}", cluster.peers[i]),
                ])
                .output()
                .expect("run etcdctl");
            assert!(out.status.success(), "snapshot restore: {out:?}");
        });
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

    /// The keys of ccci-run's locks (app and named, and their holders' tenure), with their values: what a holder or a
    /// waiter writes, and must not leave behind. (The lineage record stays by design.)
    pub(crate) fn keys(&self) -> String {
        ["/ccci-run/app/", "/ccci-run/named/", "/ccci-run/tenure/"]
            .iter()
            .map(|prefix| {
                let out = self.etcdctl(&["get", "--prefix", prefix]);
                String::from_utf8_lossy(&out.stdout).into_owned()
            })
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.kill_all();
    }
}
