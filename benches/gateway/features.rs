//! What the optional features cost, each beside the plain figure of the same
//! run (group `features`, or its parts `async`, `events`, `identity`):
//!
//! - async mode (issue 10), on PostgreSQL and on SQLite: 202 acceptance
//!   throughput (wrk first writes on a `mode = "async"` route, on a front
//!   replica with `[workers] count = 0`), then completion throughput: a
//!   replica with workers started on the backlog those runs left, timed until
//!   it is drained (or for a bounded window);
//! - completion events (issue 15), on PostgreSQL: first writes on the route
//!   with `[routes.events]` posting to the bench upstream (which answers 201),
//!   and whether the relay kept up;
//! - identity (issue 14), on PostgreSQL: replays with an RS256 JWT (a key
//!   generated here, a JWKS file) and with `[routes.authorize]` asking the
//!   bench upstream (201: allow) on every request, against API-key replays.

use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rsa::pkcs1::{EncodeRsaPrivateKey, LineEnding};
use rsa::traits::PublicKeyParts;

use crate::client::Conn;
use crate::gateway::{self, Gateway, Spec, Store};
use crate::pg::Pg;
use crate::report::{self, LoadResult, Report, Row, micros};
use crate::suite::{Ctx, REPLAY_BASE, Watch, key_prefix, measure, measure_once, request_env};
use crate::wrk::Scenario;
use crate::{Options, procs};

const PG: &str = "feat-pg";
/// The async comparison's rows (a database of its own).
const PG_ASYNC: &str = "feat-pg-async";
/// The same on a route whose upstream deduplicates (no never-sent proof).
const PG_ASYNC_IDEMPOTENT: &str = "feat-pg-async-idempotent";
const SQLITE: &str = "feat-sqlite";
const FIRST: &str = "first write";
const REPLAY: &str = "replay";
const ACCEPT: &str = "async accept";
const COMPLETE: &str = "async complete";
const EVENTS: &str = "first write+events";
const JWT: &str = "replay jwt";
const AUTHZ: &str = "replay authz";
const AUTHZ_UNCACHED: &str = "replay authz nocache";

/// Whether any part runs.
pub fn wanted(opts: &Options) -> bool {
    ["features", "async", "events", "identity"].iter().any(|g| opts.wants(g))
}

fn wants(opts: &Options, part: &str) -> bool {
    opts.wants("features") || opts.wants(part)
}

pub fn run(ctx: &mut Ctx, upstream: SocketAddr) -> Result<()> {
    postgres(ctx, upstream)?;
    if wants(ctx.opts, "async") {
        sqlite(ctx, upstream)?;
    }
    Ok(())
}

/// Each part on a fresh database of its own, its contenders in interleaved
/// rounds.
fn postgres(ctx: &mut Ctx, upstream: SocketAddr) -> Result<()> {
    ctx.progress("features on PostgreSQL: start");
    let pg = Pg::start()?;
    let spec = |db: &str| -> Result<Spec> {
        let url = pg.create_database(db)?;
        let mut base = Spec::new(&format!("{PG}-{db}"), Store::Postgres { url }, upstream);
        // No async workers but where measured: none may run the async backlog
        // during another measurement.
        base.extra = "[workers]\ncount = 0\n".into();
        base.migrate(ctx.dir)?;
        Ok(base)
    };
    if wants(ctx.opts, "identity") {
        identity(ctx, &spec("bench_identity")?, &pg, upstream)?;
    }
    if wants(ctx.opts, "events") {
        events(ctx, &spec("bench_events")?, &pg, upstream)?;
    }
    if wants(ctx.opts, "async") {
        async_rounds(ctx, &spec("bench_async")?, &pg, false)?;
        async_rounds(ctx, &spec("bench_async_idempotent")?, &pg, true)?;
    }
    Ok(())
}

fn sqlite(ctx: &mut Ctx, upstream: SocketAddr) -> Result<()> {
    let dir = ctx.dir.join("feat-sqlite");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut base = Spec::new(SQLITE, Store::Sqlite { path: dir.join("idemgate.db") }, upstream);
    base.extra = "[workers]\ncount = 0\n".into();
    base.migrate(ctx.dir)?;
    let gw = Gateway::start(&base, ctx.dir)?;
    ctx.progress(SQLITE);
    let watch = Watch { gateway: Some(&gw), server: Some(gw.cpu()), ..Watch::default() };
    first_writes(ctx, SQLITE, FIRST, &gw, &watch, "")?;
    gw.stop()?;
    async_mode(ctx, SQLITE, &base, None)
}

