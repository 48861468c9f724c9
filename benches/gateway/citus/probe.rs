//! Where a Citus cluster's database CPU goes (issue 47): the cost of the
//! gateways' background work with no load, and the statements each node
//! runs per request.
//!
//! All Citus targets share one cluster, so while one target is measured
//! the others' gateways are stopped (SIGSTOP, [`Paused`]): their background
//! work (sweeper, reaper, record counter, relay, shard-map refresh) would
//! otherwise be counted in the measured target's CPU.
//!
//! - [`idle`]: with no load, the database CPU per second of each target's
//!   gateways alone (the others stopped) and of none (every gateway
//!   stopped), per node: `IDEMGATE_BENCH_CITUS_IDLE_SECS` [10] each.
//! - [`Statements`]: with `pg_stat_statements` loaded on every node
//!   (`IDEMGATE_TEST_PG_SETTINGS=shared_preload_libraries=citus,pg_stat_statements
//!   pg_stat_statements.track=all`), `IDEMGATE_BENCH_CITUS_STATEMENTS=N`
//!   prints after each measured run the N statements each node ran most
//!   often, in calls per request.

use anyhow::Result;

use super::{Db, Target};
use crate::cpu::Cpu;
use crate::procs;
use crate::suite::Ctx;

/// Gateways stopped with SIGSTOP; continued when dropped.
pub struct Paused(Vec<u32>);

impl Paused {
    /// Stops the gateways of every target but `keep` (`None`: all).
    pub fn all_but(targets: &[Target], keep: Option<usize>) -> Paused {
        let pids: Vec<u32> =
            targets.iter().enumerate().filter(|(i, _)| Some(*i) != keep).flat_map(|(_, t)| t.gws.iter().map(|g| g.pid())).collect();
        for &pid in &pids {
            procs::pause(pid, true);
        }
        Paused(pids)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        for &pid in &self.0 {
            procs::pause(pid, false);
        }
    }
}

/// CPU seconds per second of each process set over `secs` seconds.
fn rate(cpus: &[Cpu], secs: u32) -> Result<Vec<f64>> {
    let before: Vec<f64> = cpus.iter().map(Cpu::seconds).collect();
    let began = std::time::Instant::now();
    procs::sleep(std::time::Duration::from_secs(u64::from(secs)))?;
    let took = began.elapsed().as_secs_f64();
    Ok(cpus.iter().zip(before).map(|(c, b)| (c.seconds() - b) / took).collect())
}

fn ms(v: &[f64]) -> String {
    v.iter().map(|c| format!("{:.1}", c * 1e3)).collect::<Vec<_>>().join("/")
}

/// The idle cost, one line per target: its database's CPU per second with
/// only its gateways running, per node, and with every gateway stopped.
pub fn idle(ctx: &mut Ctx, targets: &[Target]) -> Result<()> {
    let secs: u32 = crate::env_num("IDEMGATE_BENCH_CITUS_IDLE_SECS", 10)?;
    if secs == 0 {
        return Ok(());
    }
    ctx.progress(&format!("citus: the idle cost, {secs} s per target"));
    let mut parts = Vec::new();
    let statements = Statements::wanted()?;
    for (i, t) in targets.iter().enumerate() {
        let _paused = Paused::all_but(targets, Some(i));
        procs::sleep(std::time::Duration::from_secs(1))?;
        if let Some(s) = &statements {
            s.reset(&t.db)?;
        }
        let mut cpus: Vec<Cpu> = t.gws.iter().map(|g| g.cpu()).collect();
        cpus.extend(t.db_cpus.iter().copied());
        let sessions_before = sessions(&t.db)?;
        let r = rate(&cpus, secs)?;
        let new_sessions: Vec<String> =
            sessions(&t.db)?.iter().zip(sessions_before).map(|(a, b)| format!("{:.1}", (a - b) / f64::from(secs))).collect();
        if let Some(s) = &statements {
            s.report(ctx, &format!("{} idle (per second, not per request)", t.name), &t.db, u64::from(secs))?;
        }
        let (gw, db) = r.split_at(t.gws.len());
        parts.push(format!(
            "{}: db {:.1} ms/s ({}) gateways {:.1} ms/s, new database sessions {}/s",
            t.name,
            db.iter().sum::<f64>() * 1e3,
            ms(db),
            gw.iter().sum::<f64>() * 1e3,
            new_sessions.join("/")
        ));
    }
    if let Some(cluster) = targets.iter().find(|t| matches!(t.db, Db::Citus(..))) {
        let _paused = Paused::all_but(targets, None);
        procs::sleep(std::time::Duration::from_secs(1))?;
        let db = rate(&cluster.db_cpus, secs)?;
        parts.push(format!("cluster, every gateway stopped: db {:.1} ms/s ({})", db.iter().sum::<f64>() * 1e3, ms(&db)));
    }
    ctx.report.line(format!("citus idle (no load; CPU per second of wall time, per node coordinator/worker/worker): {}", parts.join("; ")));
    Ok(())
}

