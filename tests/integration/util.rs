//! Test helpers: a sandbox of directories for one test, a spawned process whose stdout and
//! stderr are read line by line so tests wait for readiness lines instead of sleeping, and the
//! one way a test says it cannot run here ([`skip`]).
//!
//! Every assertion failure prints the command line, its status and everything it printed. Every
//! skip is printed past the harness's capture when it happens and listed again when the suite
//! ends, so a skipped test never reads as a pass; under `CI=true` a skip is a failure (CI has
//! every tool), but for the few things CI cannot have ([`skip_even_in_ci`]).

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long any single wait in a test may take before it is a failure (never a synchronisation).
pub const PATIENCE: Duration = Duration::from_secs(60);

pub const BIN: &str = env!("CARGO_BIN_EXE_ccci-run");

/// One test's directories: runs, canonical abra home, locks and state files.
pub struct Sandbox {
    dir: tempfile::TempDir,
    /// `--docker` for every ccci-run of this sandbox.
    docker: &'static str,
    /// `--domain-suffix`: Docker tests get one of their own, so that no test's janitor ever
    /// sees another test's stacks on the shared engine.
    suffix: Option<String>,
    /// `--etcd-endpoints` and `--lease-ttl`, for a sandbox that is one host of a fleet.
    etcd: Option<(String, u32)>,
}

impl Sandbox {
    pub fn new() -> Self {
        let sandbox = Self {
            dir: tempfile::tempdir().expect("create sandbox"),
            docker: "off",
            suffix: None,
            etcd: None,
        };
        std::fs::create_dir_all(sandbox.state()).unwrap();
        sandbox
    }

    /// A sandbox user `uid` can enter, with its runs, lock, state and abra dirs `uid`'s.
    pub fn owned_by(uid: u32) -> Self {
        use std::os::unix::fs::PermissionsExt;
        let sandbox = Self::new();
        std::fs::set_permissions(sandbox.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        for dir in [
            sandbox.runs(),
            sandbox.locks(),
            sandbox.state(),
            sandbox.abra_home(),
        ] {
            std::fs::create_dir_all(&dir).unwrap();
            std::os::unix::fs::chown(&dir, Some(uid), Some(uid)).unwrap();
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        sandbox
    }

    /// A sandbox whose runs and janitors use the Docker engine at `DOCKER_HOST`, with a domain
    /// suffix of its own. `None` (with a message) when no engine answers outside CI; in CI a
    /// missing engine fails the test.
    pub fn with_docker() -> Option<Self> {
        if !docker_available() {
            return None;
        }
        Some(Self::with_engine_of_its_own())
    }

    /// A sandbox whose runs and janitors use Docker, with a domain suffix of its own, for a
    /// test that points each command at an engine of its choosing (`DOCKER_HOST` on the
    /// command) and has checked that engine itself.
    pub fn with_engine_of_its_own() -> Self {
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut sandbox = Self::new();
        sandbox.docker = "auto";
        sandbox.suffix = Some(format!("t{}x{n}.test", std::process::id()));
        sandbox
    }

    /// Another "host" of the same fleet as `other`: directories of its own, the same engine and
    /// domain suffix (so the two see each other's stacks and share domains).
    pub fn beside(other: &Sandbox) -> Self {
        let mut sandbox = Self::new();
        sandbox.docker = other.docker;
        sandbox.suffix = other.suffix.clone();
        sandbox.etcd = other.etcd.clone();
        sandbox
    }

    /// Keep locks in the etcd at `endpoints` from now on, with leases of `ttl` seconds.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub fn set_etcd(&mut self, endpoints: String, ttl: u32) {
        self.etcd = Some((endpoints, ttl));
    }

    /// The lease TTL of a sandbox that keeps its locks in etcd.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub fn etcd_ttl(&self) -> Option<u32> {
        self.etcd.as_ref().map(|(_, ttl)| *ttl)
    }

    /// Use `--docker mode` from now on.
    pub fn set_docker(&mut self, mode: &'static str) {
        self.docker = mode;
    }

    pub fn suffix(&self) -> &str {
        self.suffix.as_deref().unwrap_or("ci.commoninternet.net")
    }

