//! The access-log line, formatted by hand into the log's batch.
//!
//! The general log goes through `tracing-subscriber`'s formatter, which cost
//! 17-24k instructions (by machine) and a `write` per line: on the
//! pass-through path that was the largest single cost of a request. Access lines are written
//! here instead, in the same two shapes (text as the subscriber prints it
//! without colour, JSON flattened), into [`crate::telemetry::logging::batched`].
//! Latencies are milliseconds with three decimals.

use std::cell::RefCell;
use std::io::Write as _;
use std::net::IpAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::telemetry::logging::LineFormat;

use super::AccessLine;

/// The access log's target, as filters name it.
pub const TARGET: &str = "idemgate::access";

/// Appends `line` (and its newline) to `buf`.
pub fn write(buf: &mut Vec<u8>, format: LineFormat, line: &AccessLine<'_>) {
    let t = line.trace;
    let mut out = Fields { buf, format };
    match format {
        LineFormat::Text => {
            timestamp(out.buf, SystemTime::now());
            out.buf.extend_from_slice(b"  INFO ");
            out.buf.extend_from_slice(TARGET.as_bytes());
            out.buf.extend_from_slice(b": request");
        }
        LineFormat::Json => {
            out.buf.extend_from_slice(b"{\"timestamp\":\"");
            timestamp(out.buf, SystemTime::now());
            out.buf.extend_from_slice(b"\",\"level\":\"INFO\",\"message\":\"request\"");
        }
    }
    out.bare("method", line.method.as_str());
    out.string("path", line.path);
    out.string("route", t.route.as_str());
    if let Some(o) = t.outcome {
        out.string("outcome", o.as_str());
    }
    out.number("status", u64::from(line.status));
    out.millis("latency_ms", line.latency);
    if let Some(d) = line.upstream_latency {
        out.millis("upstream_ms", d);
    }
    if let Some(scope) = t.scope {
        out.name("scope");
        // 16 hex digits, as `ScopeId` displays.
        let quote = format == LineFormat::Json;
        if quote {
            out.buf.push(b'"');
        }
        out.buf.extend((0..16).rev().map(|i| b"0123456789abcdef"[((scope.0 >> (4 * i)) & 0xf) as usize]));
        if quote {
            out.buf.push(b'"');
        }
    }
    if let Some(p) = t.problem {
        out.string("problem", p);
    }
    // Bare in text (ids hold no space or quote): `grep 'request_id=<id>'`.
    out.bare("request_id", line.request_id.to_str().unwrap_or_default());
    out.name("client");
    match format {
        LineFormat::Text => address(out.buf, line.peer),
        LineFormat::Json => {
            out.buf.push(b'"');
            address(out.buf, line.peer);
            out.buf.push(b'"');
        }
    }
    if let Some(id) = line.client_request_id {
        // The client's text: quoted and escaped.
        out.string("client_request_id", id);
    }
    out.bare("http_version", line.http_version);
    if let Some(n) = line.bytes_in {
        out.number("bytes_in", n);
    }
    if let Some(n) = line.bytes_out {
        out.number("bytes_out", n);
    }
    if let Some(addr) = line.upstream_addr {
        out.name("upstream_addr");
        let quote = format == LineFormat::Json;
        if quote {
            out.buf.push(b'"');
        }
        let _ = write!(out.buf, "{addr}");
        if quote {
            out.buf.push(b'"');
        }
    }
    if let Some(id) = line.trace_id {
        out.bare("trace_id", id);
    }
    match format {
        LineFormat::Text => out.buf.push(b'\n'),
        LineFormat::Json => {
            let _ = writeln!(out.buf, ",\"target\":\"{TARGET}\"}}");
        }
    }
}

/// Writes `name=value` (text) or `"name":value` (JSON) pairs.
struct Fields<'a> {
    buf: &'a mut Vec<u8>,
    format: LineFormat,
}

impl Fields<'_> {
    fn name(&mut self, name: &str) {
        match self.format {
            LineFormat::Text => {
                self.buf.push(b' ');
                self.buf.extend_from_slice(name.as_bytes());
                self.buf.push(b'=');
            }
            LineFormat::Json => {
                self.buf.extend_from_slice(b",\"");
                self.buf.extend_from_slice(name.as_bytes());
                self.buf.extend_from_slice(b"\":");
            }
        }
    }

    /// A string: quoted in both formats (text quotes it as `{:?}` does).
    fn string(&mut self, name: &str, value: &str) {
        self.name(name);
        if value.bytes().all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\') {
            self.buf.push(b'"');
            self.buf.extend_from_slice(value.as_bytes());
            self.buf.push(b'"');
            return;
        }
        let _ = match self.format {
            LineFormat::Text => write!(self.buf, "{value:?}"),
            LineFormat::Json => serde_json::to_writer(&mut *self.buf, value).map_err(std::io::Error::other),
        };
    }

    /// A token (the method): bare in text, quoted in JSON.
    fn bare(&mut self, name: &str, value: &str) {
        match self.format {
            LineFormat::Text => {
                self.name(name);
                self.buf.extend_from_slice(value.as_bytes());
            }
            LineFormat::Json => self.string(name, value),
        }
    }

    fn number(&mut self, name: &str, n: u64) {
        self.name(name);
        decimal(self.buf, n);
    }

    /// Milliseconds with three decimals (microsecond resolution).
    fn millis(&mut self, name: &str, d: Duration) {
        self.name(name);
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        decimal(self.buf, us / 1000);
        self.buf.push(b'.');
        padded(self.buf, us % 1000, 3);
    }
}

