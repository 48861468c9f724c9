//! On a Citus cluster every statement of a request is a router query: one
//! task, on one shard (issue 30, CONTRACT.md section 10). Every request-path
//! statement of the Citus store (`idemgate::store::postgres::citus_sql::catalog_for`
//! with the Citus flavor) is prepared with the gateway's session settings
//! and explained as it executes, with parameters naming one tenant; a plan
//! with more than one task (a statement sent to several shards, maybe
//! several nodes, committed with two-phase commit), a statement Citus
//! cannot plan, or one that touches no shard fails the test. Like
//! `tests/it/pg_plans.rs` does for sequential scans on one node.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::time::Duration;

use idemgate::config::{Secret, StoreBackend, StoreConfig};
use idemgate::store::postgres::Flavor;
use idemgate::store::postgres::catalog::Statement;
use idemgate::store::postgres::citus_sql::catalog_for;
use idemgate::store::postgres::sql::{routed_session_settings, session_settings};
use idemgate::store::{Access, Store};
use serde_json::Value;
use support::citus;
use tokio_postgres::{Client, NoTls};

/// The statements a request runs (claims, replays, result writes, fenced
/// async writes, resolutions with their audit rows, events written with a
/// final state, the console's record page). Background work and operator
/// listings over all tenants are not request-path statements.
const REQUEST_PATH: &[&str] = &[
    "claim_read",
    "claim_insert",
    "claim_take_over",
    "claim_read_batch",
    "claim_insert_batch",
    "complete_of_tenant",
    "generations_of_tenant",
    "generations_start",
    "generations",
    "complete",
    "get",
    "release",
    "abandon",
    "mark_unknown",
    "resolve_lock",
    "resolve_hold",
    "resolve_delete",
    "resolve_complete",
    "resolve_requeue",
    "audit_insert",
    "event_insert",
    "inspect",
    "audit_of_scope",
    "setting",
    "heartbeat",
    "mark_sent",
    "requeue",
    "fail",
    "operation",
    "probe_failed",
];

/// A literal of `ty` (a `regtype` name) for one tenant's request.
fn literal(ty: &str) -> String {
    let scalar = |t: &str| match t {
        "text" => "'acme'::text".to_owned(),
        "bigint" => "1::int8".to_owned(),
        "integer" => "200::int4".to_owned(),
        "bytea" => "'\\x00'::bytea".to_owned(),
        "uuid" => "'00000000-0000-0000-0000-000000000001'::uuid".to_owned(),
        "boolean" => "false".to_owned(),
        other => format!("NULL::{other}"),
    };
    match ty.strip_suffix("[]") {
        Some(elem) => format!("ARRAY[{}]", scalar(elem)),
        None => scalar(ty),
    }
}

/// How many tasks each distributed step of a Citus plan has (the main
/// query's and each subplan's), and whether any step reads intermediate
/// results (a subplan run first, then its result sent along).
fn task_counts(plan: &Value) -> Vec<u64> {
    let mut found = Vec::new();
    let mut stack = vec![plan];
    while let Some(v) = stack.pop() {
        match v {
            Value::Array(items) => stack.extend(items),
            Value::Object(map) => {
                if let Some(n) = map.get("Task Count").and_then(Value::as_u64) {
                    found.push(n);
                }
                stack.extend(map.values());
            }
            _ => {}
        }
    }
    found
}

/// How many distributed subplans a plan runs first: a CTE or subquery Citus
/// executes on its own, whose result it then sends to the nodes of the
/// next step (possibly every node: a completion then failed while a worker
/// holding none of its rows was down).
fn subplans(plan: &Value) -> usize {
    let mut n = 0;
    let mut stack = vec![plan];
    while let Some(v) = stack.pop() {
        match v {
            Value::Array(items) => stack.extend(items),
            Value::Object(map) => {
                if let Some(Value::Array(s)) = map.get("Subplans") {
                    n += s.len();
                }
                stack.extend(map.values());
            }
            _ => {}
        }
    }
    n
}

