//! JWT identity (CONTRACT section 8): RS256, ES256, EdDSA and HS256 with
//! keys generated here; valid, expired, not yet valid, wrong issuer or
//! audience, tampered, unknown kid (one refresh, rate limited), JWKS
//! endpoint down (the last good set stays); and through the real binary: a
//! token's claims are the scope, an invalid one is 401 with nothing claimed
//! and the token never echoed.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use http::{HeaderMap, HeaderValue};
use idemgate::config::Config;
use idemgate::request::identity::{Identifier, Identity};
use serde_json::json;
use support::jwt::{self, JwksServer, SigningKey};
use support::*;

const ISS: &str = "https://issuer.example";
const AUD: &str = "idemgate";

/// An identifier with one JWT source, built from TOML like the gateway's.
fn identifier(source: &str, env: &[(&str, &str)]) -> Identifier {
    let text = format!(
        "[server]\ndefault_upstream = \"u\"\n[[upstreams]]\nname = \"u\"\nurl = \"http://127.0.0.1:9\"\n[[identity.sources]]\nkind = \"jwt\"\n{source}\n"
    );
    let env: Vec<(String, String)> = env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    let config = Config::from_toml(&text, "test.toml", &|name| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
        .unwrap_or_else(|e| panic!("{e}"));
    Identifier::new(config.identity)
}

fn bearer(token: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("authorization", HeaderValue::from_str(&format!("Bearer {token}")).unwrap());
    h
}

async fn who(id: &Identifier, token: &str) -> Option<Identity> {
    id.identify(&bearer(token), "192.0.2.1".parse().unwrap(), None).await
}

fn acme_alice() -> Option<Identity> {
    Some(Identity { tenant: "acme".into(), principal: "alice".into() })
}

fn jwks_file(dir: &tempfile::TempDir, keys: &[&SigningKey]) -> String {
    let path = dir.path().join("jwks.json");
    std::fs::write(&path, jwt::jwks(keys).to_string()).unwrap();
    path.display().to_string()
}

#[tokio::test]
async fn every_algorithm_verifies_with_its_key_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let (rs, es, ed) = (jwt::rs256("rs"), jwt::es256("es"), jwt::eddsa("ed"));
    let file = jwks_file(&dir, &[&rs, &es, &ed]);
    let id = identifier(
        &format!(
            "jwks_file = \"{file}\"\nissuer = \"{ISS}\"\naudience = \"{AUD}\"\nalgorithms = [\"RS256\", \"ES256\", \"EdDSA\", \"HS256\"]\nsecret_env = \"HS\""
        ),
        &[("HS", "hs-secret")],
    );
    let c = jwt::claims("acme", "alice", ISS, AUD);
    for key in [&rs, &es, &ed, &jwt::hs256("hs-secret")] {
        assert_eq!(who(&id, &jwt::token(key, &c)).await, acme_alice(), "{:?}", key.alg);
    }
    // A key of another issuer (not in the set), a wrong HMAC secret: refused.
    assert_eq!(who(&id, &jwt::token(&jwt::es256("es"), &c)).await, None, "same kid, another key");
    assert_eq!(who(&id, &jwt::token(&jwt::hs256("guess"), &c)).await, None);
    // Tampered payload.
    let t = jwt::token(&rs, &c);
    let mut parts: Vec<&str> = t.split('.').collect();
    let forged = jwt::token(&jwt::hs256("x"), &jwt::claims("evil", "mallory", ISS, AUD));
    parts[1] = forged.split('.').nth(1).unwrap();
    assert_eq!(who(&id, &parts.join(".")).await, None);
    // An algorithm that is not allowed.
    let only_rs = identifier(&format!("jwks_file = \"{file}\"\nalgorithms = [\"RS256\"]"), &[]);
    assert_eq!(who(&only_rs, &jwt::token(&es, &c)).await, None);
    assert_eq!(who(&only_rs, &jwt::token(&rs, &c)).await, acme_alice());
}

