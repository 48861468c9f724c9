//! The store's sessions, directly or behind a connection pooler
//! (`store.pooler`; docs/operations.md, "Behind a connection pooler").
//!
//! Every session needs its settings ([`sql::session_settings`] and
//! `statement_timeout`). They are never sent as the `options` startup
//! parameter, which PgBouncer refuses ("unsupported startup parameter").
//!
//! - **`none` and `session`**: the settings are `SET` once, when a connection
//!   is made (a session pooler resets them with its `server_reset_query`,
//!   `DISCARD ALL`, when the connection leaves), and each statement is
//!   prepared once per connection and kept (`prepare_cached`): the fastest
//!   path, one round trip per statement.
//! - **`transaction`**: a server session belongs to the connection for one
//!   transaction only, so nothing may outlive one: each statement is sent in
//!   one write as `BEGIN; SET LOCAL ...` (a simple query), the statement as
//!   the unnamed prepared statement (`query_typed`, parsed and planned for
//!   this execution), and `COMMIT`. Still one round trip, and nothing is left
//!   behind on the server session. The parameter types `query_typed` names
//!   are learned once per statement, by preparing it inside a transaction
//!   that closes it before it ends. The store's own transactions start with
//!   the same `SET LOCAL`s ([`Sessions::local`]).
//!
//! [`Sessions::look`] reads back what a session has in force; `serve` (at
//! start) and `check-config --connect` report any setting that is not, and a
//! pooler in transaction mode behind `none` or `session`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_postgres::{Hook, HookError};
use futures_util::future::{join, join3};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row, SimpleQueryMessage};

use super::{Flavor, sql};
use crate::store::Pooler;

/// Most statement texts whose parameter types are remembered; past it the
/// memory starts again (the store sends a few dozen).
const MAX_KNOWN: usize = 1024;

/// How the store's sessions get their settings and send their statements.
#[derive(Debug)]
pub(super) struct Sessions {
    pooler: Pooler,
    /// `name`, value as `pg_settings.setting` shows it, in the order sent.
    settings: Vec<(&'static str, String)>,
    /// `SET a = 'x'; SET b = 'y'` (`none`, `session`), or
    /// `SET LOCAL a = 'x'; ...` (`transaction`).
    set: String,
    /// `BEGIN; SET LOCAL ...` (`transaction`).
    begin: String,
    /// Parameter types per statement text (`transaction`).
    types: Mutex<HashMap<String, Arc<[Type]>>>,
}

impl Sessions {
    pub(super) fn new(pooler: Pooler, flavor: Flavor, timeout: Duration) -> Sessions {
        Sessions::with(pooler, sql::session_settings(flavor), timeout)
    }

