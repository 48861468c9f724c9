//! docs/operations.md, followed to the letter: every fenced shell block marked
//! `runnable` is run through bash against a live gateway started as the
//! document describes (`serve --pid-file`, an admin token), with only the
//! host-specific values substituted (the admin address, the configuration and
//! pid file paths, a scope id that a log line would give). Each block must
//! exit 0, and what it did must show in the store and the audit trail.
//!
//! Blocks marked `runnable postgres` need a database and are run by
//! `tests/it/pg_roles.rs`; blocks that start with `docker` need a container
//! engine and are exercised by `tests/it/deploy.rs` instead. Any other shell
//! block fails this test: a runbook command that is not run can rot.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::io::{BufRead as _, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemgate::idempotency::record::State;
use support::gateway::TEST_SECRET_ENV;
use support::{GatewayConfig, TEST_SECRET, TestUpstream, post, send, sqlite_backend};

const BIN: &str = env!("CARGO_BIN_EXE_idemgate");
const TOKEN: &str = "runbook-admin-token-0123456789abcdef";

/// A fenced block: its info string (`sh runnable`) and its text, unindented.
#[derive(Debug)]
struct Block {
    info: String,
    body: String,
    line: usize,
}

fn blocks(doc: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<(String, usize, usize, Vec<String>)> = None;
    for (n, line) in doc.lines().enumerate() {
        let indent = line.len() - line.trim_start().len();
        let trimmed = line.trim_start();
        match &mut open {
            None => {
                if let Some(info) = trimmed.strip_prefix("```") {
                    open = Some((info.trim().to_owned(), indent, n + 1, Vec::new()));
                }
            }
            Some((info, fence_indent, start, body)) => {
                if trimmed.starts_with("```") {
                    out.push(Block { info: info.clone(), body: body.join("\n"), line: *start });
                    open = None;
                } else {
                    let cut = indent.min(*fence_indent);
                    body.push(line[cut..].to_owned());
                }
            }
        }
    }
    out
}

fn operations_blocks() -> Vec<Block> {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md")).expect("read operations.md");
    blocks(&doc)
}

/// `idemgate serve --config C --pid-file P`, JSON logs collected.
struct Serve {
    child: Child,
    logs: Arc<Mutex<Vec<String>>>,
    addr: SocketAddr,
    admin: SocketAddr,
}

impl Serve {
    fn start(config: &Path, pid_file: &Path) -> Serve {
        let mut child = Command::new(BIN)
            .args(["serve", "--config"])
            .arg(config)
            .arg("--pid-file")
            .arg(pid_file)
            .env("IDEMGATE_LOG_FORMAT", "json")
            .env(TEST_SECRET_ENV, TEST_SECRET)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn idemgate serve");
        let logs = Arc::new(Mutex::new(Vec::new()));
        let err = child.stderr.take().unwrap();
        let sink = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let listening = logs.lock().unwrap().iter().find_map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).ok()?;
                if v["message"] != "listening" {
                    return None;
                }
                let addr: SocketAddr = v["addr"].as_str()?.parse().ok()?;
                let admin: SocketAddr = v["admin"].as_str()?.parse().ok()?;
                Some((addr, admin))
            });
            if let Some((addr, admin)) = listening {
                return Serve { child, logs, addr, admin };
            }
            assert!(child.try_wait().unwrap().is_none(), "serve exited:\n{}", logs.lock().unwrap().join("\n"));
            assert!(Instant::now() < deadline, "serve did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn logs(&self) -> String {
        self.logs.lock().unwrap().join("\n")
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn bin_dir() -> PathBuf {
    Path::new(BIN).parent().unwrap().to_owned()
}

/// Runs a block through `bash -euo pipefail`; panics with its output unless it exits 0.
fn run_block(block: &Block, substitutions: &[(String, String)], cwd: &Path) -> String {
    let mut script = block.body.clone();
    for (from, to) in substitutions {
        script = script.replace(from.as_str(), to);
    }
    let path = format!("{}:{}", bin_dir().display(), std::env::var("PATH").unwrap_or_default());
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!("set -euo pipefail\n{script}"))
        .current_dir(cwd)
        .env("PATH", path)
        .env("IDEMGATE_ADMIN_TOKEN", TOKEN)
        .env(TEST_SECRET_ENV, TEST_SECRET)
        .env_remove("IDEMGATE_CONFIG")
        .env("NO_PROXY", "*")
        .output()
        .expect("run bash");
    let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "operations.md line {}: the block failed ({}):\n{script}\n---\n{all}", block.line, out.status);
    all
}

