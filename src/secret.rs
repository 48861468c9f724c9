//! A value that must never reach a log or an answer.

use std::fmt;

/// A secret value (database URL with password, admin token). Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: String) -> Secret {
        Secret(s)
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// The derived-key secret (the HMAC key of the `Idempotency-Key` sent
/// upstream), shared by everything that derives keys: configured
/// (`server.derived_key_secret_*`), or read from the store once it answers
/// (a gateway that started while PostgreSQL was down learns it later).
/// Nothing is claimed, so nothing is forwarded, before it is known.
#[derive(Clone, Default)]
pub struct DerivedKeySecret(std::sync::Arc<std::sync::OnceLock<Box<[u8]>>>);

impl DerivedKeySecret {
    /// A secret known from the start.
    pub fn known(secret: &[u8]) -> DerivedKeySecret {
        let s = DerivedKeySecret::default();
        s.set(secret);
        s
    }

    /// Sets it, once (later calls change nothing).
    pub fn set(&self, secret: &[u8]) {
        let _ = self.0.set(secret.into());
    }

    pub fn get(&self) -> Option<&[u8]> {
        self.0.get().map(|s| &**s)
    }
}

impl fmt::Debug for DerivedKeySecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.get().is_some() { "DerivedKeySecret(..)" } else { "DerivedKeySecret(unknown yet)" })
    }
}
