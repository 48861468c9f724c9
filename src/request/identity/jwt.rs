//! JWT identity (`kind = "jwt"`): a bearer token verified with a key from a
//! JWKS (a file, or a URL refreshed every `jwks_refresh`) or, for HS256, a
//! shared secret; then tenant and principal read from its claims.
//!
//! Verification is the `jsonwebtoken` crate's (signature, `exp`, `nbf`,
//! issuer, audience, with a small leeway); nothing here parses or checks a
//! signature by hand. The one header rule that crate does not apply is
//! checked here: a `crit` header parameter (RFC 7515 section 4.1.11) names
//! extensions that must be understood, and idemgate understands none, so
//! such a token is refused. The key set is replaced whole on a successful refresh
//! and kept when a refresh fails; a token whose `kid` is not in the set
//! triggers one refresh, at most once per `UNKNOWN_KID_REFRESH`.
//!
//! A verified token is remembered ([`super::token_cache`]) by the SHA-256 of
//! its bytes, and served again only inside its `nbf`/`exp` window and while
//! the key that verified it is still the key set's key for its `kid`.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::time::Instant;

use http::{HeaderMap, HeaderName, Uri};
use http_body_util::BodyExt;
use jsonwebtoken::jwk::{AlgorithmParameters, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use tokio::sync::Mutex;

use crate::idempotency::key::Identity;
use crate::request::identity::token_cache::{self, Signer, TokenCache, Verified};
use crate::secret::Secret;
use crate::upstream::body::Body;
use crate::upstream::side_client::{self, SideClient};

/// A token with an unknown `kid` triggers a refresh at most this often.
const UNKNOWN_KID_REFRESH: Duration = Duration::from_secs(10);
/// Bound on fetching a JWKS.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest JWKS document accepted.
const MAX_JWKS: usize = 1 << 20;

/// Where the verification keys come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JwksSource {
    /// A JWKS file, read at start (and on reload).
    File(PathBuf),
    /// A JWKS URL, fetched at start and every `refresh`.
    Url(Uri),
    /// HS256 only: a shared secret, no JWKS.
    None,
}

/// `[[identity.sources]] kind = "jwt"` after validation.
#[derive(Debug, Clone)]
pub struct JwtConfig {
    pub header: HeaderName,
    pub keys: JwksSource,
    pub refresh: Duration,
    pub issuer: Option<Vec<String>>,
    pub audience: Option<Vec<String>>,
    pub algorithms: Vec<Algorithm>,
    /// HS256's key.
    pub secret: Option<Secret>,
    /// JSON Pointers into the claims.
    pub tenant_claim: String,
    pub principal_claim: String,
    pub leeway: Duration,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum JwtError {
    #[error("not a JWT")]
    Malformed,
    #[error("algorithm {0:?} is not allowed")]
    Algorithm(Algorithm),
    #[error("no key for kid {0:?}")]
    UnknownKey(Option<String>),
    #[error("invalid token: {0}")]
    Invalid(String),
    #[error("claim {0} is missing, not a string or a number, or a string spelling a number's principal")]
    Claim(String),
    #[error("the header lists critical extensions (crit), which are not supported")]
    Critical,
}

/// The verification keys in force.
#[derive(Default)]
struct Keyring {
    keys: Vec<RingKey>,
}

struct RingKey {
    kid: Option<String>,
    /// The algorithm family the key is for.
    family: KeyFamily,
    key: DecodingKey,
    /// SHA-256 of the JWK as parsed: a key replaced under the same `kid`
    /// has another fingerprint.
    fingerprint: [u8; 32],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyFamily {
    Rsa,
    Ec,
    Ed,
    Hmac,
}

fn family(alg: Algorithm) -> KeyFamily {
    match alg {
        Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512 => KeyFamily::Hmac,
        Algorithm::ES256 | Algorithm::ES384 => KeyFamily::Ec,
        Algorithm::EdDSA => KeyFamily::Ed,
        _ => KeyFamily::Rsa,
    }
}

/// A JWKS document: an object whose `keys` is an array. A key this crate
/// cannot read (an algorithm or curve it does not know, such as an `X25519`
/// encryption key or `ES512`, published beside the signing keys) is skipped
/// with a warning, not the whole set: one such key made every token of the
/// source unverifiable.
fn parse_jwks(bytes: &[u8]) -> Result<JwkSet, String> {
    let doc: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    let Some(entries) = doc.get("keys").and_then(serde_json::Value::as_array) else {
        return Err("no \"keys\" array".to_owned());
    };
    let mut keys = Vec::with_capacity(entries.len());
    for (i, entry) in entries.iter().enumerate() {
        match serde_json::from_value::<jsonwebtoken::jwk::Jwk>(entry.clone()) {
            Ok(jwk) => keys.push(jwk),
            Err(e) => tracing::warn!(index = i, kid = ?entry.get("kid"), error = %e, "JWKS key skipped: not one this gateway can read"),
        }
    }
    Ok(JwkSet { keys })
}

impl Keyring {
    fn from_jwks(set: &JwkSet) -> Keyring {
        let mut keys = Vec::new();
        for jwk in &set.keys {
            let fam = match &jwk.algorithm {
                AlgorithmParameters::RSA(_) => KeyFamily::Rsa,
                AlgorithmParameters::EllipticCurve(_) => KeyFamily::Ec,
                AlgorithmParameters::OctetKeyPair(_) => KeyFamily::Ed,
                // Symmetric keys are never taken from a key set: HS256 uses the configured secret.
                AlgorithmParameters::OctetKey(_) => continue,
            };
            let Ok(json) = serde_json::to_vec(jwk) else { continue };
            let fingerprint = token_cache::digest_bytes(&json);
            match DecodingKey::from_jwk(jwk) {
                Ok(key) => keys.push(RingKey { kid: jwk.common.key_id.clone(), family: fam, key, fingerprint }),
                Err(e) => tracing::warn!(kid = ?jwk.common.key_id, error = %e, "JWKS key skipped"),
            }
        }
        Keyring { keys }
    }

