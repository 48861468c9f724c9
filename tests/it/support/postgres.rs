//! A private PostgreSQL cluster for integration tests.
//!
//! Every test binary gets its own throw-away cluster: a fresh `initdb` in a temporary
//! directory, a Unix socket directory of its own, and TCP on `127.0.0.1` on a free
//! port. Nothing outside the test process is assumed to be running.
//!
//! * [`shared()`] is one cluster per test binary, started lazily. Tests isolate
//!   themselves with [`PgServer::create_database`] (or
//!   [`PgServer::create_unique_database`]).
//! * [`PgServer::start()`] gives a test a cluster of its own, for tests that stop,
//!   crash or restart the server.
//!
//! The API is synchronous std code. It never enters a tokio runtime, so it can be
//! called from plain `#[test]`s and from `#[tokio::test]`s alike (it blocks the calling
//! thread for as long as `initdb` and the start-up take, about a second).
//!
//! # Running as root
//! `initdb` and `postgres` refuse to run as root. When the effective uid is 0 the
//! cluster runs as `$IDEMGATE_TEST_PG_USER`, else `postgres` if `/etc/passwd` has it,
//! else `nobody`; its directories are `chown`ed to that user.
//!
//! # Binaries
//! `$IDEMGATE_TEST_PG_BINDIR` if set, else `postgres` and `initdb` on `PATH`, else
//! the newest `/usr/lib/postgresql/<N>/bin`. `scripts/ensure-postgres` installs them.
//!
//! # No orphaned servers
//! Statics are never dropped, so the shared cluster cannot rely on `Drop`. Two layers:
//!
//! 1. **Pipe watchdog.** The postmaster is started by a small `sh` watchdog whose stdin
//!    is a pipe from the test process. The watchdog blocks in `read`. When the test
//!    process goes away *for any reason* (normal exit, panic, `SIGKILL`) the kernel
//!    closes the pipe's write end, `read` sees EOF, and the watchdog sends `SIGQUIT`
//!    (immediate shutdown) to the postmaster, waits for it and removes the cluster's
//!    directory. The write end is close-on-exec (std creates pipes that way), so
//!    processes the tests spawn do not keep it open. The watchdog runs in its own
//!    process group, so a Ctrl-C on the terminal does not kill it before it can clean
//!    up. [`PgServer::stop_immediate`] writes `stop` on the pipe instead: the server
//!    stops but the directory stays, for [`PgServer::start_again`].
//! 2. **Stale sweep.** If the watchdog itself was killed, the postmaster would live on.
//!    Each cluster directory (`$TMPDIR/idemgate-pg-*`) holds an `owner` file with the
//!    owning test process's pid and start time. The first [`PgServer::start`] of every
//!    process (and [`sweep_stale_clusters`]) stops the postmasters of clusters whose
//!    owner is gone and removes their directories.
//!
//! (PostgreSQL adds a third net of its own: a postmaster whose data directory was
//! deleted notices at its next lock-file recheck, within about a minute, and exits.)
//!
//! Cluster directories go to `$IDEMGATE_TEST_PG_TMPDIR`, else the std temp dir. When
//! the server runs as another account, that parent must be like `/tmp` (traversable,
//! sticky-writable): otherwise the watchdog empties the directory at exit but cannot
//! remove it, and the next sweep does.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::fs;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::chown;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Once, OnceLock};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

/// The superuser `initdb` creates; every URL connects as it (trust authentication).
pub const SUPERUSER: &str = "idemgate";

/// How long `start`/`start_again` wait for the server to answer a real query.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a stop waits for the postmaster to exit and the port to close.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on one statement of the built-in client (CREATE DATABASE copies a template).
const QUERY_TIMEOUT: Duration = Duration::from_secs(120);
/// Attempts at a fresh port when another process takes ours between probe and bind.
const PORT_ATTEMPTS: usize = 4;
/// Cluster directories are `$TMPDIR/<DIR_PREFIX>XXXXXX`; the sweep looks for these.
const DIR_PREFIX: &str = "idemgate-pg-";
/// A directory without an `owner` file older than this is debris from a crashed setup.
const OWNERLESS_GRACE: Duration = Duration::from_secs(120);

/// The watchdog: starts the postmaster in the background, prints its pid, then blocks
/// reading stdin (a pipe whose only writer is the test process).
/// A line (`stop`) means "stop the server, keep the files" ; EOF means the owner is
/// gone or dropped us: stop the server and remove the cluster directory.
/// `$1` = log file, `$2` = directory to remove on EOF, `$3..` = postgres command.
const WATCHDOG: &str = r#"
log=$1; cleanup=$2; shift 2
"$@" </dev/null >>"$log" 2>&1 &
pid=$!
echo "$pid"
exec >/dev/null
if read -r _cmd; then
  kill -QUIT "$pid" 2>/dev/null
  wait "$pid"
else
  kill -QUIT "$pid" 2>/dev/null
  wait "$pid"
  rm -rf -- "$cleanup"
fi
"#;

/// One private PostgreSQL cluster: temporary data directory, private Unix socket
/// directory, TCP on `127.0.0.1:{port}`.
pub struct PgServer {
    /// Owns the cluster's base directory; removing it on drop is the last cleanup step.
    tmp: Option<tempfile::TempDir>,
    /// `data/` (PGDATA), `sock/`, `postgres.log` and `owner` live under here.
    base: PathBuf,
    data_dir: PathBuf,
    socket_dir: PathBuf,
    /// Server output from every start of this cluster, appended.
    log_path: PathBuf,
    /// Directory holding `postgres` and `initdb` of one major version.
    bin_dir: PathBuf,
    /// The unprivileged account the server runs as when we are root.
    run_as: Option<Account>,
    /// Fixed for the cluster's life so `start_again` comes back on the same address.
    port: u16,
    /// `None` while the server is stopped.
    running: Option<Running>,
    /// Time `start()` took (initdb + first start), for reports.
    startup: Duration,
    /// Server settings of this cluster beyond the harness's own (`name=value`,
    /// given on the command line at every start), e.g. `shared_preload_libraries=citus`.
    settings: Vec<String>,
}

