//! idemgate: a reverse proxy that makes retried HTTP writes safe.
//!
//! A write carrying an `Idempotency-Key` is claimed in the store (one atomic,
//! committed statement) before it is forwarded; its response is recorded and
//! replayed to retries. The modules, from the outside in:
//!
//! - [`config`]: the TOML file, validated into typed values (two stages).
//! - [`server`]: listeners, connections, the drain on shutdown.
//! - [`access`]: request ids and the access log.
//! - [`gateway`]: the request path — route, identify, fingerprint, claim,
//!   then hand the attempt to the executor, or answer from the record.
//! - [`executor`]: forwards one claimed attempt, classifies the outcome by
//!   whether the upstream may have executed it, records it fenced.
//! - [`passthrough`]: requests without idempotency, streamed both ways.
//! - [`observe`]: observe mode — pass-through that records what enforcing
//!   would have done, within a store budget.
//! - [`waiters`]: local wake-ups for duplicates waiting on a result.
//! - [`operation`], [`worker`]: async mode — accepted operations, their
//!   stored requests and status documents, and the workers that run them.
//! - [`route`], [`identity`], [`scope`], [`keysource`], [`fingerprint`]: what
//!   a request is (operation, tenant and principal, key and where it came
//!   from, fingerprint).
//! - [`record`]: records and their state machine (pure code).
//! - [`store`]: one interface over PostgreSQL and embedded SQLite.
//! - [`upstream`]: the HTTP client, whose errors say whether the upstream may
//!   have executed the request.
//! - [`problem`]: every error as an RFC 9457 problem, in one place.
//! - [`replay`], [`headers`], [`body`]: responses out of records.
//! - [`admin`], [`metrics`], [`background`]: health, Prometheus, sweeper and
//!   lease reaper.
//! - [`route_tasks`]: the background work that follows the routes in force
//!   (workers, reaper, reconciler, relay), restarted by a reload.
//! - [`keys`], [`demo`], [`healthcheck`]: operator commands, the built-in
//!   demo, and the container health check.
//! - [`keys`], [`demo`]: operator commands and the built-in demo.
//! - [`reconcile`]: the probe that settles `unknown` records by asking the
//!   upstream, and the reconciler task that runs it.
//! - [`logging`], [`signals`]: the process around the gateway — log settings
//!   and a writer that never fails a request, and the cancellation root
//!   (SIGTERM/SIGINT) with SIGHUP as events.
//! - [`tls`]: rustls on the listeners (ALPN h2, client certificates, reload
//!   on SIGHUP) and towards upstreams.

#![forbid(unsafe_code)]

pub mod access;
pub mod admin;
pub mod audit;
pub mod authorize;
pub mod background;
pub mod body;
pub mod config;
pub mod console;
pub mod demo;
pub mod executor;
pub mod fingerprint;
pub mod gateway;
pub mod headers;
pub mod healthcheck;
pub mod identity;
pub mod jwt;
pub mod keys;
pub mod keysource;
pub mod listener;
pub mod logging;
pub mod metrics;
pub mod observe;
pub mod operation;
pub mod outbox;
pub mod passthrough;
pub mod probe;
pub mod problem;
pub mod reconcile;
pub mod record;
pub mod relay;
pub mod reload;
pub mod replay;
pub mod route;
pub mod route_tasks;
pub mod scope;
pub mod secret;
pub mod server;
pub mod signals;
pub mod stats;
pub mod store;
pub mod throttle;
pub mod tls;
pub mod upstream;
pub mod waiters;
pub mod worker;
