//! `--scale`: first writes and replays with millions of pre-existing records
//! (generated with SQL, not through the gateway), and the sweeper's delete
//! rate against the insert rate.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::gateway::{self, Gateway, Spec, Store};
use crate::pg::Pg;
use crate::pgbench::{self, Length, Statement};
use crate::report::micros;
use crate::suite::{Ctx, Measured, Watch, key_prefix, measure, request_env};
use crate::upstream::Upstream;
use crate::wrk::Scenario;
use crate::{Options, procs};

const TEMPLATE_KEY: &str = "scale-template";
/// Rows per INSERT ... SELECT generate_series statement.
const CHUNK: u64 = 1_000_000;

/// What one database size measured (at the smallest connection count).
struct AtSize {
    rows: u64,
    first_write_p50_us: f64,
    claim_p50_s: Option<f64>,
    replay_p50_us: f64,
    best_first_write_rps: f64,
}

pub fn run(opts: &Options, dir: &Path) -> Result<()> {
    let mut ctx = Ctx::new(opts, dir)?;
    ctx.progress(&format!("--scale: record counts {:?}, sweep of {} expired records", opts.scale_rows, opts.sweep_rows));
    let upstream = Upstream::start(dir)?;
    let pg = Pg::start()?;
    let captured = pgbench::capture(&pg, dir, upstream.addr)?;
    let sweep = captured.sweep.clone().context("the capture gateway's sweeper ran no DELETE; is the sweeper disabled?")?;
    // Bulk generation writes gigabytes of WAL; fewer forced checkpoints.
    pg.psql("postgres", "ALTER SYSTEM SET max_wal_size = '8GB'")?;
    pg.psql("postgres", "SELECT pg_reload_conf()")?;

    let url = pg.create_database("bench")?;
    pg.set_database_settings("bench", &opts.pg_settings)?;
    let spec = Spec::new("gateway-pg", Store::Postgres { url }, upstream.addr);
    spec.migrate(dir)?;
    let gw = Gateway::start(&spec, dir)?;
    gw.populate(&[TEMPLATE_KEY.to_owned()], 1)?;

    let mut sizes = Vec::new();
    let mut have = 0;
    for &rows in &opts.scale_rows {
        ctx.progress(&format!("generating records up to {rows}"));
        generate(&pg, "s", have, rows, "now() + interval '24 hours'")?;
        have = have.max(rows);
        pg.psql("bench", "ANALYZE idemgate_records")?;
        sizes.push(at_size(&mut ctx, &gw, &pg, rows)?);
    }
    gw.stop()?;
    let insert_rate = sizes.iter().map(|s| s.best_first_write_rps).fold(0.0, f64::max);
    ctx.progress(&format!("sweep of {} expired records", opts.sweep_rows));
    let sweep_rate = sweep_rate(&ctx, &pg, &sweep)?;
    ctx.progress("the gateway's own sweeper: records per tick");
    let per_tick = sweeper_per_tick(&ctx, &pg, &spec)?;

    println!("\n{}", ctx.report.table());
    print_summary(&sizes, sweep_rate, insert_rate, per_tick)?;
    Ok(())
}

/// Records the gateway's sweeper deletes in one tick (it stops after a
/// bounded number of batches per tick), with expired records to spare.
fn sweeper_per_tick(ctx: &Ctx, pg: &Pg, spec: &Spec) -> Result<u64> {
    generate(pg, "y", 0, ctx.opts.sweep_rows, "now() - interval '1 hour'")?;
    pg.settle("bench")?;
    let mut spec = spec.clone();
    spec.name = "gateway-sweeper".into();
    spec.sweep_interval = "1s";
    let gw = Gateway::start(&spec, ctx.dir)?;
    let swept = || -> Result<u64> { Ok(gw.metrics()?.total("idemgate_swept_records_total") as u64) };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = 0;
    let mut stable_since = Instant::now();
    while Instant::now() < deadline {
        procs::sleep(Duration::from_millis(50))?;
        let now = swept()?;
        if now != last {
            (last, stable_since) = (now, Instant::now());
        } else if last > 0 && stable_since.elapsed() > Duration::from_millis(400) {
            break;
        }
    }
    gw.stop()?;
    Ok(last)
}

