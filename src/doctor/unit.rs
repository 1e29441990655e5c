//! The runner's systemd unit as `doctor` judges it: its `Delegate`, `KillMode`,
//! `TimeoutStopSec` and the `PATH` its steps see, read from systemd (`systemctl show`) or from
//! a unit file and its drop-ins, parsed here without I/O.
//!
//! Invariant: a setting the unit does not make has systemd's default (`Delegate=no`,
//! `KillMode=control-group`, `TimeoutStopSec=90s`, the service manager's `PATH`), never "fine";
//! the last assignment wins, and an empty one resets to the default, as systemd reads them.

use std::path::Path;
use std::time::Duration;

/// systemd's `DefaultTimeoutStopSec`.
pub(crate) const DEFAULT_TIMEOUT_STOP: Duration = Duration::from_secs(90);
/// The `PATH` systemd gives a service that sets none.
pub(crate) const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin";
/// How long `systemctl show` may take.
const SYSTEMCTL_TIMEOUT: Duration = Duration::from_secs(5);

/// The runner unit's settings that matter to runs, as text (systemd's spelling).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct UnitSettings {
    pub delegate: Option<String>,
    pub kill_mode: Option<String>,
    pub timeout_stop: Option<String>,
    /// `PATH` from `Environment=`.
    pub path: Option<String>,
    /// `User=`: the runner's user (none: root).
    pub user: Option<String>,
    /// Every variable of `Environment=`, in the order set (a later one wins).
    pub environment: Vec<(String, String)>,
    /// `EnvironmentFile=`: each file, and whether a missing one is fine (`-path`).
    pub environment_files: Vec<(String, bool)>,
    /// `ExecStart=`'s words: the runner's own configuration file is its argument after `daemon`.
    pub exec_start: Vec<String>,
}

impl UnitSettings {
    /// Read `[Service]` assignments from one unit file's text, over what is already known (a
    /// drop-in is read after its unit, in name order).
    pub(crate) fn apply_file(&mut self, text: &str) {
        let mut section = String::new();
        for line in logical_lines(text) {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
                continue;
            }
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = name.to_owned();
                continue;
            }
            if section != "Service" {
                continue;
            }
            let Some((key, value)) = line.split_once('=') else {
                continue;
            };
            self.assign(key.trim(), value.trim());
        }
    }

    /// Read `systemctl show` output (`Key=value` lines).
    pub(crate) fn from_show(text: &str) -> Self {
        let mut settings = Self::default();
        for line in text.lines() {
            let Some((key, value)) = line.split_once('=') else {
                continue;
            };
            match key {
                "Delegate" => settings.delegate = Some(value.to_owned()),
                "KillMode" => settings.kill_mode = Some(value.to_owned()),
                "TimeoutStopUSec" => settings.timeout_stop = Some(value.to_owned()),
                "User" => settings.user = (!value.is_empty()).then(|| value.to_owned()),
                "Environment" => {
                    settings.path = environment_path(value).or(settings.path);
                    settings.environment.extend(environment_words(value));
                }
                // `/path (ignore_errors=no)`, one per line in `systemctl show`'s output.
                "EnvironmentFiles" => {
                    if let Some((path, rest)) = value.split_once(" (") {
                        let optional = rest.contains("ignore_errors=yes");
                        settings.environment_files.push((path.to_owned(), optional));
                    }
                }
                // `{ path=… ; argv[]=/usr/bin/drone-runner-exec daemon FILE ; … }`.
                "ExecStart" => {
                    if let Some(argv) = value
                        .split(" ; ")
                        .find_map(|part| part.trim_start_matches("{ ").strip_prefix("argv[]="))
                    {
                        settings.exec_start = argv.split_whitespace().map(str::to_owned).collect();
                    }
                }
                _ => {}
            }
        }
        settings
    }

    fn assign(&mut self, key: &str, value: &str) {
        let set = |slot: &mut Option<String>| {
            *slot = (!value.is_empty()).then(|| value.to_owned());
        };
        match key {
            "Delegate" => set(&mut self.delegate),
            "KillMode" => set(&mut self.kill_mode),
            // TimeoutSec= sets the start and the stop timeout alike.
            "TimeoutStopSec" | "TimeoutSec" => set(&mut self.timeout_stop),
            "User" => set(&mut self.user),
            "Environment" if value.is_empty() => {
                self.path = None;
                self.environment.clear();
            }
            "Environment" => {
                self.path = environment_path(value).or(self.path.take());
                self.environment.extend(environment_words(value));
            }
            "EnvironmentFile" if value.is_empty() => self.environment_files.clear(),
            "EnvironmentFile" => match value.strip_prefix('-') {
                Some(path) => self.environment_files.push((path.to_owned(), true)),
                None => self.environment_files.push((value.to_owned(), false)),
            },
            "ExecStart" if value.is_empty() => self.exec_start.clear(),
            "ExecStart" => {
                self.exec_start = value
                    .trim_start_matches(['-', '@', ':', '+', '!'])
                    .split_whitespace()
                    .map(str::to_owned)
                    .collect();
            }
            _ => {}
        }
    }

    /// Whether the unit hands its cgroup subtree to the runner: `yes` (or a list of
    /// controllers, which delegates too).
    pub(crate) fn delegates(&self) -> bool {
        match self.delegate.as_deref().map(str::trim) {
            None | Some("") => false,
            Some(v) => !matches!(
                v.to_ascii_lowercase().as_str(),
                "no" | "false" | "off" | "0" | "n" | "f"
            ),
        }
    }

    pub(crate) fn kill_mode(&self) -> &str {
        self.kill_mode.as_deref().unwrap_or("control-group")
    }

    /// The stop timeout: `Ok(None)` for `infinity`, `Err` for a value that does not parse.
    pub(crate) fn timeout_stop(&self) -> Result<Option<Duration>, String> {
        match self.timeout_stop.as_deref() {
            None => Ok(Some(DEFAULT_TIMEOUT_STOP)),
            Some(text) => parse_timespan(text),
        }
    }
}

