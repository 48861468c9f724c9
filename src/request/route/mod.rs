//! Routes: which requests are idempotent operations, and where they go.
//!
//! A [`Route`] binds a method and a path template to an operation name (the
//! `operation` of the key's scope) and its policy. The [`Router`] answers, for
//! any request, one of: an idempotent operation (with its path parameters), a
//! pass-through to some upstream, or no match. Requests are routed by their
//! normal form, and spellings that have none are refused (`normal`).

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};

use crate::idempotency::fingerprint::FingerprintSpec;
use crate::idempotency::record::Retention;
use crate::request::key_source::KeySources;
use crate::retry::Backoff;

pub mod method_override;
mod normal;
#[cfg(test)]
mod normal_props;

pub use normal::{InvalidRequest, check_method, normalise_path};

/// Index into `Config::upstreams`.
pub type UpstreamId = usize;

/// One segment of a path template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param(String),
}

/// A path such as `/v1/accounts/{id}/orders`: literal segments and `{param}`
/// segments, each parameter matching exactly one non-empty path segment
/// without `;` parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathTemplate {
    source: String,
    segments: Vec<Segment>,
    /// The segments as [`normal::loose`] reads a request path: `None` for a
    /// parameter.
    loose: Vec<Option<Vec<u8>>>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathTemplateError {
    #[error("must start with '/'")]
    NotAbsolute,
    #[error("segment {0:?} mixes literal text and a {{param}}; a parameter must be a whole segment")]
    PartialParam(String),
    #[error("parameter name {0:?} must be non-empty ASCII letters, digits or '_'")]
    BadParamName(String),
    #[error("parameter {0:?} appears twice")]
    DuplicateParam(String),
    #[error("must not contain a query string or fragment")]
    QueryOrFragment,
    #[error("is not in normal form ({0}); write unreserved characters unescaped, other escapes with upper-case hex digits, and no ';'")]
    NotNormal(String),
}

