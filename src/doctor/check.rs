//! One check of `doctor` and the report of them all: its state, its line, what to do about it.
//!
//! Floor: commands (docs/architecture.md): imports the floors below, never another command.

use serde::Serialize;

/// The runner unit named when `--unit` is not given (the unit `systemd/` ships a drop-in for).
pub(crate) const DEFAULT_UNIT: &str = "drone-runner-exec.service";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum State {
    Ok,
    Warn,
    Fail,
    Skip,
}

impl State {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Warn => "warn",
            Self::Fail => "fail",
            Self::Skip => "skip",
        }
    }
}

/// One check's line.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Check {
    pub name: String,
    pub state: State,
    pub detail: String,
    /// What to do about it (for `warn`, `fail` and `skip`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

pub(crate) fn check(name: impl Into<String>, state: State, detail: impl Into<String>) -> Check {
    Check {
        name: name.into(),
        state,
        detail: detail.into(),
        fix: None,
    }
}

impl Check {
    pub(crate) fn fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }
}

/// Every check, in order; `--json` prints it as is.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    /// False when any check failed (exit 1).
    pub ok: bool,
    pub checks: Vec<Check>,
}
