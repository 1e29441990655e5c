//! The line in front of an etcd lock: a lock directory read at one revision ([`Snapshot`]),
//! what stands between a waiter and the lock ([`Obstacle`]), joining the line, the claim, and
//! the wait on the runtime for our turn ([`wait_turn`], watched by the signal funnel through
//! [`PendingTake`]). This file is the door: the snapshot and what it says are `snapshot`, the
//! claim and a holder's lapse `claim`, the release that hands the lock to the head waiter
//! `handover`, the head's looks at its holder's lease `look`, the wait for our turn `turn`.
//!
//! Only keys bound to a lease count: a key that ccci-run always binds to one, found without
//! (written by hand with `etcdctl put`), is junk. Waiters and claims look past it, `locks`
//! shows it, the janitor removes it; an owner key that is junk is removed by the claim that
//! finds it. A claim also waits for every tenure key (a holder that lost its owner key but has
//! not ended yet, whose command may still act) and for a settling lineage.

mod claim;
mod handover;
mod look;
mod snapshot;
mod turn;

pub(super) use claim::*;
pub(super) use handover::*;
pub(super) use snapshot::*;
pub(super) use turn::*;
