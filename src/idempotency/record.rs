//! Records and their state machine — pure code, no I/O.
//!
//! A record is the store's memory of one scope: the request's fingerprint, where
//! its attempt stands, and (once known) the response to replay. Both stores and
//! the proxy path ask this module what a record means for an incoming request
//! ([`decide`]), whether an expired record may be claimed again
//! ([`may_take_over`]), and which state an event leads to ([`transition`]).
//!
//! ```text
//!            claim                complete(gen)
//!   (none) ─────────▶ in_flight ─────────────────▶ completed ──(retention)──▶ swept
//!      ▲                 │  │                          │
//!      │  release(gen)   │  │ mark_unknown(gen):       │ expired: treated as absent,
//!      └─────────────────┘  │ timeout after send,      │ a new claim takes it over
//!                           ▼ or lease expired         ▼
//!                        unknown ──resolve──▶ completed | (none)
//! ```
//! Async mode (`mode = "async"`) uses three more states on the same table: an
//! accepted operation is `queued`; a worker takes it (new generation, under a
//! lease) to `processing`; its attempt ends `completed`, back in `queued` for a
//! later attempt (`requeue`), `failed_retryable` when the retries are used up
//! and no attempt may have executed, or `unknown` when one may have. A lease
//! that expires in `processing` requeues the operation if its request was
//! never sent (or the upstream deduplicates), else makes it `unknown`.
//!
//! The match arms below are written so adding a state is a compile error
//! everywhere it matters.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use uuid::Uuid;

use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::Scope;

/// A point in time on the store's clock: microseconds since the Unix epoch.
/// Deciding times (lease expiry, retention) always come from the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub i64);

impl Timestamp {
    /// The `expires_at` of a record kept forever (`retention = "forever"`):
    /// later than any clock, so no comparison with `now` ever finds it
    /// expired. PostgreSQL stores it as `'infinity'` (which reads back as
    /// this value), SQLite as the largest integer.
    pub const FOREVER: Timestamp = Timestamp(i64::MAX);

    pub fn plus(self, d: Duration) -> Timestamp {
        Timestamp(self.0.saturating_add(i64::try_from(d.as_micros()).unwrap_or(i64::MAX)))
    }

    /// Time from `self` until `later`, zero if `later` is not later.
    pub fn until(self, later: Timestamp) -> Duration {
        Duration::from_micros(u64::try_from(later.0.saturating_sub(self.0)).unwrap_or(0))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.0.div_euclid(1_000_000);
        let micros = self.0.rem_euclid(1_000_000);
        // RFC 3339 formatting covers years 1970-9999; print anything else raw
        // rather than panic on a value read from the database.
        match u64::try_from(secs).ok().filter(|s| *s <= 253_402_300_799) {
            Some(s) => {
                let t = std::time::UNIX_EPOCH + Duration::new(s, (micros * 1000) as u32);
                write!(f, "{}", humantime::format_rfc3339_micros(t))
            }
            None => write!(f, "{}us", self.0),
        }
    }
}

/// The fencing token of one attempt: drawn from a store-wide sequence at every
/// claim, take-over and operator resolution, so it grows across every life of
/// a scope (a key released or swept and used again gets a larger number), and
/// a result is recorded only under the generation that claimed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(pub i64);

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// One attempt's identity: the generation it claimed and its claim token.
/// A result, release or unknown-marking applies only to the attempt that
/// holds the record. Generations come from one store-wide sequence, so they
/// grow across every life of a scope; the token is a second, independent
/// check that the writer is the attempt that claimed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Attempt {
    pub generation: Generation,
    pub claim_token: Uuid,
}

/// Where a record stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Claimed; the request is (about to be) with the upstream.
    InFlight,
    /// The upstream's response is recorded and replayed until `expires_at`.
    Completed,
    /// The request may have reached the upstream but its result is not known.
    /// Never swept; waits for reconciliation.
    Unknown,
    /// Async: accepted (the client holds an operation id) and waiting for a
    /// worker, now or after a retry's backoff.
    Queued,
    /// Async: a worker holds it under a lease (renewed by heartbeats).
    Processing,
    /// Async: every attempt was refused or answered with a `release_on_status`
    /// status; the upstream never acted. Final; a retry with the same key
    /// starts a new operation.
    FailedRetryable,
}

impl State {
    pub const ALL: [State; 6] =
        [State::InFlight, State::Completed, State::Unknown, State::Queued, State::Processing, State::FailedRetryable];

