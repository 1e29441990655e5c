//! Reaping orphaned stacks on a real engine: the janitor against what an operator would do by
//! hand — `docker stack rm` of each stack, waiting until its resources are gone, then
//! `docker volume rm` of its volumes (stack rm never removes volumes) — in the same run.
//!
//! Each stack has two services, an overlay network, two volumes, a secret and a config.
//! The manual way is timed twice: all stacks removed at once then waited for together (the
//! quickest an operator could be), and stack after stack as a cleanup script would go.
//! Both sides are timed until the engine lists nothing of any bench stack. The janitor confirms
//! removal before it exits, so "until it exits" and "until nothing is left" must agree.
//! The engine's own floor is timed too, over its raw API in the same run: every service deleted
//! at once, every container force-removed at once, then networks, secrets, configs, and the
//! volumes (again while still in use), until the engine lists nothing — what no tool can beat.
//! Needs an engine at DOCKER_HOST (`scripts/docker-engine.sh start`). Targets: ≥ 20× the
//! per-stack CLI loop; within 1.2× of the floor (10 stacks: the floor is the engine's).
//!
//! `cargo bench --bench docker_reap [-- STACKS]` (default 10)

// A bench prints its report and reads its own files; clippy.toml keeps print! and eprintln!, and
// raw file reads, out of src/ only.
// The floor is measured over the raw API, beside the tool, not through its seam.
#![allow(
    clippy::disallowed_macros,
    clippy::disallowed_methods,
    clippy::disallowed_types
)]

#[path = "support/ratio.rs"]
mod ratio;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ccci-run");
const SUFFIX: &str = "bench.test";

/// The same stack as the Docker tests use.
const COMPOSE: &str = include_str!("../tests/fixtures/compose.yml");

