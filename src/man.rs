//! Man pages: `ccci-run(1)` and one page per command (`ccci-run-run(1)`, ...), each with the
//! sections an operator looks for — SYNOPSIS, DESCRIPTION and OPTIONS from the command line's
//! own definition, then ENVIRONMENT, EXIT STATUS, FILES, EXAMPLES and SEE ALSO.
//!
//! Nothing here may change anything but the output it is asked for.
//!
//! Floor: entry (docs/architecture.md): the top floor, imported by nothing but the entry.

use std::io::{self, Write};

/// What a page adds to the command line's own help.
struct Extra {
    /// Variables read besides the options' own, with what they do.
    environment: &'static [(&'static str, &'static str)],
    files: &'static [(&'static str, &'static str)],
    examples: &'static [(&'static str, &'static str)],
}

/// Read by every command.
const COMMON_ENVIRONMENT: &[(&str, &str)] = &[
    (
        "NO_COLOR",
        "When set and not empty, diagnostics are never coloured (they are only on a terminal).",
    ),
    (
        "RUST_LOG",
        "A tracing filter that replaces the one -v and -q choose; status lines always show.",
    ),
];

const CONFIG_FILE: (&str, &str) = (
    "/etc/ccci-run/config.toml",
    "The configuration file read when neither --config nor CCCI_CONFIG names one. Like any \
     configuration file it is read only when it is a regular file (or /dev/null) of at most \
     1 MiB, owned by the user ccci-run runs as or by root, writable by neither group nor others, \
     in a directory owned by that user or root that group and others cannot write to unless it \
     is sticky; otherwise every command refuses it (exit 2).",
);

const DOCKER_HOST: (&str, &str) = (
    "DOCKER_HOST, DOCKER_TLS_VERIFY, DOCKER_CERT_PATH",
    "The Docker engine to use: unix:///PATH, or tcp://HOST[:PORT] (port 2375, or 2376 with TLS); \
     TLS when DOCKER_TLS_VERIFY is non-empty, with ca.pem, cert.pem and key.pem from \
     DOCKER_CERT_PATH (default ~/.docker). Unset or empty: unix:///var/run/docker.sock. Any \
     other value (ssh://, fd://, http://, DOCKER_TLS without DOCKER_TLS_VERIFY) is refused \
     with exit 2 unless --docker off.",
);

const EXIT_STATUS: &[(&str, &str)] = &[
    ("0", "Success; for run and lock, the command's own status."),
    (
        "1",
        "janitor: a reap failed or did not finish within its budget, or the sweep could not \
         complete; doctor: a check failed; locks, app-domain, config: the output could not be \
         written; runs: the runs dir could not be read; stop: no such live run (unknown, \
         finished, dead, or not to be judged from here), or it could not be signalled; \
         converge: the stack settled without converging (an update paused or rolled back) or \
         has no services.",
    ),
    ("2", "Invalid input: an option, a name, a duration."),
    (
        "75",
        "The app lock or the named lock was not acquired within its budget (lock: at once \
         with -n; -E CODE chooses another code); stop: the run still runs after --wait; \
         converge: the stack did not converge within --timeout.",
    ),
    (
        "76",
        "The lock was lost while held (etcd: its lease lost, its key deleted or replaced, the \
         cluster wiped or restored); after teardown.",
    ),
    (
        "125",
        "ccci-run itself failed: set-up, an unsafe path, Docker required but unreachable.",
    ),
    (
        "126, 127",
        "The command could not be executed, or was not found.",
    ),
    ("128+N", "The command was killed by signal N."),
    (
        "129, 130, 131, 143",
        "SIGHUP, SIGINT, SIGQUIT, SIGTERM reached ccci-run; after teardown. 143 also when the \
         parent or the --tie-to process died.",
    ),
    ("142", "The hard deadline passed; after teardown."),
];

