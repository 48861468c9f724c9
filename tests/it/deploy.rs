//! What the repository ships for deployment, checked as far as this machine
//! can (it has no container engine, so images are not built here): the
//! image's baked config and the compose replicas' config pass `check-config`
//! with the environment compose gives them; compose, the Prometheus rules and
//! the Grafana dashboard parse and hang together; the Dockerfile keeps the
//! properties the docs promise. (`tests/it/operating.rs` checks that every
//! metric the rules and the dashboard query exists.)
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// A YAML file as JSON, with merge keys (`<<: *anchor`) applied as compose does.
fn yaml(path: &str) -> serde_json::Value {
    let mut v: serde_yaml_ng::Value = serde_yaml_ng::from_str(&read(path)).unwrap_or_else(|e| panic!("{path} is not valid YAML: {e}"));
    v.apply_merge().unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::to_value(&v).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `idemgate check-config` on `config` with only `env` set; exit code and output.
fn check_config(config: &Path, env: &[(String, String)]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["check-config", "--config"])
        .arg(config)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .current_dir(std::env::temp_dir())
        .output()
        .expect("run idemgate");
    (out.status.code().unwrap_or(-1), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn the_images_baked_config_is_valid_and_listens_on_every_interface() {
    // The operator's key hash comes from the environment (no default: see
    // tests/it/hardening.rs for the refusal without it).
    let hash = "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8";
    let env = [("IDEMGATE_API_KEY_SHA256".to_owned(), hash.to_owned())];
    let (code, out) = check_config(&root().join("config/docker.toml"), &env);
    assert_eq!(code, 0, "{out}");
    let text = read("config/docker.toml");
    let config = idemgate::config::Config::from_toml(&text, "config/docker.toml", &|name| {
        (name == "IDEMGATE_API_KEY_SHA256").then(|| hash.to_owned())
    })
    .unwrap();
    assert!(config.server.listen.ip().is_unspecified(), "-p 8080:8080 must reach the proxy");
    assert!(
        config.admin.as_ref().is_some_and(|a| a.listen.ip().is_loopback()),
        "unauthenticated /metrics answers inside the container only (HEALTHCHECK asks it there)"
    );
    assert!(!config.server.drain_delay.is_zero(), "load balancers get a drain delay");
    assert!(config.warnings.is_empty(), "{:?}", config.warnings);
}

#[test]
fn the_dockerfile_bakes_that_config_runs_as_a_numeric_user_and_checks_health() {
    let dockerfile = read("Dockerfile");
    assert!(dockerfile.contains("COPY config/docker.toml /etc/idemgate/idemgate.toml"), "{dockerfile}");
    assert!(dockerfile.contains("ENV IDEMGATE_CONFIG=/etc/idemgate/idemgate.toml"));
    let user = dockerfile.lines().filter_map(|l| l.strip_prefix("USER ")).next_back().expect("a USER line");
    assert!(user.trim().parse::<u32>().is_ok_and(|uid| uid != 0), "numeric, non-root USER: {user}");
    let health = dockerfile.lines().find(|l| l.starts_with("HEALTHCHECK")).expect("a HEALTHCHECK");
    assert!(health.contains(r#""/usr/local/bin/idemgate", "healthcheck""#), "{health}");
    assert!(!dockerfile.lines().filter(|l| !l.trim_start().starts_with('#')).any(|l| l.contains("curl")), "no curl in the image");
    // The build stage has every file cargo needs to read the manifest.
    assert!(dockerfile.contains("benches/gateway/main.rs"), "Cargo.toml names a bench target; the build stage must provide it");
}

#[test]
fn compose_runs_postgres_two_replicas_and_the_demo_upstream_with_valid_configs() {
    let compose = yaml("deploy/compose.yaml");
    let services = compose["services"].as_object().expect("services");
    for name in ["postgres", "orders", "idemgate-1", "idemgate-2"] {
        assert!(services.contains_key(name), "service {name} missing: {:?}", services.keys());
    }
    assert_eq!(services["orders"]["command"][0], "demo");
    assert!(services["orders"]["command"].as_array().unwrap().iter().any(|a| a == "--upstream-only"));

    let mut ports = Vec::new();
    for name in ["idemgate-1", "idemgate-2"] {
        let svc = &services[name];
        assert_eq!(svc["command"][0], "serve", "{name}");
        // The config file compose mounts, read with the environment compose sets.
        let volume = svc["volumes"][0].as_str().expect("a config volume");
        let (host, rest) = volume.split_once(':').unwrap();
        assert!(rest.starts_with("/etc/idemgate/idemgate.toml"), "{volume}");
        let config = root().join("deploy").join(host);
        let env: Vec<(String, String)> = svc["environment"]
            .as_object()
            .expect("environment as a map")
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
            .collect();
        assert!(env.iter().any(|(k, v)| k == "IDEMGATE_CONFIG" && v == "/etc/idemgate/idemgate.toml"));
        let (code, out) = check_config(&config, &env);
        assert_eq!(code, 0, "{name}: {out}");
        let (code, out) = check_config(&config, &[]);
        assert_eq!(code, 1, "without compose's environment the database URL is missing: {out}");
        assert!(out.contains("IDEMGATE_DATABASE_URL"), "{out}");
        ports.extend(svc["ports"].as_array().unwrap().iter().map(|p| p.as_str().unwrap().to_owned()));
        assert!(svc["depends_on"]["postgres"]["condition"] == "service_healthy", "{name} waits for the database");
    }
    let unique: std::collections::HashSet<_> = ports.iter().map(|p| p.split(':').next().unwrap()).collect();
    assert_eq!(unique.len(), ports.len(), "host ports are distinct: {ports:?}");
    // The replicas' upstream is the compose service.
    let config = idemgate::config::Config::from_toml(&read("deploy/idemgate.toml"), "deploy/idemgate.toml", &|name| {
        (name == "IDEMGATE_DATABASE_URL").then(|| "postgres://u:p@postgres:5432/db".to_owned())
    })
    .unwrap();
    assert_eq!(config.upstreams[0].url.host(), Some("orders"));
    assert!(config.server.listen.ip().is_unspecified() && config.admin.is_some());
}

#[test]
fn prometheus_rules_parse_and_cover_what_operators_alert_on() {
    let rules = yaml("deploy/prometheus/alerts.yaml");
    let rules: Vec<&serde_json::Value> =
        rules["groups"].as_array().expect("groups").iter().flat_map(|g| g["rules"].as_array().expect("rules")).collect();
    let mut names = Vec::new();
    for rule in &rules {
        let name = rule["alert"].as_str().expect("every rule is an alert with a name");
        let expr = rule["expr"].as_str().unwrap_or_else(|| panic!("{name}: expr"));
        assert!(!expr.trim().is_empty(), "{name}");
        assert!(["critical", "warning", "info"].contains(&rule["labels"]["severity"].as_str().unwrap_or_default()), "{name}: severity");
        assert!(rule["annotations"]["summary"].is_string(), "{name}: summary");
        if let Some(d) = rule["for"].as_str() {
            assert!(humantime::parse_duration(d).is_ok(), "{name}: for = {d}");
        }
        assert_eq!(expr.matches('(').count(), expr.matches(')').count(), "{name}: unbalanced parentheses in {expr}");
        names.push((name, expr));
    }
    let has = |metric: &str, also: &str| names.iter().any(|(_, e)| e.contains(metric) && e.contains(also));
    assert!(has("idemgate_records", "unknown"), "unknown backlog");
    assert!(has("idemgate_oldest_record_age_seconds", "unknown"), "old unknown records");
    assert!(has("idemgate_requests_total", "store_unavailable") && has("idemgate_store_errors_total", ""), "store unavailable");
    assert!(has("idemgate_fenced_writes_total", ""), "fenced writes");
    assert!(has("idemgate_draining", ""), "drain stuck");
    assert!(has("idemgate_oldest_record_age_seconds", "queued"), "async queue age");
    // What the docs tell operators to alert on.
    assert!(has("idemgate_config_reloads_total", "refused"), "refused reloads (operations.md, Reloading)");
    assert!(has("idemgate_tls_certificate_expiry_timestamp_seconds", "time()"), "certificate expiry (tls.md)");
    assert!(has("idemgate_events_parked", ""), "parked events (events.md)");

    let prometheus = yaml("deploy/prometheus/prometheus.yml");
    assert_eq!(prometheus["rule_files"][0], "/etc/prometheus/alerts.yaml");
}

#[test]
fn the_grafana_dashboard_parses_and_every_panel_queries() {
    let dash: serde_json::Value = serde_json::from_str(&read("deploy/grafana/dashboards/idemgate.json")).expect("dashboard JSON");
    assert_eq!(dash["uid"], "idemgate");
    let panels = dash["panels"].as_array().expect("panels");
    let queries: Vec<&serde_json::Value> = panels.iter().filter(|p| p["type"] != "row").collect();
    assert!(queries.len() >= 10, "{}", queries.len());
    for p in queries {
        let targets = p["targets"].as_array().unwrap_or_else(|| panic!("{}: targets", p["title"]));
        assert!(
            targets.iter().all(|t| t["expr"].as_str().is_some_and(|e| e.contains("idemgate_") || e.contains("process_"))),
            "{}",
            p["title"]
        );
    }
    // Grafana provisioning points at the dashboard directory compose mounts.
    let provider = yaml("deploy/grafana/provisioning/dashboards/idemgate.yaml");
    assert_eq!(provider["providers"][0]["options"]["path"], "/var/lib/grafana/dashboards");
}

#[test]
fn the_systemd_unit_drains_and_reloads_on_sighup() {
    let unit = read("deploy/systemd/idemgate.service");
    assert!(unit.contains("ExecStart=/usr/local/bin/idemgate serve --config /etc/idemgate/idemgate.toml"));
    assert!(unit.contains("KillSignal=SIGTERM"));
    assert!(unit.lines().any(|l| l == "ExecReload=/bin/kill -HUP $MAINPID"), "systemctl reload sends SIGHUP, which serve reloads on");
    let timeout: u64 = unit.lines().find_map(|l| l.strip_prefix("TimeoutStopSec=")).and_then(|v| v.parse().ok()).expect("TimeoutStopSec");
    assert!(timeout > 35, "longer than the default drain delay and grace");
}

// ---------------------------------------------------------------------------
// Issue 31: every file under deploy/ is exercised as far as this machine
// allows, not only parsed. The tools these tests drive (systemd-analyze,
// setpriv, promtool, prometheus, curl, psql) are installed by scripts/test
// when missing; a test that cannot find one fails and says so.

use crate::support;

use std::collections::{BTreeMap, HashMap};
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::{PermissionsExt as _, chown};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_idemgate");

/// The path of `tool` on the PATH; panics naming the package that provides it.
fn tool(name: &str, package: &str) -> PathBuf {
    let out = Command::new("sh").arg("-c").arg(format!("command -v {name}")).output().expect("run sh");
    let path = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(
        out.status.success() && !path.is_empty(),
        "`{name}` is not installed: apt-get install {package} (scripts/test installs it when missing)"
    );
    PathBuf::from(path)
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// A loopback address whose port was free a moment ago.
fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// One HTTP/1.1 GET with `Connection: close`; status and body (no chunked bodies).
fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text.split(' ').nth(1)?.parse().ok()?;
    Some((status, text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default()))
}

/// Polls `addr`'s `/readyz` until 200; panics with `why()` if `child` exits or time runs out.
fn wait_ready(addr: SocketAddr, child: &mut Child, why: &dyn Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some((200, _)) = http_get(addr, "/readyz") {
            return;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the process exited ({status}) before it was ready:\n{}", why());
        }
        assert!(Instant::now() < deadline, "not ready within 30 s:\n{}", why());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Collects a child's stderr lines in the background.
fn collect_stderr(child: &mut Child) -> std::sync::Arc<std::sync::Mutex<Vec<String>>> {
    use std::io::BufRead as _;
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let err = child.stderr.take().expect("stderr piped");
    let sink = lines.clone();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines() {
            let Ok(line) = line else { break };
            sink.lock().unwrap().push(line);
        }
    });
    lines
}

fn terminate(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let ok = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().unwrap().success();
    assert!(ok, "kill -TERM {}", child.id());
    wait_exit(child, within)
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("no exit within {within:?} of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills the processes a test started, whatever happens to the test.
#[derive(Default)]
struct Reaper(Vec<Child>);

impl Drop for Reaper {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

// --- deploy/systemd -------------------------------------------------------

/// `[Service]` settings of a unit, each key with every value it was given.
fn unit_settings(unit: &str) -> HashMap<String, Vec<String>> {
    let mut section = String::new();
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    for line in unit.lines().map(str::trim) {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        if line.starts_with('[') {
            section = line.to_owned();
            continue;
        }
        if section == "[Service]"
            && let Some((k, v)) = line.split_once('=')
        {
            out.entry(k.to_owned()).or_default().push(v.to_owned());
        }
    }
    out
}

#[test]
fn the_systemd_unit_passes_systemd_analyze_verify() {
    let analyze = tool("systemd-analyze", "systemd");
    // An alternate root holding what the unit names (the binary, /bin/kill)
    // and the stock units it is ordered against, so the unit is verified
    // exactly as shipped without installing anything on this host.
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    for dir in ["usr/local/bin", "bin", "etc/systemd/system", "usr/lib/systemd"] {
        std::fs::create_dir_all(r.join(dir)).unwrap();
    }
    std::fs::copy(BIN, r.join("usr/local/bin/idemgate")).unwrap();
    std::fs::copy("/bin/kill", r.join("bin/kill")).unwrap();
    let stock = Command::new("cp").arg("-r").arg("/usr/lib/systemd/system").arg(r.join("usr/lib/systemd/")).status().unwrap();
    assert!(stock.success(), "copy the stock units");
    std::fs::copy(root_path("deploy/systemd/idemgate.service"), r.join("etc/systemd/system/idemgate.service")).unwrap();
    let out = Command::new(analyze)
        .arg("verify")
        .arg(format!("--root={}", r.display()))
        .arg("/etc/systemd/system/idemgate.service")
        .output()
        .expect("run systemd-analyze");
    let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // Every warning (an unknown key, a bad value) fails the test too.
    assert!(out.status.success() && all.trim().is_empty(), "systemd-analyze verify: {}\n{all}", out.status);
}

fn root_path(p: &str) -> PathBuf {
    root().join(p)
}

/// The shell commands of the unit's install comment (`#   install ...`), one per entry.
fn install_steps(unit: &str) -> Vec<String> {
    unit.lines()
        .take_while(|l| l.starts_with('#'))
        .filter_map(|l| l.strip_prefix("#   "))
        .flat_map(|l| l.split("&&"))
        .map(|c| c.trim().to_owned())
        .filter(|c| !c.is_empty())
        .collect()
}

/// A directory standing for `/`, where the install steps are carried out.
struct FakeRoot {
    dir: tempfile::TempDir,
    groups: HashMap<String, u32>,
}

impl FakeRoot {
    fn path(&self, absolute: &str) -> PathBuf {
        self.dir.path().join(absolute.trim_start_matches('/'))
    }

    fn id(&self, name: &str) -> u32 {
        match name {
            "root" => 0,
            other => *self.groups.get(other).unwrap_or_else(|| panic!("the install steps never create group {other:?}")),
        }
    }

    /// Carries out one install step: `groupadd`, `install` (files and `-d`
    /// directories, with `-m`, `-o`, `-g`); `systemctl` is systemd's part.
    fn run(&mut self, step: &str) {
        let words: Vec<&str> = step.split_whitespace().collect();
        match words[0] {
            "groupadd" => {
                let name = words.last().unwrap();
                let gid = 60_900 + self.groups.len() as u32;
                self.groups.insert((*name).to_owned(), gid);
            }
            "install" => {
                let (mut dir, mut mode, mut owner, mut group, mut rest) = (false, 0o755, 0, 0, Vec::new());
                let mut it = words[1..].iter();
                while let Some(w) = it.next() {
                    match *w {
                        "-d" => dir = true,
                        "-m" => mode = u32::from_str_radix(it.next().unwrap(), 8).unwrap(),
                        "-o" => owner = self.id(it.next().unwrap()),
                        "-g" => group = self.id(it.next().unwrap()),
                        other => rest.push(other),
                    }
                }
                let targets: Vec<PathBuf> = if dir {
                    rest.iter().map(|d| self.path(d)).collect()
                } else {
                    let (dest, sources) = rest.split_last().unwrap();
                    let src = if sources[0] == "target/release/idemgate" { PathBuf::from(BIN) } else { root().join(sources[0]) };
                    let mut dest = self.path(dest);
                    if dest.is_dir() || rest.last().unwrap().ends_with('/') {
                        dest = dest.join(src.file_name().unwrap());
                    }
                    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
                    std::fs::copy(&src, &dest).unwrap_or_else(|e| panic!("{step}: {e}"));
                    vec![dest]
                };
                for t in targets {
                    if dir {
                        std::fs::create_dir_all(&t).unwrap();
                    }
                    chown(&t, Some(owner), Some(group)).unwrap();
                    std::fs::set_permissions(&t, std::fs::Permissions::from_mode(mode)).unwrap();
                }
            }
            "systemctl" => {}
            other => panic!("the test does not know the install step {other:?} ({step}); teach it"),
        }
    }

    /// Directories systemd would make, owned by `uid`, mode 0755.
    fn service_dir(&self, absolute: &str, uid: u32) -> PathBuf {
        let p = self.path(absolute);
        std::fs::create_dir_all(&p).unwrap();
        chown(&p, Some(uid), Some(uid)).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }
}

/// The `--pid-file` operations.md tells operators to pass to `idemgate reload`.
fn documented_reload_pid_file() -> String {
    let ops = read("docs/operations.md");
    let line = ops
        .lines()
        .find(|l| l.trim_start().starts_with("idemgate reload ") && l.contains("--pid-file"))
        .expect("operations.md shows `idemgate reload ... --pid-file ...`");
    let words: Vec<&str> = line.split_whitespace().collect();
    let i = words.iter().position(|w| *w == "--pid-file").unwrap();
    words[i + 1].to_owned()
}

/// The unit's install steps carried out in a directory standing for `/`,
/// then its ExecStart line run as systemd would: as an unprivileged user
/// (its dynamic user, with its supplementary groups), in its working
/// directory, with the runtime and state directories systemd makes for it.
/// It must serve, write the pid file operations.md's `idemgate reload`
/// uses, reload on that command, and exit cleanly on SIGTERM.
#[test]
fn the_systemd_units_exec_start_runs_as_an_unprivileged_user_with_the_documented_modes() {
    if !is_root() {
        eprintln!("SKIPPED: running the unit's ExecStart as another user needs root (setpriv)");
        return;
    }
    let setpriv = tool("setpriv", "util-linux");
    let unit = read("deploy/systemd/idemgate.service");
    let service = unit_settings(&unit);
    let one = |k: &str| service.get(k).and_then(|v| v.last()).cloned();

    let mut fake = FakeRoot { dir: tempfile::tempdir().unwrap(), groups: HashMap::new() };
    std::fs::set_permissions(fake.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    for step in install_steps(&unit) {
        fake.run(&step);
    }

    // The installed configuration, on ports of this test's own (modes kept).
    let (proxy, admin) = (free_addr(), free_addr());
    let config = fake.path("/etc/idemgate/idemgate.toml");
    let text = std::fs::read_to_string(&config).expect("the install steps put the configuration in /etc/idemgate/idemgate.toml");
    let text = text.replace("127.0.0.1:8080", &proxy.to_string()).replace("127.0.0.1:9090", &admin.to_string());
    std::fs::write(&config, text).unwrap();

    // What systemd does before ExecStart.
    assert_eq!(one("DynamicUser").as_deref(), Some("yes"), "the unit runs as a dynamic user");
    let uid = 61_901; // from systemd's dynamic range, used by no account here
    let groups: Vec<String> = service
        .get("SupplementaryGroups")
        .into_iter()
        .flatten()
        .flat_map(|v| v.split_whitespace())
        .map(|g| fake.id(g).to_string())
        .collect();
    let runtime = one("RuntimeDirectory").map(|d| fake.service_dir(&format!("/run/{d}"), uid));
    let state = one("StateDirectory").map(|d| fake.service_dir(&format!("/var/lib/{d}"), uid));
    let workdir = fake.path(&one("WorkingDirectory").expect("WorkingDirectory"));
    let exec = one("ExecStart").expect("ExecStart");
    let argv: Vec<String> =
        exec.split_whitespace().map(|w| if w.starts_with('/') { fake.path(w).display().to_string() } else { w.to_owned() }).collect();

    let mut cmd = Command::new(setpriv);
    cmd.arg(format!("--reuid={uid}")).arg(format!("--regid={uid}"));
    if groups.is_empty() {
        cmd.arg("--clear-groups");
    } else {
        cmd.arg(format!("--groups={}", groups.join(",")));
    }
    cmd.arg("--inh-caps=-all").arg("--").args(&argv).current_dir(&workdir).env_clear().env("PATH", "/usr/bin:/bin");
    if let Some(r) = &runtime {
        cmd.env("RUNTIME_DIRECTORY", r);
    }
    if let Some(s) = &state {
        cmd.env("STATE_DIRECTORY", s);
    }
    let mut reaper = Reaper::default();
    reaper.0.push(cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("run ExecStart"));
    let logs = collect_stderr(&mut reaper.0[0]);
    let show = || logs.lock().unwrap().join("\n");
    wait_ready(admin, &mut reaper.0[0], &show);

    // The pid file is where operations.md's reload command looks.
    let documented = documented_reload_pid_file();
    let words: Vec<&str> = exec.split_whitespace().collect();
    let pid_arg = words.iter().position(|w| *w == "--pid-file").map(|i| words[i + 1].to_owned());
    assert_eq!(pid_arg.as_deref(), Some(documented.as_str()), "ExecStart writes the pid file `idemgate reload --pid-file` reads");
    let pid_file = fake.path(&documented);

    let pid = std::fs::read_to_string(&pid_file).unwrap_or_else(|e| panic!("{}: {e}\n{}", pid_file.display(), show()));
    assert_eq!(pid.trim(), reaper.0[0].id().to_string(), "the pid file names the service's process");

    // `idemgate reload` as operations.md writes it, by root.
    let reload = Command::new(BIN)
        .args(["reload", "--config"])
        .arg(&config)
        .arg("--pid-file")
        .arg(&pid_file)
        .env_clear()
        .output()
        .expect("run idemgate reload");
    assert!(reload.status.success(), "reload: {}{}", String::from_utf8_lossy(&reload.stdout), String::from_utf8_lossy(&reload.stderr));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = http_get(admin, "/metrics").map(|(_, b)| b).unwrap_or_default();
        if metrics.contains(r#"idemgate_config_reloads_total{result="applied"} 1"#) {
            break;
        }
        assert!(Instant::now() < deadline, "the reload was not applied:\n{}", show());
        std::thread::sleep(Duration::from_millis(50));
    }

    let status = terminate(&mut reaper.0[0], Duration::from_secs(60));
    assert!(status.success(), "SIGTERM: {status}\n{}", show());
    assert!(!pid_file.exists(), "the pid file is removed on exit");
    // The embedded store lives in the state directory, owned by the service's user.
    let db = workdir.join("data/idemgate.db");
    let meta = std::fs::metadata(&db).unwrap_or_else(|e| panic!("{}: {e}", db.display()));
    assert_eq!(std::os::unix::fs::MetadataExt::uid(&meta), uid);
}

// --- Dockerfile and CA roots ----------------------------------------------

#[test]
fn the_images_runtime_stage_installs_ca_roots() {
    let dockerfile = read("Dockerfile");
    let runtime = dockerfile.rsplit("\nFROM ").next().expect("a runtime stage");
    let run: String = runtime.replace("\\\n", " ");
    assert!(
        run.lines().any(|l| l.starts_with("RUN ") && l.contains("apt-get install") && l.contains("ca-certificates")),
        "https upstreams, JWKS URLs, webhooks and sslmode=verify-full need the system's CA roots in the image:\n{runtime}"
    );
}

/// The image's missing CA roots, reproduced on the host: with an empty trust
/// store every https use without its own CA file is refused at start, and the
/// message says what to do (install the CA roots, or name a CA file).
#[test]
fn an_empty_trust_store_is_refused_with_a_message_to_install_ca_roots_or_set_ca_file() {
    let dir = tempfile::tempdir().unwrap();
    let empty_file = dir.path().join("empty.pem");
    std::fs::write(&empty_file, "").unwrap();
    let empty_dir = dir.path().join("certs");
    std::fs::create_dir(&empty_dir).unwrap();
    let config = dir.path().join("idemgate.toml");
    std::fs::write(
        &config,
        format!(
            r#"[store]
kind = "postgres"
url_env = "DB"

[[upstreams]]
name = "orders"
url = "https://orders.internal"

[[upstreams]]
name = "plain"
url = "http://plain.internal"

[[identity.sources]]
kind = "jwt"
jwks_url = "https://idp.internal/.well-known/jwks.json"

[[routes]]
operation = "create_order"
method = "POST"
path = "/v1/orders"
upstream = "plain"
[routes.events]
url = "https://hooks.internal/idemgate"
secret_file = "{secret}"
"#,
            secret = dir.path().join("secret").display()
        ),
    )
    .unwrap();
    std::fs::write(dir.path().join("secret"), "s3cret-s3cret-s3cret").unwrap();
    let env = |file: &Path, certs: &Path| {
        vec![
            ("DB".to_owned(), "postgres://u@db.internal/idemgate?sslmode=verify-full".to_owned()),
            ("SSL_CERT_FILE".to_owned(), file.display().to_string()),
            ("SSL_CERT_DIR".to_owned(), certs.display().to_string()),
        ]
    };
    let (code, out) = check_config(&config, &env(&empty_file, &empty_dir));
    assert_eq!(code, 1, "{out}");
    for (path, remedy) in [
        ("upstreams[0].ca_file", "ca_file"),
        ("store.url_env", "sslrootcert"),
        ("identity.sources[0].jwks_url", "SSL_CERT_FILE"),
        ("routes[0].events.url", "SSL_CERT_FILE"),
    ] {
        let line = out.lines().find(|l| l.contains(path)).unwrap_or_else(|| panic!("no error for {path}:\n{out}"));
        assert!(line.contains("ca-certificates") && line.contains(remedy), "{path}: install the CA roots or set {remedy}:\n{line}");
    }

    // With roots in the trust store the same file is valid.
    let pki = support::tls::Pki::new("a private CA");
    let (code, out) = check_config(&config, &env(&pki.ca_file, &empty_dir));
    assert_eq!(code, 0, "{out}");
}

// --- idemgate healthcheck (the image's HEALTHCHECK) ------------------------

fn healthcheck(config: &Path, env: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new(BIN)
        .args(["healthcheck", "--config"])
        .arg(config)
        .env_clear()
        .envs(env.iter().copied())
        .output()
        .expect("run idemgate healthcheck");
    (out.status.code().unwrap_or(-1), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// A running gateway's configuration file, written into `dir` with the admin
/// port it got (the harness asks for port 0), as an operator's would name it.
fn running_config(dir: &Path, gw: &support::Gateway) -> std::path::PathBuf {
    let config = dir.join("running.toml");
    let text = std::fs::read_to_string(gw.config_path()).unwrap();
    let admin = gw.admin.expect("an admin listener");
    std::fs::write(&config, text.replace("[admin]\nlisten = \"127.0.0.1:0\"", &format!("[admin]\nlisten = \"{admin}\""))).unwrap();
    config
}

/// `idemgate healthcheck` needs only the admin address: it works from a
/// configuration whose secrets are not in its environment (a HEALTHCHECK
/// or probe does not get them), exits 1 when the gateway is not ready or not
/// there, and 3 when its configuration cannot tell it where to ask.
#[test]
fn healthcheck_needs_no_secrets_and_separates_not_ready_from_bad_config() {
    let dir = tempfile::tempdir().unwrap();
    // A running gateway whose configuration names secrets in the environment.
    let token = dir.path().join("token");
    std::fs::write(&token, "an-admin-token-of-32-characters!").unwrap();
    let up = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gw = support::Gateway::start(
        support::GatewayConfig::new(support::sqlite_backend(), format!("http://{}", up.local_addr().unwrap()))
            .admin(&format!("token_file = \"{}\"", token.display())),
    );
    let config = running_config(dir.path(), &gw);
    let (code, out) = healthcheck(&config, &[]);
    assert_eq!(code, 0, "ready, without the derived-key secret in the environment: {out}");
    assert!(out.contains("/readyz") && out.contains("200"), "{out}");
    let (code, out) = Command::new(BIN)
        .args(["healthcheck", "--live", "--config"])
        .arg(&config)
        .env_clear()
        .output()
        .map(|o| (o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stdout).into_owned()))
        .unwrap();
    assert_eq!(code, 0, "{out}");

    // Nothing listens on the admin address: not ready (1), and no word about secrets.
    let silent = free_addr();
    let pg = dir.path().join("pg.toml");
    std::fs::write(
        &pg,
        format!(
            "[store]\nkind = \"postgres\"\nurl_env = \"IDEMGATE_DATABASE_URL\"\n[admin]\nlisten = \"{silent}\"\ntoken_env = \"IDEMGATE_ADMIN_TOKEN\"\n[server]\ndefault_upstream = \"u\"\n[[upstreams]]\nname = \"u\"\nurl = \"http://127.0.0.1:9\"\n"
        ),
    )
    .unwrap();
    let (code, out) = healthcheck(&pg, &[]);
    assert_eq!(code, 1, "not ready: {out}");
    assert!(out.contains(&silent.to_string()) && !out.contains("IDEMGATE_DATABASE_URL"), "{out}");

    // A configuration that cannot say where to ask: 3.
    let broken = dir.path().join("broken.toml");
    std::fs::write(&broken, "[admin\nlisten = ").unwrap();
    let (code, out) = healthcheck(&broken, &[]);
    assert_eq!(code, 3, "a TOML error is a configuration problem: {out}");
    let no_admin = dir.path().join("no-admin.toml");
    std::fs::write(&no_admin, "[server]\nlisten = \"127.0.0.1:8080\"\n").unwrap();
    let (code, out) = healthcheck(&no_admin, &[]);
    assert_eq!(code, 3, "no admin listener: {out}");
    assert!(out.contains("admin.listen"), "{out}");
    let (code, out) = healthcheck(&dir.path().join("missing.toml"), &[]);
    assert_eq!(code, 3, "{out}");

    // The exit codes are documented.
    let reference = read("docs/reference.md");
    let row = reference.lines().find(|l| l.starts_with("| `idemgate healthcheck")).expect("reference.md has a healthcheck row");
    assert!(row.contains("exit 0") && row.contains(" 1 ") && row.contains(" 3 "), "{row}");
}

/// With `[admin.tls]`, the check speaks TLS to the admin listener, trusting
/// exactly the certificate of `admin.tls.cert_file` (it reaches the listener
/// on a loopback address the certificate need not name); a listener showing
/// another certificate is not ready. Before, it spoke plain HTTP to a TLS
/// listener and a gateway with admin TLS was never healthy.
#[test]
fn healthcheck_speaks_tls_to_an_admin_listener_with_tls() {
    let dir = tempfile::tempdir().unwrap();
    let pki = support::tls::Pki::new("admin CA");
    let cert = pki.server(support::tls::Alg::EcdsaP256);
    let up = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gw = support::Gateway::start(
        support::GatewayConfig::new(support::sqlite_backend(), format!("http://{}", up.local_addr().unwrap())).tail(&format!(
            "[admin.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
            cert.cert_file.display(),
            cert.key_file.display()
        )),
    );
    let config = running_config(dir.path(), &gw);
    let (code, out) = healthcheck(&config, &[]);
    assert_eq!(code, 0, "ready, over TLS: {out}");
    assert!(out.contains("/readyz") && out.contains("200"), "{out}");

    // The file names another certificate than the listener shows: not ready.
    let another = support::tls::Pki::new("another CA");
    let other = another.server(support::tls::Alg::EcdsaP256);
    let impostor = dir.path().join("impostor.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&impostor, text.replace(&cert.cert_file.display().to_string(), &other.cert_file.display().to_string())).unwrap();
    let (code, out) = healthcheck(&impostor, &[]);
    assert_eq!(code, 1, "another certificate: {out}");
}

// --- References between the shipped files and the docs ---------------------

/// GitHub's anchor for a heading.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == ' ' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn headings(doc: &str) -> Vec<String> {
    read(&format!("docs/{doc}"))
        .lines()
        .filter_map(|l| l.trim_start_matches('#').strip_prefix(' ').filter(|_| l.starts_with('#')))
        .map(slug)
        .collect()
}

/// Every `docs/x.md ("Section")` a shipped file cites, and every
/// `x.md#anchor` link in the docs, names a section that exists; and the
/// reference does not deny the HTTP/2 the TLS listener serves.
#[test]
fn shipped_files_and_docs_cite_sections_that_exist() {
    let mut files: Vec<PathBuf> = vec![root().join("Dockerfile")];
    let mut stack = vec![root().join("deploy"), root().join("config")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() { stack.push(p) } else { files.push(p) }
        }
    }
    let mut cited = 0;
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap_or_default();
        for (i, _) in text.match_indices("docs/") {
            let rest = &text[i + 5..];
            let Some(end) = rest.find(".md") else { continue };
            let doc = format!("{}.md", &rest[..end]);
            if doc.contains(char::is_whitespace) {
                continue;
            }
            assert!(root().join("docs").join(&doc).exists(), "{} cites docs/{doc}, which does not exist", f.display());
            let after = rest[end + 3..].trim_start();
            if let Some(section) = after.strip_prefix("(\"").and_then(|s| s.split_once('"')).map(|(s, _)| s) {
                cited += 1;
                assert!(
                    headings(&doc).contains(&slug(section)),
                    "{} cites docs/{doc} (\"{section}\"), which has no such section",
                    f.display()
                );
            }
        }
    }
    assert!(cited > 0, "the shipped files cite sections");
    for entry in std::fs::read_dir(root().join("docs")).unwrap() {
        let p = entry.unwrap().path();
        // Markdown pages only (docs/console/ holds screenshots).
        if p.extension().is_none_or(|e| e != "md") {
            continue;
        }
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&p).unwrap();
        for (i, _) in text.match_indices("](") {
            let link = &text[i + 2..text[i..].find(')').map_or(text.len(), |e| i + e)];
            let Some((file, anchor)) = link.split_once('#') else { continue };
            if file.contains("://") || file.contains('/') {
                continue;
            }
            let target = if file.is_empty() { name.clone() } else { file.to_owned() };
            assert!(headings(&target).contains(&anchor.to_owned()), "{name} links to {target}#{anchor}, which does not exist");
        }
    }
    let reference = read("docs/reference.md");
    assert!(!reference.contains("**HTTP/1.1** only"), "reference.md says HTTP/1.1 only, but a TLS listener serves HTTP/2");
}

// --- deploy/compose.yaml, deploy/prometheus, deploy/grafana -----------------

/// `curl` with a query string, through the real curl; stdout.
fn curl_get(url: &str, query: &[(&str, &str)]) -> String {
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "--max-time", "20", "--get", url]);
    for (k, v) in query {
        cmd.arg("--data-urlencode").arg(format!("{k}={v}"));
    }
    let out = cmd.env("NO_PROXY", "*").output().expect("run curl");
    assert!(out.status.success(), "curl {url}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn json_get(url: &str, query: &[(&str, &str)]) -> serde_json::Value {
    let body = curl_get(url, query);
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{url}: not JSON ({e}): {body}"))
}

/// The `curl` lines of compose.yaml's header comment, continuation lines joined.
fn compose_curl_lines(compose: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut current = String::new();
    for l in compose.lines().take_while(|l| l.starts_with('#')) {
        let body = l.trim_start_matches('#').trim();
        if current.is_empty() && !body.starts_with("curl ") {
            continue;
        }
        match body.strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(body);
                lines.push(std::mem::take(&mut current));
            }
        }
    }
    lines
}

/// A service's `host:container` port pairs.
fn port_pairs(svc: &serde_json::Value) -> Vec<(String, String)> {
    svc["ports"]
        .as_array()
        .map(|ps| ps.iter().filter_map(|p| p.as_str()?.split_once(':').map(|(h, c)| (h.to_owned(), c.to_owned()))).collect())
        .unwrap_or_default()
}

/// deploy/compose.yaml brought up without a container engine: each service's
/// command runs against this build's binary (or, for the PostgreSQL,
/// Prometheus images, the same programs installed here), with compose's
/// environment and its mounted files, and service names and container ports
/// mapped to this machine's addresses. Then the compose header's curl lines
/// (a first request on replica 1, its replay on replica 2), the image's
/// HEALTHCHECK, Prometheus with the shipped rules scraping both replicas,
/// every alert rule evaluated and every dashboard query answered.
#[test]
fn compose_services_run_as_written_with_prometheus_evaluating_the_rules_and_dashboard() {
    let prometheus_bin = tool("prometheus", "prometheus");
    let promtool = tool("promtool", "prometheus");
    tool("curl", "curl");
    let compose_text = read("deploy/compose.yaml");
    let compose = yaml("deploy/compose.yaml");
    let services = compose["services"].as_object().unwrap();
    let work = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let mark = |what: &str| eprintln!("compose: {what} after {:?}", started.elapsed());
    let mut reaper = Reaper::default();
    // service:container-port (as other services name it) -> where it listens here.
    let mut addr_of: BTreeMap<String, SocketAddr> = BTreeMap::new();
    // The host ports compose publishes -> where they are here.
    let mut published: BTreeMap<String, SocketAddr> = BTreeMap::new();

    // postgres: the private cluster, set up as the image's environment asks.
    let pg = support::postgres::PgServer::start().expect("start PostgreSQL");
    let pg_env = &services["postgres"]["environment"];
    let (user, password, db) =
        (pg_env["POSTGRES_USER"].as_str().unwrap(), pg_env["POSTGRES_PASSWORD"].as_str().unwrap(), pg_env["POSTGRES_DB"].as_str().unwrap());
    if user != support::postgres::SUPERUSER {
        pg.simple_query("postgres", &format!("CREATE ROLE \"{user}\" LOGIN SUPERUSER PASSWORD '{password}'")).unwrap();
    }
    pg.create_database(db).unwrap();
    addr_of.insert("postgres:5432".into(), format!("127.0.0.1:{}", pg.port()).parse().unwrap());
    // Its health check, as compose runs it (PGHOST/PGPORT point pg_isready here).
    let bindir = support::postgres::replication_binaries().expect("PostgreSQL binaries");
    let test = services["postgres"]["healthcheck"]["test"].as_array().unwrap();
    assert_eq!(test[0], "CMD-SHELL");
    let ready = Command::new("sh")
        .arg("-c")
        .arg(test[1].as_str().unwrap())
        .env("PATH", format!("{}:/usr/bin:/bin", bindir.display()))
        .env("PGHOST", "127.0.0.1")
        .env("PGPORT", pg.port().to_string())
        .output()
        .unwrap();
    assert!(ready.status.success(), "postgres healthcheck: {}", String::from_utf8_lossy(&ready.stdout));

    // orders: the demo order service.
    let orders = free_addr();
    let args: Vec<String> = services["orders"]["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().replace("0.0.0.0:9000", &orders.to_string()))
        .collect();
    assert!(args.contains(&orders.to_string()), "orders listens on 0.0.0.0:9000: {args:?}");
    reaper.0.push(Command::new(BIN).args(&args).env_clear().stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap());
    addr_of.insert("orders:9000".into(), orders);
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(orders).is_err() {
        assert!(Instant::now() < deadline, "the order service did not listen");
        std::thread::sleep(Duration::from_millis(50));
    }

    // The two replicas: `serve` with compose's environment and the mounted config.
    let mut replicas = Vec::new();
    for name in ["idemgate-1", "idemgate-2"] {
        let svc = &services[name];
        let (proxy, admin) = (free_addr(), free_addr());
        for (host, container) in port_pairs(svc) {
            let here = if container == "8080" { proxy } else { admin };
            published.insert(host, here);
            addr_of.insert(format!("{name}:{container}"), here);
        }
        let volume = svc["volumes"][0].as_str().unwrap();
        let (host_file, container_path) = volume.split_once(':').unwrap();
        let container_path = container_path.trim_end_matches(":ro");
        let mut config = std::fs::read_to_string(root().join("deploy").join(host_file)).unwrap();
        config = config.replace("0.0.0.0:8080", &proxy.to_string()).replace("0.0.0.0:9090", &admin.to_string());
        config = config.replace("http://orders:9000", &format!("http://{orders}"));
        let config_path = work.path().join(format!("{name}.toml"));
        std::fs::write(&config_path, config).unwrap();
        let env: Vec<(String, String)> = svc["environment"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| {
                let v = v.as_str().unwrap().replace(container_path, &config_path.display().to_string());
                (k.clone(), v.replace("@postgres:5432/", &format!("@{}/", addr_of["postgres:5432"])))
            })
            .collect();
        let mut child = Command::new(BIN)
            .args(svc["command"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()))
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let logs = collect_stderr(&mut child);
        wait_ready(admin, &mut child, &|| logs.lock().unwrap().join("\n"));
        // The image's HEALTHCHECK, with the container's environment.
        let dockerfile = read("Dockerfile");
        let health = dockerfile.lines().find(|l| l.starts_with("HEALTHCHECK")).unwrap();
        let exec: Vec<String> = serde_json::from_str(&health[health.find("CMD [").unwrap() + 4..]).unwrap();
        assert_eq!(exec[0], "/usr/local/bin/idemgate");
        let h = Command::new(BIN).args(&exec[1..]).env_clear().envs(env.iter().map(|(k, v)| (k, v))).output().unwrap();
        assert!(h.status.success(), "{name}: HEALTHCHECK: {}{}", String::from_utf8_lossy(&h.stdout), String::from_utf8_lossy(&h.stderr));
        reaper.0.push(child);
        replicas.push((name, proxy, admin, logs));
    }

    mark("the replicas are ready");
    // The header's curl lines, on the published ports.
    let lines = compose_curl_lines(&compose_text);
    assert_eq!(lines.len(), 2, "{lines:?}");
    let mut answers = Vec::new();
    for line in &lines {
        let mut line = line.clone();
        for (host, here) in &published {
            line = line.replace(&format!("localhost:{host}"), &here.to_string());
        }
        let out = Command::new("bash").arg("-c").arg(&line).env("NO_PROXY", "*").output().unwrap();
        assert!(out.status.success(), "{line}");
        answers.push(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    assert!(answers[0].starts_with("HTTP/1.1 201"), "{}", answers[0]);
    assert!(answers[1].starts_with("HTTP/1.1 201") && answers[1].to_lowercase().contains("idempotent-replayed: true"), "{}", answers[1]);
    let count: serde_json::Value = serde_json::from_str(&curl_get(&format!("http://{orders}/v1/orders/count"), &[])).unwrap();
    assert_eq!(count["count"], 1, "one order for two requests on two replicas");

    // prometheus (profile monitoring): its command, its mounted files, the replicas as targets.
    let svc = &services["prometheus"];
    let mut mounted: Vec<(String, PathBuf)> = Vec::new();
    for v in svc["volumes"].as_array().unwrap() {
        let (host, container) = v.as_str().unwrap().split_once(':').unwrap();
        let container = container.trim_end_matches(":ro").to_owned();
        let copy = work.path().join(Path::new(&container).file_name().unwrap());
        mounted.push((container, copy));
        let _ = host;
    }
    for (container, copy) in &mounted {
        let host = svc["volumes"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).find(|v| v.contains(container.as_str())).unwrap();
        let mut text = std::fs::read_to_string(root().join("deploy").join(host.split_once(':').unwrap().0)).unwrap();
        for (c, p) in &mounted {
            text = text.replace(c.as_str(), &p.display().to_string());
        }
        for (name, here) in &addr_of {
            text = text.replace(&format!("\"{name}\""), &format!("\"{here}\""));
        }
        // Scrape and evaluate every second instead of every 10 s.
        text = text.replace("scrape_interval: 10s", "scrape_interval: 1s").replace("evaluation_interval: 10s", "evaluation_interval: 1s");
        std::fs::write(copy, text).unwrap();
    }
    let prom_config = &mounted.iter().find(|(c, _)| c.ends_with("prometheus.yml")).unwrap().1;
    let rules_file = &mounted.iter().find(|(c, _)| c.ends_with("alerts.yaml")).unwrap().1;
    for args in [vec!["check", "config"], vec!["check", "rules"]] {
        let file = if args[1] == "config" { prom_config } else { rules_file };
        let out = Command::new(&promtool).args(&args).arg(file).output().unwrap();
        assert!(
            out.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let prom = free_addr();
    let mut args: Vec<String> = svc["command"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
    for a in &mut args {
        for (c, p) in &mounted {
            *a = a.replace(c.as_str(), &p.display().to_string());
        }
    }
    args.push(format!("--web.listen-address={prom}"));
    args.push(format!("--storage.tsdb.path={}", work.path().join("tsdb").display()));
    reaper.0.push(Command::new(&prometheus_bin).args(&args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap());
    let api = format!("http://{prom}/api/v1");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ok = Command::new("curl").args(["-sf", &format!("http://{prom}/-/ready")]).output().is_ok_and(|o| o.status.success());
        if ok {
            let targets = json_get(&format!("{api}/targets"), &[]);
            let active = targets["data"]["activeTargets"].as_array().cloned().unwrap_or_default();
            if active.len() == 2 && active.iter().all(|t| t["health"] == "up") {
                break;
            }
        }
        assert!(Instant::now() < deadline, "Prometheus did not scrape both replicas");
        std::thread::sleep(Duration::from_millis(200));
    }

    mark("Prometheus scrapes both replicas");
    // Every rule of alerts.yaml loaded and evaluated without error.
    let shipped: Vec<String> = yaml("deploy/prometheus/alerts.yaml")["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().iter().map(|r| r["alert"].as_str().unwrap().to_owned()))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let rules = json_get(&format!("{api}/rules"), &[]);
        let loaded: Vec<serde_json::Value> = rules["data"]["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        let evaluated = loaded.iter().filter(|r| r["health"] == "ok").count();
        for r in &loaded {
            assert_ne!(r["health"], "err", "rule {} fails: {}", r["name"], r["lastError"]);
        }
        if evaluated == shipped.len() && loaded.len() == shipped.len() {
            break;
        }
        assert!(Instant::now() < deadline, "rules not all evaluated: {loaded:?}");
        std::thread::sleep(Duration::from_millis(200));
    }

    mark("every rule evaluated");
    // The dashboard's queries, with Grafana's variables filled in, answered by Prometheus.
    let dash: serde_json::Value = serde_json::from_str(&read("deploy/grafana/dashboards/idemgate.json")).unwrap();
    let mut queries = 0;
    for panel in dash["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            let filled = expr.replace("$__rate_interval", "1m").replace("$instance", ".*");
            let answer = json_get(&format!("{api}/query"), &[("query", &filled)]);
            assert_eq!(answer["status"], "success", "panel {}: {filled}: {answer}", panel["title"]);
            queries += 1;
        }
    }
    assert!(queries >= 10);
    let instances = json_get(&format!("{api}/label/instance/values"), &[("match[]", "idemgate_build_info")]);
    assert_eq!(instances["data"].as_array().map(Vec::len), Some(2), "the replica selector lists both replicas: {instances}");

    // grafana (profile monitoring): provisioning points at the compose Prometheus and the mounted dashboards.
    let grafana = &services["grafana"];
    let datasource = yaml("deploy/grafana/provisioning/datasources/prometheus.yaml");
    let url = datasource["datasources"][0]["url"].as_str().unwrap();
    let host_port = url.trim_start_matches("http://");
    let prom_container_port = port_pairs(&services["prometheus"]).first().map(|(_, c)| c.clone()).unwrap_or_else(|| "9090".into());
    assert_eq!(host_port, format!("prometheus:{prom_container_port}"), "the datasource is compose's Prometheus");
    let mounts: Vec<&str> = grafana["volumes"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let provider = yaml("deploy/grafana/provisioning/dashboards/idemgate.yaml");
    let dashboards_dir = provider["providers"][0]["options"]["path"].as_str().unwrap();
    assert!(mounts.iter().any(|m| m.starts_with("./grafana/dashboards:") && m.contains(dashboards_dir)), "{mounts:?}");
    assert!(mounts.iter().any(|m| m.starts_with("./grafana/provisioning:/etc/grafana/provisioning")), "{mounts:?}");

    mark("the dashboard's queries answered");
    // compose stops replicas with SIGTERM (all at once) and waits stop_grace_period: they drain and exit 0 within it.
    let grace = humantime::parse_duration(services["idemgate-1"]["stop_grace_period"].as_str().unwrap()).unwrap();
    for i in 0..replicas.len() {
        let ok = Command::new("kill").arg("-TERM").arg(reaper.0[1 + i].id().to_string()).status().unwrap().success();
        assert!(ok, "kill -TERM");
    }
    for (i, (name, _, _, logs)) in replicas.iter().enumerate() {
        let status = wait_exit(&mut reaper.0[1 + i], grace);
        assert!(status.success(), "{name}: {status}\n{}", logs.lock().unwrap().join("\n"));
    }
    mark("both replicas stopped");
}

/// The metric names (before any label) a PromQL expression uses.
fn promql_metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let start = (expr[i..].starts_with("idemgate_") || expr[i..].starts_with("process_"))
            && (i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_'));
        if start {
            let end = expr[i..].find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).map_or(expr.len(), |n| i + n);
            names.push(expr[i..end].to_owned());
            i = end;
        } else {
            i += 1;
        }
    }
    names
}

/// Every metric an alert rule or a dashboard panel names is exposed, with
/// series, by a live gateway that uses every feature they watch (a TLS
/// listener, an async route, completion events).
#[test]
fn every_metric_the_rules_and_the_dashboard_name_is_exposed_by_a_live_gateway() {
    let pki = support::tls::Pki::new("metrics CA");
    let cert = pki.server(support::tls::Alg::EcdsaP256);
    let secret = pki.dir.path().join("events-secret");
    std::fs::write(&secret, "an-events-secret-of-some-length").unwrap();
    let up = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gw = support::Gateway::start(
        support::GatewayConfig::new(support::sqlite_backend(), format!("http://{}", up.local_addr().unwrap()))
            .server(&format!("[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"", cert.cert_file.display(), cert.key_file.display()))
            .tail("[[routes]]\noperation = \"ship_order\"\nmethod = \"POST\"\npath = \"/v1/shipments\"\nupstream = \"orders\"\nmode = \"async\"")
            .tail(&format!(
                "[[routes]]\noperation = \"notify\"\nmethod = \"POST\"\npath = \"/v1/notify\"\nupstream = \"orders\"\n[routes.events]\nurl = \"http://127.0.0.1:9/hooks\"\nsecret_file = \"{}\"",
                secret.display()
            )),
    );
    let exposition = http_get(gw.admin.unwrap(), "/metrics").unwrap().1;
    // Series, not only families: `name{...} value` or `name value` lines.
    let has_series = |name: &str| {
        exposition.lines().filter(|l| !l.starts_with('#')).any(|l| {
            let series = l.split(['{', ' ']).next().unwrap_or_default();
            series == name || ["_bucket", "_count", "_sum", "_total", "_info"].iter().any(|s| format!("{name}{s}") == series)
        })
    };
    let mut checked = 0;
    for group in yaml("deploy/prometheus/alerts.yaml")["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            for name in promql_metric_names(rule["expr"].as_str().unwrap()) {
                assert!(has_series(&name), "alert {} uses {name}, which /metrics does not expose:\n{exposition}", rule["alert"]);
                checked += 1;
            }
        }
    }
    let dash: serde_json::Value = serde_json::from_str(&read("deploy/grafana/dashboards/idemgate.json")).unwrap();
    for panel in dash["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            for name in promql_metric_names(target["expr"].as_str().unwrap()) {
                assert!(has_series(&name), "panel {} uses {name}, which /metrics does not expose:\n{exposition}", panel["title"]);
                checked += 1;
            }
        }
    }
    assert!(checked > 20, "{checked}");
}