fn docker(args: &[&str]) -> String {
    let out = Command::new("docker")
        .args(args)
        .output()
        .expect("docker CLI");
    assert!(
        out.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn stack(n: usize) -> String {
    format!("bnch-{n:06x}_{}", SUFFIX.replace('.', "_"))
}

fn count(args: &[&str]) -> usize {
    docker(args).lines().count()
}

/// Resources of any kind left for the bench stacks.
fn leftovers() -> usize {
    let name = "name=bnch-";
    count(&["service", "ls", "-q", "--filter", name])
        + count(&["ps", "-aq", "--filter", name])
        + count(&["network", "ls", "-q", "--filter", name])
        + count(&["volume", "ls", "-q", "--filter", name])
        + count(&["secret", "ls", "-q", "--filter", name])
        + count(&["config", "ls", "-q", "--filter", name])
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(300);
    while !done() {
        assert!(Instant::now() < deadline, "timed out: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// What an operator does after `docker stack rm`: wait until the services, containers and
/// networks matching `filter` are gone, then remove the volumes (stack rm never does).
fn finish_by_hand(filter: &str) {
    wait_until("stack rm: services, containers and networks gone", || {
        count(&["service", "ls", "-q", "--filter", filter]) == 0
            && count(&["ps", "-aq", "--filter", filter]) == 0
            && count(&["network", "ls", "-q", "--filter", filter]) == 0
    });
    let volumes: Vec<String> = docker(&["volume", "ls", "-q", "--filter", filter])
        .lines()
        .map(str::to_owned)
        .collect();
    if !volumes.is_empty() {
        let mut args = vec!["volume", "rm"];
        args.extend(volumes.iter().map(String::as_str));
        docker(&args);
    }
}

/// The engine's floor: every bench stack's resources deleted over the raw API, each kind all
/// at once in the order that never waits on swarm, whatever is still listed deleted again,
/// until nothing is listed.
fn floor_by_raw_api() {
    use bollard::query_parameters::{
        ListContainersOptions, ListNetworksOptions, ListServicesOptions, RemoveContainerOptions,
        RemoveVolumeOptions,
    };
    use futures_util::future::join_all;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let d = bollard::Docker::connect_with_defaults().unwrap();
        let ours = |name: Option<&String>| {
            name.is_some_and(|n| n.trim_start_matches('/').starts_with("bnch-"))
        };
        loop {
            let services = d.list_services(None::<ListServicesOptions>).await.unwrap();
            let services: Vec<String> = services
                .into_iter()
                .filter(|s| ours(s.spec.as_ref().and_then(|s| s.name.as_ref())))
                .filter_map(|s| s.id)
                .collect();
            join_all(services.iter().map(|id| d.delete_service(id))).await;
            let all = Some(ListContainersOptions {
                all: true,
                ..Default::default()
            });
            let containers: Vec<String> = d
                .list_containers(all)
                .await
                .unwrap()
                .into_iter()
                .filter(|c| ours(c.names.as_ref().and_then(|n| n.first())))
                .filter_map(|c| c.id)
                .collect();
            let force = RemoveContainerOptions {
                force: true,
                v: true,
                ..Default::default()
            };
            join_all(
                containers
                    .iter()
                    .map(|id| d.remove_container(id, Some(force.clone()))),
            )
            .await;
            let networks: Vec<String> = d
                .list_networks(None::<ListNetworksOptions>)
                .await
                .unwrap()
                .into_iter()
                .filter(|n| ours(n.name.as_ref()))
                .filter_map(|n| n.id)
                .collect();
            join_all(networks.iter().map(|id| d.remove_network(id))).await;
            let secrets: Vec<String> = d
                .list_secrets(None)
                .await
                .unwrap()
                .into_iter()
                .filter(|s| ours(s.spec.as_ref().and_then(|s| s.name.as_ref())))
                .filter_map(|s| s.id)
                .collect();
            join_all(secrets.iter().map(|id| d.delete_secret(id))).await;
            let configs: Vec<String> = d
                .list_configs(None)
                .await
                .unwrap()
                .into_iter()
                .filter(|c| ours(c.spec.as_ref().and_then(|s| s.name.as_ref())))
                .filter_map(|c| c.id)
                .collect();
            join_all(configs.iter().map(|id| d.delete_config(id))).await;
            let volumes: Vec<String> = d
                .list_volumes(None::<bollard::query_parameters::ListVolumesOptions>)
                .await
                .unwrap()
                .volumes
                .unwrap_or_default()
                .into_iter()
                .map(|v| v.name)
                .filter(|n| n.starts_with("bnch-"))
                .collect();
            join_all(
                volumes
                    .iter()
                    .map(|n| d.remove_volume(n, None::<RemoveVolumeOptions>)),
            )
            .await;
            if services.is_empty()
                && containers.is_empty()
                && networks.is_empty()
                && secrets.is_empty()
                && configs.is_empty()
                && volumes.is_empty()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    });
}

fn deploy_all(dir: &Path, stacks: usize) {
    std::fs::write(dir.join("secret.txt"), "s3cret\n").unwrap();
    std::fs::write(dir.join("conf.txt"), "conf\n").unwrap();
    std::fs::write(dir.join("compose.yml"), COMPOSE).unwrap();
    let compose = dir.join("compose.yml");
    for n in 0..stacks {
        docker(&[
            "stack",
            "deploy",
            "--resolve-image",
            "never",
            "-c",
            compose.to_str().unwrap(),
            &stack(n),
        ]);
    }
    wait_until("every service running", || {
        count(&["ps", "-q", "--filter", "name=bnch-"]) == 2 * stacks
    });
}

fn main() {
    if !Command::new("docker")
        .arg("version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        eprintln!(
            "docker_reap: no Docker engine at DOCKER_HOST; start one with scripts/docker-engine.sh start"
        );
        return;
    }
    let stacks: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(10);
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(leftovers(), 0, "bench stacks left from an earlier run");

    deploy_all(dir.path(), stacks);
    let start = Instant::now();
    let status = Command::new(BIN)
        .arg("--lock-dir")
        .arg(dir.path().join("locks"))
        .arg("--abra-home")
        .arg(dir.path().join("abra"))
        .arg("--runs-dir")
        .arg(dir.path().join("runs"))
        .args([
            "--domain-suffix",
            SUFFIX,
            "--docker",
            "required",
            "janitor",
            "--json",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success(), "janitor failed");
    let janitor_exit = start.elapsed();
    // Reaped means gone: when nothing is listed as the janitor exits, it was done then.
    let left_at_exit = leftovers();
    let janitor = if left_at_exit == 0 {
        janitor_exit
    } else {
        wait_until("janitor: nothing left", || leftovers() == 0);
        start.elapsed()
    };

    deploy_all(dir.path(), stacks);
    let start = Instant::now();
    floor_by_raw_api();
    let floor = start.elapsed();
    assert_eq!(leftovers(), 0, "the raw API left something");

    deploy_all(dir.path(), stacks);
    let start = Instant::now();
    for n in 0..stacks {
        docker(&["stack", "rm", &stack(n)]);
    }
    finish_by_hand("name=bnch-");
    wait_until("stack rm: nothing left", || leftovers() == 0);
    let manual = start.elapsed();

    // The same by hand, one stack after the other, as a cleanup script would go.
    deploy_all(dir.path(), stacks);
    let start = Instant::now();
    for n in 0..stacks {
        let s = stack(n);
        docker(&["stack", "rm", &s]);
        finish_by_hand(&format!("name={s}_"));
    }
    wait_until("sequential stack rm: nothing left", || leftovers() == 0);
    let sequential = start.elapsed();

    println!(
        "docker_reap: {stacks} orphaned stacks (2 services, network, 2 volumes, secret, config each)"
    );
    println!(
        "janitor:                 {:>8.3} s until nothing is left ({:.3} s until it exits, {left_at_exit} resources listed then)",
        janitor.as_secs_f64(),
        janitor_exit.as_secs_f64()
    );
    println!(
        "docker stack rm of all, wait, volume rm:   {:>8.3} s  -> janitor {:.1}x faster",
        manual.as_secs_f64(),
        manual.as_secs_f64() / janitor.as_secs_f64()
    );
    println!(
        "docker stack rm, wait, volume rm per stack: {:>8.3} s  -> janitor {:.1}x faster",
        sequential.as_secs_f64(),
        sequential.as_secs_f64() / janitor.as_secs_f64()
    );
    println!(
        "the engine's floor, raw API, each kind at once: {:>8.3} s",
        floor.as_secs_f64()
    );
    println!("targets: at least 20x the per-stack loop; within 1.2x of the engine's floor");
    ratio::summary(
        "docker_reap",
        &[
            ratio::Figure::new(
                format!("janitor, {stacks} stacks until gone"),
                janitor.as_secs_f64(),
                "the engine's floor over its raw API",
                floor.as_secs_f64(),
                "s",
            )
            .goal(1.2),
            ratio::Figure::new(
                format!("janitor, {stacks} stacks until gone, against the CLI loop"),
                janitor.as_secs_f64(),
                "per-stack docker stack rm loop until gone",
                sequential.as_secs_f64(),
                "s",
            )
            .goal(0.05),
        ],
    );
}
