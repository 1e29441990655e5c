//! The NixOS module on the real NixOS module system: nixpkgs' `nixos/lib/eval-config.nix`
//! evaluated by a Nix of 2.18 or later, when `CCCI_NIXPKGS` names a nixpkgs checkout (and
//! `CCCI_NIX_BIN` a `nix-instantiate`, else the one on PATH). The host set-ups the module must
//! merge with, every bad value it must refuse at evaluation, and the units and configuration file
//! it writes, compared key by key with `systemd/` and checked by `systemd-analyze verify` and by
//! the binary itself. Without a nixpkgs (CI has none) each test prints why it skipped.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::util::BIN;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A nixpkgs checkout and a Nix that can evaluate it.
struct ModuleSystem {
    nix: PathBuf,
    nixpkgs: PathBuf,
}

/// The one skip CI takes too: CI's machine cannot reach a nixpkgs.
fn no_module_system(why: &str) {
    crate::util::skip_even_in_ci(
        why,
        "set CCCI_NIXPKGS to a nixpkgs checkout, and CCCI_NIX_BIN to a nix-instantiate of Nix \
         2.18 or later unless the one on PATH is, to evaluate the module for real",
    );
}

/// The module system named by the environment, or None (with a line saying why) when there is
/// none. A variable that is set but names something unusable is a failure, not a skip.
fn module_system() -> Option<ModuleSystem> {
    let Some(nixpkgs) = std::env::var_os("CCCI_NIXPKGS").map(PathBuf::from) else {
        no_module_system("CCCI_NIXPKGS names no nixpkgs checkout");
        return None;
    };
    assert!(
        nixpkgs.join("nixos/lib/eval-config.nix").is_file(),
        "CCCI_NIXPKGS={} has no nixos/lib/eval-config.nix",
        nixpkgs.display()
    );
    let nix = nix_bin(no_module_system)?;
    Some(ModuleSystem { nix, nixpkgs })
}

/// `CCCI_NIX_BIN`, else the `nix-instantiate` on PATH, when it is Nix 2.18 or later; else None,
/// `skip` told why. A `CCCI_NIX_BIN` that does not run, or is older, is a failure.
fn nix_bin(skip: fn(&str)) -> Option<PathBuf> {
    let given = std::env::var_os("CCCI_NIX_BIN").map(PathBuf::from);
    let nix = given.clone().unwrap_or_else(|| "nix-instantiate".into());
    let version = Command::new(&nix)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    let Some(version) = version else {
        assert!(
            given.is_none(),
            "CCCI_NIX_BIN={} does not run",
            nix.display()
        );
        skip("no nix-instantiate is on PATH");
        return None;
    };
    let numbers: Vec<u32> = version
        .rsplit(' ')
        .next()
        .unwrap_or_default()
        .split('.')
        .map_while(|n| n.parse().ok())
        .collect();
    if numbers.len() < 2 || (numbers[0], numbers[1]) < (2, 18) {
        assert!(
            given.is_none(),
            "CCCI_NIX_BIN={} is {version}; nixpkgs needs Nix 2.18 or later",
            nix.display()
        );
        skip(&format!(
            "the nix-instantiate on PATH is {version}, and nixpkgs needs Nix 2.18 or later"
        ));
        return None;
    }
    Some(nix)
}

/// The module system's core, nixpkgs' `lib` (its `evalModules`), with NixOS's own declarations
/// of the options the module touches stood in for (tests/nix/eval-options.nix): the option
/// types, priorities, locations, assertions and warnings are the real ones, the unit files are
/// not rendered. Where a whole nixpkgs is at hand its `lib` is used.
struct ModuleCore {
    nix: PathBuf,
    lib: PathBuf,
}

fn no_module_core(why: &str) {
    crate::util::skip_even_in_ci(
        why,
        "set CCCI_NIXPKGS_LIB to a nixpkgs lib directory (or CCCI_NIXPKGS to a nixpkgs \
         checkout), and CCCI_NIX_BIN to a nix-instantiate of Nix 2.18 or later unless the one \
         on PATH is, to evaluate the module's options on the module system",
    );
}

fn module_core() -> Option<ModuleCore> {
    let lib = std::env::var_os("CCCI_NIXPKGS_LIB")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("CCCI_NIXPKGS").map(|p| PathBuf::from(p).join("lib")));
    let Some(lib) = lib else {
        no_module_core("neither CCCI_NIXPKGS_LIB nor CCCI_NIXPKGS names a nixpkgs lib");
        return None;
    };
    assert!(
        lib.join("modules.nix").is_file() && lib.join("types.nix").is_file(),
        "{} is not a nixpkgs lib directory (no modules.nix and types.nix)",
        lib.display()
    );
    let nix = nix_bin(no_module_core)?;
    Some(ModuleCore { nix, lib })
}

impl ModuleCore {
    /// Each host (a module written to a file of its own, so errors name it) evaluated: Ok with
    /// what eval-options.nix gives, or Err with Nix's error.
    fn evaluate(&self, hosts: &[(&str, &str)]) -> BTreeMap<String, Result<Value, String>> {
        let dir = tempfile::tempdir().unwrap();
        let mut results = BTreeMap::new();
        for (name, body) in hosts {
            let file = dir.path().join(format!("{name}.nix"));
            std::fs::write(
                &file,
                format!("{{ pkgs, lib, ... }}: {{\n  {RUNNER_BODY}\n  {body}\n}}\n"),
            )
            .unwrap();
            let out = Command::new(&self.nix)
                .current_dir(repo())
                .args(["--eval", "--strict", "--json", "tests/nix/eval-options.nix"])
                .arg("--argstr")
                .arg("lib")
                .arg(&self.lib)
                .arg("--arg")
                .arg("hosts")
                .arg(format!("{{ {name} = {}; }}", file.display()))
                .output()
                .unwrap();
            let result = if out.status.success() {
                let mut all: BTreeMap<String, Value> = serde_json::from_slice(&out.stdout).unwrap();
                Ok(all.remove(*name).unwrap())
            } else {
                Err(String::from_utf8_lossy(&out.stderr).into_owned())
            };
            results.insert((*name).to_owned(), result);
        }
        results
    }
}

/// The runner's unit on a host of the module core (no packages there to name but stand-ins).
const RUNNER_BODY: &str = r#"systemd.services.drone-runner-exec.serviceConfig.ExecStart = "${pkgs.drone-runner-exec}/bin/drone-runner-exec";"#;

/// The host's Drone exec runner: nixpkgs' package (unfree: its licence is the Polyform one) in a
/// unit of the host's own, as nixpkgs has no module for it.
const RUNNER: &str = r#"{ pkgs, lib, ... }: {
  nixpkgs.config.allowUnfreePredicate = pkg: lib.getName pkg == "drone-runner-exec";
  systemd.services.drone-runner-exec = {
    description = "Drone exec runner";
    wantedBy = [ "multi-user.target" ];
    serviceConfig.ExecStart = "${pkgs.drone-runner-exec}/bin/drone-runner-exec";
  };
}"#;

/// A host: the module enabled, the runner's unit when `runner`, and `body` (Nix attributes
/// with `pkgs` and `lib` in scope).
struct Host {
    name: &'static str,
    runner: bool,
    body: &'static str,
}

const fn host(name: &'static str, runner: bool, body: &'static str) -> Host {
    Host { name, runner, body }
}

