//! Forcing a tool call: `tool_choice` `required` (OpenAI) / `any` (Anthropic, Converse) or a
//! named tool becomes a grammar the output must follow — the family's call syntax around a JSON
//! object whose `name` is one of the allowed tools and whose arguments follow that tool's
//! parameter schema. The engine enforces it token by token (llguidance), so the call the parser
//! reads back is always well formed.

use serde_json::{Value, json};
use strata_protocol::Constraint;

use super::ToolFormat;

/// Which calls the output must consist of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForcedCall {
    /// One or more calls (one, in Llama's format) of any of the tools.
    Any,
    /// Exactly one call of this tool.
    Named(String),
}

/// The grammar for `forced` calls of `tools` (template-shaped function tools:
/// `{"type": "function", "function": {"name", "parameters"}}`) written in `format`.
pub fn forced_call(format: ToolFormat, tools: &[Value], forced: &ForcedCall) -> Constraint {
    let arguments_key = match format {
        ToolFormat::Hermes => "arguments",
        ToolFormat::LlamaJson => "parameters",
    };
    let variants: Vec<Value> = tools
        .iter()
        .filter_map(|tool| {
            let function = tool.get("function")?;
            let name = function.get("name")?.as_str()?;
            if let ForcedCall::Named(wanted) = forced
                && wanted != name
            {
                return None;
            }
            let parameters = function
                .get("parameters")
                .filter(|p| p.is_object())
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            Some(json!({
                "type": "object",
                "properties": {"name": {"const": name}, arguments_key: parameters},
                "required": ["name", arguments_key],
                "additionalProperties": false,
            }))
        })
        .collect();
    let schema = json!({
        "anyOf": variants,
        "x-guidance": {"whitespace_flexible": false},
    });
    let lark = match (format, forced) {
        (ToolFormat::Hermes, ForcedCall::Any) => {
            format!(
                "start: call (\"\\n\" call)*\ncall: \"<tool_call>\\n\" %json {schema} \"\\n</tool_call>\"\n"
            )
        }
        (ToolFormat::Hermes, ForcedCall::Named(_)) => {
            format!("start: \"<tool_call>\\n\" %json {schema} \"\\n</tool_call>\"\n")
        }
        (ToolFormat::LlamaJson, _) => format!("start: %json {schema}\n"),
    };
    Constraint::Lark(lark)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}}),
            json!({"type": "function", "function": {"name": "get_time"}}),
        ]
    }

    #[test]
    fn a_named_call_admits_only_that_tool() {
        let Constraint::Lark(lark) = forced_call(
            ToolFormat::Hermes,
            &tools(),
            &ForcedCall::Named("get_time".into()),
        ) else {
            panic!("a Lark grammar");
        };
        assert!(
            lark.contains("get_time") && !lark.contains("get_weather"),
            "{lark}"
        );
        assert!(lark.starts_with("start: \"<tool_call>\\n\""), "{lark}");
    }

    #[test]
    fn llama_calls_use_parameters() {
        let Constraint::Lark(lark) = forced_call(ToolFormat::LlamaJson, &tools(), &ForcedCall::Any)
        else {
            panic!("a Lark grammar");
        };
        assert!(lark.contains("\"parameters\"") && !lark.contains("\"arguments\""));
        assert!(lark.contains("get_time") && lark.contains("get_weather"));
    }
}
