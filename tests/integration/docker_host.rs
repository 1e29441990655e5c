//! `DOCKER_HOST` is the engine used: `tcp://` over a loopback port (plain, and with TLS against
//! the suite's engine's own TLS listener), never the default socket instead, and anything ccci-run
//! cannot speak to is refused (exit 2) before a run or a sweep starts.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::docker::{Cleanup, assert_gone_now, domain};
use crate::util::{Sandbox, candidate, docker, run};

/// The suite's engine's socket, from `DOCKER_HOST` (as `scripts/docker-engine.sh` sets it).
fn engine_socket() -> PathBuf {
    std::env::var("DOCKER_HOST")
        .ok()
        .and_then(|h| h.strip_prefix("unix://").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("/var/run/docker.sock"))
}

/// A loopback TCP port in front of the engine's socket: every connection is forwarded to it,
/// byte for byte, and counted.
struct TcpFront {
    port: u16,
    connections: Arc<AtomicUsize>,
}

impl TcpFront {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&connections);
        let upstream = engine_socket();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { break };
                let Ok(server) = UnixStream::connect(&upstream) else {
                    break;
                };
                counted.fetch_add(1, Ordering::SeqCst);
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || pump(client, server));
                std::thread::spawn(move || pump(s2, c2));
            }
        });
        Self { port, connections }
    }

    fn host(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }
}

trait Shut {
    fn shut(&self);
}
impl Shut for TcpStream {
    fn shut(&self) {
        let _ = self.shutdown(std::net::Shutdown::Both);
    }
}
impl Shut for UnixStream {
    fn shut(&self) {
        let _ = self.shutdown(std::net::Shutdown::Both);
    }
}

fn pump(mut from: impl Read + Shut, mut to: impl Write + Shut) {
    let mut buf = [0u8; 65536];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    from.shut();
    to.shut();
}

/// A stack that is nothing but one labelled volume: a candidate only Docker knows of.
fn stack_with_a_volume(stack: &str) -> String {
    let name = format!("{stack}_data");
    docker(&[
        "volume",
        "create",
        "--label",
        &format!("com.docker.stack.namespace={stack}"),
        &name,
    ]);
    name
}

fn volume_exists(name: &str) -> bool {
    docker(&["volume", "ls", "-q", "--filter", &format!("name=^{name}$")])
        .lines()
        .any(|l| l == name)
}

/// `DOCKER_HOST=tcp://127.0.0.1:PORT` was silently ignored and the default socket used (where
/// another engine's stacks could be reaped). Now the janitor and a run's teardown reach the
/// engine through that port and nowhere else: the stacks are reaped, and every connection went
/// through it (there is no engine at the default socket here to fall back to).
#[test]
fn janitor_and_run_reach_the_engine_at_a_tcp_docker_host() {
    let Some(mut sandbox) = Sandbox::with_docker() else {
        return;
    };
    sandbox.set_docker("required");
    let front = TcpFront::start();

    let stack = Sandbox::stack(&domain(&sandbox, "tcpj"));
    let _cleanup = Cleanup(stack.clone());
    let volume = stack_with_a_volume(&stack);
    let mut cmd = sandbox.ccci();
    cmd.env("DOCKER_HOST", front.host())
        .args(["janitor", "--json"]);
    let done = run(cmd);
    done.assert_code(0);
    let report: serde_json::Value = serde_json::from_str(&done.out.join("\n")).unwrap();
    let domain_of = domain(&sandbox, "tcpj");
    assert_eq!(
        candidate(&report, &domain_of)["decision"],
        "reap",
        "{report:#}"
    );
    assert!(!volume_exists(&volume));
    assert_gone_now(&stack);
    let after_janitor = front.connections.load(Ordering::SeqCst);
    assert!(
        after_janitor > 0,
        "the janitor never connected to {}",
        front.host()
    );

    // A run whose command makes a Docker resource of its stack (through the same DOCKER_HOST,
    // which it inherits): its teardown removes it through the TCP port.
    std::fs::create_dir_all(sandbox.abra_home().join("servers/ci")).unwrap();
    let script = "docker volume create --label \"com.docker.stack.namespace=$CCCI_STACK_NAME\" \
                  \"${CCCI_STACK_NAME}_data\" >/dev/null \
                  && echo X=1 > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\" \
                  && echo \"made ${CCCI_STACK_NAME}_data\"";
    let mut cmd = sandbox.run_sh("tcpr", &["--pr", "31"], script);
    cmd.env("DOCKER_HOST", front.host());
    let done = run(cmd);
    done.assert_code(0);
    let made = done
        .out
        .iter()
        .find_map(|l| l.strip_prefix("made "))
        .expect("the command made its volume")
        .to_owned();
    let _cleanup_run = Cleanup(made.trim_end_matches("_data").to_owned());
    assert!(
        sandbox.record("tcpr")["teardown_errors"]
            .as_array()
            .unwrap()
            .is_empty(),
        "{:#}",
        sandbox.record("tcpr")
    );
    assert!(!volume_exists(&made), "the run's teardown left {made}");
    assert!(front.connections.load(Ordering::SeqCst) > after_janitor);
}

