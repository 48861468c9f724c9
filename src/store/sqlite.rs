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

use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;

use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::oneshot;

use bytes::Bytes;
use rusqlite::{Connection, TransactionBehavior, params};
use uuid::Uuid;

use super::codec::{decode_headers, encode_headers};
use super::migrations::{DERIVED_KEY_SECRET, SQLITE, fresh_secret};
use super::{
    Access, Claim, ClaimRequest, EventStats, ForeverCount, Inspection, ListFilter, ProbeFence, ProbeRoute, Probing, RawClaim, Reaped,
    RecordStore, Resolution, ResolveOutcome, RetryNote, StateCount, StoreError, Taken, WorkerRoute,
};
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::{IdempotencyKey, Scope, ScopeId};
use crate::idempotency::record::{
    Attempt, Event, Generation, Next, Record, Refused, State, StoredResponse, Timestamp, may_take_over, transition,
};
use crate::outbox::{Delivery, EventPolicies, EventType, OutboxEvent};
use crate::request::route::Retention;
use crate::store::audit::{self, AuditEntry, AuditNote};
use async_trait::async_trait;

const COLUMNS: &str = "tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner, \
     lease_expires_at, response_status, response_headers, response_body, created_at, updated_at, expires_at, \
     operation_id, attempts, next_attempt_at, sent_at, last_status, maybe_executed, key_source";
/// How many columns `COLUMNS` has: the next column of a row is at this index.
const NCOLS: usize = 23;
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

#[async_trait]
impl RecordStore for SqliteStore {
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

    async fn claim(&self, req: &ClaimRequest) -> Result<RawClaim, StoreError> {
        let req = req.clone();
        let token = req.claim_token;
        self.write(move |tx, now| {
            let lease = now.plus(req.lease);
            // An async acceptance starts queued (due now, no lease) with its request.
            let (state, lease_col, due, operation_id, request, idempotent) = match &req.acceptance {
                None => ("in_flight", Some(lease.0), None, None, req.request_head.as_deref(), req.upstream_idempotent),
                Some(a) => ("queued", None, Some(now.0), Some(a.operation_id.as_str()), Some(&a.request[..]), false),
            };
            let existing = get_tx(tx, &req.scope)?;
            let took_over = match existing {
                None => false,
                Some(record) if may_take_over(&record, &req.request_hash, now, idempotent) => {
                    delete(tx, &req.scope)?;
                    true
                }
                Some(record) => return Ok(RawClaim::Existing(record, now)),
            };
            let generation = next_generation(tx)?;
            let sql = "INSERT INTO idemgate_records (tenant, principal, operation, idempotency_key, request_hash, state, generation, \
                       claim_token, owner, lease_expires_at, created_at, updated_at, expires_at, operation_id, request, next_attempt_at, \
                       key_source, scope_id) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?11, ?12, ?13, ?14, ?15, ?16, ?17)";
            let [t, p, o, k] = pk(&req.scope);
            tx.prepare_cached(sql)
                .and_then(|mut st| {
                    st.execute(params![
                        t,
                        p,
                        o,
                        k,
                        &req.request_hash.0[..],
                        state,
                        generation.0,
                        token.as_bytes(),
                        &*req.owner,
                        lease_col,
                        now.0,
                        lease.0,
                        operation_id,
                        request,
                        due,
                        &*req.key_source,
                        req.scope.scope_id().to_i64()
                    ])
                })
                .map_err(err)?;
            // An acceptance has no lease yet: its claim carries the time it was accepted.
            let lease_expires_at = if req.acceptance.is_some() { now } else { lease };
            Ok(RawClaim::Claimed(Claim { scope: req.scope.clone(), generation, claim_token: token, lease_expires_at, took_over }))
        })
        .await
    }

    async fn get(&self, scope: &Scope) -> Result<Option<(Record, Timestamp)>, StoreError> {
        let scope = scope.clone();
        self.write(move |conn, now| Ok(get_conn(conn, &scope)?.map(|r| (r, now)))).await
    }

    async fn complete(
        &self,
        scope: &Scope,
        attempt: Attempt,
        response: &StoredResponse,
        retention: Retention,
        events: &EventPolicies,
    ) -> Result<bool, StoreError> {
        let s = scope.clone();
        let response = response.clone();
        let (emit, with_body) = (events.emits(&scope.operation, EventType::Completed), events.include_body(&scope.operation));
        self.fenced(scope, Event::Complete { attempt }, move |tx, now, _, record| {
            write_response(tx, &s, &response, now, retention, None)?;
            if emit {
                let body = response.body.as_deref().filter(|_| with_body);
                let ev = NewEvent { kind: EventType::Completed, record, status: Some(response.status), actor: None, body };
                insert_event(tx, &ev, Some(record.generation), now)?;
            }
            Ok(())
        })
        .await
    }

    async fn release(&self, scope: &Scope, attempt: Attempt) -> Result<bool, StoreError> {
        let s = scope.clone();
        self.fenced(scope, Event::Release { attempt }, move |tx, _, _, _| delete(tx, &s)).await
    }

