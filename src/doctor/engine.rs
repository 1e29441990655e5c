//! The engine's checks: Docker reachable and new enough, a swarm manager, and every node of a
//! swarm of several reachable by the node sweep.

use std::time::Duration;

use crate::config::{DockerMode, Global};
use crate::doctor::check::{Check, State, check};

/// How long any one Docker request may take.
pub(super) const DOCKER_TIMEOUT: Duration = Duration::from_secs(5);

/// How long doctor's node sweep may take: a job's task on each node, its image already there.
pub(super) const NODE_SWEEP_TIMEOUT: Duration = Duration::from_secs(10);

/// The oldest Docker API the Docker seam speaks (Docker 20.10).
pub(super) const MIN_DOCKER_API: (u32, u32) = (1, 41);

/// Docker reachable at `DOCKER_HOST`, in swarm mode, speaking API 1.41 or later; and the
/// swarm's nodes, each reached by a node sweep.
pub(super) fn docker(global: &Global) -> Vec<Check> {
    let mode = global.docker;
    let names = ["docker", "docker swarm", "docker api", "docker nodes"];
    if mode == DockerMode::Off {
        return names
            .iter()
            .map(|n| {
                check(
                    *n,
                    State::Skip,
                    "docker = off: runs and sweeps never touch Docker",
                )
                .fix("set docker = \"auto\" or \"required\" on a host that deploys apps")
            })
            .collect();
    }
    crate::docker::endpoint::choose(global.docker_host.as_ref());
    let seam = crate::docker::DockerSeam::connect();
    let facts = seam
        .as_ref()
        .map_err(Clone::clone)
        .and_then(|seam| seam.engine_facts(DOCKER_TIMEOUT));
    let facts = match facts {
        Ok(facts) => facts,
        Err(err) => {
            let mut checks = vec![check(names[0], State::Fail, err.to_string()).fix(format!(
                "start the engine, or point DOCKER_HOST, --docker-host or the file's docker_host \
                 (now {}) at it",
                crate::docker::endpoint::named()
            ))];
            checks.extend(names[1..].iter().map(|n| {
                check(
                    *n,
                    State::Fail,
                    "cannot be asked: the engine does not answer",
                )
                .fix("make the engine answer first")
            }));
            return checks;
        }
    };
    let mut checks = vec![check(
        names[0],
        State::Ok,
        format!(
            "Docker {} answers at {}",
            facts.version,
            crate::docker::Endpoint::from_env()
                .map(|e| e.to_string())
                .unwrap_or_default()
        ),
    )];
    checks.push(match (facts.swarm_state.as_str(), facts.swarm_manager) {
        ("active", true) => check(names[1], State::Ok, "active, this node is a manager"),
        ("active", false) => check(
            names[1],
            State::Fail,
            "active, but this node is a worker: stacks are deployed through a manager",
        )
        .fix("docker node promote this node, or run CI on a manager"),
        (state, _) => {
            let state = if state.is_empty() { "unknown" } else { state };
            let error = facts
                .swarm_error
                .as_deref()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default();
            check(
                names[1],
                State::Fail,
                format!("swarm is {state}{error}: abra deploys apps as swarm stacks"),
            )
            .fix("docker swarm init")
        }
    });
    let api = parse_api(&facts.api_version);
    checks.push(match api {
        Some(v) if v >= MIN_DOCKER_API => check(
            names[2],
            State::Ok,
            format!(
                "engine API {}, this client speaks {}",
                facts.api_version, facts.negotiated
            ),
        ),
        _ => check(
            names[2],
            State::Fail,
            format!(
                "engine API {:?}: ccci-run needs {}.{} (Docker 20.10) or later",
                facts.api_version, MIN_DOCKER_API.0, MIN_DOCKER_API.1
            ),
        )
        .fix("upgrade the Docker engine to 20.10 or later"),
    });
    checks.push(match seam {
        Ok(seam) if facts.swarm_state == "active" && facts.swarm_manager => {
            nodes(seam.with_node_sweep(global.node_sweep.clone()), names[3])
        }
        _ => check(
            names[3],
            State::Skip,
            "not a swarm manager: no nodes to ask",
        )
        .fix("point DOCKER_HOST at a swarm manager"),
    });
    checks
}

/// The swarm's nodes: each named with its role and state, and on a swarm of several, each
/// reached by a node sweep that removes nothing (what a reap's sweep does, with no stack):
/// a node whose task does not complete cannot have its volumes cleaned.
pub(super) fn nodes(seam: crate::docker::DockerSeam, name: &'static str) -> Check {
    match seam.probe_nodes(NODE_SWEEP_TIMEOUT) {
        Err(err) => {
            check(name, State::Fail, err.to_string()).fix("make the manager answer its node list")
        }
        Ok(probe) if probe.nodes.len() <= 1 => check(
            name,
            State::Ok,
            format!(
                "one node ({}): everything of an app is removed through this engine",
                probe.nodes.join(", ")
            ),
        ),
        Ok(probe) if probe.unconfirmed.is_empty() => check(
            name,
            State::Ok,
            format!(
                "{} nodes, each reached by a node sweep (image {}) that can remove a stack's \
                 containers and volumes there: {}",
                probe.nodes.len(),
                probe.image,
                probe.nodes.join(", ")
            ),
        ),
        Ok(probe) => check(
            name,
            State::Fail,
            format!(
                "{} nodes ({}); a reap cannot confirm an app gone while {}",
                probe.nodes.len(),
                probe.nodes.join(", "),
                probe.unconfirmed.join("; ")
            ),
        )
        .fix(format!(
            "bring the node back, make it active, or remove it from the swarm (docker node rm); \
             load the node sweep image {} on every node (node_sweep_image), and make its engine \
             listen on {} there (node_docker_socket)",
            probe.image, probe.socket
        )),
    }
}

pub(super) fn parse_api(version: &str) -> Option<(u32, u32)> {
    let (major, minor) = version.split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}
