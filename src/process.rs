//! Child processes: spawning a command into its own process group with the lifetime guards of
//! `linux::prepare_child`, signalling groups, and reaping.
//!
//! Kill targets are types: a [`ProcessGroup`] is signalled as a group, never through a bare
//! negative pid. Reaping is `waitpid(-1)`: as a subreaper we also collect orphaned descendants
//! re-parented to us, so nothing stays a zombie.

use std::ffi::OsString;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use nix::errno::Errno;
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid, waitpid};
use nix::unistd::Pid;

use crate::exit;
use crate::linux;

/// How a child ended, in the terms the run's exit code is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "value")]
pub enum ChildStatus {
    /// It exited with this code.
    Exited(i32),
    /// A signal with this number killed it.
    Signaled(i32),
    /// It could not be started: 126 (not executable) or 127 (not found).
    NotStarted(u8),
}

impl ChildStatus {
    /// The shell's convention: the code, 128+N for signal N, 126/127 when it never ran.
    pub fn exit_code(self) -> u8 {
        match self {
            Self::Exited(code) => (code & 0xff) as u8,
            Self::Signaled(n) => exit::SIGNAL_BASE.saturating_add(n as u8),
            Self::NotStarted(code) => code,
        }
    }

    fn from_wait(status: WaitStatus) -> Option<(Pid, Self)> {
        match status {
            WaitStatus::Exited(pid, code) => Some((pid, Self::Exited(code))),
            WaitStatus::Signaled(pid, signal, _) => Some((pid, Self::Signaled(signal as i32))),
            _ => None,
        }
    }
}

/// What to run: a program, its arguments and extra environment.
#[derive(Debug, Clone)]
pub struct CommandSpec {
    pub program: OsString,
    pub args: Vec<OsString>,
    pub env: Vec<(String, OsString)>,
    pub cwd: Option<PathBuf>,
}

/// Why a command could not be started.
#[derive(Debug, thiserror::Error)]
#[error("failed to execute {program:?}: {source}")]
pub struct SpawnError {
    pub program: OsString,
    #[source]
    pub source: io::Error,
}

impl SpawnError {
    /// 127 when the program does not exist, 126 for every other way exec can fail.
    pub fn status(&self) -> ChildStatus {
        ChildStatus::NotStarted(match self.source.kind() {
            io::ErrorKind::NotFound => exit::NOT_FOUND,
            _ => exit::NOT_EXECUTABLE,
        })
    }
}

/// A process group we created; its id is the pid of its first member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessGroup(Pid);

impl ProcessGroup {
    pub fn id(self) -> Pid {
        self.0
    }

    /// Signal every member; a group with no members left is not an error.
    pub fn signal(self, signal: Signal) -> nix::Result<()> {
        match kill(Pid::from_raw(-self.0.as_raw()), signal) {
            Err(Errno::ESRCH) => Ok(()),
            other => other,
        }
    }

    /// Ask politely: SIGTERM, then SIGCONT so stopped members can act on it.
    pub fn terminate(self) -> nix::Result<()> {
        self.signal(Signal::SIGTERM)?;
        self.signal(Signal::SIGCONT)
    }

    /// True once no process (not even an unreaped zombie) is left in the group.
    pub fn is_empty(self) -> bool {
        matches!(
            kill(Pid::from_raw(-self.0.as_raw()), None),
            Err(Errno::ESRCH)
        )
    }
}

