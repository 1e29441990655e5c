//! From a parsed command line to its command's room: the configuration resolved once, the
//! runner's user taken on before a command that writes, each configured directory a command
//! needs looked at, and each command handed to its room with the values it needs. Here too the
//! wiring between commands that the commands may not do themselves ([`RunSweeper`]).
//!
//! Floor: entry (docs/architecture.md): the top floor, imported by nothing but the entry.

use nix::unistd::Pid;

use crate::cli::{self, Cli, Command};
use crate::config::{self, Global, LogFormat, Resolved};
use crate::error::Error;
use crate::{
    completions, converge, docker, doctor, error, inspect, janitor, lock, man, named_lock, report,
    run, runs, supervise, trust,
};

/// Resolve the configuration and run the command. `start_ppid` is our parent pid as read first
/// thing, so the orphan check can tell whether the parent died while we were starting.
pub(crate) fn dispatch(cli: Cli, matches: &clap::ArgMatches, start_ppid: Pid) -> Result<u8, Error> {
    let globals = cli::Globals {
        top: (&cli.global, matches),
        sub: cli
            .command
            .global()
            .zip(matches.subcommand().map(|(_, m)| m)),
    };
    let mut inputs = globals.inputs();
    inputs.timings = cli.command.timing_flags();
    // Doctor judges the configuration rather than refusing it: it resolves it itself.
    if let Command::Doctor(args) = &cli.command {
        let (quiet, verbose) = globals.verbosity();
        report::init_logging(quiet, verbose, LogFormat::Text);
        return doctor::command(&doctor_options(args), args.json, &inputs);
    }
    let (quiet, verbose) = globals.verbosity();
    let resolved = config::resolve(&inputs).inspect_err(|_| {
        // The error goes out in the format asked for, by the flag, the environment, or a file
        // that at least parses.
        let given = inputs.log_format.as_ref().map(|(format, _)| *format);
        let format = config::log_format_for_errors(given, inputs.config.clone());
        report::init_logging(quiet, verbose, format);
    })?;
    report::init_logging(quiet, verbose, resolved.log_format);
    for s in &resolved.settings {
        tracing::debug!(key = s.key, value = %s.value, origin = %s.origin, "setting");
    }
    let global = Global::from_resolved(&resolved)?;
    // The engine, once: the flag's, the environment's, or the file's.
    docker::endpoint::choose(global.docker_host.as_ref());
    // Whose files are ours: the runner's user's too, when we are root and the file says so.
    trust::set_runner(global.runner);
    // One user runs the runs and sweeps them: a command that writes becomes the runner's user
    // before it touches any run, lock, state or server file.
    let writes = match &cli.command {
        Command::Run(_) | Command::Lock(_) | Command::Stop(_) | Command::Converge(_) => true,
        Command::Janitor(args) => !args.dry_run,
        _ => false,
    };
    if writes {
        trust::become_runner()?;
    }
    // A run and a lock command fork their fence now: as the user they run as, while this
    // process has one thread. In the fence, this is where its life ends.
    if matches!(cli.command, Command::Run(_) | Command::Lock(_)) {
        if let Some(code) = crate::supervise::fence::prefork() {
            return Ok(code);
        }
    }
    command(cli.command, &global, &resolved, &inputs, start_ppid)
        .map_err(|err| err.located(&global))
}

