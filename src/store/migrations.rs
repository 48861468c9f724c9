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

pub const POSTGRES: &[Migration] = &[
    Migration { version: 1, name: "0001_records", sql: include_str!("../../migrations/postgres/0001_records.sql") },
    Migration {
        version: 2,
        name: "0002_generations_settings_audit",
        sql: include_str!("../../migrations/postgres/0002_generations_settings_audit.sql"),
    },
    Migration { version: 3, name: "0003_async_operations", sql: include_str!("../../migrations/postgres/0003_async_operations.sql") },
    Migration {
        version: 4,
        name: "0004_reconciliation_probes",
        sql: include_str!("../../migrations/postgres/0004_reconciliation_probes.sql"),
    },
    Migration { version: 5, name: "0005_scope_id", sql: include_str!("../../migrations/postgres/0005_scope_id.sql") },
    Migration { version: 6, name: "0006_key_source_forever", sql: include_str!("../../migrations/postgres/0006_key_source_forever.sql") },
    Migration { version: 7, name: "0007_outbox", sql: include_str!("../../migrations/postgres/0007_outbox.sql") },
    Migration { version: 8, name: "0008_plans_replay_cache", sql: include_str!("../../migrations/postgres/0008_plans_replay_cache.sql") },
    Migration { version: 9, name: "0009_scope_collation_c", sql: include_str!("../../migrations/postgres/0009_scope_collation_c.sql") },
    Migration {
        version: 10,
        name: "0010_key_first_primary_key",
        sql: include_str!("../../migrations/postgres/0010_key_first_primary_key.sql"),
    },
    Migration {
        version: 11,
        name: "0011_scope_id_leads_primary_key",
        sql: include_str!("../../migrations/postgres/0011_scope_id_leads_primary_key.sql"),
    },
    Migration { version: 12, name: "0012_audit_caller", sql: include_str!("../../migrations/postgres/0012_audit_caller.sql") },
    Migration { version: 13, name: "0013_console_reads", sql: include_str!("../../migrations/postgres/0013_console_reads.sql") },
];

pub const SQLITE: &[Migration] = &[
    Migration { version: 1, name: "0001_records", sql: include_str!("../../migrations/sqlite/0001_records.sql") },
    Migration {
        version: 2,
        name: "0002_generations_settings_audit",
        sql: include_str!("../../migrations/sqlite/0002_generations_settings_audit.sql"),
    },
    Migration { version: 3, name: "0003_async_operations", sql: include_str!("../../migrations/sqlite/0003_async_operations.sql") },
    Migration {
        version: 4,
        name: "0004_reconciliation_probes",
        sql: include_str!("../../migrations/sqlite/0004_reconciliation_probes.sql"),
    },
    Migration { version: 5, name: "0005_scope_id", sql: include_str!("../../migrations/sqlite/0005_scope_id.sql") },
    Migration { version: 6, name: "0006_key_source_forever", sql: include_str!("../../migrations/sqlite/0006_key_source_forever.sql") },
    Migration { version: 7, name: "0007_outbox", sql: include_str!("../../migrations/sqlite/0007_outbox.sql") },
    Migration { version: 8, name: "0008_plans_replay_cache", sql: include_str!("../../migrations/sqlite/0008_plans_replay_cache.sql") },
    Migration { version: 9, name: "0009_scope_collation_c", sql: include_str!("../../migrations/sqlite/0009_scope_collation_c.sql") },
    Migration {
        version: 10,
        name: "0010_key_first_primary_key",
        sql: include_str!("../../migrations/sqlite/0010_key_first_primary_key.sql"),
    },
    Migration {
        version: 11,
        name: "0011_scope_id_leads_primary_key",
        sql: include_str!("../../migrations/sqlite/0011_scope_id_leads_primary_key.sql"),
    },
    Migration { version: 12, name: "0012_audit_caller", sql: include_str!("../../migrations/sqlite/0012_audit_caller.sql") },
    Migration { version: 13, name: "0013_console_reads", sql: include_str!("../../migrations/sqlite/0013_console_reads.sql") },
];

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
    fn lists_are_sorted_unique_and_alike() {
        for list in [POSTGRES, SQLITE] {
            assert!(list.windows(2).all(|w| w[0].version < w[1].version), "versions must increase");
            for m in list {
                assert!(m.name.starts_with(&format!("{:04}_", m.version)), "{} is not version {}", m.name, m.version);
            }
        }
        let names = |l: &[Migration]| l.iter().map(|m| m.name).collect::<Vec<_>>();
        assert_eq!(names(POSTGRES), names(SQLITE), "both stores have the same migrations");
    }
}
