//! Names: every string that comes from outside is validated here, and every name derived from
//! them (app domain, stack name, lock file name) is computed here and nowhere else.
//!
//! Invariant: a domain [`AppDomain::derive`] produces for a valid recipe always matches the
//! [`RunAppPattern`] of the same suffix, so the janitor can see every run's leftovers; and a stack
//! name maps back to exactly the domain it came from.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

use std::fmt;
use std::sync::LazyLock;

use regex::Regex;
use sha1::{Digest, Sha1};

/// Docker refuses stack names past this length once the service suffix is appended.
pub(crate) const MAX_STACK_NAME_LEN: usize = 45;

/// The suffix of every run-app domain unless configured otherwise.
pub(crate) const DEFAULT_DOMAIN_SUFFIX: &str = "ci.commoninternet.net";

/// A value that broke one of the contract's rules.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid {what} {value:?}: {rule}")]
pub(crate) struct NameError {
    /// What the value was meant to be ("recipe name", "run id", ...).
    pub what: &'static str,
    /// The offending value, as given.
    pub value: String,
    /// The rule it broke, in words an operator can act on.
    pub rule: String,
}

struct Rule {
    what: &'static str,
    pattern: &'static str,
    re: LazyLock<Regex>,
}

macro_rules! rule {
    ($what:literal, $pattern:literal) => {
        Rule {
            what: $what,
            pattern: $pattern,
            re: LazyLock::new(|| Regex::new($pattern).expect("rule patterns are valid")),
        }
    };
}

