//! `idemgate demo`, end to end: start the real binary on ephemeral ports, read
//! the script it prints, and run its lines through `bash -c` exactly as a user
//! would paste them (which also proves they paste into bash), checking that
//! each step shows what it says. Then SIGTERM must exit 0, and a second start
//! on the same directory must begin from an empty store.
//!
//! Needs `bash` and `curl` on the PATH; without them the test says so and
//! passes without running.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_idemgate");

/// The last line of the script.
const READY: &str = "Press Ctrl-C to stop.";

fn have(tool: &str) -> bool {
    Command::new(tool).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// A running `idemgate demo` and everything it printed.
struct Demo {
    child: Option<Child>,
    stdout: Receiver<String>,
    stderr: Arc<Mutex<Vec<String>>>,
    /// Every stdout line read so far.
    printed: Vec<String>,
}

impl Demo {
    fn start(data: &Path) -> Demo {
        let mut child = Command::new(BIN)
            .args(["demo", "--listen", "127.0.0.1:0", "--upstream-listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--data"])
            .arg(data)
            .env_remove("IDEMGATE_CONFIG")
            .env("IDEMGATE_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn idemgate demo");
        let (tx, stdout) = mpsc::channel();
        let out = child.stdout.take().expect("stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let err = child.stderr.take().expect("stderr");
        let lines = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                lines.lock().unwrap().push(line);
            }
        });
        Demo { child: Some(child), stdout, stderr, printed: Vec::new() }
    }

    /// Reads stdout until the script's last line; returns the script.
    fn script(&mut self) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left) {
                Ok(line) => {
                    let done = line.contains(READY);
                    self.printed.push(line);
                    if done {
                        return self.printed.clone();
                    }
                }
                Err(e) => panic!("the demo printed no complete script ({e:?}):\n{}\nstderr:\n{}", self.printed.join("\n"), self.logs()),
            }
        }
    }

    fn logs(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// SIGTERM, then the exit status (panics if it takes longer than `timeout`).
    fn terminate(&mut self, timeout: Duration) -> (ExitStatus, Duration) {
        let started = Instant::now();
        let ok = Command::new("kill").arg("-TERM").arg(self.pid().to_string()).status().expect("kill").success();
        assert!(ok, "kill -TERM failed");
        let mut child = self.child.take().expect("running");
        loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                // Collect what it printed on the way out.
                while let Ok(line) = self.stdout.recv_timeout(Duration::from_millis(200)) {
                    self.printed.push(line);
                }
                return (status, started.elapsed());
            }
            if started.elapsed() > timeout {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the demo did not exit within {timeout:?} of SIGTERM:\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The command printed under each `# <step>. ...` comment, keyed by step
/// (`1`, `2`, ..., `4b`, `Metrics`): the first line after it that is not a comment.
fn steps(script: &[String]) -> BTreeMap<String, String> {
    let mut steps = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in script {
        if let Some(comment) = line.strip_prefix("# ") {
            let label = comment.split(['.', ':']).next().unwrap_or("");
            if !label.is_empty() && !label.contains(' ') {
                current = Some(label.to_owned());
            }
        } else if !line.trim().is_empty()
            && !line.starts_with('#')
            && let Some(label) = current.take()
        {
            steps.insert(label, line.clone());
        }
    }
    steps
}

/// Runs a printed line through `bash -c`, isolated from the user's curl
/// configuration and proxies; returns stdout.
fn bash(line: &str, home: &Path) -> String {
    let out = Command::new("bash")
        .arg("-c")
        .arg(line)
        .env("CURL_HOME", home)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .env_remove("IDEMGATE_CONFIG")
        .output()
        .expect("run bash");
    assert!(
        out.status.success(),
        "`{line}` failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// What `curl -si` printed.
#[derive(Debug)]
struct CurlResponse {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl CurlResponse {
    fn parse(out: &str) -> CurlResponse {
        let (head, body) = out.split_once("\r\n\r\n").unwrap_or_else(|| panic!("not a curl -si response:\n{out}"));
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let status = status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("no status in {status_line:?}"));
        let headers = lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned())).collect();
        CurlResponse { status, headers, body: body.to_owned() }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("body is not JSON ({e}): {self:?}"))
    }

    fn problem_type(&self) -> String {
        self.json()["type"].as_str().unwrap_or_else(|| panic!("not a problem: {self:?}")).to_owned()
    }
}

fn curl(steps: &BTreeMap<String, String>, step: &str, home: &Path) -> CurlResponse {
    let line = &steps[step];
    assert!(line.starts_with("curl -si "), "step {step} is not a `curl -si` line: {line}");
    CurlResponse::parse(&bash(line, home))
}

/// Step 5's line with this build's binary for `idemgate`.
fn keys_list(steps: &BTreeMap<String, String>, home: &Path) -> String {
    let line = steps["5"].strip_prefix("idemgate ").unwrap_or_else(|| panic!("step 5 is not an idemgate line: {}", steps["5"]));
    assert!(line.contains("keys list") && line.contains("--state unknown"), "step 5: {line}");
    bash(&format!("'{}' {line}", BIN.replace('\'', r"'\''")), home)
}

fn order_count(steps: &BTreeMap<String, String>, home: &Path) -> u64 {
    let out = bash(&steps["6"], home);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("count is not JSON ({e}): {out}"));
    v["count"].as_u64().unwrap_or_else(|| panic!("no count in {v}"))
}

