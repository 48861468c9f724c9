//! The request fingerprint: the SHA-256 that decides whether a retried request with the
//! same idempotency key is "the same request" (replay) or not (`idempotency-key-reused`).
//!
//! # What enters the hash
//!
//! The hash input is a self-delimiting byte stream; every variable-length field is
//! written as an 8-byte big-endian length followed by its bytes, every list as an 8-byte
//! count followed by its items. In order:
//!
//! 1. the version tag `idemgate-fp-v4`;
//! 2. the method (`POST`);
//! 3. the operation (`create_order`);
//! 4. the path parameters, in template order: count, then name and value of each;
//! 5. the query string as urlencoded pairs, decoded and sorted by name with a stable
//!    sort (the values of one name keep their request order: `tag=a&tag=b` is not
//!    `tag=b&tag=a`): count, then name and value of each. An absent and an empty query
//!    are the same;
//! 6. for each header in `spec.headers`, in spec order: its lowercase name, then `0` if
//!    the request lacks it, or `1` and all its values joined with `", "` in order (so two
//!    `X: a` / `X: b` lines equal one `X: a, b` line, as HTTP says they do, while an
//!    absent header differs from an empty one);
//! 7. the body's media type: the `Content-Type` essence (type and subtype, lower case,
//!    parameters such as `charset` dropped: `Application/JSON; charset=utf-8` is
//!    `application/json`), empty when the header is absent or the body is empty. The
//!    same bytes sent as `application/json` and as `application/merge-patch+json` are
//!    two requests: an upstream may read them differently;
//! 8. a body-kind tag (`raw`, `json`, `form` or `multipart`) and the body:
//!    - `json` (`application/json` or any `*/*+json`, parameters ignored): the
//!      RFC 8785 canonical form after `defaults` and `exclude` are applied, except
//!      that every number is written as its exact decimal value (see
//!      [`canonical_json`]), streamed into the hasher. It is the last field, so it
//!      needs no length prefix;
//!    - `form` (`application/x-www-form-urlencoded`): pairs as for the query (one
//!      name's values in request order), after `defaults` and `exclude` are applied
//!      to fields named by one-token pointers. A body of that type that starts with `{`
//!      or `[` is JSON sent under the form type (curl's `-d`, Ruby's `Net::HTTP`
//!      by default), which an upstream that ignores the type reads as JSON: it is
//!      `raw`, since decoding it as a form would take `+` for a space;
//!    - `multipart` (`multipart/*` with a `boundary`): the parts between the
//!      delimiters, each length-prefixed, after a count: the same parts under
//!      another boundary (clients draw a new one for every request) are the same;
//!    - `raw` (any other or no content type): the bytes, length-prefixed.
//!
//!    An empty body is `raw` with no bytes whatever the content type, so a bodiless
//!    `POST` with `Content-Type: application/json` is accepted and equals one without.
//!
//! # Versions
//!
//! Version 3 (`idemgate-fp-v3`) was version 4 with numbers that have a fraction
//! or an exponent compared as the doubles nearest to them (so `1.000000000000000001`
//! and `1` were one amount), form-typed JSON decoded as a form, form fields without
//! `exclude` and `defaults`, and multipart bodies
//! as raw bytes (their boundary included). Version 2 (`idemgate-fp-v2`) was version 3 without the media type (field 7). Version
//! 1 (`idemgate-fp-v1`) was version 2 but for the order of query and form pairs, sorted
//! by (name, value), which took one name's values in another order for the same
//! request. A record keeps only its hash, not the version that made it, so
//! [`legacy_fingerprints`] computes what versions 3, 2 and 1 gave a request: the gateway
//! asks for them only when a record's hash differs from the request's, and a record
//! that matches one was written by that version for this request (up to what that
//! version did not tell apart: the media type, and for version 1 the order of one
//! name's values).
//!
//! # JSON bodies
//!
//! See [`canonical_json`]. Malformed JSON, invalid UTF-8, duplicate member names and
//! nesting deeper than [`MAX_DEPTH`] are errors (the gateway answers 400 `invalid-body`
//! and claims nothing); nothing here panics or recurses deeper than 64 levels on input.
//!
//! Floats are the correctly rounded doubles of their literals even though serde_json's
//! default float parser is not always correctly rounded: the parser re-reads each float
//! literal with `str::parse::<f64>` (see `tree::NumberCursor`), so enabling serde_json's
//! `float_roundtrip` feature is not needed, and would do no harm.

