//! Child processes: spawning a command into its own process group with the lifetime guards of
//! `linux::prepare_child`, signalling groups, and reaping.
//!
//! Kill targets are types: a [`ProcessGroup`] is signalled as a group, never through a bare
//! negative pid. Reaping is `waitpid(-1)`: as a subreaper we also collect orphaned descendants
//! re-parented to us, so nothing stays a zombie.

use std::ffi::{CString, OsString};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use nix::errno::Errno;
use nix::sys::signal::Signal;
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid, waitpid};
use nix::unistd::Pid;

use crate::exit;
use crate::supervise::linux;
use crate::supervise::shutdown::ChildStatus;

/// How a child ended, from what `waitpid` said (`None` for a stop or a continue).
fn child_status(status: WaitStatus) -> Option<(Pid, ChildStatus)> {
    match status {
        WaitStatus::Exited(pid, code) => Some((pid, ChildStatus::Exited(code))),
        WaitStatus::Signaled(pid, signal, _) => Some((pid, ChildStatus::Signaled(signal as i32))),
        _ => None,
    }
}

/// What to run: a program, its arguments and extra environment.
#[derive(Debug, Clone)]
pub(crate) struct CommandSpec {
    pub program: OsString,
    pub args: Vec<OsString>,
    pub env: Vec<(String, OsString)>,
    pub cwd: Option<PathBuf>,
}

/// Why a command could not be started.
#[derive(Debug, thiserror::Error)]
#[error("failed to execute {program:?}: {source}")]
pub(crate) struct SpawnError {
    pub program: OsString,
    #[source]
    pub source: io::Error,
}

impl SpawnError {
    /// 127 when the program does not exist, 125 when no process could be started at all (the
    /// command is not to blame), 126 for every other way exec can fail.
    pub(crate) fn status(&self) -> ChildStatus {
        ChildStatus::NotStarted(if self.transient() {
            exit::INTERNAL
        } else if self.source.kind() == io::ErrorKind::NotFound {
            exit::NOT_FOUND
        } else {
            exit::NOT_EXECUTABLE
        })
    }

    /// A failure of this host rather than of the command, which may pass: out of processes or
    /// threads (EAGAIN), memory (ENOMEM) or descriptors (EMFILE, ENFILE).
    pub(crate) fn transient(&self) -> bool {
        matches!(
            self.source.raw_os_error(),
            Some(nix::libc::EAGAIN | nix::libc::ENOMEM | nix::libc::EMFILE | nix::libc::ENFILE)
        )
    }

    /// Which limit a transient failure points at.
    pub(crate) fn limit_hint(&self) -> &'static str {
        match self.source.raw_os_error() {
            Some(nix::libc::EAGAIN) => {
                "the processes or threads this user may have (RLIMIT_NPROC, pids.max)"
            }
            Some(nix::libc::ENOMEM) => "memory (RLIMIT_AS, memory.max)",
            _ => "open files (RLIMIT_NOFILE, fs.file-max)",
        }
    }
}

/// A process group we created; its id is the pid of its first member, our child.
///
/// It is never signalled by a bare number: while its leader is our unreaped child (a zombie
/// included) nobody else can have that id, and the group is signalled as a group; once we have
/// reaped the leader, the id may be reused, and only members the kernel shows as our own
/// descendants are signalled, each through its `/proc` directory. The caller says which
/// (`leader_reaped`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcessGroup(Pid);

impl ProcessGroup {
    pub(crate) fn id(self) -> Pid {
        self.0
    }

    /// Signal every member; a group with no members left is not an error.
    pub(crate) fn signal(self, signal: Signal, leader_reaped: bool) -> nix::Result<()> {
        self.signal_each(&[signal], leader_reaped).map(drop)
    }

    /// Send `signals` in turn to every member. With the leader reaped, the members are found
    /// once for all of them; `Ok(false)` then says none was left: with no member, nobody can
    /// join the group again (only a member's child is born in it, and only an existing group
    /// can be joined), so it is proven empty.
    pub(crate) fn signal_each(self, signals: &[Signal], leader_reaped: bool) -> nix::Result<bool> {
        if !leader_reaped {
            for &signal in signals {
                linux::signal_group_of_unreaped_child(self.0, Some(signal))?;
            }
            return Ok(true);
        }
        let members = self.own_members();
        for &signal in signals {
            for member in &members {
                if let Err(err) = member.dir.signal(signal) {
                    tracing::debug!(pid = member.stat.pid.as_raw(), "failed to signal: {err}");
                }
            }
        }
        Ok(!members.is_empty())
    }

