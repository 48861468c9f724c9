use std::time::Duration;

use super::*;
use crate::idempotency::record::Retention;
use crate::request::route::{ForwardKey, InFlightPolicy, Mode};

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
    assert_eq!(r.key.header.as_str(), "idempotency-key");
    assert!(r.key.required);
    assert_eq!(r.record.retention, Retention::For(Duration::from_secs(24 * 3600)));
    assert_eq!(r.record.in_flight, InFlightPolicy::Reject);
    // Lease default: upstream timeout plus a margin.
    assert_eq!(r.record.lease, Duration::from_secs(7));
    assert_eq!(r.key.mismatch_status, http::StatusCode::CONFLICT);
    assert_eq!(r.key.forward, ForwardKey::Derived);
    assert_eq!(r.record.max_stored_response, 1024 * 1024);
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
        StoreBackend::Postgres { url, pool_size, .. } => {
            assert_eq!(url.expose(), "postgres://u@127.0.0.1:5432/db");
            assert_eq!(*pool_size, 4);
            assert!(!format!("{url:?}").contains("127.0.0.1"), "secrets are not printed");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.admin.as_ref().unwrap().token.as_ref().unwrap().expose(), "t0ken");
    let r = &c.routes[0];
    assert_eq!(r.record.in_flight, InFlightPolicy::Wait(Duration::from_millis(250)));
    assert_eq!(r.record.release_on_status, vec![http::StatusCode::TOO_MANY_REQUESTS, http::StatusCode::SERVICE_UNAVAILABLE]);
    assert_eq!(r.record.max_stored_response, 64 * 1024);
    assert!(r.execution.upstream_idempotent);
    assert_eq!(r.record.lease, Duration::from_secs(15));
    assert_eq!(r.key.mismatch_status, http::StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(r.key.forward, ForwardKey::Client);
    assert_eq!(r.key.fingerprint.exclude.len(), 1);
    assert_eq!(r.key.fingerprint.defaults.len(), 2);
    assert_eq!(r.key.fingerprint.headers[0].as_str(), "api-version");
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
url = "ftp://example.com"

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
mode = "later"
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

fn route(operation: &str, method: &str, path: &str) -> String {
    format!("\n[[routes]]\noperation = \"{operation}\"\nmethod = \"{method}\"\npath = \"{path}\"\nupstream = \"orders\"\n")
}

fn issue<'e>(e: &'e ConfigError, path: &str) -> &'e str {
    match e.issues.iter().find(|i| i.path == path) {
        Some(i) => &i.message,
        None => panic!("no issue at {path} in:\n{e}"),
    }
}

