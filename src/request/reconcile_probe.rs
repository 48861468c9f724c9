//! A route's reconciliation probe as configured (`[routes.reconcile]`): the
//! request that asks an upstream whether an operation happened, and how its
//! status is read. The [`crate::background::reconciler`] task sends it.

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
pub enum ProbeFinding {
    Found,
    Absent,
    Inconclusive,
}

impl Probe {
    pub fn finding(&self, status: StatusCode) -> ProbeFinding {
        if self.found.contains(&status) {
            ProbeFinding::Found
        } else if self.absent.contains(&status) {
            ProbeFinding::Absent
        } else {
            ProbeFinding::Inconclusive
        }
    }

    /// The wait before probing again after `attempts` inconclusive probes:
    /// `interval`, doubling, at most [`MAX_PROBE_BACKOFF`] (never less than
    /// `interval`).
    pub fn backoff(&self, attempts: i32) -> Duration {
        crate::retry::Backoff::new(self.interval, MAX_PROBE_BACKOFF).after(u32::try_from(attempts).unwrap_or(0))
    }
}

/// The longest wait between two probes of one record.
pub const MAX_PROBE_BACKOFF: Duration = Duration::from_secs(3600);

/// The probe's path and query, with placeholders: `{derived_key}` (the
/// `Idempotency-Key` the upstream was sent), `{key}` (the client's key),
/// `{tenant}` and `{principal}` (the rest of the record's scope) and the
/// route's path parameters.
///
/// A probe must name one scope's operation: `{derived_key}` does (it is an
/// HMAC of the whole scope); `{key}` does only with `{tenant}` and
/// `{principal}` beside it. A lookup by the client's key alone could find
/// another tenant's operation under the same key and complete this record
/// with that answer (and hand it to this record's client).
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
    Tenant,
    Principal,
    Param(String),
}

