//! Async operations (`mode = "async"`, or `Prefer: respond-async` where a
//! route allows it): the request as accepted and stored for the workers, the
//! operation id clients poll, and the status document they read.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, request};
use serde_json::json;

use crate::idempotency::record::Retention;
use crate::idempotency::record::{Record, State};
use crate::request::route::Route;
use crate::upstream::headers::{connection_listed, is_hop_by_hop};

/// Where clients poll an operation (on the proxy listener).
pub const OPERATIONS_PATH: &str = "/_idemgate/operations/";

/// A fresh, unguessable, URL-safe operation id (122 random bits).
pub fn new_operation_id() -> String {
    format!("op_{}", uuid::Uuid::new_v4().simple())
}

/// Whether a request asks to be answered asynchronously (RFC 7240).
pub fn prefers_async(headers: &HeaderMap) -> bool {
    headers
        .get_all("prefer")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("respond-async")))
}

/// The request an async operation runs, as stored with its record: method,
/// path and query, the headers that are forwarded, and the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRequest {
    pub method: String,
    pub path_and_query: String,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Bytes,
}

#[derive(Debug, thiserror::Error)]
#[error("stored request: {0}")]
pub struct StoredRequestError(&'static str);

const VERSION: u8 = 1;

impl StoredRequest {
    /// What will be forwarded of this request: hop-by-hop headers are left
    /// out (they are never forwarded anyway).
    pub fn capture(parts: &request::Parts, body: &Bytes) -> StoredRequest {
        let listed = connection_listed(&parts.headers);
        let headers = parts
            .headers
            .iter()
            .filter(|(n, _)| !is_hop_by_hop(n, &listed))
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect();
        StoredRequest {
            method: parts.method.as_str().to_owned(),
            path_and_query: parts.uri.path_and_query().map_or("/", |pq| pq.as_str()).to_owned(),
            headers,
            body: body.clone(),
        }
    }

    /// Version byte, then length-prefixed method, path and query, headers
    /// (u16 name length, name, u32 value length, value) and body.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.path_and_query.len() + self.body.len() + self.headers.len() * 32);
        out.push(VERSION);
        put(&mut out, self.method.as_bytes());
        put(&mut out, self.path_and_query.as_bytes());
        out.extend_from_slice(&u32::try_from(self.headers.len()).unwrap_or(u32::MAX).to_be_bytes());
        for (n, v) in &self.headers {
            put(&mut out, n.as_bytes());
            put(&mut out, v);
        }
        put(&mut out, &self.body);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<StoredRequest, StoredRequestError> {
        let (&version, mut rest) = bytes.split_first().ok_or(StoredRequestError("empty"))?;
        if version != VERSION {
            return Err(StoredRequestError("unknown encoding version"));
        }
        let method = String::from_utf8(take(&mut rest)?.to_vec()).map_err(|_| StoredRequestError("method is not UTF-8"))?;
        let path_and_query = String::from_utf8(take(&mut rest)?.to_vec()).map_err(|_| StoredRequestError("path is not UTF-8"))?;
        let n = u32::from_be_bytes(fixed(&mut rest)?) as usize;
        let mut headers = Vec::with_capacity(n.min(256));
        for _ in 0..n {
            let name = String::from_utf8(take(&mut rest)?.to_vec()).map_err(|_| StoredRequestError("header name is not UTF-8"))?;
            headers.push((name, take(&mut rest)?.to_vec()));
        }
        let body = Bytes::copy_from_slice(take(&mut rest)?);
        if !rest.is_empty() {
            return Err(StoredRequestError("trailing bytes"));
        }
        Ok(StoredRequest { method, path_and_query, headers, body })
    }

    /// The request head to forward, rebuilt. Invalid stored parts are an
    /// error, never a panic (the row may have been edited by hand).
    pub fn parts(&self) -> Result<request::Parts, StoredRequestError> {
        let method = Method::from_bytes(self.method.as_bytes()).map_err(|_| StoredRequestError("invalid method"))?;
        let mut req = http::Request::builder().method(method).uri(self.path_and_query.as_str());
        for (n, v) in &self.headers {
            let name = HeaderName::from_bytes(n.as_bytes()).map_err(|_| StoredRequestError("invalid header name"))?;
            let value = HeaderValue::from_bytes(v).map_err(|_| StoredRequestError("invalid header value"))?;
            req = req.header(name, value);
        }
        req.body(()).map(|r| r.into_parts().0).map_err(|_| StoredRequestError("invalid request"))
    }
}

fn put(out: &mut Vec<u8>, b: &[u8]) {
    // Lengths come from a request that fit in memory and the body limit.
    out.extend_from_slice(&u32::try_from(b.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(&b[..b.len().min(u32::MAX as usize)]);
}

fn fixed(rest: &mut &[u8]) -> Result<[u8; 4], StoredRequestError> {
    let (head, tail) = rest.split_at_checked(4).ok_or(StoredRequestError("truncated"))?;
    *rest = tail;
    head.try_into().map_err(|_| StoredRequestError("truncated"))
}

fn take<'a>(rest: &mut &'a [u8]) -> Result<&'a [u8], StoredRequestError> {
    let n = u32::from_be_bytes(fixed(rest)?) as usize;
    let (head, tail) = rest.split_at_checked(n).ok_or(StoredRequestError("truncated"))?;
    *rest = tail;
    Ok(head)
}

/// The state a client sees; `in_flight` never appears (it is synchronous).
pub fn client_state(state: State) -> &'static str {
    state.as_str()
}