    pub fn as_str(self) -> &'static str {
        match self {
            State::InFlight => "in_flight",
            State::Completed => "completed",
            State::Unknown => "unknown",
            State::Queued => "queued",
            State::Processing => "processing",
            State::FailedRetryable => "failed_retryable",
        }
    }

    /// Held by an attempt that may record a result (sync or async).
    pub fn is_attempt(self) -> bool {
        matches!(self, State::InFlight | State::Processing)
    }

    /// Final and kept for the route's retention, then swept.
    pub fn is_retained(self) -> bool {
        matches!(self, State::Completed | State::FailedRetryable)
    }

    pub fn parse(s: &str) -> Option<State> {
        State::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Every state's name, for messages: `in_flight, completed, ... or failed_retryable`.
    pub fn names() -> String {
        let names: Vec<&str> = State::ALL.iter().map(|s| s.as_str()).collect();
        match names.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
            _ => names.concat(),
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A response as recorded for replay. Hop-by-hop headers, `Set-Cookie` and
/// `Date` are never stored (see `crate::proxy::replay`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    /// Header name (lowercase) and raw value, in the order received.
    pub headers: Vec<(String, Vec<u8>)>,
    /// `None` when the body was larger than the route's `max_stored_response`:
    /// the outcome is known (status and headers) but the body cannot be replayed.
    pub body: Option<Bytes>,
}

/// One row of the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub scope: Scope,
    pub request_hash: Fingerprint,
    pub state: State,
    pub generation: Generation,
    /// Fresh for every claim; read back after an ambiguous commit to learn
    /// whether the claim was written.
    pub claim_token: Uuid,
    /// Replica id of the claimant.
    pub owner: String,
    pub lease_expires_at: Option<Timestamp>,
    pub response: Option<StoredResponse>,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
    /// For `completed` (and `failed_retryable`) records: replayed until
    /// then, swept afterwards.
    pub expires_at: Timestamp,
    /// Async operations only: the unguessable id clients poll.
    pub operation_id: Option<String>,
    /// Async: attempts taken by workers so far.
    pub attempts: i32,
    /// Async, `queued`: when the next attempt is due.
    pub next_attempt_at: Option<Timestamp>,
    /// Async, `processing`: set (durably) just before the attempt's request
    /// leaves; its absence proves the attempt never sent anything.
    pub sent_at: Option<Timestamp>,
    /// Async: the upstream status of the last retryable failure, if it answered.
    pub last_status: Option<u16>,
    /// Async: an earlier attempt may have executed (its answer was lost and
    /// the operation was run again on a deduplicating upstream), so used-up
    /// retries end `unknown`, never `failed_retryable`.
    pub maybe_executed: bool,
    /// Where the key came from (`header:<name>` or `body:<JSON Pointer>`, the
    /// route's `key_from`); `None` for records made before it was recorded.
    pub key_source: Option<String>,
    /// The key this record's request went to the upstream under, when the
    /// claiming route declared that upstream idempotent: only a claim that
    /// would send it under the same key may take the record over (see
    /// [`may_take_over`]). `None`: the claiming route did not deduplicate
    /// upstream, forwarded no key (observe mode), or the record is older
    /// than this column (migration 0018).
    pub reforward_key: Option<ReforwardKey>,
    /// The key this life's request went to the upstream under, whatever the
    /// claiming route's idempotence (a probe that asks about the derived key
    /// is made only for a request sent under it). `None`: claimed by a
    /// version that recorded it only for idempotent upstreams.
    pub sent_key: Option<ReforwardKey>,
    /// The digest of the fingerprint settings the record's hash was
    /// computed under (`FingerprintSpec::digest`); `None` for records older
    /// than this column (migration 0019) or rewritten by a replica of an
    /// earlier version.
    pub fingerprint_spec: Option<String>,
}

/// Which key an idempotent upstream is sent a record's request under: the
/// one derived from the scope, the client's own (`forward_key`), or none at
/// all (observe mode passes requests through as they are). An upstream that
/// deduplicates by key acts again on the same request sent under another
/// one: a record is taken over only by a claim that sends under its key (an
/// observing claim, which forwards whatever the record says, takes over an
/// observed one; an enforcing claim never does).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReforwardKey {
    Derived,
    /// The client's key, as a bare value.
    Client,
    /// The client's key, quoted as an sf-string (`"k"`): the same key to
    /// idemgate, another one to an upstream that compares the header's bytes.
    ClientQuoted,
    NoKey,
}

impl ReforwardKey {
    pub fn as_str(self) -> &'static str {
        match self {
            ReforwardKey::Derived => "derived",
            ReforwardKey::Client => "client",
            ReforwardKey::ClientQuoted => "client-quoted",
            ReforwardKey::NoKey => "none",
        }
    }

    /// How a claim whose upstream does not deduplicate records the key it
    /// sends under: never equal to a spelling [`ReforwardKey::parse`] reads,
    /// so such a record is never taken over, and read back by
    /// [`ReforwardKey::parse_sent`].
    pub fn sent_only(self) -> &'static str {
        match self {
            ReforwardKey::Derived => "sent-derived",
            ReforwardKey::Client => "sent-client",
            ReforwardKey::ClientQuoted => "sent-client-quoted",
            ReforwardKey::NoKey => "sent-none",
        }
    }

    /// The key a record's request was sent under, from either spelling.
    pub fn parse_sent(s: &str) -> Option<ReforwardKey> {
        ReforwardKey::parse(s.strip_prefix("sent-").unwrap_or(s))
    }

    /// The stored spelling back; anything else is no key (never taken over).
    pub fn parse(s: &str) -> Option<ReforwardKey> {
        match s {
            "derived" => Some(ReforwardKey::Derived),
            "client" => Some(ReforwardKey::Client),
            "client-quoted" => Some(ReforwardKey::ClientQuoted),
            "none" => Some(ReforwardKey::NoKey),
            _ => None,
        }
    }
}

/// What an existing record means for an incoming request with the same scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Completed, same fingerprint: answer from the record.
    Replay,
    /// Another request was made under this key: 409 (or 422).
    Mismatch,
    /// The first attempt is still running; retry after about this long.
    InProgress { lease_left: Duration },
    /// In flight, but its lease ran out: nobody is going to record a result.
    /// Becomes `unknown` (a store write) unless the route may re-forward.
    LeaseExpired,
    /// The outcome is unknown until an operator (or a probe) reconciles it.
    Unknown,
    /// Completed but past retention: treated as if absent.
    Expired,
    /// An async operation with the same fingerprint: the client gets the
    /// same acceptance (202 and operation id), whatever state it is in now.
    Accepted,
}

