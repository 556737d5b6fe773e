//! Tool definitions and the tool choice of the block-based surfaces (Anthropic, Converse), in
//! the shape the chat template takes: OpenAI's function tools, `{"type": "function",
//! "function": {"name", "description", "parameters"}}`, which is what Hugging Face templates are
//! written against. Each surface finds the members in its own JSON; the checks and the refusal
//! wording are shared here, so a tool is valid on one surface exactly when it is on the other.

use std::collections::HashSet;

use serde_json::{Map, Value, json};

use super::constraint::ForcedCall;

/// A refusal naming the request field at fault (`tools.0.name: ...`); each surface dresses it
/// in its own error shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct DefinitionError {
    pub field: String,
    pub reason: String,
}

impl DefinitionError {
    fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// One request member: its name as the surface spells it, relative to the tool, and its value.
pub type Member<'a> = (&'a str, Option<&'a Value>);

/// One tool the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDefinition {
    pub name: String,
    pub description: Option<String>,
    /// A JSON Schema object: templates print it, so it must be an object, not a schema `true`.
    pub input_schema: Map<String, Value>,
}

/// Longest name accepted, Anthropic's limit.
const MAX_NAME_LEN: usize = 128;

impl ToolDefinition {
    /// Reads a tool found at `at` (`tools.0`). The name is 1 to 128 of `[A-Za-z0-9_-]`, as both
    /// providers require: templates write it into hand-built JSON, so a quote must not reach them.
    pub fn read(
        at: &str,
        name: Member<'_>,
        description: Member<'_>,
        input_schema: Member<'_>,
    ) -> Result<Self, DefinitionError> {
        let field = |member: &str| format!("{at}.{member}");
        let name = match name.1 {
            None | Some(Value::Null) => {
                return Err(DefinitionError::new(field(name.0), "Field required"));
            }
            Some(Value::String(n)) if valid_name(n) => n.clone(),
            Some(_) => {
                return Err(DefinitionError::new(
                    field(name.0),
                    format!("must be a string of 1 to {MAX_NAME_LEN} letters, digits, `_` or `-`"),
                ));
            }
        };
        let description = match description.1 {
            None | Some(Value::Null) => None,
            Some(Value::String(d)) => Some(d.clone()),
            Some(_) => {
                return Err(DefinitionError::new(
                    field(description.0),
                    "must be a string",
                ));
            }
        };
        let input_schema = match input_schema.1 {
            Some(Value::Object(schema)) => schema.clone(),
            None | Some(Value::Null) => {
                return Err(DefinitionError::new(
                    field(input_schema.0),
                    "Field required",
                ));
            }
            Some(_) => {
                return Err(DefinitionError::new(
                    field(input_schema.0),
                    "must be a JSON Schema object",
                ));
            }
        };
        Ok(Self {
            name,
            description,
            input_schema,
        })
    }

    /// The template's shape: an OpenAI function tool.
    fn to_template(&self) -> Value {
        let mut function = json!({"name": self.name, "parameters": self.input_schema});
        if let Some(description) = &self.description {
            function["description"] = description.clone().into();
        }
        json!({"type": "function", "function": function})
    }
}

fn valid_name(name: &str) -> bool {
    (1..=MAX_NAME_LEN).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Whether and which tool the model is asked to call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    /// Some tool must be called (Anthropic `any`, Converse `any`).
    Any,
    /// This tool must be called.
    Tool(String),
    /// No tool may be called: the tools are not rendered.
    None,
}

impl ToolChoice {
    /// The call this choice forces, if any (enforced while decoding, see [`super::constraint`]).
    pub fn forced(&self) -> Option<ForcedCall> {
        match self {
            ToolChoice::Any => Some(ForcedCall::Any),
            ToolChoice::Tool(name) => Some(ForcedCall::Named(name.clone())),
            ToolChoice::Auto | ToolChoice::None => None,
        }
    }
}

