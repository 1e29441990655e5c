//! One source of configuration: every global setting comes from the command line, else the
//! environment, else the configuration file, else the built-in default — and the paths that
//! the Drone step, the janitor's timer and an operator's shell use stay the same because they
//! all read one file (`--config`, `CCCI_CONFIG`, or `/etc/ccci-run/config.toml` when it exists).
//!
//! Invariant: what comes out is absolute and validated; nothing downstream parses a setting
//! again, and `ccci-run config` shows each value with where it came from.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

use std::path::{Path, PathBuf};

use std::ffi::OsString;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::duration::Spec;
use crate::names::{
    AppDomain, DomainSuffix, GitRef, LockName, NameError, PrNumber, Recipe, RunAppPattern, RunId,
};

/// The configuration file used when neither `--config` nor `CCCI_CONFIG` names one.
pub(crate) const DEFAULT_FILE: &str = "/etc/ccci-run/config.toml";

/// The settings a configuration file may hold; anything else is an error (a typo must not pass
/// silently).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileConfig {
    pub lock_dir: Option<PathBuf>,
    pub abra_home: Option<PathBuf>,
    pub runs_dir: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
    pub domain_suffix: Option<String>,
    pub docker: Option<DockerMode>,
    pub log_format: Option<LogFormat>,
    pub cgroup: Option<CgroupMode>,
    pub etcd_endpoints: Option<Vec<String>>,
    pub lease_ttl: Option<FileDuration>,
    /// Where runs clone recipes from, `{recipe}` filled in (the host's forge).
    pub recipe_url_template: Option<String>,
    /// The image of the job that cleans a stack's leftovers on every node of a swarm.
    pub node_sweep_image: Option<String>,
    /// Where each node's own engine socket is, on that node.
    pub node_docker_socket: Option<PathBuf>,
    pub deadline: Option<FileDuration>,
    pub kill_grace: Option<FileDuration>,
    pub teardown_timeout: Option<FileDuration>,
    pub lock_wait: Option<FileDuration>,
    pub long_held: Option<FileDuration>,
    pub keep_runs: Option<FileDuration>,
    pub reap_budget: Option<FileDuration>,
    pub promote_after: Option<FileDuration>,
    pub converge_timeout: Option<FileDuration>,
    pub converge_stable: Option<FileDuration>,
}

impl FileConfig {
    /// The file's value of a run setting, if it has one.
    fn timing(&self, timing: Timing) -> Option<&FileDuration> {
        match timing {
            Timing::Deadline => self.deadline.as_ref(),
            Timing::KillGrace => self.kill_grace.as_ref(),
            Timing::TeardownTimeout => self.teardown_timeout.as_ref(),
            Timing::LockWait => self.lock_wait.as_ref(),
            Timing::LongHeld => self.long_held.as_ref(),
            Timing::KeepRuns => self.keep_runs.as_ref(),
            Timing::ReapBudget => self.reap_budget.as_ref(),
            Timing::PromoteAfter => self.promote_after.as_ref(),
            Timing::ConvergeTimeout => self.converge_timeout.as_ref(),
            Timing::ConvergeStable => self.converge_stable.as_ref(),
        }
    }
}

/// A duration in the configuration file: a string in the one duration syntax (`"90s"`,
/// `"1h30m"`, `"14d"`), or a bare TOML number of seconds.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub(crate) enum FileDuration {
    Seconds(f64),
    Text(String),
}

impl FileDuration {
    /// Parse as `spec` says; the error names the key and the file.
    fn parse(&self, key: &'static str, spec: &Spec, path: &Path) -> Result<Duration, NameError> {
        let text = match self {
            Self::Seconds(secs) => secs.to_string(),
            Self::Text(text) => text.clone(),
        };
        crate::duration::parse(&text, spec).map_err(|rule| NameError {
            what: key,
            value: text,
            rule: format!("{rule} (in {})", path.display()),
        })
    }
}

/// The run settings a host sets once (configuration file, or the environment of every step)
/// and a command line may override: the bounds and budgets of runs, locks, sweeps and of the
/// wait for a deploy to converge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Timing {
    Deadline,
    KillGrace,
    TeardownTimeout,
    LockWait,
    LongHeld,
    KeepRuns,
    ReapBudget,
    PromoteAfter,
    ConvergeTimeout,
    ConvergeStable,
}

/// What a run setting is called and what it accepts.
#[derive(Debug)]
pub(crate) struct TimingInfo {
    pub timing: Timing,
    /// The configuration key.
    pub key: &'static str,
    /// The environment variable.
    pub env: &'static str,
    pub spec: Spec,
    /// `None`: unset unless given (no bound on the lock wait but the deadline, no retention).
    pub default: Option<Duration>,
    /// What an unset value means, as `ccci-run config` shows it.
    pub unset: &'static str,
}

