//! Stage one of configuration: the TOML file exactly as written.
//!
//! Every struct denies unknown fields, so a misspelt key is an error that names
//! its TOML path rather than a silently ignored setting. Values stay strings
//! here (durations, sizes, addresses, CIDRs); `super::validate` turns them into
//! typed values and reports every problem with its path.

use std::collections::BTreeMap;

use serde::Deserialize;

/// The whole file. All sections are optional except `[[upstreams]]` and
/// `[[routes]]`, which a useful gateway needs (validation says so).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub server: ServerSection,
    /// Absent: the embedded SQLite store at its default path.
    pub store: Option<StoreSection>,
    pub admin: Option<AdminSection>,
    #[serde(default)]
    pub upstreams: Vec<UpstreamSection>,
    #[serde(default)]
    pub identity: IdentitySection,
    #[serde(default)]
    pub routes: Vec<RouteSection>,
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
    pub replica_id: Option<String>,
    pub derived_key_secret_env: Option<String>,
    pub derived_key_secret_file: Option<String>,
    pub workers: Option<i64>,
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
    pub migrate: Option<bool>,
    pub operation_timeout: Option<String>,
    pub sweep_interval: Option<String>,
    pub sweep_batch: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminSection {
    pub listen: Option<String>,
    pub token_env: Option<String>,
    pub token_file: Option<String>,
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
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentitySection {
    #[serde(default)]
    pub sources: Vec<IdentitySourceSection>,
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
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeySection {
    pub sha256: Option<String>,
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
    pub key_required: Option<bool>,
    pub retention: Option<String>,
    pub in_flight: Option<String>,
    pub in_flight_wait: Option<String>,
    pub release_on_status: Option<Vec<i64>>,
    pub max_stored_response: Option<String>,
    pub upstream_idempotent: Option<bool>,
    pub lease: Option<String>,
    pub mismatch_status: Option<i64>,
    pub forward_key: Option<String>,
    #[serde(default)]
    pub fingerprint: FingerprintSection,
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