    async fn abandon(&self, scope: &Scope, token: Uuid) -> Result<bool, StoreError> {
        let scope = scope.clone();
        self.write(move |tx, _| {
            let Some(record) = get_tx(tx, &scope)? else { return Ok(false) };
            if record.claim_token != token || record.state != State::InFlight {
                return Ok(false);
            }
            delete(tx, &scope)?;
            Ok(true)
        })
        .await
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        attempt: Attempt,
        only_if_lease_expired: bool,
        events: &EventPolicies,
    ) -> Result<bool, StoreError> {
        let s = scope.clone();
        let scope2 = scope.clone();
        let emit = events.emits(&scope.operation, EventType::Unknown);
        // Both conditions (our generation, and for a reader the lease expiry)
        // are checked against the same row under the write lock.
        self.write(move |tx, now| {
            let Some(record) = get_tx(tx, &scope2)? else { return Ok(false) };
            let mine = transition(&record, Event::MarkUnknown { attempt }, now).is_ok();
            let expired = !only_if_lease_expired || transition(&record, Event::LeaseExpired { reforwardable: false }, now).is_ok();
            if mine && expired {
                set_unknown(tx, &s, now)?;
                if emit {
                    insert_event(
                        tx,
                        &NewEvent { kind: EventType::Unknown, record: &record, status: None, actor: None, body: None },
                        Some(record.generation),
                        now,
                    )?;
                }
                Ok(true)
            } else {
                Ok(false)
            }
        })
        .await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>, StoreError> {
        let filter = filter.clone();
        self.write(move |conn, _| {
            // Keyset pagination: after the cursor's record in the list's
            // order (updated_at descending, then the primary key ascending).
            let sql = format!(
                "SELECT {COLUMNS} FROM idemgate_records \
                 WHERE (?1 IS NULL OR state = ?1) AND (?2 IS NULL OR tenant = ?2) AND (?3 IS NULL OR operation = ?3) \
                 AND (NOT ?5 OR expires_at = 9223372036854775807) \
                 AND (?6 IS NULL OR updated_at < ?6 \
                      OR (updated_at = ?6 AND (tenant, principal, operation, idempotency_key) > (?7, ?8, ?9, ?10))) \
                 ORDER BY updated_at DESC, tenant, principal, operation, idempotency_key LIMIT ?4"
            );
            let mut st = conn.prepare_cached(&sql).map_err(err)?;
            let c = filter.cursor.as_ref();
            let mut rows = st
                .query(params![
                    filter.state.map(State::as_str),
                    filter.tenant,
                    filter.operation,
                    i64::from(filter.limit),
                    filter.forever,
                    c.map(|c| c.updated_at.0),
                    c.map(|c| &*c.scope.tenant),
                    c.map(|c| &*c.scope.principal),
                    c.map(|c| &*c.scope.operation),
                    c.map(|c| c.scope.key.as_str())
                ])
                .map_err(err)?;
            let mut out = Vec::new();
            while let Some(row) = rows.next().map_err(err)? {
                out.push(decode(row)?);
            }
            Ok(out)
        })
        .await
    }

    async fn resolve(
        &self,
        scope: &Scope,
        resolution: &Resolution,
        note: &AuditNote,
        events: &EventPolicies,
        fence: Option<ProbeFence>,
    ) -> Result<ResolveOutcome, StoreError> {
        let scope = scope.clone();
        let resolution = resolution.clone();
        let note = note.clone();
        let events = events.clone();
        self.write(move |tx, now| {
            let Some(record) = get_tx(tx, &scope)? else { return Ok(ResolveOutcome::NotFound) };
            if let Some(fence) = fence
                && !probe_holds(tx, &scope, &record, fence)?
            {
                return Ok(ResolveOutcome::Refused(Refused::Fenced));
            }
            let (to, generation) = match (transition(&record, resolution.event(), now), &resolution) {
                (Err(refused), _) => return Ok(ResolveOutcome::Refused(refused)),
                (Ok(Next::Deleted), _) => {
                    delete(tx, &scope)?;
                    (None, None)
                }
                (Ok(Next::State { state, .. }), Resolution::Complete { response, retention, .. }) => {
                    let next = next_generation(tx)?;
                    write_response(tx, &scope, response, now, *retention, Some(next))?;
                    (Some(state), Some(next))
                }
                (Ok(Next::State { state: State::Queued, .. }), Resolution::Release { .. }) => {
                    // An async operation released: it runs again, under a new
                    // generation, if its request is still kept.
                    let [t, p, o, k] = pk(&scope);
                    let kept: bool = tx
                        .query_row(&format!("SELECT request IS NOT NULL FROM idemgate_records WHERE {PK}"), params![t, p, o, k], |r| {
                            r.get(0)
                        })
                        .map_err(err)?;
                    if !kept {
                        return Ok(ResolveOutcome::Refused(Refused::RequestGone));
                    }
                    let next = next_generation(tx)?;
                    tx.prepare_cached(&format!(
                        "UPDATE idemgate_records SET state = 'queued', generation = ?5, lease_expires_at = NULL, sent_at = NULL, \
                         next_attempt_at = ?6, attempts = 0, maybe_executed = 0, response_status = NULL, response_headers = NULL, \
                         response_body = NULL, updated_at = ?6 WHERE {PK}"
                    ))
                    .and_then(|mut st| st.execute(params![t, p, o, k, next.0, now.0]))
                    .map_err(err)?;
                    (Some(State::Queued), Some(next))
                }
                (Ok(Next::State { .. }), Resolution::Release { .. }) => {
                    return Ok(ResolveOutcome::Refused(Refused::NotAllowed(record.state)));
                }
            };
            let [t, p, o, k] = pk(&scope);
            tx.prepare_cached(
                "INSERT INTO idemgate_audit (at, actor, tenant, principal, operation, idempotency_key, from_state, to_state, reason, \
                 forced, generation, peer, token_label) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
            )
            .and_then(|mut st| {
                st.execute(params![
                    now.0,
                    note.actor.as_str(),
                    t,
                    p,
                    o,
                    k,
                    record.state.as_str(),
                    audit::to_state(to),
                    note.reason,
                    note.forced,
                    generation.map(|g| g.0),
                    note.caller.as_ref().map(|c| c.peer.as_str()),
                    note.caller.as_ref().map(|c| c.token.as_str())
                ])
            })
            .map_err(err)?;
            // The resolution's event, in the same transaction.
            if let Some(kind) = EventType::of_resolution(to).filter(|e| events.emits(&scope.operation, *e)) {
                let (status, body) = match &resolution {
                    Resolution::Complete { response, .. } => {
                        (Some(response.status), response.body.as_deref().filter(|_| events.include_body(&scope.operation)))
                    }
                    Resolution::Release { .. } => (None, None),
                };
                insert_event(tx, &NewEvent { kind, record: &record, status, actor: Some(note.actor.as_str()), body }, generation, now)?;
            }
            Ok(ResolveOutcome::Resolved { from: record.state })
        })
        .await
    }

    async fn audit(&self, limit: u32) -> Result<Vec<AuditEntry>, StoreError> {
        self.write(move |conn, _| {
            let mut st = conn
                .prepare_cached(
                    "SELECT id, at, actor, tenant, principal, operation, idempotency_key, from_state, to_state, reason, forced, generation, \
                     peer, token_label FROM idemgate_audit ORDER BY id DESC LIMIT ?1",
                )
                .map_err(err)?;
            let mut rows = st.query(params![i64::from(limit)]).map_err(err)?;
            let mut out = Vec::new();
            while let Some(row) = rows.next().map_err(err)? {
                out.push(decode_audit(row)?);
            }
            Ok(out)
        })
        .await
    }

    async fn inspect(&self, scope: &Scope, audit_limit: u32) -> Result<Option<Inspection>, StoreError> {
        let scope = scope.clone();
        self.write(move |conn, now| {
            let c = |e: rusqlite::Error| StoreError::Corrupt(e.to_string());
            let sql = format!(
                "SELECT {COLUMNS}, request, CASE WHEN probe_generation = generation THEN probe_attempts ELSE 0 END, next_probe_at, \
                 CASE WHEN probe_generation = generation THEN probe_last_answer END FROM idemgate_records WHERE {PK}"
            );
            let mut st = conn.prepare_cached(&sql).map_err(err)?;
            let mut rows = st.query(pk(&scope)).map_err(err)?;
            let Some(row) = rows.next().map_err(err)? else { return Ok(None) };
            let record = decode(row)?;
            let request: Option<Vec<u8>> = row.get(NCOLS).map_err(c)?;
            let probe_attempts: i32 = row.get(NCOLS + 1).map_err(c)?;
            let next_probe_at: Option<i64> = row.get(NCOLS + 2).map_err(c)?;
            let probe_last_answer: Option<String> = row.get(NCOLS + 3).map_err(c)?;
            let mut st = conn
                .prepare_cached(
                    "SELECT id, at, actor, tenant, principal, operation, idempotency_key, from_state, to_state, reason, forced, generation, \
                     peer, token_label FROM idemgate_audit WHERE tenant = ?1 AND principal = ?2 AND operation = ?3 AND idempotency_key = ?4 \
                     ORDER BY id DESC LIMIT ?5",
                )
                .map_err(err)?;
            let [t, p, o, k] = pk(&scope);
            let mut rows = st.query(params![t, p, o, k, i64::from(audit_limit)]).map_err(err)?;
            let mut audit = Vec::new();
            while let Some(row) = rows.next().map_err(err)? {
                audit.push(decode_audit(row)?);
            }
            Ok(Some(Inspection {
                record,
                now,
                request: request.map(Bytes::from),
                probe_attempts,
                next_probe_at: next_probe_at.map(Timestamp),
                probe_last_answer,
                audit,
            }))
        })
        .await
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

    async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        self.write(move |tx, now| {
            let n = tx
                .execute(
                    "DELETE FROM idemgate_records WHERE (tenant, principal, operation, idempotency_key) IN (
                        SELECT tenant, principal, operation, idempotency_key FROM idemgate_records
                        WHERE state IN ('completed', 'failed_retryable') AND expires_at <= ?1 ORDER BY expires_at LIMIT ?2)",
                    params![now.0, i64::from(batch)],
                )
                .map_err(err)?;
            Ok(n as u64)
        })
        .await
    }

