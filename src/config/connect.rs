//! `idemgate check-config --connect`: after the file validates, reach what `serve`
//! will need, without changing anything.
//!
//! - **PostgreSQL**: connect (with TLS when `sslmode` asks for it, as the store does),
//!   within `store.operation_timeout` (at least 5 s), and read (never change) what
//!   `serve` will need: `store schema` names the migrations not applied yet (an
//!   error unless `serve` will apply them itself: `store.migrate` on and a role
//!   that may change the schema), `store privileges` names every privilege the
//!   role lacks on the idemgate tables, sequences and functions, and `store
//!   sessions` reads back, on two of the store's own sessions, the settings it
//!   relies on (see `store::postgres::pooler`).
//! - **SQLite**: no connection is opened, so no lock (neither SQLite's nor `serve`'s
//!   `<path>.lock`) is taken and no journal file appears. An existing file must open
//!   for reading and writing and start with the SQLite header (an empty file is a new
//!   database to SQLite). A missing file is fine when `store.migrate` is on (`serve`
//!   creates it). Its directory, or the nearest existing parent that `serve` would
//!   create it in, must be writable: a probe file is created there and removed at once.
//! - **Upstreams**: a TCP connection to each upstream's host and port within its
//!   `connect_timeout` (for https upstreams, the TLS handshake too); no request is sent.
//!
//! Each check is one line: `store: ok (...)`, `upstream orders (http://127.0.0.1:9000): ok`,
//! or the subject and the error. Messages never include the PostgreSQL URL, which may
//! hold a password.

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::future::join_all;
use tokio::net::TcpStream;

use super::{Config, Secret, StoreBackend, StoreConfig, UpstreamConfig};

/// The shortest bound on the PostgreSQL check, whatever `store.operation_timeout` is.
const MIN_STORE_BOUND: Duration = Duration::from_secs(5);

/// The outcome of one check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectCheck {
    /// `store` or `upstream <name> (http://host:port)`.
    pub subject: String,
    /// `Ok` with an optional note, or the error.
    pub outcome: Result<Option<String>, String>,
}

impl ConnectCheck {
    pub fn is_ok(&self) -> bool {
        self.outcome.is_ok()
    }
}

impl fmt::Display for ConnectCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.outcome {
            Ok(None) => write!(f, "{}: ok", self.subject),
            Ok(Some(note)) => write!(f, "{}: ok ({note})", self.subject),
            Err(e) => write!(f, "{}: error: {e}", self.subject),
        }
    }
}

/// Runs every check concurrently; results in a fixed order: the store (on
/// PostgreSQL also its schema and the role's privileges), then the upstreams
/// as configured.
pub async fn check_connections(config: &Config) -> Vec<ConnectCheck> {
    let store = check_store(&config.store);
    let upstreams = join_all(config.upstreams.iter().map(check_upstream));
    let (store, upstreams) = tokio::join!(store, upstreams);
    store.into_iter().chain(upstreams).collect()
}

async fn check_store(store: &StoreConfig) -> Vec<ConnectCheck> {
    let line = |subject: &str, outcome| ConnectCheck { subject: subject.to_owned(), outcome };
    match &store.backend {
        StoreBackend::Postgres { url, .. } | StoreBackend::Citus { url, .. } => {
            match check_postgres(url, &store.backend, store.operation_timeout.max(MIN_STORE_BOUND)).await {
                Ok(found) => {
                    let kind = if matches!(store.backend, StoreBackend::Citus { .. }) { "citus" } else { "postgres" };
                    let mut lines = vec![
                        line("store", Ok(Some(format!("{kind}, as role {}", found.role)))),
                        found.schema(store.migrate),
                        found.privileges(),
                    ];
                    if let Some(cluster) = &found.cluster {
                        lines.push(line("store cluster", cluster.clone()));
                    }
                    lines.push(line("store sessions", check_sessions(store).await));
                    lines.push(line("store connections", found.connections(&store.backend)));
                    lines
                }
                Err(e) => vec![line("store", Err(e))],
            }
        }
        StoreBackend::Sqlite { path } => {
            let (path, migrate) = (path.clone(), store.migrate);
            let outcome = match tokio::task::spawn_blocking(move || check_sqlite(&path, migrate)).await {
                Ok(outcome) => outcome,
                Err(e) => Err(format!("the check did not finish: {e}")),
            };
            vec![line("store", outcome)]
        }
    }
}