mod canonical;
mod form;
pub(crate) use form::hex_value;
mod pointer;
mod tree;

use std::fmt;
use std::str::FromStr;

use http::{HeaderMap, HeaderName, Method, header::CONTENT_TYPE};
use serde_json::Value;

use canonical::{HashSink, Sink};
pub use pointer::{JsonPointer, PointerError};

/// Deepest accepted nesting of arrays/objects in a JSON body, counted in containers:
/// `[]` is depth 1, and a document of 64 nested arrays is accepted while 65 is
/// [`FingerprintError::TooDeep`].
pub const MAX_DEPTH: usize = 64;

/// Tag that starts every hash input; bump it whenever the encoding changes (and keep
/// the previous encodings in [`legacy_fingerprints`] while records they wrote may exist).
const VERSION_TAG: &[u8] = b"idemgate-fp-v4";

/// Version 3's tag: numbers as doubles, form-typed JSON as a form, multipart as raw.
const V3_TAG: &[u8] = b"idemgate-fp-v3";

/// Version 2's tag: no media type.
const V2_TAG: &[u8] = b"idemgate-fp-v2";

/// Version 1's tag: no media type, pairs sorted by (name, value).
const V1_TAG: &[u8] = b"idemgate-fp-v1";

/// One encoding of the hash input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    V1,
    V2,
    V3,
    V4,
}

impl Version {
    fn tag(self) -> &'static [u8] {
        match self {
            Version::V1 => V1_TAG,
            Version::V2 => V2_TAG,
            Version::V3 => V3_TAG,
            Version::V4 => VERSION_TAG,
        }
    }

    fn pair_order(self) -> form::PairOrder {
        match self {
            Version::V1 => form::PairOrder::NameThenValue,
            Version::V2 | Version::V3 | Version::V4 => form::PairOrder::Name,
        }
    }

    fn hashes_media_type(self) -> bool {
        matches!(self, Version::V3 | Version::V4)
    }

    fn numbers(self) -> canonical::Numbers {
        match self {
            Version::V4 => canonical::Numbers::Exact,
            _ => canonical::Numbers::Doubles,
        }
    }

    /// Version 4 reads form-typed JSON as bytes and multipart bodies by part.
    fn reads_bodies_as_sent(self) -> bool {
        self == Version::V4
    }
}

/// Per-route fingerprint configuration (`fingerprint.*` in a `[[routes]]` entry).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FingerprintSpec {
    /// Members or array elements removed from a JSON body before hashing (e.g. a client
    /// trace id that differs between retries). A pointer to something absent is a no-op.
    /// Pointers are resolved against the document after `defaults`, independently of
    /// each other: `/items/0` and `/items/1` remove the first two elements.
    pub exclude: Vec<JsonPointer>,
    /// Values inserted where a JSON body lacks them, so omitting a field that has a
    /// server-side default equals sending that default. Applied in order, *before*
    /// `exclude` (an excluded path never enters the hash, default or not). Only inserts
    /// into an object that exists: a missing parent, or an array or scalar parent, is a
    /// no-op. A value already present, even `null`, is kept.
    pub defaults: Vec<(JsonPointer, Value)>,
    /// Request headers that enter the fingerprint (e.g. `api-version`), in this order.
    pub headers: Vec<HeaderName>,
}

