//! `ccci-run locks`: every lock file in the lock dir, held or not, read without taking any lock.
//!
//! Holders come from `/proc/locks` (matched by device and inode), so looking never disturbs a
//! holder or a waiter, and a lock file that is not ours is described, never opened for writing.
//! `/proc/locks` hides the locks of processes outside our pid namespace, so a file of ours that
//! names a holder nobody here holds it for is tried once (and let go at once). What the holder
//! line names is judged from here: alive, dead (it died holding the lock), or unresolvable.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::{Duration, SystemTime};

use crate::names::escape_outside;

use crate::lock::backend::{LockInfo, LockKind};
use crate::lock::file::{LockFile, TryLock};
use crate::lock::holder::Holder;
use crate::lock::queue::Queue;
use crate::names::{LOCK_FILE_PREFIX, LOCK_FILE_SUFFIX, named_lock_of_file, queue_dir_of};
use crate::supervise::identity::Verdict;
use crate::supervise::linux;
use crate::supervise::procfs::ProcLock;

/// The kind and the name (escaped: file names come from outside) of a lock file.
fn classify(file_name: &[u8]) -> Option<(LockKind, String)> {
    if let Some(domain) = file_name
        .strip_prefix(LOCK_FILE_PREFIX.as_bytes())
        .and_then(|n| n.strip_suffix(LOCK_FILE_SUFFIX.as_bytes()))
    {
        return Some((LockKind::App, escape_outside(domain)));
    }
    named_lock_of_file(file_name).map(|name| (LockKind::Named, escape_outside(name)))
}

/// Describe every lock file in `dir`.
pub(crate) fn list(dir: &Path, long_held: Duration) -> std::io::Result<Vec<LockInfo>> {
    let proc_locks = linux::proc_locks().unwrap_or_else(|err| {
        tracing::warn!("failed to read /proc/locks: {err}");
        Vec::new()
    });
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let Ok(entry) = entry else { continue };
        let name = entry.file_name();
        let Some((kind, lock_name)) = classify(std::os::unix::ffi::OsStrExt::as_bytes(&*name))
        else {
            continue;
        };
        found.push(describe(
            &entry.path(),
            kind,
            &lock_name,
            &proc_locks,
            long_held,
        ));
    }
    found.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(found)
}

fn describe(
    path: &Path,
    kind: LockKind,
    name: &str,
    proc_locks: &[ProcLock],
    long_held: Duration,
) -> LockInfo {
    let mut info = LockInfo {
        path: path.to_owned(),
        kind,
        name: name.to_owned(),
        held: false,
        holder_pids: Vec::new(),
        waiters: 0,
        holder: None,
        holder_raw: None,
        holder_is: None,
        holder_unresolvable: None,
        age_s: None,
        long_held: false,
        problem: None,
        queue: None,
    };
    if kind == LockKind::Named {
        info.queue = Some(Queue::existing(queue_dir_of(path)).scan());
    }
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(err) => {
            info.problem = Some(format!("cannot inspect: {err}"));
            return info;
        }
    };
    if meta.file_type().is_symlink() {
        info.problem = Some("a symbolic link".to_owned());
        return info;
    }
    if !meta.is_file() {
        info.problem = Some("not a regular file".to_owned());
        return info;
    }
    if !crate::trust::ours(meta.uid()) {
        info.problem = Some(format!("owned by uid {}", meta.uid()));
    }
    let (major, minor) = (
        crate::supervise::procfs::dev_major(meta.dev()),
        crate::supervise::procfs::dev_minor(meta.dev()),
    );
    for lock in proc_locks
        .iter()
        .filter(|l| l.inode == meta.ino() && l.major == major && l.minor == minor)
    {
        if lock.waiting {
            info.waiters += 1;
        } else {
            info.holder_pids.push(lock.pid);
        }
    }
    info.holder_pids.sort_unstable();
    info.holder_pids.dedup();
    info.held = !info.holder_pids.is_empty();
    info.age_s = meta.modified().ok().map(|m| {
        SystemTime::now()
            .duration_since(m)
            .unwrap_or_default()
            .as_secs()
    });
    info.long_held = info.held && info.age_s.is_some_and(|a| a > long_held.as_secs());
    // Read-only, no-follow, non-blocking: looking must not disturb anything.
    let text = crate::files::read(path, &crate::files::Rules::small(4096));
    if let Ok(bytes) = text {
        let text = String::from_utf8_lossy(&bytes).trim().to_owned();
        if !info.held && !text.is_empty() && info.problem.is_none() {
            // A holder clears its line when it lets go, and `/proc/locks` hides the locks of
            // processes outside our pid namespace: a line with no holder in sight is either a
            // holder we cannot see or one that died holding the lock. One try tells them apart
            // (taken and let go at once, nothing written).
            info.held = held_unseen(path);
        }
        match Holder::parse(&text) {
            Some(holder) => {
                if let Some(process) = &holder.trace.process {
                    match process.judge() {
                        Verdict::Alive => info.holder_is = Some("alive"),
                        Verdict::Dead => info.holder_is = Some("dead"),
                        Verdict::Unresolvable(why) => {
                            info.holder_is = Some("unresolvable");
                            info.holder_unresolvable = Some(why);
                        }
                    }
                }
                info.holder = Some(holder);
            }
            None if !text.is_empty() => info.holder_raw = Some(text),
            None => {}
        }
    }
    info
}