impl ModuleSystem {
    fn command(&self, hosts: &[Host]) -> Command {
        let mut expr = format!("let runner = {RUNNER}; in {{\n");
        for h in hosts {
            expr.push_str(&format!(
                "  {} = {{ pkgs, lib, ... }}: {{\n    imports = [ {} \
                 {{ services.ccci-run.enable = lib.mkDefault true; }} ];\n    {}\n  }};\n",
                h.name,
                if h.runner { "runner" } else { "" },
                h.body
            ));
        }
        expr.push('}');
        let mut cmd = Command::new(&self.nix);
        cmd.current_dir(repo())
            .args(["--eval", "--strict", "--json", "tests/nix/eval-module.nix"])
            .arg("--argstr")
            .arg("nixpkgs")
            .arg(&self.nixpkgs)
            .arg("--arg")
            .arg("hosts")
            .arg(expr);
        cmd
    }

    /// Each host evaluated; a failed evaluation fails the test with Nix's own words.
    fn evaluate(&self, hosts: &[Host]) -> BTreeMap<String, Value> {
        let mut cmd = self.command(hosts);
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "the evaluation failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The error with which the evaluation of `host` stops.
    fn refusal(&self, host: &Host) -> String {
        let out = self.command(std::slice::from_ref(host)).output().unwrap();
        assert!(
            !out.status.success(),
            "{}: `{}` evaluated: {}",
            host.name,
            host.body,
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }
}

/// A unit's settings by (section, key), each value split into words the way the key reads:
/// ExecStart's quoted arguments with the program's directory dropped, SystemCallFilter's lines
/// whole and in order, booleans as yes/no, other lists in any order. NixOS's own environment
/// (PATH, LOCALE_ARCHIVE, TZDIR) and X- keys are left out.
type UnitSettings = BTreeMap<(String, String), Vec<String>>;

fn unit_settings(text: &str) -> UnitSettings {
    let mut settings = UnitSettings::new();
    let mut section = String::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.to_owned();
            continue;
        }
        let (key, value) = line.split_once('=').unwrap_or((line, ""));
        let nixos_env = ["\"PATH=", "\"LOCALE_ARCHIVE=", "\"TZDIR="];
        if key.starts_with("X-")
            || (key == "Environment" && nixos_env.iter().any(|p| value.starts_with(p)))
        {
            continue;
        }
        let words: Vec<String> = match key {
            "ExecStart" => {
                let mut words = exec_words(value);
                if let Some(program) = words.first_mut() {
                    *program = Path::new(program.as_str())
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default();
                }
                words
            }
            "SystemCallFilter" => vec![value.to_owned()],
            _ => value
                .split_whitespace()
                .map(|w| match w {
                    "true" | "yes" => "yes".to_owned(),
                    "false" | "no" => "no".to_owned(),
                    w => w.to_owned(),
                })
                .collect(),
        };
        settings
            .entry((section.clone(), key.to_owned()))
            .or_default()
            .extend(words);
    }
    for ((_, key), words) in settings.iter_mut() {
        if key != "ExecStart" && key != "SystemCallFilter" {
            words.sort();
        }
    }
    settings
}

/// An Exec line's arguments: words, or "double-quoted" ones with JSON-style escapes (the way
/// utils.escapeSystemdExecArgs writes them).
fn exec_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut rest = line.trim_start();
    while !rest.is_empty() {
        if rest.starts_with('"') {
            let mut de = serde_json::Deserializer::from_str(rest).into_iter::<String>();
            let word = de.next().unwrap().unwrap();
            rest = rest[de.byte_offset()..].trim_start();
            words.push(word);
        } else {
            let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
            words.push(rest[..end].to_owned());
            rest = rest[end..].trim_start();
        }
    }
    words
}

/// `want` and `have` agree key by key; the message lists every key that does not.
#[track_caller]
fn assert_same_settings(what: &str, want: &UnitSettings, have: &UnitSettings) {
    let keys: std::collections::BTreeSet<_> = want.keys().chain(have.keys()).collect();
    let differ: Vec<String> = keys
        .into_iter()
        .filter(|k| want.get(*k) != have.get(*k))
        .map(|k| format!("[{}] {}: {:?} vs {:?}", k.0, k.1, want.get(k), have.get(k)))
        .collect();
    assert!(differ.is_empty(), "{what} differ:\n{}", differ.join("\n"));
}

fn text<'a>(result: &'a Value, key: &str) -> &'a str {
    result[key]
        .as_str()
        .unwrap_or_else(|| panic!("{key} is {}", result[key]))
}

