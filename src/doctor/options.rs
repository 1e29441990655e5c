//! What `doctor` is told beyond the global settings.
//!
//! Floor: commands (docs/architecture.md): imports the floors below, never another command.

use std::path::PathBuf;

/// What `doctor` is told beyond the global settings.
#[derive(Debug, Clone, Default)]
pub(crate) struct Options {
    /// The runner's systemd unit, asked of systemd.
    pub unit: Option<String>,
    /// The runner's unit file (with its `<file>.d/*.conf` drop-ins), read instead.
    pub unit_file: Option<PathBuf>,
}
