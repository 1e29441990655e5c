//! `ccci-run doctor`: whether this host can run recipe CI as configured, one check a line.
//!
//! Each check ends in one of four states: `ok`; `warn` (runs work, but less well than they
//! could: a fallback is in use, or a limit is near); `fail` (a run, a lock or a sweep will not
//! work as configured: exit 1); `skip` (the check cannot be made here — no systemd, Docker or
//! etcd not in use — and says why and how to make it). Every check is always listed, whatever
//! came before it: a bad configuration file fails its check and the rest run on the settings
//! without it.
//!
//! Invariant: doctor changes nothing it does not undo before it returns (a probe cgroup, a
//! probe lease), never panics, and never hangs: each Docker, etcd and systemd question is
//! asked within a bound.
//!
//! Here: the report and the settings' checks; the checks of the host ([`host`]), the runner
//! ([`runner`], its unit parsed by [`unit`]), the engine ([`engine`]) and etcd ([`etcd`]) are
//! rooms of their own.
//!
//! Floor: commands (docs/architecture.md): imports the floors below, never another command.

mod check;
mod engine;
mod etcd;
mod host;
mod options;
mod runner;
mod unit;

use check::check;
pub(crate) use check::{Check, Report, State};
use engine::docker;
use etcd::etcd;
use host::{cgroups, directory, inotify, lock_dir_tmpfs};
pub(crate) use options::Options;
use runner::{runner_unit, step_path, unit_checks};

use std::path::PathBuf;

use crate::config::dirs::{self, Dir};
use crate::config::{self, Global, Inputs};
use crate::error::{Error, emit};

/// Run every check.
pub(crate) fn run(inputs: &Inputs, opts: &Options) -> Report {
    let mut checks = Vec::new();
    let global = settings(inputs, &mut checks);
    crate::trust::set_runner(global.runner);
    for (dir, key, missing, setting) in [
        (&global.lock_dir, "lock_dir", State::Warn, Some(Dir::Lock)),
        (&global.runs_dir, "runs_dir", State::Warn, Some(Dir::Runs)),
        (
            &global.state_dir,
            "state_dir",
            State::Warn,
            Some(Dir::State),
        ),
        (&global.abra_home, "abra_home", State::Fail, None),
    ] {
        // A configured dir whose parent is missing is what every command refuses (exit 2).
        let used = setting != Some(Dir::Lock) || global.etcd.is_none();
        match setting.filter(|_| used).map(|s| dirs::look(s, dir)) {
            Some(Err(refused)) => checks.push(
                check(format!("dir {key}"), State::Fail, refused.to_string())
                    .fix(format!("install -d -m 0755 {}", dir.display())),
            ),
            _ => checks.push(directory(dir, key, missing)),
        }
    }
    checks.push(lock_dir_tmpfs(&global.lock_dir));
    checks.push(cgroups(global.cgroup));
    let unit = runner_unit(opts);
    checks.extend(unit_checks(&unit, &global));
    checks.extend(docker(&global));
    checks.extend(etcd(&global));
    checks.extend(inotify(&global.lock_dir));
    checks.extend(step_path(&unit));
    Report {
        ok: checks.iter().all(|c| c.state != State::Fail),
        checks,
    }
}

/// The text report: one line per check, its fix after it.
pub(crate) fn render(report: &Report) -> String {
    let mut out = String::new();
    for c in &report.checks {
        out.push_str(&format!(
            "{:<4}  {:<24} {}",
            c.state.as_str(),
            c.name,
            c.detail
        ));
        if let Some(fix) = &c.fix {
            out.push_str(&format!(" — fix: {fix}"));
        }
        out.push('\n');
    }
    let count = |s: State| report.checks.iter().filter(|c| c.state == s).count();
    out.push_str(&format!(
        "{} ok, {} warn, {} fail, {} skip\n",
        count(State::Ok),
        count(State::Warn),
        count(State::Fail),
        count(State::Skip)
    ));
    out
}

/// The configuration file's check, and the settings the other checks use: the configured ones,
/// or (when the file or a setting is refused) those without what was refused.
fn settings(inputs: &Inputs, checks: &mut Vec<Check>) -> Global {
    let (path, named) = match &inputs.config {
        Some(path) => (path.clone(), true),
        None => (PathBuf::from(config::DEFAULT_FILE), false),
    };
    let file_ok = match crate::config_file::read(&path, named) {
        Ok(None) => {
            checks.push(
                check(
                    "config-file",
                    State::Warn,
                    format!("no configuration file at {}", path.display()),
                )
                .fix(format!(
                    "write {} (see systemd/config.toml): the Drone step, the janitor's timer and \
                     an operator's shell then share one set of paths",
                    path.display()
                )),
            );
            true
        }
        Ok(Some(text)) => match config::parse(&text, &path) {
            Ok(_) => {
                checks.push(check(
                    "config-file",
                    State::Ok,
                    format!("{}: owned and mode-safe, parses", path.display()),
                ));
                true
            }
            Err(err) => {
                checks.push(
                    check("config-file", State::Fail, err.to_string()).fix(format!(
                        "correct {}; the checks below use the settings without it",
                        path.display()
                    )),
                );
                false
            }
        },
        Err(err) => {
            checks.push(check("config-file", State::Fail, err.to_string()).fix(
                "chown root (or the runner's user) and chmod go-w the file and its directory; \
                 the checks below use the settings without it",
            ));
            false
        }
    };
    let without_file = Inputs {
        config: Some(PathBuf::from("/dev/null")),
        ..inputs.clone()
    };
    let resolved = match config::resolve(if file_ok { inputs } else { &without_file }) {
        // A value in the file that does not hold (a bad duration): the file's fault when the
        // settings without it resolve.
        Err(err) if file_ok && config::resolve(&without_file).is_ok() => {
            if let Some(c) = checks.iter_mut().find(|c| c.name == "config-file") {
                *c = check("config-file", State::Fail, err.to_string()).fix(format!(
                    "correct {}; the checks below use the settings without it",
                    path.display()
                ));
            }
            config::resolve(&without_file)
        }
        other => other,
    };
    let global = resolved
        .map_err(|e| e.to_string())
        .and_then(|r| Global::from_resolved(&r).map_err(|e| e.to_string()));
    match global {
        Ok(global) => {
            checks.push(check("settings", State::Ok, "every setting is valid"));
            global
        }
        Err(err) => {
            checks.push(
                check("settings", State::Fail, err)
                    .fix("correct the setting named; the checks below use the built-in defaults"),
            );
            let defaults = Inputs {
                config: Some(PathBuf::from("/dev/null")),
                ..Inputs::default()
            };
            config::resolve(&defaults)
                .ok()
                .and_then(|r| Global::from_resolved(&r).ok())
                .expect("the built-in defaults are valid")
        }
    }
}

/// `ccci-run doctor`: every check, exit 1 when any failed.
pub(crate) fn command(opts: &Options, json: bool, inputs: &config::Inputs) -> Result<u8, Error> {
    let report = run(inputs, opts);
    // A failed check fails the command: said on stderr too, under the one prefix.
    let failed: Vec<&str> = report
        .checks
        .iter()
        .filter(|c| c.state == State::Fail)
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
    let text = if json {
        format!(
            "{}\n",
            crate::report::json(&crate::report::Envelope::new(&report, errors.clone()))
        )
    } else {
        crate::names::visible_text(&render(&report))
    };
    emit(text.as_bytes())?;
    let code = if report.ok { 0 } else { crate::exit::FAILURE };
    for error in &errors {
        crate::report::failure(&format!("ccci-run: error: {error}"), "doctor", code);
    }
    Ok(code)
}
