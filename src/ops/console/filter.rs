//! The records list's filters that the store's list query does not have:
//! a key prefix and a minimum age (`GET /admin/records?key_prefix=&older_than=`,
//! which the console's records page uses). Applied while paging through the
//! store's keyset order, so cursors work as they do without them; one call
//! reads at most [`MAX_SCANNED`] records and then returns what it found with
//! a cursor to go on from.

use std::time::Duration;

use crate::idempotency::record::Record;
use crate::ops::keys::{self, Page};
use crate::store::{ListCursor, ListFilter, Store, StoreError};

/// Records one request reads at most before answering with a cursor.
pub const MAX_SCANNED: usize = 5_000;
const BATCH: u32 = 500;

/// The extra filters; both empty: none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Extra {
    pub key_prefix: Option<String>,
    /// Only records that last changed at least this long ago.
    pub older_than: Option<Duration>,
}

impl Extra {
    pub fn is_empty(&self) -> bool {
        self.key_prefix.is_none() && self.older_than.is_none()
    }

    fn matches(&self, r: &Record, now: crate::idempotency::record::Timestamp) -> bool {
        self.key_prefix.as_deref().is_none_or(|p| r.scope.key.as_str().starts_with(p))
            && self.older_than.is_none_or(|d| r.updated_at.until(now) >= d)
    }
}

/// A page of at most `filter.limit` records matching `filter` and `extra`.
pub async fn list(store: &Store, filter: &ListFilter, extra: &Extra) -> Result<Page, StoreError> {
    if extra.is_empty() {
        return keys::list(store, filter).await;
    }
    let now = store.now().await?;
    let limit = filter.limit as usize;
    let mut scan = ListFilter { limit: BATCH, ..filter.clone() };
    let (mut found, mut scanned) = (Vec::new(), 0usize);
    loop {
        let batch = store.list(&scan).await?;
        let exhausted = batch.len() < BATCH as usize;
        for r in batch {
            scanned += 1;
            scan.cursor = Some(ListCursor::after(&r));
            if extra.matches(&r, now) {
                found.push(r);
                if found.len() == limit {
                    // A next page may or may not hold a match: the cursor
                    // continues after this one either way.
                    let next = found.last().map(|r| keys::encode_cursor(&ListCursor::after(r)));
                    return Ok(Page { records: found, next_cursor: next });
                }
            }
        }
        if exhausted {
            return Ok(Page { records: found, next_cursor: None });
        }
        if scanned >= MAX_SCANNED {
            let next = scan.cursor.as_ref().map(keys::encode_cursor);
            return Ok(Page { records: found, next_cursor: next });
        }
    }
}
