//! ccci-run: a daemonless run supervisor for recipe CI on a Co-op Cloud style host.
//!
//! The invariant everything rests on: lock lifetime ⊆ process lifetime ⊆ step lifetime ⊆ hard
//! deadline. Kernel primitives only — flock, prctl, signals, process groups, cgroups — and no
//! daemon; across hosts, etcd for the locks and the swarm's own nodes for the reaps.
//!
//! Floor: entry (docs/architecture.md): the top floor, imported by nothing but the entry.

pub(crate) mod app;
pub(crate) mod cli;
mod completions;
pub(crate) mod config;
mod config_file;
pub(crate) mod converge;
mod dispatch;
pub(crate) mod docker;
mod doctor;
pub(crate) mod duration;
pub(crate) mod error;
pub(crate) mod exit;
pub(crate) mod files;
mod fuzz;
mod inspect;
pub(crate) mod janitor;
pub(crate) mod lock;
mod man;
mod named_lock;
pub(crate) mod names;
pub(crate) mod recipe;
pub(crate) mod recipe_url;
pub(crate) mod report;
pub(crate) mod run;
pub(crate) mod rundir;
pub(crate) mod runs;
pub(crate) mod supervise;
pub(crate) mod trust;

use std::process::ExitCode;

use clap::FromArgMatches;

use crate::cli::Cli;

/// The program: parse the command line, build the configuration, run one command.
pub fn main() -> ExitCode {
    // A run's fence is this binary too; it parses no command line.
    if let Some(args) = supervise::fence::invoked() {
        return ExitCode::from(supervise::fence::main(&args));
    }
    // Read before anything else: the orphan check compares it with the parent pid after the
    // parent-death signal is armed.
    let start_ppid = nix::unistd::getppid();
    // The matches are kept: they say whether a setting came from a flag or the environment.
    let parsed = cli::command()
        .try_get_matches()
        .and_then(|matches| Cli::from_arg_matches(&matches).map(|cli| (cli, matches)));
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(err) => return cli::errors::command_line_error(&cli::errors::with_dash_dash_tip(err)),
    };
    // A `--json` command prints its envelope whatever happens: on a failure, with the error.
    let json_when_failed = cli.command.json_when_failed();
    let done = dispatch::dispatch(cli, &matches, start_ppid);
    // A fence forked for a command that never came to hold its lock ends now.
    supervise::fence::dismiss();
    match done {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            report::failure(
                &format!("ccci-run: error: {err}"),
                err.kind(),
                err.exit_code(),
            );
            if let Some(fields) = json_when_failed {
                let document = report::Envelope::new(&fields, vec![err.to_string()]);
                // A closed or full stdout loses the document, never the exit code.
                let _ = report::stdout(format!("{}\n", report::json(&document)).as_bytes());
            }
            ExitCode::from(err.exit_code())
        }
    }
}
