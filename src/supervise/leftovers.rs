//! Processes a dead supervisor left behind, found by their environment: every process a run or
//! a `lock` command starts carries `CCCI_SUPERVISOR=<owner>` ([`Owner`]: the supervisor's pid,
//! start time and pid namespace, and its configuration), naming its supervisor for good.
//!
//! This is the fallback for hosts without a writable cgroup v2 hierarchy, and a second net
//! everywhere: a process that scrubbed its environment (`env -i`) escapes it, one in a cgroup
//! cannot. See `docs/concurrency.md`, "Every process of a run". It is also how the next holder
//! of a lock clears what a dead predecessor left ([`clear_predecessor`]), cgroup and all, before
//! its own command starts.
//!
//! Invariant: a process is only ever killed when the supervisor it names is of our own
//! configuration and judged dead — or, for the cgroup of a lock's previous holder of this boot
//! that we cannot see, when that holder let go of the lock without clearing its line, which a
//! holder only does at its exit, past its teardown — never the calling process or one of its
//! ancestors; and it is signalled through its `/proc` directory, so a pid reused meanwhile is
//! never hit.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::unistd::Pid;

use crate::report;
use crate::supervise::cgroup;
use crate::supervise::identity::{Judge, Owner, ProcessIdentity, Scope, Verdict};
use crate::supervise::linux::{self, ProcDir};

/// The environment variable naming a process's supervisor.
pub(crate) const SUPERVISOR_VAR: &str = "CCCI_SUPERVISOR";

/// How often a killer looks again for a leftover (a leftover may fork while it is killed) and
/// for the killed ones to be gone.
const POLL: Duration = Duration::from_millis(5);

/// One process that names a supervisor of our configuration, as a scan found it.
#[derive(Debug)]
pub(crate) struct Marked {
    /// Its pid as `/proc` shows it.
    pub pid: i32,
    pub owner: Owner,
    /// Its `/proc` directory: what a kill goes through.
    pub dir: ProcDir,
}

/// Every process (but this one and its ancestors) whose `CCCI_SUPERVISOR` names a supervisor
/// of the configuration `scope`. Another configuration's processes are not looked at further.
pub(crate) fn scan(scope: Scope) -> Vec<Marked> {
    scan_where(|owner| owner.scope == scope)
}

/// Every process (but this one and its ancestors) whose `CCCI_SUPERVISOR` names `owner`,
/// alive or not: what a run's fence kills ([`crate::supervise::fence`]).
pub(crate) fn scan_owned_by(owner: &Owner) -> Vec<Marked> {
    scan_where(|found| found == owner)
}

fn scan_where(wanted: impl Fn(&Owner) -> bool) -> Vec<Marked> {
    let spared = ancestors_and_self();
    linux::all_pids()
        .into_iter()
        .filter(|pid| !spared.contains(pid))
        .filter_map(|pid| {
            let dir = ProcDir::open(pid.as_raw())?;
            // A zombie has no environ to read, so what is found here is alive.
            let environ = dir.read("environ").ok()?;
            let value = crate::supervise::procfs::environ_lookup(&environ, SUPERVISOR_VAR)?;
            let owner = Owner::parse(std::str::from_utf8(value).ok()?)?;
            wanted(&owner).then_some(Marked {
                pid: pid.as_raw(),
                owner,
                dir,
            })
        })
        .collect()
}

/// SIGKILL `processes` and wait, until `until`, for each to be gone (a zombie is gone: it will
/// never act again). Returns the pids still running when time ran out.
pub(crate) fn kill_and_wait(processes: &[&Marked], until: Instant) -> Vec<i32> {
    for process in processes {
        if let Err(err) = process.dir.signal(Signal::SIGKILL) {
            tracing::warn!(
                pid = process.pid,
                "failed to kill a leftover process: {err}"
            );
        }
    }
    loop {
        let running: Vec<i32> = processes
            .iter()
            .filter(|p| p.dir.running())
            .map(|p| p.pid)
            .collect();
        if running.is_empty() || Instant::now() >= until {
            return running;
        }
        std::thread::sleep(POLL);
    }
}

