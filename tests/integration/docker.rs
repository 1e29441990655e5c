//! Reaping Docker stacks on a real engine (`DOCKER_HOST`, swarm mode, the imported
//! `ccci-test/busybox` image). Every test has a domain suffix of its own, so no janitor here ever
//! sees another test's stacks.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::util::{Sandbox, candidate, docker, run};

/// The test stack: two services, an overlay network, two volumes, a secret and a config.
const COMPOSE: &str = include_str!("../fixtures/compose.yml");

/// Write the test compose file (and its secret and config files) into `dir`.
pub(crate) fn compose_file(dir: &Path) -> PathBuf {
    std::fs::write(dir.join("secret.txt"), "s3cret\n").unwrap();
    std::fs::write(dir.join("conf.txt"), "conf\n").unwrap();
    let path = dir.join("compose.yml");
    std::fs::write(&path, COMPOSE).unwrap();
    path
}

/// Deploy the test stack as `stack`, plus an unlabelled `<stack>_external_key` secret (a name
/// its app gives, as a planted run record of the app says), and wait until both services have
/// a running container.
pub(crate) fn deploy(sandbox: &Sandbox, stack: &str) {
    let suffix = format!("_{}", sandbox.suffix().replace('.', "_"));
    if let Some(head) = stack.strip_suffix(&suffix) {
        sandbox.plant_given_names(
            &format!("{head}.{}", sandbox.suffix()),
            &[("secret", &format!("{stack}_external_key"))],
        );
    }
    let compose = compose_file(sandbox.path());
    docker(&[
        "stack",
        "deploy",
        "--resolve-image",
        "never",
        "-c",
        compose.to_str().unwrap(),
        stack,
    ]);
    let secret = sandbox.path().join("secret.txt");
    docker(&[
        "secret",
        "create",
        &format!("{stack}_external_key"),
        secret.to_str().unwrap(),
    ]);
    eventually(&format!("{stack}: two running containers"), || {
        running_containers(stack) == 2
    });
}

pub(crate) fn running_containers(stack: &str) -> usize {
    docker(&[
        "ps",
        "-q",
        "--filter",
        &format!("label=com.docker.stack.namespace={stack}"),
    ])
    .lines()
    .count()
}

/// Every resource of any kind named after or labelled with `stack`, as `kind name` lines.
pub(crate) fn leftovers(stack: &str) -> Vec<String> {
    let label = format!("label=com.docker.stack.namespace={stack}");
    let name = format!("name={stack}_");
    let mut found = Vec::new();
    for (kind, args) in [
        ("service", vec!["service", "ls", "-q", "--filter"]),
        ("container", vec!["ps", "-aq", "--filter"]),
        ("network", vec!["network", "ls", "-q", "--filter"]),
        ("volume", vec!["volume", "ls", "-q", "--filter"]),
        ("secret", vec!["secret", "ls", "-q", "--filter"]),
        ("config", vec!["config", "ls", "-q", "--filter"]),
    ] {
        for filter in [&label, &name] {
            let mut args = args.clone();
            args.push(filter);
            for id in docker(&args).lines() {
                let line = format!("{kind} {id}");
                if !found.contains(&line) {
                    found.push(line);
                }
            }
        }
    }
    found
}

/// Wait until `done` holds. Docker finishes some removals (a swarm network's local copy, a
/// container's exit) asynchronously and offers no readiness line for them; this polls, bounded.
pub(crate) fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Nothing of `stack` is listed right now, without waiting.
#[track_caller]
pub(crate) fn assert_gone_now(stack: &str) {
    let left = leftovers(stack);
    assert!(left.is_empty(), "{stack} is not gone: {left:?}");
}

/// Remove whatever a test left, so that no test leaks onto the shared engine: the stack, its
/// containers forced out (so its volumes are free), then everything named after it.
pub(crate) struct Cleanup(pub String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let stack = &self.0;
        let script = format!(
            "docker stack rm {stack} >/dev/null 2>&1; \
             docker ps -aq --filter label=com.docker.stack.namespace={stack} | xargs -r docker rm -f >/dev/null 2>&1; \
             for kind in network secret config volume; do \
               docker $kind ls -q --filter name={stack}_ | xargs -r docker $kind rm >/dev/null 2>&1; \
             done; true"
        );
        let _ = std::process::Command::new("sh")
            .args(["-c", &script])
            .status();
    }
}

