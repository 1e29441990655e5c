//! The unit tests of `names/mod.rs`.

#[test]
fn a_given_name_is_exact_and_its_version_has_no_underscore() {
    let mut given = super::GivenNames::default();
    given.add("secret", "s_t_db_password_{version}".to_owned());
    given.add("volume", "s_t_db_data".to_owned());
    assert!(given.gives("secret", "s_t_db_password_v1"));
    assert!(given.gives("secret", "s_t_db_password_v12"));
    assert!(!given.gives("secret", "s_t_db_password_"));
    assert!(!given.gives("secret", "s_t_db_password_v1_x"));
    assert!(!given.gives("secret", "s_t_example_org_db_password_v1"));
    assert!(!given.gives("volume", "s_t_example_org_db_data"));
    assert!(!given.gives("volume", "s_t_db_data_x"));
    assert!(!given.gives("config", "s_t_db_data"));
    assert!(given.gives("volume", "s_t_db_data"));
    let _ = given.gives("secret", "s_t_db_password_\u{e9}\u{e9}");
    assert_eq!(given.exact_volumes().collect::<Vec<_>>(), ["s_t_db_data"]);
    assert!(given.clone().under("s_t_example").volumes.is_empty());
}

#[cfg(feature = "etcd")]
use super::etcd as keys;

#[cfg(feature = "etcd")]
#[test]
fn tenure_keys_live_beside_the_lock_directories_and_parse_as_their_locks() {
    let dir = keys::lock_dir(keys::NAMED, "cache");
    let tenure = keys::tenure_key(&dir, 0x2a);
    assert_eq!(tenure, "/ccci-run/tenure/named/cache/000000000000002a");
    assert!(
        !tenure.starts_with(&dir),
        "a per-lock delete must not reach it"
    );
    assert_eq!(
        keys::key_parts(&tenure),
        Some(("named", "cache", "000000000000002a"))
    );
    assert!(keys::is_tenure(&tenure));
    let old = format!("{}000000000000002a", keys::legacy_tenure_prefix(&dir));
    assert_eq!(
        keys::key_parts(&old),
        Some(("named", "cache", "000000000000002a"))
    );
    assert!(keys::is_tenure(&old));
    // A lock named "tenure" is a lock, not the tenure tree.
    let owner = keys::owner_key(&keys::lock_dir(keys::NAMED, "tenure"));
    assert_eq!(keys::key_parts(&owner), Some(("named", "tenure", "owner")));
    assert!(!keys::is_tenure(&owner));
    assert!(!keys::is_tenure(&keys::queue_key(&dir, 1)));
    assert!(!keys::is_tenure(keys::FLEET) && keys::key_parts(keys::FLEET).is_none());
}

#[test]
fn visible_escapes_control_and_bidi_characters_only() {
    assert_eq!(visible("run 7 \u{e9}"), "run 7 \u{e9}");
    assert_eq!(visible("a\nb\u{1b}[31m"), "a\\nb\\u{1b}[31m");
    assert_eq!(visible("x\u{202e}y\u{2066}"), "x\\u{202e}y\\u{2066}");
}

use super::visible::needs_escape;
use super::*;
use proptest::prelude::*;
use rstest::rstest;
use sha1::{Digest, Sha1};

fn suffix() -> DomainSuffix {
    DomainSuffix::parse(DEFAULT_DOMAIN_SUFFIX).unwrap()
}

#[test]
fn domain_is_prefix_and_sha1_of_recipe_pr_ref() {
    // sha1("custom-html|12|") = 4a4b5e...; pinned so the derivation cannot drift silently.
    let pr = PrNumber::parse("12").unwrap();
    let d = AppDomain::derive("custom-html", Some(&pr), None, &suffix());
    let expected = hex::encode(Sha1::digest(b"custom-html|12|"));
    assert_eq!(
        d.as_str(),
        format!("cust-{}.ci.commoninternet.net", &expected[..6])
    );
    assert_eq!(
        d.stack_name(),
        format!("cust-{}_ci_commoninternet_net", &expected[..6])
    );
}

