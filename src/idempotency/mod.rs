//! The words of the protocol, as pure code (no I/O): the idempotency key and
//! the scope a record is found by, the request fingerprint that tells a
//! retry from a different request, and the record with its state machine.
//!
//! - [`key`]: [`key::IdempotencyKey`] (validated) and [`key::Scope`]
//!   (tenant, principal, operation, key).
//! - [`fingerprint`]: the SHA-256 over a request's canonical form.
//! - [`record`]: records and their state machine ([`record::decide`],
//!   [`record::transition`]), which both stores and the request path ask.
//! - [`outcome`]: how a request, an async attempt or a reconcile probe ended,
//!   and what enforcing would have done with an observed request: the words
//!   metrics and the access log count.

pub mod fingerprint;
pub mod key;
pub mod outcome;
pub mod record;
