//! Step 3 of a run: the recipe into the run's own tree, `$ABRA_DIR/recipes/<recipe>`.
//!
//! A git2 clone from the recipe URL (https, a plain path or `file://`), then the PR head
//! (`refs/pull/<pr>/head`) or `--ref` checked out detached; or, with `CCCI_SKIP_FETCH=1`, a copy
//! of the staged canonical clone, which is never modified.
//!
//! Invariants: the destination appears whole or not at all (everything is built in a temporary
//! directory beside it and renamed into place); credentials in a URL never reach a message, a
//! log line or the run record ([`crate::recipe_url::redact`]).

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use git2::build::CheckoutBuilder;
use git2::{FetchOptions, Oid, RemoteCallbacks, Repository};

use crate::names::{GitRef, PrNumber};
use crate::recipe_url::{redact, scrub};
use crate::report;
use crate::supervise::worker::CancelFlag;

/// Progress is reported only for fetches that take longer than this, and at most this often.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// How long a silent server is waited for before libgit2 gives up by itself.
const SERVER_TIMEOUT_MS: i32 = 120_000;

/// What to put where.
#[derive(Debug, Clone)]
pub(crate) struct FetchSpec {
    pub url: String,
    pub pr: Option<PrNumber>,
    pub git_ref: Option<GitRef>,
    pub dest: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum FetchError {
    #[error("failed to fetch {url} ({what}): {message}")]
    Git {
        url: String,
        what: String,
        message: String,
    },
    #[error("failed to stage the recipe copy from {from}: {message}")]
    Copy { from: PathBuf, message: String },
    #[error("fetch of {url} was interrupted")]
    Cancelled { url: String },
    #[error("failed to start the fetch: {0}")]
    Start(io::Error),
}

/// Make libgit2 set up its TLS and global state now, on the main thread: it calls `setenv`
/// on first use, which is unsafe once other threads run.
pub(crate) fn init_git() {
    // SAFETY: a plain integer option, set before any other thread exists.
    unsafe {
        let _ = git2::opts::set_server_timeout_in_milliseconds(SERVER_TIMEOUT_MS);
        let _ = git2::opts::set_server_connect_timeout_in_milliseconds(30_000);
    }
}

/// A temporary directory beside `dest`, removed unless [`Staging::commit`] renames it into place.
struct Staging {
    tmp: PathBuf,
    dest: PathBuf,
}

impl Staging {
    fn new(dest: &Path) -> io::Result<Self> {
        let parent = dest.parent().unwrap_or(Path::new("."));
        let name = dest.file_name().map(|n| n.to_string_lossy().into_owned());
        let tmp = parent.join(format!(
            ".{}.partial-{}",
            name.as_deref().unwrap_or("recipe"),
            std::process::id()
        ));
        remove_all(&tmp)?;
        remove_all(dest)?;
        Ok(Self {
            tmp,
            dest: dest.to_owned(),
        })
    }

