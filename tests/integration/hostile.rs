//! Every file ccci-run reads or writes on a shared host, met as it may be: another
//! configuration's, planted by another process of the same user.

use crate::util::{Proc, Sandbox, list, run};

/// Two configurations share one state dir (`/tmp` is every configuration's default), and Drone
/// build numbers make their run ids collide. Configuration B's janitor sweeps and runs — each
/// with a start-of-run sweep, one with A's very run id — never remove A's live run's state
/// files: the scope in their names says whose they are. B's own files go with B's runs.
#[test]
fn another_configuration_never_removes_a_live_run_s_state_files() {
    let a = Sandbox::new();
    let b = Sandbox::new();
    std::fs::remove_dir(b.state()).unwrap();
    std::os::unix::fs::symlink(a.state(), b.state()).unwrap();
    let script = "printf important > \"$CCCI_DEPLOYS_FILE\"; echo ready $$; read line || :";
    let mut live = Proc::spawn(a.run_sh("7", &["--pr", "1"], script));
    live.wait_ready();
    let files = list(&a.state());
    assert_eq!(files.len(), 4, "{files:?}");
    let deploys = files
        .iter()
        .find(|f| f.starts_with("ccci-deploys-"))
        .map(|f| a.state().join(f))
        .unwrap();

    let (_, done) = b.janitor(&[]);
    done.assert_code(0);
    for run_id in ["7", "8"] {
        run(b.run_sh(run_id, &["--pr", "2"], "test -n \"$CCCI_DEPLOYS_FILE\"")).assert_code(0);
    }
    let (_, done) = b.janitor(&[]);
    done.assert_code(0);
    assert_eq!(
        std::fs::read_to_string(&deploys).ok().as_deref(),
        Some("important"),
        "configuration B removed or changed A's live run's file"
    );
    assert_eq!(list(&a.state()), files, "A's state files changed");

    live.close_stdin();
    live.finish().assert_code(0);
    assert!(list(&a.state()).is_empty(), "{:?}", list(&a.state()));
}
