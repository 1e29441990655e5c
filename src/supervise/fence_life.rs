//! The fence's own life, as a process: it reads its feed (`kill-at`, `group`, `disarm`, and
//! for a fence forked before its target was known, `target`) and fires when the feed ends
//! without a `disarm` or its last deadline passes. The supervisor's side is
//! [`crate::supervise::fence`].

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{SigHandler, SigSet, SigmaskHow, Signal, sigprocmask};
use nix::sys::time::TimeSpec;
use nix::time::{ClockId, clock_gettime};
use nix::unistd::Pid;

use crate::config::LogFormat;
use crate::report;
use crate::supervise::identity::Owner;
use crate::supervise::linux::{self, ProcDir};
use crate::supervise::{cgroup, leftovers};

/// How long the fence waits for what it killed to be gone before it reports and ends.
const GONE_BUDGET: Duration = Duration::from_secs(5);

/// The name the fence gives itself (`/proc/PID/comm`), for an operator's `ps`.
pub(crate) const NAME: &std::ffi::CStr = c"ccci-run-fence";

/// The field separator of a `target` line: none of its fields may hold it, nor a newline.
pub(crate) const TARGET_SEP: char = '\t';

pub(crate) fn clock_ns() -> i128 {
    let now = clock_gettime(ClockId::CLOCK_MONOTONIC).unwrap_or_else(|_| TimeSpec::new(0, 0));
    i128::from(now.tv_sec()) * 1_000_000_000 + i128::from(now.tv_nsec())
}

/// What the fence kills, and how it words its lines.
struct Aim {
    cgroup: Option<PathBuf>,
    owner: Option<Owner>,
    label: String,
}

impl Aim {
    /// From the fence's arguments, or the fields of a `target` line: the cgroup (`-` for none),
    /// the owner, the label and the log format.
    fn parse(cgroup: &OsStr, owner: &str, label: &str, format: &str) -> Self {
        if format == "json" {
            report::init_logging(0, 0, LogFormat::Json);
        }
        Self {
            cgroup: (cgroup != "-").then(|| PathBuf::from(cgroup)),
            owner: Owner::parse(owner),
            label: label.to_owned(),
        }
    }
}

/// The life of a fence started as its own program: `args` are the cgroup (`-` for none), the
/// owner, the lock's label and the log format; the feed comes on stdin.
pub(crate) fn main(args: &[OsString]) -> u8 {
    let [cgroup, owner, label, format] = args else {
        report::line("ccci-run: error: the fence was started with the wrong arguments");
        return crate::exit::USAGE;
    };
    let aim = Aim::parse(
        cgroup,
        &owner.to_string_lossy(),
        &label.to_string_lossy(),
        &format.to_string_lossy(),
    );
    let _ = nix::sys::prctl::set_name(NAME);
    calm_signals();
    serve(Some(aim))
}

/// The life of a fence forked at the program's start: its target comes first on its feed
/// (stdin). A feed that ends before it (the supervisor gone before it had anything to fence)
/// ends it quietly.
pub(crate) fn forked() -> u8 {
    let _ = nix::sys::prctl::set_name(NAME);
    calm_signals();
    serve(None)
}

/// Read the feed (stdin, unbuffered: what is polled is what is read) until it ends, is
/// disarmed, or its deadline passes; then fire, if there is anything to fire at.
fn serve(mut aim: Option<Aim>) -> u8 {
    let mut input = match io::stdin().as_fd().try_clone_to_owned() {
        Ok(fd) => File::from(fd),
        Err(_) => {
            if let Some(aim) = aim {
                fire(
                    Why::Feed,
                    &aim.label,
                    aim.cgroup.as_deref(),
                    aim.owner.as_ref(),
                    &[],
                );
            }
            return 0;
        }
    };
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
        let fd = PollFd::new(input.as_fd(), PollFlags::POLLIN);
        match poll(&mut [fd], timeout) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => {}
            Err(_) => break Why::Feed,
        }
        let mut buf = [0u8; 4096];
        let read = match input.read(&mut buf) {
            Ok(0) => break Why::SupervisorDied,
            Ok(n) => n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break Why::Feed,
        };
        pending.extend_from_slice(&buf[..read]);
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            if let Some(fields) = line.trim_end_matches('\n').strip_prefix("target\t") {
                if let [cgroup, owner, label, format] =
                    fields.split(TARGET_SEP).collect::<Vec<_>>()[..]
                {
                    aim.get_or_insert_with(|| Aim::parse(OsStr::new(cgroup), owner, label, format));
                }
                continue;
            }
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
    // A fence that was never told what to fence has nothing to kill.
    if let Some(aim) = aim {
        fire(
            why,
            &aim.label,
            aim.cgroup.as_deref(),
            aim.owner.as_ref(),
            &groups,
        );
    }
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
