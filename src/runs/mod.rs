//! The commands that look at runs from outside: `runs` (every run in the runs dir, with what
//! it holds: [`list`]) and `stop` (one live run torn down, once proven to be that run's:
//! [`stop`]). Neither imports `run`: a run's directory, record and phases are a floor below
//! ([`crate::rundir`]).
//!
//! Floor: commands (docs/architecture.md): imports the floors below, never another command.

pub(crate) mod list;
pub(crate) mod show;
pub(crate) mod stop;

use crate::config::{self, Global};
use crate::error::{Error, emit};
use crate::{lock, names};

/// What `runs`' command line asked for, validated.
#[derive(Debug)]
pub(crate) struct Asked {
    /// One run's id, to show it alone.
    pub run_id: Option<String>,
    pub all: bool,
    pub live: bool,
    pub json: bool,
    pub wide: bool,
}

/// `ccci-run runs`: every run in the runs dir, with what it holds.
pub(crate) fn command(args: &Asked, global: &Global) -> Result<u8, Error> {
    let one = args
        .run_id
        .as_deref()
        .map(names::RunId::parse)
        .transpose()?;
    let mut listing = list::list(
        &global.runs_dir,
        args.all || one.is_some(),
        std::time::SystemTime::now(),
    )
    .map_err(|source| Error::RunsDir {
        path: global.runs_dir.clone(),
        source,
    })?;
    let mut errors = std::mem::take(&mut listing.warnings);
    // The locks are listed only when a run holds or waits for one, or is dead: a look at the
    // store, never a take.
    if list::uses_locks(&listing) {
        let long_held = global.timings.value(config::Timing::LongHeld);
        match lock::backend(global).map(|b| b.list(long_held)) {
            Ok(Ok(locks)) => list::add_holders(&mut listing, &locks),
            Ok(Err(err)) => {
                errors.push(format!(
                    "failed to list the locks: {err}; holders not shown"
                ));
            }
            Err(err) => errors.push(format!("{err}; lock holders not shown")),
        }
    }
    if !args.json {
        for error in &errors {
            crate::report::line(&format!("ccci-run: warning: {error}"));
        }
    }
    if let Some(id) = one {
        let Some(found) = listing.runs.iter().find(|r| r.run_id == id.as_str()) else {
            return Err(Error::NoSuchRun {
                run_id: id.as_str().to_owned(),
                runs_dir: global.runs_dir.clone(),
            });
        };
        let text = if args.json {
            let one = OneRun {
                run: list::Whole {
                    run: found,
                    phases: &found.phases,
                    error: found.error.as_deref(),
                },
            };
            format!(
                "{}\n",
                crate::report::json(&crate::report::Envelope::new(&one, errors))
            )
        } else {
            show::render_one(found)
        };
        return emit(text.as_bytes()).map(|()| 0);
    }
    if args.live {
        list::only_live(&mut listing);
    }
    let text = if args.json {
        format!(
            "{}\n",
            crate::report::json(&crate::report::Envelope::new(&listing, errors))
        )
    } else {
        show::render_table(&listing.runs, args.wide)
    };
    emit(text.as_bytes()).map(|()| 0)
}

/// `runs RUN_ID --json`: the run, in the envelope.
#[derive(serde::Serialize)]
struct OneRun<'a> {
    run: list::Whole<'a>,
}
