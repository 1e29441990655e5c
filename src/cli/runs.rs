//! `runs` and `stop`: looking at runs from outside.

use std::time::Duration;

use clap::Args;

use crate::cli::globals::GlobalArgs;
use crate::cli::parse::any_duration;
use crate::names::{NameError, RunId};

#[derive(Debug, Args)]
pub(crate) struct RunsArgs {
    /// One run: its phases with their times, its lock, cgroup and record, and how it ended or
    /// what a janitor did with it (exit 1 when no record names it).
    #[arg(value_name = "RUN_ID")]
    pub run_id: Option<String>,
    /// Every run, however long ago it ended.
    #[arg(long, conflicts_with = "live")]
    pub all: bool,
    /// Only the live runs (those waiting for their lock included).
    #[arg(long)]
    pub live: bool,
    /// Every column and no cut: the domain, the cgroup and the record too (also `-o wide`).
    #[arg(long)]
    pub wide: bool,
    /// The output: `table` (fits 100 columns), `wide` or `json`.
    #[arg(short = 'o', long = "output", value_name = "FORMAT", value_parser = ["table", "wide", "json"])]
    pub output: Option<String>,
    /// Print the list as one JSON object (also `-o json`).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub global: GlobalArgs,
}

#[derive(Debug, Args)]
pub(crate) struct StopArgs {
    /// The run's id (its directory in the runs dir).
    #[arg(value_name = "RUN_ID")]
    pub run_id: String,
    /// How long to wait for the run to finish its record (exit 75 if it has not).
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, default_value = "30s", value_parser = any_duration)]
    pub wait: Duration,
    /// Past the wait, kill the run's supervisor, then its cgroup (or every process naming
    /// it), and record that.
    #[arg(long)]
    pub kill: bool,
    #[command(flatten)]
    pub global: GlobalArgs,
}

impl StopArgs {
    pub(crate) fn validate(&self) -> Result<crate::runs::stop::StopConfig, NameError> {
        Ok(crate::runs::stop::StopConfig {
            run_id: RunId::parse(&self.run_id)?,
            wait: self.wait,
            kill: self.kill,
        })
    }
}

impl RunsArgs {
    pub(crate) fn json(&self) -> bool {
        self.json || self.output.as_deref() == Some("json")
    }

    pub(crate) fn wide(&self) -> bool {
        self.wide || self.output.as_deref() == Some("wide")
    }
}
