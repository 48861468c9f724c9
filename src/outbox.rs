//! Completion events through a transactional outbox.
//!
//! Every final state change of a route with `[routes.events]` (completed,
//! unknown, failed_retryable, and each release or completion by the
//! reconciler, the CLI or the API) writes an event row in the same statement
//! or transaction as the change itself, so there is no change without its
//! event and no event without its change. The [`relay`](crate::background::outbox_relay)
//! delivers them at least once, in order per scope, with a stable
//! `Idemgate-Event-Id`; receivers deduplicate by that id.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, KeyInit, Mac};
use serde::Serialize;
use serde_json::json;
use sha2::Sha256;

use crate::idempotency::key::Scope;
use crate::idempotency::record::{Generation, State, Timestamp};
use crate::secret::Secret;

/// What happened to a record, as an event says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    /// The upstream's answer was recorded (or an operator or probe recorded one).
    Completed,
    /// The outcome is unknown (timeout after send, lease expired after send).
    Unknown,
    /// Async: every attempt was refused or declined; nothing executed.
    FailedRetryable,
    /// An operator or the reconciler released the key.
    Released,
}

impl EventType {
    pub const ALL: [EventType; 4] = [EventType::Completed, EventType::Unknown, EventType::FailedRetryable, EventType::Released];

    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Completed => "completed",
            EventType::Unknown => "unknown",
            EventType::FailedRetryable => "failed_retryable",
            EventType::Released => "released",
        }
    }

    /// The `type` of a delivered event.
    pub fn type_name(self) -> &'static str {
        match self {
            EventType::Completed => "idemgate.record.completed",
            EventType::Unknown => "idemgate.record.unknown",
            EventType::FailedRetryable => "idemgate.record.failed_retryable",
            EventType::Released => "idemgate.record.released",
        }
    }

    pub fn parse(s: &str) -> Option<EventType> {
        EventType::ALL.into_iter().find(|t| t.as_str() == s)
    }

    /// The event of an operator's or the reconciler's resolution: as
    /// [`of`](Self::of), and an async operation sent back to the queue (it
    /// did not happen and runs again) is a release.
    pub fn of_resolution(state: Option<State>) -> Option<EventType> {
        match state {
            Some(State::Queued) => Some(EventType::Released),
            other => EventType::of(other),
        }
    }

    /// The event of a change that leaves a record in `state` (`None`: deleted).
    pub fn of(state: Option<State>) -> Option<EventType> {
        match state {
            Some(State::Completed) => Some(EventType::Completed),
            Some(State::Unknown) => Some(EventType::Unknown),
            Some(State::FailedRetryable) => Some(EventType::FailedRetryable),
            None => Some(EventType::Released),
            Some(State::InFlight | State::Queued | State::Processing) => None,
        }
    }
}

/// `[routes.events]` after validation.
#[derive(Debug, Clone)]
pub struct EventsConfig {
    /// Where events are POSTed.
    pub url: http::Uri,
    /// Key of the HMAC in `Idemgate-Signature`.
    pub secret: Option<Secret>,
    /// Bound on one delivery (connect and answer).
    pub timeout: Duration,
    /// Deliveries before an event is parked (visible, never dropped).
    pub max_attempts: u32,
    /// Which changes emit an event (default: all).
    pub emit: Vec<EventType>,
    /// Put the client's idempotency key in the event.
    pub include_key: bool,
    /// Put the stored response body in the event (base64).
    pub include_body: bool,
    /// Events per delivery: 1 POSTs each event alone (its id in
    /// `Idemgate-Event-Id`); more POSTs `{"events": [...]}` with up to this
    /// many, every time (see [`batch_payload`]).
    pub batch: usize,
    /// POSTs in flight to this receiver at once, at most (the smallest of
    /// the routes sharing it): a receiver at its defaults serves a few at a
    /// time (gunicorn: one), and the rest would wait out their timeout in
    /// its queue, then be sent again.
    pub concurrency: usize,
}

