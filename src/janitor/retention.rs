//! Run-dir retention: `janitor --keep-runs` removes per-run directories older than the period
//! kept whose run is not live, and nothing else.
//!
//! Invariants:
//! - A directory is removed only when it is provably a run directory of ours: a real directory
//!   (no symbolic link) named like a run id, owned by the user we run as, holding a `run.json` of
//!   ours that names that very run id and a `run.lock` of ours. Anything else in the runs dir is
//!   reported (`runs_kept`, with the reason) and left exactly as it was: retention never creates
//!   a file in a directory it has not proven to be ours.
//! - It is removed only while we hold its guard lock (`run.lock`), so a live run's directory —
//!   its guard is held for the run's whole life — is never touched.
//! - A runs dir that is a system directory (`/`, `/etc`, `/var/lib`, a home directory, …) is
//!   refused before anything looks in it ([`refuse_system_runs_dir`]): such a path is a typo, and what
//!   lives there is never ours.

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::janitor::sweep_report::{Kept, SweepReport};
use crate::lock::LockError;
use crate::names::{self, NameError, RunId};
use crate::rundir::record::RunRecord;
use crate::rundir::{self, Liveness};

/// Where every setting that names the runs dir comes from, for messages.
const RUNS_DIR_SETTING: &str = "runs dir (--runs-dir, CCCI_RUNS_DIR, runs_dir)";

/// Directories of the system or of everyone: a runs dir is never one of them. Each is also
/// compared after symbolic links are resolved (`/var/run` is `/run`, `/bin` often `/usr/bin`).
const SYSTEM_DIRS: &[&str] = &[
    "/",
    "/bin",
    "/boot",
    "/dev",
    "/dev/shm",
    "/etc",
    "/home",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/lost+found",
    "/media",
    "/mnt",
    "/nix",
    "/nix/store",
    "/opt",
    "/root",
    "/run",
    "/run/lock",
    "/run/user",
    "/sbin",
    "/snap",
    "/srv",
    "/tmp",
    "/usr",
    "/usr/bin",
    "/usr/lib",
    "/usr/lib64",
    "/usr/libexec",
    "/usr/local",
    "/usr/local/bin",
    "/usr/local/lib",
    "/usr/local/sbin",
    "/usr/local/share",
    "/usr/sbin",
    "/usr/share",
    "/usr/src",
    "/var",
    "/var/backups",
    "/var/cache",
    "/var/lib",
    "/var/local",
    "/var/lock",
    "/var/log",
    "/var/mail",
    "/var/opt",
    "/var/run",
    "/var/spool",
    "/var/tmp",
    "/var/www",
];

/// Kernel file systems: nothing under them can be a runs dir.
const PSEUDO_FS: &[&str] = &["/proc", "/sys"];

/// The runs dir's entries that are ccci-run's own but not run directories.
const OWN_ENTRIES: &[&str] = &[names::DOMAINS_DIR, names::STATE_DIR];

/// Refuse a runs dir that is a system directory (or the home directory of the user we run as):
/// every entry there is someone else's, and a run would scatter its directories among them.
/// The path is compared as given (made lexically plain) and with its symbolic links resolved.
pub(crate) fn refuse_system_runs_dir(runs_dir: &Path) -> Result<(), NameError> {
    let plain = lexically_plain(runs_dir);
    let resolved = resolved(runs_dir);
    let home = nix::unistd::User::from_uid(nix::unistd::Uid::effective())
        .ok()
        .flatten()
        .map(|user| lexically_plain(&user.dir));
    let refused = |path: &Path| -> Option<String> {
        if SYSTEM_DIRS.iter().any(|dir| path == Path::new(dir)) {
            return Some(format!("{} is a system directory", path.display()));
        }
        if let Some(fs) = PSEUDO_FS.iter().find(|fs| path.starts_with(fs)) {
            return Some(format!("{} is under the kernel's {fs}", path.display()));
        }
        if home.as_deref() == Some(path) {
            return Some(format!(
                "{} is the home directory of the user we run as",
                path.display()
            ));
        }
        None
    };
    let why = refused(&plain).or_else(|| refused(&resolved));
    match why {
        Some(why) => Err(NameError {
            what: RUNS_DIR_SETTING,
            value: runs_dir.display().to_string(),
            rule: format!(
                "{why}: a run makes a directory of its own there and retention removes old ones, \
                 so the runs dir must be a directory for ccci-run alone (the default is \
                 /var/lib/cc-ci-runs)"
            ),
        }),
        None => Ok(()),
    }
}