    /// The stack name of `domain`.
    pub fn stack(domain: &str) -> String {
        domain.replace('.', "_")
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn runs(&self) -> PathBuf {
        self.path().join("runs")
    }

    pub fn abra_home(&self) -> PathBuf {
        self.path().join("abra")
    }

    pub fn state(&self) -> PathBuf {
        self.path().join("state")
    }

    pub fn locks(&self) -> PathBuf {
        self.path().join("locks")
    }

    /// `ccci-run` with this sandbox's directories and a clean environment.
    pub fn ccci(&self) -> Command {
        let mut cmd = Command::new(BIN);
        for (key, _) in std::env::vars_os() {
            let key = key.to_string_lossy();
            if key.starts_with("CCCI_") || key.starts_with("DRONE_") || key == "RUST_LOG" {
                cmd.env_remove(&*key);
            }
        }
        // No host configuration file leaks into a test (an empty file is an empty TOML table).
        cmd.env("CCCI_CONFIG", "/dev/null");
        cmd.arg("--runs-dir")
            .arg(self.runs())
            .arg("--abra-home")
            .arg(self.abra_home())
            .arg("--lock-dir")
            .arg(self.locks())
            .arg("--state-dir")
            .arg(self.state())
            .arg("--docker")
            .arg(self.docker);
        if let Some(suffix) = &self.suffix {
            cmd.arg("--domain-suffix").arg(suffix);
        }
        if let Some((endpoints, ttl)) = &self.etcd {
            cmd.arg("--etcd-endpoints")
                .arg(endpoints)
                .arg("--lease-ttl")
                .arg(ttl.to_string());
            // Half the longest kill grace such a short lease allows (TTL - 0.5 s kill margin -
            // 3.5 s keepalive and election headroom); a test's own --kill-grace overrides it.
            let grace = f64::from(ttl.saturating_sub(4)) / 2.0;
            cmd.env("CCCI_KILL_GRACE", format!("{grace}"));
        }
        cmd
    }

    /// `ccci-run run --recipe R --run-id ID --no-fetch [extra...] -- sh -c SCRIPT`.
    pub fn run_sh(&self, run_id: &str, extra: &[&str], script: &str) -> Command {
        let mut cmd = self.ccci();
        cmd.args([
            "run",
            "--recipe",
            "custom-html",
            "--run-id",
            run_id,
            "--no-fetch",
        ])
        .args(extra)
        .args(["--", "sh", "-c", script]);
        cmd
    }

    pub fn record(&self, run_id: &str) -> Value {
        let path = self.runs().join(run_id).join("run.json");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        serde_json::from_str(&text).unwrap()
    }

    /// Plant `<abra-home>/servers/<server>/<domain>.env` holding `contents`.
    pub fn plant_env(&self, server: &str, domain: &str, contents: &str) -> PathBuf {
        let dir = self.abra_home().join("servers").join(server);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{domain}.env"));
        std::fs::write(&path, contents).unwrap();
        path
    }

    /// Plant the record of a finished run of `domain` that says its recipe gives `names`
    /// (`kind`, form: `<stack>_db_password_{version}`), as a run of that recipe records before
    /// it deploys: for tests that deploy an app by hand, unlabelled objects and all.
    pub fn plant_given_names(&self, domain: &str, names: &[(&str, &str)]) -> PathBuf {
        let dir = self.runs().join(format!("given-{domain}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut given = serde_json::Map::new();
        for (kind, form) in names {
            let list = given
                .entry(format!("{kind}s"))
                .or_insert_with(|| Value::Array(Vec::new()));
            list.as_array_mut().unwrap().push(Value::from(*form));
        }
        let record = serde_json::json!({
            "run_id": format!("given-{domain}"),
            "recipe": "custom-html",
            "pr": null,
            "ref": null,
            "domain": domain,
            "stack": Self::stack(domain),
            "pid": 1,
            "host": "test",
            "abra_dir": "",
            "recipe_url": null,
            "commit": null,
            "command": ["true"],
            "cgroup": null,
            "phases": [],
            "shutdown_reason": "command-ended",
            "command_status": null,
            "killed_after_grace": false,
            "exit_code": 0,
            "teardown_errors": [],
            "given_names": given,
            "reaped": null,
            "error": null,
        });
        let path = dir.join("run.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&record).unwrap()).unwrap();
        path
    }

    /// The app lock file of `domain`.
    pub fn lock_file(&self, domain: &str) -> PathBuf {
        self.locks().join(format!("cc-ci-app-{domain}.lock"))
    }

    /// `ccci-run janitor --json [extra...]`, its report and the finished process.
    pub fn janitor(&self, extra: &[&str]) -> (Value, Finished) {
        let mut cmd = self.ccci();
        cmd.args(["janitor", "--json"]).args(extra);
        let done = run(cmd);
        let report = serde_json::from_str(&done.out.join("\n"))
            .unwrap_or_else(|e| panic!("janitor printed no JSON ({e})\n{}", done.transcript()));
        (report, done)
    }

    /// Start `n` janitors at once; when all are done (each with exit 0), how many times each
    /// domain was reaped, and every decision they made.
    pub fn racing_janitors(&self, n: usize) -> (BTreeMap<String, usize>, Vec<String>) {
        let janitors: Vec<Proc> = (0..n)
            .map(|_| {
                let mut cmd = self.ccci();
                cmd.args(["janitor", "--json"]);
                Proc::spawn(cmd)
            })
            .collect();
        let mut reaps = BTreeMap::new();
        let mut decisions = Vec::new();
        for janitor in janitors {
            let done = janitor.finish();
            done.assert_code(0);
            let report: Value = serde_json::from_str(&done.out.join("\n")).unwrap();
            for c in report["candidates"].as_array().unwrap() {
                let decision = c["decision"].as_str().unwrap().to_owned();
                if decision == "reap" {
                    *reaps
                        .entry(c["domain"].as_str().unwrap().to_owned())
                        .or_default() += 1;
                }
                decisions.push(decision);
            }
        }
        (reaps, decisions)
    }

    /// The domain `ccci-run app-domain` gives for a recipe and PR.
    pub fn domain(&self, recipe: &str, pr: Option<&str>) -> String {
        let mut cmd = self.ccci();
        cmd.args(["app-domain", "--recipe", recipe]);
        if let Some(pr) = pr {
            cmd.args(["--pr", pr]);
        }
        let done = run(cmd);
        done.assert_code(0);
        done.out[0].clone()
    }

    /// Hold the flock on `path` from a separate `flock(1)` process until the returned process
    /// is finished (its stdin closed).
    pub fn hold_with_flock(&self, path: &Path) -> Proc {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut cmd = Command::new("flock");
        cmd.arg(path)
            .args(["sh", "-c", "echo ready $$; read line || :"]);
        let mut holder = Proc::spawn(cmd);
        holder.wait_ready();
        holder
    }

    /// Files left in the state directory.
    /// This sandbox's configuration as state file names carry it: `c<dev>.<ino>` of its runs
    /// dir (made here if missing).
    pub fn scope(&self) -> String {
        use std::os::unix::fs::MetadataExt;
        std::fs::create_dir_all(self.runs()).unwrap();
        let meta = std::fs::metadata(self.runs()).unwrap();
        format!("c{}.{}", meta.dev(), meta.ino())
    }

    pub fn state_files(&self) -> Vec<String> {
        list(&self.state())
    }
}

/// True when a Docker engine answers at `DOCKER_HOST`. In CI (`CI=true`) its absence is a
/// failure; elsewhere the Docker tests skip with a message.
pub fn docker_available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let available = *AVAILABLE.get_or_init(|| {
        Command::new("docker")
            .args(["version", "--format", "{{.Server.APIVersion}}"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    if !available {
        let host = std::env::var("DOCKER_HOST");
        skip(
            &format!(
                "no Docker engine answers at DOCKER_HOST={}",
                host.as_deref().unwrap_or("(unset)")
            ),
            "start one with `scripts/docker-engine.sh start` and export the DOCKER_HOST it prints",
        );
    }
    available
}

/// A 3-member etcd cluster of the test's own, or None where etcd is not installed (the test
/// skipped, saying so; in CI a failure).
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
pub fn etcd_cluster() -> Option<crate::etcd_cluster::Cluster> {
    if !(need("etcd") && need("etcdctl")) {
        return None;
    }
    Some(crate::etcd_cluster::Cluster::start().expect("etcd and etcdctl are installed"))
}

/// The Debian package of each program a test may go without, for the install hint of its skip.
/// The programs of Debian's base system the suite also drives (flock, setsid, setpriv, unshare,
/// script, chattr, mount, sha1sum) are not here: without them a test fails.
const PACKAGES: &[(&str, &str)] = &[
    ("bash", "bash"),
    ("etcd", "etcd-server"),
    ("etcdctl", "etcd-client"),
    ("fish", "fish"),
    ("groff", "groff-base"),
    ("ip", "iproute2"),
    ("nft", "nftables"),
    ("nix-instantiate", "nix-bin"),
    ("readelf", "binutils"),
    ("strace", "strace"),
    ("systemd-analyze", "systemd"),
    ("yamllint", "yamllint"),
    ("zsh", "zsh"),
];

/// True when the program `tool` is on PATH; otherwise the calling test is skipped with the
/// package that installs it (a failure under `CI=true`, where .ci/run installs it).
#[track_caller]
/// Make `path` (a file or a directory) look `by` old: its modification time set back.
pub fn age(path: &Path, by: Duration) {
    std::fs::File::options()
        .read(true)
        .open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .set_modified(std::time::SystemTime::now() - by)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

pub fn need(tool: &str) -> bool {
    let package = PACKAGES
        .iter()
        .find(|(name, _)| *name == tool)
        .map(|(_, package)| *package)
        .unwrap_or_else(|| panic!("{tool} has no install hint in util::PACKAGES"));
    let found = std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::metadata(dir.join(tool))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    });
    if !found {
        skip(
            &format!("{tool} is not installed"),
            &format!("apt install {package}"),
        );
    }
    found
}

/// The calling test does not run (all of it, or the part that needs what is missing) because
/// of `why`; `hint` says how to make it run. Under `CI=true` this fails the test instead: CI's
/// machine has everything the suite uses (.ci/run installs it).
#[track_caller]
pub fn skip(why: &str, hint: &str) {
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "CI=true but {why}: in CI every test runs ({hint})"
    );
    skips::record(why, hint);
}

/// Whether the suite runs as root; if not, the calling test is skipped ([`skip`]) with `hint`.
#[track_caller]
pub fn is_root_or_skip(hint: &str) -> bool {
    let root = nix::unistd::Uid::effective().is_root();
    if !root {
        skip("needs root", hint);
    }
    root
}

/// [`skip`], in CI too: only for what CI's machine cannot have (a nixpkgs checkout).
pub fn skip_even_in_ci(why: &str, hint: &str) {
    skips::record(why, hint);
}

/// Every skip of this run of the suite, listed once more when the process exits: after the
/// harness's `test result:` line, where the skips read as what they are.
mod skips {
    use std::io::Write as _;
    use std::sync::{Mutex, Once};

    /// (test, why, hint), in the order they happened.
    static SKIPS: Mutex<Vec<(String, String, String)>> = Mutex::new(Vec::new());
    static AT_EXIT: Once = Once::new();

    pub(super) fn record(why: &str, hint: &str) {
        // The harness runs each test on a thread named after it.
        let thread = std::thread::current();
        let test = match thread.name() {
            Some(name) if name != "main" => name.to_owned(),
            _ => "a test".to_owned(),
        };
        let mut skips = SKIPS.lock().unwrap_or_else(|e| e.into_inner());
        let entry = (test, why.to_owned(), hint.to_owned());
        if skips.contains(&entry) {
            return;
        }
        // Written to the process's stderr, not through eprintln!: the harness captures what
        // eprintln! prints and shows it only for a failed test.
        let _ = writeln!(
            std::io::stderr(),
            "skipped: {} because {why} ({hint})",
            entry.0
        );
        skips.push(entry);
        AT_EXIT.call_once(|| {
            // SAFETY: atexit registers a function that takes and returns nothing; `summary`
            // is one and never unwinds.
            unsafe { nix::libc::atexit(summary) };
        });
    }

    /// One line saying how many tests were skipped, then one per reason naming its tests.
    extern "C" fn summary() {
        let skips = SKIPS.lock().unwrap_or_else(|e| e.into_inner());
        let mut reasons: Vec<(&str, &str, Vec<&str>)> = Vec::new();
        for (test, why, hint) in skips.iter() {
            match reasons.iter_mut().find(|(w, h, _)| w == why && h == hint) {
                Some((_, _, tests)) => tests.push(test),
                None => reasons.push((why, hint, vec![test])),
            }
        }
        let mut tests: Vec<&str> = skips.iter().map(|(test, _, _)| test.as_str()).collect();
        tests.sort_unstable();
        tests.dedup();
        let mut text = format!(
            "\nskipped: {} of the tests reported `ok` above did not run, in all or in part:\n",
            tests.len()
        );
        for (why, hint, tests) in reasons {
            text.push_str(&format!("  {why} ({hint}): {}\n", tests.join(", ")));
        }
        let _ = std::io::stderr().write_all(text.as_bytes());
    }
}

/// Run the docker CLI; panics with its output when it fails.
pub fn docker(args: &[&str]) -> String {
    let out = Command::new("docker").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "docker {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A candidate of a janitor report, by domain.
pub fn candidate<'a>(report: &'a Value, domain: &str) -> &'a Value {
    report["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["domain"] == domain)
        .unwrap_or_else(|| panic!("no candidate {domain} in {report:#}"))
}

/// Names in a directory, sorted; empty when it does not exist.
pub fn list(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Out,
    Err,
}

/// A running process whose output is collected line by line.
pub struct Proc {
    pub child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<Option<(Stream, String)>>,
    pub out: Vec<String>,
    pub err: Vec<String>,
    open_streams: usize,
    cmdline: String,
}

/// What a finished process left.
pub struct Finished {
    pub status: ExitStatus,
    pub out: Vec<String>,
    pub err: Vec<String>,
    cmdline: String,
}

impl Finished {
    pub fn transcript(&self) -> String {
        format!(
            "status: {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.status,
            self.out.join("\n"),
            self.err.join("\n")
        )
    }

    pub fn stderr(&self) -> String {
        self.err.join("\n")
    }

    /// The command line that ran, for a failure message.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub fn command_line(&self) -> &str {
        &self.cmdline
    }

    #[track_caller]
    pub fn assert_code(&self, code: i32) {
        assert_eq!(
            self.status.code(),
            Some(code),
            "{}\n{}",
            self.cmdline,
            self.transcript()
        );
    }

    #[track_caller]
    pub fn assert_stderr_has(&self, needle: &str) {
        assert!(
            self.err.iter().any(|l| l.contains(needle)),
            "stderr lacks {needle:?}\n{}\n{}",
            self.cmdline,
            self.transcript()
        );
    }
}

impl Proc {
    pub fn spawn(mut cmd: Command) -> Self {
        let cmdline = format!("{cmd:?}");
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmdline}: {e}"));
        let (tx, rx) = channel();
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        for (stream, reader) in [
            (Stream::Out, Box::new(out) as Box<dyn std::io::Read + Send>),
            (Stream::Err, Box::new(err)),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(reader).lines() {
                    let Ok(line) = line else { break };
                    let _ = tx.send(Some((stream, line)));
                }
                let _ = tx.send(None);
            });
        }
        Self {
            stdin: child.stdin.take(),
            child,
            lines: rx,
            out: Vec::new(),
            err: Vec::new(),
            open_streams: 2,
            cmdline,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn transcript(&self) -> String {
        format!(
            "{}\n--- stdout\n{}\n--- stderr\n{}",
            self.cmdline,
            self.out.join("\n"),
            self.err.join("\n")
        )
    }

    /// Take the next line (from either stream); None once both streams are closed.
    fn next_line(&mut self, deadline: Instant) -> Option<(Stream, String)> {
        loop {
            if self.open_streams == 0 {
                return None;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(Some((stream, line))) => {
                    match stream {
                        Stream::Out => self.out.push(line.clone()),
                        Stream::Err => self.err.push(line.clone()),
                    }
                    return Some((stream, line));
                }
                Ok(None) => self.open_streams -= 1,
                Err(RecvTimeoutError::Timeout) => {
                    let _ = self.child.kill();
                    panic!("timed out waiting for output\n{}", self.transcript());
                }
                Err(RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    /// Wait for a line on `stream` containing `needle`; returns it.
    #[track_caller]
    pub fn wait_for(&mut self, stream: Stream, needle: &str) -> String {
        let deadline = Instant::now() + PATIENCE;
        while let Some((s, line)) = self.next_line(deadline) {
            if s == stream && line.contains(needle) {
                return line;
            }
        }
        panic!(
            "output ended without a line containing {needle:?}\n{}",
            self.transcript()
        );
    }

    /// Wait for the command's readiness line `ready <pid>` and return the pid (also its pgid).
    #[track_caller]
    pub fn wait_ready(&mut self) -> i32 {
        let line = self.wait_for(Stream::Out, "ready");
        line.split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("readiness line without a pid: {line:?}"))
    }

    /// The stdout lines read so far (by [`Self::wait_for`]).
    pub fn out_so_far(&self) -> &[String] {
        &self.out
    }

    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// Read both streams to their end, then reap the process.
    pub fn finish(mut self) -> Finished {
        self.stdin = None;
        let deadline = Instant::now() + PATIENCE;
        while self.next_line(deadline).is_some() {}
        let status = self.child.wait().unwrap();
        Finished {
            status,
            out: self.out,
            err: self.err,
            cmdline: self.cmdline,
        }
    }
}

/// Take every `CCCI_*` variable of the test's own environment out of `cmd`'s: no setting of
/// the machine the suite runs on leaks into a test.
pub fn without_ccci_env(cmd: &mut Command) -> &mut Command {
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("CCCI_") {
            cmd.env_remove(key);
        }
    }
    cmd
}

/// Whether nobody holds the flock on `path`: a `flock -n` of our own gets it (and lets go).
pub fn lock_is_free(path: &Path) -> bool {
    Command::new("flock")
        .arg("-n")
        .arg(path)
        .arg("true")
        .status()
        .unwrap()
        .success()
}

/// Read stdout until a line `<prefix><pid>` has come for every prefix, in whatever order the
/// processes printed them; returns the pids in the order of `prefixes`.
pub fn pids_by_prefix(proc: &mut Proc, prefixes: &[&str]) -> Vec<i32> {
    let mut found: Vec<Option<i32>> = vec![None; prefixes.len()];
    while found.iter().any(Option::is_none) {
        let line = proc.wait_for(Stream::Out, "");
        for (slot, prefix) in found.iter_mut().zip(prefixes) {
            if let Some(pid) = line
                .strip_prefix(prefix)
                .and_then(|p| p.trim().parse().ok())
            {
                *slot = Some(pid);
            }
        }
    }
    found.into_iter().map(Option::unwrap).collect()
}

/// `cmd` (its program, arguments and environment) run as user and group `uid` by setpriv,
/// with no supplementary groups.
pub fn as_user(uid: u32, cmd: &Command) -> Command {
    let mut wrapped = Command::new("setpriv");
    wrapped
        .arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .args(["--clear-groups", "--"])
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (key, value) in cmd.get_envs() {
        match value {
            Some(v) => wrapped.env(key, v),
            None => wrapped.env_remove(key),
        };
    }
    wrapped
}

/// Run to completion and collect.
pub fn run(cmd: Command) -> Finished {
    Proc::spawn(cmd).finish()
}

/// True while any process is in process group `pgid` (zombies included).
pub fn group_alive(pgid: i32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(-pgid), None).is_ok()
}

/// Wait until process `pid` has exited (zombie or reaped), through a pidfd: the kernel tells
/// us, no polling. Returns false if it is still running after [`PATIENCE`].
pub fn wait_exited(pid: i32) -> bool {
    use nix::libc;
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    }
    // SAFETY: the descriptor was just returned to us and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut fds = [nix::poll::PollFd::new(
        fd.as_fd(),
        nix::poll::PollFlags::POLLIN,
    )];
    let timeout = nix::poll::PollTimeout::try_from(PATIENCE).unwrap();
    matches!(nix::poll::poll(&mut fds, timeout), Ok(n) if n > 0)
}

/// Wait until `path` is removed (it or a directory above it), through inotify: the kernel tells
/// us, no polling. True at once when it is already gone; false if it is still there after
/// [`PATIENCE`].
pub fn wait_removed(path: &Path) -> bool {
    use inotify::{Inotify, WatchMask};
    use std::os::fd::AsFd;
    let mut inotify = Inotify::init().unwrap();
    // Watch the path itself: its removal (or a move out of the way) is the event. A path that
    // is gone before the watch is set is gone.
    if inotify
        .watches()
        .add(path, WatchMask::DELETE_SELF | WatchMask::MOVE_SELF)
        .is_err()
    {
        return !path.exists();
    }
    let deadline = Instant::now() + PATIENCE;
    let mut buf = [0u8; 4096];
    loop {
        // A removal between the watch and this look left an event in the queue too.
        if std::fs::symlink_metadata(path).is_err() {
            return true;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        let mut fds = [nix::poll::PollFd::new(
            inotify.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let timeout = nix::poll::PollTimeout::try_from(left).unwrap();
        match nix::poll::poll(&mut fds, timeout) {
            Ok(n) if n > 0 => {
                let _ = inotify.read_events(&mut buf);
            }
            Ok(_) => return !path.exists(),
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => panic!("poll on inotify: {e}"),
        }
    }
}

/// True while process `pid` is running (a zombie waiting for its reaper is dead).
pub fn process_alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let (_, tail) = stat.rsplit_once(')')?;
            tail.split_whitespace().next().map(|s| s != "Z" && s != "X")
        })
        .unwrap_or(false)
}

/// Every pid in the cgroup at `dir` and below (none once it is gone).
pub fn cgroup_members(dir: &Path) -> Vec<i32> {
    let mut pids: Vec<i32> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            pids.extend(cgroup_members(&entry.path()));
        }
    }
    pids
}