/// The heart of the protocol's read side. `now` is the store's clock.
pub fn decide(record: &Record, request_hash: &Fingerprint, now: Timestamp) -> Decision {
    if record.state.is_retained() && record.expires_at <= now {
        return Decision::Expired;
    }
    if record.request_hash != *request_hash {
        return Decision::Mismatch;
    }
    if record.operation_id.is_some() {
        return Decision::Accepted;
    }
    match record.state {
        State::Completed => Decision::Replay,
        State::Unknown => Decision::Unknown,
        State::InFlight => match record.lease_expires_at {
            Some(lease) if lease > now => Decision::InProgress { lease_left: now.until(lease) },
            _ => Decision::LeaseExpired,
        },
        // Async states always carry an operation id; without one the row is
        // inconsistent, and the safe answer is "in progress".
        State::Queued | State::Processing | State::FailedRetryable => Decision::InProgress { lease_left: Duration::ZERO },
    }
}

/// Whether a new claim may atomically replace `record`. The PostgreSQL claim's
/// `ON CONFLICT ... DO UPDATE ... WHERE` clause is this function in SQL; the
/// conformance suite holds the two to the same answers.
///
/// `reforward`: the key the claim would send the request under, if its
/// route's upstream deduplicates (`upstream_idempotent`). An attempt that
/// may have executed is sent again only under the key it went under (the
/// record's `reforward_key`): an upstream that saw no key (observe mode) or
/// the other one (`forward_key` changed by a rollout) would act twice.
pub fn may_take_over(record: &Record, request_hash: &Fingerprint, now: Timestamp, reforward: Option<ReforwardKey>) -> bool {
    let same_key = reforward.is_some() && record.reforward_key == reforward;
    match record.state {
        State::Completed | State::FailedRetryable => record.expires_at <= now,
        State::InFlight => same_key && record.request_hash == *request_hash && record.lease_expires_at.is_none_or(|lease| lease <= now),
        // An async operation's record stays its operation (its id is what
        // its client polls): a retry is answered with its acceptance.
        State::Unknown => same_key && record.request_hash == *request_hash && record.operation_id.is_none(),
        // A queued or processing operation belongs to the workers.
        State::Queued | State::Processing => false,
    }
}

/// Whether an async operation may be forwarded (again) by a new attempt:
/// nothing it was sent as may have executed (no earlier attempt's answer was
/// lost, `maybe_executed`, and the current attempt, if any, never sent), or
/// the route in force now deduplicates upstream (`reforwardable`: its
/// `upstream_idempotent`). Decided from the record's facts and the route as
/// configured now, never from how the route was configured when an earlier
/// attempt ran: a reload that turns `upstream_idempotent` off stops every
/// re-forward from then on.
pub fn may_forward(record: &Record, reforwardable: bool) -> bool {
    reforwardable || (!record.maybe_executed && record.sent_at.is_none())
}

/// Something that changes a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The attempt holding the record recorded the upstream's response.
    Complete { attempt: Attempt },
    /// The attempt holding `generation` proved the upstream never acted (or
    /// the response asked not to be stored): the key is freed.
    Release { attempt: Attempt },
    /// The attempt holding `generation` lost track of the outcome.
    MarkUnknown { attempt: Attempt },
    /// Async: the worker holding the attempt renews its lease.
    Heartbeat { attempt: Attempt },
    /// Async: the worker is about to send the attempt's request (only while
    /// its lease runs).
    MarkSent { attempt: Attempt },
    /// Async: the attempt never reached the upstream (or was answered with a
    /// `release_on_status` status): back to the queue for a later attempt.
    Requeue { attempt: Attempt },
    /// Async: the same, but the retries are used up.
    Fail { attempt: Attempt },
    /// The lease reaper found the lease expired. `reforwardable`: the
    /// route's upstream deduplicates by the derived key, so an async attempt
    /// that may have been sent can run again.
    LeaseExpired { reforwardable: bool },
    /// An operator recorded a final response. `force`: also over a record
    /// that is not `unknown` (a completed one), which the caller must justify.
    ResolveComplete { force: bool },
    /// An operator freed the key (`force`: likewise).
    ResolveRelease { force: bool },
    /// The sweeper found the record past retention.
    Sweep,
}

/// The outcome of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// The record moves to this state; `bump` says the generation increases
    /// (fencing off whoever held the old one).
    State { state: State, bump: bool },
    /// The record is deleted.
    Deleted,
}

/// Why an event does not apply to a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// The record moved on since this attempt claimed it (another generation,
    /// or no longer in flight): the write is fenced off.
    #[error("fenced: the record belongs to another attempt (it moved on to another generation or state)")]
    Fenced,
    /// The event is not meaningful in the record's state (or, for an
    /// operator's resolution of a completed record, needs force).
    #[error("not allowed while the record is {0}")]
    NotAllowed(State),
    /// Operators may not resolve a claim whose lease is still running: the
    /// attempt may yet record its result.
    #[error("the record is in flight and its lease has not expired")]
    LeaseLive,
    /// Async: the attempt's lease ran out before it could send: it must not.
    #[error("the attempt's lease has expired")]
    LeaseExpired,
    /// Async: a completed operation's stored request was dropped when it
    /// completed, so it cannot be queued to run again.
    #[error("the operation's stored request was dropped when it completed: it cannot run again")]
    RequestGone,
    /// An operator's release of an `unknown` record whose attempt recorded
    /// that it may still be at the upstream until then (its send plus the
    /// upstream timeout it was sent with): what the upstream shows now may
    /// not be what it will have done.
    #[error("its attempt may still be at the upstream until {0}")]
    AtUpstream(Timestamp),
}