/// What a probe's placeholders are filled with, for one record.
#[derive(Debug, Clone, Copy)]
pub struct ProbeValues<'a> {
    pub derived_key: &'a str,
    pub key: &'a str,
    pub tenant: &'a str,
    pub principal: &'a str,
    /// The request's path parameters as they appeared in its path (already
    /// URI-safe).
    pub params: &'a [(String, String)],
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
            let Some(close) = after.strip_prefix('{').and_then(|a| a.find('}')) else {
                return Err(format!("unbalanced braces in {target:?}"));
            };
            let name = &after[1..=close];
            pieces.push(match name {
                "derived_key" => Piece::DerivedKey,
                "key" => Piece::Key,
                "tenant" => Piece::Tenant,
                "principal" => Piece::Principal,
                p if params.contains(&p) => Piece::Param(p.to_owned()),
                other => {
                    let known: Vec<String> = ["derived_key", "key", "tenant", "principal"]
                        .iter()
                        .copied()
                        .chain(params.iter().copied())
                        .map(|n| format!("{{{n}}}"))
                        .collect();
                    return Err(format!("unknown placeholder {{{other}}}: use {}", known.join(", ")));
                }
            });
            rest = &after[close + 2..];
        }
        let t = ProbeTarget { source: target.to_owned(), pieces };
        let names = |p: &Piece| t.pieces.contains(p);
        let one_scope = names(&Piece::DerivedKey) || (names(&Piece::Key) && names(&Piece::Tenant) && names(&Piece::Principal));
        if !one_scope {
            return Err(format!(
                "the target {target:?} does not name one scope's operation: use {{derived_key}}, or {{key}} together with \
                 {{tenant}} and {{principal}} (a lookup by the client's key alone could find another tenant's operation \
                 and complete this record with its answer)"
            ));
        }
        let sample: Vec<(String, String)> = params.iter().map(|p| ((*p).to_owned(), "p".to_owned())).collect();
        let values = ProbeValues { derived_key: "0", key: "k", tenant: "t", principal: "p", params: &sample };
        t.render(&values).map_err(|e| format!("the target {target:?} is not a valid path and query: {e}"))?;
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

    /// The path and query to send.
    pub fn render(&self, v: &ProbeValues<'_>) -> Result<PathAndQuery, ProbeError> {
        let mut out = String::with_capacity(self.source.len() + v.derived_key.len());
        for piece in &self.pieces {
            match piece {
                Piece::Literal(s) => out.push_str(s),
                Piece::DerivedKey => out.extend(utf8_percent_encode(v.derived_key, COMPONENT)),
                Piece::Key => out.extend(utf8_percent_encode(v.key, COMPONENT)),
                Piece::Tenant => out.extend(utf8_percent_encode(v.tenant, COMPONENT)),
                Piece::Principal => out.extend(utf8_percent_encode(v.principal, COMPONENT)),
                Piece::Param(name) => match v.params.iter().find(|(n, _)| n == name) {
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
    /// The probe asks about `{derived_key}`, but the record's request went
    /// to the upstream under another key: its answer would say nothing
    /// about this record (an "absent" would release a request that ran).
    #[error("not probed: the probe asks about {{derived_key}}, but this request was sent {0}; settle it by hand")]
    NotSentUnderDerivedKey(&'static str),
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
        let v = |d: &'static str, k: &'static str, params: &'static [(String, String)]| ProbeValues {
            derived_key: d,
            key: k,
            tenant: "ac me",
            principal: "bill/ing",
            params,
        };
        assert_eq!(t.render(&v("ab12", "k", &[])).unwrap().as_str(), "/v1/orders/by-key/ab12");

        let (m, t) = target("head /v1/accounts/{id}/orders?key={key}&d={derived_key}", &["id"]).unwrap();
        assert_eq!(m, Method::HEAD);
        assert!(t.uses_params());
        let params: &'static [(String, String)] = Box::leak(Box::new([("id".to_owned(), "ac%20c".to_owned())]));
        // The client's key is one component whatever it holds; a parameter is
        // used as it appeared in the request path.
        assert_eq!(t.render(&v("d1", "a/b?c&d %", params)).unwrap().as_str(), "/v1/accounts/ac%20c/orders?key=a%2Fb%3Fc%26d%20%25&d=d1");
        assert!(matches!(t.render(&v("d1", "k", &[])), Err(ProbeError::MissingParam(p)) if p == "id"));

        // The client's key with the rest of the scope, each one component.
        let (_, t) = target("GET /by-key/{tenant}/{principal}/{key}", &[]).unwrap();
        assert_eq!(t.render(&v("d1", "k/1", &[])).unwrap().as_str(), "/by-key/ac%20me/bill%2Fing/k%2F1");
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
            ("GET /v1/\u{1}x/{derived_key}", "not a valid path"),
            // The client's key alone names no scope: another tenant's
            // operation under the same key would answer.
            ("GET /v1/orders/by-key/{key}", "{tenant} and {principal}"),
            ("GET /v1/orders/{tenant}/{key}", "{tenant} and {principal}"),
            ("GET /a/{account}", "does not name one scope"),
        ] {
            let e = target(probe, &["account"]).unwrap_err();
            assert!(e.contains(needle), "{probe}: {e}");
        }
        assert!(target("GET /a/{account}/{derived_key}", &["account"]).is_ok());
        assert!(target("GET /a/{account}/{tenant}/{principal}?k={key}", &["account"]).is_ok());
    }

    #[test]
    fn findings_and_backoff() {
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
        assert_eq!(p.finding(StatusCode::OK), ProbeFinding::Found);
        assert_eq!(p.finding(StatusCode::GONE), ProbeFinding::Absent);
        assert_eq!(p.finding(StatusCode::INTERNAL_SERVER_ERROR), ProbeFinding::Inconclusive);
        assert_eq!(p.finding(StatusCode::CREATED), ProbeFinding::Inconclusive);
        let waits: Vec<u64> = [0, 1, 2, 3, 4, 7, 8, 100].iter().map(|a| p.backoff(*a).as_secs()).collect();
        assert_eq!(waits, vec![30, 30, 60, 120, 240, 1920, 3600, 3600]);
    }
}
