//! The flock-probe janitor: finds run apps, probes each app lock without blocking, and reaps
//! the apps whose owner is dead — while holding the probe lock.
//!
//! A held lock means a live owner (the kernel releases a flock when its holder dies, however it
//! dies); a lock the probe can take means the owner is gone. Reaping under the probe lock closes
//! the race with a new run of the same domain: it blocks on the lock until the reap is over, then
//! sees the unlinked inode and retries on the live path.
//!
//! Invariants: only domains matching `RUN_APP_RE` are ever probed; a held lock is never stolen;
//! a dry run changes nothing at all. The decision is a pure function ([`decide`]) of what the
//! probe saw; everything else here only carries it out.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use crate::app;
use crate::cgroup;
use crate::cli::{DockerMode, Global};
use crate::docker::{DockerError, DockerSeam, Reaped, RemovedNames, StackResources};
use crate::leftovers;
use crate::lock::{self, HeldLock, Holder, LockFile, TryLock};
use crate::names::{AppDomain, RunId};
use crate::record::{self, RunRecord};
use crate::report;
use crate::rundir;
use crate::state;

/// Where a candidate was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Env,
    Docker,
}

/// What the probe of one app lock saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// We took the lock. `identity_ok`: the path still names the locked inode; `app_present`:
    /// the app was still there once we held it.
    Acquired {
        identity_ok: bool,
        app_present: bool,
    },
    /// There is no lock file (dry runs do not create one): nobody can hold it.
    NoLockFile,
    /// Someone holds it; its file was last touched `age` ago.
    Held { age: Option<Duration> },
    /// The lock file could not be opened or locked.
    Unreadable(String),
    /// The lock file is not ours: a symlink, not a regular file, or another user's.
    Foreign(String),
}

/// The janitor's verdict on one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Decision {
    Reap,
    WouldReap,
    Raced,
    Live,
    LongHeld,
    Unreadable,
    Foreign,
    /// Reaped, but the engine still listed some of it when the reap budget ran out (or a
    /// network of it is held by another stack): the lock file stays for the next sweep.
    ReapIncomplete,
}

impl Decision {
    pub const ALL: [Decision; 8] = [
        Decision::Reap,
        Decision::WouldReap,
        Decision::Raced,
        Decision::Live,
        Decision::LongHeld,
        Decision::Unreadable,
        Decision::Foreign,
        Decision::ReapIncomplete,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reap => "reap",
            Self::WouldReap => "would-reap",
            Self::Raced => "raced",
            Self::Live => "live",
            Self::LongHeld => "long-held",
            Self::Unreadable => "unreadable",
            Self::Foreign => "foreign",
            Self::ReapIncomplete => "reap-incomplete",
        }
    }
}

/// The decision table: pure, no I/O.
pub fn decide(probe: &Probe, dry_run: bool, long_held: Duration) -> Decision {
    let reap = if dry_run {
        Decision::WouldReap
    } else {
        Decision::Reap
    };
    match probe {
        Probe::Acquired {
            identity_ok: true,
            app_present: true,
        } => reap,
        // The inode was unlinked under us, or the app vanished before we held the lock:
        // another janitor got there first.
        Probe::Acquired { .. } => Decision::Raced,
        Probe::NoLockFile => reap,
        Probe::Held { age: Some(age) } if *age > long_held => Decision::LongHeld,
        Probe::Held { .. } => Decision::Live,
        Probe::Unreadable(_) => Decision::Unreadable,
        Probe::Foreign(_) => Decision::Foreign,
    }
}

/// Options of one sweep.
#[derive(Debug, Clone)]
pub struct SweepOptions {
    pub dry_run: bool,
    pub long_held: Duration,
    /// How long the Docker side of the reaps may take, confirmation included.
    pub reap_budget: Duration,
}

/// What was removed for one candidate: its Docker resources (flattened into the contract's
/// `removed` object), its `.env` files, its lock file.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RemovedResources {
    #[serde(flatten)]
    pub docker: RemovedNames,
    pub env_files: Vec<PathBuf>,
    pub lock_file: bool,
}

