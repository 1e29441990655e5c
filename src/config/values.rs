//! The values settings take: the timings with their bounds and defaults ([`TIMINGS`]), the
//! settings with a fixed set of values ([`Choice`]: `Class`, `DockerMode`, `CgroupMode`,
//! `LogFormat`), and the defaults several floors share, each with the setting that carries it.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::duration::Spec;

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
        // A bare number used to mean days: it is refused rather than read as seconds. Under an
        // hour would remove the directory of a run that has just finished, before anyone read it.
        spec: Spec {
            min: Duration::from_secs(3600),
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
    pub(super) values: [Option<Duration>; TIMINGS.len()],
    /// Where each came from (a flag, a variable, the file, or the default).
    pub(super) origins: [Origin; TIMINGS.len()],
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

    /// Where `timing`'s value came from.
    pub(crate) fn origin(&self, timing: Timing) -> &Origin {
        let at = TIMINGS
            .iter()
            .position(|t| t.timing == timing)
            .expect("every run setting is in the table");
        &self.origins[at]
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
            origins: std::array::from_fn(|_| Origin::Default),
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

/// The node sweep's image when none is given: Docker's own CLI image. A fleet without a
/// registry pre-loads it (or its own) on every node.
pub(crate) const DEFAULT_NODE_SWEEP_IMAGE: &str = "docker:27-cli";

/// Where a node's engine listens when nothing else is said: the engine's default socket.
pub(crate) const DEFAULT_NODE_DOCKER_SOCKET: &str = DEFAULT_DOCKER_SOCKET;

/// The engine's socket when nothing names another (`DOCKER_HOST` unset or empty, no
/// `--docker-host`, no `docker_host`).
pub(crate) const DEFAULT_DOCKER_SOCKET: &str = "/var/run/docker.sock";
/// The lease TTL when none is given, in seconds: room for the default kill grace (10 s), the
/// kill margin and the keepalive headroom ([`EtcdSettings::check_stop_budget`]).
pub(crate) const DEFAULT_LEASE_TTL: u32 = 15;

/// What a SIGKILL (to a process group, or `cgroup.kill`) may take to empty what it hits, added
/// to the kill grace in a holder's stop budget. Measured with the fence's own report (`cgroup.kill`,
/// the process groups and the marker scan until nothing of a run with eight processes is left):
/// 1.7–12 ms on an idle 2-core host, 3–23 ms with both cores busy; twenty times that leaves room
/// for a host under memory pressure.
pub(crate) const KILL_MARGIN: Duration = Duration::from_millis(500);

/// etcd's election timeout, as its members run by default (`--election-timeout 1000`): a
/// follower that hears nothing from its leader for a random time between one and two of these
/// calls an election.
pub(crate) const ETCD_ELECTION_TIMEOUT: Duration = Duration::from_millis(1000);

/// How much of a lease's TTL must be left for keepalives once the stop budget is set aside:
/// several keepalive rounds, each given up on a member that does not answer for the next
/// (1.5 s), and an etcd leader election, which takes up to twice the members' election timeout
/// before a new leader answers (measured in the fleet tests: a leader killed on a busy host),
/// or a healthy cluster that changes leaders would make a holder stop its command. A cluster
/// run with a longer `--election-timeout` needs that much more TTL.
pub(crate) const LEASE_HEADROOM: Duration =
    Duration::from_millis(1500 + 2 * ETCD_ELECTION_TIMEOUT.as_millis() as u64);
/// The bounds of a lease TTL, in seconds: below 2 s an etcd server rounds it up anyway (its
/// election timeout), above an hour a dead holder blocks the fleet for too long.
pub(crate) const LEASE_TTL_RANGE: std::ops::RangeInclusive<u32> = 2..=3600;

/// The largest stop budget any configuration can give a holder: it must fit in its lease TTL
/// ([`EtcdSettings::check_stop_budget`]), at most the longest TTL. A record that says more was
/// not written by a holder.
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
pub(crate) const MAX_STOP_BUDGET: Duration = Duration::from_secs(*LEASE_TTL_RANGE.end() as u64);

/// The longest lease TTL any configuration gives: a record that says more was not written by a
/// holder.
#[cfg_attr(not(feature = "etcd"), allow(dead_code))]
pub(crate) const MAX_LEASE_TTL: Duration = Duration::from_secs(*LEASE_TTL_RANGE.end() as u64);

/// The one form an etcd endpoint is written in, as every refusal names it.
pub(crate) const ENDPOINT_FORM: &str =
    "write each endpoint as http://HOST:PORT (https:// is not supported by this build)";
