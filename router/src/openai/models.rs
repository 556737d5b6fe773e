//! `GET /v1/models` and `GET /v1/models/{id}`: the one served model, under each of its names.

use axum::Json;
use axum::extract::{Path, State};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::state::AppState;

/// One entry per name the model answers to (`--served-model-name a b`: `a` and `b`, as vLLM
/// lists them), the served name first.
pub async fn list(State(state): State<AppState>) -> Json<Value> {
    let names = std::iter::once(&state.name).chain(&state.aliases);
    let data: Vec<Value> = names.map(|name| model_object(&state, name)).collect();
    Json(json!({"object": "list", "data": data}))
}

/// The entry of `id`, the served name or an alias.
pub async fn retrieve(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    state.check_model(&id)?;
    Ok(Json(model_object(&state, &id)))
}

fn model_object(state: &AppState, id: &str) -> Value {
    json!({
        "id": id,
        "object": "model",
        "created": state.created,
        "owned_by": state.owned_by,
        // vLLM's fields: the model every name serves, and the context window a request's prompt
        // and output share.
        "root": state.name,
        "max_model_len": state.context_window(),
    })
}
