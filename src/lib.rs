//! ccci-run: a daemonless run supervisor for recipe CI on a Co-op Cloud style host.
//!
//! The invariant everything rests on: lock lifetime ⊆ process lifetime ⊆ step lifetime ⊆ hard
//! deadline. Kernel primitives only — flock, prctl, signals, process groups — no daemon and no
//! shared state service.

pub mod app;
pub mod cli;
pub mod exit;
pub mod lock;
pub mod names;
pub mod process;
pub mod record;
pub mod report;
pub mod run;
pub mod rundir;
pub mod shutdown;
pub mod signals;
pub mod state;

#[cfg(target_os = "linux")]
pub mod linux;

use nix::unistd::Pid;
use tracing_subscriber::EnvFilter;

use crate::cli::{Cli, Command, LogFormat};

/// Every way `ccci-run` itself can fail, each with its documented exit code.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Invalid(#[from] names::NameError),
    #[error(transparent)]
    Run(#[from] run::RunError),
}

impl Error {
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Invalid(_) => exit::USAGE,
            Self::Run(_) => exit::INTERNAL,
        }
    }
}

/// Run the parsed command line. `start_ppid` is our parent pid as read first thing in `main`,
/// so the orphan check can tell whether the parent died while we were starting.
pub fn run(cli: Cli, start_ppid: Pid) -> Result<u8, Error> {
    init_logging(&cli.global);
    let global = cli.global.validate()?;
    match cli.command {
        Command::AppDomain(args) => {
            let identity = args.validate(&global.suffix)?;
            println!("{}", identity.domain);
            println!("{}", identity.domain.stack_name());
            Ok(0)
        }
        Command::Run(args) => {
            let cfg = args.validate(&global)?;
            Ok(run::run(&global, &cfg, start_ppid)?)
        }
    }
}

fn init_logging(global: &cli::GlobalArgs) {
    let level = match (global.quiet, global.verbose) {
        (q, _) if q > 0 => "error",
        (_, 0) => "warn",
        (_, 1) => "info",
        (_, 2) => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("ccci_run={level}")));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    let _ = match global.log_format {
        LogFormat::Text => builder.without_time().try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
