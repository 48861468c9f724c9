//! The operator's side: the admin listener and API, the operator console
//! it serves, the `idemgate keys` commands (one implementation both use),
//! and the container health check.

pub mod admin;
pub mod console;
pub mod healthcheck;
pub mod keys;