/// Continuation lines (a trailing backslash) joined.
fn logical_lines(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        match line.strip_suffix('\\') {
            Some(head) => {
                current.push_str(head);
                current.push(' ');
            }
            None => {
                current.push_str(line);
                lines.push(std::mem::take(&mut current));
            }
        }
    }
    if !current.is_empty() {
        lines.push(current);
    }
    lines
}

/// The space-separated (optionally double-quoted) assignments of `Environment=`.
fn environment_words(value: &str) -> Vec<(String, String)> {
    let mut word = String::new();
    let mut quoted = false;
    let mut words = Vec::new();
    for c in value.chars() {
        match c {
            '"' => quoted = !quoted,
            c if c.is_whitespace() && !quoted => words.push(std::mem::take(&mut word)),
            c => word.push(c),
        }
    }
    words.push(word);
    words
        .into_iter()
        .filter_map(|w| {
            let (k, v) = w.split_once('=')?;
            (!k.is_empty()).then(|| (k.to_owned(), v.to_owned()))
        })
        .collect()
}

/// Where the runner daemon reads its own configuration when its unit names none: what
/// `drone-runner-exec service install` writes into the unit it makes.
pub(crate) const RUNNER_CONFIG: &str = "/etc/drone-runner-exec/config";

/// A file of `KEY=value` lines as godotenv reads it (the runner's configuration file,
/// `DRONE_RUNNER_ENVFILE`) or systemd reads an `EnvironmentFile=`: comments, blank lines,
/// `export `, and single or double quotes around a value.
pub(crate) fn parse_env_file(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
                return None;
            }
            let line = line.strip_prefix("export ").unwrap_or(line);
            let (key, value) = line.split_once('=').or_else(|| line.split_once(':'))?;
            let value = value.trim();
            let value = value
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .or_else(|| value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')))
                .unwrap_or(value);
            Some((key.trim().to_owned(), value.to_owned()))
        })
        .collect()
}

/// `KEY:value,KEY:value` as the runner reads `DRONE_RUNNER_ENVIRON` (envconfig's map form).
pub(crate) fn parse_runner_environ(text: &str) -> Vec<(String, String)> {
    text.split(',')
        .filter_map(|pair| {
            let (k, v) = pair.split_once(':')?;
            let k = k.trim();
            (!k.is_empty()).then(|| (k.to_owned(), v.to_owned()))
        })
        .collect()
}

