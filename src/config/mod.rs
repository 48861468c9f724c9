//! Configuration, in two stages: [`file`] is the TOML as written (serde,
//! unknown keys rejected); [`Config`] is the validated, typed result. Every
//! error names the file and the TOML path it is about, and validation reports
//! all of them at once. Settings that are valid but insecure become
//! [`ConfigWarning`]s (`hardening`). [`check_connections`] (`check-config
//! --connect`) then reaches the store and the upstreams without changing
//! anything.

mod connect;
mod error;
mod file;
mod hardening;
mod validate;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

pub use connect::{ConnectCheck, check_connections};
pub use error::{ConfigError, ConfigIssue};
pub use hardening::{ConfigWarning, Hardening};

use crate::request::identity::IdentitySource;
use crate::request::route::{Route, UpstreamId};
pub use crate::secret::Secret;
pub use crate::store::{Pooler, StoreBackend, StoreConfig};
use crate::tls::server::ListenerTls;
pub use crate::upstream::UpstreamConfig;

/// Where configuration is read from when `--config` and `IDEMGATE_CONFIG` are absent.
pub const DEFAULT_CONFIG_PATH: &str = "config/idemgate.toml";
/// The embedded store's file when `[store]` is absent.
pub const DEFAULT_SQLITE_PATH: &str = "data/idemgate.db";

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub store: StoreConfig,
    pub admin: Option<AdminConfig>,
    pub upstreams: Vec<UpstreamConfig>,
    pub identity: Vec<IdentitySource>,
    pub routes: Vec<Route>,
    pub workers: WorkersConfig,
    /// Valid but insecure settings: `check-config` prints them, `serve`
    /// logs them (see [`ConfigWarning`]).
    pub warnings: Vec<ConfigWarning>,
}

/// `[workers]`: how many async operations this replica runs at once.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkersConfig {
    /// Worker tasks taking queued operations (default 2; 0: a pure front
    /// replica that accepts operations but never runs them).
    pub count: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Larger request bodies on idempotent routes get 413 before any claim.
    pub max_request_body: u64,
    /// How long SIGTERM waits for in-flight requests to finish and be recorded.
    pub shutdown_grace: Duration,
    /// Where unmatched paths go; absent: 404.
    pub default_upstream: Option<UpstreamId>,
    /// A client must send its request headers within this time (slowloris
    /// guard): the first request's after the connection opens (after the TLS
    /// handshake on a TLS listener), and each later one's after the previous
    /// request ended; a keep-alive connection (HTTP/1.1 or HTTP/2) with no
    /// request for this long is closed.
    pub request_header_timeout: Duration,
    /// HTTP/2 connections are pinged this often; one whose client does not
    /// answer within the same time is closed.
    pub http2_keep_alive_interval: Duration,
    /// ... and its body within this time, before any key is claimed.
    pub request_body_timeout: Duration,
    /// This replica's name in the `owner` column; default: hostname and pid.
    pub replica_id: String,
    /// Key for the HMAC that derives the `Idempotency-Key` sent upstream
    /// (shared by all replicas); without it the derived key is a plain hash.
    pub derived_key_secret: Option<Secret>,
    /// Threads serving the proxy listener, each with its own event loop and
    /// upstream connection pool, accepting from one socket (or, with
    /// `reuse_port`, each from its own); default: one per CPU.
    pub workers: usize,
    /// One access-log line per request (target `idemgate::proxy::access`).
    pub access_log: bool,
    /// On SIGTERM, `/readyz` answers 503 at once and the listener keeps
    /// accepting for this long (so load balancers stop sending first), then
    /// stops; `shutdown_grace` applies after it.
    pub drain_delay: Duration,
    /// Peers whose `X-Request-Id` is kept; from anyone else (and when empty)
    /// a fresh id is generated.
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// Open client connections at most, over all workers; past it new
    /// connections wait in the kernel's accept queue.
    pub max_connections: usize,
    /// `[server.tls]`: the proxy listener speaks HTTPS (HTTP/1.1 and HTTP/2).
    pub tls: Option<ListenerTls>,
    /// Bind the proxy port with SO_REUSEPORT, so that other gateways that set
    /// it too can listen on it (off: the port is this process's alone).
    pub reuse_port: bool,
    /// Request header names with `_`: dropped (default), refused, or let
    /// through (guarded names' `_` spellings are removed in every case).
    pub headers_with_underscores: crate::upstream::headers::UnderscoreHeaders,
}

#[derive(Debug, Clone, PartialEq)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// Bearer token for the admin API; health and metrics need none.
    pub token: Option<Secret>,
    /// `[admin.tls]`: the admin listener speaks HTTPS.
    pub tls: Option<ListenerTls>,
    /// What logs and the audit trail call the token; default: a keyed hash
    /// of it ([`crate::store::audit::token_label`]).
    pub token_label: Option<String>,
    /// Query parameters masked where a stored request is shown, besides the
    /// built-in credential names ([`crate::ops::console::mask`]).
    pub masked_query_params: Vec<String>,
}

