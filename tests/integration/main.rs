//! The integration suite: the real `ccci-run` binary against real processes, signals and flocks.
// The boundaries in clippy.toml are the crate's: a test stands in for the world around it,
// makes directories and cgroups of its own and prints what it measured.
#![allow(clippy::disallowed_methods, clippy::disallowed_macros)]

mod app_lock;
mod bad_input;
mod chaos;
mod cli;
mod closed_output;
mod config_file;
mod converge;
mod docker;
mod docker_host;
mod doctor;
mod drone;
#[cfg(feature = "etcd")]
mod etcd;
mod etcd_cluster;
mod fetch;
mod hostile;
mod identity;
mod janitor;
mod layers;
mod lifetime;
mod limits;
mod multinode;
mod named_lock;
#[cfg(feature = "etcd")]
mod netfleet;
mod nixos;
mod output_escapes;
#[cfg(feature = "etcd")]
mod partition;
mod reaped;
mod recipe_names;
mod retention;
mod run_dirs;
mod run_exit;
mod run_guards;
mod run_signals;
mod runner_user;
mod runs_stop;
mod shipping;
mod steer;
mod stop_proof;
mod systemd_host;
mod util;
