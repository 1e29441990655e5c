//! `ccci-run run`: supervise one CI run from lifetime guards to teardown.
//!
//! This folder holds what one run does: its state files ([`state`]), the recipe it fetches
//! ([`fetch`]), and here the order everything happens in; and the two commands that look at
//! runs from outside: `runs` ([`list`]) and `stop` ([`stop`]). Its directory, guard, record and
//! phases are a floor below ([`crate::rundir`]), where the janitor reads them too; the janitor's
//! side of a run comes from the entry, as a [`Sweeper`]. It must never reap another run's app
//! or hold a lock past its own process: what a dead run leaves is the janitor's.
//!
//! The order is the contract's: guards, per-run `ABRA_DIR`, recipe, a janitor sweep, the app
//! lock, COMMAND in its own process group, one teardown, the run record at every phase change.
//!
//! Invariant: every way out — the command ending, SIGTERM/SIGINT/SIGHUP, the parent dying (the
//! parent-death signal is SIGTERM), the hard deadline, the app lock lost — goes through
//! [`Run::teardown`] exactly once, and nothing this run started (its process group, daemonised
//! descendants, state files) outlives it.
//!
//! Floor: commands (docs/architecture.md): imports the floors below, never another command.

pub(crate) mod fetch;
pub(crate) mod list;
pub(crate) mod state;
pub(crate) mod stop;

use std::collections::VecDeque;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use nix::unistd::Pid;

use self::fetch::{FetchError, FetchSpec};
use crate::app;
use crate::config::Class;
use crate::config::{DockerMode, Fetch, Global, RunConfig};
use crate::docker::DockerError;
use crate::docker::DockerLink;
use crate::exit;
use crate::lock::backend::{
    Lease, LockBackend, LockKey, PROGRESS_EVERY, Taken, Wait, arm_fence, is_lost, loss_watch,
};
use crate::lock::{Holder, LockError};
use crate::names;
use crate::report;
use crate::run::state::{StateError, StateFiles};
use crate::rundir::phase::Phase;
use crate::rundir::record::RunRecord;
use crate::rundir::{RunDir, RunDirError};
use crate::supervise::Supervisor;
use crate::supervise::cgroup::{self, Cgroups};
use crate::supervise::fence::{self, Fence};
use crate::supervise::guards::{self, GuardError, GuardOptions};
use crate::supervise::identity::{IdentityError, Owner};
use crate::supervise::leftovers;
use crate::supervise::process::{ChildStatus, CommandSpec};
use crate::supervise::shutdown::{Event, ShutdownReason};
use crate::supervise::signals::{Awaited, SignalFunnel, shutdown_events};
use crate::supervise::watchdog::Watchdog;
use crate::supervise::worker::Worker;

/// Ways a run fails before or around its command; all of them are exit 125.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RunError {
    #[error(transparent)]
    Guards(#[from] GuardError),
    #[error(transparent)]
    RunDir(#[from] RunDirError),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("Docker is required (--docker required): {0}; {hint}", hint = crate::docker::REQUIRED_HINT)]
    DockerRequired(DockerError),
    #[error("{0}")]
    DockerWorker(DockerError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error("failed to write run record {path}: {source}")]
    Record {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error("failed to watch the app lock for its loss: {0}")]
    LossWatch(std::io::Error),
    #[error(transparent)]
    Watchdog(#[from] crate::supervise::watchdog::WatchdogError),
    #[error(
        "failed to start the fence that stops the run's processes before its etcd lease can \
         expire: {0}; not starting the command without it"
    )]
    Fence(std::io::Error),
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error(
        "failed to clear what the previous holder of the app lock of {domain} left: {why}; \
         not starting the command beside it"
    )]
    Predecessor { domain: String, why: String },
    #[error(
        "an earlier run of stack {stack} may have left containers or volumes on a node that \
         could not be checked within {waited:.1?}: {why}; not starting the command, whose deploy \
         could mount that data (the .env stays for the next sweep)"
    )]
    NodesNotClean {
        stack: String,
        waited: Duration,
        why: String,
    },
}

