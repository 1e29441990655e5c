//! The names that come from outside, each validated by its rule: a recipe, a pull request,
//! a ref, a run id, a lock name, a stack name, a domain suffix, and the app domain derived
//! from them.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

use std::fmt;
use std::sync::LazyLock;

use regex_lite::Regex;
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

/// Named lock files are `ccci-<NAME>.lock`; the queue in front of one is `<file>.queue`.
pub(crate) const NAMED_LOCK_PREFIX: &str = "ccci-";
pub(crate) const NAMED_LOCK_SUFFIX: &str = ".lock";
pub(crate) const QUEUE_SUFFIX: &str = ".queue";

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

/// App lock files are `cc-ci-app-<domain>.lock`.
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
            regex_lite::escape(suffix.as_str())
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