    /// Sessions with these settings (and `statement_timeout`).
    pub(super) fn with(pooler: Pooler, settings: Vec<(&'static str, &'static str)>, timeout: Duration) -> Sessions {
        let mut settings: Vec<(&'static str, String)> = settings.into_iter().map(|(name, value)| (name, value.to_owned())).collect();
        // READ COMMITTED, whatever the role's or database's default: a
        // claim's `INSERT ... ON CONFLICT` that meets a key another
        // transaction committed after the statement began takes that row
        // as the one it met, and the takes' `SKIP LOCKED` reads move on;
        // under REPEATABLE READ both fail with 40001 (a spurious 503 for
        // the claim). In transaction mode the `SET LOCAL` comes right after
        // `BEGIN`, before any snapshot, where it sets that transaction's.
        let isolation = if pooler == Pooler::Transaction { "transaction_isolation" } else { "default_transaction_isolation" };
        settings.push((isolation, "read committed".to_owned()));
        // statement_timeout: a statement the gateway gave up on (its operation
        // timed out, so it answered and may have abandoned a claim) must not
        // go on and commit later; the server cancels it at the same bound.
        settings.push(("statement_timeout", timeout.as_millis().max(1).to_string()));
        let local = if pooler == Pooler::Transaction { "SET LOCAL" } else { "SET" };
        let set = settings.iter().map(|(name, value)| format!("{local} {name} = '{value}'")).collect::<Vec<_>>().join("; ");
        let begin = format!("BEGIN; {set}");
        Sessions { pooler, settings, set, begin, types: Mutex::default() }
    }

    /// Whether every statement is its own transaction with its own settings.
    pub(super) fn per_transaction(&self) -> bool {
        self.pooler == Pooler::Transaction
    }

    /// The pool's post-create hook: a new connection's session settings
    /// (none in transaction mode, where each transaction sets its own).
    pub(super) fn hook(sessions: Arc<Sessions>) -> Hook {
        Hook::async_fn(move |client, _| {
            let sessions = sessions.clone();
            Box::pin(async move {
                if !sessions.per_transaction() {
                    client.batch_execute(&sessions.set).await.map_err(HookError::Backend)?;
                }
                Ok(())
            })
        })
    }

    /// The `SET LOCAL`s that begin one of the store's own transactions, in
    /// transaction mode (the session has them otherwise).
    pub(super) fn local(&self) -> Option<&str> {
        self.per_transaction().then_some(self.set.as_str())
    }

    /// One statement in transaction mode: `BEGIN; SET LOCAL ...`, the
    /// statement unnamed, `COMMIT`, written together (see the module doc).
    pub(super) async fn query(
        &self,
        client: &Client,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        let types = match self.known(sql) {
            Some(types) => types,
            None => self.learn(client, sql).await?,
        };
        let typed: Vec<(&(dyn ToSql + Sync), Type)> = params.iter().copied().zip(types.iter().cloned()).collect();
        // join3 polls in order, and each request is queued on its first poll:
        // the three go out in this order, in one write.
        let (begun, rows, committed) =
            join3(client.batch_execute(&self.begin), client.query_typed(sql, &typed), client.batch_execute("COMMIT")).await;
        // BEGIN refused: nothing ran. The statement refused (a deadlock,
        // say): COMMIT rolled back. COMMIT itself not answered: ambiguous,
        // as any write whose commit went unanswered.
        begun?;
        let rows = rows?;
        committed?;
        Ok(rows)
    }

    fn known(&self, sql: &str) -> Option<Arc<[Type]>> {
        self.types.lock().ok()?.get(sql).cloned()
    }

    /// The parameter types of `sql`, prepared inside a transaction: the
    /// prepared statement is closed before the transaction ends, so no
    /// server session keeps it.
    async fn learn(&self, client: &Client, sql: &str) -> Result<Arc<[Type]>, tokio_postgres::Error> {
        let (begun, prepared) = join(client.batch_execute("BEGIN"), client.prepare(sql)).await;
        // Dropping the statement queues its Close before the ROLLBACK.
        let types: Result<Arc<[Type]>, _> = prepared.map(|statement| statement.params().into());
        let ended = client.batch_execute("ROLLBACK").await;
        begun?;
        let types = types?;
        ended?;
        if let Ok(mut known) = self.types.lock() {
            if known.len() >= MAX_KNOWN {
                known.clear();
            }
            known.insert(sql.to_owned(), types.clone());
        }
        Ok(types)
    }

    /// What one session has in force: its server process (pid and the
    /// server's start time, which together name one server session), and
    /// each setting the store relies on that differs from what was set.
    /// Simple queries only: safe behind any pooler, whatever the mode.
    pub(super) async fn look(&self, client: &Client) -> Result<SessionLook, tokio_postgres::Error> {
        let names = self.settings.iter().map(|(name, _)| format!("'{name}'")).collect::<Vec<_>>().join(", ");
        let look = format!(
            "SELECT pg_backend_pid()::text || '@' || pg_postmaster_start_time()::text, name, setting FROM pg_settings WHERE name IN ({names})"
        );
        let text = if self.per_transaction() { format!("{}; {look}; COMMIT", self.begin) } else { look };
        let mut found = SessionLook::default();
        let mut seen = HashMap::new();
        for message in client.simple_query(&text).await? {
            if let SimpleQueryMessage::Row(row) = message {
                found.server = row.get(0).unwrap_or_default().to_owned();
                seen.insert(row.get(1).unwrap_or_default().to_owned(), row.get(2).unwrap_or_default().to_owned());
            }
        }
        for (name, wanted) in &self.settings {
            match seen.get(*name) {
                Some(value) if value == wanted => {}
                value => found.not_in_force.push(format!("{name} is {} instead of {wanted}", value.map_or("unknown", String::as_str))),
            }
        }
        Ok(found)
    }

    /// The settings, as a note: `plan_cache_mode=..., statement_timeout=5000ms`.
    pub(super) fn describe(&self) -> String {
        let how = match self.pooler {
            Pooler::Transaction => "per transaction (store.pooler = \"transaction\")",
            Pooler::Session => "per session (store.pooler = \"session\")",
            Pooler::None => "per session",
        };
        let list = self
            .settings
            .iter()
            .map(|(name, value)| if *name == "statement_timeout" { format!("{name}={value}ms") } else { format!("{name}={value}") })
            .collect::<Vec<_>>()
            .join(", ");
        format!("{list} in force {how}")
    }
}

/// What [`Sessions::look`] read from one session.
#[derive(Debug, Default)]
pub(super) struct SessionLook {
    /// `pid@server start time`: one server session.
    pub(super) server: String,
    /// `name is x instead of y`, for each setting not in force.
    pub(super) not_in_force: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Behind a transaction-mode pooler nothing may outlive a transaction,
    /// and every transaction needs the settings: so the store's code
    /// begins its transactions through `Db::transaction` (which adds the
    /// `SET LOCAL`s), and keeps a prepared statement (`prepare_cached`) only
    /// on a path that a transaction-mode pooler never takes. A read of the
    /// sources, not of behaviour (tests/it/pooler.rs has that): the places
    /// allowed are counted, so a new one must be looked at and added here.
    #[test]
    fn store_transactions_begin_with_their_settings_and_keep_no_statement_behind_a_transaction_pooler() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/store/postgres");
        let allowed = |file: &str, what: &str| match (file, what) {
            // `Db::transaction` itself, and migrations (their own settings:
            // no statement timeout, custom plans).
            ("mod.rs" | "lifecycle.rs", "client_mut().transaction()") => 1,
            // `query_text`, after its per-transaction branch returned.
            ("mod.rs", "prepare_cached(") => 1,
            // `citus_batch::draw`, when the sessions are not per transaction.
            ("citus_batch.rs", "prepare_cached(") => 1,
            _ => 0,
        };
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&dir).expect("src/store/postgres") {
            let path = entry.expect("entry").path();
            let file = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
            let text = std::fs::read_to_string(&path).expect("source");
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            for what in ["client_mut().transaction()", "prepare_cached("] {
                let n = code.lines().filter(|l| !l.trim_start().starts_with("//")).map(|l| l.matches(what).count()).sum::<usize>();
                if n != allowed(&file, what) {
                    found.push(format!("{file}: {what} {n} times, {} allowed", allowed(&file, what)));
                }
            }
        }
        assert!(found.is_empty(), "{found:#?}");
    }

