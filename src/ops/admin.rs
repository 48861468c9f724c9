//! The admin listener: `/healthz` (process up), `/readyz` (store reachable
//! and taking writes, not draining),
//! `/metrics` (Prometheus) — no token — and the admin HTTP API under
//! `/admin/`, which mirrors `idemgate keys` through the same implementation
//! ([`crate::ops::keys`]):
//!
//! - `GET /admin/records?state=&tenant=&operation=&limit=&cursor=` →
//!   `{"records": [...], "next_cursor"}` (keyset pagination, newest first);
//! - `GET /admin/records/{tenant}/{principal}/{operation}/{key}` → one record
//!   (bodies never included; `response_status` and `response_size` are);
//! - `POST /admin/records/{tenant}/{principal}/{operation}/{key}/resolve` with
//!   `{"action": "release" | "complete", "reason": "...", ...}`;
//! - `GET /admin/audit?limit=` → `{"entries": [...]}`, newest first.
//!
//! Scope segments are percent-encoded (a key may hold `/` as `%2F`); the raw
//! path is split on `/` first and each segment decoded after. The API needs
//! `Authorization: Bearer <token>` (`[admin] token_env` / `token_file`),
//! compared in constant time; without a configured token it is off (404,
//! saying so and how to turn it on).
//! Errors are RFC 9457 problems, rendered by [`crate::problem::Problem`],
//! and never echo the token.
//!
//! Every API call, a refused one included, gets an access-log line (target
//! `idemgate::proxy::access`, `route = "admin"`, whatever `server.access_log`
//! says): method, path without the query, status, the caller's address and
//! which token it presented (`none`, `invalid`, or the configured token's
//! label: `[admin] token_label`, else [`crate::store::audit::token_label`]).
//! A path that names a scope is logged with the scope's id in its place
//! (`/admin/records/{scope}/resolve`, `scope = <id>`), never the key. A
//! resolution's audit row records the same address and label.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use base64::Engine as _;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use percent_encoding::percent_decode_str;
use serde::Deserialize;
use serde_json::json;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::idempotency::key::{IdempotencyKey, Scope};
use crate::idempotency::record::{State, TransitionError};
use crate::ops::keys;
use crate::outbox::Delivery;
use crate::problem::Problem;
use crate::request::identity::IdentitySource;
use crate::request::route::Route;
use crate::secret::{DerivedKeySecret, Secret};
use crate::store::audit::{self, Actor, Caller};
use crate::store::resolution::{self, ResolveAction, ResolveError, ResolveRequest};
use crate::store::{ListFilter, Store};
use crate::telemetry::metrics::Metrics;
use crate::upstream::body::Body;

/// Largest resolve request body (a base64 response body inside JSON).
const MAX_REQUEST_BODY: usize = 16 * 1024 * 1024;
/// The resolve request body must arrive within this time.
const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// `limit` when absent, and its largest value.
const DEFAULT_LIMIT: u32 = 100;
const MAX_LIMIT: u32 = 1000;

/// How long `/readyz` waits for the store. Shorter than the operation
/// timeout: a load balancer or orchestrator should learn within about a second
/// that the primary is gone (PostgreSQL: `/readyz` also answers 503 while the
/// only server reachable is a standby).
const READY_BOUND: Duration = Duration::from_secs(1);

/// What the configuration in force decides for the admin API and the
/// console: built from each configuration applied, at start and on every
/// reload, and replaced whole.
#[derive(Debug)]
pub struct InForce {
    /// The store, writing events for the routes' `[routes.events]` (a
    /// resolution's final state).
    store: Store,
    /// For the retention of hand-made completions (the route's).
    routes: Vec<Route>,
    /// Headers the identity sources read credentials from: masked wherever
    /// the API shows stored headers.
    credential_headers: Vec<http::HeaderName>,
}

impl InForce {
    pub fn new(store: Store, routes: &[Route], identity: &[IdentitySource]) -> InForce {
        InForce {
            store,
            routes: routes.to_vec(),
            credential_headers: identity.iter().filter_map(|s| s.credential_header().cloned()).collect(),
        }
    }
}

pub struct Admin {
    metrics: Arc<Metrics>,
    /// Bearer token for the admin API (`None`: the API is off).
    token: Option<Secret>,
    /// What the configuration in force decides here (a reload replaces it).
    in_force: watch::Receiver<Arc<InForce>>,
    /// Shows the derived key of records (what the upstream was sent).
    derived_key_secret: Option<DerivedKeySecret>,
    /// `[admin] masked_query_params`: masked in a stored request's path.
    masked_query_params: Vec<String>,
    /// `[admin] token_label`: the token's name in logs and the audit trail.
    token_label: Option<String>,
    /// Keys the token's label until the derived-key secret is known.
    process_key: [u8; 32],
    /// Cancelled when the process starts draining: `/readyz` then answers 503.
    draining: Option<CancellationToken>,
}