    async fn reap_leases(&self, batch: u32, reforwardable: &[Arc<str>], events: &EventPolicies) -> Result<Reaped, StoreError> {
        let reforwardable: Vec<Arc<str>> = reforwardable.to_vec();
        let events = events.clone();
        self.write(move |tx, now| {
            let stale: Vec<Record> = {
                let sql = format!(
                    "SELECT {COLUMNS} FROM idemgate_records WHERE state IN ('in_flight', 'processing') \
                     AND (lease_expires_at IS NULL OR lease_expires_at <= ?1) ORDER BY lease_expires_at LIMIT ?2"
                );
                let mut st = tx.prepare_cached(&sql).map_err(err)?;
                let mut rows = st.query(params![now.0, i64::from(batch)]).map_err(err)?;
                let mut out = Vec::new();
                while let Some(row) = rows.next().map_err(err)? {
                    out.push(decode(row)?);
                }
                out
            };
            let mut reaped = Reaped::default();
            for record in stale {
                let reforward = reforwardable.iter().any(|o| **o == *record.scope.operation);
                match transition(&record, Event::LeaseExpired { reforwardable: reforward }, now) {
                    Ok(Next::State { state: State::Queued, .. }) => {
                        // Re-queued although it was sent: it may have executed.
                        let assignments = if record.sent_at.is_some() {
                            "state = 'queued', lease_expires_at = NULL, sent_at = NULL, next_attempt_at = ?5, maybe_executed = 1"
                        } else {
                            "state = 'queued', lease_expires_at = NULL, sent_at = NULL, next_attempt_at = ?5"
                        };
                        update_state(tx, &record.scope, assignments, now, None)?;
                        reaped.requeued += 1;
                    }
                    Ok(Next::State { state: State::Unknown, .. }) => {
                        set_unknown(tx, &record.scope, now)?;
                        if events.emits(&record.scope.operation, EventType::Unknown) {
                            let ev = NewEvent { kind: EventType::Unknown, record: &record, status: None, actor: None, body: None };
                            insert_event(tx, &ev, Some(record.generation), now)?;
                        }
                        reaped.unknown += 1;
                    }
                    _ => {}
                }
            }
            Ok(reaped)
        })
        .await
    }

