//! SQLite: the audit trail and one scope's inspection (the [`Trail`] part of the store's contract).

use super::{PK, RECORD_COLUMNS, SqliteStore, decode, err, pk};
use crate::idempotency::key::{IdempotencyKey, Scope};
use crate::idempotency::record::{Generation, Timestamp};
use crate::store::audit::AuditEntry;
use crate::store::codec::col;
use crate::store::contract::Trail;
use crate::store::{Inspection, StoreError};
use async_trait::async_trait;
use bytes::Bytes;
use rusqlite::params;

/// Where the inspection's own columns are, after the record's.
const INSPECT_REQUEST: usize = col::END;
const INSPECT_PROBE_ATTEMPTS: usize = INSPECT_REQUEST + 1;
const INSPECT_NEXT_PROBE_AT: usize = INSPECT_PROBE_ATTEMPTS + 1;
const INSPECT_PROBE_LAST_ANSWER: usize = INSPECT_NEXT_PROBE_AT + 1;

#[async_trait]
impl Trail for SqliteStore {
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
                "SELECT {RECORD_COLUMNS}, request, CASE WHEN probe_generation = generation THEN probe_attempts ELSE 0 END, next_probe_at, \
                 CASE WHEN probe_generation = generation THEN probe_last_answer END FROM idemgate_records WHERE {PK}"
            );
            let mut st = conn.prepare_cached(&sql).map_err(err)?;
            let mut rows = st.query(pk(&scope)).map_err(err)?;
            let Some(row) = rows.next().map_err(err)? else { return Ok(None) };
            let record = decode(row)?;
            let request: Option<Vec<u8>> = row.get(INSPECT_REQUEST).map_err(c)?;
            let probe_attempts: i32 = row.get(INSPECT_PROBE_ATTEMPTS).map_err(c)?;
            let next_probe_at: Option<i64> = row.get(INSPECT_NEXT_PROBE_AT).map_err(c)?;
            let probe_last_answer: Option<String> = row.get(INSPECT_PROBE_LAST_ANSWER).map_err(c)?;
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
