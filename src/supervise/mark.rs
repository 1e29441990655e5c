//! A supervisor's mark, and the proof that a process is the supervisor of a given run.
//!
//! At its start, before it claims its run directory, a run's supervisor makes an anonymous
//! in-memory file (`memfd_create`) named for its run id and keeps it open, close-on-exec, for
//! as long as it lives. The kernel shows that name in the supervisor's descriptor table
//! (`/proc/<pid>/fd/<n>` reads `/memfd:ccci-run-supervisor:<run id> (deleted)`); a memfd is
//! never renamed, and no other process can put a descriptor into the supervisor's table (its
//! command is started without it). So the mark says which run a process was started for, and
//! nothing the run's command writes (its record, its guard's holder line, its run directory's
//! name) can change it.
//!
//! [`prove`] asks the kernel, through the process's opened `/proc` directory, four things: that
//! the process runs this ccci-run's executable, that every one of its user ids is the run's
//! user, that one of its open descriptors is the run's guard and holds the guard's flock (its
//! `fdinfo` lock line: the kernel lists there only the locks that open file holds), and that
//! it carries the mark of the run asked for. Each failure names what did not match.
//!
//! Floor: mechanisms (docs/architecture.md): imports the ground and the mechanisms.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::OnceLock;

use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::Mode;

use crate::supervise::linux::ProcDir;

/// The start of a mark's memfd name.
const MARK_PREFIX: &str = "ccci-run-supervisor:";

/// This process's mark, kept open until it exits.
static MARK: OnceLock<OwnedFd> = OnceLock::new();

/// Mark this process as the supervisor of run `run_id`, once: a second call keeps the first.
pub(crate) fn hold(run_id: &str) -> io::Result<()> {
    if MARK.get().is_some() {
        return Ok(());
    }
    let name = format!("{MARK_PREFIX}{run_id}");
    let fd = nix::sys::memfd::memfd_create(name.as_str(), nix::sys::memfd::MFdFlags::MFD_CLOEXEC)?;
    let _ = MARK.set(fd);
    Ok(())
}

/// What a descriptor table entry reads as when it is the mark of `run_id`.
fn mark_link(run_id: &str) -> String {
    format!("/memfd:{MARK_PREFIX}{run_id} (deleted)")
}

/// The run id a descriptor's link names, when it is a mark.
fn marked_run(link: &str) -> Option<&str> {
    link.strip_prefix("/memfd:")?
        .strip_prefix(MARK_PREFIX)?
        .strip_suffix(" (deleted)")
}

/// What a supervisor must be.
#[derive(Debug)]
pub(crate) struct Expected<'a> {
    /// The run asked for.
    pub run_id: &'a str,
    /// The run's user: the owner of its run directory.
    pub uid: u32,
    /// The run's guard, as found at its path: its device and inode.
    pub guard: (u64, u64),
    /// The guard's path, for messages.
    pub guard_path: &'a std::path::Path,
}

/// Why a process is not proven to be the supervisor.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Unproven {
    /// It ended while we looked.
    Gone,
    /// It is alive, and this did not match.
    Mismatch(String),
}

