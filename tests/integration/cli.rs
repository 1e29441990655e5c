//! The command line: validation of every outside value, and `app-domain`.

use std::process::Command;

use rstest::rstest;

use crate::util::{Sandbox, run};

fn sha1_hex(input: &str) -> String {
    // Computed by coreutils, independently of the crate's own hashing.
    let out = Command::new("sh")
        .args(["-c", "printf '%s' \"$1\" | sha1sum", "sh", input])
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap()[..40].to_owned()
}

#[rstest]
#[case::pr(&["--recipe", "custom-html", "--pr", "12"], "cust", "custom-html|12|")]
#[case::git_ref(&["--recipe", "keycloak", "--ref", "1.0.0+1.2.3"], "keyc", "keycloak||1.0.0+1.2.3")]
#[case::both(&["--recipe", "ab-c", "--pr", "7", "--ref", "main"], "abc", "ab-c|7|main")]
#[case::neither(&["--recipe", "x"], "x", "x||")]
fn app_domain_prints_domain_then_stack(
    #[case] args: &[&str],
    #[case] prefix: &str,
    #[case] hashed: &str,
) {
    let sandbox = Sandbox::new();
    let mut cmd = sandbox.ccci();
    cmd.arg("app-domain").args(args);
    let done = run(cmd);
    done.assert_code(0);
    let hash = &sha1_hex(hashed)[..6];
    assert_eq!(
        done.out,
        vec![
            format!("{prefix}-{hash}.ci.commoninternet.net"),
            format!("{prefix}-{hash}_ci_commoninternet_net"),
        ]
    );
}

#[test]
fn app_domain_honours_the_suffix_from_the_environment() {
    let sandbox = Sandbox::new();
    let mut cmd = sandbox.ccci();
    cmd.env("CCCI_DOMAIN_SUFFIX", "ci.example.org")
        .args(["app-domain", "--recipe", "x"]);
    let done = run(cmd);
    done.assert_code(0);
    assert!(
        done.out[0].ends_with(".ci.example.org"),
        "{}",
        done.transcript()
    );
}

/// Every validation rule with a bad value: exit 2, a message naming the value and the rule,
/// and nothing left on disk.
#[rstest]
#[case::recipe_upper(&["--recipe", "Custom"], "invalid recipe name \"Custom\"")]
#[case::recipe_traversal(&["--recipe", "../../etc"], "invalid recipe name \"../../etc\"")]
#[case::recipe_long(&["--recipe", &"a".repeat(65)], "invalid recipe name")]
#[case::pr_letters(&["--recipe", "x", "--pr", "12a"], "invalid pull request number \"12a\"")]
#[case::ref_dotdot(&["--recipe", "x", "--ref", "main..evil"], "must not contain \"..\"")]
#[case::ref_space(&["--recipe", "x", "--ref", "a b"], "invalid ref \"a b\"")]
#[case::ref_dash(&["--recipe", "x", "--ref=-delete"], "must not start with \"-\"")]
#[case::run_id(&["--recipe", "x", "--run-id", "../1"], "invalid run id \"../1\"")]
#[case::run_id_long(&["--recipe", "x", "--run-id", &"1".repeat(65)], "invalid run id")]
#[case::suffix(&["--recipe", "x", "--domain-suffix", "Bad_Suffix"], "invalid domain suffix \"Bad_Suffix\"")]
#[case::suffix_long(&["--recipe", "x", "--domain-suffix", "a-very-long-ci-subdomain.example.org"], "must be at most 33 characters")]
fn bad_input_is_refused_with_exit_2_and_leaves_nothing(
    #[case] args: &[&str],
    #[case] message: &str,
) {
    let sandbox = Sandbox::new();
    let mut cmd = sandbox.ccci();
    cmd.arg("run").args(args).args(["--no-fetch", "--", "true"]);
    let done = run(cmd);
    done.assert_code(2);
    done.assert_stderr_has(message);
    assert!(
        done.stderr().contains("must"),
        "the message names the rule\n{}",
        done.transcript()
    );
    assert!(!sandbox.runs().exists(), "runs dir created");
    assert!(!sandbox.abra_home().exists(), "abra home created");
    assert!(sandbox.state_files().is_empty(), "state files created");
}

#[test]
fn drone_build_number_is_the_run_id_and_is_validated() {
    let sandbox = Sandbox::new();
    let run_with = |build: &str| {
        let mut cmd = sandbox.ccci();
        cmd.env("DRONE_BUILD_NUMBER", build).args([
            "run",
            "--recipe",
            "x",
            "--no-fetch",
            "--",
            "true",
        ]);
        run(cmd)
    };
    run_with("314").assert_code(0);
    assert_eq!(sandbox.record("314")["run_id"], "314");
    let done = run_with("bad/../id");
    done.assert_code(2);
    done.assert_stderr_has("invalid run id \"bad/../id\"");
}

