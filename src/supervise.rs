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

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::cgroup::{self, Leaf, RunCgroup};
use crate::cli::CgroupMode;
use crate::exit;
use crate::linux;
use crate::process::{self, ChildStatus, CommandSpec, ProcessGroup};
use crate::record::RunRecord;
use crate::report;
use crate::shutdown::{Action, Escalation, Event, ShutdownReason};
use crate::signals::{Arrived, SignalFunnel};

/// How many kill-and-reap passes teardown makes over leftover descendants before giving up.
const DESCENDANT_KILL_ROUNDS: usize = 100;

/// What the lifetime guards check at start.
#[derive(Debug, Clone, Copy, Default)]
pub struct GuardOptions {
    /// `--expect-parent`: the parent must be this pid.
    pub expect_parent: Option<i32>,
    /// `--tie-to`: tear down when this ancestor exits.
    pub tie_to: Option<i32>,
    /// The hard deadline, armed as the process's alarm.
    pub deadline: Option<Duration>,
}

/// Why the guards refused to start.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error(transparent)]
    Signals(#[from] crate::signals::InstallError),
    #[error("failed to set the parent-death signal: {0}")]
    ParentDeathSignal(nix::Error),
    #[error("failed to become a child subreaper: {0}")]
    Subreaper(nix::Error),
    #[error("refusing to run: {0}")]
    Orphaned(String),
    #[error("refusing to run: --tie-to {pid}: {why}")]
    TieTo { pid: i32, why: String },
}

/// Install the lifetime guards, the same for `run` and `lock`: the signal funnel, the
/// parent-death signal, the orphan check, `--expect-parent`, `--tie-to`, subreaping and the
/// hard deadline. Nothing else may happen before this.
pub fn install_guards(start_ppid: Pid, opts: &GuardOptions) -> Result<SignalFunnel, GuardError> {
    // Handlers first: a SIGTERM from a parent dying right now is then caught and funnelled
    // instead of killing us before we could tear anything down.
    let mut funnel = SignalFunnel::install(start_ppid)?;
    linux::set_parent_death_signal(Signal::SIGTERM).map_err(GuardError::ParentDeathSignal)?;
    // The parent may have died before the prctl armed; then no signal will ever come.
    let now = nix::unistd::getppid();
    if now != start_ppid {
        return Err(GuardError::Orphaned(format!(
            "parent process is gone (parent pid was {start_ppid} at start, is {now} now)"
        )));
    }
    if now.as_raw() == 1 {
        return Err(GuardError::Orphaned(
            "parent process is gone (re-parented to pid 1)".to_owned(),
        ));
    }
    if let Some(expected) = opts.expect_parent.filter(|p| *p != now.as_raw()) {
        return Err(GuardError::Orphaned(format!(
            "parent pid is {now}, not the expected {expected} (--expect-parent)"
        )));
    }
    if let Some(raw) = opts.tie_to {
        let pid = Pid::from_raw(raw);
        let refuse = |why: String| GuardError::TieTo { pid: raw, why };
        // The pidfd first: while it shows the process alive, the pid cannot name another one,
        // so the ancestry check below is about the very process we will watch.
        let fd = linux::pidfd_open(pid).map_err(|e| match e.raw_os_error() {
            Some(nix::libc::ESRCH) => refuse("no such process".to_owned()),
            _ => refuse(format!("failed to open a pidfd: {e}")),
        })?;
        if !linux::is_ancestor(pid) {
            return Err(refuse(
                "not an ancestor of this process (pass the CI step shell's $$)".to_owned(),
            ));
        }
        funnel.tie_to(pid, fd);
        if funnel.tied_pid_exited() {
            return Err(refuse(
                "the process exited while ccci-run started".to_owned(),
            ));
        }
    }
    linux::become_subreaper().map_err(GuardError::Subreaper)?;
    if let Some(deadline) = opts.deadline {
        funnel.expect_deadline_at(std::time::Instant::now() + deadline);
        linux::arm_alarm(deadline.as_secs().try_into().unwrap_or(u32::MAX));
    }
    Ok(funnel)
}

/// Of what is left of a teardown budget, the part the hook may use: everything but what app
/// removal needs (half of what is left, at most [`REMOVAL_RESERVE`]).
pub fn hook_share(now: Instant, until: Instant) -> Instant {
    let left = until.saturating_duration_since(now);
    until - (left / 2).min(REMOVAL_RESERVE)
}

/// What app removal keeps of the teardown budget when a hook runs first.
pub const REMOVAL_RESERVE: Duration = Duration::from_secs(120);

/// A supervisor's cgroup with its leaves.
#[derive(Debug)]
pub struct Cgroups {
    pub cgroup: RunCgroup,
    pub command: Leaf,
    pub hook: Leaf,
}

/// Create the supervisor's cgroup `ccci-<kind>-<label>-<pid>-<start>` with its leaves, unless
/// cgroups are off or not writable here; then say why (at `-v`) and use the fallback.
pub fn run_cgroup(mode: CgroupMode, kind: &str, label: &str) -> Option<Cgroups> {
    if mode == CgroupMode::Off {
        tracing::info!(
            "cgroups off (--cgroup off): process groups, subreaping and the environment scan only"
        );
        return None;
    }
    let name = cgroup::group_name(kind, label, std::process::id(), linux::own_start_time());
    let made = RunCgroup::create(&name).and_then(|cgroup| {
        let command = cgroup.leaf(cgroup::COMMAND_LEAF)?;
        let hook = cgroup.leaf(cgroup::HOOK_LEAF)?;
        Ok(Cgroups {
            cgroup,
            command,
            hook,
        })
    });
    match made {
        Ok(cgroups) => {
            tracing::info!(cgroup = %cgroups.cgroup.path().display(), "running in a cgroup of its own");
            Some(cgroups)
        }
        Err(err) => {
            tracing::info!(
                "cgroup v2 is not usable here ({err}); falling back to process groups, \
                 subreaping and the environment scan"
            );
            None
        }
    }
}

