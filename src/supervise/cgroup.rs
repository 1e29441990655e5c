//! A run is a cgroup: every process a run or a `lock` command starts — the command, the
//! teardown hook, whatever they fork, however they daemonise or change session — lives in a
//! cgroup v2 directory of its own, and `cgroup.kill` ends all of them at once.
//!
//! ```text
//! <supervisor's own cgroup>/
//!   ccci-run-<run-id>-<owner>/           one per supervisor; the owner names it and its configuration
//!     command/                           the supervised command and its descendants
//!     hook/                              the --on-teardown hook, killed alone when its share ends
//! ```
//!
//! The directory name ends with its [`Owner`]: the supervisor's pid, start time and pid
//! namespace, and the configuration it works for (`<pid>-<start>-<pidns>-c<dev>.<ino>`). That is
//! everything a judge in any namespace needs ([`crate::supervise::identity`]): a sweep finds the
//! cgroups of its own configuration ([`find`]), and kills and removes one ([`reap_dead`]) only
//! once its supervisor is judged dead — before the janitor reaps any app.
//!
//! Invariant: only this module writes under the cgroup file system,
//! and a cgroup is only ever killed when its supervisor is this process or provably dead.
//!
//! Where cgroup v2 is not writable (no unified hierarchy, not root, no delegation), [`RunCgroup::
//! create`] says so and the supervisor falls back to process groups, subreaping and the
//! environment scan of [`crate::supervise::leftovers`].

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use crate::config::CgroupMode;
use crate::names::{CGROUP_PREFIX, COMMAND_LEAF, HOOK_LEAF, cgroup_name, cgroup_owner};
use crate::supervise::identity::{Owner, Scope};
use crate::supervise::linux;

/// Create one cgroup directory. Only this module may (clippy's `disallowed-methods`).
#[expect(
    clippy::disallowed_methods,
    reason = "creating cgroups is this module's job"
)]
fn mkdir(path: &Path) -> io::Result<()> {
    std::fs::create_dir(path)
}

/// Remove one (empty) cgroup directory. Only this module may (clippy's `disallowed-methods`).
#[expect(
    clippy::disallowed_methods,
    reason = "removing cgroups is this module's job"
)]
fn rmdir(path: &Path) -> io::Result<()> {
    std::fs::remove_dir(path)
}

/// How deep [`reap_orphans`] walks the hierarchy looking for our cgroups.
const MAX_WALK_DEPTH: usize = 12;

/// The unified (v2) hierarchy's mount point: `/sys/fs/cgroup` on a pure v2 host,
/// `/sys/fs/cgroup/unified` on a hybrid one.
pub(crate) fn mount_point() -> Option<PathBuf> {
    // Read once: neither the mount nor our own cgroup changes while we run (a run creates its
    // cgroup below its own and never moves itself).
    static MOUNT: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    MOUNT
        .get_or_init(|| {
            let text = crate::files::kernel_text("/proc/self/mountinfo").ok()?;
            crate::supervise::procfs::cgroup2_mount(&text)
        })
        .clone()
}

/// This process's own cgroup v2 directory.
fn own_cgroup() -> io::Result<PathBuf> {
    static OWN: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    OWN.get_or_init(|| {
        let mount = mount_point().ok_or("no cgroup v2 hierarchy is mounted")?;
        let text = crate::files::kernel_text("/proc/self/cgroup").map_err(|e| e.to_string())?;
        let relative = crate::supervise::procfs::cgroup2_path(&text)
            .ok_or("this process is in no cgroup v2 group")?;
        Ok(mount.join(relative.trim_start_matches('/')))
    })
    .clone()
    .map_err(io::Error::other)
}

/// What `doctor` found of cgroup v2 under our own cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Probe {
    /// Our own cgroup, where runs make theirs.
    pub own: PathBuf,
    /// Whether a cgroup made there has `cgroup.kill` (Linux 5.14+).
    pub kill_file: bool,
}

/// Make a cgroup under our own, look for `cgroup.kill` in it, and remove it: what a run does
/// at its start, without a run. `Err` says why runs could not have cgroups here.
pub(crate) fn probe(name: &str) -> io::Result<Probe> {
    let own = own_cgroup()?;
    let dir = own.join(name);
    mkdir(&dir).map_err(|e| annotate(e, "create", &dir))?;
    let kill_file = dir.join("cgroup.kill").exists();
    let procs = dir.join("cgroup.procs").exists();
    let removed = rmdir(&dir).map_err(|e| annotate(e, "remove", &dir));
    if !procs {
        return Err(io::Error::other(format!(
            "{} is not a cgroup v2 directory",
            dir.display()
        )));
    }
    removed?;
    Ok(Probe { own, kill_file })
}

/// A supervisor's cgroup, created by it and removed by it (or by a sweep once it is dead).
#[derive(Debug)]
pub(crate) struct RunCgroup {
    dir: PathBuf,
}

