//! What `/v1/messages` and `/v1/messages/count_tokens` render: `system`, the messages with their
//! text, `tool_use` and `tool_result` blocks, and `tools` under `tool_choice`, through the shared
//! tool translation (`crate::tools`) and the model's chat template.

use std::time::Duration;

use serde_json::Value;

use super::error::AnthropicError;
use super::schema::{Content, Conversation, Message, Role};
use crate::parking::{DEFAULT_MARK_TTL, Marks, common_prefix, mark_ttl};
use crate::state::AppState;
use crate::tools::definitions::{DefinitionError, ToolChoice, ToolDefinition, template_tools};
use crate::tools::transcript::{PendingMessage, Transcript};
use crate::tools::{Rendered, forced_constraint, render_prefilled};

/// The prompt's token ids, the call format to parse when tools were rendered, and the grammar
/// when `tool_choice` forces a call.
pub(crate) fn render(
    state: &AppState,
    conversation: &Conversation,
) -> Result<Rendered, AnthropicError> {
    let tools = tools(
        conversation.tools.as_ref(),
        conversation.tool_choice.as_ref(),
    )?;
    let forced = tool_choice(conversation.tool_choice.as_ref())?.forced();
    let messages = template_messages(conversation)?;
    let (prompt, format) = render_prefilled(state, messages, tools.clone(), "messages")?;
    let constraint = forced_constraint(format.as_ref(), tools.as_deref(), forced);
    Ok((prompt, format, constraint))
}

/// Where the request's last `cache_control` mark ends, in tokens of `prompt` (the rendered
/// request), with the longest lifetime its marks ask for; `None` without marks. A mark is
/// `{"type": "ephemeral"}` with an optional `ttl` of `5m` or `1h`, on a system block, a tool or
/// a message's content block; the prefix it ends is the part of `prompt` the conversation cut
/// after the marked message renders the same (cut before the first message for a mark on the
/// system prompt or the tools).
pub(crate) fn cache_mark(
    state: &AppState,
    conversation: &Conversation,
    prompt: &[u32],
) -> Result<Option<(usize, Duration)>, AnthropicError> {
    let mut marks = Marks::default();
    if let Some(Content::Blocks(blocks)) = &conversation.system {
        for (j, block) in blocks.iter().enumerate() {
            marks.note(cache_control_ttl(block, &format!("system.{j}"))?, None);
        }
    }
    if let Some(Value::Array(tools)) = &conversation.tools {
        for (j, tool) in tools.iter().enumerate() {
            marks.note(cache_control_ttl(tool, &format!("tools.{j}"))?, None);
        }
    }
    for (i, message) in conversation.messages.iter().enumerate() {
        if let Content::Blocks(blocks) = &message.content {
            for (j, block) in blocks.iter().enumerate() {
                let field = format!("messages.{i}.content.{j}");
                marks.note(cache_control_ttl(block, &field)?, Some(i));
            }
        }
    }
    let Some((ttl, last_message)) = marks.found() else {
        return Ok(None);
    };
    let mut cut = conversation.clone();
    cut.messages = match last_message {
        Some(i) => conversation.messages[..=i].to_vec(),
        None => vec![Message {
            role: Role::User,
            content: Content::Text(String::new()),
        }],
    };
    // A conversation the template will not render cut there parks nothing.
    let prefix = render(state, &cut).map_or(0, |(tokens, _, _)| common_prefix(prompt, &tokens));
    Ok(Some((prefix, ttl)))
}

