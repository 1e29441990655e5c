//! A fleet on one machine, as root: a bridge in a network namespace of its own, three etcd
//! members, two runner hosts (A and B) and an observer (where the test's own `etcdctl` runs),
//! each in a namespace of its own and joined to the bridge by a veth pair. Their addresses
//! (10.213.N.0/24, N per fleet) exist only inside those namespaces: nothing is created in the
//! machine's own namespace and no packet goes anywhere but these addresses and loopback.
//!
//! Partitions are drops in a `bridge`-family nftables table in the bridge's namespace, one rule
//! per direction and pair, so a full cut, a cut from the leader only and a one-way cut are each
//! a set of rules; a heal flushes them. Established connections go silent, as in a real
//! partition, rather than being reset.
//!
//! A fleet owns whatever runs in its namespaces: dropping it (also while a test panics) kills
//! every process left in them, stopped ones included, and deletes the namespaces. It depends on
//! nothing of the suite, so the handover bench includes it as well.
// Not every user of the fleet uses all of it (the bench least of all).
#![allow(dead_code)]

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::Value;

/// How long the cluster may take to become healthy.
const PATIENCE: Duration = Duration::from_secs(60);
/// Where `ip netns` keeps its namespaces.
const NETNS_DIR: &str = "/var/run/netns";
/// The nftables table and chain (in the bridge's namespace) that hold the cuts.
const TABLE: &str = "ccci_fleet";
const CHAIN: &str = "cuts";

/// A runner host of the fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Host {
    A,
    B,
}

impl Host {
    pub(crate) fn tag(self) -> &'static str {
        match self {
            Host::A => "a",
            Host::B => "b",
        }
    }

    pub(crate) fn other(self) -> Host {
        match self {
            Host::A => Host::B,
            Host::B => Host::A,
        }
    }
}

/// Which packets a cut drops between a host and the members it is cut from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Way {
    /// Both directions: nothing gets through.
    Both,
    /// The host's packets to the members: its requests and keepalives are lost.
    FromHost,
    /// The members' packets to the host: its requests arrive, their answers do not.
    ToHost,
}

/// One node of the fleet: its namespace's name suffix and its address's last byte.
#[derive(Clone, Copy, Debug)]
enum Node {
    Bridge,
    Member(usize),
    Host(Host),
    Observer,
}

impl Node {
    fn suffix(self) -> String {
        match self {
            Node::Bridge => "br".to_owned(),
            Node::Member(i) => format!("m{i}"),
            Node::Host(h) => h.tag().to_owned(),
            Node::Observer => "obs".to_owned(),
        }
    }

    fn last_byte(self) -> u8 {
        match self {
            Node::Bridge => unreachable!("the bridge has no address"),
            Node::Member(i) => 11 + u8::try_from(i).expect("three members"),
            Node::Host(Host::A) => 21,
            Node::Host(Host::B) => 22,
            Node::Observer => 30,
        }
    }
}

/// The fleet's nodes that are joined to the bridge.
const NODES: [Node; 6] = [
    Node::Member(0),
    Node::Member(1),
    Node::Member(2),
    Node::Host(Host::A),
    Node::Host(Host::B),
    Node::Observer,
];

/// A fleet of this test's own.
pub(crate) struct Fleet {
    /// The prefix of its namespaces' names, `ccci<pid>f<n>`.
    name: String,
    /// N of its 10.213.N.0/24.
    net: u8,
    /// The namespaces made so far (all deleted on drop).
    namespaces: Vec<String>,
    members: Vec<Child>,
    dir: tempfile::TempDir,
}

