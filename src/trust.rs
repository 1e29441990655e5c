//! Whose files this process takes as its own. A CI runner usually runs as a user of its own
//! (`drone`), while the janitor's timer and an operator at a terminal run as root: then the lock
//! dir, the lock files and the run directories are the runner's, and root must neither refuse
//! them nor leave behind files the runner cannot open.
//!
//! The rule, configured and never guessed: one user runs the runs and sweeps them. The files of
//! the user ccci-run runs as are its own. When it runs as root and the configuration names the
//! runner's user (`runner_user`), a command that writes (`run`, `lock`, `stop`, `converge`, a
//! `janitor` that is no dry run) first becomes that user ([`become_runner`]), before it touches
//! a run, lock, state or server file: what it makes is then the runner's by construction, and no
//! file is ever handed over (no chown). Root's read-only commands (`runs`, `locks`,
//! `janitor --dry-run`, `doctor`) stay root and take the runner's files as their own to read.
//! Without `runner_user`, or when ccci-run is not root, nothing changes: a file of another user
//! is refused by name.
//!
//! Floor: mechanisms (docs/architecture.md): imports the ground and the mechanisms, nothing
//! above.

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

/// Why ccci-run could not become the runner's user.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot act as the runner's user (uid {uid}, runner_user): {what} failed: {source}; a \
     command that writes runs, locks or state files runs as the runner's user (start it as that \
     user, or as root with CAP_SETUID and CAP_SETGID)"
)]
pub(crate) struct SwitchError {
    uid: u32,
    what: &'static str,
    #[source]
    source: nix::Error,
}

impl From<SwitchError> for crate::error::Error {
    fn from(err: SwitchError) -> Self {
        Self::command(err, crate::exit::INTERNAL)
    }
}

/// Become the runner's user for good, when we are root and the configuration names one: its
/// groups first (all of them, so its Docker group keeps the engine's socket), then its group,
/// then its user, real, effective and saved alike. From then on everything this process makes is
/// the runner's by construction, and nothing of root's is left where the runner works. A no-op
/// when we are not root or no runner's user is named.
pub(crate) fn become_runner() -> Result<(), SwitchError> {
    let Some((uid, gid)) = runner() else {
        return Ok(());
    };
    let fail = |what: &'static str| move |source: nix::Error| SwitchError { uid, what, source };
    let user = nix::unistd::User::from_uid(Uid::from_raw(uid))
        .map_err(fail("looking the user up"))?
        .ok_or_else(|| fail("looking the user up")(nix::Error::ENOENT))?;
    let name = std::ffi::CString::new(user.name.clone())
        .map_err(|_| fail("naming the user")(nix::Error::EINVAL))?;
    let gid = Gid::from_raw(gid);
    nix::unistd::initgroups(&name, gid).map_err(fail("setgroups"))?;
    nix::unistd::setresgid(gid, gid, gid).map_err(fail("setresgid"))?;
    let uid_ = Uid::from_raw(uid);
    nix::unistd::setresuid(uid_, uid_, uid_).map_err(fail("setresuid"))?;
    // Proved by the kernel, not assumed: every id is the runner's now.
    let ids = nix::unistd::getresuid().map_err(fail("getresuid"))?;
    if [ids.real, ids.effective, ids.saved] != [uid_; 3] {
        return Err(fail("setresuid")(nix::Error::EPERM));
    }
    tracing::debug!(uid, gid = gid.as_raw(), user = %user.name, "acting as the runner's user");
    Ok(())
}
