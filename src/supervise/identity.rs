//! Whose is it: the one judgement of "is this supervisor dead", and the names that let anyone
//! ask it, in any namespace.
//!
//! A supervisor names itself for good with a [`ProcessIdentity`]: this boot's id, its pid
//! namespace (the inode of `/proc/self/ns/pid`), its pid there, and its start time in clock
//! ticks since boot. `/proc/<pid>/stat` shows that start time shifted by the *reader's* time
//! namespace boottime offset (`/proc/self/timens_offsets`), so the identity records it with the
//! recorder's offset taken out, and a judge takes out its own before comparing: two processes in
//! different time namespaces agree on it. A [`Scope`] names the configuration that made
//! something (the runs dir's device and inode), and an [`Owner`] is both: the text a run's cgroup
//! carries in its name and every process it starts carries in `CCCI_SUPERVISOR`.
//!
//! A [`Judge`] says [`Verdict::Dead`] only when it can prove it: the recorded process is in a
//! pid namespace its `/proc` shows, and no process there has that pid with that start time (or
//! it is a zombie), or the judge sees every process of the host and none is in that namespace.
//! Anything else — another host, another boot, a pid namespace this `/proc` does not show (an
//! enclosing or sibling container's), a `/proc` that hides processes — is
//! [`Verdict::Unresolvable`], with the reason: never dead, never killed.
//!
//! Invariant: a Dead verdict is only ever given for a process that was recorded before the
//! judge looked; a judge is therefore built after what it judges was collected (a cgroup found,
//! a marker read), and its view of `/proc` is taken at its first question.

use std::cell::OnceCell;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::OnceLock;
use std::{fmt, io};

use serde::{Deserialize, Serialize};

use crate::supervise::linux;

/// A process, named for good: it cannot be mistaken for another after its pid is reused, and
/// it means the same to a reader in another pid or time namespace.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) struct ProcessIdentity {
    /// Its pid in its own pid namespace (what `getpid` says there).
    pub pid: i32,
    /// Its start time in clock ticks since boot, the time-namespace offset taken out.
    pub start_ticks: u64,
    /// The inode of its pid namespace.
    pub pid_ns: u64,
    /// The boot of the kernel it runs on (`/proc/sys/kernel/random/boot_id`).
    pub boot_id: String,
}

/// What a judge can say about a recorded process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    Alive,
    Dead,
    /// The judge cannot tell from where it stands, and says why.
    Unresolvable(String),
}

/// Why this process cannot name itself.
#[derive(Debug, Clone, thiserror::Error)]
#[error("failed to establish this process's identity: {0}")]
pub(crate) struct IdentityError(String);

/// Where this process stands: read once, since a process's namespaces never change under it
/// (ccci-run never calls `setns` or `unshare`).
#[derive(Debug)]
struct Here {
    boot_id: String,
    pid_ns: Result<u64, String>,
    /// `/proc` is mounted for our own pid namespace: `/proc/<pid>` is our pid `<pid>`.
    proc_is_own: bool,
    /// `/proc` is the initial pid namespace's: every process of the host is in it.
    proc_is_init: bool,
    /// Our time namespace's boottime offset, in clock ticks.
    offset_ticks: Result<i128, String>,
    /// Why `/proc` may not show every process to us.
    hidden: Option<String>,
}

impl Here {
    fn get() -> &'static Here {
        static HERE: OnceLock<Here> = OnceLock::new();
        HERE.get_or_init(|| {
            let pid_ns = linux::pid_namespace("self")
                .map_err(|e| format!("failed to read /proc/self/ns/pid: {e}"));
            let depth = crate::files::kernel_text("/proc/self/status")
                .ok()
                .and_then(|s| crate::supervise::procfs::parse_nspid(&s))
                .map(|p| p.len());
            // `/proc/1` of a proc mount is the init of the namespace it was mounted for.
            let init_ns = linux::pid_namespace("1").ok();
            Here {
                boot_id: linux::boot_id(),
                pid_ns,
                proc_is_own: depth == Some(1),
                proc_is_init: init_ns == Some(crate::supervise::procfs::INIT_PID_NAMESPACE),
                offset_ticks: own_offset_ticks(),
                // Root sees every process, whatever `hidepid` says: nothing to read for it.
                hidden: (!nix::unistd::Uid::effective().is_root())
                    .then(|| crate::files::kernel_text("/proc/self/mountinfo").ok())
                    .flatten()
                    .and_then(|m| crate::supervise::procfs::proc_hidepid(&m)),
            }
        })
    }
}

