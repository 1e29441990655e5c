//! A run's life is bounded on a real host: the runner's real cancel (SIGKILL to its own step
//! shell), systemd stopping the runner, a teardown hook that hangs, the supervisor itself
//! SIGKILLed with a command that daemonised, `--tie-to`, and signals that would otherwise end
//! the supervisor without a teardown.
//!
//! The stand-ins do what their real counterparts do, not what we would like them to do: the
//! step is the pipeline's own `.drone.yml` commands written out as drone-runner-exec writes them
//! and started as `/bin/sh -e FILE` from the checkout; only that shell's pid is killed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use nix::sys::signal::Signal;
use serde_json::Value;

use crate::docker::{Cleanup, assert_gone_now, compose_file};
use crate::util::{BIN, Proc, Sandbox, Stream, process_alive, run, sh_quote, signal, wait_exited};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The `commands` of the pipeline's step, as `.drone.yml` lists them.
fn drone_step_commands() -> Vec<String> {
    let yml = std::fs::read_to_string(repo().join(".drone.yml")).unwrap();
    let mut commands = Vec::new();
    let mut inside: Option<usize> = None;
    for line in yml.lines() {
        let indent = line.len() - line.trim_start().len();
        let text = line.trim();
        match inside {
            None if text == "commands:" => inside = Some(indent),
            Some(base) if !text.is_empty() && !text.starts_with('#') => {
                if indent <= base {
                    break;
                }
                if let Some(command) = text.strip_prefix("- ") {
                    commands.push(command.to_owned());
                }
            }
            _ => {}
        }
    }
    assert!(!commands.is_empty(), "no step commands in .drone.yml");
    commands
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

/// An `abra` stand-in on PATH: `app new` writes the app's `.env`; `app deploy` deploys the
/// stack (when the sandbox uses Docker), starts a daemon that leaves the process group and
/// session, prints `deploying <pid>` and then "deploys" for a long time.
fn abra_stand_in(sandbox: &Sandbox) -> PathBuf {
    let bin = sandbox.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let abra = bin.join("abra");
    std::fs::write(
        &abra,
        r#"#!/bin/sh
set -eu
case "$1 $2" in
"app new")
  shift 3; server=default; domain=
  while [ $# -gt 0 ]; do
    case "$1" in --server) server=$2; shift ;; --domain) domain=$2; shift ;; esac
    shift
  done
  mkdir -p "$ABRA_DIR/servers/$server"
  echo "TYPE=$CCCI_RECIPE" > "$ABRA_DIR/servers/$server/$domain.env" ;;
"app deploy")
  if [ -n "${STANDIN_COMPOSE:-}" ]; then
    docker stack deploy --resolve-image never -c "$STANDIN_COMPOSE" "$CCCI_STACK_NAME" >&2
  fi
  setsid sh -c 'echo "daemon $$"; exec sleep 100000' </dev/null &
  echo "deploying $$"
  exec sleep 100000 ;;
*) ;;
esac
"#,
    )
    .unwrap();
    let mut perms = std::fs::metadata(&abra).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&abra, perms).unwrap();
    bin
}

/// The step as the runner starts it: the pipeline's commands in a script file in the
/// workspace, `/bin/sh -e FILE` with the checkout as working directory and the step's
/// environment (this sandbox's directories, the built binary, the abra stand-in).
fn runner_step(sandbox: &Sandbox, build: &str, docker: bool) -> Command {
    let script = sandbox.path().join(format!("drone-step-{build}"));
    std::fs::write(&script, runner_script(&drone_step_commands())).unwrap();
    let bin = abra_stand_in(sandbox);
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-e")
        .arg(&script)
        .current_dir(repo())
        .env("PATH", path)
        .env("CCCI_BIN", BIN)
        .env("DRONE_REPO_NAME", "custom-html")
        .env("DRONE_PULL_REQUEST", build)
        .env("DRONE_BUILD_NUMBER", build)
        .env("CCCI_RUNS_DIR", sandbox.runs())
        .env("CCCI_ABRA_HOME", sandbox.abra_home())
        .env("CCCI_APP_LOCK_DIR", sandbox.locks())
        .env("CCCI_STATE_DIR", sandbox.state())
        .env("CCCI_DOMAIN_SUFFIX", sandbox.suffix())
        .env("CCCI_DOCKER", if docker { "auto" } else { "off" })
        .env("CCCI_SKIP_FETCH", "1")
        .env_remove("CCCI_TIE_TO")
        .env_remove("RUST_LOG");
    if docker {
        cmd.env("STANDIN_COMPOSE", compose_file(sandbox.path()));
    }
    // The staged recipe that CCCI_SKIP_FETCH copies.
    std::fs::create_dir_all(sandbox.abra_home().join("recipes/custom-html/.git")).unwrap();
    cmd
}

