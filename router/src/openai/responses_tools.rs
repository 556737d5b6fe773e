//! Function tools on `/v1/responses`: the request's flat `tools` (`{"type": "function", "name",
//! "description", "parameters", "strict"}`) and `tool_choice` in the chat template's shape, and
//! the tool input items (`function_call`, `function_call_output`) as the template-shaped
//! assistant and `tool` messages chat renders. The definitions are checked by the shared
//! [`crate::tools::definitions`], so a tool valid on one surface is valid on every other.

use serde_json::{Value, json};

use crate::error::ApiError;
use crate::tools::constraint::ForcedCall;
use crate::tools::definitions::{DefinitionError, ToolChoice, ToolDefinition, template_tools};

/// The request's tools as the template takes them, the call the choice forces, and what the
/// response echoes back.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ResponseTools {
    /// `None` when nothing is rendered (no tools, or `tool_choice: "none"`).
    pub template: Option<Vec<Value>>,
    pub forced: Option<ForcedCall>,
    /// `tools` as sent (`[]` when omitted).
    pub echo_tools: Value,
    /// `tool_choice` as sent (`"auto"` when omitted, OpenAI's default).
    pub echo_choice: Value,
}

/// Reads `tools` and `tool_choice`. Only function tools are served: another type (`web_search`,
/// `file_search`, ...) is refused naming `tools[i].type`.
pub(super) fn read(
    tools: Option<&Value>,
    choice: Option<&Value>,
) -> Result<ResponseTools, ApiError> {
    let tools = match tools {
        None | Some(Value::Null) => &[][..],
        Some(Value::Array(tools)) => tools.as_slice(),
        Some(_) => return Err(ApiError::invalid(Some("tools"), "`tools` must be an array")),
    };
    let definitions = tools
        .iter()
        .enumerate()
        .map(|(i, tool)| definition(i, tool))
        .collect::<Result<Vec<_>, _>>()?;
    let choice = choice.filter(|c| !c.is_null());
    let tool_choice = tool_choice(choice)?;
    let template =
        template_tools(&definitions, &tool_choice, "tools", "tool_choice").map_err(refusal)?;
    Ok(ResponseTools {
        forced: template.as_ref().and_then(|_| tool_choice.forced()),
        template,
        echo_tools: Value::Array(tools.to_vec()),
        echo_choice: choice.cloned().unwrap_or_else(|| "auto".into()),
    })
}

fn definition(i: usize, tool: &Value) -> Result<ToolDefinition, ApiError> {
    let at = format!("tools[{i}]");
    match tool.get("type").and_then(Value::as_str) {
        Some("function") => {}
        kind => {
            let param = format!("{at}.type");
            let got = kind.map_or_else(|| "no type".to_owned(), |k| format!("{k:?}"));
            return Err(ApiError::invalid(
                Some(&param),
                format!(
                    "{param} must be \"function\" (the only tool type /v1/responses serves); \
                     got {got}"
                ),
            ));
        }
    }
    // OpenAI allows `parameters: null`: a function without arguments.
    let no_parameters = json!({"type": "object", "properties": {}});
    let parameters = tool
        .get("parameters")
        .filter(|p| !p.is_null())
        .unwrap_or(&no_parameters);
    ToolDefinition::read(
        &at,
        ("name", tool.get("name")),
        ("description", tool.get("description")),
        ("parameters", Some(parameters)),
    )
    .map_err(refusal)
}

fn tool_choice(choice: Option<&Value>) -> Result<ToolChoice, ApiError> {
    let Some(choice) = choice else {
        return Ok(ToolChoice::Auto);
    };
    let function = (choice.get("type").and_then(Value::as_str) == Some("function"))
        .then(|| choice.get("name").and_then(Value::as_str))
        .flatten();
    match (choice.as_str(), function) {
        (Some("auto"), _) => Ok(ToolChoice::Auto),
        (Some("none"), _) => Ok(ToolChoice::None),
        (Some("required"), _) => Ok(ToolChoice::Any),
        (_, Some(name)) => Ok(ToolChoice::Tool(name.to_owned())),
        _ => Err(ApiError::invalid(
            Some("tool_choice"),
            format!(
                "tool_choice must be \"auto\", \"none\", \"required\" or \
                 {{\"type\": \"function\", \"name\": ...}}; got {choice}"
            ),
        )),
    }
}

fn refusal(e: DefinitionError) -> ApiError {
    ApiError::invalid(Some(&e.field), e.to_string())
}