static RECIPE: Rule = rule!("recipe name", r"^[a-z0-9][a-z0-9_-]{0,63}$");
static PR: Rule = rule!("pull request number", r"^[0-9]{1,10}$");
// The contract's ref rule plus `+`: recipe release tags look like `1.0.0+1.2.3`.
static GIT_REF: Rule = rule!("ref", r"^[A-Za-z0-9._/+-]{1,255}$");
static RUN_ID: Rule = rule!("run id", r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$");
static LOCK_NAME: Rule = rule!("lock name", r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$");
static STACK_NAME: Rule = rule!("stack name", r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,44}$");
static SUFFIX: Rule = rule!(
    "domain suffix",
    r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$"
);

impl Rule {
    fn check(&self, value: &str) -> Result<(), NameError> {
        if self.re.is_match(value) {
            Ok(())
        } else {
            Err(self.broken(value, format!("must match {}", self.pattern)))
        }
    }

    fn broken(&self, value: &str, rule: String) -> NameError {
        NameError {
            what: self.what,
            value: value.to_owned(),
            rule,
        }
    }
}

macro_rules! validated_string {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub(crate) struct $name(String);

        impl $name {
            /// The validated value.
            pub(crate) fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

validated_string!(
    /// A recipe name: `^[a-z0-9][a-z0-9_-]{0,63}$`, so it is also a safe path component.
    Recipe
);
validated_string!(
    /// A pull-request number, kept as the digits given (they feed the domain hash).
    PrNumber
);
validated_string!(
    /// A git ref: branch, tag (`1.0.0+1.2.3` style recipe tags included) or commit.
    GitRef
);
validated_string!(
    /// A run id: a safe path component naming the run's directory and state files.
    RunId
);
validated_string!(
    /// The name of a `ccci-run lock` lock.
    LockName
);
validated_string!(
    /// A Docker stack name: what `converge --stack` and `CCCI_STACK_NAME` name.
    StackName
);
validated_string!(
    /// A DNS suffix short enough that every stack name built on it fits abra's limit on a stack name.
    DomainSuffix
);

impl Recipe {
    pub(crate) fn parse(value: &str) -> Result<Self, NameError> {
        RECIPE.check(value).map(|()| Self(value.to_owned()))
    }
}

impl PrNumber {
    /// Digits, normalised: `00001` and `1` are the same pull request, so they hash (and
    /// serialise) alike.
    pub(crate) fn parse(value: &str) -> Result<Self, NameError> {
        PR.check(value)?;
        let trimmed = value.trim_start_matches('0');
        Ok(Self(
            if trimmed.is_empty() { "0" } else { trimmed }.to_owned(),
        ))
    }
}

impl GitRef {
    pub(crate) fn parse(value: &str) -> Result<Self, NameError> {
        GIT_REF.check(value)?;
        if value.contains("..") {
            return Err(GIT_REF.broken(value, "must not contain \"..\"".to_owned()));
        }
        if value.starts_with('-') {
            return Err(GIT_REF.broken(value, "must not start with \"-\"".to_owned()));
        }
        Ok(Self(value.to_owned()))
    }
}

/// What Drone says of the build a step belongs to: its repository and its number.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct DroneBuild {
    /// `owner/name`: `DRONE_REPO`, else `DRONE_REPO_OWNER` and `DRONE_REPO_NAME`.
    pub repo: Option<String>,
    /// `DRONE_BUILD_NUMBER`: numbered per repository, so it repeats across repositories.
    pub number: Option<String>,
}

impl DroneBuild {
    /// Read through `var` (the step's environment: a variable's value when set and not empty).
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let repo = var("DRONE_REPO").or_else(|| {
            var("DRONE_REPO_OWNER")
                .zip(var("DRONE_REPO_NAME"))
                .map(|(owner, name)| format!("{owner}/{name}"))
        });
        Self {
            repo,
            number: var("DRONE_BUILD_NUMBER"),
        }
    }
}

/// The part of a repository's name kept readable in a run id: its characters within the run id
/// rule, others as `-`.
fn id_safe(part: &str) -> String {
    part.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect()
}

impl RunId {
    pub(crate) fn parse(value: &str) -> Result<Self, NameError> {
        RUN_ID.check(value).map(|()| Self(value.to_owned()))
    }

    /// The contract's order: `--run-id`, else the build's repository and number, else
    /// `manual-<pid>`.
    ///
    /// One runner serves many repositories, each numbering its builds from 1, so the number
    /// alone names no build: the default id is `<owner>.<name>.<number>` (`coop-cloud.lemp.120`)
    /// when the owner and name keep to `[A-Za-z0-9_-]` and it fits the rule's 64 characters;
    /// otherwise the readable part is shortened and a hash of the whole `owner/name` keeps it
    /// apart (`<owner-name…>.<hash8>.<number>`). A build number without a repository (a runner
    /// older than Drone 1, a hand-made environment) is the id alone, as before.
    pub(crate) fn resolve(flag: Option<&str>, drone: &DroneBuild) -> Result<Self, NameError> {
        if let Some(value) = flag {
            return Self::parse(value);
        }
        let Some(number) = drone.number.as_deref() else {
            return Self::parse(&format!("manual-{}", std::process::id()));
        };
        // The number is checked on its own first, so a bad one is named as given.
        Self::parse(number)?;
        let Some(repo) = drone.repo.as_deref() else {
            return Self::parse(number);
        };
        let plain = repo.split_once('/').and_then(|(owner, name)| {
            let ok = |p: &str| {
                !p.is_empty()
                    && p.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                    && p.starts_with(|c: char| c.is_ascii_alphanumeric())
            };
            (ok(owner) && ok(name)).then(|| format!("{owner}.{name}.{number}"))
        });
        if let Some(id) = plain.filter(|id| id.len() <= 64) {
            return Self::parse(&id);
        }
        let hash = hex::encode(Sha1::digest(repo.as_bytes()));
        // `<readable>.<hash8>.<number>` within 64: the readable part gets what is left.
        let room = 64usize.saturating_sub(number.len() + 8 + 2);
        let readable: String = id_safe(&repo.replace('/', "-"))
            .trim_start_matches(|c: char| !c.is_ascii_alphanumeric())
            .chars()
            .take(room)
            .collect();
        let readable = if readable.is_empty() {
            "repo".to_owned()
        } else {
            readable
        };
        Self::parse(&format!("{readable}.{}.{number}", &hash[..8]))
    }
}

impl LockName {
    pub(crate) fn parse(value: &str) -> Result<Self, NameError> {
        LOCK_NAME.check(value).map(|()| Self(value.to_owned()))
    }
}

impl StackName {
    pub(crate) fn parse(value: &str) -> Result<Self, NameError> {
        STACK_NAME.check(value).map(|()| Self(value.to_owned()))
    }
}

impl DomainSuffix {
    pub(crate) fn parse(value: &str) -> Result<Self, NameError> {
        SUFFIX.check(value)?;
        // The longest domain is `pppp-hhhhhh.<suffix>`: 12 characters before the suffix.
        let longest_stack = 12 + value.len();
        if longest_stack > MAX_STACK_NAME_LEN {
            return Err(SUFFIX.broken(
                value,
                format!(
                    "must be at most {} characters, so that stack names stay within abra's \
                     {MAX_STACK_NAME_LEN} (this one gives {longest_stack}); Docker's own limits \
                     on the names a recipe gives are checked at run start",
                    MAX_STACK_NAME_LEN - 12
                ),
            ));
        }
        Ok(Self(value.to_owned()))
    }
}

/// The app domain of one run: `<prefix>-<hash6>.<suffix>`, unique per (recipe, pr, ref).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct AppDomain(String);

impl AppDomain {
    /// Derive the domain from the run's identity.
    ///
    /// The prefix is the first four characters of the recipe name, lower-cased, after dropping
    /// everything outside `[a-z0-9]` (so `ab-c` gives `abc`, never `ab-c`, which would not match
    /// the run-app pattern); `app` when nothing is left.
    pub(crate) fn derive(
        recipe: &str,
        pr: Option<&PrNumber>,
        git_ref: Option<&GitRef>,
        suffix: &DomainSuffix,
    ) -> Self {
        let prefix: String = recipe
            .to_lowercase()
            .chars()
            .filter(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
            .take(4)
            .collect();
        let prefix = if prefix.is_empty() {
            "app".to_owned()
        } else {
            prefix
        };
        let key = format!(
            "{recipe}|{}|{}",
            pr.map_or("", PrNumber::as_str),
            git_ref.map_or("", GitRef::as_str)
        );
        let hash = hex::encode(Sha1::digest(key.as_bytes()));
        Self(format!("{prefix}-{}.{suffix}", &hash[..6]))
    }

    /// Accept an existing domain string (from a file name or a Docker resource) if it is a
    /// run-app domain of `pattern`'s suffix.
    pub(crate) fn recognise(value: &str, pattern: &RunAppPattern) -> Option<Self> {
        pattern.matches(value).then(|| Self(value.to_owned()))
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }

    /// abra's stack name: the domain with every `.` replaced by `_`.
    pub(crate) fn stack_name(&self) -> String {
        self.0.replace('.', "_")
    }

    /// The file name of this domain's app lock inside the lock directory.
    pub(crate) fn lock_file_name(&self) -> String {
        format!("{LOCK_FILE_PREFIX}{}{LOCK_FILE_SUFFIX}", self.0)
    }
}

impl fmt::Display for AppDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where the fleet's locks live in etcd. Each lock is a directory of keys,
/// `<prefix><kind>/<name>/`, holding `owner` (the holder's line; its create revision, above the
/// lineage's base, is the fencing token), `tenure/<lease id>` (the holder's, until it has ended)
/// and `queue/<lease id>` (one per waiter), every key bound to its writer's lease. Beside the
/// lock directories: the lineage record (no lease) and, for a while after a lineage begins, the
/// settling key.
#[cfg(feature = "etcd")]
pub(crate) mod etcd {
    pub(crate) const PREFIX: &str = "/ccci-run/";
    /// The lock lineage: the base of every fencing token, and the cluster it was begun on.
    pub(crate) const LINEAGE: &str = "/ccci-run/lineage";
    /// Present (bound to a lease that nobody renews) for one lease TTL after a lineage began.
    pub(crate) const SETTLING: &str = "/ccci-run/settling";
    /// The kinds of lock under [`PREFIX`].
    pub(crate) const APP: &str = "app";
    pub(crate) const NAMED: &str = "named";

    /// The key directory of one lock in etcd.
    pub(crate) fn lock_dir(kind: &str, name: &str) -> String {
        format!("{PREFIX}{kind}/{name}/")
    }

    /// The owner key in a lock's key directory.
    pub(crate) fn owner_key(lock_dir: &str) -> String {
        format!("{lock_dir}owner")
    }

    /// The prefix of the waiters' keys in a lock's key directory.
    pub(crate) fn queue_prefix(lock_dir: &str) -> String {
        format!("{lock_dir}queue/")
    }

    /// The fleet record: the longest lease TTL and stop budget any host of the fleet uses.
    pub(crate) const FLEET: &str = "/ccci-run/fleet";
    /// Where the holders' tenure keys live: beside the locks' directories, not in them, so that
    /// deleting one lock's directory by hand cannot end the tenure of a holder that may still
    /// be stopping its command.
    pub(crate) const TENURE: &str = "tenure";

    /// The prefix of the holders' tenure keys of the lock whose key directory is `lock_dir`:
    /// `/ccci-run/tenure/<kind>/<name>/`.
    pub(crate) fn tenure_prefix(lock_dir: &str) -> String {
        let rest = lock_dir.strip_prefix(PREFIX).unwrap_or(lock_dir);
        format!("{PREFIX}{TENURE}/{rest}")
    }

    /// Where tenure keys were kept before they moved out of the lock's directory: still read
    /// (and waited for), so that a holder of an older version is never looked past.
    pub(crate) fn legacy_tenure_prefix(lock_dir: &str) -> String {
        format!("{lock_dir}tenure/")
    }

    /// A holder's tenure key: one per lease and lock.
    pub(crate) fn tenure_key(lock_dir: &str, lease: i64) -> String {
        format!("{}{lease:016x}", tenure_prefix(lock_dir))
    }

    /// A waiter's key: one per lease and lock.
    pub(crate) fn queue_key(lock_dir: &str, lease: i64) -> String {
        format!("{lock_dir}queue/{lease:016x}")
    }

    /// Split a key under [`PREFIX`] into its lock's kind, its lock's name and the rest
    /// (`owner`, `queue/<lease>`, and for a tenure key, wherever it lives, `<lease>`).
    pub(crate) fn key_parts(key: &str) -> Option<(&str, &str, &str)> {
        let rest = key.strip_prefix(PREFIX)?;
        let rest = rest
            .strip_prefix(TENURE)
            .and_then(|r| r.strip_prefix('/'))
            .unwrap_or(rest);
        let (kind, rest) = rest.split_once('/')?;
        let (name, rest) = rest.split_once('/')?;
        Some((kind, name, rest.strip_prefix("tenure/").unwrap_or(rest)))
    }

    /// Whether `key` is a tenure key (in the tenure tree, or where older versions kept it).
    pub(crate) fn is_tenure(key: &str) -> bool {
        let Some(rest) = key.strip_prefix(PREFIX) else {
            return false;
        };
        let mut parts = rest.splitn(4, '/');
        matches!(
            (parts.next(), parts.next(), parts.next(), parts.next()),
            (Some(TENURE), Some(_), Some(_), Some(_)) | (Some(_), Some(_), Some("tenure"), Some(_))
        )
    }
}

/// App lock files are `cc-ci-app-<domain>.lock`.
/// Where a name form has the version abra bumps (`SECRET_<NAME>_VERSION`, a config's
/// `<NAME>_VERSION`): one run of characters without `_` (`v1`, `v2`, ...).
pub(crate) const VERSION_SLOT: &str = "{version}";

/// The names an app's recipe gives Docker's objects under its stack name, by kind, each a form
/// (`<stack>_db_password_{version}`, `<stack>_db_data`): what an object that carries no stack
/// label must be named, exactly, to be the app's. Never a prefix: an app whose domain extends
/// a run app's (`<stack>_example_org_…`) has names that begin with the run app's stack.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct GivenNames {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub networks: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub configs: Vec<String>,
}

impl GivenNames {
    /// The forms of `kind` (`service`, `network`, `volume`, `secret`, `config`); none for any
    /// other kind (a container's name is its task's, never a recipe's).
    pub(crate) fn of(&self, kind: &str) -> &[String] {
        match kind {
            "service" => &self.services,
            "network" => &self.networks,
            "volume" => &self.volumes,
            "secret" => &self.secrets,
            "config" => &self.configs,
            _ => &[],
        }
    }

    fn of_mut(&mut self, kind: &str) -> Option<&mut Vec<String>> {
        Some(match kind {
            "service" => &mut self.services,
            "network" => &mut self.networks,
            "volume" => &mut self.volumes,
            "secret" => &mut self.secrets,
            "config" => &mut self.configs,
            _ => return None,
        })
    }

    /// Add the form `form` of `kind`, once.
    pub(crate) fn add(&mut self, kind: &str, form: String) {
        if let Some(forms) = self.of_mut(kind) {
            if !forms.contains(&form) {
                forms.push(form);
            }
        }
    }

    /// Every form of `other` too.
    pub(crate) fn merge(&mut self, other: &GivenNames) {
        for kind in ["service", "network", "volume", "secret", "config"] {
            for form in other.of(kind) {
                self.add(kind, form.clone());
            }
        }
    }

    /// Only the forms under `stack` (`<stack>_…`): a record names no other app's objects.
    pub(crate) fn under(mut self, stack: &str) -> Self {
        let prefix = format!("{stack}_");
        for kind in ["service", "network", "volume", "secret", "config"] {
            if let Some(forms) = self.of_mut(kind) {
                forms.retain(|f| f.starts_with(&prefix));
            }
        }
        self
    }

    /// Whether `name` is exactly one of the forms of `kind`.
    pub(crate) fn gives(&self, kind: &str, name: &str) -> bool {
        self.of(kind).iter().any(|form| form_matches(form, name))
    }

    /// The volume names without a version slot: what a node sweep may take by name.
    pub(crate) fn exact_volumes(&self) -> impl Iterator<Item = &str> {
        self.volumes
            .iter()
            .filter(|v| !v.contains(VERSION_SLOT))
            .map(String::as_str)
    }
}

/// Whether `name` is `form` with each [`VERSION_SLOT`] filled by a non-empty run of characters
/// without `_`.
fn form_matches(form: &str, name: &str) -> bool {
    match form.split_once(VERSION_SLOT) {
        None => form == name,
        Some((head, rest)) => {
            let Some(after) = name.strip_prefix(head) else {
                return false;
            };
            let end = after.find('_').unwrap_or(after.len());
            // The version is at least one character, and may stop anywhere before an `_`.
            (1..=end)
                .filter(|&n| after.is_char_boundary(n))
                .any(|n| form_matches(rest, &after[n..]))
        }
    }
}

pub(crate) const LOCK_FILE_PREFIX: &str = "cc-ci-app-";
pub(crate) const LOCK_FILE_SUFFIX: &str = ".lock";

/// `RUN_APP_RE` for one suffix: the only domains the janitor may ever probe or reap.
#[derive(Debug, Clone)]
pub(crate) struct RunAppPattern {
    re: Regex,
    suffix: DomainSuffix,
}

impl RunAppPattern {
    pub(crate) fn new(suffix: &DomainSuffix) -> Self {
        let source = format!(
            r"^[a-z0-9]{{1,4}}-[0-9a-f]{{6}}\.{}$",
            regex::escape(suffix.as_str())
        );
        Self {
            re: Regex::new(&source).expect("an escaped suffix always forms a valid pattern"),
            suffix: suffix.clone(),
        }
    }

    pub(crate) fn matches(&self, domain: &str) -> bool {
        self.re.is_match(domain)
    }

    /// Map a stack name back to its run-app domain, if it is one.
    ///
    /// Stack names replace dots with underscores; run-app prefixes and hashes contain neither,
    /// so the first `_` separates `<prefix>-<hash>` from the suffix, whose own dots are known.
    pub(crate) fn domain_of_stack(&self, stack: &str) -> Option<AppDomain> {
        let (head, tail) = stack.split_once('_')?;
        if tail != self.suffix.as_str().replace('.', "_") {
            return None;
        }
        AppDomain::recognise(&format!("{head}.{}", self.suffix), self)
    }

    /// Map a Docker resource name (`<stack>_<name>`, containers with a leading `/`) back to the
    /// run-app domain of its stack, if it has one. Secrets declared external carry no stack
    /// label, so a name is all there is to go by.
    pub(crate) fn domain_of_resource(&self, name: &str) -> Option<AppDomain> {
        let name = name.strip_prefix('/').unwrap_or(name);
        let (head, tail) = name.split_once('_')?;
        let suffix = self.suffix.as_str().replace('.', "_");
        let rest = tail.strip_prefix(suffix.as_str())?;
        if !(rest.is_empty() || rest.starts_with('_')) {
            return None;
        }
        AppDomain::recognise(&format!("{head}.{}", self.suffix), self)
    }

    /// The domain an abra `.env` file name (`<domain>.env`) belongs to, if it is a run app.
    pub(crate) fn domain_of_env_file(&self, file_name: &str) -> Option<AppDomain> {
        AppDomain::recognise(file_name.strip_suffix(".env")?, self)
    }

    /// The domain a lock file name belongs to, if it is a run-app lock.
    pub(crate) fn domain_of_lock_file(&self, file_name: &str) -> Option<AppDomain> {
        let domain = file_name
            .strip_prefix(LOCK_FILE_PREFIX)?
            .strip_suffix(LOCK_FILE_SUFFIX)?;
        AppDomain::recognise(domain, self)
    }
}

/// Text from outside (a file name planted in a world-writable dir, a lock file's contents) made
/// safe for a terminal: control characters, escape sequences and backslashes are escaped, and
/// bytes that are not UTF-8 are shown as `\xNN` instead of being dropped.
/// Unicode's bidirectional formatting characters: shown raw, they reorder what a terminal shows
/// (a run id that reads as another's).
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `text` as a terminal may show it: control and bidirectional formatting characters escaped
/// (`\n`, `\u{202e}`), everything else as it is.
pub(crate) fn visible(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(|c| c.is_control() || is_bidi_control(c)) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() || is_bidi_control(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Whether `c` is escaped wherever ccci-run shows outside text.
fn needs_escape(c: char) -> bool {
    c.is_control() || is_bidi_control(c)
}

/// A text report (a table, lines of `key value`) as a terminal may show it: every control and
/// bidirectional formatting character escaped as [`visible`] does, but the line breaks that
/// make its lines.
pub(crate) fn visible_text(text: &str) -> String {
    text.split('\n').map(visible).collect::<Vec<_>>().join("\n")
}

/// A JSON document whose strings carry no control or bidirectional formatting character, raw or
/// as a JSON escape: each is written as `runs --json` writes it (the text `\u{202e}`, `\n`), so
/// what a reader decodes is as safe to show as the document itself. The structure (keys'
/// order, numbers, the pretty printer's line breaks) is left as it is.
pub(crate) fn visible_json(json: &str) -> String {
    fn push_escaped(out: &mut String, c: char) {
        for e in c.escape_default() {
            if e == '\\' {
                out.push_str("\\\\");
            } else {
                out.push(e);
            }
        }
    }
    let mut out = String::with_capacity(json.len());
    let mut chars = json.chars();
    let mut in_string = false;
    while let Some(c) = chars.next() {
        if !in_string {
            in_string = c == '"';
            out.push(c);
            continue;
        }
        match c {
            '"' => {
                in_string = false;
                out.push(c);
            }
            '\\' => {
                let Some(e) = chars.next() else {
                    out.push(c);
                    break;
                };
                let decoded = match e {
                    'n' => '\n',
                    't' => '\t',
                    'r' => '\r',
                    'b' => '\u{8}',
                    'f' => '\u{c}',
                    'u' => {
                        let hex: String = chars.by_ref().take(4).collect();
                        match u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32) {
                            Some(d) if needs_escape(d) => d,
                            _ => {
                                out.push_str("\\u");
                                out.push_str(&hex);
                                continue;
                            }
                        }
                    }
                    other => {
                        out.push('\\');
                        out.push(other);
                        continue;
                    }
                };
                push_escaped(&mut out, decoded);
            }
            c if needs_escape(c) => push_escaped(&mut out, c),
            c => out.push(c),
        }
    }
    out
}

pub(crate) fn escape_outside(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            if c.is_control() || is_bidi_control(c) || c == '\\' {
                out.extend(c.escape_default());
            } else {
                out.push(c);
            }
        }
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// Serialise a path from outside as escaped text (JSON cannot carry non-UTF-8 bytes).
pub(crate) fn serialize_path_escaped<S: serde::Serializer>(
    path: &std::path::Path,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    use std::os::unix::ffi::OsStrExt;
    serializer.serialize_str(&escape_outside(path.as_os_str().as_bytes()))
}

// ---- File, directory and cgroup names ----------------------------------------------------

/// An abra directory's parts: its servers' `.env` files, the recipe catalogue (both shared with
/// the canonical abra home), and the recipes (the run's own).
pub(crate) const ABRA_SERVERS: &str = "servers";
pub(crate) const ABRA_CATALOGUE: &str = "catalogue";
pub(crate) const ABRA_RECIPES: &str = "recipes";
/// A run's own abra directory in its run directory.
pub(crate) const RUN_ABRA_DIR: &str = "abra";
/// The sequence counter in a named lock's queue directory.
pub(crate) const QUEUE_COUNTER_FILE: &str = ".seq";
/// The last fencing token given to a holder, in a named lock's queue directory.
pub(crate) const FENCING_COUNTER_FILE: &str = ".fencing";
/// Beside a named lock's file (`ccci-<NAME>.lock.last-wait`): how long its last holder waited
/// for it, in seconds.
pub(crate) const LAST_WAIT_SUFFIX: &str = ".last-wait";

/// `<abra>/recipes/<recipe>`.
pub(crate) fn recipe_dir(abra: &std::path::Path, recipe: &Recipe) -> std::path::PathBuf {
    abra.join(ABRA_RECIPES).join(recipe.as_str())
}

/// A run's guard lock in its run directory: held for the run's whole life.
pub(crate) const RUN_GUARD_FILE: &str = "run.lock";
/// A run's record in its run directory.
pub(crate) const RUN_RECORD_FILE: &str = "run.json";
/// What `ccci-run stop` leaves in a run directory for the run's supervisor: who asks.
pub(crate) const RUN_STOP_FILE: &str = "stop.json";
/// The directory in the runs dir that holds each live run's domain lock.
pub(crate) const DOMAINS_DIR: &str = ".domains";
/// Named lock files are `ccci-<NAME>.lock`; the queue in front of one is `<file>.queue`.
pub(crate) const NAMED_LOCK_PREFIX: &str = "ccci-";
pub(crate) const NAMED_LOCK_SUFFIX: &str = ".lock";
const QUEUE_SUFFIX: &str = ".queue";

/// The state dir when none is configured, in the runs dir: the runs' user's own.
pub(crate) const STATE_DIR: &str = ".state";

/// `<runs-dir>/.state`: the default state dir.
pub(crate) fn state_dir_of(runs_dir: &std::path::Path) -> std::path::PathBuf {
    runs_dir.join(STATE_DIR)
}

/// `<runs-dir>/.domains`.
pub(crate) fn domains_dir(runs_dir: &std::path::Path) -> std::path::PathBuf {
    runs_dir.join(DOMAINS_DIR)
}

impl LockName {
    /// `ccci-<NAME>.lock`.
    pub(crate) fn file_name(&self) -> String {
        format!("{NAMED_LOCK_PREFIX}{}{NAMED_LOCK_SUFFIX}", self.0)
    }

    /// `ccci-<NAME>.lock.queue`.
    pub(crate) fn queue_dir_name(&self) -> String {
        format!("{}{QUEUE_SUFFIX}", self.file_name())
    }
}

/// The named lock a lock file name stands for (raw bytes: names come from outside).
pub(crate) fn named_lock_of_file(file_name: &[u8]) -> Option<&[u8]> {
    file_name
        .strip_prefix(NAMED_LOCK_PREFIX.as_bytes())?
        .strip_suffix(NAMED_LOCK_SUFFIX.as_bytes())
}

/// The queue directory of a named lock file's path.
pub(crate) fn queue_dir_of(lock_file: &std::path::Path) -> std::path::PathBuf {
    let mut dir = lock_file.as_os_str().to_owned();
    dir.push(QUEUE_SUFFIX);
    std::path::PathBuf::from(dir)
}

/// A state file: `ccci-<kind>-<scope>-<run-id>-<pid>`. The scope (`c<dev>.<ino>` of the runs
/// dir) names the configuration the run belongs to: configurations that share a state dir
/// (`/tmp` is every configuration's default) tell their files apart by it, never by run id.
pub(crate) fn state_file_name(kind: &str, scope: &str, run_id: &RunId, pid: u32) -> String {
    format!("ccci-{kind}-{scope}-{run_id}-{pid}")
}

/// The kinds of state file, with the environment variable each one is exported as.
pub(crate) const STATE_FILES: [(&str, &str); 4] = [
    ("deploys", "CCCI_DEPLOYS_FILE"),
    ("opstate", "CCCI_OPSTATE_FILE"),
    ("deps", "CCCI_DEPS_FILE"),
    ("depskip", "CCCI_DEPSKIP_FILE"),
];

/// The configuration scope, run id and pid a state file name
/// (`ccci-<kind>-<scope>-<run-id>-<pid>`) belongs to. A name without a scope (as runs before
/// scopes wrote them) is nobody's we can judge.
pub(crate) fn parse_state_file_name(name: &str) -> Option<(&str, RunId, u32)> {
    let rest = name.strip_prefix("ccci-")?;
    let rest = STATE_FILES
        .iter()
        .find_map(|(kind, _)| rest.strip_prefix(kind)?.strip_prefix('-'))?;
    let (scope, rest) = rest.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let (dev, ino) = scope.strip_prefix('c')?.split_once('.')?;
    if !digits(dev) || !digits(ino) {
        return None;
    }
    let (run_id, pid) = rest.rsplit_once('-')?;
    if !digits(pid) {
        return None;
    }
    Some((scope, RunId::parse(run_id).ok()?, pid.parse().ok()?))
}

/// Prefix of every cgroup this tool creates.
pub(crate) const CGROUP_PREFIX: &str = "ccci-";
/// The leaf the supervised command runs in.
pub(crate) const COMMAND_LEAF: &str = "command";
/// The leaf the teardown hook runs in.
pub(crate) const HOOK_LEAF: &str = "hook";

/// The name of a supervisor's cgroup: `ccci-<kind>-<label>-<owner>`, where the owner
/// (`<pid>-<start>-<pidns>-c<dev>.<ino>`, [`crate::supervise::identity::Owner`]) names the
/// supervisor and its configuration.
pub(crate) fn cgroup_name(kind: &str, label: &str, owner: &str) -> String {
    format!("{CGROUP_PREFIX}{kind}-{label}-{owner}")
}

/// The run id in the name of a run's cgroup (`ccci-run-<run id>-<owner>`), unparsed.
pub(crate) fn run_of_cgroup(name: &str) -> Option<&str> {
    let owner = cgroup_owner(name)?;
    name.strip_prefix(CGROUP_PREFIX)?
        .strip_prefix("run-")?
        .strip_suffix(owner)?
        .strip_suffix('-')
}

/// The owner part of a cgroup name of ours (its last four `-`-separated fields), unparsed.
pub(crate) fn cgroup_owner(name: &str) -> Option<&str> {
    let rest = name.strip_prefix(CGROUP_PREFIX)?;
    let mut cut = rest.len();
    for _ in 0..4 {
        cut = rest[..cut].rfind('-')?;
    }
    // `<kind>-<label>` stays before the owner.
    rest[..cut].contains('-').then(|| &rest[cut + 1..])
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_given_name_is_exact_and_its_version_has_no_underscore() {
        let mut given = super::GivenNames::default();
        given.add("secret", "s_t_db_password_{version}".to_owned());
        given.add("volume", "s_t_db_data".to_owned());
        assert!(given.gives("secret", "s_t_db_password_v1"));
        assert!(given.gives("secret", "s_t_db_password_v12"));
        assert!(!given.gives("secret", "s_t_db_password_"));
        assert!(!given.gives("secret", "s_t_db_password_v1_x"));
        assert!(!given.gives("secret", "s_t_example_org_db_password_v1"));
        assert!(!given.gives("volume", "s_t_example_org_db_data"));
        assert!(!given.gives("volume", "s_t_db_data_x"));
        assert!(!given.gives("config", "s_t_db_data"));
        assert!(given.gives("volume", "s_t_db_data"));
        let _ = given.gives("secret", "s_t_db_password_\u{e9}\u{e9}");
        assert_eq!(given.exact_volumes().collect::<Vec<_>>(), ["s_t_db_data"]);
        assert!(given.clone().under("s_t_example").volumes.is_empty());
    }

    #[cfg(feature = "etcd")]
    use super::etcd as keys;

    #[cfg(feature = "etcd")]
    #[test]
    fn tenure_keys_live_beside_the_lock_directories_and_parse_as_their_locks() {
        let dir = keys::lock_dir(keys::NAMED, "cache");
        let tenure = keys::tenure_key(&dir, 0x2a);
        assert_eq!(tenure, "/ccci-run/tenure/named/cache/000000000000002a");
        assert!(
            !tenure.starts_with(&dir),
            "a per-lock delete must not reach it"
        );
        assert_eq!(
            keys::key_parts(&tenure),
            Some(("named", "cache", "000000000000002a"))
        );
        assert!(keys::is_tenure(&tenure));
        let old = format!("{}000000000000002a", keys::legacy_tenure_prefix(&dir));
        assert_eq!(
            keys::key_parts(&old),
            Some(("named", "cache", "000000000000002a"))
        );
        assert!(keys::is_tenure(&old));
        // A lock named "tenure" is a lock, not the tenure tree.
        let owner = keys::owner_key(&keys::lock_dir(keys::NAMED, "tenure"));
        assert_eq!(keys::key_parts(&owner), Some(("named", "tenure", "owner")));
        assert!(!keys::is_tenure(&owner));
        assert!(!keys::is_tenure(&keys::queue_key(&dir, 1)));
        assert!(!keys::is_tenure(keys::FLEET) && keys::key_parts(keys::FLEET).is_none());
    }

    #[test]
    fn visible_escapes_control_and_bidi_characters_only() {
        assert_eq!(visible("run 7 \u{e9}"), "run 7 \u{e9}");
        assert_eq!(visible("a\nb\u{1b}[31m"), "a\\nb\\u{1b}[31m");
        assert_eq!(visible("x\u{202e}y\u{2066}"), "x\\u{202e}y\\u{2066}");
    }

    use super::*;
    use proptest::prelude::*;
    use rstest::rstest;

    fn suffix() -> DomainSuffix {
        DomainSuffix::parse(DEFAULT_DOMAIN_SUFFIX).unwrap()
    }

    #[test]
    fn domain_is_prefix_and_sha1_of_recipe_pr_ref() {
        // sha1("custom-html|12|") = 4a4b5e...; pinned so the derivation cannot drift silently.
        let pr = PrNumber::parse("12").unwrap();
        let d = AppDomain::derive("custom-html", Some(&pr), None, &suffix());
        let expected = hex::encode(Sha1::digest(b"custom-html|12|"));
        assert_eq!(
            d.as_str(),
            format!("cust-{}.ci.commoninternet.net", &expected[..6])
        );
        assert_eq!(
            d.stack_name(),
            format!("cust-{}_ci_commoninternet_net", &expected[..6])
        );
    }

    #[test]
    fn short_recipe_with_separator_drops_it_from_the_prefix() {
        // A naive recipe[..4] would give "ab-c", which RUN_APP_RE rejects: leftovers never reaped.
        let d = AppDomain::derive("ab-c", None, None, &suffix());
        assert!(d.as_str().starts_with("abc-"), "{d}");
        assert!(RunAppPattern::new(&suffix()).matches(d.as_str()));
    }

    #[test]
    fn empty_prefix_falls_back_to_app() {
        let d = AppDomain::derive("__--", None, None, &suffix());
        assert!(d.as_str().starts_with("app-"), "{d}");
    }

    #[rstest]
    #[case::service(
        "abcd-0a1b2c_ci_commoninternet_net_app",
        Some("abcd-0a1b2c.ci.commoninternet.net")
    )]
    #[case::bare_stack(
        "abcd-0a1b2c_ci_commoninternet_net",
        Some("abcd-0a1b2c.ci.commoninternet.net")
    )]
    #[case::container(
        "/abcd-0a1b2c_ci_commoninternet_net_app.1.xyz",
        Some("abcd-0a1b2c.ci.commoninternet.net")
    )]
    #[case::warm("warm-keycloak_ci_commoninternet_net_app", None)]
    #[case::other_suffix("abcd-0a1b2c_example_org_app", None)]
    #[case::suffix_run_on("abcd-0a1b2c_ci_commoninternet_netx_app", None)]
    #[case::no_underscore("abcd-0a1b2c", None)]
    fn resource_names_map_back_to_domains(#[case] name: &str, #[case] want: Option<&str>) {
        let got = RunAppPattern::new(&suffix()).domain_of_resource(name);
        assert_eq!(got.as_ref().map(AppDomain::as_str), want);
    }

    #[rstest]
    #[case::warm_app("warm-keycloak.ci.commoninternet.net")]
    #[case::other_suffix("abcd-0a1b2c.example.org")]
    #[case::uppercase_hash("abcd-0A1B2C.ci.commoninternet.net")]
    #[case::long_prefix("abcde-0a1b2c.ci.commoninternet.net")]
    #[case::short_hash("abcd-0a1b2.ci.commoninternet.net")]
    #[case::unescaped_dot("abcd-0a1b2cXci.commoninternet.net")]
    #[case::trailing("abcd-0a1b2c.ci.commoninternet.net.evil")]
    fn run_app_pattern_rejects(#[case] domain: &str) {
        assert!(!RunAppPattern::new(&suffix()).matches(domain));
    }

    #[rstest]
    #[case::uppercase("Custom", "recipe name")]
    #[case::leading_dash("-x", "recipe name")]
    #[case::traversal("../etc", "recipe name")]
    #[case::slash("a/b", "recipe name")]
    #[case::empty("", "recipe name")]
    #[case::too_long(&"a".repeat(65), "recipe name")]
    fn bad_recipe_names_are_refused(#[case] value: &str, #[case] what: &str) {
        let err = Recipe::parse(value).unwrap_err();
        assert_eq!(err.what, what);
        assert!(err.to_string().contains(&format!("{value:?}")), "{err}");
        assert!(err.to_string().contains("must match"), "{err}");
    }

    #[rstest]
    #[case("1.0.0+1.2.3")]
    #[case("main")]
    #[case("refs/heads/feature/x")]
    #[case("0123456789abcdef0123456789abcdef01234567")]
    fn good_refs(#[case] value: &str) {
        // Recipe release tags carry a '+': they must be accepted.
        GitRef::parse(value).unwrap();
    }

    #[rstest]
    #[case("a..b", "must not contain")]
    #[case("-x", "must not start")]
    #[case("a b", "must match")]
    #[case("", "must match")]
    fn bad_refs(#[case] value: &str, #[case] rule: &str) {
        assert!(GitRef::parse(value).unwrap_err().rule.contains(rule));
    }

    #[test]
    fn long_suffix_is_a_configuration_error() {
        let err = DomainSuffix::parse(&format!("{}.example.org", "a".repeat(30))).unwrap_err();
        assert!(err.rule.contains("at most 33"), "{err}");
        DomainSuffix::parse(&format!("{}.org", "a".repeat(29))).unwrap();
    }

    #[test]
    fn run_id_falls_back_to_manual_pid() {
        let id = RunId::resolve(None, &DroneBuild::default()).unwrap();
        assert_eq!(id.as_str(), format!("manual-{}", std::process::id()));
        let build = |repo: Option<&str>, number: &str| DroneBuild {
            repo: repo.map(str::to_owned),
            number: Some(number.to_owned()),
        };
        assert_eq!(
            RunId::resolve(Some("7"), &build(Some("a/b"), "9"))
                .unwrap()
                .as_str(),
            "7"
        );
        assert_eq!(
            RunId::resolve(None, &build(None, "9")).unwrap().as_str(),
            "9"
        );
    }

    #[rstest]
    #[case("coop-cloud/lemp", "120", "coop-cloud.lemp.120")]
    #[case("coop-cloud/custom-html", "120", "coop-cloud.custom-html.120")]
    #[case("Some_Org/Rec_1", "3", "Some_Org.Rec_1.3")]
    fn run_id_carries_the_repository(#[case] repo: &str, #[case] n: &str, #[case] id: &str) {
        let drone = DroneBuild {
            repo: Some(repo.to_owned()),
            number: Some(n.to_owned()),
        };
        assert_eq!(RunId::resolve(None, &drone).unwrap().as_str(), id);
    }

    #[test]
    fn run_ids_of_repositories_that_read_alike_differ() {
        let id = |repo: &str| {
            RunId::resolve(
                None,
                &DroneBuild {
                    repo: Some(repo.to_owned()),
                    number: Some("120".to_owned()),
                },
            )
            .unwrap()
            .to_string()
        };
        let long = format!("coop-cloud/{}", "x".repeat(80));
        let longer = format!("{long}y");
        let all = [
            id("a.b/c"),
            id("a/b.c"),
            id("a/b-c"),
            id(&long),
            id(&longer),
            id("ü/x"),
        ];
        for (i, a) in all.iter().enumerate() {
            RunId::parse(a).unwrap();
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert!(
            all[0].ends_with(".120") && all[0].starts_with("a-b-c."),
            "{}",
            all[0]
        );
        let bad = DroneBuild {
            repo: Some("a/b".to_owned()),
            number: Some("bad/../id".to_owned()),
        };
        let err = RunId::resolve(None, &bad).unwrap_err();
        assert_eq!(err.value, "bad/../id");
    }

    proptest! {
        #[test]
        fn every_valid_recipe_yields_a_run_app_domain(
            recipe in "[a-z0-9][a-z0-9_-]{0,63}",
            pr in proptest::option::of("[0-9]{1,10}"),
            git_ref in proptest::option::of("[A-Za-z0-9._/-]{1,40}"),
        ) {
            let recipe = Recipe::parse(&recipe).unwrap();
            let pr = pr.map(|p| PrNumber::parse(&p).unwrap());
            let git_ref = git_ref.and_then(|r| GitRef::parse(&r).ok());
            let suffix = suffix();
            let pattern = RunAppPattern::new(&suffix);
            let domain = AppDomain::derive(recipe.as_str(), pr.as_ref(), git_ref.as_ref(), &suffix);
            prop_assert!(pattern.matches(domain.as_str()), "{domain} does not match {:?}", pattern);
            prop_assert!(domain.stack_name().len() <= MAX_STACK_NAME_LEN);
            prop_assert_eq!(pattern.domain_of_stack(&domain.stack_name()), Some(domain.clone()));
            prop_assert_eq!(pattern.domain_of_lock_file(&domain.lock_file_name()), Some(domain.clone()));
            let service = format!("{}_app", domain.stack_name());
            prop_assert_eq!(pattern.domain_of_resource(&service), Some(domain.clone()));
            let container = format!("/{}_app.1.x1y2z3", domain.stack_name());
            prop_assert_eq!(pattern.domain_of_resource(&container), Some(domain));
        }

        #[test]
        fn any_string_validates_without_panicking(value in "\\PC{0,80}") {
            let _ = Recipe::parse(&value);
            let _ = GitRef::parse(&value);
            let _ = RunId::parse(&value);
            let _ = DomainSuffix::parse(&value);
            let pattern = RunAppPattern::new(&suffix());
            let _ = pattern.domain_of_stack(&value);
            let _ = pattern.domain_of_lock_file(&value);
            let _ = pattern.domain_of_resource(&value);
        }
    }

    #[rstest]
    #[case(
        "ccci-run-42-1234-98765-4026531836-c2049.77",
        Some("1234-98765-4026531836-c2049.77")
    )]
    #[case("ccci-lock-pkg-cache-99-1-7-c1.2", Some("99-1-7-c1.2"))]
    #[case("ccci-run-42-1234-98765", None)]
    #[case("ccci-1-2-3-c1.2", None)]
    #[case("other-run-1-2-3-c1.2", None)]
    #[case("ccci-", None)]
    fn group_names_name_their_owner(#[case] name: &str, #[case] want: Option<&str>) {
        assert_eq!(cgroup_owner(name), want);
    }

    #[test]
    fn a_run_s_cgroup_names_its_run() {
        let owner = "7-99-4026531836-c1.2";
        assert_eq!(
            run_of_cgroup(&cgroup_name("run", "pr-12", owner)),
            Some("pr-12")
        );
        assert_eq!(run_of_cgroup(&cgroup_name("lock", "deploy", owner)), None);
    }

    #[test]
    fn cgroup_names_round_trip() {
        let name = cgroup_name("run", "manual-3", "4321-1000000-5-c1.2");
        assert_eq!(cgroup_owner(&name), Some("4321-1000000-5-c1.2"));
    }

    proptest::proptest! {
        /// Any document of any strings (long, hostile: controls, C1, bidi, backslashes,
        /// quotes) stays valid JSON whose decoded strings carry nothing a terminal acts on,
        /// and a document with nothing to escape is left as it is.
        #[test]
        fn json_documents_carry_no_control_or_bidi_character(
            values in proptest::collection::vec(
                "(\\PC|[\\x00-\\x1f\\x7f\\u{80}-\\u{9f}\\u{202a}-\\u{202e}\\u{2066}-\\u{2069}\\\\\"])*",
                0..4
            ),
            long in 0usize..80_000,
        ) {
            let mut values = values;
            values.push("\u{202e}x".repeat(long / 2));
            let doc = serde_json::to_string_pretty(&serde_json::json!({"a": values, "k": 1})).unwrap();
            let shown = visible_json(&doc);
            let back: serde_json::Value = serde_json::from_str(&shown).unwrap();
            for v in back["a"].as_array().unwrap() {
                let v = v.as_str().unwrap();
                proptest::prop_assert!(!v.chars().any(needs_escape), "{v:?}");
            }
            proptest::prop_assert_eq!(visible_json(&shown), shown.clone());
            proptest::prop_assert!(!visible_text(&shown).chars().any(|c| c != '\n' && needs_escape(c)));
        }
    }

    #[test]
    fn json_escapes_read_as_runs_json_writes_them() {
        let doc =
            serde_json::to_string(&serde_json::json!(["a\u{1b}[31m\n\u{202e}b\u{85}", "c\\d"]))
                .unwrap();
        let back: Vec<String> = serde_json::from_str(&visible_json(&doc)).unwrap();
        assert_eq!(back, ["a\\u{1b}[31m\\n\\u{202e}b\\u{85}", "c\\d"]);
    }
}