/// A Docker sandbox when an engine answers, else a plain one (outside CI).
fn sandbox_maybe_docker() -> (Sandbox, bool) {
    match Sandbox::with_docker() {
        Some(sandbox) => (sandbox, true),
        None => (Sandbox::new(), false),
    }
}

/// Read stdout until a line `<prefix><pid>` has come for every prefix, in whatever order the
/// processes printed them; returns the pids in the order of `prefixes`.
fn pids_by_prefix(proc: &mut Proc, prefixes: &[&str]) -> Vec<i32> {
    let mut found: Vec<Option<i32>> = vec![None; prefixes.len()];
    while found.iter().any(Option::is_none) {
        let line = proc.wait_for(Stream::Out, "");
        for (slot, prefix) in found.iter_mut().zip(prefixes) {
            if let Some(pid) = line
                .strip_prefix(prefix)
                .and_then(|p| p.trim().parse().ok())
            {
                *slot = Some(pid);
            }
        }
    }
    found.into_iter().map(Option::unwrap).collect()
}

/// The pids a step's stand-in reported: the deploying `abra` and its daemon.
fn stand_in_pids(step: &mut Proc) -> (i32, i32) {
    let pids = pids_by_prefix(step, &["deploying ", "daemon "]);
    (pids[0], pids[1])
}

/// After a step was stopped: every process of the run gone, the app removed, the lock free,
/// the record finished.
#[track_caller]
fn assert_nothing_of_the_run_left(
    sandbox: &Sandbox,
    build: &str,
    pids: &[i32],
    docker: bool,
) -> Value {
    for pid in pids {
        assert!(wait_exited(*pid), "process {pid} of the run outlived it");
    }
    let record = sandbox.record(build);
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
    let lock = sandbox.lock_file(&domain);
    if lock.exists() {
        let free = Command::new("flock")
            .args(["-n"])
            .arg(&lock)
            .arg("true")
            .status()
            .unwrap();
        assert!(free.success(), "the app lock is still held");
    }
    if docker {
        assert_gone_now(record["stack"].as_str().unwrap());
    }
    if let Some(cgroup) = record["cgroup"].as_str() {
        assert!(!Path::new(cgroup).exists(), "cgroup {cgroup} was left");
    }
    assert!(sandbox.state_files().is_empty());
    record
}

/// Drone's real cancel: SIGKILL to the runner's own step shell, nothing else. The run is tied
/// to that shell (CCCI_TIE_TO=$$ in the pipeline), so its teardown runs at once: the deploying
/// stand-in, its daemon and the app are gone, the lock free, the record finished.
#[test]
fn runner_sigkill_of_the_step_shell_tears_the_run_down() {
    let (sandbox, docker) = sandbox_maybe_docker();
    let mut step = Proc::spawn(runner_step(&sandbox, "93", docker));
    let (deploying, daemon) = stand_in_pids(&mut step);
    let record = sandbox.record("93");
    let _cleanup = Cleanup(record["stack"].as_str().unwrap().to_owned());
    let supervisor = record["pid"].as_i64().unwrap() as i32;
    assert_eq!(
        record["tied_to"].as_i64(),
        Some(i64::from(step.pid())),
        "the run must be tied to the runner's step shell"
    );
    let killed = Instant::now();
    signal(step.pid(), Signal::SIGKILL);
    // The build log (our pipe) ends only when every process that held it is gone.
    let done = step.finish();
    eprintln!(
        "runner SIGKILL to nothing of the run left: {:?}",
        killed.elapsed()
    );
    done.assert_stderr_has("== tied process exited (--tie-to) — tearing down ==");
    let record =
        assert_nothing_of_the_run_left(&sandbox, "93", &[supervisor, deploying, daemon], docker);
    assert_eq!(record["shutdown_reason"], "tied-pid-died");
    assert_eq!(record["exit_code"], 143);
}

