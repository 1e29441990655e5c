//! The shipped janitor unit under a real systemd: a minimal Debian root (scripts/systemd-root.sh)
//! booted with systemd-nspawn, the binary, the shipped unit and timer, the configuration file,
//! tmpfiles lines and a `drone` user installed into it, the janitor started with `systemctl` and
//! judged by its unit's result, its journal and what it left on disk. Each case with the runner
//! as its own user (`drone`, the unit's `User=drone`, `runner_user = "drone"`) and as root.
//!
//! What a container cannot show (docs/operations.md): `/run` stays writable under
//! `ProtectSystem=strict` there, so a lock dir missing from `ReadWritePaths=` would pass;
//! `shipping::the_janitor_unit_can_write_every_directory_of_the_shipped_configuration` checks
//! that on the files instead.
//!
//! Needs root, systemd-nspawn and a root tarball (`CCCI_SYSTEMD_ROOT`, made by
//! scripts/systemd-root.sh); `.ci/run` provides all three.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use crate::util::BIN;

/// Where the run's lock files live: a directory of the runner's own, made at boot by a tmpfiles
/// line (or, when that line is missing, by the first ccci-run that needs it).
const LOCK_DIR: &str = "/run/ccci-run";
const RUNS_DIR: &str = "/var/lib/cc-ci-runs";
const METRICS: &str = "/var/lib/prometheus/node-exporter/ccci-run.prom";
const PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Who the runner is on the host under test.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Runner {
    Drone,
    Root,
}

impl Runner {
    fn user(self) -> &'static str {
        match self {
            Self::Drone => "drone",
            Self::Root => "root",
        }
    }

    fn abra_home(self) -> &'static str {
        match self {
            Self::Drone => "/var/lib/drone/.abra",
            Self::Root => "/root/.abra",
        }
    }
}

/// The root tarball, or None (and a skip said why) when nspawn cannot run here.
fn root_tarball() -> Option<PathBuf> {
    if !nix::unistd::Uid::effective().is_root() {
        crate::util::skip("needs root", "run the suite as root to boot a container");
        return None;
    }
    if Command::new("systemd-nspawn")
        .arg("--version")
        .output()
        .is_err()
    {
        crate::util::skip(
            "systemd-nspawn cannot run here: it is not installed",
            "install systemd-container of the host's systemd version (.ci/run does)",
        );
        return None;
    }
    if !Path::new("/sys/fs/cgroup/unified/cgroup.procs").exists()
        && !Path::new("/sys/fs/cgroup/cgroup.procs").exists()
    {
        crate::util::skip(
            "systemd-nspawn cannot run here: no cgroup v2 hierarchy",
            "boot with a unified or hybrid cgroup hierarchy",
        );
        return None;
    }
    match std::env::var_os("CCCI_SYSTEMD_ROOT").map(PathBuf::from) {
        Some(path) if path.is_file() => Some(path),
        Some(path) => panic!(
            "CCCI_SYSTEMD_ROOT={} is no file: scripts/systemd-root.sh makes it",
            path.display()
        ),
        None => {
            crate::util::skip(
                "systemd-nspawn cannot run here: CCCI_SYSTEMD_ROOT names no root tarball",
                "make one with scripts/systemd-root.sh TARBALL and export CCCI_SYSTEMD_ROOT=TARBALL",
            );
            None
        }
    }
}

