//! The record row, shared by the backends: its columns ([`RECORD_COLUMNS`],
//! each at a named position in [`col`]) and the mapping from their values to
//! a [`Record`] ([`RecordRow`]); and the encoding of stored response headers
//! (one `bytea`/`BLOB` column).
//!
//! Each backend reads the values with its own driver's types (PostgreSQL's
//! `timestamptz` and `uuid`, SQLite's integers and blobs) into a
//! [`RecordRow`]; what a value means, and which values no record has, is
//! decided here once.
//!
//! Format, version 1: a `0x01` byte, then per header a big-endian `u16` name
//! length, the name, a big-endian `u32` value length and the raw value bytes.
//! Header values need not be UTF-8, so JSON would be lossy; `keys show`
//! decodes this for operators.

use bytes::Bytes;
use uuid::Uuid;

use super::StoreError;
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::{IdempotencyKey, Scope};
use crate::idempotency::record::{Generation, Record, ReforwardKey, State, StoredResponse, Timestamp};

const VERSION: u8 = 1;

pub fn encode_headers(headers: &[(String, Vec<u8>)]) -> Vec<u8> {
    let len = 1 + headers.iter().map(|(n, v)| 6 + n.len() + v.len()).sum::<usize>();
    let mut out = Vec::with_capacity(len);
    out.push(VERSION);
    for (name, value) in headers {
        // Names and values come from hyper's HeaderMap, far below these limits.
        let n = u16::try_from(name.len()).unwrap_or(u16::MAX);
        let v = u32::try_from(value.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&n.to_be_bytes());
        out.extend_from_slice(&name.as_bytes()[..n as usize]);
        out.extend_from_slice(&v.to_be_bytes());
        out.extend_from_slice(&value[..v as usize]);
    }
    out
}

pub fn decode_headers(bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
    let bad = |what: &str| StoreError::Corrupt(format!("stored headers: {what}"));
    let (&version, mut rest) = bytes.split_first().ok_or_else(|| bad("empty"))?;
    if version != VERSION {
        return Err(bad("unknown encoding version"));
    }
    let mut out = Vec::new();
    while !rest.is_empty() {
        let (n, r) = take(rest, 2).ok_or_else(|| bad("truncated name length"))?;
        let n = u16::from_be_bytes([n[0], n[1]]) as usize;
        let (name, r) = take(r, n).ok_or_else(|| bad("truncated name"))?;
        let (v, r) = take(r, 4).ok_or_else(|| bad("truncated value length"))?;
        let v = u32::from_be_bytes([v[0], v[1], v[2], v[3]]) as usize;
        let (value, r) = take(r, v).ok_or_else(|| bad("truncated value"))?;
        let name = std::str::from_utf8(name).map_err(|_| bad("name is not UTF-8"))?;
        out.push((name.to_owned(), value.to_vec()));
        rest = r;
    }
    Ok(out)
}

/// The record's columns, in the order every statement that reads a record
/// returns them first (both backends name them alike).
pub const RECORD_COLUMNS: &str = "tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner, \
     lease_expires_at, response_status, response_headers, response_body, created_at, updated_at, expires_at, \
     operation_id, attempts, next_attempt_at, sent_at, last_status, maybe_executed, key_source, reforward_key, fingerprint_spec";