/// Every run setting, in the order `ccci-run config` shows them.
pub(crate) const TIMINGS: [TimingInfo; 10] = [
    TimingInfo {
        timing: Timing::Deadline,
        key: "deadline",
        env: "CCCI_DEADLINE",
        spec: Spec::at_least(Duration::from_secs(1)),
        default: Some(Duration::from_secs(3600)),
        unset: "",
    },
    TimingInfo {
        timing: Timing::KillGrace,
        key: "kill_grace",
        env: "CCCI_KILL_GRACE",
        spec: Spec::at_least(Duration::ZERO),
        default: Some(Duration::from_secs(10)),
        unset: "",
    },
    TimingInfo {
        timing: Timing::TeardownTimeout,
        key: "teardown_timeout",
        env: "CCCI_TEARDOWN_TIMEOUT",
        // A budget of nothing would skip the teardown.
        spec: Spec::at_least(Duration::from_secs(1)),
        default: Some(Duration::from_secs(300)),
        unset: "",
    },
    TimingInfo {
        timing: Timing::LockWait,
        key: "lock_wait",
        env: "CCCI_LOCK_WAIT",
        spec: Spec::at_least(Duration::ZERO),
        default: None,
        unset: "none (until the deadline)",
    },
    TimingInfo {
        timing: Timing::LongHeld,
        key: "long_held",
        env: "CCCI_LONG_HELD",
        spec: Spec::at_least(Duration::ZERO),
        default: Some(DEFAULT_LONG_HELD),
        unset: "",
    },
    TimingInfo {
        timing: Timing::KeepRuns,
        key: "keep_runs",
        env: "CCCI_KEEP_RUNS",
        // A bare number used to mean days: it is refused rather than read as seconds.
        spec: Spec {
            min: Duration::ZERO,
            max: Duration::from_secs(36_500 * 86_400),
            bare: false,
            whole_seconds: false,
        },
        default: None,
        unset: "none (run directories are kept)",
    },
    TimingInfo {
        timing: Timing::ReapBudget,
        key: "reap_budget",
        env: "CCCI_REAP_BUDGET",
        spec: Spec::at_least(Duration::from_secs(1)),
        default: Some(DEFAULT_REAP_BUDGET),
        unset: "",
    },
    TimingInfo {
        timing: Timing::PromoteAfter,
        key: "promote_after",
        env: "CCCI_PROMOTE_AFTER",
        spec: Spec::at_least(Duration::ZERO),
        default: Some(Duration::from_secs(1200)),
        unset: "",
    },
    TimingInfo {
        timing: Timing::ConvergeTimeout,
        key: "converge_timeout",
        env: "CCCI_CONVERGE_TIMEOUT",
        // Zero polls once.
        spec: Spec::at_least(Duration::ZERO),
        default: Some(Duration::from_secs(300)),
        unset: "",
    },
    TimingInfo {
        timing: Timing::ConvergeStable,
        key: "converge_stable",
        env: "CCCI_CONVERGE_STABLE",
        // Zero counts a running task at once (as long as its service has not failed).
        spec: Spec::at_least(Duration::ZERO),
        default: Some(DEFAULT_STABLE),
        unset: "",
    },
];

impl Timing {
    pub(crate) fn info(self) -> &'static TimingInfo {
        TIMINGS
            .iter()
            .find(|t| t.timing == self)
            .expect("every run setting is in the table")
    }

    /// Parse a command-line value of this setting.
    pub(crate) fn parse_flag(self, text: &str) -> Result<Duration, String> {
        crate::duration::parse(text, &self.info().spec)
    }
}

/// The lease TTL: whole seconds, within [`LEASE_TTL_RANGE`].
pub(crate) const LEASE_TTL_SPEC: Spec = Spec {
    min: Duration::from_secs(*LEASE_TTL_RANGE.start() as u64),
    max: Duration::from_secs(*LEASE_TTL_RANGE.end() as u64),
    bare: true,
    whole_seconds: true,
};

/// The run settings, resolved: flag > environment > file > default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Timings {
    values: [Option<Duration>; TIMINGS.len()],
}

impl Timings {
    /// The value of `timing`; `None` only for the settings that may stay unset.
    pub(crate) fn get(&self, timing: Timing) -> Option<Duration> {
        let at = TIMINGS
            .iter()
            .position(|t| t.timing == timing)
            .expect("every run setting is in the table");
        self.values[at]
    }

    /// The value of a setting that always has one.
    pub(crate) fn value(&self, timing: Timing) -> Duration {
        self.get(timing)
            .or(timing.info().default)
            .unwrap_or_default()
    }
}

impl Default for Timings {
    fn default() -> Self {
        Self {
            values: TIMINGS.map(|t| t.default),
        }
    }
}

/// A setting with a fixed set of values: each with its name (on the command line, in the file,
/// in `ccci-run config`) and a line of help. The CLI builds its value parsers from this, so the
/// types themselves know nothing of the command line.
pub(crate) trait Choice: Copy + PartialEq + Send + Sync + 'static {
    /// Every value: `(value, name, help)`; the help may be empty.
    const CHOICES: &'static [(Self, &'static str, &'static str)];

    fn name(self) -> &'static str {
        Self::CHOICES
            .iter()
            .find(|(v, _, _)| *v == self)
            .map_or("", |(_, name, _)| name)
    }

    fn from_name(name: &str) -> Option<Self> {
        Self::CHOICES
            .iter()
            .find(|(_, n, _)| *n == name)
            .map(|(v, _, _)| *v)
    }
}

/// A lock waiter's class: fast tickets go before normal ones.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Class {
    Fast,
    Normal,
}

impl Choice for Class {
    const CHOICES: &'static [(Self, &'static str, &'static str)] =
        &[(Self::Fast, "fast", ""), (Self::Normal, "normal", "")];
}

impl Class {
    /// Its place in a ticket's name: fast sorts first.
    pub(crate) fn rank(self) -> u8 {
        match self {
            Class::Fast => 0,
            Class::Normal => 1,
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Class::Fast => "fast",
            Class::Normal => "normal",
        }
    }
}

/// Whether to touch Docker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum DockerMode {
    Auto,
    Required,
    Off,
}

impl Choice for DockerMode {
    const CHOICES: &'static [(Self, &'static str, &'static str)] = &[
        (
            Self::Auto,
            "auto",
            "Use Docker when the daemon answers; warn once and leave Docker apps alone when it does not",
        ),
        (
            Self::Required,
            "required",
            "Fail when the daemon does not answer",
        ),
        (Self::Off, "off", "Never touch Docker"),
    ];
}

/// Whether runs and `lock` commands get a cgroup of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum CgroupMode {
    Auto,
    Off,
}

impl Choice for CgroupMode {
    const CHOICES: &'static [(Self, &'static str, &'static str)] = &[
        (
            Self::Auto,
            "auto",
            "Put each run and each `lock` command in a cgroup of its own where cgroup v2 is writable",
        ),
        (
            Self::Off,
            "off",
            "Never create cgroups: process groups, subreaping and the environment scan only",
        ),
    ];
}

/// The diagnostics format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum LogFormat {
    Text,
    Json,
}

impl Choice for LogFormat {
    const CHOICES: &'static [(Self, &'static str, &'static str)] =
        &[(Self::Text, "text", ""), (Self::Json, "json", "")];
}

/// Settings every subcommand shares, validated.
#[derive(Debug, Clone)]
pub(crate) struct Global {
    pub lock_dir: PathBuf,
    pub abra_home: PathBuf,
    pub runs_dir: PathBuf,
    pub state_dir: PathBuf,
    pub suffix: DomainSuffix,
    pub pattern: RunAppPattern,
    pub docker: DockerMode,
    pub cgroup: CgroupMode,
    /// Locks beyond one host: `None` keeps them on this host's flock.
    pub etcd: Option<EtcdSettings>,
    /// The run settings (bounds and budgets) a command line did not override.
    pub timings: Timings,
    /// Where runs clone recipes from (`{recipe}` filled in), unless `--recipe-url` says.
    pub recipe_url_template: Option<String>,
    /// How a reap reaches every node of a multi-node swarm.
    pub node_sweep: NodeSweepSettings,
}

