//! `ccci-run converge`: wait until a deployed stack has converged, as swarm itself sees it, or
//! say exactly what has not.
//!
//! Each poll is one list call per kind for the whole stack ([`crate::docker::swarm`]); the
//! judgement is pure ([`judge`]); between polls the wait is the signal funnel's, with the
//! project's full-jitter backoff, so a signal ends it at once (also in the middle of a poll),
//! and `--timeout` bounds it. Invariant: the command returns 0 only after a poll in which every
//! service had what its mode asks for and no update or rollback was in progress.
//!
//! Floor: commands (docs/architecture.md): imports the floors below, never another command.

pub(crate) mod judge;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use nix::unistd::Pid;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use serde::Serialize;

use crate::converge::judge::{Outcome, ServiceReport, Standing};
use crate::docker::DockerSeam;
use crate::docker::backoff::{Backoff, MonotonicClock, Policy};
use crate::docker::swarm::Polled;
use crate::exit;
use crate::report;
use crate::supervise::shutdown::Event;
use crate::supervise::signals::{SignalFunnel, shutdown_events};

/// What `converge` was asked, validated.
#[derive(Debug, Clone)]
pub(crate) struct ConvergeConfig {
    pub stack: String,
    pub timeout: Duration,
    /// Where the timeout was given (`--timeout`, `CCCI_CONVERGE_TIMEOUT`, `converge_timeout in
    /// FILE`); `None` when it is the default, which the recipe's own label overrides.
    pub timeout_from: Option<String>,
    /// How long a running task must have been up to count ([`judge`]).
    pub stable: Duration,
    pub allow_paused: bool,
    pub json: bool,
}

/// How often a long wait says what it is waiting for.
const PROGRESS_EVERY: Duration = Duration::from_secs(30);

/// The least a `--timeout` gives the whole command: one look at the engine needs some time
/// (`--timeout 0` polls once, within this).
const ONE_LOOK: Duration = Duration::from_secs(1);

/// Why `converge` could not judge at all.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConvergeError {
    #[error(transparent)]
    Signals(#[from] crate::supervise::signals::InstallError),
    #[error("failed to read stack {stack} from Docker: {cause}")]
    Docker { stack: String, cause: String },
}

impl From<ConvergeError> for crate::error::Error {
    fn from(err: ConvergeError) -> Self {
        Self::command(err, crate::exit::INTERNAL)
    }
}

/// The report `--json` prints.
#[derive(Debug, Serialize)]
struct Report<'a> {
    stack: &'a str,
    converged: bool,
    /// converged, timed_out, paused, rolled_back, no_stack, interrupted.
    outcome: &'static str,
    services: &'a [ServiceReport],
    waited_s: f64,
    polls: u64,
    docker_calls: usize,
}

/// The deploy timeout a recipe declares on its services, as abra reads it: the label
/// `coop-cloud.<stack>.timeout`, in seconds (or a duration with units); the longest, when
/// several services carry it. A value that is no duration is said and ignored.
fn recipe_timeout(
    stack: &str,
    services: &[crate::docker::swarm::Service],
) -> Option<(Duration, String)> {
    let label = format!("coop-cloud.{stack}.timeout");
    let spec = crate::config::Timing::ConvergeTimeout.info().spec;
    services
        .iter()
        .filter_map(|s| s.labels.get(&label).map(|v| (s, v)))
        .filter_map(|(s, value)| match crate::duration::parse(value, &spec) {
            Ok(timeout) => Some(timeout),
            Err(why) => {
                report::line(&format!(
                    "ccci-run: warning: converge: service {}'s label {label}={value:?} is not a \
                     timeout ({why}); ignored",
                    crate::names::visible(&s.name)
                ));
                None
            }
        })
        .max()
        .map(|timeout| (timeout, label))
}

/// How the wait ended.
enum End {
    Judged(Outcome),
    TimedOut,
    Stopped(Event),
}