/// `n` in decimal (what `{n}` prints, without the formatting machinery).
fn decimal(buf: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    buf.extend_from_slice(&digits[i..]);
}

/// The last `width` decimal digits of `n`, zero-padded.
fn padded(buf: &mut Vec<u8>, n: u64, width: u32) {
    let mut unit = 10u64.pow(width.saturating_sub(1));
    while unit > 0 {
        buf.push(b'0' + ((n / unit) % 10) as u8);
        unit /= 10;
    }
}

/// An IPv4 peer by hand; IPv6 through `Display`.
fn address(buf: &mut Vec<u8>, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    buf.push(b'.');
                }
                decimal(buf, u64::from(octet));
            }
        }
        IpAddr::V6(v6) => {
            let _ = write!(buf, "{v6}");
        }
    }
}

thread_local! {
    /// The second last formatted on this thread and its `YYYY-MM-DDTHH:MM:SS`.
    static SECOND: RefCell<(u64, Vec<u8>)> = const { RefCell::new((u64::MAX, Vec::new())) };
}

/// RFC 3339 in UTC with microseconds, as the subscriber prints it; the date
/// and time of day are formatted once per second and thread.
fn timestamp(buf: &mut Vec<u8>, at: SystemTime) {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    let second = since.as_secs();
    SECOND.with_borrow_mut(|(cached, text)| {
        if *cached != second {
            text.clear();
            let _ = write!(text, "{}", humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(second)));
            // Without the trailing `Z`.
            text.truncate(19);
            *cached = second;
        }
        buf.extend_from_slice(text);
    });
    buf.push(b'.');
    padded(buf, u64::from(since.subsec_micros()), 6);
    buf.push(b'Z');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::outcome::RequestOutcome;
    use crate::proxy::access::{RouteLabel, Trace};
    use http::{HeaderValue, Method};

    /// Calls `f` with the sample request's line (a POST answered 201).
    fn with_sample<R>(trace: &Trace, f: impl FnOnce(&AccessLine<'_>) -> R) -> R {
        let id = HeaderValue::from_static("0123abcd");
        f(&AccessLine {
            method: &Method::POST,
            path: "/v1/orders",
            peer: "127.0.0.1".parse().unwrap(),
            status: 201,
            latency: Duration::from_micros(1_234),
            upstream_latency: Some(Duration::from_micros(1_005)),
            request_id: &id,
            trace,
            client_request_id: Some("client's \"own\" id"),
            http_version: "HTTP/1.1",
            bytes_in: Some(15),
            bytes_out: Some(2_048),
            upstream_addr: Some("127.0.0.1:9000".parse().unwrap()),
            trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736"),
        })
    }

    fn sample(buf: &mut Vec<u8>, format: LineFormat, trace: &Trace) {
        with_sample(trace, |line| write(buf, format, line));
    }

    #[test]
    fn json_lines_carry_every_field_with_its_type() {
        let trace = Trace {
            route: RouteLabel::Operation("create_order".into()),
            outcome: Some(RequestOutcome::Forwarded),
            scope: None,
            problem: Some("in \"quotes\"\n"),
            ..Trace::default()
        };
        let mut buf = Vec::new();
        sample(&mut buf, LineFormat::Json, &trace);
        assert_eq!(buf.last(), Some(&b'\n'));
        let v: serde_json::Value = serde_json::from_slice(&buf).unwrap();
        assert_eq!(v["target"], TARGET);
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["message"], "request");
        assert_eq!(v["method"], "POST");
        assert_eq!(v["path"], "/v1/orders");
        assert_eq!(v["route"], "create_order");
        assert_eq!(v["outcome"], "forwarded");
        assert_eq!(v["status"], 201);
        assert_eq!(v["latency_ms"], 1.234);
        assert_eq!(v["upstream_ms"], 1.005);
        assert_eq!(v["problem"], "in \"quotes\"\n", "escaped, and one line");
        assert_eq!(v["request_id"], "0123abcd");
        assert_eq!(v["client"], "127.0.0.1");
        assert_eq!(v["client_request_id"], "client's \"own\" id");
        assert_eq!(v["http_version"], "HTTP/1.1");
        assert_eq!(v["bytes_in"], 15);
        assert_eq!(v["bytes_out"], 2048);
        assert_eq!(v["upstream_addr"], "127.0.0.1:9000");
        assert_eq!(v["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(v.get("scope").is_none(), "absent fields are left out");
        let ts = v["timestamp"].as_str().unwrap();
        assert!(humantime::parse_rfc3339(ts).is_ok(), "{ts}");
    }

    #[test]
    fn text_lines_look_like_the_subscribers() {
        let trace = Trace { route: RouteLabel::PassThrough, ..Trace::default() };
        let mut buf = Vec::new();
        sample(&mut buf, LineFormat::Text, &trace);
        let text = String::from_utf8(buf).unwrap();
        let (ts, rest) = text.split_once("  ").unwrap();
        assert!(humantime::parse_rfc3339(ts).is_ok(), "{ts}");
        assert_eq!(
            rest,
            "INFO idemgate::access: request method=POST path=\"/v1/orders\" route=\"passthrough\" status=201 \
             latency_ms=1.234 upstream_ms=1.005 request_id=0123abcd client=127.0.0.1 client_request_id=\"client's \\\"own\\\" id\" \
             http_version=HTTP/1.1 bytes_in=15 bytes_out=2048 upstream_addr=127.0.0.1:9000 trace_id=4bf92f3577b34da6a3ce929d0e0e4736\n"
        );
    }

    /// The subscriber's own line for the sample request.
    fn subscribers(json: bool, trace: &Trace) -> String {
        use std::sync::{Arc, Mutex};
        #[derive(Clone, Default)]
        struct Shared(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Shared {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let out = Shared::default();
        let writer = out.clone();
        let make = move || writer.clone();
        let builder = tracing_subscriber::fmt().with_writer(make).with_ansi(false);
        with_sample(trace, |line| {
            if json {
                tracing::subscriber::with_default(builder.json().flatten_event(true).finish(), || super::super::log_event(line));
            } else {
                tracing::subscriber::with_default(builder.finish(), || super::super::log_event(line));
            }
        });
        String::from_utf8(out.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn lines_match_the_subscribers_but_for_the_time() {
        let trace = Trace {
            route: RouteLabel::Operation("create_order".into()),
            outcome: Some(RequestOutcome::Replayed),
            scope: Some(crate::idempotency::key::ScopeId(0x1234_5678_9abc_def0)),
            problem: Some("conflict"),
            ..Trace::default()
        };
        let mut json = Vec::new();
        sample(&mut json, LineFormat::Json, &trace);
        let mut ours: serde_json::Value = serde_json::from_slice(&json).unwrap();
        let mut theirs: serde_json::Value = serde_json::from_str(&subscribers(true, &trace)).unwrap();
        ours["timestamp"] = serde_json::Value::Null;
        theirs["timestamp"] = serde_json::Value::Null;
        assert_eq!(ours, theirs);

        let mut text = Vec::new();
        sample(&mut text, LineFormat::Text, &trace);
        let text = String::from_utf8(text).unwrap();
        let theirs = subscribers(false, &trace);
        assert_eq!(text.split_once("  ").unwrap().1, theirs.split_once("  ").unwrap().1);
    }

    #[test]
    fn numbers_addresses_and_times_match_their_display() {
        for n in [0, 7, 10, 99, 1_000, 65_535, u64::MAX] {
            let mut buf = Vec::new();
            decimal(&mut buf, n);
            assert_eq!(buf, n.to_string().as_bytes());
        }
        for ip in ["127.0.0.1", "10.200.3.0", "255.255.255.255", "::1", "2001:db8::7"] {
            let mut buf = Vec::new();
            address(&mut buf, ip.parse().unwrap());
            assert_eq!(buf, ip.as_bytes());
        }
        for us in [0u64, 1, 999_999, 1_764_588_011_123_456, 1_764_588_012_000_001] {
            let at = UNIX_EPOCH + Duration::from_micros(us);
            let mut buf = Vec::new();
            timestamp(&mut buf, at);
            assert_eq!(String::from_utf8(buf).unwrap(), humantime::format_rfc3339_micros(at).to_string(), "{us}");
        }
    }

    #[test]
    fn millis_keep_three_decimals() {
        let mut buf = Vec::new();
        let mut f = Fields { buf: &mut buf, format: LineFormat::Text };
        f.millis("a", Duration::from_micros(7));
        f.millis("b", Duration::from_secs(2));
        assert_eq!(buf, b" a=0.007 b=2000.000");
    }
}
