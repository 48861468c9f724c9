//! Stage two: from [`FileConfig`] to [`Config`], collecting every issue.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};
use ipnet::IpNet;

use super::error::{ConfigError, Issues};
use super::file::{
    AuthorizeSection, EventsSection, FileConfig, IdentitySourceSection, OneOrMany, Part, ReconcileSection, RouteSection, SizeValue,
    StoreSection, TlsSection, UpstreamSection,
};
use super::hardening::{Hardening, Warnings};
use super::{AdminConfig, Config, DEFAULT_SQLITE_PATH, Secret, ServerConfig, StoreBackend, StoreConfig, UpstreamConfig, WorkersConfig};
use crate::idempotency::fingerprint::{FingerprintSpec, JsonPointer};
use crate::idempotency::record::Retention;
use crate::outbox::{EventType, EventsConfig};
use crate::request::authorize::AuthorizeConfig;
use crate::request::identity::{Identity, IdentitySource};
use crate::request::key_source::{KeySource, KeySources};
use crate::request::reconcile_probe::{Probe, ProbeTarget};
use crate::request::route::{
    BackgroundPolicy, Execution, ForwardKey, InFlightPolicy, KeyPolicy, Mode, PathTemplate, Queueing, RecordPolicy, ReplayMode,
    RetryPolicy, Route, ScopeMode,
};
use crate::store::{Pooler, UnreachableAtStart};
use crate::tls::client::ClientTls;
use crate::tls::server::{ClientAuth, ListenerTls};
use crate::upstream::headers::UnderscoreHeaders;
use crate::upstream::limit::{self, LimitPolicy};

/// Longest accepted duration: beyond it, database interval arithmetic and
/// timestamps overflow (PostgreSQL refuses the claim; SQLite would not).
const MAX_DURATION: Duration = Duration::from_secs(10 * 366 * 24 * 3600);

/// `server.max_connections` when absent.
const DEFAULT_MAX_CONNECTIONS: i64 = 10_000;

/// `server.listen` when absent.
const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// Margin added to the upstream timeout for the default lease.
const LEASE_MARGIN: Duration = Duration::from_secs(5);

/// What a synchronous route's lease must leave beyond the upstream's timeout:
/// room for the claim before the forward and the result write after it.
const LEASE_WRITE_ROOM: Duration = Duration::from_millis(500);

/// `routes[].mode` as written, before its settings are gathered into a [`Mode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ModeName {
    Sync,
    Async,
    Observe,
}

/// `routes[].max_queued` when absent: async operations queued per route
/// before acceptances are refused.
const DEFAULT_MAX_QUEUED: i64 = Queueing::DEFAULT.max_queued as i64;
/// `upstreams[].connect_timeout` when absent (capped at half the timeout).
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

pub(super) fn validate(raw: FileConfig, issues: Issues, origin: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
    let client_certificates = raw.server.ok().and_then(|s| s.tls.as_ref()).is_some_and(|t| t.client_ca_file.is_some());
    let mut v = Validator { issues, warnings: Warnings::default(), env, client_certificates };
    let upstreams = v.upstreams(&raw.upstreams);
    let names: HashMap<&str, usize> = upstreams.iter().enumerate().map(|(i, u)| (u.name.as_str(), i)).collect();
    let server = raw.server.ok().and_then(|s| v.server(s, &names));
    let store = raw.store.ok().and_then(|s| v.store(s.as_ref()));
    let admin = match &raw.admin {
        Part::Ok(None) => Some(None),
        Part::Ok(Some(a)) => v.admin(a).map(Some),
        Part::Broken(_) => None,
    };
    let identity: Vec<IdentitySource> =
        raw.identity_sources.iter().enumerate().filter_map(|(i, s)| s.ok().and_then(|s| v.identity_source(i, s))).collect();
    let routes: Vec<Route> =
        raw.routes.iter().enumerate().filter_map(|(i, r)| r.ok().and_then(|r| v.route(i, r, &names, &upstreams))).collect();
    // Checks across entries look at every entry that reads well enough, even one
    // that has other problems, so fixing one error does not reveal the next.
    v.distinct_operations(&raw.routes);
    v.distinct_route_shapes(&raw.routes);
    v.admin_port(&raw);
    if !raw.routes.is_empty() && raw.identity_sources.is_empty() {
        v.issues.push("identity.sources", "at least one identity source is required when [[routes]] are configured; without one every idempotent request is refused with 401");
    }
    if raw.routes.is_empty() && raw.server.ok().is_some_and(|s| s.default_upstream.is_none()) {
        v.issues.push(
            "",
            "nothing to serve: the file has no [[routes]] and no server.default_upstream (see config/idemgate.toml for an example)",
        );
    }
    let workers = raw.workers.ok().and_then(|w| match w.count.unwrap_or(2) {
        n @ 0..=256 => Some(WorkersConfig { count: n as usize }),
        n => {
            v.issues.push("workers.count", format!("must be 0-256, not {n}"));
            None
        }
    });
    // One replica by definition on the embedded store: without workers, no
    // one would ever run what its async routes accept.
    if let (Some(store), Some(WorkersConfig { count: 0 })) = (&store, &workers)
        && matches!(store.backend, StoreBackend::Sqlite { .. })
        && let Some(i) = routes.iter().position(Route::may_run_async)
    {
        v.issues.push(
            "workers.count",
            format!(
                "0 workers on the embedded store (one replica) would leave every operation of the async route {} queued forever: \
                 use at least 1, or a PostgreSQL store shared with replicas that run workers",
                routes[i].operation
            ),
        );
    }
    if !v.issues.list.is_empty() {
        return Err(ConfigError { file: origin.to_owned(), issues: v.issues.list });
    }
    match (server, store, admin, workers) {
        (Some(server), Some(store), Some(admin), Some(workers)) => Ok(Config {
            server,
            store,
            admin,
            upstreams: upstreams.into_iter().filter_map(|u| u.config).collect(),
            identity,
            routes,
            workers,
            warnings: v.warnings.list,
        }),
        _ => Err(ConfigError::single(origin, "", "invalid configuration")),
    }
}

/// An upstream entry; `config` is `None` when the entry is invalid, so indices
/// stay aligned with the file while validation goes on.
struct Upstream {
    name: String,
    config: Option<UpstreamConfig>,
}

struct Validator<'e> {
    issues: Issues,
    /// Valid but insecure settings (see [`super::hardening`]).
    warnings: Warnings,
    env: &'e dyn Fn(&str) -> Option<String>,
    /// `[server.tls]` verifies client certificates (`kind = "mtls"` needs it).
    client_certificates: bool,
}

