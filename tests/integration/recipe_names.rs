//! A recipe as abra reads it, checked before anything is deployed: every name its compose files
//! give Docker within Docker's limits (measured on engine 20.10: a service or a network name at
//! most 63 characters, a secret or a config name at most 64), and the recipe where its
//! `.env.sample`'s `TYPE`/`RECIPE` says abra will look for it.

use std::path::PathBuf;

use crate::util::{Sandbox, run};

/// Stage recipe `recipe` with `files` in the sandbox's abra home, where `CCCI_SKIP_FETCH=1`
/// copies it from into each run's tree.
fn stage(sandbox: &Sandbox, recipe: &str, files: &[(&str, String)]) -> PathBuf {
    let dir = sandbox.abra_home().join("recipes").join(recipe);
    std::fs::create_dir_all(dir.join(".git")).unwrap();
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
    dir
}

/// `ccci-run run --recipe RECIPE --run-id ID` on the staged recipe, running `script`.
fn run_staged(sandbox: &Sandbox, recipe: &str, id: &str, script: &str) -> crate::util::Finished {
    let mut cmd = sandbox.ccci();
    cmd.env("CCCI_SKIP_FETCH", "1").args([
        "run", "--recipe", recipe, "--run-id", id, "--", "sh", "-c", script,
    ]);
    run(cmd)
}

/// A secret key that makes `<stack>_<key>_v1` exactly `len` characters.
fn key_for(stack: &str, len: usize) -> String {
    let n = len - stack.len() - "_".len() - "_v1".len();
    "k".repeat(n)
}

const COMPOSE: &str = "version: \"3.8\"\nservices:\n  app:\n    image: nginx\n    networks: [internal, proxy]\n    secrets: [db]\nnetworks:\n  internal: {}\n  proxy: {external: true}\nsecrets:\n  db:\n    external: true\n    name: ${STACK_NAME}_db_${SECRET_DB_VERSION}\n";

/// A secret whose name is 65 characters under the run's domain (Docker refuses it at the
/// deploy, half-way through): the run stops before its command with exit 2, naming the
/// object, its length, Docker's limit and the longest suffix the recipe allows. One character
/// less is deployed as it is.
#[test]
fn a_name_over_docker_s_limit_stops_the_run_before_its_command() {
    let sandbox = Sandbox::new();
    let domain = sandbox.domain("longsecrets", None);
    let stack = Sandbox::stack(&domain);
    for (len, code) in [(65, 2), (64, 0)] {
        let key = key_for(&stack, len);
        let compose = format!(
            "{COMPOSE}  {key}:\n    external: true\n    name: ${{STACK_NAME}}_{key}_${{SECRET_{}_VERSION}}\n",
            key.to_uppercase()
        );
        let sample = format!(
            "TYPE=longsecrets\nSECRET_DB_VERSION=v1\nSECRET_{}_VERSION=v1\n",
            key.to_uppercase()
        );
        let dir = stage(
            &sandbox,
            "longsecrets",
            &[("compose.yml", compose), (".env.sample", sample)],
        );
        // `app-domain --names-in` says the same of a checkout, before any run.
        let mut cmd = sandbox.ccci();
        cmd.args(["app-domain", "--recipe", "longsecrets", "--names-in"])
            .arg(&dir);
        let shown = run(cmd);
        shown.assert_code(if code == 2 { 1 } else { 0 });
        let allows = sandbox.suffix().len() - if code == 2 { 1 } else { 0 };
        assert_eq!(
            shown.out[2],
            format!(
                "longest domain suffix: {allows} (this one: {})",
                sandbox.suffix().len()
            )
        );
        assert_eq!(
            shown.out.iter().any(|l| l.starts_with("over: secret ")),
            code == 2,
            "{}",
            shown.transcript()
        );
        // A failure says so on stderr, under the one prefix.
        assert_eq!(
            shown.stderr().contains("ccci-run: error: app-domain: "),
            code == 2,
            "{}",
            shown.transcript()
        );
        let marker = sandbox.path().join(format!("ran-{len}"));
        let id = format!("ls{len}");
        let done = run_staged(
            &sandbox,
            "longsecrets",
            &id,
            &format!("touch {}", marker.display()),
        );
        done.assert_code(code);
        if code == 2 {
            done.assert_stderr_has(&format!(
                "recipe longsecrets: secret {stack}_{key}_v1 (compose.yml, key {key}) is 65 \
                 characters: Docker refuses a secret name over 64"
            ));
            // 64 - len("_<key>_v1") - len("long-hhhhhh_"): one character short of this suffix.
            let allows = sandbox.suffix().len() - 1;
            done.assert_stderr_has(&format!(
                "the longest suffix this recipe allows is {allows} characters"
            ));
            done.assert_stderr_has("nothing was deployed");
            assert!(!marker.exists(), "the command ran");
            let record = sandbox.record(&id);
            assert_eq!(record["exit_code"], 2, "{record:#}");
        } else {
            assert!(marker.exists(), "{}", done.transcript());
        }
    }
}