impl PathTemplate {
    pub fn parse(source: &str) -> Result<PathTemplate, PathTemplateError> {
        if !source.starts_with('/') {
            return Err(PathTemplateError::NotAbsolute);
        }
        if source.contains('?') || source.contains('#') {
            return Err(PathTemplateError::QueryOrFragment);
        }
        let mut segments = Vec::new();
        let mut names: Vec<&str> = Vec::new();
        for raw in source[1..].split('/') {
            if let Some(inner) = raw.strip_prefix('{').and_then(|r| r.strip_suffix('}')) {
                if inner.is_empty() || !inner.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                    return Err(PathTemplateError::BadParamName(inner.to_owned()));
                }
                if names.contains(&inner) {
                    return Err(PathTemplateError::DuplicateParam(inner.to_owned()));
                }
                names.push(inner);
                segments.push(Segment::Param(inner.to_owned()));
            } else if raw.contains('{') || raw.contains('}') {
                return Err(PathTemplateError::PartialParam(raw.to_owned()));
            } else {
                if raw.contains(';') || raw.contains("%3B") {
                    return Err(PathTemplateError::NotNormal("a segment has ';' parameters".into()));
                }
                segments.push(Segment::Literal(raw.to_owned()));
            }
        }
        // A request is routed by its normal form: a template in another form
        // could never match one.
        let probe: Vec<&str> = segments
            .iter()
            .map(|s| match s {
                Segment::Literal(l) => l.as_str(),
                Segment::Param(_) => "x",
            })
            .collect();
        let probe = format!("/{}", probe.join("/"));
        match normalise_path(&probe) {
            Ok(normal) if normal == probe => {}
            Ok(normal) => return Err(PathTemplateError::NotNormal(format!("its normal form is {normal:?}"))),
            Err(e) => return Err(PathTemplateError::NotNormal(e.to_string())),
        }
        let mut loose: Vec<Option<Vec<u8>>> = segments
            .iter()
            .map(|s| match s {
                Segment::Literal(l) => Some(normal::loose(&format!("/{l}")).concat()),
                Segment::Param(_) => None,
            })
            .collect();
        if loose.len() > 1 && loose.last().is_some_and(|s| s.as_ref().is_some_and(Vec::is_empty)) {
            loose.pop();
        }
        Ok(PathTemplate { source: source.to_owned(), segments, loose })
    }

    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// True when both templates match exactly the same paths: the same literals at the
    /// same places and parameters at the same places (names do not matter), as
    /// `/a/{x}` and `/a/{y}`. Two such routes with one method could never be told apart.
    pub fn same_shape(&self, other: &PathTemplate) -> bool {
        self.segments.len() == other.segments.len()
            && self.segments.iter().zip(&other.segments).all(|pair| match pair {
                (Segment::Literal(a), Segment::Literal(b)) => a == b,
                (Segment::Param(_), Segment::Param(_)) => true,
                _ => false,
            })
    }

    /// Orders templates from most to least specific: compared segment by segment from
    /// the left, a literal comes before a parameter at the first position where one
    /// template has a literal and the other a parameter. Of two templates that match
    /// one path, the one ordered first is the more specific (they differ in kind
    /// somewhere unless they have the same shape). Templates that can never match the
    /// same path (other literals, other lengths) are ordered too, arbitrarily but
    /// consistently, so this is a total order usable for sorting.
    pub fn cmp_specificity(&self, other: &PathTemplate) -> std::cmp::Ordering {
        let is_param = |s: &Segment| matches!(s, Segment::Param(_));
        self.segments.iter().map(is_param).cmp(other.segments.iter().map(is_param))
    }

    /// The names of the `{param}` segments, in template order.
    pub fn param_names(&self) -> impl Iterator<Item = &str> {
        self.segments.iter().filter_map(|s| match s {
            Segment::Param(name) => Some(name.as_str()),
            Segment::Literal(_) => None,
        })
    }

    /// Matches a normal request path (without query, see [`normalise_path`]);
    /// on success returns the parameters in template order. Parameter values
    /// are the segments as they are in the normal path. A segment with `;`
    /// parameters fills no parameter (servers disagree on what it names).
    pub fn matches(&self, path: &str) -> Option<Vec<(String, String)>> {
        let rest = path.strip_prefix('/')?;
        let mut params = Vec::new();
        let mut parts = rest.split('/');
        for seg in &self.segments {
            let part = parts.next()?;
            match seg {
                Segment::Literal(lit) => {
                    if lit != part {
                        return None;
                    }
                }
                Segment::Param(name) => {
                    if part.is_empty() || part == "." || part == ".." || part.contains(';') {
                        return None;
                    }
                    params.push((name.clone(), part.to_owned()));
                }
            }
        }
        if parts.next().is_some() {
            return None;
        }
        Some(params)
    }

    /// Whether a lenient server could read a path (as [`normal::loose`] gives
    /// it) as this template's: literals compared as [`normal::names_loosely`]
    /// reads them, a parameter filled by any non-empty segment.
    fn matches_loosely(&self, path: &[Vec<u8>]) -> bool {
        let last = self.loose.len().saturating_sub(1);
        self.loose.len() == path.len()
            && self.loose.iter().zip(path).enumerate().all(|(i, (seg, part))| match seg {
                Some(lit) => normal::names_loosely(lit, part, i == last),
                None => !part.is_empty(),
            })
    }
}

/// What to do with a duplicate that arrives while the first is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFlightPolicy {
    /// Answer 409 `request-in-progress` with `Retry-After` at once.
    Reject,
    /// Wait up to the duration for the first request's result, then reject.
    Wait(Duration),
}

/// Retries of an async operation whose attempt was refused or declined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included; then `failed_retryable`.
    pub max_attempts: u32,
    /// Delay before the second attempt, doubling after each, capped at `MAX_BACKOFF`.
    pub backoff: Duration,
}

impl RetryPolicy {
    pub const MAX_BACKOFF: Duration = Duration::from_secs(60);

    /// The delay after attempt number `attempts` (1-based) failed.
    /// (Not jittered: the schedule is the route's, as configured.)
    pub fn delay(&self, attempts: i32) -> Duration {
        Backoff::new(self.backoff, Self::MAX_BACKOFF).after(u32::try_from(attempts).unwrap_or(0)).min(Self::MAX_BACKOFF)
    }
}

/// Which `Idempotency-Key` value the upstream receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForwardKey {
    /// A key derived from the whole scope: stable across retries and replicas,
    /// distinct between scopes (the default).
    Derived,
    /// The client's own header value, unchanged.
    Client,
}