impl RemovedResources {
    /// "2 services, 1 network, 1 env file, lock file": what is there, in words.
    pub fn summary(&self) -> String {
        let parts: Vec<String> = self
            .counts()
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(kind, n)| {
                let singular = kind.trim_end_matches('s').replace('_', " ");
                match (*kind, *n) {
                    ("lock_files", _) => "lock file".to_owned(),
                    (_, 1) => format!("1 {singular}"),
                    (_, n) => format!("{n} {}", kind.replace('_', " ")),
                }
            })
            .collect();
        if parts.is_empty() {
            "nothing".to_owned()
        } else {
            parts.join(", ")
        }
    }

    fn nothing_but_lock_file(&self) -> bool {
        self.counts()[..7].iter().all(|(_, n)| *n == 0)
    }

    /// How many of each kind, in a fixed order.
    pub fn counts(&self) -> [(&'static str, usize); 8] {
        [
            ("services", self.docker.services.len()),
            ("containers", self.docker.containers.len()),
            ("networks", self.docker.networks.len()),
            ("volumes", self.docker.volumes.len()),
            ("secrets", self.docker.secrets.len()),
            ("configs", self.docker.configs.len()),
            ("env_files", self.env_files.len()),
            ("lock_files", usize::from(self.lock_file)),
        ]
    }
}

/// One candidate's line in the report.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateReport {
    pub domain: String,
    pub stack: String,
    pub sources: BTreeSet<Source>,
    pub decision: Decision,
    pub lock_age_s: Option<u64>,
    pub removed: RemovedResources,
    pub error: Option<String>,
}

/// The outcome of one sweep; `--json` prints it as is.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SweepReport {
    pub dry_run: bool,
    pub candidates: Vec<CandidateReport>,
    pub tidied: Vec<PathBuf>,
    pub errors: Vec<String>,
    /// Per-run directories removed by `--keep-runs` (or that would be, in a dry run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runs_removed: Option<Vec<PathBuf>>,
    /// Docker list calls this sweep made (one per resource kind), when Docker was used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub docker_list_calls: Option<usize>,
    /// Rounds of "is it gone yet?" polling (each one list call per kind), when Docker was used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub docker_poll_rounds: Option<usize>,
    /// Cgroups of dead runs and `lock` commands, killed and removed (or that would be).
    pub dead_cgroups: Vec<cgroup::Orphan>,
    /// Processes of dead supervisors found by their environment, killed (or that would be).
    pub leftover_processes: Vec<leftovers::Leftover>,
    #[serde(skip)]
    pub duration: Duration,
}

impl SweepReport {
    /// True when a reap (or the sweep itself) failed: exit 1. Skipped candidates (unreadable,
    /// foreign) carry their reason in `error` but are not failures.
    pub fn failed(&self) -> bool {
        !self.errors.is_empty()
            || self.candidates.iter().any(|c| {
                (c.error.is_some() && matches!(c.decision, Decision::Reap | Decision::WouldReap))
                    || c.decision == Decision::ReapIncomplete
            })
    }

    pub fn count(&self, decision: Decision) -> usize {
        self.candidates
            .iter()
            .filter(|c| c.decision == decision)
            .count()
    }
}

/// A run app found on disk (or, later, in Docker).
#[derive(Debug, Clone)]
pub struct Candidate {
    pub domain: AppDomain,
    pub sources: BTreeSet<Source>,
    /// Its Docker resources, when Docker discovery found any.
    pub docker: Option<StackResources>,
}

/// Run-app domains from `<abra-home>/servers/*/<domain>.env`, filtered by `RUN_APP_RE`.
/// Unreadable server directories are reported, odd names skipped, nothing ever followed.
pub fn discover_env(global: &Global, errors: &mut Vec<String>) -> BTreeMap<AppDomain, Candidate> {
    let mut found = BTreeMap::new();
    let servers = global.abra_home.join("servers");
    let entries = match std::fs::read_dir(&servers) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return found,
        Err(err) => {
            errors.push(format!("failed to list {}: {err}", servers.display()));
            return found;
        }
    };
    for server in entries.flatten() {
        if !server.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let files = match std::fs::read_dir(server.path()) {
            Ok(files) => files,
            Err(err) => {
                errors.push(format!("failed to list {}: {err}", server.path().display()));
                continue;
            }
        };
        for file in files.flatten() {
            if !file
                .file_type()
                .is_ok_and(|t| t.is_file() || t.is_symlink())
            {
                continue;
            }
            let name = file.file_name();
            if let Some(domain) = name
                .to_str()
                .and_then(|n| global.pattern.domain_of_env_file(n))
            {
                found
                    .entry(domain.clone())
                    .or_insert_with(|| Candidate {
                        domain,
                        sources: BTreeSet::new(),
                        docker: None,
                    })
                    .sources
                    .insert(Source::Env);
            }
        }
    }
    found
}

/// Docker as this sweep sees it.
enum DockerState<'a> {
    Off,
    On(&'a DockerSeam),
    /// `--docker auto` and the engine did not answer: nothing that may have Docker resources
    /// is reaped, since deleting its `.env` would lose the trace of a stack still running.
    Unavailable(String),
}

