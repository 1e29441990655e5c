//! `ccci-run run`: supervise one CI run from lifetime guards to teardown.
//!
//! This folder holds what one run does: its state files ([`state`]), the recipe it fetches
//! ([`fetch`]), its app lock ([`app_lock`]), its end ([`teardown`]), and here the order
//! everything happens in. The commands that look at runs from outside, `runs` and `stop`, are
//! a room of their own ([`crate::runs`]). Its directory, guard, record and
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

mod app_lock;
pub(crate) mod fetch;
pub(crate) mod state;
mod teardown;

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
use crate::rundir::{Claimant, RunDir, RunDirError};
use crate::supervise::Supervisor;
use crate::supervise::cgroup::{self, Cgroups};
use crate::supervise::fence::{self, Fence};
use crate::supervise::guards::{self, GuardError, GuardOptions};
use crate::supervise::identity::{IdentityError, Owner};
use crate::supervise::leftovers;
use crate::supervise::process::CommandSpec;
use crate::supervise::shutdown::ChildStatus;
use crate::supervise::shutdown::{Event, ShutdownReason};
use crate::supervise::signals::{Awaited, SignalFunnel, shutdown_events};
use crate::supervise::watchdog::Watchdog;
use crate::supervise::worker::Worker;

/// Ways a run fails before or around its command: exit 125, but for a recipe that cannot be
/// deployed as it is (2).
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
    /// The recipe cannot be deployed as it is (exit 2): a name over Docker's limit, a compose
    /// file abra cannot read, a `.env.sample` naming no usable recipe.
    #[error("recipe {recipe}: {why}; nothing was deployed")]
    Recipe { recipe: String, why: String },
    #[error("recipe {recipe}: {source}")]
    RecipeRead {
        recipe: String,
        source: crate::recipe::RecipeError,
    },
    #[error("failed to watch the app lock for its loss: {0}")]
    LossWatch(std::io::Error),
    #[error(transparent)]
    Watchdog(#[from] crate::supervise::watchdog::WatchdogError),
    #[error(
        "failed to start the fence that kills the run's processes should its supervisor die \
         (or its etcd lease expire): {0}; not starting the command without it"
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

impl RunError {
    pub(crate) fn exit_code(&self) -> u8 {
        match self {
            Self::Recipe { .. } => exit::USAGE,
            _ => exit::INTERNAL,
        }
    }
}

impl From<RunError> for crate::error::Error {
    fn from(err: RunError) -> Self {
        let code = err.exit_code();
        Self::command(err, code)
    }
}

/// What a run asks of the janitor: its start-of-run sweep, and the reaping of dead runs'
/// processes before a dead run's app is removed. A command imports no other command, so the
/// entry (`dispatch.rs`) hands the run the janitor's side as a value of this trait.
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
    // The mark of the run this supervisor was started for, before anything names it: `stop`
    // signals only a process that carries it.
    if let Err(err) = crate::supervise::mark::hold(cfg.run_id.as_str()) {
        tracing::warn!(
            "failed to mark this supervisor as run {}'s (stop cannot prove it): {err}",
            cfg.run_id
        );
    }
    let holder = Holder::this_process(cfg.run_id.as_str());
    let locks = crate::lock::backend(global)?;
    let claimant = Claimant {
        run_id: &cfg.run_id,
        repo: cfg.repo.as_deref(),
        recipe: cfg.identity.recipe.as_str(),
        holder: &holder.to_line(),
    };
    let run_dir = RunDir::claim(&global.runs_dir, &claimant)?;
    // The runs dir exists now: it names the configuration every process of the run works for.
    let owner = Owner::establish(&global.runs_dir)?;
    funnel.accept_stop_requests(run_dir.stop_request_path(), owner.process.clone());
    let mut run = Run::new(funnel, global, cfg, &run_dir, hard_end, locks, owner);
    let result = run.execute(&run_dir, holder.pid, sweeper);
    if let Err(err) = &result {
        run.record.error = Some(err.to_string());
        run.record.exit_code = Some(err.exit_code());
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
        repo: cfg.repo.clone(),
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
    /// The run's dead-man, from the app lock on: what kills the run's processes should this
    /// process die, and, while the app lock can lapse (etcd), in time even when this process is
    /// stopped. Declared after the lock: it is disarmed only once the lock is released.
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
        self.check_recipe(&recipe_dir)?;
        // The run's bounds, where an operator reading the log looks first.
        let show = crate::duration::show;
        report::line(&format!(
            "== run {}: {} (stack {}), ABRA_DIR={}; deadline {}, kill grace {}, lock wait {} ==",
            self.cfg.run_id,
            identity.domain,
            identity.domain.stack_name(),
            abra_dir.display(),
            show(self.cfg.deadline),
            show(self.cfg.kill_grace),
            self.cfg
                .lock_wait
                .map_or_else(|| "until the deadline".to_owned(), show)
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

    /// Before anything is deployed: the recipe as abra will read it. Every name its compose
    /// files give Docker must be within Docker's limits (else exit 2, naming each, and the
    /// longest domain suffix the recipe allows), and where its `.env.sample` names the recipe
    /// by another name (`TYPE`/`RECIPE`, as older recipes do), the run's tree has it under that
    /// name too, since abra looks there.
    fn check_recipe(&mut self, recipe_dir: &Path) -> Result<(), RunError> {
        let identity = &self.cfg.identity;
        let recipe = identity.recipe.as_str().to_owned();
        let read = |source| RunError::RecipeRead {
            recipe: recipe.clone(),
            source,
        };
        let stack = identity.domain.stack_name();
        let names = match crate::recipe::object_names(recipe_dir, &stack, identity.domain.as_str())
        {
            Ok(names) => {
                // Recorded before anything is deployed: what a reap takes by name of what
                // carries no stack label, even once this tree is gone.
                self.record.given_names = Some(crate::recipe::given_names(&names, &stack));
                names
            }
            // A file this reader cannot parse may still be one Docker reads: say so, and leave
            // the verdict to the deploy.
            Err(err @ crate::recipe::RecipeError::Compose { .. }) => {
                report::line(&format!(
                    "ccci-run: warning: recipe {recipe}: {err}; its names were not checked \
                     against Docker's limits"
                ));
                Vec::new()
            }
            Err(err) => return Err(read(err)),
        };
        let suffix = self.global.suffix.as_str();
        let longest = crate::recipe::longest_suffix(&names, &identity.domain);
        for n in names.iter().filter(|n| n.over() && !n.deployed) {
            report::line(&format!(
                "ccci-run: warning: recipe {recipe}: {}, should an app's COMPOSE_FILE name {}",
                crate::recipe::over_limit_line(n),
                n.file
            ));
        }
        let over: Vec<String> = names
            .iter()
            .filter(|n| n.over() && n.deployed)
            .map(crate::recipe::over_limit_line)
            .collect();
        if !over.is_empty() {
            return Err(RunError::Recipe {
                recipe,
                why: format!(
                    "{}; under the domain suffix {suffix} ({} characters) its names are too \
                     long: the longest suffix this recipe allows is {longest} characters \
                     (abra's own limit, a stack name of at most {}, allows {})",
                    over.join("; "),
                    suffix.len(),
                    crate::names::MAX_STACK_NAME_LEN,
                    crate::recipe::abra_longest_suffix(&identity.domain)
                ),
            });
        }
        let vars = crate::recipe::env_sample(recipe_dir).map_err(read)?;
        if let Some(named) = crate::recipe::recipe_named(&vars).filter(|n| *n != recipe) {
            let Ok(valid) = names::Recipe::parse(&named) else {
                return Err(RunError::Recipe {
                    recipe,
                    why: format!(
                        "its .env.sample names the recipe {:?} (RECIPE/TYPE), which is no \
                         recipe name abra could look up",
                        names::visible(&named)
                    ),
                });
            };
            let there = recipe_dir.with_file_name(valid.as_str());
            if std::fs::symlink_metadata(&there).is_err() {
                std::os::unix::fs::symlink(&recipe, &there).map_err(|e| RunError::Recipe {
                    recipe: recipe.clone(),
                    why: format!("failed to link {} to it: {e}", there.display()),
                })?;
            }
            report::line(&format!(
                "== recipe {recipe}: its .env.sample names it {named} (RECIPE/TYPE), where abra \
                 looks: {} links to it ==",
                there.display()
            ));
        }
        Ok(())
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
        // The engine the run uses, when the flag or the file named it: the command's `abra`
        // and `docker` reach the same one (a Drone step never sees the runner's DOCKER_HOST).
        .chain(
            crate::docker::endpoint::exported()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v)),
        )
        .collect()
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

    /// Write the run record; a failure is reported but never stops a teardown.
    fn save(&self) {
        save_or_warn(&self.record, &self.record_path);
    }
}

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
