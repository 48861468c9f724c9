//! Citus: each tenant's request statements sent to the node that holds the
//! tenant's shard (issue 47, docs/scaling.md "Gateways on every node").
//!
//! Citus 11+ lets every node plan distributed statements. A statement that
//! enters at the node holding its shard runs there, in the backend that
//! planned it (Citus's local execution), and, when it names its tenant as a
//! constant, with a plan made once per connection: a read costs 1.4 times
//! what it costs on one PostgreSQL, against 10-14 times through the
//! coordinator (docs/performance-notes.md, "Citus: what a statement costs").
//!
//! When `store.url` lists several hosts, a Citus store opens, beside its
//! pool (which walks the hosts for a writable one, as on PostgreSQL), one
//! pool per host, whose sessions use generic plans. Each host says which
//! node group it is (`pg_dist_local_group`); the shard map (each shard's
//! hash range and group, for `idemgate_records` and the tables colocated
//! with it) is read every [`REFRESH`] through the store's pool, and a
//! tenant's hash once (`worker_hash`, the function Citus prunes with). A
//! tenant's statements go to the pool of the host whose group holds its
//! shard; when none is known or that pool cannot connect, to the store's
//! pool, where Citus routes them itself. Routing is only where a statement
//! is planned: whichever node it enters, Citus runs it on the shard's
//! current placement, so a stale map (a shard moved since) costs a remote
//! execution, never a wrong result. A node that is down fails the
//! statements of its tenants (their shards are there), which the caller
//! answers as any store failure: closed.
// deadpool's pool status and the refresh's pacing use the wall clock.
#![allow(clippy::disallowed_types)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::time::Duration;

use super::failover::one_host;
use super::{Db, Flavor, pooler, sql};
use crate::store::{Pooler, StoreError};

/// How often the shard map and the hosts' groups are read again.
const REFRESH: Duration = Duration::from_secs(5);
/// Tenants whose hash is remembered; past this the memory starts again.
const MAX_TENANTS: usize = 65_536;

/// A shard of the records' colocation group: its hash range and the group
/// of the node that holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Shard {
    min: i32,
    max: i32,
    group: i32,
}

/// One host of the URL, with its own pool.
#[derive(Debug)]
struct Node {
    db: Db,
    /// Its node group, once it answered.
    group: Mutex<Option<i32>>,
}

/// See the module documentation.
#[derive(Debug)]
pub(super) struct Router {
    nodes: Vec<Node>,
    /// The wait for one host's answer when the hosts are asked in turn
    /// (which is the coordinator): the operation timeout shared among them.
    ask_bound: Duration,
    shards: RwLock<Vec<Shard>>,
    hashes: Mutex<HashMap<Arc<str>, i32>>,
}

impl Router {
    /// One pool per host of `config` when it lists several hosts (`None`
    /// otherwise, or behind a pooler in transaction mode, which keeps no
    /// prepared statement: every statement then goes through the store's
    /// pool). `main` is the store's pool, which reads the shard map.
    pub(super) fn start(
        config: &tokio_postgres::Config,
        tls: Option<&rustls::ClientConfig>,
        pool_size: usize,
        timeout: Duration,
        pooler: Pooler,
        main: &Db,
    ) -> Result<Option<Arc<Router>>, StoreError> {
        let hosts = config.get_hosts().len().max(config.get_hostaddrs().len());
        if hosts < 2 || pooler == Pooler::Transaction {
            return Ok(None);
        }
        let sessions = Arc::new(pooler::Sessions::with(pooler, sql::routed_session_settings(), timeout));
        let mut nodes = Vec::with_capacity(hosts);
        for i in 0..hosts {
            let one = one_host(config, i);
            let db = Db::open(&one, tls, pool_size, timeout, Flavor::Citus, sessions.clone())
                .map_err(|e| StoreError::Unavailable(format!("cannot build the connection pool of node {i}: {e}")))?;
            nodes.push(Node { db, group: Mutex::new(None) });
        }
        // Migrating is not on the request path: a host gets at least a second
        // (a fresh connection, TLS included), at most the whole timeout.
        let ask_bound = (timeout / u32::try_from(hosts).unwrap_or(u32::MAX)).max(Duration::from_secs(1)).min(timeout);
        let router = Arc::new(Router { nodes, ask_bound, shards: RwLock::default(), hashes: Mutex::default() });
        let weak = Arc::downgrade(&router);
        let main = main.clone();
        tokio::spawn(async move { refresh_forever(weak, main).await });
        Ok(Some(router))
    }