/// A resolution (`event`: `ResolveComplete` or `ResolveRelease`) of
/// `record` as read under the store's lock, decided as [`transition`] does,
/// and further:
/// - with an `expected` generation (an operator who named the one they
///   looked at), only while the record is at it (`Fenced` once it moved on:
///   released and claimed again, completed by a probe);
/// - an unforced release of an `unknown` record waits until its attempt can
///   no longer be at the upstream (`at_upstream_until`, recorded with its
///   send): a look-up at the upstream before then may miss an operation
///   that is still running, and releasing would run it again. The
///   reconciler's probes wait for the same bound. A completion may go at
///   any time (its new generation fences the attempt off).
pub fn resolution(
    record: &Record,
    event: Event,
    expected: Option<Generation>,
    at_upstream_until: Option<Timestamp>,
    now: Timestamp,
) -> Result<Next, TransitionError> {
    if expected.is_some_and(|g| g != record.generation) {
        return Err(TransitionError::Fenced);
    }
    let next = transition(record, event, now)?;
    match (event, at_upstream_until) {
        (Event::ResolveRelease { force: false }, Some(until)) if record.state == State::Unknown && until > now => {
            Err(TransitionError::AtUpstream(until))
        }
        _ => Ok(next),
    }
}

/// The write side of the state machine. `now` is the store's clock.
pub fn transition(record: &Record, event: Event, now: Timestamp) -> Result<Next, TransitionError> {
    let own = |a: Attempt| record.generation == a.generation && record.claim_token == a.claim_token && record.state.is_attempt();
    let processing = |a: Attempt| own(a) && record.state == State::Processing;
    let lease_live = record.lease_expires_at.is_some_and(|l| l > now);
    let to = |state| Ok(Next::State { state, bump: false });
    match event {
        Event::Complete { attempt } if own(attempt) => to(State::Completed),
        Event::Release { attempt } if own(attempt) => Ok(Next::Deleted),
        Event::MarkUnknown { attempt } if own(attempt) => to(State::Unknown),
        Event::Heartbeat { attempt } if processing(attempt) => to(State::Processing),
        Event::MarkSent { attempt } if processing(attempt) && lease_live => to(State::Processing),
        Event::Requeue { attempt } if processing(attempt) => to(State::Queued),
        // Retries used up: "never executed" only if no attempt may have.
        Event::Fail { attempt } if processing(attempt) && record.maybe_executed => to(State::Unknown),
        Event::Fail { attempt } if processing(attempt) => to(State::FailedRetryable),
        Event::MarkSent { attempt } if processing(attempt) => Err(TransitionError::LeaseExpired),
        Event::Complete { .. }
        | Event::Release { .. }
        | Event::MarkUnknown { .. }
        | Event::Heartbeat { .. }
        | Event::MarkSent { .. }
        | Event::Requeue { .. }
        | Event::Fail { .. } => Err(TransitionError::Fenced),
        Event::LeaseExpired { reforwardable } => match record.state {
            State::InFlight | State::Processing if lease_live => Err(TransitionError::LeaseLive),
            State::InFlight => to(State::Unknown),
            // Never sent (proved by the durable sent_at) and no earlier
            // attempt may have executed, or the route in force deduplicates
            // upstream: another attempt is safe. Else unknown.
            State::Processing if may_forward(record, reforwardable) => to(State::Queued),
            State::Processing => to(State::Unknown),
            other => Err(TransitionError::NotAllowed(other)),
        },
        Event::ResolveComplete { force } | Event::ResolveRelease { force } => {
            // A live lease is never overridden, not even by force: its attempt
            // may be with the upstream right now, and freeing the key would let
            // a retry execute a second time.
            if record.state.is_attempt() && lease_live {
                return Err(TransitionError::LeaseLive);
            }
            match record.state {
                // A completed record is the answer clients are replayed;
                // changing it (a release lets the next retry execute again)
                // needs force.
                State::Completed if !force => return Err(TransitionError::NotAllowed(State::Completed)),
                // Queued operations belong to the workers; a failed one is
                // final and its key already free for a new operation. A
                // processing one whose lease ran out is the lease reaper's to
                // decide (unknown when it was sent, queued again when it
                // provably was not): a release would erase the proof that it
                // was sent, and its next attempt could run it twice.
                State::Queued | State::FailedRetryable | State::Processing => return Err(TransitionError::NotAllowed(record.state)),
                _ => {}
            }
            match event {
                // "It did not happen": an async operation runs again (its
                // client is polling its id and expects it to finish); a
                // synchronous key is freed for the client's retry.
                Event::ResolveRelease { .. } if record.operation_id.is_some() => Ok(Next::State { state: State::Queued, bump: true }),
                Event::ResolveRelease { .. } => Ok(Next::Deleted),
                _ => Ok(Next::State { state: State::Completed, bump: true }),
            }
        }
        Event::Sweep => match record.state {
            state if state.is_retained() && record.expires_at <= now => Ok(Next::Deleted),
            other => Err(TransitionError::NotAllowed(other)),
        },
    }
}

