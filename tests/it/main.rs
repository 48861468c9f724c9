//! The integration tests, as one test binary (one link of the crate instead
//! of one per file: see docs/architecture.md, "Tests"). Each file is a module
//! named after what it tests; `support` is the shared harness. Run one file's
//! tests with `cargo test --test it <module>::`.
#[macro_use]
mod support;

mod admin_api;
mod admin_trail;
mod async_faults;
mod async_mode;
mod authorize;
mod citus_cluster;
mod citus_faults;
mod citus_hazards;
mod citus_plans;
mod citus_write_cost;
mod cli;
mod console;
mod demo;
mod deploy;
mod edge;
mod edge_identity;
mod embedded;
mod events;
mod faults;
mod field_order;
mod frameworks;
mod ha;
mod hardening;
mod jwt;
mod legacy;
mod logging;
mod operating;
mod operator;
mod overload;
mod pg_harness;
mod pg_plans;
mod pg_roles;
mod pooler;
mod proxy;
mod readiness;
mod reload;
mod replay_cache;
mod runbook;
mod signals;
mod soak;
mod store_conformance;
mod telemetry;
mod tls;
mod unknown_window;
