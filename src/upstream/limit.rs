//! An upstream's concurrency limit: admission under overload.
//!
//! A request over the limit is refused *before its claim* (503 `overloaded`
//! with `Retry-After`): nothing is claimed, nothing is forwarded, and the
//! client's retry with the same key is safe. The alternative, forwarding
//! everything to an upstream that cannot keep up, turns each request that
//! queues past the upstream's timeout into an `unknown` record an operator
//! must reconcile.
//!
//! The limit is adaptive by default: a Vegas-style controller (as in
//! TCP Vegas and Netflix's concurrency-limits) compares each answer's
//! latency with the lowest latency of recent requests that met no queue of
//! ours (the upstream without a queue). While the estimated queue at the
//! upstream (`limit × (1 − min/latency)`) stays small the limit grows; when
//! it grows past a few requests the limit shrinks; a timeout, a refused
//! connection or a 429/503 from the upstream shrinks it by a tenth at once.
//! The lowest latency is read again every window of samples; when a steady
//! load left no request that met no queue, the limit is halved for a few
//! answers to read it (as TCP BBR drains its queue to read its lowest
//! round trip), so neither one fast answer nor a queued latency stays the
//! minimum. `max_in_flight` fixes it instead.
//!
//! One [`Limit`] is shared by every worker thread of a replica (and by the
//! async workers and the reconciler's probes); replicas do not share theirs
//! (docs/reference.md says how to size a fixed limit for several replicas).
//! The lock is a std mutex held for a few arithmetic steps, never across an
//! await.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::telemetry::metrics::LimitGauges;

/// Where the adaptive limit starts, before any answer says what the
/// upstream can take. Per replica: replicas starting together in front of a
/// slow upstream must not queue it past its timeout before the first answers
/// arrive (two at 20 each gave 4 unknown records of 354 against an upstream
/// serving 4 at a time; at 10, none). It grows by several requests per answer
/// while latency stays at its minimum, and an answer taking half the timeout
/// and twice the upstream's lowest latency cuts it.
pub const DEFAULT_INITIAL: u32 = 10;
/// The adaptive limit's ceiling unless `max_in_flight` sets one.
pub const DEFAULT_CEILING: u32 = 1000;
/// How long a request may wait for a slot by default (or a quarter of the
/// upstream's timeout when that is shorter). Long enough for a burst on a
/// healthy upstream to be served as slots free and the limit grows (32
/// concurrent first writes were refused at 50 ms on a busy machine), short
/// beside the timeout; nothing is claimed while a request waits.
pub const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_secs(1);
/// The `Retry-After` of a refusal.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);
/// After this many samples per unit of limit, the lowest latency is read
/// again from requests that met no queue, so that an upstream that became
/// slower for good, or one fast answer (a 4xx among slow writes), does not
/// set the limit for ever.
const REREAD_SAMPLES_PER_SLOT: f64 = 30.0;
/// The most answers a probe reads (fewer when its limit is smaller).
const PROBE_SAMPLES: u32 = 20;

/// How an upstream's limit is set (`[upstreams.limit]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LimitPolicy {
    /// No limit: every request is forwarded (in-flight requests are still counted).
    Unlimited,
    /// A fixed number of requests in flight.
    Fixed { max_in_flight: u32, queue_timeout: Duration },
    /// Follows the upstream's latency, between 1 and `ceiling`, judged
    /// against the upstream's `timeout` (see [`Controller::for_timeout`]).
    Adaptive { initial: u32, ceiling: u32, queue_timeout: Duration, timeout: Duration },
}

impl Default for LimitPolicy {
    fn default() -> LimitPolicy {
        LimitPolicy::Adaptive {
            initial: DEFAULT_INITIAL,
            ceiling: DEFAULT_CEILING,
            queue_timeout: DEFAULT_QUEUE_TIMEOUT,
            timeout: Duration::from_secs(10),
        }
    }
}

