//! The one body type idemgate sends, in both directions: a buffered body, a
//! streamed one (pass-through), a buffered prefix followed by the rest of a
//! stream (a response larger than `max_stored_response`), or any other body
//! (observe mode's recording tee). A streamed body that makes no progress for
//! its idle timeout ends with an error, so a stalled peer cannot hold a
//! connection forever.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body as _, Frame, Incoming, SizeHint};
use tokio::time::{Instant, Sleep};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug)]
pub enum Body {
    Full(Option<Bytes>),
    Stream(Streamed),
    Prefixed { prefix: Option<Bytes>, rest: Streamed },
    Boxed(Boxed),
}

/// A body of another type (it does its own idle timing, if it streams).
pub struct Boxed(pub Pin<Box<dyn hyper::body::Body<Data = Bytes, Error = BoxError> + Send>>);

impl std::fmt::Debug for Boxed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Boxed(..)")
    }
}

/// A body read from a peer, cut off after `idle` without a frame.
#[derive(Debug)]
pub struct Streamed {
    inner: ResponseBody,
    idle: Duration,
    timer: Option<Pin<Box<Sleep>>>,
    /// Adds up the data bytes that went through (the access log's `bytes_in`).
    counted: Option<Arc<AtomicU64>>,
}

/// The error a stalled stream ends with.
#[derive(Debug, thiserror::Error)]
#[error("no data for {0:?}: stream cut off")]
pub struct IdleTimeout(pub Duration);

impl Streamed {
    pub fn new(inner: impl Into<ResponseBody>, idle: Duration) -> Streamed {
        Streamed { inner: inner.into(), idle, timer: None, counted: None }
    }

    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                if let Some(timer) = self.timer.as_mut() {
                    timer.as_mut().reset(Instant::now() + self.idle);
                }
                if let (Some(counted), Some(Ok(f))) = (&self.counted, &frame)
                    && let Some(data) = f.data_ref()
                {
                    counted.fetch_add(data.len() as u64, Ordering::Relaxed);
                }
                Poll::Ready(frame.map(|f| f.map_err(BoxError::from)))
            }
            Poll::Pending => {
                let idle = self.idle;
                let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(IdleTimeout(idle))))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl Body {
    pub fn full(bytes: impl Into<Bytes>) -> Body {
        let b = bytes.into();
        Body::Full(if b.is_empty() { None } else { Some(b) })
    }

    pub fn empty() -> Body {
        Body::Full(None)
    }

    /// A body streamed from a peer, cut off after `idle` without progress.
    pub fn stream(inner: impl Into<ResponseBody>, idle: Duration) -> Body {
        Body::Stream(Streamed::new(inner, idle))
    }

    /// [`Body::stream`], adding the data bytes it carries to `counted`.
    pub fn stream_counted(inner: impl Into<ResponseBody>, idle: Duration, counted: Arc<AtomicU64>) -> Body {
        Body::Stream(Streamed { counted: Some(counted), ..Streamed::new(inner, idle) })
    }

    pub fn boxed(inner: impl hyper::body::Body<Data = Bytes, Error = BoxError> + Send + 'static) -> Body {
        Body::Boxed(Boxed(Box::pin(inner)))
    }
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            Body::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Body::Stream(s) => s.poll_frame(cx),
            Body::Prefixed { prefix, rest } => match prefix.take() {
                Some(p) => Poll::Ready(Some(Ok(Frame::data(p)))),
                None => rest.poll_frame(cx),
            },
            Body::Boxed(b) => b.0.as_mut().poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Full(b) => b.is_none(),
            Body::Stream(s) => s.inner.is_end_stream(),
            Body::Prefixed { prefix, rest } => prefix.is_none() && rest.inner.is_end_stream(),
            Body::Boxed(b) => b.0.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Body::Stream(s) => s.inner.size_hint(),
            Body::Prefixed { prefix, rest } => {
                let p = prefix.as_ref().map_or(0, |b| b.len() as u64);
                let r = rest.inner.size_hint();
                let mut h = SizeHint::new();
                h.set_lower(r.lower() + p);
                if let Some(u) = r.upper() {
                    h.set_upper(u + p);
                }
                h
            }
            Body::Boxed(b) => b.0.size_hint(),
        }
    }
}

/// A connection lent to the body it carries (an upstream's pooled HTTP/1.1
/// connection, see `upstream::pool`): driven while the body is read, given
/// back once the body was read to its end.
pub trait Lent: Send {
    /// Drives the connection; false once it ended.
    fn drive(&mut self, cx: &mut Context<'_>) -> bool;
    /// The body was read to its end: the connection goes back if it can
    /// serve another request (hyper saw the end), else it is closed.
    fn give_back(self: Box<Self>);
}

/// A body read from a peer: a request body from a client, or an upstream's
/// response body. From a pooled connection, it drives the connection while
/// it is read and gives it back once read to its end; dropped earlier, the
/// connection is closed.
pub struct ResponseBody {
    inner: Incoming,
    lease: Option<Box<dyn Lent>>,
}

impl std::fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody").field("inner", &self.inner).field("pooled", &self.lease.is_some()).finish()
    }
}

impl From<Incoming> for ResponseBody {
    fn from(inner: Incoming) -> ResponseBody {
        ResponseBody { inner, lease: None }
    }
}

impl ResponseBody {
    /// `inner`, read from the connection `lease` (if pooled).
    pub fn lent(inner: Incoming, lease: Option<Box<dyn Lent>>) -> ResponseBody {
        ResponseBody { inner, lease }
    }

    /// The exchange ended: the connection goes back if it can.
    pub fn release(&mut self) {
        if let Some(lease) = self.lease.take() {
            lease.give_back();
        }
    }
}

impl hyper::body::Body for ResponseBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if let Some(lease) = this.lease.as_mut()
            && !lease.drive(cx)
        {
            // The connection ended; what it read is in the body's channel,
            // its error if it failed.
            this.lease = None;
        }
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.release(),
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => this.release(),
            Poll::Ready(Some(Err(_))) => this.lease = None,
            _ => {}
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
