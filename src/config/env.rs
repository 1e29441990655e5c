//! The one reader of the environment. Every variable ccci-run reads — its settings' own
//! (`CCCI_*`), the engine's (`DOCKER_HOST`, `DOCKER_TLS_VERIFY`, `DOCKER_CERT_PATH`,
//! `DOCKER_TLS`), `HOME`, `PATH`, `NO_COLOR`, and what a run hands down to its command — is read
//! here: `clippy.toml` refuses `std::env::var`, `var_os`, `vars` and `vars_os` anywhere else, so a
//! setting read from the environment is found from this file.

use std::ffi::OsString;

/// `name`'s value, when it is set and valid Unicode (`std::env::var`).
pub(crate) fn var(name: &str) -> Result<String, std::env::VarError> {
    #[allow(clippy::disallowed_methods)]
    std::env::var(name)
}

/// `name`'s value as the environment holds it, Unicode or not (`std::env::var_os`).
pub(crate) fn var_os(name: &str) -> Option<OsString> {
    #[allow(clippy::disallowed_methods)]
    std::env::var_os(name)
}

/// `name`'s value when it is set, valid Unicode and not empty: how most settings read it.
pub(crate) fn non_empty(name: &str) -> Option<String> {
    var(name).ok().filter(|v| !v.is_empty())
}

/// Whether `NO_COLOR` asks for no colour (set and not empty, as no-color.org says).
pub(crate) fn no_color() -> bool {
    var_os("NO_COLOR").is_some_and(|v| !v.is_empty())
}

/// The whole environment, as a run hands it down to its command.
pub(crate) fn all() -> Vec<(OsString, OsString)> {
    #[allow(clippy::disallowed_methods)]
    std::env::vars_os().collect()
}
