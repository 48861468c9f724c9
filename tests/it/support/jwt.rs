//! Keys and tokens for JWT identity tests, generated in the test: RSA
//! (RS256), P-256 (ES256), Ed25519 (EdDSA) and a shared secret (HS256); a
//! JWKS document of their public halves; and a JWKS server whose document
//! can be swapped or taken down.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use rsa::pkcs1::{EncodeRsaPrivateKey, LineEnding};
use rsa::traits::PublicKeyParts;
use serde_json::{Value, json};

/// A signing key and the JWK of its public half.
#[derive(Clone)]
pub struct SigningKey {
    pub alg: Algorithm,
    pub kid: String,
    pub encoding: EncodingKey,
    pub jwk: Value,
}

fn b64(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

/// One RSA key per test binary (2048-bit generation takes a moment).
fn rsa_key() -> &'static rsa::RsaPrivateKey {
    static KEY: OnceLock<rsa::RsaPrivateKey> = OnceLock::new();
    KEY.get_or_init(|| rsa::RsaPrivateKey::new(&mut rsa::rand_core::OsRng, 2048).expect("generate RSA key"))
}

pub fn rs256(kid: &str) -> SigningKey {
    let key = rsa_key();
    let pem = key.to_pkcs1_pem(LineEnding::LF).expect("RSA PEM");
    SigningKey {
        alg: Algorithm::RS256,
        kid: kid.into(),
        encoding: EncodingKey::from_rsa_pem(pem.as_bytes()).expect("RSA encoding key"),
        jwk: json!({"kty": "RSA", "kid": kid, "use": "sig", "alg": "RS256", "n": b64(&key.n().to_bytes_be()), "e": b64(&key.e().to_bytes_be())}),
    }
}

pub fn es256(kid: &str) -> SigningKey {
    let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("P-256 key");
    let raw = pair.public_key_raw(); // 0x04 || x || y
    SigningKey {
        alg: Algorithm::ES256,
        kid: kid.into(),
        encoding: EncodingKey::from_ec_pem(pair.serialize_pem().as_bytes()).expect("EC encoding key"),
        jwk: json!({"kty": "EC", "kid": kid, "crv": "P-256", "x": b64(&raw[1..33]), "y": b64(&raw[33..65])}),
    }
}

pub fn eddsa(kid: &str) -> SigningKey {
    let pair = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).expect("Ed25519 key");
    SigningKey {
        alg: Algorithm::EdDSA,
        kid: kid.into(),
        encoding: EncodingKey::from_ed_pem(pair.serialize_pem().as_bytes()).expect("Ed encoding key"),
        jwk: json!({"kty": "OKP", "kid": kid, "crv": "Ed25519", "x": b64(pair.public_key_raw())}),
    }
}

pub fn hs256(secret: &str) -> SigningKey {
    SigningKey { alg: Algorithm::HS256, kid: String::new(), encoding: EncodingKey::from_secret(secret.as_bytes()), jwk: Value::Null }
}

pub fn jwks(keys: &[&SigningKey]) -> Value {
    json!({ "keys": keys.iter().map(|k| k.jwk.clone()).collect::<Vec<_>>() })
}

pub fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()
}

/// Standard claims for `tenant`/`sub`, valid for an hour, issued by `iss` for `aud`.
pub fn claims(tenant: &str, sub: &str, iss: &str, aud: &str) -> Value {
    json!({"tenant": tenant, "sub": sub, "iss": iss, "aud": aud, "iat": now(), "exp": now() + 3600})
}

pub fn token(key: &SigningKey, claims: &Value) -> String {
    let mut header = Header::new(key.alg);
    if !key.kid.is_empty() {
        header.kid = Some(key.kid.clone());
    }
    jsonwebtoken::encode(&header, claims, &key.encoding).expect("sign token")
}

/// Serves a JWKS document that tests can replace or take down; counts fetches.
pub struct JwksServer {
    pub addr: SocketAddr,
    doc: Arc<Mutex<Value>>,
    down: Arc<AtomicBool>,
    fetches: Arc<AtomicU64>,
}

impl JwksServer {
    pub async fn start(doc: Value) -> JwksServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind JWKS server");
        let addr = listener.local_addr().unwrap();
        let (doc, down, fetches) = (Arc::new(Mutex::new(doc)), Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let (d, dn, f) = (doc.clone(), down.clone(), fetches.clone());
        super::serve::spawn(listener, tokio_util::sync::CancellationToken::new(), move |_req: Request<Incoming>| {
            let (d, dn, f) = (d.clone(), dn.clone(), f.clone());
            async move {
                f.fetch_add(1, Ordering::SeqCst);
                let mut r = Response::new(Full::new(Bytes::from(d.lock().unwrap().to_string())));
                if dn.load(Ordering::SeqCst) {
                    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                }
                Ok::<_, std::convert::Infallible>(r)
            }
        });
        JwksServer { addr, doc, down, fetches }
    }

    pub fn url(&self) -> String {
        format!("http://{}/jwks.json", self.addr)
    }

    pub fn set(&self, doc: Value) {
        *self.doc.lock().unwrap() = doc;
    }

    /// Answer 503 from now on (`false` to recover).
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    pub fn fetches(&self) -> u64 {
        self.fetches.load(Ordering::SeqCst)
    }
}
