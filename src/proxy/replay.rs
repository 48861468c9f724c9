//! Answers from a record: the stored status, headers and body, marked with
//! `Idempotent-Replayed: true`.

use http::{HeaderName, HeaderValue, Response, StatusCode};

use crate::idempotency::record::StoredResponse;
use crate::problem::GatewayError;
use crate::upstream::body::Body;
use crate::upstream::headers::{IDEMPOTENT_REPLAYED, is_unreplayable};

/// Builds the replay of a stored response. Headers that must never be
/// replayed are filtered here too (a record may have been completed by hand),
/// and `Content-Length` is left to be recomputed from the body.
pub fn replay(stored: &StoredResponse) -> Result<Response<Body>, GatewayError> {
    let Some(body) = &stored.body else {
        return Err(GatewayError::ResponseNotStored { original_status: stored.status });
    };
    let status = StatusCode::from_u16(stored.status).map_err(|_| GatewayError::Internal)?;
    let mut resp = Response::new(Body::full(body.clone()));
    *resp.status_mut() = status;
    let headers = resp.headers_mut();
    for (name, value) in &stored.headers {
        let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_bytes(value)) else {
            continue;
        };
        if !is_unreplayable(&name, &[]) {
            headers.append(name, value);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn replays_status_headers_body_without_forbidden_headers() {
        let stored = StoredResponse {
            status: 201,
            headers: vec![
                ("content-type".into(), b"application/json".to_vec()),
                ("set-cookie".into(), b"s=1".to_vec()),
                ("date".into(), b"yesterday".to_vec()),
                ("transfer-encoding".into(), b"chunked".to_vec()),
                ("content-length".into(), b"999".to_vec()),
                ("location".into(), b"/v1/orders/7".to_vec()),
            ],
            body: Some(Bytes::from_static(b"{\"id\":7}")),
        };
        let resp = replay(&stored).unwrap();
        assert_eq!(resp.status(), 201);
        let h = resp.headers();
        assert_eq!(h["idempotent-replayed"], "true");
        assert_eq!(h["location"], "/v1/orders/7");
        for gone in ["set-cookie", "date", "transfer-encoding", "content-length"] {
            assert!(!h.contains_key(gone), "{gone} replayed");
        }
        assert_eq!(resp.into_body().collect().await.unwrap().to_bytes(), Bytes::from_static(b"{\"id\":7}"));
    }

    #[test]
    fn unstored_body_is_a_problem_naming_the_status() {
        let stored = StoredResponse { status: 200, headers: vec![], body: None };
        assert!(matches!(replay(&stored), Err(GatewayError::ResponseNotStored { original_status: 200 })));
    }
}
