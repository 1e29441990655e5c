//! `ccci-run stop RUN_ID`: tear one live run down as a SIGTERM would, recorded as `stopped`
//! with who asked.
//!
//! The run is signalled only once the kernel proves the process to be that run's supervisor:
//! the record in `<runs dir>/RUN_ID` is run RUN_ID's and unfinished and names a supervisor;
//! that process (its `/proc` directory opened on its recorded start time, and a pidfd taken on
//! it before the proof) runs this ccci-run's executable as the run directory's user only, has
//! an open descriptor on the run's guard that holds the guard's flock, and carries the mark of
//! run RUN_ID it made at its start ([`crate::supervise::mark`]). After the proof the pidfd is
//! checked again, and the signals go through it: a pid reused meanwhile is never hit. Anything
//! short of that is refused, naming what did not match, and nothing is signalled. Before
//! signalling, a request naming the requester and the supervisor is written (atomically) into
//! the run directory; the supervisor's funnel takes a SIGTERM from that sender, with that
//! request, for a stop. Any other SIGTERM stays a SIGTERM.
//!
//! `stop` tells a run that finished (a clean exit, perhaps meanwhile) from a dead one (its
//! supervisor gone, its record unfinished), from one that is not the caller's to look at, from
//! a live process that is not provably that run's supervisor.
//!
//! Invariant: nothing is signalled that was not proven to be the run's supervisor, and
//! `--kill` kills a run's cgroup and marked processes only once its supervisor is dead.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::Signal;

use crate::config::dirs::{self, Dir};
use crate::exit;
use crate::names::{self, RunId};
use crate::rundir::phase::Phase;
use crate::rundir::record::RunRecord;
use crate::rundir::{self, Liveness};
use crate::supervise::identity::{Judge, Owner, ProcessIdentity, Scope, Verdict};
use crate::supervise::leftovers::{self, Cleared, Predecessor};
use crate::supervise::linux;
use crate::supervise::mark;
use crate::supervise::shutdown::Requester;
use crate::supervise::signals::StopRequest;

/// What `stop` was asked.
#[derive(Debug)]
pub(crate) struct StopConfig {
    pub run_id: RunId,
    /// How long to wait for the run to finish its record.
    pub wait: Duration,
    /// Past the wait, kill what is left.
    pub kill: bool,
}