#[test]
fn every_shell_block_in_operations_md_is_run_by_a_test() {
    for b in operations_blocks() {
        let lang = b.info.split_whitespace().next().unwrap_or_default();
        if !matches!(lang, "sh" | "bash" | "shell" | "console") {
            continue;
        }
        let runnable = b.info.split_whitespace().any(|w| w == "runnable");
        let docker = b.body.trim_start().starts_with("docker ");
        assert!(runnable || docker, "operations.md line {}: a shell block that no test runs (mark it ```sh runnable):\n{}", b.line, b.body);
    }
    let sql: Vec<Block> = operations_blocks().into_iter().filter(|b| b.info.starts_with("sql")).collect();
    assert!(sql.iter().all(|b| b.info.contains("runnable") && b.info.contains("postgres")), "{sql:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_md_runnable_blocks_work_against_a_live_gateway() {
    let up = TestUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let config = dir.path().join("idemgate.toml");
    let toml =
        GatewayConfig::new(sqlite_backend(), up.url()).timeout("1s").admin(&format!("token_file = \"{}\"", token_file.display())).toml();
    std::fs::write(&config, &toml).unwrap();
    let pid_file = dir.path().join("idemgate.pid");
    let gw = Serve::start(&config, &pid_file);
    let url = format!("http://{}/v1/orders", gw.addr);

    // Four records whose outcome is unknown: the upstream takes 1.5 s, the gateway waits 1 s.
    for key in ["K1", "K2", "K3", "K4"] {
        let r = post(&url, key, "{}", &[("x-test-sleep-ms", "1500")]).await;
        assert_eq!(r.status, 504, "{key}: {}", String::from_utf8_lossy(&r.body));
    }
    // A body file for `keys resolve --complete --body-file order.json`.
    std::fs::write(dir.path().join("order.json"), r#"{"id":17}"#).unwrap();

    let substitutions = vec![
        ("http://127.0.0.1:9090".to_owned(), format!("http://{}", gw.admin)),
        ("/etc/idemgate/idemgate.toml".to_owned(), config.display().to_string()),
        ("/run/idemgate/idemgate.pid".to_owned(), pid_file.display().to_string()),
        // The scope id of K3, as the log lines about it print it.
        ("5f0c2a9d41e7b388".to_owned(), support::scope("K3").log_id()),
    ];
    let mut ran = 0;
    for b in operations_blocks() {
        let words: Vec<&str> = b.info.split_whitespace().collect();
        if words.first() != Some(&"sh") || !words.contains(&"runnable") || words.contains(&"postgres") {
            continue;
        }
        let out = run_block(&b, &substitutions, dir.path());
        eprintln!("operations.md line {}: ok\n{out}", b.line);
        ran += 1;
    }
    assert!(ran >= 3, "the admin API, CLI and reload blocks ran ({ran})");

    // What the blocks did: K1 and K3 released, K2 and K4 completed by hand, each audited.
    let store = sqlite_store(&toml).await;
    let state = |key: &'static str| {
        let store = store.clone();
        async move { support::record(&store, key).await.map(|r| (r.state, r.response.map(|s| s.status))) }
    };
    assert_eq!(state("K1").await, None, "released through the API");
    assert_eq!(state("K2").await, Some((State::Completed, Some(201))), "completed through the API");
    assert_eq!(state("K3").await, None, "released with the CLI");
    assert_eq!(state("K4").await, Some((State::Completed, Some(201))), "completed with the CLI");
    let audit = store.audit(100).await.unwrap();
    assert_eq!(audit.len(), 4, "{audit:?}");
    // The upstream ran each request once; nothing was re-executed.
    assert_eq!(up.total(), 4);

    // The reload block reloaded the running gateway through its pid file.
    let metrics = send("GET", &format!("http://{}/metrics", gw.admin), &[], "").await.unwrap();
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(text.contains(r#"idemgate_config_reloads_total{result="applied"} 1"#), "{text}\n{}", gw.logs());
}

/// The store of a generated test configuration (SQLite), opened beside the gateway.
async fn sqlite_store(toml: &str) -> idemgate::store::Store {
    let config =
        idemgate::config::Config::from_toml(toml, "test", &|name| (name == TEST_SECRET_ENV).then(|| TEST_SECRET.to_owned())).unwrap();
    idemgate::store::Store::open(&config.store, idemgate::store::Access::Existing).await.unwrap()
}
