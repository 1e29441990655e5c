//! `converge`'s arguments: the stack to wait for, and how long.

use std::time::Duration;

use clap::Args;

use crate::cli::globals::GlobalArgs;
use crate::cli::parse::{converge_stable, converge_timeout};
use crate::config::{DockerMode, Global, Identity, Origin, Timing};
use crate::names::{NameError, StackName};

#[derive(Debug, Args)]
#[command(
    group(clap::ArgGroup::new("target").args(["domain", "stack", "recipe"])),
    long_about = "Wait until a deployed stack has converged: every service of the stack (label \
        com.docker.stack.namespace) has as many tasks running as replicas (global: one on every \
        eligible node; a job: its completions), and no update or rollback is in progress \
        (UpdateStatus updating or rollback_started), so N/N replicas in the middle of a rolling \
        update is not converged. A paused update or rollback is settled and reported. A running task \
        counts once it has been up for --stable (1 s; 5 s at least once a task of the service's current spec has \
        failed), so a task that starts and crashes is not counted. Polls \
        (services and tasks, nodes only for a global service: one list call each for the whole \
        stack) with full-jitter backoff; a line every 30 s names what is not converged (-v: every \
        change), a failed task is named with its error, one summary line ends the wait.",
    after_help = "Exit codes: 0 converged; 1 settled without converging (an update paused, \
        unless --allow-paused, or rolled back) or no such stack; 2 invalid input; 75 not \
        converged within --timeout, naming what was not; 125 Docker unreachable; 128+N signal N \
        ended the wait."
)]
pub(crate) struct ConvergeArgs {
    /// The run app whose stack to wait for, by its domain (<prefix>-<hash6>.<domain-suffix>).
    #[arg(long, value_name = "D")]
    pub domain: Option<String>,
    /// The stack to wait for, by name (any stack) [default: $CCCI_STACK_NAME, the run's own].
    #[arg(long, value_name = "S")]
    pub stack: Option<String>,
    /// The recipe of the run app whose stack to wait for, with --pr or --ref as for `run`.
    #[arg(long, value_name = "R")]
    pub recipe: Option<String>,
    /// Pull request number (with --recipe).
    #[arg(long, value_name = "N", requires = "recipe")]
    pub pr: Option<String>,
    /// Branch, tag or commit (with --recipe).
    #[arg(long = "ref", value_name = "REF", requires = "recipe")]
    pub git_ref: Option<String>,
    /// Give up after DURATION and name what has not converged (exit 75); it bounds every call
    /// to the engine too; 0 polls once, within 1 s. Unset anywhere, the recipe's own
    /// deploy label coop-cloud.<stack>.timeout (seconds, as abra reads it) bounds the wait
    /// [env: CCCI_CONVERGE_TIMEOUT; file: converge_timeout; default: the label, else 5m].
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, value_parser = converge_timeout)]
    pub timeout: Option<Duration>,
    /// A running task counts once it has been up this long (at least 5 s after a failure of
    /// its service); 0 counts it at once
    /// [env: CCCI_CONVERGE_STABLE; file: converge_stable; default: 1s].
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, value_parser = converge_stable)]
    pub stable: Option<Duration>,
    /// A paused update or rollback (swarm's default failure action) counts as settled: exit 0
    /// instead of 1; it is still reported.
    #[arg(long)]
    pub allow_paused: bool,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub global: GlobalArgs,
}

impl ConvergeArgs {
    /// The stack to wait for: named by --stack, derived from --domain or --recipe as `run`
    /// derives it, or the run's own (`CCCI_STACK_NAME`).
    pub(crate) fn validate(
        &self,
        global: &Global,
    ) -> Result<crate::converge::ConvergeConfig, NameError> {
        if global.docker == DockerMode::Off {
            return Err(NameError {
                what: "--docker / CCCI_DOCKER",
                value: "off".to_owned(),
                rule: "converge asks Docker about the stack: it cannot run with Docker off"
                    .to_owned(),
            });
        }
        let stack = if let Some(stack) = &self.stack {
            StackName::parse(stack)?.as_str().to_owned()
        } else if let Some(domain) = &self.domain {
            crate::names::AppDomain::recognise(domain, &global.pattern)
                .ok_or_else(|| NameError {
                    what: "app domain (--domain)",
                    value: domain.clone(),
                    rule: format!(
                        "not a run-app domain of the suffix {0} (<prefix>-<hash6>.{0}); name any \
                         other stack with --stack",
                        global.suffix
                    ),
                })?
                .stack_name()
        } else if let Some(recipe) = &self.recipe {
            Identity::validate(
                recipe,
                self.pr.as_deref(),
                self.git_ref.as_deref(),
                &global.suffix,
            )?
            .domain
            .stack_name()
        } else {
            match crate::config::env::var("CCCI_STACK_NAME") {
                Ok(stack) if !stack.is_empty() => StackName::parse(&stack)
                    .map_err(|e| NameError {
                        what: "CCCI_STACK_NAME",
                        ..e
                    })?
                    .as_str()
                    .to_owned(),
                _ => {
                    return Err(NameError {
                        what: "converge target",
                        value: String::new(),
                        rule: "no stack to wait for: give --stack, --domain or --recipe (inside \
                               `ccci-run run`, CCCI_STACK_NAME names the run's own)"
                            .to_owned(),
                    });
                }
            }
        };
        Ok(crate::converge::ConvergeConfig {
            stack,
            timeout: global.timings.value(Timing::ConvergeTimeout),
            timeout_from: match global.timings.origin(Timing::ConvergeTimeout) {
                Origin::Default => None,
                Origin::Flag => Some("--timeout".to_owned()),
                Origin::Environment(var) => Some(var.clone()),
                Origin::File(path) => Some(format!("converge_timeout in {}", path.display())),
            },
            stable: global.timings.value(Timing::ConvergeStable),
            allow_paused: self.allow_paused,
            json: self.json,
        })
    }
}
