//! Resolution: each setting from the command line, else the environment, else the file, else
//! its default, with where it came from ([`Origin`]) for `ccci-run config`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use crate::config::keys::{FileConfig, load};
use crate::config::services::{DockerHost, EtcdSettings, NodeSweepSettings};
use crate::config::values::{
    CgroupMode, Choice, DEFAULT_LEASE_TTL, DEFAULT_NODE_DOCKER_SOCKET, DEFAULT_NODE_SWEEP_IMAGE,
    DockerMode, LEASE_TTL_SPEC, LogFormat, Origin, TIMINGS, Timing, Timings,
};
use crate::names::NameError;

/// A yes/no environment value: empty, `0`, `false`, `no`, `off` are no; `1`, `true`, `yes`,
/// `on` are yes (any case); anything else is a usage error naming the variable.
pub(super) fn parse_boolish(var: &'static str, value: &str) -> Result<bool, NameError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "" | "0" | "false" | "no" | "off" | "n" | "f" => Ok(false),
        "1" | "true" | "yes" | "on" | "y" | "t" => Ok(true),
        _ => Err(NameError {
            what: var,
            value: value.to_owned(),
            rule: "must be 1/true/yes/on or 0/false/no/off (or empty)".to_owned(),
        }),
    }
}

/// One effective setting, for `ccci-run config`: `value` is what the table shows; a setting
/// with no value (`absent`) is `null` in JSON, whatever the table says of it.
#[derive(Debug, Clone)]
pub(crate) struct Setting {
    pub key: &'static str,
    pub value: String,
    pub absent: bool,
    pub origin: Origin,
}

impl Serialize for Setting {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut s = serializer.serialize_struct("Setting", 3)?;
        s.serialize_field("key", self.key)?;
        s.serialize_field("value", &(!self.absent).then_some(&self.value))?;
        s.serialize_field("origin", &self.origin)?;
        s.end()
    }
}

/// The resolved global settings (paths still to be validated by their users).
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    pub lock_dir: PathBuf,
    pub abra_home: PathBuf,
    pub runs_dir: PathBuf,
    pub state_dir: PathBuf,
    pub domain_suffix: String,
    pub docker: DockerMode,
    pub docker_host: Option<DockerHost>,
    pub runner: Option<(u32, u32)>,
    pub log_format: LogFormat,
    pub cgroup: CgroupMode,
    pub etcd: Option<EtcdSettings>,
    pub timings: Timings,
    pub recipe_url_template: Option<String>,
    pub node_sweep: NodeSweepSettings,
    /// Every setting with its origin, in a fixed order.
    pub settings: Vec<Setting>,
}

/// A value given on the command line or in the environment, with which of the two it was.
pub(crate) type Given<T> = Option<(T, Origin)>;

/// What the command line and the environment say about the global settings; the CLI produces
/// it, [`resolve`] layers the file and the defaults under it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Inputs {
    pub config: Option<PathBuf>,
    pub lock_dir: Given<PathBuf>,
    pub abra_home: Given<PathBuf>,
    pub runs_dir: Given<PathBuf>,
    pub state_dir: Given<PathBuf>,
    pub domain_suffix: Given<String>,
    pub docker: Given<DockerMode>,
    /// `--docker-host` (the environment's `DOCKER_HOST` is read where the engine is chosen).
    pub docker_host: Given<String>,
    pub log_format: Given<LogFormat>,
    pub cgroup: Given<CgroupMode>,
    pub etcd_endpoints: Given<Vec<String>>,
    pub lease_ttl: Given<Duration>,
    /// Run settings given on the command line.
    pub timings: Vec<(Timing, Duration)>,
}

/// The first of: the value given, the file's, the default — with where it came from.
pub(super) fn pick<T>(
    given: Given<T>,
    file: Option<T>,
    file_origin: &Origin,
    default: T,
) -> (T, Origin) {
    match (given, file) {
        (Some(given), _) => given,
        (None, Some(v)) => (v, file_origin.clone()),
        (None, None) => (default, Origin::Default),
    }
}

