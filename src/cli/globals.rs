//! The options every command takes, before or after its name, and how the two places combine.
//!
//! Floor: entry (docs/architecture.md): imports every floor below.

use std::path::PathBuf;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgMatches, Args};

use crate::cli::parse::{choice, lease_ttl};
use crate::config::{CgroupMode, DockerMode, Given, Inputs, LogFormat, Origin};

/// Settings every command that uses them takes, before or after its name.
#[derive(Debug, Args)]
#[command(next_help_heading = "Global options")]
pub(crate) struct GlobalArgs {
    /// Configuration file (TOML: lock_dir, abra_home, runs_dir, state_dir, domain_suffix,
    /// docker, log_format, cgroup, etcd_endpoints, lease_ttl, recipe_url_template, and the run
    /// settings deadline,
    /// kill_grace, teardown_timeout, lock_wait, long_held, keep_runs, reap_budget,
    /// promote_after, converge_timeout, converge_stable) [default: /etc/ccci-run/config.toml when it exists].
    /// Precedence: flag > environment > file > built-in default.
    #[arg(long, value_name = "FILE", env = "CCCI_CONFIG")]
    pub config: Option<PathBuf>,
    /// Directory of the app-domain lock files and named-lock files [default: /run/lock].
    #[arg(long, value_name = "DIR", env = "CCCI_APP_LOCK_DIR")]
    pub lock_dir: Option<PathBuf>,
    /// The canonical abra directory (servers/, catalogue/, recipes/) [default: $HOME/.abra].
    #[arg(long, value_name = "DIR", env = "CCCI_ABRA_HOME")]
    pub abra_home: Option<PathBuf>,
    /// Directory of the per-run directories and run records [default: /var/lib/cc-ci-runs].
    #[arg(long, value_name = "DIR", env = "CCCI_RUNS_DIR")]
    pub runs_dir: Option<PathBuf>,
    /// Directory of the run-scoped state files [default: RUNS_DIR/.state].
    #[arg(long, value_name = "DIR", env = "CCCI_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Run-app domains end in `.SUFFIX` [default: ci.commoninternet.net].
    #[arg(long, value_name = "SUFFIX", env = "CCCI_DOMAIN_SUFFIX")]
    pub domain_suffix: Option<String>,
    /// Whether to touch Docker [default: auto]. The engine is DOCKER_HOST's: unix:///PATH, or
    /// tcp://HOST[:PORT] (TLS when DOCKER_TLS_VERIFY is set, with ca.pem, cert.pem and key.pem
    /// from DOCKER_CERT_PATH or ~/.docker); unset or empty, unix:///var/run/docker.sock; any
    /// other value is refused (exit 2), never replaced by the default socket.
    #[arg(long, value_name = "MODE", env = "CCCI_DOCKER", value_parser = choice::<DockerMode>())]
    pub docker: Option<DockerMode>,
    /// The engine, in DOCKER_HOST's forms, over DOCKER_HOST and the file's docker_host (which
    /// a Drone step needs: it never sees the runner's DOCKER_HOST); a run's command gets it as
    /// its DOCKER_HOST [default: DOCKER_HOST, else the file's docker_host, else
    /// unix:///var/run/docker.sock].
    #[arg(long, value_name = "URL")]
    pub docker_host: Option<String>,
    /// Whether runs and `lock` commands get a cgroup of their own (cgroup v2, where writable)
    /// [default: auto].
    #[arg(long, value_name = "MODE", env = "CCCI_CGROUP", value_parser = choice::<CgroupMode>())]
    pub cgroup: Option<CgroupMode>,
    /// etcd endpoints, comma-separated (http://HOST:PORT): the app-domain and named locks become
    /// keys bound to leases, shared by every host on the same etcd [default: none: this host's
    /// flock].
    #[arg(
        long,
        value_name = "URL,...",
        env = "CCCI_ETCD_ENDPOINTS",
        value_delimiter = ','
    )]
    pub etcd_endpoints: Option<Vec<String>>,
    /// How long an etcd lease outlives its holder's last keepalive (whole seconds, 2s-1h): how
    /// soon a dead holder's lock frees, and how long etcd may be unreachable before a holder
    /// stops its command; at least the kill grace + 4s, so the command is gone before the lease
    /// can expire and a leader election passes unnoticed [default: 15s].
    #[arg(long, value_name = "DURATION", allow_hyphen_values = true, env = "CCCI_LEASE_TTL", value_parser = lease_ttl)]
    pub lease_ttl: Option<Duration>,
    /// Diagnostics format: text, or json (then all of stderr is JSON, one object a line, status
    /// lines and errors included, also a refused command line: this flag wherever it stands,
    /// else CCCI_LOG_FORMAT, else the file's log_format) [default: text].
    #[arg(long, value_name = "F", env = "CCCI_LOG_FORMAT", value_parser = choice::<LogFormat>())]
    pub log_format: Option<LogFormat>,
    /// More diagnostics (-v info, -vv debug, -vvv trace); RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Fewer diagnostics (errors only).
    #[arg(short, long, action = clap::ArgAction::Count, conflicts_with = "verbose")]
    pub quiet: u8,
}
/// The global options as given before the command's name (`top`) and after it (`sub`): after
/// wins, as a later flag does, and a flag wins over the environment wherever it was given.
pub(crate) struct Globals<'a> {
    pub top: (&'a GlobalArgs, &'a ArgMatches),
    pub sub: Option<(&'a GlobalArgs, &'a ArgMatches)>,
}