/// This process and its ancestors, as `/proc` numbers them (which is not our own numbering
/// when `/proc` belongs to an enclosing pid namespace).
fn ancestors_and_self() -> HashSet<Pid> {
    let me = std::fs::read_link("/proc/self")
        .ok()
        .and_then(|p| p.to_str()?.parse().ok())
        .map_or_else(nix::unistd::getpid, Pid::from_raw);
    let mut spared = HashSet::from([me]);
    let mut current = crate::files::kernel_text(format!("/proc/{me}/stat"))
        .ok()
        .and_then(|t| linux::parse_stat(&t))
        .map_or_else(nix::unistd::getppid, |s| s.ppid);
    while current.as_raw() > 1 && spared.insert(current) {
        let Ok(text) = crate::files::kernel_text(format!("/proc/{current}/stat")) else {
            break;
        };
        match linux::parse_stat(&text) {
            Some(stat) => current = stat.ppid,
            None => break,
        }
    }
    spared
}

/// What a lock's last holder line says about a holder that did not clear it: it ended
/// without letting go cleanly (a SIGKILL, the OOM killer).
#[derive(Debug, Clone)]
pub(crate) struct Predecessor {
    pub process: Option<ProcessIdentity>,
    pub scope: Option<Scope>,
    /// The cgroup its line names.
    pub cgroup: Option<PathBuf>,
}

/// What became of a dead predecessor's leftovers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Cleared {
    /// It was dead (or had let go of the lock); everything of it we can reach is gone now:
    /// `killed` processes, in `cgroup` when it had one (removed). `unseen`: why something of
    /// it may still run out of our sight.
    Gone {
        killed: usize,
        cgroup: Option<PathBuf>,
        unseen: Option<String>,
    },
    /// Nothing was done, for this reason: it still runs, it cannot be judged from here, it is
    /// another configuration's.
    LeftAlone(String),
    /// It was dead, but something it left would not go.
    Failed(String),
}

impl Cleared {
    /// Say what became of them in a status line about the lock called `what` (its previous
    /// holder being `who`); `Err` when they would not go.
    pub(crate) fn report(&self, what: &str, who: &str) -> Result<(), String> {
        match self {
            Cleared::Gone {
                killed,
                cgroup,
                unseen,
            } => {
                let place = cgroup
                    .as_ref()
                    .map(|c| format!(" (cgroup {}, removed)", c.display()))
                    .unwrap_or_default();
                match unseen {
                    None => report::line(&format!(
                        "== {what}: its previous holder, {who}, died holding it; killed the \
                         {killed} process(es) it left{place} before starting =="
                    )),
                    Some(why) if *killed == 0 && cgroup.is_none() => report::line(&format!(
                        "!! {what}: its previous holder, {who}, let go of it without clearing \
                         its line; nothing of it was within reach: {why}"
                    )),
                    Some(why) => {
                        report::line(&format!(
                            "== {what}: its previous holder, {who}, let go of it without \
                             clearing its line; killed the {killed} process(es) it left{place} \
                             before starting =="
                        ));
                        report::line(&format!("!! {what}: its previous holder, {who}: {why}"));
                    }
                }
                Ok(())
            }
            Cleared::LeftAlone(why) => {
                report::line(&format!(
                    "!! {what}: its previous holder, {who}, did not let go cleanly; what it \
                     left, if anything, is left alone: {why}"
                ));
                Ok(())
            }
            Cleared::Failed(why) => Err(why.clone()),
        }
    }
}

/// How long killing what dead supervisors left may take, and waiting for it to be gone.
pub(crate) const KILL_BUDGET: Duration = Duration::from_secs(10);

