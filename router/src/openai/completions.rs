//! `POST /v1/completions`: a raw prompt, no chat template.

use axum::Extension;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use serde_json::{Value, json};

use super::schema::{CompletionRequest, UsageBody};
use super::{
    Framer, Prepared, ResponseMeta, TokenLogprob, check_model, finite_logprob, parse_body, respond,
};
use crate::auth::Tenant;
use crate::error::ApiError;
use crate::state::AppState;

pub async fn create(
    State(state): State<AppState>,
    tenant: Option<Extension<Tenant>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let request: CompletionRequest = parse_body(&body)?;
    check_model(&state, &request.model)?;
    let prompt = encode_prompt(&state, &request.prompt)?;
    let prepared =
        Prepared::new(&state, &request.sampling, prompt, "prompt")?.for_tenant(tenant.as_deref());
    let meta = ResponseMeta::new(&state, "cmpl");
    respond(state, prepared, || CompletionFramer(meta.clone())).await
}

/// A string (tokenized with the tokenizer's special tokens, e.g. BOS), a one-element array of
/// strings, or an array of token ids taken as they are. Batches of prompts are not supported yet.
fn encode_prompt(state: &AppState, prompt: &Value) -> Result<Vec<u32>, ApiError> {
    let refuse = || {
        ApiError::invalid(
            Some("prompt"),
            "`prompt` must be a string, a one-element array of strings or an array of token ids",
        )
    };
    match prompt {
        Value::String(text) => Ok(state.tokenizer.encode(text, true)?),
        Value::Array(items) => match items.as_slice() {
            [Value::String(text)] => Ok(state.tokenizer.encode(text, true)?),
            _ => items
                .iter()
                .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(refuse),
        },
        _ => Err(refuse()),
    }
}

struct CompletionFramer(ResponseMeta);

impl CompletionFramer {
    fn chunk(&self, choices: Value) -> Value {
        json!({
            "id": self.0.id,
            "object": "text_completion",
            "created": self.0.created,
            "model": self.0.model,
            "choices": choices,
        })
    }
}

impl Framer for CompletionFramer {
    fn delta(&self, text: &str) -> Value {
        self.chunk(json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": null}]))
    }

    fn finish(&self, reason: &str) -> Value {
        self.chunk(json!([{"index": 0, "text": "", "logprobs": null, "finish_reason": reason}]))
    }

    fn usage(&self, usage: UsageBody) -> Value {
        let mut chunk = self.chunk(json!([]));
        chunk["usage"] = json!(usage);
        chunk
    }

    /// The legacy shape: parallel arrays of tokens, their log-probabilities, a map of the
    /// alternatives per token, and each token's offset in the text.
    fn logprobs(&self, state: &AppState, tokens: &[TokenLogprob]) -> Value {
        let text = |id: u32| String::from_utf8_lossy(state.token_bytes(id)).into_owned();
        let mut offset = 0;
        let mut offsets = Vec::with_capacity(tokens.len());
        for (id, _) in tokens {
            offsets.push(offset);
            offset += text(*id).len();
        }
        json!({
            "tokens": tokens.iter().map(|(id, _)| text(*id)).collect::<Vec<_>>(),
            "token_logprobs": tokens
                .iter()
                .map(|(_, info)| finite_logprob(info.logprob))
                .collect::<Vec<_>>(),
            "top_logprobs": tokens
                .iter()
                .map(|(_, info)| {
                    info.top
                        .iter()
                        .map(|&(id, logprob)| (text(id), json!(finite_logprob(logprob))))
                        .collect::<serde_json::Map<_, _>>()
                })
                .collect::<Vec<_>>(),
            "text_offset": offsets,
        })
    }

    fn whole(&self, text: String, reason: &str, usage: UsageBody) -> Value {
        let mut body = self
            .chunk(json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": reason}]));
        body["usage"] = json!(usage);
        body
    }
}
