//! `GET /admin/records/{scope}/inspect`: one record as the console's record
//! page shows it. Unlike `GET /admin/records/{scope}` it carries the stored
//! response body (as text, or base64 when it is not UTF-8; the console shows
//! either as text, never as HTML), the stored request's method, path and
//! headers (credentials masked, in headers and query parameters; body size only), the async attempt fields,
//! the reconciler's probes of this generation, and the scope's audit rows.

use base64::Engine as _;
use serde_json::{Value, json};

use super::mask;
use crate::idempotency::record::{Record, State};
use crate::ops::keys;
use crate::request::async_op::StoredRequest;
use crate::store::Inspection;

/// How many audit rows of the scope the page lists.
pub const AUDIT_ROWS: u32 = 100;
/// The largest response body the page carries; longer ones are cut (and say so).
pub const MAX_BODY_SHOWN: usize = 256 * 1024;

/// The page's document.
/// `credentials`: the headers the identity sources read credentials from;
/// `masked_params`: query parameters masked besides the built-in ones.
pub fn json(i: &Inspection, secret: Option<&[u8]>, credentials: &[http::HeaderName], masked_params: &[String]) -> Value {
    let r = &i.record;
    let mut record = keys::record_json(r, false, secret);
    if let Some(resp) = &r.response {
        record["response"]["headers"] = mask::headers_json(&resp.headers, credentials);
        record["response"]["body"] = match &resp.body {
            Some(b) => body_json(b),
            None => Value::Null,
        };
    }
    let request = i.request.as_deref().map(|bytes| match StoredRequest::decode(bytes) {
        Ok(req) => json!({
            "method": req.method,
            "path": mask::path_and_query(&req.path_and_query, masked_params),
            "headers": mask::headers_json(&req.headers, credentials),
            // A sync record keeps the request line only (for its probe).
            "headers_stored": !req.headers.is_empty() || r.operation_id.is_some(),
            "body_bytes": req.body.len(),
        }),
        Err(e) => json!({ "error": e.to_string() }),
    });
    json!({
        "record": record,
        "now": i.now.to_string(),
        "attempts": r.attempts,
        "sent_at": r.sent_at.map(|t| t.to_string()),
        "next_attempt_at": r.next_attempt_at.map(|t| t.to_string()),
        "last_status": r.last_status,
        "maybe_executed": r.maybe_executed,
        "may_have_executed": may_have_executed(r),
        "sent_at_shown": sent_at_shown(r),
        "lease_left_seconds": r.lease_expires_at.map(|l| i.now.until(l).as_secs_f64()),
        "probe": {
            "attempts": i.probe_attempts,
            "next_probe_at": i.next_probe_at.map(|t| t.to_string()),
            "last_answer": i.probe_last_answer,
        },
        "request": request,
        "audit": i.audit.iter().map(keys::audit_json).collect::<Vec<_>>(),
    })
}

/// Whether the upstream may have executed the record's request, in the
/// words the record page shows an operator deciding how to resolve it. The
/// stored `maybe_executed` flag only says that an earlier async attempt's
/// answer was lost; the state says more (an `unknown` record is exactly one
/// that may have executed).
fn may_have_executed(r: &Record) -> &'static str {
    match r.state {
        State::Unknown => "yes: its outcome is unknown (the request may have reached the upstream)",
        State::InFlight => "possibly: it is being forwarded now",
        State::Completed => "yes: completed",
        State::Processing if r.sent_at.is_some() => "possibly: this attempt was sent",
        State::Queued | State::Processing | State::FailedRetryable if r.maybe_executed => "yes: an earlier attempt's answer was lost",
        State::Queued | State::Processing | State::FailedRetryable => "no",
    }
}

/// The send time as the page shows it: async attempts record it, a
/// synchronous request does not (it is sent right after its claim).
fn sent_at_shown(r: &Record) -> String {
    match (r.sent_at, &r.operation_id) {
        (Some(t), _) => t.to_string(),
        (None, Some(_)) => "not sent by the current attempt".to_owned(),
        (None, None) => "not recorded for synchronous requests".to_owned(),
    }
}

/// A stored body: UTF-8 text, or base64; at most [`MAX_BODY_SHOWN`] bytes.
fn body_json(b: &[u8]) -> Value {
    match std::str::from_utf8(b) {
        Ok(text) => {
            let mut end = text.len().min(MAX_BODY_SHOWN);
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            json!({ "text": &text[..end], "bytes": b.len(), "truncated": end < text.len() })
        }
        Err(_) => {
            let shown = &b[..b.len().min(MAX_BODY_SHOWN)];
            let encoded = base64::engine::general_purpose::STANDARD.encode(shown);
            json!({ "base64": encoded, "bytes": b.len(), "truncated": shown.len() < b.len() })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_are_text_or_base64_and_capped() {
        assert_eq!(body_json(b"<script>x</script>"), json!({ "text": "<script>x</script>", "bytes": 18, "truncated": false }));
        assert_eq!(body_json(&[0xff, 0x00]), json!({ "base64": "/wA=", "bytes": 2, "truncated": false }));
        let big = vec![b'a'; MAX_BODY_SHOWN + 10];
        let j = body_json(&big);
        assert_eq!((j["text"].as_str().unwrap().len(), j["truncated"].as_bool()), (MAX_BODY_SHOWN, Some(true)));
    }
}
