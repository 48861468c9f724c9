//! The chaos soak's clients and checker, shared by the soak (`tests/it/soak.rs`)
//! and the failover test (`tests/it/ha.rs`).
//!
//! Clients retry their keys with jitter against several replicas and remember
//! what they were told ([`Seen`]); the checker ([`check`]) then compares that
//! with the upstream's ledger of side effects and with the store.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemgate::idempotency::key::{IdempotencyKey, Scope};
use idemgate::idempotency::record::{Record, State};
use idemgate::store::{ListFilter, Store};
use tokio::task::JoinHandle;

use super::{PRINCIPAL, TENANT, TEST_SECRET, TestUpstream, send};

/// The tenants the clients spread their keys over. The default soak and the
/// failover test: one, the test API key's (`TENANT`). The Citus soak: a few
/// named tenants, asserted by trusted headers (the test gateways trust
/// loopback peers), because a tenant's records live on one shard and one
/// worker: without several tenants only one worker would see traffic.
/// Which tenant a key belongs to is a function of the key, so the checker
/// finds its record without asking the client.
#[derive(Debug, Clone)]
pub struct Tenants(Vec<String>);

impl Tenants {
    /// Every key is `TENANT`'s, identified by the test API key.
    pub fn one() -> Tenants {
        Tenants(Vec::new())
    }

    /// Keys spread over `names` (principal `PRINCIPAL`), by trusted headers.
    pub fn named(names: Vec<String>) -> Tenants {
        Tenants(names)
    }

    /// The tenant of `key`.
    pub fn of(&self, key: &str) -> &str {
        if self.0.is_empty() {
            return TENANT;
        }
        // FNV-1a: stable across runs and processes.
        let h = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
        &self.0[(h % self.0.len() as u64) as usize]
    }

    /// The identity headers of a request for `key`.
    pub fn headers(&self, key: &str) -> Vec<(&'static str, String)> {
        if self.0.is_empty() {
            return vec![("authorization", "Bearer test-key".to_owned())];
        }
        vec![("x-tenant-id", self.of(key).to_owned()), ("x-principal-id", PRINCIPAL.to_owned())]
    }

    /// The scope of `key` on `operation`.
    pub fn scope(&self, operation: &str, key: &str) -> Scope {
        Scope {
            tenant: self.of(key).into(),
            principal: PRINCIPAL.into(),
            operation: operation.into(),
            key: IdempotencyKey::new(key).expect("soak keys are valid"),
        }
    }

    /// The key the upstream sees for `key` on `operation`.
    pub fn derived(&self, operation: &str, key: &str) -> String {
        self.scope(operation, key).derived_key(Some(TEST_SECRET.as_bytes()))
    }

    /// How many tenants (1 for [`Tenants::one`]).
    pub fn count(&self) -> usize {
        self.0.len().max(1)
    }
}

/// `headers` plus `extra`, as `send` takes them.
fn with<'a>(headers: &'a [(&'static str, String)], extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    headers.iter().map(|(k, v)| (*k, v.as_str())).chain(extra.iter().copied()).collect()
}

/// What one client saw for one key.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    /// The first successful answer (status, body), replayed or not.
    pub first: Option<(u16, bytes::Bytes)>,
    /// The first answer came straight from the upstream (not a replay).
    pub first_forwarded: bool,
    /// Replays that differed from the first answer.
    pub replay_mismatches: u32,
    pub replays: u32,
    pub unknown: bool,
    pub gave_up: bool,
}

/// Every key the clients tried, with what they saw.
pub type SeenMap = Arc<Mutex<HashMap<String, Seen>>>;

pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()
}

