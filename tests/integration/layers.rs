//! The floors of `src/` (docs/architecture.md): every `crate::` path read from the source, each
//! room mapped to its floor by the document's table, and every arrow that points up, goes from
//! one command to another, or closes a circle on one floor named.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One floor of the table: its number, its name, its rooms (`names.rs` → `names`, `lock/` →
/// `lock`).
#[derive(Debug)]
struct Floor {
    number: u32,
    name: String,
    rooms: Vec<String>,
}

/// The floors table of docs/architecture.md: the rows under `| floor | name | rooms |`.
fn floors(doc: &str) -> Vec<Floor> {
    let mut rows = doc
        .lines()
        .skip_while(|l| !l.starts_with("| floor | name | rooms |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'));
    let mut floors = Vec::new();
    for row in rows.by_ref() {
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 3, "a floors row has three cells: {row}");
        let rooms = cells[2]
            .split(',')
            .map(|r| {
                let r = r.trim().trim_matches('`');
                r.strip_suffix(".rs")
                    .or_else(|| r.strip_suffix('/'))
                    .unwrap_or_else(|| panic!("a room is `name.rs` or `name/`: {r:?}"))
                    .to_owned()
            })
            .collect();
        floors.push(Floor {
            number: cells[0].parse().expect("a floor's number"),
            name: cells[1].to_owned(),
            rooms,
        });
    }
    floors
}

/// Every `.rs` file under `dir`, with its path relative to `src/`.
fn sources(dir: &Path, under: &Path, out: &mut Vec<(String, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            sources(&path, under, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(under).unwrap().display().to_string();
            out.push((rel, std::fs::read_to_string(&path).unwrap()));
        }
    }
}

/// The room a source file belongs to: its first path component, without `.rs`.
fn room_of(rel: &str) -> String {
    let first = rel.split('/').next().unwrap();
    first.strip_suffix(".rs").unwrap_or(first).to_owned()
}

/// The source without its comments (line comments, doc comments and block comments) and string
/// literals' contents, so that a `crate::` in prose or in a message is no import.
fn code_only(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        let rest = &text[i..];
        if rest.starts_with("//") {
            let end = rest.find('\n').unwrap_or(rest.len());
            i += end;
        } else if rest.starts_with("/*") {
            let end = rest.find("*/").map_or(rest.len(), |e| e + 2);
            i += end;
        } else if raw_string_opens(text, i) {
            let hashes = rest[1..].chars().take_while(|c| *c == '#').count();
            let close = format!("\"{}", "#".repeat(hashes));
            let body = 2 + hashes;
            let end = rest[body..]
                .find(&close)
                .map_or(rest.len(), |e| body + e + close.len());
            out.push_str("\"\"");
            i += end;
        } else if rest.starts_with('"') {
            let mut j = 1;
            let rb = rest.as_bytes();
            while j < rb.len() && rb[j] != b'"' {
                j += if rb[j] == b'\\' { 2 } else { 1 };
            }
            out.push_str("\"\"");
            i += (j + 1).min(rest.len());
        } else if rest.starts_with("'\"'") {
            // The one char literal that would open a string.
            out.push_str("' '");
            i += 3;
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// Whether a raw string (`r"`, `r#"`, `r##"`…) opens at byte `i`, not a raw identifier or the
/// end of a name.
fn raw_string_opens(text: &str, i: usize) -> bool {
    let rest = &text[i..];
    let Some(after) = rest.strip_prefix('r') else {
        return false;
    };
    let before = text[..i].chars().next_back();
    if before.is_some_and(|c| (c.is_alphanumeric() && c != 'b') || c == '_') {
        return false;
    }
    after.trim_start_matches('#').starts_with('"')
}

/// The module path of a source file (`janitor/report.rs` → `janitor::report`, `run/mod.rs` →
/// `run`, `lib.rs` → the crate root).
fn module_of(rel: &str) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .trim_end_matches(".rs")
        .split('/')
        .map(str::to_owned)
        .collect();
    if parts
        .last()
        .is_some_and(|p| p == "mod" || p == "lib" || p == "main")
    {
        parts.pop();
    }
    parts
}

/// The inline modules (`mod tests { … }`) open at each byte of `code`: for each byte, how many
/// and their names, as a stack.
fn inline_modules(code: &str) -> Vec<Vec<String>> {
    let opens = regex::Regex::new(r"\bmod\s+([A-Za-z_][A-Za-z0-9_]*)\s*\{").unwrap();
    let mut starts: BTreeMap<usize, (String, usize)> = BTreeMap::new();
    for m in opens.captures_iter(code) {
        let whole = m.get(0).unwrap();
        starts.insert(whole.end() - 1, (m[1].to_owned(), whole.start()));
    }
    let mut at = Vec::with_capacity(code.len());
    let mut stack: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    for (i, b) in code.bytes().enumerate() {
        match b {
            b'{' => {
                depth += 1;
                if let Some((name, _)) = starts.get(&i) {
                    stack.push((name.clone(), depth));
                }
            }
            b'}' => {
                if stack.last().is_some_and(|(_, d)| *d == depth) {
                    stack.pop();
                }
                depth = depth.saturating_sub(1);
            }
            _ => {}
        }
        at.push(stack.iter().map(|(n, _)| n.clone()).collect());
    }
    at
}

/// Every path of the crate that `code` (the file `rel` under `src/`, comments and strings
/// removed) names, as the compiler resolves it: `crate::…`, `$crate::…` (a macro expands it to
/// the crate), and `super::…` chains from the file's module and the inline modules around them.
/// Each comes back as its first component under the crate root (the room) and the path as
/// written. `use crate::{a::b, c}` gives `a` and `c`; a chain that resolves inside the file's
/// own room gives that room.
fn crate_paths(rel: &str, code: &str) -> Vec<(String, String)> {
    let module = module_of(rel);
    let inline = inline_modules(code);
    let starts = regex::Regex::new(r"\$?crate\s*::|(?:super\s*::\s*)+").unwrap();
    let mut found = Vec::new();
    // The end of the last group read: a path inside it was read with it.
    let mut read_to = 0;
    for m in starts.find_iter(code) {
        let start = m.start();
        if start < read_to {
            continue;
        }
        let before = code[..start].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            // `ccci_crate::`, `a::super::` (not a path from here), `::crate`.
            continue;
        }
        let written = m.as_str();
        let (base, head): (Vec<String>, String) = if written.contains("crate") {
            (Vec::new(), written.replace(char::is_whitespace, ""))
        } else {
            // `super::super::` from the module the code sits in.
            let ups = written.matches("super").count();
            let mut here = module.clone();
            here.extend(inline.get(start).cloned().unwrap_or_default());
            if ups > here.len() {
                found.push((
                    "<above the crate>".to_owned(),
                    written.replace(char::is_whitespace, ""),
                ));
                continue;
            }
            here.truncate(here.len() - ups);
            (here, written.replace(char::is_whitespace, ""))
        };
        let rest = &code[m.end()..];
        let mut push = |whole: &str| {
            let whole = whole.trim();
            // `super::` at the head of a group's item goes up from the group's path.
            let (mut base, mut item) = (base.clone(), whole);
            while let Some(up) = item
                .strip_prefix("super")
                .and_then(|r| r.trim_start().strip_prefix("::"))
            {
                if base.pop().is_none() {
                    found.push(("<above the crate>".to_owned(), format!("{head}{whole}")));
                    return;
                }
                item = up.trim_start();
            }
            let first: String = item
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '*')
                .collect();
            if first.is_empty() {
                return;
            }
            let room = base.first().cloned().unwrap_or(first);
            found.push((room, format!("{head}{}", whole.replace('\n', " "))));
        };
        if let Some(group) = rest.strip_prefix('{') {
            // A group: its top-level items, up to the matching brace.
            let items = group_items(group);
            let length: usize = items.iter().map(|i| i.len() + 1).sum::<usize>() - 1;
            read_to = m.end() + 1 + length;
            for item in items {
                push(&item);
            }
        } else {
            let path: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':' || *c == '*')
                .collect();
            push(&path);
        }
    }
    found
}

