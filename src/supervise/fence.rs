//! The fence, a run's dead-man: a small process of the run's own that kills what the run
//! started the moment its supervisor dies without finishing (SIGKILL, the OOM killer, a crash),
//! and, for a lock that can lapse, once that lock may lapse, whatever the supervisor is doing.
//!
//! Every run and every `lock` command has one, started before its command. The supervisor holds
//! the write end of the fence's stdin; the kernel closes it when the supervisor dies, however
//! it dies, and the fence reads the end of its feed at once. Nothing else needs to run: no
//! janitor, no timer. So a run's daemonised processes, which would hold a Drone step's output
//! open and keep the build running until a janitor came, end with the supervisor.
//!
//! A lock kept in etcd lapses when its lease is not renewed: the holder cut off from the
//! cluster, or its supervisor stopped (SIGSTOP, swapping, CPU starvation), stops renewing it,
//! and another host may take the lock the moment etcd expires the lease. The supervisor itself
//! stops its command in time while it runs (the lease counts as lost a stop budget early), but
//! a stopped supervisor stops nothing. So the fence runs in a session of its own (a SIGSTOP of
//! the supervisor's process group does not reach it), and the supervisor feeds it, after every
//! renewal, the instant by which the command must be gone: the earliest instant etcd may expire
//! the lease, less [`FENCE_LEAD`]. When that instant passes without a newer one, the fence
//! fires too; its end is then the supervisor's sign that the guarantee is gone: it watches the
//! fence's pidfd as a lock loss.
//!
//! What it kills, only what the kernel proves to be the run's, each through a pidfd or a
//! `/proc` directory, never by a bare number: the run's cgroup (`cgroup.kill`); without one,
//! every process that names the supervisor in `CCCI_SUPERVISOR`
//! ([`crate::supervise::leftovers`]), and the members of each process group the supervisor
//! started whose leader the fence holds and still exists (a group's id is its leader's pid,
//! which cannot be reused while the leader exists: a group whose leader is gone may be an
//! unrelated process's by now, and is left alone). It says so on stderr and ends.
//!
//! The fence is forked as the program starts, while it has one thread ([`prefork`]), and told
//! its target (`target` line) when the lock is held; where it cannot be, it is the same binary
//! (`/proc/self/exe`) started with [`ARGV_TAG`] as its first argument, and its target in its
//! arguments. Either way `crate::supervise::fence_life` is all it does, and it names itself
//! `ccci-run-fence`. It reads a line protocol on its stdin: `kill-at <ns>` (an instant
//! on `CLOCK_MONOTONIC`, which every process of the host shares), `group <pgid> <start>` (the
//! leader's start time, as `/proc` shows it), `disarm`. Deadlines are absolute, so a feed
//! delayed in the pipe is never read as later than it was.
//!
//! What remains outside it: the whole host frozen (a paused VM) stops the fence too; only a
//! fencing token checked by what the command writes to covers that. A process of a run without
//! a cgroup that scrubbed its environment (`env -i`) and left its group is out of its sight.

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use nix::fcntl::{FcntlArg, FdFlag, OFlag, fcntl};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::wait::{WaitPidFlag, waitpid};
use nix::unistd::{ForkResult, Pid};

pub(crate) use crate::config::KILL_MARGIN;
use crate::supervise::fence_life::{self, TARGET_SEP, clock_ns};
use crate::supervise::identity::Owner;
use crate::supervise::leftovers;

/// How long before the lock may lapse the fence kills what is left: half the kill margin, ten
/// times the longest the fence took to leave nothing of a run when measured on a busy host
/// (23 ms; [`KILL_MARGIN`]).
pub(crate) const FENCE_LEAD: Duration = Duration::from_millis(KILL_MARGIN.as_millis() as u64 / 2);

/// The first argument that makes `ccci-run` the fence (not a subcommand: nobody types it).
pub(crate) const ARGV_TAG: &str = "__ccci-run-fence";

/// The pid of this process's fence, while there is one: the supervisor's sweeps of its own
/// descendants leave it alone.
static FENCE_PID: AtomicI32 = AtomicI32::new(0);

/// This process's fence as `/proc` numbers it, while it is our child: `None` without one, or
/// where `/proc` numbers processes otherwise than our pid namespace does (it belongs to an
/// enclosing one), so that the number could be another process's there.
pub(crate) fn in_proc() -> Option<Pid> {
    let fence = FENCE_PID.load(Ordering::SeqCst);
    (fence != 0 && crate::supervise::linux::proc_self_pid() == std::process::id() as i32)
        .then(|| Pid::from_raw(fence))
}

