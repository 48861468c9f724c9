//! Requests without idempotency: other methods on a route's path, routes
//! whose key is optional and absent, unmatched paths to the default upstream.
//! Streamed both ways; nothing is read whole, nothing is recorded.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use http::{Request, Response, request};
use hyper::body::Incoming;

use crate::problem::{self, GatewayError};
use crate::upstream::body::Body;
use crate::upstream::headers::{self, strip_hop_by_hop};
use crate::upstream::{Upstream, UpstreamError, error_chain};

/// Proxies `req` to `upstream`; upstream failures become 502/504 problems.
pub async fn pass_through(upstream: &Upstream, req: Request<Incoming>, request_body_timeout: std::time::Duration) -> Response<Body> {
    try_pass_through(upstream, req, request_body_timeout, None).await.unwrap_or_else(|e| problem::response(&e))
}

/// [`pass_through`], with an upstream failure as the error it is answered with
/// (so the caller can name the request in the problem and count it); the
/// request body's bytes are added to `bytes_in` as they stream.
pub async fn try_pass_through(
    upstream: &Upstream,
    req: Request<Incoming>,
    request_body_timeout: std::time::Duration,
    bytes_in: Option<Arc<AtomicU64>>,
) -> Result<Response<Body>, GatewayError> {
    let (parts, body) = req.into_parts();
    let body = match bytes_in {
        Some(counted) => Body::stream_counted(body, request_body_timeout, counted),
        None => Body::stream(body, request_body_timeout),
    };
    try_forward(upstream, parts, body).await
}

/// Proxies a request whose body is already at hand (read to find its key
/// or fingerprint) or streamed; the answer is streamed back.
pub async fn forward(upstream: &Upstream, parts: request::Parts, body: Body) -> Response<Body> {
    try_forward(upstream, parts, body).await.unwrap_or_else(|e| problem::response(&e))
}

/// [`forward`], with an upstream failure as an error.
pub async fn try_forward(upstream: &Upstream, parts: request::Parts, body: Body) -> Result<Response<Body>, GatewayError> {
    let deadline = tokio::time::Instant::now() + upstream.config.timeout;
    let sent = match upstream.request(parts, body, None) {
        Ok(req) => upstream.send(req, deadline).await,
        Err(e) => Err(e),
    };
    match sent {
        Ok(resp) => {
            let (mut head, body) = resp.into_parts();
            strip_hop_by_hop(&mut head.headers);
            head.headers.remove(headers::IDEMPOTENCY_POLICY);
            Ok(Response::from_parts(head, Body::stream(body, upstream.config.timeout)))
        }
        Err(e) => Err(failure(upstream, &e)),
    }
}

/// The answer to a pass-through whose upstream failed: 504 on a timeout, else 502.
pub fn failed(upstream: &Upstream, e: &UpstreamError) -> Response<Body> {
    problem::response(&failure(upstream, e))
}

/// Why a pass-through whose upstream failed is refused (logged here): 504 on
/// a timeout, else 502.
fn failure(upstream: &Upstream, e: &UpstreamError) -> GatewayError {
    tracing::warn!(upstream = upstream.name(), error = %error_chain(e), "pass-through failed");
    match e {
        UpstreamError::Timeout { .. } => GatewayError::GatewayTimeout,
        _ => GatewayError::BadGateway,
    }
}