/// wrk at (connections, seconds).
type RunFn<'a> = Box<dyn Fn(&Ctx, u32, u32) -> Result<LoadResult> + 'a>;

/// One contender of an interleaved comparison.
struct Contender<'a> {
    scenario: &'static str,
    gw: &'a Gateway,
    note: String,
    run: RunFn<'a>,
    /// Before each measured run (warm-up included).
    before: Option<Box<dyn Fn() -> Result<()> + 'a>>,
    /// After it (given the connection count): a note for the run's row.
    after: Option<Box<dyn Fn(u32) -> Result<String> + 'a>>,
}

/// At each connection count, `rounds` rounds of one run per contender, the
/// order rotating between rounds (each takes each place in turn); each
/// contender's row is the median of its runs, with their range. The
/// database `db` is settled (VACUUM ANALYZE, CHECKPOINT) before each run.
fn interleave(ctx: &mut Ctx, pg: &Pg, db: &str, contenders: &[Contender]) -> Result<()> {
    let rounds = ctx.opts.rounds.max(1) as usize;
    for conns in ctx.opts.conns.clone() {
        let mut rows: Vec<Vec<Row>> = contenders.iter().map(|_| Vec::new()).collect();
        for round in 0..rounds {
            for k in 0..contenders.len() {
                let i = (k + round) % contenders.len();
                let c = &contenders[i];
                if let Some(before) = &c.before {
                    before()?;
                }
                let watch = Watch {
                    gateway: Some(c.gw),
                    server: Some(c.gw.cpu()),
                    db: pg.cpu(),
                    pg: Some(pg),
                    pg_db: db,
                    analyze: true,
                    nodes: &[],
                };
                let note = format!("round {}{}{}", round + 1, if c.note.is_empty() { "" } else { "; " }, c.note);
                let (_, mut row) = measure_once(ctx, (PG, c.scenario, conns), &watch, &note, |ctx, secs| (c.run)(ctx, conns, secs))?;
                if let Some(after) = &c.after {
                    row.note = format!("{} {}", row.note, after(conns)?);
                }
                ctx.report.progress(&row);
                rows[i].push(row);
                procs::check_interrupted()?;
            }
        }
        for (c, runs) in contenders.iter().zip(rows) {
            if let Some(mut row) = report::median_row(&runs) {
                row.note = format!("{}; {}", row.note, c.note);
                ctx.report.add(row);
            }
        }
    }
    Ok(())
}

/// wrk first writes (a new key per request) at each connection count.
fn first_writes(ctx: &mut Ctx, target: &str, scenario: &str, gw: &Gateway, watch: &Watch, note: &str) -> Result<()> {
    for conns in ctx.opts.conns.clone() {
        measure(ctx, (target, scenario, conns), watch, note, |ctx, secs| first_write_run(ctx, gw, conns, secs))?;
    }
    Ok(())
}

fn first_write_run(ctx: &Ctx, gw: &Gateway, conns: u32, secs: u32) -> Result<LoadResult> {
    let url = format!("http://{}{}", gw.addr, gateway::ROUTE_PATH);
    let mut env = request_env(ctx.opts);
    env.push(("BENCH_KEY_PREFIX", key_prefix()));
    ctx.wrk(Scenario::FirstWrite, &url, conns, secs, &env)
}

/// wrk replays of the populated keys, presenting `credential` as the bearer.
fn replay_run(ctx: &Ctx, gw: &Gateway, credential: &str, conns: u32, secs: u32) -> Result<LoadResult> {
    let url = format!("http://{}{}", gw.addr, gateway::ROUTE_PATH);
    let mut env = request_env(ctx.opts);
    env.retain(|(k, _)| *k != "BENCH_API_KEY");
    env.push(("BENCH_API_KEY", credential.to_owned()));
    env.push(("BENCH_KEY_FORMAT", "%d".into()));
    env.push(("BENCH_KEY_FIRST", REPLAY_BASE.to_string()));
    env.push(("BENCH_KEY_COUNT", ctx.opts.replay_keys.to_string()));
    ctx.wrk(Scenario::Replay, &url, conns, secs, &env)
}

