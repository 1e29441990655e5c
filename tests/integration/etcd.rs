//! Locks beyond one host: a real 3-member etcd cluster on loopback ports, started by each test,
//! and "hosts" that are separate lock dirs, runs dirs and abra homes sharing it.
//!
//! Members are stopped with SIGSTOP (a partition as the holder sees it: connections open,
//! nobody answering) and killed with SIGKILL, as a crashed or fenced-off member would be.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::Value;

use crate::etcd_cluster::{Cluster, free_port};
use crate::util::{PATIENCE, Proc, Sandbox, Stream, run, signal};

/// One "host": its own directories, the cluster's etcd, a lease TTL of `ttl` seconds.
struct Host {
    sandbox: Sandbox,
}

impl Host {
    fn on(cluster: &Cluster, ttl: u32) -> Self {
        Self::at(cluster.endpoints(), ttl)
    }

    fn at(endpoints: String, ttl: u32) -> Self {
        let mut sandbox = Sandbox::new();
        sandbox.set_etcd(endpoints, ttl);
        Self { sandbox }
    }

    /// Two hosts on one Docker engine (one swarm) and one etcd. `None` without an engine.
    fn pair_with_docker(cluster: &Cluster, ttl: u32) -> Option<(Self, Self)> {
        let mut a = Sandbox::with_docker()?;
        a.set_etcd(cluster.endpoints(), ttl);
        let b = Sandbox::beside(&a);
        Some((Self { sandbox: a }, Self { sandbox: b }))
    }

    fn ccci(&self) -> Command {
        self.sandbox.ccci()
    }

    fn janitor(&self) -> (Value, crate::util::Finished) {
        self.sandbox.janitor(&[])
    }

    /// `run` of custom-html PR 1 as `run_id`, running `script`.
    fn run(&self, run_id: &str, extra: &[&str], script: &str) -> Command {
        self.sandbox
            .run_sh(run_id, &[&["--pr", "1"], extra].concat(), script)
    }

    /// `lock cache [extra...] -- sh -c script`.
    fn lock(&self, extra: &[&str], script: &str) -> Command {
        let mut cmd = self.ccci();
        cmd.args(["lock", "cache"])
            .args(extra)
            .args(["--", "sh", "-c", script]);
        cmd
    }

    fn record(&self, run_id: &str) -> Value {
        self.sandbox.record(run_id)
    }

    fn locks(&self) -> Value {
        let mut cmd = self.ccci();
        cmd.args(["locks", "--json"]);
        let done = run(cmd);
        done.assert_code(0);
        let listing: Value = serde_json::from_str(&done.out.join("\n")).expect("locks JSON");
        assert_eq!(listing["version"], 1, "{listing:#}");
        listing["locks"].clone()
    }

    /// Wait until `locks` shows `n` waiters on named lock `name`.
    fn wait_for_waiters(&self, name: &str, n: usize) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let locks = self.locks();
            let waiters = locks
                .as_array()
                .unwrap()
                .iter()
                .find(|l| l["name"] == name)
                .map_or(0, |l| l["waiters"].as_u64().unwrap() as usize);
            if waiters == n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "never saw {n} waiters on {name}: {locks}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Holds until its stdin closes: prints `ready <pid> <fencing token>` first.
const HOLD: &str = "echo ready $$ $CCCI_FENCING_TOKEN; read _ || true";

fn token_of(line: &str) -> i64 {
    line.split_whitespace()
        .nth(2)
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no fencing token in {line:?}"))
}

#[test]
fn same_domain_runs_on_two_hosts_serialise_visibly_and_other_domains_do_not_wait() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let (a, b) = (Host::on(&cluster, 5), Host::on(&cluster, 5));
    let mut first = Proc::spawn(a.run("a1", &[], HOLD));
    let first_token = token_of(&first.wait_for(Stream::Out, "ready"));

    // Another domain on the other host runs straight through while the first is held.
    let other = run(b.sandbox.run_sh("b0", &["--pr", "2"], "echo other"));
    other.assert_code(0);

    let mut second = Proc::spawn(b.run("b1", &[], HOLD));
    second.wait_for(Stream::Err, "in flight — waiting; held by run a1 (pid");
    let held = a.locks();
    let app = held
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "app" && l["held"] == true)
        .unwrap_or_else(|| panic!("no held app lock in {held}"));
    assert_eq!(app["holder"]["run_id"], "a1", "{held}");
    assert!(
        !app["holder"]["host"].as_str().unwrap().is_empty(),
        "{held}"
    );

    first.close_stdin();
    let second_token = token_of(&second.wait_for(Stream::Out, "ready"));
    assert!(
        second_token > first_token,
        "the next holder's fencing token {second_token} must be larger than {first_token}"
    );
    second.close_stdin();
    first.finish().assert_code(0);
    second.finish().assert_code(0);
    assert_eq!(a.record("a1")["fencing_token"], first_token);
    assert_eq!(b.record("b1")["fencing_token"], second_token);
    assert!(
        cluster.keys().is_empty(),
        "released locks leave no keys: {}",
        cluster.keys()
    );
}

/// The fence of an etcd run never kills a process group by a bare number: the run's command
/// ends, an unrelated process takes its group id, the supervisor is SIGKILLed during its
/// teardown hook; the fence kills the hook and leaves the unrelated process alone.
#[rstest::rstest]
#[case::cgroup("auto")]
#[case::no_cgroup("off")]
fn an_etcd_run_s_fence_never_kills_a_group_id_another_process_took(#[case] cgroup: &str) {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let host = Host::on(&cluster, 5);
    crate::lifetime::group_id_reuse_attack(&host.sandbox, cgroup);
}

