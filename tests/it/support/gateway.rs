//! The real `idemgate` binary as a child process: start, kill -9, SIGSTOP,
//! SIGCONT, SIGTERM, restart on the same port; plus the config it runs with.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use idemgate::config::{Config, StoreBackend, StoreConfig};
use idemgate::store::Store;
use sha2::{Digest, Sha256};

/// The API key every test client presents (`Bearer test-key`).
pub const API_KEY: &str = "test-key";
pub const TENANT: &str = "acme";
pub const PRINCIPAL: &str = "billing";
/// The derived-key secret test gateways are configured with (through this
/// environment variable), so tests can compute the key the upstream sees.
pub const TEST_SECRET: &str = "test-derived-key-secret";
pub const TEST_SECRET_ENV: &str = "IDEMGATE_TEST_DERIVED_KEY_SECRET";

/// Which store a gateway runs on.
#[derive(Debug, Clone)]
pub enum Backend {
    Postgres {
        url: String,
    },
    /// A database on a Citus coordinator (`support::citus`).
    Citus {
        url: String,
    },
    /// PostgreSQL behind a connection pooler (`support::pgbouncer`): the
    /// store reaches it through `url`, with `store.pooler = pooler`; the
    /// tests' own SQL goes to the server directly (`direct`).
    Pooled {
        url: String,
        direct: String,
        pooler: &'static str,
    },
    Sqlite {
        path: PathBuf,
        /// Deleted when the last clone of the backend is dropped.
        dir: Option<std::sync::Arc<tempfile::TempDir>>,
    },
}

impl Backend {
    pub fn store_toml(&self, sweep_interval: &str) -> String {
        self.store_toml_with(sweep_interval, "2s")
    }

    /// [`Backend::store_toml`] with another `operation_timeout`.
    pub fn store_toml_with(&self, sweep_interval: &str, operation_timeout: &str) -> String {
        match self {
            Backend::Postgres { url } => format!(
                "[store]\nkind = \"postgres\"\nurl = \"{url}\"\npool_size = 8\noperation_timeout = \"{operation_timeout}\"\nsweep_interval = \"{sweep_interval}\"\n"
            ),
            Backend::Citus { url } => format!(
                "[store]\nkind = \"citus\"\nurl = \"{url}\"\npool_size = 8\noperation_timeout = \"{operation_timeout}\"\nsweep_interval = \"{sweep_interval}\"\n"
            ),
            Backend::Pooled { url, pooler, .. } => format!(
                "[store]\nkind = \"postgres\"\nurl = \"{url}\"\npooler = \"{pooler}\"\npool_size = 8\noperation_timeout = \"{operation_timeout}\"\nsweep_interval = \"{sweep_interval}\"\n"
            ),
            Backend::Sqlite { path, .. } => format!(
                "[store]\nkind = \"sqlite\"\npath = \"{}\"\noperation_timeout = \"{operation_timeout}\"\nsweep_interval = \"{sweep_interval}\"\n",
                path.display()
            ),
        }
    }

    /// Opens the same store from the test process, to inspect records.
    /// (A test that builds a backend of its own opens it with
    /// [`store_config`].)
    pub async fn open(&self) -> Store {
        let backend = match self {
            Backend::Postgres { url } => {
                StoreBackend::Postgres { url: idemgate::config::Secret::new(url.clone()), pool_size: 4, pooler: Default::default() }
            }
            Backend::Citus { url } => {
                StoreBackend::Citus { url: idemgate::config::Secret::new(url.clone()), pool_size: 4, pooler: Default::default() }
            }
            Backend::Pooled { url, pooler, .. } => {
                StoreBackend::Postgres { url: idemgate::config::Secret::new(url.clone()), pool_size: 4, pooler: pooler_named(pooler) }
            }
            Backend::Sqlite { path, .. } => StoreBackend::Sqlite { path: path.clone() },
        };
        let store = Store::open(&store_config(backend), idemgate::store::Access::Migrate).await.expect("open store for inspection");
        store.migrate().await.expect("migrate");
        store
    }
}

/// `store.pooler` from its name (`"none"`, `"session"`, `"transaction"`).
pub fn pooler_named(name: &str) -> idemgate::config::Pooler {
    match name {
        "transaction" => idemgate::config::Pooler::Transaction,
        "session" => idemgate::config::Pooler::Session,
        _ => idemgate::config::Pooler::None,
    }
}