/// One request as wrk will send it must be a replay (not a 401 or a 403).
fn check_replay(addr: SocketAddr, credential: &str) -> Result<()> {
    let auth = format!("Bearer {credential}");
    let key = REPLAY_BASE.to_string();
    let headers = [("Authorization", auth.as_str()), ("Content-Type", "application/json"), ("Idempotency-Key", key.as_str())];
    let resp = Conn::open(addr)?.request("POST", gateway::ROUTE_PATH, &headers, gateway::POST_BODY.as_bytes())?;
    if resp.status != 201 || resp.header("idempotent-replayed") != Some("true") {
        bail!("answered {} (replayed: {:?}): {}", resp.status, resp.header("idempotent-replayed"), resp.text());
    }
    Ok(())
}

/// Replays of the same completed keys, interleaved: with the API key, with
/// an RS256 JWT (a key made here, a JWKS file), and with the API key on a
/// route with `[routes.authorize]` asking the bench upstream (201: allow),
/// its decisions cached 1 s and not cached (asked on every request).
fn identity(ctx: &mut Ctx, base: &Spec, pg: &Pg, upstream: SocketAddr) -> Result<()> {
    ctx.progress(&format!("{PG}: identity: RSA key, gateways, populate"));
    let (token, jwks) = rs256_token()?;
    let jwks_path = ctx.dir.join("jwks.json");
    std::fs::write(&jwks_path, jwks.to_string()).with_context(|| format!("writing {}", jwks_path.display()))?;
    let named = |suffix: &str| {
        let mut spec = base.clone();
        spec.name = format!("{}-{suffix}", base.name);
        spec
    };
    let apikey = Gateway::start(base, ctx.dir)?;
    // The completed keys every replay below reads: the JWT's claims name the
    // same tenant and principal as the API key.
    let keys: Vec<String> = (0..ctx.opts.replay_keys).map(|i| (REPLAY_BASE + i).to_string()).collect();
    apikey.populate(&keys, 16)?;
    let mut spec = named("jwt");
    spec.identity =
        Some(format!("[[identity.sources]]\nkind = \"jwt\"\njwks_file = \"{}\"\nalgorithms = [\"RS256\"]\n", jwks_path.display()));
    let jwt = Gateway::start(&spec, ctx.dir)?;
    let authz = |cache: &str| -> Result<Gateway> {
        let mut spec = named(&format!("authz-{cache}"));
        spec.route_extra = format!("[routes.authorize]\nurl = \"http://{upstream}/authz\"\ncache = \"{cache}\"\n");
        Gateway::start(&spec, ctx.dir)
    };
    let (cached, uncached) = (authz("1s")?, authz("0s")?);
    let credential = gateway::API_KEY.to_owned();
    for (gw, cred) in [(&apikey, &credential), (&jwt, &token), (&cached, &credential), (&uncached, &credential)] {
        check_replay(gw.addr, cred).context("a replay before the runs")?;
    }
    let contender = |scenario: &'static str, gw, cred: &str, note: &str| {
        let cred = cred.to_owned();
        Contender {
            scenario,
            gw,
            note: note.to_owned(),
            run: Box::new(move |ctx: &Ctx, conns, secs| replay_run(ctx, gw, &cred, conns, secs)),
            before: None,
            after: None,
        }
    };
    ctx.progress(&format!("{PG}: replays: API key, JWT, authorizer cached 1 s and not cached; {} interleaved rounds", ctx.opts.rounds));
    let contenders = [
        contender(REPLAY, &apikey, &credential, "API key"),
        contender(JWT, &jwt, &token, "RS256 2048-bit, jwks_file"),
        contender(AUTHZ, &cached, &credential, "API key + authorizer (bench upstream), cache 1s"),
        contender(AUTHZ_UNCACHED, &uncached, &credential, "API key + authorizer (bench upstream), cache 0s"),
    ];
    interleave(ctx, pg, "bench_identity", &contenders)?;
    drop(contenders);
    for gw in [apikey, jwt, cached, uncached] {
        gw.stop()?;
    }
    Ok(())
}