    /// The key for a token: by `kid`, else the only key of the family.
    fn find(&self, kid: Option<&str>, fam: KeyFamily) -> Option<&RingKey> {
        let mut of_family = self.keys.iter().filter(|k| k.family == fam);
        match kid {
            Some(kid) => of_family.find(|k| k.kid.as_deref() == Some(kid)),
            None => {
                let first = of_family.next();
                if of_family.next().is_some() { None } else { first }
            }
        }
    }

    /// Whether `signer` is still the key this set gives for its `kid`
    /// (the configured secret always is).
    fn still_signs(&self, signer: &Signer<KeyFamily>) -> bool {
        match signer {
            Signer::Secret => true,
            Signer::Jwk { kid, family, fingerprint } => self.find(kid.as_deref(), *family).is_some_and(|k| k.fingerprint == *fingerprint),
        }
    }
}

/// One JWT identity source: its configuration and the keys in force.
pub struct JwtVerifier {
    pub config: JwtConfig,
    keyring: RwLock<Arc<Keyring>>,
    hmac: Option<DecodingKey>,
    /// Serializes refreshes and rate-limits the ones forced by unknown kids.
    last_forced: Mutex<Option<Instant>>,
    client: SideClient,
    /// Tokens verified before.
    cache: TokenCache<KeyFamily>,
}

impl std::fmt::Debug for JwtVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtVerifier").field("keys", &self.config.keys).finish()
    }
}

impl JwtVerifier {
    /// Builds the verifier; a JWKS file is read now (an error names it). A
    /// JWKS URL is fetched by [`refresh`](Self::refresh), at start and then
    /// every `refresh` interval.
    pub fn new(config: JwtConfig) -> Result<JwtVerifier, String> {
        let keyring = match &config.keys {
            JwksSource::File(path) => {
                let text = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                let set = parse_jwks(&text).map_err(|e| format!("{} is not a JWKS: {e}", path.display()))?;
                Keyring::from_jwks(&set)
            }
            JwksSource::Url(_) | JwksSource::None => Keyring::default(),
        };
        let hmac = config.secret.as_ref().map(|s| DecodingKey::from_secret(s.expose().as_bytes()));
        Ok(JwtVerifier {
            config,
            keyring: RwLock::new(Arc::new(keyring)),
            hmac,
            last_forced: Mutex::new(None),
            client: side_client::build(FETCH_TIMEOUT),
            cache: TokenCache::new(token_cache::CAPACITY),
        })
    }

