//! The seam itself: one connection to the engine, what it says of itself, how a failed request
//! is classified, and the resources of a stack as the rest of the room hands them around.
//!
//! Floor: backends (docs/architecture.md): imports the floors below and the other backends, never a
//! command.
#![allow(clippy::disallowed_types)]

use std::cell::Cell;
use std::time::Duration;

use bollard::Docker;
use bollard::errors::Error as BollardError;

use serde::Serialize;

use crate::config::{DockerMode, NodeSweepSettings};
use crate::docker::endpoint::Endpoint;
use crate::names::AppDomain;

pub(crate) const STACK_LABEL: &str = "com.docker.stack.namespace";

/// How long one Docker API request may take.
pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// How often a long reap says what is still listed.
pub(super) const PROGRESS_EVERY: Duration = Duration::from_secs(30);

/// How many delete requests of one kind are in flight at once.
pub(crate) const REAP_CONCURRENCY: usize = 16;

/// How long a reaped stack that had services must stay unlisted before it counts as gone.
pub(super) const SETTLE: Duration = Duration::from_millis(750);

/// How many stacks have their containers and the rest removed at once.
pub(super) const STACKS_AT_ONCE: usize = 4;

/// A Docker resource: its id (what the API removes by), its name (what people read), and what
/// made it the stack's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Resource {
    pub id: String,
    pub name: String,
    pub by: Match,
}

/// What made a resource a stack's: its stack label, or (for what carries none, such as abra's
/// secrets) its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Match {
    /// `com.docker.stack.namespace=<stack>`.
    Label,
    /// No stack label, and named `<stack>_…`.
    Name,
}

impl Match {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Label => "label",
            Self::Name => "name",
        }
    }
}

/// Every resource of one stack, by kind, and what is named like it but not provably its.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct StackResources {
    pub services: Vec<Resource>,
    pub containers: Vec<Resource>,
    pub networks: Vec<Resource>,
    pub volumes: Vec<Resource>,
    pub secrets: Vec<Resource>,
    pub configs: Vec<Resource>,
    /// Objects without a stack label named `<stack>_…` that are no name the app gives: never
    /// removed, only reported.
    pub kept: Vec<Kept>,
}

/// An object without a stack label whose name begins with a run app's stack but that is not
/// provably the app's: kept, and said why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Kept {
    pub kind: &'static str,
    pub name: String,
    pub why: String,
}

/// The names the app of a domain gives Docker's objects (its recipe's, as its runs recorded
/// them); `None` when nothing says (then what carries no stack label is kept).
pub(crate) type GivenBy<'a> = &'a dyn Fn(&AppDomain) -> Option<crate::names::GivenNames>;

impl StackResources {
    pub(crate) fn is_empty(&self) -> bool {
        self.services.is_empty()
            && self.containers.is_empty()
            && self.networks.is_empty()
            && self.volumes.is_empty()
            && self.secrets.is_empty()
            && self.configs.is_empty()
    }
}

/// What to do when `--docker required` finds no engine: every refusal of that mode ends with it.
pub(crate) const REQUIRED_HINT: &str = "start the Docker engine, or point DOCKER_HOST at one \
    (unix:///PATH, tcp://HOST:PORT); or, to go on without it, set --docker auto (Docker apps are \
    left alone while it is unreachable) or --docker off (also CCCI_DOCKER, or docker in the \
    configuration file)";

/// What the engine says of itself, for `doctor`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EngineFacts {
    pub version: String,
    /// The newest API version the engine speaks.
    pub api_version: String,
    /// The API version this client negotiated with it.
    pub negotiated: String,
    /// `active`, `inactive`, `pending`, `error`, `locked`, or empty.
    pub swarm_state: String,
    /// Whether this node is a swarm manager (stacks are deployed through a manager).
    pub swarm_manager: bool,
    pub swarm_error: Option<String>,
}

/// A failed Docker request, in words.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub(crate) struct DockerError(pub String);

/// A connected, version-negotiated Docker client with its own single-threaded runtime.
pub(crate) struct DockerSeam {
    pub(super) docker: Docker,
    pub(super) runtime: tokio::runtime::Runtime,
    pub(super) list_calls: Cell<usize>,
    pub(super) poll_rounds: Cell<usize>,
    /// How a reap reaches the other nodes of a swarm.
    pub(super) node_sweep: NodeSweepSettings,
}

impl std::fmt::Debug for DockerSeam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DockerSeam")
            .field("list_calls", &self.list_calls.get())
            .finish_non_exhaustive()
    }
}

/// A wait as it is said: to a tenth of a second (what is left of a timeout is never a round
/// figure).
pub(super) fn shown(wait: Duration) -> String {
    crate::duration::show(Duration::from_millis(
        (wait.as_millis() as u64).div_ceil(100) * 100,
    ))
}

