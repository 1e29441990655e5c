//! Durations (and the one way an instant is written, [`timestamp`]): one syntax for every flag,
//! environment variable and configuration key that takes one. A bare number is seconds,
//! fractions allowed (`90`, `1.5`); otherwise numbers with units, one or several
//! (`90s`, `500ms`, `5m`, `1h30m`, `1.5h`, `14d`, `2w`), read by humantime. Only [`UNITS`] are units:
//! humantime also reads `1hour`, `90min`, `1M` (a month of 30.44 days, a trap for "one minute")
//! and `1y`, which are refused before it sees them. Each setting has its own bounds ([`Spec`]);
//! a value outside them is refused, never clamped.
//!
//! Invariant: a duration that comes out of [`parse`] is inside its spec's bounds, so no later
//! arithmetic on instants can overflow, and every refusal names the accepted forms.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

use std::time::Duration;

/// An instant as every record and holder line writes it: RFC 3339, UTC, with milliseconds.
pub(crate) fn timestamp(at: std::time::SystemTime) -> String {
    humantime::format_rfc3339_millis(at).to_string()
}

/// The forms every error names.
pub(crate) const FORMS: &str = "seconds (90, 1.5) or a number with units (90s, 5m, 1h30m, 14d)";

/// The units a duration may be written in, and nothing else: milliseconds, seconds, minutes,
/// hours, days and weeks.
pub(crate) const UNITS: &[&str] = &["ms", "s", "m", "h", "d", "w"];

/// The units as every refusal of one lists them.
const UNITS_NAMED: &str = "the units are ms, s, m, h, d and w (milliseconds to weeks)";

/// One year: the longest any duration may be.
pub(crate) const YEAR: Duration = Duration::from_secs(365 * 86_400);

/// What a setting accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Spec {
    pub min: Duration,
    pub max: Duration,
    /// Whether a bare number (seconds) is accepted; `false` where a bare number once meant
    /// something else (days), so an old value is refused instead of silently read as seconds.
    pub bare: bool,
    /// Whether the value must be whole seconds (an etcd lease counts seconds).
    pub whole_seconds: bool,
}

impl Spec {
    /// From `min` to a year, bare seconds accepted, fractions too.
    pub(crate) const fn at_least(min: Duration) -> Self {
        Self {
            min,
            max: YEAR,
            bare: true,
            whole_seconds: false,
        }
    }
}

/// Parse `text` as a duration of `spec`. The message says what is wrong and which forms are
/// accepted; the caller adds which option, variable or key it came from.
pub(crate) fn parse(text: &str, spec: &Spec) -> Result<Duration, String> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(format!("an empty value is not a duration: write {FORMS}"));
    }
    if trimmed.starts_with('-') {
        return Err(format!(
            "{trimmed:?} is not a duration: a duration is never negative; write {FORMS}"
        ));
    }
    let value = if trimmed.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        if !spec.bare {
            return Err(format!(
                "{trimmed:?} has no unit: write it with one (for example {trimmed}d for days, \
                 {trimmed}h for hours)"
            ));
        }
        bare_seconds(trimmed, spec)?
    } else {
        check_units(trimmed)?;
        match humantime::parse_duration(trimmed) {
            Ok(value) => value,
            Err(humantime::DurationError::NumberOverflow) => return Err(too_long(trimmed, spec)),
            Err(_) => return Err(format!("{trimmed:?} is not a duration: write {FORMS}")),
        }
    };
    check(trimmed, value, spec)
}

/// Refuse every unit but [`UNITS`], before humantime reads the rest: a number is digits, a unit
/// the letters after it. What is neither is left to humantime, which refuses it.
fn check_units(text: &str) -> Result<(), String> {
    let words = text
        .split(|c: char| !c.is_alphabetic())
        .filter(|word| !word.is_empty());
    for unit in words {
        if UNITS.contains(&unit) {
            continue;
        }
        let hint = match unit {
            "M" | "mo" | "mon" | "month" | "months" => {
                "months are not a unit (1M would be read as 30d 10h 33m 36s): write 1m for \
                 a minute, or days (30d)"
                    .to_owned()
            }
            "y" | "yr" | "year" | "years" => "years are not a unit: write days (365d)".to_owned(),
            _ => format!("{unit:?} is not a unit"),
        };
        return Err(format!(
            "{text:?} is not a duration: {hint}; write {FORMS}: {UNITS_NAMED}"
        ));
    }
    Ok(())
}

