//! The operator console (contract section 11): a small page served by the
//! admin listener at `/console/`, only when the admin API is on (a token is
//! configured; otherwise `/console/` is a 404 like any unknown path).
//!
//! The page is three files compiled into the binary ([`assets`]): HTML, one
//! dependency-free script and a stylesheet, with no inline script or style,
//! so the `Content-Security-Policy` below can forbid everything else. The
//! script asks for the admin token once, keeps it in the tab's
//! `sessionStorage`, and calls the admin API with `Authorization: Bearer`
//! (no cookie, so nothing for a cross-site request to ride on) and
//! `X-Idemgate-Actor: console`, so that its resolutions are audited with
//! actor `console` ([`actor_of`]). Everything it shows of a record (scope,
//! headers, bodies, reasons) is attacker-controlled text and is inserted as
//! text only (`textContent`), never as HTML, and never turned into a link.
//!
//! The console's own reads beyond the admin API's existing endpoints are
//! `GET /admin/overview` ([`overview`]),
//! `GET /admin/records/{scope}/inspect` ([`inspect`]) and the records list's
//! `key_prefix` and `older_than` filters ([`filter`]).

pub mod assets;
pub mod filter;
pub mod inspect;
pub mod mask;
pub mod overview;

use http::{HeaderMap, HeaderValue, Method, Response, StatusCode, header};

use crate::store::audit::Actor;
use crate::upstream::body::Body;

/// Where the console lives on the admin listener.
pub const PREFIX: &str = "/console";

/// The header the console's script sends with every admin API call; the
/// only value allowed is `console`.
pub const ACTOR_HEADER: &str = "x-idemgate-actor";

/// Every console response's `Content-Security-Policy`: the page's own script
/// and stylesheet, and API calls to the same origin; nothing inline, no
/// frames, no forms, no plugins.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; \
                       frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

/// Whether `path` is the console's (`/console` or under `/console/`).
pub fn owns(path: &str) -> bool {
    path == PREFIX || path.strip_prefix(PREFIX).is_some_and(|rest| rest.starts_with('/'))
}

/// Answers a request for a console path (the caller checked that the admin
/// API is on).
pub fn serve(method: &Method, path: &str) -> Response<Body> {
    if method != Method::GET && method != Method::HEAD {
        let mut r = plain(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        r.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    if path == PREFIX {
        // The page's relative URLs need the trailing slash.
        let mut r = plain(StatusCode::PERMANENT_REDIRECT, "see /console/\n");
        r.headers_mut().insert(header::LOCATION, HeaderValue::from_static("/console/"));
        return r;
    }
    let Some(asset) = assets::find(&path[PREFIX.len()..]) else {
        return plain(StatusCode::NOT_FOUND, "not found\n");
    };
    let body = if method == Method::HEAD { Body::empty() } else { Body::full(asset.bytes) };
    let mut r = Response::new(body);
    secure(r.headers_mut());
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(asset.content_type));
    // The assets change with the binary; the page itself is small.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

fn plain(status: StatusCode, text: &'static str) -> Response<Body> {
    let mut r = Response::new(Body::full(text));
    *r.status_mut() = status;
    secure(r.headers_mut());
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    r
}

/// The headers every console response carries.
fn secure(h: &mut HeaderMap) {
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert("cross-origin-opener-policy", HeaderValue::from_static("same-origin"));
    h.insert("cross-origin-resource-policy", HeaderValue::from_static("same-origin"));
}

/// Who an admin API call acts as: [`Actor::Admin`], or [`Actor::Console`]
/// when it carries `X-Idemgate-Actor: console`. Any other value (or more
/// than one) is refused, so a typo never passes for the plain API.
pub fn actor_of(headers: &HeaderMap) -> Result<Actor, String> {
    let mut values = headers.get_all(ACTOR_HEADER).iter();
    match (values.next(), values.next()) {
        (None, _) => Ok(Actor::Admin),
        (Some(v), None) if v.as_bytes().eq_ignore_ascii_case(b"console") => Ok(Actor::Console),
        _ => Err("X-Idemgate-Actor must be \"console\" (the operator console) or absent (the admin API)".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_paths_and_assets() {
        assert!(owns("/console") && owns("/console/") && owns("/console/console.js"));
        assert!(!owns("/consoles") && !owns("/admin/console") && !owns("/"));
        let index = serve(&Method::GET, "/console/");
        assert_eq!(index.status(), StatusCode::OK);
        let h = index.headers();
        assert_eq!(h[header::CONTENT_SECURITY_POLICY], CSP);
        assert_eq!(h[header::X_FRAME_OPTIONS], "DENY");
        assert_eq!(h[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
        assert!(h[header::CONTENT_TYPE].to_str().unwrap().starts_with("text/html"));
        assert_eq!(serve(&Method::GET, "/console/console.js").headers()[header::CONTENT_TYPE], "text/javascript; charset=utf-8");
        assert_eq!(serve(&Method::GET, "/console/console.css").headers()[header::CONTENT_TYPE], "text/css; charset=utf-8");
        let missing = serve(&Method::GET, "/console/../admin/records");
        assert_eq!(missing.status(), StatusCode::NOT_FOUND);
        assert_eq!(missing.headers()[header::X_FRAME_OPTIONS], "DENY");
        assert_eq!(serve(&Method::GET, "/console").headers()[header::LOCATION], "/console/");
        assert_eq!(serve(&Method::POST, "/console/").status(), StatusCode::METHOD_NOT_ALLOWED);
    }

    #[test]
    fn the_page_has_no_inline_script_or_style() {
        let html = assets::INDEX_HTML;
        assert_eq!(html.matches("<script").count(), 1, "one script element");
        assert!(html.contains(r#"<script src="console.js" defer></script>"#));
        for inline in ["style=", "onclick", "onload", "onerror", "javascript:", "<style"] {
            assert!(!html.contains(inline), "{inline}");
        }
        // The script inserts text only.
        for sink in ["innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function", ".href ="] {
            assert!(!assets::CONSOLE_JS.contains(sink), "{sink}");
        }
    }

    #[test]
    fn the_actor_header() {
        let with = |vals: &[&'static str]| {
            let mut h = HeaderMap::new();
            for v in vals {
                h.append(ACTOR_HEADER, HeaderValue::from_static(v));
            }
            actor_of(&h)
        };
        assert_eq!(with(&[]), Ok(Actor::Admin));
        assert_eq!(with(&["console"]), Ok(Actor::Console));
        assert_eq!(with(&["Console"]), Ok(Actor::Console));
        assert!(with(&["cli"]).is_err());
        assert!(with(&["reconciler"]).is_err());
        assert!(with(&["console", "console"]).is_err());
    }
}
