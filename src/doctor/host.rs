//! The host's checks: the configured directories, the lock dir's filesystem, cgroups, and
//! inotify's limits.

use std::path::Path;

use crate::config::CgroupMode;
use crate::doctor::check::{Check, State, check};

/// A configured directory: there, and safe (the lock dir's rule: owned by us or root, not
/// writable by others unless sticky).
pub(super) fn directory(dir: &Path, key: &'static str, missing: State) -> Check {
    let name = format!("dir {key}");
    match std::fs::symlink_metadata(dir) {
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            let why = if missing == State::Fail {
                "runs link their ABRA_DIR to its servers/ and catalogue/"
            } else {
                "it is made at first use, with the permissions of whoever uses it first"
            };
            return check(
                name,
                missing,
                format!("{} does not exist: {why}", dir.display()),
            )
            .fix(format!("install -d -m 0755 {}", dir.display()));
        }
        Err(err) => {
            return check(
                name,
                State::Fail,
                format!("failed to inspect {}: {err}", dir.display()),
            );
        }
        Ok(_) => {}
    }
    match crate::lock::check_dir(dir) {
        Ok(()) => {
            use std::os::unix::fs::MetadataExt;
            let meta = std::fs::metadata(dir).ok();
            let (uid, mode) = meta.map_or((0, 0), |m| (m.uid(), m.mode() & 0o7777));
            check(
                name,
                State::Ok,
                format!("{} (uid {uid}, mode {mode:o})", dir.display()),
            )
        }
        Err(err) => check(name, State::Fail, err.to_string()).fix(format!(
            "chown root {0} && chmod go-w {0} (or chmod +t {0} where it is shared)",
            dir.display()
        )),
    }
}

/// The lock dir on tmpfs: a reboot then leaves no lock file and no holder line of a run it
/// killed.
pub(super) fn lock_dir_tmpfs(dir: &Path) -> Check {
    const NAME: &str = "lock_dir on tmpfs";
    // The nearest existing directory: a lock dir yet to be made lives where its parent is.
    let mut at = dir;
    while !at.exists() {
        match at.parent() {
            Some(parent) => at = parent,
            None => break,
        }
    }
    // A missing lock dir is said to be missing: what is (or is not) on tmpfs is the directory
    // it would be made in.
    let what = if at == dir {
        format!("{} is", dir.display())
    } else {
        format!(
            "{} is missing; {}, where it would be made, is",
            dir.display(),
            at.display()
        )
    };
    match nix::sys::statfs::statfs(at) {
        Ok(fs) if fs.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC => {
            check(NAME, State::Ok, format!("{what} on tmpfs"))
        }
        Ok(fs) => check(
            NAME,
            State::Warn,
            format!(
                "{what} not on tmpfs (file system type {:#x}): lock files and the holder lines \
                 of runs a reboot killed survive the reboot; nothing clears them at boot, so the \
                 first janitor sweep after it must",
                fs.filesystem_type().0
            ),
        )
        .fix(
            "mount a tmpfs there (as /run/lock is on most systemd hosts), or set lock_dir to a \
             directory on one",
        ),
        Err(err) => check(
            NAME,
            State::Fail,
            format!(
                "failed to inspect the file system of {}: {err}",
                at.display()
            ),
        ),
    }
}

/// cgroup v2 writable under our own cgroup, with `cgroup.kill`.
pub(super) fn cgroups(mode: CgroupMode) -> Check {
    const NAME: &str = "cgroup v2";
    if mode == CgroupMode::Off {
        return check(NAME, State::Skip, "cgroup = off: runs make no cgroups")
            .fix("set cgroup = \"auto\" to have every run's processes killed as one");
    }
    let name = format!("ccci-run-doctor-{}", std::process::id());
    match crate::supervise::cgroup::probe(&name) {
        Ok(probe) if probe.kill_file => check(
            NAME,
            State::Ok,
            format!(
                "a cgroup made under our own ({}) has cgroup.kill",
                probe.own.display()
            ),
        ),
        Ok(probe) => check(
            NAME,
            State::Warn,
            format!(
                "cgroups can be made under {}, but without cgroup.kill (Linux < 5.14): a run's \
                 processes are SIGKILLed one by one, and one that forks meanwhile may escape",
                probe.own.display()
            ),
        )
        .fix("run a kernel of 5.14 or later"),
        Err(err) => check(
            NAME,
            State::Warn,
            format!(
                "runs cannot have cgroups here ({err}): they fall back to process groups, \
                 subreaping and the environment scan"
            ),
        )
        .fix(
            "give the runner a writable cgroup v2 subtree: Delegate=yes in its unit (see \
             systemd/drone-runner-exec.service.d/)",
        ),
    }
}