/// How long a completed record is replayed before the sweeper deletes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    For(Duration),
    /// Never swept (`retention = "forever"`): for operations that must never
    /// run twice whatever the delay between a request and its retry.
    Forever,
}

impl Retention {
    /// When a record completed at `now` stops being replayed.
    pub fn expires_at(self, now: Timestamp) -> Timestamp {
        match self {
            Retention::For(d) => now.plus(d),
            Retention::Forever => Timestamp::FOREVER,
        }
    }

    /// The duration, unless forever.
    pub fn finite(self) -> Option<Duration> {
        match self {
            Retention::For(d) => Some(d),
            Retention::Forever => None,
        }
    }
}

/// `24h`, or `forever`.
impl fmt::Display for Retention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Retention::For(d) => write!(f, "{}", humantime::format_duration(*d)),
            Retention::Forever => f.write_str("forever"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::key::IdempotencyKey;

    #[test]
    fn retention_forever_never_expires() {
        let now = Timestamp(1_000_000);
        assert_eq!(Retention::For(Duration::from_secs(1)).expires_at(now), Timestamp(2_000_000));
        assert_eq!(Retention::Forever.expires_at(now), Timestamp::FOREVER);
        assert_eq!(Retention::Forever.to_string(), "forever");
        assert_eq!(Retention::For(Duration::from_secs(86400)).to_string(), "1day");
        assert_eq!(Retention::Forever.finite(), None);
    }

    const NOW: Timestamp = Timestamp(1_000_000_000);

    fn fp(b: u8) -> Fingerprint {
        Fingerprint([b; 32])
    }

    fn record(state: State, lease: Option<i64>, expires: i64) -> Record {
        Record {
            scope: Scope { tenant: "t".into(), principal: "p".into(), operation: "o".into(), key: IdempotencyKey::new("k").unwrap() },
            request_hash: fp(1),
            state,
            generation: Generation(3),
            claim_token: Uuid::nil(),
            owner: "r1".into(),
            lease_expires_at: lease.map(|d| Timestamp(NOW.0 + d)),
            response: None,
            created_at: NOW,
            updated_at: NOW,
            expires_at: Timestamp(NOW.0 + expires),
            operation_id: None,
            attempts: 0,
            next_attempt_at: None,
            sent_at: None,
            last_status: None,
            maybe_executed: false,
            key_source: None,
            reforward_key: Some(ReforwardKey::Derived),
            sent_key: Some(ReforwardKey::Derived),
            fingerprint_spec: None,
        }
    }

    #[test]
    fn records_kept_forever_never_expire() {
        let forever = Record { expires_at: Timestamp::FOREVER, ..record(State::Completed, None, 0) };
        let far_future = Timestamp(i64::MAX - 1);
        for now in [NOW, far_future] {
            assert_eq!(decide(&forever, &fp(1), now), Decision::Replay);
            assert_eq!(decide(&forever, &fp(2), now), Decision::Mismatch);
            assert!(!may_take_over(&forever, &fp(1), now, D));
            assert_eq!(transition(&forever, Event::Sweep, now), Err(TransitionError::NotAllowed(State::Completed)));
        }
        assert_eq!(Timestamp(0).plus(Duration::MAX), Timestamp::FOREVER);
    }

    #[test]
    fn decide_covers_every_state() {
        let live = record(State::InFlight, Some(2_000_000), 0);
        assert_eq!(decide(&live, &fp(1), NOW), Decision::InProgress { lease_left: Duration::from_secs(2) });
        assert_eq!(decide(&live, &fp(2), NOW), Decision::Mismatch);
        assert_eq!(decide(&record(State::InFlight, Some(0), 0), &fp(1), NOW), Decision::LeaseExpired);
        assert_eq!(decide(&record(State::InFlight, None, 0), &fp(1), NOW), Decision::LeaseExpired);
        let done = record(State::Completed, None, 10);
        assert_eq!(decide(&done, &fp(1), NOW), Decision::Replay);
        assert_eq!(decide(&done, &fp(2), NOW), Decision::Mismatch);
        // Past retention: absent, whatever the fingerprint.
        let old = record(State::Completed, None, 0);
        assert_eq!(decide(&old, &fp(1), NOW), Decision::Expired);
        assert_eq!(decide(&old, &fp(2), NOW), Decision::Expired);
        let unknown = record(State::Unknown, None, -10);
        assert_eq!(decide(&unknown, &fp(1), NOW), Decision::Unknown);
        assert_eq!(decide(&unknown, &fp(2), NOW), Decision::Mismatch);
    }

    #[test]
    fn take_over_rules() {
        // Completed records are taken over only past retention.
        assert!(!may_take_over(&record(State::Completed, None, 1), &fp(1), NOW, D));
        assert!(may_take_over(&record(State::Completed, None, 0), &fp(2), NOW, None));
        // In flight: never while the lease runs; after it only for idempotent upstreams and the same request.
        assert!(!may_take_over(&record(State::InFlight, Some(1), 0), &fp(1), NOW, D));
        assert!(!may_take_over(&record(State::InFlight, Some(0), 0), &fp(1), NOW, None));
        assert!(may_take_over(&record(State::InFlight, Some(0), 0), &fp(1), NOW, D));
        assert!(!may_take_over(&record(State::InFlight, Some(0), 0), &fp(2), NOW, D));
        // Unknown: only for idempotent upstreams and the same request.
        assert!(!may_take_over(&record(State::Unknown, None, -5), &fp(1), NOW, None));
        assert!(may_take_over(&record(State::Unknown, None, -5), &fp(1), NOW, D));
        assert!(!may_take_over(&record(State::Unknown, None, -5), &fp(2), NOW, D));
        // ...and only under the key the upstream got: none (observe mode, a
        // route that did not deduplicate, a record older than the column) or
        // the other one (`forward_key` changed) is never sent again.
        for state in [State::Unknown, State::InFlight] {
            let lease = (state == State::InFlight).then_some(0);
            for (sent_under, now_under) in [(None, D), (Some(ReforwardKey::Client), D), (Some(ReforwardKey::Derived), CLIENT)] {
                let r = Record { reforward_key: sent_under, ..record(state, lease, -5) };
                assert!(!may_take_over(&r, &fp(1), NOW, now_under), "{state:?} sent under {sent_under:?}, now {now_under:?}");
            }
            let r = Record { reforward_key: Some(ReforwardKey::Client), ..record(state, lease, -5) };
            assert!(may_take_over(&r, &fp(1), NOW, CLIENT));
            // An observed record: never by an enforcing claim, by an observing one.
            let observed = Record { reforward_key: Some(ReforwardKey::NoKey), ..record(state, lease, -5) };
            assert!(!may_take_over(&observed, &fp(1), NOW, D) && !may_take_over(&observed, &fp(1), NOW, CLIENT));
            assert!(may_take_over(&observed, &fp(1), NOW, Some(ReforwardKey::NoKey)));
        }
    }

    /// A claim whose route deduplicates upstream under the derived key, or the client's.
    const D: Option<ReforwardKey> = Some(ReforwardKey::Derived);
    const CLIENT: Option<ReforwardKey> = Some(ReforwardKey::Client);

    #[test]
    fn results_are_fenced_by_generation() {
        let r = record(State::InFlight, Some(5), 0);
        let mine = Attempt { generation: Generation(3), claim_token: Uuid::nil() };
        let stale = Attempt { generation: Generation(2), claim_token: Uuid::nil() };
        // Same generation, another life of the record (released and claimed again).
        let other_life = Attempt { generation: Generation(3), claim_token: Uuid::from_u128(7) };
        assert_eq!(transition(&r, Event::Complete { attempt: other_life }, NOW), Err(TransitionError::Fenced));
        assert_eq!(transition(&r, Event::Release { attempt: other_life }, NOW), Err(TransitionError::Fenced));
        assert_eq!(transition(&r, Event::MarkUnknown { attempt: other_life }, NOW), Err(TransitionError::Fenced));
        assert_eq!(transition(&r, Event::Complete { attempt: mine }, NOW), Ok(Next::State { state: State::Completed, bump: false }));
        assert_eq!(transition(&r, Event::Complete { attempt: stale }, NOW), Err(TransitionError::Fenced));
        assert_eq!(transition(&r, Event::Release { attempt: mine }, NOW), Ok(Next::Deleted));
        assert_eq!(transition(&r, Event::Release { attempt: stale }, NOW), Err(TransitionError::Fenced));
        assert_eq!(transition(&r, Event::MarkUnknown { attempt: mine }, NOW), Ok(Next::State { state: State::Unknown, bump: false }));
        // Once resolved or completed, the original attempt can no longer write.
        let done = record(State::Completed, None, 5);
        assert_eq!(transition(&done, Event::Complete { attempt: mine }, NOW), Err(TransitionError::Fenced));
        assert_eq!(transition(&done, Event::MarkUnknown { attempt: mine }, NOW), Err(TransitionError::Fenced));
    }

    #[test]
    fn reaper_sweeper_and_operator_events() {
        let live = record(State::InFlight, Some(5), 0);
        let expired = record(State::InFlight, Some(-5), 0);
        assert_eq!(transition(&live, Event::LeaseExpired { reforwardable: false }, NOW), Err(TransitionError::LeaseLive));
        assert_eq!(
            transition(&expired, Event::LeaseExpired { reforwardable: false }, NOW),
            Ok(Next::State { state: State::Unknown, bump: false })
        );
        for force in [false, true] {
            assert_eq!(transition(&live, Event::ResolveRelease { force }, NOW), Err(TransitionError::LeaseLive));
            assert_eq!(transition(&live, Event::ResolveComplete { force }, NOW), Err(TransitionError::LeaseLive));
        }
        let unknown = record(State::Unknown, None, 0);
        assert_eq!(transition(&unknown, Event::ResolveRelease { force: false }, NOW), Ok(Next::Deleted));
        assert_eq!(
            transition(&unknown, Event::ResolveComplete { force: false }, NOW),
            Ok(Next::State { state: State::Completed, bump: true })
        );
        assert_eq!(transition(&expired, Event::ResolveRelease { force: false }, NOW), Ok(Next::Deleted));
        // A completed record is what retries are replayed: only by force.
        let done = record(State::Completed, None, 10);
        assert_eq!(transition(&done, Event::ResolveRelease { force: false }, NOW), Err(TransitionError::NotAllowed(State::Completed)));
        assert_eq!(transition(&done, Event::ResolveComplete { force: false }, NOW), Err(TransitionError::NotAllowed(State::Completed)));
        assert_eq!(transition(&done, Event::ResolveRelease { force: true }, NOW), Ok(Next::Deleted));
        assert_eq!(transition(&done, Event::ResolveComplete { force: true }, NOW), Ok(Next::State { state: State::Completed, bump: true }));
        assert_eq!(
            transition(&unknown, Event::LeaseExpired { reforwardable: false }, NOW),
            Err(TransitionError::NotAllowed(State::Unknown))
        );
        assert_eq!(transition(&unknown, Event::Sweep, NOW), Err(TransitionError::NotAllowed(State::Unknown)));
        assert_eq!(transition(&expired, Event::Sweep, NOW), Err(TransitionError::NotAllowed(State::InFlight)));
        assert_eq!(transition(&record(State::Completed, None, 1), Event::Sweep, NOW), Err(TransitionError::NotAllowed(State::Completed)));
        assert_eq!(transition(&record(State::Completed, None, 0), Event::Sweep, NOW), Ok(Next::Deleted));
    }

    fn async_op(state: State, lease: Option<i64>, sent: bool) -> Record {
        Record { operation_id: Some("op".into()), sent_at: sent.then_some(NOW), attempts: 1, ..record(state, lease, 0) }
    }

    #[test]
    fn async_attempts_are_fenced_and_end_queued_failed_or_unknown() {
        let mine = Attempt { generation: Generation(3), claim_token: Uuid::nil() };
        let stale = Attempt { generation: Generation(2), claim_token: Uuid::nil() };
        let live = async_op(State::Processing, Some(5), false);
        let same = |state| Ok(Next::State { state, bump: false });
        assert_eq!(transition(&live, Event::Heartbeat { attempt: mine }, NOW), same(State::Processing));
        assert_eq!(transition(&live, Event::MarkSent { attempt: mine }, NOW), same(State::Processing));
        assert_eq!(transition(&live, Event::Requeue { attempt: mine }, NOW), same(State::Queued));
        assert_eq!(transition(&live, Event::Fail { attempt: mine }, NOW), same(State::FailedRetryable));
        let ran_before = Record { maybe_executed: true, ..live.clone() };
        assert_eq!(
            transition(&ran_before, Event::Fail { attempt: mine }, NOW),
            same(State::Unknown),
            "never failed_retryable once it may have run"
        );
        assert_eq!(transition(&live, Event::Complete { attempt: mine }, NOW), same(State::Completed));
        assert_eq!(transition(&live, Event::MarkUnknown { attempt: mine }, NOW), same(State::Unknown));
        for event in [
            Event::Heartbeat { attempt: stale },
            Event::MarkSent { attempt: stale },
            Event::Requeue { attempt: stale },
            Event::Fail { attempt: stale },
            Event::Complete { attempt: stale },
        ] {
            assert_eq!(transition(&live, event, NOW), Err(TransitionError::Fenced), "{event:?}");
        }
        // A worker whose lease ran out must not send (another may take it over).
        let expired = async_op(State::Processing, Some(-1), false);
        assert_eq!(transition(&expired, Event::MarkSent { attempt: mine }, NOW), Err(TransitionError::LeaseExpired));
        // Queued operations hold no attempt: nothing of a worker applies.
        let queued = async_op(State::Queued, None, false);
        assert_eq!(transition(&queued, Event::Heartbeat { attempt: mine }, NOW), Err(TransitionError::Fenced));
        assert_eq!(transition(&queued, Event::Complete { attempt: mine }, NOW), Err(TransitionError::Fenced));
    }

    #[test]
    fn async_lease_expiry_requeues_only_what_was_never_sent_or_may_run_again() {
        let expiry =
            |sent, reforwardable| transition(&async_op(State::Processing, Some(-1), sent), Event::LeaseExpired { reforwardable }, NOW);
        let to = |state| Ok(Next::State { state, bump: false });
        assert_eq!(expiry(false, false), to(State::Queued), "never sent: another attempt is safe");
        assert_eq!(expiry(true, false), to(State::Unknown), "may have executed, upstream does not deduplicate");
        assert_eq!(expiry(true, true), to(State::Queued), "the upstream deduplicates by the derived key");
        let live = async_op(State::Processing, Some(5), true);
        assert_eq!(transition(&live, Event::LeaseExpired { reforwardable: true }, NOW), Err(TransitionError::LeaseLive));
        // This attempt never sent, but an earlier one's answer was lost: only
        // a route that deduplicates now may run it again.
        let ran_before = Record { maybe_executed: true, ..async_op(State::Processing, Some(-1), false) };
        let expiry = |reforwardable| transition(&ran_before, Event::LeaseExpired { reforwardable }, NOW);
        assert_eq!(expiry(false), to(State::Unknown), "the route no longer deduplicates");
        assert_eq!(expiry(true), to(State::Queued));
    }

    #[test]
    fn an_operation_is_forwarded_again_only_if_nothing_of_it_may_have_executed_or_the_route_deduplicates() {
        let queued = async_op(State::Queued, None, false);
        assert!(may_forward(&queued, false) && may_forward(&queued, true));
        let ran_before = Record { maybe_executed: true, ..queued.clone() };
        assert!(!may_forward(&ran_before, false), "an earlier attempt may have executed");
        assert!(may_forward(&ran_before, true), "the upstream deduplicates by the derived key");
        let sent = async_op(State::Processing, Some(-1), true);
        assert!(!may_forward(&sent, false) && may_forward(&sent, true));
    }

    #[test]
    fn async_operations_answer_with_their_acceptance_and_are_kept_for_retention() {
        for state in [State::Queued, State::Processing, State::Completed, State::Unknown] {
            let op = Record { expires_at: Timestamp(NOW.0 + 10), ..async_op(state, Some(5), false) };
            assert_eq!(decide(&op, &fp(1), NOW), Decision::Accepted, "{state}");
            assert_eq!(decide(&op, &fp(2), NOW), Decision::Mismatch, "{state}");
            assert!(!may_take_over(&op, &fp(1), NOW, None) || state == State::Unknown);
        }
        // Failed: kept for retention like a result, then free; a retry starts a new operation after expiry.
        let failed = Record { expires_at: Timestamp(NOW.0 + 10), ..async_op(State::FailedRetryable, None, false) };
        assert_eq!(decide(&failed, &fp(1), NOW), Decision::Accepted);
        let old = Record { expires_at: NOW, ..failed.clone() };
        assert_eq!(decide(&old, &fp(1), NOW), Decision::Expired);
        assert!(may_take_over(&old, &fp(2), NOW, None));
        assert_eq!(transition(&old, Event::Sweep, NOW), Ok(Next::Deleted));
        // Workers' operations are never taken over by a claim.
        assert!(!may_take_over(&async_op(State::Queued, None, false), &fp(1), NOW, D));
        assert!(!may_take_over(&async_op(State::Processing, Some(-1), false), &fp(1), NOW, D));
        // Nor an unknown one, even on an upstream that deduplicates: a
        // retry is answered with its acceptance (the id its client polls).
        assert!(!may_take_over(&async_op(State::Unknown, None, true), &fp(1), NOW, D));
        // Released ("it did not happen"): an async operation runs again, under a new generation.
        let unknown_op = async_op(State::Unknown, None, true);
        assert_eq!(
            transition(&unknown_op, Event::ResolveRelease { force: false }, NOW),
            Ok(Next::State { state: State::Queued, bump: true })
        );
        // Operators cannot resolve queued or failed operations.
        assert_eq!(
            transition(&async_op(State::Queued, None, false), Event::ResolveRelease { force: true }, NOW),
            Err(TransitionError::NotAllowed(State::Queued))
        );
        assert_eq!(
            transition(&failed, Event::ResolveRelease { force: true }, NOW),
            Err(TransitionError::NotAllowed(State::FailedRetryable))
        );
        // Released (unforced) only once its attempt can no longer be at the
        // upstream; completed at any time, and by force before.
        let until = Some(Timestamp(NOW.0 + 1));
        let release = Event::ResolveRelease { force: false };
        let requeued = Ok(Next::State { state: State::Queued, bump: true });
        let completed = Ok(Next::State { state: State::Completed, bump: true });
        assert_eq!(resolution(&unknown_op, release, None, until, NOW), Err(TransitionError::AtUpstream(Timestamp(NOW.0 + 1))));
        assert_eq!(resolution(&unknown_op, release, None, until, Timestamp(NOW.0 + 1)), requeued);
        assert_eq!(resolution(&unknown_op, release, None, None, NOW), requeued);
        assert_eq!(resolution(&unknown_op, Event::ResolveRelease { force: true }, None, until, NOW), requeued);
        assert_eq!(resolution(&unknown_op, Event::ResolveComplete { force: false }, None, until, NOW), completed);
        // Only at the generation an operator named, when they named one.
        let at = unknown_op.generation;
        assert_eq!(resolution(&unknown_op, release, Some(at), None, NOW), requeued);
        assert_eq!(resolution(&unknown_op, release, Some(Generation(at.0 - 1)), None, NOW), Err(TransitionError::Fenced));
        // Nor a processing one whose lease ran out: the reaper decides it
        // (a release would erase the proof that it was sent).
        for sent in [false, true] {
            let expired = async_op(State::Processing, Some(-1), sent);
            for event in [Event::ResolveRelease { force: true }, Event::ResolveComplete { force: true }] {
                assert_eq!(transition(&expired, event, NOW), Err(TransitionError::NotAllowed(State::Processing)), "sent: {sent}");
            }
        }
    }

    #[test]
    fn a_key_sent_to_an_upstream_that_does_not_deduplicate_never_takes_a_record_over() {
        for k in [ReforwardKey::Derived, ReforwardKey::Client, ReforwardKey::ClientQuoted, ReforwardKey::NoKey] {
            assert_eq!(ReforwardKey::parse(k.sent_only()), None, "{k:?}");
            assert_eq!(ReforwardKey::parse_sent(k.sent_only()), Some(k));
            assert_eq!(ReforwardKey::parse_sent(k.as_str()), Some(k));
        }
    }

    #[test]
    fn timestamps() {
        assert_eq!(Timestamp(10).plus(Duration::from_micros(5)), Timestamp(15));
        assert_eq!(Timestamp(10).until(Timestamp(4)), Duration::ZERO);
        assert_eq!(Timestamp(0).to_string(), "1970-01-01T00:00:00.000000Z");
        assert_eq!(Timestamp(i64::MAX).to_string(), format!("{}us", i64::MAX));
        assert_eq!(Timestamp(-5).to_string(), "-5us");
        assert_eq!(State::parse("unknown"), Some(State::Unknown));
        assert_eq!(State::parse("bogus"), None);
    }
}
