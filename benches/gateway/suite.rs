//! The default run (about 3 minutes): upstream direct, nginx, idemgate on
//! PostgreSQL and on SQLite, and pgbench with the gateway's statements.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::cpu::Cpu;
use crate::gateway::{self, Gateway, Metrics, Spec, Store};
use crate::nginx::Nginx;
use crate::pg::Pg;
use crate::pgbench::{self, Captured, Length};
use crate::report::{self, LoadResult, Report, Row, mib};
use crate::upstream::Upstream;
use crate::wrk::{Load, Scenario, Wrk};
use crate::{Options, procs};

/// Replay keys are decimal strings from here on, so pgbench can draw them
/// with `random()`.
pub const REPLAY_BASE: u64 = 100_000_000;
/// Keys pgbench draws for first writes (far from the replay keys).
const PGBENCH_NEW_KEYS: &str = "random(1000000000000, 9000000000000000000)";

/// Shared by every step of a run.
pub struct Ctx<'a> {
    pub opts: &'a Options,
    pub dir: &'a Path,
    pub wrk: Wrk,
    pub report: Report,
    started: Instant,
}

impl<'a> Ctx<'a> {
    pub fn new(opts: &'a Options, dir: &'a Path) -> Result<Ctx<'a>> {
        let wrk = Wrk::new(opts.wrk.clone(), dir, opts.wrk_threads)?;
        Ok(Ctx { opts, dir, wrk, report: Report::default(), started: Instant::now() })
    }

    /// A progress line on stderr, with the time since the start.
    pub fn progress(&self, what: &str) {
        eprintln!("bench [{:>4.0}s]: {what}", self.started.elapsed().as_secs_f64());
    }

    /// One wrk run of `secs` seconds.
    pub fn wrk(&self, scenario: Scenario, url: &str, conns: u32, secs: u32, env: &[(&'static str, String)]) -> Result<LoadResult> {
        self.wrk.run(&Load { scenario, url: url.to_owned(), conns, secs, env })
    }
}

/// What to watch around a measured run.
#[derive(Default)]
pub struct Watch<'a> {
    /// Its metrics (outcomes) and peak RSS.
    pub gateway: Option<&'a Gateway>,
    /// The server under test, for CPU per request.
    pub server: Option<Cpu>,
    /// The database's processes, for CPU per request.
    pub db: Option<Cpu>,
    /// Checkpointed before each run, so that background work left by the
    /// previous run does not land in this one; its sequential scans of
    /// `idemgate_records` during the run go into the notes.
    pub pg: Option<&'a Pg>,
    /// The database of those runs.
    pub pg_db: &'a str,
    /// Also `VACUUM ANALYZE` before each run (steady-state statistics).
    pub analyze: bool,
    /// Further sets of processes whose CPU seconds during the run are
    /// reported one by one (`Measured::nodes_cpu`: a Citus cluster's nodes).
    pub nodes: &'a [Cpu],
}

/// A measured run and the gateway's metrics around it (warm-up excluded).
pub struct Measured {
    pub result: LoadResult,
    pub before: Metrics,
    pub after: Metrics,
    /// CPU seconds of each of `Watch::nodes` during the measured run.
    pub nodes_cpu: Vec<f64>,
}

/// Warms up (if configured), runs `run` measured, and adds a table row with
/// what `watch` saw. `run` gets the duration in seconds.
pub fn measure(
    ctx: &mut Ctx,
    what: (&str, &str, u32),
    watch: &Watch,
    note: &str,
    run: impl Fn(&Ctx, u32) -> Result<LoadResult>,
) -> Result<Measured> {
    let (measured, row) = measure_once(ctx, what, watch, note, run)?;
    ctx.report.add(row);
    Ok(measured)
}

