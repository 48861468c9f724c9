//! `scripts/bench --citus` (group `citus`, run only when named): the store
//! on a Citus cluster beside the store on one PostgreSQL (issues 30, 47).
//!
//! It starts from fresh databases a single PostgreSQL node and a Citus
//! cluster (a coordinator and two workers, the integration tests' harness,
//! `tests/it/support/citus.rs`) and measures first writes and replays in
//! interleaved rounds (the targets take turns, the order rotating; medians)
//! on three targets:
//!
//! - `cmp-pg`: one gateway on one PostgreSQL;
//! - `citus-coord`: one gateway whose URL names the coordinator (8 shards,
//!   the coordinator holding none): every statement enters through it;
//! - `citus-nodes`: three gateways, each given every node (a multi-host URL,
//!   its own node first), on a database whose shards (24) are spread over
//!   all three nodes, the coordinator included: each tenant's statements go
//!   to the node holding its shard (`citus_route`).
//!
//! The load comes from `IDEMGATE_BENCH_CITUS_TENANTS` [18] tenants, one API
//! key each, chosen so that each node of `citus-nodes` holds as many of them.
//! Each row's db CPU is the CPU of every node (postmaster and backends,
//! `/proc`); each node's share is in the notes. `IDEMGATE_BENCH_CITUS_BEFORE_BIN`:
//! another gateway binary (a build from before a change) measured as one
//! more target on a coordinator-only database of its own.
//!
//! Closes with a `citus:` line after the `ratios:` line: per request kind,
//! the database CPU per request of one PostgreSQL, of each node and of the
//! whole cluster, the busiest node's share, and the projected capacity of a
//! cluster of 3 and of 9 nodes, each the size of the one PostgreSQL, relative
//! to it: `N * pg / (cluster * N * busiest share)` with the busiest node's
//! share as measured on three nodes scaled to N (`citus_projected_capacity_3`,
//! `_9`; the lower of the two kinds, each kind's in brackets).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};

use crate::citus_harness::CitusCluster;
use crate::client::Conn;
use crate::cpu::Cpu;
use crate::gateway::{self, Gateway, Spec, Store};
use crate::pg::{Pg, find_pg_tool};
use crate::report::{self, LoadResult, Row};
use crate::suite::{Ctx, REPLAY_BASE, Watch, key_prefix, measure_once, request_env};
use crate::wrk::Scenario;
use crate::{Options, procs};

mod probe;

const FIRST: &str = "first write";
const REPLAY: &str = "replay";
const PG: &str = "cmp-pg";
const COORD: &str = "citus-coord";
const NODES: &str = "citus-nodes";
/// Shards of the coordinator-only database and of the every-node one.
const COORD_SHARDS: u32 = 8;
const NODES_SHARDS: u32 = 24;

/// Whether the group runs: only when `IDEMGATE_BENCH_ONLY` names it.
pub fn wanted(opts: &Options) -> bool {
    opts.only.as_ref().is_some_and(|only| only.iter().any(|g| g == "citus"))
}

/// Where a target's records live: what to settle before each run.
enum Db<'a> {
    Pg(&'a Pg, String),
    Citus(&'a CitusCluster, String),
}

impl Db<'_> {
    /// VACUUM ANALYZE and CHECKPOINT (on every node of a cluster).
    fn settle(&self) -> Result<()> {
        match self {
            Db::Pg(pg, db) => pg.settle(db),
            Db::Citus(cluster, db) => {
                cluster.coordinator.simple_query(db, "VACUUM ANALYZE").context("VACUUM ANALYZE on the coordinator")?;
                for node in cluster.nodes() {
                    node.simple_query(db, "CHECKPOINT").with_context(|| format!("CHECKPOINT on port {}", node.port()))?;
                }
                Ok(())
            }
        }
    }
}

/// One contender: its gateways (wrk's connections split over them), the
/// database's processes (a cluster's coordinator first) and its database.
struct Target<'a> {
    name: String,
    gws: Vec<Gateway>,
    db_cpus: Vec<Cpu>,
    db: Db<'a>,
    note: String,
}

impl Target<'_> {
    fn stop(self) -> Result<()> {
        self.gws.into_iter().try_for_each(Gateway::stop)
    }
}

