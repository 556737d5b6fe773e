//! `converse` and `converse-stream`: path and body → prompt tokens and sampling parameters;
//! the non-streaming answer, its text and tool calls as content blocks.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{Value, json};
use strata_protocol::SamplingParams;

use super::error::ConverseError;
use super::prompt::{cache_mark, render};
use super::schema::{ConverseRequest, InferenceConfig};
use super::stream;
use crate::auth::Tenant;
use crate::parking::Park;
use crate::sampling::{Requested, resolve};
use crate::serving::turn::{Ending, Turn};
use crate::state::AppState;
use crate::tools::blocks::{Block, BlockFramer};

pub async fn converse(
    State(state): State<AppState>,
    Path(model_id): Path<String>,
    tenant: Option<Extension<Tenant>>,
    body: Bytes,
) -> Result<Response, ConverseError> {
    let started = Instant::now();
    let (turn, framer) = start(state, &model_id, tenant, &body)?;
    let (text, ending) = turn.collect().await?;
    let cut = ending.stop_reason == "max_tokens";
    Ok(Json(whole(
        framer.whole(&text, cut),
        &ending,
        latency_ms(started),
    ))
    .into_response())
}

/// The `converse` answer; `stopReason` is `tool_use` when it holds a call, unless the token limit
/// ended it (`max_tokens` stays).
pub(crate) fn whole(blocks: Vec<Block>, ending: &Ending, latency_ms: u64) -> Value {
    let called = ending.stop_reason != "max_tokens"
        && blocks.iter().any(|b| matches!(b, Block::ToolUse { .. }));
    let content = blocks.into_iter().map(content_block).collect::<Vec<_>>();
    json!({
        "output": {"message": {"role": "assistant", "content": content}},
        "stopReason": if called { "tool_use" } else { ending.stop_reason },
        "usage": usage(ending),
        "metrics": {"latencyMs": latency_ms},
    })
}

/// A block as Converse spells it: `{"text"}` or `{"toolUse": {"toolUseId", "name", "input"}}`.
fn content_block(block: Block) -> Value {
    match block {
        Block::Text(text) => json!({"text": text}),
        Block::ToolUse { id, name, input } => {
            json!({"toolUse": {"toolUseId": id, "name": name, "input": input}})
        }
    }
}

pub async fn converse_stream(
    State(state): State<AppState>,
    Path(model_id): Path<String>,
    tenant: Option<Extension<Tenant>>,
    body: Bytes,
) -> Result<Response, ConverseError> {
    let started = Instant::now();
    let (turn, framer) = start(state, &model_id, tenant, &body)?;
    Ok(stream::respond(turn, framer, started))
}

/// Validates the request and submits it: every refusal happens here, before any frame is sent.
/// Returns the running turn and the framer for its blocks.
fn start(
    state: AppState,
    model_id: &str,
    tenant: Option<Extension<Tenant>>,
    body: &Bytes,
) -> Result<(Turn, BlockFramer), ConverseError> {
    state.check_model(model_id)?;
    let request: ConverseRequest = crate::body::from_json(body)
        .map_err(|e| ConverseError::validation(format!("invalid request body: {e}")))?;
    refuse_unsupported(&request)?;
    let (prompt, format, constraint) = render(&state, &request)?;
    let mark = cache_mark(&state, &request, &prompt)?;
    let mut sampling = sampling_params(&state, &request.inference_config, prompt.len())?;
    if let Some(top_k) = additional_top_k(request.additional_model_request_fields.as_ref())? {
        sampling.top_k = top_k;
    }
    let framer = BlockFramer::new(
        format.clone(),
        format!("tooluse_{:024}", state.next_response_number()),
    );
    let cache_salt = tenant.map_or(0, |t| t.cache_salt);
    let park = mark.and_then(|(prefix, ttl)| Park::new(&state, &prompt, prefix, cache_salt, ttl));
    let turn = Turn::start(state, prompt, sampling, cache_salt, constraint, format)?.parking(park);
    Ok((turn, framer))
}

/// Converse's usage object: `inputTokens` are the prompt tokens neither read from the cache nor
/// written to it, `totalTokens` counts every token. Its stop reasons are the [`Turn`]'s words
/// unchanged (`end_turn`, `max_tokens`, `stop_sequence`), and `tool_use` when the answer holds
/// a call.
pub(crate) fn usage(ending: &Ending) -> Value {
    json!({
        "inputTokens": ending.uncached_input_tokens(),
        "outputTokens": ending.output_tokens,
        "cacheReadInputTokens": ending.cache_read_tokens,
        "cacheWriteInputTokens": ending.cache_write_tokens,
        "totalTokens": ending.input_tokens + ending.output_tokens,
    })
}

pub(crate) fn latency_ms(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX)
}

