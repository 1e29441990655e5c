//! What a sweep reports: the per-candidate lines, the table an operator reads, the JSON a script
//! reads (the same structure), and the Prometheus metrics a textfile collector reads.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};

use crate::rundir::record;
use std::time::{Duration, SystemTime};

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
struct Tidied {
    locks: usize,
    tickets: usize,
    states: usize,
}

impl Tidied {
    fn of(report: &SweepReport) -> Self {
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

/// Prometheus text format for node_exporter's textfile collector, written atomically and with
/// mode 0644 whatever the umask (node_exporter reads it as its own user). The last-success time
/// carries over from the previous file when this sweep failed.
pub(crate) fn write_metrics(path: &Path, report: &SweepReport) -> io::Result<()> {
    const LAST: &str = "ccci_janitor_last_success_timestamp_seconds";
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let last_success = if report.failed() {
        // The metrics dir is often shared (node_exporter's textfile dir): what is at our path
        // may be anything but our last file.
        // Believed only of our own file (or root's), and only a time that can have been: a
        // finite instant, not after now.
        crate::files::read_text(path, &crate::files::Rules::small(1 << 20).trusted())
            .ok()
            .and_then(|text| {
                text.lines()
                    .find_map(|l| l.strip_prefix(LAST)?.trim().parse::<f64>().ok())
            })
            .filter(|t| t.is_finite() && *t >= 0.0 && *t <= now)
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
    let tidied = Tidied::of(report);
    let _ = writeln!(
        out,
        "# HELP ccci_janitor_tidied_lock_files Orphaned lock files unlinked by the last sweep.\n\
         # TYPE ccci_janitor_tidied_lock_files gauge\nccci_janitor_tidied_lock_files {}",
        tidied.locks
    );
    let _ = writeln!(
        out,
        "# HELP ccci_janitor_tidied_state_files Orphaned state files of dead runs unlinked by the \
         last sweep.\n\
         # TYPE ccci_janitor_tidied_state_files gauge\nccci_janitor_tidied_state_files {}",
        tidied.states
    );
    let _ = writeln!(
        out,
        "# HELP ccci_janitor_tidied_tickets Dead waiters' queue tickets unlinked by the last \
         sweep.\n\
         # TYPE ccci_janitor_tidied_tickets gauge\nccci_janitor_tidied_tickets {}",
        tidied.tickets
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
    if let Some(host) = &report.host {
        out.push_str(&host_text(host));
    }
    crate::files::write_atomically(
        path,
        out.trim_end().as_bytes(),
        false,
        crate::files::Mode::WorldReadable,
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

/// Look at the named locks (through `backend`) and the runs of the configuration `global`.
pub(crate) fn gather(
    global: &crate::config::Global,
    backend: Option<&dyn crate::lock::backend::LockBackend>,
    source: &'static str,
) -> HostMetrics {
    let mut metrics = HostMetrics {
        source,
        host: nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_default(),
        complete: true,
        ..HostMetrics::default()
    };
    let long_held = global.timings.value(crate::config::Timing::LongHeld);
    let locks = match backend.map(|b| b.list(long_held)) {
        Some(Ok(locks)) => locks,
        Some(Err(err)) if err.kind() == io::ErrorKind::NotFound => Vec::new(),
        Some(Err(err)) => {
            tracing::warn!("failed to list the locks for the metrics: {err}");
            metrics.complete = false;
            Vec::new()
        }
        None => {
            metrics.complete = false;
            Vec::new()
        }
    };
    let now = SystemTime::now();
    for lock in locks
        .iter()
        .filter(|l| l.kind == crate::lock::list::LockKind::Named)
    {
        let queue = lock.queue.clone().unwrap_or_default();
        let local_queue = crate::names::queue_dir_of(&lock.path);
        // A local ticket is touched every few seconds: its age is its birth's, where the file
        // system keeps one. An etcd waiter's age is its holder line's start.
        let age = |t: &crate::lock::queue::QueuedTicket| -> f64 {
            std::fs::metadata(local_queue.join(t.ticket.file_name()))
                .and_then(|m| m.created())
                .ok()
                .and_then(|born| now.duration_since(born).ok())
                .map_or(t.age_s as f64, |d| d.as_secs_f64())
        };
        let last_wait = crate::names::LockName::parse(&lock.name)
            .ok()
            .and_then(|n| {
                crate::lock::queue::last_wait(&crate::lock::queue::last_wait_path(
                    &global.lock_dir,
                    &n,
                ))
            });
        metrics.named_locks.push(NamedLockMetrics {
            name: lock.name.clone(),
            fast: queue
                .iter()
                .filter(|t| t.ticket.class == crate::config::Class::Fast)
                .count(),
            normal: queue
                .iter()
                .filter(|t| t.ticket.class == crate::config::Class::Normal)
                .count(),
            oldest_waiter_s: queue.iter().map(age).fold(0.0, f64::max),
            last_wait_s: last_wait,
        });
    }
    metrics.named_locks.sort_by(|a, b| a.name.cmp(&b.name));
    let (live, dead) = count_runs(&global.runs_dir, &global.abra_home);
    metrics.runs_live = live;
    metrics.runs_dead_unswept = dead;
    metrics
}

/// Live runs, and dead ones whose app is still deployed (its `.env` is there) and unreaped.
fn count_runs(runs_dir: &Path, abra_home: &Path) -> (usize, usize) {
    use crate::rundir::{Liveness, probe};
    let (mut live, mut dead) = (0, 0);
    let Ok(entries) = std::fs::read_dir(runs_dir) else {
        return (0, 0);
    };
    // The server directories a sweep looks in, linked ones as it follows them.
    let servers: Vec<PathBuf> = crate::app::server_dirs(abra_home)
        .ok()
        .flatten()
        .map(|(dirs, _)| dirs.into_iter().map(|s| s.dir).collect())
        .unwrap_or_default();
    for entry in entries.flatten() {
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        match probe(&entry.path(), false) {
            Liveness::Live { holder } if !holder.trim().is_empty() => live += 1,
            Liveness::Free { guard, .. } => {
                let record =
                    record::RunRecord::read(&entry.path().join(crate::names::RUN_RECORD_FILE));
                drop(guard);
                if let Ok(record) = record {
                    let deployed = !record.domain.is_empty()
                        && servers
                            .iter()
                            .any(|s| s.join(format!("{}.env", record.domain)).exists());
                    if record.exit_code.is_none() && record.reaped.is_none() && deployed {
                        dead += 1;
                    }
                }
            }
            _ => {}
        }
    }
    (live, dead)
}

/// A label value, escaped as the text format wants.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The host's part of a metrics file.
fn host_text(m: &HostMetrics) -> String {
    let mut out = String::new();
    let source = label(m.source);
    let family = |out: &mut String, name: &str, help: &str| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
    };
    family(
        &mut out,
        "ccci_named_lock_queue_depth",
        "Tickets waiting for a named lock, by class.",
    );
    for l in &m.named_locks {
        let name = label(&l.name);
        for (class, n) in [("fast", l.fast), ("normal", l.normal)] {
            let _ = writeln!(
                out,
                "ccci_named_lock_queue_depth{{source=\"{source}\",lock=\"{name}\",class=\"{class}\"}} {n}"
            );
        }
    }
    family(
        &mut out,
        "ccci_named_lock_oldest_waiter_age_seconds",
        "How long the oldest waiter for a named lock has waited (0 when none waits).",
    );
    for l in &m.named_locks {
        let _ = writeln!(
            out,
            "ccci_named_lock_oldest_waiter_age_seconds{{source=\"{source}\",lock=\"{}\"}} {:.3}",
            label(&l.name),
            l.oldest_waiter_s
        );
    }
    family(
        &mut out,
        "ccci_named_lock_last_wait_seconds",
        "How long the last holder of a named lock waited for it.",
    );
    for l in &m.named_locks {
        if let Some(wait) = l.last_wait_s {
            let _ = writeln!(
                out,
                "ccci_named_lock_last_wait_seconds{{source=\"{source}\",lock=\"{}\"}} {wait:.3}",
                label(&l.name)
            );
        }
    }
    let host = label(&m.host);
    for (name, help, value) in [
        (
            "ccci_host_runs_live",
            "Runs live on this host.",
            m.runs_live,
        ),
        (
            "ccci_host_runs_dead_unswept",
            "Runs of this host that died with their app deployed, awaiting a janitor sweep.",
            m.runs_dead_unswept,
        ),
        (
            "ccci_host_metrics_complete",
            "1 when every look behind these metrics succeeded.",
            usize::from(m.complete),
        ),
    ] {
        family(&mut out, name, help);
        let _ = writeln!(out, "{name}{{source=\"{source}\",host=\"{host}\"}} {value}");
    }
    out
}

/// `lock --metrics-file`: the host's metrics alone, written as the janitor writes its own.
pub(crate) fn write_host_metrics(path: &Path, metrics: &HostMetrics) -> io::Result<()> {
    crate::files::write_atomically(
        path,
        host_text(metrics).trim_end().as_bytes(),
        false,
        crate::files::Mode::WorldReadable,
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped_and_every_lock_has_each_class() {
        let text = host_text(&HostMetrics {
            source: "lock",
            host: "a\"b\\c\nd".to_owned(),
            named_locks: vec![NamedLockMetrics {
                name: "ci".to_owned(),
                fast: 2,
                normal: 0,
                oldest_waiter_s: 1.5,
                last_wait_s: None,
            }],
            runs_live: 3,
            runs_dead_unswept: 1,
            complete: true,
        });
        assert!(text.contains(r#"host="a\"b\\c\nd""#), "{text}");
        assert!(
            text.contains(
                r#"ccci_named_lock_queue_depth{source="lock",lock="ci",class="normal"} 0"#
            )
        );
        assert!(
            text.contains(r#"ccci_named_lock_queue_depth{source="lock",lock="ci",class="fast"} 2"#)
        );
        // No wait recorded: no sample, the family still declared.
        assert!(
            !text.contains("ccci_named_lock_last_wait_seconds{"),
            "{text}"
        );
        assert!(text.contains("# TYPE ccci_named_lock_last_wait_seconds gauge"));
        assert!(text.contains("ccci_host_runs_dead_unswept{source=\"lock\""));
    }
}
