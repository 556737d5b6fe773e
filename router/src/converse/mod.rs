//! The Bedrock Converse surface: `POST /model/{modelId}/converse` (one JSON answer) and
//! `POST /model/{modelId}/converse-stream` (AWS eventstream frames), rendered through the same
//! chat template and run through the same [`Turn`](crate::serving::turn::Turn) as the
//! Anthropic surface, so stop sequences and stop reasons mean the same on both; tools go through
//! the same shared translation and framing (`crate::tools`). Clients sign requests with SigV4;
//! the signature is not verified (see docs/SERVING.md).

pub mod error;
pub mod eventstream;
pub mod messages;
mod prompt;
pub mod schema;
pub mod stream;

use axum::Router;
use axum::routing::post;

use crate::state::AppState;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/model/{model_id}/converse", post(messages::converse))
        .route(
            "/model/{model_id}/converse-stream",
            post(messages::converse_stream),
        )
}
