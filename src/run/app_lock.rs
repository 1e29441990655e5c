//! The app lock: taken in the run's class, with the fence armed where the lock can lapse; what
//! a predecessor left (its processes, its app, on every node of a swarm) cleared before the
//! command; and the lock confirmed ours before the app is touched.

use super::*;

impl Run<'_> {
    /// Before anything runs under the app lock: start the run's fence, its dead-man, and for
    /// a lock that can lapse behind our back (an etcd lease) feed it every renewal.
    pub(super) fn arm_fence(&mut self, lease: &dyn Lease) -> Result<Option<Fence>, RunError> {
        arm_fence(
            lease,
            &mut self.funnel,
            &fence::Target {
                cgroup: self.cgroup.as_ref().map(|c| c.cgroup.path()),
                owner: self.owner,
                label: &format!(
                    "run {} (the app lock of {})",
                    self.cfg.run_id, self.cfg.identity.domain
                ),
            },
        )
        .map(Some)
        .map_err(RunError::Fence)
    }

    /// Whether the app lock is no longer ours for sure: lost, or its fence has fired.
    pub(super) fn lock_gone(&self) -> bool {
        self.app_lock.as_deref().is_some_and(is_lost)
            || self.fence.as_ref().is_some_and(Fence::ended)
    }

    /// Right before a teardown step that acts on the app: is the app lock provably ours? When
    /// not, say why and leave the app alone.
    pub(super) fn lock_confirmed(&mut self, step: &str) -> bool {
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

    /// Step 5: the app lock, through the lock backend. Waits visibly for as long as the
    /// lock-wait budget allows; a signal or the deadline ends the wait at once.
    pub(super) fn take_app_lock(&mut self) -> Result<Taken, RunError> {
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
        let (record, record_path) = (&mut self.record, &self.record_path);
        let taken = self
            .locks
            .take(LockKey::App(domain), &wait, &mut |holder, so_far| {
                let held_by = Holder::describe(holder);
                if !waited {
                    // The wait may be long: the record says where the run is, and since when.
                    record.enter(Phase::Waiting);
                    save_or_warn(record, record_path);
                    report::line(&format!(
                        "== app lock: another run of {domain} is in flight — waiting; held by \
                         {held_by} =="
                    ));
                } else if !so_far.is_zero() {
                    // A wait begun again (the lock file a reaper unlinked under us, at a
                    // hand-off) is the same wait: said once, its time counted from the start.
                    report::line(&format!(
                        "== app lock: still waiting for {domain} after {} s; held by {held_by} ==",
                        started.elapsed().as_secs()
                    ));
                }
                waited = true;
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
    pub(super) fn lock_timed_out(&mut self, waited: Duration, lock: &str, detail: &str) -> u8 {
        let message = format!(
            "app lock {lock} for {} not acquired within {} s; {detail}",
            self.cfg.identity.domain,
            (waited.as_secs_f64() * 10.0).round() / 10.0,
        );
        report::line(&format!("ccci-run: error: {message}"));
        self.record.error = Some(message);
        self.record.exit_code = Some(exit::LOCK_TIMEOUT);
        self.record.enter(Phase::Finished);
        self.save();
        exit::LOCK_TIMEOUT
    }

    /// Holding the app lock: a holder line found in it names a run that died holding it (a
    /// SIGKILL, the OOM killer). Whatever that run left still running — its cgroup, every
    /// process naming it — is killed and confirmed gone before our command starts, whether or
    /// not it left an app; where that cannot be done, the line says why.
    pub(super) fn clear_predecessors(&mut self) -> Result<(), RunError> {
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
    pub(super) fn clear_leftovers(&mut self, sweeper: &dyn Sweeper) -> Result<(), RunError> {
        let domain = &self.cfg.identity.domain;
        let seam = match self.docker.get() {
            Some(Ok(seam)) => Some(seam),
            _ => None,
        };
        let given = self.given_names();
        let given_by = |d: &crate::names::AppDomain| given.of(d);
        let several = seam.is_some_and(|seam| seam.several_nodes());
        // Whether anything of the app is on record anywhere: its `.env`, what the manager
        // lists of its stack (tasks on any node, volumes), or a reap left unfinished. With
        // none, a node that is down or drained never ran it, and is not waited for.
        let recorded = app::app_has_leftovers(self.global, &self.docker, domain, &given_by)
            || app::unreaped_recorded(self.global, domain);
        if !several && !recorded {
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
        let start = Instant::now();
        let deadline = start + budget;
        let mut told = false;
        let mut kept_told = false;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let removal = app::remove_app_now(
                self.global,
                &self.docker,
                domain,
                &given_by,
                left,
                !recorded,
            );
            // What was kept is said once, not at every look while a node is waited for.
            for kept in removal.kept.iter().filter(|_| !kept_told) {
                report::line(&kept_line("app lock", kept));
            }
            kept_told = true;
            if removal.removed.counts().iter().any(|(_, n)| *n > 0) {
                report::line(&format!(
                    "== app lock: removed what a previous run of {domain} left: {} ==",
                    removal.removed.summary()
                ));
            }
            if removal.nodes.is_empty() {
                for err in removal.errors {
                    tracing::warn!("failed to clear leftovers of {domain}: {err}");
                }
                return Ok(());
            }
            // A node under maintenance (drained, or down) that may hold some of the stack is
            // waited for, within the lock wait; anything else is said at once.
            let out = seam.map(|seam| seam.nodes_out()).unwrap_or_default();
            let back = !out.is_empty()
                && Instant::now() < deadline
                && seam.is_some_and(|seam| {
                    if !told {
                        told = true;
                        report::line(&format!(
                            "== app lock: an earlier run of {domain} may have left containers or \
                             volumes on {}; waiting up to {:.1} s (the lock wait) for it to be back \
                             and swept ==",
                            out.join(", "),
                            deadline.saturating_duration_since(Instant::now()).as_secs_f64()
                        ));
                    }
                    seam.wait_nodes_back(deadline)
                });
            if !back {
                return Err(RunError::NodesNotClean {
                    stack: domain.stack_name(),
                    waited: start.elapsed(),
                    why: removal.nodes.join("; "),
                });
            }
        }
    }
}

impl<'a> Run<'a> {
    /// The names the run's app gives Docker's objects: its own recipe's (read before anything
    /// was deployed) and those every recorded run of its domain gave, read on first need.
    /// `None` when nothing says: then what carries no stack label is kept.
    pub(super) fn given_names(&self) -> GivenNames<'a> {
        GivenNames {
            runs_dir: &self.global.runs_dir,
            domain: &self.cfg.identity.domain,
            own: self.record.given_names.clone(),
            read: std::cell::OnceCell::new(),
        }
    }
}

/// [`Run::given_names`]: the run app's given names, its runs' records read on first need.
pub(super) struct GivenNames<'a> {
    runs_dir: &'a std::path::Path,
    domain: &'a crate::names::AppDomain,
    own: Option<crate::names::GivenNames>,
    read: std::cell::OnceCell<Option<crate::names::GivenNames>>,
}

impl GivenNames<'_> {
    /// The names `domain`'s app gives, when it is the run's (no other app's are known here).
    pub(super) fn of(&self, domain: &crate::names::AppDomain) -> Option<crate::names::GivenNames> {
        if domain != self.domain {
            return None;
        }
        self.read
            .get_or_init(|| {
                let mut recorded =
                    crate::rundir::given_names(self.runs_dir).remove(self.domain.as_str());
                match (&mut recorded, &self.own) {
                    (Some(all), Some(own)) => all.merge(own),
                    (None, Some(own)) => recorded = Some(own.clone()),
                    _ => {}
                }
                recorded
            })
            .clone()
    }
}

/// The line that says an object named like the app's was kept, and why.
pub(super) fn kept_line(step: &str, kept: &crate::docker::Kept) -> String {
    crate::names::visible(&format!(
        "== {step}: kept {} {}: {} ==",
        kept.kind, kept.name, kept.why
    ))
    .into_owned()
}