impl DockerSeam {
    /// Connect to the engine `DOCKER_HOST` names (the default socket only when it is unset) and
    /// negotiate the API version; an engine that does not answer is an error.
    pub(crate) fn connect() -> Result<Self, DockerError> {
        Self::connect_within(Duration::from_secs(10))
    }

    /// [`Self::connect`], the engine's first answer awaited at most `within`.
    pub(crate) fn connect_within(within: Duration) -> Result<Self, DockerError> {
        let endpoint = Endpoint::from_env().map_err(|e| DockerError(e.to_string()))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| DockerError(format!("failed to start the Docker client runtime: {e}")))?;
        let timeout = REQUEST_TIMEOUT.as_secs();
        let version = bollard::API_DEFAULT_VERSION;
        let client = match &endpoint {
            Endpoint::Unix(path) => {
                Docker::connect_with_unix(&path.to_string_lossy(), timeout, version)
            }
            Endpoint::Tcp(addr) => Docker::connect_with_http(addr, timeout, version),
            Endpoint::Tls {
                addr,
                ca,
                cert,
                key,
            } => Docker::connect_with_ssl(addr, key, cert, ca, timeout, version),
        };
        let docker = client
            .map_err(|e| {
                DockerError(format!(
                    "failed to set up the Docker client for {endpoint}: {e}"
                ))
            })?
            .with_timeout(REQUEST_TIMEOUT);
        let docker = runtime
            .block_on(async { tokio::time::timeout(within, docker.negotiate_version()).await })
            .map_err(|_| {
                DockerError(format!(
                    "Docker at {endpoint} did not answer within {}",
                    shown(within)
                ))
            })?
            .map_err(|e| DockerError(format!("Docker at {endpoint} is unreachable: {e}")))?;
        Ok(Self {
            docker,
            runtime,
            list_calls: Cell::new(0),
            poll_rounds: Cell::new(0),
            node_sweep: NodeSweepSettings::default(),
        })
    }

    /// The same seam, its reaps reaching the other nodes of a swarm as `settings` say.
    pub(crate) fn with_node_sweep(mut self, settings: NodeSweepSettings) -> Self {
        self.node_sweep = settings;
        self
    }

    /// What `doctor` reports of the engine: its version, the API version spoken, and the swarm
    /// state of its node; each request within `within`.
    /// Both questions together are given at most `within`.
    pub(crate) fn engine_facts(&self, within: Duration) -> Result<EngineFacts, DockerError> {
        let until = tokio::time::Instant::now() + within;
        let late = || DockerError(format!("Docker did not answer within {}", shown(within)));
        let version = self
            .runtime
            .block_on(async { tokio::time::timeout_at(until, self.docker.version()).await })
            .map_err(|_| late())?
            .map_err(|e| DockerError(format!("failed to ask Docker its version: {e}")))?;
        let (swarm_state, swarm_manager, swarm_error) = self.swarm_facts(until, within)?;
        Ok(EngineFacts {
            version: version.version.unwrap_or_default(),
            api_version: version.api_version.unwrap_or_default(),
            negotiated: self.docker.client_version().to_string(),
            swarm_state,
            swarm_manager,
            swarm_error,
        })
    }

    /// The swarm state of the engine's node, whether it is a manager, and the swarm's error,
    /// asked by `until` (`within` of the first question).
    fn swarm_facts(
        &self,
        until: tokio::time::Instant,
        within: Duration,
    ) -> Result<(String, bool, Option<String>), DockerError> {
        let info = self
            .runtime
            .block_on(async { tokio::time::timeout_at(until, self.docker.info()).await })
            .map_err(|_| DockerError(format!("Docker did not answer within {}", shown(within))))?
            .map_err(|e| DockerError(format!("failed to ask Docker about its swarm: {e}")))?;
        let swarm = info.swarm.unwrap_or_default();
        Ok((
            swarm
                .local_node_state
                .map(|s| s.to_string())
                .unwrap_or_default(),
            swarm.control_available.unwrap_or(false),
            swarm.error.filter(|e| !e.is_empty()),
        ))
    }

    /// Refuse an engine that is a swarm worker: a worker answers every stack call with 503
    /// ("not a swarm manager"), so nothing of an app can be listed, judged or removed through it.
    /// An engine outside a swarm, or a manager, passes.
    pub(crate) fn refuse_a_worker(&self) -> Result<(), DockerError> {
        self.refuse_a_worker_within(Duration::from_secs(10))
    }

    /// [`Self::refuse_a_worker`], the engine's answer awaited at most `within`.
    pub(crate) fn refuse_a_worker_within(&self, within: Duration) -> Result<(), DockerError> {
        let until = tokio::time::Instant::now() + within;
        let (state, manager, _) = self.swarm_facts(until, within)?;
        if state == "active" && !manager {
            return Err(DockerError(
                "the Docker engine (DOCKER_HOST) is a swarm worker, not a manager: a stack's \
                 services, secrets, configs and tasks are listed and removed only through a \
                 manager; point DOCKER_HOST at a manager's engine"
                    .to_owned(),
            ));
        }
        Ok(())
    }

    /// Whether the engine is the manager of a swarm of more than one node: only then can a
    /// stack leave what this engine cannot list. An engine that cannot say counts as "yes":
    /// the sweep that follows will say why.
    pub(crate) fn several_nodes(&self) -> bool {
        self.runtime
            .block_on(self.swarm_nodes())
            .map_or(true, |nodes| nodes.is_some_and(|n| n.several()))
    }

    /// How many list calls this seam has made.
    pub(crate) fn list_calls(&self) -> usize {
        self.list_calls.get()
    }
}

