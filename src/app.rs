//! Removing a run app: what a run's teardown and the janitor's reap both do to make an app
//! domain disappear. Removal is idempotent: what is already gone counts as removed.
//!
//! Floor: backends (docs/architecture.md): imports the floors below and the other backends, never a
//! command.

use std::io;
use std::path::{Path, PathBuf};

use std::time::Duration;

use serde::Serialize;

use crate::config::Global;
use crate::docker::{DockerLink, GivenBy, Kept, RemovedNames};
use crate::names::AppDomain;

/// What one removal took away.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Removed {
    pub env_files: Vec<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
#[error("failed to {what} {path}: {source}")]
pub(crate) struct RemoveError {
    what: &'static str,
    path: PathBuf,
    #[source]
    source: io::Error,
}

/// A server directory of the abra home, as discovery and removal use it: where its `.env` files
/// are (the link's target, for a linked server directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServerDir {
    /// `<abra-home>/servers/<server>`, as it is named.
    pub named: PathBuf,
    /// Where its files are: `named` itself, or the directory its link points to.
    pub dir: PathBuf,
}

/// Every server directory under `<abra-home>/servers`, in name order, and a line for each
/// entry that is not followed. abra's docs recommend one git repository per server linked into
/// `servers/`, so a link is followed — to a real directory owned by us or root and writable
/// by nobody else (a directory anyone can write to could be filled with `.env` files of apps
/// that are not ours). Anything else (a file, a dangling link, a link to someone else's
/// directory) is refused and named. `Ok(None)` when `servers/` does not exist.
#[allow(clippy::type_complexity)]
pub(crate) fn server_dirs(
    abra_home: &Path,
) -> Result<Option<(Vec<ServerDir>, Vec<String>)>, RemoveError> {
    use std::os::unix::fs::MetadataExt;
    let servers = abra_home.join(crate::names::ABRA_SERVERS);
    let entries = match std::fs::read_dir(&servers) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(RemoveError {
                what: "list",
                path: servers,
                source,
            });
        }
    };
    let mut dirs = Vec::new();
    let mut refused = Vec::new();
    for entry in entries.flatten() {
        let named = entry.path();
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            dirs.push(ServerDir {
                dir: named.clone(),
                named,
            });
            continue;
        }
        if !kind.is_symlink() {
            continue;
        }
        let target = match std::fs::canonicalize(&named) {
            Ok(target) => target,
            Err(err) => {
                refused.push(format!(
                    "server directory {} is a link that leads nowhere ({err}): not followed",
                    named.display()
                ));
                continue;
            }
        };
        let why = match std::fs::symlink_metadata(&target) {
            Err(err) => Some(format!("cannot inspect it: {err}")),
            Ok(meta) if !meta.is_dir() => Some("it is not a directory".to_owned()),
            Ok(meta) if !crate::trust::ours(meta.uid()) && meta.uid() != 0 => Some(format!(
                "it is owned by uid {}, neither {} nor root",
                meta.uid(),
                crate::trust::who()
            )),
            Ok(meta) if meta.mode() & 0o022 != 0 => Some(format!(
                "others may write to it (mode {:o})",
                meta.mode() & 0o7777
            )),
            Ok(_) => None,
        };
        match why {
            None => dirs.push(ServerDir { named, dir: target }),
            Some(why) => refused.push(format!(
                "server directory {} links to {}, which is not followed: {why}",
                named.display(),
                target.display()
            )),
        }
    }
    dirs.sort_by(|a, b| a.named.cmp(&b.named));
    Ok(Some((dirs, refused)))
}

/// The `.env` files abra keeps for `domain`: `<abra-home>/servers/<server>/<domain>.env`, found
/// through a linked server directory as [`server_dirs`] allows, and named by where they are
/// (the link's target), so that removing one removes that file.
pub(crate) fn env_files(abra_home: &Path, domain: &AppDomain) -> Result<Vec<PathBuf>, RemoveError> {
    let Some((dirs, refused)) = server_dirs(abra_home)? else {
        return Ok(Vec::new());
    };
    for line in refused {
        tracing::warn!("{line}");
    }
    let file_name = format!("{domain}.env");
    let mut found = Vec::new();
    for server in dirs {
        let candidate = server.dir.join(&file_name);
        // A file or a link; a directory by that name is not an env file and is left alone.
        if std::fs::symlink_metadata(&candidate).is_ok_and(|m| !m.is_dir()) {
            found.push(candidate);
        }
    }
    found.sort();
    Ok(found)
}

