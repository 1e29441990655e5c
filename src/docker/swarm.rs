//! What swarm says about one stack right now: its services, their tasks and (only when a
//! global service needs them) the nodes, read as plain data for [`crate::converge`] to judge.
//!
//! One poll is at most three list calls whatever the stack's size: the services of the stack
//! (by the label `com.docker.stack.namespace`), the tasks of exactly those services (by service
//! id, so services made without the stack's container labels are seen too), and the nodes. A
//! poll can be cut short by a descriptor turning readable (the signal funnel's), and by a
//! deadline; it never decides anything. Only API 1.41 fields are read.

use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::time::SystemTime;

use bollard::errors::Error as BollardError;
use bollard::models::{ServiceUpdateStatusStateEnum, TaskState as ApiTaskState};
use bollard::query_parameters::{ListNodesOptions, ListServicesOptions, ListTasksOptions};
use serde::Serialize;

use crate::docker::seam::{DockerSeam, STACK_LABEL};

/// A service's mode, with what it asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Replicated {
        replicas: u64,
    },
    Global,
    /// Done once `completions` tasks of the current iteration have completed.
    ReplicatedJob {
        completions: u64,
    },
    GlobalJob,
}

impl Mode {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::Replicated { .. } => "replicated",
            Mode::Global => "global",
            Mode::ReplicatedJob { .. } => "replicated-job",
            Mode::GlobalJob => "global-job",
        }
    }

    /// Whether the desired count is one per eligible node.
    pub(crate) fn per_node(self) -> bool {
        matches!(self, Mode::Global | Mode::GlobalJob)
    }
}

/// A service's `UpdateStatus.State`; `None` when it was never updated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum UpdateState {
    Updating,
    Paused,
    Completed,
    RollbackStarted,
    RollbackPaused,
    RollbackCompleted,
}

impl UpdateState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            UpdateState::Updating => "updating",
            UpdateState::Paused => "paused",
            UpdateState::Completed => "completed",
            UpdateState::RollbackStarted => "rollback_started",
            UpdateState::RollbackPaused => "rollback_paused",
            UpdateState::RollbackCompleted => "rollback_completed",
        }
    }
}

/// One service of the stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Service {
    pub id: String,
    pub name: String,
    pub mode: Mode,
    pub update: Option<UpdateState>,
    pub update_message: String,
    /// When its current spec took over (the update's or rollback's start, else the service's
    /// creation): tasks that failed before belong to an older spec. (`UpdatedAt` will not do:
    /// swarm moves it with every write, the update status's own too.)
    pub spec_since: Option<SystemTime>,
    /// `Placement.Constraints`, as written (`node.role == manager`).
    pub constraints: Vec<String>,
    /// A job's current iteration (`JobStatus.JobIteration.Index`).
    pub job_iteration: u64,
    /// The service's own labels (a recipe's deploy labels: `coop-cloud.<stack>.timeout`).
    pub labels: std::collections::BTreeMap<String, String>,
}

/// The states of a task that matter here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TaskPhase {
    /// Anything before running (new … starting).
    Pending,
    Running,
    Complete,
    Failed,
    Rejected,
    /// Shut down, removed, orphaned.
    Gone,
}

/// One task of one of the stack's services.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Task {
    pub id: String,
    pub service_id: String,
    pub slot: Option<u64>,
    pub node_id: String,
    /// Whether swarm wants it running (or, for a job, completed).
    pub desired_live: bool,
    pub phase: TaskPhase,
    pub err: String,
    pub exit_code: Option<i64>,
    pub at: Option<SystemTime>,
    pub job_iteration: u64,
}

/// One node, with what placement constraints look at.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Node {
    pub id: String,
    pub hostname: String,
    pub role: String,
    pub ready: bool,
    pub active: bool,
    pub labels: HashMap<String, String>,
    pub engine_labels: HashMap<String, String>,
    pub os: String,
    pub arch: String,
}

/// Everything one poll saw of the stack.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct StackState {
    pub services: Vec<Service>,
    pub tasks: Vec<Task>,
    /// Listed only when a global service needs them.
    pub nodes: Option<Vec<Node>>,
}

/// How a poll ended.
#[derive(Debug)]
pub(crate) enum Polled {
    Seen(StackState),
    /// The descriptor turned readable first (a signal arrived).
    Interrupted,
    /// The deadline passed first.
    TimedOut,
}