/// Why there is no live run to stop, or it could not be stopped: exit 1.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StopError {
    #[error("no live run {run_id} to stop: {why}")]
    NotLive { run_id: RunId, why: String },
    /// The run may well be live, but the caller may not look at it: never "no live run".
    #[error(
        "run {run_id} is not yours to read: {path}: {why}; nothing signalled (stop it as the \
         user that runs it)"
    )]
    NotYours {
        run_id: RunId,
        path: PathBuf,
        why: String,
    },
    /// A live process, but not proven to be that run's supervisor.
    #[error("run {run_id} is not provably that run: {why}; nothing signalled")]
    NotProven { run_id: RunId, why: String },
    #[error("failed to read runs dir {path}: {source}")]
    RunsDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("failed to read run record {path}: {source}")]
    Record {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("failed to {what} run {run_id}'s supervisor: {source}")]
    Signal {
        what: &'static str,
        run_id: RunId,
        source: std::io::Error,
    },
    #[error("failed to write the stop request {path}: {source}")]
    Request {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl From<StopError> for crate::error::Error {
    fn from(err: StopError) -> Self {
        Self::command(err, crate::exit::FAILURE)
    }
}

/// How a stop ended: the exit code, and the line for stdout.
#[derive(Debug)]
pub(crate) struct Stopped {
    pub code: u8,
    pub line: Option<String>,
}

/// How long `--kill` waits for the supervisor to die and its leftovers to go.
const KILL_BUDGET: Duration = Duration::from_secs(10);

/// Stop run `cfg.run_id` of the runs dir `runs_dir`.
pub(crate) fn stop(runs_dir: &Path, cfg: &StopConfig) -> Result<Stopped, StopError> {
    let id = &cfg.run_id;
    let not_live = |why: String| StopError::NotLive {
        run_id: id.clone(),
        why,
    };
    // The runs dir must be readable: "unknown" is only said of a directory that was looked in.
    // A missing one holds no run: not live, as anywhere else there is nothing to stop.
    match std::fs::read_dir(runs_dir) {
        Ok(_) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return Err(not_live(dirs::missing_line(Dir::Runs, runs_dir)));
        }
        Err(source) => {
            return Err(StopError::RunsDir {
                path: runs_dir.to_owned(),
                source,
            });
        }
    }
    let dir = runs_dir.join(id.as_str());
    // A run dir is a directory of this runs dir: a link planted in its place (to another
    // configuration's live run) is never followed.
    match std::fs::symlink_metadata(&dir) {
        Ok(meta) if meta.is_dir() => {}
        Ok(meta) => {
            return Err(not_live(format!(
                "{} is {}, not a run directory; nothing signalled",
                dir.display(),
                crate::files::kind_name(meta.file_type())
            )));
        }
        Err(_) => {}
    }
    let record_path = dir.join(names::RUN_RECORD_FILE);
    let record = match RunRecord::read(&record_path) {
        Ok(record) => record,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return Err(not_live(format!(
                "unknown: there is no run record {}",
                record_path.display()
            )));
        }
        Err(source) if source.kind() == std::io::ErrorKind::PermissionDenied => {
            return Err(StopError::NotYours {
                run_id: id.clone(),
                path: record_path,
                why: source.to_string(),
            });
        }
        Err(source) => {
            return Err(StopError::Record {
                path: record_path,
                source,
            });
        }
    };
    if let Some(code) = record.exit_code {
        return Err(not_live(format!(
            "it has finished ({}, exit {code}); record {}",
            record.shutdown_reason.as_deref().unwrap_or("command-ended"),
            record_path.display()
        )));
    }
    // The record's own word on which run it is: a run directory renamed over another's holds
    // that other run's record.
    if record.run_id != id.as_str() {
        return Err(StopError::NotProven {
            run_id: id.clone(),
            why: format!(
                "its record {} is run {}'s, not run {id}'s",
                record_path.display(),
                names::escape_outside(record.run_id.as_bytes())
            ),
        });
    }
    let supervisor = record
        .supervisor
        .clone()
        .ok_or_else(|| StopError::NotProven {
            run_id: id.clone(),
            why: format!(
                "its record {} names no supervisor identity (an older ccci-run's)",
                record_path.display()
            ),
        })?;
    let target = verify(&dir, &supervisor, id).map_err(|why| match why {
        // Dead, or it just finished: a run that ended cleanly between our read of its record
        // and the look at its guard has written its exit by now.
        NotLive::Dead => match RunRecord::read(&record_path).ok() {
            Some(RunRecord {
                exit_code: Some(code),
                shutdown_reason: reason,
                ..
            }) => not_live(format!(
                "it has finished meanwhile ({}, exit {code}); record {}",
                reason.as_deref().unwrap_or("command-ended"),
                record_path.display()
            )),
            // A janitor has been: what it left is gone already, nothing is the next sweep's.
            Some(RunRecord {
                reaped: Some(at), ..
            }) => not_live(format!(
                "it is dead (its supervisor is gone and its record unfinished), and a janitor \
                 already reaped what it left at {at}"
            )),
            _ => not_live(NotLive::Dead.to_string()),
        },
        NotLive::NotYours(why) => StopError::NotYours {
            run_id: id.clone(),
            path: dir.join(names::RUN_GUARD_FILE),
            why,
        },
        NotLive::NotProven(why) => StopError::NotProven {
            run_id: id.clone(),
            why,
        },
        other => not_live(other.to_string()),
    })?;
    let requester = Requester {
        uid: nix::unistd::getuid().as_raw(),
        pid: std::process::id() as i32,
    };
    request(&dir, &supervisor, requester)?;
    linux::pidfd_signal(target.pidfd.as_fd(), Signal::SIGTERM).map_err(|source| {
        StopError::Signal {
            what: "signal",
            run_id: id.clone(),
            source,
        }
    })?;
    crate::report::line(&format!(
        "== stop: asked run {id} ({}) to stop; waiting up to {} ==",
        supervisor.describe(),
        humantime::format_duration(cfg.wait)
    ));
    if wait_exit(&target, cfg.wait) {
        return finished(id, &record_path);
    }
    if !cfg.kill {
        let phase = RunRecord::read(&record_path)
            .ok()
            .and_then(|r| r.phases.last().map(|p| p.name.clone()))
            .unwrap_or_default();
        crate::report::line(&format!(
            "ccci-run: error: run {id} still runs after {} (phase {phase}); it was asked to stop and \
             is tearing down (--kill ends it)",
            humantime::format_duration(cfg.wait)
        ));
        return Ok(Stopped {
            code: exit::LOCK_TIMEOUT,
            line: None,
        });
    }
    kill(runs_dir, &dir, &record, &target, requester, cfg.wait)
}

