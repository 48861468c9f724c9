//! The embedded backend: SQLite in WAL mode with `synchronous = FULL`, for a
//! single replica. Each protocol step is one `BEGIN IMMEDIATE` transaction
//! whose decisions are made by the pure functions in `crate::idempotency::record` — the
//! same rules PostgreSQL's statements encode — so both backends pass the same
//! conformance suite. One writer thread (`idemgate-sqlite`) owns the
//! connection: protocol steps are queued to it and each batch of them runs in
//! one transaction (a savepoint per step, one commit and fsync per batch), so
//! no SQLite call blocks a tokio thread; only opening the file runs on tokio's
//! blocking pool. The clock is this process's system clock: with one replica
//! it is the only clock there is.

// One file per concern of the store contract, one impl each.
mod events;
mod lifecycle;
mod queue;
mod reconcile;
mod records;
mod trail;

use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::oneshot;

use bytes::Bytes;
use rusqlite::{Connection, TransactionBehavior, params};
use uuid::Uuid;

use super::codec::{RECORD_COLUMNS, RecordRow, col, encode_headers};
use super::contract::Events;
use super::{Access, EventStats, StoreError};
use crate::idempotency::key::{IdempotencyKey, Scope};
use crate::idempotency::record::Retention;
use crate::idempotency::record::{Event, Generation, Next, Record, StoredResponse, Timestamp, transition};
use crate::outbox::{Delivery, EventType, OutboxEvent};
use async_trait::async_trait;

const KIND: &str = "sqlite";

const PK: &str = "tenant = ?1 AND principal = ?2 AND operation = ?3 AND idempotency_key = ?4";

#[derive(Debug)]
pub struct SqliteStore {
    /// The writer thread's queue: it owns the connection. Bounded
    /// ([`QUEUE_CAPACITY`]): a write that finds it full is refused at once
    /// (`Unavailable`: nothing was written) rather than queued without limit.
    jobs: mpsc::SyncSender<Job>,
    path: PathBuf,
    /// Held for the process's life by `serve`/`demo`: one replica per file.
    _lock: Option<File>,
}

/// Delivers a job's result once its batch has committed (or failed to).
type Completion = Box<dyn FnOnce(Result<(), StoreError>) + Send>;

/// A job for the current batch: runs under its own savepoint, says whether it
/// succeeded (else its savepoint is rolled back) and how to deliver its result
/// after the commit.
type BatchJob = Box<dyn FnOnce(&Connection, Timestamp) -> (bool, Completion) + Send>;

/// Work for the writer thread.
enum Job {
    /// Runs inside the current batch's transaction, under its own savepoint;
    /// says whether it succeeded (else its savepoint is rolled back) and how
    /// to deliver its result after the commit.
    InBatch(BatchJob),
    /// Runs alone, with the connection to itself (migrations).
    Alone(Box<dyn FnOnce(&mut Connection) + Send>),
}

/// Most jobs one transaction carries.
const MAX_BATCH: usize = 256;
/// Writes waiting for the writer thread, at most. Each in-flight request
/// waits for one or two; a burst beyond this is answered 503
/// `store-unavailable` (nothing claimed) instead of growing memory and
/// latency without bound.
const QUEUE_CAPACITY: usize = 4096;

