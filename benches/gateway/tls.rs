//! HTTPS (issue 13), group `tls`: the gateway terminating TLS against nginx
//! terminating TLS with the same certificate, both proxying to the bench
//! upstream over plain HTTP/1.1, and HTTPS first writes against plain ones on
//! the same PostgreSQL database.
//!
//! The certificate is a self-signed ECDSA P-256 one made here with rcgen (wrk
//! does not verify certificates). wrk speaks HTTP/1.1 and keeps its
//! connections: each run's handshakes happen once per connection, at its
//! start, so the figures are mostly the cost of encrypting the requests and
//! answers, not of handshakes.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::Options;
use crate::gateway::{self, Gateway, Spec, Store};
use crate::nginx::Nginx;
use crate::pg::Pg;
use crate::report::Report;
use crate::suite::{Ctx, Watch, key_prefix, measure, request_env};
use crate::wrk::Scenario;

const NGINX: &str = "nginx-tls";
const TLS: &str = "idemgate-tls";
const PLAIN: &str = "idemgate-plain";
const GET: &str = "GET";
const PASSTHROUGH: &str = "passthrough";
const FIRST: &str = "first write";

pub fn wanted(opts: &Options) -> bool {
    opts.wants("tls")
}

pub fn run(ctx: &mut Ctx, upstream: SocketAddr) -> Result<()> {
    let (cert, key) = certificate(ctx)?;
    ctx.progress(NGINX);
    let nginx = Nginx::start_tls(&ctx.opts.nginx, ctx.dir, upstream, (&cert, &key))?;
    let url = format!("https://{}{}", nginx.addr, gateway::ROUTE_PATH);
    let watch = Watch { server: Some(nginx.cpu()), ..Watch::default() };
    for conns in ctx.opts.conns.clone() {
        measure(ctx, (NGINX, GET, conns), &watch, "TLS, HTTP/1.1", |ctx, secs| ctx.wrk(Scenario::Get, &url, conns, secs, &[]))?;
    }
    drop(nginx);

    ctx.progress("TLS: PostgreSQL for the gateway");
    let pg = Pg::start()?;
    let db_url = pg.create_database("bench")?;
    let plain = Spec::new("tls-plain-pg", Store::Postgres { url: db_url }, upstream);
    plain.migrate(ctx.dir)?;
    let mut tls = plain.clone();
    tls.name = "tls-pg".into();
    tls.extra = format!("[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n", cert.display(), key.display());

    ctx.progress(PLAIN);
    let gw = Gateway::start(&plain, ctx.dir)?;
    first_writes(ctx, PLAIN, &gw, &pg, "http")?;
    gw.stop()?;

    ctx.progress(TLS);
    let gw = Gateway::start(&tls, ctx.dir)?;
    let url = format!("https://{}{}", gw.addr, gateway::ROUTE_PATH);
    let watch = Watch { gateway: Some(&gw), server: Some(gw.cpu()), ..Watch::default() };
    for conns in ctx.opts.conns.clone() {
        measure(ctx, (TLS, PASSTHROUGH, conns), &watch, "TLS, HTTP/1.1", |ctx, secs| ctx.wrk(Scenario::Get, &url, conns, secs, &[]))?;
    }
    first_writes(ctx, TLS, &gw, &pg, "https")?;
    gw.stop()
}

/// wrk first writes (a new key per request) at each connection count.
fn first_writes(ctx: &mut Ctx, target: &str, gw: &Gateway, pg: &Pg, scheme: &str) -> Result<()> {
    let url = format!("{scheme}://{}{}", gw.addr, gateway::ROUTE_PATH);
    let watch = Watch { gateway: Some(gw), server: Some(gw.cpu()), db: pg.cpu(), pg: Some(pg), pg_db: "bench", analyze: true, nodes: &[] };
    let note = if scheme == "https" { "TLS, HTTP/1.1" } else { "plain HTTP, same database" };
    for conns in ctx.opts.conns.clone() {
        measure(ctx, (target, FIRST, conns), &watch, note, |ctx, secs| {
            let mut env = request_env(ctx.opts);
            env.push(("BENCH_KEY_PREFIX", key_prefix()));
            ctx.wrk(Scenario::FirstWrite, &url, conns, secs, &env)
        })?;
    }
    Ok(())
}

/// A self-signed certificate for 127.0.0.1 and localhost: (cert, key) PEM
/// files in `dir/tls`, used by nginx and the gateway alike.
fn certificate(ctx: &Ctx) -> Result<(PathBuf, PathBuf)> {
    let dir = ctx.dir.join("tls");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let made = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .context("generating a self-signed certificate")?;
    let (cert, key) = (dir.join("server.crt"), dir.join("server.key"));
    std::fs::write(&cert, made.cert.pem()).with_context(|| format!("writing {}", cert.display()))?;
    std::fs::write(&key, made.key_pair.serialize_pem()).with_context(|| format!("writing {}", key.display()))?;
    Ok((cert, key))
}

impl Report {
    /// The TLS part of the closing line.
    pub fn tls_ratios(&self) -> String {
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
            _ => "n/a".to_owned(),
        };
        format!(
            "tls_passthrough_vs_nginx={} tls_passthrough_p99_vs_nginx={} tls_first_write_vs_plain={}",
            ratio(self.best_rps(TLS, PASSTHROUGH), self.best_rps(NGINX, GET)),
            ratio(self.p99_at_most_conns(TLS, PASSTHROUGH), self.p99_at_most_conns(NGINX, GET)),
            ratio(self.best_rps(TLS, FIRST), self.best_rps(PLAIN, FIRST)),
        )
    }
}
