//! `idemgate check-config --connect`: after the file validates, reach what `serve`
//! will need, without changing anything.
//!
//! - **PostgreSQL**: connect (with TLS when `sslmode` asks for it, as the store does) and run `SELECT 1`, within
//!   `store.operation_timeout` (at least 5 s). Nothing is created; migrations are not
//!   looked at.
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

/// Runs every check concurrently; results in a fixed order: the store, then the
/// upstreams as configured.
pub async fn check_connections(config: &Config) -> Vec<ConnectCheck> {
    let store = check_store(&config.store);
    let upstreams = join_all(config.upstreams.iter().map(check_upstream));
    let (store, upstreams) = tokio::join!(store, upstreams);
    std::iter::once(store).chain(upstreams).collect()
}

async fn check_store(store: &StoreConfig) -> ConnectCheck {
    let outcome = match &store.backend {
        StoreBackend::Postgres { url, .. } => check_postgres(url, store.operation_timeout.max(MIN_STORE_BOUND)).await,
        StoreBackend::Sqlite { path } => {
            let (path, migrate) = (path.clone(), store.migrate);
            match tokio::task::spawn_blocking(move || check_sqlite(&path, migrate)).await {
                Ok(outcome) => outcome,
                Err(e) => Err(format!("the check did not finish: {e}")),
            }
        }
    };
    ConnectCheck { subject: "store".to_owned(), outcome }
}

async fn check_postgres(url: &Secret, bound: Duration) -> Result<Option<String>, String> {
    // Validation already parsed it; a failure here would be a bug, reported without the URL.
    let parsed = crate::tls::postgres::parse(url.expose()).map_err(|_| "the PostgreSQL connection string does not parse".to_owned())?;
    let (mut pg, tls) = (parsed.config, parsed.tls);
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(bound);
    }
    pg.application_name("idemgate check-config");
    let attempt = async {
        match tls {
            Some(tls) => {
                let (client, connection) =
                    pg.connect(tokio_postgres_rustls::MakeRustlsConnect::new(tls)).await.map_err(|e| error_chain(&e))?;
                select_one(client, connection).await
            }
            None => {
                let (client, connection) = pg.connect(tokio_postgres::NoTls).await.map_err(|e| error_chain(&e))?;
                select_one(client, connection).await
            }
        }
    };
    match tokio::time::timeout(bound, attempt).await {
        Ok(Ok(())) => Ok(Some("postgres, SELECT 1".to_owned())),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(format!("no answer from PostgreSQL within {}", humantime::format_duration(bound))),
    }
}

async fn select_one(
    client: tokio_postgres::Client,
    connection: impl std::future::Future<Output = Result<(), tokio_postgres::Error>>,
) -> Result<(), String> {
    tokio::pin!(connection);
    tokio::select! {
        rows = client.simple_query("SELECT 1") => rows.map(drop).map_err(|e| error_chain(&e)),
        ended = &mut connection => Err(match ended {
            Ok(()) => "the server closed the connection".to_owned(),
            Err(e) => error_chain(&e),
        }),
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
