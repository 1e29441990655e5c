//! The phases of a run, in the order the contract gives them; each is noted in the run record
//! with its time when the run enters it.

use std::fmt;

/// Where a run is. The record keeps the name ([`Phase::as_str`]); readers of old or newer
/// records see a plain string, so an unknown phase never makes a record unreadable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// The lifetime guards are installed.
    Guards,
    /// The run's own `ABRA_DIR` exists.
    AbraDir,
    /// `--no-fetch`: `recipes/` stays empty.
    FetchSkipped,
    /// The staged canonical clone was copied.
    FetchCopied,
    /// The recipe was cloned and checked out.
    Fetch,
    /// The start-of-run janitor sweep is over.
    Janitor,
    /// The app lock is held by another run: this one waits for it (entered once, when the
    /// wait begins; `app-lock` follows when it is taken).
    Waiting,
    /// The app lock (and the domain's lock in the runs dir) are held.
    AppLock,
    /// The command was started.
    Command,
    /// A way out happened; teardown began.
    Teardown,
    /// The run is over; `exit_code` says how.
    Finished,
    /// The run failed before or around its command (exit 125); `error` says why.
    Failed,
}

impl Phase {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Guards => "guards",
            Self::AbraDir => "abra-dir",
            Self::FetchSkipped => "fetch-skipped",
            Self::FetchCopied => "fetch-copied",
            Self::Fetch => "fetch",
            Self::Janitor => "janitor",
            Self::Waiting => "waiting",
            Self::AppLock => "app-lock",
            Self::Command => "command",
            Self::Teardown => "teardown",
            Self::Finished => "finished",
            Self::Failed => "failed",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