/// A leaf of a [`RunCgroup`] that children are placed into before they exec.
#[derive(Debug)]
pub(crate) struct Leaf {
    dir: PathBuf,
    /// The leaf's directory, for `clone3(CLONE_INTO_CGROUP)`: children start inside it.
    dir_fd: OwnedFd,
    /// `cgroup.procs`, open for writing: where `clone3` cannot be used, the child writes "0"
    /// (itself) to it after fork.
    procs: OwnedFd,
}

impl Leaf {
    /// The leaf's directory descriptor, for spawning straight into it.
    pub(crate) fn dir_fd(&self) -> RawFd {
        self.dir_fd.as_raw_fd()
    }

    /// The descriptor a forked child writes itself into (async-signal-safe: one `write`).
    pub(crate) fn procs_fd(&self) -> RawFd {
        self.procs.as_raw_fd()
    }

    pub(crate) fn path(&self) -> &Path {
        &self.dir
    }

    /// Kill every process in the leaf and wait (within `budget`) until it is empty. An empty
    /// leaf is left alone: on some kernels a leaf that ever saw `cgroup.kill` kills every child
    /// later created in it with `CLONE_INTO_CGROUP` (its kill sequence no longer matches the
    /// parent's), so a leaf that still has a command to host is never killed needlessly.
    pub(crate) fn kill_and_wait(&self, budget: Duration) -> io::Result<bool> {
        if !self.is_populated() {
            return Ok(true);
        }
        kill(&self.dir)?;
        wait_empty(&self.dir, budget)
    }

    pub(crate) fn is_populated(&self) -> bool {
        populated(&self.dir).unwrap_or(false)
    }
}

impl RunCgroup {
    /// Create `<own cgroup>/<name>` with its leaves. `Err` says why cgroups cannot be used here.
    pub(crate) fn create(name: &str) -> io::Result<Self> {
        let parent = own_cgroup()?;
        let dir = parent.join(name);
        mkdir(&dir).map_err(|e| annotate(e, "create", &dir))?;
        let cgroup = Self { dir };
        if !cgroup.dir.join("cgroup.kill").exists() && !cgroup.dir.join("cgroup.procs").exists() {
            let _ = cgroup.remove();
            return Err(io::Error::other(format!(
                "{} is not a cgroup v2 directory",
                cgroup.dir.display()
            )));
        }
        for leaf in [COMMAND_LEAF, HOOK_LEAF] {
            let path = cgroup.dir.join(leaf);
            if let Err(err) = mkdir(&path) {
                let _ = cgroup.remove();
                return Err(annotate(err, "create", &path));
            }
        }
        Ok(cgroup)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.dir
    }

    /// Open a leaf for placing children into it.
    #[expect(
        clippy::disallowed_methods,
        reason = "a cgroup's interface files, which the kernel serves"
    )]
    pub(crate) fn leaf(&self, name: &str) -> io::Result<Leaf> {
        let dir = self.dir.join(name);
        let procs = OpenOptions::new()
            .write(true)
            .custom_flags(nix::libc::O_CLOEXEC)
            .open(dir.join("cgroup.procs"))
            .map_err(|e| annotate(e, "open", &dir.join("cgroup.procs")))?;
        let dir_fd = OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_DIRECTORY | nix::libc::O_CLOEXEC)
            .open(&dir)
            .map_err(|e| annotate(e, "open", &dir))?;
        Ok(Leaf {
            dir,
            dir_fd: dir_fd.into(),
            procs: procs.into(),
        })
    }

    /// Remove the (empty) cgroup: its leaves first, then itself.
    pub(crate) fn remove(&self) -> io::Result<()> {
        remove_tree(&self.dir)
    }
}

