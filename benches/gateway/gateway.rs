//! An idemgate instance under test: its config, the release binary as a
//! child process, its metrics and its memory.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

use crate::client::{self, Conn};
use crate::cpu::Cpu;
use crate::procs::{self, Service};

/// The key wrk and the bench present (`Authorization: Bearer bench-key`).
pub const API_KEY: &str = "bench-key";
pub const ROUTE_PATH: &str = "/v1/orders";
pub const OPERATION: &str = "create_order";
pub const TENANT: &str = "bench";
pub const PRINCIPAL: &str = "wrk";
/// The body of every idempotent POST (same fingerprint for the same key).
pub const POST_BODY: &str = r#"{"item":"book","qty":1}"#;
const DATABASE_URL_ENV: &str = "IDEMGATE_DATABASE_URL";

/// The gateway binary: `$IDEMGATE_BENCH_GATEWAY_BIN` (scripts/bench sets it
/// to a plain `cargo build --release` of the binary), else the one cargo built
/// beside this bench. They differ: building a bench enables dev-dependency
/// features (tokio's `test-util`, whose clock takes a mutex on every read) in
/// the binary too.
pub fn binary() -> PathBuf {
    std::env::var_os("IDEMGATE_BENCH_GATEWAY_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_idemgate")), PathBuf::from)
}

#[derive(Debug, Clone)]
pub enum Store {
    Postgres {
        url: String,
    },
    /// A Citus node's database (`kind = "citus"`).
    Citus {
        url: String,
    },
    Sqlite {
        path: PathBuf,
    },
}

impl Store {
    fn toml(&self, sweep_interval: &str) -> String {
        match self {
            Store::Postgres { .. } | Store::Citus { .. } => format!(
                "[store]\nkind = \"{}\"\nurl_env = \"{DATABASE_URL_ENV}\"\npool_size = 16\nmigrate = false\nsweep_interval = \"{sweep_interval}\"\n",
                if matches!(self, Store::Citus { .. }) { "citus" } else { "postgres" }
            ),
            Store::Sqlite { path } => {
                format!(
                    "[store]\nkind = \"sqlite\"\npath = \"{}\"\nmigrate = false\nsweep_interval = \"{sweep_interval}\"\n",
                    path.display()
                )
            }
        }
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        match self {
            Store::Postgres { url } | Store::Citus { url } => vec![(DATABASE_URL_ENV, url.clone())],
            Store::Sqlite { .. } => Vec::new(),
        }
    }
}

/// What a gateway instance is configured with.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Names the config and log files in the run directory.
    pub name: String,
    pub store: Store,
    pub upstream: SocketAddr,
    pub sweep_interval: &'static str,
    /// `server.access_log` (on by default, as in the product).
    pub access_log: bool,
    /// Replaces the API-key `[[identity.sources]]` entry (features.rs: JWT).
    pub identity: Option<String>,
    /// Lines added to the route's table, subtables last (`mode = "async"`,
    /// `[routes.events]`, ...).
    pub route_extra: String,
    /// Top-level tables after the route (`[workers]`).
    pub extra: String,
    /// Another gateway binary than [`binary()`] (citus.rs: a build from
    /// before a change, measured beside the current one).
    pub binary: Option<PathBuf>,
    /// The upstream's `timeout`.
    pub upstream_timeout: &'static str,
    /// Lines added to the upstream's table (overload.rs: `adaptive = false`).
    pub upstream_extra: String,
}

/// The gateway's default sweeper settings (interval, batch), from its own
/// config parser.
pub fn default_sweeper() -> Result<(Duration, u32)> {
    // A file must serve something: one upstream as the default.
    let minimal =
        "[server]\ndefault_upstream = \"u\"\n[store]\nkind = \"sqlite\"\n[[upstreams]]\nname = \"u\"\nurl = \"http://127.0.0.1:9\"\n";
    let config = idemgate::config::Config::from_toml(minimal, "defaults", &|_| None)
        .map_err(|e| anyhow::anyhow!("parsing a minimal config: {e}"))?;
    Ok((config.store.sweep_interval, config.store.sweep_batch))
}