/// systemd stopping the runner's unit: SIGTERM to every process of its cgroup, SIGKILL after a
/// window. The run tears down inside the window on its own; the KILL finds nothing left.
#[test]
fn systemd_stop_of_the_runner_unit_tears_the_run_down_within_the_window() {
    let Some(unit) = crate::util::TestCgroup::create("runner-unit") else {
        return;
    };
    let (sandbox, docker) = sandbox_maybe_docker();
    let mut cmd = runner_step(&sandbox, "94", docker);
    unit.place(&mut cmd);
    let mut step = Proc::spawn(cmd);
    let (deploying, daemon) = stand_in_pids(&mut step);
    let record = sandbox.record("94");
    let _cleanup = Cleanup(record["stack"].as_str().unwrap().to_owned());
    let supervisor = record["pid"].as_i64().unwrap() as i32;
    // KillMode=control-group: every process of the unit, sub-cgroups included, gets SIGTERM.
    unit.signal_all(Signal::SIGTERM);
    let emptied_by_itself = unit.wait_empty(crate::util::PATIENCE);
    if !emptied_by_itself {
        unit.kill();
    }
    let done = step.finish();
    assert!(
        emptied_by_itself,
        "the run was still tearing down when the stop window closed\n{}",
        done.transcript()
    );
    done.assert_stderr_has("== SIGTERM received — tearing down ==");
    let record =
        assert_nothing_of_the_run_left(&sandbox, "94", &[supervisor, deploying, daemon], docker);
    assert_eq!(record["exit_code"], 143);
}

/// A teardown hook that hangs can never make a run immortal: it is killed when its share of
/// `--teardown-timeout` runs out, the app is still removed, the lock released, and the record
/// says `teardown-timeout`. Signals meanwhile are ignored and never extend it.
#[test]
fn hanging_teardown_hook_is_killed_and_the_run_ends_within_its_bound() {
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.abra_home().join("servers/ci")).unwrap();
    let hook_pid = sandbox.path().join("hook-pid");
    let hook = format!(
        "echo $$ > {}; echo hook-started >&2; setsid sleep 100000 & exec sleep 100000",
        sh_quote(&hook_pid)
    );
    let script =
        "echo x > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\"; echo ready $$; exec sleep 100000";
    let mut cmd = sandbox.run_sh(
        "hh",
        &[
            "--deadline",
            "2",
            "--kill-grace",
            "1",
            "--teardown-timeout",
            "4",
            "--on-teardown",
            &hook,
        ],
        script,
    );
    cmd.env_remove("CCCI_TIE_TO");
    let mut proc = Proc::spawn(cmd);
    proc.wait_ready();
    proc.wait_for(Stream::Err, "hook-started");
    // A signal during teardown is reported and ignored.
    signal(proc.pid(), Signal::SIGTERM);
    let hook = std::fs::read_to_string(&hook_pid).unwrap();
    let hook: i32 = hook.trim().parse().unwrap();
    let done = proc.finish();
    done.assert_code(142);
    done.assert_stderr_has("== SIGTERM received during teardown — ignored ==");
    done.assert_stderr_has("--on-teardown command killed");
    assert!(!process_alive(hook));
    let record = sandbox.record("hh");
    assert_eq!(record["shutdown_reason"], "teardown-timeout");
    assert!(
        record["teardown_errors"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e.as_str().unwrap().contains("--on-teardown")),
        "{record:#}"
    );
    let domain = record["domain"].as_str().unwrap();
    assert!(
        !sandbox
            .abra_home()
            .join(format!("servers/ci/{domain}.env"))
            .exists(),
        "the app must still be removed after the hook was killed"
    );
    let free = Command::new("flock")
        .arg("-n")
        .arg(sandbox.lock_file(domain))
        .arg("true")
        .status()
        .unwrap();
    assert!(free.success(), "the app lock must be free");
}

/// The supervisor itself SIGKILLed (as the OOM killer does) while its command has daemonised:
/// the daemon, a double-forked child and a plain background child outlive it, and the next
/// janitor sweep kills every one of them before it reaps the app.
#[rstest::rstest]
#[case::cgroup("auto")]
#[case::fallback("off")]
fn supervisor_sigkill_leaves_nothing_after_the_next_sweep(#[case] cgroup: &str) {
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.abra_home().join("servers/ci")).unwrap();
    let script = "echo x > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\"; \
        setsid sh -c 'echo daemon $$; exec sleep 100000' & \
        (sh -c 'echo orphan $$; exec sleep 100000' &) ; \
        sleep 100000 & echo child $!; \
        echo ready $$; exec sleep 100000";
    let mut cmd = sandbox.run_sh("oom", &[], script);
    cmd.env("CCCI_CGROUP", cgroup);
    let mut proc = Proc::spawn(cmd);
    let pids = pids_by_prefix(&mut proc, &["daemon ", "orphan ", "child ", "ready "]);
    let supervisor = proc.pid();
    signal(supervisor, Signal::SIGKILL);
    assert!(wait_exited(supervisor));
    // What the real world does: these outlive a supervisor that had no chance to tear down.
    // (Not asserted: any janitor on the host, another test's too, may kill them from now on.)
    let survivors: Vec<i32> = pids.iter().copied().filter(|p| process_alive(*p)).collect();
    eprintln!("outlived the SIGKILLed supervisor: {survivors:?}");
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    for pid in &pids {
        assert!(
            !process_alive(*pid),
            "process {pid} survived the sweep\n{report:#}"
        );
    }
    let domain = sandbox.domain("custom-html", None);
    assert_eq!(
        crate::util::candidate(&report, &domain)["decision"],
        "reap",
        "{report:#}"
    );
    drop(proc);
}