/// API keys for `tenants`: `bench-<tenant>`.
fn api_keys(tenants: &[String]) -> Vec<(String, String)> {
    tenants.iter().map(|t| (format!("bench-{t}"), t.clone())).collect()
}

fn identity(keys: &[(String, String)]) -> String {
    let entries: Vec<String> = keys
        .iter()
        .map(|(key, tenant)| {
            format!(
                "{{ sha256 = \"{}\", tenant = \"{tenant}\", principal = \"{}\" }}",
                hex::encode(Sha256::digest(key)),
                gateway::PRINCIPAL
            )
        })
        .collect();
    format!("[[identity.sources]]\nkind = \"api_key\"\nheader = \"authorization\"\nkeys = [\n  {}\n]\n", entries.join(",\n  "))
}

/// `n` tenants (`t000`, `t001`, ...) whose shards in `db` are spread evenly
/// over the cluster's nodes (as many on each, the rest on the first).
fn even_tenants(cluster: &CitusCluster, db: &str, n: usize) -> Result<Vec<String>> {
    let rows = cluster.coordinator.simple_query(
        db,
        "SELECT s.t, p.nodeport FROM (SELECT i, 't' || lpad(i::text, 3, '0') AS t FROM generate_series(0, 999) i) s \
         JOIN pg_dist_shard_placement p ON p.shardid = get_shard_id_for_distribution_column('idemgate_records', s.t) ORDER BY s.i",
    )?;
    let nodes: Vec<String> = cluster.nodes().map(|n| n.port().to_string()).collect();
    let per_node = n.div_ceil(nodes.len());
    let mut on: Vec<Vec<String>> = vec![Vec::new(); nodes.len()];
    for row in rows {
        let (Some(Some(tenant)), Some(Some(port))) = (row.first(), row.get(1)) else { continue };
        if let Some(i) = nodes.iter().position(|p| p == port)
            && on[i].len() < per_node
        {
            on[i].push(tenant.clone());
        }
    }
    let mut tenants: Vec<String> = Vec::with_capacity(n);
    for k in 0..per_node {
        for node in &on {
            if let Some(t) = node.get(k)
                && tenants.len() < n
            {
                tenants.push(t.clone());
            }
        }
    }
    anyhow::ensure!(tenants.len() == n, "not {n} tenants spread over the nodes among t000..t999: {on:?}");
    Ok(tenants)
}

