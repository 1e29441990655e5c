//! Linux-only primitives: prctl, signal dispositions, the command's pre-exec set-up and the
//! `/proc` walk that finds descendants. Nothing else in the crate calls these syscalls directly.
//!
//! Invariant: everything in [`prepare_child`] is async-signal-safe, because it runs between
//! `fork` and `exec` of a multi-threaded-capable process.

use std::collections::{HashMap, HashSet};
use std::io;

use std::os::fd::BorrowedFd;

use nix::errno::Errno;
use nix::libc;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::prctl;
use nix::sys::signal::{SigHandler, SigSet, SigmaskHow, Signal, sigprocmask};
use nix::unistd::Pid;

/// Ask the kernel to send `signal` to this process when the thread that forked it exits.
pub(crate) fn set_parent_death_signal(signal: Signal) -> nix::Result<()> {
    prctl::set_pdeathsig(signal)
}

/// Become a child subreaper: orphaned descendants (daemons that `setsid` and fork) are
/// re-parented to us instead of init, so teardown can still find and kill them.
pub(crate) fn become_subreaper() -> nix::Result<()> {
    prctl::set_child_subreaper(true)
}

/// Clear `SA_RESTART` on an installed handler, keeping everything else about it.
///
/// With `SA_RESTART` a blocking `flock` or `waitpid` silently resumes after our handler ran, so
/// a SIGTERM would not end a parked wait. Without it those calls return `EINTR`.
pub(crate) fn clear_sa_restart(signal: libc::c_int) -> io::Result<()> {
    // SAFETY: a null `act` only reads the current action; writing back the same action with one
    // flag cleared keeps the handler signal-hook installed.
    unsafe {
        let mut current: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(signal, std::ptr::null(), &mut current) != 0 {
            return Err(io::Error::last_os_error());
        }
        current.sa_flags &= !libc::SA_RESTART;
        if libc::sigaction(signal, &current, std::ptr::null_mut()) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Arm (or re-arm) the process's single `SIGALRM` timer (the one alarm(2) sets) to fire once,
/// `after` from now, to the microsecond: a deadline of 1.5 s fires at 1.5 s, not at 1 s.
pub(crate) fn arm_alarm(after: std::time::Duration) {
    // Never zero: a zero it_value would disarm the timer instead of firing it at once.
    let after = after.max(std::time::Duration::from_micros(1));
    let timer = libc::itimerval {
        it_interval: libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        },
        it_value: libc::timeval {
            tv_sec: libc::time_t::try_from(after.as_secs()).unwrap_or(libc::time_t::MAX),
            tv_usec: libc::suseconds_t::from(after.subsec_micros()),
        },
    };
    // SAFETY: setitimer(2) reads the struct we pass and writes nothing (no old value asked).
    let rc = unsafe { libc::setitimer(libc::ITIMER_REAL, &timer, std::ptr::null_mut()) };
    if rc != 0 {
        // Only EINVAL is possible, and the values are in range; the watchdog's hard end still
        // bounds the run.
        tracing::warn!(
            "failed to arm the deadline timer: {}",
            io::Error::last_os_error()
        );
    }
}

/// Set-up done in the forked child before `exec`: the command must die with us, start with a
/// clean signal state, and inherit no descriptor but stdin, stdout and stderr.
///
/// Runs between fork and exec: async-signal-safe calls only, no allocation.
pub(crate) fn prepare_child(supervisor: Pid) -> io::Result<()> {
    // SIGKILL rather than SIGTERM: when the supervisor is gone nobody is left to escalate.
    prctl::set_pdeathsig(Signal::SIGKILL)?;
    // The supervisor may have died between fork and prctl; then no signal will ever come.
    // (A bare errno: this may run on the supervisor's memory, where nothing may allocate.)
    if nix::unistd::getppid() != supervisor {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    for signal in Signal::iterator() {
        if matches!(signal, Signal::SIGKILL | Signal::SIGSTOP) {
            continue;
        }
        // SAFETY: resetting a disposition to its default is always sound; handlers we installed
        // would be reset by exec anyway, but ignored signals (a background shell ignores SIGINT
        // and SIGQUIT for its jobs) would otherwise stay ignored in the command.
        unsafe { nix::sys::signal::signal(signal, SigHandler::SigDfl) }?;
    }
    // Only now: a child on the supervisor's memory must not run its handlers.
    sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)?;
    mark_inherited_fds_cloexec()
}

/// Mark every descriptor from 3 up close-on-exec, including ones our own parent leaked to us.
fn mark_inherited_fds_cloexec() -> io::Result<()> {
    // SAFETY: close_range only changes descriptor flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    // Kernels before 5.11: walk the descriptor table up to the soft limit instead.
    // SAFETY: plain syscalls on integers.
    let limit = unsafe { libc::sysconf(libc::_SC_OPEN_MAX) }.clamp(256, 65_536) as libc::c_int;
    for fd in 3..limit {
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        if flags >= 0 {
            unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) };
        }
    }
    Ok(())
}

