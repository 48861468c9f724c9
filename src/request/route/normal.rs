//! Request normalisation: the one rule for how a request's method and path
//! are spelled before anything routes, identifies, authorizes, fingerprints
//! or forwards it (docs/reference.md, "Request normalisation").
//!
//! - A method is a case-sensitive token (RFC 9110 section 9.1). A method that
//!   differs only in letter case from a route's method or from a standard one
//!   (`post`, `Post`, `delete`) is refused: frameworks that upper-case methods
//!   would run it as the method it spells.
//! - The path is put in normal form the way RFC 3986 section 6.2.2 allows
//!   without changing which resource it names: percent-encoded unreserved
//!   characters are decoded (`%6F` is `o`), other escapes get upper-case hex
//!   digits (`%c3` is `%C3`). Spellings whose meaning servers disagree on are
//!   refused instead of rewritten: dot segments (`.`, `..`, also encoded or
//!   followed by `;`), empty segments (`//`; a single trailing `/` is a path
//!   of its own), an encoded `/`, `\` or NUL, a literal `\`, malformed escapes,
//!   and a target that is not an absolute path.
//! - A normal path that routes nowhere for its method, but that a lenient
//!   server would read as a route's path of that method (letter case, a
//!   trailing `/` added or removed, `;` parameters, raw or encoded, stripped,
//!   trailing whitespace, control characters or dots trimmed from a segment,
//!   a format suffix such as `.json` after the last one), is refused, so it
//!   cannot reach an upstream without identity ([`loose`], [`names_loosely`]).
//!
//! The gateway forwards the normal path it routed; the query is forwarded as
//! the client sent it.

use std::borrow::Cow;

use http::Method;

use crate::idempotency::fingerprint::hex_value;

/// Why a request's method or path is refused before routing (400
/// `invalid-request`). The messages are for clients: fixed texts that never
/// echo the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum InvalidRequest {
    #[error("the method differs from a known method only in letter case; methods are case-sensitive")]
    MethodCase,
    #[error("the request target is not an absolute path")]
    NotAbsolutePath,
    #[error("the path has a '%' that is not followed by two hexadecimal digits")]
    MalformedEscape,
    #[error("the path has an encoded '/', '\\' or NUL")]
    EncodedSeparator,
    #[error("the path has a '\\'")]
    Backslash,
    #[error("the path has a '.' or '..' segment")]
    DotSegment,
    #[error("the path has an empty segment ('//')")]
    EmptySegment,
    #[error(
        "the path is a route's path spelled differently (letter case, a trailing '/', ';' parameters, a format suffix or trailing characters)"
    )]
    Ambiguous,
    #[error("the request carries a method override (a header or '_method') on a path a route protects")]
    MethodOverride,
    #[error("HEAD on the path of a GET route; send GET")]
    HeadOfGet,
    #[error("a header name contains '_'")]
    UnderscoreHeader,
}

/// The methods RFC 9110 and RFC 5789 define: a request spelling one of these in
/// other letter case is refused even when no route has it.
const STANDARD_METHODS: [&str; 9] = ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"];

/// Refuses a method that is not itself but a case variant of one of `known`
/// (upper case, as configuration stores route methods) or of a standard method.
pub fn check_method(method: &Method, known: &[Method]) -> Result<(), InvalidRequest> {
    let m = method.as_str();
    if !m.bytes().any(|b| b.is_ascii_lowercase()) {
        return Ok(());
    }
    let upper = m.to_ascii_uppercase();
    if upper != m && (STANDARD_METHODS.contains(&upper.as_str()) || known.iter().any(|k| k.as_str() == upper)) {
        return Err(InvalidRequest::MethodCase);
    }
    Ok(())
}

/// RFC 3986 section 2.3: ALPHA / DIGIT / "-" / "." / "_" / "~".
fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

const HEX_UPPER: &[u8; 16] = b"0123456789ABCDEF";