/// What a run asks of the janitor: its start-of-run sweep, and the reaping of dead runs'
/// processes before a dead run's app is removed. A command imports no other command, so the
/// entry (`lib.rs`) hands the run the janitor's side as a value of this trait.
pub(crate) trait Sweeper {
    /// Stop every process a dead run of the configuration `scope` left.
    fn reap_dead_runs_processes(&self, scope: crate::supervise::identity::Scope);
    /// A sweep of the host, the Docker side within `reap_budget`. Whatever goes wrong is
    /// logged, never returned: a sweep never stops the run.
    fn sweep(
        &self,
        locks: &dyn LockBackend,
        global: &Global,
        reap_budget: Duration,
        docker: &DockerLink,
    );
}

/// Run the `run` subcommand; returns the exit code.
pub(crate) fn run(
    global: &Global,
    cfg: &RunConfig,
    start_ppid: Pid,
    sweeper: &dyn Sweeper,
) -> Result<u8, RunError> {
    // Every event of the run (status lines included, in JSON mode) carries its id and domain;
    // the span is at error level so that it exists whatever the verbosity.
    let span = tracing::error_span!("run", run_id = %cfg.run_id, domain = %cfg.identity.domain);
    let _in_run = span.enter();
    let mut funnel = guards::install_guards(
        start_ppid,
        &GuardOptions {
            expect_parent: cfg.expect_parent,
            tie_to: cfg.tie_to.clone(),
            deadline: Some(cfg.deadline),
        },
    )?;
    // The whole run's bound, whatever happens: deadline + kill grace + teardown budget.
    let hard_end = Instant::now() + cfg.deadline + cfg.kill_grace + cfg.teardown_timeout;
    if matches!(cfg.fetch, Fetch::Clone { .. }) {
        // Here, before any helper thread exists: libgit2 calls setenv when it starts.
        fetch::init_git();
    }
    let holder = Holder::this_process(cfg.run_id.as_str());
    let locks = crate::lock::backend(global)?;
    let run_dir = RunDir::claim(&global.runs_dir, &cfg.run_id, &holder.to_line())?;
    // The runs dir exists now: it names the configuration every process of the run works for.
    let owner = Owner::establish(&global.runs_dir)?;
    funnel.accept_stop_requests(run_dir.stop_request_path(), owner.process.clone());
    let mut run = Run::new(funnel, global, cfg, &run_dir, hard_end, locks, owner);
    let result = run.execute(&run_dir, holder.pid, sweeper);
    if let Err(err) = &result {
        run.record.error = Some(err.to_string());
        run.record.exit_code = Some(exit::INTERNAL);
        run.record.enter(Phase::Failed);
        run.save();
    }
    run.remove_cgroup();
    result
}

/// The record a run starts with: who runs what.
fn first_record(cfg: &RunConfig, holder: &Holder) -> RunRecord {
    let identity = &cfg.identity;
    let mut record = RunRecord {
        run_id: cfg.run_id.to_string(),
        recipe: identity.recipe.to_string(),
        pr: identity.pr.as_ref().map(ToString::to_string),
        git_ref: identity.git_ref.as_ref().map(ToString::to_string),
        domain: identity.domain.to_string(),
        stack: identity.domain.stack_name(),
        pid: holder.pid,
        host: holder.host.clone(),
        tied_to: cfg.tie_to.clone(),
        command: cfg
            .command
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect(),
        ..RunRecord::default()
    };
    record.enter(Phase::Guards);
    record
}

/// The supervisor of a run's command and hook.
fn supervisor<'a>(
    funnel: &'a SignalFunnel,
    cfg: &RunConfig,
    hard_end: Instant,
    cgroup: Option<&'a Cgroups>,
    fence: Option<&'a Fence>,
) -> Supervisor<'a> {
    Supervisor {
        fence,
        funnel,
        kill_grace: cfg.kill_grace,
        deadline: cfg.deadline,
        forward_signals: false,
        teardown_timeout: cfg.teardown_timeout,
        hard_end: Some(hard_end),
        leaf: cgroup.map(|c| &c.command),
    }
}

/// `shutdown_reason` when a teardown step ran out of its budget.
const TEARDOWN_TIMEOUT: &str = "teardown-timeout";

/// Held while the run record is written. The watchdog takes it for good before its last
/// words, so a main thread that wakes at the same moment (a supervisor SIGSTOPped past its
/// whole bound, then SIGCONTed) cannot write over the watchdog's record before the process
/// ends: the record says what the exit code says.
static RECORD_WRITES: Mutex<()> = Mutex::new(());

