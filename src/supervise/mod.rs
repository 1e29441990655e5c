//! The supervisor's mechanics, shared by `run` and `lock`: the lifetime guards, the signal
//! funnel, the escalation from a way out to a stopped process group, process groups and cgroups,
//! helper threads that can be walked away from, and the Linux primitives under them.
//!
//! This folder owns every process the supervisor starts and every signal it catches. It must
//! never know about apps, locks or Docker: callers hand it a command and a budget, it hands back
//! how the command ended.
//!
//! Start a command in its own process group, turn every way out into one [`ShutdownReason`],
//! stop the group (SIGTERM, SIGKILL after the grace), and clean up what it left.
//!
//! Invariant: when [`Supervisor::start_and_stop`] returns, no member of the command's process
//! group is left, and the first reason is the one reported; signals that arrive after it are
//! reported and ignored.
//!
//! Floor: mechanisms (docs/architecture.md): imports the ground and the mechanisms, nothing above.

pub(crate) mod cgroup;
pub(crate) mod fence;
pub(crate) mod fence_life;
pub(crate) mod guards;
pub(crate) mod identity;
pub(crate) mod ignored;
pub(crate) mod leftovers;
#[cfg(target_os = "linux")]
pub(crate) mod linux;
#[cfg(target_os = "linux")]
pub(crate) mod mark;
pub(crate) mod process;
pub(crate) mod procfs;
pub(crate) mod shutdown;
pub(crate) mod signals;
pub(crate) mod threads;
pub(crate) mod vfork;
pub(crate) mod watchdog;
pub(crate) mod worker;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::unistd::Pid;

use self::cgroup::Leaf;
use self::ignored::report_ignored;
use self::process::{CommandSpec, ProcessGroup};
use self::shutdown::ChildStatus;
use crate::report;
use crate::supervise::shutdown::{Action, Escalation, Event, ShutdownReason};
use crate::supervise::signals::{SignalFunnel, shutdown_events};

/// How many kill-and-reap passes teardown makes over leftover descendants before giving up.
const DESCENDANT_KILL_ROUNDS: usize = 100;

/// Where stopping a command's group stands.
struct Stopping {
    escalation: Escalation,
    group: Option<ProcessGroup>,
    /// When the kill grace after the stop signal runs out.
    grace_until: Option<Instant>,
    /// When the teardown budget runs out.
    budget_until: Option<Instant>,
    command_status: Option<ChildStatus>,
    /// The group's leader has been reaped: its id may be reused from now on.
    leader_reaped: bool,
    errors: Vec<String>,
}

/// How a supervised command ended.
#[derive(Debug, Clone)]
pub(crate) struct Stopped {
    pub reason: ShutdownReason,
    /// How the command itself ended, when it was started and reaped.
    pub command_status: Option<ChildStatus>,
    /// The group ignored its stop signal past the grace and was SIGKILLed.
    pub killed_after_grace: bool,
    /// What went wrong while stopping; never a reason to change the exit code.
    pub errors: Vec<String>,
    /// When the whole teardown must be over: the kill grace plus the teardown budget after
    /// teardown began (never later than `hard_end`).
    pub teardown_until: Instant,
}

pub(crate) struct Supervisor<'a> {
    pub funnel: &'a SignalFunnel,
    pub kill_grace: Duration,
    /// The hard deadline, for its teardown line.
    pub deadline: Duration,
    /// Pass SIGINT/SIGHUP on to the group as they came (`lock`); otherwise the group gets
    /// SIGTERM whatever the reason (`run`).
    pub forward_signals: bool,
    /// The teardown budget (`--teardown-timeout`), counted after the kill grace.
    pub teardown_timeout: Duration,
    /// No teardown may run past this instant, whenever it began (the whole-run bound).
    pub hard_end: Option<Instant>,
    /// The cgroup leaf the command runs in, when cgroups are in use.
    pub leaf: Option<&'a Leaf>,
    /// The run's fence, while it holds a lock that can lapse: told of every process group
    /// started, for a host without cgroups.
    pub fence: Option<&'a fence::Fence>,
}