/// The supervisor, opened and proven: its `/proc` directory and a pidfd on it.
struct Target {
    pidfd: std::os::fd::OwnedFd,
}

/// Why a run is not live, or not to be signalled, as `stop` says it.
#[derive(Debug)]
enum NotLive {
    Dead,
    Unresolvable(String),
    Guard(String),
    /// The guard is another user's, or closed to us.
    NotYours(String),
    /// A live process, but not proven to be the run's supervisor: what did not match.
    NotProven(String),
}

impl std::fmt::Display for NotLive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Dead => f.write_str(
                "it is dead (its supervisor is gone and its record unfinished): the next janitor \
                 sweep clears it",
            ),
            Self::Unresolvable(why) => {
                write!(f, "its supervisor cannot be judged from here: {why}")
            }
            Self::Guard(why) | Self::NotYours(why) | Self::NotProven(why) => f.write_str(why),
        }
    }
}

/// Prove that `supervisor` is the live supervisor of run `id` in `dir`, and hold it by a pidfd
/// taken before the proof and checked after it: the process the pidfd names ran throughout.
/// The proof is the kernel's ([`mark::prove`]): its executable, its user ids, its descriptor
/// on the guard with the guard's flock, and the mark of the run it was started for.
fn verify(dir: &Path, supervisor: &ProcessIdentity, id: &RunId) -> Result<Target, NotLive> {
    use std::os::unix::fs::MetadataExt;
    match rundir::probe(dir, false) {
        Liveness::Live { .. } => {}
        Liveness::Free { .. } | Liveness::NoGuard => return Err(NotLive::Dead),
        Liveness::Unreadable(err) if err.is_not_ours() => {
            return Err(NotLive::NotYours(err.to_string()));
        }
        Liveness::Unreadable(err) => return Err(NotLive::Guard(err.to_string())),
    }
    let guard_path = dir.join(names::RUN_GUARD_FILE);
    let guard = std::fs::symlink_metadata(&guard_path)
        .map_err(|e| NotLive::Guard(format!("cannot inspect {}: {e}", guard_path.display())))?;
    let run_dir = std::fs::symlink_metadata(dir)
        .map_err(|e| NotLive::Guard(format!("cannot inspect {}: {e}", dir.display())))?;
    let me = nix::unistd::Uid::effective();
    if !me.is_root() && run_dir.uid() != me.as_raw() {
        return Err(NotLive::NotYours(format!(
            "{} is uid {}'s, and this is uid {me}",
            dir.display(),
            run_dir.uid()
        )));
    }
    let proc_dir = Judge::new()
        .open(supervisor)
        .map_err(|verdict| match verdict {
            Verdict::Unresolvable(why) => NotLive::Unresolvable(why),
            _ => NotLive::Dead,
        })?;
    let pid = proc_dir
        .read("stat")
        .ok()
        .and_then(|s| linux::parse_stat(&String::from_utf8_lossy(&s)))
        .map(|s| s.pid)
        .ok_or(NotLive::Dead)?;
    // The pidfd first: the directory, opened on the recorded process, still shows it running
    // after the pidfd was taken, so the pidfd is that process and no other.
    let pidfd = linux::pidfd_open(pid).map_err(|_| NotLive::Dead)?;
    if !proc_dir.running() {
        return Err(NotLive::Dead);
    }
    let expected = mark::Expected {
        run_id: id.as_str(),
        uid: run_dir.uid(),
        guard: (guard.dev(), guard.ino()),
        guard_path: &guard_path,
    };
    mark::prove(&proc_dir, pid.as_raw(), &expected).map_err(|why| match why {
        mark::Unproven::Gone => NotLive::Dead,
        mark::Unproven::Mismatch(why) => NotLive::NotProven(why),
    })?;
    // After the proof: the process the pidfd holds has not ended meanwhile.
    let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
    if poll(&mut fds, PollTimeout::ZERO).is_ok_and(|n| n > 0) || !proc_dir.running() {
        return Err(NotLive::Dead);
    }
    Ok(Target { pidfd })
}

