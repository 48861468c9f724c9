//! Where a route's idempotency key comes from (`key_from`): a request header
//! (the `Idempotency-Key` header by default, or another one such as
//! `x-client-order-id`), or a member of a JSON body named by a JSON Pointer
//! (`body:/client_order_id`), for legacy clients that send no key but carry
//! a business identifier. A list means "the first source present wins"; the
//! record keeps which one gave the key (`key_source`).
//!
//! Whatever the source, the value is validated like any key (1-255 bytes of
//! visible ASCII); the key's scope stays `(tenant, principal, operation,
//! key)`. A body value may be a JSON string or an integer (written in
//! decimal, exactly, whatever its size); any other JSON type counts as
//! absent, as does a missing member or a body that is not JSON.

use std::fmt;
use std::sync::Arc;

use http::{HeaderMap, HeaderName};

use crate::idempotency::fingerprint::{self, BodyKind, FingerprintError, JsonPointer, JsonScalar};
use crate::idempotency::key::{IdempotencyKey, KeyError};

/// One place a key may be found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// A request header; several values of it are refused as ambiguous.
    Header(HeaderName),
    /// A member of a JSON body (`application/json` or `*/*+json`).
    Body(JsonPointer),
}

/// Why a `key_from` entry was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeySourceSyntaxError {
    #[error("{0:?} is not a key source: write \"header:<name>\" or \"body:<JSON Pointer>\" (e.g. \"body:/client_order_id\")")]
    Unknown(String),
    #[error("invalid header name {0:?}")]
    BadHeader(String),
    #[error("invalid JSON Pointer: {0}")]
    BadPointer(fingerprint::PointerError),
}

impl KeySource {
    /// Parses `header:<name>` (case-insensitive name) or `body:<JSON Pointer>`.
    pub fn parse(s: &str) -> Result<KeySource, KeySourceSyntaxError> {
        if let Some(name) = s.strip_prefix("header:") {
            let name = name.trim();
            return HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes())
                .map(KeySource::Header)
                .map_err(|_| KeySourceSyntaxError::BadHeader(name.to_owned()));
        }
        if let Some(pointer) = s.strip_prefix("body:") {
            return JsonPointer::parse(pointer).map(KeySource::Body).map_err(KeySourceSyntaxError::BadPointer);
        }
        Err(KeySourceSyntaxError::Unknown(s.to_owned()))
    }
}

/// `header:<name>` or `body:<pointer>`, as configured and as the record shows it.
impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Header(name) => write!(f, "header:{name}"),
            KeySource::Body(pointer) => write!(f, "body:{pointer}"),
        }
    }
}

/// A route's key sources, tried in order (never empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySources {
    sources: Vec<KeySource>,
    /// `sources[i].to_string()`, made once: every claim records one of them.
    labels: Vec<Arc<str>>,
}

/// A key and the source that gave it.
#[derive(Debug, Clone)]
pub struct FoundKey {
    pub key: IdempotencyKey,
    /// The source's label, e.g. `body:/client_order_id` (the record's `key_source`).
    pub source: Arc<str>,
}

/// What the headers alone tell.
#[derive(Debug)]
pub enum FromHeaders {
    /// A header source before any body source is present.
    Found(FoundKey),
    /// No header source before the first body source is present: the body decides.
    NeedBody,
    /// Only header sources, none present.
    Absent,
}