/// How a reap cleans what a stack left on the other nodes of a swarm (their containers and
/// local volumes, which a manager can neither list nor remove): a one-shot global job of this
/// image, with each node's own engine socket bind-mounted from this path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeSweepSettings {
    pub image: String,
    pub socket: PathBuf,
}

/// The node sweep's image when none is given: Docker's own CLI image. A fleet without a
/// registry pre-loads it (or its own) on every node.
pub(crate) const DEFAULT_NODE_SWEEP_IMAGE: &str = "docker:27-cli";

/// Where a node's engine listens when nothing else is said: the engine's default socket.
pub(crate) const DEFAULT_NODE_DOCKER_SOCKET: &str = "/var/run/docker.sock";

impl Default for NodeSweepSettings {
    fn default() -> Self {
        Self {
            image: DEFAULT_NODE_SWEEP_IMAGE.to_owned(),
            socket: PathBuf::from(DEFAULT_NODE_DOCKER_SOCKET),
        }
    }
}

/// Where the fleet's locks are kept when they are kept in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EtcdSettings {
    pub endpoints: Vec<String>,
    /// How long a lease outlives its holder's last keepalive.
    pub lease_ttl: Duration,
}

/// The lease TTL when none is given, in seconds: room for the default kill grace (10 s), the
/// kill margin and the keepalive headroom ([`EtcdSettings::check_stop_budget`]).
pub(crate) const DEFAULT_LEASE_TTL: u32 = 15;

/// What a SIGKILL (to a process group, or `cgroup.kill`) may take to empty what it hits, added
/// to the kill grace in a holder's stop budget. Measured with the fence's own report (`cgroup.kill`,
/// the process groups and the marker scan until nothing of a run with eight processes is left):
/// 1.7–12 ms on an idle 2-core host, 3–23 ms with both cores busy; twenty times that leaves room
/// for a host under memory pressure.
pub(crate) const KILL_MARGIN: Duration = Duration::from_millis(500);

/// How much of a lease's TTL must be left for keepalives once the stop budget is set aside:
/// several keepalive rounds, each given up on a member that does not answer for the next, and
/// an etcd leader election (1 s by default), or a healthy cluster would make a holder stop its
/// command.
pub(crate) const LEASE_HEADROOM: Duration = Duration::from_millis(1500);
/// The bounds of a lease TTL, in seconds: below 2 s an etcd server rounds it up anyway (its
/// election timeout), above an hour a dead holder blocks the fleet for too long.
pub(crate) const LEASE_TTL_RANGE: std::ops::RangeInclusive<u32> = 2..=3600;

impl EtcdSettings {
    /// Validate endpoints as given (flag, environment or file): at least one, each a plain
    /// `http://HOST:PORT` or `HOST:PORT` (this build speaks no TLS).
    pub(crate) fn validate(endpoints: &[String], lease_ttl: u32) -> Result<Option<Self>, String> {
        let endpoints: Vec<String> = endpoints
            .iter()
            .map(|e| e.trim().to_owned())
            .filter(|e| !e.is_empty())
            .collect();
        if endpoints.is_empty() {
            return Ok(None);
        }
        for endpoint in &endpoints {
            let rest = endpoint.strip_prefix("http://").unwrap_or(endpoint);
            if rest.contains("://") {
                return Err(format!(
                    "{endpoint:?}: only http:// endpoints are supported (this build has no TLS)"
                ));
            }
            let (host, port) = rest
                .trim_end_matches('/')
                .rsplit_once(':')
                .ok_or_else(|| format!("{endpoint:?}: expected HOST:PORT or http://HOST:PORT"))?;
            if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
                return Err(format!(
                    "{endpoint:?}: expected HOST:PORT or http://HOST:PORT with a port in 1-65535"
                ));
            }
        }
        if !LEASE_TTL_RANGE.contains(&lease_ttl) {
            return Err(format!(
                "lease TTL {lease_ttl} s is out of range ({}-{} s)",
                LEASE_TTL_RANGE.start(),
                LEASE_TTL_RANGE.end()
            ));
        }
        Ok(Some(Self {
            endpoints,
            lease_ttl: Duration::from_secs(lease_ttl.into()),
        }))
    }

    /// A holder of a lock under these settings stops its command before etcd can expire its
    /// lease: from the moment the lease is at risk (less than the stop budget left), TERM, then
    /// KILL at the grace, then [`KILL_MARGIN`] for the kill to take effect. That needs a TTL
    /// of at least the stop budget plus [`LEASE_HEADROOM`] for the keepalives; refuse one
    /// that cannot hold it, naming the smallest that can.
    pub(crate) fn check_stop_budget(&self, kill_grace: Duration) -> Result<(), NameError> {
        let budget = kill_grace.saturating_add(KILL_MARGIN);
        let needed = budget.saturating_add(LEASE_HEADROOM);
        if self.lease_ttl >= needed {
            return Ok(());
        }
        let smallest = needed.as_secs() + u64::from(needed.subsec_nanos() > 0);
        let grace_room = self
            .lease_ttl
            .saturating_sub(KILL_MARGIN)
            .saturating_sub(LEASE_HEADROOM);
        let or_grace = if grace_room.is_zero() {
            String::new()
        } else {
            format!(
                ", or a kill grace of at most {} (--kill-grace, CCCI_KILL_GRACE, kill_grace)",
                crate::duration::show(grace_room)
            )
        };
        Err(NameError {
            what: "lease TTL",
            value: crate::duration::show(self.lease_ttl),
            rule: format!(
                "a holder must be able to stop its command before etcd can expire its lease: \
                 with a kill grace of {} its stop budget is {} (the grace and {} for the kill \
                 to take effect), and the lease needs {} more for keepalives; the smallest \
                 lease TTL that works is {smallest} s (--lease-ttl, CCCI_LEASE_TTL, \
                 lease_ttl){or_grace}",
                crate::duration::show(kill_grace),
                crate::duration::show(budget),
                crate::duration::show(KILL_MARGIN),
                crate::duration::show(LEASE_HEADROOM),
            ),
        })
    }

    /// How long a holder with `kill_grace` may take to stop its command once it must.
    pub(crate) fn stop_budget(kill_grace: Duration) -> Duration {
        kill_grace.saturating_add(KILL_MARGIN)
    }
}