#[tokio::test]
async fn time_issuer_audience_and_claims_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let key = jwt::es256("k");
    let file = jwks_file(&dir, &[&key]);
    let id = identifier(&format!("jwks_file = \"{file}\"\nissuer = \"{ISS}\"\naudience = [\"{AUD}\", \"other\"]\nleeway = \"5s\""), &[]);
    let ok = jwt::claims("acme", "alice", ISS, AUD);
    assert_eq!(who(&id, &jwt::token(&key, &ok)).await, acme_alice());
    let with = |k: &str, v: serde_json::Value| {
        let mut c = ok.clone();
        c[k] = v;
        jwt::token(&key, &c)
    };
    assert_eq!(who(&id, &with("exp", json!(jwt::now() - 60))).await, None, "expired");
    assert_eq!(who(&id, &with("exp", json!(jwt::now() - 2))).await, acme_alice(), "within the leeway");
    assert_eq!(who(&id, &with("nbf", json!(jwt::now() + 60))).await, None, "not yet valid");
    assert_eq!(who(&id, &with("iss", json!("https://evil.example"))).await, None, "wrong issuer");
    assert_eq!(who(&id, &with("aud", json!("someone-else"))).await, None, "wrong audience");
    assert_eq!(who(&id, &with("aud", json!("other"))).await, acme_alice(), "any configured audience");
    assert_eq!(who(&id, &with("tenant", json!(null))).await, None, "no tenant claim: no identity");
    let mut no_exp = ok.clone();
    no_exp.as_object_mut().unwrap().remove("exp");
    assert_eq!(who(&id, &jwt::token(&key, &no_exp)).await, None, "exp is required");
    // A configured issuer or audience is required, not only compared when
    // present: a token of the same keys made for another service (no `aud`,
    // as many providers' access tokens) is not this gateway's.
    for claim in ["iss", "aud"] {
        let mut without = ok.clone();
        without.as_object_mut().unwrap().remove(claim);
        assert_eq!(who(&id, &jwt::token(&key, &without)).await, None, "{claim} is required once configured");
    }
    assert_eq!(who(&id, &with("aud", json!(42))).await, None, "an audience that is not a string");
    assert_eq!(who(&id, &with("iss", json!({}))).await, None, "an issuer that is not a string");
    // Without them configured, a token needs neither.
    let open = identifier(&format!("jwks_file = \"{file}\""), &[]);
    let mut bare = ok.clone();
    bare.as_object_mut().unwrap().remove("iss");
    bare.as_object_mut().unwrap().remove("aud");
    assert_eq!(who(&open, &jwt::token(&key, &bare)).await, acme_alice(), "neither is required when not configured");
    // Nested claims by JSON Pointer, numbers marked as numbers.
    let nested = identifier(&format!("jwks_file = \"{file}\"\ntenant_claim = \"/org/id\"\nprincipal_claim = \"uid\""), &[]);
    let c = json!({"org": {"id": 42}, "uid": "u-1", "exp": jwt::now() + 60});
    assert_eq!(who(&nested, &jwt::token(&key, &c)).await, Some(Identity { tenant: "#42".into(), principal: "u-1".into() }));
    // Not a JWT at all: not this source's business.
    assert_eq!(who(&id, "not-a-jwt").await, None);
}