/// A tiny deterministic PRNG (xorshift), so runs need no extra crate.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Starts `clients` tasks that, until `deadline`, each take a new key, POST
/// it to a random replica and retry (with jitter, against random replicas)
/// until a final answer: a 2xx, or `outcome-unknown`. 3% of first attempts ask
/// the upstream to be slower than its timeout, so honest unknowns occur; 20%
/// of keys are sent once more after their 2xx to check the replay.
pub fn spawn_clients(clients: u64, urls: &[String], deadline: Instant, seen: &SeenMap, tenants: &Tenants) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    for c in 0..clients {
        let urls = urls.to_vec();
        let seen = seen.clone();
        let tenants = tenants.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (c + 1));
            let mut n = 0u64;
            while Instant::now() < deadline {
                n += 1;
                let key = format!("c{c}-{n}");
                let body = format!(r#"{{"client":{c},"n":{n},"item":"book"}}"#);
                let identity = tenants.headers(&key);
                let mut s = Seen::default();
                // 3% of requests are slower than the upstream timeout: honest unknowns.
                let slow = rng.below(100) < 3;
                let mut attempts = 0;
                let mut verify_replay = rng.below(100) < 20;
                loop {
                    attempts += 1;
                    if attempts > 60 {
                        s.gave_up = true;
                        break;
                    }
                    let url = &urls[rng.below(urls.len() as u64) as usize];
                    let sleep = if slow && attempts == 1 { "1500".to_owned() } else { rng.below(30).to_string() };
                    let headers =
                        with(&identity, &[("content-type", "application/json"), ("idempotency-key", &key), ("x-test-sleep-ms", &sleep)]);
                    let r = send("POST", url, &headers, body.clone()).await;
                    let retry_pause = Duration::from_millis(20 + rng.below(200));
                    let Ok(r) = r else {
                        tokio::time::sleep(retry_pause).await;
                        continue;
                    };
                    match r.status {
                        200..=299 => {
                            match &s.first {
                                None => {
                                    s.first = Some((r.status, r.body.clone()));
                                    s.first_forwarded = !r.replayed();
                                }
                                Some((st, b)) => {
                                    s.replays += 1;
                                    if !r.replayed() || *st != r.status || *b != r.body {
                                        s.replay_mismatches += 1;
                                    }
                                }
                            }
                            if verify_replay {
                                verify_replay = false;
                                continue;
                            }
                            break;
                        }
                        409 | 504 if r.problem() == "outcome-unknown" => {
                            s.unknown = true;
                            break;
                        }
                        409 if r.problem() == "request-in-progress" => {}
                        503 | 408 | 502 => {}
                        other => panic!("unexpected answer {other} for {key}: {:?}", String::from_utf8_lossy(&r.body)),
                    }
                    tokio::time::sleep(retry_pause).await;
                }
                seen.lock().unwrap().insert(key, s);
            }
        }));
    }
    tasks
}

/// What the checker found.
pub struct Verdict {
    pub keys: usize,
    pub side_effects: u64,
    pub max_per_key: u64,
    /// Keys a client got a 2xx for.
    pub answered: usize,
    /// Completed records in the store.
    pub completed: usize,
    pub replays: u32,
    pub replay_mismatch: u32,
    pub unknown: Vec<Record>,
    /// Unknown records whose client had its answer straight from the upstream
    /// (the result write failed; the client was not misled).
    pub unknown_after_answer: usize,
    pub gave_up: u32,
    pub in_flight: usize,
    /// In flight past their lease.
    pub stuck: usize,
    /// Keys the upstream acted on more than once, with the count.
    pub duplicates: Vec<(String, u64)>,
    /// Keys a client got a 2xx for whose record is missing, not completed,
    /// or holds another answer.
    pub lost: Vec<String>,
}

