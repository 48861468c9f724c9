//! RFC 6901 JSON Pointers, as used by `fingerprint.exclude` and `fingerprint.defaults`.
//!
//! Only pointers that name a member or element *inside* the document are accepted:
//! the empty pointer `""` (the whole document) cannot be excluded or defaulted, so it
//! is rejected at parse time rather than silently meaning "hash nothing".

use std::fmt;
use std::str::FromStr;

/// Why a string is not a usable JSON Pointer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PointerError {
    /// `""` refers to the whole document; excluding or defaulting it is meaningless.
    #[error("the empty JSON Pointer refers to the whole document and cannot be excluded or defaulted; name a member such as \"/trace_id\"")]
    Empty,
    /// Every non-empty RFC 6901 pointer starts with `/`.
    #[error("a JSON Pointer must start with '/' (got {pointer:?}); did you mean \"/{pointer}\"?")]
    MissingLeadingSlash { pointer: String },
    /// `~` must be followed by `0` (for `~`) or `1` (for `/`).
    #[error("invalid escape at byte {position} of JSON Pointer {pointer:?}: '~' must be followed by '0' or '1'")]
    InvalidEscape { pointer: String, position: usize },
}

/// A parsed RFC 6901 JSON Pointer: the original text plus its unescaped reference tokens.
///
/// Tokens are matched against object member names exactly (after JSON unescaping of the
/// document), and against array elements when the token is a canonical array index
/// (`0`, or digits without a leading zero).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct JsonPointer {
    /// The pointer as written, kept for error messages and config round-trips.
    text: String,
    /// Unescaped reference tokens (`~1` -> `/`, `~0` -> `~`); never empty.
    tokens: Vec<String>,
}

impl JsonPointer {
    /// Parses an RFC 6901 pointer. Rejects `""`, strings not starting with `/`, and
    /// `~` not followed by `0` or `1`.
    pub fn parse(s: &str) -> Result<JsonPointer, PointerError> {
        let Some(rest) = s.strip_prefix('/') else {
            return Err(if s.is_empty() { PointerError::Empty } else { PointerError::MissingLeadingSlash { pointer: s.to_owned() } });
        };
        let mut tokens = Vec::new();
        // Byte offset of `rest` within `s`, for error positions.
        let mut offset = 1;
        for raw in rest.split('/') {
            tokens.push(unescape(raw).map_err(|at| PointerError::InvalidEscape { pointer: s.to_owned(), position: offset + at })?);
            offset += raw.len() + 1;
        }
        Ok(JsonPointer { text: s.to_owned(), tokens })
    }

    /// The pointer as it was written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The unescaped reference tokens, outermost first (at least one).
    pub fn tokens(&self) -> &[String] {
        &self.tokens
    }
}

/// Unescapes one reference token; on error returns the byte index of the bad `~`.
fn unescape(raw: &str) -> Result<String, usize> {
    if !raw.contains('~') {
        return Ok(raw.to_owned());
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.char_indices();
    while let Some((i, c)) = chars.next() {
        if c == '~' {
            match chars.next() {
                Some((_, '0')) => out.push('~'),
                Some((_, '1')) => out.push('/'),
                _ => return Err(i),
            }
        } else {
            out.push(c);
        }
    }
    Ok(out)
}

/// Appends `token` to `out` as an escaped RFC 6901 reference token (with its leading `/`).
pub(crate) fn push_escaped_token(out: &mut String, token: &str) {
    out.push('/');
    for c in token.chars() {
        match c {
            '~' => out.push_str("~0"),
            '/' => out.push_str("~1"),
            c => out.push(c),
        }
    }
}

/// Interprets `token` as an RFC 6901 array index: `0` or digits without a leading zero.
/// `-` (one past the end) and anything else yield `None`.
pub(crate) fn array_index(token: &str) -> Option<usize> {
    let bytes = token.as_bytes();
    let well_formed = match bytes {
        [] => false,
        [b'0'] => true,
        [b'0', ..] => false,
        _ => bytes.iter().all(u8::is_ascii_digit),
    };
    if well_formed { token.parse().ok() } else { None }
}

impl FromStr for JsonPointer {
    type Err = PointerError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        JsonPointer::parse(s)
    }
}

impl fmt::Display for JsonPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for JsonPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JsonPointer({:?})", self.text)
    }
}