/// Why no key could be taken from a request that has one.
#[derive(Debug, thiserror::Error)]
pub enum KeySourceError {
    /// A source is present but its value is not a valid key (or a header repeats).
    #[error(transparent)]
    Key(#[from] KeyError),
    /// The body is not valid JSON (the fingerprint would refuse it too).
    #[error(transparent)]
    Body(#[from] FingerprintError),
}

impl KeySources {
    /// The sources, in order. `None` if the list is empty.
    pub fn new(sources: Vec<KeySource>) -> Option<KeySources> {
        if sources.is_empty() {
            return None;
        }
        let labels = sources.iter().map(|s| Arc::from(s.to_string())).collect();
        Some(KeySources { sources, labels })
    }

    /// The default: one header (`key_header`).
    pub fn header(name: HeaderName) -> KeySources {
        KeySources { labels: vec![Arc::from(format!("header:{name}"))], sources: vec![KeySource::Header(name)] }
    }

    pub fn sources(&self) -> &[KeySource] {
        &self.sources
    }

    /// Whether a body source is among them (the body must then be read
    /// before the key is known, unless an earlier header source is present).
    pub fn reads_body(&self) -> bool {
        self.sources.iter().any(|s| matches!(s, KeySource::Body(_)))
    }

    /// The header of a route whose only source is one header.
    pub fn single_header(&self) -> Option<&HeaderName> {
        match self.sources.as_slice() {
            [KeySource::Header(name)] => Some(name),
            _ => None,
        }
    }

    /// Where the key is looked for, for the `missing-idempotency-key` problem:
    /// "the idempotency-key header", "the body member /id", or several joined
    /// with "or".
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .sources
            .iter()
            .map(|s| match s {
                KeySource::Header(name) => format!("the {name} header"),
                KeySource::Body(pointer) => format!("the JSON body member {pointer}"),
            })
            .collect();
        parts.join(" or ")
    }

    /// Looks at the header sources up to the first body source. Lets a route
    /// whose key is in a header refuse a missing key (or pass the request
    /// through) without reading the body.
    pub fn from_headers(&self, headers: &HeaderMap) -> Result<FromHeaders, KeyError> {
        for (source, label) in self.sources.iter().zip(&self.labels) {
            match source {
                KeySource::Header(name) => {
                    if let Some(key) = header_key(headers, name)? {
                        return Ok(FromHeaders::Found(FoundKey { key, source: label.clone() }));
                    }
                }
                KeySource::Body(_) => return Ok(FromHeaders::NeedBody),
            }
        }
        Ok(FromHeaders::Absent)
    }

    /// Tries every source in order with the whole body at hand; `None` when
    /// none is present. A present source with an invalid value is an error
    /// (it does not fall through to the next source): the client sent
    /// something it meant as a key.
    pub fn from_request(&self, headers: &HeaderMap, body: &[u8]) -> Result<Option<FoundKey>, KeySourceError> {
        let is_json = !body.is_empty() && fingerprint::body_kind(headers) == BodyKind::Json;
        for (source, label) in self.sources.iter().zip(&self.labels) {
            let key = match source {
                KeySource::Header(name) => header_key(headers, name)?,
                KeySource::Body(_) if !is_json => None,
                KeySource::Body(pointer) => match fingerprint::json_value_at(body, pointer)? {
                    Some(JsonScalar::String(s)) => Some(IdempotencyKey::new(&s)?),
                    Some(JsonScalar::Integer(digits)) => Some(IdempotencyKey::new(&digits)?),
                    Some(JsonScalar::Other) | None => None,
                },
            };
            if let Some(key) = key {
                return Ok(Some(FoundKey { key, source: label.clone() }));
            }
        }
        Ok(None)
    }
}

/// The key in one header: absent, or validated. Several values are ambiguous
/// and refused.
fn header_key(headers: &HeaderMap, name: &HeaderName) -> Result<Option<IdempotencyKey>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else { return Ok(None) };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    IdempotencyKey::parse(first).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn sources(list: &[&str]) -> KeySources {
        KeySources::new(list.iter().map(|s| KeySource::parse(s).unwrap()).collect()).unwrap()
    }

