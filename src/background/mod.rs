//! The background tasks: each is named, takes the shutdown token, survives
//! store errors and runs on a supervised tracker.
//!
//! - [`housekeeping`]: the sweeper, the lease reaper and the record counters
//!   (started by [`crate::server::Server`]; the reaper's list of routes by
//!   [`crate::server::route_tasks`]).
//! - [`async_worker`]: the async workers that run queued operations.
//! - [`reconciler`]: settles `unknown` records with a route's probe.
//! - [`outbox_relay`]: delivers the [`crate::outbox`]'s completion events.
//!
//! The last three follow the routes in force and are started, and restarted
//! by a reload, by [`crate::server::route_tasks::RouteTasks`].

pub mod async_worker;
pub mod housekeeping;
pub mod outbox_relay;
pub mod reconciler;
