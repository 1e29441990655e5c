//! What ships around the binary: the Drone step, the systemd units, the Nix files, completions,
//! the man page, the CLI reference, and run-dir retention.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::util::{BIN, Proc, Sandbox, need, run, signal};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Run `cmd` and return what it printed; a failure shows the command and both streams.
#[track_caller]
fn succeeds(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {:?}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The Drone step script with this sandbox's directories and the built binary.
fn drone_step(sandbox: &Sandbox, build: &str) -> Command {
    let mut cmd = Command::new("sh");
    cmd.current_dir(repo())
        .arg("ci/recipe-ci-step.sh")
        .args(["sh", "-c", "echo ready $$; exec sleep 1000"])
        .env("CCCI_BIN", BIN)
        .env("DRONE_REPO", "coop-cloud/custom-html")
        .env("DRONE_REPO_NAME", "custom-html")
        .env("DRONE_PULL_REQUEST", "5")
        .env("DRONE_BUILD_NUMBER", build)
        .env("CCCI_RUNS_DIR", sandbox.runs())
        .env("CCCI_ABRA_HOME", sandbox.abra_home())
        .env("CCCI_APP_LOCK_DIR", sandbox.locks())
        .env("CCCI_STATE_DIR", sandbox.state())
        .env("CCCI_DOCKER", "off")
        .env("CCCI_RECIPE_URL_TEMPLATE", "/nonexistent/{recipe}");
    cmd
}

#[test]
fn drone_yml_runs_the_step_script() {
    let yml = std::fs::read_to_string(repo().join(".drone.yml")).unwrap();
    assert!(yml.contains("type: exec"));
    assert!(
        yml.contains("- exec sh ci/recipe-ci-step.sh"),
        "the step shell must become the step script\n{yml}"
    );
    assert!(
        !yml.contains("$$") && !yml.contains("${"),
        "the runner's substitution rewrites `$$` and `${{…}}` anywhere in the file\n{yml}"
    );
    assert!(
        !yml.contains("concurrency:"),
        "capacity is the runner's knob, not the pipeline's"
    );
    if need("yamllint") {
        succeeds(Command::new("yamllint").current_dir(repo()).args([
            "--strict",
            ".drone.yml",
            ".yamllint",
        ]));
    }
}

/// The step under way, its command started: the recipe is staged for CCCI_SKIP_FETCH.
fn started_drone_step(sandbox: &Sandbox, build: &str) -> Proc {
    std::fs::create_dir_all(sandbox.abra_home().join("recipes/custom-html/.git")).unwrap();
    let mut cmd = drone_step(sandbox, build);
    cmd.env("CCCI_SKIP_FETCH", "1");
    let mut step = Proc::spawn(cmd);
    step.wait_ready();
    step
}

/// Cancellation through a TERM to the step shell reaches ccci-run through the trap.
#[test]
fn drone_step_shell_term_tears_the_run_down() {
    let sandbox = Sandbox::new();
    let step = started_drone_step(&sandbox, "91");
    signal(step.pid(), Signal::SIGTERM);
    let done = step.finish();
    done.assert_code(143);
    done.assert_stderr_has("== SIGTERM received — tearing down ==");
    let record = sandbox.record("coop-cloud.custom-html.91");
    assert_eq!(record["exit_code"], 143);
    assert_eq!(record["pr"], "5");
}

/// `nix-instantiate --eval --strict --json EXPR` in the repository, its value.
fn nix_eval(expr: &str) -> serde_json::Value {
    let out = succeeds(
        Command::new("nix-instantiate")
            .current_dir(repo())
            .args(["--eval", "--strict", "--json", "-E", expr]),
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Every Nix file parses, and the rules the module's option types are built from
/// (nix/lib.nix) take and refuse what the binary and systemd do. The module itself needs a
/// nixpkgs: nixos::nixos_module_* evaluate it on the real module system.
#[test]
fn every_nix_file_parses_and_the_helpers_evaluate() {
    if !need("nix-instantiate") {
        return;
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("nix"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "nix"))
        .collect();
    files.push(repo().join("tests/nix/eval-module.nix"));
    assert!(files.len() >= 5, "{files:?}");
    for file in &files {
        succeeds(Command::new("nix-instantiate").arg("--parse").arg(file));
    }
    // (value, accepted) for each rule: what the binary's parsers and systemd take.
    let rules: &[(&str, &[(&str, bool)])] = &[
        (
            "(durationRule { min = \"0s\"; max = \"365d\"; }).check",
            &[
                ("0", true),
                ("1.5", true),
                ("90s", true),
                ("5m", true),
                ("1h30m", true),
                ("1h 30m", true),
                ("14d", true),
                ("365d", true),
                ("2w", true),
                ("366d", false),
                ("1y", false),
                ("", false),
                ("-1", false),
                ("1h30", false),
                ("10 parsecs", false),
                ("1e3", false),
                (".5", false),
                ("5S", false),
                ("1M", false),
                ("90min", false),
                ("1hour", false),
                ("3days", false),
                ("1.0001", false),
                ("500ms", true),
            ],
        ),
        (
            "(durationRule { min = \"0s\"; max = \"36500d\"; unitRequired = true; }).check",
            &[
                ("14d", true),
                ("36500d", true),
                ("12h", true),
                ("14", false),
                ("36501d", false),
                ("0d", true),
            ],
        ),
        (
            "leaseTtlRule.check",
            &[
                ("2", true),
                ("10s", true),
                ("3600s", true),
                ("1h", true),
                ("1", false),
                ("3601", false),
                ("2.5", false),
                ("1500ms", false),
            ],
        ),
        (
            "isAbsolutePath",
            &[
                ("/run/lock", true),
                ("/root/.abra", true),
                ("/", false),
                ("run/lock", false),
                ("/a/../b", false),
                ("/a/./b", false),
                ("/a/", false),
                ("/a//b", false),
                ("/a b", false),
                ("/a%b", false),
            ],
        ),
        (
            "(lib.findFirst (s: s.key == \"keep_runs\") null runSettings).rule.check",
            &[
                ("14d", true),
                ("1h", true),
                ("59m", false),
                ("0d", false),
                ("14", false),
            ],
        ),
        (
            "isMetricsFile",
            &[
                ("/var/lib/prometheus/node-exporter/ccci-run.prom", true),
                ("ccci-run.prom", false),
                ("/ccci-run.prom", false),
                ("/var/lib/ccci-run.txt", false),
                ("/var/lib/ccci-run.prom", false),
                ("/tmp/ccci-run.prom", false),
                ("/tmp/metrics/ccci-run.prom", false),
                ("/var/tmp/ccci-run.prom", false),
            ],
        ),
        (
            "isOwnDir",
            &[
                ("/var/lib/cc-ci-runs", true),
                ("/srv/ci/runs", true),
                ("/var/lib", false),
                ("/root", false),
                ("/run/lock", false),
                ("/tmp", false),
                ("/tmp/runs", false),
                ("/var/tmp/runs", false),
                ("/proc/1", false),
                ("/sys/fs/x", false),
                ("/tmpfoo", true),
            ],
        ),
        (
            "isLockDir",
            &[
                ("/run/lock", true),
                ("/run/ccci-run", true),
                ("/var/lib", false),
            ],
        ),
        (
            "isDomainSuffix",
            &[
                ("ci.commoninternet.net", true),
                ("example", true),
                ("CI.example.org", false),
                ("-ci.example.org", false),
                ("ci..example.org", false),
                ("a-much-longer-suffix.ci.example.org", false),
            ],
        ),
        (
            "isRecipeUrlTemplate",
            &[
                ("https://git.coopcloud.tech/coop-cloud/{recipe}.git", true),
                ("/srv/git/{recipe}", true),
                ("https://git.example.org/r.git", false),
                ("https://git.example.org/{recipe} .git", false),
            ],
        ),
        (
            "isEndpoint",
            &[
                ("http://10.0.0.1:2379", true),
                ("http://[::1]:2379", true),
                ("http://etcd.example.org:2379/", true),
                ("10.0.0.2:2379", false),
                ("[::1]:2379", false),
                ("https://10.0.0.1:2379", false),
                ("10.0.0.1", false),
                ("10.0.0.1:0", false),
                ("10.0.0.1:70000", false),
            ],
        ),
        (
            "isInterval",
            &[
                ("10min", true),
                ("1h 30min", true),
                ("600", true),
                ("1.5h", true),
                ("1min", true),
                ("365d", true),
                ("0", false),
                ("0s", false),
                ("1us", false),
                ("59s", false),
                ("366d", false),
                ("99999999999999999999y", false),
                ("bogus", false),
            ],
        ),
        (
            "isServiceName",
            &[
                ("drone-runner-exec", true),
                ("ci-runner", true),
                ("drone-runner-exec.service", false),
                ("a b", false),
            ],
        ),
    ];
    for (rule, cases) in rules {
        let values: Vec<&str> = cases.iter().map(|(v, _)| *v).collect();
        let got = nix_eval(&format!(
            "with import ./nix/lib.nix; let lib = {{ findFirst = p: d: l: \
             let m = builtins.filter p l; in if m == [] then d else builtins.head m; }}; in \
             map ({rule}) (builtins.fromJSON {})",
            serde_json::to_string(&serde_json::to_string(&values).unwrap()).unwrap()
        ));
        for ((value, want), got) in cases.iter().zip(got.as_array().unwrap()) {
            assert_eq!(got, want, "{rule} {value:?}");
        }
        // What the interval rule takes, systemd takes too.
        if *rule == "isInterval" && need("systemd-analyze") {
            for (value, _) in cases.iter().filter(|(_, ok)| *ok) {
                succeeds(Command::new("systemd-analyze").args(["timespan", value]));
            }
        }
    }
    // The system directories no directory of the module's may be are the binary's own list.
    let retention = std::fs::read_to_string(repo().join("src/janitor/retention.rs")).unwrap();
    let list = retention
        .split("const SYSTEM_DIRS: &[&str] = &[")
        .nth(1)
        .and_then(|rest| rest.split("];").next())
        .expect("src/janitor/retention.rs has SYSTEM_DIRS");
    let binary: Vec<&str> = list
        .split(',')
        .map(|d| d.trim().trim_matches('"'))
        .filter(|d| !d.is_empty())
        .collect();
    assert_eq!(
        nix_eval("(import ./nix/lib.nix).systemDirs"),
        serde_json::json!(binary)
    );
    // The janitor's command line with the host's defaults is the one systemd/ ships.
    let args = nix_eval(
        "with import ./nix/lib.nix; janitorArgs { inherit (defaults) longHeld keepRuns metricsFile; }",
    );
    let unit = std::fs::read_to_string(repo().join("systemd/ccci-run-janitor.service")).unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .unwrap();
    let shipped: Vec<&str> = exec.split_whitespace().skip(1).collect();
    assert_eq!(args, serde_json::json!(shipped));
    // Whatever the module passes is a command line the binary accepts.
    succeeds(Command::new(BIN).args(shipped).arg("--help"));
    let args = nix_eval(
        "(import ./nix/lib.nix).janitorArgs { longHeld = \"60\"; keepRuns = null; metricsFile = null; }",
    );
    assert_eq!(args, serde_json::json!(["janitor", "--long-held", "60"]));
    // The file from the host's defaults holds what systemd/config.toml holds; with the etcd
    // settings and every run setting, it is one the binary reads as meant.
    let defaults = nix_eval(
        "with import ./nix/lib.nix; configToml { inherit (defaults) lockDir runsDir abraHome stateDir docker; }",
    );
    let shipped = std::fs::read_to_string(repo().join("systemd/config.toml")).unwrap();
    assert_eq!(
        defaults.as_str().unwrap().parse::<toml::Table>().unwrap(),
        shipped.parse::<toml::Table>().unwrap()
    );
    // Every run setting the module writes is shown, commented, in systemd/config.toml.
    let keys = nix_eval("map (s: s.key) (import ./nix/lib.nix).runSettings");
    for key in keys.as_array().unwrap() {
        let key = key.as_str().unwrap();
        assert!(
            shipped
                .lines()
                .any(|l| l.starts_with(&format!("# {key} = \""))),
            "systemd/config.toml does not show {key}"
        );
    }
    let toml = nix_eval(
        "(import ./nix/lib.nix).configToml { lockDir = \"/l\"; runsDir = \"/r\"; \
         abraHome = \"/a\"; stateDir = \"/s\"; docker = \"auto\"; \
         dockerHost = \"tcp://10.0.0.5:2376\"; runnerUser = \"nobody\"; \
         etcdEndpoints = [ \"http://10.0.0.1:2379\" \"http://10.0.0.2:2379\" ]; leaseTtl = \"15s\"; \
         settings = { deadline = \"90m\"; kill_grace = \"1.5\"; teardown_timeout = \"10m\"; \
         lock_wait = \"0\"; long_held = \"3h\"; keep_runs = \"30d\"; reap_budget = \"5m\"; \
         promote_after = \"20m\"; converge_timeout = \"10m\"; converge_stable = \"5s\"; }; }",
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.toml");
    std::fs::write(&file, toml.as_str().unwrap()).unwrap();
    let mut cmd = Command::new(BIN);
    crate::util::without_ccci_env(&mut cmd);
    // The file's docker_host is in force only where the environment names no engine.
    cmd.env_remove("DOCKER_HOST");
    let out = succeeds(cmd.arg("--config").arg(&file).args(["config", "--json"]));
    let settings: serde_json::Value =
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["settings"].clone();
    let setting = |key: &str| {
        settings
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["key"] == key)
            .cloned()
            .unwrap_or_else(|| panic!("`ccci-run config` shows no {key}"))
    };
    assert_eq!(
        setting("etcd_endpoints")["value"],
        "http://10.0.0.1:2379,http://10.0.0.2:2379"
    );
    assert_eq!(setting("lock_dir")["value"], "/l");
    for key in keys.as_array().unwrap().iter().map(|k| k.as_str().unwrap()) {
        assert_eq!(setting(key)["origin"]["kind"], "file", "{key}");
    }
    assert_eq!(setting("lease_ttl")["value"], "15s");
    assert_eq!(setting("lease_ttl")["origin"]["kind"], "file");
    assert_eq!(setting("docker_host")["value"], "tcp://10.0.0.5:2376");
    assert_eq!(setting("docker_host")["origin"]["kind"], "file");
    assert_eq!(setting("runner_user")["value"], "nobody");
}

#[test]
fn systemd_units_verify() {
    if !need("systemd-analyze") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // verify insists that ExecStart exists and that Documentation= man pages resolve: point it
    // at the built binary and at the man page it renders, and change nothing else.
    let man = dir.path().join("man/man1");
    succeeds(Command::new(BIN).arg("man").arg("--dir").arg(&man));
    for unit in ["ccci-run-janitor.service", "ccci-run-janitor.timer"] {
        let text = std::fs::read_to_string(repo().join("systemd").join(unit)).unwrap();
        std::fs::write(
            dir.path().join(unit),
            text.replace("/usr/local/bin/ccci-run", BIN),
        )
        .unwrap();
    }
    let out = Command::new("systemd-analyze")
        .current_dir(dir.path())
        .env("MANPATH", dir.path().join("man"))
        .args([
            "verify",
            "ccci-run-janitor.service",
            "ccci-run-janitor.timer",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn completions_parse_in_their_shells() {
    for (shell, check) in [
        ("bash", vec!["bash", "-n"]),
        ("zsh", vec!["zsh", "-n"]),
        ("fish", vec!["fish", "--no-execute"]),
    ] {
        let out = succeeds(Command::new(BIN).args(["completions", shell]));
        assert!(String::from_utf8_lossy(&out.stdout).contains("ccci-run"));
        if !need(check[0]) {
            continue;
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(format!("ccci-run.{shell}"));
        std::fs::write(&file, &out.stdout).unwrap();
        succeeds(Command::new(check[0]).args(&check[1..]).arg(&file));
    }
}

/// The completion script for `shell`, written to a file of `dir`.
fn completion_script(dir: &Path, shell: &str) -> PathBuf {
    let out = succeeds(Command::new(BIN).args(["completions", shell]));
    let file = dir.join(format!("ccci-run.{shell}"));
    std::fs::write(&file, &out.stdout).unwrap();
    file
}

/// What bash offers at the end of `line`: the script sourced, the function that
/// `complete -F` registered for ccci-run called as readline calls it.
fn bash_offers(script: &Path, line: &str) -> Vec<String> {
    bash_offers_in(script, line, &[])
}

/// What bash offers at the end of `line`, with `env` set (the completion may ask ccci-run).
fn bash_offers_in(script: &Path, line: &str, env: &[(&str, String)]) -> Vec<String> {
    const DRIVER: &str = r#"
source "$1" || exit 3
spec=$(complete -p ccci-run) || exit 4
fn=${spec#*-F }; fn=${fn%% *}
COMP_LINE=$2
COMP_POINT=${#COMP_LINE}
read -ra COMP_WORDS <<< "$COMP_LINE"
[[ $COMP_LINE == *' ' ]] && COMP_WORDS+=("")
COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
COMPREPLY=()
"$fn" ccci-run "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
printf '%s\n' "${COMPREPLY[@]}"
"#;
    let out = succeeds(
        Command::new("bash")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .args(["--norc", "--noprofile", "-c", DRIVER, "bash"])
            .arg(script)
            .arg(line),
    );
    offered(&out.stdout)
}

/// What fish offers at the end of `line` (`complete -C`), the script sourced.
fn fish_offers(script: &Path, line: &str) -> Vec<String> {
    fish_offers_in(script, line, &[])
}

fn fish_offers_in(script: &Path, line: &str, env: &[(&str, String)]) -> Vec<String> {
    let out = succeeds(
        Command::new("fish")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .args([
                "--no-config",
                "-c",
                r#"source $argv[1]; complete -C $argv[2]"#,
            ])
            .arg(script)
            .arg(line),
    );
    offered(&out.stdout)
}

/// What zsh offers when Tab is pressed at the end of `line`, in an interactive zsh on a pty
/// (zpty) with compinit and the script loaded; `compadd` is wrapped to print each match it
/// adds.
fn zsh_offers(script: &Path, line: &str) -> Vec<String> {
    zsh_offers_in(script, line, &[])
}

fn zsh_offers_in(script: &Path, line: &str, env: &[(&str, String)]) -> Vec<String> {
    const DRIVER: &str = r#"
zmodload zsh/zpty || exit 3
zpty z zsh -f -i
zpty -w z "PS1='ZP%% '; LISTMAX=100000; autoload -Uz compinit; compinit -u -D; source ${(q)1}"
zpty -w z 'compadd() { if (( ${@[(I)-[OAD]]} )); then builtin compadd "$@"; return; fi; local -a __h; builtin compadd -O __h "$@"; local h; for h in $__h; do print -r -- "<<offer>> $h"; done; builtin compadd "$@"; }'
zpty -w z 'echo RE""ADY'
# Typed only once the line editor prompts: typeahead before it is not edited.
zpty -r z out '*READY*ZP% *'
zpty -w -n z "$2"$'\t'
zpty -w -n z $'\C-u'
zpty -w z 'echo DO""NE'
zpty -r z out '*DONE*'
zpty -d z
print -r -- "$out"
"#;
    let out = succeeds(
        Command::new("timeout")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .args(["60", "zsh", "-f", "-c", DRIVER, "zsh"])
            .arg(script)
            .arg(line),
    );
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "");
    let mut offers: Vec<String> = text
        .split("<<offer>> ")
        .skip(1)
        .filter_map(|rest| rest.lines().next())
        .map(|offer| offer.trim().to_owned())
        .collect();
    offers.sort();
    offers.dedup();
    offers
}

/// One candidate a line, each perhaps followed by a tab and its description (fish's).
fn offered(stdout: &[u8]) -> Vec<String> {
    let mut offers: Vec<String> = String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|l| l.split('\t').next())
        .filter(|c| !c.is_empty())
        .map(str::to_owned)
        .collect();
    offers.sort();
    offers.dedup();
    offers
}

/// The subcommands `ccci-run --help` lists.
pub(crate) fn subcommands() -> Vec<String> {
    let help = succeeds(Command::new(BIN).arg("--help"));
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    let list = help.split("Commands:\n").nth(1).unwrap();
    // A name starts its line two spaces in; a wrapped description goes on further in.
    let mut names: Vec<String> = list
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect();
    names.sort();
    names
}

/// The long options `ccci-run SUBCOMMAND --help` lists.
fn long_options(subcommand: &str) -> Vec<String> {
    let help = succeeds(Command::new(BIN).args([subcommand, "--help"]));
    let option = regex::Regex::new(r"^\s+(?:-[A-Za-z], )?(--[a-z][a-z0-9-]*)").unwrap();
    // A visible alias (flock(1)'s --timeout for --wait) is completed as well.
    let aliases = regex::Regex::new(r"\[alias(?:es)?: ([^\]]*)\]").unwrap();
    let mut options: Vec<String> = String::from_utf8_lossy(&help.stdout)
        .lines()
        .flat_map(|l| {
            let named = option.captures(l).map(|c| c[1].to_owned());
            let aka: Vec<String> = aliases
                .captures(l)
                .map_or_else(Vec::new, |c| c[1].split(", ").map(str::to_owned).collect());
            named.into_iter().chain(aka)
        })
        .collect();
    // The global options a subcommand names by reference, after its own.
    let text = String::from_utf8_lossy(&help.stdout);
    // The list may be wrapped over several lines.
    if let Some((_, rest)) = text.split_once("Global options: ") {
        let rest = rest.split_whitespace().collect::<Vec<_>>().join(" ");
        let list = rest.split(" (").next().unwrap_or_default();
        options.extend(list.split(", ").map(str::to_owned));
    }
    options.sort();
    options.dedup();
    options
}

/// Tab after every subcommand offers that subcommand's options and values, not only the
/// subcommands: in a real bash, fish and zsh, through each one's own completion machinery.
fn completes_every_subcommand(shell: &str, offers: fn(&Path, &str) -> Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let script = completion_script(dir.path(), shell);
    let check = |line: &str, want: &[&str]| {
        assert_eq!(offers(&script, line), want, "{shell}: `{line}<TAB>`");
    };
    check("ccci-run run --re", &["--recipe", "--recipe-url", "--ref"]);
    check("ccci-run lock --class ", &["fast", "normal"]);
    check("ccci-run --docker ", &["auto", "off", "required"]);
    check("ccci-run janitor --docker ", &["auto", "off", "required"]);
    check("ccci-run run --log-format ", &["json", "text"]);
    let shells: Vec<String> = offers(&script, "ccci-run completions ")
        .into_iter()
        .filter(|o| !o.starts_with('-'))
        .collect();
    assert_eq!(
        shells,
        ["bash", "elvish", "fish", "powershell", "zsh"],
        "{shell}"
    );
    let subcommands = subcommands();
    assert!(subcommands.len() >= 8, "{subcommands:?}");
    let top = offers(&script, "ccci-run ");
    // The hidden subcommand the scripts themselves call is never offered.
    assert!(
        !top.iter().any(|o| o.starts_with("__")),
        "{shell}: `ccci-run <TAB>` offers a hidden subcommand: {top:?}"
    );
    let help = offers(&script, "ccci-run help ");
    assert!(
        !help.iter().any(|o| o.starts_with("__")),
        "{shell}: `ccci-run help <TAB>` offers a hidden subcommand: {help:?}"
    );
    for sub in &subcommands {
        assert!(
            top.contains(sub),
            "{shell}: `ccci-run <TAB>` lacks {sub}: {top:?}"
        );
    }
    for sub in subcommands.iter().filter(|s| *s != "help") {
        let got: Vec<String> = offers(&script, &format!("ccci-run {sub} --"))
            .into_iter()
            .filter(|o| o.starts_with("--"))
            .collect();
        assert_eq!(got, long_options(sub), "{shell}: `ccci-run {sub} --<TAB>`");
    }
}

#[test]
fn bash_completes_every_subcommand_s_options() {
    if need("bash") {
        completes_every_subcommand("bash", bash_offers);
    }
}

#[test]
fn fish_completes_every_subcommand_s_options() {
    if need("fish") {
        completes_every_subcommand("fish", fish_offers);
    }
}

#[test]
fn zsh_completes_every_subcommand_s_options() {
    if need("zsh") {
        completes_every_subcommand("zsh", zsh_offers);
    }
}

/// A man page rendered to text by groff, which must render it without a single warning.
fn groff_text(file: &Path) -> String {
    let check = Command::new("groff")
        .args(["-man", "-Tutf8", "-ww", "-z"])
        .arg(file)
        .output()
        .unwrap();
    assert!(
        check.status.success() && check.stderr.is_empty(),
        "{}: {}",
        file.display(),
        String::from_utf8_lossy(&check.stderr)
    );
    let text = Command::new("groff")
        .args(["-man", "-Tutf8", "-P-cbou"])
        .arg(file)
        .output()
        .unwrap();
    String::from_utf8_lossy(&text.stdout).into_owned()
}

#[test]
fn man_page_renders() {
    let page = succeeds(Command::new(BIN).arg("man"));
    if !need("groff") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ccci-run.1");
    std::fs::write(&file, &page.stdout).unwrap();
    let text = groff_text(&file);
    assert!(
        text.contains("SYNOPSIS") && text.contains("janitor"),
        "{text}"
    );
}

/// docs/cli.md is `--help` of every subcommand, verbatim: it cannot drift. Every subcommand
/// the top-level help lists is in it, in that order. Regenerate it with
/// `CCCI_UPDATE_DOCS=1 cargo test cli_reference`.
#[test]
fn cli_reference_matches_help() {
    let mut expected = String::from(
        "# ccci-run command-line reference\n\n\
         The `--help` of every subcommand, verbatim (a test keeps this file identical to it).\n",
    );
    let top = Command::new(BIN).arg("--help").output().unwrap();
    let top = String::from_utf8(top.stdout).unwrap();
    let subcommands: Vec<String> = top
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter(|l| !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .filter(|s| s != "help")
        .collect();
    assert!(subcommands.len() >= 10, "{top}");
    let subs = std::iter::once(None).chain(subcommands.iter().map(|s| Some(s.as_str())));
    for sub in subs {
        let mut cmd = Command::new(BIN);
        cmd.env("COLUMNS", "100").env_remove("DRONE_BUILD_NUMBER");
        crate::util::without_ccci_env(&mut cmd);
        cmd.args(sub).arg("--help");
        let out = cmd.output().unwrap();
        assert!(out.status.success());
        let title = sub.map_or("ccci-run".to_owned(), |s| format!("ccci-run {s}"));
        expected.push_str(&format!(
            "\n## `{title}`\n\n```text\n{}```\n",
            String::from_utf8(out.stdout).unwrap()
        ));
    }
    let path = repo().join("docs/cli.md");
    let actual = std::fs::read_to_string(&path).unwrap_or_default();
    // What follows the marker is written by hand (the JSON documents), and kept.
    let (generated, by_hand) = match actual.split_once(JSON_MARKER) {
        Some((generated, rest)) => (generated.to_owned(), format!("{JSON_MARKER}{rest}")),
        None => (actual.clone(), String::new()),
    };
    let generated = if std::env::var("CCCI_UPDATE_DOCS").as_deref() == Ok("1") {
        std::fs::write(&path, format!("{expected}{by_hand}")).unwrap();
        expected.clone()
    } else {
        generated
    };
    assert!(
        generated == expected,
        "docs/cli.md differs from --help; regenerate it with CCCI_UPDATE_DOCS=1 cargo test cli_reference"
    );
}

/// Where docs/cli.md's generated part ends and its JSON documents begin.
const JSON_MARKER: &str = "\n<!-- The JSON documents: written by hand, checked by a test. -->\n";

/// Every `--json` has one envelope, `{"version": 1, <its report>, "errors": [...]}`, and
/// docs/cli.md shows each command's document with an example whose top-level keys are the ones
/// the command prints.
#[test]
fn every_json_document_has_the_envelope_docs_cli_md_shows() {
    let docs = std::fs::read_to_string(repo().join("docs/cli.md")).unwrap();
    let (_, by_hand) = docs
        .split_once(JSON_MARKER)
        .expect("docs/cli.md has its JSON section");
    // Each example: the heading's command, and its document.
    let mut examples: BTreeMap<String, serde_json::Value> = BTreeMap::new();
    let mut heading = String::new();
    let mut block: Option<String> = None;
    for line in by_hand.lines() {
        if let Some(h) = line.strip_prefix("### `") {
            heading = h.trim_end_matches('`').to_owned();
        } else if line == "```json" {
            block = Some(String::new());
        } else if line == "```" {
            if let Some(text) = block.take() {
                let value: serde_json::Value = serde_json::from_str(&text)
                    .unwrap_or_else(|e| panic!("{heading}: the example is no JSON ({e})"));
                examples.insert(heading.clone(), value);
            }
        } else if let Some(text) = block.as_mut() {
            text.push_str(line);
            text.push('\n');
        }
    }
    let sandbox = Sandbox::new();
    run(sandbox.run_sh("42", &["--pr", "1"], "true")).assert_code(0);
    let commands: [(&str, &[&str]); 6] = [
        ("ccci-run runs --json", &["runs", "--json"]),
        ("ccci-run runs RUN_ID --json", &["runs", "42", "--json"]),
        ("ccci-run locks --json", &["locks", "--json"]),
        (
            "ccci-run janitor --json",
            &["janitor", "--dry-run", "--json"],
        ),
        ("ccci-run doctor --json", &["doctor", "--json"]),
        ("ccci-run config --json", &["config", "--json"]),
    ];
    for (title, args) in commands {
        let mut cmd = sandbox.ccci();
        cmd.args(args);
        let out = cmd.output().unwrap();
        let printed: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{title}: no JSON ({e})"));
        assert_eq!(printed["version"], 1, "{title}: {printed:#}");
        assert!(printed["errors"].is_array(), "{title}: {printed:#}");
        let example = examples
            .get(title)
            .unwrap_or_else(|| panic!("docs/cli.md shows no example of {title}"));
        same_keys(title, example, &printed);
    }
    assert!(
        examples.contains_key("ccci-run converge --json"),
        "docs/cli.md shows no example of converge --json"
    );
}

/// `example` (docs/cli.md's) and `printed` (the binary's) have the same keys at every depth:
/// each object's keys equal; each element of a printed list is like one element of the
/// example's list, at every depth. A `null` on either side (an absent value), an empty list in
/// the example and a value of another kind end the comparison there.
fn same_keys(at: &str, example: &serde_json::Value, printed: &serde_json::Value) {
    if let Err(why) = keys_match(at, example, printed) {
        panic!("{why}");
    }
}

fn keys_match(
    at: &str,
    example: &serde_json::Value,
    printed: &serde_json::Value,
) -> Result<(), String> {
    use serde_json::Value;
    let keys = |v: &serde_json::Map<String, Value>| -> Vec<String> {
        let mut keys: Vec<String> = v.keys().cloned().collect();
        keys.sort();
        keys
    };
    match (example, printed) {
        (Value::Object(e), Value::Object(p)) => {
            if keys(e) != keys(p) {
                return Err(format!(
                    "{at}: keys differ: the example has {:?}, the binary prints {:?}",
                    keys(e),
                    keys(p)
                ));
            }
            p.iter()
                .try_for_each(|(key, value)| keys_match(&format!("{at}.{key}"), &e[key], value))
        }
        (Value::Array(e), Value::Array(p)) if !e.is_empty() => {
            p.iter().enumerate().try_for_each(|(i, value)| {
                let at = format!("{at}[{i}]");
                let tries: Vec<String> = e
                    .iter()
                    .map(|x| keys_match(&at, x, value))
                    .filter_map(Result::err)
                    .collect();
                if tries.len() < e.len() {
                    Ok(())
                } else {
                    Err(format!(
                        "{at}: like no element of the example: {}",
                        tries.join("; ")
                    ))
                }
            })
        }
        _ => Ok(()),
    }
}

/// A `--json` command that fails prints its envelope all the same: the report's fields empty
/// (`null` or `[]`), the error in `errors`, the exit code of the same command without
/// `--json`, and the error on stderr under the one prefix.
#[test]
fn every_json_command_prints_its_envelope_when_it_fails() {
    let sandbox = Sandbox::new();
    let bad_config = sandbox.path().join("bad.toml");
    std::fs::write(&bad_config, "no_such_key = 1\n").unwrap();
    // Directories nobody but root may read: the runs dir and the lock dir of another user.
    let unreadable = sandbox.path().join("private");
    std::fs::create_dir(&unreadable).unwrap();
    std::fs::set_permissions(
        &unreadable,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let nobody = |args: &[&str]| {
        let mut cmd = Command::new(BIN);
        crate::util::without_ccci_env(&mut cmd);
        cmd.env("CCCI_CONFIG", "/dev/null")
            .args(["--docker", "off", "--runs-dir"])
            .arg(&unreadable)
            .arg("--lock-dir")
            .arg(&unreadable)
            .args(args);
        crate::util::as_user(65534, &cmd)
    };
    let in_sandbox = |args: &[&str]| {
        let mut cmd = sandbox.ccci();
        cmd.args(args);
        cmd
    };
    let with_bad_config = |args: &[&str]| {
        let mut cmd = sandbox.ccci();
        cmd.env("CCCI_CONFIG", &bad_config).args(args);
        cmd
    };
    type Make<'a> = &'a dyn Fn(&[&str]) -> Command;
    let cases: [(Make, &[&str], &str); 4] = [
        (&in_sandbox, &["runs", "999"], "run"),
        (&nobody, &["runs"], "runs"),
        (&nobody, &["locks"], "locks"),
        (&with_bad_config, &["config"], "settings"),
    ];
    for (make, args, field) in cases {
        let text = run(make(args));
        let mut json_args = args.to_vec();
        json_args.push("--json");
        let json = run(make(&json_args));
        let title = json_args.join(" ");
        assert_ne!(
            json.status.code(),
            Some(0),
            "{title}: {}",
            json.transcript()
        );
        assert_eq!(json.status.code(), text.status.code(), "{title}");
        let printed: serde_json::Value =
            serde_json::from_str(&json.out.join("\n")).unwrap_or_else(|e| {
                panic!(
                    "{title}: no envelope on stdout ({e}): {}",
                    json.transcript()
                )
            });
        assert_eq!(printed["version"], 1, "{title}: {printed:#}");
        let errors = printed["errors"].as_array().unwrap();
        assert!(!errors.is_empty(), "{title}: {printed:#}");
        assert!(
            printed
                .get(field)
                .is_some_and(|v| v.is_null() || v.as_array().is_some_and(Vec::is_empty)),
            "{title}: {printed:#}"
        );
        json.assert_stderr_has("ccci-run: error: ");
    }
}

/// What the README tells a newcomer stays true: how to install Rust (rustup's command), no
/// count of tests (they change with every test; none is stated rather than a stale one), and
/// the race hunt runs the very test command the README gives.
#[test]
fn the_readme_gives_the_rustup_command_no_test_counts_and_the_hunt_its_test_command() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    assert!(
        readme.contains("https://sh.rustup.rs | sh"),
        "the README does not say how to install Rust with rustup"
    );
    let count = regex::Regex::new(r"\b\d+ (integration |unit )?tests\b").unwrap();
    let counts: Vec<&str> = count.find_iter(&readme).map(|m| m.as_str()).collect();
    assert!(counts.is_empty(), "the README counts tests: {counts:?}");
    let command = "cargo test --locked --features etcd";
    assert!(
        readme.contains(&format!("```sh\n{command}\n```")),
        "the README's test command"
    );
    let hunt = std::fs::read_to_string(repo().join("scripts/race-hunt.sh")).unwrap();
    assert!(
        hunt.contains(command),
        "scripts/race-hunt.sh runs another command"
    );
}

/// `config --json` writes an absent value as `null`: no `-`, no empty string, no sentence
/// standing for nothing (the table says `none …` in its place).
#[test]
fn config_json_writes_absent_values_as_null() {
    let sandbox = Sandbox::new();
    let mut cmd = sandbox.ccci();
    cmd.args(["config", "--json"]);
    let done = run(cmd);
    done.assert_code(0);
    let printed: serde_json::Value = serde_json::from_str(&done.out.join("\n")).unwrap();
    let settings = printed["settings"].as_array().unwrap();
    let value = |key: &str| {
        settings
            .iter()
            .find(|s| s["key"] == key)
            .unwrap_or_else(|| panic!("no {key}: {printed:#}"))["value"]
            .clone()
    };
    for key in ["runner_user", "etcd_endpoints", "lock_wait", "keep_runs"] {
        assert!(value(key).is_null(), "{key}: {printed:#}");
    }
    for s in settings {
        let v = s["value"].as_str().unwrap_or("null");
        assert!(!v.is_empty() && v != "-" && !v.starts_with("none"), "{s}");
    }
    let mut cmd = sandbox.ccci();
    cmd.arg("config");
    let table = run(cmd).out.join("\n");
    assert!(table.contains("none (until the deadline)"), "{table}");
}

/// The comparison of [`same_keys`] can fail, at any depth.
#[test]
fn the_json_example_check_sees_a_nested_key_that_differs() {
    let example =
        serde_json::json!({"settings": [{"key": "a", "origin": {"kind": "file", "path": "/x"}}]});
    let printed =
        serde_json::json!({"settings": [{"key": "a", "origin": {"kind": "file", "from": "/x"}}]});
    let caught = std::panic::catch_unwind(|| same_keys("t", &example, &printed));
    assert!(caught.is_err(), "a nested key that differs went unseen");
    same_keys("t", &printed, &printed);
}

#[test]
fn retention_removes_old_finished_runs_and_keeps_live_and_recent_ones() {
    let sandbox = Sandbox::new();
    for id in ["old", "recent"] {
        run(sandbox.run_sh(id, &[], "true")).assert_code(0);
    }
    crate::util::age(
        &sandbox.runs().join("old/run.json"),
        Duration::from_secs(20 * 86_400),
    );
    // A live run whose record is old all the same (a long run, or a clock step).
    let mut live = Proc::spawn(sandbox.run_sh("live", &[], "echo ready $$; read line || :"));
    live.wait_ready();
    crate::util::age(
        &sandbox.runs().join("live/run.json"),
        Duration::from_secs(20 * 86_400),
    );
    // Odd entries: a symlink and a file are never followed or removed.
    std::os::unix::fs::symlink(sandbox.path(), sandbox.runs().join("link")).unwrap();
    std::fs::write(sandbox.runs().join("stray-file"), "").unwrap();

    let (report, done) = sandbox.janitor(&["--keep-runs", "14d", "--dry-run"]);
    done.assert_code(0);
    assert_eq!(
        report["runs_removed"],
        serde_json::json!([sandbox.runs().join("old")])
    );
    assert!(
        sandbox.runs().join("old").exists(),
        "a dry run removed a run dir"
    );

    let (report, done) = sandbox.janitor(&["--keep-runs", "14d"]);
    done.assert_code(0);
    assert_eq!(
        report["runs_removed"],
        serde_json::json!([sandbox.runs().join("old")])
    );
    // `.domains/` holds the runs' domain locks, not a run: retention leaves it alone.
    let left = crate::util::list(&sandbox.runs());
    assert_eq!(left, [".domains", "link", "live", "recent", "stray-file"]);
    live.close_stdin();
    live.finish().assert_code(0);
}

/// Every test that docs/concurrency.md's failure-mode table and docs/bad-input.md name exists,
/// so neither table can point at a test that was renamed or removed.
#[test]
fn failure_mode_table_names_real_tests() {
    for doc in ["docs/concurrency.md", "docs/bad-input.md"] {
        check_named_tests(&std::fs::read_to_string(repo().join(doc)).unwrap());
    }
}

fn check_named_tests(doc: &str) {
    let mut named = 0;
    for cell in doc.split('`').skip(1).step_by(2) {
        let Some((module, test)) = cell.split_once("::") else {
            continue;
        };
        if module.contains(' ')
            || !test
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b == b'_' || b.is_ascii_digit())
        {
            continue;
        }
        let file = repo().join(format!("tests/integration/{module}.rs"));
        let source = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("{cell}: no {}: {e}", file.display()));
        assert!(
            source.contains(&format!("fn {test}(")),
            "{cell} names no test"
        );
        named += 1;
    }
    assert!(named >= 20, "the table names {named} tests");
}

/// `ccci-run man --dir` writes a page per command; every page renders without a warning, has
/// the sections an operator looks for, and every page a SEE ALSO names is one of them.
#[test]
fn every_man_page_renders_with_its_sections() {
    let dir = tempfile::tempdir().unwrap();
    let listed = succeeds(Command::new(BIN).arg("man").arg("--dir").arg(dir.path()));
    let names: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    for sub in [
        "run",
        "janitor",
        "locks",
        "lock",
        "runs",
        "stop",
        "app-domain",
        "converge",
        "completions",
        "man",
        "config",
        "doctor",
    ] {
        assert!(names.contains(&format!("ccci-run-{sub}.1")), "{names:?}");
    }
    let one = succeeds(Command::new(BIN).args(["man", "janitor"]));
    assert!(
        one.stdout == std::fs::read(dir.path().join("ccci-run-janitor.1")).unwrap(),
        "`man janitor` is not the page --dir wrote"
    );
    if !need("groff") {
        return;
    }
    for name in &names {
        let text = groff_text(&dir.path().join(name));
        for section in ["SYNOPSIS", "ENVIRONMENT", "EXIT STATUS", "SEE ALSO"] {
            assert!(text.contains(section), "{name} lacks {section}:\n{text}");
        }
        let see_also = text.split("SEE ALSO").nth(1).unwrap_or_default();
        for page in see_also
            .split([',', ' ', '\n'])
            .filter_map(|w| w.trim().strip_suffix("(1)"))
        {
            assert!(
                names.contains(&format!("{page}.1")),
                "{name} refers to {page}(1), which is not generated"
            );
        }
    }
    let run_page = std::fs::read_to_string(dir.path().join("ccci-run-run.1")).unwrap();
    for section in ["FILES", "EXAMPLES"] {
        assert!(
            run_page.contains(&format!(".SH \"{section}\"")),
            "{run_page}"
        );
    }
    assert!(run_page.contains("CCCI_RUNS_DIR"), "{run_page}");
}

/// A custom build (how `!testme` arrives) runs the PR it names in CCCI_PR, and one that names
/// neither a PR nor a ref is refused rather than run as a build of the default branch.
#[test]
fn custom_builds_run_their_pr_or_are_refused() {
    let sandbox = Sandbox::new();
    let mut step = drone_step(&sandbox, "61");
    step.env_remove("DRONE_PULL_REQUEST")
        .env("DRONE_BUILD_EVENT", "custom")
        .env("CCCI_PR", "7")
        .env("CCCI_SKIP_FETCH", "1");
    std::fs::create_dir_all(sandbox.abra_home().join("recipes/custom-html/.git")).unwrap();
    let mut step = Proc::spawn(step);
    step.wait_ready();
    signal(step.pid(), Signal::SIGTERM);
    step.finish();
    let record = sandbox.record("coop-cloud.custom-html.61");
    assert_eq!(record["pr"], "7", "{record:#}");
    assert_eq!(record["domain"], sandbox.domain("custom-html", Some("7")));

    let mut step = drone_step(&sandbox, "62");
    step.env_remove("DRONE_PULL_REQUEST")
        .env("DRONE_BUILD_EVENT", "custom");
    let done = crate::util::run(step);
    done.assert_code(2);
    done.assert_stderr_has("a custom build needs the PR number as parameter CCCI_PR");
    assert!(!sandbox.runs().join("62").exists());
}

/// The janitor unit's sandbox rates "OK" or better (exposure at most 4.0) by systemd's own
/// reckoning, and the NixOS module gives its janitor the very same settings, the directories it
/// may write included (from the module's own defaults, not the test's).
#[test]
fn the_janitor_unit_is_hardened_alike_with_and_without_nix() {
    let unit = std::fs::read_to_string(repo().join("systemd/ccci-run-janitor.service")).unwrap();
    if need("systemd-analyze") {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ccci-run-janitor.service"), &unit).unwrap();
        let out = Command::new("systemd-analyze")
            .current_dir(dir.path())
            .args(["security", "--offline=yes", "--threshold=40"])
            .arg("ccci-run-janitor.service")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "exposure above 4.0:\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    if !need("nix-instantiate") {
        return;
    }
    let out = succeeds(Command::new("nix-instantiate").current_dir(repo()).args([
        "--eval",
        "--strict",
        "--json",
        "-E",
        "with import ./nix/lib.nix; janitorHardening { inherit (defaults) abraHome; \
         writablePaths = janitorWritablePaths { inherit (defaults) lockDir runsDir stateDir metricsFile; }; }",
    ]));
    let nix: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&out.stdout).unwrap();
    // The unit's settings, each key's values gathered over its lines.
    let mut settings: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for line in unit.lines().filter(|l| !l.starts_with('#')) {
        if let Some((key, value)) = line.split_once('=') {
            settings.entry(key).or_default().push(value);
        }
    }
    for (key, value) in &nix {
        let want: Vec<String> = match value {
            serde_json::Value::Bool(b) => vec![if *b { "yes" } else { "no" }.to_owned()],
            serde_json::Value::String(s) => vec![s.clone()],
            serde_json::Value::Array(items) => items
                .iter()
                .map(|v| v.as_str().unwrap().to_owned())
                .collect(),
            other => panic!("{key}: {other}"),
        };
        let have: Vec<String> = settings
            .get(key.as_str())
            .unwrap_or_else(|| panic!("the unit lacks {key}"))
            .iter()
            .flat_map(|v| {
                if key == "SystemCallFilter" {
                    vec![v.to_string()]
                } else {
                    v.split_whitespace().map(str::to_owned).collect()
                }
            })
            .collect();
        let mut want_sorted = want.clone();
        want_sorted.sort();
        let mut have_sorted = have.clone();
        have_sorted.sort();
        assert_eq!(
            have_sorted, want_sorted,
            "{key} differs between the unit and nix/lib.nix"
        );
    }
}

/// `rust-version` is no lower than any crate of the build declares for itself, and the README
/// names it. (Crates that declare nothing can still need more: git2 0.21 calls the inherent
/// `str::from_utf8` of Rust 1.87 and declares no rust-version. Only a build with that
/// toolchain tells, which .ci/run does.)
#[test]
fn rust_version_is_at_least_every_dependency_s() {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = succeeds(Command::new(cargo).current_dir(repo()).args([
        "metadata",
        "--locked",
        "--format-version",
        "1",
        "--all-features",
        "--filter-platform",
        "x86_64-unknown-linux-gnu",
    ]));
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let version = |v: &serde_json::Value| -> Option<(u64, u64)> {
        let mut parts = v.as_str()?.split('.').map(|n| n.parse::<u64>().ok());
        Some((parts.next()??, parts.next().flatten().unwrap_or(0)))
    };
    let in_build: Vec<&str> = metadata["resolve"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["id"].as_str().unwrap())
        .collect();
    let root = metadata["resolve"]["root"].as_str().unwrap();
    let packages = metadata["packages"].as_array().unwrap();
    let ours = packages.iter().find(|p| p["id"] == root).unwrap();
    let ours = version(&ours["rust_version"]).expect("Cargo.toml declares a rust-version");
    let mut needed: Vec<((u64, u64), String)> = packages
        .iter()
        .filter(|p| p["id"] != root && in_build.contains(&p["id"].as_str().unwrap()))
        .filter_map(|p| {
            Some((
                version(&p["rust_version"])?,
                format!("{} {}", p["name"], p["version"]),
            ))
        })
        .collect();
    assert!(needed.len() > 50, "{needed:?}");
    needed.sort();
    let (highest, by) = needed.last().unwrap();
    assert!(
        ours >= *highest,
        "rust-version {ours:?} is below the {highest:?} that {by} declares"
    );
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let named = format!("Needs Rust {}.{} or later", ours.0, ours.1);
    assert!(readme.contains(&named), "the README does not say {named:?}");
}

/// What a dynamically linked binary asks of the host, by readelf: the libraries it loads
/// (NEEDED) and the newest glibc symbol version it needs (from its version-needs section).
/// None for a static binary (no NEEDED, no program interpreter).
fn host_needs(binary: &Path) -> Option<(Vec<String>, (u32, u32))> {
    let dynamic = succeeds(Command::new("readelf").arg("-d").arg(binary));
    let needed: Vec<String> = String::from_utf8_lossy(&dynamic.stdout)
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| Some(l.split('[').nth(1)?.trim_end_matches(']').to_owned()))
        .collect();
    let headers = succeeds(Command::new("readelf").arg("-l").arg(binary));
    let interpreted = String::from_utf8_lossy(&headers.stdout).contains("INTERP");
    if needed.is_empty() && !interpreted {
        return None;
    }
    let versions = succeeds(Command::new("readelf").arg("-V").arg(binary));
    let glibc = regex::Regex::new(r"Name: GLIBC_(\d+)\.(\d+)").unwrap();
    let newest = glibc
        .captures_iter(&String::from_utf8_lossy(&versions.stdout))
        .map(|c| (c[1].parse().unwrap(), c[2].parse().unwrap()))
        .max()
        .expect("a dynamic binary that needs no glibc symbol version");
    Some((needed, newest))
}

/// What the README promises the shipped binary (`--profile dist --features vendored`, built on
/// Debian 12) needs of a host: these libraries (through glibc's loader), and glibc symbols of
/// at most this version.
const SHIPPED_LOADS: &[&str] = &["libc.so.6", "libgcc_s.so.1"];
const SHIPPED_GLIBC: (u32, u32) = (2, 34);

/// The README says what the shipped binary needs of a host, and the binaries are so. The
/// suite's own binary is the same Rust code (std and every crate), so what that code asks of
/// glibc shows in it: no library but glibc's own (libc, libm, the loader) and libgcc_s, beside
/// the system OpenSSL and zlib that `vendored` builds in instead, and no glibc symbol newer than
/// promised. What `vendored` adds, the C code of OpenSSL, libgit2 and zlib, shows only in a
/// binary to ship: `CCCI_SHIP_BIN` names one (target/dist/ccci-run, or the static musl build),
/// checked exactly: the libraries named and the glibc version reached, or, static, nothing
/// loaded at all (docs/operations.md, "Install").
#[test]
fn the_binary_needs_of_a_host_what_the_readme_says() {
    if !need("readelf") {
        return;
    }
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let readme = readme.split_whitespace().collect::<Vec<_>>().join(" ");
    let promise = format!(
        "glibc {}.{} or later (its newest symbol version is `GLIBC_{}.{}`) and `libgcc_s.so.1`",
        SHIPPED_GLIBC.0, SHIPPED_GLIBC.1, SHIPPED_GLIBC.0, SHIPPED_GLIBC.1
    );
    assert!(
        readme.contains(&promise),
        "the README does not say {promise:?}"
    );
    let (needed, newest) = host_needs(Path::new(BIN)).expect("the suite's binary is dynamic");
    let allowed = [
        "ld-linux-x86-64.so.2",
        "libm.so.6",
        // What `vendored` builds in.
        "libssl.so.3",
        "libcrypto.so.3",
        "libz.so.1",
    ];
    for library in &needed {
        assert!(
            SHIPPED_LOADS.contains(&library.as_str()) || allowed.contains(&library.as_str()),
            "{BIN} loads {library}, which the README does not name"
        );
    }
    assert!(
        newest <= SHIPPED_GLIBC,
        "{BIN} needs GLIBC_{}.{}",
        newest.0,
        newest.1
    );
    let Some(shipped) = std::env::var_os("CCCI_SHIP_BIN") else {
        return;
    };
    if let Some((mut needed, newest)) = host_needs(Path::new(&shipped)) {
        needed.sort();
        assert_eq!(needed, SHIPPED_LOADS, "{shipped:?} loads");
        assert_eq!(
            newest, SHIPPED_GLIBC,
            "{shipped:?} needs GLIBC_{}.{}",
            newest.0, newest.1
        );
    }
}

/// The settings `ccci-run config --json` shows: every key of the configuration file, in its
/// order.
pub(crate) fn file_keys() -> Vec<String> {
    let mut cmd = Command::new(BIN);
    crate::util::without_ccci_env(&mut cmd);
    let out = succeeds(cmd.args(["--config", "/dev/null", "config", "--json"]));
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let list = shown["settings"]
        .as_array()
        .unwrap_or_else(|| panic!("no settings in {shown}"));
    list.iter()
        .map(|s| s["key"].as_str().unwrap().to_owned())
        .collect()
}

/// The NixOS module offers every key the binary reads, under the option docs/operations.md's
/// table names: the binary's keys, nix/lib.nix's list the module writes the file from, and the
/// table are one list. (nixos::nixos_module_core_offers_every_key_and_refuses_bad_values
/// evaluates each option on the module system and reads the file back with the binary.)
#[test]
fn the_module_offers_every_key_the_binary_reads() {
    let binary = file_keys();
    let docs = std::fs::read_to_string(repo().join("docs/operations.md")).unwrap();
    let table: Vec<(String, String)> = docs
        .split("| key | option of `services.ccci-run` |")
        .nth(1)
        .expect("docs/operations.md has the module's settings table")
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let word = |c: &str| c.split('`').nth(1).unwrap_or_default().to_owned();
            (word(cells[1]), word(cells[2]))
        })
        .collect();
    let table_keys: Vec<&str> = table.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        table_keys,
        binary.iter().map(String::as_str).collect::<Vec<_>>(),
        "docs/operations.md's table and `ccci-run config`"
    );
    if !need("nix-instantiate") {
        return;
    }
    let module = nix_eval("map (k: [ k.key k.option ]) (import ./nix/lib.nix).fileKeys");
    let mut module: Vec<(String, String)> = module
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p[0].as_str().unwrap().to_owned(),
                p[1].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let mut table = table;
    module.sort();
    table.sort();
    assert_eq!(
        module, table,
        "nix/lib.nix's fileKeys and docs/operations.md's table"
    );
    let source = std::fs::read_to_string(repo().join("nix/module.nix")).unwrap();
    for (_, option) in &module {
        assert!(
            source.contains(&format!("    {option} = mkOption"))
                || source.contains(&format!("    {option} = settingOption \"{option}\"")),
            "nix/module.nix declares no option {option}"
        );
    }
}

/// What no static script knows is asked of ccci-run at Tab, in a real bash, fish and zsh: the
/// run ids after `runs`, only the live ones after `stop`, the named locks after `lock`, and the
/// pages after `man`; nothing of the kind after an option that takes a value.
#[test]
fn every_shell_completes_run_ids_lock_names_and_man_pages() {
    let sandbox = Sandbox::new();
    run(sandbox.run_sh("done-1", &["--pr", "1"], "true")).assert_code(0);
    let mut live =
        Proc::spawn(sandbox.run_sh("live-1", &["--pr", "2"], "echo ready $$; exec sleep 100000"));
    live.wait_ready();
    let mut lock = sandbox.ccci();
    lock.args(["lock", "deploy-queue", "--", "true"]);
    run(lock).assert_code(0);
    let bin_dir = Path::new(BIN).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let env = [
        ("PATH", path),
        ("CCCI_CONFIG", "/dev/null".to_owned()),
        ("CCCI_RUNS_DIR", sandbox.runs().display().to_string()),
        ("CCCI_APP_LOCK_DIR", sandbox.locks().display().to_string()),
        ("CCCI_STATE_DIR", sandbox.state().display().to_string()),
        ("CCCI_DOCKER", "off".to_owned()),
    ];
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!("runs_dir = {:?}\n", sandbox.runs().display().to_string()),
    )
    .unwrap();
    type Offers = fn(&Path, &str, &[(&str, String)]) -> Vec<String>;
    let shells: [(&str, Offers); 3] = [
        ("bash", bash_offers_in),
        ("fish", fish_offers_in),
        ("zsh", zsh_offers_in),
    ];
    for (shell, offers) in shells {
        if !need(shell) {
            continue;
        }
        let script = completion_script(dir.path(), shell);
        let words = |line: &str| -> Vec<String> {
            offers(&script, line, &env)
                .into_iter()
                .map(|o| o.split('\t').next().unwrap_or_default().to_owned())
                .collect()
        };
        let runs = words("ccci-run runs ");
        assert!(
            runs.contains(&"done-1".to_owned()) && runs.contains(&"live-1".to_owned()),
            "{shell}: runs: {runs:?}"
        );
        let stop = words("ccci-run stop ");
        assert!(
            stop.contains(&"live-1".to_owned()),
            "{shell}: stop: {stop:?}"
        );
        assert!(
            !stop.contains(&"done-1".to_owned()),
            "{shell}: stop: {stop:?}"
        );
        let locks = words("ccci-run lock ");
        assert!(
            locks.contains(&"deploy-queue".to_owned()),
            "{shell}: lock: {locks:?}"
        );
        let pages = words("ccci-run man ");
        for page in ["ccci-run", "run", "janitor", "stop"] {
            assert!(pages.contains(&page.to_owned()), "{shell}: man: {pages:?}");
        }
        let after_wait = words("ccci-run stop --wait ");
        assert!(
            !after_wait.contains(&"live-1".to_owned()),
            "{shell}: stop --wait: {after_wait:?}"
        );
        // The directories typed earlier on the line win over the environment's (here: none),
        // before the subcommand or after it, as a flag or in the configuration file named.
        let typed = |line: &str| -> Vec<String> {
            let env: Vec<(&str, String)> = env
                .iter()
                .filter(|(k, _)| *k != "CCCI_RUNS_DIR")
                .cloned()
                .collect();
            offers(&script, line, &env)
                .into_iter()
                .map(|o| o.split('\t').next().unwrap_or_default().to_owned())
                .collect()
        };
        let runs_dir = sandbox.runs().display().to_string();
        for line in [
            format!("ccci-run --runs-dir {runs_dir} runs "),
            format!("ccci-run runs --runs-dir {runs_dir} "),
            format!("ccci-run --config {} stop ", config.display()),
        ] {
            let got = typed(&line);
            assert!(
                got.contains(&"live-1".to_owned()),
                "{shell}: `{line}`: {got:?}"
            );
        }
    }
    signal(live.pid(), Signal::SIGTERM);
    live.finish();
}

