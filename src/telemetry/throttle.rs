//! Warnings that an outage repeats (one per request whose claim fails, per
//! retry of a result write, per readiness probe) are logged when they start
//! and then at most once per [`WINDOW`] per call site, each line with
//! `suppressed`: how many were left out since the previous one. Metrics still
//! count every occurrence; only the log is thinned, so an outage of the store
//! does not bury everything else in it.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// At most one line per call site in this long.
pub const WINDOW: Duration = Duration::from_secs(10);

/// One call site's state: when it last logged, and what it left out since.
#[derive(Debug)]
pub struct Throttle {
    state: Mutex<Option<(Instant, u64)>>,
}

impl Default for Throttle {
    fn default() -> Self {
        Throttle::new()
    }
}

impl Throttle {
    pub const fn new() -> Throttle {
        Throttle { state: Mutex::new(None) }
    }

    /// `Some(suppressed)` when this occurrence is to be logged (the first,
    /// or the first after [`WINDOW`]), `None` when it is left out.
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(Instant::now(), WINDOW)
    }

    fn allow_at(&self, now: Instant, window: Duration) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let suppressed = match *state {
            Some((last, n)) if now.saturating_duration_since(last) < window => {
                *state = Some((last, n + 1));
                return None;
            }
            Some((_, n)) => n,
            None => 0,
        };
        *state = Some((now, 0));
        Some(suppressed)
    }
}

/// `tracing::warn!` through a [`Throttle`] of its own call site; the line
/// gains a `suppressed` field.
macro_rules! warn_throttled {
    ($($arg:tt)+) => {{
        static THROTTLE: $crate::telemetry::throttle::Throttle = $crate::telemetry::throttle::Throttle::new();
        if let Some(suppressed) = THROTTLE.allow() {
            ::tracing::warn!(suppressed, $($arg)+);
        }
    }};
}
pub(crate) use warn_throttled;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_the_first_then_once_per_window_with_the_count_left_out() {
        let t = Throttle::new();
        let start = Instant::now();
        let w = Duration::from_secs(10);
        assert_eq!(t.allow_at(start, w), Some(0));
        for ms in [1, 500, 9_999] {
            assert_eq!(t.allow_at(start + Duration::from_millis(ms), w), None);
        }
        assert_eq!(t.allow_at(start + Duration::from_secs(10), w), Some(3));
        assert_eq!(t.allow_at(start + Duration::from_secs(11), w), None);
        assert_eq!(t.allow_at(start + Duration::from_secs(30), w), Some(1));
    }
}
