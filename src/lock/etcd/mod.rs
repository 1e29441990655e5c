//! Locks beyond one host: etcd keeps them, as keys bound to leases (`--etcd-endpoints`).
//!
//! A lease is etcd's answer to "the kernel releases a flock when its holder dies": every key a
//! process writes is bound to the one lease it keeps alive, so when the process dies (or is cut
//! off from etcd for the lease's TTL) its keys vanish and its locks are free. Each lock is a key
//! directory (see [`crate::names::etcd`]):
//!
//! - `queue/<lease>`: a waiter. Waiters are served fast class first, then by the revision that
//!   created their key (FIFO across the fleet); a normal waiter that waited past
//!   `--promote-after` rewrites its key as fast and keeps its place.
//! - `owner`: the holder's line. Only the head waiter may create it, in one transaction that
//!   also requires it absent and removes the waiter's key; or a holder's release writes it for
//!   the head waiter, bound to the head's lease ([`queue::hand_over`]). The revision that last
//!   wrote it, above the lineage's base ([`lineage`]), is the lock's **fencing token**: larger
//!   for every later holder, cluster-wide, and across a wipe or a restore of the cluster.
//! - `tenure/<lease>`: written with the owner key, removed by the holder's own release only,
//!   once its command has ended. A holder whose owner key went behind its back (deleted by
//!   hand) keeps it until it has torn down; no claim is made while one lives, so the next
//!   holder never starts beside a command that may still act.
//!
//! A waiter waits on a watch (no polling) of the one key whose change can make it the owner:
//! what stands in the head's way, the waiter just ahead for anyone else; it re-reads the
//! directory when that key changes. Keys found without a lease are junk, looked past
//! ([`queue`]). A held lock watches its own keys ([`guard`]) and its lease's keepalive; a loss
//! of either turns [`Lease::lost_fd`] readable, which the holder's signal funnel turns into a
//! teardown (`lock-lost`, exit 76) at once.
//!
//! Nothing here falls back to the local flock: an unreachable etcd is an error, since a flock
//! would exclude nobody on another host.
//!
//! The parts: [`client`] (the runtime and the members asked in turn), [`lease`] (this
//! process's lease, its keepalive, a held lock), [`guard`] (what a held lock watches),
//! [`queue`] (a lock directory as read, the line and the claim), [`lineage`] (the base of the
//! fencing tokens); this file is the backend the users hold.

mod client;
mod fleet;
mod guard;
pub(crate) mod health;
mod lease;
mod lineage;
mod queue;
mod tidy;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, GetOptions, KeyValue, SortOrder, SortTarget};

use crate::config::{Class, EtcdSettings};
use crate::lock::backend::{Attempt, LockBackend, LockKey, PROGRESS_EVERY, Taken, Wait};
use crate::lock::backend::{LockInfo, LockKind};
use crate::lock::file::LockError;
use crate::lock::holder::Holder;
use crate::names::AppDomain;
use crate::names::etcd as keys;
use crate::report;
use crate::supervise::signals::Awaited;

use client::{ATTEMPT_TIMEOUT, Driver, Pool, REQUEST_TIMEOUT, Shared};
use queue::{Obstacle, PendingTake, Snapshot, Turn, WaiterValue, wait_turn, waiting_line};

/// Locks as etcd keys bound to this process's lease.
pub(crate) struct Etcd {
    shared: Arc<Shared>,
}

