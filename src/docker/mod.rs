//! The Docker seam: discovery of run-app stacks and removal of one stack, through bollard.
//!
//! This folder is the only code that talks to the engine (clippy keeps the bollard client here)
//! and holds its retry policy ([`backoff`]) and the choice of engine ([`endpoint`]: exactly the
//! one `DOCKER_HOST` names, over a Unix socket, TCP or TLS). It must never decide what to reap: callers hand it
//! the stacks whose locks they hold.
//!
//! Discovery makes exactly one list call per resource kind (services, containers, networks,
//! volumes, secrets, configs) however many stacks there are, and counts them so tests can check.
//! A resource belongs to stack S when it carries the label `com.docker.stack.namespace=S` or is
//! named `S_…` (external secrets carry no label); S maps back to a domain only through
//! `RUN_APP_RE`, so nothing outside the run-app namespace is ever touched.
//!
//! Removal is idempotent (404 means already gone) and ordered so that nothing waits on swarm:
//! services, then the stack's containers force-removed, networks, secrets, configs, and volumes
//! last. Transient failures are retried with full jitter ([`crate::docker::backoff`]); other client
//! errors are not. Only API 1.41 (Docker 20.10) endpoints are used; the version is negotiated.
//!
//! [`swarm`] reads one stack's services, tasks and nodes for `converge`, three list calls at most.
//!
//! Floor: backends (docs/architecture.md): imports the floors below and the other backends, never a
//! command.
#![allow(clippy::disallowed_types)]

pub(crate) mod backoff;
pub(crate) mod endpoint;
pub(crate) mod nodes;
pub(crate) mod swarm;

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bollard::Docker;
use bollard::errors::Error as BollardError;
use bollard::query_parameters::{
    InspectNetworkOptions, ListConfigsOptions, ListContainersOptions, ListNetworksOptions,
    ListSecretsOptions, ListServicesOptions, ListVolumesOptions, RemoveContainerOptions,
    RemoveVolumeOptions,
};
use futures_util::stream::{self, StreamExt};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use serde::Serialize;

use crate::config::{DockerMode, NodeSweepSettings};
use crate::docker::backoff::{Backoff, MonotonicClock, Policy};
pub(crate) use crate::docker::endpoint::Endpoint;
use crate::names::{AppDomain, RunAppPattern};

pub(crate) const STACK_LABEL: &str = "com.docker.stack.namespace";

/// How long one Docker API request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// How often a long reap says what is still listed.
const PROGRESS_EVERY: Duration = Duration::from_secs(30);

/// How many delete requests of one kind are in flight at once.
pub(crate) const REAP_CONCURRENCY: usize = 16;

/// How long a reaped stack that had services must stay unlisted before it counts as gone.
const SETTLE: Duration = Duration::from_millis(750);

/// How many stacks have their containers and the rest removed at once.
const STACKS_AT_ONCE: usize = 4;

/// A Docker resource: its id (what the API removes by) and its name (what people read).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Resource {
    pub id: String,
    pub name: String,
}

/// Every resource of one stack, by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct StackResources {
    pub services: Vec<Resource>,
    pub containers: Vec<Resource>,
    pub networks: Vec<Resource>,
    pub volumes: Vec<Resource>,
    pub secrets: Vec<Resource>,
    pub configs: Vec<Resource>,
}

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

