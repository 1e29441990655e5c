//! `ccci-run runs` and `ccci-run stop` against real runs: live, finished, dead by SIGKILL, one
//! waiting for its lock, one that ignores SIGTERM, one in another pid namespace; and what
//! neither may do: signal a pid another process has reused, take a plain SIGTERM for a stop,
//! accept a path for a run id, or panic on a closed stdout.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use nix::sys::signal::Signal;
use rstest::rstest;
use serde_json::{Value, json};

use crate::identity::in_pid_namespace;
use crate::util::{Proc, Sandbox, Stream, lock_is_free, process_alive, run, signal, wait_exited};

/// A command that announces itself and waits until it is killed.
const WAIT_FOREVER: &str = "echo ready $$; exec sleep 100000";

fn runs_json(sandbox: &Sandbox, extra: &[&str]) -> Value {
    let mut cmd = sandbox.ccci();
    cmd.args(["runs", "--json"]).args(extra);
    let done = run(cmd);
    done.assert_code(0);
    serde_json::from_str(&done.out.join("\n"))
        .unwrap_or_else(|e| panic!("runs printed no JSON ({e})\n{}", done.transcript()))
}

/// The run `id` in a `runs --json` listing, if listed.
fn listed<'a>(listing: &'a Value, id: &str) -> Option<&'a Value> {
    listing["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["run_id"] == id)
}

#[track_caller]
fn the_run<'a>(listing: &'a Value, id: &str) -> &'a Value {
    listed(listing, id).unwrap_or_else(|| panic!("run {id} not listed: {listing:#}"))
}

fn stop(sandbox: &Sandbox, args: &[&str]) -> crate::util::Finished {
    let mut cmd = sandbox.ccci();
    cmd.arg("stop").args(args);
    run(cmd)
}

