//! The shipped pipeline under a stand-in for Drone's exec runner that does what the real one
//! does (`docs/operations.md`, "Under Drone's exec runner"; [`RUNNER_PARITY`] lists each
//! behaviour with the runner's source line it copies):
//!
//! - the whole `.drone.yml` goes through the runner's variable substitution before it is read
//!   ([`substitute`], checked row by row against `tests/data/drone-envsubst.tsv`, which was
//!   measured on the substitution library the runner uses), with the build's variables only
//!   ([`build_vars`]: `${HOME}` is empty there);
//! - the step's commands are written into a script (`set -e`, an `echo + "…"` line and the
//!   command, each) and started as `/bin/sh -e FILE` by a runner process
//!   (`drone_runner.py`) that leads its own session, from a workspace it makes
//!   (`<root>/drone-<random>/{home/drone, drone/src, opt/<step>}`, the base 0755, the rest 0700)
//!   with a real clone step, and removes at once after a cancel, without waiting, or once the
//!   step ends;
//! - the step's environment is the runner's making ([`step_env`]): PATH, USER (only when the
//!   runner has one) and the proxy variables from the host, the ~95 variables the runner sets
//!   (never `CI_WORKSPACE`), HOME in the workspace, and the step's `environment:`, nothing else;
//!   so ccci-run finds its directories in its configuration file, as on a host;
//! - the build log is a pipe the runner reads on after a cancel until EOF or its own exit, right
//!   after it removed the workspace; in daemon mode (`RUNNER_MODE=daemon`) until EOF, however
//!   long;
//! - a cancel is SIGKILL to the step shell alone, and the runner exits 0; a second signal while
//!   it stops kills it by that signal; a failed step is exit 1, its code never printed; the
//!   runner's own death kills nobody.

use std::collections::BTreeMap;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::Value;

use crate::docker::{Cleanup, assert_gone_now, compose_file};
use crate::util::{
    BIN, Proc, Sandbox, Stream, pids_by_prefix, process_alive, sh_quote, signal, wait_exited,
    wait_removed,
};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// What the runner's substitution makes of `text`, with `vars` as the build's variables: `$$`
/// becomes `$`, `\\` and `\/` lose their backslash, and every `${…}` form is evaluated (an
/// unset name is empty); a plain `$NAME`, `$(…)` or a lone `$` is left alone. Quotes protect
/// nothing. An `Err` is what the runner reports as a bad substitution (the build fails).
fn substitute(text: &str, vars: &BTreeMap<&str, &str>) -> Result<String, String> {
    let mut scan = Scan {
        chars: text.chars().collect(),
        at: 0,
        vars,
    };
    let mut out = String::new();
    while let Some(c) = scan.peek(0) {
        match (c, scan.peek(1)) {
            ('$', Some('{')) => {
                scan.at += 2;
                out.push_str(&scan.expression()?);
            }
            ('$', Some('$')) | ('\\', Some('\\' | '/')) => {
                out.push(scan.peek(1).unwrap());
                scan.at += 2;
            }
            _ => {
                out.push(c);
                scan.at += 1;
            }
        }
    }
    Ok(out)
}

struct Scan<'a> {
    chars: Vec<char>,
    at: usize,
    vars: &'a BTreeMap<&'a str, &'a str>,
}

const BAD: &str = "bad substitution";

impl Scan<'_> {
    fn peek(&self, ahead: usize) -> Option<char> {
        self.chars.get(self.at + ahead).copied()
    }

    /// Take characters while `accept(char, index in the token)` holds.
    fn take(&mut self, accept: impl Fn(char, usize) -> bool) -> String {
        let mut token = String::new();
        while let Some(c) = self.peek(0) {
            if !accept(c, token.chars().count()) {
                break;
            }
            token.push(c);
            self.at += 1;
        }
        token
    }

    fn close(&mut self) -> Result<(), String> {
        if self.peek(0) == Some('}') {
            self.at += 1;
            Ok(())
        } else {
            Err(BAD.to_owned())
        }
    }

    /// A function argument: text up to a character `accept` refuses, with `${…}` inside it
    /// evaluated; with `escapes`, `\/` and `\\` lose their backslash.
    fn argument(&mut self, accept: impl Fn(char) -> bool, escapes: bool) -> Result<String, String> {
        let mut out = String::new();
        loop {
            match (self.peek(0), self.peek(1)) {
                (Some('$'), Some('{')) => {
                    self.at += 2;
                    out.push_str(&self.expression()?);
                }
                (Some('\\'), Some(c @ ('\\' | '/'))) if escapes => {
                    out.push(c);
                    self.at += 2;
                }
                (Some(c), _) if accept(c) => {
                    out.push(c);
                    self.at += 1;
                }
                _ => return Ok(out),
            }
        }
    }

    /// After `${`: the expression, evaluated, with its closing brace consumed.
    fn expression(&mut self) -> Result<String, String> {
        let name_char = |c: char| c.is_alphanumeric() || c == '_' || c == '-';
        if self.peek(0) == Some('#') {
            self.at += 1;
            let name = self.take(|c, _| name_char(c));
            if name.is_empty() {
                return Err(BAD.to_owned());
            }
            self.close()?;
            return Ok(self.value(&name).len().to_string());
        }
        let name = self.take(|c, _| name_char(c));
        if name.is_empty() {
            return Err(BAD.to_owned());
        }
        let value = self.value(&name).to_owned();
        match self.peek(0) {
            Some(':') if matches!(self.peek(1), Some('=' | '-' | '?' | '+')) => {
                self.at += 2;
                self.default(value)
            }
            Some('=') => {
                self.at += 1;
                self.default(value)
            }
            Some(':') => {
                self.at += 1;
                let offset = self.argument(|c| c != ':' && c != '}', false)?;
                let length = if self.peek(0) == Some(':') {
                    self.at += 1;
                    Some(self.argument(|c| c != '}', false)?)
                } else {
                    None
                };
                self.close()?;
                Ok(substring(&value, &offset, length.as_deref()))
            }
            Some(',' | '^') => {
                let op = self.take(|c, i| (c == ',' || c == '^') && i < 2);
                self.close()?;
                let mut chars = value.chars();
                Ok(match op.as_str() {
                    ",," => value.to_lowercase(),
                    "^^" => value.to_uppercase(),
                    "," => chars.next().map_or(String::new(), |c| {
                        c.to_lowercase().chain(chars).collect::<String>()
                    }),
                    _ => chars.next().map_or(String::new(), |c| {
                        c.to_uppercase().chain(chars).collect::<String>()
                    }),
                })
            }
            Some('/') => {
                self.at += 1;
                let kind = match self.peek(0) {
                    Some(c @ ('/' | '#' | '%')) => {
                        self.at += 1;
                        c
                    }
                    _ => ' ',
                };
                let pattern = self.argument(|c| c != '/', true)?;
                if self.peek(0) != Some('/') {
                    return Err(BAD.to_owned());
                }
                self.at += 1;
                let with = if self.peek(0) == Some('}') {
                    None
                } else {
                    Some(self.argument(|c| c != '}', true)?)
                };
                self.close()?;
                Ok(replace(&value, kind, &pattern, with.as_deref()))
            }
            Some(op @ ('#' | '%')) => {
                let longest = self.peek(1) == Some(op);
                self.at += if longest { 2 } else { 1 };
                let pattern = self.argument(|c| c != '}', false)?;
                self.close()?;
                trim(&value, op == '#', longest, &pattern)
            }
            _ => {
                self.close()?;
                Ok(value)
            }
        }
    }

    /// `${NAME:-word}` and its kin (`:=`, `=`, `:?`, `:+`): the runner's library gives every
    /// one of them the same meaning, the value or else the word (substituted).
    fn default(&mut self, value: String) -> Result<String, String> {
        let mut word = String::new();
        while self.peek(0) != Some('}') {
            if self.peek(0).is_none() {
                return Err(BAD.to_owned());
            }
            word.push_str(&self.argument(|c| c != '}', false)?);
        }
        self.close()?;
        Ok(if value.is_empty() { word } else { value })
    }

    fn value(&self, name: &str) -> &str {
        self.vars.get(name).copied().unwrap_or("")
    }
}

