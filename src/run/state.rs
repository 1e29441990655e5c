//! Run-scoped state files: `<state-dir>/ccci-<kind>-<scope>-<run-id>-<pid>`, created 0600
//! before the command starts and removed at teardown.
//!
//! Invariant: they are keyed by the configuration's scope, run id and supervisor pid, never by
//! app domain. A second run of the same domain runs its set-up while the first is still live,
//! so a domain-keyed file would be reset under the first run's feet; and configurations that
//! share a state dir reuse run ids (Drone build numbers), so only the scope tells whose a file
//! is.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;
use nix::unistd::Uid;

use crate::names::{RunId, STATE_FILES, state_file_name};
use crate::supervise::identity::Scope;

#[derive(Debug, thiserror::Error)]
pub(crate) enum StateError {
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
pub(crate) struct StateFiles {
    files: Vec<(&'static str, PathBuf)>,
}

impl StateFiles {
    /// The path of one kind of state file for a run.
    pub(crate) fn path(dir: &Path, kind: &str, scope: Scope, run_id: &RunId, pid: u32) -> PathBuf {
        dir.join(state_file_name(kind, &scope.to_string(), run_id, pid))
    }

    /// Create every kind, empty and 0600. A leftover from a dead run that had our pid is
    /// replaced if it is our own regular file, refused otherwise (it may be a planted symlink).
    pub(crate) fn create(
        dir: &Path,
        scope: Scope,
        run_id: &RunId,
        pid: u32,
    ) -> Result<Self, StateError> {
        // A missing state dir is created like the other dirs (root-only when we make it), in
        // its parent only: a missing parent is a setting to fix (`config::dirs`).
        if !dir.exists() {
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(dir)
                .map_err(|source| StateError::Create {
                    path: dir.to_owned(),
                    source,
                })?;
        }
        let mut created = Self::default();
        for (kind, var) in STATE_FILES {
            let path = Self::path(dir, kind, scope, run_id, pid);
            if let Err(err) = create_private(&path) {
                created.remove();
                return Err(err);
            }
            created.files.push((var, path));
        }
        Ok(created)
    }

    /// `(variable, path)` pairs for the command's environment.
    pub(crate) fn env(&self) -> impl Iterator<Item = (&'static str, &Path)> {
        self.files.iter().map(|(var, path)| (*var, path.as_path()))
    }

    /// Remove them all; returns the failures (a file already gone is not one).
    pub(crate) fn remove(&mut self) -> Vec<String> {
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

#[expect(
    clippy::disallowed_methods,
    reason = "a run's own state file, made with O_EXCL"
)]
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
    use crate::names::parse_state_file_name;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn files_are_private_keyed_by_run_and_pid_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunId::parse("41").unwrap();
        let scope = Scope::of_runs_dir(dir.path()).unwrap();
        let mut files = StateFiles::create(dir.path(), scope, &run, 4242).unwrap();
        let paths: Vec<_> = files.env().map(|(_, p)| p.to_owned()).collect();
        assert_eq!(
            paths[0],
            dir.path().join(format!("ccci-deploys-{scope}-41-4242"))
        );
        for path in &paths {
            let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", path.display());
        }
        assert!(files.remove().is_empty());
        assert!(paths.iter().all(|p| !p.exists()));
    }

    #[test]
    fn file_names_parse_back_to_scope_run_and_pid() {
        let run = RunId::parse("build-7.1").unwrap();
        let scope = Scope::of_runs_dir(Path::new("/")).unwrap();
        let shown = scope.to_string();
        for (kind, _) in STATE_FILES {
            let path = StateFiles::path(Path::new("/tmp"), kind, scope, &run, 4242);
            let name = path.file_name().unwrap().to_str().unwrap();
            assert_eq!(
                parse_state_file_name(name),
                Some((shown.as_str(), run.clone(), 4242))
            );
        }
        for bad in [
            "ccci-deploys-",
            "ccci-deploys-x-",
            "ccci-other-7-1",
            "ccci-deploys--1",
            // Without a scope (as older runs named them): nobody's we can judge.
            "ccci-deploys-41-4242",
            "ccci-deploys-c12-41-4242",
            "ccci-deploys-c1.x-41-4242",
            "ccci-deploys-c1.2--4242",
            "ccci-deploys-c1.2-41-",
            "x",
        ] {
            assert_eq!(parse_state_file_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn leftover_regular_file_is_replaced_but_a_symlink_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunId::parse("7").unwrap();
        let scope = Scope::of_runs_dir(dir.path()).unwrap();
        let leftover = StateFiles::path(dir.path(), "deploys", scope, &run, 1);
        std::fs::write(&leftover, "old").unwrap();
        let mut files = StateFiles::create(dir.path(), scope, &run, 1).unwrap();
        assert_eq!(
            crate::files::read_text(&leftover, &crate::files::Rules::small(64)).unwrap(),
            ""
        );
        files.remove();

        let target = dir.path().join("victim");
        std::fs::write(&target, "keep").unwrap();
        std::os::unix::fs::symlink(&target, &leftover).unwrap();
        let err = StateFiles::create(dir.path(), scope, &run, 1).unwrap_err();
        assert!(matches!(err, StateError::Unsafe { .. }), "{err}");
        assert_eq!(
            crate::files::read_text(&target, &crate::files::Rules::small(64)).unwrap(),
            "keep"
        );
        // Nothing half-created is left behind for the other kinds.
        assert!(!StateFiles::path(dir.path(), "opstate", scope, &run, 1).exists());
    }
}
