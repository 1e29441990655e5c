//! `janitor`'s arguments.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::cli::globals::GlobalArgs;
use crate::cli::parse::{keep_runs, long_held, reap_budget};
use crate::config::{Global, SweepOptions, Timing};

#[derive(Debug, Args)]
pub(crate) struct JanitorArgs {
    /// Decide and report, but change nothing at all.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the report as one JSON object (also `-o json`).
    #[arg(long)]
    pub json: bool,
    /// Every detail in full, nothing cut (also `-o wide`).
    #[arg(long)]
    pub wide: bool,
    /// The output: `table` (fits 100 columns), `wide` or `json`.
    #[arg(short = 'o', long = "output", value_name = "FORMAT", value_parser = ["table", "wide", "json"])]
    pub output: Option<String>,
    /// Flag (never steal) a lock held for longer than DURATION
    /// [env: CCCI_LONG_HELD; file: long_held; default: 2h].
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, value_parser = long_held)]
    pub long_held: Option<Duration>,
    /// Also write Prometheus metrics here (node_exporter textfile collector), atomically.
    #[arg(long, value_name = "PATH")]
    pub metrics_file: Option<PathBuf>,
    /// How long reaping may take (the Docker side, until the engine lists nothing of each
    /// stack); past it the stack is `reap-incomplete` and the next sweep finishes the job
    /// [env: CCCI_REAP_BUDGET; file: reap_budget; default: 2m].
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, value_parser = reap_budget)]
    pub reap_budget: Option<Duration>,
    /// Also remove per-run directories older than AGE whose run is not live; AGE needs a unit
    /// (14d, 36h) [env: CCCI_KEEP_RUNS; file: keep_runs; default: keep them].
    #[arg(long, value_name = "AGE", allow_hyphen_values = true, value_parser = keep_runs)]
    pub keep_runs: Option<Duration>,
    #[command(flatten)]
    pub global: GlobalArgs,
}

impl JanitorArgs {
    pub(crate) fn json(&self) -> bool {
        self.json || self.output.as_deref() == Some("json")
    }

    pub(crate) fn wide(&self) -> bool {
        self.wide || self.output.as_deref() == Some("wide")
    }

    pub(crate) fn sweep_options(&self, global: &Global) -> SweepOptions {
        SweepOptions {
            dry_run: self.dry_run,
            hunt: crate::config::Hunt::Everywhere,
            long_held: global.timings.value(Timing::LongHeld),
            reap_budget: global.timings.value(Timing::ReapBudget),
        }
    }
}
