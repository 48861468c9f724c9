//! An experiment, not a check (`#[ignore]`; issue 47): what a request-path
//! write costs on the Citus node holding its tenant's shard, as the store
//! sends it and with its clock taken out of the statement.
//!
//! The store's result write (`complete_of_tenant`) and claim insert
//! (`claim_insert`) contain `now()` and `timestamptz + interval` (stable,
//! not immutable); Citus evaluates those at the node the statement enters
//! before routing it (`RequiresCoordinatorEvaluation`), then deparses the
//! shard statement and plans it again at every execution. The variants here
//! ("params") are the same statements with every `now()` a `timestamptz`
//! parameter and every `now() + x * interval` precomputed into one, so only
//! constants, parameters and immutable operators remain. Each is executed
//! as a prepared statement (autocommit, one distinct row per execution) from
//! a session on the shard's worker with the routed sessions' settings, and
//! measured three ways: wall time at the client, the backend's CPU
//! (`/proc/<pid>/stat`, user + system) and, when the nodes preload it,
//! `pg_stat_statements.mean_exec_time`. Before that, Citus's debug2 messages
//! for two executions of each say which planner ran and whether the node
//! kept a local plan.
//!
//! Run (numbers in docs/performance-notes.md, "Citus: the clock in a write"):
//! ```text
//! export IDEMGATE_TEST_PG_BINDIR=$(scripts/ensure-postgres) IDEMGATE_TEST_CITUS=required
//! IDEMGATE_TEST_PG_SETTINGS="shared_preload_libraries=citus,pg_stat_statements pg_stat_statements.track=all pg_stat_statements.track_planning=on" \
//!   cargo test --test it citus_write_cost -- --ignored --nocapture
//! ```
//! `IDEMGATE_EXPERIMENT_EXECUTIONS` (2000) per variant per round,
//! `IDEMGATE_EXPERIMENT_ROUNDS` (2), the variants alternating in each round.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::time::{Duration, Instant, SystemTime};

use idemgate::config::{Secret, StoreBackend, StoreConfig};
use idemgate::store::postgres::Flavor;
use idemgate::store::postgres::citus_sql::catalog_for;
use idemgate::store::postgres::sql::routed_session_settings;
use idemgate::store::{Access, Store};
use support::citus;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Statement};

use crate::citus_plans::{Notices, session_with};

/// A session with the routed sessions' settings, and what Citus says in it.
async fn connect(url: &str) -> (Client, Notices) {
    session_with(url, routed_session_settings()).await
}

/// `text` with `from` replaced, which must occur.
fn edit(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "{from:?} not in {text}");
    text.replace(from, to)
}

/// The result write with its clock as parameters: `$9` the expiry (was
/// the retention), `$11` the statement's time (was `now()`).
fn complete_with_params(store: &str) -> String {
    let text = edit(
        store,
        "greatest(now() + $9::int8 * interval '1 microsecond', CASE WHEN $9::int8 IS NULL THEN 'infinity'::timestamptz END)",
        "$9::timestamptz",
    );
    let text = edit(&text, "now()", "$11::timestamptz");
    assert!(!text.contains("now()") && !text.contains("interval"), "{text}");
    text
}

