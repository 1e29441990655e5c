//! Every node of a multi-node swarm: what a stack left on the nodes a manager cannot reach into.
//!
//! A manager lists and removes a stack's services, networks, secrets and configs for the whole
//! swarm, but only its own node's containers and volumes: another node's task container goes
//! when that node's agent gets to it (seconds later, or only after its link returns), and its
//! copy of the stack's volumes stays for good, to be mounted by the next deploy of the same
//! stack. So once the manager's side of a reap is confirmed, a swarm of more than one node gets
//! a **node sweep**: a one-shot service in `global` mode with no restart (one attempt per ready,
//! active node per sweep), whose
//! container (an image with a docker CLI; [`NodeSweepSettings`]) talks to its own node's engine
//! through the bind-mounted node socket, force-removes the stacks' containers, then their
//! volumes, and exits 0 only when a fresh look finds nothing of them on that node.
//!
//! The stacks count as gone on every node only when
//! - every node of the swarm ran the job to `complete` (and every node the manager's task list
//!   showed a task of the stack on before its services were removed, should it have left the
//!   swarm since);
//! - and the manager's task list shows no task of the stacks in a non-terminal state anywhere.
//!
//! A node that cannot answer (down, drained, paused, cut off, or its task failing) is named,
//! with why, and the reap is incomplete: the app's `.env` and lock file stay, and the next sweep
//! makes a new job. A down or drained node may hold a copy of a volume as well as any other, and
//! a deploy may place a task there once it is back: it is never taken as clean. A node gone for
//! good is removed from the swarm (`docker node rm`) by its operator, and then no longer asked.
//! Once every node that can answer has, the sweep does not wait for the rest: a job never
//! reaches a node that was down or drained when it was made.
//!
//! The job is always removed, whatever happened, and its tasks and containers go with it (a
//! `global-job` service would leave both behind for good); a task that fails is not restarted,
//! and its exit code says why at once. A job whose creator died is removed by the next node
//! sweep once its own deadline (its label) has passed, and each job's task first removes the
//! exited containers of earlier jobs past theirs.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bollard::models::{Task, TaskState as ApiTaskState};
use bollard::query_parameters::{ListServicesOptions, ListTasksOptions};

use crate::config::NodeSweepSettings;
use crate::docker::node_job::{
    Cause, ForGood, JobTask, SWEEP_LABEL, job_spec, reason, rejected_for_good,
};
use crate::docker::seam::{DockerError, DockerSeam, STACK_LABEL};
use crate::docker::swarm::{Node, node};

/// Which of `stacks` (name, service ids) task `t` is of: its container carries the stack's
/// namespace label, or its service is one of the stack's.
pub(super) fn task_stack<'s>(t: &Task, stacks: &'s [(String, Vec<String>)]) -> Option<&'s str> {
    let label = t
        .spec
        .as_ref()
        .and_then(|s| s.container_spec.as_ref())
        .and_then(|c| c.labels.as_ref())
        .and_then(|l| l.get(STACK_LABEL));
    let service = t.service_id.as_deref().unwrap_or_default();
    stacks
        .iter()
        .find(|(stack, ids)| label == Some(stack) || ids.iter().any(|id| id == service))
        .map(|(stack, _)| stack.as_str())
}

/// How often a node sweep asks the manager how its job stands.
pub(super) const POLL: Duration = Duration::from_millis(200);

/// How long past its deadline an orphaned job (or its exited containers) is left alone.
const ORPHAN_GRACE: Duration = Duration::from_secs(60);

/// The swarm's nodes as a node sweep needs them.
#[derive(Debug, Clone, Default)]
pub(crate) struct Nodes {
    pub all: Vec<Node>,
}

impl Nodes {
    /// Whether there is a node besides the one the manager runs on: only then can a stack
    /// leave anything the manager's API does not show.
    pub(crate) fn several(&self) -> bool {
        self.all.len() > 1
    }

