//! The flock-probe janitor against real flocks held by real processes.

use std::collections::BTreeMap;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::sys::signal::Signal;

use crate::util::{Proc, Sandbox, Stream, candidate, list, run, signal, wait_exited};

const SECRET: &str = "SECRET_TOKEN=hunter2-never-print-me";

fn orphan(n: usize) -> String {
    format!("orph-{n:06x}.ci.commoninternet.net")
}

/// A run whose supervisor is SIGKILLed leaves its app; the next probe reaps app and lock file.
#[test]
fn sigkilled_run_is_reaped_by_the_next_sweep() {
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.abra_home().join("servers/ci")).unwrap();
    let script = format!(
        "echo '{SECRET}' > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\"; echo ready $$; exec sleep 1000"
    );
    let mut live = Proc::spawn(sandbox.run_sh("77", &[], &script));
    let command = live.wait_ready();
    let domain = sandbox.domain("custom-html", None);

    let (report, _) = sandbox.janitor(&[]);
    assert_eq!(candidate(&report, &domain)["decision"], "live");

    signal(live.pid(), Signal::SIGKILL);
    live.finish();
    assert!(wait_exited(command));
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    let c = candidate(&report, &domain);
    assert_eq!(c["decision"], "reap", "{report:#}");
    assert_eq!(c["sources"], serde_json::json!(["env"]));
    assert_eq!(c["removed"]["env_files"].as_array().unwrap().len(), 1);
    assert_eq!(c["removed"]["lock_file"], true);
    assert!(
        !sandbox
            .abra_home()
            .join(format!("servers/ci/{domain}.env"))
            .exists()
    );
    assert!(!sandbox.lock_file(&domain).exists());
    let record = sandbox.record("77");
    assert!(
        record["reaped"].is_string(),
        "run.json not marked reaped: {record:#}"
    );
    // `stop` of it says a janitor has been, not that one will come.
    let mut stop = sandbox.ccci();
    stop.args(["stop", "77"]);
    let stopped = run(stop);
    stopped.assert_code(1);
    stopped.assert_stderr_has("a janitor already reaped what it left at ");
    assert!(
        !stopped
            .stderr()
            .contains("the next janitor sweep clears it"),
        "{}",
        stopped.transcript()
    );
    assert!(
        !done.out.join("\n").contains("hunter2"),
        ".env contents leaked"
    );
}

#[test]
fn live_run_is_never_touched() {
    let sandbox = Sandbox::new();
    let domain = orphan(1);
    let env = sandbox.plant_env("ci", &domain, SECRET);
    let mut holder = sandbox.hold_with_flock(&sandbox.lock_file(&domain));
    for extra in [&[][..], &["--dry-run"][..]] {
        let (report, done) = sandbox.janitor(extra);
        done.assert_code(0);
        assert_eq!(candidate(&report, &domain)["decision"], "live");
    }
    assert_eq!(std::fs::read_to_string(&env).unwrap(), SECRET);
    assert!(sandbox.lock_file(&domain).exists());
    holder.close_stdin();
    holder.finish().assert_code(0);
}

/// The warning names the threshold as given: `--long-held 5` once printed `held >0min`.
#[rstest::rstest]
#[case::default(&[], "2h")]
#[case::seconds(&["--long-held", "5"], "5s")]
#[case::mixed(&["--long-held", "90m"], "1h30m")]
fn long_held_lock_is_flagged_never_stolen(#[case] extra: &[&str], #[case] shown: &str) {
    let sandbox = Sandbox::new();
    let domain = orphan(2);
    let env = sandbox.plant_env("ci", &domain, SECRET);
    let lock = sandbox.lock_file(&domain);
    let mut holder = sandbox.hold_with_flock(&lock);
    let three_hours_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3 * 3600);
    std::fs::File::options()
        .write(true)
        .open(&lock)
        .unwrap()
        .set_modified(three_hours_ago)
        .unwrap();
    let (report, done) = sandbox.janitor(extra);
    done.assert_code(0);
    let c = candidate(&report, &domain);
    assert_eq!(c["decision"], "long-held");
    assert!(c["lock_age_s"].as_u64().unwrap() >= 3 * 3600);
    done.assert_stderr_has(&format!(
        "ccci-run: warning: lock for {domain} held >{shown} — possible leaked run; inspect with lslocks"
    ));
    assert!(env.exists() && lock.exists());
    holder.close_stdin();
    holder.finish().assert_code(0);
}

/// After a reboot /run/lock is empty: every surviving app probes free and is reaped at once.
#[test]
fn emptied_lock_dir_reaps_every_surviving_app() {
    let sandbox = Sandbox::new();
    let envs: Vec<PathBuf> = (0..5)
        .map(|n| sandbox.plant_env("ci", &orphan(n), SECRET))
        .collect();
    assert!(!sandbox.locks().exists());
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert_eq!(report["candidates"].as_array().unwrap().len(), 5);
    for n in 0..5 {
        assert_eq!(candidate(&report, &orphan(n))["decision"], "reap");
    }
    assert!(envs.iter().all(|e| !e.exists()));
    assert!(
        list(&sandbox.locks()).is_empty(),
        "{:?}",
        list(&sandbox.locks())
    );
}