fn extra(command: &str) -> Extra {
    match command {
        "run" => Extra {
            environment: &[
                (
                    "DRONE_BUILD_NUMBER",
                    "With DRONE_REPO, the run id when --run-id is not given: <owner>.<name>.<number>.",
                ),
                (
                    "DRONE_REPO",
                    "owner/name of the build's repository (else DRONE_REPO_OWNER and DRONE_REPO_NAME): in the default run id and the run's record.",
                ),
                (
                    "CCCI_SKIP_FETCH",
                    "1/true/yes/on: copy the staged recipe instead of cloning (as --skip-fetch).",
                ),
                (
                    "CCCI_RECIPE_URL_TEMPLATE",
                    "Where to clone from, with {recipe} filled in, when --recipe-url is not given \
                     (else the file's recipe_url_template).",
                ),
                (
                    "CCCI_NODE_SWEEP_IMAGE, CCCI_NODE_DOCKER_SOCKET",
                    "On a swarm of several nodes: the image (with a docker CLI) of the job that \
                     sweeps a stack off every node, and the path of each node's engine socket \
                     (else the file's node_sweep_image and node_docker_socket; default \
                     docker:27-cli and /var/run/docker.sock).",
                ),
                (
                    "CCCI_TIE_TO",
                    "Ancestors to tie the run to, comma-separated (as --tie-to).",
                ),
                (
                    "CCCI_DEADLINE, CCCI_LOCK_WAIT, CCCI_KILL_GRACE, CCCI_TEARDOWN_TIMEOUT",
                    "The run settings, as their flags; each also a key of the configuration file.",
                ),
                DOCKER_HOST,
                (
                    "ABRA_DIR, CCCI_RUN_ID, CCCI_RECIPE, CCCI_RECIPE_DIR, CCCI_APP_DOMAIN, \
                     CCCI_STACK_NAME, CCCI_DEPLOYS_FILE, CCCI_OPSTATE_FILE, CCCI_DEPS_FILE, \
                     CCCI_DEPSKIP_FILE",
                    "Set for COMMAND and the --on-teardown hook.",
                ),
                (
                    "CCCI_FENCING_TOKEN",
                    "Set for COMMAND and the hook when the app lock is kept in etcd: larger for \
                     every later holder of the domain on any host, also after the cluster is \
                     wiped or restored. A resource that checks it must refuse any token that is \
                     not larger than the largest it has accepted.",
                ),
            ],
            files: &[
                CONFIG_FILE,
                (
                    "<runs-dir>/<run-id>/run.json",
                    "The run record: phases, shutdown reason, exit code.",
                ),
                ("<runs-dir>/<run-id>/abra/", "The run's own ABRA_DIR."),
                (
                    "<lock-dir>/cc-ci-app-<domain>.lock, <runs-dir>/.domains/cc-ci-app-<domain>.lock",
                    "The app lock and the domain's lock, held for the run's whole life.",
                ),
                (
                    "<state-dir>/ccci-<kind>-<run-id>-<pid>",
                    "The run's state files.",
                ),
            ],
            examples: &[
                (
                    "In a script a Drone exec step runs, tied to the step shell and the runner so \
                     that a cancel or the runner's death reaches the run (never in .drone.yml \
                     itself: the runner's substitution turns $$ into $):",
                    "CCCI_TIE_TO=$$,$PPID ccci-run run --recipe keycloak --pr 42 -- ./run-recipe-tests.sh",
                ),
                (
                    "A run on a scratch host, without Docker or network:",
                    "ccci-run --runs-dir /tmp/r --abra-home /tmp/a --lock-dir /tmp/l --docker off \
                     run --recipe custom-html --pr 1 --no-fetch -- sh -c 'echo $CCCI_APP_DOMAIN'",
                ),
            ],
        },
        "converge" => Extra {
            environment: &[
                (
                    "CCCI_STACK_NAME",
                    "The stack to wait for when no --stack, --domain or --recipe is given: inside \
                     `ccci-run run`, the run's own.",
                ),
                (
                    "CCCI_CONVERGE_TIMEOUT, CCCI_CONVERGE_STABLE",
                    "As --timeout and --stable; each also a key of the configuration file \
                     (converge_timeout, converge_stable).",
                ),
                DOCKER_HOST,
            ],
            files: &[CONFIG_FILE],
            examples: &[
                (
                    "In a run's script, after the deploy and before the tests:",
                    "abra app deploy \"$CCCI_APP_DOMAIN\" --no-input && ccci-run converge",
                ),
                (
                    "Any stack, as a report for a script (exit 0 converged, 75 not in time, 1 \
                     paused, rolled back or no such stack, 125 Docker unreachable):",
                    "ccci-run converge --stack myapp_example_com --timeout 90s --json",
                ),
            ],
        },
        "janitor" => Extra {
            environment: &[
                DOCKER_HOST,
                (
                    "CCCI_LONG_HELD, CCCI_REAP_BUDGET, CCCI_KEEP_RUNS",
                    "The sweep's settings, as their flags; each also a key of the configuration file.",
                ),
            ],
            files: &[
                CONFIG_FILE,
                (
                    "<abra-home>/servers/*/*.env",
                    "Where run apps are found (and, unless --docker off, in Docker).",
                ),
                (
                    "<lock-dir>/cc-ci-app-<domain>.lock",
                    "The app locks it probes.",
                ),
            ],
            examples: &[
                (
                    "What would be reaped, changing nothing:",
                    "ccci-run janitor --dry-run",
                ),
                (
                    "From a timer, with metrics for node_exporter:",
                    "ccci-run janitor --json --metrics-file /var/lib/node_exporter/ccci.prom",
                ),
            ],
        },
        "lock" => Extra {
            environment: &[
                (
                    "CCCI_HELD_LOCKS",
                    "Set for COMMAND: the locks it runs under, so a nested lock of the same name \
                     is granted instead of waiting for itself.",
                ),
                ("CCCI_RUN_ID", "Recorded as the holder's run, when set."),
                (
                    "CCCI_FENCING_TOKEN",
                    "Set for COMMAND: larger for every later holder of the lock (etcd: the \
                     lineage's base plus the owner key's create revision; one host: the \
                     counter in the queue directory, at least the clock in microseconds).",
                ),
            ],
            files: &[
                CONFIG_FILE,
                (
                    "<lock-dir>/ccci-<NAME>.lock, <lock-dir>/ccci-<NAME>.lock.queue/",
                    "The lock file and its ticket queue, with the fencing token counter .fencing.",
                ),
                (
                    "<lock-dir>/ccci-<NAME>.lock.last-wait",
                    "How long the last holder waited, in seconds, for the metrics.",
                ),
            ],
            examples: &[
                (
                    "Regenerate the catalogue, one step at a time on this host:",
                    "ccci-run lock abra-catalogue --wait 600 -- abra catalogue generate",
                ),
                (
                    "As flock -n -E 9 would: skip the write-back (exit 9) when another step has it:",
                    "ccci-run lock cache -n -E 9 -- ./write-back.sh",
                ),
                (
                    "The same, publishing every named lock's queue and last wait, and the \
                     host's runs, for node_exporter once the lock is taken:",
                    "ccci-run lock abra-catalogue --metrics-file \
                     /var/lib/node_exporter/ccci-lock.prom -- abra catalogue generate",
                ),
            ],
        },
        "doctor" => Extra {
            environment: &[
                DOCKER_HOST,
                (
                    "CCCI_KILL_GRACE, CCCI_TEARDOWN_TIMEOUT",
                    "Their sum is what the runner unit's TimeoutStopSec must allow.",
                ),
            ],
            files: &[
                CONFIG_FILE,
                (
                    "/run/systemd/system",
                    "Where it is a directory, systemd runs the host and the runner unit is \
                     asked of it (systemctl show); elsewhere the unit checks are skipped \
                     unless --unit-file names the unit's file.",
                ),
                (
                    "/proc/sys/fs/inotify/max_user_instances, max_user_watches",
                    "The inotify limits the user's instances and watches are counted against.",
                ),
            ],
            examples: &[
                (
                    "Check this host, as the runner's user, against the shipped unit:",
                    "ccci-run doctor",
                ),
                (
                    "Check a unit file before installing it, as JSON:",
                    "ccci-run doctor --json --unit-file /etc/systemd/system/drone-runner-exec.service",
                ),
            ],
        },
        "locks" => Extra {
            environment: &[],
            files: &[CONFIG_FILE, ("<lock-dir>/", "The lock files listed.")],
            examples: &[("Every lock, as JSON:", "ccci-run locks --json")],
        },
        "runs" => Extra {
            environment: &[],
            files: &[
                CONFIG_FILE,
                (
                    "<runs-dir>/<run-id>/run.json",
                    "Each run's record, read (never written) for the listing.",
                ),
            ],
            examples: &[
                (
                    "What is running here, and what ended today:",
                    "ccci-run runs",
                ),
                (
                    "Every run ever recorded, as JSON:",
                    "ccci-run runs --all --json",
                ),
            ],
        },
        "stop" => Extra {
            environment: &[],
            files: &[
                CONFIG_FILE,
                (
                    "<runs-dir>/<run-id>/run.lock, <runs-dir>/<run-id>/run.json",
                    "The run's guard and record: the run is signalled only when its guard is \
                     held by the supervisor its unfinished record names, and that process's \
                     start time matches.",
                ),
                (
                    "<runs-dir>/<run-id>/stop.json",
                    "The request (uid, pid) written before the SIGTERM; the supervisor records \
                     `shutdown_reason: stopped` and `stopped_by` from it, and exits 143.",
                ),
            ],
            examples: &[
                ("Stop run 1234, waiting up to 30 s:", "ccci-run stop 1234"),
                (
                    "Stop it, and kill it if it is not gone within 2 minutes:",
                    "ccci-run stop 1234 --wait 2m --kill",
                ),
            ],
        },
        "app-domain" => Extra {
            environment: &[],
            files: &[CONFIG_FILE],
            examples: &[(
                "The domain and stack of PR 42 of keycloak:",
                "ccci-run app-domain --recipe keycloak --pr 42",
            )],
        },
        "config" => Extra {
            environment: &[],
            files: &[CONFIG_FILE],
            examples: &[("Where each setting comes from:", "ccci-run config")],
        },
        "completions" => Extra {
            environment: &[],
            files: &[],
            examples: &[(
                "Install bash completions:",
                "ccci-run completions bash > /etc/bash_completion.d/ccci-run",
            )],
        },
        "man" => Extra {
            environment: &[],
            files: &[],
            examples: &[(
                "Install every page:",
                "ccci-run man --dir /usr/local/share/man/man1",
            )],
        },
        _ => Extra {
            environment: &[],
            files: &[
                CONFIG_FILE,
                ("/run/lock/", "The default lock dir."),
                ("/var/lib/cc-ci-runs/", "The default runs dir."),
            ],
            examples: &[
                (
                    "A supervised run:",
                    "ccci-run run --recipe keycloak --pr 42 -- ./test.sh",
                ),
                ("A dry janitor sweep:", "ccci-run janitor --dry-run"),
            ],
        },
    }
}