#[test]
fn short_recipe_with_separator_drops_it_from_the_prefix() {
    // A naive recipe[..4] would give "ab-c", which RUN_APP_RE rejects: leftovers never reaped.
    let d = AppDomain::derive("ab-c", None, None, &suffix());
    assert!(d.as_str().starts_with("abc-"), "{d}");
    assert!(RunAppPattern::new(&suffix()).matches(d.as_str()));
}

#[test]
fn empty_prefix_falls_back_to_app() {
    let d = AppDomain::derive("__--", None, None, &suffix());
    assert!(d.as_str().starts_with("app-"), "{d}");
}

#[rstest]
#[case::service(
    "abcd-0a1b2c_ci_commoninternet_net_app",
    Some("abcd-0a1b2c.ci.commoninternet.net")
)]
#[case::bare_stack(
    "abcd-0a1b2c_ci_commoninternet_net",
    Some("abcd-0a1b2c.ci.commoninternet.net")
)]
#[case::container(
    "/abcd-0a1b2c_ci_commoninternet_net_app.1.xyz",
    Some("abcd-0a1b2c.ci.commoninternet.net")
)]
#[case::warm("warm-keycloak_ci_commoninternet_net_app", None)]
#[case::other_suffix("abcd-0a1b2c_example_org_app", None)]
#[case::suffix_run_on("abcd-0a1b2c_ci_commoninternet_netx_app", None)]
#[case::no_underscore("abcd-0a1b2c", None)]
fn resource_names_map_back_to_domains(#[case] name: &str, #[case] want: Option<&str>) {
    let got = RunAppPattern::new(&suffix()).domain_of_resource(name);
    assert_eq!(got.as_ref().map(AppDomain::as_str), want);
}

#[rstest]
#[case::warm_app("warm-keycloak.ci.commoninternet.net")]
#[case::other_suffix("abcd-0a1b2c.example.org")]
#[case::uppercase_hash("abcd-0A1B2C.ci.commoninternet.net")]
#[case::long_prefix("abcde-0a1b2c.ci.commoninternet.net")]
#[case::short_hash("abcd-0a1b2.ci.commoninternet.net")]
#[case::unescaped_dot("abcd-0a1b2cXci.commoninternet.net")]
#[case::trailing("abcd-0a1b2c.ci.commoninternet.net.evil")]
fn run_app_pattern_rejects(#[case] domain: &str) {
    assert!(!RunAppPattern::new(&suffix()).matches(domain));
}

#[rstest]
#[case::uppercase("Custom", "recipe name")]
#[case::leading_dash("-x", "recipe name")]
#[case::traversal("../etc", "recipe name")]
#[case::slash("a/b", "recipe name")]
#[case::empty("", "recipe name")]
#[case::too_long(&"a".repeat(65), "recipe name")]
fn bad_recipe_names_are_refused(#[case] value: &str, #[case] what: &str) {
    let err = Recipe::parse(value).unwrap_err();
    assert_eq!(err.what, what);
    assert!(err.to_string().contains(&format!("{value:?}")), "{err}");
    assert!(err.to_string().contains("must match"), "{err}");
}

#[rstest]
#[case("1.0.0+1.2.3")]
#[case("main")]
#[case("refs/heads/feature/x")]
#[case("0123456789abcdef0123456789abcdef01234567")]
fn good_refs(#[case] value: &str) {
    // Recipe release tags carry a '+': they must be accepted.
    GitRef::parse(value).unwrap();
}

#[rstest]
#[case("a..b", "must not contain")]
#[case("-x", "must not start")]
#[case("a b", "must match")]
#[case("", "must match")]
fn bad_refs(#[case] value: &str, #[case] rule: &str) {
    assert!(GitRef::parse(value).unwrap_err().rule.contains(rule));
}