/// How a failed request should be handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// 404: the resource is already gone. Success, for a removal.
    Gone,
    /// "in use", 5xx, a connection reset or time-out: worth retrying.
    Transient,
    /// Any other client error: retrying will not help.
    Permanent,
}

pub(crate) fn classify(err: &BollardError) -> Failure {
    match err {
        BollardError::DockerResponseServerError {
            status_code: 404, ..
        } => Failure::Gone,
        BollardError::DockerResponseServerError { status_code, .. } if *status_code >= 500 => {
            Failure::Transient
        }
        BollardError::DockerResponseServerError { message, .. }
            if message.contains("in use") || message.contains("active endpoints") =>
        {
            Failure::Transient
        }
        BollardError::DockerResponseServerError { .. } => Failure::Permanent,
        // No connection at all: the daemon is down, and a minute of retries will not bring it
        // back; a connection that broke mid-request is worth another try.
        BollardError::HyperLegacyError { err } if err.is_connect() => Failure::Permanent,
        BollardError::IOError { err } if is_connect_failure(err) => Failure::Permanent,
        BollardError::SocketNotFoundError(_) => Failure::Permanent,
        BollardError::RequestTimeoutError
        | BollardError::IOError { .. }
        | BollardError::HyperResponseError { .. }
        | BollardError::HyperLegacyError { .. }
        | BollardError::HttpClientError { .. } => Failure::Transient,
        _ => Failure::Permanent,
    }
}

pub(super) fn is_connect_failure(err: &std::io::Error) -> bool {
    matches!(
        err.kind(),
        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
    )
}

/// One Docker connection, made on first use and kept: a run (or a janitor) negotiates the
/// API version once, whatever it asks of the engine later.
pub(crate) struct DockerLink {
    mode: DockerMode,
    node_sweep: NodeSweepSettings,
    seam: std::cell::OnceCell<Result<DockerSeam, DockerError>>,
}

impl DockerLink {
    /// Refuse, before anything is done, a `DOCKER_HOST` that names no engine we can use (unless
    /// Docker is off): a bad one must be a usage error, not an engine "unavailable" later.
    pub(crate) fn check_env(mode: DockerMode) -> Result<(), crate::names::NameError> {
        if mode == DockerMode::Off {
            return Ok(());
        }
        Endpoint::from_env().map(drop)
    }

    pub(crate) fn new(mode: DockerMode, node_sweep: NodeSweepSettings) -> Self {
        Self {
            mode,
            node_sweep,
            seam: std::cell::OnceCell::new(),
        }
    }

    pub(crate) fn mode(&self) -> DockerMode {
        self.mode
    }

    /// `None` with `--docker off`; otherwise the connection, made now if it was not yet.
    pub(crate) fn get(&self) -> Option<Result<&DockerSeam, &DockerError>> {
        if self.mode == DockerMode::Off {
            return None;
        }
        Some(
            self.seam
                .get_or_init(|| {
                    DockerSeam::connect().map(|seam| seam.with_node_sweep(self.node_sweep.clone()))
                })
                .as_ref(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn server(status_code: u16, message: &str) -> BollardError {
        BollardError::DockerResponseServerError {
            status_code,
            message: message.to_owned(),
        }
    }

    #[rstest]
    #[case(server(404, "no such service"), Failure::Gone)]
    #[case(server(409, "remove v: volume is in use - [abc]"), Failure::Transient)]
    #[case(
        server(403, "error while removing network: network n has active endpoints"),
        Failure::Transient
    )]
    #[case(
        server(400, "rpc error: secret s is in use by the following service: x"),
        Failure::Transient
    )]
    #[case(server(500, "internal"), Failure::Transient)]
    #[case(server(503, "swarm is busy"), Failure::Transient)]
    #[case(server(400, "invalid filter"), Failure::Permanent)]
    #[case(server(401, "unauthorized"), Failure::Permanent)]
    #[case(BollardError::RequestTimeoutError, Failure::Transient)]
    fn failures_are_classified(#[case] err: BollardError, #[case] want: Failure) {
        assert_eq!(classify(&err), want);
    }
}