/// The same name in an optional compose file (`compose.s3.yml`, enabled only by an app's
/// `COMPOSE_FILE`) is a warning naming the file, and the run goes on; once `.env.sample`'s
/// `COMPOSE_FILE` names that file, it stops the run.
#[test]
fn an_optional_compose_file_warns_until_compose_file_names_it() {
    let sandbox = Sandbox::new();
    let domain = sandbox.domain("optional", None);
    let stack = Sandbox::stack(&domain);
    let key = key_for(&stack, 65);
    let s3 = format!(
        "version: \"3.8\"\nservices:\n  app:\n    secrets: [{key}]\nsecrets:\n  {key}:\n    external: true\n    name: ${{STACK_NAME}}_{key}_v1\n"
    );
    let files = |compose_file: &str| {
        vec![
            ("compose.yml", COMPOSE.to_owned()),
            ("compose.s3.yml", s3.clone()),
            (
                ".env.sample",
                format!("TYPE=optional\nSECRET_DB_VERSION=v1\n{compose_file}"),
            ),
        ]
    };
    stage(
        &sandbox,
        "optional",
        &files("#COMPOSE_FILE=\"compose.yml:compose.s3.yml\"\n"),
    );
    let done = run_staged(&sandbox, "optional", "op1", "echo ran");
    done.assert_code(0);
    done.assert_stderr_has(&format!(
        "warning: recipe optional: secret {stack}_{key}_v1 (compose.s3.yml, key {key}) is 65 characters"
    ));
    done.assert_stderr_has("should an app's COMPOSE_FILE name compose.s3.yml");
    assert!(done.out.contains(&"ran".to_owned()));

    stage(
        &sandbox,
        "optional",
        &files("COMPOSE_FILE=\"compose.yml:compose.s3.yml\"\n"),
    );
    let done = run_staged(&sandbox, "optional", "op2", "echo ran");
    done.assert_code(2);
    done.assert_stderr_has("(compose.s3.yml, key");
    assert!(!done.out.contains(&"ran".to_owned()));
}

/// An older recipe's `.env.sample` names it by another name (`TYPE=<name>:<version>`), and abra
/// looks for the recipe there: the run's tree has it under that name too. A name abra could not
/// look up is refused (2).
#[test]
fn the_recipe_is_where_its_env_sample_says_abra_will_look() {
    let sandbox = Sandbox::new();
    stage(
        &sandbox,
        "newname",
        &[
            ("compose.yml", COMPOSE.to_owned()),
            (
                ".env.sample",
                "TYPE=oldname:1.2.0+1.25\nSECRET_DB_VERSION=v1\n".to_owned(),
            ),
        ],
    );
    let done = run_staged(
        &sandbox,
        "newname",
        "nm1",
        "test -f \"$ABRA_DIR/recipes/oldname/compose.yml\" && echo found",
    );
    done.assert_code(0);
    assert!(
        done.out.contains(&"found".to_owned()),
        "{}",
        done.transcript()
    );
    done.assert_stderr_has("its .env.sample names it oldname (RECIPE/TYPE), where abra looks");

    stage(
        &sandbox,
        "newname",
        &[(".env.sample", "RECIPE=../elsewhere\n".to_owned())],
    );
    let done = run_staged(&sandbox, "newname", "nm2", "echo ran");
    done.assert_code(2);
    done.assert_stderr_has("which is no recipe name abra could look up");
    assert!(!done.out.contains(&"ran".to_owned()));
}

/// The limits the check holds recipes to are the engine's own: on the real engine, a name at
/// each limit is taken and one character more is refused, for every kind the check knows.
#[test]
fn the_limits_checked_are_the_engine_s_own() {
    let Some(sandbox) = Sandbox::with_docker() else {
        return;
    };
    let file = sandbox.path().join("x.txt");
    std::fs::write(&file, "x\n").unwrap();
    let file = file.to_str().unwrap();
    let tag = format!("lim{}", std::process::id());
    let name = |len: usize| format!("{tag}{}", "a".repeat(len - tag.len()));
    let attempt = |args: &[&str]| {
        std::process::Command::new("docker")
            .args(args)
            .output()
            .unwrap()
            .status
            .success()
    };
    for (kind, limit, create, remove) in [
        ("secret", 64, vec!["secret", "create"], vec!["secret", "rm"]),
        ("config", 64, vec!["config", "create"], vec!["config", "rm"]),
        (
            "network",
            63,
            vec!["network", "create", "-d", "overlay"],
            vec!["network", "rm"],
        ),
        (
            "service",
            63,
            vec!["service", "create", "--detach", "--name"],
            vec!["service", "rm"],
        ),
    ] {
        for (len, ok) in [(limit, true), (limit + 1, false)] {
            let n = name(len);
            let mut args = create.clone();
            args.push(&n);
            match kind {
                "secret" | "config" => args.push(file),
                "service" => args.extend(["ccci-test/busybox:latest", "sleep", "60"]),
                _ => {}
            }
            let created = attempt(&args);
            let mut rm = remove.clone();
            rm.push(&n);
            let _ = attempt(&rm);
            assert_eq!(created, ok, "a {kind} name of {len} characters");
        }
    }
}