impl EventsConfig {
    /// Whether events for `self` and `other` can share one delivery: the
    /// same receiver, signed with the same key, in the same shape, under
    /// the same bound.
    pub fn same_destination(&self, other: &EventsConfig) -> bool {
        self.url == other.url
            && self.secret.as_ref().map(Secret::expose) == other.secret.as_ref().map(Secret::expose)
            && self.include_key == other.include_key
            && self.timeout == other.timeout
            && self.batch == other.batch
    }
}

/// Which operations emit which events: what the store consults when it
/// writes a state change (so the event goes into the same statement).
#[derive(Debug, Clone, Default)]
pub struct EventPolicies {
    by_operation: HashMap<Arc<str>, Policy>,
}

#[derive(Debug, Clone)]
struct Policy {
    emit: Vec<EventType>,
    include_body: bool,
}

impl EventPolicies {
    pub fn new<'a>(routes: impl IntoIterator<Item = (&'a Arc<str>, &'a EventsConfig)>) -> EventPolicies {
        let by_operation =
            routes.into_iter().map(|(op, e)| (op.clone(), Policy { emit: e.emit.clone(), include_body: e.include_body })).collect();
        EventPolicies { by_operation }
    }

    /// Whether a change of `operation` to `event` writes an event row.
    pub fn emits(&self, operation: &str, event: EventType) -> bool {
        self.by_operation.get(operation).is_some_and(|p| p.emit.contains(&event))
    }

    /// Whether events of `operation` carry the response body.
    pub fn include_body(&self, operation: &str) -> bool {
        self.by_operation.get(operation).is_some_and(|p| p.include_body)
    }

    /// Operations that emit `event` (for statements over many records).
    pub fn operations_emitting(&self, event: EventType) -> Vec<&str> {
        self.by_operation.iter().filter(|(_, p)| p.emit.contains(&event)).map(|(op, _)| &**op).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.by_operation.is_empty()
    }
}

/// Where an event stands in delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Delivery {
    /// Waiting for (its next) delivery.
    Pending,
    /// A receiver answered 2xx.
    Sent,
    /// `max_attempts` deliveries failed; kept until an operator redelivers it.
    Parked,
}

impl Delivery {
    pub fn as_str(self) -> &'static str {
        match self {
            Delivery::Pending => "pending",
            Delivery::Sent => "sent",
            Delivery::Parked => "parked",
        }
    }

    pub fn parse(s: &str) -> Option<Delivery> {
        [Delivery::Pending, Delivery::Sent, Delivery::Parked].into_iter().find(|d| d.as_str() == s)
    }
}

/// One outbox row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    /// Order of writing (per scope, deliveries follow it).
    pub seq: i64,
    /// Stable across redeliveries: `Idemgate-Event-Id`.
    pub id: uuid::Uuid,
    pub event_type: EventType,
    pub scope: Scope,
    /// The record's generation after the change (a release: the generation
    /// released; `None` only for releases written by earlier versions).
    pub generation: Option<Generation>,
    /// The recorded response status, if any.
    pub status: Option<u16>,
    pub operation_id: Option<String>,
    /// `cli`, `admin`, `reconciler`; `None` for the gateway's own request path.
    pub actor: Option<String>,
    pub at: Timestamp,
    /// The stored response body, when the route includes it.
    pub body: Option<Vec<u8>>,
    pub delivery: Delivery,
    pub attempts: i32,
    pub next_attempt_at: Timestamp,
    pub last_error: Option<String>,
    pub sent_at: Option<Timestamp>,
}

/// The JSON an event is delivered as (serialised straight from the event:
/// no intermediate `serde_json::Value` per field). Its keys are in
/// alphabetical order, as they always were; `body_base64` only when the
/// route includes the body, `key` only when it includes the key.
#[derive(Debug, Serialize)]
pub struct Payload<'a> {
    actor: Option<&'a str>,
    #[serde(serialize_with = "as_display")]
    at: Timestamp,
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "as_base64")]
    body_base64: Option<&'a [u8]>,
    generation: Option<i64>,
    #[serde(serialize_with = "as_display")]
    id: uuid::Uuid,
    operation_id: Option<&'a str>,
    scope: PayloadScope<'a>,
    state: &'static str,
    status: Option<u16>,
    #[serde(rename = "type")]
    kind: &'static str,
}

