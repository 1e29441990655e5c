//! `ccci-run janitor`: one sweep, the retention pass, the metrics, the report, and the exit
//! code that says whether every app was dealt with.
//!
//! Floor: commands (docs/architecture.md): imports the floors below, never another command.

use std::path::PathBuf;

use crate::config::{Global, SweepOptions};
use crate::error::{Error, emit};
use crate::janitor::metrics;
use crate::{config, docker, exit, lock, names};

use super::{retention, sweep_report};

/// What the command line asked of the janitor, validated.
#[derive(Debug)]
pub(crate) struct Asked {
    pub opts: SweepOptions,
    pub dry_run: bool,
    pub metrics_file: Option<PathBuf>,
    pub json: bool,
    pub wide: bool,
}

/// `ccci-run janitor`: one sweep, the retention pass, the metrics, the report.
pub(crate) fn run(args: &Asked, global: &Global) -> Result<u8, Error> {
    // A system directory as the runs dir was refused before (`command`).
    let keep_runs = global.timings.get(config::Timing::KeepRuns);
    docker::DockerLink::check_env(global.docker)?;
    let opts = args.opts.clone();
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
    let mut report = super::sweep(global, &opts, &link);
    for warning in &report.warnings {
        crate::report::line(&format!("ccci-run: warning: {warning}"));
    }
    if let Some(keep) = keep_runs {
        retention::sweep(&global.runs_dir, keep, args.dry_run, &mut report);
    }
    // What the sweep did is recorded before anything is printed: a closed or full stdout must
    // not lose the metrics.
    match &args.metrics_file {
        Some(path) if args.dry_run => crate::report::line(&format!(
            "ccci-run: warning: --dry-run changes nothing: metrics not written to {}",
            path.display()
        )),
        Some(path) => {
            let backend = lock::backend(global).ok();
            report.host = Some(metrics::gather(global, backend.as_deref(), "janitor"));
            metrics::write_metrics(path, &report).map_err(|source| Error::Metrics {
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
        crate::report::failure(&format!("ccci-run: error: {err}"), "janitor", code);
    }
    if code != 0 && report.errors.is_empty() {
        let failed: Vec<&str> = report
            .candidates
            .iter()
            .filter(|c| {
                use super::decide::Decision;
                (c.error.is_some() && matches!(c.decision, Decision::Reap | Decision::WouldReap))
                    || c.decision == Decision::ReapIncomplete
            })
            .map(|c| c.domain.as_str())
            .collect();
        crate::report::failure(
            &format!(
                "ccci-run: error: janitor: {} app(s) not reaped: {}",
                failed.len(),
                failed.join(", ")
            ),
            "janitor",
            code,
        );
    }
    let text = if args.json {
        format!(
            "{}\n",
            crate::report::json(&crate::report::Envelope::versioned(&report))
        )
    } else {
        names::visible_text(&sweep_report::render_table(&report, args.wide))
    };
    emit(text.as_bytes())?;
    Ok(code)
}