#[test]
fn help_lists_the_exit_codes() {
    let sandbox = Sandbox::new();
    let mut cmd = sandbox.ccci();
    cmd.arg("--help");
    let done = run(cmd);
    done.assert_code(0);
    assert!(
        done.out.join("\n").contains("142 the hard deadline"),
        "{}",
        done.transcript()
    );
    // Every subcommand's own help ends with its exit codes.
    let subcommands = crate::shipping::subcommands();
    assert!(subcommands.len() >= 12, "{subcommands:?}");
    for sub in subcommands.iter().filter(|s| *s != "help") {
        let mut cmd = sandbox.ccci();
        cmd.args([sub.as_str(), "--help"]);
        let done = run(cmd);
        done.assert_code(0);
        // The help is wrapped to the terminal: read it as one line.
        let text = done
            .out
            .join(" ")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        assert!(
            text.contains("Exit codes: 0 ")
                || text.contains("Exit codes: the command's own status"),
            "{sub}: {text}"
        );
        assert!(
            text.contains("2 invalid input")
                || text.contains("2 a run id")
                || text.contains("2 an invalid setting"),
            "{sub}: {text}"
        );
    }
}

/// One source of configuration: flag > environment > file > default, each value's origin shown
/// by `ccci-run config`, relative paths made absolute, typos in the file refused (exit 2).
#[test]
fn config_file_precedence_origins_and_absolute_paths() {
    let sandbox = Sandbox::new();
    let file = sandbox.path().join("config.toml");
    std::fs::write(
        &file,
        "runs_dir = \"/srv/from-file\"\ndocker = \"off\"\nstate_dir = \"/srv/state\"\n",
    )
    .unwrap();
    let mut cmd = std::process::Command::new(crate::util::BIN);
    crate::util::without_ccci_env(&mut cmd);
    cmd.current_dir(sandbox.path())
        .env("CCCI_CONFIG", &file)
        .env("CCCI_STATE_DIR", "/srv/from-env")
        .args(["--lock-dir", "rel/locks", "config", "--json"]);
    let done = run(cmd);
    done.assert_code(0);
    let settings: serde_json::Value =
        serde_json::from_str::<serde_json::Value>(&done.out.join("\n")).unwrap()["settings"]
            .clone();
    let find = |key: &str| {
        settings
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["key"] == key)
            .cloned()
            .unwrap_or_else(|| panic!("{key} missing: {settings:#}"))
    };
    let lock = find("lock_dir");
    assert_eq!(lock["origin"]["kind"], "flag");
    assert_eq!(
        lock["value"],
        sandbox.path().join("rel/locks").display().to_string(),
        "relative paths are made absolute"
    );
    assert_eq!(find("state_dir")["value"], "/srv/from-env");
    assert_eq!(find("state_dir")["origin"]["kind"], "environment");
    assert_eq!(find("runs_dir")["value"], "/srv/from-file");
    assert_eq!(find("runs_dir")["origin"]["kind"], "file");
    assert_eq!(find("docker")["value"], "off");
    assert_eq!(find("domain_suffix")["origin"]["kind"], "default");

    std::fs::write(&file, "lock_dri = \"/x\"\n").unwrap();
    let mut cmd = sandbox.ccci();
    cmd.arg("--config").arg(&file).arg("config");
    let done = run(cmd);
    done.assert_code(2);
    done.assert_stderr_has("unknown field `lock_dri`");
}

/// A relative runs dir reaches the command as an absolute ABRA_DIR, so a `cd` in the command
/// cannot break it.
#[test]
fn relative_paths_reach_the_command_absolute() {
    let sandbox = Sandbox::new();
    let cmd = sandbox.run_sh(
        "relp",
        &[],
        "cd / && test -d \"$ABRA_DIR/recipes\" && echo \"$ABRA_DIR\"",
    );
    // A later flag wins: a relative --runs-dir goes in just before the command.
    let mut fixed = std::process::Command::new(cmd.get_program());
    let args: Vec<_> = cmd.get_args().map(|a| a.to_owned()).collect();
    let split = args.iter().position(|a| a == "--").unwrap();
    fixed
        .args(&args[..split])
        .args(["--runs-dir", "runs-rel"])
        .args(&args[split..])
        .current_dir(sandbox.path())
        .env("CCCI_CONFIG", "/dev/null");
    for (key, _) in std::env::vars() {
        if key.starts_with("CCCI_") && key != "CCCI_CONFIG" {
            fixed.env_remove(key);
        }
    }
    let done = run(fixed);
    done.assert_code(0);
    assert_eq!(
        done.out,
        vec![
            sandbox
                .path()
                .join("runs-rel/relp/abra")
                .display()
                .to_string()
        ]
    );
}

