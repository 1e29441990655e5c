//! Which Docker engine to talk to: `DOCKER_HOST` (with `DOCKER_TLS_VERIFY` and
//! `DOCKER_CERT_PATH`), read the way the docker CLI reads them, validated once.
//!
//! Invariant: the engine named is the engine used. A `DOCKER_HOST` that this build cannot speak
//! to is an error naming the value, never a quiet fall-back to the default socket, where
//! another engine's stacks could be reaped. Understood:
//! - unset or empty: `unix:///var/run/docker.sock`;
//! - `unix:///ABSOLUTE/PATH`: that socket;
//! - `tcp://HOST[:PORT]` (port 2375, or 2376 with TLS, when none is given; `[::1]` for IPv6):
//!   plain HTTP, or TLS when `DOCKER_TLS_VERIFY` is set to anything non-empty (as for the docker
//!   CLI), with `ca.pem`, `cert.pem` and `key.pem` from `DOCKER_CERT_PATH` (default
//!   `~/.docker`): the engine's certificate is verified, ours is presented.
//!
//! Refused: any other scheme (`ssh://`, `fd://`, `npipe://`, `http://`, …), a path after a TCP
//! address, `DOCKER_TLS` without `DOCKER_TLS_VERIFY` (TLS that does not check the engine), and
//! certificate files that are missing.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::names::NameError;

/// The socket used when `DOCKER_HOST` is unset or empty.
pub(crate) const DEFAULT_SOCKET: &str = crate::config::DEFAULT_DOCKER_SOCKET;

/// What the refusals say every time: the forms that work.
const FORMS: &str = "use unix:///PATH or tcp://HOST:PORT (TLS with DOCKER_TLS_VERIFY=1 and \
                     DOCKER_CERT_PATH), or --docker off";

/// A Docker engine's address, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Endpoint {
    /// A Unix socket.
    Unix(PathBuf),
    /// Plain HTTP to `host:port`.
    Tcp(String),
    /// TLS to `host:port`: the engine verified against `ca`, our `cert` and `key` presented.
    Tls {
        addr: String,
        ca: PathBuf,
        cert: PathBuf,
        key: PathBuf,
    },
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unix(path) => write!(f, "unix://{}", path.display()),
            Self::Tcp(addr) => write!(f, "tcp://{addr}"),
            Self::Tls { addr, .. } => write!(f, "tcp://{addr} (TLS)"),
        }
    }
}

/// The environment that chooses the engine, as read from the process (or as `--docker-host`
/// and the configuration file's `docker_host` make it: [`choose`]).
#[derive(Debug, Clone, Default)]
pub(crate) struct DockerEnv {
    pub host: Option<OsString>,
    /// What named the host, for messages: `DOCKER_HOST` unless the flag or the file did.
    pub named_by: Option<&'static str>,
    /// The host came from the flag or the file: a run's command gets it as its `DOCKER_HOST`.
    pub export: bool,
    pub tls_verify: Option<OsString>,
    pub tls: Option<OsString>,
    pub cert_path: Option<OsString>,
    /// Where `~/.docker` is, when `DOCKER_CERT_PATH` is not set.
    pub home: Option<PathBuf>,
}

impl DockerEnv {
    pub(crate) fn from_process() -> Self {
        let home = crate::config::home_dir();
        Self {
            host: crate::config::env::var_os("DOCKER_HOST"),
            named_by: None,
            export: false,
            tls_verify: crate::config::env::var_os("DOCKER_TLS_VERIFY"),
            tls: crate::config::env::var_os("DOCKER_TLS"),
            cert_path: crate::config::env::var_os("DOCKER_CERT_PATH"),
            home,
        }
    }
}

fn set(value: &Option<OsString>) -> bool {
    value.as_ref().is_some_and(|v| !v.is_empty())
}

/// The engine this process uses, once [`choose`] has chosen it.
static CHOSEN: std::sync::OnceLock<DockerEnv> = std::sync::OnceLock::new();