/// Our home: `$HOME`, or, when it is unset or empty, the home directory of the user we run as.
pub(crate) fn home_dir() -> Option<PathBuf> {
    super::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .or_else(|| {
            nix::unistd::User::from_uid(nix::unistd::Uid::effective())
                .ok()
                .flatten()
                .map(|user| user.dir)
        })
}

/// `<home>/.abra` ([`home_dir`]), and `/root/.abra` only when no home is known.
pub(super) fn home_default() -> PathBuf {
    home_dir()
        .unwrap_or_else(|| PathBuf::from("/root"))
        .join(".abra")
}

/// Resolve the global settings: flag > environment > file > default.
pub(crate) fn resolve(inputs: &Inputs) -> Result<Resolved, NameError> {
    let (file, path) = load(inputs.config.as_deref())?;
    let from_file = Origin::File(path.clone().unwrap_or_default());
    let mut node_sweep_shown = Vec::new();
    let node_sweep = node_sweep_settings(&file, &from_file, &mut node_sweep_shown)?;
    let i = inputs.clone();
    let (timings, shown_timings) = resolve_timings(
        &i.timings,
        &file,
        path.as_deref().unwrap_or(Path::new("")),
        &from_file,
    )?;
    let absolute = |key: &'static str, (p, origin): (PathBuf, Origin)| {
        // A NUL cannot reach the kernel, and a newline or escape in a path would forge lines
        // in every listing and log that shows it.
        if let Some(c) = p
            .as_os_str()
            .as_encoded_bytes()
            .iter()
            .find(|b| b.is_ascii_control())
        {
            return Err(NameError {
                what: key,
                value: p.display().to_string().escape_debug().to_string(),
                rule: format!(
                    "holds the control character {:?}; a path has none",
                    char::from(*c)
                ),
            });
        }
        std::path::absolute(&p).map(|p| (p, origin)).map_err(|e| {
            invalid(
                key,
                &Some(p.clone()),
                format!("cannot be made absolute: {e}"),
            )
        })
    };
    let lock_dir = absolute(
        "lock_dir",
        pick(i.lock_dir, file.lock_dir, &from_file, "/run/lock".into()),
    )?;
    let abra_home = absolute(
        "abra_home",
        pick(i.abra_home, file.abra_home, &from_file, home_default()),
    )?;
    let runs_dir = absolute(
        "runs_dir",
        pick(
            i.runs_dir,
            file.runs_dir,
            &from_file,
            "/var/lib/cc-ci-runs".into(),
        ),
    )?;
    let state_dir = absolute(
        "state_dir",
        // The runs' user's own, beside its runs: never a directory others may write to.
        pick(
            i.state_dir,
            file.state_dir,
            &from_file,
            crate::names::state_dir_of(&runs_dir.0),
        ),
    )?;
    let default_suffix = crate::names::DEFAULT_DOMAIN_SUFFIX.to_owned();
    let domain_suffix = pick(
        i.domain_suffix,
        file.domain_suffix,
        &from_file,
        default_suffix,
    );
    let docker = pick(i.docker, file.docker, &from_file, DockerMode::Auto);
    // The engine: the flag, else the environment's DOCKER_HOST (read where the engine is
    // chosen), else the file's docker_host, else the default socket.
    let env_host = super::env::var("DOCKER_HOST")
        .ok()
        .filter(|h| !h.is_empty());
    let docker_host = match (i.docker_host, &env_host, file.docker_host.clone()) {
        (Some((host, origin)), _, _) => Some((host, origin)),
        (None, Some(_), _) => None,
        (None, None, Some(host)) => Some((host, from_file.clone())),
        (None, None, None) => None,
    }
    .map(|(host, origin)| DockerHost {
        host,
        origin,
        tls_verify: file.docker_tls_verify.unwrap_or(false),
        cert_path: file.docker_cert_path.clone(),
    });
    // The runner's user, by name or uid, as the host has it now.
    let runner = match &file.runner_user {
        None => None,
        Some(user) => {
            let found = match user.parse::<u32>() {
                Ok(uid) => nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)),
                Err(_) => nix::unistd::User::from_name(user),
            };
            match found {
                Ok(Some(u)) => Some((u.uid.as_raw(), u.gid.as_raw())),
                Ok(None) | Err(_) => {
                    return Err(invalid(
                        "runner_user",
                        &path,
                        format!("{user:?} is no user of this host (a name or a uid)"),
                    ));
                }
            }
        }
    };
    let runner_shown = match &file.runner_user {
        Some(user) => setting("runner_user", user.clone(), &from_file),
        None => unset("runner_user", "none", &Origin::Default),
    };
    let docker_host_shown = match (&docker_host, &env_host) {
        (Some(h), _) => setting("docker_host", h.host.clone(), &h.origin),
        (None, Some(h)) => setting(
            "docker_host",
            h.clone(),
            &Origin::Environment("DOCKER_HOST".to_owned()),
        ),
        (None, None) => setting(
            "docker_host",
            format!("unix://{}", crate::config::values::DEFAULT_DOCKER_SOCKET),
            &Origin::Default,
        ),
    };
    // TLS to a TCP engine: the file's settings, else the environment's (as the docker CLI
    // reads them), else none.
    let env_set = |var: &str| {
        super::env::var(var)
            .ok()
            .filter(|v| !v.is_empty())
            .map(|v| (v, Origin::Environment(var.to_owned())))
    };
    let tls_verify_shown = match (file.docker_tls_verify, env_set("DOCKER_TLS_VERIFY")) {
        (Some(on), _) => setting("docker_tls_verify", yes_no(on), &from_file),
        (None, Some((_, origin))) => setting("docker_tls_verify", yes_no(true), &origin),
        (None, None) => setting("docker_tls_verify", yes_no(false), &Origin::Default),
    };
    let cert_path_shown = match (&file.docker_cert_path, env_set("DOCKER_CERT_PATH")) {
        (Some(path), _) => setting("docker_cert_path", path.display().to_string(), &from_file),
        (None, Some((path, origin))) => setting("docker_cert_path", path, &origin),
        (None, None) => setting("docker_cert_path", "~/.docker".to_owned(), &Origin::Default),
    };
    let log_format = pick(i.log_format, file.log_format, &from_file, LogFormat::Text);
    let cgroup = pick(i.cgroup, file.cgroup, &from_file, CgroupMode::Auto);
    let endpoints = pick(
        i.etcd_endpoints,
        file.etcd_endpoints,
        &from_file,
        Vec::new(),
    );
    let file_path = path.clone().unwrap_or_default();
    let file_ttl = file
        .lease_ttl
        .as_ref()
        .map(|v| v.parse("lease_ttl", &LEASE_TTL_SPEC, &file_path))
        .transpose()?;
    let lease_ttl = pick(
        i.lease_ttl,
        file_ttl,
        &from_file,
        Duration::from_secs(DEFAULT_LEASE_TTL.into()),
    );
    let ttl_secs = u32::try_from(lease_ttl.0.as_secs()).unwrap_or(u32::MAX);
    let etcd = EtcdSettings::validate(&endpoints.0, ttl_secs).map_err(|rule| NameError {
        what: "etcd settings (--etcd-endpoints, --lease-ttl, CCCI_ETCD_ENDPOINTS, CCCI_LEASE_TTL, etcd_endpoints, lease_ttl)",
        value: endpoints.0.join(","),
        rule,
    })?;
    let shown = |p: &PathBuf| p.display().to_string();
    let settings = vec![
        setting("lock_dir", shown(&lock_dir.0), &lock_dir.1),
        setting("abra_home", shown(&abra_home.0), &abra_home.1),
        setting("runs_dir", shown(&runs_dir.0), &runs_dir.1),
        setting("state_dir", shown(&state_dir.0), &state_dir.1),
        setting("domain_suffix", domain_suffix.0.clone(), &domain_suffix.1),
        setting("docker", docker.0.name().to_owned(), &docker.1),
        docker_host_shown,
        tls_verify_shown,
        cert_path_shown,
        runner_shown,
        setting("log_format", log_format.0.name().to_owned(), &log_format.1),
        setting("cgroup", cgroup.0.name().to_owned(), &cgroup.1),
        if endpoints.0.is_empty() {
            unset("etcd_endpoints", "none (local flocks)", &endpoints.1)
        } else {
            setting("etcd_endpoints", endpoints.0.join(","), &endpoints.1)
        },
        setting(
            "lease_ttl",
            crate::duration::show(lease_ttl.0),
            &lease_ttl.1,
        ),
    ];
    let recipe_url_template = match super::env::var("CCCI_RECIPE_URL_TEMPLATE") {
        Ok(template) => Some((
            template,
            Origin::Environment("CCCI_RECIPE_URL_TEMPLATE".to_owned()),
        )),
        Err(_) => file
            .recipe_url_template
            .clone()
            .map(|t| (t, from_file.clone())),
    };
    // Without `{recipe}` every recipe would be fetched from the one repository it names.
    if let Some((template, origin)) = &recipe_url_template {
        if !template.contains("{recipe}") {
            return Err(NameError {
                what: "recipe_url_template",
                value: crate::recipe_url::redact(template),
                rule: format!(
                    "from the {origin}, has no {{recipe}}: every recipe would be fetched from the one \
                     repository it names; write where the recipe's name goes, for example \
                     {}",
                    crate::recipe_url::DEFAULT_URL_TEMPLATE
                ),
            });
        }
    }
    let mut settings = settings;
    settings.extend(node_sweep_shown);
    settings.push(match &recipe_url_template {
        // Shown as the recipe URL is everywhere: credentials redacted.
        Some((t, origin)) => setting("recipe_url_template", crate::recipe_url::redact(t), origin),
        None => setting(
            "recipe_url_template",
            crate::recipe_url::DEFAULT_URL_TEMPLATE.to_owned(),
            &Origin::Default,
        ),
    });
    settings.extend(shown_timings);
    Ok(Resolved {
        lock_dir: lock_dir.0,
        abra_home: abra_home.0,
        runs_dir: runs_dir.0,
        state_dir: state_dir.0,
        domain_suffix: domain_suffix.0,
        docker: docker.0,
        docker_host,
        runner,
        log_format: log_format.0,
        cgroup: cgroup.0,
        etcd,
        timings,
        recipe_url_template: recipe_url_template.map(|(t, _)| t),
        node_sweep,
        settings,
    })
}

