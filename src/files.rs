//! One way to read a file ccci-run did not just write itself, and one way to write a file that
//! others read ([`write_atomically`]). A file ccci-run did not just write itself is a record,
//! a stop request, a ticket, a holder line, a metrics file, a unit file. On a shared host any of
//! them may be something else than the small regular file it names: a FIFO (an open for reading
//! blocks until a writer comes, for ever), a link to `/dev/zero` (a read never ends), a huge
//! sparse file (a read takes the memory), or a link to a file of someone else's.
//!
//! Invariant: a file is opened without blocking and without following a link in its last
//! component (unless [`Rules::follow_links`] says links are expected there), judged by the
//! opened descriptor — a regular file, of an owner [`Rules::owners`] accepts, no larger than
//! [`Rules::max_len`] — and only then read, to at most that many bytes. Anything else is a
//! [`ReadError`] that names the path and what it is; the caller skips the item, never the
//! whole job.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Whose file may be believed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owners {
    /// Anyone's: what it says is checked by its reader (a pid against the process, a holder
    /// against the lock).
    Any,
    /// Ours or root's only.
    UsOrRoot,
    /// Ours, the runner's user's (`runner`: when root and `runner_user` says so, as
    /// `crate::trust` decides), or root's only.
    Trusted { runner: Option<u32> },
}

/// What a file must be to be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rules {
    /// The most bytes such a file holds; a larger one is refused unread.
    pub max_len: u64,
    /// Whether the last component may be a symbolic link (a unit file under /etc/systemd).
    pub follow_links: bool,
    pub owners: Owners,
}

impl Rules {
    /// A small file of anyone's, no link: up to `max_len` bytes.
    pub(crate) const fn small(max_len: u64) -> Self {
        Self {
            max_len,
            follow_links: false,
            owners: Owners::Any,
        }
    }

    /// The same, believed only of our own files or root's.
    pub(crate) const fn ours(self) -> Self {
        Self {
            owners: Owners::UsOrRoot,
            ..self
        }
    }

    /// The same, believed only of our files, the runner's user's (`runner`, which
    /// `crate::trust::runner` names) or root's.
    pub(crate) const fn trusted(self, runner: Option<u32>) -> Self {
        Self {
            owners: Owners::Trusted { runner },
            ..self
        }
    }
}

/// Why a file was not read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("refusing {path}: {why}")]
    Refused { path: PathBuf, why: String },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl ReadError {
    /// The file is not there (or a directory on its path is not): nothing to refuse.
    pub(crate) fn is_missing(&self) -> bool {
        matches!(self, ReadError::Open { source, .. } if source.kind() == io::ErrorKind::NotFound)
    }

    /// As an `io::Error`, for callers that speak io (its kind kept where there is one).
    pub(crate) fn into_io(self) -> io::Error {
        match self {
            ReadError::Open { source, .. } | ReadError::Read { source, .. }
                if source.kind() == io::ErrorKind::NotFound =>
            {
                source
            }
            other => io::Error::new(io::ErrorKind::InvalidData, other.to_string()),
        }
    }
}

/// What a file system object is, in words.
pub(crate) fn kind_name(kind: std::fs::FileType) -> &'static str {
    if kind.is_file() {
        "a regular file"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_symlink() {
        "a symbolic link"
    } else {
        "not a file"
    }
}

/// Open `path` for reading without blocking (a FIFO never hangs us) and, unless `follow_links`,
/// without following a link in its last component: the one way ccci-run opens a file it did not
/// just write. What the descriptor is, is the caller's to judge ([`open`] does, by [`Rules`]).
#[allow(clippy::disallowed_methods)]
pub(crate) fn open_nonblocking(path: &Path, follow_links: bool) -> io::Result<File> {
    let mut flags = nix::libc::O_NONBLOCK | nix::libc::O_NOCTTY | nix::libc::O_CLOEXEC;
    if !follow_links {
        flags |= nix::libc::O_NOFOLLOW;
    }
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
}

/// Whether an error of [`open_nonblocking`] says the last component is a symbolic link.
pub(crate) fn is_link_refused(err: &io::Error) -> bool {
    err.raw_os_error() == Some(nix::libc::ELOOP)
}

