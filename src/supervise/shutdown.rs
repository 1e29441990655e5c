//! One way out. Every way a run can end — the command finishing, SIGTERM/SIGINT/SIGHUP/SIGQUIT,
//! the parent dying, the `--tie-to` process exiting, the hard deadline — becomes
//! one [`ShutdownReason`], and the group's stop is driven by the small pure state machine
//! [`Escalation`]: polite SIGTERM first, SIGKILL once the grace runs out.
//!
//! Invariant: the first reason wins. Signals and deadlines that arrive once teardown has begun
//! are reported and ignored, so a second signal can never cut short the cleanup the first asked for.

use std::fmt;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::exit;

/// Who asked for a run to stop (`ccci-run stop`): its real uid and its pid, each as the
/// requester saw itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Requester {
    pub uid: u32,
    pub pid: i32,
}

/// How a child ended, in the terms the run's exit code is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "value")]
pub(crate) enum ChildStatus {
    /// It exited with this code.
    Exited(i32),
    /// A signal with this number killed it.
    Signaled(i32),
    /// It could not be started: 126 (not executable), 127 (not found), or 125 when this host
    /// could not start any process (a limit on processes, memory or descriptors).
    NotStarted(u8),
}

impl ChildStatus {
    /// The shell's convention: the code, 128+N for signal N, 126/127 when it never ran.
    pub(crate) fn exit_code(self) -> u8 {
        match self {
            Self::Exited(code) => (code & 0xff) as u8,
            Self::Signaled(n) => exit::SIGNAL_BASE.saturating_add(n as u8),
            Self::NotStarted(code) => code,
        }
    }
}

/// Why the run is ending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ShutdownReason {
    /// The command ended (or could not start) by itself.
    CommandEnded(ChildStatus),
    /// SIGTERM, SIGINT or SIGHUP reached ccci-run.
    Signal(Signal),
    /// The hard deadline fired.
    Deadline,
    /// Our parent died (the parent-death signal arrived and we were re-parented).
    ParentDied,
    /// A `--tie-to` process exited: this one.
    TiedPidDied(i32),
    /// A held lock was lost behind our back.
    LockLost,
    /// `ccci-run stop` asked for it (a SIGTERM from the requester it named).
    Stopped(Requester),
}

impl ShutdownReason {
    /// The run's exit code: the command's own status, or the code of the signal or deadline.
    pub(crate) fn exit_code(self) -> u8 {
        match self {
            Self::CommandEnded(status) => status.exit_code(),
            Self::Signal(signal) => exit::for_signal(signal),
            Self::Deadline => exit::DEADLINE,
            // Both are the step going away: the same code as the SIGTERM that used to bring
            // the news.
            Self::ParentDied | Self::TiedPidDied(_) => exit::for_signal(Signal::SIGTERM),
            Self::LockLost => exit::LOCK_LOST,
            // A SIGTERM with a name attached: the code a SIGTERM has always given.
            Self::Stopped(_) => exit::for_signal(Signal::SIGTERM),
        }
    }

    /// The stable name recorded in `run.json`.
    pub(crate) fn name(self) -> String {
        match self {
            Self::CommandEnded(_) => "command-ended".to_owned(),
            Self::Signal(signal) => signal.as_str().to_owned(),
            Self::Deadline => "deadline".to_owned(),
            Self::ParentDied => "parent-died".to_owned(),
            Self::TiedPidDied(_) => "tied-pid-died".to_owned(),
            Self::LockLost => "lock-lost".to_owned(),
            Self::Stopped(_) => "stopped".to_owned(),
        }
    }

    /// The operator-facing teardown line, if this reason has one.
    pub(crate) fn teardown_line(self, deadline: Duration) -> Option<String> {
        match self {
            Self::CommandEnded(_) => None,
            Self::Signal(signal) => Some(format!("== {signal} received — tearing down ==")),
            Self::Deadline => Some(format!(
                "== run exceeded {} hard deadline — tearing down ==",
                humantime::format_duration(deadline)
            )),
            Self::ParentDied => Some("== parent process died — tearing down ==".to_owned()),
            Self::TiedPidDied(pid) => Some(format!(
                "== tied process {pid} exited (--tie-to) — tearing down =="
            )),
            Self::LockLost => Some("== the lock was lost while held — tearing down ==".to_owned()),
            Self::Stopped(by) => Some(format!(
                "== stopped by ccci-run stop (uid {}, pid {}) — tearing down ==",
                by.uid, by.pid
            )),
        }
    }
}