    async fn take(&self, routes: &[WorkerRoute], owner: &str, claim_token: Uuid) -> Result<Option<Taken>, StoreError> {
        let routes = routes.to_vec();
        let owner = owner.to_owned();
        self.write(move |tx, now| {
            // The one writer thread serializes takes: no two workers can take
            // one operation.
            let mut found: Option<(Record, Vec<u8>)> = None;
            // Take-overs first (an expired attempt that may run again: never
            // sent, or its upstream deduplicates), then the queue.
            for sql in [
                format!(
                    "SELECT {COLUMNS}, request FROM idemgate_records WHERE state = 'processing' AND lease_expires_at <= ?1 \
                     ORDER BY lease_expires_at"
                ),
                format!("SELECT {COLUMNS}, request FROM idemgate_records WHERE state = 'queued' AND next_attempt_at <= ?1 ORDER BY next_attempt_at"),
            ] {
                let mut st = tx.prepare_cached(&sql).map_err(err)?;
                let mut rows = st.query(params![now.0]).map_err(err)?;
                while let Some(row) = rows.next().map_err(err)? {
                    let record = decode(row)?;
                    let Some(route) = routes.iter().find(|r| *r.operation == *record.scope.operation) else { continue };
                    if record.state == State::Processing && record.sent_at.is_some() && !route.reforwardable {
                        continue;
                    }
                    let request: Vec<u8> = row.get(23).map_err(err)?;
                    found = Some((record, request));
                    break;
                }
                if found.is_some() {
                    break;
                }
            }
            let Some((record, request)) = found else { return Ok(None) };
            let lease_expired = record.state == State::Processing;
            // Taken over although it was sent: it may have executed.
            let maybe_executed = record.maybe_executed || (lease_expired && record.sent_at.is_some());
            let lease = routes.iter().find(|r| *r.operation == *record.scope.operation).map_or(Duration::ZERO, |r| r.lease);
            let generation = next_generation(tx)?;
            let [t, p, o, k] = pk(&record.scope);
            tx.prepare_cached(&format!(
                "UPDATE idemgate_records SET state = 'processing', generation = ?5, claim_token = ?6, owner = ?7, lease_expires_at = ?8, \
                 attempts = attempts + 1, sent_at = NULL, next_attempt_at = NULL, updated_at = ?9, maybe_executed = ?10 WHERE {PK}"
            ))
            .and_then(|mut st| {
                st.execute(params![t, p, o, k, generation.0, claim_token.as_bytes(), owner, now.plus(lease).0, now.0, maybe_executed])
            })
            .map_err(err)?;
            let record = get_tx(tx, &record.scope)?.ok_or_else(|| StoreError::Corrupt("taken operation vanished".into()))?;
            let claim = Claim { scope: record.scope.clone(), generation, claim_token, lease_expires_at: now.plus(lease), took_over: true };
            Ok(Some(Taken { record, request: request.into(), claim, lease_expired }))
        })
        .await
    }

    async fn heartbeat(&self, scope: &Scope, attempt: Attempt, lease: Duration) -> Result<bool, StoreError> {
        let s = scope.clone();
        self.fenced(scope, Event::Heartbeat { attempt }, move |tx, now, _, _| {
            update_state(tx, &s, "lease_expires_at = ?5", now.plus(lease), None)
        })
        .await
    }

    async fn mark_sent(&self, scope: &Scope, attempt: Attempt) -> Result<bool, StoreError> {
        let s = scope.clone();
        self.fenced(scope, Event::MarkSent { attempt }, move |tx, now, _, _| update_state(tx, &s, "sent_at = ?5", now, None)).await
    }

    async fn requeue(&self, scope: &Scope, attempt: Attempt, delay: Duration, retry: RetryNote) -> Result<bool, StoreError> {
        let s = scope.clone();
        self.fenced(scope, Event::Requeue { attempt }, move |tx, now, _, _| {
            update_state(
                tx,
                &s,
                "state = 'queued', lease_expires_at = NULL, sent_at = NULL, next_attempt_at = ?5, last_status = ?6",
                now.plus(delay),
                retry.last_status,
            )?;
            if retry.maybe_executed {
                update_state(tx, &s, "maybe_executed = 1", now, None)?;
            }
            touch(tx, &s, now)
        })
        .await
    }

    async fn fail(
        &self,
        scope: &Scope,
        attempt: Attempt,
        retention: Retention,
        retry: RetryNote,
        events: &EventPolicies,
    ) -> Result<bool, StoreError> {
        let s = scope.clone();
        let (scope, retry_note) = (scope.clone(), retry);
        let events = events.clone();
        self.write(move |tx, now| {
            let Some(mut record) = get_tx(tx, &scope)? else { return Ok(false) };
            record.maybe_executed |= retry_note.maybe_executed;
            let Ok(Next::State { state, .. }) = transition(&record, Event::Fail { attempt }, now) else { return Ok(false) };
            // Final (failed_retryable): the stored request is dropped; an
            // unknown one keeps it (a release runs it again).
            let assignments = format!(
                "state = '{}', maybe_executed = {}, lease_expires_at = NULL, expires_at = ?5, last_status = ?6{}",
                state.as_str(),
                i32::from(record.maybe_executed),
                if state == State::FailedRetryable { ", request = NULL" } else { "" }
            );
            update_state(tx, &s, &assignments, retention.expires_at(now), retry_note.last_status)?;
            touch(tx, &s, now)?;
            if let Some(kind) = EventType::of(Some(state)).filter(|e| events.emits(&scope.operation, *e)) {
                let ev = NewEvent { kind, record: &record, status: retry_note.last_status, actor: None, body: None };
                insert_event(tx, &ev, Some(record.generation), now)?;
            }
            Ok(true)
        })
        .await
    }