/// Run `ccci-run converge`; returns the exit code.
pub(crate) fn run(cfg: &ConvergeConfig, start_ppid: Pid) -> Result<u8, ConvergeError> {
    // Handlers first, so a signal while we connect is not lost.
    let funnel = SignalFunnel::install(start_ppid)?;
    let started = Instant::now();
    // The timeout bounds the whole command, every engine call included: a hung engine is
    // given no more than the timeout (or one look's time), never a fixed allowance of its own.
    let mut deadline = started + cfg.timeout.max(ONE_LOOK);
    let left = || deadline.saturating_duration_since(Instant::now());
    let fail = |cause: String| ConvergeError::Docker {
        stack: cfg.stack.clone(),
        cause,
    };
    let seam = DockerSeam::connect_within(left()).map_err(|e| fail(e.0))?;
    // A worker answers every stack call with "not a swarm manager": say so once, at once.
    seam.refuse_a_worker_within(left()).map_err(|e| fail(e.0))?;
    let mut watch = Watch::new(cfg, started);
    let rng = Xoshiro256PlusPlus::from_rng(&mut rand::rng());
    let mut backoff = Backoff::new(Policy::CONVERGE, rng, MonotonicClock);
    let mut last_error = None;
    let end = loop {
        match seam.stack_state(&cfg.stack, Some(funnel.wake_fd()), deadline) {
            Ok(Polled::Seen(state)) => {
                watch.polls += 1;
                last_error = None;
                // The recipe's own bound, where nobody gave one: abra honours it too.
                if watch.polls == 1 && cfg.timeout_from.is_none() {
                    if let Some((timeout, label)) = recipe_timeout(&cfg.stack, &state.services) {
                        deadline = started + timeout.max(ONE_LOOK);
                        watch.timeout = timeout;
                        watch.timeout_from = format!("the recipe's label {label}");
                        report::line(&format!(
                            "ccci-run converge: {}: waiting up to {} ({})",
                            cfg.stack,
                            crate::duration::show(timeout),
                            watch.timeout_from
                        ));
                    }
                }
                let reports = judge::judge(&state, std::time::SystemTime::now(), cfg.stable);
                let outcome = judge::outcome(&reports, cfg.allow_paused);
                watch.saw(reports);
                if outcome != Outcome::Waiting {
                    break End::Judged(outcome);
                }
            }
            Ok(Polled::Interrupted) => {}
            Ok(Polled::TimedOut) => break End::TimedOut,
            Err(err) if err.transient => {
                tracing::warn!(stack = %cfg.stack, "{err}; polling again");
                last_error = Some(err.message);
            }
            Err(err) => return Err(fail(err.message)),
        }
        if let Some(event) = shutdown_events(&funnel.pending()).next() {
            break End::Stopped(event);
        }
        let now = Instant::now();
        if now >= deadline || watch.timeout.is_zero() {
            break End::TimedOut;
        }
        let delay = backoff
            .next_delay()
            .unwrap_or(Policy::CONVERGE.cap)
            .min(deadline - now);
        if let Some(event) = shutdown_events(&funnel.wait(Some(delay))).next() {
            break End::Stopped(event);
        }
    };
    let waited = started.elapsed();
    let (code, outcome, summary) = watch.conclude(&end, waited, last_error.as_deref());
    // The last line: progress when converged, the error the command ends with otherwise.
    let said = format!(
        "{} {summary} ({} poll{}, {} Docker calls)",
        cfg.stack,
        watch.polls,
        if watch.polls == 1 { "" } else { "s" },
        seam.list_calls()
    );
    report::line(&format!(
        "{} {said}",
        if code == 0 {
            "ccci-run converge:"
        } else {
            "ccci-run: error: converge:"
        },
    ));
    if cfg.json {
        let report = Report {
            stack: &cfg.stack,
            converged: code == 0,
            outcome,
            services: &watch.reports,
            waited_s: (waited.as_secs_f64() * 1000.0).round() / 1000.0,
            polls: watch.polls,
            docker_calls: seam.list_calls(),
        };
        let text = serde_json::to_string_pretty(&crate::report::Envelope::new(
            &report,
            if code == 0 {
                Vec::new()
            } else {
                vec![format!("converge: {said}")]
            },
        ))
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
        // A closed or full stdout loses the report, never the exit code.
        let _ = crate::report::stdout(format!("{text}\n").as_bytes());
    }
    Ok(code)
}

/// What the wait has seen so far, and the lines it has said.
struct Watch<'a> {
    cfg: &'a ConvergeConfig,
    /// The bound in force, and where it came from.
    timeout: Duration,
    timeout_from: String,
    started: Instant,
    polls: u64,
    reports: Vec<ServiceReport>,
    /// Every change is a line at `-v`; otherwise one every [`PROGRESS_EVERY`].
    every_change: bool,
    last_line: String,
    next_progress: Instant,
    failures_told: HashSet<String>,
}

