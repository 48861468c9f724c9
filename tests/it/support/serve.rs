//! The one accept loop of the tests' own HTTP servers (the counting
//! upstream, the webhook receiver, the authorizer, the JWKS server): serves
//! HTTP/1 with `handler` until `stop` is cancelled.

use std::future::Future;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub fn spawn<H, F, E>(listener: TcpListener, stop: CancellationToken, handler: H)
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Result<Response<Full<Bytes>>, E>> + Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
{
    tokio::spawn(async move {
        loop {
            let (sock, _) = tokio::select! {
                _ = stop.cancelled() => return,
                a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
            };
            let (handler, stop) = (handler.clone(), stop.clone());
            tokio::spawn(async move {
                let conn = http1::Builder::new().serve_connection(TokioIo::new(sock), service_fn(handler));
                tokio::select! { _ = conn => {}, _ = stop.cancelled() => {} }
            });
        }
    });
}
