//! `doctor` and `config`: what the host and the configuration are.

use std::path::PathBuf;

use clap::Args;

use crate::cli::globals::GlobalArgs;

#[derive(Debug, Args)]
pub(crate) struct DoctorArgs {
    /// Print every check as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// The Drone runner's systemd unit, asked of systemd where it runs
    /// [default: drone-runner-exec.service].
    #[arg(long, value_name = "UNIT", conflicts_with = "unit_file")]
    pub unit: Option<String>,
    /// Read the runner's unit from FILE (and its FILE.d/*.conf drop-ins) instead of asking
    /// systemd.
    #[arg(long, value_name = "FILE")]
    pub unit_file: Option<PathBuf>,
    #[command(flatten)]
    pub global: GlobalArgs,
}

#[derive(Debug, Args)]
pub(crate) struct ConfigArgs {
    /// Print the settings as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub global: GlobalArgs,
}
