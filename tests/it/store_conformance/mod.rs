//! Store conformance (CONTRACT.md section 4): one suite of store-level cases,
//! written once against the library `Store` API and run against every
//! backend, one file per concern of the store's contract
//! (`src/store/contract/`): `records`, `queue`, `reconcile`, `events`,
//! `trail`, `lifecycle`. Each file runs its cases on PostgreSQL and the
//! embedded SQLite store (`on_both_stores!`: modules `on_postgres`,
//! `on_sqlite`), through PgBouncer in transaction mode (`on_pgbouncer!`:
//! every statement and transaction of the store crosses the pooler; the
//! tests' own SQL goes to PostgreSQL directly) and on a Citus cluster
//! (`on_citus!`). Then `faults`: PostgreSQL-only cases with a TCP fault
//! proxy between the `Store` and the server (ambiguous commits, an
//! unreachable or hung store, a server restart), and tests of the proxy.
//! This module holds what the files share: opening a store on a backend,
//! requests, and reading records back.
//!
//! Leases and retention are 150 ms with sleeps just past them; "live" ones
//! are a minute, so no case depends on how fast this machine is.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

mod events;
mod faults;
mod lifecycle;
mod queue;
mod reconcile;
mod records;
mod trail;

use crate::support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idemgate::config::{Secret, StoreBackend, StoreConfig};
use idemgate::idempotency::fingerprint::Fingerprint;
use idemgate::idempotency::key::{IdempotencyKey, Scope};
use idemgate::idempotency::record::{Record, ReforwardKey, StoredResponse, Timestamp};
use idemgate::outbox::{EventPolicies, EventType, EventsConfig, OutboxEvent};
use idemgate::store::audit::{Actor, AuditNote};
use idemgate::store::{Acceptance, Claim, ClaimOutcome, ClaimRequest, ListFilter, Resolution, Store, Taken, WorkerRoute};
use support::Backend;
use uuid::Uuid;

/// A lease or retention that ends within the test.
const SHORT: Duration = Duration::from_millis(150);
/// Sleep this long to be past `SHORT` (sleeps last at least this long, and
/// both stores' clocks are this machine's).
const PAST_SHORT: Duration = Duration::from_millis(250);
/// A lease or retention that does not end within the test.
const LONG: Duration = Duration::from_secs(60);
/// The upstream timeout async attempts are marked sent with.
const AT_UPSTREAM: Duration = Duration::from_secs(1);

fn store_config(backend: &Backend, timeout: Duration, pool_size: usize) -> StoreConfig {
    let backend = match backend {
        Backend::Postgres { url } => StoreBackend::Postgres { url: Secret::new(url.clone()), pool_size, pooler: Default::default() },
        Backend::Citus { url } => StoreBackend::Citus { url: Secret::new(url.clone()), pool_size, pooler: Default::default() },
        Backend::Pooled { url, pooler, .. } => {
            StoreBackend::Postgres { url: Secret::new(url.clone()), pool_size, pooler: support::gateway::pooler_named(pooler) }
        }
        Backend::Sqlite { path, .. } => StoreBackend::Sqlite { path: path.clone() },
    };
    StoreConfig {
        backend,
        migrate: true,
        unreachable_at_start: Default::default(),
        operation_timeout: timeout,
        sweep_interval: Duration::from_secs(1),
        sweep_batch: 100,
        events_retention: Duration::from_secs(3600),
    }
}

async fn open_with(backend: &Backend, timeout: Duration, pool_size: usize) -> Store {
    let store = Store::open(&store_config(backend, timeout, pool_size), idemgate::store::Access::Migrate).await.expect("open store");
    store.migrate().await.expect("migrate");
    store
}

async fn open(backend: &Backend) -> Store {
    open_with(backend, Duration::from_secs(5), 8).await
}

fn scope(tenant: &str, principal: &str, operation: &str, key: &str) -> Scope {
    Scope { tenant: tenant.into(), principal: principal.into(), operation: operation.into(), key: IdempotencyKey::new(key).unwrap() }
}

fn key(k: &str) -> Scope {
    scope("acme", "billing", "create_order", k)
}

fn fp(b: u8) -> Fingerprint {
    Fingerprint([b; 32])
}

fn req(scope: &Scope, hash: u8, lease: Duration, upstream_idempotent: bool) -> ClaimRequest {
    ClaimRequest {
        scope: scope.clone(),
        request_hash: fp(hash),
        owner: "replica-a".into(),
        lease,
        reforward: upstream_idempotent.then_some(ReforwardKey::Derived),
        sent: idemgate::idempotency::record::ReforwardKey::Derived,
        fingerprint_spec: "test-settings".into(),
        claim_token: Uuid::new_v4(),
        acceptance: None,
        key_source: "header:idempotency-key".into(),
        request_head: None,
    }
}

