//! What `converse` and `converse-stream` render: `system`, the messages with their `text`,
//! `toolUse` and `toolResult` blocks, and `toolConfig`, through the shared tool translation
//! (`crate::tools`) and the model's chat template.

use std::time::Duration;

use serde_json::{Map, Value};

use super::error::ConverseError;
use super::schema::{ConverseRequest, Message, Role};
use crate::parking::{DEFAULT_MARK_TTL, Marks, common_prefix, mark_ttl};
use crate::state::AppState;
use crate::tools::definitions::{DefinitionError, ToolChoice, ToolDefinition, template_tools};
use crate::tools::transcript::{PendingMessage, Transcript};
use crate::tools::{Rendered, forced_constraint, render_prefilled};

/// The prompt's token ids, the call format to parse when tools were rendered, and the grammar
/// when `toolChoice` forces a call.
pub(crate) fn render(
    state: &AppState,
    request: &ConverseRequest,
) -> Result<Rendered, ConverseError> {
    let tools = tool_config(request.tool_config.as_ref())?;
    let forced = match request.tool_config.as_ref().and_then(Value::as_object) {
        Some(config) => tool_choice(config)?.forced(),
        None => None,
    };
    let messages = template_messages(request)?;
    let (prompt, format) = render_prefilled(state, messages, tools.clone(), "messages")?;
    let constraint = forced_constraint(format.as_ref(), tools.as_deref(), forced);
    Ok((prompt, format, constraint))
}

/// Where the request's last `cachePoint` block sits, in tokens of `prompt` (the rendered
/// request), with the longest lifetime its points ask for; `None` without points. A point is
/// `{"cachePoint": {"type": "default"}}` (an optional `ttl` of `5m` or `1h`) in `system`, in a
/// message's content or among the tools; the prefix it ends is the part of `prompt` the
/// conversation cut after the message holding it renders the same (cut before the first
/// message for a point in `system` or the tools).
pub(crate) fn cache_mark(
    state: &AppState,
    request: &ConverseRequest,
    prompt: &[u32],
) -> Result<Option<(usize, Duration)>, ConverseError> {
    let mut marks = Marks::default();
    for (j, block) in request.system.iter().enumerate() {
        marks.note(cache_point(block, &format!("system.{j}"))?, None);
    }
    if let Some(Value::Array(tools)) = request.tool_config.as_ref().and_then(|c| c.get("tools")) {
        for (j, tool) in tools.iter().enumerate() {
            marks.note(cache_point(tool, &format!("toolConfig.tools.{j}"))?, None);
        }
    }
    for (i, message) in request.messages.iter().enumerate() {
        for (j, block) in message.content.iter().enumerate() {
            marks.note(
                cache_point(block, &format!("messages.{i}.content.{j}"))?,
                Some(i),
            );
        }
    }
    let Some((ttl, last_message)) = marks.found() else {
        return Ok(None);
    };
    let mut cut = request.clone();
    cut.messages = match last_message {
        Some(i) => request.messages[..=i].to_vec(),
        None => vec![Message {
            role: Role::User,
            content: vec![serde_json::json!({"text": ""})],
        }],
    };
    // A conversation the template will not render cut there parks nothing.
    let prefix = render(state, &cut).map_or(0, |(tokens, _, _)| common_prefix(prompt, &tokens));
    Ok(Some((prefix, ttl)))
}

/// The lifetime a `cachePoint` block asks for; `None` for any other block.
fn cache_point(block: &Value, field: &str) -> Result<Option<Duration>, ConverseError> {
    let Some(("cachePoint", point)) = only_member(block) else {
        return Ok(None);
    };
    let bad = || {
        ConverseError::validation(format!(
            "{field}.cachePoint: must be {{\"type\": \"default\"}} with an optional \"ttl\" \
             of \"5m\" or \"1h\"; got {point}"
        ))
    };
    let object = point.as_object().ok_or_else(bad)?;
    if object.get("type").and_then(Value::as_str) != Some("default")
        || object.keys().any(|k| k != "type" && k != "ttl")
    {
        return Err(bad());
    }
    match object.get("ttl") {
        None | Some(Value::Null) => Ok(mark_ttl(DEFAULT_MARK_TTL)),
        Some(Value::String(ttl)) => mark_ttl(ttl).map(Some).ok_or_else(bad),
        Some(_) => Err(bad()),
    }
}