/// Every page: `(file name, roff)`, the main page first.
pub(crate) fn pages(cmd: clap::Command) -> io::Result<Vec<(String, Vec<u8>)>> {
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    let mut pages = vec![page(&cmd, "", &cmd)?];
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        pages.push(page(sub, sub.get_name(), &cmd)?);
    }
    Ok(pages)
}

/// The page of `cmd` (`name` empty: the main page).
fn page(cmd: &clap::Command, name: &str, main: &clap::Command) -> io::Result<(String, Vec<u8>)> {
    let man = clap_mangen::Man::new(cmd.clone());
    let mut out = Vec::new();
    man.render_title(&mut out)?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;
    man.render_description_section(&mut out)?;
    if cmd.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(&mut out)?;
    }
    if cmd.has_subcommands() {
        man.render_subcommands_section(&mut out)?;
    }
    let extra = extra(name);
    let mut environment: Vec<(String, String)> = cmd
        .get_arguments()
        .filter_map(|a| {
            let var = a.get_env()?.to_string_lossy().into_owned();
            Some((var, format!("As --{}.", a.get_long()?)))
        })
        .collect();
    environment.extend(
        extra
            .environment
            .iter()
            .chain(COMMON_ENVIRONMENT)
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    section(&mut out, "ENVIRONMENT", &environment)?;
    let exit: Vec<(String, String)> = EXIT_STATUS
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    section(&mut out, "EXIT STATUS", &exit)?;
    let files: Vec<(String, String)> = extra
        .files
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    section(&mut out, "FILES", &files)?;
    examples(&mut out, extra.examples)?;
    see_also(&mut out, cmd, main)?;
    if cmd.get_version().is_some() {
        man.render_version_section(&mut out)?;
    }
    Ok((man.get_filename(), out))
}