/// `${NAME:offset:length}` on bytes, as the runner's library does (a value that does not parse
/// leaves the string whole).
fn substring(value: &str, offset: &str, length: Option<&str>) -> String {
    let Ok(offset) = offset.parse::<i64>() else {
        return value.to_owned();
    };
    let len = value.len() as i64;
    let start = if offset < 0 {
        (len + offset).max(0)
    } else {
        offset
    };
    let bytes = value.as_bytes();
    let slice = |from: i64, to: i64| {
        String::from_utf8_lossy(&bytes[from as usize..to as usize]).into_owned()
    };
    match length {
        None if start < len => slice(start, len),
        None => String::new(),
        Some(length) => match length.parse::<i64>() {
            Err(_) => value.to_owned(),
            Ok(n) if start + n >= len => slice(start.min(len), len),
            Ok(n) => slice(start, start + n),
        },
    }
}

/// `${NAME/a/b}` (first), `${NAME//a/b}` (all), `${NAME/#a/b}` (prefix), `${NAME/%a/b}` (suffix).
fn replace(value: &str, kind: char, pattern: &str, with: Option<&str>) -> String {
    match kind {
        '/' => value.replace(pattern, with.unwrap_or("")),
        '#' => match (value.strip_prefix(pattern), with) {
            (Some(rest), Some(with)) => format!("{with}{rest}"),
            _ => value.to_owned(),
        },
        '%' => match (value.strip_suffix(pattern), with) {
            (Some(rest), Some(with)) => format!("{rest}{with}"),
            _ => value.to_owned(),
        },
        _ => value.replacen(pattern, with.unwrap_or(""), 1),
    }
}

/// `${NAME#glob}`, `##`, `%`, `%%`: the shortest or longest matching prefix or suffix removed.
fn trim(value: &str, prefix: bool, longest: bool, pattern: &str) -> Result<String, String> {
    if pattern.contains('[') {
        return Err(format!(
            "pattern {pattern:?}: bracket classes are not reproduced by this stand-in"
        ));
    }
    let ends: Vec<usize> = (0..=value.len())
        .filter(|i| value.is_char_boundary(*i))
        .collect();
    let matching = ends.iter().copied().filter(|&i| {
        let (part, rest) = if prefix {
            (&value[..i], &value[i..])
        } else {
            (&value[value.len() - i..], &value[..value.len() - i])
        };
        let _ = rest;
        i > 0 && glob(pattern, part)
    });
    let cut = if longest {
        matching.max()
    } else {
        matching.min()
    };
    Ok(match cut {
        None => value.to_owned(),
        Some(i) if prefix => value[i..].to_owned(),
        Some(i) => value[..value.len() - i].to_owned(),
    })
}

/// A path-style glob: `*` and `?` match anything but `/`, `\x` matches `x`.
fn glob(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    fn go(p: &[char], t: &[char]) -> bool {
        match p.first() {
            None => t.is_empty(),
            Some('*') => (0..=t.len())
                .take_while(|&i| i == 0 || t[i - 1] != '/')
                .any(|i| go(&p[1..], &t[i..])),
            Some('?') => t.first().is_some_and(|c| *c != '/') && go(&p[1..], &t[1..]),
            Some('\\') if p.len() > 1 => t.first() == Some(&p[1]) && go(&p[2..], &t[1..]),
            Some(c) => t.first() == Some(c) && go(&p[1..], &t[1..]),
        }
    }
    go(&p, &t)
}

/// The variables the TSV's rows were measured with.
fn tsv_vars() -> BTreeMap<&'static str, &'static str> {
    BTreeMap::from([
        ("DRONE_BUILD_NUMBER", "7"),
        ("DRONE_COMMIT_SHA", "abc123"),
        ("HOME", "/root"),
    ])
}

/// Every row measured on the runner's substitution library comes out of the stand-in's the same.
#[test]
fn the_stand_in_substitutes_every_measured_row_as_the_runner_does() {
    let table = std::fs::read_to_string(repo().join("tests/data/drone-envsubst.tsv")).unwrap();
    let mut rows = 0;
    for line in table.lines().filter(|l| !l.starts_with('#')).skip(1) {
        let mut columns = line.split('\t');
        let input = columns.next().unwrap();
        let output = columns
            .next()
            .unwrap_or_else(|| panic!("no output column: {line:?}"));
        let error = columns.next().unwrap_or("");
        match substitute(input, &tsv_vars()) {
            Ok(got) => {
                assert!(
                    error.is_empty(),
                    "{input:?}: the runner fails ({error}), we gave {got:?}"
                );
                assert_eq!(got, output, "{input:?}");
            }
            Err(err) => assert!(
                !error.is_empty(),
                "{input:?}: we failed ({err}), the runner gave {output:?}"
            ),
        }
        rows += 1;
    }
    assert!(rows >= 28, "only {rows} rows read");
    // Forms the table does not list, as the library's own sources give them.
    let vars = tsv_vars();
    for (input, output) in [
        ("${DRONE_COMMIT_SHA:2}", "c123"),
        ("${DRONE_COMMIT_SHA:-3}", "abc123"),
        ("${DRONE_COMMIT_SHA//b/B}", "aBc123"),
        ("${HOME#/}", "root"),
        ("${HOME%t}", "/roo"),
        ("${DRONE_COMMIT_SHA,,}", "abc123"),
        ("${DRONE_COMMIT_SHA^}", "Abc123"),
        ("${UNSET:-${HOME}}", "/root"),
        ("a\\\\b", "a\\b"),
    ] {
        assert_eq!(substitute(input, &vars).as_deref(), Ok(output), "{input:?}");
    }
    for bad in ["${", "${}", "${HOME", "${HOME+x}", "${#}"] {
        assert!(substitute(bad, &vars).is_err(), "{bad:?}");
    }
}

/// The `commands` of the pipeline's step, as `text` (a `.drone.yml`) lists them.
fn step_commands(text: &str) -> Vec<String> {
    let mut commands = Vec::new();
    let mut inside: Option<usize> = None;
    for line in text.lines() {
        let indent = line.len() - line.trim_start().len();
        let trimmed = line.trim();
        match inside {
            None if trimmed == "commands:" => inside = Some(indent),
            Some(base) if !trimmed.is_empty() && !trimmed.starts_with('#') => {
                if indent <= base {
                    break;
                }
                if let Some(command) = trimmed.strip_prefix("- ") {
                    commands.push(command.to_owned());
                }
            }
            _ => {}
        }
    }
    assert!(!commands.is_empty(), "no step commands in .drone.yml");
    commands
}

