//! The claim: taking the owner key when nothing stands in the way, clearing what may be cleared
//! (junk keys, a lapsed holder's tenure once its stop budget has passed), and the lapse of a
//! holder that lost its lease without releasing.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, KeyValue, PutOptions, Txn, TxnOp};

use crate::lock::etcd::client::Pool;
use crate::lock::etcd::fleet;
use crate::lock::etcd::lineage::{self, Lineage};
use crate::lock::etcd::queue::look::Proof;
use crate::lock::etcd::queue::snapshot::{
    Obstacle, Snapshot, TenureValue, delete_seen, remove_junk, tenure_lease,
};
use crate::lock::holder::Holder;
use crate::names::etcd as keys;
use crate::report;

/// A claim that went through: the owner key's revision, the cluster, the lineage it is in.
#[derive(Debug, Clone, Copy)]
pub(in crate::lock::etcd) struct Claimed {
    pub(in crate::lock::etcd) revision: i64,
    pub(in crate::lock::etcd) cluster: u64,
    pub(in crate::lock::etcd) lineage: Lineage,
}

impl Claimed {
    /// The fencing token: above every earlier holder's, in this lineage and any before it.
    pub(in crate::lock::etcd) fn token(&self) -> i64 {
        self.lineage.base.saturating_add(self.revision)
    }
}

/// Try to become the owner, as `waiter` (which must still be ours and is removed) or, without
/// one, from outside the line: in one transaction that requires the owner key absent, no
/// holder that has not ended, no settling lineage and the lineage still the one `seen` (a read
/// that found it valid). Writes the owner key and our tenure key. `None`: something changed;
/// read again.
///
/// The fleet record must cover our `ttl` and `stop_budget` before we hold: what we may hold is
/// known before we hold. When `seen` found it covering them, the transaction requires it
/// unchanged since; else it is raised first ([`fleet::raise`]).
///
/// With `queue_unchanged`, the transaction also requires that no waiter key was written since
/// `seen` (a claim made on a watch event without reading again: nobody joined ahead of us).
#[allow(clippy::too_many_arguments)]
pub(in crate::lock::etcd) async fn claim(
    pool: &Pool,
    dir: &str,
    seen: &Snapshot,
    queue_unchanged: bool,
    waiter: Option<&str>,
    lease: i64,
    holder_line: &str,
    ttl: Duration,
    stop_budget: Duration,
) -> Result<Option<Claimed>, etcd_client::Error> {
    let Some(lineage) = seen.lineage.valid() else {
        return Ok(None);
    };
    let ours = fleet::Bound::of(ttl, stop_budget);
    let fleet_seen = seen
        .fleet
        .as_ref()
        .filter(|kv| fleet::Bound::parse(kv).is_some_and(|b| b.covers(&ours)))
        .map(KeyValue::mod_revision);
    if fleet_seen.is_none() {
        fleet::raise(pool, ours).await?;
    }
    let owner = keys::owner_key(dir);
    // Its `started_at` is when the lock is taken: now, not when the wait began.
    let holder_line = crate::lock::holder::Holder::taken_now(holder_line);
    let holder_line = holder_line.as_str();
    let bound = || Some(PutOptions::new().with_lease(lease));
    let tenure = TenureValue {
        holder: holder_line.to_owned(),
        stop_budget_ms: u64::try_from(stop_budget.as_millis()).unwrap_or(u64::MAX),
        ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
        lapsed: None,
    };
    let tenure = serde_json::to_string(&tenure).expect("a tenure record always serialises");
    let mut when = vec![
        Compare::create_revision(owner.as_str(), CompareOp::Equal, 0),
        // No tenure key at all (a range compare holds for every key in it, and for an empty
        // range as for an absent key).
        Compare::create_revision(keys::tenure_prefix(dir), CompareOp::Equal, 0).with_prefix(),
        Compare::create_revision(keys::legacy_tenure_prefix(dir), CompareOp::Equal, 0)
            .with_prefix(),
        Compare::lease(keys::SETTLING, CompareOp::Equal, 0),
        Compare::mod_revision(keys::LINEAGE, CompareOp::Equal, lineage.mod_revision),
    ];
    if let Some(fleet) = fleet_seen {
        when.push(Compare::mod_revision(keys::FLEET, CompareOp::Equal, fleet));
    }
    if queue_unchanged {
        // Every waiter key (ours among them) last written at or before the read.
        when.push(
            Compare::mod_revision(
                keys::queue_prefix(dir),
                CompareOp::Less,
                seen.revision.saturating_add(1),
            )
            .with_prefix(),
        );
    }
    let mut then = vec![
        TxnOp::put(owner.as_str(), holder_line, bound()),
        // Bound to no lease: it outlives ours if ours expires, and says how long we may take
        // to stop (see [`lapse`]).
        TxnOp::put(keys::tenure_key(dir, lease), tenure, None),
    ];
    if let Some(waiter) = waiter {
        when.push(Compare::lease(waiter, CompareOp::Equal, lease));
        then.push(TxnOp::delete(waiter, None));
    }
    let txn = Txn::new().when(when).and_then(then);
    let response = pool.txn(&txn).await?;
    Ok(response.succeeded().then(|| Claimed {
        revision: response.header().map_or(0, |h| h.revision()),
        cluster: response.header().map_or(0, |h| h.cluster_id()),
        lineage,
    }))
}