fn now() -> Timestamp {
    let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    Timestamp(i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

fn err(e: rusqlite::Error) -> StoreError {
    StoreError::Unavailable(format!("sqlite: {e}"))
}

fn pk(scope: &Scope) -> [&str; 4] {
    [&scope.tenant, &scope.principal, &scope.operation, scope.key.as_str()]
}

impl SqliteStore {
    pub async fn open(path: &Path, access: Access) -> Result<SqliteStore, StoreError> {
        let path = path.to_owned();
        tokio::task::spawn_blocking(move || SqliteStore::open_blocking(&path, access))
            .await
            .map_err(|e| StoreError::Unavailable(format!("sqlite open task failed: {e}")))?
    }

    fn open_blocking(path: &Path, access: Access) -> Result<SqliteStore, StoreError> {
        SqliteStore::open_with_queue(path, access, QUEUE_CAPACITY)
    }

    fn open_with_queue(path: &Path, access: Access, capacity: usize) -> Result<SqliteStore, StoreError> {
        if access == Access::Existing {
            check_existing(path)?;
        }
        let exclusive = access == Access::Serve;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // Directories created here are the owner's alone, like the files.
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| StoreError::Unavailable(format!("cannot create directory {}: {e}", dir.display())))?;
        }
        let lock = if exclusive {
            let lock_path = lock_path(path);
            let file = File::options()
                .create(true)
                .truncate(false)
                .write(true)
                .mode(0o600)
                .open(&lock_path)
                .map_err(|e| StoreError::Unavailable(format!("cannot open {}: {e}", lock_path.display())))?;
            if file.try_lock().is_err() {
                return Err(StoreError::Locked(format!(
                    "the embedded store {} is in use by another idemgate process (lock file {}); \
                     SQLite serves one replica — run several replicas on PostgreSQL",
                    path.display(),
                    lock_path.display()
                )));
            }
            Some(file)
        } else {
            None
        };
        owner_only(path)?;
        let conn = Connection::open(path).map_err(|e| StoreError::Unavailable(format!("cannot open {}: {e}", path.display())))?;
        conn.busy_timeout(Duration::from_secs(5)).map_err(err)?;
        conn.pragma_update(None, "journal_mode", "WAL").map_err(err)?;
        // FULL: a commit is on disk before it is acknowledged, so a claim
        // survives a process kill and a power loss.
        conn.pragma_update(None, "synchronous", "FULL").map_err(err)?;
        conn.pragma_update(None, "foreign_keys", "ON").map_err(err)?;
        // Deleted and overwritten content (a stored request set to NULL, a
        // swept record with its credentials) is zeroed, not left in free
        // space; the sweeper's checkpoint then empties the WAL of the old
        // page images (`SqliteStore::sweep`).
        conn.pragma_update(None, "secure_delete", "ON").map_err(err)?;
        let (jobs, queue) = mpsc::sync_channel(capacity);
        std::thread::Builder::new()
            .name("idemgate-sqlite".into())
            .spawn(move || writer(conn, queue))
            .map_err(|e| StoreError::Unavailable(format!("cannot start the sqlite writer thread: {e}")))?;
        Ok(SqliteStore { jobs, path: path.to_owned(), _lock: lock })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Hands `job` to the writer thread, or refuses it when the queue is full
    /// (nothing ran, so the caller's write certainly did not happen).
    fn enqueue(&self, job: Job) -> Result<(), StoreError> {
        self.jobs.try_send(job).map_err(|e| match e {
            mpsc::TrySendError::Full(_) => StoreError::Unavailable(format!(
                "the embedded store's write queue is full ({QUEUE_CAPACITY} writes waiting for the disk); retry shortly"
            )),
            mpsc::TrySendError::Disconnected(_) => StoreError::Unavailable("the sqlite writer thread is gone".into()),
        })
    }

    /// Runs `f` alone on the writer thread (for migrations).
    async fn with<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let (reply, rx) = oneshot::channel();
        let job = Job::Alone(Box::new(move |conn| {
            let _ = reply.send(f(conn));
        }));
        self.enqueue(job)?;
        rx.await.unwrap_or_else(|_| Err(StoreError::Ambiguous("the sqlite writer thread ended without an answer".into())))
    }

    /// Runs `f` in the writer thread's next transaction, together with every
    /// other job queued meanwhile (group commit: one fsync for the batch).
    /// The result is delivered only after the COMMIT; a failed COMMIT is
    /// ambiguous for every job in the batch.
    async fn write<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection, Timestamp) -> Result<T, StoreError> + Send + 'static,
    {
        let (reply, rx) = oneshot::channel();
        let job = Job::InBatch(Box::new(move |conn, now| {
            let result = f(conn, now);
            let ok = result.is_ok();
            let completion: Completion = Box::new(move |committed| {
                let _ = reply.send(committed.and(result));
            });
            (ok, completion)
        }));
        self.enqueue(job)?;
        rx.await.unwrap_or_else(|_| Err(StoreError::Ambiguous("the sqlite writer thread ended without an answer".into())))
    }

    /// Applies a fenced event to the row under a write lock.
    async fn fenced(
        &self,
        scope: &Scope,
        event: Event,
        apply: impl FnOnce(&Connection, Timestamp, Next, &Record) -> Result<(), StoreError> + Send + 'static,
    ) -> Result<bool, StoreError> {
        let scope = scope.clone();
        self.write(move |tx, now| {
            let Some(record) = get_tx(tx, &scope)? else { return Ok(false) };
            match transition(&record, event, now) {
                Ok(next) => {
                    apply(tx, now, next, &record)?;
                    Ok(true)
                }
                Err(_) => Ok(false),
            }
        })
        .await
    }
}