/// An event's scope as [`Payload`] carries it.
#[derive(Debug, Serialize)]
struct PayloadScope<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    key: Option<&'a str>,
    operation: &'a str,
    principal: &'a str,
    tenant: &'a str,
}

fn as_display<T: std::fmt::Display, S: serde::Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

fn as_base64<S: serde::Serializer>(body: &Option<&[u8]>, s: S) -> Result<S::Ok, S::Error> {
    match body {
        Some(body) => s.collect_str(&base64::display::Base64Display::new(body, &base64::engine::general_purpose::STANDARD)),
        None => s.serialize_none(),
    }
}

/// The JSON an event is delivered as.
pub fn payload(e: &OutboxEvent, include_key: bool) -> Payload<'_> {
    Payload {
        actor: e.actor.as_deref(),
        at: e.at,
        body_base64: e.body.as_deref(),
        generation: e.generation.map(|g| g.0),
        id: e.id,
        operation_id: e.operation_id.as_deref(),
        scope: PayloadScope {
            key: include_key.then(|| e.scope.key.as_str()),
            operation: &e.scope.operation,
            principal: &e.scope.principal,
            tenant: &e.scope.tenant,
        },
        state: e.event_type.as_str(),
        status: e.status,
        kind: e.event_type.type_name(),
    }
}

/// The JSON of a delivery of several events (a route with `batch` > 1):
/// `{"events": [...]}`, each as [`payload`] writes it, in `seq` order.
#[derive(Debug, Serialize)]
pub struct BatchPayload<'a> {
    events: Vec<Payload<'a>>,
}

pub fn batch_payload<'a>(events: &[&'a OutboxEvent], include_key: bool) -> BatchPayload<'a> {
    BatchPayload { events: events.iter().map(|e| payload(e, include_key)).collect() }
}

/// One event as operators see it (`idemgate events list --json`,
/// `GET /admin/events`): delivery state included, the body never.
pub fn event_json(e: &OutboxEvent) -> serde_json::Value {
    json!({
        "id": e.id.to_string(),
        "seq": e.seq,
        "type": e.event_type.as_str(),
        "scope": {
            "tenant": &*e.scope.tenant,
            "principal": &*e.scope.principal,
            "operation": &*e.scope.operation,
            "key": e.scope.key.as_str(),
        },
        "generation": e.generation.map(|g| g.0),
        "status": e.status,
        "actor": e.actor,
        "at": e.at.to_string(),
        "delivery": e.delivery.as_str(),
        "attempts": e.attempts,
        "next_attempt_at": e.next_attempt_at.to_string(),
        "last_error": e.last_error,
        "sent_at": e.sent_at.map(|t| t.to_string()),
    })
}

/// A table for `idemgate events list`.
pub fn events_table(events: &[OutboxEvent]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(out, "{:<36} {:<9} {:<16} {:<8} {:>8} {:<27} SCOPE", "ID", "DELIVERY", "TYPE", "STATUS", "ATTEMPTS", "AT");
    for e in events {
        let _ = writeln!(
            out,
            "{:<36} {:<9} {:<16} {:<8} {:>8} {:<27} {}/{}/{}/{}{}",
            e.id,
            e.delivery.as_str(),
            e.event_type.as_str(),
            e.status.map(|s| s.to_string()).unwrap_or_default(),
            e.attempts,
            e.at.to_string(),
            e.scope.tenant,
            e.scope.principal,
            e.scope.operation,
            e.scope.key.as_str(),
            e.last_error.as_deref().map(|l| format!("  (last error: {l})")).unwrap_or_default()
        );
    }
    let _ = writeln!(out, "{} event(s)", events.len());
    out
}

