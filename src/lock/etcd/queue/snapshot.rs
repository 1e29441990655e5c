//! A lock directory read at one revision ([`Snapshot`]) and what it says: who holds the lock,
//! who waits, what stands between a waiter and the lock ([`Obstacle`]); the values its keys
//! hold, and the removal of a key by the revision it was seen at.
//!
//! Floor: backends (docs/architecture.md): imports the floors below and the other backends, never a
//! command.

use std::time::{Duration, Instant};

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
};
use serde::{Deserialize, Serialize};

use crate::config::Class;
use crate::lock::backend::Wait;
use crate::lock::etcd::client::{Pool, REQUEST_TIMEOUT, Shared};
use crate::lock::etcd::fleet;
use crate::lock::etcd::lineage::{self};
use crate::lock::file::LockError;
use crate::lock::holder::Holder;
use crate::names::etcd as keys;

/// How often a waiter reads its queue again even though its watch said nothing.
pub(in crate::lock::etcd) const RECHECK_EVERY: Duration = Duration::from_secs(3);

/// What a tenure key holds: the holder's line, its lease TTL, and how long it may take to stop
/// its command once its lease is at risk (its kill grace and the kill margin). Written without
/// a lease, so that it outlives a lease that ends: then whoever finds it first binds it to a
/// lease of its own that lasts the holder's TTL and stop budget ([`lapse`]), and nobody takes
/// the lock until it is gone.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(in crate::lock::etcd) struct TenureValue {
    pub(in crate::lock::etcd) holder: String,
    pub(in crate::lock::etcd) stop_budget_ms: u64,
    /// The holder's lease TTL (0 in a record of an older version: the reader's own is taken,
    /// or the fleet's if longer).
    #[serde(default)]
    pub(in crate::lock::etcd) ttl_ms: u64,
    /// Once the holder's lease was found expired: who found it, and when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(in crate::lock::etcd) lapsed: Option<String>,
}

impl TenureValue {
    /// The record, when a holder can have written it: one whose stop budget or TTL is above
    /// what any configuration gives (a planted `8e12` ms would bind the lock to a lease of
    /// centuries) is junk, removed as any other.
    pub(in crate::lock::etcd) fn parse(kv: &KeyValue) -> Option<Self> {
        serde_json::from_slice::<Self>(kv.value()).ok().filter(|v| {
            v.stop_budget() <= crate::config::MAX_STOP_BUDGET
                && Duration::from_millis(v.ttl_ms) <= crate::config::MAX_LEASE_TTL
        })
    }

    pub(in crate::lock::etcd) fn stop_budget(&self) -> Duration {
        Duration::from_millis(self.stop_budget_ms)
    }

    /// How long after its lease was found gone its holder's command may still run, at most:
    /// the holder's TTL (or `fallback` for a record that does not say) and its stop budget.
    pub(in crate::lock::etcd) fn wait_out(&self, fallback: Duration) -> Duration {
        let ttl = if self.ttl_ms == 0 {
            fallback
        } else {
            Duration::from_millis(self.ttl_ms)
        };
        ttl.saturating_add(self.stop_budget())
    }
}

/// The lease a tenure key names (`tenure/<lease id>`).
pub(super) fn tenure_lease(kv: &KeyValue) -> Option<i64> {
    let key = std::str::from_utf8(kv.key()).ok()?;
    let (_, id) = key.rsplit_once('/')?;
    i64::from_str_radix(id, 16).ok()
}

/// What a waiter's key holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(in crate::lock::etcd) struct WaiterValue {
    pub(in crate::lock::etcd) holder: Holder,
    pub(in crate::lock::etcd) class: Class,
    /// The lease TTL and stop budget the waiter will hold with: what its tenure record says.
    /// A waiter that names them may be handed the lock by the holder's release
    /// ([`super::hand_over`]); one written by an older version, which does not, claims it itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(in crate::lock::etcd) terms: Option<fleet::Bound>,
}

