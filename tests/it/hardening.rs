//! Insecure settings, through the real binary: `check-config` warns about
//! each one with its TOML path, the risk and the item of the "Hardening"
//! checklist in docs/operations.md (exit 0; `--strict` makes them errors,
//! exit 1); `serve` logs the same warnings when it starts; and the container
//! image's baked configuration refuses to start until the operator provides
//! an API key of their own.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use support::*;

const BIN: &str = env!("CARGO_BIN_EXE_idemgate");

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn run(args: &[&str], config: &Path, env: &[(&str, &str)]) -> Output {
    Command::new(BIN)
        .args(args)
        .arg("--config")
        .arg(config)
        .env_clear()
        .env("IDEMGATE_LOG", "warn")
        .envs(env.iter().copied())
        .current_dir(std::env::temp_dir())
        .output()
        .expect("run idemgate")
}

/// `serve`, which must refuse to start: killed (and the test failed) if it
/// is still running after a while.
fn serve_refused(config: &Path, env: &[(&str, &str)]) -> Output {
    let mut child = Command::new(BIN)
        .arg("serve")
        .arg("--config")
        .arg(config)
        .env_clear()
        .env("IDEMGATE_LOG", "warn")
        .envs(env.iter().copied())
        .current_dir(std::env::temp_dir())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run idemgate");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while child.try_wait().expect("try_wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("wait");
            panic!("serve started instead of refusing:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().expect("wait")
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// A file with `text`, readable by everyone (as a default umask leaves it).
fn world_readable(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
}

/// Everything the reviews found, in one file.
fn insecure(dir: &Path) -> String {
    let secret = dir.join("admin-token");
    world_readable(&secret, "x\n");
    world_readable(&dir.join("hs256-secret"), &format!("{}\n", "h".repeat(40)));
    world_readable(&dir.join("derived-key-secret"), &format!("{}\n", "d".repeat(40)));
    let pki = support::tls::Pki::new("hardening CA");
    let cert = pki.server(support::tls::Alg::EcdsaP256);
    // Copied: the PKI's own directory goes with it.
    let (ca, cert_file, key_file) = (dir.join("client-ca.pem"), dir.join("server.crt"), dir.join("server.key"));
    std::fs::copy(&pki.ca_file, &ca).unwrap();
    std::fs::copy(&cert.cert_file, &cert_file).unwrap();
    std::fs::copy(&cert.key_file, &key_file).unwrap();
    format!(
        r#"[server]
derived_key_secret_file = "{dir}/derived-key-secret"

[server.tls]
cert_file = "{cert_file}"
key_file = "{key_file}"
client_ca_file = "{ca}"
client_auth = "optional"

[store]
kind = "postgres"
url = "postgres://idemgate:hunter2@db.internal:5432/idemgate?sslmode=disable"

[admin]
listen = "0.0.0.0:9090"
token_file = "{secret}"

[[upstreams]]
name = "orders"
url = "http://127.0.0.1:9"

[[identity.sources]]
kind = "trusted_header"
tenant_header = "x-tenant-id"
principal_header = "x-principal-id"
trusted_peers = ["10.0.0.0/8", "0.0.0.0/0", "::/0"]

[[identity.sources]]
kind = "jwt"
algorithms = ["HS256"]
secret_env = "HS_SECRET"

[[identity.sources]]
kind = "jwt"
jwks_url = "http://idp.internal/.well-known/jwks.json"
issuer = "https://idp.example"
audience = "orders-api"

[[identity.sources]]
kind = "jwt"
algorithms = ["HS256"]
secret_file = "{dir}/hs256-secret"
issuer = "https://idp.example"
audience = "orders-api"
leeway = "1d"

[[identity.sources]]
kind = "mtls"
tenant_from = "san_dns"
tenant_regex = "acme-(\\w+)"
principal_from = "subject_cn"

[[identity.sources]]
kind = "api_key"
keys = [ {{ sha256 = "22a60ff8c666ee7f81ede927b1adfb38922412b0bbd7162b99525a22607f603b", tenant = "acme", principal = "billing" }} ]

[[routes]]
operation = "create_order"
method = "POST"
path = "/v1/orders"
upstream = "orders"
forward_key = "client"
"#,
        secret = secret.display(),
        dir = dir.display(),
        cert_file = cert_file.display(),
        key_file = key_file.display(),
        ca = ca.display(),
    )
}

/// (TOML path, a word of the risk) for each warning `insecure` must give.
const EXPECTED: [(&str, &str); 17] = [
    ("store.url", "sslmode=disable"),
    ("store.url", "written in the configuration file"),
    ("admin.token_file", "1 byte"),
    ("admin.token_file", "readable by its group or by others"),
    ("admin.listen", "without [admin.tls]"),
    ("server.derived_key_secret_file", "readable by its group or by others"),
    ("identity.sources[3].secret_file", "readable by its group or by others"),
    ("identity.sources[3].leeway", "1day"),
    ("identity.sources[4].tenant_regex", "not anchored"),
    ("routes[0].forward_key", "own key"),
    ("identity.sources[0].trusted_peers[1]", "0.0.0.0/0"),
    ("identity.sources[0].trusted_peers[2]", "::/0"),
    ("identity.sources[1].secret_env", "3 byte"),
    ("identity.sources[1].issuer", "issuer"),
    ("identity.sources[1].audience", "audience"),
    ("identity.sources[2].jwks_url", "http://"),
    // config/idemgate.toml's key, `example-key-change-me`.
    ("identity.sources[5].keys[0].sha256", "example-key-change-me"),
];

/// The "Hardening" items of docs/operations.md (its `###` headings).
fn hardening_items() -> Vec<String> {
    let doc = std::fs::read_to_string(root().join("docs/operations.md")).unwrap();
    let section = doc.split("\n## Hardening\n").nth(1).expect("docs/operations.md has a \"## Hardening\" section");
    let section = section.split("\n## ").next().unwrap();
    section.lines().filter_map(|l| l.strip_prefix("### ")).map(str::to_owned).collect()
}

fn assert_warnings(file: &Path, stderr: &str) {
    let items = hardening_items();
    let name = file.display().to_string();
    for (path, risk) in EXPECTED {
        let line = stderr
            .lines()
            .find(|l| l.starts_with(&format!("{name}: {path}: warning: ")) && l.contains(risk))
            .unwrap_or_else(|| panic!("no warning about {path} ({risk}) in:\n{stderr}"));
        let item = line.split("(Hardening: ").nth(1).and_then(|r| r.strip_suffix(')')).unwrap_or_else(|| panic!("no pointer: {line}"));
        assert!(line.contains("docs/operations.md"), "{line}");
        assert!(items.iter().any(|i| i == item), "{item:?} is not an item of the Hardening checklist {items:?}");
    }
    assert!(!stderr.contains("hunter2"), "the password is never printed: {stderr}");
}

#[test]
fn check_config_warns_about_each_insecure_setting_and_strict_makes_them_errors() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("insecure.toml");
    std::fs::write(&file, insecure(dir.path())).unwrap();
    let env = [("HS_SECRET", "abc")];

    let out = run(&["check-config"], &file, &env);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "warnings alone do not fail:\n{stdout}{stderr}");
    assert_warnings(&file, &stderr);
    assert!(stdout.contains(&format!(": ok (1 route(s), 1 upstream(s), {} warning(s))", EXPECTED.len())), "{stdout}");

    let out = run(&["check-config", "--strict"], &file, &env);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "--strict: warnings are errors:\n{stdout}{stderr}");
    assert_warnings(&file, &stderr);
    assert!(stderr.contains(&format!("{} warning(s) (--strict)", EXPECTED.len())), "{stderr}");
    assert!(!stdout.contains(": ok"), "{stdout}");
}

