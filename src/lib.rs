//! idemgate: a reverse proxy that makes retried HTTP writes safe.
//!
//! A write carrying an `Idempotency-Key` is claimed in the store (one atomic,
//! committed statement) before it is forwarded; its response is recorded and
//! replayed to retries. docs/architecture.md draws the house; the subsystems,
//! in the order a request meets them:
//!
//! - [`server`]: the process around the request path: listeners and
//!   connections ([`server::listener`]), the drain on shutdown, applying a
//!   configuration ([`server::apply`]), reload on SIGHUP ([`server::reload`]), process signals ([`server::signals`]), and
//!   the background tasks that follow the routes ([`server::route_tasks`]).
//! - [`proxy`]: the request path: request ids and the access log
//!   ([`proxy::access`]), the enforcing path ([`proxy::gateway`]), the one
//!   admission step of every front and what a found record means for a
//!   request ([`proxy::admission`]), observe mode
//!   ([`proxy::observe`]), pass-through ([`proxy::passthrough`]), answers
//!   from a record ([`proxy::replay`]).
//! - [`request`]: what a request asks for: its route ([`request::route`]),
//!   who sends it ([`request::identity`], with [`request::identity::jwt`] and
//!   [`request::identity::mtls`]), whether they may ([`request::authorize`]),
//!   where its key comes from ([`request::key_source`]); and what a route
//!   carries for the background: async operations ([`request::async_op`]) and
//!   the reconcile probe ([`request::reconcile_probe`]).
//! - [`idempotency`]: the protocol's words as pure code: the key and its
//!   scope ([`idempotency::key`]), the request fingerprint
//!   ([`idempotency::fingerprint`]), the record and its state machine
//!   ([`idempotency::record`]), and how requests, async attempts and probes
//!   end ([`idempotency::outcome`], the words metrics count).
//! - [`store`]: one contract ([`store::contract`]) over PostgreSQL and
//!   embedded SQLite, with the audit trail ([`store::audit`]).
//! - [`executor`]: one attempt of a claimed request, forwarded and recorded
//!   fenced, for every front, classified by [`executor::classify`] (which
//!   observe mode shares); [`executor::waiters`] wakes the duplicates
//!   waiting on it.
//! - [`upstream`]: the HTTP client whose errors say whether the upstream may
//!   have executed a request, its pool, the body type ([`upstream::body`]) and
//!   the header rules ([`upstream::headers`]).
//! - [`problem`]: every error as an RFC 9457 problem, in one place.
//! - [`background`]: the background tasks: sweeper and lease reaper
//!   ([`background::housekeeping`]), async workers
//!   ([`background::async_worker`]), the reconciler
//!   ([`background::reconciler`]), the outbox relay
//!   ([`background::outbox_relay`]).
//! - [`outbox`]: completion events, written with the change they report.
//! - [`ops`]: the operator's side: the admin listener and API
//!   ([`ops::admin`]), the operator console it serves ([`ops::console`]),
//!   `idemgate keys` ([`ops::keys`]), the container health check
//!   ([`ops::healthcheck`]).
//! - [`telemetry`]: metrics ([`telemetry::metrics`]), the log
//!   ([`telemetry::logging`]), the store's counts ([`telemetry::stats`]), and
//!   warnings thinned during an outage ([`telemetry::throttle`]).
//! - [`config`]: the TOML file, validated into typed values (two stages).
//! - [`tls`]: rustls on the listeners, towards upstreams and PostgreSQL.
//! - [`retry`]: the one backoff and the one "until the lease runs out" loop.
//! - [`secret`]: values that never reach a log or an answer.
//! - [`demo`]: `idemgate demo`, the real gateway in front of a small service.

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
