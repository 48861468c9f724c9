//! The fast upstream: a tiny hyper server answering every request with 201
//! and a small JSON body. It runs in its own process (the bench binary started
//! again with `--upstream ADDR`), so it never shares the measuring process.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
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

use crate::cpu::Cpu;
use crate::procs::Service;

const BODY: &[u8] = br#"{"id":"ord_123","status":"created"}"#;
const READY_LINE: &str = "upstream listening on ";

/// `--upstream ADDR`: serves until killed.
pub fn serve(addr: &str) -> Result<()> {
    let addr: SocketAddr = addr.parse().with_context(|| format!("--upstream: invalid address {addr:?}"))?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the upstream runtime")?;
    rt.block_on(accept_loop(addr))
}

async fn accept_loop(addr: SocketAddr) -> Result<()> {
    let listener = TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
    println!("{READY_LINE}{}", listener.local_addr()?);
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
        tokio::spawn(async move {
            let conn = http1::Builder::new().keep_alive(true).serve_connection(TokioIo::new(sock), service_fn(answer));
            let _ = conn.await;
        });
    }
}

async fn answer(req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
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
        let exe = std::env::current_exe().context("locating the bench executable")?;
        let args = ["--upstream".as_ref(), "127.0.0.1:0".as_ref()];
        let service = Service::spawn("upstream", &dir.join("upstream.log"), &exe, &args, &[])?;
        let addr = service.wait_for_log("its address", Duration::from_secs(10), |line| {
            line.strip_prefix(READY_LINE).and_then(|a| a.trim().parse().ok())
        })?;
        Ok(Upstream { addr, service })
    }

    pub fn cpu(&self) -> Cpu {
        Cpu::Pid(self.service.pid())
    }
}