/// `system` as a leading system message, then each message's blocks in order.
fn template_messages(request: &ConverseRequest) -> Result<Vec<Value>, ConverseError> {
    if request.messages.is_empty() {
        return Err(ConverseError::validation(
            "messages: must hold at least one message",
        ));
    }
    let mut transcript = Transcript::default();
    if !request.system.is_empty() {
        transcript.system(text_of(&request.system, "system")?);
    }
    for (i, message) in request.messages.iter().enumerate() {
        let mut pending = transcript.message(message.role.as_str());
        for (j, block) in message.content.iter().enumerate() {
            add_block(
                &mut pending,
                message.role,
                block,
                &format!("messages.{i}.content.{j}"),
            )?;
        }
        pending.end();
    }
    Ok(transcript.into_messages())
}

/// A block is an object with exactly one member naming its kind.
fn only_member(block: &Value) -> Option<(&str, &Value)> {
    match block.as_object() {
        Some(object) if object.len() == 1 => object.iter().next().map(|(k, v)| (k.as_str(), v)),
        _ => None,
    }
}

/// One content block: `text` anywhere, `toolUse` from the assistant, `toolResult` from the user.
fn add_block(
    pending: &mut PendingMessage<'_>,
    role: Role,
    block: &Value,
    field: &str,
) -> Result<(), ConverseError> {
    match (only_member(block), role) {
        (Some(("text", Value::String(text))), _) => pending.text(text),
        // A cache point marks a place; it renders nothing (`cache_mark` reads it).
        (Some(("cachePoint", _)), _) => {}
        (Some(("toolUse", tool_use)), Role::Assistant) => {
            let field = format!("{field}.toolUse");
            let Some(input @ Value::Object(_)) = tool_use.get("input") else {
                return Err(ConverseError::validation(format!(
                    "{field}.input: must be an object"
                )));
            };
            pending.call(
                string(tool_use, "toolUseId", &field)?,
                string(tool_use, "name", &field)?,
                input.clone(),
            );
        }
        (Some(("toolResult", result)), Role::User) => {
            let field = format!("{field}.toolResult");
            let content = match result.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::Array(blocks)) => result_text(blocks, &format!("{field}.content"))?,
                Some(_) => {
                    return Err(ConverseError::validation(format!(
                        "{field}.content: must be an array"
                    )));
                }
            };
            pending.tool_result(string(result, "toolUseId", &field)?, content);
        }
        (Some((kind @ ("toolUse" | "toolResult"), _)), _) => {
            let belongs = if kind == "toolUse" {
                "assistant"
            } else {
                "user"
            };
            return Err(ConverseError::validation(format!(
                "{field}: {kind} blocks belong in {belongs} messages"
            )));
        }
        _ => {
            return Err(ConverseError::validation(format!(
                "{field}: only text, toolUse, toolResult and cachePoint blocks are supported"
            )));
        }
    }
    Ok(())
}

fn string<'a>(object: &'a Value, member: &str, field: &str) -> Result<&'a str, ConverseError> {
    object
        .get(member)
        .and_then(Value::as_str)
        .ok_or_else(|| ConverseError::validation(format!("{field}.{member}: must be a string")))
}

/// A tool result's `{"text"}` and `{"json"}` blocks (the JSON written compactly), joined with no
/// separator; any other block is refused by position.
fn result_text(blocks: &[Value], field: &str) -> Result<String, ConverseError> {
    let mut text = String::new();
    for (j, block) in blocks.iter().enumerate() {
        match only_member(block) {
            Some(("text", Value::String(t))) => text.push_str(t),
            Some(("json", json)) => text.push_str(&json.to_string()),
            _ => {
                return Err(ConverseError::validation(format!(
                    "{field}.{j}: only text and json blocks are supported in a toolResult"
                )));
            }
        }
    }
    Ok(text)
}

/// `{"text": ...}` blocks joined with no separator; any other block is refused by position.
fn text_of(blocks: &[Value], field: &str) -> Result<String, ConverseError> {
    let mut text = String::new();
    for (j, block) in blocks.iter().enumerate() {
        match only_member(block) {
            Some(("text", Value::String(t))) => text.push_str(t),
            Some(("cachePoint", _)) => {}
            _ => {
                return Err(ConverseError::validation(format!(
                    "{field}.{j}: only text and cachePoint blocks are supported"
                )));
            }
        }
    }
    Ok(text)
}

