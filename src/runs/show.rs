//! How `runs` shows what it lists: the table an operator reads, fitted to its width, and the
//! whole of one run.
//!
//! Floor: commands (docs/architecture.md): imports the floors below, never another command.

use std::fmt::Write as _;

use crate::names::escape_outside;
use crate::runs::list::RunInfo;

/// The width the default table fits.
pub(crate) const TABLE_WIDTH: usize = 100;

/// `text` cut to `width` characters, its last one `…` when cut.
fn fit(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(width.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

/// [`fit`] keeping the end: `…ustom-html.120`.
fn fit_tail(text: &str, width: usize) -> String {
    let count = text.chars().count();
    if count <= width {
        return text.to_owned();
    }
    let tail: String = text.chars().skip(count + 1 - width.max(1)).collect();
    format!("…{tail}")
}

fn pr_ref(r: &RunInfo) -> String {
    match (&r.pr, &r.git_ref) {
        (Some(pr), _) => format!("#{pr}"),
        (None, Some(git_ref)) => git_ref.clone(),
        (None, None) => "-".to_owned(),
    }
}

/// An age as every table writes it ([`crate::duration::age`]).
fn short_age(secs: Option<u64>) -> String {
    crate::duration::age(secs)
}

/// The human-readable table, one line a run. By default it fits [`TABLE_WIDTH`] columns: RUN,
/// RECIPE, PR/REF, STATE, PHASE, AGE, EXIT and a short NOTE, long values cut with `…`. `wide`
/// adds the domain, the cgroup and the record, and cuts nothing.
pub(crate) fn render_table(runs: &[RunInfo], wide: bool) -> String {
    let headers = ["RUN", "RECIPE", "PR/REF", "STATE", "PHASE", "AGE", "EXIT"];
    // A run id carries its repository and build (`coop-cloud.custom-html.120`): cut, it keeps
    // its end, where the build number is.
    let caps = [24, 14, 10, 12, 10, 6, 4];
    let rows: Vec<[String; 7]> = runs
        .iter()
        .map(|r| {
            [
                r.run_id.clone(),
                r.recipe.clone(),
                pr_ref(r),
                r.state.as_str().to_owned(),
                r.phase.clone().unwrap_or_else(|| "-".to_owned()),
                short_age(r.age_s),
                r.exit_code
                    .map_or_else(|| "-".to_owned(), |c| c.to_string()),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..headers.len())
        .map(|i| {
            let widest = rows
                .iter()
                .map(|row| row[i].chars().count())
                .chain([headers[i].len()])
                .max()
                .unwrap_or(0);
            if wide { widest } else { widest.min(caps[i]) }
        })
        .collect();
    let cell = |i: usize, text: &str| {
        let text = if wide {
            text.to_owned()
        } else if i == 0 {
            fit_tail(text, widths[i])
        } else {
            fit(text, widths[i])
        };
        pad(&text, widths[i], i == 6)
    };
    let line = |cells: &[String]| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| cell(i, c))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut out = String::new();
    let head = line(&headers.map(str::to_owned));
    let _ = writeln!(
        out,
        "{head}  {}",
        if wide {
            "NOTE; DOMAIN; CGROUP; RECORD"
        } else {
            "NOTE"
        }
    );
    for (r, row) in runs.iter().zip(&rows) {
        let front = line(row);
        let note = r.note.clone().unwrap_or_default();
        let line = if wide {
            let repo = r.repo.as_ref().map(|repo| format!("repo {repo}"));
            let mut more: Vec<String> = [note, repo.unwrap_or_default(), r.domain.clone()]
                .into_iter()
                .filter(|m| !m.is_empty())
                .collect();
            if let Some(cgroup) = &r.cgroup {
                more.push(match r.processes {
                    Some(n) => format!("{cgroup} ({n} processes)"),
                    None => cgroup.clone(),
                });
            }
            more.push(escape_outside(r.record.as_os_str().as_encoded_bytes()));
            format!("{front}  {}", more.join("; "))
        } else {
            let room = TABLE_WIDTH.saturating_sub(front.chars().count() + 2);
            format!("{front}  {}", fit(&note, room))
        };
        // Every field may come from a record the run's own command could write: escaped.
        let _ = writeln!(out, "{}", crate::names::visible(line.trim_end()));
    }
    out
}

/// One run, `runs RUN_ID`: what it is, its phases with their times, its lock, cgroup and
/// record, and how it ended or what a janitor did with it.
pub(crate) fn render_one(r: &RunInfo) -> String {
    let mut out = String::new();
    let mut put = |key: &str, value: String| {
        let _ = writeln!(out, "{key:<10} {}", crate::names::visible(&value));
    };
    put("run", r.run_id.clone());
    if let Some(repo) = &r.repo {
        put("repo", repo.clone());
    }
    put(
        "state",
        match &r.note {
            Some(note) => format!("{} ({note})", r.state.as_str()),
            None => r.state.as_str().to_owned(),
        },
    );
    put(
        "recipe",
        format!("{} {} (domain {})", r.recipe, pr_ref(r), r.domain),
    );
    put("age", short_age(r.age_s));
    for (i, phase) in r.phases.iter().enumerate() {
        put(
            if i == 0 { "phases" } else { "" },
            format!("{} {}", phase.at, phase.name),
        );
    }
    if let Some(lock) = &r.lock {
        let holder = match (&lock.holder, lock.holder_pids.is_empty()) {
            (Some(h), _) => format!(
                " (held by {}, pid {} on {}, since {})",
                h.run_id
                    .as_deref()
                    .map_or("a lock command".to_owned(), |id| format!("run {id}")),
                h.pid,
                h.host,
                h.since
            ),
            (None, false) => format!(" (held by pids {:?})", lock.holder_pids),
            (None, true) => String::new(),
        };
        put("lock", format!("{} {}{holder}", lock.state, lock.domain));
    }
    if let Some(cgroup) = &r.cgroup {
        put(
            "cgroup",
            format!("{cgroup} ({} processes)", r.processes.unwrap_or(0)),
        );
    }
    if let Some(reason) = &r.shutdown_reason {
        let code = r
            .exit_code
            .map_or_else(String::new, |c| format!(", exit {c}"));
        put("ended", format!("{reason}{code}"));
    }
    if let Some(error) = &r.error {
        put("error", error.clone());
    }
    if let Some(swept) = &r.swept {
        put(
            "janitor",
            match swept.killed {
                0 => format!(
                    "found nothing of it running, removed its cgroup at {}",
                    swept.at
                ),
                n => format!(
                    "killed {n} process(es) left in its cgroup, removed it at {}",
                    swept.at
                ),
            },
        );
    }
    if let Some(at) = &r.reaped {
        put("janitor", format!("reaped its app at {at}"));
    }
    put(
        "record",
        escape_outside(r.record.as_os_str().as_encoded_bytes()),
    );
    out
}

/// `text` padded with spaces to `width` characters (on the left when `right`): by hand, as a
/// formatting width is capped (a field of 70,000 characters would panic `format!`).
fn pad(text: &str, width: usize, right: bool) -> String {
    let fill = " ".repeat(width.saturating_sub(text.chars().count()));
    if right {
        format!("{fill}{text}")
    } else {
        format!("{text}{fill}")
    }
}