/// Names of what a removal took away, by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct RemovedNames {
    pub services: Vec<String>,
    pub containers: Vec<String>,
    pub networks: Vec<String>,
    pub volumes: Vec<String>,
    pub secrets: Vec<String>,
    pub configs: Vec<String>,
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
    docker: Docker,
    runtime: tokio::runtime::Runtime,
    list_calls: Cell<usize>,
    poll_rounds: Cell<usize>,
    /// How a reap reaches the other nodes of a swarm.
    node_sweep: NodeSweepSettings,
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
fn shown(wait: Duration) -> String {
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
        let info = self
            .runtime
            .block_on(async { tokio::time::timeout_at(until, self.docker.info()).await })
            .map_err(|_| late())?
            .map_err(|e| DockerError(format!("failed to ask Docker about its swarm: {e}")))?;
        let swarm = info.swarm.unwrap_or_default();
        Ok(EngineFacts {
            version: version.version.unwrap_or_default(),
            api_version: version.api_version.unwrap_or_default(),
            negotiated: self.docker.client_version().to_string(),
            swarm_state: swarm
                .local_node_state
                .map(|s| s.to_string())
                .unwrap_or_default(),
            swarm_manager: swarm.control_available.unwrap_or(false),
            swarm_error: swarm.error.filter(|e| !e.is_empty()),
        })
    }

    /// Refuse an engine that is a swarm worker: a worker answers every stack call with 503
    /// ("not a swarm manager"), so nothing of an app can be listed, judged or removed through it.
    /// An engine outside a swarm, or a manager, passes.
    pub(crate) fn refuse_a_worker(&self) -> Result<(), DockerError> {
        self.refuse_a_worker_within(Duration::from_secs(10))
    }

    /// [`Self::refuse_a_worker`], the engine's answer awaited at most `within`.
    pub(crate) fn refuse_a_worker_within(&self, within: Duration) -> Result<(), DockerError> {
        let facts = self.engine_facts(within)?;
        if facts.swarm_state == "active" && !facts.swarm_manager {
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

    /// Every run-app stack's resources: one list call per kind.
    pub(crate) fn discover(
        &self,
        pattern: &RunAppPattern,
    ) -> Result<BTreeMap<AppDomain, StackResources>, DockerError> {
        self.runtime.block_on(self.list(pattern))
    }

    /// One list call per kind, sorted into run-app stacks.
    async fn list(
        &self,
        pattern: &RunAppPattern,
    ) -> Result<BTreeMap<AppDomain, StackResources>, DockerError> {
        self.list_calls.set(self.list_calls.get() + 6);
        let d = &self.docker;
        let (services, containers, networks, volumes, secrets, configs) = tokio::join!(
            d.list_services(Some(ListServicesOptions::default())),
            d.list_containers(Some(ListContainersOptions {
                all: true,
                ..Default::default()
            })),
            d.list_networks(Some(ListNetworksOptions::default())),
            d.list_volumes(Some(ListVolumesOptions::default())),
            d.list_secrets(Some(ListSecretsOptions::default())),
            d.list_configs(Some(ListConfigsOptions::default())),
        );
        fn failed(kind: &'static str) -> impl Fn(BollardError) -> DockerError {
            move |e| DockerError(format!("failed to list {kind}: {e}"))
        }
        let mut found: BTreeMap<AppDomain, StackResources> = BTreeMap::new();
        let mut add = |labels: Option<&HashMap<String, String>>,
                       id: Option<String>,
                       name: Option<String>,
                       pick: fn(&mut StackResources) -> &mut Vec<Resource>| {
            let (Some(id), Some(name)) = (id, name) else {
                return;
            };
            let by_label = labels
                .and_then(|l| l.get(STACK_LABEL))
                .and_then(|stack| pattern.domain_of_stack(stack));
            let Some(domain) = by_label.or_else(|| pattern.domain_of_resource(&name)) else {
                return;
            };
            let name = name.trim_start_matches('/').to_owned();
            pick(found.entry(domain).or_default()).push(Resource { id, name });
        };
        for s in services.map_err(failed("services"))? {
            let spec = s.spec.unwrap_or_default();
            add(spec.labels.as_ref(), s.id, spec.name, |r| &mut r.services);
        }
        for c in containers.map_err(failed("containers"))? {
            let name = c.names.and_then(|n| n.into_iter().next());
            add(c.labels.as_ref(), c.id, name, |r| &mut r.containers);
        }
        for n in networks.map_err(failed("networks"))? {
            add(n.labels.as_ref(), n.id, n.name, |r| &mut r.networks);
        }
        for v in volumes
            .map_err(failed("volumes"))?
            .volumes
            .unwrap_or_default()
        {
            add(Some(&v.labels), Some(v.name.clone()), Some(v.name), |r| {
                &mut r.volumes
            });
        }
        for s in secrets.map_err(failed("secrets"))? {
            let spec = s.spec.unwrap_or_default();
            add(spec.labels.as_ref(), s.id, spec.name, |r| &mut r.secrets);
        }
        for c in configs.map_err(failed("configs"))? {
            let spec = c.spec.unwrap_or_default();
            add(spec.labels.as_ref(), c.id, spec.name, |r| &mut r.configs);
        }
        Ok(found)
    }

    /// Reap `stacks` and confirm it: delete everything each stack has, then poll — one list
    /// call per kind per round for all the stacks, full-jitter backoff between rounds — until
    /// the engine lists nothing of a stack any more, deleting again whatever is still listed.
    /// Past `budget` (or when all that is left is blocked by another stack) what is still
    /// there is reported. On a swarm of several nodes, the stacks the manager no longer lists
    /// are then swept off every node ([`nodes`]) within the same budget; a stack counts as
    /// gone only when every node that must answer did. A stack with nothing listed is still
    /// swept off the other nodes. The results come back in the order of `stacks`.
    pub(crate) fn reap(
        &self,
        pattern: &RunAppPattern,
        stacks: Vec<(AppDomain, StackResources)>,
        budget: Duration,
    ) -> Vec<Reaped> {
        let deadline = tokio::time::Instant::now() + budget;
        // The swarm could not be asked: no stack is touched, each says why.
        let count = stacks.len();
        let failed = move |err: DockerError| {
            let reaped = Reaped {
                errors: vec![err],
                ..Reaped::default()
            };
            vec![reaped; count]
        };
        self.runtime.block_on(async {
            let nodes = match self.swarm_nodes().await {
                Ok(nodes) => nodes.filter(nodes::Nodes::several),
                Err(err) => return failed(err),
            };
            let named: Vec<(String, Vec<String>)> = stacks
                .iter()
                .map(|(domain, stack)| {
                    let ids = stack.services.iter().map(|s| s.id.clone()).collect();
                    (domain.stack_name(), ids)
                })
                .collect();
            // Where the stacks' tasks are, before their services go (and the tasks with them).
            let had = match &nodes {
                Some(_) => match self.stack_task_nodes(&named).await {
                    Ok((had, _)) => Some(had),
                    Err(err) => return failed(err),
                },
                None => None,
            };
            let mut out = if stacks.iter().any(|(_, s)| !s.is_empty()) {
                self.reap_until(pattern, stacks, deadline).await
            } else {
                vec![
                    Reaped {
                        confirmed: true,
                        ..Reaped::default()
                    };
                    stacks.len()
                ]
            };
            let (Some(nodes), Some(had)) = (nodes, had) else {
                return out;
            };
            let ready: Vec<usize> = (0..out.len()).filter(|&i| out[i].gone()).collect();
            if ready.is_empty() {
                return out;
            }
            let swept: Vec<(String, Vec<String>)> =
                ready.iter().map(|&i| named[i].clone()).collect();
            let started = std::time::Instant::now();
            let unconfirmed = self
                .sweep_nodes(&self.node_sweep, &nodes, &swept, &had, deadline)
                .await;
            tracing::debug!(stacks = swept.len(), elapsed = ?started.elapsed(), "reap: node sweep done");
            for (i, nodes) in ready.into_iter().zip(unconfirmed) {
                out[i].nodes = nodes
                    .into_iter()
                    .map(|(node, why)| match node.as_str() {
                        "" => format!("not confirmed gone on the other nodes: {why}"),
                        node => format!("not confirmed gone on node {node}: {why}"),
                    })
                    .collect();
            }
            out
        })
    }

    /// How many poll rounds reaps of this seam have made.
    pub(crate) fn poll_rounds(&self) -> usize {
        self.poll_rounds.get()
    }

    async fn reap_until(
        &self,
        pattern: &RunAppPattern,
        stacks: Vec<(AppDomain, StackResources)>,
        deadline: tokio::time::Instant,
    ) -> Vec<Reaped> {
        let docker = &self.docker;
        let mut confirming = Confirming::new(&stacks);
        // Everything known, kind by kind across all the stacks: every service goes first, so
        // swarm's own asynchronous clean-up of every stack overlaps with the container
        // removals (which the daemon serialises). Nothing here waits on swarm.
        let started = std::time::Instant::now();
        let all: Vec<&StackResources> = stacks.iter().map(|(_, stack)| stack).collect();
        if let Ok(done) = tokio::time::timeout_at(deadline, delete_all(docker, &all)).await {
            for (out, (removed, errors)) in confirming.out.iter_mut().zip(done) {
                out.removed = removed;
                out.errors = errors;
            }
        }
        tracing::debug!(stacks = stacks.len(), elapsed = ?started.elapsed(), "reap: deletes sent");
        let rng = Xoshiro256PlusPlus::from_rng(&mut rand::rng());
        let mut backoff = Backoff::new(Policy::CONFIRM, rng, MonotonicClock);
        let mut next_progress = started + PROGRESS_EVERY;
        loop {
            self.poll_rounds.set(self.poll_rounds.get() + 1);
            let listing = match self.list(pattern).await {
                Ok(listing) => listing,
                Err(err) => {
                    confirming.fail_pending(&err);
                    break;
                }
            };
            let now = tokio::time::Instant::now();
            let round = confirming.judge(&listing, now, deadline);
            tracing::debug!(pending = round.still.len(), settling = round.settling.len(), elapsed = ?started.elapsed(), "reap: poll round");
            if (round.still.is_empty() && round.settling.is_empty()) || now >= deadline {
                break;
            }
            if std::time::Instant::now() >= next_progress {
                next_progress += PROGRESS_EVERY;
                crate::report::line(&format!(
                    "== reap: {} stack(s) still listed after {} s: {} ==",
                    round.still.len(),
                    started.elapsed().as_secs(),
                    round
                        .still
                        .iter()
                        .map(|(i, _)| stacks[*i].0.stack_name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            confirming.delete_again(docker, &round).await;
            confirming.pending = round.pending();
            if confirming.stuck(&round) {
                break;
            }
            let Some(delay) = confirming.delay(&round, now, &mut backoff) else {
                break;
            };
            tokio::time::sleep_until((now + delay).min(deadline)).await;
        }
        confirming.out
    }
}

/// Where confirming a reap stands: which stacks are still pending, since when each has been
/// unlisted, and each one's report so far.
struct Confirming<'s> {
    stacks: &'s [(AppDomain, StackResources)],
    out: Vec<Reaped>,
    pending: Vec<usize>,
    quiet_since: HashMap<usize, tokio::time::Instant>,
}

/// What one poll round saw of the pending stacks.
struct Round {
    /// Still listed, with what is left.
    still: Vec<(usize, StackResources)>,
    /// Unlisted, but not for long enough yet.
    settling: Vec<usize>,
}

impl Round {
    fn pending(&self) -> Vec<usize> {
        self.still
            .iter()
            .map(|(i, _)| *i)
            .chain(self.settling.iter().copied())
            .collect()
    }
}

impl<'s> Confirming<'s> {
    fn new(stacks: &'s [(AppDomain, StackResources)]) -> Self {
        Self {
            stacks,
            out: vec![Reaped::default(); stacks.len()],
            pending: (0..stacks.len()).collect(),
            quiet_since: HashMap::new(),
        }
    }

    /// The engine could not be asked: every pending stack says why.
    fn fail_pending(&mut self, err: &DockerError) {
        for &i in &self.pending {
            self.out[i].errors.push(err.clone());
        }
    }

    /// Sort the pending stacks by what the engine lists now. When the stack had services,
    /// "nothing listed" must hold twice, SETTLE apart: a task swarm had already handed to this
    /// node may still start after its service is gone and bring the stack's network back.
    fn judge(
        &mut self,
        listing: &BTreeMap<AppDomain, StackResources>,
        now: tokio::time::Instant,
        deadline: tokio::time::Instant,
    ) -> Round {
        let mut round = Round {
            still: Vec::new(),
            settling: Vec::new(),
        };
        for i in std::mem::take(&mut self.pending) {
            let (domain, stack) = &self.stacks[i];
            let left = listing.get(domain).cloned().unwrap_or_default();
            let out = &mut self.out[i];
            if !left.is_empty() {
                self.quiet_since.remove(&i);
                out.remaining = describe(&left);
                tracing::trace!(stack = %domain, left = ?out.remaining, "reap: still listed");
                round.still.push((i, left));
                continue;
            }
            out.remaining.clear();
            out.blocked.clear();
            let since = *self.quiet_since.entry(i).or_insert(now);
            let settle = if stack.services.is_empty() {
                Duration::ZERO
            } else {
                SETTLE
            };
            if now.duration_since(since) >= settle || now >= deadline {
                out.confirmed = true;
                out.errors.clear();
            } else {
                round.settling.push(i);
            }
        }
        round
    }

    /// Whatever is still listed is deleted again (idempotent); a network that only another
    /// stack's containers hold is reported, never force-detached.
    async fn delete_again(&mut self, docker: &Docker, round: &Round) {
        let lefts: Vec<&StackResources> = round.still.iter().map(|(_, left)| left).collect();
        let deleted = delete_all(docker, &lefts).await;
        for ((i, left), (removed, errors)) in round.still.iter().zip(deleted) {
            let blocked = blocked_networks(docker, left, &removed.networks).await;
            let out = &mut self.out[*i];
            out.removed.merge(removed);
            out.errors = errors;
            out.blocked = blocked;
        }
    }

    /// Nothing will change by itself when all that is left is blocked networks.
    fn stuck(&self, round: &Round) -> bool {
        round.settling.is_empty()
            && round.still.iter().all(|(i, left)| {
                left.only_networks() && self.out[*i].blocked.len() == left.networks.len()
            })
    }

    /// How long to wait before the next round: until the first settling window closes when
    /// only settling stacks are left, else the backoff's next delay (`None`: give up).
    fn delay<R: rand::Rng, C: crate::docker::backoff::Clock>(
        &self,
        round: &Round,
        now: tokio::time::Instant,
        backoff: &mut Backoff<R, C>,
    ) -> Option<Duration> {
        if !round.still.is_empty() {
            return backoff.next_delay();
        }
        Some(
            round
                .settling
                .iter()
                .filter_map(|i| self.quiet_since.get(i))
                .map(|since| (*since + SETTLE).saturating_duration_since(now))
                .min()
                .unwrap_or(SETTLE),
        )
    }
}

/// What a reap of one stack came to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Reaped {
    /// What this reap removed.
    pub removed: RemovedNames,
    /// The engine was asked after the deletes and listed nothing of the stack.
    pub confirmed: bool,
    /// What the engine still listed when the reap stopped, as `<kind> <name>`.
    pub remaining: Vec<String>,
    /// Why some of it cannot go by itself.
    pub blocked: Vec<String>,
    /// Failed requests, when the stack is not confirmed gone.
    pub errors: Vec<DockerError>,
    /// Nodes of a swarm not confirmed clean of the stack, each with why.
    pub nodes: Vec<String>,
}

impl Reaped {
    /// Gone for good: the next deploy of the same stack can start at once.
    pub(crate) fn gone(&self) -> bool {
        self.confirmed && self.remaining.is_empty() && self.nodes.is_empty()
    }

    /// Everything that went wrong, in words, for a report.
    pub(crate) fn problems(&self) -> Vec<String> {
        let mut problems: Vec<String> = self.errors.iter().map(|e| e.0.clone()).collect();
        if !self.remaining.is_empty() {
            problems.push(format!("still there: {}", self.remaining.join(", ")));
        }
        problems.extend(self.blocked.iter().cloned());
        problems.extend(self.nodes.iter().cloned());
        problems
    }
}

impl RemovedNames {
    fn merge(&mut self, mut other: RemovedNames) {
        for kind in Kind::REMOVAL_ORDER {
            let names = std::mem::take(kind.names_mut(&mut other));
            let mine = kind.names_mut(self);
            for name in names {
                if !mine.contains(&name) {
                    mine.push(name);
                }
            }
        }
    }
}

impl StackResources {
    fn only_networks(&self) -> bool {
        self.services.is_empty()
            && self.containers.is_empty()
            && self.volumes.is_empty()
            && self.secrets.is_empty()
            && self.configs.is_empty()
    }
}

/// `<kind> <name>` of every resource.
fn describe(stack: &StackResources) -> Vec<String> {
    Kind::REMOVAL_ORDER
        .iter()
        .flat_map(|kind| {
            kind.of(stack)
                .iter()
                .map(move |r| format!("{} {}", kind.noun(), r.name))
        })
        .collect()
}

/// One delete request per resource of every stack, in the order that never waits on swarm.
/// Every stack's services go first, all at once: from then on nothing restarts, and swarm's own
/// asynchronous clean-up of every stack has begun. Then stack after stack (four at a time): its
/// containers forced out, its networks, secrets, configs, volumes. The daemon serialises
/// container removals anyway; going stack by stack lets the first stacks' network clean-up
/// (swarm's, queued, one network after another) overlap with the later stacks' removals.
/// Keeps going past failures; the confirmation decides. Results in the stacks' order.
async fn delete_all(
    docker: &Docker,
    stacks: &[&StackResources],
) -> Vec<(RemovedNames, Vec<DockerError>)> {
    let mut out: Vec<(RemovedNames, Vec<DockerError>)> = vec![Default::default(); stacks.len()];
    let services = delete_kind(docker, Kind::Service, stacks).await;
    let rest: Vec<Vec<Deleted<'_>>> = stream::iter(stacks.iter().enumerate())
        .map(|(i, stack)| async move {
            let mut done = Vec::new();
            for kind in &Kind::REMOVAL_ORDER[1..] {
                let one = delete_kind(docker, *kind, &[stack]).await;
                done.extend(
                    one.into_iter()
                        .map(|(_, kind, res, outcome)| (i, kind, res, outcome)),
                );
            }
            done
        })
        .buffer_unordered(STACKS_AT_ONCE)
        .collect()
        .await;
    for (i, kind, res, outcome) in services.into_iter().chain(rest.into_iter().flatten()) {
        match outcome {
            Ok(true) => kind.names_mut(&mut out[i].0).push(res.name.clone()),
            Ok(false) => {}
            Err(err) => out[i].1.push(err),
        }
    }
    out
}

/// One delete request's outcome: the stack's index, the kind, the resource, what happened.
type Deleted<'a> = (usize, Kind, &'a Resource, Result<bool, DockerError>);

/// Delete every resource of `kind` of `stacks` at once (up to [`REAP_CONCURRENCY`] requests
/// in flight); the index is the stack's in `stacks`.
async fn delete_kind<'a>(
    docker: &Docker,
    kind: Kind,
    stacks: &[&'a StackResources],
) -> Vec<Deleted<'a>> {
    let requests = stacks
        .iter()
        .enumerate()
        .flat_map(|(i, stack)| kind.of(stack).iter().map(move |res| (i, res)));
    stream::iter(requests)
        .map(|(i, res)| async move { (i, kind, res, attempt(docker, kind, res).await) })
        .buffer_unordered(REAP_CONCURRENCY)
        .collect()
        .await
}

/// The networks still listed that only containers of other stacks hold, as report lines.
async fn blocked_networks(
    docker: &Docker,
    left: &StackResources,
    just_removed: &[String],
) -> Vec<String> {
    let mut blocked = Vec::new();
    for network in &left.networks {
        if just_removed.contains(&network.name) {
            continue;
        }
        let foreign = foreign_endpoints(docker, network, left).await;
        if !foreign.is_empty() {
            blocked.push(format!(
                "network {} is in use by {} of another stack; not detaching it",
                network.name,
                foreign.join(", ")
            ));
        }
    }
    blocked
}

/// Containers attached to `network` that are not the stack's own.
async fn foreign_endpoints(
    docker: &Docker,
    network: &Resource,
    stack: &StackResources,
) -> Vec<String> {
    let Ok(inspected) = docker
        .inspect_network(&network.id, None::<InspectNetworkOptions>)
        .await
    else {
        return Vec::new();
    };
    inspected
        .containers
        .unwrap_or_default()
        .into_iter()
        // Swarm's load-balancer endpoints (`lb-…`, `ep-…`) belong to the network itself; only
        // container ids (hex) are containers.
        .filter(|(id, _)| !id.is_empty() && id.bytes().all(|b| b.is_ascii_hexdigit()))
        .filter(|(id, _)| !stack.containers.iter().any(|c| c.id == *id))
        .map(|(id, endpoint)| {
            let name = endpoint.name.unwrap_or_default();
            format!("container {name} ({})", &id[..id.len().min(12)])
        })
        .collect()
}

/// One delete request: `Ok(true)` removed, `Ok(false)` already gone (404).
async fn attempt(docker: &Docker, kind: Kind, res: &Resource) -> Result<bool, DockerError> {
    match remove_one(docker, kind, res).await {
        Ok(()) => Ok(true),
        Err(err) if classify(&err) == Failure::Gone => Ok(false),
        Err(err) => Err(DockerError(format!(
            "failed to remove {} {}: {err}",
            kind.noun(),
            res.name
        ))),
    }
}

/// The kinds of resource a stack has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Service,
    Container,
    Network,
    Secret,
    Config,
    Volume,
}

