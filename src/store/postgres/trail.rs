//! PostgreSQL: the audit trail and one scope's inspection (the [`Trail`] part of the store's contract).

use super::sql::NOW;
use super::sql::{PK, RECORD_COLUMNS};
use super::{PgStore, decode};
use crate::idempotency::key::{IdempotencyKey, Scope};
use crate::idempotency::record::{Generation, Timestamp};
use crate::store::audit::AuditEntry;
use crate::store::contract::Trail;
use crate::store::{Inspection, StoreError};
use async_trait::async_trait;
use bytes::Bytes;
use std::sync::LazyLock;
use tokio_postgres::Row;

pub(super) const AUDIT_INSERT: &str = "INSERT INTO idemgate_audit \
     (actor, tenant, principal, operation, idempotency_key, from_state, to_state, reason, forced, generation, peer, token_label) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)";

pub(super) const AUDIT_LIST: &str = "SELECT id, at, actor, tenant, principal, operation, idempotency_key, from_state, to_state, reason, \
     forced, generation, peer, token_label FROM idemgate_audit ORDER BY id DESC LIMIT $1";

/// The operator console's record page: the record, the store's clock, the
/// stored request and the probes of this generation.
pub(super) static INSPECT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {RECORD_COLUMNS}, now(), request, CASE WHEN probe_generation = generation THEN probe_attempts ELSE 0 END, next_probe_at, \
         CASE WHEN probe_generation = generation THEN probe_last_answer END FROM idemgate_records WHERE {PK}"
    )
});

/// Where `INSPECT`'s own columns are, after the record's and the clock ([`NOW`]).
const INSPECT_REQUEST: usize = NOW + 1;
const INSPECT_PROBE_ATTEMPTS: usize = INSPECT_REQUEST + 1;
const INSPECT_NEXT_PROBE_AT: usize = INSPECT_PROBE_ATTEMPTS + 1;
const INSPECT_PROBE_LAST_ANSWER: usize = INSPECT_NEXT_PROBE_AT + 1;

/// The audit rows of one scope, newest first (the console's record page).
pub(super) const AUDIT_OF_SCOPE: &str = "SELECT id, at, actor, tenant, principal, operation, idempotency_key, from_state, to_state, \
     reason, forced, generation, peer, token_label FROM idemgate_audit \
     WHERE tenant = $1 AND principal = $2 AND operation = $3 AND idempotency_key = $4 ORDER BY id DESC LIMIT $5";

#[async_trait]
impl Trail for PgStore {
    async fn audit(&self, limit: u32) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = self.query(AUDIT_LIST, &[&i64::from(limit)], false).await?;
        rows.iter().map(decode_audit).collect()
    }

    async fn inspect(&self, scope: &Scope, audit_limit: u32) -> Result<Option<Inspection>, StoreError> {
        let (t, p, o, k) = (&*scope.tenant, &*scope.principal, &*scope.operation, scope.key.as_str());
        let rows = self.query(&INSPECT, &[&t, &p, &o, &k], false).await?;
        let Some(row) = rows.first() else { return Ok(None) };
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let record = decode(row)?;
        let now: Timestamp = row.try_get(NOW).map_err(c)?;
        let request: Option<Vec<u8>> = row.try_get(INSPECT_REQUEST).map_err(c)?;
        let probe_attempts: i32 = row.try_get(INSPECT_PROBE_ATTEMPTS).map_err(c)?;
        let next_probe_at: Option<Timestamp> = row.try_get(INSPECT_NEXT_PROBE_AT).map_err(c)?;
        let probe_last_answer: Option<String> = row.try_get(INSPECT_PROBE_LAST_ANSWER).map_err(c)?;
        let rows = self.query(AUDIT_OF_SCOPE, &[&t, &p, &o, &k, &i64::from(audit_limit)], false).await?;
        let audit = rows.iter().map(decode_audit).collect::<Result<Vec<_>, _>>()?;
        Ok(Some(Inspection { record, now, request: request.map(Bytes::from), probe_attempts, next_probe_at, probe_last_answer, audit }))
    }
}

fn decode_audit(row: &Row) -> Result<AuditEntry, StoreError> {
    let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
    let key: &str = row.try_get(6).map_err(c)?;
    let key = IdempotencyKey::new(key).map_err(|e| StoreError::Corrupt(format!("audit idempotency_key: {e}")))?;
    let tenant: &str = row.try_get(3).map_err(c)?;
    let principal: &str = row.try_get(4).map_err(c)?;
    let operation: &str = row.try_get(5).map_err(c)?;
    Ok(AuditEntry {
        id: row.try_get(0).map_err(c)?,
        at: row.try_get(1).map_err(c)?,
        actor: row.try_get(2).map_err(c)?,
        scope: Scope { tenant: tenant.into(), principal: principal.into(), operation: operation.into(), key },
        from_state: row.try_get(7).map_err(c)?,
        to_state: row.try_get(8).map_err(c)?,
        reason: row.try_get(9).map_err(c)?,
        forced: row.try_get(10).map_err(c)?,
        generation: row.try_get::<_, Option<i64>>(11).map_err(c)?.map(Generation),
        peer: row.try_get(12).map_err(c)?,
        token: row.try_get(13).map_err(c)?,
    })
}