/// The claim insert (one row) with its clock as parameters: `$13` the lease
/// end, `$14` the expiry, `$15` the next attempt, `$16` `now()`; `$7` (the
/// lease in microseconds) is no longer used.
fn claim_insert_with_params(store: &str) -> String {
    let text = edit(store, "now() + (CASE WHEN $8::text IS NULL THEN $7::int8 END) * interval '1 microsecond'", "$13::timestamptz");
    let text = edit(&text, "now() + $7::int8 * interval '1 microsecond'", "$14::timestamptz");
    let text = edit(&text, "now() + (CASE WHEN $8::text IS NOT NULL THEN 0 END) * interval '1 microsecond'", "$15::timestamptz");
    let text = edit(&text, "now()", "$16::timestamptz");
    assert!(!text.contains("now()") && !text.contains("interval"), "{text}");
    text
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    /// The store's `claim_read` (a cached local plan already): the floor.
    Read,
    CompleteStore,
    CompleteParams,
    InsertStore,
    InsertParams,
    /// The claim insert sent unnamed (`query_typed`), as the store sends it.
    InsertStoreUnnamed,
    InsertParamsUnnamed,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Read => "claim_read (store)",
            Variant::CompleteStore => "(a) result write, store's text",
            Variant::CompleteParams => "(b) result write, clock as parameters",
            Variant::InsertStore => "(c) claim insert, store's text",
            Variant::InsertParams => "(c) claim insert, clock as parameters",
            Variant::InsertStoreUnnamed => "(c) claim insert, store's text, unnamed",
            Variant::InsertParamsUnnamed => "(c) claim insert, clock as params, unnamed",
        }
    }

    /// The prepared statement this one executes as (an unnamed one is parsed each time).
    fn prepared(self) -> Variant {
        match self {
            Variant::InsertStoreUnnamed => Variant::InsertStore,
            Variant::InsertParamsUnnamed => Variant::InsertParams,
            v => v,
        }
    }
}

struct Statements {
    read: String,
    complete: String,
    complete_params: String,
    insert: String,
    insert_params: String,
}

impl Statements {
    fn text(&self, v: Variant) -> &str {
        match v.prepared() {
            Variant::Read => &self.read,
            Variant::CompleteStore => &self.complete,
            Variant::CompleteParams => &self.complete_params,
            Variant::InsertStore => &self.insert,
            Variant::InsertParams => &self.insert_params,
            Variant::InsertStoreUnnamed | Variant::InsertParamsUnnamed => unreachable!("a prepared variant"),
        }
    }
}

fn types(v: Variant) -> Vec<Type> {
    use Type as T;
    match v.prepared() {
        Variant::Read => vec![T::INT8, T::TEXT, T::TEXT, T::TEXT],
        Variant::CompleteStore => vec![T::INT8, T::TEXT, T::TEXT, T::TEXT, T::INT8, T::INT4, T::BYTEA, T::BYTEA, T::INT8, T::UUID],
        Variant::CompleteParams => {
            vec![T::INT8, T::TEXT, T::TEXT, T::TEXT, T::INT8, T::INT4, T::BYTEA, T::BYTEA, T::TIMESTAMPTZ, T::UUID, T::TIMESTAMPTZ]
        }
        Variant::InsertStore => {
            vec![T::TEXT, T::TEXT, T::TEXT, T::BYTEA, T::UUID, T::TEXT, T::INT8, T::TEXT, T::BYTEA, T::TEXT, T::INT8, T::INT8]
        }
        Variant::InsertParams => vec![
            T::TEXT,
            T::TEXT,
            T::TEXT,
            T::BYTEA,
            T::UUID,
            T::TEXT,
            T::INT8,
            T::TEXT,
            T::BYTEA,
            T::TEXT,
            T::INT8,
            T::INT8,
            T::TIMESTAMPTZ,
            T::TIMESTAMPTZ,
            T::TIMESTAMPTZ,
            T::TIMESTAMPTZ,
        ],
        _ => unreachable!("a prepared variant"),
    }
}

const TOKEN: uuid::Uuid = uuid::Uuid::from_u128(1);
const HOUR: Duration = Duration::from_secs(3600);