/// A claim keeps its JSON type: `{"sub": 123}` and `{"sub": "123"}` are two
/// principals (they were one, so the second token was replayed the first
/// one's answers), and a string cannot spell the number's principal.
#[tokio::test]
async fn claims_of_different_json_types_never_name_one_principal() {
    let dir = tempfile::tempdir().unwrap();
    let key = jwt::es256("k");
    let file = jwks_file(&dir, &[&key]);
    let id = identifier(&format!("jwks_file = \"{file}\""), &[]);
    let with_sub = |sub: serde_json::Value| jwt::token(&key, &json!({"tenant": "acme", "sub": sub, "exp": jwt::now() + 60}));
    let number = who(&id, &with_sub(json!(123))).await.expect("a number is a principal");
    let string = who(&id, &with_sub(json!("123"))).await.expect("a string is a principal");
    assert_ne!(number, string, "a number and a string never collide");
    assert_eq!(&*string.principal, "123");
    assert_eq!(who(&id, &with_sub(json!(123))).await, Some(number.clone()), "stable");
    assert_eq!(who(&id, &with_sub(json!(format!("{}", number.principal)))).await, None, "a string spelling the number's principal");
    assert_eq!(who(&id, &with_sub(json!("#not-a-number"))).await.map(|i| i.principal), Some("#not-a-number".into()));
    for other in [json!(true), json!(null), json!([1]), json!({"a": 1}), json!("")] {
        assert_eq!(who(&id, &with_sub(other.clone())).await, None, "{other}");
    }
}

#[tokio::test]
async fn unknown_kid_refreshes_once_and_a_failed_refresh_keeps_the_last_good_set() {
    let (old, new) = (jwt::rs256("old"), jwt::es256("new"));
    let server = JwksServer::start(jwt::jwks(&[&old])).await;
    let id = identifier(&format!("jwks_url = \"{}\"\njwks_refresh = \"1h\"", server.url()), &[]);
    let sources = id.jwks_urls();
    assert_eq!(sources.len(), 1);
    assert!(sources[0].refresh().await, "the start-up fetch");
    let c = jwt::claims("acme", "alice", ISS, AUD);
    assert_eq!(who(&id, &jwt::token(&old, &c)).await, acme_alice());
    // The issuer rotates: a token with a kid not in the set triggers one refresh.
    server.set(jwt::jwks(&[&old, &new]));
    let before = server.fetches();
    assert_eq!(who(&id, &jwt::token(&new, &c)).await, acme_alice(), "found after the refresh");
    assert_eq!(server.fetches(), before + 1);
    // Unknown kids cannot make it fetch again and again.
    let stranger = jwt::es256("stranger");
    for _ in 0..5 {
        assert_eq!(who(&id, &jwt::token(&stranger, &c)).await, None);
    }
    assert!(server.fetches() <= before + 2, "rate limited: {} fetches", server.fetches() - before);
    // The endpoint goes down: the refresh fails and the last good set stays.
    server.set_down(true);
    assert!(!sources[0].refresh().await);
    assert_eq!(who(&id, &jwt::token(&old, &c)).await, acme_alice());
    assert_eq!(who(&id, &jwt::token(&new, &c)).await, acme_alice());
    // A key removed from the set stops working at the next refresh (revocation).
    server.set_down(false);
    server.set(jwt::jwks(&[&new]));
    assert!(sources[0].refresh().await);
    assert_eq!(who(&id, &jwt::token(&old, &c)).await, None);
}

/// A key set may publish keys this gateway cannot read (an X25519
/// encryption key, a curve it does not know) beside its signing keys: those
/// are skipped, the others still verify. One such key made the whole set
/// unreadable (a file refused, a URL's set never replaced).
#[tokio::test]
async fn a_key_set_with_a_key_it_cannot_read_still_verifies_with_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let key = jwt::es256("k");
    let mut set = jwt::jwks(&[&key]);
    set["keys"]
        .as_array_mut()
        .unwrap()
        .push(json!({"kty": "OKP", "crv": "X25519", "use": "enc", "kid": "enc-1", "x": "hSDwCYkwp1R0i33ctD73Wg2_Og0mOBr066SpjqqbTmo"}));
    set["keys"].as_array_mut().unwrap().push(json!({"kty": "EC", "crv": "P-521", "alg": "ES512", "kid": "p521", "x": "AA", "y": "AA"}));
    let path = dir.path().join("jwks.json");
    std::fs::write(&path, set.to_string()).unwrap();
    let id = identifier(&format!("jwks_file = \"{}\"", path.display()), &[]);
    let c = jwt::claims("acme", "alice", ISS, AUD);
    assert_eq!(who(&id, &jwt::token(&key, &c)).await, acme_alice());
}