/// Our time namespace's boottime offset in clock ticks. `/proc/self/timens_offsets` shows the
/// offsets of the namespace our *children* get; after `execve` that is our own (the kernel
/// moves an exec'ing process into it), and where the two differ the offset is not known.
fn own_offset_ticks() -> Result<i128, String> {
    let own = linux::own_namespace_link("time");
    if own != linux::own_namespace_link("time_for_children") {
        return Err(format!(
            "this process's time namespace ({}) is not the one /proc/self/timens_offsets \
             describes, so its boottime offset is unknown",
            own.map_or("?".to_owned(), |p| p.display().to_string())
        ));
    }
    let nanos = match crate::files::kernel_text("/proc/self/timens_offsets") {
        Ok(text) => crate::supervise::procfs::parse_boottime_offset(&text)
            .ok_or_else(|| "failed to parse /proc/self/timens_offsets".to_owned())?,
        // A kernel without time namespaces: no offset.
        Err(err) if err.kind() == io::ErrorKind::NotFound => 0,
        Err(err) => return Err(format!("failed to read /proc/self/timens_offsets: {err}")),
    };
    Ok(nanos.div_euclid(1_000_000_000 / linux::clock_ticks_per_second()))
}

/// A start time read from `/proc` by this process, with our time namespace's offset taken out.
fn normalise(raw: u64, offset_ticks: i128) -> u64 {
    (i128::from(raw) - offset_ticks).clamp(0, i128::from(u64::MAX)) as u64
}

impl ProcessIdentity {
    /// This process.
    pub(crate) fn own() -> Result<&'static ProcessIdentity, IdentityError> {
        static OWN: OnceLock<Result<ProcessIdentity, IdentityError>> = OnceLock::new();
        OWN.get_or_init(|| {
            let here = Here::get();
            let pid_ns = here.pid_ns.clone().map_err(IdentityError)?;
            let offset = here.offset_ticks.clone().map_err(IdentityError)?;
            let raw = crate::files::kernel_text("/proc/self/stat")
                .ok()
                .and_then(|s| crate::supervise::procfs::parse_start_time(&s))
                .ok_or_else(|| IdentityError("failed to read /proc/self/stat".to_owned()))?;
            Ok(ProcessIdentity {
                pid: std::process::id() as i32,
                start_ticks: normalise(raw, offset),
                pid_ns,
                boot_id: here.boot_id.clone(),
            })
        })
        .as_ref()
        .map_err(Clone::clone)
    }

    /// Judge this one process now.
    pub(crate) fn judge(&self) -> Verdict {
        Judge::new().judge(self)
    }

    /// "pid 3 in pid:[4026532211]"
    pub(crate) fn describe(&self) -> String {
        format!("pid {} in pid:[{}]", self.pid, self.pid_ns)
    }
}

/// One process as a full look at `/proc` saw it.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// Its start time as we read it (our time namespace's offset still in).
    raw_start: u64,
    zombie: bool,
    /// Its pid as our `/proc` numbers it.
    local: i32,
}

/// Every process `/proc` shows, by (pid namespace, pid there).
#[derive(Debug, Default)]
struct Table {
    by_pid: HashMap<(u64, i32), Seen>,
    namespaces: HashSet<u64>,
    /// Every living process's namespace could be read: an absence proves something.
    complete: bool,
}

impl Table {
    fn read() -> Self {
        let mut table = Table {
            complete: Here::get().hidden.is_none(),
            ..Table::default()
        };
        for pid in linux::all_pids() {
            let pid = pid.as_raw();
            // Gone meanwhile: a process that exited is simply not there.
            let Some(dir) = linux::ProcDir::open(pid) else {
                continue;
            };
            let Ok(stat) = dir.read("stat") else { continue };
            let stat = String::from_utf8_lossy(&stat);
            let (Some(raw_start), Some(parsed)) = (
                crate::supervise::procfs::parse_start_time(&stat),
                linux::parse_stat(&stat),
            ) else {
                continue;
            };
            let ns = dir.pid_namespace();
            let nspid = dir
                .read("status")
                .ok()
                .and_then(|s| crate::supervise::procfs::parse_nspid(&String::from_utf8_lossy(&s)))
                .and_then(|p| p.last().copied());
            match (ns, nspid) {
                (Ok(ns), Some(nspid)) => {
                    table.namespaces.insert(ns);
                    table.by_pid.insert(
                        (ns, nspid),
                        Seen {
                            raw_start,
                            zombie: parsed.zombie,
                            local: pid,
                        },
                    );
                }
                // A zombie has ended: whatever it was, it is no living supervisor.
                _ if parsed.zombie => {}
                (Err(err), _) if err.kind() == io::ErrorKind::NotFound => {}
                _ => table.complete = false,
            }
        }
        table
    }
}

