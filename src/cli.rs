//! The command line: raw clap arguments, validated once into the configuration types of
//! [`crate::config`]. Only the entry point uses this module; nothing downstream parses strings
//! again, and no type outside it knows clap.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, Parser, Subcommand};

use crate::config::{
    CgroupMode, Choice, DockerMode, Fetch, Given, Global, Identity, Inputs, LockConfig, LogFormat,
    Origin, RunConfig, SweepOptions,
};
use crate::lock::queue::Class;
use crate::names::{DomainSuffix, LockName, NameError, RunId};

#[derive(Debug, Parser)]
#[command(
    name = "ccci-run",
    version,
    // A later flag wins over an earlier one, as scripts that append overrides expect.
    args_override_self = true,
    about = "Daemonless run supervisor for recipe CI on a Co-op Cloud host",
    long_about = "Daemonless run supervisor for recipe CI on a Co-op Cloud host.\n\n\
        A run can never outlive its CI step or its hard deadline, gets its own ABRA_DIR, \
        serialises with other runs of the same app domain through a kernel flock (or, across \
        hosts, an etcd lease), and leaves nothing behind that a later janitor sweep would not reap.",
    after_help = "Exit codes: the command's own status (128+N when signal N killed it); \
        2 invalid input; 75 lock not acquired in time; 125 ccci-run failed; \
        126/127 command not executable / not found; 129/130/131/143 SIGHUP/SIGINT/SIGQUIT/SIGTERM \
        after teardown (143 also when the parent or the --tie-to process died); \
        142 hard deadline after teardown; 76 the lock was lost while held (an etcd lease \
        expired or was revoked) after teardown."
)]
pub(crate) struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Settings every command that uses them takes, before or after its name.
#[derive(Debug, Args)]
#[command(next_help_heading = "Global options")]
pub(crate) struct GlobalArgs {
    /// Configuration file (TOML: lock_dir, abra_home, runs_dir, state_dir, domain_suffix,
    /// docker, log_format, cgroup, etcd_endpoints, lease_ttl) [default: /etc/ccci-run/config.toml when it exists].
    /// Precedence: flag > environment > file > built-in default.
    #[arg(long, value_name = "FILE", env = "CCCI_CONFIG")]
    pub config: Option<PathBuf>,
    /// Directory of the app-domain lock files and named-lock files [default: /run/lock].
    #[arg(long, value_name = "DIR", env = "CCCI_APP_LOCK_DIR")]
    pub lock_dir: Option<PathBuf>,
    /// The canonical abra directory (servers/, catalogue/, recipes/) [default: $HOME/.abra].
    #[arg(long, value_name = "DIR", env = "CCCI_ABRA_HOME")]
    pub abra_home: Option<PathBuf>,
    /// Directory of the per-run directories and run records [default: /var/lib/cc-ci-runs].
    #[arg(long, value_name = "DIR", env = "CCCI_RUNS_DIR")]
    pub runs_dir: Option<PathBuf>,
    /// Directory of the run-scoped state files [default: /tmp].
    #[arg(long, value_name = "DIR", env = "CCCI_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Run-app domains end in `.SUFFIX` [default: ci.commoninternet.net].
    #[arg(long, value_name = "SUFFIX", env = "CCCI_DOMAIN_SUFFIX")]
    pub domain_suffix: Option<String>,
    /// Whether to touch Docker; DOCKER_HOST is honoured [default: auto].
    #[arg(long, value_name = "MODE", env = "CCCI_DOCKER", value_parser = choice::<DockerMode>())]
    pub docker: Option<DockerMode>,
    /// Whether runs and `lock` commands get a cgroup of their own (cgroup v2, where writable)
    /// [default: auto].
    #[arg(long, value_name = "MODE", env = "CCCI_CGROUP", value_parser = choice::<CgroupMode>())]
    pub cgroup: Option<CgroupMode>,
    /// etcd endpoints, comma-separated (http://HOST:PORT): the app-domain and named locks become
    /// keys bound to leases, shared by every host on the same etcd [default: none: this host's
    /// flock].
    #[arg(
        long,
        value_name = "URL,...",
        env = "CCCI_ETCD_ENDPOINTS",
        value_delimiter = ','
    )]
    pub etcd_endpoints: Option<Vec<String>>,
    /// Seconds an etcd lease outlives its holder's last keepalive: how soon a dead holder's lock
    /// frees, and how long etcd may be unreachable before a holder counts its lock lost
    /// [default: 10].
    #[arg(long, value_name = "SECS", env = "CCCI_LEASE_TTL")]
    pub lease_ttl: Option<u32>,
    /// Diagnostics format: text, or json (then all of stderr is JSON, one object a line, status
    /// lines included) [default: text].
    #[arg(long, value_name = "F", env = "CCCI_LOG_FORMAT", value_parser = choice::<LogFormat>())]
    pub log_format: Option<LogFormat>,
    /// More diagnostics (-v info, -vv debug, -vvv trace); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Fewer diagnostics (errors only).
    #[arg(short, long, action = clap::ArgAction::Count, conflicts_with = "verbose")]
    pub quiet: u8,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Supervise one CI run of a recipe: guards, ABRA_DIR, COMMAND, teardown.
    Run(RunArgs),
    /// Probe every run app's lock and reap the apps whose run is dead.
    Janitor(JanitorArgs),
    /// List every lock file in the lock dir: held or not, holders, age.
    Locks(LocksArgs),
    /// Run COMMAND holding a fair, bounded, named host lock.
    Lock(LockArgs),
    /// Print the app domain of a recipe run, and its stack name on a second line.
    AppDomain(AppDomainArgs),
    /// Print shell completions.
    Completions {
        /// The shell to print completions for.
        #[arg(value_name = "SHELL")]
        shell: clap_complete::Shell,
    },
    /// Print a man page (roff), or write every page to a directory.
    Man {
        /// The command whose page to print [default: the main page, ccci-run(1)].
        #[arg(value_name = "COMMAND")]
        command: Option<String>,
        /// Write every page (ccci-run.1, ccci-run-run.1, ...) into DIR instead.
        #[arg(long, value_name = "DIR", conflicts_with = "command")]
        dir: Option<PathBuf>,
    },
    /// Print the effective configuration: each setting and where it came from.
    Config(ConfigArgs),
}