impl Admin {
    /// The admin listener for the configuration `in_force` names (see [`InForce`]).
    pub fn new(in_force: watch::Receiver<Arc<InForce>>, metrics: Arc<Metrics>, token: Option<Secret>) -> Admin {
        let mut process_key = [0u8; 32];
        process_key[..16].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
        process_key[16..].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
        Admin {
            metrics,
            token,
            in_force,
            derived_key_secret: None,
            masked_query_params: Vec::new(),
            token_label: None,
            process_key,
            draining: None,
        }
    }

    /// `[admin] token_label` and `masked_query_params`.
    pub fn with_settings(mut self, token_label: Option<String>, masked_query_params: Vec<String>) -> Admin {
        self.token_label = token_label;
        self.masked_query_params = masked_query_params;
        self
    }

    /// What logs and the audit trail call the configured token: the
    /// operator's label, else a keyed hash of it (keyed by the derived-key
    /// secret, the same on every replica and restart; by a key of this
    /// process until that is known).
    fn label(&self, token: &Secret) -> String {
        if let Some(label) = &self.token_label {
            return label.clone();
        }
        let key = self.secret().unwrap_or(&self.process_key);
        audit::token_label(token.expose(), key)
    }

    /// The deployment's derived-key secret, to show each record's derived key.
    pub fn with_derived_key_secret(mut self, secret: DerivedKeySecret) -> Admin {
        self.derived_key_secret = Some(secret);
        self
    }

    /// `/readyz` answers 503 once `draining` is cancelled (SIGTERM).
    pub fn with_draining(mut self, draining: CancellationToken) -> Admin {
        self.draining = Some(draining);
        self
    }