/// A started server: the watchdog we talk to and the postmaster it supervises.
struct Running {
    watchdog: Child,
    /// Write end of the watchdog's stdin. Closing it (EOF) = stop and delete.
    control: Option<ChildStdin>,
    postmaster_pid: u32,
}

#[derive(Clone, Debug)]
struct Account {
    name: String,
    uid: u32,
    gid: u32,
}

/// Distinguishes "another process took the port" (retry with a new one) from real
/// failures.
enum SpawnError {
    PortTaken(io::Error),
    Other(io::Error),
}

impl PgServer {
    /// Creates a new cluster (`initdb`: trust auth, superuser `idemgate`, UTF8,
    /// `--no-sync`) and starts it on a free port, waiting until it answers a query.
    pub fn start() -> io::Result<PgServer> {
        PgServer::start_with_settings(&[])
    }

    /// Like [`start`](Self::start), with server settings of its own
    /// (`name=value`, on the command line at every start of this cluster).
    pub fn start_with_settings(settings: &[&str]) -> io::Result<PgServer> {
        let began = Instant::now();
        let mut server = PgServer::prepare_dirs()?;
        server.settings = settings.iter().map(|s| (*s).to_owned()).collect();
        server.initdb()?;
        server.start_on_free_port(began)?;
        Ok(server)
    }

    /// Like [`start`](Self::start), with `ssl = on` and the given server
    /// certificate and key (PEM), so clients can connect with TLS
    /// (`sslmode=require|verify-ca|verify-full`). Plain connections still work
    /// (the harness's own client uses them).
    pub fn start_with_ssl(cert_pem: &str, key_pem: &str) -> io::Result<PgServer> {
        use std::os::unix::fs::PermissionsExt;
        let began = Instant::now();
        let mut server = PgServer::prepare_dirs()?;
        server.initdb()?;
        let cert = server.data_dir.join("server.crt");
        let key = server.data_dir.join("server.key");
        fs::write(&cert, cert_pem)?;
        fs::write(&key, key_pem)?;
        fs::set_permissions(&key, fs::Permissions::from_mode(0o600))?;
        if let Some(acct) = &server.run_as {
            for p in [&cert, &key] {
                chown(p, Some(acct.uid), Some(acct.gid))?;
            }
        }
        let mut conf = fs::OpenOptions::new().append(true).open(server.data_dir.join("postgresql.conf"))?;
        io::Write::write_all(&mut conf, b"\nssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n")?;
        server.start_on_free_port(began)?;
        Ok(server)
    }

    /// A cluster directory (owner file, socket dir, log) without a data
    /// directory yet, and without a port.
    fn prepare_dirs() -> io::Result<PgServer> {
        static SWEEP: Once = Once::new();
        SWEEP.call_once(|| {
            let _ = sweep_stale_clusters();
        });

        let bin_dir = find_bin_dir()?;
        let run_as = server_account()?;

        let parent = cluster_parent_dir();
        let tmp = tempfile::Builder::new()
            .prefix(DIR_PREFIX)
            .tempdir_in(&parent)
            .map_err(|e| annotate(e, &format!("creating a temp dir in {}", parent.display())))?;
        let base = tmp.path().to_path_buf();
        write_owner_file(&base)?;
        let data_dir = base.join("data");
        let socket_dir = base.join("sock");
        let log_path = base.join("postgres.log");
        fs::create_dir(&socket_dir)?;
        fs::File::create(&log_path)?;
        if let Some(acct) = &run_as {
            for p in [&base, &socket_dir, &log_path] {
                chown(p, Some(acct.uid), Some(acct.gid)).map_err(|e| annotate(e, &format!("chown {} to {}", p.display(), acct.name)))?;
            }
        }

        Ok(PgServer {
            tmp: Some(tmp),
            base,
            data_dir,
            socket_dir,
            log_path,
            bin_dir,
            run_as,
            port: 0,
            running: None,
            startup: Duration::ZERO,
            settings: Vec::new(),
        })
    }

    fn start_on_free_port(&mut self, began: Instant) -> io::Result<()> {
        let mut last_err = None;
        for _ in 0..PORT_ATTEMPTS {
            self.port = free_port()?;
            match self.spawn_and_wait() {
                Ok(()) => {
                    self.startup = began.elapsed();
                    return Ok(());
                }
                Err(SpawnError::PortTaken(e)) => last_err = Some(e),
                Err(SpawnError::Other(e)) => return Err(e),
            }
        }
        Err(last_err.unwrap_or_else(|| io::Error::other("no free port found")))
    }