impl LimitPolicy {
    /// How long a request may wait for a slot.
    pub fn queue_timeout(&self) -> Duration {
        match self {
            LimitPolicy::Unlimited => Duration::ZERO,
            LimitPolicy::Fixed { queue_timeout, .. } | LimitPolicy::Adaptive { queue_timeout, .. } => *queue_timeout,
        }
    }
}

/// What became of a request that held a slot, for the adaptive limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sample {
    /// The upstream answered after `Duration` (its whole answer).
    Answered(Duration),
    /// The upstream is overloaded: it timed out, refused the connection, or
    /// answered 429 or 503.
    Dropped,
}

/// The controller's state: pure arithmetic, no clock and no I/O.
#[derive(Debug, Clone, PartialEq)]
pub struct Controller {
    limit: f64,
    ceiling: f64,
    /// The upstream's latency without a queue: the lowest of the requests
    /// that met no queue of ours in the last window (or lower since).
    min_latency: Option<Duration>,
    /// An answer this slow, and twice `min_latency`, counts as a drop.
    too_slow: Option<Duration>,
    /// Latency this far above the minimum is not taken for a queue.
    tolerance: Duration,
    /// The lowest latency seen under light load (at most half the limit in
    /// flight, so no queue of ours) since the last re-read.
    light_min: Option<Duration>,
    samples: u64,
    reread_at: u64,
    /// While the limit is held at half to read the lowest latency again.
    probe: Option<Probe>,
}

/// A window ended without a request that met no queue of ours: the limit is
/// held below half for a few answers, so that the requests sent then do.
#[derive(Debug, Clone, PartialEq)]
struct Probe {
    /// Answers to requests that met no queue still to read.
    left: u32,
    /// Answers after which the probe ends anyway (those sent before it drain first).
    budget: u64,
}

impl Controller {
    pub fn new(initial: u32, ceiling: u32) -> Controller {
        let ceiling = f64::from(ceiling.max(1));
        let limit = f64::from(initial.max(1)).min(ceiling);
        Controller {
            limit,
            ceiling,
            too_slow: None,
            tolerance: Duration::ZERO,
            min_latency: None,
            light_min: None,
            samples: 0,
            reread_at: reread_after(limit),
            probe: None,
        }
    }

    /// Judged against an upstream `timeout`: an answer that took half of it
    /// or longer, and twice the upstream's lowest latency or longer, counts
    /// as a sign of overload, as a timeout does (the limit shrinks before
    /// requests start to wait past the timeout; an upstream that answers in
    /// more than half its timeout without a queue is not held at 1); and latency
    /// within a hundredth of it above the minimum is not taken for a queue.
    /// Without that tolerance, an upstream answering in a fraction of a
    /// millisecond had its limit cut to a handful by scheduling jitter alone
    /// (a few milliseconds read as a queue of nearly the whole limit): 64
    /// clients of a healthy upstream behind PgBouncer were refused.
    pub fn for_timeout(mut self, timeout: Duration) -> Controller {
        self.too_slow = Some(timeout / 2);
        self.tolerance = timeout / 100;
        self
    }

    /// The number of requests that may be in flight now.
    pub fn limit(&self) -> u32 {
        // The limit stays within [1, ceiling], which fits a u32.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let limit = (self.limit.floor() as u32).max(1);
        if self.probe.is_some() {
            // Below half: a request sent now meets no queue of ours.
            ((limit - 1) / 2).max(1)
        } else {
            limit
        }
    }

    /// Whether `latency` is a sign of overload, as a timeout is.
    fn too_slow(&self, latency: Duration) -> bool {
        // Until a baseline is known, a slow answer is the baseline.
        self.too_slow.is_some_and(|slow| latency >= slow) && self.min_latency.is_some_and(|min| latency >= min * 2)
    }

    /// Takes the lowest latency of the requests that met no queue since the
    /// last re-read for the upstream's latency without a queue, and starts a
    /// new window.
    fn reread(&mut self) {
        self.samples = 0;
        self.reread_at = reread_after(self.limit);
        if let Some(light_min) = self.light_min.take() {
            self.min_latency = Some(light_min);
        }
    }