/// The statements of a request's claim and result write, which run for
/// every request, with the planner Citus must take for each: its fast-path
/// router planner (no `standard_planner` on the node that plans it; Citus
/// says "Distributed planning for a fast-path router query") for reads and
/// updates, its router planner for `INSERT ... VALUES` (which Citus prunes
/// at each execution and reports as "Creating router plan" only); and
/// whether, entering at the node holding its shard with that node's session
/// settings, Citus plans the shard's statement there once (its local
/// execution plan: no deparse and no second parse, docs/performance-notes.md).
const HOT: &[(&str, Planner, bool)] = &[
    ("claim_read", Planner::FastPath, true),
    ("claim_read_batch", Planner::FastPath, true),
    ("claim_insert", Planner::Router, false),
    ("claim_insert_batch", Planner::Router, false),
    ("claim_take_over", Planner::FastPath, false),
    ("complete_of_tenant", Planner::FastPath, false),
    ("generations_of_tenant", Planner::FastPath, true),
];

/// Which of Citus's planners planned a statement, from its debug2 messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Planner {
    FastPath,
    Router,
    Other,
}

fn planner(said: &[String]) -> Planner {
    if said.iter().any(|m| m.contains("fast-path router query")) {
        Planner::FastPath
    } else if said.iter().any(|m| m.contains("Creating router plan")) {
        Planner::Router
    } else {
        Planner::Other
    }
}

/// What Citus said it planned (its debug messages while planning).
pub(crate) type Notices = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

pub(crate) async fn session_with(url: &str, settings: Vec<(&'static str, &'static str)>) -> (Client, Notices) {
    let (client, mut connection) = tokio_postgres::connect(url, NoTls).await.expect("connect");
    let notices: Notices = Default::default();
    let seen = notices.clone();
    tokio::spawn(async move {
        loop {
            match std::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(tokio_postgres::AsyncMessage::Notice(n))) => seen.lock().unwrap().push(n.message().to_owned()),
                Some(Ok(_)) => {}
                _ => return,
            }
        }
    });
    for (name, value) in settings {
        client.batch_execute(&format!("SET {name} = '{value}'")).await.expect("session setting");
    }
    (client, notices)
}

async fn session(url: &str) -> Client {
    session_with(url, session_settings(Flavor::Citus)).await.0
}

/// Citus's planner messages (debug2) while `s` is prepared and executed
/// twice for one tenant, in a transaction rolled back (nothing is written).
async fn planner_said(client: &Client, notices: &Notices, i: usize, s: &Statement) -> Result<Vec<String>, String> {
    let name = format!("run_{i}");
    client.batch_execute(&format!("PREPARE {name} AS {}", s.sql)).await.map_err(|e| format!("PREPARE: {e:?}"))?;
    let types: Vec<String> = client
        .query_one("SELECT coalesce(parameter_types::text[], '{}') FROM pg_prepared_statements WHERE name = $1", &[&name])
        .await
        .expect("parameter types")
        .get(0);
    let args: Vec<String> = types.iter().map(|t| literal(t)).collect();
    let args = if args.is_empty() { String::new() } else { format!("({})", args.join(", ")) };
    client.batch_execute("BEGIN; SET LOCAL client_min_messages = debug2").await.expect("debug2");
    notices.lock().unwrap().clear();
    let ran = client.batch_execute(&format!("EXECUTE {name}{args}; EXECUTE {name}{args}")).await;
    let said = notices.lock().unwrap().clone();
    client.batch_execute("ROLLBACK").await.expect("rollback");
    ran.map_err(|e| format!("EXECUTE: {e:?}"))?;
    Ok(said)
}