    /// TCP port on 127.0.0.1; stays the same across `stop_immediate`/`start_again`.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://idemgate@127.0.0.1:{port}/{db}`
    pub fn url(&self, db: &str) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{}/{db}", self.port)
    }

    /// The private Unix socket directory (`host=` for libpq-style clients).
    pub fn socket_dir(&self) -> &Path {
        &self.socket_dir
    }

    /// PGDATA of this cluster.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// How long `start()` took: initdb plus the first start until a query succeeded.
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// Pid of the running postmaster (runs as the unprivileged account when root).
    pub fn postmaster_pid(&self) -> Option<u32> {
        self.running.as_ref().map(|r| r.postmaster_pid)
    }

    /// Pid of the `sh` watchdog that stops the postmaster when this process goes away.
    pub fn watchdog_pid(&self) -> Option<u32> {
        self.running.as_ref().map(|r| r.watchdog.id())
    }

    /// The cluster's base directory (removed on drop, or by the watchdog at exit).
    pub fn base_dir(&self) -> &Path {
        &self.base
    }

    /// Whether the server was started and not stopped through this handle.
    pub fn is_running(&self) -> bool {
        self.running.is_some()
    }

    /// Creates database `name` and returns its URL. Names are limited to
    /// `[A-Za-z0-9_]{1,63}` so the URL needs no escaping.
    pub fn create_database(&self, name: &str) -> io::Result<String> {
        let valid = !name.is_empty() && name.len() <= 63 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !valid {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("database name {name:?} must match [A-Za-z0-9_]{{1,63}}")));
        }
        let mut conn = MiniConn::connect(self.port, "postgres", Duration::from_secs(5), QUERY_TIMEOUT)?;
        conn.simple_query(&format!("CREATE DATABASE \"{name}\"")).map_err(|e| annotate(e, &format!("CREATE DATABASE {name}")))?;
        Ok(self.url(name))
    }

    /// Creates a database named `{prefix}_{n}` with `n` unique in this process, and
    /// returns its URL. `prefix` follows the rules of [`create_database`](Self::create_database).
    pub fn create_unique_database(&self, prefix: &str) -> io::Result<String> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        self.create_database(&format!("{prefix}_{n}"))
    }

    /// Runs SQL through the built-in minimal client (simple query protocol, text
    /// results) and returns the rows of the last statement. For fixtures and checks in
    /// sync code; products should use a real driver.
    pub fn simple_query(&self, db: &str, sql: &str) -> io::Result<Vec<Vec<Option<String>>>> {
        let mut conn = MiniConn::connect(self.port, db, Duration::from_secs(5), QUERY_TIMEOUT)?;
        conn.simple_query(sql)
    }

    /// Immediate shutdown (`SIGQUIT` to the postmaster, like `pg_ctl stop -m
    /// immediate`: no checkpoint, crash recovery on the next start). Returns once the
    /// postmaster has exited and the port refuses connections. The data stays.
    pub fn stop_immediate(&mut self) -> io::Result<()> {
        let Some(running) = self.running.take() else {
            return Ok(());
        };
        self.stop_running(running, false)?;
        wait_port_closed(self.port, STOP_TIMEOUT).map_err(|e| self.with_log(e))
    }

    /// Starts the stopped cluster again on the same port and waits until it answers.
    pub fn start_again(&mut self) -> io::Result<()> {
        if self.running.is_some() {
            return Err(io::Error::other("start_again: the server is already running"));
        }
        match self.spawn_and_wait() {
            Ok(()) => Ok(()),
            Err(SpawnError::PortTaken(e) | SpawnError::Other(e)) => Err(e),
        }
    }

    /// `stop_immediate` then `start_again`.
    pub fn restart_immediate(&mut self) -> io::Result<()> {
        self.stop_immediate()?;
        self.start_again()
    }

    /// A streaming-replication standby of `primary`, built with `pg_basebackup`
    /// from the running primary (`--checkpoint=fast -X stream`) and started with
    /// `standby.signal` and a `primary_conninfo` whose `application_name` is
    /// `name` (the name `synchronous_standby_names` refers to). On `port` if
    /// given (a replacement node taking a dead node's address), else a free one.
    /// Returns once the standby answers read-only queries; whether it streams
    /// in sync is the primary's to say ([`replication_state`](Self::replication_state)).
    pub fn start_standby(primary: &PgServer, name: &str, port: Option<u16>) -> io::Result<PgServer> {
        let valid = !name.is_empty() && name.len() <= 63 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !valid {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("standby name {name:?} must match [A-Za-z0-9_]{{1,63}}")));
        }
        let began = Instant::now();
        let mut server = PgServer::prepare_dirs()?;
        let basebackup = server.bin_dir.join("pg_basebackup");
        let mut cmd = Command::new(&basebackup);
        cmd.arg("-D").arg(&server.data_dir).args(["-h", "127.0.0.1", "-p", &primary.port.to_string(), "-U", SUPERUSER]).args([
            "--checkpoint=fast",
            "-X",
            "stream",
            "--no-sync",
        ]);
        server.prepare(&mut cmd);
        let out = cmd.stdin(Stdio::null()).output().map_err(|e| annotate(e, &format!("running {}", basebackup.display())))?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "{} failed ({}):\n{}{}",
                basebackup.display(),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let conninfo = format!("host=127.0.0.1 port={} user={SUPERUSER} application_name={name}", primary.port);
        let auto_conf = server.data_dir.join("postgresql.auto.conf");
        let mut conf = fs::read_to_string(&auto_conf).unwrap_or_default();
        conf.push_str(&format!("primary_conninfo = '{conninfo}'\n"));
        fs::write(&auto_conf, conf)?;
        let signal = server.data_dir.join("standby.signal");
        fs::write(&signal, "")?;
        if let Some(acct) = &server.run_as {
            for p in [&auto_conf, &signal] {
                chown(p, Some(acct.uid), Some(acct.gid)).map_err(|e| annotate(e, &format!("chown {}", p.display())))?;
            }
        }
        match port {
            Some(port) => {
                server.port = port;
                match server.spawn_and_wait() {
                    Ok(()) => server.startup = began.elapsed(),
                    Err(SpawnError::PortTaken(e) | SpawnError::Other(e)) => return Err(e),
                }
            }
            None => server.start_on_free_port(began)?,
        }
        Ok(server)
    }

    /// The machine dies: `SIGKILL` to the postmaster and every process it
    /// started (backends, WAL sender, checkpointer, ...), nothing flushed, no
    /// goodbye to clients or standbys. Returns once all are gone and the port
    /// refuses connections. The data stays (crash recovery on a later
    /// `start_again`).
    pub fn kill9(&mut self) -> io::Result<()> {
        let Some(running) = self.running.take() else {
            return Ok(());
        };
        let pm = running.postmaster_pid;
        // Stopped first, so it forks nothing new while its children are listed.
        signal(&["-STOP", &pm.to_string()]);
        let mut victims = children_of(pm);
        victims.push(pm);
        let args: Vec<String> = std::iter::once("-KILL".to_owned()).chain(victims.iter().map(u32::to_string)).collect();
        signal(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let deadline = Instant::now() + STOP_TIMEOUT;
        while victims.iter().any(|&p| process_alive(p)) {
            if Instant::now() > deadline {
                return Err(io::Error::other(format!("processes {victims:?} survived SIGKILL")));
            }
            thread::sleep(Duration::from_millis(5));
        }
        self.stop_running(running, false)?;
        wait_port_closed(self.port, STOP_TIMEOUT).map_err(|e| self.with_log(e))
    }

    /// Sends `sig` (e.g. `"-STOP"`) to this primary's WAL sender(s): a stopped
    /// sender leaves its standby behind, as on a slow network. WAL written
    /// meanwhile stays on this server (a synchronous standby then holds up
    /// every commit; an asynchronous one lets them be acknowledged).
    pub fn signal_wal_senders(&self, sig: &str) -> io::Result<()> {
        let pm = self.postmaster_pid().ok_or_else(|| io::Error::other("the server is not running"))?;
        let senders: Vec<String> = children_of(pm)
            .into_iter()
            .filter(|p| fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| String::from_utf8_lossy(&c).contains("walsender")))
            .map(|p| p.to_string())
            .collect();
        if senders.is_empty() {
            return Err(io::Error::other("no WAL sender process (no standby connected?)"));
        }
        let mut args = vec![sig];
        args.extend(senders.iter().map(String::as_str));
        signal(&args);
        Ok(())
    }

    /// `pg_ctl promote -w`: the standby leaves recovery and takes writes.
    /// Returns once `pg_is_in_recovery()` is false.
    pub fn promote(&self) -> io::Result<()> {
        let pg_ctl = self.bin_dir.join("pg_ctl");
        let mut cmd = Command::new(&pg_ctl);
        cmd.arg("promote").arg("-D").arg(&self.data_dir).args(["-w", "-t", "60"]);
        self.prepare(&mut cmd);
        let out = cmd.stdin(Stdio::null()).output().map_err(|e| annotate(e, &format!("running {}", pg_ctl.display())))?;
        if !out.status.success() {
            return Err(self.with_log(io::Error::other(format!(
                "pg_ctl promote failed ({}):\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))));
        }
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let rows = self.simple_query("postgres", "SELECT pg_is_in_recovery()::text");
            if let Ok(rows) = &rows
                && rows.first().and_then(|r| r.first()).and_then(|v| v.as_deref()) == Some("false")
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(self.with_log(io::Error::other(format!("still in recovery after pg_ctl promote: {rows:?}"))));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// `ALTER SYSTEM SET name = 'value'` and a configuration reload, e.g.
    /// `synchronous_standby_names`. (Settings given on the server's command
    /// line by this harness cannot be changed this way.)
    pub fn set_and_reload(&self, name: &str, value: &str) -> io::Result<()> {
        let valid = !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !valid || value.contains('\'') {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("setting {name} = {value:?}")));
        }
        // Two round trips: ALTER SYSTEM refuses to run in a multi-statement
        // query (an implicit transaction block).
        self.simple_query("postgres", &format!("ALTER SYSTEM SET {name} = '{value}'"))?;
        self.simple_query("postgres", "SELECT pg_reload_conf()").map(drop)
    }

    /// `(state, sync_state)` of the standby called `name` as this server's
    /// `pg_stat_replication` shows it (e.g. `("streaming", "sync")`); `None`
    /// while it is not connected.
    pub fn replication_state(&self, name: &str) -> io::Result<Option<(String, String)>> {
        let rows = self.simple_query(
            "postgres",
            &format!("SELECT state, sync_state FROM pg_stat_replication WHERE application_name = '{}'", name.replace('\'', "")),
        )?;
        Ok(rows.into_iter().next().and_then(|r| match (r.first().cloned().flatten(), r.get(1).cloned().flatten()) {
            (Some(state), Some(sync)) => Some((state, sync)),
            _ => None,
        }))
    }

    /// Waits until the standby `name` streams with `sync_state` (`"sync"` or `"async"`).
    pub fn wait_for_standby(&self, name: &str, sync_state: &str, timeout: Duration) -> io::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let state = self.replication_state(name);
            if let Ok(Some((s, sync))) = &state
                && s == "streaming"
                && sync == sync_state
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(
                    self.with_log(io::Error::other(format!("standby {name} not streaming as {sync_state} within {timeout:?}: {state:?}")))
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// The last 60 lines of the server log (all starts of this cluster),
    /// without the refusals of this harness's own readiness probes (one every
    /// 20 ms while the server starts: a slow crash recovery would otherwise
    /// fill the tail with them).
    pub fn log_tail(&self) -> String {
        match fs::read(&self.log_path) {
            Ok(bytes) => {
                let text = String::from_utf8_lossy(&bytes);
                let kept: Vec<&str> = text.lines().filter(|l| !l.ends_with("FATAL:  the database system is starting up")).collect();
                tail_lines(&kept.join("\n"), 60)
            }
            Err(e) => format!("<cannot read {}: {e}>", self.log_path.display()),
        }
    }

    fn initdb(&self) -> io::Result<()> {
        let initdb = self.bin_dir.join("initdb");
        let mut cmd = Command::new(&initdb);
        cmd.arg("-D")
            .arg(&self.data_dir)
            .args(["-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--locale=C"])
            .args(["--no-sync", "--no-instructions"]);
        self.prepare(&mut cmd);
        let out = cmd.stdin(Stdio::null()).output().map_err(|e| annotate(e, &format!("running {}", initdb.display())))?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "{} failed ({}):\n{}{}",
                initdb.display(),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(())
    }

    /// Common settings of every child: unprivileged account, neutral cwd, no PG* env.
    fn prepare(&self, cmd: &mut Command) {
        cmd.current_dir(&self.base);
        for var in ["PGDATA", "PGPORT", "PGHOST", "PGUSER", "PGDATABASE", "PGOPTIONS"] {
            cmd.env_remove(var);
        }
        if let Some(acct) = &self.run_as {
            cmd.uid(acct.uid).gid(acct.gid);
            // A home of its own, as an installed server has: libpq inside
            // the server (Citus's connections between nodes, with TLS)
            // looks in ~/.postgresql, and root's home is closed to it.
            cmd.env("USER", &acct.name).env("LOGNAME", &acct.name).env("HOME", &self.base);
        }
    }

    /// Starts the postmaster under the watchdog and waits until it answers a query.
    fn spawn_and_wait(&mut self) -> Result<(), SpawnError> {
        let log_offset = fs::metadata(&self.log_path).map(|m| m.len()).unwrap_or(0);
        let postgres = self.bin_dir.join("postgres");
        let port = self.port.to_string();
        let socket_dir = self.socket_dir.to_string_lossy().into_owned();
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(WATCHDOG)
            .arg("idemgate-pg-watchdog")
            .arg(&self.log_path)
            .arg(&self.base)
            .arg(&postgres)
            .arg("-D")
            .arg(&self.data_dir);
        for setting in [
            "listen_addresses=127.0.0.1".to_string(),
            format!("port={port}"),
            format!("unix_socket_directories={socket_dir}"),
            "fsync=on".to_string(),
            "synchronous_commit=on".to_string(),
            "max_connections=200".to_string(),
            "shared_buffers=32MB".to_string(),
            "logging_collector=off".to_string(),
        ] {
            cmd.arg("-c").arg(setting);
        }
        for setting in &self.settings {
            cmd.arg("-c").arg(setting);
        }
        // Extra server settings (later ones win), e.g. the benchmark's
        // `shared_buffers=512MB max_wal_size=4GB`: whitespace-separated name=value.
        if let Ok(extra) = std::env::var("IDEMGATE_TEST_PG_SETTINGS") {
            for setting in extra.split_whitespace().filter(|s| s.contains('=')) {
                cmd.arg("-c").arg(setting);
            }
        }
        self.prepare(&mut cmd);
        // Own process group: a terminal's Ctrl-C reaches only the test process; the
        // watchdog then sees EOF and cleans up instead of dying half-way.
        cmd.process_group(0).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::null());
        let mut watchdog = cmd.spawn().map_err(|e| SpawnError::Other(annotate(e, "spawning the postgres watchdog (/bin/sh)")))?;
        let control = watchdog.stdin.take();
        let pid_line = watchdog.stdout.take().map(|out| {
            let mut line = String::new();
            let _ = BufReader::new(out).read_line(&mut line);
            line
        });
        let Some(postmaster_pid) = pid_line.and_then(|l| l.trim().parse::<u32>().ok()) else {
            drop(control);
            let _ = watchdog.wait();
            return Err(SpawnError::Other(io::Error::other("the postgres watchdog did not report a pid")));
        };
        let running = Running { watchdog, control, postmaster_pid };

        let deadline = Instant::now() + READY_TIMEOUT;
        let data_dir = self.data_dir.to_string_lossy().into_owned();
        let mut last_err;
        loop {
            if !process_alive(postmaster_pid) {
                let _ = self.stop_running(running, false);
                let new_log = log_since(&self.log_path, log_offset);
                let msg = format!("postgres exited during start-up on port {}; log:\n{}", self.port, tail_lines(&new_log, 40));
                return Err(if new_log.contains("Address already in use") {
                    SpawnError::PortTaken(io::Error::new(io::ErrorKind::AddrInUse, msg))
                } else {
                    SpawnError::Other(io::Error::other(msg))
                });
            }
            // A real query, and a check that the server answering is ours (not some
            // other process that grabbed the port).
            let probe = MiniConn::connect(self.port, "postgres", Duration::from_secs(2), Duration::from_secs(2))
                .and_then(|mut c| c.simple_query("SELECT current_setting('data_directory')"));
            match probe {
                Ok(rows) if rows.first().and_then(|r| r.first()).and_then(|v| v.as_deref()) == Some(data_dir.as_str()) => {
                    self.running = Some(running);
                    return Ok(());
                }
                Ok(rows) => last_err = format!("port {} answered with another data_directory: {rows:?}", self.port),
                Err(e) => last_err = e.to_string(),
            }
            if Instant::now() >= deadline {
                let _ = self.stop_running(running, false);
                return Err(SpawnError::Other(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "postgres on port {} did not accept queries within {:?} (last error: {last_err}); log:\n{}",
                        self.port,
                        READY_TIMEOUT,
                        tail_lines(&log_since(&self.log_path, log_offset), 40)
                    ),
                )));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Tells the watchdog to stop the postmaster (`stop` line, or EOF when `delete`)
    /// and waits, bounded, until the watchdog (and so the postmaster) has exited.
    fn stop_running(&self, mut running: Running, delete: bool) -> io::Result<()> {
        if let Some(mut control) = running.control.take() {
            if !delete {
                // If this fails the watchdog is gone already; EOF follows anyway.
                let _ = control.write_all(b"stop\n").and_then(|()| control.flush());
            }
            drop(control);
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            match running.watchdog.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(5)),
                Ok(None) => {
                    let _ = running.watchdog.kill();
                    let _ = running.watchdog.wait();
                    return Err(self.with_log(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("postmaster {} did not exit within {STOP_TIMEOUT:?}", running.postmaster_pid),
                    )));
                }
                Err(e) => return Err(e),
            }
        }
        // The watchdog waited for the postmaster; this is a cheap double check.
        if process_alive(running.postmaster_pid) {
            return Err(
                self.with_log(io::Error::other(format!("postmaster {} still alive after its watchdog exited", running.postmaster_pid)))
            );
        }
        Ok(())
    }

    fn with_log(&self, e: io::Error) -> io::Error {
        io::Error::new(e.kind(), format!("{e}; server log:\n{}", self.log_tail()))
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if let Some(running) = self.running.take() {
            // EOF: the watchdog stops the server and removes the directory itself.
            let _ = self.stop_running(running, true);
        }
        if let Some(tmp) = self.tmp.take() {
            let _ = tmp.close();
        }
    }
}

