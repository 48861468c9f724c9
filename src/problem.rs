//! Every way a request can end other than with an upstream's (or a stored)
//! response, and the one renderer of an RFC 9457 problem ([`Problem`]),
//! which the admin API's errors go through too.
//!
//! `detail` texts are written here, for clients: they never carry internal
//! error text, secrets, or another scope's data. Internal causes go to logs.

use std::time::Duration;

use http::{HeaderValue, Response, StatusCode, header};

use crate::idempotency::key::KeyError;
use crate::idempotency::outcome::RequestOutcome;
use crate::upstream::body::Body;

/// Why idempotent handling ended without an upstream or stored response.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The method or path is spelled in a way the gateway refuses to route
    /// (see `crate::request::route::normal`).
    #[error("invalid request: {0}")]
    InvalidRequest(crate::request::route::InvalidRequest),
    #[error("no identity source matched")]
    Unauthenticated,
    /// `header` says where the key was looked for ("the idempotency-key header").
    #[error("missing idempotency key ({header})")]
    MissingKey { header: String },
    #[error("invalid idempotency key: {0}")]
    InvalidKey(KeyError),
    #[error("request body larger than {limit} bytes")]
    BodyTooLarge { limit: u64 },
    #[error("request body not received within {0:?}")]
    BodyTimeout(Duration),
    #[error("request body could not be read")]
    BodyRead,
    #[error("invalid request body: {0}")]
    InvalidBody(String),
    /// A body with a `Content-Encoding`: idemgate would compare and inspect
    /// the encoded bytes, not what the upstream decodes (RFC 7694: 415).
    #[error("request body with a content coding")]
    ContentEncoded,
    /// A transfer coding besides `chunked`: its bytes would reach the
    /// upstream undecoded and unlabelled (RFC 9112, section 6.1: 501).
    #[error("request with a transfer coding other than chunked")]
    TransferCoded,
    #[error("store unavailable")]
    StoreUnavailable,
    /// The upstream was not reached; the key was released.
    #[error("upstream unavailable (request not sent)")]
    UpstreamUnavailable,
    /// First request: timed out or broke after it was sent.
    #[error("upstream outcome unknown")]
    OutcomeUnknown,
    /// Retry of a request whose record is `unknown` (or whose lease expired).
    #[error("record outcome unknown")]
    RecordUnknown,
    #[error("idempotency key reused with a different request")]
    KeyReused { status: StatusCode },
    #[error("request with this key in progress")]
    InProgress { retry_after: Duration },
    /// Completed, but the body exceeded `max_stored_response`.
    #[error("stored response has no body")]
    ResponseNotStored { original_status: u16 },
    #[error("no route")]
    NotFound,
    /// The route's authorizer said no (401 or 403).
    #[error("forbidden")]
    Forbidden,
    /// The route's authorizer could not be asked: fail closed.
    #[error("authorizer unavailable")]
    AuthorizerUnavailable,
    /// Async: the operation's result was asked for before it completed.
    #[error("operation not completed")]
    OperationNotCompleted { state: crate::idempotency::record::State, retry_after: Duration },
    /// Admission under overload: the upstream's (or the route's) limit of
    /// requests in flight, or an async route's queue bound, was reached.
    /// Refused before the claim: nothing claimed, nothing forwarded.
    #[error("overloaded")]
    Overloaded,
    /// Pass-through only: the upstream failed (no record is involved).
    #[error("bad gateway")]
    BadGateway,
    #[error("gateway timeout")]
    GatewayTimeout,
    #[error("internal error")]
    Internal,
}

/// The fixed parts of one problem type.
struct Kind {
    name: &'static str,
    title: &'static str,
    status: StatusCode,
    retryable: bool,
}

