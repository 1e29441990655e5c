//! The configuration file's settings: what a file may hold (anything else is an error naming
//! the nearest key), read through [`crate::config_file`]'s rules.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::config::values::{CgroupMode, DockerMode, LogFormat, Timing};
use crate::duration::Spec;
use crate::names::NameError;

/// The configuration file used when neither `--config` nor `CCCI_CONFIG` names one.
pub(crate) const DEFAULT_FILE: &str = "/etc/ccci-run/config.toml";

/// The settings a configuration file may hold; anything else is an error (a typo must not pass
/// silently).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileConfig {
    pub lock_dir: Option<PathBuf>,
    pub abra_home: Option<PathBuf>,
    pub runs_dir: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
    pub domain_suffix: Option<String>,
    pub docker: Option<DockerMode>,
    pub log_format: Option<LogFormat>,
    pub cgroup: Option<CgroupMode>,
    pub etcd_endpoints: Option<Vec<String>>,
    pub lease_ttl: Option<FileDuration>,
    /// Where runs clone recipes from, `{recipe}` filled in (the host's forge).
    pub recipe_url_template: Option<String>,
    /// The image of the job that cleans a stack's leftovers on every node of a swarm.
    pub node_sweep_image: Option<String>,
    /// Where each node's own engine socket is, on that node.
    pub node_docker_socket: Option<PathBuf>,
    /// The user the CI runner runs as, when it is not root: ccci-run running as root (the
    /// janitor's timer, an operator) takes that user's files as its own, and hands it what it
    /// creates in the lock dir.
    pub runner_user: Option<String>,
    /// The engine, as `DOCKER_HOST` names it (`unix:///PATH`, `tcp://HOST[:PORT]`), when the
    /// environment does not: a Drone step never sees the runner's `DOCKER_HOST`.
    pub docker_host: Option<String>,
    /// TLS to a `tcp://` engine, verifying its certificate (as `DOCKER_TLS_VERIFY=1`).
    pub docker_tls_verify: Option<bool>,
    /// Where `ca.pem`, `cert.pem` and `key.pem` are (as `DOCKER_CERT_PATH`).
    pub docker_cert_path: Option<PathBuf>,
    pub deadline: Option<FileDuration>,
    pub kill_grace: Option<FileDuration>,
    pub teardown_timeout: Option<FileDuration>,
    pub lock_wait: Option<FileDuration>,
    pub long_held: Option<FileDuration>,
    pub keep_runs: Option<FileDuration>,
    pub reap_budget: Option<FileDuration>,
    pub promote_after: Option<FileDuration>,
    pub converge_timeout: Option<FileDuration>,
    pub converge_stable: Option<FileDuration>,
}

impl FileConfig {
    /// The file's value of a run setting, if it has one.
    pub(super) fn timing(&self, timing: Timing) -> Option<&FileDuration> {
        match timing {
            Timing::Deadline => self.deadline.as_ref(),
            Timing::KillGrace => self.kill_grace.as_ref(),
            Timing::TeardownTimeout => self.teardown_timeout.as_ref(),
            Timing::LockWait => self.lock_wait.as_ref(),
            Timing::LongHeld => self.long_held.as_ref(),
            Timing::KeepRuns => self.keep_runs.as_ref(),
            Timing::ReapBudget => self.reap_budget.as_ref(),
            Timing::PromoteAfter => self.promote_after.as_ref(),
            Timing::ConvergeTimeout => self.converge_timeout.as_ref(),
            Timing::ConvergeStable => self.converge_stable.as_ref(),
        }
    }
}

/// A duration in the configuration file: a string in the one duration syntax (`"90s"`,
/// `"1h30m"`, `"14d"`), or a bare TOML number of seconds.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub(crate) enum FileDuration {
    Seconds(f64),
    Text(String),
}

impl FileDuration {
    /// Parse as `spec` says; the error names the key and the file.
    pub(super) fn parse(
        &self,
        key: &'static str,
        spec: &Spec,
        path: &Path,
    ) -> Result<Duration, NameError> {
        let text = match self {
            Self::Seconds(secs) => secs.to_string(),
            Self::Text(text) => text.clone(),
        };
        crate::duration::parse(&text, spec).map_err(|rule| NameError {
            what: key,
            value: text,
            rule: format!("{rule} (in {})", path.display()),
        })
    }
}

/// Read the configuration file: the one named (it must exist), else the default one if it
/// exists, else none; either only if it passes [`crate::config_file::read`]'s checks.
pub(super) fn load(config: Option<&Path>) -> Result<(FileConfig, Option<PathBuf>), NameError> {
    let (path, required) = match config {
        Some(path) => (path.to_owned(), true),
        None => (PathBuf::from(DEFAULT_FILE), false),
    };
    let Some(text) = crate::config_file::read(&path, required)? else {
        return Ok((FileConfig::default(), None));
    };
    parse(&text, &path).map(|config| (config, Some(path)))
}

/// Parse a configuration file's text; errors name the file and, from the TOML parser, the line
/// and column with the line itself and a caret under the fault (several lines, kept as the
/// parser drew them), and for a mistyped key or value the nearest one that is known.
pub(crate) fn parse(text: &str, path: &Path) -> Result<FileConfig, NameError> {
    toml::from_str(text).map_err(|e| {
        // The snippet quotes the file: a control character in it must not reach a terminal.
        let mut rule: String = e
            .to_string()
            .trim_end()
            .chars()
            .map(|c| match c {
                '\n' | '\t' => c.to_string(),
                c if c.is_control() => c.escape_default().to_string(),
                c => c.to_string(),
            })
            .collect();
        if let Some(near) = nearest_known(e.message()) {
            rule.push_str(&format!("\ndid you mean `{near}`?"));
        }
        NameError {
            what: "configuration file",
            value: path.display().to_string(),
            rule,
        }
    })
}

/// For serde's "unknown field `x`, expected one of `a`, `b`" (or "unknown variant ..."), the
/// expected name nearest to `x`, if one is near enough to be what was meant. The names come
/// from the message, so they are always the ones the file really accepts.
pub(super) fn nearest_known(message: &str) -> Option<String> {
    let rest = message
        .strip_prefix("unknown field `")
        .or_else(|| message.strip_prefix("unknown variant `"))?;
    let (given, expected) = rest.split_once('`')?;
    let (_, expected) = expected.split_once("expected")?;
    expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|known| (strsim::jaro(given, known), known))
        // The threshold clap uses for its own suggestions.
        .filter(|(score, _)| *score > 0.7)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, known)| known.to_owned())
}