impl Spec {
    pub fn new(name: &str, store: Store, upstream: SocketAddr) -> Spec {
        Spec {
            name: name.to_owned(),
            store,
            upstream,
            sweep_interval: "30s",
            access_log: true,
            identity: None,
            route_extra: String::new(),
            extra: String::new(),
            binary: None,
            upstream_timeout: "10s",
            upstream_extra: String::new(),
        }
    }

    fn binary(&self) -> PathBuf {
        self.binary.clone().unwrap_or_else(binary)
    }

    fn toml(&self) -> String {
        let key_hash = hex::encode(Sha256::digest(API_KEY.as_bytes()));
        let api_key = format!(
            "[[identity.sources]]\nkind = \"api_key\"\nheader = \"authorization\"\n\
             keys = [ {{ sha256 = \"{key_hash}\", tenant = \"{TENANT}\", principal = \"{PRINCIPAL}\" }} ]\n"
        );
        format!(
            r#"# Written by the idemgate benchmark.
[server]
listen = "127.0.0.1:0"
shutdown_grace = "2s"
access_log = {access_log}

{store}
[admin]
listen = "127.0.0.1:0"

[[upstreams]]
name = "app"
url = "http://{upstream}"
timeout = "{upstream_timeout}"
{upstream_extra}

{identity}
[[routes]]
operation = "{OPERATION}"
method = "POST"
path = "{ROUTE_PATH}"
upstream = "app"
{route_extra}
{extra}"#,
            store = self.store.toml(self.sweep_interval),
            upstream = self.upstream,
            access_log = self.access_log,
            identity = self.identity.as_deref().unwrap_or(&api_key),
            route_extra = self.route_extra,
            extra = self.extra,
            upstream_timeout = self.upstream_timeout,
            upstream_extra = self.upstream_extra,
        )
    }

    fn write(&self, dir: &Path) -> Result<PathBuf> {
        let path = dir.join(format!("{}.toml", self.name));
        std::fs::write(&path, self.toml()).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }

    /// `idemgate migrate` with this config.
    pub fn migrate(&self, dir: &Path) -> Result<()> {
        self.cli(dir, &["migrate"]).map(drop)
    }

    /// `idemgate keys show` of the bench identity's `key` (reads one record).
    pub fn keys_show(&self, dir: &Path, key: &str) -> Result<()> {
        self.cli(dir, &["keys", "show", "--tenant", TENANT, "--principal", PRINCIPAL, "--operation", OPERATION, "--key", key]).map(drop)
    }

    /// How many records are in `state` (`idemgate keys list`).
    pub fn count_state(&self, dir: &Path, state: &str) -> Result<usize> {
        let out = self.cli(dir, &["keys", "list", "--state", state, "--limit", "1000000", "--json"])?;
        let page: serde_json::Value = serde_json::from_slice(&out).context("parsing `idemgate keys list --json`")?;
        // `{"records": [...], "next_cursor": ...}` (a bare list before cursors).
        let list = page.get("records").unwrap_or(&page).as_array().context("`idemgate keys list --json` printed no records list")?;
        if page.get("next_cursor").is_some_and(|c| !c.is_null()) {
            bail!("more than 1000000 {state} records: `idemgate keys list` has another page");
        }
        Ok(list.len())
    }

    fn cli(&self, dir: &Path, args: &[&str]) -> Result<Vec<u8>> {
        let config = self.write(dir)?;
        let mut cmd = Command::new(self.binary());
        cmd.args(args).arg("--config").arg(&config);
        for (k, v) in self.store.env() {
            cmd.env(k, v);
        }
        let out = procs::run_tool_ok(&mut cmd).with_context(|| format!("idemgate {} for {}", args.join(" "), self.name))?;
        Ok(out.stdout)
    }
}

/// A running `idemgate serve`.
pub struct Gateway {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    service: Service,
}

