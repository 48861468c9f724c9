//! The outbox: events written with final states, leased to relays, delivered, parked.

use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

use crate::outbox::{Delivery, OutboxEvent};
use crate::store::StoreError;
use crate::telemetry::stats::EventStats;

/// The outbox: events written with final states, leased to relays, delivered, parked.
#[async_trait]
pub trait Events: Send + Sync + std::fmt::Debug {
    /// Outbox: leases up to `limit` deliverable events of `operations` to the
    /// relay holding `token` for `lease`: pending, due, not leased by another
    /// relay, and with no earlier pending event of the same scope (order per
    /// scope). `FOR UPDATE SKIP LOCKED` / the single writer: two relays never
    /// hold one event.
    async fn take_events(&self, operations: &[&str], limit: u32, lease: Duration, token: Uuid) -> Result<Vec<OutboxEvent>, StoreError>;

    /// [`take_events`](Self::take_events), and whether it left deliverable
    /// events behind that the next take would find at once (a relay that is
    /// caught up may wait a moment before taking again; one that is not
    /// takes again at once). By default: whether it took `limit`.
    /// PostgreSQL's log also says so when it stopped in a lane's batch or set
    /// events aside.
    async fn take_events_more(
        &self,
        operations: &[&str],
        limit: u32,
        lease: Duration,
        token: Uuid,
    ) -> Result<(Vec<OutboxEvent>, bool), StoreError> {
        let limit = limit.min(self.most_per_take());
        let events = self.take_events(operations, limit, lease, token).await?;
        let more = reached(&events, limit);
        Ok((events, more))
    }

    /// Outbox: events one take of [`Events::take_events_more`] leases at
    /// most, whatever the relay asks for (by default no bound of its own).
    fn most_per_take(&self) -> u32 {
        u32::MAX
    }

    /// Outbox: receivers answered 2xx to these events; marks them sent in one
    /// statement and returns the ones this relay still held (the others were
    /// taken over after their lease ran out, and will be delivered again).
    /// (PostgreSQL: the relay's place in the log moves on past them.)
    async fn events_delivered(&self, seqs: &[i64], token: Uuid) -> Result<Vec<i64>, StoreError>;

    /// Outbox: a delivery failed; due again after `retry_after`, or parked.
    async fn event_failed(&self, seq: i64, token: Uuid, error: &str, retry_after: Duration, park: bool) -> Result<bool, StoreError>;

    /// Outbox: one delivery (a POST) of these events, none of them attempted
    /// before, failed: each is recorded as by [`Events::event_failed`], its
    /// first attempt made. Returns those this relay still held. By default
    /// one at a time; PostgreSQL's log records them in one statement (a
    /// failing round of a thousand events would otherwise settle them one
    /// by one).
    async fn first_attempts_failed(
        &self,
        seqs: &[i64],
        token: Uuid,
        error: &str,
        retry_after: Duration,
        park: bool,
    ) -> Result<Vec<i64>, StoreError> {
        let mut held = Vec::new();
        for &seq in seqs {
            if self.event_failed(seq, token, error, retry_after, park).await? {
                held.push(seq);
            }
        }
        Ok(held)
    }

    /// Outbox: events this relay took and does not deliver now (a
    /// destination backed off or at its limit): released, due again after
    /// `retry_after`, their attempts unchanged. Returns those it still held.
    async fn events_deferred(&self, seqs: &[i64], token: Uuid, retry_after: Duration) -> Result<Vec<i64>, StoreError>;

    /// Outbox: events, newest first, optionally only those in one delivery state.
    async fn events(&self, delivery: Option<Delivery>, limit: u32) -> Result<Vec<OutboxEvent>, StoreError>;

    /// Outbox: a parked (or sent) event delivered again, from its first attempt.
    async fn redeliver(&self, event_id: Uuid) -> Result<bool, StoreError>;

    /// Outbox: deletes up to `batch` delivered events sent more than `older_than` ago.
    async fn sweep_events(&self, batch: u32, older_than: Duration) -> Result<u64, StoreError>;

    /// Outbox: pending and parked counts, and when the oldest pending was written.
    async fn event_stats(&self) -> Result<EventStats, StoreError>;
}

/// Whether a take reached its `limit`: events may be left behind.
pub fn reached(taken: &[OutboxEvent], limit: u32) -> bool {
    taken.len() >= usize::try_from(limit).unwrap_or(usize::MAX)
}