/// `--log-format json` makes stderr JSON only, one object per line, status lines included, and
/// every event of a run carries its id and domain.
#[test]
fn json_logs_are_json_only_and_carry_the_run() {
    let sandbox = Sandbox::new();
    let mut cmd = sandbox.ccci();
    cmd.args([
        "--log-format",
        "json",
        "-vv",
        "run",
        "--recipe",
        "custom-html",
    ])
    .args([
        "--run-id",
        "j1",
        "--no-fetch",
        "--",
        "sh",
        "-c",
        "echo out-only",
    ]);
    let done = run(cmd);
    done.assert_code(0);
    assert!(!done.err.is_empty());
    let domain = sandbox.domain("custom-html", None);
    let mut statuses = 0;
    for line in &done.err {
        let event: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {line}\n{}", done.transcript()));
        if event["fields"]["status"] == true {
            statuses += 1;
            assert_eq!(event["span"]["run_id"], "j1", "{line}");
            assert_eq!(event["span"]["domain"], domain.as_str(), "{line}");
        }
    }
    assert!(statuses >= 1, "{}", done.transcript());
}

/// Colour only for a terminal, and never with NO_COLOR; each -v shows more.
#[test]
fn colour_only_on_a_terminal_and_each_v_shows_more() {
    let sandbox = Sandbox::new();
    let lines = |v: &str| {
        let mut cmd = sandbox.ccci();
        cmd.arg(v)
            .args(["run", "--recipe", "custom-html", "--no-fetch", "--", "true"]);
        let done = run(cmd);
        done.assert_code(0);
        assert!(
            !done.err.iter().any(|l| l.contains('\u{1b}')),
            "colour in a pipe: {}",
            done.transcript()
        );
        done.err.len()
    };
    let (v1, v2, v3) = (lines("-v"), lines("-vv"), lines("-vvv"));
    assert!(v1 < v2 && v2 < v3, "-v {v1}, -vv {v2}, -vvv {v3} lines");

    // On a terminal (script(1) gives the command one): colour, unless NO_COLOR is set.
    let on_tty = |no_color: Option<&str>| {
        let ccci = sandbox.ccci();
        let mut line: Vec<String> =
            vec![crate::util::sh_quote(ccci.get_program().to_str().unwrap())];
        line.extend(
            ccci.get_args()
                .map(|a| crate::util::sh_quote(a.to_str().unwrap())),
        );
        line.push("-v app-domain --recipe x >/dev/null".to_owned());
        let mut cmd = Command::new("script");
        cmd.args(["-qec", &line.join(" "), "/dev/null"])
            .env("CCCI_CONFIG", "/dev/null")
            .env("RUST_LOG", "ccci_run=debug");
        match no_color {
            Some(v) => cmd.env("NO_COLOR", v),
            None => cmd.env_remove("NO_COLOR"),
        };
        let done = run(cmd);
        done.assert_code(0);
        done.out.join("\n")
    };
    let coloured = on_tty(None);
    assert!(
        coloured.contains('\u{1b}'),
        "no colour on a terminal: {coloured:?}"
    );
    let plain = on_tty(Some("1"));
    assert!(!plain.is_empty() && !plain.contains('\u{1b}'), "{plain:?}");
}

/// Help keeps a command's own options apart from the global ones, which a subcommand names
/// once, by reference, after its own; commands that use no global option (completions, man)
/// list none.
#[test]
fn help_separates_global_options_and_lists_only_what_a_command_uses() {
    let help = |args: &[&str]| {
        let done = run({
            let mut c = Command::new(crate::util::BIN);
            c.args(args).arg("--help");
            c
        });
        done.assert_code(0);
        done.out.join("\n")
    };
    let run_help = help(&["run"]);
    let (own, global) = run_help
        .split_once("Global options:")
        .expect("run --help has a global options heading");
    assert!(
        own.contains("--deadline") && !own.contains("--runs-dir"),
        "{run_help}"
    );
    assert!(
        global.contains("--runs-dir") && !global.contains("--deadline"),
        "{run_help}"
    );
    // By reference: one line, not each option's whole text again.
    assert!(
        !run_help.contains("Directory of the per-run directories")
            && run_help.lines().count() < 120,
        "{run_help}"
    );
    for sub in ["completions", "man"] {
        let text = help(&[sub]);
        assert!(
            !text.contains("--lock-dir") && !text.contains("Global options"),
            "{sub}: {text}"
        );
    }
    assert!(help(&["completions"]).contains("The shell to print completions for"));
    // Global options are taken before the command's name and after it.
    let sandbox = Sandbox::new();
    let mut after = Command::new(crate::util::BIN);
    after
        .env("CCCI_CONFIG", "/dev/null")
        .args(["config", "--lock-dir", "/srv/locks"]);
    let done = run(after);
    done.assert_code(0);
    assert!(
        done.out
            .iter()
            .any(|l| l.starts_with("lock_dir") && l.contains("/srv/locks") && l.ends_with("flag")),
        "{}",
        done.transcript()
    );
    drop(sandbox);
}

