//! SQLite: its kind, migrations, health, clock and the deployment's secret (the [`Lifecycle`] part of the store's contract).

use super::{KIND, SqliteStore, err, now};
use crate::idempotency::record::Timestamp;
use crate::store::StoreError;
use crate::store::contract::Lifecycle;
use crate::store::migrations::{DERIVED_KEY_SECRET, SQLITE, fresh_secret};
use async_trait::async_trait;
use rusqlite::{TransactionBehavior, params};

#[async_trait]
impl Lifecycle for SqliteStore {
    fn kind(&self) -> &'static str {
        KIND
    }

    async fn migrate(&self) -> Result<Vec<String>, StoreError> {
        self.with(|conn| {
            let m = |e: rusqlite::Error| StoreError::Migration(e.to_string());
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(m)?;
            tx.execute_batch(
                "CREATE TABLE IF NOT EXISTS idemgate_schema_migrations (
                    version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL)",
            )
            .map_err(m)?;
            let done: Vec<i64> = {
                let mut st = tx.prepare("SELECT version FROM idemgate_schema_migrations").map_err(m)?;
                st.query_map([], |r| r.get(0)).map_err(m)?.collect::<Result<_, _>>().map_err(m)?
            };
            let mut applied = Vec::new();
            for mig in SQLITE.iter().filter(|mig| !done.contains(&mig.version)) {
                tx.execute_batch(mig.sql).map_err(|e| StoreError::Migration(format!("{}: {e}", mig.name)))?;
                tx.execute(
                    "INSERT INTO idemgate_schema_migrations (version, name, applied_at) VALUES (?1, ?2, ?3)",
                    params![mig.version, mig.name, now().0],
                )
                .map_err(m)?;
                applied.push(mig.name.to_owned());
            }
            let secret = fresh_secret()?;
            tx.execute(
                "INSERT INTO idemgate_settings (name, value, created_at) VALUES (?1, ?2, ?3) ON CONFLICT (name) DO NOTHING",
                params![DERIVED_KEY_SECRET, &secret[..], now().0],
            )
            .map_err(m)?;
            tx.commit().map_err(m)?;
            Ok(applied)
        })
        .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.write(|conn, _| conn.query_row("SELECT count(*) FROM idemgate_schema_migrations", [], |_| Ok(())).map_err(err)).await
    }

    /// Rewrites the database header's `user_version` with the value it
    /// has (idemgate does not use it): a page written and committed with an
    /// fsync, like any claim, without touching a table.
    async fn probe_write(&self) -> Result<(), StoreError> {
        self.write(|conn, _| {
            let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0)).map_err(err)?;
            conn.execute_batch(&format!("PRAGMA user_version = {version}")).map_err(err)
        })
        .await
    }

    async fn now(&self) -> Result<Timestamp, StoreError> {
        Ok(now())
    }

    async fn derived_key_secret(&self) -> Result<Option<Vec<u8>>, StoreError> {
        self.write(move |conn, _| {
            let exists: bool = conn
                .query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'idemgate_settings'", [], |r| r.get(0))
                .map_err(err)?;
            if !exists {
                return Ok(None);
            }
            let mut st = conn.prepare_cached("SELECT value FROM idemgate_settings WHERE name = ?1").map_err(err)?;
            let mut rows = st.query(params![DERIVED_KEY_SECRET]).map_err(err)?;
            match rows.next().map_err(err)? {
                Some(row) => Ok(Some(row.get(0).map_err(err)?)),
                None => Ok(None),
            }
        })
        .await
    }
}