/// The writer thread: takes every job queued, runs them in one `BEGIN
/// IMMEDIATE` transaction (each under a savepoint, so one failing job does not
/// undo the others), commits once, then delivers each result. Ends when the
/// store is dropped.
fn writer(mut conn: Connection, queue: mpsc::Receiver<Job>) {
    while let Ok(first) = queue.recv() {
        let mut batch = Vec::new();
        let mut next = Some(first);
        while let Some(job) = next.take() {
            match job {
                Job::Alone(f) => {
                    run_batch(&mut conn, std::mem::take(&mut batch));
                    f(&mut conn);
                }
                Job::InBatch(f) => batch.push(f),
            }
            if batch.len() < MAX_BATCH {
                next = queue.try_recv().ok();
            }
        }
        run_batch(&mut conn, batch);
    }
}

fn run_batch(conn: &mut Connection, batch: Vec<BatchJob>) {
    if batch.is_empty() {
        return;
    }
    let mut tx = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
        Ok(tx) => tx,
        Err(e) => {
            // Nothing ran. Dropping a job drops its reply channel, which its
            // caller reads as ambiguous: always safe (it reads the row back).
            tracing::warn!(error = %e, jobs = batch.len(), "sqlite: cannot begin a transaction");
            return;
        }
    };
    let now = now();
    let mut completions = Vec::with_capacity(batch.len());
    for f in batch {
        match tx.savepoint() {
            Ok(sp) => {
                let (ok, done) = f(&sp, now);
                let kept = if ok {
                    sp.commit().map_err(err)
                } else {
                    drop(sp); // rolls this job back
                    Ok(())
                };
                match kept {
                    Ok(()) => completions.push(done),
                    Err(e) => done(Err(e)),
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "sqlite: cannot open a savepoint; the job is dropped");
                drop(f);
            }
        }
    }
    let committed = tx.commit().map_err(|e| StoreError::Ambiguous(format!("sqlite commit: {e}")));
    for done in completions {
        done(committed.clone());
    }
}

/// An operator command must find a migrated store at `path`: opening a
/// mistyped path would otherwise create an empty database and report "no
/// records" for a store that holds many.
fn check_existing(path: &Path) -> Result<(), StoreError> {
    let missing = |why: &str| {
        StoreError::Missing(format!(
            "no idemgate store at {}: {why} (check store.path; `idemgate migrate` or `idemgate serve` creates it)",
            path.display()
        ))
    };
    if !path.is_file() {
        return Err(missing("the file does not exist"));
    }
    let conn = Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(|e| missing(&format!("cannot open it: {e}")))?;
    let migrated: i64 = conn
        .query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'idemgate_schema_migrations'", [], |r| r.get(0))
        .map_err(|e| missing(&format!("not an SQLite database: {e}")))?;
    if migrated == 0 { Err(missing("the file is not an idemgate store")) } else { Ok(()) }
}