#[test]
fn long_suffix_is_a_configuration_error() {
    let err = DomainSuffix::parse(&format!("{}.example.org", "a".repeat(30))).unwrap_err();
    assert!(err.rule.contains("at most 33"), "{err}");
    DomainSuffix::parse(&format!("{}.org", "a".repeat(29))).unwrap();
}

#[test]
fn run_id_falls_back_to_manual_pid() {
    let id = RunId::resolve(None, &DroneBuild::default()).unwrap();
    assert_eq!(id.as_str(), format!("manual-{}", std::process::id()));
    let build = |repo: Option<&str>, number: &str| DroneBuild {
        repo: repo.map(str::to_owned),
        number: Some(number.to_owned()),
    };
    assert_eq!(
        RunId::resolve(Some("7"), &build(Some("a/b"), "9"))
            .unwrap()
            .as_str(),
        "7"
    );
    assert_eq!(
        RunId::resolve(None, &build(None, "9")).unwrap().as_str(),
        "9"
    );
}

#[rstest]
#[case("coop-cloud/lemp", "120", "coop-cloud.lemp.120")]
#[case("coop-cloud/custom-html", "120", "coop-cloud.custom-html.120")]
#[case("Some_Org/Rec_1", "3", "Some_Org.Rec_1.3")]
fn run_id_carries_the_repository(#[case] repo: &str, #[case] n: &str, #[case] id: &str) {
    let drone = DroneBuild {
        repo: Some(repo.to_owned()),
        number: Some(n.to_owned()),
    };
    assert_eq!(RunId::resolve(None, &drone).unwrap().as_str(), id);
}

#[test]
fn run_ids_of_repositories_that_read_alike_differ() {
    let id = |repo: &str| {
        RunId::resolve(
            None,
            &DroneBuild {
                repo: Some(repo.to_owned()),
                number: Some("120".to_owned()),
            },
        )
        .unwrap()
        .to_string()
    };
    let long = format!("coop-cloud/{}", "x".repeat(80));
    let longer = format!("{long}y");
    let all = [
        id("a.b/c"),
        id("a/b.c"),
        id("a/b-c"),
        id(&long),
        id(&longer),
        id("ü/x"),
    ];
    for (i, a) in all.iter().enumerate() {
        RunId::parse(a).unwrap();
        for b in &all[i + 1..] {
            assert_ne!(a, b);
        }
    }
    assert!(
        all[0].ends_with(".120") && all[0].starts_with("a-b-c."),
        "{}",
        all[0]
    );
    let bad = DroneBuild {
        repo: Some("a/b".to_owned()),
        number: Some("bad/../id".to_owned()),
    };
    let err = RunId::resolve(None, &bad).unwrap_err();
    assert_eq!(err.value, "bad/../id");
}

proptest! {
    #[test]
    fn every_valid_recipe_yields_a_run_app_domain(
        recipe in "[a-z0-9][a-z0-9_-]{0,63}",
        pr in proptest::option::of("[0-9]{1,10}"),
        git_ref in proptest::option::of("[A-Za-z0-9._/-]{1,40}"),
    ) {
        let recipe = Recipe::parse(&recipe).unwrap();
        let pr = pr.map(|p| PrNumber::parse(&p).unwrap());
        let git_ref = git_ref.and_then(|r| GitRef::parse(&r).ok());
        let suffix = suffix();
        let pattern = RunAppPattern::new(&suffix);
        let domain = AppDomain::derive(recipe.as_str(), pr.as_ref(), git_ref.as_ref(), &suffix);
        prop_assert!(pattern.matches(domain.as_str()), "{domain} does not match {:?}", pattern);
        prop_assert!(domain.stack_name().len() <= MAX_STACK_NAME_LEN);
        prop_assert_eq!(pattern.domain_of_stack(&domain.stack_name()), Some(domain.clone()));
        prop_assert_eq!(pattern.domain_of_lock_file(&domain.lock_file_name()), Some(domain.clone()));
        let service = format!("{}_app", domain.stack_name());
        prop_assert_eq!(pattern.domain_of_resource(&service), Some(domain.clone()));
        let container = format!("/{}_app.1.x1y2z3", domain.stack_name());
        prop_assert_eq!(pattern.domain_of_resource(&container), Some(domain));
    }

    #[test]
    fn any_string_validates_without_panicking(value in "\\PC{0,80}") {
        let _ = Recipe::parse(&value);
        let _ = GitRef::parse(&value);
        let _ = RunId::parse(&value);
        let _ = DomainSuffix::parse(&value);
        let pattern = RunAppPattern::new(&suffix());
        let _ = pattern.domain_of_stack(&value);
        let _ = pattern.domain_of_lock_file(&value);
        let _ = pattern.domain_of_resource(&value);
    }
}