#[test]
fn a_sigkilled_holders_domain_goes_to_the_other_hosts_waiter_after_the_ttl_and_its_stop_budget() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let ttl = 4;
    let (a, b) = (Host::on(&cluster, ttl), Host::on(&cluster, ttl));
    let mut holder = Proc::spawn(a.run("a1", &[], HOLD));
    let command_pid = holder.wait_ready();
    let mut waiter = Proc::spawn(b.run("b1", &[], HOLD));
    waiter.wait_for(Stream::Err, "waiting; held by run a1");

    // The supervisor dies without a word (the OOM killer): nothing of it keeps its lease alive
    // any more; its fence kills the command at once. The lease expires within the TTL, and the
    // holder's tenure record then keeps the lock for its TTL and stop budget (no kill grace, the
    // 0.5 s kill margin): whoever finds a lease gone cannot tell an expiry from a revoke.
    signal(holder.pid(), Signal::SIGKILL);
    let killed = Instant::now();
    waiter.wait_for(Stream::Err, "lost its lease without releasing the lock");
    waiter.wait_for(Stream::Out, "ready");
    let handed_over = killed.elapsed();
    assert!(
        crate::util::wait_exited(command_pid),
        "the dead holder's command outlived its lock"
    );
    assert!(
        handed_over < Duration::from_secs(2 * u64::from(ttl) + 1 + 1),
        "the waiter got the domain {handed_over:?} after the holder died (TTL {ttl} s)"
    );
    waiter.close_stdin();
    waiter.finish().assert_code(0);
    // Whatever is left of the dead run's command (a janitor's job on a real host).
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(command_pid), Signal::SIGKILL);
    drop(holder.finish());
}

#[test]
fn a_run_keeps_its_lock_when_the_leader_dies_and_loses_it_when_etcd_goes_silent() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    // Long enough to ride out an election (etcd's default election timeout is 1 s).
    let ttl = 5;
    let (a, b) = (Host::on(&cluster, ttl), Host::on(&cluster, ttl));
    let mut holder = Proc::spawn(a.run("a1", &[], HOLD));
    let first_token = token_of(&holder.wait_for(Stream::Out, "ready"));

    // The leader dies: the client fails over and keeps the lease alive. A waiter that gives up
    // after twice the TTL proves the lock stayed held all that time.
    cluster.signal_member(cluster.leader(), Signal::SIGKILL);
    let budget = (2 * ttl).to_string();
    let waiter = run(b.run("b1", &["--lock-wait", &budget], "true"));
    waiter.assert_code(75);
    waiter.assert_stderr_has("held by run a1");

    // Now nobody answers at all, past the TTL: the run must assume another host may hold the
    // domain, and stop at once.
    cluster.signal_all(Signal::SIGSTOP);
    holder.wait_for(Stream::Err, "finished, exit");
    let lost = holder.finish();
    cluster.signal_all(Signal::SIGCONT);
    lost.assert_code(76);
    lost.assert_stderr_has("the lock was lost while held — tearing down");
    let record = a.record("a1");
    assert_eq!(record["shutdown_reason"], "lock-lost", "{record}");
    assert_eq!(record["exit_code"], 76, "{record}");

    // Nothing is double-held afterwards, and the next holder's token is larger.
    let mut next = Proc::spawn(b.run("b2", &[], HOLD));
    let next_token = token_of(&next.wait_for(Stream::Out, "ready"));
    assert!(next_token > first_token, "{next_token} after {first_token}");
    next.close_stdin();
    next.finish().assert_code(0);
}

/// A refused connection is said to be one, within about a second, not after the 5 s a silent
/// member is given ("no answer within 5 s" sent operators looking for a hung etcd).
#[test]
fn an_unreachable_etcd_fails_the_run_and_the_janitor_and_never_falls_back_to_flock() {
    // Nobody listens here.
    let endpoint = format!("http://127.0.0.1:{}", free_port());
    let host = Host::at(endpoint.clone(), 4);
    let started = std::time::Instant::now();
    let done = run(host.run("r1", &[], "echo must-not-run"));
    done.assert_code(125);
    done.assert_stderr_has(&endpoint);
    done.assert_stderr_has("every endpoint refused the connection: nothing listens there");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(4),
        "a refusal took {:?}",
        started.elapsed()
    );
    assert!(!done.out.join("\n").contains("must-not-run"));
    let record = host.record("r1");
    assert_eq!(record["exit_code"], 125, "{record}");
    assert!(
        record["error"].as_str().unwrap().contains(&endpoint),
        "{record}"
    );

    let mut janitor = host.ccci();
    janitor.args(["janitor", "--json"]);
    let swept = run(janitor);
    swept.assert_code(1);
    let report: Value = serde_json::from_str(&swept.out.join("\n")).unwrap();
    assert!(
        report["candidates"].as_array().is_none_or(|c| c.is_empty()),
        "{report}"
    );
    assert!(report.to_string().contains(&endpoint), "{report}");

    let mut locks = host.ccci();
    locks.arg("locks");
    let listed = run(locks);
    listed.assert_code(1);
    listed.assert_stderr_has(&endpoint);
    listed.assert_stderr_has("refused the connection");

    let mut doctor = host.ccci();
    doctor.arg("doctor");
    let judged = run(doctor);
    judged.assert_code(1);
    assert!(
        judged
            .out
            .join("\n")
            .contains("connection refused: nothing listens there"),
        "{}",
        judged.transcript()
    );
}

/// An endpoint without its scheme (`10.0.0.1:2379`) is refused when the configuration is read,
/// by every command, naming the one form; so are https:// (no TLS here) and a missing port.
/// Among several, the one refused is named.
#[test]
fn an_etcd_endpoint_without_its_scheme_is_refused_naming_the_form() {
    let sandbox = Sandbox::new();
    let mut cmd = sandbox.ccci();
    cmd.args([
        "--etcd-endpoints",
        "http://10.0.0.1:2379,10.0.0.2:2379",
        "locks",
    ]);
    let done = run(cmd);
    done.assert_code(2);
    done.assert_stderr_has("endpoint \"10.0.0.2:2379\": the scheme is missing");
    for (endpoint, why) in [
        ("10.0.0.1:2379", "the scheme is missing"),
        ("https://10.0.0.1:2379", "its scheme is not http://"),
        ("http://10.0.0.1", "the port is missing"),
    ] {
        for sub in [
            &["locks"][..],
            &["janitor", "--dry-run"],
            &["lock", "x", "--", "true"],
        ] {
            let mut cmd = sandbox.ccci();
            cmd.args(["--etcd-endpoints", endpoint]).args(sub);
            let done = run(cmd);
            done.assert_code(2);
            done.assert_stderr_has(&format!(
                "\"{endpoint}\": {why}: write each endpoint as http://HOST:PORT (https:// is not \
                 supported by this build)"
            ));
            assert!(
                !done
                    .stderr()
                    .contains(&format!("\"{endpoint}\": \"{endpoint}\"")),
                "{}",
                done.transcript()
            );
        }
    }
}