/// A build's variables, as the runner makes them for a pull request and substitutes the file
/// with: `environ.System`, `Repo`, `Build`, `Stage` and `Link` of runner-go, combined with the
/// build's parameters (`command/exec.go:50-58`). Nothing else: not `HOME`, not the workspace's
/// `DRONE_WORKSPACE`, not the step's `DRONE_STEP_NAME`. Build `build` of pull request `pr` of
/// recipe repository `repo`.
fn build_vars(build: &str, pr: &str, repo: &str) -> BTreeMap<String, String> {
    let full = format!("coop-cloud/{repo}");
    let sha = "0123456789abcdef0123456789abcdef01234567";
    let git_ref = format!("refs/pull/{pr}/head");
    let link = format!("https://drone.example.org/{full}/{build}");
    let commit_link = format!("https://git.example.org/{full}/pulls/{pr}");
    let remote = format!("https://git.example.org/{full}.git");
    let ssh = format!("git@git.example.org:{full}.git");
    let repo_link = format!("https://git.example.org/{full}");
    let now = "1700000000";
    [
        // environ.System
        ("CI", "true"),
        ("DRONE", "true"),
        ("DRONE_SYSTEM_PROTO", "https"),
        ("DRONE_SYSTEM_HOST", "drone.example.org"),
        ("DRONE_SYSTEM_HOSTNAME", "drone.example.org"),
        ("DRONE_SYSTEM_VERSION", "2.24.0"),
        // environ.Repo
        ("DRONE_REPO", full.as_str()),
        ("DRONE_REPO_SCM", "git"),
        ("DRONE_REPO_OWNER", "coop-cloud"),
        ("DRONE_REPO_NAMESPACE", "coop-cloud"),
        ("DRONE_REPO_NAME", repo),
        ("DRONE_REPO_LINK", repo_link.as_str()),
        ("DRONE_REPO_BRANCH", "main"),
        ("DRONE_REMOTE_URL", remote.as_str()),
        ("DRONE_GIT_HTTP_URL", remote.as_str()),
        ("DRONE_GIT_SSH_URL", ssh.as_str()),
        ("DRONE_REPO_VISIBILITY", "public"),
        ("DRONE_REPO_PRIVATE", "false"),
        ("CI_REPO", full.as_str()),
        ("CI_REPO_NAME", full.as_str()),
        ("CI_REPO_LINK", repo_link.as_str()),
        ("CI_REPO_REMOTE", remote.as_str()),
        ("CI_REMOTE_URL", remote.as_str()),
        ("CI_REPO_PRIVATE", "false"),
        // environ.Build, for a pull request
        ("DRONE_BRANCH", "main"),
        ("DRONE_SOURCE_BRANCH", "pr-branch"),
        ("DRONE_TARGET_BRANCH", "main"),
        ("DRONE_COMMIT", sha),
        ("DRONE_COMMIT_SHA", sha),
        ("DRONE_COMMIT_BEFORE", ""),
        ("DRONE_COMMIT_AFTER", sha),
        ("DRONE_COMMIT_REF", git_ref.as_str()),
        ("DRONE_COMMIT_BRANCH", "main"),
        ("DRONE_COMMIT_LINK", commit_link.as_str()),
        ("DRONE_COMMIT_MESSAGE", "the pull request's head"),
        ("DRONE_COMMIT_AUTHOR", "someone"),
        ("DRONE_COMMIT_AUTHOR_EMAIL", "someone@example.org"),
        ("DRONE_COMMIT_AUTHOR_AVATAR", ""),
        ("DRONE_COMMIT_AUTHOR_NAME", "Someone"),
        ("DRONE_BUILD_NUMBER", build),
        ("DRONE_BUILD_PARENT", "0"),
        ("DRONE_BUILD_EVENT", "pull_request"),
        ("DRONE_BUILD_ACTION", "opened"),
        ("DRONE_BUILD_STATUS", "success"),
        ("DRONE_BUILD_DEBUG", "false"),
        ("DRONE_BUILD_CREATED", now),
        ("DRONE_BUILD_STARTED", now),
        ("DRONE_BUILD_FINISHED", now),
        ("DRONE_DEPLOY_TO", ""),
        ("DRONE_DEPLOY_ID", "0"),
        ("DRONE_BUILD_TRIGGER", "@hook"),
        ("DRONE_PULL_REQUEST", pr),
        ("DRONE_PULL_REQUEST_TITLE", "a change"),
        ("CI_BUILD_NUMBER", build),
        ("CI_PARENT_BUILD_NUMBER", "0"),
        ("CI_BUILD_CREATED", now),
        ("CI_BUILD_STARTED", now),
        ("CI_BUILD_FINISHED", now),
        ("CI_BUILD_STATUS", "pending"),
        ("CI_BUILD_EVENT", "pull_request"),
        ("CI_BUILD_LINK", link.as_str()),
        ("CI_BUILD_TARGET", ""),
        ("CI_COMMIT_SHA", sha),
        ("CI_COMMIT_REF", git_ref.as_str()),
        ("CI_COMMIT_BRANCH", "main"),
        ("CI_COMMIT_MESSAGE", "the pull request's head"),
        ("CI_COMMIT_AUTHOR", "someone"),
        ("CI_COMMIT_AUTHOR_NAME", "Someone"),
        ("CI_COMMIT_AUTHOR_EMAIL", "someone@example.org"),
        ("CI_COMMIT_AUTHOR_AVATAR", ""),
        // environ.Stage
        ("DRONE_STAGE_KIND", "pipeline"),
        ("DRONE_STAGE_TYPE", "exec"),
        ("DRONE_STAGE_NAME", "recipe-ci"),
        ("DRONE_STAGE_NUMBER", "1"),
        ("DRONE_STAGE_MACHINE", "ci-host"),
        ("DRONE_STAGE_OS", "linux"),
        ("DRONE_STAGE_ARCH", "amd64"),
        ("DRONE_STAGE_VARIANT", ""),
        ("DRONE_STAGE_VERSION", "0"),
        ("DRONE_STAGE_STATUS", "success"),
        ("DRONE_STAGE_STARTED", now),
        ("DRONE_STAGE_FINISHED", now),
        ("DRONE_STAGE_DEPENDS_ON", ""),
        ("DRONE_CARD_PATH", "/dev/stdout"),
        // environ.Link
        ("DRONE_BUILD_LINK", link.as_str()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// The step's environment as the runner makes it from a build's variables `vars`
/// (`engine/compiler/compiler.go:157-185`, `runtime/execer.go:163-168`): `PATH` and `USER`
/// (when it has one) of its own, the proxy variables, the build's variables, the clone
/// package's `GIT_AUTHOR_*`/`GIT_COMMITTER_*`, `GIT_TERMINAL_PROMPT=0` and the step's name and
/// number. The workspace's `HOME`, `HOMEPATH`, `USERPROFILE`, `DRONE_HOME` and
/// `DRONE_WORKSPACE` the stand-in adds once it made the workspace, then the step's
/// `environment:`. Never `CI_WORKSPACE`, never the runner's other variables.
fn step_env(vars: &BTreeMap<String, String>, bin: &Path) -> BTreeMap<String, String> {
    let mut env = vars.clone();
    let host_path = std::env::var("PATH").unwrap_or_default();
    env.insert("PATH".into(), format!("{}:{host_path}", bin.display()));
    if let Ok(user) = std::env::var("USER") {
        env.insert("USER".into(), user);
    }
    for proxy in [
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
    ] {
        if let Ok(value) = std::env::var(proxy) {
            env.insert(proxy.into(), value);
        }
    }
    for (k, v) in [
        ("GIT_AUTHOR_NAME", "Someone"),
        ("GIT_AUTHOR_EMAIL", "someone@example.org"),
        ("GIT_COMMITTER_NAME", "Someone"),
        ("GIT_COMMITTER_EMAIL", "someone@example.org"),
        ("GIT_TERMINAL_PROMPT", "0"),
        ("DRONE_STEP_NAME", "recipe-ci"),
        // The clone step is number 1.
        ("DRONE_STEP_NUMBER", "2"),
    ] {
        env.insert(k.into(), v.into());
    }
    env
}

/// The `environment:` of the pipeline's step, as `text` (a `.drone.yml`) gives it: plain
/// `KEY: value` lines.
fn step_environment(text: &str) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    let mut inside: Option<usize> = None;
    for line in text.lines() {
        let indent = line.len() - line.trim_start().len();
        let trimmed = line.trim();
        match inside {
            None if trimmed == "environment:" => inside = Some(indent),
            Some(base) if !trimmed.is_empty() && !trimmed.starts_with('#') => {
                if indent <= base {
                    break;
                }
                if let Some((k, v)) = trimmed.split_once(':') {
                    env.insert(k.trim().to_owned(), v.trim().to_owned());
                }
            }
            _ => {}
        }
    }
    env
}

/// What the runner's substitution sees: the build's variables and parameters only. `${HOME}`,
/// the workspace's and the step's variables are empty there, and a backslash protects nothing
/// (`\${HOME}` gives `\`): measured by compiling this very line with the runner.
#[test]
fn the_substitution_sees_only_the_build_s_variables() {
    let vars = build_vars("7", "7", "custom-html");
    let vars: BTreeMap<&str, &str> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let line = "${HOME} \\${HOME} ${PATH} ${DRONE_WORKSPACE} ${CI_WORKSPACE} ${DRONE_STEP_NAME}";
    assert_eq!(substitute(line, &vars).as_deref(), Ok(" \\    "));
    assert_eq!(
        substitute("${DRONE_REPO} ${DRONE_COMMIT} ${CI_BUILD_NUMBER}", &vars).as_deref(),
        Ok("coop-cloud/custom-html 0123456789abcdef0123456789abcdef01234567 7")
    );
    // The step's own environment has what the substitution lacks, and never CI_WORKSPACE.
    let env = step_env(&build_vars("7", "7", "custom-html"), Path::new("/bin"));
    for name in [
        "DRONE_REPO",
        "DRONE_REPO_OWNER",
        "DRONE_COMMIT",
        "DRONE_STEP_NUMBER",
        "GIT_AUTHOR_NAME",
        "GIT_COMMITTER_EMAIL",
        "PATH",
    ] {
        assert!(env.contains_key(name), "{name}");
    }
    assert_eq!(env["GIT_TERMINAL_PROMPT"], "0");
    assert!(!env.contains_key("CI_WORKSPACE"));
    // With the five the stand-in sets from its workspace (HOME, HOMEPATH, USERPROFILE,
    // DRONE_HOME, DRONE_WORKSPACE): what the runner sets for a pull request, about 98.
    assert!(
        env.len() + 5 >= 95,
        "the runner sets about 98 variables, the stand-in {}",
        env.len() + 5
    );
}

/// `.drone.yml` as the runner reads it, substituted with a build's variables.
fn substituted_pipeline(vars: &BTreeMap<String, String>) -> String {
    let text = std::fs::read_to_string(repo().join(".drone.yml")).unwrap();
    let vars: BTreeMap<&str, &str> = vars.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    substitute(&text, &vars)
        .unwrap_or_else(|e| panic!(".drone.yml fails the runner's substitution: {e}"))
}

/// The runner's substitution leaves every command of the shipped step as written: what the
/// shell runs is what the file says. (`$$` in a step, for one, would reach the shell as `$`.)
#[test]
fn the_pipeline_s_commands_survive_the_runner_s_substitution() {
    let vars = build_vars("7", "7", "custom-html");
    let written = step_commands(&std::fs::read_to_string(repo().join(".drone.yml")).unwrap());
    let read = step_commands(&substituted_pipeline(&vars));
    assert_eq!(
        read, written,
        "the runner's substitution changes a step command of .drone.yml (never write $$ or ${{ in one)"
    );
    // And the check has teeth: the command this pipeline once had is caught.
    let once = "CCCI_TIE_TO=$$ exec sh ci/recipe-ci-step.sh";
    let vars = tsv_vars();
    assert_ne!(substitute(once, &vars).unwrap(), once);
}

/// The script drone-runner-exec writes for a POSIX step: `set -e`, then for each command an
/// `echo + "<command>"` trace line (Go's %q quoting, `$` escaped) and the command itself.
fn runner_script(commands: &[String]) -> String {
    let mut script = String::from("\nset -e\n");
    for command in commands {
        let quoted = format!("{command:?}").replace('$', "\\$");
        script.push_str(&format!("\necho + {quoted}\n{command}\n"));
    }
    script
}

/// How the stand-in `abra`'s deploy behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Deploy {
    /// Deploys, leaves a daemon behind and then "deploys" for a long time: a build to cancel.
    Hangs,
    /// Deploys and returns; undeploy removes the app: a build that succeeds.
    Returns,
}

/// One Drone build on a host: the host's ccci-run installation (a configuration file with this
/// sandbox's directories, `ccci-run` and a stand-in `abra` on the runner's PATH), a recipe
/// repository with the pull request's head, and the runner process.
struct Build {
    /// The runner, its output being the build log.
    step: Proc,
    info: BuildInfo,
}

/// What a test knows of a build besides its log.
#[derive(Debug, Clone)]
struct BuildInfo {
    /// The run's id: the repository and the build number (`coop-cloud.custom-html.7`).
    run_id: String,
    /// The runner stand-in's pid (the step shell's parent).
    runner: i32,
    /// The step shell's pid.
    shell: i32,
    workspace: PathBuf,
    docker: bool,
}

/// The host's installation for `sandbox`: a configuration file, and a PATH directory with
/// `ccci-run` (the built binary reading that file, as an installed one reads
/// /etc/ccci-run/config.toml) and the `abra` stand-in.
fn host(sandbox: &Sandbox, deploy: Deploy, docker: bool, extra_config: &str) -> PathBuf {
    let origin = recipe_origin(sandbox);
    let config = sandbox.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "lock_dir = {:?}\nruns_dir = {:?}\nabra_home = {:?}\nstate_dir = {:?}\n\
             domain_suffix = {:?}\ndocker = {:?}\nrecipe_url_template = {:?}\n{extra_config}",
            sandbox.locks(),
            sandbox.runs(),
            sandbox.abra_home(),
            sandbox.state(),
            sandbox.suffix(),
            if docker { "auto" } else { "off" },
            format!("file://{}/{{recipe}}.git", origin.display()),
        ),
    )
    .unwrap();
    let bin = sandbox.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    // The engine a host's ccci-run and abra talk to: the default socket on a host, the suite's
    // engine here.
    let engine = match std::env::var("DOCKER_HOST") {
        Ok(host) if docker => format!("DOCKER_HOST={}; export DOCKER_HOST\n", sh_quote(&host)),
        _ => String::new(),
    };
    write_executable(
        &bin.join("ccci-run"),
        &format!(
            "#!/bin/sh\n{engine}exec {} --config {} \"$@\"\n",
            sh_quote(BIN),
            sh_quote(&config)
        ),
    );
    let deploy_stack = if docker {
        format!(
            "docker stack deploy --resolve-image never -c {} \"$CCCI_STACK_NAME\" >&2\n",
            sh_quote(compose_file(sandbox.path()))
        )
    } else {
        String::new()
    };
    let deploy_rest = match deploy {
        Deploy::Hangs => {
            "  setsid sh -c 'echo \"daemon $$\"; exec sleep 100000' </dev/null &\n  \
             echo \"deploying $$\"\n  exec sleep 100000 ;;\n"
        }
        Deploy::Returns => "  echo \"deployed $$\" ;;\n",
    };
    let undeploy = if docker {
        "  docker stack rm \"$CCCI_STACK_NAME\" >&2 ;;\n"
    } else {
        "  : ;;\n"
    };
    write_executable(
        &bin.join("abra"),
        &format!(
            "#!/bin/sh\nset -eu\n{engine}case \"$1 $2\" in\n\
             \"app new\")\n  shift 3; server=default; domain=\n  \
             while [ $# -gt 0 ]; do\n    case \"$1\" in --server) server=$2; shift ;; \
             --domain) domain=$2; shift ;; esac\n    shift\n  done\n  \
             mkdir -p \"$ABRA_DIR/servers/$server\"\n  \
             echo \"TYPE=$CCCI_RECIPE\" > \"$ABRA_DIR/servers/$server/$domain.env\" ;;\n\
             \"app deploy\")\n  {deploy_stack}{deploy_rest}\
             \"app undeploy\")\n{undeploy}*) ;;\nesac\n"
        ),
    );
    bin
}

