//! Reaped means gone: after every reap path — the janitor's, a run's own teardown, a run
//! clearing what a dead holder left — the engine lists nothing of the stack, so the same stack
//! deploys again straight after (swarm removes asynchronously: a deploy inside the removal
//! window fails with `network <stack>_internal not found`). Several rounds each, on the real
//! engine, deploying exactly what a recipe deploys.

use std::path::Path;

use nix::sys::signal::Signal;

use crate::docker::{
    Cleanup, assert_gone_now, compose_file, deploy, docker_case, eventually, running_containers,
};
use crate::util::{Proc, Sandbox, Stream, candidate, docker, run, signal, wait_exited};

const ROUNDS: usize = 3;

/// `docker stack deploy` of `compose` as `stack`, which must succeed now.
#[track_caller]
fn stack_deploy(compose: &Path, stack: &str) {
    docker(&[
        "stack",
        "deploy",
        "--resolve-image",
        "never",
        "-c",
        compose.to_str().unwrap(),
        stack,
    ]);
}

/// `docker stack deploy` of `stack` must succeed now, and its services reach running.
#[track_caller]
fn redeploys_at_once(compose: &Path, stack: &str) {
    stack_deploy(compose, stack);
    eventually(
        &format!("{stack}: redeployed, two running containers"),
        || running_containers(stack) == 2,
    );
}

/// `domain`'s app is an orphan (its `.env` planted): one janitor sweep reaps it, and nothing of
/// `stack` is listed the moment the janitor is done.
#[track_caller]
fn janitor_reaps_it_gone_now(sandbox: &Sandbox, domain: &str, stack: &str, round: usize) {
    sandbox.plant_env("ci", domain, "X=1\n");
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert_eq!(
        candidate(&report, domain)["decision"],
        "reap",
        "round {round}: {report:#}"
    );
    assert_gone_now(stack);
}

/// The janitor reaps an orphan; the same stack deploys again at once, round after round.
#[test]
fn janitor_reap_then_the_same_stack_deploys_at_once() {
    let Some((sandbox, domain, stack, _cleanup)) = docker_case("rjan") else {
        return;
    };
    let compose = compose_file(sandbox.path());
    deploy(&sandbox, &stack);
    for round in 0..ROUNDS {
        janitor_reaps_it_gone_now(&sandbox, &domain, &stack, round);
        redeploys_at_once(&compose, &stack);
    }
}

/// A stack reaped straight after its deploy, while swarm is still handing its tasks to the
/// node: such a task can start after its service is gone and bring the stack's network back.
/// The reap counts the stack gone only once nothing of it can come back, so nothing is listed
/// the moment the janitor is done, nothing returns while a task would have started, and the
/// same stack deploys again at once.
#[test]
fn a_stack_reaped_while_its_tasks_start_stays_gone_and_redeploys_at_once() {
    let Some((sandbox, domain, stack, _cleanup)) = docker_case("rtsk") else {
        return;
    };
    let compose = compose_file(sandbox.path());
    // Six tasks per service: the node starts them one after another, so the reap meets
    // tasks in every state from assigned to running.
    let many = sandbox.path().join("many.yml");
    std::fs::write(
        &many,
        std::fs::read_to_string(&compose).unwrap().replace(
            "deploy: {endpoint_mode: dnsrr}",
            "deploy: {endpoint_mode: dnsrr, replicas: 6}",
        ),
    )
    .unwrap();
    for round in 0..ROUNDS {
        stack_deploy(&many, &stack);
        janitor_reaps_it_gone_now(&sandbox, &domain, &stack, round);
        // A handed-out task starts within about a second; watch for twice that.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while std::time::Instant::now() < until {
            assert_gone_now(&stack);
        }
    }
    redeploys_at_once(&compose, &stack);
}

