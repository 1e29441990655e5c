//! The lock lineage: what keeps fencing tokens rising when etcd's own revisions start again.
//!
//! Within one cluster's data, revisions only grow, so the revision that last wrote a lock's
//! owner key (its claim, or the handover to it) orders its holders. But a cluster wiped and started with an empty data dir (even with
//! the same configuration, hence the same cluster id), or restored from an older snapshot,
//! counts again from a smaller revision, and a new holder would get a token that an old one
//! already had. Nothing inside such a cluster can remember what came before, so the token is
//! not the bare revision: it is `base + revision`, where `base` comes from the lineage record
//! ([`keys::LINEAGE`], a key with no lease) and is the wall-clock time, in microseconds, at
//! which the lineage began. A lineage begins when a claim finds no record (a new cluster, or a
//! wiped one), an unreadable one, one begun on another cluster (restored or replaced), or when a
//! holder sees the cluster's revision fall below its own lock's (restored from an older
//! snapshot). Every token of an earlier lineage is below the new base, as long as the earlier
//! lineage's revisions grew by less than one per microsecond (etcd writes tens of thousands per
//! second at most) and the clock of the host that begins it is not behind by more than the
//! earlier lineage lasted.
//!
//! Beginning a lineage also writes [`keys::SETTLING`], bound to a lease of one TTL that nobody
//! renews: while it lives no lock is granted, so that a holder under the old data, which its
//! lease and its key no longer exist for, notices and stops before anyone takes its lock again.
//! Only the writer of a record may change it, in one transaction that names the record it saw.

use std::time::{Duration, SystemTime};

use etcd_client::{Compare, CompareOp, KeyValue, PutOptions, Txn, TxnOp};
use serde::{Deserialize, Serialize};

use super::client::Pool;
use crate::names::etcd as keys;

/// The lineage record's value.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    /// Microseconds since the Unix epoch when the lineage began: the base of its tokens.
    base: i64,
    /// The cluster it began on, in hex as etcdctl shows it.
    cluster_id: String,
    started_at: String,
    /// Why it began.
    why: String,
}

/// A valid lineage, as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Lineage {
    pub(super) base: i64,
    /// The revision that wrote the record: a claim requires it unchanged.
    pub(super) mod_revision: i64,
}

/// What the lineage record says, read beside a lock at one revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum State {
    Valid(Lineage),
    /// A new one must begin: why, the record's revision (0: none), and a floor for the new base.
    Ended {
        why: String,
        mod_revision: i64,
        floor: i64,
    },
}

impl State {
    /// The record `kv` as seen from cluster `cluster`.
    pub(super) fn of(kv: Option<&KeyValue>, cluster: u64) -> Self {
        Self::from_record(kv.map(|kv| (kv.value(), kv.mod_revision())), cluster)
    }

    /// The record (its value and the revision that wrote it) as seen from cluster `cluster`.
    fn from_record(record: Option<(&[u8], i64)>, cluster: u64) -> Self {
        let Some((value, mod_revision)) = record else {
            return Self::Ended {
                why: "no lock lineage is recorded (a new cluster, or one whose data was wiped)"
                    .to_owned(),
                mod_revision: 0,
                floor: 0,
            };
        };
        let Ok(record) = serde_json::from_slice::<Record>(value) else {
            return Self::Ended {
                why: format!(
                    "its lock lineage record {} is unreadable (written by hand?)",
                    keys::LINEAGE
                ),
                mod_revision,
                floor: 0,
            };
        };
        let here = format!("{cluster:x}");
        if record.cluster_id != here {
            return Self::Ended {
                why: format!(
                    "its lock lineage began on cluster {}, and cluster {here} answers now (the \
                     data was restored into another cluster, or the cluster was replaced)",
                    record.cluster_id
                ),
                mod_revision,
                floor: record.base.saturating_add(1),
            };
        }
        Self::Valid(Lineage {
            base: record.base,
            mod_revision,
        })
    }