/// A spec that could never fingerprint successfully.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("fingerprint default at {pointer} would nest {depth} levels deep, more than the {limit} a request body may have")]
    DefaultTooDeep { pointer: String, depth: usize, limit: usize },
}

impl FingerprintSpec {
    /// Checks what can be checked at config load: a default whose pointer depth plus
    /// value nesting exceeds [`MAX_DEPTH`] would make every request on the route fail.
    pub fn validate(&self) -> Result<(), SpecError> {
        for (pointer, value) in &self.defaults {
            let depth = pointer.tokens().len() + value_depth(value);
            if depth > MAX_DEPTH {
                return Err(SpecError::DefaultTooDeep { pointer: pointer.as_str().to_owned(), depth, limit: MAX_DEPTH });
            }
        }
        Ok(())
    }

    /// The spec as text, for the store's list of the settings an operation
    /// has had (a JSON object; equal specs give equal texts).
    pub fn to_text(&self) -> String {
        let defaults: Vec<Value> = self.defaults.iter().map(|(p, v)| Value::Array(vec![Value::from(p.as_str()), v.clone()])).collect();
        serde_json::json!({
            "exclude": self.exclude.iter().map(JsonPointer::as_str).collect::<Vec<_>>(),
            "defaults": defaults,
            "headers": self.headers.iter().map(HeaderName::as_str).collect::<Vec<_>>(),
        })
        .to_string()
    }

    /// A short name of the spec (hex of the first 16 bytes of the SHA-256 of
    /// [`FingerprintSpec::to_text`]): what a record keeps of the settings its
    /// hash was computed under.
    pub fn digest(&self) -> String {
        use sha2::{Digest, Sha256};
        Sha256::digest(self.to_text().as_bytes())[..16].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// [`FingerprintSpec::to_text`] read back (from the store: an error
    /// names what is wrong, never panics).
    pub fn from_text(text: &str) -> Result<FingerprintSpec, String> {
        let doc: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let list = |name: &str| doc.get(name).and_then(Value::as_array).cloned().ok_or_else(|| format!("no list {name:?}"));
        let string = |v: &Value| v.as_str().map(str::to_owned).ok_or_else(|| format!("not a string: {v}"));
        let exclude = list("exclude")?
            .iter()
            .map(|v| string(v).and_then(|s| JsonPointer::parse(&s).map_err(|e| e.to_string())))
            .collect::<Result<_, _>>()?;
        let defaults = list("defaults")?
            .iter()
            .map(|pair| match pair.as_array().map(Vec::as_slice) {
                Some([p, v]) => string(p).and_then(|s| JsonPointer::parse(&s).map_err(|e| e.to_string())).map(|p| (p, v.clone())),
                _ => Err(format!("not a [pointer, value] pair: {pair}")),
            })
            .collect::<Result<_, _>>()?;
        let headers = list("headers")?
            .iter()
            .map(|v| string(v).and_then(|s| HeaderName::from_str(&s).map_err(|e| e.to_string())))
            .collect::<Result<_, _>>()?;
        Ok(FingerprintSpec { exclude, defaults, headers })
    }
}

/// Container nesting of a value (scalar 0, `[]` 1), without recursion.
fn value_depth(value: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(value, 0usize)];
    while let Some((value, depth)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match value {
            Value::Array(items) => Box::new(items.iter()),
            Value::Object(map) => Box::new(map.values()),
            _ => continue,
        };
        let inner = depth + 1;
        deepest = deepest.max(inner);
        stack.extend(children.map(|child| (child, inner)));
    }
    deepest
}

/// SHA-256 of a request's canonical form; stored as the record's `request_hash`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lowercase hex, as `Display` writes it.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

/// Parses 64 hex digits (either case), e.g. a `request_hash` read back from the store.
impl FromStr for Fingerprint {
    type Err = hex::FromHexError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(s, &mut bytes)?;
        Ok(Fingerprint(bytes))
    }
}