/// Compares what the clients saw with the upstream's ledger and the store.
pub async fn check(seen: &HashMap<String, Seen>, up: &TestUpstream, store: &Store, tenants: &Tenants) -> Verdict {
    let ledger = up.ledger();
    let mut duplicates = Vec::new();
    let mut lost = Vec::new();
    let mut replay_mismatch = 0;
    let mut answered = 0;
    let mut unknown_after_answer = 0;
    let mut gave_up = 0;
    for (key, s) in seen {
        let effects = ledger.get(&tenants.derived("create_order", key)).copied().unwrap_or(0);
        if effects > 1 {
            duplicates.push((key.clone(), effects));
        }
        replay_mismatch += s.replay_mismatches;
        gave_up += u32::from(s.gave_up);
        if let Some((status, body)) = &s.first {
            answered += 1;
            match store.get(&tenants.scope("create_order", key)).await.expect("store get").map(|(r, _)| r) {
                None => lost.push(format!("{key}: answered {status} but no record")),
                Some(r) if r.state == State::Completed => {
                    let stored = r.response.as_ref().and_then(|resp| resp.body.clone());
                    if stored.as_ref() != Some(body) || r.response.as_ref().map(|x| x.status) != Some(*status) {
                        lost.push(format!("{key}: stored answer differs from what the client got"));
                    }
                }
                Some(r) if r.state == State::Unknown && s.first_forwarded => unknown_after_answer += 1,
                Some(r) => lost.push(format!("{key}: answered {status} but record is {}", r.state)),
            }
        }
    }
    let now = store.now().await.unwrap();
    let in_flight = store.list(&ListFilter { state: Some(State::InFlight), limit: 100_000, ..Default::default() }).await.unwrap();
    let stuck = in_flight.iter().filter(|r| r.lease_expires_at.is_none_or(|l| l <= now)).count();
    let unknown = store.list(&ListFilter { state: Some(State::Unknown), limit: 100_000, ..Default::default() }).await.unwrap();
    let completed = store.list(&ListFilter { state: Some(State::Completed), limit: 1_000_000, ..Default::default() }).await.unwrap();
    Verdict {
        keys: seen.len(),
        side_effects: up.total(),
        max_per_key: ledger.values().max().copied().unwrap_or(0),
        answered,
        completed: completed.len(),
        replays: seen.values().map(|s| s.replays).sum(),
        replay_mismatch,
        unknown,
        unknown_after_answer,
        gave_up,
        in_flight: in_flight.len(),
        stuck,
        duplicates,
        lost,
    }
}

impl Verdict {
    /// The counts, one per line.
    pub fn print_counts(&self) {
        println!("  keys attempted:            {}", self.keys);
        println!("  side effects:              {} (max per key {})", self.side_effects, self.max_per_key);
        println!("  keys answered 2xx:         {}", self.answered);
        println!("  keys with a stored answer: {}", self.completed);
        println!("  replays checked:           {} (differing: {})", self.replays, self.replay_mismatch);
        println!("  unknown records:           {} (client had the answer for {})", self.unknown.len(), self.unknown_after_answer);
        for r in self.unknown.iter().take(20) {
            println!("    unknown: {} (owner {}, generation {})", r.scope.key.as_str(), r.owner, r.generation);
        }
        println!("  clients that gave up:      {}", self.gave_up);
        println!("  in flight at end:          {} (stuck past lease: {})", self.in_flight, self.stuck);
    }

    /// Every duplicate and every lost answer.
    pub fn print_findings(&self) {
        for d in &self.duplicates {
            println!("  DUPLICATE: {} executed {} times", d.0, d.1);
        }
        for l in &self.lost {
            println!("  LOST: {l}");
        }
    }

    /// `lost` as the closing line counts it: missing or differing records
    /// plus replays that differed from the first answer.
    pub fn lost_count(&self) -> usize {
        self.lost.len() + self.replay_mismatch as usize
    }

    /// `keys=N side_effects=M duplicates=D lost=L stuck=S unknown=U`
    pub fn line(&self) -> String {
        format!(
            "keys={} side_effects={} duplicates={} lost={} stuck={} unknown={}",
            self.keys,
            self.side_effects,
            self.duplicates.len(),
            self.lost_count(),
            self.stuck,
            self.unknown.len()
        )
    }

    /// Duplicates, lost answers and stuck records must all be 0.
    pub fn assert_clean(&self) {
        assert!(self.duplicates.is_empty(), "duplicates");
        assert!(self.lost.is_empty() && self.replay_mismatch == 0, "lost or differing answers");
        assert!(self.stuck == 0, "stuck records");
    }
}

/// What one async client saw for one key.
#[derive(Debug, Default, Clone)]
pub struct SeenAsync {
    /// The operation id of the 202 (the same for every retry of the key).
    pub id: Option<String>,
    /// Retries of the acceptance that got another id.
    pub id_changed: u32,
    /// The final state the client read by polling, and the result's status.
    pub final_state: Option<String>,
    pub result_status: Option<u16>,
    pub gave_up: bool,
}

pub type SeenAsyncMap = Arc<Mutex<HashMap<String, SeenAsync>>>;