fn write_executable(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    let mut perms = std::fs::metadata(path).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(path, perms).unwrap();
}

/// The recipe's repository, with pull requests 1 to 99 pointing at one commit.
fn recipe_origin(sandbox: &Sandbox) -> PathBuf {
    let root = sandbox.path().join("forge");
    let repo_dir = root.join("custom-html.git");
    if repo_dir.exists() {
        return root;
    }
    std::fs::create_dir_all(&repo_dir).unwrap();
    let git = |args: &[&str]| {
        crate::fetch::git(&repo_dir, args);
    };
    git(&["init", "-q", "-b", "main"]);
    std::fs::write(repo_dir.join("compose.yml"), "version: '3.8'\n").unwrap();
    git(&["add", "compose.yml"]);
    git(&["commit", "-q", "-m", "recipe"]);
    for pr in 1..100 {
        git(&["update-ref", &format!("refs/pull/{pr}/head"), "HEAD"]);
    }
    root
}

/// The repository the runner's clone step clones into each build's workspace: this project's
/// pipeline files, committed (made once per sandbox).
fn pipeline_repo(sandbox: &Sandbox) -> PathBuf {
    let dir = sandbox.path().join("pipeline.git");
    if dir.exists() {
        return dir;
    }
    std::fs::create_dir_all(dir.join("ci")).unwrap();
    for file in [".drone.yml", "ci/recipe-ci-step.sh", "ci/recipe-tests.sh"] {
        std::fs::copy(repo().join(file), dir.join(file)).unwrap();
    }
    let git = |args: &[&str]| crate::fetch::git(&dir, args);
    git(&["init", "-q", "-b", "main"]);
    git(&["add", "-A"]);
    git(&["commit", "-q", "-m", "pipeline"]);
    dir
}

