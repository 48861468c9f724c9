//! Property test of request normalisation: random method and path spellings
//! (a fixed-seed generator, so a failure reproduces) go through
//! [`Router::resolve`], and an independent, deliberately lenient reading of
//! each spelling (what a permissive upstream might make of it) says whether it
//! names an idempotent route. The invariant: a request is refused, or routed
//! exactly as its normal form; and when a lenient reading of it names a route
//! of its method (of GET, for HEAD), it is refused or routed as an operation
//! (identity, claim), never passed through or answered 404; and when it is
//! routed as an operation, no route of its method more specific than the one
//! chosen is named by the lenient reading (a framework would run that one).

use std::borrow::Cow;

use http::Method;

use super::tests::route;
use super::{InvalidRequest, Route, RouteMatch, Router, normalise_path};

/// xorshift64*: small, deterministic, good enough to spread cases.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

fn routes() -> Vec<Route> {
    vec![
        route("create", Method::POST, "/v1/orders", 0),
        route("acct", Method::POST, "/v1/accounts/{id}/orders", 1),
        route("cancel", Method::POST, "/v1/orders/{id}/cancel", 2),
        route("cancel_all", Method::POST, "/v1/orders/all/cancel", 3),
        route("replace", Method::PUT, "/v1/orders/{id}", 4),
        route("items", Method::POST, "/api/items/", 5),
        route("Upper", Method::PATCH, "/V2/Things/{t}", 6),
        route("report", Method::GET, "/v1/reports/{r}", 7),
    ]
}

/// Requests to start from: routes' paths (with parameters filled) and
/// others, each with a method that suits it.
const BASES: &[(&str, &str)] = &[
    ("POST", "/v1/orders"),
    ("POST", "/v1/accounts/7/orders"),
    ("POST", "/v1/accounts/abc-9/orders"),
    ("POST", "/v1/orders/42/cancel"),
    ("POST", "/v1/orders/all/cancel"),
    ("PUT", "/v1/orders/42"),
    ("POST", "/api/items/"),
    ("PATCH", "/V2/Things/x1"),
    ("POST", "/v1/elsewhere"),
    ("GET", "/"),
    ("POST", "/v1"),
    ("POST", "/v1/orders/42/items"),
    ("GET", "/static/app.js"),
    ("GET", "/v1/reports/9"),
];

const METHODS: &[&str] = &["POST", "PUT", "PATCH", "GET", "DELETE", "HEAD", "PURGE"];

/// The base's method or another, spelled with random letter case now and then.
fn spell_method(rng: &mut Rng, suits: &str) -> String {
    let base = if rng.chance(60) { suits } else { rng.pick(METHODS) };
    if !rng.chance(25) {
        return base.to_owned();
    }
    base.chars().map(|c| if rng.chance(50) { c.to_ascii_lowercase() } else { c }).collect()
}