    pub(super) fn valid(&self) -> Option<Lineage> {
        match self {
            Self::Valid(lineage) => Some(*lineage),
            Self::Ended { .. } => None,
        }
    }
}

/// Microseconds since the Unix epoch, now.
fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// The base of a new lineage: now, and above `floor`.
fn new_base(floor: i64) -> i64 {
    now_micros().max(floor)
}

/// Begin a new lineage in place of the record at `mod_revision` (0: none), on cluster
/// `cluster`, and hold every claim back for `ttl`. Returns the status line to show when this
/// call began it; `None` when someone else changed the record first (theirs stands).
pub(super) async fn begin(
    pool: &Pool,
    cluster: u64,
    ttl: Duration,
    why: &str,
    mod_revision: i64,
    floor: i64,
) -> Result<Option<String>, etcd_client::Error> {
    let ttl_secs = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX).max(1);
    let settle = pool
        .call(|mut c| async move { c.lease_grant(ttl_secs, None).await })
        .await?
        .id();
    let base = new_base(floor);
    let record = Record {
        base,
        cluster_id: format!("{cluster:x}"),
        started_at: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
        why: why.to_owned(),
    };
    let value = serde_json::to_string(&record).expect("a lineage record always serialises");
    let txn = Txn::new()
        .when([Compare::mod_revision(
            keys::LINEAGE,
            CompareOp::Equal,
            mod_revision,
        )])
        .and_then([
            TxnOp::put(keys::LINEAGE, value, None),
            TxnOp::put(
                keys::SETTLING,
                why,
                Some(PutOptions::new().with_lease(settle)),
            ),
        ]);
    let response = pool.txn(&txn).await?;
    if !response.succeeded() {
        // Someone else began one first: ours is not needed, nor its settling lease.
        let _ = pool
            .call(|mut c| async move { c.lease_revoke(settle).await })
            .await;
        return Ok(None);
    }
    tracing::info!(base, cluster = format!("{cluster:x}"), "lock lineage begun");
    Ok(Some(format!(
        "== etcd: {why}; a new lock lineage begins (fencing tokens from now on are above {base}, \
         above any handed out before); no lock is granted for {} s, so that a holder under the \
         old data notices and stops ==",
        ttl.as_secs()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(base: i64, cluster: &str) -> Vec<u8> {
        serde_json::to_vec(&Record {
            base,
            cluster_id: cluster.to_owned(),
            started_at: "2025-01-01T00:00:00Z".to_owned(),
            why: "test".to_owned(),
        })
        .unwrap()
    }

    #[test]
    fn a_record_of_this_cluster_is_valid_and_anything_else_ends_the_lineage() {
        let ours = record(1_000, "2a");
        assert_eq!(
            State::from_record(Some((&ours, 7)), 0x2a).valid(),
            Some(Lineage {
                base: 1_000,
                mod_revision: 7
            })
        );
        // A wiped cluster: no record, nothing to build on but the clock.
        let State::Ended {
            mod_revision,
            floor,
            ..
        } = State::from_record(None, 0x2a)
        else {
            panic!("no record is no lineage");
        };
        assert_eq!((mod_revision, floor), (0, 0));
        // Restored into, or replaced by, another cluster: above the old base in any case.
        let State::Ended {
            why,
            mod_revision,
            floor,
        } = State::from_record(Some((&ours, 7)), 0x2b)
        else {
            panic!("another cluster's lineage is not this one's");
        };
        assert_eq!((mod_revision, floor), (7, 1_001));
        assert!(
            why.contains("began on cluster 2a, and cluster 2b answers"),
            "{why}"
        );
        // Written by hand: replaced (the transaction names the revision it saw).
        let State::Ended { mod_revision, .. } = State::from_record(Some((b"junk", 9)), 0x2a) else {
            panic!("an unreadable record is no lineage");
        };
        assert_eq!(mod_revision, 9);
    }

    #[test]
    fn a_new_base_is_now_or_later_and_above_its_floor() {
        let before = now_micros();
        assert!(new_base(0) >= before);
        let far = before + 3_600_000_000;
        assert_eq!(new_base(far), far);
    }
}
