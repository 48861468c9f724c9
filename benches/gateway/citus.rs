//! `scripts/bench --citus` (group `citus`, run only when named): the store
//! on a Citus cluster beside the store on one PostgreSQL (issue 30).
//!
//! It starts from fresh databases a single PostgreSQL node and a Citus
//! cluster (a coordinator and two workers, the integration tests' harness,
//! `tests/support/citus.rs`), migrates the cluster twice, with 8 and with 64
//! shards per table (`citus.shard_count` set on the database before
//! `idemgate migrate` distributes the tables), and measures first writes and
//! replays on each in interleaved rounds (the targets take turns, the order
//! rotating; medians). The load comes from `IDEMGATE_BENCH_CITUS_TENANTS`
//! [16] tenants, one API key each, so that it spreads over shards and
//! workers as a real deployment's does. Each row's db CPU is the CPU of every
//! node (postmaster and backends, `/proc`); the notes give the coordinator's
//! share of it. `IDEMGATE_BENCH_CITUS_BEFORE_BIN`: another gateway binary
//! (a build from before a change) measured as one more target on a cluster
//! database of its own with 8 shards.
//!
//! Then "query from any node": a gateway whose URL names a worker instead of
//! the coordinator is started and sent a first write and its replay, first
//! on the schema as `idemgate migrate` leaves it, then, if refused, with the
//! generation sequence on every node (made a column default of the records,
//! which Citus creates on each node with a range of its own). The summary
//! line says whether each served and, if not, what refused it. If one
//! serves, three gateways, one per node, are measured against three
//! gateways all on the coordinator (wrk's connections split over them).
//!
//! Closes with a `citus:` line after the `ratios:` line.

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

const FIRST: &str = "first write";
const REPLAY: &str = "replay";
const PG: &str = "cmp-pg";
const SHARDS: [u32; 2] = [8, 64];

/// Whether the group runs: only when `IDEMGATE_BENCH_ONLY` names it.
pub fn wanted(opts: &Options) -> bool {
    opts.only.as_ref().is_some_and(|only| only.iter().any(|g| g == "citus"))
}