    fn json_headers(extra: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("content-type", HeaderValue::from_static("application/json"));
        for (k, v) in extra {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    fn key(s: &KeySources, headers: &HeaderMap, body: &str) -> Result<Option<(String, String)>, KeySourceError> {
        s.from_request(headers, body.as_bytes()).map(|f| f.map(|f| (f.key.as_str().to_owned(), f.source.to_string())))
    }

    #[test]
    fn parses_and_displays_sources() {
        assert_eq!(KeySource::parse("header:X-Client-Order-Id").unwrap().to_string(), "header:x-client-order-id");
        assert_eq!(KeySource::parse("body:/order/id").unwrap().to_string(), "body:/order/id");
        assert!(matches!(KeySource::parse("/client_order_id"), Err(KeySourceSyntaxError::Unknown(_))));
        assert!(matches!(KeySource::parse("header:bad name"), Err(KeySourceSyntaxError::BadHeader(_))));
        assert!(matches!(KeySource::parse("body:"), Err(KeySourceSyntaxError::BadPointer(_))));
        assert!(matches!(KeySource::parse("body:client_order_id"), Err(KeySourceSyntaxError::BadPointer(_))));
        assert!(KeySources::new(vec![]).is_none());
        let s = sources(&["header:x-request-id", "body:/id"]);
        assert_eq!(s.describe(), "the x-request-id header or the JSON body member /id");
        assert!(s.reads_body());
        assert!(s.single_header().is_none());
        assert_eq!(
            KeySources::header(HeaderName::from_static("idempotency-key")).single_header().map(|h| h.as_str()),
            Some("idempotency-key")
        );
    }

    #[test]
    fn strings_and_integers_of_any_size_are_keys() {
        let s = sources(&["body:/client_order_id"]);
        let h = json_headers(&[]);
        assert_eq!(key(&s, &h, r#"{"client_order_id": "A-17"}"#).unwrap(), Some(("A-17".into(), "body:/client_order_id".into())));
        assert_eq!(key(&s, &h, r#"{"client_order_id": 42}"#).unwrap(), Some(("42".into(), "body:/client_order_id".into())));
        assert_eq!(key(&s, &h, r#"{"client_order_id": -7}"#).unwrap().unwrap().0, "-7");
        // Beyond u64 and past 2^53: exact digits, never rounded through a double.
        let big = "123456789012345678901234567890";
        assert_eq!(key(&s, &h, &format!(r#"{{"client_order_id": {big}}}"#)).unwrap().unwrap().0, big);
        assert_eq!(key(&s, &h, r#"{"client_order_id": 9007199254740993}"#).unwrap().unwrap().0, "9007199254740993");
        // A JSON string is unescaped first, then validated.
        assert_eq!(key(&s, &h, r#"{"client_order_id": "a\u0042c"}"#).unwrap().unwrap().0, "aBc");
        // Nested pointers and array elements.
        let nested = sources(&["body:/order/refs/1"]);
        assert_eq!(key(&nested, &h, r#"{"order": {"refs": ["x", "y"]}}"#).unwrap().unwrap().0, "y");
    }

    #[test]
    fn other_types_and_missing_members_are_absent() {
        let s = sources(&["body:/client_order_id"]);
        let h = json_headers(&[]);
        for body in [
            r#"{}"#,
            r#"{"client_order_id": null}"#,
            r#"{"client_order_id": true}"#,
            r#"{"client_order_id": 1.5}"#,
            r#"{"client_order_id": 1e3}"#,
            r#"{"client_order_id": {"id": 1}}"#,
            r#"{"client_order_id": [1]}"#,
            r#"[1, 2]"#,
            r#""just a string""#,
            "",
        ] {
            assert!(key(&s, &h, body).unwrap().is_none(), "{body}");
        }
        // Not JSON by its content type: the body is not looked into.
        let text = HeaderMap::new();
        assert!(key(&s, &text, r#"{"client_order_id": "A-17"}"#).unwrap().is_none());
    }

    #[test]
    fn present_but_invalid_values_are_errors() {
        let s = sources(&["body:/id", "header:x-id"]);
        let h = json_headers(&[("x-id", "fallback")]);
        assert!(matches!(key(&s, &h, r#"{"id": ""}"#), Err(KeySourceError::Key(KeyError::Empty))));
        assert!(matches!(key(&s, &h, r#"{"id": "has space"}"#), Err(KeySourceError::Key(KeyError::NotVisibleAscii))));
        assert!(matches!(key(&s, &h, &format!(r#"{{"id": "{}"}}"#, "k".repeat(256))), Err(KeySourceError::Key(KeyError::TooLong))));
        assert!(matches!(key(&s, &h, r#"{"id": "a", "id": "b"}"#), Err(KeySourceError::Body(_))));
        assert!(matches!(key(&s, &h, r#"{"id": "#), Err(KeySourceError::Body(_))));
        // A repeated header is ambiguous.
        let repeated = json_headers(&[("x-id", "a"), ("x-id", "b")]);
        assert!(matches!(key(&s, &repeated, "{}"), Err(KeySourceError::Key(KeyError::Repeated))));
    }

    #[test]
    fn the_first_present_source_wins() {
        let s = sources(&["header:x-client-order-id", "body:/client_order_id", "header:idempotency-key"]);
        let both = json_headers(&[("x-client-order-id", "H-1"), ("idempotency-key", "K-1")]);
        let body = r#"{"client_order_id": "B-1"}"#;
        assert_eq!(key(&s, &both, body).unwrap(), Some(("H-1".into(), "header:x-client-order-id".into())));
        let key_only = json_headers(&[("idempotency-key", "K-1")]);
        assert_eq!(key(&s, &key_only, body).unwrap(), Some(("B-1".into(), "body:/client_order_id".into())));
        assert_eq!(key(&s, &key_only, "{}").unwrap(), Some(("K-1".into(), "header:idempotency-key".into())));
        assert!(key(&s, &json_headers(&[]), "{}").unwrap().is_none());
    }

    #[test]
    fn headers_alone_decide_until_the_first_body_source() {
        let s = sources(&["header:x-a", "body:/id", "header:x-b"]);
        let found = s.from_headers(&json_headers(&[("x-a", "1")])).unwrap();
        assert!(matches!(found, FromHeaders::Found(f) if f.key.as_str() == "1" && &*f.source == "header:x-a"));
        // x-b comes after a body source: the body must be read first.
        assert!(matches!(s.from_headers(&json_headers(&[("x-b", "1")])).unwrap(), FromHeaders::NeedBody));
        let headers_only = sources(&["header:x-a", "header:x-b"]);
        assert!(
            matches!(headers_only.from_headers(&json_headers(&[("x-b", "2")])).unwrap(), FromHeaders::Found(f) if &*f.source == "header:x-b")
        );
        assert!(matches!(headers_only.from_headers(&json_headers(&[])).unwrap(), FromHeaders::Absent));
        assert!(matches!(headers_only.from_headers(&json_headers(&[("x-a", "bad key")])), Err(KeyError::NotVisibleAscii)));
    }
}
