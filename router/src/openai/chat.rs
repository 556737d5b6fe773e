//! `POST /v1/chat/completions`: messages rendered through the model's own chat template.

use axum::Extension;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use serde_json::{Value, json};
use strata_model::chat::ChatRequest;

use super::schema::{ChatCompletionRequest, UsageBody};
use super::tools::constraint::{ForcedCall, forced_call};
use super::tools::{Piece, ToolCallSplitter, ToolFormat, parse};
use super::{Framer, Prepared, ResponseMeta, check_model, parse_body, respond};
use crate::auth::Tenant;
use crate::error::ApiError;
use crate::state::AppState;

pub async fn create(
    State(state): State<AppState>,
    tenant: Option<Extension<Tenant>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let mut request: ChatCompletionRequest = parse_body(&body)?;
    check_model(&state, &request.model)?;
    // Taken out of the shared fields, which still refuse them on /v1/completions.
    let tools = tool_list(request.sampling.tools.take())?;
    let (tools, forced) = apply_tool_choice(tools, request.sampling.tool_choice.take())?;
    let (prompt, format) = render(&state, &request.messages, tools.clone())?;
    let mut prepared =
        Prepared::new(&state, &request.sampling, prompt, "messages")?.for_tenant(tenant.as_deref());
    prepared.keep_special_tokens = format
        .as_ref()
        .is_some_and(ToolFormat::keeps_special_tokens);
    if let (Some(forced), Some(format), Some(tools)) = (forced, &format, &tools) {
        if prepared.constraint.is_some() {
            return Err(ApiError::invalid(
                Some("response_format"),
                "`response_format` cannot apply when `tool_choice` forces a tool call",
            ));
        }
        prepared.constraint = Some(forced_call(format, tools, &forced));
    }
    let meta = ResponseMeta::new(&state, "chatcmpl");
    respond(state, prepared, |choice| {
        ChatFramer::new(meta.clone(), format.clone()).for_choice(choice)
    })
    .await
}

/// `tools` as OpenAI function tools; an empty list is no tools.
fn tool_list(tools: Option<Value>) -> Result<Option<Vec<Value>>, ApiError> {
    let tools = match tools {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(tools)) => tools,
        Some(_) => return Err(ApiError::invalid(Some("tools"), "`tools` must be an array")),
    };
    for (i, tool) in tools.iter().enumerate() {
        let is_function = tool.get("type").and_then(Value::as_str) == Some("function");
        let named = tool
            .pointer("/function/name")
            .and_then(Value::as_str)
            .is_some();
        if !is_function || !named {
            return Err(ApiError::invalid(
                Some(&format!("tools[{i}]")),
                format!(
                    "tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                ),
            ));
        }
    }
    Ok((!tools.is_empty()).then_some(tools))
}

/// The tools to render (and so parse calls for) under `tool_choice`, and the call it forces.
/// `none` renders no tools and turns the parser off; `required` forces at least one call of any
/// tool and a named function exactly one call of it (enforced while decoding). A named function
/// must be one of `tools`.
type Choice = (Option<Vec<Value>>, Option<ForcedCall>);

fn apply_tool_choice(tools: Option<Vec<Value>>, choice: Option<Value>) -> Result<Choice, ApiError> {
    let refuse = |message: String| Err(ApiError::invalid(Some("tool_choice"), message));
    let choice = match choice {
        None | Some(Value::Null) => return Ok((tools, None)),
        Some(choice) => choice,
    };
    match (&choice, choice.as_str()) {
        (_, Some("none")) => Ok((None, None)),
        (_, Some("auto")) if tools.is_some() => Ok((tools, None)),
        (_, Some("required")) if tools.is_some() => Ok((tools, Some(ForcedCall::Any))),
        (_, Some(other @ ("auto" | "required"))) => {
            refuse(format!("tool_choice {other:?} needs a non-empty `tools`"))
        }
        (Value::Object(_), _) => {
            let name = (choice.get("type").and_then(Value::as_str) == Some("function"))
                .then(|| choice.pointer("/function/name").and_then(Value::as_str))
                .flatten();
            let Some(name) = name else {
                return refuse(
                    "tool_choice must be \"none\", \"auto\", \"required\" or                      {\"type\": \"function\", \"function\": {\"name\": ...}}"
                        .into(),
                );
            };
            let known = tools
                .iter()
                .flatten()
                .any(|t| t.pointer("/function/name").and_then(Value::as_str) == Some(name));
            if known {
                Ok((tools, Some(ForcedCall::Named(name.to_string()))))
            } else {
                refuse(format!(
                    "tool_choice names {name:?}, which is not in `tools`"
                ))
            }
        }
        _ => refuse(format!(
            "tool_choice must be \"none\", \"auto\", \"required\" or a named function; got {choice}"
        )),
    }
}