/// Where async clients send their work, and how slow it is.
#[derive(Debug, Clone)]
pub struct AsyncLoad {
    /// The route's path (`/v1/jobs`).
    pub path: String,
    /// Keys are `{prefix}{client}-{n}` (unique across routes).
    pub prefix: String,
    /// Percent of keys whose request asks the upstream to work
    /// `slow_ms.0..slow_ms.1` ms (`x-test-sleep-ms`); the rest 0-29 ms.
    pub slow_percent: u64,
    pub slow_ms: (u64, u64),
    /// Whose keys they are.
    pub tenants: Tenants,
}

/// When the clients stopped sending writes: an async client counts itself
/// while it posts a key (its acceptance and the retries of it) and notes when
/// each POST returned. Its polls (reads) are not traffic.
#[derive(Debug, Default)]
pub struct Posting {
    active: std::sync::atomic::AtomicUsize,
    last: Mutex<Option<Instant>>,
}

impl Posting {
    fn enter(&self) {
        self.active.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    fn returned(&self) {
        let mut last = self.last.lock().unwrap();
        *last = Some(last.map_or(Instant::now(), |l| l.max(Instant::now())));
    }

    fn leave(&self) {
        self.active.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// Waits until no client is posting, then tells when the last POST returned.
    pub async fn stopped(&self) -> Option<Instant> {
        while self.active.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        *self.last.lock().unwrap()
    }
}

/// Async clients (numbered from `first`): each takes a new key, POSTs it
/// (retrying until a 202), sometimes POSTs it again (the same id must come
/// back), then polls the operation (against random replicas) until it is
/// final, and reads the result of a completed one. The body carries the key,
/// so whoever sees the request at the upstream can find its record.
pub fn spawn_async_clients(
    clients: u64,
    first: u64,
    bases: &[String],
    load: &AsyncLoad,
    deadline: Instant,
    seen: &SeenAsyncMap,
    posting: &Arc<Posting>,
) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    for c in first..first + clients {
        let (bases, seen, load, posting) = (bases.to_vec(), seen.clone(), load.clone(), posting.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0xA5A5_5A5A_1234_5678 ^ (c + 7));
            let mut n = 0u64;
            let path = &load.path;
            loop {
                posting.enter();
                if Instant::now() >= deadline {
                    posting.leave();
                    break;
                }
                n += 1;
                let key = format!("{}{c}-{n}", load.prefix);
                let body = format!(r#"{{"job":{c},"n":{n},"key":"{key}"}}"#);
                let identity = load.tenants.headers(&key);
                let auth = with(&identity, &[]);
                let sleep = if rng.below(100) < load.slow_percent {
                    load.slow_ms.0 + rng.below(load.slow_ms.1.saturating_sub(load.slow_ms.0))
                } else {
                    rng.below(30)
                }
                .to_string();
                let mut s = SeenAsync::default();
                let mut posts = 1 + u32::from(rng.below(100) < 30);
                let mut attempts = 0;
                while posts > 0 && attempts < 60 {
                    attempts += 1;
                    let base = &bases[rng.below(bases.len() as u64) as usize];
                    let r = send(
                        "POST",
                        &format!("{base}{path}"),
                        &with(&identity, &[("content-type", "application/json"), ("idempotency-key", &key), ("x-test-sleep-ms", &sleep)]),
                        body.clone(),
                    )
                    .await;
                    posting.returned();
                    match r {
                        Ok(r) if r.status == 202 => {
                            let id = r.json()["id"].as_str().unwrap_or_default().to_owned();
                            match &s.id {
                                None => s.id = Some(id),
                                Some(first) if *first != id => s.id_changed += 1,
                                Some(_) => {}
                            }
                            posts -= 1;
                        }
                        Ok(r) if matches!(r.status, 503 | 502 | 408 | 409) => {}
                        Ok(r) => panic!("unexpected answer {} for {key} on {path}: {:?}", r.status, String::from_utf8_lossy(&r.body)),
                        Err(_) => {}
                    }
                    tokio::time::sleep(Duration::from_millis(20 + rng.below(100))).await;
                }
                posting.leave();
                let Some(id) = s.id.clone() else {
                    s.gave_up = true;
                    seen.lock().unwrap().insert(key, s);
                    continue;
                };
                // Poll until final (bounded; the checker waits for stragglers).
                let poll_deadline = Instant::now() + Duration::from_secs(30);
                while Instant::now() < poll_deadline {
                    let base = &bases[rng.below(bases.len() as u64) as usize];
                    if let Ok(r) = send("GET", &format!("{base}/_idemgate/operations/{id}"), &auth, "").await
                        && r.status == 200
                    {
                        let doc = r.json();
                        let state = doc["state"].as_str().unwrap_or_default().to_owned();
                        if !matches!(state.as_str(), "queued" | "processing") {
                            if state == "completed" {
                                // The result, retried through the nemesis (503 while a store restarts).
                                for _ in 0..50 {
                                    let base = &bases[rng.below(bases.len() as u64) as usize];
                                    match send("GET", &format!("{base}/_idemgate/operations/{id}/result"), &auth, "").await {
                                        Ok(res) if !matches!(res.status, 502 | 503) => {
                                            s.result_status = Some(res.status);
                                            break;
                                        }
                                        _ => tokio::time::sleep(Duration::from_millis(100 + rng.below(200))).await,
                                    }
                                }
                            }
                            s.final_state = Some(state);
                            break;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(100 + rng.below(200))).await;
                }
                seen.lock().unwrap().insert(key, s);
            }
        }));
    }
    tasks
}

