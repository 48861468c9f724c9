//! The admin listener: `/healthz` (process up), `/readyz` (store reachable),
//! `/metrics` (Prometheus). Health and metrics need no token; the token is
//! reserved for the admin API that mirrors `idemgate keys`.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;

use crate::body::Body;
use crate::config::Secret;
use crate::metrics::Metrics;
use crate::store::Store;

/// How long `/readyz` waits for the store. Shorter than the operation
/// timeout: a load balancer or orchestrator should learn within about a second
/// that the primary is gone (PostgreSQL: `/readyz` also answers 503 while the
/// only server reachable is a standby).
const READY_BOUND: Duration = Duration::from_secs(1);

pub struct Admin {
    store: Store,
    metrics: Arc<Metrics>,
    /// Bearer token for future admin API endpoints.
    _token: Option<Secret>,
}

impl Admin {
    pub fn new(store: Store, metrics: Arc<Metrics>, token: Option<Secret>) -> Admin {
        Admin { store, metrics, _token: token }
    }

    pub async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        }
        match req.uri().path() {
            "/healthz" => text(StatusCode::OK, "ok\n"),
            "/readyz" => match tokio::time::timeout(READY_BOUND, self.store.ping()).await {
                Ok(Ok(())) => text(StatusCode::OK, "ready\n"),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "readiness check failed");
                    text(StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n")
                }
                Err(_) => {
                    tracing::warn!(bound = ?READY_BOUND, "readiness check failed: the store did not answer in time");
                    text(StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n")
                }
            },
            "/metrics" => {
                let mut r = Response::new(Body::full(self.metrics.encode()));
                r.headers_mut()
                    .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"));
                r
            }
            _ => text(StatusCode::NOT_FOUND, "not found\n"),
        }
    }
}

fn text(status: StatusCode, body: &'static str) -> Response<Body> {
    let mut r = Response::new(Body::full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    r
}
