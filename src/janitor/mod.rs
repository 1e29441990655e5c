//! The flock-probe janitor: finds run apps, probes each app lock without blocking, and reaps
//! the apps whose owner is dead — while holding the probe lock.
//!
//! This folder holds the sweep ([`sweep`], here), the pure decision table
//! ([`decide`](mod@decide)), the reaping of dead runs' processes and apps ([`reap`]), the tidying
//! of orphaned lock and state files ([`tidy`]), the report ([`sweep_report`]: table, JSON), its
//! metrics ([`metrics`]), the candidates a sweep looks at ([`candidate`]) and the retention of
//! old run directories ([`retention`]). It must never reap an app whose lock it
//! does not hold, and a dry run changes nothing at all.
//!
//! A held lock means a live owner (the kernel releases a flock when its holder dies, however it
//! dies); a lock the probe can take means the owner is gone. Reaping under the probe lock closes
//! the race with a new run of the same domain: it blocks on the lock until the reap is over, then
//! sees the unlinked inode and retries on the live path.
//!
//! Invariants: only domains matching `RUN_APP_RE` are ever probed; a held lock is never stolen.
//! The decision is a pure function ([`decide`](fn@decide)) of what the probe saw; everything
//! else here only carries it out.
//!
//! Floor: commands (docs/architecture.md): imports the floors below, never another command.

pub(crate) mod candidate;
pub(crate) mod command;
pub(crate) mod decide;
pub(crate) mod metrics;
pub(crate) mod reap;
pub(crate) mod retention;
pub(crate) mod sweep_report;
pub(crate) mod tidy;

use std::collections::BTreeMap;
use std::io;
use std::time::Instant;

use crate::app::RemovedResources;
use crate::config::dirs::{self, Dir};
use crate::config::{DockerMode, Global, Hunt, SweepOptions};
use crate::docker::{DockerLink, DockerSeam, Reaped, StackResources};
use crate::janitor::candidate::{Candidate, discover_env};
use crate::janitor::decide::{Decision, Probe, decide};
use crate::janitor::reap::{finish_reap, not_in_cgroups, reap_dead_runs_cgroups, reap_leftovers};
use crate::janitor::sweep_report::{CandidateReport, Source, SweepReport};
use crate::janitor::tidy::tidy_state_files;
use crate::lock::backend::LockKind;
use crate::lock::backend::{Attempt, Lease, LockBackend, LockKey, is_lost};
use crate::names::AppDomain;
use crate::report as status;
use crate::supervise::identity::Scope;

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
                report.errors.push(format!(
                    "Docker is required (--docker required): {err}; {}",
                    crate::docker::REQUIRED_HINT
                ));
                None
            }
            Some(Err(err)) => {
                status::line(&format!(
                    "ccci-run: warning: janitor: {err}; apps that may have Docker resources are not reaped"
                ));
                Some(Self::Unavailable(err.0.clone()))
            }
        }
    }
}

/// One sweep over every candidate, then the tidy sweep of orphaned lock files.
pub(crate) fn sweep(global: &Global, opts: &SweepOptions, link: &DockerLink) -> SweepReport {
    match crate::lock::backend(global) {
        Ok(locks) => sweep_with(&*locks, global, opts, link),
        Err(err) => SweepReport {
            dry_run: opts.dry_run,
            // Deciding without the locks could reap a live app: decide nothing.
            errors: vec![err.to_string()],
            ..SweepReport::default()
        },
    }
}

/// [`sweep`] through a lock backend the caller already has (a run's, at its start).
pub(crate) fn sweep_with(
    locks: &dyn LockBackend,
    global: &Global,
    opts: &SweepOptions,
    link: &DockerLink,
) -> SweepReport {
    let started = Instant::now();
    let report = SweepReport {
        dry_run: opts.dry_run,
        ..SweepReport::default()
    };
    let mut sweep = Sweep {
        global,
        opts,
        locks,
        report,
        given: std::cell::OnceCell::new(),
    };
    sweep.run(link);
    sweep.report.duration = started.elapsed();
    sweep.report
}

