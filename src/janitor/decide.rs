//! The janitor's decisions: pure functions of what the probe of one app lock saw, and of what
//! the judge said of the supervisor a leftover (a cgroup, a marked process) names. No I/O.

use std::time::Duration;

use serde::Serialize;

use crate::supervise::identity::Verdict;

/// What the probe of one app lock saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Probe {
    /// We took the lock. `identity_ok`: the path still names the locked inode; `app_present`:
    /// the app was still there once we held it.
    Acquired {
        identity_ok: bool,
        app_present: bool,
    },
    /// There is no lock file (dry runs do not create one): nobody can hold it.
    NoLockFile,
    /// Someone holds it; its file was last touched `age` ago.
    Held { age: Option<Duration> },
    /// The lock file could not be opened or locked.
    Unreadable(String),
    /// The lock file is not ours: a symlink, not a regular file, or another user's.
    Foreign(String),
}

/// The janitor's verdict on one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Decision {
    Reap,
    WouldReap,
    Raced,
    Live,
    LongHeld,
    Unreadable,
    Foreign,
    /// Reaped, but the engine still listed some of it when the reap budget ran out (or a
    /// network of it is held by another stack): the lock file stays for the next sweep.
    ReapIncomplete,
}

impl Decision {
    pub(crate) const ALL: [Decision; 8] = [
        Decision::Reap,
        Decision::WouldReap,
        Decision::Raced,
        Decision::Live,
        Decision::LongHeld,
        Decision::Unreadable,
        Decision::Foreign,
        Decision::ReapIncomplete,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Reap => "reap",
            Self::WouldReap => "would-reap",
            Self::Raced => "raced",
            Self::Live => "live",
            Self::LongHeld => "long-held",
            Self::Unreadable => "unreadable",
            Self::Foreign => "foreign",
            Self::ReapIncomplete => "reap-incomplete",
        }
    }
}

/// The decision table: pure, no I/O.
pub(crate) fn decide(probe: &Probe, dry_run: bool, long_held: Duration) -> Decision {
    let reap = if dry_run {
        Decision::WouldReap
    } else {
        Decision::Reap
    };
    match probe {
        Probe::Acquired {
            identity_ok: true,
            app_present: true,
        } => reap,
        // The inode was unlinked under us, or the app vanished before we held the lock:
        // another janitor got there first.
        Probe::Acquired { .. } => Decision::Raced,
        Probe::NoLockFile => reap,
        Probe::Held { age: Some(age) } if *age > long_held => Decision::LongHeld,
        Probe::Held { .. } => Decision::Live,
        Probe::Unreadable(_) => Decision::Unreadable,
        Probe::Foreign(_) => Decision::Foreign,
    }
}

/// What a sweep does with a cgroup or a process of its own configuration, by what the judge
/// said of the supervisor it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LeftoverDecision {
    /// Its supervisor is dead: kill it (and remove the cgroup).
    Kill,
    /// The same in a dry run: report it only.
    WouldKill,
    /// Its supervisor lives: not a leftover at all.
    Spare,
    /// Nobody can tell from here: left alone, reported with the reason.
    Unresolvable(String),
}

/// The leftover table: pure, no I/O. Only a proven death kills.
pub(crate) fn leftover(verdict: &Verdict, dry_run: bool) -> LeftoverDecision {
    match verdict {
        Verdict::Dead if dry_run => LeftoverDecision::WouldKill,
        Verdict::Dead => LeftoverDecision::Kill,
        Verdict::Alive => LeftoverDecision::Spare,
        Verdict::Unresolvable(why) => LeftoverDecision::Unresolvable(why.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case::dead(Verdict::Dead, false, LeftoverDecision::Kill)]
    #[case::dead_dry(Verdict::Dead, true, LeftoverDecision::WouldKill)]
    #[case::alive(Verdict::Alive, false, LeftoverDecision::Spare)]
    #[case::alive_dry(Verdict::Alive, true, LeftoverDecision::Spare)]
    #[case::unresolvable(
        Verdict::Unresolvable("another pid namespace".into()),
        false,
        LeftoverDecision::Unresolvable("another pid namespace".into())
    )]
    #[case::unresolvable_dry(
        Verdict::Unresolvable("another boot".into()),
        true,
        LeftoverDecision::Unresolvable("another boot".into())
    )]
    fn leftover_table(
        #[case] verdict: Verdict,
        #[case] dry_run: bool,
        #[case] want: LeftoverDecision,
    ) {
        assert_eq!(leftover(&verdict, dry_run), want);
    }

    const LONG: Duration = Duration::from_secs(7200);

    fn acquired(identity_ok: bool, app_present: bool) -> Probe {
        Probe::Acquired {
            identity_ok,
            app_present,
        }
    }

    #[rstest]
    #[case::orphan(acquired(true, true), false, Decision::Reap)]
    #[case::orphan_dry(acquired(true, true), true, Decision::WouldReap)]
    #[case::stale_inode(acquired(false, true), false, Decision::Raced)]
    #[case::stale_inode_dry(acquired(false, true), true, Decision::Raced)]
    #[case::app_gone(acquired(true, false), false, Decision::Raced)]
    #[case::no_lock_file(Probe::NoLockFile, true, Decision::WouldReap)]
    #[case::no_lock_file_real(Probe::NoLockFile, false, Decision::Reap)]
    #[case::live(Probe::Held { age: Some(Duration::from_secs(60)) }, false, Decision::Live)]
    #[case::live_unknown_age(Probe::Held { age: None }, false, Decision::Live)]
    #[case::at_threshold(Probe::Held { age: Some(LONG) }, false, Decision::Live)]
    #[case::long_held(Probe::Held { age: Some(LONG + Duration::from_secs(1)) }, false, Decision::LongHeld)]
    #[case::long_held_dry(Probe::Held { age: Some(LONG * 2) }, true, Decision::LongHeld)]
    #[case::unreadable(Probe::Unreadable("EIO".into()), false, Decision::Unreadable)]
    #[case::foreign(Probe::Foreign("symlink".into()), false, Decision::Foreign)]
    fn decision_table(#[case] probe: Probe, #[case] dry_run: bool, #[case] want: Decision) {
        assert_eq!(decide(&probe, dry_run, LONG), want);
    }

    #[test]
    fn a_held_lock_is_never_reaped_whatever_its_age() {
        for secs in [0, 1, 7200, 7201, u64::MAX / 2] {
            let d = decide(
                &Probe::Held {
                    age: Some(Duration::from_secs(secs)),
                },
                false,
                LONG,
            );
            assert!(matches!(d, Decision::Live | Decision::LongHeld), "{d:?}");
        }
    }
}
