//! The database's ceiling: pgbench running exactly the statements the gateway
//! runs.
//!
//! The statements are not copied from the source: a capture gateway runs
//! against its own database with `log_statement = 'all'`, serves one first
//! write and one replay, and its sweeper runs once; then `idemgate keys show`
//! reads the record (the store's primary-key lookup). The statements (with
//! their parameters) are read back from the server log, and turned into pgbench
//! scripts where the idempotency key becomes a per-transaction variable and
//! every other parameter keeps the captured value. So the ceiling follows the
//! gateway's SQL whenever `src/store` changes.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::client::Conn;
use crate::gateway::{self, Gateway, Spec, Store};
use crate::pg::Pg;
use crate::procs;
use crate::report::LoadResult;

const CAPTURE_DB: &str = "capture";
const CAPTURE_KEY: &str = "bench-capture-key";

/// One statement as the gateway ran it.
#[derive(Debug, Clone)]
pub struct Statement {
    pub sql: String,
    /// `$1..$n` as logged; `None` is NULL.
    pub params: Vec<Option<String>>,
}

/// How a statement carries the capture key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyParam {
    /// `$n = 'key'`
    Scalar,
    /// `$n = '{key}'`: a batched statement's one-element array.
    Array,
}

fn key_param(value: &str) -> Option<KeyParam> {
    if value == CAPTURE_KEY {
        Some(KeyParam::Scalar)
    } else if value == format!("{{{CAPTURE_KEY}}}") || value == format!("{{\"{CAPTURE_KEY}\"}}") {
        Some(KeyParam::Array)
    } else {
        None
    }
}

impl Statement {
    /// Whether any parameter is the capture key (or a one-element array of it).
    fn carries_key(&self) -> bool {
        self.params.iter().flatten().any(|p| key_param(p).is_some())
    }

    /// The statement's verbs, for reports: `UPDATE`, or `WITH(SELECT/UPDATE/INSERT)`.
    pub fn summary(&self) -> String {
        let upper = self.sql.to_ascii_uppercase();
        let words: Vec<&str> = upper.split(|c: char| !c.is_ascii_alphabetic()).collect();
        let mut verbs: Vec<&str> = Vec::new();
        for w in &words {
            if ["SELECT", "INSERT", "UPDATE", "DELETE"].contains(w) && !verbs.contains(w) {
                verbs.push(w);
            }
        }
        if upper.trim_start().starts_with("WITH") {
            format!("WITH({})", verbs.join("/"))
        } else {
            verbs.first().map_or_else(|| words.iter().find(|w| !w.is_empty()).unwrap_or(&"?").to_string(), |v| v.to_string())
        }
    }
}

/// `a + b` for a list of statements.
pub fn summarize_all(stmts: &[Statement]) -> String {
    stmts.iter().map(Statement::summary).collect::<Vec<_>>().join(" + ")
}

/// What the gateway runs for each kind of work.
#[derive(Debug, Clone)]
pub struct Captured {
    pub first_write: Vec<Statement>,
    pub replay: Vec<Statement>,
    /// The store's primary-key read (`get`), as `idemgate keys show` runs it.
    pub lookup: Vec<Statement>,
    pub sweep: Option<Statement>,
}

impl Captured {
    /// Whether a replay runs more than the plain primary-key lookup.
    pub fn replay_differs_from_lookup(&self) -> bool {
        let sql = |v: &[Statement]| v.iter().map(|s| s.sql.clone()).collect::<Vec<_>>();
        sql(&self.replay) != sql(&self.lookup)
    }

    pub fn describe(&self) -> String {
        format!(
            "first write = {} | replay = {} | pk lookup = {}",
            summarize_all(&self.first_write),
            summarize_all(&self.replay),
            summarize_all(&self.lookup)
        )
    }
}

