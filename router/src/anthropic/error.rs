//! Errors in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`. The refusals
//! themselves are the OpenAI surface's [`ApiError`] (one place decides what is the client's
//! fault and words the numbers); this only re-dresses them by status.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::error::ApiError;

#[derive(Debug, Clone, PartialEq)]
pub struct AnthropicError {
    pub status: StatusCode,
    /// `invalid_request_error`, `not_found_error`, `api_error` or `overloaded_error`.
    pub kind: &'static str,
    pub message: String,
}

impl AnthropicError {
    pub fn invalid(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
        }
    }

    /// The body, also sent as an `error` event when a stream fails midway.
    pub fn body(&self) -> Value {
        json!({
            "type": "error",
            "error": {"type": self.kind, "message": self.message},
        })
    }
}

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        let kind = match e.status {
            StatusCode::BAD_REQUEST => "invalid_request_error",
            StatusCode::NOT_FOUND => "not_found_error",
            // A stopped engine: the SDKs retry 503 as they do 529.
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            _ => "api_error",
        };
        Self {
            status: e.status,
            kind,
            message: e.message,
        }
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_engine_api::submit::SubmitError;

    #[test]
    fn context_overflow_keeps_its_numbers_in_anthropics_shape() {
        let e: AnthropicError = ApiError::from_submit(
            SubmitError::ContextWindow {
                prompt: 300,
                window: 256,
            },
            "messages",
        )
        .into();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let body = e.body();
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("300") && message.contains("256"),
            "{message}"
        );
    }

    #[test]
    fn statuses_pick_anthropics_error_types() {
        let not_found: AnthropicError = ApiError::model_not_found("x", "y").into();
        assert_eq!(not_found.kind, "not_found_error");
        let stopped: AnthropicError =
            ApiError::from_submit(SubmitError::Stopped, "messages").into();
        assert_eq!(stopped.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(stopped.kind, "overloaded_error");
        let internal: AnthropicError = ApiError::internal("boom").into();
        assert_eq!(internal.kind, "api_error");
    }
}
