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
use crate::report::{LoadResult, Report, Row, micros};
use crate::suite::{Ctx, REPLAY_BASE, Watch, key_prefix, measure, request_env};
use crate::wrk::Scenario;
use crate::{Options, procs};

const PG: &str = "feat-pg";
const SQLITE: &str = "feat-sqlite";
const FIRST: &str = "first write";
const REPLAY: &str = "replay";
const ACCEPT: &str = "async accept";
const COMPLETE: &str = "async complete";
const EVENTS: &str = "first write+events";
const JWT: &str = "replay jwt";
const AUTHZ: &str = "replay authz";

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

fn postgres(ctx: &mut Ctx, upstream: SocketAddr) -> Result<()> {
    ctx.progress("features on PostgreSQL: start, populate");
    let pg = Pg::start()?;
    let url = pg.create_database("bench")?;
    let mut base = Spec::new(PG, Store::Postgres { url }, upstream);
    // No async workers but where measured: none may run the async backlog
    // during another measurement.
    base.extra = "[workers]\ncount = 0\n".into();
    base.migrate(ctx.dir)?;
    let gw = Gateway::start(&base, ctx.dir)?;
    // The completed keys every replay scenario below reads: the JWT's claims
    // name the same tenant and principal as the API key.
    let keys: Vec<String> = (0..ctx.opts.replay_keys).map(|i| (REPLAY_BASE + i).to_string()).collect();
    gw.populate(&keys, 16)?;
    ctx.progress(PG);
    let watch = Watch { gateway: Some(&gw), server: Some(gw.cpu()), db: pg.cpu(), pg: Some(&pg), pg_db: "bench", analyze: true };
    first_writes(ctx, PG, FIRST, &gw, &watch, "")?;
    if wants(ctx.opts, "identity") {
        replays(ctx, PG, REPLAY, &gw, &watch, gateway::API_KEY, "API key")?;
    }
    gw.stop()?;
    if wants(ctx.opts, "async") {
        async_mode(ctx, PG, &base, Some(&pg))?;
    }
    if wants(ctx.opts, "events") {
        events(ctx, &base, &pg, upstream)?;
    }
    if wants(ctx.opts, "identity") {
        jwt(ctx, &base, &pg)?;
        authorizer(ctx, &base, &pg, upstream)?;
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

/// wrk first writes (a new key per request) at each connection count.
fn first_writes(ctx: &mut Ctx, target: &str, scenario: &str, gw: &Gateway, watch: &Watch, note: &str) -> Result<()> {
    let url = format!("http://{}{}", gw.addr, gateway::ROUTE_PATH);
    for conns in ctx.opts.conns.clone() {
        measure(ctx, (target, scenario, conns), watch, note, |ctx, secs| {
            let mut env = request_env(ctx.opts);
            env.push(("BENCH_KEY_PREFIX", key_prefix()));
            ctx.wrk(Scenario::FirstWrite, &url, conns, secs, &env)
        })?;
    }
    Ok(())
}

/// wrk replays of the populated keys, presenting `credential` as the bearer.
fn replays(ctx: &mut Ctx, target: &str, scenario: &str, gw: &Gateway, watch: &Watch, credential: &str, note: &str) -> Result<()> {
    check_replay(gw.addr, credential).with_context(|| format!("{target} {scenario}: a replay before the runs"))?;
    let url = format!("http://{}{}", gw.addr, gateway::ROUTE_PATH);
    for conns in ctx.opts.conns.clone() {
        measure(ctx, (target, scenario, conns), watch, note, |ctx, secs| {
            let mut env = request_env(ctx.opts);
            env.retain(|(k, _)| *k != "BENCH_API_KEY");
            env.push(("BENCH_API_KEY", credential.to_owned()));
            env.push(("BENCH_KEY_FORMAT", "%d".into()));
            env.push(("BENCH_KEY_FIRST", REPLAY_BASE.to_string()));
            env.push(("BENCH_KEY_COUNT", ctx.opts.replay_keys.to_string()));
            ctx.wrk(Scenario::Replay, &url, conns, secs, &env)
        })?;
    }
    Ok(())
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

/// Async workers of the replica that drains the backlog
/// (`IDEMGATE_BENCH_ASYNC_WORKERS`, default 16).
fn async_workers() -> Result<u32> {
    crate::env_num("IDEMGATE_BENCH_ASYNC_WORKERS", 16)
}

/// 202s on a front replica, then the backlog they left drained by a replica
/// with workers.
fn async_mode(ctx: &mut Ctx, target: &str, base: &Spec, pg: Option<&Pg>) -> Result<()> {
    let mut front = base.clone();
    front.name = format!("{}-async-front", base.name);
    front.route_extra = "mode = \"async\"\n".into();
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
    let watch = Watch { gateway: Some(&gw), server: Some(gw.cpu()), db: pg.and_then(Pg::cpu), pg, pg_db: "bench", analyze: true };
    first_writes(ctx, target, ACCEPT, &gw, &watch, note)?;
    gw.stop()?;

    let backlog = front.count_state(ctx.dir, "queued")?;
    let workers = async_workers()?;
    let mut runner = front.clone();
    runner.name = format!("{}-async-workers", base.name);
    runner.extra = format!("[workers]\ncount = {workers}\n");
    let window = Duration::from_secs(u64::from(ctx.opts.secs * 4).max(20));
    ctx.progress(&format!("{target}: {workers} async workers on {backlog} queued operations (at most {} s)", window.as_secs()));
    if let Some(pg) = pg {
        pg.settle("bench")?;
    }
    let db = pg.and_then(Pg::cpu);
    let db_before = db.map(|c| c.seconds());
    let started = Instant::now();
    let gw = Gateway::start(&runner, ctx.dir)?;
    let attempts = |gw: &Gateway, outcome: &str| -> Result<u64> {
        Ok(gw.metrics()?.sum("idemgate_async_attempts_total", &[("outcome", outcome)]) as u64)
    };
    let mut completed = attempts(&gw, "completed")?;
    while completed < backlog as u64 && started.elapsed() < window {
        procs::sleep(Duration::from_millis(100))?;
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
            "completions/s: {completed} of {backlog} queued in {secs:.1} s ({drained}; from the replica's start); \
             conns = [workers] count; errors = attempts not completed"
        ),
    });
    gw.stop()
}

/// First writes with `[routes.events]` to the bench upstream; whether the
/// relay kept up.
fn events(ctx: &mut Ctx, base: &Spec, pg: &Pg, upstream: SocketAddr) -> Result<()> {
    let mut spec = base.clone();
    spec.name = format!("{}-events", base.name);
    spec.route_extra = format!("[routes.events]\nurl = \"http://{upstream}/hooks\"\n");
    let started = Instant::now();
    let gw = Gateway::start(&spec, ctx.dir)?;
    ctx.progress(&format!("{PG}: first writes with completion events"));
    let watch = Watch { gateway: Some(&gw), server: Some(gw.cpu()), db: pg.cpu(), pg: Some(pg), pg_db: "bench", analyze: true };
    first_writes(ctx, PG, EVENTS, &gw, &watch, "[routes.events] to the bench upstream (201)")?;
    let load_secs = started.elapsed().as_secs_f64();
    let delivered =
        |gw: &Gateway| -> Result<u64> { Ok(gw.metrics()?.sum("idemgate_event_deliveries_total", &[("outcome", "delivered")]) as u64) };
    let delivered_in_load = delivered(&gw)?;
    let (total, pending_at_end) = event_counts(pg)?;
    procs::sleep(Duration::from_secs(5))?;
    let (_, pending_later) = event_counts(pg)?;
    // The relay's own statements over the gateway's life (a fresh process).
    let metrics = gw.metrics()?;
    let latency = |op: &str| {
        let q = |q: f64| metrics.store_quantile_since(&Default::default(), op, q).map_or_else(|| "-".to_owned(), |s| micros(s * 1e6));
        format!("{op} p50 {} p99 {}", q(0.5), q(0.99))
    };
    gw.stop()?;
    ctx.report.line(format!(
        "{PG} events: {total} written; the relay delivered {delivered_in_load} while the runs went on ({:.0}/s); \
         pending at the end: {pending_at_end}, 5 s later: {pending_later} (relay kept up: {}); {}, {}",
        delivered_in_load as f64 / load_secs.max(1e-9),
        if pending_at_end == 0 { "yes" } else { "no" },
        latency("take_events"),
        latency("events_delivered"),
    ));
    Ok(())
}

/// (all events, pending events) in the bench database.
fn event_counts(pg: &Pg) -> Result<(u64, u64)> {
    let out = pg.psql("bench", "SELECT count(*) || ' ' || count(*) FILTER (WHERE delivery = 'pending') FROM idemgate_events")?;
    let mut it = out.split_whitespace().map(str::parse::<u64>);
    match (it.next(), it.next()) {
        (Some(Ok(total)), Some(Ok(pending))) => Ok((total, pending)),
        _ => bail!("unexpected event counts {out:?}"),
    }
}

/// Replays with an RS256 JWT whose claims name the bench tenant and principal.
fn jwt(ctx: &mut Ctx, base: &Spec, pg: &Pg) -> Result<()> {
    ctx.progress(&format!("{PG}: RSA key for the JWT replays"));
    let (token, jwks) = rs256_token()?;
    let jwks_path = ctx.dir.join("jwks.json");
    std::fs::write(&jwks_path, jwks.to_string()).with_context(|| format!("writing {}", jwks_path.display()))?;
    let mut spec = base.clone();
    spec.name = format!("{}-jwt", base.name);
    spec.identity =
        Some(format!("[[identity.sources]]\nkind = \"jwt\"\njwks_file = \"{}\"\nalgorithms = [\"RS256\"]\n", jwks_path.display()));
    let gw = Gateway::start(&spec, ctx.dir)?;
    ctx.progress(&format!("{PG}: replays with a JWT"));
    let watch = Watch { gateway: Some(&gw), server: Some(gw.cpu()), db: pg.cpu(), pg: Some(pg), pg_db: "bench", analyze: true };
    replays(ctx, PG, JWT, &gw, &watch, &token, "RS256 2048-bit, jwks_file")?;
    gw.stop()
}

/// Replays on the route with `[routes.authorize]` (asked on every request).
fn authorizer(ctx: &mut Ctx, base: &Spec, pg: &Pg, upstream: SocketAddr) -> Result<()> {
    let mut spec = base.clone();
    spec.name = format!("{}-authz", base.name);
    spec.route_extra = format!("[routes.authorize]\nurl = \"http://{upstream}/authz\"\n");
    let gw = Gateway::start(&spec, ctx.dir)?;
    ctx.progress(&format!("{PG}: replays with an authorizer"));
    let watch = Watch { gateway: Some(&gw), server: Some(gw.cpu()), db: pg.cpu(), pg: Some(pg), pg_db: "bench", analyze: true };
    replays(ctx, PG, AUTHZ, &gw, &watch, gateway::API_KEY, "API key + authorizer (bench upstream, cache 0s)")?;
    gw.stop()
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
    /// The features' part of the closing line.
    pub fn feature_ratios(&self) -> String {
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
            _ => "n/a".to_owned(),
        };
        let rate = |target: &str| self.best_rps(target, COMPLETE).map_or_else(|| "n/a".to_owned(), |r| format!("{r:.0}"));
        format!(
            "async_accept_vs_sync_first={} async_accept_vs_sync_first_sqlite={} async_completions_per_s={} \
             async_completions_per_s_sqlite={} first_events_vs_plain={} replay_jwt_vs_apikey={} replay_authz_vs_apikey={}",
            ratio(self.best_rps(PG, ACCEPT), self.best_rps(PG, FIRST)),
            ratio(self.best_rps(SQLITE, ACCEPT), self.best_rps(SQLITE, FIRST)),
            rate(PG),
            rate(SQLITE),
            ratio(self.best_rps(PG, EVENTS), self.best_rps(PG, FIRST)),
            ratio(self.best_rps(PG, JWT), self.best_rps(PG, REPLAY)),
            ratio(self.best_rps(PG, AUTHZ), self.best_rps(PG, REPLAY)),
        )
    }
}
