//! The configured directories (the lock, runs and state dirs) and the one rule for a missing
//! one, which every command keeps:
//! - a directory whose parent is missing is refused before anything is done (exit 2, one
//!   message, [`ParentMissing`]): it is a typo or a host not set up, and nothing makes it;
//! - a directory whose parent exists is made, one level and no more, by the commands that keep
//!   something there (`run`, `lock`, the janitor's sweep for its probe locks), and read as
//!   empty by those that only look (`locks`, `runs`, `stop`, `janitor --dry-run`), which say
//!   so in one line ([`missing_line`]).
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

use std::io;
use std::path::{Path, PathBuf};

/// One configured directory, named as every message names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dir {
    Lock,
    Runs,
    State,
}

impl Dir {
    /// What it is called: `lock dir`.
    pub(crate) fn kind(self) -> &'static str {
        match self {
            Self::Lock => "lock dir",
            Self::Runs => "runs dir",
            Self::State => "state dir",
        }
    }

    /// Where it is set: its flag, variable and file key.
    pub(crate) fn sources(self) -> &'static str {
        match self {
            Self::Lock => "--lock-dir, CCCI_APP_LOCK_DIR, lock_dir",
            Self::Runs => "--runs-dir, CCCI_RUNS_DIR, runs_dir",
            Self::State => "--state-dir, CCCI_STATE_DIR, state_dir",
        }
    }

    /// Which commands make it when it is missing.
    fn makers(self) -> &'static str {
        match self {
            Self::Lock => "run, lock and janitor make it",
            Self::Runs => "run and lock make it",
            Self::State => "run makes it",
        }
    }
}

/// A configured directory that does not exist, and neither does its parent.
#[derive(Debug, thiserror::Error)]
#[error(
    "{} {} ({}) does not exist, nor does its parent {}: ccci-run makes a missing {} only in a \
     directory that exists; create it (mkdir -p {}), or set the {} this host uses",
    .dir.kind(), .path.display(), .dir.sources(), .parent.display(), .dir.kind(),
    .path.display(), .dir.kind()
)]
pub(crate) struct ParentMissing {
    pub dir: Dir,
    pub path: PathBuf,
    pub parent: PathBuf,
}

/// Whether `path`, the `dir` setting's value, exists (`Ok(true)`), is missing where it could
/// be made (`Ok(false)`), or is missing with its parent. What cannot be looked at (a parent we
/// may not search) counts as there: whoever uses it says what is wrong.
pub(crate) fn look(dir: Dir, path: &Path) -> Result<bool, ParentMissing> {
    let missing =
        |p: &Path| matches!(p.symlink_metadata(), Err(e) if e.kind() == io::ErrorKind::NotFound);
    if !missing(path) {
        return Ok(true);
    }
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() && missing(parent) => Err(ParentMissing {
            dir,
            path: path.to_owned(),
            parent: parent.to_owned(),
        }),
        _ => Ok(false),
    }
}

/// The one line a command that only looks says of a missing `dir` (whose parent exists).
pub(crate) fn missing_line(dir: Dir, path: &Path) -> String {
    format!(
        "{} {} ({}) does not exist: nothing there yet ({})",
        dir.kind(),
        path.display(),
        dir.sources(),
        dir.makers()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_dir_is_refused_only_when_its_parent_is_missing_too() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(look(Dir::Lock, tmp.path()).unwrap());
        assert!(!look(Dir::Lock, &tmp.path().join("locks")).unwrap());
        let nested = tmp.path().join("x/locks");
        let err = look(Dir::Lock, &nested).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "lock dir {0}/x/locks (--lock-dir, CCCI_APP_LOCK_DIR, lock_dir) does not exist, \
                 nor does its parent {0}/x: ccci-run makes a missing lock dir only in a \
                 directory that exists; create it (mkdir -p {0}/x/locks), or set the lock dir \
                 this host uses",
                tmp.path().display()
            )
        );
        assert!(missing_line(Dir::Runs, &nested).contains(
            "(--runs-dir, CCCI_RUNS_DIR, runs_dir) does not exist: nothing there yet (run and \
             lock make it)"
        ));
    }
}