/// Remove the app's `.env` files. A directory in the way is an error, never recursed into.
pub(crate) fn remove(abra_home: &Path, domain: &AppDomain) -> Result<Removed, RemoveError> {
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

/// What was removed for one candidate: its Docker resources (flattened into the contract's
/// `removed` object), its `.env` files, its lock file.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct RemovedResources {
    #[serde(flatten)]
    pub docker: RemovedNames,
    pub env_files: Vec<PathBuf>,
    pub lock_file: bool,
}

impl RemovedResources {
    /// "2 services, 1 network, 1 env file, lock file": what is there, in words.
    pub(crate) fn summary(&self) -> String {
        let parts: Vec<String> = self
            .counts()
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(kind, n)| {
                let singular = kind.trim_end_matches('s').replace('_', " ");
                match (*kind, *n) {
                    ("lock_files", _) => "lock file".to_owned(),
                    (_, 1) => format!("1 {singular}"),
                    (_, n) => format!("{n} {}", kind.replace('_', " ")),
                }
            })
            .collect();
        if parts.is_empty() {
            "nothing".to_owned()
        } else {
            parts.join(", ")
        }
    }

    pub(crate) fn nothing_but_lock_file(&self) -> bool {
        self.counts()[..7].iter().all(|(_, n)| *n == 0)
    }

    /// How many of each kind, in a fixed order.
    pub(crate) fn counts(&self) -> [(&'static str, usize); 8] {
        [
            ("services", self.docker.services.len()),
            ("containers", self.docker.containers.len()),
            ("networks", self.docker.networks.len()),
            ("volumes", self.docker.volumes.len()),
            ("secrets", self.docker.secrets.len()),
            ("configs", self.docker.configs.len()),
            ("env_files", self.env_files.len()),
            ("lock_files", usize::from(self.lock_file)),
        ]
    }
}

/// Whether anything of `domain`'s app is there: its `.env`, or (Docker on) any resource of its
/// stack. An unreachable engine counts as "maybe": the removal that follows will say why.
pub(crate) fn app_has_leftovers(
    global: &Global,
    link: &DockerLink,
    domain: &AppDomain,
    given: GivenBy<'_>,
) -> bool {
    app_present(global, domain)
        || match link.get() {
            None => false,
            Some(Err(_)) => true,
            Some(Ok(seam)) => seam
                .discover(&global.pattern, given)
                .map(|stacks| stacks.get(domain).is_some_and(|s| !s.is_empty()))
                .unwrap_or(true),
        }
}

pub(crate) fn app_present(global: &Global, domain: &AppDomain) -> bool {
    env_files(&global.abra_home, domain).is_ok_and(|files| !files.is_empty())
}

/// Where a reap that could not be confirmed is recorded, one file per app domain (the stack's
/// name follows from it): in the state dir, which neither a teardown hook nor an operator
/// removing the app's `.env` (`abra app rm`) touches. Every sweep reaps what is recorded here,
/// and only a confirmed reap removes the record.
pub(crate) fn unreaped_dir(global: &Global) -> PathBuf {
    global.state_dir.join("unreaped")
}

/// Record that `domain`'s stack is being reaped and is not confirmed gone yet. A failure is
/// logged: the `.env`, when it is still there, leads the next sweep to it too.
pub(crate) fn record_unreaped(global: &Global, domain: &AppDomain) {
    let dir = unreaped_dir(global);
    let write = || {
        let made = std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
            .create(&dir);
        match made {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(err) => Err(err),
        }
        .and_then(|()| {
            std::fs::write(
                dir.join(domain.as_str()),
                format!("{domain} {}\n", domain.stack_name()),
            )
        })
    };
    // Once more should the empty dir have been removed (by a clear) between the two steps.
    let written = match write() {
        Err(err) if err.kind() == io::ErrorKind::NotFound => write(),
        other => other,
    };
    if let Err(err) = written {
        tracing::warn!(
            "failed to record in {} that the stack of {domain} is not confirmed gone: {err}",
            dir.display()
        );
    }
}

/// Whether a reap of `domain`'s stack is recorded as not confirmed.
pub(crate) fn unreaped_recorded(global: &Global, domain: &AppDomain) -> bool {
    std::fs::symlink_metadata(unreaped_dir(global).join(domain.as_str())).is_ok_and(|m| m.is_file())
}