impl Supervisor<'_> {
    /// Start `spec` (unless `early` already holds a way out) and return once its group is gone.
    /// `on_started` is called once the start was tried (what may wait until the command runs),
    /// `on_teardown` once, when teardown begins.
    pub(crate) fn start_and_stop(
        &self,
        spec: &CommandSpec,
        mut early: VecDeque<Event>,
        on_started: &mut dyn FnMut(),
        on_teardown: &mut dyn FnMut(ShutdownReason),
    ) -> Stopped {
        let mut leader = None;
        if early.is_empty() {
            match self.spawn_retrying(spec, &mut early) {
                Some(Ok(started)) => {
                    tracing::info!(pid = started.0.as_raw(), "command started");
                    if let Some(fence) = self.fence {
                        fence.watch_group(started.1.id());
                    }
                    leader = Some(started);
                }
                Some(Err(err)) => {
                    report::line(&format!("ccci-run: error: {err}"));
                    early.push_back(Event::CommandEnded(err.status()));
                }
                // A way out came while waiting to retry: it is in `early`.
                None => {}
            }
        }
        on_started();
        self.stop_group(leader, early, on_teardown)
    }

    /// Start `spec`; a failure of the host (out of processes, memory or descriptors) is tried
    /// again with backoff for up to [`SPAWN_RETRY_BUDGET`], then given up on (125, naming the
    /// limit). `None` when a way out arrived meanwhile (pushed to `early`).
    fn spawn_retrying(
        &self,
        spec: &CommandSpec,
        early: &mut VecDeque<Event>,
    ) -> Option<Result<(Pid, ProcessGroup), process::SpawnError>> {
        let give_up = Instant::now() + SPAWN_RETRY_BUDGET;
        let mut delay = Duration::from_millis(10);
        let mut tries = 0u32;
        loop {
            tries += 1;
            let err = match process::spawn_group(spec, self.leaf) {
                Err(err) if err.transient() => err,
                other => return Some(other),
            };
            let left = give_up.saturating_duration_since(Instant::now());
            if left.is_zero() {
                report::line(&format!(
                    "ccci-run: error: failed to start the command after {tries} tries in {}: {} — a \
                     limit on {} was reached",
                    crate::duration::show(SPAWN_RETRY_BUDGET),
                    err.source,
                    err.limit_hint()
                ));
                return Some(Err(err));
            }
            if tries == 1 {
                report::line(&format!(
                    "== could not start the command ({}): retrying for up to {} ==",
                    err.source,
                    crate::duration::show(SPAWN_RETRY_BUDGET)
                ));
            }
            let arrived = self.funnel.wait(Some(delay.min(left)));
            let ways_out: Vec<Event> = shutdown_events(&arrived).collect();
            if !ways_out.is_empty() {
                early.extend(ways_out);
                return None;
            }
            delay = (delay * 2).min(Duration::from_millis(500));
        }
    }

    fn stop_group(
        &self,
        leader: Option<(Pid, ProcessGroup)>,
        mut events: VecDeque<Event>,
        on_teardown: &mut dyn FnMut(ShutdownReason),
    ) -> Stopped {
        let mut stop = Stopping {
            escalation: Escalation::new(),
            group: leader.map(|(_, group)| group),
            grace_until: None,
            budget_until: None,
            command_status: None,
            leader_reaped: leader.is_none(),
            errors: Vec::new(),
        };
        loop {
            while let Some(event) = events.pop_front() {
                if let Event::CommandEnded(status) = event {
                    stop.command_status = Some(status);
                }
                let action = stop.escalation.handle(event);
                self.act(action, &mut stop, on_teardown);
            }
            if stop.escalation.stopped() {
                return self.stopped(stop);
            }
            let reaped = stop.leader_reaped;
            if stop.escalation.tearing_down() && stop.group.is_none_or(|g| g.is_empty(reaped)) {
                events.push_back(Event::GroupEmpty);
                continue;
            }
            events.extend(self.next_events(leader, &mut stop));
        }
    }

    /// Carry out what the escalation says.
    fn act(
        &self,
        action: Action,
        stop: &mut Stopping,
        on_teardown: &mut dyn FnMut(ShutdownReason),
    ) {
        let group = stop.group;
        let reaped = stop.leader_reaped;
        match action {
            Action::BeginTeardown(reason) => {
                match reason.teardown_line(self.deadline) {
                    Some(line) => report::line(&line),
                    None => {
                        tracing::info!(code = reason.exit_code(), "command ended; tearing down")
                    }
                }
                on_teardown(reason);
                if let Some(group) = group {
                    let signalled = match reason {
                        ShutdownReason::Signal(signal) if self.forward_signals => {
                            group.signal_each(&[signal, Signal::SIGCONT], reaped)
                        }
                        _ => group.terminate(reaped),
                    };
                    match signalled {
                        // No member was left to signal: the group is gone for good, and there
                        // is nothing to look for again.
                        Ok(false) => stop.group = None,
                        Ok(true) => {}
                        Err(err) => stop
                            .errors
                            .push(format!("failed to signal process group: {err}")),
                    }
                }
                let now = Instant::now();
                stop.grace_until = Some(now + self.kill_grace);
                stop.budget_until = Some(self.teardown_end(now));
            }
            Action::Ignore(event) => report_ignored(event),
            Action::KillGroup => {
                report::line(&format!(
                    "== process group still alive after {} grace — sending SIGKILL ==",
                    humantime::format_duration(self.kill_grace)
                ));
                if let Some(Err(err)) = group.map(|g| g.signal(Signal::SIGKILL, reaped)) {
                    stop.errors
                        .push(format!("failed to kill process group: {err}"));
                }
            }
            Action::GiveUp => stop.errors.push(format!(
                "process group {} still not empty when the teardown budget ran out \
                 (uninterruptible?)",
                group.map_or(0, |g| g.id().as_raw())
            )),
            Action::GroupStopped | Action::None => {}
        }
    }

    /// Wait for what happens next: a signal, the leader's exit, the grace or the budget
    /// running out.
    fn next_events(&self, leader: Option<(Pid, ProcessGroup)>, stop: &mut Stopping) -> Vec<Event> {
        let next = match (stop.grace_until, stop.budget_until) {
            (Some(g), Some(b)) => Some(g.min(b)),
            (g, b) => g.or(b),
        };
        let timeout = next.map(|t| t.saturating_duration_since(Instant::now()));
        let mut events: Vec<Event> = shutdown_events(&self.funnel.wait(timeout)).collect();
        let reaped = process::reap_ready();
        if !reaped.is_empty() {
            // A signal that arrived before the exit was seen (the supervisor may have been off
            // the CPU between the two) came first, and goes first: a stop request is never lost
            // to a command that ended in the same instant.
            events.extend(shutdown_events(&self.funnel.pending()));
        }
        for (pid, status) in reaped {
            if leader.is_some_and(|(leader, _)| leader == pid) {
                stop.leader_reaped = true;
                // Killed when the fence's deadline had come (a whole host frozen, then thawed):
                // the fence killed it, because the lock may have lapsed. That is a lost lock,
                // and the run ends as one, not as a command killed by a signal.
                if status == ChildStatus::Signaled(Signal::SIGKILL as i32)
                    && !stop.escalation.tearing_down()
                    && self.fence.is_some_and(fence::Fence::fired)
                {
                    events.push(Event::LockLost);
                }
                events.push(Event::CommandEnded(status));
            }
        }
        if stop.grace_until.is_some_and(|t| Instant::now() >= t) {
            stop.grace_until = None;
            events.push(Event::GraceElapsed);
        }
        if stop.budget_until.is_some_and(|t| Instant::now() >= t) {
            events.push(Event::BudgetElapsed);
        }
        events
    }

    /// How the stop ended, once the escalation says the group is stopped.
    fn stopped(&self, stop: Stopping) -> Stopped {
        Stopped {
            reason: stop
                .escalation
                .reason()
                .expect("the group only stops after teardown began"),
            command_status: stop.command_status,
            killed_after_grace: stop.escalation.escalated(),
            errors: stop.errors,
            teardown_until: stop
                .budget_until
                .unwrap_or_else(|| self.teardown_end(Instant::now())),
        }
    }

    /// When a teardown that begins at `began` must be over.
    fn teardown_end(&self, began: Instant) -> Instant {
        let end = began + self.kill_grace + self.teardown_timeout;
        self.hard_end.map_or(end, |hard| end.min(hard))
    }

    /// Run a teardown step (such as `--on-teardown`) in a process group (and cgroup leaf) of its
    /// own until it ends or `until` passes; then the group and the leaf are killed. Signals
    /// meanwhile are reported and ignored: they can never extend it.
    pub(crate) fn run_within(
        &self,
        spec: &CommandSpec,
        leaf: Option<&Leaf>,
        until: Instant,
    ) -> Result<ChildStatus, String> {
        let (pid, group) = process::spawn_group(spec, leaf).map_err(|e| e.to_string())?;
        if let Some(fence) = self.fence {
            fence.watch_group(group.id());
        }
        loop {
            if let Some((_, status)) = process::reap_ready().into_iter().find(|(p, _)| *p == pid) {
                return Ok(status);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                // Not reaped yet: `reap_ready` above would have returned it.
                let _ = group.signal(Signal::SIGKILL, false);
                if let Some(leaf) = leaf {
                    let _ = leaf.kill_and_wait(Duration::from_secs(1));
                }
                let _ = process::reap_ready();
                return Err(
                    "killed: it did not finish within its share of the teardown budget".to_owned(),
                );
            }
            for event in shutdown_events(&self.funnel.wait(Some(left))) {
                report_ignored(event);
            }
        }
    }

    /// SIGKILL and reap every descendant left, daemonised ones included (and everything in the
    /// cgroup leaf, when there is one), until `until`. Returns an error when some survived.
    pub(crate) fn kill_leftovers(&self, leaf: Option<&Leaf>, until: Instant) -> Result<(), String> {
        let mut problems = Vec::new();
        if let Some(leaf) = leaf {
            let left = until.saturating_duration_since(Instant::now());
            match leaf.kill_and_wait(left) {
                Ok(true) => {}
                Ok(false) => problems.push(format!(
                    "cgroup {} still has processes after SIGKILL (uninterruptible?)",
                    leaf.path().display()
                )),
                Err(err) => problems.push(err.to_string()),
            }
        }
        let survivors = process::kill_descendants(DESCENDANT_KILL_ROUNDS, || {
            let left = until.saturating_duration_since(Instant::now());
            for event in
                shutdown_events(&self.funnel.wait(Some(left.min(Duration::from_millis(20)))))
            {
                report_ignored(event);
            }
            !left.is_zero()
        });
        if !survivors.is_empty() {
            problems.push(format!(
                "descendants survived SIGKILL (uninterruptible?): {survivors:?}"
            ));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }
}

/// How long a command that cannot be started for want of processes, memory or descriptors is
/// tried again before the run gives up (125).
pub(crate) const SPAWN_RETRY_BUDGET: Duration = Duration::from_secs(5);