/// One process as `/proc/<pid>/stat` describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcStat {
    pub pid: Pid,
    pub ppid: Pid,
    /// Its process group.
    pub pgid: Pid,
    pub zombie: bool,
}

/// Parse `/proc/<pid>/stat`. The command name may hold spaces and parentheses, so the fields
/// are read after the last `)`.
pub(crate) fn parse_stat(text: &str) -> Option<ProcStat> {
    let (head, tail) = text.rsplit_once(')')?;
    let pid = head.split_once(" (")?.0.trim().parse().ok()?;
    let mut fields = tail.split_ascii_whitespace();
    let state = fields.next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgid = fields.next().and_then(|f| f.parse().ok()).unwrap_or(0);
    Some(ProcStat {
        pid: Pid::from_raw(pid),
        ppid: Pid::from_raw(ppid),
        pgid: Pid::from_raw(pgid),
        zombie: state == "Z" || state == "X",
    })
}

/// A descendant of this process, held by its `/proc` directory: what a kill goes through.
#[derive(Debug)]
pub(crate) struct Descendant {
    pub stat: ProcStat,
    pub dir: ProcDir,
}

/// Every descendant of this process (zombies too), each held by its `/proc` directory and
/// proven ours: its parent, as read through its own directory, is this process or another
/// descendant that still existed after that read (a pid cannot be reused while its process
/// exists, zombie or not), so the chain from us down to it was real when it was read.
///
/// Processes that appear or vanish during the walk are expected: callers loop until this is
/// empty. The child `skip` (as `/proc` numbers it: one that starts nothing, the fence) is left
/// out with what is below it; its number is its own while it is our child.
pub(crate) fn descendants(skip: Option<Pid>) -> io::Result<Vec<Descendant>> {
    let root = Pid::from_raw(proc_self_pid());
    let mut children: HashMap<Pid, Vec<Descendant>> = HashMap::new();
    // Where the kernel lists each task's children, only our own tree is read (a handful of
    // processes), not every process of the host; the proof below is the same either way.
    if let Some(listed) = tree_by_children_files(root, skip) {
        for d in listed {
            children.entry(d.stat.ppid).or_default().push(d);
        }
        return Ok(prove_descendants(root, children));
    }
    for entry in std::fs::read_dir("/proc")? {
        let Ok(entry) = entry else { continue };
        let Some(pid) = entry
            .file_name()
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        // A process that exited since read_dir listed it is simply gone.
        let Some(dir) = ProcDir::open(pid) else {
            continue;
        };
        let Some(stat) = dir.stat() else { continue };
        if skip == Some(stat.pid) && stat.ppid == root {
            continue;
        }
        children
            .entry(stat.ppid)
            .or_default()
            .push(Descendant { stat, dir });
    }
    Ok(prove_descendants(root, children))
}