/// The stack of `domain` is confirmed gone everywhere: its record goes.
pub(crate) fn clear_unreaped(global: &Global, domain: &AppDomain) {
    let dir = unreaped_dir(global);
    match std::fs::remove_file(dir.join(domain.as_str())) {
        // The dir goes when it is empty (a state dir holds only what is needed).
        Ok(()) => {
            // rmdir, not remove_dir_all: another domain's record must stay. No cgroup here.
            #[allow(clippy::disallowed_methods)]
            let _ = std::fs::remove_dir(&dir);
        }
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => tracing::warn!("failed to remove the unreaped record of {domain}: {err}"),
    }
}

/// Every run-app domain whose reap is recorded as not confirmed.
pub(crate) fn unreaped_domains(global: &Global) -> io::Result<Vec<AppDomain>> {
    let entries = match std::fs::read_dir(unreaped_dir(global)) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(err) => return Err(err),
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        if !entry.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        if let Some(domain) = entry
            .file_name()
            .to_str()
            .and_then(|n| AppDomain::recognise(n, &global.pattern))
        {
            found.push(domain);
        }
    }
    found.sort();
    Ok(found)
}

/// What [`remove_app_now`] did: what went, what failed (each in words), and of those, the
/// nodes of a swarm not confirmed clean of the app's stack.
#[derive(Debug, Default)]
pub(crate) struct Removal {
    pub removed: RemovedResources,
    /// Objects without a stack label named like the app's that are no name it gives: kept.
    pub kept: Vec<Kept>,
    pub errors: Vec<String>,
    pub nodes: Vec<String>,
}

/// Remove one app right now, Docker resources first and confirmed gone (on every node of a
/// swarm), within `budget`: what a run's own teardown does while it still holds its app lock.
/// When the stack is not confirmed gone, the `.env` stays for a later sweep. `unrecorded`:
/// nothing of the app is on record anywhere (see [`crate::docker::DockerSeam::reap`]).
pub(crate) fn remove_app_now(
    global: &Global,
    link: &DockerLink,
    domain: &AppDomain,
    given: GivenBy<'_>,
    budget: Duration,
    unrecorded: bool,
) -> Removal {
    let mut out = Removal::default();
    if let Some(seam) = link.get() {
        // Recorded before the reap, and kept unless it is confirmed: a hook or an operator
        // that removes the `.env` then leaves the next sweep something to find.
        let recorded = !unrecorded || unreaped_recorded(global, domain);
        if !unrecorded {
            record_unreaped(global, domain);
        }
        let reaped = seam.map_err(Clone::clone).and_then(|seam| {
            let mut stacks = seam.discover(&global.pattern, given)?;
            // Also when the engine lists nothing of it: what the other nodes of a swarm hold
            // of the stack is swept off them.
            let mut stack = stacks.remove(domain).unwrap_or_default();
            out.kept = std::mem::take(&mut stack.kept);
            Ok(seam
                .reap(
                    &global.pattern,
                    given,
                    vec![(domain.clone(), stack)],
                    budget,
                    unrecorded,
                )
                .pop()
                .unwrap_or_default())
        });
        match reaped {
            Ok(reaped) if reaped.gone() => {
                out.removed.docker = reaped.removed;
                clear_unreaped(global, domain);
            }
            Ok(reaped) => {
                if !recorded {
                    record_unreaped(global, domain);
                }
                out.errors = reaped.problems();
                out.errors.push(format!(
                    "{domain} is not gone after {:.1} s; keeping its .env, and a record in {}, so the next sweep finishes the job",
                    budget.as_secs_f64(),
                    unreaped_dir(global).display()
                ));
                out.nodes = reaped.nodes;
                out.removed.docker = reaped.removed;
                return out;
            }
            Err(err) => {
                if !recorded {
                    record_unreaped(global, domain);
                }
                // Keep the .env: without it nothing would lead a later sweep to the stack.
                out.errors.push(format!(
                    "{err}; keeping the app's .env so a later sweep reaps the stack"
                ));
                return out;
            }
        }
    }
    match remove(&global.abra_home, domain) {
        Ok(gone) => out.removed.env_files = gone.env_files,
        Err(err) => out.errors.push(err.to_string()),
    }
    out
}
