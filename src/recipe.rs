//! A recipe checkout as abra reads it: its `.env.sample` (the defaults every app's `.env`
//! starts from, `COMPOSE_FILE` and `TYPE`/`RECIPE` among them) and its compose files, read for
//! the names a deploy will give Docker's objects.
//!
//! Docker refuses a name over its limit at the object that has it, half-way through a deploy
//! (measured on engine 20.10: a service or an overlay network name at most 63 characters, a
//! secret or a config name at most 64, a volume name at most 255, the file system's). abra
//! names a stack after its domain, `.` → `_`, and cuts it at 45 characters. So a run checks,
//! before anything is deployed, every name the recipe's compose files give — in the files
//! `COMPOSE_FILE` names (`compose.yml` when it names none), with `.env.sample`'s values, the
//! versions `abra.sh` exports, and the run's `STACK_NAME` and `DOMAIN` filled in — and refuses the run (exit 2) naming the object,
//! its length, the limit and whose limit it is, and the longest domain suffix the recipe allows.
//! The other `compose.*.yml` files (optional, enabled by an app's `.env`) are checked too, and
//! what is over a limit there is a warning.
//!
//! Floor: backends (docs/architecture.md): imports the floors below and the other backends,
//! never a command.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use yaml_rust2::{Yaml, YamlLoader};

use crate::names::{AppDomain, MAX_STACK_NAME_LEN};

/// A compose file or `.env.sample` is a few KiB; anything past this is not one.
const FILE_RULES: crate::files::Rules = crate::files::Rules::small(1 << 20);

/// The kinds of object a stack deploy names, each with Docker's limit on the name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    Service,
    Network,
    Volume,
    Secret,
    Config,
}

impl Kind {
    /// Docker's limit on the name, as measured on engine 20.10.
    pub(crate) fn limit(self) -> usize {
        match self {
            Kind::Service | Kind::Network => 63,
            Kind::Secret | Kind::Config => 64,
            Kind::Volume => 255,
        }
    }

    pub(crate) fn noun(self) -> &'static str {
        match self {
            Kind::Service => "service",
            Kind::Network => "network",
            Kind::Volume => "volume",
            Kind::Secret => "secret",
            Kind::Config => "config",
        }
    }
}

/// One name a deploy will give Docker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ObjectName {
    pub kind: Kind,
    /// Its key in the compose file (`uploads_s3_secret_access_key`).
    pub key: String,
    /// The name Docker gets (`<stack>_uploads_s3_secret_access_key_v1`).
    pub name: String,
    /// The same with every version a `*_VERSION` variable fills in left open
    /// (`<stack>_uploads_s3_secret_access_key_{version}`): the name whatever version is bumped.
    pub form: String,
    /// The compose file, by its name in the recipe.
    pub file: String,
    /// Whether the file is one `COMPOSE_FILE` names (else an optional one).
    pub deployed: bool,
}

impl ObjectName {
    pub(crate) fn over(&self) -> bool {
        self.name.chars().count() > self.kind.limit()
    }
}

/// Why a recipe could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RecipeError {
    #[error("failed to read {path}: {why}")]
    Read { path: PathBuf, why: String },
    #[error("{path} is not a compose file abra can read: {why}")]
    Compose { path: PathBuf, why: String },
}

/// `.env.sample`'s assignments, as abra reads an env file: `KEY=VALUE` lines, quotes removed,
/// comments and blank lines skipped. Empty when there is none.
pub(crate) fn env_sample(recipe_dir: &Path) -> Result<BTreeMap<String, String>, RecipeError> {
    let path = recipe_dir.join(".env.sample");
    let text = match crate::files::read_text(&path, &FILE_RULES) {
        Ok(text) => text,
        Err(err) if err.is_missing() => return Ok(BTreeMap::new()),
        Err(err) => {
            return Err(RecipeError::Read {
                path,
                why: err.to_string(),
            });
        }
    };
    Ok(parse_env(&text))
}

fn parse_env(text: &str) -> BTreeMap<String, String> {
    let mut vars = BTreeMap::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let line = line.strip_prefix("export ").unwrap_or(line);
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let key = key.trim();
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let value = value.trim();
        let (value, literal) = match value.chars().next() {
            // A quoted value ends at its closing quote (a comment may follow).
            Some(q @ ('"' | '\'')) => match value[1..].find(q) {
                Some(end) => (&value[1..=end], q == '\''),
                None => (value, false),
            },
            // An unquoted value ends at an inline comment.
            _ => (value.split(" #").next().unwrap_or(value).trim_end(), false),
        };
        // As abra reads it: variables are filled in (recipes build COMPOSE_FILE up line by
        // line, `COMPOSE_FILE="$COMPOSE_FILE:compose.postgres.yml"`), but not in single quotes.
        let value = if literal {
            value.to_owned()
        } else {
            interpolate(value, &vars)
        };
        vars.insert(key.to_owned(), value);
    }
    vars
}