/// The node sweep's image and node socket: the environment, else the file, else the default;
/// each shown with its origin. An empty image, or a socket path that is not absolute, is
/// refused (the job would fail on every node, every sweep).
pub(super) fn node_sweep_settings(
    file: &FileConfig,
    from_file: &Origin,
    settings: &mut Vec<Setting>,
) -> Result<NodeSweepSettings, NameError> {
    let env = |name: &str| {
        super::env::var(name)
            .ok()
            .map(|v| (v, Origin::Environment(name.to_owned())))
    };
    let (image, image_origin) = env("CCCI_NODE_SWEEP_IMAGE")
        .or_else(|| {
            file.node_sweep_image
                .clone()
                .map(|v| (v, from_file.clone()))
        })
        .unwrap_or_else(|| (DEFAULT_NODE_SWEEP_IMAGE.to_owned(), Origin::Default));
    if image.trim().is_empty() || image.chars().any(char::is_whitespace) {
        return Err(NameError {
            what: "node sweep image (CCCI_NODE_SWEEP_IMAGE, node_sweep_image)",
            value: image,
            rule: "must name an image with a docker CLI, such as docker:27-cli, without spaces"
                .to_owned(),
        });
    }
    let (socket, socket_origin) = env("CCCI_NODE_DOCKER_SOCKET")
        .map(|(v, o)| (PathBuf::from(v), o))
        .or_else(|| {
            file.node_docker_socket
                .clone()
                .map(|v| (v, from_file.clone()))
        })
        .unwrap_or_else(|| (PathBuf::from(DEFAULT_NODE_DOCKER_SOCKET), Origin::Default));
    if !socket.is_absolute() {
        return Err(NameError {
            what: "node Docker socket (CCCI_NODE_DOCKER_SOCKET, node_docker_socket)",
            value: socket.display().to_string(),
            rule: "must be an absolute path, the same on every node, such as /var/run/docker.sock"
                .to_owned(),
        });
    }
    settings.push(setting("node_sweep_image", image.clone(), &image_origin));
    settings.push(setting(
        "node_docker_socket",
        socket.display().to_string(),
        &socket_origin,
    ));
    Ok(NodeSweepSettings { image, socket })
}

