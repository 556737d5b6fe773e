//! Admission: at most `max_inflight` generations run at once and at most `max_queued` wait for a
//! slot; beyond that a request is refused at once with 429 and `Retry-After`, so overload costs
//! the server nothing. A slot is held until the response body (an SSE stream included) is done
//! or dropped. Bodies over `max_body_bytes` are refused with 413 in the surface's error shape.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Json;
use axum::body::{Body, HttpBody};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::json;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::memory::IdleTrim;
use crate::state::AppState;

/// Seconds a refused client is told to wait (`Retry-After`).
const RETRY_AFTER_SECS: &str = "1";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Generation requests running at once.
    pub max_inflight: usize,
    /// Generation requests waiting for a slot; more are refused with 429.
    pub max_queued: usize,
    /// Largest request body accepted; larger is a 413.
    pub max_body_bytes: usize,
}

impl Default for AdmissionLimits {
    fn default() -> Self {
        Self {
            max_inflight: 256,
            max_queued: 1024,
            max_body_bytes: 4 << 20,
        }
    }
}

/// The slots and the waiting line, shared by every request.
pub struct Admission {
    limits: AdmissionLimits,
    slots: Arc<Semaphore>,
    queued: AtomicUsize,
    /// Gives the heap back when the last running generation ends (`memory.rs`).
    trim: IdleTrim,
}

impl Admission {
    pub fn new(limits: AdmissionLimits) -> Self {
        Self {
            limits,
            slots: Arc::new(Semaphore::new(limits.max_inflight.max(1))),
            queued: AtomicUsize::new(0),
            trim: IdleTrim::default(),
        }
    }

    /// A slot now, or after waiting in line; `None` when the line is full.
    async fn slot(&self, state: &AppState) -> Option<OwnedSemaphorePermit> {
        if let Ok(permit) = self.slots.clone().try_acquire_owned() {
            state.metrics.observe_queue_time(std::time::Duration::ZERO);
            return Some(permit);
        }
        if self.queued.fetch_add(1, Ordering::SeqCst) >= self.limits.max_queued {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        // Leaves the line even when the client hangs up while waiting (the future is dropped).
        let _in_line = InLine(self, state.clone());
        state.metrics.queued.inc();
        let waiting = std::time::Instant::now();
        let permit = self.slots.clone().acquire_owned().await.ok();
        if permit.is_some() {
            state.metrics.observe_queue_time(waiting.elapsed());
        }
        permit
    }
}

struct InLine<'a>(&'a Admission, AppState);

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::SeqCst);
        self.1.metrics.queued.dec();
    }
}

/// A held slot; counted in the in-flight gauge until dropped with the response body.
struct Running {
    _permit: OwnedSemaphorePermit,
    state: AppState,
    admission: Arc<Admission>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.state.metrics.inflight.dec();
        // This slot is still held: every other one free means the server is going idle.
        let others_free = self.admission.slots.available_permits() + 1;
        if others_free >= self.admission.limits.max_inflight.max(1) {
            self.admission.trim.idle();
        }
    }
}

/// Requests that run a generation: every POST except token counting.
fn is_generation(request: &Request) -> bool {
    request.method() == Method::POST && !request.uri().path().ends_with("/count_tokens")
}

/// Middleware: admits generation requests through the slots; 429 when the line is full. Every
/// 429 or 503 leaving the server carries `Retry-After`.
pub async fn admit(
    State((admission, state)): State<(Arc<Admission>, AppState)>,
    request: Request,
    next: Next,
) -> Response {
    if !is_generation(&request) {
        return with_retry_after(next.run(request).await);
    }
    let Some(permit) = admission.slot(&state).await else {
        let limits = admission.limits;
        let message = format!(
            "the server is at capacity ({} requests running, {} waiting); retry later",
            limits.max_inflight, limits.max_queued
        );
        return with_retry_after(refusal(
            request.uri().path(),
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            Some("rate_limit_exceeded"),
            &message,
        ));
    };
    state.metrics.inflight.inc();
    let running = Running {
        _permit: permit,
        state: state.clone(),
        admission: Arc::clone(&admission),
    };
    let (parts, body) = next.run(request).await.into_parts();
    if body.size_hint().exact().is_some() {
        // A whole response: the generation is over, the slot is free now.
        return with_retry_after(Response::from_parts(parts, body));
    }
    let body = body.into_data_stream().map(move |chunk| {
        let _slot = &running;
        chunk
    });
    with_retry_after(Response::from_parts(parts, Body::from_stream(body)))
}