#[test]
fn named_lock_waiters_across_hosts_are_served_in_order_and_a_killed_one_drops_out() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let (a, b) = (Host::on(&cluster, 4), Host::on(&cluster, 4));
    let order = a.sandbox.path().join("order");
    let append = |who: &str| {
        format!(
            "echo {who} >> {}",
            crate::util::sh_quote(PathBuf::from(&order))
        )
    };
    let lock = |host: &Host, script: &str| host.lock(&[], script);
    let mut holder = Proc::spawn(lock(&a, HOLD));
    holder.wait_ready();
    let mut waiters = Vec::new();
    for (i, host) in [&b, &a, &b].into_iter().enumerate() {
        waiters.push(Proc::spawn(lock(host, &append(&format!("w{i}")))));
        a.wait_for_waiters("cache", i + 1);
    }
    // The middle waiter dies; its key goes with its lease, and it is skipped.
    signal(waiters[1].pid(), Signal::SIGKILL);
    holder.close_stdin();
    holder.finish().assert_code(0);
    let mut finished = Vec::new();
    for (i, waiter) in waiters.into_iter().enumerate() {
        let done = waiter.finish();
        if i != 1 {
            done.assert_code(0);
        }
        finished.push(done);
    }
    let served = std::fs::read_to_string(&order).unwrap();
    assert_eq!(served, "w0\nw2\n");
    // A descendant of a holder is granted the lock at once.
    let nested = run(lock(
        &a,
        &format!(
            "{} --etcd-endpoints {} --lock-dir {} lock cache --wait 1 -- echo nested",
            crate::util::sh_quote(crate::util::BIN),
            cluster.endpoints(),
            crate::util::sh_quote(a.sandbox.locks())
        ),
    ));
    nested.assert_code(0);
    assert!(
        nested.out.join("\n").contains("nested"),
        "{}",
        nested.transcript()
    );
}

#[test]
fn a_named_lock_timeout_names_its_ticket_and_the_holder() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let (a, b) = (Host::on(&cluster, 4), Host::on(&cluster, 4));
    let mut holder = Proc::spawn(a.lock(&[], HOLD));
    holder.wait_ready();
    let timed_out = run(b.lock(&["--wait", "0.5"], "true"));
    timed_out.assert_code(75);
    timed_out.assert_stderr_has("as queue ticket ");
    timed_out.assert_stderr_has("(normal); (no other ticket queued); held by pid");
    holder.close_stdin();
    holder.finish().assert_code(0);
}

#[test]
fn a_dead_hosts_app_is_reaped_from_another_host_and_a_live_one_is_left_alone() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let ttl = 4;
    let Some((a, b)) = Host::pair_with_docker(&cluster, ttl) else {
        return;
    };
    let compose = crate::docker::compose_file(a.sandbox.path());
    std::fs::create_dir_all(a.sandbox.abra_home().join("servers/ci")).unwrap();
    let deploy_and_hold = "docker stack deploy --resolve-image never -c \"$COMPOSE\" \"$CCCI_STACK_NAME\" >/dev/null \
         && echo X=1 > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\" \
         && echo ready $$ $CCCI_FENCING_TOKEN $CCCI_STACK_NAME $CCCI_APP_DOMAIN; read _ || true";
    let mut cmd = a.run("a1", &[], deploy_and_hold);
    cmd.env("COMPOSE", &compose);
    let mut holder = Proc::spawn(cmd);
    let ready = holder.wait_for(Stream::Out, "ready");
    let words: Vec<&str> = ready.split_whitespace().collect();
    let (command_pid, stack, domain) = (words[1], words[3].to_owned(), words[4].to_owned());
    let _cleanup = crate::docker::Cleanup(stack.clone());
    let env = a
        .sandbox
        .abra_home()
        .join(format!("servers/ci/{domain}.env"));
    assert!(env.exists());

    // From the other host: the stack is there, its domain's key is held: live, and who holds it.
    let (report, done) = b.janitor();
    done.assert_code(0);
    let line = crate::util::candidate(&report, &domain);
    assert_eq!(line["decision"], "live", "{report:#}");
    assert_eq!(line["holder"]["run_id"], "a1", "{report:#}");
    assert!(
        !line["holder"]["host"].as_str().unwrap().is_empty(),
        "{report:#}"
    );

    // Host A dies: its supervisor and its command, without a teardown.
    signal(holder.pid(), Signal::SIGKILL);
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(command_pid.parse().unwrap()),
        Signal::SIGKILL,
    );
    drop(holder.finish());
    // Its lease runs out and its owner key with it; its tenure record stays, so the other
    // host's janitor first finds a holder that lost its lease without a release: the domain is
    // `live` while that holder's stop budget runs, then reaped, swarm-wide.
    let deadline = Instant::now() + PATIENCE;
    while cluster.keys().contains(&app_owner(&domain)) {
        assert!(
            Instant::now() < deadline,
            "the dead run's owner key never went"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (mut sweeps, mut said) = (Vec::new(), String::new());
    let report = loop {
        assert!(Instant::now() < deadline, "never reaped: {sweeps:?}");
        let (report, done) = b.janitor();
        done.assert_code(0);
        said.push_str(&done.stderr());
        let decision = crate::util::candidate(&report, &domain)["decision"].clone();
        sweeps.push(decision.clone());
        if decision == "reap" {
            break report;
        }
        assert_eq!(decision, "live", "{report:#}");
        std::thread::sleep(Duration::from_millis(250));
    };
    assert!(
        sweeps.len() > 1,
        "reaped before the stop budget: {report:#}"
    );
    // The sweep that found the holder's lease expired said so.
    assert!(
        said.contains("lost its lease without releasing the lock"),
        "{said}"
    );
    assert!(cluster.keys().is_empty(), "{}", cluster.keys());
    crate::docker::assert_gone_now(&stack);
    // Host A's own files are host A's: never touched from another host.
    assert!(env.exists(), "another host's .env was removed");
    // And a new run of the domain, on the other host, deploys the same stack at once.
    let mut cmd = b.run("b1", &[], deploy_and_hold);
    cmd.env("COMPOSE", &compose);
    std::fs::create_dir_all(b.sandbox.abra_home().join("servers/ci")).unwrap();
    let mut again = Proc::spawn(cmd);
    again.wait_for(Stream::Out, "ready");
    again.close_stdin();
    again.finish().assert_code(0);
    crate::docker::assert_gone_now(&stack);
}

#[test]
fn named_lock_classes_and_promotion_hold_across_hosts() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let (a, b) = (Host::on(&cluster, 4), Host::on(&cluster, 4));
    let order = a.sandbox.path().join("order");
    let lock = |host: &Host, who: &str, extra: &[&str]| {
        let script = format!("echo {who} >> {}", crate::util::sh_quote(&order));
        host.lock(extra, &script)
    };
    let mut holder = Proc::spawn(a.lock(&[], HOLD));
    holder.wait_ready();
    // In arrival order: a normal waiter, a normal one that is promoted soon, a fast one.
    let n1 = Proc::spawn(lock(&b, "n1", &[]));
    a.wait_for_waiters("cache", 1);
    let n2 = Proc::spawn(lock(&a, "n2", &["--promote-after", "0.2"]));
    a.wait_for_waiters("cache", 2);
    // n2 joins the fast class, keeping its place among the fast by its arrival.
    let deadline = Instant::now() + PATIENCE;
    loop {
        let locks = a.locks();
        let queue = locks[0]["queue"].clone();
        if queue
            .as_array()
            .is_some_and(|q| q.iter().any(|t| t["ticket"]["class"] == "fast"))
        {
            break;
        }
        assert!(Instant::now() < deadline, "n2 was never promoted: {locks}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let f1 = Proc::spawn(lock(&b, "f1", &["--class", "fast"]));
    a.wait_for_waiters("cache", 3);
    holder.close_stdin();
    holder.finish().assert_code(0);
    for waiter in [n1, n2, f1] {
        waiter.finish().assert_code(0);
    }
    assert_eq!(std::fs::read_to_string(&order).unwrap(), "n2\nf1\nn1\n");
}

#[test]
fn a_named_lock_whose_lease_runs_out_stops_its_command_with_76() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let host = Host::on(&cluster, 4);
    let mut holder = Proc::spawn(host.lock(&[], HOLD));
    let command_pid = holder.wait_ready();
    cluster.signal_all(Signal::SIGSTOP);
    holder.wait_for(Stream::Err, "the lock was lost while held");
    let done = holder.finish();
    cluster.signal_all(Signal::SIGCONT);
    done.assert_code(76);
    assert!(
        crate::util::wait_exited(command_pid),
        "the command outlived its lock"
    );
}

#[test]
fn a_signal_ends_a_wait_on_etcd_at_once_and_leaves_no_place_in_line() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let (a, b) = (Host::on(&cluster, 5), Host::on(&cluster, 5));
    let mut holder = Proc::spawn(a.run("a1", &[], HOLD));
    holder.wait_ready();
    let mut waiter = Proc::spawn(b.run("b1", &[], "echo must-not-run"));
    waiter.wait_for(Stream::Err, "waiting; held by run a1");
    signal(waiter.pid(), Signal::SIGTERM);
    let done = waiter.finish();
    done.assert_code(143);
    assert!(!done.out.join("\n").contains("must-not-run"));
    // Its waiter key went with it (not only when its lease ran out): nobody is queued.
    let locks = a.locks();
    let app = &locks.as_array().unwrap()[0];
    assert_eq!(app["waiters"], 0, "{locks}");
    assert_eq!(app["holder"]["run_id"], "a1", "{locks}");
    holder.close_stdin();
    holder.finish().assert_code(0);
}

