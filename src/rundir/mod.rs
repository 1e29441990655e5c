//! The per-run directory `<runs-dir>/<run-id>/`: its guard lock, its `run.json`, and the run's
//! own `ABRA_DIR`:
//!
//! ```text
//! <runs-dir>/<run-id>/
//!   run.lock     held for the run's whole life: a second live run with this id is refused
//!   run.json     the run record
//!   abra/
//!     servers   -> <abra-home>/servers     shared: .env files stay where every tool sees them
//!     catalogue -> <abra-home>/catalogue   shared, read-mostly
//!     recipes/                             this run's alone: same-recipe runs never share a tree
//! ```
//!
//! Invariant: nothing under a run directory is removed or rebuilt unless we hold its guard lock,
//! so a live run's tree is never wiped by another run that reuses its id; and a run clears its
//! holder line before it lets the guard go, so a finished run's id can always be run again.
//!
//! Floor: backends (docs/architecture.md): imports the floors below and the other backends, never a
//! command.

pub(crate) mod phase;
pub(crate) mod record;

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use crate::lock::{HeldLock, Holder, LockError, LockFile, TryLock};
use crate::names::{self, RunId};
use crate::supervise::identity::Verdict;

/// How long a run waits for a janitor's probe of its guard to end before calling it live.
const PROBE_PATIENCE: std::time::Duration = std::time::Duration::from_secs(5);
/// How often it looks again meanwhile.
const PROBE_POLL: std::time::Duration = std::time::Duration::from_millis(10);

#[derive(Debug, thiserror::Error)]
pub(crate) enum RunDirError {
    #[error(
        "run {run_id} is already live ({theirs}; {holder}); refusing to share or wipe its \
         directory {dir} for this run ({ours})"
    )]
    Live {
        run_id: RunId,
        dir: PathBuf,
        holder: String,
        theirs: String,
        ours: String,
    },
    #[error(
        "run {run_id}'s directory {dir} keeps the record of another repository's run \
         ({theirs}); refusing to reuse it for this run ({ours}): give this run another --run-id"
    )]
    Taken {
        run_id: RunId,
        dir: PathBuf,
        theirs: String,
        ours: String,
    },
    #[error("refusing run directory {dir}: {why}")]
    Unsafe { dir: PathBuf, why: String },
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("failed to {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn io_err<'p>(what: &'static str, path: &'p Path) -> impl FnOnce(io::Error) -> RunDirError + 'p {
    move |source| RunDirError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

/// Who claims a run directory: the run id and what tells one run of it from another's.
#[derive(Debug)]
pub(crate) struct Claimant<'a> {
    pub run_id: &'a RunId,
    /// The Drone repository (`owner/name`) of the run's build, when known.
    pub repo: Option<&'a str>,
    pub recipe: &'a str,
    /// The guard's holder line.
    pub holder: &'a str,
}

/// How a run is named in a refusal: its repository (or none) and recipe.
fn describe(repo: Option<&str>, recipe: &str) -> String {
    match repo {
        Some(repo) => format!("repository {repo}, recipe {recipe}"),
        None => format!("no repository, recipe {recipe}"),
    }
}

/// The record in `dir`, when there is one that reads.
fn record_in(dir: &Path) -> Option<record::RunRecord> {
    record::RunRecord::read(&dir.join(crate::names::RUN_RECORD_FILE)).ok()
}

/// The names every recorded run of an app gave (their union), by domain: what the app's objects
/// that carry no stack label are named. A domain no readable record gives names for is absent
/// (then labels alone decide). Each record's names count only under its own stack.
pub(crate) fn given_names(runs_dir: &Path) -> BTreeMap<String, crate::names::GivenNames> {
    let mut out: BTreeMap<String, crate::names::GivenNames> = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(runs_dir) else {
        return out;
    };
    for entry in entries.flatten() {
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Some(record) = record_in(&entry.path()) else {
            continue;
        };
        let Some(given) = record.given_names else {
            continue;
        };
        if record.domain.is_empty() || record.stack != record.domain.replace('.', "_") {
            continue;
        }
        let given = given.under(&record.stack);
        out.entry(record.domain).or_default().merge(&given);
    }
    out
}

/// A run directory we own for as long as this value lives.
#[derive(Debug)]
pub(crate) struct RunDir {
    dir: PathBuf,
    _guard: HeldLock,
}

/// The runs dir must not let others replace our entries: writable by others is only acceptable
/// with the sticky bit (then nobody but us can rename or remove what we made there).
/// Make `dir` in its parent (0755 under the usual umask), unless it is there.
fn make_dir(dir: &Path) -> io::Result<()> {
    match std::fs::DirBuilder::new().create(dir) {
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        done => done,
    }
}

