//! Operator commands over records: what `idemgate keys` and the admin API
//! show. Resolving a record, which they share with the reconciler, is
//! [`crate::store::resolution`].

use std::fmt::Write as _;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bytes::Bytes;
use serde_json::json;

use crate::idempotency::key::{IdempotencyKey, Scope};
use crate::idempotency::record::Retention;
use crate::idempotency::record::{Record, State, Timestamp};
use crate::store::audit::AuditEntry;
use crate::store::{ListCursor, ListFilter, Store, StoreError};

/// One page of `keys list` / `GET /admin/records`.
#[derive(Debug, Clone)]
pub struct Page {
    pub records: Vec<Record>,
    /// Where the next page starts (opaque); `None` on the last page.
    pub next_cursor: Option<String>,
}

/// The one implementation of listing: records matching `filter` (newest
/// first), at most `filter.limit`, and the cursor of the next page if there
/// is one.
pub async fn list(store: &Store, filter: &ListFilter) -> Result<Page, StoreError> {
    let limit = filter.limit as usize;
    // One more than asked tells whether a next page exists.
    let probe = ListFilter { limit: filter.limit.saturating_add(1), ..filter.clone() };
    let mut records = store.list(&probe).await?;
    let next_cursor = if records.len() > limit {
        records.truncate(limit);
        records.last().map(|r| encode_cursor(&ListCursor::after(r)))
    } else {
        None
    };
    Ok(Page { records, next_cursor })
}

/// A page as JSON (`keys list --json`, `GET /admin/records`): records
/// without bodies, and `next_cursor`.
pub fn page_json(page: &Page, secret: Option<&[u8]>) -> serde_json::Value {
    let records: Vec<_> = page.records.iter().map(|r| record_json(r, false, secret)).collect();
    json!({ "records": records, "next_cursor": page.next_cursor })
}

/// A cursor as clients see it: opaque (base64url of the position).
pub fn encode_cursor(c: &ListCursor) -> String {
    let s = &c.scope;
    let position = json!([c.updated_at.0, &*s.tenant, &*s.principal, &*s.operation, s.key.as_str()]);
    URL_SAFE_NO_PAD.encode(position.to_string())
}

/// A cursor that `encode_cursor` did not make.
#[derive(Debug, thiserror::Error)]
#[error("invalid cursor: pass the next_cursor of the previous page unchanged")]
pub struct InvalidCursor;

pub fn decode_cursor(s: &str) -> Result<ListCursor, InvalidCursor> {
    let bytes = URL_SAFE_NO_PAD.decode(s.trim()).map_err(|_| InvalidCursor)?;
    let (at, tenant, principal, operation, key): (i64, String, String, String, String) =
        serde_json::from_slice(&bytes).map_err(|_| InvalidCursor)?;
    let key = IdempotencyKey::new(&key).map_err(|_| InvalidCursor)?;
    Ok(ListCursor {
        updated_at: Timestamp(at),
        scope: Scope { tenant: tenant.into(), principal: principal.into(), operation: operation.into(), key },
    })
}

/// One record as JSON (bodies as UTF-8 text when they are, else base16).
pub fn record_json(r: &Record, with_body: bool, secret: Option<&[u8]>) -> serde_json::Value {
    let response = r.response.as_ref().map(|resp| {
        let headers: Vec<serde_json::Value> = resp.headers.iter().map(|(n, v)| json!([n, String::from_utf8_lossy(v)])).collect();
        let mut o = json!({
            "status": resp.status,
            "headers": headers,
            "body_stored": resp.body.is_some(),
            "body_bytes": resp.body.as_ref().map(|b| b.len()),
        });
        if with_body && let Some(b) = &resp.body {
            o["body"] = match std::str::from_utf8(b) {
                Ok(s) => json!(s),
                Err(_) => json!({ "hex": hex::encode(b) }),
            };
        }
        o
    });
    json!({
        "tenant": &*r.scope.tenant,
        "principal": &*r.scope.principal,
        "operation": &*r.scope.operation,
        "key": r.scope.key.as_str(),
        "scope_id": r.scope.scope_id().to_string(),
        "derived_key": r.scope.derived_key(secret),
        "state": r.state.as_str(),
        "generation": r.generation.0,
        "owner": r.owner,
        "request_hash": r.request_hash.to_string(),
        "lease_expires_at": r.lease_expires_at.map(|t| t.to_string()),
        "created_at": r.created_at.to_string(),
        "updated_at": r.updated_at.to_string(),
        "expires_at": if r.state.is_retained() { Some(expires_text(r)) } else { None },
        "key_source": r.key_source,
        "response_status": r.response.as_ref().map(|resp| resp.status),
        "response_size": r.response.as_ref().and_then(|resp| resp.body.as_ref()).map(Bytes::len),
        "operation_id": r.operation_id,
        "response": response,
    })
}

/// When a completed record stops being replayed: a time, or `forever`.
fn expires_text(r: &Record) -> String {
    if r.expires_at == Timestamp::FOREVER { "forever".to_owned() } else { r.expires_at.to_string() }
}

