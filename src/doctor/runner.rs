//! The runner's checks: its systemd unit (read by [`super::unit`]) as runs need it, and the
//! programs a step finds on its `PATH`.

use super::*;

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

/// The programs a Drone step runs, on the `PATH` it sees: the runner unit's (its
/// `Environment=PATH=`, else systemd's default), or ours where no unit could be read.
pub(super) fn step_path(source: &UnitSource) -> Vec<Check> {
    let (path, from): (OsString, String) = match source {
        UnitSource::Settings { settings, from } => match &settings.path {
            Some(path) => (path.into(), format!("the PATH of {from}")),
            None => (
                unit::DEFAULT_PATH.into(),
                format!("systemd's default PATH ({from} sets none)"),
            ),
        },
        _ => (
            std::env::var_os("PATH").unwrap_or_default(),
            "this shell's PATH (no runner unit could be read)".to_owned(),
        ),
    };
    STEP_PROGRAMS
        .iter()
        .map(|program| {
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
                    "install {program} into a directory of that PATH, or add its directory with \
                     Environment=PATH=... in the runner's unit"
                )),
            }
        })
        .collect()
}
