//! The swarm's nodes as a run or `doctor` asks of them: which are out of service now, the wait
//! for them to come back, and a node sweep that removes nothing, to prove each can be swept.
//!
//! Floor: backends (docs/architecture.md): imports the floors below and the other backends, never a
//! command.

use std::time::Duration;

use crate::docker::nodes::{POLL, SweepTargets, TaskNodes};
use crate::docker::seam::{DockerError, DockerSeam};

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