/// One `[[routes]]` entry after validation: which requests it takes and
/// where they go, then its policies, grouped by what they decide.
#[derive(Debug, Clone)]
pub struct Route {
    /// Position in the file, for log and error messages.
    pub index: usize,
    /// The operation in the key's scope; also the `route` label in metrics.
    pub operation: Arc<str>,
    pub method: Method,
    pub path: PathTemplate,
    pub upstream: UpstreamId,
    /// Where the key comes from and what it is scoped and compared by.
    pub key: KeyPolicy,
    /// What a record keeps, for how long, and how it answers again.
    pub record: RecordPolicy,
    /// How a request runs.
    pub execution: Execution,
    /// What the background tasks do for the route.
    pub background: BackgroundPolicy,
}

impl Route {
    /// Whether an operation of this route may run asynchronously (always,
    /// or when a request prefers it): the one predicate the async workers,
    /// the metrics and the configuration's checks share.
    pub fn may_run_async(&self) -> bool {
        self.execution.mode.queueing().is_some()
    }

    /// How this route's operations are queued, retried and polled: the
    /// configured settings if they may run asynchronously, else the
    /// defaults (what an operation accepted under an earlier configuration
    /// is polled and retried by).
    pub fn queueing(&self) -> &Queueing {
        self.execution.mode.queueing().unwrap_or(&Queueing::DEFAULT)
    }

    /// Whether the route is observed (`mode = "observe"`).
    pub fn is_observed(&self) -> bool {
        matches!(self.execution.mode, Mode::Observe { .. })
    }
}

/// Where a route's key comes from and what it is scoped and compared by.
#[derive(Debug, Clone)]
pub struct KeyPolicy {
    /// The header `forward_key = "client"` forwards (the one header source).
    pub header: HeaderName,
    /// Where the key is taken from, first present wins (`key_from`; default:
    /// `key_header`).
    pub from: KeySources,
    pub required: bool,
    /// Whose keys are these: one principal's (default), or every principal
    /// of the tenant's (`scope = "tenant"`).
    pub scope: ScopeMode,
    /// Which `Idempotency-Key` value the upstream receives.
    pub forward: ForwardKey,
    /// What of a request its fingerprint reads.
    pub fingerprint: FingerprintSpec,
    /// [`FingerprintSpec::digest`] of `fingerprint`, kept in the records
    /// claimed under it.
    pub fingerprint_digest: Arc<str>,
    /// Status for "same key, different request": 409 (default) or 422.
    pub mismatch_status: StatusCode,
}

/// What a route's records keep, for how long, and how they answer again.
#[derive(Debug, Clone)]
pub struct RecordPolicy {
    /// How long a completed record is replayed.
    pub retention: Retention,
    /// How long a claim is considered alive without a result.
    pub lease: Duration,
    /// What a duplicate of a request in flight gets.
    pub in_flight: InFlightPolicy,
    /// Upstream statuses that free the key instead of being replayed.
    pub release_on_status: Vec<StatusCode>,
    /// Responses up to this size are stored (and replayed) in full.
    pub max_stored_response: u64,
    /// How a completed record is replayed.
    pub replay: ReplayMode,
}

/// How a route's requests run.
#[derive(Debug, Clone)]
pub struct Execution {
    /// Sync, async or observed, with the settings only that mode has.
    pub mode: Mode,
    /// Asked before every request on the route (replays included).
    pub authorize: Option<crate::request::authorize::AuthorizeConfig>,
    /// Admission: this route's own cap on requests in flight (per replica),
    /// within its upstream's limit.
    pub max_in_flight: Option<u32>,
    /// The upstream honours `Idempotency-Key` itself, so an expired in-flight
    /// or unknown record may be forwarded again (with the same derived key).
    pub upstream_idempotent: bool,
}

/// How a route answers: one choice, carrying the settings only it has, so
/// that no combination means nothing (an observed route that runs async, an
/// observe budget on an async route).
#[derive(Debug, Clone, PartialEq)]
pub enum Mode {
    /// The client waits for the upstream's answer (or its replay). With
    /// `respond_async` (`allow_async = true`), a request that sends `Prefer:
    /// respond-async` is accepted instead, as on an async route.
    Sync { respond_async: Option<Queueing> },
    /// The request is accepted (202 and an operation id) and run by workers.
    Async(Queueing),
    /// Every request passes through untouched; idemgate claims and records
    /// as `Sync` would, waiting for the claim at most `budget`, and counts
    /// what enforcing would have changed (see `crate::proxy::observe`).
    Observe { budget: Duration },
}

impl Queueing {
    /// The settings when the configuration gives none.
    pub const DEFAULT: Queueing = Queueing {
        poll_interval: Duration::from_secs(1),
        retry: RetryPolicy { max_attempts: 5, backoff: Duration::from_secs(1) },
        max_queued: 10_000,
    };
}