impl fmt::Display for ShutdownReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// What the supervisor observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// SIGTERM, SIGINT or SIGHUP.
    Signal(Signal),
    /// SIGALRM: the hard deadline.
    Deadline,
    /// The parent died.
    ParentDied,
    /// A `--tie-to` process exited: this one.
    TiedPidDied(i32),
    /// A held lock was lost (its lease expired or was revoked, its record deleted or replaced).
    LockLost,
    /// `ccci-run stop` asked (its SIGTERM, with its request in the run directory).
    Stopped(Requester),
    /// The command (the group leader) was reaped.
    CommandEnded(ChildStatus),
    /// The kill grace after SIGTERM ran out.
    GraceElapsed,
    /// No member of the command's process group is left.
    GroupEmpty,
    /// The teardown budget ran out while the group was still being stopped.
    BudgetElapsed,
}

/// What the supervisor must do about an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Action {
    /// Nothing to do.
    None,
    /// Teardown starts: report the reason, SIGTERM the group, start the kill grace.
    BeginTeardown(ShutdownReason),
    /// Teardown is under way: report that this event was ignored.
    Ignore(Event),
    /// The grace ran out: SIGKILL the group.
    KillGroup,
    /// The group is gone: go on with the rest of the teardown.
    GroupStopped,
    /// The teardown budget ran out with members still there (unkillable): stop waiting.
    GiveUp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Running,
    Terminating,
    Killing,
    Stopped,
}

/// The escalation from "running" to "group gone".
#[derive(Debug, Clone)]
pub(crate) struct Escalation {
    state: State,
    reason: Option<ShutdownReason>,
    killed: bool,
}

impl Default for Escalation {
    fn default() -> Self {
        Self::new()
    }
}

impl Escalation {
    pub(crate) fn new() -> Self {
        Self {
            state: State::Running,
            reason: None,
            killed: false,
        }
    }

    /// The reason teardown began for, once it has.
    pub(crate) fn reason(&self) -> Option<ShutdownReason> {
        self.reason
    }

    /// True once teardown has begun.
    pub(crate) fn tearing_down(&self) -> bool {
        self.state != State::Running
    }

    /// True once the group has been stopped.
    pub(crate) fn stopped(&self) -> bool {
        self.state == State::Stopped
    }

    /// True when the group needed SIGKILL.
    pub(crate) fn escalated(&self) -> bool {
        self.killed
    }

    pub(crate) fn handle(&mut self, event: Event) -> Action {
        match (self.state, event) {
            (State::Running, Event::Signal(signal)) => self.begin(ShutdownReason::Signal(signal)),
            (State::Running, Event::Deadline) => self.begin(ShutdownReason::Deadline),
            (State::Running, Event::ParentDied) => self.begin(ShutdownReason::ParentDied),
            (State::Running, Event::TiedPidDied(pid)) => {
                self.begin(ShutdownReason::TiedPidDied(pid))
            }
            (State::Running, Event::LockLost) => self.begin(ShutdownReason::LockLost),
            (State::Running, Event::Stopped(by)) => self.begin(ShutdownReason::Stopped(by)),
            (State::Running, Event::CommandEnded(status)) => {
                self.begin(ShutdownReason::CommandEnded(status))
            }
            // Without a teardown under way there is no grace and nothing to conclude.
            (State::Running, Event::GraceElapsed | Event::GroupEmpty | Event::BudgetElapsed) => {
                Action::None
            }

            (
                _,
                Event::Signal(_)
                | Event::Deadline
                | Event::ParentDied
                | Event::TiedPidDied(_)
                | Event::LockLost
                | Event::Stopped(_),
            ) => Action::Ignore(event),
            // Ending during teardown is what we asked for; the reason stays the first one.
            (_, Event::CommandEnded(_)) => Action::None,
            (State::Terminating, Event::GraceElapsed) => {
                self.state = State::Killing;
                self.killed = true;
                Action::KillGroup
            }
            (State::Terminating | State::Killing, Event::GroupEmpty) => {
                self.state = State::Stopped;
                Action::GroupStopped
            }
            (State::Killing | State::Stopped, Event::GraceElapsed) => Action::None,
            (State::Stopped, Event::GroupEmpty | Event::BudgetElapsed) => Action::None,
            (State::Terminating | State::Killing, Event::BudgetElapsed) => {
                self.state = State::Stopped;
                Action::GiveUp
            }
        }
    }