/// The cluster of this test binary, started on first use and stopped (by the
/// watchdog) when the process exits. Do not stop it; tests that need to stop or crash
/// a server start their own with [`PgServer::start`].
///
/// Panics if the cluster cannot be started (with the reason, in every test that asks).
pub fn shared() -> &'static PgServer {
    static SHARED: OnceLock<Result<PgServer, String>> = OnceLock::new();
    match SHARED.get_or_init(|| PgServer::start().map_err(|e| e.to_string())) {
        Ok(server) => server,
        Err(e) => panic!("could not start the shared test PostgreSQL: {e}"),
    }
}

/// Stops the postmasters of clusters whose owning test process is gone and removes
/// their directories. Returns how many directories were removed. Run automatically by
/// the first `PgServer::start` of each process.
pub fn sweep_stale_clusters() -> io::Result<usize> {
    sweep_stale_clusters_in(&cluster_parent_dir())
}

/// [`sweep_stale_clusters`] for cluster directories under `parent`.
pub fn sweep_stale_clusters_in(parent: &Path) -> io::Result<usize> {
    let mut removed = 0;
    for entry in fs::read_dir(parent)? {
        let Ok(entry) = entry else { continue };
        if !entry.file_name().to_string_lossy().starts_with(DIR_PREFIX) {
            continue;
        }
        let dir = entry.path();
        match fs::read_to_string(dir.join("owner")) {
            Ok(owner) => {
                let mut it = owner.split_whitespace().map(str::parse::<u64>);
                if let (Some(Ok(pid)), Some(Ok(start))) = (it.next(), it.next())
                    && process_start_time(pid as u32) == Some(start)
                {
                    continue; // owner alive
                }
            }
            Err(_) => {
                // Setup in progress elsewhere, or debris from a crash during setup.
                let age = entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| SystemTime::now().duration_since(t).ok())
                    .unwrap_or_default();
                if age < OWNERLESS_GRACE {
                    continue;
                }
            }
        }
        stop_stale_postmaster(&dir.join("data"));
        if fs::remove_dir_all(&dir).is_ok() {
            removed += 1;
        }
    }
    Ok(removed)
}

