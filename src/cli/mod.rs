//! The command line: raw clap arguments, validated once into the configuration types of
//! [`crate::config`]. Only the entry point uses this module; nothing downstream parses strings
//! again, and no type outside it knows clap.
//!
//! Here: the global options, the subcommands, and the value parsers they share; each
//! subcommand's own arguments, and their validation, are a file of this folder.
//!
//! Floor: entry (docs/architecture.md): the top floor, imported by nothing but the entry.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, Parser, Subcommand};

use crate::config::Class;
use crate::config::{
    CgroupMode, Choice, DockerMode, Fetch, Given, Global, Identity, Inputs, LockConfig, LogFormat,
    Origin, RunConfig, SweepOptions, Timing,
};
use crate::names::{DomainSuffix, DroneBuild, LockName, NameError, RunId, StackName};

mod converge;
mod doctor;
pub(crate) mod errors;
mod janitor;
mod lock;
mod run;
mod runs;

pub(crate) use converge::ConvergeArgs;
pub(crate) use doctor::{ConfigArgs, DoctorArgs};
pub(crate) use janitor::JanitorArgs;
pub(crate) use lock::{LockArgs, LocksArgs};
pub(crate) use run::{AppDomainArgs, RunArgs};
pub(crate) use runs::{RunsArgs, StopArgs};

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
    after_help = "Exit codes (each subcommand's --help gives its own): 0 success; 1 a failure \
        the command reports (a failed check, an incomplete reap, no such run); 2 invalid input; \
        75 a lock not acquired in time (or a wait not over: stop, converge); 76 a lock lost \
        while held; 125 ccci-run failed; for run and lock, the command's own status (128+N \
        when signal N killed it), 126/127 command not executable / not found, 129/130/131/143 \
        SIGHUP/SIGINT/SIGQUIT/SIGTERM after teardown, 142 the hard deadline after teardown."
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
    /// docker, log_format, cgroup, etcd_endpoints, lease_ttl, recipe_url_template, and the run
    /// settings deadline,
    /// kill_grace, teardown_timeout, lock_wait, long_held, keep_runs, reap_budget,
    /// promote_after, converge_timeout, converge_stable) [default: /etc/ccci-run/config.toml when it exists].
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
    /// Directory of the run-scoped state files [default: RUNS_DIR/.state].
    #[arg(long, value_name = "DIR", env = "CCCI_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Run-app domains end in `.SUFFIX` [default: ci.commoninternet.net].
    #[arg(long, value_name = "SUFFIX", env = "CCCI_DOMAIN_SUFFIX")]
    pub domain_suffix: Option<String>,
    /// Whether to touch Docker [default: auto]. The engine is DOCKER_HOST's: unix:///PATH, or
    /// tcp://HOST[:PORT] (TLS when DOCKER_TLS_VERIFY is set, with ca.pem, cert.pem and key.pem
    /// from DOCKER_CERT_PATH or ~/.docker); unset or empty, unix:///var/run/docker.sock; any
    /// other value is refused (exit 2), never replaced by the default socket.
    #[arg(long, value_name = "MODE", env = "CCCI_DOCKER", value_parser = choice::<DockerMode>())]
    pub docker: Option<DockerMode>,
    /// The engine, in DOCKER_HOST's forms, over DOCKER_HOST and the file's docker_host (which
    /// a Drone step needs: it never sees the runner's DOCKER_HOST); a run's command gets it as
    /// its DOCKER_HOST [default: DOCKER_HOST, else the file's docker_host, else
    /// unix:///var/run/docker.sock].
    #[arg(long, value_name = "URL")]
    pub docker_host: Option<String>,
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
    /// How long an etcd lease outlives its holder's last keepalive (whole seconds, 2s-1h): how
    /// soon a dead holder's lock frees, and how long etcd may be unreachable before a holder
    /// stops its command; at least the kill grace + 4s, so the command is gone before the lease
    /// can expire and a leader election passes unnoticed [default: 15s].
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, env = "CCCI_LEASE_TTL", value_parser = lease_ttl)]
    pub lease_ttl: Option<Duration>,
    /// Diagnostics format: text, or json (then all of stderr is JSON, one object a line, status
    /// lines and errors included, also a refused command line: this flag wherever it stands,
    /// else CCCI_LOG_FORMAT, else the file's log_format) [default: text].
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
    /// List the runs in the runs dir: live, dead, and those that ended in the last 24 h.
    Runs(RunsArgs),
    /// Stop one live run: tear it down as a SIGTERM would, recorded as `stopped`.
    Stop(StopArgs),
    /// Print the app domain of a recipe run, and its stack name on a second line (with
    /// --names-in, what the recipe's names allow).
    AppDomain(AppDomainArgs),
    /// Wait until a deployed stack has converged: every task running, no update in progress.
    Converge(ConvergeArgs),
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
    /// What a shell completes here, one a line: the run ids (`runs`), the live ones (`stop`),
    /// the named locks (`lock`). For the completion scripts; prints nothing it cannot read.
    #[command(name = "__complete", hide = true)]
    Complete {
        #[arg(value_parser = ["run-ids", "live-run-ids", "lock-names"])]
        what: String,
    },
    /// Check this host: configuration, directories, cgroups, the runner unit, Docker, etcd,
    /// inotify and the step's PATH; one line per check (exit 1 when any fails).
    ///
    /// Every check is listed, in one of four states: ok; warn (runs work, less well: a
    /// fallback is in use or a limit is near); fail (a run, lock or sweep will not work as
    /// configured); skip (the check cannot be made here: no systemd, or Docker or etcd not in
    /// use). Each line that is not ok says how to fix it. A bad configuration file fails its
    /// check and the rest run on the settings without it. Doctor changes nothing it does not
    /// undo (a probe cgroup, a probe lease), and each Docker, etcd and systemd question has a
    /// time limit. Exit 0 when nothing failed, 1 otherwise.
    Doctor(DoctorArgs),
}

