//! Request ids: every request is known by one id, the client's `x-request-id` when it sent a
//! usable one, else one made here. The id comes back in the `x-request-id` response header on
//! every answer (refusals and errors included) and names the tracing span the request runs in,
//! so a client's report and the server's log lines meet on it.
//!
//! Ids are labels, not secrets: they are unique within a process and unlikely to repeat across
//! restarts, nothing more.

use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

pub const HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// The longest client id taken as is; a longer one is replaced.
pub const MAX_LEN: usize = 128;

/// The request's id, in its extensions for handlers that want to quote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestId(pub Arc<str>);

/// Makes ids: a per-process random prefix and a counter, 24 hex digits or more.
pub struct RequestIds {
    prefix: u64,
    next: AtomicU64,
}

impl Default for RequestIds {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestIds {
    pub fn new() -> Self {
        // RandomState is seeded from the OS per process; hashing the clock adds the start time.
        let prefix = RandomState::new().hash_one(std::time::SystemTime::now());
        Self {
            prefix,
            next: AtomicU64::new(1),
        }
    }

    pub fn generate(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{:016x}{n:08x}", self.prefix)
    }
}

/// A client's id is used when it is 1 to [`MAX_LEN`] printable ASCII characters (spaces
/// included); anything else could break log lines or headers, so it is replaced.
pub fn accept(value: &HeaderValue) -> Option<&str> {
    let bytes = value.as_bytes();
    let printable = bytes.iter().all(|&b| b == b' ' || b.is_ascii_graphic());
    if bytes.is_empty() || bytes.len() > MAX_LEN || !printable {
        return None;
    }
    value.to_str().ok()
}

/// Middleware, outermost: picks the id, runs the request inside the span
/// `request{id, method, path, tenant}` (the key check fills in `tenant`) and puts the id on the
/// answer.
pub async fn tag_request(
    State(ids): State<Arc<RequestIds>>,
    mut request: Request,
    next: Next,
) -> Response {
    let id = match request.headers().get(HEADER).and_then(accept) {
        Some(id) => id.to_string(),
        None => ids.generate(),
    };
    let span = tracing::info_span!(
        "request",
        id = %id,
        method = %request.method(),
        path = %request.uri().path(),
        tenant = tracing::field::Empty,
    );
    let header = HeaderValue::from_str(&id);
    request.extensions_mut().insert(RequestId(Arc::from(id)));
    let started = Instant::now();
    let mut response = next.run(request).instrument(span.clone()).await;
    span.in_scope(|| {
        let (status, elapsed_ms) = (
            response.status().as_u16(),
            started.elapsed().as_millis() as u64,
        );
        // Every 5xx is logged with its request id (the span's): a 503 is the server refusing
        // load, any other a fault to look into.
        match status {
            503 => tracing::warn!(status, elapsed_ms, "answered"),
            500.. => tracing::error!(status, elapsed_ms, "answered"),
            _ => tracing::debug!(status, elapsed_ms, "answered"),
        }
    });
    // Accepted and generated ids are printable ASCII, so the header is always valid.
    if let Ok(value) = header {
        response.headers_mut().insert(HEADER, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_are_distinct_and_printable() {
        let ids = RequestIds::new();
        let (a, b) = (ids.generate(), ids.generate());
        assert_ne!(a, b);
        assert_eq!(a.len(), 24);
        assert!(accept(&HeaderValue::from_str(&a).unwrap()).is_some());
    }

    #[test]
    fn only_short_printable_client_ids_are_taken() {
        let take = |v: &[u8]| accept(&HeaderValue::from_bytes(v).unwrap()).map(str::to_string);
        assert_eq!(take(b"abc-123 x"), Some("abc-123 x".into()));
        assert_eq!(take(&[b'a'; MAX_LEN]).map(|s| s.len()), Some(MAX_LEN));
        assert_eq!(take(&[b'a'; MAX_LEN + 1]), None);
        assert_eq!(take(b""), None);
        assert_eq!(take(b"tab\there"), None);
        assert_eq!(take("caf\u{e9}".as_bytes()), None);
    }
}
