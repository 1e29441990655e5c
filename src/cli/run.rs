//! `run`'s arguments, and the app identity (`--recipe`, `--pr`, `--ref`) that `run`, `app-domain` and `converge` share.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::cli::globals::GlobalArgs;
use crate::cli::parse::{
    deadline, kill_grace, lock_wait, parse_pid, teardown_timeout, unique_pids,
};
use crate::config::{Fetch, Global, Identity, RunConfig, Timing};
use crate::names::{DomainSuffix, DroneBuild, NameError, RunId};

#[derive(Debug, Args)]
pub(crate) struct AppDomainArgs {
    #[command(flatten)]
    pub identity: IdentityArgs,
    /// A checkout of the recipe: also print the longest domain suffix its names allow (each
    /// within Docker's limits: 63 for a service or network, 64 for a secret or config), and
    /// every name over a limit under the current suffix.
    #[arg(long, value_name = "DIR")]
    pub names_in: Option<PathBuf>,
    #[command(flatten)]
    pub global: GlobalArgs,
}

#[derive(Debug, Args)]
pub(crate) struct IdentityArgs {
    /// Recipe name.
    #[arg(long, value_name = "R")]
    pub recipe: String,
    /// Pull request number.
    #[arg(long, value_name = "N")]
    pub pr: Option<String>,
    /// Branch, tag or commit.
    #[arg(long = "ref", value_name = "REF")]
    pub git_ref: Option<String>,
}

#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub identity: IdentityArgs,
    /// Run id [default: <owner>.<name>.<number> of $DRONE_REPO and $DRONE_BUILD_NUMBER, else
    /// manual-<pid>].
    #[arg(long, value_name = "ID")]
    pub run_id: Option<String>,
    /// Hard deadline for the whole run [env: CCCI_DEADLINE; file: deadline; default: 1h].
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, value_parser = deadline)]
    pub deadline: Option<Duration>,
    /// Give up waiting for the app lock after DURATION (exit 75)
    /// [env: CCCI_LOCK_WAIT; file: lock_wait; default: until the deadline].
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, value_parser = lock_wait)]
    pub lock_wait: Option<Duration>,
    /// Time between SIGTERM and SIGKILL of the command's process group
    /// [env: CCCI_KILL_GRACE; file: kill_grace; default: 10s].
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, value_parser = kill_grace)]
    pub kill_grace: Option<Duration>,
    /// Time the rest of the teardown (hook, app removal) may take after the kill grace; the
    /// whole run is bounded by deadline + kill grace + this, whatever happens
    /// [env: CCCI_TEARDOWN_TIMEOUT; file: teardown_timeout; default: 5m].
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, value_parser = teardown_timeout)]
    pub teardown_timeout: Option<Duration>,
    /// Refuse to run unless our parent process is PID (pass the step shell's $$; 1 when a
    /// container's init runs the step).
    #[arg(long, value_name = "PID", value_parser = parse_pid)]
    pub expect_parent: Option<i32>,
    /// Tear down when any of these processes exits; each must be an ancestor (the CI step
    /// shell's $$, and its parent, the runner).
    #[arg(long, value_name = "PID,...", env = "CCCI_TIE_TO", value_delimiter = ',', value_parser = parse_pid)]
    pub tie_to: Vec<i32>,
    /// Shell command run (sh -c, with the run's environment) during teardown.
    #[arg(long, value_name = "CMD")]
    pub on_teardown: Option<String>,
    /// Keep the app (its .env and Docker resources) and skip --on-teardown; processes are still
    /// stopped, and the next janitor sweep reaps the app once this run is over.
    #[arg(long)]
    pub no_teardown: bool,
    /// Leave $ABRA_DIR/recipes empty instead of fetching the recipe.
    #[arg(long, conflicts_with = "skip_fetch")]
    pub no_fetch: bool,
    /// Copy the staged <abra-home>/recipes/<recipe> (with its .git) instead of fetching
    /// [also CCCI_SKIP_FETCH=1; 0, false or empty mean no].
    #[arg(long)]
    pub skip_fetch: bool,
    /// Where to clone the recipe from (https, a path or file://)
    /// [default: $CCCI_RECIPE_URL_TEMPLATE, else the file's recipe_url_template, with {recipe}
    /// filled in; else https://git.coopcloud.tech/coop-cloud/{recipe}.git].
    #[arg(long, value_name = "URL")]
    pub recipe_url: Option<String>,
    /// The command to supervise.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
    #[command(flatten)]
    pub global: GlobalArgs,
}

impl IdentityArgs {
    pub(crate) fn validate(&self, suffix: &DomainSuffix) -> Result<Identity, NameError> {
        Identity::validate(
            &self.recipe,
            self.pr.as_deref(),
            self.git_ref.as_deref(),
            suffix,
        )
    }
}

impl RunArgs {
    pub(crate) fn validate(&self, global: &Global) -> Result<RunConfig, NameError> {
        let identity = self.identity.validate(&global.suffix)?;
        let drone = DroneBuild::from_vars(crate::config::env::non_empty);
        let run_id = RunId::resolve(self.run_id.as_deref(), &drone)?;
        let fetch = Fetch::choose(
            self.no_fetch,
            self.skip_fetch,
            self.recipe_url.as_deref(),
            global.recipe_url_template.as_deref(),
            &identity.recipe,
        )?;
        let t = &global.timings;
        if let Some(etcd) = &global.etcd {
            etcd.check_stop_budget(t.value(Timing::KillGrace))?;
        }
        Ok(RunConfig {
            identity,
            run_id,
            repo: drone.repo,
            deadline: t.value(Timing::Deadline),
            kill_grace: t.value(Timing::KillGrace),
            teardown_timeout: t.value(Timing::TeardownTimeout),
            lock_wait: t.get(Timing::LockWait),
            expect_parent: self.expect_parent,
            tie_to: unique_pids(&self.tie_to)?,
            on_teardown: self.on_teardown.clone(),
            no_teardown: self.no_teardown,
            fetch,
            command: self.command.clone(),
        })
    }
}