    #[test]
    fn settings_are_set_per_session_or_per_transaction() {
        let direct = Sessions::new(Pooler::None, Flavor::Postgres, Duration::from_millis(2500));
        assert!(!direct.per_transaction());
        assert!(direct.set.starts_with("SET plan_cache_mode = 'force_generic_plan'; SET enable_seqscan = 'off'"), "{}", direct.set);
        assert!(direct.set.ends_with("SET statement_timeout = '2500'"), "{}", direct.set);
        assert_eq!(direct.local(), None);
        let pooled = Sessions::new(Pooler::Transaction, Flavor::Citus, Duration::from_secs(5));
        assert!(pooled.per_transaction());
        assert!(
            pooled.begin.starts_with("BEGIN; SET LOCAL plan_cache_mode = 'force_custom_plan'; SET LOCAL enable_seqscan"),
            "{}",
            pooled.begin
        );
        assert!(pooled.local().is_some_and(|l| l.ends_with("SET LOCAL statement_timeout = '5000'")));
        assert!(direct.set.contains("SET default_transaction_isolation = 'read committed'"), "{}", direct.set);
        assert!(pooled.begin.contains("SET LOCAL transaction_isolation = 'read committed'"), "{}", pooled.begin);
        assert!(pooled.describe().contains("statement_timeout=5000ms in force per transaction"), "{}", pooled.describe());
    }
}
