//! Output nobody reads any more: every line ccci-run writes (status lines, `tracing` events in
//! text and JSON, listings) to a closed or full stdout or stderr is dropped, never a panic (exit
//! 101), and the exit code stays the one the run records (run.json's `exit_code`) or, where
//! there is no record, the documented one.
//!
//! Each test closes the read end of a pipe at one phase — waiting for a lock, while the command
//! runs, during teardown, at a lock-lost teardown with etcd — and lets the process go on to its
//! end. `-vv` makes every phase after the close write `tracing` events, not only status lines;
//! the lock-lost case keeps the default level, where its WARN line once ended the run with a
//! panic while run.json said 76.

use std::io::Read;
use std::os::fd::AsFd;
use std::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use nix::sys::signal::Signal;
use rstest::rstest;
use serde_json::Value;

use crate::util::{PATIENCE, Proc, Sandbox, Stream, signal, wait_exited};

/// Says it is ready on both streams, waits for its stdin to close, writes to both again (a
/// write to the closed one fails and it goes on) and ends with 7.
const WRITES_THEN_7: &str = "trap '' PIPE; echo ready $$; echo ready $$ >&2; read _ || :; \
                             echo after-out; echo after-err >&2; exit 7";

/// Takes its time to stop: on SIGTERM it says so on both streams, waits for its stdin to
/// close, writes to both and ends with 9.
const SLOW_TO_STOP: &str = "trap '' PIPE; trap 'echo term-seen; echo term-seen >&2; read _ || :; \
                            echo term-out; echo term-err >&2; exit 9' TERM; \
                            echo ready $$; while :; do sleep 0.05; done";

/// Writes to both streams until it is stopped.
const TICKS: &str =
    "trap '' PIPE; echo ready $$; while :; do echo tick; echo tick >&2; sleep 0.1; done";

/// Holds until its stdin closes.
const HOLD: &str = "echo ready $$; read _ || :";

/// When, in a run or a lock, the reader goes away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the lock another holds; the holder then lets go.
    Waiting,
    /// While the command runs.
    Running,
    /// After SIGTERM, while the command takes its time to stop.
    Teardown,
    /// Holding an etcd lock whose owner key is then deleted by hand: a lock-lost teardown.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    LockLost,
}

impl Phase {
    /// The exit code the phase ends with: the command's 7, 128+SIGTERM, or lock lost.
    fn code(self) -> i32 {
        match self {
            Self::Waiting | Self::Running => 7,
            Self::Teardown => 143,
            Self::LockLost => 76,
        }
    }
}

fn index(stream: Stream) -> usize {
    match stream {
        Stream::Out => 0,
        Stream::Err => 1,
    }
}

/// A process whose stdout and stderr are pipes the test reads and can close at any moment:
/// once a read end is closed, every later write to it (the process's and its command's) gets
/// EPIPE. One thread polls both pipes, so a close takes effect at once (a reader thread blocked
/// in read(2) would keep its pipe open).
struct Watched {
    child: Child,
    stdin: Option<ChildStdin>,
    out: Option<ChildStdout>,
    err: Option<ChildStderr>,
    /// Everything read from stdout and stderr, and how far [`Watched::wait_for`] has looked.
    text: [String; 2],
    seen: [usize; 2],
    cmdline: String,
}

/// What a [`Watched`] process left.
struct Done {
    status: std::process::ExitStatus,
    text: [String; 2],
    cmdline: String,
}