/// Builds a gateway config around one upstream and an `orders` route.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    pub backend: Backend,
    pub upstream_url: String,
    pub upstream_timeout: &'static str,
    /// Extra lines inside the `create_order` route table.
    pub route_extra: String,
    /// Extra TOML appended at the end (more routes, ...).
    pub tail: String,
    /// Extra lines in `[server]`.
    pub server_extra: String,
    /// Extra lines in `[admin]` (`token_file = ...`).
    pub admin_extra: String,
    pub listen: SocketAddr,
    /// Sweeper and lease reaper cadence (fast in tests).
    pub sweep_interval: &'static str,
    pub operation_timeout: &'static str,
    /// Replaces the generated `[store]` section (an empty string: no section).
    pub store_section: Option<String>,
    /// The process's working directory (default: the test's).
    pub workdir: Option<PathBuf>,
    /// Configure `TEST_SECRET` as the derived-key secret (default); false: the
    /// gateway uses the one `migrate` generated in the store.
    pub configured_secret: bool,
    /// Replaces the default identity sources (an API key and trusted headers).
    pub identity: Option<String>,
    /// Extra lines in the `orders` upstream (`ca_file = ...`).
    pub upstream_extra: String,
}

impl GatewayConfig {
    pub fn new(backend: Backend, upstream_url: String) -> GatewayConfig {
        GatewayConfig {
            backend,
            upstream_url,
            upstream_timeout: "2s",
            route_extra: String::new(),
            tail: String::new(),
            server_extra: String::new(),
            admin_extra: String::new(),
            listen: "127.0.0.1:0".parse().unwrap(),
            sweep_interval: "200ms",
            operation_timeout: "2s",
            store_section: None,
            workdir: None,
            configured_secret: true,
            identity: None,
            upstream_extra: String::new(),
        }
    }

    /// Replaces the `[[identity.sources]]` entries.
    pub fn identity(mut self, sources: &str) -> Self {
        self.identity = Some(sources.to_owned());
        self
    }

    /// Leaves `server.derived_key_secret_*` out: the store's generated secret applies.
    pub fn generated_secret(mut self) -> Self {
        self.configured_secret = false;
        self
    }

    pub fn route(mut self, extra: &str) -> Self {
        self.route_extra.push_str(extra);
        self.route_extra.push('\n');
        self
    }

    pub fn upstream(mut self, extra: &str) -> Self {
        self.upstream_extra.push_str(extra);
        self.upstream_extra.push('\n');
        self
    }

    pub fn server(mut self, extra: &str) -> Self {
        self.server_extra.push_str(extra);
        self.server_extra.push('\n');
        self
    }

    pub fn admin(mut self, extra: &str) -> Self {
        self.admin_extra.push_str(extra);
        self.admin_extra.push('\n');
        self
    }

    pub fn tail(mut self, extra: &str) -> Self {
        self.tail.push_str(extra);
        self.tail.push('\n');
        self
    }

    pub fn sweep_interval(mut self, every: &'static str) -> Self {
        self.sweep_interval = every;
        self
    }

    /// The store's `operation_timeout` (the tests' default is 2 s).
    pub fn operation_timeout(mut self, t: &'static str) -> Self {
        self.operation_timeout = t;
        self
    }

    pub fn timeout(mut self, t: &'static str) -> Self {
        self.upstream_timeout = t;
        self
    }

