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
pub(crate) mod docker;
mod doctor;
pub(crate) mod duration;
pub(crate) mod error;
pub(crate) mod exit;
pub(crate) mod files;
mod fuzz;
pub(crate) mod janitor;
pub(crate) mod lock;
mod man;
pub(crate) mod names;
pub(crate) mod recipe;
pub(crate) mod recipe_url;
pub(crate) mod report;
pub(crate) mod run;
pub(crate) mod rundir;
pub(crate) mod supervise;
pub(crate) mod trust;

use std::process::ExitCode;

use clap::FromArgMatches;
use nix::unistd::Pid;
use tracing_subscriber::EnvFilter;

use crate::cli::{Cli, Command, ConfigArgs, JanitorArgs, LocksArgs, RunsArgs};
use crate::config::{Global, LogFormat, Resolved};
use crate::error::Error;

/// The program: parse the command line, build the configuration, run one command.
pub fn main() -> ExitCode {
    // A run's fence is this binary too; it parses no command line.
    if let Some(args) = supervise::fence::invoked() {
        if args.last().is_some_and(|f| f == "json") {
            init_logging(0, 0, LogFormat::Json);
        }
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
        Err(err) => return command_line_error(&with_dash_dash_tip(err)),
    };
    // A `--json` command prints its envelope whatever happens: on a failure, with the error.
    let json_when_failed = cli.command.json_when_failed();
    match dispatch(cli, &matches, start_ppid) {
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
                let _ = report::stdout(format!("{}\n", json(&document)).as_bytes());
            }
            ExitCode::from(err.exit_code())
        }
    }
}

/// `run` and `lock` take their command after `--`: a command given without it is an unknown
/// argument to clap, and the error says where it goes.
fn with_dash_dash_tip(mut err: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if err.kind() != ErrorKind::UnknownArgument {
        return err;
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--") {
        return err;
    }
    let Some(sub) = args.iter().find(|a| *a == "run" || *a == "lock") else {
        return err;
    };
    let usage = if sub == "run" {
        "ccci-run run [OPTIONS] --recipe R -- COMMAND [ARGS]..."
    } else {
        "ccci-run lock [OPTIONS] NAME -- COMMAND [ARGS]..."
    };
    err.insert(
        ContextKind::Suggested,
        ContextValue::StyledStrs(vec![
            format!("the command to run goes after `--`: {usage}").into(),
        ]),
    );
    err
}

/// A command line clap refused. In the log format the command line would have chosen, though
/// it could not be parsed ([`cli::log_format_before_parsing`], [`config::log_format_for_errors`]):
/// one JSON error event, or clap's own text. `--help` and `--version` print as always.
fn command_line_error(err: &clap::Error) -> ExitCode {
    let (flag, config_flag) = cli::log_format_before_parsing(std::env::args_os().skip(1));
    let given = flag.or_else(config::log_format_from_env);
    let config = config_flag.or_else(|| {
        crate::config::env::var_os("CCCI_CONFIG")
            .filter(|v| !v.is_empty())
            .map(std::path::PathBuf::from)
    });
    if !err.use_stderr() {
        err.exit();
    }
    let code = u8::try_from(err.exit_code()).unwrap_or(exit::USAGE);
    if config::log_format_for_errors(given, config) == LogFormat::Json {
        init_logging(0, 0, LogFormat::Json);
        report::failure(
            &prefixed(&err.render().to_string()),
            &kebab(&format!("{:?}", err.kind())),
            code,
        );
        return ExitCode::from(code);
    }
    // clap's text, styled as clap would style it, under the one prefix every error has.
    let colour = report::stderr_is_terminal() && !config::env::no_color();
    let rendered = err.render();
    let text = if colour {
        rendered.ansi().to_string()
    } else {
        rendered.to_string()
    };
    report::failure(&prefixed(&text), "usage", code);
    ExitCode::from(code)
}

/// clap's error text under the prefix of every error of ccci-run: `ccci-run: error: …`.
fn prefixed(text: &str) -> String {
    format!("ccci-run: {}", text.trim_end())
}