impl Mode {
    /// How operations are queued and polled, if they may run asynchronously.
    pub fn queueing(&self) -> Option<&Queueing> {
        match self {
            Mode::Async(q) | Mode::Sync { respond_async: Some(q) } => Some(q),
            Mode::Sync { respond_async: None } | Mode::Observe { .. } => None,
        }
    }

    /// Whether every operation runs asynchronously (`mode = "async"`).
    pub fn always_async(&self) -> bool {
        matches!(self, Mode::Async(_))
    }
}

/// How a route's async operations are queued, retried and polled.
#[derive(Debug, Clone, PartialEq)]
pub struct Queueing {
    /// The 202's `Retry-After` and the status document's poll interval.
    pub poll_interval: Duration,
    pub retry: RetryPolicy,
    /// Acceptances are refused once this many operations are queued.
    pub max_queued: u64,
}

/// What the background tasks do for a route.
#[derive(Debug, Clone, Default)]
pub struct BackgroundPolicy {
    /// Completion events for this route's final state changes (the outbox).
    pub events: Option<crate::outbox::EventsConfig>,
    /// `[routes.reconcile]`: the probe that settles this route's `unknown` records.
    pub reconcile: Option<Arc<crate::request::reconcile_probe::Probe>>,
}

/// What a completed record keeps and how it is answered again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayMode {
    /// The stored status, headers and body (up to `max_stored_response`).
    Stored,
    /// Only the status and the `Location` header are kept; a replay reads
    /// `Location` from the upstream again with the caller's own credentials.
    Refetch,
}

/// Who shares a key space on a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScopeMode {
    /// (tenant, principal, operation, key): the default.
    Principal,
    /// (tenant, operation, key): any principal of the tenant replays another's
    /// answer under the same key. Only for operations whose answers every
    /// principal of a tenant may see.
    Tenant,
}

/// The routing decision for one request.
#[derive(Debug)]
pub enum RouteMatch<'a> {
    /// An idempotent operation: method and path matched a route.
    Operation { route: &'a Arc<Route>, params: Vec<(String, String)> },
    /// Proxied without idempotency: another method on a route's path, or the
    /// default upstream.
    PassThrough { upstream: UpstreamId },
    /// No route and no default upstream: 404.
    NotFound,
}

/// All routes. Of the routes whose method and path match a request, the most specific
/// wins ([`PathTemplate::cmp_specificity`]: a literal segment beats a `{param}` at the
/// first position where they differ), whatever their order in the file. Configuration
/// refuses two routes of one method with the same shape, so the winner is unique.
#[derive(Debug, Clone, Default)]
pub struct Router {
    /// In file order, as configured.
    routes: Vec<Arc<Route>>,
    /// The same routes, most specific first (ties in file order), sorted once here so
    /// that routing a request stays one pass that stops at the first match.
    by_specificity: Vec<Arc<Route>>,
    default_upstream: Option<UpstreamId>,
    /// The routes' methods, each once.
    methods: Vec<Method>,
}

impl Router {
    pub fn new(routes: Vec<Route>, default_upstream: Option<UpstreamId>) -> Router {
        let routes: Vec<Arc<Route>> = routes.into_iter().map(Arc::new).collect();
        let mut by_specificity = routes.clone();
        by_specificity.sort_by(|a, b| a.path.cmp_specificity(&b.path));
        let mut methods: Vec<Method> = Vec::new();
        for r in &routes {
            if !methods.contains(&r.method) {
                methods.push(r.method.clone());
            }
        }
        Router { routes, by_specificity, default_upstream, methods }
    }

