//! SQLite: the outbox (the [`Events`] part of the store's contract).

use super::*;

/// Events one take leases at most: it leases them one by one in the
/// single writer's transaction, which holds every other write back
/// meanwhile (a relay asks for up to 1,024).
const MOST_PER_TAKE: u32 = 256;

#[async_trait]
impl Events for SqliteStore {
    fn most_per_take(&self) -> u32 {
        MOST_PER_TAKE
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

    async fn events_deferred(&self, seqs: &[i64], token: Uuid, retry_after: Duration) -> Result<Vec<i64>, StoreError> {
        let seqs = seqs.to_vec();
        self.write(move |tx, now| {
            let mut st = tx
                .prepare_cached(
                    "UPDATE idemgate_events SET next_attempt_at = ?3, lease_token = NULL, lease_until = NULL \
                     WHERE seq = ?1 AND lease_token = ?2 AND delivery = 'pending'",
                )
                .map_err(err)?;
            let mut released = Vec::new();
            for seq in seqs {
                if st.execute(params![seq, token.as_bytes(), now.plus(retry_after).0]).map_err(err)? > 0 {
                    released.push(seq);
                }
            }
            Ok(released)
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
}

const EVENT_COLUMNS: &str = "seq, event_id, event_type, tenant, principal, operation, idempotency_key, generation, status, operation_id, \
     actor, at, body, delivery, attempts, next_attempt_at, last_error, sent_at";

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
