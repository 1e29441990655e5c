//! A held lock watches its own keys: a lock can be lost behind its holder's back in more ways
//! than a lease running out, and a holder that goes on after that acts beside the next one.
//!
//! The guard of a held lock is a task on the runtime that says "lost" (once, with why) as soon
//! as any of these is seen:
//! - the owner key deleted or replaced (by hand, or by a restore of data from before the
//!   claim), or the lineage record changed: a watch on both reports it as it happens;
//! - an answer from another cluster, or a revision below the claim's own (the cluster was wiped
//!   and started again, or restored from an older snapshot): a read checks it whenever the
//!   watch is set up again (a wipe breaks every connection) and every [`RECHECK_EVERY`] (a
//!   member that stops answering leaves a watch silent);
//! - the lease lost, as its keepalive tells.
//!
//! A holder that sees the cluster go back in time also begins a new lineage, so that a token
//! handed out from then on is above its own (see [`super::lineage`]).

use std::io::Write as _;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, Txn, TxnOp, TxnOpResponse, WatchOptions};
use tokio::sync::watch;

use super::client::{ATTEMPT_TIMEOUT, Pool, RETRY_PAUSE};
use super::lineage;
use super::queue::{Claimed, RECHECK_EVERY};
use crate::names::etcd as keys;
use crate::report;

/// The lock a guard watches.
pub(super) struct Watched {
    pub(super) pool: Arc<Pool>,
    pub(super) owner: String,
    pub(super) lease: i64,
    pub(super) claimed: Claimed,
    /// The lease TTL: how long a lineage begun here settles.
    pub(super) ttl: Duration,
}

/// Why the lock is not ours any more.
struct Loss {
    why: String,
    /// The cluster went back in time below our claim: a new lineage must begin.
    rewound: bool,
}

impl Loss {
    fn new(why: String) -> Self {
        Self {
            why,
            rewound: false,
        }
    }
}

/// Watch `watched` until it is lost, or the session's lease is (`session_lost` says why); then
/// say so and write to `notify`.
pub(super) async fn guard(
    watched: Watched,
    mut session_lost: watch::Receiver<Option<String>>,
    mut notify: UnixStream,
) {
    let loss = tokio::select! {
        loss = watch_keys(&watched) => loss,
        why = session_lost.wait_for(Option::is_some) => Loss::new(match why {
            Ok(why) => format!("its lease: {}", why.as_deref().unwrap_or("lost")),
            Err(_) => "its lease is no longer kept alive".to_owned(),
        }),
    };
    report::line(&format!(
        "== etcd: the lock {} was lost: {} ==",
        watched.owner, loss.why
    ));
    let _ = notify.write_all(&[1]);
    if loss.rewound {
        rewind_lineage(&watched).await;
    }
}

