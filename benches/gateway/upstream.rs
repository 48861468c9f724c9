//! The fast upstream: a tiny hyper server answering every request with 201
//! and a small JSON body. It runs in its own process (the bench binary started
//! again with `--upstream ADDR`), so it never shares the measuring process.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::cpu::Cpu;
use crate::procs::Service;

const BODY: &[u8] = br#"{"id":"ord_123","status":"created"}"#;
const READY_LINE: &str = "upstream listening on ";
const EXECUTED_PATH: &str = "/_executed";

/// `--upstream ADDR [--capacity N --service-ms M]`: serves until killed.
/// With a capacity, it serves N requests at a time, M ms each, and queues the
/// rest (a service that can be overloaded: benches/gateway/overload.rs);
/// `GET /_executed` answers how many it has executed.
pub fn serve(addr: &str, capacity: Option<(usize, Duration)>) -> Result<()> {
    let addr: SocketAddr = addr.parse().with_context(|| format!("--upstream: invalid address {addr:?}"))?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the upstream runtime")?;
    rt.block_on(accept_loop(addr, capacity))
}

/// A capacity and what was executed under it.
struct Capacity {
    workers: Semaphore,
    service: Duration,
    executed: AtomicU64,
}

async fn accept_loop(addr: SocketAddr, capacity: Option<(usize, Duration)>) -> Result<()> {
    let listener = TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
    println!("{READY_LINE}{}", listener.local_addr()?);
    let capacity = capacity.map(|(n, service)| Arc::new(Capacity { workers: Semaphore::new(n), service, executed: AtomicU64::new(0) }));
    loop {
        let sock = match listener.accept().await {
            Ok((sock, _)) => sock,
            Err(e) => {
                eprintln!("upstream: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let _ = sock.set_nodelay(true);
        let capacity = capacity.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| answer(req, capacity.clone()));
            let conn = http1::Builder::new().keep_alive(true).serve_connection(TokioIo::new(sock), svc);
            let _ = conn.await;
        });
    }
}

async fn answer(req: Request<Incoming>, capacity: Option<Arc<Capacity>>) -> Result<Response<Full<Bytes>>, Infallible> {
    if let Some(c) = &capacity {
        if req.uri().path() == EXECUTED_PATH {
            return Ok(Response::new(Full::new(Bytes::from(c.executed.load(Ordering::Relaxed).to_string()))));
        }
        let _worker = c.workers.acquire().await;
        c.executed.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(c.service).await;
    }
    // Read the request whole, as a real service would.
    let _ = req.into_body().collect().await;
    let mut resp = Response::new(Full::new(Bytes::from_static(BODY)));
    *resp.status_mut() = StatusCode::CREATED;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Ok(resp)
}

/// The upstream process, started from the bench.
pub struct Upstream {
    pub addr: SocketAddr,
    service: Service,
}

impl Upstream {
    pub fn start(dir: &Path) -> Result<Upstream> {
        Upstream::spawn(dir, "upstream", &[])
    }

    /// An upstream serving `n` requests at a time, `service` each.
    pub fn with_capacity(dir: &Path, name: &str, n: usize, service: Duration) -> Result<Upstream> {
        Upstream::spawn(dir, name, &["--capacity".into(), n.to_string(), "--service-ms".into(), service.as_millis().to_string()])
    }

    fn spawn(dir: &Path, name: &str, extra: &[String]) -> Result<Upstream> {
        let exe = std::env::current_exe().context("locating the bench executable")?;
        let mut args: Vec<&std::ffi::OsStr> = vec!["--upstream".as_ref(), "127.0.0.1:0".as_ref()];
        args.extend(extra.iter().map(std::ffi::OsStr::new));
        let service = Service::spawn(name, &dir.join(format!("{name}.log")), &exe, &args, &[])?;
        let addr = service.wait_for_log("its address", Duration::from_secs(10), |line| {
            line.strip_prefix(READY_LINE).and_then(|a| a.trim().parse().ok())
        })?;
        Ok(Upstream { addr, service })
    }

    pub fn cpu(&self) -> Cpu {
        Cpu::Pid(self.service.pid())
    }

    /// Requests executed so far (an upstream with a capacity).
    pub fn executed(&self) -> Result<u64> {
        let resp = crate::client::get(self.addr, EXECUTED_PATH).context("asking the upstream what it executed")?;
        resp.text().trim().parse().context("the upstream's count")
    }
}