/// The owner key of `domain`'s app lock.
fn app_owner(domain: &str) -> String {
    format!("/ccci-run/app/{domain}/owner")
}

/// Run `etcdctl` against `cluster`, which must succeed.
#[track_caller]
fn etcdctl(cluster: &Cluster, args: &[&str]) {
    let out = cluster.etcdctl(args);
    assert!(out.status.success(), "etcdctl {args:?}: {out:?}");
}

/// Nanoseconds since the Unix epoch, as `date +%s%N` in a command writes them.
fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// The timestamps (`date +%s%N`, one a line) in `path`.
fn stamps(path: &std::path::Path) -> Vec<u128> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// A command that keeps acting after SIGTERM (it writes the time to `$ACTS` every 20 ms, and
/// when TERM came to `$TERMED`) until it is SIGKILLed: the worst case of a holder whose lock
/// went behind its back.
const ACTS_THROUGH_TERM: &str = r#"trap 'date +%s%N > "$TERMED"' TERM; echo ready $$ $CCCI_FENCING_TOKEN; while :; do date +%s%N >> "$ACTS"; sleep 0.02; done"#;

/// Records when it starts (`$STARTED`) and its token, and ends.
const RECORDS_START: &str = r#"date +%s%N > "$STARTED"; echo ready $$ $CCCI_FENCING_TOKEN"#;

#[test]
fn an_owner_key_deleted_by_hand_stops_its_holder_at_once_and_the_next_starts_only_after_it_ended() {
    // The issue this guards: the holder never noticed, the next one started beside it.
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let (a, b) = (Host::on(&cluster, 6), Host::on(&cluster, 6));
    let dir = a.sandbox.path();
    let (acts, termed, started) = (dir.join("acts"), dir.join("termed"), dir.join("started"));
    let mut cmd = a.run("r1", &["--kill-grace", "1.5"], ACTS_THROUGH_TERM);
    cmd.env("ACTS", &acts).env("TERMED", &termed);
    let mut r1 = Proc::spawn(cmd);
    let ready = r1.wait_for(Stream::Out, "ready");
    let first_token = token_of(&ready);
    let mut cmd = b.run("r2", &["--lock-wait", "60"], RECORDS_START);
    cmd.env("STARTED", &started);
    let mut r2 = Proc::spawn(cmd);
    r2.wait_for(Stream::Err, "waiting; held by run r1");
    let domain = a.record("r1")["domain"].as_str().unwrap().to_owned();

    // The delete happens somewhere inside the etcdctl call: timed from its return (and its
    // start, for the command's SIGTERM, which is stamped by the command itself).
    let deleting_ns = now_ns();
    etcdctl(&cluster, &["del", &app_owner(&domain)]);
    let deleted = Instant::now();
    r1.wait_for(Stream::Err, "its owner key was deleted");
    let noticed = deleted.elapsed();
    let lost = r1.finish();
    lost.assert_code(76);
    lost.assert_stderr_has("the lock was lost while held — tearing down");
    let r1_ended = deleted.elapsed();
    assert_eq!(a.record("r1")["shutdown_reason"], "lock-lost");
    let next_token = token_of(&r2.wait_for(Stream::Out, "ready"));
    let second = r2.finish();
    second.assert_code(0);

    let termed_ns = stamps(&termed)[0];
    let last_act = *stamps(&acts).last().unwrap();
    let r2_start = stamps(&started)[0];
    let gap_ms = (r2_start as f64 - last_act as f64) / 1e6;
    eprintln!(
        "owner key deleted: r1 said so {noticed:?} after etcdctl returned, its command got \
         SIGTERM {:.1} ms after etcdctl started, r1 ended {r1_ended:?} after etcdctl returned; \
         r2's command started {gap_ms:.1} ms after r1's command last acted",
        (termed_ns as f64 - deleting_ns as f64) / 1e6
    );
    assert!(
        noticed < Duration::from_secs(1),
        "the holder took {noticed:?} to see its key gone"
    );
    assert!(
        r2_start > last_act,
        "the next holder's command started {:.1} ms before the last one's stopped acting",
        -gap_ms
    );
    // It waited for the last holder to end, and said so.
    second.assert_stderr_has("its last holder, run r1 (pid");
    assert!(next_token > first_token, "{next_token} after {first_token}");
}