    /// Learns from one request that held a slot while `in_flight` requests
    /// (itself included) did.
    pub fn learn(&mut self, sample: Sample, in_flight: u32) {
        let latency = match sample {
            Sample::Answered(latency) if !self.too_slow(latency) => latency.max(Duration::from_micros(1)),
            Sample::Answered(_) | Sample::Dropped => {
                self.limit = (self.limit * 0.9).max(1.0);
                return;
            }
        };
        // Too few requests in flight to tell whether the limit is the
        // bottleneck; but such a request met no queue of ours (nor does one
        // sent alone).
        let light = f64::from(in_flight) * 2.0 < self.limit;
        let unqueued = light || in_flight <= 1;
        if unqueued {
            self.light_min = Some(self.light_min.map_or(latency, |m| m.min(latency)));
        }
        if let Some(probe) = self.probe.as_mut() {
            // The answers of a probe read the lowest latency and nothing
            // else: those sent before it carry the queue it drains.
            probe.budget = probe.budget.saturating_sub(1);
            if unqueued {
                probe.left = probe.left.saturating_sub(1);
            }
            if probe.left == 0 || probe.budget == 0 {
                self.probe = None;
                self.reread();
            }
            return;
        }
        self.samples += 1;
        if self.samples >= self.reread_at {
            // The lowest latency is read again every window, so that an
            // upstream that became slower for good, or one fast answer, does
            // not set the limit for ever; but only from requests that met no
            // queue: under a sustained overload every latency includes the
            // queue, and taking one of those for the minimum would let the
            // limit (and the queue) grow window after window. A window
            // without such a request (the limit always full) ends with a
            // probe, which sends some.
            if self.light_min.is_some() {
                self.reread();
            } else {
                let probe_limit = ((self.limit() - 1) / 2).max(1);
                self.probe = Some(Probe {
                    left: probe_limit.min(PROBE_SAMPLES),
                    // Those in flight drain, then the probe's own answer.
                    budget: 2 * u64::from(self.limit()) + u64::from(PROBE_SAMPLES),
                });
                return;
            }
        }
        let min = match self.min_latency {
            Some(min) if min <= latency => min,
            _ => *self.min_latency.insert(latency),
        };
        if light {
            return;
        }
        let log = self.limit.log10().max(1.0);
        let (alpha, beta) = (3.0 * log, 6.0 * log);
        let queue = (self.limit * (1.0 - (min + self.tolerance).as_secs_f64() / latency.as_secs_f64())).ceil();
        if queue <= log {
            self.limit += beta;
        } else if queue < alpha {
            self.limit += log;
        } else if queue > beta {
            self.limit -= log;
        }
        self.limit = self.limit.clamp(1.0, self.ceiling);
    }
}

fn reread_after(limit: f64) -> u64 {
    // A whole number of samples, at least 30.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let n = (limit.max(1.0) * REREAD_SAMPLES_PER_SLOT) as u64;
    n
}

#[derive(Debug)]
struct State {
    /// How the limit is set: the configuration in force (a reload may change it).
    policy: LimitPolicy,
    in_flight: u32,
    controller: Option<Controller>,
    refusals: u64,
    /// Where the limit, the slots held and the refusals are shown.
    gauges: Option<LimitGauges>,
}

/// One upstream's (or route's) concurrency limit. It lives as long as the
/// process (see [`Limits`]): a reload changes its policy, never the slots
/// held under it.
#[derive(Debug)]
pub struct Limit {
    state: Mutex<State>,
    /// Wakes a request waiting for a slot when one is freed.
    freed: Notify,
}

/// Why no slot was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overloaded;

impl Limit {
    pub fn new(policy: LimitPolicy) -> Arc<Limit> {
        Arc::new(Limit {
            state: Mutex::new(State { policy, in_flight: 0, controller: controller_for(policy), refusals: 0, gauges: None }),
            freed: Notify::new(),
        })
    }