/// Choose the engine for this process, once, from the resolved configuration: the environment's
/// (`DOCKER_HOST`, `DOCKER_TLS_VERIFY`, `DOCKER_CERT_PATH`), unless `--docker-host` names one,
/// or the environment names none and the file's `docker_host` does. The file's TLS settings
/// apply where the environment sets none. Nothing is validated here: a command that uses
/// Docker refuses a bad value (exit 2, [`Endpoint::from_env`]), others never look.
pub(crate) fn choose(host: Option<&crate::config::DockerHost>) {
    let mut env = DockerEnv::from_process();
    if let Some(h) = host {
        env.host = Some(h.host.clone().into());
        env.named_by = Some(match h.origin {
            crate::config::Origin::Flag => "--docker-host",
            _ => "docker_host (configuration file)",
        });
        env.export = true;
        if !set(&env.tls_verify) && h.tls_verify {
            env.tls_verify = Some("1".into());
        }
        if !set(&env.cert_path) {
            env.cert_path = h.cert_path.clone().map(Into::into);
        }
    }
    let _ = CHOSEN.set(env);
}

/// The chosen engine's environment (the process's, before [`choose`]).
fn chosen() -> DockerEnv {
    CHOSEN
        .get()
        .cloned()
        .unwrap_or_else(DockerEnv::from_process)
}

/// The engine's address as it was given, for messages: "what named it: value".
pub(crate) fn named() -> String {
    let env = chosen();
    format!(
        "{} {:?}",
        env.named_by.unwrap_or("DOCKER_HOST"),
        env.host.unwrap_or_default().to_string_lossy()
    )
}

/// What a run's command needs in its environment to reach the same engine as the run: when
/// the flag or the file chose it, `DOCKER_HOST` (and the TLS variables it was chosen with);
/// nothing when the environment chose, since the command inherits that.
pub(crate) fn exported() -> Vec<(&'static str, OsString)> {
    let env = chosen();
    if !env.export {
        return Vec::new();
    }
    let mut vars = vec![("DOCKER_HOST", env.host.unwrap_or_default())];
    if set(&env.tls_verify) {
        vars.push(("DOCKER_TLS_VERIFY", "1".into()));
        if let Some(path) = env.cert_path.filter(|p| !p.is_empty()) {
            vars.push(("DOCKER_CERT_PATH", path));
        }
    }
    vars
}

impl Endpoint {
    /// The engine this process uses: as [`choose`] chose it, else as the process environment
    /// names it.
    pub(crate) fn from_env() -> Result<Self, NameError> {
        Self::parse(&chosen())
    }

