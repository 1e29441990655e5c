//! The names of ccci-run's own files, directories and cgroups, and their parts read back.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

use crate::names::validated::{NAMED_LOCK_PREFIX, NAMED_LOCK_SUFFIX, QUEUE_SUFFIX, Recipe, RunId};

/// An abra directory's parts: its servers' `.env` files, the recipe catalogue (both shared with
/// the canonical abra home), and the recipes (the run's own).
pub(crate) const ABRA_SERVERS: &str = "servers";
pub(crate) const ABRA_CATALOGUE: &str = "catalogue";
pub(crate) const ABRA_RECIPES: &str = "recipes";
/// A run's own abra directory in its run directory.
pub(crate) const RUN_ABRA_DIR: &str = "abra";
/// The sequence counter in a named lock's queue directory.
pub(crate) const QUEUE_COUNTER_FILE: &str = ".seq";
/// The last fencing token given to a holder, in a named lock's queue directory.
pub(crate) const FENCING_COUNTER_FILE: &str = ".fencing";
/// Beside a named lock's file (`ccci-<NAME>.lock.last-wait`): how long its last holder waited
/// for it, in seconds.
pub(crate) const LAST_WAIT_SUFFIX: &str = ".last-wait";

/// `<abra>/recipes/<recipe>`.
pub(crate) fn recipe_dir(abra: &std::path::Path, recipe: &Recipe) -> std::path::PathBuf {
    abra.join(ABRA_RECIPES).join(recipe.as_str())
}

/// A run's guard lock in its run directory: held for the run's whole life.
pub(crate) const RUN_GUARD_FILE: &str = "run.lock";
/// A run's record in its run directory.
pub(crate) const RUN_RECORD_FILE: &str = "run.json";
/// What `ccci-run stop` leaves in a run directory for the run's supervisor: who asks.
pub(crate) const RUN_STOP_FILE: &str = "stop.json";
/// The directory in the runs dir that holds each live run's domain lock.
pub(crate) const DOMAINS_DIR: &str = ".domains";

/// The state dir when none is configured, in the runs dir: the runs' user's own.
pub(crate) const STATE_DIR: &str = ".state";

/// `<runs-dir>/.state`: the default state dir.
pub(crate) fn state_dir_of(runs_dir: &std::path::Path) -> std::path::PathBuf {
    runs_dir.join(STATE_DIR)
}

/// `<runs-dir>/.domains`.
pub(crate) fn domains_dir(runs_dir: &std::path::Path) -> std::path::PathBuf {
    runs_dir.join(DOMAINS_DIR)
}

/// The named lock a lock file name stands for (raw bytes: names come from outside).
pub(crate) fn named_lock_of_file(file_name: &[u8]) -> Option<&[u8]> {
    file_name
        .strip_prefix(NAMED_LOCK_PREFIX.as_bytes())?
        .strip_suffix(NAMED_LOCK_SUFFIX.as_bytes())
}

/// The queue directory of a named lock file's path.
pub(crate) fn queue_dir_of(lock_file: &std::path::Path) -> std::path::PathBuf {
    let mut dir = lock_file.as_os_str().to_owned();
    dir.push(QUEUE_SUFFIX);
    std::path::PathBuf::from(dir)
}

/// A state file: `ccci-<kind>-<scope>-<run-id>-<pid>`. The scope (`c<dev>.<ino>` of the runs
/// dir) names the configuration the run belongs to: configurations that share a state dir
/// (`/tmp` is every configuration's default) tell their files apart by it, never by run id.
pub(crate) fn state_file_name(kind: &str, scope: &str, run_id: &RunId, pid: u32) -> String {
    format!("ccci-{kind}-{scope}-{run_id}-{pid}")
}

/// The kinds of state file, with the environment variable each one is exported as.
pub(crate) const STATE_FILES: [(&str, &str); 4] = [
    ("deploys", "CCCI_DEPLOYS_FILE"),
    ("opstate", "CCCI_OPSTATE_FILE"),
    ("deps", "CCCI_DEPS_FILE"),
    ("depskip", "CCCI_DEPSKIP_FILE"),
];

/// The configuration scope, run id and pid a state file name
/// (`ccci-<kind>-<scope>-<run-id>-<pid>`) belongs to. A name without a scope (as runs before
/// scopes wrote them) is nobody's we can judge.
pub(crate) fn parse_state_file_name(name: &str) -> Option<(&str, RunId, u32)> {
    let rest = name.strip_prefix("ccci-")?;
    let rest = STATE_FILES
        .iter()
        .find_map(|(kind, _)| rest.strip_prefix(kind)?.strip_prefix('-'))?;
    let (scope, rest) = rest.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let (dev, ino) = scope.strip_prefix('c')?.split_once('.')?;
    if !digits(dev) || !digits(ino) {
        return None;
    }
    let (run_id, pid) = rest.rsplit_once('-')?;
    if !digits(pid) {
        return None;
    }
    Some((scope, RunId::parse(run_id).ok()?, pid.parse().ok()?))
}

/// Prefix of every cgroup this tool creates.
pub(crate) const CGROUP_PREFIX: &str = "ccci-";
/// The leaf the supervised command runs in.
pub(crate) const COMMAND_LEAF: &str = "command";
/// The leaf the teardown hook runs in.
pub(crate) const HOOK_LEAF: &str = "hook";

/// The name of a supervisor's cgroup: `ccci-<kind>-<label>-<owner>`, where the owner
/// (`<pid>-<start>-<pidns>-c<dev>.<ino>`, [`crate::supervise::identity::Owner`]) names the
/// supervisor and its configuration.
pub(crate) fn cgroup_name(kind: &str, label: &str, owner: &str) -> String {
    format!("{CGROUP_PREFIX}{kind}-{label}-{owner}")
}

/// The run id in the name of a run's cgroup (`ccci-run-<run id>-<owner>`), unparsed.
pub(crate) fn run_of_cgroup(name: &str) -> Option<&str> {
    let owner = cgroup_owner(name)?;
    name.strip_prefix(CGROUP_PREFIX)?
        .strip_prefix("run-")?
        .strip_suffix(owner)?
        .strip_suffix('-')
}

/// The owner part of a cgroup name of ours (its last four `-`-separated fields), unparsed.
pub(crate) fn cgroup_owner(name: &str) -> Option<&str> {
    let rest = name.strip_prefix(CGROUP_PREFIX)?;
    let mut cut = rest.len();
    for _ in 0..4 {
        cut = rest[..cut].rfind('-')?;
    }
    // `<kind>-<label>` stays before the owner.
    rest[..cut].contains('-').then(|| &rest[cut + 1..])
}
