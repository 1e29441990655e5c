//! Reading the configuration file: it names the lock dir and the runs dir, so it is held to the
//! rules those directories are held to before a byte of it is believed.
//!
//! Invariant: a file is read only when nobody but us and root can have written what it says — a
//! regular file owned by us or root, writable by neither group nor others, in a directory
//! (the one named and, through symbolic links, the one it really is in) owned by us or root
//! that group and others cannot write to unless it is sticky. It is opened without blocking (a
//! FIFO never hangs us), judged by the opened descriptor (no swap between look and read), and
//! read to at most [`MAX_LEN`] bytes (a device never grows us without bound). In a directory
//! others may write to (sticky, as `/tmp`) the file is never followed through a symbolic link. The null device
//! reads as an empty file: `--config /dev/null` means "no settings from a file".
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

use std::io::{self};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::names::NameError;

/// The largest configuration file read: a real one is a few hundred bytes.
pub(crate) const MAX_LEN: u64 = 1 << 20;

/// Where the configuration file's path comes from, for messages.
const SETTING: &str = "--config, CCCI_CONFIG";

/// The null device's numbers (Linux `mem` major 1, minor 3).
const NULL_DEVICE: (u64, u64) = (1, 3);

fn refused(path: &Path, rule: String) -> NameError {
    NameError {
        what: "configuration file",
        value: path.display().to_string(),
        rule,
    }
}

/// The text of the configuration file at `path`, checked. `None` when it does not exist and
/// was not asked for (`required` is false for the default file).
pub(crate) fn read(path: &Path, required: bool) -> Result<Option<String>, NameError> {
    // In a directory others may write to (a sticky /tmp), whoever planted a link there would
    // choose what we read: the file must be there itself, never followed through a link.
    let shared_dir = directories(path)
        .first()
        .is_some_and(|dir| std::fs::metadata(dir).is_ok_and(|m| m.mode() & 0o022 != 0));
    let file = match crate::files::open_nonblocking(path, !shared_dir) {
        Ok(file) => file,
        Err(err) if !required && err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(err) if shared_dir && crate::files::is_link_refused(&err) => {
            return Err(refused(
                path,
                format!(
                    "it is a symbolic link in {}, a directory others may write to: whoever \
                     planted it would choose what we read ({SETTING})",
                    directories(path)[0].display()
                ),
            ));
        }
        Err(err) => {
            return Err(refused(path, format!("cannot be read ({SETTING}): {err}")));
        }
    };
    let meta = file
        .metadata()
        .map_err(|err| refused(path, format!("cannot be inspected ({SETTING}): {err}")))?;
    let kind = meta.file_type();
    if kind.is_char_device()
        && (
            nix::sys::stat::major(meta.rdev()),
            nix::sys::stat::minor(meta.rdev()),
        ) == NULL_DEVICE
    {
        return Ok(Some(String::new()));
    }
    if !kind.is_file() {
        return Err(refused(
            path,
            format!(
                "it is {}, not a regular file ({SETTING})",
                crate::files::kind_name(kind)
            ),
        ));
    }
    let us = nix::unistd::Uid::effective().as_raw();
    if meta.uid() != us && meta.uid() != 0 {
        return Err(refused(
            path,
            format!(
                "it is owned by uid {}, neither us (uid {us}) nor root: its owner could choose \
                 our lock and runs dirs ({SETTING})",
                meta.uid()
            ),
        ));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(refused(
            path,
            format!(
                "mode {mode:o} lets others rewrite it (writable by group or others), and with it \
                 our lock and runs dirs; chmod go-w it ({SETTING})"
            ),
        ));
    }
    for dir in directories(path) {
        check_directory(path, &dir, us)?;
    }
    let bytes = crate::files::read_capped(file, MAX_LEN)
        .map_err(|err| refused(path, format!("cannot be read ({SETTING}): {err}")))?
        .ok_or_else(|| {
            refused(
                path,
                format!(
                    "it is larger than {} KiB, more than a configuration file can be ({SETTING})",
                    MAX_LEN / 1024
                ),
            )
        })?;
    String::from_utf8(bytes)
        .map(Some)
        .map_err(|err| refused(path, format!("it is not UTF-8 text ({SETTING}): {err}")))
}

/// The directory the file is named in and, when links lead elsewhere, the one it really is in:
/// whoever can replace an entry in either can replace what we read.
fn directories(path: &Path) -> Vec<PathBuf> {
    let named = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
        _ => PathBuf::from("."),
    };
    let mut dirs = vec![named];
    if let Some(real) = std::fs::canonicalize(path)
        .ok()
        .and_then(|p| p.parent().map(Path::to_owned))
    {
        if std::fs::canonicalize(&dirs[0]).ok().as_ref() != Some(&real) {
            dirs.push(real);
        }
    }
    dirs
}

/// The lock dir's rules, for the directory holding the configuration file.
fn check_directory(path: &Path, dir: &Path, us: u32) -> Result<(), NameError> {
    let meta = std::fs::metadata(dir).map_err(|err| {
        refused(
            path,
            format!(
                "its directory {} cannot be inspected ({SETTING}): {err}",
                dir.display()
            ),
        )
    })?;
    if meta.uid() != us && meta.uid() != 0 {
        return Err(refused(
            path,
            format!(
                "its directory {} is owned by uid {}, neither us (uid {us}) nor root, who could \
                 replace the file ({SETTING})",
                dir.display(),
                meta.uid()
            ),
        ));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(refused(
            path,
            format!(
                "its directory {} has mode {mode:o}, which lets others replace the file \
                 (writable without the sticky bit) ({SETTING})",
                dir.display()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn chmod(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn the_rules_of_the_directories_hold_for_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.toml");
        std::fs::write(&file, "docker = \"off\"\n").unwrap();
        chmod(&file, 0o644);
        assert_eq!(
            read(&file, true).unwrap().as_deref(),
            Some("docker = \"off\"\n")
        );
        assert_eq!(read(&dir.path().join("missing"), false).unwrap(), None);
        assert!(read(&dir.path().join("missing"), true).is_err());
        assert_eq!(
            read(Path::new("/dev/null"), true).unwrap().as_deref(),
            Some("")
        );
        for (mode, why) in [
            (0o666, "mode 666"),
            (0o664, "mode 664"),
            (0o646, "mode 646"),
        ] {
            chmod(&file, mode);
            let err = read(&file, true).unwrap_err().to_string();
            assert!(err.contains(why) && err.contains("--config"), "{err}");
        }
        chmod(&file, 0o600);
        chmod(dir.path(), 0o777);
        let err = read(&file, true).unwrap_err().to_string();
        assert!(err.contains("has mode 777"), "{err}");
        chmod(dir.path(), 0o1777);
        assert!(read(&file, true).is_ok());
        chmod(dir.path(), 0o700);
        let err = read(dir.path(), true).unwrap_err().to_string();
        assert!(err.contains("it is a directory"), "{err}");
        let err = read(Path::new("/dev/zero"), true).unwrap_err().to_string();
        assert!(err.contains("a character device"), "{err}");
    }
}