    async fn operation(&self, tenant: &str, operation_id: &str) -> Result<Option<(Record, Timestamp)>, StoreError> {
        let (tenant, operation_id) = (tenant.to_owned(), operation_id.to_owned());
        self.write(move |conn, now| {
            let sql = format!("SELECT {COLUMNS} FROM idemgate_records WHERE tenant = ?1 AND operation_id = ?2");
            let mut st = conn.prepare_cached(&sql).map_err(err)?;
            let mut rows = st.query(params![tenant, operation_id]).map_err(err)?;
            match rows.next().map_err(err)? {
                Some(row) => Ok(Some((decode(row)?, now))),
                None => Ok(None),
            }
        })
        .await
    }

    async fn take_events(&self, operations: &[&str], limit: u32, lease: Duration, token: Uuid) -> Result<Vec<OutboxEvent>, StoreError> {
        let operations: Vec<String> = operations.iter().map(|o| (*o).to_owned()).collect();
        self.write(move |tx, now| {
            // The single writer serializes relays: an event is leased to one.
            let candidates = {
                let sql = format!(
                    "SELECT {EVENT_COLUMNS} FROM idemgate_events e WHERE delivery = 'pending' AND next_attempt_at <= ?1 \
                     AND (lease_until IS NULL OR lease_until <= ?1) \
                     AND NOT EXISTS (SELECT 1 FROM idemgate_events p WHERE p.delivery = 'pending' AND p.tenant = e.tenant \
                       AND p.principal = e.principal AND p.operation = e.operation AND p.idempotency_key = e.idempotency_key \
                       AND p.seq < e.seq) \
                     AND NOT EXISTS (SELECT 1 FROM idemgate_events q WHERE q.delivery = 'parked' AND q.seq < e.seq \
                       AND q.tenant = e.tenant AND q.principal = e.principal AND q.operation = e.operation \
                       AND q.idempotency_key = e.idempotency_key) \
                     ORDER BY next_attempt_at"
                );
                let mut st = tx.prepare_cached(&sql).map_err(err)?;
                let mut rows = st.query(params![now.0]).map_err(err)?;
                let mut out = Vec::new();
                while let Some(row) = rows.next().map_err(err)? {
                    let e = decode_event(row)?;
                    if operations.iter().any(|o| **o == *e.scope.operation) {
                        out.push(e);
                        if out.len() >= limit as usize {
                            break;
                        }
                    }
                }
                // Handed out in seq order, like PostgreSQL's.
                out.sort_by_key(|e| e.seq);
                out
            };
            for e in &candidates {
                tx.prepare_cached("UPDATE idemgate_events SET lease_token = ?2, lease_until = ?3 WHERE seq = ?1")
                    .and_then(|mut st| st.execute(params![e.seq, token.as_bytes(), now.plus(lease).0]))
                    .map_err(err)?;
            }
            Ok(candidates)
        })
        .await
    }

    async fn events_delivered(&self, seqs: &[i64], token: Uuid) -> Result<Vec<i64>, StoreError> {
        let seqs = seqs.to_vec();
        self.write(move |tx, now| {
            let mut st = tx
                .prepare_cached(
                    "UPDATE idemgate_events SET delivery = 'sent', sent_at = ?3, lease_token = NULL, lease_until = NULL \
                     WHERE seq = ?1 AND lease_token = ?2 AND delivery = 'pending'",
                )
                .map_err(err)?;
            let mut marked = Vec::new();
            for seq in seqs {
                if st.execute(params![seq, token.as_bytes(), now.0]).map_err(err)? > 0 {
                    marked.push(seq);
                }
            }
            Ok(marked)
        })
        .await
    }

    async fn event_failed(&self, seq: i64, token: Uuid, error: &str, retry_after: Duration, park: bool) -> Result<bool, StoreError> {
        let error = error.to_owned();
        self.write(move |tx, now| {
            let n = tx
                .prepare_cached(
                    "UPDATE idemgate_events SET attempts = attempts + 1, last_error = ?3, next_attempt_at = ?4, \
                     delivery = CASE WHEN ?5 THEN 'parked' ELSE 'pending' END, lease_token = NULL, lease_until = NULL \
                     WHERE seq = ?1 AND lease_token = ?2 AND delivery = 'pending'",
                )
                .and_then(|mut st| st.execute(params![seq, token.as_bytes(), error, now.plus(retry_after).0, park]))
                .map_err(err)?;
            Ok(n > 0)
        })
        .await
    }

    async fn events(&self, delivery: Option<Delivery>, limit: u32) -> Result<Vec<OutboxEvent>, StoreError> {
        self.write(move |conn, _| {
            let sql = format!("SELECT {EVENT_COLUMNS} FROM idemgate_events WHERE (?1 IS NULL OR delivery = ?1) ORDER BY seq DESC LIMIT ?2");
            let mut st = conn.prepare_cached(&sql).map_err(err)?;
            let mut rows = st.query(params![delivery.map(Delivery::as_str), i64::from(limit)]).map_err(err)?;
            let mut out = Vec::new();
            while let Some(row) = rows.next().map_err(err)? {
                out.push(decode_event(row)?);
            }
            out.reverse();
            Ok(out)
        })
        .await
    }