/// SIGKILL a supervisor together with its dead-man (its fence, stopped first so that it never
/// acts): what a whole machine's crash or the OOM killer taking both would leave, for the tests
/// of the second nets (the next holder of a lock, the janitor).
pub fn kill_supervisor_and_its_dead_man(supervisor: i32) {
    use nix::sys::signal::Signal;
    let fences = fences_of(supervisor);
    for fence in &fences {
        signal(*fence, Signal::SIGSTOP);
    }
    signal(supervisor, Signal::SIGKILL);
    assert!(wait_exited(supervisor));
    for fence in &fences {
        signal(*fence, Signal::SIGKILL);
        assert!(wait_exited(*fence));
    }
}

/// Whether process `pid` is a fence: started as its own program with the tag as its first
/// argument (so from its exec on), or forked at its supervisor's start; either names itself
/// `ccci-run-fence` as it begins.
pub fn is_fence(pid: i32) -> bool {
    let tagged = std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| c.split(|b| *b == 0).nth(1) == Some(b"__ccci-run-fence".as_slice()));
    tagged
        || std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .is_ok_and(|c| c.trim_end() == "ccci-run-fence")
}

/// The fences (dead-men) below `supervisor` (the supervisor's pid, or a wrapper's that started
/// it: `unshare`): its descendants that are fences ([`is_fence`]). Every caller's supervisor has
/// one; a forked fence is known by its name only once it has named itself, for which the kernel
/// gives no event: looked for again until one is found, for up to [`PATIENCE`].
pub fn fences_of(supervisor: i32) -> Vec<i32> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let found = fences_below(supervisor);
        if !found.is_empty() || Instant::now() >= deadline {
            return found;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn fences_below(supervisor: i32) -> Vec<i32> {
    let ppid_of = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                let (_, tail) = s.rsplit_once(')')?;
                tail.split_whitespace().nth(1)?.parse::<i32>().ok()
            })
    };
    let below = |mut pid: i32| {
        for _ in 0..4 {
            match ppid_of(pid) {
                Some(p) if p == supervisor => return true,
                Some(p) if p > 1 => pid = p,
                _ => return false,
            }
        }
        false
    };
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let tagged = is_fence(pid);
        if tagged && below(pid) {
            found.push(pid);
        }
    }
    found
}