/// Why a request body cannot be fingerprinted. All variants are the client's fault
/// (400 `invalid-body`); messages describe the body's shape, never its content beyond
/// the pointer of a duplicate member.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FingerprintError {
    #[error("request body is not valid JSON: {reason} at line {line} column {column}")]
    InvalidJson { line: usize, column: usize, reason: String },
    #[error("request body has a duplicate member name at JSON Pointer {pointer:?}")]
    DuplicateMember { pointer: String },
    #[error("request body nests arrays/objects deeper than {limit} levels")]
    TooDeep { limit: usize },
    #[error("request body is not valid UTF-8 (invalid byte at offset {valid_up_to})")]
    InvalidUtf8 { valid_up_to: usize },
}

/// The parts of a request that identify it.
#[derive(Debug, Clone, Copy)]
pub struct RequestParts<'a> {
    pub method: &'a Method,
    /// The route's `operation`.
    pub operation: &'a str,
    /// `{param}` captures, in template order.
    pub path_params: &'a [(String, String)],
    /// The raw query string, without `?`.
    pub query: Option<&'a str>,
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
}

/// How a body is read, from its `Content-Type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// `application/json` or `<type>/<subtype>+json`: canonical JSON.
    Json,
    /// `application/x-www-form-urlencoded`: decoded pairs sorted by name.
    Form,
    /// Anything else, no or unreadable `Content-Type`: the bytes as they are.
    Raw,
}

/// Classifies the (first) `Content-Type` header: media type compared case-insensitively,
/// parameters such as `charset` ignored.
pub fn body_kind(headers: &HeaderMap) -> BodyKind {
    let Some(value) = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return BodyKind::Raw;
    };
    let media = value.split(';').next().unwrap_or_default().trim_matches([' ', '\t']);
    let Some((kind, subtype)) = media.split_once('/') else {
        return BodyKind::Raw;
    };
    if kind.is_empty() || subtype.contains('/') {
        return BodyKind::Raw;
    }
    let json_suffix = subtype.len() > 5 && subtype.get(subtype.len() - 5..).is_some_and(|suffix| suffix.eq_ignore_ascii_case("+json"));
    if media.eq_ignore_ascii_case("application/json") || json_suffix {
        BodyKind::Json
    } else if media.eq_ignore_ascii_case("application/x-www-form-urlencoded") {
        BodyKind::Form
    } else {
        BodyKind::Raw
    }
}

/// Computes the fingerprint of a request (see the module docs for what enters it).
///
/// The body is validated before anything is hashed, so an invalid body costs no hashing.
pub fn fingerprint(spec: &FingerprintSpec, parts: &RequestParts<'_>) -> Result<Fingerprint, FingerprintError> {
    fingerprint_as(Version::V4, spec, parts)
}

/// The fingerprints earlier versions gave this request, newest first (version 3:
/// numbers as doubles; version 2: nor the media type; version 1: nor pairs in
/// request order), computed one at a time
/// as the iterator is read: for recognising records written by them, nothing else.
pub fn legacy_fingerprints<'a>(
    spec: &'a FingerprintSpec,
    parts: &'a RequestParts<'a>,
) -> impl Iterator<Item = Result<Fingerprint, FingerprintError>> + 'a {
    [Version::V3, Version::V2, Version::V1].into_iter().map(move |version| fingerprint_as(version, spec, parts))
}

/// The fingerprint version 1 gave this request (query and form pairs sorted by
/// (name, value)).
pub fn legacy_fingerprint(spec: &FingerprintSpec, parts: &RequestParts<'_>) -> Result<Fingerprint, FingerprintError> {
    fingerprint_as(Version::V1, spec, parts)
}

