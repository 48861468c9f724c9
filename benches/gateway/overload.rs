//! Admission under overload (group `overload`), on the embedded store:
//!
//! - **15x**: an upstream that serves 4 requests at a time in 100 ms each
//!   (40 per second) behind a gateway with a 1 s upstream timeout, and wrk's
//!   64 connections sending first writes with fresh keys (about 15 times
//!   what it can serve), for at least 10 s. From the gateway's outcomes and
//!   the upstream's own count: `overload_goodput_vs_capacity` (first writes
//!   recorded completed over what the upstream could serve in the run) and
//!   `overload_unknown_vs_executed` (outcomes lost to timeouts over what the
//!   upstream executed). A refusal is 503 `overloaded`, before any claim.
//! - **1x**: the same upstream shape, 20 ms each, 4 connections (what it
//!   serves at a time), with the default adaptive limit and with none
//!   (`adaptive = false`), in interleaved rounds: `overload_1x_refused`
//!   (requests refused at capacity: 0 expected) and
//!   `overload_1x_p50_vs_unlimited` (median latency, limited over not).

use std::time::Duration;

use anyhow::{Context, Result};

use crate::gateway::{Gateway, Metrics, Spec, Store};
use crate::report::{self, Row};
use crate::suite::{Ctx, key_prefix, request_env};
use crate::upstream::Upstream;
use crate::wrk::Scenario;
use crate::{Options, gateway};

/// The overloaded upstream: requests served at a time, and each one's time.
const CAPACITY: usize = 4;
const SERVICE: Duration = Duration::from_millis(100);
const CLIENTS: u32 = 64;
/// The 1x comparison's upstream: faster, so that rounds hold many requests.
const SERVICE_1X: Duration = Duration::from_millis(20);

pub fn wanted(opts: &Options) -> bool {
    opts.wants("overload")
}

pub fn run(ctx: &mut Ctx) -> Result<()> {
    fifteen_times(ctx)?;
    at_capacity(ctx)
}

fn sqlite_spec(ctx: &Ctx, name: &str, upstream: &Upstream) -> Result<Spec> {
    let dir = ctx.dir.join(name);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut spec = Spec::new(name, Store::Sqlite { path: dir.join("idemgate.db") }, upstream.addr);
    spec.upstream_timeout = "1s";
    // The refusals would fill the log; the outcomes are in the metrics.
    spec.access_log = false;
    spec.migrate(ctx.dir)?;
    Ok(spec)
}

fn outcome(after: &Metrics, before: &Metrics, outcome: &str) -> f64 {
    let f = [("outcome", outcome)];
    after.sum("idemgate_requests_total", &f) - before.sum("idemgate_requests_total", &f)
}

fn fifteen_times(ctx: &mut Ctx) -> Result<()> {
    ctx.progress("overload: 64 clients against an upstream serving 4 at a time (15x)");
    let upstream = Upstream::with_capacity(ctx.dir, "upstream-overloaded", CAPACITY, SERVICE)?;
    let spec = sqlite_spec(ctx, "overload-sqlite", &upstream)?;
    let gw = Gateway::start(&spec, ctx.dir)?;
    let secs = ctx.opts.secs.max(10);
    let url = format!("http://{}{}", gw.addr, gateway::ROUTE_PATH);
    let mut env = request_env(ctx.opts);
    env.push(("BENCH_KEY_PREFIX", key_prefix()));
    let (before, executed_before) = (gw.metrics()?, upstream.executed()?);
    let result = ctx.wrk(Scenario::FirstWrite, &url, CLIENTS, secs, &env)?;
    // Forwards still running finish (and are recorded) within the timeout.
    std::thread::sleep(Duration::from_secs(2));
    let (after, executed) = (gw.metrics()?, upstream.executed()? - executed_before);
    gw.stop()?;
    let (completed, unknown, refused) =
        (outcome(&after, &before, "forwarded"), outcome(&after, &before, "unknown"), outcome(&after, &before, "overloaded"));
    let capacity = CAPACITY as f64 / SERVICE.as_secs_f64() * f64::from(secs);
    let goodput = completed / capacity;
    let unknown_share = if executed > 0 { unknown / executed as f64 } else { 0.0 };
    ctx.report.add(Row {
        target: "overload-sqlite".into(),
        scenario: "first write 15x".into(),
        conns: CLIENTS,
        result: result.clone(),
        peak_rss_kib: None,
        server_cpu_us: None,
        db_cpu_us: None,
        note: format!("executed {executed}, completed {completed:.0}, unknown {unknown:.0}, refused {refused:.0}, capacity {capacity:.0}"),
    });
    ctx.report.figures.push(("overload_goodput_vs_capacity".into(), format!("{goodput:.2}")));
    ctx.report.figures.push(("overload_unknown_vs_executed".into(), format!("{unknown_share:.3}")));
    Ok(())
}