/// Start build `build` of the pipeline: substituted, written, started by the runner stand-in
/// with the runner's environment. `wrap` may put the runner in a cgroup or a namespace.
fn start_build(
    sandbox: &Sandbox,
    build: &str,
    bin: &Path,
    docker: bool,
    wrap: impl FnOnce(&mut Command),
) -> Build {
    start_build_of(sandbox, build, build, "custom-html", bin, docker, wrap)
}

/// [`start_build`] of pull request `pr` of recipe repository `repo`.
fn start_build_of(
    sandbox: &Sandbox,
    build: &str,
    pr: &str,
    recipe_repo: &str,
    bin: &Path,
    docker: bool,
    wrap: impl FnOnce(&mut Command),
) -> Build {
    // The runner makes the workspace (`<root>/drone-<random>/drone/src`); the variables that
    // name it are its to set, after the substitution, which does not see them.
    let root = sandbox.path().join("runner-root");
    let vars = build_vars(build, pr, recipe_repo);
    let pipeline = substituted_pipeline(&vars);
    let script = runner_script(&step_commands(&pipeline));
    let env = step_env(&vars, bin);
    let mut cmd = Command::new("python3");
    cmd.arg(repo().join("tests/integration/drone_runner.py"))
        .arg(&root)
        .arg(pipeline_repo(sandbox))
        .arg("recipe-ci")
        .arg(&script)
        .arg(serde_json::to_string(&env).unwrap())
        .arg(serde_json::to_string(&step_environment(&pipeline)).unwrap());
    wrap(&mut cmd);
    let mut step = Proc::spawn(cmd);
    let line = step.wait_for(Stream::Err, "runner ");
    let words: Vec<&str> = line.split_whitespace().collect();
    let (runner, shell) = (words[1].parse().unwrap(), words[3].parse().unwrap());
    let workspace = PathBuf::from(words[5]);
    Build {
        step,
        info: BuildInfo {
            run_id: format!("coop-cloud.{recipe_repo}.{build}"),
            runner,
            shell,
            workspace,
            docker,
        },
    }
}

/// A Docker sandbox when an engine answers, else a plain one (outside CI).
fn sandbox_maybe_docker() -> (Sandbox, bool) {
    match Sandbox::with_docker() {
        Some(sandbox) => (sandbox, true),
        None => (Sandbox::new(), false),
    }
}

/// The pids of a cancellable build once its command deploys: the supervisor, the deploying
/// `abra` and its daemon.
fn running_build(sandbox: &Sandbox, build: &mut Build) -> (Value, Vec<i32>) {
    let pids = pids_by_prefix(&mut build.step, &["deploying ", "daemon "]);
    let record = sandbox.record(&build.info.run_id);
    let supervisor = record["pid"].as_i64().unwrap() as i32;
    (record, vec![supervisor, pids[0], pids[1]])
}

/// After a build was stopped: every process of the run gone, the workspace gone, the app
/// removed, the lock free, the cgroup and state files gone, the record finished.
#[track_caller]
fn assert_nothing_of_the_run_left(sandbox: &Sandbox, build: &BuildInfo, pids: &[i32]) -> Value {
    for pid in pids {
        assert!(wait_exited(*pid), "process {pid} of the run outlived it");
    }
    let record = sandbox.record(&build.run_id);
    let phases = record["phases"].as_array().unwrap();
    assert_eq!(
        phases.last().unwrap()["name"],
        "finished",
        "record not finished: {record:#}"
    );
    let domain = record["domain"].as_str().unwrap().to_owned();
    let env = sandbox
        .abra_home()
        .join(format!("servers/default/{domain}.env"));
    assert!(!env.exists(), "the app's .env was left: {}", env.display());
    let abra_dir = record["abra_dir"].as_str().unwrap();
    assert!(
        !Path::new(abra_dir)
            .join(format!("servers/default/{domain}.env"))
            .exists(),
        "the run's own .env was left"
    );
    let lock = sandbox.lock_file(&domain);
    if lock.exists() {
        assert!(
            crate::util::lock_is_free(&lock),
            "the app lock is still held"
        );
    }
    if build.docker {
        assert_gone_now(record["stack"].as_str().unwrap());
    }
    if let Some(cgroup) = record["cgroup"].as_str() {
        assert!(!Path::new(cgroup).exists(), "cgroup {cgroup} was left");
    }
    assert!(
        sandbox.state_files().is_empty(),
        "{:?}",
        sandbox.state_files()
    );
    // The runner removes it a moment after the cancel, on a timer of its own: wait for that.
    assert!(
        wait_removed(&build.workspace),
        "the runner removes the workspace"
    );
    record
}

/// A stand-in for the system journal's socket, seen at /run/systemd/journal/socket only by
/// the processes of a private mount namespace (a runner wrapped by [`Journal::wrap`]).
struct Journal {
    dir: PathBuf,
    socket: UnixDatagram,
}

impl Journal {
    fn new(sandbox: &Sandbox) -> Self {
        let dir = sandbox.path().join("journal");
        std::fs::create_dir_all(&dir).unwrap();
        let socket = UnixDatagram::bind(dir.join("socket")).unwrap();
        Self { dir, socket }
    }

    /// Run `cmd` in a mount namespace of its own where this socket is the journal's.
    fn wrap(&self, cmd: &mut Command) {
        let program = cmd.get_program().to_owned();
        let args: Vec<_> = cmd.get_args().map(ToOwned::to_owned).collect();
        let mut wrapped = Command::new("unshare");
        wrapped
            .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg(
                "mkdir -p /run/systemd && mount -t tmpfs tmpfs /run/systemd && \
                 mkdir /run/systemd/journal && mount --bind \"$0\" /run/systemd/journal && \
                 exec \"$@\"",
            )
            .arg(&self.dir)
            .arg(program)
            .args(args);
        *cmd = wrapped;
    }

    /// The next journal entry whose MESSAGE contains `needle`, within `limit`: its fields.
    fn wait_for(&self, needle: &str, limit: Duration) -> BTreeMap<String, String> {
        let end = Instant::now() + limit;
        let mut buf = vec![0u8; 65536];
        let mut seen = Vec::new();
        while Instant::now() < end {
            self.socket
                .set_read_timeout(Some(
                    end.saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1)),
                ))
                .unwrap();
            let Ok(n) = self.socket.recv(&mut buf) else {
                continue;
            };
            let entry = journal_fields(&buf[..n]);
            if entry.get("MESSAGE").is_some_and(|m| m.contains(needle)) {
                return entry;
            }
            seen.push(entry);
        }
        panic!("no journal entry with {needle:?}; got {seen:#?}");
    }
}