/// The media type a request's body is sent as: the `Content-Type` essence,
/// lower case, without parameters; empty without the header.
fn media_type(headers: &HeaderMap) -> String {
    headers
        .get(CONTENT_TYPE)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).split(';').next().unwrap_or_default().trim().to_ascii_lowercase())
        .unwrap_or_default()
}

fn fingerprint_as(version: Version, spec: &FingerprintSpec, parts: &RequestParts<'_>) -> Result<Fingerprint, FingerprintError> {
    let mut body = prepare_body(version, spec, parts.headers, parts.body)?;
    let mut out = HashSink::new();
    put_field(&mut out, version.tag());
    put_field(&mut out, parts.method.as_str().as_bytes());
    put_field(&mut out, parts.operation.as_bytes());
    put_len(&mut out, parts.path_params.len());
    for (name, value) in parts.path_params {
        put_field(&mut out, name.as_bytes());
        put_field(&mut out, value.as_bytes());
    }
    let query = form::sorted_pairs(parts.query.unwrap_or_default().as_bytes(), version.pair_order());
    form::write_pairs(&mut out, &query);
    put_len(&mut out, spec.headers.len());
    for name in &spec.headers {
        put_header(&mut out, parts.headers, name);
    }
    if version.hashes_media_type() {
        let media = if parts.body.is_empty() { String::new() } else { media_type(parts.headers) };
        put_field(&mut out, media.as_bytes());
    }
    match &mut body {
        Body::Raw(bytes) => {
            put_field(&mut out, b"raw");
            put_field(&mut out, bytes);
        }
        Body::Form(pairs) => {
            put_field(&mut out, b"form");
            form::write_pairs(&mut out, pairs);
        }
        Body::Parts(parts) => {
            put_field(&mut out, b"multipart");
            put_len(&mut out, parts.len());
            for part in parts {
                put_field(&mut out, part);
            }
        }
        Body::Json(root) => {
            put_field(&mut out, b"json");
            canonical::write_node(&mut out, root, 0, version.numbers())?;
        }
    }
    Ok(Fingerprint(out.finish()))
}

/// The RFC 8785 (JCS) canonical form of a JSON body after `spec.defaults` and then
/// `spec.exclude` are applied, exactly as [`fingerprint`] hashes it for JSON bodies.
///
/// - members sorted by name as UTF-16 code units; no insignificant whitespace;
/// - strings with only `\" \\ \b \f \n \r \t` and `\u00xx` (controls) escaped, so
///   `"\u0041"` and `"A"` are equal;
/// - every number as its exact decimal value: significant digits, then `e` and
///   the power of ten unless it is 0 (`1`, `1.0`, `1e0`, `10e-1` -> `1`; `1000`,
///   `1e3` -> `1e3`; `1.5` -> `15e-1`; `-0` -> `0`). JCS writes numbers as the
///   doubles nearest to them, which makes distinct ids such as `9007199254740993` and
///   `9007199254740992`, and distinct amounts such as `0.1` and
///   `0.10000000000000000001`, collide; we deliberately keep them apart. Two
///   spellings of one double compare equal when both are exact decimals of the
///   same value, which the shortest spellings that JavaScript, Python and Go write
///   are. Literals beyond the range of a double are refused as invalid JSON by
///   the parser.
///
/// An empty body yields empty bytes (no error); anything else must be one JSON value.
pub fn canonical_json(body: &[u8], spec: &FingerprintSpec) -> Result<Vec<u8>, FingerprintError> {
    if body.is_empty() {
        return Ok(Vec::new());
    }
    let mut root = json_tree(body, spec)?;
    let mut out = Vec::with_capacity(body.len());
    canonical::write_node(&mut out, &mut root, 0, Version::V4.numbers())?;
    Ok(out)
}

/// What a JSON body holds at a pointer (for keys taken from the body, a route's
/// `key_from = "body:<pointer>"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonScalar {
    /// A string, unescaped.
    String(String),
    /// An integer literal (no fraction, no exponent) of any size, as its exact
    /// decimal digits with an optional `-` (`-0` is `0`), as the fingerprint
    /// compares them: never rounded through a double.
    Integer(String),
    /// `null`, a boolean, a number with a fraction or an exponent, an array or
    /// an object.
    Other,
}

