//! The idempotency key and its scope.
//!
//! A record is found by its whole [`Scope`] — `(tenant, principal, operation,
//! key)` — never by the key alone, so a guessed or reused key in another scope
//! reaches nothing.

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, KeyInit, Mac};
use http::HeaderValue;
use sha2::{Digest, Sha256};

/// Longest accepted key, in bytes (after unquoting).
pub const MAX_KEY_LEN: usize = 255;

/// Why a presented key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the idempotency key is empty")]
    Empty,
    #[error("the idempotency key is longer than {MAX_KEY_LEN} bytes")]
    TooLong,
    #[error("the idempotency key must be visible ASCII (0x21-0x7e)")]
    NotVisibleAscii,
    #[error("the idempotency key is a malformed structured-field string")]
    BadQuoting,
    #[error("the idempotency key header appears more than once")]
    Repeated,
}

/// A validated client key: 1-255 bytes of visible ASCII.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(Arc<str>);

impl IdempotencyKey {
    /// Validates a header value. A structured-field string (`"abc"`, with `\"`
    /// and `\\` escapes) is unquoted; a bare value is taken as it is.
    pub fn parse(value: &HeaderValue) -> Result<IdempotencyKey, KeyError> {
        let raw = value.as_bytes();
        let raw = trim_ows(raw);
        if raw.len() > MAX_KEY_LEN + 2 + MAX_KEY_LEN {
            return Err(KeyError::TooLong);
        }
        if raw.first() == Some(&b'"') {
            IdempotencyKey::from_bytes(unquote_sf_string(raw)?)
        } else {
            IdempotencyKey::from_bytes(raw.to_vec())
        }
    }

    /// A key as stored or typed by an operator: validated, never unquoted.
    pub fn new(s: &str) -> Result<IdempotencyKey, KeyError> {
        IdempotencyKey::from_bytes(s.as_bytes().to_vec())
    }

    fn from_bytes(key: Vec<u8>) -> Result<IdempotencyKey, KeyError> {
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong);
        }
        if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
            return Err(KeyError::NotVisibleAscii);
        }
        // All bytes are ASCII, so this cannot fail; map rather than unwrap.
        let s = String::from_utf8(key).map_err(|_| KeyError::NotVisibleAscii)?;
        Ok(IdempotencyKey(s.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Keys are secrets of a sort (a guessable key is a capability), so Debug never
/// shows them; logs use [`Scope::log_id`].
impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey(..{} bytes)", self.0.len())
    }
}

fn trim_ows(mut b: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = b {
        b = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = b {
        b = rest;
    }
    b
}

/// RFC 8941 sf-string: `"` *( unescaped / `\"` / `\\` ) `"`.
fn unquote_sf_string(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    let inner = raw.strip_prefix(b"\"").and_then(|r| r.strip_suffix(b"\"")).ok_or(KeyError::BadQuoting)?;
    let mut out = Vec::with_capacity(inner.len());
    let mut it = inner.iter();
    while let Some(&b) = it.next() {
        match b {
            b'\\' => match it.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err(KeyError::BadQuoting),
            },
            b'"' => return Err(KeyError::BadQuoting),
            _ => out.push(b),
        }
    }
    Ok(out)
}

/// The primary key of a record.
/// The principal part of a tenant-wide scope (`scope = "tenant"`).
pub const TENANT_WIDE: &str = "";

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    pub tenant: Arc<str>,
    pub principal: Arc<str>,
    pub operation: Arc<str>,
    pub key: IdempotencyKey,
}

impl Scope {
    pub fn new(identity: &Identity, operation: &Arc<str>, key: IdempotencyKey) -> Scope {
        Scope { tenant: identity.tenant.clone(), principal: identity.principal.clone(), operation: operation.clone(), key }
    }