impl<'a> DockerState<'a> {
    fn connect(link: &'a DockerLink, report: &mut SweepReport) -> Option<Self> {
        match link.get() {
            None => Some(Self::Off),
            Some(Ok(seam)) => Some(Self::On(seam)),
            Some(Err(err)) if link.mode() == DockerMode::Required => {
                report.errors.push(format!("Docker is required: {err}"));
                None
            }
            Some(Err(err)) => {
                report::line(&format!(
                    "!! janitor: {err}; apps that may have Docker resources are not reaped"
                ));
                Some(Self::Unavailable(err.0.clone()))
            }
        }
    }
}

/// One Docker connection, made on first use and kept: a run (or a janitor) negotiates the
/// API version once, whatever it asks of the engine later.
pub struct DockerLink {
    mode: DockerMode,
    seam: std::cell::OnceCell<Result<DockerSeam, DockerError>>,
}

impl DockerLink {
    pub fn new(mode: DockerMode) -> Self {
        Self {
            mode,
            seam: std::cell::OnceCell::new(),
        }
    }

    pub fn mode(&self) -> DockerMode {
        self.mode
    }

    /// `None` with `--docker off`; otherwise the connection, made now if it was not yet.
    pub fn get(&self) -> Option<Result<&DockerSeam, &DockerError>> {
        if self.mode == DockerMode::Off {
            return None;
        }
        Some(self.seam.get_or_init(DockerSeam::connect).as_ref())
    }
}

/// One sweep over every candidate, then the tidy sweep of orphaned lock files.
pub fn sweep(global: &Global, opts: &SweepOptions, link: &DockerLink) -> SweepReport {
    let started = Instant::now();
    let mut report = SweepReport {
        dry_run: opts.dry_run,
        ..SweepReport::default()
    };
    let dir_check = if opts.dry_run {
        lock::check_dir(&global.lock_dir).or_else(|err| match err {
            // A dry run creates nothing: a missing lock dir simply holds no locks.
            _ if !global.lock_dir.exists() => Ok(()),
            err => Err(err),
        })
    } else {
        lock::prepare_dir(&global.lock_dir)
    };
    if let Err(err) = dir_check {
        report.errors.push(err.to_string());
        report.duration = started.elapsed();
        return report;
    }
    // Before any app is reaped: what dead runs still have running goes first, so no leftover
    // deploy or test script acts on an app while (or after) it is removed.
    let (dead_cgroups, leftover_processes) =
        reap_dead_runs_processes(&mut report.errors, opts.dry_run);
    report.dead_cgroups = dead_cgroups;
    report.leftover_processes = leftover_processes;
    let Some(mut docker) = DockerState::connect(link, &mut report) else {
        report.duration = started.elapsed();
        return report;
    };
    let mut candidates = discover_env(global, &mut report.errors);
    if let DockerState::On(seam) = &docker {
        match seam.discover(&global.pattern) {
            Ok(stacks) => {
                for (domain, resources) in stacks {
                    let candidate = candidates
                        .entry(domain.clone())
                        .or_insert_with(|| Candidate {
                            domain,
                            sources: BTreeSet::new(),
                            docker: None,
                        });
                    candidate.sources.insert(Source::Docker);
                    candidate.docker = Some(resources);
                }
            }
            Err(err) => {
                report.errors.push(err.to_string());
                docker = DockerState::Unavailable(err.0);
            }
        }
    }

    // Probe every candidate; keep the probe locks of the ones to reap.
    let mut to_reap: Vec<(&Candidate, usize, HeldLock)> = Vec::new();
    for candidate in candidates.values() {
        let (mut line, mut held) = probe(global, opts, candidate);
        // Defense in depth: a free app lock is not the last word while the runs dir says a live
        // run owns the domain (its lock file deleted by hand, or a lock dir that differs between
        // the run and this janitor).
        if matches!(line.decision, Decision::Reap | Decision::WouldReap) {
            if let Some(run_id) = owner_by_runs_dir(global, &candidate.domain) {
                let detail = format!("held by run {run_id} under another lock dir");
                report::line(&format!(
                    "!! janitor: {}: its lock under {} is free, but run {run_id} is live and owns it \
                     (lock file deleted by hand, or a lock dir that differs between runs and \
                     janitor?); not reaping",
                    candidate.domain,
                    global.lock_dir.display()
                ));
                line.decision = Decision::Live;
                line.error = Some(detail);
                held = None;
            }
        }
        if line.decision == Decision::Reap {
            if let DockerState::Unavailable(why) = &docker {
                line.decision = Decision::WouldReap;
                line.error = Some(format!("docker unavailable: {why}"));
            }
        }
        match (line.decision, held) {
            (Decision::Reap, Some(lock)) => {
                to_reap.push((candidate, report.candidates.len(), lock));
            }
            // We created this lock file only to probe an app that is gone: do not leave it.
            (Decision::Raced, Some(lock)) if !opts.dry_run => {
                let _ = lock.unlink();
            }
            // Any other probe lock is released right here.
            _ => {}
        }
        report.candidates.push(line);
    }

    // Docker resources first, several stacks at a time, each under its own probe lock, and
    // confirmed gone before anything else of the app goes or the lock is released.
    let stacks: Vec<(AppDomain, StackResources)> = to_reap
        .iter()
        .map(|(candidate, _, _)| {
            (
                candidate.domain.clone(),
                candidate.docker.clone().unwrap_or_default(),
            )
        })
        .collect();
    let reaped = match &docker {
        DockerState::On(seam) if stacks.iter().any(|(_, s)| !s.is_empty()) => {
            seam.reap(&global.pattern, stacks, opts.reap_budget)
        }
        _ => vec![
            Reaped {
                confirmed: true,
                ..Reaped::default()
            };
            to_reap.len()
        ],
    };
    for ((candidate, i, lock), reaped) in to_reap.into_iter().zip(reaped) {
        let line = &mut report.candidates[i];
        let gone = reaped.gone();
        let problems = reaped.problems();
        line.removed.docker = reaped.removed;
        if gone {
            finish_reap(global, candidate, &lock, line);
        } else {
            // The .env and the lock file stay: they bring the next sweep back to this stack.
            line.decision = Decision::ReapIncomplete;
            line.error = Some(problems.join("; "));
            report::line(&format!(
                "!! janitor: {} is not gone yet: {}",
                candidate.domain,
                problems.join("; ")
            ));
        }
        // Releasing the probe lock: only now may a new run of this domain go on.
        drop(lock);
    }
    if let DockerState::On(seam) = &docker {
        report.docker_list_calls = Some(seam.list_calls());
        report.docker_poll_rounds = Some(seam.poll_rounds());
    }
    tidy(global, &global.lock_dir, opts, &candidates, &mut report);
    tidy(
        global,
        &rundir::domains_dir(&global.runs_dir),
        opts,
        &candidates,
        &mut report,
    );
    tidy_state_files(global, opts, &mut report);
    report.duration = started.elapsed();
    report
}

