use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};

fn main() -> ExitCode {
    // Read before anything else: the orphan check compares it with the parent pid after the
    // parent-death signal is armed.
    let start_ppid = nix::unistd::getppid();
    // The matches are kept: they say whether a setting came from a flag or the environment.
    let matches = ccci_run::cli::Cli::command().get_matches();
    let cli = ccci_run::cli::Cli::from_arg_matches(&matches).unwrap_or_else(|err| err.exit());
    match ccci_run::run(cli, &matches, start_ppid) {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            ccci_run::report::line(&format!("ccci-run: error: {err}"));
            ExitCode::from(err.exit_code())
        }
    }
}