/// The normal form of a request path (without its query), or why it has none.
/// Borrows when the path is already normal.
pub fn normalise_path(raw: &str) -> Result<Cow<'_, str>, InvalidRequest> {
    if !raw.starts_with('/') {
        return Err(InvalidRequest::NotAbsolutePath);
    }
    let bytes = raw.as_bytes();
    let mut out: Option<Vec<u8>> = None;
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'\\' => return Err(InvalidRequest::Backslash),
            b'%' => {
                let hi = bytes.get(i + 1).copied().and_then(hex_value);
                let lo = bytes.get(i + 2).copied().and_then(hex_value);
                let (Some(hi), Some(lo)) = (hi, lo) else { return Err(InvalidRequest::MalformedEscape) };
                let value = hi << 4 | lo;
                if matches!(value, b'/' | b'\\' | 0) {
                    return Err(InvalidRequest::EncodedSeparator);
                }
                let spelled = bytes.get(i..i + 3).unwrap_or_default();
                let normal: [u8; 3] = [b'%', HEX_UPPER[usize::from(hi)], HEX_UPPER[usize::from(lo)]];
                if is_unreserved(value) {
                    out.get_or_insert_with(|| bytes.get(..i).unwrap_or_default().to_vec()).push(value);
                } else if spelled != normal {
                    out.get_or_insert_with(|| bytes.get(..i).unwrap_or_default().to_vec()).extend_from_slice(&normal);
                } else if let Some(o) = &mut out {
                    o.extend_from_slice(&normal);
                }
                i += 3;
                continue;
            }
            _ => {
                if let Some(o) = &mut out {
                    o.push(b);
                }
            }
        }
        i += 1;
    }
    let path: Cow<'_, str> = match out {
        None => Cow::Borrowed(raw),
        // Only ASCII was replaced by ASCII, so the text stays UTF-8; refuse
        // rather than panic should that ever not hold.
        Some(o) => Cow::Owned(String::from_utf8(o).map_err(|_| InvalidRequest::MalformedEscape)?),
    };
    check_segments(&path)?;
    Ok(path)
}

/// A segment's name: what precedes its first `;` parameter (raw, or encoded
/// as `%3B`: servers differ on which they honour).
fn segment_name(segment: &str) -> &str {
    let raw_end = segment.find(';').unwrap_or(segment.len());
    let encoded_end = segment.find("%3B").unwrap_or(segment.len());
    segment.get(..raw_end.min(encoded_end)).unwrap_or(segment)
}

/// No dot segments; no empty segments but a final one (a trailing `/`), and
/// no segment that is empty but for `;` parameters.
fn check_segments(path: &str) -> Result<(), InvalidRequest> {
    let rest = path.get(1..).unwrap_or_default();
    let mut segments = rest.split('/').peekable();
    while let Some(segment) = segments.next() {
        let name = segment_name(segment);
        if name == "." || name == ".." {
            return Err(InvalidRequest::DotSegment);
        }
        let last = segments.peek().is_none();
        if name.is_empty() && !(last && segment.is_empty()) {
            return Err(InvalidRequest::EmptySegment);
        }
    }
    Ok(())
}

/// A path as a lenient server might read it, for comparison only: each
/// segment fully percent-decoded, cut at its first `;` (before or after
/// decoding) and lower-cased; a trailing empty segment (a trailing `/`)
/// dropped.
pub(crate) fn loose(path: &str) -> Vec<Vec<u8>> {
    let rest = path.strip_prefix('/').unwrap_or(path);
    let mut segments: Vec<Vec<u8>> = rest.split('/').map(loose_segment).collect();
    if segments.len() > 1 && segments.last().is_some_and(|s| s.is_empty()) {
        segments.pop();
    }
    segments
}

fn loose_segment(segment: &str) -> Vec<u8> {
    let raw = segment.split(';').next().unwrap_or_default().as_bytes();
    let mut decoded = Vec::with_capacity(raw.len());
    let mut i = 0;
    while let Some(&b) = raw.get(i) {
        if b == b'%'
            && let (Some(hi), Some(lo)) = (raw.get(i + 1).copied().and_then(hex_value), raw.get(i + 2).copied().and_then(hex_value))
        {
            decoded.push(hi << 4 | lo);
            i += 3;
            continue;
        }
        decoded.push(b);
        i += 1;
    }
    if let Some(cut) = decoded.iter().position(|&b| b == b';') {
        decoded.truncate(cut);
    }
    decoded.make_ascii_lowercase();
    decoded
}

/// Whether a lenient server could take `part`, a request path's segment as
/// [`loose`] reads it, for `literal`, a template's segment read the same way:
/// the same, or the same once trailing whitespace (Unicode's too), control
/// characters and dots are trimmed (`orders%20`, `orders%09`, `orders.`);
/// the `last` segment also with anything after a `.` or such a character
/// (a format suffix: `orders.json`, `orders.tar.gz`, as Rails' `(.:format)`
/// routes it).
pub(crate) fn names_loosely(literal: &[u8], part: &[u8], last: bool) -> bool {
    if part == literal {
        return true;
    }
    let Some(rest) = part.strip_prefix(literal) else { return false };
    let rest = String::from_utf8_lossy(rest);
    let mut chars = rest.chars();
    let Some(first) = chars.next() else { return false };
    if !is_trimmed(first) {
        return false;
    }
    last || chars.all(is_trimmed)
}