/// First writes without and with `[routes.events]` (posting to the bench
/// upstream), interleaved on one database; before each run the relay has
/// delivered every pending event, and after each run with events the share
/// of the events written during it (warm-up included) that the relay had
/// delivered by its end.
fn events(ctx: &mut Ctx, base: &Spec, pg: &Pg, upstream: SocketAddr) -> Result<()> {
    const DB: &str = "bench_events";
    let plain = Gateway::start(base, ctx.dir)?;
    let mut spec = base.clone();
    spec.name = format!("{}-events", base.name);
    let batch: u32 = crate::env_num("IDEMGATE_BENCH_EVENTS_BATCH", 100)?;
    spec.route_extra = format!("[routes.events]\nurl = \"http://{upstream}/hooks\"\nbatch = {batch}\n");
    let with_events = Gateway::start(&spec, ctx.dir)?;
    // The last event before a run: the run's events are those after it.
    let started = std::cell::Cell::new(0u64);
    let shares: std::cell::RefCell<Vec<(u32, f64)>> = std::cell::RefCell::default();
    // At most 30 s: a relay that does not keep up leaves a backlog that the
    // next runs meet (the share below counts only each run's own events).
    let drained = || -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while event_counts(pg, DB, 0)?.1 > 0 && Instant::now() < deadline {
            procs::sleep(Duration::from_millis(200))?;
        }
        Ok(())
    };
    let contenders = [
        Contender {
            scenario: FIRST,
            gw: &plain,
            note: String::new(),
            run: Box::new(|ctx: &Ctx, conns, secs| first_write_run(ctx, &plain, conns, secs)),
            before: Some(Box::new(drained)),
            after: None,
        },
        Contender {
            scenario: EVENTS,
            gw: &with_events,
            note: format!("[routes.events] to the bench upstream (201), batch = {batch}"),
            run: Box::new(|ctx: &Ctx, conns, secs| first_write_run(ctx, &with_events, conns, secs)),
            before: Some(Box::new(|| {
                drained()?;
                started.set(last_event(pg, DB)?);
                Ok(())
            })),
            after: Some(Box::new(|conns| {
                let (written, pending) = event_counts(pg, DB, started.get())?;
                let share = if written == 0 { 1.0 } else { 1.0 - pending as f64 / written as f64 };
                shares.borrow_mut().push((conns, share));
                let dead = event_dead_tuples(pg, DB)?;
                Ok(format!(
                    "events written {written}, {pending} of them pending at the end ({:.0}% delivered); dead tuples: {dead}",
                    share * 100.0
                ))
            })),
        },
    ];
    ctx.progress(&format!("{PG}: first writes without and with completion events; {} interleaved rounds", ctx.opts.rounds));
    let statements = pg.statements_reset(DB)?;
    interleave(ctx, pg, DB, &contenders)?;
    drop(contenders);
    if statements {
        // Both contenders' statements, every round: the relay's and the
        // event inserts' share among the first writes'.
        for line in pg.statements_top(DB, 10)? {
            ctx.report.line(format!("{PG} events statements: {line}"));
        }
    }
    let most = ctx.opts.conns.iter().copied().max().unwrap_or(0);
    let at_most: Vec<f64> = shares.borrow().iter().filter(|(c, _)| *c == most).map(|(_, s)| *s).collect();
    if !at_most.is_empty() {
        let median = report::median(at_most.clone());
        ctx.report.figures.push(("events_delivered_during_load".into(), format!("{median:.2}")));
        ctx.report.line(format!(
            "{PG} events: share of the events written during a run at {most} connections delivered by its end: median {median:.2} of {:?}",
            at_most.iter().map(|s| format!("{s:.2}")).collect::<Vec<_>>()
        ));
    }
    let metrics = with_events.metrics()?;
    let latency = |op: &str| {
        let q = |q: f64| metrics.store_quantile_since(&Default::default(), op, q).map_or_else(|| "-".to_owned(), |s| micros(s * 1e6));
        format!("{op} p50 {} p99 {}", q(0.5), q(0.99))
    };
    ctx.report.line(format!("{PG} events relay statements: {}, {}", latency("take_events"), latency("events_delivered")));
    plain.stop()?;
    with_events.stop()
}

