//! vLLM's utility endpoints: `POST /tokenize`, `POST /detokenize`, `GET /version`.
//!
//! `/tokenize` takes a `prompt` (tokenized as `/v1/completions` does, with the tokenizer's
//! special tokens unless `add_special_tokens: false`) or chat `messages` (rendered by the chat
//! template with the generation prompt, as `/v1/chat/completions` does), and answers the ids,
//! their count and the model's context window. `/detokenize` turns `tokens` back into text.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use serde::Deserialize;
use serde_json::{Value, json};

use super::chat::render_messages;
use super::{check_model, parse_body};
use crate::error::ApiError;
use crate::state::AppState;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<Value>>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

pub async fn tokenize(State(state): State<AppState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let request: TokenizeRequest = parse_body(&body)?;
    if let Some(model) = &request.model {
        check_model(&state, model)?;
    }
    let tokens = match (request.prompt, request.messages) {
        (Some(prompt), None) => state
            .tokenizer
            .encode(&prompt, request.add_special_tokens.unwrap_or(true))?,
        (None, Some(messages)) => {
            if request.add_generation_prompt == Some(false) {
                return Err(ApiError::invalid(
                    Some("add_generation_prompt"),
                    "`add_generation_prompt` can only be true on this server (as chat renders)",
                ));
            }
            let messages = messages
                .iter()
                .enumerate()
                .map(|(i, m)| super::chat::normalize_message(i, m))
                .collect::<Result<_, _>>()?;
            render_messages(&state, messages, "messages")?
        }
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                Some("messages"),
                "give `prompt` or `messages`, not both",
            ));
        }
        (None, None) => {
            return Err(ApiError::invalid(
                Some("prompt"),
                "`prompt` or `messages` is required",
            ));
        }
    };
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": state.context_window(),
        "tokens": tokens,
    })))
}

pub async fn detokenize(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let request: DetokenizeRequest = parse_body(&body)?;
    if let Some(model) = &request.model {
        check_model(&state, model)?;
    }
    let vocab = state.tokenizer.vocab_size();
    if let Some(bad) = request.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid(
            Some("tokens"),
            format!("token id {bad} is outside the vocabulary (0..{vocab})"),
        ));
    }
    let prompt = state.tokenizer.decode(&request.tokens, false)?;
    Ok(Json(json!({"prompt": prompt})))
}

pub async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}