/// One warmed-up, measured run and its table row (not added to the report).
pub fn measure_once(
    ctx: &Ctx,
    (target, scenario, conns): (&str, &str, u32),
    watch: &Watch,
    note: &str,
    run: impl Fn(&Ctx, u32) -> Result<LoadResult>,
) -> Result<(Measured, Row)> {
    if let Some(pg) = watch.pg {
        if watch.analyze { pg.settle(watch.pg_db)? } else { pg.checkpoint(watch.pg_db)? }
    }
    if ctx.opts.warmup > 0 {
        run(ctx, ctx.opts.warmup)?;
    }
    let seq_before = watch.pg.map(|pg| pg.records_seq_scans(watch.pg_db)).transpose()?;
    let before = watch.gateway.map(Gateway::metrics).transpose()?.unwrap_or_default();
    let reset = watch.gateway.is_some_and(Gateway::reset_peak_rss);
    let cpu_before = (watch.server.map(|c| c.seconds()), watch.db.map(|c| c.seconds()));
    let nodes_before: Vec<f64> = watch.nodes.iter().map(Cpu::seconds).collect();
    let result = run(ctx, ctx.opts.secs)?;
    let nodes_cpu: Vec<f64> = watch.nodes.iter().zip(&nodes_before).map(|(c, b)| c.seconds() - b).collect();
    let per_request = |before: Option<f64>, now: Option<f64>| match (before, now) {
        (Some(b), Some(a)) if result.requests > 0 => Some((a - b) * 1e6 / result.requests as f64),
        _ => None,
    };
    let server_cpu_us = per_request(cpu_before.0, watch.server.map(|c| c.seconds()));
    let db_cpu_us = per_request(cpu_before.1, watch.db.map(|c| c.seconds()));
    let after = watch.gateway.map(Gateway::metrics).transpose()?.unwrap_or_default();
    let mut notes = vec![note.to_owned()];
    if let (Some(pg), Some(before)) = (watch.pg, seq_before) {
        let now = pg.records_seq_scans(watch.pg_db)?;
        notes.push(format!("seq_scan+{} (total {now})", now.saturating_sub(before)));
    }
    notes.extend(outcome_shares(&after.outcomes_since(&before)));
    if watch.gateway.is_some() && !reset {
        notes.push("(peak RSS since start)".into());
    }
    let row = Row {
        target: target.into(),
        scenario: scenario.into(),
        conns,
        result: result.clone(),
        peak_rss_kib: watch.gateway.and_then(|g| g.peak_rss_kib().ok()),
        server_cpu_us,
        db_cpu_us,
        note: notes.iter().filter(|n| !n.is_empty()).cloned().collect::<Vec<_>>().join(" "),
    };
    Ok((Measured { result, before, after, nodes_cpu }, row))
}

fn outcome_shares(outcomes: &[(String, u64)]) -> Vec<String> {
    let total: u64 = outcomes.iter().map(|(_, n)| n).sum();
    outcomes.iter().map(|(o, n)| format!("{o} {:.0}%", 100.0 * *n as f64 / total.max(1) as f64)).collect()
}

/// A group of measurements run after the built-in ones, on the same upstream
/// and report (the feature benches: `features::run`).
pub type Section = fn(&mut Ctx, SocketAddr) -> Result<()>;