/// Each warning is one setting: fixing them leaves a file `--strict` accepts.
#[test]
fn the_same_file_hardened_has_no_warnings() {
    let dir = tempfile::tempdir().unwrap();
    let fixed = insecure(dir.path())
        .replace("url = \"postgres://idemgate:hunter2@db.internal:5432/idemgate?sslmode=disable\"", "url_env = \"DB_URL\"")
        .replace(", \"0.0.0.0/0\", \"::/0\"", "")
        .replace("secret_env = \"HS_SECRET\"", "secret_env = \"HS_SECRET\"\nissuer = \"https://idp.example\"\naudience = \"orders-api\"")
        .replace("http://idp.internal", "https://idp.internal")
        .replace("22a60ff8c666ee7f81ede927b1adfb38922412b0bbd7162b99525a22607f603b", &"5".repeat(64));
    let fixed = fixed
        .replace("listen = \"0.0.0.0:9090\"", "listen = \"127.0.0.1:9090\"")
        .replace("leeway = \"1d\"", "leeway = \"30s\"")
        .replace("tenant_regex = \"acme-(\\\\w+)\"", "tenant_regex = \"^acme-(\\\\w+)$\"")
        .replace("forward_key = \"client\"\n", "");
    std::fs::write(dir.path().join("admin-token"), "0123456789abcdef0123456789abcdef\n").unwrap();
    for secret in ["admin-token", "hs256-secret", "derived-key-secret"] {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path().join(secret), std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let file = dir.path().join("fixed.toml");
    std::fs::write(&file, fixed).unwrap();
    let long = "s".repeat(32);
    let env = [("HS_SECRET", long.as_str()), ("DB_URL", "postgres://idemgate:hunter2@db.internal:5432/idemgate?sslmode=require")];
    let out = run(&["check-config", "--strict"], &file, &env);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(!stderr.contains("warning"), "{stderr}");
    assert!(stdout.contains(": ok (1 route(s), 1 upstream(s))"), "{stdout}");
}

/// A password in the database URL with no `sslmode` (libpq's `prefer`) is
/// only worth a warning when the host is not this machine.
#[test]
fn a_password_without_sslmode_is_a_warning_only_off_this_host() {
    let dir = tempfile::tempdir().unwrap();
    let base = "[store]\nkind = \"postgres\"\nurl_env = \"DB_URL\"\n[server]\ndefault_upstream = \"u\"\n[[upstreams]]\nname = \"u\"\nurl = \"http://127.0.0.1:9\"\n";
    let file = dir.path().join("db.toml");
    std::fs::write(&file, base).unwrap();
    for (url, warned) in [
        ("postgres://u:pw@db.internal:5432/x", true),
        ("postgres://u:pw@127.0.0.1:5432/x", false),
        ("postgres://u:pw@localhost/x", false),
        ("postgres://u@db.internal:5432/x", false),
        ("host=db.internal user=u password=pw dbname=x", true),
        ("postgres://u:pw@db.internal:5432/x?sslmode=require", false),
    ] {
        let out = run(&["check-config"], &file, &[("DB_URL", url)]);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(0), "{url}: {stdout}{stderr}");
        assert_eq!(stderr.contains("store.url_env: warning:"), warned, "{url}: {stderr}");
        assert!(!stderr.contains("pw@"), "{stderr}");
    }
}