/// The bytes of an opened file, at most `max_len` of them: `None` when it holds more (it may
/// have grown since it was judged; a device may never end).
pub(crate) fn read_capped(file: File, max_len: u64) -> io::Result<Option<Vec<u8>>> {
    let mut bytes = Vec::new();
    file.take(max_len + 1).read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= max_len).then_some(bytes))
}

/// Open `path` for reading without blocking (and, unless the rules allow links, without
/// following one), and check the opened descriptor against `rules`.
pub(crate) fn open(path: &Path, rules: &Rules) -> Result<File, ReadError> {
    let file = open_nonblocking(path, rules.follow_links).map_err(|source| {
        // O_NOFOLLOW on a link fails with ELOOP: say what it is.
        if is_link_refused(&source) && !rules.follow_links {
            ReadError::Refused {
                path: path.to_owned(),
                why: "it is a symbolic link, where a file of its own is expected".to_owned(),
            }
        } else {
            ReadError::Open {
                path: path.to_owned(),
                source,
            }
        }
    })?;
    check(&file, path, rules)?;
    Ok(file)
}

/// Check an open descriptor against `rules`.
fn check(file: &File, path: &Path, rules: &Rules) -> Result<(), ReadError> {
    let refused = |why: String| ReadError::Refused {
        path: path.to_owned(),
        why,
    };
    let meta = file.metadata().map_err(|source| ReadError::Read {
        path: path.to_owned(),
        source,
    })?;
    let kind = meta.file_type();
    if !kind.is_file() {
        return Err(refused(format!(
            "it is {}, not a regular file",
            kind_name(kind)
        )));
    }
    if let Owners::Trusted { runner } = rules.owners {
        let us = nix::unistd::Uid::effective().as_raw();
        let uid = meta.uid();
        if uid != 0 && uid != us && runner != Some(uid) {
            let who = match runner {
                Some(r) => format!("us (uid {us}) or the runner's user (uid {r}, runner_user)"),
                None => format!("us (uid {us})"),
            };
            return Err(refused(format!(
                "it is owned by uid {uid}, neither {who} nor root"
            )));
        }
    }
    if rules.owners == Owners::UsOrRoot {
        let us = nix::unistd::Uid::effective().as_raw();
        if meta.uid() != us && meta.uid() != 0 {
            return Err(refused(format!(
                "it is owned by uid {}, neither us (uid {us}) nor root",
                meta.uid()
            )));
        }
    }
    if meta.len() > rules.max_len {
        return Err(refused(format!(
            "it is {} bytes long, more than the {} such a file can hold",
            meta.len(),
            rules.max_len
        )));
    }
    Ok(())
}

/// The bytes of the file at `path`, read as [`open`] allows.
pub(crate) fn read(path: &Path, rules: &Rules) -> Result<Vec<u8>, ReadError> {
    let file = open(path, rules)?;
    read_capped(file, rules.max_len)
        .map_err(|source| ReadError::Read {
            path: path.to_owned(),
            source,
        })?
        // It grew between the look and the read.
        .ok_or_else(|| ReadError::Refused {
            path: path.to_owned(),
            why: format!(
                "it holds more than the {} bytes such a file can",
                rules.max_len
            ),
        })
}

/// The text of the file at `path` (UTF-8), read as [`open`] allows.
pub(crate) fn read_text(path: &Path, rules: &Rules) -> Result<String, ReadError> {
    let bytes = read(path, rules)?;
    String::from_utf8(bytes).map_err(|err| ReadError::Refused {
        path: path.to_owned(),
        why: format!("it is not UTF-8 text: {err}"),
    })
}

/// The text of a file the kernel serves (`/proc`, a cgroup's interface files): what it says is
/// the kernel's, and it is never a FIFO, a device or a planted link. Read whole.
#[allow(clippy::disallowed_methods)]
pub(crate) fn kernel_text(path: impl AsRef<Path>) -> io::Result<String> {
    std::fs::read_to_string(path)
}

/// A file the kernel serves, opened for reading (to poll a cgroup's `cgroup.events`).
#[allow(clippy::disallowed_methods)]
pub(crate) fn kernel_file(path: impl AsRef<Path>) -> io::Result<File> {
    File::open(path)
}

