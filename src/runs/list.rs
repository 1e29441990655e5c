//! `ccci-run runs`: every run in the runs dir, from its record, judged from here.
//!
//! A run is `finished` when its record has an exit code; otherwise its supervisor, as the
//! record names it, is judged ([`crate::supervise::identity::Judge`], one view of `/proc` for
//! the whole listing): `live`, `dead` (gone without finishing its record: a SIGKILL, the OOM
//! killer) or `unresolvable` (in a pid namespace or on a host this process cannot see).
//!
//! Invariant: looking changes nothing. Records are only read; the locks are listed from
//! `/proc/locks` (or the lock store), never taken; a guard is tried only for a record too old
//! to name its supervisor, and let go at once.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::config::dirs::{self, Dir};
use crate::lock::backend::{LockInfo, LockKind};
use crate::names::{self, escape_outside};
use crate::rundir::phase::Phase;
use crate::rundir::record::RunRecord;
use crate::rundir::{self, Liveness};
use crate::supervise::cgroup;
use crate::supervise::identity::{Judge, Verdict};

/// How long a run that ended stays in the listing without `--all`.
pub(crate) const RECENT: Duration = Duration::from_secs(24 * 3600);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum RunState {
    /// Its supervisor runs.
    Live,
    /// Its supervisor is gone and its record unfinished.
    Dead,
    /// Its record says how it ended.
    Finished,
    /// Its supervisor cannot be judged from here.
    Unresolvable,
}

impl RunState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Live => "live",
            Self::Dead => "dead",
            Self::Finished => "finished",
            Self::Unresolvable => "unresolvable",
        }
    }
}

/// Who holds a lock, as its holder line says (each field escaped: the line is the holder's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct HolderFields {
    /// The holder's run, when it is a run (a `lock` command has none).
    pub run_id: Option<String>,
    pub pid: u32,
    pub host: String,
    /// When it took the lock.
    pub since: String,
}

impl HolderFields {
    fn of(holder: &crate::lock::Holder) -> Self {
        Self {
            run_id: (!holder.run_id.is_empty()).then(|| escape_outside(holder.run_id.as_bytes())),
            pid: holder.pid,
            host: escape_outside(holder.host.as_bytes()),
            since: escape_outside(holder.started_at.as_bytes()),
        }
    }

    /// `run 130` or `pid 4242 on host-a`.
    fn short(&self) -> String {
        match &self.run_id {
            Some(run) => format!("run {run}"),
            None => format!("pid {} on {}", self.pid, self.host),
        }
    }
}

/// The app lock a live run holds or waits for.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct LockUse {
    /// The app domain whose lock it is.
    pub domain: String,
    /// `held` or `waiting`.
    pub state: &'static str,
    /// Who holds it now (for a waiting run: the one it waits for).
    pub holder: Option<HolderFields>,
    /// The processes that hold it, when no holder line names them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub holder_pids: Vec<i32>,
}

/// One run, as `runs` lists it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RunInfo {
    pub run_id: String,
    /// The Drone repository (`owner/name`) of the run's build, when its step named one.
    pub repo: Option<String>,
    pub recipe: String,
    pub pr: Option<String>,
    #[serde(rename = "ref")]
    pub git_ref: Option<String>,
    pub domain: String,
    /// The last phase the record names.
    pub phase: Option<String>,
    pub state: RunState,
    /// When the run began (its first phase).
    pub started: Option<String>,
    pub age_s: Option<u64>,
    pub lock: Option<LockUse>,
    /// Its cgroup, while it exists.
    pub cgroup: Option<String>,
    /// How many processes its cgroup has now.
    pub processes: Option<usize>,
    pub shutdown_reason: Option<String>,
    pub exit_code: Option<u8>,
    #[serde(serialize_with = "crate::names::serialize_path_escaped")]
    pub record: PathBuf,
    /// When a janitor reaped the app a dead run left.
    pub reaped: Option<String>,
    /// What a janitor killed of a dead run's processes (its cgroup), and when.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub swept: Option<crate::rundir::record::Swept>,
    /// What to make of it in a few words: what it holds or waits for, what is left of a dead
    /// run and what a janitor did with it, why it cannot be judged, how it ended.
    pub note: Option<String>,
    /// Its phases with their times (shown by `runs RUN_ID`: [`Whole`]).
    #[serde(skip)]
    pub phases: Vec<crate::rundir::record::Phase>,
    /// Why the run failed before its command could run (shown by `runs RUN_ID`).
    #[serde(skip)]
    pub error: Option<String>,
    /// When it ended (its last phase), for the 24 h window.
    #[serde(skip)]
    ended: Option<SystemTime>,
}

