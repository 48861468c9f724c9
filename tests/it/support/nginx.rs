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
    /// `None` when nginx is missing and not required (scripts/test installs it).
    pub fn start(to: u16) -> Option<Nginx> {
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
        let conf = format!(
            "daemon off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\nevents {{}}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fastcgi;\n\
               uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
               server {{\n    listen 127.0.0.1:{port};\n    location / {{ proxy_pass http://127.0.0.1:{to}; }}\n  }}\n}}\n"
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