/// Runs the capture gateway and reads its statements from the server log.
pub fn capture(pg: &Pg, dir: &Path, upstream: SocketAddr) -> Result<Captured> {
    let url = pg.create_database(CAPTURE_DB)?;
    let mut spec = Spec::new("capture-gateway", Store::Postgres { url }, upstream);
    spec.sweep_interval = "300ms";
    spec.migrate(dir)?;
    pg.psql("postgres", &format!("ALTER DATABASE {CAPTURE_DB} SET log_statement = 'all'"))?;

    let start = pg.log_len();
    let gw = Gateway::start(&spec, dir)?;
    let mut conn = Conn::open(gw.addr)?;
    expect_status(&gateway::post(&mut conn, CAPTURE_KEY)?, false)?;
    procs::sleep(Duration::from_millis(200))?;
    let middle = pg.log_len();
    expect_status(&gateway::post(&mut conn, CAPTURE_KEY)?, true)?;
    procs::sleep(Duration::from_millis(200))?;
    let end = pg.log_len();
    let sweep = wait_for_sweep(pg, start)?;
    drop(conn);
    gw.stop()?;
    spec.keys_show(dir, CAPTURE_KEY)?;
    procs::sleep(Duration::from_millis(200))?;
    let after_show = pg.log_len();

    let log = std::fs::read(pg.log_path()).context("reading the PostgreSQL log")?;
    let slice = |a: u64, b: u64| String::from_utf8_lossy(&log[a as usize..(b as usize).min(log.len())]).into_owned();
    let with_key = |text: &str| statements(text).into_iter().filter(Statement::carries_key).collect::<Vec<_>>();
    let captured = Captured {
        first_write: with_key(&slice(start, middle)),
        replay: with_key(&slice(middle, end)),
        lookup: with_key(&slice(end, after_show)),
        sweep,
    };
    if captured.first_write.is_empty() || captured.replay.is_empty() || captured.lookup.is_empty() {
        bail!(
            "found no statements carrying the idempotency key in the PostgreSQL log ({}): {}; \
             has the store stopped passing the key as a parameter (or a one-element array)? \
             Update benches/gateway/pgbench.rs",
            pg.log_path().display(),
            captured.describe()
        );
    }
    Ok(captured)
}

fn expect_status(resp: &crate::client::Response, replayed: bool) -> Result<()> {
    let is_replay = resp.header("idempotent-replayed") == Some("true");
    if resp.status != 201 || is_replay != replayed {
        bail!("capture request: expected 201 (replayed: {replayed}), got {} (replayed: {is_replay}): {}", resp.status, resp.text());
    }
    Ok(())
}

/// The sweeper's DELETE, once it has run (it ticks every 300 ms here).
fn wait_for_sweep(pg: &Pg, from: u64) -> Result<Option<Statement>> {
    for _ in 0..40 {
        let log = std::fs::read(pg.log_path()).context("reading the PostgreSQL log")?;
        let text = String::from_utf8_lossy(&log[(from as usize).min(log.len())..]).into_owned();
        let found = statements(&text).into_iter().find(|s| !s.carries_key() && s.sql.to_ascii_uppercase().contains("DELETE"));
        if found.is_some() {
            return Ok(found);
        }
        procs::sleep(Duration::from_millis(100))?;
    }
    Ok(None)
}

/// Statements logged by `log_statement` (`execute <name>: SQL` or `statement: SQL`),
/// each with the `parameters:` detail that follows it from the same backend.
fn statements(log: &str) -> Vec<Statement> {
    let entries = entries(log);
    let mut out = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        if e.level != "LOG" {
            continue;
        }
        let sql = if let Some(rest) = e.text.strip_prefix("execute ") {
            match rest.split_once(": ") {
                Some((_, sql)) => sql,
                None => continue,
            }
        } else if let Some(sql) = e.text.strip_prefix("statement: ") {
            sql
        } else {
            continue;
        };
        let params = entries[i + 1..]
            .iter()
            .find(|d| d.pid == e.pid)
            .filter(|d| d.level == "DETAIL")
            .and_then(|d| d.text.strip_prefix("parameters: "))
            .map(parse_params)
            .unwrap_or_default();
        out.push(Statement { sql: sql.to_owned(), params });
    }
    out
}

struct Entry<'a> {
    pid: &'a str,
    level: &'a str,
    text: String,
}

/// Log entries with the default `log_line_prefix` (`%m [%p] `): continuation
/// lines start with a tab.
fn entries(log: &str) -> Vec<Entry<'_>> {
    let mut out: Vec<Entry> = Vec::new();
    for line in log.lines() {
        if let Some(more) = line.strip_prefix('\t') {
            if let Some(last) = out.last_mut() {
                last.text.push('\n');
                last.text.push_str(more);
            }
            continue;
        }
        let Some((_, rest)) = line.split_once(" [") else { continue };
        let Some((pid, rest)) = rest.split_once("] ") else { continue };
        let Some((level, text)) = rest.split_once(":  ") else { continue };
        out.push(Entry { pid, level, text: text.to_owned() });
    }
    out
}