/// Where each of [`RECORD_COLUMNS`] is in a row, and [`col::END`], where a
/// statement's own columns after them start.
pub mod col {
    pub const TENANT: usize = 0;
    pub const PRINCIPAL: usize = 1;
    pub const OPERATION: usize = 2;
    pub const IDEMPOTENCY_KEY: usize = 3;
    pub const REQUEST_HASH: usize = 4;
    pub const STATE: usize = 5;
    pub const GENERATION: usize = 6;
    pub const CLAIM_TOKEN: usize = 7;
    pub const OWNER: usize = 8;
    pub const LEASE_EXPIRES_AT: usize = 9;
    pub const RESPONSE_STATUS: usize = 10;
    pub const RESPONSE_HEADERS: usize = 11;
    pub const RESPONSE_BODY: usize = 12;
    pub const CREATED_AT: usize = 13;
    pub const UPDATED_AT: usize = 14;
    pub const EXPIRES_AT: usize = 15;
    pub const OPERATION_ID: usize = 16;
    pub const ATTEMPTS: usize = 17;
    pub const NEXT_ATTEMPT_AT: usize = 18;
    pub const SENT_AT: usize = 19;
    pub const LAST_STATUS: usize = 20;
    pub const MAYBE_EXECUTED: usize = 21;
    pub const KEY_SOURCE: usize = 22;
    pub const REFORWARD_KEY: usize = 23;
    pub const FINGERPRINT_SPEC: usize = 24;
    /// The first column after the record's.
    pub const END: usize = 25;
}

/// One record row's values as a backend reads them from its driver (each
/// converts its own column types: timestamps, the claim token);
/// [`RecordRow::into_record`] checks them and makes the record, the same way
/// for every backend.
#[derive(Debug)]
pub struct RecordRow<'a> {
    pub tenant: &'a str,
    pub principal: &'a str,
    pub operation: &'a str,
    pub idempotency_key: &'a str,
    pub request_hash: &'a [u8],
    pub state: &'a str,
    pub generation: i64,
    pub claim_token: Uuid,
    pub owner: String,
    pub lease_expires_at: Option<Timestamp>,
    pub response_status: Option<i64>,
    pub response_headers: Option<&'a [u8]>,
    pub response_body: Option<Bytes>,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
    pub expires_at: Timestamp,
    pub operation_id: Option<String>,
    pub attempts: i32,
    pub next_attempt_at: Option<Timestamp>,
    pub sent_at: Option<Timestamp>,
    pub last_status: Option<i64>,
    pub maybe_executed: bool,
    pub key_source: Option<String>,
    /// `<kind>:<claim token>` (see [`this_life`]).
    pub reforward_key: Option<&'a str>,
    /// `<digest>:<claim token>`.
    pub fingerprint_spec: Option<&'a str>,
}

impl RecordRow<'_> {
    /// The record, or `Corrupt` naming the column whose value no record has.
    pub fn into_record(self) -> Result<Record, StoreError> {
        let key = IdempotencyKey::new(self.idempotency_key).map_err(|e| StoreError::Corrupt(format!("idempotency_key: {e}")))?;
        let hash: [u8; 32] = self.request_hash.try_into().map_err(|_| StoreError::Corrupt("request_hash is not 32 bytes".into()))?;
        let state = State::parse(self.state).ok_or_else(|| StoreError::Corrupt(format!("unknown state {:?}", self.state)))?;
        let response = match self.response_status {
            None => None,
            Some(s) => Some(StoredResponse {
                status: u16::try_from(s).map_err(|_| StoreError::Corrupt(format!("response_status {s}")))?,
                headers: self.response_headers.map(decode_headers).transpose()?.unwrap_or_default(),
                body: self.response_body,
            }),
        };
        let last_status =
            self.last_status.map(|s| u16::try_from(s).map_err(|_| StoreError::Corrupt(format!("last_status {s}")))).transpose()?;
        Ok(Record {
            scope: Scope { tenant: self.tenant.into(), principal: self.principal.into(), operation: self.operation.into(), key },
            request_hash: Fingerprint(hash),
            state,
            generation: Generation(self.generation),
            claim_token: self.claim_token,
            owner: self.owner,
            lease_expires_at: self.lease_expires_at,
            response,
            created_at: self.created_at,
            updated_at: self.updated_at,
            expires_at: self.expires_at,
            operation_id: self.operation_id,
            attempts: self.attempts,
            next_attempt_at: self.next_attempt_at,
            sent_at: self.sent_at,
            last_status,
            maybe_executed: self.maybe_executed,
            key_source: self.key_source,
            reforward_key: of_this_life(self.reforward_key, self.claim_token).and_then(ReforwardKey::parse),
            sent_key: of_this_life(self.reforward_key, self.claim_token).and_then(ReforwardKey::parse_sent),
            fingerprint_spec: of_this_life(self.fingerprint_spec, self.claim_token).map(str::to_owned),
        })
    }
}