/// The tools to render (and so parse calls for), under `choice`; `None` when there is nothing
/// to render. `tools_field` and `choice_field` name the request's members in refusals.
///
/// `Any` and `Tool` render like `Auto` and then force the call while decoding
/// ([`ToolChoice::forced`]). They need tools, and a named tool must be one of them.
pub fn template_tools(
    tools: &[ToolDefinition],
    choice: &ToolChoice,
    tools_field: &str,
    choice_field: &str,
) -> Result<Option<Vec<Value>>, DefinitionError> {
    let mut seen = HashSet::new();
    if let Some(twice) = tools.iter().find(|t| !seen.insert(t.name.as_str())) {
        return Err(DefinitionError::new(
            tools_field,
            format!(
                "tool names must be unique; {:?} appears more than once",
                twice.name
            ),
        ));
    }
    match choice {
        ToolChoice::None => return Ok(None),
        ToolChoice::Auto => {}
        ToolChoice::Any | ToolChoice::Tool(_) if tools.is_empty() => {
            return Err(DefinitionError::new(
                choice_field,
                format!("asks for a tool call, but `{tools_field}` holds no tools"),
            ));
        }
        ToolChoice::Any => {}
        ToolChoice::Tool(name) => {
            if !tools.iter().any(|t| &t.name == name) {
                return Err(DefinitionError::new(
                    choice_field,
                    format!("names {name:?}, which is not in `{tools_field}`"),
                ));
            }
        }
    }
    Ok((!tools.is_empty()).then(|| tools.iter().map(ToolDefinition::to_template).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(tool: &Value) -> Result<ToolDefinition, DefinitionError> {
        ToolDefinition::read(
            "tools.1",
            ("name", tool.get("name")),
            ("description", tool.get("description")),
            ("input_schema", tool.get("input_schema")),
        )
    }

    fn tool(name: &str) -> ToolDefinition {
        read(&json!({"name": name, "input_schema": {"type": "object"}})).unwrap()
    }

    #[test]
    fn a_tool_renders_as_an_openai_function() {
        let t = read(&json!({
            "name": "get_weather", "description": "Weather.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }))
        .unwrap();
        let rendered = template_tools(&[t], &ToolChoice::Auto, "tools", "tool_choice").unwrap();
        assert_eq!(
            rendered,
            Some(vec![json!({"type": "function", "function": {
                "name": "get_weather", "description": "Weather.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            }})])
        );
    }

    #[test]
    fn bad_definitions_are_refused_by_member() {
        let cases = [
            (
                json!({"input_schema": {}}),
                "tools.1.name",
                "Field required",
            ),
            (
                json!({"name": "a b", "input_schema": {}}),
                "tools.1.name",
                "must be",
            ),
            (
                json!({"name": "", "input_schema": {}}),
                "tools.1.name",
                "must be",
            ),
            (
                json!({"name": "f"}),
                "tools.1.input_schema",
                "Field required",
            ),
            (
                json!({"name": "f", "input_schema": "object"}),
                "tools.1.input_schema",
                "object",
            ),
            (
                json!({"name": "f", "input_schema": {}, "description": 3}),
                "tools.1.description",
                "",
            ),
        ];
        for (tool, field, reason) in cases {
            let e = read(&tool).unwrap_err();
            assert_eq!(e.field, field, "{tool}");
            assert!(e.reason.contains(reason), "{tool}: {e}");
        }
    }

    #[test]
    fn the_choice_is_checked_against_the_tools() {
        let tools = [tool("a"), tool("b")];
        let render = |tools: &[ToolDefinition], choice: ToolChoice| {
            template_tools(tools, &choice, "tools", "tool_choice")
        };
        assert_eq!(render(&tools, ToolChoice::Auto).unwrap().unwrap().len(), 2);
        assert_eq!(render(&tools, ToolChoice::Any).unwrap().unwrap().len(), 2);
        assert!(
            render(&tools, ToolChoice::Tool("b".into()))
                .unwrap()
                .is_some()
        );
        assert_eq!(render(&tools, ToolChoice::None).unwrap(), None);
        assert_eq!(render(&[], ToolChoice::Auto).unwrap(), None);
        for (tools, choice) in [
            (&tools[..], ToolChoice::Tool("c".into())),
            (&[], ToolChoice::Any),
        ] {
            assert_eq!(render(tools, choice).unwrap_err().field, "tool_choice");
        }
        let e = render(&[tool("a"), tool("a")], ToolChoice::Auto).unwrap_err();
        assert_eq!(e.field, "tools");
        assert!(e.reason.contains("unique"), "{e}");
    }
}
