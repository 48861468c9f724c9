//! Method-override signals: what makes an upstream framework run another
//! method than the request line's. Rack's `MethodOverride` (on in Rails),
//! Laravel and Symfony, Express's `method-override` and others read the
//! method from a header (`X-HTTP-Method-Override`, `X-HTTP-Method`,
//! `X-Method-Override`) or from a `_method` parameter of the query or of the
//! body (a form, a multipart form, or, in Laravel, a JSON object); ASP.NET
//! MVC 5 also reads `X-HTTP-Method-Override` as a form field or a query
//! parameter. A request
//! carrying one on a path a route protects is refused
//! ([`Router::route_normal`](super::Router::route_normal) for the head,
//! [`in_body`] once the body is read): the gateway would identify, claim and
//! fingerprint one operation while the upstream ran another.
//!
//! Header names are compared as CGI-style servers fold them (letter case,
//! `_` and `-` alike), so `X_HTTP_Method_Override` counts too when header
//! names with `_` are allowed through.

use http::HeaderMap;

use crate::upstream::headers::is_override_header;

/// The parameter frameworks read an overriding method from.
const FIELD: &str = "_method";

/// The header's name, which ASP.NET MVC 5 also reads as a form field or a
/// query parameter (lower case, as [`spells_field`] compares).
const HEADER_FIELD: &[u8] = b"x-http-method-override";

/// An override in the request's head: one of the headers, or `_method` in
/// the query, in any spelling [`in_body`]'s scan finds (`%5Fmethod`,
/// `.method`, ...).
pub fn in_head(headers: &HeaderMap, query: Option<&str>) -> bool {
    headers.keys().any(|n| is_override_header(n.as_str())) || query.is_some_and(|q| spells_field(q.as_bytes()))
}

/// Whether a body with these headers is read and looked at for `_method`:
/// every body except one whose content type no framework parses for
/// parameters (binary media: streamed as they come). The type's essence is
/// taken as frameworks take it (see `essence`); a body without a content
/// type is read (Rack reads a POST without one as a form). A type that
/// holds `/json` or `+json` anywhere, in any letter case, is read whatever
/// its essence: Laravel's `isJson()` asks only that, and then reads
/// `_method` from the body as JSON (`application/octet-stream; x=/json`).
pub fn body_read(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(http::header::CONTENT_TYPE) else { return true };
    if contains_ignoring_case(value.as_bytes(), b"/json") || contains_ignoring_case(value.as_bytes(), b"+json") {
        return true;
    }
    let essence = essence(value.as_bytes());
    let binary = [&b"image/"[..], b"audio/", b"video/", b"font/"].iter().any(|p| essence.starts_with(p))
        || [&b"application/octet-stream"[..], b"application/pdf", b"application/zip", b"application/gzip"].contains(&&essence[..]);
    !binary
}

/// A Content-Type value's essence as frameworks take it: lower case, up to
/// the first `;`, `,` or space (Rack splits on `;` and `,`, PHP also on a
/// space), from the raw bytes (a value with bytes above ASCII still names a
/// form to Rack).
fn essence(value: &[u8]) -> Vec<u8> {
    let start = value.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(value.len());
    let rest = &value[start..];
    rest.iter().position(|b| matches!(b, b';' | b',' | b' ' | b'\t')).map_or(rest, |end| &rest[..end]).to_ascii_lowercase()
}

/// Whether the request's body is typed as JSON (`application/json`, or a
/// `+json` structured suffix), so that no framework parses it as a form.
fn typed_json(headers: &HeaderMap) -> bool {
    headers.get(http::header::CONTENT_TYPE).is_some_and(|v| {
        let essence = essence(v.as_bytes());
        essence == b"application/json" || (essence.ends_with(b"+json") && essence.iter().filter(|b| **b == b'/').count() == 1)
    })
}

/// Whether a body (sent with these headers) names `_method` where some
/// framework would read it. A JSON object is asked for a top-level member
/// (Laravel's reading), as parsed. Unless the body is typed as JSON
/// (`typed_json`), it is also scanned as bytes, parsed or not: Rack and PHP
/// read a form (or a body without a type) as a form whatever its first byte,
/// so `{"a":"&_method=DELETE&"}` has a field `_method` for them. JSON that
/// does not parse here (a number out of range, nesting deeper than serde's
/// limit: PHP's decoder takes both) is scanned too, whatever its type. The
/// scan looks for the name as a word in any spelling a framework reads as
/// `_method` or ASP.NET MVC 5 as `X-HTTP-Method-Override` (see
/// `spells_field`): a form's field, a multipart part's name in any header
/// (folded or not, `name`, `name*`, quoted or not, `Content-ID`), Rack's
/// `[_method]`, PHP's `.method`. The scan is deliberately wide: a body that
/// spells the word `_method` by itself anywhere, even as a value, is refused
/// on a path a route protects.
pub fn in_body(headers: &HeaderMap, body: &[u8]) -> bool {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    // A JSON key names it only spelled out or escaped: most bodies are not
    // parsed a second time.
    if matches!(first, Some(b'{' | b'['))
        && (contains_ignoring_case(body, b"method") || contains_ignoring_case(body, b"\\u"))
        && let Ok(value) = serde_json::from_slice::<serde_json::Value>(body)
    {
        let member = value.as_object().is_some_and(|object| object.keys().any(|k| k.trim().eq_ignore_ascii_case(FIELD)));
        return member || (!typed_json(headers) && spells_field(body));
    }
    spells_field(body)
}