/// The fields of one entry in the journal's native protocol: `KEY=value` lines, or `KEY`, a
/// newline, the value's length (64-bit little-endian), the value and a newline.
fn journal_fields(mut bytes: &[u8]) -> BTreeMap<String, String> {
    let mut fields = BTreeMap::new();
    while let Some(end) = bytes.iter().position(|b| *b == b'\n' || *b == b'=') {
        let key = String::from_utf8_lossy(&bytes[..end]).into_owned();
        let (value, rest) = if bytes[end] == b'=' {
            let line = bytes[end + 1..]
                .iter()
                .position(|b| *b == b'\n')
                .unwrap_or(bytes.len() - end - 1);
            (
                &bytes[end + 1..end + 1 + line],
                &bytes[(end + 2 + line).min(bytes.len())..],
            )
        } else {
            let len = u64::from_le_bytes(bytes[end + 1..end + 9].try_into().unwrap()) as usize;
            (
                &bytes[end + 9..end + 9 + len],
                &bytes[(end + 10 + len).min(bytes.len())..],
            )
        };
        fields.insert(key, String::from_utf8_lossy(value).into_owned());
        bytes = rest;
    }
    fields
}

/// Drone's cancel, as the runner does it: SIGINT to the runner, which SIGKILLs its step shell
/// (nothing else), closes the log and removes the workspace. The run is tied to that shell: its
/// teardown runs at once, with nobody reading its output; the deploying stand-in, its daemon
/// and the app are gone, the lock free, the record says which pid died, and the outcome reaches
/// the system journal.
#[test]
fn a_cancelled_build_tears_its_run_down_with_its_log_gone() {
    let (sandbox, docker) = sandbox_maybe_docker();
    let bin = host(&sandbox, Deploy::Hangs, docker, "");
    let journal = Journal::new(&sandbox);
    // Daemon mode: the log is read on until its end (exec mode stops reading at its exit).
    let mut build = start_build(&sandbox, "93", &bin, docker, |cmd| {
        journal.wrap(cmd);
        cmd.env("RUNNER_MODE", "daemon");
    });
    let (record, pids) = running_build(&sandbox, &mut build);
    let _cleanup = Cleanup(record["stack"].as_str().unwrap().to_owned());
    assert_eq!(
        record["tied_to"],
        serde_json::json!([build.info.shell, build.info.runner]),
        "the run must be tied to the step shell and to the runner"
    );
    signal(build.info.runner, Signal::SIGINT);
    build.step.wait_for(Stream::Err, "cancel received");
    assert!(wait_exited(build.info.shell));
    let record = assert_nothing_of_the_run_left(&sandbox, &build.info, &pids);
    assert_eq!(record["shutdown_reason"], "tied-pid-died");
    assert_eq!(record["tied_pid_died"], build.info.shell);
    assert_eq!(record["exit_code"], 143);
    let entry = journal.wait_for(
        "run coop-cloud.custom-html.93: torn down after tied-pid-died, exit 143, nothing left",
        crate::util::PATIENCE,
    );
    assert_eq!(entry["SYSLOG_IDENTIFIER"], "ccci-run", "{entry:?}");
    assert_eq!(entry["PRIORITY"], "5", "{entry:?}");
    // The daemon read the step's output to its end: the run's teardown lines are in the log.
    let done = build.step.finish();
    done.assert_code(0);
    assert!(
        done.out.iter().any(|l| l.contains("exit 143")),
        "{}",
        done.transcript()
    );
}

/// The runner itself dies (SIGKILL, as the OOM killer does): nobody kills the step shell, it is
/// re-parented and would run on to the deadline. The run is tied to the runner too, so it tears
/// down at once; the shell then ends with it.
#[test]
fn the_runner_s_own_death_tears_the_run_down() {
    let (sandbox, docker) = sandbox_maybe_docker();
    let bin = host(&sandbox, Deploy::Hangs, docker, "");
    let mut build = start_build(&sandbox, "95", &bin, docker, |_| {});
    let (record, pids) = running_build(&sandbox, &mut build);
    let _cleanup = Cleanup(record["stack"].as_str().unwrap().to_owned());
    let killed = Instant::now();
    signal(build.info.runner, Signal::SIGKILL);
    let done = build.step.finish();
    assert!(!done.status.success());
    assert!(
        wait_exited(build.info.shell),
        "the step shell outlived its run"
    );
    let mut all = pids.clone();
    all.push(build.info.shell);
    // The runner removes no workspace when it dies: the run's own test of "nothing left".
    std::fs::remove_dir_all(&build.info.workspace).unwrap();
    let record = assert_nothing_of_the_run_left(&sandbox, &build.info, &all);
    eprintln!(
        "runner SIGKILL to nothing of the run left: {:?}",
        killed.elapsed()
    );
    assert_eq!(record["shutdown_reason"], "tied-pid-died");
    assert_eq!(record["tied_pid_died"], build.info.runner, "{record:#}");
    assert_eq!(record["exit_code"], 143);
}

/// Each behaviour of the stand-in (`drone_runner.py` and this file), with the line of
/// drone-runner-exec 9decf29 (or of the modules it vendors, at its go.sum's versions) it copies.
/// Known differences are said so in their row.
const RUNNER_PARITY: &[(&str, &str)] = &[
    (
        "a cancel is SIGINT/SIGTERM to the runner",
        "vendor/github.com/drone/signal/signal.go:26 (Notify SIGINT, SIGTERM); command/exec.go:127-130",
    ),
    (
        "the cancel SIGKILLs the step shell's pid alone, no wait",
        "engine/exec.go:124-130 (cmd.Process.Kill(), return without Wait)",
    ),
    (
        "a second signal while stopping kills the runner by that signal, the workspace left",
        "vendor/github.com/drone/signal/signal.go:27 (signal.Stop after the first)",
    ),
    (
        "exit 0 when cancelled, 1 on a failed step, the step's code never printed",
        "command/exec.go:147-151",
    ),
    (
        "exec mode: the log read until EOF or the runner's exit, which follows the removal",
        "engine/exec.go:130; runtime/execer.go:62 and engine/exec.go:93-95 (Destroy = os.RemoveAll)",
    ),
    (
        "daemon mode: the log read until EOF, its writer never errors",
        "runtime/runner.go:117-126 (cancel over RPC); vendor/github.com/drone/runner-go/livelog/livelog.go:69-112",
    ),
    (
        "the workspace: base 0755, home/drone, drone/src, opt 0700",
        "engine/exec.go:28 (MkdirAll(root, 0777)); engine/compiler/compiler.go:92-130",
    ),
    (
        "the .netrc, always in exec mode: 0600 `machine  login  password `",
        "engine/compiler/compiler.go:133-146",
    ),
    (
        "the scripts opt/clone and opt/<step>: 0700",
        "engine/compiler/compiler.go:187-222, 226-245",
    ),
    (
        "the shell's group and session are the runner's, stdin /dev/null",
        "engine/exec.go:99-103 (no SysProcAttr, nil Stdin)",
    ),
    (
        "the step's environment: PATH, USER from the host, the proxies, the build's variables, \
         GIT_*, HOME in the workspace, the step's name and number, `environment:`",
        "engine/compiler/vars.go:14-16; engine/compiler/compiler.go:157-185, 237-241; runtime/execer.go:163-168",
    ),
    (
        "the substitution: the build's variables and parameters only",
        "command/exec.go:50-76 (runtime/runner.go:128-146 in daemon mode)",
    ),
    (
        "the script: set -e, `echo + %q` and each command, run as /bin/sh -e FILE",
        "vendor/github.com/drone/runner-go/shell/bash/bash.go:20-52",
    ),
    (
        "the runner's own death kills nobody",
        "(nothing: no parent-death signal is set, engine/exec.go:99-103)",
    ),
    (
        "differs: the clone is a plain `git clone` of the default branch, its output not logged",
        "engine/compiler/compiler.go:187-222; vendor/github.com/drone/runner-go/clone/clone.go:66-74",
    ),
    (
        "differs: the log is copied in raw chunks, not as `[step:N]` lines",
        "vendor/github.com/drone/runner-go/pipeline/console/plain.go",
    ),
];

