//! `lock` and `locks`: a named lock's arguments, and the listing of every lock.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::cli::globals::GlobalArgs;
use crate::cli::parse::{
    any_duration, choice, conflict_exit_code, kill_grace, long_held, parse_pid, promote_after,
    teardown_timeout, unique_pids,
};
use crate::config::{Class, Global, LockConfig, Timing};
use crate::names::{LockName, NameError};

#[derive(Debug, Args)]
pub(crate) struct LockArgs {
    /// The lock's name: `<lock-dir>/ccci-<NAME>.lock`.
    pub name: String,
    /// Give up after DURATION (exit 75, or -E's code) [default: wait as long as it takes];
    /// flock(1)'s -w SECS, fractions too.
    #[arg(short = 'w', long, visible_alias = "timeout", value_name = "DURATION", allow_hyphen_values = true, value_parser = any_duration)]
    pub wait: Option<Duration>,
    /// Do not wait: give up at once (exit 75, or -E's code) when the lock is held or others
    /// queue ahead, as --wait 0 does (flock(1)'s -n, which exits 1).
    #[arg(short = 'n', long, visible_alias = "nb", conflicts_with = "wait")]
    pub nonblock: bool,
    /// The exit code when the lock is not acquired (--wait ran out, -n found it taken)
    /// [default: 75]: 1, 3-75 or 77-124, since ccci-run gives the others their own meaning
    /// (flock(1)'s -E, whose default is 1).
    #[arg(short = 'E', long, value_name = "CODE", value_parser = conflict_exit_code)]
    pub conflict_exit_code: Option<u8>,
    /// Queue class: fast tickets go before normal ones.
    #[arg(long, value_name = "CLASS", default_value = "normal", value_parser = choice::<Class>())]
    pub class: Class,
    /// A normal ticket that waited this long joins the fast class, keeping its place
    /// [env: CCCI_PROMOTE_AFTER; file: promote_after; default: 20m].
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, value_parser = promote_after)]
    pub promote_after: Option<Duration>,
    /// Time between the forwarded signal and SIGKILL of COMMAND's process group
    /// [env: CCCI_KILL_GRACE; file: kill_grace; default: 10s].
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, value_parser = kill_grace)]
    pub kill_grace: Option<Duration>,
    /// Time the rest of the teardown may take after the kill grace; then whatever is left is
    /// killed and ccci-run exits [env: CCCI_TEARDOWN_TIMEOUT; file: teardown_timeout;
    /// default: 5m].
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, value_parser = teardown_timeout)]
    pub teardown_timeout: Option<Duration>,
    /// Tear down when any of these processes exits; each must be an ancestor (the CI step
    /// shell's $$, and its parent, the runner).
    #[arg(long, value_name = "PID,...", env = "CCCI_TIE_TO", value_delimiter = ',', value_parser = parse_pid)]
    pub tie_to: Vec<i32>,
    /// Write Prometheus metrics here once the lock is taken (or the wait given up), atomically:
    /// every named lock's queue and last wait, and this host's live and unswept dead runs.
    #[arg(long, value_name = "FILE")]
    pub metrics_file: Option<PathBuf>,
    /// The command to run while holding the lock.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
    #[command(flatten)]
    pub global: GlobalArgs,
}

#[derive(Debug, Args)]
pub(crate) struct LocksArgs {
    /// Print the list as JSON (also `-o json`).
    #[arg(long)]
    pub json: bool,
    /// Every holder and note in full, nothing cut (also `-o wide`).
    #[arg(long)]
    pub wide: bool,
    /// The output: `table` (fits 100 columns), `wide` or `json`.
    #[arg(short = 'o', long = "output", value_name = "FORMAT", value_parser = ["table", "wide", "json"])]
    pub output: Option<String>,
    /// Flag a lock held for longer than DURATION
    /// [env: CCCI_LONG_HELD; file: long_held; default: 2h].
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, value_parser = long_held)]
    pub long_held: Option<Duration>,
    #[command(flatten)]
    pub global: GlobalArgs,
}

impl LocksArgs {
    pub(crate) fn json(&self) -> bool {
        self.json || self.output.as_deref() == Some("json")
    }

    pub(crate) fn wide(&self) -> bool {
        self.wide || self.output.as_deref() == Some("wide")
    }
}

impl LockArgs {
    pub(crate) fn validate(self, global: &Global) -> Result<LockConfig, NameError> {
        let t = &global.timings;
        if let Some(etcd) = &global.etcd {
            etcd.check_stop_budget(t.value(Timing::KillGrace))?;
        }
        Ok(LockConfig {
            name: LockName::parse(&self.name)?,
            wait: if self.nonblock {
                Some(Duration::ZERO)
            } else {
                self.wait
            },
            conflict_exit: self.conflict_exit_code.unwrap_or(crate::exit::LOCK_TIMEOUT),
            class: self.class,
            promote_after: t.value(Timing::PromoteAfter),
            kill_grace: t.value(Timing::KillGrace),
            teardown_timeout: t.value(Timing::TeardownTimeout),
            tie_to: unique_pids(&self.tie_to)?,
            cgroup: global.cgroup,
            lock_dir: global.lock_dir.clone(),
            metrics: self.metrics_file.map(|file| crate::config::MetricsTarget {
                file,
                global: global.clone(),
            }),
            command: self.command,
        })
    }
}