    /// Answers one request from `peer`.
    pub async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let path = req.uri().path();
        if path == "/admin" || path.starts_with("/admin/") {
            let started = Instant::now();
            let (method, path) = (req.method().clone(), path.to_owned());
            let mut presented = Presented::None;
            let (resp, problem_name) = match self.api(req, peer, &mut presented).await {
                Ok(resp) => (resp, None),
                Err(e) => (problem(&e), Some(e.type_name())),
            };
            let (logged, scope) = logged_path(&path);
            log_call(&method, &logged, scope, peer, resp.status(), started.elapsed(), &presented, problem_name);
            return resp;
        }
        // The operator console: only while the admin API is on; otherwise
        // its paths are unknown like any other.
        if self.token.is_some() && crate::ops::console::owns(path) {
            return crate::ops::console::serve(req.method(), path);
        }
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        }
        match path {
            "/healthz" => text(StatusCode::OK, "ok\n"),
            "/readyz" if self.draining.as_ref().is_some_and(CancellationToken::is_cancelled) => {
                text(StatusCode::SERVICE_UNAVAILABLE, "draining\n")
            }
            "/readyz" => match tokio::time::timeout(READY_BOUND, self.store().readiness()).await {
                Ok(Ok(())) => text(StatusCode::OK, "ready\n"),
                Ok(Err(e)) => {
                    crate::telemetry::throttle::warn_throttled!(error = %e, "readiness check failed");
                    text(StatusCode::SERVICE_UNAVAILABLE, e.body())
                }
                Err(_) => {
                    crate::telemetry::throttle::warn_throttled!(bound = ?READY_BOUND, "readiness check failed: the store did not answer in time");
                    text(StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n")
                }
            },
            "/metrics" => {
                let mut r = Response::new(Body::full(self.metrics.encode()));
                r.headers_mut()
                    .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"));
                r
            }
            _ => text(StatusCode::NOT_FOUND, "not found\n"),
        }
    }

    async fn api(&self, req: Request<Incoming>, peer: SocketAddr, presented: &mut Presented) -> Result<Response<Body>, AdminError> {
        if req.headers().contains_key(header::AUTHORIZATION) {
            *presented = Presented::Invalid;
        }
        // Off without a token; checked before anything else so that callers
        // without the token learn nothing about the API's shape (only that
        // it is off, and how an operator turns it on).
        let token = self.token.as_ref().ok_or(AdminError::Disabled)?;
        authorize(req.headers(), token)?;
        let label = self.label(token);
        *presented = Presented::Valid(label.clone());
        let caller = Caller { peer: peer.to_string(), token: label };
        let actor = crate::ops::console::actor_of(req.headers()).map_err(AdminError::BadRequest)?;
        let endpoint = Endpoint::parse(req.uri().path())?;
        let query = req.uri().query().unwrap_or_default().to_owned();
        match (endpoint, req.method().clone()) {
            (Endpoint::Records, Method::GET) => self.list(&query).await,
            (Endpoint::Record(scope), Method::GET) => {
                no_query(&query)?;
                self.show(&scope).await
            }
            (Endpoint::Resolve(scope), Method::POST) => {
                no_query(&query)?;
                self.resolve(&scope, req.into_body(), caller, actor).await
            }
            (Endpoint::Inspect(scope), Method::GET) => {
                no_query(&query)?;
                match self.store().inspect(&scope, crate::ops::console::inspect::AUDIT_ROWS).await.map_err(store_error)? {
                    Some(found) => Ok(json_response(
                        StatusCode::OK,
                        &crate::ops::console::inspect::json(
                            &found,
                            self.secret(),
                            &self.in_force().credential_headers,
                            &self.masked_query_params,
                        ),
                    )),
                    None => Err(AdminError::NoRecord),
                }
            }
            (Endpoint::Overview, Method::GET) => {
                no_query(&query)?;
                let doc = crate::ops::console::overview::overview(&self.store(), &self.metrics).await.map_err(store_error)?;
                Ok(json_response(StatusCode::OK, &doc))
            }
            (Endpoint::Audit, Method::GET) => self.audit(&query).await,
            (Endpoint::Events, Method::GET) => self.events(&query).await,
            (Endpoint::Redeliver(id), Method::POST) => {
                no_query(&query)?;
                match self.store().redeliver(id).await.map_err(store_error)? {
                    true => Ok(json_response(StatusCode::OK, &json!({ "id": id.to_string(), "delivery": "pending" }))),
                    false => Err(AdminError::NotFound),
                }
            }
            (Endpoint::Resolve(_) | Endpoint::Redeliver(_), _) => Err(AdminError::MethodNotAllowed("POST")),
            (_, _) => Err(AdminError::MethodNotAllowed("GET")),
        }
    }

    /// What the configuration in force decides now.
    fn in_force(&self) -> Arc<InForce> {
        self.in_force.borrow().clone()
    }

    /// The store of the configuration in force.
    fn store(&self) -> Store {
        self.in_force.borrow().store.clone()
    }

    fn secret(&self) -> Option<&[u8]> {
        self.derived_key_secret.as_ref().and_then(DerivedKeySecret::get)
    }

    async fn list(&self, query: &str) -> Result<Response<Body>, AdminError> {
        let mut filter = ListFilter { limit: DEFAULT_LIMIT, ..ListFilter::default() };
        let mut extra = crate::ops::console::filter::Extra::default();
        for (name, value) in form_urlencoded::parse(query.as_bytes()) {
            match &*name {
                "state" => {
                    filter.state = Some(
                        State::parse(&value)
                            .ok_or_else(|| AdminError::BadRequest(format!("unknown state {value:?}: use {}", State::names())))?,
                    );
                }
                "tenant" => filter.tenant = Some(value.into_owned()),
                "operation" => filter.operation = Some(value.into_owned()),
                "limit" => filter.limit = limit(&value)?,
                "cursor" => filter.cursor = Some(keys::decode_cursor(&value).map_err(|e| AdminError::BadRequest(e.to_string()))?),
                "key_prefix" => extra.key_prefix = Some(value.into_owned()).filter(|p| !p.is_empty()),
                "older_than" => {
                    let d = humantime::parse_duration(&value)
                        .map_err(|e| AdminError::BadRequest(format!("older_than: {e} (write e.g. \"10m\")")))?;
                    extra.older_than = Some(d);
                }
                other => return Err(unknown_parameter(other, "state, tenant, operation, key_prefix, older_than, limit, cursor")),
            }
        }
        let page = crate::ops::console::filter::list(&self.store(), &filter, &extra).await.map_err(store_error)?;
        let mut doc = keys::page_json(&page, self.secret());
        if let Some(rows) = doc["records"].as_array_mut() {
            for (row, record) in rows.iter_mut().zip(&page.records) {
                self.mask_response_headers(row, record);
            }
        }
        Ok(json_response(StatusCode::OK, &doc))
    }

    async fn show(&self, scope: &Scope) -> Result<Response<Body>, AdminError> {
        match self.store().get(scope).await.map_err(store_error)? {
            Some((record, _)) => {
                let mut doc = keys::record_json(&record, false, self.secret());
                self.mask_response_headers(&mut doc, &record);
                Ok(json_response(StatusCode::OK, &doc))
            }
            None => Err(AdminError::NoRecord),
        }
    }

    /// A record's stored response headers as the API shows them: credentials
    /// (a token an upstream answered a create with) masked, as the console
    /// masks them.
    fn mask_response_headers(&self, doc: &mut serde_json::Value, record: &crate::idempotency::record::Record) {
        if let Some(resp) = &record.response {
            doc["response"]["headers"] = crate::ops::console::mask::headers_json(&resp.headers, &self.in_force().credential_headers);
        }
    }

    async fn audit(&self, query: &str) -> Result<Response<Body>, AdminError> {
        let mut n = DEFAULT_LIMIT;
        for (name, value) in form_urlencoded::parse(query.as_bytes()) {
            match &*name {
                "limit" => n = limit(&value)?,
                other => return Err(unknown_parameter(other, "limit")),
            }
        }
        let entries = self.store().audit(n).await.map_err(store_error)?;
        Ok(json_response(StatusCode::OK, &keys::audit_page_json(&entries)))
    }

    /// `GET /admin/events?delivery=pending|sent|parked&limit=`: the outbox, oldest first.
    async fn events(&self, query: &str) -> Result<Response<Body>, AdminError> {
        let (mut delivery, mut n) = (None, DEFAULT_LIMIT);
        for (name, value) in form_urlencoded::parse(query.as_bytes()) {
            match &*name {
                "delivery" => {
                    delivery =
                        Some(Delivery::parse(&value).ok_or_else(|| AdminError::BadRequest(format!("unknown delivery state {value:?}")))?)
                }
                "limit" => n = limit(&value)?,
                other => return Err(unknown_parameter(other, "delivery, limit")),
            }
        }
        let events = self.store().events(delivery, n).await.map_err(store_error)?;
        let stats = self.store().event_stats().await.map_err(store_error)?;
        Ok(json_response(
            StatusCode::OK,
            &json!({
                "events": events.iter().map(crate::outbox::event_json).collect::<Vec<_>>(),
                "pending": stats.pending,
                "parked": stats.parked,
            }),
        ))
    }

    async fn resolve(&self, scope: &Scope, body: Incoming, caller: Caller, actor: Actor) -> Result<Response<Body>, AdminError> {
        let body = match tokio::time::timeout(BODY_TIMEOUT, Limited::new(body, MAX_REQUEST_BODY).collect()).await {
            Ok(Ok(collected)) => collected.to_bytes(),
            Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
                return Err(AdminError::BadRequest(format!("the request body exceeds {MAX_REQUEST_BODY} bytes")));
            }
            Ok(Err(_)) | Err(_) => return Err(AdminError::BadRequest("the request body could not be read".into())),
        };
        let request = ResolveRequest { actor, ..resolve_request(&body)? };
        let to = match request.action {
            ResolveAction::Release => audit::RELEASED,
            ResolveAction::Complete { .. } => State::Completed.as_str(),
        };
        let retention = keys::default_retention(&self.in_force().routes, &scope.operation);
        let (peer, token) = (caller.peer.clone(), caller.token.clone());
        match resolution::resolve_by(&self.store(), scope, request, retention, Some(caller)).await {
            Ok(from) => {
                tracing::info!(scope = %scope.log_id(), actor = actor.as_str(), peer, token, from = %from, to, "record resolved through the admin API");
                Ok(json_response(StatusCode::OK, &json!({ "scope": keys::scope_json(scope), "from_state": from.as_str(), "to_state": to })))
            }
            Err(ResolveError::Invalid(why)) => Err(AdminError::BadRequest(why)),
            Err(ResolveError::NotFound) => Err(AdminError::NoRecord),
            Err(ResolveError::Refused(refused)) => Err(AdminError::NotResolvable(refused)),
            Err(ResolveError::Store(e)) => Err(store_error(e)),
        }
    }
}

