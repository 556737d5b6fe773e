//! Tool calls in generated text: the family's format → plain content plus calls, whole or
//! incrementally while streaming. Formats are of two shapes: marked calls inside free text
//! (Hermes and Qwen3-Coder `<tool_call>` blocks, Mistral's `[TOOL_CALLS]`), where text around
//! the calls streams and each call is held only until it is complete; and whole-output calls
//! (Llama 3.1 JSON, pythonic lists), where an output that begins like a call is held to its end.
//! A call that is malformed stays plain text: the client sees what the model wrote rather than
//! a call the server invented. A call the token limit cut off is dropped, neither a call nor
//! text.

use serde_json::{Map, Value};

use super::qwen_xml::ParamTypes;
use super::{mistral, pythonic, qwen_xml};

pub(super) const OPEN: &str = "<tool_call>";
pub(super) const CLOSE: &str = "</tool_call>";

/// How the served model writes a tool call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolFormat {
    /// Qwen / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or several.
    Hermes,
    /// Llama 3.1: the whole output is `{"name": ..., "parameters": {...}}`.
    LlamaJson,
    /// Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (older templates) or
    /// `[TOOL_CALLS]name[ARGS]{...}`, once per call (newer ones).
    Mistral,
    /// Qwen3-Coder: `<tool_call><function=NAME><parameter=ARG>VALUE</parameter>...</function>
    /// </tool_call>`, one or several (a Hermes JSON body is read too). The values are text; the
    /// tools' declared parameter types say which are numbers, booleans, objects or arrays.
    QwenXml(ParamTypes),
    /// Llama 3.2 / 4: the whole output is `[f(a=1, b="x"), g()]`, Python literal arguments (a
    /// Llama 3.1 JSON output is read too).
    Pythonic,
}

impl ToolFormat {
    /// Whether the output must be decoded with the tokenizer's special tokens kept: Mistral's
    /// own tokenizers make `[TOOL_CALLS]` and `[ARGS]` control tokens, which a decoder skipping
    /// special tokens would drop before the parser sees them (vLLM keeps them for Mistral too).
    pub fn keeps_special_tokens(&self) -> bool {
        matches!(self, ToolFormat::Mistral)
    }

    /// The format a rendered prompt (with tools) teaches. Checked most specific first:
    /// `[AVAILABLE_TOOLS]` → Mistral; `<function=` with `<parameter=` → Qwen3-Coder XML (its
    /// template also names `<tool_call>`, so this precedes Hermes); `<tool_call>` → Hermes;
    /// the pythonic example `[func_name1(` → pythonic (Llama templates that teach it may also
    /// say `ipython`, so this precedes Llama JSON); `ipython` or Llama's "respond with a JSON
    /// for a function call" → Llama JSON; otherwise Hermes.
    pub fn detect(rendered_prompt: &str) -> Self {
        let has = |marker: &str| rendered_prompt.contains(marker);
        if has(mistral::AVAILABLE_TOOLS) {
            ToolFormat::Mistral
        } else if has(qwen_xml::FUNCTION) && has(qwen_xml::PARAMETER) {
            ToolFormat::QwenXml(ParamTypes::default())
        } else if has(OPEN) {
            ToolFormat::Hermes
        } else if has(pythonic::TEMPLATE_EXAMPLE) {
            ToolFormat::Pythonic
        } else if has("ipython") || has("JSON for a function call") {
            ToolFormat::LlamaJson
        } else {
            ToolFormat::Hermes
        }
    }

    /// This format reading the parameter types the rendered `tools` declare (Qwen3-Coder's
    /// values are text; the other formats write JSON or Python literals, typed as written).
    pub fn typed_by(self, tools: &[Value]) -> Self {
        match self {
            ToolFormat::QwenXml(_) => ToolFormat::QwenXml(ParamTypes::of(tools)),
            other => other,
        }
    }

    fn shape(&self) -> Shape<'_> {
        match self {
            ToolFormat::Hermes => Shape::Marked(Box::new(|held| scan_block(held, hermes_body))),
            ToolFormat::QwenXml(types) => Shape::Marked(Box::new(move |held| {
                scan_block(held, |body| qwen_xml::call_from_body(body, types))
            })),
            ToolFormat::Mistral => Shape::Marked(Box::new(mistral::scan)),
            ToolFormat::LlamaJson => Shape::WholeOutput("{", llama_json_output),
            ToolFormat::Pythonic => Shape::WholeOutput("[{", pythonic::calls_from_output),
        }
    }
}

/// How a format sits in the output (see the module comment).
enum Shape<'a> {
    /// Calls inside free text, found by this scanner.
    Marked(Box<dyn Fn(&str) -> Scan + 'a>),
    /// An output whose first non-blank character is one of these may be calls: it is read
    /// whole by this parser.
    WholeOutput(&'static str, fn(&str) -> Option<Vec<ToolCall>>),
}

/// What a marked format finds at the start of the held text.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Scan {
    /// This many bytes (at least one) are plain text: released now.
    Text(usize),
    /// Complete calls spanning this many bytes.
    Calls(Vec<ToolCall>, usize),
    /// A complete stretch of this many bytes (at least one) that was no valid call: released as
    /// text, as written.
    NotACall(usize),
    /// What is held could still become a call: more output decides.
    Incomplete,
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
    /// Whole-output formats: whether the output has begun like a call (then all of it is held
    /// to the end).
    call_output: Option<bool>,
    /// Marked formats: the last piece released was a call (whitespace after it is held: it is
    /// no content when another call or the end follows).
    after_call: bool,
}