fn at_capacity(ctx: &mut Ctx) -> Result<()> {
    ctx.progress("overload: 4 clients against an upstream serving 4 at a time (1x), limited and not");
    let upstream = Upstream::with_capacity(ctx.dir, "upstream-1x", CAPACITY, SERVICE_1X)?;
    let limited = sqlite_spec(ctx, "overload-1x-limited", &upstream)?;
    let mut unlimited = sqlite_spec(ctx, "overload-1x-unlimited", &upstream)?;
    unlimited.upstream_extra = "adaptive = false".into();
    let gateways = [("limited", Gateway::start(&limited, ctx.dir)?), ("unlimited", Gateway::start(&unlimited, ctx.dir)?)];
    let conns = CAPACITY as u32;
    let mut env = request_env(ctx.opts);
    let (mut refused, mut ratios) = (0.0, Vec::new());
    for round in 0..ctx.opts.rounds.max(1) {
        let mut p50 = [0.0; 2];
        // Each takes each place in turn.
        for i in 0..2 {
            let which = (i + round as usize) % 2;
            let (name, gw) = &gateways[which];
            let url = format!("http://{}{}", gw.addr, gateway::ROUTE_PATH);
            env.retain(|(k, _)| *k != "BENCH_KEY_PREFIX");
            env.push(("BENCH_KEY_PREFIX", key_prefix()));
            let before = gw.metrics()?;
            let result = ctx.wrk(Scenario::FirstWrite, &url, conns, ctx.opts.secs, &env)?;
            let after = gw.metrics()?;
            if *name == "limited" {
                refused += outcome(&after, &before, "overloaded");
            }
            p50[which] = result.p50_us;
            ctx.report.progress(&Row {
                target: format!("overload-1x-{name}"),
                scenario: "first write 1x".into(),
                conns,
                result,
                peak_rss_kib: None,
                server_cpu_us: None,
                db_cpu_us: None,
                note: format!("round {}", round + 1),
            });
        }
        if p50[1] > 0.0 {
            ratios.push(p50[0] / p50[1]);
        }
    }
    for (_, gw) in gateways {
        gw.stop()?;
    }
    let median = report::median(ratios.clone());
    ctx.report.line(format!(
        "overload 1x: p50 limited/unlimited per round {:?}, median {median:.2}; refused at capacity: {refused:.0}",
        ratios.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>()
    ));
    ctx.report.figures.push(("overload_1x_refused".into(), format!("{refused:.0}")));
    ctx.report.figures.push(("overload_1x_p50_vs_unlimited".into(), format!("{median:.2}")));
    Ok(())
}

impl report::Report {
    /// This section's part of the closing line (empty when it did not run).
    pub fn overload_ratios(&self) -> String {
        let names = ["overload_goodput_vs_capacity", "overload_unknown_vs_executed", "overload_1x_refused", "overload_1x_p50_vs_unlimited"];
        names
            .iter()
            .filter_map(|name| self.figures.iter().find(|(n, _)| n == name).map(|(n, v)| format!("{n}={v}")))
            .collect::<Vec<_>>()
            .join(" ")
    }
}