/// A table for `keys list`.
pub fn list_table(records: &[Record]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<10} {:<16} {:<16} {:<16} {:<20} {:<24} {:>4} {:<27}",
        "STATE", "SCOPE_ID", "TENANT", "PRINCIPAL", "OPERATION", "KEY", "GEN", "UPDATED"
    );
    for r in records {
        let _ = writeln!(
            out,
            "{:<10} {:<16} {:<16} {:<16} {:<20} {:<24} {:>4} {:<27}",
            r.state.as_str(),
            r.scope.scope_id().to_string(),
            r.scope.tenant,
            r.scope.principal,
            r.scope.operation,
            r.scope.key.as_str(),
            r.generation.0,
            r.updated_at.to_string()
        );
    }
    let _ = writeln!(out, "{} record(s)", records.len());
    out
}

/// Human-readable `keys show`.
pub fn show_text(r: &Record, secret: Option<&[u8]>) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "scope:       tenant={} principal={} operation={} key={}",
        r.scope.tenant,
        r.scope.principal,
        r.scope.operation,
        r.scope.key.as_str()
    );
    let _ = writeln!(out, "scope id:    {} (as logs print it: scope=...)", r.scope.scope_id());
    let _ = writeln!(
        out,
        "derived key: {} (the Idempotency-Key the upstream saw, unless forward_key = \"client\")",
        r.scope.derived_key(secret)
    );
    let _ = writeln!(out, "key source:  {}", r.key_source.as_deref().unwrap_or("(not recorded: claimed before key sources were)"));
    let _ = writeln!(out, "state:       {}", r.state);
    let _ = writeln!(out, "generation:  {}", r.generation);
    let _ = writeln!(out, "owner:       {}", r.owner);
    let _ = writeln!(out, "created_at:  {}", r.created_at);
    let _ = writeln!(out, "updated_at:  {}", r.updated_at);
    if let Some(l) = r.lease_expires_at {
        let _ = writeln!(out, "lease until: {l}");
    }
    if r.state.is_retained() {
        let _ = writeln!(out, "expires_at:  {}", expires_text(r));
    }
    match &r.response {
        Some(resp) => {
            let _ = writeln!(
                out,
                "response:    {} ({} header(s), body: {})",
                resp.status,
                resp.headers.len(),
                resp.body.as_ref().map_or("not stored (over max_stored_response)".to_owned(), |b| format!("{} bytes", b.len()))
            );
        }
        None => {
            let _ = writeln!(out, "response:    none");
        }
    }
    if r.state == State::Unknown {
        let _ = writeln!(
            out,
            "\nThe upstream may have executed this request. Find out, then either\n  idemgate keys resolve ... --release --reason '...'             (it did not happen: the client may retry)\n  idemgate keys resolve ... --complete --status N --reason '...' (it happened: record what to replay)"
        );
    }
    out
}

/// The retention a hand-made completion gets when none is given: its route's,
/// else a day.
pub fn default_retention(routes: &[crate::request::route::Route], operation: &str) -> Retention {
    routes.iter().find(|r| &*r.operation == operation).map_or(Retention::For(Duration::from_secs(24 * 3600)), |r| r.record.retention)
}

/// A scope as JSON.
pub fn scope_json(s: &Scope) -> serde_json::Value {
    json!({ "tenant": &*s.tenant, "principal": &*s.principal, "operation": &*s.operation, "key": s.key.as_str() })
}

/// The audit trail as JSON (`keys audit --json`, `GET /admin/audit`):
/// `{"entries": [...]}`, newest first.
pub fn audit_page_json(entries: &[AuditEntry]) -> serde_json::Value {
    json!({ "entries": entries.iter().map(audit_json).collect::<Vec<_>>() })
}

/// One audit row as JSON.
pub fn audit_json(a: &AuditEntry) -> serde_json::Value {
    json!({
        "id": a.id,
        "at": a.at.to_string(),
        "actor": a.actor,
        "scope": scope_json(&a.scope),
        "from_state": a.from_state,
        "to_state": a.to_state,
        "reason": a.reason,
        "forced": a.forced,
        "generation": a.generation.map(|g| g.0),
        "peer": a.peer,
        "token": a.token,
    })
}

/// A table for `keys audit`.
pub fn audit_table(entries: &[AuditEntry]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{:<27} {:<10} {:<10} {:<10} {:<40} REASON", "AT", "ACTOR", "FROM", "TO", "SCOPE");
    for a in entries {
        let scope =
            printable(&format!("{}/{}/{}/{}", a.scope.tenant, a.scope.principal, a.scope.operation, a.scope.key.as_str())).into_owned();
        // An admin API change names its caller: `admin@10.0.0.7:51234`.
        let actor = match &a.peer {
            Some(peer) => format!("{}@{peer}", a.actor),
            None => a.actor.clone(),
        };
        let _ = writeln!(
            out,
            "{:<27} {:<10} {:<10} {:<10} {:<40} {}{}",
            a.at.to_string(),
            actor,
            a.from_state,
            a.to_state,
            scope,
            if a.forced { "[forced] " } else { "" },
            printable(&a.reason)
        );
    }
    out
}

/// Text as a terminal may print it: control characters (rows written before
/// reasons were checked may have them) escaped as `\n`, `\u{1b}`.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(s);
    }
    std::borrow::Cow::Owned(s.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect())
}
