//! The Prometheus metrics a textfile collector reads: a sweep's, written after each janitor
//! run, and the host's (named locks and runs), gathered by the janitor and by `lock`.
//!
//! Floor: commands (docs/architecture.md): imports the floors below, never another command.

use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::app::RemovedResources;
use crate::janitor::decide::Decision;
use crate::janitor::sweep_report::{HostMetrics, NamedLockMetrics};
use crate::janitor::sweep_report::{SweepReport, Tidied};
use crate::rundir::record;

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
        crate::files::read_text(
            path,
            &crate::files::Rules::small(1 << 20)
                .trusted(crate::trust::runner().map(|(uid, _)| uid)),
        )
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
        .filter(|l| l.kind == crate::lock::backend::LockKind::Named)
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
                crate::lock::queue::wait::last_wait(&crate::lock::queue::wait::last_wait_path(
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