/// Text for roff: a backslash is `\e`, a line never starts with a control character.
fn escape(text: &str) -> String {
    let text = text.replace('\\', "\\e").replace('-', "\\-");
    if text.starts_with(['.', '\'']) {
        format!("\\&{text}")
    } else {
        text
    }
}

/// A section of tagged paragraphs; nothing when there is nothing to say.
fn section(out: &mut dyn Write, title: &str, items: &[(String, String)]) -> io::Result<()> {
    if items.is_empty() {
        return Ok(());
    }
    writeln!(out, ".SH \"{title}\"")?;
    for (tag, text) in items {
        writeln!(out, ".TP\n\\fB{}\\fR\n{}", escape(tag), escape(text))?;
    }
    Ok(())
}

fn examples(out: &mut dyn Write, items: &[(&str, &str)]) -> io::Result<()> {
    if items.is_empty() {
        return Ok(());
    }
    writeln!(out, ".SH \"EXAMPLES\"")?;
    for (what, line) in items {
        writeln!(
            out,
            ".PP\n{}\n.PP\n.RS 4\n.nf\n{}\n.fi\n.RE",
            escape(what),
            escape(line)
        )?;
    }
    Ok(())
}

/// The other pages: the main page lists the commands' pages, a command's page the main one.
fn see_also(out: &mut dyn Write, cmd: &clap::Command, main: &clap::Command) -> io::Result<()> {
    let main_name = main.get_name();
    let pages: Vec<String> = if cmd.get_name() == main_name {
        main.get_subcommands()
            .filter(|s| !s.is_hide_set())
            .map(|s| {
                // `\%`: a page name is never hyphenated across lines (app-do-main(1)).
                format!(
                    "\\fB\\%{}\\fR(1)",
                    escape(&format!("{main_name}-{}", s.get_name()))
                )
            })
            .collect()
    } else {
        vec![format!("\\fB{}\\fR(1)", escape(main_name))]
    };
    writeln!(out, ".SH \"SEE ALSO\"\n{}", pages.join(", "))
}