/// The run settings: each from the command line, else its environment variable, else the
/// file, else its default; with what `ccci-run config` shows of each.
pub(super) fn resolve_timings(
    flags: &[(Timing, Duration)],
    file: &FileConfig,
    path: &Path,
    from_file: &Origin,
) -> Result<(Timings, Vec<Setting>), NameError> {
    let mut timings = Timings::default();
    let mut shown = Vec::new();
    for (at, info) in TIMINGS.iter().enumerate() {
        let flag = flags
            .iter()
            .rev()
            .find(|(t, _)| *t == info.timing)
            .map(|(_, v)| (*v, Origin::Flag));
        // A flag wins: the variable is not even read then, so a bad value set for every step
        // never turns an explicit flag into a usage error.
        let env = match super::env::var_os(info.env).filter(|_| flag.is_none()) {
            Some(value) => {
                let text = value.to_string_lossy();
                let parsed =
                    crate::duration::parse(&text, &info.spec).map_err(|rule| NameError {
                        what: info.env,
                        value: text.clone().into_owned(),
                        rule,
                    })?;
                Some((parsed, Origin::Environment(info.env.to_owned())))
            }
            None => None,
        };
        let from_file_value = file
            .timing(info.timing)
            .map(|v| v.parse(info.key, &info.spec, path))
            .transpose()?;
        let (value, origin) = match (flag.or(env), from_file_value) {
            (Some(given), _) => (Some(given.0), given.1),
            (None, Some(v)) => (Some(v), from_file.clone()),
            (None, None) => (info.default, Origin::Default),
        };
        timings.values[at] = value;
        timings.origins[at] = origin.clone();
        shown.push(match value {
            Some(value) => setting(info.key, crate::duration::show(value), &origin),
            None => unset(info.key, info.unset, &origin),
        });
    }
    Ok((timings, shown))
}

