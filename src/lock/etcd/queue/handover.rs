//! The release that hands the lock over: a holder whose command has ended makes the head
//! waiter the owner in the same transaction that ends its own hold, so the next holder learns
//! it holds from its watch and one read, not from a claim of its own.
//!
//! The transaction requires everything the head's own claim would ([`super::claim`]): the
//! owner key still ours, no holder but us that has not ended, the lineage and the fleet record
//! as read and covering the head's terms, no lineage settling; and the lock's keys unchanged
//! since the read (so the head read is the head: nobody joined ahead of it, nobody was promoted,
//! and its key is the one read, so its lease lived at the commit). It writes the owner key bound
//! to the head's lease and the head's tenure record with the head's own terms, removes the
//! head's waiter key and our tenure. Anything else, and nothing is written: the release is the
//! plain one, and the head claims as before.
//!
//! The owner key is overwritten, not made anew (etcd refuses a put and a delete of one key in
//! one transaction), so a holder is known by the revision that last wrote the owner key: its
//! creation for a claim, the handover for a handed lock. That revision is the fencing token's
//! base, above every earlier holder's as a creation revision is.

use std::sync::{Arc, Mutex, PoisonError};

use etcd_client::{Compare, CompareOp, KeyValue, PutOptions, Txn, TxnOp, WatchOptions};

use crate::lock::etcd::client::{ATTEMPT_TIMEOUT, Pool, RETRY_PAUSE};
use crate::lock::etcd::fleet;
use crate::lock::etcd::queue::claim::Claimed;
use crate::lock::etcd::queue::snapshot::{Snapshot, TenureValue, snapshot_as};
use crate::lock::holder::Holder;
use crate::names::etcd as keys;

/// The lock's directory as a holder last read it ([`follow_line`]).
pub(in crate::lock::etcd) type Line = Arc<Mutex<Option<Snapshot>>>;

/// While we hold lock `dir`, keep `line` read: once at first, then again at every change under
/// `dir` (a waiter that joins, leaves or is promoted), so that the release finds the head
/// already read. Each read is the member's own, stale or not ([`hand_over`] requires what it
/// read unchanged); a watch that fails is set up again after a read.
pub(in crate::lock::etcd) async fn follow_line(pool: Arc<Pool>, dir: String, line: Line) {
    loop {
        let Ok(snap) = snapshot_as(&pool, &dir, true).await else {
            tokio::time::sleep(RETRY_PAUSE).await;
            continue;
        };
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(snap.revision.saturating_add(1));
        *line.lock().unwrap_or_else(PoisonError::into_inner) = Some(snap);
        let (at, mut client) = pool.current();
        let Ok(Ok(mut watch)) =
            tokio::time::timeout(ATTEMPT_TIMEOUT, client.watch(dir.as_str(), Some(options))).await
        else {
            pool.fail_over(at);
            tokio::time::sleep(RETRY_PAUSE).await;
            continue;
        };
        loop {
            match watch.message().await {
                Ok(Some(resp)) if resp.events().is_empty() && !resp.canceled() => {}
                Ok(Some(_)) => break,
                Ok(None) | Err(_) => {
                    pool.fail_over(at);
                    tokio::time::sleep(RETRY_PAUSE).await;
                    break;
                }
            }
        }
    }
}

/// Hand lock `dir`, held under `lease` as `claimed`, to its head waiter, if one can take it
/// so, as `seen` found it (read now without it). `Ok(true)`: handed over (our hold and our
/// tenure ended with it); `Ok(false)`: nothing was written, release as usual.
pub(in crate::lock::etcd) async fn hand_over(
    pool: &Pool,
    dir: &str,
    lease: i64,
    claimed: &Claimed,
    seen: Option<Snapshot>,
) -> Result<bool, etcd_client::Error> {
    // A read of the member we ask, stale or not: the transaction requires what it read
    // unchanged, so a stale one only fails it.
    let snap = match seen {
        Some(snap) => snap,
        None => snapshot_as(pool, dir, true).await?,
    };
    let Some(txn) = handover_txn(&snap, dir, lease, claimed) else {
        return Ok(false);
    };
    let response = pool.txn(&txn).await?;
    Ok(response.succeeded())
}

/// The transaction that hands the lock over as `snap` found it, if `snap` allows one.
fn handover_txn(snap: &Snapshot, dir: &str, lease: i64, claimed: &Claimed) -> Option<Txn> {
    let owner = snap
        .owner
        .as_ref()
        .filter(|kv| kv.lease() == lease && kv.mod_revision() == claimed.revision)?;
    let (head, value) = snap.queue.first()?;
    let value = value.as_ref()?;
    let terms = value.terms?;
    let lineage = snap.lineage.valid()?;
    let ours = keys::tenure_key(dir, lease);
    let tenures_ours = snap.tenures.iter().all(|kv| kv.key() == ours.as_bytes());
    let fleet_seen = snap
        .fleet
        .as_ref()
        .filter(|kv| fleet::Bound::parse(kv).is_some_and(|b| b.covers(&terms)))
        .map(KeyValue::mod_revision);
    // Terms no configuration gives are not written into a record (a tenure record with them
    // would be junk); nor is a lock handed to ourselves.
    let plausible = terms.plausible();
    if !tenures_ours
        || !snap.junk.is_empty()
        || snap.settling.is_some()
        || lineage.mod_revision != claimed.lineage.mod_revision
        || fleet_seen.is_none()
        || !plausible
        || head.lease() == lease
        || head.lease() == 0
    {
        return None;
    }
    let head_key = std::str::from_utf8(head.key()).ok()?;
    let holder_line = Holder::taken_now(&value.holder.to_line());
    let tenure = TenureValue {
        holder: holder_line.clone(),
        stop_budget_ms: terms.stop_budget_ms,
        ttl_ms: terms.ttl_ms,
        lapsed: None,
    };
    let tenure = serde_json::to_string(&tenure).expect("a tenure record always serialises");
    let unchanged = snap.revision.saturating_add(1);
    let owner_key = keys::owner_key(dir);
    let when = vec![
        Compare::lease(owner_key.as_str(), CompareOp::Equal, lease),
        Compare::mod_revision(owner_key.as_str(), CompareOp::Equal, owner.mod_revision()),
        // Every key of the lock (the queue among them) and every tenure key last written at
        // or before the read.
        Compare::mod_revision(dir, CompareOp::Less, unchanged).with_prefix(),
        Compare::mod_revision(keys::tenure_prefix(dir), CompareOp::Less, unchanged).with_prefix(),
        Compare::mod_revision(keys::legacy_tenure_prefix(dir), CompareOp::Less, unchanged)
            .with_prefix(),
        Compare::lease(head_key, CompareOp::Equal, head.lease()),
        Compare::create_revision(head_key, CompareOp::Equal, head.create_revision()),
        Compare::lease(keys::SETTLING, CompareOp::Equal, 0),
        Compare::mod_revision(keys::LINEAGE, CompareOp::Equal, lineage.mod_revision),
        Compare::mod_revision(keys::FLEET, CompareOp::Equal, fleet_seen?),
    ];
    let then = vec![
        TxnOp::put(
            owner_key.as_str(),
            holder_line,
            Some(PutOptions::new().with_lease(head.lease())),
        ),
        TxnOp::delete(ours.as_str(), None),
        TxnOp::put(keys::tenure_key(dir, head.lease()), tenure, None),
        TxnOp::delete(head_key, None),
    ];
    Some(Txn::new().when(when).and_then(then))
}