/// `kill <args>` through the shell (the server may run as another account; we are
/// then root).
fn signal(args: &[&str]) {
    let _ = Command::new("/bin/sh").arg("-c").arg("kill \"$@\"").arg("sh").args(args).stderr(Stdio::null()).status();
}

/// Pids whose parent is `pid` (field 2 after the command of `/proc/<p>/stat`).
fn children_of(pid: u32) -> Vec<u32> {
    let parent = pid.to_string();
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| proc_stat_fields(p).is_some_and(|f| f.get(1) == Some(&parent)))
        .collect()
}

/// SIGQUIT (then SIGKILL) to the postmaster recorded in `data/postmaster.pid`, if that
/// pid really is a postgres serving this data directory.
fn stop_stale_postmaster(data_dir: &Path) {
    let Ok(pidfile) = fs::read_to_string(data_dir.join("postmaster.pid")) else {
        return;
    };
    let Some(pid) = pidfile.lines().next().and_then(|l| l.trim().parse::<u32>().ok()) else {
        return;
    };
    let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
        return;
    };
    let cmdline = String::from_utf8_lossy(&cmdline);
    if !cmdline.contains("postgres") || !cmdline.contains(&*data_dir.to_string_lossy()) {
        return;
    }
    for signal in ["-QUIT", "-KILL"] {
        let _ = Command::new("/bin/sh").args(["-c", "kill \"$1\" \"$2\"", "sh", signal, &pid.to_string()]).stderr(Stdio::null()).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while process_alive(pid) && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(20));
        }
        if !process_alive(pid) {
            return;
        }
    }
}

