//! `GET /v1/models` and `GET /v1/models/{id}`: the one served model.

use axum::Json;
use axum::extract::{Path, State};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::state::AppState;

pub async fn list(State(state): State<AppState>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&state)]}))
}

pub async fn retrieve(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    // An alias finds the model too; the object names it by its served name, as responses do.
    state.check_model(&id)?;
    Ok(Json(model_object(&state)))
}

fn model_object(state: &AppState) -> Value {
    json!({
        "id": state.name,
        "object": "model",
        "created": state.created,
        "owned_by": state.owned_by,
        // vLLM's field: the context window a request's prompt and output share.
        "max_model_len": state.context_window(),
    })
}
