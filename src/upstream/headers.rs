//! Header rules shared by forwarding, recording and replaying.

use http::header::{self, HeaderMap, HeaderName};

// Names, not strings: a lookup or removal by `&str` parses and hashes the
// name again on every call, on every request.

/// The header an upstream sets to ask that its response not be stored.
pub const IDEMPOTENCY_POLICY: HeaderName = HeaderName::from_static("idempotency-policy");
/// Marks an answer served from a record.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// The fencing token of the attempt, sent upstream.
pub const IDEMPOTENCY_GENERATION: HeaderName = HeaderName::from_static("x-idempotency-generation");
/// The header carrying the key upstream.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// What becomes of a request header whose name contains `_`
/// (`server.headers_with_underscores`). CGI-style servers (WSGI, Rack, PHP)
/// read `X_Tenant_Id` and `X-Tenant-Id` as one `HTTP_X_TENANT_ID`, so such a
/// name can stand in for a header the gateway strips or sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnderscoreHeaders {
    /// Removed before anything reads the request (the default; as nginx).
    #[default]
    Drop,
    /// The request is refused with 400 `invalid-request`.
    Refuse,
    /// Forwarded, except those that fold into a guarded name
    /// ([`HeaderScreen`]).
    Allow,
}

/// The first rule a request's headers meet, before identity, routing or
/// anything else reads them: names with `_` dropped (or the request refused,
/// or let through), and in every case no spelling of a guarded header (an
/// identity source's, a key's, idemgate's own control and forwarding
/// headers) other than its own reaches anything: `X_Tenant_Id` is never
/// `X-Tenant-Id`.
#[derive(Debug, Clone, Default)]
pub struct HeaderScreen {
    underscores: UnderscoreHeaders,
    /// Lower case, with `-`: the names whose other spellings are removed.
    guarded: Vec<String>,
}

/// Headers every gateway guards, besides those its configuration reads and
/// the method-override headers ([`is_override_header`]).
pub const ALWAYS_GUARDED: [&str; 8] = [
    "idempotency-key",
    "x-idempotency-generation",
    "idempotency-policy",
    "x-request-id",
    "authorization",
    "x-forwarded-for",
    "x-real-ip",
    "forwarded",
];

/// The headers frameworks read an overriding method from, lower case.
pub const OVERRIDE_HEADERS: [&str; 3] = ["x-http-method-override", "x-http-method", "x-method-override"];

/// Why [`HeaderScreen::apply`] refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnderscoreRefused;

impl HeaderScreen {
    /// `guarded`: the names the configuration reads (identity sources, key
    /// headers); [`ALWAYS_GUARDED`] is added.
    pub fn new<'a>(underscores: UnderscoreHeaders, guarded: impl IntoIterator<Item = &'a str>) -> HeaderScreen {
        let mut names: Vec<String> = ALWAYS_GUARDED.iter().map(|n| (*n).to_owned()).collect();
        for name in guarded {
            let folded = fold(name);
            if !names.contains(&folded) {
                names.push(folded);
            }
        }
        HeaderScreen { underscores, guarded: names }
    }

    /// Applies the screen to a request's headers in place.
    pub fn apply(&self, headers: &mut HeaderMap) -> Result<(), UnderscoreRefused> {
        // Nearly every request has no such name: one pass says so.
        if !headers.keys().any(|n| n.as_str().contains('_')) {
            return Ok(());
        }
        let doomed: Vec<HeaderName> = match self.underscores {
            UnderscoreHeaders::Refuse => return Err(UnderscoreRefused),
            UnderscoreHeaders::Drop => headers.keys().filter(|n| n.as_str().contains('_')).cloned().collect(),
            UnderscoreHeaders::Allow => headers
                .keys()
                .filter(|n| {
                    let n = n.as_str();
                    n.contains('_') && (self.guarded.iter().any(|g| folds_to(n, g)) || is_override_header(n))
                })
                .cloned()
                .collect(),
        };
        for name in doomed {
            headers.remove(&name);
        }
        Ok(())
    }
}

/// A header name as CGI-style servers fold it: lower case, `_` as `-`.
fn fold(name: &str) -> String {
    name.bytes().map(|b| if b == b'_' { '-' } else { char::from(b.to_ascii_lowercase()) }).collect()
}