/// `serve` logs each warning when it starts (and still starts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_logs_the_warnings_at_start() {
    let up = TestUpstream::start().await;
    let token = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(token.path(), "short").unwrap();
    let gw = Gateway::start(
        GatewayConfig::new(sqlite_backend(), up.url())
            .admin(&format!("token_file = \"{}\"", token.path().display()))
            .identity(
                "[[identity.sources]]\nkind = \"trusted_header\"\ntenant_header = \"x-tenant-id\"\nprincipal_header = \"x-principal-id\"\ntrusted_peers = [\"0.0.0.0/0\"]\n",
            ),
    );
    let logs = gw.logs();
    let warned = |path: &str| {
        logs.lines().any(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .is_ok_and(|v| v["level"] == "WARN" && v["path"] == path && v["hardening"].is_string())
        })
    };
    assert!(warned("admin.token_file"), "{logs}");
    assert!(warned("identity.sources[0].trusted_peers[0]"), "{logs}");
    let r = send("POST", &gw.url("/v1/orders"), &[("x-tenant-id", "t"), ("x-principal-id", "p"), ("idempotency-key", "k")], "{}")
        .await
        .unwrap();
    assert_eq!(r.status, 201, "it serves all the same");
}

/// The image's baked configuration lists no key anyone knows: without the
/// operator's key hash in the environment `serve` refuses to start, naming
/// the variable; with it, the file passes `check-config --strict`.
#[test]
fn the_images_baked_config_refuses_to_start_without_an_operators_key() {
    let config = root().join("config/docker.toml");
    let out = serve_refused(&config, &[]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stderr.contains("IDEMGATE_API_KEY_SHA256"), "the message names what to set: {stderr}");
    assert!(stderr.contains("sha256sum"), "and how to make it: {stderr}");

    let hash = "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8";
    let out = run(&["check-config", "--strict"], &config, &[("IDEMGATE_API_KEY_SHA256", hash)]);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    let text = std::fs::read_to_string(&config).unwrap();
    for published in ["22a60ff8c666ee7f81ede927b1adfb38922412b0bbd7162b99525a22607f603b", "example-key-change-me"] {
        assert!(!text.contains(published), "the baked config still lists a published key");
    }
}