    fn commit(self) -> io::Result<()> {
        std::fs::rename(&self.tmp, &self.dest)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = remove_all(&self.tmp);
    }
}

fn remove_all(path: &Path) -> io::Result<()> {
    match std::fs::remove_dir_all(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
        _ => Ok(()),
    }
}

/// Clone `spec.url` into `spec.dest` and check out what the run asked for. Returns the commit.
pub(crate) fn fetch(spec: &FetchSpec, cancel: &CancelFlag) -> Result<Oid, FetchError> {
    let url = &spec.url;
    let shown = redact(url);
    let git_err = |what: &str, err: git2::Error| FetchError::Git {
        url: shown.clone(),
        what: what.to_owned(),
        message: scrub(err.message(), url),
    };
    let cancelled = || FetchError::Cancelled { url: shown.clone() };
    let io_err = |what: &str, err: io::Error| FetchError::Git {
        url: shown.clone(),
        what: what.to_owned(),
        message: err.to_string(),
    };
    let staging = Staging::new(&spec.dest).map_err(|e| io_err("prepare the destination", e))?;
    let repo = Repository::init(&staging.tmp).map_err(|e| git_err("create the clone", e))?;
    let mut remote = repo
        .remote("origin", url)
        .map_err(|e| git_err("add the remote", e))?;

    let mut refspecs = vec![
        "+refs/heads/*:refs/remotes/origin/*".to_owned(),
        "+refs/tags/*:refs/tags/*".to_owned(),
    ];
    if let Some(pr) = &spec.pr {
        refspecs.push(format!("+refs/pull/{pr}/head:refs/remotes/origin/pr/{pr}"));
    }

    let started = Instant::now();
    let mut last_report = started;
    let mut callbacks = RemoteCallbacks::new();
    callbacks.transfer_progress(|progress| {
        if cancel.is_cancelled() {
            return false;
        }
        let now = Instant::now();
        if now.duration_since(started) >= PROGRESS_EVERY
            && now.duration_since(last_report) >= PROGRESS_EVERY
        {
            last_report = now;
            report::line(&format!(
                "== fetching {shown}: {}/{} objects, {} KiB ==",
                progress.received_objects(),
                progress.total_objects(),
                progress.received_bytes() / 1024
            ));
        }
        true
    });
    let mut options = FetchOptions::new();
    options.remote_callbacks(callbacks);
    let fetched = remote.fetch(&refspecs, Some(&mut options), None);
    if cancel.is_cancelled() {
        return Err(cancelled());
    }
    fetched.map_err(|e| git_err("fetch", e))?;
    drop(remote);

    let target = resolve(&repo, spec).map_err(|message| FetchError::Git {
        url: shown.clone(),
        what: describe(spec),
        message,
    })?;
    repo.set_head_detached(target)
        .and_then(|()| repo.checkout_head(Some(CheckoutBuilder::new().force())))
        .map_err(|e| git_err("check out", e))?;
    drop(repo);
    staging
        .commit()
        .map_err(|e| io_err("move the clone into place", e))?;
    Ok(target)
}

/// "PR 12", "ref main", "PR 12 at ref abc", "the default branch".
fn describe(spec: &FetchSpec) -> String {
    match (&spec.pr, &spec.git_ref) {
        (Some(pr), Some(r)) => format!("PR {pr} at ref {r}"),
        (Some(pr), None) => format!("PR {pr}"),
        (None, Some(r)) => format!("ref {r}"),
        (None, None) => "the default branch".to_owned(),
    }
}

/// The commit to check out.
fn resolve(repo: &Repository, spec: &FetchSpec) -> Result<Oid, String> {
    let pr_head = match &spec.pr {
        Some(pr) => Some(
            commit_of(repo, &format!("refs/remotes/origin/pr/{pr}"))
                .ok_or_else(|| format!("the remote has no refs/pull/{pr}/head"))?,
        ),
        None => None,
    };
    let by_ref = match &spec.git_ref {
        Some(r) => Some(
            resolve_ref(repo, r.as_str())
                .ok_or_else(|| format!("no branch, tag or commit {r} in the remote"))?,
        ),
        None => None,
    };
    match (pr_head, by_ref) {
        (Some(head), Some(wanted)) if head != wanted => Err(format!(
            "the PR head is {head}, but the ref resolves to {wanted}"
        )),
        (Some(head), _) => Ok(head),
        (None, Some(wanted)) => Ok(wanted),
        (None, None) => default_branch(repo).ok_or_else(|| "the remote has no branches".to_owned()),
    }
}

fn commit_of(repo: &Repository, reference: &str) -> Option<Oid> {
    repo.find_reference(reference)
        .ok()?
        .peel_to_commit()
        .ok()
        .map(|c| c.id())
}

/// A branch, a tag, or a (possibly abbreviated) commit id.
fn resolve_ref(repo: &Repository, name: &str) -> Option<Oid> {
    let name = name.strip_prefix("refs/heads/").unwrap_or(name);
    commit_of(repo, &format!("refs/remotes/origin/{name}"))
        .or_else(|| {
            commit_of(
                repo,
                &format!("refs/tags/{}", name.trim_start_matches("refs/tags/")),
            )
        })
        .or_else(|| {
            let object = repo.revparse_single(name).ok()?;
            object.peel_to_commit().ok().map(|c| c.id())
        })
}

/// `main`, else `master`, else the only branch there is.
fn default_branch(repo: &Repository) -> Option<Oid> {
    ["main", "master"]
        .iter()
        .find_map(|b| commit_of(repo, &format!("refs/remotes/origin/{b}")))
        .or_else(|| {
            let mut refs = repo.references_glob("refs/remotes/origin/*").ok()?;
            refs.next()?.ok()?.peel_to_commit().ok().map(|c| c.id())
        })
}

/// `CCCI_SKIP_FETCH=1`: copy the staged canonical clone (with its `.git`) into the run's tree.
/// The source is only read.
pub(crate) fn copy_staged(from: &Path, dest: &Path) -> Result<(), FetchError> {
    let err = |message: String| FetchError::Copy {
        from: from.to_owned(),
        message,
    };
    if !from.join(".git").exists() {
        return Err(err("it is not a git checkout (no .git)".to_owned()));
    }
    let staging = Staging::new(dest).map_err(|e| err(e.to_string()))?;
    copy_tree(from, &staging.tmp).map_err(|e| err(e.to_string()))?;
    staging.commit().map_err(|e| err(e.to_string()))
}

/// Copy a directory tree: files with their permissions, symlinks as symlinks, nothing followed.
fn copy_tree(from: &Path, to: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new().create(to)?;
    std::fs::set_permissions(to, std::fs::metadata(from)?.permissions())?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        let kind = entry.file_type()?;
        if kind.is_dir() {
            copy_tree(&src, &dst)?;
        } else if kind.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&src)?, &dst)?;
        } else if kind.is_file() {
            std::fs::copy(&src, &dst)?;
        }
    }
    Ok(())
}
