//! Citus: the PostgreSQL backend on a Citus coordinator, every table
//! distributed by `tenant` (docs/scaling.md).
//!
//! Citus speaks PostgreSQL's protocol, so this is the PostgreSQL backend with
//! a [`Flavor`]: the same pool, failover handling and statements, except
//! where Citus needs a statement of another shape (kept beside the
//! PostgreSQL statement in `sql`), plus what `migrate` does here: the schema
//! of the PostgreSQL migrations, then [`CITUS`], which distributes it.

use tokio_postgres::Transaction;

use super::super::StoreError;
use super::super::migrations::Migration;

/// Which server the PostgreSQL backend talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Flavor {
    /// One PostgreSQL (with standbys): `store.kind = "postgres"`.
    #[default]
    Postgres,
    /// A Citus coordinator: `store.kind = "citus"`.
    Citus,
}

impl Flavor {
    /// `store.kind`, as logs and metrics name the store.
    pub fn kind(self) -> &'static str {
        match self {
            Flavor::Postgres => "postgres",
            Flavor::Citus => "citus",
        }
    }
}

/// Citus's migrations, applied after every PostgreSQL migration, recorded in
/// the same `idemgate_schema_migrations` under versions of their own.
pub const CITUS: &[Migration] =
    &[Migration { version: 1_000_001, name: "citus_0001_distribute", sql: include_str!("../../../migrations/citus/0001_distribute.sql") }];

/// What the server and the database hold, for the checks at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    /// The Citus extension is created in this database.
    pub extension: bool,
    /// `idemgate_records` exists.
    pub records: bool,
    /// `idemgate_records` is a Citus distributed table.
    pub distributed: bool,
}

/// Reads [`Found`]. Plain SQL on any PostgreSQL: `pg_dist_partition` is only
/// looked at when the extension exists.
pub async fn inspect(client: &tokio_postgres::Client) -> Result<Found, tokio_postgres::Error> {
    let row = client
        .query_one("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus'), to_regclass('idemgate_records') IS NOT NULL", &[])
        .await?;
    let (extension, records): (bool, bool) = (row.get(0), row.get(1));
    let distributed = if extension && records {
        client
            .query_one("SELECT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = 'idemgate_records'::regclass)", &[])
            .await?
            .get(0)
    } else {
        false
    };
    Ok(Found { extension, records, distributed })
}

/// Whether a store of `flavor` may use a database holding `found`; if not,
/// the start-up error saying which.
pub fn check(flavor: Flavor, found: Found) -> Result<(), StoreError> {
    match flavor {
        Flavor::Postgres if found.distributed => Err(StoreError::Migration(
            "store.kind = \"postgres\", but this database's idemgate schema is distributed by Citus \
             (idemgate_records is a distributed table): set store.kind = \"citus\""
                .into(),
        )),
        Flavor::Citus if !found.extension => Err(StoreError::Migration(
            "store.kind = \"citus\", but this server has no Citus extension in this database: \
             the URL must name a Citus coordinator's database with `CREATE EXTENSION citus` done and its workers added \
             (docs/scaling.md), or set store.kind = \"postgres\""
                .into(),
        )),
        Flavor::Citus if found.records && !found.distributed => Err(StoreError::Migration(
            "store.kind = \"citus\", but this database holds an idemgate schema that is not distributed \
             (idemgate_records is a plain table, migrated as kind = \"postgres\"): idemgate does not convert a \
             single-node store; migrate an empty database on the coordinator with kind = \"citus\" (docs/scaling.md)"
                .into(),
        )),
        _ => Ok(()),
    }
}

/// Citus's part of `migrate`, inside the migration's transaction (after the
/// PostgreSQL migrations): the migrations of [`CITUS`] not yet in `done`.
/// Returns the names applied.
pub async fn migrate(tx: &Transaction<'_>, done: &[i64]) -> Result<Vec<String>, (String, tokio_postgres::Error)> {
    let mut applied = Vec::new();
    for mig in CITUS.iter().filter(|mig| !done.contains(&mig.version)) {
        tx.batch_execute(mig.sql).await.map_err(|e| (mig.name.to_owned(), e))?;
        tx.execute("INSERT INTO idemgate_schema_migrations (version, name) VALUES ($1, $2)", &[&mig.version, &mig.name])
            .await
            .map_err(|e| (mig.name.to_owned(), e))?;
        applied.push(mig.name.to_owned());
    }
    Ok(applied)
}