impl Etcd {
    /// Set up a client of `settings.endpoints`; whether one of them answers is for
    /// [`LockBackend::prepare`] to find out.
    pub(crate) fn connect(settings: &EtcdSettings) -> Result<Self, LockError> {
        let endpoints = settings.endpoints.join(",");
        let fail = |what: &str, detail: String| LockError::Etcd {
            endpoints: endpoints.clone(),
            what: what.to_owned(),
            detail,
        };
        let addresses = client::resolve(&settings.endpoints)
            .map_err(|detail| fail("resolve the endpoints' host names", detail))?;
        let driver = Driver::start().map_err(|(what, detail)| fail(what, detail))?;
        let handle = driver.handle.clone();
        let options = ConnectOptions::new()
            .with_connect_timeout(ATTEMPT_TIMEOUT)
            .with_keep_alive(Duration::from_secs(1), Duration::from_secs(1))
            // A member cut off from the others refuses at once instead of waiting.
            .with_require_leader(true);
        let clients = handle
            .block_on(async {
                let mut clients = Vec::new();
                for endpoint in &addresses {
                    // One endpoint per client: connects lazily, so a member that is down now
                    // is only skipped.
                    clients.push(Client::connect([endpoint], Some(options.clone())).await?);
                }
                Ok::<_, etcd_client::Error>(clients)
            })
            .map_err(|e| fail("connect", e.to_string()))?;
        Ok(Self {
            shared: Arc::new(Shared {
                handle,
                driver: Some(driver),
                pool: Arc::new(Pool {
                    clients,
                    next: AtomicUsize::new(0),
                }),
                endpoints,
                ttl: settings.lease_ttl,
                session: Mutex::new(None),
                host: nix::unistd::gethostname()
                    .map(|h| h.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                stop_budget: Arc::new(std::sync::atomic::AtomicU64::new(
                    u64::try_from(crate::config::KILL_MARGIN.as_nanos()).unwrap_or(u64::MAX),
                )),
            }),
        })
    }
}

/// Which lock, as keys.
fn lock_dir(key: LockKey<'_>) -> String {
    match key {
        LockKey::App(domain) => keys::lock_dir(keys::APP, domain.as_str()),
        LockKey::Named(name) => keys::lock_dir(keys::NAMED, name.as_str()),
    }
}

impl LockBackend for Etcd {
    fn describe(&self, key: LockKey<'_>) -> String {
        format!("etcd key {}", keys::owner_key(&lock_dir(key)))
    }

    /// Whether etcd answers: a lock kept in an etcd nobody can reach protects nothing.
    fn prepare(&self, _create: bool) -> Result<(), LockError> {
        self.shared
            .block_on(
                "reach any endpoint",
                REQUEST_TIMEOUT,
                self.shared
                    .pool
                    .call(|mut c| async move { c.status().await }),
            )
            .map(drop)
    }

    fn describe_store(&self) -> String {
        format!("etcd at {}", self.shared.endpoints)
    }

    fn missing_store(&self) -> Option<String> {
        None
    }

    fn try_take(&self, key: LockKey<'_>, create: bool) -> Result<Attempt, LockError> {
        let dir = lock_dir(key);
        let held = |holder: Option<Holder>| Attempt::Held {
            age: holder.as_ref().and_then(tidy::age_of),
            holder,
            note: None,
        };
        // A junk owner key, or a lineage that must begin, is dealt with and the lock read
        // again; more than that in one try is someone else's doing (they may hold it).
        for _ in 0..3 {
            let snap = queue::read_snapshot(&self.shared, &dir)?;
            let obstacle = snap.obstacle(None);
            match &obstacle {
                Some(Obstacle::Tenure(kv)) if create && kv.lease() == 0 => {
                    // A holder whose lease expired: its stop budget begins now (a look only
                    // looks).
                    let who = self.shared.who();
                    let lapsed = self.shared.block_on(
                        "look at the lock's last holder",
                        REQUEST_TIMEOUT,
                        queue::lapse(&self.shared.pool, kv, &who, self.shared.ttl),
                    )?;
                    if let queue::Tenure::Lapsed(value) = lapsed {
                        report::line(&queue::lapsed_line(
                            &self.describe(key),
                            &value,
                            self.shared.ttl,
                        ));
                    }
                    return Ok(held(snap.holder()));
                }
                Some(Obstacle::Owner(_) | Obstacle::Tenure(_)) => return Ok(held(snap.holder())),
                // A live waiter is about to take it (its key lives only as long as its lease).
                Some(Obstacle::Ahead(_)) => {
                    let waiter = snap.queue.first().and_then(|(_, v)| v.as_ref());
                    return Ok(Attempt::Held {
                        age: None,
                        holder: waiter.map(|v| v.holder.clone()),
                        note: None,
                    });
                }
                _ if !create => return Ok(Attempt::Missing),
                // Held back while a new lineage settles: nothing is taken (a holder under the
                // old data may still be ending).
                Some(Obstacle::Settling(_)) => return Ok(held(None)),
                Some(obstacle) => {
                    self.shared.block_on(
                        "clear the way to the lock",
                        REQUEST_TIMEOUT,
                        queue::clear(&self.shared.pool, &snap, obstacle, self.shared.ttl),
                    )?;
                }
                None => {
                    let session = lease::session(&self.shared)?;
                    let line = Holder::this_process("").to_line();
                    let claimed = self.shared.block_on(
                        "take the lock",
                        REQUEST_TIMEOUT,
                        queue::claim(
                            &self.shared.pool,
                            &dir,
                            &snap,
                            false,
                            None,
                            session.id,
                            &line,
                            self.shared.ttl,
                            self.shared.stop_budget(),
                        ),
                    )?;
                    return match claimed {
                        Some(claimed) => Ok(Attempt::Taken {
                            lease: lease::lease(&self.shared, session, &dir, claimed)?,
                            current: true,
                        }),
                        None => Ok(held(None)),
                    };
                }
            }
        }
        Ok(held(None))
    }