/// Judges processes against one view of `/proc`, taken at its first question that needs more
/// than one process's file. Build it after collecting what it is to judge.
#[derive(Debug, Default)]
pub(crate) struct Judge {
    table: OnceCell<Table>,
}

/// Start times closer than this are the same process: a time-namespace offset that is not a
/// whole number of ticks rounds differently for two readers, and no pid is reused within a
/// tick of its last holder's start (the kernel hands pids out round the whole pid space).
const START_TOLERANCE: u64 = 1;

impl Judge {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(crate) fn judge(&self, who: &ProcessIdentity) -> Verdict {
        self.locate(who).0
    }

    /// The recorded process's directory in our `/proc`, opened and checked to be that very
    /// process (its start time read through the open directory, so a pid reused meanwhile is
    /// never taken for it): what a signal meant for it alone goes through. `Err` is the verdict
    /// when it is not alive, or cannot be judged from here.
    pub(crate) fn open(&self, who: &ProcessIdentity) -> Result<linux::ProcDir, Verdict> {
        let (verdict, local) = self.locate(who);
        let Some(local) = local.filter(|_| verdict == Verdict::Alive) else {
            return Err(verdict);
        };
        let dir = linux::ProcDir::open(local).ok_or(Verdict::Dead)?;
        let offset = Here::get()
            .offset_ticks
            .clone()
            .map_err(Verdict::Unresolvable)?;
        let stat = dir.read("stat").map_err(|_| Verdict::Dead)?;
        let stat = String::from_utf8_lossy(&stat);
        match (
            crate::supervise::procfs::parse_start_time(&stat),
            linux::parse_stat(&stat),
        ) {
            (Some(raw), Some(parsed))
                if !parsed.zombie
                    && normalise(raw, offset).abs_diff(who.start_ticks) <= START_TOLERANCE =>
            {
                Ok(dir)
            }
            _ => Err(Verdict::Dead),
        }
    }

    /// The verdict, and the process's pid in our `/proc` when it was found there.
    fn locate(&self, who: &ProcessIdentity) -> (Verdict, Option<i32>) {
        let here = Here::get();
        if who.boot_id != here.boot_id {
            let why = format!(
                "recorded under boot id {} (this is {}): on another host, or before a reboot",
                or_unknown(&who.boot_id),
                or_unknown(&here.boot_id)
            );
            return (Verdict::Unresolvable(why), None);
        }
        let offset = match &here.offset_ticks {
            Ok(offset) => *offset,
            Err(why) => return (Verdict::Unresolvable(why.clone()), None),
        };
        let own_ns = match &here.pid_ns {
            Ok(ns) => *ns,
            Err(why) => return (Verdict::Unresolvable(why.clone()), None),
        };
        let compare = |seen: Seen| {
            let start = normalise(seen.raw_start, offset);
            if seen.zombie || start.abs_diff(who.start_ticks) > START_TOLERANCE {
                (Verdict::Dead, None)
            } else {
                (Verdict::Alive, Some(seen.local))
            }
        };
        if who.pid_ns == own_ns && here.proc_is_own {
            // The common case, one file: `/proc/<pid>` is the recorded pid in our namespace.
            return match crate::files::kernel_text(format!("/proc/{}/stat", who.pid)) {
                Ok(text) => match (
                    crate::supervise::procfs::parse_start_time(&text),
                    linux::parse_stat(&text),
                ) {
                    (Some(raw_start), Some(stat)) => compare(Seen {
                        raw_start,
                        zombie: stat.zombie,
                        local: who.pid,
                    }),
                    _ => (
                        Verdict::Unresolvable(format!("failed to parse /proc/{}/stat", who.pid)),
                        None,
                    ),
                },
                Err(err)
                    if err.kind() == io::ErrorKind::NotFound
                        || err.raw_os_error() == Some(nix::libc::ESRCH) =>
                {
                    let verdict = match &here.hidden {
                        Some(why) => Verdict::Unresolvable(format!(
                            "{} is not in /proc, but {why}",
                            who.describe()
                        )),
                        None => Verdict::Dead,
                    };
                    (verdict, None)
                }
                Err(err) => (
                    Verdict::Unresolvable(format!("failed to read /proc/{}/stat: {err}", who.pid)),
                    None,
                ),
            };
        }
        let table = self.table.get_or_init(Table::read);
        if let Some(seen) = table.by_pid.get(&(who.pid_ns, who.pid)) {
            return compare(*seen);
        }
        let verdict = if !table.complete {
            Verdict::Unresolvable(format!(
                "{} is not among the processes this judge can see, and some processes' \
                 namespaces could not be read here",
                who.describe()
            ))
        } else if table.namespaces.contains(&who.pid_ns) {
            // Its namespace lives and shows every process it has: that pid is not among them.
            Verdict::Dead
        } else if here.proc_is_init {
            // Every process of the host is visible here, and none is in that namespace.
            Verdict::Dead
        } else {
            Verdict::Unresolvable(format!(
                "{} is in a pid namespace this judge (in pid:[{own_ns}]) cannot see into",
                who.describe()
            ))
        };
        (verdict, None)
    }
}

