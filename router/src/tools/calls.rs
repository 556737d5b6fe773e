//! Tool calls in generated text: the family's format (Hermes `<tool_call>` blocks or Llama 3.1's
//! bare JSON object) → plain content plus calls, whole or incrementally while streaming.
//! A block whose JSON is malformed (or lacks a string `name`) stays plain text: the client sees
//! what the model wrote rather than a call the server invented.

use serde_json::{Map, Value};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// How the served model writes a tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// Qwen / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or several.
    Hermes,
    /// Llama 3.1: the whole output is `{"name": ..., "parameters": {...}}`.
    LlamaJson,
}

impl ToolFormat {
    /// The format a rendered prompt (with tools) teaches: `<tool_call>` → Hermes; `ipython` or
    /// Llama's "respond with a JSON for a function call" → Llama JSON; otherwise Hermes.
    pub fn detect(rendered_prompt: &str) -> Self {
        if rendered_prompt.contains(OPEN) {
            ToolFormat::Hermes
        } else if rendered_prompt.contains("ipython")
            || rendered_prompt.contains("JSON for a function call")
        {
            ToolFormat::LlamaJson
        } else {
            ToolFormat::Hermes
        }
    }
}

/// One parsed call; `arguments` is a JSON string, as OpenAI sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// A whole output split into content (text outside calls) and calls, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

/// Splits a whole output.
/// The calls and the text of a whole output; `cut` when the token limit ended it (a call it cut
/// off is dropped, never returned as text).
pub fn parse(format: ToolFormat, text: &str, cut: bool) -> Parsed {
    let mut splitter = ToolCallSplitter::new(format);
    let mut parsed = Parsed::default();
    for piece in splitter.push(text).into_iter().chain(splitter.finish(cut)) {
        match piece {
            Piece::Text(t) => parsed.content.push_str(&t),
            Piece::Call(c) => parsed.calls.push(c),
        }
    }
    parsed
}

/// What the splitter releases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
}

/// Incremental splitter: text that could still become a call is held back; everything else is
/// released as soon as it arrives.
#[derive(Debug)]
pub struct ToolCallSplitter {
    format: ToolFormat,
    held: String,
    /// Llama JSON: whether the output has begun with `{` (then all of it is held to the end).
    json_output: Option<bool>,
}

impl ToolCallSplitter {
    pub fn new(format: ToolFormat) -> Self {
        Self {
            format,
            held: String::new(),
            json_output: None,
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        match self.format {
            ToolFormat::Hermes => self.drain_hermes(false, false),
            ToolFormat::LlamaJson => self.drain_llama(false, false),
        }
    }

    /// Releases everything still held: an unfinished call is plain text.
    /// Releases what is held at the end of the output. `cut`: the token limit ended it, so a call
    /// still open (or the start of its marker) was cut off: it is dropped, neither a call nor
    /// text (its markup must not leak into the answer).
    pub fn finish(&mut self, cut: bool) -> Vec<Piece> {
        match self.format {
            ToolFormat::Hermes => self.drain_hermes(true, cut),
            ToolFormat::LlamaJson => self.drain_llama(true, cut),
        }
    }

    fn drain_hermes(&mut self, end: bool, cut: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        loop {
            let Some(start) = self.held.find(OPEN) else {
                // Keep the longest suffix that is a prefix of `<tool_call>`.
                let keep = if end && !cut {
                    0
                } else {
                    partial_prefix(&self.held, OPEN)
                };
                let release = self.held.len() - keep;
                push_text(&mut out, self.held[..release].to_string());
                self.held.drain(..release);
                if end {
                    // Cut inside the opening marker: dropped.
                    self.held.clear();
                }
                return out;
            };
            push_text(&mut out, self.held[..start].to_string());
            self.held.drain(..start);
            let Some(close) = self.held.find(CLOSE) else {
                if end {
                    let open = std::mem::take(&mut self.held);
                    if !cut {
                        push_text(&mut out, open);
                    }
                }
                return out;
            };
            let block_end = close + CLOSE.len();
            let body = &self.held[OPEN.len()..close];
            match call_from_json(body, &["arguments", "parameters"]) {
                Some(call) => out.push(Piece::Call(call)),
                None => push_text(&mut out, self.held[..block_end].to_string()),
            }
            self.held.drain(..block_end);
        }
    }

    fn drain_llama(&mut self, end: bool, cut: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        if self.json_output.is_none() {
            match self.held.trim_start().chars().next() {
                Some(c) => self.json_output = Some(c == '{'),
                None if !end => return out,
                None => {}
            }
        }
        if self.json_output == Some(true) && !end {
            return out;
        }
        let text = std::mem::take(&mut self.held);
        match call_from_json(&text, &["parameters", "arguments"]) {
            Some(call) if self.json_output == Some(true) => out.push(Piece::Call(call)),
            // A call the limit cut off before its JSON closed.
            _ if cut && self.json_output == Some(true) => {}
            _ => push_text(&mut out, text),
        }
        out
    }
}

fn push_text(out: &mut Vec<Piece>, text: String) {
    if text.is_empty() {
        return;
    }
    if let Some(Piece::Text(last)) = out.last_mut() {
        last.push_str(&text);
    } else {
        out.push(Piece::Text(text));
    }
}

/// Length of the longest proper suffix of `text` that starts `marker`.
fn partial_prefix(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&n| {
            text.len() >= n && text.is_char_boundary(text.len() - n) && text.ends_with(&marker[..n])
        })
        .unwrap_or(0)
}