    /// The normal form of a request's path, or why the request is refused
    /// before routing (its method or its path): see `normal`.
    pub fn normalise<'p>(&self, method: &Method, path: &'p str) -> Result<std::borrow::Cow<'p, str>, InvalidRequest> {
        check_method(method, &self.methods)?;
        normalise_path(path)
    }

    /// Routes a normal path ([`Router::normalise`]) by the one rule for what
    /// may reach an upstream unidentified: a request an upstream could run as
    /// one of the routes' operations is that operation (an exact match of
    /// method and path) or refused, never passed through. Refused:
    /// - a method override (`overridden`: [`method_override::in_head`]) on
    ///   any path a route [`protects`](Router::protects), whatever the
    ///   method (the upstream would run another than the one routed);
    /// - a path that is not an operation of `method` but that a lenient
    ///   server would read as the path of one of its routes
    ///   (`normal::loose`, `normal::names_loosely`);
    /// - a path that is an operation of `method`, but that a lenient server
    ///   would read as the path of a route of `method` more specific than
    ///   the one matched (`Router::shadows`): `/v1/orders/ALL/cancel` is
    ///   `/v1/orders/{id}/cancel`'s exactly, and Express runs
    ///   `/v1/orders/all/cancel` for it;
    /// - HEAD where a GET route protects the path (frameworks run the GET
    ///   handler for HEAD).
    pub fn route_normal(&self, method: &Method, path: &str, overridden: bool) -> Result<RouteMatch<'_>, InvalidRequest> {
        if overridden && self.protects(path, None) {
            return Err(InvalidRequest::MethodOverride);
        }
        let found = self.route(method, path);
        if let RouteMatch::Operation { route, .. } = &found {
            if self.shadows(path, route) {
                return Err(InvalidRequest::Ambiguous);
            }
            return Ok(found);
        }
        if self.methods.contains(method) && self.protects(path, Some(method)) {
            return Err(InvalidRequest::Ambiguous);
        }
        if method == Method::HEAD && self.methods.contains(&Method::GET) && self.protects(path, Some(&Method::GET)) {
            return Err(InvalidRequest::HeadOfGet);
        }
        Ok(found)
    }

    /// Whether an upstream could read `path` (normal) as the path of a route
    /// of `method` (of any method when `None`): exactly, or as a lenient
    /// server reads paths, also behind a PHP front controller (the path
    /// after a segment naming a `.php` script: PHP's `PATH_INFO`, which
    /// Symfony and Laravel route by, so `/index.php/v1/orders` runs the
    /// handler of `/v1/orders`). This is the one predicate for "could this
    /// request be a protected operation" that routing and the
    /// method-override checks (headers, query, body) share.
    pub fn protects(&self, path: &str, method: Option<&Method>) -> bool {
        let loose = normal::loose(path);
        let after_script = loose.iter().position(|s| s.ends_with(b".php")).map(|i| &loose[i + 1..]);
        self.by_specificity.iter().any(|r| {
            method.is_none_or(|m| r.method == *m)
                && (r.path.matches_loosely(&loose) || after_script.is_some_and(|rest| r.path.matches_loosely(rest)))
        })
    }

    /// Whether a route of `matched`'s method, strictly more specific than
    /// `matched` ([`PathTemplate::cmp_specificity`]), names `path` as a
    /// lenient server reads it, though `matched` is the exact match: a
    /// framework that ignores letter case, cuts `;` parameters or takes a
    /// format suffix (Rails' `:id` takes no dots, so `/v1/orders/purge.json`
    /// is `/v1/orders/purge`) would run that route instead. Less specific or
    /// equally specific routes that name it do not count: a router that
    /// prefers the more specific route (or has the literal first, as they
    /// are usually written) picks `matched` over them. (The path after a PHP
    /// script is not looked at here: a route may name that script itself.)
    fn shadows(&self, path: &str, matched: &Route) -> bool {
        let mut stricter = self
            .by_specificity
            .iter()
            .take_while(|r| r.path.cmp_specificity(&matched.path).is_lt())
            .filter(|r| r.method == matched.method)
            .peekable();
        // Most routes have none: the path is not taken apart for them.
        if stricter.peek().is_none() {
            return false;
        }
        let loose = normal::loose(path);
        stricter.any(|r| r.path.matches_loosely(&loose))
    }

    /// [`Router::normalise`], then [`Router::route_normal`] (without an
    /// override): the path the request is routed (and forwarded) as, and
    /// where it goes.
    pub fn resolve<'p>(&self, method: &Method, path: &'p str) -> Result<(std::borrow::Cow<'p, str>, RouteMatch<'_>), InvalidRequest> {
        let normal = self.normalise(method, path)?;
        let found = self.route_normal(method, &normal, false)?;
        Ok((normal, found))
    }

    /// The routes in file order.
    /// The route of an operation (each operation belongs to one route).
    pub fn route_for(&self, operation: &str) -> Option<&Arc<Route>> {
        self.routes.iter().find(|r| &*r.operation == operation)
    }

    pub fn routes(&self) -> &[Arc<Route>] {
        &self.routes
    }

    /// The operation of the most specific route matching method and path; else a
    /// pass-through to the upstream of the most specific route matching the path alone
    /// (another method), else to the default upstream; else not found. `path` must be
    /// normal: requests go through [`Router::resolve`].
    pub fn route(&self, method: &Method, path: &str) -> RouteMatch<'_> {
        let mut path_match: Option<UpstreamId> = None;
        for route in &self.by_specificity {
            if let Some(params) = route.path.matches(path) {
                if route.method == *method {
                    return RouteMatch::Operation { route, params };
                }
                path_match.get_or_insert(route.upstream);
            }
        }
        match path_match.or(self.default_upstream) {
            Some(upstream) => RouteMatch::PassThrough { upstream },
            None => RouteMatch::NotFound,
        }
    }
}