/// Whether `name` is `expected` (lower case, with `-`) as a server that
/// folds letter case and `_` into `-` reads it.
pub fn folds_to(name: &str, expected: &str) -> bool {
    name.len() == expected.len()
        && name.bytes().zip(expected.bytes()).all(|(a, b)| {
            let a = if a == b'_' { b'-' } else { a.to_ascii_lowercase() };
            a == b
        })
}

/// A method-override header, in any spelling [`folds_to`] one.
pub fn is_override_header(name: &str) -> bool {
    OVERRIDE_HEADERS.iter().any(|h| folds_to(name, h))
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");

/// Writes the forwarding headers as a proxy does (`peer`: the connection's
/// address). From a peer that is not a trusted proxy, the client's
/// `X-Forwarded-For`, `Forwarded` and `X-Real-IP` are dropped and each
/// names the peer alone; from a trusted proxy the peer is appended to the
/// first two (their values joined into one) and its `X-Real-IP` is kept (or,
/// absent, set to the peer).
pub fn write_forwarded(headers: &mut HeaderMap, peer: std::net::IpAddr, trusted: bool) {
    let node = match peer {
        std::net::IpAddr::V4(v4) => format!("for={v4}"),
        std::net::IpAddr::V6(v6) => format!("for=\"[{v6}]\""),
    };
    let peer = peer.to_string();
    let chain = |headers: &HeaderMap, name: &HeaderName, last: &str| -> String {
        let earlier: Vec<&str> = if trusted {
            headers.get_all(name).iter().filter_map(|v| v.to_str().ok()).map(str::trim).filter(|v| !v.is_empty()).collect()
        } else {
            Vec::new()
        };
        earlier.into_iter().chain(std::iter::once(last)).collect::<Vec<_>>().join(", ")
    };
    let xff = chain(headers, &X_FORWARDED_FOR, &peer);
    let forwarded = chain(headers, &header::FORWARDED, &node);
    let real_ip = headers.get(&X_REAL_IP).filter(|_| trusted).cloned();
    for (name, value) in [(X_FORWARDED_FOR, xff), (header::FORWARDED, forwarded)] {
        match header::HeaderValue::from_str(&value) {
            Ok(v) => {
                headers.insert(name, v);
            }
            Err(_) => {
                headers.remove(name);
            }
        }
    }
    match real_ip.or_else(|| header::HeaderValue::from_str(&peer).ok()) {
        Some(v) => {
            headers.insert(X_REAL_IP, v);
        }
        None => {
            headers.remove(X_REAL_IP);
        }
    }
}

/// Hop-by-hop headers (RFC 9110 section 7.6.1) plus the ones named in
/// `Connection`: never forwarded, never stored, never replayed.
pub fn is_hop_by_hop(name: &HeaderName, connection_listed: &[HeaderName]) -> bool {
    name == header::CONNECTION
        || name == header::TE
        || name == header::TRAILER
        || name == header::TRANSFER_ENCODING
        || name == header::UPGRADE
        || name == header::PROXY_AUTHORIZATION
        || name == header::PROXY_AUTHENTICATE
        || name.as_str() == "keep-alive"
        || name.as_str().starts_with("proxy-")
        || connection_listed.contains(name)
}

/// Whether a request's body is sent with a content coding other than
/// `identity` (`Content-Encoding: gzip`): its bytes are not what the upstream
/// reads once it decodes them (Express's body parsers inflate by default).
pub fn content_coded(headers: &HeaderMap) -> bool {
    headers.get_all(header::CONTENT_ENCODING).iter().any(|v| {
        v.as_bytes().split(|b| *b == b',').any(|c| {
            let c = c.trim_ascii();
            !c.is_empty() && !c.eq_ignore_ascii_case(b"identity")
        })
    })
}

/// Whether a request names a transfer coding other than `chunked` (hyper
/// decodes only the chunking: a `gzip, chunked` body would reach the
/// upstream compressed and unlabelled).
pub fn transfer_coded(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .any(|v| v.as_bytes().split(|b| *b == b',').map(<[u8]>::trim_ascii).any(|c| !c.is_empty() && !c.eq_ignore_ascii_case(b"chunked")))
}

/// Gives an HTTP/2 request the `Host` it names in `:authority` (the URI's
/// authority; RFC 9113, section 8.3.1: forwarded over HTTP/1.1 it must be
/// `Host`), so that the upstream, the fingerprint and a stored request see the
/// client's host as from an HTTP/1.1 client, not the upstream's own address.
pub fn host_from_authority<B>(req: &mut http::Request<B>) {
    if req.headers().contains_key(header::HOST) {
        return;
    }
    let Some(authority) = req.uri().authority() else { return };
    let host = authority.as_str().rsplit('@').next().unwrap_or_default();
    if let Ok(value) = header::HeaderValue::from_str(host) {
        req.headers_mut().insert(header::HOST, value);
    }
}

/// The header names a message's `Connection` header lists.
pub fn connection_listed(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().to_ascii_lowercase().as_bytes()).ok())
        .collect()
}