/// Run `cmd`; panic with its command line and output unless it succeeds.
#[track_caller]
fn must(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}\nstatus: {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn kill(pid: i32, sig: Signal) {
    // A process that is gone already (or not yet reaped) is no error here.
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
}

/// The pids of the processes in namespace `ns` (zombies have left it).
fn pids_in(ns: &str) -> Vec<i32> {
    Command::new("ip")
        .args(["netns", "pids", ns])
        .output()
        .map(|out| {
            String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Kill everything in namespace `ns` and delete it.
fn remove_namespace(ns: &str) {
    for _ in 0..50 {
        let pids = pids_in(ns);
        if pids.is_empty() {
            break;
        }
        for pid in pids {
            kill(pid, Signal::SIGCONT);
            kill(pid, Signal::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = Command::new("ip")
        .args(["netns", "del", ns])
        .stderr(Stdio::null())
        .status();
}

/// Remove the namespaces of fleets whose process is gone (killed before its fleet was dropped).
fn sweep_orphans() {
    for entry in std::fs::read_dir(NETNS_DIR).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("ccci")
            .and_then(|rest| rest.split_once('f'))
            .and_then(|(pid, _)| pid.parse::<i32>().ok())
        else {
            continue;
        };
        if std::fs::metadata(format!("/proc/{pid}")).is_err() {
            remove_namespace(&name);
        }
    }
}

impl Fleet {
    /// Build the fleet and start its etcd cluster. `Err` (why) when this machine cannot make a
    /// network namespace (not root, or no CAP_SYS_ADMIN); any later failure panics.
    pub(crate) fn start() -> Result<Self, String> {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        sweep_orphans();
        let mut fleet = Self {
            name: format!("ccci{pid}f{n}"),
            net: u8::try_from((pid as usize * 7 + n) % 250 + 1).expect("below 251"),
            namespaces: Vec::new(),
            members: Vec::new(),
            dir: tempfile::tempdir().expect("a fleet directory"),
        };
        let first = fleet.namespace(Node::Bridge);
        let made = Command::new("ip")
            .args(["netns", "add", &first])
            .output()
            .map_err(|e| format!("ip netns add failed: {e}"))?;
        if !made.status.success() {
            return Err(format!(
                "ip netns add failed: {}",
                String::from_utf8_lossy(&made.stderr).trim()
            ));
        }
        fleet.namespaces.push(first);
        fleet.build_network();
        fleet.members = (0..3).map(|i| fleet.spawn_member(i)).collect();
        fleet.wait_healthy();
        Ok(fleet)
    }

    fn namespace(&self, node: Node) -> String {
        format!("{}{}", self.name, node.suffix())
    }

    fn netns_path(&self, node: Node) -> String {
        format!("{NETNS_DIR}/{}", self.namespace(node))
    }

    fn addr(&self, node: Node) -> String {
        format!("10.213.{}.{}", self.net, node.last_byte())
    }

    /// `ip -n NS args...`, which must succeed.
    fn ip(&self, node: Node, args: &[&str]) {
        must(
            Command::new("ip")
                .arg("-n")
                .arg(self.namespace(node))
                .args(args),
        );
    }

    /// The bridge, one namespace and veth pair per node, addresses, and the (empty) cut table.
    fn build_network(&mut self) {
        self.ip(Node::Bridge, &["link", "add", "br0", "type", "bridge"]);
        self.ip(Node::Bridge, &["link", "set", "br0", "up"]);
        for (port, node) in NODES.into_iter().enumerate() {
            let ns = self.namespace(node);
            must(Command::new("ip").args(["netns", "add", &ns]));
            self.namespaces.push(ns.clone());
            let port = format!("p{port}");
            self.ip(
                node,
                &[
                    "link",
                    "add",
                    "eth0",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &port,
                    "netns",
                    &self.namespace(Node::Bridge),
                ],
            );
            self.ip(Node::Bridge, &["link", "set", &port, "master", "br0"]);
            self.ip(Node::Bridge, &["link", "set", &port, "up"]);
            let cidr = format!("{}/24", self.addr(node));
            self.ip(node, &["addr", "add", &cidr, "dev", "eth0"]);
            self.ip(node, &["link", "set", "eth0", "up"]);
            self.ip(node, &["link", "set", "lo", "up"]);
        }
        self.nft(&format!(
            "add table bridge {TABLE}\n\
             add chain bridge {TABLE} {CHAIN} {{ type filter hook forward priority 0; policy accept; }}\n"
        ));
    }

    /// Apply an nftables script in the bridge's namespace, atomically.
    fn nft(&self, script: &str) {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.netns_path(Node::Bridge)))
            .args(["--", "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("run nft");
        child
            .stdin
            .take()
            .expect("piped")
            .write_all(script.as_bytes())
            .expect("write to nft");
        let out = child.wait_with_output().expect("wait for nft");
        assert!(
            out.status.success(),
            "nft -f - <<{script}\nstatus: {:?}\n--- stderr\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn initial_cluster(&self) -> String {
        (0..3)
            .map(|i| format!("m{i}=http://{}:2380", self.addr(Node::Member(i))))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn member_log(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("m{i}.log"))
    }

    /// Start member `i` in its namespace. (etcd 3.4 has no --unsafe-no-fsync; its data dir is
    /// on whatever disk the machine's temp dir is.)
    fn spawn_member(&self, i: usize) -> Child {
        let node = Node::Member(i);
        let log = std::fs::File::create(self.member_log(i)).expect("a member log");
        let client = format!("http://{}:2379", self.addr(node));
        let peer = format!("http://{}:2380", self.addr(node));
        Command::new("nsenter")
            .arg(format!("--net={}", self.netns_path(node)))
            .args(["--", "etcd", "--name", &format!("m{i}")])
            .arg("--data-dir")
            .arg(self.dir.path().join(format!("m{i}")))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
                "--initial-cluster",
                &self.initial_cluster(),
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                &self.name,
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd")
    }

    /// The last lines of every member's log, for a failure message.
    fn member_logs(&self) -> String {
        (0..3)
            .map(|i| {
                let text = std::fs::read_to_string(self.member_log(i)).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(15).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                format!("--- m{i}.log (tail)\n{}", tail.join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Ask until every member answers and the cluster has a leader.
    fn wait_healthy(&mut self) {
        let deadline = Instant::now() + PATIENCE;
        while !self.etcdctl(&["endpoint", "health"]).status.success() {
            let exited = self
                .members
                .iter_mut()
                .position(|m| m.try_wait().ok().flatten().is_some());
            assert!(
                exited.is_none(),
                "etcd member m{} exited while the cluster started\n{}",
                exited.unwrap_or_default(),
                self.member_logs()
            );
            assert!(
                Instant::now() < deadline,
                "the fleet's etcd cluster never became healthy\n{}",
                self.member_logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The members' client URLs, for `--etcd-endpoints`.
    pub(crate) fn endpoints(&self) -> String {
        (0..3)
            .map(|i| format!("http://{}:2379", self.addr(Node::Member(i))))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The fleet's own directory (its members' data and logs; a test may keep files there).
    pub(crate) fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// `cmd` as it runs on the observer, which no cut ever touches (in its network namespace
    /// only).
    pub(crate) fn on_observer(&self, cmd: &Command) -> Command {
        let mut wrapped = Command::new("nsenter");
        wrapped
            .arg(format!("--net={}", self.netns_path(Node::Observer)))
            .arg("--");
        copy_command(cmd, &mut wrapped);
        wrapped
    }

    /// `etcdctl` (API 3) against every member, from the observer.
    pub(crate) fn etcdctl(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new("etcdctl");
        cmd.env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.endpoints()])
            .args(["--dial-timeout", "1s", "--command-timeout", "3s"])
            .args(args);
        self.on_observer(&cmd).output().expect("run etcdctl")
    }

    /// The keys under `prefix`, as the observer reads them.
    #[track_caller]
    pub(crate) fn keys(&self, prefix: &str) -> Vec<String> {
        let out = self.etcdctl(&["get", "--prefix", "--keys-only", prefix]);
        assert!(
            out.status.success(),
            "etcdctl get --prefix {prefix}: {out:?}"
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// The member that leads now.
    #[track_caller]
    pub(crate) fn leader(&self) -> usize {
        let out = self.etcdctl(&["endpoint", "status", "-w", "json"]);
        let statuses: Vec<Value> = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("endpoint status JSON ({e}): {out:?}"));
        let leader = &statuses[0]["Status"]["leader"];
        statuses
            .iter()
            .position(|s| &s["Status"]["header"]["member_id"] == leader)
            .unwrap_or_else(|| panic!("no leader among the members: {statuses:?}"))
    }

    /// SIGKILL the member that leads now, and return it and how long the others took to elect
    /// a new leader (as the observer sees it: a member that answers names a leader other than
    /// the one killed). The killed member stays down.
    #[track_caller]
    pub(crate) fn kill_leader(&self) -> (usize, Duration) {
        let leader = self.leader();
        let pid = i32::try_from(self.members[leader].id()).expect("a pid");
        let killed = Instant::now();
        kill(pid, Signal::SIGKILL);
        let deadline = killed + PATIENCE;
        // Only the members left: one that is down costs etcdctl its dial timeout.
        let live = (0..3)
            .filter(|i| *i != leader)
            .map(|i| format!("http://{}:2379", self.addr(Node::Member(i))))
            .collect::<Vec<_>>()
            .join(",");
        loop {
            let mut cmd = Command::new("etcdctl");
            cmd.env("ETCDCTL_API", "3")
                .args(["--endpoints", &live, "--dial-timeout", "1s"])
                .args([
                    "--command-timeout",
                    "1s",
                    "endpoint",
                    "status",
                    "-w",
                    "json",
                ]);
            let out = self.on_observer(&cmd).output().expect("run etcdctl");
            let statuses: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap_or_default();
            let ids: Vec<&Value> = statuses
                .iter()
                .map(|s| &s["Status"]["header"]["member_id"])
                .collect();
            let elected = statuses.iter().any(|s| {
                let named = &s["Status"]["leader"];
                !named.is_null() && named.as_u64() != Some(0) && ids.contains(&named)
            });
            if elected {
                return (leader, killed.elapsed());
            }
            assert!(
                Instant::now() < deadline,
                "no new leader after m{leader} was killed\n{}",
                self.member_logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Drop the packets between `host` and each of `members`, as `way` says.
    pub(crate) fn cut(&self, host: Host, members: &[usize], way: Way) {
        let h = self.addr(Node::Host(host));
        let mut script = String::new();
        for &m in members {
            let m = self.addr(Node::Member(m));
            let mut rule = |from: &str, to: &str| {
                script.push_str(&format!(
                    "add rule bridge {TABLE} {CHAIN} ip saddr {from} ip daddr {to} drop\n"
                ));
            };
            if way != Way::ToHost {
                rule(&h, &m);
            }
            if way != Way::FromHost {
                rule(&m, &h);
            }
        }
        self.nft(&script);
    }

    /// Cut `host` off from every member, both ways.
    pub(crate) fn cut_off(&self, host: Host) {
        self.cut(host, &[0, 1, 2], Way::Both);
    }

    /// Heal every cut.
    pub(crate) fn heal(&self) {
        self.nft(&format!("flush chain bridge {TABLE} {CHAIN}\n"));
    }

    /// The name `host` goes by (its own UTS namespace's hostname).
    pub(crate) fn hostname(&self, host: Host) -> String {
        format!("{}-{}", self.name, host.tag())
    }

    /// `cmd` (its program, arguments, environment and working directory) as it runs on `host`:
    /// in the host's network namespace, in a UTS namespace of its own named after the host, and
    /// in a process group of its own, as a CI step's supervisor is. The wrappers exec, so the
    /// spawned pid is `cmd`'s own.
    pub(crate) fn on_host(&self, host: Host, cmd: &Command) -> Command {
        let mut wrapped = Command::new("nsenter");
        wrapped
            .arg(format!("--net={}", self.netns_path(Node::Host(host))))
            .args(["--", "unshare", "--uts", "--", "sh", "-c"])
            .arg(r#"hostname "$0" && exec "$@""#)
            .arg(self.hostname(host));
        copy_command(cmd, &mut wrapped);
        std::os::unix::process::CommandExt::process_group(&mut wrapped, 0);
        wrapped
    }
}

/// Append `cmd`'s program and arguments to `wrapped`'s, and give it `cmd`'s environment
/// changes and working directory.
fn copy_command(cmd: &Command, wrapped: &mut Command) {
    wrapped.arg(cmd.get_program()).args(cmd.get_args());
    for (key, value) in cmd.get_envs() {
        match value {
            Some(value) => wrapped.env(key, value),
            None => wrapped.env_remove(key),
        };
    }
    if let Some(dir) = cmd.get_current_dir() {
        wrapped.current_dir(dir);
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        // Everything in the namespaces goes, members and whatever a test left running.
        for ns in self.namespaces.iter().rev() {
            remove_namespace(ns);
        }
        for member in &mut self.members {
            let _ = member.kill();
            let _ = member.wait();
        }
    }
}