/// Whether the operation can still change (the answer carries `Retry-After`).
pub fn is_pending(state: State) -> bool {
    matches!(state, State::Queued | State::Processing | State::InFlight)
}

/// The status document of an operation, as answered to its 202 and to polls.
/// `retention_s` is `null` for a route that keeps its records forever.
pub fn status_document(record: &Record, poll_interval: Duration, retention: Retention) -> serde_json::Value {
    let id = record.operation_id.as_deref().unwrap_or_default();
    let result = match (&record.state, &record.response) {
        (State::Completed, Some(resp)) => json!({ "status": resp.status, "href": format!("{OPERATIONS_PATH}{id}/result") }),
        _ => serde_json::Value::Null,
    };
    let mut doc = json!({
        "id": id,
        "operation": &*record.scope.operation,
        "state": client_state(record.state),
        "attempts": record.attempts,
        "created_at": record.created_at.to_string(),
        "updated_at": record.updated_at.to_string(),
        "result": result,
        "poll_interval_s": poll_interval.as_secs().max(1),
        "retention_s": retention.finite().map(|d| d.as_secs()),
    });
    if record.state == State::FailedRetryable {
        doc["last_status"] = json!(record.last_status);
    }
    doc
}

/// What a synchronous claim keeps for the reconciler: on a route whose probe
/// uses path parameters, the request line (method, path and query, encoded
/// as a [`StoredRequest`] without headers or body). `None` elsewhere: nothing
/// extra is written.
pub fn request_head(route: &Route, parts: &request::Parts) -> Option<Bytes> {
    route.background.reconcile.as_ref().filter(|p| p.target.uses_params())?;
    let head = StoredRequest {
        method: parts.method.as_str().to_owned(),
        path_and_query: parts.uri.path_and_query().map_or("/", |pq| pq.as_str()).to_owned(),
        headers: Vec::new(),
        body: Bytes::new(),
    };
    Some(head.encode().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_requests_round_trip_and_reject_garbage() {
        let req = StoredRequest {
            method: "POST".into(),
            path_and_query: "/v1/orders?x=1".into(),
            headers: vec![("content-type".into(), b"application/json".to_vec()), ("x-bin".into(), vec![0xff, b'a'])],
            body: Bytes::from_static(b"{\"a\":1}"),
        };
        let enc = req.encode();
        assert_eq!(StoredRequest::decode(&enc).unwrap(), req);
        for cut in 0..enc.len() {
            assert!(StoredRequest::decode(&enc[..cut]).is_err(), "truncated at {cut}");
        }
        let mut extra = enc.clone();
        extra.push(0);
        assert!(StoredRequest::decode(&extra).is_err());
        assert!(StoredRequest::decode(&[2]).is_err());
        // A stored header value that is not a valid header fails to rebuild, without a panic.
        let bad = StoredRequest { headers: vec![("x".into(), b"a\nb".to_vec())], ..req.clone() };
        assert!(bad.parts().is_err());
        let parts = req.parts().unwrap();
        assert_eq!((parts.method.as_str(), parts.uri.to_string().as_str()), ("POST", "/v1/orders?x=1"));
    }

    #[test]
    fn capture_leaves_out_hop_by_hop_headers() {
        let (parts, ()) = http::Request::post("/v1/orders?q=1")
            .header("connection", "x-conn-only")
            .header("x-conn-only", "1")
            .header("te", "trailers")
            .header("authorization", "Bearer k")
            .body(())
            .unwrap()
            .into_parts();
        let stored = StoredRequest::capture(&parts, &Bytes::from_static(b"b"));
        let names: Vec<&str> = stored.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, vec!["authorization"]);
        assert_eq!(stored.path_and_query, "/v1/orders?q=1");
    }

    #[test]
    fn prefer_respond_async() {
        let mut h = HeaderMap::new();
        assert!(!prefers_async(&h));
        h.insert("prefer", HeaderValue::from_static("return=minimal, Respond-Async; wait=10"));
        assert!(prefers_async(&h));
        h.insert("prefer", HeaderValue::from_static("respond-asynchronously"));
        assert!(!prefers_async(&h));
    }

    #[test]
    fn operation_ids_are_url_safe_and_distinct() {
        let (a, b) = (new_operation_id(), new_operation_id());
        assert_ne!(a, b);
        assert!(a.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_'), "{a}");
        assert_eq!(a.len(), 35);
    }
}
