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

fn connection_listed(headers: &HeaderMap) -> Vec<HeaderName> {
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
    let listed = connection_listed(headers);
    let doomed: Vec<HeaderName> = headers.keys().filter(|n| is_hop_by_hop(n, &listed)).cloned().collect();
    for name in doomed {
        headers.remove(&name);
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
}