/// The suite's engine's TLS listener (`tcp://127.0.0.1:PORT`) and a client certificate it
/// accepts, from `scripts/docker-engine.sh`. `None` (outside CI) when the engine was started
/// without one.
fn tls_engine() -> Option<(String, PathBuf)> {
    if !crate::util::docker_available() {
        return None;
    }
    let base = engine_socket().parent().unwrap().to_owned();
    match std::fs::read_to_string(base.join("tls-host")) {
        Ok(host) => Some((host.trim().to_owned(), base.join("tls/client"))),
        Err(err) => {
            crate::util::skip(
                &format!(
                    "the engine has no TLS listener ({}: {err})",
                    base.join("tls-host").display()
                ),
                "start the engine with `scripts/docker-engine.sh start`, which gives it one",
            );
            None
        }
    }
}

/// `DOCKER_TLS_VERIFY=1` with `DOCKER_CERT_PATH`: the janitor speaks TLS to the engine's own
/// TLS port, presents its certificate and verifies the engine's. Plain HTTP to that port, or a
/// `ca.pem` that did not sign the engine's certificate, fails the sweep (exit 1 with `--docker
/// required`) and reaps nothing.
#[test]
fn janitor_reaches_the_engine_over_tls_and_verifies_it() {
    let Some((host, certs)) = tls_engine() else {
        return;
    };
    let mut sandbox = Sandbox::with_docker().unwrap();
    sandbox.set_docker("required");
    let stack = Sandbox::stack(&domain(&sandbox, "tlsj"));
    let _cleanup = Cleanup(stack.clone());
    let volume = stack_with_a_volume(&stack);
    let janitor = |tls_verify: Option<&str>, cert_path: &Path| {
        let mut cmd = sandbox.ccci();
        cmd.env("DOCKER_HOST", &host)
            .env("DOCKER_CERT_PATH", cert_path)
            .env_remove("DOCKER_TLS_VERIFY")
            .env_remove("DOCKER_TLS")
            .args(["janitor", "--json"]);
        if let Some(value) = tls_verify {
            cmd.env("DOCKER_TLS_VERIFY", value);
        }
        run(cmd)
    };

    // Plain HTTP to a TLS port: the engine says so, nothing is reaped.
    let done = janitor(None, &certs);
    done.assert_code(1);
    assert!(
        done.out
            .join("\n")
            .contains("HTTP request to an HTTPS server"),
        "{}",
        done.transcript()
    );
    assert!(volume_exists(&volume));

    // A CA that did not sign the engine's certificate (our own client certificate): the
    // handshake fails, nothing is reaped.
    let wrong = sandbox.path().join("wrong-ca");
    std::fs::create_dir(&wrong).unwrap();
    for name in ["cert.pem", "key.pem"] {
        std::fs::copy(certs.join(name), wrong.join(name)).unwrap();
    }
    std::fs::copy(certs.join("cert.pem"), wrong.join("ca.pem")).unwrap();
    let done = janitor(Some("1"), &wrong);
    done.assert_code(1);
    assert!(
        done.out.join("\n").contains("is unreachable"),
        "{}",
        done.transcript()
    );
    assert!(volume_exists(&volume));

    let done = janitor(Some("1"), &certs);
    done.assert_code(0);
    let report: serde_json::Value = serde_json::from_str(&done.out.join("\n")).unwrap();
    assert_eq!(
        candidate(&report, &domain(&sandbox, "tlsj"))["decision"],
        "reap",
        "{report:#}"
    );
    assert!(!volume_exists(&volume));
    assert_gone_now(&stack);
}

