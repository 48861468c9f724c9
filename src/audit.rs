//! The audit trail: every state change made by a person or by the reconciler
//! (who, when, why, from which state to which). Written in the same
//! transaction as the change itself; kept after the record is swept.

use std::fmt;

use crate::record::{Generation, State, Timestamp};
use crate::scope::Scope;

/// Who changed a record outside the request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Actor {
    /// `idemgate keys resolve` on the command line.
    Cli,
    /// The admin HTTP API.
    Admin,
    /// The reconciler's probe.
    Reconciler,
}

impl Actor {
    pub const ALL: [Actor; 3] = [Actor::Cli, Actor::Admin, Actor::Reconciler];

    pub fn as_str(self) -> &'static str {
        match self {
            Actor::Cli => "cli",
            Actor::Admin => "admin",
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
}

/// `to_state` for a change that leaves the record in `state` (or deletes it).
pub fn to_state(state: Option<State>) -> &'static str {
    state.map_or(RELEASED, State::as_str)
}