/// The value parsers of the run settings: one duration syntax, each with its own bounds.
fn deadline(value: &str) -> Result<Duration, String> {
    Timing::Deadline.parse_flag(value)
}

fn kill_grace(value: &str) -> Result<Duration, String> {
    Timing::KillGrace.parse_flag(value)
}

fn teardown_timeout(value: &str) -> Result<Duration, String> {
    Timing::TeardownTimeout.parse_flag(value)
}

fn lock_wait(value: &str) -> Result<Duration, String> {
    Timing::LockWait.parse_flag(value)
}

fn long_held(value: &str) -> Result<Duration, String> {
    Timing::LongHeld.parse_flag(value)
}

fn keep_runs(value: &str) -> Result<Duration, String> {
    Timing::KeepRuns.parse_flag(value)
}

fn reap_budget(value: &str) -> Result<Duration, String> {
    Timing::ReapBudget.parse_flag(value)
}

fn promote_after(value: &str) -> Result<Duration, String> {
    Timing::PromoteAfter.parse_flag(value)
}

fn converge_timeout(value: &str) -> Result<Duration, String> {
    Timing::ConvergeTimeout.parse_flag(value)
}

fn converge_stable(value: &str) -> Result<Duration, String> {
    Timing::ConvergeStable.parse_flag(value)
}

/// Any duration from nothing to a year.
fn any_duration(value: &str) -> Result<Duration, String> {
    crate::duration::parse(value, &crate::duration::Spec::at_least(Duration::ZERO))
}

fn lease_ttl(value: &str) -> Result<Duration, String> {
    crate::duration::parse(value, &crate::config::LEASE_TTL_SPEC)
}

/// The exit code of a lock not acquired: any that ccci-run gives no other meaning, so a script
/// can tell "not acquired" from what else the command or ccci-run ended with.
fn conflict_exit_code(value: &str) -> Result<u8, String> {
    let allowed = "choose 1, 3-75 or 77-124";
    let code: u32 = value
        .trim()
        .parse()
        .map_err(|_| format!("{value:?} is not an exit code (a number, {allowed})"))?;
    let meaning = match code {
        0 => "0 would say the command ran and succeeded",
        2 => "2 means invalid input",
        76 => "76 means a held lock was lost",
        125 => "125 means ccci-run itself failed",
        126 | 127 => "126 and 127 mean the command could not be executed or found",
        128..=255 => "128-255 mean a signal (128+N) or the hard deadline (142)",
        256.. => "exit codes go up to 255",
        _ => return Ok(code as u8),
    };
    Err(format!("{meaning}: {allowed}"))
}