/// Rows of a `keys list` table (header and total line excluded).
fn record_rows(table: &str) -> Vec<&str> {
    table.lines().filter(|l| !l.starts_with("STATE") && !l.ends_with("record(s)") && !l.trim().is_empty()).collect()
}

#[test]
fn printed_script_works_when_pasted_into_bash() {
    if !have("curl") || !have("bash") {
        eprintln!("SKIPPED printed_script_works_when_pasted_into_bash: needs `curl` and `bash` on the PATH");
        return;
    }
    let started = Instant::now();
    let tmp = tempfile::tempdir().expect("tempdir");
    let home = tmp.path().join("curl-home");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::write(home.join(".curlrc"), "max-time = 30\n").unwrap();
    // A space in the path: the printed --config must be quoted for bash.
    let data: PathBuf = tmp.path().join("demo data");
    std::fs::create_dir_all(&data).unwrap();
    let bystander = data.join("notes.txt");
    std::fs::write(&bystander, "not the demo's").unwrap();

    let mut demo = Demo::start(&data);
    let script = demo.script();
    let text = script.join("\n");
    let steps = steps(&script);
    for step in ["1", "2", "3", "4", "4b", "5", "6", "7", "Metrics"] {
        assert!(steps.contains_key(step), "step {step} missing from the script:\n{text}");
    }
    assert!(!text.contains(":0/") && !text.contains(":0 "), "port 0 leaked into the script:\n{text}");
    assert!(text.contains("demo-key"), "the API key is printed:\n{text}");
    let config_path = data.join("idemgate.toml");
    let config = std::fs::read_to_string(&config_path).expect("the demo writes its config");
    assert!(!config.contains("demo-key"), "the config holds only the key's sha256:\n{config}");
    assert!(!config.contains(":0\""), "the config names the bound ports:\n{config}");

    // A second demo on the same directory refuses to start and deletes nothing.
    let other = Command::new(BIN)
        .args(["demo", "--listen", "127.0.0.1:0", "--upstream-listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--data"])
        .arg(&data)
        .output()
        .expect("run a second demo");
    assert_eq!(other.status.code(), Some(1), "a second demo on the same --data must fail: {other:?}");
    assert!(String::from_utf8_lossy(&other.stderr).contains("in use"), "{}", String::from_utf8_lossy(&other.stderr));
    assert!(config_path.exists(), "the running demo's config survived");

    // 1. First request: forwarded, order created.
    let first = curl(&steps, "1", &home);
    assert_eq!(first.status, 201, "step 1: {first:?}\n{}", demo.logs());
    assert_eq!(first.header("idempotent-replayed"), None, "{first:?}");
    assert_eq!(first.json()["id"], 1, "{first:?}");
    assert_eq!(first.header("location"), Some("/v1/orders/1"), "{first:?}");

    // 2. The same again: replayed, same body.
    let again = curl(&steps, "2", &home);
    assert_eq!(again.status, 201, "step 2: {again:?}");
    assert_eq!(again.header("idempotent-replayed"), Some("true"), "step 2: {again:?}");
    assert_eq!(again.body, first.body, "step 2 replays the recorded body");

    // 3. Same key, changed body.
    let changed = curl(&steps, "3", &home);
    assert_eq!(changed.status, 409, "step 3: {changed:?}");
    assert_eq!(changed.problem_type(), "urn:idemgate:problem:idempotency-key-reused");

    // 4. The slow endpoint outlives the upstream timeout; the retry stays unknown.
    let slow = curl(&steps, "4", &home);
    assert_eq!(slow.status, 504, "step 4: {slow:?}");
    assert_eq!(slow.problem_type(), "urn:idemgate:problem:outcome-unknown");
    let retry = curl(&steps, "4b", &home);
    assert_eq!(retry.status, 409, "step 4b: {retry:?}");
    assert_eq!(retry.problem_type(), "urn:idemgate:problem:outcome-unknown");

    // 5. The operator's view: exactly the one unknown record.
    let table = keys_list(&steps, &home);
    let rows = record_rows(&table);
    assert_eq!(rows.len(), 1, "step 5 lists exactly one record:\n{table}");
    assert!(rows[0].starts_with("unknown") && rows[0].contains("create_order_slow") && rows[0].contains("order-2"), "{table}");

    // 6. The order service created the first order and, after its sleep, the slow one: 2.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut count = order_count(&steps, &home);
    while count < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        count = order_count(&steps, &home);
    }
    assert_eq!(count, 2, "step 6: the order service created exactly 2 orders");

    // 7. The admin API, enabled with the token the demo printed: the same unknown record.
    let admin = &steps["7"];
    assert!(admin.contains("/admin/records?state=unknown") && admin.contains("Authorization: Bearer "), "step 7: {admin}");
    let token = admin.split("Authorization: Bearer ").nth(1).and_then(|t| t.split('\'').next()).unwrap_or_default();
    assert!(token.len() >= 32, "a printed token: {admin}");
    assert!(!config.contains(token), "the config does not hold the token itself:\n{config}");
    let out = bash(admin, &home);
    let listed: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("step 7 is not JSON ({e}): {out}"));
    let records = listed["records"].as_array().unwrap_or_else(|| panic!("step 7: {listed}"));
    assert_eq!(records.len(), 1, "step 7: {listed}");
    assert_eq!(records[0]["state"], "unknown", "step 7: {listed}");

    // 8. The operator console, at the printed URL, on the admin listener.
    let console = demo.printed.iter().find(|l| l.trim_start().starts_with("console ")).unwrap_or_else(|| panic!("no console line"));
    let url = console.split_whitespace().nth(1).unwrap_or_default().to_owned();
    assert!(url.starts_with("http://") && url.ends_with("/console/"), "{console}");
    assert!(demo.printed.iter().any(|l| l.trim() == format!("#    {url}")), "step 8 names the console");
    let page = bash(&format!("curl -si {url}"), &home);
    assert!(page.starts_with("HTTP/1.1 200") && page.contains("content-security-policy: default-src 'none'"), "{page}");

    let metrics = bash(&steps["Metrics"], &home);
    assert!(metrics.contains(r#"idemgate_requests_total{operation="create_order",outcome="replayed"} 1"#), "{metrics}");

    // Ctrl-C / SIGTERM: a clean exit.
    let (status, took) = demo.terminate(Duration::from_secs(10));
    assert!(status.success(), "exit status after SIGTERM: {status}\n{}", demo.logs());
    assert!(demo.printed.iter().any(|l| l.contains("Demo stopped")), "{}", demo.printed.join("\n"));
    eprintln!("first run: {:?}; SIGTERM to exit: {took:?}", started.elapsed());

    // The store outlives the demo, for `keys list` after it stops.
    let table = keys_list(&steps, &home);
    assert_eq!(record_rows(&table).len(), 1, "after exit:\n{table}");

    // A second start on the same directory begins from an empty store and
    // leaves files that are not the demo's alone.
    let mut demo = Demo::start(&data);
    let steps = self::steps(&demo.script());
    let first = curl(&steps, "1", &home);
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(first.header("idempotent-replayed"), None, "a fresh store: {first:?}");
    assert_eq!(record_rows(&keys_list(&steps, &home)).len(), 0);
    assert!(bystander.exists(), "files that are not the demo's are left alone");
    let (status, _) = demo.terminate(Duration::from_secs(10));
    assert!(status.success(), "exit status after SIGTERM: {status}\n{}", demo.logs());
}
