//! Method-override signals: what makes an upstream framework run another
//! method than the request line's. Rack's `MethodOverride` (on in Rails),
//! Laravel and Symfony, Express's `method-override` and others read the
//! method from a header (`X-HTTP-Method-Override`, `X-HTTP-Method`,
//! `X-Method-Override`) or from a `_method` parameter of the query or of the
//! body (a form, a multipart form, or, in Laravel, a JSON object). A request
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

/// An override in the request's head: one of the headers, or `_method` in
/// the query (its name percent-decoded: `%5Fmethod`).
pub fn in_head(headers: &HeaderMap, query: Option<&str>) -> bool {
    headers.keys().any(|n| is_override_header(n.as_str())) || query.is_some_and(|q| names_field(form_urlencoded::parse(q.as_bytes())))
}

fn names_field<'a>(pairs: impl Iterator<Item = (std::borrow::Cow<'a, str>, std::borrow::Cow<'a, str>)>) -> bool {
    pairs.into_iter().any(|(name, _)| name.trim().eq_ignore_ascii_case(FIELD))
}

/// How a body could carry `_method`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// `application/x-www-form-urlencoded`, or no content type at all (Rack
    /// reads a POST without one as a form).
    Form,
    Multipart,
    Json,
}

/// The kind of body a framework may read `_method` from, by the request's
/// content type; `None` for other bodies.
pub fn body_kind(headers: &HeaderMap) -> Option<BodyKind> {
    let Some(value) = headers.get(http::header::CONTENT_TYPE) else { return Some(BodyKind::Form) };
    let essence = value.to_str().ok()?.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    match essence.as_str() {
        "" | "application/x-www-form-urlencoded" => Some(BodyKind::Form),
        "multipart/form-data" => Some(BodyKind::Multipart),
        e if e == "application/json" || e.ends_with("+json") => Some(BodyKind::Json),
        _ => None,
    }
}

/// Whether a body of `kind` names `_method`: a form's field, a multipart
/// part's name (in any of its part headers), a JSON object's top-level
/// member. A body that does not parse names nothing here (the route's own
/// checks refuse it where it matters).
pub fn in_body(kind: BodyKind, body: &[u8]) -> bool {
    match kind {
        BodyKind::Form => names_field(form_urlencoded::parse(body)),
        BodyKind::Multipart => multipart_names_field(body),
        BodyKind::Json => {
            // Most bodies never spell it, not even escaped: no parse then.
            let maybe = memmem(body, b"method") || memmem(body, b"\\u");
            maybe
                && serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body)
                    .is_ok_and(|object| object.keys().any(|k| k.eq_ignore_ascii_case(FIELD)))
        }
    }
}

/// A multipart body whose part headers mention `_method` (as the name of
/// a part, quoted or not, or in an RFC 2231 `name*=`): read without the
/// boundary, so that a body with a misleading boundary parameter cannot hide
/// a part a lenient parser would find.
fn multipart_names_field(body: &[u8]) -> bool {
    let lower = body.to_ascii_lowercase();
    let mut at = 0;
    while let Some(found) = lower.get(at..).and_then(|rest| find(rest, b"content-disposition")) {
        let start = at + found;
        let end = lower.get(start..).and_then(|rest| find(rest, b"\n")).map_or(lower.len(), |e| start + e);
        if lower.get(start..end).is_some_and(|line| memmem(line, FIELD.as_bytes())) {
            return true;
        }
        at = end;
    }
    false
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn memmem(haystack: &[u8], needle: &[u8]) -> bool {
    find(haystack, needle).is_some()
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
    fn bodies_signal_an_override_by_their_kind() {
        assert_eq!(body_kind(&HeaderMap::new()), Some(BodyKind::Form));
        assert_eq!(body_kind(&headers(&[("content-type", "Application/X-WWW-Form-Urlencoded; charset=utf-8")])), Some(BodyKind::Form));
        assert_eq!(body_kind(&headers(&[("content-type", "multipart/form-data; boundary=x")])), Some(BodyKind::Multipart));
        assert_eq!(body_kind(&headers(&[("content-type", "application/merge-patch+json")])), Some(BodyKind::Json));
        assert_eq!(body_kind(&headers(&[("content-type", "application/octet-stream")])), None);
        assert!(in_body(BodyKind::Form, b"a=1&_method=DELETE"));
        assert!(in_body(BodyKind::Form, b"%5Fmethod=DELETE"));
        assert!(!in_body(BodyKind::Form, b"a=1&method=DELETE"));
        assert!(in_body(BodyKind::Json, br#"{"a":1,"_method":"DELETE"}"#));
        assert!(in_body(BodyKind::Json, br#"{"a":1,"\u005fmethod":"DELETE"}"#));
        assert!(!in_body(BodyKind::Json, br#"{"a":{"_method":"DELETE"}}"#));
        assert!(!in_body(BodyKind::Json, br#"[{"_method":"DELETE"}]"#));
        let part = b"--b\r\nContent-Disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n--b--\r\n";
        assert!(in_body(BodyKind::Multipart, part));
        let other = b"--b\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\n_method\r\n--b--\r\n";
        assert!(!in_body(BodyKind::Multipart, other));
    }
}