/// A process id: a positive number. (Whether 1 makes sense depends on who our parent is: the
/// guards decide.)
fn parse_pid(value: &str) -> Result<i32, String> {
    let pid: i32 = value.trim().parse().map_err(|_| {
        format!("{value:?} is not a process id (a positive number; several: PID,PID)")
    })?;
    if pid <= 0 {
        return Err(format!(
            "{value:?} is not a process id (a positive number; several: PID,PID)"
        ));
    }
    Ok(pid)
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
    /// The report's own fields of this command's `--json` document, empty, when `--json` was
    /// asked for: what its envelope holds when the command fails before it has a report.
    pub(crate) fn json_when_failed(&self) -> Option<serde_json::Map<String, serde_json::Value>> {
        use serde_json::{Value, json};
        let fields: Value = match self {
            Self::Runs(a) if a.json() && a.run_id.is_some() => json!({ "run": null }),
            Self::Runs(a) if a.json() => json!({ "runs": [] }),
            Self::Locks(a) if a.json() => json!({ "locks": [] }),
            Self::Config(a) if a.json => json!({ "settings": [] }),
            Self::Doctor(a) if a.json => json!({ "ok": false, "checks": [] }),
            Self::Janitor(a) if a.json() => json!({
                "dry_run": a.dry_run,
                "candidates": [],
                "tidied": [],
                "dead_cgroups": [],
                "leftover_processes": [],
            }),
            Self::Converge(a) if a.json => json!({
                "stack": a.stack,
                "converged": false,
                "outcome": null,
                "services": [],
                "waited_s": 0.0,
                "polls": 0,
                "docker_calls": 0,
            }),
            _ => return None,
        };
        match fields {
            Value::Object(map) => Some(map),
            _ => None,
        }
    }

    /// The run settings given on the command line.
    pub(crate) fn timing_flags(&self) -> Vec<(Timing, Duration)> {
        let given: Vec<(Timing, Option<Duration>)> = match self {
            Self::Run(a) => vec![
                (Timing::Deadline, a.deadline),
                (Timing::LockWait, a.lock_wait),
                (Timing::KillGrace, a.kill_grace),
                (Timing::TeardownTimeout, a.teardown_timeout),
            ],
            Self::Lock(a) => vec![
                (Timing::PromoteAfter, a.promote_after),
                (Timing::KillGrace, a.kill_grace),
                (Timing::TeardownTimeout, a.teardown_timeout),
            ],
            Self::Janitor(a) => vec![
                (Timing::LongHeld, a.long_held),
                (Timing::ReapBudget, a.reap_budget),
                (Timing::KeepRuns, a.keep_runs),
            ],
            Self::Locks(a) => vec![(Timing::LongHeld, a.long_held)],
            Self::Converge(a) => vec![
                (Timing::ConvergeTimeout, a.timeout),
                (Timing::ConvergeStable, a.stable),
            ],
            _ => Vec::new(),
        };
        given
            .into_iter()
            .filter_map(|(t, v)| v.map(|v| (t, v)))
            .collect()
    }

    /// The global options given after the command's name, for the commands that take them.
    pub(crate) fn global(&self) -> Option<&GlobalArgs> {
        match self {
            Self::Run(a) => Some(&a.global),
            Self::Janitor(a) => Some(&a.global),
            Self::Locks(a) => Some(&a.global),
            Self::Lock(a) => Some(&a.global),
            Self::Runs(a) => Some(&a.global),
            Self::Stop(a) => Some(&a.global),
            Self::AppDomain(a) => Some(&a.global),
            Self::Converge(a) => Some(&a.global),
            Self::Config(a) => Some(&a.global),
            Self::Doctor(a) => Some(&a.global),
            Self::Completions { .. } | Self::Man { .. } | Self::Complete { .. } => None,
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
            docker_host: self.pick(|g| &g.docker_host, "docker_host", "DOCKER_HOST"),
            log_format: self.pick(|g| &g.log_format, "log_format", "CCCI_LOG_FORMAT"),
            cgroup: self.pick(|g| &g.cgroup, "cgroup", "CCCI_CGROUP"),
            etcd_endpoints: self.pick(
                |g| &g.etcd_endpoints,
                "etcd_endpoints",
                "CCCI_ETCD_ENDPOINTS",
            ),
            lease_ttl: self.pick(|g| &g.lease_ttl, "lease_ttl", "CCCI_LEASE_TTL"),
            timings: Vec::new(),
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

/// The `--tie-to` pids, each once: a pid named twice is a mistake in whoever built the list.
fn unique_pids(pids: &[i32]) -> Result<Vec<i32>, NameError> {
    for (at, pid) in pids.iter().enumerate() {
        if pids[..at].contains(pid) {
            return Err(NameError {
                what: "--tie-to / CCCI_TIE_TO",
                value: pids
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
                rule: format!("names pid {pid} twice: list each ancestor once (PID,PID)"),
            });
        }
    }
    Ok(pids.to_vec())
}

/// What a command line says of `--log-format` and `--config` (the last of each, before `--`),
/// read from the raw arguments: for an error clap found before it parsed them. A value that is
/// no format counts as not given.
pub(crate) fn log_format_before_parsing(
    args: impl IntoIterator<Item = OsString>,
) -> (Option<LogFormat>, Option<PathBuf>) {
    let (mut format, mut config) = (None, None);
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let Some(text) = arg.to_str() else { continue };
        if text == "--" {
            break;
        }
        let (name, inline) = match text.split_once('=') {
            Some((name, value)) => (name, Some(OsString::from(value))),
            None => (text, None),
        };
        if !matches!(name, "--log-format" | "--config") {
            continue;
        }
        let Some(value) = inline.or_else(|| args.next()) else {
            break;
        };
        if name == "--config" {
            config = Some(PathBuf::from(value));
        } else if let Some(given) = value.to_str().and_then(LogFormat::from_name) {
            format = Some(given);
        }
    }
    (format, config)
}

/// The command line as the completion scripts know it: `man`'s COMMAND takes the name of a
/// subcommand (or `ccci-run`), so shells complete those.
pub(crate) fn base() -> clap::Command {
    use clap::CommandFactory;
    let cmd = Cli::command();
    let pages: Vec<String> = std::iter::once("ccci-run".to_owned())
        .chain(
            cmd.get_subcommands()
                .filter(|s| !s.is_hide_set())
                .map(|s| s.get_name().to_owned()),
        )
        .collect();
    cmd.mut_subcommand("man", move |man| {
        man.mut_arg("command", move |a| {
            a.value_parser(clap::builder::PossibleValuesParser::new(pages))
        })
    })
}

/// Each subcommand's exit codes, as its `--help` ends with them.
const EXIT_CODES: &[(&str, &str)] = &[
    (
        "run",
        "Exit codes: the command's own status (128+N when signal N killed it); 2 invalid input; \
         75 lock not acquired in time; 76 the lock was lost while held, after teardown; 125 \
         ccci-run failed; 126/127 command not executable / not found; 129/130/131/143 \
         SIGHUP/SIGINT/SIGQUIT/SIGTERM after teardown (143 also when the parent or the --tie-to \
         process died); 142 hard deadline after teardown.",
    ),
    (
        "janitor",
        "Exit codes: 0 swept (or, with --dry-run, looked); 1 something could not be done (a reap \
         incomplete, an unreadable lock, a directory that failed); 2 invalid input.",
    ),
    (
        "locks",
        "Exit codes: 0 listed (an empty or missing lock dir lists nothing); 1 the locks could \
         not be read; 2 invalid input.",
    ),
    (
        "lock",
        "Exit codes: the command's own status (128+N when signal N killed it); 2 invalid input; \
         75 not acquired in time (-w) or at once (-n), or -E's code; 76 the lock was lost while \
         held; 125 ccci-run failed; 126/127 command not executable / not found.",
    ),
    (
        "runs",
        "Exit codes: 0 listed; 1 the runs dir cannot be read, or no record names RUN_ID; 2 \
         invalid input.",
    ),
    (
        "stop",
        "Exit codes: 0 stopped (the record finished); 1 no such live run (unknown, finished, \
         dead, not yours to read, or not to be judged from here); 2 a run id that is not one; \
         75 the run still runs after --wait (ask again with --kill).",
    ),
    (
        "app-domain",
        "Exit codes: 0 printed; 1 with --names-in, a name of the recipe over a Docker limit; 2 \
         invalid input.",
    ),
    ("completions", "Exit codes: 0 printed; 2 invalid input."),
    (
        "man",
        "Exit codes: 0 printed or written; 1 a page could not be written; 2 invalid input.",
    ),
    (
        "config",
        "Exit codes: 0 shown; 2 an invalid setting (named with where it came from).",
    ),
    (
        "doctor",
        "Exit codes: 0 every check ok or warn; 1 a check failed; 2 invalid input.",
    ),
];

/// The command line as it is parsed and shown: each subcommand's `--help` gives its own
/// options, then the global options by reference (they are taken all the same, before or
/// after the subcommand's name; `ccci-run --help` describes them), then its exit codes.
pub(crate) fn command() -> clap::Command {
    let cmd = base();
    let globals: Vec<clap::Id> = cmd
        .get_arguments()
        .filter(|a| a.get_help_heading() == Some("Global options"))
        .map(|a| a.get_id().clone())
        .collect();
    let names: Vec<String> = cmd
        .get_arguments()
        .filter(|a| a.get_help_heading() == Some("Global options"))
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .collect();
    let mut cmd = cmd;
    let subcommands: Vec<String> = cmd
        .get_subcommands()
        .map(|s| s.get_name().to_owned())
        .collect();
    for name in subcommands {
        let globals = globals.clone();
        let reference = format!(
            "Global options: {} (before or after the subcommand; most also a CCCI_* variable \
             or a key of the configuration file: `ccci-run --help` describes each).",
            names.join(", ")
        );
        let exit = EXIT_CODES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, text)| *text);
        cmd = cmd.mut_subcommand(&name, move |mut sub| {
            let mut takes_globals = false;
            for id in &globals {
                if sub.get_arguments().any(|a| a.get_id() == id) {
                    takes_globals = true;
                    sub = sub.mut_arg(id, |a| a.hide(true));
                }
            }
            let mut after: Vec<String> = Vec::new();
            match (sub.get_after_help(), exit) {
                (Some(existing), _) => after.push(existing.to_string()),
                (None, Some(exit)) => after.push(exit.to_owned()),
                (None, None) => {}
            }
            if takes_globals {
                after.push(reference);
            }
            sub.after_help(after.join("\n\n"))
        });
    }
    cmd
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
    fn every_duration_flag_speaks_one_syntax() {
        assert_eq!(kill_grace("0.25").unwrap(), Duration::from_millis(250));
        assert_eq!(deadline("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(deadline("1.5").unwrap(), Duration::from_millis(1500));
        assert_eq!(lease_ttl("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(long_held("2h").unwrap(), Duration::from_secs(7200));
        assert_eq!(keep_runs("14d").unwrap(), Duration::from_secs(14 * 86_400));
        assert!(keep_runs("14").unwrap_err().contains("14d"));
        assert!(deadline("0").unwrap_err().contains("too short"));
        assert!(teardown_timeout("0.5").unwrap_err().contains("at least 1s"));
        assert!(
            deadline("9223372036854775807")
                .unwrap_err()
                .contains("too long")
        );
        for bad in ["-1", "soon", "NaN", "inf", "", "5x"] {
            assert!(kill_grace(bad).is_err(), "{bad}");
        }
    }

    #[rstest::rstest]
    #[case(&["--log-format", "json", "run", "--bogus"], Some(LogFormat::Json), None)]
    #[case(&["run", "--bogus", "--log-format=json"], Some(LogFormat::Json), None)]
    #[case(&["--log-format", "json", "--log-format", "text"], Some(LogFormat::Text), None)]
    #[case(&["--log-format", "xml"], None, None)]
    #[case(&["--config", "/c.toml", "lock"], None, Some("/c.toml"))]
    #[case(&["lock", "x", "--", "--log-format", "json"], None, None)]
    #[case(&["--log-format"], None, None)]
    fn the_log_format_is_read_before_parsing(
        #[case] args: &[&str],
        #[case] format: Option<LogFormat>,
        #[case] config: Option<&str>,
    ) {
        let got = log_format_before_parsing(args.iter().map(OsString::from));
        assert_eq!(got, (format, config.map(PathBuf::from)));
    }

    #[test]
    fn conflict_exit_codes_avoid_the_ones_already_taken() {
        for ok in [1, 3, 9, 75, 77, 124] {
            assert_eq!(conflict_exit_code(&ok.to_string()), Ok(ok as u8));
        }
        for bad in [
            "0", "2", "76", "125", "126", "127", "128", "143", "255", "256", "-1", "x",
        ] {
            let err = conflict_exit_code(bad).unwrap_err();
            assert!(err.contains("choose 1, 3-75 or 77-124"), "{bad}: {err}");
        }
    }

    #[test]
    fn pids_are_positive_and_listed_once() {
        assert_eq!(parse_pid("42"), Ok(42));
        assert_eq!(parse_pid("1"), Ok(1));
        for bad in ["0", "-5", "x", "", "99999999999", "$"] {
            assert!(parse_pid(bad).unwrap_err().contains("PID,PID"), "{bad}");
        }
        assert_eq!(unique_pids(&[7, 9]).unwrap(), vec![7, 9]);
        let err = unique_pids(&[7, 9, 7]).unwrap_err().to_string();
        assert!(err.contains("twice") && err.contains("7,9,7"), "{err}");
    }
}