/// The `seq` of the last event written so far (0: none): the outbox's
/// sequence, which the PostgreSQL event log shares.
fn last_event(pg: &Pg, db: &str) -> Result<u64> {
    let out = pg.psql(db, "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM idemgate_events_seq_seq")?;
    out.trim().parse().with_context(|| format!("unexpected last event {out:?}"))
}

/// (events, pending events) after event `after` (a `seq`) in database `db`:
/// on PostgreSQL every event is in the log, pending until its lane passed it
/// (and not copied into `idemgate_events`, whose pending rows count then);
/// without the log (an earlier build), the outbox table's rows.
fn event_counts(pg: &Pg, db: &str, after: u64) -> Result<(u64, u64)> {
    let log = pg.psql(db, "SELECT to_regclass('idemgate_event_log') IS NOT NULL")? == "t";
    let sql = if log {
        format!(
            "SELECT count(*) || ' ' || (count(*) FILTER (WHERE pending) \
                 + (SELECT count(*) FROM idemgate_events WHERE seq > {after} AND delivery = 'pending')) \
             FROM (SELECT NOT (pg_visible_in_snapshot(e.xid, l.done) OR (l.upto IS NOT NULL \
                     AND pg_visible_in_snapshot(e.xid, l.upto) AND e.seq <= coalesce(l.after_seq, 0))) \
                     AND NOT EXISTS (SELECT 1 FROM idemgate_events r WHERE r.seq = e.seq) AS pending \
                   FROM idemgate_event_log e JOIN idemgate_event_lanes l ON l.lane = e.lane WHERE e.seq > {after}) x"
        )
    } else {
        format!("SELECT count(*) || ' ' || count(*) FILTER (WHERE delivery = 'pending') FROM idemgate_events WHERE seq > {after}")
    };
    let out = pg.psql(db, &sql)?;
    let mut it = out.split_whitespace().map(str::parse::<u64>);
    match (it.next(), it.next()) {
        (Some(Ok(total)), Some(Ok(pending))) => Ok((total, pending)),
        _ => bail!("unexpected event counts {out:?}"),
    }
}

/// Dead tuples of the event tables (`pg_stat_user_tables`, as the
/// statistics collector last reported them), e.g. `idemgate_events 0,
/// idemgate_event_log_0 0, ...`.
fn event_dead_tuples(pg: &Pg, db: &str) -> Result<String> {
    let out = pg.psql(
        db,
        "SELECT coalesce(string_agg(relname || ' ' || n_dead_tup, ', ' ORDER BY relname), '-') FROM pg_stat_user_tables \
         WHERE relname = 'idemgate_events' OR relname LIKE 'idemgate\\_event\\_%'",
    )?;
    Ok(out.trim().to_owned())
}