/// One run as `runs RUN_ID --json` shows it: the listing's fields, its phases and its error.
#[derive(Debug, Serialize)]
pub(crate) struct Whole<'a> {
    #[serde(flatten)]
    pub run: &'a RunInfo,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub phases: &'a [crate::rundir::record::Phase],
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<&'a str>,
}

/// `{"runs": [...]}` (in the envelope every `--json` has)
#[derive(Debug, Default, Serialize)]
pub(crate) struct Listing {
    pub runs: Vec<RunInfo>,
    /// Run directories that could not be listed, and why.
    #[serde(skip)]
    pub warnings: Vec<String>,
}

fn parse_time(at: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339(at).ok()
}

/// Every run under `runs_dir` (with `all`, also those that ended more than [`RECENT`] ago),
/// sorted by start. `Err` when the runs dir itself cannot be read; a missing one holds no run.
pub(crate) fn list(runs_dir: &Path, all: bool, now: SystemTime) -> std::io::Result<Listing> {
    let mut found = Vec::new();
    let mut warnings = Vec::new();
    let entries = match std::fs::read_dir(runs_dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            warnings.push(dirs::missing_line(Dir::Runs, runs_dir));
            return Ok(Listing {
                runs: Vec::new(),
                warnings,
            });
        }
        Err(err) => return Err(err),
    };
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(err) => {
                warnings.push(format!(
                    "failed to read runs dir {}: {err}",
                    runs_dir.display()
                ));
                continue;
            }
        };
        let name = entry.file_name();
        let bytes = std::os::unix::ffi::OsStrExt::as_bytes(&*name);
        // `.domains` and temporary files: not runs.
        if bytes.starts_with(b".") || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let dir = entry.path();
        let path = dir.join(names::RUN_RECORD_FILE);
        match RunRecord::read(&path) {
            Ok(record) => found.push((dir, path, record)),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => warnings.push(format!(
                "run directory {} has no run record (a run that is starting, or what an older \
                 one left)",
                escape_outside(dir.as_os_str().as_encoded_bytes())
            )),
            Err(err) => warnings.push(format!(
                "failed to read run record {}: {err}",
                escape_outside(path.as_os_str().as_encoded_bytes())
            )),
        }
    }
    // Built after the records were read: a judge only proves the death of what it was shown.
    let judge = Judge::new();
    let mut runs: Vec<RunInfo> = found
        .into_iter()
        .map(|(dir, path, record)| describe(&judge, &dir, path, record, now))
        .filter(|run| all || recent(run, now))
        .collect();
    runs.sort_by(|a, b| (a.started.as_deref(), &a.run_id).cmp(&(b.started.as_deref(), &b.run_id)));
    Ok(Listing { runs, warnings })
}

/// Live and unresolvable runs always; the others when they ended within [`RECENT`].
fn recent(run: &RunInfo, now: SystemTime) -> bool {
    match run.state {
        RunState::Live | RunState::Unresolvable => true,
        RunState::Dead | RunState::Finished => run
            .ended
            .is_none_or(|at| now.duration_since(at).unwrap_or_default() <= RECENT),
    }
}

