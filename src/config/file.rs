//! Stage one of configuration: the TOML file exactly as written.
//!
//! Every struct denies unknown fields, so a misspelt key is an error that names
//! its TOML path rather than a silently ignored setting. Values stay strings
//! here (durations, sizes, addresses, CIDRs); `super::validate` turns them into
//! typed values and reports every problem with its path. The text is parsed to a
//! TOML tree first and each section and entry deserialized from it on its own,
//! so type errors in several places are all reported (see [`parse`]).

use std::collections::BTreeMap;
use std::ops::Range;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use toml::Spanned;
use toml::de::{DeTable, DeValue, ValueDeserializer};

use super::error::{ConfigError, Issues};

/// The whole file, each part deserialized on its own: `[server]`, `[store]`,
/// `[admin]`, and every `[[upstreams]]`, `[[identity.sources]]` and `[[routes]]`
/// entry. A part that does not fit its type (a string where a number belongs, an
/// unknown key) is reported and marked [`Part::Broken`] without hiding the problems
/// of the others, so one run reports every error in the file.
#[derive(Debug, Default)]
pub struct FileConfig {
    /// Absent: all defaults.
    pub server: Part<ServerSection>,
    /// Absent (`None`): the embedded SQLite store at its default path.
    pub store: Part<Option<StoreSection>>,
    pub admin: Part<Option<AdminSection>>,
    pub upstreams: Vec<Part<UpstreamSection>>,
    /// `[[identity.sources]]`, the only key of `[identity]`.
    pub identity_sources: Vec<Part<IdentitySourceSection>>,
    pub routes: Vec<Part<RouteSection>>,
    /// `[workers]`: async operation workers on this replica.
    pub workers: Part<WorkersSection>,
}

/// One section or list entry after stage one.
#[derive(Debug)]
pub enum Part<T> {
    Ok(T),
    /// It did not deserialize; its issues are recorded and validation skips it.
    Broken(Keys),
}

/// The identifying keys of an entry that did not deserialize, when they are strings:
/// references to a broken upstream are not reported a second time, and checks across
/// entries (one route per operation and shape, the admin port) still see it.
#[derive(Debug, Default, Clone)]
pub struct Keys {
    pub name: Option<String>,
    pub operation: Option<String>,
    pub method: Option<String>,
    pub path: Option<String>,
    pub listen: Option<String>,
}

impl Part<RouteSection> {
    /// `(operation, method, path)` as written, whether or not the entry deserialized.
    pub fn route_keys(&self) -> (Option<&str>, Option<&str>, Option<&str>) {
        match self {
            Part::Ok(r) => (r.operation.as_deref(), r.method.as_deref(), r.path.as_deref()),
            Part::Broken(k) => (k.operation.as_deref(), k.method.as_deref(), k.path.as_deref()),
        }
    }
}

impl<T: Default> Default for Part<T> {
    fn default() -> Self {
        Part::Ok(T::default())
    }
}

impl<T> Part<T> {
    pub fn ok(&self) -> Option<&T> {
        match self {
            Part::Ok(t) => Some(t),
            Part::Broken(_) => None,
        }
    }
}

const TOP_LEVEL: &str = "`server`, `store`, `admin`, `upstreams`, `identity`, `routes`, `workers`";

/// Stage one. Only a TOML syntax error stops early (nothing after it can be read);
/// every other problem is recorded in `issues` with its TOML path and position.
pub(super) fn parse(text: &str, origin: &str, issues: &mut Issues) -> Result<FileConfig, ConfigError> {
    let root = DeTable::parse(text).map_err(|e| {
        let at = e.span().map(|span| position(text, span)).unwrap_or_default();
        ConfigError::single(origin, "", format!("{}{at}", e.message().trim()))
    })?;
    let mut found = Found::default();
    let mut file = FileConfig::default();
    for (key, value) in root.into_inner() {
        match key.get_ref().as_ref() {
            "server" => file.server = part(text, "server", value, &mut found),
            "store" => file.store = optional(part(text, "store", value, &mut found)),
            "admin" => file.admin = optional(part(text, "admin", value, &mut found)),
            "upstreams" => file.upstreams = entries(text, "upstreams", value, &mut found),
            "routes" => file.routes = entries(text, "routes", value, &mut found),
            "identity" => file.identity_sources = identity(text, value, &mut found),
            "workers" => file.workers = part(text, "workers", value, &mut found),
            other => unknown_key(text, "", other, key.span(), TOP_LEVEL, &mut found),
        }
    }
    found.list.sort_by_key(|(offset, _, _)| *offset);
    for (_, path, message) in found.list {
        issues.push(path, message);
    }
    Ok(file)
}