/// Async mode on PostgreSQL in rounds: first writes on a plain route and
/// 202s on an async route's front replica (`[workers] count = 0`), then the
/// backlog those runs left drained by a replica with workers; each round's
/// completions per second over its best acceptances per second, and over
/// its best synchronous first writes per second. `idempotent`: the async
/// route's upstream deduplicates (`upstream_idempotent = true`: its
/// attempts are sent without a never-sent proof), figures suffixed
/// `_idempotent`.
fn async_rounds(ctx: &mut Ctx, base: &Spec, pg: &Pg, idempotent: bool) -> Result<()> {
    let (target, db, suffix) =
        if idempotent { (PG_ASYNC_IDEMPOTENT, "bench_async_idempotent", "_idempotent") } else { (PG_ASYNC, "bench_async", "") };
    let plain = Gateway::start(base, ctx.dir)?;
    let mut front_spec = base.clone();
    front_spec.name = format!("{}-async-front", base.name);
    // The queue is not capped (`max_queued` 10,000 by default): the
    // acceptance runs measure acceptances, not refusals, and the drains
    // last long enough for the workers' start to matter little.
    front_spec.route_extra = format!("mode = \"async\"\nupstream_idempotent = {idempotent}\nmax_queued = 10000000\n");
    let front = Gateway::start(&front_spec, ctx.dir)?;
    let (mut ratios, mut vs_sync) = (Vec::new(), Vec::new());
    let contenders = [(FIRST, &plain, ""), (ACCEPT, &front, "202s; front replica, [workers] count = 0")];
    let mut rows: Vec<Vec<Row>> = vec![Vec::new(); contenders.len() * ctx.opts.conns.len()];
    for round in 0..ctx.opts.rounds.max(1) as usize {
        ctx.progress(&format!("{target}: async round {}", round + 1));
        let (mut best_accept, mut best_first) = (0.0f64, 0.0f64);
        for (c, conns) in ctx.opts.conns.clone().into_iter().enumerate() {
            for k in 0..contenders.len() {
                let i = (k + round) % contenders.len();
                let (scenario, gw, note) = contenders[i];
                let watch =
                    Watch { gateway: Some(gw), server: Some(gw.cpu()), db: pg.cpu(), pg: Some(pg), pg_db: db, analyze: true, nodes: &[] };
                let note = format!("round {}{}{note}", round + 1, if note.is_empty() { "" } else { "; " });
                let (m, row) =
                    measure_once(ctx, (target, scenario, conns), &watch, &note, |ctx, secs| first_write_run(ctx, gw, conns, secs))?;
                ctx.report.progress(&row);
                rows[c * contenders.len() + i].push(row);
                if scenario == ACCEPT {
                    best_accept = best_accept.max(m.result.rps);
                } else {
                    best_first = best_first.max(m.result.rps);
                }
            }
        }
        let completions = drain(ctx, target, &front_spec, Some((pg, db)))?;
        if best_accept > 0.0 {
            ratios.push(completions / best_accept);
        }
        if best_first > 0.0 {
            vs_sync.push(completions / best_first);
        }
    }
    plain.stop()?;
    front.stop()?;
    for runs in rows {
        if let Some(row) = report::median_row(&runs) {
            ctx.report.add(row);
        }
    }
    for (name, what, values) in
        [("async_completions_vs_accepts", "acceptances", ratios), ("async_completions_vs_sync_first", "synchronous first writes", vs_sync)]
    {
        if values.is_empty() {
            continue;
        }
        let median = report::median(values.clone());
        ctx.report.figures.push((format!("{name}{suffix}"), format!("{median:.2}")));
        ctx.report.line(format!(
            "{target}: completions/s over the round's best {what}/s: median {median:.2} of {:?}",
            values.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>()
        ));
    }
    Ok(())
}

/// Async workers of the replica that drains the backlog
/// (`IDEMGATE_BENCH_ASYNC_WORKERS`; by default as many as the most
/// connections the synchronous side is measured with, so that the two run
/// at the same concurrency: each worker waits for its attempt's commits and
/// exchange in turn, as each connection waits for its request).
fn async_workers(ctx: &Ctx) -> Result<u32> {
    let most = ctx.opts.conns.iter().copied().max().unwrap_or(16);
    crate::env_num("IDEMGATE_BENCH_ASYNC_WORKERS", most)
}

/// 202s on a front replica, then the backlog they left drained by a replica
/// with workers.
fn async_mode(ctx: &mut Ctx, target: &str, base: &Spec, pg: Option<&Pg>) -> Result<()> {
    let mut front = base.clone();
    front.name = format!("{}-async-front", base.name);
    front.route_extra = "mode = \"async\"\nmax_queued = 10000000\n".into();
    // The embedded store is one replica: it refuses an async route without
    // workers (nothing would run it), so its 202s are measured with one
    // worker running them meanwhile.
    let note = if pg.is_some() {
        "202s; front replica, [workers] count = 0"
    } else {
        front.extra = "[workers]\ncount = 1\n".into();
        "202s; one worker runs them meanwhile (embedded store: no front replica)"
    };
    let gw = Gateway::start(&front, ctx.dir)?;
    ctx.progress(&format!("{target}: async acceptance"));
    let watch =
        Watch { gateway: Some(&gw), server: Some(gw.cpu()), db: pg.and_then(Pg::cpu), pg, pg_db: "bench", analyze: true, nodes: &[] };
    first_writes(ctx, target, ACCEPT, &gw, &watch, note)?;
    gw.stop()?;
    drain(ctx, target, &front, pg.map(|pg| (pg, "bench"))).map(drop)
}