/// PostgreSQL with `ssl = on`. No `sslmode` (libpq's default, `prefer`):
/// the gateway's sessions are encrypted, as libpq's would be. `PGSSLMODE`
/// and `PGSSLROOTCERT` apply when the string has no `sslmode` (a server
/// certificate of another CA is then refused), and the string's own
/// `sslmode` wins over them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_prefer_uses_tls_when_offered_and_pgsslmode_is_honoured() {
    use support::tls::{Alg, Pki};
    let pki = Pki::new("database CA");
    let stranger = Pki::new("stranger CA");
    let cert = pki.server(Alg::EcdsaP256);
    let pg = support::postgres::PgServer::start_with_ssl(&cert.cert_pem, &cert.key_pem).expect("a PostgreSQL cluster with ssl = on");
    let plain = pg.create_database("prefer_store").unwrap();
    assert!(!plain.contains("sslmode"), "{plain}");

    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(Backend::Postgres { url: plain.clone() }, up.url()));
    assert_eq!(post(&gw.url("/v1/orders"), "k-prefer", r#"{"a":1}"#, &[]).await.status, 201);
    let sessions = pg
        .simple_query(
            "prefer_store",
            "SELECT coalesce(s.ssl, false)::text, count(*)::text FROM pg_stat_activity a LEFT JOIN pg_stat_ssl s USING (pid) \
             WHERE a.application_name = 'idemgate' GROUP BY 1 ORDER BY 1",
        )
        .unwrap();
    let count = |ssl: &str| -> u64 {
        sessions.iter().find(|r| r[0].as_deref() == Some(ssl)).and_then(|r| r[1].as_deref()?.parse().ok()).unwrap_or(0)
    };
    assert!(count("true") >= 1 && count("false") == 0, "every gateway session is encrypted: {sessions:?}");
    drop(gw);

    // `check-config --connect` reaches the store as `serve` does.
    let dir = tempfile::tempdir().unwrap();
    let connect = |url: &str, env: &[(&str, &str)]| {
        let file = dir.path().join("pg.toml");
        std::fs::write(
            &file,
            format!(
                "[store]\nkind = \"postgres\"\nurl_env = \"DB_URL\"\n[server]\ndefault_upstream = \"u\"\n[[upstreams]]\nname = \"u\"\nurl = \"{}\"\n",
                up.url()
            ),
        )
        .unwrap();
        let mut all = vec![("DB_URL", url)];
        all.extend_from_slice(env);
        let out = run(&["check-config", "--connect"], &file, &all);
        let (stdout, stderr) = text(&out);
        (out.status.code(), format!("{stdout}{stderr}"))
    };
    let (ours, theirs) = (pki.ca_file.display().to_string(), stranger.ca_file.display().to_string());
    let (code, out) = connect(&plain, &[("PGSSLMODE", "verify-full"), ("PGSSLROOTCERT", &theirs)]);
    assert_eq!(code, Some(1), "PGSSLMODE=verify-full refuses a certificate of another CA: {out}");
    let (code, out) = connect(&plain, &[("PGSSLMODE", "verify-full"), ("PGSSLROOTCERT", &ours)]);
    assert_eq!(code, Some(0), "{out}");
    // (With PGSSLROOTCERT set, `require` would verify the chain, as in libpq.)
    let (code, out) = connect(&format!("{plain}?sslmode=require"), &[("PGSSLMODE", "verify-full")]);
    assert_eq!(code, Some(0), "the string's own sslmode wins: {out}");
    let (code, out) = connect(&plain, &[("PGSSLMODE", "allow")]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("verify-full") && out.contains("PGSSLMODE"), "the refusal names the modes and where the mode came from: {out}");
}