/// `ccci-run man`: one page on stdout, or every page into a directory.
pub(crate) fn command(
    command: Option<&str>,
    dir: Option<&std::path::Path>,
) -> Result<u8, crate::error::Error> {
    let pages = pages(crate::cli::command()).map_err(crate::error::Error::Output)?;
    if let Some(dir) = dir {
        let written = std::fs::create_dir_all(dir).and_then(|()| {
            pages
                .iter()
                .try_for_each(|(name, page)| std::fs::write(dir.join(name), page))
        });
        written.map_err(|source| crate::error::Error::ManDir {
            path: dir.to_owned(),
            source,
        })?;
        let names: Vec<String> = pages.iter().map(|(name, _)| format!("{name}\n")).collect();
        return crate::error::emit(names.concat().as_bytes()).map(|()| 0);
    }
    let wanted = match command {
        None | Some("ccci-run") => "ccci-run.1".to_owned(),
        Some(command) => format!("ccci-run-{command}.1"),
    };
    match pages.iter().find(|(name, _)| *name == wanted) {
        Some((_, page)) => crate::error::emit(page).map(|()| 0),
        None => Err(crate::error::Error::Invalid(crate::names::NameError {
            what: "man page",
            value: command.unwrap_or_default().to_owned(),
            rule: "no such command; see ccci-run --help".to_owned(),
        })),
    }
}