    /// The scope of a route with `scope = "tenant"`: every principal of the
    /// tenant shares the key space (the principal part is empty, which no
    /// identity source ever produces).
    pub fn tenant_wide(identity: &Identity, operation: &Arc<str>, key: IdempotencyKey) -> Scope {
        Scope { tenant: identity.tenant.clone(), principal: TENANT_WIDE.into(), operation: operation.clone(), key }
    }

    /// Whether `identity` may see records of this scope.
    pub fn visible_to(&self, identity: &Identity) -> bool {
        self.tenant == identity.tenant && (self.principal == identity.principal || &*self.principal == TENANT_WIDE)
    }

    /// Feeds the domain tag and the four fields, each length-prefixed (so
    /// ("ab", "c") and ("a", "bc") differ), to `update`.
    fn feed(&self, domain: &[u8], mut update: impl FnMut(&[u8])) {
        update(domain);
        for part in [self.tenant.as_bytes(), self.principal.as_bytes(), self.operation.as_bytes(), self.key.as_str().as_bytes()] {
            update(&(part.len() as u64).to_be_bytes());
            update(part);
        }
    }

    fn digest(&self, domain: &[u8]) -> [u8; 32] {
        let mut h = Sha256::new();
        self.feed(domain, |b| h.update(b));
        h.finalize().into()
    }

    /// The key forwarded upstream: derived from the whole scope, so it is
    /// stable across retries and replicas and distinct between scopes. With a
    /// secret (shared by all replicas) it is an HMAC, so nobody who knows a
    /// scope's parts can compute it and present it to the upstream directly.
    pub fn derived_key(&self, secret: Option<&[u8]>) -> String {
        let Some(secret) = secret else {
            return hex::encode(self.digest(b"idemgate/derived-key/v1"));
        };
        match <Hmac<Sha256> as KeyInit>::new_from_slice(secret) {
            Ok(mut mac) => {
                self.feed(b"idemgate/derived-key/v2-hmac", |b| mac.update(b));
                hex::encode(mac.finalize().into_bytes())
            }
            // HMAC takes keys of any length; kept total rather than unwrap.
            Err(_) => hex::encode(self.digest(b"idemgate/derived-key/v1")),
        }
    }

    /// A short, non-reversible id for logs (the raw key is never logged):
    /// [`Scope::scope_id`] in hex.
    pub fn log_id(&self) -> String {
        self.scope_id().to_string()
    }

    /// The scope's id: the first 8 bytes of a SHA-256 over the scope. Logs
    /// print it; records store it, so `idemgate keys show --scope-id` finds
    /// the record a log line is about.
    pub fn scope_id(&self) -> ScopeId {
        let d = self.digest(b"idemgate/log-id/v1");
        ScopeId(u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]]))
    }
}

/// A scope's id as logs print it (16 hex digits) and records store it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ScopeId(pub u64);

impl ScopeId {
    /// 16 hex digits, as logs print them (either case).
    pub fn parse(s: &str) -> Option<ScopeId> {
        let s = s.trim();
        if s.len() != 16 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u64::from_str_radix(s, 16).ok().map(ScopeId)
    }

    /// The stored form: the same 64 bits as a signed integer (SQL `bigint`).
    pub fn to_i64(self) -> i64 {
        i64::from_be_bytes(self.0.to_be_bytes())
    }

    pub fn from_i64(v: i64) -> ScopeId {
        ScopeId(u64::from_be_bytes(v.to_be_bytes()))
    }
}

