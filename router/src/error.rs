//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the status
//! code a client library maps to its exception types (400 → BadRequestError, 404 →
//! NotFoundError, ...). Every refusal names the field and carries the numbers.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use strata_engine_api::rpc::RefusalKind;
use strata_engine_api::submit::SubmitError;
use strata_model::chat::TemplateError;
use strata_model::grammar::GrammarError;
use strata_model::tokenizer::TokenizerError;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type`: `invalid_request_error`, `not_found_error`, `server_error`.
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// The prompt, with the output asked for, does not fit the context window.
    pub fn context_length_exceeded(prompt_param: &str, message: impl Into<String>) -> Self {
        Self::invalid(Some(prompt_param), message).with_code("context_length_exceeded")
    }

    pub fn model_not_found(requested: &str, served: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!(
                "the model `{requested}` does not exist; this server serves `{served}`"
            ),
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// No engine can take or finish the request now: a 503 (with Retry-After, as every 503).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            ..Self::internal(message)
        }
    }

    fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The `{"error": {...}}` body, also sent as the last event of a stream that fails midway.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }

    /// A refusal at submission. `prompt_param` names the field the prompt came from.
    pub fn from_submit(e: SubmitError, prompt_param: &str) -> Self {
        let message = e.to_string();
        match e {
            SubmitError::ContextWindow { .. } => {
                Self::context_length_exceeded(prompt_param, message)
            }
            SubmitError::EmptyPrompt
            | SubmitError::ResumeSpent { .. }
            | SubmitError::KvCapacity { .. }
            | SubmitError::TokenOutOfRange { .. } => Self::invalid(Some(prompt_param), message),
            SubmitError::Sampling(_)
            | SubmitError::NoEmbeddings
            | SubmitError::EmbedWithGeneration => Self::invalid(None, message),
            // A schema or grammar that does not compile, or is too ambiguous to follow within
            // the matcher's step limit, is the request's fault; a model whose tokenizer cannot
            // be constrained refuses the request, as any unsupported feature.
            SubmitError::Grammar(
                GrammarError::SchemaJson(_)
                | GrammarError::Compile(_)
                | GrammarError::TooSlow(_)
                | GrammarError::Tokenizer(_)
                | GrammarError::NoEos,
            )
            | SubmitError::GrammarUnavailable => Self::invalid(None, message),
            SubmitError::Grammar(GrammarError::Matcher(_)) => Self::internal(message),
            SubmitError::Stopped => Self {
                status: StatusCode::SERVICE_UNAVAILABLE,
                ..Self::internal(message)
            },
            SubmitError::Remote(refusal) => match refusal.kind {
                RefusalKind::ContextWindow => Self::context_length_exceeded(prompt_param, message),
                RefusalKind::Prompt => Self::invalid(Some(prompt_param), message),
                RefusalKind::Sampling | RefusalKind::Grammar => Self::invalid(None, message),
                RefusalKind::Internal => Self::internal(message),
                RefusalKind::Unavailable | RefusalKind::Busy => Self {
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    ..Self::internal(message)
                },
            },
        }
    }
}

impl From<TemplateError> for ApiError {
    /// A template that refuses a conversation (`raise_exception`) is the request's fault.
    /// The message says what the template did, never where the server keeps it.
    fn from(e: TemplateError) -> Self {
        let what = match e {
            TemplateError::Raised { message, .. } => {
                format!("the chat template refused the messages: {message}")
            }
            TemplateError::Render { message, .. } => {
                format!("the chat template could not render the messages: {message}")
            }
            TemplateError::UnknownTemplate {
                name, available, ..
            } => format!("no chat template named {name:?} (available: {available})"),
            other => format!("the chat template failed: {other}"),
        };
        Self::invalid(Some("messages"), what)
    }
}

impl From<TokenizerError> for ApiError {
    fn from(e: TokenizerError) -> Self {
        Self::internal(format!("tokenizer: {e}"))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // The cause of a server fault, logged in the request's span (its id).
        if self.status.is_server_error() && self.status != StatusCode::SERVICE_UNAVAILABLE {
            tracing::error!(status = self.status.as_u16(), "{}", self.message);
        }
        (self.status, Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_overflow_is_a_400_with_the_numbers() {
        let e = ApiError::from_submit(
            SubmitError::ContextWindow {
                prompt: 300,
                window: 256,
            },
            "prompt",
        );
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let body = e.body();
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("300") && message.contains("256"),
            "{message}"
        );
        assert_eq!(body["error"]["param"], "prompt");
        assert_eq!(body["error"]["code"], "context_length_exceeded");
    }

    #[test]
    fn a_grammar_that_does_not_compile_is_the_clients_fault() {
        let schema = ApiError::from_submit(
            SubmitError::Grammar(GrammarError::SchemaJson("expected object".into())),
            "messages",
        );
        assert_eq!(schema.status, StatusCode::BAD_REQUEST);
        assert!(
            schema.message.contains("expected object"),
            "{}",
            schema.message
        );
        let unavailable = ApiError::from_submit(SubmitError::GrammarUnavailable, "messages");
        assert_eq!(unavailable.status, StatusCode::BAD_REQUEST);
        let matcher = ApiError::from_submit(
            SubmitError::Grammar(GrammarError::Matcher("stuck".into())),
            "messages",
        );
        assert_eq!(matcher.status, StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[test]
    fn a_stopped_engine_is_not_the_clients_fault() {
        let e = ApiError::from_submit(SubmitError::Stopped, "prompt");
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.body()["error"]["type"], "server_error");
    }
}