    /// Ask politely: SIGTERM, then SIGCONT so stopped members can act on it. `Ok(false)`: the
    /// group was found empty (see [`Self::signal_each`]).
    pub(crate) fn terminate(self, leader_reaped: bool) -> nix::Result<bool> {
        self.signal_each(&[Signal::SIGTERM, Signal::SIGCONT], leader_reaped)
    }

    /// True once no process (not even an unreaped zombie) is left in the group.
    pub(crate) fn is_empty(self, leader_reaped: bool) -> bool {
        if !leader_reaped {
            return matches!(
                linux::signal_group_of_unreaped_child(self.0, None),
                Err(Errno::ESRCH)
            );
        }
        self.own_members().is_empty()
    }

    /// The group's members among our own descendants (zombies too), held by their `/proc`
    /// directories: with the leader reaped, the only ones provably of this group. As subreaper
    /// every member the command started is our descendant.
    fn own_members(self) -> Vec<linux::Descendant> {
        // The fence is in a session of its own, never in the group.
        linux::descendants(crate::supervise::fence::in_proc())
            .unwrap_or_default()
            .into_iter()
            .filter(|d| d.stat.pgid == self.0)
            .collect()
    }
}

/// Start `spec` as the leader of a new process group, a child of this (main) thread.
///
/// The parent-death signal of a child fires when the *thread* that forked it exits, so this
/// must only be called from the main thread, which lives as long as the process.
///
/// With a cgroup leaf, the child is created inside it (`clone3` with `CLONE_INTO_CGROUP`), so
/// nothing it ever starts can be outside it — and no migration is needed: moving a process into
/// a cgroup waits for an RCU grace period (~10 ms), creating it there does not. Where `clone3`
/// is refused, the child joins the leaf itself before `exec`.
pub(crate) fn spawn_group(
    spec: &CommandSpec,
    leaf: Option<&crate::supervise::cgroup::Leaf>,
) -> Result<(Pid, ProcessGroup), SpawnError> {
    tracing::debug!(program = ?spec.program, args = ?spec.args, cgroup = ?leaf.map(|l| l.path()), "starting");
    if let Some(leaf) = leaf {
        match clone_into(spec, leaf.dir_fd()) {
            Ok(pid) => return Ok((pid, ProcessGroup(pid))),
            Err(CloneError::Spawn(err)) => return Err(err),
            Err(CloneError::Unsupported(errno)) => {
                tracing::debug!("clone3 into a cgroup refused ({errno}); joining after fork");
            }
        }
    }
    spawn_with_std(spec, leaf.map(crate::supervise::cgroup::Leaf::procs_fd))
}