/// A `DOCKER_HOST` ccci-run cannot speak to (ssh://, garbage, another scheme, a bad port, a
/// relative socket), TLS without verification, or TLS without its files: `run` and `janitor`
/// refuse it with exit 2 naming the value, before anything is done — the run's command never
/// starts and no run directory is made. With `--docker off` Docker is never asked, so
/// `DOCKER_HOST` does not matter.
#[test]
fn bad_docker_hosts_are_refused_with_exit_2_by_run_and_janitor() {
    let mut sandbox = Sandbox::new();
    sandbox.set_docker("auto");
    let empty = sandbox.path().join("no-certs");
    std::fs::create_dir(&empty).unwrap();
    let empty = empty.to_str().unwrap().to_owned();
    let cases: &[(&[(&str, &str)], &str)] = &[
        (
            &[("DOCKER_HOST", "ssh://x")],
            "invalid DOCKER_HOST \"ssh://x\": the ssh:// scheme is not supported",
        ),
        (
            &[("DOCKER_HOST", "garbage")],
            "invalid DOCKER_HOST \"garbage\": it names no scheme",
        ),
        (
            &[("DOCKER_HOST", "http://127.0.0.1:2375")],
            "the http:// scheme is not supported",
        ),
        (
            &[("DOCKER_HOST", "tcp://127.0.0.1:0")],
            "\"0\" is not a port",
        ),
        (
            &[("DOCKER_HOST", "unix://docker.sock")],
            "needs an absolute socket path",
        ),
        (
            &[("DOCKER_HOST", "tcp://127.0.0.1:2376"), ("DOCKER_TLS", "1")],
            "invalid DOCKER_TLS \"1\": TLS without verifying",
        ),
        (
            &[
                ("DOCKER_HOST", "tcp://127.0.0.1:2376"),
                ("DOCKER_TLS_VERIFY", "1"),
                ("DOCKER_CERT_PATH", &empty),
            ],
            "ca.pem: No such file or directory",
        ),
    ];
    for (n, (env, message)) in cases.iter().enumerate() {
        let id = format!("dh{n}");
        let mut cmd = sandbox.run_sh(&id, &[], "echo command-ran");
        cmd.envs(env.iter().copied());
        let done = run(cmd);
        done.assert_code(2);
        done.assert_stderr_has(message);
        if env.len() == 1 {
            done.assert_stderr_has("unix:///PATH or tcp://HOST:PORT");
        }
        assert!(!done.out.iter().any(|l| l == "command-ran"));
        assert!(!sandbox.runs().join(&id).exists());

        let mut cmd = sandbox.ccci();
        cmd.envs(env.iter().copied()).args(["janitor", "--json"]);
        let done = run(cmd);
        done.assert_code(2);
        done.assert_stderr_has(message);
        // --json: the envelope all the same, the refusal in its errors.
        let printed: serde_json::Value = serde_json::from_str(&done.out.join("\n"))
            .unwrap_or_else(|e| panic!("no envelope ({e}): {}", done.transcript()));
        assert!(
            printed["errors"][0].as_str().unwrap().contains(message),
            "{printed:#}"
        );

        let mut cmd = sandbox.ccci();
        cmd.envs(env.iter().copied())
            .args(["--docker", "off", "janitor", "--json"]);
        run(cmd).assert_code(0);
    }
}