async fn check_postgres(url: &Secret, backend: &StoreBackend, bound: Duration) -> Result<PgFindings, String> {
    // Validation already parsed it; a failure here would be a bug, reported without the URL.
    let parsed = crate::tls::postgres::parse(url.expose()).map_err(|_| "the PostgreSQL connection string does not parse".to_owned())?;
    let (mut pg, tls) = (parsed.config, parsed.tls);
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(bound);
    }
    pg.application_name("idemgate check-config");
    let attempt = async {
        let (client, driver) = connect(&pg, tls.clone()).await.map_err(|e| error_chain(&e))?;
        // Read inside a transaction: each statement prepared for a read is
        // closed on the server session that prepared it, behind a pooler in
        // transaction mode too.
        client.batch_execute("BEGIN READ ONLY").await.map_err(|e| error_chain(&e))?;
        let mut found = PgFindings::read(&client, matches!(backend, StoreBackend::Citus { .. })).await;
        if let (Ok(found), StoreBackend::Citus { .. }) = (&mut found, backend) {
            found.cluster = Some(citus_cluster(&client).await);
        }
        if let Ok(found) = &mut found
            && counted(backend)
            && routed_hosts(&pg, backend) == 0
        {
            found.rooms = vec![Room::read(&client, None).await];
        }
        drop(client.batch_execute("ROLLBACK").await);
        driver.abort();
        found
    };
    let mut found = match tokio::time::timeout(bound, attempt).await {
        Ok(found) => found?,
        Err(_) => return Err(format!("no answer from PostgreSQL within {}", humantime::format_duration(bound))),
    };
    // Each node of a Citus store given several hosts, on a connection of its
    // own and within its own bound: one that does not answer is named, and
    // the other lines stand.
    let hosts = if counted(backend) { routed_hosts(&pg, backend) } else { 0 };
    if hosts > 0 {
        found.rooms = join_all((0..hosts).map(|i| Room::of_host(&pg, tls.clone(), i, bound))).await;
    }
    Ok(found)
}

/// One connection as `pg` says (TLS when the URL's `sslmode` asks for it),
/// its driver running until the handle is aborted.
async fn connect(
    pg: &tokio_postgres::Config,
    tls: Option<rustls::ClientConfig>,
) -> Result<(tokio_postgres::Client, tokio::task::JoinHandle<()>), tokio_postgres::Error> {
    Ok(match tls {
        Some(tls) => {
            let (client, connection) = pg.connect(tokio_postgres_rustls::MakeRustlsConnect::new(tls)).await?;
            (client, tokio::spawn(async move { drop(connection.await) }))
        }
        None => {
            let (client, connection) = pg.connect(tokio_postgres::NoTls).await?;
            (client, tokio::spawn(async move { drop(connection.await) }))
        }
    })
}

/// Whether the `store connections` line counts sessions: not behind a
/// pooler, whose own limits stand between the replicas and the server.
fn counted(backend: &StoreBackend) -> bool {
    matches!(backend, StoreBackend::Postgres { pooler, .. } | StoreBackend::Citus { pooler, .. } if *pooler == crate::store::Pooler::None)
}

/// `store sessions`: the settings the store relies on, read back from its
/// own sessions as `serve` makes them (`store.pooler`), and a pooler in
/// transaction mode behind `pooler = "none"` or `"session"`. Only session
/// settings are made, which end with the sessions.
async fn check_sessions(store: &StoreConfig) -> Result<Option<String>, String> {
    let opened = crate::store::Store::open(store, crate::store::Access::Existing).await.map_err(|e| e.to_string())?;
    let report = opened.check_sessions().await.map_err(|e| e.to_string())?;
    if report.problems.is_empty() {
        Ok(Some(report.note))
    } else {
        Err(format!("{} (\"Behind a connection pooler\" in docs/operations.md)", report.problems.join("; ")))
    }
}

