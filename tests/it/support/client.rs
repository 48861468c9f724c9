//! A small HTTP client for tests, plus raw-socket helpers for abusive clients.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    /// The problem type's last part, e.g. `request-in-progress`.
    pub fn problem(&self) -> String {
        let v = self.json();
        let t = v["type"].as_str().unwrap_or_else(|| panic!("not a problem: {v}"));
        t.strip_prefix("urn:idemgate:problem:").unwrap_or(t).to_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
}

/// One request on a fresh connection.
pub async fn send(method: &str, url: &str, headers: &[(&str, &str)], body: impl Into<Bytes>) -> Result<Resp, String> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(0).build_http();
    let mut b = Request::builder().method(Method::from_bytes(method.as_bytes()).unwrap()).uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(Full::new(body.into())).map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(Duration::from_secs(60), client.request(req))
        .await
        .map_err(|_| "client timeout".to_owned())?
        .map_err(|e| format!("{e:?}"))?;
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(Resp { status: parts.status.as_u16(), headers: parts.headers, body })
}

/// A POST with an API key, an idempotency key and a JSON body.
pub async fn post(url: &str, key: &str, body: &str, extra: &[(&str, &str)]) -> Resp {
    try_post(url, key, body, extra).await.unwrap_or_else(|e| panic!("POST {url} failed: {e}"))
}

/// [`post`], for a request that may fail on purpose (its gateway is killed).
pub async fn try_post(url: &str, key: &str, body: &str, extra: &[(&str, &str)]) -> Result<Resp, String> {
    let mut h = vec![("authorization", "Bearer test-key"), ("content-type", "application/json"), ("idempotency-key", key)];
    h.extend_from_slice(extra);
    send("POST", url, &h, body.to_owned()).await
}