impl fmt::Display for ScopeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// The trusted half of a key's scope.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    pub tenant: Arc<str>,
    pub principal: Arc<str>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &[u8]) -> Result<String, KeyError> {
        IdempotencyKey::parse(&HeaderValue::from_bytes(s).unwrap()).map(|k| k.as_str().to_owned())
    }

    #[test]
    fn accepts_visible_ascii_and_unquotes_sf_strings() {
        assert_eq!(parse(b"abc-123").unwrap(), "abc-123");
        assert_eq!(parse(b"\"8e03978e-40d5\"").unwrap(), "8e03978e-40d5");
        assert_eq!(parse(b"\"a\\\"b\\\\c\"").unwrap(), "a\"b\\c");
        assert_eq!(parse(b"  spaced  ").unwrap(), "spaced");
        assert_eq!(parse(&[b'k'; 255]).unwrap().len(), 255);
    }

    #[test]
    fn rejects_bad_keys() {
        assert_eq!(parse(b""), Err(KeyError::Empty));
        assert_eq!(parse(b"\"\""), Err(KeyError::Empty));
        assert_eq!(parse(&[b'k'; 256]), Err(KeyError::TooLong));
        assert_eq!(parse(&[b'k'; 10_000]), Err(KeyError::TooLong));
        assert_eq!(parse(b"has space"), Err(KeyError::NotVisibleAscii));
        assert_eq!(parse(b"\"has space\""), Err(KeyError::NotVisibleAscii));
        assert_eq!(parse(b"caf\xc3\xa9"), Err(KeyError::NotVisibleAscii));
        assert_eq!(parse(b"\"open"), Err(KeyError::BadQuoting));
        assert_eq!(parse(b"\"a\"b\""), Err(KeyError::BadQuoting));
        assert_eq!(parse(b"\"bad\\escape\""), Err(KeyError::BadQuoting));
    }

    fn scope(t: &str, p: &str, o: &str, k: &str) -> Scope {
        Scope { tenant: t.into(), principal: p.into(), operation: o.into(), key: IdempotencyKey::new(k).unwrap() }
    }

    #[test]
    fn keyed_derived_key_depends_on_the_secret() {
        let a = scope("acme", "billing", "create_order", "k1");
        let k1 = a.derived_key(Some(b"secret-one"));
        assert_eq!(k1, a.derived_key(Some(b"secret-one")), "stable for one secret");
        assert_ne!(k1, a.derived_key(Some(b"secret-two")));
        assert_ne!(k1, a.derived_key(None));
        assert_ne!(k1, scope("acme", "billing", "create_order", "k2").derived_key(Some(b"secret-one")));
        assert_eq!(k1.len(), 64);
    }

    #[test]
    fn derived_key_is_stable_and_scope_distinct() {
        let a = scope("acme", "billing", "create_order", "k1");
        assert_eq!(a.derived_key(None), scope("acme", "billing", "create_order", "k1").derived_key(None));
        assert_eq!(a.derived_key(None).len(), 64);
        for other in [
            scope("acme2", "billing", "create_order", "k1"),
            scope("acme", "billing2", "create_order", "k1"),
            scope("acme", "billing", "create_order2", "k1"),
            scope("acme", "billing", "create_order", "k2"),
            // Length prefixes keep field boundaries: ("ab","c") != ("a","bc").
            scope("acmeb", "illing", "create_order", "k1"),
        ] {
            assert_ne!(a.derived_key(None), other.derived_key(None));
        }
        assert_ne!(a.derived_key(None), a.log_id());
        assert!(!format!("{:?}", a).contains("k1"));
    }

    #[test]
    fn scope_id_round_trips_through_text_and_storage() {
        let a = scope("acme", "billing", "create_order", "k1");
        let id = a.scope_id();
        assert_eq!(a.log_id(), hex::encode(&a.digest(b"idemgate/log-id/v1")[..8]), "logs keep printing what they printed");
        assert_eq!(ScopeId::parse(&a.log_id()), Some(id));
        assert_eq!(ScopeId::parse(&a.log_id().to_uppercase()), Some(id));
        assert_eq!(ScopeId::from_i64(id.to_i64()), id);
        assert_eq!(ScopeId::from_i64(-1).to_string(), "ffffffffffffffff");
        for bad in ["", "abc", "0123456789abcdefa", "0123456789abcdeg", "+123456789abcdef"] {
            assert_eq!(ScopeId::parse(bad), None, "{bad:?}");
        }
    }
}