#[test]
fn three_racing_janitors_reap_each_orphan_exactly_once() {
    let sandbox = Sandbox::new();
    const ORPHANS: usize = 60;
    for n in 0..ORPHANS {
        sandbox.plant_env(&format!("server{}", n % 3), &orphan(n), SECRET);
    }
    let (reaps, decisions) = sandbox.racing_janitors(3);
    for decision in &decisions {
        assert!(
            matches!(decision.as_str(), "reap" | "raced" | "live"),
            "unexpected {decision}"
        );
    }
    assert_eq!(reaps.len(), ORPHANS, "every orphan reaped");
    assert!(
        reaps.values().all(|&n| n == 1),
        "reaped more than once: {reaps:?}"
    );
    for n in 0..3 {
        assert!(list(&sandbox.abra_home().join(format!("servers/server{n}"))).is_empty());
    }
    assert!(list(&sandbox.locks()).is_empty());
}

#[test]
fn warm_and_foreign_suffix_apps_are_never_probed() {
    let sandbox = Sandbox::new();
    let warm = sandbox.plant_env("ci", "warm-keycloak.ci.commoninternet.net", SECRET);
    let other = sandbox.plant_env("ci", "abcd-123456.example.org", SECRET);
    let long = sandbox.plant_env("ci", "abcde-123456.ci.commoninternet.net", SECRET);
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert_eq!(report["candidates"], serde_json::json!([]));
    assert!(warm.exists() && other.exists() && long.exists());
    assert!(list(&sandbox.locks()).is_empty(), "probing left lock files");
}

/// Garbage at lock paths and under servers/: no crash, nothing reaped that should not be.
#[test]
fn garbage_is_skipped_and_reported_never_reaped() {
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.locks()).unwrap();
    let (dir_d, link_d, owner_d, immut_d) = (orphan(10), orphan(11), orphan(12), orphan(13));
    let envs: Vec<PathBuf> = [&dir_d, &link_d, &owner_d, &immut_d]
        .iter()
        .map(|d| sandbox.plant_env("ci", d, SECRET))
        .collect();
    std::fs::create_dir(sandbox.lock_file(&dir_d)).unwrap();
    let target = sandbox.path().join("victim");
    std::fs::write(&target, "keep").unwrap();
    std::os::unix::fs::symlink(&target, sandbox.lock_file(&link_d)).unwrap();
    std::fs::write(sandbox.lock_file(&owner_d), "").unwrap();
    nix::unistd::chown(
        &sandbox.lock_file(&owner_d),
        Some(nix::unistd::Uid::from_raw(65534)),
        None,
    )
    .unwrap();
    let immutable = sandbox.lock_file(&immut_d);
    std::fs::write(&immutable, "").unwrap();
    let chattr = |flag: &str| {
        let ok = std::process::Command::new("chattr")
            .arg(flag)
            .arg(&immutable)
            .status()
            .unwrap();
        assert!(
            ok.success(),
            "chattr {flag} (the sandbox must be on a filesystem with attributes)"
        );
    };
    chattr("+i");
    // Odd entries under servers/: a non-UTF-8 name, a directory named like an env file, a
    // stray file, a symlinked server directory.
    let servers = sandbox.abra_home().join("servers");
    std::fs::write(
        servers
            .join("ci")
            .join(std::ffi::OsStr::from_bytes(b"\xff\xfe.env")),
        SECRET,
    )
    .unwrap();
    std::fs::create_dir(servers.join("ci").join(format!("{}.env", orphan(14)))).unwrap();
    std::fs::write(servers.join("not-a-server-dir.env"), SECRET).unwrap();
    std::os::unix::fs::symlink(sandbox.path(), servers.join("linked-server")).unwrap();

    let (report, done) = sandbox.janitor(&[]);
    chattr("-i");
    // The immutable lock file is a candidate the janitor could not act on: the sweep failed.
    done.assert_code(1);
    assert_eq!(candidate(&report, &dir_d)["decision"], "foreign");
    assert_eq!(candidate(&report, &link_d)["decision"], "foreign");
    assert_eq!(candidate(&report, &owner_d)["decision"], "foreign");
    assert_eq!(candidate(&report, &immut_d)["decision"], "unreadable");
    assert_eq!(
        report["candidates"].as_array().unwrap().len(),
        4,
        "{report:#}"
    );
    assert!(
        envs.iter().all(|e| e.exists()),
        "an app behind a bad lock file was reaped"
    );
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
    assert!(
        sandbox
            .lock_file(&link_d)
            .symlink_metadata()
            .unwrap()
            .file_type()
            .is_symlink()
    );
    done.assert_stderr_has("ccci-run: warning: janitor:");
    assert!(!done.out.join("\n").contains("hunter2") && !done.stderr().contains("hunter2"));
}

/// A fingerprint of every file under `root`: type, mode, owner, size, mtime and contents.
fn snapshot(root: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let body = if meta.is_file() {
                format!("{:?}", std::fs::read(&path).unwrap())
            } else if meta.file_type().is_symlink() {
                format!("-> {:?}", std::fs::read_link(&path).unwrap())
            } else {
                stack.push(path.clone());
                "dir".to_owned()
            };
            out.insert(
                path,
                format!(
                    "{:o} {} {} {}.{} {body}",
                    meta.mode(),
                    meta.uid(),
                    meta.len(),
                    meta.mtime(),
                    meta.mtime_nsec()
                ),
            );
        }
    }
    out
}