/// A volume of `stack`, labelled as swarm labels a stack's volumes.
fn stack_volume(stack: &str, name: &str) {
    let label = format!("com.docker.stack.namespace={stack}");
    docker(&[
        "volume",
        "create",
        "--label",
        &label,
        &format!("{stack}_{name}"),
    ]);
}

/// What a stack leaves once its services are gone: a labelled overlay network and volume.
fn leave_network_and_volume(stack: &str) {
    let label = format!("com.docker.stack.namespace={stack}");
    docker(&[
        "network",
        "create",
        "--driver",
        "overlay",
        "--label",
        &label,
        &format!("{stack}_net"),
    ]);
    stack_volume(stack, "data");
}

pub(crate) fn domain(sandbox: &Sandbox, prefix: &str) -> String {
    format!("{prefix}-0d0c4e.{}", sandbox.suffix())
}

/// A Docker test's set-up: its sandbox, one run-app domain, its stack, and the clean-up of that
/// stack. `None` when no engine answers (outside CI).
pub(crate) fn docker_case(prefix: &str) -> Option<(Sandbox, String, String, Cleanup)> {
    let sandbox = Sandbox::with_docker()?;
    let domain = domain(&sandbox, prefix);
    let stack = Sandbox::stack(&domain);
    let cleanup = Cleanup(stack.clone());
    Some((sandbox, domain, stack, cleanup))
}

#[test]
fn orphan_stack_is_reaped_completely() {
    let Some((sandbox, domain, stack, _cleanup)) = docker_case("orph") else {
        return;
    };
    deploy(&sandbox, &stack);
    let env = sandbox.plant_env("ci", &domain, "X=1\n");
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    let c = candidate(&report, &domain);
    assert_eq!(c["decision"], "reap", "{report:#}");
    assert_eq!(c["sources"], serde_json::json!(["env", "docker"]));
    let removed = &c["removed"];
    for (kind, n) in [
        ("services", 2),
        ("networks", 1),
        ("volumes", 2),
        ("secrets", 2),
        ("configs", 1),
    ] {
        assert_eq!(
            removed[kind].as_array().unwrap().len(),
            n,
            "{kind}: {removed:#}"
        );
    }
    assert!(
        removed["secrets"].to_string().contains("_external_key"),
        "{removed:#}"
    );
    assert!(!env.exists());
    // Discovery, then one list call per kind per poll round until nothing was listed.
    let rounds = report["docker_poll_rounds"].as_u64().unwrap();
    assert!(rounds >= 1, "{report:#}");
    assert_eq!(report["docker_list_calls"].as_u64(), Some(6 * (1 + rounds)));
    // Reaped means gone: nothing is listed the moment the janitor is done.
    assert_gone_now(&stack);
}

#[test]
fn live_run_s_stack_and_dry_run_are_untouched() {
    let Some((sandbox, domain, stack, _cleanup)) = docker_case("live") else {
        return;
    };
    deploy(&sandbox, &stack);
    let before = leftovers(&stack);

    let (report, done) = sandbox.janitor(&["--dry-run"]);
    done.assert_code(0);
    assert_eq!(candidate(&report, &domain)["decision"], "would-reap");
    assert_eq!(leftovers(&stack), before, "a dry run touched Docker");

    let mut holder = sandbox.hold_with_flock(&sandbox.lock_file(&domain));
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert_eq!(candidate(&report, &domain)["decision"], "live");
    assert_eq!(leftovers(&stack), before, "a live run's stack was touched");
    assert_eq!(running_containers(&stack), 2);
    holder.close_stdin();
    holder.finish().assert_code(0);
}

