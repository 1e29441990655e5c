//! Removal: one delete request per resource, idempotent (404 means already gone) and ordered so
//! that nothing waits on swarm: services, then the stack's containers force-removed, networks,
//! secrets, configs, and volumes last. Transient failures are retried with full jitter
//! ([`super::backoff`]); other client errors are not.

use bollard::Docker;
use bollard::errors::Error as BollardError;
use bollard::query_parameters::{
    InspectNetworkOptions, RemoveContainerOptions, RemoveVolumeOptions,
};
use futures_util::stream::{self, StreamExt};
use serde::Serialize;

use crate::docker::nodes;
use crate::docker::seam::{
    DockerError, Failure, REAP_CONCURRENCY, Resource, STACKS_AT_ONCE, StackResources, classify,
};

impl RemovedNames {
    pub(super) fn merge(&mut self, mut other: RemovedNames) {
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
    pub(super) fn only_networks(&self) -> bool {
        self.services.is_empty()
            && self.containers.is_empty()
            && self.volumes.is_empty()
            && self.secrets.is_empty()
            && self.configs.is_empty()
    }
}

impl StackResources {
    /// Every resource with its kind's noun, in the order a removal takes them.
    pub(crate) fn listed(&self) -> Vec<(&'static str, &Resource)> {
        Kind::REMOVAL_ORDER
            .iter()
            .flat_map(|kind| kind.of(self).iter().map(move |r| (kind.noun(), r)))
            .collect()
    }

    /// Every resource's name by kind: what a removal of the stack would remove.
    pub(crate) fn names(&self) -> RemovedNames {
        let mut names = RemovedNames::default();
        for kind in Kind::REMOVAL_ORDER {
            kind.names_mut(&mut names)
                .extend(kind.of(self).iter().map(|r| r.name.clone()));
        }
        names
    }
}

/// `<kind> <name>` of every resource.
pub(super) fn describe(stack: &StackResources) -> Vec<String> {
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
pub(super) async fn delete_all(
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
pub(super) type Deleted<'a> = (usize, Kind, &'a Resource, Result<bool, DockerError>);

/// Delete every resource of `kind` of `stacks` at once (up to [`REAP_CONCURRENCY`] requests
/// in flight); the index is the stack's in `stacks`.
pub(super) async fn delete_kind<'a>(
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
pub(super) async fn blocked_networks(
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
pub(super) async fn foreign_endpoints(
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
pub(super) async fn attempt(
    docker: &Docker,
    kind: Kind,
    res: &Resource,
) -> Result<bool, DockerError> {
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
pub(super) enum Kind {
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
    pub(super) const REMOVAL_ORDER: [Kind; 6] = [
        Kind::Service,
        Kind::Container,
        Kind::Network,
        Kind::Secret,
        Kind::Config,
        Kind::Volume,
    ];

    pub(super) fn noun(self) -> &'static str {
        match self {
            Kind::Service => "service",
            Kind::Container => "container",
            Kind::Network => "network",
            Kind::Secret => "secret",
            Kind::Config => "config",
            Kind::Volume => "volume",
        }
    }

    pub(super) fn of(self, stack: &StackResources) -> &[Resource] {
        match self {
            Kind::Service => &stack.services,
            Kind::Container => &stack.containers,
            Kind::Network => &stack.networks,
            Kind::Secret => &stack.secrets,
            Kind::Config => &stack.configs,
            Kind::Volume => &stack.volumes,
        }
    }

    pub(super) fn names_mut(self, removed: &mut RemovedNames) -> &mut Vec<String> {
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
pub(super) async fn remove_one(
    docker: &Docker,
    kind: Kind,
    res: &Resource,
) -> Result<(), BollardError> {
    match kind {
        Kind::Service => docker.delete_service(&res.id).await,
        Kind::Container => force_remove_container(docker, &res.id).await,
        Kind::Network => docker.remove_network(&res.id).await,
        Kind::Secret => docker.delete_secret(&res.id).await,
        Kind::Config => docker.delete_config(&res.id).await,
        Kind::Volume => remove_volume(docker, &res.name).await,
    }
}

pub(super) async fn force_remove_container(docker: &Docker, id: &str) -> Result<(), BollardError> {
    let options = RemoveContainerOptions {
        force: true,
        v: true,
        ..Default::default()
    };
    docker.remove_container(id, Some(options)).await
}

/// Remove a volume; when it is still in use by containers that are on their way out, force
/// them out first (the error names them) and report the failure as transient.
pub(super) async fn remove_volume(docker: &Docker, name: &str) -> Result<(), BollardError> {
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
pub(super) fn containers_named_in(message: &str) -> Vec<String> {
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

/// Names of what a removal took away, by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct RemovedNames {
    pub services: Vec<String>,
    pub containers: Vec<String>,
    pub networks: Vec<String>,
    pub volumes: Vec<String>,
    pub secrets: Vec<String>,
    pub configs: Vec<String>,
    /// What a node sweep removed on each node of a swarm (containers and volumes no manager
    /// lists), the node by id and hostname; absent when it removed nothing.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<nodes::NodeRemoved>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

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