/// A process of its own (not of any run) that leads a process group whose id is `pid`: made by
/// steering the kernel's next pid (`ns_last_pid`, root only) until a fork gets that pid, which
/// then calls `setsid`. What an unrelated process does that happens to get a dead group's id.
/// `None` when another process took the pid every time.
pub struct GroupLeader {
    pub pid: i32,
    pub start: String,
}

impl GroupLeader {
    pub fn take(pid: i32) -> Option<Self> {
        const TAKE: &str = r#"
import os, sys
n = int(sys.argv[1])
for _ in range(5000):
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(n - 1))
    child = os.fork()
    if child == 0:
        if os.getpid() == n:
            os.setsid()
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.execvp("sleep", ["sleep", "100000"])
        os._exit(0)
    if child == n:
        while True:
            with open(f"/proc/{n}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[2] == str(n):
                break
        print(n, flush=True)
        sys.exit(0)
    os.waitpid(child, 0)
sys.exit(1)
"#;
        let out = Command::new("python3")
            .args(["-c", TAKE, &pid.to_string()])
            .env_remove("CCCI_SUPERVISOR")
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .unwrap();
        if !out.status.success() {
            return None;
        }
        Some(Self {
            pid,
            start: start_time(pid)?,
        })
    }

    /// Still that very process, running.
    pub fn alive(&self) -> bool {
        process_alive(self.pid) && start_time(self.pid).as_deref() == Some(&*self.start)
    }
}

