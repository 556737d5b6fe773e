//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: request → prompt tokens and
//! sampling parameters; the non-streaming answer, its text and tool calls as content blocks.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use strata_model::GenerationConfig;
use strata_protocol::{Constraint, SamplingParams};

use super::error::AnthropicError;
use super::prompt::{cache_mark, render};
use super::schema::{CountTokensRequest, MessagesRequest};
use super::stream;
use crate::auth::Tenant;
use crate::parking::Park;
use crate::sampling::{Requested, resolve};
use crate::serving::turn::{Ending, Turn};
use crate::state::AppState;
use crate::tools::blocks::{Block, BlockFramer};

pub async fn create(
    State(state): State<AppState>,
    tenant: Option<Extension<Tenant>>,
    body: Bytes,
) -> Result<Response, AnthropicError> {
    let request: MessagesRequest = parse_body(&body)?;
    check_model(&state, &request.model)?;
    // Extended thinking is not offered; a request that turns it off explicitly asks for what
    // every request gets.
    let thinking = request
        .thinking
        .clone()
        .filter(|t| t.get("type").and_then(Value::as_str) != Some("disabled"));
    refuse_unsupported(&[("thinking", &thinking)])?;
    if let Some((name, _)) = request
        .extra
        .iter()
        .find(|(name, value)| !value.is_null() && name.as_str() != "service_tier")
    {
        return Err(AnthropicError::invalid(format!(
            "{name}: not a field this server knows"
        )));
    }
    let max_tokens = match request.max_tokens {
        None => return Err(AnthropicError::invalid("max_tokens: Field required")),
        Some(v) if v < 1 => {
            return Err(AnthropicError::invalid(format!(
                "max_tokens: must be at least 1; got {v}"
            )));
        }
        Some(v) => u32::try_from(v).unwrap_or(u32::MAX),
    };
    let (prompt, format, forced) = render(&state, &request.conversation)?;
    let mark = cache_mark(&state, &request.conversation, &prompt)?;
    let constraint = match (output_format(request.output_config.as_ref())?, forced) {
        (Some(_), Some(_)) => {
            return Err(AnthropicError::invalid(
                "output_config.format: cannot apply when tool_choice forces a tool call",
            ));
        }
        (format, forced) => format.or(forced),
    };
    let sampling = sampling_params(&state.generation_config, &request, max_tokens)?;
    let number = state.next_response_number();
    let header = MessageHeader {
        id: format!("msg_{number:024}"),
        model: state.name.clone(),
        input_tokens: prompt.len() as u32,
    };
    let framer = BlockFramer::new(format.clone(), format!("toolu_{number:024}"));
    let cache_salt = tenant.map_or(0, |t| t.cache_salt);
    let park = mark.and_then(|(prefix, ttl)| Park::new(&state, &prompt, prefix, cache_salt, ttl));
    let turn = Turn::start(state, prompt, sampling, cache_salt, constraint, format)?.parking(park);
    if request.stream {
        return Ok(stream::respond(turn, header, framer));
    }
    let (text, ending) = turn.collect().await?;
    let cut = ending.stop_reason == "max_tokens";
    Ok(Json(header.whole(framer.whole(&text, cut), ending)).into_response())
}

pub async fn count_tokens(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Json<Value>, AnthropicError> {
    let request: CountTokensRequest = parse_body(&body)?;
    check_model(&state, &request.model)?;
    let (prompt, _, _) = render(&state, &request.conversation)?;
    Ok(Json(json!({"input_tokens": prompt.len()})))
}

/// Anthropic's usage object: `input_tokens` are the prompt tokens neither read from the cache
/// nor written to it; the prompt is their sum with the two cache counts.
pub(crate) fn usage(ending: &Ending) -> Value {
    json!({
        "input_tokens": ending.uncached_input_tokens(),
        "cache_creation_input_tokens": ending.cache_write_tokens,
        "cache_read_input_tokens": ending.cache_read_tokens,
        "output_tokens": ending.output_tokens,
    })
}

/// What every message object of one response shares.
pub(crate) struct MessageHeader {
    pub id: String,
    pub model: String,
    pub input_tokens: u32,
}

impl MessageHeader {
    /// The message object; `message_start` sends it with no content and no stop reason yet.
    pub fn message(&self, content: Value, ending: Option<&Ending>) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": ending.map(|e| e.stop_reason),
            "stop_sequence": ending.and_then(|e| e.stop_sequence.as_deref()),
            "usage": match ending {
                Some(ending) => usage(ending),
                // `message_start`: the split over the cache is not known yet (the final
                // `message_delta` carries it).
                None => json!({
                    "input_tokens": self.input_tokens,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0,
                    "output_tokens": 0,
                }),
            },
        })
    }

    /// The whole answer; `stop_reason` is `tool_use` when it holds a call, unless the token limit
    /// ended it (`max_tokens` stays).
    pub fn whole(&self, blocks: Vec<Block>, mut ending: Ending) -> Value {
        let cut = ending.stop_reason == "max_tokens";
        if !cut && blocks.iter().any(|b| matches!(b, Block::ToolUse { .. })) {
            ending.stop_reason = "tool_use";
        }
        let content = blocks.into_iter().map(content_block).collect::<Vec<_>>();
        self.message(content.into(), Some(&ending))
    }
}