/// The messages of a host's failed assertions and its warnings, as strings.
fn messages(result: &Value, key: &str) -> Vec<String> {
    result[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            m.as_str()
                .unwrap()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

/// The runner's (or the janitor's) unit has `line` exactly once.
#[track_caller]
fn has_line_once(unit: &str, line: &str) {
    let n = unit.lines().filter(|l| l.trim() == line).count();
    assert_eq!(n, 1, "{line:?} is in the unit {n} times:\n{unit}");
}

/// `ccci-run config --json` reads `toml` and takes every one of `keys` from it.
#[track_caller]
fn binary_reads(toml: &str, keys: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.toml");
    std::fs::write(&file, toml).unwrap();
    let mut cmd = Command::new(BIN);
    crate::util::without_ccci_env(&mut cmd);
    let out = cmd
        .arg("--config")
        .arg(&file)
        .args(["config", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ccci-run refuses the module's configuration file:\n{toml}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    let settings: Vec<Value> = serde_json::from_value(shown["settings"].clone()).unwrap();
    for key in keys {
        let setting = settings
            .iter()
            .find(|s| s["key"] == *key)
            .unwrap_or_else(|| panic!("`ccci-run config` shows no {key}"));
        assert_eq!(setting["origin"]["kind"], "file", "{key}: {setting}");
    }
}

/// `systemd-analyze verify` of the module's units, their programs and man pages pointed at the
/// built binary and the pages it renders (nothing else changed).
fn systemd_verifies(units: &[(&str, &str)]) {
    if !crate::util::need("systemd-analyze") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let man = dir.path().join("man/man1");
    let listed = Command::new(BIN)
        .arg("man")
        .arg("--dir")
        .arg(&man)
        .output()
        .unwrap();
    assert!(listed.status.success());
    let store_program = regex::Regex::new(r#""?/nix/store/[^ "]+/bin/([a-z-]+)"?"#).unwrap();
    for (name, unit) in units {
        let unit = store_program.replace_all(unit, |c: &regex::Captures| {
            if &c[1] == "ccci-run" {
                BIN.to_owned()
            } else {
                "/bin/true".to_owned()
            }
        });
        std::fs::write(dir.path().join(name), unit.as_bytes()).unwrap();
    }
    let out = Command::new("systemd-analyze")
        .current_dir(dir.path())
        .env("MANPATH", dir.path().join("man"))
        .arg("verify")
        .args(units.iter().map(|(name, _)| name))
        .output()
        .unwrap();
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "systemd-analyze verify: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn shipped(file: &str) -> String {
    std::fs::read_to_string(repo().join("systemd").join(file)).unwrap()
}

/// With its defaults, the module writes what systemd/ ships for hosts without Nix: the janitor's
/// service and timer key by key (ReadWritePaths and ExecStart included), the configuration
/// file's settings, the runner's drop-in; systemd accepts every unit and the binary the file.
#[test]
fn nixos_module_writes_what_systemd_ships() {
    let Some(nix) = module_system() else {
        return;
    };
    let results = nix.evaluate(&[
        host("defaults", true, ""),
        host(
            "run_settings",
            true,
            r#"services.ccci-run = {
              deadline = "90m"; killGrace = "15s"; teardownTimeout = "10m"; lockWait = "0";
              longHeld = "1h 30m"; keepRuns = "30d"; reapBudget = "5m"; promoteAfter = "1.5";
            };"#,
        ),
        host(
            "former_option_values",
            true,
            r#"services.ccci-run = {
              janitor.keepRunsDays = 30; janitor.longHeld = 3600;
              etcdEndpoints = [ "http://10.0.0.1:2379" "http://10.0.0.2:2379" ]; leaseTtl = 15;
            };"#,
        ),
    ]);

    let defaults = &results["defaults"];
    assert_eq!(defaults["failedAssertions"], serde_json::json!([]));
    assert_eq!(defaults["warnings"], serde_json::json!([]));
    let janitor = text(defaults, "janitorService");
    let timer = text(defaults, "janitorTimer");
    assert_same_settings(
        "the module's janitor service and systemd/ccci-run-janitor.service",
        &unit_settings(&shipped("ccci-run-janitor.service")),
        &unit_settings(janitor),
    );
    assert_same_settings(
        "the module's janitor timer and systemd/ccci-run-janitor.timer",
        &unit_settings(&shipped("ccci-run-janitor.timer")),
        &unit_settings(timer),
    );
    // The drop-in's every setting is on the runner's unit, with the same value.
    let runner_unit = text(defaults, "runnerUnit");
    let runner = unit_settings(runner_unit);
    for (key, want) in unit_settings(&shipped("drone-runner-exec.service.d/ccci-run.conf")) {
        assert_eq!(runner.get(&key), Some(&want), "{key:?} in\n{runner_unit}");
    }
    has_line_once(runner_unit, "Environment=\"DRONE_RUNNER_CAPACITY=2\"");
    let path = defaults["runnerPath"].as_array().unwrap();
    assert!(
        path.contains(&"ccci-run".into()) && path.contains(&"util-linux".into()),
        "{path:?}"
    );
    let tmpfiles = &defaults["tmpfiles"];
    assert!(
        tmpfiles
            .as_array()
            .unwrap()
            .contains(&"d /var/lib/cc-ci-runs 0755 root root -".into()),
        "{tmpfiles}"
    );
    // The configuration file holds what systemd/config.toml holds (comments aside).
    let toml_of = |s: &str| s.parse::<toml::Table>().unwrap();
    let generated = text(defaults, "configToml");
    assert_eq!(
        toml_of(generated),
        toml_of(&shipped("config.toml")),
        "{generated}"
    );
    binary_reads(
        generated,
        &["lock_dir", "runs_dir", "abra_home", "state_dir", "docker"],
    );
    systemd_verifies(&[
        ("ccci-run-janitor.service", janitor),
        ("ccci-run-janitor.timer", timer),
        ("drone-runner-exec.service", runner_unit),
    ]);

    // The run settings reach the file under their keys; the janitor's flags and the runner's
    // stop timeout follow them.
    let set = &results["run_settings"];
    assert_eq!(set["failedAssertions"], serde_json::json!([]));
    let file = toml_of(text(set, "configToml"));
    for (key, value) in [
        ("deadline", "90m"),
        ("kill_grace", "15s"),
        ("teardown_timeout", "10m"),
        ("lock_wait", "0"),
        ("long_held", "1h 30m"),
        ("keep_runs", "30d"),
        ("reap_budget", "5m"),
        ("promote_after", "1.5"),
    ] {
        assert_eq!(
            file.get(key).and_then(|v| v.as_str()),
            Some(value),
            "{file:?}"
        );
    }
    let exec = &unit_settings(text(set, "janitorService"))[&("Service".into(), "ExecStart".into())];
    assert_eq!(
        exec[1..7],
        [
            "janitor",
            "--long-held",
            "1h 30m",
            "--keep-runs",
            "30d",
            "--metrics-file"
        ],
        "{exec:?}"
    );
    // 15 s of kill grace and 10 min of teardown, and the margin.
    assert_eq!(set["runnerServiceConfig"]["TimeoutStopSec"], "665s");
    systemd_verifies(&[("ccci-run-janitor.service", text(set, "janitorService"))]);

    // Values of the former option types still evaluate, to what they meant.
    let former = &results["former_option_values"];
    let exec =
        &unit_settings(text(former, "janitorService"))[&("Service".into(), "ExecStart".into())];
    assert_eq!(
        exec[1..6],
        ["janitor", "--long-held", "3600", "--keep-runs", "30d"]
    );
    let warnings = messages(former, "warnings");
    assert!(
        warnings.iter().any(|w| w.contains("janitor.keepRunsDays")),
        "{warnings:?}"
    );
    let file = toml_of(text(former, "configToml"));
    assert_eq!(file["lease_ttl"].as_str(), Some("15"), "{file:?}");
    let janitor = unit_settings(text(former, "janitorService"));
    assert_eq!(
        janitor[&("Service".into(), "RestrictAddressFamilies".into())],
        ["AF_INET", "AF_INET6", "AF_UNIX"]
    );
    assert!(!janitor.contains_key(&("Service".into(), "IPAddressDeny".into())));
    // And the binary takes the files with the run settings and the etcd settings as written.
    binary_reads(
        text(set, "configToml"),
        &[
            "deadline",
            "kill_grace",
            "teardown_timeout",
            "lock_wait",
            "long_held",
            "keep_runs",
            "reap_budget",
            "promote_after",
        ],
    );
    binary_reads(text(former, "configToml"), &["etcd_endpoints", "lease_ttl"]);
}

/// The module merges with whatever the host sets on its own runner: the capacity in each way a
/// host sets it, the runner's own settings, another runner's name, none, the module disabled;
/// a set-up that would break ccci-run fails the evaluation with a message saying what to do.
#[test]
fn nixos_module_merges_with_the_hosts_runner() {
    let Some(nix) = module_system() else {
        return;
    };
    const RUNNER_FILE: &str = r#"
      environment.etc."drone-runner-exec/config".text = ''
        DRONE_RPC_HOST=drone.example.org
        DRONE_RUNNER_CAPACITY=4
      '';
      systemd.services.drone-runner-exec.serviceConfig.ExecStart =
        lib.mkForce "${pkgs.drone-runner-exec}/bin/drone-runner-exec daemon /etc/drone-runner-exec/config";
    "#;
    let body = |s: &str| -> &'static str { Box::leak(s.to_owned().into_boxed_str()) };
    let results = nix.evaluate(&[
        host(
            "capacity_plain",
            true,
            r#"systemd.services.drone-runner-exec.environment.DRONE_RUNNER_CAPACITY = "4";"#,
        ),
        host(
            "capacity_mkdefault",
            true,
            r#"systemd.services.drone-runner-exec.environment.DRONE_RUNNER_CAPACITY = lib.mkDefault "4";"#,
        ),
        host(
            "capacity_mkforce",
            true,
            r#"systemd.services.drone-runner-exec.environment.DRONE_RUNNER_CAPACITY = lib.mkForce "4";"#,
        ),
        host("capacity_in_the_runners_file", true, RUNNER_FILE),
        host(
            "capacity_in_the_file_and_the_option",
            true,
            body(&format!("{RUNNER_FILE} services.ccci-run.runnerCapacity = 3;")),
        ),
        host(
            "capacity_in_the_file_and_the_unit",
            true,
            body(&format!(
                "{RUNNER_FILE} systemd.services.drone-runner-exec.environment.DRONE_RUNNER_CAPACITY = \"4\";"
            )),
        ),
        host("capacity_option", true, "services.ccci-run.runnerCapacity = 5;"),
        host(
            "capacity_in_service_environment",
            true,
            r#"systemd.services.drone-runner-exec.serviceConfig.Environment = [ "DRONE_RUNNER_CAPACITY=4" ];"#,
        ),
        host(
            "capacity_in_service_environment_and_the_option",
            true,
            r#"systemd.services.drone-runner-exec.serviceConfig.Environment = "DRONE_RUNNER_CAPACITY=4";
            services.ccci-run.runnerCapacity = 3;"#,
        ),
        host("capacity_left_alone", true, "services.ccci-run.runnerCapacity = null;"),
        host(
            "runner_settings",
            true,
            r#"systemd.services.drone-runner-exec.serviceConfig = {
              User = "drone"; Group = "drone"; Restart = "always"; KillMode = "mixed";
              TimeoutStopSec = "30s"; Delegate = true;
            };
            services.ccci-run.lockDir = "/run/ccci-run";"#,
        ),
        // Host set-ups that would not work: refused, naming what to set.
        host(
            "runner_user_in_run_lock",
            true,
            r#"systemd.services.drone-runner-exec.serviceConfig.User = "drone";"#,
        ),
        host(
            "runner_dynamic_user",
            true,
            r#"systemd.services.drone-runner-exec.serviceConfig = {
              User = "drone"; DynamicUser = true;
            };
            services.ccci-run.lockDir = "/run/ccci-run";"#,
        ),
        host(
            "runner_home_as_runs_dir",
            true,
            r#"users.users.drone = { isSystemUser = true; group = "users"; home = "/var/lib/drone"; };
            systemd.services.drone-runner-exec.serviceConfig.User = "drone";
            services.ccci-run = { lockDir = "/run/ccci-run"; runsDir = "/var/lib/drone"; };"#,
        ),
        host(
            "runner_user_of_group_users",
            true,
            r#"users.users.drone = { isSystemUser = true; group = "users"; };
            services.ccci-run = { runnerUser = "drone"; lockDir = "/run/ccci-run"; };"#,
        ),
        host(
            "runner_left_alone_of_its_own_user",
            false,
            "services.ccci-run.droneRunnerService = null;",
        ),
        host(
            "runner_settings_that_fit",
            true,
            r#"systemd.services.drone-runner-exec.serviceConfig = {
              User = "drone"; TimeoutStopSec = "10min"; Delegate = "yes";
            };
            services.ccci-run = { lockDir = "/run/ccci-run"; abraHome = "/var/lib/drone/.abra"; };"#,
        ),
        host(
            "runner_of_another_name",
            false,
            r#"services.ccci-run.droneRunnerService = "ci-runner";
            systemd.services.ci-runner.script = "exec sleep infinity";"#,
        ),
        host(
            "runner_left_alone",
            false,
            r#"services.ccci-run = { droneRunnerService = null; runnerUser = "root"; };"#,
        ),
        host("no_runner_unit", false, ""),
        host(
            "runner_not_delegated",
            true,
            "systemd.services.drone-runner-exec.serviceConfig.Delegate = false;",
        ),
        host("disabled", true, "services.ccci-run.enable = false;"),
        host(
            "node_exporter",
            true,
            "services.prometheus.exporters.node.enable = true;",
        ),
        host(
            "node_exporter_with_its_own_directory",
            true,
            r#"services.prometheus.exporters.node = {
              enable = true; extraFlags = lib.mkAfter [ "--collector.textfile.directory=/srv/textfile" ];
            };"#,
        ),
        host(
            "node_exporter_with_the_metrics_in_its_directory",
            true,
            r#"services.prometheus.exporters.node = {
              enable = true; extraFlags = [ "--collector.textfile.directory=/srv/textfile" ];
            };
            services.ccci-run.janitor.metricsFile = "/srv/textfile/ccci-run.prom";"#,
        ),
        host(
            "no_metrics",
            true,
            r#"services.prometheus.exporters.node.enable = true;
            services.ccci-run.janitor.metricsFile = null;"#,
        ),
    ]);
    let ok = |name: &str| {
        let r = &results[name];
        assert_eq!(r["failedAssertions"], serde_json::json!([]), "{name}");
        r
    };
    let capacity = |name: &str| ok(name)["runnerEnvironment"]["DRONE_RUNNER_CAPACITY"].clone();

    for name in ["capacity_plain", "capacity_mkdefault", "capacity_mkforce"] {
        assert_eq!(capacity(name), "4", "{name}");
        has_line_once(
            text(&results[name], "runnerUnit"),
            "Environment=\"DRONE_RUNNER_CAPACITY=4\"",
        );
    }
    // The file's capacity is the one in force: the unit sets none that would hide it.
    assert_eq!(capacity("capacity_in_the_runners_file"), Value::Null);
    assert!(!text(&results["capacity_in_the_runners_file"], "runnerUnit").contains("CAPACITY"));
    // A capacity in serviceConfig.Environment is the one place: the module adds no second line.
    assert_eq!(
        ok("capacity_in_service_environment")["runnerEnvironment"]["DRONE_RUNNER_CAPACITY"],
        Value::Null
    );
    for name in [
        "capacity_in_the_file_and_the_option",
        "capacity_in_the_file_and_the_unit",
    ] {
        let failed = messages(&results[name], "failedAssertions");
        assert!(
            failed.len() == 1
                && failed[0].contains("capacity is set in 2 places")
                && failed[0].contains("godotenv"),
            "{name}: {failed:?}"
        );
    }
    let failed = messages(
        &results["capacity_in_service_environment_and_the_option"],
        "failedAssertions",
    );
    assert!(
        failed.len() == 1
            && failed[0].contains("capacity is set in 2 places")
            && failed[0].contains("serviceConfig.Environment"),
        "{failed:?}"
    );
    assert_eq!(capacity("capacity_option"), "5");
    assert_eq!(capacity("capacity_left_alone"), Value::Null);

    // The host's own settings of its runner stay as they are; the module says what they cost.
    let settings = &ok("runner_settings")["runnerServiceConfig"];
    for (key, value) in [
        ("User", "drone"),
        ("Group", "drone"),
        ("Restart", "always"),
        ("KillMode", "mixed"),
        ("TimeoutStopSec", "30s"),
    ] {
        assert_eq!(settings[key], value, "{settings}");
    }
    assert_eq!(settings["Delegate"], true);
    let unit = text(&results["runner_settings"], "runnerUnit");
    for line in [
        "User=drone",
        "Restart=always",
        "KillMode=mixed",
        "TimeoutStopSec=30s",
        "Delegate=true",
    ] {
        has_line_once(unit, line);
    }
    let warnings = messages(&results["runner_settings"], "warnings");
    for words in [
        "TimeoutStopSec is 30s, shorter than the 6min",
        "runs as drone, which cannot read the abra home /root/.abra",
    ] {
        assert!(
            warnings.iter().any(|w| w.contains(words)),
            "{words}: {warnings:?}"
        );
    }
    for (name, words) in [
        (
            "runner_user_in_run_lock",
            "cannot create lock files in /run/lock",
        ),
        ("runner_dynamic_user", "DynamicUser=true"),
        ("runner_home_as_runs_dir", "the home of drone"),
        (
            "runner_left_alone_of_its_own_user",
            "set services.ccci-run.runnerUser",
        ),
    ] {
        let failed = messages(&results[name], "failedAssertions");
        assert!(
            failed.iter().any(|m| m.contains(words)),
            "{name}: {words}: {failed:?}"
        );
    }
    // The runner's user's own group, as the host declares it; the janitor runs as that user.
    let users = ok("runner_user_of_group_users");
    let tmpfiles: Vec<&str> = users["tmpfiles"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        tmpfiles.contains(&"d /var/lib/cc-ci-runs 0755 drone users -"),
        "{tmpfiles:?}"
    );
    let janitor = text(users, "janitorService");
    has_line_once(janitor, "User=drone");
    has_line_once(janitor, "Group=users");
    let fit = ok("runner_settings_that_fit");
    assert_eq!(fit["warnings"], serde_json::json!([]));
    assert_eq!(fit["runnerServiceConfig"]["Delegate"], "yes");
    let tmpfiles = fit["tmpfiles"].as_array().unwrap();
    for rule in [
        "d /var/lib/cc-ci-runs 0755 drone drone -",
        "d /var/lib/ccci-run/state 0700 drone drone -",
        "d /run/ccci-run 0755 drone drone -",
    ] {
        assert!(tmpfiles.contains(&rule.into()), "{rule}: {tmpfiles:?}");
    }

    let other = ok("runner_of_another_name");
    assert_eq!(other["runner"], "ci-runner");
    assert_eq!(other["runnerEnvironment"]["DRONE_RUNNER_CAPACITY"], "2");
    assert_eq!(other["runnerServiceConfig"]["Delegate"], true);
    assert!(
        !other["services"]
            .as_array()
            .unwrap()
            .contains(&"drone-runner-exec".into())
    );
    let alone = ok("runner_left_alone");
    assert!(
        !alone["services"]
            .as_array()
            .unwrap()
            .contains(&"drone-runner-exec".into())
    );
    assert!(alone["janitorService"].is_string());

    let failed = messages(&results["no_runner_unit"], "failedAssertions");
    assert!(
        failed.len() == 1
            && failed[0].contains("systemd.services.drone-runner-exec starts nothing")
            && failed[0].contains("droneRunnerService")
            && failed[0].contains("null"),
        "{failed:?}"
    );
    let failed = messages(&results["runner_not_delegated"], "failedAssertions");
    assert!(
        failed.len() == 1 && failed[0].contains("needs the runner's cgroup subtree delegated"),
        "{failed:?}"
    );

    let disabled = ok("disabled");
    for key in ["janitorService", "janitorTimer", "configToml", "package"] {
        assert_eq!(disabled[key], Value::Null, "{key}");
    }
    let config = &disabled["runnerServiceConfig"];
    assert!(
        config.get("Delegate").is_none() && config.get("TimeoutStopSec").is_none(),
        "{config}"
    );
    assert_eq!(
        disabled["runnerEnvironment"].get("DRONE_RUNNER_CAPACITY"),
        None
    );

    // node_exporter gets one textfile directory: the module's, or the host's own.
    let textfile_flags = |name: &str| -> Vec<String> {
        let exec = text(&results[name], "nodeExporter");
        exec.split_whitespace()
            .filter(|w| w.starts_with("--collector.textfile.directory"))
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(
        textfile_flags("node_exporter"),
        ["--collector.textfile.directory=/var/lib/prometheus/node-exporter"]
    );
    assert_eq!(
        textfile_flags("node_exporter_with_its_own_directory"),
        ["--collector.textfile.directory=/srv/textfile"]
    );
    let warnings = messages(&results["node_exporter_with_its_own_directory"], "warnings");
    assert!(
        warnings.len() == 1
            && warnings[0].contains("metricsFile is in /var/lib/prometheus/node-exporter")
            && warnings[0].contains("reads /srv/textfile"),
        "{warnings:?}"
    );
    let fitting = ok("node_exporter_with_the_metrics_in_its_directory");
    assert_eq!(fitting["warnings"], serde_json::json!([]));
    assert_eq!(
        textfile_flags("node_exporter_with_the_metrics_in_its_directory"),
        ["--collector.textfile.directory=/srv/textfile"]
    );
    let janitor = unit_settings(text(fitting, "janitorService"));
    assert!(
        janitor[&("Service".into(), "ReadWritePaths".into())].contains(&"-/srv/textfile".into())
    );
    let none = ok("no_metrics");
    assert!(textfile_flags("no_metrics").is_empty());
    assert!(!text(none, "janitorService").contains("metrics-file"));
    assert!(!text(none, "janitorService").contains("node-exporter"));
}