/// Accepted operations not final (`queued` or `processing`) in the store now.
pub async fn open_operations(store: &Store) -> Vec<Record> {
    let mut open = Vec::new();
    for state in [State::Queued, State::Processing] {
        open.extend(
            store.list(&ListFilter { state: Some(state), limit: 100_000, ..Default::default() }).await.expect("list open operations"),
        );
    }
    open
}

/// What the async checker found.
pub struct AsyncVerdict {
    pub accepted: usize,
    pub completed: usize,
    pub unknown: usize,
    pub failed: usize,
    pub duplicates: Vec<(String, u64)>,
    /// Accepted operations that never reached a final state, or whose id
    /// changed between retries, or whose completion is not in the store.
    pub lost: Vec<String>,
}

/// Compares what async clients saw with the ledger and the store (after the
/// run quiesced): every accepted operation must be final, executed at most
/// once, and (if the client read `completed`) completed in the store.
pub async fn check_async(
    seen: &HashMap<String, SeenAsync>,
    up: &TestUpstream,
    store: &Store,
    operation: &str,
    tenants: &Tenants,
) -> AsyncVerdict {
    let ledger = up.ledger();
    let mut v = AsyncVerdict { accepted: 0, completed: 0, unknown: 0, failed: 0, duplicates: Vec::new(), lost: Vec::new() };
    for (key, s) in seen {
        let scope = tenants.scope(operation, key);
        let effects = ledger.get(&scope.derived_key(Some(TEST_SECRET.as_bytes()))).copied().unwrap_or(0);
        if effects > 1 {
            v.duplicates.push((key.clone(), effects));
        }
        let Some(id) = &s.id else { continue };
        v.accepted += 1;
        if s.id_changed > 0 {
            v.lost.push(format!("{key}: a retry of the acceptance got another id"));
        }
        match store.get(&scope).await.ok().flatten().map(|(r, _)| r) {
            None => v.lost.push(format!("{key}: accepted as {id} but no record")),
            Some(r) => match r.state {
                State::Completed => v.completed += 1,
                State::Unknown => v.unknown += 1,
                State::FailedRetryable => v.failed += 1,
                other => v.lost.push(format!("{key}: accepted but still {other}")),
            },
        }
        if s.final_state.as_deref() == Some("completed") && s.result_status.is_none_or(|st| !(200..300).contains(&st)) {
            v.lost.push(format!("{key}: completed but its result was {:?}", s.result_status));
        }
    }
    v
}

/// The tenants [`seed_blocked_tenants`] makes: more than one background
/// round's 32 on Citus.
pub const BLOCKED_TENANTS: usize = 34;

