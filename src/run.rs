//! `ccci-run run`: supervise one CI run from lifetime guards to teardown.
//!
//! The order is the contract's: guards, per-run `ABRA_DIR`, recipe, a janitor sweep, the app
//! lock, COMMAND in its own process group, one teardown, the run record at every phase change.
//!
//! Invariant: every way out — the command ending, SIGTERM/SIGINT/SIGHUP, the parent dying (the
//! parent-death signal is SIGTERM), the hard deadline — goes through [`Run::teardown`] exactly
//! once, and nothing this run started (its process group, daemonised descendants, state files)
//! outlives it.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use nix::unistd::Pid;

use crate::cli::{DockerMode, Fetch, Global, RunConfig};
use crate::docker::DockerError;
use crate::exit;
use crate::fetch::{self, FetchError, FetchSpec};
use crate::janitor::{self, Decision, DockerLink};
use crate::lock::{self, HeldLock, Holder, LockError, LockFile, TryLock};
use crate::process::{ChildStatus, CommandSpec};
use crate::record::RunRecord;
use crate::report;
use crate::rundir::{self, RunDir, RunDirError};
use crate::shutdown::Event;
use crate::signals::SignalFunnel;
use crate::state::{StateError, StateFiles};
use crate::supervise::{
    self, Cgroups, GuardError, GuardOptions, Supervisor, Watchdog, hook_share, shutdown_events,
};
use crate::worker::Worker;

