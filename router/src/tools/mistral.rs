//! Mistral's tool calls: `[TOOL_CALLS]` then either a JSON list of
//! `{"name": ..., "arguments": {...}}` objects (older templates) or `name[ARGS]{...}` (newer
//! ones; one marker per call, optionally `name[CALL_ID]id[ARGS]{...}`). Text before the marker
//! streams; a call is released once its JSON closes.

use super::calls::{LeadingJson, Scan, ToolCall, call_from_value, leading_json, text_before};

/// How Mistral's templates render the tools: the prompt that holds it teaches this format.
pub(super) const AVAILABLE_TOOLS: &str = "[AVAILABLE_TOOLS]";
const TOOL_CALLS: &str = "[TOOL_CALLS]";
const ARGS: &str = "[ARGS]";
const CALL_ID: &str = "[CALL_ID]";

/// What the held text starts with (see [`Scan`]). Whatever follows a marker that cannot become a
/// call is released as text, the marker first.
pub(super) fn scan(held: &str) -> Scan {
    if let Some(text) = text_before(held, TOOL_CALLS) {
        return text;
    }
    let after = &held[TOOL_CALLS.len()..];
    let body = after.trim_start();
    let start = held.len() - body.len();
    let not_a_call = Scan::NotACall(TOOL_CALLS.len());
    if body.is_empty() {
        return Scan::Incomplete;
    }
    if body.starts_with('[') {
        return match leading_json(body) {
            LeadingJson::Incomplete => Scan::Incomplete,
            LeadingJson::Invalid => not_a_call,
            LeadingJson::Complete(list, len) => match calls_from_list(list) {
                Some(calls) => Scan::Calls(calls, start + len),
                None => not_a_call,
            },
        };
    }
    let Some(header_len) = body.find(ARGS) else {
        return if header_may_continue(body) {
            Scan::Incomplete
        } else {
            not_a_call
        };
    };
    let Some(name) = name_in_header(&body[..header_len]) else {
        return not_a_call;
    };
    let arguments_at = header_len + ARGS.len();
    match leading_json(&body[arguments_at..]) {
        LeadingJson::Incomplete => Scan::Incomplete,
        LeadingJson::Complete(arguments @ serde_json::Value::Object(_), len) => Scan::Calls(
            vec![ToolCall {
                name: name.to_string(),
                arguments: arguments.to_string(),
            }],
            start + arguments_at + len,
        ),
        _ => not_a_call,
    }
}

/// The older form's list: every element a call, at least one.
fn calls_from_list(list: serde_json::Value) -> Option<Vec<ToolCall>> {
    let serde_json::Value::Array(items) = list else {
        return None;
    };
    let calls: Option<Vec<ToolCall>> = items
        .into_iter()
        .map(|item| call_from_value(item, &["arguments", "parameters"]))
        .collect();
    calls.filter(|c| !c.is_empty())
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')
}

/// The function name in a complete `name` or `name[CALL_ID]id` header.
fn name_in_header(header: &str) -> Option<&str> {
    let (name, id) = match header.split_once(CALL_ID) {
        Some((name, id)) => (name, Some(id)),
        None => (header, None),
    };
    let valid = !name.is_empty()
        && name.chars().all(is_name_char)
        && id.is_none_or(|id| id.chars().all(|c| c.is_ascii_alphanumeric()));
    valid.then_some(name)
}

