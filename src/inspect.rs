//! The commands that look and change nothing: `app-domain` (the names a run would use),
//! `config` (each setting and where it came from) and `locks` (every lock, held or not).
//!
//! Floor: commands (docs/architecture.md): imports the floors below, never another command.

use std::path::Path;

use crate::config::{self, Global, Identity, Resolved};
use crate::error::{Error, emit};
use crate::names;
use crate::{exit, lock, recipe, report};

/// `ccci-run app-domain`: the domain and stack of `identity`, and with a recipe checkout
/// (`names_in`), the longest domain suffix its names allow and every name over a limit.
pub(crate) fn app_domain(
    identity: &Identity,
    names_in: Option<&Path>,
    global: &Global,
) -> Result<u8, Error> {
    let mut text = format!("{}\n{}\n", identity.domain, identity.domain.stack_name());
    let mut code = 0;
    if let Some(dir) = names_in {
        let stack = identity.domain.stack_name();
        let names = recipe::object_names(dir, &stack, identity.domain.as_str()).map_err(|e| {
            Error::Invalid(names::NameError {
                what: "--names-in",
                value: dir.display().to_string(),
                rule: e.to_string(),
            })
        })?;
        text.push_str(&format!(
            "longest domain suffix: {} (this one: {})\n",
            recipe::longest_suffix(&names, &identity.domain),
            global.suffix.as_str().len()
        ));
        for n in names.iter().filter(|n| n.over()) {
            text.push_str(&format!(
                "over: {}{}\n",
                recipe::over_limit_line(n),
                if n.deployed { "" } else { " (optional file)" }
            ));
            code = code.max(if n.deployed { exit::FAILURE } else { 0 });
        }
    }
    emit(text.as_bytes())?;
    if code != 0 {
        report::failure(
            "ccci-run: error: app-domain: a name the recipe deploys is over Docker's \
                     limit with this domain (the `over:` lines)",
            "app-domain",
            code,
        );
    }
    Ok(code)
}

/// `ccci-run config`: each setting with where it came from.
pub(crate) fn config(json: bool, resolved: &Resolved) -> Result<u8, Error> {
    let text = if json {
        let settings = Settings {
            settings: &resolved.settings,
        };
        format!(
            "{}\n",
            crate::report::json(&report::Envelope::new(&settings, Vec::new()))
        )
    } else {
        // Columns as wide as the longest key (and value, up to 40), so every line lines up.
        let keys = resolved
            .settings
            .iter()
            .map(|s| s.key.len())
            .max()
            .unwrap_or(0);
        let values = resolved
            .settings
            .iter()
            .map(|s| s.value.chars().count())
            .filter(|&n| n <= 40)
            .max()
            .unwrap_or(0);
        resolved
            .settings
            .iter()
            .map(|s| format!("{:<keys$} {:<values$} {}\n", s.key, s.value, s.origin))
            .collect::<String>()
    };
    let text = if json {
        text
    } else {
        names::visible_text(&text)
    };
    emit(text.as_bytes()).map(|()| 0)
}

/// `ccci-run locks`: every lock file, held or not.
pub(crate) fn locks(json: bool, wide: bool, global: &Global) -> Result<u8, Error> {
    let long_held = global.timings.value(config::Timing::LongHeld);
    let backend = lock::backend(global).map_err(Error::from)?;
    let mut errors = Vec::new();
    if let Some(missing) = backend.missing_store() {
        report::line(&format!("ccci-run: warning: {missing}"));
        errors.push(missing.to_string());
    }
    let locks = match backend.list(long_held) {
        Ok(locks) => locks,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(source) => {
            // The etcd backend's own error names its endpoints already: said once.
            return Err(match source.downcast::<lock::LockError>() {
                Ok(err) => Error::from(err),
                Err(source) => Error::LockDir {
                    store: backend.describe_store(),
                    source,
                },
            });
        }
    };
    let text = if json {
        let locks = Locks { locks: &locks };
        format!(
            "{}\n",
            crate::report::json(&report::Envelope::new(&locks, errors))
        )
    } else {
        names::visible_text(&lock::list::render_table(&locks, wide))
    };
    emit(text.as_bytes()).map(|()| 0)
}

/// `config --json`: the settings, in the envelope.
#[derive(serde::Serialize)]
struct Settings<'a> {
    settings: &'a [config::Setting],
}

/// `locks --json`: every lock, in the envelope.
#[derive(serde::Serialize)]
struct Locks<'a> {
    locks: &'a [lock::backend::LockInfo],
}
