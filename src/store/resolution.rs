//! Resolving a record by hand or by the reconciler: the one implementation
//! that `idemgate keys resolve`, the admin API and the reconciler share.
//! It validates what was asked (a reason, a final status, valid headers) and
//! applies it with its audit row through the store's facade.

use std::time::Duration;

use bytes::Bytes;

use crate::idempotency::key::Scope;
use crate::idempotency::record::{Generation, Retention, State, StoredResponse, TransitionError};
use crate::store::audit::{Actor, AuditNote, Caller};
use crate::store::{ProbeFence, Resolution, ResolveOutcome, Store, StoreError};

/// A resolution as an operator asks for it (CLI or admin API), before
/// validation.
#[derive(Debug, Clone)]
pub struct ResolveRequest {
    pub action: ResolveAction,
    /// Why; stored in the audit trail. Required (a blank one is none).
    pub reason: Option<String>,
    /// Also resolve a record that is not `unknown` or an expired claim (a
    /// completed one): releasing it lets the client's next retry execute again.
    pub force: bool,
    pub actor: Actor,
    /// The reconciler: apply only to the record its probe took (still
    /// `unknown` at the generation probed, still marked by the probe).
    pub fence: Option<ProbeFence>,
    /// An operator: apply only to the record at this generation (the one
    /// they looked at); a record that moved on since is refused.
    pub generation: Option<Generation>,
}

#[derive(Debug, Clone)]
pub enum ResolveAction {
    /// It did not happen: delete the record so the client may retry.
    Release,
    /// It happened: record this response for replays (`body: None`: the
    /// status and headers only, when the body is larger than the route
    /// stores).
    Complete { status: u16, headers: Vec<(String, Vec<u8>)>, body: Option<Bytes>, retention: Option<Duration> },
}

/// Why a resolution was not applied.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The request itself is wrong (status out of range, no reason with force).
    #[error("{0}")]
    Invalid(String),
    #[error("no record for that scope")]
    NotFound,
    /// The record is not in a state that may be resolved (see `record::transition`).
    #[error("refused: {0}")]
    Refused(TransitionError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Statuses a hand-made response may carry: a 1xx would break the client's
/// connection handling, and nothing outside 200-599 is a final HTTP answer.
pub const RESOLVABLE_STATUSES: std::ops::RangeInclusive<u16> = 200..=599;

/// The one implementation of resolving a record, shared by `idemgate keys
/// resolve` and the admin API: validates the request, applies it with its
/// audit row, and returns the state the record was in.
/// `default_retention` applies to a completion that names none (the route's).
pub async fn resolve(store: &Store, scope: &Scope, req: ResolveRequest, default_retention: Retention) -> Result<State, ResolveError> {
    resolve_by(store, scope, req, default_retention, None).await
}

/// [`resolve`], recording who asked over the network (the admin API's
/// caller: its address and token label) in the audit row.
pub async fn resolve_by(
    store: &Store,
    scope: &Scope,
    req: ResolveRequest,
    default_retention: Retention,
    caller: Option<Caller>,
) -> Result<State, ResolveError> {
    let Some(reason) = req.reason.as_deref().map(str::trim).filter(|r| !r.is_empty()) else {
        return Err(ResolveError::Invalid("a resolution needs a reason (it is kept in the audit trail)".into()));
    };
    // A reason is printed on terminals and screens: an escape sequence in
    // it could rewrite what an operator sees (erase a line, forge a row).
    if reason.chars().any(char::is_control) {
        return Err(ResolveError::Invalid(
            "the reason has a control character (a newline, a tab, an escape sequence): write it on one line of plain text".into(),
        ));
    }
    let resolution = match req.action {
        ResolveAction::Release => Resolution::Release { force: req.force },
        ResolveAction::Complete { status, headers, body, retention } => {
            if !RESOLVABLE_STATUSES.contains(&status) {
                return Err(ResolveError::Invalid(format!("status {status} is not a final HTTP status (200-599)")));
            }
            for (name, value) in &headers {
                if http::HeaderName::from_bytes(name.as_bytes()).is_err() || http::HeaderValue::from_bytes(value).is_err() {
                    return Err(ResolveError::Invalid(format!("invalid header {name:?}")));
                }
            }
            Resolution::Complete {
                response: StoredResponse { status, headers, body },
                retention: retention.map_or(default_retention, Retention::For),
                force: req.force,
            }
        }
    };
    let note = AuditNote { actor: req.actor, reason: reason.to_owned(), forced: req.force, caller };
    let outcome = match req.fence {
        Some(fence) => store.resolve_probed(scope, &resolution, &note, fence).await?,
        None => store.resolve_expecting(scope, &resolution, &note, req.generation).await?,
    };
    match outcome {
        ResolveOutcome::Resolved { from } => Ok(from),
        ResolveOutcome::NotFound => Err(ResolveError::NotFound),
        ResolveOutcome::Refused(r) => Err(ResolveError::Refused(r)),
    }
}