#[derive(Debug, Args)]
pub(crate) struct LockArgs {
    /// The lock's name: `<lock-dir>/ccci-<NAME>.lock`.
    pub name: String,
    /// Give up after SECS (exit 75) [default: wait as long as it takes].
    #[arg(long, value_name = "SECS", value_parser = parse_seconds)]
    pub wait: Option<Duration>,
    /// Queue class: fast tickets go before normal ones.
    #[arg(long, value_name = "CLASS", default_value = "normal", value_parser = choice::<Class>())]
    pub class: Class,
    /// A normal ticket that waited this long joins the fast class, keeping its place.
    #[arg(long, value_name = "SECS", default_value = "1200", value_parser = parse_seconds)]
    pub promote_after: Duration,
    /// Seconds between the forwarded signal and SIGKILL of COMMAND's process group.
    #[arg(long, value_name = "SECS", default_value = "10", value_parser = parse_seconds)]
    pub kill_grace: Duration,
    /// Seconds the rest of the teardown may take after the kill grace; then whatever is left
    /// is killed and ccci-run exits.
    #[arg(long, value_name = "SECS", default_value = "300", value_parser = parse_budget)]
    pub teardown_timeout: Duration,
    /// Tear down when process PID exits; PID must be an ancestor (pass the CI step shell's $$).
    #[arg(long, value_name = "PID", env = "CCCI_TIE_TO", value_parser = parse_pid)]
    pub tie_to: Option<i32>,
    /// The command to run while holding the lock.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
    #[command(flatten)]
    pub global: GlobalArgs,
}

