//! Errors in Converse's shape: the status, an `x-amzn-errortype` header naming the exception
//! (botocore reads the error code from it) and `{"message": ...}`. The refusals themselves are
//! the shared [`ApiError`]s (one place decides what is the client's fault and words the numbers);
//! this re-dresses them by status.

use axum::Json;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::error::ApiError;

#[derive(Debug, Clone, PartialEq)]
pub struct ConverseError {
    pub status: StatusCode,
    /// `ValidationException`, `ResourceNotFoundException`, `ThrottlingException`,
    /// `ServiceUnavailableException` or `InternalServerException`.
    pub kind: &'static str,
    pub message: String,
}

impl ConverseError {
    pub fn validation(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "ValidationException",
            message: message.into(),
        }
    }

    pub(crate) fn from_status(status: StatusCode, message: String) -> Self {
        let kind = match status {
            StatusCode::BAD_REQUEST
            | StatusCode::PAYLOAD_TOO_LARGE
            | StatusCode::METHOD_NOT_ALLOWED => "ValidationException",
            StatusCode::NOT_FOUND => "ResourceNotFoundException",
            StatusCode::UNAUTHORIZED => "UnrecognizedClientException",
            StatusCode::TOO_MANY_REQUESTS => "ThrottlingException",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableException",
            _ => "InternalServerException",
        };
        Self {
            status,
            kind,
            message,
        }
    }

    pub fn body(&self) -> Value {
        json!({"message": self.message})
    }

    /// The name of this error as a `converse-stream` exception event (`validationException`).
    pub fn stream_exception_type(&self) -> &'static str {
        match self.kind {
            "ValidationException" => "validationException",
            "ThrottlingException" => "throttlingException",
            "ServiceUnavailableException" => "serviceUnavailableException",
            _ => "internalServerException",
        }
    }
}

impl From<ApiError> for ConverseError {
    fn from(e: ApiError) -> Self {
        Self::from_status(e.status, e.message)
    }
}

impl IntoResponse for ConverseError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        response
            .headers_mut()
            .insert("x-amzn-errortype", HeaderValue::from_static(self.kind));
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_engine_api::submit::SubmitError;

    #[test]
    fn context_overflow_is_a_validation_exception_with_the_numbers() {
        let e: ConverseError = ApiError::from_submit(
            SubmitError::ContextWindow {
                prompt: 300,
                window: 256,
            },
            "messages",
        )
        .into();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.kind, "ValidationException");
        assert!(
            e.message.contains("300") && e.message.contains("256"),
            "{}",
            e.message
        );
        let response = e.into_response();
        assert_eq!(
            response.headers()["x-amzn-errortype"],
            "ValidationException"
        );
    }

    #[test]
    fn statuses_pick_converse_exceptions() {
        let not_found: ConverseError = ApiError::model_not_found("x", "y").into();
        assert_eq!(not_found.kind, "ResourceNotFoundException");
        let stopped: ConverseError = ApiError::from_submit(SubmitError::Stopped, "messages").into();
        assert_eq!(stopped.kind, "ServiceUnavailableException");
        let internal: ConverseError = ApiError::internal("boom").into();
        assert_eq!(internal.kind, "InternalServerException");
        assert_eq!(internal.stream_exception_type(), "internalServerException");
    }
}