/// The conversation as prompt token ids (the template supplies every special token), and the
/// tool-call format to parse when tools were rendered.
fn render(
    state: &AppState,
    messages: &[Value],
    tools: Option<Vec<Value>>,
) -> Result<(Vec<u32>, Option<ToolFormat>), ApiError> {
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
    let has_tools = tools.is_some();
    let text = render_text(state, messages, tools, "messages", true)?;
    let format = has_tools.then(|| ToolFormat::detect(&text));
    Ok((state.encode(&text, false, "messages")?, format))
}

/// Already-normalised messages through the model's chat template with the generation prompt,
/// as token ids. `param` names the request field a missing template is blamed on.
pub(crate) fn render_messages(
    state: &AppState,
    messages: Vec<Value>,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    render_conversation(state, messages, param, true)
}

/// The token ids of `messages` rendered by the chat template, with the generation prompt or
/// without it (a conversation's prefix, as a later turn renders it).
pub(crate) fn render_conversation(
    state: &AppState,
    messages: Vec<Value>,
    param: &'static str,
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ApiError> {
    let text = render_text(state, messages, None, param, add_generation_prompt)?;
    state.encode(&text, false, param)
}

fn render_text(
    state: &AppState,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    param: &'static str,
    add_generation_prompt: bool,
) -> Result<String, ApiError> {
    let template = state.template.as_ref().ok_or_else(|| {
        ApiError::invalid(
            Some(param),
            "the served model has no chat template; use /v1/completions",
        )
    })?;
    Ok(template.render(&ChatRequest {
        messages,
        tools,
        add_generation_prompt,
        extra: Default::default(),
    })?)
}

/// Templates expect `content` as a string: the array-of-text-parts form is joined, and the
/// `developer` role (OpenAI's newer name for `system`) becomes `system`. Other fields pass
/// through untouched, except an assistant's `tool_calls[].function.arguments`: OpenAI sends a
/// JSON string, templates expect an object, so a string holding valid JSON becomes that value.
pub(crate) fn normalize_message(index: usize, message: &Value) -> Result<Value, ApiError> {
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
        Some("system" | "user" | "assistant" | "tool") => {}
        // A role the template does not know would be dropped from the prompt without a word.
        Some(other) => {
            return Err(ApiError::invalid(
                Some(&format!("messages[{index}].role")),
                format!(
                    "messages[{index}].role must be one of system, developer, user, assistant, \
                     tool; got {other:?}"
                ),
            ));
        }
        None => {
            return Err(ApiError::invalid(
                Some(&format!("messages[{index}].role")),
                format!("messages[{index}].role must be a string"),
            ));
        }
    }
    let assistant = object.get("role").and_then(Value::as_str) == Some("assistant");
    match object.get("content") {
        Some(Value::String(_) | Value::Array(_)) => {}
        // An assistant turn that only called tools carries `content: null` (or none): OpenAI's
        // own shape, and what `message.model_dump()` gives back. Templates concatenate it.
        None | Some(Value::Null) if assistant => {
            object.insert("content".into(), "".into());
        }
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                Some(&format!("messages[{index}].content")),
                format!("messages[{index}].content is required (a string or text parts)"),
            ));
        }
        Some(other) => {
            return Err(ApiError::invalid(
                Some(&format!("messages[{index}].content")),
                format!(
                    "messages[{index}].content must be a string or an array of text parts, not \
                     {}",
                    json_kind(other)
                ),
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
    if let Some(Value::Array(calls)) = object.get_mut("tool_calls") {
        for call in calls {
            let Some(arguments) = call.pointer_mut("/function/arguments") else {
                continue;
            };
            if let Some(parsed) = arguments
                .as_str()
                .and_then(|a| serde_json::from_str::<Value>(a).ok())
                .filter(Value::is_object)
            {
                *arguments = parsed;
            }
        }
    }
    Ok(Value::Object(object))
}

/// The JSON type of `v`, as an error message names it.
fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Chat's objects; with tools rendered, text is split into content and tool calls.
struct ChatFramer {
    meta: ResponseMeta,
    tools: Option<ToolStream>,
    /// The choice framed (`n` > 1 frames each on its own).
    choice: usize,
}

/// A streamed choice's tool-call state: the splitter and how many calls were sent.
struct ToolStream {
    format: ToolFormat,
    splitter: ToolCallSplitter,
    sent: usize,
}

impl ChatFramer {
    fn new(meta: ResponseMeta, format: Option<ToolFormat>) -> Self {
        let tools = format.map(|format| ToolStream {
            splitter: ToolCallSplitter::new(format.clone()),
            format,
            sent: 0,
        });
        Self {
            meta,
            tools,
            choice: 0,
        }
    }

    fn for_choice(self, choice: usize) -> Self {
        Self { choice, ..self }
    }

    fn chunk(&self, choices: Value) -> Value {
        json!({
            "id": self.meta.id,
            "object": "chat.completion.chunk",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": choices,
        })
    }

    /// Unique within the server's run: the response number, the choice (beyond the first)
    /// and the call's index.
    fn call_id(&self, index: usize) -> String {
        let number = self.meta.id.rsplit('-').next().unwrap_or_default();
        match self.choice {
            0 => format!("call_{number}_{index}"),
            choice => format!("call_{number}_{choice}_{index}"),
        }
    }

    fn tool_delta(&self, delta: Value) -> Value {
        self.chunk(json!([{
            "index": 0,
            "delta": delta,
            "logprobs": null,
            "finish_reason": null,
        }]))
    }

    /// A released piece as chunks: content, or a call's header then its arguments.
    fn piece_chunks(&mut self, piece: Piece, out: &mut Vec<Value>) {
        match piece {
            Piece::Text(text) => out.push(self.delta(&text)),
            Piece::Call(call) => {
                let Some(tools) = self.tools.as_mut() else {
                    return;
                };
                let index = tools.sent;
                tools.sent += 1;
                let id = self.call_id(index);
                out.push(self.tool_delta(json!({"tool_calls": [{
                    "index": index,
                    "id": id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }]})));
                out.push(self.tool_delta(json!({"tool_calls": [{
                    "index": index,
                    "function": {"arguments": call.arguments},
                }]})));
            }
        }
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
        self.tool_delta(json!({"content": text}))
    }

    fn finish(&self, reason: &str) -> Value {
        self.chunk(json!([{
            "index": 0,
            "delta": {},
            "logprobs": null,
            "finish_reason": reason,
        }]))
    }

    fn deltas(&mut self, text: &str) -> Vec<Value> {
        let Some(tools) = self.tools.as_mut() else {
            return vec![self.delta(text)];
        };
        let pieces = tools.splitter.push(text);
        let mut out = Vec::new();
        for piece in pieces {
            self.piece_chunks(piece, &mut out);
        }
        out
    }

    fn closing(&mut self, reason: &str) -> Vec<Value> {
        // Cut by the token limit: a call it cut off is dropped and the answer ends as `length`.
        let cut = reason == "length";
        let pieces = self
            .tools
            .as_mut()
            .map(|t| t.splitter.finish(cut))
            .unwrap_or_default();
        let mut out = Vec::new();
        for piece in pieces {
            self.piece_chunks(piece, &mut out);
        }
        let called = self.tools.as_ref().is_some_and(|t| t.sent > 0);
        out.push(self.finish(if called && !cut { "tool_calls" } else { reason }));
        out
    }

    fn usage(&self, usage: UsageBody) -> Value {
        let mut chunk = self.chunk(json!([]));
        chunk["usage"] = json!(usage);
        chunk
    }

    fn whole(&self, text: String, reason: &str, usage: UsageBody) -> Value {
        let mut message = json!({"role": "assistant", "content": text});
        let mut reason = reason;
        if let Some(tools) = &self.tools {
            let cut = reason == "length";
            let parsed = parse(tools.format.clone(), &text, cut);
            if !parsed.calls.is_empty() {
                let calls = parsed
                    .calls
                    .into_iter()
                    .enumerate()
                    .map(|(i, call)| {
                        json!({
                            "id": self.call_id(i),
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        })
                    })
                    .collect::<Vec<_>>();
                let content = parsed.content.trim();
                message["content"] = if content.is_empty() {
                    Value::Null
                } else {
                    content.into()
                };
                message["tool_calls"] = calls.into();
                if !cut {
                    reason = "tool_calls";
                }
            } else {
                // Without a call, the text as the parser left it (a cut-off call dropped).
                message["content"] = parsed.content.into();
            }
        }
        json!({
            "id": self.meta.id,
            "object": "chat.completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [{
                "index": 0,
                "message": message,
                "logprobs": null,
                "finish_reason": reason,
            }],
            "usage": usage,
        })
    }
}