/// Labels decide: a config labelled for another stack, named as if it were the run app's
/// (`<stack>_…`, as an app whose domain extends a run app's names its objects), is never the
/// run app's; the unlabelled external secret abra makes is, by its name. `--dry-run` says which
/// rule matched each object, and the reap takes exactly what it said.
#[test]
fn labels_decide_and_an_object_labelled_for_another_stack_is_never_reaped() {
    let Some((sandbox, domain, stack, _cleanup)) = docker_case("lbls") else {
        return;
    };
    deploy(&sandbox, &stack);
    let foreign = format!("{stack}_foreign_conf");
    let conf = sandbox.path().join("conf.txt");
    docker(&[
        "config",
        "create",
        "--label",
        &format!("com.docker.stack.namespace={stack}_foreign"),
        &foreign,
        conf.to_str().unwrap(),
    ]);
    sandbox.plant_env("ci", &domain, "X=1\n");

    let (report, done) = sandbox.janitor(&["--dry-run"]);
    done.assert_code(0);
    let c = candidate(&report, &domain);
    assert_eq!(c["decision"], "would-reap", "{report:#}");
    let objects = c["objects"].as_array().unwrap();
    let by = |name: &str| {
        objects
            .iter()
            .find(|o| o["name"] == name)
            .map(|o| o["by"].as_str().unwrap().to_owned())
    };
    assert_eq!(
        by(&format!("{stack}_external_key")).as_deref(),
        Some("name")
    );
    assert_eq!(by(&format!("{stack}_app")).as_deref(), Some("label"));
    assert_eq!(by(&foreign), None, "{objects:#?}");
    // The table an operator reads says it too (in full: -o wide).
    let mut cmd = sandbox.ccci();
    cmd.args(["janitor", "--dry-run", "-o", "wide"]);
    let done = run(cmd);
    done.assert_code(0);
    let text = done.out.join("\n");
    assert!(
        text.contains(&format!("secret {stack}_external_key (by name)"))
            && text.contains(&format!("service {stack}_app (by label)"))
            && !text.contains(&foreign),
        "{text}"
    );

    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert_eq!(
        candidate(&report, &domain)["decision"],
        "reap",
        "{report:#}"
    );
    assert_eq!(
        docker(&["config", "ls", "-q", "--filter", &format!("name={foreign}")])
            .lines()
            .count(),
        1,
        "another stack's config was removed"
    );
    assert_eq!(
        leftovers(&stack).len(),
        1,
        "only the foreign config is left: {:?}",
        leftovers(&stack)
    );
}

#[test]
fn stacks_outside_the_run_app_pattern_are_untouched() {
    let Some(sandbox) = Sandbox::with_docker() else {
        return;
    };
    let warm = format!("warm-app_{}", sandbox.suffix().replace('.', "_"));
    let _cleanup = Cleanup(warm.clone());
    deploy(&sandbox, &warm);
    let before = leftovers(&warm);
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert_eq!(report["candidates"], serde_json::json!([]), "{report:#}");
    assert_eq!(leftovers(&warm), before);
}

/// `docker stack ls` no longer shows a stack whose services are gone, but its network and
/// volume still belong to it and are found and reaped.
#[test]
fn stack_with_only_a_network_and_a_volume_left_is_reaped() {
    let Some((sandbox, domain, stack, _cleanup)) = docker_case("rest") else {
        return;
    };
    leave_network_and_volume(&stack);
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    let c = candidate(&report, &domain);
    assert_eq!(c["decision"], "reap");
    assert_eq!(c["sources"], serde_json::json!(["docker"]));
    assert_eq!(c["removed"]["networks"].as_array().unwrap().len(), 1);
    assert_eq!(c["removed"]["volumes"].as_array().unwrap().len(), 1);
    assert_gone_now(&stack);
}

#[test]
fn list_calls_do_not_grow_with_the_number_of_stacks() {
    let Some(sandbox) = Sandbox::with_docker() else {
        return;
    };
    let mut calls = Vec::new();
    for count in [1, 4] {
        let stacks: Vec<String> = (0..count)
            .map(|n| Sandbox::stack(&domain(&sandbox, &format!("n{count}{n}"))))
            .collect();
        let _cleanup: Vec<Cleanup> = stacks.iter().cloned().map(Cleanup).collect();
        for stack in &stacks {
            stack_volume(stack, "v");
        }
        let (report, done) = sandbox.janitor(&[]);
        done.assert_code(0);
        assert_eq!(report["candidates"].as_array().unwrap().len(), count);
        let rounds = report["docker_poll_rounds"].as_u64().unwrap();
        calls.push(report["docker_list_calls"].as_u64().unwrap() - 6 * rounds);
        for stack in &stacks {
            assert_gone_now(stack);
        }
    }
    // Discovery takes one call per kind, and so does each poll round, for all stacks at once.
    assert_eq!(calls, vec![6, 6]);
}