/// Which API endpoint a path names. The raw path is split on `/` first and
/// each scope segment percent-decoded after, so `%2F` inside a key is part of
/// the key, never a separator.
#[derive(Debug, PartialEq, Eq)]
enum Endpoint {
    Records,
    Record(Scope),
    Resolve(Scope),
    Audit,
    /// The outbox's events.
    Events,
    /// `POST /admin/events/{id}/redeliver`.
    Redeliver(uuid::Uuid),
    /// `GET /admin/overview` (the console's first page).
    Overview,
    /// `GET /admin/records/{scope}/inspect` (the console's record page).
    Inspect(Scope),
}

impl Endpoint {
    fn parse(path: &str) -> Result<Endpoint, AdminError> {
        match path {
            "/admin/records" => return Ok(Endpoint::Records),
            "/admin/audit" => return Ok(Endpoint::Audit),
            "/admin/events" => return Ok(Endpoint::Events),
            "/admin/overview" => return Ok(Endpoint::Overview),
            _ => {}
        }
        if let Some(id) = path.strip_prefix("/admin/events/").and_then(|r| r.strip_suffix("/redeliver")) {
            return id.parse().map(Endpoint::Redeliver).map_err(|_| AdminError::NotFound);
        }
        let rest = path.strip_prefix("/admin/records/").ok_or(AdminError::NotFound)?;
        let segments: Vec<&str> = rest.split('/').collect();
        let (scope, action) = match segments.as_slice() {
            [t, p, o, k] => ([*t, *p, *o, *k], None),
            [t, p, o, k, action @ ("resolve" | "inspect")] => ([*t, *p, *o, *k], Some(*action)),
            _ => return Err(AdminError::NotFound),
        };
        let scope = scope_of(scope)?;
        Ok(match action {
            Some("resolve") => Endpoint::Resolve(scope),
            Some(_) => Endpoint::Inspect(scope),
            None => Endpoint::Record(scope),
        })
    }
}