/// One sweep's context: what every step needs, said once.
struct Sweep<'a> {
    global: &'a Global,
    opts: &'a SweepOptions,
    locks: &'a dyn LockBackend,
    report: SweepReport,
    /// The names each app's recorded runs gave, read from the runs dir on first need.
    given: std::cell::OnceCell<BTreeMap<String, crate::names::GivenNames>>,
}

/// The names the app of a domain gives, by what its runs recorded (read once, on first need).
fn given_by<'g>(
    cell: &'g std::cell::OnceCell<BTreeMap<String, crate::names::GivenNames>>,
    runs_dir: &'g std::path::Path,
) -> impl Fn(&AppDomain) -> Option<crate::names::GivenNames> + 'g {
    move |domain| {
        cell.get_or_init(|| crate::rundir::given_names(runs_dir))
            .get(domain.as_str())
            .cloned()
    }
}

/// A candidate to reap, its line in the report, and its probe lock, held until it is done.
struct ToReap<'c> {
    candidate: &'c Candidate,
    line: usize,
    lock: Box<dyn Lease>,
}

impl Sweep<'_> {
    fn run(&mut self, link: &DockerLink) {
        if let Err(err) = self.locks.prepare(!self.opts.dry_run) {
            self.report.errors.push(err.to_string());
            return;
        }
        self.report
            .scanned
            .push(format!("app locks in {}", self.locks.describe_store()));
        if let Some(missing) = self.locks.missing_store() {
            self.report.warnings.push(missing);
        }
        // Before any app is reaped: what dead runs still have running goes first, so no leftover
        // deploy or test script acts on an app while (or after) it is removed. Only this
        // configuration's: another's (a second runner, a test suite) is its own janitor's.
        let nearby = self.opts.hunt == Hunt::Nearby;
        let scope = self.scope();
        if let Some(scope) = scope {
            self.report.dead_cgroups =
                reap_dead_runs_cgroups(scope, &mut self.report.errors, self.opts.dry_run, nearby);
            if !self.opts.dry_run {
                crate::janitor::reap::mark_runs_swept(self.global, &self.report.dead_cgroups);
            }
            if !nearby {
                let found = reap_leftovers(scope, &mut self.report.errors, self.opts.dry_run);
                self.report.leftover_processes = not_in_cgroups(found, &self.report.dead_cgroups);
            }
        }
        let Some(mut docker) = DockerState::connect(link, &mut self.report) else {
            return;
        };
        self.report.scanned.push(
            match &docker {
                DockerState::Off => "Docker off",
                DockerState::On(_) => "Docker",
                DockerState::Unavailable(_) => "Docker unavailable",
            }
            .to_owned(),
        );
        let candidates = self.discover(&mut docker);
        let to_reap = self.probe_all(&candidates, &docker);
        if let (Hunt::Nearby, false, Some(scope)) = (self.opts.hunt, to_reap.is_empty(), scope) {
            // Still before any app goes: the environment scan, now that one is to be reaped.
            let found = reap_leftovers(scope, &mut self.report.errors, self.opts.dry_run);
            self.report.leftover_processes = not_in_cgroups(found, &self.report.dead_cgroups);
        }
        self.reap(to_reap, &docker);
        if let DockerState::On(seam) = &docker {
            self.report.docker_list_calls = Some(seam.list_calls());
            self.report.docker_poll_rounds = Some(seam.poll_rounds());
        }
        let (tidied, errors) = self
            .locks
            .tidy(&|domain| candidates.contains_key(domain), self.opts.dry_run);
        self.report.tidied.extend(tidied);
        self.report.errors.extend(errors);
        tidy_state_files(self.global, scope, self.opts, &mut self.report);
    }

    /// This configuration, named by its runs dir. A runs dir that does not exist holds no run:
    /// no cgroup or process is judged ours then.
    fn scope(&mut self) -> Option<Scope> {
        match Scope::of_runs_dir(&self.global.runs_dir) {
            Ok(scope) => Some(scope),
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                // No cgroup or process of this configuration is looked for.
                self.report
                    .warnings
                    .push(dirs::missing_line(Dir::Runs, &self.global.runs_dir));
                None
            }
            Err(err) => {
                self.report.errors.push(format!(
                    "failed to inspect runs dir {} (it names this configuration): {err}",
                    self.global.runs_dir.display()
                ));
                None
            }
        }
    }

    /// Every run app: from `.env` files, and from Docker when it is on. A Docker discovery
    /// that fails makes Docker unavailable for this sweep.
    fn discover(&mut self, docker: &mut DockerState<'_>) -> BTreeMap<AppDomain, Candidate> {
        let mut candidates = discover_env(self.global, &mut self.report);
        // Reaps left unconfirmed: the `.env` may be gone (a teardown hook, an operator), the
        // stack's copy on a node not.
        match crate::app::unreaped_domains(self.global) {
            Ok(domains) => {
                for domain in domains {
                    Candidate::of(&mut candidates, domain)
                        .sources
                        .insert(Source::Unreaped);
                }
            }
            Err(err) => self.report.errors.push(format!(
                "failed to list {}: {err}",
                crate::app::unreaped_dir(self.global).display()
            )),
        }
        // A held app lock is a live run even before its app has a `.env` or a Docker object:
        // listed, never reaped (a free lock without an app is nothing to say). The janitor's
        // own sweeps list them; the one at every run start stays as cheap as it was.
        if self.opts.hunt == Hunt::Everywhere {
            match self.locks.list(self.opts.long_held) {
                Ok(locks) => {
                    for lock in locks.iter().filter(|l| l.kind == LockKind::App && l.held) {
                        let Some(domain) = AppDomain::recognise(&lock.name, &self.global.pattern)
                        else {
                            continue;
                        };
                        Candidate::of(&mut candidates, domain)
                            .sources
                            .insert(Source::Lock);
                    }
                }
                // A lock dir that does not exist holds no lock: said once, where it is probed.
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(err) => self
                    .report
                    .errors
                    .push(format!("failed to list the app locks: {err}")),
            }
        }
        let DockerState::On(seam) = docker else {
            return candidates;
        };
        let given = given_by(&self.given, &self.global.runs_dir);
        match seam.discover(&self.global.pattern, &given) {
            Ok(stacks) => {
                for (domain, mut resources) in stacks {
                    // Named like the app's, but no name it gives: kept, and said so.
                    for kept in resources.kept.drain(..) {
                        self.report.kept.push(sweep_report::KeptObject {
                            domain: domain.to_string(),
                            kind: kept.kind,
                            name: kept.name,
                            why: kept.why,
                        });
                    }
                    if resources.is_empty() && !candidates.contains_key(&domain) {
                        continue;
                    }
                    let candidate = Candidate::of(&mut candidates, domain);
                    candidate.sources.insert(Source::Docker);
                    candidate.docker = Some(resources);
                }
            }
            Err(err) => {
                self.report.errors.push(err.to_string());
                *docker = DockerState::Unavailable(err.0);
            }
        }
        candidates
    }

    /// Probe every candidate; keep the probe locks of the ones to reap.
    fn probe_all<'c>(
        &mut self,
        candidates: &'c BTreeMap<AppDomain, Candidate>,
        docker: &DockerState<'_>,
    ) -> Vec<ToReap<'c>> {
        let mut to_reap = Vec::new();
        for candidate in candidates.values() {
            let (mut line, held) = self.probe(candidate);
            if line.decision == Decision::Reap {
                if let DockerState::Unavailable(why) = docker {
                    line.decision = Decision::WouldReap;
                    line.error = Some(format!("docker unavailable: {why}"));
                }
            }
            match (line.decision, held) {
                (Decision::Reap, Some(lock)) => to_reap.push(ToReap {
                    candidate,
                    line: self.report.candidates.len(),
                    lock,
                }),
                // We created this lock file only to probe an app that is gone: do not leave it.
                (Decision::Raced, Some(lock)) if !self.opts.dry_run => {
                    let _ = lock.remove();
                }
                // Any other probe lock is released right here.
                _ => {}
            }
            self.report.candidates.push(line);
        }
        to_reap
    }

    /// Docker resources first, several stacks at a time, each under its own probe lock, and
    /// confirmed gone before anything else of the app goes or the lock is released.
    fn reap(&mut self, to_reap: Vec<ToReap<'_>>, docker: &DockerState<'_>) {
        // A probe lock lost before the reap (an etcd lease that ran out) may be someone else's
        // lock by now, and the app theirs: hands off. For a lock that can be lost, the store
        // must say it is still ours, right before the removal.
        let (mut ready, mut lost) = (Vec::new(), Vec::new());
        for r in to_reap {
            match r.lock.confirm() {
                Ok(()) => ready.push(r),
                Err(why) => lost.push((r, why)),
            }
        }
        let to_reap = ready;
        for (r, why) in lost {
            self.not_ours_mid_reap(&r, &why);
        }
        let stacks: Vec<(AppDomain, StackResources)> = to_reap
            .iter()
            .map(|r| {
                let resources = r.candidate.docker.clone().unwrap_or_default();
                (r.candidate.domain.clone(), resources)
            })
            .collect();
        let reaped = match docker {
            // Also when the manager lists nothing of a stack: on a swarm of several nodes, what
            // another node holds of it is seen only by sweeping that node.
            DockerState::On(seam) if !stacks.is_empty() => {
                // Not past the time the probe locks are safely ours (a lease not renewed
                // meanwhile): what is not gone by then is the next sweep's.
                let safe = to_reap
                    .iter()
                    .filter_map(|r| r.lock.safe_until())
                    .min()
                    .map(|until| until.saturating_duration_since(std::time::Instant::now()));
                let budget = safe.map_or(self.opts.reap_budget, |safe| {
                    safe.min(self.opts.reap_budget)
                });
                let given = given_by(&self.given, &self.global.runs_dir);
                seam.reap(&self.global.pattern, &given, stacks, budget, false)
            }
            _ => vec![
                Reaped {
                    confirmed: true,
                    ..Reaped::default()
                };
                to_reap.len()
            ],
        };
        for (r, reaped) in to_reap.into_iter().zip(reaped) {
            if is_lost(&*r.lock) {
                self.lost_mid_reap(&r);
                continue;
            }
            let line = &mut self.report.candidates[r.line];
            let gone = reaped.gone();
            let problems = reaped.problems();
            line.removed.docker = reaped.removed;
            if gone {
                finish_reap(self.global, r.candidate, &*r.lock, line);
            } else {
                // The .env and the lock file stay, and the record in the state dir, which
                // nothing but a confirmed reap removes: they bring the next sweep back here.
                crate::app::record_unreaped(self.global, &r.candidate.domain);
                line.decision = Decision::ReapIncomplete;
                line.error = Some(problems.join("; "));
                status::line(&format!(
                    "ccci-run: warning: janitor: {} is not gone yet: {}",
                    r.candidate.domain,
                    problems.join("; ")
                ));
            }
            // Releasing the probe lock: only now may a new run of this domain go on.
            drop(r.lock);
        }
    }

    /// The probe lock of `r` was lost: leave the rest of the app (its `.env`) to the next
    /// sweep, which will find out whose it is.
    fn lost_mid_reap(&mut self, r: &ToReap<'_>) {
        self.leave_to_next_sweep(
            r,
            "the probe lock was lost (its lease ran out): left to the next sweep".to_owned(),
        );
    }

    /// The probe lock of `r` is not provably ours (`why`): leave the app to the next sweep.
    fn not_ours_mid_reap(&mut self, r: &ToReap<'_>, why: &str) {
        self.leave_to_next_sweep(
            r,
            format!("the probe lock is not provably ours ({why}): left to the next sweep"),
        );
    }

    /// Leave the rest of `r`'s app (its `.env`) to the next sweep, saying why.
    fn leave_to_next_sweep(&mut self, r: &ToReap<'_>, why: String) {
        let line = &mut self.report.candidates[r.line];
        line.decision = Decision::ReapIncomplete;
        status::line(&format!(
            "ccci-run: warning: janitor: {}: {why}",
            r.candidate.domain
        ));
        line.error = Some(why);
    }

    /// Probe one candidate's lock and decide. A lock taken for a `reap` (or `raced`) is
    /// handed back still held.
    fn probe(&self, candidate: &Candidate) -> (CandidateReport, Option<Box<dyn Lease>>) {
        let domain = &candidate.domain;
        let mut line = CandidateReport {
            domain: domain.to_string(),
            stack: domain.stack_name(),
            sources: candidate.sources.clone(),
            decision: Decision::Unreadable,
            lock_age_s: None,
            holder: None,
            why: None,
            removed: RemovedResources::default(),
            would_remove: None,
            error: None,
            objects: candidate
                .docker
                .iter()
                .flat_map(StackResources::listed)
                .map(|(kind, r)| sweep_report::FoundObject {
                    kind,
                    name: r.name.clone(),
                    by: r.by,
                })
                .collect(),
        };
        let mut held = None;
        let mut elsewhere = None;
        let probe = match self
            .locks
            .try_take(LockKey::App(domain), !self.opts.dry_run)
        {
            Err(err) if err.is_foreign() => Probe::Foreign(err.to_string()),
            Err(err) => Probe::Unreadable(err.to_string()),
            Ok(Attempt::Missing) => Probe::NoLockFile,
            Ok(Attempt::Held { age, holder, note }) => {
                elsewhere = note;
                line.holder = holder;
                Probe::Held { age }
            }
            Ok(Attempt::Taken { lease, current }) => {
                // A line left in a free lock names the holder that died holding it.
                line.holder = lease.holder();
                held = Some(lease);
                Probe::Acquired {
                    identity_ok: current,
                    app_present: candidate.docker.as_ref().is_some_and(|d| !d.is_empty())
                        || crate::app::app_present(self.global, domain)
                        || candidate.sources.contains(&Source::Unreaped),
                }
            }
        };
        if let Probe::Held { age: Some(age) } = &probe {
            line.lock_age_s = Some(age.as_secs());
        }
        line.decision = decide(&probe, self.opts.dry_run, self.opts.long_held);
        line.why = Some(match (&probe, &line.holder) {
            (Probe::Held { .. }, _) => format!(
                "its lock is held by {}",
                crate::lock::Holder::describe(line.holder.as_ref())
            ),
            (Probe::NoLockFile, _) => "it has no lock: no run holds it".to_owned(),
            (Probe::Acquired { .. }, Some(h)) => format!(
                "its lock was free: {} died holding it",
                crate::lock::Holder::describe(Some(h))
            ),
            (Probe::Acquired { .. }, None) => {
                "its lock was free, and names no holder: its last run let go of it".to_owned()
            }
            (Probe::Foreign(why) | Probe::Unreadable(why), _) => why.clone(),
        });
        if line.decision == Decision::WouldReap {
            line.would_remove = Some(RemovedResources {
                docker: candidate
                    .docker
                    .as_ref()
                    .map(StackResources::names)
                    .unwrap_or_default(),
                env_files: crate::app::env_files(&self.global.abra_home, domain)
                    .unwrap_or_default(),
                lock_file: matches!(probe, Probe::Acquired { .. }),
            });
        }
        tracing::debug!(%domain, ?probe, decision = line.decision.as_str(), "probed");
        match (&probe, line.decision, elsewhere) {
            // Defense in depth: a free app lock is not the last word while another account
            // says a live run owns the domain.
            (_, _, Some(note)) => {
                status::line(&format!(
                    "ccci-run: warning: janitor: {domain}: its lock under {} is free, but it is {note} (lock file \
                     deleted by hand, or a lock dir that differs between runs and janitor?); \
                     not reaping",
                    self.locks.describe(LockKey::App(domain))
                ));
                line.error = Some(note);
            }
            (Probe::Foreign(why), _, _) => {
                status::line(&format!("ccci-run: warning: janitor: {domain}: {why}"));
                line.error = Some(why.clone());
            }
            (Probe::Unreadable(why), _, _) => {
                tracing::warn!("janitor: {domain}: {why}");
                line.error = Some(why.clone());
            }
            (_, Decision::LongHeld, _) => status::line(&format!(
                "ccci-run: warning: lock for {domain} held >{} — possible leaked run; inspect with lslocks",
                crate::duration::show(self.opts.long_held)
            )),
            _ => {}
        }
        (line, held)
    }
}