#[test]
fn an_owner_key_replaced_by_hand_is_a_loss_and_junk_to_the_next_holder() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let (a, b) = (Host::on(&cluster, 5), Host::on(&cluster, 5));
    let mut r1 = Proc::spawn(a.run("r1", &[], HOLD));
    let first_token = token_of(&r1.wait_for(Stream::Out, "ready"));
    let mut r2 = Proc::spawn(b.run("r2", &["--lock-wait", "60"], HOLD));
    r2.wait_for(Stream::Err, "waiting; held by run r1");
    let domain = a.record("r1")["domain"].as_str().unwrap().to_owned();

    let replaced = Instant::now();
    etcdctl(&cluster, &["put", &app_owner(&domain), "written by hand"]);
    r1.wait_for(Stream::Err, "its owner key was replaced");
    let noticed = replaced.elapsed();
    let lost = r1.finish();
    lost.assert_code(76);
    // The hand-written key is nobody's lock: the next holder removes it and goes on.
    r2.wait_for(
        Stream::Err,
        "a key without a lease or record (written by hand?)",
    );
    let next_token = token_of(&r2.wait_for(Stream::Out, "ready"));
    eprintln!("owner key replaced: r1 saw it after {noticed:?}");
    assert!(noticed < Duration::from_secs(1), "{noticed:?}");
    assert!(next_token > first_token, "{next_token} after {first_token}");
    r2.close_stdin();
    r2.finish().assert_code(0);
    assert!(cluster.keys().is_empty(), "{}", cluster.keys());
}

#[test]
fn a_wiped_cluster_is_a_loss_to_its_holder_and_never_hands_out_a_smaller_token() {
    let Some(mut cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let ttl = 4;
    let (a, b) = (Host::on(&cluster, ttl), Host::on(&cluster, ttl));
    let dir = a.sandbox.path();
    let (acts, started) = (dir.join("acts"), dir.join("started"));
    // Revisions well above what the wiped cluster starts at.
    for i in 0..20 {
        etcdctl(&cluster, &["put", "/elsewhere/filler", &i.to_string()]);
    }
    let mut cmd = a.run(
        "r1",
        &[],
        r#"echo ready $$ $CCCI_FENCING_TOKEN; while :; do date +%s%N >> "$ACTS"; sleep 0.02; done"#,
    );
    cmd.env("ACTS", &acts);
    let mut r1 = Proc::spawn(cmd);
    let first_token = token_of(&r1.wait_for(Stream::Out, "ready"));

    cluster.wipe();
    let back = Instant::now();
    // A new run straight away, racing the old holder's notice.
    let mut cmd = b.run("r2", &["--lock-wait", "60"], RECORDS_START);
    cmd.env("STARTED", &started);
    let mut r2 = Proc::spawn(cmd);
    let loss = r1.wait_for(Stream::Err, "was lost:");
    let noticed = back.elapsed();
    r1.finish().assert_code(76);
    r2.wait_for(Stream::Err, "a new lock lineage begins");
    let next_token = token_of(&r2.wait_for(Stream::Out, "ready"));
    r2.finish().assert_code(0);
    let last_act = *stamps(&acts).last().unwrap();
    let r2_start = stamps(&started)[0];
    eprintln!(
        "cluster wiped: r1 saw it {noticed:?} after the cluster was back ({loss}); r2's command \
         started {:.1} ms after r1's last act; tokens {first_token} then {next_token}",
        (r2_start as f64 - last_act as f64) / 1e6
    );
    assert!(
        noticed < Duration::from_secs(u64::from(ttl)),
        "the holder took {noticed:?}"
    );
    assert!(r2_start > last_act, "the two holders overlapped");
    assert!(
        next_token > first_token,
        "a token after the wipe ({next_token}) is not above the one before ({first_token})"
    );
}

#[test]
fn a_cluster_restored_from_before_the_claim_is_a_loss_and_the_lineage_begins_again() {
    let Some(mut cluster) = crate::util::etcd_cluster() else {
        return;
    };
    // The restore stops, restores and restarts three members: seconds on a busy machine. With a
    // lease short enough for that to outlast the holder's keepalive window, the holder would
    // tear down for its silent lease before it could see the cluster went back in time.
    let ttl = 10;
    let (a, b) = (Host::on(&cluster, ttl), Host::on(&cluster, ttl));
    let mut r0 = Proc::spawn(a.run("r0", &[], HOLD));
    let zeroth = token_of(&r0.wait_for(Stream::Out, "ready"));
    // r1 is in line (its lease granted) when the snapshot is taken, and takes the lock after.
    let mut r1 = Proc::spawn(b.run("r1", &["--lock-wait", "60"], HOLD));
    r1.wait_for(Stream::Err, "waiting; held by run r0");
    let snapshot = cluster.save_snapshot();
    r0.close_stdin();
    r0.finish().assert_code(0);
    let first_token = token_of(&r1.wait_for(Stream::Out, "ready"));

    cluster.restore(&snapshot);
    let back = Instant::now();
    let loss = r1.wait_for(Stream::Err, "was lost:");
    let noticed = back.elapsed();
    assert!(loss.contains("went back in time"), "{loss}");
    // The holder that saw it begins a new lineage above its own token.
    r1.wait_for(Stream::Err, "a new lock lineage begins");
    r1.finish().assert_code(76);
    let mut r2 = Proc::spawn(a.run("r2", &["--lock-wait", "60"], HOLD));
    let next_token = token_of(&r2.wait_for(Stream::Out, "ready"));
    r2.close_stdin();
    r2.finish().assert_code(0);
    eprintln!(
        "restored from before the claim: r1 saw it {noticed:?} after the cluster was back; \
         tokens {zeroth}, {first_token}, then {next_token}"
    );
    assert!(noticed < Duration::from_secs(u64::from(ttl)), "{noticed:?}");
    assert!(
        next_token > first_token,
        "a token after the restore ({next_token}) is not above the one before ({first_token})"
    );
}

/// Write `key` without a lease, as an operator with etcdctl would.
fn put_junk(cluster: &Cluster, key: &str) {
    etcdctl(cluster, &["put", key, "written by hand"]);
}

/// The `locks --json` entry named `name`.
fn lock_entry(host: &Host, name: &str) -> Value {
    let locks = host.locks();
    locks
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == name)
        .cloned()
        .unwrap_or_else(|| panic!("no lock {name} in {locks}"))
}