/// The scope named by four raw segments. The principal may be empty: the
/// records of a `scope = "tenant"` route belong to the whole tenant
/// (`/admin/records/acme//create_order/K`).
fn scope_of([t, p, o, k]: [&str; 4]) -> Result<Scope, AdminError> {
    let decode = |what: &str, raw: &str| -> Result<String, AdminError> {
        let s = percent_decode_str(raw)
            .decode_utf8()
            .map_err(|_| AdminError::BadRequest(format!("the {what} segment is not percent-encoded UTF-8")))?;
        if s.is_empty() && what != "principal" {
            return Err(AdminError::BadRequest(format!("the {what} segment is empty")));
        }
        Ok(s.into_owned())
    };
    let (tenant, principal, operation) = (decode("tenant", t)?, decode("principal", p)?, decode("operation", o)?);
    let key = IdempotencyKey::new(&decode("key", k)?).map_err(|e| AdminError::BadRequest(e.to_string()))?;
    Ok(Scope { tenant: tenant.into(), principal: principal.into(), operation: operation.into(), key })
}

/// `Authorization: Bearer <token>`, compared in constant time (the SHA-256
/// digests of both, so neither the token's length nor its bytes leak through
/// timing).
fn authorize(headers: &HeaderMap, token: &Secret) -> Result<(), AdminError> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let (Some(value), None) = (values.next(), values.next()) else { return Err(AdminError::Unauthorized) };
    let presented = value.as_bytes();
    let credentials = match presented.split_first_chunk::<7>() {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case(b"bearer ") => rest.trim_ascii(),
        _ => return Err(AdminError::Unauthorized),
    };
    let matches = Sha256::digest(credentials).ct_eq(&Sha256::digest(token.expose().as_bytes()));
    if bool::from(matches) { Ok(()) } else { Err(AdminError::Unauthorized) }
}

fn limit(value: &str) -> Result<u32, AdminError> {
    match value.parse::<u32>() {
        Ok(n @ 1..=MAX_LIMIT) => Ok(n),
        _ => Err(AdminError::BadRequest(format!("limit must be 1-{MAX_LIMIT}, not {value:?}"))),
    }
}

fn no_query(query: &str) -> Result<(), AdminError> {
    match form_urlencoded::parse(query.as_bytes()).next() {
        Some((name, _)) => Err(unknown_parameter(&name, "none")),
        None => Ok(()),
    }
}

fn unknown_parameter(name: &str, known: &str) -> AdminError {
    AdminError::BadRequest(format!("unknown query parameter {name:?} (known: {known})"))
}

/// The JSON body of `POST .../resolve`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResolveBody {
    action: String,
    reason: Option<String>,
    status: Option<u16>,
    #[serde(default)]
    headers: BTreeMap<String, OneOrMany>,
    body_base64: Option<String>,
    #[serde(default)]
    force: bool,
    /// How long to replay a completion (`"24h"`); default: the route's retention.
    retention: Option<String>,
    /// The generation the operator looked at: the resolution applies only
    /// to the record at it (409 once the record moved on).
    generation: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// The resolution an API request asks for, checked as far as the request
