//! The value parsers the subcommands' arguments share: one duration syntax with each setting's
//! bounds, exit codes, process ids and the choices of the ground's value types.
//!
//! Floor: entry (docs/architecture.md): imports every floor below.

use std::time::Duration;

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};

use crate::config::{Choice, Timing};
use crate::names::NameError;

/// The value parsers of the run settings: one duration syntax, each with its own bounds.
pub(super) fn deadline(value: &str) -> Result<Duration, String> {
    Timing::Deadline.parse_flag(value)
}

pub(super) fn kill_grace(value: &str) -> Result<Duration, String> {
    Timing::KillGrace.parse_flag(value)
}

pub(super) fn teardown_timeout(value: &str) -> Result<Duration, String> {
    Timing::TeardownTimeout.parse_flag(value)
}

pub(super) fn lock_wait(value: &str) -> Result<Duration, String> {
    Timing::LockWait.parse_flag(value)
}

pub(super) fn long_held(value: &str) -> Result<Duration, String> {
    Timing::LongHeld.parse_flag(value)
}

pub(super) fn keep_runs(value: &str) -> Result<Duration, String> {
    Timing::KeepRuns.parse_flag(value)
}

pub(super) fn reap_budget(value: &str) -> Result<Duration, String> {
    Timing::ReapBudget.parse_flag(value)
}

pub(super) fn promote_after(value: &str) -> Result<Duration, String> {
    Timing::PromoteAfter.parse_flag(value)
}

pub(super) fn converge_timeout(value: &str) -> Result<Duration, String> {
    Timing::ConvergeTimeout.parse_flag(value)
}

pub(super) fn converge_stable(value: &str) -> Result<Duration, String> {
    Timing::ConvergeStable.parse_flag(value)
}

/// Any duration from nothing to a year.
pub(super) fn any_duration(value: &str) -> Result<Duration, String> {
    crate::duration::parse(value, &crate::duration::Spec::at_least(Duration::ZERO))
}

pub(super) fn lease_ttl(value: &str) -> Result<Duration, String> {
    crate::duration::parse(value, &crate::config::LEASE_TTL_SPEC)
}

/// The exit code of a lock not acquired: any that ccci-run gives no other meaning, so a script
/// can tell "not acquired" from what else the command or ccci-run ended with.
pub(super) fn conflict_exit_code(value: &str) -> Result<u8, String> {
    let allowed = "choose 1, 3-75 or 77-124";
    let code: u32 = value
        .trim()
        .parse()
        .map_err(|_| format!("{value:?} is not an exit code (a number, {allowed})"))?;
    let meaning = match code {
        0 => "0 would say the command ran and succeeded",
        2 => "2 means invalid input",
        76 => "76 means a held lock was lost",
        125 => "125 means ccci-run itself failed",
        126 | 127 => "126 and 127 mean the command could not be executed or found",
        128..=255 => "128-255 mean a signal (128+N) or the hard deadline (142)",
        256.. => "exit codes go up to 255",
        _ => return Ok(code as u8),
    };
    Err(format!("{meaning}: {allowed}"))
}

/// A process id: a positive number. (Whether 1 makes sense depends on who our parent is: the
/// guards decide.)
pub(super) fn parse_pid(value: &str) -> Result<i32, String> {
    let pid: i32 = value.trim().parse().map_err(|_| {
        format!("{value:?} is not a process id (a positive number; several: PID,PID)")
    })?;
    if pid <= 0 {
        return Err(format!(
            "{value:?} is not a process id (a positive number; several: PID,PID)"
        ));
    }
    Ok(pid)
}

/// A value parser for a [`Choice`]: its names as the possible values, its help as theirs.
pub(super) fn choice<T: Choice + Clone>() -> impl TypedValueParser<Value = T> {
    let values = T::CHOICES.iter().map(|(_, name, help)| {
        let value = PossibleValue::new(*name);
        if help.is_empty() {
            value
        } else {
            value.help(*help)
        }
    });
    PossibleValuesParser::new(values).try_map(|name| T::from_name(&name).ok_or("unknown value"))
}

/// The `--tie-to` pids, each once: a pid named twice is a mistake in whoever built the list.
pub(super) fn unique_pids(pids: &[i32]) -> Result<Vec<i32>, NameError> {
    for (at, pid) in pids.iter().enumerate() {
        if pids[..at].contains(pid) {
            return Err(NameError {
                what: "--tie-to / CCCI_TIE_TO",
                value: pids
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
                rule: format!("names pid {pid} twice: list each ancestor once (PID,PID)"),
            });
        }
    }
    Ok(pids.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_duration_flag_speaks_one_syntax() {
        assert_eq!(kill_grace("0.25").unwrap(), Duration::from_millis(250));
        assert_eq!(deadline("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(deadline("1.5").unwrap(), Duration::from_millis(1500));
        assert_eq!(lease_ttl("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(long_held("2h").unwrap(), Duration::from_secs(7200));
        assert_eq!(keep_runs("14d").unwrap(), Duration::from_secs(14 * 86_400));
        assert!(keep_runs("14").unwrap_err().contains("14d"));
        assert!(deadline("0").unwrap_err().contains("too short"));
        assert!(teardown_timeout("0.5").unwrap_err().contains("at least 1s"));
        assert!(
            deadline("9223372036854775807")
                .unwrap_err()
                .contains("too long")
        );
        for bad in ["-1", "soon", "NaN", "inf", "", "5x"] {
            assert!(kill_grace(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn conflict_exit_codes_avoid_the_ones_already_taken() {
        for ok in [1, 3, 9, 75, 77, 124] {
            assert_eq!(conflict_exit_code(&ok.to_string()), Ok(ok as u8));
        }
        for bad in [
            "0", "2", "76", "125", "126", "127", "128", "143", "255", "256", "-1", "x",
        ] {
            let err = conflict_exit_code(bad).unwrap_err();
            assert!(err.contains("choose 1, 3-75 or 77-124"), "{bad}: {err}");
        }
    }

    #[test]
    fn pids_are_positive_and_listed_once() {
        assert_eq!(parse_pid("42"), Ok(42));
        assert_eq!(parse_pid("1"), Ok(1));
        for bad in ["0", "-5", "x", "", "99999999999", "$"] {
            assert!(parse_pid(bad).unwrap_err().contains("PID,PID"), "{bad}");
        }
        assert_eq!(unique_pids(&[7, 9]).unwrap(), vec![7, 9]);
        let err = unique_pids(&[7, 9, 7]).unwrap_err().to_string();
        assert!(err.contains("twice") && err.contains("7,9,7"), "{err}");
    }
}
