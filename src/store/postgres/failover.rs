//! Reaching the primary of a replicated PostgreSQL, and letting go of the old
//! one after a failover.
//!
//! - **Only the primary.** Every session asks for `target_session_attrs =
//!   read-write`: a standby (or a primary fenced read-only) refuses the
//!   session at connect time, so the pool never holds a connection that cannot
//!   write.
//! - **Several hosts, each bounded.** A URL may list several hosts
//!   (`postgres://a:5432,b:5432/db`). tokio-postgres bounds only each TCP
//!   connect, so a host that accepts TCP but never answers (a frozen server, a
//!   blackholed path) would hold the whole walk until the pool's create
//!   timeout and the next host would never be tried. [`HostWalk`] gives every
//!   host but the last its share of the operation timeout, and starts with the
//!   host that last gave a read-write session, so after a failover new
//!   connections go straight to the new primary.
//! - **Forgetting the old primary.** A server that answers "read-only"
//!   (SQLSTATE 25006, a fenced or demoted primary), a server shutting down
//!   (57P01-57P03), a connection exception (class 08) or a lost connection
//!   means every pooled connection may point at a server that is no longer the
//!   primary. [`Flush`] marks that instant: idle connections opened before it
//!   are closed at once, and connections in use then are discarded when they
//!   would next be handed out (a `pre_recycle` hook), so the pool reconnects to
//!   whichever host is the primary now, without a restart. A Citus
//!   coordinator's error about one of its workers (`citus::remote_node_error`,
//!   08006 "connection to the remote node ... failed" among them) is not one
//!   of these: the coordinator answered and its session goes on serving.
// deadpool stamps its connections with std's clock; the flush mark must be
// comparable with them, so this module keeps std's `Instant`.
#![allow(clippy::disallowed_types)]

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;
use std::time::Duration;
use std::time::Instant;

use deadpool_postgres::{Connect, Hook, HookError, Pool};
use tokio::task::JoinHandle;
use tokio_postgres::AsyncMessage;
use tokio_postgres::config::Host;
use tokio_postgres::error::{DbError, Severity, SqlState};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{Client, Config, Socket};

/// What a failed statement says about its connection and the server behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SessionFate {
    /// The server refused this statement (constraint, deadlock, timeout, ...):
    /// the session is fine and goes back to the pool.
    Keep,
    /// The session is unusable (mid-protocol, or an error of our own):
    /// discard it.
    Discard,
    /// The server behind the session is gone or no longer the writable
    /// primary: discard it and every connection opened before now.
    Failover,
    /// The schema changed under the session's prepared statements (a
    /// migration ran while this replica served): PostgreSQL refused to run
    /// the statement ("cached plan must not change result type", 0A000), so
    /// it did not take effect. Every connection opened before now holds the
    /// same stale statements: discard them all; the statement may be run
    /// again on a new connection.
    Stale,
}

/// Classifies a failed statement's error by what it says about the session.
pub(super) fn fate(e: &tokio_postgres::Error) -> SessionFate {
    match e.code() {
        // A Citus coordinator's error about one of its workers: the
        // coordinator (this session's server) is fine, and so are the
        // pooled sessions of every other tenant.
        Some(_)
            if e.as_db_error().is_some_and(|db| db.parsed_severity() == Some(Severity::Error) && super::citus::remote_node_error(db)) =>
        {
            SessionFate::Keep
        }
        Some(code) if failover_code(code) => SessionFate::Failover,
        Some(code) if stale_plan(code, e) => SessionFate::Stale,
        Some(_) => SessionFate::Keep,
        // No SQLSTATE: the connection broke, or the client failed before or
        // while sending. A closed or broken connection points at the server.
        None if e.is_closed() || has_io_source(e) => SessionFate::Failover,
        None => SessionFate::Discard,
    }
}

/// A prepared statement whose result columns changed since it was prepared.
fn stale_plan(code: &SqlState, e: &tokio_postgres::Error) -> bool {
    *code == SqlState::FEATURE_NOT_SUPPORTED && e.as_db_error().is_some_and(|db| db.message().starts_with("cached plan must not change"))
}

/// SQLSTATEs that mean "this server is not (or soon not) the primary".
fn failover_code(code: &SqlState) -> bool {
    *code == SqlState::READ_ONLY_SQL_TRANSACTION
        || *code == SqlState::ADMIN_SHUTDOWN
        || *code == SqlState::CRASH_SHUTDOWN
        || *code == SqlState::CANNOT_CONNECT_NOW
        || code.code().starts_with("08")
}

fn has_io_source(e: &tokio_postgres::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if s.is::<std::io::Error>() {
            return true;
        }
        source = s.source();
    }
    false
}

/// The instant after which pooled connections are trusted; see the module doc.
#[derive(Debug, Default)]
pub(super) struct Flush {
    since: Mutex<Option<Instant>>,
}