/// `PATH` among the space-separated (optionally double-quoted) assignments of `Environment=`.
fn environment_path(value: &str) -> Option<String> {
    let mut found = None;
    let mut word = String::new();
    let mut quoted = false;
    let mut words = Vec::new();
    for c in value.chars() {
        match c {
            '"' => quoted = !quoted,
            c if c.is_whitespace() && !quoted => words.push(std::mem::take(&mut word)),
            c => word.push(c),
        }
    }
    words.push(word);
    for word in words {
        if let Some(path) = word.strip_prefix("PATH=") {
            found = Some(path.to_owned());
        }
    }
    found
}

/// A systemd time span: `infinity`, a bare number of seconds, or numbers with units
/// (`6min`, `1min 30s`, `500ms`, `2h`); `systemctl show` writes the same forms.
pub(crate) fn parse_timespan(text: &str) -> Result<Option<Duration>, String> {
    let text = text.trim();
    if text == "infinity" {
        return Ok(None);
    }
    if let Ok(secs) = text.parse::<f64>() {
        if secs.is_finite() && secs >= 0.0 {
            return Ok(Some(Duration::from_secs_f64(secs)));
        }
    }
    humantime::parse_duration(text)
        .map(Some)
        .map_err(|e| format!("{text:?} is not a systemd time span: {e}"))
}

/// What a unit file or drop-in may be: a link (systemd's own layout is full of them) to a
/// regular file far below this size.
const UNIT_RULES: crate::files::Rules = crate::files::Rules {
    max_len: 1 << 20,
    follow_links: true,
    owners: crate::files::Owners::Any,
};

/// The unit's settings from its file at `path` and the drop-ins of `<path>.d/*.conf`, each
/// read as [`crate::files`] reads (a FIFO or `/dev/zero` named as a unit file is refused).
pub(crate) fn read_file(path: &Path) -> Result<(UnitSettings, Vec<String>), String> {
    let text = crate::files::read_text(path, &UNIT_RULES)
        .map_err(|e| format!("failed to read unit file: {e}"))?;
    let mut settings = UnitSettings::default();
    settings.apply_file(&text);
    let mut read = vec![path.display().to_string()];
    let mut dropins_dir = path.as_os_str().to_owned();
    dropins_dir.push(".d");
    let mut dropins: Vec<_> = std::fs::read_dir(&dropins_dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "conf"))
        .collect();
    dropins.sort();
    for dropin in dropins {
        let text = crate::files::read_text(&dropin, &UNIT_RULES)
            .map_err(|e| format!("failed to read drop-in: {e}"))?;
        settings.apply_file(&text);
        read.push(dropin.display().to_string());
    }
    Ok((settings, read))
}

/// Whether systemd runs this host (`sd_booted`'s test).
pub(crate) fn systemd_running() -> bool {
    Path::new("/run/systemd/system").is_dir()
}