    /// Applies a reloaded configuration's `policy`. The slots held stay
    /// held and counted; an adaptive limit whose settings did not change
    /// keeps what it learned (other changes start it afresh). Requests
    /// waiting for a slot look again (the limit may have grown).
    pub fn reconfigure(&self, policy: LimitPolicy) {
        let mut state = self.state();
        if state.policy == policy {
            return;
        }
        state.policy = policy;
        state.controller = controller_for(policy);
        Self::changed(&state);
        drop(state);
        self.freed.notify_waiters();
    }

    /// Shows this limit in `gauges` from now on (in place of any earlier).
    pub fn report_to(&self, gauges: LimitGauges) {
        let mut state = self.state();
        Self::show(&gauges, &state);
        state.gauges = Some(gauges);
    }

    fn show(gauges: &LimitGauges, state: &State) {
        gauges.in_flight.set(i64::from(state.in_flight));
        if let (Some(gauge), Some(limit)) = (&gauges.limit, Self::limit_of(state)) {
            gauge.set(i64::from(limit));
        }
    }

    /// Updates the gauges after a change of `state`.
    fn changed(state: &State) {
        if let Some(gauges) = &state.gauges {
            Self::show(gauges, state);
        }
    }

    /// Counts a refusal (or a deferral of background work).
    pub fn refused(&self) {
        let mut state = self.state();
        state.refusals += 1;
        if let Some(gauges) = &state.gauges {
            gauges.refusals.inc();
        }
    }

