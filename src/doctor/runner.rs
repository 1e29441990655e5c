//! The runner's checks: its systemd unit (read by [`super::unit`]) as runs need it, and the
//! programs a step finds on its `PATH`.

use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

use crate::config::{Global, Timing};
use crate::doctor::check::{Check, DEFAULT_UNIT, State, check};
use crate::doctor::options::Options;
use crate::doctor::unit;

/// The programs a step runs, which must be on the `PATH` it sees.
pub(super) const STEP_PROGRAMS: [&str; 4] = ["ccci-run", "abra", "git", "setsid"];

/// Where the runner unit's settings come from.
pub(super) enum UnitSource {
    Settings {
        settings: unit::UnitSettings,
        from: String,
    },
    /// The unit could not be read: every unit check fails with this.
    Broken(String),
    /// Nothing to read here: every unit check is skipped with this.
    Absent(String),
}

pub(super) fn runner_unit(opts: &Options) -> UnitSource {
    if let Some(path) = &opts.unit_file {
        return match unit::read_file(path) {
            Ok((settings, read)) => UnitSource::Settings {
                settings,
                from: read.join(" + "),
            },
            Err(err) => UnitSource::Broken(format!("{err} (--unit-file)")),
        };
    }
    let name = opts.unit.clone().unwrap_or_else(|| DEFAULT_UNIT.to_owned());
    if !unit::systemd_running() {
        return UnitSource::Absent(format!(
            "systemd is not running here (no /run/systemd/system), so unit {name} cannot be asked"
        ));
    }
    match unit::show(&name) {
        Ok(settings) => UnitSource::Settings {
            settings,
            from: format!("systemd's {name}"),
        },
        Err(err) => UnitSource::Broken(err),
    }
}

pub(super) fn unit_checks(source: &UnitSource, global: &Global) -> Vec<Check> {
    let names = [
        "unit Delegate",
        "unit KillMode",
        "unit TimeoutStopSec",
        "unit User",
    ];
    let (settings, from) = match source {
        UnitSource::Settings { settings, from } => (settings, from),
        UnitSource::Broken(why) => {
            return names
                .iter()
                .map(|n| {
                    check(*n, State::Fail, why.clone())
                        .fix("name the runner's unit with --unit, or its file with --unit-file")
                })
                .collect();
        }
        UnitSource::Absent(why) => {
            return names
                .iter()
                .map(|n| {
                    check(*n, State::Skip, why.clone())
                        .fix("check the runner's unit file with --unit-file FILE")
                })
                .collect();
        }
    };
    let mut checks = Vec::new();
    checks.push(if settings.delegates() {
        check(names[0], State::Ok, format!("Delegate=yes in {from}"))
    } else {
        check(
            names[0],
            State::Fail,
            format!(
                "Delegate={} in {from}: the runner's cgroup subtree is not its own, so runs \
                 cannot have cgroups",
                settings.delegate.as_deref().unwrap_or("no (the default)")
            ),
        )
        .fix("Delegate=yes in [Service] (systemd/drone-runner-exec.service.d/ccci-run.conf)")
    });
    let kill_mode = settings.kill_mode();
    checks.push(if kill_mode == "control-group" {
        check(
            names[1],
            State::Ok,
            format!("KillMode=control-group in {from}"),
        )
    } else {
        check(
            names[1],
            State::Fail,
            format!(
                "KillMode={kill_mode} in {from}: stopping the runner does not send every run \
                 its SIGTERM, so runs are SIGKILLed without a teardown"
            ),
        )
        .fix("KillMode=control-group (systemd's default): remove the KillMode line")
    });
    let needed =
        global.timings.value(Timing::KillGrace) + global.timings.value(Timing::TeardownTimeout);
    let show = |d: Duration| crate::duration::show(d);
    checks.push(match settings.timeout_stop() {
        Ok(None) => check(
            names[2],
            State::Ok,
            format!("TimeoutStopSec=infinity in {from}"),
        ),
        Ok(Some(timeout)) if timeout >= needed => check(
            names[2],
            State::Ok,
            format!(
                "TimeoutStopSec={} in {from}, at least kill_grace + teardown_timeout ({})",
                show(timeout),
                show(needed)
            ),
        ),
        Ok(Some(timeout)) => check(
            names[2],
            State::Fail,
            format!(
                "TimeoutStopSec={} in {from} is shorter than kill_grace + teardown_timeout ({}): \
                 systemd SIGKILLs a run mid-teardown when the runner stops",
                show(timeout),
                show(needed)
            ),
        )
        .fix(format!(
            "TimeoutStopSec={} or more in [Service]",
            (needed + Duration::from_secs(59)).as_secs() / 60 * 60
        )),
        Err(err) => check(names[2], State::Fail, format!("{err} in {from}"))
            .fix("write TimeoutStopSec as systemd does: 6min, 400, infinity"),
    });
    checks.push(runner_user(names[3], settings.user.as_deref(), from));
    checks
}

