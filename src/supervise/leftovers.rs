//! Processes a dead supervisor left behind, found without cgroups: every process a run or a
//! `lock` command starts carries `CCCI_SUPERVISOR=<pid>-<start>` in its environment, naming its
//! supervisor for good (a pid plus its start time survives pid reuse). A process whose named
//! supervisor is gone belongs to a run that ended without its teardown, and is killed.
//!
//! This is the fallback for hosts without a writable cgroup v2 hierarchy, and a second net
//! everywhere: a process that scrubbed its environment (`env -i`) escapes it, one in a cgroup
//! cannot. See `docs/concurrency.md`, "Every process of a run".
//!
//! Invariant: a process is only ever killed when the supervisor it names is provably dead, and
//! never the calling process or one of its ancestors.

use std::collections::HashSet;

use nix::sys::signal::Signal;
use nix::unistd::Pid;

use crate::supervise::linux;

/// The environment variable naming a process's supervisor.
pub(crate) const SUPERVISOR_VAR: &str = "CCCI_SUPERVISOR";

/// How many kill passes a sweep makes (a leftover may fork while we kill).
const ROUNDS: usize = 20;

/// `<pid>-<start>` of this process, the value its children carry.
pub(crate) fn this_supervisor() -> String {
    format!("{}-{}", std::process::id(), linux::own_start_time())
}

/// Parse a `CCCI_SUPERVISOR` value.
pub(crate) fn parse_supervisor(value: &[u8]) -> Option<(i32, u64)> {
    let text = std::str::from_utf8(value).ok()?;
    let (pid, start) = text.split_once('-')?;
    let pid = pid.parse().ok().filter(|p: &i32| *p > 0)?;
    Some((pid, start.parse().ok()?))
}

/// One leftover process found by a sweep.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Leftover {
    pub pid: i32,
    /// The dead supervisor it named.
    pub supervisor: i32,
}

/// Kill (unless `dry_run`) every process whose supervisor is dead; returns what was found.
pub(crate) fn reap(dry_run: bool) -> Vec<Leftover> {
    let me = nix::unistd::getpid();
    let spared = ancestors_and_self(me);
    let mut found: Vec<Leftover> = Vec::new();
    let mut seen = HashSet::new();
    for _ in 0..ROUNDS {
        let round = scan(&spared);
        if round.is_empty() {
            break;
        }
        for leftover in &round {
            if !dry_run {
                let _ = linux::signal_process(Pid::from_raw(leftover.pid), Signal::SIGKILL);
            }
            if seen.insert(leftover.pid) {
                found.push(leftover.clone());
            }
        }
        if dry_run {
            break;
        }
        // Let the kills land before looking again; SIGKILL needs no cooperation.
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    found
}

fn scan(spared: &HashSet<Pid>) -> Vec<Leftover> {
    let mut verdicts: std::collections::HashMap<(i32, u64), bool> = Default::default();
    linux::all_pids()
        .into_iter()
        .filter(|pid| !spared.contains(pid))
        .filter_map(|pid| {
            let value = linux::environ_value(pid, SUPERVISOR_VAR)?;
            let (supervisor, start) = parse_supervisor(&value)?;
            let dead = *verdicts
                .entry((supervisor, start))
                .or_insert_with(|| !linux::is_running(supervisor, start));
            // A zombie has no environ to read, so what is found here is alive.
            dead.then_some(Leftover {
                pid: pid.as_raw(),
                supervisor,
            })
        })
        .collect()
}

fn ancestors_and_self(me: Pid) -> HashSet<Pid> {
    let mut spared = HashSet::from([me]);
    let mut current = nix::unistd::getppid();
    while current.as_raw() > 1 && spared.insert(current) {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{current}/stat")) else {
            break;
        };
        match linux::parse_stat(&text) {
            Some(stat) => current = stat.ppid,
            None => break,
        }
    }
    spared
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case(b"123-456", Some((123, 456)))]
    #[case(b"0-456", None)]
    #[case(b"-1-2", None)]
    #[case(b"123", None)]
    #[case(b"a-b", None)]
    #[case(b"\xff-1", None)]
    fn supervisor_values(#[case] value: &[u8], #[case] want: Option<(i32, u64)>) {
        assert_eq!(parse_supervisor(value), want);
    }

    #[test]
    fn this_process_names_itself_alive() {
        let (pid, start) = parse_supervisor(this_supervisor().as_bytes()).unwrap();
        assert_eq!(linux::process_start_time(pid), Some(start));
    }
}