/// Seeds `BLOCKED_TENANTS` tenants (`seed-NN`, not the clients') whose
/// background work cannot proceed, all older than anything the clients do:
/// each holds, on `operation` (a route with events and a probe), a parked
/// event with a pending one of its scope held behind it, and an `unknown`
/// record whose last probe was inconclusive (backing off for an hour). A
/// tenant list that counted such work would be filled by these tenants in
/// every round and starve the clients' events and probes. Run before any
/// replica starts (nothing else takes the events or probes meanwhile);
/// [`remove_blocked_tenants`] deletes them before the final check.
pub async fn seed_blocked_tenants(store: &Store, operation: &str, hook: &str) -> Vec<String> {
    use idemgate::idempotency::fingerprint::Fingerprint;
    use idemgate::idempotency::record::Retention;
    use idemgate::outbox::{EventPolicies, EventType, EventsConfig};
    use idemgate::store::audit::{Actor, AuditNote};
    use idemgate::store::{ClaimOutcome, ClaimRequest, ProbeRoute, Resolution};
    let config = EventsConfig {
        url: hook.parse().expect("webhook url"),
        secret: None,
        timeout: Duration::from_secs(1),
        max_attempts: 3,
        emit: EventType::ALL.to_vec(),
        include_key: false,
        include_body: false,
        batch: 1,
        concurrency: 4,
    };
    let op: Arc<str> = operation.into();
    let store = store.clone().with_events(EventPolicies::new([(&op, &config)]));
    let names: Vec<String> = (0..BLOCKED_TENANTS).map(|i| format!("seed-{i:02}")).collect();
    let scope = |tenant: &str, key: &str| Scope {
        tenant: tenant.into(),
        principal: PRINCIPAL.into(),
        operation: operation.into(),
        key: IdempotencyKey::new(key).expect("key"),
    };
    let unknown = |s: Scope| {
        let store = store.clone();
        async move {
            let req = ClaimRequest {
                scope: s,
                request_hash: Fingerprint([9; 32]),
                owner: "seed".into(),
                lease: Duration::from_millis(100),
                reforward: None,
                sent: idemgate::idempotency::record::ReforwardKey::Derived,
                fingerprint_spec: "test-settings".into(),
                claim_token: uuid::Uuid::new_v4(),
                acceptance: None,
                key_source: "header:idempotency-key".into(),
                request_head: None,
            };
            match store.claim(&req).await.expect("seed claim") {
                ClaimOutcome::Claimed(c) => store.mark_unknown(&c).await.expect("seed unknown"),
                other => panic!("seed: {other:?}"),
            };
        }
    };
    for t in &names {
        unknown(scope(t, "held")).await;
    }
    // Their `unknown` events parked.
    let relay = uuid::Uuid::new_v4();
    let mut parked = 0;
    while parked < names.len() {
        let events = store.take_events(&[operation], 64, Duration::from_secs(60), relay).await.expect("seed events");
        assert!(!events.is_empty(), "seed: {parked} events parked, the rest not taken");
        for e in events {
            assert!(store.event_failed(e.seq, relay, "seeded: parked", Duration::ZERO, true).await.expect("park"));
            parked += 1;
        }
    }
    // A later event of each scope, held behind the parked one.
    let note = AuditNote { actor: Actor::Cli, reason: "seeded".into(), forced: false, caller: None };
    let complete = Resolution::Complete {
        response: idemgate::idempotency::record::StoredResponse { status: 201, headers: vec![], body: None },
        retention: Retention::For(Duration::from_secs(3600)),
        force: false,
    };
    for t in &names {
        store.resolve(&scope(t, "held"), &complete, &note).await.expect("seed resolve");
    }
    // `unknown` records whose probe was inconclusive: backing off. (Their
    // own `unknown` events are deliverable and delivered.)
    for t in &names {
        unknown(scope(t, "probed")).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let route = ProbeRoute { operation: operation.into(), settle: Duration::ZERO, at_upstream: Duration::ZERO };
    let mut probed = 0;
    while probed < names.len() {
        let taken = store.take_probes(std::slice::from_ref(&route), Duration::from_secs(60), 64).await.expect("seed probes");
        assert!(!taken.is_empty(), "seed: {probed} probed, the rest not taken");
        for p in taken {
            store.probe_failed(&p.record.scope, p.fence, Duration::from_secs(3600), "seeded: inconclusive").await.expect("probe failed");
            probed += 1;
        }
    }
    names
}

/// Deletes what [`seed_blocked_tenants`] made (records and events), through
/// a connection of its own to `url`.
pub async fn remove_blocked_tenants(url: &str) {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
    let task = tokio::spawn(conn);
    for table in ["idemgate_events", "idemgate_records"] {
        client.execute(&format!("DELETE FROM {table} WHERE tenant LIKE 'seed-%'"), &[]).await.expect("remove the seeded tenants");
    }
    drop(client);
    let _ = task.await;
}