/// Nanoseconds of `CLOCK_MONOTONIC` at `at` (std's `Instant` is that clock on Linux).
fn monotonic_ns(at: Instant) -> i128 {
    let now = Instant::now();
    let base = clock_ns();
    if at >= now {
        base + i128::try_from(at.duration_since(now).as_nanos()).unwrap_or(i128::MAX / 2)
    } else {
        base - i128::try_from(now.duration_since(at).as_nanos()).unwrap_or(i128::MAX / 2)
    }
}

/// A running fence, from the supervisor's side.
#[derive(Debug)]
pub(crate) struct Fence {
    pid: Pid,
    feed: Feed,
    /// Readable once the fence has ended.
    pidfd: OwnedFd,
    disarmed: bool,
    /// It guards a lock that can lapse: its end is that lock's loss.
    guards_lease: bool,
}

/// What the supervisor writes to its fence, and the last deadline written; cloned into
/// whatever passes renewals on.
#[derive(Debug, Clone)]
pub(crate) struct Feed(Arc<Mutex<File>>, Arc<Mutex<Option<Instant>>>);

impl Feed {
    /// The run's processes must be gone by `at` (the lock's earliest lapse less the margin).
    pub(crate) fn kill_at(&self, at: Instant) {
        *self.1.lock().unwrap_or_else(PoisonError::into_inner) = Some(at);
        self.send(&format!("kill-at {}\n", monotonic_ns(at)));
    }

    /// The lock may lapse at `expiry`: what the run started must be gone by then. The
    /// supervisor's own SIGKILL comes [`KILL_MARGIN`] before it; the fence acts only after
    /// that, [`FENCE_LEAD`] before it: a supervisor that runs always stops its command itself.
    pub(crate) fn expires_at(&self, expiry: Instant) {
        self.kill_at(expiry.checked_sub(FENCE_LEAD).unwrap_or(expiry));
    }

    fn send(&self, line: &str) {
        let mut file = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        // Non-blocking: a fence that does not read (stopped itself) never stalls the
        // supervisor; it acts on the last deadline it read, which is never later than ours.
        if let Err(err) = file.write_all(line.as_bytes()) {
            tracing::debug!("could not feed the fence: {err}");
        }
    }
}

/// What the fence kills.
pub(crate) struct Target<'a> {
    /// The run's cgroup (its `cgroup.kill` ends every process in it).
    pub cgroup: Option<&'a std::path::Path>,
    /// The supervisor, as its processes name it in `CCCI_SUPERVISOR`.
    pub owner: &'a Owner,
    /// The run or the lock, for its lines.
    pub label: &'a str,
}