/// Every process below `root` as its tasks' `children` files list them, each held by its
/// `/proc` directory with its stat; `None` where the kernel keeps no such file
/// (CONFIG_PROC_CHILDREN), or where one cannot be read.
fn tree_by_children_files(root: Pid, skip: Option<Pid>) -> Option<Vec<Descendant>> {
    let mut found = Vec::new();
    let mut queue = vec![root.as_raw()];
    let mut seen = HashSet::from([root.as_raw()]);
    while let Some(parent) = queue.pop() {
        let Some(dir) = ProcDir::open(parent) else {
            if parent == root.as_raw() {
                return None;
            }
            // Gone since it was listed: no children to look for.
            continue;
        };
        for pid in dir.listed_children(parent)? {
            if parent == root.as_raw() && skip.is_some_and(|skip| skip.as_raw() == pid) {
                continue;
            }
            let Some(child) = ProcDir::open(pid) else {
                continue;
            };
            let Some(stat) = child.stat() else { continue };
            if seen.insert(pid) {
                queue.push(pid);
                found.push(Descendant { stat, dir: child });
            }
        }
    }
    Some(found)
}

/// Of the processes in `children` (by parent), those proven descendants of `root`.
fn prove_descendants(root: Pid, mut children: HashMap<Pid, Vec<Descendant>>) -> Vec<Descendant> {
    let mut found: Vec<Descendant> = Vec::new();
    let mut seen = HashSet::from([root]);
    let mut queue = vec![root];
    while let Some(parent) = queue.pop() {
        for child in children.remove(&parent).into_iter().flatten() {
            if seen.insert(child.stat.pid) {
                queue.push(child.stat.pid);
                found.push(child);
            }
        }
    }
    // The proof: each parent named still exists now, after its children's stat was read.
    let present: HashSet<Pid> = found
        .iter()
        .filter(|d| d.dir.stat().is_some())
        .map(|d| d.stat.pid)
        .chain([root])
        .collect();
    let mut proven: HashSet<Pid> = HashSet::from([root]);
    let mut kept = Vec::new();
    // `found` is in walk order: a parent always comes before its children.
    for d in found {
        if proven.contains(&d.stat.ppid) && present.contains(&d.stat.ppid) {
            proven.insert(d.stat.pid);
            kept.push(d);
        }
    }
    kept
}

/// Every living (non-zombie) descendant of this process, held and proven as [`descendants`]
/// says.
pub(crate) fn living_descendants() -> io::Result<Vec<Descendant>> {
    Ok(descendants(None)?
        .into_iter()
        .filter(|d| !d.stat.zombie)
        .collect())
}

/// This process's pid as `/proc` numbers it (not our own numbering when `/proc` belongs to an
/// enclosing pid namespace).
pub(crate) fn proc_self_pid() -> i32 {
    std::fs::read_link("/proc/self")
        .ok()
        .and_then(|p| p.to_str()?.parse().ok())
        .unwrap_or_else(|| nix::unistd::getpid().as_raw())
}

/// SIGKILL (or `signal`) every member of process group `group` that a walk of `/proc` finds,
/// each through its `/proc` directory, as long as `still_theirs` (asked after the walk) says
/// the group id still belongs to the group meant: a group's id is its first member's pid, which
/// cannot be reused while that process exists. Returns how many were signalled.
pub(crate) fn signal_group_members(
    group: Pid,
    signal: Signal,
    still_theirs: impl Fn() -> bool,
) -> usize {
    let members: Vec<ProcDir> = all_pids()
        .into_iter()
        .filter_map(|pid| ProcDir::open(pid.as_raw()))
        .filter(|dir| dir.stat().is_some_and(|s| s.pgid == group && !s.zombie))
        .collect();
    if members.is_empty() || !still_theirs() {
        return 0;
    }
    for dir in &members {
        let _ = dir.signal(signal);
    }
    members.len()
}

/// The pid namespace `/proc/<pid>/ns/pid` (or `self`) links to: the inode of its nsfs file.
pub(crate) fn pid_namespace(pid: &str) -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/pid")).map(|m| m.ino())
}

/// Where two namespace links of this process point (`time` and `time_for_children`, say):
/// `None` when the kernel has no such link.
pub(crate) fn own_namespace_link(name: &str) -> Option<std::path::PathBuf> {
    std::fs::read_link(format!("/proc/self/ns/{name}")).ok()
}

/// Clock ticks per second, the unit of `/proc/<pid>/stat` start times (`USER_HZ`).
pub(crate) fn clock_ticks_per_second() -> i128 {
    // SAFETY: sysconf only reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { i128::from(hz) } else { 100 }
}

