//! The Docker seam: discovery of run-app stacks and removal of one stack, through bollard.
//!
//! This folder is the only code that talks to the engine (clippy keeps the bollard client here)
//! and holds its retry policy ([`backoff`]) and the choice of engine ([`endpoint`]: exactly the
//! one `DOCKER_HOST` names, over a Unix socket, TCP or TLS). It must never decide what to
//! reap: callers hand it the stacks whose locks they hold.
//!
//! Split by concern: `seam` is the connection itself and the words the rest share; `discover`
//! finds every run-app stack's resources, one list call per kind however many stacks there are;
//! `remove` deletes them, idempotently and in the order that never waits on swarm; `confirm`
//! asks again until the engine lists nothing of a stack, and [`nodes`] sweeps the other nodes
//! of a swarm with the job of [`node_job`] ([`node_probe`]: the nodes out of service). Only API 1.41 (Docker 20.10) endpoints are
//! used; the version is negotiated.
//!
//! [`swarm`] reads one stack's services, tasks and nodes for `converge`, three list calls at most.
//!
//! Floor: backends (docs/architecture.md): imports the floors below and the other backends, never a
//! command.
#![allow(clippy::disallowed_types)]

pub(crate) mod backoff;
mod confirm;
mod discover;
pub(crate) mod endpoint;
pub(crate) mod node_job;
pub(crate) mod node_probe;
pub(crate) mod nodes;
mod remove;
mod seam;
pub(crate) mod swarm;

pub(crate) use confirm::Reaped;
pub(crate) use endpoint::Endpoint;
pub(crate) use remove::RemovedNames;
pub(crate) use seam::*;