/// The database holds the derived-key secret, stored responses and async
/// requests: it is created readable and writable by its owner only (mode
/// 0600, before SQLite opens it; SQLite gives its `-wal`, `-shm` and
/// `-journal` files the database's mode). A database or companion file that
/// group or others may read or write (created by an earlier version with
/// the umask, or copied) is tightened to the owner's bits, with a warning;
/// one this process may not change is an error.
fn owner_only(path: &Path) -> Result<(), StoreError> {
    use std::os::unix::fs::PermissionsExt;
    match File::options().write(true).create_new(true).mode(0o600).open(path) {
        Ok(_) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(StoreError::Unavailable(format!("cannot create {}: {e}", path.display()))),
    }
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut file = path.as_os_str().to_owned();
        file.push(suffix);
        let file = PathBuf::from(file);
        let Ok(meta) = std::fs::metadata(&file) else { continue };
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 == 0 {
            continue;
        }
        let tightened = mode & 0o700;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(tightened)).map_err(|e| {
            StoreError::Unavailable(format!(
                "{} is readable or writable by group or others (mode {mode:03o}) and cannot be changed: {e}; \
                 it holds the derived-key secret and stored responses: run `chmod 600 {}` as its owner",
                file.display(),
                file.display()
            ))
        })?;
        tracing::warn!(
            file = %file.display(),
            was = %format!("{mode:03o}"),
            now = %format!("{tightened:03o}"),
            "the store file was readable by group or others: permissions tightened to its owner"
        );
    }
    Ok(())
}

/// `<db path>.lock`, the file `serve` locks for the process's life.
pub fn lock_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".lock");
    PathBuf::from(p)
}

fn get_conn(conn: &Connection, scope: &Scope) -> Result<Option<Record>, StoreError> {
    let sql = format!("SELECT {RECORD_COLUMNS} FROM idemgate_records WHERE {PK}");
    let mut st = conn.prepare_cached(&sql).map_err(err)?;
    let mut rows = st.query(pk(scope)).map_err(err)?;
    match rows.next().map_err(err)? {
        Some(row) => Ok(Some(decode(row)?)),
        None => Ok(None),
    }
}

fn get_tx(conn: &Connection, scope: &Scope) -> Result<Option<Record>, StoreError> {
    get_conn(conn, scope)
}

fn delete(tx: &Connection, scope: &Scope) -> Result<(), StoreError> {
    tx.prepare_cached(&format!("DELETE FROM idemgate_records WHERE {PK}")).and_then(|mut st| st.execute(pk(scope))).map_err(err).map(drop)
}

/// `UPDATE ... SET <assignments> WHERE <pk>`, with `?5` = `at` and `?6` =
/// `status` available to the assignments.
fn update_state(tx: &Connection, scope: &Scope, assignments: &str, at: Timestamp, status: Option<u16>) -> Result<(), StoreError> {
    let [t, p, o, k] = pk(scope);
    let sql = format!("UPDATE idemgate_records SET {assignments} WHERE {PK}");
    let mut st = tx.prepare_cached(&sql).map_err(err)?;
    // Unused parameters are fine for SQLite only when they are not numbered
    // past the statement's last one: bind just what the assignments use.
    let result = if assignments.contains("?6") {
        st.execute(params![t, p, o, k, at.0, status.map(i64::from)])
    } else {
        st.execute(params![t, p, o, k, at.0])
    };
    result.map_err(err).map(drop)
}

fn touch(tx: &Connection, scope: &Scope, now: Timestamp) -> Result<(), StoreError> {
    update_state(tx, scope, "updated_at = ?5", now, None)
}

fn set_unknown(tx: &Connection, scope: &Scope, now: Timestamp) -> Result<(), StoreError> {
    let [t, p, o, k] = pk(scope);
    tx.prepare_cached(&format!("UPDATE idemgate_records SET state = 'unknown', updated_at = ?5 WHERE {PK}"))
        .and_then(|mut st| st.execute(params![t, p, o, k, now.0]))
        .map_err(err)
        .map(drop)
}

/// Writes a completed response; `generation` is set when an operator's
/// resolution fences off the original attempt.
fn write_response(
    tx: &Connection,
    scope: &Scope,
    response: &StoredResponse,
    now: Timestamp,
    retention: Retention,
    generation: Option<Generation>,
) -> Result<(), StoreError> {
    let [t, p, o, k] = pk(scope);
    let sql = format!(
        "UPDATE idemgate_records SET state = 'completed', response_status = ?5, response_headers = ?6, response_body = ?7, \
         lease_expires_at = NULL, updated_at = ?8, expires_at = ?9, generation = coalesce(?10, generation), request = NULL WHERE {PK}"
    );
    let body: Option<&[u8]> = response.body.as_deref();
    tx.prepare_cached(&sql)
        .and_then(|mut st| {
            st.execute(params![
                t,
                p,
                o,
                k,
                i64::from(response.status),
                encode_headers(&response.headers),
                body,
                now.0,
                retention.expires_at(now).0,
                generation.map(|g| g.0)
            ])
        })
        .map_err(err)
        .map(drop)
}