/// Executes `v` once for key `key` (whose scope id is `scope`): one row
/// written (or read), checked.
async fn run_once(client: &Client, st: &Statement, text: &str, v: Variant, key: &str, scope: i64) {
    let (p, op) = ("p".to_owned(), "op".to_owned());
    let key = key.to_owned();
    let hash = vec![0u8];
    let now = SystemTime::now();
    let later = now + HOUR;
    let rows = match v {
        Variant::Read => client.query(st, &[&scope, &p, &op, &key]).await,
        Variant::CompleteStore | Variant::CompleteParams => {
            let retention: i64 = 3_600_000_000;
            let expiry: &(dyn ToSql + Sync) = if v == Variant::CompleteStore { &retention } else { &later };
            let params: Vec<&(dyn ToSql + Sync)> = vec![&scope, &p, &op, &key, &1i64, &200i32, &hash, &hash, expiry, &TOKEN, &now];
            let n = if v == Variant::CompleteStore { 10 } else { 11 };
            client.query(st, &params[..n]).await
        }
        Variant::InsertStore | Variant::InsertParams | Variant::InsertStoreUnnamed | Variant::InsertParamsUnnamed => {
            let (owner, lease, none): (String, i64, Option<String>) = ("o".to_owned(), 3_600_000_000, None);
            let (no_request, source): (Option<Vec<u8>>, String) = (None, "header".to_owned());
            let no_time: Option<SystemTime> = None;
            let params: Vec<&(dyn ToSql + Sync)> = vec![
                &p,
                &op,
                &key,
                &hash,
                &TOKEN,
                &owner,
                &lease,
                &none,
                &no_request,
                &source,
                &scope,
                &1i64,
                &later,
                &later,
                &no_time,
                &now,
            ];
            let n = types(v).len();
            if v.prepared() == v {
                client.query(st, &params[..n]).await
            } else {
                let typed: Vec<(&(dyn ToSql + Sync), Type)> = params[..n].iter().copied().zip(types(v)).collect();
                client.query_typed(text, &typed).await
            }
        }
    };
    let rows = rows.unwrap_or_else(|e| panic!("{}: {e:?}", v.name()));
    assert_eq!(rows.len(), 1, "{} for {key}: one row", v.name());
}

/// User + system CPU of process `pid`, from `/proc/<pid>/stat`.
fn cpu_of(pid: i32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("backend stat");
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of proc(5), here 11 and 12 (state is the first).
    let ticks: u64 = fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    // USER_HZ is 100 on Linux.
    Duration::from_millis(ticks * 10)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "an experiment with printed numbers (issue 47); see the module documentation"]
