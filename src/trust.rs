//! Whose files this process takes as its own. A CI runner usually runs as a user of its own
//! (`drone`), while the janitor's timer and an operator at a terminal run as root: then the lock
//! dir, the lock files and the run directories are the runner's, and root must neither refuse
//! them nor leave behind files the runner cannot open.
//!
//! The rule, configured and never guessed: the files of the user ccci-run runs as are its own;
//! when it runs as root and the configuration names the runner's user (`runner_user`), that
//! user's files are its own too, and what it creates where both work (the lock dir: lock files,
//! queue tickets and counters, the last-wait records, directories it makes there) it hands to
//! that user at once, so that the runner's next run opens them as its own. Without
//! `runner_user`, or when ccci-run is not root, nothing changes: a file of another user is
//! refused by name.
//!
//! Floor: mechanisms (docs/architecture.md): imports the ground and the mechanisms, nothing
//! above.

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::OnceLock;

use nix::unistd::{Gid, Uid};

/// The runner's user and group, as the configuration names them.
static RUNNER: OnceLock<Option<(u32, u32)>> = OnceLock::new();

/// Take the runner's user (uid, gid) from the configuration, once.
pub(crate) fn set_runner(runner: Option<(u32, u32)>) {
    let _ = RUNNER.set(runner);
}

/// The runner's user and group, when this process is root and the configuration names them.
pub(crate) fn runner() -> Option<(u32, u32)> {
    if !Uid::effective().is_root() {
        return None;
    }
    RUNNER.get().copied().flatten()
}

/// The runner's user and group as the configuration names them, whoever we run as.
pub(crate) fn configured_runner() -> Option<(u32, u32)> {
    RUNNER.get().copied().flatten()
}

/// Whether a file owned by `uid` is ours.
pub(crate) fn ours(uid: u32) -> bool {
    uid == Uid::effective().as_raw() || runner().is_some_and(|(r, _)| r == uid)
}

/// Who "ours" is, for messages: `us (uid 0)`, or `us (uid 0) or the runner's user (uid 1000)`.
pub(crate) fn who() -> String {
    let us = Uid::effective().as_raw();
    match runner() {
        Some((r, _)) => format!("us (uid {us}) or the runner's user (uid {r}, runner_user)"),
        None => format!("us (uid {us})"),
    }
}

/// Hand a file root just made to the runner's user (a no-op without one, or when the file is
/// not root's): the runner's runs open it as their own.
pub(crate) fn adopt(file: &impl AsFd) -> std::io::Result<()> {
    let Some((uid, gid)) = runner() else {
        return Ok(());
    };
    let meta = nix::sys::stat::fstat(file.as_fd())?;
    if meta.st_uid != 0 {
        return Ok(());
    }
    nix::unistd::fchown(
        file.as_fd(),
        Some(Uid::from_raw(uid)),
        Some(Gid::from_raw(gid)),
    )?;
    Ok(())
}

/// [`adopt`] for a directory root just made, by its path (never following a link).
pub(crate) fn adopt_dir(dir: &Path) -> std::io::Result<()> {
    let Some((uid, gid)) = runner() else {
        return Ok(());
    };
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() || std::os::unix::fs::MetadataExt::uid(&meta) != 0 {
        return Ok(());
    }
    std::os::unix::fs::lchown(dir, Some(uid), Some(gid))
}