/// Until the lock is lost: verify it by a read, watch its keys from there, read again when the
/// watch ends or falls silent.
async fn watch_keys(w: &Watched) -> Loss {
    loop {
        let seen = match verify(w).await {
            Ok(Ok(revision)) => revision,
            Ok(Err(loss)) => return loss,
            Err(_) => {
                // Nobody answers: the keepalive decides when that has gone on too long.
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
        };
        let options = WatchOptions::new().with_start_revision(seen + 1);
        let (at, mut client) = w.pool.current();
        let watching = async {
            let mut stream = client
                .watch(w.owner.as_str(), Some(options.clone()))
                .await?;
            stream.watch(keys::LINEAGE, Some(options)).await?;
            Ok::<_, etcd_client::Error>(stream)
        };
        let mut stream = match tokio::time::timeout(ATTEMPT_TIMEOUT, watching).await {
            Ok(Ok(stream)) => stream,
            _ => {
                w.pool.fail_over(at);
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
        };
        let mut recheck = tokio::time::Instant::now() + RECHECK_EVERY;
        loop {
            tokio::select! {
                answer = stream.message() => match answer {
                    Ok(Some(resp)) => {
                        if let Some(event) = resp.events().first() {
                            let revision = event.kv().map_or(0, |kv| kv.mod_revision());
                            let on_owner = event
                                .kv()
                                .is_some_and(|kv| kv.key() == w.owner.as_bytes());
                            return Loss::new(match (on_owner, event.event_type()) {
                                (true, EventType::Delete) => format!(
                                    "its owner key was deleted at revision {revision} (by hand, \
                                     or its lease ended)"
                                ),
                                (true, EventType::Put) => format!(
                                    "its owner key was replaced at revision {revision} (by hand?)"
                                ),
                                (false, _) => format!(
                                    "the lock lineage {} changed at revision {revision}",
                                    keys::LINEAGE
                                ),
                            });
                        }
                        if resp.canceled() {
                            // Compacted past our start, or the member lost its leader: read
                            // again and watch from there.
                            break;
                        }
                    }
                    Ok(None) | Err(_) => {
                        w.pool.fail_over(at);
                        tokio::time::sleep(RETRY_PAUSE).await;
                        break;
                    }
                },
                () = tokio::time::sleep_until(recheck) => {
                    if let Ok(Err(loss)) = verify(w).await {
                        return loss;
                    }
                    recheck = tokio::time::Instant::now() + RECHECK_EVERY;
                }
            }
        }
    }
}

/// Read the owner key and the lineage: the revision read at while the lock is ours, else why
/// it is not. `Err`: no member answered.
async fn verify(w: &Watched) -> Result<Result<i64, Loss>, etcd_client::Error> {
    let txn = Txn::new().and_then([
        TxnOp::get(w.owner.as_str(), None),
        TxnOp::get(keys::LINEAGE, None),
    ]);
    let response = w.pool.txn(&txn).await?;
    let (revision, cluster) = response
        .header()
        .map_or((0, 0), |h| (h.revision(), h.cluster_id()));
    let claimed = &w.claimed;
    if cluster != claimed.cluster {
        return Ok(Err(Loss::new(format!(
            "etcd cluster {cluster:x} answers, not {:x} that granted it (the cluster was \
             replaced)",
            claimed.cluster
        ))));
    }
    if revision < claimed.revision {
        return Ok(Err(Loss {
            why: format!(
                "etcd went back in time: its revision {revision} is below the lock's own \
                 {} (the cluster was wiped, or restored from an older snapshot)",
                claimed.revision
            ),
            rewound: true,
        }));
    }
    let mut gets = response.op_responses().into_iter().map(|op| match op {
        TxnOpResponse::Get(get) => get.kvs().first().cloned(),
        _ => None,
    });
    let (owner, record) = (gets.next().flatten(), gets.next().flatten());
    let loss = match owner {
        None => Some("its owner key is gone (deleted by hand, or data from before the claim)"),
        Some(kv) if kv.mod_revision() != claimed.revision || kv.lease() != w.lease => {
            Some("its owner key is another's now (replaced)")
        }
        Some(_) => None,
    };
    if let Some(why) = loss {
        return Ok(Err(Loss::new(why.to_owned())));
    }
    match record {
        Some(kv) if kv.mod_revision() == claimed.lineage.mod_revision => Ok(Ok(revision)),
        _ => Ok(Err(Loss::new(format!(
            "the lock lineage {} changed",
            keys::LINEAGE
        )))),
    }
}

/// The cluster went back in time below our claim: begin a new lineage above our token, unless
/// the lineage is already another than ours (a wiped cluster has none: the next claim begins
/// one).
async fn rewind_lineage(w: &Watched) {
    let Ok(response) = w
        .pool
        .call(|mut c| async move { c.get(keys::LINEAGE, None).await })
        .await
    else {
        return;
    };
    let cluster = response.header().map_or(0, |h| h.cluster_id());
    let kv = response.kvs().first();
    if lineage::State::of(kv, cluster).valid().map(|l| l.base) != Some(w.claimed.lineage.base) {
        return;
    }
    let floor = w.claimed.token().saturating_add(1);
    let why = "its revisions went back below those of a lock held here (restored from an older \
               snapshot)";
    let mod_revision = kv.map_or(0, |kv| kv.mod_revision());
    if let Ok(Some(line)) = lineage::begin(&w.pool, cluster, w.ttl, why, mod_revision, floor).await
    {
        report::line(&line);
    }
}
