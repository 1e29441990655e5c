//! `ccci-run lock NAME`: run a command holding a fair, bounded, observable named host lock.
//!
//! The lock is taken through the lock backend (on one host: a ticket queue in front of a lock
//! file, [`crate::lock::queue`]); a command that runs `ccci-run lock NAME` again under a holder
//! is granted the lock its ancestor holds (`CCCI_HELD_LOCKS`) instead of waiting for itself.
//!
//! Invariant: the lock is released only by the process's exit, after the command's whole
//! process group (and cgroup) is gone; and the command starts only once whatever a previous
//! holder that died holding the lock left running is gone (or said to be out of reach).
//!
//! Its lock mechanics are the lock backend's (`lock/`); this room is the command around them.
//!
//! Floor: commands (docs/architecture.md): imports the floors below, never another command.

use std::cell::Cell;
use std::collections::VecDeque;
use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::time::{Duration, Instant};

use nix::unistd::Pid;

use crate::exit;
use crate::lock::backend::{LockBackend, LockKey, Taken, Wait, arm_fence, loss_watch, start_fence};
use crate::lock::{Holder, LockError};
use crate::names::LockName;
use crate::report;
use crate::supervise::fence::{self, Fence};
use crate::supervise::guards::{self, GuardOptions};
use crate::supervise::identity::{IdentityError, Owner};
use crate::supervise::process::CommandSpec;
use crate::supervise::shutdown::Event;
use crate::supervise::signals::SignalFunnel;
use crate::supervise::{Supervisor, cgroup};
use crate::supervise::{leftovers, linux};

/// The variable that carries the holder's fencing token to the command.
pub(crate) const FENCING_VAR: &str = "CCCI_FENCING_TOKEN";

/// The variable that carries the locks an ancestor holds: `NAME:PID:MAJOR:MINOR:INODE:DEPTH`,
/// comma-separated.
pub(crate) const HELD_VAR: &str = "CCCI_HELD_LOCKS";

#[derive(Debug, thiserror::Error)]
pub(crate) enum NamedLockError {
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error(
        "lock {name}: an ancestor (pid {pid}) says it holds it, but it no longer does; refusing to take it behind its back"
    )]
    StaleAncestor { name: LockName, pid: i32 },
    #[error("failed to set up signal handling: {0}")]
    Guards(String),
    #[error("failed to watch the lock for its loss: {0}")]
    LossWatch(std::io::Error),
    #[error(
        "failed to start the fence that kills the command should this process die (or the \
         lock's etcd lease expire): {0}; not starting the command without it"
    )]
    Fence(std::io::Error),
    #[error("failed to create runs dir {path} (it names this configuration): {source}")]
    RunsDir {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error(
        "lock {name}: failed to clear what its previous holder left: {why}; not starting the \
         command beside it"
    )]
    Predecessor { name: LockName, why: String },
}

impl From<NamedLockError> for crate::error::Error {
    fn from(err: NamedLockError) -> Self {
        Self::command(err, crate::exit::INTERNAL)
    }
}

pub(crate) type LockOptions = crate::config::LockConfig;

/// What the command above the lock does once the wait is over: `lock --metrics-file` writes
/// the host's metrics there (the janitor's report, which a backend does not know of). It may
/// not stop the command: a failure is its own warning.
pub(crate) type Publish<'a> = &'a dyn Fn(&dyn LockBackend);

/// Once the wait is over: record how long the holder waited (for whoever publishes metrics),
/// and publish. Neither may stop the command: a failure is a warning.
fn publish(
    backend: &dyn LockBackend,
    opts: &LockOptions,
    held: bool,
    waited: Duration,
    then: Publish<'_>,
) {
    if held {
        if let Err(err) =
            crate::lock::queue::wait::record_last_wait(&opts.lock_dir, &opts.name, waited)
        {
            tracing::warn!(
                "failed to record the wait for lock {} in {}: {err}",
                opts.name,
                opts.lock_dir.display()
            );
        }
    }
    then(backend);
}

