//! The Citus hazards of issue 30 (docs/scaling.md, "What does not work as
//! is"), each on the test cluster through the library `Store`, with many
//! tenants (so several shards on both workers):
//!
//! - a batch of claims that mixes tenants;
//! - background takes (`FOR UPDATE SKIP LOCKED`) across shards, by several
//!   replicas at once;
//! - generations drawn with `nextval()`, which Citus refuses in a
//!   distributed `UPDATE`, and which must still grow per scope when the
//!   counter is behind (a shard moved to a node whose counter is lower);
//! - the outbox's and the audit trail's keys, which must contain the tenant.
//!
//! Each test steps aside, with one line on stderr, when Citus is not installed.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idemgate::config::{Secret, StoreBackend, StoreConfig};
use idemgate::idempotency::fingerprint::Fingerprint;
use idemgate::idempotency::key::{IdempotencyKey, Scope};
use idemgate::idempotency::record::Retention;
use idemgate::idempotency::record::{Generation, ReforwardKey, State, StoredResponse};
use idemgate::outbox::{EventPolicies, EventType, EventsConfig};
use idemgate::store::audit::{Actor, AuditNote};
use idemgate::store::{
    Acceptance, Access, ClaimOutcome, ClaimRequest, ProbeRoute, Resolution, ResolveOutcome, Store, WorkerRoute, WriteOutcome,
};
use support::citus;
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(60);
const SHORT: Duration = Duration::from_millis(150);

async fn store(url: &str) -> Store {
    let config = StoreConfig {
        backend: StoreBackend::Citus { url: Secret::new(url.to_owned()), pool_size: 8, pooler: Default::default() },
        migrate: true,
        unreachable_at_start: Default::default(),
        operation_timeout: Duration::from_secs(10),
        sweep_interval: Duration::from_secs(1),
        sweep_batch: 100,
        events_retention: Duration::from_secs(3600),
    };
    let store = Store::open(&config, Access::Migrate).await.expect("store");
    store.migrate().await.expect("migrate");
    store
}

fn scope(tenant: &str, key: &str) -> Scope {
    Scope { tenant: tenant.into(), principal: "billing".into(), operation: "create_order".into(), key: IdempotencyKey::new(key).unwrap() }
}

fn req(scope: &Scope, lease: Duration, upstream_idempotent: bool) -> ClaimRequest {
    ClaimRequest {
        scope: scope.clone(),
        request_hash: Fingerprint([7; 32]),
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

fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse { status: 201, headers: vec![], body: Some(Bytes::from_static(body)) }
}

fn tenants(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("tenant-{i:02}")).collect()
}

async fn client(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
    tokio::spawn(conn);
    client
}

/// Claims of many tenants arriving together (the PostgreSQL store puts them
/// in one batched statement, whose arrays Citus cannot route: "could not
/// create distributed plan"): each is claimed once, in its own tenant's
/// shard, and completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_many_tenants_at_once_each_route_to_their_shard() {
    if citus::skip_unless_installed() {
        return;
    }
    let url = citus::shared().create_unique_database("mixed").expect("database");
    let store = store(&url).await;
    let scopes: Vec<Scope> = tenants(16).iter().flat_map(|t| (0..3).map(move |k| scope(t, &format!("k{k}")))).collect();
    let barrier = Arc::new(tokio::sync::Barrier::new(scopes.len()));
    let mut tasks = Vec::new();
    for s in &scopes {
        let (store, barrier, r) = (store.clone(), barrier.clone(), req(s, LONG, false));
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let claim = match store.claim(&r).await.expect("claim") {
                ClaimOutcome::Claimed(c) => c,
                other => panic!("{:?}: {other:?}", r.scope),
            };
            assert_eq!(store.complete(&claim, &response(b"done"), Retention::For(LONG)).await.expect("complete"), WriteOutcome::Written);
            claim
        }));
    }
    // Generations are drawn per tenant, on its shard (no counter is shared
    // between tenants): distinct within each tenant.
    let mut generations = BTreeSet::new();
    for t in tasks {
        let c = t.await.expect("task");
        assert!(
            generations.insert((c.scope.tenant.clone(), c.generation)),
            "generation {:?} of {} drawn twice",
            c.generation,
            c.scope.tenant
        );
    }
    for s in &scopes {
        let (record, _) = store.get(s).await.expect("get").expect("record");
        assert_eq!(
            (record.state, record.response.as_ref().and_then(|r| r.body.clone())),
            (State::Completed, Some(Bytes::from_static(b"done")))
        );
    }
    // Each tenant's records sit on one shard; the tenants spread over both workers.
    let db = client(&url).await;
    let nodes: i64 = db
        .query_one(
            "SELECT count(DISTINCT nodeport) FROM pg_dist_shard_placement p JOIN pg_dist_shard s USING (shardid) \
             WHERE s.logicalrelid = 'idemgate_records'::regclass \
               AND shardid IN (SELECT get_shard_id_for_distribution_column('idemgate_records', t) FROM unnest($1::text[]) t)",
            &[&tenants(16)],
        )
        .await
        .expect("placements")
        .get(0);
    assert_eq!(nodes, 2, "16 tenants land on both workers");
}