/// The top-level items of a use group, `group` being the text after its opening brace: `a,
/// b::{c, d}, e} …` gives `a`, ` b::{c, d}` and ` e`.
fn group_items(group: &str) -> Vec<String> {
    let mut depth = 1;
    let mut item = String::new();
    let mut items = Vec::new();
    for c in group.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        if depth == 0 {
            break;
        }
        if c == ',' && depth == 1 {
            items.push(std::mem::take(&mut item));
        } else {
            item.push(c);
        }
    }
    items.push(item);
    items
}

/// Every `crate as NAME` in `code`: a second name for the crate root hides each path through
/// it from this test, so none is allowed.
fn crate_aliases(code: &str) -> Vec<String> {
    regex::Regex::new(r"\b(?:\$?crate)\s+as\s+[A-Za-z_][A-Za-z0-9_]*")
        .unwrap()
        .find_iter(code)
        .map(|m| m.as_str().to_owned())
        .collect()
}

/// A room's own doc: the `//!` lines at the top of its file (`x.rs`) or its `mod.rs`.
fn room_doc(src: &Path, room: &str) -> String {
    let file = if src.join(room).is_dir() {
        src.join(room).join("mod.rs")
    } else {
        src.join(format!("{room}.rs"))
    };
    std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        .lines()
        .take_while(|l| l.starts_with("//!") || l.starts_with("#!") || l.trim().is_empty())
        .filter(|l| l.starts_with("//!"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn every_import_points_down_and_no_command_imports_another() {
    let doc = std::fs::read_to_string(repo().join("docs/architecture.md")).unwrap();
    let floors = floors(&doc);
    assert!(
        floors.len() >= 3,
        "docs/architecture.md has no floors table: {floors:?}"
    );
    let mut floor_of: BTreeMap<&str, &Floor> = BTreeMap::new();
    for floor in &floors {
        for room in &floor.rooms {
            assert!(
                floor_of.insert(room, floor).is_none(),
                "room {room} is on two floors of docs/architecture.md"
            );
        }
    }
    let commands = floors
        .iter()
        .find(|f| f.name == "commands")
        .expect("a floor named commands");

    let src = repo().join("src");
    let mut files = Vec::new();
    sources(&src, &src, &mut files);
    let rooms: BTreeSet<String> = files.iter().map(|(rel, _)| room_of(rel)).collect();
    let mut problems = Vec::new();
    for room in &rooms {
        let Some(floor) = floor_of.get(room.as_str()) else {
            problems.push(format!(
                "room {room} is on no floor: add it to the floors table of docs/architecture.md"
            ));
            continue;
        };
        let doc = room_doc(&src, room);
        let said = format!("Floor: {}", floor.name);
        if !doc.contains(&said) {
            problems.push(format!(
                "room {room}'s module doc does not name its floor (a line with {said:?})"
            ));
        }
    }
    for room in floor_of.keys() {
        if !rooms.contains(*room) {
            problems.push(format!(
                "docs/architecture.md names room {room}, which src/ does not have"
            ));
        }
    }

    // Room-level arrows, with one example each (file and path) for the messages.
    let mut arrows: BTreeMap<(String, String), (String, String)> = BTreeMap::new();
    for (rel, text) in &files {
        let from = room_of(rel);
        let code = code_only(text);
        for alias in crate_aliases(&code) {
            problems.push(format!(
                "src/{rel}: `{alias}` names the crate root anew: write `crate::` paths"
            ));
        }
        for (to, path) in crate_paths(rel, &code) {
            if to == from || !rooms.contains(&to) {
                // Its own room, or an item of lib.rs itself (`crate::Error`): the entry.
                if to != from && !rooms.contains(&to) {
                    arrows
                        .entry((from.clone(), "lib".to_owned()))
                        .or_insert((rel.clone(), path));
                }
                continue;
            }
            arrows
                .entry((from.clone(), to))
                .or_insert((rel.clone(), path));
        }
    }
    for ((from, to), (file, path)) in &arrows {
        let (Some(a), Some(b)) = (floor_of.get(from.as_str()), floor_of.get(to.as_str())) else {
            continue;
        };
        if b.number > a.number {
            problems.push(format!(
                "src/{file}: {path} points up, from {from} ({}) to {to} ({})",
                a.name, b.name
            ));
        } else if a.number == commands.number && b.number == commands.number {
            problems.push(format!(
                "src/{file}: {path} goes from command {from} to command {to}: what two \
                 commands share moves down a floor, or the entry hands it over"
            ));
        }
    }
    // No circle among the rooms of one floor: a depth-first search over same-floor arrows.
    let same_floor: BTreeMap<&str, Vec<&str>> = arrows
        .keys()
        .filter(|(f, t)| {
            floor_of
                .get(f.as_str())
                .zip(floor_of.get(t.as_str()))
                .is_some_and(|(a, b)| a.number == b.number)
        })
        .fold(BTreeMap::new(), |mut m, (f, t)| {
            m.entry(f.as_str())
                .or_insert_with(Vec::new)
                .push(t.as_str());
            m
        });
    fn visit<'a>(
        room: &'a str,
        graph: &BTreeMap<&'a str, Vec<&'a str>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
        circles: &mut Vec<String>,
    ) {
        if let Some(at) = path.iter().position(|r| *r == room) {
            let mut circle = path[at..].to_vec();
            circle.push(room);
            circles.push(circle.join(" -> "));
            return;
        }
        if !done.insert(room) {
            return;
        }
        path.push(room);
        for next in graph.get(room).into_iter().flatten() {
            visit(next, graph, path, done, circles);
        }
        path.pop();
    }
    let mut circles = Vec::new();
    let mut done = BTreeSet::new();
    for room in same_floor.keys() {
        visit(room, &same_floor, &mut Vec::new(), &mut done, &mut circles);
    }
    for circle in circles {
        problems.push(format!("a circle on one floor: {circle}"));
    }
    assert!(
        problems.is_empty(),
        "the floors of docs/architecture.md do not hold:\n  {}",
        problems.join("\n  ")
    );
}

/// The reader of paths is itself right: groups, nested groups, inline paths, `$crate::` in a
/// macro, `super::` chains from a file's module and its inline modules, a second name for the
/// crate refused, and nothing from comments or strings. Each shape that once slipped past it is
/// planted here.
#[test]
fn the_import_reader_reads_what_rustc_reads() {
    let code = code_only(
        r##"
        use crate::{lock::{self, LockFile}, names::RunId,
            supervise::identity::Scope};
        use crate::config::Global;
        // use crate::janitor::sweep;
        /// See [`crate::docker::DockerSeam`].
        let x = crate::runs::stop::stop(a);
        let s = "crate::converge::run";
        let r = r#"crate::doctor"#;
        macro_rules! m { () => { $crate::report::line("") } }
        let c = '"'; let d = crate::exit::OK;
        pub(in crate::lock::etcd) fn f() {}
        pub(super) fn g() {}
        "##,
    );
    let firsts = |rel: &str, code: &str| -> Vec<String> {
        crate_paths(rel, code).into_iter().map(|(f, _)| f).collect()
    };
    assert_eq!(
        firsts("run/mod.rs", &code),
        [
            "lock",
            "names",
            "supervise",
            "config",
            "runs",
            "report",
            "exit",
            "lock"
        ],
        "{code}"
    );
    // `super::` from a top-level room is the crate root.
    assert_eq!(
        firsts("app.rs", &code_only("use super::janitor::sweep;")),
        ["janitor"]
    );
    // Two levels up from `run/list.rs` is the crate root too; one is `run` itself.
    assert_eq!(
        firsts(
            "run/list.rs",
            &code_only("use super::super::janitor; use super::stop::StopError;")
        ),
        ["janitor", "run"]
    );
    // A group after a chain, and a chain inside an inline module.
    assert_eq!(
        firsts(
            "lock/etcd/queue/claim.rs",
            &code_only("use super::super::super::{file, super::janitor::x};")
        ),
        ["lock", "janitor"]
    );
    assert_eq!(
        firsts(
            "names.rs",
            &code_only(
                "fn a() {} mod tests { use super::*; use super::super::janitor::x; } \
                 use super::converge;"
            )
        ),
        ["names", "janitor", "converge"]
    );
    // `$crate::` outside a macro_rules body, written with spaces.
    assert_eq!(
        firsts("report.rs", &code_only("$crate::janitor::x")),
        ["janitor"]
    );
    // A second name for the crate is refused: paths through it would go unseen.
    assert_eq!(
        crate_aliases(&code_only("use crate as root; root::janitor::sweep();")),
        ["crate as root"]
    );
    assert!(crate_aliases(&code_only("use crate::names as n;")).is_empty());
}

/// The README's Layout names every entry of the tree that a reader meets: each file and folder
/// of `src/`, each top-level folder and file of the repository but the build's own (Cargo's,
/// git's, the linters'), each folder of `tests/`; and every path it names exists.
#[test]
fn the_readme_layout_matches_the_tree() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let layout = readme
        .split("## Layout")
        .nth(1)
        .and_then(|rest| rest.split("```").nth(1))
        .expect("README.md has a Layout block");
    // Every word of the block that names a path, with its folder carried over a comma list
    // (`src/duration.rs, exit.rs` names src/exit.rs).
    let mut named: Vec<String> = Vec::new();
    for line in layout.lines() {
        let mut folder = String::new();
        for word in line.split_whitespace() {
            let word = word.trim_matches(|c: char| ",;:()`".contains(c));
            let looks_like_path = word.ends_with('/')
                || word.ends_with(".rs")
                || word.ends_with(".yml")
                || word == ".ci/run";
            if !looks_like_path || word.contains("..") {
                continue;
            }
            if let Some((dir, _)) = word.rsplit_once('/') {
                if !dir.is_empty() {
                    folder = format!("{dir}/");
                }
                named.push(word.to_owned());
            } else if !folder.is_empty() && line.trim_start().starts_with(&folder) {
                named.push(format!("{folder}{word}"));
            } else {
                named.push(word.to_owned());
            }
        }
    }
    let has = |path: &str| named.iter().any(|n| n == path);
    // What is named is there.
    for path in named
        .iter()
        .filter(|n| n.contains('/') && !n.ends_with('/'))
    {
        assert!(
            repo().join(path).exists() || repo().join("src").join(path).exists(),
            "README.md's Layout names {path}, which is not in the tree"
        );
    }
    let mut missing = Vec::new();
    let entries = |dir: &Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let name = e.file_name().to_string_lossy().into_owned();
                if e.file_type().unwrap().is_dir() {
                    format!("{name}/")
                } else {
                    name
                }
            })
            .collect();
        names.sort();
        names
    };
    for name in entries(&repo().join("src")) {
        if !has(&format!("src/{name}")) {
            missing.push(format!("src/{name}"));
        }
    }
    for name in entries(&repo().join("tests")) {
        if name.ends_with('/') && !has(&format!("tests/{name}")) {
            missing.push(format!("tests/{name}"));
        }
    }
    // The build's own files, not the project's.
    const TOOLING: [&str; 9] = [
        ".git/",
        ".gitignore",
        ".yamllint",
        "Cargo.toml",
        "Cargo.lock",
        "README.md",
        "clippy.toml",
        "target/",
        ".ci/",
    ];
    for name in entries(&repo()) {
        let under = named
            .iter()
            .any(|n| n.starts_with(&name) && name.ends_with('/'));
        if !TOOLING.contains(&name.as_str()) && !name.starts_with(".cargo") && !has(&name) && !under
        {
            missing.push(name);
        }
    }
    assert!(has(".ci/run"), "README.md's Layout does not name .ci/run");
    assert!(
        missing.is_empty(),
        "README.md's Layout leaves out {missing:?}"
    );
}

