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
//! The fence runs the same binary (`/proc/self/exe`) with [`ARGV_TAG`] as its first argument;
//! [`main`] is all it does. It reads a line protocol on its stdin: `kill-at <ns>` (an instant
//! on `CLOCK_MONOTONIC`, which every process of the host shares), `group <pgid> <start>` (the
//! leader's start time, as `/proc` shows it), `disarm`. Deadlines are absolute, so a feed
//! delayed in the pipe is never read as later than it was.
//!
//! What remains outside it: the whole host frozen (a paused VM) stops the fence too; only a
//! fencing token checked by what the command writes to covers that. A process of a run without
//! a cgroup that scrubbed its environment (`env -i`) and left its group is out of its sight.

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigHandler, SigSet, SigmaskHow, Signal, sigprocmask};
use nix::sys::time::TimeSpec;
use nix::time::{ClockId, clock_gettime};
use nix::unistd::Pid;

pub(crate) use crate::config::KILL_MARGIN;
use crate::report;
use crate::supervise::identity::Owner;
use crate::supervise::linux::{self, ProcDir};
use crate::supervise::{cgroup, leftovers};

/// How long before the lock may lapse the fence kills what is left: half the kill margin, ten
/// times the longest the fence took to leave nothing of a run when measured on a busy host
/// (23 ms; [`KILL_MARGIN`]).
pub(crate) const FENCE_LEAD: Duration = Duration::from_millis(KILL_MARGIN.as_millis() as u64 / 2);

/// The first argument that makes `ccci-run` the fence (not a subcommand: nobody types it).
pub(crate) const ARGV_TAG: &str = "__ccci-run-fence";

/// How long the fence waits for what it killed to be gone before it reports and ends.
const GONE_BUDGET: Duration = Duration::from_secs(5);

/// The pid of this process's fence, while there is one: the supervisor's sweeps of its own
/// descendants leave it alone.
static FENCE_PID: AtomicI32 = AtomicI32::new(0);

/// Whether `pid` is this process's fence.
pub(crate) fn is_fence(pid: Pid) -> bool {
    let fence = FENCE_PID.load(Ordering::SeqCst);
    fence != 0 && fence == pid.as_raw()
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

fn clock_ns() -> i128 {
    let now = clock_gettime(ClockId::CLOCK_MONOTONIC).unwrap_or_else(|_| TimeSpec::new(0, 0));
    i128::from(now.tv_sec()) * 1_000_000_000 + i128::from(now.tv_nsec())
}

/// A running fence, from the supervisor's side.
#[derive(Debug)]
pub(crate) struct Fence {
    child: Child,
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
    /// Start the fence for `target`. It kills nothing until its first deadline comes (or its
    /// supervisor dies before disarming it).
    pub(crate) fn spawn(target: &Target<'_>, json: bool) -> io::Result<Self> {
        let (read, write) = std::io::pipe()?;
        let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
        let mut command = Command::new("/proc/self/exe");
        command
            .arg0(exe.as_os_str())
            .arg(ARGV_TAG)
            .arg(
                target
                    .cgroup
                    .map_or_else(|| OsString::from("-"), Into::into),
            )
            .arg(target.owner.to_string())
            .arg(target.label)
            .arg(if json { "json" } else { "text" })
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
        Ok(Self {
            child,
            feed: Feed(Arc::new(Mutex::new(file)), Arc::new(Mutex::new(None))),
            pidfd,
            disarmed: false,
            guards_lease: false,
        })
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
        // Its end takes a moment; it must not be left a zombie, nor waited for long.
        let fd = PollFd::new(self.pidfd.as_fd(), PollFlags::POLLIN);
        let _ = poll(&mut [fd], PollTimeout::from(1000u16));
        let _ = self.child.try_wait();
        FENCE_PID.store(0, Ordering::SeqCst);
    }
}

impl Drop for Fence {
    fn drop(&mut self) {
        self.disarm_now();
    }
}

fn set_nonblocking(file: &File) -> io::Result<()> {
    use nix::fcntl::{FcntlArg, OFlag, fcntl};
    let flags = OFlag::from_bits_truncate(fcntl(file, FcntlArg::F_GETFL).map_err(io::Error::from)?);
    fcntl(file, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK)).map_err(io::Error::from)?;
    Ok(())
}

/// Whether this process was started as a fence: its arguments after the tag.
pub(crate) fn invoked() -> Option<Vec<OsString>> {
    let mut args = std::env::args_os().skip(1);
    (args.next()? == ARGV_TAG).then(|| args.collect())
}