impl Global {
    /// Validate the resolved settings (flags, environment, file, defaults).
    pub(crate) fn from_resolved(resolved: &Resolved) -> Result<Self, NameError> {
        let suffix = DomainSuffix::parse(&resolved.domain_suffix)?;
        Ok(Global {
            lock_dir: resolved.lock_dir.clone(),
            abra_home: resolved.abra_home.clone(),
            runs_dir: resolved.runs_dir.clone(),
            state_dir: resolved.state_dir.clone(),
            pattern: RunAppPattern::new(&suffix),
            suffix,
            docker: resolved.docker,
            cgroup: resolved.cgroup,
            etcd: resolved.etcd.clone(),
            timings: resolved.timings.clone(),
            recipe_url_template: resolved.recipe_url_template.clone(),
            node_sweep: resolved.node_sweep.clone(),
        })
    }
}

/// A run's identity, validated: what the app domain is derived from.
#[derive(Debug, Clone)]
pub(crate) struct Identity {
    pub recipe: Recipe,
    pub pr: Option<PrNumber>,
    pub git_ref: Option<GitRef>,
    pub domain: AppDomain,
}

impl Identity {
    pub(crate) fn validate(
        recipe: &str,
        pr: Option<&str>,
        git_ref: Option<&str>,
        suffix: &DomainSuffix,
    ) -> Result<Self, NameError> {
        let recipe = Recipe::parse(recipe)?;
        let pr = pr.map(PrNumber::parse).transpose()?;
        let git_ref = git_ref.map(GitRef::parse).transpose()?;
        let domain = AppDomain::derive(recipe.as_str(), pr.as_ref(), git_ref.as_ref(), suffix);
        Ok(Identity {
            recipe,
            pr,
            git_ref,
            domain,
        })
    }
}

/// Everything `run` needs, validated.
#[derive(Debug, Clone)]
pub(crate) struct RunConfig {
    pub identity: Identity,
    pub run_id: RunId,
    pub deadline: Duration,
    pub kill_grace: Duration,
    pub teardown_timeout: Duration,
    pub lock_wait: Option<Duration>,
    pub expect_parent: Option<i32>,
    /// The `--tie-to` ancestors: the run ends when any of them exits.
    pub tie_to: Vec<i32>,
    pub on_teardown: Option<String>,
    pub no_teardown: bool,
    pub fetch: Fetch,
    pub command: Vec<OsString>,
}

/// How the recipe gets into the run's tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fetch {
    /// Leave `recipes/` empty.
    Skip,
    /// Copy the staged canonical clone.
    CopyStaged,
    /// Clone from this URL (it may hold credentials: show it only through `recipe_url::redact`).
    Clone { url: String },
}

impl Fetch {
    /// `--no-fetch` wins; then `--skip-fetch` or `CCCI_SKIP_FETCH`; else a clone from
    /// `--recipe-url`, the URL template (`CCCI_RECIPE_URL_TEMPLATE` or the file's
    /// `recipe_url_template`) or the default. The flag wins over the
    /// environment: `CCCI_SKIP_FETCH` set for every step never turns a `--no-fetch` into a usage
    /// error.
    pub(crate) fn choose(
        no_fetch: bool,
        skip_fetch: bool,
        recipe_url: Option<&str>,
        template: Option<&str>,
        recipe: &Recipe,
    ) -> Result<Self, NameError> {
        let skip_from_env = std::env::var("CCCI_SKIP_FETCH")
            .ok()
            .map(|v| parse_boolish("CCCI_SKIP_FETCH", &v))
            .transpose()?
            .unwrap_or(false);
        Ok(if no_fetch {
            Fetch::Skip
        } else if skip_fetch || skip_from_env {
            Fetch::CopyStaged
        } else {
            Fetch::Clone {
                url: crate::recipe_url::recipe_url(recipe_url, template, recipe),
            }
        })
    }
}

/// A yes/no environment value: empty, `0`, `false`, `no`, `off` are no; `1`, `true`, `yes`,
/// `on` are yes (any case); anything else is a usage error naming the variable.
fn parse_boolish(var: &'static str, value: &str) -> Result<bool, NameError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "" | "0" | "false" | "no" | "off" | "n" | "f" => Ok(false),
        "1" | "true" | "yes" | "on" | "y" | "t" => Ok(true),
        _ => Err(NameError {
            what: var,
            value: value.to_owned(),
            rule: "must be 1/true/yes/on or 0/false/no/off (or empty)".to_owned(),
        }),
    }
}

/// Everything `lock` needs, validated.
#[derive(Debug, Clone)]
pub(crate) struct LockConfig {
    pub name: LockName,
    pub wait: Option<Duration>,
    /// The exit code when the lock is not acquired within `wait`.
    pub conflict_exit: u8,
    pub class: Class,
    pub promote_after: Duration,
    pub kill_grace: Duration,
    pub teardown_timeout: Duration,
    pub tie_to: Vec<i32>,
    pub cgroup: CgroupMode,
    /// Where the queue directories are (the last wait is recorded there).
    pub lock_dir: PathBuf,
    /// Where to write the host's metrics once the wait is over.
    pub metrics: Option<MetricsTarget>,
    pub command: Vec<OsString>,
}

/// Where `lock --metrics-file` writes the host's metrics, and the configuration they describe.
#[derive(Debug, Clone)]
pub(crate) struct MetricsTarget {
    pub file: PathBuf,
    pub global: Global,
}

/// Where a sweep looks for the processes of dead runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hunt {
    /// Every cgroup of ours in the hierarchy, and every process's environment: the janitor.
    Everywhere,
    /// The cgroups beside our own (where this host's runs make theirs), and the environment
    /// scan only when an app is about to be reaped: the sweep at the start of every run, which
    /// must stay cheap on a host with many processes.
    Nearby,
}

/// What a janitor sweep is asked to do.
#[derive(Debug, Clone)]
pub(crate) struct SweepOptions {
    pub dry_run: bool,
    pub hunt: Hunt,
    pub long_held: Duration,
    /// How long the Docker side of the reaps may take, confirmation included.
    pub reap_budget: Duration,
}