impl Validator<'_> {
    /// An operation is the key's scope: two routes sharing one would replay each
    /// other's records (and mix idempotent and non-idempotent upstreams).
    fn distinct_operations(&mut self, routes: &[Part<RouteSection>]) {
        let mut first: HashMap<&str, usize> = HashMap::new();
        for (i, r) in routes.iter().enumerate() {
            let Some(op) = r.route_keys().0 else { continue };
            if let Some(j) = first.get(op) {
                self.issues.push(
                    format!("routes[{i}].operation"),
                    format!(
                        "operation {op:?} is already the operation of routes[{j}]; each operation belongs to exactly one route \
                         (records are scoped by operation, so two routes sharing one would replay each other's answers)"
                    ),
                );
            } else {
                first.insert(op, i);
            }
        }
    }

    /// Two routes of one method whose templates have the same shape match exactly the
    /// same requests: neither is more specific, so one would never be reached.
    fn distinct_route_shapes(&mut self, routes: &[Part<RouteSection>]) {
        let parsed: Vec<(usize, Method, PathTemplate)> = routes
            .iter()
            .enumerate()
            .filter_map(|(i, r)| {
                let (_, method, path) = r.route_keys();
                let method = Method::from_bytes(method?.to_ascii_uppercase().as_bytes()).ok()?;
                Some((i, method, PathTemplate::parse(path?).ok()?))
            })
            .collect();
        for (n, (i, method, path)) in parsed.iter().enumerate() {
            if let Some((j, _, other)) = parsed[..n].iter().find(|(_, m, other)| m == method && other.same_shape(path)) {
                self.issues.push(
                    format!("routes[{i}].path"),
                    format!(
                        "{method} {} matches exactly the same requests as routes[{j}] ({method} {}), so one of them could never be reached",
                        path.as_str(),
                        other.as_str()
                    ),
                );
            }
        }
    }

    /// The admin listener cannot bind the proxy's port on an overlapping address
    /// (port 0 asks the system for a free port, so it never clashes).
    fn admin_port(&mut self, raw: &FileConfig) {
        let proxy = match &raw.server {
            Part::Ok(s) => s.listen.as_deref(),
            Part::Broken(k) => k.listen.as_deref(),
        };
        let admin = match &raw.admin {
            Part::Ok(a) => a.as_ref().and_then(|a| a.listen.as_deref()),
            Part::Broken(k) => k.listen.as_deref(),
        };
        let proxy = proxy.unwrap_or(DEFAULT_LISTEN).parse::<SocketAddr>().ok();
        let admin = admin.and_then(|a| a.parse::<SocketAddr>().ok());
        let (Some(proxy), Some(admin)) = (proxy, admin) else { return };
        let overlap = proxy.ip() == admin.ip() || proxy.ip().is_unspecified() || admin.ip().is_unspecified();
        if admin.port() != 0 && admin.port() == proxy.port() && overlap {
            self.issues.push(
                "admin.listen",
                format!("{admin} clashes with the proxy listener (server.listen = {proxy}): the admin listener needs a port of its own"),
            );
        }
    }

    fn duration(&mut self, path: &str, value: Option<&str>, default: &str) -> Option<Duration> {
        let s = value.unwrap_or(default);
        match humantime::parse_duration(s) {
            Ok(d) if d > MAX_DURATION => {
                self.issues.push(path, format!("{s:?} is too long (at most {})", humantime::format_duration(MAX_DURATION)));
                None
            }
            Ok(d) => Some(d),
            Err(e) => {
                self.issues.push(path, format!("invalid duration {s:?}: {e} (write e.g. \"250ms\", \"30s\", \"24h\")"));
                None
            }
        }
    }

    /// A duration that must not be shorter than `min` (zero timeouts would make
    /// every request fail, a zero interval would spin).
    fn at_least(&mut self, path: &str, d: Option<Duration>, min: Duration) -> Option<Duration> {
        match d {
            Some(d) if d < min => {
                self.issues.push(path, format!("must be at least {}", humantime::format_duration(min)));
                None
            }
            other => other,
        }
    }

    fn size(&mut self, path: &str, value: Option<&str>, default: &str) -> Option<u64> {
        let s = value.unwrap_or(default);
        let ok = s.trim().bytes().next().is_some_and(|b| b.is_ascii_digit());
        match s.trim().parse::<bytesize::ByteSize>() {
            Ok(b) if ok => Some(b.as_u64()),
            Ok(_) => {
                self.issues.push(path, format!("invalid size {s:?} (write e.g. \"64KiB\", \"1MiB\")"));
                None
            }
            Err(e) => {
                self.issues.push(path, format!("invalid size {s:?}: {e} (write e.g. \"64KiB\", \"1MiB\")"));
                None
            }
        }
    }

    fn addr(&mut self, path: &str, value: Option<&str>, default: Option<&str>) -> Option<SocketAddr> {
        let Some(s) = value.or(default) else {
            self.issues.push(path, "required");
            return None;
        };
        match s.parse() {
            Ok(a) => Some(a),
            Err(_) => {
                self.issues.push(path, format!("invalid socket address {s:?} (write e.g. \"127.0.0.1:8080\")"));
                None
            }
        }
    }

    /// A list of CIDRs (a bare address is a /32 or /128); `None` if one is invalid.
    fn cidrs(&mut self, path: &str, list: &[String]) -> Option<Vec<IpNet>> {
        let mut nets = Vec::with_capacity(list.len());
        let mut ok = true;
        for (k, cidr) in list.iter().enumerate() {
            match cidr.parse::<IpNet>().or_else(|_| cidr.parse::<std::net::IpAddr>().map(IpNet::from)) {
                Ok(net) => nets.push(net),
                Err(_) => {
                    ok = false;
                    self.issues.push(format!("{path}[{k}]"), format!("invalid CIDR {cidr:?} (write e.g. \"10.0.0.0/8\")"));
                }
            }
        }
        ok.then_some(nets)
    }

    fn header_name(&mut self, path: &str, value: Option<&str>, default: &'static str) -> Option<HeaderName> {
        let s = value.unwrap_or(default);
        match HeaderName::from_bytes(s.as_bytes()) {
            Ok(h) => Some(h),
            Err(_) => {
                self.issues.push(path, format!("invalid header name {s:?}"));
                None
            }
        }
    }

    fn required<'a>(&mut self, path: &str, value: Option<&'a str>) -> Option<&'a str> {
        match value {
            Some(s) if !s.trim().is_empty() => Some(s),
            Some(_) => {
                self.issues.push(path, "must not be empty");
                None
            }
            None => {
                self.issues.push(path, "required");
                None
            }
        }
    }

    /// A secret given inline, by environment variable, or by file — exactly one.
    fn secret(&mut self, path: &str, inline: Option<&str>, env_name: Option<&str>, file: Option<&str>) -> Option<Option<Secret>> {
        let given = [inline.is_some(), env_name.is_some(), file.is_some()].iter().filter(|b| **b).count();
        if given > 1 {
            self.issues.push(path, "give only one way to read the secret");
            return None;
        }
        if let Some(s) = inline {
            return Some(Some(Secret::new(s.to_owned())));
        }
        if let Some(name) = env_name {
            return match (self.env)(name) {
                Some(v) if !v.trim().is_empty() => Some(Some(Secret::new(v.trim().to_owned()))),
                _ => {
                    self.issues.push(format!("{path}_env"), format!("environment variable {name} is not set"));
                    None
                }
            };
        }
        if let Some(f) = file {
            if super::hardening::readable_by_others(f) == Some(true) {
                self.warnings.push(
                    format!("{path}_file"),
                    Hardening::Secrets,
                    format!("{f} is readable by its group or by others: another account on this machine can read the secret; chmod 600 it"),
                );
            }
            return match std::fs::read_to_string(f) {
                Ok(v) if !v.trim().is_empty() => Some(Some(Secret::new(v.trim().to_owned()))),
                Ok(_) => {
                    self.issues.push(format!("{path}_file"), format!("file {f} is empty"));
                    None
                }
                Err(e) => {
                    self.issues.push(format!("{path}_file"), format!("cannot read {f}: {e}"));
                    None
                }
            };
        }
        Some(None)
    }

    fn server(&mut self, s: &super::file::ServerSection, names: &HashMap<&str, usize>) -> Option<ServerConfig> {
        let listen = self.addr("server.listen", s.listen.as_deref(), Some(DEFAULT_LISTEN));
        let max_request_body = self.size("server.max_request_body", s.max_request_body.as_deref(), "1MiB");
        let shutdown_grace = self.duration("server.shutdown_grace", s.shutdown_grace.as_deref(), "30s");
        let request_header_timeout = self.duration("server.request_header_timeout", s.request_header_timeout.as_deref(), "10s");
        let request_body_timeout = self.duration("server.request_body_timeout", s.request_body_timeout.as_deref(), "30s");
        let http2_keep_alive_interval = self.duration("server.http2_keep_alive_interval", s.http2_keep_alive_interval.as_deref(), "20s");
        let http2_keep_alive_interval =
            self.at_least("server.http2_keep_alive_interval", http2_keep_alive_interval, Duration::from_millis(100));
        let default_upstream = match s.default_upstream.as_deref() {
            None => Some(None),
            Some(name) => match names.get(name) {
                Some(&i) => Some(Some(i)),
                None => {
                    self.issues.push("server.default_upstream", format!("no [[upstreams]] entry is named {name:?}"));
                    None
                }
            },
        };
        let replica_id = match s.replica_id.as_deref() {
            Some(id) if id.trim().is_empty() || id.len() > 128 => {
                self.issues.push("server.replica_id", "must be 1-128 characters");
                None
            }
            Some(id) => Some(id.to_owned()),
            None => Some(default_replica_id()),
        };
        let workers = match s.workers {
            None => Some(std::thread::available_parallelism().map_or(1, |n| n.get())),
            Some(n @ 1..=256) => Some(n as usize),
            Some(n) => {
                self.issues.push("server.workers", format!("must be between 1 and 256, not {n}"));
                None
            }
        };
        let derived_key_secret =
            self.secret("server.derived_key_secret", None, s.derived_key_secret_env.as_deref(), s.derived_key_secret_file.as_deref());
        let drain_delay = self.duration("server.drain_delay", s.drain_delay.as_deref(), "0s");
        let trusted_proxies = self.cidrs("server.trusted_proxies", s.trusted_proxies.as_deref().unwrap_or_default());
        let max_connections = match s.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS) {
            n @ 1..=1_000_000 => Some(n as usize),
            n => {
                self.issues.push("server.max_connections", format!("must be between 1 and 1000000, not {n}"));
                None
            }
        };
        let tls = match &s.tls {
            Some(t) => self.listener_tls("server.tls", t, &[b"h2", b"http/1.1"]).map(Some),
            None => Some(None),
        };
        let headers_with_underscores = match s.headers_with_underscores.as_deref() {
            None | Some("drop") => Some(UnderscoreHeaders::Drop),
            Some("refuse") => Some(UnderscoreHeaders::Refuse),
            Some("allow") => Some(UnderscoreHeaders::Allow),
            Some(other) => {
                self.issues
                    .push("server.headers_with_underscores", format!("unknown value {other:?}: use \"drop\", \"refuse\" or \"allow\""));
                None
            }
        };
        Some(ServerConfig {
            headers_with_underscores: headers_with_underscores?,
            max_connections: max_connections?,
            tls: tls?,
            access_log: s.access_log.unwrap_or(true),
            reuse_port: s.reuse_port.unwrap_or(false),
            drain_delay: drain_delay?,
            trusted_proxies: trusted_proxies?,
            derived_key_secret: derived_key_secret?,
            workers: workers?,
            listen: listen?,
            max_request_body: max_request_body?,
            shutdown_grace: shutdown_grace?,
            default_upstream: default_upstream?,
            request_header_timeout: request_header_timeout?,
            request_body_timeout: request_body_timeout?,
            http2_keep_alive_interval: http2_keep_alive_interval?,
            replica_id: replica_id?,
        })
    }

    fn store(&mut self, s: Option<&StoreSection>) -> Option<StoreConfig> {
        let default = StoreSection::default();
        let s = s.unwrap_or(&default);
        let migrate = s.migrate.unwrap_or(true);
        let unreachable_at_start = match s.unreachable_at_start.as_deref() {
            None | Some("retry") => Some(UnreachableAtStart::Retry),
            Some("exit") => Some(UnreachableAtStart::Exit),
            Some(other) => {
                self.issues.push("store.unreachable_at_start", format!("unknown value {other:?}: use \"retry\" or \"exit\""));
                None
            }
        };
        let operation_timeout = self.duration("store.operation_timeout", s.operation_timeout.as_deref(), "5s");
        let operation_timeout = self.at_least("store.operation_timeout", operation_timeout, Duration::from_millis(10));
        let sweep_interval = self.duration("store.sweep_interval", s.sweep_interval.as_deref(), "30s");
        let sweep_interval = self.at_least("store.sweep_interval", sweep_interval, Duration::from_millis(10));
        let events_retention = self.duration("store.events_retention", s.events_retention.as_deref(), "7d");
        let events_retention = self.at_least("store.events_retention", events_retention, Duration::from_secs(1));
        let sweep_batch = match s.sweep_batch.unwrap_or(500) {
            n @ 1..=100_000 => Some(n as u32),
            n => {
                self.issues.push("store.sweep_batch", format!("must be between 1 and 100000, not {n}"));
                None
            }
        };
        let backend = match s.kind.as_deref().unwrap_or("sqlite") {
            kind @ ("postgres" | "citus") => {
                if s.path.is_some() {
                    self.issues.push("store.path", "only for kind = \"sqlite\"");
                }
                let pool_size = match s.pool_size.unwrap_or(16) {
                    n @ 1..=1024 => Some(n as usize),
                    n => {
                        self.issues.push("store.pool_size", format!("must be between 1 and 1024, not {n}"));
                        None
                    }
                };
                let url = match self.secret("store.url", s.url.as_deref(), s.url_env.as_deref(), s.url_file.as_deref()) {
                    Some(Some(url)) => self.postgres_url(s, url),
                    Some(None) => {
                        self.issues.push("store.url_env", format!("kind = \"{kind}\" needs url_env, url_file or url"));
                        None
                    }
                    None => None,
                };
                let pooler = match s.pooler.as_deref() {
                    None | Some("none") => Some(Pooler::None),
                    Some("session") => Some(Pooler::Session),
                    Some("transaction") => Some(Pooler::Transaction),
                    Some(other) => {
                        self.issues.push("store.pooler", format!("unknown value {other:?}: use \"none\", \"session\" or \"transaction\""));
                        None
                    }
                };
                match (url, pool_size, pooler) {
                    (Some(url), Some(pool_size), Some(pooler)) if kind == "citus" => Some(StoreBackend::Citus { url, pool_size, pooler }),
                    (Some(url), Some(pool_size), Some(pooler)) => Some(StoreBackend::Postgres { url, pool_size, pooler }),
                    _ => None,
                }
            }
            "sqlite" => {
                for (field, set) in [
                    ("store.url", s.url.is_some()),
                    ("store.url_env", s.url_env.is_some()),
                    ("store.url_file", s.url_file.is_some()),
                    ("store.pool_size", s.pool_size.is_some()),
                    ("store.pooler", s.pooler.is_some()),
                    ("store.unreachable_at_start", s.unreachable_at_start.is_some()),
                ] {
                    if set {
                        self.issues.push(field, "only for kind = \"postgres\" or \"citus\"");
                    }
                }
                let path = s.path.as_deref().unwrap_or(DEFAULT_SQLITE_PATH);
                if path.trim().is_empty() {
                    self.issues.push("store.path", "must not be empty");
                    None
                } else {
                    Some(StoreBackend::Sqlite { path: PathBuf::from(path) })
                }
            }
            other => {
                self.issues.push("store.kind", format!("unknown store kind {other:?}: use \"postgres\", \"citus\" or \"sqlite\""));
                None
            }
        };
        Some(StoreConfig {
            backend: backend?,
            migrate,
            unreachable_at_start: unreachable_at_start?,
            operation_timeout: operation_timeout?,
            sweep_interval: sweep_interval?,
            sweep_batch: sweep_batch?,
            events_retention: events_retention?,
        })
    }

    /// `[routes.authorize]`: who is asked, how long, what it is told.
    fn authorize(&mut self, p: &str, a: &AuthorizeSection) -> Option<AuthorizeConfig> {
        let url = self.required(&format!("{p}.url"), a.url.as_deref()).and_then(|u| match u.parse::<http::Uri>() {
            Ok(uri) if uri.scheme_str() == Some("http") && uri.authority().is_some() => Some(uri),
            Ok(uri) if uri.scheme_str() == Some("https") && uri.authority().is_some() => self.system_roots(&format!("{p}.url"), uri),
            _ => {
                self.issues.push(format!("{p}.url"), format!("invalid URL {u:?} (write e.g. \"http://authz:8181/check\")"));
                None
            }
        });
        let timeout = self.duration(&format!("{p}.timeout"), a.timeout.as_deref(), "1s");
        let timeout = self.at_least(&format!("{p}.timeout"), timeout, Duration::from_millis(10));
        let cache = self.duration(&format!("{p}.cache"), a.cache.as_deref(), "0s");
        let mut headers = Vec::new();
        for (k, h) in a.headers.as_deref().unwrap_or(&["authorization".to_owned()]).iter().enumerate() {
            if let Some(name) = self.header_name(&format!("{p}.headers[{k}]"), Some(h), "") {
                headers.push(name);
            }
        }
        Some(AuthorizeConfig { url: url?, timeout: timeout?, headers, cache: cache? })
    }

    /// `[routes.events]`: where and how completion events are delivered.
    fn events(&mut self, p: &str, e: &EventsSection) -> Option<EventsConfig> {
        let url = self.required(&format!("{p}.url"), e.url.as_deref()).and_then(|u| match u.parse::<http::Uri>() {
            Ok(uri) if uri.authority().is_some_and(|a| a.as_str().contains('@')) => {
                self.issues.push(
                    format!("{p}.url"),
                    "a user or password in the URL is not sent; receivers verify events by their signature (secret_env or secret_file)",
                );
                None
            }
            Ok(uri) if uri.scheme_str() == Some("http") && uri.authority().is_some() => Some(uri),
            Ok(uri) if uri.scheme_str() == Some("https") && uri.authority().is_some() => self.system_roots(&format!("{p}.url"), uri),
            _ => {
                self.issues.push(format!("{p}.url"), format!("invalid URL {u:?} (write e.g. \"http://hooks.internal:8080/idemgate\")"));
                None
            }
        });
        let secret = self.secret(&format!("{p}.secret"), None, e.secret_env.as_deref(), e.secret_file.as_deref());
        let timeout = self.duration(&format!("{p}.timeout"), e.timeout.as_deref(), "5s");
        let timeout = self.at_least(&format!("{p}.timeout"), timeout, Duration::from_millis(10));
        let max_attempts = match e.max_attempts.unwrap_or(20) {
            n @ 1..=1000 => Some(n as u32),
            n => {
                self.issues.push(format!("{p}.max_attempts"), format!("must be 1-1000, not {n}"));
                None
            }
        };
        let batch = match e.batch.unwrap_or(1) {
            n @ 1..=1000 => Some(n as usize),
            n => {
                self.issues.push(format!("{p}.batch"), format!("must be 1-1000 events per delivery, not {n}"));
                None
            }
        };
        let concurrency = match e.concurrency.unwrap_or(4) {
            n @ 1..=256 => Some(n as usize),
            n => {
                self.issues.push(format!("{p}.concurrency"), format!("must be 1-256 POSTs in flight, not {n}"));
                None
            }
        };
        let mut emit = Vec::new();
        match &e.emit {
            None => emit.extend(EventType::ALL),
            Some(list) => {
                for (k, name) in list.iter().enumerate() {
                    match EventType::parse(name) {
                        Some(t) if !emit.contains(&t) => emit.push(t),
                        Some(_) => {}
                        None => self.issues.push(
                            format!("{p}.emit[{k}]"),
                            format!("unknown event {name:?}: use \"completed\", \"unknown\", \"failed_retryable\" or \"released\""),
                        ),
                    }
                }
            }
        }
        Some(EventsConfig {
            url: url?,
            secret: secret?,
            timeout: timeout?,
            max_attempts: max_attempts?,
            emit,
            include_key: e.include_key.unwrap_or(false),
            include_body: e.include_body.unwrap_or(false),
            batch: batch?,
            concurrency: concurrency?,
        })
    }

    /// Checks that a PostgreSQL connection string parses and names a host, reporting
    /// at the key it came from. The string itself is never printed: it may hold a
    /// password.
    fn postgres_url(&mut self, s: &StoreSection, url: Secret) -> Option<Secret> {
        let (path, source) = match (&s.url_env, &s.url_file) {
            (Some(name), _) => ("store.url_env", format!("the value of environment variable {name}")),
            (None, Some(file)) => ("store.url_file", format!("the content of {file}")),
            (None, None) => ("store.url", "the URL".to_owned()),
        };
        match crate::tls::postgres::parse_with(url.expose(), self.env) {
            Ok(c) if c.config.get_hosts().is_empty() && c.config.get_hostaddrs().is_empty() => {
                self.issues.push(path, format!("{source} is a PostgreSQL connection string without a host"));
                None
            }
            Ok(c) => {
                self.database_warnings(path, s.url.is_some(), &c);
                Some(url)
            }
            Err(crate::tls::postgres::PgTlsError::Config(e)) => {
                // The cause ("unexpected EOF", "invalid value for option `port`", ...)
                // names no secret, except the offending character, which is cut off.
                let cause = std::error::Error::source(&e).map_or_else(|| e.to_string(), |c| c.to_string());
                let cause = cause.split(" but got").next().unwrap_or_default();
                self.issues.push(
                    path,
                    format!(
                        "{source} is not a valid PostgreSQL connection string ({cause}); write postgres://user@host:5432/dbname \
                         or key=value pairs"
                    ),
                );
                None
            }
            // The others name no value of the string but sslmode's, sslrootcert's and target_session_attrs' (never a secret).
            Err(e) => {
                self.issues.push(path, format!("{source}: {e}"));
                None
            }
        }
    }

    /// A password in the connection string: written in the file, or sent
    /// where TLS is off or can be stripped (never printed).
    fn database_warnings(&mut self, path: &str, inline: bool, c: &crate::tls::postgres::PgConnect) {
        use crate::tls::postgres::SslMode;
        if c.config.get_password().is_none() {
            return;
        }
        if inline {
            self.warnings.push(
                path,
                Hardening::Database,
                "the database password is written in the configuration file, readable by whoever reads the file; use url_env or url_file",
            );
        }
        let local = super::hardening::database_is_local(&c.config);
        match c.mode {
            SslMode::Disable => self.warnings.push(
                path,
                Hardening::Database,
                "the connection string holds a password and sslmode=disable: the login and every stored request and response cross the network unencrypted; use sslmode=verify-full",
            ),
            SslMode::Prefer if !local => self.warnings.push(
                path,
                Hardening::Database,
                "the connection string holds a password and no sslmode (prefer): TLS is tried, but anyone on the path to a non-local host can refuse it and read the traffic; use sslmode=verify-full",
            ),
            _ => {}
        }
    }

    fn admin(&mut self, a: &super::file::AdminSection) -> Option<AdminConfig> {
        let listen = self.addr("admin.listen", a.listen.as_deref(), None);
        let token = self.secret("admin.token", None, a.token_env.as_deref(), a.token_file.as_deref());
        if let Some(Some(t)) = &token {
            let path = if a.token_env.is_some() { "admin.token_env" } else { "admin.token_file" };
            self.warnings.short_secret(path, "admin token", t.expose().len(), "whoever guesses it can release or rewrite any record");
        }
        let tls = match &a.tls {
            Some(t) => self.listener_tls("admin.tls", t, &[b"http/1.1"]).map(Some),
            None => Some(None),
        };
        if let (Some(addr), Some(Some(_)), None) = (listen, &token, &a.tls)
            && !addr.ip().is_loopback()
        {
            self.warnings.push(
                "admin.listen",
                Hardening::Secrets,
                format!(
                    "the admin API listens on {addr} without [admin.tls]: its token and every record it shows cross the network in clear; add [admin.tls] or listen on a loopback address"
                ),
            );
        }
        let token_label = match a.token_label.as_deref() {
            Some(l) if l.is_empty() || l.len() > 64 || !l.bytes().all(|b| b.is_ascii_graphic()) => {
                self.issues.push("admin.token_label", "must be 1-64 visible ASCII characters (letters, digits, punctuation; no spaces)");
                None
            }
            other => Some(other.map(str::to_owned)),
        };
        let masked_query_params = a.masked_query_params.clone().unwrap_or_default();
        Some(AdminConfig { listen: listen?, token: token?, tls: tls?, token_label: token_label?, masked_query_params })
    }

    /// `[server.tls]` / `[admin.tls]`: the files are read now, so a missing
    /// or mismatched certificate is a configuration error naming its key.
    fn listener_tls(&mut self, p: &str, t: &TlsSection, alpn: &[&[u8]]) -> Option<ListenerTls> {
        let cert_file = self.required(&format!("{p}.cert_file"), t.cert_file.as_deref());
        let key_file = self.required(&format!("{p}.key_file"), t.key_file.as_deref());
        let handshake_timeout = self.duration(&format!("{p}.handshake_timeout"), t.handshake_timeout.as_deref(), "10s");
        let handshake_timeout = self.at_least(&format!("{p}.handshake_timeout"), handshake_timeout, Duration::from_millis(10));
        let client_auth = match (t.client_ca_file.is_some(), t.client_auth.as_deref()) {
            (false, None) => Some(ClientAuth::Off),
            (false, Some(_)) => {
                self.issues.push(format!("{p}.client_auth"), "needs client_ca_file (the CA that signs client certificates)");
                None
            }
            (true, None | Some("required")) => Some(ClientAuth::Required),
            (true, Some("optional")) => Some(ClientAuth::Optional),
            (true, Some(other)) => {
                self.issues.push(format!("{p}.client_auth"), format!("unknown value {other:?}: use \"required\" or \"optional\""));
                None
            }
        };
        let settings = ListenerTls {
            cert_file: cert_file?.into(),
            key_file: key_file?.into(),
            client_ca_file: t.client_ca_file.as_deref().map(PathBuf::from),
            client_auth: client_auth?,
            handshake_timeout: handshake_timeout?,
        };
        match crate::tls::server::build(&settings, alpn) {
            Ok(_) => Some(settings),
            Err(e) => {
                self.issues.push(format!("{p}.{}", e.key), e.to_string());
                None
            }
        }
    }

    fn upstreams(&mut self, list: &[Part<UpstreamSection>]) -> Vec<Upstream> {
        let mut seen = HashSet::new();
        list.iter()
            .enumerate()
            .map(|(i, u)| {
                let u = match u {
                    Part::Ok(u) => u,
                    Part::Broken(keys) => return Upstream { name: keys.name.clone().unwrap_or_default(), config: None },
                };
                let p = format!("upstreams[{i}]");
                let name = self.required(&format!("{p}.name"), u.name.as_deref()).map(str::to_owned);
                if let Some(n) = &name
                    && !seen.insert(n.clone())
                {
                    self.issues.push(format!("{p}.name"), format!("another upstream is already named {n:?}"));
                }
                let url = self.required(&format!("{p}.url"), u.url.as_deref()).and_then(|s| self.upstream_url(&format!("{p}.url"), s));
                let timeout = self.duration(&format!("{p}.timeout"), u.timeout.as_deref(), "10s");
                let timeout = self.at_least(&format!("{p}.timeout"), timeout, Duration::from_millis(1));
                let connect_timeout = self.connect_timeout(&p, u.connect_timeout.as_deref(), timeout);
                let pool_idle_timeout = self.duration(&format!("{p}.pool_idle_timeout"), u.pool_idle_timeout.as_deref(), "1s");
                let pool_max_idle = match u.pool_max_idle.unwrap_or(256) {
                    n @ 0..=65_536 => Some(n as usize),
                    n => {
                        self.issues.push(format!("{p}.pool_max_idle"), format!("must be between 0 and 65536, not {n}"));
                        None
                    }
                };
                let tls = self.upstream_tls(&p, u, url.as_ref());
                let limit = self.upstream_limit(&p, u, timeout);
                let config = (|| {
                    Some(UpstreamConfig {
                        name: name.clone()?,
                        url: url?,
                        tls: tls?,
                        connect_timeout: connect_timeout?,
                        timeout: timeout?,
                        pool_idle_timeout: pool_idle_timeout?,
                        pool_max_idle: pool_max_idle?,
                        limit: limit?,
                    })
                })();
                Upstream { name: name.unwrap_or_default(), config }
            })
            .collect()
    }

    /// `max_in_flight`, `adaptive` and `queue_timeout`: how the upstream's
    /// concurrency limit is set (see [`LimitPolicy`]). The wait for a slot
    /// must end well before the upstream's timeout.
    fn upstream_limit(&mut self, p: &str, u: &UpstreamSection, timeout: Option<Duration>) -> Option<LimitPolicy> {
        let max_in_flight = match u.max_in_flight {
            None => Some(None),
            Some(n @ 1..=100_000) => Some(Some(n as u32)),
            Some(n) => {
                self.issues.push(format!("{p}.max_in_flight"), format!("must be between 1 and 100000, not {n}"));
                None
            }
        };
        let path = format!("{p}.queue_timeout");
        let queue_timeout = match u.queue_timeout.as_deref() {
            None => timeout.map(|t| limit::DEFAULT_QUEUE_TIMEOUT.min(t / 4)),
            Some(value) => {
                let wait = self.duration(&path, Some(value), "");
                if let (Some(w), Some(t)) = (wait, timeout)
                    && w > t / 2
                {
                    self.issues.push(
                        path,
                        format!(
                            "must be at most half of {p}.timeout ({}): a request waiting for a slot holds its client",
                            humantime::format_duration(t)
                        ),
                    );
                    return None;
                }
                wait
            }
        };
        let (max_in_flight, queue_timeout, timeout) = (max_in_flight?, queue_timeout?, timeout?);
        Some(match (u.adaptive, max_in_flight) {
            (Some(false), None) => LimitPolicy::Unlimited,
            (None | Some(false), Some(max_in_flight)) => LimitPolicy::Fixed { max_in_flight, queue_timeout },
            (None | Some(true), None) => {
                LimitPolicy::Adaptive { initial: limit::DEFAULT_INITIAL, ceiling: limit::DEFAULT_CEILING, queue_timeout, timeout }
            }
            (Some(true), Some(ceiling)) => {
                LimitPolicy::Adaptive { initial: limit::DEFAULT_INITIAL.min(ceiling), ceiling, queue_timeout, timeout }
            }
        })
    }

    /// An https URL of a service without TLS settings of its own (webhook,
    /// JWKS, authorizer): it is verified against the system roots, which
    /// must exist.
    fn system_roots(&mut self, path: &str, uri: http::Uri) -> Option<http::Uri> {
        if crate::tls::client::system_default().is_some() {
            return Some(uri);
        }
        let why = crate::tls::system_roots(crate::tls::remedy::SSL_CERT_FILE).err().map(|e| e.to_string()).unwrap_or_default();
        self.issues.push(path, why);
        None
    }

    /// An https upstream's client configuration: `ca_file` (else the system
    /// roots) and an optional client certificate, read now so a bad file is a
    /// configuration error. `Some(None)`: a plain http upstream.
    fn upstream_tls(&mut self, p: &str, u: &UpstreamSection, url: Option<&http::Uri>) -> Option<Option<Arc<rustls::ClientConfig>>> {
        let settings = ClientTls {
            ca_file: u.ca_file.as_deref().map(PathBuf::from),
            cert_file: u.client_cert_file.as_deref().map(PathBuf::from),
            key_file: u.client_key_file.as_deref().map(PathBuf::from),
        };
        if settings.cert_file.is_some() != settings.key_file.is_some() {
            let missing = if settings.cert_file.is_none() { "client_cert_file" } else { "client_key_file" };
            self.issues.push(format!("{p}.{missing}"), "client_cert_file and client_key_file go together");
            return None;
        }
        let https = url.is_some_and(|u| u.scheme_str() == Some("https"));
        if !https {
            if url.is_some() && settings != ClientTls::default() {
                self.issues.push(format!("{p}.url"), "ca_file and client certificates need an https:// URL");
                return None;
            }
            return Some(None);
        }
        match crate::tls::client::build(&settings) {
            Ok(config) => Some(Some(config)),
            Err(e) => {
                self.issues.push(format!("{p}.{}", e.key), e.to_string());
                None
            }
        }
    }

    /// The connect phase (name resolution and TCP connect) must end before the
    /// exchange's `timeout`: a connect still running when the exchange times
    /// out could not be told from a request that was sent, and would be
    /// recorded `unknown` although nothing left. Default: 1s, or half the
    /// timeout when that is shorter.
    fn connect_timeout(&mut self, p: &str, value: Option<&str>, timeout: Option<Duration>) -> Option<Duration> {
        let path = format!("{p}.connect_timeout");
        let Some(value) = value else {
            return timeout.map(|t| DEFAULT_CONNECT_TIMEOUT.min(t / 2));
        };
        let connect = self.duration(&path, Some(value), "");
        let connect = self.at_least(&path, connect, Duration::from_millis(1));
        if let (Some(c), Some(t)) = (connect, timeout)
            && c >= t
        {
            self.issues.push(
                path,
                format!(
                    "must be shorter than {p}.timeout ({}): a connect still running when the exchange times out could not be told \
                     from a request that was sent",
                    humantime::format_duration(t)
                ),
            );
            return None;
        }
        connect
    }

    fn upstream_url(&mut self, path: &str, s: &str) -> Option<http::Uri> {
        let uri: http::Uri = match s.parse() {
            Ok(u) => u,
            Err(e) => {
                self.issues.push(path, format!("invalid URL {s:?}: {e}"));
                return None;
            }
        };
        match uri.scheme_str() {
            Some("http" | "https") => {}
            _ => {
                self.issues.push(path, format!("URL {s:?} must start with http:// or https://"));
                return None;
            }
        }
        if uri.authority().is_none() {
            self.issues.push(path, format!("URL {s:?} has no host"));
            return None;
        }
        if uri.query().is_some() {
            self.issues.push(path, "must not have a query string");
            return None;
        }
        Some(uri)
    }

    fn identity_source(&mut self, i: usize, s: &IdentitySourceSection) -> Option<IdentitySource> {
        let p = format!("identity.sources[{i}]");
        match s.kind.as_deref() {
            Some("api_key") => {
                for (field, set) in [
                    ("tenant_header", s.tenant_header.is_some()),
                    ("principal_header", s.principal_header.is_some()),
                    ("trusted_peers", s.trusted_peers.is_some()),
                ] {
                    if set {
                        self.issues.push(format!("{p}.{field}"), "only for kind = \"trusted_header\"");
                    }
                }
                let header = self.header_name(&format!("{p}.header"), s.header.as_deref(), "authorization");
                let mut keys = HashMap::new();
                let list = s.keys.as_deref().unwrap_or_default();
                if list.is_empty() {
                    self.issues
                        .push(format!("{p}.keys"), "list at least one key: { sha256 = \"<hex>\", tenant = \"..\", principal = \"..\" }");
                }
                for (k, entry) in list.iter().enumerate() {
                    let kp = format!("{p}.keys[{k}]");
                    let (hex_path, hex) = match (entry.sha256.as_deref(), entry.sha256_env.as_deref()) {
                        (Some(_), Some(_)) => {
                            self.issues.push(format!("{kp}.sha256_env"), "give sha256 or sha256_env, not both");
                            (String::new(), None)
                        }
                        (None, Some(name)) => match (self.env)(name).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty()) {
                            Some(v) => (format!("{kp}.sha256_env"), Some(std::borrow::Cow::Owned(v))),
                            None => {
                                self.issues.push(
                                    format!("{kp}.sha256_env"),
                                    format!(
                                        "environment variable {name} is not set: give it the SHA-256 of a client API key of your own \
                                         (printf %s \"$KEY\" | sha256sum)"
                                    ),
                                );
                                (String::new(), None)
                            }
                        },
                        (given, None) => {
                            (format!("{kp}.sha256"), self.required(&format!("{kp}.sha256"), given).map(std::borrow::Cow::Borrowed))
                        }
                    };
                    let digest = hex.and_then(|h| {
                        let mut out = [0u8; 32];
                        match hex::decode_to_slice(h.trim(), &mut out) {
                            Ok(()) => Some(out),
                            Err(_) => {
                                self.issues.push(
                                    hex_path.clone(),
                                    "must be 64 hex digits (the SHA-256 of the key, e.g. `printf %s KEY | sha256sum`)",
                                );
                                None
                            }
                        }
                    });
                    if let Some(d) = &digest {
                        self.warnings.published_key(&hex_path, d);
                    }
                    let tenant = self.scope_part(&format!("{kp}.tenant"), entry.tenant.as_deref());
                    let principal = self.scope_part(&format!("{kp}.principal"), entry.principal.as_deref());
                    if let (Some(d), Some(t), Some(pr)) = (digest, tenant, principal)
                        && keys.insert(d, Identity { tenant: t.into(), principal: pr.into() }).is_some()
                    {
                        self.issues.push(hex_path, "the same key is listed twice");
                    }
                }
                Some(IdentitySource::ApiKey { header: header?, keys })
            }
            Some("jwt") => self.jwt_source(&p, s),
            Some("mtls") => self.mtls_source(&p, s),
            Some("trusted_header") => {
                for (field, set) in [("header", s.header.is_some()), ("keys", s.keys.is_some())] {
                    if set {
                        self.issues.push(format!("{p}.{field}"), "only for kind = \"api_key\"");
                    }
                }
                let tenant_header = self
                    .required(&format!("{p}.tenant_header"), s.tenant_header.as_deref())
                    .and_then(|h| self.header_name(&format!("{p}.tenant_header"), Some(h), ""));
                let principal_header = self
                    .required(&format!("{p}.principal_header"), s.principal_header.as_deref())
                    .and_then(|h| self.header_name(&format!("{p}.principal_header"), Some(h), ""));
                let peers = s.trusted_peers.as_deref().unwrap_or_default();
                if peers.is_empty() {
                    self.issues.push(format!("{p}.trusted_peers"), "list the peers (CIDRs) allowed to assert identity headers");
                }
                let trusted_peers = self.cidrs(&format!("{p}.trusted_peers"), peers).unwrap_or_default();
                let asserted = format!(
                    "{} / {}",
                    s.tenant_header.as_deref().unwrap_or("the tenant header"),
                    s.principal_header.as_deref().unwrap_or("the principal header")
                );
                self.warnings.trusted_peers(&format!("{p}.trusted_peers"), &trusted_peers, &asserted);
                Some(IdentitySource::TrustedHeader { tenant_header: tenant_header?, principal_header: principal_header?, trusted_peers })
            }
            Some(other) => {
                self.issues.push(
                    format!("{p}.kind"),
                    format!("unknown identity source {other:?}: use \"api_key\", \"trusted_header\", \"jwt\" or \"mtls\""),
                );
                None
            }
            None => {
                self.issues.push(format!("{p}.kind"), "required: \"api_key\", \"trusted_header\", \"jwt\" or \"mtls\"");
                None
            }
        }
    }

    /// `kind = "jwt"`: where the keys come from, what is checked, which claims name the scope.
    fn jwt_source(&mut self, p: &str, s: &IdentitySourceSection) -> Option<IdentitySource> {
        for (field, set) in [
            ("keys", s.keys.is_some()),
            ("tenant_header", s.tenant_header.is_some()),
            ("principal_header", s.principal_header.is_some()),
            ("trusted_peers", s.trusted_peers.is_some()),
        ] {
            if set {
                self.issues.push(format!("{p}.{field}"), "not a setting of kind = \"jwt\"");
            }
        }
        let header = self.header_name(&format!("{p}.header"), s.header.as_deref(), "authorization");
        let mut algorithms = Vec::new();
        for (k, a) in s.algorithms.as_deref().unwrap_or(&["RS256".to_owned(), "ES256".to_owned(), "EdDSA".to_owned()]).iter().enumerate() {
            match crate::request::identity::jwt::parse_algorithm(a) {
                Some(alg) => algorithms.push(alg),
                None => {
                    self.issues.push(format!("{p}.algorithms[{k}]"), format!("unknown algorithm {a:?}: use RS256, ES256, EdDSA or HS256"))
                }
            }
        }
        let hs256 = algorithms.contains(&jsonwebtoken::Algorithm::HS256);
        let secret = self.secret(&format!("{p}.secret"), None, s.secret_env.as_deref(), s.secret_file.as_deref());
        if hs256 && matches!(secret, Some(None)) {
            self.issues.push(format!("{p}.secret_env"), "HS256 needs secret_env or secret_file");
        }
        if !hs256 && matches!(secret, Some(Some(_))) {
            self.issues.push(format!("{p}.secret_env"), "a secret is only used by HS256: add it to algorithms");
        }
        if let (true, Some(Some(secret))) = (hs256, &secret) {
            let path = if s.secret_env.is_some() { format!("{p}.secret_env") } else { format!("{p}.secret_file") };
            self.warnings.short_secret(&path, "HS256 secret", secret.expose().len(), "whoever guesses it can sign tokens for any tenant");
        }
        if s.issuer.is_none() {
            self.warnings.push(
                format!("{p}.issuer"),
                Hardening::Jwt,
                "no issuer is checked: a token from any issuer whose key verifies is accepted",
            );
        }
        if s.audience.is_none() {
            self.warnings.push(
                format!("{p}.audience"),
                Hardening::Jwt,
                "no audience is checked: a token the issuer made for another service is accepted here",
            );
        }
        let asymmetric = algorithms.iter().any(|a| *a != jsonwebtoken::Algorithm::HS256);
        let keys = match (s.jwks_file.as_deref(), s.jwks_url.as_deref()) {
            (Some(_), Some(_)) => {
                self.issues.push(format!("{p}.jwks_url"), "give jwks_file or jwks_url, not both");
                None
            }
            (Some(f), None) => Some(crate::request::identity::jwt::JwksSource::File(PathBuf::from(f))),
            (None, Some(u)) => match u.parse::<http::Uri>() {
                Ok(uri) if uri.scheme_str() == Some("http") && uri.authority().is_some() => {
                    self.warnings.push(
                        format!("{p}.jwks_url"),
                        Hardening::Jwt,
                        "the keys are fetched over plain http://: whoever can alter them in transit can sign tokens for any tenant; use https://",
                    );
                    Some(crate::request::identity::jwt::JwksSource::Url(uri))
                }
                Ok(uri) if uri.scheme_str() == Some("https") && uri.authority().is_some() => {
                    self.system_roots(&format!("{p}.jwks_url"), uri).map(crate::request::identity::jwt::JwksSource::Url)
                }
                _ => {
                    self.issues.push(format!("{p}.jwks_url"), format!("invalid URL {u:?}"));
                    None
                }
            },
            (None, None) if asymmetric => {
                self.issues.push(format!("{p}.jwks_file"), "RS256, ES256 and EdDSA need jwks_file or jwks_url");
                None
            }
            (None, None) => Some(crate::request::identity::jwt::JwksSource::None),
        };
        let refresh = self.duration(&format!("{p}.jwks_refresh"), s.jwks_refresh.as_deref(), "5m");
        let refresh = self.at_least(&format!("{p}.jwks_refresh"), refresh, Duration::from_secs(1));
        let leeway = self.duration(&format!("{p}.leeway"), s.leeway.as_deref(), "30s");
        if let Some(l) = leeway.filter(|l| *l > super::hardening::MAX_JWT_LEEWAY) {
            self.warnings.push(
                format!("{p}.leeway"),
                Hardening::Jwt,
                format!(
                    "a leeway of {} keeps a token valid that long after it expired (and before it is valid): a stolen or revoked token stays usable; keep it to a few seconds, at most 5m",
                    humantime::format_duration(l)
                ),
            );
        }
        let claim = |c: Option<&str>, default: &str| -> String {
            let c = c.unwrap_or(default);
            if c.starts_with('/') { c.to_owned() } else { format!("/{c}") }
        };
        let tenant_claim = claim(s.tenant_claim.as_deref(), "tenant");
        let principal_claim = claim(s.principal_claim.as_deref(), "sub");
        let config = crate::request::identity::jwt::JwtConfig {
            header: header?,
            keys: keys?,
            refresh: refresh?,
            issuer: s.issuer.as_ref().map(|i| i.to_vec()),
            audience: s.audience.as_ref().map(|a| a.to_vec()),
            algorithms,
            secret: secret?,
            tenant_claim,
            principal_claim,
            leeway: leeway?,
        };
        match crate::request::identity::jwt::JwtVerifier::new(config) {
            Ok(v) => Some(IdentitySource::Jwt(std::sync::Arc::new(v))),
            Err(e) => {
                self.issues.push(format!("{p}.jwks_file"), e);
                None
            }
        }
    }

    /// `kind = "mtls"`: tenant and principal from the verified client certificate.
    fn mtls_source(&mut self, p: &str, s: &IdentitySourceSection) -> Option<IdentitySource> {
        use crate::request::identity::mtls::{CertField, CertRule, MtlsSource};
        if !self.client_certificates {
            self.issues
                .push(format!("{p}.kind"), "kind = \"mtls\" needs client certificates: set server.tls.client_ca_file (and client_auth)");
        }
        for (field, set) in [
            ("header", s.header.is_some()),
            ("keys", s.keys.is_some()),
            ("tenant_header", s.tenant_header.is_some()),
            ("principal_header", s.principal_header.is_some()),
            ("trusted_peers", s.trusted_peers.is_some()),
            ("jwks_file", s.jwks_file.is_some()),
            ("jwks_url", s.jwks_url.is_some()),
        ] {
            if set {
                self.issues.push(format!("{p}.{field}"), "not used by kind = \"mtls\"");
            }
        }
        let mut rule = |from: &str, value: Option<&str>, regex_key: &str, regex: Option<&str>| -> Option<CertRule> {
            let field = match self.required(&format!("{p}.{from}"), value).map(|v| (v, CertField::parse(v))) {
                Some((_, Some(f))) => Some(f),
                Some((v, None)) => {
                    self.issues.push(format!("{p}.{from}"), format!("unknown field {v:?}: use \"san_uri\", \"san_dns\" or \"subject_cn\""));
                    None
                }
                None => None,
            };
            let pattern = match regex.map(|r| (r, regex::Regex::new(r))) {
                None => Some(None),
                Some((source, Ok(re))) => {
                    if super::hardening::unanchored(source, re.captures_len() > 1) {
                        self.warnings.push(
                            format!("{p}.{regex_key}"),
                            Hardening::ClientCertificates,
                            "the pattern is not anchored (^ at its start, and $ at its end when it has no capture group): it matches inside a longer certificate field, so a certificate whose field merely contains the expected text is taken for one that is it",
                        );
                    }
                    Some(Some(re))
                }
                Some((_, Err(e))) => {
                    self.issues.push(format!("{p}.{regex_key}"), format!("invalid regular expression: {e}"));
                    None
                }
            };
            Some(CertRule { field: field?, pattern: pattern? })
        };
        let tenant = rule("tenant_from", s.tenant_from.as_deref(), "tenant_regex", s.tenant_regex.as_deref());
        let principal = rule("principal_from", s.principal_from.as_deref(), "principal_regex", s.principal_regex.as_deref());
        Some(IdentitySource::Mtls(MtlsSource { tenant: tenant?, principal: principal? }))
    }

    fn scope_part<'a>(&mut self, path: &str, value: Option<&'a str>) -> Option<&'a str> {
        let v = self.required(path, value)?;
        if v.len() > 255 || v.chars().any(char::is_control) {
            self.issues.push(path, "must be at most 255 bytes without control characters");
            return None;
        }
        Some(v)
    }

    fn route(&mut self, i: usize, r: &RouteSection, names: &HashMap<&str, usize>, upstreams: &[Upstream]) -> Option<Route> {
        let p = format!("routes[{i}]");
        let operation = self.scope_part(&format!("{p}.operation"), r.operation.as_deref());
        let method = self.required(&format!("{p}.method"), r.method.as_deref()).and_then(|m| {
            match Method::from_bytes(m.to_ascii_uppercase().as_bytes()) {
                Ok(method) => Some(method),
                Err(_) => {
                    self.issues.push(format!("{p}.method"), format!("invalid method {m:?}"));
                    None
                }
            }
        });
        let path = self.required(&format!("{p}.path"), r.path.as_deref()).and_then(|s| match PathTemplate::parse(s) {
            Ok(t) => Some(t),
            Err(e) => {
                self.issues.push(format!("{p}.path"), format!("invalid path {s:?}: {e}"));
                None
            }
        });
        let upstream = self.required(&format!("{p}.upstream"), r.upstream.as_deref()).and_then(|n| match names.get(n) {
            Some(&id) => Some(id),
            None => {
                self.issues.push(format!("{p}.upstream"), format!("no [[upstreams]] entry is named {n:?}"));
                None
            }
        });
        let mode = match r.mode.as_deref() {
            None | Some("sync") => Some(ModeName::Sync),
            Some("async") => Some(ModeName::Async),
            Some("observe") => Some(ModeName::Observe),
            Some(other) => {
                self.issues.push(format!("{p}.mode"), format!("unknown mode {other:?}: use \"sync\", \"async\" or \"observe\""));
                None
            }
        };
        if mode == Some(ModeName::Observe) && r.allow_async == Some(true) {
            self.issues.push(format!("{p}.allow_async"), "not with mode = \"observe\": observed requests always pass through");
        }
        let observe_budget = self.duration(&format!("{p}.observe_budget"), r.observe_budget.as_deref(), "50ms");
        let observe_budget = self.at_least(&format!("{p}.observe_budget"), observe_budget, Duration::from_millis(1));
        if mode != Some(ModeName::Observe) && r.observe_budget.is_some() {
            self.issues.push(format!("{p}.observe_budget"), "applies to mode = \"observe\" only");
        }
        let is_async = mode == Some(ModeName::Async) || r.allow_async == Some(true);
        if mode == Some(ModeName::Async) && r.allow_async.is_some() {
            self.issues.push(format!("{p}.allow_async"), "only for sync routes (mode = \"async\" is always async)");
        }
        let poll_interval = self.duration(&format!("{p}.poll_interval"), r.poll_interval.as_deref(), "1s");
        let poll_interval = self.at_least(&format!("{p}.poll_interval"), poll_interval, Duration::from_secs(1));
        let max_attempts = match r.retry.max_attempts.unwrap_or(5) {
            n @ 1..=100 => Some(n as u32),
            n => {
                self.issues.push(format!("{p}.retry.max_attempts"), format!("must be 1-100, not {n}"));
                None
            }
        };
        let backoff = self.duration(&format!("{p}.retry.backoff"), r.retry.backoff.as_deref(), "1s");
        let backoff = self.at_least(&format!("{p}.retry.backoff"), backoff, Duration::from_millis(10));
        if !is_async && (r.poll_interval.is_some() || r.retry.max_attempts.is_some() || r.retry.backoff.is_some()) {
            self.issues
                .push(format!("{p}.mode"), "poll_interval and retry apply to async routes: set mode = \"async\" or allow_async = true");
        }
        let key_header = self.header_name(&format!("{p}.key_header"), r.key_header.as_deref(), "idempotency-key");
        let key_from = match (&r.key_from, &key_header) {
            (None, Some(header)) => Some(KeySources::header(header.clone())),
            (None, None) => None,
            (Some(list), _) => self.key_from(&p, list, r.key_header.is_some()),
        };
        // The header `forward_key = "client"` forwards: the route's one header source.
        let key_header = match &key_from {
            Some(sources) if r.key_from.is_some() => sources.single_header().cloned().or(key_header),
            _ => key_header,
        };
        if r.forward_key.as_deref() == Some("client") && key_from.as_ref().is_some_and(|k| k.single_header().is_none()) {
            self.issues.push(
                format!("{p}.forward_key"),
                "\"client\" forwards the client's key header as it is: it needs key_from to be a single header source",
            );
        }
        let retention = match r.retention.as_deref() {
            Some("forever") => Some(Retention::Forever),
            other => {
                let retention = self.duration(&format!("{p}.retention"), other, "24h");
                self.at_least(&format!("{p}.retention"), retention, Duration::from_secs(1)).map(Retention::For)
            }
        };
        let wait = self.duration(&format!("{p}.in_flight_wait"), r.in_flight_wait.as_deref(), "5s");
        let in_flight = match r.in_flight.as_deref().unwrap_or("reject") {
            "reject" => Some(InFlightPolicy::Reject),
            "wait" => wait.map(InFlightPolicy::Wait),
            other => {
                self.issues.push(format!("{p}.in_flight"), format!("unknown policy {other:?}: use \"reject\" or \"wait\""));
                None
            }
        };
        let mut release_on_status = Vec::new();
        for (k, code) in r.release_on_status.as_deref().unwrap_or_default().iter().enumerate() {
            match u16::try_from(*code).ok().and_then(|c| StatusCode::from_u16(c).ok()) {
                Some(s) if s.as_u16() >= 200 => release_on_status.push(s),
                _ => self.issues.push(format!("{p}.release_on_status[{k}]"), format!("{code} is not a final HTTP status (200-999)")),
            }
        }
        let max_stored_response = match &r.max_stored_response {
            Some(SizeValue::Bytes(n)) => match u64::try_from(*n) {
                Ok(n) => Some(n),
                Err(_) => {
                    self.issues.push(format!("{p}.max_stored_response"), format!("must not be negative, not {n}"));
                    None
                }
            },
            Some(SizeValue::Text(text)) => self.size(&format!("{p}.max_stored_response"), Some(text), "1MiB"),
            None => self.size(&format!("{p}.max_stored_response"), None, "1MiB"),
        };
        let upstream_timeout = upstream.and_then(|u| upstreams.get(u)).and_then(|u| u.config.as_ref()).map(|c| c.timeout);
        let lease = match (r.lease.as_deref(), upstream_timeout) {
            (Some(l), timeout) => {
                let lease = self.duration(&format!("{p}.lease"), Some(l), "");
                // Async attempts renew their lease by heartbeats (every third of
                // it), so there it may be shorter than the upstream's timeout;
                // a request that is also served synchronously needs the lease to
                // outlast the whole exchange.
                if mode == Some(ModeName::Async) {
                    if lease.is_some_and(|l| l < Duration::from_millis(300)) {
                        self.issues.push(format!("{p}.lease"), "must be at least 300ms (heartbeats renew it every third)");
                    }
                } else if let (Some(lease), Some(timeout)) = (lease, timeout)
                    && lease < timeout + LEASE_WRITE_ROOM
                {
                    self.issues.push(
                        format!("{p}.lease"),
                        format!(
                            "must be at least the upstream's timeout ({}) plus {} for the claim and the result write \
                             (at least {}), or a request still running would be refused or declared unknown",
                            humantime::format_duration(timeout),
                            humantime::format_duration(LEASE_WRITE_ROOM),
                            humantime::format_duration(timeout + LEASE_WRITE_ROOM)
                        ),
                    );
                }
                lease
            }
            (None, Some(timeout)) => Some(timeout + LEASE_MARGIN),
            (None, None) => None,
        };
        let mismatch_status = match r.mismatch_status.unwrap_or(409) {
            409 => Some(StatusCode::CONFLICT),
            422 => Some(StatusCode::UNPROCESSABLE_ENTITY),
            n => {
                self.issues.push(format!("{p}.mismatch_status"), format!("must be 409 or 422, not {n}"));
                None
            }
        };
        let forward_key = match r.forward_key.as_deref().unwrap_or("derived") {
            "derived" => Some(ForwardKey::Derived),
            "client" => {
                self.warnings.push(
                    format!("{p}.forward_key"),
                    Hardening::KeysUpstream,
                    "the upstream gets each client's own key: two tenants or principals that pick the same key are one request to an upstream that deduplicates by key (one is answered the other's result); keep the derived key unless the upstream scopes keys itself",
                );
                Some(ForwardKey::Client)
            }
            other => {
                self.issues.push(format!("{p}.forward_key"), format!("unknown value {other:?}: use \"derived\" or \"client\""));
                None
            }
        };
        let fingerprint = self.fingerprint(&p, &r.fingerprint);
        let max_in_flight = match r.max_in_flight {
            None => Some(None),
            Some(n @ 1..=100_000) => Some(Some(n as u32)),
            Some(n) => {
                self.issues.push(format!("{p}.max_in_flight"), format!("must be between 1 and 100000, not {n}"));
                None
            }
        };
        if r.max_queued.is_some() && !is_async {
            self.issues.push(format!("{p}.max_queued"), "applies to async routes: set mode = \"async\" or allow_async = true");
        }
        let max_queued = match r.max_queued.unwrap_or(DEFAULT_MAX_QUEUED) {
            n @ 1..=100_000_000 => Some(n as u64),
            n => {
                self.issues.push(format!("{p}.max_queued"), format!("must be between 1 and 100000000, not {n}"));
                None
            }
        };
        let reconcile = match &r.reconcile {
            None => Some(None),
            Some(section) => self.probe(&p, section, path.as_ref(), forward_key).map(|probe| Some(std::sync::Arc::new(probe))),
        };
        let queueing = || -> Option<Queueing> {
            Some(Queueing {
                poll_interval: poll_interval?,
                retry: RetryPolicy { max_attempts: max_attempts?, backoff: backoff? },
                max_queued: max_queued?,
            })
        };
        let mode = match mode? {
            ModeName::Sync if r.allow_async == Some(true) => Mode::Sync { respond_async: Some(queueing()?) },
            ModeName::Sync => Mode::Sync { respond_async: None },
            ModeName::Async => Mode::Async(queueing()?),
            ModeName::Observe => Mode::Observe { budget: observe_budget? },
        };
        Some(Route {
            index: i,
            operation: operation?.into(),
            method: method?,
            path: path?,
            upstream: upstream?,
            key: KeyPolicy {
                header: key_header?,
                from: key_from?,
                required: r.key_required.unwrap_or(true),
                scope: match r.scope.as_deref().unwrap_or("principal") {
                    "principal" => ScopeMode::Principal,
                    "tenant" => ScopeMode::Tenant,
                    other => {
                        self.issues.push(format!("{p}.scope"), format!("unknown scope {other:?}: use \"principal\" or \"tenant\""));
                        return None;
                    }
                },
                forward: forward_key?,
                fingerprint_digest: fingerprint.as_ref().map(|f| f.digest().into())?,
                fingerprint: fingerprint?,
                mismatch_status: mismatch_status?,
            },
            record: RecordPolicy {
                retention: retention?,
                lease: lease?,
                in_flight: in_flight?,
                release_on_status,
                max_stored_response: max_stored_response?,
                replay: match r.replay.as_deref().unwrap_or("stored") {
                    "stored" => ReplayMode::Stored,
                    "refetch" => ReplayMode::Refetch,
                    other => {
                        self.issues.push(format!("{p}.replay"), format!("unknown replay {other:?}: use \"stored\" or \"refetch\""));
                        return None;
                    }
                },
            },
            execution: Execution {
                mode,
                authorize: match &r.authorize {
                    None => None,
                    Some(a) => Some(self.authorize(&format!("{p}.authorize"), a)?),
                },
                max_in_flight: max_in_flight?,
                upstream_idempotent: r.upstream_idempotent.unwrap_or(false),
            },
            background: BackgroundPolicy {
                events: match &r.events {
                    None => None,
                    Some(e) => Some(self.events(&format!("{p}.events"), e)?),
                },
                reconcile: reconcile?,
            },
        })
    }

    /// `key_from`: one source or a list, each `"header:<name>"` or `"body:<JSON Pointer>"`.
    fn key_from(&mut self, p: &str, list: &OneOrMany, key_header_set: bool) -> Option<KeySources> {
        let path = format!("{p}.key_from");
        if key_header_set {
            self.issues.push(
                format!("{p}.key_header"),
                "set key_from or key_header, not both (key_from = \"header:<name>\" names the key header)",
            );
        }
        let items = list.items();
        if items.is_empty() {
            self.issues.push(&path, "list at least one source: \"header:<name>\" or \"body:<JSON Pointer>\"");
            return None;
        }
        let mut sources = Vec::new();
        let mut ok = true;
        for (k, item) in items.iter().enumerate() {
            let at = match list {
                OneOrMany::One(_) => path.clone(),
                OneOrMany::Many(_) => format!("{path}[{k}]"),
            };
            match KeySource::parse(item) {
                Ok(source) if sources.contains(&source) => {
                    ok = false;
                    self.issues.push(at, format!("{item:?} is listed twice"));
                }
                Ok(source) => sources.push(source),
                Err(e) => {
                    ok = false;
                    self.issues.push(at, e.to_string());
                }
            }
        }
        if ok { KeySources::new(sources) } else { None }
    }

    /// `[routes.reconcile]`. `path` is `None` when the route's path is
    /// invalid (already reported): its parameters are unknown.
    fn probe(&mut self, p: &str, r: &ReconcileSection, path: Option<&PathTemplate>, forward_key: Option<ForwardKey>) -> Option<Probe> {
        let p = format!("{p}.reconcile");
        let params: Vec<&str> = path?.param_names().collect();
        let target = self.required(&format!("{p}.probe"), r.probe.as_deref()).and_then(|s| match ProbeTarget::parse_probe(s, &params) {
            Ok(t) => Some(t),
            Err(e) => {
                self.issues.push(format!("{p}.probe"), e);
                None
            }
        });
        if let Some((_, t)) = &target
            && t.uses_derived_key()
            && forward_key == Some(ForwardKey::Client)
        {
            self.issues.push(
                format!("{p}.probe"),
                "this route forwards the client's own key (forward_key = \"client\"): the upstream never saw {derived_key}; use {key} with {tenant} and {principal}",
            );
        }
        let found = self.statuses(&format!("{p}.found"), r.found.as_deref(), &[200]);
        if found.as_ref().is_some_and(Vec::is_empty) {
            self.issues.push(format!("{p}.found"), "list at least one status that means the operation happened");
        }
        let absent = self.statuses(&format!("{p}.absent"), r.absent.as_deref(), &[404]);
        if let (Some(found), Some(absent)) = (&found, &absent)
            && let Some(both) = found.iter().find(|s| absent.contains(s))
        {
            self.issues.push(format!("{p}.absent"), format!("{} is also in found: a status must say one thing", both.as_u16()));
        }
        let found_as = match r.found_as {
            None => Some(None),
            Some(code) => self.statuses(&format!("{p}.found_as"), Some(&[code]), &[]).and_then(|s| s.first().copied()).map(Some),
        };
        let settle = self.duration(&format!("{p}.settle"), r.settle.as_deref(), "30s");
        let interval = self.duration(&format!("{p}.interval"), r.interval.as_deref(), "30s");
        let interval = self.at_least(&format!("{p}.interval"), interval, Duration::from_millis(10));
        let (method, target) = target?;
        Some(Probe { method, target, found: found?, found_as: found_as?, absent: absent?, settle: settle?, interval: interval? })
    }

    /// A list of final HTTP statuses (200-599: what a recorded response or a
    /// probe's answer can be).
    fn statuses(&mut self, path: &str, list: Option<&[i64]>, default: &[u16]) -> Option<Vec<StatusCode>> {
        let Some(list) = list else {
            return Some(default.iter().filter_map(|c| StatusCode::from_u16(*c).ok()).collect());
        };
        let mut ok = true;
        let mut out = Vec::new();
        for (k, code) in list.iter().enumerate() {
            match u16::try_from(*code).ok().filter(|c| (200..=599).contains(c)).and_then(|c| StatusCode::from_u16(c).ok()) {
                Some(s) => out.push(s),
                None => {
                    ok = false;
                    let at = if path.ends_with("found_as") { path.to_owned() } else { format!("{path}[{k}]") };
                    self.issues.push(at, format!("{code} is not a final HTTP status (200-599)"));
                }
            }
        }
        ok.then_some(out)
    }

    fn fingerprint(&mut self, p: &str, f: &super::file::FingerprintSection) -> Option<FingerprintSpec> {
        let mut ok = true;
        let mut spec = FingerprintSpec::default();
        for (k, ptr) in f.exclude.iter().enumerate() {
            match JsonPointer::parse(ptr) {
                Ok(jp) => spec.exclude.push(jp),
                Err(e) => {
                    ok = false;
                    self.issues.push(format!("{p}.fingerprint.exclude[{k}]"), format!("invalid JSON Pointer {ptr:?}: {e}"));
                }
            }
        }
        for (ptr, value) in &f.defaults {
            let path = format!("{p}.fingerprint.defaults.\"{ptr}\"");
            let jp = match JsonPointer::parse(ptr) {
                Ok(jp) => jp,
                Err(e) => {
                    ok = false;
                    self.issues.push(path, format!("invalid JSON Pointer {ptr:?}: {e}"));
                    continue;
                }
            };
            spec.defaults.push((jp, toml_to_json(value)));
        }
        for (k, h) in f.headers.iter().enumerate() {
            match HeaderName::from_bytes(h.as_bytes()) {
                Ok(name) => spec.headers.push(name),
                Err(_) => {
                    ok = false;
                    self.issues.push(format!("{p}.fingerprint.headers[{k}]"), format!("invalid header name {h:?}"));
                }
            }
        }
        if let Err(e) = spec.validate() {
            ok = false;
            self.issues.push(format!("{p}.fingerprint.defaults"), e.to_string());
        }
        ok.then_some(spec)
    }
}

fn toml_to_json(v: &toml::Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        toml::Value::String(s) => J::String(s.clone()),
        toml::Value::Integer(i) => J::from(*i),
        toml::Value::Float(f) => serde_json::Number::from_f64(*f).map_or(J::Null, J::Number),
        toml::Value::Boolean(b) => J::Bool(*b),
        toml::Value::Datetime(d) => J::String(d.to_string()),
        toml::Value::Array(a) => J::Array(a.iter().map(toml_to_json).collect()),
        toml::Value::Table(t) => J::Object(t.iter().map(|(k, v)| (k.clone(), toml_to_json(v))).collect()),
    }
}

fn default_replica_id() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "idemgate".to_owned());
    format!("{host}-{}", std::process::id())
}