/// A block as Anthropic spells it: `text` or `tool_use` (`input` an object).
fn content_block(block: Block) -> Value {
    match block {
        Block::Text(text) => json!({"type": "text", "text": text}),
        Block::ToolUse { id, name, input } => {
            json!({"type": "tool_use", "id": id, "name": name, "input": input})
        }
    }
}

fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, AnthropicError> {
    crate::body::from_json(body)
        .map_err(|e| AnthropicError::invalid(format!("invalid request body: {e}")))
}

fn check_model(state: &AppState, requested: &str) -> Result<(), AnthropicError> {
    Ok(state.check_model(requested)?)
}

fn refuse_unsupported(fields: &[(&str, &Option<Value>)]) -> Result<(), AnthropicError> {
    match fields
        .iter()
        .find(|(_, v)| v.as_ref().is_some_and(|v| !v.is_null()))
    {
        Some((name, _)) => Err(AnthropicError::invalid(format!(
            "{name}: not supported by this server yet"
        ))),
        None => Ok(()),
    }
}

/// `output_config`: `format` `{"type": "json_schema", "schema": {…}}` is enforced while decoding
/// (what the SDK's `messages.parse(output_format=…)` sends); `effort` is accepted without effect;
/// anything else is refused by name.
fn output_format(config: Option<&Value>) -> Result<Option<Constraint>, AnthropicError> {
    let Some(config) = config.filter(|c| !c.is_null()) else {
        return Ok(None);
    };
    let Some(object) = config.as_object() else {
        return Err(AnthropicError::invalid("output_config: must be an object"));
    };
    if let Some(key) = object
        .keys()
        .find(|k| !matches!(k.as_str(), "format" | "effort"))
    {
        return Err(AnthropicError::invalid(format!(
            "output_config.{key}: not supported by this server"
        )));
    }
    let Some(format) = object.get("format").filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match (
        format.get("type").and_then(Value::as_str),
        format.get("schema"),
    ) {
        (Some("json_schema"), Some(schema @ (Value::Object(_) | Value::Bool(_)))) => {
            Ok(Some(Constraint::JsonSchema(schema.to_string())))
        }
        (Some("json_schema"), _) => Err(AnthropicError::invalid(
            "output_config.format.schema: a JSON Schema object is required",
        )),
        _ => Err(AnthropicError::invalid(
            "output_config.format.type: must be \"json_schema\"",
        )),
    }
}

/// Anthropic's fields over the checkpoint's defaults: an omitted `temperature` / `top_p` /
/// `top_k` takes [`GenerationConfig::sampling_defaults`], the rule every surface uses (the
/// current SDK no longer sends `temperature` unless asked, so the checkpoint's value is what most
/// requests get); `min_p` and `repetition_penalty` have no Anthropic field.
fn sampling_params(
    generation: &GenerationConfig,
    r: &MessagesRequest,
    max_tokens: u32,
) -> Result<SamplingParams, AnthropicError> {
    let requested = Requested {
        temperature: r.temperature,
        top_p: r.top_p,
        top_k: r.top_k,
        max_tokens: Some(max_tokens),
        stop: r.stop_sequences.clone(),
        ..Requested::default()
    };
    resolve(generation, 1, requested).map_err(|e| AnthropicError::invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_max_tokens_is_not_a_parse_error() {
        let r: MessagesRequest = serde_json::from_value(json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0
        }))
        .unwrap();
        assert_eq!(r.max_tokens, None);
        assert_eq!(r.temperature, Some(0.0));
    }

    #[test]
    fn omitted_sampling_fields_take_the_checkpoints_defaults_as_on_every_surface() {
        let r: MessagesRequest = serde_json::from_value(json!({
            "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]
        }))
        .unwrap();
        let shipped = GenerationConfig {
            temperature: Some(0.6),
            top_p: Some(0.9),
            top_k: Some(20),
            ..GenerationConfig::default()
        };
        let s = sampling_params(&shipped, &r, 4).unwrap();
        // It was Anthropic's 1.0 whatever the checkpoint said.
        assert_eq!((s.temperature, s.top_p, s.top_k), (0.6, 0.9, 20));
        let greedy = GenerationConfig {
            do_sample: Some(false),
            ..shipped
        };
        assert_eq!(sampling_params(&greedy, &r, 4).unwrap().temperature, 0.0);
        // A field the request names wins over the checkpoint.
        let hot: MessagesRequest = serde_json::from_value(json!({
            "model": "m", "max_tokens": 4, "temperature": 1.0,
            "messages": [{"role": "user", "content": "hi"}]
        }))
        .unwrap();
        assert_eq!(sampling_params(&greedy, &hot, 4).unwrap().temperature, 1.0);
    }

    #[test]
    fn fields_beside_the_flattened_conversation_land_in_extra_only_when_unknown() {
        let r: MessagesRequest = serde_json::from_value(json!({
            "model": "m", "max_tokens": 4, "system": "s", "tools": [],
            "messages": [{"role": "user", "content": "hi"}], "mcp_servers": [], "service_tier": "auto"
        }))
        .unwrap();
        let extra: Vec<&str> = r.extra.keys().map(String::as_str).collect();
        assert_eq!(extra, ["mcp_servers", "service_tier"]);
    }

    #[test]
    fn an_unknown_role_is_a_parse_error() {
        let r = serde_json::from_value::<MessagesRequest>(json!({
            "model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]
        }));
        assert!(r.is_err());
    }
}
