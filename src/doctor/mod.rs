//! `ccci-run doctor`: whether this host can run recipe CI as configured, one check a line.
//!
//! Each check ends in one of four states: `ok`; `warn` (runs work, but less well than they
//! could: a fallback is in use, or a limit is near); `fail` (a run, a lock or a sweep will not
//! work as configured: exit 1); `skip` (the check cannot be made here — no systemd, Docker or
//! etcd not in use — and says why and how to make it). Every check is always listed, whatever
//! came before it: a bad configuration file fails its check and the rest run on the settings
//! without it.
//!
//! Invariant: doctor changes nothing it does not undo before it returns (a probe cgroup, a
//! probe lease), never panics, and never hangs: each Docker, etcd and systemd question is
//! asked within a bound.
//!
//! Floor: commands (docs/architecture.md): imports the floors below, never another command.

mod unit;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use crate::config::{self, CgroupMode, DockerMode, Global, Inputs, Timing};

/// The runner unit named when `--unit` is not given (the unit `systemd/` ships a drop-in for).
pub(crate) const DEFAULT_UNIT: &str = "drone-runner-exec.service";
/// How long any one Docker request may take.
const DOCKER_TIMEOUT: Duration = Duration::from_secs(5);

/// How long doctor's node sweep may take: a job's task on each node, its image already there.
const NODE_SWEEP_TIMEOUT: Duration = Duration::from_secs(10);
/// The oldest Docker API the Docker seam speaks (Docker 20.10).
const MIN_DOCKER_API: (u32, u32) = (1, 41);
/// The programs a step runs, which must be on the `PATH` it sees.
const STEP_PROGRAMS: [&str; 4] = ["ccci-run", "abra", "git", "setsid"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum State {
    Ok,
    Warn,
    Fail,
    Skip,
}

impl State {
    fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Warn => "warn",
            Self::Fail => "fail",
            Self::Skip => "skip",
        }
    }
}

/// One check's line.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Check {
    pub name: String,
    pub state: State,
    pub detail: String,
    /// What to do about it (for `warn`, `fail` and `skip`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

fn check(name: impl Into<String>, state: State, detail: impl Into<String>) -> Check {
    Check {
        name: name.into(),
        state,
        detail: detail.into(),
        fix: None,
    }
}

impl Check {
    fn fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }
}

/// Every check, in order; `--json` prints it as is.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    /// False when any check failed (exit 1).
    pub ok: bool,
    pub checks: Vec<Check>,
}

/// What `doctor` is told beyond the global settings.
#[derive(Debug, Clone, Default)]
pub(crate) struct Options {
    /// The runner's systemd unit, asked of systemd.
    pub unit: Option<String>,
    /// The runner's unit file (with its `<file>.d/*.conf` drop-ins), read instead.
    pub unit_file: Option<PathBuf>,
}

/// Run every check.
pub(crate) fn run(inputs: &Inputs, opts: &Options) -> Report {
    let mut checks = Vec::new();
    let global = settings(inputs, &mut checks);
    for (dir, key, missing) in [
        (&global.lock_dir, "lock_dir", State::Warn),
        (&global.runs_dir, "runs_dir", State::Warn),
        (&global.state_dir, "state_dir", State::Warn),
        (&global.abra_home, "abra_home", State::Fail),
    ] {
        checks.push(directory(dir, key, missing));
    }
    checks.push(lock_dir_tmpfs(&global.lock_dir));
    checks.push(cgroups(global.cgroup));
    let unit = runner_unit(opts);
    checks.extend(unit_checks(&unit, &global));
    checks.extend(docker(&global));
    checks.extend(etcd(&global));
    checks.extend(inotify(&global.lock_dir));
    checks.extend(step_path(&unit));
    Report {
        ok: checks.iter().all(|c| c.state != State::Fail),
        checks,
    }
}

/// The text report: one line per check, its fix after it.
pub(crate) fn render(report: &Report) -> String {
    let mut out = String::new();
    for c in &report.checks {
        out.push_str(&format!(
            "{:<4}  {:<24} {}",
            c.state.as_str(),
            c.name,
            c.detail
        ));
        if let Some(fix) = &c.fix {
            out.push_str(&format!(" — fix: {fix}"));
        }
        out.push('\n');
    }
    let count = |s: State| report.checks.iter().filter(|c| c.state == s).count();
    out.push_str(&format!(
        "{} ok, {} warn, {} fail, {} skip\n",
        count(State::Ok),
        count(State::Warn),
        count(State::Fail),
        count(State::Skip)
    ));
    out
}