/// Start `spec` as the leader of a new process group, a child of this (main) thread.
///
/// The parent-death signal of a child fires when the *thread* that forked it exits, so this
/// must only be called from the main thread, which lives as long as the process.
///
/// With `cgroup_procs` (an open `cgroup.procs` of a leaf), the child joins that cgroup before
/// anything else, so nothing it ever starts can leave it.
pub fn spawn_group(
    spec: &CommandSpec,
    cgroup_procs: Option<std::os::fd::RawFd>,
) -> Result<(Pid, ProcessGroup), SpawnError> {
    let supervisor = nix::unistd::getpid();
    let mut command = Command::new(&spec.program);
    command
        .args(&spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        // Names this supervisor for good, so a sweep can find what a dead one left behind.
        .env(crate::leftovers::SUPERVISOR_VAR, supervisor_id())
        .stdin(Stdio::inherit())
        .process_group(0);
    if let Some(cwd) = &spec.cwd {
        command.current_dir(cwd);
    }
    // SAFETY: prepare_child is async-signal-safe (see its docs).
    unsafe {
        command.pre_exec(move || {
            if let Some(fd) = cgroup_procs {
                crate::cgroup::join_in_child(fd)?;
            }
            linux::prepare_child(supervisor)
        });
    }
    let child = command.spawn().map_err(|source| SpawnError {
        program: spec.program.clone(),
        source,
    })?;
    // We reap through waitpid(-1) ourselves; dropping `child` neither waits nor kills.
    let pid = Pid::from_raw(child.id() as i32);
    Ok((pid, ProcessGroup(pid)))
}

/// `<pid>-<start>` of this process, computed once.
fn supervisor_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(crate::leftovers::this_supervisor)
}

/// Reap every child that has already ended, without blocking.
pub fn reap_ready() -> Vec<(Pid, ChildStatus)> {
    let mut reaped = Vec::new();
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => break,
            Ok(status) => reaped.extend(ChildStatus::from_wait(status)),
            Err(Errno::EINTR) => continue,
            Err(err) => {
                tracing::warn!("waitpid failed: {err}");
                break;
            }
        }
    }
    reaped
}

/// True while this process has any child, living or a zombie: as subreaper every living
/// descendant is below one of our children, so without children there is nothing to walk.
pub fn has_children() -> bool {
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
    loop {
        match waitid(Id::All, flags) {
            Err(Errno::ECHILD) => return false,
            Err(Errno::EINTR) => continue,
            _ => return true,
        }
    }
}

/// SIGKILL every living descendant of this process and reap them, until none is left.
///
/// Daemonised descendants (`setsid` + fork) have left the command's group but were re-parented
/// to us as subreaper, so the `/proc` walk still finds them. Gives up after `rounds` passes
/// (a process stuck in uninterruptible sleep cannot be killed) and returns what survived.
/// `wait_a_moment` returns false once the caller's budget is spent.
pub fn kill_descendants(rounds: usize, mut wait_a_moment: impl FnMut() -> bool) -> Vec<Pid> {
    let me = nix::unistd::getpid();
    let mut survivors = Vec::new();
    for _ in 0..rounds {
        reap_ready();
        if !has_children() {
            return Vec::new();
        }
        survivors = match linux::living_descendants(me) {
            Ok(found) => found,
            Err(err) => {
                tracing::warn!("failed to list descendants in /proc: {err}");
                return Vec::new();
            }
        };
        if survivors.is_empty() {
            return survivors;
        }
        for pid in &survivors {
            tracing::debug!(pid = pid.as_raw(), "killing leftover descendant");
            if let Err(err) = linux::signal_process(*pid, Signal::SIGKILL) {
                tracing::warn!("failed to kill descendant {pid}: {err}");
            }
        }
        if !wait_a_moment() {
            break;
        }
    }
    survivors
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case(ChildStatus::Exited(0), 0)]
    #[case(ChildStatus::Exited(3), 3)]
    #[case(ChildStatus::Exited(256 + 7), 7)]
    #[case(ChildStatus::Signaled(9), 137)]
    #[case(ChildStatus::Signaled(15), 143)]
    #[case(ChildStatus::NotStarted(127), 127)]
    fn exit_codes_follow_the_shell_convention(#[case] status: ChildStatus, #[case] code: u8) {
        assert_eq!(status.exit_code(), code);
    }
}
