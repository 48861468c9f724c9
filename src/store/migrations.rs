//! Versioned schema migrations, embedded in the binary. Each backend records
//! applied versions in `idemgate_schema_migrations` and applies the rest in
//! order, each exactly once (PostgreSQL serialises concurrent migrators with
//! an advisory lock; SQLite with its write lock). Versions need not be
//! consecutive (a store that applied 6 before 4 existed applies 4 later);
//! the lists must stay sorted by version, which a test checks.

/// One migration file.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    pub version: i64,
    pub name: &'static str,
    pub sql: &'static str,
}

/// Lists every migration once, by version and name; each store's SQL is
/// `migrations/<store>/<name>.sql` (both stores have every version: a version
/// that changes nothing on one store says so in its file).
macro_rules! migrations {
    ($($version:literal $name:literal,)*) => {
        /// PostgreSQL's migrations, in order.
        pub const POSTGRES: &[Migration] =
            &[$(Migration { version: $version, name: $name, sql: include_str!(concat!("../../migrations/postgres/", $name, ".sql")) },)*];
        /// SQLite's migrations, in order.
        pub const SQLITE: &[Migration] =
            &[$(Migration { version: $version, name: $name, sql: include_str!(concat!("../../migrations/sqlite/", $name, ".sql")) },)*];
    };
}

migrations! {
    1 "0001_records",
    2 "0002_generations_settings_audit",
    3 "0003_async_operations",
    4 "0004_reconciliation_probes",
    5 "0005_scope_id",
    6 "0006_key_source_forever",
    7 "0007_outbox",
    8 "0008_plans_replay_cache",
    9 "0009_scope_collation_c",
    10 "0010_key_first_primary_key",
    11 "0011_scope_id_leads_primary_key",
    12 "0012_audit_caller",
    13 "0013_console_reads",
    14 "0014_attempt_bound",
    15 "0015_event_log",
    16 "0016_event_log_seq",
    17 "0017_event_log_floor",
    18 "0018_reforward_key",
    19 "0019_fingerprint_specs",
}

/// The PostgreSQL migrations that create the event log (nothing on a Citus
/// store; see `0015_event_log.sql`).
pub const EVENT_LOG: [i64; 3] = [15, 16, 17];

/// The `idemgate_settings` row holding the derived-key secret.
pub const DERIVED_KEY_SECRET: &str = "derived_key_secret";

/// A fresh 32-byte secret: 256 bits from the operating system's random
/// source (`getrandom`). A system that cannot give them fails the migration
/// rather than store a weaker key.
pub fn fresh_secret() -> Result<[u8; 32], super::StoreError> {
    let mut s = [0u8; 32];
    getrandom::fill(&mut s).map_err(|e| super::StoreError::Migration(format!("no randomness for the derived-key secret: {e}")))?;
    Ok(s)
}

/// Key for `pg_advisory_xact_lock` while migrating ("idemgate" in ASCII).
pub const PG_LOCK_KEY: i64 = 0x6964_656d_6761_7465;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_secrets_are_32_random_bytes() {
        let (a, b) = (fresh_secret().unwrap(), fresh_secret().unwrap());
        assert_ne!(a, b);
        assert_ne!(a, [0u8; 32]);
    }

    #[test]
    fn the_list_is_sorted_and_named_by_version() {
        for list in [POSTGRES, SQLITE] {
            assert!(list.windows(2).all(|w| w[0].version < w[1].version), "versions must increase");
            for m in list {
                assert!(m.name.starts_with(&format!("{:04}_", m.version)), "{} is not version {}", m.name, m.version);
            }
        }
    }

    #[test]
    fn every_migration_file_is_listed() {
        for (store, list) in [("postgres", POSTGRES), ("sqlite", SQLITE)] {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations").join(store);
            let mut files: Vec<String> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().trim_end_matches(".sql").to_owned())
                .collect();
            files.sort();
            let listed: Vec<String> = list.iter().map(|m| m.name.to_owned()).collect();
            assert_eq!(files, listed, "migrations/{store}/ and the list differ");
        }
    }
}
