//! One source of configuration: every global setting comes from the command line, else the
//! environment, else the configuration file, else the built-in default — and the paths that
//! the Drone step, the janitor's timer and an operator's shell use stay the same because they
//! all read one file (`--config`, `CCCI_CONFIG`, or `/etc/ccci-run/config.toml` when it exists).
//!
//! Invariant: what comes out is absolute and validated; nothing downstream parses a setting
//! again, and `ccci-run config` shows each value with where it came from.

use std::path::{Path, PathBuf};

use clap::ArgMatches;
use clap::parser::ValueSource;
use serde::{Deserialize, Serialize};

use crate::cli::{CgroupMode, DockerMode, GlobalArgs, LogFormat};
use crate::names::NameError;

/// The configuration file used when neither `--config` nor `CCCI_CONFIG` names one.
pub const DEFAULT_FILE: &str = "/etc/ccci-run/config.toml";

/// The settings a configuration file may hold; anything else is an error (a typo must not pass
/// silently).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub lock_dir: Option<PathBuf>,
    pub abra_home: Option<PathBuf>,
    pub runs_dir: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
    pub domain_suffix: Option<String>,
    pub docker: Option<DockerMode>,
    pub log_format: Option<LogFormat>,
    pub cgroup: Option<CgroupMode>,
    /// Reserved for the etcd backend, which this build does not have: refused when set, so a
    /// fleet never believes it is coordinated when it is not.
    pub etcd_endpoints: Option<Vec<String>>,
}

/// Where a setting's value came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case", tag = "kind", content = "from")]
pub enum Origin {
    Flag,
    Environment(String),
    File(PathBuf),
    Default,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Flag => f.write_str("flag"),
            Self::Environment(var) => write!(f, "environment ({var})"),
            Self::File(path) => write!(f, "file ({})", path.display()),
            Self::Default => f.write_str("default"),
        }
    }
}

/// One effective setting, for `ccci-run config`.
#[derive(Debug, Clone, Serialize)]
pub struct Setting {
    pub key: &'static str,
    pub value: String,
    pub origin: Origin,
}

/// The resolved global settings (paths still to be validated by their users).
#[derive(Debug, Clone)]
pub struct Resolved {
    pub lock_dir: PathBuf,
    pub abra_home: PathBuf,
    pub runs_dir: PathBuf,
    pub state_dir: PathBuf,
    pub domain_suffix: String,
    pub docker: DockerMode,
    pub log_format: LogFormat,
    pub cgroup: CgroupMode,
    /// The file that was read, if any.
    pub file: Option<PathBuf>,
    /// Every setting with its origin, in a fixed order.
    pub settings: Vec<Setting>,
}

/// Resolve the global settings: flag > environment > file > default.
pub fn resolve(args: &GlobalArgs, matches: &ArgMatches) -> Result<Resolved, NameError> {
    let (file, path) = load(args)?;
    if file.etcd_endpoints.is_some() {
        return Err(invalid(
            "configuration file",
            &path,
            "etcd_endpoints: this build has only the local flock backend; remove the key"
                .to_owned(),
        ));
    }
    let mut settings = Vec::new();
    let source = |id: &str, env: &str| match matches.value_source(id) {
        Some(ValueSource::CommandLine) => Some(Origin::Flag),
        Some(ValueSource::EnvVariable) => Some(Origin::Environment(env.to_owned())),
        _ => None,
    };
    let file_origin = || Origin::File(path.clone().unwrap_or_default());

    macro_rules! pick {
        ($id:literal, $env:literal, $flag:expr, $file:expr, $default:expr) => {{
            let (value, origin) = match ($flag.clone(), source($id, $env)) {
                (Some(v), Some(origin)) => (v, origin),
                _ => match $file.clone() {
                    Some(v) => (v, file_origin()),
                    None => ($default, Origin::Default),
                },
            };
            (value, origin)
        }};
    }

    let home_default = || {
        std::env::var_os("HOME")
            .filter(|h| !h.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/root"))
            .join(".abra")
    };
    let (lock_dir, o1) = pick!(
        "lock_dir",
        "CCCI_APP_LOCK_DIR",
        args.lock_dir,
        file.lock_dir,
        PathBuf::from("/run/lock")
    );
    let (abra_home, o2) = pick!(
        "abra_home",
        "CCCI_ABRA_HOME",
        args.abra_home,
        file.abra_home,
        home_default()
    );
    let (runs_dir, o3) = pick!(
        "runs_dir",
        "CCCI_RUNS_DIR",
        args.runs_dir,
        file.runs_dir,
        PathBuf::from("/var/lib/cc-ci-runs")
    );
    let (state_dir, o4) = pick!(
        "state_dir",
        "CCCI_STATE_DIR",
        args.state_dir,
        file.state_dir,
        PathBuf::from("/tmp")
    );
    let (domain_suffix, o5) = pick!(
        "domain_suffix",
        "CCCI_DOMAIN_SUFFIX",
        args.domain_suffix,
        file.domain_suffix,
        crate::names::DEFAULT_DOMAIN_SUFFIX.to_owned()
    );
    let (docker, o6) = pick!(
        "docker",
        "CCCI_DOCKER",
        args.docker,
        file.docker,
        DockerMode::Auto
    );
    let (log_format, o7) = pick!(
        "log_format",
        "CCCI_LOG_FORMAT",
        args.log_format,
        file.log_format,
        LogFormat::Text
    );
    let (cgroup, o8) = pick!(
        "cgroup",
        "CCCI_CGROUP",
        args.cgroup,
        file.cgroup,
        CgroupMode::Auto
    );
    let absolute = |key: &'static str, p: PathBuf| {
        std::path::absolute(&p).map_err(|e| {
            invalid(
                key,
                &Some(p.clone()),
                format!("cannot be made absolute: {e}"),
            )
        })
    };
    let lock_dir = absolute("lock_dir", lock_dir)?;
    let abra_home = absolute("abra_home", abra_home)?;
    let runs_dir = absolute("runs_dir", runs_dir)?;
    let state_dir = absolute("state_dir", state_dir)?;
    for (key, value, origin) in [
        ("lock_dir", lock_dir.display().to_string(), o1),
        ("abra_home", abra_home.display().to_string(), o2),
        ("runs_dir", runs_dir.display().to_string(), o3),
        ("state_dir", state_dir.display().to_string(), o4),
        ("domain_suffix", domain_suffix.clone(), o5),
        ("docker", name_of(docker), o6),
        ("log_format", name_of(log_format), o7),
        ("cgroup", name_of(cgroup), o8),
    ] {
        settings.push(Setting { key, value, origin });
    }
    Ok(Resolved {
        lock_dir,
        abra_home,
        runs_dir,
        state_dir,
        domain_suffix,
        docker,
        log_format,
        cgroup,
        file: path,
        settings,
    })
}