/// Inserts completed records `prefix{n}` for n in (from, to], copied from the
/// template record, in chunks.
fn generate(pg: &Pg, prefix: &str, from: u64, to: u64, expires: &str) -> Result<()> {
    let started = Instant::now();
    let mut done = from;
    while done < to {
        let end = (done + CHUNK).min(to);
        pg.psql("bench", &insert_sql(prefix, done + 1, end, expires))?;
        done = end;
        let rate = (done - from) as f64 / started.elapsed().as_secs_f64().max(1e-3);
        eprintln!("bench: generated {prefix}-records {done}/{to} ({rate:.0} rows/s)");
    }
    Ok(())
}

fn insert_sql(prefix: &str, first: u64, last: u64, expires: &str) -> String {
    format!(
        "INSERT INTO idemgate_records (tenant, principal, operation, idempotency_key, request_hash, state, generation, \
             claim_token, owner, lease_expires_at, response_status, response_headers, response_body, created_at, updated_at, expires_at,
             scope_id)
         SELECT t.tenant, t.principal, t.operation, '{prefix}' || lpad(g::text, 10, '0'), t.request_hash, 'completed', 1,
             t.claim_token, t.owner, NULL, t.response_status, t.response_headers, t.response_body, now(), now(), {expires},
             idemgate_scope_id(t.tenant, t.principal, t.operation, '{prefix}' || lpad(g::text, 10, '0'))
         FROM idemgate_records t CROSS JOIN generate_series({first}::bigint, {last}::bigint) AS g
         WHERE t.scope_id = idemgate_scope_id('bench', 'wrk', '{op}', '{TEMPLATE_KEY}')
           AND t.tenant = 'bench' AND t.principal = 'wrk' AND t.operation = '{op}' AND t.idempotency_key = '{TEMPLATE_KEY}'",
        op = gateway::OPERATION,
    )
}

fn at_size(ctx: &mut Ctx, gw: &Gateway, pg: &Pg, rows: u64) -> Result<AtSize> {
    let label = count_label(rows);
    let target = format!("idemgate-pg@{label}");
    ctx.progress(&target);
    // As before: populated with SQL and analyzed (VACUUM ANALYZE before each run).
    let watch = Watch { gateway: Some(gw), server: Some(gw.cpu()), db: pg.cpu(), pg: Some(pg), pg_db: "bench", analyze: true, nodes: &[] };
    let url = format!("http://{}{}", gw.addr, gateway::ROUTE_PATH);
    let mut first = Vec::new();
    let mut replay = Vec::new();
    for conns in ctx.opts.conns.clone() {
        let env = || {
            let mut env = request_env(ctx.opts);
            env.push(("BENCH_KEY_PREFIX", key_prefix()));
            env
        };
        first.push(measure(ctx, (&target, "first write", conns), &watch, "", |ctx, secs| {
            ctx.wrk(Scenario::FirstWrite, &url, conns, secs, &env())
        })?);
        let replay_env = {
            let mut env = request_env(ctx.opts);
            env.extend([
                ("BENCH_KEY_FORMAT", "s%010d".to_owned()),
                ("BENCH_KEY_FIRST", "1".to_owned()),
                ("BENCH_KEY_COUNT", rows.to_string()),
                ("BENCH_KEY_RANDOM", "1".to_owned()),
            ]);
            env
        };
        replay.push(measure(ctx, (&target, "replay (random key)", conns), &watch, "", |ctx, secs| {
            ctx.wrk(Scenario::Replay, &url, conns, secs, &replay_env)
        })?);
    }
    let claim_p50_s = first.first().and_then(|m| m.after.store_quantile_since(&m.before, "claim", 0.5));
    if let Some(p50) = claim_p50_s {
        ctx.report.line(format!("{target}: claim p50 {} (store histogram, {} conns)", micros(p50 * 1e6), ctx.opts.conns[0]));
    }
    Ok(AtSize {
        rows,
        first_write_p50_us: first.first().map(|m| m.result.p50_us).unwrap_or(f64::NAN),
        claim_p50_s,
        replay_p50_us: replay.first().map(|m| m.result.p50_us).unwrap_or(f64::NAN),
        best_first_write_rps: first.iter().map(|m: &Measured| m.result.rps).fold(0.0, f64::max),
    })
}