fn describe(
    judge: &Judge,
    dir: &Path,
    record_path: PathBuf,
    record: RunRecord,
    now: SystemTime,
) -> RunInfo {
    let started = record.phases.first().map(|p| p.at.clone());
    let last = record.phases.last();
    let (state, note) = if record.exit_code.is_some() {
        (RunState::Finished, None)
    } else {
        match &record.supervisor {
            Some(who) => match judge.judge(who) {
                Verdict::Alive => (RunState::Live, None),
                Verdict::Dead => (RunState::Dead, None),
                Verdict::Unresolvable(why) => (RunState::Unresolvable, Some(why)),
            },
            // A record too old to name its supervisor: its guard says.
            None => match rundir::probe(dir, false) {
                Liveness::Live { .. } => (RunState::Live, None),
                Liveness::Free { .. } | Liveness::NoGuard => (RunState::Dead, None),
                Liveness::Unreadable(err) => (RunState::Unresolvable, Some(err.to_string())),
            },
        }
    };
    let lock = (state == RunState::Live)
        .then(|| lock_use(&record))
        .flatten();
    // A cgroup is shown while it exists: a finished run's, or a swept dead run's, is gone.
    let cgroup = record.cgroup.as_deref().filter(|c| Path::new(c).is_dir());
    let processes = cgroup.map(|c| cgroup::population(Path::new(c)));
    let note = match state {
        RunState::Dead => Some(dead_note(&record, processes)),
        RunState::Finished => finished_note(&record),
        _ => note,
    };
    RunInfo {
        run_id: escape_outside(record.run_id.as_bytes()),
        repo: record.repo.as_deref().map(|r| escape_outside(r.as_bytes())),
        recipe: escape_outside(record.recipe.as_bytes()),
        pr: record.pr.as_deref().map(|p| escape_outside(p.as_bytes())),
        git_ref: record
            .git_ref
            .as_deref()
            .map(|r| escape_outside(r.as_bytes())),
        domain: escape_outside(record.domain.as_bytes()),
        phase: last.map(|p| escape_outside(p.name.as_bytes())),
        state,
        age_s: started
            .as_deref()
            .and_then(parse_time)
            .map(|at| now.duration_since(at).unwrap_or_default().as_secs()),
        started,
        lock,
        cgroup: cgroup.map(|c| escape_outside(c.as_bytes())),
        processes,
        shutdown_reason: record
            .shutdown_reason
            .as_deref()
            .map(|r| escape_outside(r.as_bytes())),
        exit_code: record.exit_code,
        record: record_path,
        reaped: record
            .reaped
            .as_deref()
            .map(|r| escape_outside(r.as_bytes())),
        swept: record.swept.clone().map(|s| crate::rundir::record::Swept {
            at: escape_outside(s.at.as_bytes()),
            killed: s.killed,
        }),
        note: note.map(|n| escape_outside(n.as_bytes())),
        phases: record
            .phases
            .iter()
            .map(|p| crate::rundir::record::Phase {
                name: escape_outside(p.name.as_bytes()),
                at: escape_outside(p.at.as_bytes()),
            })
            .collect(),
        error: record
            .error
            .as_deref()
            .map(|e| escape_outside(e.as_bytes())),
        ended: match state {
            RunState::Finished | RunState::Dead => last.and_then(|p| parse_time(&p.at)),
            _ => None,
        },
    }
}

/// An instant of a record, short for a note: `14:36:30Z` on the day it is now (UTC), else
/// `2026-12-01 14:36Z`; as written when it does not parse.
fn short_time(at: &str) -> String {
    let today = crate::duration::timestamp(SystemTime::now());
    match (at.get(..10), at.get(11..19), at.get(11..16)) {
        (Some(day), Some(time), _) if today.starts_with(day) => format!("{time}Z"),
        (Some(day), _, Some(minutes)) => format!("{day} {minutes}Z"),
        _ => at.to_owned(),
    }
}

/// What is left of a dead run (its supervisor gone, its record unfinished: its state says so),
/// and what a janitor did with it. Whether its app is left is told by the locks ([`add_holders`]).
fn dead_note(record: &RunRecord, processes: Option<usize>) -> String {
    match (&record.reaped, processes) {
        (Some(at), _) => format!("a janitor reaped its app at {}", short_time(at)),
        (None, None | Some(0)) if record.swept.is_some() => {
            let swept = record.swept.as_ref().expect("checked");
            match swept.killed {
                0 => format!(
                    "a janitor removed its cgroup at {} (nothing of it still ran)",
                    short_time(&swept.at)
                ),
                n => format!(
                    "a janitor killed its {n} process{} at {}",
                    if n == 1 { "" } else { "es" },
                    short_time(&swept.at)
                ),
            }
        }
        (None, Some(n)) if n > 0 => format!(
            "{n} process{} left for the janitor",
            if n == 1 { "" } else { "es" }
        ),
        (None, _) => "nothing of it is left running".to_owned(),
    }
}

/// How a finished run ended, when that is not simply its command ending.
fn finished_note(record: &RunRecord) -> Option<String> {
    match record.shutdown_reason.as_deref() {
        None | Some("command-ended") => record.error.clone(),
        Some("stopped") => Some(match &record.stopped_by {
            Some(by) => format!("stopped by uid {} (pid {})", by.uid, by.pid),
            None => "stopped".to_owned(),
        }),
        Some(reason) => Some(format!("ended by {reason}")),
    }
}

/// The app lock a live run's phases say it holds (it entered `app-lock`) or waits for (its
/// start-of-run sweep is over, and it has not got it yet).
fn lock_use(record: &RunRecord) -> Option<LockUse> {
    let entered = |phase: Phase| record.phases.iter().any(|p| p.name == phase.as_str());
    let state = if entered(Phase::AppLock) {
        "held"
    } else if [Phase::Janitor.as_str(), Phase::Waiting.as_str()]
        .contains(&record.phases.last()?.name.as_str())
    {
        "waiting"
    } else {
        return None;
    };
    if entered(Phase::Teardown) && state == "waiting" {
        return None;
    }
    Some(LockUse {
        domain: escape_outside(record.domain.as_bytes()),
        state,
        holder: None,
        holder_pids: Vec::new(),
    })
}