/// Issues of stage one with their byte offsets, to report them in file order (the
/// tree's tables are sorted by key).
#[derive(Default)]
struct Found {
    list: Vec<(usize, String, String)>,
}

impl Found {
    fn push(&mut self, text: &str, span: Range<usize>, path: impl Into<String>, message: impl Into<String>) {
        let at = position(text, span.clone());
        self.list.push((span.start, path.into(), format!("{}{at}", message.into())));
    }
}

fn optional<T>(part: Part<T>) -> Part<Option<T>> {
    match part {
        Part::Ok(t) => Part::Ok(Some(t)),
        Part::Broken(keys) => Part::Broken(keys),
    }
}

/// `[identity]` holds only `sources`.
fn identity(text: &str, value: Spanned<DeValue<'_>>, issues: &mut Found) -> Vec<Part<IdentitySourceSection>> {
    let span = value.span();
    let DeValue::Table(table) = value.into_inner() else {
        issues.push(text, span, "identity", "must be a table ([identity] or [[identity.sources]])");
        return Vec::new();
    };
    let mut sources = Vec::new();
    for (key, value) in table {
        match key.get_ref().as_ref() {
            "sources" => sources = entries(text, "identity.sources", value, issues),
            other => unknown_key(text, "identity.", other, key.span(), "`sources`", issues),
        }
    }
    sources
}

fn unknown_key(text: &str, prefix: &str, key: &str, span: Range<usize>, expected: &str, issues: &mut Found) {
    issues.push(text, span, format!("{prefix}{key}"), format!("unknown field `{key}`, expected one of {expected}"));
}

/// An array of tables (`[[name]]`), each entry deserialized on its own.
fn entries<T: DeserializeOwned>(text: &str, path: &str, value: Spanned<DeValue<'_>>, issues: &mut Found) -> Vec<Part<T>> {
    let span = value.span();
    let DeValue::Array(items) = value.into_inner() else {
        issues.push(text, span, path, format!("must be an array of tables ([[{path}]])"));
        return Vec::new();
    };
    items.into_iter().enumerate().map(|(i, item)| part(text, &format!("{path}[{i}]"), item, issues)).collect()
}

/// Deserializes one part, recording a failure with its full TOML path and position.
/// A part that fails is deserialized again field by field (each alone, with the
/// part's `kind`), so that every field in error is reported in one run, not only
/// the first the whole part stopped at.
fn part<T: DeserializeOwned>(text: &str, path: &str, value: Spanned<DeValue<'_>>, issues: &mut Found) -> Part<T> {
    let key = |k: &str| value.get_ref().get(k).and_then(|v| v.get_ref().as_str()).map(str::to_owned);
    let keys = Keys { name: key("name"), operation: key("operation"), method: key("method"), path: key("path"), listen: key("listen") };
    let whole = value.span();
    let fields = match value.get_ref() {
        DeValue::Table(table) => Some(table.clone()),
        _ => None,
    };
    let first = match serde_path_to_error::deserialize(ValueDeserializer::from(value)) {
        Ok(t) => return Part::Ok(t),
        Err(e) => error_at(path, &e, whole.clone()),
    };
    let mut reported = vec![(first.1.clone(), first.2.clone())];
    issues.push(text, first.0, first.1, first.2);
    let kind = fields.as_ref().and_then(|t| t.iter().find(|(k, _)| k.get_ref().as_ref() == "kind").map(|(k, v)| (k.clone(), v.clone())));
    for (name, field) in fields.into_iter().flatten() {
        if name.get_ref().as_ref() == "kind" {
            continue;
        }
        let mut alone = DeTable::new();
        if let Some((k, v)) = &kind {
            alone.insert(k.clone(), v.clone());
        }
        alone.insert(name, field);
        let Err(e) = serde_path_to_error::deserialize::<_, T>(ValueDeserializer::from(Spanned::new(whole.clone(), DeValue::Table(alone))))
        else {
            continue;
        };
        let (span, full, message) = error_at(path, &e, whole.clone());
        // A field alone misses the others: that is not its problem.
        if message.starts_with("missing field") || reported.contains(&(full.clone(), message.clone())) {
            continue;
        }
        reported.push((full.clone(), message.clone()));
        issues.push(text, span, full, message);
    }
    Part::Broken(keys)
}

/// Where a part's deserialization failed: the span, the full TOML path and
/// the message.
fn error_at(path: &str, e: &serde_path_to_error::Error<toml::de::Error>, whole: Range<usize>) -> (Range<usize>, String, String) {
    let inner = e.path().to_string();
    let full = match inner.as_str() {
        "." => path.to_owned(),
        _ if inner.starts_with('[') => format!("{path}{inner}"),
        _ => format!("{path}.{inner}"),
    };
    (e.inner().span().unwrap_or(whole), full, e.inner().message().trim().to_owned())
}