impl ToolCallSplitter {
    pub fn new(format: ToolFormat) -> Self {
        Self {
            format,
            held: String::new(),
            call_output: None,
            after_call: false,
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        self.drain(false, false)
    }

    /// Releases what is held at the end of the output: an unfinished call is plain text — unless
    /// `cut`: the token limit ended the output, so a call still open (or the start of its
    /// marker) was cut off and is dropped, neither a call nor text (its markup must not leak
    /// into the answer).
    pub fn finish(&mut self, cut: bool) -> Vec<Piece> {
        self.drain(true, cut)
    }

    fn drain(&mut self, end: bool, cut: bool) -> Vec<Piece> {
        // The format is read while the held text changes (a Qwen3-Coder format shares its
        // parameter types, an `Arc`, with the copy).
        let format = self.format.clone();
        match format.shape() {
            Shape::Marked(scan) => self.drain_marked(&*scan, end, cut),
            Shape::WholeOutput(openers, parse) => self.drain_whole(openers, parse, end, cut),
        }
    }

    fn drain_marked(&mut self, scan: &dyn Fn(&str) -> Scan, end: bool, cut: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        while !self.held.is_empty() {
            let consumed = match scan(&self.held) {
                Scan::Text(n) if self.after_call && self.held[..n].trim().is_empty() => {
                    // Whitespace after a call: dropped before another call or at the end (a
                    // forced grammar lets a newline end the output), kept before text.
                    let next = (n < self.held.len()).then(|| scan(&self.held[n..]));
                    match next {
                        None if !end => break,
                        None | Some(Scan::Calls(..)) => n,
                        Some(Scan::Incomplete) if !end => break,
                        Some(_) => {
                            self.after_call = false;
                            push_text(&mut out, self.held[..n].to_string());
                            n
                        }
                    }
                }
                Scan::Text(n) | Scan::NotACall(n) if n > 0 => {
                    self.after_call = false;
                    push_text(&mut out, self.held[..n].to_string());
                    n
                }
                Scan::Calls(calls, n) if n > 0 => {
                    self.after_call = true;
                    out.extend(calls.into_iter().map(Piece::Call));
                    n
                }
                // An empty stretch would never progress: wait like an unfinished call.
                _ => {
                    if end {
                        let rest = std::mem::take(&mut self.held);
                        if !cut {
                            push_text(&mut out, rest);
                        }
                    }
                    break;
                }
            };
            self.held.drain(..consumed);
        }
        out
    }

    fn drain_whole(
        &mut self,
        openers: &str,
        parse: fn(&str) -> Option<Vec<ToolCall>>,
        end: bool,
        cut: bool,
    ) -> Vec<Piece> {
        let mut out = Vec::new();
        if self.call_output.is_none() {
            match self.held.trim_start().chars().next() {
                Some(c) => self.call_output = Some(openers.contains(c)),
                None if !end => return out,
                None => {}
            }
        }
        let call_output = self.call_output == Some(true);
        if call_output && !end {
            return out;
        }
        let text = std::mem::take(&mut self.held);
        match parse(&text) {
            Some(calls) if call_output && !calls.is_empty() => {
                out.extend(calls.into_iter().map(Piece::Call))
            }
            // A call the limit cut off before it closed.
            _ if cut && call_output => {}
            _ => push_text(&mut out, text),
        }
        out
    }
}

/// A `<tool_call>` … `</tool_call>` block whose body `body` reads, after any text before it.
fn scan_block(held: &str, body: impl Fn(&str) -> Option<ToolCall>) -> Scan {
    if let Some(text) = text_before(held, OPEN) {
        return text;
    }
    let inside = &held[OPEN.len()..];
    let Some(close) = inside.find(CLOSE) else {
        return Scan::Incomplete;
    };
    let len = OPEN.len() + close + CLOSE.len();
    match body(&inside[..close]) {
        Some(call) => Scan::Calls(vec![call], len),
        None => Scan::NotACall(len),
    }
}

/// The text before `marker` in `held`: `None` when `held` starts with it. A tail that could be
/// the marker's beginning is held back.
pub(super) fn text_before(held: &str, marker: &str) -> Option<Scan> {
    let text = match held.find(marker) {
        Some(0) => return None,
        Some(at) => at,
        None => held.len() - partial_prefix(held, marker),
    };
    Some(if text == 0 {
        Scan::Incomplete
    } else {
        Scan::Text(text)
    })
}

fn hermes_body(body: &str) -> Option<ToolCall> {
    call_from_json(body, &["arguments", "parameters"])
}

fn llama_json_output(text: &str) -> Option<Vec<ToolCall>> {
    call_from_json(text, &["parameters", "arguments"]).map(|call| vec![call])
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
pub(super) fn partial_prefix(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&n| {
            text.len() >= n && text.is_char_boundary(text.len() - n) && text.ends_with(&marker[..n])
        })
        .unwrap_or(0)
}

/// `{"name": "...", "<args key>": {...}}` → a call; anything else → `None`.
pub(super) fn call_from_json(body: &str, argument_keys: &[&str]) -> Option<ToolCall> {
    call_from_value(serde_json::from_str(body.trim()).ok()?, argument_keys)
}

/// [`call_from_json`] on a parsed value.
pub(super) fn call_from_value(value: Value, argument_keys: &[&str]) -> Option<ToolCall> {
    let Value::Object(object) = value else {
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

/// A JSON value at the start of a text that may still be growing.
#[derive(Debug)]
pub(super) enum LeadingJson {
    /// The value and the bytes it spans (leading whitespace included).
    Complete(Value, usize),
    /// The text ends inside the value.
    Incomplete,
    /// No JSON value, however the text goes on.
    Invalid,
}

/// The JSON value `text` begins with. Meant for objects and arrays, whose end is unambiguous
/// (a number at the very end could still grow).
pub(super) fn leading_json(text: &str) -> LeadingJson {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    match values.next() {
        Some(Ok(value)) => LeadingJson::Complete(value, values.byte_offset()),
        Some(Err(e)) if e.is_eof() => LeadingJson::Incomplete,
        None => LeadingJson::Incomplete,
        Some(Err(_)) => LeadingJson::Invalid,
    }
}

/// `text` pushed `chunk` characters at a time, then finished: what a stream would release.
#[cfg(test)]
pub(super) fn streamed(format: ToolFormat, text: &str, chunk: usize, cut: bool) -> Parsed {
    let mut splitter = ToolCallSplitter::new(format);
    let chars: Vec<char> = text.chars().collect();
    let mut pieces = Vec::new();
    for piece in chars.chunks(chunk.max(1)) {
        pieces.extend(splitter.push(&piece.iter().collect::<String>()));
    }
    let mut parsed = Parsed::default();
    for piece in pieces.into_iter().chain(splitter.finish(cut)) {
        match piece {
            Piece::Text(t) => parsed.content.push_str(&t),
            Piece::Call(c) => parsed.calls.push(c),
        }
    }
    parsed
}

/// A call as the parsers report it, for the formats' tests.
#[cfg(test)]
pub(super) fn call(name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        name: name.into(),
        arguments: arguments.into(),
    }
}

/// Asserts that `text` streamed in chunks of every size up to 7 characters reads as parsed
/// whole, with and without `cut`.
#[cfg(test)]
pub(super) fn assert_streaming_matches_whole(format: ToolFormat, text: &str) {
    for cut in [false, true] {
        let whole = parse(format.clone(), text, cut);
        for chunk in 1..=7 {
            assert_eq!(
                streamed(format.clone(), text, chunk, cut),
                whole,
                "{format:?}, chunks of {chunk}, cut {cut}: {text}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_mistral_decodes_with_special_tokens_kept() {
        use ToolFormat::*;
        let kept: Vec<ToolFormat> = [
            Hermes,
            LlamaJson,
            Mistral,
            QwenXml(Default::default()),
            Pythonic,
        ]
        .into_iter()
        .filter(|f| f.keeps_special_tokens())
        .collect();
        assert_eq!(kept, [Mistral]);
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

    /// Streamed, whitespace after a call is held: dropped at the end or before another call,
    /// released with the text that follows it.
    #[test]
    fn whitespace_after_a_call_is_content_only_before_text() {
        let one = "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>";
        let texts = |pieces: &[Piece]| -> String {
            pieces
                .iter()
                .filter_map(|p| match p {
                    Piece::Text(t) => Some(t.as_str()),
                    Piece::Call(_) => None,
                })
                .collect()
        };
        let mut s = ToolCallSplitter::new(ToolFormat::Hermes);
        let mut out = s.push(one);
        out.extend(s.push("\n"));
        assert_eq!(texts(&out), "", "held, not released");
        out.extend(s.finish(false));
        assert_eq!((texts(&out).as_str(), out.len()), ("", 1));
        let mut s = ToolCallSplitter::new(ToolFormat::Hermes);
        let mut out = s.push(one);
        out.extend(s.push("\n"));
        out.extend(s.push("Done."));
        out.extend(s.finish(false));
        assert_eq!(texts(&out), "\nDone.");
    }

    #[test]
    fn hermes_several_calls_with_leading_text() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n\
                    <tool_call>\n{\"name\": \"b\", \"arguments\": {\"x\": 1}}\n</tool_call>";
        let p = parse(ToolFormat::Hermes, text, false);
        // The newline between the calls is no content.
        assert_eq!(p.content, "Let me check.\n");
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
                let mut splitter = ToolCallSplitter::new(format.clone());
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
                let whole = parse(format.clone(), text, false);
                assert_eq!(streamed, whole, "{format:?}: {text}");
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