/// `{"name": "...", "<args key>": {...}}` → a call; anything else → `None`.
fn call_from_json(body: &str, argument_keys: &[&str]) -> Option<ToolCall> {
    let Value::Object(object) = serde_json::from_str::<Value>(body.trim()).ok()? else {
        return None;
    };
    let name = object.get("name")?.as_str()?.to_string();
    let arguments = argument_keys
        .iter()
        .find_map(|k| object.get(*k))
        .cloned()
        .unwrap_or_else(|| Value::Object(Map::new()));
    let arguments = match arguments {
        // Some models write the arguments already as a JSON string.
        Value::String(s) if serde_json::from_str::<Value>(&s).is_ok() => s,
        Value::Object(_) => arguments.to_string(),
        _ => return None,
    };
    Some(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn hermes_single_call() {
        let p = parse(
            ToolFormat::Hermes,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            false,
        );
        assert_eq!(p.content, "");
        assert_eq!(p.calls, vec![call("get_weather", r#"{"city":"Paris"}"#)]);
    }

    #[test]
    fn hermes_several_calls_with_leading_text() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n\
                    <tool_call>\n{\"name\": \"b\", \"arguments\": {\"x\": 1}}\n</tool_call>";
        let p = parse(ToolFormat::Hermes, text, false);
        assert_eq!(p.content, "Let me check.\n\n");
        assert_eq!(p.calls, vec![call("a", "{}"), call("b", r#"{"x":1}"#)]);
    }

    #[test]
    fn hermes_malformed_json_stays_text() {
        let text = "x<tool_call>{\"name\": \"a\", \"arguments\": {</tool_call>";
        let p = parse(ToolFormat::Hermes, text, false);
        assert_eq!(p.content, text);
        assert!(p.calls.is_empty());
    }

    #[test]
    fn hermes_unclosed_call_stays_text() {
        let text = "<tool_call>{\"name\": \"a\"";
        assert_eq!(parse(ToolFormat::Hermes, text, false).content, text);
    }

    #[test]
    fn llama_json_whole_output() {
        let p = parse(
            ToolFormat::LlamaJson,
            " {\"name\": \"f\", \"parameters\": {\"q\": \"rust\"}}",
            false,
        );
        assert_eq!(p.content, "");
        assert_eq!(p.calls, vec![call("f", r#"{"q":"rust"}"#)]);
        let p = parse(
            ToolFormat::LlamaJson,
            "{\"name\": \"f\", \"arguments\": {}}",
            false,
        );
        assert_eq!(p.calls, vec![call("f", "{}")]);
        let p = parse(
            ToolFormat::LlamaJson,
            "The answer is {\"name\": \"f\"}",
            false,
        );
        assert!(p.calls.is_empty());
    }

    #[test]
    fn format_is_detected_from_the_rendered_prompt() {
        assert_eq!(
            ToolFormat::detect("answer with <tool_call>"),
            ToolFormat::Hermes
        );
        assert_eq!(
            ToolFormat::detect("Environment: ipython\n"),
            ToolFormat::LlamaJson
        );
    }

    #[test]
    fn a_call_cut_off_by_the_limit_is_dropped_not_returned_as_text() {
        let done = "Sure.<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>";
        for cut_at in [
            done.len() - 3,
            "Sure.<tool_call>{\"na".len(),
            "Sure.<tool_".len(),
        ] {
            let p = parse(ToolFormat::Hermes, &done[..cut_at], true);
            assert_eq!(
                p,
                Parsed {
                    content: "Sure.".into(),
                    calls: vec![]
                },
                "cut at {cut_at}"
            );
            // The canary: read as a whole output, the same text leaks the markup.
            let whole = parse(ToolFormat::Hermes, &done[..cut_at], false);
            assert!(whole.content.len() > "Sure.".len(), "{whole:?}");
        }
        // A call completed before the cut stays a call.
        let two = format!("{done}\n<tool_call>{{\"name\"");
        let p = parse(ToolFormat::Hermes, &two, true);
        assert_eq!(p.calls.len(), 1);
        assert_eq!(p.content.trim(), "Sure.");
        let p = parse(
            ToolFormat::LlamaJson,
            "{\"name\": \"f\", \"parameters\": {\"a\"",
            true,
        );
        assert_eq!(p, Parsed::default());
        let free = parse(ToolFormat::LlamaJson, "Plain words cut of", true);
        assert_eq!(
            free.content, "Plain words cut of",
            "text that is no call stays text"
        );
    }

    #[test]
    fn streaming_one_char_at_a_time_matches_whole_parse() {
        let texts = [
            "Let me check. <tool_call>\n{\"name\": \"a\", \"arguments\": {\"é\": 1}}\n</tool_call> done <tool_c",
            "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{bad}</tool_call>",
            "plain < text <tool with no call",
        ];
        for format in [ToolFormat::Hermes, ToolFormat::LlamaJson] {
            for text in texts
                .iter()
                .copied()
                .chain(["{\"name\": \"f\", \"parameters\": {}}"])
            {
                let mut splitter = ToolCallSplitter::new(format);
                let mut streamed = Parsed::default();
                let mut buf = [0u8; 4];
                let pieces = text
                    .chars()
                    .flat_map(|c| splitter.push(c.encode_utf8(&mut buf)))
                    .collect::<Vec<_>>();
                for piece in pieces.into_iter().chain(splitter.finish(false)) {
                    match piece {
                        Piece::Text(t) => streamed.content.push_str(&t),
                        Piece::Call(c) => streamed.calls.push(c),
                    }
                }
                assert_eq!(streamed, parse(format, text, false), "{format:?}: {text}");
            }
        }
    }

    #[test]
    fn plain_text_is_released_while_a_marker_prefix_is_held() {
        let mut s = ToolCallSplitter::new(ToolFormat::Hermes);
        assert_eq!(s.push("hi <tool"), vec![Piece::Text("hi ".into())]);
        assert_eq!(s.push("box"), vec![Piece::Text("<toolbox".into())]);
    }
}
