//! Qwen3-Coder's tool calls: `<tool_call>` blocks (found like Hermes ones) whose body is XML,
//! `<function=NAME>` then `<parameter=ARG>VALUE</parameter>` per argument then `</function>`.
//! A Hermes JSON body is read too: the grammar that forces a call writes that form (see
//! [`super::constraint`]). Values are text; the type each tool declares for a parameter says
//! what the text is ([`ParamTypes`]), as vLLM's Qwen3-Coder parser reads them.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{Map, Value};

use super::calls::{ToolCall, call_from_json};

/// The template teaches the form with these two tags.
pub(super) const FUNCTION: &str = "<function=";
pub(super) const PARAMETER: &str = "<parameter=";
const FUNCTION_END: &str = "</function>";
const PARAMETER_END: &str = "</parameter>";

/// The JSON Schema type each rendered tool declares for each of its parameters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParamTypes(Arc<BTreeMap<String, BTreeMap<String, String>>>);

impl ParamTypes {
    /// From template-shaped tools (`{"type": "function", "function": {"name", "parameters"}}`,
    /// or a function object itself): each property's `type`, the first that is not `"null"` of
    /// a list; a property without one is left to its value.
    pub fn of(tools: &[Value]) -> Self {
        let mut all = BTreeMap::new();
        for tool in tools {
            let function = tool.get("function").unwrap_or(tool);
            let Some(name) = function.get("name").and_then(Value::as_str) else {
                continue;
            };
            let properties = function
                .get("parameters")
                .and_then(|schema| schema.get("properties"))
                .and_then(Value::as_object);
            let types = properties
                .into_iter()
                .flatten()
                .filter_map(|(param, schema)| Some((param.clone(), declared_type(schema)?)))
                .collect();
            all.insert(name.to_string(), types);
        }
        Self(Arc::new(all))
    }

    fn of_param(&self, tool: &str, param: &str) -> Option<&str> {
        self.0.get(tool)?.get(param).map(String::as_str)
    }
}

fn declared_type(schema: &Value) -> Option<String> {
    match schema.get("type")? {
        Value::String(t) => Some(t.clone()),
        Value::Array(types) => types
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .map(str::to_string),
        _ => None,
    }
}

/// A `<tool_call>` block's body as a call: XML (its values typed by `types`), or Hermes JSON.
pub(super) fn call_from_body(body: &str, types: &ParamTypes) -> Option<ToolCall> {
    let body = body.trim();
    if body.starts_with('{') {
        return call_from_json(body, &["arguments", "parameters"]);
    }
    let (name, mut rest) = body.strip_prefix(FUNCTION)?.split_once('>')?;
    let name = name.trim();
    if name.is_empty() || name.contains(['<', '\n']) {
        return None;
    }
    let mut arguments = Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix(FUNCTION_END) {
            return after.trim().is_empty().then(|| ToolCall {
                name: name.to_string(),
                arguments: Value::Object(arguments).to_string(),
            });
        }
        let (parameter, after) = rest.strip_prefix(PARAMETER)?.split_once('>')?;
        let (value, after) = after.split_once(PARAMETER_END)?;
        let parameter = parameter.trim();
        if parameter.is_empty() || parameter.contains(['<', '\n']) {
            return None;
        }
        // The template puts the value on lines of its own.
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let declared = types.of_param(name, parameter);
        arguments.insert(parameter.to_string(), typed_value(value, declared));
        rest = after;
    }
}

/// A parameter's value from its text and the type its tool declares: a `string` parameter is
/// the text as written (`42` stays `"42"`); `integer`, `number`, `boolean`, `object`, `array` and
/// `null` take the text as JSON when it reads as that type, and the text as written otherwise
/// (the client's validation then names the mismatch; nothing is invented). Without a declared
/// type the value says: one that reads as a JSON number, boolean, object or array is that,
/// anything else (`null` and quoted strings included) is the string written.
fn typed_value(value: &str, declared: Option<&str>) -> Value {
    let text = || Value::String(value.to_string());
    let parsed = serde_json::from_str::<Value>(value.trim()).ok();
    match (declared, parsed) {
        (Some("string"), _) => text(),
        (Some(kind), Some(v)) if declared_kind_matches(kind, &v) => v,
        (Some(_), _) => text(),
        (
            None,
            Some(v @ (Value::Number(_) | Value::Bool(_) | Value::Object(_) | Value::Array(_))),
        ) => v,
        (None, _) => text(),
    }
}