    fn take(
        &self,
        key: LockKey<'_>,
        wait: &Wait<'_>,
        on_wait: &mut dyn FnMut(Option<&Holder>, Duration),
    ) -> Result<Taken, LockError> {
        let dir = lock_dir(key);
        self.shared.need_stop_budget(wait.stop_budget);
        let session = lease::session(&self.shared)?;
        let started = Instant::now();
        let value = WaiterValue {
            holder: wait.holder.clone(),
            class: wait.class,
            terms: Some(fleet::Bound::of(self.shared.ttl, self.shared.stop_budget())),
        };
        let (waiter, claimed, snap) = queue::enqueue(&self.shared, &session, &dir, &value)?;
        let ticket = snap
            .queue
            .iter()
            .find(|(kv, _)| kv.key() == waiter.as_bytes())
            .map_or(0, |(kv, _)| kv.create_revision());
        if let Some(claimed) = claimed {
            return Ok(Taken::Held(lease::lease(
                &self.shared,
                session,
                &dir,
                claimed,
            )?));
        }
        let say_where = |snap: &Snapshot| {
            if let LockKey::Named(name) = key {
                report::line(&waiting_line(name, snap, &waiter, ticket, wait));
            }
        };
        // Held back for a lineage that begins (it says so itself), not by a holder: nobody to
        // name as the holder.
        if !snap.settles() {
            on_wait(snap.holder().as_ref(), Duration::ZERO);
            say_where(&snap);
        }
        let promote = (wait.class == Class::Normal)
            .then(|| started.checked_add(wait.promote_after))
            .flatten()
            .map(|at| {
                let fast = WaiterValue {
                    class: Class::Fast,
                    ..value.clone()
                };
                let line = serde_json::to_string(&fast).expect("a waiter always serialises");
                (tokio::time::Instant::from_std(at), line)
            });
        let (ready, notify) = UnixStream::pair().map_err(|e| self.shared.error("wait", e))?;
        let (tx, rx) = mpsc::channel();
        let task = self.shared.handle.spawn({
            let work = wait_turn(
                self.shared.pool.clone(),
                Turn {
                    dir: dir.clone(),
                    waiter: waiter.clone(),
                    lease: session.id,
                    holder_line: wait.holder.to_line(),
                    waiter_line: serde_json::to_string(&value).expect("a waiter always serialises"),
                    promote,
                    ttl: self.shared.ttl,
                    label: self.describe(key),
                    stop_budget: self.shared.stop_budget(),
                    who: self.shared.who(),
                    expiry: session.expiry.clone(),
                },
            );
            let mut notify = notify;
            async move {
                let outcome = work.await;
                let _ = tx.send(outcome);
                let _ = notify.write_all(&[1]);
            }
        });
        let pending = PendingTake {
            shared: self.shared.clone(),
            dir: dir.clone(),
            waiter: waiter.clone(),
            lease: session.id,
            ready,
            outcome: rx,
            task,
        };
        let shared = &self.shared;
        let mut progress = || {
            let snap = queue::read_snapshot(shared, &dir).ok();
            if let Some(snap) = &snap {
                say_where(snap);
            }
            on_wait(snap.and_then(|s| s.holder()).as_ref(), started.elapsed());
        };
        let keepalive: Option<(Duration, &mut dyn FnMut())> = Some((PROGRESS_EVERY, &mut progress));
        let lost = wait.funnel.await_work(pending, wait.until, keepalive);
        match lost {
            Awaited::Done(Ok(claimed)) => Ok(Taken::Held(lease::lease(
                &self.shared,
                session,
                &dir,
                claimed,
            )?)),
            Awaited::Done(Err(why)) => Err(self.shared.error("wait for the lock", why)),
            Awaited::Stopped(event) => Ok(Taken::Stopped(event)),
            Awaited::TimedOut => Ok(Taken::TimedOut {
                waited: started.elapsed(),
                lock: match key {
                    LockKey::App(_) => self.describe(key),
                    LockKey::Named(name) => name.to_string(),
                },
                detail: queue::timed_out_detail(&self.shared, key, &dir, ticket, wait.class),
            }),
        }
    }