/// The configuration file's check, and the settings the other checks use: the configured ones,
/// or (when the file or a setting is refused) those without what was refused.
fn settings(inputs: &Inputs, checks: &mut Vec<Check>) -> Global {
    let (path, named) = match &inputs.config {
        Some(path) => (path.clone(), true),
        None => (PathBuf::from(config::DEFAULT_FILE), false),
    };
    let file_ok = match crate::config_file::read(&path, named) {
        Ok(None) => {
            checks.push(
                check(
                    "config-file",
                    State::Warn,
                    format!("no configuration file at {}", path.display()),
                )
                .fix(format!(
                    "write {} (see systemd/config.toml): the Drone step, the janitor's timer and \
                     an operator's shell then share one set of paths",
                    path.display()
                )),
            );
            true
        }
        Ok(Some(text)) => match config::parse(&text, &path) {
            Ok(_) => {
                checks.push(check(
                    "config-file",
                    State::Ok,
                    format!("{}: owned and mode-safe, parses", path.display()),
                ));
                true
            }
            Err(err) => {
                checks.push(
                    check("config-file", State::Fail, err.to_string()).fix(format!(
                        "correct {}; the checks below use the settings without it",
                        path.display()
                    )),
                );
                false
            }
        },
        Err(err) => {
            checks.push(check("config-file", State::Fail, err.to_string()).fix(
                "chown root (or the runner's user) and chmod go-w the file and its directory; \
                 the checks below use the settings without it",
            ));
            false
        }
    };
    let without_file = Inputs {
        config: Some(PathBuf::from("/dev/null")),
        ..inputs.clone()
    };
    let resolved = match config::resolve(if file_ok { inputs } else { &without_file }) {
        // A value in the file that does not hold (a bad duration): the file's fault when the
        // settings without it resolve.
        Err(err) if file_ok && config::resolve(&without_file).is_ok() => {
            if let Some(c) = checks.iter_mut().find(|c| c.name == "config-file") {
                *c = check("config-file", State::Fail, err.to_string()).fix(format!(
                    "correct {}; the checks below use the settings without it",
                    path.display()
                ));
            }
            config::resolve(&without_file)
        }
        other => other,
    };
    let global = resolved
        .map_err(|e| e.to_string())
        .and_then(|r| Global::from_resolved(&r).map_err(|e| e.to_string()));
    match global {
        Ok(global) => {
            checks.push(check("settings", State::Ok, "every setting is valid"));
            global
        }
        Err(err) => {
            checks.push(
                check("settings", State::Fail, err)
                    .fix("correct the setting named; the checks below use the built-in defaults"),
            );
            let defaults = Inputs {
                config: Some(PathBuf::from("/dev/null")),
                ..Inputs::default()
            };
            config::resolve(&defaults)
                .ok()
                .and_then(|r| Global::from_resolved(&r).ok())
                .expect("the built-in defaults are valid")
        }
    }
}

/// A configured directory: there, and safe (the lock dir's rule: owned by us or root, not
/// writable by others unless sticky).
fn directory(dir: &Path, key: &'static str, missing: State) -> Check {
    let name = format!("dir {key}");
    match std::fs::symlink_metadata(dir) {
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            let why = if missing == State::Fail {
                "runs link their ABRA_DIR to its servers/ and catalogue/"
            } else {
                "it is made at first use, with the permissions of whoever uses it first"
            };
            return check(
                name,
                missing,
                format!("{} does not exist: {why}", dir.display()),
            )
            .fix(format!("install -d -m 0755 {}", dir.display()));
        }
        Err(err) => {
            return check(
                name,
                State::Fail,
                format!("failed to inspect {}: {err}", dir.display()),
            );
        }
        Ok(_) => {}
    }
    match crate::lock::check_dir(dir) {
        Ok(()) => {
            use std::os::unix::fs::MetadataExt;
            let meta = std::fs::metadata(dir).ok();
            let (uid, mode) = meta.map_or((0, 0), |m| (m.uid(), m.mode() & 0o7777));
            check(
                name,
                State::Ok,
                format!("{} (uid {uid}, mode {mode:o})", dir.display()),
            )
        }
        Err(err) => check(name, State::Fail, err.to_string()).fix(format!(
            "chown root {0} && chmod go-w {0} (or chmod +t {0} where it is shared)",
            dir.display()
        )),
    }
}