pub fn run(opts: &Options, dir: &Path, extra: Option<Section>) -> Result<()> {
    let mut ctx = Ctx::new(opts, dir)?;
    ctx.progress(&format!(
        "{} s per run (+{} s warm-up), connections {:?}, {} interleaved pass-through rounds, gateway {}; numbers from a shared machine are noisy",
        opts.secs,
        opts.warmup,
        opts.conns,
        opts.rounds,
        gateway::binary().display()
    ));
    ctx.report.line(format!("load average at the start: {}", load_average()));
    let cpu_at_start = cpu_times();
    let upstream = Upstream::start(dir)?;
    if opts.wants("upstream") {
        plain_get(&mut ctx, "upstream", upstream.addr, upstream.cpu())?;
    }
    let nginx = if opts.wants("nginx") { Some(Nginx::start(&opts.nginx, dir, upstream.addr)?) } else { None };
    // Every gateway is started first, so the pass-through comparison can
    // interleave its runs with nginx's.
    let pg = if opts.wants("pg") || opts.wants("accesslog") || opts.wants("pgbench") {
        Some(PgSetup::start(&mut ctx, upstream.addr)?)
    } else {
        None
    };
    let sqlite = if opts.wants("sqlite") {
        std::fs::create_dir_all(dir.join("sqlite"))?;
        let store = Store::Sqlite { path: dir.join("sqlite").join("idemgate.db") };
        let spec = Spec::new("gateway-sqlite", store, upstream.addr);
        let gw = prepared_gateway(&ctx, &spec)?;
        Some((spec, gw))
    } else {
        None
    };
    let mut gateways: Vec<(&str, &Gateway)> = Vec::new();
    if let Some(pg) = pg.as_ref().filter(|_| opts.wants("pg")) {
        gateways.push(("idemgate-pg", &pg.gateway));
    }
    if let Some((_, gw)) = &sqlite {
        gateways.push(("idemgate-sqlite", gw));
    }
    passthrough_rounds(&mut ctx, nginx.as_ref(), &gateways)?;
    drop(nginx);
    if let Some(pg) = pg {
        pg.rest(&mut ctx, upstream.addr)?;
    }
    if let Some((spec, gw)) = sqlite {
        gateway_scenarios(&mut ctx, "idemgate-sqlite", &gw, None)?;
        leftovers(&mut ctx, "idemgate-sqlite", &spec)?;
        memory(&mut ctx, "idemgate-sqlite", &gw)?;
        gw.stop()?;
    }
    if let Some(section) = extra {
        section(&mut ctx, upstream.addr)?;
    }
    ctx.report.line(format!("load average at the end: {}", load_average()));
    if let (Some(start), Some(end)) = (cpu_at_start, cpu_times()) {
        let total: u64 = end.iter().zip(&start).map(|(e, s)| e.saturating_sub(*s)).sum();
        let share = |i: usize| 100.0 * end[i].saturating_sub(start[i]) as f64 / total.max(1) as f64;
        ctx.report.line(format!(
            "machine over the run (/proc/stat, all CPUs): steal {:.1}%, iowait {:.1}%, idle {:.1}%",
            share(7),
            share(4),
            share(3)
        ));
    }
    ctx.progress("done");
    println!("\n{}", ctx.report.table());
    println!(
        "(srv CPU: CPU time of the process under test per request; db CPU: of all PostgreSQL processes, checkpointed before each run)"
    );
    println!("(errors: answers other than 2xx/3xx, e.g. the mix's expected 409s for same-key concurrency, plus socket errors)");
    println!(
        "(pass-through and nginx rows: medians of {} interleaved runs, their range in the notes; the passthrough ratios compare medians at each connection count and report the worst; other ratios: best req/s over the connection counts)",
        opts.rounds
    );
    println!("{}", ctx.report.ratio_line());
    for line in &ctx.report.summaries {
        println!("{line}");
    }
    Ok(())
}

/// The first line of `/proc/stat`: user, nice, system, idle, iowait, irq,
/// softirq, steal (clock ticks, all CPUs).
fn cpu_times() -> Option<Vec<u64>> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = text.lines().next()?.split_whitespace().skip(1).take(8).filter_map(|v| v.parse().ok()).collect();
    (fields.len() == 8).then_some(fields)
}

