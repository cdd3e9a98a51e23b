//! Admission for the `Relay` service: the bearer token, per-client rate limits, and the stream
//! wrapper that ends every open stream with `UNAVAILABLE` when the relay shuts down.

use crate::shutdown::Shutdown;
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota};
use std::future::Future;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio_stream::Stream;
use tonic::metadata::MetadataValue;
use tonic::{Request, Status};

/// The metadata key of the retry hint on `RESOURCE_EXHAUSTED`, in milliseconds.
pub const RETRY_AFTER_MS: &str = "retry-after-ms";

/// A `RESOURCE_EXHAUSTED` status carrying the retry hint.
pub fn resource_exhausted(message: impl Into<String>, retry_after: Duration) -> Status {
    let mut st = Status::resource_exhausted(message);
    let ms = retry_after.as_millis().max(1).to_string();
    if let Ok(v) = MetadataValue::try_from(ms) {
        st.metadata_mut().insert(RETRY_AFTER_MS, v);
    }
    st
}

/// Checks `authorization: Bearer <token>` on every call to the service it guards.
#[derive(Clone)]
pub struct TokenCheck {
    /// `None`: no token configured, every call passes.
    expected: Option<Vec<u8>>,
}

impl TokenCheck {
    pub fn new(token: Option<&str>) -> Self {
        TokenCheck { expected: token.map(|t| format!("Bearer {t}").into_bytes()) }
    }

    pub fn check(&self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.expected else { return Ok(req) };
        let got = req.metadata().get("authorization").map(|v| v.as_bytes()).unwrap_or_default();
        if constant_time_eq(got, expected) {
            Ok(req)
        } else {
            Err(Status::unauthenticated("missing or wrong bearer token"))
        }
    }
}

/// Compares without an early exit on the first differing byte (the length is not secret).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Per-client rate limit (GCRA, keyed by the peer's IP address). Keys are dropped once their
/// bucket is full again, so the map holds only clients seen within the last burst period.
pub struct ClientLimiter {
    limiter: DefaultKeyedRateLimiter<IpAddr>,
}

impl ClientLimiter {
    pub fn new(per_second: u32, burst: u32) -> Self {
        let per_second = NonZeroU32::new(per_second.max(1)).unwrap_or(NonZeroU32::MIN);
        let burst = NonZeroU32::new(burst.max(1)).unwrap_or(NonZeroU32::MIN);
        ClientLimiter { limiter: DefaultKeyedRateLimiter::keyed(Quota::per_second(per_second).allow_burst(burst)) }
    }

    /// Takes one request from the client's bucket, or says how long to wait.
    pub fn check(&self, peer: Option<IpAddr>, what: &str) -> Result<(), Status> {
        if self.limiter.len() > 10_000 {
            self.limiter.retain_recent();
        }
        let key = peer.unwrap_or(IpAddr::from([0, 0, 0, 0]));
        self.limiter.check_key(&key).map_err(|not_until| {
            let wait = not_until.wait_time_from(DefaultClock::default().now());
            metrics::counter!("kv_relay_rate_limited_total", "rpc" => what.to_string()).increment(1);
            resource_exhausted(format!("{what} rate limit exceeded for {key}"), wait)
        })
    }
}

/// Wraps a response stream: when the relay starts shutting down, the stream yields
/// `UNAVAILABLE "relay shutting down"` at once (messages still buffered are dropped: the client
/// resumes from its cursor) and ends.
pub struct UntilShutdown<S> {
    inner: S,
    shutdown: Pin<Box<dyn Future<Output = ()> + Send>>,
    done: bool,
}

impl<S> UntilShutdown<S> {
    pub fn new(inner: S, mut shutdown: Shutdown) -> Self {
        // A trigger dropped means the server is gone: the same as shutting down.
        let shutdown = Box::pin(async move { shutdown.recv().await });
        UntilShutdown { inner, shutdown, done: false }
    }
}

/// The status every open stream ends with on shutdown.
pub fn shutting_down() -> Status {
    Status::unavailable("relay shutting down")
}

impl<S, T> Stream for UntilShutdown<S>
where
    S: Stream<Item = Result<T, Status>> + Unpin,
{
    type Item = Result<T, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        if self.shutdown.as_mut().poll(cx).is_ready() {
            self.done = true;
            return Poll::Ready(Some(Err(shutting_down())));
        }
        let item = Pin::new(&mut self.inner).poll_next(cx);
        if let Poll::Ready(None) = item {
            self.done = true;
        }
        item
    }
}
