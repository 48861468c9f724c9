//! PostgreSQL only: a fault proxy between the `Store` and the server
//! (ambiguous commits, an unreachable or hung store, a server restart), and
//! the fault proxy itself, in front of an echo server.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use idemgate::idempotency::record::Retention;
use idemgate::idempotency::record::State;
use idemgate::store::{ClaimOutcome, Store, StoreError, WriteOutcome};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::{LONG, all, claim, get, key, key_set, open_with, req, response, row, set};
use crate::support::Backend;
use crate::support::faultproxy::{Fault, FaultProxy};
use crate::support::postgres::{self as pg, PgServer};

/// Store operation timeout for the fault cases: long enough that nothing
/// times out by accident on a busy 2-core machine, short enough to wait for.
const FAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// A fresh database on the shared cluster, and a `Store` (pool of
/// `pool_size`) that reaches it only through a fault proxy.
async fn pg_behind_proxy(pool_size: usize) -> (FaultProxy, Store) {
    let server = pg::shared();
    let direct = server.create_unique_database("conformance").expect("create database");
    let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], server.port()))).await;
    let url = direct.replace(&format!("127.0.0.1:{}/", server.port()), &format!("127.0.0.1:{}/", proxy.port()));
    assert_ne!(url, direct);
    let store = open_with(&Backend::Postgres { url }, FAULT_TIMEOUT, pool_size).await;
    (proxy, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_claim_whose_reply_is_lost_is_read_back_as_claimed() {
    let (proxy, store) = pg_behind_proxy(1).await;
    // One pooled connection, with the claim statement already prepared on it,
    // so the next claim's first bytes on the wire are the statement itself.
    claim(&store, &req(&key("warm-up"), 1, LONG, false)).await;
    assert_eq!(proxy.connections(), 1);
    let s = key("ambiguous");
    let before = store.now().await.unwrap();

    assert_eq!(proxy.blackhole_existing_downstream(), 1);
    let started = Instant::now();
    let r = req(&s, 1, LONG, false);
    let out = store.claim(&r).await.expect("the read-back resolves the ambiguity");
    let took = started.elapsed();
    let ClaimOutcome::Claimed(c) = out else { panic!("expected Claimed, got {out:?}") };
    assert!(took >= FAULT_TIMEOUT, "the first reply was lost, so the claim waited for its timeout ({took:?})");
    assert_eq!((c.took_over, c.claim_token), (false, r.claim_token));

    let rec = row(&store, &s).await;
    assert_eq!((rec.state, rec.generation, rec.claim_token), (State::InFlight, c.generation, c.claim_token));
    assert!(
        rec.created_at < before.plus(FAULT_TIMEOUT / 2),
        "the row was written by the attempt whose reply was lost ({} vs {before}), not by a retry",
        rec.created_at
    );
    assert_eq!(key_set(&all(&store).await), set(&["warm-up", "ambiguous"]));
    // The broken connection was discarded, not returned to the pool.
    assert!(proxy.wait_connections(1, Duration::from_secs(5)).await, "{} connections", proxy.connections());
    assert_eq!(store.complete(&c, &response(201, b"ok"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_claim_that_never_arrived_is_retried() {
    let (proxy, store) = pg_behind_proxy(1).await;
    claim(&store, &req(&key("warm-up"), 1, LONG, false)).await;
    let s = key("lost");
    let before = store.now().await.unwrap();

    assert_eq!(proxy.blackhole_existing_upstream(), 1);
    let started = Instant::now();
    let r = req(&s, 1, LONG, false);
    let out = store.claim(&r).await.expect("no row on read-back: the claim is retried");
    let took = started.elapsed();
    let ClaimOutcome::Claimed(c) = out else { panic!("expected Claimed, got {out:?}") };
    assert!(took >= FAULT_TIMEOUT, "{took:?}");
    assert_eq!(c.claim_token, r.claim_token);
    let rec = row(&store, &s).await;
    assert_eq!((rec.state, rec.generation, rec.claim_token), (State::InFlight, c.generation, c.claim_token));
    assert!(rec.created_at >= before.plus(FAULT_TIMEOUT * 9 / 10), "the row was written by the retry ({} vs {before})", rec.created_at);
    assert_eq!(key_set(&all(&store).await), set(&["warm-up", "lost"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_complete_whose_reply_is_lost_is_read_back_as_written() {
    let (proxy, store) = pg_behind_proxy(1).await;
    // Prepare the complete statement on the one pooled connection.
    let warm = claim(&store, &req(&key("warm-up"), 1, LONG, false)).await;
    store.complete(&warm, &response(200, b"warm"), Retention::For(LONG)).await.unwrap();
    let s = key("ambiguous-complete");
    let c = claim(&store, &req(&s, 1, LONG, false)).await;
    let before = store.now().await.unwrap();

    assert_eq!(proxy.blackhole_existing_downstream(), 1);
    let started = Instant::now();
    let written = store.complete(&c, &response(201, b"kept"), Retention::For(LONG)).await.expect("the read-back resolves the ambiguity");
    let took = started.elapsed();
    assert_eq!(written, WriteOutcome::Written);
    assert!(took >= FAULT_TIMEOUT, "{took:?}");
    let rec = row(&store, &s).await;
    assert_eq!((rec.state, rec.generation), (State::Completed, c.generation));
    assert_eq!(rec.response, Some(response(201, b"kept")));
    assert!(rec.updated_at < before.plus(FAULT_TIMEOUT / 2), "written by the attempt whose reply was lost");
    // The write happened once: a repeat is fenced, the response is unchanged.
    assert_eq!(store.complete(&c, &response(500, b"again"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(row(&store, &s).await, rec);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_unreachable_store_fails_the_claim_and_writes_nothing() {
    let (proxy, store) = pg_behind_proxy(2).await;
    let s = key("unreachable");
    proxy.set(Fault::Refuse);
    proxy.reset_all();
    assert!(proxy.wait_connections(0, Duration::from_secs(5)).await);

    let started = Instant::now();
    let out = store.claim(&req(&s, 1, LONG, false)).await;
    assert!(matches!(out, Err(StoreError::Unavailable(_) | StoreError::Ambiguous(_))), "{out:?}");
    assert!(started.elapsed() < FAULT_TIMEOUT * 4, "failing is bounded: {:?}", started.elapsed());
    assert!(store.get(&s).await.is_err());
    assert!(store.ping().await.is_err());

    proxy.set(Fault::None);
    assert_eq!(get(&store, &s).await, None, "nothing was committed");
    assert_eq!(all(&store).await.len(), 0);
    let c = claim(&store, &req(&s, 1, LONG, false)).await;
    assert!(!c.took_over, "the same Store works once the store is back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_hung_store_fails_the_claim_within_its_timeout_and_writes_nothing() {
    let (proxy, store) = pg_behind_proxy(2).await;
    let s = key("hung");
    proxy.set(Fault::BlackholeUpstream);
    let started = Instant::now();
    let out = store.claim(&req(&s, 1, LONG, false)).await;
    let took = started.elapsed();
    // The claim timed out and so did its read-back: the outcome cannot be known.
    assert!(matches!(out, Err(StoreError::Ambiguous(_))), "{out:?}");
    assert!(took >= FAULT_TIMEOUT && took < FAULT_TIMEOUT * 4, "{took:?}");

    proxy.set(Fault::None);
    assert_eq!(get(&store, &s).await, None, "no statement reached the server");
    let c = claim(&store, &req(&s, 1, LONG, false)).await;
    assert!(!c.took_over, "a first claim: nothing was there to take over");
    assert_eq!(key_set(&all(&store).await), set(&["hung"]));
}

/// A claim whose first attempt may still commit stays ambiguous when a
/// later attempt fails for a definite reason. Here the first attempt's
/// commit waits for a synchronous standby that is not there
/// (`synchronous_standby_names`), so its read-back finds no row, and the
/// retry waits on the first attempt's insert until the database's
/// `lock_timeout` refuses it (55P03, a definite failure of that attempt).
/// The first commit lands once the standby requirement is lifted: the
/// caller must be told the claim may exist, so that it deletes it by its
/// token (`abandon`) rather than leave a record nothing was sent for to turn
/// `unknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_claim_that_may_still_commit_stays_ambiguous_after_a_definite_failure() {
    let server = tokio::task::spawn_blocking(PgServer::start).await.unwrap().expect("start private cluster");
    let url = server.create_database("conformance").expect("create database");
    server.simple_query("conformance", "ALTER DATABASE conformance SET lock_timeout = '300ms'").expect("lock_timeout");
    let store = open_with(&Backend::Postgres { url }, FAULT_TIMEOUT, 2).await;
    claim(&store, &req(&key("warm-up"), 1, LONG, false)).await;

    server.set_and_reload("synchronous_standby_names", "nobody").expect("commits wait for a standby");
    // The reload reaches the pooled session asynchronously (the postmaster
    // passes the signal on): wait until a new session sees it, then a
    // little longer for the idle ones.
    let seen = crate::support::eventually(Duration::from_secs(10), || async {
        server.simple_query("conformance", "SHOW synchronous_standby_names").is_ok_and(|rows| rows[0][0].as_deref() == Some("nobody"))
    })
    .await;
    assert!(seen, "the setting reached new sessions");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let s = key("may-commit");
    let r = req(&s, 1, LONG, false);
    let out = store.claim(&r).await;
    assert!(matches!(out, Err(StoreError::Ambiguous(_))), "the first attempt may still commit: {out:?}");
    if let Err(e) = &out {
        assert!(e.to_string().contains("lock"), "the later failure is named too: {e}");
    }

    server.set_and_reload("synchronous_standby_names", "").expect("commits go on");
    let landed = crate::support::eventually(Duration::from_secs(10), || async {
        matches!(store.get(&s).await, Ok(Some((rec, _))) if rec.claim_token == r.claim_token)
    })
    .await;
    assert!(landed, "the first attempt's commit landed late");
    assert_eq!(row(&store, &s).await.state, State::InFlight);
    assert!(store.abandon(&s, r.claim_token).await.expect("abandon"), "the caller deletes it by its token");
    assert_eq!(get(&store, &s).await, None);
    let c = claim(&store, &req(&s, 1, LONG, false)).await;
    assert!(!c.took_over, "the key is free again");
}

/// A database whose default isolation is REPEATABLE READ (a role's or a
/// database's setting). A claim that meets a key another transaction
/// inserted and commits while the claim waits on it must find that record,
/// as READ COMMITTED does; under REPEATABLE READ the statement fails with
/// 40001 and the request gets a spurious 503. The store pins its sessions
/// to READ COMMITTED: per session directly, per transaction behind
/// PgBouncer in transaction mode (where it must be set before the
/// transaction's first snapshot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_claim_meeting_a_concurrent_insert_under_a_repeatable_read_default_finds_it() {
    let direct = pg::shared().create_unique_database("isolation").expect("create database");
    claim_under_repeatable_read(Backend::Postgres { url: direct.clone() }, &direct, "default_transaction_isolation").await;
    let pooled = crate::support::pgbouncer_backend();
    let Backend::Pooled { direct, .. } = &pooled else { unreachable!() };
    let direct = direct.clone();
    claim_under_repeatable_read(pooled, &direct, "transaction_isolation").await;
}

async fn claim_under_repeatable_read(backend: Backend, url: &str, setting: &str) {
    let server = pg::shared();
    let name = url.rsplit('/').next().expect("a database name").split('?').next().unwrap_or_default().to_owned();
    server.simple_query(&name, &format!("ALTER DATABASE {name} SET default_transaction_isolation = 'repeatable read'")).expect("alter");
    let store = open_with(&backend, Duration::from_secs(10), 2).await;
    let url = url.to_owned();
    claim(&store, &req(&key("first"), 1, LONG, false)).await;
    let (raw, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.expect("connect");
    tokio::spawn(conn);
    // Another claimer's row for `second`, held uncommitted.
    raw.batch_execute(
        "BEGIN; INSERT INTO idemgate_records SELECT (jsonb_populate_record(NULL::idemgate_records, to_jsonb(r) || jsonb_build_object(\
             'idempotency_key', 'second', 'scope_id', idemgate_scope_id(r.tenant, r.principal, r.operation, 'second'), \
             'claim_token', gen_random_uuid()))).* FROM idemgate_records r WHERE r.idempotency_key = 'first'",
    )
    .await
    .expect("insert, uncommitted");
    let claiming = {
        let store = store.clone();
        tokio::spawn(async move { store.claim(&req(&key("second"), 1, LONG, false)).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    raw.batch_execute("COMMIT").await.expect("commit");
    let out = claiming.await.unwrap();
    assert!(matches!(out, Ok(ClaimOutcome::Existing { .. })), "the other claimer's record is found: {out:?}");
    let report = store.check_sessions().await.expect("sessions");
    assert!(report.problems.is_empty(), "{:?}", report.problems);
    assert!(report.note.contains(&format!("{setting}=read committed")), "{}", report.note);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_restart_is_survived_by_the_same_store() {
    let mut server = tokio::task::spawn_blocking(PgServer::start).await.unwrap().expect("start private cluster");
    let url = server.create_database("conformance").expect("create database");
    let store = open_with(&Backend::Postgres { url }, Duration::from_secs(2), 4).await;
    let first = key("before-crash");
    let c1 = claim(&store, &req(&first, 1, LONG, false)).await;

    let mut server = tokio::task::spawn_blocking(move || server.stop_immediate().map(|()| server)).await.unwrap().expect("stop_immediate");
    let down = store.claim(&req(&key("while-down"), 1, LONG, false)).await;
    assert!(matches!(down, Err(StoreError::Unavailable(_) | StoreError::Ambiguous(_))), "{down:?}");
    assert!(store.ping().await.is_err());

    let server = tokio::task::spawn_blocking(move || server.start_again().map(|()| server)).await.unwrap().expect("start_again");
    // The same Store, not recreated: dead pooled connections are dropped and
    // the first operation after the restart succeeds.
    let second = key("after-restart");
    let c2 = claim(&store, &req(&second, 1, LONG, false)).await;
    assert!(c2.generation > c1.generation, "the generation sequence survived the restart");
    let rec = row(&store, &first).await;
    assert_eq!(
        (rec.state, rec.generation, rec.claim_token),
        (State::InFlight, c1.generation, c1.claim_token),
        "the committed claim survived"
    );
    assert_eq!(get(&store, &key("while-down")).await, None);
    assert_eq!(store.complete(&c1, &response(201, b"after"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
    assert_eq!(key_set(&all(&store).await), set(&["before-crash", "after-restart"]));
    drop(server);
}

// ---------------------------------------------------------------------------
// The fault proxy itself, in front of an echo server

async fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

async fn roundtrip(c: &mut TcpStream, msg: &[u8]) -> Vec<u8> {
    c.write_all(msg).await.unwrap();
    let mut buf = vec![0; msg.len()];
    tokio::time::timeout(Duration::from_secs(5), c.read_exact(&mut buf)).await.expect("echo within 5s").unwrap();
    buf
}

/// Nothing arrives on `c` within a little while.
async fn silent(c: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    tokio::time::timeout(Duration::from_millis(200), c.read(&mut buf)).await.is_err()
}

fn is_reset<T: std::fmt::Debug>(r: &std::io::Result<T>) -> bool {
    matches!(r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset)
}

/// A connection to `addr` is reset: either while connecting (the RST came
/// before the handshake was seen complete) or on the first read.
async fn refused(addr: SocketAddr) -> bool {
    match TcpStream::connect(addr).await {
        Ok(mut s) => {
            let mut buf = [0u8; 8];
            is_reset(&tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.expect("reset within 5s"))
        }
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_proxy_forwards_delays_and_blackholes() {
    let proxy = FaultProxy::start(echo_server().await).await;
    let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut c, b"hello").await, b"hello");
    assert_eq!(proxy.connections(), 1);

    proxy.set(Fault::Delay(Duration::from_millis(150)));
    let t = Instant::now();
    assert_eq!(roundtrip(&mut c, b"slow").await, b"slow");
    assert!(t.elapsed() >= Duration::from_millis(300), "delayed each way: {:?}", t.elapsed());

    proxy.set(Fault::BlackholeDownstream);
    c.write_all(b"dropped-down").await.unwrap();
    assert!(silent(&mut c).await);
    proxy.set(Fault::None);
    assert_eq!(roundtrip(&mut c, b"after").await, b"after", "the dropped reply never shows up later");

    proxy.set(Fault::BlackholeUpstream);
    c.write_all(b"dropped-up").await.unwrap();
    assert!(silent(&mut c).await);
    // A connection opened under the fault is affected too.
    let mut fresh = TcpStream::connect(proxy.addr()).await.unwrap();
    fresh.write_all(b"x").await.unwrap();
    assert!(silent(&mut fresh).await);
    proxy.set(Fault::None);
    assert_eq!(roundtrip(&mut c, b"again").await, b"again");
    assert_eq!(roundtrip(&mut fresh, b"y").await, b"y");
    assert_eq!(proxy.connections(), 2);

    // Blackholing only the existing connections lets new ones through.
    assert_eq!(proxy.blackhole_existing_downstream(), 2);
    let mut later = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut later, b"new").await, b"new");
    c.write_all(b"old").await.unwrap();
    assert!(silent(&mut c).await);
    assert_eq!(proxy.fault(), Fault::None);

    drop((c, fresh, later));
    assert!(proxy.wait_connections(0, Duration::from_secs(5)).await, "closed connections leave the registry");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_proxy_resets_refuses_and_closes() {
    let proxy = FaultProxy::start(echo_server().await).await;
    let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
    let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut a, b"a").await, b"a");
    assert_eq!(roundtrip(&mut b, b"b").await, b"b");
    assert_eq!(proxy.reset_all(), 2);
    let mut buf = [0u8; 8];
    assert!(is_reset(&a.read(&mut buf).await), "reset, not closed");
    assert!(is_reset(&b.read(&mut buf).await));
    assert!(proxy.wait_connections(0, Duration::from_secs(5)).await);

    proxy.set(Fault::Refuse);
    let accepted = proxy.accepted();
    assert!(refused(proxy.addr()).await, "a new connection is reset");
    assert_eq!(proxy.accepted(), accepted + 1);
    assert_eq!(proxy.connections(), 0);

    // CloseAfter counts from when it is set.
    proxy.set(Fault::None);
    let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut c, b"12345678").await, b"12345678");
    proxy.set(Fault::CloseAfter { bytes_down: 4 });
    c.write_all(b"abcdefgh").await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut got)).await.unwrap().unwrap();
    assert_eq!(got, b"abcd");

    // A proxy whose target is down resets its clients.
    let dead = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let to_dead = FaultProxy::start(dead).await;
    assert!(refused(to_dead.addr()).await);
    assert_eq!(to_dead.accepted(), 1);
}
