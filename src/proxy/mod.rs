//! The request path on the proxy listener, in the order a request meets it:
//!
//! - [`access`]: the request id and the access-log line of every answer.
//! - [`gateway`]: route, identify, authorize, key, fingerprint, claim, then
//!   hand the attempt to the [`crate::executor`] or answer from the record.
//! - [`admission`]: one admission pipeline for every front (a claim request
//!   or where and why it stopped), and what the record a claim found means
//!   for this request.
//! - [`observe`]: observe mode, pass-through that works out what enforcing
//!   would have done.
//! - [`fingerprints`]: the fingerprint settings each operation has had,
//!   for a request that fingerprints differently from its record.
//! - [`passthrough`]: requests without idempotency, streamed both ways.
//! - [`replay`]: answers out of a record.
//! - [`state`]: what outlives configurations and what one configuration
//!   decides, shared by every event loop's gateway.

pub mod access;
pub mod admission;
pub mod fingerprints;
pub mod gateway;
pub mod observe;
pub mod passthrough;
pub mod replay;
pub mod state;