impl Kind {
    /// Services first (nothing restarts then), containers forced out rather than waiting for
    /// swarm's stop delay, and volumes last: they are "in use" until the containers are gone.
    const REMOVAL_ORDER: [Kind; 6] = [
        Kind::Service,
        Kind::Container,
        Kind::Network,
        Kind::Secret,
        Kind::Config,
        Kind::Volume,
    ];

    fn noun(self) -> &'static str {
        match self {
            Kind::Service => "service",
            Kind::Container => "container",
            Kind::Network => "network",
            Kind::Secret => "secret",
            Kind::Config => "config",
            Kind::Volume => "volume",
        }
    }

    fn of(self, stack: &StackResources) -> &[Resource] {
        match self {
            Kind::Service => &stack.services,
            Kind::Container => &stack.containers,
            Kind::Network => &stack.networks,
            Kind::Secret => &stack.secrets,
            Kind::Config => &stack.configs,
            Kind::Volume => &stack.volumes,
        }
    }

    fn names_mut(self, removed: &mut RemovedNames) -> &mut Vec<String> {
        match self {
            Kind::Service => &mut removed.services,
            Kind::Container => &mut removed.containers,
            Kind::Network => &mut removed.networks,
            Kind::Secret => &mut removed.secrets,
            Kind::Config => &mut removed.configs,
            Kind::Volume => &mut removed.volumes,
        }
    }
}