/// The last line of defence of the whole-run bound: a thread that, should the main thread
/// still be running at the hard end (stuck in a call that never returns), kills everything the
/// run started, records `teardown-timeout` and ends the process. The app lock goes with it.
#[derive(Debug)]
pub struct Watchdog {
    code: Arc<AtomicU8>,
}

impl Watchdog {
    pub fn arm(hard_end: Instant, record: PathBuf, cgroup: Option<PathBuf>) -> Self {
        let code = Arc::new(AtomicU8::new(exit::INTERNAL));
        let exit_code = Arc::clone(&code);
        let spawned = std::thread::Builder::new()
            .name("watchdog".to_owned())
            .spawn(move || {
                linux::block_all_signals_but_kick();
                loop {
                    let left = hard_end.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    std::thread::sleep(left);
                }
                let code = exit_code.load(Ordering::SeqCst);
                report::line(
                    "!! teardown budget exhausted — killing what is left of the run and exiting",
                );
                if let Some(dir) = cgroup {
                    let _ = cgroup::kill_path(&dir);
                }
                let me = nix::unistd::getpid();
                for pid in linux::living_descendants(me).unwrap_or_default() {
                    let _ = linux::signal_process(pid, Signal::SIGKILL);
                }
                if let Ok(mut rec) = RunRecord::read(&record) {
                    rec.shutdown_reason = Some("teardown-timeout".to_owned());
                    rec.teardown_errors
                        .push("the whole-run bound passed; ccci-run ended itself".to_owned());
                    rec.exit_code = Some(code);
                    rec.enter("finished");
                    let _ = rec.write(&record);
                }
                // SAFETY: ends the process at once; nothing of ours must run after this.
                unsafe { nix::libc::_exit(i32::from(code)) }
            });
        if let Err(err) = spawned {
            tracing::warn!("failed to start the watchdog thread: {err}");
        }
        Self { code }
    }

    /// The code to exit with if the watchdog has to end the run.
    pub fn set_exit_code(&self, code: u8) {
        self.code.store(code, Ordering::SeqCst);
    }
}

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
    /// When the whole teardown must be over: the kill grace plus the teardown budget after
    /// teardown began (never later than `hard_end`).
    pub teardown_until: Instant,
}

pub struct Supervisor<'a> {
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
            match process::spawn_group(spec, self.leaf) {
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
        let mut budget_until: Option<Instant> = None;
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
                        let now = Instant::now();
                        grace_until = Some(now + self.kill_grace);
                        budget_until = Some(self.teardown_end(now));
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
                    Action::GiveUp => errors.push(format!(
                        "process group {} still not empty when the teardown budget ran out \
                         (uninterruptible?)",
                        group.map_or(0, |g| g.id().as_raw())
                    )),
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
                    teardown_until: budget_until
                        .unwrap_or_else(|| self.teardown_end(Instant::now())),
                };
            }
            if escalation.tearing_down() && group.is_none_or(ProcessGroup::is_empty) {
                events.push_back(Event::GroupEmpty);
                continue;
            }
            let next = match (grace_until, budget_until) {
                (Some(g), Some(b)) => Some(g.min(b)),
                (g, b) => g.or(b),
            };
            let timeout = next.map(|t| t.saturating_duration_since(Instant::now()));
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
            if budget_until.is_some_and(|t| Instant::now() >= t) {
                events.push_back(Event::BudgetElapsed);
            }
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
    pub fn run_within(
        &self,
        spec: &CommandSpec,
        leaf: Option<&Leaf>,
        until: Instant,
    ) -> Result<ChildStatus, String> {
        let (pid, group) = process::spawn_group(spec, leaf).map_err(|e| e.to_string())?;
        loop {
            if let Some((_, status)) = process::reap_ready().into_iter().find(|(p, _)| *p == pid) {
                return Ok(status);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let _ = group.signal(Signal::SIGKILL);
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
    pub fn kill_leftovers(&self, leaf: Option<&Leaf>, until: Instant) -> Result<(), String> {
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

/// Turn caught signals into supervision events (SIGCHLD only wakes the loop up).
pub fn shutdown_events(arrived: &Arrived) -> impl Iterator<Item = Event> + '_ {
    let deaths = [
        arrived.tied_pid_died.then_some(Event::TiedPidDied),
        arrived.parent_died.then_some(Event::ParentDied),
    ];
    deaths
        .into_iter()
        .flatten()
        .chain(arrived.iter().filter_map(|signal| match signal {
            Signal::SIGALRM => Some(Event::Deadline),
            Signal::SIGCHLD => None,
            other => Some(Event::Signal(other)),
        }))
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
        Event::ParentDied => report::line("== parent process died during teardown — ignored =="),
        Event::TiedPidDied => {
            report::line("== tied process exited (--tie-to) during teardown — ignored ==");
        }
        _ => {}
    }
}
