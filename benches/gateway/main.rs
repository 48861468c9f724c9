//! The idemgate benchmark (issue #5): one machine, loopback only.
//!
//! `scripts/bench` builds this target and runs it. In one invocation it starts
//! a fast upstream (this binary again, with `--upstream`), nginx as a plain
//! reverse proxy, a private PostgreSQL with the project's schema, and the
//! release `idemgate` on PostgreSQL and on SQLite; drives each with wrk at
//! several connection counts; runs pgbench with the gateway's own statements
//! as the database's ceiling; and prints a table and a closing ratio line.
//! Pass-through is compared with nginx in interleaved rounds (nginx and each
//! gateway take turns, `IDEMGATE_BENCH_ROUNDS` times): its rows and ratios
//! are medians, printed with the range of the runs.
//! `--scale` measures instead how the store behaves with millions of records
//! and how fast the sweeper's statement deletes. See `scripts/bench` for the
//! environment variables.
//!
//! Under `cargo test --all-targets` (no `--bench` argument) it does nothing.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

/// The integration tests' harness: private PostgreSQL clusters, and Citus
/// clusters (which reach the first as `super::postgres`).
#[path = "../../tests/it/support/citus.rs"]
mod citus_harness;
#[path = "../../tests/it/support/postgres.rs"]
mod postgres;
use postgres as pg_harness;

mod citus;
mod client;
mod cpu;
mod features;
mod gateway;
mod nginx;
mod overload;
mod pg;
mod pgbench;
mod procs;
mod report;
mod scale;
mod suite;
mod tls;
mod upstream;
mod wrk;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "--upstream") {
        let addr = args.get(i + 1).map(String::as_str).unwrap_or("127.0.0.1:0");
        let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).and_then(|v| v.parse::<u64>().ok());
        let capacity = value("--capacity")
            .zip(value("--service-ms"))
            .map(|(n, ms)| (usize::try_from(n).unwrap_or(1), std::time::Duration::from_millis(ms)));
        return exit_code(upstream::serve(addr, capacity));
    }
    if !args.iter().any(|a| a == "--bench") {
        println!("benches/gateway: not run in test mode; use scripts/bench (or cargo bench --bench gateway)");
        return ExitCode::SUCCESS;
    }
    exit_code(procs::install_signal_handler().and_then(|()| Options::parse(&args)).and_then(|opts| run(&opts)))
}