#[test]
fn dry_run_changes_nothing_at_all() {
    let sandbox = Sandbox::new();
    for n in 0..4 {
        sandbox.plant_env("ci", &orphan(n), SECRET);
    }
    // One orphan with a stale lock file, one live, one stale lock file with no app.
    std::fs::create_dir_all(sandbox.locks()).unwrap();
    std::fs::write(sandbox.lock_file(&orphan(0)), "{}").unwrap();
    std::fs::set_permissions(
        sandbox.lock_file(&orphan(0)),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    std::fs::write(sandbox.lock_file(&orphan(9)), "").unwrap();
    let mut holder = sandbox.hold_with_flock(&sandbox.lock_file(&orphan(1)));
    let before = snapshot(sandbox.path());
    let (report, done) = sandbox.janitor(&["--dry-run"]);
    let after = snapshot(sandbox.path());
    done.assert_code(0);
    assert_eq!(report["dry_run"], true);
    assert_eq!(candidate(&report, &orphan(0))["decision"], "would-reap");
    assert_eq!(candidate(&report, &orphan(1))["decision"], "live");
    assert_eq!(candidate(&report, &orphan(2))["decision"], "would-reap");
    assert_eq!(report["tidied"].as_array().unwrap().len(), 1);
    assert_eq!(before, after, "a dry run changed the tree");
    holder.close_stdin();
    holder.finish().assert_code(0);
}

#[test]
fn tidy_unlinks_unheld_lock_files_without_an_app_but_not_held_ones() {
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.locks()).unwrap();
    let stale = sandbox.lock_file(&orphan(20));
    std::fs::write(&stale, "").unwrap();
    let held = sandbox.lock_file(&orphan(21));
    let mut holder = sandbox.hold_with_flock(&held);
    let unrelated = sandbox
        .locks()
        .join("cc-ci-app-warm-keycloak.ci.commoninternet.net.lock");
    std::fs::write(&unrelated, "").unwrap();
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert_eq!(report["tidied"], serde_json::json!([stale]));
    assert!(!stale.exists() && held.exists() && unrelated.exists());
    holder.close_stdin();
    holder.finish().assert_code(0);
}

