//! `stop` signals only a process the kernel proves to be that run's supervisor: the attacks a
//! run's own command (or the runner's user) can mount on the files `stop` reads, as root and as
//! the runner's user. Each ends with the victim untouched and a message naming what did not
//! match. And a stop of a live run stays fast.

use std::path::Path;
use std::process::Command;

use nix::sys::signal::Signal;

use crate::util::{Finished, PATIENCE, Proc, Sandbox, process_alive, signal, wait_exited};

/// The runner's user of these tests.
const RUNNER: u32 = 65534;

/// Who runs the runs and the `stop`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    Root,
    /// The runs and the stop are the runner's user's.
    Runner,
    /// The runs are the runner's user's; root stops them (`runner_user` names that user).
    RootForRunner,
}

fn bounded(cmd: Command) -> Finished {
    let proc_ = Proc::spawn(cmd);
    let pid = proc_.pid();
    if !wait_exited(pid) {
        signal(pid, Signal::SIGKILL);
        let done = proc_.finish();
        panic!("hung: killed after {PATIENCE:?}\n{}", done.transcript());
    }
    proc_.finish()
}

/// A sandbox whose directories the runner's user may use, when `who` needs it; `None` (after
/// saying so) when the test cannot switch users.
fn sandbox_for(who: Who) -> Option<Sandbox> {
    if who == Who::Root {
        return Some(Sandbox::new());
    }
    if !crate::util::is_root_or_skip("run the suite as root to switch to another user") {
        return None;
    }
    let sandbox = Sandbox::owned_by(RUNNER);
    std::fs::write(
        sandbox.path().join("config.toml"),
        "runner_user = \"nobody\"\n",
    )
    .unwrap();
    Some(sandbox)
}

/// `cmd` as the user that runs the runs.
fn as_runs_user(who: Who, sandbox: &Sandbox, cmd: Command) -> Command {
    match who {
        Who::Root => cmd,
        Who::Runner | Who::RootForRunner => {
            let mut cmd = crate::util::as_user(RUNNER, &cmd);
            cmd.env("CCCI_CONFIG", sandbox.path().join("config.toml"));
            cmd
        }
    }
}

/// `ccci-run stop ID --kill --wait 2` as `who`.
fn stop(who: Who, sandbox: &Sandbox, id: &str) -> Finished {
    let mut cmd = sandbox.ccci();
    cmd.args(["stop", id, "--kill", "--wait", "2"]);
    let cmd = match who {
        Who::Root => cmd,
        Who::Runner => as_runs_user(who, sandbox, cmd),
        Who::RootForRunner => {
            cmd.env("CCCI_CONFIG", sandbox.path().join("config.toml"));
            cmd
        }
    };
    bounded(cmd)
}

/// A live run `id` (of a PR of its own: its own app lock) whose command says `ready` and waits
/// for its stdin.
fn live(who: Who, sandbox: &Sandbox, id: &str) -> Proc {
    let pr = (id.bytes().map(u32::from).sum::<u32>() % 9000 + 1).to_string();
    let cmd = sandbox.run_sh(id, &["--pr", &pr], "echo ready $$; read line || :");
    let mut run = Proc::spawn(as_runs_user(who, sandbox, cmd));
    run.wait_ready();
    run
}

fn end(run: Proc) {
    let mut run = run;
    run.close_stdin();
    run.finish().assert_code(0);
}

fn refused(done: &Finished, id: &str, needle: &str) {
    done.assert_code(1);
    done.assert_stderr_has(&format!("run {id} is not provably that run: "));
    done.assert_stderr_has(needle);
    done.assert_stderr_has("nothing signalled");
}

fn rename(from: &Path, to: &Path) {
    std::fs::rename(from, to)
        .unwrap_or_else(|e| panic!("rename {} → {}: {e}", from.display(), to.display()));
}

/// Run X's command renames `runs/x` away and `runs/v` to `runs/x`: `stop x` refuses (the
/// record there is run v's) and both runs go on.
#[rstest::rstest]
#[case::root(Who::Root)]
#[case::runner(Who::Runner)]
#[case::root_for_runner(Who::RootForRunner)]
fn stop_refuses_a_run_dir_renamed_over_another_s(#[case] who: Who) {
    let Some(sandbox) = sandbox_for(who) else {
        return;
    };
    let victim = live(who, &sandbox, "v");
    let runs = sandbox.runs();
    let script = format!(
        "mv {x} {away} && mv {v} {x} && echo ready $$; read line || :",
        x = crate::util::sh_quote(runs.join("x")),
        away = crate::util::sh_quote(runs.join("x-away")),
        v = crate::util::sh_quote(runs.join("v")),
    );
    let mut forger = Proc::spawn(as_runs_user(
        who,
        &sandbox,
        sandbox.run_sh("x", &["--pr", "9999"], &script),
    ));
    forger.wait_ready();

    let done = stop(who, &sandbox, "x");
    refused(&done, "x", "is run v's, not run x's");
    assert!(process_alive(victim.pid()), "run v was signalled");
    assert!(process_alive(forger.pid()), "run x was signalled");
    // Put back, so each ends as it began.
    rename(&runs.join("x"), &runs.join("v"));
    rename(&runs.join("x-away"), &runs.join("x"));
    end(victim);
    end(forger);
}

