//! The job a node sweep runs on every node of a swarm: its script, its spec, how one node's
//! task stands and what its exit code says, and why a node is not confirmed clean yet.
//!
//! Floor: backends (docs/architecture.md): imports the floors below and the other backends, never a
//! command.

use std::collections::HashMap;
use std::time::SystemTime;

use bollard::models::{
    Mount, MountType, ServiceSpec, ServiceSpecMode, TaskSpec, TaskSpecContainerSpec,
    TaskSpecRestartPolicy, TaskSpecRestartPolicyConditionEnum, TaskState as ApiTaskState,
};

use crate::config::NodeSweepSettings;
use crate::docker::swarm::Node;

/// The label of a node sweep's service and containers; its value is the job's deadline, in
/// seconds since the epoch: past it, the job is nobody's and may be removed.
pub(crate) const SWEEP_LABEL: &str = "io.ccci-run.node-sweep";

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
pub(super) const SCRIPT: &str = r#"
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
pub(super) enum Cause {
    NoCli,
    NoEngine,
    Denied,
    OtherNode,
    Listing,
    StillThere,
}

impl Cause {
    pub(super) fn of_exit(code: i64) -> Option<Self> {
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
    pub(super) fn permanent(self) -> bool {
        matches!(
            self,
            Self::NoCli | Self::NoEngine | Self::Denied | Self::OtherNode
        )
    }

    pub(super) fn describe(self, settings: &NodeSweepSettings) -> String {
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
pub(super) fn rejected_for_good(err: &str, settings: &NodeSweepSettings) -> Option<String> {
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
/// How one node's task of the job stands.
#[derive(Debug, Clone, Default)]
pub(super) struct JobTask {
    pub(super) id: String,
    pub(super) state: Option<ApiTaskState>,
    pub(super) at: Option<SystemTime>,
    pub(super) err: String,
    /// Why this node's tasks of the job failed, when no retry mends it (any task of the job
    /// there, not only the newest).
    pub(super) for_good: Option<ForGood>,
}

/// A failure of a node's sweep task that no retry mends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ForGood {
    Exit(Cause),
    /// Rejected by its engine; the text names the setting.
    Rejected(String),
}

impl ForGood {
    pub(super) fn describe(&self, settings: &NodeSweepSettings) -> String {
        match self {
            Self::Exit(cause) => cause.describe(settings),
            Self::Rejected(why) => why.clone(),
        }
    }
}
/// Why a node is not confirmed clean yet.
pub(super) fn reason(
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
pub(super) fn job_spec(
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
