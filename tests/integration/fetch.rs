//! Step 3, the recipe fetch: local repositories made with git(1), no network.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::sys::signal::Signal;

use crate::util::{Proc, Sandbox, Stream, list, run, signal};

/// Run git in `dir`; panics with its output when it fails.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_AUTHOR_NAME", "ci")
        .env("GIT_AUTHOR_EMAIL", "ci@example.org")
        .env("GIT_COMMITTER_NAME", "ci")
        .env("GIT_COMMITTER_EMAIL", "ci@example.org")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// A recipe repository: `main` (tagged `1.0.0+1.2.3`), a `feature` branch, and a pull request
/// head `refs/pull/7/head` on a branch of its own.
struct Origin {
    path: PathBuf,
    main: String,
    feature: String,
    pr: String,
}

fn origin(root: &Path) -> Origin {
    let path = root.join("origin");
    std::fs::create_dir_all(&path).unwrap();
    git(&path, &["init", "-q", "-b", "main"]);
    let commit = |file: &str| {
        std::fs::write(path.join(file), file).unwrap();
        git(&path, &["add", file]);
        git(&path, &["commit", "-q", "-m", file]);
        git(&path, &["rev-parse", "HEAD"])
    };
    let main = commit("compose.yml");
    git(&path, &["tag", "1.0.0+1.2.3"]);
    git(&path, &["checkout", "-q", "-b", "feature"]);
    let feature = commit("feature.txt");
    git(&path, &["checkout", "-q", "-b", "pr-branch", &main]);
    let pr = commit("pr.txt");
    git(&path, &["update-ref", "refs/pull/7/head", &pr]);
    git(&path, &["checkout", "-q", "main"]);
    Origin {
        path,
        main,
        feature,
        pr,
    }
}

/// `ccci-run run` of custom-html fetching from `url`; options and the command follow.
fn fetch_cmd(sandbox: &Sandbox, run_id: &str, url: &str) -> Command {
    let mut cmd = sandbox.ccci();
    cmd.args([
        "run",
        "--recipe",
        "custom-html",
        "--run-id",
        run_id,
        "--recipe-url",
        url,
    ]);
    cmd
}

/// `ccci-run run` fetching from `url`, its command printing the checked-out commit.
fn fetch_run(sandbox: &Sandbox, run_id: &str, url: &str, extra: &[&str]) -> crate::util::Finished {
    let mut cmd = fetch_cmd(sandbox, run_id, url);
    cmd.args(extra).args([
        "--",
        "sh",
        "-c",
        "git -C \"$CCCI_RECIPE_DIR\" rev-parse HEAD",
    ]);
    run(cmd)
}

fn recipes(sandbox: &Sandbox, run_id: &str) -> Vec<String> {
    list(&sandbox.runs().join(run_id).join("abra/recipes"))
}

#[test]
fn pr_head_branch_tag_and_commit_are_checked_out() {
    let sandbox = Sandbox::new();
    let o = origin(sandbox.path());
    let url = o.path.to_str().unwrap().to_owned();
    let file_url = format!("file://{url}");
    let short = &o.feature[..10];
    for (id, url, extra, want) in [
        ("pr", &url, vec!["--pr", "7"], &o.pr),
        ("branch", &url, vec!["--ref", "feature"], &o.feature),
        ("tag", &url, vec!["--ref", "1.0.0+1.2.3"], &o.main),
        ("commit", &url, vec!["--ref", short], &o.feature),
        ("default", &file_url, vec![], &o.main),
        ("both", &url, vec!["--pr", "7", "--ref", "pr-branch"], &o.pr),
    ] {
        let done = fetch_run(&sandbox, id, url, &extra);
        done.assert_code(0);
        assert_eq!(done.out, vec![want.clone()], "{id}\n{}", done.transcript());
        assert_eq!(sandbox.record(id)["commit"], want.as_str());
        assert_eq!(recipes(&sandbox, id), ["custom-html"], "{id}");
    }
}

#[test]
fn failed_fetches_are_125_and_leave_no_half_written_tree() {
    let sandbox = Sandbox::new();
    let o = origin(sandbox.path());
    let url = o.path.to_str().unwrap();
    let corrupt = sandbox.path().join("corrupt");
    std::fs::create_dir_all(corrupt.join(".git")).unwrap();
    std::fs::write(corrupt.join(".git/HEAD"), "garbage\n").unwrap();
    let missing = sandbox.path().join("missing");
    for (id, url, extra, message) in [
        (
            "mismatch",
            url,
            vec!["--pr", "7", "--ref", "main"],
            "but the ref resolves to",
        ),
        ("nopr", url, vec!["--pr", "99"], "has no refs/pull/99/head"),
        (
            "noref",
            url,
            vec!["--ref", "no-such-branch"],
            "no branch, tag or commit no-such-branch",
        ),
        (
            "missing",
            missing.to_str().unwrap(),
            vec![],
            "failed to fetch",
        ),
        (
            "corrupt",
            corrupt.to_str().unwrap(),
            vec![],
            "failed to fetch",
        ),
    ] {
        let done = fetch_run(&sandbox, id, url, &extra);
        done.assert_code(125);
        done.assert_stderr_has(message);
        assert!(
            recipes(&sandbox, id).is_empty(),
            "{id}: {:?}",
            recipes(&sandbox, id)
        );
        assert!(done.out.is_empty(), "the command ran after a failed fetch");
        assert!(
            sandbox.record(id)["error"]
                .as_str()
                .unwrap()
                .contains(message)
        );
    }
}

