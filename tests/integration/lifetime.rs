//! A run's life is bounded on a real host: a teardown hook that hangs, the supervisor itself
//! SIGKILLed with a command that daemonised, `--tie-to`, and signals that would otherwise end
//! the supervisor without a teardown. (The runner's cancel, its own death and systemd stopping
//! it are in `drone.rs`, under a stand-in that does what the runner does.)

use std::path::Path;
use std::process::Command;

use nix::sys::signal::Signal;

use crate::util::{
    Proc, Sandbox, Stream, pids_by_prefix, process_alive, run, sh_quote, signal, wait_exited,
};

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
    assert!(
        crate::util::lock_is_free(&sandbox.lock_file(domain)),
        "the app lock must be free"
    );
}

/// A run ends with its supervisor: SIGKILLed (as the OOM killer does) while its command left a
/// setsid daemon holding the step's output, a double-forked orphan and a background child, the
/// run's own dead-man kills every one of them within a second, with no janitor — so whoever
/// reads the output (a Drone runner reads it until EOF) sees its end at once. With cgroups
/// (`cgroup.kill`) and without (the processes carry their supervisor's marker).
#[rstest::rstest]
#[case::cgroup("auto")]
#[case::no_cgroup("off")]
fn a_sigkilled_supervisor_takes_its_whole_run_with_it_within_a_second(#[case] cgroup: &str) {
    let sandbox = Sandbox::new();
    let script = "setsid sh -c 'echo daemon $$; exec sleep 100000' & \
        (sh -c 'echo orphan $$; exec sleep 100000' &) ; \
        sleep 100000 & echo child $!; \
        echo ready $$; exec sleep 100000";
    let mut cmd = sandbox.run_sh("dm", &[], script);
    cmd.env("CCCI_CGROUP", cgroup);
    let mut proc = Proc::spawn(cmd);
    let pids = pids_by_prefix(&mut proc, &["daemon ", "orphan ", "child ", "ready "]);
    let record = sandbox.record("dm");
    let supervisor = proc.pid();
    let killed = std::time::Instant::now();
    signal(supervisor, Signal::SIGKILL);
    // Both output pipes at their end: every process that held them is gone.
    let done = proc.finish();
    let ended = killed.elapsed();
    for pid in &pids {
        assert!(
            !process_alive(*pid),
            "process {pid} outlived its run\n{}",
            done.transcript()
        );
    }
    assert!(
        ended < std::time::Duration::from_secs(1),
        "the run's output ended {ended:?} after its supervisor's death\n{}",
        done.transcript()
    );
    done.assert_stderr_has("!! dead-man of run dm");
    done.assert_stderr_has("all gone in");
    match record["cgroup"].as_str() {
        Some(dir) => {
            assert_eq!(cgroup, "auto");
            let procs = crate::util::cgroup_members(Path::new(dir));
            assert!(procs.is_empty(), "left in the run's cgroup: {procs:?}");
        }
        None => assert_eq!(cgroup, "off", "{record:#}"),
    }
}

/// A run started inside another run's command carries that run's mark (`CCCI_SUPERVISOR`, as
/// every process of a run does); its own fence must not. A fence with the mark would be killed by
/// any sweep for that run's processes: here the mark names a supervisor of the same
/// configuration that has ended, so the inner run's own start sweep is such a sweep. Such a
/// run's fence is therefore started as its own program, without the mark (a fence forked at the
/// start keeps its environment); a run inside no other has its fence forked, and no mark
/// either. Either way the fence is the one alive when the supervisor is SIGKILLed, and takes the
/// whole run with it.
#[rstest::rstest]
#[case::inside_no_run(false, "auto")]
#[case::inside_an_ended_run(true, "auto")]
#[case::inside_an_ended_run_no_cgroup(true, "off")]
fn a_run_s_fence_never_carries_the_mark_of_a_run_it_was_started_in(
    #[case] nested: bool,
    #[case] cgroup: &str,
) {
    let sandbox = Sandbox::new();
    let mark = if nested {
        // The mark of a run of this configuration that has ended.
        let done = run(sandbox.run_sh("outer", &[], "echo mark $CCCI_SUPERVISOR"));
        done.assert_code(0);
        let mark = done
            .out
            .iter()
            .find_map(|l| l.strip_prefix("mark "))
            .expect("the outer run's command prints its mark")
            .to_owned();
        assert!(!mark.is_empty(), "{}", done.transcript());
        Some(mark)
    } else {
        None
    };
    let script =
        "setsid sh -c 'echo daemon $$; exec sleep 100000' & echo ready $$; exec sleep 100000";
    let mut cmd = sandbox.run_sh("inner", &[], script);
    cmd.env("CCCI_CGROUP", cgroup);
    match &mark {
        Some(mark) => cmd.env("CCCI_SUPERVISOR", mark),
        None => cmd.env_remove("CCCI_SUPERVISOR"),
    };
    let mut proc = Proc::spawn(cmd);
    let pids = pids_by_prefix(&mut proc, &["daemon ", "ready "]);
    let supervisor = proc.pid();
    let fences = crate::util::fences_of(supervisor);
    assert_eq!(fences.len(), 1, "one dead-man per run");
    let environ = std::fs::read(format!("/proc/{}/environ", fences[0])).unwrap();
    assert!(
        !environ
            .split(|b| *b == 0)
            .any(|entry| entry.starts_with(b"CCCI_SUPERVISOR=")),
        "the fence carries a run's mark"
    );
    let started = std::fs::read(format!("/proc/{}/cmdline", fences[0])).unwrap();
    let tagged = started
        .split(|b| *b == 0)
        .nth(1)
        .is_some_and(|arg| arg == b"__ccci-run-fence");
    assert_eq!(
        tagged, nested,
        "a fence is started as its own program exactly when its run carries another's mark"
    );
    signal(supervisor, Signal::SIGKILL);
    let done = proc.finish();
    for pid in &pids {
        assert!(
            !process_alive(*pid),
            "process {pid} outlived its run\n{}",
            done.transcript()
        );
    }
    done.assert_stderr_has("!! dead-man of run inner");
}