/// The runner's user as the unit has it, against `runner_user`: a runner that is not root
/// makes the lock files, run directories and state files that a root janitor must accept as
/// its own, and only `runner_user` tells it to (never guessed).
fn runner_user(name: &'static str, user: Option<&str>, from: &str) -> Check {
    let configured = crate::trust::configured_runner();
    let Some(user) = user.filter(|u| !matches!(*u, "root" | "0")) else {
        return match configured {
            None => check(name, State::Ok, format!("the runner runs as root ({from})")),
            Some((uid, _)) => check(
                name,
                State::Warn,
                format!(
                    "the runner runs as root ({from}), but runner_user names uid {uid}: files of \
                     that user are trusted as the runner's"
                ),
            )
            .fix("remove runner_user from the configuration file"),
        };
    };
    let found = match user.parse::<u32>() {
        Ok(uid) => nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)),
        Err(_) => nix::unistd::User::from_name(user),
    };
    let uid = match found {
        Ok(Some(u)) => u.uid.as_raw(),
        Ok(None) => {
            return check(
                name,
                State::Fail,
                format!("User={user} in {from}: no such user on this host"),
            )
            .fix("create the runner's user, or correct User= in the unit");
        }
        Err(err) => {
            return check(
                name,
                State::Fail,
                format!("User={user} in {from}: failed to look it up: {err}"),
            );
        }
    };
    match configured {
        Some((r, _)) if r == uid => check(
            name,
            State::Ok,
            format!("User={user} (uid {uid}) in {from}, named by runner_user"),
        ),
        Some((r, _)) => check(
            name,
            State::Fail,
            format!(
                "User={user} (uid {uid}) in {from}, but runner_user names uid {r}: a root \
                 janitor refuses the runner's lock dir and keeps its run directories"
            ),
        )
        .fix(format!(
            "runner_user = \"{user}\" in the configuration file"
        )),
        None => check(
            name,
            State::Fail,
            format!(
                "User={user} (uid {uid}) in {from}, and runner_user is not set: a root janitor \
                 refuses the runner's lock dir (\"owned by uid {uid}, neither us nor root\") and \
                 keeps every run directory"
            ),
        )
        .fix(format!(
            "runner_user = \"{user}\" in the configuration file"
        )),
    }
}