/// Live, finished and dead-by-SIGKILL runs, listed with their state, lock, cgroup and record,
/// sorted by start; a finished run older than a day only with `--all`. `stop` stops the live
/// one (recorded `stopped` with our uid and pid, exit 143) and refuses the others, saying why.
#[test]
fn runs_lists_live_finished_and_dead_runs_and_stop_stops_only_the_live_one() {
    let sandbox = Sandbox::new();
    run(sandbox.run_sh("fin", &["--pr", "1"], "true")).assert_code(0);
    run(sandbox.run_sh("old", &["--pr", "4"], "exit 3")).assert_code(3);
    let mut dead = Proc::spawn(sandbox.run_sh("dead", &["--pr", "3"], WAIT_FOREVER));
    dead.wait_ready();
    signal(dead.pid(), Signal::SIGKILL);
    assert!(wait_exited(dead.pid()));
    let mut live = Proc::spawn(sandbox.run_sh("live", &["--pr", "2"], WAIT_FOREVER));
    live.wait_ready();
    // A record that ended two days ago.
    let old_path = sandbox.runs().join("old/run.json");
    let mut old = sandbox.record("old");
    for phase in old["phases"].as_array_mut().unwrap() {
        phase["at"] = json!("2020-01-01T00:00:00.000Z");
    }
    std::fs::write(&old_path, serde_json::to_vec(&old).unwrap()).unwrap();

    let listing = runs_json(&sandbox, &[]);
    let ids: Vec<&str> = listing["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["run_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["fin", "dead", "live"], "sorted by start\n{listing:#}");
    let fin = the_run(&listing, "fin");
    assert_eq!(fin["state"], "finished");
    assert_eq!(fin["exit_code"], 0);
    assert_eq!(fin["shutdown_reason"], "command-ended");
    assert_eq!(fin["pr"], "1");
    assert_eq!(fin["lock"], Value::Null);
    let record = sandbox.runs().join("fin/run.json");
    assert_eq!(fin["record"], record.display().to_string());
    let dead_run = the_run(&listing, "dead");
    assert_eq!(dead_run["state"], "dead", "{dead_run:#}");
    assert_eq!(dead_run["phase"], "command");
    assert!(
        dead_run["note"].as_str().unwrap().contains("janitor"),
        "{dead_run:#}"
    );
    // Its cgroup stayed until the next run's sweep emptied and removed it: the record says
    // what that sweep killed (its command, unless the fence had ended it first), and when.
    if sandbox.record("dead")["cgroup"].is_string() {
        let record = sandbox.record("dead");
        let swept = &record["swept"];
        let at = swept["at"]
            .as_str()
            .unwrap_or_else(|| panic!("not swept: {record:#}"));
        // Today's time of day in the note; the record keeps the whole instant.
        let at = format!("{}Z", &at[11..19]);
        let note = dead_run["note"].as_str().unwrap();
        let said = match swept["killed"].as_u64().unwrap() {
            0 => format!("a janitor removed its cgroup at {at} (nothing of it still ran)"),
            1 => format!("a janitor killed its 1 process at {at}"),
            n => format!("a janitor killed its {n} processes at {at}"),
        };
        assert_eq!(note, said, "{record:#}");
    }
    let live_run = the_run(&listing, "live");
    assert_eq!(live_run["state"], "live", "{live_run:#}");
    assert_eq!(live_run["phase"], "command");
    assert_eq!(live_run["lock"]["state"], "held", "{live_run:#}");
    let holder = &live_run["lock"]["holder"];
    assert_eq!(holder["run_id"], "live", "{live_run:#}");
    assert!(holder["pid"].as_u64().unwrap() > 0, "{live_run:#}");
    assert!(
        holder["since"].as_str().unwrap().ends_with('Z'),
        "{live_run:#}"
    );
    assert_eq!(listing["version"], 1);
    assert_eq!(listing["errors"], json!([]));
    assert!(live_run["age_s"].as_u64().is_some());
    if live_run["cgroup"].is_string() {
        // The command (sleep) is in it.
        assert!(live_run["processes"].as_u64().unwrap() >= 1, "{live_run:#}");
    }
    for key in [
        "run_id",
        "recipe",
        "pr",
        "ref",
        "domain",
        "phase",
        "state",
        "started",
        "age_s",
        "lock",
        "cgroup",
        "processes",
        "shutdown_reason",
        "exit_code",
        "record",
    ] {
        assert!(live_run.get(key).is_some(), "no {key}: {live_run:#}");
    }
    let all = runs_json(&sandbox, &["--all"]);
    assert_eq!(the_run(&all, "old")["exit_code"], 3);
    assert_eq!(all["runs"][0]["run_id"], "old", "the oldest first: {all:#}");

    let mut table = sandbox.ccci();
    table.arg("runs");
    let table = run(table);
    table.assert_code(0);
    let text = table.out.join("\n");
    assert!(text.starts_with("RUN "), "{text}");
    let dead_line = table.out.iter().find(|l| l.starts_with("dead ")).unwrap();
    assert!(
        dead_line.contains(" dead ") && dead_line.contains("janitor"),
        "{text}"
    );
    for line in &table.out {
        assert!(
            line.chars().count() <= 100,
            "wider than 100 columns: {line}"
        );
    }
    // No path that no longer exists: a finished run's cgroup is gone, so it is not shown.
    assert_eq!(fin["cgroup"], Value::Null, "{fin:#}");
    // Only the live run with --live; one run by its id; an unknown id is 1.
    let live_only = runs_json(&sandbox, &["--live"]);
    let ids: Vec<&str> = live_only["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["run_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["live"]);
    let one = runs_json(&sandbox, &["fin"]);
    assert_eq!(one["run"]["run_id"], "fin", "{one:#}");
    let phases: Vec<&str> = one["run"]["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(phases.first(), Some(&"guards"), "{one:#}");
    assert_eq!(phases.last(), Some(&"finished"), "{one:#}");
    let mut missing = sandbox.ccci();
    missing.args(["runs", "nobody"]);
    let missing = run(missing);
    missing.assert_code(1);
    missing.assert_stderr_has("no run nobody in ");
    let mut wide = sandbox.ccci();
    wide.args(["runs", "-o", "wide"]);
    let wide = run(wide);
    assert!(
        wide.out
            .iter()
            .any(|l| l.contains(&record.display().to_string())),
        "{}",
        wide.transcript()
    );

    // Only the live run is stopped; the others are refused, each saying why.
    let done = stop(&sandbox, &["fin"]);
    done.assert_code(1);
    done.assert_stderr_has("no live run fin to stop: it has finished (command-ended, exit 0)");
    let done = stop(&sandbox, &["dead"]);
    done.assert_code(1);
    done.assert_stderr_has("no live run dead to stop: it is dead");
    let done = stop(&sandbox, &["nobody"]);
    done.assert_code(1);
    done.assert_stderr_has("no live run nobody to stop: unknown");

    let done = stop(&sandbox, &["live"]);
    done.assert_code(0);
    let line = done.out.join("\n");
    let me = std::process::id();
    assert!(
        line.starts_with("run live: stopped by uid 0 (pid ") && line.contains("exit 143"),
        "{}",
        done.transcript()
    );
    let finished = live.finish();
    finished.assert_code(143);
    finished.assert_stderr_has("== stopped by ccci-run stop (uid 0, pid ");
    let record = sandbox.record("live");
    assert_eq!(record["shutdown_reason"], "stopped");
    assert_eq!(record["exit_code"], 143);
    assert_eq!(record["stopped_by"]["uid"], nix::unistd::getuid().as_raw());
    let by = record["stopped_by"]["pid"].as_i64().unwrap();
    assert!(
        by > 0 && by != i64::from(me),
        "the stop command's pid: {record:#}"
    );
    assert!(!sandbox.runs().join("live/stop.json").exists());
    assert!(lock_is_free(
        &sandbox.lock_file(live_run["domain"].as_str().unwrap())
    ));
    // The dead run's leftovers are the janitor's.
    sandbox.janitor(&[]).1.assert_code(0);
}

/// A SIGTERM is a stop only when its sender is the requester its request names, and a ccci-run:
/// with a request naming our supervisor but another pid, our own SIGTERM is the plain SIGTERM
/// it always was; with a forged one naming us (the run's own command can write there, and can
/// name whoever is about to send a plain SIGTERM: Drone's runner, systemd), it still is. The
/// request is checked against the kernel's word on the sender (`si_pid`, `si_uid`, and the
/// sender's command name), not taken on trust; a real `stop` is recorded `stopped` in
/// `runs_lists_live_finished_and_dead_runs_and_stop_stops_only_the_live_one`.
#[rstest]
#[case::another_sender(false)]
#[case::a_forgery_naming_the_sender(true)]
fn a_sigterm_is_a_stop_only_from_the_requester(#[case] ours: bool) {
    let sandbox = Sandbox::new();
    let mut live = Proc::spawn(sandbox.run_sh("st", &[], WAIT_FOREVER));
    live.wait_ready();
    let record = sandbox.record("st");
    let me = std::process::id() as i32;
    let request = json!({
        "uid": nix::unistd::getuid().as_raw(),
        "pid": if ours { me } else { me + 100_000 },
        "pid_ns": record["supervisor"]["pid_ns"],
        "supervisor": record["supervisor"],
        "at": "2026-01-01T00:00:00.000Z",
    });
    std::fs::write(
        sandbox.runs().join("st/stop.json"),
        serde_json::to_vec(&request).unwrap(),
    )
    .unwrap();
    signal(live.pid(), Signal::SIGTERM);
    live.finish().assert_code(143);
    let record = sandbox.record("st");
    assert_eq!(record["shutdown_reason"], "SIGTERM", "{record:#}");
    assert!(record.get("stopped_by").is_none(), "{record:#}");
}

/// A stale record whose supervisor's pid now belongs to another process, with its guard held
/// by a holder line naming it (so only the start time tells them apart): `runs` calls it dead,
/// `stop` refuses it and the process that has the pid now is never signalled.
#[test]
fn a_stale_record_whose_pid_was_reused_is_never_signalled() {
    let sandbox = Sandbox::new();
    run(sandbox.run_sh("fin", &[], "true")).assert_code(0);
    let mut record = sandbox.record("fin");
    let mut victim = Proc::spawn({
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo ready $$; exec sleep 100000"]);
        cmd
    });
    let victim_pid = victim.wait_ready();
    // Its pid, with the start time of a process that ended before it began.
    let mut stale = record["supervisor"].clone();
    stale["pid"] = json!(victim_pid);
    stale["start_ticks"] = json!(stale["start_ticks"].as_u64().unwrap().saturating_sub(100));
    record["supervisor"] = stale.clone();
    record["run_id"] = json!("stale");
    record["exit_code"] = Value::Null;
    record["shutdown_reason"] = Value::Null;
    record["phases"].as_array_mut().unwrap().truncate(2);
    let dir = sandbox.runs().join("stale");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("run.json"), serde_json::to_vec(&record).unwrap()).unwrap();
    let holder = json!({
        "run_id": "stale", "pid": victim_pid, "started_at": "2026-01-01T00:00:00.000Z",
        "host": "h", "process": stale,
    });
    std::fs::write(dir.join("run.lock"), format!("{holder}\n")).unwrap();
    let _guard = sandbox.hold_with_flock(&dir.join("run.lock"));

    assert_eq!(the_run(&runs_json(&sandbox, &[]), "stale")["state"], "dead");
    let done = stop(&sandbox, &["stale", "--wait", "1"]);
    done.assert_code(1);
    done.assert_stderr_has("no live run stale to stop: it is dead");
    assert!(process_alive(victim_pid), "the reused pid was signalled");
    assert!(!dir.join("stop.json").exists(), "a request was left");
    signal(victim_pid, Signal::SIGKILL);
    let _ = victim.finish();
}

/// A run id that is a path, empty, or absurdly long is refused (exit 2) before anything is
/// looked at.
#[rstest]
#[case("../1")]
#[case("a/b")]
#[case("")]
#[case(".hidden")]
#[case(&"x".repeat(65))]
fn stop_refuses_a_run_id_that_is_no_run_id(#[case] id: &str) {
    let sandbox = Sandbox::new();
    let done = stop(&sandbox, &[id]);
    done.assert_code(2);
    done.assert_stderr_has("invalid run id");
}

/// A run still waiting for its app lock is stopped where it waits: recorded `stopped` without
/// ever entering `app-lock`, and the lock stays its holder's.
#[test]
fn a_run_waiting_for_its_lock_is_stopped_and_takes_no_lock() {
    let sandbox = Sandbox::new();
    let mut first = Proc::spawn(sandbox.run_sh("first", &["--pr", "5"], WAIT_FOREVER));
    first.wait_ready();
    let mut second = Proc::spawn(sandbox.run_sh("second", &["--pr", "5"], WAIT_FOREVER));
    second.wait_for(Stream::Err, "is in flight — waiting");
    let listing = runs_json(&sandbox, &[]);
    let waiting = the_run(&listing, "second");
    assert_eq!(waiting["state"], "live");
    assert_eq!(waiting["phase"], "waiting");
    assert_eq!(waiting["lock"]["state"], "waiting", "{waiting:#}");
    assert_eq!(waiting["lock"]["holder"]["run_id"], "first", "{waiting:#}");
    let domain = waiting["domain"].as_str().unwrap();
    let short = domain.split('.').next().unwrap();
    assert_eq!(
        waiting["note"],
        format!("waiting for {short} (held by run first)"),
        "{waiting:#}"
    );
    // The table says the same in its NOTE, within 100 columns; the run's own view names the
    // holder in full.
    let mut table = sandbox.ccci();
    table.arg("runs");
    let table = run(table);
    let line = table.out.iter().find(|l| l.starts_with("second ")).unwrap();
    assert!(
        line.contains(" waiting ")
            && line.ends_with(&format!("waiting for {short} (held by run first)")),
        "{}",
        table.transcript()
    );
    let mut one = sandbox.ccci();
    one.args(["runs", "second"]);
    let one = run(one);
    one.assert_code(0);
    let text = one.out.join("\n");
    assert!(
        text.contains(&format!(
            "lock       waiting {domain} (held by run first, pid "
        )),
        "{text}"
    );

    stop(&sandbox, &["second"]).assert_code(0);
    second.finish().assert_code(143);
    let record = sandbox.record("second");
    assert_eq!(record["shutdown_reason"], "stopped");
    let phases: Vec<&str> = record["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert!(!phases.contains(&"app-lock"), "{phases:?}");
    let domain = waiting["domain"].as_str().unwrap();
    assert!(
        !lock_is_free(&sandbox.lock_file(domain)),
        "the holder lost its lock"
    );
    assert_eq!(
        sandbox.record("first")["exit_code"],
        Value::Null,
        "the holder was touched"
    );
    stop(&sandbox, &["first"]).assert_code(0);
    first.finish().assert_code(143);
}

/// A run whose command ignores SIGTERM (with a long kill grace) is still tearing down when the
/// wait ends: 75, and it keeps tearing down. With `--kill`, its supervisor, then its cgroup (or,
/// without one, every process naming it) are killed, and the record says so (exit 137) and
/// names who asked.
#[rstest]
#[case::cgroup("auto")]
#[case::fallback("off")]
fn a_run_that_outlasts_the_wait_is_75_and_killed_with_kill(#[case] cgroup: &str) {
    let sandbox = Sandbox::new();
    let script = "trap '' TERM; echo ready $$; exec sleep 100000";
    let mut cmd = sandbox.run_sh("slow", &["--kill-grace", "5m"], script);
    cmd.env("CCCI_CGROUP", cgroup);
    let mut live = Proc::spawn(cmd);
    let command = live.wait_ready();
    let done = stop(&sandbox, &["slow", "--wait", "0.5"]);
    done.assert_code(75);
    done.assert_stderr_has("ccci-run: error: run slow still runs after 500ms");
    live.wait_for(Stream::Err, "== stopped by ccci-run stop");
    assert!(process_alive(command));

    let done = stop(&sandbox, &["slow", "--wait", "0.5", "--kill"]);
    done.assert_code(0);
    let out = done.out.join("\n");
    assert!(out.contains("exit 137"), "{}", done.transcript());
    assert!(
        out.contains("run slow: its app, if any, is left for the next janitor sweep"),
        "{}",
        done.transcript()
    );
    let finished = live.finish();
    assert_eq!(finished.status.code(), None, "the supervisor was killed");
    assert!(
        wait_exited(command) && !process_alive(command),
        "its command survived"
    );
    let record = sandbox.record("slow");
    assert_eq!(record["exit_code"], 137, "{record:#}");
    assert_eq!(record["shutdown_reason"], "stopped");
    assert!(record["stopped_by"]["pid"].as_i64().is_some());
    let errors = record["teardown_errors"].to_string();
    assert!(errors.contains("ccci-run stop --kill"), "{errors}");
    if let Some(cgroup) = record["cgroup"].as_str() {
        assert!(!Path::new(cgroup).exists(), "cgroup {cgroup} left");
    }
    assert!(!sandbox.runs().join("slow/stop.json").exists());
    let listing = runs_json(&sandbox, &[]);
    assert_eq!(the_run(&listing, "slow")["state"], "finished");
}

/// A run in another pid namespace is live to `runs` on the host and stopped by the host's
/// `stop` (whose pid the run's kernel view shows as 0: the request's namespace says whose it
/// is); from inside another namespace, the host's run (and the first namespace's) is
/// `unresolvable` and `stop` refuses it, signalling nothing.
#[test]
fn runs_and_stop_across_pid_namespaces() {
    let sandbox = Sandbox::new();
    let mut inner = Proc::spawn(in_pid_namespace(&sandbox.run_sh(
        "inner",
        &["--pr", "6"],
        WAIT_FOREVER,
    )));
    inner.wait_ready();
    let mut host = Proc::spawn(sandbox.run_sh("host", &["--pr", "7"], WAIT_FOREVER));
    host.wait_ready();

    let listing = runs_json(&sandbox, &[]);
    assert_eq!(the_run(&listing, "inner")["state"], "live", "{listing:#}");
    assert_eq!(the_run(&listing, "host")["state"], "live");

    let mut cmd = sandbox.ccci();
    cmd.args(["runs", "--json"]);
    let done = run(in_pid_namespace(&cmd));
    done.assert_code(0);
    let seen: Value = serde_json::from_str(&done.out.join("\n")).unwrap();
    let host_run = the_run(&seen, "host");
    assert_eq!(host_run["state"], "unresolvable", "{seen:#}");
    assert!(
        host_run["note"]
            .as_str()
            .unwrap()
            .contains("cannot see into")
    );
    // A sibling namespace (each `unshare` makes its own) is out of sight too.
    assert_eq!(the_run(&seen, "inner")["state"], "unresolvable", "{seen:#}");

    let mut cmd = sandbox.ccci();
    cmd.args(["stop", "host", "--wait", "1"]);
    let done = run(in_pid_namespace(&cmd));
    done.assert_code(1);
    done.assert_stderr_has("no live run host to stop: its supervisor cannot be judged from here");
    assert_eq!(sandbox.record("host")["exit_code"], Value::Null);

    let done = stop(&sandbox, &["inner"]);
    done.assert_code(0);
    let finished = inner.finish();
    finished.assert_code(143);
    let record = sandbox.record("inner");
    assert_eq!(record["shutdown_reason"], "stopped", "{record:#}");
    assert_eq!(record["stopped_by"]["uid"], 0);
    stop(&sandbox, &["host"]).assert_code(0);
    host.finish().assert_code(143);
}

/// `runs` and `stop` on a runs dir that cannot be read (a file, one another user may not read)
/// are exit 1 naming it and the setting; a missing one (its parent there) holds no run: `runs`
/// lists none (0) and `stop` finds none live (1), each saying so in the one line; on a closed
/// stdout `runs` ends quietly, never a panic.
#[test]
fn runs_on_an_unreadable_runs_dir_is_1_and_a_closed_stdout_is_no_panic() {
    let sandbox = Sandbox::new();
    let file = sandbox.path().join("not-a-dir");
    std::fs::write(&file, "").unwrap();
    for command in [vec!["runs"], vec!["stop", "7"]] {
        let mut cmd = sandbox.ccci();
        cmd.arg("--runs-dir").arg(&file).args(&command);
        let done = run(cmd);
        done.assert_code(1);
        done.assert_stderr_has(&format!("failed to read runs dir {}: ", file.display()));
        done.assert_stderr_has("--runs-dir / CCCI_RUNS_DIR");
    }
    let missing = sandbox.path().join("missing");
    for (command, code) in [(vec!["runs"], 0), (vec!["stop", "7"], 1)] {
        let mut cmd = sandbox.ccci();
        cmd.arg("--runs-dir").arg(&missing).args(&command);
        let done = run(cmd);
        done.assert_code(code);
        done.assert_stderr_has(&format!(
            "runs dir {} (--runs-dir, CCCI_RUNS_DIR, runs_dir) does not exist: nothing there yet",
            missing.display()
        ));
        assert!(!missing.exists(), "a look makes nothing");
    }
    // A runs dir another user may not read: as uid 65534, the same clear error.
    run(sandbox.run_sh("mine", &[], "true")).assert_code(0);
    std::fs::set_permissions(sandbox.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(sandbox.runs(), std::fs::Permissions::from_mode(0o700)).unwrap();
    for command in [vec!["runs"], vec!["stop", "mine"]] {
        let mut cmd = Command::new("setpriv");
        crate::util::without_ccci_env(&mut cmd);
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(crate::util::BIN)
            .env("CCCI_CONFIG", "/dev/null")
            .env_remove("HOME")
            .arg("--runs-dir")
            .arg(sandbox.runs())
            .args(&command);
        let done = run(cmd);
        done.assert_code(1);
        done.assert_stderr_has(&format!(
            "failed to read runs dir {}: Permission denied",
            sandbox.runs().display()
        ));
    }
    std::fs::set_permissions(sandbox.runs(), std::fs::Permissions::from_mode(0o755)).unwrap();
    // Far more than a pipe holds (64 KiB), so the write meets the closed pipe.
    run(sandbox.run_sh("r0", &[], "true")).assert_code(0);
    let record = std::fs::read(sandbox.runs().join("r0/run.json")).unwrap();
    for n in 1..400 {
        let dir = sandbox.runs().join(format!("r{n}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("run.json"), &record).unwrap();
    }
    let mut cmd = sandbox.ccci();
    cmd.args(["runs", "--all", "--json"]);
    let line = format!(
        "{} | head -c 1 >/dev/null; echo status ${{PIPESTATUS[0]}}",
        shell_words(&cmd)
    );
    let mut bash = Command::new("bash");
    bash.args(["-c", &line]);
    let done = run(bash);
    done.assert_code(0);
    assert!(
        done.out.iter().any(|l| l == "status 0"),
        "{}",
        done.transcript()
    );
    assert!(!done.stderr().contains("panicked"), "{}", done.transcript());
}

/// `cmd` as one shell line (its environment changes included).
fn shell_words(cmd: &Command) -> String {
    // env(1) takes its -u options before any NAME=VALUE.
    let mut unset = Vec::new();
    let mut set = Vec::new();
    for (key, value) in cmd.get_envs() {
        match value {
            Some(value) => set.push(crate::util::sh_quote(format!(
                "{}={}",
                key.to_string_lossy(),
                value.to_string_lossy()
            ))),
            None => unset.push(format!("-u {}", crate::util::sh_quote(key))),
        }
    }
    let mut words = vec!["env".to_owned()];
    words.extend(unset);
    words.extend(set);
    words.push(crate::util::sh_quote(cmd.get_program()));
    words.extend(cmd.get_args().map(crate::util::sh_quote));
    words.join(" ")
}