/// No kill by a bare number: a run's command ends (its supervisor reaps it, so its pid and
/// process group id are free), an unrelated process takes that id for a group of its own, and
/// the supervisor is SIGKILLed during its teardown hook. The run's dead-man, told of the
/// command's group when it started, kills the hook and nothing else: the unrelated group's
/// leader lives. (It used to `killpg` the number.)
#[rstest::rstest]
#[case::cgroup("auto")]
#[case::no_cgroup("off")]
fn a_command_s_group_id_taken_by_another_process_is_never_killed(#[case] cgroup: &str) {
    group_id_reuse_attack(&Sandbox::new(), cgroup);
}

/// [`a_command_s_group_id_taken_by_another_process_is_never_killed`] on `sandbox` (its lock
/// backend: flock, or etcd).
pub(crate) fn group_id_reuse_attack(sandbox: &Sandbox, cgroup: &str) {
    let hook = "echo hook-running $$ >&2; exec sleep 100000";
    let mut cmd = sandbox.run_sh("reuse", &["--on-teardown", hook], "echo ready $$; read x");
    cmd.env("CCCI_CGROUP", cgroup);
    let mut proc = Proc::spawn(cmd);
    let leader = proc.wait_ready();
    let supervisor = proc.pid();
    let fences = crate::util::fences_of(supervisor);
    assert_eq!(fences.len(), 1, "one dead-man per run");
    // The dead-man holds the command's group leader (its `/proc` directory) from its start.
    let holds = std::time::Instant::now();
    while !crate::util::holds_proc_dir(fences[0], leader) {
        assert!(
            holds.elapsed() < crate::util::PATIENCE,
            "the dead-man never held the leader"
        );
        std::thread::yield_now();
    }
    proc.close_stdin();
    let hook = proc.wait_for(Stream::Err, "hook-running ");
    let hook: i32 = hook.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(wait_exited(leader));
    let Some(victim) = crate::util::GroupLeader::take(leader) else {
        crate::util::skip(
            &format!("another process kept taking pid {leader}"),
            "run it again on a quieter host",
        );
        return;
    };
    signal(supervisor, Signal::SIGKILL);
    let done = proc.finish();
    done.assert_stderr_has("!! dead-man of run reuse");
    done.assert_stderr_has("all gone in");
    assert!(!process_alive(hook), "the teardown hook outlived its run");
    assert!(
        victim.alive(),
        "the unrelated process that took group id {leader} was killed\n{}",
        done.transcript()
    );
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
    // Its dead-man too (the run's own net, tested above): what the janitor clears is what a
    // supervisor and its dead-man both gone at once leave.
    crate::util::kill_supervisor_and_its_dead_man(proc.pid());
    // These outlive them. (Not asserted: any janitor on the host, another test's too, may kill
    // them from now on.)
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
    crate::util::kill_supervisor_and_its_dead_man(proc.pid());
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
    let tied = step.pid();
    signal(tied, Signal::SIGKILL);
    let done = step.finish();
    done.assert_stderr_has(&format!(
        "== tied process {tied} exited (--tie-to) — tearing down =="
    ));
    let record = sandbox.record("tie");
    assert_eq!(record["shutdown_reason"], "tied-pid-died");
    assert_eq!(record["tied_pid_died"], tied);
    assert_eq!(record["tied_to"], serde_json::json!([tied]));
    assert_eq!(record["exit_code"], 143);
    assert!(
        done.out.iter().any(|l| l == "inner-survived"),
        "the intermediate shell (the run's parent) lives on; only the tie can have fired\n{}",
        done.transcript()
    );
}