/// The lifetime a block's `cache_control` asks for; `None` when it has none.
fn cache_control_ttl(value: &Value, field: &str) -> Result<Option<Duration>, AnthropicError> {
    let Some(control) = value.get("cache_control").filter(|c| !c.is_null()) else {
        return Ok(None);
    };
    let bad = || {
        AnthropicError::invalid(format!(
            "{field}.cache_control: must be {{\"type\": \"ephemeral\"}} with an optional \
             \"ttl\" of \"5m\" or \"1h\"; got {control}"
        ))
    };
    let object = control.as_object().ok_or_else(bad)?;
    if object.get("type").and_then(Value::as_str) != Some("ephemeral")
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
fn template_messages(conversation: &Conversation) -> Result<Vec<Value>, AnthropicError> {
    if conversation.messages.is_empty() {
        return Err(AnthropicError::invalid(
            "messages: must hold at least one message",
        ));
    }
    let mut transcript = Transcript::default();
    if let Some(system) = &conversation.system {
        transcript.system(text_of(system, "system")?);
    }
    for (i, message) in conversation.messages.iter().enumerate() {
        let mut pending = transcript.message(message.role.as_str());
        let field = format!("messages.{i}.content");
        match &message.content {
            Content::Text(text) => pending.text(text),
            Content::Blocks(blocks) => {
                for (j, block) in blocks.iter().enumerate() {
                    add_block(&mut pending, message.role, block, &format!("{field}.{j}"))?;
                }
            }
        }
        pending.end();
    }
    Ok(transcript.into_messages())
}

/// One content block: text anywhere, `tool_use` from the assistant, `tool_result` from the user.
fn add_block(
    pending: &mut PendingMessage<'_>,
    role: Role,
    block: &Value,
    field: &str,
) -> Result<(), AnthropicError> {
    let string = |member: &str| -> Result<&str, AnthropicError> {
        block
            .get(member)
            .and_then(Value::as_str)
            .ok_or_else(|| AnthropicError::invalid(format!("{field}.{member}: must be a string")))
    };
    match (block.get("type").and_then(Value::as_str), role) {
        (Some("text"), _) => pending.text(string("text")?),
        (Some("tool_use"), Role::Assistant) => {
            let Some(input @ Value::Object(_)) = block.get("input") else {
                return Err(AnthropicError::invalid(format!(
                    "{field}.input: must be an object"
                )));
            };
            pending.call(string("id")?, string("name")?, input.clone());
        }
        (Some("tool_result"), Role::User) => {
            let content = match block.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(text)) => text.clone(),
                Some(Value::Array(blocks)) => joined_text(blocks, &format!("{field}.content"))?,
                Some(_) => {
                    return Err(AnthropicError::invalid(format!(
                        "{field}.content: must be a string or an array of text blocks"
                    )));
                }
            };
            pending.tool_result(string("tool_use_id")?, content);
        }
        (Some(kind @ ("tool_use" | "tool_result")), _) => {
            let belongs = if kind == "tool_use" {
                "assistant"
            } else {
                "user"
            };
            return Err(AnthropicError::invalid(format!(
                "{field}: {kind} blocks belong in {belongs} messages"
            )));
        }
        _ => {
            return Err(AnthropicError::invalid(format!(
                "{field}: only text, tool_use and tool_result blocks are supported"
            )));
        }
    }
    Ok(())
}

/// A string, or text blocks joined with no separator.
fn text_of(content: &Content, field: &str) -> Result<String, AnthropicError> {
    match content {
        Content::Text(text) => Ok(text.clone()),
        Content::Blocks(blocks) => joined_text(blocks, field),
    }
}

/// Text blocks joined with no separator; any other block is refused by position.
fn joined_text(blocks: &[Value], field: &str) -> Result<String, AnthropicError> {
    let mut text = String::new();
    for (j, block) in blocks.iter().enumerate() {
        match (block.get("type").and_then(Value::as_str), block.get("text")) {
            (Some("text"), Some(Value::String(t))) => text.push_str(t),
            _ => {
                return Err(AnthropicError::invalid(format!(
                    "{field}.{j}: only text blocks ({{\"type\": \"text\", \"text\": ...}}) are \
                     supported here"
                )));
            }
        }
    }
    Ok(text)
}

/// `tools` (custom tools: `name`, `description`, `input_schema`) under `tool_choice`, in the
/// template's shape; `None` when nothing is to be rendered.
fn tools(
    tools: Option<&Value>,
    choice: Option<&Value>,
) -> Result<Option<Vec<Value>>, AnthropicError> {
    let definitions = match tools {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(tools)) => tools
            .iter()
            .enumerate()
            .map(|(i, tool)| definition(i, tool))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(AnthropicError::invalid("tools: must be an array")),
    };
    let choice = tool_choice(choice)?;
    Ok(template_tools(
        &definitions,
        &choice,
        "tools",
        "tool_choice",
    )?)
}

fn definition(i: usize, tool: &Value) -> Result<ToolDefinition, AnthropicError> {
    let at = format!("tools.{i}");
    if !tool.is_object() {
        return Err(AnthropicError::invalid(format!("{at}: must be an object")));
    }
    // Server tools (`bash_20250124`, `web_search_20250305`, ...) run on Anthropic's side.
    match tool.get("type").and_then(Value::as_str) {
        None | Some("custom") => {}
        Some(other) => {
            return Err(AnthropicError::invalid(format!(
                "{at}.type: only custom tools are supported; got {other:?}"
            )));
        }
    }
    Ok(ToolDefinition::read(
        &at,
        ("name", tool.get("name")),
        ("description", tool.get("description")),
        ("input_schema", tool.get("input_schema")),
    )?)
}

/// `{"type": "auto" | "any" | "none"}` or `{"type": "tool", "name"}`; omitted is `auto`.
/// `disable_parallel_tool_use` is accepted and has no effect.
fn tool_choice(choice: Option<&Value>) -> Result<ToolChoice, AnthropicError> {
    let Some(choice) = choice.filter(|c| !c.is_null()) else {
        return Ok(ToolChoice::Auto);
    };
    let name = choice.get("name").and_then(Value::as_str);
    match (choice.get("type").and_then(Value::as_str), name) {
        (Some("auto"), _) => Ok(ToolChoice::Auto),
        (Some("any"), _) => Ok(ToolChoice::Any),
        (Some("none"), _) => Ok(ToolChoice::None),
        (Some("tool"), Some(name)) => Ok(ToolChoice::Tool(name.to_string())),
        (Some("tool"), None) => Err(AnthropicError::invalid("tool_choice.name: Field required")),
        _ => Err(AnthropicError::invalid(format!(
            "tool_choice: must be {{\"type\": \"auto\" | \"any\" | \"none\"}} or \
             {{\"type\": \"tool\", \"name\": ...}}; got {choice}"
        ))),
    }
}

