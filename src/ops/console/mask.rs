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