/// Remove the state files of runs that are dead: their run's guard lock is free (or gone), or
/// held by a later run with the same id under another pid. A SIGKILLed run cannot remove its own.
fn tidy_state_files(global: &Global, opts: &SweepOptions, report: &mut SweepReport) {
    let entries = match std::fs::read_dir(&global.state_dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return,
        Err(err) => {
            report.errors.push(format!(
                "failed to list state dir {} (--state-dir, CCCI_STATE_DIR): {err}",
                global.state_dir.display()
            ));
            return;
        }
    };
    let us = nix::unistd::Uid::effective().as_raw();
    let mut runs: BTreeMap<String, RunState> = BTreeMap::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((run_id, pid)) = name.to_str().and_then(state::parse_file_name) else {
            continue;
        };
        if !entry
            .file_type()
            .is_ok_and(|t| t.is_file() || t.is_symlink())
        {
            continue;
        }
        // Only our own files: in a shared /tmp a name alone proves nothing.
        if std::fs::symlink_metadata(entry.path())
            .map(|m| std::os::unix::fs::MetadataExt::uid(&m) != us)
            .unwrap_or(true)
        {
            continue;
        }
        let state = *runs
            .entry(run_id.as_str().to_owned())
            .or_insert_with(|| run_state(global, &run_id));
        let dead = match state {
            RunState::Dead => true,
            // A later run with the same id (Drone reuses build numbers) under another pid.
            RunState::Live(holder) => holder != pid,
            RunState::Unknown => false,
        };
        if !dead {
            continue;
        }
        let path = entry.path();
        if opts.dry_run {
            report.tidied.push(path);
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => report.tidied.push(path),
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => report.errors.push(format!(
                "failed to remove state file {}: {err}",
                path.display()
            )),
        }
    }
}

/// Whether a run id has a live run, judged by its guard lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RunState {
    /// No run with this id is live.
    Dead,
    /// The live run with this id has this pid.
    Live(u32),
    /// Live (or unreadable) but its pid unknown: keep everything rather than guess.
    Unknown,
}