/// The directory of the server's loadable modules (`pkglibdir`, where an
/// extension such as Citus installs its `.so`) for the binaries the harness uses.
pub fn pkglibdir() -> io::Result<PathBuf> {
    let bin = find_bin_dir()?;
    let out = Command::new(bin.join("pg_config")).arg("--pkglibdir").stdin(Stdio::null()).output();
    if let Ok(out) = out
        && out.status.success()
    {
        return Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    }
    bin.parent().map(|p| p.join("lib")).ok_or_else(|| io::Error::other(format!("no lib directory beside {}", bin.display())))
}

/// Where cluster directories go: `$IDEMGATE_TEST_PG_TMPDIR`, else the std temp dir.
/// Its ancestors must be traversable by the server account (e.g. `/tmp`).
fn cluster_parent_dir() -> PathBuf {
    std::env::var_os("IDEMGATE_TEST_PG_TMPDIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir)
}

/// Records who owns the cluster so a later sweep can tell live clusters from orphans.
fn write_owner_file(base: &Path) -> io::Result<()> {
    let pid = std::process::id();
    let start = process_start_time(pid).ok_or_else(|| io::Error::other("cannot read /proc/self/stat"))?;
    fs::write(base.join("owner"), format!("{pid} {start}\n"))
}

/// The directory with the server binaries a replicated cluster needs
/// (`postgres`, `initdb`, `pg_basebackup`, `pg_ctl`), or why there is none.
pub fn replication_binaries() -> io::Result<PathBuf> {
    let dir = find_bin_dir()?;
    for tool in ["pg_basebackup", "pg_ctl"] {
        if !dir.join(tool).is_file() {
            return Err(io::Error::new(io::ErrorKind::NotFound, format!("{} has no {tool}", dir.display())));
        }
    }
    Ok(dir)
}

/// `$IDEMGATE_TEST_PG_BINDIR`, else the directory of `postgres` on PATH (symlinks
/// resolved, must contain `initdb` too), else the newest `/usr/lib/postgresql/*/bin`.
fn find_bin_dir() -> io::Result<PathBuf> {
    let has_both = |d: &Path| d.join("postgres").is_file() && d.join("initdb").is_file();
    if let Some(dir) = std::env::var_os("IDEMGATE_TEST_PG_BINDIR") {
        let dir = PathBuf::from(dir);
        if has_both(&dir) {
            return Ok(dir);
        }
        return Err(io::Error::new(io::ErrorKind::NotFound, format!("IDEMGATE_TEST_PG_BINDIR={} has no postgres/initdb", dir.display())));
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join("postgres");
            if !candidate.is_file() {
                continue;
            }
            if let Some(real_dir) = fs::canonicalize(&candidate).ok().and_then(|p| p.parent().map(Path::to_path_buf))
                && has_both(&real_dir)
            {
                return Ok(real_dir);
            }
            if has_both(&dir) {
                return Ok(dir);
            }
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            has_both(&bin).then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "PostgreSQL server binaries (postgres, initdb) not found on PATH nor in \
             /usr/lib/postgresql/*/bin; run scripts/ensure-postgres",
        )
    })
}

