//! The printed results: one table row per run, memory lines, and the closing
//! ratio line.

use std::fmt::Write as _;

/// What one load run measured.
#[derive(Debug, Clone)]
pub struct LoadResult {
    /// Requests (wrk) or transactions (pgbench) completed in the measured run.
    pub requests: u64,
    pub rps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// Answers other than 2xx/3xx (wrk), failed transactions (pgbench).
    pub status_errors: u64,
    pub socket_errors: u64,
}

#[derive(Debug, Clone)]
pub struct Row {
    /// What was measured: "upstream", "nginx", "idemgate-pg", "pgbench", ...
    pub target: String,
    pub scenario: String,
    pub conns: u32,
    pub result: LoadResult,
    pub peak_rss_kib: Option<u64>,
    /// CPU time of the server under test per request (µs).
    pub server_cpu_us: Option<f64>,
    /// CPU time of all PostgreSQL processes per request (µs).
    pub db_cpu_us: Option<f64>,
    pub note: String,
}

#[derive(Debug, Default)]
pub struct Report {
    pub rows: Vec<Row>,
    pub lines: Vec<String>,
}

impl Report {
    pub fn add(&mut self, row: Row) {
        eprintln!("  {}", format_row(&row));
        self.rows.push(row);
    }

    /// A free-form line printed after the table (memory, captured SQL, ...).
    pub fn line(&mut self, line: String) {
        eprintln!("  {line}");
        self.lines.push(line);
    }

    fn find(&self, target: &str, scenario: &str) -> impl Iterator<Item = &Row> {
        self.rows.iter().filter(move |r| r.target == target && r.scenario == scenario)
    }

    /// Best requests/s over the connection counts.
    pub fn best_rps(&self, target: &str, scenario: &str) -> Option<f64> {
        self.find(target, scenario).map(|r| r.result.rps).max_by(f64::total_cmp)
    }

    /// p99 at the highest connection count measured.
    pub fn p99_at_most_conns(&self, target: &str, scenario: &str) -> Option<f64> {
        self.find(target, scenario).max_by_key(|r| r.conns).map(|r| r.result.p99_us)
    }

    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "{}", header());
        let _ = writeln!(out, "{}", "-".repeat(header().len()));
        for row in &self.rows {
            let _ = writeln!(out, "{}", format_row(row));
        }
        for line in &self.lines {
            let _ = writeln!(out, "{line}");
        }
        out
    }

    /// The closing line of the default run.
    pub fn ratio_line(&self) -> String {
        let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
            _ => "n/a".to_owned(),
        };
        format!(
            "ratios: first_write_vs_pg_ceiling={} replay_vs_pg_lookup={} passthrough_vs_nginx={} passthrough_p99_vs_nginx={} \
             access_log_first_write={} access_log_replay={} {} {}",
            ratio(self.best_rps("idemgate-pg", "first write"), self.best_rps("pgbench", "first write")),
            ratio(self.best_rps("idemgate-pg", "replay"), self.best_rps("pgbench", "pk lookup")),
            ratio(self.best_rps("idemgate-pg", "passthrough"), self.best_rps("nginx", "GET")),
            ratio(self.p99_at_most_conns("idemgate-pg", "passthrough"), self.p99_at_most_conns("nginx", "GET")),
            // Access log on (the default) vs off, same database: at least 0.95.
            ratio(self.best_rps("idemgate-pg", "first write"), self.best_rps("idemgate-pg-nolog", "first write")),
            ratio(self.best_rps("idemgate-pg", "replay"), self.best_rps("idemgate-pg-nolog", "replay")),
            self.feature_ratios(),
            self.tls_ratios(),
        )
    }
}

fn header() -> String {
    format!(
        "{:<16} {:<20} {:>5} {:>9} {:>8} {:>8} {:>7} {:>9} {:>9} {:>9}  {}",
        "target", "scenario", "conns", "req/s", "p50", "p99", "errors", "peak RSS", "srv CPU", "db CPU", "notes"
    )
}

fn format_row(r: &Row) -> String {
    let errors = r.result.status_errors + r.result.socket_errors;
    format!(
        "{:<16} {:<20} {:>5} {:>9.0} {:>8} {:>8} {:>7} {:>9} {:>9} {:>9}  {}",
        r.target,
        r.scenario,
        r.conns,
        r.result.rps,
        micros(r.result.p50_us),
        micros(r.result.p99_us),
        errors,
        r.peak_rss_kib.map(mib).unwrap_or_else(|| "-".to_owned()),
        cpu(r.server_cpu_us),
        cpu(r.db_cpu_us),
        r.note
    )
}

/// CPU µs per request.
fn cpu(us: Option<f64>) -> String {
    us.map(|us| format!("{us:.0}us/r")).unwrap_or_else(|| "-".to_owned())
}

pub fn micros(us: f64) -> String {
    if us.is_nan() {
        return "-".to_owned();
    }
    if us >= 10_000.0 { format!("{:.1}ms", us / 1000.0) } else { format!("{:.0}us", us) }
}

pub fn mib(kib: u64) -> String {
    format!("{:.1}MiB", kib as f64 / 1024.0)
}