impl From<DefinitionError> for AnthropicError {
    fn from(e: DefinitionError) -> Self {
        AnthropicError::invalid(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn conversation(body: Value) -> Conversation {
        serde_json::from_value(body).unwrap()
    }

    #[test]
    fn text_blocks_are_joined_and_others_refused_by_position() {
        let blocks = Content::Blocks(vec![
            json!({"type": "text", "text": "Be "}),
            json!({"type": "text", "text": "brief."}),
        ]);
        assert_eq!(text_of(&blocks, "system").unwrap(), "Be brief.");
        let c = conversation(json!({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [
                {"type": "text", "text": "look"}, {"type": "image", "source": {}}
            ]},
        ]}));
        let e = template_messages(&c).unwrap_err();
        assert!(
            e.message.starts_with("messages.2.content.1:"),
            "{}",
            e.message
        );
    }

    #[test]
    fn tool_use_and_tool_result_render_like_openai_tool_calls_and_tool_messages() {
        let c = conversation(json!({
            "system": "Be brief.",
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris"}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1",
                     "content": [{"type": "text", "text": "18"}, {"type": "text", "text": "°C"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "late",
                     "is_error": true},
                    {"type": "text", "text": "Thanks."},
                ]},
            ],
        }));
        assert_eq!(
            template_messages(&c).unwrap(),
            [
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "Weather in Paris?"}),
                json!({"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "toolu_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                ]}),
                json!({"role": "tool", "tool_call_id": "toolu_1", "content": "18°C"}),
                json!({"role": "tool", "tool_call_id": "toolu_2", "content": "late"}),
                json!({"role": "user", "content": "Thanks."}),
            ]
        );
    }

    #[test]
    fn misplaced_or_malformed_tool_blocks_are_refused_by_position() {
        let cases = [
            (
                json!({"role": "user", "content": [
                    {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}),
                "messages.0.content.0: tool_use blocks belong in assistant messages",
            ),
            (
                json!({"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}),
                "messages.0.content.0.input:",
            ),
            (
                json!({"role": "user", "content": [
                    {"type": "tool_result", "content": "x"}]}),
                "messages.0.content.0.tool_use_id:",
            ),
            (
                json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                    "content": [{"type": "image", "source": {}}]}]}),
                "messages.0.content.0.content.0:",
            ),
        ];
        for (message, prefix) in cases {
            let c = conversation(json!({"messages": [message]}));
            let e = template_messages(&c).unwrap_err();
            assert!(e.message.starts_with(prefix), "{}", e.message);
        }
    }

    #[test]
    fn tools_and_tool_choice_are_read_and_checked() {
        let weather = json!([{"name": "get_weather", "description": "Weather.",
                               "input_schema": {"type": "object"}}]);
        let rendered = tools(Some(&weather), None).unwrap().unwrap();
        assert_eq!(rendered[0]["function"]["name"], "get_weather");
        assert_eq!(
            rendered[0]["function"]["parameters"],
            json!({"type": "object"})
        );
        for choice in [
            json!({"type": "auto"}),
            json!({"type": "any"}),
            json!({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true}),
        ] {
            assert!(
                tools(Some(&weather), Some(&choice)).unwrap().is_some(),
                "{choice}"
            );
        }
        assert!(
            tools(Some(&weather), Some(&json!({"type": "none"})))
                .unwrap()
                .is_none()
        );
        assert!(tools(None, None).unwrap().is_none());
        let refusals = [
            (
                json!([{"input_schema": {}}]),
                json!(null),
                "tools.0.name: Field required",
            ),
            (
                json!([{"name": "f", "input_schema": []}]),
                json!(null),
                "tools.0.input_schema:",
            ),
            (
                json!([{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]),
                json!(null),
                "tools: tool names must be unique",
            ),
            (
                json!([{"type": "web_search_20250305", "name": "web_search"}]),
                json!(null),
                "tools.0.type:",
            ),
            (
                weather.clone(),
                json!({"type": "tool", "name": "nope"}),
                "tool_choice:",
            ),
            (
                weather.clone(),
                json!({"type": "tool"}),
                "tool_choice.name:",
            ),
            (
                weather.clone(),
                json!({"type": "sometimes"}),
                "tool_choice:",
            ),
            (json!([]), json!({"type": "any"}), "tool_choice:"),
        ];
        for (tool_list, choice, prefix) in refusals {
            let e = tools(Some(&tool_list), Some(&choice)).unwrap_err();
            assert_eq!(e.kind, "invalid_request_error");
            assert!(e.message.starts_with(prefix), "{}", e.message);
        }
    }
}