/// `/proc/loadavg`'s first three fields.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// The pass-through comparison: at each connection count, `rounds` rounds
/// of one run per target (nginx and each gateway), the order alternating
/// between rounds; each target's row is the median of its runs, with their
/// range. One lucky or unlucky run cannot make the ratio.
fn passthrough_rounds(ctx: &mut Ctx, nginx: Option<&Nginx>, gateways: &[(&str, &Gateway)]) -> Result<()> {
    if nginx.is_none() && gateways.is_empty() {
        return Ok(());
    }
    ctx.progress(&format!("pass-through: nginx and {} gateway(s), {} interleaved rounds", gateways.len(), ctx.opts.rounds));
    let url = |addr: SocketAddr| format!("http://{addr}{}", gateway::ROUTE_PATH);
    for conns in ctx.opts.conns.clone() {
        let mut runs: Vec<(String, &str, Vec<Row>)> = Vec::new();
        if nginx.is_some() {
            runs.push(("nginx".into(), "GET", Vec::new()));
        }
        for (name, _) in gateways {
            runs.push(((*name).into(), "passthrough", Vec::new()));
        }
        for round in 0..ctx.opts.rounds.max(1) {
            let mut order: Vec<usize> = (0..runs.len()).collect();
            if round % 2 == 1 {
                order.reverse();
            }
            for i in order {
                let (target, scenario) = (runs[i].0.clone(), runs[i].1);
                let (addr, watch) = match (target.as_str(), nginx) {
                    ("nginx", Some(n)) => (n.addr, Watch { server: Some(n.cpu()), ..Watch::default() }),
                    _ => {
                        let gw = gateways
                            .iter()
                            .find(|(name, _)| *name == target)
                            .map(|(_, gw)| *gw)
                            .context("gateway for a pass-through run")?;
                        (gw.addr, Watch { gateway: Some(gw), server: Some(gw.cpu()), ..Watch::default() })
                    }
                };
                let target_url = url(addr);
                let (_, row) = measure_once(ctx, (&target, scenario, conns), &watch, &format!("round {}", round + 1), |ctx, secs| {
                    ctx.wrk(Scenario::Get, &target_url, conns, secs, &[])
                })?;
                ctx.report.progress(&row);
                runs[i].2.push(row);
                procs::check_interrupted()?;
            }
        }
        for (_, _, rows) in runs {
            if let Some(row) = report::median_row(&rows) {
                ctx.report.add(row);
            }
        }
    }
    Ok(())
}

/// The PostgreSQL cluster, the gateway on it, the database of the run
/// without access log, and the statements it captured (for pgbench).
struct PgSetup {
    pg: Pg,
    captured: Captured,
    nolog_url: String,
    spec: Spec,
    gateway: Gateway,
}

impl PgSetup {
    fn start(ctx: &mut Ctx, upstream: SocketAddr) -> Result<PgSetup> {
        ctx.progress("PostgreSQL: start, capture the gateway's statements, populate");
        let pg = Pg::start()?;
        let captured = pgbench::capture(&pg, ctx.dir, upstream)?;
        ctx.report.line(format!("gateway SQL, captured from the PostgreSQL log: {}", captured.describe()));
        // Each gateway gets a database of its own, freshly migrated by it and,
        // unless IDEMGATE_BENCH_STEADY=1, never analyzed: what a new user's
        // gateway meets (autovacuum may analyze it during the runs, as it would).
        let mut urls = Vec::new();
        for db in ["bench", "bench_nolog"] {
            urls.push(pg.create_database(db)?);
            pg.set_database_settings(db, &ctx.opts.pg_settings)?;
        }
        let (url, nolog_url) = (urls.swap_remove(0), urls.swap_remove(0));
        if !ctx.opts.pg_settings.is_empty() {
            ctx.report.line(format!("PostgreSQL settings for the bench database: {:?}", ctx.opts.pg_settings));
        }
        ctx.report.line(if ctx.opts.steady {
            "PostgreSQL runs: VACUUM ANALYZE and CHECKPOINT before each (IDEMGATE_BENCH_STEADY=1)".to_owned()
        } else {
            "PostgreSQL runs: a freshly migrated database, never analyzed by the bench (CHECKPOINT before each run); \
             seq_scan+N: sequential scans of idemgate_records during the run"
                .to_owned()
        });
        let spec = Spec::new("gateway-pg", Store::Postgres { url }, upstream);
        let gateway = prepared_gateway(ctx, &spec)?;
        Ok(PgSetup { pg, captured, nolog_url, spec, gateway })
    }

    /// Everything but the pass-through comparison: the run without access
    /// log, the gateway's other scenarios, then pgbench's ceiling.
    fn rest(self, ctx: &mut Ctx, upstream: SocketAddr) -> Result<()> {
        let PgSetup { pg, captured, nolog_url, spec, gateway } = self;
        if ctx.opts.wants("accesslog") {
            without_access_log(ctx, &pg, &nolog_url, upstream)?;
        }
        if ctx.opts.wants("pg") {
            gateway_scenarios(ctx, "idemgate-pg", &gateway, Some(&pg))?;
            leftovers(ctx, "idemgate-pg", &spec)?;
            memory(ctx, "idemgate-pg", &gateway)?;
        }
        gateway.stop()?;
        if ctx.opts.wants("pgbench") {
            pgbench_ceiling(ctx, &pg, &captured)?;
        }
        Ok(())
    }
}