#[test]
fn unsafe_lock_dir_fails_the_sweep_with_exit_1() {
    let sandbox = Sandbox::new();
    sandbox.plant_env("ci", &orphan(1), SECRET);
    std::fs::create_dir_all(sandbox.locks()).unwrap();
    std::fs::set_permissions(sandbox.locks(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(1);
    assert!(
        report["errors"][0]
            .as_str()
            .unwrap()
            .contains("refusing lock directory")
    );
    assert!(
        sandbox
            .abra_home()
            .join(format!("servers/ci/{}.env", orphan(1)))
            .exists()
    );
}

#[test]
fn table_output_and_metrics_file() {
    let sandbox = Sandbox::new();
    sandbox.plant_env("ci", &orphan(1), SECRET);
    let metrics = sandbox.path().join("ccci.prom");
    let mut cmd = sandbox.ccci();
    cmd.args(["janitor", "--metrics-file"]).arg(&metrics);
    let done = run(cmd);
    done.assert_code(0);
    let table = done.out.join("\n");
    assert!(
        table.contains("DECISION") && table.contains(&orphan(1)) && table.contains("reap"),
        "{table}"
    );
    let text = std::fs::read_to_string(&metrics).unwrap();
    for line in [
        // The orphan's lock file went with its app (removed, not tidied); no state file.
        "ccci_janitor_tidied_lock_files 0",
        "ccci_janitor_tidied_state_files 0",
        "ccci_janitor_candidates{decision=\"reap\"} 1",
        "ccci_janitor_candidates{decision=\"live\"} 0",
        "ccci_janitor_removed{kind=\"env_files\"} 1",
        "ccci_janitor_sweep_failed 0",
        "# TYPE ccci_janitor_sweep_duration_seconds gauge",
        "ccci_janitor_last_success_timestamp_seconds ",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
}

/// `janitor --dry-run` and `locks` fit 100 columns, long values cut with `…`; `-o wide` cuts
/// nothing. Ages read as in `runs` (`3h0m`), in both.
#[test]
fn janitor_and_locks_tables_fit_100_columns_and_wide_shows_everything() {
    let sandbox = Sandbox::new();
    // A live run holding its lock: a holder to show (started first: its start sweep would
    // reap the dead run's app).
    let mut live =
        Proc::spawn(sandbox.run_sh("wide-1", &["--pr", "9"], "echo ready $$; read line || :"));
    live.wait_ready();
    // An app of a dead run: a free lock three hours old, its .env, a long detail.
    let domain = orphan(0x4242);
    let env = sandbox.plant_env("ci", &domain, SECRET);
    let lock = sandbox.lock_file(&domain);
    std::fs::create_dir_all(lock.parent().unwrap()).unwrap();
    std::fs::write(&lock, "").unwrap();
    crate::util::age(&lock, std::time::Duration::from_secs(3 * 3600));
    let lines = |args: &[&str]| {
        let mut cmd = sandbox.ccci();
        cmd.args(args);
        let done = run(cmd);
        done.assert_code(0);
        done.out
    };
    let widest = |out: &[String]| out.iter().map(|l| l.chars().count()).max().unwrap_or(0);
    let table = lines(&["janitor", "--dry-run"]);
    assert!(
        widest(&table) <= 100,
        "wider than 100:\n{}",
        table.join("\n")
    );
    let row = table
        .iter()
        .find(|l| l.starts_with(&domain))
        .unwrap_or_else(|| panic!("{}", table.join("\n")));
    assert!(row.contains("would-reap"), "{row}");
    assert!(row.ends_with('…'), "the detail is cut: {row}");
    let wide = lines(&["janitor", "--dry-run", "-o", "wide"]);
    let row = wide.iter().find(|l| l.starts_with(&domain)).unwrap();
    assert!(
        row.contains(&format!(".env {}", env.display())),
        "-o wide cuts nothing: {row}"
    );
    let locks = lines(&["locks"]);
    assert!(
        widest(&locks) <= 100,
        "wider than 100:\n{}",
        locks.join("\n")
    );
    let row = locks.iter().find(|l| l.contains(&domain)).unwrap();
    assert!(row.contains(" 3h0m "), "{row}");
    let wide = lines(&["locks", "--wide"]);
    assert!(
        wide.iter()
            .any(|l| l.contains("run wide-1 pid ") && l.contains(" since ")),
        "{}",
        wide.join("\n")
    );
    live.close_stdin();
    live.finish().assert_code(0);
}

#[test]
fn locks_lists_holders_from_proc_locks() {
    let sandbox = Sandbox::new();
    let mut live =
        Proc::spawn(sandbox.run_sh("lk", &["--pr", "5"], "echo ready $PPID; read line || :"));
    let pid = live.wait_ready();
    let domain = sandbox.domain("custom-html", Some("5"));
    std::fs::write(sandbox.lock_file(&orphan(3)), "garbage \u{1b}[31m").unwrap();
    let mut cmd = sandbox.ccci();
    cmd.args(["locks", "--json"]);
    let done = run(cmd);
    done.assert_code(0);
    let locks: serde_json::Value =
        serde_json::from_str::<serde_json::Value>(&done.out.join("\n")).unwrap()["locks"].clone();
    let find = |name: &str| {
        locks
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["name"] == name)
            .unwrap_or_else(|| panic!("{name} missing from {locks:#}"))
            .clone()
    };
    let held = find(&domain);
    assert_eq!(held["held"], true);
    assert_eq!(held["holder_pids"], serde_json::json!([pid]));
    assert_eq!(held["holder"]["run_id"], "lk");
    assert_eq!(held["long_held"], false);
    let stale = find(&orphan(3));
    assert_eq!(stale["held"], false);
    assert!(stale["holder"].is_null());
    // Shown, never sent raw: the escape character is written out as `runs --json` writes it.
    assert_eq!(stale["holder_raw"], "garbage \\u{1b}[31m");
    let mut cmd = sandbox.ccci();
    cmd.arg("locks");
    let table = run(cmd);
    table.assert_code(0);
    let text = table.out.join("\n");
    assert!(text.contains(&format!("run lk pid {pid}")), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "raw control characters reached the terminal"
    );
    live.close_stdin();
    live.finish().assert_code(0);
}

/// Every run sweeps at its start: an orphan of another run is gone before its command starts.
#[test]
fn run_start_sweeps_orphans_and_survives_a_broken_sweep() {
    let sandbox = Sandbox::new();
    let env = sandbox.plant_env("ci", &orphan(30), SECRET);
    let done = run(sandbox.run_sh("s1", &[], "echo ran"));
    done.assert_code(0);
    done.assert_stderr_has(&format!(
        "== janitor: reaped orphaned app {} ==",
        orphan(30)
    ));
    assert!(!env.exists());
    // A reap that fails (an immutable server directory) is reported, never fatal to the run.
    let server = sandbox.abra_home().join("servers/frozen");
    let stuck = sandbox.plant_env("frozen", &orphan(31), SECRET);
    let chattr = |flag: &str| {
        let status = std::process::Command::new("chattr")
            .arg(flag)
            .arg(&server)
            .status()
            .unwrap();
        assert!(status.success(), "chattr {flag}");
    };
    chattr("+i");
    let done = run(sandbox.run_sh("s2", &[], "echo ran"));
    chattr("-i");
    done.assert_code(0);
    assert_eq!(done.out, vec!["ran"]);
    done.assert_stderr_has(&format!("janitor: failed to reap {}", orphan(31)));
    assert!(stuck.exists());
}

#[test]
fn waiting_run_blocks_until_a_reap_under_the_probe_lock_is_over() {
    // strace stops the janitor at the one system call after its probe flock.
    if !crate::util::need("strace") {
        return;
    }
    let sandbox = Sandbox::new();
    let domain = sandbox.domain("custom-html", None);
    let env = sandbox.plant_env("ci", &domain, SECRET);
    // Stop the janitor right after its probe flock succeeded: it holds the probe lock and has
    // not removed anything yet.
    let mut cmd = std::process::Command::new("strace");
    let janitor = sandbox.ccci();
    cmd.args([
        "-f",
        "-qq",
        "-e",
        "trace=flock",
        "-e",
        "inject=flock:signal=SIGSTOP:when=1",
    ])
    .arg(janitor.get_program())
    .args(janitor.get_args())
    .arg("janitor");
    let mut janitor = Proc::spawn(cmd);
    janitor.wait_for(Stream::Err, "stopped by SIGSTOP");
    let mut waiter = Proc::spawn(sandbox.run_sh(
        "after-reap",
        &[],
        "test -e \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\" && echo saw-half-reaped-app; echo ready $$",
    ));
    waiter.wait_for(Stream::Err, "== app lock: another run of");
    assert!(env.exists(), "the reap ran ahead of the stop");
    // The stopped janitor is strace's child.
    let tracer = janitor.pid().to_string();
    let stopped = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                stat.rsplit_once(')')
                    .and_then(|(_, tail)| tail.split_whitespace().nth(1).map(|p| p == tracer))
                    .unwrap_or(false)
            })
        })
        .collect::<Vec<_>>();
    assert_eq!(stopped.len(), 1, "{stopped:?}");
    signal(stopped[0], Signal::SIGCONT);
    let done = janitor.finish();
    done.assert_code(0);
    let done_wait = waiter.finish();
    done_wait.assert_code(0);
    assert!(
        !done_wait.out.iter().any(|l| l == "saw-half-reaped-app"),
        "{}",
        done_wait.transcript()
    );
    assert!(!env.exists());
}