pub(super) fn setting(key: &'static str, value: String, origin: &Origin) -> Setting {
    Setting {
        key,
        value,
        absent: false,
        origin: origin.clone(),
    }
}

/// A setting with no value: `shown` in the table, `null` in JSON.
fn unset(key: &'static str, shown: &str, origin: &Origin) -> Setting {
    Setting {
        absent: true,
        ..setting(key, shown.to_owned(), origin)
    }
}

fn yes_no(on: bool) -> String {
    if on { "yes" } else { "no" }.to_owned()
}

pub(super) fn invalid(what: &'static str, path: &Option<PathBuf>, rule: String) -> NameError {
    NameError {
        what,
        value: path
            .as_deref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        rule,
    }
}

/// `CCCI_LOG_FORMAT`, when it names a format.
pub(crate) fn log_format_from_env() -> Option<LogFormat> {
    super::env::var("CCCI_LOG_FORMAT")
        .ok()
        .and_then(|v| LogFormat::from_name(&v))
}

/// The log format of an error that came before the configuration could be resolved: `given`
/// (the flag, else the environment), else the configuration file's `log_format` when that
/// file can be read and parsed, else text.
pub(crate) fn log_format_for_errors(
    given: Option<LogFormat>,
    config: Option<PathBuf>,
) -> LogFormat {
    given
        .or_else(|| load(config.as_deref()).ok()?.0.log_format)
        .unwrap_or(LogFormat::Text)
}