/// What servers and frameworks trim from the end of a path or a segment.
fn is_trimmed(c: char) -> bool {
    c == '.' || c.is_whitespace() || c.is_control()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(raw: &str) -> Result<String, InvalidRequest> {
        normalise_path(raw).map(Cow::into_owned)
    }

    #[test]
    fn normal_paths_are_borrowed_unchanged() {
        for p in ["/", "/v1/orders", "/v1/orders/", "/v1/a%20b", "/v1/%C3%A9", "/v1/x;y=1", "/a-b_c.d~e", "/v1/.well-known", "/v1/..."] {
            assert!(matches!(normalise_path(p), Ok(Cow::Borrowed(q)) if q == p), "{p}");
        }
    }

    #[test]
    fn unreserved_escapes_are_decoded_and_others_upper_cased() {
        assert_eq!(n("/v1/%6Frders"), Ok("/v1/orders".into()));
        assert_eq!(n("/v1/%6frders"), Ok("/v1/orders".into()));
        assert_eq!(n("/%41%7a%30%2D%2e%5F%7E"), Ok("/Az0-._~".into()));
        assert_eq!(n("/v1/%c3%a9%20"), Ok("/v1/%C3%A9%20".into()));
        assert_eq!(n("/v1/a%3b"), Ok("/v1/a%3B".into()));
    }

    #[test]
    fn ambiguous_spellings_are_refused() {
        use InvalidRequest::*;
        let cases = [
            ("v1/orders", NotAbsolutePath),
            ("*", NotAbsolutePath),
            ("", NotAbsolutePath),
            ("//v1/orders", EmptySegment),
            ("/v1//orders", EmptySegment),
            ("//", EmptySegment),
            ("/v1/;x/orders", EmptySegment),
            ("/v1/orders/;x", EmptySegment),
            ("/v1/./orders", DotSegment),
            ("/v1/x/../orders", DotSegment),
            ("/..", DotSegment),
            ("/v1/.", DotSegment),
            ("/v1/%2e%2E/orders", DotSegment),
            ("/v1/%2e/orders", DotSegment),
            ("/v1/..;/orders", DotSegment),
            ("/v1/..%3b/orders", DotSegment),
            ("/v1/.;x=1/orders", DotSegment),
            ("/v1/orders%2F", EncodedSeparator),
            ("/v1/orders%2f..", EncodedSeparator),
            ("/v1/orders%5C", EncodedSeparator),
            ("/v1/orders%00", EncodedSeparator),
            ("/v1\\orders", Backslash),
            ("/v1/orders%", MalformedEscape),
            ("/v1/orders%4", MalformedEscape),
            ("/v1/orders%zz", MalformedEscape),
        ];
        for (raw, why) in cases {
            assert_eq!(n(raw), Err(why), "{raw}");
        }
    }

    #[test]
    fn normalising_twice_changes_nothing() {
        for p in ["/v1/%6Frders", "/a/%c3%a9", "/%7e/x;y", "/v1/orders/"] {
            let once = n(p).unwrap();
            assert_eq!(n(&once), Ok(once.clone()), "{p}");
        }
    }

    #[test]
    fn method_case_variants_of_known_methods_are_refused() {
        let known = [Method::POST, Method::from_bytes(b"PURGE").unwrap()];
        for ok in ["POST", "GET", "PURGE", "PROPFIND", "brew", "M-SEARCH"] {
            assert_eq!(check_method(&Method::from_bytes(ok.as_bytes()).unwrap(), &known), Ok(()), "{ok}");
        }
        for bad in ["post", "Post", "pOST", "get", "delete", "Patch", "purge", "options"] {
            assert_eq!(check_method(&Method::from_bytes(bad.as_bytes()).unwrap(), &known), Err(InvalidRequest::MethodCase), "{bad}");
        }
    }

    #[test]
    fn the_loose_reading_folds_case_parameters_escapes_and_a_trailing_slash() {
        let l = |p: &str| loose(p).into_iter().map(|s| String::from_utf8_lossy(&s).into_owned()).collect::<Vec<_>>();
        assert_eq!(l("/V1/Orders/"), ["v1", "orders"]);
        assert_eq!(l("/v1/orders;x=1"), ["v1", "orders"]);
        assert_eq!(l("/v1/orders%3Bx=1"), ["v1", "orders"]);
        assert_eq!(l("/v1/ord%45rs"), ["v1", "orders"]);
        assert_eq!(l("/"), [""]);
    }

    #[test]
    fn a_segment_is_read_without_trailing_junk_and_the_last_without_a_format_suffix() {
        for (part, last) in [
            ("orders", false),
            ("orders.", false),
            ("orders \t.", false),
            ("orders\u{a0}", false),
            ("orders\u{3000}", false),
            ("orders\u{b}", false),
            ("orders.json", true),
            ("orders.tar.gz", true),
            ("orders .json", true),
            ("orders.json ", true),
            ("orders\u{85}x", true),
        ] {
            assert!(names_loosely(b"orders", part.as_bytes(), last), "{part:?} last={last}");
        }
        for (part, last) in [
            ("ordersx", true),
            ("orders-archive.json", true),
            ("order", true),
            ("orders.json", false),
            ("orders x", false),
            ("xorders", true),
            ("", true),
        ] {
            assert!(!names_loosely(b"orders", part.as_bytes(), last), "{part:?} last={last}");
        }
    }
}
