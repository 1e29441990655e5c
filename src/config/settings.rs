//! The validated configurations each command is handed (`Global`, `RunConfig`, `LockConfig`,
//! ...): absolute, checked, each value with where it came from.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use crate::config::env;
use crate::config::resolve::{Resolved, parse_boolish};
use crate::config::services::{DockerHost, EtcdSettings, NodeSweepSettings};
use crate::config::values::{CgroupMode, Class, DockerMode, Hunt, Timings};

use crate::names::{
    AppDomain, DomainSuffix, GitRef, LockName, NameError, PrNumber, Recipe, RunAppPattern, RunId,
};

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