/// `UnknownArgument` → `unknown-argument`.
fn kebab(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if c.is_ascii_uppercase() && !out.is_empty() {
            out.push('-');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// Resolve the configuration and run the command. `start_ppid` is our parent pid as read first
/// thing, so the orphan check can tell whether the parent died while we were starting.
fn dispatch(cli: Cli, matches: &clap::ArgMatches, start_ppid: Pid) -> Result<u8, Error> {
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
        init_logging(quiet, verbose, LogFormat::Text);
        return doctor(args, &inputs);
    }
    let (quiet, verbose) = globals.verbosity();
    let resolved = config::resolve(&inputs).inspect_err(|_| {
        // The error goes out in the format asked for, by the flag, the environment, or a file
        // that at least parses.
        let given = inputs.log_format.as_ref().map(|(format, _)| *format);
        let format = config::log_format_for_errors(given, inputs.config.clone());
        init_logging(quiet, verbose, format);
    })?;
    init_logging(quiet, verbose, resolved.log_format);
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
        Command::Doctor(args) => doctor(&args, inputs),
        Command::Config(args) => show_config(&args, resolved),
        Command::Completions { shell } => emit(&completions::script(shell)).map(|()| 0),
        Command::Complete { what } => complete(&what, global),
        Command::Man { command, dir } => man_pages(command.as_deref(), dir.as_deref()),
        Command::AppDomain(args) => {
            let identity = args.identity.validate(&global.suffix)?;
            let mut text = format!("{}\n{}\n", identity.domain, identity.domain.stack_name());
            let mut code = 0;
            if let Some(dir) = &args.names_in {
                let stack = identity.domain.stack_name();
                let names =
                    recipe::object_names(dir, &stack, identity.domain.as_str()).map_err(|e| {
                        Error::Invalid(names::NameError {
                            what: "--names-in",
                            value: dir.display().to_string(),
                            rule: e.to_string(),
                        })
                    })?;
                text.push_str(&format!(
                    "longest domain suffix: {} (this one: {})\n",
                    recipe::longest_suffix(&names, &identity.domain),
                    global.suffix.as_str().len()
                ));
                for n in names.iter().filter(|n| n.over()) {
                    text.push_str(&format!(
                        "over: {}{}\n",
                        recipe::over_limit_line(n),
                        if n.deployed { "" } else { " (optional file)" }
                    ));
                    code = code.max(if n.deployed { exit::FAILURE } else { 0 });
                }
            }
            emit(text.as_bytes())?;
            if code != 0 {
                report::failure(
                    "ccci-run: error: app-domain: a name the recipe deploys is over Docker's \
                     limit with this domain (the `over:` lines)",
                    "app-domain",
                    code,
                );
            }
            Ok(code)
        }
        Command::Converge(args) => {
            let cfg = args.validate(global)?;
            docker::DockerLink::check_env(global.docker)?;
            Ok(converge::run(&cfg, start_ppid)?)
        }
        Command::Janitor(args) => janitor(&args, global),
        Command::Lock(args) => {
            let cfg = args.validate(global)?;
            let backend = lock::backend(global).map_err(lock::named::NamedLockError::from)?;
            // `--metrics-file`: the janitor's report of the host, once the wait is over (the
            // lock backend knows nothing of the janitor).
            let publish = |backend: &dyn lock::backend::LockBackend| {
                let Some(target) = &cfg.metrics else { return };
                let metrics = janitor::report::gather(&target.global, Some(backend), "lock");
                if let Err(err) = janitor::report::write_host_metrics(&target.file, &metrics) {
                    report::line(&format!(
                        "ccci-run: warning: failed to write metrics file {}: {err}",
                        target.file.display()
                    ));
                }
            };
            Ok(lock::named::run(
                &*backend,
                &global.runs_dir,
                &cfg,
                start_ppid,
                &publish,
            )?)
        }
        Command::Locks(args) => locks(&args, global),
        Command::Runs(args) => runs(&args, global),
        Command::Stop(args) => {
            let cfg = args.validate()?;
            let stopped = run::stop::stop(&global.runs_dir, &cfg)?;
            if let Some(line) = stopped.line {
                emit(format!("{line}\n").as_bytes())?;
            }
            Ok(stopped.code)
        }
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

/// `ccci-run man`: one page on stdout, or every page into a directory.
fn man_pages(command: Option<&str>, dir: Option<&std::path::Path>) -> Result<u8, Error> {
    let pages = man::pages(cli::command()).map_err(Error::Output)?;
    if let Some(dir) = dir {
        let written = std::fs::create_dir_all(dir).and_then(|()| {
            pages
                .iter()
                .try_for_each(|(name, page)| std::fs::write(dir.join(name), page))
        });
        written.map_err(|source| Error::ManDir {
            path: dir.to_owned(),
            source,
        })?;
        let names: Vec<String> = pages.iter().map(|(name, _)| format!("{name}\n")).collect();
        return emit(names.concat().as_bytes()).map(|()| 0);
    }
    let wanted = match command {
        None | Some("ccci-run") => "ccci-run.1".to_owned(),
        Some(command) => format!("ccci-run-{command}.1"),
    };
    match pages.iter().find(|(name, _)| *name == wanted) {
        Some((_, page)) => emit(page).map(|()| 0),
        None => Err(Error::Invalid(names::NameError {
            what: "man page",
            value: command.unwrap_or_default().to_owned(),
            rule: "no such command; see ccci-run --help".to_owned(),
        })),
    }
}

/// `ccci-run __complete WHAT`: the names a shell completes, one a line; what cannot be read is
/// left out without a word (a completion must never print an error into the line).
fn complete(what: &str, global: &Global) -> Result<u8, Error> {
    let names: Vec<String> = match what {
        "run-ids" | "live-run-ids" => {
            let all = what == "run-ids";
            let mut listing = run::list::list(&global.runs_dir, all, std::time::SystemTime::now())
                .unwrap_or_default();
            if !all {
                run::list::only_live(&mut listing);
            }
            listing.runs.into_iter().map(|r| r.run_id).collect()
        }
        _ => lock::backend(global)
            .ok()
            .and_then(|b| b.list(global.timings.value(config::Timing::LongHeld)).ok())
            .unwrap_or_default()
            .into_iter()
            .filter(|l| l.kind == lock::list::LockKind::Named)
            .map(|l| l.name)
            .collect(),
    };
    let text: String = names
        .iter()
        .filter(|n| names::RunId::parse(n).is_ok())
        .map(|n| format!("{n}\n"))
        .collect();
    emit(text.as_bytes()).map(|()| 0)
}

/// `ccci-run config`: each setting with where it came from.
fn show_config(args: &ConfigArgs, resolved: &Resolved) -> Result<u8, Error> {
    let text = if args.json {
        let settings = Settings {
            settings: &resolved.settings,
        };
        format!("{}\n", json(&report::Envelope::new(&settings, Vec::new())))
    } else {
        // Columns as wide as the longest key (and value, up to 40), so every line lines up.
        let keys = resolved
            .settings
            .iter()
            .map(|s| s.key.len())
            .max()
            .unwrap_or(0);
        let values = resolved
            .settings
            .iter()
            .map(|s| s.value.chars().count())
            .filter(|&n| n <= 40)
            .max()
            .unwrap_or(0);
        resolved
            .settings
            .iter()
            .map(|s| format!("{:<keys$} {:<values$} {}\n", s.key, s.value, s.origin))
            .collect::<String>()
    };
    let text = if args.json {
        text
    } else {
        names::visible_text(&text)
    };
    emit(text.as_bytes()).map(|()| 0)
}

/// `ccci-run janitor`: one sweep, the retention pass, the metrics, the report.
fn janitor(args: &JanitorArgs, global: &Global) -> Result<u8, Error> {
    // A system directory as the runs dir was refused before (`command`).
    let keep_runs = global.timings.get(config::Timing::KeepRuns);
    docker::DockerLink::check_env(global.docker)?;
    let opts = args.sweep_options(global);
    let link = docker::DockerLink::new(global.docker, global.node_sweep.clone());
    // A worker's engine can judge and remove nothing: say so before any lock is probed.
    if let Some(Ok(seam)) = link.get() {
        seam.refuse_a_worker().map_err(|err| names::NameError {
            what: "Docker engine",
            value: crate::config::env::var("DOCKER_HOST")
                .unwrap_or_else(|_| "(the default socket)".into()),
            rule: err.to_string(),
        })?;
    }
    let mut report = janitor::sweep(global, &opts, &link);
    for warning in &report.warnings {
        report::line(&format!("ccci-run: warning: {warning}"));
    }
    if let Some(keep) = keep_runs {
        janitor::retention::sweep(&global.runs_dir, keep, args.dry_run, &mut report);
    }
    // What the sweep did is recorded before anything is printed: a closed or full stdout must
    // not lose the metrics.
    match &args.metrics_file {
        Some(path) if args.dry_run => report::line(&format!(
            "ccci-run: warning: --dry-run changes nothing: metrics not written to {}",
            path.display()
        )),
        Some(path) => {
            let backend = lock::backend(global).ok();
            report.host = Some(janitor::report::gather(
                global,
                backend.as_deref(),
                "janitor",
            ));
            janitor::report::write_metrics(path, &report).map_err(|source| Error::Metrics {
                path: path.clone(),
                source,
            })?;
        }
        None => {}
    }
    // Every error of the sweep on stderr, under the one prefix, whatever stdout shows; a sweep
    // that failed for its apps alone says which.
    let code = if report.failed() { exit::FAILURE } else { 0 };
    for err in &report.errors {
        report::failure(&format!("ccci-run: error: {err}"), "janitor", code);
    }
    if code != 0 && report.errors.is_empty() {
        let failed: Vec<&str> = report
            .candidates
            .iter()
            .filter(|c| {
                use janitor::decide::Decision;
                (c.error.is_some() && matches!(c.decision, Decision::Reap | Decision::WouldReap))
                    || c.decision == Decision::ReapIncomplete
            })
            .map(|c| c.domain.as_str())
            .collect();
        report::failure(
            &format!(
                "ccci-run: error: janitor: {} app(s) not reaped: {}",
                failed.len(),
                failed.join(", ")
            ),
            "janitor",
            code,
        );
    }
    let text = if args.json() {
        format!("{}\n", json(&report::Envelope::versioned(&report)))
    } else {
        names::visible_text(&janitor::report::render_table(&report, args.wide()))
    };
    emit(text.as_bytes())?;
    Ok(code)
}

/// `ccci-run doctor`: every check, exit 1 when any failed.
fn doctor(args: &cli::DoctorArgs, inputs: &config::Inputs) -> Result<u8, Error> {
    let opts = doctor::Options {
        unit: args.unit.clone(),
        unit_file: args.unit_file.clone(),
    };
    let report = doctor::run(inputs, &opts);
    // A failed check fails the command: said on stderr too, under the one prefix.
    let failed: Vec<&str> = report
        .checks
        .iter()
        .filter(|c| c.state == doctor::State::Fail)
        .map(|c| c.name.as_str())
        .collect();
    let errors: Vec<String> = if failed.is_empty() {
        Vec::new()
    } else {
        vec![format!(
            "doctor: {} check(s) failed: {}",
            failed.len(),
            failed.join(", ")
        )]
    };
    let text = if args.json {
        format!(
            "{}\n",
            json(&report::Envelope::new(&report, errors.clone()))
        )
    } else {
        names::visible_text(&doctor::render(&report))
    };
    emit(text.as_bytes())?;
    let code = if report.ok { 0 } else { exit::FAILURE };
    for error in &errors {
        report::failure(&format!("ccci-run: error: {error}"), "doctor", code);
    }
    Ok(code)
}

/// `ccci-run locks`: every lock file, held or not.
fn locks(args: &LocksArgs, global: &Global) -> Result<u8, Error> {
    let long_held = global.timings.value(config::Timing::LongHeld);
    let backend = lock::backend(global).map_err(Error::from)?;
    let mut errors = Vec::new();
    if let Some(missing) = backend.missing_store() {
        report::line(&format!("ccci-run: warning: {missing}"));
        errors.push(missing.to_string());
    }
    let locks = match backend.list(long_held) {
        Ok(locks) => locks,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(source) => {
            // The etcd backend's own error names its endpoints already: said once.
            return Err(match source.downcast::<lock::LockError>() {
                Ok(err) => Error::from(err),
                Err(source) => Error::LockDir {
                    store: backend.describe_store(),
                    source,
                },
            });
        }
    };
    let text = if args.json() {
        let locks = Locks { locks: &locks };
        format!("{}\n", json(&report::Envelope::new(&locks, errors)))
    } else {
        names::visible_text(&lock::list::render_table(&locks, args.wide()))
    };
    emit(text.as_bytes()).map(|()| 0)
}

/// `ccci-run runs`: every run in the runs dir, with what it holds.
fn runs(args: &RunsArgs, global: &Global) -> Result<u8, Error> {
    let one = args
        .run_id
        .as_deref()
        .map(names::RunId::parse)
        .transpose()?;
    let mut listing = run::list::list(
        &global.runs_dir,
        args.all || one.is_some(),
        std::time::SystemTime::now(),
    )
    .map_err(|source| Error::RunsDir {
        path: global.runs_dir.clone(),
        source,
    })?;
    let mut errors = std::mem::take(&mut listing.warnings);
    // The locks are listed only when a run holds or waits for one, or is dead: a look at the
    // store, never a take.
    if run::list::uses_locks(&listing) {
        let long_held = global.timings.value(config::Timing::LongHeld);
        match lock::backend(global).map(|b| b.list(long_held)) {
            Ok(Ok(locks)) => run::list::add_holders(&mut listing, &locks),
            Ok(Err(err)) => {
                errors.push(format!(
                    "failed to list the locks: {err}; holders not shown"
                ));
            }
            Err(err) => errors.push(format!("{err}; lock holders not shown")),
        }
    }
    if !args.json() {
        for error in &errors {
            report::line(&format!("ccci-run: warning: {error}"));
        }
    }
    if let Some(id) = one {
        let Some(found) = listing.runs.iter().find(|r| r.run_id == id.as_str()) else {
            return Err(Error::NoSuchRun {
                run_id: id.as_str().to_owned(),
                runs_dir: global.runs_dir.clone(),
            });
        };
        let text = if args.json() {
            let one = OneRun {
                run: run::list::Whole {
                    run: found,
                    phases: &found.phases,
                    error: found.error.as_deref(),
                },
            };
            format!("{}\n", json(&report::Envelope::new(&one, errors)))
        } else {
            run::list::render_one(found)
        };
        return emit(text.as_bytes()).map(|()| 0);
    }
    if args.live {
        run::list::only_live(&mut listing);
    }
    let text = if args.json() {
        format!("{}\n", json(&report::Envelope::new(&listing, errors)))
    } else {
        run::list::render_table(&listing.runs, args.wide())
    };
    emit(text.as_bytes()).map(|()| 0)
}

/// Write `bytes` to stdout. A closed stdout (`| head`) ends the output quietly, as coreutils
/// do; any other write error (a full disk) is a clear error. Never a panic.
fn emit(bytes: &[u8]) -> Result<(), Error> {
    report::stdout(bytes).map_err(Error::Output)
}

/// `config --json`: the settings, in the envelope.
#[derive(serde::Serialize)]
struct Settings<'a> {
    settings: &'a [config::Setting],
}

/// `locks --json`: every lock, in the envelope.
#[derive(serde::Serialize)]
struct Locks<'a> {
    locks: &'a [lock::list::LockInfo],
}