fn run_state(global: &Global, run_id: &RunId) -> RunState {
    let guard = global
        .runs_dir
        .join(run_id.as_str())
        .join(rundir::GUARD_FILE);
    match LockFile::open_existing(&guard) {
        Ok(None) => RunState::Dead,
        Ok(Some(file)) => match file.try_lock() {
            Ok(TryLock::Acquired(_)) => RunState::Dead,
            Ok(TryLock::Busy(mut file)) => Holder::parse(&file.read_holder())
                .map_or(RunState::Unknown, |h| RunState::Live(h.pid)),
            Err(_) => RunState::Unknown,
        },
        Err(_) => RunState::Unknown,
    }
}

/// Probe one candidate's lock and decide. A lock taken for a `reap` (or `raced`) is handed
/// back still held.
fn probe(
    global: &Global,
    opts: &SweepOptions,
    candidate: &Candidate,
) -> (CandidateReport, Option<HeldLock>) {
    let domain = &candidate.domain;
    let path = global.lock_dir.join(domain.lock_file_name());
    let mut line = CandidateReport {
        domain: domain.to_string(),
        stack: domain.stack_name(),
        sources: candidate.sources.clone(),
        decision: Decision::Unreadable,
        lock_age_s: None,
        removed: RemovedResources::default(),
        error: None,
    };
    let opened = if opts.dry_run {
        LockFile::open_existing(&path)
    } else {
        LockFile::open(&path).map(Some)
    };
    let mut held: Option<HeldLock> = None;
    let probe = match opened {
        Err(err) if err.is_foreign() => Probe::Foreign(err.to_string()),
        Err(err) => Probe::Unreadable(err.to_string()),
        Ok(None) => Probe::NoLockFile,
        Ok(Some(file)) => match file.try_lock() {
            Err(err) => Probe::Unreadable(err.to_string()),
            Ok(TryLock::Busy(file)) => Probe::Held { age: file.age() },
            Ok(TryLock::Acquired(lock)) => {
                let probe = match lock.identity_matches() {
                    Err(err) => Probe::Unreadable(err.to_string()),
                    Ok(identity_ok) => Probe::Acquired {
                        identity_ok,
                        app_present: candidate.docker.as_ref().is_some_and(|d| !d.is_empty())
                            || app_present(global, domain),
                    },
                };
                held = Some(lock);
                probe
            }
        },
    };
    if let Probe::Held { age: Some(age) } = &probe {
        line.lock_age_s = Some(age.as_secs());
    }
    line.decision = decide(&probe, opts.dry_run, opts.long_held);
    match (&probe, line.decision) {
        (Probe::Foreign(why), _) => {
            report::line(&format!("!! janitor: {domain}: {why}"));
            line.error = Some(why.clone());
        }
        (Probe::Unreadable(why), _) => {
            tracing::warn!("janitor: {domain}: {why}");
            line.error = Some(why.clone());
        }
        (_, Decision::LongHeld) => report::line(&format!(
            "!! lock for {domain} held >{}min — possible leaked run; inspect with lslocks",
            opts.long_held.as_secs() / 60
        )),
        _ => {}
    }
    (line, held)
}

/// Whether anything of `domain`'s app is there: its `.env`, or (Docker on) any resource of its
/// stack. An unreachable engine counts as "maybe": the removal that follows will say why.
pub fn app_has_leftovers(global: &Global, link: &DockerLink, domain: &AppDomain) -> bool {
    app_present(global, domain)
        || match link.get() {
            None => false,
            Some(Err(_)) => true,
            Some(Ok(seam)) => seam
                .discover(&global.pattern)
                .map(|stacks| stacks.get(domain).is_some_and(|s| !s.is_empty()))
                .unwrap_or(true),
        }
}

fn app_present(global: &Global, domain: &AppDomain) -> bool {
    app::env_files(&global.abra_home, domain).is_ok_and(|files| !files.is_empty())
}

/// After its Docker resources are gone: remove the app's `.env`, unlink the lock file (still
/// holding it), and mark the dead run's record.
fn finish_reap(
    global: &Global,
    candidate: &Candidate,
    lock: &HeldLock,
    line: &mut CandidateReport,
) {
    let domain = &candidate.domain;
    let holder = Holder::parse(&lock.read_holder());
    match app::remove(&global.abra_home, domain) {
        Ok(gone) => line.removed.env_files = gone.env_files,
        Err(err) => {
            line.error = Some(err.to_string());
            return;
        }
    }
    match lock.unlink() {
        Ok(unlinked) => line.removed.lock_file = unlinked,
        Err(err) => line.error = Some(err.to_string()),
    }
    if line.removed.nothing_but_lock_file() {
        // Everything was already gone: another janitor reaped it between our look and our lock.
        line.decision = Decision::Raced;
        return;
    }
    report::line(&format!("== janitor: reaped orphaned app {domain} =="));
    if let Some(holder) = holder {
        mark_run_reaped(global, &holder, domain);
    }
}

