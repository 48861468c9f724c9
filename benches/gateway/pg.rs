//! The private PostgreSQL cluster (the integration tests' harness,
//! `tests/it/support/postgres.rs`) plus psql and pgbench against it.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result};

use crate::cpu::Cpu;
use crate::pg_harness::{PgServer, SUPERUSER};
use crate::procs;

pub struct Pg {
    server: PgServer,
    psql: PathBuf,
    pgbench: PathBuf,
}

impl Pg {
    /// initdb + start on a free port (as an unprivileged user when root).
    pub fn start() -> Result<Pg> {
        let psql = find_pg_tool("psql")?;
        let pgbench = find_pg_tool("pgbench")?;
        let server = PgServer::start().context("starting a private PostgreSQL (tests/it/support/postgres.rs)")?;
        if let Some(pid) = server.watchdog_pid() {
            procs::register_group(pid);
        }
        Ok(Pg { server, psql, pgbench })
    }

    /// The postmaster and its backends, for CPU accounting.
    pub fn cpu(&self) -> Option<Cpu> {
        self.server.postmaster_pid().map(Cpu::Tree)
    }

    pub fn port(&self) -> u16 {
        self.server.port()
    }

    pub fn create_database(&self, name: &str) -> Result<String> {
        self.server.create_database(name).with_context(|| format!("creating database {name}"))
    }

    /// `ALTER DATABASE db SET name = 'value'` for each setting (new sessions).
    pub fn set_database_settings(&self, db: &str, settings: &[(String, String)]) -> Result<()> {
        for (name, value) in settings {
            self.psql("postgres", &format!("ALTER DATABASE {db} SET {name} = '{}'", value.replace('\'', "''")))?;
        }
        Ok(())
    }

    /// The server's log (all sessions; `log_statement` output lands here).
    pub fn log_path(&self) -> PathBuf {
        self.server.base_dir().join("postgres.log")
    }

    pub fn log_len(&self) -> u64 {
        std::fs::metadata(self.log_path()).map(|m| m.len()).unwrap_or(0)
    }

    /// Runs SQL with psql (unaligned, tuples only); returns stdout.
    pub fn psql(&self, db: &str, sql: &str) -> Result<String> {
        let mut cmd = Command::new(&self.psql);
        cmd.args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"]);
        self.connection_args(&mut cmd, db);
        cmd.arg("-c").arg(sql);
        let out = procs::run_tool_ok(&mut cmd).with_context(|| format!("psql: {}", first_line(sql)))?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Whether `pg_stat_statements` is loaded (`IDEMGATE_TEST_PG_SETTINGS`
    /// with `shared_preload_libraries=pg_stat_statements`): then its
    /// counters of database `db` are reset and `true` is returned.
    pub fn statements_reset(&self, db: &str) -> Result<bool> {
        if !self.psql(db, "SHOW shared_preload_libraries")?.contains("pg_stat_statements") {
            return Ok(false);
        }
        self.psql(db, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")?;
        self.psql(db, "SELECT pg_stat_statements_reset()")?;
        Ok(true)
    }

    /// The `n` statements of database `db` that took the most execution
    /// time since [`Pg::statements_reset`], one line each: calls, rows, total
    /// and mean time, shared blocks hit and read, and the statement's start.
    pub fn statements_top(&self, db: &str, n: u32) -> Result<Vec<String>> {
        let out = self.psql(
            db,
            &format!(
                "SELECT calls || ' calls, ' || rows || ' rows, ' || round(total_exec_time::numeric, 1) || ' ms total, ' \
                    || round((1000 * mean_exec_time)::numeric, 1) || ' us mean, ' \
                    || shared_blks_hit || ' hit ' || shared_blks_read || ' read: ' \
                    || CASE WHEN query LIKE '%INSERT INTO idemgate_event_log %' THEN '[appends events] ' ELSE '' END \
                    || left(regexp_replace(query, '\\s+', ' ', 'g'), 140) \
                 FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
                 WHERE d.datname = current_database() ORDER BY total_exec_time DESC LIMIT {n}"
            ),
        )?;
        Ok(out.lines().map(str::to_owned).collect())
    }

    /// VACUUM ANALYZE and CHECKPOINT: no autovacuum or checkpoint work left
    /// over from earlier load (and fresh statistics).
    pub fn settle(&self, db: &str) -> Result<()> {
        self.psql(db, "VACUUM ANALYZE")?;
        self.psql(db, "CHECKPOINT")?;
        Ok(())
    }

    /// CHECKPOINT only: no checkpoint work left over from earlier load, and
    /// the statistics left as they are.
    pub fn checkpoint(&self, db: &str) -> Result<()> {
        self.psql(db, "CHECKPOINT")?;
        Ok(())
    }

    /// Sequential scans of `idemgate_records` so far (`pg_stat_user_tables`;
    /// backends report at most once a second, so a count can lag a little).
    pub fn records_seq_scans(&self, db: &str) -> Result<u64> {
        let out = self.psql(db, "SELECT coalesce(sum(seq_scan), 0) FROM pg_stat_user_tables WHERE relname = 'idemgate_records'")?;
        out.trim().parse().with_context(|| format!("seq_scan: {out:?}"))
    }

    /// A pgbench command connected to `db`; the caller adds the workload.
    pub fn pgbench(&self, db: &str) -> Command {
        let mut cmd = Command::new(&self.pgbench);
        self.connection_args(&mut cmd, db);
        cmd
    }

    fn connection_args(&self, cmd: &mut Command, db: &str) {
        cmd.args(["-h", "127.0.0.1", "-p"]).arg(self.port().to_string()).args(["-U", SUPERUSER, "-d", db]);
        for var in ["PGPASSWORD", "PGOPTIONS", "PGSERVICE", "PGSSLMODE"] {
            cmd.env_remove(var);
        }
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        // The server itself is stopped by PgServer's Drop (or its watchdog).
        if let Some(pid) = self.server.watchdog_pid() {
            procs::unregister_group(pid);
        }
    }
}

fn first_line(sql: &str) -> &str {
    sql.trim().lines().next().unwrap_or("")
}

/// `$IDEMGATE_TEST_PG_BINDIR/NAME`, else NAME on PATH, else the newest
/// `/usr/lib/postgresql/*/bin/NAME`.
pub fn find_pg_tool(name: &str) -> Result<PathBuf> {
    let candidates = std::env::var_os("IDEMGATE_TEST_PG_BINDIR")
        .map(PathBuf::from)
        .into_iter()
        .chain(std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default())
        .chain(newest_pg_bin_dirs());
    candidates
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .with_context(|| format!("{name} not found (install postgresql-client, or run scripts/bench which does)"))
}

fn newest_pg_bin_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .collect();
    dirs.sort();
    dirs.into_iter().rev().map(|(_, d)| d).collect()
}