/// Every value the binary (or the unit it lands in) would refuse is refused when the host's
/// configuration is evaluated, with the option's name and the rule it breaks.
#[test]
fn nixos_module_refuses_bad_values_at_evaluation() {
    let Some(nix) = module_system() else {
        return;
    };
    let path_rule = "an absolute path (not \"/\")";
    let span_rule = "a systemd time span from 1min to 365d";
    let cases: &[(&str, &str, &str)] = &[
        (r#"lockDir = "run/lock";"#, "lockDir", path_rule),
        (r#"lockDir = "/";"#, "lockDir", path_rule),
        (r#"runsDir = "/var/lib/cc ci-runs";"#, "runsDir", path_rule),
        (
            r#"stateDir = "/var/lib/ccci-run/../state";"#,
            "stateDir",
            path_rule,
        ),
        (r#"abraHome = "/root/.abra/";"#, "abraHome", path_rule),
        (r#"abraHome = "/root/100%";"#, "abraHome", path_rule),
        (
            r#"janitor.metricsFile = "ccci-run.prom";"#,
            "janitor.metricsFile",
            "ending in .prom",
        ),
        (
            r#"janitor.metricsFile = "/var/lib/ccci-run.txt";"#,
            "janitor.metricsFile",
            "ending in .prom",
        ),
        (
            r#"janitor.interval = "bogus";"#,
            "janitor.interval",
            span_rule,
        ),
        (r#"janitor.interval = "0";"#, "janitor.interval", span_rule),
        (
            r#"etcdEndpoints = [ "https://10.0.0.1:2379" ];"#,
            "etcdEndpoints",
            "https:// is not supported",
        ),
        (
            r#"etcdEndpoints = [ "10.0.0.1" ];"#,
            "etcdEndpoints",
            "HOST:PORT",
        ),
        (
            r#"etcdEndpoints = [ "10.0.0.1:70000" ];"#,
            "etcdEndpoints",
            "a port in 1-65535",
        ),
        (
            "leaseTtl = 1;",
            "leaseTtl",
            "from 2s to 3600s in whole seconds",
        ),
        (r#"leaseTtl = "3601s";"#, "leaseTtl", "from 2s to 3600s"),
        (r#"leaseTtl = "2.5";"#, "leaseTtl", "in whole seconds"),
        (
            r#"janitor.longHeld = "366d";"#,
            "janitor.longHeld",
            "from 0s to 365d",
        ),
        (
            r#"janitor.keepRuns = "14";"#,
            "janitor.keepRuns",
            "a bare number is refused",
        ),
        (r#"keepRuns = "36501d";"#, "keepRuns", "from 1h to 36500d"),
        (r#"deadline = "0";"#, "deadline", "from 1s to 365d"),
        (r#"deadline = "1y";"#, "deadline", "from 1s to 365d"),
        (r#"killGrace = "-1";"#, "killGrace", "from 0s to 365d"),
        (
            r#"killGrace = "10 parsecs";"#,
            "killGrace",
            "from 0s to 365d",
        ),
        (
            r#"teardownTimeout = "0s";"#,
            "teardownTimeout",
            "from 1s to 365d",
        ),
        (r#"lockWait = "1h30";"#, "lockWait", "from 0s to 365d"),
        (r#"reapBudget = "0";"#, "reapBudget", "from 1s to 365d"),
        (
            r#"promoteAfter = "forever";"#,
            "promoteAfter",
            "from 0s to 365d",
        ),
        ("runnerCapacity = 0;", "runnerCapacity", "positive integer"),
        (
            r#"droneRunnerService = "drone-runner-exec.service";"#,
            "droneRunnerService",
            "no .service suffix",
        ),
        (
            r#"docker = "sometimes";"#,
            "docker",
            "one of \"auto\", \"required\", \"off\"",
        ),
    ];
    // Two evaluations at a time: the machine's cores, not one case's speed, bound the test.
    let numbered: Vec<_> = cases.iter().enumerate().collect();
    let refusals: Vec<(usize, String)> = std::thread::scope(|scope| {
        let handles: Vec<_> = numbered
            .chunks(cases.len().div_ceil(2))
            .map(|chunk| {
                let nix = &nix;
                scope.spawn(move || {
                    chunk
                        .iter()
                        .map(|(i, (set, _, _))| {
                            let body: &'static str =
                                Box::leak(format!("services.ccci-run.{set}").into_boxed_str());
                            (*i, nix.refusal(&host("bad", true, body)))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    for (i, stderr) in refusals {
        let (set, option, rule) = cases[i];
        let flat = stderr.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            (flat.contains(&format!(
                "option `services.ccci-run.{option}' is not of type"
            )) || flat.contains(&format!("option `services.ccci-run.{option}.\"[definition")))
                && flat.contains("is not of type")
                && flat.contains(rule),
            "`{set}` is not refused with the option's name and {rule:?}:\n{stderr}"
        );
    }
}

/// Every key of the configuration file has its option, and every bad value the binary or
/// systemd would trip on is refused at evaluation, naming the option and the host's own file;
/// the capacity has one place whichever way the host sets it. On the module system's core
/// (nixpkgs' lib.evalModules), so that what the module's types and assertions do is the real
/// module system's, whole NixOS or not.
#[test]
fn nixos_module_core_offers_every_key_and_refuses_bad_values() {
    let Some(core) = module_core() else {
        return;
    };
    const EVERY_KEY: &str = r#"services.ccci-run = {
      lockDir = "/run/ccci-run"; runsDir = "/srv/ci/runs"; stateDir = "/var/lib/ccci-run/state";
      abraHome = "/srv/ci/abra"; domainSuffix = "ci.example.org"; docker = "required";
      dockerHost = "tcp://10.0.0.5:2376"; dockerTlsVerify = true;
      dockerCertPath = "/etc/ccci-run/docker-tls"; logFormat = "json"; cgroup = "off";
      etcdEndpoints = [ "http://10.0.0.1:2379" ]; leaseTtl = "15s";
      nodeSweepImage = "docker:27-cli"; nodeDockerSocket = "/var/run/docker.sock";
      recipeUrlTemplate = "https://git.example.org/coop-cloud/{recipe}.git";
      deadline = "90m"; killGrace = "5s"; teardownTimeout = "10m"; lockWait = "30m";
      longHeld = "3h"; keepRuns = "30d"; reapBudget = "5m"; promoteAfter = "10m";
      convergeTimeout = "10m"; convergeStable = "5s";
    };
    systemd.services.drone-runner-exec.serviceConfig.User = "nobody";"#;
    const ENV_FILE: &str = r#"environment.etc."drone-runner-exec/env".text = ''
        DRONE_RPC_SECRET=s3cret
        DRONE_RUNNER_CAPACITY=4
      '';
      systemd.services.drone-runner-exec.serviceConfig.EnvironmentFile = "-/etc/drone-runner-exec/env";"#;
    const RUNNER_FILE: &str = r#"environment.etc."drone-runner-exec/config".text = ''
        DRONE_RUNNER_CAPACITY=4
      '';"#;
    const UNIT: &str =
        r#"systemd.services.drone-runner-exec.environment.DRONE_RUNNER_CAPACITY = "4";"#;
    let good: Vec<(&str, String)> = vec![
        ("every_key", EVERY_KEY.to_owned()),
        (
            "tcp_engine",
            r#"services.ccci-run.dockerHost = "tcp://10.0.0.5:2375";"#.to_owned(),
        ),
        (
            "unix_engine",
            r#"services.ccci-run.dockerHost = "unix:///run/docker.sock";"#.to_owned(),
        ),
        ("keep_runs_days", "services.ccci-run.janitor.keepRunsDays = 30;".to_owned()),
        ("capacity_env_file", ENV_FILE.to_owned()),
        ("capacity_unit", UNIT.to_owned()),
        ("capacity_runner_file", RUNNER_FILE.to_owned()),
        (
            "capacity_env_file_and_option",
            format!("{ENV_FILE} services.ccci-run.runnerCapacity = 3;"),
        ),
        (
            "capacity_unit_and_option",
            format!("{UNIT} services.ccci-run.runnerCapacity = 3;"),
        ),
        (
            "capacity_runner_file_and_option",
            format!("{RUNNER_FILE} services.ccci-run.runnerCapacity = 3;"),
        ),
        ("capacity_env_file_and_unit", format!("{ENV_FILE} {UNIT}")),
        (
            "capacity_unread_env_file_and_option",
            r#"systemd.services.drone-runner-exec.serviceConfig.EnvironmentFile = "/run/secrets/drone";
            services.ccci-run.runnerCapacity = 3;"#
                .to_owned(),
        ),
        (
            "tls_without_tcp",
            "services.ccci-run.dockerTlsVerify = true;".to_owned(),
        ),
        (
            "keep_runs_twice",
            r#"services.ccci-run.janitor = { keepRunsDays = 7; keepRuns = "7d"; };"#.to_owned(),
        ),
        // The runner's user: its own group, and the set-ups it cannot work in.
        (
            "runner_user_of_group_users",
            r#"users.users.drone = { isSystemUser = true; group = "users"; };
            services.ccci-run = { runnerUser = "drone"; lockDir = "/run/ccci-run"; };"#
                .to_owned(),
        ),
        (
            "runner_left_alone_as_root",
            r#"services.ccci-run = { droneRunnerService = null; runnerUser = "root"; };"#
                .to_owned(),
        ),
        (
            "runner_user_in_run_lock",
            r#"systemd.services.drone-runner-exec.serviceConfig.User = "drone";"#.to_owned(),
        ),
        (
            "runner_dynamic_user",
            r#"systemd.services.drone-runner-exec.serviceConfig = { User = "drone"; DynamicUser = true; };
            services.ccci-run.lockDir = "/run/ccci-run";"#
                .to_owned(),
        ),
        (
            "runner_dynamic_user_yes",
            r#"systemd.services.drone-runner-exec.serviceConfig = { User = "drone"; DynamicUser = "yes"; };
            services.ccci-run.lockDir = "/run/ccci-run";"#
                .to_owned(),
        ),
        (
            "runner_home_as_runs_dir",
            r#"users.users.drone = { isSystemUser = true; group = "users"; home = "/var/lib/drone"; };
            systemd.services.drone-runner-exec.serviceConfig.User = "drone";
            services.ccci-run = { lockDir = "/run/ccci-run"; runsDir = "/var/lib/drone"; };"#
                .to_owned(),
        ),
        (
            "runner_left_alone_of_its_own_user",
            "services.ccci-run.droneRunnerService = null;".to_owned(),
        ),
        (
            "runner_users_differ",
            r#"systemd.services.drone-runner-exec.serviceConfig.User = "ci";
            services.ccci-run = { runnerUser = "drone"; lockDir = "/run/ccci-run"; };"#
                .to_owned(),
        ),
    ];
    let hosts: Vec<(&str, &str)> = good.iter().map(|(n, b)| (*n, b.as_str())).collect();
    let results = core.evaluate(&hosts);
    let ok = |name: &str| -> &Value {
        results[name]
            .as_ref()
            .unwrap_or_else(|e| panic!("{name} does not evaluate: {e}"))
    };
    let toml_of = |s: &str| s.parse::<toml::Table>().unwrap();

    // Every key the binary reads is written from its option, and read back as written.
    let every = ok("every_key");
    assert_eq!(every["failedAssertions"], serde_json::json!([]));
    let file = toml_of(text(every, "configToml"));
    let keys = crate::shipping::file_keys();
    for key in &keys {
        assert!(file.contains_key(key), "{key} is not written: {file:?}");
    }
    assert_eq!(file["runner_user"].as_str(), Some("nobody"));
    assert_eq!(file["docker_tls_verify"].as_bool(), Some(true));
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    binary_reads(text(every, "configToml"), &keys);
    let tmpfiles = &every["tmpfiles"];
    for line in [
        "d /srv/ci/runs 0755 nobody nogroup -",
        "d /var/lib/ccci-run/state 0700 nobody nogroup -",
        "d /run/ccci-run 0755 nobody nogroup -",
    ] {
        assert!(
            tmpfiles.as_array().unwrap().contains(&line.into()),
            "{tmpfiles}"
        );
    }

    // The runner's user's own group, as the host declares it; the janitor runs as that user,
    // and so does the runner's unit when the host named the user only in runnerUser.
    let users = ok("runner_user_of_group_users");
    assert_eq!(users["failedAssertions"], serde_json::json!([]));
    assert!(
        users["tmpfiles"]
            .as_array()
            .unwrap()
            .contains(&"d /var/lib/cc-ci-runs 0755 drone users -".into()),
        "{users}"
    );
    assert_eq!(users["janitorServiceConfig"]["User"], "drone");
    assert_eq!(users["janitorServiceConfig"]["Group"], "users");
    assert_eq!(users["runnerServiceConfig"]["User"], "drone");
    assert_eq!(
        toml_of(text(users, "configToml"))["runner_user"].as_str(),
        Some("drone")
    );
    let root = ok("runner_left_alone_as_root");
    assert_eq!(root["failedAssertions"], serde_json::json!([]));
    assert!(
        root["runnerServiceConfig"].get("Delegate").is_none(),
        "{root}"
    );
    assert!(
        root["tmpfiles"]
            .as_array()
            .unwrap()
            .contains(&"d /var/lib/cc-ci-runs 0755 root root -".into()),
        "{root}"
    );
    assert!(!toml_of(text(root, "configToml")).contains_key("runner_user"));
    for (name, words) in [
        (
            "runner_user_in_run_lock",
            "cannot create lock files in /run/lock",
        ),
        ("runner_dynamic_user", "DynamicUser=true"),
        ("runner_dynamic_user_yes", "DynamicUser=true"),
        ("runner_home_as_runs_dir", "the home of drone"),
        (
            "runner_left_alone_of_its_own_user",
            "set services.ccci-run.runnerUser",
        ),
        (
            "runner_users_differ",
            "runnerUser is drone, but systemd.services.drone-runner-exec runs as ci",
        ),
    ] {
        let failed = messages(ok(name), "failedAssertions");
        assert!(
            failed.len() == 1 && failed[0].contains(words),
            "{name}: {words}: {failed:?}"
        );
    }

    // The janitor reaches the network only when a setting needs it: a TCP engine does.
    let families = |name: &str| ok(name)["janitorServiceConfig"]["RestrictAddressFamilies"].clone();
    let denied = |name: &str| {
        ok(name)["janitorServiceConfig"]
            .get("IPAddressDeny")
            .cloned()
    };
    assert_eq!(
        families("tcp_engine"),
        serde_json::json!(["AF_UNIX", "AF_INET", "AF_INET6"])
    );
    assert_eq!(denied("tcp_engine"), None);
    assert_eq!(families("unix_engine"), serde_json::json!(["AF_UNIX"]));
    assert_eq!(denied("unix_engine"), Some("any".into()));

    // The former keepRunsDays: what it meant, with a warning.
    let days = ok("keep_runs_days");
    assert!(
        text(&days["janitorServiceConfig"], "ExecStart").contains("\"--keep-runs\" \"30d\""),
        "{days}"
    );
    assert!(
        messages(days, "warnings")
            .iter()
            .any(|w| w.contains("janitor.keepRuns = \"30d\"")),
        "{days}"
    );

    // The capacity: one place, whichever; a file's value is left to the file.
    let capacity = |name: &str| ok(name)["runnerEnvironment"]["DRONE_RUNNER_CAPACITY"].clone();
    for name in ["capacity_env_file", "capacity_runner_file"] {
        assert_eq!(
            ok(name)["failedAssertions"],
            serde_json::json!([]),
            "{name}"
        );
        assert_eq!(capacity(name), Value::Null, "{name}");
    }
    assert_eq!(capacity("capacity_unit"), "4");
    for (name, in_force) in [
        (
            "capacity_env_file_and_option",
            "from DRONE_RUNNER_CAPACITY=4 in /etc/drone-runner-exec/env (the unit's EnvironmentFile=",
        ),
        (
            "capacity_unit_and_option",
            "from DRONE_RUNNER_CAPACITY=4 in systemd.services.drone-runner-exec.environment",
        ),
        (
            "capacity_runner_file_and_option",
            "from DRONE_RUNNER_CAPACITY=4 in /etc/drone-runner-exec/config",
        ),
        (
            "capacity_env_file_and_unit",
            "from DRONE_RUNNER_CAPACITY=4 in /etc/drone-runner-exec/env (the unit's EnvironmentFile=",
        ),
    ] {
        let failed = messages(ok(name), "failedAssertions");
        assert!(
            failed.len() == 1
                && failed[0].contains("capacity is set in 2 places")
                && failed[0].contains(&format!(
                    "The runner would run 4 builds at once, {in_force}"
                )),
            "{name}: {failed:?}"
        );
    }
    assert!(
        messages(ok("capacity_unread_env_file_and_option"), "warnings")
            .iter()
            .any(|w| w.contains("/run/secrets/drone") && w.contains("would win")),
        "{:?}",
        ok("capacity_unread_env_file_and_option")
    );
    for (name, needle) in [
        (
            "tls_without_tcp",
            "dockerTlsVerify and dockerCertPath are for an engine reached over TCP",
        ),
        ("keep_runs_twice", "keepRunsDays is replaced by keepRuns"),
    ] {
        let failed = messages(ok(name), "failedAssertions");
        assert!(
            failed.iter().any(|f| f.contains(needle)),
            "{name}: {failed:?}"
        );
    }

    // Values that would break a real host: refused, naming the option and the host's file.
    let bad = [
        (
            "runs_var_lib",
            "services.ccci-run.runsDir = \"/var/lib\";",
            "runsDir",
        ),
        (
            "runs_root",
            "services.ccci-run.runsDir = \"/root\";",
            "runsDir",
        ),
        (
            "runs_tmp",
            "services.ccci-run.runsDir = \"/tmp/runs\";",
            "runsDir",
        ),
        (
            "state_tmp",
            "services.ccci-run.stateDir = \"/tmp\";",
            "stateDir",
        ),
        (
            "lock_var_lib",
            "services.ccci-run.lockDir = \"/var/lib\";",
            "lockDir",
        ),
        (
            "metrics_tmp",
            "services.ccci-run.janitor.metricsFile = \"/tmp/ccci-run.prom\";",
            "janitor.metricsFile",
        ),
        (
            "metrics_var_lib",
            "services.ccci-run.janitor.metricsFile = \"/var/lib/ccci-run.prom\";",
            "janitor.metricsFile",
        ),
        (
            "interval_huge",
            "services.ccci-run.janitor.interval = \"99999999999999999999y\";",
            "janitor.interval",
        ),
        (
            "interval_tiny",
            "services.ccci-run.janitor.interval = \"1us\";",
            "janitor.interval",
        ),
        (
            "days_negative",
            "services.ccci-run.janitor.keepRunsDays = -1;",
            "janitor.keepRunsDays",
        ),
        (
            "days_zero",
            "services.ccci-run.janitor.keepRunsDays = 0;",
            "janitor.keepRunsDays",
        ),
        (
            "keep_nothing",
            "services.ccci-run.keepRuns = \"0d\";",
            "keepRuns",
        ),
        (
            "keep_minutes",
            "services.ccci-run.janitor.keepRuns = \"30m\";",
            "janitor.keepRuns",
        ),
        (
            "suffix_case",
            "services.ccci-run.domainSuffix = \"CI.Example.org\";",
            "domainSuffix",
        ),
        (
            "suffix_long",
            "services.ccci-run.domainSuffix = \"a-much-longer-suffix.ci.example.org\";",
            "domainSuffix",
        ),
        (
            "template_fixed",
            "services.ccci-run.recipeUrlTemplate = \"https://git.example.org/r.git\";",
            "recipeUrlTemplate",
        ),
        (
            "cert_relative",
            "services.ccci-run.dockerCertPath = \"certs\";",
            "dockerCertPath",
        ),
        (
            "log_format",
            "services.ccci-run.logFormat = \"yaml\";",
            "logFormat",
        ),
        ("cgroup", "services.ccci-run.cgroup = \"on\";", "cgroup"),
        (
            "converge",
            "services.ccci-run.convergeTimeout = \"forever\";",
            "convergeTimeout",
        ),
    ];
    let results = core.evaluate(&bad.iter().map(|(n, b, _)| (*n, *b)).collect::<Vec<_>>());
    for (name, body, option) in bad {
        let Err(error) = &results[name] else {
            panic!("{name}: `{body}` evaluated");
        };
        let error = error.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            error.contains(&format!(
                "option `services.ccci-run.{option}' is not of type"
            )) && error.contains(&format!("{name}.nix")),
            "{name}: {error}"
        );
    }
}

/// One duration grammar: the module's rule (nix/lib.nix, which every duration option is built
/// from) and the binary take and refuse the same values, and read the same length from each.
/// Needs only nix-instantiate: lib.nix is free of nixpkgs.
#[test]
fn the_module_and_the_binary_read_every_duration_alike() {
    if !crate::util::need("nix-instantiate") {
        return;
    }
    let table = [
        "0",
        "90",
        "1.5",
        "0.001",
        "90s",
        "13.5s",
        "1.5m",
        "1.5h",
        "1.5d",
        "2.25w",
        "500ms",
        "5m",
        "1h30m",
        "1h 30m",
        "1 m",
        "1.5 m",
        "1s1s",
        "1m1h",
        "14d",
        "365d",
        "2w",
        ".5",
        "1.",
        "0.5ms",
        "1.25ms",
        "1.0001",
        "0.0001s",
        "366d",
        "1y",
        "1M",
        "5S",
        "90min",
        "1hour",
        "1h30",
        "1e3",
        "-1",
        "",
        "10 parsecs",
        "3days",
    ];
    let exprs: Vec<String> = table
        .iter()
        .map(|v| {
            format!(
                "(let r = (l.durationRule {{ min = \"0s\"; max = \"365d\"; }}).check {v:?}; in \
                 if r then l.durationMillis {v:?} else null)"
            )
        })
        .collect();
    let expr = format!("let l = import ./nix/lib.nix; in [ {} ]", exprs.join(" "));
    let out = Command::new("nix-instantiate")
        .current_dir(repo())
        .args(["--eval", "--strict", "--json", "-E", &expr])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let module: Vec<Option<u64>> = serde_json::from_slice(&out.stdout).unwrap();
    // The binary's reading of the same value, as `config --json` shows it, in milliseconds.
    let millis = |shown: &str| -> u64 {
        let mut total = 0;
        let mut number = String::new();
        let mut chars = shown.chars().peekable();
        while let Some(c) = chars.next() {
            if c.is_ascii_digit() {
                number.push(c);
                continue;
            }
            let mut unit = c.to_string();
            while chars.peek().is_some_and(|c| c.is_alphabetic()) {
                unit.push(chars.next().unwrap());
            }
            let n: u64 = number.parse().unwrap();
            number.clear();
            total += n * match unit.as_str() {
                "ms" => 1,
                "s" => 1000,
                "m" => 60_000,
                "h" => 3_600_000,
                "d" => 86_400_000,
                "w" => 7 * 86_400_000,
                other => panic!("unit {other:?} in {shown:?}"),
            };
        }
        total
    };
    let mut differ = Vec::new();
    for (value, module) in table.iter().zip(module) {
        let done = Command::new(crate::util::BIN)
            .env("CCCI_CONFIG", "/dev/null")
            .env("CCCI_KILL_GRACE", value)
            .args(["config", "--json"])
            .output()
            .unwrap();
        let binary = done.status.success().then(|| {
            let json: Value = serde_json::from_slice(&done.stdout).unwrap();
            let shown = json["settings"]
                .as_array()
                .unwrap()
                .iter()
                .find(|s| s["key"] == "kill_grace")
                .unwrap()["value"]
                .as_str()
                .unwrap()
                .to_owned();
            millis(&shown)
        });
        if binary != module {
            differ.push(format!(
                "{value:?}: binary {binary:?} ms, module {module:?} ms"
            ));
        }
    }
    assert!(
        differ.is_empty(),
        "the module and the binary differ: {differ:#?}"
    );
}