/// The lock dir on tmpfs: a reboot then leaves no lock file and no holder line of a run it
/// killed.
fn lock_dir_tmpfs(dir: &Path) -> Check {
    const NAME: &str = "lock_dir on tmpfs";
    // The nearest existing directory: a lock dir yet to be made lives where its parent is.
    let mut at = dir;
    while !at.exists() {
        match at.parent() {
            Some(parent) => at = parent,
            None => break,
        }
    }
    match nix::sys::statfs::statfs(at) {
        Ok(fs) if fs.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC => {
            check(NAME, State::Ok, format!("{} is on tmpfs", dir.display()))
        }
        Ok(fs) => check(
            NAME,
            State::Warn,
            format!(
                "{} is not on tmpfs (file system type {:#x}): lock files and the holder lines of \
                 runs a reboot killed survive the reboot; nothing clears them at boot, so the \
                 first janitor sweep after it must",
                dir.display(),
                fs.filesystem_type().0
            ),
        )
        .fix(
            "mount a tmpfs there (as /run/lock is on most systemd hosts), or set lock_dir to a \
             directory on one",
        ),
        Err(err) => check(
            NAME,
            State::Fail,
            format!(
                "failed to inspect the file system of {}: {err}",
                at.display()
            ),
        ),
    }
}

/// cgroup v2 writable under our own cgroup, with `cgroup.kill`.
fn cgroups(mode: CgroupMode) -> Check {
    const NAME: &str = "cgroup v2";
    if mode == CgroupMode::Off {
        return check(NAME, State::Skip, "cgroup = off: runs make no cgroups")
            .fix("set cgroup = \"auto\" to have every run's processes killed as one");
    }
    let name = format!("ccci-run-doctor-{}", std::process::id());
    match crate::supervise::cgroup::probe(&name) {
        Ok(probe) if probe.kill_file => check(
            NAME,
            State::Ok,
            format!(
                "a cgroup made under our own ({}) has cgroup.kill",
                probe.own.display()
            ),
        ),
        Ok(probe) => check(
            NAME,
            State::Warn,
            format!(
                "cgroups can be made under {}, but without cgroup.kill (Linux < 5.14): a run's \
                 processes are SIGKILLed one by one, and one that forks meanwhile may escape",
                probe.own.display()
            ),
        )
        .fix("run a kernel of 5.14 or later"),
        Err(err) => check(
            NAME,
            State::Warn,
            format!(
                "runs cannot have cgroups here ({err}): they fall back to process groups, \
                 subreaping and the environment scan"
            ),
        )
        .fix(
            "give the runner a writable cgroup v2 subtree: Delegate=yes in its unit (see \
             systemd/drone-runner-exec.service.d/)",
        ),
    }
}

/// Where the runner unit's settings come from.
enum UnitSource {
    Settings {
        settings: unit::UnitSettings,
        from: String,
    },
    /// The unit could not be read: every unit check fails with this.
    Broken(String),
    /// Nothing to read here: every unit check is skipped with this.
    Absent(String),
}

fn runner_unit(opts: &Options) -> UnitSource {
    if let Some(path) = &opts.unit_file {
        return match unit::read_file(path) {
            Ok((settings, read)) => UnitSource::Settings {
                settings,
                from: read.join(" + "),
            },
            Err(err) => UnitSource::Broken(format!("{err} (--unit-file)")),
        };
    }
    let name = opts.unit.clone().unwrap_or_else(|| DEFAULT_UNIT.to_owned());
    if !unit::systemd_running() {
        return UnitSource::Absent(format!(
            "systemd is not running here (no /run/systemd/system), so unit {name} cannot be asked"
        ));
    }
    match unit::show(&name) {
        Ok(settings) => UnitSource::Settings {
            settings,
            from: format!("systemd's {name}"),
        },
        Err(err) => UnitSource::Broken(err),
    }
}

