//! Credentials in stored headers, masked before the console (or any admin
//! API answer that carries headers it read from a request) shows them.
//!
//! A stored async request keeps every header the upstream will be sent,
//! credentials included (the worker forwards them); a stored response keeps
//! the upstream's headers. Operators need to see which headers there were,
//! not the secrets in them.

use http::HeaderName;

/// Header names whose values are credentials, compared case-insensitively.
const CREDENTIAL_HEADERS: [&str; 6] = ["authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key", "api-key"];

/// Name fragments that mark a header as carrying a credential.
const CREDENTIAL_FRAGMENTS: [&str; 9] = ["auth", "token", "secret", "password", "passwd", "session", "apikey", "api-key", "signature"];

/// Whether a header's value is a credential and must not be shown: a
/// well-known credential name, a name with a credential fragment, or one of
/// `configured`, the headers the configured identity sources read a
/// credential from (an `api_key` source's own header, a JWT source's).
pub fn is_credential(name: &str, configured: &[HeaderName]) -> bool {
    let name = name.to_ascii_lowercase();
    CREDENTIAL_HEADERS.contains(&name.as_str())
        || CREDENTIAL_FRAGMENTS.iter().any(|f| name.contains(f))
        || configured.iter().any(|h| h.as_str() == name)
}

/// What is shown instead of a credential's value: its size only.
pub fn masked(value: &[u8]) -> String {
    format!("(masked: {} bytes)", value.len())
}

/// Query parameter names whose values are credentials (OAuth's
/// `access_token`, API keys, signed URLs' signatures), compared
/// case-insensitively after percent-decoding.
const CREDENTIAL_PARAMS: [&str; 16] = [
    "access_token",
    "refresh_token",
    "id_token",
    "token",
    "api_key",
    "apikey",
    "key",
    "password",
    "passwd",
    "pwd",
    "secret",
    "client_secret",
    "signature",
    "sig",
    "code",
    "x-amz-credential",
];

/// Whether a query parameter's value is a credential: a built-in name, a
/// name with a credential fragment (as for headers, `_` read as `-`), or
/// one of `configured` (`[admin] masked_query_params`).
pub fn is_credential_param(name: &str, configured: &[String]) -> bool {
    let name = name.trim().to_ascii_lowercase();
    let dashed = name.replace('_', "-");
    CREDENTIAL_PARAMS.contains(&name.as_str())
        || CREDENTIAL_FRAGMENTS.iter().any(|f| dashed.contains(f))
        || configured.iter().any(|c| c.eq_ignore_ascii_case(&name))
}

/// A stored request's path and query as shown: each query parameter whose
/// name is a credential's ([`is_credential_param`]) has its value replaced
/// by `(masked: N bytes)`; the rest is kept as sent.
pub fn path_and_query(target: &str, configured: &[String]) -> String {
    let Some((path, query)) = target.split_once('?') else { return target.to_owned() };
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| {
            let (raw_name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let name: String = form_urlencoded::parse(raw_name.as_bytes()).next().map(|(n, _)| n.into_owned()).unwrap_or_default();
            if !value.is_empty() && is_credential_param(&name, configured) {
                format!("{raw_name}={}", masked(value.as_bytes()))
            } else {
                pair.to_owned()
            }
        })
        .collect();
    format!("{path}?{}", pairs.join("&"))
}

/// Headers as `[[name, value], ...]`, credentials masked, other values as
/// (lossy) UTF-8 text.
pub fn headers_json(headers: &[(String, Vec<u8>)], configured: &[HeaderName]) -> serde_json::Value {
    headers
        .iter()
        .map(|(name, value)| {
            let shown = if is_credential(name, configured) { masked(value) } else { String::from_utf8_lossy(value).into_owned() };
            serde_json::json!([name, shown])
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credential_query_parameters_are_masked_and_the_rest_is_kept() {
        let shown =
            path_and_query("/v1/orders?access_token=abc123&page=2&API_KEY=k&x%5Fauth%5Ftoken=t&sig=s&ticket=T&empty=", &["Ticket".into()]);
        assert_eq!(
            shown,
            "/v1/orders?access_token=(masked: 6 bytes)&page=2&API_KEY=(masked: 1 bytes)&x%5Fauth%5Ftoken=(masked: 1 bytes)&sig=(masked: 1 bytes)&ticket=(masked: 1 bytes)&empty="
        );
        assert_eq!(path_and_query("/v1/orders", &[]), "/v1/orders");
        assert_eq!(path_and_query("/v1/orders?page=1&sort=asc", &[]), "/v1/orders?page=1&sort=asc");
    }

    #[test]
    fn credentials_are_masked_and_the_rest_is_kept() {
        for name in [
            "Authorization",
            "proxy-authorization",
            "Cookie",
            "set-cookie",
            "X-Api-Key",
            "x-auth-token",
            "x-amz-security-token",
            "x-client-secret",
            "x-session-id",
            "idemgate-signature",
        ] {
            assert!(is_credential(name, &[]), "{name}");
        }
        for name in ["idempotency-key", "content-type", "location", "x-request-id", "x-tenant-id"] {
            assert!(!is_credential(name, &[]), "{name}");
        }
        let shown =
            headers_json(&[("authorization".into(), b"Bearer hunter2".to_vec()), ("x-note".into(), b"javascript:alert(1)".to_vec())], &[]);
        assert_eq!(shown, serde_json::json!([["authorization", "(masked: 14 bytes)"], ["x-note", "javascript:alert(1)"]]));
        assert!(!shown.to_string().contains("hunter2"));
    }

    #[test]
    fn headers_an_identity_source_reads_a_credential_from_are_masked() {
        let configured = [HeaderName::from_static("x-client-id")];
        assert!(!is_credential("x-client-id", &[]), "not a credential by its name alone");
        assert!(is_credential("X-Client-Id", &configured));
        let shown = headers_json(&[("x-client-id".into(), b"live-key-123".to_vec())], &configured);
        assert_eq!(shown, serde_json::json!([["x-client-id", "(masked: 12 bytes)"]]));
    }
}