/// What a container cannot show: there `/run` stays writable under `ProtectSystem=strict`, so a
/// directory missing from the janitor unit's `ReadWritePaths=` would pass under nspawn. Checked
/// on the files: every directory the shipped configuration names (and the metrics file's) is
/// writable under the shipped unit.
#[test]
fn the_janitor_unit_can_write_every_directory_of_the_shipped_configuration() {
    let unit = std::fs::read_to_string(repo().join("systemd/ccci-run-janitor.service")).unwrap();
    let writable: Vec<String> = unit
        .lines()
        .filter_map(|l| l.strip_prefix("ReadWritePaths="))
        .flat_map(|l| l.split_whitespace())
        .map(|p| p.trim_start_matches('-').to_owned())
        .collect();
    let config: toml::Value =
        toml::from_str(&std::fs::read_to_string(repo().join("systemd/config.toml")).unwrap())
            .unwrap();
    let mut needed: Vec<String> = ["lock_dir", "runs_dir", "state_dir", "abra_home"]
        .iter()
        .map(|k| config[*k].as_str().unwrap().to_owned())
        .collect();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .unwrap();
    let metrics = exec
        .split_whitespace()
        .skip_while(|w| *w != "--metrics-file")
        .nth(1)
        .unwrap();
    needed.push(Path::new(metrics).parent().unwrap().display().to_string());
    for dir in &needed {
        assert!(
            writable
                .iter()
                .any(|w| Path::new(dir).starts_with(Path::new(w))),
            "{dir} is not in the janitor unit's ReadWritePaths: {writable:?}"
        );
    }
    assert!(
        unit.contains("ProtectSystem=strict"),
        "the unit no longer confines what it writes"
    );
}
