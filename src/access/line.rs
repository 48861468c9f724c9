//! The access-log line, formatted by hand into the log's batch.
//!
//! The general log goes through `tracing-subscriber`'s formatter, which costs
//! some 17k instructions and a `write` per line: on the pass-through path
//! that was the largest single cost of a request. Access lines are written
//! here instead, in the same two shapes (text as the subscriber prints it
//! without colour, JSON flattened), into [`crate::logging::batched`].
//! Latencies are milliseconds with three decimals.

use std::io::Write as _;
use std::time::{Duration, SystemTime};

use crate::logging::LineFormat;

use super::AccessLine;

/// The access log's target, as filters name it.
pub const TARGET: &str = "idemgate::access";

/// Appends `line` (and its newline) to `buf`.
pub fn write(buf: &mut Vec<u8>, format: LineFormat, line: &AccessLine<'_>) {
    let t = line.trace;
    let mut out = Fields { buf, format };
    let now = humantime::format_rfc3339_micros(SystemTime::now());
    match format {
        LineFormat::Text => {
            let _ = write!(out.buf, "{now}  INFO {TARGET}: request");
        }
        LineFormat::Json => {
            let _ = write!(out.buf, "{{\"timestamp\":\"{now}\",\"level\":\"INFO\",\"message\":\"request\"");
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
        let _ = match format {
            LineFormat::Text => write!(out.buf, "{scope}"),
            LineFormat::Json => write!(out.buf, "\"{scope}\""),
        };
    }
    if let Some(p) = t.problem {
        out.string("problem", p);
    }
    out.string("request_id", line.request_id.to_str().unwrap_or_default());
    out.name("client");
    let _ = match format {
        LineFormat::Text => write!(out.buf, "{}", line.peer),
        LineFormat::Json => write!(out.buf, "\"{}\"", line.peer),
    };
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
        let _ = write!(self.buf, "{n}");
    }

    /// Milliseconds with three decimals (microsecond resolution).
    fn millis(&mut self, name: &str, d: Duration) {
        self.name(name);
        let us = d.as_micros();
        let _ = write!(self.buf, "{}.{:03}", us / 1000, us % 1000);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access::{RouteLabel, Trace};
    use crate::metrics::Outcome;
    use http::{HeaderValue, Method};

    fn sample(buf: &mut Vec<u8>, format: LineFormat, trace: &Trace) {
        let id = HeaderValue::from_static("0123abcd");
        let line = AccessLine {
            method: &Method::POST,
            path: "/v1/orders",
            peer: "127.0.0.1".parse().unwrap(),
            status: 201,
            latency: Duration::from_micros(1_234),
            upstream_latency: Some(Duration::from_micros(1_005)),
            request_id: &id,
            trace,
        };
        write(buf, format, &line);
    }

    #[test]
    fn json_lines_carry_every_field_with_its_type() {
        let trace = Trace {
            route: RouteLabel::Operation("create_order".into()),
            outcome: Some(Outcome::Forwarded),
            scope: None,
            problem: Some("in \"quotes\"\n"),
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
        assert!(v.get("scope").is_none(), "absent fields are left out");
        let ts = v["timestamp"].as_str().unwrap();
        assert!(humantime::parse_rfc3339(ts).is_ok(), "{ts}");
    }

    #[test]
    fn text_lines_look_like_the_subscribers() {
        let trace = Trace { route: RouteLabel::PassThrough, outcome: None, scope: None, problem: None };
        let mut buf = Vec::new();
        sample(&mut buf, LineFormat::Text, &trace);
        let text = String::from_utf8(buf).unwrap();
        let (ts, rest) = text.split_once("  ").unwrap();
        assert!(humantime::parse_rfc3339(ts).is_ok(), "{ts}");
        assert_eq!(
            rest,
            "INFO idemgate::access: request method=POST path=\"/v1/orders\" route=\"passthrough\" status=201 \
             latency_ms=1.234 upstream_ms=1.005 request_id=\"0123abcd\" client=127.0.0.1\n"
        );
    }

    /// The subscriber's line for the same request, timestamp cut off.
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
        let id = HeaderValue::from_static("0123abcd");
        let line = AccessLine {
            method: &Method::POST,
            path: "/v1/orders",
            peer: "127.0.0.1".parse().unwrap(),
            status: 201,
            latency: Duration::from_micros(1_234),
            upstream_latency: Some(Duration::from_micros(1_005)),
            request_id: &id,
            trace,
        };
        if json {
            tracing::subscriber::with_default(builder.json().flatten_event(true).finish(), || super::super::log_event(&line));
        } else {
            tracing::subscriber::with_default(builder.finish(), || super::super::log_event(&line));
        }
        String::from_utf8(out.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn lines_match_the_subscribers_but_for_the_time() {
        let trace = Trace {
            route: RouteLabel::Operation("create_order".into()),
            outcome: Some(Outcome::Replayed),
            scope: Some(crate::scope::ScopeId(0x1234_5678_9abc_def0)),
            problem: Some("conflict"),
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
    fn millis_keep_three_decimals() {
        let mut buf = Vec::new();
        let mut f = Fields { buf: &mut buf, format: LineFormat::Text };
        f.millis("a", Duration::from_micros(7));
        f.millis("b", Duration::from_secs(2));
        assert_eq!(buf, b" a=0.007 b=2000.000");
    }
}
