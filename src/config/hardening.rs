//! Warnings: settings that are valid but insecure. Each names its TOML path,
//! the risk, and the item of the "Hardening" checklist in docs/operations.md
//! that says what to do instead. `check-config` prints them (`--strict` makes
//! them errors), `serve` and a reload log them.

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

/// Secrets shorter than this many bytes are worth a warning.
pub const MIN_SECRET_BYTES: usize = 32;

/// API keys printed in this repository (the example configuration, the
/// demo): anyone who read it can present them.
const PUBLISHED_KEYS: [&str; 2] = ["example-key-change-me", "demo-key"];

/// A JWT leeway longer than this keeps expired tokens alive too long.
pub const MAX_JWT_LEEWAY: std::time::Duration = std::time::Duration::from_secs(300);

/// A trusted network with a shorter prefix than this is "very wide" (an
/// IPv4 /7 is two /8s; `10.0.0.0/8` and IPv6 `fd00::/8` are usual).
const MIN_TRUSTED_PREFIX: u8 = 8;

/// The items of the "Hardening" checklist (their headings in docs/operations.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hardening {
    TrustedPeers,
    Secrets,
    Database,
    Jwt,
    ClientCertificates,
    KeysUpstream,
}

impl Hardening {
    /// The `###` heading of the item under "## Hardening".
    pub fn title(self) -> &'static str {
        match self {
            Hardening::TrustedPeers => "Trusted peers",
            Hardening::Secrets => "Tokens and secrets",
            Hardening::Database => "Database connection",
            Hardening::Jwt => "JWT sources",
            Hardening::ClientCertificates => "Client certificates",
            Hardening::KeysUpstream => "Keys sent upstream",
        }
    }
}

/// One insecure setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigWarning {
    /// TOML path of the setting, e.g. `identity.sources[1].trusted_peers[0]`.
    pub path: String,
    /// What can go wrong, in a sentence (never the secret itself).
    pub risk: String,
    pub hardening: Hardening,
}

impl fmt::Display for ConfigWarning {
    /// `path: warning: risk; see docs/operations.md (Hardening: item)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: warning: {}; see docs/operations.md (Hardening: {})", self.path, self.risk, self.hardening.title())
    }
}

/// Collects warnings while validating.
#[derive(Debug, Default)]
pub(crate) struct Warnings {
    pub(crate) list: Vec<ConfigWarning>,
}

impl Warnings {
    pub(crate) fn push(&mut self, path: impl Into<String>, hardening: Hardening, risk: impl Into<String>) {
        self.list.push(ConfigWarning { path: path.into(), risk: risk.into(), hardening });
    }

    /// `trusted_peers` entries wide enough to let (nearly) anyone assert an identity.
    pub(crate) fn trusted_peers(&mut self, path: &str, nets: &[IpNet], headers: &str) {
        for (k, net) in nets.iter().enumerate() {
            if net.prefix_len() == 0 {
                self.push(
                    format!("{path}[{k}]"),
                    Hardening::TrustedPeers,
                    format!(
                        "{net} trusts every address: anyone who can reach the listener may assert any tenant and principal in {headers}"
                    ),
                );
            } else if net.prefix_len() < MIN_TRUSTED_PREFIX {
                self.push(
                    format!("{path}[{k}]"),
                    Hardening::TrustedPeers,
                    format!("{net} is a very wide range: any host in it may assert any tenant and principal in {headers}"),
                );
            }
        }
    }

    /// An API key whose SHA-256 is `digest` and that this repository
    /// publishes ([`PUBLISHED_KEYS`]).
    pub(crate) fn published_key(&mut self, path: &str, digest: &[u8; 32]) {
        use sha2::{Digest, Sha256};
        if let Some(key) = PUBLISHED_KEYS.iter().find(|k| Sha256::digest(k.as_bytes()).as_slice() == digest) {
            self.push(
                path,
                Hardening::Secrets,
                format!(
                    "this is the SHA-256 of `{key}`, a key printed in idemgate's own examples: anyone who read them can act as this \
                     tenant and principal; use a key of {MIN_SECRET_BYTES} random bytes or more"
                ),
            );
        }
    }