/// The janitor unit keeps two capabilities, CAP_KILL and CAP_DAC_OVERRIDE: enough to kill a
/// dead run's daemonised processes, remove its cgroup (here right below the hierarchy's root,
/// whose directory mode lets only that capability in) and reap its app.
#[test]
fn a_janitor_with_the_unit_s_capabilities_still_cleans_up_after_a_sigkilled_supervisor() {
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.abra_home().join("servers/ci")).unwrap();
    let script = "echo x > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\"; \
        setsid sh -c 'echo daemon $$; exec sleep 100000' & \
        echo ready $$; exec sleep 100000";
    let mut proc = Proc::spawn(sandbox.run_sh("capkill", &[], script));
    let pids = pids_by_prefix(&mut proc, &["daemon ", "ready "]);
    let supervisor = proc.pid();
    signal(supervisor, Signal::SIGKILL);
    assert!(wait_exited(supervisor));
    let ccci = sandbox.ccci();
    let mut cmd = Command::new("setpriv");
    cmd.args([
        "--bounding-set=-all,+kill,+dac_override",
        "--inh-caps=-all",
        "--",
    ])
    .arg(ccci.get_program())
    .args(ccci.get_args())
    .args(["janitor", "--json"])
    .env("CCCI_CONFIG", "/dev/null");
    let done = crate::util::run(cmd);
    let report: serde_json::Value = serde_json::from_str(&done.out.join("\n")).unwrap();
    done.assert_code(0);
    for pid in &pids {
        assert!(!process_alive(*pid), "process {pid} survived\n{report:#}");
    }
    let domain = sandbox.domain("custom-html", None);
    assert_eq!(
        crate::util::candidate(&report, &domain)["decision"],
        "reap",
        "{report:#}"
    );
    assert!(
        report["dead_cgroups"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["error"].is_null()),
        "{report:#}"
    );
    drop(proc);
}

/// `--tie-to` ties a run to an ancestor further up than its parent: when that process exits,
/// the run tears down (`tied-pid-died`), even though its own parent lives on.
#[test]
fn tie_to_an_ancestor_tears_down_when_it_exits() {
    let sandbox = Sandbox::new();
    let ccci = sandbox.run_sh(
        "tie",
        &["--tie-to", "TIED"],
        "echo ready $$; exec sleep 100000",
    );
    // outer (tied) -> inner sh (stays) -> ccci-run
    let inner = format!(
        "{} {}; echo inner-survived",
        sh_quote(ccci.get_program()),
        ccci.get_args()
            .map(|a| if a == "TIED" {
                "\"$TIED\"".to_owned()
            } else {
                sh_quote(a)
            })
            .collect::<Vec<_>>()
            .join(" ")
    );
    let mut outer = Command::new("sh");
    outer.args([
        "-c",
        "TIED=$$ sh -c \"$1\" & echo outer $$; wait",
        "outer",
        &inner,
    ]);
    outer.env_remove("CCCI_TIE_TO");
    let mut step = Proc::spawn(outer);
    step.wait_ready();
    signal(step.pid(), Signal::SIGKILL);
    let done = step.finish();
    done.assert_stderr_has("== tied process exited (--tie-to) — tearing down ==");
    let record = sandbox.record("tie");
    assert_eq!(record["shutdown_reason"], "tied-pid-died");
    assert_eq!(record["exit_code"], 143);
    assert!(
        done.out.iter().any(|l| l == "inner-survived"),
        "the intermediate shell (the run's parent) lives on; only the tie can have fired\n{}",
        done.transcript()
    );
}