    async fn redeliver(&self, event_id: Uuid) -> Result<bool, StoreError> {
        self.write(move |tx, now| {
            let n = tx
                .prepare_cached(
                    "UPDATE idemgate_events SET delivery = 'pending', attempts = 0, next_attempt_at = ?2, lease_token = NULL, \
                     lease_until = NULL, last_error = NULL, sent_at = NULL WHERE event_id = ?1",
                )
                .and_then(|mut st| st.execute(params![event_id.as_bytes(), now.0]))
                .map_err(err)?;
            Ok(n > 0)
        })
        .await
    }

    async fn sweep_events(&self, batch: u32, older_than: Duration) -> Result<u64, StoreError> {
        self.write(move |tx, now| {
            let cutoff = Timestamp(now.0.saturating_sub(i64::try_from(older_than.as_micros()).unwrap_or(i64::MAX)));
            let n = tx
                .execute(
                    "DELETE FROM idemgate_events WHERE seq IN (SELECT seq FROM idemgate_events WHERE delivery = 'sent' \
                     AND sent_at <= ?1 ORDER BY sent_at LIMIT ?2)",
                    params![cutoff.0, i64::from(batch)],
                )
                .map_err(err)?;
            Ok(n as u64)
        })
        .await
    }

    async fn event_stats(&self) -> Result<EventStats, StoreError> {
        self.write(move |conn, _| {
            conn.query_row(
                "SELECT count(*) FILTER (WHERE delivery = 'pending'), count(*) FILTER (WHERE delivery = 'parked'), \
                 min(at) FILTER (WHERE delivery = 'pending'), \
                 (SELECT count(*) FROM idemgate_events q JOIN idemgate_events e ON e.delivery = 'pending' \
                    AND e.tenant = q.tenant AND e.principal = q.principal AND e.operation = q.operation \
                    AND e.idempotency_key = q.idempotency_key AND e.seq > q.seq WHERE q.delivery = 'parked') \
                 FROM idemgate_events WHERE delivery <> 'sent'",
                [],
                |row| {
                    Ok(EventStats {
                        pending: row.get(0)?,
                        parked: row.get(1)?,
                        oldest_pending_at: row.get::<_, Option<i64>>(2)?.map(Timestamp),
                        held: row.get(3)?,
                    })
                },
            )
            .map_err(err)
        })
        .await
    }

    async fn stats(&self) -> Result<Vec<StateCount>, StoreError> {
        self.write(move |conn, _| {
            let mut st = conn
                .prepare_cached(
                    "SELECT operation, state, count(*), min(created_at), min(updated_at), min(lease_expires_at) FROM idemgate_records \
                     WHERE state <> 'completed' GROUP BY operation, state",
                )
                .map_err(err)?;
            let mut rows = st.query([]).map_err(err)?;
            let mut out = Vec::new();
            while let Some(row) = rows.next().map_err(err)? {
                let c = |e: rusqlite::Error| StoreError::Corrupt(e.to_string());
                let state: String = row.get(1).map_err(c)?;
                out.push(StateCount {
                    operation: row.get(0).map_err(c)?,
                    state: State::parse(&state).ok_or_else(|| StoreError::Corrupt(format!("unknown state {state:?}")))?,
                    count: row.get(2).map_err(c)?,
                    oldest_created_at: Timestamp(row.get(3).map_err(c)?),
                    oldest_updated_at: Timestamp(row.get(4).map_err(c)?),
                    earliest_lease_expiry: row.get::<_, Option<i64>>(5).map_err(c)?.map(Timestamp),
                });
            }
            Ok(out)
        })
        .await
    }

    async fn by_scope_id(&self, id: ScopeId) -> Result<Vec<Record>, StoreError> {
        self.write(move |conn, _| {
            let mut st = conn.prepare_cached(&format!("SELECT {COLUMNS} FROM idemgate_records WHERE scope_id = ?1")).map_err(err)?;
            let mut rows = st.query(params![id.to_i64()]).map_err(err)?;
            let mut out = Vec::new();
            while let Some(row) = rows.next().map_err(err)? {
                out.push(decode(row)?);
            }
            Ok(out)
        })
        .await
    }

    async fn scopes_without_id(&self, after: Option<&Scope>, limit: u32) -> Result<Vec<Scope>, StoreError> {
        let after = after.cloned();
        self.write(move |conn, _| {
            let sql = "SELECT tenant, principal, operation, idempotency_key FROM idemgate_records \
                       WHERE scope_id IS NULL AND (?5 = 0 OR (tenant, principal, operation, idempotency_key) > (?1, ?2, ?3, ?4)) \
                       ORDER BY tenant, principal, operation, idempotency_key LIMIT ?6";
            let [t, p, o, k] = after.as_ref().map_or(["", "", "", ""], pk);
            let mut st = conn.prepare_cached(sql).map_err(err)?;
            let mut rows = st.query(params![t, p, o, k, after.is_some(), i64::from(limit)]).map_err(err)?;
            let mut out = Vec::new();
            while let Some(row) = rows.next().map_err(err)? {
                let c = |e: rusqlite::Error| StoreError::Corrupt(e.to_string());
                let (t, p, o, k): (String, String, String, String) =
                    (row.get(0).map_err(c)?, row.get(1).map_err(c)?, row.get(2).map_err(c)?, row.get(3).map_err(c)?);
                let key = IdempotencyKey::new(&k).map_err(|e| StoreError::Corrupt(format!("idempotency_key: {e}")))?;
                out.push(Scope { tenant: t.into(), principal: p.into(), operation: o.into(), key });
            }
            Ok(out)
        })
        .await
    }

    async fn forever_counts(&self) -> Result<Vec<ForeverCount>, StoreError> {
        self.write(move |conn, _| {
            // The literal matches the partial index's predicate.
            let mut st = conn
                .prepare_cached(
                    "SELECT operation, count(*) FROM idemgate_records WHERE expires_at = 9223372036854775807 GROUP BY operation",
                )
                .map_err(err)?;
            let mut rows = st.query([]).map_err(err)?;
            let mut out = Vec::new();
            while let Some(row) = rows.next().map_err(err)? {
                let c = |e: rusqlite::Error| StoreError::Corrupt(e.to_string());
                out.push(ForeverCount { operation: row.get(0).map_err(c)?, count: row.get(1).map_err(c)? });
            }
            Ok(out)
        })
        .await
    }