/// Run one command.
fn command(
    command: Command,
    global: &Global,
    resolved: &Resolved,
    inputs: &config::Inputs,
    start_ppid: Pid,
) -> Result<u8, Error> {
    // A system directory as the runs dir is refused first, whether it exists or not (a path
    // such as `/var/lib/x/..` names one without existing).
    let keeps_runs = match &command {
        Command::Run(_) => true,
        Command::Janitor(_) => global.timings.get(config::Timing::KeepRuns).is_some(),
        _ => false,
    };
    if keeps_runs {
        janitor::retention::refuse_system_runs_dir(&global.runs_dir)?;
    }
    check_dirs(&command, global)?;
    match command {
        Command::Doctor(args) => doctor::command(&doctor_options(&args), args.json, inputs),
        Command::Config(args) => inspect::config(args.json, resolved),
        Command::Completions { shell } => error::emit(&completions::script(shell)).map(|()| 0),
        Command::Complete { what } => completions::complete(&what, global),
        Command::Man { command, dir } => man::command(command.as_deref(), dir.as_deref()),
        Command::AppDomain(args) => inspect::app_domain(
            &args.identity.validate(&global.suffix)?,
            args.names_in.as_deref(),
            global,
        ),
        Command::Converge(args) => {
            let cfg = args.validate(global)?;
            docker::DockerLink::check_env(global.docker)?;
            Ok(converge::run(&cfg, start_ppid)?)
        }
        Command::Janitor(args) => janitor::command::run(
            &janitor::command::Asked {
                opts: args.sweep_options(global),
                dry_run: args.dry_run,
                metrics_file: args.metrics_file.clone(),
                json: args.json(),
                wide: args.wide(),
            },
            global,
        ),
        Command::Lock(args) => {
            let cfg = args.validate(global)?;
            let backend = lock::backend(global).map_err(named_lock::NamedLockError::from)?;
            // `--metrics-file`: the janitor's report of the host, once the wait is over (the
            // lock backend knows nothing of the janitor).
            let publish = |backend: &dyn lock::backend::LockBackend| {
                let Some(target) = &cfg.metrics else { return };
                let metrics = janitor::metrics::gather(&target.global, Some(backend), "lock");
                if let Err(err) = janitor::metrics::write_host_metrics(&target.file, &metrics) {
                    report::line(&format!(
                        "ccci-run: warning: failed to write metrics file {}: {err}",
                        target.file.display()
                    ));
                }
            };
            Ok(named_lock::run(
                &*backend,
                &global.runs_dir,
                &cfg,
                start_ppid,
                &publish,
            )?)
        }
        Command::Locks(args) => inspect::locks(args.json(), args.wide(), global),
        Command::Runs(args) => runs::command(
            &runs::Asked {
                run_id: args.run_id.clone(),
                all: args.all,
                live: args.live,
                json: args.json(),
                wide: args.wide(),
            },
            global,
        ),
        Command::Stop(args) => runs::stop::command(&args.validate()?, global),
        Command::Run(args) => {
            let cfg = args.validate(global)?;
            docker::DockerLink::check_env(global.docker)?;
            Ok(run::run(global, &cfg, start_ppid, &RunSweeper)?)
        }
    }
}

/// Refuse, before anything is done, each configured directory `command` keeps or reads that is
/// missing with its parent (`config::dirs`): one exit code (2) and one message for every
/// command. The lock dir only counts for the local locks.
fn check_dirs(command: &Command, global: &Global) -> Result<(), Error> {
    use config::dirs::{Dir, look};
    let dirs: &[Dir] = match command {
        Command::Run(_) | Command::Janitor(_) => &[Dir::Lock, Dir::Runs, Dir::State],
        Command::Lock(_) => &[Dir::Lock, Dir::Runs],
        Command::Locks(_) => &[Dir::Lock],
        Command::Runs(_) | Command::Stop(_) => &[Dir::Runs],
        _ => &[],
    };
    for &dir in dirs {
        let path = match dir {
            Dir::Lock if global.etcd.is_some() => continue,
            Dir::Lock => &global.lock_dir,
            Dir::Runs => &global.runs_dir,
            // In the runs dir (the default): made with it, which the runs dir's look covers.
            Dir::State if global.state_dir.parent() == Some(global.runs_dir.as_path()) => continue,
            Dir::State => &global.state_dir,
        };
        look(dir, path)?;
    }
    Ok(())
}

/// The janitor's side of a run, handed to it here: a command imports no other command.
struct RunSweeper;

impl run::Sweeper for RunSweeper {
    fn reap_dead_runs_processes(&self, scope: supervise::identity::Scope) {
        janitor::reap::reap_dead_runs_processes(scope, &mut Vec::new(), false);
    }

    fn sweep(
        &self,
        locks: &dyn lock::backend::LockBackend,
        global: &config::Global,
        reap_budget: std::time::Duration,
        docker: &docker::DockerLink,
    ) {
        let opts = config::SweepOptions {
            dry_run: false,
            hunt: config::Hunt::Nearby,
            long_held: config::DEFAULT_LONG_HELD,
            reap_budget,
        };
        let report = janitor::sweep_with(locks, global, &opts, docker);
        for warning in &report.warnings {
            tracing::warn!("janitor: {warning}");
        }
        for err in &report.errors {
            tracing::warn!("janitor: {err}");
        }
        for c in report
            .candidates
            .iter()
            .filter(|c| c.decision == janitor::decide::Decision::Reap)
        {
            if let Some(err) = &c.error {
                tracing::warn!("janitor: failed to reap {}: {err}", c.domain);
            }
        }
    }
}

/// What `doctor`'s command line asks for beyond the configuration.
fn doctor_options(args: &cli::DoctorArgs) -> doctor::Options {
    doctor::Options {
        unit: args.unit.clone(),
        unit_file: args.unit_file.clone(),
    }
}