/// Run `ccci-run lock`; returns the exit code.
pub(crate) fn run(
    backend: &dyn LockBackend,
    runs_dir: &Path,
    opts: &LockOptions,
    start_ppid: Pid,
    then: Publish<'_>,
) -> Result<u8, NamedLockError> {
    let span = tracing::error_span!("lock", name = %opts.name);
    let _in_lock = span.enter();
    let guards = GuardOptions {
        tie_to: opts.tie_to.clone(),
        ..GuardOptions::default()
    };
    let mut funnel = guards::install_guards(start_ppid, &guards)
        .map_err(|e| NamedLockError::Guards(e.to_string()))?;
    backend.prepare(true)?;
    // The runs dir names the configuration the command's processes belong to. Made in its
    // parent only: a missing parent is a setting to fix (`config::dirs`).
    match std::fs::DirBuilder::new().create(runs_dir) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(source) => {
            return Err(NamedLockError::RunsDir {
                path: runs_dir.to_owned(),
                source,
            });
        }
    }
    let owner = Owner::establish(runs_dir)?;
    // Made before the wait, so the holder line can name it.
    let cgroups = cgroup::run_cgroup(opts.cgroup, "lock", opts.name.as_str(), owner);
    let key = LockKey::Named(&opts.name);
    let mut held = HeldLocks::inherited(crate::config::env::var(HELD_VAR).unwrap_or_default());
    let fence;
    let unpublished = Unpublished {
        backend,
        opts,
        then,
        waited: Cell::new(None),
    };
    let lease = match held.grant(backend, &opts.name)? {
        // The command inherits the ancestor's token with the rest of its environment.
        Some(depth) => {
            tracing::info!(depth, "lock already held by an ancestor; granted");
            // No lock of its own to guard, but a dead-man all the same.
            let target = fence::Target {
                cgroup: cgroups.as_ref().map(|c| c.cgroup.path()),
                owner,
                label: &format!("lock {}", opts.name),
            };
            fence = Some(start_fence(&target).map_err(|e| {
                remove_cgroup(&opts.name, cgroups.as_ref());
                NamedLockError::Fence(e)
            })?);
            None
        }
        None => {
            let wait = Wait {
                // Inside a run, the run; elsewhere just the process. The line names our cgroup
                // and marker: should we die holding the lock, the next holder clears them.
                holder: &Holder::this_process(
                    &crate::config::env::var("CCCI_RUN_ID").unwrap_or_default(),
                )
                .with_cgroup(cgroups.as_ref().map(|c| c.cgroup.path())),
                funnel: &funnel,
                until: opts.wait.map(|w| Instant::now() + w),
                class: opts.class,
                promote_after: opts.promote_after,
                stop_budget: crate::config::EtcdSettings::stop_budget(opts.kill_grace),
            };
            let waiting_since = Instant::now();
            let taken = backend.take(key, &wait, &mut |_, _| {})?;
            let waited = waiting_since.elapsed();
            // A lock held is published once its command has been started (or has failed to
            // start), not between the handoff and the command; anything else at once.
            if matches!(taken, Taken::Held(_)) {
                unpublished.waited.set(Some(waited));
            } else {
                publish(backend, opts, false, waited, then);
            }
            match taken {
                Taken::Held(lease) => {
                    if let Some(fd) = loss_watch(&*lease).map_err(NamedLockError::LossWatch)? {
                        funnel.watch_loss(fd);
                    }
                    let target = fence::Target {
                        cgroup: cgroups.as_ref().map(|c| c.cgroup.path()),
                        owner,
                        label: &format!("lock {}", opts.name),
                    };
                    fence = Some(arm_fence(&*lease, &mut funnel, &target).map_err(|e| {
                        remove_cgroup(&opts.name, cgroups.as_ref());
                        NamedLockError::Fence(e)
                    })?);
                    let what = format!("lock {}", opts.name);
                    let until = Instant::now() + leftovers::KILL_BUDGET;
                    for before in lease.predecessors() {
                        let cleared =
                            leftovers::clear_predecessor(&before.predecessor(), owner, until);
                        if let Err(why) = cleared.report(&what, &Holder::describe(Some(&before))) {
                            remove_cgroup(&opts.name, cgroups.as_ref());
                            return Err(NamedLockError::Predecessor {
                                name: opts.name.clone(),
                                why,
                            });
                        }
                    }
                    held.push(HeldEntry {
                        name: opts.name.to_string(),
                        pid: std::process::id() as i32,
                        token: lease.token()?,
                        depth: 1,
                    });
                    Some(lease)
                }
                Taken::TimedOut { waited, detail, .. } => {
                    report::line(&format!(
                        "ccci-run: error: lock {} not acquired within {} s {detail}",
                        opts.name,
                        (waited.as_secs_f64() * 10.0).round() / 10.0,
                    ));
                    remove_cgroup(&opts.name, cgroups.as_ref());
                    return Ok(opts.conflict_exit);
                }
                Taken::Stopped(event) => {
                    remove_cgroup(&opts.name, cgroups.as_ref());
                    return Ok(stopped_while_waiting(&opts.name, event));
                }
            }
        }
    };
    let token = lease.as_ref().and_then(|lease| lease.fencing_token());
    let code = run_holding(
        &funnel,
        opts,
        &held,
        token,
        cgroups.as_ref(),
        fence.as_ref(),
        &mut || unpublished.now(),
    );
    // The lock first, then the fence that guarded what ran under it; the empty cgroup last:
    // tidying it is no reason to keep the next holder waiting.
    drop(lease);
    drop(fence);
    remove_cgroup(&opts.name, cgroups.as_ref());
    Ok(code)
}

