//! Group commit for the two writes every first request makes: concurrent
//! claims share one INSERT statement, concurrent result writes one UPDATE.
//!
//! Each statement is still one autocommitted statement, and each request still
//! learns its own outcome before it goes on (a claim before its forward), but
//! N requests pay for one commit instead of N. Batches form naturally: while
//! `concurrency` statements are running, new requests queue, and the next
//! statement takes all of them (up to `max_batch`). At low load a batch is one
//! request and nothing waits.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::store::StoreError;

struct Job<I, O> {
    item: I,
    reply: oneshot::Sender<Result<O, StoreError>>,
}

/// Queues items for `exec`, which runs one statement for a whole batch and
/// returns one result per item, in order.
pub(super) struct Batcher<I, O> {
    tx: mpsc::UnboundedSender<Job<I, O>>,
}

impl<I, O> std::fmt::Debug for Batcher<I, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Batcher")
    }
}

impl<I: Send + 'static, O: Send + 'static> Batcher<I, O> {
    /// Starts the batching task. It ends when the batcher is dropped (the
    /// store goes away), after finishing the batches already taken, so
    /// results of a draining gateway are still written.
    pub(super) fn start<F, Fut>(name: &'static str, max_batch: usize, concurrency: usize, exec: F) -> Batcher<I, O>
    where
        F: Fn(Vec<I>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<O>, StoreError>> + Send + 'static,
    {
        let (tx, mut rx) = mpsc::unbounded_channel::<Job<I, O>>();
        let exec = Arc::new(exec);
        let slots = Arc::new(Semaphore::new(concurrency.max(1)));
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                // Wait for a free slot first: meanwhile the queue fills up.
                let Ok(slot) = slots.clone().acquire_owned().await else { break };
                let mut jobs = vec![first];
                while jobs.len() < max_batch {
                    match rx.try_recv() {
                        Ok(job) => jobs.push(job),
                        Err(_) => break,
                    }
                }
                // A caller that stopped waiting (its operation timed out and it
                // answered, or it is reading the row back) must not have its
                // statement run behind its back: skip it.
                jobs.retain(|job| !job.reply.is_closed());
                if jobs.is_empty() {
                    continue;
                }
                let exec = exec.clone();
                tokio::spawn(async move {
                    let (items, replies): (Vec<I>, Vec<_>) = jobs.into_iter().map(|j| (j.item, j.reply)).unzip();
                    let n = items.len();
                    match exec(items).await {
                        Ok(results) if results.len() == n => {
                            for (reply, result) in replies.into_iter().zip(results) {
                                let _ = reply.send(Ok(result));
                            }
                        }
                        Ok(results) => {
                            let e = StoreError::Corrupt(format!("{name}: batch of {n} returned {} results", results.len()));
                            for reply in replies {
                                let _ = reply.send(Err(e.clone()));
                            }
                        }
                        Err(e) => {
                            for reply in replies {
                                let _ = reply.send(Err(e.clone()));
                            }
                        }
                    }
                    drop(slot);
                });
            }
            tracing::debug!(batcher = name, "batcher stopped");
        });
        Batcher { tx }
    }

    /// Adds `item` to the next batch and waits for its result.
    pub(super) async fn submit(&self, item: I) -> Result<O, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Job { item, reply }).map_err(|_| StoreError::Unavailable("store is shutting down".into()))?;
        // A dropped reply means the batch task died: the statement may or may
        // not have run.
        rx.await.unwrap_or_else(|_| Err(StoreError::Ambiguous("batch task ended without an answer".into())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_items_share_batches_and_get_their_own_results() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let batcher = Arc::new(Batcher::start("test", 64, 1, move |items: Vec<u32>| {
            let c = c.clone();
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok(items.into_iter().map(|i| i * 10).collect())
            }
        }));
        let mut tasks = Vec::new();
        for i in 0..100u32 {
            let b = batcher.clone();
            tasks.push(tokio::spawn(async move { (i, b.submit(i).await) }));
        }
        for t in tasks {
            let (i, r) = t.await.unwrap();
            assert_eq!(r.unwrap(), i * 10);
        }
        let n = calls.load(Ordering::SeqCst);
        assert!((2..100).contains(&n), "100 items took {n} statements");
    }

    #[tokio::test]
    async fn a_failed_batch_fails_every_item() {
        let batcher = Batcher::start("test", 8, 1, |_items: Vec<u32>| async { Err::<Vec<u32>, _>(StoreError::Ambiguous("lost".into())) });
        assert!(matches!(batcher.submit(1).await, Err(StoreError::Ambiguous(_))));
    }
}