/// A run's own teardown removes its stack (Docker first, then its .env) while it holds its lock.
#[test]
fn run_teardown_leaves_nothing_labelled_behind() {
    let Some(sandbox) = Sandbox::with_docker() else {
        return;
    };
    let compose = compose_file(sandbox.path());
    std::fs::create_dir_all(sandbox.abra_home().join("servers/ci")).unwrap();
    let script = "docker stack deploy --resolve-image never -c \"$COMPOSE\" \"$CCCI_STACK_NAME\" >/dev/null \
                  && echo X=1 > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\" \
                  && echo \"deployed $CCCI_STACK_NAME\"";
    let mut cmd = sandbox.run_sh("d1", &[], script);
    cmd.env("COMPOSE", &compose);
    let done = run(cmd);
    done.assert_code(0);
    let stack = done
        .out
        .iter()
        .find_map(|l| l.strip_prefix("deployed "))
        .expect("the command deployed its stack")
        .to_owned();
    let _cleanup = Cleanup(stack.clone());
    assert!(
        sandbox.record("d1")["teardown_errors"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    assert_gone_now(&stack);
    assert!(sandbox.state_files().is_empty());
}

/// A proxy in front of the engine's socket that "dies" (drops every connection and stops
/// answering) at the first DELETE request: the daemon going away in the middle of a sweep.
struct DyingProxy {
    path: PathBuf,
    died: Arc<AtomicBool>,
}

impl DyingProxy {
    fn start(dir: &Path) -> Self {
        let upstream = std::env::var("DOCKER_HOST")
            .ok()
            .and_then(|h| h.strip_prefix("unix://").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from("/var/run/docker.sock"));
        let path = dir.join("proxy.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let died = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&died);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { break };
                if flag.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(server) = UnixStream::connect(&upstream) else {
                    break;
                };
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let flag_up = Arc::clone(&flag);
                std::thread::spawn(move || pump(client, server, Some(flag_up)));
                std::thread::spawn(move || pump(s2, c2, None));
            }
        });
        Self { path, died }
    }
}