fn or_unknown(text: &str) -> &str {
    if text.is_empty() { "(unknown)" } else { text }
}

/// The configuration something belongs to: the runs dir's device and inode. Two
/// configurations on one host (a second runner, a test suite on a runner host) have two runs
/// dirs; a janitor touches the leftovers of its own only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Scope {
    dev: u64,
    ino: u64,
}

impl Scope {
    /// The scope of the configuration whose runs dir is `runs_dir` (it must exist).
    pub(crate) fn of_runs_dir(runs_dir: &Path) -> io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(runs_dir)?;
        Ok(Self {
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }

    pub(crate) fn parse(text: &str) -> Option<Self> {
        let (dev, ino) = text.strip_prefix('c')?.split_once('.')?;
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(dev) || !digits(ino) {
            return None;
        }
        Some(Self {
            dev: dev.parse().ok()?,
            ino: ino.parse().ok()?,
        })
    }
}

/// `c<dev>.<ino>`
impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "c{}.{}", self.dev, self.ino)
    }
}

impl Serialize for Scope {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Scope {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Self::parse(&text).ok_or_else(|| serde::de::Error::custom("not a scope (c<dev>.<ino>)"))
    }
}

/// A supervisor and the configuration it works for: what its cgroup's name ends with and what
/// every process it starts carries in `CCCI_SUPERVISOR`, as `<pid>-<start>-<pidns>-c<dev>.<ino>`.
/// Cgroups and environments do not outlive a boot, so the boot is this one.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Owner {
    pub process: ProcessIdentity,
    pub scope: Scope,
}

static ESTABLISHED: OnceLock<Owner> = OnceLock::new();

impl Owner {
    /// This process working for the configuration whose runs dir is `runs_dir`, which must
    /// exist. Set once per process, before it starts anything; later calls return it.
    pub(crate) fn establish(runs_dir: &Path) -> Result<&'static Owner, IdentityError> {
        if let Some(owner) = ESTABLISHED.get() {
            return Ok(owner);
        }
        let process = ProcessIdentity::own()?.clone();
        let scope = Scope::of_runs_dir(runs_dir).map_err(|e| {
            IdentityError(format!(
                "failed to inspect runs dir {} (its device and inode name this configuration): {e}",
                runs_dir.display()
            ))
        })?;
        Ok(ESTABLISHED.get_or_init(|| Owner { process, scope }))
    }

    /// The owner [`Owner::establish`] set, if it was.
    pub(crate) fn established() -> Option<&'static Owner> {
        ESTABLISHED.get()
    }

    /// Parse `<pid>-<start>-<pidns>-c<dev>.<ino>`: this boot's.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        let mut fields = text.rsplitn(4, '-');
        let scope = Scope::parse(fields.next()?)?;
        let number = |s: &str| -> Option<u64> {
            (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse().ok())
                .flatten()
        };
        let pid_ns = number(fields.next()?)?;
        let start_ticks = number(fields.next()?)?;
        let pid = i32::try_from(number(fields.next()?)?)
            .ok()
            .filter(|p| *p > 0)?;
        Some(Self {
            process: ProcessIdentity {
                pid,
                start_ticks,
                pid_ns,
                boot_id: Here::get().boot_id.clone(),
            },
            scope,
        })
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.process;
        write!(f, "{}-{}-{}-{}", p.pid, p.start_ticks, p.pid_ns, self.scope)
    }
}

#[cfg(test)]
mod tests;