fn refuse_unsupported(request: &ConverseRequest) -> Result<(), ConverseError> {
    let set = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
    let refused = [
        ("guardrailConfig", set(&request.guardrail_config)),
        ("promptVariables", set(&request.prompt_variables)),
        (
            "additionalModelResponseFieldPaths",
            request
                .additional_model_response_field_paths
                .as_ref()
                .is_some_and(|v| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty())),
        ),
    ];
    if let Some((name, _)) = refused.iter().find(|(_, refused)| *refused) {
        return Err(ConverseError::validation(format!(
            "{name}: not supported by this server yet"
        )));
    }
    if let Some(config) = request.performance_config.as_ref() {
        performance_config(config)?;
    }
    // Bedrock's own words for a member it does not know.
    match request.extra.iter().find(|(_, v)| !v.is_null()) {
        Some((name, _)) => Err(ConverseError::validation(format!(
            "extraneous key [{name}] is not permitted"
        ))),
        None => Ok(()),
    }
}

/// `performanceConfig`: null, or an object whose one member `latency` is `"standard"` (the
/// latency this server has; `"optimized"` is refused rather than silently ignored).
fn performance_config(config: &Value) -> Result<(), ConverseError> {
    let map = match config {
        Value::Null => return Ok(()),
        Value::Object(map) => map,
        other => {
            return Err(ConverseError::validation(format!(
                "performanceConfig: must be an object, got {other}"
            )));
        }
    };
    if let Some(key) = map.keys().find(|k| *k != "latency") {
        return Err(ConverseError::validation(format!(
            "performanceConfig: extraneous key [{key}] is not permitted"
        )));
    }
    match map.get("latency") {
        None | Some(Value::Null) => Ok(()),
        Some(latency) if latency == "standard" => Ok(()),
        Some(latency) => Err(ConverseError::validation(format!(
            "performanceConfig.latency: only \"standard\" is served; got {latency}"
        ))),
    }
}

/// `top_k` from `additionalModelRequestFields` (the one model parameter Converse has no member
/// for that this server samples with); any other key is refused by name.
fn additional_top_k(fields: Option<&Value>) -> Result<Option<u32>, ConverseError> {
    let Some(fields) = fields.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let Some(map) = fields.as_object() else {
        return Err(ConverseError::validation(
            "additionalModelRequestFields: must be an object",
        ));
    };
    if let Some(key) = map.keys().find(|k| *k != "top_k") {
        return Err(ConverseError::validation(format!(
            "additionalModelRequestFields.{key}: not supported (only top_k is)"
        )));
    }
    match map.get("top_k") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|k| u32::try_from(k).ok())
            .map(Some)
            .ok_or_else(|| {
                ConverseError::validation(format!(
                    "additionalModelRequestFields.top_k: must be a non-negative integer; got {v}"
                ))
            }),
    }
}

/// `inferenceConfig` over the checkpoint's defaults: an omitted `temperature` / `topP` takes
/// [`GenerationConfig::sampling_defaults`], the rule every surface uses; an omitted `maxTokens`
/// runs to the context window; `top_k`, `min_p` and the repetition penalty have no Converse
/// field and come from the checkpoint.
fn sampling_params(
    state: &AppState,
    c: &InferenceConfig,
    prompt_len: usize,
) -> Result<SamplingParams, ConverseError> {
    let max_tokens = match c.max_tokens {
        Some(v) if v < 1 => {
            return Err(ConverseError::validation(format!(
                "inferenceConfig.maxTokens: must be at least 1; got {v}"
            )));
        }
        v => v.map(|v| u32::try_from(v).unwrap_or(u32::MAX)),
    };
    let requested = Requested {
        temperature: c.temperature,
        top_p: c.top_p,
        max_tokens,
        stop: c.stop_sequences.clone(),
        ..Requested::default()
    };
    let room = state.context_window().saturating_sub(prompt_len);
    resolve(&state.generation_config, room, requested).map_err(|e| {
        // Converse's own member names, not the canonical ones.
        let field = match e.field {
            "top_p" => "topP",
            other => other,
        };
        ConverseError::validation(format!(
            "inferenceConfig.{field}: {} is out of range (must be {})",
            e.value, e.range
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_parses_in_camel_case() {
        let r: ConverseRequest = serde_json::from_value(json!({
            "messages": [{"role": "user", "content": [{"text": "hi"}]}],
            "inferenceConfig": {"maxTokens": 4, "topP": 0.5, "stopSequences": ["x"]},
        }))
        .unwrap();
        assert_eq!(r.inference_config.max_tokens, Some(4));
        assert_eq!(r.inference_config.top_p, Some(0.5));
        assert_eq!(r.inference_config.stop_sequences, ["x"]);
    }

    #[test]
    fn an_unknown_role_is_a_parse_error() {
        let r = serde_json::from_value::<ConverseRequest>(json!({
            "messages": [{"role": "system", "content": [{"text": "hi"}]}]
        }));
        assert!(r.is_err());
    }
}