/// Removes hop-by-hop headers in place (forwarding in either direction).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Usually there is nothing to strip, which one pass over the names says
    // (`Connection` is hop-by-hop itself, so a message listing more names
    // never takes this exit).
    if !headers.keys().any(|n| is_hop_by_hop(n, &[])) {
        return;
    }
    // A length sent beside a transfer coding is not the message's length
    // (RFC 9112, section 6.3): gone with the coding, so that the message goes
    // on with the length it turns out to have.
    if headers.contains_key(header::TRANSFER_ENCODING) {
        headers.remove(header::CONTENT_LENGTH);
    }
    let listed = connection_listed(headers);
    let doomed: Vec<HeaderName> = headers.keys().filter(|n| is_hop_by_hop(n, &listed)).cloned().collect();
    for name in doomed {
        headers.remove(&name);
    }
}

/// The headers idemgate itself speaks, removed from an upstream's answer
/// before anything forwards or stores it: an upstream that echoes them would
/// show the client the derived key and the attempt's generation, or mark a
/// first answer as a replay (`Idempotency-Policy` is read first, by
/// `executor::classify::head`).
pub fn strip_ours(headers: &mut HeaderMap) {
    for ours in [IDEMPOTENCY_POLICY, IDEMPOTENCY_KEY, IDEMPOTENCY_GENERATION, IDEMPOTENT_REPLAYED] {
        headers.remove(ours);
    }
}

/// Headers never stored nor replayed: hop-by-hop, `Set-Cookie` (another
/// client's session), `Date` (replays get a fresh one), `Content-Length`
/// (recomputed), and idemgate's own control header.
pub fn is_unreplayable(name: &HeaderName, connection_listed: &[HeaderName]) -> bool {
    is_hop_by_hop(name, connection_listed)
        || name == header::SET_COOKIE
        || name == header::DATE
        || name == header::CONTENT_LENGTH
        || name == IDEMPOTENCY_POLICY
        || name == IDEMPOTENT_REPLAYED
}

