//! nginx as users install it (Debian's package, scripts/test installs it)
//! at its defaults, as a reverse proxy in front of a local port.
// Real processes: waiting on the wall clock is the point.
#![allow(clippy::disallowed_types)]

use std::time::Duration;

/// nginx at its defaults, proxying to a local port (its own configuration:
/// paths in a temporary directory, nothing else set); stopped when dropped
/// (`nginx -s stop`: its workers outlive a killed master).
pub struct Nginx {
    child: std::process::Child,
    program: &'static str,
    pub port: u16,
    dir: tempfile::TempDir,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let d = self.dir.path().display().to_string();
        let stopped = std::process::Command::new(self.program)
            .args(["-p", &d, "-c", &format!("{d}/nginx.conf"), "-s", "stop"])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !stopped {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Nginx {
    /// What nginx logged (errors, and why it refused a request).
    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }

    /// `None` when nginx is missing and not required (scripts/test installs it).
    pub fn start(to: u16) -> Option<Nginx> {
        Nginx::start_with(to, |_| (String::new(), String::new()))
    }

    /// nginx terminating TLS with `cert` (HTTP/2 and HTTP/1.1 by ALPN, TLS
    /// 1.2 and 1.3 as its defaults allow), proxying to a local port;
    /// everything else at its defaults (`keepalive_requests 1000` among
    /// them). With `client_ca`, clients must present a certificate issued by
    /// that CA (`ssl_verify_client on`).
    pub fn start_https(to: u16, cert: &super::tls::Issued, client_ca: Option<&std::path::Path>) -> Option<Nginx> {
        let (cert, key) = (cert.cert_file.display().to_string(), cert.key_file.display().to_string());
        let client_ca = client_ca.map(|p| p.display().to_string());
        Nginx::start_with(to, move |program| {
            // `http2 on;` came with nginx 1.25.1; before it, a `listen` parameter.
            let (listen, http2) = if version_at_least(program, (1, 25, 1)) { (" ssl", "    http2 on;\n") } else { (" ssl http2", "") };
            let mut server = format!("{http2}    ssl_certificate {cert};\n    ssl_certificate_key {key};\n");
            if let Some(ca) = &client_ca {
                server.push_str(&format!("    ssl_client_certificate {ca};\n    ssl_verify_client on;\n"));
            }
            (listen.to_owned(), server)
        })
    }

    /// `configure` gets the program and gives the `listen` directive's extra
    /// parameters and extra lines for the `server` block.
    fn start_with(to: u16, configure: impl FnOnce(&str) -> (String, String)) -> Option<Nginx> {
        use std::process::{Command, Stdio};
        let program = if std::path::Path::new("/usr/sbin/nginx").exists() { "/usr/sbin/nginx" } else { "nginx" };
        let mut probe = Command::new(program);
        probe.arg("-v");
        if !super::installed(probe, "nginx") {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let d = dir.path().display();
        let (listen, server) = configure(program);
        let conf = format!(
            "daemon off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log info;\nevents {{}}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fastcgi;\n\
               uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
               server {{\n    listen 127.0.0.1:{port}{listen};\n{server}    location / {{ proxy_pass http://127.0.0.1:{to}; }}\n  }}\n}}\n"
        );
        std::fs::write(dir.path().join("nginx.conf"), conf).unwrap();
        let child = Command::new(program)
            .args(["-p", &d.to_string(), "-c", &format!("{d}/nginx.conf")])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nginx");
        let mut n = Nginx { child, program, port, dir };
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            let exited = n.child.try_wait().ok().flatten();
            if exited.is_some() || std::time::Instant::now() >= deadline {
                let log = std::fs::read_to_string(n.dir.path().join("error.log")).unwrap_or_default();
                panic!("nginx did not listen on {port} ({exited:?}): {log}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(n)
    }
}

/// Whether `program -v` reports at least `version`.
fn version_at_least(program: &str, version: (u32, u32, u32)) -> bool {
    let out = std::process::Command::new(program).arg("-v").output().expect("nginx -v");
    // "nginx version: nginx/1.22.1" (on stderr)
    let text = String::from_utf8_lossy(&out.stderr);
    let found = text.split_once("nginx/").map(|(_, v)| {
        let mut parts = v.split(|c: char| !c.is_ascii_digit()).map(|p| p.parse::<u32>().unwrap_or(0));
        (parts.next().unwrap_or(0), parts.next().unwrap_or(0), parts.next().unwrap_or(0))
    });
    found.is_some_and(|v| v >= version)
}