    fn begin(&mut self, reason: ShutdownReason) -> Action {
        self.state = State::Terminating;
        self.reason = Some(reason);
        Action::BeginTeardown(reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    const TERM: Event = Event::Signal(Signal::SIGTERM);
    const INT: Event = Event::Signal(Signal::SIGINT);
    const ENDED: Event = Event::CommandEnded(ChildStatus::Exited(3));
    const BY: Requester = Requester { uid: 1000, pid: 77 };
    const STOP: Event = Event::Stopped(BY);

    /// An escalation driven into `state` by the only path that reaches it.
    fn in_state(state: State) -> Escalation {
        let mut e = Escalation::new();
        let path: &[Event] = match state {
            State::Running => &[],
            State::Terminating => &[TERM],
            State::Killing => &[TERM, Event::GraceElapsed],
            State::Stopped => &[TERM, Event::GroupEmpty],
        };
        for event in path {
            e.handle(*event);
        }
        assert_eq!(e.state, state);
        e
    }

    #[rstest]
    #[case::run_term(
        State::Running,
        TERM,
        Action::BeginTeardown(ShutdownReason::Signal(Signal::SIGTERM)),
        State::Terminating
    )]
    #[case::run_int(
        State::Running,
        INT,
        Action::BeginTeardown(ShutdownReason::Signal(Signal::SIGINT)),
        State::Terminating
    )]
    #[case::run_deadline(
        State::Running,
        Event::Deadline,
        Action::BeginTeardown(ShutdownReason::Deadline),
        State::Terminating
    )]
    #[case::run_ended(
        State::Running,
        ENDED,
        Action::BeginTeardown(ShutdownReason::CommandEnded(ChildStatus::Exited(3))),
        State::Terminating
    )]
    #[case::run_grace(State::Running, Event::GraceElapsed, Action::None, State::Running)]
    #[case::run_empty(State::Running, Event::GroupEmpty, Action::None, State::Running)]
    #[case::run_budget(State::Running, Event::BudgetElapsed, Action::None, State::Running)]
    #[case::run_parent(
        State::Running,
        Event::ParentDied,
        Action::BeginTeardown(ShutdownReason::ParentDied),
        State::Terminating
    )]
    #[case::run_tied(
        State::Running,
        Event::TiedPidDied(4242),
        Action::BeginTeardown(ShutdownReason::TiedPidDied(4242)),
        State::Terminating
    )]
    #[case::run_lock_lost(
        State::Running,
        Event::LockLost,
        Action::BeginTeardown(ShutdownReason::LockLost),
        State::Terminating
    )]
    #[case::run_stopped(
        State::Running,
        STOP,
        Action::BeginTeardown(ShutdownReason::Stopped(BY)),
        State::Terminating
    )]
    #[case::term_stopped(State::Terminating, STOP, Action::Ignore(STOP), State::Terminating)]
    #[case::kill_stopped(State::Killing, STOP, Action::Ignore(STOP), State::Killing)]
    #[case::stopped_stopped(State::Stopped, STOP, Action::Ignore(STOP), State::Stopped)]
    #[case::term_lock_lost(
        State::Terminating,
        Event::LockLost,
        Action::Ignore(Event::LockLost),
        State::Terminating
    )]
    #[case::kill_lock_lost(
        State::Killing,
        Event::LockLost,
        Action::Ignore(Event::LockLost),
        State::Killing
    )]
    #[case::stopped_lock_lost(
        State::Stopped,
        Event::LockLost,
        Action::Ignore(Event::LockLost),
        State::Stopped
    )]
    #[case::term_parent(
        State::Terminating,
        Event::ParentDied,
        Action::Ignore(Event::ParentDied),
        State::Terminating
    )]
    #[case::term_budget(
        State::Terminating,
        Event::BudgetElapsed,
        Action::GiveUp,
        State::Stopped
    )]
    #[case::kill_tied(
        State::Killing,
        Event::TiedPidDied(4242),
        Action::Ignore(Event::TiedPidDied(4242)),
        State::Killing
    )]
    #[case::kill_budget(State::Killing, Event::BudgetElapsed, Action::GiveUp, State::Stopped)]
    #[case::stopped_budget(State::Stopped, Event::BudgetElapsed, Action::None, State::Stopped)]
    #[case::stopped_parent(
        State::Stopped,
        Event::ParentDied,
        Action::Ignore(Event::ParentDied),
        State::Stopped
    )]
    #[case::term_term(State::Terminating, TERM, Action::Ignore(TERM), State::Terminating)]
    #[case::term_int(State::Terminating, INT, Action::Ignore(INT), State::Terminating)]
    #[case::term_deadline(
        State::Terminating,
        Event::Deadline,
        Action::Ignore(Event::Deadline),
        State::Terminating
    )]
    #[case::term_ended(State::Terminating, ENDED, Action::None, State::Terminating)]
    #[case::term_grace(
        State::Terminating,
        Event::GraceElapsed,
        Action::KillGroup,
        State::Killing
    )]
    #[case::term_empty(
        State::Terminating,
        Event::GroupEmpty,
        Action::GroupStopped,
        State::Stopped
    )]
    #[case::kill_term(State::Killing, TERM, Action::Ignore(TERM), State::Killing)]
    #[case::kill_deadline(
        State::Killing,
        Event::Deadline,
        Action::Ignore(Event::Deadline),
        State::Killing
    )]
    #[case::kill_ended(State::Killing, ENDED, Action::None, State::Killing)]
    #[case::kill_grace(State::Killing, Event::GraceElapsed, Action::None, State::Killing)]
    #[case::kill_empty(
        State::Killing,
        Event::GroupEmpty,
        Action::GroupStopped,
        State::Stopped
    )]
    #[case::stopped_term(State::Stopped, TERM, Action::Ignore(TERM), State::Stopped)]
    #[case::stopped_deadline(
        State::Stopped,
        Event::Deadline,
        Action::Ignore(Event::Deadline),
        State::Stopped
    )]
    #[case::stopped_ended(State::Stopped, ENDED, Action::None, State::Stopped)]
    #[case::stopped_grace(State::Stopped, Event::GraceElapsed, Action::None, State::Stopped)]
    #[case::stopped_empty(State::Stopped, Event::GroupEmpty, Action::None, State::Stopped)]
    fn every_state_and_event(
        #[case] from: State,
        #[case] event: Event,
        #[case] action: Action,
        #[case] to: State,
    ) {
        let mut e = in_state(from);
        let before = e.reason();
        assert_eq!(e.handle(event), action);
        assert_eq!(e.state, to);
        if from != State::Running {
            assert_eq!(e.reason(), before, "the first reason must win");
        }
    }

    #[test]
    fn first_reason_decides_the_exit_code() {
        let mut e = Escalation::new();
        e.handle(Event::Deadline);
        e.handle(TERM);
        e.handle(ENDED);
        assert_eq!(e.reason().unwrap().exit_code(), 142);
        assert!(!e.escalated());
        e.handle(Event::GraceElapsed);
        assert!(e.escalated());
    }

    #[rstest]
    #[case(ShutdownReason::Signal(Signal::SIGTERM), 143)]
    #[case(ShutdownReason::Signal(Signal::SIGINT), 130)]
    #[case(ShutdownReason::Signal(Signal::SIGHUP), 129)]
    #[case(ShutdownReason::Deadline, 142)]
    #[case(ShutdownReason::ParentDied, 143)]
    #[case(ShutdownReason::TiedPidDied(4242), 143)]
    #[case(ShutdownReason::LockLost, 76)]
    #[case(ShutdownReason::Stopped(BY), 143)]
    #[case(ShutdownReason::CommandEnded(ChildStatus::Signaled(9)), 137)]
    #[case(ShutdownReason::CommandEnded(ChildStatus::NotStarted(127)), 127)]
    fn exit_codes(#[case] reason: ShutdownReason, #[case] code: u8) {
        assert_eq!(reason.exit_code(), code);
    }

    #[test]
    fn teardown_lines_are_the_contract_s() {
        let d = Duration::from_secs(3600);
        assert_eq!(
            ShutdownReason::Signal(Signal::SIGTERM)
                .teardown_line(d)
                .unwrap(),
            "== SIGTERM received — tearing down =="
        );
        assert_eq!(
            ShutdownReason::Deadline.teardown_line(d).unwrap(),
            "== run exceeded 1h hard deadline — tearing down =="
        );
    }
}