/// How long the Docker side of a reap may take by default, confirmation included.
pub(crate) const DEFAULT_REAP_BUDGET: Duration = Duration::from_secs(120);

/// How long any task must have been running for `converge` to count it, unless
/// `converge_stable` says.
pub(crate) const DEFAULT_STABLE: Duration = Duration::from_secs(1);

/// Twice the default hard deadline: no healthy run holds its lock that long.
pub(crate) const DEFAULT_LONG_HELD: Duration = Duration::from_secs(7200);

/// Where a setting's value came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind", content = "from")]
pub(crate) enum Origin {
    Flag,
    Environment(String),
    File(PathBuf),
    Default,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Flag => f.write_str("flag"),
            Self::Environment(var) => write!(f, "environment ({var})"),
            Self::File(path) => write!(f, "file ({})", path.display()),
            Self::Default => f.write_str("default"),
        }
    }
}

/// One effective setting, for `ccci-run config`.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Setting {
    pub key: &'static str,
    pub value: String,
    pub origin: Origin,
}

/// The resolved global settings (paths still to be validated by their users).
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    pub lock_dir: PathBuf,
    pub abra_home: PathBuf,
    pub runs_dir: PathBuf,
    pub state_dir: PathBuf,
    pub domain_suffix: String,
    pub docker: DockerMode,
    pub log_format: LogFormat,
    pub cgroup: CgroupMode,
    pub etcd: Option<EtcdSettings>,
    pub timings: Timings,
    pub recipe_url_template: Option<String>,
    pub node_sweep: NodeSweepSettings,
    /// Every setting with its origin, in a fixed order.
    pub settings: Vec<Setting>,
}

/// A value given on the command line or in the environment, with which of the two it was.
pub(crate) type Given<T> = Option<(T, Origin)>;

/// What the command line and the environment say about the global settings; the CLI produces
/// it, [`resolve`] layers the file and the defaults under it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Inputs {
    pub config: Option<PathBuf>,
    pub lock_dir: Given<PathBuf>,
    pub abra_home: Given<PathBuf>,
    pub runs_dir: Given<PathBuf>,
    pub state_dir: Given<PathBuf>,
    pub domain_suffix: Given<String>,
    pub docker: Given<DockerMode>,
    pub log_format: Given<LogFormat>,
    pub cgroup: Given<CgroupMode>,
    pub etcd_endpoints: Given<Vec<String>>,
    pub lease_ttl: Given<Duration>,
    /// Run settings given on the command line.
    pub timings: Vec<(Timing, Duration)>,
}

/// The first of: the value given, the file's, the default — with where it came from.
fn pick<T>(given: Given<T>, file: Option<T>, file_origin: &Origin, default: T) -> (T, Origin) {
    match (given, file) {
        (Some(given), _) => given,
        (None, Some(v)) => (v, file_origin.clone()),
        (None, None) => (default, Origin::Default),
    }
}

/// `$HOME/.abra`; when HOME is unset or empty, the home directory of the user we run as, and
/// `/root` only when even that is unknown.
fn home_default() -> PathBuf {
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            nix::unistd::User::from_uid(nix::unistd::Uid::effective())
                .ok()
                .flatten()
                .map(|user| user.dir)
        })
        .unwrap_or_else(|| PathBuf::from("/root"))
        .join(".abra")
}

/// Resolve the global settings: flag > environment > file > default.
pub(crate) fn resolve(inputs: &Inputs) -> Result<Resolved, NameError> {
    let (file, path) = load(inputs.config.as_deref())?;
    let from_file = Origin::File(path.clone().unwrap_or_default());
    let mut node_sweep_shown = Vec::new();
    let node_sweep = node_sweep_settings(&file, &from_file, &mut node_sweep_shown)?;
    let i = inputs.clone();
    let (timings, shown_timings) = resolve_timings(
        &i.timings,
        &file,
        path.as_deref().unwrap_or(Path::new("")),
        &from_file,
    )?;
    let absolute = |key: &'static str, (p, origin): (PathBuf, Origin)| {
        // A NUL cannot reach the kernel, and a newline or escape in a path would forge lines
        // in every listing and log that shows it.
        if let Some(c) = p
            .as_os_str()
            .as_encoded_bytes()
            .iter()
            .find(|b| b.is_ascii_control())
        {
            return Err(NameError {
                what: key,
                value: p.display().to_string().escape_debug().to_string(),
                rule: format!(
                    "holds the control character {:?}; a path has none",
                    char::from(*c)
                ),
            });
        }
        std::path::absolute(&p).map(|p| (p, origin)).map_err(|e| {
            invalid(
                key,
                &Some(p.clone()),
                format!("cannot be made absolute: {e}"),
            )
        })
    };
    let lock_dir = absolute(
        "lock_dir",
        pick(i.lock_dir, file.lock_dir, &from_file, "/run/lock".into()),
    )?;
    let abra_home = absolute(
        "abra_home",
        pick(i.abra_home, file.abra_home, &from_file, home_default()),
    )?;
    let runs_dir = absolute(
        "runs_dir",
        pick(
            i.runs_dir,
            file.runs_dir,
            &from_file,
            "/var/lib/cc-ci-runs".into(),
        ),
    )?;
    let state_dir = absolute(
        "state_dir",
        pick(i.state_dir, file.state_dir, &from_file, "/tmp".into()),
    )?;
    let default_suffix = crate::names::DEFAULT_DOMAIN_SUFFIX.to_owned();
    let domain_suffix = pick(
        i.domain_suffix,
        file.domain_suffix,
        &from_file,
        default_suffix,
    );
    let docker = pick(i.docker, file.docker, &from_file, DockerMode::Auto);
    let log_format = pick(i.log_format, file.log_format, &from_file, LogFormat::Text);
    let cgroup = pick(i.cgroup, file.cgroup, &from_file, CgroupMode::Auto);
    let endpoints = pick(
        i.etcd_endpoints,
        file.etcd_endpoints,
        &from_file,
        Vec::new(),
    );
    let file_path = path.clone().unwrap_or_default();
    let file_ttl = file
        .lease_ttl
        .as_ref()
        .map(|v| v.parse("lease_ttl", &LEASE_TTL_SPEC, &file_path))
        .transpose()?;
    let lease_ttl = pick(
        i.lease_ttl,
        file_ttl,
        &from_file,
        Duration::from_secs(DEFAULT_LEASE_TTL.into()),
    );
    let ttl_secs = u32::try_from(lease_ttl.0.as_secs()).unwrap_or(u32::MAX);
    let etcd = EtcdSettings::validate(&endpoints.0, ttl_secs).map_err(|rule| NameError {
        what: "etcd settings (--etcd-endpoints, --lease-ttl, CCCI_ETCD_ENDPOINTS, CCCI_LEASE_TTL, etcd_endpoints, lease_ttl)",
        value: endpoints.0.join(","),
        rule,
    })?;
    let shown = |p: &PathBuf| p.display().to_string();
    let settings = vec![
        setting("lock_dir", shown(&lock_dir.0), &lock_dir.1),
        setting("abra_home", shown(&abra_home.0), &abra_home.1),
        setting("runs_dir", shown(&runs_dir.0), &runs_dir.1),
        setting("state_dir", shown(&state_dir.0), &state_dir.1),
        setting("domain_suffix", domain_suffix.0.clone(), &domain_suffix.1),
        setting("docker", docker.0.name().to_owned(), &docker.1),
        setting("log_format", log_format.0.name().to_owned(), &log_format.1),
        setting("cgroup", cgroup.0.name().to_owned(), &cgroup.1),
        setting("etcd_endpoints", endpoints.0.join(","), &endpoints.1),
        setting(
            "lease_ttl",
            crate::duration::show(lease_ttl.0),
            &lease_ttl.1,
        ),
    ];
    let recipe_url_template = match std::env::var("CCCI_RECIPE_URL_TEMPLATE") {
        Ok(template) => Some((
            template,
            Origin::Environment("CCCI_RECIPE_URL_TEMPLATE".to_owned()),
        )),
        Err(_) => file
            .recipe_url_template
            .clone()
            .map(|t| (t, from_file.clone())),
    };
    let mut settings = settings;
    settings.extend(node_sweep_shown);
    settings.push(match &recipe_url_template {
        // Shown as the recipe URL is everywhere: credentials redacted.
        Some((t, origin)) => setting("recipe_url_template", crate::recipe_url::redact(t), origin),
        None => setting(
            "recipe_url_template",
            crate::recipe_url::DEFAULT_URL_TEMPLATE.to_owned(),
            &Origin::Default,
        ),
    });
    settings.extend(shown_timings);
    Ok(Resolved {
        lock_dir: lock_dir.0,
        abra_home: abra_home.0,
        runs_dir: runs_dir.0,
        state_dir: state_dir.0,
        domain_suffix: domain_suffix.0,
        docker: docker.0,
        log_format: log_format.0,
        cgroup: cgroup.0,
        etcd,
        timings,
        recipe_url_template: recipe_url_template.map(|(t, _)| t),
        node_sweep,
        settings,
    })
}

