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

use bollard::models::{
    Mount, MountType, ServiceSpec, ServiceSpecMode, TaskSpec, TaskSpecContainerSpec,
    TaskSpecRestartPolicy, TaskSpecRestartPolicyConditionEnum, TaskState as ApiTaskState,
};
use bollard::query_parameters::{ListServicesOptions, ListTasksOptions};

use crate::config::NodeSweepSettings;
use crate::docker::seam::{DockerError, DockerSeam, STACK_LABEL};
use crate::docker::swarm::{Node, node};

/// The label of a node sweep's service and containers; its value is the job's deadline, in
/// seconds since the epoch: past it, the job is nobody's and may be removed.
pub(crate) const SWEEP_LABEL: &str = "io.ccci-run.node-sweep";

/// How often a node sweep asks the manager how its job stands.
const POLL: Duration = Duration::from_millis(200);

/// How long past its deadline an orphaned job (or its exited containers) is left alone.
const ORPHAN_GRACE: Duration = Duration::from_secs(60);

/// The job's task: prove it reached its own node's engine, remove the stacks' containers and
/// volumes on this node, look again, and succeed only when every listing succeeded and found
/// nothing of them. Plain `sh` and the docker CLI only (the image may be a bare busybox with a
/// docker CLI). A volume is the stack's when its namespace label names the stack, or when it
/// has no such label, its name is exactly one its app gives (`CCCI_VOLUMES`, from the names its
/// runs recorded), and no longer stack the node knows by its labels (`<stack>_example_org`)
/// begins that name. Any other unlabelled `<stack>_…` volume is left alone.
///
/// It fails closed, with an exit code that says why (see [`Cause`]): no docker CLI (3), an
/// engine that does not answer at the socket (4), a socket its user may not open (5), the
/// engine of another node (6: its node id is not the task's, `CCCI_NODE`), a listing that
/// failed (7), something still there after its tries (1).
const SCRIPT: &str = r#"
set -u
fail() { code=$1; shift; echo "node sweep: $*" >&2; exit "$code"; }
command -v docker >/dev/null 2>&1 || fail 3 "no docker CLI in this image"
me=$(docker info --format '{{.Swarm.NodeID}}' 2>&1) || case "$me" in
  *[Pp]ermission\ denied*) fail 5 "the node socket may not be opened: $me" ;;
  *) fail 4 "no engine answers at the node socket: $me" ;;
esac
[ -n "$me" ] && [ "$me" = "$CCCI_NODE" ] ||
  fail 6 "the node socket reaches node '$me''s engine, not this node's ($CCCI_NODE)"
now=$(date +%s)
old=$(docker ps -a --filter "label=$SWEEP_LABEL" --filter status=exited \
  --format "{{.ID}} {{.Label \"$SWEEP_LABEL\"}}") || fail 7 "listing containers failed"
printf '%s\n' "$old" | while read -r id until; do
  case "$until" in ''|*[!0-9]*) continue ;; esac
  [ "$until" -lt "$now" ] && docker rm "$id" >/dev/null 2>&1
done
volumes_of() {
  all=$(docker volume ls --format "{{.Name}} {{.Label \"com.docker.stack.namespace\"}}") ||
    return 1
  # Stacks this node knows by their labels: an unlabelled name a longer one extends is its.
  known=$(printf '%s\n' "$all" | while read -r name label; do echo "$label"; done; \
    docker ps -a --format "{{.Label \"com.docker.stack.namespace\"}}") || return 1
  printf '%s\n' "$all" | while read -r name label; do
    if [ "$label" = "$1" ]; then echo "$name"; fi
    if [ -z "$label" ]; then
      case "$name" in "$1"_*) ;; *) continue ;; esac
      given=
      for v in ${CCCI_VOLUMES:-}; do [ "$v" = "$name" ] && given=1; done
      [ -n "$given" ] || continue
      theirs=
      for o in $known; do
        case "$o" in "$1"_*) case "$name" in "$o"_*) theirs=1 ;; esac ;; esac
      done
      [ -n "$theirs" ] || echo "$name"
    fi
  done
}
try=0
while :; do
  for s in $CCCI_STACKS; do
    ids=$(docker ps -a --filter "label=com.docker.stack.namespace=$s" --format '{{.Names}}') ||
      fail 7 "listing containers failed"
    for c in $ids; do
      docker rm -f -v "$c" >/dev/null 2>&1 && echo "removed $s container $c"
    done
    vols=$(volumes_of "$s") || fail 7 "listing volumes failed"
    for v in $vols; do
      docker volume rm "$v" >/dev/null 2>&1 && echo "removed $s volume $v"
    done
  done
  left=
  for s in $CCCI_STACKS; do
    ids=$(docker ps -aq --filter "label=com.docker.stack.namespace=$s") ||
      fail 7 "listing containers failed"
    vols=$(volumes_of "$s") || fail 7 "listing volumes failed"
    l=$(echo $ids $vols)
    [ -z "$l" ] || left="$left $s: $l;"
  done
  if [ -z "$left" ]; then echo "clean"; exit 0; fi
  try=$((try + 1))
  if [ "$try" -ge 40 ]; then fail 1 "still there:$left"; fi
  sleep 0.25