/// Several replicas' workers take queued operations of many tenants at once
/// (the PostgreSQL take is one `FOR UPDATE SKIP LOCKED` over all tenants,
/// which Citus refuses across shards): every operation is taken exactly
/// once, none is left behind, each under its own new generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_workers_of_several_replicas_take_every_tenants_operations_once() {
    if citus::skip_unless_installed() {
        return;
    }
    let url = citus::shared().create_unique_database("take").expect("database");
    let replicas = [store(&url).await, store(&url).await, store(&url).await];
    let mut queued = BTreeSet::new();
    for (i, t) in tenants(12).iter().enumerate() {
        for k in 0..2 {
            let s = scope(t, &format!("op{k}"));
            let r = ClaimRequest {
                acceptance: Some(Acceptance { operation_id: format!("op_{i}_{k}"), request: Bytes::from_static(b"stored request") }),
                ..req(&s, LONG, false)
            };
            assert!(matches!(replicas[0].claim(&r).await.expect("accept"), ClaimOutcome::Claimed(_)));
            queued.insert(format!("{}/{}", s.tenant, s.key.as_str()));
        }
    }
    let routes = [WorkerRoute { operation: "create_order".into(), lease: LONG, reforwardable: false, sent_on_take: None }];
    let mut workers = Vec::new();
    for (n, replica) in replicas.iter().enumerate() {
        for w in 0..2 {
            let (store, routes) = (replica.clone(), routes.clone());
            workers.push(tokio::spawn(async move {
                let mut taken = Vec::new();
                while let Some(t) = store.take(&routes, &format!("r{n}-w{w}")).await.expect("take") {
                    taken.push(t);
                }
                taken
            }));
        }
    }
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut generations = BTreeSet::new();
    for w in workers {
        for t in w.await.expect("worker") {
            *seen.entry(format!("{}/{}", t.record.scope.tenant, t.record.scope.key.as_str())).or_default() += 1;
            assert!(
                generations.insert((t.record.scope.tenant.clone(), t.claim.generation)),
                "generation {:?} of {} twice",
                t.claim.generation,
                t.record.scope.tenant
            );
            assert_eq!((t.record.state, t.record.attempts), (State::Processing, 1));
        }
    }
    assert!(seen.values().all(|&n| n == 1), "each operation taken once: {seen:?}");
    assert_eq!(seen.keys().cloned().collect::<BTreeSet<_>>(), queued, "none left behind");
}