/// The parity table names a runner source line for every behaviour, and the stand-in points to it.
#[test]
fn every_stand_in_behaviour_names_the_runner_line_it_copies() {
    for (behaviour, source) in RUNNER_PARITY {
        assert!(
            source.contains(".go") || source.starts_with("(nothing"),
            "{behaviour}: {source}"
        );
    }
    let stand_in =
        std::fs::read_to_string(repo().join("tests/integration/drone_runner.py")).unwrap();
    assert!(stand_in.contains("RUNNER_PARITY"));
    assert!(RUNNER_PARITY.len() >= 14);
}

/// A second SIGTERM while the runner stops kills it by that signal, with its workspace left
/// (the real runner's signal handler is gone after the first); and the workspace it made has
/// the runner's modes.
#[test]
fn a_second_signal_while_the_runner_stops_kills_it_and_leaves_the_workspace() {
    let sandbox = Sandbox::new();
    let bin = host(&sandbox, Deploy::Hangs, false, "");
    let mut build = start_build(&sandbox, "98", &bin, false, |_| {});
    let (_, pids) = running_build(&sandbox, &mut build);
    let src = build.info.workspace.clone();
    let base = src.parent().unwrap().parent().unwrap().to_owned();
    let mode = |p: &Path| {
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(p).unwrap().permissions())
            & 0o7777
    };
    assert_eq!(mode(&base), 0o755);
    for dir in ["home", "home/drone", "drone", "drone/src", "opt"] {
        assert_eq!(mode(&base.join(dir)), 0o700, "{dir}");
    }
    for file in ["opt/clone", "opt/recipe-ci"] {
        assert_eq!(mode(&base.join(file)), 0o700, "{file}");
    }
    let netrc = base.join("home/drone/.netrc");
    assert_eq!(mode(&netrc), 0o600);
    assert_eq!(
        std::fs::read_to_string(&netrc).unwrap(),
        "machine  login  password "
    );
    // A workspace whose removal takes a while, as a real clone's does (69-382 ms measured).
    let junk = src.join("junk");
    std::fs::create_dir(&junk).unwrap();
    for i in 0..20_000 {
        std::fs::write(junk.join(i.to_string()), "").unwrap();
    }
    signal(build.info.runner, Signal::SIGINT);
    build
        .step
        .wait_for(Stream::Err, "received signal, terminating process");
    signal(build.info.runner, Signal::SIGTERM);
    let done = build.step.finish();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&done.status),
        Some(15),
        "{}",
        done.transcript()
    );
    assert!(
        base.exists(),
        "the killed runner finished removing its workspace"
    );
    for pid in &pids {
        assert!(wait_exited(*pid), "process {pid} of the run outlived it");
    }
    std::fs::remove_dir_all(&base).unwrap();
}

/// The supervisor itself SIGKILLed (as the OOM killer does) while its deploy left a daemon that
/// holds the step's output: the runner reads the log until EOF, so before the run had a dead-man
/// the build hung until a janitor came. Now the run's dead-man kills every process of it at
/// once: the build ends within a second of the supervisor's death, with no janitor, with
/// cgroups and without.
#[rstest::rstest]
#[case::cgroup("auto")]
#[case::no_cgroup("off")]
fn a_build_whose_supervisor_is_sigkilled_ends_at_once(#[case] cgroup: &str) {
    let sandbox = Sandbox::new();
    let bin = host(
        &sandbox,
        Deploy::Hangs,
        false,
        &format!("cgroup = {cgroup:?}\n"),
    );
    let mut build = start_build(&sandbox, "97", &bin, false, |_| {});
    let (record, pids) = running_build(&sandbox, &mut build);
    assert_eq!(record["cgroup"].is_string(), cgroup == "auto", "{record:#}");
    let killed = Instant::now();
    signal(pids[0], Signal::SIGKILL);
    // The runner's log reaches its end only once nothing holds the step's output.
    let done = build.step.finish();
    let ended = killed.elapsed();
    eprintln!("supervisor SIGKILL to the build's end (cgroup {cgroup}): {ended:?}");
    for pid in &pids {
        assert!(
            !process_alive(*pid),
            "process {pid} outlived its run\n{}",
            done.transcript()
        );
    }
    assert!(
        ended < Duration::from_secs(1),
        "the build ran on {ended:?} after its supervisor's death\n{}",
        done.transcript()
    );
    assert!(
        done.out
            .iter()
            .any(|l| l.contains("!! dead-man of run coop-cloud.custom-html.97 ")),
        "{}",
        done.transcript()
    );
    // The step failed: the runner says so with 1.
    done.assert_code(1);
}

/// systemd stopping the runner's unit: SIGTERM to every process of its cgroup (the runner, the
/// step shell, ccci-run, the command), SIGKILL after a window. The run tears down inside the
/// window on its own; the KILL finds nothing left.
#[test]
fn systemd_stop_of_the_runner_unit_tears_the_run_down_within_the_window() {
    let unit = crate::util::TestCgroup::create("runner-unit")
        .expect("a cgroup v2 hierarchy this suite may write (it runs as root)");
    let (sandbox, docker) = sandbox_maybe_docker();
    let bin = host(&sandbox, Deploy::Hangs, docker, "");
    let mut build = start_build(&sandbox, "94", &bin, docker, |cmd| unit.place(cmd));
    let (record, pids) = running_build(&sandbox, &mut build);
    let _cleanup = Cleanup(record["stack"].as_str().unwrap().to_owned());
    // KillMode=control-group: every process of the unit, sub-cgroups included, gets SIGTERM.
    unit.signal_all(Signal::SIGTERM);
    let emptied_by_itself = unit.wait_empty(crate::util::PATIENCE);
    if !emptied_by_itself {
        unit.kill();
    }
    let done = build.step.finish();
    assert!(
        emptied_by_itself,
        "the run was still tearing down when the stop window closed\n{}",
        done.transcript()
    );
    let record = assert_nothing_of_the_run_left(&sandbox, &build.info, &pids);
    // Which came first, its own SIGTERM or the shell's SIGKILL by the runner, is a race
    // between two ways of being told the same thing.
    let reason = record["shutdown_reason"].as_str().unwrap();
    assert!(matches!(reason, "SIGTERM" | "tied-pid-died"), "{record:#}");
    assert_eq!(record["exit_code"], 143);
}

/// A build that runs to its end: the command succeeds, the run exits 0, the build log has the
/// run's lines, the runner reports success, and nothing of the run is left. Without an engine
/// the recipe tests stop at `converge`, which cannot ask a Docker that is off: the build fails
/// with its refusal (2) and still leaves nothing.
#[test]
fn a_successful_build_exits_0_and_leaves_nothing() {
    let (sandbox, docker) = sandbox_maybe_docker();
    let bin = host(&sandbox, Deploy::Returns, docker, "");
    let mut build = start_build(&sandbox, "96", &bin, docker, |_| {});
    let deployed = build.step.wait_for(Stream::Out, "deployed ");
    let Build { step, info } = build;
    let done = step.finish();
    if !docker {
        // The real runner exits 1 on a failed step, and never prints the step's code.
        done.assert_code(1);
        assert!(
            done.transcript().contains("cannot run with Docker off"),
            "converge's refusal is in the build log\n{}",
            done.transcript()
        );
        let record = assert_nothing_of_the_run_left(&sandbox, &info, &[info.shell]);
        assert_eq!(record["exit_code"], 2, "{record:#} {deployed}");
        return;
    }
    done.assert_code(0);
    assert!(
        done.out
            .iter()
            .any(|l| l.contains("== run coop-cloud.custom-html.96: finished, exit 0")),
        "the build log has the run's own lines\n{}",
        done.transcript()
    );
    let record = assert_nothing_of_the_run_left(&sandbox, &info, &[info.shell]);
    assert_eq!(record["exit_code"], 0, "{record:#} {deployed}");
    assert_eq!(record["shutdown_reason"], "command-ended");
    assert!(
        record["commit"].as_str().is_some_and(|c| c.len() == 40),
        "the recipe was cloned: {record:#}"
    );
    if docker {
        let _cleanup = Cleanup(record["stack"].as_str().unwrap().to_owned());
    }
    assert!(!process_alive(info.runner));
}