    /// The token from the configured header (`Bearer <jwt>`), if any.
    pub fn token<'h>(&self, headers: &'h HeaderMap) -> Option<&'h str> {
        let value = headers.get(&self.config.header)?.to_str().ok()?.trim();
        let (scheme, token) = value.split_once(' ')?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return None;
        }
        let token = token.trim();
        // Three base64url parts: anything else is not for this source.
        (token.split('.').count() == 3).then_some(token)
    }

    /// Verifies `token` (or finds it verified before, see the module
    /// documentation); refreshes the key set once if its `kid` is unknown.
    pub async fn verify(&self, token: &str) -> Result<Identity, JwtError> {
        let digest = token_cache::digest(token);
        let keyring = self.keyring();
        if let Some(identity) = self.cache.get(&digest, jsonwebtoken::get_current_timestamp(), |s| keyring.still_signs(s)) {
            return Ok(identity);
        }
        let verified = match self.verify_now(token) {
            Err(JwtError::UnknownKey(_)) if matches!(self.config.keys, JwksSource::Url(_)) => {
                // Whether this call fetched or another one did (it waited
                // for that fetch, or one ran lately), the keys in force now
                // decide: the callers that arrived during a fetch (at start,
                // right after a reload) were refused as "too recent".
                self.forced_refresh().await;
                self.verify_now(token)
            }
            other => other,
        }?;
        let identity = verified.identity.clone();
        self.cache.insert(digest, verified);
        Ok(identity)
    }

    /// Tokens answered from the cache of verified tokens so far.
    pub fn cache_hits(&self) -> u64 {
        self.cache.hits()
    }

    fn keyring(&self) -> Arc<Keyring> {
        self.keyring.read().map(|k| k.clone()).unwrap_or_default()
    }

    fn verify_now(&self, token: &str) -> Result<Verified<KeyFamily>, JwtError> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| JwtError::Malformed)?;
        if has_crit(token)? {
            return Err(JwtError::Critical);
        }
        if !self.config.algorithms.contains(&header.alg) {
            return Err(JwtError::Algorithm(header.alg));
        }
        let fam = family(header.alg);
        let keyring = self.keyring();
        let (key, signer) = match fam {
            KeyFamily::Hmac => self.hmac.as_ref().map(|k| (k, Signer::Secret)),
            _ => keyring
                .find(header.kid.as_deref(), fam)
                .map(|k| (&k.key, Signer::Jwk { kid: header.kid.clone(), family: fam, fingerprint: k.fingerprint })),
        }
        .ok_or_else(|| JwtError::UnknownKey(header.kid.clone()))?;
        let mut v = Validation::new(header.alg);
        v.algorithms = vec![header.alg];
        v.leeway = self.config.leeway.as_secs();
        v.validate_nbf = true;
        // A configured issuer or audience must be in the token, not only
        // match when it is there (the crate requires only `exp` by default,
        // and skips the comparison of a claim that is absent or not a string).
        match &self.config.issuer {
            Some(iss) => {
                v.set_issuer(iss);
                v.required_spec_claims.insert("iss".to_owned());
            }
            None => v.iss = None,
        }
        match &self.config.audience {
            Some(aud) => {
                v.set_audience(aud);
                v.required_spec_claims.insert("aud".to_owned());
            }
            None => v.validate_aud = false,
        }
        let data = jsonwebtoken::decode::<serde_json::Value>(token, key, &v).map_err(|e| JwtError::Invalid(e.kind_name()))?;
        let claim = |pointer: &str| typed_claim(data.claims.pointer(pointer)).ok_or_else(|| JwtError::Claim(pointer.to_owned()));
        let identity = Identity { tenant: claim(&self.config.tenant_claim)?, principal: claim(&self.config.principal_claim)? };
        // The window the crate's validation accepts (with the leeway), read
        // from the claims it accepted; rounded inwards.
        let leeway = self.config.leeway.as_secs();
        let (valid_from, valid_until) = match (data.claims.get("nbf"), data.claims.get("exp").and_then(|v| epoch_secs(v, false))) {
            (None, Some(exp)) => (0, exp.saturating_add(leeway)),
            (Some(nbf), Some(exp)) => match epoch_secs(nbf, true) {
                Some(nbf) => (nbf.saturating_sub(leeway), exp.saturating_add(leeway)),
                // An `nbf` the crate could not read: never served from the cache.
                None => (1, 0),
            },
            // `exp` is required: not reached, but never cached either.
            (_, None) => (1, 0),
        };
        Ok(Verified { identity, signer, valid_from, valid_until })
    }

    /// Refreshes the key set now and then every `jwks_refresh`, until
    /// `shutdown` or until the verifier is gone (a reload replaced it).
    pub async fn keep_fresh(verifier: std::sync::Weak<JwtVerifier>, shutdown: tokio_util::sync::CancellationToken) {
        loop {
            let Some(v) = verifier.upgrade() else { return };
            v.refresh().await;
            let wait = v.config.refresh;
            drop(v);
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Fetches the JWKS URL; on success the set replaces the one in force, on
    /// failure the last good set stays. Returns whether it succeeded.
    pub async fn refresh(&self) -> bool {
        let JwksSource::Url(url) = &self.config.keys else { return true };
        match self.fetch(url).await {
            Ok(set) => {
                let ring = Arc::new(Keyring::from_jwks(&set));
                tracing::debug!(url = %url, keys = ring.keys.len(), "JWKS refreshed");
                if let Ok(mut k) = self.keyring.write() {
                    *k = ring.clone();
                }
                // Entries of keys gone or replaced are misses already; drop them.
                self.cache.retain_signers(jsonwebtoken::get_current_timestamp(), |s| ring.still_signs(s));
                true
            }
            Err(e) => {
                tracing::warn!(url = %url, error = %e, "JWKS refresh failed; the last good key set stays");
                false
            }
        }
    }

    /// A refresh for an unknown `kid`, at most once per `UNKNOWN_KID_REFRESH`
    /// (a caller that finds one running waits for it).
    async fn forced_refresh(&self) {
        let mut last = self.last_forced.lock().await;
        if last.is_some_and(|t| t.elapsed() < UNKNOWN_KID_REFRESH) {
            return;
        }
        *last = Some(Instant::now());
        self.refresh().await;
    }

    async fn fetch(&self, url: &Uri) -> Result<JwkSet, String> {
        let req = http::Request::get(url.clone()).body(Body::empty()).map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(FETCH_TIMEOUT, self.client.request(req))
            .await
            .map_err(|_| "timed out".to_owned())?
            .map_err(|e| crate::upstream::error_chain(&e))?;
        if !resp.status().is_success() {
            return Err(format!("answered {}", resp.status().as_u16()));
        }
        let body = http_body_util::Limited::new(resp.into_body(), MAX_JWKS);
        let bytes = tokio::time::timeout(FETCH_TIMEOUT, body.collect())
            .await
            .map_err(|_| "timed out".to_owned())?
            .map_err(|e| e.to_string())?
            .to_bytes();
        parse_jwks(&bytes).map_err(|e| format!("not a JWKS: {e}"))
    }
}

/// Marks a tenant or principal that was a JSON number in the token.
const NUMBER_MARK: char = '#';

/// A tenant or principal claim as the scope carries it, keeping its JSON
/// type: a string as it is (non-empty, at most 255 bytes, no control
/// characters), a number as `#` and its decimal text (`{"sub": 123}` is
/// `#123`), so that a number and a string never name one principal. A string
/// that reads as a marked number (`"#123"`) is refused: it would be that
/// number's principal. Anything else is no identity.
fn typed_claim(value: Option<&serde_json::Value>) -> Option<Arc<str>> {
    match value? {
        serde_json::Value::String(s) if !s.is_empty() && s.len() <= 255 && !s.chars().any(char::is_control) => {
            let marked_number = s.strip_prefix(NUMBER_MARK).is_some_and(|rest| serde_json::from_str::<serde_json::Number>(rest).is_ok());
            (!marked_number).then(|| s.as_str().into())
        }
        serde_json::Value::Number(n) => Some(format!("{NUMBER_MARK}{n}").into()),
        _ => None,
    }
}

/// A NumericDate claim as seconds since the epoch, as the `jsonwebtoken`
/// crate reads it (an integer, or a finite non-negative number it rounds),
/// rounded up for a start (`up`) and down for an end, so a cached window is
/// never wider than the verified one.
fn epoch_secs(value: &serde_json::Value, up: bool) -> Option<u64> {
    if let Some(n) = value.as_u64() {
        return Some(n);
    }
    let f = value.as_f64()?;
    if !(f.is_finite() && f >= 0.0 && f < u64::MAX as f64) {
        return None;
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    Some(if up { f.ceil() as u64 } else { f.floor() as u64 })
}

/// Whether the token's JOSE header has a `crit` parameter (any value: an
/// extension list idemgate cannot honour, or a malformed one).
fn has_crit(token: &str) -> Result<bool, JwtError> {
    use base64::Engine as _;
    let encoded = token.split('.').next().ok_or(JwtError::Malformed)?;
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(encoded).map_err(|_| JwtError::Malformed)?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&json).map_err(|_| JwtError::Malformed)?;
    Ok(header.contains_key("crit"))
}

trait KindName {
    fn kind_name(&self) -> String;
}

impl KindName for jsonwebtoken::errors::Error {
    /// The failure without token contents (never echoed to clients anyway).
    fn kind_name(&self) -> String {
        format!("{:?}", self.kind())
    }
}

/// Parses an algorithm name as configured.
pub fn parse_algorithm(s: &str) -> Option<Algorithm> {
    match s {
        "RS256" => Some(Algorithm::RS256),
        "ES256" => Some(Algorithm::ES256),
        "EdDSA" => Some(Algorithm::EdDSA),
        "HS256" => Some(Algorithm::HS256),
        _ => None,
    }
}