/// One lock's key directory, as read at one revision, with the lineage beside it.
pub(in crate::lock::etcd) struct Snapshot {
    /// The lock's key directory.
    dir: String,
    pub(in crate::lock::etcd) revision: i64,
    /// The cluster that answered.
    pub(in crate::lock::etcd) cluster: u64,
    /// The owner key, when it is bound to a lease.
    pub(in crate::lock::etcd) owner: Option<KeyValue>,
    /// Holders that have not ended yet (their tenure keys), in creation order.
    pub(in crate::lock::etcd) tenures: Vec<KeyValue>,
    /// Waiters in service order: fast first, then by creation.
    pub(in crate::lock::etcd) queue: Vec<(KeyValue, Option<WaiterValue>)>,
    /// Keys of the directory found without a lease: ignored.
    pub(in crate::lock::etcd) junk: Vec<KeyValue>,
    pub(in crate::lock::etcd) lineage: lineage::State,
    /// The settling key, while a new lineage settles.
    pub(in crate::lock::etcd) settling: Option<KeyValue>,
    /// The fleet record, when it was read with the directory ([`snapshot`]): a claim that
    /// finds it covering ours requires it unchanged instead of raising it.
    pub(in crate::lock::etcd) fleet: Option<KeyValue>,
}

/// The first thing between a claim and the lock.
pub(in crate::lock::etcd) enum Obstacle<'s> {
    /// No valid lineage: a new one must begin.
    Lineage {
        why: &'s str,
        mod_revision: i64,
        floor: i64,
    },
    /// Held.
    Owner(&'s KeyValue),
    /// An owner or tenure key without a lease (or, for a tenure key, without a tenure record):
    /// removed, then claimed over.
    Junk(&'s KeyValue),
    /// A holder that lost its owner key and has not ended yet.
    Tenure(&'s KeyValue),
    /// A new lineage settles.
    Settling(&'s KeyValue),
    /// Another waiter is served first.
    Ahead(&'s KeyValue),
}

impl Obstacle<'_> {
    /// The key whose change may clear it, when waiting is the way past it.
    pub(in crate::lock::etcd) fn watched(&self) -> Option<&[u8]> {
        match self {
            Self::Owner(kv) | Self::Tenure(kv) | Self::Settling(kv) | Self::Ahead(kv) => {
                Some(kv.key())
            }
            Self::Lineage { .. } | Self::Junk(_) => None,
        }
    }
}

impl Snapshot {
    /// Lock directory `dir` from its keys as read at `revision` from `cluster`, in creation
    /// order, beside the lineage record and the settling key as read with them.
    pub(in crate::lock::etcd) fn of<'k>(
        dir: &str,
        (revision, cluster): (i64, u64),
        kvs: impl IntoIterator<Item = &'k KeyValue>,
        lineage: Option<&KeyValue>,
        settling: Option<&KeyValue>,
    ) -> Self {
        let owner_key = keys::owner_key(dir);
        let queue_prefix = keys::queue_prefix(dir);
        let tenure_prefix = keys::tenure_prefix(dir);
        let legacy_tenure = keys::legacy_tenure_prefix(dir);
        let mut snap = Self {
            dir: dir.to_owned(),
            revision,
            cluster,
            owner: None,
            tenures: Vec::new(),
            queue: Vec::new(),
            junk: Vec::new(),
            lineage: lineage::State::of(lineage, cluster),
            settling: settling.filter(|kv| kv.lease() != 0).cloned(),
            fleet: None,
        };
        for kv in kvs {
            let key = kv.key();
            let ours = key == owner_key.as_bytes()
                || key.starts_with(queue_prefix.as_bytes())
                || key.starts_with(tenure_prefix.as_bytes())
                || key.starts_with(legacy_tenure.as_bytes());
            if !ours {
                continue;
            }
            let tenure = key.starts_with(tenure_prefix.as_bytes())
                || key.starts_with(legacy_tenure.as_bytes());
            if tenure && TenureValue::parse(kv).is_some() {
                // Bound to no lease while its holder lives, to one of its own once it lapsed.
                snap.tenures.push(kv.clone());
            } else if kv.lease() == 0 || tenure {
                snap.junk.push(kv.clone());
            } else if key == owner_key.as_bytes() {
                snap.owner = Some(kv.clone());
            } else {
                let value = serde_json::from_slice::<WaiterValue>(kv.value()).ok();
                snap.queue.push((kv.clone(), value));
            }
        }
        // The tenure tree is read apart from the directory: creation order across both.
        snap.tenures.sort_by_key(KeyValue::create_revision);
        // Stable: within a class, creation order (the read's order) stands.
        snap.queue
            .sort_by_key(|(_, v)| v.as_ref().map_or(Class::Normal, |v| v.class));
        snap
    }

    /// Who holds the lock: the owner, else a holder that lost its key but has not ended.
    pub(in crate::lock::etcd) fn holder(&self) -> Option<Holder> {
        if let Some(kv) = &self.owner {
            return Holder::parse(&String::from_utf8_lossy(kv.value()));
        }
        let tenure = TenureValue::parse(self.tenures.first()?)?;
        Holder::parse(&tenure.holder)
    }

    /// The tenure record of the holder whose lease is `lease`.
    pub(in crate::lock::etcd) fn tenure_of(&self, lease: i64) -> Option<TenureValue> {
        let key = keys::tenure_key(&self.dir, lease);
        let kv = self.tenures.iter().find(|kv| kv.key() == key.as_bytes())?;
        TenureValue::parse(kv)
    }

    /// A junk owner or tenure key: it would fail a claim's transaction, so it goes first.
    fn junk_in_the_way(&self) -> Option<&KeyValue> {
        let owner = keys::owner_key(&self.dir);
        let tenure = keys::tenure_prefix(&self.dir);
        let legacy = keys::legacy_tenure_prefix(&self.dir);
        self.junk.iter().find(|kv| {
            kv.key() == owner.as_bytes()
                || kv.key().starts_with(tenure.as_bytes())
                || kv.key().starts_with(legacy.as_bytes())
        })
    }

    /// What stands between `waiter` (or, without one, a claim from outside the line) and the
    /// lock; `None`: claim it now.
    pub(in crate::lock::etcd) fn obstacle(&self, waiter: Option<&str>) -> Option<Obstacle<'_>> {
        let ahead = match waiter {
            Some(waiter) => self
                .queue
                .iter()
                .take_while(|(kv, _)| kv.key() != waiter.as_bytes())
                .last(),
            None => self.queue.first(),
        };
        if let Some((kv, _)) = ahead {
            return Some(Obstacle::Ahead(kv));
        }
        if let Some(kv) = &self.owner {
            return Some(Obstacle::Owner(kv));
        }
        if let Some(kv) = self.tenures.first() {
            return Some(Obstacle::Tenure(kv));
        }
        if let lineage::State::Ended {
            why,
            mod_revision,
            floor,
        } = &self.lineage
        {
            return Some(Obstacle::Lineage {
                why,
                mod_revision: *mod_revision,
                floor: *floor,
            });
        }
        if let Some(kv) = &self.settling {
            return Some(Obstacle::Settling(kv));
        }
        self.junk_in_the_way().map(Obstacle::Junk)
    }

    /// Whether the owner key is all that stands between `waiter` and the lock: once it goes
    /// (and nothing else changed), `waiter` may claim at once, without reading again.
    /// (Its holder's own tenure key goes with it, in the release.)
    pub(in crate::lock::etcd) fn only_owner_in_the_way(&self, waiter: &str) -> bool {
        let Some(Obstacle::Owner(owner)) = self.obstacle(Some(waiter)) else {
            return false;
        };
        self.tenures
            .iter()
            .all(|kv| tenure_lease(kv) == Some(owner.lease()))
            && self.lineage.valid().is_some()
            && self.settling.is_none()
            && self.junk_in_the_way().is_none()
    }

    /// Whether the lock is held back for the lineage (one to begin, or settling), not by a
    /// holder.
    pub(in crate::lock::etcd) fn settles(&self) -> bool {
        self.owner.is_none()
            && self.tenures.is_empty()
            && (self.settling.is_some() || self.lineage.valid().is_none())
    }
}

/// One lock's snapshot, read on the client's runtime.
pub(in crate::lock::etcd) fn read_snapshot(
    shared: &Shared,
    dir: &str,
) -> Result<Snapshot, LockError> {
    shared.block_on(
        "read the lock",
        REQUEST_TIMEOUT,
        snapshot(&shared.pool, dir),
    )
}

/// Read one lock's key directory, the lineage, the settling key and the fleet record, at one
/// revision.
pub(in crate::lock::etcd) async fn snapshot(
    pool: &Pool,
    dir: &str,
) -> Result<Snapshot, etcd_client::Error> {
    snapshot_as(pool, dir, false).await
}

/// [`snapshot`], `serializable`: as the member asked has applied it, without asking the
/// leader whether that is the latest (it may be behind). Only for a read whose every use is a
/// transaction that requires what it read unchanged.
pub(in crate::lock::etcd) async fn snapshot_as(
    pool: &Pool,
    dir: &str,
    serializable: bool,
) -> Result<Snapshot, etcd_client::Error> {
    let options = || {
        let options = GetOptions::new();
        if serializable {
            options.with_serializable()
        } else {
            options
        }
    };
    let txn = Txn::new().and_then([
        TxnOp::get(
            dir,
            Some(
                options()
                    .with_prefix()
                    .with_sort(SortTarget::Create, SortOrder::Ascend),
            ),
        ),
        TxnOp::get(keys::LINEAGE, Some(options())),
        TxnOp::get(keys::SETTLING, Some(options())),
        TxnOp::get(keys::tenure_prefix(dir), Some(options().with_prefix())),
        TxnOp::get(keys::FLEET, Some(options())),
    ]);
    let response = pool.txn(&txn).await?;
    let header = response
        .header()
        .map_or((0, 0), |h| (h.revision(), h.cluster_id()));
    let gets: Vec<_> = response
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get),
            _ => None,
        })
        .collect();
    let [dir_keys, lineage, settling, tenures, fleet] = gets.as_slice() else {
        return Err(etcd_client::Error::InvalidArgs(
            "a read of a lock directory answered without its five parts".to_owned(),
        ));
    };
    let mut snap = Snapshot::of(
        dir,
        header,
        dir_keys.kvs().iter().chain(tenures.kvs()),
        lineage.kvs().first(),
        settling.kvs().first(),
    );
    snap.fleet = fleet.kvs().first().cloned();
    Ok(snap)
}