fn unit_checks(source: &UnitSource, global: &Global) -> Vec<Check> {
    let names = ["unit Delegate", "unit KillMode", "unit TimeoutStopSec"];
    let (settings, from) = match source {
        UnitSource::Settings { settings, from } => (settings, from),
        UnitSource::Broken(why) => {
            return names
                .iter()
                .map(|n| {
                    check(*n, State::Fail, why.clone())
                        .fix("name the runner's unit with --unit, or its file with --unit-file")
                })
                .collect();
        }
        UnitSource::Absent(why) => {
            return names
                .iter()
                .map(|n| {
                    check(*n, State::Skip, why.clone())
                        .fix("check the runner's unit file with --unit-file FILE")
                })
                .collect();
        }
    };
    let mut checks = Vec::new();
    checks.push(if settings.delegates() {
        check(names[0], State::Ok, format!("Delegate=yes in {from}"))
    } else {
        check(
            names[0],
            State::Fail,
            format!(
                "Delegate={} in {from}: the runner's cgroup subtree is not its own, so runs \
                 cannot have cgroups",
                settings.delegate.as_deref().unwrap_or("no (the default)")
            ),
        )
        .fix("Delegate=yes in [Service] (systemd/drone-runner-exec.service.d/ccci-run.conf)")
    });
    let kill_mode = settings.kill_mode();
    checks.push(if kill_mode == "control-group" {
        check(
            names[1],
            State::Ok,
            format!("KillMode=control-group in {from}"),
        )
    } else {
        check(
            names[1],
            State::Fail,
            format!(
                "KillMode={kill_mode} in {from}: stopping the runner does not send every run \
                 its SIGTERM, so runs are SIGKILLed without a teardown"
            ),
        )
        .fix("KillMode=control-group (systemd's default): remove the KillMode line")
    });
    let needed =
        global.timings.value(Timing::KillGrace) + global.timings.value(Timing::TeardownTimeout);
    let show = |d: Duration| crate::duration::show(d);
    checks.push(match settings.timeout_stop() {
        Ok(None) => check(
            names[2],
            State::Ok,
            format!("TimeoutStopSec=infinity in {from}"),
        ),
        Ok(Some(timeout)) if timeout >= needed => check(
            names[2],
            State::Ok,
            format!(
                "TimeoutStopSec={} in {from}, at least kill_grace + teardown_timeout ({})",
                show(timeout),
                show(needed)
            ),
        ),
        Ok(Some(timeout)) => check(
            names[2],
            State::Fail,
            format!(
                "TimeoutStopSec={} in {from} is shorter than kill_grace + teardown_timeout ({}): \
                 systemd SIGKILLs a run mid-teardown when the runner stops",
                show(timeout),
                show(needed)
            ),
        )
        .fix(format!(
            "TimeoutStopSec={} or more in [Service]",
            (needed + Duration::from_secs(59)).as_secs() / 60 * 60
        )),
        Err(err) => check(names[2], State::Fail, format!("{err} in {from}"))
            .fix("write TimeoutStopSec as systemd does: 6min, 400, infinity"),
    });
    checks
}

/// Docker reachable at `DOCKER_HOST`, in swarm mode, speaking API 1.41 or later; and the
/// swarm's nodes, each reached by a node sweep.
fn docker(global: &Global) -> Vec<Check> {
    let mode = global.docker;
    let names = ["docker", "docker swarm", "docker api", "docker nodes"];
    if mode == DockerMode::Off {
        return names
            .iter()
            .map(|n| {
                check(
                    *n,
                    State::Skip,
                    "docker = off: runs and sweeps never touch Docker",
                )
                .fix("set docker = \"auto\" or \"required\" on a host that deploys apps")
            })
            .collect();
    }
    let seam = crate::docker::DockerSeam::connect();
    let facts = seam
        .as_ref()
        .map_err(Clone::clone)
        .and_then(|seam| seam.engine_facts(DOCKER_TIMEOUT));
    let facts = match facts {
        Ok(facts) => facts,
        Err(err) => {
            let host = std::env::var("DOCKER_HOST").unwrap_or_default();
            let mut checks = vec![check(names[0], State::Fail, err.to_string()).fix(format!(
                "start the engine, or point DOCKER_HOST (now {:?}) at it",
                host
            ))];
            checks.extend(names[1..].iter().map(|n| {
                check(
                    *n,
                    State::Fail,
                    "cannot be asked: the engine does not answer",
                )
                .fix("make the engine answer first")
            }));
            return checks;
        }
    };
    let mut checks = vec![check(
        names[0],
        State::Ok,
        format!(
            "Docker {} answers at {}",
            facts.version,
            crate::docker::Endpoint::from_env()
                .map(|e| e.to_string())
                .unwrap_or_default()
        ),
    )];
    checks.push(match (facts.swarm_state.as_str(), facts.swarm_manager) {
        ("active", true) => check(names[1], State::Ok, "active, this node is a manager"),
        ("active", false) => check(
            names[1],
            State::Fail,
            "active, but this node is a worker: stacks are deployed through a manager",
        )
        .fix("docker node promote this node, or run CI on a manager"),
        (state, _) => {
            let state = if state.is_empty() { "unknown" } else { state };
            let error = facts
                .swarm_error
                .as_deref()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default();
            check(
                names[1],
                State::Fail,
                format!("swarm is {state}{error}: abra deploys apps as swarm stacks"),
            )
            .fix("docker swarm init")
        }
    });
    let api = parse_api(&facts.api_version);
    checks.push(match api {
        Some(v) if v >= MIN_DOCKER_API => check(
            names[2],
            State::Ok,
            format!(
                "engine API {}, this client speaks {}",
                facts.api_version, facts.negotiated
            ),
        ),
        _ => check(
            names[2],
            State::Fail,
            format!(
                "engine API {:?}: ccci-run needs {}.{} (Docker 20.10) or later",
                facts.api_version, MIN_DOCKER_API.0, MIN_DOCKER_API.1
            ),
        )
        .fix("upgrade the Docker engine to 20.10 or later"),
    });
    checks.push(match seam {
        Ok(seam) if facts.swarm_state == "active" && facts.swarm_manager => {
            nodes(seam.with_node_sweep(global.node_sweep.clone()), names[3])
        }
        _ => check(
            names[3],
            State::Skip,
            "not a swarm manager: no nodes to ask",
        )
        .fix("point DOCKER_HOST at a swarm manager"),
    });
    checks
}