    pub fn policy(&self) -> LimitPolicy {
        self.state().policy
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held cannot leave the counts torn (each
        // update is one statement); keep serving.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The number of requests that may be in flight now (`None`: no limit).
    pub fn current(&self) -> Option<u32> {
        let state = self.state();
        Self::limit_of(&state)
    }

    fn limit_of(state: &State) -> Option<u32> {
        match (state.policy, &state.controller) {
            (LimitPolicy::Fixed { max_in_flight, .. }, _) => Some(max_in_flight),
            (LimitPolicy::Adaptive { .. }, Some(c)) => Some(c.limit()),
            _ => None,
        }
    }

    /// Requests holding a slot now.
    pub fn in_flight(&self) -> u32 {
        self.state().in_flight
    }

    /// Slots free now (`u32::MAX` without a limit).
    pub fn available(&self) -> u32 {
        let state = self.state();
        Self::limit_of(&state).map_or(u32::MAX, |limit| limit.saturating_sub(state.in_flight))
    }

    /// Refusals since start.
    pub fn refusals(&self) -> u64 {
        self.state().refusals
    }

    /// A slot now, or none.
    pub fn try_acquire(self: &Arc<Self>) -> Option<Permit> {
        let mut state = self.state();
        let free = Self::limit_of(&state).is_none_or(|limit| state.in_flight < limit);
        free.then(|| {
            state.in_flight += 1;
            Self::changed(&state);
            Permit { limit: self.clone(), in_flight: state.in_flight, sample: None }
        })
    }

    /// A slot, waiting for one up to the policy's `queue_timeout`; counted as
    /// a refusal when none came.
    pub async fn acquire(self: &Arc<Self>) -> Result<Permit, Overloaded> {
        self.wait_turn().await.ok_or_else(|| {
            self.refused();
            Overloaded
        })
    }

    /// A slot, waiting for one up to the policy's `queue_timeout` in turn
    /// with the requests waiting. Background work (event deliveries, probes,
    /// async attempts) that finds no slot free waits here for one, so an
    /// upstream kept at its limit by requests still gets its share of it
    /// (looking for a free slot alone found none under a steady load, and
    /// events waited until the load ended). A wait that ends without a slot
    /// is no refusal: the work waits for its next round.
    pub async fn wait_turn(self: &Arc<Self>) -> Option<Permit> {
        let deadline = Instant::now() + self.policy().queue_timeout();
        loop {
            // Registered before looking, so a slot freed in between is not missed.
            let freed = self.freed.notified();
            if let Some(permit) = self.try_acquire() {
                return Some(permit);
            }
            if Instant::now() >= deadline || tokio::time::timeout_at(deadline, freed).await.is_err() {
                // One last look: a slot may have been freed as the deadline passed.
                return self.try_acquire();
            }
        }
    }

    fn release(&self, in_flight: u32, sample: Option<Sample>) {
        let mut state = self.state();
        state.in_flight = state.in_flight.saturating_sub(1);
        if let (Some(sample), Some(controller)) = (sample, state.controller.as_mut()) {
            controller.learn(sample, in_flight);
        }
        Self::changed(&state);
        drop(state);
        self.freed.notify_one();
    }
}

/// The adaptive controller a policy needs (none for a fixed or no limit).
fn controller_for(policy: LimitPolicy) -> Option<Controller> {
    match policy {
        LimitPolicy::Adaptive { initial, ceiling, timeout, .. } => Some(Controller::new(initial, ceiling).for_timeout(timeout)),
        LimitPolicy::Unlimited | LimitPolicy::Fixed { .. } => None,
    }
}

/// The process's limits by name (an upstream's, or a route's cap), kept
/// across reloads: a configuration takes the limit of a name that an
/// earlier one had, with its new policy, so the requests admitted under the
/// earlier configuration keep counting against the one limit (a new limit
/// per reload let twice `max_in_flight` reach the upstream while they ran).
#[derive(Debug, Default)]
pub struct Limits {
    by_name: Mutex<std::collections::HashMap<String, Arc<Limit>>>,
}

impl Limits {
    /// The limit named `name`, under `policy` from now on.
    pub fn get(&self, name: &str, policy: LimitPolicy) -> Arc<Limit> {
        let mut by_name = self.by_name.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match by_name.get(name) {
            Some(limit) => {
                limit.reconfigure(policy);
                limit.clone()
            }
            None => {
                let limit = Limit::new(policy);
                by_name.insert(name.to_owned(), limit.clone());
                limit
            }
        }
    }
}

/// A slot held: freed when dropped, teaching the limit what
/// [`Permit::record`] says of the request.
#[derive(Debug)]
pub struct Permit {
    limit: Arc<Limit>,
    /// Requests in flight when this one took its slot (itself included).
    in_flight: u32,
    sample: Option<Sample>,
}

impl Permit {
    /// What the upstream did with the request this slot was held for.
    pub fn record(&mut self, sample: Sample) {
        self.sample = Some(sample);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.limit.release(self.in_flight, self.sample.take());
    }
}

/// The slots one forward holds: its upstream's, and its route's when the
/// route has a cap of its own.
#[derive(Debug)]
pub struct Slot {
    upstream: Permit,
    _route: Option<Permit>,
}

impl Slot {
    /// A slot of `route`'s cap (if any) and of `upstream`'s limit, each
    /// waiting up to its `queue_timeout`.
    pub async fn acquire(upstream: &Arc<Limit>, route: Option<&Arc<Limit>>) -> Result<Slot, Overloaded> {
        let route = match route {
            Some(limit) => Some(limit.acquire().await?),
            None => None,
        };
        Ok(Slot { upstream: upstream.acquire().await?, _route: route })
    }

    /// A slot of `route`'s cap (if any) and of `upstream`'s limit if both
    /// have one free now; nothing is waited for, nothing counted as refused.
    pub fn try_now(upstream: &Arc<Limit>, route: Option<&Arc<Limit>>) -> Option<Slot> {
        let route = match route {
            Some(limit) => Some(limit.try_acquire()?),
            None => None,
        };
        Some(Slot { upstream: upstream.try_acquire()?, _route: route })
    }

    /// What the upstream did with the request (teaches the upstream's limit).
    pub fn record(&mut self, sample: Sample) {
        self.upstream.record(sample);
    }
}

impl From<Permit> for Slot {
    /// A slot of the upstream's limit alone.
    fn from(upstream: Permit) -> Slot {
        Slot { upstream, _route: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// An upstream that serves `capacity` requests at a time in `service`
    /// each, first come first served, behind a gateway whose clients keep
    /// as many requests in flight as the limit allows (quieter when
    /// `quiet(round)` says so: one request at a time). Returns the highest
    /// limit seen.
    fn run(c: &mut Controller, capacity: usize, service: Duration, rounds: usize, quiet: impl Fn(usize) -> bool) -> u32 {
        use std::cmp::Reverse;
        use std::collections::{BinaryHeap, VecDeque};
        let mut now = Duration::ZERO;
        // (arrival, in flight when it took its slot)
        let mut waiting: VecDeque<(Duration, u32)> = VecDeque::new();
        let mut serving: BinaryHeap<Reverse<(Duration, Duration, u32)>> = BinaryHeap::new();
        let mut in_flight = 0u32;
        let mut highest = c.limit();
        for round in 0..rounds {
            let want = if quiet(round) { 1 } else { c.limit() };
            while in_flight < want {
                in_flight += 1;
                waiting.push_back((now, in_flight));
            }
            while serving.len() < capacity {
                let Some((arrival, n)) = waiting.pop_front() else { break };
                serving.push(Reverse((now + service, arrival, n)));
            }
            let Some(Reverse((done, arrival, n))) = serving.pop() else { break };
            now = done;
            in_flight -= 1;
            c.learn(Sample::Answered(now - arrival), n);
            highest = highest.max(c.limit());
        }
        highest
    }

    #[test]
    fn the_limit_settles_near_what_the_upstream_can_serve() {
        let mut c = Controller::new(DEFAULT_INITIAL, DEFAULT_CEILING).for_timeout(Duration::from_secs(1));
        run(&mut c, 4, 100 * MS, 5_000, |_| false);
        let settled = c.limit();
        // 4 served at a time: a limit a little above 4 keeps the upstream
        // busy with a short queue; far above it, requests wait several
        // service times and, past the timeout, become unknown.
        assert!((4..=16).contains(&settled), "settled at {settled}");
    }

    #[test]
    fn the_limit_grows_while_latency_stays_at_its_minimum() {
        let mut c = Controller::new(5, DEFAULT_CEILING);
        for _ in 0..200 {
            let n = c.limit();
            c.learn(Sample::Answered(10 * MS), n);
        }
        assert!(c.limit() > 100, "grew to {}", c.limit());
    }

    #[test]
    fn an_idle_upstream_does_not_raise_the_limit() {
        let mut c = Controller::new(20, DEFAULT_CEILING);
        for _ in 0..1000 {
            c.learn(Sample::Answered(10 * MS), 2);
        }
        assert_eq!(c.limit(), 20);
    }

    #[test]
    fn drops_shrink_the_limit_by_a_tenth_down_to_one() {
        let mut c = Controller::new(100, DEFAULT_CEILING);
        c.learn(Sample::Dropped, 100);
        assert_eq!(c.limit(), 90);
        for _ in 0..100 {
            c.learn(Sample::Dropped, 1);
        }
        assert_eq!(c.limit(), 1);
    }

    #[test]
    fn answers_near_the_timeout_shrink_the_limit_as_timeouts_do() {
        let mut c = Controller::new(40, DEFAULT_CEILING).for_timeout(1000 * MS);
        // The upstream answers in 100 ms without a queue.
        c.learn(Sample::Answered(100 * MS), 1);
        assert_eq!(c.limit(), 40);
        c.learn(Sample::Answered(600 * MS), 40);
        assert_eq!(c.limit(), 36);
        // Below it, an answer is a latency like any other: this one reads as
        // a queue, and the limit shrinks by a step, not by a tenth.
        c.learn(Sample::Answered(499 * MS), 36);
        assert!((33..36).contains(&c.limit()), "limit {}", c.limit());
    }

    #[test]
    fn jitter_of_a_fast_upstream_is_not_a_queue() {
        // An upstream answering in 0.3 ms at best, a few ms under a busy
        // machine's scheduling, with a 2 s timeout: the limit must not shrink.
        let mut c = Controller::new(DEFAULT_INITIAL, DEFAULT_CEILING).for_timeout(Duration::from_secs(2));
        for i in 0..2_000u32 {
            let n = c.limit();
            let latency = Duration::from_micros(300 + u64::from(i % 7) * 1_500);
            c.learn(Sample::Answered(latency), n);
        }
        assert!(c.limit() >= 500, "shrank to {}", c.limit());
    }

    #[test]
    fn the_limit_never_passes_its_ceiling() {
        let mut c = Controller::new(50, 64);
        for _ in 0..500 {
            let n = c.limit();
            c.learn(Sample::Answered(MS), n);
        }
        assert_eq!(c.limit(), 64);
    }

    #[test]
    fn a_permanently_slower_upstream_is_learned_again_from_quiet_moments() {
        let mut c = Controller::new(DEFAULT_INITIAL, DEFAULT_CEILING);
        run(&mut c, 32, 10 * MS, 5_000, |_| false);
        let before = c.limit();
        // The same capacity, each request now ten times slower, with quiet
        // moments between busy ones: the limit comes back to what it was.
        run(&mut c, 32, 100 * MS, 50_000, |round| round % 1000 < 20);
        let after = c.limit();
        assert!(after * 2 >= before, "before {before}, after {after}");
    }

    #[test]
    fn a_sustained_overload_never_takes_a_queued_latency_for_the_minimum() {
        let mut c = Controller::new(DEFAULT_INITIAL, DEFAULT_CEILING);
        let highest = run(&mut c, 4, 100 * MS, 50_000, |_| false);
        assert!(c.limit() <= 16 && highest <= 24, "limit {}, highest {highest}", c.limit());
    }

    #[test]
    fn one_fast_answer_does_not_pin_the_lowest_latency_under_a_steady_load() {
        // A 4xx answered in 5 ms, then writes taking 400 ms with the limit
        // always full (no request ever meets an empty upstream): the 5 ms
        // must not stay the upstream's latency without a queue, or every
        // write reads as a queue of three quarters of the limit and holds it
        // at about 8 whatever the upstream can take.
        let mut c = Controller::new(DEFAULT_INITIAL, DEFAULT_CEILING).for_timeout(Duration::from_secs(10));
        c.learn(Sample::Answered(5 * MS), DEFAULT_INITIAL);
        for _ in 0..5_000 {
            let n = c.limit();
            c.learn(Sample::Answered(400 * MS), n);
        }
        assert!(c.limit() > 50, "held at {}", c.limit());
    }

    #[test]
    fn a_slow_upstream_is_not_taken_for_an_overloaded_one() {
        // Answers in 6 s with a 10 s timeout, steadily: more than half the
        // timeout, but no slower than the upstream's own latency.
        let mut c = Controller::new(DEFAULT_INITIAL, DEFAULT_CEILING).for_timeout(Duration::from_secs(10));
        for _ in 0..200 {
            let n = c.limit();
            c.learn(Sample::Answered(Duration::from_secs(6)), n);
        }
        let grown = c.limit();
        assert!(grown > DEFAULT_INITIAL, "held at {grown}");
        // Timeouts still cut it.
        for _ in 0..10 {
            let n = c.limit();
            c.learn(Sample::Dropped, n);
        }
        assert!(c.limit() * 2 < grown, "from {grown} to {}", c.limit());
    }

    #[test]
    fn the_limit_recovers_after_a_flood_of_timeouts() {
        let mut c = Controller::new(DEFAULT_INITIAL, DEFAULT_CEILING).for_timeout(Duration::from_secs(1));
        run(&mut c, 32, 10 * MS, 2_000, |_| false);
        for _ in 0..100 {
            let n = c.limit();
            c.learn(Sample::Dropped, n);
        }
        assert_eq!(c.limit(), 1);
        run(&mut c, 32, 10 * MS, 5_000, |_| false);
        assert!(c.limit() >= 32, "back to {}", c.limit());
    }

    #[test]
    fn a_limit_kept_across_configurations_keeps_its_slots_under_the_new_policy() {
        let limits = Limits::default();
        let fixed = |max_in_flight| LimitPolicy::Fixed { max_in_flight, queue_timeout: Duration::ZERO };
        let first = limits.get("upstream orders", fixed(2));
        let held = (first.try_acquire().expect("a slot"), first.try_acquire().expect("a second slot"));
        // The same policy again (a reload of the same file): the same limit.
        let again = limits.get("upstream orders", fixed(2));
        assert!(Arc::ptr_eq(&first, &again));
        assert!(again.try_acquire().is_none(), "both slots are still held");
        // Lowered to one: both slots stay held, none is free until both go.
        let lowered = limits.get("upstream orders", fixed(1));
        assert_eq!((lowered.in_flight(), lowered.available()), (2, 0));
        drop(held.0);
        assert_eq!(lowered.available(), 0);
        drop(held.1);
        assert_eq!(lowered.available(), 1);
        // Another name is another limit.
        assert!(!Arc::ptr_eq(&first, &limits.get("route create_order", fixed(2))));
        // An adaptive limit whose settings are unchanged keeps what it learned.
        let adaptive = LimitPolicy::Adaptive { initial: 10, ceiling: 1000, timeout: Duration::from_secs(1), queue_timeout: Duration::ZERO };
        let a = limits.get("upstream slow", adaptive);
        for _ in 0..50 {
            let mut p = a.try_acquire().expect("a slot");
            p.record(Sample::Dropped);
        }
        let learned = a.current();
        assert!(learned < Some(10), "{learned:?}");
        assert_eq!(limits.get("upstream slow", adaptive).current(), learned);
    }

    #[tokio::test]
    async fn a_fixed_limit_refuses_past_it_and_counts() {
        let limit = Limit::new(LimitPolicy::Fixed { max_in_flight: 2, queue_timeout: Duration::ZERO });
        let a = limit.try_acquire().expect("first");
        let _b = limit.acquire().await.expect("second");
        assert_eq!(limit.acquire().await.unwrap_err(), Overloaded);
        assert_eq!((limit.in_flight(), limit.available(), limit.refusals()), (2, 0, 1));
        drop(a);
        assert_eq!(limit.available(), 1);
        assert!(limit.acquire().await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_request_gets_a_slot_freed_within_its_queue_timeout() {
        let limit = Limit::new(LimitPolicy::Fixed { max_in_flight: 1, queue_timeout: Duration::from_millis(50) });
        let held = limit.try_acquire().expect("first");
        let waiter = tokio::spawn({
            let limit = limit.clone();
            async move { limit.acquire().await.map(|_| ()) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(held);
        assert_eq!(waiter.await.expect("joined"), Ok(()));
        // Nobody frees one now: refused at the deadline.
        let _held = limit.try_acquire().expect("free again");
        assert_eq!(limit.acquire().await.unwrap_err(), Overloaded);
        assert_eq!(limit.refusals(), 1);
    }

    #[tokio::test]
    async fn no_limit_admits_everything_and_still_counts() {
        let limit = Limit::new(LimitPolicy::Unlimited);
        let permits: Vec<_> = (0..100).map(|_| limit.try_acquire().expect("unlimited")).collect();
        assert_eq!((limit.in_flight(), limit.current()), (100, None));
        drop(permits);
        assert_eq!(limit.in_flight(), 0);
    }

    #[tokio::test]
    async fn a_recorded_sample_teaches_the_adaptive_limit() {
        let limit = Limit::new(LimitPolicy::Adaptive {
            initial: 10,
            ceiling: 100,
            queue_timeout: Duration::ZERO,
            timeout: Duration::from_secs(10),
        });
        let mut permit = limit.try_acquire().expect("slot");
        permit.record(Sample::Dropped);
        drop(permit);
        assert_eq!(limit.current(), Some(9));
    }
}
