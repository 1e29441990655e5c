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

use clap::{Parser, Subcommand};

use crate::config::{Choice, LogFormat, Timing};

mod converge;
mod doctor;
pub(crate) mod errors;
pub(crate) use globals::{GlobalArgs, Globals};
mod globals;
mod janitor;
mod lock;
mod parse;
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
}