/// Take-overs and resolutions draw new generations without `nextval()` in
/// a distributed `UPDATE` (Citus: "functions used in UPDATE queries on
/// distributed tables must not be VOLATILE"), and a scope's generation
/// grows even when the counter is behind the record (as after a shard moved
/// to a node whose counter is lower): the old holder stays fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generations_grow_per_scope_without_a_volatile_update_even_with_the_counter_behind() {
    if citus::skip_unless_installed() {
        return;
    }
    let url = citus::shared().create_unique_database("gens").expect("database");
    let store = store(&url).await;
    let s = scope("tenant-gen", "k");
    let first = match store.claim(&req(&s, SHORT, true)).await.expect("claim") {
        ClaimOutcome::Claimed(c) => c,
        other => panic!("{other:?}"),
    };
    tokio::time::sleep(Duration::from_millis(250)).await;
    let second = match store.claim(&req(&s, SHORT, true)).await.expect("take over") {
        ClaimOutcome::Claimed(c) => c,
        other => panic!("{other:?}"),
    };
    assert!(second.took_over && second.generation > first.generation);
    assert_eq!(store.complete(&first, &response(b"old"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Fenced);

    // The counter falls behind every record.
    let db = client(&url).await;
    db.batch_execute("UPDATE idemgate_generations SET generation = 1 WHERE tenant = 'tenant-gen'").await.expect("counter set back");
    tokio::time::sleep(Duration::from_millis(250)).await;
    let third = match store.claim(&req(&s, SHORT, true)).await.expect("take over") {
        ClaimOutcome::Claimed(c) => c,
        other => panic!("{other:?}"),
    };
    assert!(third.generation > second.generation, "{:?} after {:?}", third.generation, second.generation);
    assert_eq!(store.complete(&second, &response(b"old"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(store.complete(&third, &response(b"new"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);

    // An operator's resolution draws one too.
    let note = AuditNote { actor: Actor::Cli, reason: "corrected by hand".into(), forced: true, caller: None };
    let resolution = Resolution::Complete { response: response(b"fixed"), retention: Retention::For(LONG), force: true };
    assert_eq!(store.resolve(&s, &resolution, &note).await.unwrap(), ResolveOutcome::Resolved { from: State::Completed });
    let (record, _) = store.get(&s).await.unwrap().unwrap();
    assert!(record.generation > third.generation, "{:?} after {:?}", record.generation, third.generation);
    assert!(record.generation > Generation(0));
}

/// Events and audit rows of many tenants live on their tenants' shards
/// under keys that include the tenant (a distributed table's unique keys
/// must): a final state writes its event, a resolution its audit row, in
/// the change's own single-shard transaction; the relay leases and
/// delivers every tenant's events once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_and_audit_rows_of_every_tenant_sit_with_their_records() {
    if citus::skip_unless_installed() {
        return;
    }
    let url = citus::shared().create_unique_database("outbox").expect("database");
    let store = store_with_events(&url).await;
    let note = AuditNote { actor: Actor::Cli, reason: "released by hand".into(), forced: false, caller: None };
    for t in tenants(8) {
        let done = scope(&t, "done");
        let c = match store.claim(&req(&done, LONG, false)).await.unwrap() {
            ClaimOutcome::Claimed(c) => c,
            other => panic!("{other:?}"),
        };
        assert_eq!(store.complete(&c, &response(b"ok"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
        let lost = scope(&t, "lost");
        let c = match store.claim(&req(&lost, LONG, false)).await.unwrap() {
            ClaimOutcome::Claimed(c) => c,
            other => panic!("{other:?}"),
        };
        assert_eq!(store.mark_unknown(&c).await.unwrap(), WriteOutcome::Written);
        let out = store.resolve(&lost, &Resolution::Release { force: false }, &note).await.unwrap();
        assert_eq!(out, ResolveOutcome::Resolved { from: State::Unknown });
    }
    // Each tenant's rows on the node of its records' shard (colocation).
    let db = client(&url).await;
    let node_of = |table: &'static str, tenant: String| {
        let db = &db;
        async move {
            let row = db
                .query_one(
                    "SELECT nodeport::int8 FROM pg_dist_shard_placement WHERE shardid = get_shard_id_for_distribution_column($1::text::regclass, $2::text)",
                    &[&table, &tenant],
                )
                .await
                .expect("placement");
            row.get::<_, i64>(0)
        }
    };
    for t in tenants(8) {
        let records = node_of("idemgate_records", t.clone()).await;
        for table in ["idemgate_events", "idemgate_audit"] {
            let n: i64 = db.query_one(&format!("SELECT count(*) FROM {table} WHERE tenant = $1"), &[&t]).await.unwrap().get(0);
            assert!(n > 0, "{table} has rows of {t}");
            assert_eq!(node_of(table, t.clone()).await, records, "{table} of {t} beside its records");
        }
    }
    let audit = store.audit(100).await.unwrap();
    assert_eq!(audit.len(), 8);
    // The relay leases every tenant's events (completed, unknown, released), delivers them, and none is left.
    let relay = Uuid::new_v4();
    let mut delivered = 0;
    loop {
        let events = store.take_events(&["create_order"], 5, LONG, relay).await.unwrap();
        if events.is_empty() {
            break;
        }
        let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
        delivered += store.events_delivered(&seqs, relay).await.unwrap().len();
    }
    assert_eq!(delivered, 24);
    let pending = store.event_stats().await.unwrap().pending;
    assert_eq!(pending, 0);
}

/// A worker dies mid-traffic: claims of the tenants whose shards it holds
/// fail closed (an error, nothing claimed, nothing to forward), the other
/// worker's tenants keep being served; once it is back, the failed claims
/// succeed once and nothing is doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_fails_its_tenants_claims_closed_and_the_others_keep_serving() {
    if citus::skip_unless_installed() {
        return;
    }
    let mut cluster = citus::CitusCluster::start(2).expect("a cluster of its own");
    let url = cluster.create_database("faults").expect("database");
    let store = {
        let config = StoreConfig {
            backend: StoreBackend::Citus { url: Secret::new(url.clone()), pool_size: 4, pooler: Default::default() },
            migrate: true,
            unreachable_at_start: Default::default(),
            operation_timeout: Duration::from_secs(3),
            sweep_interval: Duration::from_secs(1),
            sweep_batch: 100,
            events_retention: Duration::from_secs(3600),
        };
        let store = Store::open(&config, Access::Migrate).await.expect("store");
        store.migrate().await.expect("migrate");
        store
    };
    // Which worker holds each tenant's shard.
    let db = client(&url).await;
    let mut on: BTreeMap<i64, Vec<String>> = BTreeMap::new();
    for t in tenants(16) {
        let port: i64 = db
            .query_one(
                "SELECT nodeport::int8 FROM pg_dist_shard_placement \
                 WHERE shardid = get_shard_id_for_distribution_column('idemgate_records', $1::text)",
                &[&t],
            )
            .await
            .unwrap()
            .get(0);
        on.entry(port).or_default().push(t);
    }
    let dead_port = i64::from(cluster.workers[0].port());
    let (dead, alive) = (on[&dead_port].clone(), on.iter().find(|(p, _)| **p != dead_port).map(|(_, t)| t.clone()).unwrap());
    assert!(!dead.is_empty() && !alive.is_empty(), "{on:?}");

    cluster.workers[0].kill9().expect("kill the worker");
    for t in &dead {
        let out = store.claim(&req(&scope(t, "during"), LONG, false)).await;
        assert!(out.is_err(), "{t}: a claim on the dead worker's shard must fail closed: {out:?}");
    }
    for t in &alive {
        match store.claim(&req(&scope(t, "during"), LONG, false)).await.expect("claim on the live worker") {
            ClaimOutcome::Claimed(c) => {
                assert_eq!(store.complete(&c, &response(b"ok"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written)
            }
            other => panic!("{t}: {other:?}"),
        }
    }

    cluster.workers[0].start_again().expect("the worker comes back");
    let mut retried = 0;
    for t in &dead {
        let s = scope(t, "during");
        // The first statements after the restart may still meet a broken
        // cached connection: a client retries, as it would after a 503.
        let mut outcome = None;
        for _ in 0..20 {
            match store.claim(&req(&s, LONG, false)).await {
                Ok(o) => {
                    outcome = Some(o);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        }
        match outcome.expect("claims succeed once the worker is back") {
            ClaimOutcome::Claimed(c) => {
                assert_eq!(store.complete(&c, &response(b"ok"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
                retried += 1;
            }
            other => panic!("{t}: the failed claim left a record behind: {other:?}"),
        }
    }
    assert_eq!(retried, dead.len());
    // One record per scope, every one completed once.
    let n: i64 = db.query_one("SELECT count(*) FROM idemgate_records", &[]).await.unwrap().get(0);
    assert_eq!(n as usize, dead.len() + alive.len());
    let completed: i64 = db.query_one("SELECT count(*) FROM idemgate_records WHERE state = 'completed'", &[]).await.unwrap().get(0);
    assert_eq!(completed, n);
}

/// One tenant's concurrent claims share statements on Citus (the tenant's
/// read and insert queues, `src/store/postgres/citus_batch.rs`) and keep
/// the claim's rules. A transaction holds an uncommitted row of one key, so
/// the first claim's insert of that key waits, and the claims arriving
/// meanwhile queue behind it and go in as one multi-row insert: new keys
/// claimed twice at once (one wins, the other sees the winner's attempt),
/// completed keys (replayed), expired attempts claimed twice by requests
/// that may take them over (one takes over under a higher generation, the
/// other sees its attempt), and the held key itself (its insert lost: the
/// claim sees the other transaction's row).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_concurrent_claims_share_statements_and_keep_the_rules() {
    if citus::skip_unless_installed() {
        return;
    }
    let url = citus::shared().create_unique_database("batched").expect("database");
    let store = store(&url).await;
    let tenant = "solo";
    for k in 0..4 {
        let claim = match store.claim(&req(&scope(tenant, &format!("c{k}")), LONG, false)).await.expect("claim") {
            ClaimOutcome::Claimed(c) => c,
            other => panic!("c{k}: {other:?}"),
        };
        assert_eq!(store.complete(&claim, &response(b"done"), Retention::For(LONG)).await.expect("complete"), WriteOutcome::Written);
    }
    let mut expired = BTreeMap::new();
    for k in 0..3 {
        match store.claim(&req(&scope(tenant, &format!("x{k}")), SHORT, true)).await.expect("claim") {
            ClaimOutcome::Claimed(c) => expired.insert(format!("x{k}"), c.generation),
            other => panic!("x{k}: {other:?}"),
        };
    }
    tokio::time::sleep(SHORT * 3).await;

    let holder = client(&url).await;
    holder.batch_execute("BEGIN").await.expect("begin");
    holder
        .execute(
            "INSERT INTO idemgate_records (tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, \
             owner, lease_expires_at, created_at, updated_at, expires_at, key_source, scope_id) \
             VALUES ('solo', 'billing', 'create_order', 'held', decode(repeat('07', 32), 'hex'), 'in_flight', 1, \
             gen_random_uuid(), 'another-replica', now() + interval '1 hour', now(), now(), now() + interval '1 hour', \
             'header:idempotency-key', idemgate_scope_id('solo', 'billing', 'create_order', 'held'))",
            &[],
        )
        .await
        .expect("the held row");
    let spawn = |key: String, upstream_idempotent: bool| {
        let store = store.clone();
        tokio::spawn(async move {
            let outcome = store.claim(&req(&scope("solo", &key), LONG, upstream_idempotent)).await.expect("claim");
            (key, outcome)
        })
    };
    let mut tasks = vec![spawn("held".into(), false)];
    tokio::time::sleep(Duration::from_millis(300)).await;
    for k in 0..8 {
        tasks.push(spawn(format!("n{k}"), false));
        tasks.push(spawn(format!("n{k}"), false));
    }
    for k in 0..4 {
        tasks.push(spawn(format!("c{k}"), false));
    }
    for k in 0..3 {
        tasks.push(spawn(format!("x{k}"), true));
        tasks.push(spawn(format!("x{k}"), true));
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    holder.batch_execute("COMMIT").await.expect("commit");

    let mut by_key: BTreeMap<String, Vec<ClaimOutcome>> = BTreeMap::new();
    for t in tasks {
        let (key, outcome) = t.await.expect("task");
        by_key.entry(key).or_default().push(outcome);
    }
    match &by_key["held"][..] {
        [ClaimOutcome::Existing { record, .. }] => assert_eq!((&*record.owner, record.state), ("another-replica", State::InFlight)),
        other => panic!("held: {other:?}"),
    }
    let mut generations = BTreeSet::new();
    for (key, outcomes) in &by_key {
        let claimed: Vec<_> = outcomes.iter().filter_map(|o| if let ClaimOutcome::Claimed(c) = o { Some(c) } else { None }).collect();
        let seen: Vec<_> =
            outcomes.iter().filter_map(|o| if let ClaimOutcome::Existing { record, .. } = o { Some(record) } else { None }).collect();
        match key.chars().next() {
            Some('n' | 'x') => {
                let [winner] = claimed[..] else { panic!("{key}: not exactly one winner: {outcomes:?}") };
                assert_eq!(winner.took_over, key.starts_with('x'), "{key}: {winner:?}");
                if let Some(old) = expired.get(key) {
                    assert!(winner.generation > *old, "{key}: taken over under {:?}, not above {old:?}", winner.generation);
                }
                let [other] = seen[..] else { panic!("{key}: {outcomes:?}") };
                assert_eq!(
                    (other.state, other.claim_token, other.generation),
                    (State::InFlight, winner.claim_token, winner.generation),
                    "{key}"
                );
                assert!(generations.insert(winner.generation), "{key}: generation {:?} drawn twice", winner.generation);
                assert_eq!(store.complete(winner, &response(b"new"), Retention::For(LONG)).await.expect("complete"), WriteOutcome::Written);
            }
            Some('c') => {
                let [record] = seen[..] else { panic!("{key}: {outcomes:?}") };
                assert_eq!(
                    (record.state, record.response.as_ref().and_then(|r| r.body.clone())),
                    (State::Completed, Some(Bytes::from_static(b"done")))
                );
            }
            _ => {}
        }
    }
    assert_eq!(generations.len(), 8 + 3);
    let rows: i64 =
        client(&url).await.query_one("SELECT count(*) FROM idemgate_records WHERE tenant = 'solo'", &[]).await.expect("count").get(0);
    assert_eq!(rows, 4 + 3 + 8 + 1, "one row per scope");
}

fn scope_of(tenant: &str, operation: &str, key: &str) -> Scope {
    Scope { tenant: tenant.into(), principal: "billing".into(), operation: operation.into(), key: IdempotencyKey::new(key).unwrap() }
}

async fn claimed(store: &Store, r: &ClaimRequest) -> idemgate::store::Claim {
    match store.claim(r).await.expect("claim") {
        ClaimOutcome::Claimed(c) => c,
        other => panic!("{:?}: {other:?}", r.scope),
    }
}

/// A synchronous attempt of `scope` that timed out: `unknown` (its claim's
/// lease, `SHORT`, bounds it: probes take it once that ran out).
async fn unknown(store: &Store, s: &Scope) {
    let c = claimed(store, &req(s, SHORT, false)).await;
    assert_eq!(store.mark_unknown(&c).await.unwrap(), WriteOutcome::Written);
}

/// An async acceptance of `s`, queued.
async fn accepted(store: &Store, s: &Scope) {
    let r = ClaimRequest {
        acceptance: Some(Acceptance { operation_id: format!("op_{}_{}", s.tenant, s.key.as_str()), request: Bytes::from_static(b"req") }),
        ..req(s, LONG, false)
    };
    claimed(store, &r).await;
}

/// A store on `url` whose `create_order` writes events (and `charge` none).
async fn store_with_events(url: &str) -> Store {
    let config = EventsConfig {
        url: "http://127.0.0.1:9/hook".parse().unwrap(),
        secret: None,
        timeout: Duration::from_secs(1),
        max_attempts: 3,
        emit: EventType::ALL.to_vec(),
        include_key: false,
        include_body: false,
        batch: 1,
        concurrency: 4,
    };
    let op: Arc<str> = "create_order".into();
    store(url).await.with_events(EventPolicies::new([(&op, &config)]))
}

fn probe_route(operation: &str) -> ProbeRoute {
    ProbeRoute { operation: operation.into(), settle: Duration::ZERO, at_upstream: Duration::ZERO }
}

/// A scope's events written through different nodes are delivered in the
/// order they were written (issue 47): an event's `seq` comes from the range
/// of the node its statement entered (the coordinator's lowest), so an
/// `unknown` written through a worker and its resolution written through the
/// coordinator have their `seq` values the wrong way round; generations grow
/// per scope whatever the node, and order them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scopes_events_written_through_different_nodes_are_delivered_in_order() {
    if citus::skip_unless_installed() {
        return;
    }
    let cluster = citus::shared();
    let url = cluster.create_unique_database("evorder").expect("database");
    let db = url.rsplit('/').next().expect("database name").to_owned();
    let via_coordinator = store_with_events(&url).await;
    let via_worker = store_with_events(&cluster.workers[0].url(&db)).await;
    let note = AuditNote { actor: Actor::Cli, reason: "it happened".into(), forced: false, caller: None };
    let complete = Resolution::Complete { response: response(b"ok"), retention: Retention::For(LONG), force: false };
    let s = scope_of("tenant-order", "create_order", "k");
    unknown(&via_worker, &s).await;
    assert_eq!(via_coordinator.resolve(&s, &complete, &note).await.unwrap(), ResolveOutcome::Resolved { from: State::Unknown });
    let written = via_coordinator.events(None, 10).await.unwrap();
    let seq_of = |t: EventType| written.iter().find(|e| e.event_type == t).map(|e| e.seq).expect("event written");
    assert!(
        seq_of(EventType::Completed) < seq_of(EventType::Unknown),
        "the test's premise: the later event has the lower seq ({written:?})"
    );
    let relay = Uuid::new_v4();
    let mut delivered = Vec::new();
    for _ in 0..2 {
        let taken = via_coordinator.take_events(&["create_order"], 8, LONG, relay).await.unwrap();
        assert_eq!(taken.len(), 1, "one event of a scope at a time: {taken:?}");
        delivered.push(taken[0].event_type);
        let seqs: Vec<i64> = taken.iter().map(|e| e.seq).collect();
        assert_eq!(via_coordinator.events_delivered(&seqs, relay).await.unwrap(), seqs);
    }
    assert_eq!(delivered, [EventType::Unknown, EventType::Completed], "delivered in the order written");
}

/// The tenant lists of the background rounds (at most 32 tenants a round)
/// apply what the per-tenant takes apply: 34 tenants whose only pending
/// events are held behind parked ones of their scopes, and whose `unknown`
/// records back off after inconclusive probes, all older than another
/// tenant's work, do not fill the rounds: that tenant's event is delivered
/// and its record probed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_that_cannot_proceed_never_fills_a_round_of_tenants() {
    if citus::skip_unless_installed() {
        return;
    }
    let url = citus::shared().create_unique_database("starve").expect("database");
    let store = store_with_events(&url).await;
    let note = AuditNote { actor: Actor::Cli, reason: "it happened".into(), forced: false, caller: None };
    let complete = Resolution::Complete { response: response(b"ok"), retention: Retention::For(LONG), force: false };
    let blocked = tenants(34);
    for t in &blocked {
        unknown(&store, &scope_of(t, "create_order", "e")).await;
        unknown(&store, &scope_of(t, "charge", "p")).await;
    }
    // Every blocked tenant's `unknown` event parked.
    let relay = Uuid::new_v4();
    let mut parked = 0;
    while parked < blocked.len() {
        let events = store.take_events(&["create_order"], 64, LONG, relay).await.unwrap();
        assert!(!events.is_empty(), "{parked} parked, the rest not taken");
        for e in events {
            assert!(store.event_failed(e.seq, relay, "answered 500", Duration::ZERO, true).await.unwrap());
            parked += 1;
        }
    }
    // A later event of each scope, held back behind the parked one.
    for t in &blocked {
        let out = store.resolve(&scope_of(t, "create_order", "e"), &complete, &note).await.unwrap();
        assert_eq!(out, ResolveOutcome::Resolved { from: State::Unknown });
    }
    // Every blocked tenant's record probed, inconclusively: backing off.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let mut probed = 0;
    while probed < blocked.len() {
        let taken = store.take_probes(&[probe_route("charge")], LONG, 64).await.unwrap();
        assert!(!taken.is_empty(), "{probed} probed, the rest not taken");
        for p in taken {
            assert_eq!(store.probe_failed(&p.record.scope, p.fence, LONG, "answered 503").await.unwrap(), WriteOutcome::Written);
            probed += 1;
        }
    }
    // The other tenant's work, newer than all of that.
    let other = "tenant-other";
    unknown(&store, &scope_of(other, "create_order", "e")).await;
    unknown(&store, &scope_of(other, "charge", "p")).await;
    tokio::time::sleep(Duration::from_millis(250)).await;
    let events = store.take_events(&["create_order"], 8, LONG, Uuid::new_v4()).await.unwrap();
    let tenants_of: BTreeSet<String> = events.iter().map(|e| e.scope.tenant.to_string()).collect();
    assert_eq!(tenants_of, BTreeSet::from([other.to_owned()]), "only the other tenant's event is deliverable");
    let taken = store.take_probes(&[probe_route("charge")], LONG, 8).await.unwrap();
    let keys: Vec<String> = taken.iter().map(|p| p.record.scope.tenant.to_string()).collect();
    assert_eq!(keys, [other], "only the other tenant's record is due for a probe");
}

/// A worker down stops the background work of its own tenants only: the
/// tenant lists (one read of every shard) fail while it is down, so each
/// round lists the tenants node by node instead, and the other worker's
/// tenants' queued operations are taken, their unknown records probed,
/// their events relayed and their expired leases reaped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_stops_only_its_own_tenants_background_work() {
    if citus::skip_unless_installed() {
        return;
    }
    let mut cluster = citus::CitusCluster::start(2).expect("a cluster of its own");
    let url = cluster.create_database("background").expect("database");
    let store = store_with_events(&url).await;
    let on = cluster.tenants_on_workers("background", 1).expect("a tenant on each worker");
    let (dead, alive) = (on[0][0].clone(), on[1][0].clone());
    for t in [&dead, &alive] {
        accepted(&store, &scope_of(t, "create_order", "queued")).await;
        unknown(&store, &scope_of(t, "charge", "probe")).await;
        unknown(&store, &scope_of(t, "create_order", "event")).await;
        claimed(&store, &req(&scope_of(t, "charge", "lease"), SHORT, false)).await;
    }
    tokio::time::sleep(Duration::from_millis(250)).await;
    cluster.workers[0].kill9().expect("kill the worker");

    let routes = [WorkerRoute { operation: "create_order".into(), lease: LONG, reforwardable: false, sent_on_take: None }];
    let taken = store.take(&routes, "w").await.expect("the take lists the live worker's tenants").expect("its operation");
    assert_eq!((taken.record.scope.tenant.to_string(), taken.record.scope.key.as_str()), (alive.clone(), "queued"));
    let probes = store.take_probes(&[probe_route("charge")], LONG, 8).await.expect("the probe take");
    let probed: Vec<(String, String)> =
        probes.iter().map(|p| (p.record.scope.tenant.to_string(), p.record.scope.key.as_str().to_owned())).collect();
    assert!(probed.contains(&(alive.clone(), "probe".to_owned())), "{probed:?}");
    let events = store.take_events(&["create_order"], 8, LONG, Uuid::new_v4()).await.expect("the relay's take");
    assert!(events.iter().all(|e| *e.scope.tenant == *alive) && !events.is_empty(), "{events:?}");
    let reaped = store.reap_leases(10, &[]).await.expect("the reaper");
    assert!(reaped.unknown >= 1, "{reaped:?}");
    let (lease, _) = store.get(&scope_of(&alive, "charge", "lease")).await.unwrap().unwrap();
    assert_eq!(lease.state, State::Unknown);
}

/// Gateways connected to different nodes at once (issue 47): a scope's
/// record claimed through one node, completed with a short retention,
/// swept, and claimed again through another node, then released (the key
/// given back) and claimed again through a third: each claim's generation
/// (what the upstream gets as `X-Idempotency-Generation`) is above every
/// earlier one of the scope, although nothing is drawn from a sequence on
/// the coordinator. A store given every node (a multi-host URL, its
/// tenants' statements sent to their shards' nodes) takes part, and so does
/// a tenant new to every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scope_claimed_again_through_another_node_after_a_sweep_gets_a_higher_generation() {
    if citus::skip_unless_installed() {
        return;
    }
    let cluster = citus::shared();
    let url = cluster.create_unique_database("anynode").expect("database");
    let db = url.rsplit('/').next().expect("database name").to_owned();
    let via_coordinator = store(&url).await;
    let via_worker: Vec<Store> = {
        let mut stores = Vec::new();
        for w in &cluster.workers {
            stores.push(store(&w.url(&db)).await);
        }
        stores
    };
    let hosts: Vec<String> = cluster.nodes().map(|n| format!("127.0.0.1:{}", n.port())).collect();
    let every_node = store(&format!("postgres://idemgate@{}/{db}", hosts.join(","))).await;
    let through: Vec<&Store> = vec![&via_coordinator, &via_worker[0], &every_node, &via_worker[1], &via_coordinator, &every_node];
    for tenant in ["tenant-any", "tenant-new"] {
        let s = scope(tenant, "again");
        let mut last = Generation(0);
        for (round, store) in through.iter().enumerate() {
            let claim = match store.claim(&req(&s, LONG, false)).await.expect("claim") {
                ClaimOutcome::Claimed(c) => c,
                other => panic!("round {round}: {other:?}"),
            };
            assert!(claim.generation > last, "{tenant}, round {round}: generation {:?} after {:?}", claim.generation, last);
            last = claim.generation;
            if round % 2 == 0 {
                // Completed with a retention that runs out at once, then swept.
                assert_eq!(
                    store.complete(&claim, &response(b"done"), Retention::For(Duration::from_millis(1))).await.unwrap(),
                    WriteOutcome::Written
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
                let mut swept = 0;
                while swept == 0 {
                    swept = through[(round + 1) % through.len()].sweep(100).await.expect("sweep");
                }
            } else {
                // Given back (the request never reached the upstream).
                assert_eq!(store.release(&claim).await.unwrap(), WriteOutcome::Written);
            }
            assert!(via_coordinator.get(&s).await.expect("get").is_none(), "{tenant}, round {round}: the record is gone");
        }
    }
}

/// The upgrade from before migration `citus_0002` (one generation sequence
/// on the coordinator): a database migrated by this version is set back to
/// that state by hand (the counters' table gone, the sequence back, having
/// given generations up to 5000, a record holding 5000, the migration
/// forgotten), then migrated again. Every generation drawn after it, for
/// the scope that held 5000 (taken over once its retention ran out), for
/// another scope of its tenant, and for a tenant new to the cluster, is
/// above every number the sequence gave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generations_after_the_upgrade_to_per_tenant_counters_are_above_the_old_sequences() {
    if citus::skip_unless_installed() {
        return;
    }
    let url = citus::shared().create_unique_database("upgrade_gens").expect("database");
    let before = store(&url).await;
    let old = scope("tenant-old", "held");
    let claim = match before.claim(&req(&old, LONG, false)).await.expect("claim") {
        ClaimOutcome::Claimed(c) => c,
        other => panic!("{other:?}"),
    };
    assert_eq!(before.complete(&claim, &response(b"old"), Retention::For(Duration::from_millis(1))).await.unwrap(), WriteOutcome::Written);
    drop(before);
    let db = client(&url).await;
    db.batch_execute(
        "DROP TABLE idemgate_generations;
         SELECT undistribute_table('idemgate_schema_migrations');
         CREATE SEQUENCE idemgate_generation AS bigint CACHE 1;
         SELECT setval('idemgate_generation', 5000);
         UPDATE idemgate_records SET generation = 5000 WHERE tenant = 'tenant-old';
         DELETE FROM idemgate_settings WHERE name = 'citus_generation_floor';
         DELETE FROM idemgate_schema_migrations WHERE name = 'citus_0002_generations_per_tenant';",
    )
    .await
    .expect("the schema as before citus_0002");

    let after = store(&url).await;
    let floor: String = db
        .query_one("SELECT convert_from(value, 'UTF8') FROM idemgate_settings WHERE name = 'citus_generation_floor'", &[])
        .await
        .expect("the floor")
        .get(0);
    assert_eq!(floor, "5000");
    let sequence: Option<String> = db.query_one("SELECT to_regclass('idemgate_generation')::text", &[]).await.unwrap().get(0);
    assert_eq!(sequence, None, "the sequence is gone");
    for s in [old.clone(), scope("tenant-old", "other"), scope("tenant-brand-new", "first")] {
        let c = match after.claim(&req(&s, LONG, false)).await.expect("claim") {
            ClaimOutcome::Claimed(c) => c,
            other => panic!("{}: {other:?}", s.key.as_str()),
        };
        assert!(c.generation > Generation(5000), "{}/{}: {:?}", s.tenant, s.key.as_str(), c.generation);
        assert_eq!(c.took_over, s == old, "{}", s.key.as_str());
    }
}