impl Fence {
    /// Start the fence for `target`: the one forked at the program's start ([`prefork`]), told
    /// its target now, or else a new one. It kills nothing until its first deadline comes (or
    /// its supervisor dies before disarming it).
    pub(crate) fn spawn(target: &Target<'_>, json: bool) -> io::Result<Self> {
        let format = if json { "json" } else { "text" };
        let cgroup = target
            .cgroup
            .map_or_else(|| OsString::from("-"), Into::into);
        if let Some(fence) = Self::told(target, &cgroup, format) {
            return Ok(fence);
        }
        let (read, write) = std::io::pipe()?;
        let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
        let mut command = Command::new("/proc/self/exe");
        command
            .arg0(exe.as_os_str())
            .arg(ARGV_TAG)
            .arg(&cgroup)
            .arg(target.owner.to_string())
            .arg(target.label)
            .arg(format)
            .stdin(Stdio::from(OwnedFd::from(read)))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            // Never killed with the command it fences, nor stopped with the supervisor's group.
            .env_remove(leftovers::SUPERVISOR_VAR);
        // SAFETY: setsid is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            command.pre_exec(|| {
                nix::unistd::setsid().map_err(io::Error::from)?;
                Ok(())
            });
        }
        let child = command.spawn()?;
        let pid = Pid::from_raw(i32::try_from(child.id()).unwrap_or(0));
        let pidfd = crate::supervise::linux::pidfd_open(pid)?;
        let file = File::from(OwnedFd::from(write));
        set_nonblocking(&file)?;
        FENCE_PID.store(pid.as_raw(), Ordering::SeqCst);
        Ok(Self::new(pid, pidfd, file))
    }

    fn new(pid: Pid, pidfd: OwnedFd, feed: File) -> Self {
        Self {
            pid,
            feed: Feed(Arc::new(Mutex::new(feed)), Arc::new(Mutex::new(None))),
            pidfd,
            disarmed: false,
            guards_lease: false,
        }
    }

    /// The fence forked at the start, told `target`: `None` when there is none, or it cannot
    /// be told (it is gone, or a field would not survive the line), and a new one must start.
    fn told(target: &Target<'_>, cgroup: &OsString, format: &str) -> Option<Self> {
        let mut waiting = PREFORKED
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()?;
        let owner = target.owner.to_string();
        let line = cgroup.to_str().and_then(|cgroup| {
            let fields = [cgroup, owner.as_str(), target.label, format];
            let fit = fields
                .iter()
                .all(|f| !f.contains(TARGET_SEP) && !f.contains('\n'));
            fit.then(|| {
                format!(
                    "target{TARGET_SEP}{}\n",
                    fields.join(&TARGET_SEP.to_string())
                )
            })
        });
        // One write below PIPE_BUF into an empty pipe: whole, or not at all. A fence already
        // gone (killed) fails it with EPIPE.
        match line.map(|line| waiting.feed.write_all(line.as_bytes())) {
            Some(Ok(())) => Some(Self::new(waiting.pid, waiting.pidfd, waiting.feed)),
            // It cannot be told: it ends, and a new one starts.
            _ => {
                waiting.end();
                None
            }
        }
    }

    /// From now on its end counts as the loss of the lock it guards ([`Fence::ended`]).
    pub(crate) fn guard_lease(&mut self) {
        self.guards_lease = true;
    }

    /// A handle to feed it renewals.
    pub(crate) fn feed(&self) -> Feed {
        self.feed.clone()
    }

    /// Kill process group `group` too, when the time comes (a host without cgroups). `group`
    /// is the id of a group whose leader is our child, not yet reaped: its start time, read
    /// now, lets the fence hold that very process.
    pub(crate) fn watch_group(&self, group: Pid) {
        let start = crate::supervise::linux::ProcDir::open(group.as_raw())
            .and_then(|dir| dir.start_ticks());
        if let Some(start) = start {
            self.feed
                .send(&format!("group {} {start}\n", group.as_raw()));
        }
    }

    /// A descriptor that turns readable when the fence has ended: before [`Fence::disarm`],
    /// that means it fired (or was killed), and the lock's guarantee is gone.
    pub(crate) fn ended_fd(&self) -> io::Result<OwnedFd> {
        self.pidfd.try_clone()
    }

    /// Whether the lock it guards is gone for sure: it guards one that can lapse, and has ended
    /// (fired, or was killed). A dead-man of a lock that cannot lapse is no lock's guarantee.
    pub(crate) fn ended(&self) -> bool {
        self.guards_lease && crate::supervise::linux::readable_now(self.pidfd.as_fd())
    }

    /// Whether the fence has ended, or the last deadline it was given has passed (it kills,
    /// or is about to): what the run started may have been killed by it, not by its command's
    /// own doing, and the lock is no longer ours for sure.
    pub(crate) fn fired(&self) -> bool {
        let deadline = *self.feed.1.lock().unwrap_or_else(PoisonError::into_inner);
        !self.disarmed && (self.ended() || deadline.is_some_and(|at| Instant::now() >= at))
    }

    /// The run is over and its lock released: the fence ends without killing anything.
    fn disarm_now(&mut self) {
        if self.disarmed {
            return;
        }
        self.disarmed = true;
        self.feed.send("disarm\n");
        reap(self.pid, &self.pidfd);
    }
}

/// Wait briefly for fence `pid` (its pidfd `pidfd`), told to end, to be gone, and reap it: its
/// end takes a moment, and it must not be left a zombie, nor waited for long. It is this
/// process's fence no more.
fn reap(pid: Pid, pidfd: &OwnedFd) {
    let fd = PollFd::new(pidfd.as_fd(), PollFlags::POLLIN);
    let _ = poll(&mut [fd], PollTimeout::from(1000u16));
    let _ = waitpid(pid, Some(WaitPidFlag::WNOHANG));
    let _ = FENCE_PID.compare_exchange(pid.as_raw(), 0, Ordering::SeqCst, Ordering::SeqCst);
}

impl Drop for Fence {
    fn drop(&mut self) {
        self.disarm_now();
    }
}

fn set_nonblocking(file: &File) -> io::Result<()> {
    let flags = OFlag::from_bits_truncate(fcntl(file, FcntlArg::F_GETFL).map_err(io::Error::from)?);
    fcntl(file, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK)).map_err(io::Error::from)?;
    Ok(())
}

/// A fence forked at the program's start, waiting for its target.
struct Preforked {
    pid: Pid,
    pidfd: OwnedFd,
    feed: File,
}

static PREFORKED: Mutex<Option<Preforked>> = Mutex::new(None);