    /// A token or HMAC secret shorter than [`MIN_SECRET_BYTES`].
    pub(crate) fn short_secret(&mut self, path: &str, what: &str, len: usize, consequence: &str) {
        if len < MIN_SECRET_BYTES {
            self.push(
                path,
                Hardening::Secrets,
                format!(
                    "the {what} is {len} byte(s), shorter than {MIN_SECRET_BYTES}: it can be guessed, and {consequence}; use {MIN_SECRET_BYTES} random bytes or more"
                ),
            );
        }
    }
}

/// Whether a file's mode lets its group or others read it (so another
/// account on the machine can read the secret in it). `None`: unknown.
pub(crate) fn readable_by_others(path: &str) -> Option<bool> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).ok().map(|m| m.permissions().mode() & 0o077 != 0)
}

/// Whether a certificate pattern can match a field it should not: not
/// anchored at the start (`^` or `\\A`: `acme` matches `evil-acme`), or,
/// when the whole match is the value (`groups` false), not anchored at the
/// end either (`^acme` matches `acme-evil`).
pub(crate) fn unanchored(pattern: &str, groups: bool) -> bool {
    let start = pattern.starts_with('^') || pattern.starts_with("\\A");
    let end = (pattern.ends_with('$') && !pattern.ends_with("\\$")) || pattern.ends_with("\\z");
    !start || (!groups && !end)
}

/// Whether every host of a PostgreSQL connection is this machine (a Unix
/// socket, `localhost` or a loopback address).
pub(crate) fn database_is_local(config: &tokio_postgres::Config) -> bool {
    let local_ip = |ip: IpAddr| ip.is_loopback();
    if !config.get_hostaddrs().is_empty() {
        return config.get_hostaddrs().iter().all(|ip| local_ip(*ip));
    }
    config.get_hosts().iter().all(|h| match h {
        tokio_postgres::config::Host::Tcp(name) => {
            name.eq_ignore_ascii_case("localhost") || name.trim_matches(['[', ']']).parse::<IpAddr>().is_ok_and(local_ip)
        }
        #[cfg(unix)]
        tokio_postgres::config::Host::Unix(_) => true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wide_trusted_networks_are_warned_about() {
        let mut w = Warnings::default();
        let nets: Vec<IpNet> = ["10.0.0.0/8", "127.0.0.1/32", "0.0.0.0/0", "::/0", "128.0.0.0/1", "fd00::/8", "::1/128"]
            .iter()
            .map(|n| n.parse().unwrap())
            .collect();
        w.trusted_peers("p", &nets, "x-tenant-id / x-principal-id");
        let paths: Vec<&str> = w.list.iter().map(|w| w.path.as_str()).collect();
        assert_eq!(paths, ["p[2]", "p[3]", "p[4]"]);
        assert!(w.list.iter().all(|w| w.hardening == Hardening::TrustedPeers));
    }

    #[test]
    fn unanchored_patterns() {
        for (pattern, groups) in [("^acme-(\\w+)$", true), ("\\A(.*)\\z", true), ("^spiffe://([^/]+)/", true), ("^acme$", false)] {
            assert!(!unanchored(pattern, groups), "{pattern}");
        }
        for (pattern, groups) in
            [("acme-(\\w+)", true), ("spiffe://([^/]+)/", true), ("^acme", false), ("acme$", false), ("^acme\\$", false)]
        {
            assert!(unanchored(pattern, groups), "{pattern}");
        }
    }

    #[test]
    fn locality_of_database_hosts() {
        let local = |s: &str| database_is_local(&s.parse().unwrap());
        assert!(local("postgres://u@localhost/x"));
        assert!(local("postgres://u@127.0.0.1:5432/x"));
        assert!(local("postgres://u@[::1]:5432/x"));
        assert!(local("host=/run/postgresql user=u"));
        assert!(!local("postgres://u@db.internal/x"));
        assert!(!local("postgres://u@localhost,db.internal/x"));
        assert!(!local("host=db.invalid hostaddr=10.0.0.5 user=u"));
        assert!(local("host=db.invalid hostaddr=127.0.0.1 user=u"));
    }
}