impl GatewayError {
    fn kind(&self) -> Kind {
        use GatewayError as E;
        let k = |name, title, status, retryable| Kind { name, title, status, retryable };
        match self {
            E::InvalidRequest(_) => k("invalid-request", "Invalid request", StatusCode::BAD_REQUEST, false),
            E::Unauthenticated => k("unauthenticated", "Unauthenticated", StatusCode::UNAUTHORIZED, false),
            E::MissingKey { .. } => k("missing-idempotency-key", "Missing idempotency key", StatusCode::BAD_REQUEST, false),
            E::InvalidKey(_) => k("invalid-idempotency-key", "Invalid idempotency key", StatusCode::BAD_REQUEST, false),
            E::BodyTooLarge { .. } => k("request-too-large", "Request body too large", StatusCode::PAYLOAD_TOO_LARGE, false),
            E::BodyTimeout(_) => k("request-timeout", "Request body not received in time", StatusCode::REQUEST_TIMEOUT, true),
            E::BodyRead => k("invalid-body", "Request body could not be read", StatusCode::BAD_REQUEST, false),
            E::InvalidBody(_) => k("invalid-body", "Invalid request body", StatusCode::BAD_REQUEST, false),
            E::ContentEncoded => {
                k("unsupported-content-encoding", "Content encoding not accepted", StatusCode::UNSUPPORTED_MEDIA_TYPE, false)
            }
            E::TransferCoded => k("unsupported-transfer-coding", "Transfer coding not implemented", StatusCode::NOT_IMPLEMENTED, false),
            E::StoreUnavailable => k("store-unavailable", "Idempotency store unavailable", StatusCode::SERVICE_UNAVAILABLE, true),
            E::UpstreamUnavailable => k("upstream-unavailable", "Upstream unavailable", StatusCode::SERVICE_UNAVAILABLE, true),
            E::OutcomeUnknown => k("outcome-unknown", "Outcome unknown", StatusCode::GATEWAY_TIMEOUT, false),
            E::RecordUnknown => k("outcome-unknown", "Outcome unknown", StatusCode::CONFLICT, false),
            E::KeyReused { status } => k("idempotency-key-reused", "Idempotency key reused", *status, false),
            E::InProgress { .. } => k("request-in-progress", "Request in progress", StatusCode::CONFLICT, true),
            E::ResponseNotStored { .. } => k("response-not-stored", "Response not stored", StatusCode::CONFLICT, false),
            E::NotFound => k("not-found", "Not found", StatusCode::NOT_FOUND, false),
            E::Forbidden => k("forbidden", "Forbidden", StatusCode::FORBIDDEN, false),
            E::AuthorizerUnavailable => k("authorizer-unavailable", "Authorizer unavailable", StatusCode::SERVICE_UNAVAILABLE, true),
            E::OperationNotCompleted { state, .. } => {
                k("operation-not-completed", "Operation not completed", StatusCode::CONFLICT, crate::request::async_op::is_pending(*state))
            }
            E::Overloaded => k("overloaded", "Overloaded", StatusCode::SERVICE_UNAVAILABLE, true),
            E::BadGateway => k("bad-gateway", "Bad gateway", StatusCode::BAD_GATEWAY, true),
            E::GatewayTimeout => k("gateway-timeout", "Gateway timeout", StatusCode::GATEWAY_TIMEOUT, true),
            E::Internal => k("internal", "Internal error", StatusCode::INTERNAL_SERVER_ERROR, false),
        }
    }