/// Sessions each node of `db` has started so far (`pg_stat_database`, every
/// database: Citus's connections between nodes included).
fn sessions(db: &Db) -> Result<Vec<f64>> {
    let mut out = Vec::new();
    for_each_node(db, |node| {
        let rows = node("SELECT sum(sessions) FROM pg_stat_database")?;
        out.push(rows.first().and_then(|r| r.first().cloned().flatten()).and_then(|v| v.parse().ok()).unwrap_or(f64::NAN));
        Ok(())
    })?;
    Ok(out)
}

/// `pg_stat_statements` on a target's nodes around a measured run.
pub struct Statements {
    top: u32,
}

impl Statements {
    /// `IDEMGATE_BENCH_CITUS_STATEMENTS=N` (N > 0).
    pub fn wanted() -> Result<Option<Statements>> {
        let top: u32 = crate::env_num("IDEMGATE_BENCH_CITUS_STATEMENTS", 0)?;
        Ok((top > 0).then_some(Statements { top }))
    }

    /// Counters of the target's database reset on each node.
    pub fn reset(&self, db: &Db) -> Result<()> {
        for_each_node(db, |node| {
            node(
                "SET citus.enable_ddl_propagation = off; CREATE EXTENSION IF NOT EXISTS pg_stat_statements; \
                 SELECT pg_stat_statements_reset()",
            )
            .map(drop)
        })
    }

    /// The most called statements of each node, in calls per request.
    pub fn report(&self, ctx: &mut Ctx, label: &str, db: &Db, requests: u64) -> Result<()> {
        let per = requests.max(1) as f64;
        let sql = format!(
            "SELECT s.calls, s.rows, round((s.total_exec_time * 1000 / greatest(s.calls, 1))::numeric, 1), \
                    left(regexp_replace(s.query, '\\s+', ' ', 'g'), 160) \
             FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
             WHERE d.datname = current_database() ORDER BY s.calls DESC LIMIT {}",
            self.top
        );
        let mut node_no = 0;
        let mut lines = Vec::new();
        for_each_node(db, |node| {
            let rows = node(&sql)?;
            let total: f64 = rows.iter().filter_map(|r| r.first().cloned().flatten()?.parse::<f64>().ok()).sum();
            lines.push(format!("{label} node {node_no}: top {} statements, {:.2} calls per request", rows.len(), total / per));
            for r in rows {
                let f = |i: usize| r.get(i).cloned().flatten().unwrap_or_default();
                let calls: f64 = f(0).parse().unwrap_or(0.0);
                let rows_: f64 = f(1).parse().unwrap_or(0.0);
                lines.push(format!("    {:.3}/r  rows/call {:.1}  {} us mean  {}", calls / per, rows_ / calls.max(1.0), f(2), f(3)));
            }
            node_no += 1;
            Ok(())
        })?;
        for l in lines {
            ctx.report.line(l);
        }
        Ok(())
    }
}

type Rows = Vec<Vec<Option<String>>>;

/// `f` with a query function for each node of `db` (one for one PostgreSQL).
fn for_each_node(db: &Db, mut f: impl FnMut(&dyn Fn(&str) -> Result<Rows>) -> Result<()>) -> Result<()> {
    match db {
        Db::Pg(pg, name) => f(&|sql: &str| {
            let out = pg.psql(name, &sql.replace("SET citus.enable_ddl_propagation = off; ", ""))?;
            Ok(out.lines().map(|l| l.split('|').map(|c| Some(c.to_owned())).collect()).collect())
        }),
        Db::Citus(cluster, name) => {
            for node in cluster.nodes() {
                f(&|sql: &str| Ok(node.simple_query(name, sql)?))?;
            }
            Ok(())
        }
    }
}
