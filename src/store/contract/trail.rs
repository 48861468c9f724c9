//! The audit trail and what an operator reads of one scope.

use async_trait::async_trait;
use bytes::Bytes;

use crate::idempotency::key::Scope;
use crate::idempotency::record::{Record, Timestamp};
use crate::store::StoreError;
use crate::store::audit::AuditEntry;

/// What the operator console's record page reads of one scope besides the
/// record: the stored request (async) or request line (sync, probed routes),
/// the reconciler's inconclusive probes of this generation, and the scope's
/// audit rows (newest first).
#[derive(Debug, Clone)]
pub struct Inspection {
    pub record: Record,
    /// The store's clock when the record was read.
    pub now: Timestamp,
    pub request: Option<Bytes>,
    pub probe_attempts: i32,
    pub next_probe_at: Option<Timestamp>,
    /// What the last of those probes said (`None` before the first).
    pub probe_last_answer: Option<String>,
    pub audit: Vec<AuditEntry>,
}

/// The audit trail and what an operator reads of one scope.
#[async_trait]
pub trait Trail: Send + Sync + std::fmt::Debug {
    /// The audit trail, newest first.
    async fn audit(&self, limit: u32) -> Result<Vec<AuditEntry>, StoreError>;

    /// The scope's record with what the console shows beside it (at most
    /// `audit_limit` audit rows of the scope); `None` without a record.
    async fn inspect(&self, scope: &Scope, audit_limit: u32) -> Result<Option<Inspection>, StoreError>;
}
