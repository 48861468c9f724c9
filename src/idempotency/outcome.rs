//! How things end, in the words of the request path, the async workers and
//! the reconciler: a request's [`RequestOutcome`], an async attempt's
//! [`AttemptOutcome`], a reconcile probe's [`ProbeOutcome`], and what
//! enforcing would have done with a request observe mode passed through
//! ([`Would`], [`RefusalReason`]).
//!
//! The code that decides an outcome names it here; metrics and the access log
//! only count and print it. Each `as_str` is a metric label value and an
//! access-log field: an interface, not to be renamed.

/// How a request on an idempotent route ended, as counted in
/// `idemgate_requests_total{operation,outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOutcome {
    /// First request: claimed, forwarded, recorded.
    Forwarded,
    /// Answered from a completed record.
    Replayed,
    /// Same key, different request.
    Mismatch,
    /// Same key while the first is in flight.
    InFlight,
    /// The outcome is unknown (timeout after send, lease expired, or the record is `unknown`).
    Unknown,
    /// The key was freed (`release_on_status`, `no-store`, upstream unreachable).
    Released,
    /// The result write was fenced off by a newer attempt.
    Fenced,
    /// Refused before any claim (identity, key, body).
    Rejected,
    /// The store could not be reached; nothing was forwarded.
    StoreUnavailable,
    /// No idempotency applied (other method, key not required and absent, default upstream).
    PassThrough,
    /// Async: accepted (or the acceptance answered again): 202 and an operation id.
    Accepted,
    /// Refused before the claim: the upstream's limit (or the async queue's
    /// bound) was reached (503 `overloaded`).
    Overloaded,
    /// Async: an operation's status document was read (access log only; polls
    /// are not counted per route).
    Polled,
}

impl RequestOutcome {
    /// The outcomes a request on a route can have, each a series of
    /// `idemgate_requests_total` from the start.
    pub const OF_ROUTES: [RequestOutcome; 12] = [
        RequestOutcome::Forwarded,
        RequestOutcome::Replayed,
        RequestOutcome::Mismatch,
        RequestOutcome::InFlight,
        RequestOutcome::Unknown,
        RequestOutcome::Released,
        RequestOutcome::Fenced,
        RequestOutcome::Rejected,
        RequestOutcome::StoreUnavailable,
        RequestOutcome::PassThrough,
        RequestOutcome::Accepted,
        RequestOutcome::Overloaded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RequestOutcome::Forwarded => "forwarded",
            RequestOutcome::Replayed => "replayed",
            RequestOutcome::Mismatch => "mismatch",
            RequestOutcome::InFlight => "in_flight",
            RequestOutcome::Unknown => "unknown",
            RequestOutcome::Released => "released",
            RequestOutcome::Fenced => "fenced",
            RequestOutcome::Rejected => "rejected",
            RequestOutcome::StoreUnavailable => "store_unavailable",
            RequestOutcome::PassThrough => "passthrough",
            RequestOutcome::Accepted => "accepted",
            RequestOutcome::Overloaded => "overloaded",
            RequestOutcome::Polled => "polled",
        }
    }
}

/// How an async attempt ended, as counted in `idemgate_async_attempts_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptOutcome {
    Completed,
    /// Refused or declined: back to the queue after a backoff.
    Requeued,
    /// Retries used up: the operation ends `failed_retryable` (or
    /// `unknown` if an earlier attempt may have executed).
    Failed,
    Unknown,
    /// The worker lost its lease (a newer attempt holds the operation): its
    /// writes were dropped.
    LostLease,
    /// The store could not be written; the lease expiry will decide.
    StoreUnavailable,
}

impl AttemptOutcome {
    pub const ALL: [AttemptOutcome; 6] = [
        AttemptOutcome::Completed,
        AttemptOutcome::Requeued,
        AttemptOutcome::Failed,
        AttemptOutcome::Unknown,
        AttemptOutcome::LostLease,
        AttemptOutcome::StoreUnavailable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Completed => "completed",
            AttemptOutcome::Requeued => "requeued",
            AttemptOutcome::Failed => "failed",
            AttemptOutcome::Unknown => "unknown",
            AttemptOutcome::LostLease => "lost_lease",
            AttemptOutcome::StoreUnavailable => "store_unavailable",
        }
    }
}