async fn citus_write_cost() {
    if citus::skip_unless_installed() {
        return;
    }
    let executions: usize = std::env::var("IDEMGATE_EXPERIMENT_EXECUTIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    let rounds: usize = std::env::var("IDEMGATE_EXPERIMENT_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let cluster = citus::shared();
    let url = cluster.create_unique_database("writecost").expect("database");
    let config = StoreConfig {
        backend: StoreBackend::Citus { url: Secret::new(url.clone()), pool_size: 2, pooler: Default::default() },
        migrate: true,
        unreachable_at_start: Default::default(),
        operation_timeout: Duration::from_secs(30),
        sweep_interval: Duration::from_secs(3600),
        sweep_batch: 100,
        events_retention: Duration::from_secs(3600),
    };
    Store::open(&config, Access::Migrate).await.expect("store").migrate().await.expect("migrate");

    let catalog = catalog_for(Flavor::Citus);
    let of = |name: &str| catalog.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("{name} in the catalog")).sql.clone();
    let texts = Statements {
        read: of("claim_read"),
        complete_params: complete_with_params(&of("complete_of_tenant")),
        complete: of("complete_of_tenant"),
        insert_params: claim_insert_with_params(&of("claim_insert")),
        insert: of("claim_insert"),
    };
    for v in [Variant::CompleteStore, Variant::CompleteParams, Variant::InsertStore, Variant::InsertParams] {
        eprintln!("{}:\n  {}\n", v.name(), texts.text(v).split_whitespace().collect::<Vec<_>>().join(" "));
    }

    // The worker holding acme's shard; the records to write, made through
    // the coordinator (each execution writes its own row).
    let (coordinator, _) = connect(&url).await;
    let db = url.rsplit('/').next().expect("database name").to_owned();
    let worker = cluster.worker_holding(&coordinator, "acme").await;
    let per_variant = executions * rounds + 2;
    let made = Instant::now();
    for prefix in ["complete-store", "complete-params", "read"] {
        // Literals, not parameters: Citus cannot plan an `INSERT ... SELECT`
        // calling an SQL function with parameters.
        coordinator
            .batch_execute(&format!(
                "INSERT INTO idemgate_records (tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, \
                 owner, lease_expires_at, created_at, updated_at, expires_at, scope_id, key_source) \
                 SELECT 'acme', 'p', 'op', k, '\\x00', 'in_flight', 1, '{TOKEN}', 'o', now() + interval '1 hour', now(), now(), \
                 now() + interval '1 hour', idemgate_scope_id('acme', 'p', 'op', k), 'header' \
                 FROM (SELECT '{prefix}-' || i AS k FROM generate_series(0, {}) i) s",
                per_variant - 1
            ))
            .await
            .expect("records");
    }
    eprintln!("{} records per variant made in {:?}", per_variant, made.elapsed());
    let scope_of = |key: &str| idemgate_scope_id(&coordinator, key.to_owned());

    let (local, notices) = connect(&worker.url(&db)).await;
    // The commit's fsync is not what is measured (it is the same for every variant).
    local.batch_execute("SET synchronous_commit = off").await.expect("synchronous_commit");
    let pid: i32 = local.query_one("SELECT pg_backend_pid()", &[]).await.expect("pid").get(0);
    // Created through the coordinator, which propagates it to the workers.
    if let Err(e) = coordinator.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").await {
        eprintln!("CREATE EXTENSION pg_stat_statements: {e:?}");
    }
    let stats = match local.query("SELECT 1 FROM pg_stat_statements LIMIT 1", &[]).await {
        Ok(_) => true,
        Err(e) => {
            eprintln!("pg_stat_statements on the worker: {e:?}");
            false
        }
    };
    eprintln!("pg_stat_statements: {}", if stats { "on" } else { "not loaded (mean_exec_time not printed)" });

    let variants = [
        Variant::Read,
        Variant::CompleteStore,
        Variant::CompleteParams,
        Variant::InsertStore,
        Variant::InsertParams,
        Variant::InsertStoreUnnamed,
        Variant::InsertParamsUnnamed,
    ];
    let mut prepared = Vec::new();
    for v in variants {
        let st = local.prepare_typed(texts.text(v), &types(v)).await.unwrap_or_else(|e| panic!("prepare {}: {e:?}", v.name()));
        prepared.push(st);
    }
    let key_for = |v: Variant, round: usize, i: usize| match v {
        Variant::Read => format!("read-{}", i % per_variant),
        Variant::CompleteStore => format!("complete-store-{}", round * executions + i),
        Variant::CompleteParams => format!("complete-params-{}", round * executions + i),
        Variant::InsertStore => format!("insert-store-{round}-{i}"),
        Variant::InsertParams => format!("insert-params-{round}-{i}"),
        Variant::InsertStoreUnnamed => format!("insert-store-unnamed-{round}-{i}"),
        Variant::InsertParamsUnnamed => format!("insert-params-unnamed-{round}-{i}"),
    };

    // What Citus says while planning two executions (rolled back).
    for (v, st) in variants.iter().zip(&prepared) {
        local.batch_execute("BEGIN; SET LOCAL client_min_messages = debug2").await.expect("debug2");
        notices.lock().unwrap().clear();
        for i in 0..2 {
            let key = match v {
                Variant::CompleteStore => format!("complete-store-{}", per_variant - 1 - i),
                Variant::CompleteParams => format!("complete-params-{}", per_variant - 1 - i),
                Variant::Read => format!("read-{i}"),
                _ => format!("probe-{i}"),
            };
            let scope = scope_of(&key).await;
            run_once(&local, st, texts.text(*v), *v, &key, scope).await;
        }
        let said = notices.lock().unwrap().clone();
        local.batch_execute("ROLLBACK").await.expect("rollback");
        eprintln!("{} (debug2, two executions):", v.name());
        for m in &said {
            eprintln!("  {}", m.split_whitespace().collect::<Vec<_>>().join(" ").chars().take(220).collect::<String>());
        }
    }

    // Scope ids computed first, outside the timing.
    let mut results: Vec<(Variant, usize, f64, f64, Option<f64>)> = Vec::new();
    for round in 0..rounds {
        let order: Vec<usize> = if round % 2 == 0 { (0..variants.len()).collect() } else { (0..variants.len()).rev().collect() };
        for k in order {
            let (v, st) = (variants[k], &prepared[k]);
            let keys: Vec<String> = (0..executions).map(|i| key_for(v, round, i)).collect();
            let work: Vec<(String, i64)> = coordinator
                .query(
                    "SELECT k, idemgate_scope_id('acme', 'p', 'op', k) FROM unnest($1::text[]) WITH ORDINALITY AS u(k, n) ORDER BY n",
                    &[&keys],
                )
                .await
                .expect("scope ids")
                .iter()
                .map(|r| (r.get(0), r.get(1)))
                .collect();
            if stats {
                local.execute("SELECT pg_stat_statements_reset()", &[]).await.expect("reset");
            }
            let cpu = cpu_of(pid);
            let began = Instant::now();
            for (key, scope) in &work {
                run_once(&local, st, texts.text(v), v, key, *scope).await;
            }
            let wall = began.elapsed();
            let cpu = cpu_of(pid).saturating_sub(cpu);
            // pg_stat_statements writes constants as parameters: the
            // statements run at least `executions` times since the reset.
            let mut mean = None;
            let mut seen = Vec::new();
            if stats {
                let rows = local
                    .query(
                        "SELECT toplevel, calls, mean_exec_time, mean_plan_time, left(regexp_replace(query, '\\s+', ' ', 'g'), 70) FROM pg_stat_statements \
                         WHERE calls >= $1 ORDER BY toplevel DESC, calls DESC",
                        &[&(executions as i64)],
                    )
                    .await
                    .expect("pg_stat_statements");
                for r in &rows {
                    let (top, calls, m, plan, q): (bool, i64, f64, f64, String) = (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
                    if top && mean.is_none() {
                        mean = Some(m * 1000.0);
                    }
                    seen.push(format!(
                        "    {} calls {calls} mean exec {:.1} us, plan {:.1} us: {q}",
                        if top { "top   " } else { "nested" },
                        m * 1000.0,
                        plan * 1000.0
                    ));
                }
            }
            let per = |d: Duration| d.as_secs_f64() * 1e6 / executions as f64;
            eprintln!(
                "round {round} {:<42} {executions} executions: wall {:>7.1} us/exec, backend CPU {:>7.1} us/exec, mean_exec_time {}",
                v.name(),
                per(wall),
                per(cpu),
                mean.map_or("-".to_owned(), |m| format!("{m:.1} us")),
            );
            for line in &seen {
                eprintln!("{line}");
            }
            results.push((v, round, per(wall), per(cpu), mean));
        }
    }
    eprintln!("\nsummary (per execution, us): variant | round | wall | backend CPU | mean_exec_time");
    for (v, round, wall, cpu, mean) in &results {
        eprintln!("{:<42} | {round} | {wall:.1} | {cpu:.1} | {}", v.name(), mean.map_or("-".to_owned(), |m| format!("{m:.1}")));
    }
}

async fn idemgate_scope_id(client: &Client, key: String) -> i64 {
    client.query_one("SELECT idemgate_scope_id('acme', 'p', 'op', $1)", &[&key]).await.expect("scope id").get(0)
}