#[derive(Debug, Args)]
pub(crate) struct JanitorArgs {
    /// Decide and report, but change nothing at all.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Flag (never steal) a lock held for longer than SECS.
    #[arg(long, value_name = "SECS", default_value_t = DEFAULT_LONG_HELD_SECS, value_parser = clap::value_parser!(u64).range(..=MAX_SECS))]
    pub long_held: u64,
    /// Also write Prometheus metrics here (node_exporter textfile collector), atomically.
    #[arg(long, value_name = "PATH")]
    pub metrics_file: Option<PathBuf>,
    /// How long reaping may take (the Docker side, until the engine lists nothing of each
    /// stack); past it the stack is `reap-incomplete` and the next sweep finishes the job.
    #[arg(long, value_name = "SECS", default_value = "120", value_parser = parse_budget)]
    pub reap_budget: Duration,
    /// Also remove per-run directories older than DAYS whose run is not live.
    #[arg(long, value_name = "DAYS", value_parser = clap::value_parser!(u64).range(..=MAX_KEEP_DAYS))]
    pub keep_runs: Option<u64>,
    #[command(flatten)]
    pub global: GlobalArgs,
}

#[derive(Debug, Args)]
pub(crate) struct ConfigArgs {
    /// Print the settings as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub global: GlobalArgs,
}

#[derive(Debug, Args)]
pub(crate) struct LocksArgs {
    /// Print the list as JSON.
    #[arg(long)]
    pub json: bool,
    /// Flag a lock held for longer than SECS.
    #[arg(long, value_name = "SECS", default_value_t = DEFAULT_LONG_HELD_SECS, value_parser = clap::value_parser!(u64).range(..=MAX_SECS))]
    pub long_held: u64,
    #[command(flatten)]
    pub global: GlobalArgs,
}

/// Twice the default hard deadline: no healthy run holds its lock that long.
pub(crate) const DEFAULT_LONG_HELD_SECS: u64 = crate::config::DEFAULT_LONG_HELD.as_secs();

/// The longest any duration option may be: one year. Larger values are refused when parsed,
/// so no arithmetic on instants can overflow later.
pub(crate) const MAX_SECS: u64 = 365 * 86_400;

/// The longest `--keep-runs` may be, in days (a century).
pub(crate) const MAX_KEEP_DAYS: u64 = 36_500;

#[derive(Debug, Args)]
pub(crate) struct AppDomainArgs {
    #[command(flatten)]
    pub identity: IdentityArgs,
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
    /// Run id [default: $DRONE_BUILD_NUMBER, else manual-<pid>].
    #[arg(long, value_name = "ID")]
    pub run_id: Option<String>,
    /// Hard deadline for the whole run, in seconds.
    #[arg(long, value_name = "SECS", default_value_t = 3600, value_parser = clap::value_parser!(u32).range(1..=MAX_SECS as i64))]
    pub deadline: u32,
    /// Give up waiting for the app lock after SECS (exit 75) [default: until the deadline].
    #[arg(long, value_name = "SECS", value_parser = parse_seconds)]
    pub lock_wait: Option<Duration>,
    /// Seconds between SIGTERM and SIGKILL of the command's process group (fractions allowed).
    #[arg(long, value_name = "SECS", env = "CCCI_KILL_GRACE", default_value = "10", value_parser = parse_seconds)]
    pub kill_grace: Duration,
    /// Seconds the rest of the teardown (hook, app removal) may take after the kill grace; the
    /// whole run is bounded by deadline + kill grace + this, whatever happens.
    #[arg(long, value_name = "SECS", env = "CCCI_TEARDOWN_TIMEOUT", default_value = "300", value_parser = parse_budget)]
    pub teardown_timeout: Duration,
    /// Refuse to run unless our parent process is PID (pass the step shell's $$).
    #[arg(long, value_name = "PID")]
    pub expect_parent: Option<i32>,
    /// Tear down when process PID exits; PID must be an ancestor (pass the CI step shell's $$).
    #[arg(long, value_name = "PID", env = "CCCI_TIE_TO", value_parser = parse_pid)]
    pub tie_to: Option<i32>,
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
    /// [default: $CCCI_RECIPE_URL_TEMPLATE with {recipe} filled in, else
    /// https://git.coopcloud.tech/coop-cloud/{recipe}.git].
    #[arg(long, value_name = "URL")]
    pub recipe_url: Option<String>,
    /// The command to supervise.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
    #[command(flatten)]
    pub global: GlobalArgs,
}