#[test]
fn keys_without_a_lease_never_wedge_an_app_lock_and_the_janitor_removes_them() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let host = Host::on(&cluster, 4);
    let domain = host.sandbox.domain("custom-html", Some("1"));
    let junk_queue = format!("/ccci-run/app/{domain}/queue/0000000000000001");
    let junk = || {
        put_junk(&cluster, &app_owner(&domain));
        put_junk(&cluster, &junk_queue);
    };
    junk();
    // `locks` shows them for what they are: nobody holds the lock.
    let entry = lock_entry(&host, &domain);
    assert_eq!(entry["held"], false, "{entry}");
    assert_eq!(entry["waiters"], 0, "{entry}");
    assert!(
        entry["problem"].as_str().unwrap().contains("junk"),
        "{entry}"
    );
    // A run is not held up by them, nor by a lineage record written by hand (a new lineage
    // begins in its place).
    put_junk(&cluster, "/ccci-run/lineage");
    let done = run(host.run("r1", &["--lock-wait", "10"], "echo ran"));
    done.assert_code(0);
    assert!(done.out.join("\n").contains("ran"), "{}", done.transcript());
    done.assert_stderr_has("its lock lineage record /ccci-run/lineage is unreadable");

    // An orphan app behind junk keys is an orphan: reaped, and the junk removed.
    junk();
    host.sandbox.plant_env("ci", &domain, "X=1\n");
    let (report, swept) = host.janitor();
    swept.assert_code(0);
    let line = crate::util::candidate(&report, &domain);
    assert_eq!(line["decision"], "reap", "{report:#}");
    assert!(
        report["tidied"].to_string().contains(&junk_queue),
        "{report:#}"
    );
    assert!(cluster.keys().is_empty(), "{}", cluster.keys());
}

#[test]
fn keys_without_a_lease_never_wedge_a_named_lock_and_the_janitor_removes_them() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let host = Host::on(&cluster, 4);
    let junk_owner = "/ccci-run/named/cache/owner";
    let junk_queue = "/ccci-run/named/cache/queue/0000000000000001";
    // A tenure key where holders keep it, and where older versions kept it.
    let junk_tenure = "/ccci-run/tenure/named/cache/0000000000000001";
    let junk_old_tenure = "/ccci-run/named/cache/tenure/0000000000000002";
    put_junk(&cluster, junk_owner);
    put_junk(&cluster, junk_queue);
    put_junk(&cluster, junk_tenure);
    put_junk(&cluster, junk_old_tenure);
    let done = run(host.lock(&["--wait", "10"], "echo ran"));
    done.assert_code(0);
    assert!(done.out.join("\n").contains("ran"), "{}", done.transcript());

    // The claim removed the junk owner and tenure keys in its way; the queue's junk it only
    // looked past.
    put_junk(&cluster, junk_owner);
    put_junk(&cluster, junk_tenure);
    put_junk(&cluster, junk_old_tenure);
    let entry = lock_entry(&host, "cache");
    assert_eq!(entry["held"], false, "{entry}");
    assert_eq!(entry["waiters"], 0, "{entry}");
    let problem = entry["problem"].as_str().unwrap();
    assert!(
        [junk_owner, junk_queue, junk_tenure, junk_old_tenure]
            .iter()
            .all(|k| problem.contains(k)),
        "{entry}"
    );
    let (report, swept) = host.janitor();
    swept.assert_code(0);
    let tidied = report["tidied"].to_string();
    assert!(
        [junk_owner, junk_queue, junk_tenure, junk_old_tenure]
            .iter()
            .all(|k| tidied.contains(k)),
        "{report:#}"
    );
    assert!(cluster.keys().is_empty(), "{}", cluster.keys());
}

/// Named-lock holders on two hosts, one after another, get strictly increasing fencing tokens
/// (`CCCI_FENCING_TOKEN`), each the lineage's base plus the etcd revision that created the
/// holder's owner key; meanwhile `-n` on the other host gives up at once with `-E`'s code.
#[test]
fn named_lock_holders_across_hosts_see_strictly_increasing_fencing_tokens() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let (a, b) = (Host::on(&cluster, 5), Host::on(&cluster, 5));
    let mut seen: Vec<(i64, i64)> = Vec::new();
    for host in [&a, &b, &a, &b, &b] {
        let mut holder = Proc::spawn(host.lock(&[], HOLD));
        let token = token_of(&holder.wait_for(Stream::Out, "ready"));
        let out = cluster.etcdctl(&["get", "/ccci-run/named/cache/owner", "--write-out=json"]);
        assert!(out.status.success(), "{out:?}");
        let got: Value = serde_json::from_slice(&out.stdout).unwrap();
        let created = got["kvs"][0]["create_revision"]
            .as_i64()
            .unwrap_or_else(|| panic!("no owner key: {got}"));
        seen.push((token, created));
        // flock(1)'s -n and -E hold across hosts too: the other host gives up at once.
        let other = if std::ptr::eq(host, &a) { &b } else { &a };
        let done = run(other.lock(&["-n", "-E", "9"], "echo never"));
        done.assert_code(9);
        assert!(done.out.is_empty(), "{}", done.transcript());
        holder.close_stdin();
        holder.finish().assert_code(0);
    }
    assert!(
        seen.windows(2).all(|w| w[0].0 < w[1].0),
        "tokens must rise with every holder: {seen:?}"
    );
    let base = seen[0].0 - seen[0].1;
    assert!(
        seen.iter().all(|(token, created)| token - created == base),
        "every token is the base plus its owner key's create revision: {seen:?}"
    );
}