/// Run X's command moves run V's guard over its own and copies V's supervisor into its record:
/// the kernel truly says V's supervisor holds that guard, but V's supervisor was started for
/// run v, so `stop x` refuses, naming that, and both runs go on.
#[rstest::rstest]
#[case::root(Who::Root)]
#[case::runner(Who::Runner)]
#[case::root_for_runner(Who::RootForRunner)]
fn stop_refuses_another_run_s_guard_moved_over_its_own(#[case] who: Who) {
    let Some(sandbox) = sandbox_for(who) else {
        return;
    };
    let victim = live(who, &sandbox, "v");
    let forger = live(who, &sandbox, "x");
    let (v, x) = (sandbox.runs().join("v"), sandbox.runs().join("x"));
    let v_record = sandbox.record("v");
    let mut x_record = sandbox.record("x");
    x_record["supervisor"] = v_record["supervisor"].clone();
    x_record["pid"] = v_record["pid"].clone();
    // In place, so the record stays the runs' user's.
    std::fs::write(x.join("run.json"), x_record.to_string()).unwrap();
    rename(&v.join("run.lock"), &x.join("run.lock"));

    let done = stop(who, &sandbox, "x");
    refused(&done, "x", "was started for run v, not for run x");
    assert!(process_alive(victim.pid()), "run v was signalled");
    assert!(process_alive(forger.pid()), "run x was signalled");
    end(victim);
    end(forger);
}

/// The runner's user holds a planted guard in a process that is no supervisor (as a flock
/// passed to a child whose parent exited leaves it), and a forged record names a root process
/// (as one that reused the dead holder's pid would be): neither a root `stop` nor the runner's
/// signals it, and they name what did not match — a process that is no ccci-run, or a ccci-run
/// that is not the runs' user's.
#[rstest::rstest]
#[case::root_stops_a_stranger(Who::RootForRunner, false)]
#[case::root_stops_a_root_ccci_run(Who::RootForRunner, true)]
#[case::runner_stops_a_stranger(Who::Runner, false)]
fn stop_never_signals_a_process_a_forged_record_names(#[case] who: Who, #[case] ccci: bool) {
    let Some(sandbox) = sandbox_for(who) else {
        return;
    };
    // A real record of the runner's user, to forge from.
    let mut first = as_runs_user(who, &sandbox, sandbox.run_sh("evil", &[], "true"));
    first.stdin(std::process::Stdio::null());
    bounded(first).assert_code(0);
    let dir = sandbox.runs().join("evil");
    let guard = dir.join("run.lock");
    let mut holder = Command::new("flock");
    holder
        .arg(&guard)
        .args(["sh", "-c", "echo ready $$; read line || :"]);
    let mut holder = Proc::spawn(crate::util::as_user(RUNNER, &holder));
    holder.wait_ready();

    // The root process a reused pid would name.
    let mut victim = if ccci {
        let mut cmd = sandbox.ccci();
        cmd.args([
            "lock",
            "victim",
            "--",
            "sh",
            "-c",
            "echo ready $$; read line || :",
        ]);
        cmd.env("CCCI_CONFIG", sandbox.path().join("config.toml"));
        Proc::spawn(cmd)
    } else {
        Proc::spawn({
            let mut cmd = Command::new("sh");
            cmd.args(["-c", "echo ready $$; read line || :"]);
            cmd
        })
    };
    victim.wait_ready();
    let victim_pid = victim.pid();
    let mut record = sandbox.record("evil");
    let stat = std::fs::read_to_string(format!("/proc/{victim_pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let start_ticks: u64 = after.split(' ').nth(19).unwrap().parse().unwrap();
    record["supervisor"]["pid"] = victim_pid.into();
    record["supervisor"]["start_ticks"] = start_ticks.into();
    record["pid"] = victim_pid.into();
    record
        .as_object_mut()
        .unwrap()
        .retain(|k, _| !["exit_code", "shutdown_reason"].contains(&k.as_str()));
    std::fs::write(dir.join("run.json"), record.to_string()).unwrap();

    let done = stop(who, &sandbox, "evil");
    if ccci {
        // A root ccci-run's ids are not the run directory's user's; a stop that acts as the
        // runner's user cannot even read what that process runs (a process that changed its
        // ids is not dumpable): refused either way, naming what it could not prove.
        refused(&done, "evil", "");
        let err = done.err.join("\n");
        assert!(
            err.contains("not only as uid 65534 whose run directory it is")
                || (err.contains(&format!(
                    "the executable of pid {victim_pid} cannot be read"
                ))),
            "{}",
            done.transcript()
        );
    } else {
        refused(&done, "evil", "executable");
    }
    assert!(process_alive(victim_pid), "the root process was signalled");
    assert!(
        process_alive(holder.pid()),
        "the guard's holder was signalled"
    );
    victim.close_stdin();
    victim.finish().assert_code(0);
    holder.close_stdin();
    holder.finish();
}

/// A stop of a live run ends it, run after run, and a stop of a run that finished says so and
/// signals nothing. (How long a stop takes is measured in `cargo bench --bench stop`, beside a
/// signal by number: not asserted here, on a shared and noisy machine.)
#[test]
fn a_stop_of_a_live_run_ends_it_every_time() {
    let sandbox = Sandbox::new();
    let mut finished = Proc::spawn(sandbox.run_sh("done", &[], "true"));
    finished.close_stdin();
    finished.finish().assert_code(0);
    let stop = |id: &str, code: i32| {
        let mut cmd = sandbox.ccci();
        cmd.args(["stop", id]);
        let done = bounded(cmd);
        done.assert_code(code);
        done
    };
    for i in 0..5 {
        let id = format!("fast{i}");
        let mut run = Proc::spawn(sandbox.run_sh(&id, &[], "echo ready $$; exec sleep 600"));
        run.wait_ready();
        let said = stop("done", 1);
        assert!(said.stderr().contains("finished"), "{}", said.transcript());
        stop(&id, 0);
        let ended = run.finish();
        assert_eq!(
            sandbox.record(&id)["shutdown_reason"],
            "stopped",
            "{}",
            ended.transcript()
        );
    }
}