fn spawn_with_std(
    spec: &CommandSpec,
    cgroup_procs: Option<std::os::fd::RawFd>,
) -> Result<(Pid, ProcessGroup), SpawnError> {
    let supervisor = nix::unistd::getpid();
    let mut command = Command::new(&spec.program);
    command
        .args(&spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::inherit())
        .process_group(0);
    // Names this supervisor for good, so a sweep can find what a dead one left behind; an
    // inherited value naming someone else never passes through.
    match supervisor_id() {
        Some(id) => command.env(crate::supervise::leftovers::SUPERVISOR_VAR, id),
        None => command.env_remove(crate::supervise::leftovers::SUPERVISOR_VAR),
    };
    if let Some(cwd) = &spec.cwd {
        command.current_dir(cwd);
    }
    // SAFETY: prepare_child is async-signal-safe (see its docs).
    unsafe {
        command.pre_exec(move || {
            if let Some(fd) = cgroup_procs {
                crate::supervise::cgroup::join_in_child(fd)?;
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

enum CloneError {
    /// `clone3` into a cgroup is not available here (old kernel, seccomp): use the fallback.
    Unsupported(Errno),
    /// The command could not be started.
    Spawn(SpawnError),
}

/// Everything the child needs, built before the fork: after it, only async-signal-safe calls.
struct Prepared {
    /// Where to try to `execve` the program, in order (the `PATH` search done beforehand).
    candidates: Vec<CString>,
    argv: Vec<CString>,
    envp: Vec<CString>,
    cwd: Option<CString>,
}

fn cstring(bytes: &[u8], program: &OsString) -> Result<CString, SpawnError> {
    CString::new(bytes).map_err(|_| SpawnError {
        program: program.clone(),
        source: io::Error::new(io::ErrorKind::InvalidInput, "argument contains a NUL byte"),
    })
}

impl Prepared {
    fn new(spec: &CommandSpec) -> Result<Self, SpawnError> {
        let program = &spec.program;
        let mut env: Vec<(OsString, OsString)> = crate::config::env::all();
        let mut set = |key: OsString, value: OsString| match env.iter_mut().find(|(k, _)| *k == key)
        {
            Some(slot) => slot.1 = value,
            None => env.push((key, value)),
        };
        for (key, value) in &spec.env {
            set(key.into(), value.clone());
        }
        match supervisor_id() {
            Some(id) => set(
                crate::supervise::leftovers::SUPERVISOR_VAR.into(),
                id.into(),
            ),
            None => env.retain(|(k, _)| k != crate::supervise::leftovers::SUPERVISOR_VAR),
        }
        let envp = env
            .iter()
            .map(|(k, v)| {
                let mut entry = k.as_bytes().to_vec();
                entry.push(b'=');
                entry.extend_from_slice(v.as_bytes());
                cstring(&entry, program)
            })
            .collect::<Result<_, _>>()?;
        let argv = std::iter::once(program)
            .chain(&spec.args)
            .map(|a| cstring(a.as_bytes(), program))
            .collect::<Result<_, _>>()?;
        let candidates = if program.as_bytes().contains(&b'/') {
            vec![cstring(program.as_bytes(), program)?]
        } else {
            let path = env
                .iter()
                .find(|(k, _)| k == "PATH")
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
            std::env::split_paths(&path)
                .map(|dir| dir.join(program))
                .map(|p| cstring(p.as_os_str().as_bytes(), program))
                .collect::<Result<_, _>>()?
        };
        let cwd = spec
            .cwd
            .as_ref()
            .map(|c| cstring(c.as_os_str().as_bytes(), program))
            .transpose()?;
        Ok(Self {
            candidates,
            argv,
            envp,
            cwd,
        })
    }
}

/// `CLONE_INTO_CGROUP` (Linux 5.7); libc's constant does not fit its declared type.
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// Fork straight into the cgroup whose directory is `cgroup_fd`, then exec `spec` there.
fn clone_into(spec: &CommandSpec, cgroup_fd: std::os::fd::RawFd) -> Result<Pid, CloneError> {
    let prepared = Prepared::new(spec).map_err(CloneError::Spawn)?;
    let argv: Vec<*const nix::libc::c_char> = prepared
        .argv
        .iter()
        .map(|a| a.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let envp: Vec<*const nix::libc::c_char> = prepared
        .envp
        .iter()
        .map(|e| e.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let supervisor = nix::unistd::getpid();
    let (status_read, status_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| CloneError::Spawn(spawn_error(spec, e as i32)))?;
    // SAFETY: clone_args is plain data; all zero but what we set.
    let mut args: nix::libc::clone_args = unsafe { std::mem::zeroed() };
    args.flags = CLONE_INTO_CGROUP;
    args.exit_signal = nix::libc::SIGCHLD as u64;
    args.cgroup = cgroup_fd as u64;
    let child = Child {
        prepared: &prepared,
        argv: &argv,
        envp: &envp,
        status: status_write.as_raw_fd(),
        supervisor,
    };
    let rc = if cfg!(target_arch = "x86_64") {
        // SAFETY: `start_child` runs only async-signal-safe code on what `child` points to,
        // which lives until the clone has returned, and ends in execve or _exit.
        unsafe {
            crate::supervise::vfork::clone3(
                &mut args,
                start_child,
                std::ptr::from_ref(&child).cast_mut().cast(),
            )
        }
    } else {
        // SAFETY: clone3 without CLONE_VM is a fork: the child gets a copy of our memory and
        // runs only async-signal-safe code (`exec_child`) before execve or _exit.
        let rc = unsafe {
            nix::libc::syscall(
                nix::libc::SYS_clone3,
                &args as *const nix::libc::clone_args,
                std::mem::size_of::<nix::libc::clone_args>(),
            )
        };
        if rc == 0 {
            start_child(std::ptr::from_ref(&child).cast_mut().cast());
        }
        Errno::result(rc).map(|pid| pid as i32)
    };
    let rc = match rc {
        Ok(pid) => pid,
        Err(errno) => {
            return Err(match errno {
                Errno::ENOSYS | Errno::EINVAL | Errno::EPERM | Errno::E2BIG | Errno::EOPNOTSUPP => {
                    CloneError::Unsupported(errno)
                }
                other => CloneError::Spawn(spawn_error(spec, other as i32)),
            });
        }
    };
    drop(status_write);
    let pid = Pid::from_raw(rc as i32);
    // The pipe closes on a successful exec; otherwise the child sends its errno first.
    let mut buf = [0u8; 4];
    let mut got = 0;
    while got < buf.len() {
        match nix::unistd::read(&status_read, &mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(Errno::EINTR) => continue,
            Err(_) => break,
        }
    }
    if got == buf.len() {
        // It exited right after telling us: reap it here, it is ours alone.
        let _ = waitpid(pid, None);
        return Err(CloneError::Spawn(spawn_error(
            spec,
            i32::from_ne_bytes(buf),
        )));
    }
    Ok(pid)
}

fn spawn_error(spec: &CommandSpec, errno: i32) -> SpawnError {
    SpawnError {
        program: spec.program.clone(),
        source: io::Error::from_raw_os_error(errno),
    }
}

/// What the child of [`clone_into`] execs, built before the clone.
struct Child<'a> {
    prepared: &'a Prepared,
    argv: &'a [*const nix::libc::c_char],
    envp: &'a [*const nix::libc::c_char],
    status: std::os::fd::RawFd,
    supervisor: Pid,
}

/// The child's entry: `arg` is a [`Child`].
extern "C" fn start_child(arg: *mut std::ffi::c_void) -> ! {
    // SAFETY: `clone_into` passes a `Child` that outlives the clone.
    let child = unsafe { &*arg.cast::<Child<'_>>() };
    // SAFETY: in the child, with pointers built before the clone.
    unsafe {
        exec_child(
            child.prepared,
            child.argv,
            child.envp,
            child.status,
            child.supervisor,
        )
    }
}

/// The child's side of [`clone_into`]: own process group, the guards of
/// `linux::prepare_child`, the working directory, then `execve` of each candidate in turn (as
/// `execvp` would). Any failure is reported through `status` and ends the child.
///
/// Nothing here allocates, locks or unwinds: the child may share our memory with our other
/// threads (`crate::supervise::vfork`).
///
/// # Safety
/// Only to be called in the child of a fork or a shared-memory clone, with pointers built
/// before it.
unsafe fn exec_child(
    prepared: &Prepared,
    argv: &[*const nix::libc::c_char],
    envp: &[*const nix::libc::c_char],
    status: std::os::fd::RawFd,
    supervisor: Pid,
) -> ! {
    use nix::libc;
    let fail = |errno: i32| -> ! {
        let bytes = errno.to_ne_bytes();
        // SAFETY: write(2) and _exit(2) are async-signal-safe.
        unsafe {
            libc::write(status, bytes.as_ptr().cast(), bytes.len());
            libc::_exit(127)
        }
    };
    let errno = || {
        io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL)
    };
    // SAFETY: plain syscalls on our own process.
    if unsafe { libc::setpgid(0, 0) } != 0 {
        fail(errno());
    }
    if let Err(err) = linux::prepare_child(supervisor) {
        fail(err.raw_os_error().unwrap_or(libc::EINVAL));
    }
    if let Some(cwd) = &prepared.cwd {
        // SAFETY: a NUL-terminated path built before the fork.
        if unsafe { libc::chdir(cwd.as_ptr()) } != 0 {
            fail(errno());
        }
    }
    let mut reported = libc::ENOENT;
    for path in &prepared.candidates {
        // SAFETY: NUL-terminated strings and NULL-terminated arrays built before the fork.
        unsafe { libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
        match errno() {
            // Not here: try the next PATH entry.
            libc::ENOENT | libc::ENOTDIR => {}
            // Found but not executable: remembered, as execvp does, while the search goes on.
            other => reported = other,
        }
    }
    fail(reported)
}

/// This process as the supervisor of its configuration (`<owner>`), once established.
fn supervisor_id() -> Option<&'static str> {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let owner = crate::supervise::identity::Owner::established()?;
    Some(ID.get_or_init(|| owner.to_string()))
}

/// Reap every child that has already ended, without blocking.
pub(crate) fn reap_ready() -> Vec<(Pid, ChildStatus)> {
    let mut reaped = Vec::new();
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => break,
            Ok(status) => reaped.extend(child_status(status)),
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
pub(crate) fn has_children() -> bool {
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
pub(crate) fn kill_descendants(rounds: usize, mut wait_a_moment: impl FnMut() -> bool) -> Vec<Pid> {
    let mut survivors = Vec::new();
    for _ in 0..rounds {
        reap_ready();
        if !has_children() {
            return Vec::new();
        }
        // The run's fence stays until the lock is released (it kills, it is not killed).
        let found = match linux::descendants(crate::supervise::fence::in_proc()) {
            Ok(found) => found
                .into_iter()
                .filter(|d| !d.stat.zombie)
                .collect::<Vec<_>>(),
            Err(err) => {
                tracing::warn!("failed to list descendants in /proc: {err}");
                return Vec::new();
            }
        };
        survivors = found.iter().map(|d| d.stat.pid).collect();
        if survivors.is_empty() {
            return survivors;
        }
        // Each through its `/proc` directory: never whatever took its pid meanwhile.
        for descendant in &found {
            let pid = descendant.stat.pid;
            tracing::debug!(pid = pid.as_raw(), "killing leftover descendant");
            if let Err(err) = descendant.dir.signal(Signal::SIGKILL) {
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