impl Watched {
    fn spawn(mut cmd: Command) -> Self {
        let cmdline = format!("{cmd:?}");
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmdline}: {e}"));
        Self {
            stdin: child.stdin.take(),
            out: child.stdout.take(),
            err: child.stderr.take(),
            child,
            text: [String::new(), String::new()],
            seen: [0, 0],
            cmdline,
        }
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("a pid")
    }

    fn open(&self, stream: Stream) -> bool {
        match stream {
            Stream::Out => self.out.is_some(),
            Stream::Err => self.err.is_some(),
        }
    }

    /// Close the read end of `stream`.
    fn close(&mut self, stream: Stream) {
        match stream {
            Stream::Out => self.out = None,
            Stream::Err => self.err = None,
        }
    }

    fn transcript(&self) -> String {
        format!(
            "{}\n--- stdout\n{}\n--- stderr\n{}",
            self.cmdline, self.text[0], self.text[1]
        )
    }

    /// Read what has come on the open streams, waiting at most until `deadline`; a stream at
    /// its end is closed. False once none is open.
    fn read_some(&mut self, deadline: Instant) -> bool {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let _ = self.child.kill();
            panic!("timed out waiting for output\n{}", self.transcript());
        }
        let ready = {
            let mut fds = Vec::new();
            let mut which = Vec::new();
            if let Some(out) = &self.out {
                fds.push(PollFd::new(out.as_fd(), PollFlags::POLLIN));
                which.push(Stream::Out);
            }
            if let Some(err) = &self.err {
                fds.push(PollFd::new(err.as_fd(), PollFlags::POLLIN));
                which.push(Stream::Err);
            }
            if fds.is_empty() {
                return false;
            }
            let timeout = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
            match poll(&mut fds, timeout) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => panic!("poll: {e}"),
            }
            fds.iter()
                .zip(which)
                .filter(|(fd, _)| fd.revents().is_some_and(|r| !r.is_empty()))
                .map(|(_, stream)| stream)
                .collect::<Vec<_>>()
        };
        for stream in ready {
            let mut buf = [0u8; 4096];
            let read = match stream {
                Stream::Out => self.out.as_mut().map(|r| r.read(&mut buf)),
                Stream::Err => self.err.as_mut().map(|r| r.read(&mut buf)),
            };
            match read {
                Some(Ok(0) | Err(_)) => self.close(stream),
                Some(Ok(n)) => {
                    self.text[index(stream)].push_str(&String::from_utf8_lossy(&buf[..n]))
                }
                None => {}
            }
        }
        true
    }

    /// Wait for a whole line on `stream` containing `needle`, after the last one found.
    #[track_caller]
    fn wait_for(&mut self, stream: Stream, needle: &str) -> String {
        let deadline = Instant::now() + PATIENCE;
        let i = index(stream);
        loop {
            let rest = &self.text[i][self.seen[i]..];
            let mut at = 0;
            for line in rest.split_inclusive('\n') {
                if !line.ends_with('\n') {
                    break;
                }
                at += line.len();
                if line.contains(needle) {
                    let found = line.trim_end().to_owned();
                    self.seen[i] += at;
                    return found;
                }
            }
            if !self.open(stream) || !self.read_some(deadline) {
                panic!(
                    "output ended without a line containing {needle:?}\n{}",
                    self.transcript()
                );
            }
        }
    }

    /// Let the command go on (its stdin closed), read the open streams to their end and reap
    /// the process.
    fn finish(mut self) -> Done {
        self.stdin = None;
        let deadline = Instant::now() + PATIENCE;
        while self.read_some(deadline) {}
        if !wait_exited(self.pid()) {
            let _ = self.child.kill();
            panic!("still running after {PATIENCE:?}\n{}", self.transcript());
        }
        let status = self.child.wait().unwrap();
        Done {
            status,
            text: self.text,
            cmdline: self.cmdline,
        }
    }
}

impl Done {
    fn transcript(&self) -> String {
        format!(
            "{}\nstatus: {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.cmdline, self.status, self.text[0], self.text[1]
        )
    }

    /// Ended with `code`, and nothing it said before its reader went away tells of a panic.
    #[track_caller]
    fn assert_code(&self, code: i32) {
        assert!(
            !self.text.iter().any(|t| t.contains("panicked")),
            "a panic\n{}",
            self.transcript()
        );
        assert_eq!(self.status.code(), Some(code), "{}", self.transcript());
    }
}

/// The write end of a pipe whose read end is already closed: every write to it gets EPIPE.
fn closed_pipe() -> Stdio {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    writer.into()
}

/// `/dev/full`, where every write gets ENOSPC.
fn full_disk() -> Stdio {
    std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap()
        .into()
}

/// `ccci-run [-vv] [--log-format json] run ... -- sh -c SCRIPT` for custom-html (one domain
/// for every run of a sandbox), with a kill grace long enough for any command here.
fn run_cmd(sandbox: &Sandbox, run_id: &str, loud: bool, json: bool, script: &str) -> Command {
    let mut cmd = sandbox.ccci();
    if loud {
        cmd.arg("-vv");
    }
    if json {
        cmd.args(["--log-format", "json"]);
    }
    cmd.args([
        "run",
        "--recipe",
        "custom-html",
        "--run-id",
        run_id,
        "--no-fetch",
        "--kill-grace",
        &long_grace(sandbox),
        "--lock-wait",
        "60s",
        "--",
        "sh",
        "-c",
        script,
    ]);
    cmd
}

/// A kill grace long enough for a test to close a reader while the command is still tearing
/// down: 30 s, or with etcd the longest its lease allows (a lease TTL must cover the grace).
fn long_grace(sandbox: &Sandbox) -> String {
    match sandbox.etcd_ttl() {
        Some(ttl) => format!("{}s", ttl.saturating_sub(4).min(30)),
        None => "30s".to_owned(),
    }
}