struct Run<'a> {
    funnel: SignalFunnel,
    global: &'a Global,
    cfg: &'a RunConfig,
    record_path: PathBuf,
    record: RunRecord,
    state: StateFiles,
    env: Vec<(String, OsString)>,
    /// Where the app lock is kept.
    locks: Box<dyn LockBackend>,
    /// Held from step 5 until the process exits; the run never removes it.
    app_lock: Option<Box<dyn Lease>>,
    /// While the app lock can lapse (etcd): what kills the run's processes in time even when
    /// this process is stopped. Declared after the lock: it is disarmed only once the lock is
    /// released.
    fence: Option<Fence>,
    /// Some teardown step ran out of its budget.
    teardown_timed_out: bool,
    /// The run's cgroup and its leaves, where cgroup v2 is writable.
    cgroup: Option<Cgroups>,
    /// No teardown step may run past this.
    hard_end: Instant,
    /// Ends the process at `hard_end` if the main thread is stuck.
    watchdog: Watchdog,
    /// The run's one Docker connection, made on first use.
    docker: DockerLink,
    /// This supervisor and its configuration.
    owner: &'static Owner,
}

impl<'a> Run<'a> {
    /// A run that holds its run dir: its record, cgroup and watchdog set up.
    fn new(
        funnel: SignalFunnel,
        global: &'a Global,
        cfg: &'a RunConfig,
        run_dir: &RunDir,
        hard_end: Instant,
        locks: Box<dyn LockBackend>,
        owner: &'static Owner,
    ) -> Self {
        let mut record = first_record(cfg, &Holder::this_process(cfg.run_id.as_str()));
        let cgroup = cgroup::run_cgroup(global.cgroup, "run", cfg.run_id.as_str(), owner);
        record.cgroup = cgroup
            .as_ref()
            .map(|c| c.cgroup.path().display().to_string());
        record.supervisor = Some(owner.process.clone());
        record.scope = Some(owner.scope);
        record.marker = Some(owner.to_string());
        let record_path = run_dir.record_path();
        let watchdog = Watchdog::arm(
            hard_end,
            cgroup.as_ref().map(|c| c.cgroup.path().to_owned()),
            {
                let record_path = record_path.clone();
                move |code| record_watchdog_end(&record_path, code)
            },
        );
        Run {
            funnel,
            global,
            cfg,
            record_path,
            record,
            state: StateFiles::default(),
            env: Vec::new(),
            locks,
            app_lock: None,
            fence: None,
            teardown_timed_out: false,
            cgroup,
            hard_end,
            watchdog,
            docker: DockerLink::new(global.docker, global.node_sweep.clone()),
            owner,
        }
    }
}

