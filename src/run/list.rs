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

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::config::dirs::{self, Dir};
use crate::lock::list::{LockInfo, LockKind};
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
    fn as_str(self) -> &'static str {
        match self {
            Self::Live => "live",
            Self::Dead => "dead",
            Self::Finished => "finished",
            Self::Unresolvable => "unresolvable",
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
    /// Who holds it, as its holder line says (escaped).
    pub holder: Option<String>,
}

/// One run, as `runs` lists it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RunInfo {
    pub run_id: String,
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
    pub cgroup: Option<String>,
    /// How many processes its cgroup has now.
    pub processes: Option<usize>,
    pub shutdown_reason: Option<String>,
    pub exit_code: Option<u8>,
    #[serde(serialize_with = "crate::names::serialize_path_escaped")]
    pub record: PathBuf,
    /// What to make of it: why it cannot be judged, that the janitor clears a dead run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// When it ended (its last phase), for the 24 h window.
    #[serde(skip)]
    ended: Option<SystemTime>,
}

/// `{"runs": [...]}`
#[derive(Debug, Serialize)]
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
    let note = match (state, &record.reaped) {
        (RunState::Dead, Some(reaped)) => Some(format!(
            "its supervisor is gone and its record unfinished; a janitor reaped what it left \
             ({reaped})"
        )),
        (RunState::Dead, None) => Some(
            "its supervisor is gone and its record unfinished: the next janitor sweep clears it"
                .to_owned(),
        ),
        _ => note,
    };
    let lock = (state == RunState::Live)
        .then(|| lock_use(&record))
        .flatten();
    let processes = match (&record.cgroup, state) {
        (Some(cgroup), RunState::Live | RunState::Dead | RunState::Unresolvable) => {
            Some(cgroup::population(Path::new(cgroup)))
        }
        _ => None,
    };
    RunInfo {
        run_id: escape_outside(record.run_id.as_bytes()),
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
        cgroup: record
            .cgroup
            .as_deref()
            .map(|c| escape_outside(c.as_bytes())),
        processes,
        shutdown_reason: record
            .shutdown_reason
            .as_deref()
            .map(|r| escape_outside(r.as_bytes())),
        exit_code: record.exit_code,
        record: record_path,
        note,
        ended: match state {
            RunState::Finished | RunState::Dead => last.and_then(|p| parse_time(&p.at)),
            _ => None,
        },
    }
}

/// The app lock a live run's phases say it holds (it entered `app-lock`) or waits for (its
/// start-of-run sweep is over, and it has not got it yet).
fn lock_use(record: &RunRecord) -> Option<LockUse> {
    let entered = |phase: Phase| record.phases.iter().any(|p| p.name == phase.as_str());
    let state = if entered(Phase::AppLock) {
        "held"
    } else if record.phases.last()?.name == Phase::Janitor.as_str() {
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
    })
}

/// True when some run in the listing holds or waits for a lock (then the locks are worth
/// listing).
pub(crate) fn uses_locks(listing: &Listing) -> bool {
    listing.runs.iter().any(|r| r.lock.is_some())
}

/// Fill in the holders of the locks the runs use, from a listing of the locks.
pub(crate) fn add_holders(listing: &mut Listing, locks: &[LockInfo]) {
    for lock in listing.runs.iter_mut().filter_map(|r| r.lock.as_mut()) {
        let found = locks
            .iter()
            .find(|l| l.kind == LockKind::App && l.name == lock.domain);
        lock.holder = found.and_then(|l| match (&l.holder, l.held) {
            (Some(h), true) if h.run_id.is_empty() => Some(escape_outside(
                format!("pid {} on {} since {}", h.pid, h.host, h.started_at).as_bytes(),
            )),
            (Some(h), true) => Some(escape_outside(
                format!(
                    "run {} pid {} on {} since {}",
                    h.run_id, h.pid, h.host, h.started_at
                )
                .as_bytes(),
            )),
            (None, true) => Some(format!("pids {:?}", l.holder_pids)),
            (_, false) => None,
        });
    }
}

/// The human-readable table: one line a run, what it holds and where its record is after.
pub(crate) fn render_table(runs: &[RunInfo]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<20} {:<16} {:<12} {:<34} {:<10} {:<12} {:>9} {:>4}  DETAIL",
        "RUN", "RECIPE", "PR/REF", "DOMAIN", "PHASE", "STATE", "AGE", "EXIT"
    );
    for r in runs {
        let pr_ref = match (&r.pr, &r.git_ref) {
            (Some(pr), _) => format!("#{pr}"),
            (None, Some(git_ref)) => git_ref.clone(),
            (None, None) => "-".to_owned(),
        };
        let age = r
            .age_s
            .map(|s| humantime::format_duration(Duration::from_secs(s)).to_string())
            .map(|s| s.split(' ').take(2).collect::<Vec<_>>().join(""))
            .unwrap_or_else(|| "-".to_owned());
        let mut detail = Vec::new();
        if let Some(lock) = &r.lock {
            let holder = lock
                .holder
                .as_deref()
                .map(|h| format!(" (holder: {h})"))
                .unwrap_or_default();
            detail.push(format!("lock {} {}{holder}", lock.state, lock.domain));
        }
        if let Some(reason) = &r.shutdown_reason {
            detail.push(format!("reason {reason}"));
        }
        if let Some(cgroup) = &r.cgroup {
            match r.processes {
                Some(n) => detail.push(format!("cgroup {cgroup} ({n} processes)")),
                None => detail.push(format!("cgroup {cgroup}")),
            }
        }
        detail.push(format!(
            "record {}",
            escape_outside(r.record.as_os_str().as_encoded_bytes())
        ));
        if let Some(note) = &r.note {
            detail.push(format!("note: {note}"));
        }
        // Every field may come from a record the run's own command could write: escaped.
        let line = format!(
            "{:<20} {:<16} {:<12} {:<34} {:<10} {:<12} {:>9} {:>4}  {}",
            r.run_id,
            r.recipe,
            pr_ref,
            r.domain,
            r.phase.as_deref().unwrap_or("-"),
            r.state.as_str(),
            age,
            r.exit_code
                .map_or_else(|| "-".to_owned(), |c| c.to_string()),
            detail.join("; ")
        );
        let _ = writeln!(out, "{}", crate::names::visible(&line));
    }
    out
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
