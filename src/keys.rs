//! `idemgate keys`: what operators see of records, and manual reconciliation.

use std::fmt::Write as _;

use serde_json::json;

use crate::record::{Record, State};

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
        "derived_key": r.scope.derived_key(secret),
        "state": r.state.as_str(),
        "generation": r.generation.0,
        "owner": r.owner,
        "request_hash": r.request_hash.to_string(),
        "lease_expires_at": r.lease_expires_at.map(|t| t.to_string()),
        "created_at": r.created_at.to_string(),
        "updated_at": r.updated_at.to_string(),
        "expires_at": if r.state == State::Completed { Some(r.expires_at.to_string()) } else { None },
        "response": response,
    })
}

/// A table for `keys list`.
pub fn list_table(records: &[Record]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<10} {:<16} {:<16} {:<20} {:<24} {:>4} {:<27}",
        "STATE", "TENANT", "PRINCIPAL", "OPERATION", "KEY", "GEN", "UPDATED"
    );
    for r in records {
        let _ = writeln!(
            out,
            "{:<10} {:<16} {:<16} {:<20} {:<24} {:>4} {:<27}",
            r.state.as_str(),
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
    let _ = writeln!(
        out,
        "derived key: {} (the Idempotency-Key the upstream saw, unless forward_key = \"client\")",
        r.scope.derived_key(secret)
    );
    let _ = writeln!(out, "state:       {}", r.state);
    let _ = writeln!(out, "generation:  {}", r.generation);
    let _ = writeln!(out, "owner:       {}", r.owner);
    let _ = writeln!(out, "created_at:  {}", r.created_at);
    let _ = writeln!(out, "updated_at:  {}", r.updated_at);
    if let Some(l) = r.lease_expires_at {
        let _ = writeln!(out, "lease until: {l}");
    }
    if r.state == State::Completed {
        let _ = writeln!(out, "expires_at:  {}", r.expires_at);
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
            "\nThe upstream may have executed this request. Find out, then either\n  idemgate keys resolve ... --release             (it did not happen: the client may retry)\n  idemgate keys resolve ... --complete --status N (it happened: record what to replay)"
        );
    }
    out
}