/// A number of seconds, fractions allowed, from 0 to [`MAX_SECS`].
fn parse_seconds(value: &str) -> Result<Duration, String> {
    let secs: f64 = value
        .trim()
        .parse()
        .map_err(|_| format!("{value:?} is not a number of seconds"))?;
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("{value:?} is not a usable duration"));
    }
    if secs > MAX_SECS as f64 {
        return Err(format!(
            "{value:?} is too long: at most {MAX_SECS} s (one year)"
        ));
    }
    Duration::try_from_secs_f64(secs).map_err(|_| format!("{value:?} is not a usable duration"))
}

/// Like [`parse_seconds`], but at least one second: a budget of nothing would skip teardown.
fn parse_budget(value: &str) -> Result<Duration, String> {
    let secs = parse_seconds(value)?;
    if secs < Duration::from_secs(1) {
        return Err(format!(
            "{value:?} is too short: at least 1 s, or teardown could not even start"
        ));
    }
    Ok(secs)
}

/// A process id: a positive number, not 1 (init never exits: tying to it guards nothing).
fn parse_pid(value: &str) -> Result<i32, String> {
    let pid: i32 = value
        .trim()
        .parse()
        .map_err(|_| format!("{value:?} is not a process id"))?;
    match pid {
        ..=0 => Err(format!("{value:?} is not a process id")),
        1 => Err(
            "1 is init, which never exits: name the CI step shell's pid ($$) instead".to_owned(),
        ),
        pid => Ok(pid),
    }
}

/// A value parser for a [`Choice`]: its names as the possible values, its help as theirs.
fn choice<T: Choice + Clone>() -> impl TypedValueParser<Value = T> {
    let values = T::CHOICES.iter().map(|(_, name, help)| {
        let value = PossibleValue::new(*name);
        if help.is_empty() {
            value
        } else {
            value.help(*help)
        }
    });
    PossibleValuesParser::new(values).try_map(|name| T::from_name(&name).ok_or("unknown value"))
}

impl Command {
    /// The global options given after the command's name, for the commands that take them.
    pub(crate) fn global(&self) -> Option<&GlobalArgs> {
        match self {
            Self::Run(a) => Some(&a.global),
            Self::Janitor(a) => Some(&a.global),
            Self::Locks(a) => Some(&a.global),
            Self::Lock(a) => Some(&a.global),
            Self::AppDomain(a) => Some(&a.global),
            Self::Config(a) => Some(&a.global),
            Self::Completions { .. } | Self::Man { .. } => None,
        }
    }
}

/// The global options as given before the command's name (`top`) and after it (`sub`): after
/// wins, as a later flag does, and a flag wins over the environment wherever it was given.
pub(crate) struct Globals<'a> {
    pub top: (&'a GlobalArgs, &'a ArgMatches),
    pub sub: Option<(&'a GlobalArgs, &'a ArgMatches)>,
}

