use std::time::Duration;

use super::*;
use crate::route::{ForwardKey, InFlightPolicy};

const KEY_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

fn env(name: &str) -> Option<String> {
    match name {
        "DB_URL" => Some("postgres://u@127.0.0.1:5432/db".into()),
        "ADMIN_TOKEN" => Some("t0ken".into()),
        _ => None,
    }
}

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::from_toml(text, "test.toml", &env)
}

fn minimal(extra_route: &str) -> String {
    format!(
        r#"
[[upstreams]]
name = "orders"
url = "http://127.0.0.1:9000"
timeout = "2s"

[[identity.sources]]
kind = "api_key"
keys = [ {{ sha256 = "{KEY_HASH}", tenant = "t", principal = "p" }} ]

[[routes]]
operation = "create_order"
method = "post"
path = "/v1/orders"
upstream = "orders"
{extra_route}
"#
    )
}

#[test]
fn defaults_are_documented_values() {
    let c = parse(&minimal("")).unwrap();
    assert_eq!(c.server.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(c.server.max_request_body, 1024 * 1024);
    assert_eq!(c.server.shutdown_grace, Duration::from_secs(30));
    assert!(matches!(&c.store.backend, StoreBackend::Sqlite { path } if path.to_str() == Some(DEFAULT_SQLITE_PATH)));
    assert!(c.store.migrate);
    let r = &c.routes[0];
    assert_eq!(r.method, http::Method::POST);
    assert_eq!(r.key_header.as_str(), "idempotency-key");
    assert!(r.key_required);
    assert_eq!(r.retention, Duration::from_secs(24 * 3600));
    assert_eq!(r.in_flight, InFlightPolicy::Reject);
    // Lease default: upstream timeout plus a margin.
    assert_eq!(r.lease, Duration::from_secs(7));
    assert_eq!(r.mismatch_status, http::StatusCode::CONFLICT);
    assert_eq!(r.forward_key, ForwardKey::Derived);
    assert_eq!(r.max_stored_response, 1024 * 1024);
}

#[test]
fn full_route_and_postgres_store() {
    let text = format!(
        "[store]\nkind = \"postgres\"\nurl_env = \"DB_URL\"\npool_size = 4\n[admin]\nlisten = \"127.0.0.1:9090\"\ntoken_env = \"ADMIN_TOKEN\"\n{}",
        minimal(
            r#"retention = "1h"
in_flight = "wait"
in_flight_wait = "250ms"
release_on_status = [429, 503]
max_stored_response = "64KiB"
upstream_idempotent = true
lease = "15s"
mismatch_status = 422
forward_key = "client"
fingerprint.exclude = ["/trace_id"]
fingerprint.defaults = { "/currency" = "USD", "/n" = 3 }
fingerprint.headers = ["Api-Version"]"#
        )
    );
    let c = parse(&text).unwrap();
    match &c.store.backend {
        StoreBackend::Postgres { url, pool_size } => {
            assert_eq!(url.expose(), "postgres://u@127.0.0.1:5432/db");
            assert_eq!(*pool_size, 4);
            assert!(!format!("{url:?}").contains("127.0.0.1"), "secrets are not printed");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.admin.as_ref().unwrap().token.as_ref().unwrap().expose(), "t0ken");
    let r = &c.routes[0];
    assert_eq!(r.in_flight, InFlightPolicy::Wait(Duration::from_millis(250)));
    assert_eq!(r.release_on_status, vec![http::StatusCode::TOO_MANY_REQUESTS, http::StatusCode::SERVICE_UNAVAILABLE]);
    assert_eq!(r.max_stored_response, 64 * 1024);
    assert!(r.upstream_idempotent);
    assert_eq!(r.lease, Duration::from_secs(15));
    assert_eq!(r.mismatch_status, http::StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(r.forward_key, ForwardKey::Client);
    assert_eq!(r.fingerprint.exclude.len(), 1);
    assert_eq!(r.fingerprint.defaults.len(), 2);
    assert_eq!(r.fingerprint.headers[0].as_str(), "api-version");
}

#[test]
fn unknown_keys_name_their_path() {
    let e = parse(&minimal("colour = \"blue\"")).unwrap_err();
    assert!(e.mentions("routes[0].colour"), "{e}");
    assert!(e.to_string().starts_with("test.toml: routes[0].colour: unknown field"), "{e}");
    let e = parse("[server]\nlisten = \"127.0.0.1:1\"\nport = 3\n").unwrap_err();
    assert!(e.mentions("server.port"), "{e}");
}

#[test]
fn syntax_errors_give_line_and_column() {
    let e = parse("[server]\nlisten = \n").unwrap_err();
    let s = e.to_string();
    assert!(s.starts_with("test.toml: "), "{s}");
    assert!(s.contains("line 2"), "{s}");
}

#[test]
fn every_invalid_value_is_reported_with_its_path() {
    let text = r#"
[server]
listen = "nowhere"
max_request_body = "lots"
default_upstream = "missing"

[store]
kind = "postgres"
url_env = "NOT_SET"
pool_size = 0

[[upstreams]]
name = "a"
url = "https://example.com"

[[upstreams]]
name = "a"
url = "http://127.0.0.1:1"
timeout = "10s"

[[identity.sources]]
kind = "trusted_header"
tenant_header = "x-t"
principal_header = "x-p"
trusted_peers = ["10.0.0.0/33"]

[[identity.sources]]
kind = "magic"

[[routes]]
operation = "op"
method = "POST"
path = "/x/{a}{b}"
upstream = "a"
in_flight = "queue"
release_on_status = [42]
mismatch_status = 400
lease = "5s"
forward_key = "raw"
mode = "async"
fingerprint.exclude = ["no-slash"]
fingerprint.headers = ["bad header"]
"#;
    let e = parse(text).unwrap_err();
    for path in [
        "server.listen",
        "server.max_request_body",
        "server.default_upstream",
        "store.url_env",
        "store.pool_size",
        "upstreams[0].url",
        "upstreams[1].name",
        "identity.sources[0].trusted_peers[0]",
        "identity.sources[1].kind",
        "routes[0].path",
        "routes[0].in_flight",
        "routes[0].release_on_status[0]",
        "routes[0].mismatch_status",
        "routes[0].lease",
        "routes[0].forward_key",
        "routes[0].mode",
        "routes[0].fingerprint.exclude[0]",
        "routes[0].fingerprint.headers[0]",
    ] {
        assert!(e.mentions(path), "missing {path} in:\n{e}");
    }
}

#[test]
fn duplicate_routes_and_missing_identity() {
    let text = minimal("") + "\n[[routes]]\noperation = \"again\"\nmethod = \"POST\"\npath = \"/v1/orders\"\nupstream = \"orders\"\n";
    let e = parse(&text).unwrap_err();
    assert!(e.mentions("routes[1]"), "{e}");
    let no_identity = minimal("").replace("[[identity.sources]]\nkind = \"api_key\"", "[[unused]]\nkind = \"api_key\"");
    assert!(parse(&no_identity).is_err());
}

#[test]
fn durations_have_bounds() {
    let e = parse(&minimal("retention = \"100000years\"")).unwrap_err();
    assert!(e.mentions("routes[0].retention"), "{e}");
    let e = parse(&minimal("").replace("timeout = \"2s\"", "timeout = \"0s\"")).unwrap_err();
    assert!(e.mentions("upstreams[0].timeout"), "{e}");
    let e = parse("[store]\nsweep_interval = \"0s\"\n").unwrap_err();
    assert!(e.mentions("store.sweep_interval"), "{e}");
}

#[test]
fn sqlite_rejects_postgres_only_keys() {
    let e = parse("[store]\nkind = \"sqlite\"\npool_size = 3\n").unwrap_err();
    assert!(e.mentions("store.pool_size"), "{e}");
    let e = parse("[store]\nkind = \"mysql\"\n").unwrap_err();
    assert!(e.mentions("store.kind"), "{e}");
}

#[test]
fn example_config_in_the_repo_is_valid() {
    let text = include_str!("../../config/idemgate.toml");
    let c = Config::from_toml(text, "config/idemgate.toml", &|_| None).unwrap();
    assert_eq!(c.routes.len(), 2);
    assert_eq!(c.identity.len(), 2);
}