#[test]
fn credentials_never_reach_output_or_the_record() {
    let sandbox = Sandbox::new();
    let url = "https://alice:hunter2@127.0.0.1:1/recipe.git";
    let done = fetch_run(&sandbox, "creds", url, &[]);
    done.assert_code(125);
    done.assert_stderr_has("https://***@127.0.0.1:1/recipe.git");
    let everything = format!(
        "{}\n{}\n{}",
        done.out.join("\n"),
        done.stderr(),
        std::fs::read_to_string(sandbox.runs().join("creds/run.json")).unwrap()
    );
    assert!(!everything.contains("hunter2"), "{everything}");
    assert!(!everything.contains("alice"), "{everything}");
}

/// A server that accepts the connection and never answers: SIGTERM must still end the run now.
#[test]
fn sigterm_ends_a_hanging_fetch() {
    let sandbox = Sandbox::new();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/recipe.git", listener.local_addr().unwrap());
    let mut cmd = fetch_cmd(&sandbox, "hang", &url);
    cmd.args(["--", "echo", "must-not-run"]);
    let mut hung = Proc::spawn(cmd);
    // Readiness: the fetch has connected and waits for an answer that never comes.
    let (_connection, _) = listener.accept().unwrap();
    signal(hung.pid(), Signal::SIGTERM);
    hung.wait_for(Stream::Err, "== SIGTERM received — tearing down ==");
    let done = hung.finish();
    done.assert_code(143);
    assert!(done.out.is_empty());
    assert!(
        recipes(&sandbox, "hang").is_empty(),
        "{:?}",
        recipes(&sandbox, "hang")
    );
}

/// CCCI_SKIP_FETCH=1 copies the staged clone: two live runs each check out another commit in
/// their own tree, and neither the canonical clone nor the other run's tree moves.
#[test]
fn skip_fetch_copies_in_isolation() {
    let sandbox = Sandbox::new();
    let o = origin(sandbox.path());
    let canonical = sandbox.abra_home().join("recipes/custom-html");
    std::fs::create_dir_all(canonical.parent().unwrap()).unwrap();
    git(
        sandbox.path(),
        &[
            "clone",
            "-q",
            o.path.to_str().unwrap(),
            canonical.to_str().unwrap(),
        ],
    );
    std::fs::write(canonical.join("staged-change.txt"), "uncommitted\n").unwrap();
    let script = "test -f \"$CCCI_RECIPE_DIR/staged-change.txt\" || exit 9; \
                  git -C \"$CCCI_RECIPE_DIR\" checkout -q \"$WANT\" && echo ready $$; read line || :; \
                  git -C \"$CCCI_RECIPE_DIR\" rev-parse HEAD";
    let start = |id: &str, pr: &str, want: &str| {
        let mut cmd = sandbox.run_sh(id, &["--pr", pr], script);
        cmd.env("CCCI_SKIP_FETCH", "1").env("WANT", want);
        // run_sh passes --no-fetch; this run copies instead.
        let args: Vec<_> = cmd
            .get_args()
            .filter(|a| *a != "--no-fetch")
            .map(|a| a.to_owned())
            .collect();
        let mut copy = Command::new(cmd.get_program());
        copy.args(args);
        for (k, v) in cmd.get_envs() {
            match v {
                Some(v) => copy.env(k, v),
                None => copy.env_remove(k),
            };
        }
        Proc::spawn(copy)
    };
    let mut a = start("a", "1", &o.feature);
    let mut b = start("b", "2", &o.pr);
    a.wait_ready();
    b.wait_ready();
    assert_eq!(git(&canonical, &["rev-parse", "HEAD"]), o.main);
    a.close_stdin();
    b.close_stdin();
    let (a, b) = (a.finish(), b.finish());
    a.assert_code(0);
    b.assert_code(0);
    assert_eq!(a.out.last().unwrap(), &o.feature);
    assert_eq!(b.out.last().unwrap(), &o.pr);
    assert_eq!(
        git(&canonical, &["rev-parse", "HEAD"]),
        o.main,
        "the canonical clone moved"
    );
    assert_eq!(
        git(&canonical, &["status", "--porcelain"]),
        "?? staged-change.txt"
    );
}

/// Tokens outside the user information — in a query string, a fragment, or scp-style
/// `user:secret@host:path` — never reach a message, the record or a `-vvv` log either.
#[rstest::rstest]
#[case::query("https://127.0.0.1:1/recipe.git?token=SECRETQUERY", "SECRETQUERY")]
#[case::fragment("https://u:p4ss@127.0.0.1:1/recipe.git#SECRETFRAG", "SECRETFRAG")]
#[case::scp("user:SECRETSCP@127.0.0.1:recipe.git", "SECRETSCP")]
fn tokens_outside_the_userinfo_are_redacted_everywhere(#[case] url: &str, #[case] secret: &str) {
    let sandbox = Sandbox::new();
    let done = fetch_run(&sandbox, "tok", url, &["-vvv"]);
    done.assert_code(125);
    let everything = format!(
        "{}\n{}\n{}",
        done.out.join("\n"),
        done.stderr(),
        std::fs::read_to_string(sandbox.runs().join("tok/run.json")).unwrap()
    );
    assert!(!everything.contains(secret), "{everything}");
    assert!(
        everything.contains("***"),
        "the redacted URL is still shown: {everything}"
    );
}
