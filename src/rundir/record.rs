//! The run record `<runs-dir>/<run-id>/run.json`: who ran what, each phase with its time, why
//! it ended and with which code.
//!
//! Invariant: readers only ever see a complete record. Each write goes to a temporary file in
//! the same directory and is renamed over the old one. Only the write that says the command
//! starts is synced to disk first: it is the one a run must be able to make before its command
//! may run, and after a power loss it is the one worth finding. The others are not: a crash can
//! at worst bring back an earlier phase (ext4 and btrfs write a renamed file's data before the
//! rename; elsewhere an unreadable record is what a reader may meet, and every reader skips it),
//! and each sync costs a disk flush on every run.

use std::io;
use std::path::Path;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

/// What a run record may be: far below this (a few KiB), whatever the run did.
const RECORD_RULES: crate::files::Rules = crate::files::Rules::small(1 << 20);

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Phase {
    pub name: String,
    pub at: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct RunRecord {
    pub run_id: String,
    /// The Drone repository (`owner/name`) whose build this run is, when the step named one: a
    /// run id is kept by the run of one repository only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo: Option<String>,
    pub recipe: String,
    pub pr: Option<String>,
    #[serde(rename = "ref")]
    pub git_ref: Option<String>,
    pub domain: String,
    pub stack: String,
    pub pid: u32,
    pub host: String,
    pub abra_dir: String,
    /// Where the recipe was fetched from, credentials redacted.
    pub recipe_url: Option<String>,
    /// The commit checked out in the run's recipe tree.
    pub commit: Option<String>,
    pub command: Vec<String>,
    /// The `--tie-to` pids (a record of an older version holds one pid, or null).
    #[serde(default, deserialize_with = "pids")]
    pub tied_to: Vec<i32>,
    /// Which `--tie-to` pid exited, when that ended the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tied_pid_died: Option<i32>,
    /// Who asked for the run to stop (`ccci-run stop`), when that ended it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped_by: Option<crate::supervise::shutdown::Requester>,
    /// The run's cgroup (absolute path in the cgroup file system), when it had one.
    pub cgroup: Option<String>,
    /// The supervisor named for good: what a judge in any pid or time namespace needs to tell
    /// whether this run is alive (its cgroup's name carries the same).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supervisor: Option<crate::supervise::identity::ProcessIdentity>,
    /// The configuration the run belongs to (its runs dir's device and inode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<crate::supervise::identity::Scope>,
    /// The `CCCI_SUPERVISOR` value every process of the run carries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub marker: Option<String>,
    pub phases: Vec<Phase>,
    /// `command-ended`, `SIGTERM`, `SIGINT`, `SIGHUP`, `SIGQUIT`, `deadline`, `parent-died`,
    /// `tied-pid-died`, `lock-lost`, `stopped` (`ccci-run stop`), or `teardown-timeout` when a teardown step ran out of its budget.
    pub shutdown_reason: Option<String>,
    /// How the command itself ended, when it was reaped.
    pub command_status: Option<serde_json::Value>,
    /// True when the group ignored SIGTERM past the kill grace and was SIGKILLed.
    pub killed_after_grace: bool,
    pub exit_code: Option<u8>,
    /// Teardown steps that failed; they never change the exit code.
    pub teardown_errors: Vec<String>,
    /// The app lock's fencing token when it is kept beyond this host (etcd): larger for every
    /// later holder of the domain, on any host. Also `CCCI_FENCING_TOKEN` for the command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing_token: Option<i64>,
    /// The names its recipe gives Docker's objects under its stack, read before anything was
    /// deployed: what a later reap takes by name of what carries no stack label (abra's
    /// secrets). Absent (an older record, or a recipe not read): labels only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub given_names: Option<crate::names::GivenNames>,
    /// Set by a later janitor that reaped this run's leftovers.
    pub reaped: Option<String>,
    /// Set by a later janitor that killed what this dead run left running in its cgroup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swept: Option<Swept>,
    /// Why the run failed before its command could run, if it did.
    pub error: Option<String>,
}

/// What a janitor did with a dead run's processes, and when.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Swept {
    pub at: String,
    /// How many processes its cgroup still held, killed.
    pub killed: usize,
}

/// `tied_to` as any version wrote it: a list, one pid, or null.
fn pids<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Vec<i32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Pids {
        List(Vec<i32>),
        One(i32),
        None(()),
    }
    Ok(match Pids::deserialize(deserializer)? {
        Pids::List(pids) => pids,
        Pids::One(pid) => vec![pid],
        Pids::None(()) => Vec::new(),
    })
}

impl RunRecord {
    /// Note that the run entered `phase` now.
    pub(crate) fn enter(&mut self, phase: crate::rundir::phase::Phase) {
        tracing::debug!(%phase, "phase");
        self.phases.push(Phase {
            name: phase.as_str().to_owned(),
            at: crate::duration::timestamp(SystemTime::now()),
        });
    }

    /// Read a run record: a small regular file, never a FIFO, a link or a huge file planted in
    /// its place ([`crate::files`]).
    pub(crate) fn read(path: &Path) -> io::Result<Self> {
        let text =
            crate::files::read(path, &RECORD_RULES).map_err(crate::files::ReadError::into_io)?;
        serde_json::from_slice(&text).map_err(io::Error::other)
    }

    /// Write atomically to `path`: temp file, rename.
    pub(crate) fn write(&self, path: &Path) -> io::Result<()> {
        self.write_with(path, false)
    }

    /// Write atomically over the record at `path`, keeping its mode (a janitor's note, under the
    /// janitor unit's `UMask=0077`, never closes a record to the runner's other readers).
    pub(crate) fn write_keeping_mode(&self, path: &Path) -> io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::symlink_metadata(path)?.permissions().mode();
        let json = serde_json::to_vec_pretty(self).map_err(io::Error::other)?;
        crate::files::write_atomically(path, &json, false, crate::files::Mode::Exactly(mode))
    }

    /// Write atomically and durably: temp file, fsync, rename.
    pub(crate) fn write_durably(&self, path: &Path) -> io::Result<()> {
        self.write_with(path, true)
    }

    fn write_with(&self, path: &Path, sync: bool) -> io::Result<()> {
        let json = serde_json::to_vec_pretty(self).map_err(io::Error::other)?;
        tracing::trace!(path = %path.display(), bytes = json.len(), sync, "writing the run record");
        crate::files::write_atomically(path, &json, sync, crate::files::Mode::Umasked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rundir::phase::Phase;

    #[test]
    fn round_trips_and_leaves_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(crate::names::RUN_RECORD_FILE);
        let mut record = RunRecord {
            run_id: "5".into(),
            git_ref: Some("main".into()),
            ..Default::default()
        };
        record.enter(Phase::Guards);
        record.write(&path).unwrap();
        record.exit_code = Some(0);
        record.write(&path).unwrap();
        assert_eq!(RunRecord::read(&path).unwrap(), record);
        let text = crate::files::read_text(&path, &RECORD_RULES).unwrap();
        assert!(text.contains("\"ref\": \"main\""), "{text}");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from(crate::names::RUN_RECORD_FILE)]
        );
    }
}