/// The run that owns `domain` by the runs dir's account (it holds the domain's lock in
/// `<runs-dir>/.domains/`), if any. A probe that finds the lock free lets go at once.
fn owner_by_runs_dir(global: &Global, domain: &AppDomain) -> Option<String> {
    let path = rundir::domains_dir(&global.runs_dir).join(domain.lock_file_name());
    match LockFile::open_existing(&path) {
        Ok(Some(file)) => match file.try_lock() {
            Ok(TryLock::Busy(mut file)) => Some(
                Holder::parse(&file.read_holder()).map_or_else(|| "?".to_owned(), |h| h.run_id),
            ),
            // Free, or unreadable: the app lock's verdict stands.
            _ => None,
        },
        _ => None,
    }
}

/// How long the Docker side of a reap may take by default, confirmation included.
pub const DEFAULT_REAP_BUDGET: Duration = Duration::from_secs(120);

/// How long killing the processes of dead runs may take in one sweep.
const DEAD_RUN_KILL_BUDGET: Duration = Duration::from_secs(10);

/// Kill (unless `dry_run`) every process of a dead run or `lock` command: their cgroups first,
/// then whatever the environment scan finds. Failures go to `errors`.
pub fn reap_dead_runs_processes(
    errors: &mut Vec<String>,
    dry_run: bool,
) -> (Vec<cgroup::Orphan>, Vec<leftovers::Leftover>) {
    let orphans = cgroup::reap_orphans(dry_run, DEAD_RUN_KILL_BUDGET);
    for orphan in &orphans {
        match &orphan.error {
            Some(err) => errors.push(err.clone()),
            None if !dry_run && orphan.processes > 0 => report::line(&format!(
                "== janitor: killed {} process(es) of a dead run in {} ==",
                orphan.processes,
                orphan.path.display()
            )),
            None => {}
        }
    }
    let found = leftovers::reap(dry_run);
    if !found.is_empty() && !dry_run {
        report::line(&format!(
            "== janitor: killed {} leftover process(es) of dead runs ==",
            found.len()
        ));
    }
    (orphans, found)
}

/// Remove one app right now, Docker resources first and confirmed gone, within `budget`: what
/// a run's own teardown does while it still holds its app lock. Returns what went and what
/// failed; when the stack is not confirmed gone, the `.env` stays for a later sweep.
pub fn remove_app_now(
    global: &Global,
    link: &DockerLink,
    domain: &AppDomain,
    budget: Duration,
) -> (RemovedResources, Vec<String>) {
    let mut removed = RemovedResources::default();
    if let Some(seam) = link.get() {
        let reaped = seam.map_err(Clone::clone).and_then(|seam| {
            let mut stacks = seam.discover(&global.pattern)?;
            Ok(match stacks.remove(domain) {
                Some(stack) if !stack.is_empty() => seam
                    .reap(&global.pattern, vec![(domain.clone(), stack)], budget)
                    .pop()
                    .unwrap_or_default(),
                _ => Reaped {
                    confirmed: true,
                    ..Reaped::default()
                },
            })
        });
        match reaped {
            Ok(reaped) if reaped.gone() => removed.docker = reaped.removed,
            Ok(reaped) => {
                let mut problems = reaped.problems();
                problems.push(format!(
                    "{domain} is not gone after {:.1} s; keeping its .env so the next sweep finishes the job",
                    budget.as_secs_f64()
                ));
                removed.docker = reaped.removed;
                return (removed, problems);
            }
            Err(err) => {
                // Keep the .env: without it nothing would lead a later sweep to the stack.
                return (
                    removed,
                    vec![format!(
                        "{err}; keeping the app's .env so a later sweep reaps the stack"
                    )],
                );
            }
        }
    }
    match app::remove(&global.abra_home, domain) {
        Ok(gone) => removed.env_files = gone.env_files,
        Err(err) => return (removed, vec![err.to_string()]),
    }
    (removed, Vec::new())
}