/// `$1 = 'a', $2 = NULL, $3 = 'it''s'` → values by position.
fn parse_params(text: &str) -> Vec<Option<String>> {
    let mut out = Vec::new();
    let mut rest = text.trim();
    while let Some(after_dollar) = rest.strip_prefix('$') {
        let Some((_, value)) = after_dollar.split_once(" = ") else { break };
        let (param, remainder) = if let Some(v) = value.strip_prefix("NULL") {
            (None, v)
        } else if let Some(quoted) = value.strip_prefix('\'') {
            let (v, r) = unquote(quoted);
            (Some(v), r)
        } else {
            break;
        };
        out.push(param);
        rest = remainder.trim_start_matches(',').trim_start();
    }
    out
}

/// The body of a single-quoted literal (`''` is a quote); returns (value, rest).
fn unquote(s: &str) -> (String, &str) {
    let mut value = String::new();
    let mut chars = s.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c == '\'' {
            if chars.peek().is_some_and(|(_, n)| *n == '\'') {
                chars.next();
                value.push('\'');
                continue;
            }
            return (value, &s[i + 1..]);
        }
        value.push(c);
    }
    (value, "")
}

/// A pgbench script plus the `-D` variables it needs.
pub struct Workload {
    pub name: String,
    script: PathBuf,
    vars: Vec<(String, String)>,
}

/// Writes a pgbench script that runs `stmts` as autocommit statements, with
/// `key_expr` (a pgbench expression) as the idempotency key of each transaction.
/// Batched statements (array parameters) run as batches of one.
pub fn workload(dir: &Path, name: &str, stmts: &[Statement], key_expr: &str) -> Result<Workload> {
    let mut vars = Vec::new();
    let mut body = String::new();
    for (i, st) in stmts.iter().enumerate() {
        let sql = substitute_params(&st.sql, |n| match st.params.get(n - 1) {
            Some(Some(v)) if key_param(v) == Some(KeyParam::Scalar) => ":key".to_owned(),
            // A batch of one: the same statement shape with this transaction's key.
            Some(Some(v)) if key_param(v) == Some(KeyParam::Array) => "ARRAY[:key]".to_owned(),
            Some(Some(v)) => {
                let var = format!("s{i}p{n}");
                vars.push((var.clone(), v.clone()));
                format!(":{var}")
            }
            Some(None) | None => "NULL".to_owned(),
        });
        body.push_str(sql.trim().trim_end_matches(';'));
        body.push_str(";\n");
    }
    let defines: Vec<String> = vars.iter().map(|(k, v)| format!("-D {k}={}", v.replace('\n', " "))).collect();
    let script = format!(
        "-- Generated by the idemgate benchmark from the gateway's logged statements.\n\
         -- pgbench -n -M prepared -f {name}.sql {}\n\\set key {key_expr}\n{body}",
        defines.join(" ")
    );
    let dir = dir.join("pgbench");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("{name}.sql"));
    std::fs::write(&path, script).with_context(|| format!("writing {}", path.display()))?;
    Ok(Workload { name: name.to_owned(), script: path, vars })
}