/// Whether `body` (no `[ARGS]` yet) can still grow into `name[CALL_ID]id[ARGS]`.
fn header_may_continue(body: &str) -> bool {
    let rest = body.trim_start_matches(is_name_char);
    if rest.is_empty() || ARGS.starts_with(rest) || CALL_ID.starts_with(rest) {
        return true;
    }
    match rest.strip_prefix(CALL_ID) {
        Some(id) => {
            let tail = id.trim_start_matches(|c: char| c.is_ascii_alphanumeric());
            ARGS.starts_with(tail)
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::super::calls::{Parsed, ToolFormat, assert_streaming_matches_whole, call, parse};
    use super::*;

    fn mistral(text: &str, cut: bool) -> Parsed {
        parse(ToolFormat::Mistral, text, cut)
    }

    #[test]
    fn the_older_list_form_reads_one_or_several_calls() {
        let p = mistral(
            r#"[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]"#,
            false,
        );
        assert_eq!(p.content, "");
        assert_eq!(p.calls, vec![call("get_weather", r#"{"city":"Paris"}"#)]);
        let p = mistral(
            r#"Let me look. [TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}, "id": "abc123def"}]"#,
            false,
        );
        assert_eq!(p.content, "Let me look. ");
        assert_eq!(p.calls, vec![call("a", "{}"), call("b", r#"{"x":1}"#)]);
    }

    #[test]
    fn the_newer_args_form_reads_one_call_per_marker() {
        let p = mistral(r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}"#, false);
        assert_eq!(p.calls, vec![call("get_weather", r#"{"city":"Paris"}"#)]);
        let p = mistral(
            r#"Sure.[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[CALL_ID]x1Y2z3[ARGS]{"q": [1, 2]}"#,
            false,
        );
        assert_eq!(p.content, "Sure.");
        assert_eq!(p.calls, vec![call("a", "{}"), call("b", r#"{"q":[1,2]}"#)]);
    }

    #[test]
    fn malformed_calls_stay_text() {
        for text in [
            r#"[TOOL_CALLS][{"name": "a", "arguments": {}}, ]"#,
            r#"[TOOL_CALLS][{"arguments": {}}]"#,
            r#"[TOOL_CALLS][]"#,
            r#"[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}"#,
            r#"[TOOL_CALLS]f[ARGS]["not", "an object"]"#,
            r#"[TOOL_CALLS]f[ARGS]{"a": oops}"#,
        ] {
            let p = mistral(text, false);
            assert_eq!(p.content, text);
            assert!(p.calls.is_empty(), "{text}");
        }
    }

    #[test]
    fn a_cut_call_is_dropped_and_a_finished_one_kept() {
        let done = r#"Sure.[TOOL_CALLS]f[ARGS]{"a": 1}"#;
        for cut_at in [
            done.len() - 1,
            "Sure.[TOOL_CALLS]f[AR".len(),
            "Sure.[TOOL".len(),
        ] {
            let p = mistral(&done[..cut_at], true);
            assert_eq!(p.content, "Sure.", "cut at {cut_at}");
            assert!(p.calls.is_empty());
            // The canary: as a whole output, the same text is returned as written.
            assert_eq!(mistral(&done[..cut_at], false).content, &done[..cut_at]);
        }
        let p = mistral(&format!("{done}[TOOL_CALLS]g[ARGS]{{\"b\""), true);
        assert_eq!(p.calls, vec![call("f", r#"{"a":1}"#)]);
        assert_eq!(p.content, "Sure.");
        let p = mistral(r#"[TOOL_CALLS][{"name": "f", "arguments": {"a""#, true);
        assert_eq!(p, Parsed::default());
    }

    #[test]
    fn streaming_in_small_chunks_matches_whole_parsing() {
        for text in [
            r#"Let me look. [TOOL_CALLS][{"name": "a", "arguments": {"é": "[ARGS]"}}] then"#,
            r#"[TOOL_CALLS]a[ARGS]{"x": "}"}[TOOL_CALLS]b[CALL_ID]q9[ARGS]{} done [TOOL"#,
            r#"[TOOL_CALLS]bad name[ARGS]{}"#,
            r#"[TOOL_CALLS]f[ARGS]{"a": oops} [TOOL_CALLS]g[ARGS]{}"#,
            "plain [text] with [TOOL no call",
        ] {
            assert_streaming_matches_whole(ToolFormat::Mistral, text);
        }
    }

    #[test]
    fn detection_takes_the_available_tools_marker() {
        let prompt =
            "<s>[AVAILABLE_TOOLS][{\"type\": \"function\"}][/AVAILABLE_TOOLS][INST]hi[/INST]";
        assert_eq!(ToolFormat::detect(prompt), ToolFormat::Mistral);
        // The canary: without the marker the same prompt falls back to Hermes.
        let other = prompt.replace(AVAILABLE_TOOLS, "[TOOLS]");
        assert_eq!(ToolFormat::detect(&other), ToolFormat::Hermes);
    }
}