impl Drop for GroupLeader {
    fn drop(&mut self) {
        if self.alive() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Field 22 of `/proc/<pid>/stat`, the start time.
pub fn start_time(pid: i32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(19)
        .map(str::to_owned)
}

/// Whether one of `holder`'s descriptors is `/proc/<pid>` (what a `/proc` directory held to
/// act on that process later looks like).
pub fn holds_proc_dir(holder: i32, pid: i32) -> bool {
    let want = PathBuf::from(format!("/proc/{pid}"));
    std::fs::read_dir(format!("/proc/{holder}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == want))
}

pub fn signal(pid: i32, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal).unwrap();
}

pub fn sh_quote(path: impl AsRef<OsStr>) -> String {
    format!(
        "'{}'",
        path.as_ref().to_string_lossy().replace('\'', r"'\''")
    )
}

/// A cgroup v2 directory of the test's own, standing in for a systemd unit: processes are
/// placed in it at spawn, and it can be signalled or killed as a whole. Removed on drop.
pub struct TestCgroup {
    dir: PathBuf,
}

impl TestCgroup {
    /// `None` (with a message) where cgroup v2 is not writable; in CI that is a failure.
    pub fn create(name: &str) -> Option<Self> {
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let made = (|| {
            let mount = cgroup2_mount()?;
            let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
            let own = own.lines().find_map(|l| l.strip_prefix("0::"))?.to_owned();
            let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let dir = mount
                .join(own.trim_start_matches('/'))
                .join(format!("test-{name}-{}-{n}", std::process::id()));
            std::fs::create_dir(&dir).ok()?;
            Some(Self { dir })
        })();
        if made.is_none() {
            skip(
                "cgroup v2 is not writable here",
                "run the suite as root on a host with the unified cgroup v2 hierarchy",
            );
        }
        made
    }

    /// Start `cmd` inside this cgroup.
    pub fn place(&self, cmd: &mut Command) {
        use std::os::unix::process::CommandExt;
        let procs = std::fs::OpenOptions::new()
            .write(true)
            .open(self.dir.join("cgroup.procs"))
            .unwrap();
        let fd = std::os::fd::IntoRawFd::into_raw_fd(procs);
        // SAFETY: one write(2) of a static buffer between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if nix::libc::write(fd, b"0".as_ptr().cast(), 1) == 1 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }

    fn members(dir: &Path, pids: &mut Vec<i32>) {
        if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            pids.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
        }
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                Self::members(&entry.path(), pids);
            }
        }
    }

    /// Send `sig` to every process in the cgroup and below, as systemd does on stop.
    pub fn signal_all(&self, sig: nix::sys::signal::Signal) {
        let mut pids = Vec::new();
        Self::members(&self.dir, &mut pids);
        for pid in pids {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig);
        }
    }