pub fn run(ctx: &mut Ctx, upstream: SocketAddr) -> Result<()> {
    ctx.report.line(fsync_latency(ctx));
    let n_tenants: usize = crate::env_num("IDEMGATE_BENCH_CITUS_TENANTS", 18)?;
    ctx.progress("citus: a PostgreSQL node and a Citus cluster (coordinator + 2 workers), fresh databases");
    let pg = Pg::start()?;
    let cluster = CitusCluster::start(2).context("starting a Citus cluster (tests/it/support/citus.rs)")?;
    for node in cluster.nodes() {
        if let Some(pid) = node.watchdog_pid() {
            procs::register_group(pid);
        }
    }
    let cluster_cpus: Vec<Cpu> = cluster.nodes().filter_map(|n| n.postmaster_pid()).map(Cpu::Tree).collect();
    let cluster_db = |db: &str, shards: u32, coordinator_shards: bool| -> Result<String> {
        let url = cluster.create_database(db).with_context(|| format!("creating {db} on the cluster"))?;
        cluster.coordinator.simple_query(db, &format!("ALTER DATABASE {db} SET citus.shard_count = {shards}"))?;
        if coordinator_shards {
            cluster.coordinator.simple_query(
                db,
                &format!("SELECT citus_set_node_property('127.0.0.1', {}, 'shouldhaveshards', true)", cluster.coordinator.port()),
            )?;
        }
        Ok(url)
    };
    // The every-node database first: its placements choose the tenants.
    let nodes_db = "cmp_citus_nodes";
    let nodes_url = cluster_db(nodes_db, NODES_SHARDS, true)?;
    let placeholder = api_keys(&["t000".to_owned()]);
    let mut migrate_spec = Spec::new("citus-cmp-nodes-migrate", Store::Citus { url: nodes_url }, upstream);
    migrate_spec.identity = Some(identity(&placeholder));
    migrate_spec.migrate(ctx.dir)?;
    let tenants = even_tenants(&cluster, nodes_db, n_tenants.max(1))?;
    let keys = api_keys(&tenants);
    let auths: String = keys.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(",");
    let spec = |name: &str, store: Store| {
        let mut s = Spec::new(name, store, upstream);
        s.identity = Some(identity(&keys));
        s
    };
    let mut targets = Vec::new();
    {
        let db = "cmp_pg";
        let url = pg.create_database(db)?;
        let s = spec("citus-cmp-pg", Store::Postgres { url });
        targets.push(Target {
            name: PG.into(),
            gws: vec![prepared(ctx, &s, &keys)?],
            db_cpus: pg.cpu().into_iter().collect(),
            db: Db::Pg(&pg, db.into()),
            note: "one PostgreSQL".into(),
        });
    }
    {
        let db = "cmp_citus_coord";
        let url = cluster_db(db, COORD_SHARDS, false)?;
        let s = spec("citus-cmp-coord", Store::Citus { url });
        let gw = prepared(ctx, &s, &keys)?;
        let found = shard_count(&cluster, db)?;
        targets.push(Target {
            name: COORD.into(),
            gws: vec![gw],
            db_cpus: cluster_cpus.clone(),
            db: Db::Citus(&cluster, db.into()),
            note: format!("1 gateway on the coordinator, {found} shards on the workers"),
        });
    }
    {
        // Each gateway lists every node, its own first (its store's pool,
        // for background work, prefers that node).
        let hosts: Vec<String> = cluster.nodes().map(|n| format!("127.0.0.1:{}", n.port())).collect();
        let mut gws = Vec::new();
        for i in 0..hosts.len() {
            let rotated: Vec<&str> = hosts.iter().cycle().skip(i).take(hosts.len()).map(String::as_str).collect();
            let url = format!("postgres://idemgate@{}/{nodes_db}", rotated.join(","));
            let s = spec(&format!("citus-cmp-nodes-{i}"), Store::Citus { url });
            gws.push(Gateway::start(&s, ctx.dir)?);
        }
        populate(&gws[0], ctx.opts.replay_keys, &keys)?;
        let found = shard_count(&cluster, nodes_db)?;
        targets.push(Target {
            name: NODES.into(),
            gws,
            db_cpus: cluster_cpus.clone(),
            db: Db::Citus(&cluster, nodes_db.into()),
            note: format!("3 gateways each given every node, {found} shards on all 3 nodes"),
        });
    }
    if let Some(before) = std::env::var_os("IDEMGATE_BENCH_CITUS_BEFORE_BIN").map(PathBuf::from) {
        let db = "cmp_citus_before";
        let url = cluster_db(db, COORD_SHARDS, false)?;
        let mut s = spec("citus-cmp-before", Store::Citus { url });
        s.binary = Some(before.clone());
        targets.push(Target {
            name: "citus-coord-before".into(),
            gws: vec![prepared(ctx, &s, &keys)?],
            db_cpus: cluster_cpus.clone(),
            db: Db::Citus(&cluster, db.into()),
            note: format!("gateway {}", before.display()),
        });
    }
    ctx.report.line(format!(
        "citus: {} tenants (one API key each, {} per node of {NODES}); cluster: coordinator + 2 workers, each node a private \
         PostgreSQL with the bench's settings; db CPU of a cluster: all three nodes, each node's share in the notes",
        keys.len(),
        keys.len().div_ceil(3)
    ));
    probe::idle(ctx, &targets)?;
    let nodes = rounds(ctx, &targets, &auths)?;
    for t in targets {
        t.stop()?;
    }
    let summary = summary(ctx, &nodes);
    ctx.report.summaries.push(summary);
    Ok(())
}

/// Shards of `idemgate_records` in `db`.
fn shard_count(cluster: &CitusCluster, db: &str) -> Result<String> {
    let rows =
        cluster.coordinator.simple_query(db, "SELECT count(*) FROM pg_dist_shard WHERE logicalrelid = 'idemgate_records'::regclass")?;
    Ok(rows.first().and_then(|r| r.first()).cloned().flatten().unwrap_or_else(|| "?".into()))
}