/// The loaded unit's settings as systemd has them, within [`SYSTEMCTL_TIMEOUT`].
pub(crate) fn show(unit: &str) -> Result<UnitSettings, String> {
    use std::io::Read;
    let mut child = std::process::Command::new("systemctl")
        .args([
            "show",
            unit,
            "--property=LoadState,Delegate,KillMode,TimeoutStopUSec,Environment,User,\
             EnvironmentFiles,ExecStart",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("failed to run systemctl show {unit}: {e}"))?;
    let mut stdout = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        let _ = tx.send(text);
    });
    let Ok(text) = rx.recv_timeout(SYSTEMCTL_TIMEOUT) else {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!(
            "systemctl show {unit} did not answer within {} s",
            SYSTEMCTL_TIMEOUT.as_secs()
        ));
    };
    let status = child
        .wait()
        .map_err(|e| format!("failed to wait for systemctl: {e}"))?;
    if !status.success() {
        return Err(format!("systemctl show {unit} failed ({status})"));
    }
    if let Some(state) = text.lines().find_map(|l| l.strip_prefix("LoadState=")) {
        if state != "loaded" {
            return Err(format!(
                "systemd has no unit {unit} (LoadState={state}); name it with --unit"
            ));
        }
    }
    Ok(UnitSettings::from_show(&text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[test]
    fn assignments_in_order_with_defaults_and_resets() {
        let mut s = UnitSettings::default();
        assert!(!s.delegates());
        assert_eq!(s.kill_mode(), "control-group");
        assert_eq!(s.timeout_stop(), Ok(Some(DEFAULT_TIMEOUT_STOP)));
        s.apply_file(
            "[Unit]\nDelegate=yes\n[Service]\nDelegate=yes\nKillMode=process\n\
             TimeoutSec=30\nEnvironment=\"A=b c\" PATH=/opt/bin:/usr/bin\n",
        );
        assert!(s.delegates());
        assert_eq!(s.kill_mode(), "process");
        assert_eq!(s.timeout_stop(), Ok(Some(Duration::from_secs(30))));
        assert_eq!(s.path.as_deref(), Some("/opt/bin:/usr/bin"));
        // A drop-in: a later assignment wins, an empty one resets.
        s.apply_file("[Service]\nKillMode=\nTimeoutStopSec=6min\nDelegate=no\n");
        assert_eq!(s.kill_mode(), "control-group");
        assert_eq!(s.timeout_stop(), Ok(Some(Duration::from_secs(360))));
        assert!(!s.delegates());
        s.apply_file("[Service]\nDelegate=cpu memory\nEnvironment=\n");
        assert!(s.delegates());
        assert_eq!(s.path, None);
    }

    #[test]
    fn systemctl_show_output_is_read() {
        let s = UnitSettings::from_show(
            "LoadState=loaded\nDelegate=yes\nKillMode=mixed\nTimeoutStopUSec=1min 30s\n\
             Environment=PATH=/usr/bin:/bin HOME=/root\n",
        );
        assert!(s.delegates());
        assert_eq!(s.kill_mode(), "mixed");
        assert_eq!(s.timeout_stop(), Ok(Some(Duration::from_secs(90))));
        assert_eq!(s.path.as_deref(), Some("/usr/bin:/bin"));
    }

    #[rstest]
    #[case("90", Some(90_000))]
    #[case("6min", Some(360_000))]
    #[case("1min 30s", Some(90_000))]
    #[case("500ms", Some(500))]
    #[case("2h", Some(7_200_000))]
    #[case("infinity", None)]
    fn time_spans(#[case] text: &str, #[case] millis: Option<u64>) {
        assert_eq!(
            parse_timespan(text),
            Ok(millis.map(Duration::from_millis)),
            "{text}"
        );
    }

    #[test]
    fn the_runner_s_environment_files_and_map_are_read_as_it_reads_them() {
        let env = parse_env_file("# c\n\nexport A=\"x y\"\nB='z'\nC=plain\n");
        assert_eq!(
            env,
            [("A", "x y"), ("B", "z"), ("C", "plain")]
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .to_vec()
        );
        let map = parse_runner_environ("A:1,B:two:three,,:x");
        assert_eq!(
            map,
            [("A", "1"), ("B", "two:three")]
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .to_vec()
        );
        let mut settings = UnitSettings::default();
        settings.apply_file(
            "[Service]\nEnvironment=\"A=1 2\" B=3\nEnvironmentFile=-/x\nExecStart=-/bin/r daemon /c\n",
        );
        assert_eq!(settings.environment.len(), 2);
        assert_eq!(settings.environment_files, vec![("/x".to_owned(), true)]);
        assert_eq!(settings.exec_start, vec!["/bin/r", "daemon", "/c"]);
        let shown = UnitSettings::from_show(
            "EnvironmentFiles=/etc/x (ignore_errors=no)\n\
             ExecStart={ path=/bin/r ; argv[]=/bin/r service run --config /c ; ignore_errors=no }\n",
        );
        assert_eq!(shown.environment_files, vec![("/etc/x".to_owned(), false)]);
        assert_eq!(
            shown.exec_start,
            vec!["/bin/r", "service", "run", "--config", "/c"]
        );
    }

    #[test]
    fn a_bad_time_span_is_an_error() {
        assert!(parse_timespan("soon").unwrap_err().contains("soon"));
        assert!(parse_timespan("-5").is_err());
    }
}
