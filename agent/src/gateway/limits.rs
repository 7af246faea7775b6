//! What the gateway holds in memory for its callers, bounded: request bodies across all calls
//! together (`gateway.max_body_bytes_total`), on top of each body's own limit
//! (`gateway.max_body_bytes`) and deadline (`gateway.body_timeout_s`); and plain answers
//! waiting for their callers to take them (`gateway.max_response_bytes_total`): an answer holds
//! its bytes until the caller has read it or gone ([`HeldBody`]).
//!
//! A body's bytes are counted as they arrive (not as its `Content-Length` declares: a caller
//! that declares large bodies and sends nothing must not hold the budget) and stay counted
//! until its call ends, since the body is kept to be forwarded. A call whose
//! body does not fit is refused with a 503 that names the limit, instead of waiting: a body
//! half read holds bytes too, so waiting callers could starve each other.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use bytes::BytesMut;
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::GatewayError;

/// Bytes counted at a time when a body grows past what it holds (fewer wake-ups of the
/// semaphore for a body that arrives in small frames).
const STEP: usize = 64 * 1024;
/// The most a body's buffer takes before its bytes arrive.
const FIRST_CAPACITY: usize = 256 * 1024;

/// The request-body bytes all calls may hold together.
pub struct BodyBudget {
    sem: Arc<Semaphore>,
    limit: usize,
}

/// Bytes a call holds; given back when dropped.
#[derive(Debug, Default)]
pub struct BodyPermit(Option<OwnedSemaphorePermit>);

impl BodyPermit {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.0.as_ref().map_or(0, OwnedSemaphorePermit::num_permits)
    }
}

impl BodyBudget {
    pub fn new(limit: usize) -> BodyBudget {
        BodyBudget { sem: Arc::new(Semaphore::new(limit.min(Semaphore::MAX_PERMITS))), limit }
    }

    /// Bytes free now.
    pub fn available(&self) -> usize {
        self.sem.available_permits()
    }

    fn grow(&self, permit: &mut BodyPermit, n: usize) -> Result<(), GatewayError> {
        if n == 0 {
            return Ok(());
        }
        let n32 = u32::try_from(n).map_err(|_| GatewayError::BodyBudget { limit: self.limit })?;
        let more = self.sem.clone().try_acquire_many_owned(n32).map_err(|_| GatewayError::BodyBudget { limit: self.limit })?;
        match &mut permit.0 {
            Some(p) => p.merge(more),
            None => permit.0 = Some(more),
        }
        Ok(())
    }

    /// `n` bytes counted at once, if they fit.
    pub fn hold(&self, n: usize) -> Option<BodyPermit> {
        let mut permit = BodyPermit::default();
        self.grow(&mut permit, n).ok().map(|()| permit)
    }

    /// Reads a whole request body: at most `max` bytes, within `timeout`, counted against the
    /// budget as they arrive (`declared`, the `Content-Length`, only sizes the steps). The
    /// permit keeps the bytes counted.
    pub async fn read(
        &self,
        body: Body,
        declared: Option<u64>,
        max: usize,
        timeout: Duration,
    ) -> Result<(Bytes, BodyPermit), GatewayError> {
        let mut permit = BodyPermit::default();
        let cap = declared.map_or(max, |d| usize::try_from(d).unwrap_or(usize::MAX).min(max));
        let mut buf = BytesMut::with_capacity(cap.min(FIRST_CAPACITY));
        let mut body = body;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => return Err(GatewayError::BodyTimeout { seconds: timeout.as_secs() }),
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    tracing::debug!(error = %e, "reading a request body failed");
                    return Err(GatewayError::BadRequest("the request body could not be read (the connection broke off)".into()));
                }
                Ok(Some(Ok(f))) => f,
            };
            let Ok(data) = frame.into_data() else { continue };
            let len = buf.len() + data.len();
            if len > max {
                return Err(GatewayError::BodyTooLarge { limit: max });
            }
            if len > permit.bytes() {
                let want = (len - permit.bytes()).max(STEP).min(cap.max(len) - permit.bytes());
                self.grow(&mut permit, want)?;
            }
            buf.extend_from_slice(&data);
        }
        Ok((buf.freeze(), permit))
    }
}

/// Bytes of an answer handed to the connection at a time: the connection takes the next piece
/// only once it has written the last, so an answer's bytes stay counted until a slow reader
/// has nearly all of them.
const ANSWER_PIECE: usize = 64 * 1024;

/// An answer body that keeps its bytes counted until it is sent or dropped (the caller took
/// it, or went away).
pub struct HeldBody {
    data: Bytes,
    _permit: BodyPermit,
}

impl HeldBody {
    pub fn new(data: Bytes, permit: BodyPermit) -> HeldBody {
        HeldBody { data, _permit: permit }
    }
}

impl http_body::Body for HeldBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if self.data.is_empty() {
            return std::task::Poll::Ready(None);
        }
        let n = self.data.len().min(ANSWER_PIECE);
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(self.data.split_to(n)))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_empty()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.data.len() as u64)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bodies_share_one_budget_and_give_it_back() {
        let budget = BodyBudget::new(1000);
        let t = Duration::from_secs(5);
        let (a, pa) = budget.read(Body::from(vec![1u8; 600]), Some(600), 800, t).await.unwrap();
        assert_eq!((a.len(), pa.bytes()), (600, 600));
        // 600 held: a second declared 600 does not fit; one of 400 does.
        let e = budget.read(Body::from(vec![1u8; 600]), Some(600), 800, t).await.unwrap_err();
        assert_eq!((e.status().as_u16(), e.code()), (503, "server_busy"));
        assert!(e.to_string().contains("gateway.max_body_bytes_total"), "{e}");
        let (_, pb) = budget.read(Body::from(vec![1u8; 400]), Some(400), 800, t).await.unwrap();
        assert_eq!(budget.available(), 0);
        drop((pa, pb));
        assert_eq!(budget.available(), 1000);
        // Without a Content-Length (chunked) the bytes are counted as they come.
        let stream = futures_util::stream::iter((0..10).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![2u8; 50]))));
        let (b, p) = budget.read(Body::from_stream(stream), None, 800, t).await.unwrap();
        assert_eq!(b.len(), 500);
        assert!(p.bytes() >= 500 && p.bytes() <= 800);
        // The per-body limit still applies.
        let e = budget.read(Body::from(vec![1u8; 900]), None, 800, t).await.unwrap_err();
        assert_eq!(e.code(), "request_too_large");
        drop(p);
        assert_eq!(budget.available(), 1000, "a refused body gives its bytes back");
        // A declared body that does not come holds nothing of the budget meanwhile.
        let budget = Arc::new(budget);
        let b = budget.clone();
        let waiting = tokio::spawn(async move {
            let never = futures_util::stream::pending::<Result<Bytes, std::io::Error>>();
            b.read(Body::from_stream(never), Some(800), 800, Duration::from_millis(300)).await.map(|_| ())
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(budget.available(), 1000, "a Content-Length alone reserves nothing");
        assert_eq!(waiting.await.unwrap().unwrap_err().code(), "request_timeout");
    }
}