/// No kill by a bare number: every signal the crate sends to another process goes through a
/// pidfd or a `/proc` directory held on that very process (`ProcDir::signal`, the pidfd
/// syscalls), and the one raw `kill(2)` — a group whose leader is our own unreaped child — is
/// `signal_group_of_unreaped_child`. All of them live in `src/supervise/linux.rs`; clippy.toml
/// forbids the raw calls everywhere else too, and this test also catches what clippy cannot
/// see (a raw syscall number, an import renamed).
#[test]
fn raw_kills_live_in_one_place() {
    let src = repo().join("src");
    let mut files = Vec::new();
    sources(&src, &src, &mut files);
    let raw = regex::Regex::new(
        r"\bkillpg\b|signal::kill\b|signal::\{[^}]*\bkill\b|libc::kill\b|\bSYS_(kill|tkill|tgkill|pidfd_send_signal|rt_sigqueueinfo|rt_tgsigqueueinfo)\b|\bsigqueue\b",
    )
    .unwrap();
    let mut found = Vec::new();
    let mut in_place = 0;
    for (rel, text) in &files {
        for hit in raw.find_iter(&code_only(text)) {
            if rel == "supervise/linux.rs" {
                in_place += 1;
            } else {
                found.push(format!("src/{rel}: {}", hit.as_str()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "a raw kill outside src/supervise/linux.rs (signal through a held pidfd or /proc \
         directory there instead):\n{}",
        found.join("\n")
    );
    // The rule still sees what it guards: the two raw calls of the one place.
    assert_eq!(
        in_place, 2,
        "src/supervise/linux.rs's raw kill and pidfd_send_signal"
    );
}

/// docs/architecture.md says what the tree holds: every file or folder of `src/` it names in
/// backticks exists, and its list of files over 600 lines names each of them.
#[test]
fn the_architecture_document_matches_the_tree() {
    let doc = std::fs::read_to_string(repo().join("docs/architecture.md")).unwrap();
    let src = repo().join("src");
    let named = regex::Regex::new(r"`([a-z_]+(?:/[a-z_]+)*(?:\.rs|/))`").unwrap();
    let room_line = regex::Regex::new(r"^- \*\*`([a-z_/]+/)`\*\*").unwrap();
    let mut problems = Vec::new();
    for line in doc.lines() {
        // A room's own line names its files from the room (`**`config/`**: `values.rs``).
        let room = room_line.captures(line).map(|c| c[1].to_owned());
        for found in named.captures_iter(line) {
            let path = &found[1];
            let whole = found.get(0).unwrap();
            // What a file was once called (`(was `a.rs`, `b.rs`)`), `src/` itself, and paths
            // outside it.
            let before = &line[..whole.start()];
            let aside = before.rfind('(').map_or("", |at| &before[at..]);
            if aside.contains("was ")
                || path == "src/"
                || path.starts_with("tests/")
                || path.starts_with("benches/")
            {
                continue;
            }
            let there = src.join(path).exists()
                || room
                    .as_ref()
                    .is_some_and(|r| src.join(r).join(path).exists());
            if !there {
                problems.push(format!(
                    "docs/architecture.md names src/{path}, which is not there"
                ));
            }
        }
    }
    let tables = doc
        .split("The data tables over 600 lines:")
        .nth(1)
        .expect("docs/architecture.md lists the data tables over 600 lines");
    let tables = tables.split("\n\n").next().unwrap_or_default();
    let mut files = Vec::new();
    sources(&src, &src, &mut files);
    for (rel, text) in &files {
        let lines = text.lines().count();
        if lines > 600 && !tables.contains(&format!("`{rel}`")) {
            problems.push(format!(
                "src/{rel} has {lines} lines: split it by concern (a data table is named in \
                 docs/architecture.md's list of the data tables over 600 lines)"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The module each source file is, by its path (`lock/etcd/queue/turn.rs` →
/// `lock::etcd::queue::turn`), and back.
fn module_files(files: &[(String, String)]) -> BTreeMap<Vec<String>, String> {
    files
        .iter()
        .map(|(rel, _)| (module_of(rel), rel.clone()))
        .collect()
}

/// The paths a use tree names, each as its segments: `a::{b, c::{d, *}}` gives `a::b`,
/// `a::c::d` and `a::c::*`; `self` in a group is the group's own path, `super` goes up, and a
/// rename (`as x`) is dropped.
fn expand_use_tree(tree: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut path: Vec<String> = Vec::new();
    let mut rest = tree.trim_start();
    loop {
        if let Some(group) = rest.strip_prefix('{') {
            let items = group_items(group);
            for item in items {
                for inner in expand_use_tree(&item) {
                    let mut whole = path.clone();
                    for segment in inner {
                        match segment.as_str() {
                            "super" => {
                                whole.pop();
                            }
                            "self" => {}
                            _ => whole.push(segment),
                        }
                    }
                    out.push(whole);
                }
            }
            return out;
        }
        let segment: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '*')
            .collect();
        if segment.is_empty() {
            break;
        }
        rest = rest[segment.len()..].trim_start();
        path.push(segment);
        match rest.strip_prefix("::") {
            Some(after) => rest = after.trim_start(),
            None => break,
        }
    }
    if !path.is_empty() {
        out.push(path);
    }
    out
}

/// Every file-to-file arrow of the crate: for each source file, the files whose items it names,
/// by `crate::`, `$crate::`, `super::` and `self::` paths and by the names of its own child
/// modules, each resolved to the deepest module that is a file. One example path each.
fn file_arrows(files: &[(String, String)]) -> BTreeMap<(String, String), String> {
    let modules = module_files(files);
    let mut arrows = BTreeMap::new();
    for (rel, text) in files {
        let code = code_only(text);
        let module = module_of(rel);
        let inline = inline_modules(&code);
        let children: Vec<&str> = modules
            .keys()
            .filter(|m| m.len() == module.len() + 1 && m.starts_with(&module))
            .map(|m| m.last().unwrap().as_str())
            .collect();
        let mut pattern = String::from(r"\$?crate\s*::|(?:super\s*::\s*)+|self\s*::");
        for child in &children {
            pattern.push_str(&format!(r"|\b{child}\s*::"));
        }
        let starts = regex::Regex::new(&pattern).unwrap();
        let mut read_to = 0;
        for m in starts.find_iter(&code) {
            if m.start() < read_to {
                continue;
            }
            let before = code[..m.start()].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            // `pub(in crate::lock::etcd)` says who may see an item: it names no item.
            if code[..m.start()].trim_end().ends_with("pub(in") {
                continue;
            }
            let mut written = m.as_str().replace(char::is_whitespace, "");
            let mut here = module.clone();
            here.extend(inline.get(m.start()).cloned().unwrap_or_default());
            let (base, tail_from) = if written.contains("crate") {
                (Vec::new(), m.end())
            } else if written.starts_with("super") {
                let ups = written.matches("super").count();
                if ups > here.len() {
                    continue;
                }
                here.truncate(here.len() - ups);
                (here, m.end())
            } else if written.starts_with("self") {
                (here, m.end())
            } else {
                // A child module's name: the path starts at the name.
                written.clear();
                (module.clone(), m.start())
            };
            let tail: String = {
                let rest = &code[tail_from..];
                if rest.starts_with('{') {
                    let mut depth = 0;
                    let mut end = rest.len();
                    for (i, c) in rest.char_indices() {
                        match c {
                            '{' => depth += 1,
                            '}' => {
                                depth -= 1;
                                if depth == 0 {
                                    end = i + 1;
                                    break;
                                }
                            }
                            _ => {}
                        }
                    }
                    rest[..end].to_owned()
                } else {
                    let mut end = 0;
                    let bytes = rest.as_bytes();
                    while end < bytes.len() {
                        let c = bytes[end] as char;
                        if c.is_alphanumeric() || c == '_' || c == '*' || c == ':' {
                            end += 1;
                        } else if c == '{' && rest[..end].ends_with("::") {
                            // A group after a path: read it whole.
                            let mut depth = 0;
                            for (i, c) in rest[end..].char_indices() {
                                match c {
                                    '{' => depth += 1,
                                    '}' => {
                                        depth -= 1;
                                        if depth == 0 {
                                            end += i + 1;
                                            break;
                                        }
                                    }
                                    _ => {}
                                }
                            }
                            break;
                        } else {
                            break;
                        }
                    }
                    rest[..end].to_owned()
                }
            };
            read_to = tail_from + tail.len();
            for segments in expand_use_tree(&tail) {
                let mut whole = base.clone();
                for segment in segments {
                    match segment.as_str() {
                        "super" => {
                            whole.pop();
                        }
                        "self" => {}
                        _ => whole.push(segment),
                    }
                }
                // The deepest module along the path that is a file of its own.
                let target = (0..=whole.len())
                    .rev()
                    .find_map(|n| modules.get(&whole[..n]))
                    .cloned();
                if let Some(target) = target {
                    if &target != rel {
                        arrows
                            .entry((rel.clone(), target))
                            .or_insert_with(|| format!("{written}{tail}"));
                    }
                }
            }
        }
    }
    arrows
}

/// The circles of a graph, one per strongly tied group found by a depth-first search.
fn circles_of(graph: &BTreeMap<String, Vec<String>>) -> Vec<String> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, Vec<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        circles: &mut Vec<String>,
    ) {
        if let Some(at) = path.iter().position(|r| r == node) {
            let mut circle = path[at..].to_vec();
            circle.push(node.to_owned());
            circles.push(circle.join(" -> "));
            return;
        }
        if !done.insert(node.to_owned()) {
            return;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            visit(next, graph, path, done, circles);
        }
        path.pop();
    }
    let mut circles = Vec::new();
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        visit(node, graph, &mut Vec::new(), &mut done, &mut circles);
    }
    circles
}

/// No circle among the files of one room: a file names what it needs from the file that holds
/// it, and the files of a room form a tree of concerns, not a knot.
#[test]
fn no_circle_among_the_files_of_a_room() {
    let src = repo().join("src");
    let mut files = Vec::new();
    sources(&src, &src, &mut files);
    let arrows = file_arrows(&files);
    let mut graph: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (from, to) in arrows.keys() {
        if room_of(from) == room_of(to) {
            graph.entry(from.clone()).or_default().push(to.clone());
        }
    }
    let circles = circles_of(&graph);
    let described: Vec<String> = circles
        .iter()
        .map(|circle| {
            let hops: Vec<&str> = circle.split(" -> ").collect();
            let examples: Vec<String> = hops
                .windows(2)
                .map(|w| {
                    format!(
                        "src/{}: {}",
                        w[0],
                        arrows[&(w[0].to_owned(), w[1].to_owned())]
                    )
                })
                .collect();
            format!("{circle}\n      {}", examples.join("\n      "))
        })
        .collect();
    assert!(
        described.is_empty(),
        "a circle among the files of a room:\n  {}",
        described.join("\n  ")
    );
}

/// The file rule sees each shape a circle inside a room takes: a child that takes its parent's
/// items by a glob, a parent that names a child by its module name, `self::` and `crate::`
/// paths, a group; and it reads no arrow from a visibility (`pub(in crate::…)`), a comment or a
/// unit test's own file.
#[test]
fn the_file_reader_finds_each_circle_in_a_room() {
    let plant = |files: &[(&str, &str)]| -> Vec<String> {
        let files: Vec<(String, String)> = files
            .iter()
            .map(|(rel, text)| ((*rel).to_owned(), (*text).to_owned()))
            .collect();
        let arrows = file_arrows(&files);
        let mut graph: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (from, to) in arrows.keys() {
            graph.entry(from.clone()).or_default().push(to.clone());
        }
        circles_of(&graph)
    };
    // A child's glob of its parent, and the parent's re-export of the child.
    assert_eq!(
        plant(&[
            (
                "a/mod.rs",
                "mod b; pub(crate) use b::Thing; pub(crate) struct Shared;"
            ),
            ("a/b.rs", "use super::*; pub(crate) struct Thing(Shared);"),
        ]),
        ["a/b.rs -> a/mod.rs -> a/b.rs"]
    );
    // Through `self::` and a `crate::` group, three files long.
    assert_eq!(
        plant(&[
            ("a/mod.rs", "mod b; mod c; use self::b::x;"),
            ("a/b.rs", "use crate::a::{c::{y, z}}; pub fn x() {}"),
            (
                "a/c.rs",
                "pub fn y() { crate::a::Top::new(); } pub fn z() {}"
            ),
        ]),
        ["a/b.rs -> a/c.rs -> a/mod.rs -> a/b.rs"]
    );
    // No arrow from a visibility, a comment, a string, or a test file's glob of its parent.
    assert!(
        plant(&[
            ("a/mod.rs", "mod b; use b::x;"),
            (
                "a/b.rs",
                "pub(in crate::a) fn x() {} // crate::a::y\nconst S: &str = \"crate::a::z\";\n\
                 #[cfg(test)] mod tests;"
            ),
            ("a/b/tests.rs", "use super::*;"),
        ])
        .is_empty()
    );
}