/// alone allows (`resolution::resolve` checks the rest, as for the CLI).
fn resolve_request(body: &Bytes) -> Result<ResolveRequest, AdminError> {
    let bad = |why: String| AdminError::BadRequest(why);
    let b: ResolveBody = serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
    let reason = b.reason.map(|r| r.trim().to_owned()).filter(|r| !r.is_empty());
    if reason.is_none() {
        return Err(bad("\"reason\" is required: say why (it is kept in the audit trail)".into()));
    }
    let action = match b.action.as_str() {
        "release" => {
            if b.status.is_some() || !b.headers.is_empty() || b.body_base64.is_some() || b.retention.is_some() {
                return Err(bad("a release records no response: leave out status, headers, body_base64 and retention".into()));
            }
            ResolveAction::Release
        }
        "complete" => {
            let status = b.status.ok_or_else(|| bad("\"complete\" needs \"status\"".into()))?;
            let body = match &b.body_base64 {
                Some(s) => {
                    base64::engine::general_purpose::STANDARD.decode(s).map_err(|e| bad(format!("body_base64 is not valid base64: {e}")))?
                }
                None => Vec::new(),
            };
            let mut headers = Vec::new();
            for (name, values) in b.headers {
                let values = match values {
                    OneOrMany::One(v) => vec![v],
                    OneOrMany::Many(vs) => vs,
                };
                headers.extend(values.into_iter().map(|v| (name.to_ascii_lowercase(), v.into_bytes())));
            }
            let retention = b
                .retention
                .as_deref()
                .map(humantime::parse_duration)
                .transpose()
                .map_err(|e| bad(format!("invalid retention: {e} (write e.g. \"24h\")")))?;
            ResolveAction::Complete { status, headers, body: Some(body.into()), retention }
        }
        other => return Err(bad(format!("unknown action {other:?}: use \"release\" or \"complete\""))),
    };
    let generation = b.generation.map(crate::idempotency::record::Generation);
    Ok(ResolveRequest { action, reason, force: b.force, actor: Actor::Admin, fence: None, generation })
}

/// Which token an admin API call presented, as its access-log line says.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Presented {
    None,
    /// An `Authorization` header that is not the configured token (or the
    /// API is off).
    Invalid,
    /// The configured token: its label.
    Valid(String),
}

impl Presented {
    fn as_str(&self) -> &str {
        match self {
            Presented::None => "none",
            Presented::Invalid => "invalid",
            Presented::Valid(label) => label,
        }
    }
}

/// An admin path as the access log shows it: a path naming a scope has
/// `{scope}` in place of its four segments, and the scope's id beside it
/// (`None` when they do not name one), so that no key reaches the log.
fn logged_path(path: &str) -> (String, Option<String>) {
    let Some(rest) = path.strip_prefix("/admin/records/") else { return (path.to_owned(), None) };
    let segments: Vec<&str> = rest.split('/').collect();
    let (scope, action) = match segments.as_slice() {
        [t, p, o, k] => ([*t, *p, *o, *k], None),
        [t, p, o, k, action] => ([*t, *p, *o, *k], Some(*action)),
        _ => return ("/admin/records/...".to_owned(), None),
    };
    let id = scope_of(scope).ok().map(|s| s.scope_id().to_string());
    let action = action.filter(|a| matches!(*a, "resolve" | "inspect")).map_or(String::new(), |a| format!("/{a}"));
    (format!("/admin/records/{{scope}}{action}"), id)
}

/// The access-log line of an admin API call (admin calls are rare: a plain
/// `tracing` event, under the access log's target).
#[allow(clippy::too_many_arguments)]
fn log_call(
    method: &Method,
    path: &str,
    scope: Option<String>,
    peer: SocketAddr,
    status: StatusCode,
    latency: Duration,
    presented: &Presented,
    problem: Option<&'static str>,
) {
    tracing::info!(
        target: "idemgate::access",
        method = %method,
        path,
        scope,
        route = "admin",
        status = status.as_u16(),
        latency_ms = (latency.as_micros() as f64) / 1000.0,
        problem,
        token = presented.as_str(),
        client = %peer.ip(),
        "request"
    );
}

/// How an admin API request ended other than with its answer.
#[derive(Debug, thiserror::Error)]
enum AdminError {
    /// The path names no endpoint.
    #[error("not found")]
    NotFound,
    /// No token is configured: the API is off.
    #[error("the admin API is disabled")]
    Disabled,
    #[error("no record for that scope")]
    NoRecord,
    #[error("unauthorized")]
    Unauthorized,
    #[error("method not allowed")]
    MethodNotAllowed(&'static str),
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("not resolvable: {0}")]
    NotResolvable(TransitionError),
    #[error("store unavailable")]
    StoreUnavailable,
}

impl AdminError {
    /// The problem type's name, for the access log.
    fn type_name(&self) -> &'static str {
        match self {
            AdminError::NotFound | AdminError::Disabled | AdminError::NoRecord => "not-found",
            AdminError::Unauthorized => "unauthenticated",
            AdminError::MethodNotAllowed(_) => "method-not-allowed",
            AdminError::BadRequest(_) => "invalid-request",
            AdminError::NotResolvable(_) => "not-resolvable",
            AdminError::StoreUnavailable => "store-unavailable",
        }
    }
}

fn store_error(e: crate::store::StoreError) -> AdminError {
    tracing::warn!(error = %e, "admin API: store operation failed");
    AdminError::StoreUnavailable
}