impl Gateway {
    pub fn start(spec: &Spec, dir: &Path) -> Result<Gateway> {
        let config = spec.write(dir)?;
        let mut env = spec.store.env();
        env.push(("IDEMGATE_LOG_FORMAT", "json".into()));
        env.push(("IDEMGATE_LOG", "info".into()));
        let args = ["serve".as_ref(), "--config".as_ref(), config.as_os_str()];
        let log = dir.join(format!("{}.log", spec.name));
        let service = Service::spawn(&spec.name, &log, &spec.binary(), &args, &env)?;
        let (addr, admin) = service.wait_for_log("\"listening\"", Duration::from_secs(30), listening)?;
        Ok(Gateway { addr, admin, service })
    }

    pub fn pid(&self) -> u32 {
        self.service.pid()
    }

    pub fn cpu(&self) -> Cpu {
        Cpu::Pid(self.pid())
    }

    pub fn stop(self) -> Result<()> {
        self.service.stop()
    }

    pub fn metrics(&self) -> Result<Metrics> {
        let resp = client::get(self.admin, "/metrics").context("scraping /metrics")?;
        if resp.status != 200 {
            bail!("/metrics answered {}", resp.status);
        }
        Ok(Metrics::parse(&resp.text()))
    }

    /// Resets the peak RSS (VmHWM) to the current RSS; false if the kernel refused.
    pub fn reset_peak_rss(&self) -> bool {
        std::fs::write(format!("/proc/{}/clear_refs", self.pid()), "5").is_ok()
    }

    pub fn peak_rss_kib(&self) -> Result<u64> {
        proc_status_kib(self.pid(), "VmHWM")
    }

    pub fn rss_kib(&self) -> Result<u64> {
        proc_status_kib(self.pid(), "VmRSS")
    }

    /// POSTs `keys` once each through `threads` keep-alive connections, so that
    /// replays find completed records.
    pub fn populate(&self, keys: &[String], threads: usize) -> Result<()> {
        let chunk = keys.len().div_ceil(threads.max(1)).max(1);
        thread::scope(|s| {
            let workers: Vec<_> = keys.chunks(chunk).map(|part| s.spawn(move || self.post_all(part))).collect();
            workers.into_iter().try_for_each(|w| w.join().unwrap_or_else(|_| bail!("a populate thread panicked")))
        })
    }

    fn post_all(&self, keys: &[String]) -> Result<()> {
        let mut conn = Conn::open(self.addr)?;
        for key in keys {
            procs::check_interrupted()?;
            let resp = post(&mut conn, key)?;
            if resp.status != 201 {
                bail!("POST with key {key} answered {}: {}", resp.status, resp.text());
            }
        }
        Ok(())
    }

    /// VmRSS with no client connections, then with `n` open idle keep-alive
    /// connections (each has made one pass-through request).
    pub fn rss_with_idle_connections(&self, n: usize) -> Result<(u64, u64)> {
        procs::sleep(Duration::from_millis(500))?;
        let before = self.rss_kib()?;
        let mut conns = Vec::with_capacity(n);
        for i in 0..n {
            procs::check_interrupted()?;
            let mut conn = Conn::open(self.addr).with_context(|| format!("opening idle connection {i}"))?;
            let resp = conn.request("GET", ROUTE_PATH, &[], b"")?;
            if resp.status != 201 {
                bail!("pass-through GET answered {}", resp.status);
            }
            conns.push(conn);
        }
        procs::sleep(Duration::from_secs(1))?;
        let with = self.rss_kib()?;
        drop(conns);
        Ok((before, with))
    }
}

/// One idempotent POST with the bench's identity and body.
pub fn post(conn: &mut Conn, key: &str) -> Result<client::Response> {
    let auth = format!("Bearer {API_KEY}");
    let headers = [("Authorization", auth.as_str()), ("Content-Type", "application/json"), ("Idempotency-Key", key)];
    conn.request("POST", ROUTE_PATH, &headers, POST_BODY.as_bytes())
}