/// Prove that the process of `proc_dir` (pid `pid` here) is the supervisor `expected` asks
/// for; see the module doc.
pub(crate) fn prove(proc_dir: &ProcDir, pid: i32, expected: &Expected<'_>) -> Result<(), Unproven> {
    let dir = proc_dir.as_fd();
    // Whatever read fails once the process is gone is "gone", never a mismatch.
    let gone_or = |why: String| {
        if proc_dir.running() {
            Unproven::Mismatch(why)
        } else {
            Unproven::Gone
        }
    };
    // 1. This ccci-run's executable.
    let exe = nix::sys::stat::fstatat(dir, "exe", AtFlags::empty())
        .map_err(|e| gone_or(format!("the executable of pid {pid} cannot be read: {e}")))?;
    let own = nix::sys::stat::stat("/proc/self/exe").map_err(|e| {
        Unproven::Mismatch(format!("this process's own executable cannot be read: {e}"))
    })?;
    if (exe.st_dev, exe.st_ino) != (own.st_dev, own.st_ino) {
        let link = nix::fcntl::readlinkat(dir, "exe")
            .map(|l| l.to_string_lossy().into_owned())
            .unwrap_or_default();
        return Err(gone_or(format!(
            "pid {pid} runs {}, not this ccci-run's executable ({}), so it is no ccci-run \
             supervisor (one started before an upgrade is stopped with the binary it runs: \
             /proc/{pid}/exe stop)",
            crate::names::visible(&link),
            std::fs::read_link("/proc/self/exe")
                .map(|p| crate::names::visible(&p.display().to_string()).into_owned())
                .unwrap_or_default()
        )));
    }
    // 2. The run's user, in every one of its user ids.
    let status = proc_dir
        .read("status")
        .map_err(|e| gone_or(format!("the status of pid {pid} cannot be read: {e}")))?;
    let uids = crate::supervise::procfs::parse_uids(&String::from_utf8_lossy(&status))
        .ok_or_else(|| gone_or(format!("the status of pid {pid} names no user ids")))?;
    if uids.iter().any(|&u| u != expected.uid) {
        return Err(gone_or(format!(
            "pid {pid} runs as user ids {uids:?} (real, effective, saved, filesystem), not \
             only as uid {} whose run directory it is",
            expected.uid
        )));
    }
    // 3 and 4. Its descriptor table: the guard with its flock, and the mark.
    let fd_dir = nix::fcntl::openat(
        dir,
        "fd",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| gone_or(format!("the descriptors of pid {pid} cannot be read: {e}")))?;
    // Listed through our own descriptor on that very directory, never by the pid's path.
    let listing = {
        use std::os::fd::AsRawFd;
        std::fs::read_dir(format!("/proc/self/fd/{}", fd_dir.as_raw_fd()))
    }
    .map_err(|e| {
        gone_or(format!(
            "the descriptors of pid {pid} cannot be listed: {e}"
        ))
    })?;
    let numbers: Vec<String> = listing
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_owned))
        .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        .collect();
    let fd_dir = fd_dir.as_fd();
    let mut guard_open = false;
    let mut guard_locked = false;
    let mut marks: Vec<String> = Vec::new();
    for n in &numbers {
        let Ok(link) = nix::fcntl::readlinkat(fd_dir, n.as_str()) else {
            continue;
        };
        let link = link.to_string_lossy();
        if let Some(run) = marked_run(&link) {
            marks.push(run.to_owned());
            continue;
        }
        let Ok(st) = nix::sys::stat::fstatat(fd_dir, n.as_str(), AtFlags::empty()) else {
            continue;
        };
        if (st.st_dev, st.st_ino) != expected.guard {
            continue;
        }
        guard_open = true;
        let info = proc_dir.read(&format!("fdinfo/{n}")).unwrap_or_default();
        let (major, minor) = (
            crate::supervise::procfs::dev_major(expected.guard.0),
            crate::supervise::procfs::dev_minor(expected.guard.0),
        );
        if String::from_utf8_lossy(&info)
            .lines()
            .filter_map(|l| l.strip_prefix("lock:"))
            .filter_map(crate::supervise::procfs::parse_proc_lock)
            .any(|l| {
                !l.waiting && l.inode == expected.guard.1 && (l.major, l.minor) == (major, minor)
            })
        {
            guard_locked = true;
        }
    }
    if !guard_open {
        return Err(gone_or(format!(
            "pid {pid} has no open descriptor on the guard {} (inode {})",
            expected.guard_path.display(),
            expected.guard.1
        )));
    }
    if !guard_locked {
        return Err(gone_or(format!(
            "pid {pid} has the guard {} open but does not hold its flock",
            expected.guard_path.display()
        )));
    }
    if !marks.iter().any(|m| m == expected.run_id) {
        return Err(gone_or(match marks.first() {
            Some(other) => format!(
                "pid {pid} was started for run {}, not for run {}",
                crate::names::visible(other),
                expected.run_id
            ),
            None => format!(
                "pid {pid} carries no run mark ({}), so what run it was started for cannot be \
                 proven (a ccci-run older than this one?)",
                mark_link(expected.run_id)
            ),
        }));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_reads_back_as_its_run_only() {
        assert_eq!(marked_run(&mark_link("42")), Some("42"));
        assert_eq!(marked_run("/memfd:ccci-run-supervisor:42"), None);
        assert_eq!(marked_run("/memfd:other:42 (deleted)"), None);
        assert_eq!(marked_run("/tmp/ccci-run-supervisor:42 (deleted)"), None);
    }

    #[test]
    fn this_process_is_proven_only_for_its_own_mark() {
        use std::os::unix::fs::MetadataExt;
        hold("mark-test").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let guard_path = dir.path().join("run.lock");
        let me = std::process::id() as i32;
        let proc_dir = ProcDir::open(me).unwrap();
        std::fs::write(&guard_path, b"").unwrap();
        let meta = std::fs::metadata(&guard_path).unwrap();
        let expected = Expected {
            run_id: "mark-test",
            uid: nix::unistd::getuid().as_raw(),
            guard: (meta.dev(), meta.ino()),
            guard_path: &guard_path,
        };
        // Not open: refused.
        let why = prove(&proc_dir, me, &expected).unwrap_err();
        assert!(
            matches!(&why, Unproven::Mismatch(w) if w.contains("no open descriptor")),
            "{why:?}"
        );
    }
}