/// `store cluster` for `kind = "citus"`: the coordinator's active worker
/// nodes and whether the idemgate schema is distributed (or the start-up
/// error the store would give).
async fn citus_cluster(client: &tokio_postgres::Client) -> Result<Option<String>, String> {
    use crate::store::postgres::citus::{Flavor, check, inspect};
    let found = inspect(client).await.map_err(|e| error_chain(&e))?;
    check(Flavor::Citus, found).map_err(|e| e.to_string())?;
    let workers: i64 = client
        .query_one("SELECT count(*) FROM citus_get_active_worker_nodes()", &[])
        .await
        .map_err(|e| error_chain(&e))?
        .try_get(0)
        .map_err(|e| error_chain(&e))?;
    let schema = if found.distributed { "the schema is distributed by tenant" } else { "no idemgate schema yet (migrate distributes it)" };
    Ok(Some(format!("a coordinator and {workers} active worker node(s); {schema}")))
}

/// What `check-config --connect` reads from PostgreSQL, as the configured role.
#[derive(Debug, Default)]
struct PgFindings {
    /// `kind = "citus"`: the `store cluster` line.
    cluster: Option<Result<Option<String>, String>>,
    /// What each server the store's sessions reach allows and has in use
    /// (the `store connections` line).
    rooms: Vec<Result<Room, String>>,
    role: String,
    /// `current_schema()`: where the unqualified idemgate tables are.
    schema: String,
    /// This version's migrations not recorded as applied (all of them
    /// when the bookkeeping table does not exist).
    pending: Vec<&'static str>,
    /// The role may create tables in the schema and owns (or is a member
    /// of the owner of) the idemgate tables that exist: it may migrate.
    may_migrate: bool,
    /// `INSERT, UPDATE on idemgate_records`, `USAGE on sequence ...`, one
    /// entry per object the role lacks something on.
    missing: Vec<String>,
    /// Tables, sequences and functions whose privileges were checked.
    checked: usize,
}

/// The privileges `serve` needs on each kind of idemgate object.
const TABLE_PRIVILEGES: [&str; 4] = ["SELECT", "INSERT", "UPDATE", "DELETE"];

