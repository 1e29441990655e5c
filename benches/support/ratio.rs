//! Each bench's summary: every figure beside its anchor (measured in the same run), their
//! ratio, and the ratio recorded for it before (`benches/baselines.json`), flagged when it grew
//! by more than [`TOLERANCE`]. Every figure is a cost (a time, CPU, faults): lower is better,
//! so a ratio that grows is a regression.
//!
//! `CCCI_BENCH_RECORD=1` writes this run's ratios into the baseline file as the new record;
//! `CCCI_BENCH_README=1` writes them as this bench's rows of the README's performance table
//! (between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`), so the table is what a run
//! printed, never typed.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// How much a ratio may grow over its recorded one before the summary flags it.
pub const TOLERANCE: f64 = 0.20;

/// One figure and its anchor, in the same unit.
pub struct Figure {
    /// What was measured ("clean handover, median").
    pub name: String,
    pub value: f64,
    /// What it is held against ("etcdctl lock, median").
    pub anchor: String,
    pub anchor_value: f64,
    /// "ms", "s", ...
    pub unit: &'static str,
    /// The goal for the ratio, when there is one (a ratio at or below it meets it).
    pub goal: Option<f64>,
}

impl Figure {
    pub fn new(
        name: impl Into<String>,
        value: f64,
        anchor: impl Into<String>,
        anchor_value: f64,
        unit: &'static str,
    ) -> Self {
        Self {
            name: name.into(),
            value,
            anchor: anchor.into(),
            anchor_value,
            unit,
            goal: None,
        }
    }

    pub fn goal(mut self, ratio: f64) -> Self {
        self.goal = Some(ratio);
        self
    }

    pub fn ratio(&self) -> Option<f64> {
        (self.anchor_value > 0.0 && self.value.is_finite()).then(|| self.value / self.anchor_value)
    }
}

fn baseline_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/baselines.json")
}

type Baselines = BTreeMap<String, BTreeMap<String, f64>>;

fn read_baselines() -> Baselines {
    std::fs::read_to_string(baseline_path())
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default()
}

/// Print `figures` of bench `bench` with their ratios and the recorded ones; returns how many
/// regressed.
pub fn summary(bench: &str, figures: &[Figure]) -> usize {
    let mut baselines = read_baselines();
    let recorded = baselines.get(bench).cloned().unwrap_or_default();
    println!("\n== {bench}: figure / anchor (same run); ratio, recorded ratio ==");
    let mut regressions = 0;
    for f in figures {
        let ratio = f.ratio();
        let was = recorded.get(&f.name).copied();
        let verdict = match (ratio, was) {
            (Some(r), Some(w)) if r > w * (1.0 + TOLERANCE) => {
                regressions += 1;
                format!(
                    "REGRESSION: {:+.0} % over the recorded {w:.3}",
                    (r / w - 1.0) * 100.0
                )
            }
            (Some(r), Some(w)) => format!("recorded {w:.3} ({:+.0} %)", (r / w - 1.0) * 100.0),
            (_, None) => "no recorded ratio".to_owned(),
            (None, Some(w)) => format!("recorded {w:.3}"),
        };
        let goal = match (ratio, f.goal) {
            (Some(r), Some(g)) if r <= g => format!("; goal ≤ {g:.2}: met"),
            (_, Some(g)) => format!("; goal ≤ {g:.2}: NOT MET"),
            _ => String::new(),
        };
        println!(
            "  {}: {:.3} {unit} / {}: {:.3} {unit} = {}; {verdict}{goal}",
            f.name,
            f.value,
            f.anchor,
            f.anchor_value,
            ratio.map_or("-".to_owned(), |r| format!("{r:.3}")),
            unit = f.unit,
        );
    }
    if regressions == 0 {
        println!(
            "  no ratio regressed by more than {:.0} %",
            TOLERANCE * 100.0
        );
    } else {
        println!(
            "  {regressions} ratio(s) REGRESSED by more than {:.0} %",
            TOLERANCE * 100.0
        );
    }
    if std::env::var_os("CCCI_BENCH_RECORD").is_some_and(|v| v == "1") {
        let entry = baselines.entry(bench.to_owned()).or_default();
        for f in figures {
            if let Some(r) = f.ratio() {
                entry.insert(f.name.clone(), (r * 1000.0).round() / 1000.0);
            }
        }
        let text = serde_json::to_string_pretty(&baselines).expect("baselines serialise");
        std::fs::write(baseline_path(), text + "\n").expect("write the baselines");
        println!(
            "  recorded as the new baseline in {}",
            baseline_path().display()
        );
    }
    if std::env::var_os("CCCI_BENCH_README").is_some_and(|v| v == "1") {
        match write_readme_rows(bench, figures) {
            Ok(()) => println!("  written as {bench}'s rows of the README's performance table"),
            Err(why) => println!("  README NOT WRITTEN: {why}"),
        }
    }
    regressions
}

/// The README's rows for `figures`: figure, anchor, ratio, goal, and the load it ran at.
pub fn readme_rows(bench: &str, figures: &[Figure], load: &str) -> String {
    let mut rows = String::new();
    for f in figures {
        let ratio = f.ratio().map_or("-".to_owned(), |r| match r {
            r if r < 0.1 => format!("{r:.3}×"),
            r => format!("{r:.2}×"),
        });
        let goal = match (f.ratio(), f.goal) {
            (Some(r), Some(g)) if r <= g => format!("≤ {g:.2}×: met"),
            (_, Some(g)) => format!("≤ {g:.2}×: not met"),
            _ => "-".to_owned(),
        };
        rows.push_str(&format!(
            "| `{bench}` | {} {:.3} {unit} | {} {:.3} {unit} | {ratio} | {goal} | {load} |\n",
            f.name,
            f.value,
            f.anchor,
            f.anchor_value,
            unit = f.unit
        ));
    }
    rows
}

/// Replace `bench`'s rows of the README's performance table (between `<!-- bench-table -->`
/// and `<!-- /bench-table -->`) with this run's, where its old rows were, else at the end.
fn write_readme_rows(bench: &str, figures: &[Figure]) -> Result<(), String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (open, close) = ("<!-- bench-table -->\n", "<!-- /bench-table -->");
    let (Some(start), Some(end)) = (text.find(open), text.find(close)) else {
        return Err(format!("the README has no {open:?} … {close:?} table"));
    };
    if end < start {
        return Err(format!("{close:?} comes before {open:?} in the README"));
    }
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned());
    let rows = readme_rows(bench, figures, &load);
    let mine = format!("| `{bench}` |");
    let mut table = String::new();
    let mut placed = false;
    for line in text[start + open.len()..end].lines() {
        if line.starts_with(&mine) {
            if !placed {
                table.push_str(&rows);
                placed = true;
            }
            continue;
        }
        table.push_str(line);
        table.push('\n');
    }
    if !placed {
        table.push_str(&rows);
    }
    let new = format!("{}{open}{table}{}", &text[..start], &text[end..]);
    std::fs::write(&path, new).map_err(|e| format!("{}: {e}", path.display()))
}