/// Starts a replica with workers on the backlog `front`'s runs left and
/// times it until drained (or for a bounded window); adds its row and
/// returns its completions per second.
fn drain(ctx: &mut Ctx, target: &str, front: &Spec, pg: Option<(&Pg, &str)>) -> Result<f64> {
    let backlog = front.count_state(ctx.dir, "queued")?;
    let workers = async_workers(ctx)?;
    let mut runner = front.clone();
    // A name (config and log file) of its own: a second replica appending to
    // the first one's log would be found listening at the first one's address.
    static RUNNERS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    runner.name = format!("{}-workers-{}", front.name, RUNNERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    runner.extra = format!("[workers]\ncount = {workers}\n");
    let window = Duration::from_secs(u64::from(ctx.opts.secs * 4).max(20));
    ctx.progress(&format!("{target}: {workers} async workers on {backlog} queued operations (at most {} s)", window.as_secs()));
    if let Some((pg, db)) = pg {
        pg.settle(db)?;
    }
    let statements = match pg {
        Some((pg, db)) => pg.statements_reset(db)?,
        None => false,
    };
    let db = pg.and_then(|(pg, _)| pg.cpu());
    let db_before = db.map(|c| c.seconds());
    let gw = Gateway::start(&runner, ctx.dir)?;
    let attempts = |gw: &Gateway, outcome: &str| -> Result<u64> {
        Ok(gw.metrics()?.sum("idemgate_async_attempts_total", &[("outcome", outcome)]) as u64)
    };
    // Timed from the replica answering (its workers start as it does): the
    // completions made during its start count as made at once, which a
    // start of tens of milliseconds changes little.
    let started = Instant::now();
    let mut completed = attempts(&gw, "completed")?;
    while completed < backlog as u64 && started.elapsed() < window {
        procs::sleep(Duration::from_millis(50))?;
        completed = attempts(&gw, "completed")?;
    }
    let secs = started.elapsed().as_secs_f64();
    let not_completed = attempts(&gw, "requeued")? + attempts(&gw, "failed")? + attempts(&gw, "unknown")?;
    let per_op = |cpu: f64| (completed > 0).then(|| cpu * 1e6 / completed as f64);
    let drained = if completed >= backlog as u64 { "drained" } else { "window over, not drained" };
    ctx.report.add(Row {
        target: target.into(),
        scenario: COMPLETE.into(),
        conns: workers,
        result: LoadResult {
            requests: completed,
            rps: completed as f64 / secs.max(1e-9),
            p50_us: f64::NAN,
            p99_us: f64::NAN,
            status_errors: not_completed,
            socket_errors: 0,
        },
        peak_rss_kib: gw.peak_rss_kib().ok(),
        server_cpu_us: per_op(gw.cpu().seconds()),
        db_cpu_us: match (db_before, db) {
            (Some(b), Some(c)) => per_op(c.seconds() - b),
            _ => None,
        },
        note: format!(
            "completions/s: {completed} of {backlog} queued in {secs:.1} s ({drained}; from the replica's first answer); \
             conns = [workers] count; errors = attempts not completed"
        ),
    });
    gw.stop()?;
    if let (true, Some((pg, db))) = (statements, pg) {
        for line in pg.statements_top(db, 8)? {
            ctx.report.line(format!("{target} drain statements: {line}"));
        }
    }
    Ok(completed as f64 / secs.max(1e-9))
}

/// A 2048-bit RSA key made here: a token valid for a day and the JWKS of its
/// public half.
fn rs256_token() -> Result<(String, serde_json::Value)> {
    let key = rsa::RsaPrivateKey::new(&mut rsa::rand_core::OsRng, 2048).context("generating an RSA key")?;
    let pem = key.to_pkcs1_pem(LineEnding::LF).context("encoding the RSA key")?;
    let encoding = jsonwebtoken::EncodingKey::from_rsa_pem(pem.as_bytes()).context("loading the RSA key")?;
    let b64 = |bytes: Vec<u8>| URL_SAFE_NO_PAD.encode(bytes);
    let jwks = serde_json::json!({"keys": [{"kty": "RSA", "kid": "bench", "use": "sig", "alg": "RS256",
        "n": b64(key.n().to_bytes_be()), "e": b64(key.e().to_bytes_be())}]});
    let now = SystemTime::now().duration_since(UNIX_EPOCH).context("reading the clock")?.as_secs();
    let claims = serde_json::json!({"tenant": gateway::TENANT, "sub": gateway::PRINCIPAL, "iat": now, "exp": now + 86_400});
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::RS256);
    header.kid = Some("bench".into());
    let token = jsonwebtoken::encode(&header, &claims, &encoding).context("signing the token")?;
    Ok((token, jwks))
}

