//! The run's end: the command supervised until a way out, then one teardown — the teardown
//! hook, the app removed while the lock is provably ours, what is left of the command killed —
//! each step within its share of what is left before the hard end.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::run::{Run, TEARDOWN_TIMEOUT, save_or_warn, supervisor};
use crate::rundir::phase::Phase;
use crate::supervise::process::CommandSpec;
use crate::supervise::shutdown::{ChildStatus, Event, ShutdownReason};
use crate::{app, report};

impl Run<'_> {
    /// Start the command (unless a way out already happened), wait for a way out, tear down.
    pub(super) fn supervise_and_tear_down(&mut self, early: VecDeque<Event>) -> u8 {
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
        let stopped = supervisor.start_and_stop(&spec, early, &mut || {}, &mut |reason| {
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
        crate::supervise::ignored::summarise_ignored();
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
    pub(super) fn teardown(&mut self, until: Instant) {
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
    pub(super) fn tear_down_app(&mut self, until: Instant) {
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
        let domain = &self.cfg.identity.domain;
        let given = self.given_names();
        let given_by = |d: &crate::names::AppDomain| given.of(d);
        let app::Removal {
            removed,
            errors,
            kept,
            ..
        } = app::remove_app_now(self.global, &self.docker, domain, &given_by, budget, false);
        for kept in &kept {
            report::line(&super::app_lock::kept_line("teardown", kept));
        }
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

    pub(super) fn run_hook(&mut self, hook: &str, until: Instant) {
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

    pub(super) fn kill_leftovers(&mut self, until: Instant) {
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
    pub(super) fn remove_cgroup(&mut self) {
        let Some(cgroups) = &self.cgroup else {
            return;
        };
        if let Err(err) = cgroups.cgroup.remove() {
            let message = format!("{err}; the next janitor sweep removes it");
            tracing::warn!("{message}");
        }
    }

    pub(super) fn teardown_error(&mut self, message: String) {
        report::line(&format!("!! teardown: {message}"));
        self.record.teardown_errors.push(message);
    }
}

/// Of what is left of a teardown budget, the part the hook may use: everything but what app
/// removal needs (half of what is left, at most [`REMOVAL_RESERVE`]).
pub(super) fn hook_share(now: Instant, until: Instant) -> Instant {
    let left = until.saturating_duration_since(now);
    until - (left / 2).min(REMOVAL_RESERVE)
}

/// What app removal keeps of the teardown budget when a hook runs first.
pub(super) const REMOVAL_RESERVE: Duration = Duration::from_secs(120);