/// The recipe abra will look for, by `.env.sample`'s `RECIPE` (or the older `TYPE`), without a
/// `:<version>`; `None` when it names none.
pub(crate) fn recipe_named(vars: &BTreeMap<String, String>) -> Option<String> {
    vars.get("RECIPE")
        .or_else(|| vars.get("TYPE"))
        .map(|v| v.split(':').next().unwrap_or_default().trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `$VAR` and `$$` as compose fills them in;
/// an unknown variable is empty (compose warns, then does the same).
fn interpolate(text: &str, vars: &BTreeMap<String, String>) -> String {
    interpolate_with(text, vars, false)
}

/// [`interpolate`]; with `open_versions`, every `*_VERSION` variable is left open as
/// [`crate::names::VERSION_SLOT`], set or not.
fn interpolate_with(text: &str, vars: &BTreeMap<String, String>, open_versions: bool) -> String {
    let version = |name: &str| open_versions && name.ends_with("_VERSION");
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(after) = after.strip_prefix('$') {
            out.push('$');
            rest = after;
        } else if let Some(body) = after.strip_prefix('{') {
            let Some(end) = body.find('}') else {
                out.push_str(&rest[at..]);
                return out;
            };
            let expr = &body[..end];
            // `${X:-d}`: d when X is unset or empty; `${X-d}`: d only when X is unset.
            let (name, default, or_empty) = match expr.split_once(":-") {
                Some((name, default)) => (name, Some(default), true),
                None => match expr.split_once('-') {
                    Some((name, default)) => (name, Some(default), false),
                    None => (expr, None, false),
                },
            };
            let value = vars.get(name).filter(|v| !(or_empty && v.is_empty()));
            match (value, default) {
                _ if version(name) => out.push_str(crate::names::VERSION_SLOT),
                (Some(v), _) => out.push_str(v),
                (None, Some(d)) => out.push_str(&interpolate_with(d, vars, open_versions)),
                (None, None) => {}
            }
            rest = &body[end + 1..];
        } else {
            let name: String = after
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if name.is_empty() {
                out.push('$');
            } else if version(&name) {
                out.push_str(crate::names::VERSION_SLOT);
            } else if let Some(v) = vars.get(&name) {
                out.push_str(v);
            }
            rest = &after[name.len()..];
        }
    }
    out.push_str(rest);
    out
}

/// Every name a deploy of the recipe in `recipe_dir` as stack `stack` (domain `domain`) gives
/// Docker: the files `COMPOSE_FILE` names first (marked `deployed`), then every other
/// `compose.*.yml` of the recipe. Empty when the recipe has no compose file.
pub(crate) fn object_names(
    recipe_dir: &Path,
    stack: &str,
    domain: &str,
) -> Result<Vec<ObjectName>, RecipeError> {
    let mut vars = env_sample(recipe_dir)?;
    // abra.sh, which abra sources before a deploy, sets the versions of the recipe's configs.
    let abra_sh = recipe_dir.join("abra.sh");
    match crate::files::read_text(&abra_sh, &FILE_RULES) {
        Ok(text) => vars.extend(parse_env(&text)),
        Err(err) if err.is_missing() => {}
        Err(err) => {
            return Err(RecipeError::Read {
                path: abra_sh,
                why: err.to_string(),
            });
        }
    }
    vars.insert("STACK_NAME".to_owned(), stack.to_owned());
    vars.insert("DOMAIN".to_owned(), domain.to_owned());
    let named: Vec<String> = vars
        .get("COMPOSE_FILE")
        .map(|list| {
            list.split(':')
                .map(str::trim)
                .filter(|f| !f.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .filter(|list: &Vec<String>| !list.is_empty())
        .unwrap_or_else(|| vec!["compose.yml".to_owned()]);
    let mut others: Vec<String> = std::fs::read_dir(recipe_dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| {
                    (n == "compose.yml" || n.starts_with("compose.") && n.ends_with(".yml"))
                        && !named.contains(n)
                })
                .collect()
        })
        .unwrap_or_default();
    others.sort();
    let mut names = Vec::new();
    for (file, deployed) in named
        .iter()
        .map(|f| (f, true))
        .chain(others.iter().map(|f| (f, false)))
    {
        let path = recipe_dir.join(file);
        let text = match crate::files::read_text(&path, &FILE_RULES) {
            Ok(text) => text,
            // A file that is not there has no names to check (the deploy says the rest).
            Err(err) if err.is_missing() => continue,
            Err(err) => {
                return Err(RecipeError::Read {
                    path,
                    why: err.to_string(),
                });
            }
        };
        let docs = YamlLoader::load_from_str(&text).map_err(|e| RecipeError::Compose {
            path: path.clone(),
            why: e.to_string(),
        })?;
        let Some(doc) = docs.first() else { continue };
        for object in compose_names(doc, stack, &vars) {
            let (kind, key, name, form) = object;
            let known = names
                .iter()
                .any(|n: &ObjectName| n.kind == kind && n.name == name);
            if !known {
                names.push(ObjectName {
                    kind,
                    key,
                    name,
                    form,
                    file: file.clone(),
                    deployed,
                });
            }
        }
    }
    Ok(names)
}

/// The names one compose document gives: `(kind, key, name, form)`.
fn compose_names(
    doc: &Yaml,
    stack: &str,
    vars: &BTreeMap<String, String>,
) -> Vec<(Kind, String, String, String)> {
    let mut out = Vec::new();
    let section = |key: &str| doc[key].as_hash().cloned().unwrap_or_default();
    let services = section("services");
    let mut default_network = false;
    for (key, service) in &services {
        let Some(key) = key.as_str() else { continue };
        let name = format!("{stack}_{key}");
        out.push((Kind::Service, key.to_owned(), name.clone(), name));
        if service["networks"].is_badvalue() || service["networks"].is_null() {
            default_network = true;
        }
    }
    if default_network {
        let name = format!("{stack}_default");
        out.push((Kind::Network, "default".to_owned(), name.clone(), name));
    }
    for (kind, section_key) in [
        (Kind::Network, "networks"),
        (Kind::Volume, "volumes"),
        (Kind::Secret, "secrets"),
        (Kind::Config, "configs"),
    ] {
        for (key, object) in &section(section_key) {
            let Some(key) = key.as_str() else { continue };
            let external = object["external"].as_bool().unwrap_or(false);
            let template = object["name"].as_str();
            let (name, form) = match (template, external) {
                (Some(t), _) => (interpolate(t, vars), interpolate_with(t, vars, true)),
                // An external object without a name is the host's, by its key (the `proxy`
                // network): nothing the deploy names.
                (None, true) => continue,
                (None, false) => (format!("{stack}_{key}"), format!("{stack}_{key}")),
            };
            // An external network belongs to the host (`proxy`): not the app's name to check.
            if external && kind == Kind::Network {
                continue;
            }
            out.push((kind, key.to_owned(), name, form));
        }
    }
    out
}

/// The names a deploy of the recipe gives under `stack`, as forms: what the app's objects that
/// carry no stack label (abra's secrets) are named, exactly, whatever version is bumped. Every
/// compose file's, the optional ones too (an app's `.env` may enable them).
pub(crate) fn given_names(names: &[ObjectName], stack: &str) -> crate::names::GivenNames {
    let mut given = crate::names::GivenNames::default();
    for n in names {
        given.add(n.kind.noun(), n.form.clone());
    }
    given.under(stack)
}

/// What of the run-app domain `<prefix>-<hash6>.<suffix>` is not its suffix: the stack is
/// that many characters and the suffix.
fn fixed_len(domain: &AppDomain) -> usize {
    domain.as_str().find('-').unwrap_or(0) + 8
}

/// The longest domain suffix abra's own limit on a stack name allows, for `domain`'s recipe.
pub(crate) fn abra_longest_suffix(domain: &AppDomain) -> usize {
    MAX_STACK_NAME_LEN.saturating_sub(fixed_len(domain))
}

/// The longest domain suffix under which every deployed name in `names` that carries
/// `domain`'s stack fits its limit, and abra's.
pub(crate) fn longest_suffix(names: &[ObjectName], domain: &AppDomain) -> usize {
    let stack = domain.stack_name();
    let fixed = fixed_len(domain);
    names
        .iter()
        .filter(|n| n.deployed)
        .filter_map(|n| {
            let rest = n.name.strip_prefix(&stack)?.chars().count();
            Some(n.kind.limit().saturating_sub(rest).saturating_sub(fixed))
        })
        .chain(std::iter::once(abra_longest_suffix(domain)))
        .min()
        .unwrap_or(0)
}

/// The sentence that names an object over its limit.
pub(crate) fn over_limit_line(n: &ObjectName) -> String {
    format!(
        "{} {} ({}, key {}) is {} characters: Docker refuses a {} name over {}",
        n.kind.noun(),
        n.name,
        n.file,
        n.key,
        n.name.chars().count(),
        n.kind.noun(),
        n.kind.limit()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn compose_interpolation_fills_in_as_compose_does() {
        let v = vars(&[
            ("STACK_NAME", "s_t"),
            ("SECRET_DB_VERSION", "v2"),
            ("E", ""),
        ]);
        assert_eq!(
            interpolate("${STACK_NAME}_db_${SECRET_DB_VERSION}", &v),
            "s_t_db_v2"
        );
        assert_eq!(interpolate("${MISSING:-v1}", &v), "v1");
        assert_eq!(interpolate("${E:-x}", &v), "x");
        assert_eq!(interpolate("${E-x}", &v), "");
        assert_eq!(
            interpolate("$STACK_NAME.x $$HOME ${NOPE}", &v),
            "s_t.x $HOME "
        );
    }

    #[test]
    fn an_env_sample_reads_as_abra_reads_it() {
        let v = parse_env(
            "# comment\nTYPE=custom-php:1.2.0+8.1\nDOMAIN=\"x.example.com\" # the app\n\
             COMPOSE_FILE=\"compose.yml\"\nCOMPOSE_FILE=\"$COMPOSE_FILE:compose.postgres.yml\"\n\
             #COMPOSE_FILE=\"$COMPOSE_FILE:compose.s3.yml\"\nSECRET_DB_VERSION=v1 # db\n\
             LITERAL='$DOMAIN'\nbad line\n",
        );
        assert_eq!(
            v.get("COMPOSE_FILE").map(String::as_str),
            Some("compose.yml:compose.postgres.yml")
        );
        assert_eq!(v.get("LITERAL").map(String::as_str), Some("$DOMAIN"));
        assert_eq!(v.get("DOMAIN").map(String::as_str), Some("x.example.com"));
        assert_eq!(v.get("SECRET_DB_VERSION").map(String::as_str), Some("v1"));
        assert_eq!(recipe_named(&v).as_deref(), Some("custom-php"));
    }

    #[test]
    fn a_compose_file_names_services_networks_volumes_secrets_and_configs() {
        let doc = &YamlLoader::load_from_str(
            "version: '3.8'\nservices:\n  app:\n    networks: [internal, proxy]\n  worker: {}\n\
             networks:\n  internal: {}\n  proxy: {external: true}\nvolumes:\n  data: {}\n\
             secrets:\n  db_password:\n    external: true\n    name: ${STACK_NAME}_db_password_${SECRET_DB_PASSWORD_VERSION}\n\
             configs:\n  nginx_conf:\n    name: ${STACK_NAME}_nginx_conf_${NGINX_CONF_VERSION:-v1}\n    file: nginx.conf\n",
        )
        .unwrap()[0];
        let v = vars(&[("STACK_NAME", "s"), ("SECRET_DB_PASSWORD_VERSION", "v3")]);
        let names = compose_names(doc, "s", &v);
        let listed: Vec<(Kind, &str)> = names.iter().map(|(k, _, n, _)| (*k, n.as_str())).collect();
        let forms: Vec<&str> = names.iter().map(|(_, _, _, f)| f.as_str()).collect();
        assert_eq!(
            forms,
            [
                "s_app",
                "s_worker",
                "s_default",
                "s_internal",
                "s_data",
                "s_db_password_{version}",
                "s_nginx_conf_{version}",
            ]
        );
        assert_eq!(
            listed,
            [
                (Kind::Service, "s_app"),
                (Kind::Service, "s_worker"),
                (Kind::Network, "s_default"),
                (Kind::Network, "s_internal"),
                (Kind::Volume, "s_data"),
                (Kind::Secret, "s_db_password_v3"),
                (Kind::Config, "s_nginx_conf_v1"),
            ]
        );
    }

    #[test]
    fn the_longest_suffix_is_the_tightest_name_s() {
        let suffix = crate::names::DomainSuffix::parse("ci.commoninternet.net").unwrap();
        let domain = AppDomain::derive("bonfire", None, None, &suffix);
        let stack = &domain.stack_name();
        let secret = ObjectName {
            kind: Kind::Secret,
            key: "uploads_s3_secret_access_key".to_owned(),
            name: format!("{stack}_uploads_s3_secret_access_key_v1"),
            form: format!("{stack}_uploads_s3_secret_access_key_{{version}}"),
            file: "compose.s3.yml".to_owned(),
            deployed: true,
        };
        assert_eq!(secret.name.len(), 65);
        assert!(secret.over());
        // 64 - "_uploads_s3_secret_access_key_v1".len() (32) - "bonf-hhhhhh_" (12) = 20.
        assert_eq!(longest_suffix(&[secret], &domain), 20);
        assert_eq!(longest_suffix(&[], &domain), 33);
    }
}
