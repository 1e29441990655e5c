//! The run apps a sweep looks at: each domain found on disk or in Docker, with where it was
//! seen, and the scan of the abra home's `.env` files that finds them on disk.
//!
//! Floor: commands (docs/architecture.md): imports the floors below, never another command.

use std::collections::{BTreeMap, BTreeSet};

use crate::config::Global;
use crate::docker::StackResources;
use crate::janitor::sweep_report::{Source, SweepReport};
use crate::names::AppDomain;

/// A run app found on disk (or, later, in Docker).
#[derive(Debug, Clone)]
pub(crate) struct Candidate {
    pub domain: AppDomain,
    pub sources: BTreeSet<Source>,
    /// Its Docker resources, when Docker discovery found any.
    pub docker: Option<StackResources>,
}

impl Candidate {
    /// The candidate of `domain` in `found`, a new one (no source yet) if it is not there.
    pub(crate) fn of(
        found: &mut BTreeMap<AppDomain, Candidate>,
        domain: AppDomain,
    ) -> &mut Candidate {
        found.entry(domain.clone()).or_insert_with(|| Candidate {
            domain,
            sources: BTreeSet::new(),
            docker: None,
        })
    }
}

/// Run-app domains from `<abra-home>/servers/*/<domain>.env`, filtered by `RUN_APP_RE`.
/// Unreadable server directories are reported, odd names skipped; a linked server directory is
/// followed only as [`crate::app::server_dirs`] allows, and one that is not is named.
pub(crate) fn discover_env(
    global: &Global,
    report: &mut SweepReport,
) -> BTreeMap<AppDomain, Candidate> {
    let mut found = BTreeMap::new();
    let servers = global.abra_home.join(crate::names::ABRA_SERVERS);
    report
        .scanned
        .push(format!(".env files {}/*/*.env", servers.display()));
    let dirs = match crate::app::server_dirs(&global.abra_home) {
        Ok(Some((dirs, refused))) => {
            report.warnings.extend(refused);
            dirs
        }
        Ok(None) => {
            report.warnings.push(format!(
                "{} does not exist (--abra-home, CCCI_ABRA_HOME): no .env file was scanned",
                servers.display()
            ));
            return found;
        }
        Err(err) => {
            report.errors.push(err.to_string());
            return found;
        }
    };
    let errors = &mut report.errors;
    for server in dirs {
        let files = match std::fs::read_dir(&server.dir) {
            Ok(files) => files,
            Err(err) => {
                errors.push(format!("failed to list {}: {err}", server.named.display()));
                continue;
            }
        };
        for file in files.flatten() {
            if !file
                .file_type()
                .is_ok_and(|t| t.is_file() || t.is_symlink())
            {
                continue;
            }
            let name = file.file_name();
            if let Some(domain) = name
                .to_str()
                .and_then(|n| global.pattern.domain_of_env_file(n))
            {
                Candidate::of(&mut found, domain)
                    .sources
                    .insert(Source::Env);
            }
        }
    }
    found
}