/// ` (line L, column C)` of a byte offset, for messages.
fn position(text: &str, span: Range<usize>) -> String {
    let before = text.get(..span.start.min(text.len())).unwrap_or_default();
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let col = before.get(line_start..).unwrap_or_default().chars().count() + 1;
    format!(" (line {line}, column {col})")
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSection {
    pub listen: Option<String>,
    pub max_request_body: Option<String>,
    pub shutdown_grace: Option<String>,
    pub default_upstream: Option<String>,
    pub request_header_timeout: Option<String>,
    pub request_body_timeout: Option<String>,
    /// HTTP/2 PING cadence on the proxy and admin listeners.
    pub http2_keep_alive_interval: Option<String>,
    pub replica_id: Option<String>,
    pub derived_key_secret_env: Option<String>,
    pub derived_key_secret_file: Option<String>,
    pub workers: Option<i64>,
    /// One access-log line per request (default on).
    pub access_log: Option<bool>,
    /// SIGTERM: keep accepting this long while `/readyz` answers 503.
    pub drain_delay: Option<String>,
    /// Peers (CIDRs) whose `X-Request-Id` is kept.
    pub trusted_proxies: Option<Vec<String>>,
    /// Request header names with `_`: "drop" (default), "refuse" or "allow".
    pub headers_with_underscores: Option<String>,
    /// Open client connections at most (all workers together).
    pub max_connections: Option<i64>,
    /// Bind the proxy port with SO_REUSEPORT (other processes may share it).
    pub reuse_port: Option<bool>,
    /// `[server.tls]`: HTTPS (and HTTP/2 by ALPN) on the proxy listener.
    pub tls: Option<TlsSection>,
}

/// `[server.tls]` / `[admin.tls]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    pub cert_file: Option<String>,
    pub key_file: Option<String>,
    pub client_ca_file: Option<String>,
    pub client_auth: Option<String>,
    pub handshake_timeout: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreSection {
    pub kind: Option<String>,
    pub url: Option<String>,
    pub url_env: Option<String>,
    pub url_file: Option<String>,
    pub path: Option<String>,
    pub pool_size: Option<i64>,
    pub pooler: Option<String>,
    pub migrate: Option<bool>,
    pub unreachable_at_start: Option<String>,
    pub operation_timeout: Option<String>,
    pub sweep_interval: Option<String>,
    pub sweep_batch: Option<i64>,
    pub events_retention: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminSection {
    pub listen: Option<String>,
    pub token_env: Option<String>,
    pub token_file: Option<String>,
    /// What logs and the audit trail call the admin token (default: a keyed hash).
    pub token_label: Option<String>,
    /// Query parameters masked where a stored request is shown, besides the
    /// built-in credential names.
    pub masked_query_params: Option<Vec<String>>,
    pub tls: Option<TlsSection>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamSection {
    pub name: Option<String>,
    pub url: Option<String>,
    pub connect_timeout: Option<String>,
    pub timeout: Option<String>,
    pub pool_idle_timeout: Option<String>,
    pub pool_max_idle: Option<i64>,
    /// https upstreams: trusted roots (PEM); absent: the system's.
    pub ca_file: Option<String>,
    /// https upstreams: a client certificate (chain) and its key.
    pub client_cert_file: Option<String>,
    pub client_key_file: Option<String>,
    /// Admission under overload: the requests in flight to this upstream
    /// (per replica). Set, it fixes the limit (unless `adaptive = true`
    /// makes it the adaptive limit's ceiling).
    pub max_in_flight: Option<i64>,
    /// Whether the limit follows the upstream's latency (default true;
    /// false without `max_in_flight`: no limit).
    pub adaptive: Option<bool>,
    /// How long a request may wait for a slot before it is refused.
    pub queue_timeout: Option<String>,
}

/// One `[[identity.sources]]` entry; `kind` selects which fields apply.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentitySourceSection {
    pub kind: Option<String>,
    // kind = "api_key"
    pub header: Option<String>,
    pub keys: Option<Vec<ApiKeySection>>,
    // kind = "trusted_header"
    pub tenant_header: Option<String>,
    pub principal_header: Option<String>,
    pub trusted_peers: Option<Vec<String>>,
    // kind = "jwt" (also `header`)
    pub jwks_file: Option<String>,
    pub jwks_url: Option<String>,
    pub jwks_refresh: Option<String>,
    pub issuer: Option<OneOrMany>,
    pub audience: Option<OneOrMany>,
    pub algorithms: Option<Vec<String>>,
    pub secret_env: Option<String>,
    pub secret_file: Option<String>,
    pub tenant_claim: Option<String>,
    pub principal_claim: Option<String>,
    pub leeway: Option<String>,
    // kind = "mtls"
    pub tenant_from: Option<String>,
    pub principal_from: Option<String>,
    pub tenant_regex: Option<String>,
    pub principal_regex: Option<String>,
}

/// A string or a list of strings (`audience = "api"` or `audience = ["a", "b"]`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string or a list of strings")]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }

    pub fn items(&self) -> Vec<&str> {
        match self {
            OneOrMany::One(s) => vec![s.as_str()],
            OneOrMany::Many(v) => v.iter().map(String::as_str).collect(),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeySection {
    pub sha256: Option<String>,
    /// The SHA-256 read from this environment variable instead (a container
    /// image's config lists no key anyone knows).
    pub sha256_env: Option<String>,
    pub tenant: Option<String>,
    pub principal: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteSection {
    pub operation: Option<String>,
    pub method: Option<String>,
    pub path: Option<String>,
    pub upstream: Option<String>,
    pub mode: Option<String>,
    pub key_header: Option<String>,
    /// Where the key comes from: `"header:<name>"`, `"body:<JSON Pointer>"`,
    /// or a list of them (first present wins).
    pub key_from: Option<OneOrMany>,
    pub key_required: Option<bool>,
    pub retention: Option<String>,
    pub in_flight: Option<String>,
    pub in_flight_wait: Option<String>,
    pub release_on_status: Option<Vec<i64>>,
    /// A size (`"1MiB"`) or a number of bytes (`0`: status and headers only).
    pub max_stored_response: Option<SizeValue>,
    pub upstream_idempotent: Option<bool>,
    pub lease: Option<String>,
    pub mismatch_status: Option<i64>,
    pub forward_key: Option<String>,
    /// Async mode: `Prefer: respond-async` is honoured on a sync route.
    pub allow_async: Option<bool>,
    /// Async mode: how often clients should poll (the 202's `Retry-After`).
    pub poll_interval: Option<String>,
    /// Async mode: retries of refused or declined attempts.
    #[serde(default)]
    pub retry: RetrySection,
    /// Completion events (the outbox) for this route.
    pub events: Option<EventsSection>,
    /// An external authorizer asked before every request on the route.
    pub authorize: Option<AuthorizeSection>,
    /// `principal` (default) or `tenant`: who shares the key space.
    pub scope: Option<String>,
    /// `stored` (default) or `refetch`.
    pub replay: Option<String>,
    /// Observe mode: how long the store may delay a request.
    pub observe_budget: Option<String>,
    #[serde(default)]
    pub fingerprint: FingerprintSection,
    /// `[routes.reconcile]`: the probe that settles `unknown` records.
    pub reconcile: Option<ReconcileSection>,
    /// Admission: this route's requests in flight to its upstream (per
    /// replica), within the upstream's own limit.
    pub max_in_flight: Option<i64>,
    /// Async routes: the most operations queued before acceptances are refused.
    pub max_queued: Option<i64>,
}

/// `[routes.reconcile]`, see `crate::request::reconcile_probe::Probe`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReconcileSection {
    /// `"GET /v1/orders/by-key/{derived_key}"`.
    pub probe: Option<String>,
    pub found: Option<Vec<i64>>,
    pub found_as: Option<i64>,
    pub absent: Option<Vec<i64>>,
    pub settle: Option<String>,
    pub interval: Option<String>,
}

/// A size written as a string (`"64KiB"`) or as a number of bytes.
#[derive(Debug, Deserialize)]
#[serde(untagged, expecting = "a size such as \"64KiB\" or a number of bytes")]
pub enum SizeValue {
    Text(String),
    Bytes(i64),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrySection {
    pub max_attempts: Option<i64>,
    pub backoff: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthorizeSection {
    pub url: Option<String>,
    pub timeout: Option<String>,
    pub headers: Option<Vec<String>>,
    pub cache: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsSection {
    pub url: Option<String>,
    pub secret_env: Option<String>,
    pub secret_file: Option<String>,
    pub timeout: Option<String>,
    pub max_attempts: Option<i64>,
    pub emit: Option<Vec<String>>,
    pub include_key: Option<bool>,
    pub include_body: Option<bool>,
    pub batch: Option<i64>,
    pub concurrency: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkersSection {
    pub count: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FingerprintSection {
    #[serde(default)]
    pub exclude: Vec<String>,
    #[serde(default)]
    pub defaults: BTreeMap<String, toml::Value>,
    #[serde(default)]
    pub headers: Vec<String>,
}
