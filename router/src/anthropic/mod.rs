//! The Anthropic Messages surface: `/v1/messages` (whole or SSE) and
//! `/v1/messages/count_tokens`, rendered through the same chat template and engine as the
//! OpenAI surface, tools included (`crate::tools`). The `anthropic-version` header is accepted
//! with any value and not required: there is one behaviour, so there is nothing for a version to
//! select.

pub mod error;
pub mod messages;
mod prompt;
pub mod schema;
pub mod stream;

use axum::Router;
use axum::routing::post;

use crate::state::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/messages", post(messages::create))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
}