#[test]
fn duplicate_routes_and_missing_identity() {
    let text = minimal("") + &route("again", "POST", "/v1/orders");
    let e = parse(&text).unwrap_err();
    assert!(issue(&e, "routes[1].path").contains("routes[0]"), "{e}");
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
fn unreachable_at_start_is_retry_or_exit_on_postgres() {
    let pg = |extra: &str| parse(&(minimal("") + &format!("\n[store]\nkind = \"postgres\"\nurl_env = \"DB_URL\"\n{extra}")));
    assert_eq!(pg("").unwrap().store.unreachable_at_start, crate::store::UnreachableAtStart::Retry);
    assert_eq!(pg("unreachable_at_start = \"exit\"").unwrap().store.unreachable_at_start, crate::store::UnreachableAtStart::Exit);
    let e = pg("unreachable_at_start = \"wait\"").unwrap_err();
    assert!(issue(&e, "store.unreachable_at_start").contains("\"retry\" or \"exit\""), "{e}");
    let e = parse("[store]\nkind = \"sqlite\"\nunreachable_at_start = \"exit\"\n").unwrap_err();
    assert!(issue(&e, "store.unreachable_at_start").contains("postgres"), "{e}");
}

#[test]
fn example_config_in_the_repo_is_valid() {
    let text = include_str!("../../config/idemgate.toml");
    let c = Config::from_toml(text, "config/idemgate.toml", &|_| None).unwrap();
    assert_eq!(c.routes.len(), 2);
    assert_eq!(c.identity.len(), 2);
}

// ---- issue 8: what check-config used to accept -------------------------------------

#[test]
fn one_operation_belongs_to_exactly_one_route() {
    let text = minimal("") + &route("refund", "POST", "/v1/refunds") + &route("create_order", "POST", "/v1/orders/bulk");
    let e = parse(&text).unwrap_err();
    let msg = issue(&e, "routes[2].operation");
    assert!(msg.contains("routes[0]") && msg.contains("exactly one route"), "{msg}");
    assert_eq!(e.issues.len(), 1, "{e}");
    // The same path under other methods is fine with distinct operations.
    let ok = minimal("") + &route("replace_orders", "PUT", "/v1/orders");
    assert_eq!(parse(&ok).unwrap().routes.len(), 2);
}

#[test]
fn routes_of_one_method_and_shape_are_refused_whatever_their_parameter_names() {
    let text = minimal("") + &route("cancel", "POST", "/v1/orders/{id}/cancel") + &route("cancel2", "post", "/v1/orders/{order}/cancel");
    let e = parse(&text).unwrap_err();
    let msg = issue(&e, "routes[2].path");
    assert!(msg.contains("routes[1]"), "{msg}");
    // Another method, or another literal, is another route.
    let ok = minimal("") + &route("cancel", "POST", "/v1/orders/{id}/cancel") + &route("peek", "GET", "/v1/orders/{order}/cancel");
    assert!(parse(&ok).is_ok());
}

#[test]
fn a_literal_route_listed_after_a_parameter_route_is_reachable() {
    let text =
        minimal("") + &route("cancel_one", "POST", "/v1/orders/{other}/cancel") + &route("cancel_all", "POST", "/v1/orders/all/cancel");
    let c = parse(&text).unwrap();
    let router = crate::request::route::Router::new(c.routes, None);
    let op = |path: &str| match router.route(&http::Method::POST, path) {
        crate::request::route::RouteMatch::Operation { route, .. } => route.operation.to_string(),
        other => panic!("{path}: {other:?}"),
    };
    assert_eq!(op("/v1/orders/all/cancel"), "cancel_all");
    assert_eq!(op("/v1/orders/42/cancel"), "cancel_one");
}

#[test]
fn admin_listener_may_not_share_the_proxy_port() {
    let with =
        |server: &str, admin: &str| parse(&format!("[server]\nlisten = \"{server}\"\n[admin]\nlisten = \"{admin}\"\n{}", minimal("")));
    for (server, admin) in [
        ("127.0.0.1:8080", "127.0.0.1:8080"),
        ("127.0.0.1:8080", "0.0.0.0:8080"),
        ("0.0.0.0:8080", "127.0.0.1:8080"),
        ("[::]:8080", "127.0.0.1:8080"),
        ("[::1]:8080", "[::1]:8080"),
    ] {
        let e = with(server, admin).unwrap_err();
        assert!(issue(&e, "admin.listen").contains("8080"), "{server} / {admin}: {e}");
        assert_eq!(e.issues.len(), 1, "{e}");
    }
    for (server, admin) in [
        ("127.0.0.1:8080", "127.0.0.1:9090"),
        ("127.0.0.1:8080", "127.0.0.2:8080"),
        ("127.0.0.1:0", "127.0.0.1:0"),
        ("0.0.0.0:0", "0.0.0.0:0"),
    ] {
        assert!(with(server, admin).is_ok(), "{server} / {admin}");
    }
}

#[test]
fn unparsable_postgres_urls_are_refused_without_printing_them() {
    let env = |name: &str| match name {
        "BAD_URL" => Some("postgres://u:hunter2@db.example:notaport/x".into()),
        "NO_HOST" => Some("user=u password=hunter2 dbname=x".into()),
        _ => None,
    };
    let store = |line: &str| format!("[store]\nkind = \"postgres\"\n{line}\n{}", minimal(""));
    let e = parse(&store("url = \"not a url\"")).unwrap_err();
    assert!(issue(&e, "store.url").contains("PostgreSQL"), "{e}");
    let e = Config::from_toml(&store("url_env = \"BAD_URL\""), "test.toml", &env).unwrap_err();
    assert!(issue(&e, "store.url_env").contains("BAD_URL"), "{e}");
    assert!(!e.to_string().contains("hunter2") && !e.to_string().contains("db.example"), "{e}");
    let e = Config::from_toml(&store("url_env = \"NO_HOST\""), "test.toml", &env).unwrap_err();
    assert!(issue(&e, "store.url_env").contains("host"), "{e}");
    assert!(!e.to_string().contains("hunter2"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("url");
    std::fs::write(&file, "postgres://u:hunter2@[::1/x\n").unwrap();
    let e = parse(&store(&format!("url_file = \"{}\"", file.display()))).unwrap_err();
    assert!(issue(&e, "store.url_file").contains("PostgreSQL"), "{e}");
    assert!(!e.to_string().contains("hunter2"), "{e}");
    // Both URL and key=value forms that name a host are fine.
    assert!(parse(&store("url = \"host=127.0.0.1 user=u dbname=x\"")).is_ok());
    assert!(parse(&store("url = \"postgresql://u@localhost/x?sslmode=disable\"")).is_ok());
}

#[test]
fn retention_under_one_second_is_refused() {
    for bad in ["0s", "500ms", "999ms"] {
        let e = parse(&minimal(&format!("retention = \"{bad}\""))).unwrap_err();
        assert!(issue(&e, "routes[0].retention").contains("at least 1s"), "{bad}: {e}");
    }
    assert_eq!(parse(&minimal("retention = \"1s\"")).unwrap().routes[0].record.retention, Retention::For(Duration::from_secs(1)));
}

#[test]
fn a_file_with_nothing_to_serve_is_refused() {
    for text in [
        "",
        "\n# only a comment\n",
        "[server]\nlisten = \"127.0.0.1:8080\"\n",
        "[[upstreams]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n",
    ] {
        let e = parse(text).unwrap_err();
        assert!(issue(&e, "").contains("nothing to serve"), "{text:?}: {e}");
        assert!(e.to_string().starts_with("test.toml: nothing to serve"), "{e}");
    }
    // A default upstream alone is a (pass-through) gateway.
    let proxy = "[server]\ndefault_upstream = \"a\"\n[[upstreams]]\nname = \"a\"\nurl = \"http://127.0.0.1:1\"\n";
    assert!(parse(proxy).is_ok());
}

#[test]
fn errors_of_every_section_are_reported_in_one_pass() {
    let text = format!(
        r#"
[server]
shutdown_grace = "soon"

[store]
pool_size = "many"

[[upstreams]]
name = "billing"
url = "http://127.0.0.1:9001"
timeout = 5

{minimal}
key_required = "yes"

[[routes]]
operation = "bill"
method = "POST"
path = "/v1/bills"
upstream = "billing"

[[routes]]
operation = "refund"
method = "POST"
path = "/v1/refunds"
upstream = "orders"
retention = "a while"

[[routes]]
operation = "cancel"
method = "POST"
path = "/v1/orders/{{id}}/cancel"
upstream = "orders"
colour = "blue"

[identity]
extra = 1

[srever]
listen = "127.0.0.1:1"
"#,
        minimal = minimal("")
    );
    let e = parse(&text).unwrap_err();
    for path in [
        "server.shutdown_grace",
        "store.pool_size",
        "upstreams[0].timeout",
        "routes[0].key_required",
        "routes[2].retention",
        "routes[3].colour",
        "identity.extra",
        "srever",
    ] {
        assert!(e.mentions(path), "missing {path} in:\n{e}");
    }
    // A route on a broken upstream is not reported a second time.
    assert!(!e.mentions("routes[1].upstream"), "{e}");
    assert_eq!(e.issues.len(), 8, "{e}");
    // Type errors carry the file and the position.
    let s = e.to_string();
    assert!(s.lines().any(|l| l.starts_with("test.toml: routes[0].key_required: invalid type") && l.contains("line ")), "{s}");
    assert!(s.lines().any(|l| l.starts_with("test.toml: srever: unknown field") && l.contains("line ")), "{s}");
}

#[test]
fn sections_of_the_wrong_type_are_reported_by_path() {
    let e = parse("routes = 3\nupstreams = [1]\nserver = \"x\"\n").unwrap_err();
    for path in ["routes", "upstreams[0]", "server"] {
        assert!(e.mentions(path), "missing {path} in:\n{e}");
    }
}

#[test]
fn checks_across_entries_see_entries_that_have_other_errors() {
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:7000\"\nshutdown_grace = \"soon\"\n[admin]\nlisten = \"0.0.0.0:7000\"\n{}{}",
        minimal("retention = \"0s\""),
        route("create_order", "POST", "/v1/orders").replace("upstream = \"orders\"", "upstream = \"orders\"\nretention = \"0s\"")
    );
    let e = parse(&text).unwrap_err();
    for path in
        ["server.shutdown_grace", "admin.listen", "routes[0].retention", "routes[1].retention", "routes[1].operation", "routes[1].path"]
    {
        assert!(e.mentions(path), "missing {path} in:\n{e}");
    }
    assert_eq!(e.issues.len(), 6, "{e}");
}

#[test]
fn an_entry_that_does_not_deserialize_still_takes_part_in_cross_checks() {
    // routes[0] has an unknown key, yet its operation and path are still compared.
    let text = minimal("colour = \"blue\"") + &route("create_order", "post", "/v1/orders");
    let e = parse(&text).unwrap_err();
    for path in ["routes[0].colour", "routes[1].operation", "routes[1].path"] {
        assert!(e.mentions(path), "missing {path} in:\n{e}");
    }
    // So does a [server] section with a type error, for the admin port.
    let text = format!("[server]\nlisten = \"127.0.0.1:7000\"\nworkers = \"two\"\n[admin]\nlisten = \"127.0.0.1:7000\"\n{}", minimal(""));
    let e = parse(&text).unwrap_err();
    assert!(e.mentions("server.workers") && e.mentions("admin.listen"), "{e}");
}

#[test]
fn key_from_takes_one_source_or_a_list() {
    let labels = |c: &Config| c.routes[0].key.from.sources().iter().map(|s| s.to_string()).collect::<Vec<_>>();
    // Default: key_header.
    assert_eq!(labels(&parse(&minimal("")).unwrap()), ["header:idempotency-key"]);
    assert_eq!(labels(&parse(&minimal("key_header = \"x-key\"")).unwrap()), ["header:x-key"]);
    let one = parse(&minimal("key_from = \"body:/client_order_id\"")).unwrap();
    assert_eq!(labels(&one), ["body:/client_order_id"]);
    let list = parse(&minimal("key_from = [\"header:X-Client-Order-Id\", \"body:/order/id\", \"header:idempotency-key\"]")).unwrap();
    assert_eq!(labels(&list), ["header:x-client-order-id", "body:/order/id", "header:idempotency-key"]);
    // One header source is the header forward_key = "client" forwards.
    let client = parse(&minimal("key_from = \"header:x-request-id\"\nforward_key = \"client\"")).unwrap();
    assert_eq!(client.routes[0].key.header.as_str(), "x-request-id");
}

#[test]
fn bad_key_sources_are_reported_with_their_path() {
    let e = parse(&minimal("key_from = \"/client_order_id\"")).unwrap_err();
    assert!(issue(&e, "routes[0].key_from").contains("\"header:<name>\" or \"body:<JSON Pointer>\""), "{e}");
    let e = parse(&minimal("key_from = [\"header:ok\", \"body:no-slash\", \"header:bad name\", \"header:ok\"]")).unwrap_err();
    assert!(issue(&e, "routes[0].key_from[1]").contains("JSON Pointer"), "{e}");
    assert!(issue(&e, "routes[0].key_from[2]").contains("invalid header name"), "{e}");
    assert!(issue(&e, "routes[0].key_from[3]").contains("listed twice"), "{e}");
    let e = parse(&minimal("key_from = []")).unwrap_err();
    assert!(issue(&e, "routes[0].key_from").contains("at least one source"), "{e}");
    let e = parse(&minimal("key_from = 7")).unwrap_err();
    assert!(issue(&e, "routes[0].key_from").contains("a string or a list of strings"), "{e}");
    let e = parse(&minimal("key_from = \"body:/id\"\nkey_header = \"x-key\"")).unwrap_err();
    assert!(issue(&e, "routes[0].key_header").contains("not both"), "{e}");
    let e = parse(&minimal("key_from = \"body:/id\"\nforward_key = \"client\"")).unwrap_err();
    assert!(issue(&e, "routes[0].forward_key").contains("single header source"), "{e}");
}

#[test]
fn forever_retention_and_a_zero_response_limit() {
    let c = parse(&minimal("retention = \"forever\"\nmax_stored_response = \"0\"")).unwrap();
    assert_eq!(c.routes[0].record.retention, Retention::Forever);
    assert_eq!(c.routes[0].record.max_stored_response, 0);
    // A number of bytes is accepted too.
    assert_eq!(parse(&minimal("max_stored_response = 0")).unwrap().routes[0].record.max_stored_response, 0);
    assert_eq!(parse(&minimal("max_stored_response = 4096")).unwrap().routes[0].record.max_stored_response, 4096);
    let e = parse(&minimal("max_stored_response = -1")).unwrap_err();
    assert!(issue(&e, "routes[0].max_stored_response").contains("negative"), "{e}");
    let e = parse(&minimal("retention = \"always\"")).unwrap_err();
    assert!(issue(&e, "routes[0].retention").contains("invalid duration"), "{e}");
}

#[test]
fn observe_mode_and_its_budget() {
    let c = parse(&minimal("mode = \"observe\"")).unwrap();
    assert_eq!(c.routes[0].execution.mode, Mode::Observe { budget: Duration::from_millis(50) });
    let c = parse(&minimal("mode = \"observe\"\nobserve_budget = \"20ms\"")).unwrap();
    assert_eq!(c.routes[0].execution.mode, Mode::Observe { budget: Duration::from_millis(20) });
    let e = parse(&minimal("observe_budget = \"20ms\"")).unwrap_err();
    assert!(issue(&e, "routes[0].observe_budget").contains("mode = \"observe\""), "{e}");
    let e = parse(&minimal("mode = \"observe\"\nobserve_budget = \"0s\"")).unwrap_err();
    assert!(issue(&e, "routes[0].observe_budget").contains("at least"), "{e}");
    let e = parse(&minimal("mode = \"observe\"\nallow_async = true")).unwrap_err();
    assert!(issue(&e, "routes[0].allow_async").contains("observe"), "{e}");
    let e = parse(&minimal("mode = \"watch\"")).unwrap_err();
    assert!(issue(&e, "routes[0].mode").contains("\"observe\""), "{e}");
}

// ---- issue 11: the unknown window --------------------------------------------------

#[test]
fn connect_timeout_must_end_before_the_exchange_times_out() {
    // Explicitly as long as the timeout: refused, with the path.
    let text = minimal("").replace("timeout = \"2s\"", "timeout = \"2s\"\nconnect_timeout = \"2s\"");
    let e = parse(&text).unwrap_err();
    let msg = issue(&e, "upstreams[0].connect_timeout");
    assert!(msg.contains("shorter than upstreams[0].timeout"), "{msg}");
    // Absent: 1s, or half of a shorter timeout.
    assert_eq!(parse(&minimal("")).unwrap().upstreams[0].connect_timeout, Duration::from_secs(1));
    let short = minimal("lease = \"2s\"").replace("timeout = \"2s\"", "timeout = \"600ms\"");
    assert_eq!(parse(&short).unwrap().upstreams[0].connect_timeout, Duration::from_millis(300));
}

#[test]
fn a_sync_lease_leaves_room_for_the_claim_and_the_result_write() {
    // The case that used to pass and then answer random 503s.
    let e = parse(&minimal("lease = \"2001ms\"")).unwrap_err();
    let msg = issue(&e, "routes[0].lease");
    assert!(msg.contains("at least 2s 500ms"), "{msg}");
    assert_eq!(parse(&minimal("lease = \"2500ms\"")).unwrap().routes[0].record.lease, Duration::from_millis(2500));
    // Async routes renew their lease by heartbeats: shorter is fine.
    assert!(parse(&minimal("mode = \"async\"\nlease = \"1s\"")).is_ok());
}

#[test]
fn a_probe_is_parsed_with_its_defaults() {
    let c = parse(&minimal("[routes.reconcile]\nprobe = \"GET /v1/orders/by-key/{derived_key}\"")).unwrap();
    let p = c.routes[0].background.reconcile.as_ref().expect("probe");
    assert_eq!(p.method, http::Method::GET);
    assert_eq!(p.target.as_str(), "/v1/orders/by-key/{derived_key}");
    assert_eq!(p.found, vec![http::StatusCode::OK]);
    assert_eq!(p.found_as, None);
    assert_eq!(p.absent, vec![http::StatusCode::NOT_FOUND]);
    assert_eq!((p.settle, p.interval), (Duration::from_secs(30), Duration::from_secs(30)));
    assert!(parse(&minimal("")).unwrap().routes[0].background.reconcile.is_none(), "no probe unless configured");

    let text = minimal(
        "[routes.reconcile]\nprobe = \"head /v1/orders/{id}/by-key?k={key}&t={tenant}&p={principal}\"\nfound = [200, 204]\nfound_as = 201\nabsent = [404, 410]\n\
         settle = \"5s\"\ninterval = \"250ms\"",
    )
    .replace("path = \"/v1/orders\"", "path = \"/v1/orders/{id}\"");
    let c = parse(&text).unwrap();
    let p = c.routes[0].background.reconcile.as_ref().expect("probe");
    assert_eq!(p.method, http::Method::HEAD);
    assert!(p.target.uses_params());
    assert_eq!(p.found_as, Some(http::StatusCode::CREATED));
    assert_eq!(p.absent.len(), 2);
    assert_eq!((p.settle, p.interval), (Duration::from_secs(5), Duration::from_millis(250)));
}

#[test]
fn bad_probes_are_reported_by_path() {
    let text = minimal(
        "forward_key = \"client\"\n[routes.reconcile]\nprobe = \"GET /v1/orders/by-key/{derived_key}/{id}\"\nfound = [200, 99]\n\
         found_as = 700\nabsent = [200]\nsettle = \"soon\"\ninterval = \"0s\"\ncolour = 1",
    );
    let e = parse(&text).unwrap_err();
    // A broken section (unknown key) is reported alone first.
    assert!(e.mentions("routes[0].reconcile.colour"), "{e}");
    let e = parse(&text.replace("\ncolour = 1", "")).unwrap_err();
    for path in [
        "routes[0].reconcile.probe",
        "routes[0].reconcile.found[1]",
        "routes[0].reconcile.found_as",
        "routes[0].reconcile.settle",
        "routes[0].reconcile.interval",
    ] {
        assert!(e.mentions(path), "missing {path} in:\n{e}");
    }
    assert!(issue(&e, "routes[0].reconcile.probe").contains("unknown placeholder {id}"), "{e}");
    // {derived_key} on a route that forwards the client's key.
    let e = parse(&minimal("forward_key = \"client\"\n[routes.reconcile]\nprobe = \"GET /o/{derived_key}\"")).unwrap_err();
    assert!(issue(&e, "routes[0].reconcile.probe").contains("{key}"), "{e}");
    // {key} alone: another tenant's operation under the same key could answer.
    let e = parse(&minimal("forward_key = \"client\"\n[routes.reconcile]\nprobe = \"GET /o/{key}\"")).unwrap_err();
    assert!(issue(&e, "routes[0].reconcile.probe").contains("{tenant} and {principal}"), "{e}");
    assert!(parse(&minimal("forward_key = \"client\"\n[routes.reconcile]\nprobe = \"GET /o/{tenant}/{principal}/{key}\"")).is_ok());
    // A status that says two things.
    let e = parse(&minimal("[routes.reconcile]\nprobe = \"GET /o/{key}\"\nfound = [200]\nabsent = [200, 404]")).unwrap_err();
    assert!(issue(&e, "routes[0].reconcile.absent").contains("200"), "{e}");
    let e = parse(&minimal("[routes.reconcile]\nfound = [200]")).unwrap_err();
    assert!(e.mentions("routes[0].reconcile.probe"), "{e}");
    let e = parse(&minimal("[routes.reconcile]\nprobe = \"DELETE /o/{key}\"")).unwrap_err();
    assert!(issue(&e, "routes[0].reconcile.probe").contains("GET or HEAD"), "{e}");
}

#[test]
fn operating_keys_have_defaults_and_are_checked() {
    let c = parse(&minimal("")).unwrap();
    assert!(c.server.access_log, "the access log is on by default");
    assert_eq!(c.server.drain_delay, Duration::ZERO);
    assert!(c.server.trusted_proxies.is_empty(), "no trusted proxies: request ids are always generated");

    let c =
        parse(&format!("[server]\naccess_log = false\ndrain_delay = \"5s\"\ntrusted_proxies = [\"10.0.0.0/8\", \"::1\"]\n{}", minimal("")))
            .unwrap();
    assert!(!c.server.access_log);
    assert_eq!(c.server.drain_delay, Duration::from_secs(5));
    assert_eq!(c.server.trusted_proxies.len(), 2);

    let e = parse(&format!("[server]\ndrain_delay = \"soon\"\ntrusted_proxies = [\"10.0.0.0/8\", \"nope\"]\n{}", minimal(""))).unwrap_err();
    assert!(issue(&e, "server.drain_delay").contains("invalid duration"), "{e}");
    assert!(issue(&e, "server.trusted_proxies[1]").contains("invalid CIDR"), "{e}");
    let e = parse(&format!("[server]\naccess_log = \"yes\"\n{}", minimal(""))).unwrap_err();
    assert!(e.to_string().contains("server.access_log"), "{e}");
}

#[test]
fn https_urls_are_accepted_for_upstreams_webhooks_jwks_and_authorizers() {
    // Verified against the system roots (this machine has them); upstreams
    // may name their own ca_file instead.
    let text = r#"
[[upstreams]]
name = "orders"
url = "https://orders.internal:8443"

[[identity.sources]]
kind = "jwt"
jwks_url = "https://issuer.example/.well-known/jwks.json"

[[routes]]
operation = "op"
method = "POST"
path = "/x"
upstream = "orders"
authorize.url = "https://authz.internal/check"
events.url = "https://hooks.internal/idemgate"
"#;
    let c = parse(text).unwrap_or_else(|e| panic!("{e}"));
    assert!(c.upstreams[0].tls.is_some());
    let e = parse(&text.replace("url = \"https://orders.internal:8443\"", "url = \"http://orders.internal\"\nca_file = \"ca.pem\""))
        .unwrap_err();
    assert!(e.mentions("upstreams[0].url"), "{e}");
    let e = parse(
        &text.replace("url = \"https://orders.internal:8443\"", "url = \"https://orders.internal\"\nca_file = \"/nonexistent/ca.pem\""),
    )
    .unwrap_err();
    assert!(issue(&e, "upstreams[0].ca_file").contains("/nonexistent/ca.pem"), "{e}");
}

#[test]
fn mtls_sources_need_client_certificates_and_valid_rules() {
    let text = r#"
[[upstreams]]
name = "orders"
url = "http://127.0.0.1:9"

[[identity.sources]]
kind = "mtls"
tenant_from = "san_email"
principal_from = "subject_cn"
principal_regex = "(unclosed"

[[routes]]
operation = "op"
method = "POST"
path = "/x"
upstream = "orders"
"#;
    let e = parse(text).unwrap_err();
    assert!(issue(&e, "identity.sources[0].kind").contains("client_ca_file"), "{e}");
    assert!(issue(&e, "identity.sources[0].tenant_from").contains("san_uri"), "{e}");
    assert!(e.mentions("identity.sources[0].principal_regex"), "{e}");
}

#[test]
fn postgres_sslmode_and_sslrootcert_are_checked() {
    let store = |url: &str| {
        format!(
            "[store]\nkind = \"postgres\"\nurl = \"{url}\"\n[[upstreams]]\nname = \"u\"\nurl = \"http://127.0.0.1:9\"\n[server]\ndefault_upstream = \"u\"\n"
        )
    };
    assert!(parse(&store("postgres://u@db/x?sslmode=verify-full&sslrootcert=/dev/null")).is_err());
    let e = parse(&store("postgres://u@db/x?sslmode=verify-full&sslrootcert=/nonexistent/root.crt")).unwrap_err();
    assert!(issue(&e, "store.url").contains("/nonexistent/root.crt"), "{e}");
    let e = parse(&store("postgres://u@db/x?sslmode=sometimes")).unwrap_err();
    assert!(issue(&e, "store.url").contains("sslmode"), "{e}");
    assert!(parse(&store("postgres://u@db/x?sslmode=require")).is_ok());
}

#[test]
fn no_workers_on_the_embedded_store_with_an_async_route_is_refused() {
    let e = parse(&format!("[workers]\ncount = 0\n{}", minimal("mode = \"async\""))).unwrap_err();
    assert!(issue(&e, "workers.count").contains("queued forever"), "{e}");
    let e = parse(&format!("[workers]\ncount = 0\n{}", minimal("allow_async = true"))).unwrap_err();
    assert!(e.mentions("workers.count"), "{e}");
    // A synchronous route needs no workers; a PostgreSQL front replica may have none.
    assert!(parse(&format!("[workers]\ncount = 0\n{}", minimal(""))).is_ok());
    let pg = "[store]\nkind = \"postgres\"\nurl = \"postgres://u@127.0.0.1/db\"\n[workers]\ncount = 0\n";
    assert!(parse(&format!("{pg}{}", minimal("mode = \"async\""))).is_ok());
}

#[test]
fn check_config_explains_when_a_probe_may_first_ask() {
    let c =
        parse(&minimal("mode = \"async\"\nlease = \"1s\"\n[routes.reconcile]\nprobe = \"GET /o/{derived_key}\"\nsettle = \"2s\"")).unwrap();
    let notes = c.notes();
    assert_eq!(notes.len(), 1, "{notes:?}");
    // The upstream's timeout is 2s: first probe 4s after the send, 3s after the record turned unknown.
    assert!(
        notes[0].starts_with("routes[0].reconcile:") && notes[0].contains("no sooner than 4s after its attempt was sent"),
        "{}",
        notes[0]
    );
    assert!(notes[0].contains("lease (1s) is shorter") && notes[0].contains("about 3s more"), "{}", notes[0]);
    // Synchronous: the claim's lease (the default, timeout + 5s) bounds the attempt.
    let sync = parse(&minimal("[routes.reconcile]\nprobe = \"GET /o/{derived_key}\"\nsettle = \"2s\"")).unwrap().notes();
    assert!(sync[0].contains("no sooner than 9s after it was claimed") && sync[0].contains("its lease 7s"), "{}", sync[0]);
    assert!(parse(&minimal("")).unwrap().notes().is_empty(), "no probe, nothing to explain");
}

#[test]
fn citus_store_takes_the_postgres_keys() {
    let citus = |extra: &str| parse(&(minimal("") + &format!("\n[store]\nkind = \"citus\"\n{extra}")));
    let c = citus("url_env = \"DB_URL\"\npool_size = 4\nunreachable_at_start = \"exit\"").unwrap();
    match &c.store.backend {
        StoreBackend::Citus { url, pool_size, .. } => {
            assert_eq!(url.expose(), "postgres://u@127.0.0.1:5432/db");
            assert_eq!(*pool_size, 4);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(c.store.unreachable_at_start, crate::store::UnreachableAtStart::Exit);
    let e = citus("").unwrap_err();
    assert!(issue(&e, "store.url_env").contains("kind = \"citus\" needs url_env"), "{e}");
    let e = citus("url_env = \"DB_URL\"\npath = \"x.db\"").unwrap_err();
    assert!(e.mentions("store.path"), "{e}");
    let e = parse("[store]\nkind = \"sqlite\"\nurl = \"postgres://u@h/db\"\n").unwrap_err();
    assert!(issue(&e, "store.url").contains("\"postgres\" or \"citus\""), "{e}");
}

#[test]
fn event_batches_default_to_one_and_are_bounded() {
    let c = parse(&minimal("[routes.events]\nurl = \"http://hooks.internal/idemgate\"")).unwrap();
    assert_eq!(c.routes[0].background.events.as_ref().unwrap().batch, 1, "one event per POST unless asked");
    let c = parse(&minimal("[routes.events]\nurl = \"http://hooks.internal/idemgate\"\nbatch = 100")).unwrap();
    assert_eq!(c.routes[0].background.events.as_ref().unwrap().batch, 100);
    for bad in ["0", "1001", "-1"] {
        let e = parse(&minimal(&format!("[routes.events]\nurl = \"http://hooks.internal/idemgate\"\nbatch = {bad}"))).unwrap_err();
        assert!(issue(&e, "routes[0].events.batch").contains("1-1000"), "{e}");
    }
}

/// Every field in error within one entry is reported in one run (the whole
/// entry stops at its first error; each field is then tried alone), each at
/// its own path, and a field alone never reports the fields it lacks.
#[test]
fn every_field_in_error_of_one_entry_is_reported() {
    let e = parse(&minimal("release_on_status = [\"429\"]\nretention = 5\nkey_required = \"yes\"\nnot_a_key = 1")).unwrap_err();
    for path in ["routes[0].release_on_status[0]", "routes[0].retention", "routes[0].key_required", "routes[0].not_a_key"] {
        assert!(e.issues.iter().any(|i| i.path == path), "{path} not reported: {e}");
    }
    assert!(!e.issues.iter().any(|i| i.message.starts_with("missing field")), "{e}");
    let paths: Vec<&str> = e.issues.iter().map(|i| i.path.as_str()).collect();
    let mut unique = paths.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), paths.len(), "each once: {e}");
    // A tagged entry (an identity source) is tried field by field with its kind.
    let text = minimal("").replace("kind = \"api_key\"", "kind = \"api_key\"\nheader = 7\nbogus = true");
    let e = parse(&text).unwrap_err();
    for path in ["identity.sources[0].header", "identity.sources[0].bogus"] {
        assert!(e.issues.iter().any(|i| i.path == path), "{path} not reported: {e}");
    }
}
