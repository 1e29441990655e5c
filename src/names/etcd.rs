//! Where the fleet's locks live in etcd. Each lock is a directory of keys,
//! `<prefix><kind>/<name>/`, holding `owner` (the holder's line; its create revision, above the
//! lineage's base, is the fencing token), `tenure/<lease id>` (the holder's, until it has ended)
//! and `queue/<lease id>` (one per waiter), every key bound to its writer's lease. Beside the
//! lock directories: the lineage record (no lease) and, for a while after a lineage begins, the
//! settling key.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

pub(crate) const PREFIX: &str = "/ccci-run/";
/// The lock lineage: the base of every fencing token, and the cluster it was begun on.
pub(crate) const LINEAGE: &str = "/ccci-run/lineage";
/// Present (bound to a lease that nobody renews) for one lease TTL after a lineage began.
pub(crate) const SETTLING: &str = "/ccci-run/settling";
/// The kinds of lock under [`PREFIX`].
pub(crate) const APP: &str = "app";
pub(crate) const NAMED: &str = "named";

/// The key directory of one lock in etcd.
pub(crate) fn lock_dir(kind: &str, name: &str) -> String {
    format!("{PREFIX}{kind}/{name}/")
}

/// The owner key in a lock's key directory.
pub(crate) fn owner_key(lock_dir: &str) -> String {
    format!("{lock_dir}owner")
}

/// The prefix of the waiters' keys in a lock's key directory.
pub(crate) fn queue_prefix(lock_dir: &str) -> String {
    format!("{lock_dir}queue/")
}

/// The fleet record: the longest lease TTL and stop budget any host of the fleet uses.
pub(crate) const FLEET: &str = "/ccci-run/fleet";
/// Where the holders' tenure keys live: beside the locks' directories, not in them, so that
/// deleting one lock's directory by hand cannot end the tenure of a holder that may still
/// be stopping its command.
pub(crate) const TENURE: &str = "tenure";

/// The prefix of the holders' tenure keys of the lock whose key directory is `lock_dir`:
/// `/ccci-run/tenure/<kind>/<name>/`.
pub(crate) fn tenure_prefix(lock_dir: &str) -> String {
    let rest = lock_dir.strip_prefix(PREFIX).unwrap_or(lock_dir);
    format!("{PREFIX}{TENURE}/{rest}")
}

/// Where tenure keys were kept before they moved out of the lock's directory: still read
/// (and waited for), so that a holder of an older version is never looked past.
pub(crate) fn legacy_tenure_prefix(lock_dir: &str) -> String {
    format!("{lock_dir}tenure/")
}

/// A holder's tenure key: one per lease and lock.
pub(crate) fn tenure_key(lock_dir: &str, lease: i64) -> String {
    format!("{}{lease:016x}", tenure_prefix(lock_dir))
}

/// A waiter's key: one per lease and lock.
pub(crate) fn queue_key(lock_dir: &str, lease: i64) -> String {
    format!("{lock_dir}queue/{lease:016x}")
}

/// Split a key under [`PREFIX`] into its lock's kind, its lock's name and the rest
/// (`owner`, `queue/<lease>`, and for a tenure key, wherever it lives, `<lease>`).
pub(crate) fn key_parts(key: &str) -> Option<(&str, &str, &str)> {
    let rest = key.strip_prefix(PREFIX)?;
    let rest = rest
        .strip_prefix(TENURE)
        .and_then(|r| r.strip_prefix('/'))
        .unwrap_or(rest);
    let (kind, rest) = rest.split_once('/')?;
    let (name, rest) = rest.split_once('/')?;
    Some((kind, name, rest.strip_prefix("tenure/").unwrap_or(rest)))
}

/// Whether `key` is a tenure key (in the tenure tree, or where older versions kept it).
pub(crate) fn is_tenure(key: &str) -> bool {
    let Some(rest) = key.strip_prefix(PREFIX) else {
        return false;
    };
    let mut parts = rest.splitn(4, '/');
    matches!(
        (parts.next(), parts.next(), parts.next(), parts.next()),
        (Some(TENURE), Some(_), Some(_), Some(_)) | (Some(_), Some(_), Some("tenure"), Some(_))
    )
}
