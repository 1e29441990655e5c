//! The per-run ABRA_DIR, the same-run-id guard, run-scoped state files and descriptor hygiene.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;

use crate::util::{Proc, Sandbox, Stream, list, run};

#[test]
fn abra_dir_links_the_canonical_servers_and_catalogue_and_has_empty_recipes() {
    let sandbox = Sandbox::new();
    let script = "echo \"abra=$ABRA_DIR\"; echo \"recipe_dir=$CCCI_RECIPE_DIR\"; \
                  echo \"domain=$CCCI_APP_DOMAIN\"; echo \"stack=$CCCI_STACK_NAME\"; \
                  echo \"recipe=$CCCI_RECIPE\"; echo \"run=$CCCI_RUN_ID\"; \
                  ls -A \"$ABRA_DIR/recipes\" | wc -l | sed 's/^/recipes=/'";
    let done = run(sandbox.run_sh("30", &[], script));
    done.assert_code(0);
    let abra = sandbox.runs().join("30").join("abra");
    let expect = [
        format!("abra={}", abra.display()),
        format!("recipe_dir={}", abra.join("recipes/custom-html").display()),
        "recipe=custom-html".to_owned(),
        "run=30".to_owned(),
        "recipes=0".to_owned(),
    ];
    for line in &expect {
        assert!(
            done.out.contains(line),
            "missing {line}\n{}",
            done.transcript()
        );
    }
    for shared in ["servers", "catalogue"] {
        let target = std::fs::read_link(abra.join(shared)).unwrap();
        assert_eq!(target, sandbox.abra_home().join(shared));
        assert!(
            target.is_dir(),
            "canonical {shared} must exist so the link never dangles"
        );
    }
}

#[test]
fn second_live_run_with_the_same_id_is_refused_and_reuse_after_the_end_is_fresh() {
    let sandbox = Sandbox::new();
    let first_script = "touch \"$ABRA_DIR/recipes/marker\"; echo ready $$; read line || :";
    let mut first = Proc::spawn(sandbox.run_sh("dup", &[], first_script));
    first.wait_ready();
    let marker = sandbox.runs().join("dup/abra/recipes/marker");

    let second = run(sandbox.run_sh("dup", &[], "echo second-ran"));
    second.assert_code(125);
    second.assert_stderr_has("run dup is already live");
    assert!(!second.out.iter().any(|l| l == "second-ran"));
    assert!(marker.exists(), "the live run's tree was wiped");

    first.close_stdin();
    first.finish().assert_code(0);

    let third = run(sandbox.run_sh("dup", &[], "ls -A \"$ABRA_DIR/recipes\"; echo third-ran"));
    third.assert_code(0);
    assert_eq!(
        third.out,
        vec!["third-ran"],
        "a reused run dir starts fresh"
    );
}

#[test]
fn state_files_are_private_and_keyed_by_run_id_and_pid_not_domain() {
    let sandbox = Sandbox::new();
    let script = "for f in \"$CCCI_DEPLOYS_FILE\" \"$CCCI_OPSTATE_FILE\" \"$CCCI_DEPS_FILE\" \
                  \"$CCCI_DEPSKIP_FILE\"; do echo \"state $(stat -c %a \"$f\") $f\"; done; \
                  echo ready $PPID; read line || :";
    // Two live runs of the same recipe (different pull requests, so they run side by side).
    let mut a = Proc::spawn(sandbox.run_sh("40", &["--pr", "1"], script));
    let mut b = Proc::spawn(sandbox.run_sh("41", &["--pr", "2"], script));
    let pid_a = a.wait_ready();
    let pid_b = b.wait_ready();
    let states = |p: &Proc| -> Vec<String> {
        p.out
            .iter()
            .filter(|l| l.starts_with("state "))
            .cloned()
            .collect()
    };
    let state_dir = sandbox.state();
    let scope = sandbox.scope();
    for (proc_, run_id, pid) in [(&a, "40", pid_a), (&b, "41", pid_b)] {
        let lines = states(proc_);
        assert_eq!(lines.len(), 4, "{lines:?}");
        for (line, kind) in lines.iter().zip(["deploys", "opstate", "deps", "depskip"]) {
            let path = state_dir.join(format!("ccci-{kind}-{scope}-{run_id}-{pid}"));
            assert_eq!(line, &format!("state 600 {}", path.display()));
        }
    }
    assert_eq!(list(&state_dir).len(), 8);
    a.close_stdin();
    b.close_stdin();
    a.finish().assert_code(0);
    b.finish().assert_code(0);
    assert!(list(&state_dir).is_empty(), "{:?}", list(&state_dir));
}

