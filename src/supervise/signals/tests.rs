//! The unit tests of `supervise/signals.rs`.

use super::*;
use std::io::Write;

/// A funnel without the stop signals' handlers: what it watches is what is under test
/// here, not the process's signal dispositions. Only the kick is handled, as cancelling a
/// worker needs it.
fn funnel() -> (SignalFunnel, UnixStream) {
    let kick = crate::supervise::threads::kick_signal();
    signal_hook::flag::register(kick, &KICKED).unwrap();
    linux::clear_sa_restart(kick).unwrap();
    let (wake, notify) = UnixStream::pair().unwrap();
    wake.set_nonblocking(true).unwrap();
    let funnel = SignalFunnel {
        wake,
        start_ppid: nix::unistd::getppid(),
        tie: Vec::new(),
        losses: Vec::new(),
        deadline: None,
        senders: None,
        last_sender: Cell::new(None),
        stop: None,
    };
    // The other end stays open: a closed one would wake every wait at once.
    (funnel, notify)
}

/// A SIGTERM is the request's only from its requester, to the supervisor it names: the
/// kernel gives the sender's pid in the receiver's namespace, or 0 from an enclosing one.
#[rstest::rstest]
#[case::same_namespace(Sender { pid: 42, uid: 1000 }, 42, 7, true)]
#[case::another_pid(Sender { pid: 43, uid: 1000 }, 42, 7, false)]
#[case::another_uid(Sender { pid: 42, uid: 0 }, 42, 7, false)]
#[case::from_an_enclosing_namespace(Sender { pid: 0, uid: 1000 }, 4242, 9, true)]
#[case::hidden_sender_but_same_namespace(Sender { pid: 0, uid: 1000 }, 42, 7, false)]
#[case::same_pid_in_another_namespace(Sender { pid: 42, uid: 1000 }, 42, 9, false)]
fn a_stop_request_is_matched_to_its_sender(
    #[case] sender: Sender,
    #[case] pid: i32,
    #[case] pid_ns: u64,
    #[case] matches: bool,
) {
    let own = ProcessIdentity {
        pid: 3,
        start_ticks: 100,
        pid_ns: 7,
        boot_id: "b".into(),
    };
    let request = StopRequest {
        uid: 1000,
        pid,
        pid_ns,
        supervisor: own.clone(),
        at: String::new(),
    };
    assert_eq!(request.sent_by(sender, &own), matches);
    let other = ProcessIdentity {
        start_ticks: 200,
        ..own.clone()
    };
    assert!(
        !request.sent_by(sender, &other),
        "another supervisor's request"
    );
}

#[test]
fn a_lost_lock_wakes_the_wait_and_is_a_way_out_once() {
    let (mut funnel, _notify) = funnel();
    let (lost, mut lose) = UnixStream::pair().unwrap();
    funnel.watch_loss(OwnedFd::from(lost));
    assert!(funnel.pending().is_empty());
    let waker = std::thread::spawn(move || {
        lose.write_all(&[1]).unwrap();
        lose
    });
    let started = Instant::now();
    let arrived = funnel.wait(Some(Duration::from_secs(30)));
    let _lose = waker.join().unwrap();
    // Woken by the loss, not by the timeout: the loss is in the same poll as the signals.
    assert!(started.elapsed() < Duration::from_secs(30));
    assert!(arrived.lock_lost, "{arrived:?}");
    assert_eq!(
        shutdown_events(&arrived).collect::<Vec<_>>(),
        [Event::LockLost]
    );
    assert!(!funnel.pending().lock_lost, "a loss is reported once");
}

#[test]
fn a_worker_that_finishes_is_done_and_a_budget_that_runs_out_cancels_it() {
    let (funnel, _notify) = funnel();
    let worker = crate::supervise::worker::Worker::spawn("test", |_| 7).unwrap();
    assert!(matches!(
        funnel.await_work(worker, None, None),
        Awaited::Done(7)
    ));
    let worker = crate::supervise::worker::Worker::spawn("test", |cancel| {
        while !cancel.is_cancelled() {
            std::thread::sleep(Duration::from_millis(1));
        }
    })
    .unwrap();
    let mut ticks = 0;
    let mut tick = || ticks += 1;
    let until = Instant::now() + Duration::from_millis(50);
    let awaited = funnel.await_work(
        worker,
        Some(until),
        Some((Duration::from_millis(10), &mut tick)),
    );
    assert!(matches!(awaited, Awaited::TimedOut), "{awaited:?}");
    assert!(Instant::now() >= until);
    assert!(ticks >= 1, "the keepalive ran while waiting");
}