/// `--tie-to` must name living ancestors, each once: anything else is refused before anything
/// happens, naming the accepted form.
#[rstest::rstest]
#[case::not_an_ancestor("NOT_ANCESTOR", 125, "not an ancestor of this process")]
#[case::one_not_an_ancestor("PARENT,NOT_ANCESTOR", 125, "not an ancestor of this process")]
#[case::dead_pid("DEAD", 125, "no such process")]
#[case::init("1", 125, "1 is init, which never exits")]
#[case::duplicate("PARENT,PARENT", 2, "twice: list each ancestor once (PID,PID)")]
#[case::garbage("soon", 2, "is not a process id (a positive number; several: PID,PID)")]
#[case::substituted("$", 2, "is not a process id")]
#[case::empty("", 2, "is not a process id")]
#[case::trailing_comma("PARENT,", 2, "is not a process id")]
#[case::negative("-5", 2, "is not a process id")]
#[case::huge("99999999999", 2, "is not a process id")]
fn tie_to_must_name_a_living_ancestor(#[case] pid: &str, #[case] code: i32, #[case] message: &str) {
    let sandbox = Sandbox::new();
    let mut sibling = Command::new("sleep").arg("100000").spawn().unwrap();
    let mut dead = Command::new("true").spawn().unwrap();
    dead.wait().unwrap();
    let pid = pid
        .replace("NOT_ANCESTOR", &sibling.id().to_string())
        .replace("DEAD", &dead.id().to_string())
        .replace("PARENT", &std::process::id().to_string());
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

/// A container's init running the step is a living pid 1 parent: accepted when the caller
/// says so (`--expect-parent 1`, or `--tie-to 1`), refused as an orphan otherwise.
#[rstest::rstest]
#[case::unsaid("", 125)]
#[case::expect_parent("--expect-parent=1", 0)]
#[case::tie_to_init("--tie-to=1", 0)]
fn a_container_init_parent_is_accepted_when_said(#[case] flag: &str, #[case] code: i32) {
    let sandbox = Sandbox::new();
    let extra: Vec<&str> = [flag].into_iter().filter(|f| !f.is_empty()).collect();
    let ccci = sandbox.run_sh("init-parent", &extra, "echo command-ran");
    // pid 1 of a new PID namespace is a shell that stays (it has more to do after ccci-run).
    let line = format!(
        "{} {}; echo init-done",
        sh_quote(ccci.get_program()),
        ccci.get_args().map(sh_quote).collect::<Vec<_>>().join(" ")
    );
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--mount-proc", "--", "sh", "-c", &line]);
    for (key, value) in ccci.get_envs() {
        match value {
            Some(value) => cmd.env(key, value),
            None => cmd.env_remove(key),
        };
    }
    let done = run(cmd);
    assert!(
        done.out.iter().any(|l| l == "init-done"),
        "{}",
        done.transcript()
    );
    if code == 0 {
        assert!(
            done.out.iter().any(|l| l == "command-ran"),
            "{}",
            done.transcript()
        );
        assert_eq!(sandbox.record("init-parent")["exit_code"], 0);
    } else {
        done.assert_stderr_has("re-parented to pid 1");
        done.assert_stderr_has("--expect-parent 1");
        assert!(!done.out.iter().any(|l| l == "command-ran"));
    }
}

/// A flood of signals during teardown is ignored without flooding the log: the first has its
/// line, then at most one "N more" line a second, and the total comes at the end.
#[test]
fn a_flood_of_ignored_signals_is_summarised() {
    let sandbox = Sandbox::new();
    let hook = "echo hook-started >&2; sleep 3";
    let mut proc = Proc::spawn(sandbox.run_sh(
        "flood",
        &["--on-teardown", hook],
        "echo ready $$; exec sleep 100000",
    ));
    proc.wait_ready();
    signal(proc.pid(), Signal::SIGTERM);
    proc.wait_for(Stream::Err, "hook-started");
    // One ignored SIGTERM seen through before the flood: a standard signal is not queued (the
    // kernel merges a SIGTERM sent while one is pending), so only this makes sure the total
    // counts at least two deliveries however the flood is scheduled.
    signal(proc.pid(), Signal::SIGTERM);
    proc.wait_for(
        Stream::Err,
        "== SIGTERM received during teardown — ignored ==",
    );
    let pid = nix::unistd::Pid::from_raw(proc.pid());
    let mut sent = 1;
    while sent < 10_000 && nix::sys::signal::kill(pid, Signal::SIGTERM).is_ok() {
        sent += 1;
    }
    let done = proc.finish();
    done.assert_code(143);
    let lines: Vec<&String> = done
        .err
        .iter()
        .filter(|l| l.contains("SIGTERM") && l.contains("ignored"))
        .collect();
    // The first, one a second over a 3 s hook (and a little slack), the total.
    assert!(
        lines.len() <= 7,
        "{sent} signals gave {} lines: {lines:#?}",
        lines.len()
    );
    let total = done
        .err
        .iter()
        .find_map(|l| {
            l.strip_prefix("== SIGTERM received ")?
                .strip_suffix(" times during teardown — all ignored ==")?
                .parse::<u64>()
                .ok()
        })
        .unwrap_or_else(|| panic!("no total line\n{}", done.transcript()));
    assert!(total >= 2 && total <= sent, "total {total} of {sent} sent");
}
