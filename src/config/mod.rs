//! One source of configuration: every global setting comes from the command line, else the
//! environment, else the configuration file, else the built-in default — and the paths that
//! the Drone step, the janitor's timer and an operator's shell use stay the same because they
//! all read one file (`--config`, `CCCI_CONFIG`, or `/etc/ccci-run/config.toml` when it exists).
//!
//! Invariant: what comes out is absolute and validated; nothing downstream parses a setting
//! again, and `ccci-run config` shows each value with where it came from.
//!
//! Here: the validated configurations each command is handed (`Global`, `RunConfig`,
//! `LockConfig`, ...); the values settings take are [`values`], the file's settings [`file`],
//! the resolution of each setting from its four sources [`resolve`], what a missing
//! configured directory means [`dirs`], and the one reader of the environment [`env`].
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

pub(crate) mod dirs;
pub(crate) mod env;
mod file;
mod resolve;
mod values;

pub(crate) use file::*;
pub(crate) use resolve::*;
pub(crate) use values::*;

/// The engine as `--docker-host` or the configuration file's `docker_host` names it, with the
/// file's TLS settings. Whatever the environment says of TLS (`DOCKER_TLS_VERIFY`,
/// `DOCKER_CERT_PATH`) goes first, as for every setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DockerHost {
    pub host: String,
    pub origin: Origin,
    pub tls_verify: bool,
    pub cert_path: Option<PathBuf>,
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
    /// The runner's user and group (`runner_user`), when it is not root.
    pub runner: Option<(u32, u32)>,
    /// The engine, when the command line or the configuration file names it (the environment's
    /// `DOCKER_HOST` is read where the engine is chosen, [`crate::docker::endpoint`]).
    pub docker_host: Option<DockerHost>,
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
pub(crate) const DEFAULT_NODE_DOCKER_SOCKET: &str = DEFAULT_DOCKER_SOCKET;

/// The engine's socket when nothing names another (`DOCKER_HOST` unset or empty, no
/// `--docker-host`, no `docker_host`).
pub(crate) const DEFAULT_DOCKER_SOCKET: &str = "/var/run/docker.sock";

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

impl EtcdSettings {
    /// Validate endpoints as given (flag, environment or file): at least one, each
    /// `http://HOST:PORT` and nothing else. The scheme is required: a bare `HOST:PORT` would be
    /// read by the client as plain http, which a reader of the setting cannot tell from TLS; and
    /// this build speaks no TLS.
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
            // The setting's value is named by the caller: one endpoint of several is named here.
            let which = if endpoints.len() > 1 {
                format!("endpoint {endpoint:?}: ")
            } else {
                String::new()
            };
            let Some(rest) = endpoint.strip_prefix("http://") else {
                let why = if endpoint.contains("://") {
                    "its scheme is not http://"
                } else {
                    "the scheme is missing"
                };
                return Err(format!("{which}{why}: {ENDPOINT_FORM}"));
            };
            let (host, port) = rest
                .trim_end_matches('/')
                .rsplit_once(':')
                .ok_or_else(|| format!("{which}the port is missing: {ENDPOINT_FORM}"))?;
            if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
                return Err(format!("{which}{ENDPOINT_FORM} with a port in 1-65535"));
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
                 to take effect), and the lease needs {} more for keepalives and an etcd leader \
                 election; the smallest \
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
            docker_host: resolved.docker_host.clone(),
            runner: resolved.runner,
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
    /// The Drone repository (`owner/name`) the run's build belongs to, when a step says so.
    pub repo: Option<String>,
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
        let skip_from_env = env::var("CCCI_SKIP_FETCH")
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

/// What a janitor sweep is asked to do.
#[derive(Debug, Clone)]
pub(crate) struct SweepOptions {
    pub dry_run: bool,
    pub hunt: Hunt,
    pub long_held: Duration,
    /// How long the Docker side of the reaps may take, confirmation included.
    pub reap_budget: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_ttl_must_hold_the_kill_grace_the_margin_and_the_keepalive_headroom() {
        let etcd = |ttl: u32| EtcdSettings {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            lease_ttl: Duration::from_secs(ttl.into()),
        };
        // The defaults agree.
        let grace = TIMINGS[1].default.unwrap();
        assert_eq!(TIMINGS[1].timing, Timing::KillGrace);
        etcd(DEFAULT_LEASE_TTL).check_stop_budget(grace).unwrap();
        // Grace + 0.5 s + 3.5 s, to the second.
        etcd(7).check_stop_budget(Duration::from_secs(3)).unwrap();
        let err = etcd(7)
            .check_stop_budget(Duration::from_millis(3001))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("smallest lease TTL that works is 8 s"),
            "{err}"
        );
        assert!(err.contains("a kill grace of at most 3s"), "{err}");
        // The smallest TTL that works allows no kill grace at all.
        etcd(4).check_stop_budget(Duration::ZERO).unwrap();
        etcd(3).check_stop_budget(Duration::ZERO).unwrap_err();
        let err = etcd(4)
            .check_stop_budget(Duration::from_secs(1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("is 5 s"), "{err}");
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
            "etcd_endpoints = [\"http://127.0.0.1:2379\", \"http://10.0.0.2:2379\"]\nlease_ttl = 15\n",
        )
        .unwrap();
        inputs.config = Some(file.clone());
        let resolved = resolve(&inputs).unwrap();
        assert_eq!(
            resolved.etcd,
            Some(EtcdSettings {
                endpoints: vec![
                    "http://127.0.0.1:2379".into(),
                    "http://10.0.0.2:2379".into()
                ],
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
            (
                "https://a:2379",
                10,
                "its scheme is not http://: write each endpoint as http://HOST:PORT (https:// is not supported by this build)",
            ),
            (
                "http://a",
                10,
                "the port is missing: write each endpoint as http://HOST:PORT",
            ),
            ("http://a:0", 10, "port in 1-65535"),
            (
                "10.0.0.1:2379",
                10,
                "the scheme is missing: write each endpoint as http://HOST:PORT",
            ),
            ("a", 10, "the scheme is missing"),
            ("http://a:2379", 1, "out of range"),
            ("http://a:2379", 100_000, "out of range"),
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
    #[case("keep_runs = \"0d\"\n", "at least 1h")]
    #[case("teardown_timeout = \"\"\n", "empty")]
    #[case("long_held = \"400d\"\n", "too long")]
    #[case("lease_ttl = 2.5\n", "whole number")]
    #[case("promote_after = true\n", "promote_after")]
    #[case(
        "recipe_url_template = \"https://u:SECRET@git.example.org/r.git\"\n",
        "https://***@git.example.org/r.git\": from the file"
    )]
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