/// Requests that arrive together with a key the source has not fetched yet
/// (at start, or right after a reload builds the source anew) all wait for
/// the one fetch their first caller makes, and are then verified: those
/// that waited for it were refused as "refreshed too recently" before.
#[tokio::test]
async fn requests_waiting_for_the_first_fetch_are_verified_with_its_keys() {
    let key = jwt::es256("k");
    let server = JwksServer::start(jwt::jwks(&[&key])).await;
    let id = identifier(&format!("jwks_url = \"{}\"\njwks_refresh = \"1h\"", server.url()), &[]);
    let c = jwt::claims("acme", "alice", ISS, AUD);
    let token = jwt::token(&key, &c);
    let answers = futures_util::future::join_all((0..20).map(|_| who(&id, &token))).await;
    let refused = answers.iter().filter(|a| a.is_none()).count();
    assert_eq!(refused, 0, "{refused} of 20 requests refused while the first one fetched the keys");
    assert_eq!(server.fetches(), 1, "one fetch for all of them");
}

#[test]
fn bad_jwt_sources_are_refused_with_their_path() {
    let bad = |source: &str| {
        let text = format!(
            "[server]\ndefault_upstream = \"u\"\n[[upstreams]]\nname = \"u\"\nurl = \"http://h:1\"\n[[identity.sources]]\nkind = \"jwt\"\n{source}\n"
        );
        Config::from_toml(&text, "t.toml", &|_| None).unwrap_err().to_string()
    };
    assert!(bad("").contains("identity.sources[0].jwks_file"), "{}", bad(""));
    assert!(bad("jwks_file = \"/nonexistent/jwks.json\"").contains("cannot read /nonexistent/jwks.json"));
    assert!(bad("jwks_file = \"a\"\njwks_url = \"http://h/\"").contains("identity.sources[0].jwks_url"));
    assert!(bad("algorithms = [\"none\"]\njwks_url = \"http://h/\"").contains("identity.sources[0].algorithms[0]"));
    assert!(bad("algorithms = [\"HS256\"]").contains("identity.sources[0].secret_env"));
}

/// Through the real binary: the token's claims are the key's scope; an
/// expired or forged token is 401, nothing is claimed, the problem never
/// echoes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwt_identity_scopes_records_and_refuses_bad_tokens() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let key = jwt::rs256("k1");
    let server = JwksServer::start(jwt::jwks(&[&key])).await;
    let mut cfg = GatewayConfig::new(backend.clone(), up.url());
    cfg = cfg.identity(&format!(
        "[[identity.sources]]\nkind = \"jwt\"\njwks_url = \"{}\"\nissuer = \"{ISS}\"\naudience = \"{AUD}\"\n",
        server.url()
    ));
    let gw = Gateway::start(cfg);
    let store = backend.open().await;
    let url = gw.url("/v1/orders");
    let good = jwt::token(&key, &jwt::claims("acme", "billing", ISS, AUD));
    let body = r#"{"item":"book"}"#;
    let send_with = |token: String, k: &'static str| {
        let url = url.clone();
        async move {
            send(
                "POST",
                &url,
                &[("authorization", &format!("Bearer {token}")), ("idempotency-key", k), ("content-type", "application/json")],
                body,
            )
            .await
            .unwrap()
        }
    };
    // The first request may race the start-up JWKS fetch: the unknown kid refreshes.
    let first = send_with(good.clone(), "j1").await;
    assert_eq!(first.status, 201, "{first:?}\n{}", gw.logs());
    assert!(send_with(good.clone(), "j1").await.replayed());
    let rec = settled_record(&store, "j1").await.expect("scoped by the token's tenant and sub");
    assert_eq!((&*rec.scope.tenant, &*rec.scope.principal), (TENANT, PRINCIPAL));
    let mut expired = jwt::claims("acme", "billing", ISS, AUD);
    expired["exp"] = json!(jwt::now() - 3600);
    let stale = jwt::token(&key, &expired);
    let r = send_with(stale.clone(), "j2").await;
    assert_eq!((r.status, r.problem().as_str()), (401, "unauthenticated"));
    assert!(!String::from_utf8_lossy(&r.body).contains(&stale[..20]), "the token is never echoed");
    assert!(settled_record(&store, "j2").await.is_none(), "nothing claimed");
    assert_eq!(up.total(), 1);
}