/// Migrated, started, and holding the completed keys replays use (key n
/// posted with API key n % tenants, as replay.lua sends it).
fn prepared(ctx: &Ctx, spec: &Spec, keys: &[(String, String)]) -> Result<Gateway> {
    spec.migrate(ctx.dir)?;
    let gw = Gateway::start(spec, ctx.dir)?;
    populate(&gw, ctx.opts.replay_keys, keys)?;
    Ok(gw)
}

fn populate(gw: &Gateway, count: u64, keys: &[(String, String)]) -> Result<()> {
    let threads = 16u64;
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || -> Result<()> {
                    let mut conn = Conn::open(gw.addr)?;
                    for n in (t..count).step_by(threads as usize) {
                        procs::check_interrupted()?;
                        let auth = format!("Bearer {}", keys[(n % keys.len() as u64) as usize].0);
                        let key = (REPLAY_BASE + n).to_string();
                        let resp = post(&mut conn, &auth, &key)?;
                        if resp.status != 201 {
                            anyhow::bail!("POST with key {key} answered {}: {}", resp.status, resp.text());
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| w.join().unwrap_or_else(|_| anyhow::bail!("a populate thread panicked")))
    })
}

fn post(conn: &mut Conn, auth: &str, key: &str) -> Result<crate::client::Response> {
    let headers = [("Authorization", auth), ("Content-Type", "application/json"), ("Idempotency-Key", key)];
    conn.request("POST", gateway::ROUTE_PATH, &headers, gateway::POST_BODY.as_bytes())
}

