//! The services a configuration names: the Docker engine (and how its other nodes are swept)
//! and the etcd cluster that keeps a fleet's locks, each with the checks its values must pass.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

use std::path::PathBuf;
use std::time::Duration;

use crate::config::values::{
    DEFAULT_NODE_DOCKER_SOCKET, DEFAULT_NODE_SWEEP_IMAGE, ENDPOINT_FORM, KILL_MARGIN,
    LEASE_HEADROOM, LEASE_TTL_RANGE, Origin,
};
use crate::names::NameError;

/// The engine as `--docker-host` or the configuration file's `docker_host` names it, with the
/// file's TLS settings. Whatever the environment says of TLS (`DOCKER_TLS_VERIFY`,
/// `DOCKER_CERT_PATH`) goes first, as for every setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DockerHost {
    pub host: String,
    pub origin: Origin,
    pub tls_verify: bool,
    pub cert_path: Option<PathBuf>,
}
/// How a reap cleans what a stack left on the other nodes of a swarm (their containers and
/// local volumes, which a manager can neither list nor remove): a one-shot global job of this
/// image, with each node's own engine socket bind-mounted from this path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NodeSweepSettings {
    pub image: String,
    pub socket: PathBuf,
}

impl Default for NodeSweepSettings {
    fn default() -> Self {
        Self {
            image: DEFAULT_NODE_SWEEP_IMAGE.to_owned(),
            socket: PathBuf::from(DEFAULT_NODE_DOCKER_SOCKET),
        }
    }
}

/// Where the fleet's locks are kept when they are kept in etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EtcdSettings {
    pub endpoints: Vec<String>,
    /// How long a lease outlives its holder's last keepalive.
    pub lease_ttl: Duration,
}

impl EtcdSettings {
    /// Validate endpoints as given (flag, environment or file): at least one, each
    /// `http://HOST:PORT` and nothing else. The scheme is required: a bare `HOST:PORT` would be
    /// read by the client as plain http, which a reader of the setting cannot tell from TLS; and
    /// this build speaks no TLS.
    pub(crate) fn validate(endpoints: &[String], lease_ttl: u32) -> Result<Option<Self>, String> {
        let endpoints: Vec<String> = endpoints
            .iter()
            .map(|e| e.trim().to_owned())
            .filter(|e| !e.is_empty())
            .collect();
        if endpoints.is_empty() {
            return Ok(None);
        }
        for endpoint in &endpoints {
            // The setting's value is named by the caller: one endpoint of several is named here.
            let which = if endpoints.len() > 1 {
                format!("endpoint {endpoint:?}: ")
            } else {
                String::new()
            };
            let Some(rest) = endpoint.strip_prefix("http://") else {
                let why = if endpoint.contains("://") {
                    "its scheme is not http://"
                } else {
                    "the scheme is missing"
                };
                return Err(format!("{which}{why}: {ENDPOINT_FORM}"));
            };
            let (host, port) = rest
                .trim_end_matches('/')
                .rsplit_once(':')
                .ok_or_else(|| format!("{which}the port is missing: {ENDPOINT_FORM}"))?;
            if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
                return Err(format!("{which}{ENDPOINT_FORM} with a port in 1-65535"));
            }
        }
        if !LEASE_TTL_RANGE.contains(&lease_ttl) {
            return Err(format!(
                "lease TTL {lease_ttl} s is out of range ({}-{} s)",
                LEASE_TTL_RANGE.start(),
                LEASE_TTL_RANGE.end()
            ));
        }
        Ok(Some(Self {
            endpoints,
            lease_ttl: Duration::from_secs(lease_ttl.into()),
        }))
    }

    /// A holder of a lock under these settings stops its command before etcd can expire its
    /// lease: from the moment the lease is at risk (less than the stop budget left), TERM, then
    /// KILL at the grace, then [`KILL_MARGIN`] for the kill to take effect. That needs a TTL
    /// of at least the stop budget plus [`LEASE_HEADROOM`] for the keepalives; refuse one
    /// that cannot hold it, naming the smallest that can.
    pub(crate) fn check_stop_budget(&self, kill_grace: Duration) -> Result<(), NameError> {
        let budget = kill_grace.saturating_add(KILL_MARGIN);
        let needed = budget.saturating_add(LEASE_HEADROOM);
        if self.lease_ttl >= needed {
            return Ok(());
        }
        let smallest = needed.as_secs() + u64::from(needed.subsec_nanos() > 0);
        let grace_room = self
            .lease_ttl
            .saturating_sub(KILL_MARGIN)
            .saturating_sub(LEASE_HEADROOM);
        let or_grace = if grace_room.is_zero() {
            String::new()
        } else {
            format!(
                ", or a kill grace of at most {} (--kill-grace, CCCI_KILL_GRACE, kill_grace)",
                crate::duration::show(grace_room)
            )
        };
        Err(NameError {
            what: "lease TTL",
            value: crate::duration::show(self.lease_ttl),
            rule: format!(
                "a holder must be able to stop its command before etcd can expire its lease: \
                 with a kill grace of {} its stop budget is {} (the grace and {} for the kill \
                 to take effect), and the lease needs {} more for keepalives and an etcd leader \
                 election; the smallest \
                 lease TTL that works is {smallest} s (--lease-ttl, CCCI_LEASE_TTL, \
                 lease_ttl){or_grace}",
                crate::duration::show(kill_grace),
                crate::duration::show(budget),
                crate::duration::show(KILL_MARGIN),
                crate::duration::show(LEASE_HEADROOM),
            ),
        })
    }

    /// How long a holder with `kill_grace` may take to stop its command once it must.
    pub(crate) fn stop_budget(kill_grace: Duration) -> Duration {
        kill_grace.saturating_add(KILL_MARGIN)
    }
}