/// RFC 7515 section 4.1.11: a header whose `crit` names extensions the
/// recipient does not understand must be refused. idemgate understands none:
/// such a token is no identity (401, nothing claimed, nothing forwarded),
/// while the same claims signed without `crit` pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_with_critical_extensions_is_refused() {
    use base64::Engine as _;
    use hmac::Mac as _;
    let secret = "a-shared-secret-of-at-least-32-bytes!";
    let sign = |header: serde_json::Value| {
        let b64 = |v: &serde_json::Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string());
        let input = format!("{}.{}", b64(&header), b64(&jwt::claims("acme", "billing", ISS, AUD)));
        let mut mac = <hmac::Hmac<sha2::Sha256> as hmac::KeyInit>::new_from_slice(secret.as_bytes()).unwrap();
        mac.update(input.as_bytes());
        let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
        format!("{input}.{sig}")
    };
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("hs");
    std::fs::write(&secret_file, secret).unwrap();
    let id = identifier(
        &format!("algorithms = [\"HS256\"]\nsecret_file = \"{}\"\nissuer = \"{ISS}\"\naudience = \"{AUD}\"", secret_file.display()),
        &[],
    );
    let plain = sign(json!({"alg": "HS256", "typ": "JWT"}));
    let critical = sign(json!({"alg": "HS256", "typ": "JWT", "crit": ["exp-policy"], "exp-policy": "strict"}));
    let empty_crit = sign(json!({"alg": "HS256", "typ": "JWT", "crit": []}));
    let acme = Some(Identity { tenant: "acme".into(), principal: "billing".into() });
    assert_eq!(who(&id, &plain).await, acme, "the control token verifies");
    assert_eq!(who(&id, &critical).await, None, "an unknown critical extension");
    assert_eq!(who(&id, &empty_crit).await, None, "an empty crit list is malformed too");

    // Through the real binary.
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).identity(&format!(
        "[[identity.sources]]\nkind = \"jwt\"\nalgorithms = [\"HS256\"]\nsecret_file = \"{}\"\nissuer = \"{ISS}\"\naudience = \"{AUD}\"\n",
        secret_file.display()
    )));
    let store = backend.open().await;
    let with = |token: &str, key: &'static str| {
        let auth = format!("Bearer {token}");
        let url = gw.url("/v1/orders");
        async move { send("POST", &url, &[("authorization", auth.as_str()), ("idempotency-key", key)], "{}").await.unwrap() }
    };
    let r = with(&critical, "c1").await;
    assert_eq!((r.status, r.problem().as_str()), (401, "unauthenticated"));
    assert!(settled_record(&store, "c1").await.is_none(), "nothing claimed");
    assert_eq!(up.total(), 0);
    assert_eq!(with(&plain, "c2").await.status, 201);
    assert_eq!(up.total(), 1);
}