    fn is_held_by(&self, key: LockKey<'_>, pid: i32, token: &str) -> bool {
        let Some((lease, revision)) = token
            .strip_prefix("etcd:")
            .and_then(|t| t.split_once(':'))
            .and_then(|(l, r)| Some((i64::from_str_radix(l, 16).ok()?, r.parse::<i64>().ok()?)))
        else {
            return false;
        };
        let Ok(snap) = queue::read_snapshot(&self.shared, &lock_dir(key)) else {
            return false;
        };
        let (Some(owner), Some(holder)) = (snap.owner.as_ref(), snap.holder()) else {
            return false;
        };
        owner.lease() == lease
            && owner.mod_revision() == revision
            && i64::from(holder.pid) == i64::from(pid)
            && holder.host == self.shared.host
    }

    fn list(&self, long_held: Duration) -> std::io::Result<Vec<LockInfo>> {
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend);
        let response = self
            .shared
            .get("list the locks", keys::PREFIX, Some(options))
            .map_err(std::io::Error::other)?;
        let header = response
            .header()
            .map_or((0, 0), |h| (h.revision(), h.cluster_id()));
        let mut dirs: BTreeMap<(LockKind, String), Vec<&KeyValue>> = BTreeMap::new();
        for kv in response.kvs() {
            let Some((kind, name, _)) =
                std::str::from_utf8(kv.key()).ok().and_then(keys::key_parts)
            else {
                continue;
            };
            let kind = match kind {
                keys::APP => LockKind::App,
                keys::NAMED => LockKind::Named,
                _ => continue,
            };
            dirs.entry((kind, name.to_owned())).or_default().push(kv);
        }
        let mut found = Vec::new();
        for ((kind, name), kvs) in dirs {
            let dir = keys::lock_dir(
                match kind {
                    LockKind::App => keys::APP,
                    LockKind::Named => keys::NAMED,
                },
                &name,
            );
            // The lineage does not matter to a listing.
            let snap = Snapshot::of(&dir, header, kvs, None, None);
            found.push(tidy::describe_lock(&snap, &dir, kind, &name, long_held));
        }
        Ok(found)
    }

    fn tidy(
        &self,
        _keep: &dyn Fn(&AppDomain) -> bool,
        dry_run: bool,
    ) -> (Vec<PathBuf>, Vec<String>) {
        // Keys go with their leases: what is left is only what was written without one.
        let (mut tidied, mut errors) = (Vec::new(), Vec::new());
        let junk = match tidy::junk(&self.shared) {
            Ok(junk) => junk,
            Err(err) => {
                errors.push(format!("failed to look for junk keys: {err}"));
                return (tidied, errors);
            }
        };
        if !dry_run {
            tidy::lapse_tenures(&self.shared, &mut errors);
        }
        for kv in junk {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            if dry_run {
                tidied.push(PathBuf::from(key));
                continue;
            }
            let removed = self.shared.block_on(
                "remove a junk key",
                REQUEST_TIMEOUT,
                queue::remove_junk(&self.shared.pool, &kv),
            );
            match removed {
                Ok(true) => {
                    report::line(&format!(
                        "== janitor: removed etcd key {key}, written without a lease (by hand?) =="
                    ));
                    tidied.push(PathBuf::from(key));
                }
                // Changed meanwhile: whoever wrote it again is for the next sweep to see.
                Ok(false) => {}
                Err(err) => errors.push(format!("failed to remove etcd key {key}: {err}")),
            }
        }
        (tidied, errors)
    }
}