/// The recipe fixture's repository beside [`recipe_origin`]'s: `tests/fixtures/recipes/lemp`,
/// with recipe tests that print the db volume's first-start mark, then wait while `hold`
/// exists; pull requests 1 to 9.
fn lemp_origin(sandbox: &Sandbox, hold: &Path) -> PathBuf {
    let root = recipe_origin(sandbox);
    let repo_dir = root.join("lemp.git");
    let fixture = repo().join("tests/fixtures/recipes/lemp");
    std::fs::create_dir_all(repo_dir.join("tests")).unwrap();
    for file in ["compose.yml", ".env.sample", "abra.sh", "app.conf"] {
        std::fs::copy(fixture.join(file), repo_dir.join(file)).unwrap();
    }
    write_executable(
        &repo_dir.join("tests/run.sh"),
        &format!(
            "#!/bin/sh\n# The recipe's own tests: the db volume's first-start mark.\nset -eu\n\
             stack=$(printf '%s' \"$1\" | tr . _)\n\
             id=$(docker ps -q --filter \"label=com.docker.swarm.service.name=${{stack}}_db\" | head -n 1)\n\
             echo \"mark $(docker exec \"$id\" cat /var/lib/db/created)\"\n\
             while [ -e {} ]; do sleep 0.1; done\n",
            sh_quote(hold)
        ),
    );
    let git = |args: &[&str]| {
        crate::fetch::git(&repo_dir, args);
    };
    git(&["init", "-q", "-b", "main"]);
    git(&["add", "-A"]);
    git(&["commit", "-q", "-m", "recipe"]);
    for pr in 1..10 {
        git(&["update-ref", &format!("refs/pull/{pr}/head"), "HEAD"]);
    }
    root
}

/// The project's own recipe fixture (`tests/fixtures/recipes/lemp`: three services, an internal
/// network and the host's external `proxy`, two volumes, two external versioned secrets, a
/// versioned config, a timeout label) through the shipped pipeline under the runner stand-in,
/// deployed by the abra stand-in that follows abra's documented layout (`tests/fixtures/abra`),
/// with `servers/default` a link to a server repository of its own and, beside the app,
/// another stack's config named like the app's objects.
///
/// The recipe tests run (after `converge`, bounded by the recipe's own timeout label); the
/// supervisor is SIGKILLed, as the OOM killer does; the janitor reaps every object of the app,
/// the unlabelled secrets by their names, its `.env` behind the link, and never the other
/// stack's config or the `proxy` network; a build of the same pull request straight after
/// deploys the same stack, and its db volume is a fresh one.
#[test]
fn the_recipe_fixture_is_reaped_whole_after_its_supervisor_dies_and_redeploys_at_once() {
    let Some(sandbox) = Sandbox::with_docker() else {
        return;
    };
    // The host's network, which recipes attach to and no reap ever removes.
    let _ = Command::new("docker")
        .args([
            "network",
            "create",
            "-d",
            "overlay",
            "--attachable",
            "proxy",
        ])
        .output();
    let hold = sandbox.path().join("hold");
    std::fs::write(&hold, "").unwrap();
    lemp_origin(&sandbox, &hold);
    let server_repo = sandbox.path().join("server-repo");
    std::fs::create_dir_all(&server_repo).unwrap();
    std::fs::set_permissions(
        &server_repo,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    std::fs::create_dir_all(sandbox.abra_home().join("servers")).unwrap();
    std::os::unix::fs::symlink(&server_repo, sandbox.abra_home().join("servers/default")).unwrap();
    let bin = host(&sandbox, Deploy::Returns, true, "");
    std::fs::copy(repo().join("tests/fixtures/abra"), bin.join("abra")).unwrap();

    let domain = sandbox.domain("lemp", Some("4"));
    let stack = Sandbox::stack(&domain);
    let _cleanup = Cleanup(stack.clone());
    let conf = sandbox.path().join("foreign.txt");
    std::fs::write(&conf, "x\n").unwrap();
    let foreign = format!("{stack}_foreign_conf");
    crate::util::docker(&[
        "config",
        "create",
        "--label",
        &format!("com.docker.stack.namespace={stack}_other"),
        &foreign,
        conf.to_str().unwrap(),
    ]);

    let mut build = start_build_of(&sandbox, "41", "4", "lemp", &bin, true, |_| {});
    let waiting = build.step.wait_for(Stream::Out, "waiting up to");
    assert!(
        waiting.contains(&format!(
            "2m (the recipe's label coop-cloud.{stack}.timeout)"
        )),
        "{waiting}"
    );
    let first = build.step.wait_for(Stream::Out, "mark ");
    let env = server_repo.join(format!("{domain}.env"));
    assert!(env.exists(), "the app's .env is not behind the link");
    let supervisor = sandbox.record("coop-cloud.lemp.41")["pid"]
        .as_i64()
        .unwrap() as i32;
    signal(supervisor, Signal::SIGKILL);
    assert!(wait_exited(supervisor));

    let started = Instant::now();
    let (report, done) = sandbox.janitor(&[]);
    let took = started.elapsed();
    done.assert_code(0);
    let c = crate::util::candidate(&report, &domain);
    assert_eq!(c["decision"], "reap", "{report:#}");
    let removed = &c["removed"];
    for (kind, n) in [
        ("services", 3),
        ("networks", 1),
        ("volumes", 2),
        ("secrets", 2),
        ("configs", 1),
        ("env_files", 1),
    ] {
        assert_eq!(
            removed[kind].as_array().map_or(0, Vec::len),
            n,
            "{kind}: {removed:#}"
        );
    }
    let objects: usize = [
        "services",
        "containers",
        "networks",
        "volumes",
        "secrets",
        "configs",
    ]
    .iter()
    .map(|k| removed[*k].as_array().map_or(0, Vec::len))
    .sum();
    eprintln!(
        "recipe fixture: {objects} objects of {stack} reaped and confirmed gone by the janitor \
         in {took:.2?}"
    );
    assert!(!env.exists(), "the .env behind the link was left");
    assert_eq!(
        crate::docker::leftovers(&stack).len(),
        1,
        "only the other stack's config may be left: {:?}",
        crate::docker::leftovers(&stack)
    );
    assert!(
        !crate::util::docker(&["config", "ls", "-q", "--filter", &format!("name={foreign}")])
            .trim()
            .is_empty(),
        "another stack's config was removed"
    );
    assert!(
        Command::new("docker")
            .args(["network", "inspect", "proxy"])
            .output()
            .unwrap()
            .status
            .success(),
        "the host's proxy network was removed"
    );
    drop(build.step.finish());

    // The same pull request, straight after: the same stack deploys, on a fresh volume.
    std::fs::remove_file(&hold).unwrap();
    let mut again = start_build_of(&sandbox, "42", "4", "lemp", &bin, true, |_| {});
    let second = again.step.wait_for(Stream::Out, "mark ");
    assert_ne!(
        first, second,
        "the redeploy mounted the dead run's db volume"
    );
    let done = again.step.finish();
    done.assert_code(0);
    assert_eq!(crate::docker::leftovers(&stack).len(), 1);
    assert!(!env.exists());
}
