//! What the janitor's sweep and `locks` do in etcd beyond the seam: a holder cut off without a
//! release begins its stop budget, keys written without a lease are found, and each lock is
//! described as `locks` shows it.
//!
//! Floor: backends (docs/architecture.md): imports the floors below and the other backends, never a
//! command.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use etcd_client::{GetOptions, KeyValue};

use crate::config::Class;
use crate::lock::backend::{LockInfo, LockKind};
use crate::lock::file::LockError;
use crate::lock::holder::Holder;
use crate::lock::queue::ticket::{QueuedTicket, Ticket};
use crate::names::etcd as keys;
use crate::report;

use crate::lock::etcd::client::{REQUEST_TIMEOUT, Shared};
use crate::lock::etcd::queue;
use crate::lock::etcd::queue::Snapshot;

/// Every tenure record whose holder's lease expired without a release begins its stop
/// budget now, on a lease of its own: so the keys of a holder that was cut off go by
/// themselves even when nobody waits for its lock.
pub(super) fn lapse_tenures(shared: &Shared, errors: &mut Vec<String>) {
    let response = match shared.get(
        "look for lapsed holders",
        keys::PREFIX,
        Some(GetOptions::new().with_prefix()),
    ) {
        Ok(response) => response,
        Err(err) => {
            errors.push(format!("failed to look for lapsed holders: {err}"));
            return;
        }
    };
    let who = shared.who();
    for kv in response.kvs() {
        let Some(key) = std::str::from_utf8(kv.key()).ok() else {
            continue;
        };
        let Some((kind, name, _)) = keys::key_parts(key) else {
            continue;
        };
        if kv.lease() != 0 || !keys::is_tenure(key) || queue::TenureValue::parse(kv).is_none() {
            continue;
        }
        let label = format!("etcd key {}", keys::owner_key(&keys::lock_dir(kind, name)));
        match shared.block_on(
            "look at a lock's last holder",
            REQUEST_TIMEOUT,
            queue::lapse(&shared.pool, kv, &who, shared.ttl),
        ) {
            Ok(queue::Tenure::Lapsed(value)) => {
                report::line(&queue::lapsed_line(&label, &value, shared.ttl));
            }
            Ok(_) => {}
            Err(err) => errors.push(format!("failed to look at {label}'s last holder: {err}")),
        }
    }
}

/// Every key under the prefix that ccci-run binds to a lease, found without one.
pub(super) fn junk(shared: &Shared) -> Result<Vec<KeyValue>, LockError> {
    let response = shared.get(
        "look for junk keys",
        keys::PREFIX,
        Some(GetOptions::new().with_prefix()),
    )?;
    let header = response
        .header()
        .map_or((0, 0), |h| (h.revision(), h.cluster_id()));
    let mut junk = Vec::new();
    let mut dirs: BTreeMap<String, Vec<&KeyValue>> = BTreeMap::new();
    for kv in response.kvs() {
        if kv.key() == keys::SETTLING.as_bytes() && kv.lease() == 0 {
            junk.push(kv.clone());
            continue;
        }
        let Some((kind, name, _)) = std::str::from_utf8(kv.key()).ok().and_then(keys::key_parts)
        else {
            continue;
        };
        if kind == keys::APP || kind == keys::NAMED {
            dirs.entry(keys::lock_dir(kind, name)).or_default().push(kv);
        }
    }
    for (dir, kvs) in dirs {
        junk.extend(Snapshot::of(&dir, header, kvs, None, None).junk);
    }
    Ok(junk)
}

/// One lock's line in `ccci-run locks`.
pub(super) fn describe_lock(
    snap: &Snapshot,
    dir: &str,
    kind: LockKind,
    name: &str,
    long_held: Duration,
) -> LockInfo {
    let holder = snap.holder();
    let age = holder.as_ref().and_then(age_of);
    let mut problems = Vec::new();
    if let (None, Some(kv)) = (&snap.owner, snap.tenures.first()) {
        problems.push(match queue::TenureValue::parse(kv) {
            Some(value) if kv.lease() != 0 => format!(
                "its holder lost its lease without releasing the lock: nobody else is let in \
                 until its lease TTL and stop budget, {:.1} s, have passed since that was found",
                value.wait_out(Duration::ZERO).as_secs_f64()
            ),
            _ => "its holder lost the owner key and has not ended yet (nobody else is let in \
                  until it has, or until its lease is found gone and its lease TTL and stop \
                  budget have passed since)"
                .to_owned(),
        });
    }
    if !snap.junk.is_empty() {
        let junk: Vec<String> = snap
            .junk
            .iter()
            .map(|kv| crate::names::escape_outside(kv.key()))
            .collect();
        problems.push(format!(
            "junk: {} without a lease (written by hand?): nobody's, ignored; the janitor \
             removes it",
            junk.join(", ")
        ));
    }
    LockInfo {
        path: PathBuf::from(keys::owner_key(dir)),
        kind,
        name: crate::names::escape_outside(name.as_bytes()),
        held: snap.owner.is_some() || !snap.tenures.is_empty(),
        holder_pids: holder
            .iter()
            .map(|h| i32::try_from(h.pid).unwrap_or(i32::MAX))
            .collect(),
        waiters: snap.queue.len(),
        holder_raw: match (&snap.owner, &holder) {
            (Some(kv), None) => Some(String::from_utf8_lossy(kv.value()).into_owned()),
            _ => None,
        },
        holder,
        age_s: age.map(|a| a.as_secs()),
        long_held: age.is_some_and(|a| a > long_held),
        problem: (!problems.is_empty()).then(|| problems.join("; ")),
        // Another host's holder: its liveness is etcd's lease, not a judgement of this one.
        holder_is: None,
        holder_unresolvable: None,
        queue: (kind == LockKind::Named).then(|| {
            snap.queue
                .iter()
                .map(|(kv, v)| QueuedTicket {
                    ticket: Ticket {
                        class: v.as_ref().map_or(Class::Normal, |v| v.class),
                        seq: kv.create_revision().unsigned_abs(),
                        pid: v
                            .as_ref()
                            .map_or(0, |v| i32::try_from(v.holder.pid).unwrap_or(0)),
                    },
                    age_s: v
                        .as_ref()
                        .and_then(|v| age_of(&v.holder))
                        .map_or(0, |a| a.as_secs()),
                })
                .collect()
        }),
    }
}

/// How long ago a holder line says it started.
pub(super) fn age_of(holder: &Holder) -> Option<Duration> {
    let since = humantime::parse_rfc3339_weak(&holder.started_at).ok()?;
    SystemTime::now().duration_since(since).ok()
}