/// One random change to a path's spelling.
fn mutate(rng: &mut Rng, path: &str) -> String {
    let slashes: Vec<usize> = path.match_indices('/').map(|(i, _)| i).collect();
    if slashes.is_empty() {
        return format!("/{path}");
    }
    let at_slash = *rng.pick(&slashes);
    let at = rng.below(path.len() + 1);
    let (before, after) = path.split_at(at);
    let (sb, sa) = path.split_at(at_slash);
    match rng.below(18) {
        0 => format!("{sb}/{sa}"),
        1 => format!("{sb}/.{sa}"),
        2 => format!("{sb}/x/..{sa}"),
        3 => format!("{sb}/%2e%2E{sa}"),
        4 => format!("{sb}/..;{sa}"),
        5 => format!("{path}/"),
        6 => path.strip_suffix('/').map_or_else(|| format!("{path}/"), str::to_owned),
        7 => format!("{path};x=1"),
        8 => format!("{path}%3Bx"),
        9 => format!("{sb}%2F{}", sa.get(1..).unwrap_or_default()),
        10 => format!("{sb}\\{}", sa.get(1..).unwrap_or_default()),
        11 => format!("{before}%5c{after}"),
        // Escape one unreserved character, in either hex case.
        12 => match path.char_indices().filter(|(_, c)| c.is_ascii_alphanumeric() || "-._~".contains(*c)).nth(rng.below(8)) {
            Some((i, c)) => {
                let hex = if rng.chance(50) { format!("%{:02X}", c as u32) } else { format!("%{:02x}", c as u32) };
                format!("{}{hex}{}", &path[..i], &path[i + 1..])
            }
            None => path.to_owned(),
        },
        13 => path.chars().map(|c| if rng.chance(30) { c.to_ascii_uppercase() } else { c }).collect(),
        14 => format!("{before}{}{after}", rng.pick(&["%20", "%c3%a9", "%", "%4", "%00", ";", "~"])),
        // A format suffix or trailing junk, at the end or before a slash.
        16 => format!("{path}{}", rng.pick(&[".json", ".", "%20", "%09", "%0b", "%C2%A0", ".tar.gz", "%E3%80%80", ".x%20"])),
        17 => format!("{sb}{}{sa}", rng.pick(&["%20", ".", "%09", ".json"])),
        _ => format!("{sb}/{sa}").replacen("//", "/;a/", 1),
    }
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

/// Every escape decoded (a malformed one kept as it is).
fn decode_all(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && let (Some(h), Some(l)) = (b.get(i + 1).copied().and_then(hex), b.get(i + 2).copied().and_then(hex))
        {
            out.push(h << 4 | l);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// The most lenient reading a permissive upstream could make of a path,
/// written independently of the gateway's: fully decoded, `\` as `/`,
/// `;` parameters dropped, trailing whitespace, control characters and dots
/// trimmed from each segment (unless that leaves nothing), the last cut at
/// its first `.` or whitespace (a format suffix), empty segments merged, dot
/// segments resolved (RFC 3986 section 5.2.4), letter case folded, no
/// trailing `/`.
fn lenient(path: &str) -> Vec<Vec<u8>> {
    let junk = |c: char| c == '.' || c.is_whitespace() || c.is_control();
    let decoded = decode_all(path);
    let mut segments: Vec<Vec<u8>> = Vec::new();
    for raw in decoded.split(|&b| b == b'/' || b == b'\\') {
        let name: Vec<u8> = raw.split(|&b| b == b';').next().unwrap_or_default().to_ascii_lowercase();
        match name.as_slice() {
            b"" | b"." => {}
            b".." => {
                segments.pop();
            }
            _ => {
                let text = String::from_utf8_lossy(&name).into_owned();
                let trimmed = text.trim_end_matches(junk);
                segments.push(if trimmed.is_empty() { name } else { trimmed.as_bytes().to_vec() });
            }
        }
    }
    if let Some(last) = segments.last_mut() {
        let text = String::from_utf8_lossy(last).into_owned();
        if let Some(cut) = text.find(|c: char| c == '.' || c.is_whitespace() || c.is_control()).filter(|&i| i > 0) {
            *last = text.as_bytes()[..cut].to_vec();
        }
    }
    segments
}

/// Whether the lenient reading `segs` of a path names route `r`'s path.
fn names(r: &Route, segs: &[Vec<u8>]) -> bool {
    let tmpl: Vec<&str> = r.path.as_str().trim_start_matches('/').split('/').filter(|s| !s.is_empty()).collect();
    tmpl.len() == segs.len() && tmpl.iter().zip(segs).all(|(t, s)| t.starts_with('{') || t.to_ascii_lowercase().as_bytes() == s.as_slice())
}

/// The route of `method` that a lenient reading of `path` names, if any.
fn lenient_route<'a>(routes: &'a [Route], method: &str, path: &str) -> Option<&'a Route> {
    let segs = lenient(path);
    let upper = method.to_ascii_uppercase();
    routes.iter().find(|r| (r.method.as_str() == upper || (upper == "HEAD" && r.method == Method::GET)) && names(r, &segs))
}

/// A route of `chosen`'s method, strictly more specific than it, that a
/// lenient reading of `path` names: a framework that tries routes from the
/// most specific (or in the order they are usually written) would run it.
fn shadowing<'a>(routes: &'a [Route], chosen: &Route, path: &str) -> Option<&'a Route> {
    let segs = lenient(path);
    routes.iter().find(|r| r.method == chosen.method && r.path.cmp_specificity(&chosen.path) == std::cmp::Ordering::Less && names(r, &segs))
}

