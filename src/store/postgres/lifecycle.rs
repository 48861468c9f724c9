//! PostgreSQL: its kind, migrations, health, clock and the deployment's secret (the [`Lifecycle`] part of the store's contract).

use super::citus::Flavor;
use super::{Conn, PING_BOUND, PgStore, citus, migration_error, replan, up_to_date};
use crate::idempotency::record::Timestamp;
use crate::store::StoreError;
use crate::store::contract::Lifecycle;
use crate::store::migrations::{DERIVED_KEY_SECRET, EVENT_LOG, PG_LOCK_KEY, POSTGRES, fresh_secret};
use async_trait::async_trait;

pub(super) const SETTING: &str = "SELECT value FROM idemgate_settings WHERE name = $1";

/// The readiness write probe: `txid_current()` takes a transaction id, so
/// the statement's commit is written and flushed (the write path of every
/// claim, without a row), and the grants a claim needs are read.
pub(super) const PROBE_WRITE: &str = "SELECT txid_current(), \
     has_table_privilege('idemgate_records', 'INSERT') \
     AND has_table_privilege('idemgate_records', 'UPDATE') \
     AND has_table_privilege('idemgate_records', 'DELETE')";

/// Whether the event log's migrations are recorded as applied but the log
/// is missing: what versions before the `idemgate.store_kind` setting left
/// on a PostgreSQL store whose database has the Citus extension (they
/// skipped the log wherever the extension existed). Those three migrations
/// create only the log, so applying them again makes it.
pub(super) async fn log_skipped(client: &impl deadpool_postgres::GenericClient, done: &[i64]) -> Result<bool, tokio_postgres::Error> {
    if !EVENT_LOG.iter().all(|v| done.contains(v)) {
        return Ok(false);
    }
    let row = client.query_one("SELECT to_regclass('idemgate_event_rotation') IS NULL", &[]).await?;
    row.try_get(0)
}