/// What the runner hands every step of its own, as its unit and files say: the runner's
/// environment is its unit's `Environment=`, overridden by its `EnvironmentFile=`s, then its
/// own configuration file for what is still unset (godotenv never overrides); of that, a step
/// gets `PATH` (and `USER`), overridden by `DRONE_RUNNER_ENVIRON` (`KEY:value,…`), then by the
/// lines of `DRONE_RUNNER_ENVFILE`, then `PATH` by `DRONE_RUNNER_PATH`
/// (drone-runner-exec's `daemon/config.go:66-68,117-137`, `engine/compiler/compiler.go:157-159`).
struct StepEnvironment {
    /// The step's `PATH`, and where it comes from.
    path: Option<(String, String)>,
    /// What `DRONE_RUNNER_ENVIRON` and `DRONE_RUNNER_ENVFILE` pass to every step: name, and
    /// which of the two.
    passed: Vec<(String, &'static str)>,
    /// Files named that could not be read.
    problems: Vec<String>,
}

fn step_environment(settings: &unit::UnitSettings, from: &str) -> StepEnvironment {
    let mut problems = Vec::new();
    let mut env: std::collections::BTreeMap<String, (String, String)> = settings
        .environment
        .iter()
        .map(|(k, v)| (k.clone(), (v.clone(), format!("Environment= of {from}"))))
        .collect();
    let read = |path: &str| crate::files::read_text(Path::new(path), &ENV_FILE_RULES);
    for (file, optional) in &settings.environment_files {
        match read(file) {
            Ok(text) => {
                for (k, v) in unit::parse_env_file(&text) {
                    env.insert(k, (v, file.clone()));
                }
            }
            Err(_) if *optional => {}
            Err(err) => problems.push(format!("EnvironmentFile={file}: {err}")),
        }
    }
    let config = runner_config_file(&settings.exec_start);
    match read(&config) {
        Ok(text) => {
            for (k, v) in unit::parse_env_file(&text) {
                env.entry(k).or_insert((v, config.clone()));
            }
        }
        // A runner configured by its unit alone has none.
        Err(err) if err.is_missing() => {}
        Err(err) => problems.push(format!("{config}: {err}")),
    }
    let mut path = env
        .get("PATH")
        .map(|(v, origin)| (v.clone(), format!("the runner's PATH ({origin})")));
    let mut passed = Vec::new();
    if let Some((environ, _)) = env.get("DRONE_RUNNER_ENVIRON") {
        for (k, v) in unit::parse_runner_environ(environ) {
            if k == "PATH" {
                path = Some((v, "DRONE_RUNNER_ENVIRON's PATH".to_owned()));
            }
            passed.push((k, "DRONE_RUNNER_ENVIRON"));
        }
    }
    if let Some((file, _)) = env.get("DRONE_RUNNER_ENVFILE") {
        match read(file) {
            Ok(text) => {
                for (k, v) in unit::parse_env_file(&text) {
                    if k == "PATH" {
                        path = Some((v, format!("the PATH of DRONE_RUNNER_ENVFILE {file}")));
                    }
                    passed.push((k, "DRONE_RUNNER_ENVFILE"));
                }
            }
            Err(err) => problems.push(format!("DRONE_RUNNER_ENVFILE {file}: {err}")),
        }
    }
    if let Some((runner_path, _)) = env.get("DRONE_RUNNER_PATH").filter(|(p, _)| !p.is_empty()) {
        path = Some((runner_path.clone(), "DRONE_RUNNER_PATH".to_owned()));
    }
    StepEnvironment {
        path,
        passed,
        problems,
    }
}

/// What the runner's environment files may be: regular files of any owner, small.
const ENV_FILE_RULES: crate::files::Rules = crate::files::Rules {
    max_len: 1 << 20,
    follow_links: true,
    owners: crate::files::Owners::Any,
};

/// The runner's own configuration file: the argument of `--config` (`service run`) or after
/// `daemon`, else the one `service install` names.
fn runner_config_file(exec_start: &[String]) -> String {
    let mut words = exec_start.iter().skip(1);
    while let Some(word) = words.next() {
        if let Some(file) = word.strip_prefix("--config=") {
            return file.to_owned();
        }
        if word == "--config" || word == "daemon" {
            if let Some(file) = words.next().filter(|w| !w.starts_with('-')) {
                return file.clone();
            }
        }
    }
    unit::RUNNER_CONFIG.to_owned()
}

/// The programs a Drone step runs, on the `PATH` it sees: the runner's (its unit's
/// `Environment=PATH=`, its environment files', systemd's default), or `DRONE_RUNNER_PATH`,
/// `DRONE_RUNNER_ENVIRON`'s or `DRONE_RUNNER_ENVFILE`'s where they set one; ours where no unit
/// could be read. And what `DRONE_RUNNER_ENVIRON` and `DRONE_RUNNER_ENVFILE` pass to every step.
pub(super) fn step_path(source: &UnitSource) -> Vec<Check> {
    let mut checks = Vec::new();
    let (path, from): (OsString, String) = match source {
        UnitSource::Settings { settings, from } => {
            let step = step_environment(settings, from);
            checks.push(passed_check(&step, from));
            match step.path {
                Some((path, origin)) => (path.into(), format!("{origin}, of {from}")),
                None => (
                    unit::DEFAULT_PATH.into(),
                    format!("systemd's default PATH ({from} sets none)"),
                ),
            }
        }
        _ => (
            crate::config::env::var_os("PATH").unwrap_or_default(),
            "this shell's PATH (no runner unit could be read)".to_owned(),
        ),
    };
    checks.extend(STEP_PROGRAMS.iter().map(|program| {
        let name = format!("step PATH {program}");
        let found = std::env::split_paths(&path).find_map(|dir| {
            use std::os::unix::fs::PermissionsExt;
            let candidate = dir.join(program);
            std::fs::metadata(&candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .then_some(candidate)
        });
        match found {
            Some(at) => check(name, State::Ok, format!("{} (on {from})", at.display())),
            None => check(
                name,
                State::Fail,
                format!("{program} is not on {from}: a step that runs it fails"),
            )
            .fix(format!(
                "install {program} into a directory of that PATH, or add its directory to \
                 DRONE_RUNNER_PATH (or Environment=PATH=...) of the runner"
            )),
        }
    }));
    checks
}

/// The `step environment` check: what the runner passes to every step beyond its own
/// variables. A `CCCI_*` among them steers every run past the configuration file.
fn passed_check(step: &StepEnvironment, from: &str) -> Check {
    let name = "step environment";
    if !step.problems.is_empty() {
        return check(
            name,
            State::Fail,
            format!(
                "the runner's environment could not be read whole: {}",
                step.problems.join("; ")
            ),
        )
        .fix("make the files the runner's unit and configuration name readable, or drop them");
    }
    let steering: Vec<String> = step
        .passed
        .iter()
        .filter(|(k, _)| k.starts_with("CCCI_") || k == "DOCKER_HOST")
        .map(|(k, via)| format!("{k} (by {via})"))
        .collect();
    if !steering.is_empty() {
        return check(
            name,
            State::Warn,
            format!(
                "{} reach every step from {from}: they override the configuration file for \
                 every run",
                steering.join(", ")
            ),
        )
        .fix("set them in the configuration file instead, and take them out of the runner's");
    }
    let names: Vec<String> = step
        .passed
        .iter()
        .map(|(k, via)| format!("{k} (by {via})"))
        .collect();
    let detail = if names.is_empty() {
        format!(
            "{from} passes no variable of its own to steps (DRONE_RUNNER_ENVIRON, DRONE_RUNNER_ENVFILE unset)"
        )
    } else {
        format!("{from} passes to every step: {}", names.join(", "))
    };
    check(name, State::Ok, detail)
}