/// Whether `text` spells `_method` (or `x-http-method-override`) as a name,
/// once decoded the ways frameworks decode names (`%XX`, `+` as a space,
/// JSON's `\uXXXX`) and letter case ignored: `method` right after `_` or
/// `.`, or `x-http-method-override`, that itself starts a word and is
/// followed by the word's end. A word starts at the text's start, or after
/// a separator such as `&`, `"`, `[`, `]`, `:`, a space or a line break; after
/// `=` only when that follows the word `name` (or `name*`), as a multipart
/// part's unquoted `name=_method`, which Rack, PHP and busboy take: any
/// other `=` ends a field's name, and what follows is its value. PHP reads a
/// `.` in a name as `_` (after dropping leading spaces), and Rack drops
/// brackets around a name; ASP.NET MVC 5 reads `X-HTTP-Method-Override` from
/// the form and the query as from the headers.
pub(crate) fn spells_field(text: &[u8]) -> bool {
    // Most texts never spell it, not even escaped: no copy is made of them.
    if !contains_ignoring_case(text, b"method") && !text.contains(&b'%') && !contains_ignoring_case(text, b"\\u") {
        return false;
    }
    let decoded = decode(text);
    let separates = |b: u8| matches!(b, b'&' | b';' | b'"' | b'\'' | b'[' | b']' | b'{' | b',' | b':' | 0 | b'\r' | b'\n' | b'\t' | b' ');
    // `name=` or `name*=` ending at `i` (the `=`), `name` a word of its own.
    let after_name = |i: usize| {
        let before = decoded.get(..i).unwrap_or_default();
        let before = before.strip_suffix(b"*").unwrap_or(before);
        before.strip_suffix(b"name").is_some_and(|head| head.last().is_none_or(|b| separates(*b)))
    };
    let starts_word = |at: Option<usize>| at.is_none_or(|i| separates(decoded[i]) || (decoded[i] == b'=' && after_name(i)));
    let ends_word = |at: usize| {
        decoded.get(at).is_none_or(|b| {
            matches!(b, b'&' | b';' | b'"' | b'\'' | b'[' | b']' | b'}' | b',' | b':' | b'=' | 0 | b'\r' | b'\n' | b'\t' | b' ')
        })
    };
    let mut from = 0;
    while let Some(found) = decoded.get(from..).and_then(|rest| find(rest, b"method")) {
        let at = from + found;
        if at >= 1 && matches!(decoded[at - 1], b'_' | b'.') && starts_word(at.checked_sub(2)) && ends_word(at + 6) {
            return true;
        }
        from = at + 1;
    }
    let mut from = 0;
    while let Some(found) = decoded.get(from..).and_then(|rest| find(rest, HEADER_FIELD)) {
        let at = from + found;
        if starts_word(at.checked_sub(1)) && ends_word(at + HEADER_FIELD.len()) {
            return true;
        }
        from = at + 1;
    }
    false
}

