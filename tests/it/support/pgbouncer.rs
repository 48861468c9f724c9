//! PgBouncer in front of a private PostgreSQL (`support::postgres`), as a
//! user installs it: Debian's package (`scripts/test` installs it when
//! missing) and its configuration file with only the lines a user must add
//! (docs/operations.md, "Behind a connection pooler"):
//!
//! - `[databases] * = host=127.0.0.1 port=<PostgreSQL's port>`: where the
//!   databases are;
//! - `listen_port`, and `pool_mode = transaction` for transaction pooling
//!   (session pooling is PgBouncer's default);
//! - the client's password in `auth_file` (the package's `auth_type = md5`).
//!
//! Everything else is the package's file (`listen_addr = localhost`) with
//! its paths (log, pid file, Unix socket) moved into a temporary directory,
//! since the package's are root's. PgBouncer refuses to run as root: as
//! root, it runs as the account the PostgreSQL clusters run as.
//!
//! Like the clusters, it is started by a small `sh` watchdog that stops it
//! when the test process goes away, however it goes.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::io::{self, BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::chown;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::postgres::{self, PgServer, SUPERUSER};

/// The password of `SUPERUSER` in PgBouncer's `auth_file`.
pub const PASSWORD: &str = "bouncer-test-password";

/// The watchdog: starts PgBouncer in the background, prints its pid, then
/// blocks reading stdin (a pipe from the test process); EOF or a line stops it.
/// `$1` = log file, `$2` = directory to remove afterwards, `$3..` = the command.
const WATCHDOG: &str = r#"
log=$1; cleanup=$2; shift 2
"$@" </dev/null >>"$log" 2>&1 &
pid=$!
echo "$pid"
exec >/dev/null
read -r _cmd
kill -INT "$pid" 2>/dev/null
wait "$pid"
rm -rf -- "$cleanup"
"#;

/// PgBouncer's pool modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    Session,
    Transaction,
}

impl PoolMode {
    /// As `pool_mode` and idemgate's `store.pooler` spell it.
    pub fn name(self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        }
    }
}

/// A running PgBouncer.
pub struct PgBouncer {
    dir: tempfile::TempDir,
    port: u16,
    log: PathBuf,
    watchdog: Child,
    control: Option<ChildStdin>,
}

impl PgBouncer {
    /// Starts PgBouncer in `mode` in front of `pg`, on a free port, and waits
    /// until it accepts connections.
    pub fn start(pg: &PgServer, mode: PoolMode) -> io::Result<PgBouncer> {
        let binary = find_binary()?;
        let dir = tempfile::Builder::new().prefix("idemgate-pgbouncer-").tempdir()?;
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port();
        let path = |name: &str| dir.path().join(name);
        let (ini, users, log) = (path("pgbouncer.ini"), path("userlist.txt"), path("pgbouncer.log"));
        // The package's file (/etc/pgbouncer/pgbouncer.ini without its
        // comments), its paths moved here, and the lines a user adds.
        let pool_mode = match mode {
            PoolMode::Transaction => "pool_mode = transaction\n",
            PoolMode::Session => "",
        };
        let text = format!(
            "[databases]\n\
             * = host=127.0.0.1 port={pg_port}\n\
             [users]\n\
             [pgbouncer]\n\
             logfile = {log}\n\
             pidfile = {pid}\n\
             listen_addr = localhost\n\
             listen_port = {port}\n\
             unix_socket_dir = {dir}\n\
             auth_type = md5\n\
             auth_file = {users}\n\
             {pool_mode}",
            pg_port = pg.port(),
            log = log.display(),
            pid = path("pgbouncer.pid").display(),
            dir = dir.path().display(),
            users = users.display(),
        );
        std::fs::write(&ini, text)?;
        std::fs::write(&users, format!("\"{SUPERUSER}\" \"{PASSWORD}\"\n"))?;
        std::fs::write(&log, "")?;
        let ids = postgres::server_ids()?;
        if let Some((uid, gid)) = ids {
            for p in [dir.path().to_path_buf(), ini.clone(), users.clone(), log.clone()] {
                chown(&p, Some(uid), Some(gid))?;
            }
        }
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c").arg(WATCHDOG).arg("idemgate-pgbouncer-watchdog").arg(&log).arg(dir.path()).arg(&binary).arg(&ini);
        if let Some((uid, gid)) = ids {
            cmd.uid(uid).gid(gid);
        }
        cmd.current_dir(dir.path()).process_group(0).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null());
        let mut watchdog = cmd.spawn()?;
        let control = watchdog.stdin.take();
        if let Some(out) = watchdog.stdout.take() {
            let mut pid = String::new();
            BufReader::new(out).read_line(&mut pid)?;
        }
        let bouncer = PgBouncer { dir, port, log, watchdog, control };
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            if Instant::now() > deadline || matches!(bouncer_exited(&bouncer), Some(true)) {
                return Err(io::Error::other(format!("PgBouncer did not listen on {addr}:\n{}", bouncer.log_tail())));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(bouncer)
    }

    /// The URL of database `db` through PgBouncer (with the password it asks for).
    pub fn url(&self, db: &str) -> String {
        format!("postgres://{SUPERUSER}:{PASSWORD}@127.0.0.1:{}/{db}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// PgBouncer's log.
    pub fn log_tail(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

fn bouncer_exited(b: &PgBouncer) -> Option<bool> {
    let pid = b.watchdog.id();
    Some(!std::path::Path::new(&format!("/proc/{pid}")).exists())
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        drop(self.control.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.watchdog.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.watchdog.kill();
    }
}

/// `pgbouncer` on `PATH`, else Debian's `/usr/sbin/pgbouncer`.
fn find_binary() -> io::Result<PathBuf> {
    if let Ok(path) = std::env::var("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join("pgbouncer");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    let debian = PathBuf::from("/usr/sbin/pgbouncer");
    if debian.is_file() {
        return Ok(debian);
    }
    Err(io::Error::new(io::ErrorKind::NotFound, "pgbouncer not found (scripts/test installs it: apt-get install pgbouncer)"))
}

/// This test binary's PgBouncer in transaction mode, in front of its shared
/// PostgreSQL cluster (`postgres::shared`), started on first use.
pub fn shared_transaction() -> &'static PgBouncer {
    static SHARED: OnceLock<Result<PgBouncer, String>> = OnceLock::new();
    match SHARED.get_or_init(|| PgBouncer::start(postgres::shared(), PoolMode::Transaction).map_err(|e| e.to_string())) {
        Ok(bouncer) => bouncer,
        Err(e) => panic!("could not start the shared PgBouncer: {e}"),
    }
}