    /// The pool of the node that holds `tenant`'s shard, if it is known;
    /// reads the tenant's hash through `main` the first time.
    pub(super) async fn node_of(&self, main: &Db, tenant: &Arc<str>) -> Option<&Db> {
        let known = self.hashes.lock().unwrap_or_else(PoisonError::into_inner).get(tenant).copied();
        let hash = match known {
            Some(h) => h,
            None => {
                let rows = main.query("SELECT worker_hash($1::text)", &[&&**tenant], false).await.ok()?;
                let h: i32 = rows.first()?.try_get(0).ok()?;
                let mut hashes = self.hashes.lock().unwrap_or_else(PoisonError::into_inner);
                if hashes.len() >= MAX_TENANTS {
                    hashes.clear();
                }
                hashes.insert(tenant.clone(), h);
                h
            }
        };
        let group = self.shards.read().unwrap_or_else(PoisonError::into_inner).iter().find(|s| s.min <= hash && hash <= s.max)?.group;
        self.nodes.iter().find(|n| *n.group.lock().unwrap_or_else(PoisonError::into_inner) == Some(group)).map(|n| &n.db)
    }

    /// Reads the shard map through `main`, and the group of each host not
    /// yet known (each on its own pool, bounded: a host down answers later).
    async fn refresh(&self, main: &Db) {
        match main.query(SHARD_MAP, &[], false).await {
            Ok(rows) => {
                let map: Vec<Shard> = rows
                    .iter()
                    .filter_map(|r| Some(Shard { min: r.try_get(0).ok()?, max: r.try_get(1).ok()?, group: r.try_get(2).ok()? }))
                    .collect();
                *self.shards.write().unwrap_or_else(PoisonError::into_inner) = map;
            }
            Err(e) => {
                crate::telemetry::throttle::warn_throttled!(error = %e, "the Citus shard map could not be read; statements go through the store's pool meanwhile")
            }
        }
        for i in 0..self.nodes.len() {
            self.learn_group(i).await;
        }
    }

    /// Asks host `i` its node group, while it is not known.
    async fn learn_group(&self, i: usize) {
        let Some(node) = self.nodes.get(i) else { return };
        if node.group.lock().unwrap_or_else(PoisonError::into_inner).is_some() {
            return;
        }
        // A node whose metadata was never synced says group 0, as the
        // coordinator does: its group is not known until it is added.
        let ask = "SELECT CASE WHEN groupid <> 0 OR citus_is_coordinator() THEN groupid END FROM pg_dist_local_group";
        match node.db.query(ask, &[], false).await {
            Ok(rows) => {
                let group: Option<i32> = rows.first().and_then(|r| r.try_get(0).ok());
                tracing::info!(host = i, group = ?group, "Citus node: statements of the tenants whose shards it holds go to it");
                *node.group.lock().unwrap_or_else(PoisonError::into_inner) = group;
            }
            Err(e) => tracing::debug!(host = i, error = %e, "Citus node did not say its group yet"),
        }
    }

    /// The pool of the host that says it is the coordinator
    /// (`citus_is_coordinator()`: group 0 with worker nodes known; a node
    /// whose metadata is not synced is group 0 too), asking the hosts in
    /// the URL's order, each for at most its share of the operation
    /// timeout; `None` when none of them says so in time.
    pub(super) async fn coordinator(&self) -> Option<&Db> {
        for (i, node) in self.nodes.iter().enumerate() {
            let asked = tokio::time::timeout(self.ask_bound, node.db.query("SELECT citus_is_coordinator()", &[], false)).await;
            match asked {
                Ok(Ok(rows)) if rows.first().and_then(|r| r.try_get::<_, bool>(0).ok()) == Some(true) => return Some(&node.db),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::debug!(host = i, error = %e, "Citus node did not say whether it is the coordinator"),
                Err(_) => tracing::debug!(host = i, "Citus node did not say in time whether it is the coordinator"),
            }
        }
        None
    }
}

/// Each shard of the records (and so of the tables colocated with them) with
/// its hash range and the group of its active primary placement.
const SHARD_MAP: &str = "SELECT s.shardminvalue::int4, s.shardmaxvalue::int4, p.groupid FROM pg_dist_shard s \
     JOIN pg_dist_placement p ON p.shardid = s.shardid \
     JOIN pg_dist_node n ON n.groupid = p.groupid AND n.noderole = 'primary' AND n.isactive \
     WHERE s.logicalrelid = 'idemgate_records'::regclass";

/// Refreshes the router until the store is dropped.
async fn refresh_forever(router: Weak<Router>, main: Db) {
    loop {
        let Some(r) = router.upgrade() else { return };
        r.refresh(&main).await;
        drop(r);
        tokio::time::sleep(REFRESH).await;
    }
}