    /// The engine `env` names, or why it names none this build can use.
    pub(crate) fn parse(env: &DockerEnv) -> Result<Self, NameError> {
        let raw = env.host.clone().unwrap_or_default();
        let bad = |rule: String| NameError {
            what: env.named_by.unwrap_or("DOCKER_HOST"),
            value: raw.to_string_lossy().into_owned(),
            rule,
        };
        if raw.is_empty() {
            return Ok(Self::Unix(PathBuf::from(DEFAULT_SOCKET)));
        }
        let Some(host) = raw.to_str() else {
            return Err(bad(format!("it is not UTF-8; {FORMS}")));
        };
        if let Some(path) = host.strip_prefix("unix://") {
            if !path.starts_with('/') {
                return Err(bad(format!(
                    "a unix:// address needs an absolute socket path (unix:///run/docker.sock); \
                     {FORMS}"
                )));
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        let Some(rest) = host.strip_prefix("tcp://") else {
            let why = match host.split_once("://") {
                Some((scheme, _)) => format!("the {scheme}:// scheme is not supported by ccci-run"),
                None => "it names no scheme".to_owned(),
            };
            return Err(bad(format!("{why}; {FORMS}")));
        };
        let tls = set(&env.tls_verify);
        if !tls && set(&env.tls) {
            return Err(NameError {
                what: "DOCKER_TLS",
                value: env
                    .tls
                    .clone()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned(),
                rule: "TLS without verifying the engine's certificate is not supported: set \
                       DOCKER_TLS_VERIFY=1 (with ca.pem, cert.pem and key.pem in \
                       DOCKER_CERT_PATH), or unset DOCKER_TLS for plain TCP"
                    .to_owned(),
            });
        }
        let default_port = if tls { 2376 } else { 2375 };
        let addr = host_port(rest, default_port).map_err(|why| bad(format!("{why}; {FORMS}")))?;
        if !tls {
            return Ok(Self::Tcp(addr));
        }
        let dir = match &env.cert_path {
            Some(dir) if !dir.is_empty() => PathBuf::from(dir),
            _ => match &env.home {
                Some(home) => home.join(".docker"),
                None => {
                    return Err(NameError {
                        what: "DOCKER_CERT_PATH",
                        value: String::new(),
                        rule: "it is not set and there is no home directory to find .docker in"
                            .to_owned(),
                    });
                }
            },
        };
        let file = |name: &str| -> Result<PathBuf, NameError> {
            let path = dir.join(name);
            match std::fs::metadata(&path) {
                Ok(meta) if meta.is_file() => Ok(path),
                Ok(_) => Err(cert_error(
                    &dir,
                    format!("{} is not a regular file", path.display()),
                )),
                Err(err) => Err(cert_error(&dir, format!("{}: {err}", path.display()))),
            }
        };
        Ok(Self::Tls {
            addr,
            ca: file("ca.pem")?,
            cert: file("cert.pem")?,
            key: file("key.pem")?,
        })
    }
}

fn cert_error(dir: &Path, why: String) -> NameError {
    NameError {
        what: "DOCKER_CERT_PATH (DOCKER_TLS_VERIFY is set)",
        value: dir.display().to_string(),
        rule: format!("{why}; it must hold ca.pem, cert.pem and key.pem"),
    }
}

/// `HOST[:PORT][/]` as `HOST:PORT`, the port defaulted; a path, an empty host or a bad port is
/// an error.
fn host_port(rest: &str, default_port: u16) -> Result<String, String> {
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('/') {
        return Err("a tcp:// address takes no path".to_owned());
    }
    if rest.contains('@') || rest.contains('?') || rest.contains('#') {
        return Err("a tcp:// address is HOST:PORT and nothing else".to_owned());
    }
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        let (inside, after) = v6
            .split_once(']')
            .ok_or_else(|| "an IPv6 address needs its closing ]".to_owned())?;
        if inside.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("[{inside}] is not an IPv6 address"));
        }
        let port = match after.strip_prefix(':') {
            Some(port) => Some(port),
            None if after.is_empty() => None,
            None => return Err("expected :PORT after the IPv6 address".to_owned()),
        };
        (format!("[{inside}]"), port)
    } else {
        match rest.rsplit_once(':') {
            Some((host, port)) => (host.to_owned(), Some(port)),
            None => (rest.to_owned(), None),
        }
    };
    if host.is_empty() || (host.contains(':') && !host.starts_with('[')) {
        return Err("a tcp:// address needs a host (an IPv6 one in brackets)".to_owned());
    }
    let port = match port {
        None => default_port,
        Some(port) => match port.parse::<u16>() {
            Ok(port) if port > 0 => port,
            _ => return Err(format!("{port:?} is not a port in 1-65535")),
        },
    };
    Ok(format!("{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn env(host: &str) -> DockerEnv {
        DockerEnv {
            host: Some(host.into()),
            home: Some("/nonexistent-home".into()),
            ..DockerEnv::default()
        }
    }

    #[rstest]
    #[case("", Endpoint::Unix(DEFAULT_SOCKET.into()))]
    #[case("unix:///tmp/d.sock", Endpoint::Unix("/tmp/d.sock".into()))]
    #[case("tcp://127.0.0.1:2375", Endpoint::Tcp("127.0.0.1:2375".into()))]
    #[case("tcp://127.0.0.1:2375/", Endpoint::Tcp("127.0.0.1:2375".into()))]
    #[case("tcp://docker.example", Endpoint::Tcp("docker.example:2375".into()))]
    #[case("tcp://[::1]:2380", Endpoint::Tcp("[::1]:2380".into()))]
    #[case("tcp://[::1]", Endpoint::Tcp("[::1]:2375".into()))]
    fn understood(#[case] host: &str, #[case] want: Endpoint) {
        assert_eq!(Endpoint::parse(&env(host)), Ok(want));
    }

    #[test]
    fn unset_is_the_default_socket() {
        assert_eq!(
            Endpoint::parse(&DockerEnv::default()),
            Ok(Endpoint::Unix(DEFAULT_SOCKET.into()))
        );
    }

    #[rstest]
    #[case("ssh://x", "the ssh:// scheme is not supported")]
    #[case("ssh://user@host:22", "the ssh:// scheme is not supported")]
    #[case("garbage", "it names no scheme")]
    #[case("/var/run/docker.sock", "it names no scheme")]
    #[case("http://127.0.0.1:2375", "the http:// scheme is not supported")]
    #[case("https://127.0.0.1:2376", "the https:// scheme is not supported")]
    #[case("fd://", "the fd:// scheme is not supported")]
    #[case(
        "npipe:////./pipe/docker_engine",
        "the npipe:// scheme is not supported"
    )]
    #[case("unix://", "needs an absolute socket path")]
    #[case("unix://relative.sock", "needs an absolute socket path")]
    #[case("tcp://", "needs a host")]
    #[case("tcp://:2375", "needs a host")]
    #[case("tcp://h:0", "\"0\" is not a port")]
    #[case("tcp://h:99999", "\"99999\" is not a port")]
    #[case("tcp://h:x", "\"x\" is not a port")]
    #[case("tcp://h:2375/prefix", "takes no path")]
    #[case("tcp://u@h:2375", "HOST:PORT and nothing else")]
    #[case("tcp://[::1", "closing ]")]
    #[case("tcp://[zz]:1", "not an IPv6 address")]
    #[case("tcp://::1:2375", "needs a host")]
    fn refused_naming_the_value(#[case] host: &str, #[case] why: &str) {
        let err = Endpoint::parse(&env(host)).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("invalid DOCKER_HOST {host:?}: ")),
            "{err}"
        );
        assert!(err.contains(why), "{err}");
        assert!(err.contains("unix:///PATH or tcp://HOST:PORT"), "{err}");
    }

    #[test]
    fn tls_needs_verification_and_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = env("tcp://127.0.0.1:2376");
        e.tls = Some("1".into());
        let err = Endpoint::parse(&e).unwrap_err().to_string();
        assert!(err.contains("DOCKER_TLS_VERIFY=1"), "{err}");

        e.tls_verify = Some("1".into());
        e.cert_path = Some(dir.path().into());
        let err = Endpoint::parse(&e).unwrap_err().to_string();
        assert!(
            err.contains("DOCKER_CERT_PATH") && err.contains("ca.pem"),
            "{err}"
        );
        for name in ["ca.pem", "cert.pem", "key.pem"] {
            std::fs::write(dir.path().join(name), "").unwrap();
        }
        assert_eq!(
            Endpoint::parse(&e),
            Ok(Endpoint::Tls {
                addr: "127.0.0.1:2376".into(),
                ca: dir.path().join("ca.pem"),
                cert: dir.path().join("cert.pem"),
                key: dir.path().join("key.pem"),
            })
        );
        // The default port with TLS is 2376; without DOCKER_CERT_PATH, ~/.docker.
        e.host = Some("tcp://127.0.0.1".into());
        e.cert_path = None;
        let err = Endpoint::parse(&e).unwrap_err().to_string();
        assert!(err.contains("/nonexistent-home/.docker"), "{err}");
        // A Unix socket ignores the TLS settings, as the docker CLI does.
        e.host = Some("unix:///tmp/d.sock".into());
        assert_eq!(
            Endpoint::parse(&e),
            Ok(Endpoint::Unix("/tmp/d.sock".into()))
        );
    }
}