/// Note in the dead run's `run.json` that its app was reaped — only if that record is really
/// the holder's (same pid and domain) and no run with that id is live now.
fn mark_run_reaped(global: &Global, holder: &Holder, domain: &AppDomain) {
    let Ok(run_id) = RunId::parse(&holder.run_id) else {
        return;
    };
    let dir = global.runs_dir.join(run_id.as_str());
    let guard = match LockFile::open_existing(&dir.join(rundir::GUARD_FILE)) {
        Ok(Some(file)) => file,
        _ => return,
    };
    // Holding the run's guard keeps a new run with the same id from writing meanwhile.
    let Ok(TryLock::Acquired(_guard)) = guard.try_lock() else {
        return;
    };
    let path = dir.join(record::FILE_NAME);
    let Ok(mut record) = RunRecord::read(&path) else {
        return;
    };
    if record.pid != holder.pid || record.domain != domain.as_str() || record.reaped.is_some() {
        return;
    }
    record.reaped = Some(record::timestamp(SystemTime::now()));
    if let Err(err) = record.write(&path) {
        tracing::warn!(path = %path.display(), "failed to mark run record reaped: {err}");
    }
}

/// Unlink unheld run-app lock files that no candidate stands behind.
fn tidy(
    global: &Global,
    dir: &Path,
    opts: &SweepOptions,
    candidates: &BTreeMap<AppDomain, Candidate>,
    report: &mut SweepReport,
) {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return,
        Err(err) => {
            report
                .errors
                .push(format!("failed to list lock dir {}: {err}", dir.display()));
            return;
        }
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(domain) = name
            .to_str()
            .and_then(|n| global.pattern.domain_of_lock_file(n))
        else {
            continue;
        };
        if candidates.contains_key(&domain) {
            continue;
        }
        let path = entry.path();
        let file = match LockFile::open_existing(&path) {
            Ok(Some(file)) => file,
            Ok(None) => continue,
            Err(err) => {
                tracing::warn!("janitor: not tidying {}: {err}", path.display());
                continue;
            }
        };
        // Held: a live run that has not created its app yet. Leave it.
        let Ok(TryLock::Acquired(lock)) = file.try_lock() else {
            continue;
        };
        if opts.dry_run {
            if lock.identity_matches().unwrap_or(false) {
                report.tidied.push(path);
            }
            continue;
        }
        match lock.unlink() {
            Ok(true) => report.tidied.push(path),
            Ok(false) => {}
            Err(err) => report.errors.push(err.to_string()),
        }
    }
}

/// The human-readable table.
pub fn render_table(report: &SweepReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<40} {:<10} {:<11} {:>9}  DETAIL",
        "DOMAIN", "SOURCES", "DECISION", "LOCK AGE"
    );
    for c in &report.candidates {
        let sources: Vec<&str> = c
            .sources
            .iter()
            .map(|s| match s {
                Source::Env => "env",
                Source::Docker => "docker",
            })
            .collect();
        let age = c
            .lock_age_s
            .map(|s| humantime::format_duration(Duration::from_secs(s)).to_string())
            .unwrap_or_else(|| "-".to_owned());
        let detail = match &c.error {
            Some(err) => format!("error: {err}"),
            None if c.decision == Decision::Reap => format!("removed {}", c.removed.summary()),
            None => String::new(),
        };
        let _ = writeln!(
            out,
            "{:<40} {:<10} {:<11} {:>9}  {}",
            c.domain,
            sources.join(","),
            c.decision.as_str(),
            age,
            detail
        );
    }
    for path in &report.tidied {
        let verb = if report.dry_run {
            "would tidy"
        } else {
            "tidied"
        };
        let _ = writeln!(out, "{verb} {}", path.display());
    }
    for path in report.runs_removed.iter().flatten() {
        let verb = if report.dry_run {
            "would remove run dir"
        } else {
            "removed run dir"
        };
        let _ = writeln!(out, "{verb} {}", path.display());
    }
    for err in &report.errors {
        let _ = writeln!(out, "error: {err}");
    }
    let _ = writeln!(
        out,
        "{} candidate(s), {} {}, {} lock file(s) {} in {:.3} s{}",
        report.candidates.len(),
        report.count(Decision::Reap) + report.count(Decision::WouldReap),
        if report.dry_run {
            "would be reaped"
        } else {
            "reaped"
        },
        report.tidied.len(),
        if report.dry_run { "to tidy" } else { "tidied" },
        report.duration.as_secs_f64(),
        if report.dry_run {
            " (dry run: nothing changed)"
        } else {
            ""
        }
    );
    out
}

