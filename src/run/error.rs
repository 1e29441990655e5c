//! What a run fails with before or around its command, and the exit code each failure gives.
//!
//! Floor: commands (docs/architecture.md): imports the floors below, never another command.

use std::path::PathBuf;
use std::time::Duration;

use crate::docker::DockerError;
use crate::exit;
use crate::lock::file::LockError;
use crate::run::fetch::FetchError;
use crate::run::state::StateError;
use crate::rundir::RunDirError;
use crate::supervise::guards::GuardError;
use crate::supervise::identity::IdentityError;

/// Ways a run fails before or around its command: exit 125, but for a recipe that cannot be
/// deployed as it is (2).
#[derive(Debug, thiserror::Error)]
pub(crate) enum RunError {
    #[error(transparent)]
    Guards(#[from] GuardError),
    #[error(transparent)]
    RunDir(#[from] RunDirError),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("Docker is required (--docker required): {0}; {hint}", hint = crate::docker::REQUIRED_HINT)]
    DockerRequired(DockerError),
    #[error("{0}")]
    DockerWorker(DockerError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error("failed to write run record {path}: {source}")]
    Record {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Fetch(#[from] FetchError),
    /// The recipe cannot be deployed as it is (exit 2): a name over Docker's limit, a compose
    /// file abra cannot read, a `.env.sample` naming no usable recipe.
    #[error("recipe {recipe}: {why}; nothing was deployed")]
    Recipe { recipe: String, why: String },
    #[error("recipe {recipe}: {source}")]
    RecipeRead {
        recipe: String,
        source: crate::recipe::RecipeError,
    },
    #[error("failed to watch the app lock for its loss: {0}")]
    LossWatch(std::io::Error),
    #[error(transparent)]
    Watchdog(#[from] crate::supervise::watchdog::WatchdogError),
    #[error(
        "failed to start the fence that kills the run's processes should its supervisor die \
         (or its etcd lease expire): {0}; not starting the command without it"
    )]
    Fence(std::io::Error),
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error(
        "failed to clear what the previous holder of the app lock of {domain} left: {why}; \
         not starting the command beside it"
    )]
    Predecessor { domain: String, why: String },
    #[error(
        "an earlier run of stack {stack} may have left containers or volumes on a node that \
         could not be checked within {waited:.1?}: {why}; not starting the command, whose deploy \
         could mount that data (the .env stays for the next sweep)"
    )]
    NodesNotClean {
        stack: String,
        waited: Duration,
        why: String,
    },
}

impl RunError {
    pub(crate) fn exit_code(&self) -> u8 {
        match self {
            Self::Recipe { .. } => exit::USAGE,
            _ => exit::INTERNAL,
        }
    }
}

impl From<RunError> for crate::error::Error {
    fn from(err: RunError) -> Self {
        let code = err.exit_code();
        Self::command(err, code)
    }
}