impl Config {
    /// Reads and validates a file. Relative paths inside it (SQLite path,
    /// secret files) are relative to the working directory.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::single(&file, "", format!("cannot read the file: {e}")))?;
        Config::from_toml(&text, &file, &|name| std::env::var(name).ok())
    }

    /// Validates TOML text. `origin` names it in errors; `env` looks up
    /// environment variables (so tests need neither files nor a real env).
    pub fn from_toml(text: &str, origin: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let mut issues = error::Issues::default();
        let raw = file::parse(text, origin, &mut issues)?;
        validate::validate(raw, issues, origin, env)
    }

    /// Where the admin listener of the configuration in `path` listens, read
    /// without validating the rest of the file or resolving any secret:
    /// `idemgate healthcheck` runs where the gateway's secrets are not set
    /// (a container's HEALTHCHECK, an orchestrator's probe). Errors are the
    /// file's (unreadable, not TOML, `[admin]` malformed or absent).
    pub fn admin_listen(path: &Path) -> Result<SocketAddr, ConfigError> {
        Config::admin_probe(path).map(|(listen, _)| listen)
    }

    /// [`Config::admin_listen`], and the certificate file of `[admin.tls]`
    /// when the listener speaks TLS (public: no key or secret is read).
    pub fn admin_probe(path: &Path) -> Result<(SocketAddr, Option<std::path::PathBuf>), ConfigError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::single(&origin, "", format!("cannot read the file: {e}")))?;
        let mut issues = error::Issues::default();
        let raw = file::parse(&text, &origin, &mut issues)?;
        let broken = |issues: error::Issues| ConfigError { file: origin.clone(), issues: issues.list };
        let (listen, cert_file) = match &raw.admin {
            file::Part::Ok(Some(admin)) => {
                (admin.listen.clone(), admin.tls.as_ref().and_then(|t| t.cert_file.as_ref()).map(std::path::PathBuf::from))
            }
            file::Part::Ok(None) => (None, None),
            file::Part::Broken(_) => {
                issues.list.retain(|i| i.path == "admin" || i.path.starts_with("admin."));
                if issues.list.is_empty() {
                    issues.push("admin", "the section does not parse");
                }
                return Err(broken(issues));
            }
        };
        let Some(listen) = listen else {
            return Err(ConfigError::single(&origin, "admin.listen", "no [admin] listener is configured (set admin.listen)"));
        };
        let listen = listen.parse().map_err(|e| {
            ConfigError::single(&origin, "admin.listen", format!("invalid address {listen:?}: {e} (write e.g. \"127.0.0.1:9090\")"))
        })?;
        Ok((listen, cert_file))
    }

    pub fn upstream(&self, id: UpstreamId) -> &UpstreamConfig {
        &self.upstreams[id]
    }

    /// Logs each warning (at start and after a reload).
    /// What `check-config` explains about the routes' numbers (not errors,
    /// not insecure): when a reconciliation probe may first ask about an
    /// `unknown` record. An async attempt is probed no sooner than the
    /// timeout it was sent with plus `settle` after its send; a synchronous
    /// one no sooner than its claim's lease (which outlasts the upstream's
    /// timeout) plus `settle` after its claim. On a route whose lease is
    /// shorter than the timeout (async: heartbeats renew it), a record turns
    /// `unknown` long before its first probe.
    pub fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        for (i, r) in self.routes.iter().enumerate() {
            let (Some(probe), Some(up)) = (&r.background.reconcile, self.upstreams.get(r.upstream)) else { continue };
            let first = up.timeout + probe.settle;
            let fmt = humantime::format_duration;
            let mut note = if r.execution.mode.always_async() {
                format!(
                    "routes[{i}].reconcile: an unknown operation of {} is probed no sooner than {} after its attempt was sent \
                     (upstream {} timeout {} + settle {}; an attempt sent by a replica with another timeout waits for that one): \
                     until then the request may still be at the upstream",
                    r.operation,
                    fmt(first),
                    up.name,
                    fmt(up.timeout),
                    fmt(probe.settle),
                )
            } else {
                format!(
                    "routes[{i}].reconcile: an unknown record of {} is probed no sooner than {} after it was claimed \
                     (its lease {}, which outlasts upstream {}'s timeout {}, + settle {}): until then the request may still be \
                     at the upstream",
                    r.operation,
                    fmt(r.record.lease + probe.settle),
                    fmt(r.record.lease),
                    up.name,
                    fmt(up.timeout),
                    fmt(probe.settle),
                )
            };
            if r.record.lease < up.timeout {
                note.push_str(&format!(
                    "; its lease ({}) is shorter than that timeout, so a lost attempt turns unknown after one lease and waits \
                     about {} more for its first probe",
                    humantime::format_duration(r.record.lease),
                    humantime::format_duration(first.saturating_sub(r.record.lease)),
                ));
            }
            notes.push(note);
        }
        notes
    }

    pub fn log_warnings(&self, file: &str) {
        for w in &self.warnings {
            tracing::warn!(file, path = %w.path, hardening = w.hardening.title(), "insecure setting: {}; see docs/operations.md", w.risk);
        }
    }
}

#[cfg(test)]
mod tests;
