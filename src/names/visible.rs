//! Text from outside made safe to show: on a terminal, in JSON, in a path.
//!
//! Floor: ground (docs/architecture.md): imports nothing above the ground.

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
pub(super) fn needs_escape(c: char) -> bool {
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