/// `ccci-run [-vv] [--log-format json] lock shared ... -- sh -c SCRIPT`.
fn lock_cmd(sandbox: &Sandbox, loud: bool, json: bool, script: &str) -> Command {
    let mut cmd = sandbox.ccci();
    if loud {
        cmd.arg("-vv");
    }
    if json {
        cmd.args(["--log-format", "json"]);
    }
    cmd.args([
        "lock",
        "shared",
        "--kill-grace",
        &long_grace(sandbox),
        "--",
        "sh",
        "-c",
        script,
    ]);
    cmd
}

/// What is being watched: a run (its id) or a named lock.
#[derive(Debug, Clone, Copy)]
enum Subject {
    Run,
    Lock,
}

/// Start `subject` on `sandbox`, close the reader of `closed` at `phase`, let it end; returns
/// what it left. `lose` deletes the etcd owner key of the lock it holds (for
/// [`Phase::LockLost`]).
fn through_phase(
    sandbox: &Sandbox,
    subject: Subject,
    phase: Phase,
    closed: Stream,
    json: bool,
    lose: &dyn Fn(&Sandbox),
) -> Done {
    // The lock-lost case keeps the default level: its WARN line is what used to panic.
    let loud = phase != Phase::LockLost;
    let script = match phase {
        Phase::Waiting | Phase::Running => WRITES_THEN_7,
        Phase::Teardown => SLOW_TO_STOP,
        Phase::LockLost => TICKS,
    };
    let command = |loud, json, script| match subject {
        Subject::Run => run_cmd(sandbox, "closed", loud, json, script),
        Subject::Lock => lock_cmd(sandbox, loud, json, script),
    };
    let holder = if phase == Phase::Waiting {
        let holder_cmd = match subject {
            Subject::Run => run_cmd(sandbox, "holder", false, false, HOLD),
            Subject::Lock => lock_cmd(sandbox, false, false, HOLD),
        };
        let mut holder = Proc::spawn(holder_cmd);
        holder.wait_ready();
        Some(holder)
    } else {
        None
    };
    let mut watched = Watched::spawn(command(loud, json, script));
    match phase {
        Phase::Waiting => {
            let waiting = match subject {
                Subject::Run => "held by run holder",
                Subject::Lock => "waiting as queue ticket",
            };
            watched.wait_for(Stream::Err, waiting);
            watched.close(closed);
            let mut holder = holder.expect("a holder");
            holder.close_stdin();
            holder.finish().assert_code(0);
        }
        Phase::Running => {
            watched.wait_for(Stream::Out, "ready");
            watched.close(closed);
        }
        Phase::Teardown => {
            watched.wait_for(Stream::Out, "ready");
            signal(watched.pid(), Signal::SIGTERM);
            // The command has its TERM: the teardown is under way.
            watched.wait_for(closed, "term-seen");
            watched.close(closed);
        }
        Phase::LockLost => {
            watched.wait_for(Stream::Out, "ready");
            watched.close(closed);
            lose(sandbox);
        }
    }
    watched.finish()
}

/// [`through_phase`] for a run: the exit code is the one its run.json records, and that is
/// the phase's.
fn run_through(
    sandbox: &Sandbox,
    phase: Phase,
    closed: Stream,
    json: bool,
    lose: &dyn Fn(&Sandbox),
) {
    let done = through_phase(sandbox, Subject::Run, phase, closed, json, lose);
    let record = sandbox.record("closed");
    let recorded = record["exit_code"]
        .as_i64()
        .unwrap_or_else(|| panic!("no exit code in {record:#}\n{}", done.transcript()));
    done.assert_code(i32::try_from(recorded).unwrap());
    assert_eq!(recorded, i64::from(phase.code()), "{}", done.transcript());
}

/// [`through_phase`] for a named lock: the documented exit code of the phase.
fn lock_through(
    sandbox: &Sandbox,
    phase: Phase,
    closed: Stream,
    json: bool,
    lose: &dyn Fn(&Sandbox),
) {
    let done = through_phase(sandbox, Subject::Lock, phase, closed, json, lose);
    done.assert_code(phase.code());
}

fn no_loss(_: &Sandbox) {
    unreachable!("only an etcd lock is lost by hand");
}