    fn populated(&self) -> bool {
        std::fs::read_to_string(self.dir.join("cgroup.events"))
            .map(|t| t.lines().any(|l| l == "populated 1"))
            .unwrap_or(false)
    }

    /// Wait (on `cgroup.events` change notifications) until no process is left, at most `limit`.
    pub fn wait_empty(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let events = std::fs::File::open(self.dir.join("cgroup.events")).unwrap();
        while self.populated() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            let mut fds = [nix::poll::PollFd::new(
                std::os::fd::AsFd::as_fd(&events),
                nix::poll::PollFlags::POLLPRI,
            )];
            let wait = left.min(Duration::from_millis(100));
            let _ = nix::poll::poll(
                &mut fds,
                nix::poll::PollTimeout::try_from(wait).unwrap_or(nix::poll::PollTimeout::MAX),
            );
        }
        true
    }

    /// SIGKILL everything in it.
    pub fn kill(&self) {
        let _ = std::fs::write(self.dir.join("cgroup.kill"), "1");
        self.wait_empty(PATIENCE);
    }

    fn remove(dir: &Path) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                Self::remove(&entry.path());
            }
        }
        let _ = std::fs::remove_dir(dir);
    }
}

/// Where the unified (cgroup v2) hierarchy is mounted, if it is.
fn cgroup2_mount() -> Option<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo.lines().find_map(|l| {
        let (head, tail) = l.split_once(" - ")?;
        (tail.split_whitespace().next()? == "cgroup2")
            .then(|| head.split_whitespace().nth(4).map(PathBuf::from))?
    })
}