fn citus_target(shards: u32) -> String {
    format!("citus-{shards}")
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

/// The tenants' API keys: `bench-t00`, ... for tenants `t00`, ...
fn api_keys() -> Result<Vec<(String, String)>> {
    let n: usize = crate::env_num("IDEMGATE_BENCH_CITUS_TENANTS", 16)?;
    Ok((0..n.max(1)).map(|i| (format!("bench-t{i:02}"), format!("t{i:02}"))).collect())
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

pub fn run(ctx: &mut Ctx, upstream: SocketAddr) -> Result<()> {
    ctx.report.line(fsync_latency(ctx));
    let keys = api_keys()?;
    let auths: String = keys.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(",");
    let spec = |name: &str, store: Store| {
        let mut s = Spec::new(name, store, upstream);
        s.identity = Some(identity(&keys));
        s
    };
    ctx.progress("citus: a PostgreSQL node and a Citus cluster (coordinator + 2 workers), fresh databases");
    let pg = Pg::start()?;
    let cluster = CitusCluster::start(2).context("starting a Citus cluster (tests/support/citus.rs)")?;
    for node in cluster.nodes() {
        if let Some(pid) = node.watchdog_pid() {
            procs::register_group(pid);
        }
    }
    let cluster_cpus: Vec<Cpu> = cluster.nodes().filter_map(|n| n.postmaster_pid()).map(Cpu::Tree).collect();
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
    let cluster_db = |db: &str, shards: u32| -> Result<String> {
        let url = cluster.create_database(db).with_context(|| format!("creating {db} on the cluster"))?;
        cluster.coordinator.simple_query(db, &format!("ALTER DATABASE {db} SET citus.shard_count = {shards}"))?;
        Ok(url)
    };
    for shards in SHARDS {
        let db = format!("cmp_citus_{shards}");
        let url = cluster_db(&db, shards)?;
        let s = spec(&format!("citus-cmp-{shards}"), Store::Citus { url });
        let gw = prepared(ctx, &s, &keys)?;
        let found = shard_count(&cluster, &db)?;
        targets.push(Target {
            name: citus_target(shards),
            gws: vec![gw],
            db_cpus: cluster_cpus.clone(),
            db: Db::Citus(&cluster, db),
            note: format!("{found} shards"),
        });
    }
    if let Some(before) = std::env::var_os("IDEMGATE_BENCH_CITUS_BEFORE_BIN").map(PathBuf::from) {
        let db = "cmp_citus_before";
        let url = cluster_db(db, 8)?;
        let mut s = spec("citus-cmp-before", Store::Citus { url });
        s.binary = Some(before.clone());
        targets.push(Target {
            name: "citus-8-before".into(),
            gws: vec![prepared(ctx, &s, &keys)?],
            db_cpus: cluster_cpus.clone(),
            db: Db::Citus(&cluster, db.into()),
            note: format!("gateway {}", before.display()),
        });
    }
    ctx.report.line(format!(
        "citus: {} tenants (one API key each); cluster: coordinator + 2 workers, each node a private PostgreSQL with the bench's settings; \
         db CPU of a cluster: all three nodes, the coordinator's share in the notes",
        keys.len()
    ));
    let mut shares = rounds(ctx, &targets, &auths)?;
    let any_node = any_node(ctx, &cluster, &spec, &keys, &auths, &cluster_cpus, &mut shares)?;
    for t in targets {
        t.stop()?;
    }
    let summary = summary(ctx, &shares, &any_node);
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
/// from the processes' `/proc` times) and the coordinator's share of the
/// database CPU (a cluster's).
fn measure(ctx: &Ctx, t: &Target, scenario: &str, conns: u32, round: usize, auths: &str) -> Result<(Row, Option<f64>)> {
    t.db.settle()?;
    let mut cpus: Vec<Cpu> = t.gws.iter().map(Gateway::cpu).collect();
    cpus.extend(t.db_cpus.iter().copied());
    let watch = Watch { gateway: t.gws.first(), nodes: &cpus, ..Watch::default() };
    let note = format!("round {}; {}", round + 1, t.note);
    let (m, mut row) =
        measure_once(ctx, (&t.name, scenario, conns), &watch, &note, |ctx, secs| load(ctx, &t.gws, scenario, conns, secs, auths))?;
    let (gw_cpu, db_cpu) = m.nodes_cpu.split_at(t.gws.len());
    let per_request = |s: f64| (m.result.requests > 0).then(|| s * 1e6 / m.result.requests as f64);
    row.server_cpu_us = per_request(gw_cpu.iter().sum());
    let db_total: f64 = db_cpu.iter().sum();
    row.db_cpu_us = per_request(db_total);
    let share = (matches!(t.db, Db::Citus(..)) && db_total > 0.0).then(|| db_cpu[0] / db_total);
    if let Some(share) = share {
        row.note = format!("{} coordinator {:.0}% of db CPU", row.note, share * 100.0);
    }
    Ok((row, share))
}

/// (target, scenario, conns) → the median coordinator share of its runs.
type Shares = Vec<(String, String, u32, f64)>;

/// At each connection count and scenario, `rounds` rounds of one run per
/// target, the order rotating; each target's row is the median of its runs.
fn rounds(ctx: &mut Ctx, targets: &[Target], auths: &str) -> Result<Shares> {
    let mut shares = Vec::new();
    for conns in ctx.opts.conns.clone() {
        for scenario in [FIRST, REPLAY] {
            ctx.progress(&format!("citus: {scenario}, {conns} connections, {} interleaved rounds", ctx.opts.rounds));
            let mut rows: Vec<Vec<(Row, Option<f64>)>> = targets.iter().map(|_| Vec::new()).collect();
            for round in 0..ctx.opts.rounds.max(1) as usize {
                for k in 0..targets.len() {
                    let i = (k + round) % targets.len();
                    let measured = measure(ctx, &targets[i], scenario, conns, round, auths)?;
                    ctx.report.progress(&measured.0);
                    rows[i].push(measured);
                    procs::check_interrupted()?;
                }
            }
            for (t, runs) in targets.iter().zip(rows) {
                let share: Vec<f64> = runs.iter().filter_map(|(_, s)| *s).collect();
                let runs: Vec<Row> = runs.into_iter().map(|(r, _)| r).collect();
                if let Some(mut row) = report::median_row(&runs) {
                    row.note = format!("{}; {}", row.note, t.note);
                    if !share.is_empty() {
                        let median = report::median(share);
                        row.note = format!("{row_note}; coordinator {:.0}% of db CPU", median * 100.0, row_note = row.note);
                        shares.push((t.name.clone(), scenario.to_owned(), conns, median));
                    }
                    ctx.report.add(row);
                }
            }
        }
    }
    Ok(shares)
}

/// What a gateway whose URL names a worker did.
enum AnyNode {
    /// It served a first write and its replay.
    Serves,
    /// It did not start, or a request failed: why.
    Refused(String),
}

/// Query from any node. First as `idemgate migrate` leaves the cluster: does
/// a gateway whose URL names a worker start and serve a first write and its
/// replay? If not, with what it takes (the generation sequence on every
/// node: a column default on a distributed table makes Citus create it on
/// each node, drawing from a range of its own), again; if it then serves,
/// three gateways, one per node, against three on the coordinator.
fn any_node(
    ctx: &mut Ctx,
    cluster: &CitusCluster,
    spec: &dyn Fn(&str, Store) -> Spec,
    keys: &[(String, String)],
    auths: &str,
    cluster_cpus: &[Cpu],
    shares: &mut Shares,
) -> Result<(AnyNode, Option<AnyNode>, Option<usize>)> {
    let db = "any_node";
    ctx.progress("citus: query from any node: a gateway whose URL names a worker");
    let url = cluster.create_database(db)?;
    cluster.coordinator.simple_query(db, &format!("ALTER DATABASE {db} SET citus.shard_count = {}", SHARDS[0]))?;
    spec("citus-any-coordinator-0", Store::Citus { url: url.clone() }).migrate(ctx.dir)?;
    let worker_url = cluster.workers[0].url(db);
    let as_migrated = probe(ctx, &spec("citus-any-probe-1", Store::Citus { url: worker_url.clone() }), keys, "probe-1")?;
    let with_sequence = match &as_migrated {
        AnyNode::Serves => None,
        AnyNode::Refused(why) => {
            ctx.report.line(format!("citus: a gateway on a worker, schema as migrated: refused: {why}"));
            cluster
                .coordinator
                .simple_query(db, "ALTER TABLE idemgate_records ALTER COLUMN generation SET DEFAULT nextval('idemgate_generation')")?;
            let again = probe(ctx, &spec("citus-any-probe-2", Store::Citus { url: worker_url }), keys, "probe-2")?;
            if let AnyNode::Refused(why) = &again {
                ctx.report.line(format!("citus: a gateway on a worker, generation sequence on every node: refused: {why}"));
            }
            Some(again)
        }
    };
    if matches!(with_sequence.as_ref().unwrap_or(&as_migrated), AnyNode::Refused(_)) {
        return Ok((as_migrated, with_sequence, None));
    }
    ctx.report.line("citus: a gateway on a worker served a first write and its replay; measuring 3 gateways one per node".into());
    let nodes: Vec<String> = cluster.nodes().map(|n| n.url(db)).collect();
    let mut spread = Vec::new();
    let mut central = Vec::new();
    for (i, node_url) in nodes.iter().enumerate() {
        let s = spec(&format!("citus-any-node-{i}"), Store::Citus { url: node_url.clone() });
        spread.push(Gateway::start(&s, ctx.dir)?);
        let s = spec(&format!("citus-any-coordinator-{i}"), Store::Citus { url: url.clone() });
        central.push(Gateway::start(&s, ctx.dir)?);
    }
    populate(&central[0], ctx.opts.replay_keys, keys)?;
    let targets = [
        Target {
            name: "citus-coord-x3".into(),
            gws: central,
            db_cpus: cluster_cpus.to_vec(),
            db: Db::Citus(cluster, db.into()),
            note: "3 gateways, all on the coordinator".into(),
        },
        Target {
            name: "citus-any-x3".into(),
            gws: spread,
            db_cpus: cluster_cpus.to_vec(),
            db: Db::Citus(cluster, db.into()),
            note: "3 gateways, one per node".into(),
        },
    ];
    shares.extend(rounds(ctx, &targets, auths)?);
    for t in targets {
        t.stop()?;
    }
    // What the gateways on the workers logged (their background work ran
    // there too: sweeper, lease reaper, relay and reconciler rounds).
    let logged: Vec<String> =
        (0..nodes.len()).flat_map(|i| warnings(&procs::read_lossy(&ctx.dir.join(format!("citus-any-node-{i}.log"))))).collect();
    ctx.report.line(format!(
        "citus: warnings and errors logged by the gateways on the nodes: {} {}",
        logged.len(),
        logged.first().map(String::as_str).unwrap_or("")
    ));
    Ok((as_migrated, with_sequence, Some(logged.len())))
}

/// A gateway with `spec` (its URL naming a worker): a first write and its replay.
fn probe(ctx: &Ctx, spec: &Spec, keys: &[(String, String)], key: &str) -> Result<AnyNode> {
    let gw = match Gateway::start(spec, ctx.dir) {
        Ok(gw) => gw,
        Err(e) => {
            let log = procs::read_lossy(&ctx.dir.join(format!("{}.log", spec.name)));
            return Ok(AnyNode::Refused(warnings(&log).into_iter().next().unwrap_or_else(|| format!("did not start: {e:#}"))));
        }
    };
    let mut conn = Conn::open(gw.addr)?;
    let auth = format!("Bearer {}", keys[0].0);
    let first = post(&mut conn, &auth, key)?;
    let again = post(&mut conn, &auth, key)?;
    gw.stop()?;
    if first.status == 201 && again.status == 201 && again.header("idempotent-replayed") == Some("true") {
        return Ok(AnyNode::Serves);
    }
    let log = procs::read_lossy(&ctx.dir.join(format!("{}.log", spec.name)));
    let why = warnings(&log).into_iter().next().unwrap_or_default();
    Ok(AnyNode::Refused(format!("first write answered {}, its retry {}: {why}", first.status, again.status)))
}

/// The warnings and errors of a gateway's JSON log: message and error.
fn warnings(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).ok()?;
            let level = v.get("level")?.as_str()?;
            if !(level.eq_ignore_ascii_case("error") || level.eq_ignore_ascii_case("warn")) {
                return None;
            }
            let fields = v.get("fields").unwrap_or(&v);
            let message = fields.get("message").and_then(|m| m.as_str()).unwrap_or("");
            let error = fields.get("error").and_then(|m| m.as_str()).unwrap_or("");
            Some(format!("{message}: {error}"))
        })
        .collect()
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

/// The closing `citus:` line: ratios of the medians at the highest
/// connection count (each count's in brackets).
fn summary(ctx: &Ctx, shares: &Shares, any_node: &(AnyNode, Option<AnyNode>, Option<usize>)) -> String {
    let rows = &ctx.report.rows;
    let find = |t: &str, s: &str, c: u32| rows.iter().find(|r| r.target == t && r.scenario == s && r.conns == c);
    let per_conns = |f: &dyn Fn(u32) -> Option<f64>| -> String {
        let values: Vec<(u32, f64)> = ctx.opts.conns.iter().filter_map(|&c| f(c).filter(|v| v.is_finite()).map(|v| (c, v))).collect();
        match values.iter().max_by_key(|(c, _)| *c) {
            None => "n/a".into(),
            Some((_, top)) => {
                let each: Vec<String> = values.iter().map(|(c, v)| format!("{c}:{v:.2}")).collect();
                format!("{top:.2}({})", each.join(","))
            }
        }
    };
    let rps = |a: String, b: &str, s: &str| per_conns(&|c| Some(find(&a, s, c)?.result.rps / find(b, s, c)?.result.rps));
    let cpu = |t: String, s: &str| {
        per_conns(&|c| {
            let r = find(&t, s, c)?;
            Some(r.db_cpu_us? + r.server_cpu_us?)
        })
    };
    let db_cpu = |t: String, s: &str| per_conns(&|c| find(&t, s, c)?.db_cpu_us);
    let cpu_ratio = |a: String, b: String, s: &str| {
        per_conns(&|c| {
            let (a, b) = (find(&a, s, c)?, find(&b, s, c)?);
            Some((a.db_cpu_us? + a.server_cpu_us?) / (b.db_cpu_us? + b.server_cpu_us?))
        })
    };
    let share = |t: String, s: &str| per_conns(&|c| shares.iter().find(|(n, sc, cc, _)| *n == t && sc == s && *cc == c).map(|x| x.3));
    let (small, big) = (citus_target(SHARDS[0]), citus_target(SHARDS[1]));
    let refused = |why: &str| format!("refused({})", why.replace(' ', "_").chars().take(160).collect::<String>());
    let state = |a: &AnyNode| match a {
        AnyNode::Serves => "serves".to_owned(),
        AnyNode::Refused(why) => refused(why),
    };
    let (as_migrated, with_sequence, warnings) = any_node;
    let mut any = format!("any_node={}", state(as_migrated));
    if let Some(w) = with_sequence {
        any.push_str(&format!(" any_node_with_sequence_on_every_node={}", state(w)));
    }
    if let Some(warnings) = warnings {
        any.push_str(&format!(
            " any_first_vs_coordinator={} any_replay_vs_coordinator={} any_coordinator_share_first={} any_node_gateway_warnings={warnings}",
            rps("citus-any-x3".into(), "citus-coord-x3", FIRST),
            rps("citus-any-x3".into(), "citus-coord-x3", REPLAY),
            share("citus-any-x3".into(), FIRST),
        ));
    }
    format!(
        "citus: nodes=3 first_citus_vs_pg={} replay_citus_vs_pg={} coordinator_share_first={} cpu_us_per_first pg={} citus{}={} citus{}={} \
         cpu_us_per_replay pg={} citus{}={} db_cpu_us_per_first citus{}={} citus{}={} first_cpu_{}_vs_{}_shards={} replay_cpu_{}_vs_{}_shards={} {any} \
         [medians of interleaved rounds; cpu: gateway + every database process, per request; ratios at the most connections, each count's in brackets]",
        rps(small.clone(), PG, FIRST),
        rps(small.clone(), PG, REPLAY),
        share(small.clone(), FIRST),
        cpu(PG.into(), FIRST),
        SHARDS[0],
        cpu(small.clone(), FIRST),
        SHARDS[1],
        cpu(big.clone(), FIRST),
        cpu(PG.into(), REPLAY),
        SHARDS[0],
        cpu(small.clone(), REPLAY),
        SHARDS[0],
        db_cpu(small.clone(), FIRST),
        SHARDS[1],
        db_cpu(big.clone(), FIRST),
        SHARDS[1],
        SHARDS[0],
        cpu_ratio(big.clone(), small.clone(), FIRST),
        SHARDS[1],
        SHARDS[0],
        cpu_ratio(big, small, REPLAY),
    )
}