/// The plan of `s` as it executes with one tenant's parameters, or Citus's refusal.
async fn explain(client: &Client, i: usize, s: &Statement) -> Result<Value, String> {
    let name = format!("plan_{i}");
    client.batch_execute(&format!("PREPARE {name} AS {}", s.sql)).await.map_err(|e| format!("PREPARE: {e:?}"))?;
    let types: Vec<String> = client
        .query_one("SELECT coalesce(parameter_types::text[], '{}') FROM pg_prepared_statements WHERE name = $1", &[&name])
        .await
        .expect("parameter types")
        .get(0);
    let args: Vec<String> = types.iter().map(|t| literal(t)).collect();
    let args = if args.is_empty() { String::new() } else { format!("({})", args.join(", ")) };
    // EXPLAIN without ANALYZE: nothing is written.
    let row = client.query_one(&format!("EXPLAIN (FORMAT JSON) EXECUTE {name}{args}"), &[]).await.map_err(|e| format!("EXPLAIN: {e:?}"))?;
    Ok(row.get::<_, Value>(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_path_statement_is_one_task_on_one_shard() {
    if citus::skip_unless_installed() {
        return;
    }
    let url = citus::shared().create_unique_database("plans").expect("database");
    let config = StoreConfig {
        backend: StoreBackend::Citus { url: Secret::new(url.clone()), pool_size: 2, pooler: Default::default() },
        migrate: true,
        unreachable_at_start: Default::default(),
        operation_timeout: Duration::from_secs(30),
        sweep_interval: Duration::from_secs(1),
        sweep_batch: 100,
        events_retention: Duration::from_secs(3600),
    };
    Store::open(&config, Access::Migrate).await.expect("store").migrate().await.expect("migrate");
    let client = session(&url).await;
    let catalog = catalog_for(Flavor::Citus);
    let mut failures = Vec::new();
    let mut checked = 0;
    for name in REQUEST_PATH {
        let Some((i, s)) = catalog.iter().enumerate().find(|(_, s)| s.name == *name) else {
            failures.push(format!("{name}: not in the catalog"));
            continue;
        };
        checked += 1;
        match explain(&client, i, s).await {
            Err(e) => failures.push(format!("{name}: {e}")),
            Ok(plan) => {
                let tasks = task_counts(&plan);
                let steps = subplans(&plan);
                if steps > 0 {
                    failures.push(format!(
                        "{name}: {steps} distributed subplan(s) run before it (intermediate results may go to every node):\n{plan:#}"
                    ));
                } else if tasks.is_empty() {
                    failures.push(format!("{name}: no distributed step (tasks {tasks:?}):\n{plan:#}"));
                } else if tasks.iter().any(|&n| n != 1) {
                    failures.push(format!("{name}: a step with more than one task (tasks {tasks:?}):\n{plan:#}"));
                }
            }
        }
    }
    assert_eq!(checked, REQUEST_PATH.len());
    assert!(failures.is_empty(), "{} of {checked} statements are not single-shard:\n{}", failures.len(), failures.join("\n\n"));

    // The planner each hot statement takes: through the coordinator, and at
    // the worker that holds the tenant's shard with a routed session.
    let (coordinator, coordinator_notices) = session_with(&url, session_settings(Flavor::Citus)).await;
    let db = url.rsplit('/').next().expect("database name").to_owned();
    let worker = citus::shared().worker_holding(&coordinator, "acme").await;
    let (local, local_notices) = session_with(&worker.url(&db), routed_session_settings()).await;
    let mut wrong = Vec::new();
    for (k, (name, kind, local_plan)) in HOT.iter().enumerate() {
        let (i, s) = catalog.iter().enumerate().find(|(_, s)| s.name == *name).expect("hot statement in the catalog");
        let said = planner_said(&coordinator, &coordinator_notices, 1000 + i, s).await.expect("planned on the coordinator");
        if planner(&said) != *kind {
            wrong.push(format!("{name}: planned by {:?} on the coordinator, not {kind:?}: {said:?}", planner(&said)));
        }
        let said = planner_said(&local, &local_notices, 2000 + k, s).await.expect("planned on the shard's worker");
        if planner(&said) != *kind {
            wrong.push(format!("{name}: planned by {:?} on the shard's worker, not {kind:?}: {said:?}", planner(&said)));
        }
        let planned_locally = said.iter().any(|m| m.contains("created local execution plan"))
            && said.iter().any(|m| m.contains("Using task's cached local plan"));
        if *local_plan && !planned_locally {
            wrong.push(format!("{name}: its local execution plan was not made once and reused on the shard's worker: {said:?}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The checker itself: a plan with a step of 8 tasks is seen, one of 1 task is not.
#[test]
fn the_checker_counts_tasks_in_every_step() {
    let multi = serde_json::json!([{ "Plan": { "Node Type": "Custom Scan", "Distributed Query": {
        "Subplans": [{ "PlannedStmt": [{ "Plan": { "Distributed Query": { "Job": { "Task Count": 1 } } } }] }],
        "Job": { "Task Count": 8 } } } }]);
    let mut counts = task_counts(&multi);
    counts.sort();
    assert_eq!(counts, vec![1, 8]);
    let router = serde_json::json!([{ "Plan": { "Node Type": "Custom Scan", "Distributed Query": { "Job": { "Task Count": 1 } } } }]);
    assert_eq!(task_counts(&router), vec![1]);
    assert_eq!((subplans(&multi), subplans(&router)), (1, 0));
}