/// A run deploys its stack and its teardown removes it; the next run of the domain deploys the
/// same stack at once (its command fails if the deploy does), round after round.
#[test]
fn run_teardown_then_the_next_run_deploys_at_once() {
    let Some((sandbox, _domain, _stack, _cleanup)) = docker_case("rrun") else {
        return;
    };
    let compose = compose_file(sandbox.path());
    std::fs::create_dir_all(sandbox.abra_home().join("servers/ci")).unwrap();
    let script = "docker stack deploy --resolve-image never -c \"$COMPOSE\" \"$CCCI_STACK_NAME\" >/dev/null \
        && echo X=1 > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\" \
        && until [ \"$(docker ps -q --filter label=com.docker.stack.namespace=$CCCI_STACK_NAME | wc -l)\" = 2 ]; do sleep 0.1; done \
        && echo \"deployed $CCCI_STACK_NAME\"";
    let mut stack = None;
    for round in 0..ROUNDS {
        let mut cmd = sandbox.run_sh(&format!("rt{round}"), &[], script);
        cmd.env("COMPOSE", &compose);
        let done = run(cmd);
        done.assert_code(0);
        let deployed = done
            .out
            .iter()
            .find_map(|l| l.strip_prefix("deployed "))
            .expect("the command deployed its stack")
            .to_owned();
        let _cleanup = Cleanup(deployed.clone());
        assert!(
            sandbox.record(&format!("rt{round}"))["teardown_errors"]
                .as_array()
                .unwrap()
                .is_empty(),
            "round {round}"
        );
        assert_gone_now(&deployed);
        stack = Some(deployed);
    }
    assert!(stack.is_some());
}

/// Run A deploys and its supervisor is SIGKILLed while run B waits behind it; B takes the lock,
/// clears what A left (killing A's leftover processes first) and deploys the same stack at
/// once.
#[test]
fn leftovers_of_a_dead_holder_are_gone_before_the_next_run_deploys() {
    let Some((sandbox, _domain, _stack, _cleanup)) = docker_case("rdead") else {
        return;
    };
    let compose = compose_file(sandbox.path());
    std::fs::create_dir_all(sandbox.abra_home().join("servers/ci")).unwrap();
    let deploy_script = "docker stack deploy --resolve-image never -c \"$COMPOSE\" \"$CCCI_STACK_NAME\" >/dev/null \
        && echo X=1 > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\" \
        && until [ \"$(docker ps -q --filter label=com.docker.stack.namespace=$CCCI_STACK_NAME | wc -l)\" = 2 ]; do sleep 0.1; done";
    for round in 0..ROUNDS {
        let holder_script =
            format!("{deploy_script} && echo \"ready $$ $CCCI_STACK_NAME\"; exec sleep 100000");
        let mut holder = sandbox.run_sh(&format!("dh{round}"), &[], &holder_script);
        holder.env("COMPOSE", &compose);
        let mut holder = Proc::spawn(holder);
        let ready = holder.wait_for(Stream::Out, "ready ");
        let stack = ready.split_whitespace().nth(2).unwrap().to_owned();
        let _cleanup = Cleanup(stack.clone());
        let next_script = format!("{deploy_script} && echo next-deployed");
        let mut next = sandbox.run_sh(&format!("dn{round}"), &[], &next_script);
        next.env("COMPOSE", &compose);
        let mut next = Proc::spawn(next);
        next.wait_for(Stream::Err, "== app lock: another run of");
        let supervisor = holder.pid();
        signal(supervisor, Signal::SIGKILL);
        assert!(wait_exited(supervisor));
        let done = next.finish();
        done.assert_code(0);
        done.assert_stderr_has("removed what a previous run of");
        assert!(
            done.out.iter().any(|l| l == "next-deployed"),
            "round {round}\n{}",
            done.transcript()
        );
        assert_gone_now(&stack);
        drop(holder);
    }
}

