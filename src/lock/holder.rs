//! Who holds a lock: the line its holder writes into the lock file, read by `locks`, the
//! janitor and the next holder, and how long a hand-over is given to show it.
//!
//! Floor: backends (docs/architecture.md): imports the floors below and the other backends, never a
//! command.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::lock::file::LockFile;
use crate::supervise::identity::{Owner, ProcessIdentity, Scope};
use crate::supervise::leftovers::Predecessor;

/// How long a waiter gives a lock changing hands, or a janitor's look at it, to show the line
/// of the holder that follows: a new holder writes it within microseconds of its flock, and a
/// janitor judges a lock within milliseconds.
pub(crate) const HANDOFF_GRACE: std::time::Duration = std::time::Duration::from_secs(1);
pub(crate) const HANDOFF_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// Who holds a lock: written into the lock file by its holder, read by `locks`, the janitor and
/// the next holder, which finds in it what a holder that died holding the lock left behind.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Holder {
    pub run_id: String,
    pub pid: u32,
    pub started_at: String,
    pub host: String,
    /// Who it is for good, and where what it starts runs.
    #[serde(flatten)]
    pub trace: Box<HolderTrace>,
}

/// What a judge in any namespace and the next holder of the lock need of a holder (absent in
/// a line an older ccci-run wrote).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct HolderTrace {
    /// The holder named for good.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessIdentity>,
    /// The configuration it works for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<Scope>,
    /// Its cgroup, where its command runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// The `CCCI_SUPERVISOR` value every process it starts carries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub marker: Option<String>,
}

impl Holder {
    /// This process, as the holder for `run_id`: named for good, and, once this process has
    /// established its configuration, with its marker.
    pub(crate) fn this_process(run_id: &str) -> Self {
        let owner = Owner::established();
        Self {
            run_id: run_id.to_owned(),
            pid: std::process::id(),
            started_at: crate::duration::timestamp(SystemTime::now()),
            host: nix::unistd::gethostname()
                .map(|h| h.to_string_lossy().into_owned())
                .unwrap_or_default(),
            trace: Box::new(HolderTrace {
                process: ProcessIdentity::own().ok().cloned(),
                scope: owner.map(|o| o.scope),
                cgroup: None,
                marker: owner.map(ToString::to_string),
            }),
        }
    }

    /// A holder line as written when the lock is taken: its `started_at` is now, so that
    /// "since" in `locks` is when the lock was taken, not when its holder began to wait. A line
    /// that does not parse is left as it is.
    pub(crate) fn taken_now(line: &str) -> String {
        Self::parse(line).map_or_else(
            || line.to_owned(),
            |mut holder| {
                holder.started_at = crate::duration::timestamp(SystemTime::now());
                holder.to_line()
            },
        )
    }

    /// The same holder, naming the cgroup its command runs in.
    pub(crate) fn with_cgroup(mut self, cgroup: Option<&Path>) -> Self {
        self.trace.cgroup = cgroup.map(|c| c.display().to_string());
        self
    }

    /// One JSON line.
    pub(crate) fn to_line(&self) -> String {
        serde_json::to_string(self).expect("a holder always serialises")
    }

    /// Parse what a lock file holds; garbage gives `None`, never a panic.
    pub(crate) fn parse(text: &str) -> Option<Self> {
        serde_json::from_str(text.trim()).ok()
    }

    /// The holder the lock file at `path` names, read without taking the lock.
    pub(crate) fn of_file(path: &Path) -> Option<Self> {
        let mut file = LockFile::open_existing(path).ok().flatten()?;
        Self::parse(&file.read_holder())
    }

    /// The holder the lock file at `path` names, for a waiter's periodic line: a line found
    /// empty is read again for up to [`HANDOFF_GRACE`] (a lock changing hands, or a janitor
    /// judging it, has no line for a moment).
    pub(crate) fn of_file_settled(path: &Path) -> Option<Self> {
        let until = std::time::Instant::now() + HANDOFF_GRACE;
        loop {
            if let Some(holder) = Self::of_file(path) {
                return Some(holder);
            }
            if std::time::Instant::now() >= until {
                return None;
            }
            std::thread::sleep(HANDOFF_POLL);
        }
    }

    /// What its line says a dead holder may have left: for the next holder to clear.
    pub(crate) fn predecessor(&self) -> Predecessor {
        Predecessor {
            process: self.trace.process.clone(),
            scope: self.trace.scope,
            cgroup: self.trace.cgroup.as_ref().map(PathBuf::from),
        }
    }

    /// "run 42 (pid 7 on host since …)", "pid 7 on host since …" for a holder that is no run,
    /// or what is known of a holder that wrote no line.
    pub(crate) fn describe(holder: Option<&Self>) -> String {
        match holder {
            Some(h) if h.run_id.is_empty() => {
                format!("pid {} on {} since {}", h.pid, h.host, h.started_at)
            }
            Some(h) => format!(
                "run {} (pid {} on {} since {})",
                h.run_id, h.pid, h.host, h.started_at
            ),
            None => "a holder that wrote no holder line (flock(1) or another program that is \
                     not ccci-run)"
                .to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_line_of_an_older_version_still_parses_without_a_trace() {
        let old = r#"{"run_id":"42","pid":7,"started_at":"2024-01-01T00:00:00.000Z","host":"h"}"#;
        let holder = Holder::parse(old).unwrap();
        assert_eq!(holder.pid, 7);
        assert_eq!(*holder.trace, HolderTrace::default());
    }

    #[test]
    fn a_holder_line_round_trips_with_its_trace() {
        let holder = Holder::this_process("42").with_cgroup(Some(Path::new("/sys/fs/cgroup/x")));
        assert!(holder.trace.process.is_some());
        let line = holder.to_line();
        assert!(!line.contains('\n'), "{line}");
        assert_eq!(Holder::parse(&line), Some(holder));
    }
}
