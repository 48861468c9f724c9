//! What the gateway tells its operator: Prometheus metrics, the log and its
//! writer, the store's counts behind the gauges, and the throttle that thins
//! warnings an outage repeats.

pub mod logging;
pub mod metrics;
pub mod stats;
pub mod throttle;
