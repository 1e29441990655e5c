//! What `ccci-run doctor` asks of each etcd endpoint: does it answer, which cluster is it a
//! member of, which member leads, and what TTL does it grant a lease asked for ours.
//!
//! Invariant: every request is bounded ([`ASK_TIMEOUT`] per endpoint and request), each
//! endpoint is asked alone (one client each, so the answers say which member said what), and the
//! one lease granted is revoked before the answer is returned: nothing is left in etcd.

use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use super::client::{Driver, refused};
use crate::config::EtcdSettings;

/// How long connecting to one endpoint, or one request of it, may take.
pub(crate) const ASK_TIMEOUT: Duration = Duration::from_secs(3);

/// What one endpoint answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Member {
    pub cluster_id: u64,
    pub member_id: u64,
    /// The member it says leads (0: none).
    pub leader: u64,
    pub version: String,
    /// The TTL it granted a lease asked for the configured one, in seconds.
    pub granted_ttl: Option<i64>,
}

/// One endpoint and what it answered, or why it gave no answer.
pub(crate) type Answer = (String, Result<Member, String>);

/// Ask every endpoint of `settings`, in order.
pub(crate) fn ask(settings: &EtcdSettings) -> Result<Vec<Answer>, String> {
    let driver = Driver::start().map_err(|(what, detail)| format!("failed to {what}: {detail}"))?;
    let ttl = i64::try_from(settings.lease_ttl.as_secs()).unwrap_or(i64::MAX);
    let answers = settings
        .endpoints
        .iter()
        .map(|endpoint| {
            let answer = driver.handle.block_on(async {
                tokio::time::timeout(ASK_TIMEOUT * 3, ask_one(endpoint, ttl))
                    .await
                    .unwrap_or_else(|_| {
                        Err(format!("no answer within {} s", ASK_TIMEOUT.as_secs() * 3))
                    })
            });
            (endpoint.clone(), answer)
        })
        .collect();
    driver.stop();
    Ok(answers)
}

async fn ask_one(endpoint: &str, ttl: i64) -> Result<Member, String> {
    let options = ConnectOptions::new()
        .with_connect_timeout(ASK_TIMEOUT)
        .with_timeout(ASK_TIMEOUT);
    let mut client = Client::connect([endpoint], Some(options))
        .await
        .map_err(|e| unreachable("failed to connect", &e))?;
    let status = client
        .status()
        .await
        .map_err(|e| unreachable("failed to ask its status", &e))?;
    let header = status.header();
    let mut member = Member {
        cluster_id: header.map_or(0, |h| h.cluster_id()),
        member_id: header.map_or(0, |h| h.member_id()),
        leader: status.leader(),
        version: status.version().to_owned(),
        granted_ttl: None,
    };
    // Only a member with a leader can grant a lease; without one the missing leader is the news.
    if member.leader != 0 {
        let lease = client
            .lease_grant(ttl, None)
            .await
            .map_err(|e| format!("failed to grant a {ttl} s lease: {e}"))?;
        member.granted_ttl = Some(lease.ttl());
        let _ = client.lease_revoke(lease.id()).await;
    }
    Ok(member)
}

/// Why an endpoint gave no answer: a refused connection said in a word, anything else as the
/// client put it.
fn unreachable(what: &str, err: &etcd_client::Error) -> String {
    if refused(err) {
        format!(
            "{what}: connection refused: nothing listens there (is etcd running, on that port?)"
        )
    } else {
        format!("{what}: {err}")
    }
}