    fn name(&self, id: &str) -> String {
        self.all
            .iter()
            .find(|n| n.id == id)
            .map_or_else(|| format!("node {id}"), |n| n.hostname.clone())
    }

    fn get(&self, id: &str) -> Option<&Node> {
        self.all.iter().find(|n| n.id == id)
    }
}

/// Per stack, the nodes the manager's task list shows it on (tasks in any state).
pub(crate) type TaskNodes = BTreeMap<String, BTreeSet<String>>;

/// One stack's part of a node sweep: the nodes not confirmed clean, by name, each with why
/// (an empty name: the sweep could not start, and no node is confirmed).
pub(crate) type Unconfirmed = Vec<(String, String)>;

/// What a node sweep removed of one stack on one node, by the node's id and hostname.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub(crate) struct NodeRemoved {
    pub id: String,
    pub hostname: String,
    pub containers: Vec<String>,
    pub volumes: Vec<String>,
}

/// What a node sweep did for one stack: the nodes not confirmed clean, and what it removed on
/// each node.
pub(crate) type NodeSweep = (Unconfirmed, Vec<NodeRemoved>);

impl DockerSeam {
    /// The swarm's nodes; `None` when the engine is not a swarm manager (a plain engine has
    /// only itself; a worker was refused before).
    pub(crate) async fn swarm_nodes(&self) -> Result<Option<Nodes>, DockerError> {
        match self.docker.list_nodes(None).await {
            Ok(nodes) => Ok(Some(Nodes {
                all: nodes.into_iter().map(node).collect(),
            })),
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 503, ..
            }) => Ok(None),
            Err(err) => Err(DockerError(format!(
                "failed to list the swarm's nodes: {err}"
            ))),
        }
    }

    /// The nodes each of `stacks` has (or had) a task on, by the manager's task list: tasks
    /// whose container carries the stack's namespace label, or of a service in `services`.
    pub(crate) async fn stack_task_nodes(
        &self,
        stacks: &[(String, Vec<String>)],
    ) -> Result<(TaskNodes, BTreeMap<String, BTreeSet<String>>), DockerError> {
        let tasks = self.list_swarm_tasks().await?;
        let mut on: TaskNodes = BTreeMap::new();
        let mut live: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for t in &tasks {
            let Some(stack) = task_stack(t, stacks) else {
                continue;
            };
            let Some(node) = t.node_id.clone().filter(|n| !n.is_empty()) else {
                continue;
            };
            let state = t.status.as_ref().and_then(|s| s.state);
            let terminal = matches!(
                state,
                Some(
                    ApiTaskState::COMPLETE
                        | ApiTaskState::SHUTDOWN
                        | ApiTaskState::FAILED
                        | ApiTaskState::REJECTED
                        | ApiTaskState::REMOVE
                        | ApiTaskState::ORPHANED
                )
            );
            on.entry(stack.to_owned()).or_default().insert(node.clone());
            if !terminal {
                live.entry(stack.to_owned()).or_default().insert(node);
            }
        }
        Ok((on, live))
    }

    /// Every task the swarm keeps, in any state.
    pub(super) async fn list_swarm_tasks(&self) -> Result<Vec<Task>, DockerError> {
        self.docker
            .list_tasks(None::<ListTasksOptions>)
            .await
            .map_err(|e| DockerError(format!("failed to list the swarm's tasks: {e}")))
    }

    /// Clean `targets.stacks` (name, service ids) off every node with a global job, until `deadline`:
    /// per stack, in order, the nodes not confirmed clean (empty: gone everywhere). `had` is
    /// where the manager saw each stack's tasks before its services were removed. With
    /// `unrecorded`, nothing of the stacks is on record anywhere (no `.env`, nothing the
    /// manager lists, no reap left unfinished): a node that is down or not active and that no
    /// task of a stack was ever seen on need not answer (a deploy places nothing there).
    pub(crate) async fn sweep_nodes(
        &self,
        settings: &NodeSweepSettings,
        nodes: &Nodes,
        targets: SweepTargets<'_>,
        unrecorded: bool,
        deadline: tokio::time::Instant,
    ) -> Vec<NodeSweep> {
        let SweepTargets {
            stacks,
            volumes,
            had,
        } = targets;
        self.remove_orphaned_jobs().await;
        let fail_all = |why: String| vec![(vec![(String::new(), why)], Vec::new()); stacks.len()];
        let until =
            SystemTime::now() + deadline.saturating_duration_since(tokio::time::Instant::now());
        let until_secs = until.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let names: Vec<&str> = stacks.iter().map(|(s, _)| s.as_str()).collect();
        let spec = job_spec(settings, &names, volumes, until_secs);
        let created =
            tokio::time::timeout_at(deadline, self.docker.create_service(spec, None)).await;
        let job = match created {
            Ok(Ok(created)) => created.id.unwrap_or_default(),
            Ok(Err(err)) => {
                return fail_all(format!(
                    "failed to start the node sweep (image {}): {err}",
                    settings.image
                ));
            }
            Err(_) => {
                return fail_all("no time left to start the node sweep".to_owned());
            }
        };
        // Who must answer: every node of the swarm (a down or drained node may hold a copy of
        // a volume as well as any other), and every node a task of the stack was on.
        let all: BTreeSet<String> = nodes
            .all
            .iter()
            .filter(|n| !unrecorded || (n.ready && n.active))
            .map(|n| n.id.clone())
            .collect();
        let must: Vec<BTreeSet<String>> = stacks
            .iter()
            .map(|(stack, _)| {
                let mut must = all.clone();
                must.extend(had.get(stack).into_iter().flatten().cloned());
                must
            })
            .collect();
        let mut pending = must.clone();
        let mut why: BTreeMap<String, String> = BTreeMap::new();
        let mut current = nodes.clone();
        let mut last: HashMap<String, JobTask> = HashMap::new();
        loop {
            let round = self.job_round(&job, stacks, settings).await;
            let now = tokio::time::Instant::now();
            match round {
                Ok((tasks, live, seen_nodes)) => {
                    last.clone_from(&tasks);
                    if let Some(seen) = seen_nodes {
                        current = seen;
                    }
                    why.clear();
                    for (i, set) in pending.iter_mut().enumerate() {
                        set.clear();
                        for id in &must[i] {
                            let task = tasks.get(id);
                            let done =
                                task.is_some_and(|t| t.state == Some(ApiTaskState::COMPLETE));
                            let stack_live =
                                live.get(&stacks[i].0).is_some_and(|on| on.contains(id));
                            if done && !stack_live {
                                continue;
                            }
                            // Nothing of the stack on record: a node that went down or was
                            // drained since the sweep began, with no task of the stack ever
                            // seen there, need not answer either (a deploy places nothing
                            // there).
                            let out_now = current.get(id).is_none_or(|n| !n.ready || !n.active);
                            let had_here = had.get(&stacks[i].0).is_some_and(|on| on.contains(id));
                            if unrecorded && out_now && !had_here && !stack_live {
                                continue;
                            }
                            set.insert(id.clone());
                            why.entry(id.clone()).or_insert_with(|| {
                                reason(current.get(id), task, stack_live, settings)
                            });
                        }
                        // A live task of the stack on a node that need not answer keeps it
                        // pending too.
                        for id in live.get(&stacks[i].0).into_iter().flatten() {
                            if set.insert(id.clone()) {
                                why.entry(id.clone()).or_insert_with(|| {
                                    reason(current.get(id), tasks.get(id), true, settings)
                                });
                            }
                        }
                    }
                    if pending.iter().all(BTreeSet::is_empty) {
                        break;
                    }
                    // Nothing more can come from nodes that are down or not active: a job
                    // never reaches them, not even once they are back.
                    // Nor from a node whose task failed for a cause no retry mends: the
                    // reap is incomplete there, said at once, naming the setting.
                    let hopeless = pending.iter().flatten().all(|id| {
                        let cut_off = current.get(id).is_none_or(|n| !n.ready || !n.active)
                            && !tasks.contains_key(id);
                        let ended = tasks.get(id).is_some_and(|t| {
                            t.for_good.is_some()
                                || matches!(
                                    t.state,
                                    Some(ApiTaskState::FAILED | ApiTaskState::REJECTED)
                                )
                        });
                        cut_off || ended
                    });
                    if hopeless {
                        break;
                    }
                }
                Err(err) => {
                    for set in &pending {
                        for id in set {
                            why.insert(id.clone(), err.0.clone());
                        }
                    }
                }
            }
            if now >= deadline {
                break;
            }
            tokio::time::sleep_until((now + POLL).min(deadline)).await;
        }
        // What each node's task says it removed, before the job (and its tasks' logs) goes.
        let mut removed: Vec<Vec<NodeRemoved>> = vec![Vec::new(); stacks.len()];
        let mut by_node: Vec<(&String, &JobTask)> = last.iter().collect();
        by_node.sort_by(|a, b| a.0.cmp(b.0));
        for (node, task) in by_node {
            let Some(text) = self.task_output(&task.id, deadline).await else {
                continue;
            };
            for (i, (stack, _)) in stacks.iter().enumerate() {
                let mut here = NodeRemoved {
                    id: node.clone(),
                    hostname: current
                        .get(node)
                        .map(|n| n.hostname.clone())
                        .unwrap_or_default(),
                    ..NodeRemoved::default()
                };
                for line in text.lines() {
                    let mut words = line.split_whitespace();
                    let (Some("removed"), Some(s), Some(kind), Some(name), None) = (
                        words.next(),
                        words.next(),
                        words.next(),
                        words.next(),
                        words.next(),
                    ) else {
                        continue;
                    };
                    if s != stack {
                        continue;
                    }
                    match kind {
                        "container" => here.containers.push(name.to_owned()),
                        "volume" => here.volumes.push(name.to_owned()),
                        _ => {}
                    }
                }
                if !here.containers.is_empty() || !here.volumes.is_empty() {
                    removed[i].push(here);
                }
            }
        }
        self.remove_job(&job).await;
        pending
            .iter()
            .zip(removed)
            .map(|(set, removed)| {
                let unconfirmed = set
                    .iter()
                    .map(|id| {
                        let why = why.get(id).map_or("no answer", String::as_str);
                        (current.name(id), why.to_owned())
                    })
                    .collect();
                (unconfirmed, removed)
            })
            .collect()
    }

    /// What a task of the job printed, read through the manager, within a couple of seconds
    /// (never past `deadline`); `None` when it cannot be read.
    async fn task_output(&self, task: &str, deadline: tokio::time::Instant) -> Option<String> {
        use futures_util::StreamExt;
        if task.is_empty() {
            return None;
        }
        let options = bollard::query_parameters::LogsOptions {
            stdout: true,
            ..Default::default()
        };
        let read = async {
            let mut out = String::new();
            let mut logs = self.docker.task_logs(task, Some(options));
            while let Some(chunk) = logs.next().await {
                out.push_str(&chunk.ok()?.to_string());
            }
            Some(out)
        };
        let until = deadline.min(tokio::time::Instant::now() + Duration::from_secs(2));
        tokio::time::timeout_at(until, read).await.ok().flatten()
    }

    /// One look at the job: its tasks by node (the newest of each), the stacks' live tasks
    /// by node, and the nodes.
    async fn job_round(
        &self,
        job: &str,
        stacks: &[(String, Vec<String>)],
        settings: &NodeSweepSettings,
    ) -> Result<
        (
            HashMap<String, JobTask>,
            BTreeMap<String, BTreeSet<String>>,
            Option<Nodes>,
        ),
        DockerError,
    > {
        let filters = HashMap::from([("service".to_owned(), vec![job.to_owned()])]);
        let (tasks, live, nodes) = tokio::join!(
            self.docker.list_tasks(Some(ListTasksOptions {
                filters: Some(filters)
            })),
            self.stack_task_nodes(stacks),
            self.swarm_nodes(),
        );
        let tasks = tasks
            .map_err(|e| DockerError(format!("failed to list the node sweep's tasks: {e}")))?;
        let (_, live) = live?;
        let mut by_node: HashMap<String, JobTask> = HashMap::new();
        for t in tasks {
            let Some(node) = t.node_id.filter(|n| !n.is_empty()) else {
                continue;
            };
            let status = t.status.unwrap_or_default();
            let at = status
                .timestamp
                .as_deref()
                .and_then(|t| humantime::parse_rfc3339(t).ok());
            let err = status.err.unwrap_or_default();
            let exit = status.container_status.and_then(|c| c.exit_code);
            let for_good = match status.state {
                Some(ApiTaskState::FAILED) => exit
                    .and_then(Cause::of_exit)
                    .filter(|c| c.permanent())
                    .map(ForGood::Exit),
                Some(ApiTaskState::REJECTED) => {
                    rejected_for_good(&err, settings).map(ForGood::Rejected)
                }
                _ => None,
            };
            let task = JobTask {
                id: t.id.unwrap_or_default(),
                state: status.state,
                at,
                err,
                for_good: None,
            };
            let old = by_node.get(&node);
            let seen_for_good = old.and_then(|o| o.for_good.clone()).or(for_good);
            let newer = old.is_none_or(|old| {
                task.state == Some(ApiTaskState::COMPLETE)
                    || (old.state != Some(ApiTaskState::COMPLETE) && task.at >= old.at)
            });
            let mut kept = if newer {
                task
            } else {
                old.cloned().unwrap_or(task)
            };
            kept.for_good = seen_for_good;
            by_node.insert(node, kept);
        }
        Ok((by_node, live, nodes.ok().flatten()))
    }

    /// Remove the job, retrying a failed request a few times until it is gone.
    async fn remove_job(&self, job: &str) {
        for attempt in 0..5 {
            match self.docker.delete_service(job).await {
                Ok(()) => return,
                Err(err)
                    if crate::docker::seam::classify(&err)
                        == crate::docker::seam::Failure::Gone =>
                {
                    return;
                }
                Err(err) => {
                    tracing::warn!(job, attempt, "failed to remove the node sweep job: {err}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    /// Remove node sweep jobs whose deadline passed a while ago: their creators died.
    async fn remove_orphaned_jobs(&self) {
        let filters = HashMap::from([("label".to_owned(), vec![SWEEP_LABEL.to_owned()])]);
        let Ok(services) = self
            .docker
            .list_services(Some(ListServicesOptions {
                filters: Some(filters),
                status: None,
            }))
            .await
        else {
            return;
        };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        for s in services {
            let until = s
                .spec
                .as_ref()
                .and_then(|spec| spec.labels.as_ref())
                .and_then(|l| l.get(SWEEP_LABEL))
                .and_then(|v| v.parse::<u64>().ok());
            let (Some(id), Some(until)) = (s.id, until) else {
                continue;
            };
            if until.saturating_add(ORPHAN_GRACE.as_secs()) < now {
                tracing::info!(job = %id, "removing a node sweep job its creator left");
                self.remove_job(&id).await;
            }
        }
    }
}

/// What a node sweep removes: the stacks (name, service ids), the volumes their apps give by
/// exact name, and where the manager saw each stack's tasks before its services went.
pub(crate) struct SweepTargets<'a> {
    pub(crate) stacks: &'a [(String, Vec<String>)],
    pub(crate) volumes: &'a [String],
    pub(crate) had: &'a TaskNodes,
}

#[cfg(test)]
mod tests;
