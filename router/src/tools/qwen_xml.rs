//! Qwen3-Coder's tool calls: `<tool_call>` blocks (found like Hermes ones) whose body is XML,
//! `<function=NAME>` then `<parameter=ARG>VALUE</parameter>` per argument then `</function>`.
//! A Hermes JSON body is read too: the grammar that forces a call writes that form (see
//! [`super::constraint`]).

use serde_json::{Map, Value};

use super::calls::{ToolCall, call_from_json};

/// The template teaches the form with these two tags.
pub(super) const FUNCTION: &str = "<function=";
pub(super) const PARAMETER: &str = "<parameter=";
const FUNCTION_END: &str = "</function>";
const PARAMETER_END: &str = "</parameter>";

/// A `<tool_call>` block's body as a call: XML, or Hermes JSON.
pub(super) fn call_from_body(body: &str) -> Option<ToolCall> {
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
        arguments.insert(parameter.to_string(), typed_value(value));
        rest = after;
    }
}

/// A parameter's value. The schema would say which parameters are strings, but the parser is
/// built from the format alone and does not see the tools; so the value says: one that reads as
/// a JSON number, boolean, object or array is that, anything else (`null` and quoted strings
/// included) is the string written. A string parameter whose value looks like a number (`42`)
/// therefore arrives as a number.
fn typed_value(value: &str) -> Value {
    match serde_json::from_str::<Value>(value.trim()) {
        Ok(v @ (Value::Number(_) | Value::Bool(_) | Value::Object(_) | Value::Array(_))) => v,
        _ => Value::String(value.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::super::calls::{Parsed, ToolFormat, assert_streaming_matches_whole, call, parse};
    use super::*;

    fn qwen(text: &str, cut: bool) -> Parsed {
        parse(ToolFormat::QwenXml, text, cut)
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
    fn several_calls_after_text_and_a_json_body() {
        let text = format!(
            "I'll check.\n{WEATHER}\n<tool_call>\n{{\"name\": \"get_time\", \"arguments\": {{}}}}\n</tool_call>"
        );
        let p = qwen(&text, false);
        assert_eq!(p.content, "I'll check.\n\n");
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
            assert_streaming_matches_whole(ToolFormat::QwenXml, &text);
        }
    }

    #[test]
    fn detection_prefers_the_xml_form_over_hermes() {
        let prompt = "# Tools\n<tools>...</tools>\nTo call a function, reply:\n<tool_call>\n\
                      <function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n\
                      </parameter>\n</function>\n</tool_call>";
        assert_eq!(ToolFormat::detect(prompt), ToolFormat::QwenXml);
        // The canary: without the XML tags, the same prompt is Hermes.
        let hermes = prompt.replace(FUNCTION, "<f=").replace(PARAMETER, "<p=");
        assert_eq!(ToolFormat::detect(&hermes), ToolFormat::Hermes);
    }
}