impl PgFindings {
    /// Reads only: catalog queries and the applied migrations.
    async fn read(client: &tokio_postgres::Client, citus: bool) -> Result<PgFindings, String> {
        let e = |e: tokio_postgres::Error| error_chain(&e);
        let row = client
            .query_one(
                "SELECT current_user::text, coalesce(current_schema()::text, ''), \
                        coalesce(has_schema_privilege(current_schema(), 'USAGE'), false), \
                        coalesce(has_schema_privilege(current_schema(), 'CREATE'), false), \
                        to_regclass('idemgate_schema_migrations') IS NOT NULL, \
                        coalesce((SELECT bool_and(pg_has_role(c.relowner, 'USAGE')) FROM pg_class c \
                                  WHERE c.relname LIKE 'idemgate\\_%' AND c.relkind IN ('r', 'p') AND pg_table_is_visible(c.oid)), true)",
                &[],
            )
            .await
            .map_err(e)?;
        let mut found = PgFindings { role: row.get(0), schema: row.get(1), ..PgFindings::default() };
        let (usage, create, bookkept, owns): (bool, bool, bool, bool) = (row.get(2), row.get(3), row.get(4), row.get(5));
        found.may_migrate = create && owns;
        if found.schema.is_empty() {
            return Err(format!("role {} has no schema on its search_path to find the idemgate tables in", found.role));
        }
        if !usage {
            found.missing.push(format!("USAGE on schema {}", found.schema));
        }
        let applied: Vec<i64> = if bookkept {
            match client.query("SELECT version FROM idemgate_schema_migrations", &[]).await {
                Ok(rows) => rows.iter().map(|r| r.get(0)).collect(),
                Err(err) => return Err(format!("cannot read idemgate_schema_migrations: {}", error_chain(&err))),
            }
        } else {
            Vec::new()
        };
        found.pending = crate::store::migrations::POSTGRES.iter().filter(|m| !applied.contains(&m.version)).map(|m| m.name).collect();
        // Recorded without the log (an earlier version on a database with
        // the Citus extension): `migrate` applies them again.
        let log = crate::store::migrations::EVENT_LOG;
        if !citus && log.iter().all(|v| applied.contains(v)) {
            let missing: bool = client.query_one("SELECT to_regclass('idemgate_event_rotation') IS NULL", &[]).await.map_err(e)?.get(0);
            if missing {
                found.pending.extend(crate::store::migrations::POSTGRES.iter().filter(|m| log.contains(&m.version)).map(|m| m.name));
            }
        }

        let objects = client
            .query(
                "SELECT c.relname::text, c.relkind::text, \
                        CASE WHEN c.relkind = 'S' THEN ARRAY[has_sequence_privilege(c.oid, 'USAGE')] \
                             ELSE ARRAY[has_table_privilege(c.oid, 'SELECT'), has_table_privilege(c.oid, 'INSERT'), \
                                        has_table_privilege(c.oid, 'UPDATE'), has_table_privilege(c.oid, 'DELETE')] END \
                 FROM pg_class c \
                 WHERE c.relname LIKE 'idemgate\\_%' AND c.relkind IN ('r', 'p', 'S') AND pg_table_is_visible(c.oid) \
                 ORDER BY c.relname",
                &[],
            )
            .await
            .map_err(e)?;
        for row in &objects {
            let (name, kind, granted): (String, String, Vec<bool>) = (row.get(0), row.get(1), row.get(2));
            let lacking: Vec<&str> = if kind == "S" {
                granted.first().is_some_and(|g| !g).then_some("USAGE").into_iter().collect()
            } else if name == "idemgate_schema_migrations" {
                // serve never writes it; check-config reads it.
                granted.first().is_some_and(|g| !g).then_some("SELECT").into_iter().collect()
            } else {
                TABLE_PRIVILEGES.iter().zip(&granted).filter(|(_, g)| !**g).map(|(p, _)| *p).collect()
            };
            if !lacking.is_empty() {
                let what = if kind == "S" { format!("sequence {name}") } else { name };
                found.missing.push(format!("{} on {what}", lacking.join(", ")));
            }
            found.checked += 1;
        }
        let functions = client
            .query(
                "SELECT p.oid::regprocedure::text, has_function_privilege(p.oid, 'EXECUTE') FROM pg_proc p \
                 WHERE p.proname LIKE 'idemgate\\_%' AND pg_function_is_visible(p.oid) ORDER BY 1",
                &[],
            )
            .await
            .map_err(e)?;
        for row in &functions {
            let (name, granted): (String, bool) = (row.get(0), row.get(1));
            if !granted {
                found.missing.push(format!("EXECUTE on function {name}"));
            }
            found.checked += 1;
        }
        Ok(found)
    }

    /// `store schema`: every migration of this version applied, or who applies the rest.
    fn schema(&self, migrate: bool) -> ConnectCheck {
        let total = crate::store::migrations::POSTGRES.len();
        let outcome = if self.pending.is_empty() {
            Ok(Some(format!("all {total} migrations applied")))
        } else {
            let names = self.pending.join(", ");
            let n = self.pending.len();
            if migrate && self.may_migrate {
                Ok(Some(format!("{n} migration(s) not applied yet ({names}); serve applies them at start (store.migrate = true)")))
            } else if self.may_migrate {
                Err(format!("{n} migration(s) not applied ({names}): run `idemgate migrate`"))
            } else {
                Err(format!(
                    "{n} migration(s) not applied ({names}): run `idemgate migrate` as the role that owns the schema \
                     (role {} may not change schema {})",
                    self.role, self.schema
                ))
            }
        };
        ConnectCheck { subject: "store schema".to_owned(), outcome }
    }