done
"#;

/// Why a node's sweep task failed, by its exit code: the causes that no retry mends name the
/// setting to fix, and end the wait for that node at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    NoCli,
    NoEngine,
    Denied,
    OtherNode,
    Listing,
    StillThere,
}

impl Cause {
    fn of_exit(code: i64) -> Option<Self> {
        Some(match code {
            3 | 127 => Self::NoCli,
            4 => Self::NoEngine,
            5 => Self::Denied,
            6 => Self::OtherNode,
            7 => Self::Listing,
            1 => Self::StillThere,
            _ => return None,
        })
    }

    /// No retry mends it: the settings do.
    fn permanent(self) -> bool {
        matches!(
            self,
            Self::NoCli | Self::NoEngine | Self::Denied | Self::OtherNode
        )
    }

    fn describe(self, settings: &NodeSweepSettings) -> String {
        let socket = settings.socket.display();
        let image = &settings.image;
        match self {
            Self::NoCli => {
                format!("the node sweep image {image} has no docker CLI there (node_sweep_image)")
            }
            Self::NoEngine => format!(
                "no engine answers at {socket} there, so its containers and volumes cannot be \
                 looked at (node_docker_socket)"
            ),
            Self::Denied => format!(
                "the node sweep image {image}'s user may not open {socket} there \
                 (node_sweep_image, node_docker_socket)"
            ),
            Self::OtherNode => format!(
                "{socket} there reaches another node's engine, not that node's own \
                 (node_docker_socket)"
            ),
            Self::Listing => "a listing of its containers or volumes failed there".to_owned(),
            Self::StillThere => {
                "something of the stack was still there after the sweep's tries".to_owned()
            }
        }
    }
}

/// A rejected task that no retry mends (its bind source or its image missing there), with the
/// setting to fix.
fn rejected_for_good(err: &str, settings: &NodeSweepSettings) -> Option<String> {
    if err.contains("bind source path does not exist") {
        return Some(format!(
            "{} does not exist there (node_docker_socket): {err}",
            settings.socket.display()
        ));
    }
    if err.contains("No such image") || err.contains("pull access denied") {
        return Some(format!(
            "the node sweep image {} is not there (node_sweep_image): {err}",
            settings.image
        ));
    }
    None
}

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

/// How one node's task of the job stands.
#[derive(Debug, Clone, Default)]
struct JobTask {
    id: String,
    state: Option<ApiTaskState>,
    at: Option<SystemTime>,
    err: String,
    /// Why this node's tasks of the job failed, when no retry mends it (any task of the job
    /// there, not only the newest).
    for_good: Option<ForGood>,
}

/// A failure of a node's sweep task that no retry mends.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ForGood {
    Exit(Cause),
    /// Rejected by its engine; the text names the setting.
    Rejected(String),
}

