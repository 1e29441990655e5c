//! `runs` and `stop`: looking at runs from outside.

use super::*;

#[derive(Debug, Args)]
pub(crate) struct RunsArgs {
    /// Every run, however long ago it ended.
    #[arg(long)]
    pub all: bool,
    /// Print the list as one JSON object.
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
    pub(crate) fn validate(&self) -> Result<crate::run::stop::StopConfig, NameError> {
        Ok(crate::run::stop::StopConfig {
            run_id: RunId::parse(&self.run_id)?,
            wait: self.wait,
            kill: self.kill,
        })
    }
}