/// An event to write with a state change.
struct NewEvent<'a> {
    kind: EventType,
    /// The record as it was before the change (scope and operation id).
    record: &'a Record,
    status: Option<u16>,
    actor: Option<&'a str>,
    body: Option<&'a [u8]>,
}

/// Writes an outbox row in the caller's transaction (the one making the change).
fn insert_event(tx: &Connection, e: &NewEvent<'_>, generation: Option<Generation>, now: Timestamp) -> Result<(), StoreError> {
    let [t, p, o, k] = pk(&e.record.scope);
    tx.prepare_cached(
        "INSERT INTO idemgate_events (event_id, event_type, tenant, principal, operation, idempotency_key, generation, status, \
         operation_id, actor, at, body, next_attempt_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?11)",
    )
    .and_then(|mut st| {
        st.execute(params![
            Uuid::new_v4().as_bytes(),
            e.kind.as_str(),
            t,
            p,
            o,
            k,
            generation.map(|g| g.0),
            e.status.map(i64::from),
            e.record.operation_id,
            e.actor,
            now.0,
            e.body
        ])
    })
    .map_err(err)
    .map(drop)
}

/// Draws the next generation (store-wide, strictly increasing) inside the
/// caller's transaction.
fn next_generation(tx: &Connection) -> Result<Generation, StoreError> {
    tx.prepare_cached("UPDATE idemgate_sequences SET value = value + 1 WHERE name = 'generation' RETURNING value")
        .and_then(|mut st| st.query_row([], |r| r.get(0)))
        .map(Generation)
        .map_err(err)
}