/// The framing the handler applies to generated text, offline: the whole response for `text`
/// and the stream's chunks for `pieces` (each as one engine step), with tool calls parsed in
/// `format`. For checking the JSON clients parse without a model that emits calls.
pub fn frame_offline(
    pieces: &[&str],
    reason: &str,
    format: Option<ToolFormat>,
) -> (Value, Vec<Value>) {
    let meta = || ResponseMeta {
        id: "chatcmpl-0".into(),
        created: 0,
        model: "offline".into(),
    };
    let usage = UsageBody::new(1, pieces.len() as u32);
    let whole = ChatFramer::new(meta(), format.clone()).whole(pieces.concat(), reason, usage);
    let mut framer = ChatFramer::new(meta(), format);
    let mut chunks = framer.opening().into_iter().collect::<Vec<_>>();
    for piece in pieces {
        chunks.extend(framer.deltas(piece));
    }
    chunks.extend(framer.closing(reason));
    chunks.push(framer.usage(usage));
    (whole, chunks)
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
    fn tool_call_arguments_become_objects_for_the_template() {
        let m = json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}},
            {"id": "d", "type": "function", "function": {"name": "g", "arguments": "not json"}}
        ]});
        let out = normalize_message(0, &m).unwrap();
        assert_eq!(
            out["tool_calls"][0]["function"]["arguments"],
            json!({"a": 1})
        );
        assert_eq!(out["tool_calls"][1]["function"]["arguments"], "not json");
    }

    #[test]
    fn tool_choice_is_checked_against_tools() {
        let tools = || {
            tool_list(Some(
                json!([{"type": "function", "function": {"name": "f"}}]),
            ))
        };
        let named = |n: &str| Some(json!({"type": "function", "function": {"name": n}}));
        assert_eq!(
            apply_tool_choice(tools().unwrap(), named("f")).unwrap(),
            (tools().unwrap(), Some(ForcedCall::Named("f".into())))
        );
        assert_eq!(
            apply_tool_choice(tools().unwrap(), Some("none".into())).unwrap(),
            (None, None)
        );
        for bad in [named("g"), Some("sometimes".into()), Some(json!(3))] {
            let e = apply_tool_choice(tools().unwrap(), bad).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("tool_choice"));
        }
        let e = apply_tool_choice(None, Some("required".into())).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let e = tool_list(Some(json!([{"type": "retrieval"}]))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0]"));
        assert!(tool_list(Some(json!([]))).unwrap().is_none());
    }

    #[test]
    fn an_assistant_turn_without_content_renders_as_empty_and_others_need_content() {
        let call = json!([{"id": "c", "type": "function",
                           "function": {"name": "f", "arguments": "{}"}}]);
        for m in [
            json!({"role": "assistant", "content": null, "tool_calls": call}),
            json!({"role": "assistant", "tool_calls": call}),
        ] {
            assert_eq!(normalize_message(1, &m).unwrap()["content"], "");
        }
        for m in [
            json!({"role": "user", "content": null}),
            json!({"role": "tool", "tool_call_id": "c"}),
        ] {
            let e = normalize_message(3, &m).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("messages[3].content"));
        }
        let e = normalize_message(0, &json!({"role": "user", "content": 5})).unwrap_err();
        assert!(e.message.contains("not a number"), "{}", e.message);
    }

    #[test]
    fn a_message_without_a_role_is_refused() {
        let e = normalize_message(0, &json!({"content": "hi"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
    }

    #[test]
    fn a_message_with_an_unknown_role_is_refused_by_name() {
        let e = normalize_message(2, &json!({"role": "narrator", "content": "hi"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[2].role"));
        assert!(e.message.contains("\"narrator\""), "{}", e.message);
        for role in ["system", "developer", "user", "assistant", "tool"] {
            assert!(normalize_message(0, &json!({"role": role, "content": "hi"})).is_ok());
        }
    }
}