fn declared_kind_matches(kind: &str, value: &Value) -> bool {
    match kind {
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        "boolean" => value.is_boolean(),
        "object" => value.is_object(),
        "array" => value.is_array(),
        "null" => value.is_null(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::super::calls::{Parsed, ToolFormat, assert_streaming_matches_whole, call, parse};
    use super::*;

    fn qwen(text: &str, cut: bool) -> Parsed {
        parse(ToolFormat::QwenXml(ParamTypes::default()), text, cut)
    }

    const WEATHER: &str = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, France\n\
                           </parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";

    #[test]
    fn a_whole_call_reads_with_typed_values() {
        let p = qwen(WEATHER, false);
        assert_eq!(p.content, "");
        assert_eq!(
            p.calls,
            vec![call("get_weather", r#"{"city":"Paris, France","days":3}"#)]
        );
        let text = "<tool_call>\n<function=f>\n<parameter=opts>\n{\"deep\": [1, true]}\n</parameter>\n\
                    <parameter=flag>\nfalse\n</parameter>\n<parameter=none>\nnull\n</parameter>\n\
                    <parameter=code>\nfn main() {\n    x < y\n}\n</parameter>\n</function>\n</tool_call>";
        let p = qwen(text, false);
        let arguments: Value = serde_json::from_str(&p.calls[0].arguments).unwrap();
        assert_eq!(
            arguments,
            serde_json::json!({"opts": {"deep": [1, true]}, "flag": false, "none": "null",
                               "code": "fn main() {\n    x < y\n}"})
        );
        let p = qwen(
            "<tool_call>\n<function=now>\n</function>\n</tool_call>",
            false,
        );
        assert_eq!(p.calls, vec![call("now", "{}")]);
    }

    #[test]
    fn values_take_the_types_the_tools_declare() {
        let tools = [serde_json::json!({"type": "function", "function": {
            "name": "ship",
            "parameters": {"type": "object", "properties": {
                "zip": {"type": "string"},
                "count": {"type": "integer"},
                "weight": {"type": ["number", "null"]},
                "express": {"type": "boolean"},
                "items": {"type": "array"},
                "note": {"description": "no type declared"},
            }},
        }})];
        let format = ToolFormat::detect("<function=f><parameter=p>").typed_by(&tools);
        let text = "<tool_call>\n<function=ship>\n<parameter=zip>\n02139\n</parameter>\n\
                    <parameter=count>\n3\n</parameter>\n<parameter=weight>\n2.5\n</parameter>\n\
                    <parameter=express>\ntrue\n</parameter>\n<parameter=items>\n[\"a\"]\n</parameter>\n\
                    <parameter=note>\n42\n</parameter>\n</function>\n</tool_call>";
        let p = parse(format.clone(), text, false);
        let arguments: Value = serde_json::from_str(&p.calls[0].arguments).unwrap();
        assert_eq!(
            arguments,
            serde_json::json!({"zip": "02139", "count": 3, "weight": 2.5, "express": true,
                               "items": ["a"], "note": 42})
        );
        // A string parameter that reads as a number stays the string written; a value that is
        // not its declared type is the text written, not a guess.
        let text = "<tool_call>\n<function=ship>\n<parameter=zip>\n42\n</parameter>\n\
                    <parameter=count>\nthree\n</parameter>\n<parameter=express>\n1\n</parameter>\n\
                    </function>\n</tool_call>";
        let p = parse(format.clone(), text, false);
        let arguments: Value = serde_json::from_str(&p.calls[0].arguments).unwrap();
        assert_eq!(
            arguments,
            serde_json::json!({"zip": "42", "count": "three", "express": "1"})
        );
        // The canary: without the declared types, `42` for the string parameter is a number.
        let p = qwen(text, false);
        let untyped: Value = serde_json::from_str(&p.calls[0].arguments).unwrap();
        assert_eq!(untyped["zip"], 42);
        // Formats that write JSON are typed as written: the tools change nothing.
        assert_eq!(ToolFormat::Hermes.typed_by(&tools), ToolFormat::Hermes);
    }

    #[test]
    fn several_calls_after_text_and_a_json_body() {
        let text = format!(
            "I'll check.\n{WEATHER}\n<tool_call>\n{{\"name\": \"get_time\", \"arguments\": {{}}}}\n</tool_call>"
        );
        let p = qwen(&text, false);
        assert_eq!(p.content, "I'll check.\n");
        assert_eq!(p.calls.len(), 2);
        assert_eq!(p.calls[1], call("get_time", "{}"));
    }

    #[test]
    fn malformed_calls_stay_text() {
        for text in [
            "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",
            "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
            "<tool_call>\n<function=>\n</function>\n</tool_call>",
            "<tool_call>\nget_weather(city=Paris)\n</tool_call>",
            "<tool_call>\n<function=f>\n</function>\ntrailing\n</tool_call>",
        ] {
            let p = qwen(text, false);
            assert_eq!(p.content, text);
            assert!(p.calls.is_empty(), "{text}");
        }
    }

    #[test]
    fn a_cut_call_is_dropped_and_a_finished_one_kept() {
        let done = format!("Sure.{WEATHER}");
        for cut_at in [done.len() - 2, "Sure.<tool_call>\n<function=get".len(), 7] {
            let p = qwen(&done[..cut_at], true);
            assert_eq!(
                p,
                Parsed {
                    content: "Sure.".into(),
                    calls: vec![]
                },
                "cut at {cut_at}"
            );
            // The canary: as a whole output, the same text is returned as written.
            assert_eq!(qwen(&done[..cut_at], false).content, &done[..cut_at]);
        }
        let p = qwen(&format!("{done}<tool_call>\n<function=g>"), true);
        assert_eq!(p.calls.len(), 1);
        assert_eq!(p.content, "Sure.");
    }

    #[test]
    fn streaming_in_small_chunks_matches_whole_parsing() {
        for text in [
            format!("Let me check é. {WEATHER} done <tool_c"),
            format!("{WEATHER}<tool_call><function=f>\n</parameter></tool_call>"),
            "plain < text <function=f> with no call".to_string(),
        ] {
            assert_streaming_matches_whole(ToolFormat::QwenXml(ParamTypes::default()), &text);
        }
    }

    #[test]
    fn detection_prefers_the_xml_form_over_hermes() {
        let prompt = "# Tools\n<tools>...</tools>\nTo call a function, reply:\n<tool_call>\n\
                      <function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n\
                      </parameter>\n</function>\n</tool_call>";
        assert_eq!(
            ToolFormat::detect(prompt),
            ToolFormat::QwenXml(ParamTypes::default())
        );
        // The canary: without the XML tags, the same prompt is Hermes.
        let hermes = prompt.replace(FUNCTION, "<f=").replace(PARAMETER, "<p=");
        assert_eq!(ToolFormat::detect(&hermes), ToolFormat::Hermes);
    }
}
