//! Supervising a command: start it in its own process group, turn every way out into one
//! [`ShutdownReason`], stop the group (SIGTERM, SIGKILL after the grace), and clean up what it
//! left. Shared by `run` and `lock`.
//!
//! Invariant: when [`Supervisor::start_and_stop`] returns, no member of the command's process
//! group is left, and the first reason is the one reported; signals that arrive after it are
//! reported and ignored.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::unistd::Pid;

use crate::process::{self, ChildStatus, CommandSpec, ProcessGroup};
use crate::report;
use crate::shutdown::{Action, Escalation, Event, ShutdownReason};
use crate::signals::{Arrived, SignalFunnel};

/// How many kill-and-reap passes teardown makes over leftover descendants before giving up.
const DESCENDANT_KILL_ROUNDS: usize = 100;

/// How a supervised command ended.
#[derive(Debug, Clone)]
pub struct Stopped {
    pub reason: ShutdownReason,
    /// How the command itself ended, when it was started and reaped.
    pub command_status: Option<ChildStatus>,
    /// The group ignored its stop signal past the grace and was SIGKILLed.
    pub killed_after_grace: bool,
    /// What went wrong while stopping; never a reason to change the exit code.
    pub errors: Vec<String>,
}

pub struct Supervisor<'a> {
    pub funnel: &'a SignalFunnel,
    pub kill_grace: Duration,
    /// The hard deadline, for its teardown line.
    pub deadline: Duration,
    /// Pass SIGINT/SIGHUP on to the group as they came (`lock`); otherwise the group gets
    /// SIGTERM whatever the reason (`run`).
    pub forward_signals: bool,
}

impl Supervisor<'_> {
    /// Start `spec` (unless `early` already holds a way out) and return once its group is gone.
    /// `on_teardown` is called once, when teardown begins.
    pub fn start_and_stop(
        &self,
        spec: &CommandSpec,
        mut early: VecDeque<Event>,
        on_teardown: &mut dyn FnMut(ShutdownReason),
    ) -> Stopped {
        let mut leader = None;
        if early.is_empty() {
            match process::spawn_group(spec) {
                Ok(started) => {
                    tracing::info!(pid = started.0.as_raw(), "command started");
                    leader = Some(started);
                }
                Err(err) => {
                    report::line(&format!("ccci-run: {err}"));
                    early.push_back(Event::CommandEnded(err.status()));
                }
            }
        }
        self.stop_group(leader, early, on_teardown)
    }

    fn stop_group(
        &self,
        leader: Option<(Pid, ProcessGroup)>,
        mut events: VecDeque<Event>,
        on_teardown: &mut dyn FnMut(ShutdownReason),
    ) -> Stopped {
        let mut escalation = Escalation::new();
        let mut grace_until: Option<Instant> = None;
        let mut command_status = None;
        let mut errors = Vec::new();
        let group = leader.map(|(_, group)| group);
        loop {
            while let Some(event) = events.pop_front() {
                if let Event::CommandEnded(status) = event {
                    command_status = Some(status);
                }
                match escalation.handle(event) {
                    Action::BeginTeardown(reason) => {
                        match reason.teardown_line(self.deadline) {
                            Some(line) => report::line(&line),
                            None => tracing::info!(
                                code = reason.exit_code(),
                                "command ended; tearing down"
                            ),
                        }
                        on_teardown(reason);
                        if let Some(group) = group {
                            let stop = match reason {
                                ShutdownReason::Signal(signal) if self.forward_signals => group
                                    .signal(signal)
                                    .and_then(|()| group.signal(Signal::SIGCONT)),
                                _ => group.terminate(),
                            };
                            if let Err(err) = stop {
                                errors.push(format!("failed to signal process group: {err}"));
                            }
                        }
                        grace_until = Some(Instant::now() + self.kill_grace);
                    }
                    Action::Ignore(event) => report_ignored(event),
                    Action::KillGroup => {
                        report::line(&format!(
                            "== process group still alive after {} grace — sending SIGKILL ==",
                            humantime::format_duration(self.kill_grace)
                        ));
                        if let Some(Err(err)) = group.map(|g| g.signal(Signal::SIGKILL)) {
                            errors.push(format!("failed to kill process group: {err}"));
                        }
                    }
                    Action::GroupStopped | Action::None => {}
                }
            }
            if escalation.stopped() {
                return Stopped {
                    reason: escalation
                        .reason()
                        .expect("the group only stops after teardown began"),
                    command_status,
                    killed_after_grace: escalation.escalated(),
                    errors,
                };
            }
            if escalation.tearing_down() && group.is_none_or(ProcessGroup::is_empty) {
                events.push_back(Event::GroupEmpty);
                continue;
            }
            let timeout = grace_until.map(|t| t.saturating_duration_since(Instant::now()));
            events.extend(shutdown_events(&self.funnel.wait(timeout)));
            for (pid, status) in process::reap_ready() {
                if leader.is_some_and(|(leader, _)| leader == pid) {
                    events.push_back(Event::CommandEnded(status));
                }
            }
            if grace_until.is_some_and(|t| Instant::now() >= t) {
                grace_until = None;
                events.push_back(Event::GraceElapsed);
            }
        }
    }

    /// Run a teardown step (such as `--on-teardown`) to its end; signals meanwhile are reported
    /// and ignored.
    pub fn run_to_end(&self, spec: &CommandSpec) -> Result<ChildStatus, String> {
        let (pid, _) = process::spawn_group(spec).map_err(|e| e.to_string())?;
        loop {
            if let Some((_, status)) = process::reap_ready().into_iter().find(|(p, _)| *p == pid) {
                return Ok(status);
            }
            for event in shutdown_events(&self.funnel.wait(None)) {
                report_ignored(event);
            }
        }
    }

    /// SIGKILL and reap every descendant left, daemonised ones included. Returns an error when
    /// some survived (uninterruptible sleep).
    pub fn kill_leftover_descendants(&self) -> Result<(), String> {
        let survivors = process::kill_descendants(DESCENDANT_KILL_ROUNDS, || {
            for event in shutdown_events(&self.funnel.wait(Some(Duration::from_millis(20)))) {
                report_ignored(event);
            }
        });
        if survivors.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "descendants survived SIGKILL (uninterruptible?): {survivors:?}"
            ))
        }
    }
}

/// Turn caught signals into supervision events (SIGCHLD only wakes the loop up).
pub fn shutdown_events(arrived: &Arrived) -> impl Iterator<Item = Event> + '_ {
    arrived.iter().filter_map(|signal| match signal {
        Signal::SIGALRM => Some(Event::Deadline),
        Signal::SIGCHLD => None,
        other => Some(Event::Signal(other)),
    })
}

/// The line for a signal or deadline that arrived once teardown had begun.
pub fn report_ignored(event: Event) {
    match event {
        Event::Signal(signal) => {
            report::line(&format!(
                "== {signal} received during teardown — ignored =="
            ));
        }
        Event::Deadline => report::line("== hard deadline passed during teardown — ignored =="),
        _ => {}
    }
}