/// A held lock's publication ([`publish`]): due once its command has been started (or has
/// failed to start), or as this goes, should the way there end in an error.
struct Unpublished<'a> {
    backend: &'a dyn LockBackend,
    opts: &'a LockOptions,
    then: Publish<'a>,
    /// How long the lock was waited for, until it is published.
    waited: Cell<Option<Duration>>,
}

impl Unpublished<'_> {
    fn now(&self) {
        if let Some(waited) = self.waited.take() {
            publish(self.backend, self.opts, true, waited, self.then);
        }
    }
}

impl Drop for Unpublished<'_> {
    fn drop(&mut self) {
        self.now();
    }
}

/// Remove the (empty) cgroup made for the command, once it has ended or when it never started.
fn remove_cgroup(name: &LockName, cgroups: Option<&cgroup::Cgroups>) {
    if let Some(Err(err)) = cgroups.map(|c| c.cgroup.remove()) {
        report::line(&format!("!! lock {name}: {err}"));
    }
}

/// The exit code of a wait that a signal (or a death) ended.
fn stopped_while_waiting(name: &LockName, event: Event) -> u8 {
    match event {
        Event::Signal(signal) => {
            report::line(&format!(
                "== {signal} received while waiting for lock {name} — giving up =="
            ));
            exit::for_signal(signal)
        }
        _ => exit::INTERNAL,
    }
}

/// Run the command, holding the lock, in its own process group and cgroup; signals go on to it.
fn run_holding(
    funnel: &SignalFunnel,
    opts: &LockOptions,
    held: &HeldLocks,
    fencing_token: Option<i64>,
    cgroups: Option<&cgroup::Cgroups>,
    fence: Option<&Fence>,
    on_started: &mut dyn FnMut(),
) -> u8 {
    let (program, args) = opts.command.split_first().expect("clap requires a command");
    let mut env = vec![(HELD_VAR.to_owned(), held.to_string().into())];
    env.extend(fencing_token.map(|token| (FENCING_VAR.to_owned(), token.to_string().into())));
    let spec = CommandSpec {
        program: program.clone(),
        args: args.to_vec(),
        env,
        cwd: None,
    };
    let supervisor = Supervisor {
        funnel,
        kill_grace: opts.kill_grace,
        deadline: Duration::ZERO,
        forward_signals: true,
        teardown_timeout: opts.teardown_timeout,
        hard_end: None,
        leaf: cgroups.map(|c| &c.command),
        fence,
    };
    let stopped = supervisor.start_and_stop(&spec, VecDeque::new(), on_started, &mut |_| {});
    let mut problems = stopped.errors;
    problems.extend(
        supervisor
            .kill_leftovers(cgroups.map(|c| &c.command), stopped.teardown_until)
            .err(),
    );
    for problem in problems {
        report::line(&format!("!! lock {}: {problem}", opts.name));
    }
    crate::supervise::ignored::summarise_ignored();
    stopped.reason.exit_code()
}

/// One lock an ancestor holds, as carried in `CCCI_HELD_LOCKS`: `NAME:PID:TOKEN:DEPTH`, where
/// the token names the lock instance for the backend (the local one: `MAJOR:MINOR:INODE`) and
/// the depth counts the nested `lock` commands that were granted it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HeldEntry {
    pub name: String,
    pub pid: i32,
    pub token: String,
    pub depth: u32,
}

impl FromStr for HeldEntry {
    type Err = String;