    pub fn toml(&self) -> String {
        let key_hash = hex::encode(Sha256::digest(API_KEY.as_bytes()));
        format!(
            r#"[server]
listen = "{listen}"
shutdown_grace = "10s"
{secret}
{server_extra}
{store}
[admin]
listen = "127.0.0.1:0"
{admin_extra}

[[upstreams]]
name = "orders"
url = "{upstream}"
connect_timeout = "{connect_timeout}"
timeout = "{timeout}"
{upstream_extra}

{identity}

[[routes]]
operation = "create_order"
method = "POST"
path = "/v1/orders"
upstream = "orders"
{route_extra}
{tail}
"#,
            listen = self.listen,
            secret = if self.configured_secret { format!("derived_key_secret_env = \"{TEST_SECRET_ENV}\"") } else { String::new() },
            server_extra = self.server_extra,
            admin_extra = self.admin_extra,
            store = self.store_section.clone().unwrap_or_else(|| self.backend.store_toml_with(self.sweep_interval, self.operation_timeout)),
            upstream = self.upstream_url,
            timeout = self.upstream_timeout,
            identity = self.identity.clone().unwrap_or_else(|| format!(
                "[[identity.sources]]\nkind = \"api_key\"\nkeys = [ {{ sha256 = \"{key_hash}\", tenant = \"{TENANT}\", principal = \"{PRINCIPAL}\" }},\n         {{ sha256 = \"{}\", tenant = \"{TENANT}\", principal = \"other\" }} ]\n\n[[identity.sources]]\nkind = \"trusted_header\"\ntenant_header = \"x-tenant-id\"\nprincipal_header = \"x-principal-id\"\ntrusted_peers = [\"127.0.0.1/32\"]\n",
                hex::encode(Sha256::digest(b"other-key"))
            )),
            // Shorter than the timeout, as configuration requires.
            connect_timeout = humantime::format_duration(
                humantime::parse_duration(self.upstream_timeout).expect("upstream timeout").div_f64(2.0).min(Duration::from_millis(500))
            ),
            route_extra = self.route_extra,
            upstream_extra = self.upstream_extra,
            tail = self.tail,
        )
    }

    /// The validated config (for tests that use the library directly).
    pub fn parsed(&self) -> Config {
        Config::from_toml(&self.toml(), "test", &|name| (name == TEST_SECRET_ENV).then(|| TEST_SECRET.to_owned()))
            .expect("test config is valid")
    }
}

#[derive(Default)]
struct Logs {
    lines: Vec<String>,
    listening: Option<(SocketAddr, Option<SocketAddr>)>,
    exited: bool,
}

/// A running gateway process.
pub struct Gateway {
    pub config: GatewayConfig,
    pub addr: SocketAddr,
    pub admin: Option<SocketAddr>,
    child: Option<Child>,
    dir: tempfile::TempDir,
    logs: Arc<(Mutex<Logs>, Condvar)>,
    /// Log lines of earlier processes (before restarts).
    history: Vec<String>,
}

impl Gateway {
    pub fn start(config: GatewayConfig) -> Gateway {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut g = Gateway {
            config,
            addr: "0.0.0.0:0".parse().unwrap(),
            admin: None,
            child: None,
            dir,
            logs: Arc::default(),
            history: Vec::new(),
        };
        g.spawn();
        g
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("idemgate.toml")
    }