impl<'a> Watch<'a> {
    fn new(cfg: &'a ConvergeConfig, started: Instant) -> Self {
        Self {
            cfg,
            timeout: cfg.timeout,
            timeout_from: cfg
                .timeout_from
                .clone()
                .unwrap_or_else(|| "the default".to_owned()),
            started,
            polls: 0,
            reports: Vec::new(),
            every_change: tracing::enabled!(tracing::Level::INFO),
            last_line: String::new(),
            next_progress: started + PROGRESS_EVERY,
            failures_told: HashSet::new(),
        }
    }

    /// One poll's judgement: a line for each newly failed task, and the waiting line when due.
    fn saw(&mut self, reports: Vec<ServiceReport>) {
        for (id, line) in reports.iter().flat_map(|r| &r.failures) {
            if self.failures_told.insert(id.clone()) {
                report::line(&format!("ccci-run converge: {line}"));
            }
        }
        self.reports = reports;
        let line = judge::describe(&self.reports, &self.cfg.stack);
        let now = Instant::now();
        let changed = line != self.last_line;
        if !line.is_empty() && (now >= self.next_progress || self.every_change && changed) {
            report::line(&format!(
                "ccci-run converge: {} not converged after {} s: {line}",
                self.cfg.stack,
                now.duration_since(self.started).as_secs()
            ));
            while self.next_progress <= now {
                self.next_progress += PROGRESS_EVERY;
            }
        }
        self.last_line = line;
    }

    /// The exit code, the outcome's name and the summary line of how the wait ended.
    fn conclude(
        &self,
        end: &End,
        waited: Duration,
        last_error: Option<&str>,
    ) -> (u8, &'static str, String) {
        let secs = format!("{:.1} s", waited.as_secs_f64());
        let what = judge::describe(&self.reports, &self.cfg.stack);
        let settled = |label: &str| {
            let paused: Vec<&str> = self
                .reports
                .iter()
                .filter(|r| matches!(r.standing, Standing::Paused | Standing::RolledBack))
                .map(|r| r.name.as_str())
                .collect();
            if paused.is_empty() {
                String::new()
            } else {
                format!("; {label}: {what}")
            }
        };
        match end {
            End::Judged(Outcome::Converged) => (
                0,
                "converged",
                format!(
                    "converged after {secs}: {} service{}{}",
                    self.reports.len(),
                    if self.reports.len() == 1 { "" } else { "s" },
                    settled("settled, allowed by --allow-paused")
                ),
            ),
            End::Judged(Outcome::Paused) => (
                exit::FAILURE,
                "paused",
                format!("settled after {secs} but not converged: {what}"),
            ),
            End::Judged(Outcome::Failed) => (
                exit::FAILURE,
                "rolled_back",
                format!("settled after {secs} but not converged: {what}"),
            ),
            End::Judged(Outcome::NoStack) => (
                exit::FAILURE,
                "no_stack",
                format!(
                    "has no services (no service carries the label {}={}): no such stack",
                    crate::docker::STACK_LABEL,
                    self.cfg.stack
                ),
            ),
            End::Judged(Outcome::Waiting) | End::TimedOut => {
                let why = match (self.polls, last_error) {
                    (_, Some(err)) => format!("the last poll failed: {err}"),
                    (0, None) => "Docker did not answer in time".to_owned(),
                    (_, None) => what,
                };
                (
                    exit::CONVERGE_TIMEOUT,
                    "timed_out",
                    format!(
                        "not converged within {} ({}): {why}",
                        crate::duration::show(self.timeout),
                        self.timeout_from
                    ),
                )
            }
            End::Stopped(event) => {
                let (code, name) = match event {
                    Event::Signal(signal) => (exit::for_signal(*signal), signal.as_str()),
                    Event::Deadline => (exit::DEADLINE, "SIGALRM"),
                    _ => (
                        exit::for_signal(nix::sys::signal::Signal::SIGTERM),
                        "the death of its parent",
                    ),
                };
                (
                    code,
                    "interrupted",
                    format!("wait ended by {name} after {secs}, not converged"),
                )
            }
        }
    }
}