/// A plain number of seconds; fractions allowed, with digits on both sides of the point (`1.5`,
/// never `.5` or `1.`), as the NixOS module reads it.
fn bare_seconds(text: &str, spec: &Spec) -> Result<Duration, String> {
    let well_formed = match text.split_once('.') {
        None => !text.is_empty(),
        Some((whole, part)) => {
            !whole.is_empty() && !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit())
        }
    };
    if !well_formed {
        return Err(format!("{text:?} is not a duration: write {FORMS}"));
    }
    let secs: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a duration: write {FORMS}"))?;
    if secs > spec.max.as_secs_f64() {
        return Err(too_long(text, spec));
    }
    Duration::try_from_secs_f64(secs)
        .map_err(|_| format!("{text:?} is not a duration: write {FORMS}"))
}

fn check(text: &str, value: Duration, spec: &Spec) -> Result<Duration, String> {
    if value > spec.max {
        return Err(too_long(text, spec));
    }
    if value < spec.min {
        return Err(format!(
            "{text:?} is too short: at least {}",
            show(spec.min)
        ));
    }
    if !value.subsec_nanos().is_multiple_of(1_000_000) {
        return Err(format!(
            "{text:?} is finer than a millisecond, the smallest step a duration counts"
        ));
    }
    if spec.whole_seconds && value.subsec_nanos() != 0 {
        return Err(format!("{text:?} is not a whole number of seconds"));
    }
    Ok(value)
}

fn too_long(text: &str, spec: &Spec) -> String {
    format!("{text:?} is too long: at most {}", show(spec.max))
}

/// A duration as it is shown back (`ccci-run config`, errors): days, hours, minutes, seconds
/// and milliseconds (`365d`, `1h30m`, `1s500ms`), the units [`parse`] reads again; nothing finer
/// is shown, as nothing finer is read. (humantime's own form counts months and years of 30.44
/// and 365.25 days: `365d` would not read as such.)
pub(crate) fn show(value: Duration) -> String {
    if value.is_zero() {
        return "0s".to_owned();
    }
    let secs = value.as_secs();
    let parts = [
        (secs / 86_400, "d"),
        (secs % 86_400 / 3600, "h"),
        (secs % 3600 / 60, "m"),
        (secs % 60, "s"),
        (u64::from(value.subsec_millis()), "ms"),
    ];
    parts
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, unit)| format!("{n}{unit}"))
        .collect()
}

