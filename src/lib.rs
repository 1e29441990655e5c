//! ccci-run: a daemonless run supervisor for recipe CI on a Co-op Cloud style host.
//!
//! The invariant everything rests on: lock lifetime ⊆ process lifetime ⊆ step lifetime ⊆ hard
//! deadline. Kernel primitives only — flock, prctl, signals, process groups — no daemon and no
//! shared state service.

pub mod app;
pub mod backoff;
pub mod cgroup;
pub mod cli;
pub mod config;
pub mod docker;
pub mod exit;
pub mod fetch;
mod fuzz;
pub mod janitor;
pub mod leftovers;
pub mod lock;
pub mod locks;
pub mod namedlock;
pub mod names;
pub mod process;
pub mod record;
pub mod report;
pub mod retention;
pub mod run;
pub mod rundir;
pub mod shutdown;
pub mod signals;
pub mod state;
pub mod supervise;
pub mod worker;

#[cfg(target_os = "linux")]
pub mod linux;

use std::time::Duration;

use nix::unistd::Pid;
use tracing_subscriber::EnvFilter;

use clap::CommandFactory;

use crate::cli::{Cli, Command, LogFormat};

/// Every way `ccci-run` itself can fail, each with its documented exit code.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Invalid(#[from] names::NameError),
    #[error(transparent)]
    Run(#[from] run::RunError),
    #[error(transparent)]
    NamedLock(#[from] namedlock::NamedLockError),
    #[error("failed to write metrics file {path}: {source}")]
    Metrics {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("failed to write to stdout: {0}")]
    Output(std::io::Error),
    #[error("failed to list lock dir {path}: {source}")]
    LockDir {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

impl Error {
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Invalid(_) => exit::USAGE,
            Self::Run(_) | Self::NamedLock(_) => exit::INTERNAL,
            Self::Metrics { .. } | Self::LockDir { .. } | Self::Output(_) => exit::FAILURE,
        }
    }
}

/// Run the parsed command line. `start_ppid` is our parent pid as read first thing in `main`,
/// so the orphan check can tell whether the parent died while we were starting.
pub fn run(cli: Cli, matches: &clap::ArgMatches, start_ppid: Pid) -> Result<u8, Error> {
    let resolved = config::resolve(&cli.global, matches)?;
    init_logging(&cli.global, resolved.log_format);
    let global = cli::Global::from_resolved(&resolved)?;
    match cli.command {
        Command::Config(args) => {
            let text = if args.json {
                format!("{}\n", json(&resolved.settings))
            } else {
                let mut out = String::new();
                for s in &resolved.settings {
                    out.push_str(&format!("{:<14} {:<40} {}\n", s.key, s.value, s.origin));
                }
                out
            };
            emit(text.as_bytes())?;
            Ok(0)
        }
        Command::Completions { shell } => {
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "ccci-run", &mut out);
            emit(&out)?;
            Ok(0)
        }
        Command::Man => {
            let mut out = Vec::new();
            clap_mangen::Man::new(Cli::command())
                .render(&mut out)
                .map_err(Error::Output)?;
            emit(&out)?;
            Ok(0)
        }
        Command::AppDomain(args) => {
            let identity = args.validate(&global.suffix)?;
            emit(format!("{}\n{}\n", identity.domain, identity.domain.stack_name()).as_bytes())?;
            Ok(0)
        }
        Command::Janitor(args) => {
            let opts = janitor::SweepOptions {
                dry_run: args.dry_run,
                long_held: Duration::from_secs(args.long_held),
                reap_budget: args.reap_budget,
            };
            let link = janitor::DockerLink::new(global.docker);
            let mut report = janitor::sweep(&global, &opts, &link);
            if let Some(days) = args.keep_runs {
                retention::sweep(
                    &global.runs_dir,
                    Duration::from_secs(days * 86_400),
                    args.dry_run,
                    &mut report,
                );
            }
            // What the sweep did is recorded before anything is printed: a closed or full
            // stdout must not lose the metrics.
            if let Some(path) = &args.metrics_file {
                if !args.dry_run {
                    janitor::write_metrics(path, &report).map_err(|source| Error::Metrics {
                        path: path.clone(),
                        source,
                    })?;
                }
            }
            let text = if args.json {
                format!("{}\n", json(&report))
            } else {
                janitor::render_table(&report)
            };
            emit(text.as_bytes())?;
            Ok(if report.failed() { exit::FAILURE } else { 0 })
        }
        Command::Lock(args) => {
            let opts = namedlock::LockOptions {
                name: names::LockName::parse(&args.name)?,
                wait: args.wait,
                class: args.class,
                promote_after: args.promote_after,
                kill_grace: args.kill_grace,
                teardown_timeout: args.teardown_timeout,
                tie_to: args.tie_to,
                cgroup: global.cgroup,
                command: args.command,
            };
            Ok(namedlock::run(&global.lock_dir, &opts, start_ppid)?)
        }
        Command::Locks(args) => {
            let long_held = Duration::from_secs(args.long_held);
            let locks = match locks::list(&global.lock_dir, long_held) {
                Ok(locks) => locks,
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                Err(source) => {
                    return Err(Error::LockDir {
                        path: global.lock_dir.clone(),
                        source,
                    });
                }
            };
            let text = if args.json {
                format!("{}\n", json(&locks))
            } else {
                locks::render_table(&locks)
            };
            emit(text.as_bytes())?;
            Ok(0)
        }
        Command::Run(args) => {
            let cfg = args.validate(&global)?;
            Ok(run::run(&global, &cfg, start_ppid)?)
        }
    }
}

/// Write `bytes` to stdout. A closed stdout (`| head`) ends the output quietly, as coreutils
/// do; any other write error (a full disk) is a clear error. Never a panic.
fn emit(bytes: &[u8]) -> Result<(), Error> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.map_err(Error::Output),
    }
}

/// Pretty JSON of a report made of plain data.
fn json(value: &impl serde::Serialize) -> String {
    serde_json::to_string_pretty(value).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

fn init_logging(global: &cli::GlobalArgs, format: LogFormat) {
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
    let _ = match format {
        LogFormat::Text => builder.without_time().try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