/// Prometheus text format for node_exporter's textfile collector, written atomically.
/// The last-success time carries over from the previous file when this sweep failed.
pub fn write_metrics(path: &Path, report: &SweepReport) -> io::Result<()> {
    const LAST: &str = "ccci_janitor_last_success_timestamp_seconds";
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let last_success = if report.failed() {
        std::fs::read_to_string(path).ok().and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix(LAST)?.trim().parse::<f64>().ok())
        })
    } else {
        Some(now)
    };
    let mut out = String::new();
    out.push_str("# HELP ccci_janitor_candidates Candidates of the last sweep, by decision.\n");
    out.push_str("# TYPE ccci_janitor_candidates gauge\n");
    for decision in Decision::ALL {
        let _ = writeln!(
            out,
            "ccci_janitor_candidates{{decision=\"{}\"}} {}",
            decision.as_str(),
            report.count(decision)
        );
    }
    out.push_str("# HELP ccci_janitor_removed Resources removed by the last sweep, by kind.\n");
    out.push_str("# TYPE ccci_janitor_removed gauge\n");
    let mut totals = RemovedResources::default().counts();
    for c in &report.candidates {
        for (total, (_, n)) in totals.iter_mut().zip(c.removed.counts()) {
            total.1 += n;
        }
    }
    for (kind, count) in totals {
        let _ = writeln!(out, "ccci_janitor_removed{{kind=\"{kind}\"}} {count}");
    }
    let _ = writeln!(
        out,
        "# HELP ccci_janitor_tidied_lock_files Orphaned lock files unlinked by the last sweep.\n\
         # TYPE ccci_janitor_tidied_lock_files gauge\nccci_janitor_tidied_lock_files {}",
        report.tidied.len()
    );
    let _ = writeln!(
        out,
        "# HELP ccci_janitor_sweep_duration_seconds Duration of the last sweep.\n\
         # TYPE ccci_janitor_sweep_duration_seconds gauge\nccci_janitor_sweep_duration_seconds {:.6}",
        report.duration.as_secs_f64()
    );
    let _ = writeln!(
        out,
        "# HELP ccci_janitor_sweep_failed 1 when the last sweep had a failed reap or error.\n\
         # TYPE ccci_janitor_sweep_failed gauge\nccci_janitor_sweep_failed {}",
        u8::from(report.failed())
    );
    if let Some(last) = last_success {
        let _ = writeln!(
            out,
            "# HELP {LAST} Unix time of the last sweep that completed without errors.\n\
             # TYPE {LAST} gauge\n{LAST} {last:.3}"
        );
    }
    record::write_atomically(path, out.trim_end().as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    const LONG: Duration = Duration::from_secs(7200);

    fn acquired(identity_ok: bool, app_present: bool) -> Probe {
        Probe::Acquired {
            identity_ok,
            app_present,
        }
    }

    #[rstest]
    #[case::orphan(acquired(true, true), false, Decision::Reap)]
    #[case::orphan_dry(acquired(true, true), true, Decision::WouldReap)]
    #[case::stale_inode(acquired(false, true), false, Decision::Raced)]
    #[case::stale_inode_dry(acquired(false, true), true, Decision::Raced)]
    #[case::app_gone(acquired(true, false), false, Decision::Raced)]
    #[case::no_lock_file(Probe::NoLockFile, true, Decision::WouldReap)]
    #[case::no_lock_file_real(Probe::NoLockFile, false, Decision::Reap)]
    #[case::live(Probe::Held { age: Some(Duration::from_secs(60)) }, false, Decision::Live)]
    #[case::live_unknown_age(Probe::Held { age: None }, false, Decision::Live)]
    #[case::at_threshold(Probe::Held { age: Some(LONG) }, false, Decision::Live)]
    #[case::long_held(Probe::Held { age: Some(LONG + Duration::from_secs(1)) }, false, Decision::LongHeld)]
    #[case::long_held_dry(Probe::Held { age: Some(LONG * 2) }, true, Decision::LongHeld)]
    #[case::unreadable(Probe::Unreadable("EIO".into()), false, Decision::Unreadable)]
    #[case::foreign(Probe::Foreign("symlink".into()), false, Decision::Foreign)]
    fn decision_table(#[case] probe: Probe, #[case] dry_run: bool, #[case] want: Decision) {
        assert_eq!(decide(&probe, dry_run, LONG), want);
    }

    #[test]
    fn a_held_lock_is_never_reaped_whatever_its_age() {
        for secs in [0, 1, 7200, 7201, u64::MAX / 2] {
            let d = decide(
                &Probe::Held {
                    age: Some(Duration::from_secs(secs)),
                },
                false,
                LONG,
            );
            assert!(matches!(d, Decision::Live | Decision::LongHeld), "{d:?}");
        }
    }
}
