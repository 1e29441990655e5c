//! What the kernel's text files say (`/proc`'s: a process's stat, status and environ, the
//! mounts, the locks; a cgroup's events), parsed into values: pure functions over the text, so
//! each is fuzzed and table-tested apart from the primitives that read the files.
//!
//! Floor: mechanisms (docs/architecture.md): imports the ground and the mechanisms, nothing above.

/// Field 22 (`starttime`) of a `/proc/<pid>/stat` line; the fields are counted after the last `)`.
/// The kernel shows it in clock ticks since boot as the *reader's* time namespace sees boot:
/// [`crate::supervise::identity`] takes that offset out before comparing.
pub(crate) fn parse_start_time(text: &str) -> Option<u64> {
    let (_, tail) = text.rsplit_once(')')?;
    tail.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// The inode of the initial pid namespace, the one every other is nested in: a fixed number
/// since Linux 3.8 (`PROC_PID_INIT_INO`).
pub(crate) const INIT_PID_NAMESPACE: u64 = 0xEFFF_FFFC;

/// The `NSpid:` line of a `/proc/<pid>/status`: the process's pid in every pid namespace from
/// the one `/proc` was mounted for down to its own (the last one).
pub(crate) fn parse_nspid(status: &str) -> Option<Vec<i32>> {
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    let pids: Option<Vec<i32>> = line
        .split_ascii_whitespace()
        .map(|p| p.parse().ok())
        .collect();
    pids.filter(|p| !p.is_empty())
}

/// The boottime offset of a time namespace, in nanoseconds, from its `timens_offsets` text
/// (`boottime <secs> <nanosecs>`).
pub(crate) fn parse_boottime_offset(text: &str) -> Option<i128> {
    text.lines().find_map(|line| {
        let mut fields = line.split_ascii_whitespace();
        // Kernels before 5.7 print the clock's number (7) instead of its name.
        if !matches!(fields.next()?, "boottime" | "7") {
            return None;
        }
        let secs: i128 = fields.next()?.parse().ok()?;
        let nanos: i128 = fields.next()?.parse().ok()?;
        Some(secs * 1_000_000_000 + nanos)
    })
}

/// The `hidepid=` option `/proc` is mounted with (from a mountinfo text), unless it hides
/// nothing: then `/proc` may hide other users' processes from a process without privileges.
pub(crate) fn proc_hidepid(mountinfo: &str) -> Option<String> {
    mountinfo.lines().find_map(|line| {
        let (head, tail) = line.split_once(" - ")?;
        if head.split_ascii_whitespace().nth(4)? != "/proc" {
            return None;
        }
        let mut tail = tail.split_ascii_whitespace();
        if tail.next()? != "proc" {
            return None;
        }
        let options = tail.nth(1)?;
        let hidepid = options
            .split(',')
            .find_map(|o| o.strip_prefix("hidepid="))?;
        (!matches!(hidepid, "0" | "off"))
            .then(|| format!("/proc is mounted with hidepid={hidepid}"))
    })
}

/// The four user ids (real, effective, saved, filesystem) of a `/proc/<pid>/status`.
pub(crate) fn parse_uids(status: &str) -> Option<[u32; 4]> {
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    let mut ids = line.split_ascii_whitespace().map(str::parse::<u32>);
    let mut out = [0; 4];
    for slot in &mut out {
        *slot = ids.next()?.ok()?;
    }
    Some(out)
}

/// The mount point of the unified (cgroup v2) hierarchy, from `/proc/self/mountinfo`.
pub(crate) fn cgroup2_mount(mountinfo: &str) -> Option<std::path::PathBuf> {
    mountinfo.lines().find_map(|line| {
        // `<id> <parent> <maj:min> <root> <mount point> <options> [optional...] - <fstype> ...`
        let (head, tail) = line.split_once(" - ")?;
        if tail.split_ascii_whitespace().next()? != "cgroup2" {
            return None;
        }
        let mount = head.split_ascii_whitespace().nth(4)?;
        Some(std::path::PathBuf::from(unescape_mountinfo(mount)))
    })
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            let digits = std::str::from_utf8(&bytes[i + 1..i + 4]).ok();
            if let Some(n) = digits.and_then(|d| u8::from_str_radix(d, 8).ok()) {
                out.push(n);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// This process's path in the unified hierarchy: the `0::<path>` line of `/proc/self/cgroup`.
pub(crate) fn cgroup2_path(proc_cgroup: &str) -> Option<String> {
    proc_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim_end_matches(" (deleted)").to_owned())
}

/// `populated` from a `cgroup.events` file.
pub(crate) fn cgroup_populated(events: &str) -> Option<bool> {
    events
        .lines()
        .find_map(|l| match l.strip_prefix("populated ")? {
            "0" => Some(false),
            "1" => Some(true),
            _ => None,
        })
}

/// Look `key` up in a NUL-separated `KEY=value` block.
pub(crate) fn environ_lookup<'a>(data: &'a [u8], key: &str) -> Option<&'a [u8]> {
    data.split(|b| *b == 0).find_map(|entry| {
        entry
            .strip_prefix(key.as_bytes())
            .and_then(|rest| rest.strip_prefix(b"="))
    })
}

/// One line of `/proc/locks`: a flock held (or waited for) on an inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcLock {
    pub pid: i32,
    pub major: u32,
    pub minor: u32,
    pub inode: u64,
    /// A process blocked waiting for the lock (`->` lines), not a holder.
    pub waiting: bool,
}

/// Parse one `/proc/locks` line such as `3: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF`
/// (device numbers in hex, the inode in decimal). Only flocks are returned.
pub(crate) fn parse_proc_lock(line: &str) -> Option<ProcLock> {
    let mut fields = line.split_ascii_whitespace();
    fields.next()?.strip_suffix(':')?;
    let mut kind = fields.next()?;
    let waiting = kind == "->";
    if waiting {
        kind = fields.next()?;
    }
    if kind != "FLOCK" {
        return None;
    }
    let _advisory = fields.next()?;
    let _mode = fields.next()?;
    let pid = fields.next()?.parse().ok()?;
    let mut id = fields.next()?.split(':');
    let major = u32::from_str_radix(id.next()?, 16).ok()?;
    let minor = u32::from_str_radix(id.next()?, 16).ok()?;
    let inode = id.next()?.parse().ok()?;
    Some(ProcLock {
        pid,
        major,
        minor,
        inode,
        waiting,
    })
}

/// The major number of a device id, as `/proc/locks` prints it.
pub(crate) fn dev_major(dev: u64) -> u32 {
    nix::sys::stat::major(dev) as u32
}

/// The minor number of a device id, as `/proc/locks` prints it.
pub(crate) fn dev_minor(dev: u64) -> u32 {
    nix::sys::stat::minor(dev) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case("1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF", Some((1234, 8, 1, 5678, false)))]
    #[case("2: -> FLOCK  ADVISORY  WRITE 99 fd:0a:12 0 EOF", Some((99, 0xfd, 0x0a, 12, true)))]
    #[case("3: POSIX  ADVISORY  WRITE 1 08:01:5 0 EOF", None)]
    #[case("4: OFDLCK ADVISORY  READ  -1 00:05:2 0 EOF", None)]
    #[case("garbage", None)]
    #[case("5: FLOCK ADVISORY WRITE x 08:01:5 0 EOF", None)]
    fn proc_locks_lines(#[case] line: &str, #[case] want: Option<(i32, u32, u32, u64, bool)>) {
        let got = parse_proc_lock(line).map(|l| (l.pid, l.major, l.minor, l.inode, l.waiting));
        assert_eq!(got, want);
    }
}