/// A fact a claim wrote about the record's current life (`reforward_key`,
/// `fingerprint_spec`): stored as `<value>:<claim token>`, and the value
/// only while the token is still the record's. A replica of an earlier
/// version that takes the record over writes a new token and leaves the
/// column as it was: the fact then belongs to an earlier life, and is none.
fn of_this_life(stored: Option<&str>, claim_token: Uuid) -> Option<&str> {
    let (value, token) = stored?.rsplit_once(':')?;
    (Uuid::parse_str(token).ok()? == claim_token).then_some(value)
}

/// `value` for this life of a record claimed with `claim_token`: what a claim
/// writes about the record's current life, which counts only while the
/// record keeps that token (a take-over by a replica of an earlier version
/// writes a new one and leaves the column).
pub fn this_life(value: &str, claim_token: Uuid) -> String {
    format!("{value}:{claim_token}")
}

fn take(b: &[u8], n: usize) -> Option<(&[u8], &[u8])> {
    (b.len() >= n).then(|| b.split_at(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each named position is its column's place in [`RECORD_COLUMNS`].
    #[test]
    fn named_positions_follow_the_column_list() {
        let names: Vec<&str> = RECORD_COLUMNS.split(',').map(str::trim).collect();
        assert_eq!(names.len(), col::END);
        let positions = [
            ("tenant", col::TENANT),
            ("principal", col::PRINCIPAL),
            ("operation", col::OPERATION),
            ("idempotency_key", col::IDEMPOTENCY_KEY),
            ("request_hash", col::REQUEST_HASH),
            ("state", col::STATE),
            ("generation", col::GENERATION),
            ("claim_token", col::CLAIM_TOKEN),
            ("owner", col::OWNER),
            ("lease_expires_at", col::LEASE_EXPIRES_AT),
            ("response_status", col::RESPONSE_STATUS),
            ("response_headers", col::RESPONSE_HEADERS),
            ("response_body", col::RESPONSE_BODY),
            ("created_at", col::CREATED_AT),
            ("updated_at", col::UPDATED_AT),
            ("expires_at", col::EXPIRES_AT),
            ("operation_id", col::OPERATION_ID),
            ("attempts", col::ATTEMPTS),
            ("next_attempt_at", col::NEXT_ATTEMPT_AT),
            ("sent_at", col::SENT_AT),
            ("last_status", col::LAST_STATUS),
            ("maybe_executed", col::MAYBE_EXECUTED),
            ("key_source", col::KEY_SOURCE),
            ("reforward_key", col::REFORWARD_KEY),
            ("fingerprint_spec", col::FINGERPRINT_SPEC),
        ];
        assert_eq!(positions.len(), col::END);
        for (name, at) in positions {
            assert_eq!(names[at], name);
        }
    }

    #[test]
    fn round_trip_and_corruption() {
        let h = vec![("content-type".to_owned(), b"application/json".to_vec()), ("x-bin".to_owned(), vec![0xff, 0x00, 0x80])];
        let enc = encode_headers(&h);
        assert_eq!(decode_headers(&enc).unwrap(), h);
        assert_eq!(decode_headers(&encode_headers(&[])).unwrap(), vec![]);
        assert!(decode_headers(&[]).is_err());
        assert!(decode_headers(&[2]).is_err());
        for cut in 1..enc.len() {
            // Every strict prefix that ends inside a header is rejected, never a panic.
            let r = decode_headers(&enc[..cut]);
            let ends_on_boundary = cut == 1 || cut == 1 + 2 + 12 + 4 + 16;
            assert_eq!(r.is_ok(), ends_on_boundary, "cut at {cut}");
        }
    }
}