/// The fence's whole life: `args` are the cgroup (`-` for none), the owner, the lock's label
/// and the log format; the feed comes on stdin.
pub(crate) fn main(args: &[OsString]) -> u8 {
    let [cgroup, owner, label, _format] = args else {
        report::line("ccci-run: error: the fence was started with the wrong arguments");
        return crate::exit::USAGE;
    };
    let cgroup = (cgroup != "-").then(|| PathBuf::from(cgroup));
    let owner = owner.to_str().and_then(Owner::parse);
    let label = label.to_string_lossy().into_owned();
    calm_signals();
    let mut stdin = io::stdin().lock();
    let mut pending = Vec::new();
    let mut kill_at: Option<i128> = None;
    let mut groups: Vec<(Pid, ProcDir)> = Vec::new();
    let why = loop {
        let timeout = match kill_at {
            Some(at) => {
                let left = at - clock_ns();
                if left <= 0 {
                    break Why::Lapse;
                }
                // Round up: waking a moment early only loops.
                let ms = (left + 999_999) / 1_000_000;
                PollTimeout::try_from(ms.clamp(0, i128::from(i32::MAX))).unwrap_or(PollTimeout::MAX)
            }
            None => PollTimeout::NONE,
        };
        let fd = PollFd::new(stdin.as_fd(), PollFlags::POLLIN);
        match poll(&mut [fd], timeout) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => {}
            Err(_) => break Why::Feed,
        }
        let mut buf = [0u8; 4096];
        let read = match stdin.read(&mut buf) {
            Ok(0) => break Why::SupervisorDied,
            Ok(n) => n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break Why::Feed,
        };
        pending.extend_from_slice(&buf[..read]);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let mut words = line.split_whitespace();
            match (words.next(), words.next()) {
                (Some("disarm"), _) => return 0,
                (Some("kill-at"), Some(at)) => {
                    if let Ok(at) = at.parse::<i128>() {
                        kill_at = Some(at);
                    }
                }
                (Some("group"), Some(group)) => {
                    if let Some(held) = hold_leader(group, words.next()) {
                        groups.push(held);
                    }
                }
                _ => {}
            }
        }
    };
    fire(why, &label, cgroup.as_deref(), owner.as_ref(), &groups);
    0
}

/// Ignore what would end or stop the fence but SIGKILL: it must outlive a TERM meant for the
/// run, and it starts with the supervisor's blocked mask.
fn calm_signals() {
    let _ = sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
    for signal in [
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGQUIT,
        Signal::SIGPIPE,
        Signal::SIGTSTP,
        Signal::SIGTTIN,
        Signal::SIGTTOU,
    ] {
        // SAFETY: setting a disposition to "ignore" installs no handler.
        let _ = unsafe { nix::sys::signal::signal(signal, SigHandler::SigIgn) };
    }
}

/// Why the fence fired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    /// Its feed ended: the supervisor died without disarming it.
    SupervisorDied,
    /// The lock's lease was not renewed in time.
    Lapse,
    /// Its feed could not be read.
    Feed,
}

impl Why {
    fn words(self) -> &'static str {
        match self {
            Why::SupervisorDied => {
                "its supervisor died without finishing (SIGKILL, the OOM killer)"
            }
            Why::Lapse => {
                "the lock's lease was not renewed in time (its supervisor is cut off from etcd, \
                 or stopped)"
            }
            Why::Feed => "its feed could not be read",
        }
    }
}

/// The leader of a group the supervisor started, held by its `/proc` directory, when the
/// process now at that pid is the one started at `start`; `None` otherwise.
fn hold_leader(group: &str, start: Option<&str>) -> Option<(Pid, ProcDir)> {
    let group = group.parse::<i32>().ok().filter(|g| *g > 1)?;
    let start = start?.parse::<u64>().ok()?;
    let dir = ProcDir::open(group)?;
    (dir.start_ticks() == Some(start)).then(|| (Pid::from_raw(group), dir))
}

/// Kill everything the run started that the kernel proves is the run's, and say so.
fn fire(
    why: Why,
    label: &str,
    cgroup: Option<&std::path::Path>,
    owner: Option<&Owner>,
    groups: &[(Pid, ProcDir)],
) {
    let started = Instant::now();
    let until = started + GONE_BUDGET;
    if let Some(dir) = cgroup {
        let _ = cgroup::kill_path(dir);
    }
    let mut left = Vec::new();
    loop {
        // A group is killed only while its leader still exists: then its id is still its own.
        for (group, leader) in groups {
            linux::signal_group_members(*group, Signal::SIGKILL, || leader.stat().is_some());
        }
        let Some(owner) = owner else { break };
        let marked = leftovers::scan_owned_by(owner);
        if marked.is_empty() {
            left.clear();
            break;
        }
        // A process that forked while it was killed: the next pass finds its child.
        let refs: Vec<&leftovers::Marked> = marked.iter().collect();
        left = leftovers::kill_and_wait(&refs, until);
        if Instant::now() >= until {
            break;
        }
    }
    if let Some(dir) = cgroup {
        while cgroup::population(dir) > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let gone = if left.is_empty() && cgroup.is_none_or(|d| cgroup::population(d) == 0) {
        format!(
            "all gone in {:.1} ms",
            started.elapsed().as_secs_f64() * 1000.0
        )
    } else {
        format!("still running after {} s: {left:?}", GONE_BUDGET.as_secs())
    };
    let words = why.words();
    match why {
        Why::Lapse => report::line(&format!(
            "!! fence of {label}: {words} — killed the run's processes before the lock can pass \
             to another holder ({gone})"
        )),
        Why::SupervisorDied | Why::Feed => report::line(&format!(
            "!! dead-man of {label}: {words} — killed every process of it ({gone})"
        )),
    }
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