/// True when someone holds the lock file at `path` though `/proc/locks` shows no holder.
fn held_unseen(path: &Path) -> bool {
    matches!(
        LockFile::open_existing(path).map(|f| f.map(LockFile::try_lock)),
        Ok(Some(Ok(TryLock::Busy(_))))
    )
}

/// The human-readable table: KIND, NAME, HELD, PIDS, AGE, WAITERS, then the holder and the
/// notes; by default it fits [`crate::report::TABLE_WIDTH`] columns (long values cut with `…`,
/// the holder without its start, which AGE says), `wide` cuts nothing.
pub(crate) fn render_table(locks: &[LockInfo], wide: bool) -> String {
    use crate::report::Column;
    let columns = [
        Column {
            header: "KIND",
            cap: 5,
            right: false,
        },
        Column {
            header: "NAME",
            cap: 34,
            right: false,
        },
        Column {
            header: "HELD",
            cap: 4,
            right: false,
        },
        Column {
            header: "PIDS",
            cap: 11,
            right: false,
        },
        Column {
            header: "AGE",
            cap: 6,
            right: true,
        },
        Column {
            header: "WAITERS",
            cap: 7,
            right: true,
        },
    ];
    let rows: Vec<Vec<String>> = locks
        .iter()
        .map(|l| {
            let pids: Vec<String> = l.holder_pids.iter().map(ToString::to_string).collect();
            let since = |at: &str| {
                if wide {
                    format!(" since {at}")
                } else {
                    String::new()
                }
            };
            let holder = match (&l.holder, &l.holder_raw) {
                (Some(h), _) if h.run_id.is_empty() => escape_outside(
                    format!("pid {} on {}{}", h.pid, h.host, since(&h.started_at)).as_bytes(),
                ),
                (Some(h), _) => escape_outside(
                    format!(
                        "run {} pid {} on {}{}",
                        h.run_id,
                        h.pid,
                        h.host,
                        since(&h.started_at)
                    )
                    .as_bytes(),
                ),
                (None, Some(raw)) => format!("unparsed: {}", escape_outside(raw.as_bytes())),
                (None, None) => String::new(),
            };
            let mut notes = Vec::new();
            if !holder.is_empty() {
                notes.push(holder);
            }
            if l.long_held {
                notes.push("LONG-HELD".to_owned());
            }
            match (l.holder_is, &l.holder_unresolvable) {
                (Some("dead"), _) => notes.push("its holder died holding it".to_owned()),
                (Some("unresolvable"), Some(why)) => {
                    notes.push(format!("holder not judged from here: {why}"));
                }
                _ => {}
            }
            if let Some(queue) = l.queue.as_ref().filter(|q| !q.is_empty()) {
                let tickets: Vec<String> = queue
                    .iter()
                    .map(|t| {
                        format!(
                            "{} {} pid {} {}",
                            t.ticket.seq,
                            t.ticket.class.as_str(),
                            t.ticket.pid,
                            crate::duration::age(Some(t.age_s))
                        )
                    })
                    .collect();
                notes.push(format!("queue: {}", tickets.join(", ")));
            }
            if let Some(problem) = &l.problem {
                notes.push(format!("!! {problem}"));
            }
            vec![
                match l.kind {
                    LockKind::App => "app",
                    LockKind::Named => "named",
                }
                .to_owned(),
                l.name.clone(),
                if l.held { "yes" } else { "no" }.to_owned(),
                if pids.is_empty() {
                    "-".to_owned()
                } else {
                    pids.join(",")
                },
                crate::duration::age(l.age_s),
                l.waiters.to_string(),
                notes.join("; "),
            ]
        })
        .collect();
    crate::report::table(&columns, "HOLDER", &rows, wide)
}