/// `--docker auto` with no engine: one warning, nothing that may have Docker resources reaped
/// (its .env is the only trace of a stack that may still run), exit 1.
#[test]
fn unreachable_docker_is_never_a_reason_to_lose_an_env() {
    let mut sandbox = Sandbox::new();
    let env = sandbox.plant_env("ci", &orphan(40), SECRET);
    let nowhere = format!(
        "unix://{}",
        sandbox.path().join("no-such-docker.sock").display()
    );

    sandbox.set_docker("auto");
    let mut cmd = sandbox.ccci();
    cmd.env("DOCKER_HOST", &nowhere).args(["janitor", "--json"]);
    let done = run(cmd);
    done.assert_code(1);
    let report: serde_json::Value = serde_json::from_str(&done.out.join("\n")).unwrap();
    let c = candidate(&report, &orphan(40));
    assert_eq!(c["decision"], "would-reap");
    assert!(
        c["error"]
            .as_str()
            .unwrap()
            .starts_with("docker unavailable"),
        "{c:#}"
    );
    assert_eq!(
        done.err
            .iter()
            .filter(|l| l.contains("apps that may have Docker resources are not reaped"))
            .filter(|l| l.starts_with("ccci-run: warning: janitor: "))
            .count(),
        1,
        "{}",
        done.transcript()
    );
    assert!(env.exists());

    sandbox.set_docker("required");
    let mut cmd = sandbox.ccci();
    cmd.env("DOCKER_HOST", &nowhere).args(["janitor", "--json"]);
    let done = run(cmd);
    done.assert_code(1);
    // Both refusals say what to do: start or name an engine, or choose another mode.
    let hint = "start the Docker engine, or point DOCKER_HOST at one";
    let modes = "set --docker auto (Docker apps are left alone while it is unreachable) or \
                 --docker off (also CCCI_DOCKER, or docker in the configuration file)";
    let out = done.out.join("\n");
    assert!(
        out.contains("Docker is required (--docker required)")
            && out.contains(hint)
            && out.contains(modes),
        "{}",
        done.transcript()
    );
    assert!(env.exists());
    // The table's dry run: the error on stderr under the one prefix, not in the table; the
    // exit code unchanged.
    let mut cmd = sandbox.ccci();
    cmd.env("DOCKER_HOST", &nowhere)
        .args(["janitor", "--dry-run"]);
    let done = run(cmd);
    done.assert_code(1);
    done.assert_stderr_has("ccci-run: error: Docker is required (--docker required)");
    assert!(
        !done.out.join("\n").contains("Docker is required"),
        "the error went to stdout: {}",
        done.transcript()
    );
    assert!(
        done.err.iter().all(|l| !l.starts_with("!!")),
        "{}",
        done.transcript()
    );

    let mut cmd = sandbox.run_sh("dreq", &[], "echo must-not-run");
    cmd.env("DOCKER_HOST", &nowhere);
    let done = run(cmd);
    done.assert_code(125);
    done.assert_stderr_has("Docker is required (--docker required)");
    done.assert_stderr_has(hint);
    done.assert_stderr_has(modes);
    assert!(done.out.is_empty());

    // auto: the run goes on; its teardown keeps its .env and says why.
    sandbox.set_docker("auto");
    std::fs::create_dir_all(sandbox.abra_home().join("servers/ci")).unwrap();
    let mut cmd = sandbox.run_sh(
        "dauto",
        &["--pr", "8"],
        "echo X=1 > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\"; echo ran",
    );
    cmd.env("DOCKER_HOST", &nowhere);
    let done = run(cmd);
    done.assert_code(0);
    let errors = sandbox.record("dauto")["teardown_errors"].to_string();
    assert!(errors.contains("keeping the app's .env"), "{errors}");
    let domain = sandbox.domain("custom-html", Some("8"));
    assert!(
        sandbox
            .abra_home()
            .join(format!("servers/ci/{domain}.env"))
            .exists()
    );

    // off: Docker is never asked; the .env-only app is reaped.
    sandbox.set_docker("off");
    let mut cmd = sandbox.ccci();
    cmd.env("DOCKER_HOST", &nowhere).args(["janitor", "--json"]);
    let done = run(cmd);
    done.assert_code(0);
    assert!(!env.exists());
}