/// The cgroups ccci-run made for the configuration whose runs dir is `runs` (their names end
/// with `-c<dev>.<ino>` of that directory), anywhere in the unified hierarchy.
fn cgroups_of_runs_dir(runs: &Path) -> Vec<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    fn walk(dir: &Path, suffix: &str, depth: usize, found: &mut Vec<PathBuf>) {
        if depth > 8 {
            return;
        }
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("ccci-") {
                if name.ends_with(suffix) {
                    found.push(entry.path());
                }
            } else {
                walk(&entry.path(), suffix, depth + 1, found);
            }
        }
    }
    let (Ok(meta), Some(mount)) = (std::fs::metadata(runs), cgroup2_mount()) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    walk(
        &mount,
        &format!("-c{}.{}", meta.dev(), meta.ino()),
        0,
        &mut found,
    );
    found
}

/// A sandbox goes with what its runs left in the cgroup hierarchy (a supervisor killed by a
/// test leaves its cgroup for a janitor that will never come): its runs dir's inode is free for
/// the next sandbox once the directory is gone, and that sandbox's janitor must not find
/// another test's cgroups as its own.
impl Drop for Sandbox {
    fn drop(&mut self) {
        for dir in cgroups_of_runs_dir(&self.runs()) {
            drop(TestCgroup { dir });
        }
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        self.kill();
        Self::remove(&self.dir);
    }
}
