//! The etcd checks: the cluster answers, a lease can be granted and revoked, and the lease TTL
//! holds the kill grace (the stop budget).

use crate::config;
use crate::config::Global;
use crate::doctor::check::{Check, State, check};

/// Each etcd endpoint reachable; one cluster, with a leader; the TTL as granted.
pub(super) fn etcd(global: &Global) -> Vec<Check> {
    let Some(settings) = &global.etcd else {
        return vec![
            check(
                "etcd",
                State::Skip,
                "no etcd endpoints: locks are this host's flock",
            )
            .fix("set etcd_endpoints to share locks with other hosts"),
        ];
    };
    let grace = global.timings.value(config::Timing::KillGrace);
    let budget = match settings.check_stop_budget(grace) {
        Ok(()) => check(
            "etcd stop budget",
            State::Ok,
            format!(
                "a {} lease holds the {} kill grace, the 0.5 s kill margin and 3.5 s of \
                 keepalives and an etcd leader election: a holder stops its command before etcd \
                 can expire its lease",
                crate::duration::show(settings.lease_ttl),
                crate::duration::show(grace)
            ),
        ),
        Err(err) => check("etcd stop budget", State::Fail, err.to_string())
            .fix("raise lease_ttl, or lower kill_grace, as the message says: run and lock refuse these settings"),
    };
    let mut checks = vec![budget];
    checks.extend(etcd_checks(settings));
    checks
}

#[cfg(not(feature = "etcd"))]
pub(super) fn etcd_checks(settings: &config::EtcdSettings) -> Vec<Check> {
    vec![
        check(
            "etcd",
            State::Fail,
            format!(
                "etcd endpoints are set ({}), but this build has no etcd backend: every lock \
             command refuses to run",
                settings.endpoints.join(",")
            ),
        )
        .fix("install a ccci-run built with --features etcd, or remove etcd_endpoints"),
    ]
}

#[cfg(feature = "etcd")]
pub(super) fn etcd_checks(settings: &config::EtcdSettings) -> Vec<Check> {
    let answers = match crate::lock::etcd::health::ask(settings) {
        Ok(answers) => answers,
        Err(err) => return vec![check("etcd", State::Fail, err)],
    };
    let mut checks = Vec::new();
    let mut members = Vec::new();
    for (endpoint, answer) in answers {
        let name = format!("etcd {endpoint}");
        match answer {
            Ok(member) => {
                checks.push(check(
                    name,
                    State::Ok,
                    format!(
                        "etcd {}, member {:x} of cluster {:x}",
                        member.version, member.member_id, member.cluster_id
                    ),
                ));
                members.push((endpoint, member));
            }
            Err(err) => checks.push(
                check(name, State::Fail, err)
                    .fix("start that member, or remove the endpoint from etcd_endpoints"),
            ),
        }
    }
    let mut clusters: Vec<u64> = members.iter().map(|(_, m)| m.cluster_id).collect();
    clusters.sort_unstable();
    clusters.dedup();
    checks.push(match clusters.as_slice() {
        [] => check("etcd cluster", State::Fail, "no endpoint answered")
            .fix("start etcd, or correct etcd_endpoints"),
        [one] => check("etcd cluster", State::Ok, format!("one cluster, {one:x}")),
        many => check(
            "etcd cluster",
            State::Fail,
            format!(
                "the endpoints belong to {} clusters ({}): hosts on different clusters exclude \
                 nobody",
                many.len(),
                members
                    .iter()
                    .map(|(e, m)| format!("{e}: {:x}", m.cluster_id))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
        .fix("list the members of one cluster in etcd_endpoints"),
    });
    let leaders: Vec<u64> = members
        .iter()
        .map(|(_, m)| m.leader)
        .filter(|l| *l != 0)
        .collect();
    checks.push(match leaders.first() {
        Some(leader) if !members.is_empty() && leaders.len() == members.len() => {
            check("etcd leader", State::Ok, format!("member {leader:x} leads"))
        }
        Some(_) => check(
            "etcd leader",
            State::Warn,
            "some members answering know no leader: they refuse lock requests",
        )
        .fix("look at etcd's logs: a member is cut off from the others"),
        None if members.is_empty() => {
            check("etcd leader", State::Fail, "no endpoint answered").fix("start etcd")
        }
        None => check(
            "etcd leader",
            State::Fail,
            "no member knows a leader (no quorum): every lock request is refused",
        )
        .fix("bring a majority of the cluster's members up"),
    });
    let asked = settings.lease_ttl.as_secs();
    let granted: Vec<i64> = members.iter().filter_map(|(_, m)| m.granted_ttl).collect();
    checks.push(match granted.iter().max() {
        None => check(
            "etcd lease ttl",
            State::Fail,
            format!("no member granted a {asked} s lease"),
        )
        .fix("make the cluster answer first"),
        Some(&got) if u64::try_from(got).is_ok_and(|g| g > asked) => check(
            "etcd lease ttl",
            State::Warn,
            format!(
                "asked {asked} s, granted {got} s: etcd raises a TTL below its minimum (1.5 × \
                 its election timeout), so a dead holder's lock frees later than configured"
            ),
        )
        .fix(format!("set lease_ttl to {got} s or more")),
        Some(&got) => check(
            "etcd lease ttl",
            State::Ok,
            format!("{got} s, as asked (a dead holder's lock frees within it)"),
        ),
    });
    checks
}
