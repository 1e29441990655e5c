//! Run-scoped state files: `<state-dir>/ccci-<kind>-<run-id>-<pid>`, created 0600 before the
//! command starts and removed at teardown.
//!
//! Invariant: they are keyed by run id and supervisor pid, never by app domain. A second run of
//! the same domain runs its set-up while the first is still live, so a domain-keyed file would be
//! reset under the first run's feet.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;
use nix::unistd::Uid;

use crate::names::RunId;

/// The kinds of state file, with the environment variable each one is exported as.
pub const KINDS: [(&str, &str); 4] = [
    ("deploys", "CCCI_DEPLOYS_FILE"),
    ("opstate", "CCCI_OPSTATE_FILE"),
    ("deps", "CCCI_DEPS_FILE"),
    ("depskip", "CCCI_DEPSKIP_FILE"),
];

/// The run id and pid a state file name (`ccci-<kind>-<run-id>-<pid>`) belongs to.
pub fn parse_file_name(name: &str) -> Option<(RunId, u32)> {
    let rest = name.strip_prefix("ccci-")?;
    let rest = KINDS
        .iter()
        .find_map(|(kind, _)| rest.strip_prefix(kind)?.strip_prefix('-'))?;
    let (run_id, pid) = rest.rsplit_once('-')?;
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((RunId::parse(run_id).ok()?, pid.parse().ok()?))
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("failed to create state file {path}: {source}")]
    Create {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("refusing state file {path}: a leftover that is not our regular file is in the way")]
    Unsafe { path: PathBuf },
}

/// The run's state files, created and owned by this run.
#[derive(Debug, Default)]
pub struct StateFiles {
    files: Vec<(&'static str, PathBuf)>,
}

impl StateFiles {
    /// The path of one kind of state file for a run.
    pub fn path(dir: &Path, kind: &str, run_id: &RunId, pid: u32) -> PathBuf {
        dir.join(format!("ccci-{kind}-{run_id}-{pid}"))
    }

    /// Create every kind, empty and 0600. A leftover from a dead run that had our pid is
    /// replaced if it is our own regular file, refused otherwise (it may be a planted symlink).
    pub fn create(dir: &Path, run_id: &RunId, pid: u32) -> Result<Self, StateError> {
        // A missing state dir is created like the other dirs (root-only when we make it).
        if !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|source| StateError::Create {
                    path: dir.to_owned(),
                    source,
                })?;
        }
        let mut created = Self::default();
        for (kind, var) in KINDS {
            let path = Self::path(dir, kind, run_id, pid);
            if let Err(err) = create_private(&path) {
                created.remove();
                return Err(err);
            }
            created.files.push((var, path));
        }
        Ok(created)
    }

    /// `(variable, path)` pairs for the command's environment.
    pub fn env(&self) -> impl Iterator<Item = (&'static str, &Path)> {
        self.files.iter().map(|(var, path)| (*var, path.as_path()))
    }

    /// Remove them all; returns the failures (a file already gone is not one).
    pub fn remove(&mut self) -> Vec<String> {
        let mut errors = Vec::new();
        for (_, path) in self.files.drain(..) {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(err) => errors.push(format!(
                    "failed to remove state file {}: {err}",
                    path.display()
                )),
            }
        }
        errors
    }
}

fn create_private(path: &Path) -> Result<(), StateError> {
    let open = || {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
            .open(path)
    };
    let create_err = |source| StateError::Create {
        path: path.to_owned(),
        source,
    };
    match open() {
        Ok(_) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists => {
            let meta = std::fs::symlink_metadata(path).map_err(create_err)?;
            if !meta.file_type().is_file() || meta.uid() != Uid::effective().as_raw() {
                return Err(StateError::Unsafe {
                    path: path.to_owned(),
                });
            }
            std::fs::remove_file(path).map_err(create_err)?;
            open().map(drop).map_err(create_err)
        }
        Err(err) => Err(create_err(err)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn files_are_private_keyed_by_run_and_pid_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunId::parse("41").unwrap();
        let mut files = StateFiles::create(dir.path(), &run, 4242).unwrap();
        let paths: Vec<_> = files.env().map(|(_, p)| p.to_owned()).collect();
        assert_eq!(paths[0], dir.path().join("ccci-deploys-41-4242"));
        for path in &paths {
            let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", path.display());
        }
        assert!(files.remove().is_empty());
        assert!(paths.iter().all(|p| !p.exists()));
    }

    #[test]
    fn file_names_parse_back_to_run_and_pid() {
        let run = RunId::parse("build-7.1").unwrap();
        for (kind, _) in KINDS {
            let path = StateFiles::path(Path::new("/tmp"), kind, &run, 4242);
            let name = path.file_name().unwrap().to_str().unwrap();
            assert_eq!(parse_file_name(name), Some((run.clone(), 4242)));
        }
        for bad in [
            "ccci-deploys-",
            "ccci-deploys-x-",
            "ccci-other-7-1",
            "ccci-deploys--1",
            "x",
        ] {
            assert_eq!(parse_file_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn leftover_regular_file_is_replaced_but_a_symlink_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunId::parse("7").unwrap();
        let leftover = StateFiles::path(dir.path(), "deploys", &run, 1);
        std::fs::write(&leftover, "old").unwrap();
        let mut files = StateFiles::create(dir.path(), &run, 1).unwrap();
        assert_eq!(std::fs::read_to_string(&leftover).unwrap(), "");
        files.remove();

        let target = dir.path().join("victim");
        std::fs::write(&target, "keep").unwrap();
        std::os::unix::fs::symlink(&target, &leftover).unwrap();
        let err = StateFiles::create(dir.path(), &run, 1).unwrap_err();
        assert!(matches!(err, StateError::Unsafe { .. }), "{err}");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
        // Nothing half-created is left behind for the other kinds.
        assert!(!StateFiles::path(dir.path(), "opstate", &run, 1).exists());
    }
}
