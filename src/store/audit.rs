//! The audit trail: every state change made by a person or by the reconciler
//! (who, when, why, from which state to which). Written in the same
//! transaction as the change itself; kept after the record is swept. A
//! change made through the admin API also names its caller: the peer
//! address and a label of the token it presented (never the token).

use std::fmt;

use crate::idempotency::key::Scope;
use crate::idempotency::record::{Generation, State, Timestamp};

/// Who changed a record outside the request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Actor {
    /// `idemgate keys resolve` on the command line.
    Cli,
    /// The admin HTTP API.
    Admin,
    /// The operator console (the admin API, called by the console's page,
    /// which says so with `X-Idemgate-Actor: console`).
    Console,
    /// The reconciler's probe.
    Reconciler,
}

impl Actor {
    pub const ALL: [Actor; 4] = [Actor::Cli, Actor::Admin, Actor::Console, Actor::Reconciler];

    pub fn as_str(self) -> &'static str {
        match self {
            Actor::Cli => "cli",
            Actor::Admin => "admin",
            Actor::Console => "console",
            Actor::Reconciler => "reconciler",
        }
    }

    pub fn parse(s: &str) -> Option<Actor> {
        Actor::ALL.into_iter().find(|a| a.as_str() == s)
    }
}

impl fmt::Display for Actor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the caller of a change says about it; the store adds the states.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditNote {
    pub actor: Actor,
    pub reason: String,
    /// The change overrode the usual rule (a completed record resolved).
    pub forced: bool,
    /// Who asked over the network (the admin API); `None` for the CLI and
    /// the reconciler.
    pub caller: Option<Caller>,
}

/// An admin API caller, as the audit trail records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The connection's peer address (`10.0.0.7:51234`).
    pub peer: String,
    /// Which token it presented: see [`token_label`].
    pub token: String,
}

/// A label that tells tokens apart without revealing them: `hmac:` and the
/// first 12 hex digits of the HMAC-SHA256 of the token under `key` (the
/// deployment's derived-key secret, or a key of the process when it is not
/// known). Unlike a bare hash, a label cannot be turned back into a
/// guessable token offline by whoever reads a log line.
pub fn token_label(token: &str, key: &[u8]) -> String {
    use hmac::{Hmac, KeyInit, Mac};
    let Ok(mut mac) = <Hmac<sha2::Sha256> as KeyInit>::new_from_slice(key) else { return "hmac:?".to_owned() };
    mac.update(b"idemgate admin token label\0");
    mac.update(token.as_bytes());
    let tag = mac.finalize().into_bytes();
    format!("hmac:{}", hex::encode(tag.get(..6).unwrap_or_default()))
}

/// The state a record is left in by a change: a state, or deleted.
pub const RELEASED: &str = "released";

/// One row of the trail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEntry {
    pub id: i64,
    pub at: Timestamp,
    pub actor: String,
    pub scope: Scope,
    pub from_state: String,
    /// A record state, or [`RELEASED`].
    pub to_state: String,
    pub reason: String,
    pub forced: bool,
    /// The record's generation after the change (`None`: it was deleted).
    pub generation: Option<Generation>,
    /// The admin API caller's peer address and token label (rows written
    /// before migration 0012, and CLI or reconciler changes: `None`).
    pub peer: Option<String>,
    pub token: Option<String>,
}

/// `to_state` for a change that leaves the record in `state` (or deletes it).
pub fn to_state(state: Option<State>) -> &'static str {
    state.map_or(RELEASED, State::as_str)
}