/// Fork this run's fence now, while the program has one thread: a fork needs no second start of
/// the program then (about 3 ms of CPU, on the way from a lock taken to its command), and the
/// child may run any code. Called once the process runs as the user it works as (a root that
/// becomes the runner's user has become it): the fence has no rights the supervisor has not. It
/// waits for its target ([`Fence::spawn`]); a supervisor that ends before it has one ends it
/// with the feed.
///
/// Returns the child's exit code in the child, `None` in this process. Nothing is forked, and
/// the fence is started as its own program when the time comes, when this process already has
/// more threads, or when it is a process of another run (`CCCI_SUPERVISOR` in its environment:
/// a started fence leaves that mark behind, a forked one cannot), or when the fork fails.
pub(crate) fn prefork() -> Option<u8> {
    if crate::config::env::var_os(leftovers::SUPERVISOR_VAR).is_some() || !single_threaded() {
        return None;
    }
    let (read, write) = std::io::pipe().ok()?;
    if read.as_raw_fd() <= 2 || write.as_raw_fd() <= 2 {
        // Started with a standard descriptor closed, which the pipe took: ours stays as it is.
        return None;
    }
    // SAFETY: this process has one thread (checked just above), so the child is a whole copy of
    // it and may run any code.
    match unsafe { nix::unistd::fork() } {
        Err(_) => None,
        Ok(ForkResult::Child) => {
            drop(write);
            as_started(read);
            Some(fence_life::forked())
        }
        Ok(ForkResult::Parent { child }) => {
            drop(read);
            let file = File::from(OwnedFd::from(write));
            match (
                crate::supervise::linux::pidfd_open(child),
                set_nonblocking(&file),
            ) {
                (Ok(pidfd), Ok(())) => {
                    FENCE_PID.store(child.as_raw(), Ordering::SeqCst);
                    *PREFORKED.lock().unwrap_or_else(PoisonError::into_inner) = Some(Preforked {
                        pid: child,
                        pidfd,
                        feed: file,
                    });
                }
                _ => {
                    // Its feed ends here; it ends with it.
                    drop(file);
                    let _ = waitpid(child, None);
                }
            }
            None
        }
    }
}

impl Preforked {
    /// End it (its feed ends before any target) and reap it.
    fn end(self) {
        drop(self.feed);
        reap(self.pid, &self.pidfd);
    }
}

/// End the fence forked at the start if it was never told a target, and wait for it: a
/// command that ends without running anything under a lock leaves no process behind.
pub(crate) fn dismiss() {
    let waiting = PREFORKED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    if let Some(waiting) = waiting {
        waiting.end();
    }
}

/// Whether this process has one thread.
fn single_threaded() -> bool {
    std::fs::read_dir("/proc/self/task").is_ok_and(|tasks| tasks.count() == 1)
}

/// In the forked child: what a start as its own program would have left it with. A session of
/// its own (never stopped with the supervisor's group), its feed on stdin, stdout on
/// `/dev/null`, and none of the descriptors an exec would have closed.
fn as_started(feed: std::io::PipeReader) {
    let _ = nix::unistd::setsid();
    let _ = nix::unistd::dup2_stdin(&feed);
    drop(feed);
    // A process started with its stdout closed gets that number for `/dev/null`.
    if let Ok(null) = nix::fcntl::open("/dev/null", OFlag::O_WRONLY, nix::sys::stat::Mode::empty())
    {
        if null.as_raw_fd() == 1 {
            std::mem::forget(null);
        } else {
            let _ = nix::unistd::dup2_stdout(null);
        }
    }
    let open: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .collect();
    for fd in open.into_iter().filter(|fd| *fd > 2) {
        // SAFETY: borrowed for one fcntl; `fd` was open when listed, and nothing else in this
        // one-threaded child closes it meanwhile (a closed one fails the fcntl).
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let cloexec = fcntl(borrowed, FcntlArg::F_GETFD)
            .is_ok_and(|flags| FdFlag::from_bits_truncate(flags).contains(FdFlag::FD_CLOEXEC));
        if cloexec {
            // SAFETY: an exec would close it; nothing in the fence uses it.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
}

/// The life of a fence started as its own program.
pub(crate) use fence_life::main;

/// Whether this process was started as a fence: its arguments after the tag.
pub(crate) fn invoked() -> Option<Vec<OsString>> {
    let mut args = std::env::args_os().skip(1);
    (args.next()? == ARGV_TAG).then(|| args.collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_monotonic_instant_converts_both_ways_round_the_present() {
        let now = Instant::now();
        let later = now + Duration::from_secs(3);
        let earlier = now.checked_sub(Duration::from_secs(3)).unwrap();
        let (n, l, e) = (
            monotonic_ns(now),
            monotonic_ns(later),
            monotonic_ns(earlier),
        );
        assert!((l - n - 3_000_000_000).abs() < 50_000_000, "{n} {l}");
        assert!((n - e - 3_000_000_000).abs() < 50_000_000, "{n} {e}");
    }
}