/// The swarm's nodes: each named with its role and state, and on a swarm of several, each
/// reached by a node sweep that removes nothing (what a reap's sweep does, with no stack):
/// a node whose task does not complete cannot have its volumes cleaned.
fn nodes(seam: crate::docker::DockerSeam, name: &'static str) -> Check {
    match seam.probe_nodes(NODE_SWEEP_TIMEOUT) {
        Err(err) => {
            check(name, State::Fail, err.to_string()).fix("make the manager answer its node list")
        }
        Ok(probe) if probe.nodes.len() <= 1 => check(
            name,
            State::Ok,
            format!(
                "one node ({}): everything of an app is removed through this engine",
                probe.nodes.join(", ")
            ),
        ),
        Ok(probe) if probe.unconfirmed.is_empty() => check(
            name,
            State::Ok,
            format!(
                "{} nodes, each reached by a node sweep (image {}) that can remove a stack's \
                 containers and volumes there: {}",
                probe.nodes.len(),
                probe.image,
                probe.nodes.join(", ")
            ),
        ),
        Ok(probe) => check(
            name,
            State::Fail,
            format!(
                "{} nodes ({}); a reap cannot confirm an app gone while {}",
                probe.nodes.len(),
                probe.nodes.join(", "),
                probe.unconfirmed.join("; ")
            ),
        )
        .fix(format!(
            "bring the node back, make it active, or remove it from the swarm (docker node rm); \
             load the node sweep image {} on every node (node_sweep_image), and make its engine \
             listen on {} there (node_docker_socket)",
            probe.image, probe.socket
        )),
    }
}