/// A SIGKILLed run cannot remove its own state files: the next sweep must (found by the chaos
/// harness, seed 1). A live run's files, and a same-id successor's, stay.
#[test]
fn state_files_of_a_sigkilled_run_are_tidied_by_the_next_sweep() {
    let sandbox = Sandbox::new();
    let mut dead =
        Proc::spawn(sandbox.run_sh("reused", &["--pr", "1"], "echo ready $$; exec sleep 1000"));
    let command = dead.wait_ready();
    let dead_files = sandbox.state_files();
    assert_eq!(dead_files.len(), 4);
    signal(dead.pid(), Signal::SIGKILL);
    dead.finish();
    assert!(wait_exited(command));
    let (report, done) = sandbox.janitor(&["--dry-run"]);
    done.assert_code(0);
    // The dead run's cgroup, emptied by its fence: removed, with nothing to kill in it.
    let mut cmd = sandbox.ccci();
    cmd.args(["janitor", "--dry-run"]);
    let table = run(cmd).out.join("\n");
    assert!(!table.contains("(0 process(es))"), "{table}");
    if sandbox.record("reused")["cgroup"].is_string() {
        assert!(table.contains("would remove the empty cgroup "), "{table}");
    }
    let tidied = report["tidied"].to_string();
    assert!(
        dead_files.iter().all(|f| tidied.contains(f.as_str())),
        "{report:#}"
    );
    assert_eq!(
        sandbox.state_files(),
        dead_files,
        "a dry run removed state files"
    );
    // The metrics count the lock files and the state files a sweep tidies apart.
    let lock_files = report["tidied"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p.as_str().unwrap().ends_with(".lock"))
        .count();
    let metrics = sandbox.path().join("ccci.prom");
    let mut cmd = sandbox.ccci();
    cmd.args(["janitor", "--metrics-file"]).arg(&metrics);
    run(cmd).assert_code(0);
    let text = std::fs::read_to_string(&metrics).unwrap();
    assert!(
        text.contains(&format!(
            "\nccci_janitor_tidied_state_files {}\n",
            dead_files.len()
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!("\nccci_janitor_tidied_lock_files {lock_files}\n")),
        "{text}"
    );
    assert!(sandbox.state_files().is_empty());

    // A live run's own files stay through later sweeps.
    let mut live =
        Proc::spawn(sandbox.run_sh("other", &["--pr", "2"], "echo ready $$; read line || :"));
    live.wait_ready();
    let live_files = sandbox.state_files();
    assert_eq!(live_files.len(), 4);
    assert!(
        live_files.iter().all(|f| f.contains("-other-")),
        "{live_files:?}"
    );
    let (_, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert_eq!(sandbox.state_files(), live_files);
    live.close_stdin();
    live.finish().assert_code(0);
    assert!(sandbox.state_files().is_empty());
}

/// Defense in depth: a live run's app is never reaped, whatever the lock dir says — its lock
/// file deleted by hand, or a janitor started with another lock dir than the run (a drifted
/// CCCI_APP_LOCK_DIR). The runs dir knows the run is live; the mismatch is reported.
#[rstest::rstest]
#[case::lock_file_deleted_by_hand(false)]
#[case::janitor_with_another_lock_dir(true)]
fn live_run_is_never_reaped_whatever_the_lock_dir_says(#[case] other_lock_dir: bool) {
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.abra_home().join("servers/ci")).unwrap();
    let script =
        "echo x > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\"; echo ready $$; read line || :";
    let mut holder = crate::util::Proc::spawn(sandbox.run_sh("dd", &[], script));
    holder.wait_ready();
    let domain = sandbox.domain("custom-html", None);
    let env = sandbox.abra_home().join(format!("servers/ci/{domain}.env"));
    let mut janitor = sandbox.ccci();
    if other_lock_dir {
        janitor
            .arg("--lock-dir")
            .arg(sandbox.path().join("drifted-locks"));
    } else {
        std::fs::remove_file(sandbox.lock_file(&domain)).unwrap();
    }
    janitor.args(["janitor", "--json"]);
    let done = crate::util::run(janitor);
    done.assert_code(0);
    let report: serde_json::Value = serde_json::from_str(&done.out.join("\n")).unwrap();
    let c = crate::util::candidate(&report, &domain);
    assert_eq!(c["decision"], "live", "{report:#}");
    assert_eq!(
        c["error"], "held by run dd under another lock dir",
        "{report:#}"
    );
    done.assert_stderr_has("not reaping");
    assert!(env.exists(), "a live run's app was reaped");
    holder.close_stdin();
    holder.finish().assert_code(0);
}

/// A typo in a path is not a clean sweep: the janitor says where it looked, and warns (on
/// stderr, and in the JSON report) about a directory that does not exist, naming the option
/// that sets it. `locks` does the same for its lock dir.
#[test]
fn a_missing_directory_is_named_not_swept_silently() {
    let sandbox = Sandbox::new();
    let mut cmd = sandbox.ccci();
    cmd.args(["--abra-home", "/nonexistent/abra", "--lock-dir"])
        .arg(sandbox.path().join("no-such-locks"))
        .args(["janitor", "--dry-run", "--wide"]);
    let done = run(cmd);
    done.assert_code(0);
    done.assert_stderr_has(
        "warning: /nonexistent/abra/servers does not exist (--abra-home, CCCI_ABRA_HOME)",
    );
    done.assert_stderr_has(
        "(--lock-dir, CCCI_APP_LOCK_DIR, lock_dir) does not exist: nothing there yet",
    );
    let out = done.out.join("\n");
    assert!(
        out.contains(".env files /nonexistent/abra/servers/*/*.env"),
        "{out}"
    );

    let mut cmd = sandbox.ccci();
    cmd.args([
        "--abra-home",
        "/nonexistent/abra",
        "janitor",
        "--json",
        "--dry-run",
    ]);
    let done = run(cmd);
    let report: serde_json::Value = serde_json::from_str(&done.out.join("\n")).unwrap();
    assert!(
        report["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w.as_str().unwrap().contains("--abra-home")),
        "{report:#}"
    );

    let mut cmd = sandbox.ccci();
    cmd.arg("--lock-dir")
        .arg(sandbox.path().join("no-such-locks"))
        .arg("locks");
    let done = run(cmd);
    done.assert_code(0);
    done.assert_stderr_has("(--lock-dir, CCCI_APP_LOCK_DIR, lock_dir) does not exist");
}

/// The summary line tells reaped from would-be-reaped (an engine that does not answer turns a
/// reap into the latter in a real sweep too) and lock files from state files; a dry run with
/// `--metrics-file` says that it wrote none.
#[test]
fn the_summary_counts_what_really_happened() {
    let mut sandbox = Sandbox::new();
    sandbox.plant_env("ci", &orphan(41), SECRET);
    let nowhere = format!(
        "unix://{}",
        sandbox.path().join("no-such-docker.sock").display()
    );
    sandbox.set_docker("auto");
    let mut cmd = sandbox.ccci();
    cmd.env("DOCKER_HOST", &nowhere).arg("janitor");
    let done = run(cmd);
    done.assert_code(1);
    let summary = done.out.last().unwrap();
    assert!(
        summary.starts_with(
            "1 candidate(s), 0 reaped, 1 would be reaped, 0 lock file(s) and 0 state file(s) tidied"
        ),
        "{summary}"
    );

    // A dead run's state file is tidied, and called a state file.
    std::fs::create_dir_all(sandbox.state()).unwrap();
    std::fs::write(
        sandbox
            .state()
            .join(format!("ccci-deploys-{}-55-4242", sandbox.scope())),
        "",
    )
    .unwrap();
    sandbox.set_docker("off");
    let mut cmd = sandbox.ccci();
    let metrics = sandbox.path().join("ccci.prom");
    cmd.args(["janitor", "--dry-run", "--metrics-file"])
        .arg(&metrics);
    let done = run(cmd);
    done.assert_code(0);
    let summary = done.out.last().unwrap();
    assert!(
        summary.contains("1 would be reaped, 0 lock file(s) and 1 state file(s) to tidy"),
        "{summary}"
    );
    done.assert_stderr_has("--dry-run changes nothing: metrics not written to");
    assert!(!metrics.exists());
}

/// The metrics file is 0644 whatever the umask: the janitor's unit runs with UMask=0077, and
/// node_exporter reads the file as a user of its own (here: nobody, through setpriv).
#[test]
fn metrics_file_is_readable_by_another_user_under_umask_077() {
    let sandbox = Sandbox::new();
    let dir = sandbox.path().join("textfile");
    std::fs::create_dir(&dir).unwrap();
    for d in [sandbox.path(), dir.as_path()] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let metrics = dir.join("ccci-run.prom");
    let mut janitor = sandbox.ccci();
    janitor.args(["janitor", "--metrics-file"]).arg(&metrics);
    // The umask is set by the shell that execs the janitor, and reported, so the test knows it
    // was in force.
    let mut cmd = std::process::Command::new("sh");
    cmd.args([
        "-c",
        "umask 077 && echo \"umask $(umask)\" && exec \"$@\"",
        "sh",
    ])
    .arg(janitor.get_program())
    .args(janitor.get_args());
    for (key, value) in janitor.get_envs() {
        match value {
            Some(value) => cmd.env(key, value),
            None => cmd.env_remove(key),
        };
    }
    let done = run(cmd);
    done.assert_code(0);
    assert_eq!(
        done.out.first().map(String::as_str),
        Some("umask 0077"),
        "{}",
        done.transcript()
    );
    let mode = std::fs::metadata(&metrics).unwrap().mode() & 0o7777;
    assert_eq!(mode, 0o644, "metrics file mode {mode:o}");
    let mut cat = std::process::Command::new("setpriv");
    cat.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--",
        "cat",
    ])
    .arg(&metrics);
    let read = run(cat);
    read.assert_code(0);
    assert!(
        read.out
            .iter()
            .any(|l| l.starts_with("ccci_janitor_sweep_failed 0")),
        "{}",
        read.transcript()
    );
}