/// The node sweep's image and node socket: the environment, else the file, else the default;
/// each shown with its origin. An empty image, or a socket path that is not absolute, is
/// refused (the job would fail on every node, every sweep).
fn node_sweep_settings(
    file: &FileConfig,
    from_file: &Origin,
    settings: &mut Vec<Setting>,
) -> Result<NodeSweepSettings, NameError> {
    let env = |name: &str| {
        std::env::var(name)
            .ok()
            .map(|v| (v, Origin::Environment(name.to_owned())))
    };
    let (image, image_origin) = env("CCCI_NODE_SWEEP_IMAGE")
        .or_else(|| {
            file.node_sweep_image
                .clone()
                .map(|v| (v, from_file.clone()))
        })
        .unwrap_or_else(|| (DEFAULT_NODE_SWEEP_IMAGE.to_owned(), Origin::Default));
    if image.trim().is_empty() || image.chars().any(char::is_whitespace) {
        return Err(NameError {
            what: "node sweep image (CCCI_NODE_SWEEP_IMAGE, node_sweep_image)",
            value: image,
            rule: "must name an image with a docker CLI, such as docker:27-cli, without spaces"
                .to_owned(),
        });
    }
    let (socket, socket_origin) = env("CCCI_NODE_DOCKER_SOCKET")
        .map(|(v, o)| (PathBuf::from(v), o))
        .or_else(|| {
            file.node_docker_socket
                .clone()
                .map(|v| (v, from_file.clone()))
        })
        .unwrap_or_else(|| (PathBuf::from(DEFAULT_NODE_DOCKER_SOCKET), Origin::Default));
    if !socket.is_absolute() {
        return Err(NameError {
            what: "node Docker socket (CCCI_NODE_DOCKER_SOCKET, node_docker_socket)",
            value: socket.display().to_string(),
            rule: "must be an absolute path, the same on every node, such as /var/run/docker.sock"
                .to_owned(),
        });
    }
    settings.push(setting("node_sweep_image", image.clone(), &image_origin));
    settings.push(setting(
        "node_docker_socket",
        socket.display().to_string(),
        &socket_origin,
    ));
    Ok(NodeSweepSettings { image, socket })
}

/// The run settings: each from the command line, else its environment variable, else the
/// file, else its default; with what `ccci-run config` shows of each.
fn resolve_timings(
    flags: &[(Timing, Duration)],
    file: &FileConfig,
    path: &Path,
    from_file: &Origin,
) -> Result<(Timings, Vec<Setting>), NameError> {
    let mut timings = Timings::default();
    let mut shown = Vec::new();
    for (at, info) in TIMINGS.iter().enumerate() {
        let flag = flags
            .iter()
            .rev()
            .find(|(t, _)| *t == info.timing)
            .map(|(_, v)| (*v, Origin::Flag));
        // A flag wins: the variable is not even read then, so a bad value set for every step
        // never turns an explicit flag into a usage error.
        let env = match std::env::var_os(info.env).filter(|_| flag.is_none()) {
            Some(value) => {
                let text = value.to_string_lossy();
                let parsed =
                    crate::duration::parse(&text, &info.spec).map_err(|rule| NameError {
                        what: info.env,
                        value: text.clone().into_owned(),
                        rule,
                    })?;
                Some((parsed, Origin::Environment(info.env.to_owned())))
            }
            None => None,
        };
        let from_file_value = file
            .timing(info.timing)
            .map(|v| v.parse(info.key, &info.spec, path))
            .transpose()?;
        let (value, origin) = match (flag.or(env), from_file_value) {
            (Some(given), _) => (Some(given.0), given.1),
            (None, Some(v)) => (Some(v), from_file.clone()),
            (None, None) => (info.default, Origin::Default),
        };
        timings.values[at] = value;
        let text = value.map_or_else(|| info.unset.to_owned(), crate::duration::show);
        shown.push(setting(info.key, text, &origin));
    }
    Ok((timings, shown))
}

