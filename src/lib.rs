//! idemgate: a reverse proxy that makes retried HTTP writes safe.
//!
//! A write carrying an `Idempotency-Key` is claimed in the store (one atomic,
//! committed statement) before it is forwarded; its response is recorded and
//! replayed to retries.
//!
//! The module map (what each folder holds, the order a request meets them,
//! and where a new admission step, store statement or setting goes) is
//! `docs/architecture.md`, in one place; each module's own opening comment
//! says what it is.

#![forbid(unsafe_code)]

pub mod background;
pub mod config;
pub mod demo;
pub mod executor;
pub mod idempotency;
pub mod ops;
pub mod outbox;
pub mod problem;
pub mod proxy;
pub mod request;
pub mod retry;
pub mod secret;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod upstream;