/// Deletes `sweep_rows` expired records with the sweeper's own statement in a
/// loop (one pgbench client, one statement per transaction); rows per second.
fn sweep_rate(ctx: &Ctx, pg: &Pg, sweep: &Statement) -> Result<f64> {
    let n = ctx.opts.sweep_rows;
    generate(pg, "x", 0, n, "now() - interval '1 hour'")?;
    pg.settle("bench")?;
    let batch: u64 = sweep.params.first().cloned().flatten().and_then(|b| b.parse().ok()).unwrap_or(500);
    let workload = pgbench::workload(ctx.dir, "sweep", std::slice::from_ref(sweep), "1")?;
    let started = Instant::now();
    pgbench::run(pg, "bench", ctx.dir, &workload, 1, Length::Transactions(n.div_ceil(batch) + 1))?;
    let elapsed = started.elapsed().as_secs_f64();
    let left: u64 = pg
        .psql("bench", "SELECT count(*) FROM idemgate_records WHERE state = 'completed' AND expires_at <= now()")?
        .parse()
        .context("counting expired records")?;
    procs::check_interrupted()?;
    let rate = n.saturating_sub(left) as f64 / elapsed;
    eprintln!("bench: swept {} records in {elapsed:.1} s, batch {batch} ({left} left)", n.saturating_sub(left));
    Ok(rate)
}

fn print_summary(sizes: &[AtSize], sweep_rate: f64, insert_rate: f64, per_tick: u64) -> Result<()> {
    for s in sizes {
        println!(
            "scale {:>5}: first write p50 {}, claim p50 {}, replay p50 {}",
            count_label(s.rows),
            micros(s.first_write_p50_us),
            s.claim_p50_s.map(|c| micros(c * 1e6)).unwrap_or_else(|| "n/a".into()),
            micros(s.replay_p50_us)
        );
    }
    let (small, large) = (sizes.first(), sizes.last());
    let ratio = |f: fn(&AtSize) -> Option<f64>| match (small.and_then(f), large.and_then(f)) {
        (Some(a), Some(b)) if a > 0.0 => format!("{:.2}", b / a),
        _ => "n/a".to_owned(),
    };
    let names = match (small, large) {
        (Some(a), Some(b)) => format!("{}_vs_{}", count_label(b.rows).to_lowercase(), count_label(a.rows).to_lowercase()),
        _ => "n/a".into(),
    };
    let (interval, batch) = gateway::default_sweeper()?;
    println!(
        "sweeper: one tick of the running gateway deleted all {per_tick} expired records (batches of {batch}, every {interval:?}); \
         a tick drains the whole backlog, so its rate is the statement's rate below"
    );
    println!(
        "scale: claim_p50_{names}={} first_write_p50_{names}={} replay_p50_{names}={} sweep_rows_per_s={sweep_rate:.0} first_write_rows_per_s={insert_rate:.0} sweep_vs_insert={:.2}",
        ratio(|s| s.claim_p50_s),
        ratio(|s| Some(s.first_write_p50_us)),
        ratio(|s| Some(s.replay_p50_us)),
        if insert_rate > 0.0 { sweep_rate / insert_rate } else { f64::NAN },
    );
    Ok(())
}

/// 1000000 → "1M", 20000 → "20k".
fn count_label(n: u64) -> String {
    if n >= 1_000_000 && n.is_multiple_of(1_000_000) {
        format!("{}M", n / 1_000_000)
    } else if n >= 1000 && n.is_multiple_of(1000) {
        format!("{}k", n / 1000)
    } else {
        n.to_string()
    }
}