/// A normal path has no `//`, no dot segment, no escape of an unreserved
/// character, no lower-case hex digit, no encoded `/`.
fn looks_normal(path: &str) -> bool {
    let b = path.as_bytes();
    let escapes_ok = b.iter().enumerate().filter(|(_, c)| **c == b'%').all(|(i, _)| {
        let (h, l) = (b.get(i + 1).copied().unwrap_or(b'g'), b.get(i + 2).copied().unwrap_or(b'g'));
        let (Some(hv), Some(lv)) = (hex(h), hex(l)) else { return false };
        let v = hv << 4 | lv;
        !(h.is_ascii_lowercase() || l.is_ascii_lowercase() || v.is_ascii_alphanumeric() || b"-._~/\\".contains(&v))
    });
    let segments_ok = path[1..].split('/').enumerate().all(|(i, s)| {
        let name = s.split(';').next().unwrap_or_default();
        name != "." && name != ".." && (!name.is_empty() || i == path[1..].split('/').count() - 1)
    });
    path.starts_with('/') && !path.contains("//") && !path.contains('\\') && escapes_ok && segments_ok
}

#[test]
fn random_spellings_are_refused_or_routed_as_their_normal_form() {
    let routes = routes();
    let router = Router::new(routes.clone(), Some(9));
    let mut rng = Rng(0x1d3a_6a7e_0000_0028);
    let (mut refused, mut operations, mut passed, mut protected) = (0, 0, 0, 0);
    for case in 0..20_000 {
        let &(suits, base) = rng.pick(BASES);
        let spelled_method = spell_method(&mut rng, suits);
        let mut path = base.to_owned();
        for _ in 0..rng.below(4) {
            path = mutate(&mut rng, &path);
        }
        let method = Method::from_bytes(spelled_method.as_bytes()).expect("a token");
        let named = lenient_route(&routes, &spelled_method, &path);
        let what = format!("case {case}: {spelled_method} {path:?}");
        match router.resolve(&method, &path) {
            Err(_) => refused += 1,
            Ok((normal, found)) => {
                // Routed exactly as its normal form, which is a fixpoint,
                // looks normal, and means what the spelling meant.
                assert!(looks_normal(&normal), "{what}: not normal: {normal:?}");
                assert_eq!(normalise_path(&normal).as_deref(), Ok(&*normal), "{what}");
                assert_eq!(decode_all(&normal), decode_all(&path), "{what}: normalising changed the path's meaning");
                let again = router.route(&method, &normal);
                assert_eq!(format!("{found:?}"), format!("{again:?}"), "{what}");
                match found {
                    RouteMatch::Operation { route, .. } => {
                        operations += 1;
                        assert_eq!(route.method, method, "{what}");
                        let shadow = shadowing(&routes, route, &path);
                        assert!(
                            shadow.is_none(),
                            "{what}: routed as {} though {:?} names it",
                            route.operation,
                            shadow.map(|r| &r.operation)
                        );
                    }
                    other => {
                        passed += 1;
                        assert!(named.is_none(), "{what}: names route {:?} but was {other:?} as {normal:?}", named.map(|r| &r.operation));
                    }
                }
            }
        }
        if named.is_some() {
            protected += 1;
        }
    }
    // The generator reaches every outcome often (not a vacuous pass).
    eprintln!("refused {refused}, operations {operations}, passed through or not found {passed}; named a route leniently {protected}");
    assert!(refused > 1_000 && operations > 1_000 && passed > 1_000 && protected > 1_000, "{refused} {operations} {passed} {protected}");
}