fn with_retry_after(mut response: Response) -> Response {
    let status = response.status();
    if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
        response
            .headers_mut()
            .entry(header::RETRY_AFTER)
            .or_insert(HeaderValue::from_static(RETRY_AFTER_SECS));
    }
    response
}

/// Middleware: axum answers some refusals itself in plain text — an oversize body (413), a wrong
/// method (405), a body that cannot be read (400, e.g. cut short) — and this gives each the
/// surface's error shape (413 with the limit).
pub async fn shape_plain_errors(
    State(limits): State<AdmissionLimits>,
    request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path().to_string();
    let method = request.method().clone();
    let response = next.run(request).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if is_json || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    match status {
        StatusCode::PAYLOAD_TOO_LARGE => refusal(
            &path,
            status,
            "invalid_request_error",
            Some("request_too_large"),
            &format!(
                "the request body exceeds the limit of {} bytes",
                limits.max_body_bytes
            ),
        ),
        StatusCode::METHOD_NOT_ALLOWED => {
            let allow = response.headers().get(header::ALLOW).cloned();
            let mut shaped = refusal(
                &path,
                status,
                "invalid_request_error",
                Some("method_not_allowed"),
                &format!("{method} is not allowed on {path}"),
            );
            if let Some(allow) = allow {
                shaped.headers_mut().insert(header::ALLOW, allow);
            }
            shaped
        }
        _ => {
            // axum's own rejections carry a one-line plain-text reason; keep it.
            let bytes = axum::body::to_bytes(response.into_body(), 4096)
                .await
                .unwrap_or_default();
            let reason = String::from_utf8_lossy(&bytes).trim().to_string();
            let message = if reason.is_empty() {
                status
                    .canonical_reason()
                    .unwrap_or("request refused")
                    .to_string()
            } else {
                reason
            };
            let kind = if status.is_server_error() {
                "server_error"
            } else {
                "invalid_request_error"
            };
            refusal(&path, status, kind, None, &message)
        }
    }
}

/// A refusal made before any handler ran, in the error shape of the surface `path` belongs to:
/// Anthropic's for `/v1/messages`, Converse's for `/model/…`, OpenAI's everywhere else.
pub(crate) fn refusal(
    path: &str,
    status: StatusCode,
    openai_type: &str,
    code: Option<&str>,
    message: &str,
) -> Response {
    if path.starts_with("/model/") {
        return crate::converse::error::ConverseError::from_status(status, message.to_string())
            .into_response();
    }
    let body = if path.starts_with("/v1/messages") {
        let kind = match status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            _ => "invalid_request_error",
        };
        json!({"type": "error", "error": {"type": kind, "message": message}})
    } else {
        json!({"error": {"message": message, "type": openai_type, "param": null, "code": code}})
    };
    (status, Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_take_the_surface_shape() {
        let openai = refusal(
            "/v1/chat/completions",
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            None,
            "no",
        );
        assert_eq!(openai.status(), StatusCode::UNAUTHORIZED);
        let anthropic = refusal(
            "/v1/messages",
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            None,
            "busy",
        );
        assert_eq!(anthropic.status(), StatusCode::TOO_MANY_REQUESTS);
        let converse = refusal(
            "/model/m/converse",
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            None,
            "busy",
        );
        assert_eq!(
            converse.headers()["x-amzn-errortype"],
            "ThrottlingException"
        );
    }

    #[test]
    fn retry_after_is_added_to_overload_answers_only() {
        let busy = with_retry_after(StatusCode::SERVICE_UNAVAILABLE.into_response());
        assert_eq!(busy.headers()[header::RETRY_AFTER], RETRY_AFTER_SECS);
        let fine = with_retry_after(StatusCode::OK.into_response());
        assert!(fine.headers().get(header::RETRY_AFTER).is_none());
    }
}