    /// `store privileges`: what the role lacks for `serve`, named.
    fn privileges(&self) -> ConnectCheck {
        let outcome = if !self.missing.is_empty() {
            Err(format!("role {} lacks {} (the grants: \"PostgreSQL roles\" in docs/operations.md)", self.role, self.missing.join("; ")))
        } else if self.checked == 0 {
            Ok(Some("no idemgate tables yet: checked once they exist".to_owned()))
        } else {
            Ok(Some(format!("what serve needs on {} idemgate tables, sequences and functions", self.checked)))
        };
        ConnectCheck { subject: "store privileges".to_owned(), outcome }
    }
}

/// How many hosts of a Citus store's URL get a pool of their own (the
/// store's routing, `store::postgres::citus_route`): every host when the URL
/// lists several and no pooler in transaction mode is between; 0 otherwise
/// (only the server the check reached).
fn routed_hosts(pg: &tokio_postgres::Config, backend: &StoreBackend) -> usize {
    let hosts = pg.get_hosts().len().max(pg.get_hostaddrs().len());
    match backend {
        StoreBackend::Citus { pooler, .. } if hosts > 1 && *pooler != crate::store::Pooler::Transaction => hosts,
        _ => 0,
    }
}

/// What one server allows and has open, read when the check ran.
#[derive(Debug, Clone)]
struct Room {
    /// `host:port` (as the server says, or as the URL names it).
    host: String,
    /// `max_connections` less the connections reserved for superusers and
    /// for `pg_use_reserved_connections` (PostgreSQL 16).
    allowed: i64,
    /// Sessions open now (other replicas', this check's, Citus's own). A
    /// role without `pg_read_all_stats` sees other roles' sessions without
    /// their kind: those are counted too, with any background process among
    /// them (the count errs high, the room low).
    in_use: i64,
    /// The server is a standby (a multi-host URL's check reached one).
    standby: bool,
}

impl Room {
    /// `host` names the server as the URL does; without it, as the server
    /// says (`inet_server_addr`), or `the server` over a Unix socket.
    async fn read(client: &tokio_postgres::Client, host: Option<String>) -> Result<Room, String> {
        let label = host.clone().unwrap_or_else(|| "the server".to_owned());
        let row = client
            .query_one(
                "SELECT current_setting('max_connections')::int8 - current_setting('superuser_reserved_connections')::int8 \
                        - coalesce(current_setting('reserved_connections', true)::int8, 0), \
                        (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' OR backend_type IS NULL), \
                        pg_is_in_recovery(), host(inet_server_addr()) || ':' || inet_server_port()",
                &[],
            )
            .await
            .map_err(|e| format!("{label}: {}", error_chain(&e)))?;
        let said: Option<String> = row.try_get(3).map_err(|e| error_chain(&e))?;
        Ok(Room {
            host: host.or(said).unwrap_or(label),
            allowed: row.try_get(0).map_err(|e| error_chain(&e))?,
            in_use: row.try_get(1).map_err(|e| error_chain(&e))?,
            standby: row.try_get(2).map_err(|e| error_chain(&e))?,
        })
    }

    /// Host `i` of `pg`, over a connection of its own, within `bound`.
    async fn of_host(pg: &tokio_postgres::Config, tls: Option<rustls::ClientConfig>, i: usize, bound: Duration) -> Result<Room, String> {
        let one = crate::store::postgres::one_host(pg, i);
        let port = one.get_ports().first().copied().unwrap_or(5432);
        let host = match (one.get_hosts().first(), one.get_hostaddrs().first()) {
            (Some(tokio_postgres::config::Host::Tcp(h)), _) => format!("{h}:{port}"),
            (Some(tokio_postgres::config::Host::Unix(path)), _) => format!("{} (port {port})", path.display()),
            (None, Some(addr)) => format!("{addr}:{port}"),
            (None, None) => format!("host {}", i + 1),
        };
        let read = async {
            let (client, driver) = connect(&one, tls).await.map_err(|e| format!("{host}: {}", error_chain(&e)))?;
            let room = Room::read(&client, Some(host.clone())).await;
            driver.abort();
            room
        };
        match tokio::time::timeout(bound, read).await {
            Ok(room) => room,
            Err(_) => Err(format!("{host}: no answer within {}", humantime::format_duration(bound))),
        }
    }
}

