//! What `ccci-run` itself can fail with, each with its documented exit code ([`crate::exit`]),
//! and the setting behind a path an error is about. A command's own error comes here through
//! its room's `From` ([`Error::Command`]), with the exit code that room gives it.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

use std::path::{Path, PathBuf};

use crate::config::{Global, dirs};
use crate::exit;
use crate::names::NameError;

/// Every way `ccci-run` itself can fail.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    #[error(transparent)]
    Invalid(#[from] NameError),
    #[error(transparent)]
    Dir(#[from] dirs::ParentMissing),
    /// A command's own error, with the exit code its room gives it.
    #[error("{inner}")]
    Command {
        inner: Box<dyn std::error::Error>,
        code: u8,
    },
    #[error("failed to write metrics file {path}: {source}")]
    Metrics {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("failed to write to stdout: {0}")]
    Output(std::io::Error),
    #[error("failed to write man pages into {path}: {source}")]
    ManDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("failed to read runs dir {path}: {source}")]
    RunsDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no run {run_id} in {runs_dir}: no record names it")]
    NoSuchRun { run_id: String, runs_dir: PathBuf },
    #[error("failed to list the locks in {store}: {source}")]
    LockDir {
        store: String,
        source: std::io::Error,
    },
    /// An error about a path under a configured directory, with the setting that names it.
    #[error("{source} (the directory is set by {setting})")]
    Located {
        source: Box<Error>,
        setting: &'static str,
    },
}

impl Error {
    /// A command's own error `inner`, ending with exit code `code`.
    pub(crate) fn command(inner: impl std::error::Error + 'static, code: u8) -> Self {
        Self::Command {
            inner: Box::new(inner),
            code,
        }
    }

    /// What kind of error this is, as a JSON error event names it: its exit code in a word.
    pub(crate) fn kind(&self) -> &'static str {
        match self.exit_code() {
            exit::USAGE => "invalid-input",
            exit::INTERNAL => "internal",
            _ => "failure",
        }
    }

    pub(crate) fn exit_code(&self) -> u8 {
        match self {
            Self::Invalid(_) | Self::Dir(_) => exit::USAGE,
            Self::Command { code, .. } => *code,
            Self::Metrics { .. }
            | Self::LockDir { .. }
            | Self::RunsDir { .. }
            | Self::NoSuchRun { .. }
            | Self::Output(_)
            | Self::ManDir { .. } => exit::FAILURE,
            Self::Located { source, .. } => source.exit_code(),
        }
    }

    /// Name the setting behind the path this error is about, so that a typo or a directory
    /// the user may not write (a root-owned `/run/lock`, `/var/lib/cc-ci-runs`) says which
    /// option to change. The longest configured directory the message names wins.
    pub(crate) fn located(self, global: &Global) -> Self {
        if matches!(self, Self::Invalid(_) | Self::Output(_) | Self::Dir(_)) {
            return self;
        }
        let message = self.to_string();
        // A message that already names its setting (`config::dirs`) says it once.
        let named_already = [dirs::Dir::Lock, dirs::Dir::Runs, dirs::Dir::State];
        if named_already
            .iter()
            .any(|dir| message.contains(dir.sources()))
        {
            return self;
        }
        let settings = [
            (&global.lock_dir, "--lock-dir / CCCI_APP_LOCK_DIR"),
            (&global.runs_dir, "--runs-dir / CCCI_RUNS_DIR"),
            (&global.state_dir, "--state-dir / CCCI_STATE_DIR"),
            (&global.abra_home, "--abra-home / CCCI_ABRA_HOME"),
        ];
        let named = settings
            .iter()
            .filter(|(dir, _)| names_path_under(&message, dir))
            .max_by_key(|(dir, _)| dir.as_os_str().len());
        match named {
            Some((_, setting)) => Self::Located {
                source: Box::new(self),
                setting,
            },
            None => self,
        }
    }
}

/// Write `bytes` to stdout. A closed stdout (`| head`) ends the output quietly, as coreutils
/// do; any other write error (a full disk) is a clear error. Never a panic.
pub(crate) fn emit(bytes: &[u8]) -> Result<(), Error> {
    crate::report::stdout(bytes).map_err(Error::Output)
}

/// Whether `message` names `dir` or a path below it.
fn names_path_under(message: &str, dir: &Path) -> bool {
    let dir = dir.display().to_string();
    message.match_indices(&dir).any(|(at, _)| {
        let rest = &message[at + dir.len()..];
        rest.is_empty() || rest.starts_with(['/', ':', ' ', ')', ','])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_is_named_only_whole() {
        let dir = Path::new("/var/lib/runs");
        assert!(names_path_under(
            "failed to open /var/lib/runs/x: denied",
            dir
        ));
        assert!(names_path_under("failed to read /var/lib/runs", dir));
        assert!(names_path_under("at /var/lib/runs: no", dir));
        assert!(!names_path_under("failed to open /var/lib/runs2/x", dir));
    }

    #[test]
    fn each_kind_is_its_exit_code_in_a_word() {
        let usage = Error::Invalid(NameError {
            what: "x",
            value: String::new(),
            rule: String::new(),
        });
        assert_eq!(
            (usage.exit_code(), usage.kind()),
            (exit::USAGE, "invalid-input")
        );
        let internal = Error::command(std::io::Error::other("x"), exit::INTERNAL);
        assert_eq!(internal.kind(), "internal");
        let failure = Error::Output(std::io::Error::other("x"));
        assert_eq!(
            (failure.exit_code(), failure.kind()),
            (exit::FAILURE, "failure")
        );
    }
}