impl Flush {
    /// Connections opened before now are not used again.
    pub(super) fn now(&self, pool: &Pool, why: &str) {
        let mark = Instant::now();
        if let Ok(mut since) = self.since.lock() {
            *since = Some(mark);
        }
        let closed = pool.retain(|_, metrics| metrics.created > mark).removed.len();
        tracing::warn!(reason = why, idle_closed = closed, "database connections opened before now will not be reused");
    }

    fn stale(&self, created: Instant) -> bool {
        self.since.lock().ok().and_then(|s| *s).is_some_and(|mark| created <= mark)
    }

    /// The pool hook that discards a connection opened before the last flush
    /// instead of handing it out.
    pub(super) fn hook(flush: std::sync::Arc<Flush>) -> Hook {
        Hook::sync_fn(
            move |_, metrics| {
                if flush.stale(metrics.created) { Err(HookError::message("connection opened before a failover")) } else { Ok(()) }
            },
        )
    }
}

type ConnectFuture<'a> = Pin<Box<dyn Future<Output = Result<(Client, JoinHandle<()>), tokio_postgres::Error>> + Send + 'a>>;

/// Connects to the first host of the URL that gives a read-write session,
/// starting with the one that did last time; see the module doc.
pub(super) struct HostWalk<T> {
    /// One config per host of the URL, in the URL's order.
    hosts: Vec<Config>,
    /// Bound on each host but the last one tried; the pool's create timeout
    /// bounds the walk as a whole.
    per_host: Duration,
    /// Index into `hosts` of the host to try first: the one that last gave
    /// a read-write session, or the one after a host still being tried.
    preferred: AtomicUsize,
    /// The host that last gave a read-write session (for the log line when
    /// it changes).
    last_good: AtomicUsize,
    tls: T,
}

impl<T> HostWalk<T> {
    /// Splits `config` into one config per host. `timeout` is the bound on the
    /// whole walk (the pool's create timeout); each host gets an equal share.
    pub(super) fn new(config: &Config, timeout: Duration, tls: T) -> HostWalk<T> {
        let n = config.get_hosts().len().max(config.get_hostaddrs().len()).max(1);
        let per_host = timeout / u32::try_from(n).unwrap_or(u32::MAX);
        let hosts = (0..n)
            .map(|i| {
                let mut one = one_host(config, i);
                one.connect_timeout(per_host);
                one
            })
            .collect();
        HostWalk { hosts, per_host, preferred: AtomicUsize::new(0), last_good: AtomicUsize::new(0), tls }
    }
}

impl<T> Connect for HostWalk<T>
where
    T: MakeTlsConnect<Socket> + Clone + Sync + Send + 'static,
    T::Stream: Sync + Send,
    T::TlsConnect: Sync + Send,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    fn connect(&self, _whole: &Config) -> ConnectFuture<'_> {
        Box::pin(async move {
            let n = self.hosts.len();
            let first = self.preferred.load(Ordering::Relaxed) % n;
            let order: Vec<usize> = (0..n).map(|step| (first + step) % n).collect();
            let Some((&last, earlier)) = order.split_last() else { unreachable!("a walk has at least one host") };
            for &i in earlier {
                let before = self.suspect(i);
                match tokio::time::timeout(self.per_host, self.hosts[i].connect(self.tls.clone())).await {
                    Ok(Ok(pair)) => return Ok(self.adopt(i, pair)),
                    Ok(Err(e)) => {
                        self.unsuspect(i, before);
                        tracing::debug!(host = i, error = %e, "database host refused a read-write session");
                    }
                    Err(_) => {
                        crate::telemetry::throttle::warn_throttled!(host = i, bound = ?self.per_host, "database host did not answer in time; trying the next")
                    }
                }
            }
            let before = self.suspect(last);
            match self.hosts[last].connect(self.tls.clone()).await {
                Ok(pair) => Ok(self.adopt(last, pair)),
                Err(e) => {
                    self.unsuspect(last, before);
                    Err(e)
                }
            }
        })
    }
}

impl<T> HostWalk<T> {
    /// Until host `i` answers, the next one is first in line, so a host that
    /// hangs (and whose attempt times out, or is cut short by its caller, e.g.
    /// a readiness probe's bound) is not at the head of the next walk.
    /// Returns the host that was first in line before.
    fn suspect(&self, i: usize) -> usize {
        self.preferred.swap((i + 1) % self.hosts.len(), Ordering::Relaxed)
    }

