//! The unit tests of `supervise/identity.rs`.

use super::*;
use rstest::rstest;

#[test]
fn this_process_is_alive_to_itself() {
    let me = ProcessIdentity::own().unwrap();
    assert_eq!(me.pid, std::process::id() as i32);
    assert_eq!(me.judge(), Verdict::Alive);
}

#[test]
fn a_reaped_child_is_dead_and_a_reused_start_time_is_not_its_own() {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id() as i32;
    child.wait().unwrap();
    let me = ProcessIdentity::own().unwrap();
    let gone = ProcessIdentity { pid, ..me.clone() };
    assert_eq!(gone.judge(), Verdict::Dead);
    // Our own pid with another start time: the pid was reused, the recorded one is gone.
    let earlier = ProcessIdentity {
        start_ticks: me.start_ticks.saturating_sub(1000),
        ..me.clone()
    };
    assert_eq!(earlier.judge(), Verdict::Dead);
}

#[test]
fn a_zombie_is_dead() {
    let child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id() as i32;
    // Not waited for: a zombie until the test ends.
    let dir = linux::ProcDir::open(pid).unwrap();
    while dir.running() {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let start = crate::supervise::procfs::parse_start_time(&String::from_utf8_lossy(
        &dir.read("stat").unwrap(),
    ))
    .unwrap();
    let me = ProcessIdentity::own().unwrap();
    let offset = Here::get().offset_ticks.clone().unwrap();
    let zombie = ProcessIdentity {
        pid,
        start_ticks: normalise(start, offset),
        ..me.clone()
    };
    assert_eq!(zombie.judge(), Verdict::Dead);
    drop(child);
}

#[rstest]
#[case::another_boot(|p: &mut ProcessIdentity| p.boot_id = "another-boot".into())]
#[case::an_unseen_namespace(|p: &mut ProcessIdentity| p.pid_ns = 1)]
fn what_cannot_be_seen_from_here_is_never_dead(#[case] change: fn(&mut ProcessIdentity)) {
    let mut other = ProcessIdentity::own().unwrap().clone();
    change(&mut other);
    // pid:[1] names no namespace at all; but a judge that sees the whole host (in the
    // initial namespace, with nothing hidden) knows it has no process: that is proof.
    let here = Here::get();
    let proven_empty = other.boot_id == here.boot_id && here.proc_is_init;
    match other.judge() {
        Verdict::Dead => assert!(proven_empty, "{other:?} judged dead"),
        Verdict::Unresolvable(why) => assert!(!why.is_empty()),
        Verdict::Alive => panic!("{other:?} judged alive"),
    }
}

#[test]
fn the_whole_table_agrees_with_the_direct_look() {
    let me = ProcessIdentity::own().unwrap();
    let judge = Judge::new();
    let table = judge.table.get_or_init(Table::read);
    assert!(table.by_pid.contains_key(&(me.pid_ns, me.pid)));
}

#[rstest]
#[case("3-318675-4026532211-c2049.1234", Some((3, 318675, 4026532211, "c2049.1234")))]
#[case("1-0-1-c0.0", Some((1, 0, 1, "c0.0")))]
#[case("0-1-1-c1.1", None)]
#[case("3-318675-4026532211", None)]
#[case("3-318675-4026532211-2049.1234", None)]
#[case("3-318675--c1.2", None)]
#[case("x-1-1-c1.2", None)]
#[case("+3-1-1-c1.2", None)]
#[case("3-1-1-c1.2.3", None)]
#[case("3-1-1-c.2", None)]
fn owners_parse(#[case] text: &str, #[case] want: Option<(i32, u64, u64, &str)>) {
    let got = Owner::parse(text);
    assert_eq!(
        got.as_ref().map(|o| (
            o.process.pid,
            o.process.start_ticks,
            o.process.pid_ns,
            o.scope.to_string()
        )),
        want.map(|(p, s, n, c)| (p, s, n, c.to_owned()))
    );
    if let Some(owner) = got {
        assert_eq!(owner.to_string(), text);
    }
}

#[rstest]
#[case("monotonic 0 0\nboottime 100000 0\n", Some(100_000_000_000_000))]
#[case("1 0 0\n7 -5 500000000\n", Some(-4_500_000_000))]
#[case("monotonic 0 0\n", None)]
#[case("boottime x 0", None)]
fn boottime_offsets_parse(#[case] text: &str, #[case] want: Option<i128>) {
    assert_eq!(crate::supervise::procfs::parse_boottime_offset(text), want);
}

#[rstest]
#[case(1000, 0, 1000)]
#[case(10_001_000, 10_000_000, 1000)]
#[case(500, -300, 800)]
#[case(5, 10, 0)]
fn start_times_lose_the_time_namespace_offset(
    #[case] raw: u64,
    #[case] offset: i128,
    #[case] want: u64,
) {
    assert_eq!(normalise(raw, offset), want);
}

#[rstest]
#[case(
    "22 1 0:21 / /proc rw,nosuid - proc proc rw,hidepid=invisible\n",
    Some("invisible")
)]
#[case("22 1 0:21 / /proc rw - proc proc rw,hidepid=2,gid=4\n", Some("2"))]
#[case("22 1 0:21 / /proc rw - proc proc rw,hidepid=0\n", None)]
#[case("22 1 0:21 / /proc rw - proc proc rw\n", None)]
#[case("23 1 0:22 / /mnt/proc rw - proc proc rw,hidepid=2\n", None)]
fn hidepid_is_read_from_the_proc_mount(#[case] mountinfo: &str, #[case] want: Option<&str>) {
    assert_eq!(
        crate::supervise::procfs::proc_hidepid(mountinfo),
        want.map(|w| format!("/proc is mounted with hidepid={w}"))
    );
}

#[rstest]
#[case("Name:\tsh\nNSpid:\t31116\t3\n", Some(vec![31116, 3]))]
#[case("NSpid:\t1\n", Some(vec![1]))]
#[case("NSpid:\n", None)]
#[case("Pid:\t4\n", None)]
fn nspid_lines_parse(#[case] text: &str, #[case] want: Option<Vec<i32>>) {
    assert_eq!(crate::supervise::procfs::parse_nspid(text), want);
}