impl Report {
    /// The features' part of the closing line: ratios of the medians of
    /// interleaved rounds at each connection count, the lowest printed (each
    /// count's in brackets); rates: best over the connection counts.
    pub fn feature_ratios(&self) -> String {
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
            _ => "n/a".to_owned(),
        };
        let rps_ratio = |a: (&str, &str), b: (&str, &str)| self.per_conns(a, b, |a, b| Some(a.result.rps / b.result.rps), true);
        let rate = |target: &str| self.best_rps(target, COMPLETE).map_or_else(|| "n/a".to_owned(), |r| format!("{r:.0}"));
        let figure = |name: &str| {
            let value = self.figures.iter().find(|(n, _)| n == name).map_or("n/a", |(_, v)| v.as_str());
            format!("{name}={value}")
        };
        format!(
            "replay_jwt_vs_apikey={} replay_jwt_cpu_vs_apikey={} replay_authz_vs_apikey={} authz_uncached_cpu_over_apikey_us={} \
             first_events_vs_plain={} {} \
             {} {} {} async_accept_vs_sync_first={} async_completions_per_s={} async_completions_per_s_idempotent={} \
             async_accept_vs_sync_first_sqlite={} async_completions_per_s_sqlite={} [features: medians of interleaved rounds]",
            rps_ratio((PG, JWT), (PG, REPLAY)),
            // The gateway's CPU per request, steadier than req/s on a busy machine.
            self.per_conns((PG, JWT), (PG, REPLAY), |a, b| Some(a.server_cpu_us? / b.server_cpu_us?), false),
            rps_ratio((PG, AUTHZ), (PG, REPLAY)),
            self.per_conns((PG, AUTHZ_UNCACHED), (PG, REPLAY), |a, b| Some(a.server_cpu_us? - b.server_cpu_us?), false),
            rps_ratio((PG, EVENTS), (PG, FIRST)),
            figure("events_delivered_during_load"),
            figure("async_completions_vs_accepts"),
            figure("async_completions_vs_sync_first"),
            figure("async_completions_vs_sync_first_idempotent"),
            rps_ratio((PG_ASYNC, ACCEPT), (PG_ASYNC, FIRST)),
            rate(PG_ASYNC),
            rate(PG_ASYNC_IDEMPOTENT),
            ratio(self.best_rps(SQLITE, ACCEPT), self.best_rps(SQLITE, FIRST)),
            rate(SQLITE),
        )
    }

    /// `f(row of a, row of b)` at each connection count both have, the
    /// lowest (or highest) first and every count's in brackets.
    fn per_conns(&self, a: (&str, &str), b: (&str, &str), f: fn(&Row, &Row) -> Option<f64>, lowest: bool) -> String {
        let mut values: Vec<(u32, f64)> = Vec::new();
        for ra in self.rows.iter().filter(|r| r.target == a.0 && r.scenario == a.1) {
            let rb = self.rows.iter().find(|r| r.target == b.0 && r.scenario == b.1 && r.conns == ra.conns);
            if let Some(v) = rb.and_then(|rb| f(ra, rb)).filter(|v| v.is_finite()) {
                values.push((ra.conns, v));
            }
        }
        let pick = values.iter().map(|(_, v)| *v).reduce(|x, y| if lowest { x.min(y) } else { x.max(y) });
        match pick {
            None => "n/a".into(),
            Some(v) => {
                let each: Vec<String> = values.iter().map(|(c, v)| format!("{c}:{v:.2}")).collect();
                format!("{v:.2}({})", each.join(","))
            }
        }
    }
}