/// This boot of this kernel: a random id, the same in every container on it, new at every boot.
pub(crate) fn boot_id() -> String {
    crate::files::kernel_text("/proc/sys/kernel/random/boot_id")
        .map(|id| id.trim().to_owned())
        .unwrap_or_default()
}

/// One process as found under `/proc`, held by its directory: the descriptor stays bound to
/// that very process, so reading it again or signalling it can never reach a process that
/// reused its pid, whatever pid namespace `/proc` belongs to.
#[derive(Debug)]
pub(crate) struct ProcDir {
    dir: std::os::fd::OwnedFd,
}

impl ProcDir {
    /// Open `/proc/<pid>`; `None` when it is gone.
    #[expect(
        clippy::disallowed_methods,
        reason = "a process's /proc directory, which the kernel serves"
    )]
    pub(crate) fn open(pid: i32) -> Option<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(format!("/proc/{pid}"))
            .ok()?;
        Some(Self { dir: dir.into() })
    }

    /// The pids the `children` files of process `pid`'s tasks list (this directory's
    /// process). `None` when the kernel keeps no such file (CONFIG_PROC_CHILDREN) or one
    /// cannot be read while its task lives: a listing that may be short is never used.
    fn listed_children(&self, pid: i32) -> Option<Vec<i32>> {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            // Gone (reaped) since it was opened: it has no children to list.
            return self.stat().is_none().then(Vec::new);
        };
        let mut pids = Vec::new();
        for task in tasks {
            let Ok(task) = task else { return None };
            let Some(tid) = task.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            match self.read(&format!("task/{tid}/children")) {
                Ok(text) => pids.extend(
                    String::from_utf8_lossy(&text)
                        .split_ascii_whitespace()
                        .filter_map(|p| p.parse::<i32>().ok()),
                ),
                // A task that ended meanwhile has no children left to list; one that lives
                // without the file means the kernel keeps none.
                Err(_) if self.read(&format!("task/{tid}/stat")).is_err() => {}
                Err(_) => return None,
            }
        }
        Some(pids)
    }

    /// Read one file of the process's directory (`stat`, `environ`); an error once the process
    /// is reaped.
    pub(crate) fn read(&self, name: &str) -> io::Result<Vec<u8>> {
        use std::io::Read;
        use std::os::fd::{AsRawFd, FromRawFd};
        let name = std::ffi::CString::new(name).map_err(io::Error::other)?;
        // SAFETY: openat on a directory descriptor we own, with a NUL-terminated name.
        let fd = unsafe {
            libc::openat(
                self.dir.as_raw_fd(),
                name.as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just gave us this descriptor and nobody else owns it.
        let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
        let mut data = Vec::new();
        file.read_to_end(&mut data)?;
        Ok(data)
    }

    /// The inode of the process's pid namespace (`ns/pid`).
    pub(crate) fn pid_namespace(&self) -> io::Result<u64> {
        use std::os::fd::AsRawFd;
        // SAFETY: a zeroed stat buffer for fstatat to fill; the name is a static C string.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        let rc = unsafe { libc::fstatat(self.dir.as_raw_fd(), c"ns/pid".as_ptr(), &mut st, 0) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(st.st_ino)
    }

    /// True while the process runs (a zombie has ended: it will never act again).
    pub(crate) fn running(&self) -> bool {
        self.stat().is_some_and(|s| !s.zombie)
    }

    /// Its `stat`, read through the directory; `None` once it is reaped.
    pub(crate) fn stat(&self) -> Option<ProcStat> {
        self.read("stat")
            .ok()
            .and_then(|s| parse_stat(&String::from_utf8_lossy(&s)))
    }

    /// Its start time (`stat` field 22, in clock ticks as `/proc` shows it); `None` once it
    /// is reaped.
    pub(crate) fn start_ticks(&self) -> Option<u64> {
        self.read("stat")
            .ok()
            .and_then(|s| crate::supervise::procfs::parse_start_time(&String::from_utf8_lossy(&s)))
    }

    /// Send `signal` to the process itself (`pidfd_send_signal` accepts a `/proc/<pid>`
    /// directory): never to whatever has its pid now. A process already gone is not an error.
    pub(crate) fn signal(&self, signal: Signal) -> io::Result<()> {
        use std::os::fd::AsFd;
        pidfd_signal(self.dir.as_fd(), signal)
    }
}

impl std::os::fd::AsFd for ProcDir {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.dir.as_fd()
    }
}

