//! Locks: what serialises runs of one app domain, users of one named host resource, and what
//! the janitor probes to tell a live run from a dead one.
//!
//! - [`file`](mod@file): lock files and the only `flock` calls in the crate (clippy enforces it), with
//!   the flopen-style identity check and the holder line.
//! - [`named`]: `ccci-run lock NAME`: a command run holding a named host lock.
//! - [`queue`]: the fair ticket queue in front of a named lock file.
//! - [`list`]: `ccci-run locks`, every lock file with its holder and age.
//! - [`backend`](mod@backend): the seam the run, the `lock` command, `locks` and the janitor hold a lock
//!   through — take it within an interruptible budget, try it, ask who holds it, release it,
//!   notice its loss — implemented on one host by the local flock ([`local`]).
//!
//! Nothing here may start a process, touch Docker or remove an app: a lock only says who may.
//!
//! Floor: backends (docs/architecture.md): imports the floors below and the other backends, never a
//! command.

pub(crate) mod backend;
#[cfg(feature = "etcd")]
pub(crate) mod etcd;
pub(crate) mod file;
pub(crate) mod file_lease;
pub(crate) mod holder;
pub(crate) mod list;
pub(crate) mod local;
pub(crate) mod queue;

pub(crate) use file::*;
pub(crate) use holder::*;

/// The lock backend the configuration names: etcd when endpoints are set (and reachable: an
/// unreachable etcd is an error, never a fallback to the flock, which would exclude nobody on
/// another host), else this host's flock.
pub(crate) fn backend(
    global: &crate::config::Global,
) -> Result<Box<dyn backend::LockBackend>, LockError> {
    match &global.etcd {
        #[cfg(feature = "etcd")]
        Some(settings) => Ok(Box::new(etcd::Etcd::connect(settings)?)),
        #[cfg(not(feature = "etcd"))]
        Some(_) => Err(LockError::NoEtcd),
        None => Ok(Box::new(local::Local::new(
            &global.lock_dir,
            &global.runs_dir,
            &global.pattern,
        ))),
    }
}

#[cfg(all(test, not(feature = "etcd")))]
mod tests {
    use super::*;

    #[test]
    fn etcd_endpoints_without_the_etcd_backend_are_an_error_not_a_flock() {
        let suffix = crate::names::DomainSuffix::parse("ci.example.org").unwrap();
        let global = crate::config::Global {
            lock_dir: "/nonexistent/locks".into(),
            abra_home: "/nonexistent/abra".into(),
            runs_dir: "/nonexistent/runs".into(),
            state_dir: "/nonexistent/state".into(),
            pattern: crate::names::RunAppPattern::new(&suffix),
            suffix,
            docker: crate::config::DockerMode::Off,
            docker_host: None,
            runner: None,
            cgroup: crate::config::CgroupMode::Off,
            etcd: Some(crate::config::EtcdSettings {
                endpoints: vec!["http://127.0.0.1:2379".into()],
                lease_ttl: std::time::Duration::from_secs(10),
            }),
            timings: crate::config::Timings::default(),
            recipe_url_template: None,
            node_sweep: crate::config::NodeSweepSettings::default(),
        };
        let err = backend(&global).err().expect("no fallback to the flock");
        assert!(err.to_string().contains("--features etcd"), "{err}");
    }
}