/// An admin API error as a problem ([`Problem`], the renderer the proxy's
/// errors go through too).
fn problem(e: &AdminError) -> Response<Body> {
    let name = e.type_name();
    let (title, status, detail) = match e {
        AdminError::NotFound => ("Not found", StatusCode::NOT_FOUND, "No such admin endpoint.".to_owned()),
        AdminError::Disabled => (
            "Not found",
            StatusCode::NOT_FOUND,
            "The admin API is disabled: it needs a bearer token. Set [admin] token_env (an environment variable) or token_file \
             (a file) in the configuration and restart; then send Authorization: Bearer <token>."
                .to_owned(),
        ),
        AdminError::NoRecord => ("Not found", StatusCode::NOT_FOUND, "There is no record for that scope.".to_owned()),
        AdminError::Unauthorized => (
            "Unauthenticated",
            StatusCode::UNAUTHORIZED,
            "The admin API needs the configured bearer token: Authorization: Bearer <token>.".to_owned(),
        ),
        AdminError::MethodNotAllowed(allow) => {
            ("Method not allowed", StatusCode::METHOD_NOT_ALLOWED, format!("This endpoint answers {allow} only."))
        }
        AdminError::BadRequest(why) => ("Invalid request", StatusCode::BAD_REQUEST, format!("{why}.")),
        AdminError::NotResolvable(refused) => (
            "Record not resolvable",
            StatusCode::CONFLICT,
            match refused {
                TransitionError::NotAllowed(State::Completed) => {
                    "The record is completed: it is what retries are replayed. Add \"force\": true (with a reason) to change it.".to_owned()
                }
                TransitionError::LeaseLive => {
                    "The record is in flight and its lease has not expired: its attempt may still record a result.".to_owned()
                }
                TransitionError::RequestGone => "The operation completed, and its stored request was dropped then: it cannot run again. \
                     Complete it by hand instead, or have the client submit a new operation."
                    .to_owned(),
                TransitionError::AtUpstream(until) => format!(
                    "Its attempt may still be at the upstream until {until} (its send plus the upstream timeout it was sent with): \
                     a look-up there now may miss an operation still running. Wait until then, complete it if it happened, \
                     or release it with force."
                ),
                TransitionError::Fenced => "The record moved on since it was read (another generation, or resolved meanwhile): \
                     read it again and decide on what it is now."
                    .to_owned(),
                other => format!("Only unknown records and expired claims may be resolved ({other})."),
            },
        ),
        AdminError::StoreUnavailable => {
            ("Store unavailable", StatusCode::SERVICE_UNAVAILABLE, "The store could not be reached.".to_owned())
        }
    };
    let unavailable = matches!(e, AdminError::StoreUnavailable);
    let mut resp = Problem {
        name,
        title,
        status,
        detail,
        retryable: unavailable,
        retry_after: unavailable.then_some(Duration::from_secs(1)),
        instance: None,
        original_status: None,
    }
    .response();
    let h = resp.headers_mut();
    match e {
        AdminError::Unauthorized => {
            h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"idemgate-admin\""));
        }
        AdminError::MethodNotAllowed(allow) => {
            h.insert(header::ALLOW, HeaderValue::from_static(allow));
        }
        _ => {}
    }
    resp
}