fn setting(key: &'static str, value: String, origin: &Origin) -> Setting {
    Setting {
        key,
        value,
        origin: origin.clone(),
    }
}

fn invalid(what: &'static str, path: &Option<PathBuf>, rule: String) -> NameError {
    NameError {
        what,
        value: path
            .as_deref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        rule,
    }
}

/// Read the configuration file: the one named (it must exist), else the default one if it
/// exists, else none; either only if it passes [`crate::config_file::read`]'s checks.
fn load(config: Option<&Path>) -> Result<(FileConfig, Option<PathBuf>), NameError> {
    let (path, required) = match config {
        Some(path) => (path.to_owned(), true),
        None => (PathBuf::from(DEFAULT_FILE), false),
    };
    let Some(text) = crate::config_file::read(&path, required)? else {
        return Ok((FileConfig::default(), None));
    };
    parse(&text, &path).map(|config| (config, Some(path)))
}

/// `CCCI_LOG_FORMAT`, when it names a format.
pub(crate) fn log_format_from_env() -> Option<LogFormat> {
    std::env::var("CCCI_LOG_FORMAT")
        .ok()
        .and_then(|v| LogFormat::from_name(&v))
}

/// The log format of an error that came before the configuration could be resolved: `given`
/// (the flag, else the environment), else the configuration file's `log_format` when that
/// file can be read and parsed, else text.
pub(crate) fn log_format_for_errors(
    given: Option<LogFormat>,
    config: Option<PathBuf>,
) -> LogFormat {
    given
        .or_else(|| load(config.as_deref()).ok()?.0.log_format)
        .unwrap_or(LogFormat::Text)
}

/// Parse a configuration file's text; errors name the file and, from the TOML parser, the line
/// and column with the line itself and a caret under the fault (several lines, kept as the
/// parser drew them), and for a mistyped key or value the nearest one that is known.
pub(crate) fn parse(text: &str, path: &Path) -> Result<FileConfig, NameError> {
    toml::from_str(text).map_err(|e| {
        // The snippet quotes the file: a control character in it must not reach a terminal.
        let mut rule: String = e
            .to_string()
            .trim_end()
            .chars()
            .map(|c| match c {
                '\n' | '\t' => c.to_string(),
                c if c.is_control() => c.escape_default().to_string(),
                c => c.to_string(),
            })
            .collect();
        if let Some(near) = nearest_known(e.message()) {
            rule.push_str(&format!("\ndid you mean `{near}`?"));
        }
        NameError {
            what: "configuration file",
            value: path.display().to_string(),
            rule,
        }
    })
}

