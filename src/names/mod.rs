//! Names: every string that comes from outside is validated here, and every name derived from
//! them (app domain, stack name, lock file name) is computed here and nowhere else.
//!
//! Invariant: a domain [`AppDomain::derive`] produces for a valid recipe always matches the
//! [`RunAppPattern`] of the same suffix, so the janitor can see every run's leftovers; and a stack
//! name maps back to exactly the domain it came from.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

#[cfg(feature = "etcd")]
pub(crate) mod etcd;
mod files;
mod given;
mod validated;
mod visible;

pub(crate) use files::*;
pub(crate) use given::*;
pub(crate) use validated::*;
pub(crate) use visible::*;

#[cfg(test)]
mod tests;