/// The example configuration file reads as meant, with every commented setting taken in too:
/// each run setting from the file, shown with its origin, and a flag or variable still wins.
#[test]
fn the_example_configuration_file_sets_every_run_setting() {
    let example = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("systemd/config.toml"),
    )
    .unwrap();
    let uncommented: String = example
        .lines()
        .map(|line| match line.strip_prefix("# ") {
            Some(rest) if rest.contains(" = ") && !rest.starts_with(' ') => rest.to_owned(),
            _ => line.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.toml");
    std::fs::write(&file, uncommented).unwrap();
    let mut cmd = Command::new(crate::util::BIN);
    crate::util::without_ccci_env(&mut cmd);
    cmd.arg("--config")
        .arg(&file)
        .args(["config", "--json"])
        .env("CCCI_KILL_GRACE", "3");
    let done = run(cmd);
    done.assert_code(0);
    let settings: serde_json::Value =
        serde_json::from_str::<serde_json::Value>(&done.out.join("\n")).unwrap()["settings"]
            .clone();
    let get = |key: &str| {
        settings
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["key"] == key)
            .unwrap_or_else(|| panic!("no {key} in {settings:#}"))
            .clone()
    };
    for (key, value) in [
        ("deadline", "1h"),
        ("teardown_timeout", "5m"),
        ("lock_wait", "30m"),
        ("long_held", "2h"),
        ("keep_runs", "14d"),
        ("reap_budget", "2m"),
        ("promote_after", "20m"),
        ("converge_timeout", "5m"),
        ("converge_stable", "1s"),
    ] {
        let setting = get(key);
        assert_eq!(setting["value"], value, "{setting}");
        assert_eq!(setting["origin"]["kind"], "file", "{setting}");
    }
    assert_eq!(get("kill_grace")["value"], "3s");
    assert_eq!(get("kill_grace")["origin"]["from"], "CCCI_KILL_GRACE");
    assert_eq!(
        get("recipe_url_template")["value"],
        "https://git.coopcloud.tech/coop-cloud/{recipe}.git"
    );
}

/// `run` and `lock` take their command after `--`; without it, clap's refusal (2) says where it
/// goes.
#[test]
fn a_command_without_dash_dash_is_refused_with_where_it_goes() {
    for (args, usage) in [
        (
            &["run", "--recipe", "custom-html", "sleep", "1"][..],
            "ccci-run run [OPTIONS] --recipe R -- COMMAND [ARGS]...",
        ),
        (
            &["lock", "x", "sleep", "1"][..],
            "ccci-run lock [OPTIONS] NAME -- COMMAND [ARGS]...",
        ),
    ] {
        let mut cmd = Command::new(crate::util::BIN);
        crate::util::without_ccci_env(&mut cmd);
        cmd.env("CCCI_CONFIG", "/dev/null").args(args);
        let done = run(cmd);
        done.assert_code(2);
        done.assert_stderr_has("unexpected argument 'sleep'");
        done.assert_stderr_has(&format!("tip: the command to run goes after `--`: {usage}"));
    }
}

/// `--help` wraps to the terminal's width (COLUMNS where there is no terminal): no line is
/// wider, but for a single word that is (a URL).
#[test]
fn help_wraps_to_the_terminal_width() {
    for columns in [60, 100] {
        for sub in [None, Some("run"), Some("janitor"), Some("locks")] {
            let mut cmd = Command::new(crate::util::BIN);
            cmd.env("COLUMNS", columns.to_string())
                .args(sub)
                .arg("--help");
            let done = run(cmd);
            done.assert_code(0);
            let wide: Vec<&String> = done
                .out
                .iter()
                .filter(|l| l.chars().count() > columns)
                .filter(|l| l.split_whitespace().count() > 1)
                .collect();
            assert!(wide.is_empty(), "{sub:?} at {columns} columns: {wide:#?}");
        }
    }
}
