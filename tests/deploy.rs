//! What the repository ships for deployment, checked as far as this machine
//! can (it has no container engine, so images are not built here): the
//! image's baked config and the compose replicas' config pass `check-config`
//! with the environment compose gives them; compose, the Prometheus rules and
//! the Grafana dashboard parse and hang together; the Dockerfile keeps the
//! properties the docs promise. (`tests/operating.rs` checks that every
//! metric the rules and the dashboard query exists.)

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
    // tests/hardening.rs for the refusal without it).
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
