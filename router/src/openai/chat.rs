//! `POST /v1/chat/completions`: messages rendered through the model's own chat template.

use axum::Extension;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use serde_json::{Value, json};
use strata_model::chat::ChatRequest;

use super::schema::{ChatCompletionRequest, UsageBody};
use super::{Framer, Prepared, ResponseMeta, check_model, parse_body, respond};
use crate::auth::Tenant;
use crate::error::ApiError;
use crate::state::AppState;

pub async fn create(
    State(state): State<AppState>,
    tenant: Option<Extension<Tenant>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let request: ChatCompletionRequest = parse_body(&body)?;
    check_model(&state, &request.model)?;
    let prompt = render(&state, &request.messages)?;
    let prepared =
        Prepared::new(&state, &request.sampling, prompt, "messages")?.for_tenant(tenant.as_deref());
    let framer = ChatFramer(ResponseMeta::new(&state, "chatcmpl"));
    respond(state, prepared, framer).await
}

/// The conversation as prompt token ids (the template supplies every special token).
fn render(state: &AppState, messages: &[Value]) -> Result<Vec<u32>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            Some("messages"),
            "`messages` must hold at least one message",
        ));
    }
    let messages = messages
        .iter()
        .enumerate()
        .map(|(i, m)| normalize_message(i, m))
        .collect::<Result<_, _>>()?;
    render_messages(state, messages, "messages")
}

/// Already-normalised messages through the model's chat template with the generation prompt,
/// as token ids. `param` names the request field a missing template is blamed on.
pub(crate) fn render_messages(
    state: &AppState,
    messages: Vec<Value>,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    let template = state.template.as_ref().ok_or_else(|| {
        ApiError::invalid(
            Some(param),
            "the served model has no chat template; use /v1/completions",
        )
    })?;
    let text = template.render(&ChatRequest {
        messages,
        tools: None,
        add_generation_prompt: true,
        extra: Default::default(),
    })?;
    Ok(state.tokenizer.encode(&text, false)?)
}

/// Templates expect `content` as a string: the array-of-text-parts form is joined, and the
/// `developer` role (OpenAI's newer name for `system`) becomes `system`. Other fields pass
/// through untouched.
fn normalize_message(index: usize, message: &Value) -> Result<Value, ApiError> {
    let Some(object) = message.as_object() else {
        return Err(ApiError::invalid(
            Some(&format!("messages[{index}]")),
            format!("messages[{index}] must be an object"),
        ));
    };
    let mut object = object.clone();
    match object.get("role").and_then(Value::as_str) {
        Some("developer") => {
            object.insert("role".into(), "system".into());
        }
        Some(_) => {}
        None => {
            return Err(ApiError::invalid(
                Some(&format!("messages[{index}].role")),
                format!("messages[{index}].role must be a string"),
            ));
        }
    }
    if let Some(Value::Array(parts)) = object.get("content") {
        let mut text = String::new();
        for (j, part) in parts.iter().enumerate() {
            match (part.get("type").and_then(Value::as_str), part.get("text")) {
                (Some("text"), Some(Value::String(t))) => text.push_str(t),
                _ => {
                    return Err(ApiError::invalid(
                        Some(&format!("messages[{index}].content[{j}]")),
                        format!(
                            "messages[{index}].content[{j}]: only text parts \
                             ({{\"type\": \"text\", \"text\": ...}}) are supported"
                        ),
                    ));
                }
            }
        }
        object.insert("content".into(), text.into());
    }
    Ok(Value::Object(object))
}

struct ChatFramer(ResponseMeta);

impl ChatFramer {
    fn chunk(&self, choices: Value) -> Value {
        json!({
            "id": self.0.id,
            "object": "chat.completion.chunk",
            "created": self.0.created,
            "model": self.0.model,
            "choices": choices,
        })
    }
}

impl Framer for ChatFramer {
    fn opening(&self) -> Option<Value> {
        Some(self.chunk(json!([{
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": null,
            "finish_reason": null,
        }])))
    }

    fn delta(&self, text: &str) -> Value {
        self.chunk(json!([{
            "index": 0,
            "delta": {"content": text},
            "logprobs": null,
            "finish_reason": null,
        }]))
    }

    fn finish(&self, reason: &str) -> Value {
        self.chunk(json!([{
            "index": 0,
            "delta": {},
            "logprobs": null,
            "finish_reason": reason,
        }]))
    }

    fn usage(&self, usage: UsageBody) -> Value {
        let mut chunk = self.chunk(json!([]));
        chunk["usage"] = json!(usage);
        chunk
    }

    fn whole(&self, text: String, reason: &str, usage: UsageBody) -> Value {
        json!({
            "id": self.0.id,
            "object": "chat.completion",
            "created": self.0.created,
            "model": self.0.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": reason,
            }],
            "usage": usage,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_parts_are_joined_and_developer_becomes_system() {
        let m = json!({"role": "developer", "content": [
            {"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}
        ]});
        let out = normalize_message(0, &m).unwrap();
        assert_eq!(out, json!({"role": "system", "content": "Be brief."}));
    }

    #[test]
    fn non_text_parts_are_refused_by_position() {
        let m = json!({"role": "user", "content": [
            {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}
        ]});
        let e = normalize_message(2, &m).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[2].content[1]"));
    }

    #[test]
    fn a_message_without_a_role_is_refused() {
        let e = normalize_message(0, &json!({"content": "hi"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
    }
}