/// `--tie-to` must name a living ancestor: anything else is refused before anything happens.
#[rstest::rstest]
#[case::not_an_ancestor("NOT_ANCESTOR", 125, "not an ancestor of this process")]
#[case::dead_pid("DEAD", 125, "no such process")]
#[case::init("1", 2, "1 is init, which never exits")]
#[case::garbage("soon", 2, "is not a process id")]
#[case::negative("-5", 2, "is not a process id")]
#[case::huge("99999999999", 2, "is not a process id")]
fn tie_to_must_name_a_living_ancestor(#[case] pid: &str, #[case] code: i32, #[case] message: &str) {
    let sandbox = Sandbox::new();
    let mut sibling = Command::new("sleep").arg("100000").spawn().unwrap();
    let mut dead = Command::new("true").spawn().unwrap();
    dead.wait().unwrap();
    let pid = match pid {
        "NOT_ANCESTOR" => sibling.id().to_string(),
        "DEAD" => dead.id().to_string(),
        other => other.to_owned(),
    };
    let tie = format!("--tie-to={pid}");
    let done = run(sandbox.run_sh("tie-bad", &[&tie], "echo command-ran"));
    sibling.kill().unwrap();
    sibling.wait().unwrap();
    done.assert_code(code);
    done.assert_stderr_has(message);
    assert!(!done.out.iter().any(|l| l == "command-ran"));
}

/// Signals whose default action would end the supervisor without a teardown are caught,
/// reported and ignored: the run goes on and still tears down properly.
#[test]
fn stray_signals_never_kill_the_supervisor_silently() {
    let sandbox = Sandbox::new();
    let mut proc = Proc::spawn(sandbox.run_sh("stray", &[], "echo ready $$; read line || :"));
    proc.wait_ready();
    let rt = nix::libc::SIGRTMIN() + 5;
    for sig in [Signal::SIGUSR1, Signal::SIGUSR2, Signal::SIGPWR] {
        signal(proc.pid(), sig);
        proc.wait_for(
            Stream::Err,
            &format!("== {} received — ignored ==", sig.as_str()),
        );
    }
    // SAFETY: kill(2) with a real-time signal number.
    assert_eq!(unsafe { nix::libc::kill(proc.pid(), rt) }, 0);
    proc.wait_for(Stream::Err, "== SIGRTMIN+5 received — ignored ==");
    signal(proc.pid(), Signal::SIGQUIT);
    let done = proc.finish();
    done.assert_code(131);
    done.assert_stderr_has("== SIGQUIT received — tearing down ==");
    assert_eq!(sandbox.record("stray")["exit_code"], 131);
}

/// A SIGALRM from outside is not the hard deadline: it is reported and ignored, the run goes on
/// and ends for its own reason (here a SIGTERM, 143 — not 142).
#[test]
fn external_sigalrm_is_not_taken_for_the_deadline() {
    let sandbox = Sandbox::new();
    let mut proc = Proc::spawn(sandbox.run_sh(
        "alrm",
        &["--deadline", "600"],
        "echo ready $$; read line || :",
    ));
    proc.wait_ready();
    signal(proc.pid(), Signal::SIGALRM);
    proc.wait_for(
        Stream::Err,
        "== SIGALRM received before the hard deadline — ignored ==",
    );
    signal(proc.pid(), Signal::SIGTERM);
    let done = proc.finish();
    done.assert_code(143);
    assert_eq!(sandbox.record("alrm")["shutdown_reason"], "SIGTERM");
}

/// The command starts inside its run's cgroup (created there, not moved there later), and so
/// does the teardown hook, each in its own leaf; the record names the run's cgroup.
#[test]
fn command_and_hook_start_inside_the_run_s_cgroup() {
    if crate::util::TestCgroup::create("probe").is_none() {
        return;
    }
    let sandbox = Sandbox::new();
    let hook_out = sandbox.path().join("hook-cgroup");
    let hook = format!("grep '^0::' /proc/self/cgroup > {}", sh_quote(&hook_out));
    let done = run(sandbox.run_sh(
        "cg",
        &["--on-teardown", &hook],
        "grep '^0::' /proc/self/cgroup",
    ));
    done.assert_code(0);
    let record = sandbox.record("cg");
    let cgroup = record["cgroup"]
        .as_str()
        .expect("the record names the cgroup");
    let name = Path::new(cgroup).file_name().unwrap().to_str().unwrap();
    assert!(name.starts_with("ccci-run-cg-"), "{cgroup}");
    let line = &done.out[0];
    assert!(
        line.ends_with(&format!("/{name}/command")),
        "{line} vs {cgroup}"
    );
    let hook_line = std::fs::read_to_string(&hook_out).unwrap();
    assert!(
        hook_line.trim().ends_with(&format!("/{name}/hook")),
        "{hook_line}"
    );
    assert!(!Path::new(cgroup).exists(), "the run removes its cgroup");
}