/// The headers of an upstream response as they are stored for replay.
pub fn storable(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    let listed = connection_listed(headers);
    headers.iter().filter(|(n, _)| !is_unreplayable(n, &listed)).map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn hop_by_hop_and_connection_listed_are_stripped() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close, X-Secret-Hop"));
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("proxy-foo", HeaderValue::from_static("1"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("content-type", HeaderValue::from_static("application/json"));
        strip_hop_by_hop(&mut h);
        let names: Vec<&str> = h.keys().map(|n| n.as_str()).collect();
        assert_eq!(names, vec!["content-type"]);
    }

    fn names(h: &HeaderMap) -> Vec<&str> {
        let mut names: Vec<&str> = h.keys().map(|n| n.as_str()).collect();
        names.sort_unstable();
        names
    }

    fn with_underscores() -> HeaderMap {
        let mut h = HeaderMap::new();
        for name in ["x_tenant_id", "x-tenant-id", "idempotency_key", "x_idempotency_generation", "x_custom", "x_http_method", "accept"] {
            h.insert(HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_static("v"));
        }
        h
    }

    #[test]
    fn underscore_names_are_dropped_refused_or_screened_for_guarded_spellings() {
        let screen = |u| HeaderScreen::new(u, ["X-Tenant-Id", "x-principal-id"]);
        let mut h = with_underscores();
        assert_eq!(screen(UnderscoreHeaders::Drop).apply(&mut h), Ok(()));
        assert_eq!(names(&h), ["accept", "x-tenant-id"]);
        let mut h = with_underscores();
        assert_eq!(screen(UnderscoreHeaders::Refuse).apply(&mut h), Err(UnderscoreRefused));
        let mut h = with_underscores();
        assert_eq!(screen(UnderscoreHeaders::Allow).apply(&mut h), Ok(()));
        assert_eq!(names(&h), ["accept", "x-tenant-id", "x_custom"]);
        // Nothing to do: nothing changes, whatever the setting.
        let mut plain = HeaderMap::new();
        plain.insert("x-tenant-id", HeaderValue::from_static("acme"));
        assert_eq!(screen(UnderscoreHeaders::Refuse).apply(&mut plain), Ok(()));
        assert_eq!(names(&plain), ["x-tenant-id"]);
    }

    #[test]
    fn forwarding_headers_name_the_peer_and_keep_a_trusted_proxys_chain() {
        let client = || {
            let mut h = HeaderMap::new();
            h.append("x-forwarded-for", HeaderValue::from_static("1.2.3.4"));
            h.append("x-forwarded-for", HeaderValue::from_static("5.6.7.8"));
            h.append("forwarded", HeaderValue::from_static("for=1.2.3.4"));
            h.append("x-real-ip", HeaderValue::from_static("1.2.3.4"));
            h
        };
        let peer: std::net::IpAddr = "10.0.0.9".parse().unwrap();
        let mut h = client();
        write_forwarded(&mut h, peer, false);
        assert_eq!(h.get_all("x-forwarded-for").iter().collect::<Vec<_>>(), ["10.0.0.9"]);
        assert_eq!(h.get_all("forwarded").iter().collect::<Vec<_>>(), ["for=10.0.0.9"]);
        assert_eq!(h.get_all("x-real-ip").iter().collect::<Vec<_>>(), ["10.0.0.9"]);
        let mut h = client();
        write_forwarded(&mut h, peer, true);
        assert_eq!(h.get_all("x-forwarded-for").iter().collect::<Vec<_>>(), ["1.2.3.4, 5.6.7.8, 10.0.0.9"]);
        assert_eq!(h.get_all("forwarded").iter().collect::<Vec<_>>(), ["for=1.2.3.4, for=10.0.0.9"]);
        assert_eq!(h.get_all("x-real-ip").iter().collect::<Vec<_>>(), ["1.2.3.4"]);
        let mut h = HeaderMap::new();
        write_forwarded(&mut h, "2001:db8::1".parse().unwrap(), true);
        assert_eq!(h.get("forwarded").unwrap(), "for=\"[2001:db8::1]\"");
        assert_eq!(h.get("x-forwarded-for").unwrap(), "2001:db8::1");
    }

    #[test]
    fn storable_drops_cookies_dates_lengths() {
        let mut h = HeaderMap::new();
        h.append("set-cookie", HeaderValue::from_static("session=abc"));
        h.append("date", HeaderValue::from_static("Mon, 01 Jan 2024 00:00:00 GMT"));
        h.append("content-length", HeaderValue::from_static("12"));
        h.append("upgrade", HeaderValue::from_static("h2c"));
        h.append("idempotency-policy", HeaderValue::from_static("no-store"));
        h.append("location", HeaderValue::from_static("/v1/orders/1"));
        h.append("x-multi", HeaderValue::from_static("a"));
        h.append("x-multi", HeaderValue::from_static("b"));
        let stored = storable(&h);
        assert_eq!(
            stored,
            vec![
                ("location".to_owned(), b"/v1/orders/1".to_vec()),
                ("x-multi".to_owned(), b"a".to_vec()),
                ("x-multi".to_owned(), b"b".to_vec()),
            ]
        );
    }

    #[test]
    fn codings_idemgate_cannot_see_through() {
        let h = |name: &'static str, values: &[&'static str]| {
            let mut m = HeaderMap::new();
            for v in values {
                m.append(name, HeaderValue::from_static(v));
            }
            m
        };
        assert!(!transfer_coded(&h("transfer-encoding", &["chunked"])));
        assert!(!transfer_coded(&h("transfer-encoding", &[", chunked", "Chunked"])), "empty list elements are nothing");
        assert!(transfer_coded(&h("transfer-encoding", &["gzip, chunked"])));
        assert!(transfer_coded(&h("transfer-encoding", &["chunked", "gzip"])));
        assert!(!content_coded(&h("content-encoding", &["identity"])));
        assert!(!content_coded(&HeaderMap::new()));
        assert!(content_coded(&h("content-encoding", &["identity", "br"])));
        assert!(content_coded(&h("content-encoding", &[" GZIP "])));
    }
}