#[test]
fn normal_spellings_of_routes_are_never_refused() {
    let routes = routes();
    let router = Router::new(routes.clone(), None);
    for (method, path, op) in [
        ("POST", "/v1/orders", "create"),
        ("POST", "/v1/accounts/7/orders", "acct"),
        ("POST", "/v1/orders/all/cancel", "cancel_all"),
        ("POST", "/v1/orders/%C3%A9/cancel", "cancel"),
        ("PUT", "/v1/orders/a~b.c_d-e", "replace"),
        ("POST", "/api/items/", "items"),
        ("PATCH", "/V2/Things/x", "Upper"),
    ] {
        let found = router.resolve(&Method::from_bytes(method.as_bytes()).unwrap(), path);
        assert!(
            matches!(&found, Ok((Cow::Borrowed(p), RouteMatch::Operation { route, .. })) if *p == path && &*route.operation == op),
            "{method} {path}: {found:?}"
        );
    }
    // The same paths spelled otherwise, and what a request on them gets.
    let post = Method::POST;
    assert_eq!(router.resolve(&post, "/api/items").err(), Some(InvalidRequest::Ambiguous));
    assert_eq!(router.resolve(&post, "/v1/Orders").err(), Some(InvalidRequest::Ambiguous));
    assert_eq!(router.resolve(&Method::PATCH, "/v2/things/x").err(), Some(InvalidRequest::Ambiguous));
    assert!(matches!(router.resolve(&Method::GET, "/v1/orders/"), Ok((_, RouteMatch::NotFound))));
    assert_eq!(router.resolve(&post, "/v1/orders.json").err(), Some(InvalidRequest::Ambiguous));
    assert_eq!(router.resolve(&post, "/v1/orders%09").err(), Some(InvalidRequest::Ambiguous));
    assert_eq!(router.resolve(&post, "/v1/orders/7/cancel.xml").err(), Some(InvalidRequest::Ambiguous));
    // `{id}` matches these exactly, but a framework reads them as the literal `all`.
    assert_eq!(router.resolve(&post, "/v1/orders/ALL/cancel").err(), Some(InvalidRequest::Ambiguous));
    assert_eq!(router.resolve(&post, "/v1/orders/all%3Bx/cancel").err(), Some(InvalidRequest::Ambiguous));
    assert_eq!(router.resolve(&Method::HEAD, "/v1/reports/1").err(), Some(InvalidRequest::HeadOfGet));
    assert!(matches!(router.resolve(&Method::HEAD, "/v1/orders"), Ok((_, RouteMatch::PassThrough { upstream: 0 }))));
    assert!(matches!(router.resolve(&post, "/v1/ordersx"), Ok((_, RouteMatch::NotFound))));
    // An override signal on a path any route protects, whatever the method.
    assert_eq!(router.route_normal(&Method::GET, "/v1/orders/7", true).err(), Some(InvalidRequest::MethodOverride));
    assert_eq!(router.route_normal(&post, "/v1/orders", true).err(), Some(InvalidRequest::MethodOverride));
    assert_eq!(router.route_normal(&post, "/v1/orders/7.json", true).err(), Some(InvalidRequest::MethodOverride));
    assert!(matches!(router.route_normal(&post, "/v1/elsewhere", true), Ok(RouteMatch::NotFound)));
    assert!(matches!(
        router.resolve(&post, "/v1/%6Frders"),
        Ok((Cow::Owned(p), RouteMatch::Operation { route, .. })) if p == "/v1/orders" && &*route.operation == "create"
    ));
}