/// The same GET straight to a server (upstream, nginx).
fn plain_get(ctx: &mut Ctx, target: &str, addr: SocketAddr, cpu: Cpu) -> Result<()> {
    ctx.progress(target);
    let url = format!("http://{addr}{}", gateway::ROUTE_PATH);
    let watch = Watch { server: Some(cpu), ..Watch::default() };
    for conns in ctx.opts.conns.clone() {
        measure(ctx, (target, "GET", conns), &watch, "", |ctx, secs| ctx.wrk(Scenario::Get, &url, conns, secs, &[]))?;
    }
    Ok(())
}

/// First writes and replays with `server.access_log = false`, for the
/// `access_log_*` ratios (the main runs have it on, the default).
fn without_access_log(ctx: &mut Ctx, pg: &Pg, url: &str, upstream: SocketAddr) -> Result<()> {
    let mut spec = Spec::new("gateway-pg-nolog", Store::Postgres { url: url.to_owned() }, upstream);
    spec.access_log = false;
    let gw = prepared_gateway(ctx, &spec)?;
    let target = "idemgate-pg-nolog";
    ctx.progress(target);
    let url = format!("http://{}{}", gw.addr, gateway::ROUTE_PATH);
    let watch = Watch {
        gateway: Some(&gw),
        server: Some(gw.cpu()),
        db: pg.cpu(),
        pg: Some(pg),
        pg_db: "bench_nolog",
        analyze: ctx.opts.steady,
        nodes: &[],
    };
    for (name, scenario) in [("first write", Scenario::FirstWrite), ("replay", Scenario::Replay)] {
        for conns in ctx.opts.conns.clone() {
            let env = || replay_env(ctx.opts);
            measure(ctx, (target, name, conns), &watch, "access_log = false", |ctx, secs| ctx.wrk(scenario, &url, conns, secs, &env()))?;
        }
    }
    gw.stop()
}

/// Migrated, started, and holding the completed keys replays use.
fn prepared_gateway(ctx: &Ctx, spec: &Spec) -> Result<Gateway> {
    spec.migrate(ctx.dir)?;
    let gw = Gateway::start(spec, ctx.dir)?;
    let keys: Vec<String> = (0..ctx.opts.replay_keys).map(|i| (REPLAY_BASE + i).to_string()).collect();
    gw.populate(&keys, 16)?;
    Ok(gw)
}

/// First writes, replays and the mix, at each connection count (pass-through
/// is measured in the interleaved rounds).
fn gateway_scenarios(ctx: &mut Ctx, target: &str, gw: &Gateway, pg: Option<&Pg>) -> Result<()> {
    ctx.progress(target);
    let url = format!("http://{}{}", gw.addr, gateway::ROUTE_PATH);
    let watch = Watch {
        gateway: Some(gw),
        server: Some(gw.cpu()),
        db: pg.and_then(Pg::cpu),
        pg,
        pg_db: "bench",
        analyze: ctx.opts.steady,
        nodes: &[],
    };
    for (name, scenario) in [("first write", Scenario::FirstWrite), ("replay", Scenario::Replay), ("mix", Scenario::Mix)] {
        for conns in ctx.opts.conns.clone() {
            let env = || replay_env(ctx.opts);
            measure(ctx, (target, name, conns), &watch, "", |ctx, secs| ctx.wrk(scenario, &url, conns, secs, &env()))?;
        }
    }
    Ok(())
}

/// A short prefix that makes one wrk run's new keys unique: `r1`, `r2`, ...
pub fn key_prefix() -> String {
    static RUNS: AtomicU64 = AtomicU64::new(1);
    format!("r{}", RUNS.fetch_add(1, Ordering::Relaxed))
}

/// What every idempotent wrk scenario sends.
pub fn request_env(opts: &Options) -> Vec<(&'static str, String)> {
    vec![
        ("BENCH_KEY_ORDER", opts.key_order.clone()),
        ("BENCH_API_KEY", gateway::API_KEY.into()),
        ("BENCH_BODY", gateway::POST_BODY.into()),
        ("BENCH_PATH", gateway::ROUTE_PATH.into()),
    ]
}