impl Run<'_> {
    /// The run's steps in the contract's order; a way out before the command starts goes
    /// straight to teardown.
    fn execute(
        &mut self,
        run_dir: &RunDir,
        pid: u32,
        sweeper: &dyn Sweeper,
    ) -> Result<u8, RunError> {
        // Before anything is fetched, locked or started: no run without its last-resort bound.
        self.watchdog.check()?;
        self.save_checked(false)?;
        // Where the app lock is kept must answer before anything is fetched or deployed.
        self.locks.prepare(true)?;
        let abra_dir = run_dir.prepare_abra_dir(&self.global.abra_home)?;
        self.record.abra_dir = abra_dir.display().to_string();
        self.record.enter(Phase::AbraDir);
        // The record is written where a step may take long (a clone, a wait for the lock, a
        // removal of leftovers) and, durably, before the command: each write costs a rename
        // (and, on a disk with online discard, a discard), so not at every phase.
        let identity = &self.cfg.identity;
        let recipe_dir = names::recipe_dir(&abra_dir, &identity.recipe);
        if let Some(event) = self.get_recipe(&recipe_dir)? {
            return Ok(self.supervise_and_tear_down(VecDeque::from([event])));
        }
        report::line(&format!(
            "== run {}: {} (stack {}), ABRA_DIR={} ==",
            self.cfg.run_id,
            identity.domain,
            identity.domain.stack_name(),
            abra_dir.display()
        ));
        if self.global.docker == DockerMode::Required {
            if let Some(Err(err)) = self.docker.get() {
                return Err(RunError::DockerRequired(err.clone()));
            }
        }
        // Before any lock is taken or probed: a worker's engine can deploy, judge and remove
        // nothing of the app.
        if let Some(Ok(seam)) = self.docker.get() {
            seam.refuse_a_worker().map_err(RunError::DockerWorker)?;
        }
        self.sweep(sweeper);
        self.record.enter(Phase::Janitor);
        match self.take_app_lock()? {
            Taken::Held(lease) => {
                if let Some(fd) = loss_watch(&*lease).map_err(RunError::LossWatch)? {
                    self.funnel.watch_loss(fd);
                }
                self.record.fencing_token = lease.fencing_token();
                self.fence = self.arm_fence(&*lease)?;
                self.app_lock = Some(lease);
            }
            Taken::Stopped(event) => {
                return Ok(self.supervise_and_tear_down(VecDeque::from([event])));
            }
            Taken::TimedOut {
                waited,
                lock,
                detail,
            } => return Ok(self.lock_timed_out(waited, &lock, &detail)),
        }
        self.record.enter(Phase::AppLock);
        self.clear_predecessors()?;
        self.clear_leftovers(sweeper)?;
        self.state = StateFiles::create(
            &self.global.state_dir,
            self.owner.scope,
            &self.cfg.run_id,
            pid,
        )?;
        self.env = self.command_env(abra_dir, recipe_dir);
        let early: VecDeque<Event> = shutdown_events(&self.funnel.pending()).collect();
        if early.is_empty() {
            // The command starts only once the record says so, durably: a run that cannot
            // record itself (a full disk) does not run at all (125).
            self.record.enter(Phase::Command);
            if let Err(err) = self.save_checked(true) {
                for problem in self.state.remove() {
                    tracing::warn!("{problem}");
                }
                return Err(err);
            }
        }
        Ok(self.supervise_and_tear_down(early))
    }

    /// For an app lock that can lapse behind our back (an etcd lease): start the run's fence
    /// and feed it every renewal, before anything runs under the lock.
    fn arm_fence(&mut self, lease: &dyn Lease) -> Result<Option<Fence>, RunError> {
        arm_fence(
            lease,
            &mut self.funnel,
            &fence::Target {
                cgroup: self.cgroup.as_ref().map(|c| c.cgroup.path()),
                owner: self.owner,
                label: &format!("the app lock of {}", self.cfg.identity.domain),
            },
        )
        .map_err(RunError::Fence)
    }

    /// Whether the app lock is no longer ours for sure: lost, or its fence has fired.
    fn lock_gone(&self) -> bool {
        self.app_lock.as_deref().is_some_and(is_lost)
            || self.fence.as_ref().is_some_and(Fence::ended)
    }

    /// Right before a teardown step that acts on the app: is the app lock provably ours? When
    /// not, say why and leave the app alone.
    fn lock_confirmed(&mut self, step: &str) -> bool {
        let Some(lease) = self.app_lock.as_deref() else {
            return false;
        };
        match lease.confirm() {
            Ok(()) => true,
            Err(why) => {
                self.teardown_error(format!(
                    "the app lock is not provably ours before {step} ({why}): the app is left \
                     to whoever holds the lock now, or to the janitor"
                ));
                false
            }
        }
    }

    /// Step 3: the recipe into the run's tree, as configured. `Some(event)`: a way out ended a
    /// fetch that was under way.
    fn get_recipe(&mut self, recipe_dir: &Path) -> Result<Option<Event>, RunError> {
        let identity = &self.cfg.identity;
        match &self.cfg.fetch {
            Fetch::Skip => self.record.enter(Phase::FetchSkipped),
            Fetch::CopyStaged => {
                let staged = names::recipe_dir(&self.global.abra_home, &identity.recipe);
                fetch::copy_staged(&staged, recipe_dir)?;
                self.record.enter(Phase::FetchCopied);
            }
            Fetch::Clone { url } => {
                self.record.recipe_url = Some(crate::recipe_url::redact(url));
                self.save_checked(false)?;
                let spec = FetchSpec {
                    url: url.clone(),
                    pr: identity.pr.clone(),
                    git_ref: identity.git_ref.clone(),
                    dest: recipe_dir.to_owned(),
                };
                match self.fetch_recipe(spec)? {
                    Ok(commit) => {
                        self.record.commit = Some(commit);
                        self.record.enter(Phase::Fetch);
                    }
                    Err(event) => return Ok(Some(event)),
                }
            }
        }
        Ok(None)
    }

    /// What the command (and the hook) get in their environment.
    fn command_env(&self, abra_dir: PathBuf, recipe_dir: PathBuf) -> Vec<(String, OsString)> {
        let identity = &self.cfg.identity;
        [
            ("ABRA_DIR", abra_dir.into_os_string()),
            ("CCCI_RUN_ID", self.cfg.run_id.as_str().into()),
            ("CCCI_RECIPE", identity.recipe.as_str().into()),
            ("CCCI_RECIPE_DIR", recipe_dir.into_os_string()),
            ("CCCI_APP_DOMAIN", identity.domain.as_str().into()),
            ("CCCI_STACK_NAME", identity.domain.stack_name().into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .chain(self.state.env().map(|(k, p)| (k.to_owned(), p.into())))
        .chain(
            self.record
                .fencing_token
                .map(|token| ("CCCI_FENCING_TOKEN".to_owned(), token.to_string().into())),
        )
        .collect()
    }

    /// Step 5: the app lock, through the lock backend. Waits visibly for as long as the
    /// lock-wait budget allows; a signal or the deadline ends the wait at once.
    fn take_app_lock(&mut self) -> Result<Taken, RunError> {
        let domain = &self.cfg.identity.domain;
        // The line names our cgroup and marker: should we die holding the lock, the next
        // holder finds in it what to clear.
        let holder = Holder::this_process(self.cfg.run_id.as_str())
            .with_cgroup(self.cgroup.as_ref().map(|c| c.cgroup.path()));
        let wait = Wait {
            holder: &holder,
            funnel: &self.funnel,
            until: self.cfg.lock_wait.map(|budget| Instant::now() + budget),
            class: Class::Normal,
            promote_after: Duration::MAX,
            stop_budget: crate::config::EtcdSettings::stop_budget(self.cfg.kill_grace),
        };
        let started = Instant::now();
        let mut waited = false;
        let (record, record_path) = (&self.record, &self.record_path);
        let taken = self
            .locks
            .take(LockKey::App(domain), &wait, &mut |holder, so_far| {
                if !waited {
                    // The wait may be long: the record says where the run is.
                    save_or_warn(record, record_path);
                }
                waited = true;
                let held_by = Holder::describe(holder);
                if so_far.is_zero() {
                    report::line(&format!(
                        "== app lock: another run of {domain} is in flight — waiting; held by \
                         {held_by} =="
                    ));
                } else {
                    report::line(&format!(
                        "== app lock: still waiting for {domain} after {} s; held by {held_by} ==",
                        so_far.as_secs()
                    ));
                }
            })?;
        if waited && matches!(taken, Taken::Held(_)) {
            report::line(&format!(
                "== app lock: acquired {domain} after {:.1} s ==",
                started.elapsed().as_secs_f64()
            ));
        }
        Ok(taken)
    }

    /// The lock-wait budget ran out: say who holds the lock, record it, exit 75.
    fn lock_timed_out(&mut self, waited: Duration, lock: &str, detail: &str) -> u8 {
        let message = format!(
            "app lock {lock} for {} not acquired within {} s; {detail}",
            self.cfg.identity.domain,
            (waited.as_secs_f64() * 10.0).round() / 10.0,
        );
        report::line(&format!("ccci-run: {message}"));
        self.record.error = Some(message);
        self.record.exit_code = Some(exit::LOCK_TIMEOUT);
        self.record.enter(Phase::Finished);
        self.save();
        exit::LOCK_TIMEOUT
    }

    /// Write the run record, or fail the run: before its command starts, a run must be able
    /// to record itself.
    fn save_checked(&self, durable: bool) -> Result<(), RunError> {
        let _writing = RECORD_WRITES.lock().unwrap_or_else(PoisonError::into_inner);
        let written = if durable {
            self.record.write_durably(&self.record_path)
        } else {
            self.record.write(&self.record_path)
        };
        written.map_err(|source| RunError::Record {
            path: self.record_path.clone(),
            source,
        })
    }

    /// Step 3: clone on a worker thread; a signal or the deadline ends a hanging fetch at once.
    /// `Ok(Err(event))` is such an ending.
    fn fetch_recipe(&mut self, spec: FetchSpec) -> Result<Result<String, Event>, RunError> {
        let shown = crate::recipe_url::redact(&spec.url);
        let worker = Worker::spawn("fetch", move |cancel| fetch::fetch(&spec, cancel))
            .map_err(|e| RunError::Fetch(FetchError::Start(e)))?;
        let started = Instant::now();
        let mut progress = || {
            report::line(&format!(
                "== fetch: still cloning {shown} after {} s ==",
                started.elapsed().as_secs()
            ));
        };
        let keepalive: Option<(Duration, &mut dyn FnMut())> = Some((PROGRESS_EVERY, &mut progress));
        match self.funnel.await_work(worker, None, keepalive) {
            Awaited::Done(outcome) => Ok(Ok(outcome?.to_string())),
            Awaited::Stopped(event) => Ok(Err(event)),
            // No budget but the hard deadline, which arrives as a signal.
            Awaited::TimedOut => Ok(Err(Event::Deadline)),
        }
    }

    /// Holding the app lock: a holder line found in it names a run that died holding it (a
    /// SIGKILL, the OOM killer). Whatever that run left still running — its cgroup, every
    /// process naming it — is killed and confirmed gone before our command starts, whether or
    /// not it left an app; where that cannot be done, the line says why.
    fn clear_predecessors(&mut self) -> Result<(), RunError> {
        let Some(lease) = self.app_lock.as_deref() else {
            return Ok(());
        };
        let domain = self.cfg.identity.domain.to_string();
        let until = Instant::now()
            + leftovers::KILL_BUDGET.min(self.hard_end.saturating_duration_since(Instant::now()));
        for before in lease.predecessors() {
            let cleared = leftovers::clear_predecessor(&before.predecessor(), self.owner, until);
            let who = Holder::describe(Some(&before));
            if let Err(why) = cleared.report("app lock", &who) {
                return Err(RunError::Predecessor { domain, why });
            }
        }
        Ok(())
    }

    /// Holding the app lock, nothing else of this domain can be alive: whatever of the app is
    /// there now was left by a run that died while we waited (after our sweep). It goes before
    /// the command starts, so the command never deploys over a dead run's stack. On a swarm of
    /// several nodes the stack is always swept off every node (another node's copy of a volume
    /// is seen by no manager), within the lock wait: a node that may hold some of it and cannot
    /// be checked stops the run (125), naming the node, rather than let the command's deploy
    /// mount an earlier run's data there.
    fn clear_leftovers(&mut self, sweeper: &dyn Sweeper) -> Result<(), RunError> {
        let domain = &self.cfg.identity.domain;
        let several = match self.docker.get() {
            Some(Ok(seam)) => seam.several_nodes(),
            _ => false,
        };
        if !several && !app::app_has_leftovers(self.global, &self.docker, domain) {
            return Ok(());
        }
        self.save();
        // Its processes first: a dead run's leftover deploy or test script must not act on the
        // app while (or after) it is removed.
        sweeper.reap_dead_runs_processes(self.owner.scope);
        let mut budget = crate::config::DEFAULT_REAP_BUDGET
            .min(self.hard_end.saturating_duration_since(Instant::now()));
        if let Some(wait) = self.cfg.lock_wait {
            budget = budget.min(wait);
        }
        let removal = app::remove_app_now(self.global, &self.docker, domain, budget);
        if removal.removed.counts().iter().any(|(_, n)| *n > 0) {
            report::line(&format!(
                "== app lock: removed what a previous run of {domain} left: {} ==",
                removal.removed.summary()
            ));
        }
        if !removal.nodes.is_empty() {
            return Err(RunError::NodesNotClean {
                stack: domain.stack_name(),
                waited: budget,
                why: removal.nodes.join("; "),
            });
        }
        for err in removal.errors {
            tracing::warn!("failed to clear leftovers of {domain}: {err}");
        }
        Ok(())
    }

    /// Step 4: a janitor sweep. Whatever goes wrong is logged; it never stops the run.
    fn sweep(&mut self, sweeper: &dyn Sweeper) {
        let budget = crate::config::DEFAULT_REAP_BUDGET
            .min(self.hard_end.saturating_duration_since(Instant::now()));
        sweeper.sweep(&*self.locks, self.global, budget, &self.docker);
    }

    fn supervisor(&self) -> Supervisor<'_> {
        supervisor(
            &self.funnel,
            self.cfg,
            self.hard_end,
            self.cgroup.as_ref(),
            self.fence.as_ref(),
        )
    }

    /// Start the command (unless a way out already happened), wait for a way out, tear down.
    fn supervise_and_tear_down(&mut self, early: VecDeque<Event>) -> u8 {
        let (program, args) = self
            .cfg
            .command
            .split_first()
            .expect("clap requires a command");
        let spec = CommandSpec {
            program: program.clone(),
            args: args.to_vec(),
            env: self.env.clone(),
            cwd: None,
        };
        // Built from the fields it needs, so the record can be written as teardown begins.
        let record = &mut self.record;
        let record_path = &self.record_path;
        let watchdog = &self.watchdog;
        let supervisor = supervisor(
            &self.funnel,
            self.cfg,
            self.hard_end,
            self.cgroup.as_ref(),
            self.fence.as_ref(),
        );
        let stopped = supervisor.start_and_stop(&spec, early, &mut |reason| {
            watchdog.set_exit_code(reason.exit_code());
            record.shutdown_reason = Some(reason.name());
            match reason {
                ShutdownReason::TiedPidDied(pid) => record.tied_pid_died = Some(pid),
                ShutdownReason::Stopped(by) => record.stopped_by = Some(by),
                _ => {}
            }
            record.enter(Phase::Teardown);
            save_or_warn(record, record_path);
        });
        self.record.command_status = stopped
            .command_status
            .and_then(|s| serde_json::to_value(s).ok());
        self.record.killed_after_grace = stopped.killed_after_grace;
        for err in stopped.errors {
            self.teardown_error(err);
        }
        self.teardown(stopped.teardown_until);
        // Past the whole bound (a supervisor stopped that long): ended as the watchdog would
        // have ended it, whichever thread gets there first.
        if self.teardown_timed_out || Instant::now() >= self.hard_end {
            self.record.shutdown_reason = Some(TEARDOWN_TIMEOUT.to_owned());
        }
        crate::supervise::summarise_ignored();
        let code = stopped.reason.exit_code();
        self.record.exit_code = Some(code);
        self.record.enter(Phase::Finished);
        self.save();
        report::line(&format!(
            "== run {}: finished, exit {code}; record {} ==",
            self.cfg.run_id,
            self.record_path.display()
        ));
        // The build log may be gone by now (a cancelled build's pipe is closed at the kill):
        // the outcome also goes to the system journal, where there is one.
        let reason = self
            .record
            .shutdown_reason
            .as_deref()
            .unwrap_or("command-ended");
        let left = if self.record.teardown_errors.is_empty() {
            "nothing left".to_owned()
        } else {
            format!(
                "teardown incomplete ({}; see {})",
                self.record.teardown_errors.join("; "),
                self.record_path.display()
            )
        };
        report::journal(&format!(
            "run {}: torn down after {reason}, exit {code}, {left}",
            self.cfg.run_id
        ));
        code
    }

    /// Everything after the command's group is gone, within `until`: leftovers killed, the
    /// hook (its share of the budget), app removal (the rest), state files. Signals are
    /// reported and ignored here; they can never extend it.
    fn teardown(&mut self, until: Instant) {
        self.kill_leftovers(until);
        if self.app_lock.is_none() {
            // Never held the app lock: the app, if any, is another run's. Hands off.
        } else if self.lock_gone() {
            report::line(
                "!! teardown: the app lock was lost; the app is left to whoever holds the lock \
                 now, or to the janitor",
            );
        } else if self.cfg.no_teardown {
            report::line("== --no-teardown: keeping the app; the next janitor sweep reaps it ==");
        } else {
            self.tear_down_app(until);
        }
        for err in self.state.remove() {
            self.teardown_error(err);
        }
    }

    /// The app's part of a teardown, while the app lock is held: the hook (its share of the
    /// budget), then the app's removal (the rest), each only once etcd confirms the lock.
    fn tear_down_app(&mut self, until: Instant) {
        if let Some(hook) = self.cfg.on_teardown.clone() {
            if !self.lock_confirmed("the teardown hook") {
                return;
            }
            self.run_hook(&hook, hook_share(Instant::now(), until));
            self.kill_leftovers(until);
        }
        if !self.lock_confirmed("the app's removal") {
            return;
        }
        // Never past the time the app lock is safely ours (a lease not renewed meanwhile).
        let safe = self
            .app_lock
            .as_deref()
            .and_then(|lease| lease.safe_until());
        let budget = safe
            .map_or(until, |safe| safe.min(until))
            .saturating_duration_since(Instant::now());
        let app::Removal {
            removed, errors, ..
        } = app::remove_app_now(self.global, &self.docker, &self.cfg.identity.domain, budget);
        for (kind, count) in removed.counts() {
            if count > 0 {
                tracing::info!(kind, count, "removed the app's resources");
            }
        }
        if Instant::now() >= until && !errors.is_empty() {
            self.teardown_timed_out = true;
        }
        for err in errors {
            self.teardown_error(err);
        }
    }

    fn run_hook(&mut self, hook: &str, until: Instant) {
        let spec = CommandSpec {
            program: "sh".into(),
            args: vec!["-c".into(), hook.into()],
            env: self.env.clone(),
            cwd: None,
        };
        let leaf = self.cgroup.as_ref().map(|c| &c.hook);
        let share = until.saturating_duration_since(Instant::now());
        match self.supervisor().run_within(&spec, leaf, until) {
            Ok(ChildStatus::Exited(0)) => {}
            Ok(status) => self.teardown_error(format!(
                "--on-teardown command failed with exit code {}",
                status.exit_code()
            )),
            Err(err) => {
                self.teardown_timed_out = true;
                self.teardown_error(format!(
                    "--on-teardown command {err} ({:.1} s)",
                    share.as_secs_f64()
                ));
            }
        }
    }

    fn kill_leftovers(&mut self, until: Instant) {
        let result = match &self.cgroup {
            Some(c) => self
                .supervisor()
                .kill_leftovers(Some(&c.command), until)
                .and(self.supervisor().kill_leftovers(Some(&c.hook), until)),
            None => self.supervisor().kill_leftovers(None, until),
        };
        if let Err(err) = result {
            self.teardown_error(err);
        }
    }

    /// Remove the run's (empty) cgroup; it is named in the record, so say when it stays.
    fn remove_cgroup(&mut self) {
        let Some(cgroups) = &self.cgroup else {
            return;
        };
        if let Err(err) = cgroups.cgroup.remove() {
            let message = format!("{err}; the next janitor sweep removes it");
            tracing::warn!("{message}");
        }
    }

    fn teardown_error(&mut self, message: String) {
        report::line(&format!("!! teardown: {message}"));
        self.record.teardown_errors.push(message);
    }

    /// Write the run record; a failure is reported but never stops a teardown.
    fn save(&self) {
        save_or_warn(&self.record, &self.record_path);
    }
}

