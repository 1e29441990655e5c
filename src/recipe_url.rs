//! The recipe repository's URL: the template it is made from, and how it is shown.
//!
//! Invariant: credentials in a URL (user information, a query string, a fragment) never reach
//! a message, a log line or a record: whatever shows a URL shows [`redact`]'s form of it.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

use crate::names::Recipe;

/// The default recipe URL template; `{recipe}` is replaced by the recipe name.
pub(crate) const DEFAULT_URL_TEMPLATE: &str = "https://git.coopcloud.tech/coop-cloud/{recipe}.git";

/// The parts of a recipe URL that may carry a secret: the user information (`user:pass@`, in
/// `scheme://` URLs and scp-style `user:pass@host:path` alike), the query string and the
/// fragment (tokens travel there too).
#[derive(Debug, Default, PartialEq, Eq)]
struct SecretParts<'a> {
    userinfo: Option<&'a str>,
    query: Option<&'a str>,
    fragment: Option<&'a str>,
}

fn secret_parts(url: &str) -> SecretParts<'_> {
    let mut parts = SecretParts::default();
    if let Some((_, rest)) = url.split_once("://") {
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        parts.userinfo = rest[..end].rsplit_once('@').map(|(info, _)| info);
        let after = &rest[end..];
        let (before_fragment, fragment) = match after.split_once('#') {
            Some((b, f)) => (b, Some(f)),
            None => (after, None),
        };
        parts.fragment = fragment;
        parts.query = before_fragment.split_once('?').map(|(_, q)| q);
    } else if let Some((info, host)) = url.rsplit_once('@') {
        // scp-style `user[:secret]@host:path`; a local path with an `@` in it has a `/` before.
        if !info.contains('/') && host.contains(':') {
            parts.userinfo = Some(info);
        }
    }
    parts
}

/// `url` with its user information, query string and fragment replaced by `***`, fit for
/// messages, logs and records.
pub(crate) fn redact(url: &str) -> String {
    let parts = secret_parts(url);
    let mut shown = url.to_owned();
    if let Some(info) = parts.userinfo.filter(|i| !i.is_empty()) {
        shown = shown.replacen(&format!("{info}@"), "***@", 1);
    }
    if let Some(query) = parts.query.filter(|q| !q.is_empty()) {
        shown = shown.replacen(&format!("?{query}"), "?***", 1);
    }
    if let Some(fragment) = parts.fragment.filter(|f| !f.is_empty()) {
        shown = shown.replacen(&format!("#{fragment}"), "#***", 1);
    }
    shown
}

/// Every secret piece of a URL, to scrub from messages libgit2 composes.
fn secrets_of(url: &str) -> Vec<String> {
    let parts = secret_parts(url);
    let mut secrets = Vec::new();
    if let Some(info) = parts.userinfo {
        secrets.push(info.to_owned());
        if let Some((_, password)) = info.split_once(':') {
            secrets.push(password.to_owned());
        }
    }
    for piece in [parts.query, parts.fragment].into_iter().flatten() {
        secrets.push(piece.to_owned());
        // `token=SECRET&x=y`: each value on its own, in case a message quotes only that.
        secrets.extend(
            piece
                .split('&')
                .filter_map(|kv| kv.split_once('=').map(|(_, v)| v.to_owned())),
        );
    }
    secrets.retain(|s| s.len() >= 3);
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    secrets
}

/// `message` with the URL shown redacted and every secret piece of it replaced by `***`.
pub(crate) fn scrub(message: &str, url: &str) -> String {
    let mut message = message.replace(url, &redact(url));
    for secret in secrets_of(url) {
        message = message.replace(&secret, "***");
    }
    message
}

/// The recipe URL: the flag, else the template with `{recipe}` filled in.
pub(crate) fn recipe_url(flag: Option<&str>, template: Option<&str>, recipe: &Recipe) -> String {
    match flag {
        Some(url) => url.to_owned(),
        None => template
            .unwrap_or(DEFAULT_URL_TEMPLATE)
            .replace("{recipe}", recipe.as_str()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case(
        "https://user:hunter2@git.example.org/r.git",
        "https://***@git.example.org/r.git"
    )]
    #[case(
        "https://token@git.example.org/r.git",
        "https://***@git.example.org/r.git"
    )]
    #[case("https://git.example.org/r.git", "https://git.example.org/r.git")]
    #[case("https://u:p@ss@host:8443", "https://***@host:8443")]
    #[case("/srv/git/r.git", "/srv/git/r.git")]
    #[case("https://host/x.git?token=SECRET", "https://host/x.git?***")]
    #[case("https://u:p@host/x.git#SECRET", "https://***@host/x.git#***")]
    #[case(
        "https://host/x.git?a=1&token=SECRET#frag",
        "https://host/x.git?***#***"
    )]
    #[case("https://host?token=SECRET", "https://host?***")]
    #[case("user:SECRET@host:x.git", "***@host:x.git")]
    #[case("git@host:coop-cloud/x.git", "***@host:coop-cloud/x.git")]
    #[case("/srv/a@b/x.git", "/srv/a@b/x.git")]
    #[case("file:///srv/git/r.git", "file:///srv/git/r.git")]
    fn urls_are_redacted(#[case] url: &str, #[case] shown: &str) {
        assert_eq!(redact(url), shown);
    }

    #[test]
    fn scrub_removes_passwords_from_any_message() {
        let url = "https://alice:hunter2@127.0.0.1:1/r.git";
        let msg = format!("failed to connect to {url}; auth hunter2 rejected for alice:hunter2");
        let clean = scrub(&msg, url);
        assert!(!clean.contains("hunter2"), "{clean}");
        assert!(clean.contains("https://***@127.0.0.1:1/r.git"), "{clean}");
    }

    #[test]
    fn template_fills_in_the_recipe() {
        let recipe = Recipe::parse("keycloak").unwrap();
        assert_eq!(
            recipe_url(None, None, &recipe),
            "https://git.coopcloud.tech/coop-cloud/keycloak.git"
        );
        assert_eq!(
            recipe_url(None, Some("/srv/{recipe}"), &recipe),
            "/srv/keycloak"
        );
        assert_eq!(
            recipe_url(Some("file:///x"), Some("/srv/{recipe}"), &recipe),
            "file:///x"
        );
    }
}
