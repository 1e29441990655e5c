//! No output can be made to panic or to carry a raw control or bidirectional formatting
//! character: long and hostile fields planted where a run's own command, another app or a
//! configuration can put them, through every table and JSON document.

use crate::util::{Finished, Sandbox, run};

/// Hostile text: a terminal escape, a C1 control, a right-to-left override, an isolate.
const HOSTILE: &str = "a\u{1b}[2J\u{85}b\u{202e}c\u{2066}d\u{7f}";

/// Whether `text` carries a character a terminal acts on (line breaks apart).
fn raw(text: &str) -> Option<char> {
    text.chars().find(|&c| {
        (c.is_control() && c != '\n')
            || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    })
}

/// `text` as a TOML basic string's body: every character outside printable ASCII as `\uXXXX`.
fn toml_escaped(text: &str) -> String {
    text.chars()
        .map(|c| match c {
            ' '..='~' if c != '"' && c != '\\' => c.to_string(),
            c => format!("\\U{:08x}", u32::from(c)),
        })
        .collect()
}

#[track_caller]
fn clean(done: &Finished, what: &str) {
    let out = done.out.join("\n");
    assert!(
        !done.stderr().contains("panicked"),
        "{what} panicked\n{}",
        done.transcript()
    );
    if let Some(c) = raw(&out) {
        panic!("{what}: raw {c:?} in stdout\n{}", done.transcript());
    }
}

/// A run's record whose recipe field is 70,000 characters of hostile text (its own command
/// can write it): `runs`, `runs -o wide` and `runs --json` list it, exit 0, no panic, nothing
/// raw.
#[test]
fn a_70000_character_hostile_record_field_is_listed_wide_without_a_panic() {
    let sandbox = Sandbox::new();
    run(sandbox.run_sh("long", &[], "true")).assert_code(0);
    let path = sandbox.runs().join("long").join("run.json");
    let mut record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let long = HOSTILE.repeat(70_000 / HOSTILE.chars().count() + 1);
    record["recipe"] = long.clone().into();
    record["domain"] = long.into();
    std::fs::write(&path, record.to_string()).unwrap();
    for args in [
        &["runs", "--all"][..],
        &["runs", "--all", "-o", "wide"],
        &["runs", "--all", "--json"],
        &["runs", "long"],
    ] {
        let mut cmd = sandbox.ccci();
        cmd.args(args);
        let done = run(cmd);
        done.assert_code(0);
        clean(&done, &args.join(" "));
    }
}

/// Hostile text in a configured template and endpoint, in a lock file's name and its holder
/// line, and in an app's `.env` name: `config`, `doctor`, `locks` and `janitor --dry-run`, as
/// tables and as JSON, show it escaped.
#[test]
fn config_doctor_locks_and_janitor_show_hostile_text_escaped() {
    let sandbox = Sandbox::new();
    let config = sandbox.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "recipe_url_template = \"{}\"\n",
            toml_escaped(&format!("https://git.example/{HOSTILE}/{{recipe}}.git"))
        ),
    )
    .unwrap();
    std::fs::create_dir_all(sandbox.locks()).unwrap();
    let lock = sandbox.locks().join(format!("ccci-{HOSTILE}.lock"));
    std::fs::write(&lock, format!("pid 1 run {HOSTILE} host {HOSTILE}\n")).unwrap();
    sandbox.plant_env("ci", &format!("{HOSTILE}.ci.test"), "X=1\n");
    for args in [
        &["config"][..],
        &["config", "--json"],
        &["doctor"],
        &["doctor", "--json"],
        &["locks"],
        &["locks", "--json"],
        &["janitor", "--dry-run"],
        &["janitor", "--dry-run", "--json"],
    ] {
        let mut cmd = sandbox.ccci();
        cmd.env("CCCI_CONFIG", &config).args(args);
        let done = run(cmd);
        assert!(
            !done.stderr().contains("invalid configuration file"),
            "{}",
            done.transcript()
        );
        clean(&done, &args.join(" "));
        if args.contains(&"--json") {
            let doc: serde_json::Value = serde_json::from_str(&done.out.join("\n"))
                .unwrap_or_else(|e| panic!("{args:?}: no JSON ({e})\n{}", done.transcript()));
            if let Some(c) = raw(&doc.to_string()) {
                panic!("{args:?}: a decoded string carries {c:?}: {doc:#}");
            }
        }
    }
    let mut cmd = sandbox.ccci();
    cmd.env("CCCI_CONFIG", &config).args(["config"]);
    let done = run(cmd);
    assert!(
        done.out.join("\n").contains("\\u{202e}"),
        "the template is not shown escaped\n{}",
        done.transcript()
    );
}
