//! The lifetime guards, installed by one function for `run` and `lock` alike before anything
//! else happens: the signal funnel, the parent-death signal, the orphan check,
//! `--expect-parent`, `--tie-to`, subreaping and the hard deadline.

use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::Pid;

use crate::supervise::linux;
use crate::supervise::signals::SignalFunnel;

/// What the lifetime guards check at start.
#[derive(Debug, Clone, Default)]
pub(crate) struct GuardOptions {
    /// `--expect-parent`: the parent must be this pid.
    pub expect_parent: Option<i32>,
    /// `--tie-to`: tear down when any of these ancestors exits.
    pub tie_to: Vec<i32>,
    /// The hard deadline, armed as the process's alarm.
    pub deadline: Option<Duration>,
}

/// Why the guards refused to start.
#[derive(Debug, thiserror::Error)]
pub(crate) enum GuardError {
    #[error(transparent)]
    Signals(#[from] crate::supervise::signals::InstallError),
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
pub(crate) fn install_guards(
    start_ppid: Pid,
    opts: &GuardOptions,
) -> Result<SignalFunnel, GuardError> {
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
    // A parent of pid 1 from the start is either an orphan (we were re-parented before we
    // could look) or a container's init running the step: only the caller can tell, by saying
    // that pid 1 is the parent it means (`--expect-parent 1`, or `--tie-to 1`).
    let init_meant = opts.expect_parent == Some(1) || opts.tie_to.contains(&1);
    if now.as_raw() == 1 && !init_meant {
        return Err(GuardError::Orphaned(
            "parent process is gone (re-parented to pid 1); when pid 1 is the container's init \
             that runs the step, say so with --expect-parent 1"
                .to_owned(),
        ));
    }
    if let Some(expected) = opts.expect_parent.filter(|p| *p != now.as_raw()) {
        return Err(GuardError::Orphaned(format!(
            "parent pid is {now}, not the expected {expected} (--expect-parent)"
        )));
    }
    for &raw in &opts.tie_to {
        let pid = Pid::from_raw(raw);
        let refuse = |why: String| GuardError::TieTo { pid: raw, why };
        if raw == 1 && now.as_raw() != 1 {
            return Err(refuse(
                "1 is init, which never exits: name the CI step shell's pid ($$) and its \
                 parent's ($PPID) instead"
                    .to_owned(),
            ));
        }
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
        funnel.tie_to(raw, fd);
    }
    if let Some(raw) = funnel.tied_pid_exited() {
        return Err(GuardError::TieTo {
            pid: raw,
            why: "the process exited while ccci-run started".to_owned(),
        });
    }
    linux::become_subreaper().map_err(GuardError::Subreaper)?;
    if let Some(deadline) = opts.deadline {
        funnel.expect_deadline_at(std::time::Instant::now() + deadline);
        linux::arm_alarm(deadline);
    }
    Ok(funnel)
}