/// wrk on the target's gateways, `conns` split over them (one wrk each, at
/// the same time); the results added up (p50: the mean, p99: the worst).
fn load(ctx: &Ctx, gws: &[Gateway], scenario: &str, conns: u32, secs: u32, auths: &str) -> Result<LoadResult> {
    let mut env = request_env(ctx.opts);
    env.push(("BENCH_API_KEYS", auths.to_owned()));
    let wrk_scenario = if scenario == FIRST {
        Scenario::FirstWrite
    } else {
        env.push(("BENCH_KEY_FORMAT", "%d".into()));
        env.push(("BENCH_KEY_FIRST", REPLAY_BASE.to_string()));
        env.push(("BENCH_KEY_COUNT", ctx.opts.replay_keys.to_string()));
        Scenario::Replay
    };
    let each = (conns / gws.len().max(1) as u32).max(1);
    let results: Vec<Result<LoadResult>> = std::thread::scope(|s| {
        let runs: Vec<_> = gws
            .iter()
            .map(|gw| {
                let url = format!("http://{}{}", gw.addr, gateway::ROUTE_PATH);
                // New keys of a run of their own for each wrk.
                let mut env = env.clone();
                if wrk_scenario == Scenario::FirstWrite {
                    env.push(("BENCH_KEY_PREFIX", key_prefix()));
                }
                s.spawn(move || ctx.wrk(wrk_scenario, &url, each, secs, &env))
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap_or_else(|_| anyhow::bail!("a wrk thread panicked"))).collect()
    });
    let results = results.into_iter().collect::<Result<Vec<_>>>()?;
    let n = results.len().max(1) as f64;
    Ok(LoadResult {
        requests: results.iter().map(|r| r.requests).sum(),
        rps: results.iter().map(|r| r.rps).sum(),
        p50_us: results.iter().map(|r| r.p50_us).sum::<f64>() / n,
        p99_us: results.iter().map(|r| r.p99_us).fold(0.0, f64::max),
        status_errors: results.iter().map(|r| r.status_errors).sum(),
        socket_errors: results.iter().map(|r| r.socket_errors).sum(),
    })
}

/// One measured run of `t`: its row (gateway and database CPU per request
/// from the processes' `/proc` times) and each database node's CPU per
/// request (a cluster's nodes in order: coordinator, workers).
fn measure(ctx: &mut Ctx, t: &Target, scenario: &str, conns: u32, round: usize, auths: &str) -> Result<(Row, Vec<f64>)> {
    t.db.settle()?;
    let statements = probe::Statements::wanted()?;
    let mut cpus: Vec<Cpu> = t.gws.iter().map(Gateway::cpu).collect();
    cpus.extend(t.db_cpus.iter().copied());
    let watch = Watch { gateway: t.gws.first(), nodes: &cpus, ..Watch::default() };
    let note = format!("round {}; {}", round + 1, t.note);
    let (m, mut row) = measure_once(ctx, (&t.name, scenario, conns), &watch, &note, |ctx, secs| {
        // The measured run (after the warm-up): the statements it runs.
        if let Some(s) = statements.as_ref().filter(|_| secs == ctx.opts.secs) {
            s.reset(&t.db)?;
        }
        load(ctx, &t.gws, scenario, conns, secs, auths)
    })?;
    if let Some(s) = &statements {
        s.report(ctx, &format!("{} {scenario} {conns}", t.name), &t.db, m.result.requests)?;
    }
    let (gw_cpu, db_cpu) = m.nodes_cpu.split_at(t.gws.len());
    let per_request = |s: f64| (m.result.requests > 0).then(|| s * 1e6 / m.result.requests as f64);
    row.server_cpu_us = per_request(gw_cpu.iter().sum());
    let db_total: f64 = db_cpu.iter().sum();
    row.db_cpu_us = per_request(db_total);
    let per_node: Vec<f64> = db_cpu.iter().map(|&c| per_request(c).unwrap_or(f64::NAN)).collect();
    if matches!(t.db, Db::Citus(..)) && db_total > 0.0 {
        let shares: Vec<String> = db_cpu.iter().map(|c| format!("{:.0}%", c / db_total * 100.0)).collect();
        row.note = format!("{} nodes {}", row.note, shares.join("/"));
    }
    Ok((row, per_node))
}

/// (target, scenario, conns) → the median CPU per request of each node.
type PerNode = Vec<(String, String, u32, Vec<f64>)>;

/// At each connection count and scenario, `rounds` rounds of one run per
/// target, the order rotating; each target's row is the median of its runs.
fn rounds(ctx: &mut Ctx, targets: &[Target], auths: &str) -> Result<PerNode> {
    let mut per_node = Vec::new();
    for conns in ctx.opts.conns.clone() {
        for scenario in [FIRST, REPLAY] {
            ctx.progress(&format!("citus: {scenario}, {conns} connections, {} interleaved rounds", ctx.opts.rounds));
            let mut rows: Vec<Vec<(Row, Vec<f64>)>> = targets.iter().map(|_| Vec::new()).collect();
            for round in 0..ctx.opts.rounds.max(1) as usize {
                for k in 0..targets.len() {
                    let i = (k + round) % targets.len();
                    // The other targets' gateways share the cluster: kept
                    // still, their background work is not counted here.
                    let paused = probe::Paused::all_but(targets, Some(i));
                    let measured = measure(ctx, &targets[i], scenario, conns, round, auths)?;
                    drop(paused);
                    ctx.report.progress(&measured.0);
                    rows[i].push(measured);
                    procs::check_interrupted()?;
                }
            }
            for (t, runs) in targets.iter().zip(rows) {
                let nodes = runs.first().map_or(0, |(_, n)| n.len());
                let medians: Vec<f64> = (0..nodes).map(|j| report::median(runs.iter().map(|(_, n)| n[j]).collect())).collect();
                let runs: Vec<Row> = runs.into_iter().map(|(r, _)| r).collect();
                if let Some(mut row) = report::median_row(&runs) {
                    let total: f64 = medians.iter().sum();
                    let each: Vec<String> = medians.iter().map(|c| format!("{c:.0}")).collect();
                    row.note = format!("{}; {}; db CPU per node (us/r) {}", row.note, t.note, each.join("/"));
                    if medians.len() > 1 && total > 0.0 {
                        let busiest = medians.iter().copied().fold(0.0, f64::max) / total;
                        row.note = format!("{}; busiest node {:.0}%", row.note, busiest * 100.0);
                    }
                    per_node.push((t.name.clone(), scenario.to_owned(), conns, medians));
                    ctx.report.add(row);
                }
            }
        }
    }
    Ok(per_node)
}

/// `pg_test_fsync -s 1`: this machine's fdatasync time, for the record.
fn fsync_latency(ctx: &Ctx) -> String {
    let result = (|| -> Result<String> {
        let tool = find_pg_tool("pg_test_fsync")?;
        let file = ctx.dir.join("fsync.test");
        let out = procs::run_tool_ok(Command::new(tool).args(["-s", "1", "-f"]).arg(&file))?;
        let _ = std::fs::remove_file(&file);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines()
            .find(|l| l.contains("fdatasync") && l.contains("usecs/op"))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .context("no fdatasync line")
    })();
    match result {
        Ok(line) => format!("machine: pg_test_fsync -s 1 (8 kB writes, one per sync): {line}"),
        Err(e) => format!("machine: pg_test_fsync not measured ({e:#})"),
    }
}

/// The closing `citus:` line: per request kind, at the most connections
/// (each count's in brackets where it says so), the database CPU per
/// request of one PostgreSQL, of each node and of the whole cluster, the
/// busiest node's share, and the projected capacity of 3 and 9 nodes.
fn summary(ctx: &Ctx, per_node: &PerNode) -> String {
    let top = ctx.opts.conns.iter().copied().max().unwrap_or(0);
    let nodes_of = |t: &str, s: &str, c: u32| per_node.iter().find(|(n, sc, cc, _)| n == t && sc == s && *cc == c).map(|x| x.3.clone());
    let total = |t: &str, s: &str, c: u32| nodes_of(t, s, c).map(|v| v.iter().sum::<f64>());
    let mut parts = Vec::new();
    let mut projected: Vec<(u32, Vec<(String, f64)>)> = vec![(3, Vec::new()), (9, Vec::new())];
    for (kind, scenario) in [("first", FIRST), ("replay", REPLAY)] {
        let (Some(pg), Some(coord), Some(nodes)) =
            (total(PG, scenario, top), nodes_of(COORD, scenario, top), nodes_of(NODES, scenario, top))
        else {
            parts.push(format!("{kind}=n/a"));
            continue;
        };
        let coord_total: f64 = coord.iter().sum();
        let nodes_total: f64 = nodes.iter().sum();
        let busiest = nodes.iter().copied().fold(0.0, f64::max) / nodes_total;
        let each = |v: &[f64]| v.iter().map(|c| format!("{c:.0}")).collect::<Vec<_>>().join("/");
        let ratios: Vec<String> = ctx
            .opts
            .conns
            .iter()
            .filter_map(|&c| Some(format!("{c}:{:.2}", total(NODES, scenario, c)? / total(PG, scenario, c)?)))
            .collect();
        parts.push(format!(
            "{kind}: db_cpu_us pg={pg:.0} {COORD}={coord_total:.0}({}) {NODES}={nodes_total:.0}({}) {kind}_cluster_vs_pg={:.2}({}) \
             {kind}_busiest_node_share={busiest:.2}",
            each(&coord),
            each(&nodes),
            nodes_total / pg,
            ratios.join(","),
        ));
        // A cluster of n nodes, each the size of the one PostgreSQL: the
        // busiest node saturates first, carrying `busiest * 3 / n` of the
        // cluster's work (the imbalance measured on three nodes).
        for (n, values) in &mut projected {
            let n_f = f64::from(*n);
            values.push((kind.to_owned(), pg / (nodes_total * busiest * 3.0 / n_f)));
        }
    }
    let projections: Vec<String> = projected
        .iter()
        .map(|(n, values)| {
            let lowest = values.iter().map(|(_, v)| *v).fold(f64::INFINITY, f64::min);
            let each: Vec<String> = values.iter().map(|(k, v)| format!("{k}:{v:.2}")).collect();
            format!("citus_projected_capacity_{n}={lowest:.2}({})", each.join(","))
        })
        .collect();
    format!(
        "citus: nodes=3 conns={top} {} {} [medians of interleaved rounds; db CPU of every database process per request; \
         {NODES}: 3 gateways each given every node, statements at their shards' nodes; projection: n * pg / (cluster * busiest share * 3)]",
        parts.join(" "),
        projections.join(" ")
    )
}
