//! Waiting between tries, in one place: an exponential [`Backoff`] (jittered
//! where replicas that failed together would otherwise retry in step), and
//! [`while_leased`], the loop for a write that must land while a claim's lease
//! still holds (a result, a release, the abandon of an unconfirmed claim).
//!
//! Which waits are jittered: the ones many replicas share a reason for (the
//! store coming back at start-up, a webhook receiver, the writes retried while
//! the store blinks). Waits that are configured and documented as a schedule
//! (an async route's `backoff`, a probe's `interval`) and the idle polls of
//! one replica's own loops are not.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// `first`, doubling after each failure, at most `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
}

impl Backoff {
    pub const fn new(first: Duration, max: Duration) -> Backoff {
        Backoff { first, max }
    }

    /// The wait after `failures` failures in a row (1: the first failure
    /// waits `first`): `first` doubled `failures - 1` times, at most `max`,
    /// never less than `first`.
    pub fn after(self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(30);
        self.first.saturating_mul(1 << doublings).min(self.max).max(self.first)
    }

    /// [`Backoff::after`] scaled by a random factor in `0.5..1.0`.
    pub fn jittered(self, failures: u32) -> Duration {
        self.after(failures).mul_f64(jitter())
    }
}

/// A random factor in `0.5..1.0`.
pub fn jitter() -> f64 {
    let mut bytes = [0u8; 8];
    // Without randomness (never seen on Linux) the wait is the plain backoff's
    // upper half; nothing depends on it being random but the spread.
    if getrandom::fill(&mut bytes).is_err() {
        return 0.75;
    }
    let bits = u64::from_le_bytes(bytes) >> 11;
    0.5 + bits as f64 / (1u64 << 53) as f64 / 2.0
}

/// The waits of [`while_leased`]: a quarter second, doubling to a second,
/// jittered.
pub const WHILE_LEASED: Backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(1));

/// Tries `attempt` until it returns `Some`, waiting [`WHILE_LEASED`]
/// (jittered) between tries, and gives up (`None`) when the next try would
/// start at or after `deadline`. `failed_before`: the caller already tried
/// once and failed, so the first try here waits first.
///
/// The deadline is the lease's end on this process's clock; the lease's real
/// end is on the store's clock, and every write retried this way is fenced,
/// so a try that lands after it is refused, never harmful.
pub async fn while_leased<T, F, Fut>(deadline: Instant, failed_before: bool, mut attempt: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let mut failures = u32::from(failed_before);
    loop {
        if failures > 0 {
            let pause = WHILE_LEASED.jittered(failures);
            if Instant::now() + pause >= deadline {
                return None;
            }
            tokio::time::sleep(pause).await;
        }
        if let Some(done) = attempt().await {
            return Some(done);
        }
        failures = failures.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_and_never_drops_below_its_first_wait() {
        let b = Backoff::new(Duration::from_millis(250), Duration::from_secs(10));
        let waits: Vec<u128> = (1..=8).map(|n| b.after(n).as_millis()).collect();
        assert_eq!(waits, vec![250, 500, 1000, 2000, 4000, 8000, 10_000, 10_000]);
        assert_eq!(b.after(0), b.first);
        assert_eq!(b.after(u32::MAX), b.max);
        // A cap below the first wait: the first wait wins.
        assert_eq!(Backoff::new(Duration::from_secs(5), Duration::from_secs(1)).after(3), Duration::from_secs(5));
    }

    #[test]
    fn jitter_spreads_over_the_upper_half() {
        let b = Backoff::new(Duration::from_millis(1000), Duration::from_secs(10));
        let waits: Vec<Duration> = (0..200).map(|_| b.jittered(1)).collect();
        assert!(waits.iter().all(|w| (Duration::from_millis(500)..Duration::from_millis(1000)).contains(w)), "{waits:?}");
        let (lo, hi) = (waits.iter().min().unwrap(), waits.iter().max().unwrap());
        assert!(*hi - *lo > Duration::from_millis(100), "no spread: {lo:?}..{hi:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn while_leased_tries_until_done_or_the_deadline() {
        let start = Instant::now();
        let mut tries = 0;
        let done = while_leased(start + Duration::from_secs(10), false, || {
            tries += 1;
            let t = tries;
            async move { (t == 3).then_some(t) }
        })
        .await;
        assert_eq!(done, Some(3));
        // Two failures waited 125-250 ms and 250-500 ms.
        let waited = start.elapsed();
        assert!((Duration::from_millis(375)..Duration::from_millis(750)).contains(&waited), "{waited:?}");

        let start = Instant::now();
        let mut tries = 0u32;
        let never = while_leased(start + Duration::from_secs(3), true, || {
            tries += 1;
            async { None::<()> }
        })
        .await;
        assert_eq!(never, None);
        assert!(start.elapsed() < Duration::from_secs(3), "a try started after the deadline");
        // Waits of at most 250, 500, then 1000 ms each: at least four tries in 3 s.
        assert!(tries >= 4, "{tries} tries");
    }
}