    /// Host `i` answered quickly, if only with a refusal (a standby): the
    /// order goes back to what it was.
    fn unsuspect(&self, i: usize, before: usize) {
        let _ = self.preferred.compare_exchange((i + 1) % self.hosts.len(), before, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Remembers host `i` as the one to try first, and starts the
    /// connection's driver (its handle is aborted when the pooled client is
    /// dropped).
    fn adopt<S>(&self, i: usize, (client, connection): (Client, tokio_postgres::Connection<Socket, S>)) -> (Client, JoinHandle<()>)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        if self.hosts.len() > 1 && self.last_good.swap(i, Ordering::Relaxed) != i {
            tracing::info!(host = i, "connected to the read-write database host");
        }
        self.preferred.store(i, Ordering::Relaxed);
        let driver = tokio::spawn(async move {
            let mut connection = connection;
            // Drives the connection as awaiting it would, but the server's
            // notices come here instead of tokio-postgres' `log` line.
            let ended = std::future::poll_fn(|cx| {
                loop {
                    match connection.poll_message(cx) {
                        Poll::Ready(Some(Ok(AsyncMessage::Notice(notice)))) => server_notice(&notice),
                        Poll::Ready(Some(Ok(_))) => {}
                        Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
                        Poll::Ready(None) => return Poll::Ready(Ok(())),
                        Poll::Pending => return Poll::Pending,
                    }
                }
            })
            .await;
            if let Err(e) = ended {
                tracing::debug!(error = %e, "database connection ended");
            }
        });
        (client, driver)
    }
}

/// A message the server sends beside a statement's result (NOTICE, WARNING,
/// ...): a warning is logged as one, anything milder at debug (migrations'
/// `IF NOT EXISTS` notices are routine), with the server's fields.
fn server_notice(notice: &DbError) {
    let (severity, code, message) = (notice.severity(), notice.code().code(), notice.message());
    match notice.parsed_severity() {
        Some(Severity::Warning) => tracing::warn!(severity, code, message, "database server warning"),
        _ => tracing::debug!(severity, code, message, "database server notice"),
    }
}

/// `config` with only its `i`-th host (and hostaddr and port). Everything
/// else is copied field by field: tokio-postgres can add hosts to a config
/// but not remove them.
pub(crate) fn one_host(config: &Config, i: usize) -> Config {
    let mut c = Config::new();
    if let Some(v) = config.get_user() {
        c.user(v);
    }
    if let Some(v) = config.get_password() {
        c.password(v);
    }
    if let Some(v) = config.get_dbname() {
        c.dbname(v);
    }
    if let Some(v) = config.get_options() {
        c.options(v);
    }
    if let Some(v) = config.get_application_name() {
        c.application_name(v);
    }
    c.ssl_mode(config.get_ssl_mode());
    c.ssl_negotiation(config.get_ssl_negotiation());
    match config.get_hosts().get(i) {
        Some(Host::Tcp(h)) => {
            c.host(h);
        }
        Some(Host::Unix(p)) => {
            c.host_path(p);
        }
        None => {}
    }
    if let Some(a) = config.get_hostaddrs().get(i) {
        c.hostaddr(*a);
    }
    // One port for all hosts, or one per host.
    if let Some(p) = config.get_ports().get(i).or_else(|| config.get_ports().first()) {
        c.port(*p);
    }
    if let Some(v) = config.get_connect_timeout() {
        c.connect_timeout(*v);
    }
    if let Some(v) = config.get_tcp_user_timeout() {
        c.tcp_user_timeout(*v);
    }
    c.keepalives(config.get_keepalives());
    c.keepalives_idle(config.get_keepalives_idle());
    if let Some(v) = config.get_keepalives_interval() {
        c.keepalives_interval(v);
    }
    if let Some(v) = config.get_keepalives_retries() {
        c.keepalives_retries(v);
    }
    c.target_session_attrs(config.get_target_session_attrs());
    c.channel_binding(config.get_channel_binding());
    c.load_balance_hosts(config.get_load_balance_hosts());
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_host_of_a_single_host_url_is_the_same_config() {
        let url = "postgres://u:secret@db.example:6543/app?application_name=x&options=-c%20a%3Db&connect_timeout=3\
                   &keepalives_idle=7&keepalives_interval=2&keepalives_retries=4&target_session_attrs=read-write\
                   &sslmode=disable&channel_binding=disable&tcp_user_timeout=5&load_balance_hosts=random";
        let c: Config = url.parse().unwrap();
        assert!(one_host(&c, 0) == c, "a field is not copied");
    }

    #[test]
    fn each_host_keeps_its_own_port_or_the_shared_one() {
        let c: Config = "postgres://u@a:1,b:2,c:3/db".parse().unwrap();
        let b = one_host(&c, 1);
        assert_eq!(b.get_hosts(), &[Host::Tcp("b".into())]);
        assert_eq!(b.get_ports(), &[2]);
        assert_eq!(b.get_dbname(), Some("db"));
        let shared: Config = "host=a,b port=5433 user=u".parse().unwrap();
        assert_eq!(one_host(&shared, 1).get_ports(), &[5433]);
        assert_eq!(one_host(&shared, 1).get_hosts(), &[Host::Tcp("b".into())]);
    }

    #[test]
    fn the_walk_splits_the_bound_between_hosts() {
        let c: Config = "postgres://u@a:1,b:2/db".parse().unwrap();
        let walk = HostWalk::new(&c, Duration::from_secs(4), tokio_postgres::NoTls);
        assert_eq!(walk.hosts.len(), 2);
        assert_eq!(walk.per_host, Duration::from_secs(2));
        assert_eq!(walk.hosts[1].get_connect_timeout(), Some(&Duration::from_secs(2)));
    }
}
