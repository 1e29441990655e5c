//! One source of configuration: every global setting comes from the command line, else the
//! environment, else the configuration file, else the built-in default — and the paths that
//! the Drone step, the janitor's timer and an operator's shell use stay the same because they
//! all read one file (`--config`, `CCCI_CONFIG`, or `/etc/ccci-run/config.toml` when it exists).
//!
//! Invariant: what comes out is absolute and validated; nothing downstream parses a setting
//! again, and `ccci-run config` shows each value with where it came from.
//!
//! This file is the room's door: it declares the files and re-exports what the other rooms use.
//! The validated configurations each command is handed (`Global`, `RunConfig`, `LockConfig`,
//! ...) are in `settings`, the engine and etcd settings in `services`, the values settings take
//! in `values`, the file's keys in `keys`, the resolution of each setting from its four
//! sources in `resolve`, what a missing configured directory means in [`dirs`], and the one
//! reader of the environment in [`env`].
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

pub(crate) mod dirs;
pub(crate) mod env;
mod keys;
mod resolve;
mod services;
mod settings;
mod values;

pub(crate) use keys::*;
pub(crate) use resolve::*;
pub(crate) use services::*;
pub(crate) use settings::*;
pub(crate) use values::*;
#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use std::time::Duration;

    #[test]
    fn a_lease_ttl_must_hold_the_kill_grace_the_margin_and_the_keepalive_headroom() {
        let etcd = |ttl: u32| EtcdSettings {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            lease_ttl: Duration::from_secs(ttl.into()),
        };
        // The defaults agree.
        let grace = TIMINGS[1].default.unwrap();
        assert_eq!(TIMINGS[1].timing, Timing::KillGrace);
        etcd(DEFAULT_LEASE_TTL).check_stop_budget(grace).unwrap();
        // Grace + 0.5 s + 3.5 s, to the second.
        etcd(7).check_stop_budget(Duration::from_secs(3)).unwrap();
        let err = etcd(7)
            .check_stop_budget(Duration::from_millis(3001))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("smallest lease TTL that works is 8 s"),
            "{err}"
        );
        assert!(err.contains("a kill grace of at most 3s"), "{err}");
        // The smallest TTL that works allows no kill grace at all.
        etcd(4).check_stop_budget(Duration::ZERO).unwrap();
        etcd(3).check_stop_budget(Duration::ZERO).unwrap_err();
        let err = etcd(4)
            .check_stop_budget(Duration::from_secs(1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("is 5 s"), "{err}");
        assert!(!err.contains("at most"), "{err}");
        assert_eq!(
            EtcdSettings::stop_budget(Duration::from_secs(2)),
            Duration::from_millis(2500)
        );
    }

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

    /// The parser's snippet stays as it drew it, on its own lines, and a near miss is named.
    #[rstest::rstest]
    #[case("run_dir = \"/r\"\n", "run_dir", Some("runs_dir"))]
    #[case("lock_dri = \"/x\"\n", "lock_dri", Some("lock_dir"))]
    #[case("docker = \"requird\"\n", "requird", Some("required"))]
    #[case("zzz = 1\n", "zzz", None)]
    fn a_toml_error_keeps_its_snippet_and_names_the_nearest_key(
        #[case] text: &str,
        #[case] given: &str,
        #[case] near: Option<&str>,
    ) {
        let err = parse(text, Path::new("/etc/ccci-run/config.toml"))
            .unwrap_err()
            .to_string();
        let lines: Vec<&str> = err.lines().collect();
        assert!(
            lines[0].starts_with(
                "invalid configuration file \"/etc/ccci-run/config.toml\": \
                 TOML parse error at line 1, column "
            ),
            "{err}"
        );
        assert_eq!(lines[1], "  |", "{err}");
        assert_eq!(lines[2], format!("1 | {}", text.trim_end()), "{err}");
        assert!(
            lines[3].starts_with("  | ") && lines[3].ends_with('^'),
            "{err}"
        );
        assert!(lines[4].contains(&format!("`{given}`")), "{err}");
        match near {
            Some(near) => assert_eq!(
                lines.last().copied(),
                Some(format!("did you mean `{near}`?").as_str()),
                "{err}"
            ),
            None => assert!(!err.contains("did you mean"), "{err}"),
        }
    }

    #[test]
    fn a_named_file_must_exist_and_etcd_settings_are_validated() {
        let dir = tempfile::tempdir().unwrap();
        let mut inputs = Inputs {
            config: Some(dir.path().join("missing.toml")),
            ..Inputs::default()
        };
        let err = load(inputs.config.as_deref()).unwrap_err();
        assert!(
            err.to_string()
                .contains("cannot be read (--config, CCCI_CONFIG)"),
            "{err}"
        );
        let file = dir.path().join("etcd.toml");
        std::fs::write(
            &file,
            "etcd_endpoints = [\"http://127.0.0.1:2379\", \"http://10.0.0.2:2379\"]\nlease_ttl = 15\n",
        )
        .unwrap();
        inputs.config = Some(file.clone());
        let resolved = resolve(&inputs).unwrap();
        assert_eq!(
            resolved.etcd,
            Some(EtcdSettings {
                endpoints: vec![
                    "http://127.0.0.1:2379".into(),
                    "http://10.0.0.2:2379".into()
                ],
                lease_ttl: Duration::from_secs(15),
            })
        );
        // A flag wins over the file, as everywhere.
        inputs.lease_ttl = Some((Duration::from_secs(20), Origin::Flag));
        assert_eq!(
            resolve(&inputs).unwrap().etcd.unwrap().lease_ttl,
            Duration::from_secs(20)
        );
        for (endpoints, ttl, why) in [
            (
                "https://a:2379",
                10,
                "its scheme is not http://: write each endpoint as http://HOST:PORT (https:// is not supported by this build)",
            ),
            (
                "http://a",
                10,
                "the port is missing: write each endpoint as http://HOST:PORT",
            ),
            ("http://a:0", 10, "port in 1-65535"),
            (
                "10.0.0.1:2379",
                10,
                "the scheme is missing: write each endpoint as http://HOST:PORT",
            ),
            ("a", 10, "the scheme is missing"),
            ("http://a:2379", 1, "out of range"),
            ("http://a:2379", 100_000, "out of range"),
        ] {
            inputs.etcd_endpoints = Some((vec![endpoints.to_owned()], Origin::Flag));
            inputs.lease_ttl = Some((Duration::from_secs(ttl), Origin::Flag));
            let err = resolve(&inputs).unwrap_err().to_string();
            assert!(
                err.contains(why) && err.contains("--etcd-endpoints"),
                "{err}"
            );
        }
        // No endpoints: the local flock, whatever the TTL says.
        inputs.etcd_endpoints = Some((Vec::new(), Origin::Flag));
        inputs.lease_ttl = None;
        std::fs::write(&file, "").unwrap();
        assert_eq!(resolve(&inputs).unwrap().etcd, None);
    }

    #[test]
    fn run_settings_come_from_flag_then_file_then_default_with_their_origin() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.toml");
        std::fs::write(
            &file,
            "deadline = \"90m\"\nkill_grace = 1.5\nkeep_runs = \"14d\"\nlease_ttl = \"15s\"\n\
             reap_budget = 60\n",
        )
        .unwrap();
        let mut inputs = Inputs {
            config: Some(file.clone()),
            ..Inputs::default()
        };
        let resolved = resolve(&inputs).unwrap();
        let t = &resolved.timings;
        assert_eq!(t.value(Timing::Deadline), Duration::from_secs(5400));
        assert_eq!(t.value(Timing::KillGrace), Duration::from_millis(1500));
        assert_eq!(
            t.get(Timing::KeepRuns),
            Some(Duration::from_secs(14 * 86_400))
        );
        assert_eq!(t.value(Timing::ReapBudget), Duration::from_secs(60));
        assert_eq!(t.value(Timing::TeardownTimeout), Duration::from_secs(300));
        assert_eq!(t.get(Timing::LockWait), None);
        let shown = |resolved: &Resolved, key: &str| {
            let s = resolved.settings.iter().find(|s| s.key == key).unwrap();
            (s.value.clone(), s.origin.clone())
        };
        assert_eq!(
            shown(&resolved, "deadline"),
            ("1h30m".to_owned(), Origin::File(file.clone()))
        );
        assert_eq!(
            shown(&resolved, "lock_wait"),
            ("none (until the deadline)".to_owned(), Origin::Default)
        );
        assert_eq!(shown(&resolved, "lease_ttl").0, "15s");
        inputs.timings = vec![(Timing::Deadline, Duration::from_secs(60))];
        let resolved = resolve(&inputs).unwrap();
        assert_eq!(
            resolved.timings.value(Timing::Deadline),
            Duration::from_secs(60)
        );
        assert_eq!(
            shown(&resolved, "deadline"),
            ("1m".to_owned(), Origin::Flag)
        );
    }

    #[rstest::rstest]
    #[case("deadline = \"5x\"\n", "deadline")]
    #[case("deadline = 0\n", "too short")]
    #[case("kill_grace = -1\n", "kill_grace")]
    #[case("keep_runs = 14\n", "14d")]
    #[case("keep_runs = \"0d\"\n", "at least 1h")]
    #[case("teardown_timeout = \"\"\n", "empty")]
    #[case("long_held = \"400d\"\n", "too long")]
    #[case("lease_ttl = 2.5\n", "whole number")]
    #[case("promote_after = true\n", "promote_after")]
    #[case(
        "recipe_url_template = \"https://u:SECRET@git.example.org/r.git\"\n",
        "https://***@git.example.org/r.git\": from the file"
    )]
    fn a_bad_run_setting_in_the_file_names_key_file_and_forms(
        #[case] text: &str,
        #[case] needle: &str,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.toml");
        std::fs::write(&file, text).unwrap();
        let inputs = Inputs {
            config: Some(file.clone()),
            ..Inputs::default()
        };
        let err = resolve(&inputs).unwrap_err().to_string();
        assert!(err.contains(needle), "{text:?}: {err}");
        assert!(err.contains(&file.display().to_string()), "{err}");
    }
}