/// `path` without `.` components and repeated or trailing slashes; `..` is left to
/// [`resolved`], which knows where symbolic links lead.
fn lexically_plain(path: &Path) -> PathBuf {
    path.components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect()
}

/// Where the absolute `path` leads: resolved component by component, each symbolic link
/// followed and each `..` taken from the real parent while the path exists; past the first
/// component that does not exist nothing can be a link, and `..` is taken literally.
fn resolved(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(part) => {
                out.push(part);
                if let Ok(real) = std::fs::canonicalize(&out) {
                    out = real;
                }
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// Remove (or, in a dry run, list) finished run directories older than `keep`; report every
/// entry that is not provably one of them, and leave it. Only a directory of ours named like a
/// run id and younger than `keep` goes unreported, whatever it holds: a run may be making it.
pub(crate) fn sweep(runs_dir: &Path, keep: Duration, dry_run: bool, report: &mut SweepReport) {
    let removed = report.runs_removed.get_or_insert_with(Vec::new);
    let kept = report.runs_kept.get_or_insert_with(Vec::new);
    sweep_into(runs_dir, keep, dry_run, removed, kept, &mut report.errors);
}

fn sweep_into(
    runs_dir: &Path,
    keep: Duration,
    dry_run: bool,
    removed: &mut Vec<PathBuf>,
    kept: &mut Vec<Kept>,
    errors: &mut Vec<String>,
) {
    // The same rule as for the runs that make the directories: where others may replace
    // entries, nothing found there can be proven ours.
    match std::fs::metadata(runs_dir) {
        Ok(meta) => {
            let mode = meta.permissions().mode();
            if mode & 0o022 != 0 && mode & 0o1000 == 0 {
                errors.push(format!(
                    "refusing runs dir {}: mode {:o} lets others replace run directories \
                     (--runs-dir, CCCI_RUNS_DIR); nothing removed",
                    runs_dir.display(),
                    mode & 0o7777
                ));
                return;
            }
        }
        Err(err) if err.kind() == io::ErrorKind::NotFound => return,
        Err(err) => {
            errors.push(format!(
                "failed to inspect runs dir {}: {err}",
                runs_dir.display()
            ));
            return;
        }
    }
    let entries = match std::fs::read_dir(runs_dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return,
        Err(err) => {
            errors.push(format!(
                "failed to list runs dir {}: {err}",
                runs_dir.display()
            ));
            return;
        }
    };
    let us = nix::unistd::Uid::effective().as_raw();
    let now = SystemTime::now();
    let mut entries: Vec<_> = entries.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let dir = entry.path();
        let mut keep_it = |why: String| {
            kept.push(Kept {
                path: dir.clone(),
                why,
            })
        };
        let name = entry.file_name();
        if name.to_str().is_some_and(|n| OWN_ENTRIES.contains(&n)) {
            continue;
        }
        let Some(run_id) = name.to_str().and_then(|n| RunId::parse(n).ok()) else {
            keep_it("not a run directory: its name is not a run id".to_owned());
            continue;
        };
        let meta = match std::fs::symlink_metadata(&dir) {
            Ok(meta) => meta,
            // Removed meanwhile (by a run that reuses the id, or another janitor).
            Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
            Err(err) => {
                errors.push(format!("failed to inspect {}: {err}", dir.display()));
                continue;
            }
        };
        if let Err(why) = own_directory(&meta, us) {
            keep_it(format!("not a run directory of ours: {why}"));
            continue;
        }
        // A run's last record write is when it finished; a directory without one, its own
        // time. Younger than the period kept: left without a word (a run may be making it).
        let record = dir.join(names::RUN_RECORD_FILE);
        let last = std::fs::symlink_metadata(&record)
            .or(Ok::<_, io::Error>(meta))
            .and_then(|m| m.modified());
        let Ok(last) = last else { continue };
        if now.duration_since(last).unwrap_or_default() <= keep {
            continue;
        }
        if let Err(why) = proven_run_dir(&dir, &run_id, us) {
            keep_it(format!("not a run directory of ours: {why}"));
            continue;
        }
        // Never create a guard here: a directory without one is not a run's.
        let _held = match rundir::probe(&dir, false) {
            // The path must still name the inode we locked (another janitor may have removed
            // the directory, and a new run made it anew).
            Liveness::Free { current: false, .. } => continue,
            Liveness::Free { guard, .. } => guard,
            // Held: the run is live, however old its directory looks.
            Liveness::Live { .. } => continue,
            Liveness::NoGuard => {
                keep_it(format!(
                    "not a run directory of ours: it has no {}",
                    names::RUN_GUARD_FILE
                ));
                continue;
            }
            Liveness::Unreadable(err @ LockError::Io { .. }) => {
                errors.push(format!("not removing {}: {err}", dir.display()));
                continue;
            }
            Liveness::Unreadable(err) => {
                keep_it(format!("not a run directory of ours: {err}"));
                continue;
            }
        };
        // Held, and the path still names the guard we hold: only a directory swapped in within
        // this instant could differ, and it would have to be ours again to be removed.
        match std::fs::symlink_metadata(&dir) {
            Ok(meta) if own_directory(&meta, us).is_ok() => {}
            _ => continue,
        }
        if dry_run {
            removed.push(dir);
            continue;
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => removed.push(dir),
            Err(err) => errors.push(format!("failed to remove run dir {}: {err}", dir.display())),
        }
    }
}

/// A real directory (not a symbolic link) owned by `us`.
fn own_directory(meta: &std::fs::Metadata, us: u32) -> Result<(), String> {
    if meta.file_type().is_symlink() {
        return Err("it is a symbolic link".to_owned());
    }
    if !meta.is_dir() {
        return Err("it is not a directory".to_owned());
    }
    if meta.uid() != us && !crate::trust::ours(meta.uid()) {
        return Err(format!(
            "it is owned by uid {}, not by {}",
            meta.uid(),
            crate::trust::who()
        ));
    }
    Ok(())
}

/// The largest run record retention reads: a record is a few KiB.
const MAX_RECORD: u64 = 1 << 20;

/// A run directory's own evidence: a `run.json` of ours (a regular file owned by `us`) that names
/// `run_id`, and a `run.lock` (whose kind and owner the probe checks when it opens it).
fn proven_run_dir(dir: &Path, run_id: &RunId, us: u32) -> Result<(), String> {
    let record_path = dir.join(names::RUN_RECORD_FILE);
    let record = names::RUN_RECORD_FILE;
    let meta = match std::fs::symlink_metadata(&record_path) {
        Ok(meta) => meta,
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            return Err(format!("it has no {record}"));
        }
        Err(err) => return Err(format!("its {record} cannot be inspected: {err}")),
    };
    if !meta.file_type().is_file() {
        return Err(format!("its {record} is not a regular file"));
    }
    if meta.uid() != us && !crate::trust::ours(meta.uid()) {
        return Err(format!(
            "its {record} is owned by uid {}, not by {}",
            meta.uid(),
            crate::trust::who()
        ));
    }
    if meta.len() > MAX_RECORD {
        return Err(format!(
            "its {record} is {} bytes, more than a run record can be",
            meta.len()
        ));
    }
    let named = RunRecord::read(&record_path)
        .map_err(|err| format!("its {record} is not a run record: {err}"))?
        .run_id;
    if named != run_id.as_str() {
        return Err(format!(
            "its {record} names run {:?}, not {:?}",
            names::escape_outside(named.as_bytes()),
            run_id.as_str()
        ));
    }
    match std::fs::symlink_metadata(dir.join(names::RUN_GUARD_FILE)) {
        Ok(_) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            Err(format!("it has no {}", names::RUN_GUARD_FILE))
        }
        Err(err) => Err(format!(
            "its {} cannot be inspected: {err}",
            names::RUN_GUARD_FILE
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_directories_are_refused_as_runs_dirs() {
        for dir in [
            "/",
            "/var/lib",
            "/var/lib/",
            "/./etc",
            "/usr//",
            "/tmp",
            "/proc/1",
            "/sys/fs",
        ] {
            let err = refuse_system_runs_dir(Path::new(dir))
                .unwrap_err()
                .to_string();
            assert!(err.contains("--runs-dir"), "{dir}: {err}");
        }
        // `..` and symbolic links are resolved before the comparison.
        assert!(refuse_system_runs_dir(Path::new("/var/lib/..")).is_err());
        assert!(refuse_system_runs_dir(Path::new("/var/run")).is_err());
        for dir in [
            "/var/lib/cc-ci-runs",
            "/srv/ci/runs",
            "/tmp/ccci-runs",
            "/etc/ccci-run/runs",
        ] {
            assert_eq!(refuse_system_runs_dir(Path::new(dir)), Ok(()), "{dir}");
        }
    }
}