/// `request_env` plus the completed keys replays cycle through (the ones
/// `prepared_gateway` populated).
fn replay_env(opts: &Options) -> Vec<(&'static str, String)> {
    let mut env = request_env(opts);
    env.push(("BENCH_KEY_PREFIX", key_prefix()));
    env.push(("BENCH_KEY_FORMAT", "%d".into()));
    env.push(("BENCH_KEY_FIRST", REPLAY_BASE.to_string()));
    env.push(("BENCH_KEY_COUNT", opts.replay_keys.to_string()));
    env
}

/// Records still `in_flight` or `unknown` once the load has stopped: claims
/// whose request was never recorded (wrk closes its connections with
/// requests in flight at the end of every run).
fn leftovers(ctx: &mut Ctx, target: &str, spec: &Spec) -> Result<()> {
    procs::sleep(Duration::from_secs(1))?;
    let in_flight = spec.count_state(ctx.dir, "in_flight")?;
    let unknown = spec.count_state(ctx.dir, "unknown")?;
    ctx.report.line(format!(
        "{target} records left after the runs: in_flight={in_flight} unknown={unknown} \
         (each is a claim whose client went away before it was forwarded or recorded; they expire to unknown)"
    ));
    Ok(())
}

/// VmRSS idle and with many open idle client connections.
fn memory(ctx: &mut Ctx, target: &str, gw: &Gateway) -> Result<()> {
    let n = ctx.opts.idle_conns;
    if n == 0 {
        return Ok(());
    }
    ctx.progress(&format!("{target}: RSS with {n} idle connections"));
    let (idle, with) = gw.rss_with_idle_connections(n)?;
    let per_conn = with.saturating_sub(idle) as f64 / n as f64;
    ctx.report.line(format!(
        "{target} memory: VmRSS {} idle after the runs, {} with {n} open idle client connections ({per_conn:.1} KiB per connection)",
        mib(idle),
        mib(with)
    ));
    Ok(())
}

/// pgbench with the captured statements at the same client counts.
fn pgbench_ceiling(ctx: &mut Ctx, pg: &Pg, captured: &Captured) -> Result<()> {
    ctx.progress("pgbench with the gateway's statements");
    let replay_keys = format!("random({REPLAY_BASE}, {})", REPLAY_BASE + ctx.opts.replay_keys.max(1) - 1);
    // The ceiling for first writes is the design the issue names: one claim
    // and one result statement per request, each committed on its own. The
    // gateway's own (batched) statements, run one request at a time, are
    // shown beside it for reference.
    let single_row = pgbench::single_row_first_write(ctx.dir, PGBENCH_NEW_KEYS)?;
    let mut workloads = vec![
        ("first write", None, single_row),
        ("pk lookup", Some(&captured.lookup), pgbench::workload(ctx.dir, "pk_lookup", &captured.lookup, &replay_keys)?),
        (
            "gateway first write",
            Some(&captured.first_write),
            pgbench::workload(ctx.dir, "first_write", &captured.first_write, PGBENCH_NEW_KEYS)?,
        ),
    ];
    if captured.replay_differs_from_lookup() {
        workloads.push((
            "gateway replay",
            Some(&captured.replay),
            pgbench::workload(ctx.dir, "replay_path", &captured.replay, &replay_keys)?,
        ));
    }
    let watch = Watch { db: pg.cpu(), pg: Some(pg), pg_db: "bench", analyze: ctx.opts.steady, ..Watch::default() };
    for (name, stmts, workload) in &workloads {
        let note = match stmts {
            Some(stmts) => format!("{} autocommit: {}, one request per statement", stmts.len(), pgbench::summarize_all(stmts)),
            None => "2 autocommit: INSERT ON CONFLICT DO NOTHING + fenced UPDATE, one row each".to_owned(),
        };
        for conns in ctx.opts.conns.clone() {
            measure(ctx, ("pgbench", name, conns), &watch, &note, |ctx, secs| {
                pgbench::run(pg, "bench", ctx.dir, workload, conns, Length::Secs(secs))
            })?;
        }
        procs::check_interrupted()?;
    }
    Ok(())
}