fn succeeds(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {:?}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// A host's root directory, made from the tarball, with ccci-run installed as docs/operations.md
/// says (the shipped unit and timer, the shipped configuration file with this host's paths).
struct Root {
    _dir: tempfile::TempDir,
    path: PathBuf,
    runner: Runner,
}

impl Root {
    fn new(tarball: &Path, runner: Runner) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("ccci-systemd-host-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let path = dir.path().join("root");
        std::fs::create_dir(&path).unwrap();
        succeeds(
            Command::new("tar")
                .arg("--zstd")
                .arg("-C")
                .arg(&path)
                .arg("-xf")
                .arg(tarball),
        );
        let root = Self {
            _dir: dir,
            path,
            runner,
        };
        root.install();
        root
    }

    fn at(&self, inside: &str) -> PathBuf {
        self.path.join(inside.trim_start_matches('/'))
    }

    fn install(&self) {
        let bin = self.at("/usr/local/bin/ccci-run");
        std::fs::create_dir_all(bin.parent().unwrap()).unwrap();
        std::fs::copy(BIN, &bin).unwrap();
        for unit in ["ccci-run-janitor.service", "ccci-run-janitor.timer"] {
            std::fs::copy(
                repo().join("systemd").join(unit),
                self.at("/etc/systemd/system").join(unit),
            )
            .unwrap();
        }
        let user = self.runner.user();
        if self.runner == Runner::Drone {
            succeeds(
                Command::new("useradd")
                    .arg("--root")
                    .arg(&self.path)
                    .args(["--system", "--user-group", "--home-dir", "/var/lib/drone"])
                    .args(["--shell", "/usr/sbin/nologin", "drone"]),
            );
        }
        // The shipped configuration file, with this host's paths and no Docker (the Docker side
        // of a reap is the Docker tests'; here the unit's confinement is judged).
        let shipped = std::fs::read_to_string(repo().join("systemd/config.toml")).unwrap();
        let mut config = String::new();
        for line in shipped.lines() {
            let line = match line.split_once(" = ").map(|(k, _)| k.trim()) {
                Some("lock_dir") => format!("lock_dir = \"{LOCK_DIR}\""),
                Some("abra_home") => format!("abra_home = \"{}\"", self.runner.abra_home()),
                Some("docker") => "docker = \"off\"".to_owned(),
                Some("#   runner_user") if self.runner == Runner::Drone => {
                    "runner_user = \"drone\"".to_owned()
                }
                _ => line.to_owned(),
            };
            config.push_str(&line);
            config.push('\n');
        }
        // A dead run's leftovers with cgroups off: only the environment scan finds them.
        config.push_str("cgroup = \"off\"\n");
        write(&self.at("/etc/ccci-run/config.toml"), &config);
        // The directories the runner works in, as the NixOS module's tmpfiles lines make them.
        let group = user;
        let abra = self.runner.abra_home();
        write(
            &self.at("/etc/tmpfiles.d/ccci-run.conf"),
            &format!(
                "d {RUNS_DIR} 0755 {user} {group} -\n\
                 d /var/lib/ccci-run/state 0700 {user} {group} -\n\
                 d /var/lib/prometheus/node-exporter 0755 {user} {group} -\n\
                 d {abra} 0700 {user} {group} -\n\
                 d {abra}/servers 0755 {user} {group} -\n\
                 d {abra}/servers/ci 0755 {user} {group} -\n"
            ),
        );
        self.lock_dir_line(true);
        // What an operator adds to the shipped unit for these paths (its ReadWritePaths must
        // name them), and for a runner of its own user, the user.
        let mut drop_in = format!("[Service]\nReadWritePaths=-{LOCK_DIR} -{abra}\n");
        if self.runner == Runner::Drone {
            drop_in.push_str("User=drone\n");
        }
        write(
            &self.at("/etc/systemd/system/ccci-run-janitor.service.d/host.conf"),
            &drop_in,
        );
    }

    /// Whether a tmpfiles line makes the lock dir at boot.
    fn lock_dir_line(&self, present: bool) {
        let path = self.at("/etc/tmpfiles.d/ccci-run-locks.conf");
        if present {
            let user = self.runner.user();
            write(&path, &format!("d {LOCK_DIR} 0755 {user} {user} -\n"));
        } else {
            let _ = std::fs::remove_file(path);
        }
    }

    fn boot(&self) -> Host {
        Host::boot(self)
    }
}

/// A booted container.
struct Host {
    nspawn: Child,
    init: i32,
    cgroup: PathBuf,
}

impl Host {
    fn boot(root: &Root) -> Self {
        let base = if Path::new("/sys/fs/cgroup/unified/cgroup.procs").exists() {
            PathBuf::from("/sys/fs/cgroup/unified")
        } else {
            PathBuf::from("/sys/fs/cgroup")
        };
        let cgroup = base.join(format!(
            "ccci-systemd-host-{}-{}",
            std::process::id(),
            root.path.display().to_string().len() + rand_suffix()
        ));
        std::fs::create_dir(&cgroup).unwrap();
        let procs = cgroup.join("cgroup.procs");
        let mut cmd = Command::new("systemd-nspawn");
        cmd.env("SYSTEMD_NSPAWN_UNIFIED_HIERARCHY", "1")
            .arg("-D")
            .arg(&root.path)
            .args([
                "--boot",
                "--register=no",
                "--keep-unit",
                "--console=read-only",
                "--capability=CAP_BPF,CAP_NET_ADMIN,CAP_PERFMON",
                "--system-call-filter=bpf",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // From a cgroup of its own: nspawn makes its payload's below the one it starts in.
        unsafe {
            cmd.pre_exec(move || {
                std::fs::write(&procs, b"0")?;
                Ok(())
            });
        }
        let nspawn = cmd.spawn().unwrap();
        // Its one child is the container's PID 1: wait for it, then for systemd to say the
        // boot is done (`is-system-running --wait` waits for that itself).
        let children = format!("/proc/{0}/task/{0}/children", nspawn.id());
        let started = std::time::Instant::now();
        // The child nspawn forks first is a helper; the container's PID 1 is the child in a
        // pid namespace of its own.
        let ours = std::fs::read_link("/proc/self/ns/pid").unwrap();
        let init = loop {
            let text = std::fs::read_to_string(&children).unwrap_or_default();
            let init = text.split_whitespace().find_map(|pid| {
                let ns = std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok()?;
                (ns != ours).then(|| pid.parse::<i32>().ok()).flatten()
            });
            if let Some(pid) = init {
                break pid;
            }
            assert!(
                started.elapsed() < std::time::Duration::from_secs(30),
                "systemd-nspawn started no container"
            );
            std::thread::yield_now();
        };
        let mut host = Self {
            nspawn,
            init,
            cgroup,
        };
        // Until PID 1 is systemd and answers (nsenter fails while the namespaces are made).
        let state = loop {
            // `offline`: the manager's socket is not up yet.
            let out = host.sh("systemctl is-system-running --wait");
            let said = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            if !said.is_empty() && said != "offline" {
                break said;
            }
            assert!(
                started.elapsed() < std::time::Duration::from_secs(60),
                "the container's systemd never answered: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            if let Ok(Some(status)) = host.nspawn.try_wait() {
                panic!("systemd-nspawn exited: {status}");
            }
        };
        let failed = host.sh("systemctl --failed --no-legend --plain");
        assert_eq!(
            state,
            "running",
            "the container did not boot clean: {}",
            String::from_utf8_lossy(&failed.stdout)
        );
        host
    }

    /// `script` by `sh` in the container, as root, with a clean environment.
    fn sh(&self, script: &str) -> Output {
        Command::new("nsenter")
            .arg("-t")
            .arg(self.init.to_string())
            .args(["-a", "env", "-i", PATH, "HOME=/root", "sh", "-c", script])
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// [`Host::sh`] that must succeed; its stdout.
    #[track_caller]
    fn ok(&self, script: &str) -> String {
        let out = self.sh(script);
        assert!(
            out.status.success(),
            "{script}: {:?}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `script` as the runner's user, as a Drone step runs.
    fn as_runner(runner: Runner, script: &str) -> String {
        match runner {
            Runner::Root => script.to_owned(),
            Runner::Drone => format!(
                "cd / && setpriv --reuid drone --regid drone --init-groups env HOME=/var/lib/drone sh -c '{}'",
                script.replace('\'', "'\\''")
            ),
        }
    }

    /// Start the janitor's unit and wait for it (a oneshot): its result and its journal.
    fn janitor(&self) -> (String, String) {
        let _ = self.sh("systemctl start ccci-run-janitor.service");
        let result = self.ok("systemctl show -P Result ccci-run-janitor.service");
        let journal = self.ok("journalctl -b -o cat --no-pager -u ccci-run-janitor.service");
        (result.trim().to_owned(), journal)
    }

    fn poweroff(mut self) {
        let _ = self.sh("systemctl poweroff");
        let status = self.nspawn.wait().unwrap();
        assert!(status.success(), "systemd-nspawn: {status}");
        remove_cgroup(&self.cgroup);
        self.init = 0;
    }
}

impl Drop for Host {
    /// A test that failed half-way: everything of the container ends with its cgroup (a
    /// SIGKILL of nspawn alone would leave the container running), then the cgroups go.
    fn drop(&mut self) {
        if self.init != 0 {
            let _ = std::fs::write(self.cgroup.join("cgroup.kill"), b"1");
            let _ = self.nspawn.kill();
            let _ = self.nspawn.wait();
            let started = std::time::Instant::now();
            while std::fs::read_to_string(self.cgroup.join("cgroup.events"))
                .is_ok_and(|e| e.contains("populated 1"))
                && started.elapsed() < std::time::Duration::from_secs(10)
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            remove_cgroup(&self.cgroup);
        }
    }
}

fn rand_suffix() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Remove the container's cgroups (payload/, supervisor/ and below), deepest first.
fn remove_cgroup(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup(&entry.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// A run of `recipe`'s PR `pr` as the runner, in the container: its command writes the app's
/// `.env` and leaves a daemon of its own session; then its supervisor and its dead-man are
/// SIGKILLed together (the dead-man stopped first), so the daemon is the janitor's to clear.
/// The daemon's pid.
fn dead_run(host: &Host, runner: Runner, run_id: &str, pr: &str) -> i32 {
    let abra = runner.abra_home();
    let script = format!(
        "ccci-run run --recipe custom-html --pr {pr} --run-id {run_id} --no-fetch -- sh -c \
         \"echo x > {abra}/servers/ci/\\$CCCI_APP_DOMAIN.env; setsid sleep 1000 </dev/null >/dev/null 2>&1 & \
         echo daemon \\$!; exec sleep 1000\" > /tmp/{run_id}.out 2>&1 & \
         for i in $(seq 600); do grep -q daemon /tmp/{run_id}.out && break; sleep 0.05; done; \
         s=$(cat {RUNS_DIR}/{run_id}/run.json | sed -n 's/.*\"pid\": \\([0-9]*\\).*/\\1/p' | head -n 1); \
         f=$(pgrep -x ccci-run-fence); kill -STOP $f; kill -KILL $s; kill -KILL $f; \
         sed -n 's/^daemon //p' /tmp/{run_id}.out"
    );
    let out = host.ok(&Host::as_runner(runner, &script));
    out.trim()
        .parse()
        .unwrap_or_else(|_| panic!("no daemon pid: {out:?}"))
}

fn alive(host: &Host, pid: i32) -> bool {
    host.sh(&format!("kill -0 {pid}")).status.success()
}

/// Every entry under `dirs` (in the container) not owned by the runner.
fn not_the_runners(host: &Host, runner: Runner, dirs: &[&str]) -> String {
    let user = runner.user();
    host.ok(&format!(
        "for d in {}; do [ -e \"$d\" ] && find \"$d\" ! -user {user}; done; true",
        dirs.join(" ")
    ))
}

fn the_shipped_janitor_unit_under_systemd(runner: Runner) {
    let Some(tarball) = root_tarball() else {
        return;
    };
    let root = Root::new(&tarball, runner);
    let abra = runner.abra_home();
    let work_dirs = [LOCK_DIR, RUNS_DIR, "/var/lib/ccci-run/state", abra];

    // Boot 1: runs of the runner, a dead one with a daemon left (cgroups off), root operators.
    let host = root.boot();
    host.ok(&Host::as_runner(
        runner,
        "ccci-run run --recipe custom-html --run-id f1 --no-fetch -- true",
    ));
    let daemon = dead_run(&host, runner, "d1", "1");
    assert!(alive(&host, daemon));
    // A root operator's dry run: exit 0 (nothing failed), nothing changed, nothing made.
    let dry = host.sh("ccci-run janitor --dry-run --json");
    assert!(
        dry.status.success(),
        "{}",
        String::from_utf8_lossy(&dry.stderr)
    );
    assert!(String::from_utf8_lossy(&dry.stdout).contains("would-reap"));
    assert!(alive(&host, daemon), "a dry run killed the daemon");
    // A named lock taken first by root, then by the runner.
    host.ok("ccci-run lock shared -- true");
    host.ok(&Host::as_runner(runner, "ccci-run lock shared -- true"));
    assert_eq!(not_the_runners(&host, runner, &work_dirs), "");
    let record_before = host.ok(&format!("stat -c '%U %a' {RUNS_DIR}/d1/run.json"));
    // The janitor, as systemd starts it: the daemon killed, the app reaped, the sweep a success.
    let (result, journal) = host.janitor();
    assert_eq!(result, "success", "{journal}");
    assert!(
        !alive(&host, daemon),
        "the dead run's daemon outlived the janitor\n{journal}"
    );
    let env_left = host.ok(&format!("ls {abra}/servers/ci"));
    assert_eq!(env_left.trim(), "", "{journal}");
    let metrics = host.ok(&format!("cat {METRICS}"));
    assert!(metrics.contains("ccci_janitor_sweep_failed 0"), "{metrics}");
    // The dead run's record keeps its owner and mode; the runner's own runs reads it.
    let record = host.ok(&format!("stat -c '%U %a' {RUNS_DIR}/d1/run.json"));
    assert_eq!(
        record, record_before,
        "the janitor changed the record's owner or mode"
    );
    assert!(
        host.ok(&format!("cat {RUNS_DIR}/d1/run.json"))
            .contains("\"reaped\": \""),
        "the janitor noted nothing in the record"
    );
    assert_eq!(record.split_whitespace().next(), Some(runner.user()));
    let runs = host.ok(&Host::as_runner(runner, "ccci-run runs --all --json"));
    assert!(runs.contains("\"d1\""), "{runs}");
    // Retention, once the finished run is old; a second dead run left for the reboot.
    host.ok(&format!("touch -d '15 days ago' {RUNS_DIR}/f1/run.json"));
    let daemon2 = dead_run(&host, runner, "d2", "2");
    assert!(alive(&host, daemon2));
    host.poweroff();

    // Boot 2, a reboot: the lock dir emptied (a tmpfs), the dead run's .env left.
    let host = root.boot();
    assert_eq!(host.ok(&format!("ls -A {LOCK_DIR}")).trim(), "");
    let (result, journal) = host.janitor();
    assert_eq!(result, "success", "{journal}");
    assert_eq!(
        host.ok(&format!("ls {abra}/servers/ci")).trim(),
        "",
        "{journal}"
    );
    assert_eq!(
        host.ok(&format!("ls {RUNS_DIR}"))
            .split_whitespace()
            .collect::<Vec<_>>(),
        vec!["d1", "d2"],
        "the finished run outlived --keep-runs 14d\n{journal}"
    );
    host.ok(&Host::as_runner(
        runner,
        "ccci-run run --recipe custom-html --pr 2 --run-id n2 --no-fetch -- true",
    ));
    assert_eq!(not_the_runners(&host, runner, &work_dirs), "");
    host.poweroff();

    // Boot 3: no line makes the lock dir. Root makes it (its parent /run is root's); a runner of
    // its own user cannot, and the janitor fails saying so, leaving nothing of root's; the
    // tmpfiles line (what the module writes) mends it.
    root.lock_dir_line(false);
    let host = root.boot();
    assert!(!host.sh(&format!("test -e {LOCK_DIR}")).status.success());
    let (mut result, mut journal) = host.janitor();
    if runner == Runner::Drone {
        assert_eq!(result, "exit-code", "{journal}");
        assert!(
            journal.contains(&format!(
                "refusing lock directory {LOCK_DIR}: cannot create it"
            )),
            "{journal}"
        );
        assert!(!host.sh(&format!("test -e {LOCK_DIR}")).status.success());
        root.lock_dir_line(true);
        host.ok("systemd-tmpfiles --create /etc/tmpfiles.d/ccci-run-locks.conf");
        (result, journal) = host.janitor();
    }
    assert_eq!(result, "success", "{journal}");
    let owner = host.ok(&format!("stat -c %U {LOCK_DIR}"));
    assert_eq!(owner.trim(), runner.user(), "{journal}");
    host.ok(&Host::as_runner(
        runner,
        "ccci-run run --recipe custom-html --pr 3 --run-id n3 --no-fetch -- true",
    ));
    assert_eq!(not_the_runners(&host, runner, &work_dirs), "");

    // A lock file the janitor cannot open (root's, 0600, as an older version left them): the
    // unit fails, and its metrics say so.
    if runner == Runner::Drone {
        host.ok(&format!(
            "echo x > {abra}/servers/ci/cust-000000.ci.commoninternet.net.env && \
             chown drone: {abra}/servers/ci/cust-000000.ci.commoninternet.net.env && \
             : > {LOCK_DIR}/cc-ci-app-cust-000000.ci.commoninternet.net.lock && \
             chmod 600 {LOCK_DIR}/cc-ci-app-cust-000000.ci.commoninternet.net.lock"
        ));
        let (result, journal) = host.janitor();
        assert_eq!(result, "exit-code", "{journal}");
        let metrics = host.ok(&format!("cat {METRICS}"));
        assert!(metrics.contains("ccci_janitor_sweep_failed 1"), "{metrics}");
    }
    host.poweroff();
}

#[test]
fn the_shipped_janitor_unit_works_for_a_runner_of_its_own_user() {
    the_shipped_janitor_unit_under_systemd(Runner::Drone);
}

#[test]
fn the_shipped_janitor_unit_works_for_a_runner_as_root() {
    the_shipped_janitor_unit_under_systemd(Runner::Root);
}