fn json_response(status: StatusCode, doc: &serde_json::Value) -> Response<Body> {
    let mut resp = Response::new(Body::full(doc.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

fn text(status: StatusCode, body: &'static str) -> Response<Body> {
    let mut r = Response::new(Body::full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    r
}

/// The admin listener's endpoints, as `idemgate_http_requests_total` and
/// `idemgate_http_request_duration_seconds` name them (`operation`).
pub const ENDPOINTS: [&str; 6] = ["not_found", "healthz", "readyz", "metrics", "admin_api", "console"];

/// The endpoint a request path is for (one of [`ENDPOINTS`]).
pub fn endpoint(path: &str) -> &'static str {
    match path {
        "/healthz" => "healthz",
        "/readyz" => "readyz",
        "/metrics" => "metrics",
        p if p == "/admin" || p.starts_with("/admin/") => "admin_api",
        p if crate::ops::console::owns(p) => "console",
        _ => "not_found",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_segments_are_decoded_after_splitting() {
        let e = Endpoint::parse("/admin/records/acme/ops%20team/create_order/a%2Fb%25c").unwrap();
        let Endpoint::Record(s) = e else { panic!("{e:?}") };
        assert_eq!((&*s.tenant, &*s.principal, &*s.operation, s.key.as_str()), ("acme", "ops team", "create_order", "a/b%c"));
        assert!(matches!(Endpoint::parse("/admin/records/t/p/o/k/resolve"), Ok(Endpoint::Resolve(_))));
        assert!(matches!(Endpoint::parse("/admin/records"), Ok(Endpoint::Records)));
        assert!(matches!(Endpoint::parse("/admin/audit"), Ok(Endpoint::Audit)));
        assert!(matches!(Endpoint::parse("/admin/overview"), Ok(Endpoint::Overview)));
        assert!(matches!(Endpoint::parse("/admin/records/t/p/o/k/inspect"), Ok(Endpoint::Inspect(_))));
        // A raw `/` inside a key is a separator: too many segments.
        assert!(matches!(Endpoint::parse("/admin/records/t/p/o/a/b"), Err(AdminError::NotFound)));
        assert!(matches!(Endpoint::parse("/admin/records/t/p/o"), Err(AdminError::NotFound)));
        assert!(matches!(Endpoint::parse("/admin/records/t/p/o/k/other"), Err(AdminError::NotFound)));
        assert!(matches!(Endpoint::parse("/admin/records//p/o/k"), Err(AdminError::BadRequest(_))));
        assert!(matches!(Endpoint::parse("/admin/records/t/p//k"), Err(AdminError::BadRequest(_))));
        // A tenant-wide record (scope = "tenant") has an empty principal.
        let Ok(Endpoint::Record(s)) = Endpoint::parse("/admin/records/t//o/k") else { panic!() };
        assert_eq!(&*s.principal, crate::idempotency::key::TENANT_WIDE);
        assert!(matches!(Endpoint::parse("/admin/records/t/p/o/%FF"), Err(AdminError::BadRequest(_))));
        // Keys are visible ASCII: a space is refused as it is on the proxy.
        assert!(matches!(Endpoint::parse("/admin/records/t/p/o/a%20b"), Err(AdminError::BadRequest(_))));
    }

    /// Admin errors go through the proxy's problem renderer: the same
    /// document and headers, with the admin API's own additions.
    #[test]
    fn admin_problems_are_rendered_as_the_proxys() {
        let r = problem(&AdminError::StoreUnavailable);
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/problem+json");
        assert_eq!(r.headers()[header::CACHE_CONTROL], "no-store");
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        let r = problem(&AdminError::Unauthorized);
        assert_eq!(r.headers()[header::WWW_AUTHENTICATE], "Bearer realm=\"idemgate-admin\"");
        assert!(r.headers().get(header::RETRY_AFTER).is_none());
        assert_eq!(problem(&AdminError::MethodNotAllowed("POST")).headers()[header::ALLOW], "POST");
    }

    #[test]
    fn bearer_tokens_are_checked() {
        let token = Secret::new("s3cret".into());
        let with = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, HeaderValue::from_static(v));
            authorize(&h, &token)
        };
        assert!(with("Bearer s3cret").is_ok());
        assert!(with("bearer s3cret").is_ok());
        assert!(with("Bearer s3cret2").is_err());
        assert!(with("Bearer S3cret").is_err());
        assert!(with("Basic s3cret").is_err());
        assert!(with("s3cret").is_err());
        assert!(authorize(&HeaderMap::new(), &token).is_err());
    }

    #[test]
    fn resolve_bodies_are_validated() {
        let parse = |s: &str| resolve_request(&Bytes::from(s.to_owned()));
        let r = parse(r#"{"action":"release","reason":"checked the ledger"}"#).unwrap();
        assert!(matches!(r.action, ResolveAction::Release) && r.actor == Actor::Admin && !r.force);
        let r = parse(
            r#"{"action":"complete","status":201,"headers":{"Content-Type":"application/json","x-m":["a","b"]},"body_base64":"eyJvayI6MX0=","reason":"r","retention":"1h"}"#,
        )
        .unwrap();
        let ResolveAction::Complete { status, headers, body, retention } = r.action else { panic!() };
        assert_eq!(status, 201);
        assert_eq!(body.as_deref(), Some(&b"{\"ok\":1}"[..]));
        assert_eq!(
            headers,
            vec![("content-type".into(), b"application/json".to_vec()), ("x-m".into(), b"a".to_vec()), ("x-m".into(), b"b".to_vec())]
        );
        assert_eq!(retention, Some(Duration::from_secs(3600)));
        for (body, needle) in [
            (r#"{"action":"release"}"#, "reason"),
            (r#"{"action":"release","reason":"  "}"#, "reason"),
            (r#"{"action":"complete","reason":"r"}"#, "status"),
            (r#"{"action":"release","reason":"r","status":200}"#, "leave out"),
            (r#"{"action":"undo","reason":"r"}"#, "unknown action"),
            (r#"{"action":"complete","status":200,"body_base64":"***","reason":"r"}"#, "base64"),
            (r#"{"action":"release","reason":"r","colour":1}"#, "unknown field"),
            ("not json", "invalid JSON"),
        ] {
            match parse(body) {
                Err(AdminError::BadRequest(why)) => assert!(why.contains(needle), "{body}: {why}"),
                other => panic!("{body}: {other:?}"),
            }
        }
    }
}