/// Leave the request the supervisor looks for when our SIGTERM arrives.
fn request(dir: &Path, supervisor: &ProcessIdentity, by: Requester) -> Result<(), StopError> {
    let path = dir.join(names::RUN_STOP_FILE);
    let own_ns = ProcessIdentity::own().map(|p| p.pid_ns).unwrap_or_default();
    let request = StopRequest {
        uid: by.uid,
        pid: by.pid,
        pid_ns: own_ns,
        supervisor: supervisor.clone(),
        at: crate::duration::timestamp(std::time::SystemTime::now()),
    };
    let json = serde_json::to_vec(&request).map_err(std::io::Error::other);
    json.and_then(|json| {
        crate::files::write_atomically(&path, &json, false, crate::files::Mode::Umasked)
    })
    .map_err(|source| StopError::Request { path, source })
}

/// Wait until the supervisor exits or `wait` passes; whether it exited.
fn wait_exit(target: &Target, wait: Duration) -> bool {
    let until = Instant::now() + wait;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let ms = PollTimeout::try_from(left.as_millis().min(i32::MAX as u128) as i32)
            .unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(target.pidfd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, ms) {
            Ok(n) if n > 0 => return true,
            Ok(_) if left.is_zero() => return false,
            _ if Instant::now() >= until => return false,
            _ => {}
        }
    }
}

/// The run's supervisor is gone: what its record says.
fn finished(id: &RunId, record_path: &Path) -> Result<Stopped, StopError> {
    let record = RunRecord::read(record_path).map_err(|source| StopError::Record {
        path: record_path.to_owned(),
        source,
    })?;
    let Some(code) = record.exit_code else {
        let after = match &record.reaped {
            Some(at) => format!("a janitor already reaped what it left at {at}"),
            None => "the next janitor sweep clears it".to_owned(),
        };
        return Err(StopError::NotLive {
            run_id: id.clone(),
            why: format!(
                "its supervisor ended without finishing its record {} (killed?): {after}",
                record_path.display()
            ),
        });
    };
    Ok(Stopped {
        code: 0,
        line: Some(final_line(id, &record, code, record_path)),
    })
}

fn final_line(id: &RunId, record: &RunRecord, code: u8, path: &Path) -> String {
    let by = record
        .stopped_by
        .map(|by| format!(" by uid {} (pid {})", by.uid, by.pid))
        .unwrap_or_default();
    format!(
        "run {id}: {}{by}, exit {code}; record {}",
        record.shutdown_reason.as_deref().unwrap_or("command-ended"),
        path.display()
    )
}