/// `text` lower-cased with `%XX`, `+` and `\uXXXX` (below 0x80) decoded,
/// once.
fn decode(text: &[u8]) -> Vec<u8> {
    let hex = |b: Option<&[u8]>| b.and_then(|b| std::str::from_utf8(b).ok()).and_then(|h| u8::from_str_radix(h, 16).ok());
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while let Some(&b) = text.get(i) {
        let escaped = text.get(i + 1).is_some_and(|n| *n == b'u' || *n == b'U');
        let (byte, width) = match b {
            b'%' => hex(text.get(i + 1..i + 3)).map_or((b, 1), |v| (v, 3)),
            // `\u00XX`: two hex digits of zeros, then the byte below 0x80.
            b'\\' if escaped && text.get(i + 2..i + 4) == Some(b"00") => {
                hex(text.get(i + 4..i + 6)).filter(|v| *v < 0x80).map_or((b, 1), |v| (v, 6))
            }
            b'+' => (b' ', 1),
            _ => (b, 1),
        };
        out.push(byte);
        i += width;
    }
    out.make_ascii_lowercase();
    out
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Whether `haystack` holds `needle` (lower-case ASCII) in any letter case.
fn contains_ignoring_case(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w.eq_ignore_ascii_case(needle))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(http::HeaderName::from_bytes(k.as_bytes()).unwrap(), HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn headers_and_query_signal_an_override_in_every_spelling() {
        for name in ["X-HTTP-Method-Override", "x-http-method", "X-Method-Override", "x_http_method_override", "X_METHOD-override"] {
            assert!(in_head(&headers(&[(name, "DELETE")]), None), "{name}");
        }
        for query in ["_method=PUT", "a=1&_method=DELETE", "%5Fmethod=put", "%5fMETHOD=x", "_method", "+_method+=x"] {
            assert!(in_head(&HeaderMap::new(), Some(query)), "{query}");
        }
        for query in ["method=PUT", "a=_method", "x_method=1", ""] {
            assert!(!in_head(&headers(&[("x-http-methods", "x"), ("x-method", "x")]), Some(query)), "{query}");
        }
    }

    #[test]
    fn bodies_are_read_unless_their_type_is_binary_media() {
        assert!(body_read(&HeaderMap::new()));
        for t in [
            "Application/X-WWW-Form-Urlencoded; charset=utf-8",
            "application/x-www-form-urlencoded, x",
            "multipart/mixed; boundary=x",
            "text/json",
            "application/x-json",
            "application/merge-patch+json",
            "text/plain",
            " application/octet-stream,application/x-www-form-urlencoded",
        ] {
            let binary = t.trim_start().starts_with("application/octet-stream");
            assert_eq!(body_read(&headers(&[("content-type", t)])), !binary, "{t}");
        }
        for t in ["application/octet-stream", "image/png", "video/mp4; codecs=x", "application/PDF"] {
            assert!(!body_read(&headers(&[("content-type", t)])), "{t}");
        }
        let mut h = HeaderMap::new();
        h.insert(http::header::CONTENT_TYPE, HeaderValue::from_bytes(b"application/x-www-form-urlencoded; x=\xff").unwrap());
        assert!(body_read(&h), "a value with a byte above ASCII");
    }

    #[test]
    fn bodies_signal_an_override_in_every_spelling_a_framework_reads() {
        let form = headers(&[("content-type", "application/x-www-form-urlencoded")]);
        let json = headers(&[("content-type", "application/json")]);
        let refused: &[&[u8]] = &[
            b"a=1&_method=DELETE",
            b"%5Fmethod=DELETE",
            b"_METHOD=put",
            b"+_method+=x",
            b"[_method]=DELETE",
            b"_method]=DELETE",
            b".method=DELETE",
            b"%20.method=DELETE",
            b"_method%00x=DELETE",
            br#"{"a":1,"_method":"DELETE"}"#,
            br#"{"a":1,"\u005fmethod":"DELETE"}"#,
            br#"{"_method":"DELETE","n":1e400}"#,
            b"--b\r\nContent-Disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n--b--\r\n",
            b"--b\r\nContent-Disposition: form-data;\r\n name=\"_method\"\r\n\r\nDELETE\r\n--b--\r\n",
            b"--b\r\nContent-ID: _method\r\n\r\nDELETE\r\n--b--\r\n",
            b"--b\r\nContent-Disposition: form-data; name*=utf-8''%5Fmethod\r\n\r\nDELETE\r\n--b--\r\n",
        ];
        for body in refused {
            assert!(in_body(&form, body), "{}", String::from_utf8_lossy(body));
        }
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let deep_with_field = format!(r#"{{"_method":"DELETE","x":{deep}}}"#);
        assert!(in_body(&json, deep_with_field.as_bytes()), "JSON nested deeper than the parser goes");
        let passed: &[&[u8]] = &[
            b"a=1&method=DELETE",
            b"tax_method=1&payment.method=card",
            b"a=_method",
            br#"{"shipping method":"post","payment_method":"card"}"#,
            // Words, not names: no framework reads ` method` as `_method`.
            b"note=Steps:+method+A",
            b"id, method\nid-1, card",
            b"def f(self, method):\n    return method",
            b"",
        ];
        for body in passed {
            assert!(!in_body(&form, body), "{}", String::from_utf8_lossy(body));
        }
        // Typed as JSON, a body is read as JSON only: a member below the top is no signal
        // (as a form, it would be scanned).
        for body in [&br#"{"a":{"_method":"DELETE"}}"#[..], br#"[{"_method":"DELETE"}]"#, br#"{"note":"use _method"}"#] {
            assert!(!in_body(&json, body), "{}", String::from_utf8_lossy(body));
            assert!(in_body(&form, body), "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn a_json_looking_body_of_another_type_is_scanned_as_a_form_too() {
        // Rack parses a form (or a POST without a content type) whatever its first byte:
        // `{"a":"` is one field's name, `_method=DELETE` the next field.
        let body: &[u8] = br#"{"a":"&_method=DELETE&"}"#;
        for t in [Some("application/x-www-form-urlencoded"), Some("multipart/form-data; boundary=x"), Some("text/plain"), None] {
            let h = headers(&t.map(|t| ("content-type", t)).into_iter().collect::<Vec<_>>());
            assert!(in_body(&h, body), "{t:?}");
        }
        let multipart: &[u8] = b"[\r\n--b\r\nContent-Disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n--b--\r\n]";
        assert!(in_body(&headers(&[("content-type", "multipart/form-data; boundary=b")]), multipart));
        // A JSON body read as JSON: only a top-level member names it.
        for t in ["application/json", "Application/JSON; charset=utf-8", "application/merge-patch+json", "application/vnd.api+json"] {
            assert!(!in_body(&headers(&[("content-type", t)]), body), "{t}");
            assert!(in_body(&headers(&[("content-type", t)]), br#"{"_method":"DELETE"}"#), "{t}");
        }
        // Still a JSON member when the type is not JSON's (Laravel reads JSON by a loose type).
        assert!(in_body(&headers(&[("content-type", "text/plain")]), br#"{"\u005fmethod":"DELETE"}"#));
    }

    #[test]
    fn an_unquoted_part_name_signals_an_override() {
        // Rack, PHP and busboy take `name=_method` without quotes.
        let h = headers(&[("content-type", "multipart/form-data; boundary=b")]);
        for body in [
            &b"--b\r\nContent-Disposition: form-data; name=_method\r\n\r\nDELETE\r\n--b--\r\n"[..],
            b"--b\r\nContent-Disposition: form-data;name=_METHOD\r\n\r\nDELETE\r\n--b--\r\n",
            b"--b\r\nContent-Disposition: form-data; NAME=_method; filename=x\r\n\r\nDELETE\r\n--b--\r\n",
            b"--b\r\nContent-Disposition: form-data; name*=_method\r\n\r\nDELETE\r\n--b--\r\n",
            b"--b\r\nContent-Disposition: form-data; name=%5Fmethod\r\n\r\nDELETE\r\n--b--\r\n",
        ] {
            assert!(in_body(&h, body), "{}", String::from_utf8_lossy(body));
        }
        // `=` starts a word only after `name` itself: another field's value is not a name.
        let form = headers(&[("content-type", "application/x-www-form-urlencoded")]);
        for body in [&b"username=_method"[..], b"a=_method", b"rename=_method"] {
            assert!(!in_body(&form, body), "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn a_json_marker_anywhere_in_the_content_type_reads_the_body() {
        // Laravel's `isJson()`: the Content-Type contains `/json` or `+json` anywhere.
        for t in ["application/octet-stream; x=/json", "image/png; a=+JSON", "application/pdf;/Json", "video/mp4 +json"] {
            assert!(body_read(&headers(&[("content-type", t)])), "{t}");
            assert!(in_body(&headers(&[("content-type", t)]), br#"{"_method":"DELETE"}"#), "{t}");
        }
        for t in ["application/octet-stream; x=json", "image/png; a=jsonp"] {
            assert!(!body_read(&headers(&[("content-type", t)])), "{t}");
        }
    }

    #[test]
    fn asp_net_mvc_reads_the_override_header_as_a_field() {
        // ASP.NET MVC 5 also reads `X-HTTP-Method-Override` from the form and the query.
        for query in ["X-HTTP-Method-Override=DELETE", "a=1&x-http-method-override=PUT", "x%2Dhttp%2Dmethod%2Doverride=PUT"] {
            assert!(in_head(&HeaderMap::new(), Some(query)), "{query}");
        }
        let form = headers(&[("content-type", "application/x-www-form-urlencoded")]);
        let multipart = headers(&[("content-type", "multipart/form-data; boundary=b")]);
        assert!(in_body(&form, b"item=1&X-HTTP-Method-Override=DELETE"));
        assert!(in_body(&multipart, b"--b\r\nContent-Disposition: form-data; name=\"X-HTTP-Method-Override\"\r\n\r\nPUT\r\n--b--\r\n"));
        for query in ["x-http-method-overrides=1", "my-x-http-method-override=1", "a=b-x-http-method-override"] {
            assert!(!in_head(&HeaderMap::new(), Some(query)), "{query}");
        }
    }
}