/// `toolConfig`: `tools` (at least one `{"toolSpec": {"name", "description", "inputSchema":
/// {"json"}}}`) and `toolChoice` (`{"auto": {}}`, `{"any": {}}` or `{"tool": {"name"}}`;
/// omitted is `auto`), in the template's shape.
fn tool_config(config: Option<&Value>) -> Result<Option<Vec<Value>>, ConverseError> {
    let config = match config {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(config)) => config,
        Some(_) => return Err(ConverseError::validation("toolConfig: must be an object")),
    };
    let definitions = match config.get("tools") {
        Some(Value::Array(tools)) if tools.iter().any(|t| !is_cache_point(t)) => tools
            .iter()
            .enumerate()
            .filter(|(_, tool)| !is_cache_point(tool))
            .map(|(i, tool)| definition(i, tool))
            .collect::<Result<Vec<_>, _>>()?,
        _ => {
            return Err(ConverseError::validation(
                "toolConfig.tools: must be an array of at least one tool",
            ));
        }
    };
    let choice = tool_choice(config)?;
    Ok(template_tools(
        &definitions,
        &choice,
        "toolConfig.tools",
        "toolConfig.toolChoice",
    )?)
}

fn is_cache_point(block: &Value) -> bool {
    matches!(only_member(block), Some(("cachePoint", _)))
}

fn definition(i: usize, tool: &Value) -> Result<ToolDefinition, ConverseError> {
    let at = format!("toolConfig.tools.{i}");
    let Some(("toolSpec", spec)) = only_member(tool) else {
        return Err(ConverseError::validation(format!(
            "{at}: only {{\"toolSpec\": ...}} tools are supported"
        )));
    };
    Ok(ToolDefinition::read(
        &format!("{at}.toolSpec"),
        ("name", spec.get("name")),
        ("description", spec.get("description")),
        ("inputSchema.json", spec.pointer("/inputSchema/json")),
    )?)
}

fn tool_choice(config: &Map<String, Value>) -> Result<ToolChoice, ConverseError> {
    let choice = match config.get("toolChoice") {
        None | Some(Value::Null) => return Ok(ToolChoice::Auto),
        Some(choice) => choice,
    };
    match only_member(choice) {
        Some(("auto", _)) => Ok(ToolChoice::Auto),
        Some(("any", _)) => Ok(ToolChoice::Any),
        Some(("tool", tool)) => match tool.get("name").and_then(Value::as_str) {
            Some(name) => Ok(ToolChoice::Tool(name.to_string())),
            None => Err(ConverseError::validation(
                "toolConfig.toolChoice.tool.name: must be a string",
            )),
        },
        _ => Err(ConverseError::validation(format!(
            "toolConfig.toolChoice: must be {{\"auto\": {{}}}}, {{\"any\": {{}}}} or \
             {{\"tool\": {{\"name\": ...}}}}; got {choice}"
        ))),
    }
}

impl From<DefinitionError> for ConverseError {
    fn from(e: DefinitionError) -> Self {
        ConverseError::validation(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request(body: Value) -> ConverseRequest {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn text_blocks_are_joined_and_others_refused_by_position() {
        let blocks = [json!({"text": "Be "}), json!({"text": "brief."})];
        assert_eq!(text_of(&blocks, "system").unwrap(), "Be brief.");
        let image = [
            json!({"text": "look"}),
            json!({"image": {"format": "png", "source": {"bytes": ""}}}),
        ];
        let e = text_of(&image, "messages.2.content").unwrap_err();
        assert_eq!(e.kind, "ValidationException");
        assert!(
            e.message.starts_with("messages.2.content.1:"),
            "{}",
            e.message
        );
    }

    #[test]
    fn tool_use_and_tool_result_render_like_openai_tool_calls_and_tool_messages() {
        let r = request(json!({
            "system": [{"text": "Be brief."}],
            "messages": [
                {"role": "user", "content": [{"text": "Weather in Paris?"}]},
                {"role": "assistant", "content": [
                    {"text": "Checking."},
                    {"toolUse": {"toolUseId": "tooluse_1", "name": "get_weather",
                                 "input": {"city": "Paris"}}},
                ]},
                {"role": "user", "content": [
                    {"toolResult": {"toolUseId": "tooluse_1",
                                    "content": [{"text": "18"}, {"json": {"unit": "C"}}]}},
                    {"toolResult": {"toolUseId": "tooluse_2", "content": [{"text": "late"}],
                                    "status": "error"}},
                    {"text": "Thanks."},
                ]},
            ],
        }));
        assert_eq!(
            template_messages(&r).unwrap(),
            [
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "Weather in Paris?"}),
                json!({"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "tooluse_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                ]}),
                json!({"role": "tool", "tool_call_id": "tooluse_1",
                       "content": "18{\"unit\":\"C\"}"}),
                json!({"role": "tool", "tool_call_id": "tooluse_2", "content": "late"}),
                json!({"role": "user", "content": "Thanks."}),
            ]
        );
    }