/// Refuse a runs dir that others may write to without the sticky bit: they could replace a
/// run's directory.
fn check_runs_dir_mode(runs_dir: &Path) -> Result<(), RunDirError> {
    use std::os::unix::fs::PermissionsExt;
    let Ok(meta) = std::fs::metadata(runs_dir) else {
        return Ok(()); // created below, by us
    };
    let mode = meta.permissions().mode();
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(RunDirError::Unsafe {
            dir: runs_dir.to_owned(),
            why: format!(
                "mode {:o} lets others replace run directories (--runs-dir, CCCI_RUNS_DIR)",
                mode & 0o7777
            ),
        });
    }
    Ok(())
}

/// The run directory must be a real directory of ours: a symbolic link planted under that
/// name (by anyone who can write to the runs dir) would have us wipe and write through it.
fn check_own_dir(dir: &Path) -> Result<(), RunDirError> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(dir).map_err(io_err("inspect run directory", dir))?;
    let unsafe_dir = |why: String| RunDirError::Unsafe {
        dir: dir.to_owned(),
        why,
    };
    if meta.file_type().is_symlink() {
        return Err(unsafe_dir("it is a symbolic link".to_owned()));
    }
    if !meta.is_dir() {
        return Err(unsafe_dir("it is not a directory".to_owned()));
    }
    if !crate::trust::ours(meta.uid()) {
        return Err(unsafe_dir(format!(
            "it is owned by uid {}, not by {}",
            meta.uid(),
            crate::trust::who()
        )));
    }
    Ok(())
}

/// What a look at a run directory's guard (`run.lock`) saw: the one way to tell whether a run
/// is live.
#[derive(Debug)]
pub(crate) enum Liveness {
    /// There is no guard file (only when asked not to create one): no run is there.
    NoGuard,
    /// Nobody held it and now we do: no run is live there. `current`: the path still names
    /// the locked file (the directory was not removed and made anew meanwhile).
    Free { guard: HeldLock, current: bool },
    /// Someone holds it: a live run, which wrote its holder line, or a moment's probe, which
    /// wrote none.
    Live { holder: String },
    /// The guard could not be opened or locked.
    Unreadable(LockError),
}

impl Liveness {
    /// The live run's holder line, parsed.
    pub(crate) fn holder(&self) -> Option<Holder> {
        match self {
            Self::Live { holder } => Holder::parse(holder),
            _ => None,
        }
    }
}

/// Open the guard of the run directory `dir` (creating it only when `create`), try it without
/// waiting and, when it is held, read who holds it. A guard taken is handed back held.
pub(crate) fn probe(dir: &Path, create: bool) -> Liveness {
    let path = dir.join(crate::names::RUN_GUARD_FILE);
    let opened = if create {
        LockFile::open(&path).map(Some)
    } else {
        LockFile::open_existing(&path)
    };
    let file = match opened {
        Ok(Some(file)) => file,
        Ok(None) => return Liveness::NoGuard,
        Err(err) => return Liveness::Unreadable(err),
    };
    match file.try_lock() {
        Ok(TryLock::Acquired(guard)) => match guard.identity_matches() {
            Ok(current) => Liveness::Free { guard, current },
            Err(err) => Liveness::Unreadable(err),
        },
        Ok(TryLock::Busy(mut file)) => Liveness::Live {
            holder: file.read_holder(),
        },
        Err(err) => Liveness::Unreadable(err),
    }
}

/// Whether a held guard's holder line names a run that may be live. A run clears its line
/// before it lets go of the guard, so a held guard with no line, or with the line of a run
/// judged dead (one that was SIGKILLed: it could not clear it), is held by a janitor's probe.
fn names_a_live_run(holder_line: &str) -> bool {
    if holder_line.trim().is_empty() {
        return false;
    }
    match Holder::parse(holder_line).and_then(|h| h.trace.process) {
        Some(process) => process.judge() != Verdict::Dead,
        // A line we cannot read: whoever wrote it, it is not ours to call dead.
        None => true,
    }
}