/// True when some run in the listing holds or waits for a lock, or is dead (its app may be
/// left): then the locks are worth listing.
pub(crate) fn uses_locks(listing: &Listing) -> bool {
    listing
        .runs
        .iter()
        .any(|r| r.lock.is_some() || r.state == RunState::Dead)
}

/// Fill in the holders of the locks the runs use, from a listing of the locks: a run waiting
/// for a lock someone holds is in phase `waiting`, and a dead run whose lock is still there has
/// its app left for the janitor.
pub(crate) fn add_holders(listing: &mut Listing, locks: &[LockInfo]) {
    for run in &mut listing.runs {
        let found = locks
            .iter()
            .find(|l| l.kind == LockKind::App && l.name == run.domain);
        if run.state == RunState::Dead {
            let left = found.is_some_and(|l| {
                l.holder
                    .as_ref()
                    .is_some_and(|h| escape_outside(h.run_id.as_bytes()) == run.run_id)
            });
            if left && run.reaped.is_none() {
                run.note = Some(format!(
                    "its app {} is left for the janitor",
                    short_domain(&run.domain)
                ));
            }
            continue;
        }
        let Some(lock) = run.lock.as_mut() else {
            continue;
        };
        let Some(found) = found.filter(|l| l.held) else {
            continue;
        };
        lock.holder = found.holder.as_ref().map(HolderFields::of);
        if lock.holder.is_none() {
            lock.holder_pids = found.holder_pids.clone();
        }
        let by_other = lock
            .holder
            .as_ref()
            .is_none_or(|h| h.run_id.as_deref() != Some(run.run_id.as_str()));
        if lock.state == "waiting" && by_other {
            run.phase = Some("waiting".to_owned());
        }
    }
    for run in &mut listing.runs {
        if run.state != RunState::Live {
            continue;
        }
        run.note = run.lock.as_ref().map(|lock| {
            let domain = short_domain(&lock.domain);
            match (lock.state, &lock.holder) {
                ("held", _) => format!("holds {domain}"),
                (_, Some(h)) => format!("waiting for {domain} (held by {})", h.short()),
                (_, None) if !lock.holder_pids.is_empty() => {
                    format!("waiting for {domain} (held by pids {:?})", lock.holder_pids)
                }
                (_, None) => format!("waiting for {domain}"),
            }
        });
    }
}

/// An app domain by its first label (`cust-1ef5c9`): unique under one suffix, and short.
fn short_domain(domain: &str) -> &str {
    domain.split('.').next().unwrap_or(domain)
}

/// Keep only live runs (`runs --live`).
pub(crate) fn only_live(listing: &mut Listing) {
    listing.runs.retain(|r| r.state == RunState::Live);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rundir::record::Phase as Entered;

    fn record(phases: &[&str], exit_code: Option<u8>) -> RunRecord {
        RunRecord {
            run_id: "7".into(),
            domain: "d.ci.example.org".into(),
            phases: phases
                .iter()
                .map(|p| Entered {
                    name: (*p).to_owned(),
                    at: "2026-01-01T00:00:00.000Z".into(),
                })
                .collect(),
            exit_code,
            ..RunRecord::default()
        }
    }

    #[test]
    fn a_run_waits_for_its_lock_after_its_sweep_and_holds_it_after_app_lock() {
        let waiting = lock_use(&record(&["guards", "abra-dir", "janitor"], None)).unwrap();
        assert_eq!(waiting.state, "waiting");
        let held = lock_use(&record(&["guards", "janitor", "app-lock", "command"], None));
        assert_eq!(held.unwrap().state, "held");
        assert!(lock_use(&record(&["guards", "abra-dir"], None)).is_none());
        // Stopped while waiting: it never took the lock.
        assert!(lock_use(&record(&["guards", "janitor", "teardown"], None)).is_none());
    }

    #[test]
    fn ended_runs_leave_the_default_listing_after_a_day() {
        let now = SystemTime::now();
        let mut run = describe(
            &Judge::new(),
            Path::new("/nonexistent"),
            PathBuf::from("/nonexistent/run.json"),
            record(&["guards", "finished"], Some(0)),
            now,
        );
        assert_eq!(run.state, RunState::Finished);
        run.ended = Some(now - Duration::from_secs(3600));
        assert!(recent(&run, now));
        run.ended = Some(now - RECENT - Duration::from_secs(1));
        assert!(!recent(&run, now));
        run.state = RunState::Live;
        assert!(recent(&run, now));
    }
}