    async fn take_probes(&self, routes: &[ProbeRoute], token: Uuid, hold: Duration, limit: u32) -> Result<Vec<Probing>, StoreError> {
        let routes = routes.to_vec();
        // The one writer thread serializes takes: no two probes take one record.
        self.write(move |tx, now| {
            let mut taken = Vec::new();
            for route in &routes {
                let left = i64::from(limit).saturating_sub(taken.len() as i64);
                if left <= 0 {
                    break;
                }
                let ago = |d: Duration| Timestamp(now.0.saturating_sub(i64::try_from(d.as_micros()).unwrap_or(i64::MAX)));
                let settled = ago(route.settle);
                // Sent (or, synchronous, claimed) long enough ago that the
                // attempt cannot still be at the upstream.
                let finished = ago(route.at_upstream.saturating_add(route.settle));
                let sql = format!(
                    "SELECT {COLUMNS}, request, CASE WHEN probe_generation = generation THEN probe_attempts ELSE 0 END \
                     FROM idemgate_records WHERE state = 'unknown' AND operation = ?1 AND updated_at <= ?2 \
                     AND coalesce(sent_at, created_at) <= ?5 \
                     AND (probe_generation IS NOT generation \
                          OR ((next_probe_at IS NULL OR next_probe_at <= ?3) AND (probe_until IS NULL OR probe_until <= ?3))) \
                     ORDER BY updated_at LIMIT ?4"
                );
                let mut st = tx.prepare_cached(&sql).map_err(err)?;
                let mut rows = st.query(params![&*route.operation, settled.0, now.0, left, finished.0]).map_err(err)?;
                while let Some(row) = rows.next().map_err(err)? {
                    let record = decode(row)?;
                    let request: Option<Vec<u8>> = row.get(NCOLS).map_err(err)?;
                    let attempts: i32 = row.get(NCOLS + 1).map_err(err)?;
                    taken.push(Probing {
                        fence: ProbeFence { generation: record.generation, token },
                        attempts,
                        request: request.map(Bytes::from),
                        record,
                    });
                }
            }
            for p in &taken {
                let [t, pr, o, k] = pk(&p.record.scope);
                tx.prepare_cached(&format!(
                    "UPDATE idemgate_records SET probe_attempts = ?5, probe_generation = generation, next_probe_at = NULL, \
                     probe_token = ?6, probe_until = ?7 WHERE {PK}"
                ))
                .and_then(|mut st| st.execute(params![t, pr, o, k, p.attempts, token.as_bytes(), now.plus(hold).0]))
                .map_err(err)?;
            }
            Ok(taken)
        })
        .await
    }

    async fn probe_failed(&self, scope: &Scope, fence: ProbeFence, retry_in: Duration, answer: &str) -> Result<bool, StoreError> {
        let scope = scope.clone();
        let answer = answer.to_owned();
        self.write(move |tx, now| {
            let Some(record) = get_tx(tx, &scope)? else { return Ok(false) };
            if !probe_holds(tx, &scope, &record, fence)? {
                return Ok(false);
            }
            let [t, p, o, k] = pk(&scope);
            tx.prepare_cached(&format!(
                "UPDATE idemgate_records SET probe_attempts = probe_attempts + 1, next_probe_at = ?5, probe_token = NULL, \
                 probe_until = NULL, probe_last_answer = ?6 WHERE {PK}"
            ))
            .and_then(|mut st| st.execute(params![t, p, o, k, now.plus(retry_in).0, answer]))
            .map_err(err)?;
            Ok(true)
        })
        .await
    }
}