/// abra's recommended layout: each server's `.env` files in a repository of their own, linked
/// into `servers/`. A SIGKILLed run's app whose `.env` is behind such a link is found and
/// reaped by the janitor (its `.env` removed from the link's target, the link kept), and a
/// finished run's own teardown removes its `.env` through the link. A link to a directory of
/// another user, or one others may write to, is not followed and is named; what is behind it
/// is left alone.
#[test]
fn linked_server_directories_are_followed_only_to_directories_we_trust() {
    use std::os::unix::fs::symlink;
    let sandbox = Sandbox::new();
    let servers = sandbox.abra_home().join("servers");
    std::fs::create_dir_all(&servers).unwrap();
    let repo = sandbox.path().join("server-repo");
    std::fs::create_dir(&repo).unwrap();
    std::fs::set_permissions(&repo, std::fs::Permissions::from_mode(0o755)).unwrap();
    symlink(&repo, servers.join("ci")).unwrap();

    // A run's own teardown, through the link.
    let script = "echo x > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\"";
    run(sandbox.run_sh("own", &["--pr", "1"], script)).assert_code(0);
    let domain = sandbox.domain("custom-html", Some("1"));
    assert!(
        !repo.join(format!("{domain}.env")).exists(),
        "the run's teardown left its .env behind the link"
    );

    // A SIGKILLed run's app, reaped by the janitor through the link.
    let script =
        "echo x > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\"; echo ready $$; exec sleep 1000";
    let mut live = Proc::spawn(sandbox.run_sh("77", &["--pr", "2"], script));
    let command = live.wait_ready();
    let domain = sandbox.domain("custom-html", Some("2"));
    signal(live.pid(), Signal::SIGKILL);
    live.finish();
    assert!(wait_exited(command));

    // Beside it, two links that are not followed, each with a dead run app's .env behind it.
    let theirs = sandbox.path().join("theirs");
    let open = sandbox.path().join("open");
    for (dir, mode) in [(&theirs, 0o755), (&open, 0o777)] {
        std::fs::create_dir(dir).unwrap();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).unwrap();
        std::fs::write(dir.join(format!("{}.env", orphan(21))), "X=1\n").unwrap();
    }
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    symlink(&theirs, servers.join("theirs")).unwrap();
    symlink(&open, servers.join("open")).unwrap();

    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    let c = candidate(&report, &domain);
    assert_eq!(c["decision"], "reap", "{report:#}");
    assert_eq!(
        c["removed"]["env_files"],
        serde_json::json!([std::fs::canonicalize(&repo)
            .unwrap()
            .join(format!("{domain}.env"))])
    );
    assert!(!repo.join(format!("{domain}.env")).exists());
    assert!(
        servers.join("ci").symlink_metadata().unwrap().is_symlink(),
        "the link itself was removed"
    );
    let warnings = report["warnings"].to_string();
    assert!(
        warnings.contains("owned by uid 65534") && warnings.contains("others may write to it"),
        "{report:#}"
    );
    assert!(
        report["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["domain"] != orphan(21)),
        "{report:#}"
    );
    for dir in [&theirs, &open] {
        assert!(dir.join(format!("{}.env", orphan(21))).exists());
    }
}

