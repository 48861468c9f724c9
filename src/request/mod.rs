//! What a request is asking for, read against the routes in force: which
//! route it is on, who sends it, whether they may, and where its key comes
//! from. Also the per-route pieces a [`route::Route`] carries for the
//! background tasks: its reconcile probe and, in async mode, the request as
//! stored for the workers.
//!
//! - [`route`]: routes and the router; request normalisation.
//! - [`identity`]: tenant and principal (API keys, trusted headers,
//!   [`identity::jwt`], [`identity::mtls`]).
//! - [`authorize`]: the external authorizer (`[routes.authorize]`).
//! - [`key_source`]: where a route's idempotency key comes from (`key_from`).
//! - [`async_op`]: async operations: the request as accepted and stored, the
//!   operation id clients poll, the status document.
//! - [`reconcile_probe`]: a route's `[routes.reconcile]` probe as configured
//!   (the background reconciler sends it).

pub mod async_op;
pub mod authorize;
pub mod identity;
pub mod key_source;
pub mod reconcile_probe;
pub mod route;