/// For serde's "unknown field `x`, expected one of `a`, `b`" (or "unknown variant ..."), the
/// expected name nearest to `x`, if one is near enough to be what was meant. The names come
/// from the message, so they are always the ones the file really accepts.
fn nearest_known(message: &str) -> Option<String> {
    let rest = message
        .strip_prefix("unknown field `")
        .or_else(|| message.strip_prefix("unknown variant `"))?;
    let (given, expected) = rest.split_once('`')?;
    let (_, expected) = expected.split_once("expected")?;
    expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|known| (strsim::jaro(given, known), known))
        // The threshold clap uses for its own suggestions.
        .filter(|(score, _)| *score > 0.7)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, known)| known.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_ttl_must_hold_the_kill_grace_the_margin_and_the_keepalive_headroom() {
        let etcd = |ttl: u32| EtcdSettings {
            endpoints: vec!["127.0.0.1:2379".into()],
            lease_ttl: Duration::from_secs(ttl.into()),
        };
        // The defaults agree.
        let grace = TIMINGS[1].default.unwrap();
        assert_eq!(TIMINGS[1].timing, Timing::KillGrace);
        etcd(DEFAULT_LEASE_TTL).check_stop_budget(grace).unwrap();
        // Grace + 0.5 s + 1.5 s, to the second.
        etcd(5).check_stop_budget(Duration::from_secs(3)).unwrap();
        let err = etcd(5)
            .check_stop_budget(Duration::from_millis(3001))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("smallest lease TTL that works is 6 s"),
            "{err}"
        );
        assert!(err.contains("a kill grace of at most 3s"), "{err}");
        // The smallest TTL allows no kill grace at all.
        etcd(2).check_stop_budget(Duration::ZERO).unwrap();
        let err = etcd(2)
            .check_stop_budget(Duration::from_secs(1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("is 3 s"), "{err}");
        assert!(!err.contains("at most"), "{err}");
        assert_eq!(
            EtcdSettings::stop_budget(Duration::from_secs(2)),
            Duration::from_millis(2500)
        );
    }

    #[test]
    fn every_key_parses_and_unknown_keys_are_refused() {
        let path = Path::new("/etc/ccci-run/config.toml");
        let config = parse(
            "lock_dir = \"/run/lock\"\nabra_home = \"/root/.abra\"\nruns_dir = \"/r\"\n\
             state_dir = \"/s\"\ndomain_suffix = \"ci.example\"\ndocker = \"required\"\n\
             log_format = \"json\"\ncgroup = \"off\"\n",
            path,
        )
        .unwrap();
        assert_eq!(config.docker, Some(DockerMode::Required));
        assert_eq!(config.cgroup, Some(CgroupMode::Off));
        let err = parse("lock_dri = \"/x\"\n", path).unwrap_err();
        assert!(err.to_string().contains("lock_dri"), "{err}");
        assert!(parse("docker = \"sometimes\"\n", path).is_err());
    }

    /// The parser's snippet stays as it drew it, on its own lines, and a near miss is named.
    #[rstest::rstest]
    #[case("run_dir = \"/r\"\n", "run_dir", Some("runs_dir"))]
    #[case("lock_dri = \"/x\"\n", "lock_dri", Some("lock_dir"))]
    #[case("docker = \"requird\"\n", "requird", Some("required"))]
    #[case("zzz = 1\n", "zzz", None)]
    fn a_toml_error_keeps_its_snippet_and_names_the_nearest_key(
        #[case] text: &str,
        #[case] given: &str,
        #[case] near: Option<&str>,
    ) {
        let err = parse(text, Path::new("/etc/ccci-run/config.toml"))
            .unwrap_err()
            .to_string();
        let lines: Vec<&str> = err.lines().collect();
        assert!(
            lines[0].starts_with(
                "invalid configuration file \"/etc/ccci-run/config.toml\": \
                 TOML parse error at line 1, column "
            ),
            "{err}"
        );
        assert_eq!(lines[1], "  |", "{err}");
        assert_eq!(lines[2], format!("1 | {}", text.trim_end()), "{err}");
        assert!(
            lines[3].starts_with("  | ") && lines[3].ends_with('^'),
            "{err}"
        );
        assert!(lines[4].contains(&format!("`{given}`")), "{err}");
        match near {
            Some(near) => assert_eq!(
                lines.last().copied(),
                Some(format!("did you mean `{near}`?").as_str()),
                "{err}"
            ),
            None => assert!(!err.contains("did you mean"), "{err}"),
        }
    }

    #[test]
    fn a_named_file_must_exist_and_etcd_settings_are_validated() {
        let dir = tempfile::tempdir().unwrap();
        let mut inputs = Inputs {
            config: Some(dir.path().join("missing.toml")),
            ..Inputs::default()
        };
        let err = load(inputs.config.as_deref()).unwrap_err();
        assert!(
            err.to_string()
                .contains("cannot be read (--config, CCCI_CONFIG)"),
            "{err}"
        );
        let file = dir.path().join("etcd.toml");
        std::fs::write(
            &file,
            "etcd_endpoints = [\"http://127.0.0.1:2379\", \"10.0.0.2:2379\"]\nlease_ttl = 15\n",
        )
        .unwrap();
        inputs.config = Some(file.clone());
        let resolved = resolve(&inputs).unwrap();
        assert_eq!(
            resolved.etcd,
            Some(EtcdSettings {
                endpoints: vec!["http://127.0.0.1:2379".into(), "10.0.0.2:2379".into()],
                lease_ttl: Duration::from_secs(15),
            })
        );
        // A flag wins over the file, as everywhere.
        inputs.lease_ttl = Some((Duration::from_secs(20), Origin::Flag));
        assert_eq!(
            resolve(&inputs).unwrap().etcd.unwrap().lease_ttl,
            Duration::from_secs(20)
        );
        for (endpoints, ttl, why) in [
            ("https://a:2379", 10, "no TLS"),
            ("a", 10, "HOST:PORT"),
            ("a:0", 10, "port in 1-65535"),
            ("a:2379", 1, "out of range"),
            ("a:2379", 100_000, "out of range"),
        ] {
            inputs.etcd_endpoints = Some((vec![endpoints.to_owned()], Origin::Flag));
            inputs.lease_ttl = Some((Duration::from_secs(ttl), Origin::Flag));
            let err = resolve(&inputs).unwrap_err().to_string();
            assert!(
                err.contains(why) && err.contains("--etcd-endpoints"),
                "{err}"
            );
        }
        // No endpoints: the local flock, whatever the TTL says.
        inputs.etcd_endpoints = Some((Vec::new(), Origin::Flag));
        inputs.lease_ttl = None;
        std::fs::write(&file, "").unwrap();
        assert_eq!(resolve(&inputs).unwrap().etcd, None);
    }

    #[test]
    fn run_settings_come_from_flag_then_file_then_default_with_their_origin() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.toml");
        std::fs::write(
            &file,
            "deadline = \"90m\"\nkill_grace = 1.5\nkeep_runs = \"14d\"\nlease_ttl = \"15s\"\n\
             reap_budget = 60\n",
        )
        .unwrap();
        let mut inputs = Inputs {
            config: Some(file.clone()),
            ..Inputs::default()
        };
        let resolved = resolve(&inputs).unwrap();
        let t = &resolved.timings;
        assert_eq!(t.value(Timing::Deadline), Duration::from_secs(5400));
        assert_eq!(t.value(Timing::KillGrace), Duration::from_millis(1500));
        assert_eq!(
            t.get(Timing::KeepRuns),
            Some(Duration::from_secs(14 * 86_400))
        );
        assert_eq!(t.value(Timing::ReapBudget), Duration::from_secs(60));
        assert_eq!(t.value(Timing::TeardownTimeout), Duration::from_secs(300));
        assert_eq!(t.get(Timing::LockWait), None);
        let shown = |resolved: &Resolved, key: &str| {
            let s = resolved.settings.iter().find(|s| s.key == key).unwrap();
            (s.value.clone(), s.origin.clone())
        };
        assert_eq!(
            shown(&resolved, "deadline"),
            ("1h30m".to_owned(), Origin::File(file.clone()))
        );
        assert_eq!(
            shown(&resolved, "lock_wait"),
            ("none (until the deadline)".to_owned(), Origin::Default)
        );
        assert_eq!(shown(&resolved, "lease_ttl").0, "15s");
        inputs.timings = vec![(Timing::Deadline, Duration::from_secs(60))];
        let resolved = resolve(&inputs).unwrap();
        assert_eq!(
            resolved.timings.value(Timing::Deadline),
            Duration::from_secs(60)
        );
        assert_eq!(
            shown(&resolved, "deadline"),
            ("1m".to_owned(), Origin::Flag)
        );
    }

    #[rstest::rstest]
    #[case("deadline = \"5x\"\n", "deadline")]
    #[case("deadline = 0\n", "too short")]
    #[case("kill_grace = -1\n", "kill_grace")]
    #[case("keep_runs = 14\n", "14d")]
    #[case("teardown_timeout = \"\"\n", "empty")]
    #[case("long_held = \"400d\"\n", "too long")]
    #[case("lease_ttl = 2.5\n", "whole number")]
    #[case("promote_after = true\n", "promote_after")]
    fn a_bad_run_setting_in_the_file_names_key_file_and_forms(
        #[case] text: &str,
        #[case] needle: &str,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.toml");
        std::fs::write(&file, text).unwrap();
        let inputs = Inputs {
            config: Some(file.clone()),
            ..Inputs::default()
        };
        let err = resolve(&inputs).unwrap_err().to_string();
        assert!(err.contains(needle), "{text:?}: {err}");
        assert!(err.contains(&file.display().to_string()), "{err}");
    }
}