/// A Drone step never sees the runner's `DOCKER_HOST`: the configuration file's `docker_host`
/// names the engine instead (here a loopback TCP port in front of the suite's engine, with no
/// `DOCKER_HOST` in the environment). The janitor reaps through it, a run's command gets it as
/// its own `DOCKER_HOST` (so its `docker` reaches the same engine) and its teardown removes what
/// the command made through it. The precedence is every setting's: `--docker-host` over
/// `DOCKER_HOST` over the file; `config` says which; a value ccci-run cannot use is exit 2,
/// naming the file's key.
#[test]
fn the_configuration_file_names_the_engine_when_the_environment_does_not() {
    let Some(mut sandbox) = Sandbox::with_docker() else {
        return;
    };
    sandbox.set_docker("required");
    let front = TcpFront::start();
    let file = sandbox.path().join("config.toml");
    std::fs::write(&file, format!("docker_host = \"{}\"\n", front.host())).unwrap();
    let with_file = |cmd: &mut std::process::Command| {
        cmd.env_remove("DOCKER_HOST").env("CCCI_CONFIG", &file);
    };

    let stack = Sandbox::stack(&domain(&sandbox, "cfgh"));
    let _cleanup = Cleanup(stack.clone());
    let volume = stack_with_a_volume(&stack);
    let mut cmd = sandbox.ccci();
    with_file(&mut cmd);
    cmd.args(["janitor", "--json"]);
    let done = run(cmd);
    done.assert_code(0);
    let report: serde_json::Value = serde_json::from_str(&done.out.join("\n")).unwrap();
    assert_eq!(
        candidate(&report, &domain(&sandbox, "cfgh"))["decision"],
        "reap",
        "{report:#}"
    );
    assert!(!volume_exists(&volume));
    let after_janitor = front.connections.load(Ordering::SeqCst);
    assert!(
        after_janitor > 0,
        "the janitor never used the file's engine"
    );

    std::fs::create_dir_all(sandbox.abra_home().join("servers/ci")).unwrap();
    let script = "echo \"host $DOCKER_HOST\"; \
                  docker volume create --label \"com.docker.stack.namespace=$CCCI_STACK_NAME\" \
                  \"${CCCI_STACK_NAME}_data\" >/dev/null \
                  && echo X=1 > \"$ABRA_DIR/servers/ci/$CCCI_APP_DOMAIN.env\" \
                  && echo \"made ${CCCI_STACK_NAME}_data\"";
    let mut cmd = sandbox.run_sh("cfgr", &["--pr", "32"], script);
    with_file(&mut cmd);
    let done = run(cmd);
    done.assert_code(0);
    assert!(
        done.out.contains(&format!("host {}", front.host())),
        "{}",
        done.transcript()
    );
    let made = done
        .out
        .iter()
        .find_map(|l| l.strip_prefix("made "))
        .expect("the command made its volume through the file's engine")
        .to_owned();
    let _cleanup_run = Cleanup(made.trim_end_matches("_data").to_owned());
    assert!(!volume_exists(&made), "the run's teardown left {made}");
    assert!(front.connections.load(Ordering::SeqCst) > after_janitor);

    // doctor asks the engine the file names.
    let mut cmd = sandbox.ccci();
    with_file(&mut cmd);
    cmd.args(["doctor", "--json"]);
    let done = run(cmd);
    let report: serde_json::Value = serde_json::from_str(&done.out.join("\n"))
        .unwrap_or_else(|e| panic!("no JSON ({e})\n{}", done.transcript()));
    let docker_check = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "docker")
        .cloned()
        .unwrap();
    assert_eq!(docker_check["state"], "ok", "{docker_check:#}");
    assert!(
        docker_check["detail"]
            .as_str()
            .unwrap()
            .contains(&format!("answers at {}", front.host())),
        "{docker_check:#}"
    );

    // The precedence, as `config` shows it.
    let shown = |env: Option<&str>, flag: Option<&str>| {
        let mut cmd = sandbox.ccci();
        with_file(&mut cmd);
        if let Some(env) = env {
            cmd.env("DOCKER_HOST", env);
        }
        if let Some(flag) = flag {
            cmd.args(["--docker-host", flag]);
        }
        cmd.arg("config");
        let done = run(cmd);
        done.assert_code(0);
        done.out
            .iter()
            .find(|l| l.starts_with("docker_host "))
            .cloned()
            .unwrap_or_else(|| panic!("no docker_host line\n{}", done.transcript()))
    };
    let line = shown(None, None);
    assert!(
        line.contains(&front.host()) && line.contains("config.toml"),
        "{line}"
    );
    let line = shown(Some("unix:///run/env.sock"), None);
    assert!(
        line.contains("unix:///run/env.sock") && line.contains("DOCKER_HOST"),
        "{line}"
    );
    let line = shown(Some("unix:///run/env.sock"), Some("unix:///run/flag.sock"));
    assert!(
        line.contains("unix:///run/flag.sock") && line.contains("flag"),
        "{line}"
    );

    // A value ccci-run cannot speak to is refused before anything runs, naming the key.
    std::fs::write(&file, "docker_host = \"ssh://ci@host\"\n").unwrap();
    let mut cmd = sandbox.run_sh("cfgbad", &[], "echo ran");
    with_file(&mut cmd);
    let done = run(cmd);
    done.assert_code(2);
    done.assert_stderr_has("docker_host (configuration file)");
    assert!(!done.out.contains(&"ran".to_owned()));
}