/// Appends input item `index` to `messages` when it is a tool item, and says whether it was.
/// Consecutive `function_call` items join the assistant message before them (one turn whose
/// `tool_calls` lists them, as chat's template expects); a `function_call_output` is a `tool`
/// message answering `call_id`.
pub(super) fn push_tool_item(
    messages: &mut Vec<Value>,
    index: usize,
    item: &Value,
) -> Result<bool, ApiError> {
    let string = |field: &str| {
        item.get(field).and_then(Value::as_str).ok_or_else(|| {
            let param = format!("input[{index}].{field}");
            ApiError::invalid(Some(&param), format!("{param} must be a string"))
        })
    };
    match item.get("type").and_then(Value::as_str) {
        Some("function_call") => {
            let call = template_call(string("call_id")?, string("name")?, string("arguments")?);
            match messages.last_mut() {
                Some(last) if last["role"] == "assistant" => {
                    match last.get_mut("tool_calls").and_then(Value::as_array_mut) {
                        Some(calls) => calls.push(call),
                        None => last["tool_calls"] = json!([call]),
                    }
                }
                _ => {
                    messages.push(json!({"role": "assistant", "content": "", "tool_calls": [call]}))
                }
            }
            Ok(true)
        }
        Some("function_call_output") => {
            let call_id = string("call_id")?;
            let output = call_output(index, item.get("output"))?;
            messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// A call as the template takes it: OpenAI sends `arguments` as a JSON string, templates expect
/// an object, so a string holding a JSON object becomes that object (anything else stays as
/// written, as chat leaves it).
pub(super) fn template_call(call_id: &str, name: &str, arguments: &str) -> Value {
    let arguments = serde_json::from_str::<Value>(arguments)
        .ok()
        .filter(Value::is_object)
        .unwrap_or_else(|| arguments.into());
    json!({
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    })
}

/// `output`: a string, or `input_text` parts joined.
fn call_output(index: usize, output: Option<&Value>) -> Result<String, ApiError> {
    let param = format!("input[{index}].output");
    let refuse = || {
        ApiError::invalid(
            Some(&param),
            format!("{param} must be a string or a list of input_text parts"),
        )
    };
    match output {
        Some(Value::String(text)) => Ok(text.clone()),
        Some(Value::Array(parts)) => {
            parts.iter().try_fold(String::new(), |mut text, part| {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("input_text"), Some(Value::String(t))) => {
                        text.push_str(t);
                        Ok(text)
                    }
                    _ => Err(refuse()),
                }
            })
        }
        _ => Err(refuse()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "name": "get_weather", "description": "Weather.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
               "strict": true})
    }

    #[test]
    fn flat_function_tools_become_template_tools() {
        let tools = json!([weather()]);
        let read = read(Some(&tools), None).unwrap();
        let template = read.template.unwrap();
        assert_eq!(template[0]["type"], "function");
        assert_eq!(template[0]["function"]["name"], "get_weather");
        assert_eq!(template[0]["function"]["description"], "Weather.");
        assert_eq!(
            template[0]["function"]["parameters"]["properties"]["city"]["type"],
            "string"
        );
        assert_eq!(read.forced, None);
        assert_eq!(read.echo_tools, tools);
        assert_eq!(read.echo_choice, "auto");
    }

    #[test]
    fn tool_choice_has_chats_semantics() {
        let tools = json!([weather(), {"type": "function", "name": "noop", "parameters": null}]);
        let forced = |choice: Value| read(Some(&tools), Some(&choice)).unwrap().forced;
        assert_eq!(forced("required".into()), Some(ForcedCall::Any));
        assert_eq!(
            forced(json!({"type": "function", "name": "noop"})),
            Some(ForcedCall::Named("noop".into()))
        );
        assert_eq!(forced("auto".into()), None);
        let none = read(Some(&tools), Some(&"none".into())).unwrap();
        assert_eq!((none.template, none.forced), (None, None));
        assert_eq!(none.echo_choice, "none");
    }

    #[test]
    fn refusals_name_the_field() {
        let param = |tools: Value, choice: Option<Value>| {
            read(Some(&tools), choice.as_ref())
                .unwrap_err()
                .param
                .unwrap()
        };
        let search = json!([weather(), {"type": "web_search"}]);
        assert_eq!(param(search, None), "tools[1].type");
        assert_eq!(param(json!([{"type": "function"}]), None), "tools[0].name");
        let unknown = json!({"type": "function", "name": "nope"});
        assert_eq!(param(json!([weather()]), Some(unknown)), "tool_choice");
        assert_eq!(param(json!([]), Some("required".into())), "tool_choice");
        assert_eq!(
            param(json!([weather()]), Some("sometimes".into())),
            "tool_choice"
        );
        assert_eq!(param(json!([weather(), weather()]), None), "tools");
    }

    #[test]
    fn calls_join_the_assistant_turn_and_outputs_answer_them() {
        let mut messages = vec![json!({"role": "assistant", "content": "Checking."})];
        let items = [
            json!({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\":1}"}),
            json!({"type": "function_call", "call_id": "c2", "name": "g", "arguments": "oops"}),
            json!({"type": "function_call_output", "call_id": "c1", "output": "18"}),
            json!({"type": "function_call_output", "call_id": "c2",
                   "output": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}),
            json!({"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"}),
        ];
        for (i, item) in items.iter().enumerate() {
            assert!(push_tool_item(&mut messages, i, item).unwrap());
        }
        assert_eq!(messages.len(), 4, "{messages:?}");
        let calls = &messages[0]["tool_calls"];
        assert_eq!(messages[0]["content"], "Checking.");
        assert_eq!(calls[0]["function"]["arguments"], json!({"a": 1}));
        assert_eq!(calls[1]["function"]["arguments"], "oops");
        assert_eq!(calls[1]["id"], "c2");
        assert_eq!(
            messages[1],
            json!({"role": "tool", "tool_call_id": "c1", "content": "18"})
        );
        assert_eq!(messages[2]["content"], "ab");
        assert_eq!(messages[3]["role"], "assistant");
        assert_eq!(messages[3]["tool_calls"][0]["id"], "c3");
        assert!(!push_tool_item(&mut messages, 9, &json!({"role": "user"})).unwrap());
    }

    #[test]
    fn bad_tool_items_are_refused_by_position() {
        let mut messages = Vec::new();
        let e = push_tool_item(
            &mut messages,
            2,
            &json!({"type": "function_call", "name": "f"}),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[2].call_id"));
        let bad_output = json!({"type": "function_call_output", "call_id": "c", "output": 3});
        let e = push_tool_item(&mut messages, 0, &bad_output).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].output"));
    }
}