/// A pidfd for `pid`: it turns readable when the process exits, whoever its parent is.
pub(crate) fn pidfd_open(pid: Pid) -> io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open(2) returns a new descriptor or -1; flags 0.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just gave us this descriptor and nobody else owns it.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as libc::c_int) })
}

/// Send `signal` through the pidfd `pidfd`: to that process, never to whatever has its pid now.
/// A process already gone is not an error.
pub(crate) fn pidfd_signal(pidfd: std::os::fd::BorrowedFd<'_>, signal: Signal) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_send_signal(2) with a descriptor we borrow, no siginfo, flags 0.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal as libc::c_int,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    match rc {
        0 => Ok(()),
        _ => match io::Error::last_os_error() {
            err if err.raw_os_error() == Some(libc::ESRCH) => Ok(()),
            err => Err(err),
        },
    }
}

/// Every pid in `/proc`.
pub(crate) fn all_pids() -> Vec<Pid> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .map(Pid::from_raw)
        .collect()
}

/// Every flock in the system, from `/proc/locks`.
pub(crate) fn proc_locks() -> io::Result<Vec<crate::supervise::procfs::ProcLock>> {
    Ok(crate::files::kernel_text("/proc/locks")?
        .lines()
        .filter_map(crate::supervise::procfs::parse_proc_lock)
        .collect())
}

/// True when `pid` is this process's parent, grandparent, ... (walking `/proc`).
pub(crate) fn is_ancestor(pid: Pid) -> bool {
    let mut current = nix::unistd::getppid();
    for _ in 0..4096 {
        if current == pid {
            return true;
        }
        if current.as_raw() <= 1 {
            return false;
        }
        let Ok(text) = crate::files::kernel_text(format!("/proc/{current}/stat")) else {
            return false;
        };
        match parse_stat(&text) {
            Some(stat) => current = stat.ppid,
            None => return false,
        }
    }
    false
}

/// Send `signal` to the process group of `leader`, a child of this process that it has not
/// reaped: while unreaped its pid, and so the group id it made, cannot be anyone else's. The
/// only `kill(2)` of the crate (clippy's `disallowed-methods`, and `layers.rs`): everything
/// else signals a process through its pidfd or `/proc` directory. An empty group is not an
/// error.
#[expect(
    clippy::disallowed_methods,
    reason = "the one raw kill(2): a group whose leader is our unreaped child"
)]
pub(crate) fn signal_group_of_unreaped_child(
    leader: Pid,
    signal: Option<Signal>,
) -> nix::Result<()> {
    match nix::sys::signal::kill(Pid::from_raw(-leader.as_raw()), signal) {
        Err(Errno::ESRCH) => Ok(()),
        other => other,
    }
}

/// Whether `fd` has something to read right now, without waiting.
pub(crate) fn readable_now(fd: BorrowedFd<'_>) -> bool {
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case("42 (sleep) S 7 42 42 0", 42, 7, false)]
    #[case("43 (a) b) (c) Z 1 43 43 0", 43, 1, true)]
    #[case("44 (with space) R 9 1 1", 44, 9, false)]
    fn stat_lines_parse_after_the_last_paren(
        #[case] line: &str,
        #[case] pid: i32,
        #[case] ppid: i32,
        #[case] zombie: bool,
    ) {
        let stat = parse_stat(line).unwrap();
        assert_eq!(stat.pid, Pid::from_raw(pid));
        assert_eq!(stat.ppid, Pid::from_raw(ppid));
        assert_eq!(stat.zombie, zombie);
    }

    #[rstest]
    #[case("")]
    #[case("garbage")]
    #[case("1 (x)")]
    #[case("x (y) S z")]
    fn garbage_stat_lines_are_rejected(#[case] line: &str) {
        assert_eq!(parse_stat(line), None);
    }

    #[test]
    fn descendant_walk_never_reports_the_root() {
        let me = Pid::from_raw(proc_self_pid());
        assert!(!descendants(None).unwrap().iter().any(|d| d.stat.pid == me));
    }
}