/// The value at `pointer` in a JSON body, if the member or element exists.
/// The body is parsed as [`fingerprint`] parses it (duplicate member names,
/// nesting deeper than [`MAX_DEPTH`] and invalid JSON are errors).
pub fn json_value_at(body: &[u8], pointer: &JsonPointer) -> Result<Option<JsonScalar>, FingerprintError> {
    let mut root = tree::parse(body)?;
    Ok(tree::navigate(&mut root, pointer.tokens()).map(|node| match node {
        tree::Node::Str(s) => JsonScalar::String(s.to_string()),
        tree::Node::U64(n) => JsonScalar::Integer(n.to_string()),
        tree::Node::I64(n) => JsonScalar::Integer(n.to_string()),
        tree::Node::BigInt(digits) => JsonScalar::Integer(digits.to_string()),
        _ => JsonScalar::Other,
    }))
}

/// A body ready to hash.
enum Body<'a> {
    Raw(&'a [u8]),
    Form(Vec<form::Pair<'a>>),
    /// A multipart body's parts, without its delimiters.
    Parts(Vec<&'a [u8]>),
    Json(tree::Node<'a>),
}

fn prepare_body<'a>(
    version: Version,
    spec: &'a FingerprintSpec,
    headers: &HeaderMap,
    body: &'a [u8],
) -> Result<Body<'a>, FingerprintError> {
    if body.is_empty() {
        return Ok(Body::Raw(body));
    }
    Ok(match body_kind(headers) {
        BodyKind::Raw if version.reads_bodies_as_sent() => match multipart_boundary(headers) {
            Some(boundary) => Body::Parts(multipart_parts(body, boundary.as_bytes())),
            None => Body::Raw(body),
        },
        BodyKind::Raw => Body::Raw(body),
        BodyKind::Form if version.reads_bodies_as_sent() && matches!(body.trim_ascii_start().first(), Some(b'{' | b'[')) => Body::Raw(body),
        BodyKind::Form if version.reads_bodies_as_sent() => Body::Form(form_fields(body, spec)),
        BodyKind::Form => Body::Form(form::sorted_pairs(body, version.pair_order())),
        BodyKind::Json => Body::Json(json_tree(body, spec)?),
    })
}

/// A form body's pairs after `spec.defaults` and then `spec.exclude`, as for a
/// JSON object: a pointer of one token names a field (`/authenticity_token`);
/// a default is a string, number or boolean (written as its text), added when
/// no pair has the name; an exclusion removes every pair of the name. Other
/// pointers and values do not apply to a form.
fn form_fields<'a>(body: &'a [u8], spec: &'a FingerprintSpec) -> Vec<form::Pair<'a>> {
    use std::borrow::Cow;
    let mut pairs = form::sorted_pairs(body, form::PairOrder::Name);
    let field = |pointer: &'a JsonPointer| match pointer.tokens() {
        [name] => Some(name.as_bytes()),
        _ => None,
    };
    let mut added = false;
    for (pointer, value) in &spec.defaults {
        let text = match value {
            Value::String(s) => Cow::Borrowed(s.as_bytes()),
            Value::Number(n) => Cow::Owned(n.to_string().into_bytes()),
            Value::Bool(b) => Cow::Borrowed(if *b { &b"true"[..] } else { &b"false"[..] }),
            _ => continue,
        };
        if let Some(name) = field(pointer)
            && !pairs.iter().any(|(n, _)| **n == *name)
        {
            pairs.push((Cow::Borrowed(name), text));
            added = true;
        }
    }
    if added {
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
    }
    let excluded: Vec<&[u8]> = spec.exclude.iter().filter_map(field).collect();
    if !excluded.is_empty() {
        pairs.retain(|(name, _)| !excluded.contains(&&**name));
    }
    pairs
}

