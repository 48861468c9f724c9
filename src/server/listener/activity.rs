//! What a TLS connection is doing, for its deadlines: whether a request has
//! reached the service yet, how many are open (a request stays open until
//! its response body has been sent or dropped), and when the last one ended.
//!
//! hyper bounds the wait for HTTP/1.1 headers itself, but not the bytes
//! hyper-util's auto builder reads to tell HTTP/1.1 from HTTP/2, nor an
//! HTTP/2 connection that never completes a request or sits idle between
//! requests: the listener closes those when [`Activity::deadline`] passes.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Frame, SizeHint};
use tokio::time::Instant;

/// `last_end` before any request has ended.
const NONE_YET: u64 = 0;

#[derive(Debug)]
pub struct Activity {
    /// When the connection was handed to hyper (after the TLS handshake).
    start: Instant,
    /// Requests begun and not yet ended.
    open: AtomicUsize,
    /// When the last request ended, in milliseconds after `start`, plus one
    /// (so that `NONE_YET` is below every end and `fetch_max` keeps the latest).
    last_end: AtomicU64,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity { start: Instant::now(), open: AtomicUsize::new(0), last_end: AtomicU64::new(NONE_YET) })
    }

    /// A request reached the service; it is open until the guard is dropped.
    pub fn begin(self: &Arc<Self>) -> InUse {
        self.open.fetch_add(1, Ordering::AcqRel);
        InUse(self.clone())
    }

    /// Whether a request has ever reached the service on this connection.
    pub fn any_request(&self) -> bool {
        self.open.load(Ordering::Acquire) > 0 || self.last_end.load(Ordering::Acquire) != NONE_YET
    }

    /// When the connection is to be closed if nothing happens meanwhile:
    /// `timeout` after it started (no request yet) or after its last request
    /// ended. `None` while a request is open.
    pub fn deadline(&self, timeout: Duration) -> Option<Instant> {
        if self.open.load(Ordering::Acquire) > 0 {
            return None;
        }
        let since = match self.last_end.load(Ordering::Acquire) {
            NONE_YET => Duration::ZERO,
            ms => Duration::from_millis(ms - 1),
        };
        Some(self.start + since + timeout)
    }
}

/// An open request; dropping it ends the request.
#[derive(Debug)]
pub struct InUse(Arc<Activity>);

impl Drop for InUse {
    fn drop(&mut self) {
        let a = &self.0;
        let ms = u64::try_from(a.start.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1;
        // Recorded before the count drops, so a deadline read in between
        // never sees an idle connection with a stale end.
        a.last_end.fetch_max(ms, Ordering::AcqRel);
        a.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request open until the body has been
/// sent (or dropped).
#[derive(Debug)]
pub struct Tracked<B> {
    inner: B,
    in_use: Option<InUse>,
}

impl<B> Tracked<B> {
    pub fn new(inner: B, in_use: InUse) -> Tracked<B> {
        Tracked { inner, in_use: Some(in_use) }
    }
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
            this.in_use = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_deadline_runs_from_the_start_then_from_the_last_request() {
        let t = Duration::from_secs(10);
        let a = Activity::new();
        let start = Instant::now();
        assert!(!a.any_request());
        assert_eq!(a.deadline(t), Some(start + t));
        tokio::time::advance(Duration::from_secs(3)).await;
        let first = a.begin();
        let second = a.begin();
        assert!(a.any_request());
        assert_eq!(a.deadline(t), None, "open requests have no deadline");
        tokio::time::advance(Duration::from_secs(4)).await;
        drop(first);
        assert_eq!(a.deadline(t), None, "one is still open");
        tokio::time::advance(Duration::from_secs(1)).await;
        drop(second);
        assert_eq!(a.deadline(t), Some(start + Duration::from_secs(8) + t));
    }
}
