//! An upstream with a fixed capacity, as real services have: it serves
//! `capacity` requests at a time, each taking `service`, and queues the rest
//! (first come, first served) for as long as their clients wait. Every
//! request it starts serving is one execution, counted under its
//! `Idempotency-Key` when it starts: a request whose client gave up while it
//! was being served still executed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

pub struct OverloadedUpstream {
    pub addr: SocketAddr,
    executions: Arc<Mutex<HashMap<String, u64>>>,
    stop: CancellationToken,
}

impl Drop for OverloadedUpstream {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl OverloadedUpstream {
    pub async fn start(capacity: usize, service: Duration) -> OverloadedUpstream {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let executions: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
        let stop = CancellationToken::new();
        let workers = Arc::new(Semaphore::new(capacity));
        let (ex, st) = (executions.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let conn = tokio::select! {
                    _ = st.cancelled() => return,
                    c = listener.accept() => c,
                };
                let Ok((tcp, _)) = conn else { continue };
                let (ex, workers) = (ex.clone(), workers.clone());
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let (ex, workers) = (ex.clone(), workers.clone());
                        async move {
                            let key = req.headers().get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
                            let _worker = workers.acquire_owned().await.expect("semaphore");
                            *ex.lock().unwrap().entry(key).or_default() += 1;
                            tokio::time::sleep(service).await;
                            let mut resp = Response::new(Full::new(Bytes::from_static(b"{\"id\":1}")));
                            *resp.status_mut() = StatusCode::CREATED;
                            Ok::<_, std::convert::Infallible>(resp)
                        }
                    });
                    let _ = http1::Builder::new().serve_connection(TokioIo::new(tcp), svc).await;
                });
            }
        });
        OverloadedUpstream { addr, executions, stop }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Executions in all.
    pub fn executed(&self) -> u64 {
        self.executions.lock().unwrap().values().sum()
    }

    /// Executions per forwarded key.
    pub fn executions(&self) -> HashMap<String, u64> {
        self.executions.lock().unwrap().clone()
    }
}