/// Copy `from` to `to`; when `watch` is given, a DELETE request kills the connection instead.
fn pump(mut from: UnixStream, mut to: UnixStream, watch: Option<Arc<AtomicBool>>) {
    let mut buf = [0u8; 65536];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(flag) = &watch {
            if buf[..n].starts_with(b"DELETE ") || flag.load(Ordering::SeqCst) {
                flag.store(true, Ordering::SeqCst);
                break;
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}

#[test]
fn daemon_dying_mid_sweep_is_a_clear_failure_and_loses_no_env() {
    let Some((sandbox, domain, stack, _cleanup)) = docker_case("dies") else {
        return;
    };
    stack_volume(&stack, "data");
    let env = sandbox.plant_env("ci", &domain, "X=1\n");
    let proxy = DyingProxy::start(sandbox.path());
    let mut cmd = sandbox.ccci();
    cmd.env("DOCKER_HOST", format!("unix://{}", proxy.path.display()))
        .args(["janitor", "--json"]);
    let done = run(cmd);
    assert!(
        proxy.died.load(Ordering::SeqCst),
        "the proxy never saw a DELETE"
    );
    done.assert_code(1);
    let report: serde_json::Value = serde_json::from_str(&done.out.join("\n")).unwrap();
    let c = candidate(&report, &domain);
    assert!(
        c["error"]
            .as_str()
            .unwrap()
            .contains(&format!("{stack}_data")),
        "{report:#}"
    );
    assert!(
        env.exists(),
        "the .env was deleted although the stack was not reaped"
    );
    assert!(sandbox.lock_file(&domain).exists() || !env.exists());
    // With the engine back, the next sweep finishes the job.
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert_eq!(candidate(&report, &domain)["decision"], "reap");
    assert!(!env.exists());
    assert_gone_now(&stack);
}

#[test]
fn concurrent_janitors_never_fight_over_a_stack() {
    let Some(sandbox) = Sandbox::with_docker() else {
        return;
    };
    let stacks: Vec<(String, String)> = (0..6)
        .map(|n| {
            let d = domain(&sandbox, &format!("rc{n}"));
            (Sandbox::stack(&d), d)
        })
        .collect();
    let _cleanup: Vec<Cleanup> = stacks.iter().map(|(s, _)| Cleanup(s.clone())).collect();
    for (stack, _) in &stacks {
        leave_network_and_volume(stack);
    }
    let (reaps, _) = sandbox.racing_janitors(3);
    for (stack, domain) in &stacks {
        assert_eq!(reaps.get(domain), Some(&1), "{domain}: {reaps:?}");
        assert_gone_now(stack);
    }
}

/// Another app whose domain extends the run app's (`<run app>.example.org`), deployed beside
/// it, with an unlabelled secret and volume named under its own stack (`<run stack>_example_org_…`,
/// which begins with the run app's stack): neither the dry run nor the reap takes them as the
/// run app's, and they survive the reap with the other app's services.
#[test]
fn another_app_extending_the_run_app_s_domain_keeps_its_unlabelled_objects() {
    let Some((sandbox, domain, stack, _cleanup)) = docker_case("extd") else {
        return;
    };
    let other = format!("{stack}_example_org");
    let _other_cleanup = Cleanup(other.clone());
    deploy(&sandbox, &stack);
    deploy(&sandbox, &other);
    let volume = format!("{other}_data");
    docker(&["volume", "create", &volume]);
    let secret = format!("{other}_external_key");
    sandbox.plant_env("ci", &domain, "X=1\n");

    let (report, done) = sandbox.janitor(&["--dry-run"]);
    done.assert_code(0);
    let objects = candidate(&report, &domain)["objects"].to_string();
    assert!(
        !objects.contains(&other),
        "the other app's objects are taken as the run app's: {report:#}"
    );
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert_eq!(
        candidate(&report, &domain)["decision"],
        "reap",
        "{report:#}"
    );
    for (kind, name) in [("secret", &secret), ("volume", &volume)] {
        assert_eq!(
            docker(&[kind, "ls", "-q", "--filter", &format!("name={name}")])
                .lines()
                .count(),
            1,
            "the other app's {kind} {name} was removed"
        );
    }
    assert_eq!(running_containers(&other), 2, "the other app was touched");
}

/// The recipe fixture (`tests/fixtures/recipes/lemp`), staged in the sandbox's abra home where
/// `CCCI_SKIP_FETCH=1` copies it from into each run's tree.
fn stage_lemp(sandbox: &Sandbox) {
    let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/recipes/lemp");
    let to = sandbox.abra_home().join("recipes/lemp");
    std::fs::create_dir_all(to.join(".git")).unwrap();
    for entry in std::fs::read_dir(&from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// Make an unlabelled secret, or an unlabelled volume, as abra makes them.
fn unlabelled(sandbox: &Sandbox, kind: &str, name: &str) {
    match kind {
        "secret" => {
            let file = sandbox.path().join("unlabelled.txt");
            std::fs::write(&file, "s3cret\n").unwrap();
            docker(&["secret", "create", name, file.to_str().unwrap()]);
        }
        _ => {
            docker(&["volume", "create", name]);
        }
    }
}

fn exists(kind: &str, name: &str) -> bool {
    docker(&[kind, "ls", "--format", "{{.Name}}"])
        .lines()
        .any(|l| l == name)
}

/// The recipe fixture's app and a second app whose domain extends the run app's
/// (`….example.org`, stack `<stack>_example_org`), its services gone so that only its
/// unlabelled secrets and volumes are left: nothing of it names a stack the engine knows, and
/// every name begins with the run app's stack. An unlabelled object is the run app's only by a
/// name its recipe gives exactly (recorded with the run, before it deploys): the run's own
/// teardown, the janitor's dry run and its reap each take the run app's own unlabelled secrets
/// and volume, and keep the other app's (and anything else named `<stack>_…`), saying so. A
/// run record that names no given names (an older one) leaves the run app's unlabelled objects
/// kept too: labels only.
#[test]
fn an_extending_app_with_only_unlabelled_objects_left_survives_every_reap_and_teardown() {
    let Some(sandbox) = Sandbox::with_docker() else {
        return;
    };
    stage_lemp(&sandbox);
    let domain = sandbox.domain("lemp", None);
    let stack = Sandbox::stack(&domain);
    let other = format!("{stack}_example_org");
    let _cleanup = Cleanup(stack.clone());
    let _other_cleanup = Cleanup(other.clone());
    let theirs = [
        ("secret", format!("{other}_db_password_v1")),
        ("secret", format!("{other}_db_root_password_v1")),
        ("volume", format!("{other}_db_data")),
        ("volume", format!("{other}_content")),
    ];
    for (kind, name) in &theirs {
        unlabelled(&sandbox, kind, name);
    }
    let ours = [
        ("secret", format!("{stack}_db_password_v1")),
        ("secret", format!("{stack}_db_root_password_v2")),
        ("volume", format!("{stack}_db_data")),
    ];
    // Named like the run app's, but no name its recipe gives.
    let stray = format!("{stack}_stray_v1");
    let survivors = || {
        for (kind, name) in theirs.iter().chain([&("secret", stray.clone())]) {
            assert!(exists(kind, name), "{kind} {name} was removed");
        }
    };
    let server = sandbox.abra_home().join("servers/ci");
    std::fs::create_dir_all(&server).unwrap();

    // The run's own teardown.
    let script = format!(
        "set -e; for s in {stack}_db_password_v1 {stack}_db_root_password_v2 {stray}; do \
           echo s3cret | docker secret create \"$s\" - >/dev/null; done; \
         docker volume create {stack}_db_data >/dev/null; \
         echo X=1 > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\""
    );
    let mut cmd = sandbox.ccci();
    cmd.env("CCCI_SKIP_FETCH", "1").args([
        "run", "--recipe", "lemp", "--run-id", "x1", "--", "sh", "-c", &script,
    ]);
    let done = run(cmd);
    done.assert_code(0);
    let record = sandbox.record("x1");
    assert_eq!(
        record["given_names"]["secrets"],
        serde_json::json!([
            format!("{stack}_db_password_{{version}}"),
            format!("{stack}_db_root_password_{{version}}")
        ]),
        "{record:#}"
    );
    for (kind, name) in &ours {
        assert!(!exists(kind, name), "the teardown left {kind} {name}");
    }
    survivors();
    let transcript = done.transcript();
    for (kind, name) in theirs.iter().chain([&("secret", stray.clone())]) {
        assert!(
            transcript.contains(&format!("== teardown: kept {kind} {name}: ")),
            "{transcript}"
        );
    }

    // The janitor of the dead run: its recipe tree is gone, its record is not.
    let _ = std::fs::remove_dir_all(sandbox.runs().join("x1/abra/recipes"));
    for (kind, name) in &ours {
        unlabelled(&sandbox, kind, name);
    }
    sandbox.plant_env("ci", &domain, "X=1\n");
    let (report, done) = sandbox.janitor(&["--dry-run"]);
    done.assert_code(0);
    let kept: Vec<String> = report["kept"]
        .as_array()
        .unwrap_or_else(|| panic!("no kept objects: {report:#}"))
        .iter()
        .map(|k| {
            format!(
                "{} {}",
                k["kind"].as_str().unwrap(),
                k["name"].as_str().unwrap()
            )
        })
        .collect();
    for (kind, name) in theirs.iter().chain([&("secret", stray.clone())]) {
        assert!(kept.contains(&format!("{kind} {name}")), "{report:#}");
    }
    let objects = candidate(&report, &domain)["objects"].to_string();
    for (_, name) in &ours {
        assert!(objects.contains(name.as_str()), "{report:#}");
    }
    assert!(
        !objects.contains(&other) && !objects.contains(&stray),
        "{report:#}"
    );
    let mut cmd = sandbox.ccci();
    cmd.args(["janitor", "--dry-run", "--wide"]);
    let table = run(cmd);
    table.assert_code(0);
    let text = table.out.join("\n");
    assert!(
        text.contains(&format!(
            "kept secret {other}_db_password_v1: no stack label, and not a name the recipe of \
             {domain} gives"
        )),
        "{text}"
    );
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert_eq!(
        candidate(&report, &domain)["decision"],
        "reap",
        "{report:#}"
    );
    assert_eq!(
        report["kept"].as_array().map(Vec::len),
        Some(5),
        "{report:#}"
    );
    for (kind, name) in &ours {
        assert!(!exists(kind, name), "the janitor left {kind} {name}");
    }
    survivors();

    // An older record, which names nothing: labels only, the run app's own secret kept too.
    let path = sandbox.runs().join("x1/run.json");
    let mut record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    record.as_object_mut().unwrap().remove("given_names");
    std::fs::write(&path, serde_json::to_vec(&record).unwrap()).unwrap();
    let (kind, name) = &ours[0];
    unlabelled(&sandbox, kind, name);
    sandbox.plant_env("ci", &domain, "X=1\n");
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert!(exists(kind, name), "{report:#}");
    assert!(
        report["kept"].to_string().contains("recorded the names"),
        "{report:#}"
    );
    survivors();
}