#[rstest]
#[case(
    "ccci-run-42-1234-98765-4026531836-c2049.77",
    Some("1234-98765-4026531836-c2049.77")
)]
#[case("ccci-lock-pkg-cache-99-1-7-c1.2", Some("99-1-7-c1.2"))]
#[case("ccci-run-42-1234-98765", None)]
#[case("ccci-1-2-3-c1.2", None)]
#[case("other-run-1-2-3-c1.2", None)]
#[case("ccci-", None)]
fn group_names_name_their_owner(#[case] name: &str, #[case] want: Option<&str>) {
    assert_eq!(cgroup_owner(name), want);
}

#[test]
fn a_run_s_cgroup_names_its_run() {
    let owner = "7-99-4026531836-c1.2";
    assert_eq!(
        run_of_cgroup(&cgroup_name("run", "pr-12", owner)),
        Some("pr-12")
    );
    assert_eq!(run_of_cgroup(&cgroup_name("lock", "deploy", owner)), None);
}

#[test]
fn cgroup_names_round_trip() {
    let name = cgroup_name("run", "manual-3", "4321-1000000-5-c1.2");
    assert_eq!(cgroup_owner(&name), Some("4321-1000000-5-c1.2"));
}

proptest::proptest! {
    /// Any document of any strings (long, hostile: controls, C1, bidi, backslashes,
    /// quotes) stays valid JSON whose decoded strings carry nothing a terminal acts on,
    /// and a document with nothing to escape is left as it is.
    #[test]
    fn json_documents_carry_no_control_or_bidi_character(
        values in proptest::collection::vec(
            "(\\PC|[\\x00-\\x1f\\x7f\\u{80}-\\u{9f}\\u{202a}-\\u{202e}\\u{2066}-\\u{2069}\\\\\"])*",
            0..4
        ),
        long in 0usize..80_000,
    ) {
        let mut values = values;
        values.push("\u{202e}x".repeat(long / 2));
        let doc = serde_json::to_string_pretty(&serde_json::json!({"a": values, "k": 1})).unwrap();
        let shown = visible_json(&doc);
        let back: serde_json::Value = serde_json::from_str(&shown).unwrap();
        for v in back["a"].as_array().unwrap() {
            let v = v.as_str().unwrap();
            proptest::prop_assert!(!v.chars().any(needs_escape), "{v:?}");
        }
        proptest::prop_assert_eq!(visible_json(&shown), shown.clone());
        proptest::prop_assert!(!visible_text(&shown).chars().any(|c| c != '\n' && needs_escape(c)));
    }
}

#[test]
fn json_escapes_read_as_runs_json_writes_them() {
    let doc = serde_json::to_string(&serde_json::json!(["a\u{1b}[31m\n\u{202e}b\u{85}", "c\\d"]))
        .unwrap();
    let back: Vec<String> = serde_json::from_str(&visible_json(&doc)).unwrap();
    assert_eq!(back, ["a\\u{1b}[31m\\n\\u{202e}b\\u{85}", "c\\d"]);
}
