use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // Read before anything else: the orphan check compares it with the parent pid after the
    // parent-death signal is armed.
    let start_ppid = nix::unistd::getppid();
    let cli = ccci_run::cli::Cli::parse();
    match ccci_run::run(cli, start_ppid) {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            ccci_run::report::line(&format!("ccci-run: error: {err}"));
            ExitCode::from(err.exit_code())
        }
    }
}
