//! The one body type idemgate sends, in both directions: a buffered body, a
//! streamed one (pass-through), or a buffered prefix followed by the rest of a
//! stream (a response larger than `max_stored_response`).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};

#[derive(Debug)]
pub enum Body {
    Full(Option<Bytes>),
    Stream(Incoming),
    Prefixed { prefix: Option<Bytes>, rest: Incoming },
}

impl Body {
    pub fn full(bytes: impl Into<Bytes>) -> Body {
        let b = bytes.into();
        Body::Full(if b.is_empty() { None } else { Some(b) })
    }

    pub fn empty() -> Body {
        Body::Full(None)
    }
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            Body::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Body::Stream(s) => Pin::new(s).poll_frame(cx),
            Body::Prefixed { prefix, rest } => match prefix.take() {
                Some(p) => Poll::Ready(Some(Ok(Frame::data(p)))),
                None => Pin::new(rest).poll_frame(cx),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Full(b) => b.is_none(),
            Body::Stream(s) => s.is_end_stream(),
            Body::Prefixed { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Body::Stream(s) => s.size_hint(),
            Body::Prefixed { prefix, rest } => {
                let p = prefix.as_ref().map_or(0, |b| b.len() as u64);
                let r = rest.size_hint();
                let mut h = SizeHint::new();
                h.set_lower(r.lower() + p);
                if let Some(u) = r.upper() {
                    h.set_upper(u + p);
                }
                h
            }
        }
    }
}