/// An async acceptance of `scope` (operation id derived from the key).
fn accept_req(scope: &Scope, hash: u8) -> ClaimRequest {
    ClaimRequest {
        acceptance: Some(Acceptance { operation_id: format!("op_{}", scope.key.as_str()), request: Bytes::from_static(b"stored request") }),
        ..req(scope, hash, LONG, false)
    }
}

fn worker_route(operation: &str, lease: Duration) -> WorkerRoute {
    WorkerRoute { operation: operation.into(), lease, reforwardable: false, sent_on_take: None }
}

fn response(status: u16, body: &'static [u8]) -> StoredResponse {
    StoredResponse { status, headers: vec![("content-type".into(), b"application/json".to_vec())], body: Some(Bytes::from_static(body)) }
}

async fn claim(store: &Store, r: &ClaimRequest) -> Claim {
    match store.claim(r).await.expect("claim") {
        ClaimOutcome::Claimed(c) => c,
        ClaimOutcome::Existing { record, .. } => panic!("expected to claim {:?}, found {record:?}", r.scope),
    }
}

async fn existing(store: &Store, r: &ClaimRequest) -> (Record, Timestamp) {
    match store.claim(r).await.expect("claim") {
        ClaimOutcome::Existing { record, now } => (record, now),
        ClaimOutcome::Claimed(c) => panic!("expected an existing record for {:?}, claimed {c:?}", r.scope),
    }
}

async fn get(store: &Store, s: &Scope) -> Option<Record> {
    store.get(s).await.expect("get").map(|(r, _)| r)
}

async fn row(store: &Store, s: &Scope) -> Record {
    get(store, s).await.unwrap_or_else(|| panic!("no row for {s:?}"))
}

async fn all(store: &Store) -> Vec<Record> {
    store.list(&ListFilter { limit: 1000, ..ListFilter::default() }).await.expect("list")
}

fn keys_of(records: &[Record]) -> Vec<String> {
    records.iter().map(|r| r.scope.key.as_str().to_owned()).collect()
}

fn key_set(records: &[Record]) -> BTreeSet<String> {
    keys_of(records).into_iter().collect()
}

fn set(keys: &[&str]) -> BTreeSet<String> {
    keys.iter().map(|k| (*k).to_owned()).collect()
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap()
}

/// The store clock at which a claim was made (a claim's lease is "now + lease").
fn claimed_at(c: &Claim, lease: Duration) -> Timestamp {
    Timestamp(c.lease_expires_at.0 - micros(lease))
}

fn note(reason: &str) -> AuditNote {
    AuditNote { actor: Actor::Cli, reason: reason.into(), forced: false, caller: None }
}

const RELEASE: Resolution = Resolution::Release { force: false };

async fn take(store: &Store, routes: &[WorkerRoute], owner: &str) -> Option<Taken> {
    store.take(routes, owner).await.expect("take")
}

fn events_config(include_body: bool) -> EventsConfig {
    EventsConfig {
        url: "http://127.0.0.1:9/hook".parse().unwrap(),
        secret: None,
        timeout: Duration::from_secs(1),
        max_attempts: 3,
        emit: EventType::ALL.to_vec(),
        include_key: false,
        include_body,
        batch: 1,
        concurrency: 4,
    }
}

/// A store whose `create_order` and `charge` operations emit events (charge with bodies).
async fn open_with_events(backend: &Backend) -> Store {
    let (plain, with_body) = (events_config(false), events_config(true));
    let (op, charge): (Arc<str>, Arc<str>) = ("create_order".into(), "charge".into());
    open(backend).await.with_events(EventPolicies::new([(&op, &plain), (&charge, &with_body)]))
}

async fn all_events(store: &Store) -> Vec<OutboxEvent> {
    store.events(None, 1000).await.expect("events")
}

/// Runs SQL against the backend's database from outside the store.
async fn raw_sql(backend: &Backend, sql: &str) {
    match backend {
        Backend::Postgres { url } | Backend::Citus { url } | Backend::Pooled { direct: url, .. } => {
            let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
            let task = tokio::spawn(conn);
            if matches!(backend, Backend::Citus { .. }) {
                // Citus propagates DDL statement by statement, not from a
                // multi-statement query: one statement per line, or per
                // `; ` outside a function body.
                for line in sql.lines().filter(|l| !l.trim().is_empty()) {
                    let statements: Vec<&str> = if line.contains("$$") { vec![line] } else { line.split("; ").collect() };
                    for statement in statements {
                        client.batch_execute(statement).await.expect("raw sql");
                    }
                }
            } else {
                client.batch_execute(sql).await.expect("raw sql");
            }
            drop(client);
            let _ = task.await;
        }
        Backend::Sqlite { path, .. } => {
            let conn = rusqlite::Connection::open(path).expect("open sqlite");
            conn.busy_timeout(Duration::from_secs(5)).unwrap();
            conn.execute_batch(sql).expect("raw sql");
        }
    }
}
