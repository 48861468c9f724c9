//! Versioned schema migrations, embedded in the binary. Each backend records
//! applied versions in `idemgate_schema_migrations` and applies the rest in
//! order, each exactly once (PostgreSQL serialises concurrent migrators with
//! an advisory lock; SQLite with its write lock).

/// One migration file.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    pub version: i64,
    pub name: &'static str,
    pub sql: &'static str,
}

pub const POSTGRES: &[Migration] =
    &[Migration { version: 1, name: "0001_records", sql: include_str!("../../migrations/postgres/0001_records.sql") }];

pub const SQLITE: &[Migration] =
    &[Migration { version: 1, name: "0001_records", sql: include_str!("../../migrations/sqlite/0001_records.sql") }];

/// Key for `pg_advisory_xact_lock` while migrating ("idemgate" in ASCII).
pub const PG_LOCK_KEY: i64 = 0x6964_656d_6761_7465;