/// A run whose reader goes away at any phase ends with the code its run.json records.
#[rstest]
#[case::waiting_stderr(Phase::Waiting, Stream::Err, false)]
#[case::waiting_stdout(Phase::Waiting, Stream::Out, false)]
#[case::waiting_stderr_json(Phase::Waiting, Stream::Err, true)]
#[case::running_stderr(Phase::Running, Stream::Err, false)]
#[case::running_stdout(Phase::Running, Stream::Out, false)]
#[case::running_stderr_json(Phase::Running, Stream::Err, true)]
#[case::teardown_stderr(Phase::Teardown, Stream::Err, false)]
#[case::teardown_stdout(Phase::Teardown, Stream::Out, false)]
#[case::teardown_stderr_json(Phase::Teardown, Stream::Err, true)]
fn a_run_whose_reader_goes_away_ends_with_its_recorded_code(
    #[case] phase: Phase,
    #[case] closed: Stream,
    #[case] json: bool,
) {
    run_through(&Sandbox::new(), phase, closed, json, &no_loss);
}

/// A named lock whose reader goes away at any phase ends with its documented code.
#[rstest]
#[case::waiting_stderr(Phase::Waiting, Stream::Err, false)]
#[case::waiting_stdout(Phase::Waiting, Stream::Out, false)]
#[case::holding_stderr(Phase::Running, Stream::Err, false)]
#[case::holding_stdout(Phase::Running, Stream::Out, false)]
#[case::holding_stderr_json(Phase::Running, Stream::Err, true)]
#[case::teardown_stderr(Phase::Teardown, Stream::Err, false)]
#[case::teardown_stdout(Phase::Teardown, Stream::Out, false)]
fn a_lock_whose_reader_goes_away_ends_with_its_documented_code(
    #[case] phase: Phase,
    #[case] closed: Stream,
    #[case] json: bool,
) {
    lock_through(&Sandbox::new(), phase, closed, json, &no_loss);
}

/// `ccci-run -vvv ARGS` with `stdout` and `stderr`; the finished process.
fn with_streams(
    sandbox: &Sandbox,
    args: &[&str],
    stdout: Stdio,
    stderr: Stdio,
) -> std::process::Output {
    let mut cmd = sandbox.ccci();
    cmd.arg("-vvv")
        .args(args)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr);
    cmd.output().unwrap()
}

/// Nothing captured tells of a panic, and the code is `code`.
#[track_caller]
fn assert_quiet_end(args: &[&str], done: &std::process::Output, code: i32) {
    let (out, err) = (
        String::from_utf8_lossy(&done.stdout),
        String::from_utf8_lossy(&done.stderr),
    );
    assert!(
        !out.contains("panicked") && !err.contains("panicked"),
        "{args:?}: a panic\n{out}\n{err}"
    );
    assert_eq!(
        done.status.code(),
        Some(code),
        "{args:?}\n--- stdout\n{out}\n--- stderr\n{err}"
    );
}

/// A janitor whose stdout or stderr nobody reads (closed before it starts; `-vvv` logs every
/// step) does its sweep and ends 0.
fn janitor_with_closed_streams(sandbox: &Sandbox) {
    for args in [&["janitor"][..], &["janitor", "--json"]] {
        let done = with_streams(sandbox, args, closed_pipe(), Stdio::piped());
        assert_quiet_end(args, &done, 0);
        for json in [false, true] {
            let args = if json {
                [&["--log-format", "json"], args].concat()
            } else {
                args.to_vec()
            };
            let done = with_streams(sandbox, &args, Stdio::piped(), closed_pipe());
            assert_quiet_end(&args, &done, 0);
            if args.contains(&"--json") {
                let report: Result<Value, _> = serde_json::from_slice(&done.stdout);
                assert!(report.is_ok(), "{args:?}: {done:?}");
            }
        }
    }
}

#[test]
fn a_janitor_whose_reader_goes_away_ends_0() {
    janitor_with_closed_streams(&Sandbox::new());
}

/// What prints a document or a table on a full disk: no panic, the documented code (1 and
/// "failed to write to stdout" for a listing; clap's 0 for `--help`).
#[rstest]
#[case::runs_json(&["runs", "--json"], 1)]
#[case::locks_json(&["locks", "--json"], 1)]
#[case::janitor_json(&["janitor", "--json"], 1)]
#[case::config(&["config"], 1)]
#[case::help(&["--help"], 0)]
fn stdout_on_a_full_disk_is_no_panic(#[case] args: &[&str], #[case] code: i32) {
    let sandbox = Sandbox::new();
    // A run to list, and a runs dir for `runs`.
    let mut first = run_cmd(&sandbox, "listed", false, false, "exit 0");
    first
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    assert!(first.status().unwrap().success());
    let done = with_streams(&sandbox, args, full_disk(), Stdio::piped());
    assert_quiet_end(args, &done, code);
    if code == 1 {
        let err = String::from_utf8_lossy(&done.stderr);
        assert!(err.contains("failed to write to stdout"), "{args:?}: {err}");
    }
}