/// A holder's clean release hands the lock to the head waiter in the same transaction: the
/// owner key is overwritten, bound to the waiter's lease, the waiter's key and the last holder's
/// tenure go, and the waiter's own tenure record (with the terms its key named) is written. The
/// next holder's token is the lineage's base plus the handover's revision. A waiter whose key
/// names no terms (as an older version writes it) is never handed the lock: the release is the
/// plain one, and it claims it itself.
#[test]
fn a_clean_release_hands_the_lock_to_a_head_waiter_that_names_its_terms() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let (a, b) = (Host::on(&cluster, 5), Host::on(&cluster, 5));
    let get_json = |key: &str, prefix: bool| -> Value {
        let mut args = vec!["get", key, "--write-out=json"];
        if prefix {
            args.push("--prefix");
        }
        let out = cluster.etcdctl(&args);
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let values = |prefix: &str| -> Vec<Value> {
        let out = cluster.etcdctl(&["get", prefix, "--prefix", "--print-value-only"]);
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    };
    let owner = "/ccci-run/named/cache/owner";
    let (queue, tenures) = (
        "/ccci-run/named/cache/queue/",
        "/ccci-run/tenure/named/cache/",
    );

    let mut first = Proc::spawn(a.lock(&[], HOLD));
    let first_token = token_of(&first.wait_for(Stream::Out, "ready"));
    let created = get_json(owner, false)["kvs"][0]["create_revision"]
        .as_i64()
        .unwrap();
    let base = first_token - created;
    let mut second = Proc::spawn(b.lock(&[], HOLD));
    a.wait_for_waiters("cache", 1);
    let waiting = values(queue);
    assert_eq!(waiting.len(), 1, "{waiting:?}");
    assert_eq!(waiting[0]["terms"]["ttl_ms"], 5000, "{waiting:?}");
    let stop_budget = waiting[0]["terms"]["stop_budget_ms"].as_u64().unwrap();
    assert!(stop_budget > 0, "{waiting:?}");

    first.close_stdin();
    first.finish().assert_code(0);
    let second_token = token_of(&second.wait_for(Stream::Out, "ready"));
    let kv = get_json(owner, false)["kvs"][0].clone();
    let (created, written) = (
        kv["create_revision"].as_i64().unwrap(),
        kv["mod_revision"].as_i64().unwrap(),
    );
    assert!(created < written, "handed over, not claimed anew: {kv}");
    assert_eq!(second_token, base + written, "{kv}");
    assert!(second_token > first_token);
    assert!(values(queue).is_empty(), "the head's waiter key went");
    let held = values(tenures);
    assert_eq!(held.len(), 1, "only the new holder's tenure: {held:?}");
    assert_eq!(held[0]["ttl_ms"], 5000, "{held:?}");
    assert_eq!(held[0]["stop_budget_ms"], stop_budget, "{held:?}");
    let holder = held[0]["holder"].as_str().unwrap();
    assert!(
        holder.contains(&format!("\"pid\":{}", second.pid())),
        "the tenure names the new holder: {holder}"
    );

    // A waiter as an older version writes it: its own lease, no terms.
    let mut older = waiting[0].clone();
    older.as_object_mut().unwrap().remove("terms");
    let granted = cluster.etcdctl(&["lease", "grant", "60"]);
    assert!(granted.status.success(), "{granted:?}");
    let lease = String::from_utf8_lossy(&granted.stdout)
        .split_whitespace()
        .nth(1)
        .unwrap()
        .to_owned();
    let key = format!("{queue}{lease:0>16}");
    let put = cluster.etcdctl(&["put", &key, &older.to_string(), &format!("--lease={lease}")]);
    assert!(put.status.success(), "{put:?}");
    b.wait_for_waiters("cache", 1);
    second.close_stdin();
    second.finish().assert_code(0);
    assert_eq!(
        get_json(owner, false)["count"].as_i64().unwrap_or(0),
        0,
        "released, not handed to a waiter that names no terms"
    );
    assert!(values(tenures).is_empty());
    assert_eq!(values(queue).len(), 1, "the older waiter still waits");
    let revoked = cluster.etcdctl(&["lease", "revoke", &lease]);
    assert!(revoked.status.success(), "{revoked:?}");
    run(a.lock(&["-n"], "true")).assert_code(0);
}

/// Named lock `cache` handed, by its holder's clean release, to a head waiter stopped
/// (SIGSTOP) just before, with another waiter behind it.
struct StoppedHead {
    head: Proc,
    behind: Proc,
    first_token: i64,
    /// When the first holder had ended (and handed the lock over).
    released: Instant,
    /// The three hosts: their directories live as long as the test.
    _hosts: [Host; 3],
}

fn hand_to_a_stopped_head(cluster: &Cluster, ttl: u32) -> StoppedHead {
    let hosts = [
        Host::on(cluster, ttl),
        Host::on(cluster, ttl),
        Host::on(cluster, ttl),
    ];
    let mut first = Proc::spawn(hosts[0].lock(&[], HOLD));
    let first_token = token_of(&first.wait_for(Stream::Out, "ready"));
    let head = Proc::spawn(hosts[1].lock(&[], HOLD));
    hosts[0].wait_for_waiters("cache", 1);
    let behind = Proc::spawn(hosts[2].lock(&[], HOLD));
    hosts[0].wait_for_waiters("cache", 2);

    signal(head.pid(), Signal::SIGSTOP);
    first.close_stdin();
    first.finish().assert_code(0);
    let released = Instant::now();
    let out = cluster.etcdctl(&["get", "/ccci-run/named/cache/owner", "--print-value-only"]);
    let owner = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        owner.contains(&format!("\"pid\":{}", head.pid())),
        "handed to the stopped head: {owner}"
    );
    StoppedHead {
        head,
        behind,
        first_token,
        released,
        _hosts: hosts,
    }
}

