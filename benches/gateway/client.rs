//! A minimal blocking HTTP/1.1 client (keep-alive, Content-Length or chunked
//! bodies): enough to pre-populate keys, scrape metrics and hold idle
//! connections from the bench process without a runtime.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, bail};

const IO_TIMEOUT: Duration = Duration::from_secs(30);

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// One keep-alive connection.
pub struct Conn {
    reader: BufReader<TcpStream>,
    addr: SocketAddr,
}

impl Conn {
    pub fn open(addr: SocketAddr) -> Result<Conn> {
        let stream = TcpStream::connect_timeout(&addr, IO_TIMEOUT).with_context(|| format!("connecting to {addr}"))?;
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        stream.set_nodelay(true)?;
        Ok(Conn { reader: BufReader::new(stream), addr })
    }

    pub fn request(&mut self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Result<Response> {
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\n", self.addr, body.len());
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let stream = self.reader.get_mut();
        stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(body)).with_context(|| format!("sending {method} {path}"))?;
        self.read_response().with_context(|| format!("reading the answer to {method} {path} from {}", self.addr))
    }

    fn read_response(&mut self) -> Result<Response> {
        let status_line = self.line()?;
        let status = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("malformed status line {status_line:?}"))?;
        let mut headers = Vec::new();
        loop {
            let line = self.line()?;
            if line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                headers.push((k.trim().to_owned(), v.trim().to_owned()));
            }
        }
        let mut resp = Response { status, headers, body: Vec::new() };
        resp.body = if resp.header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
            self.chunked()?
        } else {
            let len: usize = resp.header("content-length").map(str::parse).transpose()?.unwrap_or(0);
            let mut body = vec![0; len];
            self.reader.read_exact(&mut body)?;
            body
        };
        Ok(resp)
    }

    fn chunked(&mut self) -> Result<Vec<u8>> {
        let mut body = Vec::new();
        loop {
            let size_line = self.line()?;
            let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("").trim(), 16)
                .with_context(|| format!("malformed chunk size {size_line:?}"))?;
            if size == 0 {
                while !self.line()?.is_empty() {}
                return Ok(body);
            }
            let start = body.len();
            body.resize(start + size, 0);
            self.reader.read_exact(&mut body[start..])?;
            self.line()?;
        }
    }

    fn line(&mut self) -> Result<String> {
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            bail!("connection closed");
        }
        Ok(line.trim_end_matches(['\r', '\n']).to_owned())
    }
}

/// `GET path` on a fresh connection.
pub fn get(addr: SocketAddr, path: &str) -> Result<Response> {
    Conn::open(addr)?.request("GET", path, &[], b"")
}