/// A failed poll: `transient` when the next poll may well succeed (a broken connection, a
/// request time-out); otherwise the engine is unreachable or refuses (not a swarm manager).
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("{message}")]
pub(crate) struct PollError {
    pub message: String,
    pub transient: bool,
}

impl DockerSeam {
    /// One poll of `stack`: services, their tasks, and nodes when a global service needs
    /// them. Ends early when `wake` turns readable or `deadline` passes.
    pub(crate) fn stack_state(
        &self,
        stack: &str,
        wake: Option<BorrowedFd<'_>>,
        deadline: std::time::Instant,
    ) -> Result<Polled, PollError> {
        self.runtime.block_on(async {
            let deadline = tokio::time::Instant::from_std(deadline);
            let poll = tokio::time::timeout_at(deadline, self.poll_stack(stack));
            let woken = async {
                // SAFETY: a `BorrowedFd` is open for as long as it is borrowed, and the
                // registration is dropped before this call returns, inside the borrow.
                let registered = wake.map(|fd| unsafe {
                    tokio::io::unix::AsyncFd::register_with_interest(
                        fd,
                        tokio::io::Interest::READABLE,
                    )
                });
                match registered {
                    Some(Ok(fd)) => {
                        let _ = fd.readable().await;
                    }
                    // Without a descriptor to watch (or one tokio cannot), nothing wakes us.
                    _ => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                biased;
                () = woken => Ok(Polled::Interrupted),
                done = poll => match done {
                    Ok(state) => state.map(Polled::Seen),
                    Err(_) => Ok(Polled::TimedOut),
                },
            }
        })
    }

    async fn poll_stack(&self, stack: &str) -> Result<StackState, PollError> {
        let d = &self.docker;
        let label = HashMap::from([("label".to_owned(), vec![format!("{STACK_LABEL}={stack}")])]);
        self.count_list_call();
        let services = d
            .list_services(Some(ListServicesOptions {
                filters: Some(label),
                status: None,
            }))
            .await
            .map_err(failed("services"))?;
        let services: Vec<Service> = services.into_iter().filter_map(service).collect();
        if services.is_empty() {
            return Ok(StackState::default());
        }
        let ids: Vec<String> = services.iter().map(|s| s.id.clone()).collect();
        let need_nodes = services.iter().any(|s| s.mode.per_node());
        self.count_list_call();
        let tasks = d.list_tasks(Some(ListTasksOptions {
            filters: Some(HashMap::from([("service".to_owned(), ids)])),
        }));
        let (tasks, nodes) = if need_nodes {
            self.count_list_call();
            let (tasks, nodes) = tokio::join!(tasks, d.list_nodes(None::<ListNodesOptions>));
            (tasks, Some(nodes.map_err(failed("nodes"))?))
        } else {
            (tasks.await, None)
        };
        let tasks = tasks.map_err(failed("tasks"))?;
        Ok(StackState {
            tasks: tasks.into_iter().filter_map(task).collect(),
            nodes: nodes.map(|n| n.into_iter().map(node).collect()),
            services,
        })
    }

    fn count_list_call(&self) {
        self.list_calls.set(self.list_calls.get() + 1);
    }
}

fn failed(kind: &'static str) -> impl Fn(BollardError) -> PollError {
    move |err| PollError {
        transient: matches!(
            err,
            BollardError::RequestTimeoutError | BollardError::HyperResponseError { .. }
        ) || matches!(&err, BollardError::IOError { err } if !crate::docker::seam::is_connect_failure(err)),
        message: format!("failed to list {kind}: {err}"),
    }
}

fn time(text: Option<&String>) -> Option<SystemTime> {
    text.and_then(|t| humantime::parse_rfc3339(t).ok())
}

fn service(s: bollard::models::Service) -> Option<Service> {
    let spec = s.spec?;
    let labels = spec
        .labels
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    let mode = spec.mode.unwrap_or_default();
    let count = |n: Option<i64>, default: u64| n.map_or(default, |n| u64::try_from(n).unwrap_or(0));
    let mode = if let Some(r) = mode.replicated {
        Mode::Replicated {
            replicas: count(r.replicas, 1),
        }
    } else if mode.global.is_some() {
        Mode::Global
    } else if let Some(job) = mode.replicated_job {
        // Swarm's defaults: one at a time, and as many completions as may run at once.
        let concurrent = count(job.max_concurrent, 1);
        Mode::ReplicatedJob {
            completions: count(job.total_completions, concurrent),
        }
    } else if mode.global_job.is_some() {
        Mode::GlobalJob
    } else {
        Mode::Replicated { replicas: 1 }
    };
    let status = s.update_status.unwrap_or_default();
    let update = status.state.and_then(|state| match state {
        ServiceUpdateStatusStateEnum::UPDATING => Some(UpdateState::Updating),
        ServiceUpdateStatusStateEnum::PAUSED => Some(UpdateState::Paused),
        ServiceUpdateStatusStateEnum::COMPLETED => Some(UpdateState::Completed),
        ServiceUpdateStatusStateEnum::ROLLBACK_STARTED => Some(UpdateState::RollbackStarted),
        ServiceUpdateStatusStateEnum::ROLLBACK_PAUSED => Some(UpdateState::RollbackPaused),
        ServiceUpdateStatusStateEnum::ROLLBACK_COMPLETED => Some(UpdateState::RollbackCompleted),
        ServiceUpdateStatusStateEnum::EMPTY => None,
    });
    Some(Service {
        id: s.id?,
        name: spec.name?,
        mode,
        update,
        update_message: status.message.unwrap_or_default(),
        spec_since: time(status.started_at.as_ref()).or_else(|| time(s.created_at.as_ref())),
        constraints: spec
            .task_template
            .and_then(|t| t.placement)
            .and_then(|p| p.constraints)
            .unwrap_or_default(),
        labels,
        job_iteration: s
            .job_status
            .and_then(|j| j.job_iteration)
            .and_then(|v| v.index)
            .unwrap_or(0),
    })
}

fn phase(state: Option<ApiTaskState>) -> TaskPhase {
    match state {
        Some(ApiTaskState::RUNNING) => TaskPhase::Running,
        Some(ApiTaskState::COMPLETE) => TaskPhase::Complete,
        Some(ApiTaskState::FAILED) => TaskPhase::Failed,
        Some(ApiTaskState::REJECTED) => TaskPhase::Rejected,
        Some(ApiTaskState::SHUTDOWN | ApiTaskState::REMOVE | ApiTaskState::ORPHANED) => {
            TaskPhase::Gone
        }
        _ => TaskPhase::Pending,
    }
}

fn task(t: bollard::models::Task) -> Option<Task> {
    let status = t.status.unwrap_or_default();
    Some(Task {
        id: t.id?,
        service_id: t.service_id?,
        slot: t.slot.and_then(|s| u64::try_from(s).ok()),
        node_id: t.node_id.unwrap_or_default(),
        // A job's tasks are desired "complete"; a service's "running".
        desired_live: matches!(
            t.desired_state,
            Some(ApiTaskState::RUNNING | ApiTaskState::COMPLETE)
        ),
        phase: phase(status.state),
        err: status.err.unwrap_or_default(),
        exit_code: status.container_status.and_then(|c| c.exit_code),
        at: time(status.timestamp.as_ref()),
        job_iteration: t.job_iteration.and_then(|v| v.index).unwrap_or(0),
    })
}

pub(crate) fn node(n: bollard::models::Node) -> Node {
    let spec = n.spec.unwrap_or_default();
    let description = n.description.unwrap_or_default();
    let platform = description.platform.unwrap_or_default();
    Node {
        id: n.id.unwrap_or_default(),
        hostname: description.hostname.unwrap_or_default(),
        role: spec.role.map(|r| r.to_string()).unwrap_or_default(),
        ready: n
            .status
            .and_then(|s| s.state)
            .is_some_and(|s| s == bollard::models::NodeState::READY),
        active: spec
            .availability
            .is_some_and(|a| a == bollard::models::NodeSpecAvailabilityEnum::ACTIVE),
        labels: spec.labels.unwrap_or_default(),
        engine_labels: description
            .engine
            .and_then(|e| e.labels)
            .unwrap_or_default(),
        os: platform.os.unwrap_or_default(),
        arch: platform.architecture.unwrap_or_default(),
    }
}