/// Whether the probe identified by `fence` still holds `record`: unknown, at
/// the generation probed, marked with the probe's token.
fn probe_holds(tx: &Connection, scope: &Scope, record: &Record, fence: ProbeFence) -> Result<bool, StoreError> {
    if record.state != State::Unknown || record.generation != fence.generation {
        return Ok(false);
    }
    let token: Option<Vec<u8>> = tx
        .prepare_cached(&format!("SELECT probe_token FROM idemgate_records WHERE {PK}"))
        .and_then(|mut st| st.query_row(pk(scope), |r| r.get(0)))
        .map_err(err)?;
    Ok(token.as_deref() == Some(fence.token.as_bytes().as_slice()))
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
    let sql = format!("SELECT {COLUMNS} FROM idemgate_records WHERE {PK}");
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

const EVENT_COLUMNS: &str = "seq, event_id, event_type, tenant, principal, operation, idempotency_key, generation, status, operation_id, \
     actor, at, body, delivery, attempts, next_attempt_at, last_error, sent_at";

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

fn decode_event(row: &rusqlite::Row<'_>) -> Result<OutboxEvent, StoreError> {
    let c = |e: rusqlite::Error| StoreError::Corrupt(e.to_string());
    let key: String = row.get(6).map_err(c)?;
    let key = IdempotencyKey::new(&key).map_err(|e| StoreError::Corrupt(format!("event idempotency_key: {e}")))?;
    let id: Vec<u8> = row.get(1).map_err(c)?;
    let kind: String = row.get(2).map_err(c)?;
    let delivery: String = row.get(13).map_err(c)?;
    let (tenant, principal, operation): (String, String, String) = (row.get(3).map_err(c)?, row.get(4).map_err(c)?, row.get(5).map_err(c)?);
    Ok(OutboxEvent {
        seq: row.get(0).map_err(c)?,
        id: Uuid::from_slice(&id).map_err(|_| StoreError::Corrupt("event_id is not 16 bytes".into()))?,
        event_type: EventType::parse(&kind).ok_or_else(|| StoreError::Corrupt(format!("event type {kind:?}")))?,
        scope: Scope { tenant: tenant.into(), principal: principal.into(), operation: operation.into(), key },
        generation: row.get::<_, Option<i64>>(7).map_err(c)?.map(Generation),
        status: row.get::<_, Option<i64>>(8).map_err(c)?.and_then(|s| u16::try_from(s).ok()),
        operation_id: row.get(9).map_err(c)?,
        actor: row.get(10).map_err(c)?,
        at: Timestamp(row.get(11).map_err(c)?),
        body: row.get(12).map_err(c)?,
        delivery: Delivery::parse(&delivery).ok_or_else(|| StoreError::Corrupt(format!("event delivery {delivery:?}")))?,
        attempts: row.get(14).map_err(c)?,
        next_attempt_at: Timestamp(row.get(15).map_err(c)?),
        last_error: row.get(16).map_err(c)?,
        sent_at: row.get::<_, Option<i64>>(17).map_err(c)?.map(Timestamp),
    })
}

/// Draws the next generation (store-wide, strictly increasing) inside the
/// caller's transaction.
fn next_generation(tx: &Connection) -> Result<Generation, StoreError> {
    tx.prepare_cached("UPDATE idemgate_sequences SET value = value + 1 WHERE name = 'generation' RETURNING value")
        .and_then(|mut st| st.query_row([], |r| r.get(0)))
        .map(Generation)
        .map_err(err)
}

fn decode_audit(row: &rusqlite::Row<'_>) -> Result<AuditEntry, StoreError> {
    let c = |e: rusqlite::Error| StoreError::Corrupt(e.to_string());
    let key: String = row.get(6).map_err(c)?;
    let key = IdempotencyKey::new(&key).map_err(|e| StoreError::Corrupt(format!("audit idempotency_key: {e}")))?;
    let tenant: String = row.get(3).map_err(c)?;
    let principal: String = row.get(4).map_err(c)?;
    let operation: String = row.get(5).map_err(c)?;
    Ok(AuditEntry {
        id: row.get(0).map_err(c)?,
        at: Timestamp(row.get(1).map_err(c)?),
        actor: row.get(2).map_err(c)?,
        scope: Scope { tenant: tenant.into(), principal: principal.into(), operation: operation.into(), key },
        from_state: row.get(7).map_err(c)?,
        to_state: row.get(8).map_err(c)?,
        reason: row.get(9).map_err(c)?,
        forced: row.get(10).map_err(c)?,
        generation: row.get::<_, Option<i64>>(11).map_err(c)?.map(Generation),
        peer: row.get(12).map_err(c)?,
        token: row.get(13).map_err(c)?,
    })
}

fn decode(row: &rusqlite::Row<'_>) -> Result<Record, StoreError> {
    let c = |e: rusqlite::Error| StoreError::Corrupt(e.to_string());
    let key: String = row.get(3).map_err(c)?;
    let key = IdempotencyKey::new(&key).map_err(|e| StoreError::Corrupt(format!("idempotency_key: {e}")))?;
    let hash: Vec<u8> = row.get(4).map_err(c)?;
    let hash: [u8; 32] = hash.try_into().map_err(|_| StoreError::Corrupt("request_hash is not 32 bytes".into()))?;
    let state: String = row.get(5).map_err(c)?;
    let state = State::parse(&state).ok_or_else(|| StoreError::Corrupt(format!("unknown state {state:?}")))?;
    let token: Vec<u8> = row.get(7).map_err(c)?;
    let token = Uuid::from_slice(&token).map_err(|_| StoreError::Corrupt("claim_token is not 16 bytes".into()))?;
    let status: Option<i64> = row.get(10).map_err(c)?;
    let headers: Option<Vec<u8>> = row.get(11).map_err(c)?;
    let body: Option<Vec<u8>> = row.get(12).map_err(c)?;
    let response = match status {
        None => None,
        Some(s) => Some(StoredResponse {
            status: u16::try_from(s).map_err(|_| StoreError::Corrupt(format!("response_status {s}")))?,
            headers: headers.as_deref().map(decode_headers).transpose()?.unwrap_or_default(),
            body: body.map(Bytes::from),
        }),
    };
    let tenant: String = row.get(0).map_err(c)?;
    let principal: String = row.get(1).map_err(c)?;
    let operation: String = row.get(2).map_err(c)?;
    Ok(Record {
        scope: Scope { tenant: tenant.into(), principal: principal.into(), operation: operation.into(), key },
        request_hash: Fingerprint(hash),
        state,
        generation: Generation(row.get(6).map_err(c)?),
        claim_token: token,
        owner: row.get(8).map_err(c)?,
        lease_expires_at: row.get::<_, Option<i64>>(9).map_err(c)?.map(Timestamp),
        response,
        created_at: Timestamp(row.get(13).map_err(c)?),
        updated_at: Timestamp(row.get(14).map_err(c)?),
        expires_at: Timestamp(row.get(15).map_err(c)?),
        operation_id: row.get(16).map_err(c)?,
        attempts: row.get(17).map_err(c)?,
        next_attempt_at: row.get::<_, Option<i64>>(18).map_err(c)?.map(Timestamp),
        sent_at: row.get::<_, Option<i64>>(19).map_err(c)?.map(Timestamp),
        last_status: row
            .get::<_, Option<i64>>(20)
            .map_err(c)?
            .map(|s| u16::try_from(s).map_err(|_| StoreError::Corrupt(format!("last_status {s}"))))
            .transpose()?,
        maybe_executed: row.get(21).map_err(c)?,
        key_source: row.get(22).map_err(c)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
