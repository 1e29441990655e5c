//! The names a recipe gives Docker's objects under an app's stack name, and the pattern
//! that recognises a run app by its domain, its stack name or its lock file.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

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