/// The name a value enum has on the command line.
fn name_of(value: impl clap::ValueEnum) -> String {
    value
        .to_possible_value()
        .map(|v| v.get_name().to_owned())
        .unwrap_or_default()
}

fn invalid(what: &'static str, path: &Option<PathBuf>, rule: String) -> NameError {
    NameError {
        what,
        value: path
            .as_deref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        rule,
    }
}

/// Read the configuration file: the one named (it must exist), else the default one if it
/// exists, else none.
fn load(args: &GlobalArgs) -> Result<(FileConfig, Option<PathBuf>), NameError> {
    let (path, required) = match &args.config {
        Some(path) => (path.clone(), true),
        None => (PathBuf::from(DEFAULT_FILE), false),
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(err) if !required && err.kind() == std::io::ErrorKind::NotFound => {
            return Ok((FileConfig::default(), None));
        }
        Err(err) => {
            return Err(invalid(
                "configuration file",
                &Some(path),
                format!("cannot be read (--config, CCCI_CONFIG): {err}"),
            ));
        }
    };
    parse(&text, &path).map(|config| (config, Some(path)))
}

/// Parse a configuration file's text; errors name the file and, from the TOML parser, the key
/// and line.
pub fn parse(text: &str, path: &Path) -> Result<FileConfig, NameError> {
    toml::from_str(text).map_err(|e| NameError {
        what: "configuration file",
        value: path.display().to_string(),
        rule: e.to_string().trim().replace('\n', " "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_parses_and_unknown_keys_are_refused() {
        let path = Path::new("/etc/ccci-run/config.toml");
        let config = parse(
            "lock_dir = \"/run/lock\"\nabra_home = \"/root/.abra\"\nruns_dir = \"/r\"\n\
             state_dir = \"/s\"\ndomain_suffix = \"ci.example\"\ndocker = \"required\"\n\
             log_format = \"json\"\ncgroup = \"off\"\n",
            path,
        )
        .unwrap();
        assert_eq!(config.docker, Some(DockerMode::Required));
        assert_eq!(config.cgroup, Some(CgroupMode::Off));
        let err = parse("lock_dri = \"/x\"\n", path).unwrap_err();
        assert!(err.to_string().contains("lock_dri"), "{err}");
        assert!(parse("docker = \"sometimes\"\n", path).is_err());
    }

    #[test]
    fn a_named_file_must_exist_and_etcd_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut args = <crate::cli::Cli as clap::Parser>::parse_from(["ccci-run", "man"]).global;
        args.config = Some(dir.path().join("missing.toml"));
        let err = load(&args).unwrap_err();
        assert!(
            err.to_string()
                .contains("cannot be read (--config, CCCI_CONFIG)"),
            "{err}"
        );
        let file = dir.path().join("etcd.toml");
        std::fs::write(&file, "etcd_endpoints = [\"http://127.0.0.1:2379\"]\n").unwrap();
        args.config = Some(file);
        let matches = <crate::cli::Cli as clap::CommandFactory>::command()
            .get_matches_from(["ccci-run", "man"]);
        let err = resolve(&args, &matches).unwrap_err();
        assert!(
            err.to_string().contains("only the local flock backend"),
            "{err}"
        );
    }
}