/// The inotify instances and watches this user has left: every named-lock waiter takes one of
/// each (without them, waiters poll).
pub(super) fn inotify(lock_dir: &Path) -> Vec<Check> {
    let read = |name: &str| -> Option<u64> {
        crate::files::kernel_text(format!("/proc/sys/fs/inotify/{name}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let (max_instances, max_watches) = (read("max_user_instances"), read("max_user_watches"));
    let (instances, watches) = inotify_in_use();
    // The kernel's own answer: can we have one more instance, and a watch in it?
    let probe = inotify::Inotify::init().and_then(|i| {
        let at = if lock_dir.is_dir() {
            lock_dir
        } else {
            Path::new("/")
        };
        i.watches().add(at, inotify::WatchMask::CREATE).map(drop)
    });
    let fix = |what: &str| {
        format!(
            "raise fs.inotify.{what} (sysctl -w fs.inotify.{what}=N, and in /etc/sysctl.d/), or \
             find the processes of this user that hold them"
        )
    };
    let judge = |name: &str, used: u64, max: Option<u64>, what: &str, refused: bool| {
        let Some(max) = max else {
            return check(
                name.to_owned(),
                State::Warn,
                format!("failed to read fs.inotify.{what}"),
            );
        };
        let left = max.saturating_sub(used);
        let detail = format!("{used} of {max} in use by this user, {left} left");
        if refused || left == 0 {
            check(
                name.to_owned(),
                State::Fail,
                format!("{detail}: used up, so named-lock waiters poll and other programs fail"),
            )
            .fix(fix(what))
        } else if left < (max / 10).max(8) {
            check(
                name.to_owned(),
                State::Warn,
                format!("{detail}: nearly used up"),
            )
            .fix(fix(what))
        } else {
            check(name.to_owned(), State::Ok, detail)
        }
    };
    let refused = |err: &std::io::Error, errnos: &[i32]| {
        err.raw_os_error().is_some_and(|e| errnos.contains(&e))
    };
    let (no_instance, no_watch) = match &probe {
        Ok(()) => (false, false),
        Err(err) => (
            refused(err, &[nix::libc::EMFILE]),
            refused(err, &[nix::libc::ENOSPC]),
        ),
    };
    vec![
        judge(
            "inotify instances",
            instances,
            max_instances,
            "max_user_instances",
            no_instance,
        ),
        judge(
            "inotify watches",
            watches,
            max_watches,
            "max_user_watches",
            no_watch,
        ),
    ]
}

/// The inotify instances and watches held by processes of our effective user (each open
/// instance counted once per process that has it open).
pub(super) fn inotify_in_use() -> (u64, u64) {
    let us = nix::unistd::Uid::effective().as_raw();
    let (mut instances, mut watches) = (0, 0);
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return (0, 0);
    };
    for entry in procs.flatten() {
        let pid = entry.file_name();
        if !pid.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let dir = entry.path();
        let euid = crate::files::kernel_text(dir.join("status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("Uid:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse::<u32>().ok())
            });
        if euid != Some(us) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(dir.join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == "anon_inode:inotify") {
                instances += 1;
                let info = dir.join("fdinfo").join(fd.file_name());
                watches += crate::files::kernel_text(info)
                    .map(|t| t.lines().filter(|l| l.starts_with("inotify wd:")).count() as u64)
                    .unwrap_or(0);
            }
        }
    }
    (instances, watches)
}