/// What a reconciliation probe said, as counted in
/// `idemgate_probes_total{operation,outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeOutcome {
    /// A `found` status: the record was completed with the probe's answer.
    Found,
    /// An `absent` status: the key was released.
    Absent,
    /// Another status: the record stays unknown (backoff).
    Inconclusive,
    /// No answer (refused, timeout, unreadable), or the probe could not be
    /// built: the record stays unknown (backoff).
    Error,
}

impl ProbeOutcome {
    pub const ALL: [ProbeOutcome; 4] = [ProbeOutcome::Found, ProbeOutcome::Absent, ProbeOutcome::Inconclusive, ProbeOutcome::Error];

    pub fn as_str(self) -> &'static str {
        match self {
            ProbeOutcome::Found => "found",
            ProbeOutcome::Absent => "absent",
            ProbeOutcome::Inconclusive => "inconclusive",
            ProbeOutcome::Error => "error",
        }
    }
}

/// What enforcing would have answered instead of the upstream, for a request
/// observe mode passed through (`idemgate_observe_would_total{would}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Would {
    /// A completed record with the same fingerprint: a replay (or, if its
    /// body was not stored, 409 `response-not-stored`).
    Replay,
    /// The key was used with a different request: 409 (or 422) `idempotency-key-reused`.
    Conflict,
    /// The first request with the key is still in flight: 409 `request-in-progress`
    /// (with `in_flight = "wait"`: first a wait, then maybe a replay).
    RejectInFlight,
    /// The record is `unknown` (or its lease expired): 409 `outcome-unknown`.
    Unknown,
}

impl Would {
    pub const ALL: [Would; 4] = [Would::Replay, Would::Conflict, Would::RejectInFlight, Would::Unknown];

    pub fn as_str(self) -> &'static str {
        match self {
            Would::Replay => "replay",
            Would::Conflict => "conflict",
            Would::RejectInFlight => "reject_in_flight",
            Would::Unknown => "unknown",
        }
    }
}

/// Why enforcing would have refused an observed request before any claim
/// (`idemgate_observe_would_refuse_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalReason {
    /// 401: no identity source matched.
    Unauthenticated,
    /// 400 `missing-idempotency-key` (the key is required and no source is present).
    MissingKey,
    /// 400 `invalid-idempotency-key`.
    InvalidKey,
    /// 400 `invalid-body` (JSON the fingerprint refuses).
    InvalidBody,
}

impl RefusalReason {
    pub const ALL: [RefusalReason; 4] =
        [RefusalReason::Unauthenticated, RefusalReason::MissingKey, RefusalReason::InvalidKey, RefusalReason::InvalidBody];

    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::Unauthenticated => "unauthenticated",
            RefusalReason::MissingKey => "missing_key",
            RefusalReason::InvalidKey => "invalid_key",
            RefusalReason::InvalidBody => "invalid_body",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The label values are an interface (dashboards, alerts, log queries):
    /// moving or renaming a variant must not change them.
    #[test]
    fn label_values_stay_as_published() {
        let outcomes: Vec<&str> = RequestOutcome::OF_ROUTES.iter().chain([&RequestOutcome::Polled]).map(|o| o.as_str()).collect();
        assert_eq!(
            outcomes,
            [
                "forwarded",
                "replayed",
                "mismatch",
                "in_flight",
                "unknown",
                "released",
                "fenced",
                "rejected",
                "store_unavailable",
                "passthrough",
                "accepted",
                "overloaded",
                "polled"
            ]
        );
        let attempts: Vec<&str> = AttemptOutcome::ALL.iter().map(|o| o.as_str()).collect();
        assert_eq!(attempts, ["completed", "requeued", "failed", "unknown", "lost_lease", "store_unavailable"]);
        let probes: Vec<&str> = ProbeOutcome::ALL.iter().map(|o| o.as_str()).collect();
        assert_eq!(probes, ["found", "absent", "inconclusive", "error"]);
        let woulds: Vec<&str> = Would::ALL.iter().map(|o| o.as_str()).collect();
        assert_eq!(woulds, ["replay", "conflict", "reject_in_flight", "unknown"]);
        let refusals: Vec<&str> = RefusalReason::ALL.iter().map(|o| o.as_str()).collect();
        assert_eq!(refusals, ["unauthenticated", "missing_key", "invalid_key", "invalid_body"]);
    }
}