/// Remove `kv`, a key found without a lease, if it is still the one seen; whether it went.
pub(in crate::lock::etcd) async fn remove_junk(
    pool: &Pool,
    kv: &KeyValue,
) -> Result<bool, etcd_client::Error> {
    delete_seen(pool, kv, true).await
}

/// Delete `kv` if it is still the one seen (its revision unchanged; and still bound to no lease,
/// when `unleased`); whether it went.
pub(in crate::lock::etcd) async fn delete_seen(
    pool: &Pool,
    kv: &KeyValue,
    unleased: bool,
) -> Result<bool, etcd_client::Error> {
    let mut when = vec![Compare::mod_revision(
        kv.key(),
        CompareOp::Equal,
        kv.mod_revision(),
    )];
    if unleased {
        when.push(Compare::lease(kv.key(), CompareOp::Equal, 0));
    }
    let txn = Txn::new()
        .when(when)
        .and_then([TxnOp::delete(kv.key(), None)]);
    let response = pool.txn(&txn).await?;
    Ok(response.succeeded())
}

/// "ticket 41 (normal, pid 7 on host-b)".
pub(in crate::lock::etcd) fn describe_waiter(kv: &KeyValue, value: Option<&WaiterValue>) -> String {
    match value {
        Some(v) => format!(
            "{} ({}, pid {} on {})",
            kv.create_revision(),
            v.class.as_str(),
            v.holder.pid,
            v.holder.host
        ),
        None => kv.create_revision().to_string(),
    }
}

/// A named lock's waiting line, as on one host: our ticket, the budget, our place in line.
pub(in crate::lock::etcd) fn waiting_line(
    name: &crate::names::LockName,
    snap: &Snapshot,
    waiter: &str,
    ticket: i64,
    wait: &Wait<'_>,
) -> String {
    let budget = wait.until.map_or("no time limit".to_owned(), |until| {
        format!(
            "{:.1} s of budget left",
            until
                .saturating_duration_since(Instant::now())
                .as_secs_f64()
        )
    });
    let ahead = snap
        .queue
        .iter()
        .take_while(|(kv, _)| kv.key() != waiter.as_bytes())
        .count();
    let position = if ahead == 0 {
        "head of the queue, waiting for the holder".to_owned()
    } else {
        let head = snap
            .queue
            .first()
            .map_or("-".to_owned(), |(kv, v)| describe_waiter(kv, v.as_ref()));
        format!("{ahead} ticket(s) ahead, head is {head}")
    };
    format!(
        "== lock {name}: waiting as queue ticket {ticket} ({}), {budget}; {position} ==",
        wait.class.as_str()
    )
}
