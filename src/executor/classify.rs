//! The response classifier: what the upstream's answer to an attempt, or its
//! failure, means for the attempt's record, before anything is recorded.
//! The executor (enforcing, synchronous and async) and observe mode classify
//! by these same functions, so a change to a rule here changes what both
//! modes record (and what observe mode reports enforcing would have done).

use http::StatusCode;

use crate::upstream::UpstreamError;
use crate::upstream::headers::{self, strip_hop_by_hop};

/// How an attempt's exchange with the upstream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// The upstream answered, and the answer is to be recorded.
    Answered,
    /// The upstream answered but declined recording: a `release_on_status`
    /// status, or `Idempotency-Policy: no-store` (`no_store`).
    Declined { no_store: bool },
    /// The request never left idemgate: nothing can have executed.
    NotSent,
    /// The request was sent and its answer is lost: it may have executed.
    MaybeExecuted,
}

/// What a synchronous attempt writes for each class: enforcing's record,
/// and the history observe mode leaves for enforcing to find later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncWrite {
    /// `completed`, with the answer.
    Complete,
    /// The key is freed.
    Release,
    /// `unknown`.
    MarkUnknown,
}

impl Class {
    pub fn sync_write(self) -> SyncWrite {
        match self {
            Class::Answered => SyncWrite::Complete,
            Class::Declined { .. } | Class::NotSent => SyncWrite::Release,
            Class::MaybeExecuted => SyncWrite::MarkUnknown,
        }
    }
}

/// Classifies an answer by its head, made ready to forward on the way:
/// hop-by-hop headers and `Idempotency-Policy` are removed (the client never
/// sees the latter), and so are the headers idemgate itself speaks
/// (`Idempotency-Key`, `X-Idempotency-Generation`, `Idempotent-Replayed`): an
/// upstream that echoes them would show the client the derived key and the
/// attempt's generation, or mark a first answer as a replay. A
/// `Content-Length` sent beside `Transfer-Encoding` goes too
/// ([`strip_hop_by_hop`]). `Answered` until the body says otherwise: a
/// body that fails mid-read is [`failure`]'s to classify.
pub fn head(release_on_status: &[StatusCode], head: &mut http::response::Parts) -> Class {
    strip_hop_by_hop(&mut head.headers);
    // Every line of it: an upstream may send the directive on a second one.
    let no_store = head
        .headers
        .get_all(headers::IDEMPOTENCY_POLICY)
        .iter()
        .any(|v| v.to_str().is_ok_and(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case("no-store"))));
    headers::strip_ours(&mut head.headers);
    if no_store || release_on_status.contains(&head.status) { Class::Declined { no_store } } else { Class::Answered }
}

/// Classifies a failed exchange by the error's typed fact: never sent, or
/// may have executed.
pub fn failure(e: &UpstreamError) -> Class {
    if e.may_have_executed() { Class::MaybeExecuted } else { Class::NotSent }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::telemetry::metrics::UpstreamErrorKind;

    fn answer(status: u16, policy: Option<&str>) -> http::response::Parts {
        let mut b = http::Response::builder().status(status).header("connection", "close");
        if let Some(p) = policy {
            b = b.header(headers::IDEMPOTENCY_POLICY, p);
        }
        b.body(()).unwrap().into_parts().0
    }

    /// The rules both modes record by, one table: enforcing's executor
    /// (`Executor::exchange`) and observe mode (`observe::forward`) classify
    /// every exchange by `head` and `failure`, and observe mode writes by
    /// `sync_write`; changing a row here changes both modes.
    #[test]
    fn one_classification_for_enforce_and_observe() {
        let release_on_status = [StatusCode::CONFLICT, StatusCode::SERVICE_UNAVAILABLE];
        for (status, policy, class, write) in [
            (200, None, Class::Answered, SyncWrite::Complete),
            (201, None, Class::Answered, SyncWrite::Complete),
            (422, None, Class::Answered, SyncWrite::Complete),
            (500, None, Class::Answered, SyncWrite::Complete),
            (502, None, Class::Answered, SyncWrite::Complete),
            (409, None, Class::Declined { no_store: false }, SyncWrite::Release),
            (503, None, Class::Declined { no_store: false }, SyncWrite::Release),
            (200, Some("no-store"), Class::Declined { no_store: true }, SyncWrite::Release),
            (201, Some("private, No-Store"), Class::Declined { no_store: true }, SyncWrite::Release),
            (200, Some("store"), Class::Answered, SyncWrite::Complete),
        ] {
            let mut h = answer(status, policy);
            let got = head(&release_on_status, &mut h);
            assert_eq!((got, got.sync_write()), (class, write), "{status} {policy:?}");
            assert!(h.headers.get(headers::IDEMPOTENCY_POLICY).is_none() && h.headers.get("connection").is_none(), "{status}");
        }
        // A second line says no-store; idemgate's own headers never pass; a
        // length beside a transfer coding goes.
        let mut h = http::Response::builder()
            .status(201)
            .header(headers::IDEMPOTENCY_POLICY, "private")
            .header(headers::IDEMPOTENCY_POLICY, "no-store")
            .header(headers::IDEMPOTENCY_KEY, "derived")
            .header(headers::IDEMPOTENCY_GENERATION, "7")
            .header(headers::IDEMPOTENT_REPLAYED, "true")
            .header("transfer-encoding", "chunked")
            .header("content-length", "100")
            .header("content-type", "application/json")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        assert_eq!(head(&release_on_status, &mut h), Class::Declined { no_store: true });
        let left: Vec<&str> = h.headers.keys().map(|n| n.as_str()).collect();
        assert_eq!(left, ["content-type"]);
        let mut h = http::Response::builder().status(201).header("content-length", "5").body(()).unwrap().into_parts().0;
        assert_eq!(head(&release_on_status, &mut h), Class::Answered);
        assert_eq!(h.headers.get("content-length").map(|v| v.as_bytes()), Some(&b"5"[..]), "a length alone is the body's");
        let refused = UpstreamError::Connect { upstream: "u".into(), detail: "refused".into(), kind: UpstreamErrorKind::Other };
        let timed_out = UpstreamError::Timeout { upstream: "u".into(), timeout: Duration::from_secs(1) };
        let broken = UpstreamError::Broken { upstream: "u".into(), detail: "reset".into(), kind: UpstreamErrorKind::Other };
        assert_eq!(failure(&refused).sync_write(), SyncWrite::Release);
        assert_eq!(failure(&timed_out).sync_write(), SyncWrite::MarkUnknown);
        assert_eq!(failure(&broken).sync_write(), SyncWrite::MarkUnknown);
    }
}