impl Globals<'_> {
    /// What the command line and the environment say, with which of the two said it.
    pub(crate) fn inputs(&self) -> Inputs {
        Inputs {
            config: self
                .pick(|g| &g.config, "config", "CCCI_CONFIG")
                .map(|(v, _)| v),
            lock_dir: self.pick(|g| &g.lock_dir, "lock_dir", "CCCI_APP_LOCK_DIR"),
            abra_home: self.pick(|g| &g.abra_home, "abra_home", "CCCI_ABRA_HOME"),
            runs_dir: self.pick(|g| &g.runs_dir, "runs_dir", "CCCI_RUNS_DIR"),
            state_dir: self.pick(|g| &g.state_dir, "state_dir", "CCCI_STATE_DIR"),
            domain_suffix: self.pick(|g| &g.domain_suffix, "domain_suffix", "CCCI_DOMAIN_SUFFIX"),
            docker: self.pick(|g| &g.docker, "docker", "CCCI_DOCKER"),
            docker_host: self.pick(|g| &g.docker_host, "docker_host", "DOCKER_HOST"),
            log_format: self.pick(|g| &g.log_format, "log_format", "CCCI_LOG_FORMAT"),
            cgroup: self.pick(|g| &g.cgroup, "cgroup", "CCCI_CGROUP"),
            etcd_endpoints: self.pick(
                |g| &g.etcd_endpoints,
                "etcd_endpoints",
                "CCCI_ETCD_ENDPOINTS",
            ),
            lease_ttl: self.pick(|g| &g.lease_ttl, "lease_ttl", "CCCI_LEASE_TTL"),
            timings: Vec::new(),
        }
    }

    /// `-q` and `-v` counts, wherever they were given.
    pub(crate) fn verbosity(&self) -> (u8, u8) {
        let (q, v) = self.sub.map_or((0, 0), |(g, _)| (g.quiet, g.verbose));
        (
            self.top.0.quiet.saturating_add(q),
            self.top.0.verbose.saturating_add(v),
        )
    }

    fn pick<T: Clone>(
        &self,
        field: impl Fn(&GlobalArgs) -> &Option<T>,
        id: &str,
        env: &str,
    ) -> Given<T> {
        let given = |(args, matches): (&GlobalArgs, &ArgMatches)| {
            let origin = match matches.value_source(id) {
                Some(ValueSource::CommandLine) => Origin::Flag,
                Some(ValueSource::EnvVariable) => Origin::Environment(env.to_owned()),
                _ => return None,
            };
            field(args).clone().map(|v| (v, origin))
        };
        let is_flag = |g: &Given<T>| matches!(g, Some((_, Origin::Flag)));
        let sub = self.sub.and_then(given);
        let top = given(self.top);
        if is_flag(&sub) || !is_flag(&top) && sub.is_some() {
            sub
        } else {
            top
        }
    }
}