    fn from_str(entry: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("{why} in {HELD_VAR} entry {entry:?}");
        if entry.contains(',') {
            return Err(bad("a comma"));
        }
        let (name, rest) = entry.split_once(':').ok_or_else(|| bad("no pid"))?;
        let (pid, rest) = rest.split_once(':').ok_or_else(|| bad("no token"))?;
        let (token, depth) = rest.rsplit_once(':').ok_or_else(|| bad("no depth"))?;
        if name.is_empty() || token.is_empty() {
            return Err(bad("an empty field"));
        }
        Ok(Self {
            name: name.to_owned(),
            pid: pid
                .parse()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| bad("a bad pid"))?,
            token: token.to_owned(),
            depth: depth.parse().map_err(|_| bad("a bad depth"))?,
        })
    }
}

impl fmt::Display for HeldEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}:{}",
            self.name, self.pid, self.token, self.depth
        )
    }
}

/// The entries of `CCCI_HELD_LOCKS`, passed on to the command with ours added. Entries for
/// other locks are passed on as they came.
#[derive(Debug, Default)]
struct HeldLocks {
    entries: Vec<String>,
}

impl HeldLocks {
    fn inherited(value: String) -> Self {
        Self {
            entries: value
                .split(',')
                .filter(|e| !e.is_empty())
                .map(str::to_owned)
                .collect(),
        }
    }

    fn push(&mut self, entry: HeldEntry) {
        self.entries.push(entry.to_string());
    }

    /// The depth at which an ancestor's hold on `name` is granted to us, if one holds it. An
    /// entry whose pid is not even our ancestor was not inherited from a holder: it says
    /// nothing about us (forged, or leaked into an unrelated environment) and is dropped. An
    /// ancestor's entry that the backend does not confirm is refused: taking the lock behind
    /// the ancestor's back would wait for ourselves.
    fn grant(
        &mut self,
        backend: &dyn LockBackend,
        name: &LockName,
    ) -> Result<Option<u32>, NamedLockError> {
        let Some(i) = self
            .entries
            .iter()
            .position(|e| e.split(':').next() == Some(name.as_str()))
        else {
            return Ok(None);
        };
        let claimed: Option<i32> = self.entries[i]
            .split(':')
            .nth(1)
            .and_then(|p| p.parse().ok());
        let ancestor = claimed
            .filter(|p| *p > 1)
            .is_some_and(|p| linux::is_ancestor(Pid::from_raw(p)));
        if !ancestor {
            report::line(&format!(
                "!! lock {name}: ignoring {HELD_VAR} entry {:?}: its pid is not an ancestor of this \
                 process; queueing normally",
                crate::names::escape_outside(self.entries[i].as_bytes())
            ));
            self.entries.remove(i);
            return Ok(None);
        }
        let confirmed = self.entries[i]
            .parse::<HeldEntry>()
            .ok()
            .filter(|e| backend.is_held_by(LockKey::Named(name), e.pid, &e.token));
        let Some(mut entry) = confirmed else {
            return Err(NamedLockError::StaleAncestor {
                name: name.clone(),
                pid: claimed.unwrap_or(0),
            });
        };
        entry.depth += 1;
        self.entries[i] = entry.to_string();
        Ok(Some(entry.depth))
    }
}

impl fmt::Display for HeldLocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.entries.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case("pkg:42:8:1:1234:1", Some(("pkg", 42, "8:1:1234", 1)))]
    #[case("pkg:42:tok:3", Some(("pkg", 42, "tok", 3)))]
    #[case("pkg:42:8:1:1234", Some(("pkg", 42, "8:1", 1234)))]
    #[case("pkg:0:8:1:1234:1", None)]
    #[case("pkg:x:8:1:1234:1", None)]
    #[case("pkg:42::1", None)]
    #[case(":42:t:1", None)]
    #[case("pkg:42:t:one", None)]
    #[case("pkg:42", None)]
    #[case("pkg:42:t:1,x", None)]
    fn held_entries_parse(#[case] text: &str, #[case] want: Option<(&str, i32, &str, u32)>) {
        let got = text.parse::<HeldEntry>().ok();
        assert_eq!(
            got.as_ref()
                .map(|e| (e.name.as_str(), e.pid, e.token.as_str(), e.depth)),
            want
        );
        if let Some(entry) = got {
            assert_eq!(entry.to_string(), text);
        }
    }
}