/// Lets config structs hold `Vec<JsonPointer>` directly; invalid pointers fail the load.
impl<'de> serde::Deserialize<'de> for JsonPointer {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(deserializer)?;
        JsonPointer::parse(&text).map_err(serde::de::Error::custom)
    }
}

impl serde::Serialize for JsonPointer {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(s: &str) -> Vec<String> {
        match JsonPointer::parse(s) {
            Ok(p) => p.tokens().to_vec(),
            Err(e) => panic!("{s:?} should parse: {e}"),
        }
    }

    #[test]
    fn parses_simple_and_nested_pointers() {
        assert_eq!(tokens("/trace_id"), ["trace_id"]);
        assert_eq!(tokens("/a/b/0"), ["a", "b", "0"]);
        assert_eq!(tokens("/"), [""]);
        assert_eq!(tokens("//"), ["", ""]);
        assert_eq!(tokens("/a b/ü"), ["a b", "ü"]);
    }

    #[test]
    fn unescapes_tilde_sequences_left_to_right() {
        assert_eq!(tokens("/a~1b"), ["a/b"]);
        assert_eq!(tokens("/m~0n"), ["m~n"]);
        // "~01" is "~" followed by a literal "1", not "/".
        assert_eq!(tokens("/~01"), ["~1"]);
        assert_eq!(tokens("/~10"), ["/0"]);
    }

    #[test]
    fn keeps_original_text() {
        let p = JsonPointer::parse("/a~1b/c").map_err(|e| e.to_string());
        assert_eq!(p.as_ref().map(JsonPointer::as_str), Ok("/a~1b/c"));
        assert_eq!(p.map(|p| p.to_string()), Ok("/a~1b/c".to_owned()));
    }

    #[test]
    fn rejects_empty_pointer_with_clear_message() {
        let err = JsonPointer::parse("");
        assert_eq!(err, Err(PointerError::Empty));
        let msg = PointerError::Empty.to_string();
        assert!(msg.contains("whole document"), "{msg}");
    }

    #[test]
    fn rejects_missing_leading_slash() {
        assert_eq!(JsonPointer::parse("trace_id"), Err(PointerError::MissingLeadingSlash { pointer: "trace_id".into() }));
        assert_eq!(JsonPointer::parse("#/a"), Err(PointerError::MissingLeadingSlash { pointer: "#/a".into() }));
    }

    #[test]
    fn rejects_bad_escapes_with_position() {
        assert_eq!(JsonPointer::parse("/a~2"), Err(PointerError::InvalidEscape { pointer: "/a~2".into(), position: 2 }));
        assert_eq!(JsonPointer::parse("/ok/b~"), Err(PointerError::InvalidEscape { pointer: "/ok/b~".into(), position: 5 }));
        assert!(JsonPointer::parse("/~").is_err());
    }

    #[test]
    fn array_index_follows_rfc6901() {
        assert_eq!(array_index("0"), Some(0));
        assert_eq!(array_index("17"), Some(17));
        assert_eq!(array_index("01"), None);
        assert_eq!(array_index("-"), None);
        assert_eq!(array_index("+1"), None);
        assert_eq!(array_index(""), None);
        assert_eq!(array_index("1a"), None);
        assert_eq!(array_index("99999999999999999999999999"), None);
    }

    #[test]
    fn escaping_round_trips() {
        let mut s = String::new();
        push_escaped_token(&mut s, "a/b~c");
        assert_eq!(s, "/a~1b~0c");
        assert_eq!(tokens(&s), ["a/b~c"]);
    }

    #[test]
    fn deserializes_from_config_strings() {
        let ok: Result<Vec<JsonPointer>, _> = serde_json::from_str(r#"["/a", "/b~1c"]"#);
        let ok = ok.map_err(|e| e.to_string());
        assert_eq!(ok.map(|v| v.iter().map(|p| p.as_str().to_owned()).collect::<Vec<_>>()), Ok(vec!["/a".to_owned(), "/b~1c".to_owned()]));
        let bad: Result<JsonPointer, _> = serde_json::from_str(r#""""#);
        let msg = bad.map(|p| p.to_string()).unwrap_or_else(|e| e.to_string());
        assert!(msg.contains("whole document"), "{msg}");
    }
}