/// `--kill`: the wait is over and the run still runs. SIGKILL its supervisor, then (it being
/// dead) its cgroup and every process that names it; record that, holding its guard.
fn kill(
    runs_dir: &Path,
    dir: &Path,
    before: &RunRecord,
    target: &Target,
    by: Requester,
    waited: Duration,
) -> Result<Stopped, StopError> {
    let id = RunId::parse(&before.run_id).map_err(|e| StopError::Record {
        path: dir.join(names::RUN_RECORD_FILE),
        source: std::io::Error::other(e.to_string()),
    })?;
    linux::pidfd_signal(target.pidfd.as_fd(), Signal::SIGKILL).map_err(|source| {
        StopError::Signal {
            what: "kill",
            run_id: id.clone(),
            source,
        }
    })?;
    if !wait_exit(target, KILL_BUDGET) {
        crate::report::line(&format!(
            "ccci-run: error: run {id}'s supervisor still runs {} after SIGKILL",
            humantime::format_duration(KILL_BUDGET)
        ));
        return Ok(Stopped {
            code: exit::LOCK_TIMEOUT,
            line: None,
        });
    }
    let record_path = dir.join(names::RUN_RECORD_FILE);
    // It may have finished its record after all, between the wait and the kill.
    if let Ok(done) = finished(&id, &record_path) {
        return Ok(done);
    }
    let scope = Scope::of_runs_dir(runs_dir).ok();
    let left = match (ProcessIdentity::own(), scope) {
        (Ok(me), Some(scope)) => {
            let own = Owner {
                process: me.clone(),
                scope,
            };
            let predecessor = Predecessor {
                process: before.supervisor.clone(),
                scope: before.scope,
                cgroup: before.cgroup.as_ref().map(PathBuf::from),
            };
            leftovers::clear_predecessor(&predecessor, &own, Instant::now() + KILL_BUDGET)
        }
        _ => Cleared::LeftAlone("this process cannot name its configuration".to_owned()),
    };
    let what = match &left {
        Cleared::Gone { killed, cgroup, .. } => format!(
            "killed its supervisor and the {killed} process(es) it left{}",
            cgroup
                .as_ref()
                .map(|c| format!(" (cgroup {}, removed)", c.display()))
                .unwrap_or_default()
        ),
        Cleared::LeftAlone(why) | Cleared::Failed(why) => {
            format!("killed its supervisor; what it left is not: {why}")
        }
    };
    let note = format!(
        "ccci-run stop --kill (uid {}, pid {}) after {}: {what}; the app, if any, is the next \
         janitor sweep's",
        by.uid,
        by.pid,
        humantime::format_duration(waited)
    );
    crate::report::line(&format!("== stop: run {id}: {note} =="));
    // Recorded holding the guard: no run of the same id writes meanwhile.
    let code = exit::for_signal(Signal::SIGKILL);
    if let Liveness::Free { guard, .. } = rundir::probe(dir, false) {
        if let Ok(mut rec) = RunRecord::read(&record_path) {
            rec.shutdown_reason
                .get_or_insert_with(|| "stopped".to_owned());
            rec.stopped_by.get_or_insert(by);
            rec.teardown_errors.push(note);
            rec.exit_code = Some(code);
            rec.enter(Phase::Finished);
            if let Err(err) = rec.write(&record_path) {
                tracing::warn!(path = %record_path.display(), "failed to write run record: {err}");
            }
        }
        // Nobody is left to take the request: it goes with the run.
        let _ = std::fs::remove_file(dir.join(names::RUN_STOP_FILE));
        drop(guard);
    }
    let record = RunRecord::read(&record_path).unwrap_or_else(|_| before.clone());
    // Killed, it tore nothing down: its app (if it deployed one) is the janitor's now.
    Ok(Stopped {
        code: 0,
        line: Some(format!(
            "{}\nrun {id}: its app, if any, is left for the next janitor sweep",
            final_line(&id, &record, code, &record_path)
        )),
    })
}

/// `ccci-run stop RUN_ID`: the stop, its line on stdout, its exit code.
pub(crate) fn command(
    cfg: &StopConfig,
    global: &crate::config::Global,
) -> Result<u8, crate::error::Error> {
    let stopped = stop(&global.runs_dir, cfg)?;
    if let Some(line) = stopped.line {
        crate::error::emit(format!("{line}\n").as_bytes())?;
    }
    Ok(stopped.code)
}