/// `runs RUN_ID --json`: the run, in the envelope.
#[derive(serde::Serialize)]
struct OneRun<'a> {
    run: run::list::Whole<'a>,
}

/// Pretty JSON of a report made of plain data.
fn json(value: &impl serde::Serialize) -> String {
    // No control or bidi character reaches a reader of any document, raw or decoded.
    names::visible_json(
        &serde_json::to_string_pretty(value).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}")),
    )
}

fn init_logging(quiet: u8, verbose: u8, format: LogFormat) {
    let level = match (quiet, verbose) {
        (q, _) if q > 0 => "error",
        (_, 0) => "warn",
        (_, 1) => "info",
        (_, 2) => "debug",
        _ => "trace",
    };
    // Status lines are always shown, whatever the level or RUST_LOG says.
    let status = format!("{}=info", report::STATUS_TARGET)
        .parse()
        .expect("a valid directive");
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("ccci_run={level}")))
        .add_directive(status);
    // Colour only for a person at a terminal, and never when NO_COLOR says so.
    let colour = report::stderr_is_terminal() && !config::env::no_color();
    // A stderr nobody reads any more (or a full disk) drops the event, never a panic.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(report::Stderr)
        .with_ansi(colour)
        .with_target(false);
    let _ = match format {
        LogFormat::Text => builder.without_time().try_init(),
        LogFormat::Json => {
            report::use_json();
            builder
                .json()
                .with_current_span(true)
                .with_span_list(false)
                .try_init()
        }
    };
}