impl PgFindings {
    /// `store connections`: about the most sessions this replica opens on
    /// each server the check counts, against what the server allows and has
    /// open, and how many replicas like this one fit at their busiest
    /// (docs/scaling.md, "Connections per node"). An error when a node did
    /// not answer, or when one replica alone may open more than a server
    /// allows.
    fn connections(&self, backend: &StoreBackend) -> Result<Option<String>, String> {
        let (pool_size, citus) = match backend {
            StoreBackend::Postgres { pool_size, .. } => (*pool_size, false),
            StoreBackend::Citus { pool_size, .. } => (*pool_size, true),
            StoreBackend::Sqlite { .. } => return Ok(None),
        };
        if !counted(backend) {
            return Ok(Some(
                "not counted behind a connection pooler: its own limits apply (PgBouncer's max_client_conn, and default_pool_size per database and role)"
                    .into(),
            ));
        }
        let pool_size = i64::try_from(pool_size).unwrap_or(i64::MAX);
        let routed = self.rooms.len() > 1;
        let failed: Vec<&str> = self.rooms.iter().filter_map(|r| r.as_ref().err()).map(String::as_str).collect();
        if !failed.is_empty() {
            return Err(failed.join("; "));
        }
        let mut notes = Vec::new();
        let mut fits = i64::MAX;
        for (i, room) in self.rooms.iter().filter_map(|r| r.as_ref().ok()).enumerate() {
            if room.standby && !routed {
                return Ok(Some(format!(
                    "not counted: the check reached a standby ({}), and the store's sessions go to the primary",
                    room.host
                )));
            }
            // A Citus store given several hosts: its pool for the tenants each
            // node holds, Citus's connections from the store's own sessions (one
            // to every node), and on the first host that answers (the first
            // listed, while it does) the store's pool itself.
            let most = match (routed, i) {
                (false, _) => pool_size,
                (true, 0) => 3 * pool_size,
                (true, _) => 2 * pool_size,
            };
            if most > room.allowed {
                return Err(format!(
                    "{} allows {} sessions (max_connections less the reserved ones), fewer than this replica alone \
                     may open there ({most}); raise max_connections or lower store.pool_size",
                    room.host, room.allowed
                ));
            }
            fits = fits.min((room.allowed - room.in_use).max(0) / most);
            notes.push(format!("{}: {} allowed, {} open now, this replica up to about {most}", room.host, room.allowed, room.in_use));
        }
        let unlisted = if citus && !routed {
            " (Citus: only the node in store.url is counted; the others get Citus's connections from its sessions too: list every node to count them)"
        } else {
            ""
        };
        Ok(Some(format!(
            "{}; room for {fits} replica(s) like this one at their busiest beside what is open now{unlisted}",
            notes.join("; ")
        )))
    }
}

/// An error and its causes, `a: b: c`, skipping a cause its parent already printed.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}

/// The first 16 bytes of every SQLite database file.
const SQLITE_HEADER: &[u8; 16] = b"SQLite format 3\0";

fn check_sqlite(path: &Path, migrate: bool) -> Result<Option<String>, String> {
    let shown = path.display();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    match std::fs::metadata(path) {
        Ok(meta) if !meta.is_file() => Err(format!("{shown} is not a file")),
        Ok(meta) => {
            let mut file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .map_err(|e| format!("cannot open {shown} for reading and writing: {e}"))?;
            if meta.len() > 0 {
                let mut header = [0u8; 16];
                file.read_exact(&mut header).map_err(|_| format!("{shown} is not an SQLite database"))?;
                if &header != SQLITE_HEADER {
                    return Err(format!("{shown} is not an SQLite database"));
                }
            }
            writable_dir(&dir)?;
            Ok(Some(format!("sqlite {shown}")))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if !migrate {
                return Err(format!("{shown} does not exist and store.migrate = false; run `idemgate migrate` first"));
            }
            let mut existing = dir.as_path();
            while !existing.exists() {
                existing = match existing.parent() {
                    Some(p) if !p.as_os_str().is_empty() => p,
                    _ => Path::new("."),
                };
            }
            writable_dir(existing)?;
            Ok(Some(format!("sqlite {shown} does not exist yet; serve creates it")))
        }
        Err(e) => Err(format!("cannot read {shown}: {e}")),
    }
}