/// Before our own command starts: if the lock's last holder (whose line was still in the lock
/// we took) is judged dead, or cannot be judged from here but was of this boot (it let go of
/// the lock, so it is gone or past its teardown), and was of our configuration, kill what it
/// left that we can reach — its cgroup, then every process naming it — and wait (until
/// `until`) until all of it is gone.
pub(crate) fn clear_predecessor(before: &Predecessor, own: &Owner, until: Instant) -> Cleared {
    let Some(process) = &before.process else {
        return Cleared::LeftAlone(
            "its holder line names no process identity (an older ccci-run's)".to_owned(),
        );
    };
    // What of it may lie beyond our reach, said after what was killed.
    let mut unseen = None;
    match process.judge() {
        Verdict::Alive => {
            return Cleared::LeftAlone(format!(
                "it still runs ({}), so it is not judged dead",
                process.describe()
            ));
        }
        // A holder clears its line before it lets go, and lets go only at its exit, after its
        // teardown: a line left in a lock we now hold is a holder of this boot that let go
        // without clearing it. Dead, or past its teardown with its cgroup gone: its cgroup,
        // which we can reach, is no live command's. What it may have outside that cgroup runs
        // where we cannot see, and is left to a janitor that can.
        Verdict::Unresolvable(why) if process.boot_id == linux::boot_id() => {
            unseen = Some(format!(
                "{why}: what of it runs outside its cgroup cannot be seen from here"
            ));
        }
        Verdict::Unresolvable(why) => {
            return Cleared::LeftAlone(format!("whether it is dead cannot be told here: {why}"));
        }
        Verdict::Dead => {}
    }
    let scope = match before.scope {
        Some(scope) if scope == own.scope => scope,
        Some(scope) => {
            return Cleared::LeftAlone(format!(
                "it was another configuration's ({scope}, this is {}): left to its own janitor",
                own.scope
            ));
        }
        None => {
            return Cleared::LeftAlone(
                "its holder line names no configuration: nothing of it is ours to kill".to_owned(),
            );
        }
    };
    let owner = Owner {
        process: process.clone(),
        scope,
    };
    let mut killed = 0;
    let mut cgroup_gone = None;
    if let Some(named) = &before.cgroup {
        match cgroup::named_for(named, &owner) {
            Some(dir) if dir.exists() => {
                killed += cgroup::population(&dir);
                let left = until.saturating_duration_since(Instant::now());
                if let Err(err) = cgroup::reap_dead(&dir, left) {
                    return Cleared::Failed(err.to_string());
                }
                cgroup_gone = Some(dir);
            }
            Some(_) => {}
            None => tracing::warn!(
                cgroup = %named.display(),
                "the holder line names a cgroup that is not its supervisor's; not touched"
            ),
        }
    }
    // The second net: whatever escaped the cgroup, or had none, still names its supervisor.
    loop {
        let found = scan_where(|o| *o == owner);
        if found.is_empty() {
            break;
        }
        let refs: Vec<&Marked> = found.iter().collect();
        let left = kill_and_wait(&refs, until);
        killed += found.len();
        if !left.is_empty() {
            return Cleared::Failed(format!(
                "processes {left:?} of the dead holder still run after SIGKILL"
            ));
        }
        if Instant::now() >= until {
            return Cleared::Failed(
                "processes of the dead holder kept appearing until the budget ran out".to_owned(),
            );
        }
    }
    Cleared::Gone {
        killed,
        cgroup: cgroup_gone,
        unseen,
    }
}

/// True while something a lock's last holder left may still be there for the next holder to
/// clear: it is dead and its cgroup or a process naming it is still there, or it cannot be
/// judged from here (but was of this boot: nothing outlives a reboot). A look only.
pub(crate) fn remains(before: &Predecessor) -> bool {
    let Some(process) = &before.process else {
        return false;
    };
    match process.judge() {
        Verdict::Alive => return false,
        Verdict::Unresolvable(_) => return process.boot_id == linux::boot_id(),
        Verdict::Dead => {}
    }
    let Some(scope) = before.scope else {
        return false;
    };
    let owner = Owner {
        process: process.clone(),
        scope,
    };
    let cgroup_left = before
        .cgroup
        .as_deref()
        .and_then(|c| cgroup::named_for(c, &owner))
        .is_some_and(|dir| cgroup::population(&dir) > 0);
    cgroup_left || !scan_where(|o| *o == owner).is_empty()
}

/// Judge every process of `found` with one view of `/proc` (taken now, after the scan).
pub(crate) fn judge_all(found: &[Marked]) -> Vec<Verdict> {
    let judge = Judge::new();
    found
        .iter()
        .map(|m| judge.judge(&m.owner.process))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_s_marker_names_it_alive() {
        let me = ProcessIdentity::own().unwrap();
        let owner = Owner {
            process: me.clone(),
            scope: Scope::of_runs_dir(std::path::Path::new("/")).unwrap(),
        };
        let parsed = Owner::parse(&owner.to_string()).unwrap();
        assert_eq!(parsed, owner);
        assert_eq!(parsed.process.judge(), Verdict::Alive);
    }

    #[test]
    fn a_scan_never_finds_this_process_or_its_ancestors() {
        let me = Pid::this();
        let spared = ancestors_and_self();
        assert!(spared.contains(&me));
        assert!(spared.contains(&nix::unistd::getppid()));
    }
}