/// A head waiter handed the lock while it is frozen, then killed, never runs its command; the
/// lock stays held by its lease alone, and the waiter behind it takes the lock once that lease
/// has run out (its look at the lease proves the frozen holder's command gone by then), not a
/// lapse later, with a larger token.
#[test]
fn a_head_waiter_killed_as_it_is_handed_the_lock_holds_it_no_longer_than_its_lease() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let ttl = 5;
    let mut handed = hand_to_a_stopped_head(&cluster, ttl);
    signal(handed.head.pid(), Signal::SIGKILL);
    let line = handed.behind.wait_for(Stream::Out, "ready");
    let waited = handed.released.elapsed();
    eprintln!("the waiter behind took the lock {waited:?} after the handover");
    assert!(token_of(&line) > handed.first_token, "{line}");
    // Its lease (at most the TTL from its last renewal), the look's slack, and the claim.
    let bound = Duration::from_secs(u64::from(ttl) + 3);
    assert!(
        waited < bound,
        "the lock was held {waited:?} after the handover to a dead waiter (bound {bound:?})"
    );
    let killed = handed.head.finish();
    assert!(
        !killed.out.iter().any(|l| l.contains("ready")),
        "the killed waiter's command never ran: {}",
        killed.transcript()
    );
    handed.behind.close_stdin();
    handed.behind.finish().assert_code(0);
}

/// A head waiter stopped while it is handed the lock, and resumed only once its lease has run
/// out and the waiter behind it holds the lock, never runs its command: the handover's event
/// waited for it all that time, and its lease is no longer safe by its own clock, so it reads
/// again and finds the lock another's. It ends as a waiter whose lease is gone.
#[test]
fn a_head_waiter_stopped_as_it_is_handed_the_lock_never_runs_once_its_lease_ran_out() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let mut handed = hand_to_a_stopped_head(&cluster, 5);
    handed.behind.wait_for(Stream::Out, "ready");
    signal(handed.head.pid(), Signal::SIGCONT);
    let resumed = handed.head.finish();
    assert!(
        !resumed.out.iter().any(|l| l.contains("ready")),
        "the resumed waiter ran its command beside the holder: {}",
        resumed.transcript()
    );
    assert_ne!(resumed.status.code(), Some(0), "{}", resumed.transcript());
    handed.behind.close_stdin();
    handed.behind.finish().assert_code(0);
}

/// A run whose command ends while no etcd member answers cannot prove it still holds its app
/// lock: its teardown hook does not run (nor would the app's removal), the record says why, and
/// the app is left to whoever holds the lock next, or to the janitor. Before, a lock whose loss
/// had not been noticed yet counted as held, and the hook acted on an app that may have been
/// another run's by then.
#[test]
fn a_teardown_acts_on_the_app_only_after_etcd_confirms_the_lock() {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let host = Host::on(&cluster, 5);
    let hook_ran = host.sandbox.path().join("hook-ran");
    let hook = format!("touch {}", hook_ran.display());
    let confirmed = run(host.run("r0", &["--on-teardown", &hook], "true"));
    confirmed.assert_code(0);
    assert!(hook_ran.exists(), "{}", confirmed.transcript());
    std::fs::remove_file(&hook_ran).unwrap();

    let mut r1 = Proc::spawn(host.run("r1", &["--on-teardown", &hook], HOLD));
    r1.wait_ready();
    cluster.signal_all(Signal::SIGSTOP);
    r1.close_stdin();
    r1.wait_for(Stream::Err, "finished, exit");
    let done = r1.finish();
    cluster.signal_all(Signal::SIGCONT);
    done.assert_stderr_has("the app lock is not provably ours before the teardown hook");
    assert!(!hook_ran.exists(), "{}", done.transcript());
    let record = host.record("r1");
    assert!(
        record["teardown_errors"]
            .to_string()
            .contains("not provably ours"),
        "{record}"
    );
}

/// A tenure record planted with a stop budget no configuration gives (`8e12` ms would bind the
/// lock to a lease of centuries; `u64::MAX` one etcd refuses), where tenure keys live and where
/// older versions kept them, and a fleet record of the same: junk, removed by the claim in its
/// way (the fleet record written afresh), the lock taken once a new lineage's own wait is over;
/// and by the janitor, which exits 0.
#[rstest::rstest]
#[case::centuries("8000000000000")]
#[case::u64_max("18446744073709551615")]
fn a_tenure_record_with_a_stop_budget_no_configuration_gives_is_junk(#[case] budget_ms: &str) {
    let Some(cluster) = crate::util::etcd_cluster() else {
        return;
    };
    let host = Host::on(&cluster, 5);
    // Where tenure keys live, and where older versions kept them: junk in either is junk.
    let record = format!("{{\"holder\":\"pid 1 run x\",\"stop_budget_ms\":{budget_ms}}}");
    let tenures = [
        "/ccci-run/tenure/named/cache/0000000000000001",
        "/ccci-run/named/cache/tenure/0000000000000002",
    ];
    for tenure in tenures {
        etcdctl(&cluster, &["put", tenure, &record]);
    }
    // A fleet record no host can have written.
    let fleet = format!("{{\"ttl_ms\":{budget_ms},\"stop_budget_ms\":{budget_ms}}}");
    etcdctl(&cluster, &["put", "/ccci-run/fleet", &fleet]);
    let started = std::time::Instant::now();
    let done = run(host.lock(&["--wait", "30"], "echo ran"));
    done.assert_code(0);
    assert!(done.out.join("\n").contains("ran"), "{}", done.transcript());
    // A new lineage waits out its own TTL (5 s) before its first claim; the junk would have
    // held it for centuries, or for good.
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}\n{}",
        started.elapsed(),
        done.transcript()
    );
    for tenure in tenures {
        etcdctl(&cluster, &["put", tenure, &record]);
    }
    let (report, swept) = host.janitor();
    swept.assert_code(0);
    for tenure in tenures {
        assert!(report["tidied"].to_string().contains(tenure), "{report:#}");
    }
    assert!(!cluster.keys().contains("tenure"), "{}", cluster.keys());
    // The fleet record the claim wrote afresh is one a host can have written.
    let fleet = cluster.etcdctl(&["get", "--print-value-only", "/ccci-run/fleet"]);
    let fleet = String::from_utf8_lossy(&fleet.stdout);
    assert!(!fleet.contains(budget_ms), "{fleet}");
}
