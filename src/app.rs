//! Removing a run app: what a run's teardown and the janitor's reap both do to make an app
//! domain disappear. Removal is idempotent: what is already gone counts as removed.

use std::io;
use std::path::{Path, PathBuf};

use crate::names::AppDomain;

/// What one removal took away.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Removed {
    pub env_files: Vec<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
#[error("failed to {what} {path}: {source}")]
pub struct RemoveError {
    what: &'static str,
    path: PathBuf,
    #[source]
    source: io::Error,
}

/// The `.env` files abra keeps for `domain`: `<abra-home>/servers/<server>/<domain>.env`.
pub fn env_files(abra_home: &Path, domain: &AppDomain) -> Result<Vec<PathBuf>, RemoveError> {
    let servers = abra_home.join("servers");
    let entries = match std::fs::read_dir(&servers) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(RemoveError {
                what: "list",
                path: servers,
                source,
            });
        }
    };
    let file_name = format!("{domain}.env");
    let mut found = Vec::new();
    for entry in entries.flatten() {
        // Only real server directories: a symlinked server entry is not followed.
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            let candidate = entry.path().join(&file_name);
            // A file or a link; a directory by that name is not an env file and is left alone.
            if std::fs::symlink_metadata(&candidate).is_ok_and(|m| !m.is_dir()) {
                found.push(candidate);
            }
        }
    }
    found.sort();
    Ok(found)
}

/// Remove the app's `.env` files. A directory in the way is an error, never recursed into.
pub fn remove(abra_home: &Path, domain: &AppDomain) -> Result<Removed, RemoveError> {
    let mut removed = Removed::default();
    for path in env_files(abra_home, domain)? {
        match std::fs::remove_file(&path) {
            Ok(()) => removed.env_files.push(path),
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(RemoveError {
                    what: "remove",
                    path,
                    source,
                });
            }
        }
    }
    Ok(removed)
}
