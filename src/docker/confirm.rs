//! Confirmation: a reap is over only when the engine is asked after the deletes and lists
//! nothing of the stack (and, on a swarm of several nodes, when every node has swept it:
//! [`super::nodes`]). One list call per kind per round for all the stacks, full-jitter backoff
//! between rounds, whatever is still listed deleted again; past the budget, what is left is
//! reported, never assumed gone.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use bollard::Docker;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;

use super::remove::{blocked_networks, delete_all, describe};
use crate::docker::backoff::{Backoff, MonotonicClock, Policy};
use crate::docker::nodes;
use crate::docker::remove::RemovedNames;
use crate::docker::seam::PROGRESS_EVERY;
use crate::docker::seam::{DockerError, DockerSeam, GivenBy, SETTLE, StackResources};
use crate::names::{AppDomain, RunAppPattern};

impl DockerSeam {
    /// Reap `stacks` and confirm it: delete everything each stack has, then poll — one list
    /// call per kind per round for all the stacks, full-jitter backoff between rounds — until
    /// the engine lists nothing of a stack any more, deleting again whatever is still listed.
    /// Past `budget` (or when all that is left is blocked by another stack) what is still
    /// there is reported. On a swarm of several nodes, the stacks the manager no longer lists
    /// are then swept off every node ([`nodes`]) within the same budget; a stack counts as
    /// gone only when every node that must answer did. A stack with nothing listed is still
    /// swept off the other nodes. The results come back in the order of `stacks`. With
    /// `unrecorded` (nothing of the stacks on record: see [`Self::sweep_nodes`]), a node that
    /// is down or drained and never ran a task of them need not answer.
    pub(crate) fn reap(
        &self,
        pattern: &RunAppPattern,
        given: GivenBy<'_>,
        stacks: Vec<(AppDomain, StackResources)>,
        budget: Duration,
        unrecorded: bool,
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
            let stacks_domains: Vec<AppDomain> = stacks.iter().map(|(d, _)| d.clone()).collect();
            let named = named_stacks(&stacks);
            // Where the stacks' tasks are, before their services go (and the tasks with them).
            let had = match &nodes {
                Some(_) => match self.stack_task_nodes(&named).await {
                    Ok((had, _)) => Some(had),
                    Err(err) => return failed(err),
                },
                None => None,
            };
            let mut out = if stacks.iter().any(|(_, s)| !s.is_empty()) {
                self.reap_until(pattern, given, stacks, deadline).await
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
            // What carries no stack label on a node is a stack's only by a volume name its
            // app gives exactly.
            let volumes: Vec<String> = ready
                .iter()
                .filter_map(|&i| given(&stacks_domains[i]))
                .flat_map(|g| g.exact_volumes().map(str::to_owned).collect::<Vec<_>>())
                .collect();
            let started = std::time::Instant::now();
            let unconfirmed = self
                .sweep_nodes(
                    &self.node_sweep,
                    &nodes,
                    super::nodes::SweepTargets {
                        stacks: &swept,
                        volumes: &volumes,
                        had: &had,
                    },
                    unrecorded,
                    deadline,
                )
                .await;
            tracing::debug!(stacks = swept.len(), elapsed = ?started.elapsed(), "reap: node sweep done");
            for (i, (nodes, removed)) in ready.into_iter().zip(unconfirmed) {
                out[i].removed.nodes = removed;
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

    /// Whether the swarm keeps a removed service's task until its node reported it stopped
    /// (desired state `remove`, since API 1.35), so that no task left is proof.
    fn tasks_outlive_their_service(&self) -> bool {
        let v = self.docker.client_version();
        (v.major_version, v.minor_version) >= (1, 35)
    }

    /// How many poll rounds reaps of this seam have made.
    pub(crate) fn poll_rounds(&self) -> usize {
        self.poll_rounds.get()
    }

    pub(super) async fn reap_until(
        &self,
        pattern: &RunAppPattern,
        given: GivenBy<'_>,
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
        let named = named_stacks(&stacks);
        loop {
            self.poll_rounds.set(self.poll_rounds.get() + 1);
            // The swarm's tasks are asked before the resources: a stack with no task left
            // by then has none that can still start and bring something back (swarm deletes a
            // removed service's task only once its node reported it stopped, or before it was
            // ever assigned), so nothing listed after that is gone for good. A task list that
            // cannot be had proves nothing: the settle window decides then. Engines before API
            // 1.35 (Docker 17.12) deleted a removed service's tasks at once: no proof there.
            let tasks = if self.tasks_outlive_their_service() && confirming.needs_task_proof() {
                self.list_swarm_tasks().await.ok().map(|tasks| {
                    tasks
                        .iter()
                        .filter_map(|t| nodes::task_stack(t, &named))
                        .map(str::to_owned)
                        .collect::<BTreeSet<String>>()
                })
            } else {
                None
            };
            let listing = match self.list(pattern, given).await {
                Ok(listing) => listing,
                Err(err) => {
                    confirming.fail_pending(&err);
                    break;
                }
            };
            let now = tokio::time::Instant::now();
            let round = confirming.judge(&listing, tasks.as_ref(), now, deadline);
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

/// Each stack's name and its services' ids: what its tasks are known by.
fn named_stacks(stacks: &[(AppDomain, StackResources)]) -> Vec<(String, Vec<String>)> {
    stacks
        .iter()
        .map(|(domain, stack)| {
            let ids = stack.services.iter().map(|s| s.id.clone()).collect();
            (domain.stack_name(), ids)
        })
        .collect()
}

/// Where confirming a reap stands: which stacks are still pending, since when each has been
/// unlisted, and each one's report so far.
pub(super) struct Confirming<'s> {
    stacks: &'s [(AppDomain, StackResources)],
    out: Vec<Reaped>,
    pending: Vec<usize>,
    quiet_since: HashMap<usize, tokio::time::Instant>,
}

/// What one poll round saw of the pending stacks.
pub(super) struct Round {
    /// Still listed, with what is left.
    still: Vec<(usize, StackResources)>,
    /// Unlisted, but not for long enough yet.
    settling: Vec<usize>,
}

impl Round {
    pub(super) fn pending(&self) -> Vec<usize> {
        self.still
            .iter()
            .map(|(i, _)| *i)
            .chain(self.settling.iter().copied())
            .collect()
    }
}

impl<'s> Confirming<'s> {
    pub(super) fn new(stacks: &'s [(AppDomain, StackResources)]) -> Self {
        Self {
            stacks,
            out: vec![Reaped::default(); stacks.len()],
            pending: (0..stacks.len()).collect(),
            quiet_since: HashMap::new(),
        }
    }

    /// The engine could not be asked: every pending stack says why.
    pub(super) fn fail_pending(&mut self, err: &DockerError) {
        for &i in &self.pending {
            self.out[i].errors.push(err.clone());
        }
    }

    /// Whether a pending stack had services: only then can a task of it still start.
    pub(super) fn needs_task_proof(&self) -> bool {
        self.pending
            .iter()
            .any(|&i| !self.stacks[i].1.services.is_empty())
    }

    /// Sort the pending stacks by what the engine lists now. When the stack had services, a
    /// task swarm had already handed to this node may still start after its service is gone
    /// and bring the stack's network back, so "nothing listed" is proof only when the swarm's
    /// task list, asked before the listing (`tasks`: the stacks with a task in it), held no
    /// task of the stack; without that, nothing listed must hold twice, SETTLE apart.
    pub(super) fn judge(
        &mut self,
        listing: &BTreeMap<AppDomain, StackResources>,
        tasks: Option<&BTreeSet<String>>,
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
            let no_task_left = tasks.is_some_and(|t| !t.contains(&domain.stack_name()));
            let settle = if stack.services.is_empty() || no_task_left {
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
    pub(super) async fn delete_again(&mut self, docker: &Docker, round: &Round) {
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
    pub(super) fn stuck(&self, round: &Round) -> bool {
        round.settling.is_empty()
            && round.still.iter().all(|(i, left)| {
                left.only_networks() && self.out[*i].blocked.len() == left.networks.len()
            })
    }

    /// How long to wait before the next round: until the first settling window closes when
    /// only settling stacks are left, else the backoff's next delay (`None`: give up).
    pub(super) fn delay<R: rand::Rng, C: crate::docker::backoff::Clock>(
        &self,
        round: &Round,
        now: tokio::time::Instant,
        backoff: &mut Backoff<R, C>,
    ) -> Option<Duration> {
        let next = backoff.next_delay();
        if !round.still.is_empty() {
            return next;
        }
        // Only settling stacks: the next round may prove them gone by the task list, and is
        // never later than the first settle window's end.
        let window = round
            .settling
            .iter()
            .filter_map(|i| self.quiet_since.get(i))
            .map(|since| (*since + SETTLE).saturating_duration_since(now))
            .min()
            .unwrap_or(SETTLE);
        Some(next.map_or(window, |next| next.min(window)))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::docker::seam::{Match, Resource};
    use crate::names::DomainSuffix;

    fn stack_with_a_service() -> Vec<(AppDomain, StackResources)> {
        let suffix = DomainSuffix::parse("ci.example.org").unwrap();
        let domain = RunAppPattern::new(&suffix)
            .domain_of_stack("cust-0a1b2c_ci_example_org")
            .unwrap();
        let stack = StackResources {
            services: vec![Resource {
                id: "svc1".into(),
                name: "cust-0a1b2c_ci_example_org_app".into(),
                by: Match::Label,
            }],
            ..StackResources::default()
        };
        vec![(domain, stack)]
    }

    /// Nothing listed of a stack that had services: gone at once only when the task list
    /// asked before the listing held no task of it; otherwise the settle window decides.
    #[test]
    fn an_unlisted_stack_is_gone_at_once_only_with_no_task_left() {
        let stacks = stack_with_a_service();
        let name = stacks[0].0.stack_name();
        let now = tokio::time::Instant::now();
        let later = now + Duration::from_secs(60);
        let listing = BTreeMap::new();

        let mut no_tasks_asked = Confirming::new(&stacks);
        let round = no_tasks_asked.judge(&listing, None, now, later);
        assert_eq!(round.settling, vec![0], "no task list: the window decides");
        assert!(!no_tasks_asked.out[0].confirmed);
        no_tasks_asked.pending = round.pending();

        let mut a_task_left = Confirming::new(&stacks);
        let left: BTreeSet<String> = [name.clone()].into();
        let round = a_task_left.judge(&listing, Some(&left), now, later);
        assert_eq!(
            round.settling,
            vec![0],
            "a task is left: it may still start"
        );

        let mut none_left = Confirming::new(&stacks);
        let other: BTreeSet<String> = ["some-other_stack".to_owned()].into();
        let round = none_left.judge(&listing, Some(&other), now, later);
        assert!(round.settling.is_empty() && round.still.is_empty());
        assert!(none_left.out[0].confirmed && none_left.out[0].gone());

        // The window still ends a wait where no task list could be had.
        let round = no_tasks_asked.judge(&listing, None, now + SETTLE, later);
        assert!(round.settling.is_empty());
        assert!(no_tasks_asked.out[0].confirmed);
    }
}
