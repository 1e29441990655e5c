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
//! so a live run's tree is never wiped by another run that reuses its id.

use std::io;
use std::path::{Path, PathBuf};

use crate::lock::{HeldLock, LockError, LockFile, TryLock};
use crate::names::RunId;
use crate::record;

pub const GUARD_FILE: &str = "run.lock";

#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error(
        "run {run_id} is already live ({holder}); refusing to share or wipe its directory {dir}"
    )]
    Live {
        run_id: RunId,
        dir: PathBuf,
        holder: String,
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

/// A run directory we own for as long as this value lives.
#[derive(Debug)]
pub struct RunDir {
    dir: PathBuf,
    _guard: HeldLock,
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
    let us = nix::unistd::Uid::effective().as_raw();
    if meta.uid() != us {
        return Err(unsafe_dir(format!(
            "it is owned by uid {}, not by us (uid {us})",
            meta.uid()
        )));
    }
    Ok(())
}

impl RunDir {
    /// Create (or reuse, when its last run has ended) `<runs-dir>/<run-id>/` and take its guard.
    pub fn claim(runs_dir: &Path, run_id: &RunId, holder: &str) -> Result<Self, RunDirError> {
        let dir = runs_dir.join(run_id.as_str());
        std::fs::create_dir_all(&dir).map_err(io_err("create run directory", &dir))?;
        check_own_dir(&dir)?;
        let guard = match LockFile::open(&dir.join(GUARD_FILE))?.try_lock()? {
            TryLock::Acquired(guard) => guard,
            TryLock::Busy(mut file) => {
                return Err(RunDirError::Live {
                    run_id: run_id.clone(),
                    dir,
                    holder: file.read_holder(),
                });
            }
        };
        let mut guard = guard;
        guard.write_holder(holder)?;
        Ok(Self { dir, _guard: guard })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    pub fn record_path(&self) -> PathBuf {
        self.dir.join(record::FILE_NAME)
    }

    /// Build a fresh `abra/` for this run, replacing whatever a previous run with this id left.
    ///
    /// The canonical `servers/` and `catalogue/` are created if missing so the links never dangle.
    pub fn prepare_abra_dir(&self, abra_home: &Path) -> Result<PathBuf, RunDirError> {
        let abra_home = std::path::absolute(abra_home).map_err(io_err("resolve", abra_home))?;
        let abra = self.dir.join("abra");
        match std::fs::remove_dir_all(&abra) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => return Err(io_err("remove the previous run's", &abra)(err)),
        }
        std::fs::create_dir(&abra).map_err(io_err("create", &abra))?;
        for shared in ["servers", "catalogue"] {
            let canonical = abra_home.join(shared);
            std::fs::create_dir_all(&canonical).map_err(io_err("create", &canonical))?;
            let link = abra.join(shared);
            std::os::unix::fs::symlink(&canonical, &link).map_err(io_err("create link", &link))?;
        }
        let recipes = abra.join("recipes");
        std::fs::create_dir(&recipes).map_err(io_err("create", &recipes))?;
        Ok(abra)
    }
}