/// An age as every table writes it: its two largest units, no space (`42s`, `5m3s`, `2h5m`,
/// `3d4h`); `-` when unknown.
pub(crate) fn age(secs: Option<u64>) -> String {
    let Some(secs) = secs else {
        return "-".to_owned();
    };
    let (d, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m{s}s"),
        (0, _, _) => format!("{h}h{m}m"),
        _ => format!("{d}d{h}h"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ANY: Spec = Spec::at_least(Duration::ZERO);

    #[rstest::rstest]
    #[case("90", 90_000)]
    #[case("1.5", 1_500)]
    #[case(" 0.25 ", 250)]
    #[case("0", 0)]
    #[case("90s", 90_000)]
    #[case("500ms", 500)]
    #[case("5m", 300_000)]
    #[case("1h30m", 5_400_000)]
    #[case("1h 30m", 5_400_000)]
    #[case("14d", 14 * 86_400_000)]
    #[case("2w", 14 * 86_400_000)]
    #[case("1.5h", 5_400_000)]
    #[case("1w 2d 3h 4m 5s 6ms", 788_645_006)]
    #[case("365d", 365 * 86_400_000)]
    fn accepted_forms(#[case] text: &str, #[case] millis: u64) {
        assert_eq!(parse(text, &ANY), Ok(Duration::from_millis(millis)));
    }

    #[rstest::rstest]
    #[case("", "empty")]
    #[case("   ", "empty")]
    #[case("5x", "not a duration")]
    #[case("-1", "never negative")]
    #[case("-5s", "never negative")]
    #[case("soon", "not a duration")]
    #[case("NaN", "not a duration")]
    #[case("inf", "not a duration")]
    #[case("1.2.3", "not a duration")]
    #[case("1e3", "not a duration")]
    #[case("366d", "too long")]
    #[case("9223372036854775807", "too long")]
    #[case("99999999999999999999999d", "too long")]
    #[case("18446744073709551616s", "too long")]
    #[case("1.0000001", "finer than a millisecond")]
    #[case("1ns", "not a unit")]
    #[case("1us", "not a unit")]
    #[case("1hour", "not a unit")]
    #[case("90min", "not a unit")]
    #[case("3days", "not a unit")]
    #[case("1sec", "not a unit")]
    #[case("5H", "not a unit")]
    #[case("1M", "months are not a unit")]
    #[case("2months", "months are not a unit")]
    #[case("1y", "years are not a unit")]
    fn refused_forms_name_the_accepted_ones(#[case] text: &str, #[case] why: &str) {
        let err = parse(text, &ANY).unwrap_err();
        assert!(err.contains(why), "{text:?}: {err}");
        if why == "not a duration" || why == "empty" || why.contains("unit") {
            assert!(err.contains(FORMS), "{err}");
        }
        if why.contains("unit") {
            assert!(err.contains(UNITS_NAMED), "{err}");
        }
    }

    #[test]
    fn bounds_units_and_whole_seconds() {
        let budget = Spec::at_least(Duration::from_secs(1));
        assert!(parse("0.5", &budget).unwrap_err().contains("at least 1s"));
        assert_eq!(parse("1", &budget), Ok(Duration::from_secs(1)));
        let days = Spec {
            bare: false,
            max: Duration::from_secs(36_500 * 86_400),
            ..ANY
        };
        assert!(parse("14", &days).unwrap_err().contains("14d"));
        assert_eq!(parse("14d", &days), Ok(Duration::from_secs(14 * 86_400)));
        let ttl = Spec {
            min: Duration::from_secs(2),
            max: Duration::from_secs(3600),
            bare: true,
            whole_seconds: true,
        };
        assert!(parse("2.5", &ttl).unwrap_err().contains("whole number"));
        assert_eq!(parse("10s", &ttl), Ok(Duration::from_secs(10)));
        assert!(parse("1h1s", &ttl).unwrap_err().contains("at most 1h"));
        assert!(parse("366d", &ANY).unwrap_err().contains("at most 365d"));
    }

    /// `1M` is a month to humantime, not a minute: the refusal says which to write instead.
    #[test]
    fn a_month_is_refused_naming_the_minute_and_days() {
        let err = parse("1M", &ANY).unwrap_err();
        assert!(err.contains("write 1m for a minute"), "{err}");
        assert!(err.contains("30d"), "{err}");
    }

    #[test]
    fn shown_values_read_back() {
        for value in [
            Duration::ZERO,
            Duration::from_millis(1500),
            Duration::from_secs(5400),
            Duration::from_secs(14 * 86_400),
            Duration::from_millis(1_000_007),
            YEAR,
        ] {
            assert_eq!(parse(&show(value), &ANY), Ok(value), "{}", show(value));
        }
    }

    #[test]
    fn an_age_is_its_two_largest_units_without_a_space() {
        assert_eq!(super::age(None), "-");
        assert_eq!(super::age(Some(42)), "42s");
        assert_eq!(super::age(Some(61)), "1m1s");
        assert_eq!(super::age(Some(74)), "1m14s");
        assert_eq!(super::age(Some(3 * 3600 + 59)), "3h0m");
        assert_eq!(super::age(Some(3 * 86_400 + 4 * 3600)), "3d4h");
    }
}
