//! What a sweep reports: the per-candidate lines, the table an operator reads and the JSON a
//! script reads (the same structure); its metrics are [`super::metrics`].

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use std::time::Duration;

use serde::Serialize;

use crate::app::RemovedResources;
use crate::janitor::decide::Decision;

/// Where a candidate was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Source {
    Env,
    Docker,
    /// A held app lock (a live run whose app has no `.env` or Docker object yet).
    Lock,
    /// A reap recorded as not confirmed (in the state dir): what it could not confirm gone
    /// may still be on a node, whether or not the `.env` is still there.
    Unreaped,
}

/// One candidate's line in the report.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct CandidateReport {
    pub domain: String,
    pub stack: String,
    pub sources: BTreeSet<Source>,
    pub decision: Decision,
    pub lock_age_s: Option<u64>,
    /// Who holds the domain's lock, as the lock names it (with the host, when locks are kept
    /// beyond one host).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holder: Option<crate::lock::Holder>,
    /// Why it was judged as it was: who holds it, or how its owner was found dead.
    pub why: Option<String>,
    pub removed: RemovedResources,
    /// In a dry run (or with Docker unreachable), what a reap would remove.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub would_remove: Option<RemovedResources>,
    pub error: Option<String>,
    /// What Docker showed of the app when it was found, each object with the rule that made it
    /// the app's (its stack label, or its name for what carries no label).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub objects: Vec<FoundObject>,
}

/// One Docker object of a candidate, and why it is the candidate's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct FoundObject {
    pub kind: &'static str,
    pub name: String,
    pub by: crate::docker::Match,
}

/// An object without a stack label named like a run app's (`<stack>_…`) that is no name the
/// app gives: kept, never removed, and said why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct KeptObject {
    /// The run app whose stack its name begins with.
    pub domain: String,
    pub kind: &'static str,
    pub name: String,
    pub why: String,
}

/// A cgroup of this configuration whose supervisor is dead, or cannot be judged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct DeadCgroup {
    pub path: PathBuf,
    /// The supervisor it names (`<pid>-<start>-<pidns>-<scope>`).
    pub supervisor: String,
    /// Processes it still held when found.
    pub processes: usize,
    /// Whether it is gone now (killed, emptied and removed).
    pub removed: bool,
    pub error: Option<String>,
    /// Why its supervisor could not be judged: then it is left alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unresolvable: Option<String>,
}

/// A process of this configuration whose supervisor is dead, or cannot be judged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct LeftoverProcess {
    /// Its pid as this sweep's `/proc` shows it.
    pub pid: i32,
    /// The pid of the supervisor it names, in that supervisor's namespace.
    pub supervisor: i32,
    /// Its `CCCI_SUPERVISOR` value.
    pub marker: String,
    /// Why its supervisor could not be judged: then it is left alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unresolvable: Option<String>,
}

/// The outcome of one sweep; `--json` prints it as is.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct SweepReport {
    pub dry_run: bool,
    pub candidates: Vec<CandidateReport>,
    /// Objects named like a run app's that are no name it gives: kept (in a dry run too).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub kept: Vec<KeptObject>,
    pub tidied: Vec<PathBuf>,
    pub errors: Vec<String>,
    /// What the sweep looked at and found missing: a directory that does not exist is most
    /// often a typo in a path, and it means nothing there was swept.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// Where the sweep looked, for the summary.
    #[serde(skip)]
    pub scanned: Vec<String>,
    /// Per-run directories removed by `--keep-runs` (or that would be, in a dry run).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runs_removed: Option<Vec<PathBuf>>,
    /// Entries of the runs dir that `--keep-runs` left alone although they are old enough:
    /// nothing proves them run directories of ours.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runs_kept: Option<Vec<Kept>>,
    /// Docker list calls this sweep made (one per resource kind), when Docker was used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub docker_list_calls: Option<usize>,
    /// Rounds of "is it gone yet?" polling (each one list call per kind), when Docker was used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub docker_poll_rounds: Option<usize>,
    /// Cgroups of dead runs and `lock` commands of this configuration, killed and removed (or
    /// that would be), and those whose supervisor could not be judged, left alone.
    pub dead_cgroups: Vec<DeadCgroup>,
    /// Processes of dead supervisors of this configuration found by their environment, killed
    /// (or that would be), and those whose supervisor could not be judged, left alone.
    pub leftover_processes: Vec<LeftoverProcess>,
    #[serde(skip)]
    pub duration: Duration,
    /// The host's named locks and runs, as the metrics file shows them.
    #[serde(skip)]
    pub host: Option<HostMetrics>,
}

