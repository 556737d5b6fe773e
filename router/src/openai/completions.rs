//! `POST /v1/completions`: a raw prompt, no chat template.

use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Extension;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use serde_json::{Value, json};

use super::schema::{CompletionRequest, UsageBody};
use super::{
    Framer, Prepared, ResponseMeta, TokenLogprob, check_model, finite_logprob, parse_body,
    respond_batch,
};
use crate::auth::Tenant;
use crate::error::ApiError;
use crate::state::AppState;

/// Prompts one request may carry (a batch).
pub const MAX_PROMPTS: usize = 128;

/// One prompt of a request: its token ids, and its text when it was given as text.
pub(super) type Prompt = (Vec<u32>, Option<String>);

pub async fn create(
    State(state): State<AppState>,
    tenant: Option<Extension<Tenant>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let mut request: CompletionRequest = parse_body(&body)?;
    // Taken out of the shared fields, which still refuse it on chat.
    let echo = echo(request.sampling.echo.take())?;
    check_model(&state, &request.model)?;
    let prompts = encode_prompts(&state, &request.prompt, "prompt", MAX_PROMPTS, true)?;
    if echo
        && request
            .sampling
            .logprobs
            .as_ref()
            .is_some_and(|v| !v.is_null())
    {
        return Err(ApiError::invalid(
            Some("echo"),
            "`echo` with `logprobs` needs the prompt's log-probabilities, which this server does \
             not compute",
        ));
    }
    let mut batch = Vec::with_capacity(prompts.len());
    let mut echoed = Vec::with_capacity(prompts.len());
    for (ids, text) in prompts {
        echoed.push(match (echo, text) {
            (false, _) => None,
            (true, Some(text)) => Some(text),
            // Token ids echo as their text, special tokens included (as /detokenize).
            (true, None) => Some(state.tokenizer.decode(&ids, false)?),
        });
        let prepared =
            Prepared::new(&state, &request.sampling, ids, "prompt")?.for_tenant(tenant.as_deref());
        batch.push(prepared);
    }
    let meta = ResponseMeta::new(&state, "cmpl");
    respond_batch(state, batch, |p, _| CompletionFramer {
        meta: meta.clone(),
        text_offset: AtomicUsize::new(echoed[p].as_ref().map_or(0, String::len)),
        echo: echoed[p].clone(),
    })
    .await
}

/// `echo`: a boolean (null is false).
fn echo(value: Option<Value>) -> Result<bool, ApiError> {
    match value {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(b),
        Some(other) => Err(ApiError::invalid(
            Some("echo"),
            format!("`echo` must be a boolean; got {other}"),
        )),
    }
}

/// The prompts of field `param`, each as token ids with its text when it was given as text: a
/// string (tokenized with the tokenizer's special tokens, e.g. BOS, when `special`), an array of
/// token ids taken as they are, or a batch of up to `max` — an array of strings or of token-id
/// arrays.
pub(super) fn encode_prompts(
    state: &AppState,
    prompt: &Value,
    param: &'static str,
    max: usize,
    special: bool,
) -> Result<Vec<Prompt>, ApiError> {
    let refuse = || {
        ApiError::invalid(
            Some(param),
            format!(
                "`{param}` must be a string, an array of token ids, or an array of strings or \
                 of token-id arrays"
            ),
        )
    };
    let text = |text: &str| -> Result<Prompt, ApiError> {
        Ok((state.encode(text, special, param)?, Some(text.to_string())))
    };
    let ids = |items: &[Value]| -> Option<Vec<u32>> {
        items
            .iter()
            .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect()
    };
    match prompt {
        Value::String(s) => Ok(vec![text(s)?]),
        Value::Array(items) if items.iter().all(Value::is_number) => {
            Ok(vec![(ids(items).ok_or_else(refuse)?, None)])
        }
        Value::Array(items) => {
            if items.is_empty() || items.len() > max {
                return Err(ApiError::invalid(
                    Some(param),
                    format!("a batch of `{param}` holds 1 to {max}; got {}", items.len()),
                ));
            }
            items
                .iter()
                .map(|item| match item {
                    Value::String(s) => text(s),
                    Value::Array(tokens) if !tokens.is_empty() => {
                        Ok((ids(tokens).ok_or_else(refuse)?, None))
                    }
                    _ => Err(refuse()),
                })
                .collect()
        }
        _ => Err(refuse()),
    }
}

struct CompletionFramer {
    meta: ResponseMeta,
    /// The prompt's text, when `echo` asks for it before the completion.
    echo: Option<String>,
    /// Where the next token's text starts in the choice's text (after an echoed prompt): a
    /// stream's offsets go on from chunk to chunk, as the whole answer's do.
    text_offset: AtomicUsize,
}

impl CompletionFramer {
    fn chunk(&self, choices: Value) -> Value {
        json!({
            "id": self.meta.id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
        })
    }
}

impl Framer for CompletionFramer {
    /// With `echo`, the prompt's text is the stream's first chunk.
    fn opening(&self) -> Option<Value> {
        let echo = self.echo.as_deref()?;
        Some(self.delta(echo))
    }

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
        let mut offsets = Vec::with_capacity(tokens.len());
        for (id, _) in tokens {
            let len = text(*id).len();
            offsets.push(self.text_offset.fetch_add(len, Ordering::Relaxed));
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
        let text = match &self.echo {
            Some(prompt) => format!("{prompt}{text}"),
            None => text,
        };
        let mut body = self
            .chunk(json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": reason}]));
        body["usage"] = json!(usage);
        body
    }
}