fn exit_code(result: Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) if procs::interrupted() => {
            eprintln!("bench: interrupted; everything it started is stopped");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("bench: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(opts: &Options) -> Result<()> {
    let (dir, _tmp) = run_dir()?;
    if opts.scale {
        scale::run(opts, &dir)
    } else {
        let any = features::wanted(opts) || tls::wanted(opts) || citus::wanted(opts) || overload::wanted(opts);
        suite::run(opts, &dir, any.then_some(sections as suite::Section))
    }
}

/// The optional sections after the built-in runs: features.rs, tls.rs,
/// overload.rs, citus.rs.
fn sections(ctx: &mut suite::Ctx, upstream: std::net::SocketAddr) -> Result<()> {
    if features::wanted(ctx.opts) {
        features::run(ctx, upstream)?;
    }
    if tls::wanted(ctx.opts) {
        tls::run(ctx, upstream)?;
    }
    if overload::wanted(ctx.opts) {
        overload::run(ctx)?;
    }
    if citus::wanted(ctx.opts) {
        citus::run(ctx, upstream)?;
    }
    Ok(())
}

/// `$IDEMGATE_BENCH_DIR` (made and removed by scripts/bench), else a temp dir
/// removed on return.
fn run_dir() -> Result<(PathBuf, Option<tempfile::TempDir>)> {
    if let Some(dir) = std::env::var_os("IDEMGATE_BENCH_DIR") {
        let dir = PathBuf::from(dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        procs::publish_groups_in(&dir);
        return Ok((dir, None));
    }
    let tmp = tempfile::Builder::new().prefix("idemgate-bench-").tempdir().context("creating a temp dir")?;
    Ok((tmp.path().to_path_buf(), Some(tmp)))
}

/// Settings: `--scale`, and `IDEMGATE_BENCH_*` environment variables.
#[derive(Debug, Clone)]
pub struct Options {
    pub scale: bool,
    /// Seconds per measured run.
    pub secs: u32,
    /// Seconds of warm-up before each measured run (0: none).
    pub warmup: u32,
    pub conns: Vec<u32>,
    /// Interleaved runs per target in the pass-through comparison (medians).
    pub rounds: u32,
    pub wrk_threads: u32,
    /// Completed keys the replay scenario cycles through.
    pub replay_keys: u64,
    pub idle_conns: usize,
    /// New keys in wrk runs: "spread" over the index (like UUIDs) or "sequential".
    pub key_order: String,
    /// Groups to run (upstream, nginx, pg, accesslog, pgbench, sqlite, features or its
    /// parts async, events, identity, tls); all when unset. `citus` runs only
    /// when named (`scripts/bench --citus`).
    pub only: Option<Vec<String>>,
    /// Record counts for `--scale`.
    pub scale_rows: Vec<u64>,
    /// Expired records the sweep measurement deletes.
    pub sweep_rows: u64,
    /// `name=value` settings applied to the benchmark database
    /// (`ALTER DATABASE bench SET ...`), for experiments.
    pub pg_settings: Vec<(String, String)>,
    /// `VACUUM ANALYZE` before each PostgreSQL run of the default suite
    /// (steady state). Off by default: the runs meet the database as a new
    /// user's gateway does, freshly migrated and never analyzed.
    pub steady: bool,
    pub wrk: PathBuf,
    pub nginx: PathBuf,
}

impl Options {
    fn parse(args: &[String]) -> Result<Options> {
        let mut scale = false;
        for arg in args {
            match arg.as_str() {
                "--bench" => {}
                "--scale" => scale = true,
                other => bail!("unknown argument {other:?} (expected --scale)"),
            }
        }
        Ok(Options {
            scale,
            secs: env_num("IDEMGATE_BENCH_SECS", 5)?,
            warmup: env_num("IDEMGATE_BENCH_WARMUP", 1)?,
            conns: env_list("IDEMGATE_BENCH_CONNS", &[16, 64])?,
            rounds: env_num("IDEMGATE_BENCH_ROUNDS", 3)?,
            wrk_threads: env_num("IDEMGATE_BENCH_WRK_THREADS", 2)?,
            replay_keys: env_num("IDEMGATE_BENCH_REPLAY_KEYS", 3000)?,
            idle_conns: env_num("IDEMGATE_BENCH_IDLE_CONNS", 1000)?,
            key_order: key_order()?,
            only: std::env::var("IDEMGATE_BENCH_ONLY").ok().map(|v| v.split(',').map(|s| s.trim().to_owned()).collect()),
            scale_rows: env_list("IDEMGATE_BENCH_SCALE_ROWS", &[1_000_000, 20_000_000])?,
            sweep_rows: env_num("IDEMGATE_BENCH_SWEEP_ROWS", 500_000)?,
            pg_settings: pg_settings()?,
            steady: env_num("IDEMGATE_BENCH_STEADY", 0u32)? == 1,
            wrk: find_tool("IDEMGATE_BENCH_WRK", "wrk")?,
            nginx: find_tool("IDEMGATE_BENCH_NGINX", "nginx")?,
        })
    }

    pub fn wants(&self, group: &str) -> bool {
        self.only.as_ref().is_none_or(|only| only.iter().any(|g| g == group))
    }
}

/// `IDEMGATE_BENCH_PG_SETTINGS="plan_cache_mode=force_generic_plan,work_mem=8MB"`.
fn pg_settings() -> Result<Vec<(String, String)>> {
    let Ok(text) = std::env::var("IDEMGATE_BENCH_PG_SETTINGS") else { return Ok(Vec::new()) };
    text.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            let (name, value) = s.split_once('=').with_context(|| format!("IDEMGATE_BENCH_PG_SETTINGS: {s:?} is not name=value"))?;
            let name = name.trim();
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.') {
                bail!("IDEMGATE_BENCH_PG_SETTINGS: invalid setting name {name:?}");
            }
            Ok((name.to_owned(), value.trim().to_owned()))
        })
        .collect()
}

fn key_order() -> Result<String> {
    match std::env::var("IDEMGATE_BENCH_KEY_ORDER").as_deref() {
        Err(_) | Ok("spread") => Ok("spread".into()),
        Ok("sequential") => Ok("sequential".into()),
        Ok(other) => bail!("IDEMGATE_BENCH_KEY_ORDER={other:?}: expected spread or sequential"),
    }
}

fn env_num<T: std::str::FromStr>(name: &str, default: T) -> Result<T> {
    match std::env::var(name) {
        Ok(v) => v.trim().replace('_', "").parse().map_err(|_| anyhow::anyhow!("{name}={v:?} is not a number")),
        Err(_) => Ok(default),
    }
}

fn env_list<T: std::str::FromStr + Clone>(name: &str, default: &[T]) -> Result<Vec<T>> {
    match std::env::var(name) {
        Ok(v) => v
            .split(',')
            .map(|s| s.trim().replace('_', "").parse().map_err(|_| anyhow::anyhow!("{name}={v:?}: {s:?} is not a number")))
            .collect(),
        Err(_) => Ok(default.to_vec()),
    }
}

/// `$VAR`, else `name` on PATH or in the sbin directories.
fn find_tool(var: &str, name: &str) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        return Ok(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .with_context(|| format!("{name} not found; install it (scripts/bench does) or set {var}"))
}