/// Place the calling (forked, not yet exec'd) process into the leaf whose `cgroup.procs` is
/// open as `fd`. Async-signal-safe: a single `write`.
pub(crate) fn join_in_child(fd: RawFd) -> io::Result<()> {
    // SAFETY: write(2) of a static buffer to a descriptor the parent opened for us.
    let rc = unsafe { nix::libc::write(fd, b"0".as_ptr().cast(), 1) };
    if rc == 1 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Kill everything in the cgroup at `dir` (the watchdog's last resort).
pub(crate) fn kill_path(dir: &Path) -> io::Result<()> {
    kill(dir)
}

/// `cgroup.kill` where the kernel has it (5.14+); otherwise SIGKILL each member until none is
/// left to signal.
#[expect(
    clippy::disallowed_methods,
    reason = "a cgroup's interface files, which the kernel serves"
)]
fn kill(dir: &Path) -> io::Result<()> {
    let kill_file = dir.join("cgroup.kill");
    match OpenOptions::new().write(true).open(&kill_file) {
        Ok(mut file) => match file.write_all(b"1") {
            Err(err) if !is_gone(&err) => Err(annotate(err, "write", &kill_file)),
            _ => Ok(()),
        },
        // Removed meanwhile (its supervisor finished, or another sweep got there first).
        Err(err) if is_gone(&err) && !dir.exists() => Ok(()),
        Err(err) if err.raw_os_error() == Some(nix::libc::ENODEV) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            // Each member held by its `/proc` directory and shown, through it, to be in this
            // cgroup still: never whatever took a listed pid meanwhile.
            let relative = mount_point().and_then(|m| dir.strip_prefix(m).ok().map(Path::to_owned));
            for pid in members(dir).unwrap_or_default() {
                let Some(held) = linux::ProcDir::open(pid.as_raw()) else {
                    continue;
                };
                let inside = held.read("cgroup").ok().is_some_and(|text| {
                    let text = String::from_utf8_lossy(&text);
                    let at = crate::supervise::procfs::cgroup2_path(&text).unwrap_or_default();
                    relative
                        .as_deref()
                        .is_some_and(|r| Path::new(at.trim_start_matches('/')).starts_with(r))
                });
                if inside {
                    let _ = held.signal(nix::sys::signal::Signal::SIGKILL);
                }
            }
            Ok(())
        }
        Err(err) => Err(annotate(err, "open", &kill_file)),
    }
}

/// Every process in `dir` and below.
fn members(dir: &Path) -> io::Result<Vec<nix::unistd::Pid>> {
    let mut pids = Vec::new();
    let text = crate::files::kernel_text(dir.join("cgroup.procs"))?;
    pids.extend(
        text.lines()
            .filter_map(|l| l.trim().parse().ok())
            .map(nix::unistd::Pid::from_raw),
    );
    for entry in std::fs::read_dir(dir)?.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            pids.extend(members(&entry.path())?);
        }
    }
    Ok(pids)
}

/// `populated` from `cgroup.events`: true while any process is in the cgroup or below.
fn populated(dir: &Path) -> io::Result<bool> {
    let text = crate::files::kernel_text(dir.join("cgroup.events"))?;
    Ok(crate::supervise::procfs::cgroup_populated(&text).unwrap_or(true))
}

/// Wait until `cgroup.events` says `populated 0`, woken by its change notifications
/// (`POLLPRI`), at most `budget`. A cgroup that no longer exists is empty.
fn wait_empty(dir: &Path, budget: Duration) -> io::Result<bool> {
    let until = Instant::now() + budget;
    let events = dir.join("cgroup.events");
    let file = match crate::files::kernel_file(&events) {
        Ok(file) => file,
        Err(err) if is_gone(&err) => return Ok(true),
        Err(err) => return Err(annotate(err, "open", &events)),
    };
    loop {
        match populated(dir) {
            Ok(false) => return Ok(true),
            Ok(true) => {}
            Err(err) if is_gone(&err) => return Ok(true),
            Err(err) => return Err(annotate(err, "read", &events)),
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        // A kernfs change notification wakes us; the short cap covers a missed edge (the file
        // changed between our read and the poll) and kernels without notifications.
        let wait = left.min(Duration::from_millis(50));
        let mut fds = [PollFd::new(
            std::os::fd::AsFd::as_fd(&file),
            PollFlags::POLLPRI,
        )];
        let timeout = PollTimeout::try_from(wait.as_millis().max(1) as i32)
            .unwrap_or(PollTimeout::from(50u8));
        let _ = poll(&mut fds, timeout);
    }
}

/// Remove `dir` and the cgroups below it, deepest first.
fn remove_tree(dir: &Path) -> io::Result<()> {
    match std::fs::read_dir(dir) {
        Ok(entries) => {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    remove_tree(&entry.path())?;
                }
            }
        }
        Err(err) if is_gone(&err) => return Ok(()),
        Err(err) => return Err(annotate(err, "list", dir)),
    }
    match rmdir(dir) {
        Ok(()) => Ok(()),
        Err(err) if is_gone(&err) => Ok(()),
        Err(err) => Err(annotate(err, "remove", dir)),
    }
}

/// The cgroup went away meanwhile (its supervisor or another sweep removed it): a removed
/// kernfs node answers ENODEV to a descriptor opened before, ENOENT to a new lookup.
fn is_gone(err: &io::Error) -> bool {
    err.kind() == io::ErrorKind::NotFound || err.raw_os_error() == Some(nix::libc::ENODEV)
}

fn annotate(err: io::Error, what: &str, path: &Path) -> io::Error {
    io::Error::new(
        err.kind(),
        format!("failed to {what} cgroup {}: {err}", path.display()),
    )
}

/// A cgroup of ours, of the configuration a sweep works for, as found in the hierarchy.
#[derive(Debug, Clone)]
pub(crate) struct Found {
    pub path: PathBuf,
    /// The supervisor that made it, as its name says.
    pub owner: Owner,
}