/// The command gets stdin, stdout and stderr only: neither ccci-run's own descriptors (run
/// guard lock, signal pipe) nor a descriptor ccci-run's parent leaked to it.
#[test]
fn command_inherits_no_descriptor_beyond_stdio() {
    let sandbox = Sandbox::new();
    let leak = std::fs::File::open("/dev/null").unwrap();
    // `ls` lists the shell's table from outside; a command substitution would add its own pipe.
    let script = "echo ready $$; echo fds-begin; ls /proc/$$/fd; echo fds-done; ls -l /proc/$$/fd";
    let mut cmd = sandbox.run_sh("50", &[], script);
    // Hand ccci-run an inheritable descriptor 7, as a sloppy parent might.
    let raw = std::os::fd::AsRawFd::as_raw_fd(&leak);
    unsafe {
        cmd.pre_exec(move || {
            if nix::libc::dup2(raw, 7) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut proc_ = Proc::spawn(cmd);
    proc_.wait_ready();
    proc_.wait_for(Stream::Out, "fds-done");
    let done = proc_.finish();
    done.assert_code(0);
    let begin = done.out.iter().position(|l| l == "fds-begin").unwrap();
    let end = done.out.iter().position(|l| l == "fds-done").unwrap();
    assert_eq!(
        done.out[begin + 1..end],
        ["0", "1", "2"],
        "descriptors\n{}",
        done.transcript()
    );
}

#[test]
fn run_record_is_complete_and_readable() {
    let sandbox = Sandbox::new();
    let done = run(sandbox.run_sh("60", &["--pr", "9"], "exit 0"));
    done.assert_code(0);
    let record = sandbox.record("60");
    assert_eq!(record["run_id"], "60");
    assert_eq!(record["recipe"], "custom-html");
    assert_eq!(record["pr"], "9");
    assert!(record["domain"].as_str().unwrap().starts_with("cust-"));
    let phases: Vec<&str> = record["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        phases,
        [
            "guards",
            "abra-dir",
            "fetch-skipped",
            "janitor",
            "app-lock",
            "command",
            "teardown",
            "finished"
        ]
    );
    let run_dir = sandbox.runs().join("60");
    assert_eq!(
        list(&run_dir),
        ["abra", "run.json", "run.lock"],
        "no temp files left"
    );
    let mode = std::fs::metadata(run_dir.join("run.lock"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn teardown_removes_the_app_env_files_but_no_other_app_s() {
    let sandbox = Sandbox::new();
    let domain = {
        let mut cmd = sandbox.ccci();
        cmd.args(["app-domain", "--recipe", "custom-html"]);
        run(cmd).out[0].clone()
    };
    let server = sandbox.abra_home().join("servers/ci-host");
    std::fs::create_dir_all(&server).unwrap();
    let other = server.join("warm-keycloak.ci.commoninternet.net.env");
    std::fs::write(&other, "KEEP=1\n").unwrap();
    let script = "echo X=1 > \"$ABRA_DIR/servers/ci-host/$CCCI_APP_DOMAIN.env\"; echo created";
    let done = run(sandbox.run_sh("70", &[], script));
    done.assert_code(0);
    assert!(!server.join(format!("{domain}.env")).exists());
    assert!(other.exists());

    // --no-teardown keeps the app for the next janitor sweep.
    let done = run(sandbox.run_sh("71", &["--no-teardown"], script));
    done.assert_code(0);
    assert!(server.join(format!("{domain}.env")).exists());
}

/// `janitor --keep-runs` racing runs that are starting in directories that look old: retention
/// never deletes a directory a run is creating or about to take, and a run is never refused
/// because a janitor's probe held its guard for a moment. Ids repeat, so a new run takes the
/// directory of a finished one; every record is aged past the period kept as fast as it can be,
/// so the janitors judge each directory old, whether its run has finished or is just starting.
#[test]
fn retention_racing_starting_runs_never_refuses_or_wipes_them() {
    let sandbox = crate::util::Sandbox::new();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ager = {
        let runs = sandbox.runs();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut aged = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                for entry in std::fs::read_dir(&runs).into_iter().flatten().flatten() {
                    for path in [entry.path().join("run.json"), entry.path()] {
                        let file = std::fs::File::options().read(true).open(&path);
                        let old =
                            std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
                        if file.and_then(|f| f.set_modified(old)).is_ok() {
                            aged += 1;
                        }
                    }
                }
                std::thread::yield_now();
            }
            aged
        })
    };
    let janitors: Vec<_> = (0..2)
        .map(|_| {
            let mut cmd = sandbox.ccci();
            cmd.args(["janitor", "--keep-runs", "1h"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null());
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut sweeps = 0;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    cmd.status().unwrap();
                    sweeps += 1;
                }
                sweeps
            })
        })
        .collect();
    for wave in 0..10 {
        let runs: Vec<_> = (0..8)
            .map(|i| {
                // Ids repeat across waves: a later run reuses a directory retention may be
                // removing right now.
                let id = format!("ret-{}", (wave * 8 + i) % 12);
                crate::util::Proc::spawn(sandbox.run_sh(&id, &[], "test -d \"$ABRA_DIR/recipes\""))
            })
            .collect();
        for run in runs {
            let done = run.finish();
            done.assert_code(0);
        }
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let sweeps: usize = janitors.into_iter().map(|j| j.join().unwrap()).sum();
    assert!(sweeps > 0);
    assert!(ager.join().unwrap() > 0);
}

/// One runner serves many repositories, each numbering its builds from 1: two repositories'
/// build 120 run side by side, each in its own directory with its own record, and a given run
/// id already used by another repository's run is refused naming both, live or not.
#[test]
fn two_repositories_builds_of_one_number_each_keep_their_own_run() {
    let sandbox = Sandbox::new();
    let step = |recipe: &str, drone: &[(&str, &str)], run_id: Option<&str>, script: &str| {
        let mut cmd = sandbox.ccci();
        cmd.args(["run", "--recipe", recipe, "--no-fetch"]);
        if let Some(id) = run_id {
            cmd.args(["--run-id", id]);
        }
        cmd.args(["--", "sh", "-c", script])
            .envs(drone.iter().copied());
        cmd
    };
    let live = "echo \"run=$CCCI_RUN_ID\"; echo ready $$; read line || :";
    let html = [
        ("DRONE_REPO", "coop-cloud/custom-html"),
        ("DRONE_BUILD_NUMBER", "120"),
    ];
    // The other form a step may have: owner and name apart.
    let lemp = [
        ("DRONE_REPO_OWNER", "coop-cloud"),
        ("DRONE_REPO_NAME", "lemp"),
        ("DRONE_BUILD_NUMBER", "120"),
    ];
    let mut a = Proc::spawn(step("custom-html", &html, None, live));
    let mut b = Proc::spawn(step("lemp", &lemp, None, live));
    a.wait_ready();
    b.wait_ready();
    assert!(
        a.out.iter().any(|l| l == "run=coop-cloud.custom-html.120"),
        "{:?}",
        a.out
    );
    assert!(
        b.out.iter().any(|l| l == "run=coop-cloud.lemp.120"),
        "{:?}",
        b.out
    );
    let ccci = |args: &[&str]| {
        let mut cmd = sandbox.ccci();
        cmd.args(args);
        run(cmd)
    };
    let listed = ccci(&["runs", "--json"]);
    listed.assert_code(0);
    let json: serde_json::Value = serde_json::from_str(&listed.out.join("\n")).unwrap();
    let runs = json["runs"].as_array().unwrap();
    let repos: Vec<(&str, &str, &str)> = runs
        .iter()
        .map(|r| {
            (
                r["run_id"].as_str().unwrap(),
                r["repo"].as_str().unwrap(),
                r["state"].as_str().unwrap(),
            )
        })
        .collect();
    assert!(
        repos.contains(&(
            "coop-cloud.custom-html.120",
            "coop-cloud/custom-html",
            "live"
        )) && repos.contains(&("coop-cloud.lemp.120", "coop-cloud/lemp", "live")),
        "{repos:?}"
    );
    let one = ccci(&["runs", "coop-cloud.lemp.120"]);
    assert!(
        one.out
            .iter()
            .any(|l| l.starts_with("repo") && l.ends_with("coop-cloud/lemp")),
        "{}",
        one.transcript()
    );
    a.close_stdin();
    b.close_stdin();
    a.finish().assert_code(0);
    b.finish().assert_code(0);

    // A later build of lemp with that number (a rerun by hand) replaces lemp's record only.
    run(step("lemp", &lemp, None, "echo again")).assert_code(0);
    let html_record = sandbox.record("coop-cloud.custom-html.120");
    assert_eq!(html_record["repo"], "coop-cloud/custom-html");
    assert_eq!(html_record["recipe"], "custom-html");
    assert_eq!(sandbox.record("coop-cloud.lemp.120")["recipe"], "lemp");

    // One --run-id given to two repositories' runs: refused while the first is live, naming
    // both, and after it ended too; the first keeps its record.
    let mut first = Proc::spawn(step("custom-html", &html, Some("shared"), live));
    first.wait_ready();
    let second = run(step("lemp", &lemp, Some("shared"), "echo second-ran"));
    second.assert_code(125);
    second.assert_stderr_has("run shared is already live (repository coop-cloud/custom-html");
    second.assert_stderr_has("this run (repository coop-cloud/lemp, recipe lemp)");
    first.close_stdin();
    first.finish().assert_code(0);
    let later = run(step("lemp", &lemp, Some("shared"), "echo later-ran"));
    later.assert_code(125);
    later.assert_stderr_has(
        "keeps the record of another repository's run (repository coop-cloud/custom-html",
    );
    assert!(!later.out.iter().any(|l| l == "later-ran"));
    let kept = sandbox.record("shared");
    assert_eq!(kept["repo"], "coop-cloud/custom-html");
    assert_eq!(kept["exit_code"], 0);
}
