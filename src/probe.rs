//! A route's reconciliation probe as configured (`[routes.reconcile]`): the
//! request that asks an upstream whether an operation happened, and how its
//! status is read. The [`crate::reconcile`] task sends it.

use std::time::Duration;

use http::uri::PathAndQuery;
use http::{Method, StatusCode};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};

/// A route's reconciliation probe (`[routes.reconcile]`), validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// GET or HEAD: a probe is repeated and must be safe.
    pub method: Method,
    pub target: ProbeTarget,
    /// The operation happened: record the probe's response.
    pub found: Vec<StatusCode>,
    /// The status the recorded response gets (default: the probe's own).
    pub found_as: Option<StatusCode>,
    /// The operation did not happen: release the key.
    pub absent: Vec<StatusCode>,
    /// Probe only records unknown for at least this long.
    pub settle: Duration,
    /// How often the reconciler looks, and the first backoff step.
    pub interval: Duration,
}

/// What a probe's status says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Found,
    Absent,
    Inconclusive,
}

impl Probe {
    pub fn verdict(&self, status: StatusCode) -> Verdict {
        if self.found.contains(&status) {
            Verdict::Found
        } else if self.absent.contains(&status) {
            Verdict::Absent
        } else {
            Verdict::Inconclusive
        }
    }

    /// The wait before probing again after `attempts` inconclusive probes:
    /// `interval`, doubling, at most [`MAX_PROBE_BACKOFF`] (never less than
    /// `interval`).
    pub fn backoff(&self, attempts: i32) -> Duration {
        let doublings = u32::try_from(attempts.saturating_sub(1)).unwrap_or(0).min(30);
        self.interval.saturating_mul(1 << doublings).min(MAX_PROBE_BACKOFF).max(self.interval)
    }
}

/// The longest wait between two probes of one record.
pub const MAX_PROBE_BACKOFF: Duration = Duration::from_secs(3600);

/// The probe's path and query, with placeholders: `{derived_key}` (the
/// `Idempotency-Key` the upstream was sent), `{key}` (the client's key) and
/// the route's path parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeTarget {
    source: String,
    pieces: Vec<Piece>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Literal(String),
    DerivedKey,
    Key,
    Param(String),
}

/// Characters left as they are in a substituted key: RFC 3986 unreserved.
/// Everything else (`/`, `?`, `%`, ...) is percent-encoded, so a key is one
/// path segment or query value whatever it contains.
const COMPONENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

impl ProbeTarget {
    /// Parses `"GET /v1/orders/by-key/{derived_key}"`: the method and the
    /// target. `params`: the route's path parameters.
    pub fn parse_probe(s: &str, params: &[&str]) -> Result<(Method, ProbeTarget), String> {
        let s = s.trim();
        let (method, target) = s
            .split_once(char::is_whitespace)
            .ok_or_else(|| format!("{s:?} is not \"METHOD /path\" (write e.g. \"GET /v1/orders/by-key/{{derived_key}}\")"))?;
        let method = match method.to_ascii_uppercase().as_str() {
            "GET" => Method::GET,
            "HEAD" => Method::HEAD,
            other => return Err(format!("method {other:?}: a probe is repeated, so it must be safe: use GET or HEAD")),
        };
        Ok((method, ProbeTarget::parse(target.trim(), params)?))
    }

    fn parse(target: &str, params: &[&str]) -> Result<ProbeTarget, String> {
        if !target.starts_with('/') {
            return Err(format!("the target {target:?} must start with '/'"));
        }
        if target.contains(char::is_whitespace) || target.contains('#') {
            return Err(format!("the target {target:?} must not contain spaces or a fragment"));
        }
        let mut pieces = Vec::new();
        let mut rest = target;
        while !rest.is_empty() {
            let Some(open) = rest.find(['{', '}']) else {
                pieces.push(Piece::Literal(rest.to_owned()));
                break;
            };
            if open > 0 {
                pieces.push(Piece::Literal(rest[..open].to_owned()));
            }
            let after = &rest[open..];
            let close = match after.strip_prefix('{').and_then(|a| a.find('}')) {
                Some(close) => close,
                None => return Err(format!("unbalanced braces in {target:?}")),
            };
            let name = &after[1..=close];
            pieces.push(match name {
                "derived_key" => Piece::DerivedKey,
                "key" => Piece::Key,
                p if params.contains(&p) => Piece::Param(p.to_owned()),
                other => {
                    let known: Vec<String> =
                        ["derived_key", "key"].iter().copied().chain(params.iter().copied()).map(|n| format!("{{{n}}}")).collect();
                    return Err(format!("unknown placeholder {{{other}}}: use {}", known.join(", ")));
                }
            });
            rest = &after[close + 2..];
        }
        let t = ProbeTarget { source: target.to_owned(), pieces };
        let sample: Vec<(String, String)> = params.iter().map(|p| ((*p).to_owned(), "p".to_owned())).collect();
        t.render("0", "k", &sample).map_err(|e| format!("the target {target:?} is not a valid path and query: {e}"))?;
        Ok(t)
    }