    fn detail(&self) -> String {
        use GatewayError as E;
        match self {
            E::InvalidRequest(why) => {
                format!("{why}. The request was not routed or forwarded; send the path in normal form (see the gateway's reference).")
            }
            E::Unauthenticated => "No identity source recognised this request; idempotent routes need a known API key or trusted identity headers.".into(),
            E::MissingKey { header } => format!("This operation requires an idempotency key in {header}."),
            E::InvalidKey(e) => format!("{e}; a key is 1-255 bytes of visible ASCII, optionally as a quoted structured-field string."),
            E::BodyTooLarge { limit } => format!("The request body exceeds the limit of {limit} bytes; the key was not used."),
            E::BodyTimeout(d) => format!("The request body was not received within {}; the key was not used.", humantime::format_duration(*d)),
            E::BodyRead => "The request body could not be read; the key was not used.".into(),
            E::InvalidBody(why) => format!("{why}; the key was not used."),
            E::ContentEncoded => "The request body has a Content-Encoding. This gateway compares and inspects request bodies as they are sent, so it accepts them here only unencoded; send the body without Content-Encoding. The key was not used.".into(),
            E::TransferCoded => "The request has a Transfer-Encoding other than chunked, which this gateway does not decode. Send the body with chunked or with a Content-Length.".into(),
            E::StoreUnavailable => "The idempotency store could not be reached, so the request was not forwarded. Retry with the same key.".into(),
            E::UpstreamUnavailable => "The upstream could not be reached and did not receive the request. The key was released; retry with the same key.".into(),
            E::OutcomeUnknown => "The request was sent to the upstream but no complete response arrived in time. It may have been executed; the key is held as unknown until an operator reconciles it.".into(),
            E::RecordUnknown => "An earlier request with this key may have been executed but its outcome is unknown. The key is held until an operator reconciles it.".into(),
            E::KeyReused { .. } => "This idempotency key was already used with a different request. Use a new key for a new request.".into(),
            E::InProgress { .. } => "A request with this idempotency key is still being processed. Retry after the indicated time.".into(),
            E::ResponseNotStored { original_status } => format!("The request with this key completed with status {original_status}, but its response was too large to store, so it cannot be replayed."),
            E::NotFound => "No route matches this request.".into(),
            E::Forbidden => "The authorizer does not allow this request for this principal.".into(),
            E::AuthorizerUnavailable => "The authorizer could not be asked, so the request was refused. Retry later.".into(),
            E::OperationNotCompleted { state, .. } => format!(
                "The operation is {}; its result can be read once it is completed. Poll the operation for its state.",
                state.as_str()
            ),
            E::Overloaded => "The upstream has as many requests in flight as it can take; this one was not claimed or forwarded. Retry with the same key after the indicated time.".into(),
            E::BadGateway => "The upstream could not be reached or failed.".into(),
            E::GatewayTimeout => "The upstream did not answer in time.".into(),
            E::Internal => "The gateway failed unexpectedly.".into(),
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            GatewayError::InProgress { retry_after } => Some(*retry_after),
            GatewayError::OperationNotCompleted { state, retry_after } if crate::request::async_op::is_pending(*state) => {
                Some(*retry_after)
            }
            GatewayError::StoreUnavailable | GatewayError::UpstreamUnavailable | GatewayError::AuthorizerUnavailable => {
                Some(Duration::from_secs(1))
            }
            GatewayError::Overloaded => Some(crate::upstream::limit::RETRY_AFTER),
            _ => None,
        }
    }

    /// How the request counts in `idemgate_requests_total`.
    pub fn outcome(&self) -> RequestOutcome {
        use GatewayError as E;
        match self {
            E::InvalidRequest(_)
            | E::Unauthenticated
            | E::MissingKey { .. }
            | E::InvalidKey(_)
            | E::BodyTooLarge { .. }
            | E::BodyTimeout(_)
            | E::BodyRead
            | E::InvalidBody(_)
            | E::ContentEncoded
            | E::TransferCoded
            | E::NotFound
            | E::Forbidden
            | E::AuthorizerUnavailable
            | E::OperationNotCompleted { .. } => RequestOutcome::Rejected,
            E::StoreUnavailable | E::Internal => RequestOutcome::StoreUnavailable,
            E::UpstreamUnavailable => RequestOutcome::Released,
            E::OutcomeUnknown | E::RecordUnknown => RequestOutcome::Unknown,
            E::KeyReused { .. } => RequestOutcome::Mismatch,
            E::InProgress { .. } => RequestOutcome::InFlight,
            E::Overloaded => RequestOutcome::Overloaded,
            E::ResponseNotStored { .. } => RequestOutcome::Replayed,
            E::BadGateway | E::GatewayTimeout => RequestOutcome::PassThrough,
        }
    }

    /// The problem type URI's last part, e.g. `request-in-progress`.
    pub fn type_name(&self) -> &'static str {
        self.kind().name
    }
}

/// The one place an error becomes a response.
pub fn response(err: &GatewayError) -> Response<Body> {
    response_with_instance(err, None)
}