impl Globals<'_> {
    /// What the command line and the environment say, with which of the two said it.
    pub(crate) fn inputs(&self) -> Inputs {
        Inputs {
            config: self
                .pick(|g| &g.config, "config", "CCCI_CONFIG")
                .map(|(v, _)| v),
            lock_dir: self.pick(|g| &g.lock_dir, "lock_dir", "CCCI_APP_LOCK_DIR"),
            abra_home: self.pick(|g| &g.abra_home, "abra_home", "CCCI_ABRA_HOME"),
            runs_dir: self.pick(|g| &g.runs_dir, "runs_dir", "CCCI_RUNS_DIR"),
            state_dir: self.pick(|g| &g.state_dir, "state_dir", "CCCI_STATE_DIR"),
            domain_suffix: self.pick(|g| &g.domain_suffix, "domain_suffix", "CCCI_DOMAIN_SUFFIX"),
            docker: self.pick(|g| &g.docker, "docker", "CCCI_DOCKER"),
            log_format: self.pick(|g| &g.log_format, "log_format", "CCCI_LOG_FORMAT"),
            cgroup: self.pick(|g| &g.cgroup, "cgroup", "CCCI_CGROUP"),
            etcd_endpoints: self.pick(
                |g| &g.etcd_endpoints,
                "etcd_endpoints",
                "CCCI_ETCD_ENDPOINTS",
            ),
            lease_ttl: self.pick(|g| &g.lease_ttl, "lease_ttl", "CCCI_LEASE_TTL"),
        }
    }

    /// `-q` and `-v` counts, wherever they were given.
    pub(crate) fn verbosity(&self) -> (u8, u8) {
        let (q, v) = self.sub.map_or((0, 0), |(g, _)| (g.quiet, g.verbose));
        (
            self.top.0.quiet.saturating_add(q),
            self.top.0.verbose.saturating_add(v),
        )
    }

    fn pick<T: Clone>(
        &self,
        field: impl Fn(&GlobalArgs) -> &Option<T>,
        id: &str,
        env: &str,
    ) -> Given<T> {
        let given = |(args, matches): (&GlobalArgs, &ArgMatches)| {
            let origin = match matches.value_source(id) {
                Some(ValueSource::CommandLine) => Origin::Flag,
                Some(ValueSource::EnvVariable) => Origin::Environment(env.to_owned()),
                _ => return None,
            };
            field(args).clone().map(|v| (v, origin))
        };
        let is_flag = |g: &Given<T>| matches!(g, Some((_, Origin::Flag)));
        let sub = self.sub.and_then(given);
        let top = given(self.top);
        if is_flag(&sub) || !is_flag(&top) && sub.is_some() {
            sub
        } else {
            top
        }
    }
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
        let drone_build = std::env::var("DRONE_BUILD_NUMBER").ok();
        let run_id = RunId::resolve(self.run_id.as_deref(), drone_build.as_deref())?;
        let fetch = Fetch::choose(
            self.no_fetch,
            self.skip_fetch,
            self.recipe_url.as_deref(),
            &identity.recipe,
        )?;
        Ok(RunConfig {
            identity,
            run_id,
            deadline: Duration::from_secs(self.deadline.into()),
            kill_grace: self.kill_grace,
            teardown_timeout: self.teardown_timeout,
            lock_wait: self.lock_wait,
            expect_parent: self.expect_parent,
            tie_to: self.tie_to,
            on_teardown: self.on_teardown.clone(),
            no_teardown: self.no_teardown,
            fetch,
            command: self.command.clone(),
        })
    }
}

impl LockArgs {
    pub(crate) fn validate(self, global: &Global) -> Result<LockConfig, NameError> {
        Ok(LockConfig {
            name: LockName::parse(&self.name)?,
            wait: self.wait,
            class: self.class,
            promote_after: self.promote_after,
            kill_grace: self.kill_grace,
            teardown_timeout: self.teardown_timeout,
            tie_to: self.tie_to,
            cgroup: global.cgroup,
            command: self.command,
        })
    }
}

impl JanitorArgs {
    pub(crate) fn sweep_options(&self) -> SweepOptions {
        SweepOptions {
            dry_run: self.dry_run,
            hunt: crate::config::Hunt::Everywhere,
            long_held: Duration::from_secs(self.long_held),
            reap_budget: self.reap_budget,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn verify_cli() {
        Cli::command().debug_assert();
    }

    #[test]
    fn kill_grace_takes_fractions_and_refuses_garbage() {
        assert_eq!(parse_seconds("0.25").unwrap(), Duration::from_millis(250));
        assert!(parse_seconds("-1").is_err());
        assert!(parse_seconds("soon").is_err());
        assert!(parse_seconds("NaN").is_err());
        assert!(parse_seconds("inf").is_err());
    }

    #[test]
    fn absurd_durations_are_refused_at_parse_time() {
        let err = parse_seconds("9223372036854775807").unwrap_err();
        assert!(err.contains("too long"), "{err}");
        assert!(parse_seconds(&MAX_SECS.to_string()).is_ok());
        assert!(parse_budget("0").unwrap_err().contains("at least 1 s"));
        assert_eq!(parse_budget("1").unwrap(), Duration::from_secs(1));
    }

    #[test]
    fn pids_are_positive_and_not_init() {
        assert_eq!(parse_pid("42"), Ok(42));
        assert!(parse_pid("1").unwrap_err().contains("init"));
        for bad in ["0", "-5", "x", "", "99999999999"] {
            assert!(parse_pid(bad).is_err(), "{bad}");
        }
    }
}
