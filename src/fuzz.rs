//! Fuzzing of every parser of outside input: names and validation, `.env` discovery, Docker
//! resource names, lock-file holder metadata, named-lock ticket names, and the `/proc` lines the
//! supervisor reads.
//!
//! Each target is a function that must never panic on any input and must keep its round-trip
//! properties. The inputs mix arbitrary text, arbitrary bytes (decoded lossily, as file names
//! and file contents are) and mutations of valid values, which is where these small split-and-
//! parse parsers have their edges. The unit tests run a bounded number of cases; the soak runs
//! one target for as long as asked:
//!
//! ```sh
//! CCCI_FUZZ_TARGET=names,holder CCCI_FUZZ_SECS=600 cargo test --release --lib fuzz::soak -- --ignored --nocapture
//! ```
//!
//! Floor: entry (docs/architecture.md): the top floor, imported by nothing but the entry.

#![cfg(test)]

use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;

use crate::lock::Holder;
use crate::lock::queue::Ticket;
use crate::names::{
    AppDomain, DomainSuffix, GitRef, LockName, PrNumber, Recipe, RunAppPattern, RunId,
};
use crate::supervise::linux;

/// Inputs: arbitrary text, arbitrary bytes decoded lossily, and mutated valid examples.
fn input(examples: &'static [&'static str]) -> impl Strategy<Value = String> {
    let mutated = (
        proptest::sample::select(examples),
        "\\PC{0,8}",
        "\\PC{0,8}",
        0usize..64,
    )
        .prop_map(|(base, pre, post, cut)| {
            let cut = base
                .char_indices()
                .map(|(i, _)| i)
                .nth(cut)
                .unwrap_or(base.len());
            format!("{pre}{}{post}{}", &base[..cut], &base[cut..])
        });
    prop_oneof![
        "\\PC{0,80}",
        proptest::collection::vec(any::<u8>(), 0..120)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        mutated,
        proptest::sample::select(examples).prop_map(str::to_owned),
    ]
}

fn suffix() -> DomainSuffix {
    DomainSuffix::parse("ci.commoninternet.net").unwrap()
}

/// Every validation rule, and every derived name of what passes.
fn names(value: &str) {
    let suffix = suffix();
    let pattern = RunAppPattern::new(&suffix);
    if let Ok(recipe) = Recipe::parse(value) {
        let domain = AppDomain::derive(recipe.as_str(), None, None, &suffix);
        assert!(pattern.matches(domain.as_str()), "{domain}");
        assert_eq!(pattern.domain_of_stack(&domain.stack_name()), Some(domain));
    }
    let pr = PrNumber::parse(value).ok();
    let git_ref = GitRef::parse(value).ok();
    if let Some(r) = &git_ref {
        assert!(!r.as_str().contains("..") && !r.as_str().starts_with('-'));
    }
    let domain = AppDomain::derive("recipe", pr.as_ref(), git_ref.as_ref(), &suffix);
    assert!(pattern.matches(domain.as_str()));
    if let Ok(id) = RunId::parse(value) {
        // A run id is a path component: no separators, no dot-dot.
        assert!(!id.as_str().contains('/') && id.as_str() != ".." && id.as_str() != ".");
    }
    let _ = LockName::parse(value);
    if let Ok(s) = DomainSuffix::parse(value) {
        let d = AppDomain::derive("abcd", None, None, &s);
        assert!(d.stack_name().len() <= crate::names::MAX_STACK_NAME_LEN);
        assert!(RunAppPattern::new(&s).matches(d.as_str()));
    }
}

/// `.env` file names found under `servers/`.
fn env_files(value: &str) {
    let pattern = RunAppPattern::new(&suffix());
    if let Some(domain) = pattern.domain_of_env_file(value) {
        assert_eq!(format!("{domain}.env"), value);
        assert!(pattern.matches(domain.as_str()));
    }
    if let Some(domain) = pattern.domain_of_lock_file(value) {
        assert_eq!(domain.lock_file_name(), value);
    }
}

/// Docker resource and stack names back to domains.
fn docker_names(value: &str) {
    let pattern = RunAppPattern::new(&suffix());
    if let Some(domain) = pattern.domain_of_stack(value) {
        assert_eq!(domain.stack_name(), value);
    }
    if let Some(domain) = pattern.domain_of_resource(value) {
        let name = value.trim_start_matches('/');
        assert!(name.starts_with(&domain.stack_name()), "{value} → {domain}");
    }
}

/// Holder metadata read back from lock files.
fn holder(value: &str) {
    if let Some(h) = Holder::parse(value) {
        assert_eq!(Holder::parse(&h.to_line()), Some(h));
    }
}

/// Named-lock ticket names.
fn tickets(value: &str) {
    if let Some(t) = Ticket::parse(value) {
        assert_eq!(t.file_name(), value);
    }
}

/// `/proc/<pid>/stat` and `/proc/locks` lines.
fn proc_lines(value: &str) {
    let _ = linux::parse_stat(value);
    let _ = crate::supervise::procfs::parse_proc_lock(value);
}

/// Recipe URLs: redaction never panics and never lets a query, fragment or password through.
fn urls(value: &str) {
    let shown = crate::recipe_url::redact(value);
    if let Some((_, rest)) = value.split_once("://") {
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        if let Some((info, _)) = rest[..end].rsplit_once('@') {
            if info.len() >= 3 && !shown.contains("***@") {
                panic!("userinfo {info:?} of {value:?} shown: {shown:?}");
            }
        }
        if let Some((_, fragment)) = rest[end..].split_once('#') {
            assert!(
                fragment.is_empty() || shown.ends_with("#***"),
                "{value:?} → {shown:?}"
            );
        }
    }
}