/// [`response`] with the problem's `instance`: the URI of this occurrence
/// (the request path uses `urn:idemgate:request:<request id>`, so a client's
/// report names the access-log line).
pub fn response_with_instance(err: &GatewayError, instance: Option<&str>) -> Response<Body> {
    let kind = err.kind();
    let problem = Problem {
        name: kind.name,
        title: kind.title,
        status: kind.status,
        detail: err.detail(),
        retryable: kind.retryable,
        retry_after: err.retry_after(),
        instance,
        original_status: match err {
            GatewayError::ResponseNotStored { original_status } => Some(*original_status),
            _ => None,
        },
    };
    let mut resp = problem.response();
    if matches!(err, GatewayError::ResponseNotStored { .. }) {
        resp.headers_mut().insert(crate::upstream::headers::IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    if matches!(err, GatewayError::ContentEncoded) {
        // RFC 7694, section 3: the codings a request may use.
        resp.headers_mut().insert(header::ACCEPT_ENCODING, HeaderValue::from_static("identity"));
    }
    resp
}

/// An RFC 9457 problem document: `urn:idemgate:problem:<name>`, with
/// `retryable`, and `Retry-After` when a retry should wait.
#[derive(Debug)]
pub struct Problem<'a> {
    /// The problem type's last part, e.g. `request-in-progress`.
    pub name: &'static str,
    pub title: &'static str,
    pub status: StatusCode,
    /// Written for clients: never internal error text or secrets.
    pub detail: String,
    pub retryable: bool,
    pub retry_after: Option<Duration>,
    /// The URI of this occurrence.
    pub instance: Option<&'a str>,
    /// `response-not-stored`: the status the upstream answered with.
    pub original_status: Option<u16>,
}

impl Problem<'_> {
    /// The one place a problem becomes a response.
    pub fn response(&self) -> Response<Body> {
        let mut body = serde_json::json!({
            "type": format!("urn:idemgate:problem:{}", self.name),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
            "retryable": self.retryable,
        });
        if let Some(instance) = self.instance {
            body["instance"] = serde_json::json!(instance);
        }
        if let Some(original_status) = self.original_status {
            body["original_status"] = serde_json::json!(original_status);
        }
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        let mut resp = Response::new(Body::full(bytes));
        *resp.status_mut() = self.status;
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(after) = self.retry_after {
            let secs = after.as_secs_f64().ceil().max(1.0) as u64;
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    async fn json(resp: Response<Body>) -> serde_json::Value {
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[tokio::test]
    async fn problems_are_rfc9457_with_retryable_and_retry_after() {
        let r = response(&GatewayError::InProgress { retry_after: Duration::from_millis(300) });
        assert_eq!(r.status(), StatusCode::CONFLICT);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/problem+json");
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        let v = json(r).await;
        assert_eq!(v["type"], "urn:idemgate:problem:request-in-progress");
        assert_eq!(v["status"], 409);
        assert_eq!(v["retryable"], true);
        assert!(v["title"].is_string() && v["detail"].is_string());

        let r = response(&GatewayError::KeyReused { status: StatusCode::UNPROCESSABLE_ENTITY });
        assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert!(r.headers().get(header::RETRY_AFTER).is_none());
        assert_eq!(json(r).await["retryable"], false);

        let r = response(&GatewayError::StoreUnavailable);
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(r.headers().contains_key(header::RETRY_AFTER));
        assert_eq!(json(r).await["retryable"], true);

        // The three 409s are told apart by type alone.
        let types: Vec<&str> = [
            GatewayError::InProgress { retry_after: Duration::ZERO },
            GatewayError::RecordUnknown,
            GatewayError::KeyReused { status: StatusCode::CONFLICT },
        ]
        .iter()
        .map(|e| e.type_name())
        .collect();
        assert_eq!(types, vec!["request-in-progress", "outcome-unknown", "idempotency-key-reused"]);
    }

    #[tokio::test]
    async fn instance_is_included_when_given() {
        let v = json(response_with_instance(&GatewayError::NotFound, Some("urn:idemgate:request:abc"))).await;
        assert_eq!(v["instance"], "urn:idemgate:request:abc");
        assert!(json(response(&GatewayError::NotFound)).await.get("instance").is_none());
    }

    #[test]
    fn every_rejection_has_a_declared_reason() {
        let rejections = [
            GatewayError::InvalidRequest(crate::request::route::InvalidRequest::DotSegment),
            GatewayError::Unauthenticated,
            GatewayError::MissingKey { header: "k".into() },
            GatewayError::InvalidKey(KeyError::Empty),
            GatewayError::BodyTooLarge { limit: 1 },
            GatewayError::BodyTimeout(Duration::ZERO),
            GatewayError::BodyRead,
            GatewayError::InvalidBody("x".into()),
            GatewayError::NotFound,
            GatewayError::Forbidden,
            GatewayError::AuthorizerUnavailable,
            GatewayError::OperationNotCompleted { state: crate::idempotency::record::State::Queued, retry_after: Duration::ZERO },
        ];
        for e in &rejections {
            assert_eq!(e.outcome(), RequestOutcome::Rejected, "{e}");
            assert!(crate::telemetry::metrics::REJECTION_REASONS.contains(&e.type_name()), "{e}: {}", e.type_name());
        }
    }
}