/// A run whose stderr, or stdout, or both are on a full disk (`-vv` and JSON logs: every line
/// fails) ends with the code its run.json records.
#[rstest]
#[case::stderr(false, true, false)]
#[case::stderr_json(false, true, true)]
#[case::stdout(true, false, false)]
#[case::both(true, true, false)]
fn a_run_on_a_full_disk_ends_with_its_recorded_code(
    #[case] full_out: bool,
    #[case] full_err: bool,
    #[case] json: bool,
) {
    let sandbox = Sandbox::new();
    let mut cmd = run_cmd(
        &sandbox,
        "closed",
        true,
        json,
        "trap '' PIPE; echo out; echo err >&2; exit 7",
    );
    let stream = |full| if full { full_disk() } else { Stdio::piped() };
    cmd.stdin(Stdio::null())
        .stdout(stream(full_out))
        .stderr(stream(full_err));
    let done = cmd.output().unwrap();
    assert_quiet_end(&["run"], &done, 7);
    assert_eq!(sandbox.record("closed")["exit_code"], 7);
}

#[cfg(feature = "etcd")]
mod etcd {
    use super::*;
    use crate::etcd_cluster::Cluster;

    /// A sandbox keeping its locks in `cluster`, with leases of `ttl` seconds.
    fn host(cluster: &Cluster, ttl: u32) -> Sandbox {
        let mut sandbox = Sandbox::new();
        sandbox.set_etcd(cluster.endpoints(), ttl);
        sandbox
    }

    #[track_caller]
    fn etcdctl(cluster: &Cluster, args: &[&str]) {
        let out = cluster.etcdctl(args);
        assert!(out.status.success(), "etcdctl {args:?}: {out:?}");
    }

    /// The owner key of the app lock of the run "closed" in `sandbox`.
    fn app_owner(sandbox: &Sandbox) -> String {
        let record = sandbox.record("closed");
        let domain = record["domain"].as_str().expect("a domain");
        format!("/ccci-run/app/{domain}/owner")
    }

    /// The issue this guards: a lock lost with nobody reading stderr ended with 101 (a panic
    /// on a WARN line) while run.json said 76. The owner key deleted by hand, and etcd gone
    /// silent (every member stopped) until the lease is lost; text and JSON logs.
    #[test]
    fn a_lost_lock_whose_reader_goes_away_ends_76() {
        let Some(cluster) = crate::util::etcd_cluster() else {
            return;
        };
        let lose_app = |sandbox: &Sandbox| etcdctl(&cluster, &["del", &app_owner(sandbox)]);
        let lose_named = |_: &Sandbox| etcdctl(&cluster, &["del", "/ccci-run/named/shared/owner"]);
        for json in [false, true] {
            for closed in [Stream::Err, Stream::Out] {
                run_through(&host(&cluster, 7), Phase::LockLost, closed, json, &lose_app);
                lock_through(
                    &host(&cluster, 7),
                    Phase::LockLost,
                    closed,
                    json,
                    &lose_named,
                );
            }
        }
        let silence = |_: &Sandbox| cluster.signal_all(Signal::SIGSTOP);
        for json in [false, true] {
            run_through(
                &host(&cluster, 4),
                Phase::LockLost,
                Stream::Err,
                json,
                &silence,
            );
            cluster.signal_all(Signal::SIGCONT);
            lock_through(
                &host(&cluster, 4),
                Phase::LockLost,
                Stream::Err,
                json,
                &silence,
            );
            cluster.signal_all(Signal::SIGCONT);
        }
    }

    /// Waiting, running and tearing down on etcd, each with stderr and then stdout closed.
    #[test]
    fn runs_and_locks_on_etcd_whose_reader_goes_away_end_with_their_codes() {
        let Some(cluster) = crate::util::etcd_cluster() else {
            return;
        };
        for phase in [Phase::Waiting, Phase::Running, Phase::Teardown] {
            for closed in [Stream::Err, Stream::Out] {
                run_through(&host(&cluster, 7), phase, closed, false, &no_loss);
                lock_through(&host(&cluster, 7), phase, closed, false, &no_loss);
            }
        }
    }

    #[test]
    fn a_janitor_on_etcd_whose_reader_goes_away_ends_0() {
        let Some(cluster) = crate::util::etcd_cluster() else {
            return;
        };
        janitor_with_closed_streams(&host(&cluster, 7));
    }
}
