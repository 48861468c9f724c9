//! nginx as a plain reverse proxy to the upstream: a private instance with its
//! own config, pid and log files in the run directory (never the system
//! service), 2 workers, upstream keep-alive.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::cpu::Cpu;
use crate::procs::{self, Service};

const PORT_ATTEMPTS: usize = 4;

pub struct Nginx {
    pub addr: SocketAddr,
    service: Service,
}

impl Nginx {
    pub fn start(binary: &Path, dir: &Path, upstream: SocketAddr) -> Result<Nginx> {
        Nginx::start_in(binary, &dir.join("nginx"), upstream, None)
    }

    /// Terminating TLS (HTTP/1.1 only) with `(certificate, key)` PEM files
    /// (tls.rs), in its own prefix `dir/nginx-tls`.
    pub fn start_tls(binary: &Path, dir: &Path, upstream: SocketAddr, tls: (&Path, &Path)) -> Result<Nginx> {
        Nginx::start_in(binary, &dir.join("nginx-tls"), upstream, Some(tls))
    }

    fn start_in(binary: &Path, prefix: &Path, upstream: SocketAddr, tls: Option<(&Path, &Path)>) -> Result<Nginx> {
        std::fs::create_dir_all(prefix.join("tmp")).with_context(|| format!("creating {}", prefix.display()))?;
        let mut last = None;
        for _ in 0..PORT_ATTEMPTS {
            match start_on_free_port(binary, prefix, upstream, tls) {
                Ok(nginx) => return Ok(nginx),
                Err(e) => last = Some(e),
            }
            procs::check_interrupted()?;
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("nginx did not start")))
    }
}

impl Nginx {
    /// Master and workers (the service's process group).
    pub fn cpu(&self) -> Cpu {
        Cpu::Group(self.service.group())
    }
}

fn start_on_free_port(binary: &Path, prefix: &Path, upstream: SocketAddr, tls: Option<(&Path, &Path)>) -> Result<Nginx> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?));
    let conf = prefix.join("nginx.conf");
    std::fs::write(&conf, config(prefix, addr, upstream, tls)).with_context(|| format!("writing {}", conf.display()))?;
    let error_log = prefix.join("error.log");
    let args = ["-p".as_ref(), prefix.as_os_str(), "-c".as_ref(), conf.as_os_str(), "-e".as_ref(), error_log.as_os_str()];
    let service = Service::spawn("nginx", &prefix.join("nginx.out"), binary, &args, &[])?;
    wait_listening(&service, addr, &error_log)?;
    Ok(Nginx { addr, service })
}

fn wait_listening(service: &Service, addr: SocketAddr, error_log: &Path) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        procs::check_interrupted()?;
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if !service.alive() || Instant::now() > deadline {
            bail!(
                "nginx did not listen on {addr}; error log:\n{}\n{}",
                procs::tail(&procs::read_lossy(error_log), 20),
                service.log_tail(20)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("probing for a free port")?;
    Ok(l.local_addr()?.port())
}

fn config(prefix: &Path, listen: SocketAddr, upstream: SocketAddr, tls: Option<(&Path, &Path)>) -> String {
    let p = prefix.display();
    // TLS: the same certificate as the gateway, HTTP/1.1 only (no `http2` on
    // the listen line; wrk speaks no h2; `http2 off` needs nginx >= 1.25.1).
    let listen = match tls {
        None => format!("{listen}"),
        Some((cert, key)) => format!(
            "{listen} ssl;\n        ssl_certificate {};\n        ssl_certificate_key {};\n        \
             ssl_session_cache shared:bench:10m",
            cert.display(),
            key.display()
        ),
    };
    format!(
        r#"# Private nginx for the idemgate benchmark: a plain reverse proxy.
daemon off;
master_process on;
worker_processes 2;
pid {p}/nginx.pid;
error_log {p}/error.log warn;

events {{
    worker_connections 4096;
}}

http {{
    access_log off;
    client_body_temp_path {p}/tmp/body;
    proxy_temp_path {p}/tmp/proxy;
    fastcgi_temp_path {p}/tmp/fastcgi;
    uwsgi_temp_path {p}/tmp/uwsgi;
    scgi_temp_path {p}/tmp/scgi;

    upstream app {{
        server {upstream};
        keepalive 128;
    }}

    server {{
        listen {listen};
        location / {{
            proxy_pass http://app;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
"#
    )
}