#[async_trait]
impl Lifecycle for PgStore {
    fn kind(&self) -> &'static str {
        self.flavor.kind()
    }

    async fn migrate(&self) -> Result<Vec<String>, StoreError> {
        // On Citus, on the coordinator whichever host the URL lists first.
        let (mut conn, may_change) = self.reach.conn_for_migrations().await?;
        let m = |e: tokio_postgres::Error| migration_error("", &e);
        // These reads prepare statements: inside a transaction, so that each
        // is closed on the server session that prepared it, behind a pooler
        // in transaction mode too. (On an early return the connection is
        // discarded, never pooled mid-transaction.)
        conn.client().batch_execute("BEGIN READ ONLY").await.map_err(m)?;
        // The right kind of server and schema for this flavor, or the
        // start-up error that says which (see `citus`).
        let found = citus::inspect(conn.client()).await.map_err(m)?;
        citus::check(self.flavor, found)?;
        // Up to date: nothing is locked, created or written, so a runtime
        // role without the right to change the schema starts (and the server
        // sends no "already exists, skipping" notice at every start).
        let current = up_to_date(&conn, self.flavor).await?;
        conn.client().batch_execute("COMMIT").await.map_err(m)?;
        if current {
            conn.done();
            return Ok(Vec::new());
        }
        if !may_change {
            return Err(StoreError::Unavailable(
                "the schema needs migrating and none of the hosts in store.url answered as the Citus coordinator \
                 (citus_is_coordinator()); migrations run there only"
                    .into(),
            ));
        }
        let tx = conn.client_mut().transaction().await.map_err(m)?;
        // Migrations may take longer than one protocol statement.
        // Custom plans, whichever pool the connection is from (a Citus node's
        // pool keeps generic plans, which Citus refuses for some statements).
        // READ COMMITTED whatever the default: the versions applied are read
        // after the advisory lock, and must include what a migrator that
        // held it before committed.
        tx.batch_execute(
            "SET LOCAL transaction_isolation = 'read committed'; SET LOCAL statement_timeout = 0; SET LOCAL plan_cache_mode = force_custom_plan",
        )
        .await
        .map_err(m)?;
        if self.flavor == Flavor::Citus {
            // Schema changes on every shard with Citus's own parallelism, not
            // the one connection per node the store's sessions keep
            // (`sql::CITUS_SETTINGS`): a node's shards one after another would
            // hold the tables' locks that many times longer.
            tx.batch_execute("SET LOCAL citus.max_adaptive_executor_pool_size TO DEFAULT").await.map_err(m)?;
        }
        // The migrations that differ by kind read it (the event log, on
        // PostgreSQL only, also where the Citus extension merely exists).
        tx.batch_execute(&format!("SET LOCAL idemgate.store_kind = '{}'", self.flavor.kind())).await.map_err(m)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&PG_LOCK_KEY]).await.map_err(m)?;
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS idemgate_schema_migrations (
                version bigint PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .await
        .map_err(m)?;
        let done: Vec<i64> =
            tx.query("SELECT version FROM idemgate_schema_migrations", &[]).await.map_err(m)?.iter().map(|r| r.get(0)).collect();
        // The log's migrations are applied again where an earlier version
        // recorded them but created nothing (see `log_skipped`).
        let redo = self.flavor == Flavor::Postgres && log_skipped(&tx, &done).await.map_err(m)?;
        if redo {
            tracing::warn!(
                "the event log's migrations were recorded without creating it (an earlier version, on a database with the Citus extension): applying them now"
            );
        }
        let mut applied = Vec::new();
        for mig in POSTGRES.iter().filter(|mig| !done.contains(&mig.version) || (redo && EVENT_LOG.contains(&mig.version))) {
            tx.batch_execute(mig.sql).await.map_err(|e| migration_error(mig.name, &e))?;
            tx.execute(
                "INSERT INTO idemgate_schema_migrations (version, name) VALUES ($1, $2) ON CONFLICT (version) DO NOTHING",
                &[&mig.version, &mig.name],
            )
            .await
            .map_err(m)?;
            applied.push(mig.name.to_owned());
        }
        if self.flavor == Flavor::Citus {
            applied.extend(citus::migrate(&tx, &done).await.map_err(|(name, e)| migration_error(&name, &e))?);
        }
        // The derived-key secret, once per deployment: every replica reads
        // the same row.
        let secret = fresh_secret()?;
        tx.execute(
            "INSERT INTO idemgate_settings (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
            &[&DERIVED_KEY_SECRET, &&secret[..]],
        )
        .await
        .map_err(m)?;
        tx.commit().await.map_err(m)?;
        conn.done();
        Ok(applied)
    }

    /// Ready means connected to a primary that takes writes, within
    /// `PING_BOUND`. A ping that runs out of time, or reaches a read-only
    /// server, lets go of the pooled connections (see `failover`).
    async fn ping(&self) -> Result<(), StoreError> {
        let probe = self.query("SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'", &[], false);
        let Ok(rows) = tokio::time::timeout(PING_BOUND, probe).await else {
            self.db.flush.now(&self.db.pool, "the database did not answer a ping in time");
            return Err(StoreError::Unavailable(format!("the database did not answer a ping within {PING_BOUND:?}")));
        };
        let rows = rows?;
        let read_only: bool = rows.first().and_then(|r| r.try_get(0).ok()).unwrap_or(true);
        if read_only {
            self.db.flush.now(&self.db.pool, "the server is read-only");
            return Err(StoreError::Unavailable("connected to a read-only server (a standby, or a fenced primary)".into()));
        }
        Ok(())
    }

    /// One autocommit statement that takes a transaction id (so its commit
    /// is written and flushed like a claim's) and asks whether this role may
    /// write the records.
    async fn probe_write(&self) -> Result<(), StoreError> {
        let rows = self.query(PROBE_WRITE, &[], true).await?;
        let may_write: bool = rows.first().and_then(|r| r.try_get(1).ok()).unwrap_or(false);
        if !may_write {
            return Err(StoreError::Unavailable(
                "the database role may not insert, update and delete in idemgate_records (see the grants in docs/operations.md)".into(),
            ));
        }
        Ok(())
    }

    async fn now(&self) -> Result<Timestamp, StoreError> {
        let rows = self.query("SELECT now()", &[], false).await?;
        let row = rows.first().ok_or_else(|| StoreError::Corrupt("SELECT now() returned no row".into()))?;
        row.try_get(0).map_err(|e| StoreError::Corrupt(e.to_string()))
    }

    async fn derived_key_secret(&self) -> Result<Option<Vec<u8>>, StoreError> {
        let rows = self.query(SETTING, &[&DERIVED_KEY_SECRET], false).await;
        match rows {
            Ok(rows) => rows.first().map(|r| r.try_get(0).map_err(|e| StoreError::Corrupt(e.to_string()))).transpose(),
            // Before migration 2 the table does not exist: no secret yet.
            Err(StoreError::Unavailable(m)) if m.contains("42P01") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Citus plans each execution and keeps its tables on the workers, and
    /// behind a transaction-mode pooler each statement is planned as it
    /// runs: nothing to keep fit there.
    fn caches_plans(&self) -> bool {
        self.flavor == Flavor::Postgres && !self.db.sessions.per_transaction()
    }

    /// The settings read back on two sessions at once. Two sessions open at
    /// the same time are two server sessions, directly or behind a pooler
    /// in session mode; when both answer from one (same process, same
    /// server start), a pooler in transaction mode is passing them around
    /// and settings set once per session are not in force.
    async fn check_sessions(&self) -> Result<crate::store::SessionReport, StoreError> {
        let sessions = &self.db.sessions;
        let mut report = crate::store::SessionReport { note: sessions.describe(), problems: Vec::new() };
        let first = self.conn().await?;
        // A pool of one has no second session to compare with.
        let second = if self.db.pool.status().max_size > 1 { Some(self.conn().await?) } else { None };
        let (mut servers, mut held) = (Vec::new(), Vec::new());
        for conn in std::iter::once(first).chain(second) {
            let look = match sessions.look(conn.client()).await {
                Ok(look) => look,
                Err(e) => return Err(self.db.failed(conn, e, false).0),
            };
            for problem in look.not_in_force {
                if !report.problems.contains(&problem) {
                    report.problems.push(problem);
                }
            }
            servers.push(look.server);
            // Both held until both have answered.
            held.push(conn);
        }
        held.into_iter().for_each(Conn::done);
        if !sessions.per_transaction() && servers.len() == 2 && servers[0] == servers[1] {
            report.problems.insert(
                0,
                "two sessions open at once were served by one server session: a connection pooler in transaction mode sits \
                 between idemgate and PostgreSQL, and settings made once per session are not in force; set \
                 store.pooler = \"transaction\""
                    .to_owned(),
            );
        }
        Ok(report)
    }

    /// See `replan`.
    async fn refresh_plans(&self) -> Result<(), StoreError> {
        if !self.caches_plans() {
            return Ok(());
        }
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let looks = self
            .query(replan::TABLE_LOOK, &[], false)
            .await?
            .iter()
            .map(|row| {
                Ok(replan::Look {
                    table: row.try_get(0).map_err(c)?,
                    rows: row.try_get(1).map_err(c)?,
                    pages: row.try_get(2).map_err(c)?,
                    changed: row.try_get(3).map_err(c)?,
                    may_analyze: row.try_get(4).map_err(c)?,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        for table in self.db.replan.saw(&looks) {
            // A table that another session is vacuuming or analyzing is
            // skipped (a notice, not an error); the next look tries again.
            self.db.utility(&format!("ANALYZE (SKIP_LOCKED) {table}")).await?;
            tracing::info!(table, "analyzed a table whose statistics said it was tiny while it filled");
        }
        Ok(())
    }
}