/// `(uid, gid)` of the unprivileged account the servers run as when the
/// tests run as root (`None` otherwise): PgBouncer refuses root too.
pub fn server_ids() -> io::Result<Option<(u32, u32)>> {
    Ok(server_account()?.map(|a| (a.uid, a.gid)))
}

/// `None` when not root; otherwise the account the server must run as.
fn server_account() -> io::Result<Option<Account>> {
    if effective_uid()? != 0 {
        return Ok(None);
    }
    let passwd = fs::read_to_string("/etc/passwd")?;
    let lookup = |name: &str| -> Option<Account> {
        passwd.lines().find_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 4 || f[0] != name {
                return None;
            }
            Some(Account { name: name.to_string(), uid: f[2].parse().ok()?, gid: f[3].parse().ok()? })
        })
    };
    if let Ok(name) = std::env::var("IDEMGATE_TEST_PG_USER") {
        return match lookup(&name) {
            Some(acct) if acct.uid != 0 => Ok(Some(acct)),
            Some(_) => Err(io::Error::other(format!("IDEMGATE_TEST_PG_USER={name} is root"))),
            None => Err(io::Error::new(io::ErrorKind::NotFound, format!("IDEMGATE_TEST_PG_USER={name} is not in /etc/passwd"))),
        };
    }
    lookup("postgres")
        .or_else(|| lookup("nobody"))
        .map(Some)
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "running as root, but /etc/passwd has neither postgres nor nobody"))
}

fn effective_uid() -> io::Result<u32> {
    let status = fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|rest| rest.split_whitespace().nth(1)?.parse().ok())
        .ok_or_else(|| io::Error::other("no Uid line in /proc/self/status"))
}

/// Fields of `/proc/<pid>/stat` after the `(comm)` field: index 0 is the state.
fn proc_stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    Some(after.split_whitespace().map(str::to_string).collect())
}

/// Alive = exists and is not a zombie (the postmaster is the watchdog's child, so it
/// stays a zombie until the watchdog reaps it).
fn process_alive(pid: u32) -> bool {
    proc_stat_fields(pid).is_some_and(|f| f.first().is_some_and(|s| s != "Z" && s != "X"))
}

/// Start time in clock ticks since boot (field 22); with the pid it names a process
/// uniquely, guarding against pid reuse.
fn process_start_time(pid: u32) -> Option<u64> {
    let fields = proc_stat_fields(pid)?;
    if fields.first().is_some_and(|s| s == "Z") {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// Bind 127.0.0.1:0, read the port, release it. Racy by nature; start() retries.
fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port())
}