    fn spawn(&mut self) {
        std::fs::write(self.config_path(), self.config.toml()).expect("write config");
        // A fresh log buffer per process: the previous process's reader thread
        // may still be draining its pipe and must not touch this one.
        let previous = std::mem::take(&mut self.logs.0.lock().unwrap_or_else(|p| p.into_inner()).lines);
        self.history.extend(previous);
        self.logs = Arc::default();
        let mut command = Command::new(env!("CARGO_BIN_EXE_idemgate"));
        if let Some(dir) = &self.config.workdir {
            command.current_dir(dir);
        }
        let mut child = command
            .args(["serve", "--config"])
            .arg(self.config_path())
            .env("IDEMGATE_LOG_FORMAT", "json")
            .env(TEST_SECRET_ENV, TEST_SECRET)
            .env("IDEMGATE_LOG", "info,idemgate=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn idemgate");
        let stderr = child.stderr.take().expect("stderr");
        let logs = self.logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let (lock, cv) = &*logs;
                let mut l = lock.lock().unwrap();
                if l.listening.is_none()
                    && let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
                    && v["message"] == "listening"
                {
                    let addr = v["addr"].as_str().and_then(|a| a.parse().ok());
                    let admin = v["admin"].as_str().and_then(|a| a.parse().ok());
                    if let Some(addr) = addr {
                        l.listening = Some((addr, admin));
                    }
                }
                l.lines.push(line);
                cv.notify_all();
            }
            let (lock, cv) = &*logs;
            lock.lock().unwrap().exited = true;
            cv.notify_all();
        });
        self.child = Some(child);
        let (lock, cv) = &*self.logs;
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut l = lock.lock().unwrap();
        loop {
            if let Some((addr, admin)) = l.listening {
                self.addr = addr;
                self.admin = admin;
                // Restarts reuse the same port, so clients keep their URL.
                self.config.listen = addr;
                return;
            }
            if l.exited || Instant::now() > deadline {
                panic!("gateway did not start:\n{}", l.lines.join("\n"));
            }
            l = cv.wait_timeout(l, Duration::from_millis(100)).unwrap().0;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin.expect("admin listener"), path)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill").arg(format!("-{sig}")).arg(self.pid().to_string()).status().expect("kill").success();
        assert!(ok, "kill -{sig} failed");
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the process to exit by itself (after SIGTERM).
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let mut c = self.child.take().expect("running");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = c.try_wait().expect("try_wait") {
                return s;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                panic!("gateway did not exit within {timeout:?}:\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts again with the same config and port (after kill9 or exit).
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// Rewrites the config file with `config` (restarts use it too), sends
    /// SIGHUP and waits (blocking) until the process logs `configuration
    /// reloaded`. Err with the logs if it refused the file or said nothing
    /// within `timeout`.
    pub fn reload(&mut self, config: GatewayConfig, timeout: Duration) -> Result<(), String> {
        let (applied, refused) = (self.log_count("configuration reloaded"), self.log_count("reload refused"));
        self.config = config;
        std::fs::write(self.config_path(), self.config.toml()).map_err(|e| format!("write config: {e}"))?;
        self.signal("HUP");
        let deadline = Instant::now() + timeout;
        loop {
            if self.log_count("configuration reloaded") > applied {
                return Ok(());
            }
            if self.log_count("reload refused") > refused || Instant::now() > deadline {
                return Err(self.logs());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn logs(&self) -> String {
        let current = self.logs.0.lock().unwrap_or_else(|p| p.into_inner()).lines.clone();
        self.history.iter().chain(current.iter()).cloned().collect::<Vec<_>>().join("\n")
    }

    /// Log lines whose message contains `needle`.
    pub fn log_count(&self, needle: &str) -> usize {
        let current = self.logs.0.lock().unwrap_or_else(|p| p.into_inner()).lines.clone();
        self.history.iter().chain(current.iter()).filter(|l| l.contains(needle)).count()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(c) = &self.child {
            // A stopped process ignores SIGKILL until continued on some kernels' views; continue first.
            let _ = Command::new("kill").arg("-CONT").arg(c.id().to_string()).status();
        }
        self.kill9();
    }
}

/// The proxy address in a JSON `listening` log line.
pub fn listening_addr(line: &str) -> Option<SocketAddr> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    if v["message"] != "listening" {
        return None;
    }
    v["addr"].as_str()?.parse().ok()
}

/// A loopback address with a port that was free a moment ago, for a gateway
/// whose logs the test cannot read to learn its port.
pub fn free_local_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local addr")
}

/// `idemgate serve` with the stderr the test provides (a pipe it reads and
/// closes, or one already closed): the harness reads none of its logs.
pub struct ServeProcess {
    child: Option<Child>,
    /// Holds the config file.
    _dir: tempfile::TempDir,
}

impl ServeProcess {
    /// Starts the binary on `config` with the harness's log settings, then
    /// `env` on top of them.
    pub fn spawn(config: &GatewayConfig, stderr: Stdio, env: &[(&str, &str)]) -> ServeProcess {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("idemgate.toml");
        std::fs::write(&path, config.toml()).expect("write config");
        let child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args(["serve", "--config"])
            .arg(&path)
            .env("IDEMGATE_LOG_FORMAT", "json")
            .env("IDEMGATE_LOG", "info,idemgate=debug")
            .env(TEST_SECRET_ENV, TEST_SECRET)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn idemgate");
        ServeProcess { child: Some(child), _dir: dir }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill").arg(format!("-{sig}")).arg(self.pid().to_string()).status().expect("kill").success();
        assert!(ok, "kill -{sig} failed");
    }

    /// The exit status if the process has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().expect("running").try_wait().expect("try_wait")
    }

    /// Waits for the process to exit by itself (after SIGTERM).
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let mut c = self.child.take().expect("running");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = c.try_wait().expect("try_wait") {
                return s;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                panic!("gateway did not exit within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A store configuration as tests open one from their own process: `backend`,
/// migrated on open, a 5 s operation timeout, a fast sweeper.
pub fn store_config(backend: StoreBackend) -> StoreConfig {
    StoreConfig {
        backend,
        migrate: true,
        unreachable_at_start: Default::default(),
        operation_timeout: Duration::from_secs(5),
        sweep_interval: Duration::from_secs(1),
        sweep_batch: 100,
        events_retention: Duration::from_secs(3600),
    }
}