impl RunDir {
    /// Create (or reuse, when its last run has ended) `<runs-dir>/<run-id>/` and take its guard.
    ///
    /// A guard held by someone who names no live run is a janitor's probe (retention, the
    /// record of a reap), held for moments: wait for it rather than refuse. If retention removed
    /// the directory meanwhile, the lock we got is on an unlinked file: start over.
    ///
    /// A directory whose record names another repository is never reused, live or not: the id
    /// was given twice (`--run-id`), and that run's record stays as it was.
    pub(crate) fn claim(runs_dir: &Path, claimant: &Claimant<'_>) -> Result<Self, RunDirError> {
        let run_id = claimant.run_id;
        let ours = describe(claimant.repo, claimant.recipe);
        let dir = runs_dir.join(run_id.as_str());
        check_runs_dir_mode(runs_dir)?;
        // The runs dir and the run's are each made in their parent only: a missing parent of
        // the runs dir is a setting to fix (`config::dirs`), never made.
        make_dir(runs_dir).map_err(io_err("create runs dir", runs_dir))?;
        let started = std::time::Instant::now();
        loop {
            // Retention may remove the directory between any two of these steps (it holds the
            // old guard while it does): a vanished directory means "go round again".
            let gone = |err: &RunDirError| {
                let source = match err {
                    RunDirError::Io { source, .. } => source,
                    RunDirError::Lock(LockError::Io { source, .. }) => source,
                    _ => return false,
                };
                source.kind() == io::ErrorKind::NotFound && started.elapsed() < PROBE_PATIENCE
            };
            let made = make_dir(&dir)
                .map_err(io_err("create run directory", &dir))
                .and_then(|()| check_own_dir(&dir));
            let liveness = match made {
                Ok(()) => probe(&dir, true),
                Err(err) if gone(&err) => continue,
                Err(err) => return Err(err),
            };
            match liveness {
                Liveness::Free { current: false, .. } | Liveness::NoGuard => continue,
                Liveness::Free { mut guard, .. } => {
                    // Under the guard: no run of this id writes its record meanwhile.
                    if let Some(theirs) = record_in(&dir) {
                        if theirs.repo.as_deref() != claimant.repo {
                            return Err(RunDirError::Taken {
                                run_id: run_id.clone(),
                                dir,
                                theirs: describe(theirs.repo.as_deref(), &theirs.recipe),
                                ours,
                            });
                        }
                    }
                    guard.write_holder(claimant.holder)?;
                    return Ok(Self { dir, _guard: guard });
                }
                Liveness::Unreadable(err) => {
                    let err = RunDirError::Lock(err);
                    if gone(&err) {
                        continue;
                    }
                    return Err(err);
                }
                Liveness::Live { holder: held_by } => {
                    if !names_a_live_run(&held_by) && started.elapsed() < PROBE_PATIENCE {
                        std::thread::sleep(PROBE_POLL);
                        continue;
                    }
                    let theirs = record_in(&dir).map_or_else(
                        || "its record not written yet".to_owned(),
                        |r| describe(r.repo.as_deref(), &r.recipe),
                    );
                    return Err(RunDirError::Live {
                        run_id: run_id.clone(),
                        dir,
                        holder: held_by,
                        theirs,
                        ours,
                    });
                }
            }
        }
    }

    pub(crate) fn record_path(&self) -> PathBuf {
        self.dir.join(crate::names::RUN_RECORD_FILE)
    }

    /// Where `ccci-run stop` leaves its request for this run.
    pub(crate) fn stop_request_path(&self) -> PathBuf {
        self.dir.join(crate::names::RUN_STOP_FILE)
    }

    /// Build a fresh `abra/` for this run, replacing whatever a previous run with this id left.
    ///
    /// The canonical `servers/` and `catalogue/` are created if missing so the links never dangle.
    pub(crate) fn prepare_abra_dir(&self, abra_home: &Path) -> Result<PathBuf, RunDirError> {
        let abra_home = std::path::absolute(abra_home).map_err(io_err("resolve", abra_home))?;
        let abra = self.dir.join(names::RUN_ABRA_DIR);
        match std::fs::remove_dir_all(&abra) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => return Err(io_err("remove the previous run's", &abra)(err)),
        }
        std::fs::DirBuilder::new()
            .create(&abra)
            .map_err(io_err("create", &abra))?;
        for shared in [names::ABRA_SERVERS, names::ABRA_CATALOGUE] {
            let canonical = abra_home.join(shared);
            std::fs::create_dir_all(&canonical).map_err(io_err("create", &canonical))?;
            let link = abra.join(shared);
            std::os::unix::fs::symlink(&canonical, &link).map_err(io_err("create link", &link))?;
        }
        let recipes = abra.join(names::ABRA_RECIPES);
        std::fs::DirBuilder::new()
            .create(&recipes)
            .map_err(io_err("create", &recipes))?;
        Ok(abra)
    }
}