fn wait_port_closed(port: u16, timeout: Duration) -> io::Result<()> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let deadline = Instant::now() + timeout;
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => return Ok(()),
            _ if Instant::now() >= deadline => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("port {port} still accepts connections {timeout:?} after the stop"),
                ));
            }
            _ => thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn annotate(e: io::Error, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn log_since(path: &Path, offset: u64) -> String {
    let bytes = fs::read(path).unwrap_or_default();
    let start = (offset as usize).min(bytes.len());
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

fn tail_of(path: &Path, lines: usize) -> String {
    match fs::read(path) {
        Ok(bytes) => tail_lines(&String::from_utf8_lossy(&bytes), lines),
        Err(e) => format!("<cannot read {}: {e}>", path.display()),
    }
}

fn tail_lines(text: &str, n: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(n)..].join("\n")
}

/// Just enough of the PostgreSQL v3 wire protocol for trust auth and simple queries:
/// readiness probes and `CREATE DATABASE` without a driver or an async runtime.
struct MiniConn {
    stream: TcpStream,
}

impl MiniConn {
    /// `io_timeout` bounds every read and write (a query may take that long).
    fn connect(port: u16, db: &str, connect_timeout: Duration, io_timeout: Duration) -> io::Result<MiniConn> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let stream = TcpStream::connect_timeout(&addr, connect_timeout)?;
        stream.set_read_timeout(Some(io_timeout))?;
        stream.set_write_timeout(Some(io_timeout))?;
        stream.set_nodelay(true)?;
        let mut conn = MiniConn { stream };

        let mut body = Vec::new();
        body.extend_from_slice(&196_608i32.to_be_bytes()); // protocol 3.0
        for (k, v) in [("user", SUPERUSER), ("database", db)] {
            body.extend_from_slice(k.as_bytes());
            body.push(0);
            body.extend_from_slice(v.as_bytes());
            body.push(0);
        }
        body.push(0);
        let mut msg = ((body.len() + 4) as i32).to_be_bytes().to_vec();
        msg.extend_from_slice(&body);
        conn.stream.write_all(&msg)?;

        loop {
            let (tag, body) = conn.read_message()?;
            match tag {
                b'R' => {
                    let code = body.get(..4).map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]));
                    if code != Some(0) {
                        return Err(io::Error::other(format!(
                            "server asked for authentication (code {code:?}); the test cluster should use trust"
                        )));
                    }
                }
                b'E' => return Err(server_error(&body)),
                b'Z' => return Ok(conn),
                _ => {} // ParameterStatus, BackendKeyData, NoticeResponse
            }
        }
    }

    fn simple_query(&mut self, sql: &str) -> io::Result<Vec<Vec<Option<String>>>> {
        if sql.contains('\0') {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "SQL contains NUL"));
        }
        let mut msg = vec![b'Q'];
        msg.extend_from_slice(&((sql.len() + 5) as i32).to_be_bytes());
        msg.extend_from_slice(sql.as_bytes());
        msg.push(0);
        self.stream.write_all(&msg)?;

        let mut rows = Vec::new();
        let mut error = None;
        loop {
            let (tag, body) = self.read_message()?;
            match tag {
                b'T' => rows.clear(), // a new result set starts; keep the last one
                b'D' => rows.push(parse_data_row(&body)?),
                b'E' => error = Some(server_error(&body)),
                b'Z' => return error.map_or(Ok(rows), Err),
                _ => {} // CommandComplete, EmptyQueryResponse, NoticeResponse, ...
            }
        }
    }

    fn read_message(&mut self) -> io::Result<(u8, Vec<u8>)> {
        let mut header = [0u8; 5];
        self.stream.read_exact(&mut header)?;
        let len = i32::from_be_bytes([header[1], header[2], header[3], header[4]]);
        if !(4..=(1 << 28)).contains(&len) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad message length {len}")));
        }
        let mut body = vec![0u8; len as usize - 4];
        self.stream.read_exact(&mut body)?;
        Ok((header[0], body))
    }
}

impl Drop for MiniConn {
    fn drop(&mut self) {
        let _ = self.stream.write_all(&[b'X', 0, 0, 0, 4]); // Terminate
    }
}

fn parse_data_row(body: &[u8]) -> io::Result<Vec<Option<String>>> {
    let bad = || io::Error::new(io::ErrorKind::InvalidData, "malformed DataRow");
    let count = i16::from_be_bytes(body.get(..2).ok_or_else(bad)?.try_into().map_err(|_| bad())?);
    let mut pos = 2;
    let mut row = Vec::with_capacity(count.max(0) as usize);
    for _ in 0..count {
        let len = i32::from_be_bytes(body.get(pos..pos + 4).ok_or_else(bad)?.try_into().map_err(|_| bad())?);
        pos += 4;
        if len < 0 {
            row.push(None);
        } else {
            let value = body.get(pos..pos + len as usize).ok_or_else(bad)?;
            row.push(Some(String::from_utf8_lossy(value).into_owned()));
            pos += len as usize;
        }
    }
    Ok(row)
}

/// ErrorResponse → "SEVERITY SQLSTATE: message".
fn server_error(body: &[u8]) -> io::Error {
    let (mut severity, mut code, mut message) = (String::new(), String::new(), String::new());
    for field in body.split(|&b| b == 0) {
        let Some((&kind, value)) = field.split_first() else {
            continue;
        };
        let value = String::from_utf8_lossy(value).into_owned();
        match kind {
            b'S' => severity = value,
            b'C' => code = value,
            b'M' => message = value,
            _ => {}
        }
    }
    io::Error::other(format!("{severity} {code}: {message}"))
}
