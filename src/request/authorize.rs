//! The external authorizer (`[routes.authorize]`): before every request on a
//! route — first requests, replays, in-progress and mismatch answers, polls of
//! an async operation and its result — idemgate asks "may this principal do
//! this?" and answers `forbidden` (403) without touching the record when the
//! authorizer says no. A principal whose permission was revoked after its
//! request completed therefore never gets the stored response. Fails closed:
//! an authorizer that errs or is slow makes the answer 503.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

use http::{HeaderMap, HeaderName, Method, Request, Uri};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::request::identity::Identity;
use crate::upstream::body::Body;
use crate::upstream::side_client::{self, SideClient};

/// Most cached positive decisions per route.
const CACHE_CAP: usize = 10_000;

/// `[routes.authorize]` after validation.
#[derive(Debug, Clone)]
pub struct AuthorizeConfig {
    pub url: Uri,
    pub timeout: Duration,
    /// Request headers passed on to the authorizer (e.g. `authorization`).
    pub headers: Vec<HeaderName>,
    /// How long an "allowed" is remembered (zero: ask every time). This is
    /// the delay before a revocation takes effect.
    pub cache: Duration,
}

/// What the authorizer decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Authorization {
    Allowed,
    /// 401 or 403 from the authorizer.
    Denied,
    /// Any other answer, an error or a timeout: fail closed.
    Unavailable,
}

/// One route's authorizer: its client (this worker's) and its decision cache
/// (shared by the workers).
#[derive(Debug, Clone)]
pub struct Authorizer {
    pub config: AuthorizeConfig,
    client: SideClient,
    cache: Arc<Mutex<HashMap<String, Instant>>>,
}

impl Authorizer {
    pub fn new(config: AuthorizeConfig) -> Authorizer {
        let client = side_client::build(config.timeout);
        Authorizer { config, client, cache: Arc::default() }
    }

    /// A copy with its own connection pool (for another worker's event loop),
    /// sharing the decision cache.
    pub fn with_own_pool(&self) -> Authorizer {
        Authorizer { cache: self.cache.clone(), ..Authorizer::new(self.config.clone()) }
    }

    /// Asks whether `identity` may `method path` on `operation`.
    pub async fn check(&self, method: &Method, path: &str, operation: &str, identity: &Identity, headers: &HeaderMap) -> Authorization {
        // The decision is the authorizer's answer about this request with
        // the credentials it was sent: two credentials of one principal (a
        // narrower delegated token) are two questions. They count in the key
        // by their digest, not in clear; without a cache there is no key.
        let cache_key = (!self.config.cache.is_zero()).then(|| {
            let mut sent = Sha256::new();
            for name in &self.config.headers {
                for value in headers.get_all(name) {
                    sent.update(name.as_str().as_bytes());
                    sent.update([0]);
                    sent.update(value.as_bytes());
                    sent.update([0]);
                }
            }
            format!(
                "{}\u{0}{}\u{0}{operation}\u{0}{method}\u{0}{path}\u{0}{}",
                identity.tenant,
                identity.principal,
                hex::encode(sent.finalize())
            )
        });
        if let Some(key) = &cache_key {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if cache.get(key).is_some_and(|until| *until > Instant::now()) {
                return Authorization::Allowed;
            }
        }
        // Boxed: the HTTP exchange would otherwise make every idempotent
        // request's future as large, authorizer or not (docs/performance-notes.md,
        // issue 32); a cached decision allocates nothing.
        let decision = Box::pin(self.ask(method, path, operation, identity, headers)).await;
        if let (Authorization::Allowed, Some(key)) = (decision, cache_key) {
            let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if cache.len() >= CACHE_CAP {
                let now = Instant::now();
                cache.retain(|_, until| *until > now);
                if cache.len() >= CACHE_CAP {
                    cache.clear();
                }
            }
            cache.insert(key, Instant::now() + self.config.cache);
        }
        decision
    }

    async fn ask(&self, method: &Method, path: &str, operation: &str, identity: &Identity, headers: &HeaderMap) -> Authorization {
        let body = json!({
            "method": method.as_str(),
            "path": path,
            "operation": operation,
            "tenant": &*identity.tenant,
            "principal": &*identity.principal,
        })
        .to_string();
        let mut req =
            Request::builder().method(Method::POST).uri(self.config.url.clone()).header(http::header::CONTENT_TYPE, "application/json");
        for name in &self.config.headers {
            for value in headers.get_all(name) {
                req = req.header(name, value);
            }
        }
        let Ok(req) = req.body(Body::full(body)) else { return Authorization::Unavailable };
        match tokio::time::timeout(self.config.timeout, self.client.request(req)).await {
            Ok(Ok(resp)) if resp.status().is_success() => Authorization::Allowed,
            Ok(Ok(resp)) if matches!(resp.status().as_u16(), 401 | 403) => Authorization::Denied,
            Ok(Ok(resp)) => {
                tracing::warn!(status = resp.status().as_u16(), operation, "authorizer answered neither allow nor deny; refusing");
                Authorization::Unavailable
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %crate::upstream::error_chain(&e), operation, "authorizer unreachable; refusing");
                Authorization::Unavailable
            }
            Err(_) => {
                tracing::warn!(timeout = ?self.config.timeout, operation, "authorizer did not answer in time; refusing");
                Authorization::Unavailable
            }
        }
    }
}
