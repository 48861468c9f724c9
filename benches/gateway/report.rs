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
    /// Named figures for the closing line that are not a row's (the
    /// features' medians of per-round figures).
    pub figures: Vec<(String, String)>,
    /// Closing lines printed after the `ratios:` line (`citus: ...`).
    pub summaries: Vec<String>,
}

impl Report {
    pub fn add(&mut self, row: Row) {
        eprintln!("  {}", format_row(&row));
        self.rows.push(row);
    }

    /// Prints a row without keeping it (one of several runs whose median is
    /// kept).
    pub fn progress(&self, row: &Row) {
        eprintln!("  {}", format_row(row));
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
            "ratios: first_write_vs_pg_ceiling={} replay_vs_pg_lookup={} {} access_log_first_write={} access_log_replay={} {} {} {}",
            ratio(self.best_rps("idemgate-pg", "first write"), self.best_rps("pgbench", "first write")),
            ratio(self.best_rps("idemgate-pg", "replay"), self.best_rps("pgbench", "pk lookup")),
            self.passthrough_ratios(),
            // Access log on (the default) vs off, same database: at least 0.95.
            ratio(self.best_rps("idemgate-pg", "first write"), self.best_rps("idemgate-pg-nolog", "first write")),
            ratio(self.best_rps("idemgate-pg", "replay"), self.best_rps("idemgate-pg-nolog", "replay")),
            self.feature_ratios(),
            self.tls_ratios(),
            self.overload_ratios(),
        )
    }

    /// Pass-through against nginx from the medians, at each connection count:
    /// throughput (the lowest ratio is reported), p99 and CPU per request
    /// (the highest). The PostgreSQL gateway's rows when present, else the
    /// SQLite one's (pass-through never touches the store).
    pub fn passthrough_ratios(&self) -> String {
        let target = ["idemgate-pg", "idemgate-sqlite"].into_iter().find(|t| self.find(t, "passthrough").next().is_some());
        let Some(target) = target else {
            return "passthrough_vs_nginx=n/a passthrough_p99_vs_nginx=n/a passthrough_cpu_vs_nginx=n/a".into();
        };
        let mut per_conns = Vec::new();
        for row in self.find(target, "passthrough") {
            let Some(nginx) = self.find("nginx", "GET").find(|n| n.conns == row.conns) else { continue };
            per_conns.push(VsNginx {
                conns: row.conns,
                rps: row.result.rps / nginx.result.rps.max(f64::MIN_POSITIVE),
                p99: row.result.p99_us / nginx.result.p99_us.max(f64::MIN_POSITIVE),
                cpu: match (row.server_cpu_us, nginx.server_cpu_us) {
                    (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                    _ => None,
                },
            });
        }
        if per_conns.is_empty() {
            return "passthrough_vs_nginx=n/a passthrough_p99_vs_nginx=n/a passthrough_cpu_vs_nginx=n/a".into();
        }
        let detail = |f: fn(&VsNginx) -> Option<f64>| {
            per_conns.iter().filter_map(|p| f(p).map(|v| format!("{}: {v:.2}", p.conns))).collect::<Vec<_>>().join(", ")
        };
        let worst = |f: fn(&VsNginx) -> Option<f64>, lowest: bool| {
            let values = per_conns.iter().filter_map(f);
            let v = if lowest { values.fold(f64::INFINITY, f64::min) } else { values.fold(f64::NEG_INFINITY, f64::max) };
            if v.is_finite() { format!("{v:.2}") } else { "n/a".into() }
        };
        format!(
            "passthrough_vs_nginx={} ({}) passthrough_p99_vs_nginx={} ({}) passthrough_cpu_vs_nginx={} ({}) [{target}, medians]",
            worst(|p| Some(p.rps), true),
            detail(|p| Some(p.rps)),
            worst(|p| Some(p.p99), false),
            detail(|p| Some(p.p99)),
            worst(|p| p.cpu, false),
            detail(|p| p.cpu),
        )
    }
}

/// The gateway's pass-through medians over nginx's, at one connection count.
struct VsNginx {
    conns: u32,
    rps: f64,
    p99: f64,
    cpu: Option<f64>,
}

/// The median run of `rows` (same target, scenario and connection count):
/// each figure is the median of its own values; the notes give each
/// figure's range over the runs.
pub fn median_row(rows: &[Row]) -> Option<Row> {
    let first = rows.first()?;
    let range = |v: Vec<f64>, fmt: &dyn Fn(f64) -> String| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{}-{}", fmt(lo), fmt(hi))
    };
    let rps: Vec<f64> = rows.iter().map(|r| r.result.rps).collect();
    let p50: Vec<f64> = rows.iter().map(|r| r.result.p50_us).collect();
    let p99: Vec<f64> = rows.iter().map(|r| r.result.p99_us).collect();
    let cpu: Vec<f64> = rows.iter().filter_map(|r| r.server_cpu_us).collect();
    let db_cpu: Vec<f64> = rows.iter().filter_map(|r| r.db_cpu_us).collect();
    let mut note = format!(
        "median of {}: req/s {} p99 {}",
        rows.len(),
        range(rps.clone(), &|v| format!("{:.1}k", v / 1000.0)),
        range(p99.clone(), &micros)
    );
    if !cpu.is_empty() {
        note.push_str(&format!(" CPU {}us/r", range(cpu.clone(), &|v| format!("{v:.1}"))));
    }
    let requests: Vec<f64> = rows.iter().map(|r| r.result.requests as f64).collect();
    Some(Row {
        target: first.target.clone(),
        scenario: first.scenario.clone(),
        conns: first.conns,
        result: LoadResult {
            requests: median(requests) as u64,
            rps: median(rps),
            p50_us: median(p50),
            p99_us: median(p99),
            status_errors: rows.iter().map(|r| r.result.status_errors).sum(),
            socket_errors: rows.iter().map(|r| r.result.socket_errors).sum(),
        },
        peak_rss_kib: rows.iter().filter_map(|r| r.peak_rss_kib).max(),
        server_cpu_us: (!cpu.is_empty()).then(|| median(cpu)),
        db_cpu_us: (!db_cpu.is_empty()).then(|| median(db_cpu)),
        note,
    })
}

/// The median of `v` (NaN when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
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