/// The real recipe shape: an external, shared `proxy` network and versioned external secrets
/// (`<stack>_<name>_v1`, no stack label, as `abra app secret generate` makes them). The reap
/// takes the stack's own secrets (as `abra app rm` does, so the next run can generate them
/// again) and never the shared network or another app's secrets; the same stack then deploys
/// again at once.
#[test]
fn recipe_shape_shared_network_survives_and_the_stack_redeploys() {
    let Some((sandbox, domain, stack, _cleanup)) = docker_case("rshp") else {
        return;
    };
    let proxy = format!("proxy_{}", stack);
    let other_secret = format!("warm_{}_db_password_v1", std::process::id());
    docker(&[
        "network",
        "create",
        "--driver",
        "overlay",
        "--attachable",
        &proxy,
    ]);
    let secret_file = sandbox.path().join("s.txt");
    std::fs::write(&secret_file, "s3cret\n").unwrap();
    docker(&[
        "secret",
        "create",
        &other_secret,
        secret_file.to_str().unwrap(),
    ]);
    let compose = sandbox.path().join("recipe.yml");
    std::fs::write(
        &compose,
        format!(
            r#"version: "3.8"
services:
  app:
    image: ccci-test/busybox:latest
    command: ["sleep", "100000"]
    networks: [proxy, internal]
    secrets: [db_password]
    deploy: {{endpoint_mode: dnsrr}}
  db:
    image: ccci-test/busybox:latest
    command: ["sleep", "100000"]
    networks: [internal]
    volumes: [data:/data]
    secrets: [db_password]
    deploy: {{endpoint_mode: dnsrr}}
networks:
  proxy: {{external: true, name: {proxy}}}
  internal: {{}}
volumes:
  data: {{}}
secrets:
  db_password: {{external: true, name: {stack}_db_password_v1}}
"#
        ),
    )
    .unwrap();
    // The recipe gives its secret that name (a run of it records so).
    sandbox.plant_given_names(
        &domain,
        &[("secret", &format!("{stack}_db_password_{{version}}"))],
    );
    for round in 0..ROUNDS {
        docker(&[
            "secret",
            "create",
            &format!("{stack}_db_password_v1"),
            secret_file.to_str().unwrap(),
        ]);
        redeploys_at_once(&compose, &stack);
        janitor_reaps_it_gone_now(&sandbox, &domain, &stack, round);
        let networks = docker(&["network", "ls", "-q", "--filter", &format!("name={proxy}")]);
        assert!(
            !networks.trim().is_empty(),
            "the shared proxy network was removed"
        );
        let secrets = docker(&[
            "secret",
            "ls",
            "-q",
            "--filter",
            &format!("name={other_secret}"),
        ]);
        assert!(
            !secrets.trim().is_empty(),
            "another app's secret was removed"
        );
    }
    let _ = std::process::Command::new("docker")
        .args(["network", "rm", &proxy])
        .status();
    let _ = std::process::Command::new("docker")
        .args(["secret", "rm", &other_secret])
        .status();
}

/// A network of the stack that a container of another stack is attached to is never
/// force-detached: the reap ends `reap-incomplete` naming that container (exit 1), keeps the
/// lock file and the `.env` for the next sweep, and that sweep finishes once it is gone.
#[test]
fn network_held_by_another_stack_is_reported_reap_incomplete() {
    let Some((sandbox, domain, stack, _cleanup)) = docker_case("rinc") else {
        return;
    };
    let network = format!("{stack}_internal");
    let label = format!("com.docker.stack.namespace={stack}");
    docker(&["network", "create", "--label", &label, &network]);
    let intruder = format!("intruder_{}", std::process::id());
    docker(&[
        "run",
        "-d",
        "--name",
        &intruder,
        "--network",
        &network,
        "--label",
        "com.docker.stack.namespace=warm_app",
        "ccci-test/busybox:latest",
        "sleep",
        "100000",
    ]);
    let env = sandbox.plant_env("ci", &domain, "X=1\n");
    let (report, done) = sandbox.janitor(&["--reap-budget", "30"]);
    done.assert_code(1);
    let c = candidate(&report, &domain);
    assert_eq!(c["decision"], "reap-incomplete", "{report:#}");
    let error = c["error"].as_str().unwrap();
    assert!(error.contains(&network), "{error}");
    assert!(error.contains(&intruder), "{error}");
    assert!(error.contains("not detaching"), "{error}");
    assert!(env.exists(), "the .env must stay for the next sweep");
    assert!(
        sandbox.lock_file(&domain).exists(),
        "the lock file must stay"
    );
    let attached = docker(&[
        "inspect",
        "-f",
        "{{json .NetworkSettings.Networks}}",
        &intruder,
    ]);
    assert!(
        attached.contains(&network),
        "the intruder was detached: {attached}"
    );
    docker(&["rm", "-f", &intruder]);
    let (report, done) = sandbox.janitor(&[]);
    done.assert_code(0);
    assert_eq!(
        candidate(&report, &domain)["decision"],
        "reap",
        "{report:#}"
    );
    assert!(!env.exists());
    assert_gone_now(&stack);
}