/// The event policies of the routes that have `[routes.events]`.
pub fn event_policies(routes: &[Route]) -> crate::outbox::EventPolicies {
    crate::outbox::EventPolicies::new(routes.iter().filter_map(|r| r.background.events.as_ref().map(|e| (&r.operation, e))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literal_and_param_segments() {
        let t = PathTemplate::parse("/v1/accounts/{id}/orders").unwrap();
        assert_eq!(t.matches("/v1/accounts/42/orders"), Some(vec![("id".into(), "42".into())]));
        assert_eq!(t.matches("/v1/accounts//orders"), None);
        assert_eq!(t.matches("/v1/accounts/42/orders/7"), None);
        assert_eq!(t.matches("/v1/accounts/42"), None);
        assert_eq!(t.matches("v1/accounts/42/orders"), None);
        let lit = PathTemplate::parse("/v1/orders").unwrap();
        assert_eq!(lit.matches("/v1/orders"), Some(vec![]));
        assert_eq!(lit.matches("/v1/orders/"), None);
    }

    #[test]
    fn template_errors() {
        assert_eq!(PathTemplate::parse("v1"), Err(PathTemplateError::NotAbsolute));
        assert_eq!(PathTemplate::parse("/a/x{id}"), Err(PathTemplateError::PartialParam("x{id}".into())));
        assert_eq!(PathTemplate::parse("/a/{}"), Err(PathTemplateError::BadParamName("".into())));
        assert_eq!(PathTemplate::parse("/{a}/{a}"), Err(PathTemplateError::DuplicateParam("a".into())));
        assert_eq!(PathTemplate::parse("/a?b"), Err(PathTemplateError::QueryOrFragment));
        // A request is routed by its normal form: a template in another form could never match.
        for not_normal in
            ["/v1//orders", "//v1", "/v1/./x", "/v1/{id}/..", "/v1/%6Frders", "/v1/%c3%a9", "/v1/a;b", "/v1/a%3Bb", "/v1/%2F", "/a\\b"]
        {
            assert!(matches!(PathTemplate::parse(not_normal), Err(PathTemplateError::NotNormal(_))), "{not_normal}");
        }
        for normal in ["/", "/v1/orders/", "/v1/%C3%A9/{id}", "/v1/.well-known/x", "/V1/Orders"] {
            assert!(PathTemplate::parse(normal).is_ok(), "{normal}");
        }
    }

    pub(super) fn route(op: &str, method: Method, path: &str, upstream: UpstreamId) -> Route {
        Route {
            index: upstream,
            operation: op.into(),
            method,
            path: PathTemplate::parse(path).unwrap(),
            upstream,
            key: KeyPolicy {
                header: HeaderName::from_static("idempotency-key"),
                from: KeySources::header(HeaderName::from_static("idempotency-key")),
                required: true,
                scope: ScopeMode::Principal,
                forward: ForwardKey::Derived,
                fingerprint: FingerprintSpec::default(),
                fingerprint_digest: FingerprintSpec::default().digest().into(),
                mismatch_status: StatusCode::CONFLICT,
            },
            record: RecordPolicy {
                retention: Retention::For(Duration::from_secs(60)),
                lease: Duration::from_secs(5),
                in_flight: InFlightPolicy::Reject,
                release_on_status: vec![],
                max_stored_response: 1024,
                replay: ReplayMode::Stored,
            },
            execution: Execution {
                mode: Mode::Sync { respond_async: None },
                authorize: None,
                max_in_flight: None,
                upstream_idempotent: false,
            },
            background: BackgroundPolicy::default(),
        }
    }

    #[test]
    fn a_path_behind_a_php_front_controller_is_protected() {
        let r = Router::new(
            vec![route("create", Method::POST, "/v1/orders", 0), route("delete", Method::DELETE, "/v1/orders/{id}", 0)],
            Some(0),
        );
        for path in ["/index.php/v1/orders", "/app/Index.PHP/v1/orders.json", "/index.php/v1/orders/42"] {
            assert!(r.protects(path, None), "{path}");
        }
        assert!(r.protects("/index.php/v1/orders", Some(&Method::POST)));
        assert!(!r.protects("/index.php/v1/orders", Some(&Method::DELETE)));
        for path in ["/index.php", "/index.php/v1/elsewhere", "/index.phpx/v1/orders"] {
            assert!(!r.protects(path, None), "{path}");
        }
        assert!(matches!(r.route_normal(&Method::POST, "/index.php/v1/orders", false), Err(InvalidRequest::Ambiguous)));
    }

    #[test]
    fn retry_backoff_doubles_and_is_capped() {
        let p = RetryPolicy { max_attempts: 10, backoff: Duration::from_secs(1) };
        let delays: Vec<u64> = (1..=8).map(|a| p.delay(a).as_secs()).collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(p.delay(0), Duration::from_secs(1));
        assert_eq!(p.delay(i32::MAX), RetryPolicy::MAX_BACKOFF);
    }

    #[test]
    fn router_decisions() {
        let r = Router::new(
            vec![route("create", Method::POST, "/v1/orders", 0), route("cancel", Method::POST, "/v1/orders/{id}/cancel", 1)],
            None,
        );
        match r.route(&Method::POST, "/v1/orders") {
            RouteMatch::Operation { route, params } => {
                assert_eq!(&*route.operation, "create");
                assert!(params.is_empty());
            }
            other => panic!("unexpected {other:?}"),
        }
        match r.route(&Method::POST, "/v1/orders/9/cancel") {
            RouteMatch::Operation { route, params } => {
                assert_eq!(&*route.operation, "cancel");
                assert_eq!(params, vec![("id".to_owned(), "9".to_owned())]);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(r.route(&Method::GET, "/v1/orders/9/cancel"), RouteMatch::PassThrough { upstream: 1 }));
        assert!(matches!(r.route(&Method::GET, "/elsewhere"), RouteMatch::NotFound));
        let with_default = Router::new(vec![], Some(3));
        assert!(matches!(with_default.route(&Method::POST, "/x"), RouteMatch::PassThrough { upstream: 3 }));
    }

    fn operation(r: &Router, method: Method, path: &str) -> Option<String> {
        match r.route(&method, path) {
            RouteMatch::Operation { route, .. } => Some(route.operation.to_string()),
            _ => None,
        }
    }

    #[test]
    fn most_specific_route_wins_whatever_the_file_order() {
        // Issue 8 item 5: with first-match-wins the literal route listed second was unreachable.
        let routes = vec![
            route("cancel_any", Method::POST, "/v1/orders/{other}/cancel", 0),
            route("cancel_all", Method::POST, "/v1/orders/all/cancel", 1),
            route("x_then_lit", Method::POST, "/{a}/x", 2),
            route("lit_then_x", Method::POST, "/a/{b}", 3),
            route("params", Method::POST, "/{p}/{q}", 4),
        ];
        for order in [routes.clone(), routes.iter().rev().cloned().collect()] {
            let r = Router::new(order, None);
            assert_eq!(operation(&r, Method::POST, "/v1/orders/all/cancel").as_deref(), Some("cancel_all"));
            assert_eq!(operation(&r, Method::POST, "/v1/orders/7/cancel").as_deref(), Some("cancel_any"));
            // The first segment where they differ decides: a literal `a` beats `{a}`.
            assert_eq!(operation(&r, Method::POST, "/a/x").as_deref(), Some("lit_then_x"));
            assert_eq!(operation(&r, Method::POST, "/b/x").as_deref(), Some("x_then_lit"));
            assert_eq!(operation(&r, Method::POST, "/a/y").as_deref(), Some("lit_then_x"));
            assert_eq!(operation(&r, Method::POST, "/b/y").as_deref(), Some("params"));
            // `routes()` keeps the file order.
            assert_eq!(r.routes().len(), 5);
        }
    }

    #[test]
    fn an_exact_match_is_refused_when_a_more_specific_route_names_the_path_loosely() {
        // A review: `/v1/orders/ALL/cancel` matched `{other}` exactly and was claimed as
        // `cancel_any`, while Express and ASP.NET Core (letter case ignored) run the literal
        // route; Rails reads `purge.json` as `purge` with a format (`:id` takes no dots).
        let routes = vec![
            route("cancel_any", Method::POST, "/v1/orders/{other}/cancel", 0),
            route("cancel_all", Method::POST, "/v1/orders/all/cancel", 1),
            route("create_by_id", Method::POST, "/v1/orders/{id}", 2),
            route("purge", Method::POST, "/v1/orders/purge", 3),
            route("any_kind", Method::POST, "/v1/{kind}/{id}", 4),
            route("get_any", Method::GET, "/v1/things/{id}", 5),
        ];
        for order in [routes.clone(), routes.iter().rev().cloned().collect()] {
            let r = Router::new(order, None);
            let routed = |method: Method, path: &str| match r.route_normal(&method, path, false) {
                Ok(RouteMatch::Operation { route, .. }) => Ok(route.operation.to_string()),
                Ok(other) => panic!("{method} {path}: {other:?}"),
                Err(e) => Err(e),
            };
            for path in [
                "/v1/orders/ALL/cancel",
                "/v1/orders/All/cancel",
                "/v1/orders/all%3Bx/cancel",
                "/v1/orders/all%20/cancel",
                "/v1/orders/all./cancel",
                "/v1/orders/purge.json",
                "/v1/orders/PURGE",
                "/v1/orders/purge%09",
                "/v1/orders/purge%3Bx",
                // `/v1/orders/{id}` is more specific than `/v1/{kind}/{id}`.
                "/v1/ORDERS/5",
            ] {
                assert_eq!(routed(Method::POST, path), Err(InvalidRequest::Ambiguous), "{path}");
            }
            // Only a less specific route (`{kind}`) names these too: routed as before.
            for (path, op) in [
                ("/v1/orders/all/cancel", "cancel_all"),
                ("/v1/orders/7/cancel", "cancel_any"),
                ("/v1/orders/alligator/cancel", "cancel_any"),
                ("/v1/orders/purge", "purge"),
                ("/v1/orders/5", "create_by_id"),
                ("/v1/orders/purged", "create_by_id"),
                ("/v1/orders/7.json", "create_by_id"),
                ("/v1/invoices/5", "any_kind"),
                ("/v1/things/5", "any_kind"),
            ] {
                assert_eq!(routed(Method::POST, path).as_deref(), Ok(op), "{path}");
            }
            // Another method's more specific route shadows nothing.
            assert_eq!(routed(Method::GET, "/v1/things/5").as_deref(), Ok("get_any"));
        }
    }

    #[test]
    fn method_is_matched_before_specificity_and_pass_through_prefers_the_specific_path() {
        let r = Router::new(
            vec![route("any", Method::POST, "/a/{x}", 0), route("get_b", Method::GET, "/a/b", 1), route("put_b", Method::PUT, "/a/b", 2)],
            Some(9),
        );
        // POST /a/b is the POST route's operation, though a GET route has the literal path.
        assert_eq!(operation(&r, Method::POST, "/a/b").as_deref(), Some("any"));
        assert_eq!(operation(&r, Method::PUT, "/a/b").as_deref(), Some("put_b"));
        // Another method: proxied to the upstream of the most specific path match.
        assert!(matches!(r.route(&Method::DELETE, "/a/b"), RouteMatch::PassThrough { upstream: 1 }));
        assert!(matches!(r.route(&Method::DELETE, "/a/c"), RouteMatch::PassThrough { upstream: 0 }));
        assert!(matches!(r.route(&Method::DELETE, "/z"), RouteMatch::PassThrough { upstream: 9 }));
    }

    #[test]
    fn shapes_compare_literals_and_parameter_positions() {
        let t = |s: &str| PathTemplate::parse(s).unwrap();
        assert!(t("/a/{x}").same_shape(&t("/a/{y}")));
        assert!(t("/v1/{id}/cancel").same_shape(&t("/v1/{order}/cancel")));
        assert!(t("/a").same_shape(&t("/a")));
        assert!(!t("/a/{x}").same_shape(&t("/a/b")));
        assert!(!t("/a/{x}").same_shape(&t("/b/{x}")));
        assert!(!t("/a/{x}").same_shape(&t("/a/{x}/c")));
        assert!(!t("/{x}/a").same_shape(&t("/a/{x}")));
    }
}