/// SQLite writes its `-wal` and `-shm` files beside the database, so the directory must
/// be writable; only creating a file there says so for sure (permissions, ACLs,
/// read-only mounts). The probe is removed at once.
fn writable_dir(dir: &Path) -> Result<(), String> {
    if !dir.is_dir() {
        return Err(format!("{} is not a directory", dir.display()));
    }
    let probe = dir.join(format!(".idemgate-check-{}", std::process::id()));
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&probe) {
        Ok(file) => {
            drop(file);
            std::fs::remove_file(&probe).map_err(|e| format!("cannot remove the probe file {}: {e}", probe.display()))
        }
        Err(e) => Err(format!("directory {} is not writable: {e}", dir.display())),
    }
}

async fn check_upstream(u: &UpstreamConfig) -> ConnectCheck {
    // Validation guarantees an http:// or https:// URL with a host.
    let scheme = u.url.scheme_str().unwrap_or("http");
    let host = u.url.host().unwrap_or_default();
    let port = u.url.port_u16().unwrap_or(if u.tls.is_some() { 443 } else { 80 });
    let subject = format!("upstream {} ({scheme}://{host}:{port})", u.name);
    let bare = host.trim_start_matches('[').trim_end_matches(']').to_owned();
    // https: the TLS handshake too (the upstream's roots and client certificate).
    let connect = async {
        let stream = TcpStream::connect((bare.as_str(), port)).await.map_err(|e| e.to_string())?;
        let Some(tls) = &u.tls else { return Ok(None) };
        let name = rustls::pki_types::ServerName::try_from(bare.clone()).map_err(|e| format!("invalid server name: {e}"))?;
        let session =
            tokio_rustls::TlsConnector::from(tls.clone()).connect(name, stream).await.map_err(|e| format!("TLS handshake: {e}"))?;
        let version = session.get_ref().1.protocol_version().map(|v| format!("{v:?}")).unwrap_or_default();
        Ok(Some(format!("TLS handshake ok, {version}")))
    };
    let outcome = match tokio::time::timeout(u.connect_timeout, connect).await {
        Ok(result) => result,
        Err(_) => Err(format!("no connection within connect_timeout ({})", humantime::format_duration(u.connect_timeout))),
    };
    ConnectCheck { subject, outcome }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_read_as_documented() {
        let ok = ConnectCheck { subject: "store".into(), outcome: Ok(None) };
        assert_eq!(ok.to_string(), "store: ok");
        let note = ConnectCheck { subject: "store".into(), outcome: Ok(Some("sqlite x.db".into())) };
        assert_eq!(note.to_string(), "store: ok (sqlite x.db)");
        let bad = ConnectCheck { subject: "upstream a (http://h:1)".into(), outcome: Err("refused".into()) };
        assert_eq!(bad.to_string(), "upstream a (http://h:1): error: refused");
        assert!(!bad.is_ok());
    }

    #[test]
    fn sqlite_checks_create_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("sub").join("db.sqlite");
        assert!(check_sqlite(&missing, true).is_ok());
        assert!(check_sqlite(&missing, false).unwrap_err().contains("does not exist"));
        assert!(!dir.path().join("sub").exists());
        let empty = dir.path().join("empty.db");
        std::fs::write(&empty, b"").unwrap();
        assert!(check_sqlite(&empty, false).is_ok(), "an empty file is a new database to SQLite");
        let short = dir.path().join("short.db");
        std::fs::write(&short, b"SQLite").unwrap();
        assert!(check_sqlite(&short, true).unwrap_err().contains("not an SQLite database"));
        assert!(check_sqlite(dir.path(), true).unwrap_err().contains("not a file"));
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "only the two files written here: {names:?}");
    }
}