/// The permissions of a file [`write_atomically`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// 0644 less the process's umask: a run's own records.
    Umasked,
    /// 0644 whatever the umask: a file that another user's process must read. The metrics are
    /// read by node_exporter under its own user, and the janitor's unit runs with UMask=0077.
    WorldReadable,
    /// Exactly these permission bits, whatever the umask: a file rewritten by another process
    /// than the one that made it (a janitor's note in a dead run's record) keeps its mode.
    Exactly(u32),
}

/// One way to write a file others read: replace `path` with `bytes` (and a newline) so that
/// readers see the old or the new contents, never a mix. The new contents go to a temp file
/// made beside it with `O_EXCL` under an unpredictable name (never a file or a link someone
/// else made there first, in a shared metrics dir or a run dir the run's command can write),
/// then renamed into place; on any failure the temp file is removed.
pub(crate) fn write_atomically(
    path: &Path,
    bytes: &[u8],
    sync: bool,
    mode: Mode,
) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map_or_else(|| "file".to_owned(), |n| n.to_string_lossy().into_owned());
    let mut file = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .permissions(std::fs::Permissions::from_mode(0o644))
        .tempfile_in(dir)?;
    // The umask applies to open(2) only: fchmod sets the mode itself, and before the rename,
    // so the name never shows a file its reader cannot open.
    match mode {
        Mode::Umasked => {}
        Mode::WorldReadable => file
            .as_file()
            .set_permissions(std::fs::Permissions::from_mode(0o644))?,
        Mode::Exactly(bits) => file
            .as_file()
            .set_permissions(std::fs::Permissions::from_mode(bits & 0o777))?,
    }
    file.write_all(bytes)?;
    file.write_all(b"\n")?;
    // When asked: the data reaches the disk before the name does, so a crash cannot leave a
    // torn record. The rename is not synced on its own: after a crash the previous phase's
    // record may come back, which a run's phases tolerate.
    if sync {
        file.as_file().sync_data()?;
    }
    file.persist(path).map(drop).map_err(|e| e.error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use std::time::{Duration, Instant};

    fn refused(result: Result<Vec<u8>, ReadError>) -> String {
        match result {
            Err(ReadError::Refused { why, .. }) => why,
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn a_fifo_a_device_link_and_a_huge_file_are_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let rules = Rules::small(4096);
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let started = Instant::now();
        assert!(refused(read(&fifo, &rules)).contains("a FIFO"));
        assert!(started.elapsed() < Duration::from_secs(5));

        let zero = dir.path().join("zero");
        symlink("/dev/zero", &zero).unwrap();
        assert!(refused(read(&zero, &rules)).contains("symbolic link"));
        let followed = Rules {
            follow_links: true,
            ..rules
        };
        assert!(refused(read(&zero, &followed)).contains("a character device"));

        let huge = dir.path().join("huge");
        File::create(&huge).unwrap().set_len(3 << 30).unwrap();
        assert!(refused(read(&huge, &rules)).contains("bytes long"));

        let fine = dir.path().join("fine");
        std::fs::write(&fine, "ok\n").unwrap();
        assert_eq!(read_text(&fine, &rules).unwrap(), "ok\n");
        assert!(
            read(&dir.path().join("missing"), &rules)
                .unwrap_err()
                .is_missing()
        );
    }

    #[test]
    fn another_owner_is_refused_when_only_ours_will_do() {
        if !nix::unistd::Uid::effective().is_root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let theirs = dir.path().join("theirs");
        std::fs::write(&theirs, "x").unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        let rules = Rules {
            owners: Owners::UsOrRoot,
            ..Rules::small(64)
        };
        assert!(refused(read(&theirs, &rules)).contains("uid 65534"));
        assert_eq!(read(&theirs, &Rules::small(64)).unwrap(), b"x");
    }

    #[test]
    fn an_atomic_write_replaces_a_planted_link_and_leaves_no_temp_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        let target = dir.path().join("ccci.prom");
        symlink(&victim, &target).unwrap();
        write_atomically(&target, b"metrics", false, Mode::WorldReadable).unwrap();
        assert_eq!(read_text(&victim, &Rules::small(64)).unwrap(), "keep");
        let meta = std::fs::symlink_metadata(&target).unwrap();
        assert!(meta.is_file());
        assert_eq!(meta.permissions().mode() & 0o777, 0o644);
        assert_eq!(read_text(&target, &Rules::small(64)).unwrap(), "metrics\n");
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["ccci.prom", "victim"]);
    }
}