fn decode(row: &rusqlite::Row<'_>) -> Result<Record, StoreError> {
    let c = |e: rusqlite::Error| StoreError::Corrupt(e.to_string());
    let value = |i: usize| row.get_ref(i).map_err(c);
    let bad = |e: rusqlite::types::FromSqlError| StoreError::Corrupt(e.to_string());
    let text = |i: usize| value(i)?.as_str().map_err(bad);
    let blob = |i: usize| value(i)?.as_blob().map_err(bad);
    let blob_or_null = |i: usize| value(i)?.as_blob_or_null().map_err(bad);
    let at = |i: usize| row.get::<_, Option<i64>>(i).map(|t| t.map(Timestamp)).map_err(c);
    RecordRow {
        tenant: text(col::TENANT)?,
        principal: text(col::PRINCIPAL)?,
        operation: text(col::OPERATION)?,
        idempotency_key: text(col::IDEMPOTENCY_KEY)?,
        request_hash: blob(col::REQUEST_HASH)?,
        state: text(col::STATE)?,
        generation: row.get(col::GENERATION).map_err(c)?,
        claim_token: Uuid::from_slice(blob(col::CLAIM_TOKEN)?).map_err(|_| StoreError::Corrupt("claim_token is not 16 bytes".into()))?,
        owner: row.get(col::OWNER).map_err(c)?,
        lease_expires_at: at(col::LEASE_EXPIRES_AT)?,
        response_status: row.get(col::RESPONSE_STATUS).map_err(c)?,
        response_headers: blob_or_null(col::RESPONSE_HEADERS)?,
        response_body: blob_or_null(col::RESPONSE_BODY)?.map(Bytes::copy_from_slice),
        created_at: Timestamp(row.get(col::CREATED_AT).map_err(c)?),
        updated_at: Timestamp(row.get(col::UPDATED_AT).map_err(c)?),
        expires_at: Timestamp(row.get(col::EXPIRES_AT).map_err(c)?),
        operation_id: row.get(col::OPERATION_ID).map_err(c)?,
        attempts: row.get(col::ATTEMPTS).map_err(c)?,
        next_attempt_at: at(col::NEXT_ATTEMPT_AT)?,
        sent_at: at(col::SENT_AT)?,
        last_status: row.get(col::LAST_STATUS).map_err(c)?,
        maybe_executed: row.get(col::MAYBE_EXECUTED).map_err(c)?,
        key_source: row.get(col::KEY_SOURCE).map_err(c)?,
        reforward_key: value(col::REFORWARD_KEY)?.as_str_or_null().map_err(bad)?,
        fingerprint_spec: value(col::FINGERPRINT_SPEC)?.as_str_or_null().map_err(bad)?,
    }
    .into_record()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::store::contract::Lifecycle;

    use super::*;

    /// Every statement that selects records by state (the workers' take,
    /// the reaper, the probes, the sweeper, the counts) reaches them through
    /// an index: a plan that scans `idemgate_records` costs a pass over
    /// every record kept, per take (issue 32: 6 ms per async completion).
    #[tokio::test]
    async fn selections_by_state_never_scan_the_records() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("plans.db"), Access::Migrate).await.unwrap();
        store.migrate().await.unwrap();
        let statements: Vec<(&str, String)> = vec![
            ("take_overs", queue::TAKE_OVERS.clone()),
            ("take_due", queue::TAKE_DUE.clone()),
            ("reap_stale", records::REAP_STALE.clone()),
            ("probes_due", reconcile::PROBES_DUE.clone()),
            ("unknown_by_age", records::unknown_by_age_sql("CASE WHEN updated_at > ?1 THEN 0 ELSE 1 END")),
            ("sweep", records::SWEEP.to_owned()),
            ("stats", records::STATS.to_owned()),
        ];
        let plans = store
            .with(move |conn| {
                let mut plans = Vec::new();
                for (name, sql) in statements {
                    let mut st = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).map_err(err)?;
                    // Unbound parameters are NULL: the plan does not depend on them.
                    let mut rows = st.raw_query();
                    let mut lines = Vec::new();
                    while let Some(row) = rows.next().map_err(err)? {
                        lines.push(row.get::<_, String>(3).map_err(err)?);
                    }
                    plans.push((name, lines));
                }
                Ok(plans)
            })
            .await
            .unwrap();
        assert_eq!(plans.len(), 7);
        for (name, lines) in plans {
            let scans: Vec<&String> =
                // A scan of a (partial) index is fine; of the table, not.
                lines.iter().filter(|l| l.starts_with("SCAN idemgate_records") && !l.contains(" INDEX ")).collect();
            assert!(scans.is_empty(), "{name} scans the records: {lines:?}");
            assert!(lines.iter().any(|l| l.contains("idemgate_records")), "{name}: {lines:?}");
        }
    }

    /// A write that finds the writer's queue full is refused at once as
    /// `Unavailable` (nothing ran), and the writes already queued still run.
    #[tokio::test]
    async fn a_full_write_queue_refuses_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SqliteStore::open_with_queue(&dir.path().join("q.db"), Access::Migrate, 1).unwrap());
        // Hold the writer thread inside a job until `release` is sent.
        let (started_tx, started) = std::sync::mpsc::channel();
        let (release, held) = std::sync::mpsc::channel::<()>();
        let holder = {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .with(move |_| {
                        let _ = started_tx.send(());
                        let _ = held.recv();
                        Ok(())
                    })
                    .await
            })
        };
        tokio::task::spawn_blocking(move || started.recv()).await.unwrap().unwrap();
        // One job fills the queue (capacity 1); the next write is refused.
        let (ran_tx, ran) = std::sync::mpsc::channel();
        store
            .enqueue(Job::Alone(Box::new(move |_| {
                let _ = ran_tx.send(());
            })))
            .unwrap();
        let full = store.write(|_, _| Ok(8)).await.unwrap_err();
        assert!(matches!(&full, StoreError::Unavailable(m) if m.contains("write queue is full")), "{full:?}");
        release.send(()).unwrap();
        holder.await.unwrap().unwrap();
        tokio::task::spawn_blocking(move || ran.recv()).await.unwrap().expect("the queued job still runs");
        assert_eq!(store.write(|_, _| Ok(9)).await.unwrap(), 9, "writes go on once the queue drains");
    }
}