impl ForGood {
    fn describe(&self, settings: &NodeSweepSettings) -> String {
        match self {
            Self::Exit(cause) => cause.describe(settings),
            Self::Rejected(why) => why.clone(),
        }
    }
}

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
        let tasks = self
            .docker
            .list_tasks(None::<ListTasksOptions>)
            .await
            .map_err(|e| DockerError(format!("failed to list the swarm's tasks: {e}")))?;
        let mut on: TaskNodes = BTreeMap::new();
        let mut live: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for t in tasks {
            let label = t
                .spec
                .as_ref()
                .and_then(|s| s.container_spec.as_ref())
                .and_then(|c| c.labels.as_ref())
                .and_then(|l| l.get(STACK_LABEL))
                .cloned();
            let service = t.service_id.clone().unwrap_or_default();
            let Some((stack, _)) = stacks
                .iter()
                .find(|(stack, ids)| label.as_deref() == Some(stack) || ids.contains(&service))
            else {
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
            on.entry(stack.clone()).or_default().insert(node.clone());
            if !terminal {
                live.entry(stack.clone()).or_default().insert(node);
            }
        }
        Ok((on, live))
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

impl DockerSeam {
    /// The nodes of the swarm that are down or not active (drained, paused) right now, each as
    /// `hostname (id): state`; empty when every node is ready and active, or the swarm could
    /// not be asked.
    pub(crate) fn nodes_out(&self) -> Vec<String> {
        let nodes = self.runtime.block_on(self.swarm_nodes());
        nodes
            .ok()
            .flatten()
            .unwrap_or_default()
            .all
            .iter()
            .filter(|n| !n.ready || !n.active)
            .map(|n| {
                let state = match (n.ready, n.active) {
                    (false, _) => "down",
                    _ => "drained or paused",
                };
                format!("{} ({}): {state}", n.hostname, n.id)
            })
            .collect()
    }

    /// Wait until every node of the swarm is ready and active again, or `deadline`: whether
    /// they are.
    pub(crate) fn wait_nodes_back(&self, deadline: std::time::Instant) -> bool {
        loop {
            if self.nodes_out().is_empty() {
                return true;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return false;
            }
            std::thread::sleep(POLL.min(deadline - now));
        }
    }
}

/// Why a node is not confirmed clean yet.
fn reason(
    node: Option<&Node>,
    task: Option<&JobTask>,
    stack_live: bool,
    settings: &NodeSweepSettings,
) -> String {
    let node_state = match node {
        None => return "no longer a node of the swarm".to_owned(),
        Some(n) if !n.ready => Some(
            "the node is down (its containers and volumes cannot be checked until it is back; \
             remove it from the swarm with `docker node rm` if it is gone for good)",
        ),
        Some(n) if !n.active => Some(
            "the node is drained or paused (no job runs there; make it active again, or remove \
             it from the swarm)",
        ),
        Some(_) => None,
    };
    let job = match task {
        None => "no task of the node sweep reached it".to_owned(),
        Some(JobTask {
            for_good: Some(why),
            ..
        }) => why.describe(settings),
        Some(t) => {
            let state = t
                .state
                .map_or_else(|| "unknown".to_owned(), |s| s.to_string());
            if t.err.is_empty() {
                format!("its node sweep task is {state}")
            } else {
                format!("its node sweep task is {state}: {}", t.err)
            }
        }
    };
    let mut why = Vec::new();
    why.extend(node_state.map(str::to_owned));
    if stack_live {
        why.push("the manager still lists a task of the stack there as not stopped".to_owned());
    }
    if node_state.is_none() || task.is_some() {
        why.push(job);
    }
    why.join("; ")
}

/// The global job that cleans `stacks` on every node.
fn job_spec(
    settings: &NodeSweepSettings,
    stacks: &[&str],
    volumes: &[String],
    until: u64,
) -> ServiceSpec {
    let suffix: u32 = rand::random();
    let label = HashMap::from([(SWEEP_LABEL.to_owned(), until.to_string())]);
    ServiceSpec {
        name: Some(format!("ccci-run-node-sweep-{suffix:08x}")),
        labels: Some(label.clone()),
        // A global service, not a global job: swarm keeps a job's tasks in the manager's list
        // (and their containers on every node) for good once the job is removed, a service's
        // it removes with it.
        mode: Some(ServiceSpecMode {
            global: Some(Default::default()),
            ..Default::default()
        }),
        task_template: Some(TaskSpec {
            container_spec: Some(TaskSpecContainerSpec {
                image: Some(settings.image.clone()),
                labels: Some(label),
                command: Some(vec!["sh".to_owned(), "-c".to_owned(), SCRIPT.to_owned()]),
                env: Some(vec![
                    format!("CCCI_STACKS={}", stacks.join(" ")),
                    // The volume names the stacks' apps give: what carries no stack label
                    // is taken only by one of these, exactly.
                    format!("CCCI_VOLUMES={}", volumes.join(" ")),
                    // The task's own node, by swarm's template: the engine the socket reaches
                    // must be that node's.
                    "CCCI_NODE={{.Node.ID}}".to_owned(),
                    format!("SWEEP_LABEL={SWEEP_LABEL}"),
                    "DOCKER_HOST=unix:///var/run/docker.sock".to_owned(),
                ]),
                mounts: Some(vec![Mount {
                    target: Some("/var/run/docker.sock".to_owned()),
                    source: Some(settings.socket.display().to_string()),
                    typ: Some(MountType::BIND),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            // One attempt per node per sweep: a failed task stays failed, with its exit code
            // (the cause), and the next sweep makes a new service.
            restart_policy: Some(TaskSpecRestartPolicy {
                condition: Some(TaskSpecRestartPolicyConditionEnum::NONE),
                max_attempts: Some(1),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// What a node sweep with no stack found: every node, as `name (role, state, availability)`,
/// and those that did not complete it, each with why.
#[derive(Debug, Clone)]
pub(crate) struct Probe {
    pub nodes: Vec<String>,
    pub unconfirmed: Vec<String>,
    pub image: String,
    pub socket: String,
}

impl DockerSeam {
    /// Run a node sweep that removes nothing on a swarm of several nodes, within `within`:
    /// whether each node can be swept at all (the image there, its socket answering).
    pub(crate) fn probe_nodes(&self, within: Duration) -> Result<Probe, DockerError> {
        self.runtime.block_on(async {
            let deadline = tokio::time::Instant::now() + within;
            let nodes = self.swarm_nodes().await?.unwrap_or_default();
            let mut probe = Probe {
                nodes: nodes
                    .all
                    .iter()
                    .map(|n| {
                        format!(
                            "{} ({}, {}, {})",
                            n.hostname,
                            n.role,
                            if n.ready { "ready" } else { "down" },
                            if n.active { "active" } else { "not active" }
                        )
                    })
                    .collect(),
                unconfirmed: Vec::new(),
                image: self.node_sweep.image.clone(),
                socket: self.node_sweep.socket.display().to_string(),
            };
            if nodes.several() {
                let nothing = [(String::new(), Vec::new())];
                probe.unconfirmed = self
                    .sweep_nodes(
                        &self.node_sweep,
                        &nodes,
                        SweepTargets {
                            stacks: &nothing,
                            volumes: &[],
                            had: &TaskNodes::new(),
                        },
                        false,
                        deadline,
                    )
                    .await
                    .pop()
                    .unwrap_or_default()
                    .0
                    .into_iter()
                    .map(|(node, why)| match node.as_str() {
                        "" => why,
                        node => format!("{node}: {why}"),
                    })
                    .collect();
            }
            Ok(probe)
        })
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
mod tests {
    use super::*;

    #[test]
    fn the_sweep_runs_once_on_every_node_with_the_node_socket_and_no_stack_label() {
        let settings = NodeSweepSettings {
            image: "docker:27-cli".to_owned(),
            socket: "/run/docker.sock".into(),
        };
        let spec = job_spec(
            &settings,
            &["ab-000000_x_test", "cd-000000_x_test"],
            &["ab-000000_x_test_db".to_owned()],
            1_700_000_000,
        );
        assert!(
            spec.name
                .as_deref()
                .unwrap()
                .starts_with("ccci-run-node-sweep-")
        );
        let mode = spec.mode.unwrap();
        assert!(mode.global.is_some() && mode.replicated.is_none() && mode.global_job.is_none());
        let policy = spec
            .task_template
            .as_ref()
            .unwrap()
            .restart_policy
            .clone()
            .unwrap();
        assert_eq!(
            policy.condition,
            Some(TaskSpecRestartPolicyConditionEnum::NONE)
        );
        let labels = spec.labels.unwrap();
        assert_eq!(
            labels.get(SWEEP_LABEL).map(String::as_str),
            Some("1700000000")
        );
        assert!(!labels.contains_key(STACK_LABEL));
        let container = spec.task_template.unwrap().container_spec.unwrap();
        assert!(!container.labels.unwrap().contains_key(STACK_LABEL));
        assert_eq!(container.image.as_deref(), Some("docker:27-cli"));
        let env = container.env.unwrap();
        assert!(env.contains(&"CCCI_STACKS=ab-000000_x_test cd-000000_x_test".to_owned()));
        assert!(env.contains(&"CCCI_VOLUMES=ab-000000_x_test_db".to_owned()));
        let mount = &container.mounts.unwrap()[0];
        assert_eq!(mount.source.as_deref(), Some("/run/docker.sock"));
        assert_eq!(mount.target.as_deref(), Some("/var/run/docker.sock"));
        assert_eq!(mount.typ, Some(MountType::BIND));
    }

    fn node(ready: bool, active: bool) -> Node {
        Node {
            id: "n2".to_owned(),
            hostname: "worker-2".to_owned(),
            ready,
            active,
            ..Node::default()
        }
    }

    #[test]
    fn a_node_not_confirmed_says_why() {
        let assigned = JobTask {
            state: Some(ApiTaskState::ASSIGNED),
            ..JobTask::default()
        };
        let rejected = JobTask {
            state: Some(ApiTaskState::REJECTED),
            err: "No such image: x".to_owned(),
            ..JobTask::default()
        };
        let s = &NodeSweepSettings::default();
        assert_eq!(
            reason(None, None, false, s),
            "no longer a node of the swarm"
        );
        assert!(reason(Some(&node(false, true)), None, false, s).starts_with("the node is down"));
        assert!(
            reason(Some(&node(true, false)), None, false, s).starts_with("the node is drained")
        );
        assert_eq!(
            reason(Some(&node(true, true)), Some(&assigned), true, s),
            "the manager still lists a task of the stack there as not stopped; its node sweep \
             task is assigned"
        );
        assert_eq!(
            reason(Some(&node(true, true)), Some(&rejected), false, s),
            "its node sweep task is rejected: No such image: x"
        );
        let denied = JobTask {
            state: Some(ApiTaskState::FAILED),
            for_good: Some(ForGood::Exit(Cause::Denied)),
            ..JobTask::default()
        };
        let why = reason(Some(&node(true, true)), Some(&denied), false, s);
        assert!(
            why.contains("may not open") && why.contains("node_docker_socket"),
            "{why}"
        );
    }

    /// The script against a stand-in `docker` on its PATH: each way of not reaching its own
    /// node's engine, or of a listing failing, is its own exit code, never "clean".
    #[rstest::rstest]
    #[case::no_cli(None, 3)]
    #[case::no_engine(Some("echo 'Cannot connect to the Docker daemon' >&2; exit 1"), 4)]
    #[case::denied(
        Some("echo 'permission denied while trying to connect' >&2; exit 1"),
        5
    )]
    #[case::other_node(Some("echo n1"), 6)]
    #[case::not_a_swarm(Some("echo"), 6)]
    #[case::listing_fails(Some("[ \"$1\" = info ] && { echo n2; exit 0; }; exit 1"), 7)]
    #[case::clean(Some("[ \"$1\" = info ] && echo n2; exit 0"), 0)]
    #[case::a_longer_stack_s_unlabelled_volume_is_not_the_stack_s(
        Some(
            "case \"$1 $2\" in info*) echo n2 ;; 'volume ls') printf '%s\\n' \
             'ab-000000_x_test_example_org_data ' 'x ab-000000_x_test_example_org' ;; esac"
        ),
        0
    )]
    fn the_script_fails_closed(#[case] docker: Option<&str>, #[case] code: i32) {
        let (out, _) = run_script(docker);
        assert_eq!(
            out.status.code(),
            Some(code),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// An unlabelled volume is taken only by a name the app gives, exactly: the stack's given
    /// `…_data` goes, `…_other` (no name it gives) and the longer stack's stay.
    #[test]
    fn the_script_takes_an_unlabelled_volume_only_by_a_given_name() {
        let docker = "case \"$1 $2\" in info*) echo n2 ;; \
             'volume ls') [ -f \"${0%/docker}/removed\" ] || echo 'ab-000000_x_test_data '; \
               printf '%s\\n' 'ab-000000_x_test_other ' 'ab-000000_x_test_example_org_data ' ;; \
             'volume rm') echo \"$*\" >> \"${0%/docker}/removed\" ;; esac";
        let (out, bin) = run_script(Some(docker));
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let removed = crate::files::read_text(
            &bin.path().join("removed"),
            &crate::files::Rules::small(1 << 10),
        )
        .unwrap();
        assert_eq!(removed, "volume rm ab-000000_x_test_data\n");
    }

    /// The node sweep's script with a stand-in `docker` whose body is `docker` (none: no CLI).
    fn run_script(docker: Option<&str>) -> (std::process::Output, tempfile::TempDir) {
        use std::os::unix::fs::PermissionsExt;
        let bin = tempfile::tempdir().unwrap();
        for tool in ["sh", "date", "sleep"] {
            let found = ["/bin", "/usr/bin"]
                .iter()
                .map(|d| std::path::Path::new(d).join(tool))
                .find(|p| p.exists())
                .unwrap();
            std::os::unix::fs::symlink(found, bin.path().join(tool)).unwrap();
        }
        if let Some(body) = docker {
            let path = bin.path().join("docker");
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let out = std::process::Command::new(bin.path().join("sh"))
            .args(["-c", SCRIPT])
            .env_clear()
            .env("PATH", bin.path())
            .env("CCCI_STACKS", "ab-000000_x_test")
            .env("CCCI_VOLUMES", "ab-000000_x_test_data")
            .env("CCCI_NODE", "n2")
            .env("SWEEP_LABEL", SWEEP_LABEL)
            .output()
            .unwrap();
        (out, bin)
    }
}