/// Ways a run fails before or around its command; all of them are exit 125.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Guards(#[from] GuardError),
    #[error(transparent)]
    RunDir(#[from] RunDirError),
    #[error(transparent)]
    Lock(#[from] LockError),
    #[error("Docker is required (--docker required): {0}")]
    DockerRequired(DockerError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error("failed to write run record {path}: {source}")]
    Record {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Fetch(#[from] FetchError),
}

/// Run the `run` subcommand; returns the exit code.
pub fn run(global: &Global, cfg: &RunConfig, start_ppid: Pid) -> Result<u8, RunError> {
    let funnel = supervise::install_guards(
        start_ppid,
        &GuardOptions {
            expect_parent: cfg.expect_parent,
            tie_to: cfg.tie_to,
            deadline: Some(cfg.deadline),
        },
    )?;
    let started = Instant::now();
    // The whole run's bound, whatever happens: deadline + kill grace + teardown budget.
    let hard_end = started + cfg.deadline + cfg.kill_grace + cfg.teardown_timeout;
    if matches!(cfg.fetch, Fetch::Clone { .. }) {
        // Here, before any helper thread exists: libgit2 calls setenv when it starts.
        fetch::init_git();
    }
    let pid = std::process::id();
    let holder = Holder::this_process(cfg.run_id.as_str());
    let run_dir = RunDir::claim(&global.runs_dir, &cfg.run_id, &holder.to_line())?;
    let identity = &cfg.identity;
    let mut record = RunRecord {
        run_id: cfg.run_id.to_string(),
        recipe: identity.recipe.to_string(),
        pr: identity.pr.as_ref().map(ToString::to_string),
        git_ref: identity.git_ref.as_ref().map(ToString::to_string),
        domain: identity.domain.to_string(),
        stack: identity.domain.stack_name(),
        pid,
        host: holder.host.clone(),
        tied_to: cfg.tie_to,
        command: cfg
            .command
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect(),
        ..RunRecord::default()
    };
    record.enter("guards");
    let cgroup = supervise::run_cgroup(global.cgroup, "run", cfg.run_id.as_str());
    record.cgroup = cgroup
        .as_ref()
        .map(|c| c.cgroup.path().display().to_string());
    let record_path = run_dir.record_path();
    let watchdog = Watchdog::arm(
        hard_end,
        record_path.clone(),
        cgroup.as_ref().map(|c| c.cgroup.path().to_owned()),
    );
    let mut run = Run {
        funnel,
        global,
        cfg,
        record_path,
        record,
        state: StateFiles::default(),
        env: Vec::new(),
        app_lock: None,
        teardown_timed_out: false,
        cgroup,
        hard_end,
        watchdog,
        docker: DockerLink::new(global.docker),
    };
    let result = run.execute(&run_dir, pid);
    if let Err(err) = &result {
        run.record.error = Some(err.to_string());
        run.record.exit_code = Some(exit::INTERNAL);
        run.record.enter("failed");
        run.save();
    }
    run.remove_cgroup();
    result
}

/// `shutdown_reason` when a teardown step ran out of its budget.
const TEARDOWN_TIMEOUT: &str = "teardown-timeout";

struct Run<'a> {
    funnel: SignalFunnel,
    global: &'a Global,
    cfg: &'a RunConfig,
    record_path: PathBuf,
    record: RunRecord,
    state: StateFiles,
    env: Vec<(String, OsString)>,
    /// Held from step 5 until the process exits; the run never unlinks it.
    app_lock: Option<Vec<HeldLock>>,
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
}

enum LockOutcome {
    Held(HeldLock),
    Stopped(Event),
    TimedOut { waited: Duration, holder: String },
}

impl Run<'_> {
    fn execute(&mut self, run_dir: &RunDir, pid: u32) -> Result<u8, RunError> {
        self.record
            .write(&self.record_path)
            .map_err(|source| RunError::Record {
                path: self.record_path.clone(),
                source,
            })?;
        let abra_dir = run_dir.prepare_abra_dir(&self.global.abra_home)?;
        self.record.abra_dir = abra_dir.display().to_string();
        self.record.enter("abra-dir");
        self.save_durably()?;

        let identity = &self.cfg.identity;
        let recipe_dir = abra_dir.join("recipes").join(identity.recipe.as_str());
        match &self.cfg.fetch {
            Fetch::Skip => self.record.enter("fetch-skipped"),
            Fetch::CopyStaged => {
                let staged = self
                    .global
                    .abra_home
                    .join("recipes")
                    .join(identity.recipe.as_str());
                fetch::copy_staged(&staged, &recipe_dir)?;
                self.record.enter("fetch-copied");
            }
            Fetch::Clone { url } => {
                self.record.recipe_url = Some(fetch::redact(url));
                let spec = FetchSpec {
                    url: url.clone(),
                    pr: identity.pr.clone(),
                    git_ref: identity.git_ref.clone(),
                    dest: recipe_dir.clone(),
                };
                match self.fetch_recipe(spec)? {
                    Ok(commit) => {
                        self.record.commit = Some(commit);
                        self.record.enter("fetch");
                    }
                    Err(event) => return Ok(self.supervise_and_tear_down(VecDeque::from([event]))),
                }
            }
        }
        self.save();
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
        self.sweep();
        self.record.enter("janitor");
        // Two locks, always in this order: the app lock in the lock dir, then the domain's lock in
        // the runs dir. The second is defense in depth: a lock file deleted by hand, or a lock dir
        // that differs between runs, can no longer let two runs of one domain overlap.
        let file_name = identity.domain.lock_file_name();
        let locks = [
            (
                self.global.lock_dir.clone(),
                self.global.lock_dir.join(&file_name),
            ),
            (
                rundir::domains_dir(&self.global.runs_dir),
                rundir::domains_dir(&self.global.runs_dir).join(&file_name),
            ),
        ];
        let mut held = Vec::new();
        for (dir, lock_path) in locks {
            match self.acquire_app_lock(&dir, &lock_path)? {
                LockOutcome::Held(lock) => held.push(lock),
                LockOutcome::Stopped(event) => {
                    return Ok(self.supervise_and_tear_down(VecDeque::from([event])));
                }
                LockOutcome::TimedOut { waited, holder } => {
                    let holder = match Holder::parse(&holder) {
                        Some(h) => format!(
                            "run {} (pid {} on {} since {})",
                            h.run_id, h.pid, h.host, h.started_at
                        ),
                        None => "a holder that left no metadata".to_owned(),
                    };
                    let message = format!(
                        "app lock {} for {} not acquired within {} s; held by {holder}",
                        lock_path.display(),
                        identity.domain,
                        (waited.as_secs_f64() * 10.0).round() / 10.0,
                    );
                    report::line(&format!("ccci-run: {message}"));
                    self.record.error = Some(message);
                    self.record.exit_code = Some(exit::LOCK_TIMEOUT);
                    self.record.enter("finished");
                    self.save();
                    return Ok(exit::LOCK_TIMEOUT);
                }
            }
        }
        self.app_lock = Some(held);
        self.record.enter("app-lock");
        self.save_durably()?;
        self.clear_leftovers();

        self.state = StateFiles::create(&self.global.state_dir, &self.cfg.run_id, pid)?;
        self.env = [
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
        .collect();

        let early: VecDeque<Event> = shutdown_events(&self.funnel.pending()).collect();
        if early.is_empty() {
            // The command starts only once the record says so, durably: a run that cannot
            // record itself (a full disk) does not run at all (125).
            self.record.enter("command");
            if let Err(err) = self.save_durably() {
                for problem in self.state.remove() {
                    tracing::warn!("{problem}");
                }
                return Err(err);
            }
        }
        Ok(self.supervise_and_tear_down(early))
    }

    /// Write the run record, or fail the run: before its command starts, a run must be able
    /// to record itself.
    fn save_durably(&self) -> Result<(), RunError> {
        self.record
            .write(&self.record_path)
            .map_err(|source| RunError::Record {
                path: self.record_path.clone(),
                source,
            })
    }

    /// Step 3: clone on a worker thread; a signal or the deadline ends a hanging fetch at once.
    /// `Ok(Err(event))` is such an ending.
    fn fetch_recipe(&mut self, spec: FetchSpec) -> Result<Result<String, Event>, RunError> {
        let mut worker = Worker::spawn("fetch", move |cancel| fetch::fetch(&spec, cancel))
            .map_err(|e| RunError::Fetch(FetchError::Start(e)))?;
        loop {
            let (arrived, ready) = self.funnel.wait_or(Some(worker.ready_fd()), None);
            if let Some(event) = shutdown_events(&arrived).next() {
                drop(worker.cancel());
                return Ok(Err(event));
            }
            if ready {
                if let Some(outcome) = worker.try_finish() {
                    return Ok(Ok(outcome?.to_string()));
                }
            }
        }
    }

    /// Holding the app lock, nothing else of this domain can be alive: whatever of the app is
    /// there now was left by a run that died while we waited (after our sweep). It goes before
    /// the command starts, so the command never deploys over a dead run's stack.
    fn clear_leftovers(&mut self) {
        let domain = &self.cfg.identity.domain;
        if !janitor::app_has_leftovers(self.global, &self.docker, domain) {
            return;
        }
        // Its processes first: a dead run's leftover deploy or test script must not act on the
        // app while (or after) it is removed.
        janitor::reap_dead_runs_processes(&mut Vec::new(), false);
        let budget = janitor::DEFAULT_REAP_BUDGET
            .min(self.hard_end.saturating_duration_since(Instant::now()));
        let (removed, errors) = janitor::remove_app_now(self.global, &self.docker, domain, budget);
        if removed.counts().iter().any(|(_, n)| *n > 0) {
            report::line(&format!(
                "== app lock: removed what a previous run of {domain} left: {} ==",
                removed.summary()
            ));
        }
        for err in errors {
            tracing::warn!("failed to clear leftovers of {domain}: {err}");
        }
    }

    /// Step 4: a janitor sweep. Whatever goes wrong is logged; it never stops the run.
    fn sweep(&mut self) {
        let opts = janitor::SweepOptions {
            dry_run: false,
            long_held: Duration::from_secs(crate::cli::DEFAULT_LONG_HELD_SECS),
            reap_budget: janitor::DEFAULT_REAP_BUDGET
                .min(self.hard_end.saturating_duration_since(Instant::now())),
        };
        let report = janitor::sweep(self.global, &opts, &self.docker);
        for err in &report.errors {
            tracing::warn!("janitor: {err}");
        }
        for c in report
            .candidates
            .iter()
            .filter(|c| c.decision == Decision::Reap)
        {
            if let Some(err) = &c.error {
                tracing::warn!("janitor: failed to reap {}: {err}", c.domain);
            }
        }
    }

    /// Step 5: the app lock. Waits visibly, in ONE blocking flock, for as long as the lock-wait
    /// budget allows; a signal or the deadline ends the wait at once.
    fn acquire_app_lock(
        &mut self,
        dir: &std::path::Path,
        path: &std::path::Path,
    ) -> Result<LockOutcome, RunError> {
        lock::prepare_dir(dir)?;
        let holder = Holder::this_process(self.cfg.run_id.as_str()).to_line();
        let started = Instant::now();
        let mut announced = false;
        loop {
            let mut lock = match LockFile::open(path)?.try_lock()? {
                TryLock::Acquired(lock) => lock,
                TryLock::Busy(mut file) => {
                    if !announced {
                        announced = true;
                        report::line(&format!(
                            "== app lock: another run of {} is in flight — waiting ==",
                            self.cfg.identity.domain
                        ));
                        tracing::info!(holder = file.read_holder(), "app lock busy");
                    }
                    let mut pending = file.lock_in_background()?;
                    loop {
                        let remaining = self
                            .cfg
                            .lock_wait
                            .map(|budget| budget.saturating_sub(started.elapsed()));
                        if remaining == Some(Duration::ZERO) {
                            pending.cancel();
                            let holder = LockFile::open_existing(path)
                                .ok()
                                .flatten()
                                .map(|mut f| f.read_holder())
                                .unwrap_or_default();
                            return Ok(LockOutcome::TimedOut {
                                waited: started.elapsed(),
                                holder,
                            });
                        }
                        let (arrived, ready) =
                            self.funnel.wait_or(Some(pending.ready_fd()), remaining);
                        if let Some(event) = shutdown_events(&arrived).next() {
                            pending.cancel();
                            return Ok(LockOutcome::Stopped(event));
                        }
                        if ready {
                            if let Some(outcome) = pending.try_finish() {
                                break outcome?;
                            }
                        }
                    }
                }
            };
            // A janitor may have reaped and unlinked the file while we waited on it.
            if !lock.identity_matches()? {
                tracing::info!(path = %path.display(), "lock file was replaced; retrying on the live path");
                continue;
            }
            lock.write_holder(&holder)?;
            if announced {
                report::line(&format!(
                    "== app lock: acquired {} after {:.1} s ==",
                    self.cfg.identity.domain,
                    started.elapsed().as_secs_f64()
                ));
            }
            return Ok(LockOutcome::Held(lock));
        }
    }

    fn supervisor(&self) -> Supervisor<'_> {
        Supervisor {
            funnel: &self.funnel,
            kill_grace: self.cfg.kill_grace,
            deadline: self.cfg.deadline,
            forward_signals: false,
            teardown_timeout: self.cfg.teardown_timeout,
            hard_end: Some(self.hard_end),
            leaf: self.cgroup.as_ref().map(|c| &c.command),
        }
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
        let supervisor = Supervisor {
            funnel: &self.funnel,
            kill_grace: self.cfg.kill_grace,
            deadline: self.cfg.deadline,
            forward_signals: false,
            teardown_timeout: self.cfg.teardown_timeout,
            hard_end: Some(self.hard_end),
            leaf: self.cgroup.as_ref().map(|c| &c.command),
        };
        let stopped = supervisor.start_and_stop(&spec, early, &mut |reason| {
            watchdog.set_exit_code(reason.exit_code());
            record.shutdown_reason = Some(reason.name());
            record.enter("teardown");
            if let Err(err) = record.write(record_path) {
                tracing::warn!(path = %record_path.display(), "failed to write run record: {err}");
            }
        });
        self.record.command_status = stopped
            .command_status
            .and_then(|s| serde_json::to_value(s).ok());
        self.record.killed_after_grace = stopped.killed_after_grace;
        for err in stopped.errors {
            self.teardown_error(err);
        }
        self.teardown(stopped.teardown_until);
        if self.teardown_timed_out {
            self.record.shutdown_reason = Some(TEARDOWN_TIMEOUT.to_owned());
        }
        let code = stopped.reason.exit_code();
        self.record.exit_code = Some(code);
        self.record.enter("finished");
        self.save();
        code
    }

    /// Everything after the command's group is gone, within `until`: leftovers killed, the
    /// hook (its share of the budget), app removal (the rest), state files. Signals are
    /// reported and ignored here; they can never extend it.
    fn teardown(&mut self, until: Instant) {
        self.kill_leftovers(until);
        if self.app_lock.is_none() {
            // Never held the app lock: the app, if any, is another run's. Hands off.
        } else if self.cfg.no_teardown {
            report::line("== --no-teardown: keeping the app; the next janitor sweep reaps it ==");
        } else {
            if let Some(hook) = self.cfg.on_teardown.clone() {
                self.run_hook(&hook, hook_share(Instant::now(), until));
                self.kill_leftovers(until);
            }
            let budget = until.saturating_duration_since(Instant::now());
            let (removed, errors) = janitor::remove_app_now(
                self.global,
                &self.docker,
                &self.cfg.identity.domain,
                budget,
            );
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
        for err in self.state.remove() {
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
        if let Err(err) = self.record.write(&self.record_path) {
            tracing::warn!(path = %self.record_path.display(), "failed to write run record: {err}");
        }
    }
}