    #[test]
    fn misplaced_or_malformed_tool_blocks_are_refused_by_position() {
        let cases = [
            (
                json!({"role": "user", "content": [
                    {"toolUse": {"toolUseId": "t", "name": "f", "input": {}}}]}),
                "messages.0.content.0: toolUse blocks belong in assistant messages",
            ),
            (
                json!({"role": "assistant", "content": [
                    {"toolUse": {"toolUseId": "t", "input": {}}}]}),
                "messages.0.content.0.toolUse.name:",
            ),
            (
                json!({"role": "user", "content": [{"toolResult": {"toolUseId": "t",
                    "content": [{"image": {}}]}}]}),
                "messages.0.content.0.toolResult.content.0:",
            ),
        ];
        for (message, prefix) in cases {
            let e = template_messages(&request(json!({"messages": [message]}))).unwrap_err();
            assert_eq!(e.kind, "ValidationException");
            assert!(e.message.starts_with(prefix), "{}", e.message);
        }
    }

    #[test]
    fn tool_config_is_read_and_checked() {
        let spec = |name: &str| {
            json!({"toolSpec": {"name": name, "description": "Weather.",
                                "inputSchema": {"json": {"type": "object"}}}})
        };
        let config = |choice: Value| json!({"tools": [spec("get_weather")], "toolChoice": choice});
        let rendered = tool_config(Some(&json!({"tools": [spec("get_weather")]})))
            .unwrap()
            .unwrap();
        assert_eq!(
            rendered[0],
            json!({"type": "function", "function": {"name": "get_weather",
                   "description": "Weather.", "parameters": {"type": "object"}}})
        );
        for choice in [
            json!({"auto": {}}),
            json!({"any": {}}),
            json!({"tool": {"name": "get_weather"}}),
        ] {
            assert!(tool_config(Some(&config(choice))).unwrap().is_some());
        }
        assert!(tool_config(None).unwrap().is_none());
        let refusals = [
            (json!({"tools": []}), "toolConfig.tools:"),
            (
                json!({"tools": [{"toolSpec": {"inputSchema": {"json": {}}}}]}),
                "toolConfig.tools.0.toolSpec.name: Field required",
            ),
            (
                json!({"tools": [{"toolSpec": {"name": "f", "inputSchema": {"json": "x"}}}]}),
                "toolConfig.tools.0.toolSpec.inputSchema.json:",
            ),
            (
                json!({"tools": [spec("f"), spec("f")]}),
                "toolConfig.tools: tool names must be unique",
            ),
            (
                json!({"tools": [{"cachePoint": {"type": "default"}}]}),
                "toolConfig.tools: must be an array of at least one tool",
            ),
            (json!({"tools": [{"image": {}}]}), "toolConfig.tools.0:"),
            (
                config(json!({"tool": {"name": "nope"}})),
                "toolConfig.toolChoice:",
            ),
            (config(json!({"none": {}})), "toolConfig.toolChoice:"),
        ];
        for (config, prefix) in refusals {
            let e = tool_config(Some(&config)).unwrap_err();
            assert_eq!(e.kind, "ValidationException");
            assert!(e.message.starts_with(prefix), "{}", e.message);
        }
        // A cache point among the tools is skipped by the rendering (`cache_mark` reads it).
        let pointed = json!({"tools": [spec("f"), {"cachePoint": {"type": "default"}}]});
        assert_eq!(
            tool_config(Some(&pointed)).unwrap().map(|t| t.len()),
            Some(1)
        );
    }

    #[test]
    fn cache_points_are_read_with_their_lifetime_and_bad_ones_refused_by_position() {
        let ttl = |block: Value| cache_point(&block, "system.1");
        assert_eq!(ttl(json!({"text": "x"})).unwrap(), None);
        assert_eq!(
            ttl(json!({"cachePoint": {"type": "default"}})).unwrap(),
            Some(Duration::from_secs(300))
        );
        assert_eq!(
            ttl(json!({"cachePoint": {"type": "default", "ttl": "1h"}})).unwrap(),
            Some(Duration::from_secs(3600))
        );
        for bad in [
            json!({"cachePoint": {}}),
            json!({"cachePoint": {"type": "default", "ttl": "2d"}}),
            json!({"cachePoint": {"type": "default", "size": 1}}),
            json!({"cachePoint": "default"}),
        ] {
            let e = ttl(bad.clone()).unwrap_err();
            assert!(
                e.message.starts_with("system.1.cachePoint:"),
                "{bad}: {}",
                e.message
            );
        }
    }
}