/// Every cgroup of the configuration `scope` (`ccci-…-<owner>`) in the unified hierarchy, or
/// only beside our own (`nearby`: where this host's runs put theirs). Another configuration's
/// cgroups are not even looked at. Also returned: cgroups named like ours whose name carries no
/// owner (an older ccci-run's), which nobody can judge. Without cgroup v2 there is nothing to find.
pub(crate) fn find(scope: Scope, nearby: bool) -> (Vec<Found>, Vec<PathBuf>) {
    let start = if nearby {
        own_cgroup().ok()
    } else {
        mount_point()
    };
    let Some(start) = start else {
        return (Vec::new(), Vec::new());
    };
    let mut dirs = Vec::new();
    find_ours(&start, if nearby { MAX_WALK_DEPTH } else { 0 }, &mut dirs);
    let (mut found, mut ownerless) = (Vec::new(), Vec::new());
    for path in dirs {
        let owner = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(cgroup_owner)
            .and_then(Owner::parse);
        match owner {
            Some(owner) if owner.scope == scope => found.push(Found { path, owner }),
            Some(_) => {}
            None => ownerless.push(path),
        }
    }
    (found, ownerless)
}

/// How many processes are in the cgroup at `dir` and below.
/// The pids in cgroup `dir` and below it (none when it cannot be read).
pub(crate) fn member_pids(dir: &Path) -> Vec<i32> {
    members(dir)
        .map(|m| m.into_iter().map(nix::unistd::Pid::as_raw).collect())
        .unwrap_or_default()
}

pub(crate) fn population(dir: &Path) -> usize {
    members(dir).map(|m| m.len()).unwrap_or(0)
}

/// Kill everything in a dead supervisor's cgroup, wait (at most `budget`) until it is empty and
/// remove it. The caller has judged the supervisor dead.
pub(crate) fn reap_dead(dir: &Path, budget: Duration) -> io::Result<()> {
    kill(dir)
        .and_then(|()| wait_empty(dir, budget))
        .and_then(|empty| {
            if empty {
                remove_tree(dir)
            } else {
                Err(io::Error::other(format!(
                    "cgroup {} still has processes after SIGKILL",
                    dir.display()
                )))
            }
        })
}

/// The cgroup a holder line names, when it really is one of ours made by `owner`: under the
/// unified hierarchy and named for that very supervisor. `None` otherwise (a name is never
/// trusted to point anywhere else).
pub(crate) fn named_for(path: &Path, owner: &Owner) -> Option<PathBuf> {
    let mount = mount_point()?;
    let rest = path.strip_prefix(&mount).ok()?;
    if rest
        .components()
        .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return None;
    }
    let name = path.file_name()?.to_str()?;
    (cgroup_owner(name).and_then(Owner::parse).as_ref() == Some(owner)).then(|| path.to_owned())
}

/// Collect directories named like ours under `dir`; ours are not descended into.
fn find_ours(dir: &Path, depth: usize, found: &mut Vec<PathBuf>) {
    if depth > MAX_WALK_DEPTH {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let name = entry.file_name();
        if name.as_bytes().starts_with(CGROUP_PREFIX.as_bytes()) {
            found.push(entry.path());
        } else {
            find_ours(&entry.path(), depth + 1, found);
        }
    }
}

/// A supervisor's cgroup with its leaves.
#[derive(Debug)]
pub(crate) struct Cgroups {
    pub cgroup: RunCgroup,
    pub command: Leaf,
    pub hook: Leaf,
}

/// Create the supervisor's cgroup `ccci-<kind>-<label>-<pid>-<start>` with its leaves, unless
/// cgroups are off or not writable here; then say why (at `-v`) and use the fallback.
pub(crate) fn run_cgroup(
    mode: CgroupMode,
    kind: &str,
    label: &str,
    owner: &Owner,
) -> Option<Cgroups> {
    if mode == CgroupMode::Off {
        tracing::info!(
            "cgroups off (--cgroup off): process groups, subreaping and the environment scan only"
        );
        return None;
    }
    let name = cgroup_name(kind, label, &owner.to_string());
    let made = RunCgroup::create(&name).and_then(|cgroup| {
        let command = cgroup.leaf(COMMAND_LEAF)?;
        let hook = cgroup.leaf(HOOK_LEAF)?;
        Ok(Cgroups {
            cgroup,
            command,
            hook,
        })
    });
    match made {
        Ok(cgroups) => {
            tracing::info!(cgroup = %cgroups.cgroup.path().display(), "running in a cgroup of its own");
            Some(cgroups)
        }
        Err(err) => {
            tracing::info!(
                "cgroup v2 is not usable here ({err}); falling back to process groups, \
                 subreaping and the environment scan"
            );
            None
        }
    }
}