/// `Idemgate-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`.
/// The timestamp lets a receiver refuse old (replayed) deliveries; the MAC
/// covers it.
pub fn signature(secret: &[u8], unix_seconds: u64, body: &[u8]) -> String {
    // HMAC takes keys of any length; this cannot fail.
    let Ok(mut mac) = <Hmac<Sha256> as KeyInit>::new_from_slice(secret) else { return String::new() };
    mac.update(unix_seconds.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("t={unix_seconds},v1={}", hex::encode(mac.finalize().into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signature_is_an_hmac_over_timestamp_and_body() {
        let s = signature(b"k", 1_700_000_000, b"{}");
        assert!(s.starts_with("t=1700000000,v1="));
        assert_eq!(s, signature(b"k", 1_700_000_000, b"{}"));
        assert_ne!(s, signature(b"k", 1_700_000_001, b"{}"), "the timestamp is signed");
        assert_ne!(s, signature(b"other", 1_700_000_000, b"{}"));
        assert_ne!(s, signature(b"k", 1_700_000_000, b"{ }"));
        // Known answer (computed independently with openssl):
        // printf '1.{}' | openssl dgst -sha256 -hmac k
        assert_eq!(signature(b"k", 1, b"{}"), format!("t=1,v1={}", KNOWN));
    }

    #[test]
    fn an_event_is_delivered_as_this_json() {
        let event = OutboxEvent {
            seq: 7,
            id: "00000001-3201-89f0-9567-699acaa711fc".parse().unwrap(),
            event_type: EventType::Released,
            scope: Scope {
                tenant: "acme".into(),
                principal: "svc \"a\"".into(),
                operation: "create_order".into(),
                key: crate::idempotency::key::IdempotencyKey::new("k-1").unwrap(),
            },
            generation: Some(Generation(3)),
            status: Some(201),
            operation_id: None,
            actor: Some("cli".into()),
            at: Timestamp(1_700_000_000_123_456),
            body: Some(b"{\"id\":1}".to_vec()),
            delivery: Delivery::Pending,
            attempts: 0,
            next_attempt_at: Timestamp(0),
            last_error: None,
            sent_at: None,
        };
        // The wire form receivers have always had: keys in alphabetical
        // order, the body and the key only when the route includes them.
        let with = r#"{"actor":"cli","at":"2023-11-14T22:13:20.123456Z","body_base64":"eyJpZCI6MX0=","generation":3,"id":"00000001-3201-89f0-9567-699acaa711fc","operation_id":null,"scope":{"key":"k-1","operation":"create_order","principal":"svc \"a\"","tenant":"acme"},"state":"released","status":201,"type":"idemgate.record.released"}"#;
        assert_eq!(serde_json::to_string(&payload(&event, true)).unwrap(), with);
        let event = OutboxEvent { body: None, ..event };
        let without = r#"{"actor":"cli","at":"2023-11-14T22:13:20.123456Z","generation":3,"id":"00000001-3201-89f0-9567-699acaa711fc","operation_id":null,"scope":{"operation":"create_order","principal":"svc \"a\"","tenant":"acme"},"state":"released","status":201,"type":"idemgate.record.released"}"#;
        assert_eq!(serde_json::to_string(&payload(&event, false)).unwrap(), without);
        let batch = serde_json::to_string(&batch_payload(&[&event, &event], false)).unwrap();
        assert_eq!(batch, format!(r#"{{"events":[{without},{without}]}}"#));
    }

    const KNOWN: &str = "3dd49b2593d0f9a349e9e71c4bde3e2b862c2be4003fe9b4ba81332029310158";

    #[test]
    fn policies_say_who_emits_what() {
        let cfg = EventsConfig {
            url: "http://h/".parse().unwrap(),
            secret: None,
            timeout: Duration::from_secs(1),
            max_attempts: 3,
            emit: vec![EventType::Completed, EventType::Released],
            include_key: false,
            include_body: true,
            batch: 1,
            concurrency: 4,
        };
        let op: Arc<str> = "create_order".into();
        let p = EventPolicies::new([(&op, &cfg)]);
        assert!(p.emits("create_order", EventType::Completed));
        assert!(!p.emits("create_order", EventType::Unknown));
        assert!(!p.emits("other", EventType::Completed));
        assert!(p.include_body("create_order"));
        assert_eq!(p.operations_emitting(EventType::Released), vec!["create_order"]);
        assert_eq!(EventType::of(None), Some(EventType::Released));
        assert_eq!(EventType::of(Some(State::Queued)), None);
    }
}