/// `janitor --dry-run`'s table names the holder it saw for a live app (the run, its pid, host
/// and since when it holds the lock), and the JSON has it as fields.
#[test]
fn a_dry_run_names_the_holder_of_a_live_app() {
    let sandbox = Sandbox::new();
    std::fs::create_dir_all(sandbox.abra_home().join("servers/ci")).unwrap();
    let script =
        "echo x > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\"; echo ready $$; read line || :";
    let mut live = Proc::spawn(sandbox.run_sh("held", &[], script));
    live.wait_ready();
    let domain = sandbox.domain("custom-html", None);
    let mut cmd = sandbox.ccci();
    cmd.args(["janitor", "--dry-run"]);
    let done = run(cmd);
    done.assert_code(0);
    let row = done
        .out
        .iter()
        .find(|l| l.starts_with(&domain))
        .unwrap_or_else(|| panic!("{}", done.transcript()));
    assert!(
        row.contains(" live ")
            && row.contains(&format!("held by run held (pid {} on ", live.pid())),
        "{row}"
    );
    let (report, _) = sandbox.janitor(&["--dry-run"]);
    let holder = &candidate(&report, &domain)["holder"];
    assert_eq!(holder["run_id"], "held", "{report:#}");
    assert_eq!(holder["pid"], live.pid(), "{report:#}");
    live.close_stdin();
    live.finish().assert_code(0);
}

/// `janitor --dry-run` says, for each app, the holder it saw or why it judged the owner dead,
/// and everything a reap would remove, in the table and the JSON: a live run whose app has no
/// `.env` yet is listed by its held lock; a run SIGKILLed holding its lock is named as the
/// holder that died, with its `.env` and its lock file to go.
#[test]
fn a_dry_run_names_each_holder_and_everything_a_reap_would_remove() {
    let sandbox = Sandbox::new();
    let mut live =
        Proc::spawn(sandbox.run_sh("alive", &["--pr", "1"], "echo ready $$; exec sleep 100000"));
    live.wait_ready();
    let mut dead =
        Proc::spawn(sandbox.run_sh("gone", &["--pr", "2"], "echo ready $$; exec sleep 100000"));
    dead.wait_ready();
    signal(dead.pid(), Signal::SIGKILL);
    assert!(wait_exited(dead.pid()));
    let gone = sandbox.domain("custom-html", Some("2"));
    let env = sandbox.plant_env("default", &gone, "TYPE=custom-html\n");
    let alive = sandbox.domain("custom-html", Some("1"));

    let (report, done) = sandbox.janitor(&["--dry-run"]);
    done.assert_code(0);
    let held = candidate(&report, &alive);
    assert_eq!(held["decision"], "live", "{report:#}");
    assert_eq!(held["sources"], serde_json::json!(["lock"]));
    assert_eq!(held["holder"]["run_id"], "alive");
    assert!(
        held["why"]
            .as_str()
            .unwrap()
            .starts_with("its lock is held by run alive (pid "),
        "{held:#}"
    );
    let doomed = candidate(&report, &gone);
    assert_eq!(doomed["decision"], "would-reap", "{report:#}");
    assert_eq!(doomed["holder"]["run_id"], "gone", "{doomed:#}");
    assert!(
        doomed["why"]
            .as_str()
            .unwrap()
            .starts_with("its lock was free: run gone (pid "),
        "{doomed:#}"
    );
    assert_eq!(
        doomed["would_remove"]["env_files"],
        serde_json::json!([env.display().to_string()])
    );
    assert_eq!(doomed["would_remove"]["lock_file"], true);
    assert!(env.exists(), "a dry run removed the .env");

    let mut table = sandbox.ccci();
    table.args(["janitor", "--dry-run", "-o", "wide"]);
    let table = run(table);
    let line = |domain: &str| {
        table
            .out
            .iter()
            .find(|l| l.starts_with(domain))
            .unwrap_or_else(|| panic!("{domain} not listed\n{}", table.transcript()))
            .clone()
    };
    assert!(
        line(&alive).contains("held by run alive (pid "),
        "{}",
        table.transcript()
    );
    let doomed = line(&gone);
    assert!(
        doomed.contains("run gone (pid ")
            && doomed.contains(&format!("would remove .env {}", env.display()))
            && doomed.ends_with("its lock file"),
        "{}",
        table.transcript()
    );
    signal(live.pid(), Signal::SIGTERM);
    live.finish();
    sandbox.janitor(&[]).1.assert_code(0);
}