/// Sleeps until the wall clock (the verifier's, in whole seconds) is past `exp`.
async fn until_past(exp: u64) {
    while jwt::now() <= exp {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The cache of verified tokens (issue 32) answers a token seen before
/// without verifying it again, but never once a fresh verification would
/// refuse it: past its `exp` (leeway 0 here), or once the key that signed it
/// left the key set or was replaced under the same `kid`. A token differing
/// in its signature is another token: never a hit.
#[tokio::test]
async fn a_cached_token_is_refused_once_expired() {
    let key = jwt::es256("k");
    let server = JwksServer::start(jwt::jwks(&[&key])).await;
    let id = identifier(&format!("jwks_url = \"{}\"\njwks_refresh = \"1h\"\nleeway = \"0s\"", server.url()), &[]);
    let source = &id.jwks_urls()[0];
    assert!(source.refresh().await);
    let mut c = jwt::claims("acme", "alice", ISS, AUD);
    let exp = jwt::now() + 2;
    c["exp"] = json!(exp);
    let token = jwt::token(&key, &c);
    assert_eq!(who(&id, &token).await, acme_alice());
    assert_eq!(who(&id, &token).await, acme_alice());
    assert_eq!(source.cache_hits(), 1, "the second one was answered from the cache");
    until_past(exp).await;
    assert_eq!(who(&id, &token).await, None, "expired, although cached");
    assert_eq!(source.cache_hits(), 1);
    // A fresh token of the same key is verified and cached again.
    let fresh = jwt::token(&key, &jwt::claims("acme", "alice", ISS, AUD));
    assert_eq!(who(&id, &fresh).await, acme_alice());
    assert_eq!(who(&id, &fresh).await, acme_alice());
    assert_eq!(source.cache_hits(), 2);
}

#[tokio::test]
async fn a_cached_token_is_refused_once_its_key_leaves_the_key_set_or_changes() {
    let (old, new) = (jwt::rs256("old"), jwt::es256("new"));
    let server = JwksServer::start(jwt::jwks(&[&old, &new])).await;
    let id = identifier(&format!("jwks_url = \"{}\"\njwks_refresh = \"1h\"", server.url()), &[]);
    let source = &id.jwks_urls()[0];
    assert!(source.refresh().await);
    let c = jwt::claims("acme", "alice", ISS, AUD);
    let (by_old, by_new) = (jwt::token(&old, &c), jwt::token(&new, &c));
    for t in [&by_old, &by_new, &by_old, &by_new] {
        assert_eq!(who(&id, t).await, acme_alice());
    }
    assert_eq!(source.cache_hits(), 2);
    // An unchanged key set keeps the entries.
    assert!(source.refresh().await);
    assert_eq!(who(&id, &by_old).await, acme_alice());
    assert_eq!(source.cache_hits(), 3);
    // "old" leaves the set: its token is refused, although cached; "new" stays.
    server.set(jwt::jwks(&[&new]));
    assert!(source.refresh().await);
    assert_eq!(who(&id, &by_old).await, None, "signed by a key no longer in the set");
    assert_eq!(who(&id, &by_new).await, acme_alice());
    assert_eq!(source.cache_hits(), 4);
    // "new" is replaced by another key under the same kid.
    server.set(jwt::jwks(&[&jwt::es256("new")]));
    assert!(source.refresh().await);
    assert_eq!(who(&id, &by_new).await, None, "its kid now names another key");
    assert_eq!(source.cache_hits(), 4);
}

#[tokio::test]
async fn a_token_with_another_signature_is_never_a_cache_hit() {
    let key = jwt::es256("k");
    let server = JwksServer::start(jwt::jwks(&[&key])).await;
    let id = identifier(&format!("jwks_url = \"{}\"\njwks_refresh = \"1h\"", server.url()), &[]);
    let source = &id.jwks_urls()[0];
    assert!(source.refresh().await);
    let c = jwt::claims("acme", "alice", ISS, AUD);
    let token = jwt::token(&key, &c);
    assert_eq!(who(&id, &token).await, acme_alice());
    assert_eq!(who(&id, &token).await, acme_alice());
    assert_eq!(source.cache_hits(), 1);
    let (signed, _) = token.rsplit_once('.').unwrap();
    // The same header and claims signed by another key under the same kid.
    let forged = jwt::token(&jwt::es256("k"), &c);
    assert_eq!(forged.rsplit_once('.').unwrap().0, signed, "same signing input");
    assert_eq!(who(&id, &forged).await, None, "another key's signature");
    // The signature changed in one character.
    let sig: Vec<char> = token.rsplit_once('.').unwrap().1.chars().collect();
    let mut altered = sig.clone();
    altered[10] = if sig[10] == 'A' { 'B' } else { 'A' };
    let altered = format!("{signed}.{}", altered.into_iter().collect::<String>());
    assert_eq!(who(&id, &altered).await, None, "a changed signature");
    assert_eq!(source.cache_hits(), 1, "neither was a hit");
    // ES256 signatures are randomized: a second valid signature of the same
    // input is another token, verified (not a hit) and accepted.
    let resigned = jwt::token(&key, &c);
    assert_ne!(resigned, token);
    assert_eq!(who(&id, &resigned).await, acme_alice());
    assert_eq!(source.cache_hits(), 1);
    assert_eq!(who(&id, &token).await, acme_alice(), "the cached token still is");
    assert_eq!(source.cache_hits(), 2);
}

/// Through the real binary, the JWKS refreshed every second and no leeway:
/// tokens seen before are answered again (replays), but a cached token past
/// its `exp`, or signed by a key the last refresh removed from the set, is
/// 401 like any invalid token: nothing claimed, nothing forwarded, the
/// stored response not replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_refuses_cached_tokens_once_expired_or_their_key_is_gone() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let (k1, k2) = (jwt::es256("k1"), jwt::es256("k2"));
    let server = JwksServer::start(jwt::jwks(&[&k1, &k2])).await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).identity(&format!(
        "[[identity.sources]]\nkind = \"jwt\"\njwks_url = \"{}\"\njwks_refresh = \"1s\"\nleeway = \"0s\"\nissuer = \"{ISS}\"\naudience = \"{AUD}\"\n",
        server.url()
    )));
    let store = backend.open().await;
    let post = |token: &str, key: &'static str| {
        let auth = format!("Bearer {token}");
        let url = gw.url("/v1/orders");
        async move { send("POST", &url, &[("authorization", auth.as_str()), ("idempotency-key", key)], r#"{"item":"book"}"#).await.unwrap() }
    };
    let by_k1 = jwt::token(&k1, &jwt::claims("acme", "billing", ISS, AUD));
    let mut short = jwt::claims("acme", "billing", ISS, AUD);
    let exp = jwt::now() + 5;
    short["exp"] = json!(exp);
    let by_k2_short = jwt::token(&k2, &short);
    for (token, key) in [(&by_k1, "a"), (&by_k2_short, "b")] {
        let first = post(token, key).await;
        assert_eq!(first.status, 201, "{first:?}\n{}", gw.logs());
        assert!(post(token, key).await.replayed(), "the token again (from the cache): a replay");
    }
    let unauthenticated = |r: &Resp| r.status == 401 && r.problem() == "unauthenticated";

    // Past its exp: refused, the replay included.
    until_past(exp).await;
    assert!(unauthenticated(&post(&by_k2_short, "b").await), "an expired token's replay");
    assert!(unauthenticated(&post(&by_k2_short, "c").await), "an expired token's first write");

    // k1 leaves the key set: once the gateway has fetched it, k1's token is refused.
    let before = server.fetches();
    server.set(jwt::jwks(&[&k2]));
    assert!(eventually(std::time::Duration::from_secs(15), || async { server.fetches() >= before + 2 }).await, "JWKS refreshed");
    assert!(unauthenticated(&post(&by_k1, "a").await), "a removed key's token, replay");
    assert!(unauthenticated(&post(&by_k1, "d").await), "a removed key's token, first write");
    // k2 stays: a fresh token of it works.
    let by_k2 = jwt::token(&k2, &jwt::claims("acme", "billing", ISS, AUD));
    assert!(post(&by_k2, "a").await.replayed());

    for key in ["a", "b"] {
        let rec = settled_record(&store, key).await.expect("recorded");
        assert_eq!(rec.state, idemgate::idempotency::record::State::Completed, "{key}");
    }
    for key in ["c", "d"] {
        assert!(settled_record(&store, key).await.is_none(), "{key}: nothing claimed");
    }
    assert_eq!(up.total(), 2, "only the two first writes reached the upstream");
}