/// The `boundary` parameter of a `multipart/*` content type (unquoted).
fn multipart_boundary(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(CONTENT_TYPE)?.to_str().ok()?;
    let mut params = value.split(';');
    let media = params.next()?.trim();
    if !media.get(..10).is_some_and(|m| m.eq_ignore_ascii_case("multipart/")) {
        return None;
    }
    params
        .find_map(|p| {
            let (name, v) = p.split_once('=')?;
            name.trim().eq_ignore_ascii_case("boundary").then(|| v.trim().trim_matches('"').to_owned())
        })
        .filter(|b| !b.is_empty())
}

/// A multipart body split at its delimiters (RFC 2046, section 5.1.1):
/// `--boundary` at the start of the body or of a line, followed by the end
/// of the line (white space allowed), by `--` (the last one), or by the end
/// of the body. What comes before the first, each part (with its headers),
/// and what follows the last. `--boundary` anywhere else is content: a
/// part's text `pay--Xnow` under boundary `X` is not a delimiter.
fn multipart_parts<'a>(body: &'a [u8], boundary: &[u8]) -> Vec<&'a [u8]> {
    let mut delimiter = b"--".to_vec();
    delimiter.extend_from_slice(boundary);
    let is_delimiter = |at: usize| {
        let line_start = at == 0 || body.get(at - 1) == Some(&b'\n');
        let after = body.get(at + delimiter.len()..).unwrap_or_default();
        let line_end = after.is_empty()
            || after.starts_with(b"--")
            || after.iter().position(|b| !matches!(b, b' ' | b'\t')).is_none_or(|i| matches!(after[i], b'\r' | b'\n'));
        line_start && line_end
    };
    let mut parts = Vec::new();
    let (mut from, mut at) = (0, 0);
    while let Some(found) = body.get(at..).and_then(|rest| rest.windows(delimiter.len()).position(|w| w == delimiter.as_slice())) {
        let pos = at + found;
        if is_delimiter(pos) {
            parts.push(&body[from..pos]);
            from = pos + delimiter.len();
        }
        at = pos + 1;
    }
    parts.push(&body[from..]);
    parts
}

/// Parses a JSON body and applies defaults, then exclusions.
fn json_tree<'a>(body: &'a [u8], spec: &'a FingerprintSpec) -> Result<tree::Node<'a>, FingerprintError> {
    let mut root = tree::parse(body)?;
    for (pointer, value) in &spec.defaults {
        tree::apply_default(&mut root, pointer, value);
    }
    for pointer in &spec.exclude {
        tree::apply_exclusion(&mut root, pointer);
    }
    Ok(root)
}

/// Writes a length or count as 8 bytes, big-endian.
pub(crate) fn put_len(out: &mut impl Sink, len: usize) {
    out.put(&(len as u64).to_be_bytes());
}

/// Writes a length-prefixed field.
pub(crate) fn put_field(out: &mut impl Sink, bytes: &[u8]) {
    put_len(out, bytes.len());
    out.put(bytes);
}

/// Name, then `0` (absent) or `1` and the values joined with `", "`.
fn put_header(out: &mut impl Sink, headers: &HeaderMap, name: &HeaderName) {
    put_field(out, name.as_str().as_bytes());
    let values = headers.get_all(name);
    let mut count = 0usize;
    let mut total = 0usize;
    for value in &values {
        count += 1;
        total += value.len();
    }
    if count == 0 {
        out.put(&[0]);
        return;
    }
    out.put(&[1]);
    put_len(out, total + 2 * (count - 1));
    for (i, value) in values.iter().enumerate() {
        if i > 0 {
            out.put(b", ");
        }
        out.put(value.as_bytes());
    }
}

#[cfg(test)]
mod tests;