/// What a waiter (or a claim from outside the line) does about `obstacle` that is not waiting:
/// begin a lineage, remove a junk owner key. `Err` when etcd did not answer.
pub(in crate::lock::etcd) async fn clear(
    pool: &Pool,
    snap: &Snapshot,
    obstacle: &Obstacle<'_>,
    ttl: Duration,
) -> Result<(), etcd_client::Error> {
    match obstacle {
        Obstacle::Lineage {
            why,
            mod_revision,
            floor,
        } => {
            // Held back for as long as any holder under the old data may still run.
            let settle = fleet::longest_hold(pool, ttl).await?;
            if let Some(line) =
                lineage::begin(pool, snap.cluster, settle, why, *mod_revision, *floor).await?
            {
                report::line(&line);
            }
        }
        Obstacle::Junk(kv) => {
            let removed = remove_junk(pool, kv).await?;
            if removed {
                report::line(&format!(
                    "== etcd: removed {}, a key without a lease or record (written by hand?): it \
                     held nobody's lock ==",
                    String::from_utf8_lossy(kv.key())
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

/// What a look at a tenure key found.
pub(in crate::lock::etcd) enum Tenure {
    /// Its holder's lease lives: the holder is stopping its command, and removes the key when
    /// it has.
    Alive,
    /// Its holder's lease ended without a release (expired: cut off, stalled or killed; or
    /// revoked by hand): the key was just bound to a lease of the holder's TTL and stop budget,
    /// or already was; nobody takes the lock until it is gone.
    Lapsed(TenureValue),
    /// It changed meanwhile: read again.
    Changed,
}

/// Look at tenure key `kv`: a key bound to no lease whose holder's lease is gone is rebound to
/// a lease of its own that lasts the holder's TTL and stop budget, from now (`fallback_ttl`
/// for a record that names no TTL). `who` says who found it.
///
/// Why that long: etcd cannot tell us how the lease ended. An expiry came no earlier than the
/// holder's last renewal plus its TTL, but a revoke (`etcdctl lease revoke`) deletes the keys at
/// once, while a holder cut off from the cluster hears nothing of it and runs on to its own
/// at-risk point: its last answered keepalive's send time plus its TTL less its stop budget,
/// then stops within its stop budget (its fence kills what is left by then). Its last
/// keepalive was sent before the lease ended, which was before we found it gone: so its
/// command is gone by now plus its TTL, whatever ended the lease; the stop budget on top is
/// the margin for a holder's clock and for a fence that is late.
pub(in crate::lock::etcd) async fn lapse(
    pool: &Pool,
    kv: &KeyValue,
    who: &str,
    fallback_ttl: Duration,
) -> Result<Tenure, etcd_client::Error> {
    let Some(value) = TenureValue::parse(kv) else {
        return Ok(Tenure::Changed);
    };
    if kv.lease() != 0 {
        return Ok(Tenure::Lapsed(value));
    }
    if let Some(id) = tenure_lease(kv) {
        let alive = pool
            .call(|mut c| async move { c.lease_time_to_live(id, None).await })
            .await?;
        if alive.ttl() > 0 {
            return Ok(Tenure::Alive);
        }
    }
    let wait = value.wait_out(fallback_ttl);
    let ttl = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    let ttl = i64::try_from(ttl.max(1)).unwrap_or(i64::MAX);
    let grant = pool
        .call(|mut c| async move { c.lease_grant(ttl, None).await })
        .await?;
    let lapsed = TenureValue {
        lapsed: Some(format!(
            "found expired by {who} at {}",
            humantime::format_rfc3339_millis(std::time::SystemTime::now())
        )),
        ..value.clone()
    };
    let line = serde_json::to_string(&lapsed).expect("a tenure record always serialises");
    let txn = Txn::new()
        .when([
            Compare::mod_revision(kv.key(), CompareOp::Equal, kv.mod_revision()),
            Compare::lease(kv.key(), CompareOp::Equal, 0),
        ])
        .and_then([TxnOp::put(
            kv.key(),
            line,
            Some(PutOptions::new().with_lease(grant.id())),
        )]);
    let response = pool.txn(&txn).await?;
    Ok(if response.succeeded() {
        Tenure::Lapsed(lapsed)
    } else {
        Tenure::Changed
    })
}

/// End tenure key `kv` whose holder's command a look proved gone ([`LeaseWatch`]), if it is
/// still the one seen (bound to a lease of a lapse or not).
pub(in crate::lock::etcd) async fn end_tenure(
    pool: &Pool,
    kv: &KeyValue,
) -> Result<bool, etcd_client::Error> {
    delete_seen(pool, kv, false).await
}

/// The line the head says once about a holder whose lease a look found within its stop
/// budget before it ended.
pub(in crate::lock::etcd) fn proven_line(label: &str, kv: &KeyValue, proof: &Proof) -> String {
    let value = TenureValue::parse(kv);
    let holder = value.as_ref().and_then(|v| Holder::parse(&v.holder));
    let budget = value.map_or(0.0, |v| v.stop_budget().as_secs_f64());
    format!(
        "== {label}: its last holder, {}, lost its lease without releasing the lock; at {} \
         etcd's leader gave its lease under {} s, within its {budget:.1} s stop budget, so it \
         was stopping its command by then: the lock is taken {:.1} s from now, when that lease \
         had run out ==",
        Holder::describe(holder.as_ref()),
        humantime::format_rfc3339_millis(proof.at),
        proof.left_s + 1,
        proof
            .gone_by
            .saturating_duration_since(tokio::time::Instant::now())
            .as_secs_f64()
    )
}

/// The line a waiter says once about a holder that lost its lease without a release.
pub(in crate::lock::etcd) fn lapsed_line(
    label: &str,
    value: &TenureValue,
    fallback_ttl: Duration,
) -> String {
    let holder = Holder::parse(&value.holder);
    format!(
        "== {label}: its last holder, {}, lost its lease without releasing the lock (cut off, \
         stalled, killed, or its lease revoked): its command may run until its own clock says \
         the lease is at risk, so the lock is taken only once its lease TTL and stop budget, \
         {:.1} s, have passed since ==",
        Holder::describe(holder.as_ref()),
        value.wait_out(fallback_ttl).as_secs_f64()
    )
}