/// The gateway's `"listening"` JSON log line: (proxy address, admin address).
fn listening(line: &str) -> Option<(SocketAddr, SocketAddr)> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let fields = if v.get("message").is_some() { &v } else { v.get("fields")? };
    if fields.get("message")?.as_str()? != "listening" {
        return None;
    }
    let addr = fields.get("addr")?.as_str()?.parse().ok()?;
    let admin = fields.get("admin")?.as_str()?.parse().ok()?;
    Some((addr, admin))
}

fn proc_status_kib(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).with_context(|| format!("reading /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':')?.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("no {field} in /proc/{pid}/status"))
}

/// A scrape of `/metrics`: every sample by name and labels.
#[derive(Debug, Default, Clone)]
pub struct Metrics {
    samples: Vec<(String, HashMap<String, String>, f64)>,
}

impl Metrics {
    fn parse(text: &str) -> Metrics {
        let samples = text.lines().filter(|l| !l.starts_with('#')).filter_map(parse_sample).collect();
        Metrics { samples }
    }

    pub fn sum(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        self.samples
            .iter()
            .filter(|(n, labels, _)| n == name && filter.iter().all(|(k, v)| labels.get(*k).is_some_and(|l| l == v)))
            .map(|(_, _, v)| v)
            .sum()
    }

    /// The sum of every sample named `name` (all labels).
    pub fn total(&self, name: &str) -> f64 {
        self.sum(name, &[])
    }

    /// `idemgate_requests_total` by outcome, minus an earlier scrape.
    pub fn outcomes_since(&self, earlier: &Metrics) -> Vec<(String, u64)> {
        let mut outcomes: Vec<String> = self
            .samples
            .iter()
            .filter(|(n, _, _)| n == "idemgate_requests_total")
            .filter_map(|(_, l, _)| l.get("outcome").cloned())
            .collect();
        outcomes.sort();
        outcomes.dedup();
        outcomes
            .into_iter()
            .map(|o| {
                let f = [("outcome", o.as_str())];
                let n = self.sum("idemgate_requests_total", &f) - earlier.sum("idemgate_requests_total", &f);
                (o, n.max(0.0) as u64)
            })
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// Quantile `q` of the store operation `op`'s latency histogram between
    /// two scrapes, interpolated within buckets (seconds).
    pub fn store_quantile_since(&self, earlier: &Metrics, op: &str, q: f64) -> Option<f64> {
        let name = "idemgate_store_duration_seconds_bucket";
        let mut buckets: Vec<(f64, f64)> = self
            .samples
            .iter()
            .filter(|(n, l, _)| n == name && l.get("op").is_some_and(|o| o == op))
            .filter_map(|(_, l, _)| {
                let le_text = l.get("le")?;
                let le = if le_text == "+Inf" { f64::INFINITY } else { le_text.parse().ok()? };
                let f = [("op", op), ("le", le_text.as_str())];
                Some((le, self.sum(name, &f) - earlier.sum(name, &f)))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        quantile_from_buckets(&buckets, q)
    }
}

/// `buckets` are cumulative (upper bound, count) pairs, ascending.
fn quantile_from_buckets(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank {
            if le.is_infinite() {
                return Some(lower);
            }
            let within = (rank - below) / (count - below).max(f64::MIN_POSITIVE);
            return Some(lower + (le - lower) * within);
        }
        (lower, below) = (le, count);
    }
    None
}

/// `name{k="v",...} value` (labels optional).
fn parse_sample(line: &str) -> Option<(String, HashMap<String, String>, f64)> {
    let (series, value) = line.rsplit_once(' ')?;
    let value: f64 = value.parse().ok()?;
    let Some((name, rest)) = series.split_once('{') else { return Some((series.to_owned(), HashMap::new(), value)) };
    let labels = rest
        .trim_end_matches('}')
        .split(',')
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some((k.trim().to_owned(), v.trim().trim_matches('"').to_owned()))
        })
        .collect();
    Some((name.to_owned(), labels, value))
}