fn parse_api(version: &str) -> Option<(u32, u32)> {
    let (major, minor) = version.split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// Each etcd endpoint reachable; one cluster, with a leader; the TTL as granted.
fn etcd(global: &Global) -> Vec<Check> {
    let Some(settings) = &global.etcd else {
        return vec![
            check(
                "etcd",
                State::Skip,
                "no etcd endpoints: locks are this host's flock",
            )
            .fix("set etcd_endpoints to share locks with other hosts"),
        ];
    };
    let grace = global.timings.value(config::Timing::KillGrace);
    let budget = match settings.check_stop_budget(grace) {
        Ok(()) => check(
            "etcd stop budget",
            State::Ok,
            format!(
                "a {} lease holds the {} kill grace, the 0.5 s kill margin and 1.5 s of \
                 keepalives: a holder stops its command before etcd can expire its lease",
                crate::duration::show(settings.lease_ttl),
                crate::duration::show(grace)
            ),
        ),
        Err(err) => check("etcd stop budget", State::Fail, err.to_string())
            .fix("raise lease_ttl, or lower kill_grace, as the message says: run and lock refuse these settings"),
    };
    let mut checks = vec![budget];
    checks.extend(etcd_checks(settings));
    checks
}

#[cfg(not(feature = "etcd"))]
fn etcd_checks(settings: &config::EtcdSettings) -> Vec<Check> {
    vec![
        check(
            "etcd",
            State::Fail,
            format!(
                "etcd endpoints are set ({}), but this build has no etcd backend: every lock \
             command refuses to run",
                settings.endpoints.join(",")
            ),
        )
        .fix("install a ccci-run built with --features etcd, or remove etcd_endpoints"),
    ]
}

#[cfg(feature = "etcd")]
fn etcd_checks(settings: &config::EtcdSettings) -> Vec<Check> {
    let answers = match crate::lock::etcd::health::ask(settings) {
        Ok(answers) => answers,
        Err(err) => return vec![check("etcd", State::Fail, err)],
    };
    let mut checks = Vec::new();
    let mut members = Vec::new();
    for (endpoint, answer) in answers {
        let name = format!("etcd {endpoint}");
        match answer {
            Ok(member) => {
                checks.push(check(
                    name,
                    State::Ok,
                    format!(
                        "etcd {}, member {:x} of cluster {:x}",
                        member.version, member.member_id, member.cluster_id
                    ),
                ));
                members.push((endpoint, member));
            }
            Err(err) => checks.push(
                check(name, State::Fail, err)
                    .fix("start that member, or remove the endpoint from etcd_endpoints"),
            ),
        }
    }
    let mut clusters: Vec<u64> = members.iter().map(|(_, m)| m.cluster_id).collect();
    clusters.sort_unstable();
    clusters.dedup();
    checks.push(match clusters.as_slice() {
        [] => check("etcd cluster", State::Fail, "no endpoint answered")
            .fix("start etcd, or correct etcd_endpoints"),
        [one] => check("etcd cluster", State::Ok, format!("one cluster, {one:x}")),
        many => check(
            "etcd cluster",
            State::Fail,
            format!(
                "the endpoints belong to {} clusters ({}): hosts on different clusters exclude \
                 nobody",
                many.len(),
                members
                    .iter()
                    .map(|(e, m)| format!("{e}: {:x}", m.cluster_id))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
        .fix("list the members of one cluster in etcd_endpoints"),
    });
    let leaders: Vec<u64> = members
        .iter()
        .map(|(_, m)| m.leader)
        .filter(|l| *l != 0)
        .collect();
    checks.push(match leaders.first() {
        Some(leader) if !members.is_empty() && leaders.len() == members.len() => {
            check("etcd leader", State::Ok, format!("member {leader:x} leads"))
        }
        Some(_) => check(
            "etcd leader",
            State::Warn,
            "some members answering know no leader: they refuse lock requests",
        )
        .fix("look at etcd's logs: a member is cut off from the others"),
        None if members.is_empty() => {
            check("etcd leader", State::Fail, "no endpoint answered").fix("start etcd")
        }
        None => check(
            "etcd leader",
            State::Fail,
            "no member knows a leader (no quorum): every lock request is refused",
        )
        .fix("bring a majority of the cluster's members up"),
    });
    let asked = settings.lease_ttl.as_secs();
    let granted: Vec<i64> = members.iter().filter_map(|(_, m)| m.granted_ttl).collect();
    checks.push(match granted.iter().max() {
        None => check(
            "etcd lease ttl",
            State::Fail,
            format!("no member granted a {asked} s lease"),
        )
        .fix("make the cluster answer first"),
        Some(&got) if u64::try_from(got).is_ok_and(|g| g > asked) => check(
            "etcd lease ttl",
            State::Warn,
            format!(
                "asked {asked} s, granted {got} s: etcd raises a TTL below its minimum (1.5 × \
                 its election timeout), so a dead holder's lock frees later than configured"
            ),
        )
        .fix(format!("set lease_ttl to {got} s or more")),
        Some(&got) => check(
            "etcd lease ttl",
            State::Ok,
            format!("{got} s, as asked (a dead holder's lock frees within it)"),
        ),
    });
    checks
}

/// The inotify instances and watches this user has left: every named-lock waiter takes one of
/// each (without them, waiters poll).
fn inotify(lock_dir: &Path) -> Vec<Check> {
    let read = |name: &str| -> Option<u64> {
        crate::files::kernel_text(format!("/proc/sys/fs/inotify/{name}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let (max_instances, max_watches) = (read("max_user_instances"), read("max_user_watches"));
    let (instances, watches) = inotify_in_use();
    // The kernel's own answer: can we have one more instance, and a watch in it?
    let probe = inotify::Inotify::init().and_then(|i| {
        let at = if lock_dir.is_dir() {
            lock_dir
        } else {
            Path::new("/")
        };
        i.watches().add(at, inotify::WatchMask::CREATE).map(drop)
    });
    let fix = |what: &str| {
        format!(
            "raise fs.inotify.{what} (sysctl -w fs.inotify.{what}=N, and in /etc/sysctl.d/), or \
             find the processes of this user that hold them"
        )
    };
    let judge = |name: &str, used: u64, max: Option<u64>, what: &str, refused: bool| {
        let Some(max) = max else {
            return check(
                name.to_owned(),
                State::Warn,
                format!("failed to read fs.inotify.{what}"),
            );
        };
        let left = max.saturating_sub(used);
        let detail = format!("{used} of {max} in use by this user, {left} left");
        if refused || left == 0 {
            check(
                name.to_owned(),
                State::Fail,
                format!("{detail}: used up, so named-lock waiters poll and other programs fail"),
            )
            .fix(fix(what))
        } else if left < (max / 10).max(8) {
            check(
                name.to_owned(),
                State::Warn,
                format!("{detail}: nearly used up"),
            )
            .fix(fix(what))
        } else {
            check(name.to_owned(), State::Ok, detail)
        }
    };
    let refused = |err: &std::io::Error, errnos: &[i32]| {
        err.raw_os_error().is_some_and(|e| errnos.contains(&e))
    };
    let (no_instance, no_watch) = match &probe {
        Ok(()) => (false, false),
        Err(err) => (
            refused(err, &[nix::libc::EMFILE]),
            refused(err, &[nix::libc::ENOSPC]),
        ),
    };
    vec![
        judge(
            "inotify instances",
            instances,
            max_instances,
            "max_user_instances",
            no_instance,
        ),
        judge(
            "inotify watches",
            watches,
            max_watches,
            "max_user_watches",
            no_watch,
        ),
    ]
}

/// The inotify instances and watches held by processes of our effective user (each open
/// instance counted once per process that has it open).
fn inotify_in_use() -> (u64, u64) {
    let us = nix::unistd::Uid::effective().as_raw();
    let (mut instances, mut watches) = (0, 0);
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return (0, 0);
    };
    for entry in procs.flatten() {
        let pid = entry.file_name();
        if !pid.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let dir = entry.path();
        let euid = crate::files::kernel_text(dir.join("status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("Uid:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse::<u32>().ok())
            });
        if euid != Some(us) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(dir.join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == "anon_inode:inotify") {
                instances += 1;
                let info = dir.join("fdinfo").join(fd.file_name());
                watches += crate::files::kernel_text(info)
                    .map(|t| t.lines().filter(|l| l.starts_with("inotify wd:")).count() as u64)
                    .unwrap_or(0);
            }
        }
    }
    (instances, watches)
}

/// The programs a Drone step runs, on the `PATH` it sees: the runner unit's (its
/// `Environment=PATH=`, else systemd's default), or ours where no unit could be read.
fn step_path(source: &UnitSource) -> Vec<Check> {
    let (path, from): (OsString, String) = match source {
        UnitSource::Settings { settings, from } => match &settings.path {
            Some(path) => (path.into(), format!("the PATH of {from}")),
            None => (
                unit::DEFAULT_PATH.into(),
                format!("systemd's default PATH ({from} sets none)"),
            ),
        },
        _ => (
            std::env::var_os("PATH").unwrap_or_default(),
            "this shell's PATH (no runner unit could be read)".to_owned(),
        ),
    };
    STEP_PROGRAMS
        .iter()
        .map(|program| {
            let name = format!("step PATH {program}");
            let found = std::env::split_paths(&path).find_map(|dir| {
                use std::os::unix::fs::PermissionsExt;
                let candidate = dir.join(program);
                std::fs::metadata(&candidate)
                    .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                    .then_some(candidate)
            });
            match found {
                Some(at) => check(name, State::Ok, format!("{} (on {from})", at.display())),
                None => check(
                    name,
                    State::Fail,
                    format!("{program} is not on {from}: a step that runs it fails"),
                )
                .fix(format!(
                    "install {program} into a directory of that PATH, or add its directory with \
                     Environment=PATH=... in the runner's unit"
                )),
            }
        })
        .collect()
}
