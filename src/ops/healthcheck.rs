//! `idemgate healthcheck`: asks a running gateway's admin listener whether it
//! is ready (`/readyz`) or alive (`/healthz`), for container health checks
//! that have no curl. One HTTP/1.1 request on a fresh connection (over TLS
//! when the listener has `[admin.tls]`, trusting exactly its certificate),
//! bounded by a timeout; the verdict is the exit code.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Why a check did not get an answer.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("cannot reach {addr}: {source}")]
    Connect { addr: SocketAddr, source: std::io::Error },
    #[error("no answer from {addr} within {timeout:?}")]
    Timeout { addr: SocketAddr, timeout: Duration },
    #[error("{addr} did not answer with HTTP: {line:?}")]
    NotHttp { addr: SocketAddr, line: String },
    #[error("reading from {addr}: {source}")]
    Io { addr: SocketAddr, source: std::io::Error },
    #[error("TLS with {addr}: {source}")]
    Tls { addr: SocketAddr, source: std::io::Error },
}

/// Where to connect to reach a listener bound to `listen`: a wildcard
/// address (`0.0.0.0`, `[::]`) is reached on loopback.
pub fn local_target(listen: SocketAddr) -> SocketAddr {
    let ip = match listen.ip() {
        IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v6) if v6.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, listen.port())
}

/// `GET path` on `addr`; the status code and the first line of the body.
/// `tls`: the listener's TLS client configuration (see
/// [`crate::tls::client::pinned`]), `None` for plain HTTP.
pub async fn probe(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
    tls: Option<std::sync::Arc<rustls::ClientConfig>>,
) -> Result<(u16, String), CheckError> {
    let exchanged = async {
        let tcp = TcpStream::connect(addr).await.map_err(|source| CheckError::Connect { addr, source })?;
        match tls {
            None => exchange(addr, path, tcp).await,
            Some(config) => {
                let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
                let stream =
                    tokio_rustls::TlsConnector::from(config).connect(name, tcp).await.map_err(|source| CheckError::Tls { addr, source })?;
                exchange(addr, path, stream).await
            }
        }
    };
    match tokio::time::timeout(timeout, exchanged).await {
        Ok(r) => r,
        Err(_) => Err(CheckError::Timeout { addr, timeout }),
    }
}

async fn exchange(
    addr: SocketAddr,
    path: &str,
    mut stream: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
) -> Result<(u16, String), CheckError> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: idemgate-healthcheck\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.map_err(|source| CheckError::Io { addr, source })?;
    // Health answers are a few bytes; read at most 8 KiB until the peer closes.
    let mut buf = Vec::with_capacity(512);
    let mut limited = stream.take(8 * 1024);
    // A TLS peer that closes without close_notify still said what it had to.
    match limited.read_to_end(&mut buf).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !buf.is_empty() => {}
        Err(source) => return Err(CheckError::Io { addr, source }),
    }
    let text = String::from_utf8_lossy(&buf);
    let status_line = text.lines().next().unwrap_or_default();
    let status = status_line
        .strip_prefix("HTTP/1.")
        .and_then(|rest| rest.split_whitespace().nth(1))
        .and_then(|code| code.parse::<u16>().ok())
        .ok_or_else(|| CheckError::NotHttp { addr, line: status_line.chars().take(80).collect() })?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.lines().next().unwrap_or_default().trim().to_owned()).unwrap_or_default();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcard_listeners_are_reached_on_loopback() {
        assert_eq!(local_target("0.0.0.0:9090".parse().unwrap()), "127.0.0.1:9090".parse().unwrap());
        assert_eq!(local_target("[::]:9090".parse().unwrap()), "[::1]:9090".parse().unwrap());
        assert_eq!(local_target("10.1.2.3:9090".parse().unwrap()), "10.1.2.3:9090".parse().unwrap());
    }

    #[tokio::test]
    async fn reads_the_status_and_body() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await.unwrap();
            s.write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 9\r\n\r\ndraining\n").await.unwrap();
        });
        assert_eq!(probe(addr, "/readyz", Duration::from_secs(2), None).await.unwrap(), (503, "draining".to_owned()));
    }

    #[tokio::test]
    async fn a_closed_port_is_an_error() {
        let reserved = tokio::net::TcpSocket::new_v4().unwrap();
        reserved.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = reserved.local_addr().unwrap();
        assert!(matches!(probe(addr, "/readyz", Duration::from_secs(2), None).await, Err(CheckError::Connect { .. })));
    }
}
