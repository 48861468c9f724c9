//! The admin API from a test: a gateway with it on (its token in a file),
//! requests with a bearer token, and the records' paths.

use super::{Backend, Gateway, GatewayConfig, Resp, TestUpstream, send};

/// A gateway whose admin API is on with `token` (in a file in the returned
/// directory), after `f` adjusted its config; and its store.
pub async fn setup(
    backend: Backend,
    token: &str,
    f: impl FnOnce(GatewayConfig) -> GatewayConfig,
) -> (TestUpstream, Gateway, idemgate::store::Store, tempfile::TempDir) {
    let up = TestUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let cfg = GatewayConfig::new(backend.clone(), up.url()).admin(&format!("token_file = \"{}\"", token_file.display()));
    let gw = Gateway::start(f(cfg));
    let store = backend.open().await;
    (up, gw, store, dir)
}

/// `method path` on the admin listener with a JSON `body`, and `token` as a
/// bearer token if given. Panics only if no answer came.
pub async fn request(gw: &Gateway, method: &str, path: &str, token: Option<&str>, body: &str) -> Resp {
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut h = vec![("content-type", "application/json")];
    if let Some(a) = &auth {
        h.push(("authorization", a.as_str()));
    }
    send(method, &gw.admin_url(path), &h, body.to_owned()).await.unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// A path segment, percent-encoded.
pub fn enc(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// `/admin/records/{tenant}/{principal}/{operation}/{key}`, encoded.
pub fn record_path(tenant: &str, principal: &str, operation: &str, key: &str) -> String {
    format!("/admin/records/{}/{}/{}/{}", enc(tenant), enc(principal), enc(operation), enc(key))
}