/// One removal request.
async fn remove_one(docker: &Docker, kind: Kind, res: &Resource) -> Result<(), BollardError> {
    match kind {
        Kind::Service => docker.delete_service(&res.id).await,
        Kind::Container => force_remove_container(docker, &res.id).await,
        Kind::Network => docker.remove_network(&res.id).await,
        Kind::Secret => docker.delete_secret(&res.id).await,
        Kind::Config => docker.delete_config(&res.id).await,
        Kind::Volume => remove_volume(docker, &res.name).await,
    }
}

async fn force_remove_container(docker: &Docker, id: &str) -> Result<(), BollardError> {
    let options = RemoveContainerOptions {
        force: true,
        v: true,
        ..Default::default()
    };
    docker.remove_container(id, Some(options)).await
}

/// Remove a volume; when it is still in use by containers that are on their way out, force
/// them out first (the error names them) and report the failure as transient.
async fn remove_volume(docker: &Docker, name: &str) -> Result<(), BollardError> {
    let result = docker
        .remove_volume(name, Some(RemoveVolumeOptions { force: false }))
        .await;
    if let Err(BollardError::DockerResponseServerError { message, .. }) = &result {
        for id in containers_named_in(message) {
            let _ = force_remove_container(docker, &id).await;
        }
    }
    result
}

/// Container ids in a "volume is in use - [id, id]" message.
pub(crate) fn containers_named_in(message: &str) -> Vec<String> {
    let Some(list) = message
        .split_once("in use")
        .and_then(|(_, rest)| rest.split_once('['))
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| list)
    else {
        return Vec::new();
    };
    list.split(',')
        .map(str::trim)
        .filter(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_hexdigit()))
        .map(str::to_owned)
        .collect()
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

fn is_connect_failure(err: &std::io::Error) -> bool {
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

    #[rstest]
    #[case("remove v: volume is in use - [0a1b2c, 3d4e5f]", &["0a1b2c", "3d4e5f"])]
    #[case("remove v: volume is in use - [0a1b2c]", &["0a1b2c"])]
    #[case("volume is in use - []", &[])]
    #[case("something else [deadbeef]", &[])]
    #[case("in use - [not-hex!, ab]", &["ab"])]
    fn in_use_messages_name_containers(#[case] message: &str, #[case] ids: &[&str]) {
        assert_eq!(containers_named_in(message), ids);
    }
}
