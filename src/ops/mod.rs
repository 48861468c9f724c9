//! The operator's side: the admin listener and API, the `idemgate keys`
//! commands (one implementation both use), and the container health check.

pub mod admin;
pub mod healthcheck;
pub mod keys;