impl SweepReport {
    /// True when a reap (or the sweep itself) failed, or a candidate could not be acted on (an
    /// unreadable lock file: its app stays, its runs fail): exit 1. Foreign candidates (not ours
    /// by design: a link, a directory, another user's file) carry their reason in `error` but
    /// are not failures.
    pub(crate) fn failed(&self) -> bool {
        !self.errors.is_empty()
            || self.candidates.iter().any(|c| {
                (c.error.is_some() && matches!(c.decision, Decision::Reap | Decision::WouldReap))
                    || matches!(c.decision, Decision::ReapIncomplete | Decision::Unreadable)
            })
    }

    pub(crate) fn count(&self, decision: Decision) -> usize {
        self.candidates
            .iter()
            .filter(|c| c.decision == decision)
            .count()
    }
}

/// The human-readable table.
pub(crate) fn render_table(report: &SweepReport, wide: bool) -> String {
    use crate::report::Column;
    let columns = [
        Column {
            header: "DOMAIN",
            cap: 33,
            right: false,
        },
        Column {
            header: "SOURCES",
            cap: 15,
            right: false,
        },
        Column {
            header: "DECISION",
            cap: 15,
            right: false,
        },
        Column {
            header: "LOCK AGE",
            cap: 8,
            right: true,
        },
    ];
    let mut rows = Vec::new();
    for c in &report.candidates {
        let sources: Vec<&str> = c
            .sources
            .iter()
            .map(|s| match s {
                Source::Env => "env",
                Source::Docker => "docker",
                Source::Lock => "lock",
                Source::Unreaped => "unreaped",
            })
            .collect();
        let age = crate::duration::age(c.lock_age_s);
        let detail = match &c.error {
            Some(err) => format!("error: {err}"),
            None if c.decision == Decision::Reap => format!("removed {}", c.removed.summary()),
            // A dry run says what a reap would remove, and by which rule each object is the
            // app's.
            None if c.decision == Decision::WouldReap => {
                let mut what: Vec<String> = c
                    .objects
                    .iter()
                    .map(|o| format!("{} {} (by {})", o.kind, o.name, o.by.as_str()))
                    .collect();
                if let Some(would) = &c.would_remove {
                    what.extend(
                        would
                            .env_files
                            .iter()
                            .map(|p| format!(".env {}", p.display())),
                    );
                    if would.lock_file {
                        what.push("its lock file".to_owned());
                    }
                }
                let why = c
                    .why
                    .as_deref()
                    .map(|w| format!("{w}; "))
                    .unwrap_or_default();
                let what = if what.is_empty() {
                    "nothing is left to remove".to_owned()
                } else {
                    format!("would remove {}", what.join(", "))
                };
                crate::names::visible(&format!("{why}{what}")).into_owned()
            }
            // Who it saw holding the app's lock.
            None if matches!(c.decision, Decision::Live | Decision::LongHeld) => {
                crate::names::visible(&format!(
                    "held by {}",
                    crate::lock::Holder::describe(c.holder.as_ref())
                ))
                .into_owned()
            }
            None => crate::names::visible(c.why.as_deref().unwrap_or_default()).into_owned(),
        };
        rows.push(vec![
            c.domain.clone(),
            sources.join(","),
            c.decision.as_str().to_owned(),
            age,
            detail,
        ]);
    }
    let table = crate::report::table(&columns, "DETAIL", &rows, wide);
    let mut out = String::new();
    for k in &report.kept {
        let _ = writeln!(
            out,
            "{}",
            crate::names::visible(&format!("kept {} {}: {}", k.kind, k.name, k.why))
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
    for kept in report.runs_kept.iter().flatten() {
        let path = crate::names::escape_outside(kept.path.as_os_str().as_encoded_bytes());
        let _ = writeln!(out, "left alone {path}: {}", kept.why);
    }
    for c in &report.dead_cgroups {
        let _ = match (&c.unresolvable, report.dry_run, c.removed) {
            (Some(why), ..) => writeln!(
                out,
                "left alone cgroup {} ({} process(es)): its supervisor cannot be judged: {why}",
                c.path.display(),
                c.processes
            ),
            (None, true, _) if c.processes == 0 => writeln!(
                out,
                "would remove the empty cgroup {} of a dead run",
                c.path.display(),
            ),
            (None, true, _) => writeln!(
                out,
                "would kill cgroup {} of a dead run ({} process(es))",
                c.path.display(),
                c.processes
            ),
            (None, false, true) if c.processes == 0 => writeln!(
                out,
                "removed the empty cgroup {} of a dead run",
                c.path.display(),
            ),
            (None, false, true) => writeln!(
                out,
                "killed cgroup {} of a dead run ({} process(es)) and removed it",
                c.path.display(),
                c.processes
            ),
            (None, false, false) => Ok(()),
        };
    }
    for p in &report.leftover_processes {
        let _ = match (&p.unresolvable, report.dry_run) {
            (Some(why), _) => writeln!(
                out,
                "left alone process {} (supervisor {}): it cannot be judged: {why}",
                p.pid, p.marker
            ),
            (None, true) => writeln!(
                out,
                "would kill process {} of a dead run (supervisor {})",
                p.pid, p.marker
            ),
            (None, false) => writeln!(
                out,
                "killed process {} of a dead run (supervisor {})",
                p.pid, p.marker
            ),
        };
    }
    // The errors go to stderr (`ccci-run: error: …`), never into the table.
    if !report.scanned.is_empty() {
        let _ = writeln!(out, "scanned: {}", report.scanned.join("; "));
    }
    let _ = writeln!(out, "{}", summary(report));
    if wide {
        return table + &out;
    }
    let notes: String = out
        .lines()
        .map(|line| crate::report::fit(line, crate::report::TABLE_WIDTH) + "\n")
        .collect();
    table + &notes
}

/// What a sweep tidied, by kind: lock files, dead waiters' tickets (files in a named lock's
/// `.queue` directory), and state files (the rest).
pub(crate) struct Tidied {
    pub locks: usize,
    pub tickets: usize,
    pub states: usize,
}

impl Tidied {
    pub(crate) fn of(report: &SweepReport) -> Self {
        let ticket = |p: &Path| {
            p.parent()
                .and_then(|d| d.extension())
                .is_some_and(|e| e == "queue")
        };
        let lock = |p: &Path| !ticket(p) && p.extension().is_some_and(|e| e == "lock");
        let locks = report.tidied.iter().filter(|p| lock(p)).count();
        let tickets = report.tidied.iter().filter(|p| ticket(p)).count();
        Self {
            locks,
            tickets,
            states: report.tidied.len() - locks - tickets,
        }
    }
}

/// "3 candidate(s), 1 reaped, 1 would be reaped, 2 lock file(s) and 1 state file(s) tidied in
/// 0.012 s": reaped and would-be-reaped apart (an unreachable engine turns a reap into the
/// latter even in a real sweep), lock files and state files apart.
fn summary(report: &SweepReport) -> String {
    let reaped = report.count(Decision::Reap);
    let would = report.count(Decision::WouldReap);
    let mut parts = vec![format!("{} candidate(s)", report.candidates.len())];
    if !report.dry_run {
        parts.push(format!("{reaped} reaped"));
    }
    if report.dry_run || would > 0 {
        parts.push(format!("{would} would be reaped"));
    }
    let Tidied {
        locks,
        tickets,
        states,
    } = Tidied::of(report);
    let verb = if report.dry_run { "to tidy" } else { "tidied" };
    let tickets = if tickets > 0 {
        format!(", {tickets} dead waiter's ticket(s)")
    } else {
        String::new()
    };
    parts.push(format!(
        "{locks} lock file(s){tickets} and {states} state file(s) {verb}"
    ));
    format!(
        "{} in {:.3} s{}",
        parts.join(", "),
        report.duration.as_secs_f64(),
        if report.dry_run {
            " (dry run: nothing changed)"
        } else {
            ""
        }
    )
}

/// One named lock's line in the metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct NamedLockMetrics {
    pub name: String,
    /// Tickets waiting, by class.
    pub fast: usize,
    pub normal: usize,
    /// How long the oldest waiter has waited (0 when nobody waits).
    pub oldest_waiter_s: f64,
    /// How long the last holder waited for it, when one has been recorded.
    pub last_wait_s: Option<f64>,
}

/// What the metrics say of this host's named locks and runs, and who said it (`lock` or
/// `janitor`: the `source` label keeps the two files apart in one textfile collector).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct HostMetrics {
    pub source: &'static str,
    pub host: String,
    pub named_locks: Vec<NamedLockMetrics>,
    /// Run directories whose guard a live run holds.
    pub runs_live: usize,
    /// Runs that died (no exit recorded, guard free) whose app still has its `.env`, and which
    /// no janitor has reaped yet.
    pub runs_dead_unswept: usize,
    /// Whether every look succeeded; what failed is logged.
    pub complete: bool,
}

/// An entry of the runs dir that retention left alone because nothing proves it a run
/// directory of ours, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Kept {
    /// The entry, escaped (its name comes from whoever made it).
    #[serde(serialize_with = "crate::names::serialize_path_escaped")]
    pub path: std::path::PathBuf,
    pub why: String,
}