/// Of what is left of a teardown budget, the part the hook may use: everything but what app
/// removal needs (half of what is left, at most [`REMOVAL_RESERVE`]).
pub(crate) fn hook_share(now: Instant, until: Instant) -> Instant {
    let left = until.saturating_duration_since(now);
    until - (left / 2).min(REMOVAL_RESERVE)
}

/// What app removal keeps of the teardown budget when a hook runs first.
pub(crate) const REMOVAL_RESERVE: Duration = Duration::from_secs(120);

/// The watchdog's note in the run record before it ends the process.
fn record_watchdog_end(path: &std::path::Path, code: u8) {
    // Kept until the process ends (in a moment, at this thread's `_exit`): no write of the
    // main thread's comes after this one.
    std::mem::forget(RECORD_WRITES.lock().unwrap_or_else(PoisonError::into_inner));
    if let Ok(mut rec) = RunRecord::read(path) {
        rec.shutdown_reason = Some(TEARDOWN_TIMEOUT.to_owned());
        rec.teardown_errors
            .push("the whole-run bound passed; ccci-run ended itself".to_owned());
        rec.exit_code = Some(code);
        rec.enter(Phase::Finished);
        let _ = rec.write(path);
    }
}

/// Write the run record; a failure is reported but stops nothing (after the command started,
/// a record that cannot be written must not cut a teardown short).
fn save_or_warn(record: &RunRecord, path: &Path) {
    let _writing = RECORD_WRITES.lock().unwrap_or_else(PoisonError::into_inner);
    if let Err(err) = record.write(path) {
        tracing::warn!(path = %path.display(), "failed to write run record: {err}");
    }
}