/// Outside text made safe for a terminal: no control character survives, in a text report
/// (but its line breaks) or in any string a JSON document decodes to.
fn escapes(value: &str) {
    let shown = crate::names::escape_outside(value.as_bytes());
    assert!(
        !shown.chars().any(char::is_control),
        "{value:?} → {shown:?}"
    );
    let bidi = |c: char| matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
    let text = crate::names::visible_text(value);
    assert!(
        !text
            .chars()
            .any(|c| (c.is_control() && c != '\n') || bidi(c)),
        "{value:?} → {text:?}"
    );
    let doc = serde_json::to_string_pretty(&serde_json::json!({ "v": value, "k": [value] }))
        .expect("a string serialises");
    let json = crate::names::visible_json(&doc);
    let back: serde_json::Value =
        serde_json::from_str(&json).unwrap_or_else(|e| panic!("{value:?} → {json:?}: {e}"));
    let decoded = back["v"].as_str().unwrap_or_default();
    assert!(
        !decoded.chars().any(|c| c.is_control() || bidi(c)),
        "{value:?} → {decoded:?}"
    );
}

/// Configuration files: any text parses to settings or to an error naming the file, never a
/// panic.
fn config_files(value: &str) {
    let path = std::path::Path::new("/etc/ccci-run/config.toml");
    if let Err(err) = crate::config::parse(value, path) {
        assert!(err.to_string().contains("config.toml"), "{err}");
    }
}

type Target = (&'static str, fn(&str), &'static [&'static str]);

const TARGETS: [Target; 9] = [
    (
        "config",
        config_files,
        &[
            "lock_dir = \"/run/lock\"\ndocker = \"auto\"\n",
            "runs_dir = 5\n",
            "[table]\nx = 1\n",
            "etcd_endpoints = [\"http://127.0.0.1:2379\"]\n",
        ],
    ),
    (
        "urls",
        urls,
        &[
            "https://u:p@host/x.git?token=s#frag",
            "user:secret@host:x.git",
            "https://host?t=1",
            "/srv/a@b/x.git",
        ],
    ),
    (
        "escapes",
        escapes,
        &[
            "\u{1b}[31mred\n",
            "plain",
            "a\\b",
            "\u{202e}txt\u{85}\"\\u001b",
        ],
    ),
    (
        "names",
        names,
        &[
            "custom-html",
            "1.0.0+1.2.3",
            "manual-42",
            "ci.commoninternet.net",
            "ab-c",
            "refs/heads/main",
        ],
    ),
    (
        "env-files",
        env_files,
        &[
            "abcd-0a1b2c.ci.commoninternet.net.env",
            "cc-ci-app-abcd-0a1b2c.ci.commoninternet.net.lock",
            "warm-keycloak.ci.commoninternet.net.env",
        ],
    ),
    (
        "docker-names",
        docker_names,
        &[
            "abcd-0a1b2c_ci_commoninternet_net",
            "/abcd-0a1b2c_ci_commoninternet_net_app.1.x",
            "abcd-0a1b2c_ci_commoninternet_net_db_password",
        ],
    ),
    (
        "holder",
        holder,
        &[r#"{"run_id":"7","pid":42,"started_at":"2026-11-30T08:00:00.000Z","host":"ci"}"#],
    ),
    (
        "tickets",
        tickets,
        &["0-000000000012-42", "1-000000000000-1"],
    ),
    (
        "proc",
        proc_lines,
        &[
            "42 (sleep) S 7 42 42 0",
            "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF",
            "2: -> FLOCK  ADVISORY  WRITE 99 fd:0a:12 0 EOF",
        ],
    ),
];

/// Run `target` on generated inputs until `budget` is spent and at least `min_cases` ran;
/// returns how many ran. (A floor of cases, not of speed: a loaded machine only takes longer.)
fn drive(target: &Target, budget: Duration, min_cases: u64) -> u64 {
    let (name, check, examples) = *target;
    let strategy = input(examples);
    let mut runner = TestRunner::default();
    let started = Instant::now();
    let mut cases = 0;
    while started.elapsed() < budget || cases < min_cases {
        let value = strategy.new_tree(&mut runner).expect("strategy").current();
        let outcome = std::panic::catch_unwind(|| check(&value));
        assert!(outcome.is_ok(), "fuzz target {name} panicked on {value:?}");
        cases += 1;
    }
    cases
}

#[test]
fn every_target_survives_a_short_run() {
    for target in &TARGETS {
        assert!(
            drive(target, Duration::from_millis(300), 100) >= 100,
            "{}",
            target.0
        );
    }
}

#[test]
#[ignore = "a soak: run it on purpose, see the module docs"]
#[expect(
    clippy::disallowed_macros,
    reason = "a soak prints its counts to the harness"
)]
fn soak() {
    let wanted = crate::config::env::var("CCCI_FUZZ_TARGET").ok();
    let secs: u64 = crate::config::env::var("CCCI_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let wanted: Option<Vec<&str>> = wanted.as_deref().map(|w| w.split(',').collect());
    for target in TARGETS
        .iter()
        .filter(|t| wanted.as_ref().is_none_or(|w| w.contains(&t.0)))
    {
        let cases = drive(target, Duration::from_secs(secs), 0);
        println!("fuzz {}: {cases} inputs in {secs} s, no panic", target.0);
    }
}