/// The ceiling the issue names: a gateway that commits each claim and each
/// result on its own, one row per statement. The contract's two statements,
/// written out: the claim as `INSERT ... ON CONFLICT DO NOTHING RETURNING`,
/// the result as the generation-fenced `UPDATE`. Two commits per request.
pub fn single_row_first_write(dir: &Path, key_expr: &str) -> Result<Workload> {
    let hash = "\\x".to_owned() + &"ab".repeat(32);
    let script = format!(
        "-- The contract's claim and fenced result update, one row per statement (two commits).\n\
         \\set key {key_expr}\n\
         INSERT INTO idemgate_records (tenant, principal, operation, idempotency_key, request_hash, state, generation, \
         claim_token, owner, lease_expires_at, created_at, updated_at, expires_at, scope_id) \
         VALUES ('bench', 'pgbench', 'create_order', :key, '{hash}'::bytea, 'in_flight', 1, gen_random_uuid(), 'pgbench', \
         now() + interval '15 seconds', now(), now(), now() + interval '15 seconds', \
         idemgate_scope_id('bench', 'pgbench', 'create_order', :key)) \
         ON CONFLICT (scope_id, idempotency_key, tenant, principal, operation) DO NOTHING RETURNING generation;\n\
         UPDATE idemgate_records SET state = 'completed', response_status = 201, response_headers = '\\x01'::bytea, \
         response_body = '{{\"order\":1}}'::bytea, lease_expires_at = NULL, updated_at = now(), \
         expires_at = now() + interval '24 hours' \
         WHERE scope_id = idemgate_scope_id('bench', 'pgbench', 'create_order', :key) \
         AND tenant = 'bench' AND principal = 'pgbench' AND operation = 'create_order' AND idempotency_key = :key::text \
         AND generation = 1 AND state = 'in_flight';\n"
    );
    let dir = dir.join("pgbench");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("first_write_single_row.sql");
    std::fs::write(&path, script).with_context(|| format!("writing {}", path.display()))?;
    Ok(Workload { name: "first_write_single_row".to_owned(), script: path, vars: Vec::new() })
}

/// Replaces `$N` placeholders with `f(N)`.
fn substitute_params(sql: &str, mut f: impl FnMut(usize) -> String) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '$' && chars.peek().is_some_and(char::is_ascii_digit) {
            let mut n = 0usize;
            while let Some(d) = chars.peek().and_then(|c| c.to_digit(10)) {
                n = n * 10 + d as usize;
                chars.next();
            }
            out.push_str(&f(n));
        } else {
            out.push(c);
        }
    }
    out
}

/// How long pgbench runs: by time, or a fixed number of transactions per client.
pub enum Length {
    Secs(u32),
    Transactions(u64),
}

/// Runs pgbench (prepared statements, like the gateway) and reads per-transaction
/// latencies from its log.
pub fn run(pg: &Pg, db: &str, dir: &Path, w: &Workload, clients: u32, length: Length) -> Result<LoadResult> {
    let logs = dir.join("pgbench").join(format!("log-{}-c{clients}", w.name));
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let mut cmd = pg.pgbench(db);
    cmd.args(["-n", "-M", "prepared", "-l"])
        .arg(format!("--log-prefix={}", logs.join("tx").display()))
        .arg("-c")
        .arg(clients.to_string())
        .arg("-j")
        .arg(clients.min(2).to_string());
    match length {
        Length::Secs(s) => cmd.arg("-T").arg(s.to_string()),
        Length::Transactions(t) => cmd.arg("-t").arg(t.to_string()),
    };
    for (k, v) in &w.vars {
        cmd.arg("-D").arg(format!("{k}={v}"));
    }
    cmd.arg("-f").arg(&w.script);
    let out = procs::run_tool_ok(&mut cmd).with_context(|| format!("pgbench {}", w.name))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let latencies = read_latencies(&logs)?;
    let result = summarize(&stdout, latencies).with_context(|| format!("pgbench {} output:\n{stdout}", w.name))?;
    let _ = std::fs::remove_dir_all(&logs);
    Ok(result)
}

/// Per-transaction latencies (µs, third field) from every `tx.*` log file.
fn read_latencies(dir: &Path) -> Result<Vec<f64>> {
    let mut all = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let text = std::fs::read_to_string(entry?.path())?;
        all.extend(text.lines().filter_map(|l| l.split_whitespace().nth(2)?.parse::<f64>().ok()));
    }
    all.sort_by(f64::total_cmp);
    Ok(all)
}

fn summarize(stdout: &str, latencies: Vec<f64>) -> Result<LoadResult> {
    let tps: f64 =
        stdout.lines().find_map(|l| l.strip_prefix("tps = ")?.split_whitespace().next()?.parse().ok()).context("no `tps = ` line")?;
    let failed: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("number of failed transactions: ")?.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    if latencies.is_empty() {
        bail!("no transactions logged");
    }
    let pct = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    Ok(LoadResult {
        requests: latencies.len() as u64,
        rps: tps,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        status_errors: failed,
        socket_errors: 0,
    })
}