    pub fn as_str(&self) -> &str {
        &self.source
    }

    pub fn uses_params(&self) -> bool {
        self.pieces.iter().any(|p| matches!(p, Piece::Param(_)))
    }

    pub fn uses_derived_key(&self) -> bool {
        self.pieces.contains(&Piece::DerivedKey)
    }

    /// The path and query to send. `params` are the request's path
    /// parameters as they appeared in its path (already URI-safe).
    pub fn render(&self, derived_key: &str, key: &str, params: &[(String, String)]) -> Result<PathAndQuery, ProbeError> {
        let mut out = String::with_capacity(self.source.len() + derived_key.len());
        for piece in &self.pieces {
            match piece {
                Piece::Literal(s) => out.push_str(s),
                Piece::DerivedKey => out.extend(utf8_percent_encode(derived_key, COMPONENT)),
                Piece::Key => out.extend(utf8_percent_encode(key, COMPONENT)),
                Piece::Param(name) => match params.iter().find(|(n, _)| n == name) {
                    Some((_, v)) => out.push_str(v),
                    None => return Err(ProbeError::MissingParam(name.clone())),
                },
            }
        }
        PathAndQuery::try_from(out).map_err(|e| ProbeError::Target(e.to_string()))
    }
}

/// Why a probe could not be sent or read (an `error` outcome).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("path parameter {{{0}}} cannot be recovered: the record keeps no request line (claimed before the probe was configured?)")]
    MissingParam(String),
    #[error("invalid probe target: {0}")]
    Target(String),
    #[error("the record's stored request is unreadable: {0}")]
    StoredRequest(String),
    #[error(transparent)]
    Upstream(#[from] crate::upstream::UpstreamError),
    #[error("the probe's response body could not be read in time or in size: {0}")]
    Body(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(s: &str, params: &[&str]) -> Result<(Method, ProbeTarget), String> {
        ProbeTarget::parse_probe(s, params)
    }

    #[test]
    fn probes_parse_with_their_placeholders() {
        let (m, t) = target("GET /v1/orders/by-key/{derived_key}", &[]).unwrap();
        assert_eq!(m, Method::GET);
        assert!(t.uses_derived_key() && !t.uses_params());
        assert_eq!(t.render("ab12", "k", &[]).unwrap().as_str(), "/v1/orders/by-key/ab12");

        let (m, t) = target("head /v1/accounts/{id}/orders?key={key}&d={derived_key}", &["id"]).unwrap();
        assert_eq!(m, Method::HEAD);
        assert!(t.uses_params());
        let params = vec![("id".to_owned(), "ac%20c".to_owned())];
        // The client's key is one component whatever it holds; a parameter is
        // used as it appeared in the request path.
        assert_eq!(t.render("d1", "a/b?c&d %", &params).unwrap().as_str(), "/v1/accounts/ac%20c/orders?key=a%2Fb%3Fc%26d%20%25&d=d1");
        assert!(matches!(t.render("d1", "k", &[]), Err(ProbeError::MissingParam(p)) if p == "id"));
    }

    #[test]
    fn bad_probes_are_refused_with_a_reason() {
        for (probe, needle) in [
            ("/v1/orders/{derived_key}", "METHOD /path"),
            ("POST /v1/orders/{derived_key}", "GET or HEAD"),
            ("GET v1/orders", "start with '/'"),
            ("GET /v1/orders/{id}", "unknown placeholder {id}"),
            ("GET /v1/orders/{derived_key", "unbalanced"),
            ("GET /v1/orders/}x", "unbalanced"),
            ("GET /v1/orders#frag", "fragment"),
            ("GET /v1/\u{1}x", "not a valid path"),
        ] {
            let e = target(probe, &["account"]).unwrap_err();
            assert!(e.contains(needle), "{probe}: {e}");
        }
        assert!(target("GET /a/{account}", &["account"]).is_ok());
    }

    #[test]
    fn verdicts_and_backoff() {
        let (method, target) = target("GET /x/{derived_key}", &[]).unwrap();
        let p = Probe {
            method,
            target,
            found: vec![StatusCode::OK],
            found_as: None,
            absent: vec![StatusCode::NOT_FOUND, StatusCode::GONE],
            settle: Duration::ZERO,
            interval: Duration::from_secs(30),
        };
        assert_eq!(p.verdict(StatusCode::OK), Verdict::Found);
        assert_eq!(p.verdict(StatusCode::GONE), Verdict::Absent);
        assert_eq!(p.verdict(StatusCode::INTERNAL_SERVER_ERROR), Verdict::Inconclusive);
        assert_eq!(p.verdict(StatusCode::CREATED), Verdict::Inconclusive);
        let waits: Vec<u64> = [0, 1, 2, 3, 4, 7, 8, 100].iter().map(|a| p.backoff(*a).as_secs()).collect();
        assert_eq!(waits, vec![30, 30, 60, 120, 240, 1920, 3600, 3600]);
    }
}
