//! A response's `output` items built from the generated text: one `message` item for the text
//! and one `function_call` item per call, in the order they first appear. Streaming and
//! non-streaming responses run the same builder (the whole text pushed at once, or step by
//! step), so `response.completed` lists exactly the items a non-streaming response would.
//!
//! With tools rendered, text is split by the shared [`ToolCallSplitter`]: a call is released
//! when complete, and one the token limit cut off is dropped. The message item opens at the
//! first non-blank text (blank text before a call opens nothing, so a call alone is a lone
//! `function_call` item); a response with neither text nor calls still has its (empty) message.
//! Without tools the message opens before any text, as it always has.

use serde_json::{Value, json};

use crate::tools::{Piece, ToolCall, ToolCallSplitter, ToolFormat};

use super::responses_tools::template_call;

/// One stream event for an output item: its type and body, before the sequence number.
pub(super) type ItemEvent = (&'static str, Value);

pub(super) struct OutputItems {
    splitter: Option<ToolCallSplitter>,
    message_id: String,
    /// The response's number, which call ids carry.
    number: u64,
    items: Vec<Item>,
    /// Where the message item is in `items`, once opened.
    message: Option<usize>,
    /// Blank text seen before the message opened.
    held: String,
}

enum Item {
    Message(String),
    Call(usize, ToolCall),
}

impl OutputItems {
    pub fn new(format: Option<ToolFormat>, message_id: String, number: u64) -> Self {
        Self {
            splitter: format.map(ToolCallSplitter::new),
            message_id,
            number,
            items: Vec::new(),
            message: None,
            held: String::new(),
        }
    }

    /// The whole output of a finished generation.
    pub fn whole(mut self, text: &str, cut: bool) -> Self {
        self.opening();
        self.push(text);
        self.finish(cut);
        self
    }

    /// Events before any text: the message item, when no tools are rendered.
    pub fn opening(&mut self) -> Vec<ItemEvent> {
        let mut events = Vec::new();
        if self.splitter.is_none() {
            self.open_message(&mut events);
        }
        events
    }

    /// One step's text.
    pub fn push(&mut self, text: &str) -> Vec<ItemEvent> {
        let mut events = Vec::new();
        match self.splitter.as_mut() {
            Some(splitter) => {
                for piece in splitter.push(text) {
                    self.piece(piece, &mut events);
                }
            }
            None => self.text(text, &mut events),
        }
        events
    }

    /// The end of the output (`cut` by the token limit): held-back calls and the items' closing
    /// events.
    pub fn finish(&mut self, cut: bool) -> Vec<ItemEvent> {
        let mut events = Vec::new();
        let pieces = self
            .splitter
            .as_mut()
            .map(|s| s.finish(cut))
            .unwrap_or_default();
        for piece in pieces {
            self.piece(piece, &mut events);
        }
        if self.message.is_none() && self.items.is_empty() {
            self.open_message(&mut events);
            let held = std::mem::take(&mut self.held);
            self.text(&held, &mut events);
        }
        if let Some(index) = self.message {
            self.close_message(index, &mut events);
        }
        events
    }

    /// The `output` array, every item completed.
    pub fn output(&self) -> Value {
        let items = self
            .items
            .iter()
            .map(|item| self.item_json(item, "completed"));
        Value::Array(items.collect())
    }

    /// The assistant turn for a stored conversation: the text, and the calls the template
    /// renders (so a follow-up answering them with `function_call_output` continues correctly).
    pub fn assistant_message(&self) -> Value {
        let mut text = "";
        let mut calls = Vec::new();
        for item in &self.items {
            match item {
                Item::Message(t) => text = t,
                Item::Call(n, call) => {
                    calls.push(template_call(
                        &self.call_id(*n),
                        &call.name,
                        &call.arguments,
                    ));
                }
            }
        }
        let mut message = json!({"role": "assistant", "content": text});
        if !calls.is_empty() {
            message["tool_calls"] = calls.into();
        }
        message
    }

    fn piece(&mut self, piece: Piece, events: &mut Vec<ItemEvent>) {
        match piece {
            Piece::Text(text) => self.text(&text, events),
            Piece::Call(call) => self.call(call, events),
        }
    }

    fn text(&mut self, text: &str, events: &mut Vec<ItemEvent>) {
        let index = match self.message {
            Some(index) => index,
            None => {
                self.held.push_str(text);
                if self.held.trim().is_empty() {
                    return;
                }
                self.open_message(events);
                let held = std::mem::take(&mut self.held);
                return self.text(&held, events);
            }
        };
        if text.is_empty() {
            return;
        }
        if let Some(Item::Message(t)) = self.items.get_mut(index) {
            t.push_str(text);
        }
        events.push((
            "response.output_text.delta",
            json!({
                "item_id": self.message_id, "output_index": index, "content_index": 0,
                "delta": text, "logprobs": [],
            }),
        ));
    }

    fn open_message(&mut self, events: &mut Vec<ItemEvent>) {
        let index = self.items.len();
        self.items.push(Item::Message(String::new()));
        self.message = Some(index);
        let item = self.item_json(&self.items[index], "in_progress");
        events.push((
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        ));
        events.push((
            "response.content_part.added",
            json!({
                "item_id": self.message_id, "output_index": index, "content_index": 0,
                "part": output_text(""),
            }),
        ));
    }

    fn close_message(&self, index: usize, events: &mut Vec<ItemEvent>) {
        let Some(item @ Item::Message(text)) = self.items.get(index) else {
            return;
        };
        let id = &self.message_id;
        events.push((
            "response.output_text.done",
            json!({
                "item_id": id, "output_index": index, "content_index": 0,
                "text": text, "logprobs": [],
            }),
        ));
        events.push((
            "response.content_part.done",
            json!({
                "item_id": id, "output_index": index, "content_index": 0,
                "part": output_text(text),
            }),
        ));
        events.push((
            "response.output_item.done",
            json!({"output_index": index, "item": self.item_json(item, "completed")}),
        ));
    }

    /// A complete call: its item opens, its arguments arrive whole, and it closes.
    fn call(&mut self, call: ToolCall, events: &mut Vec<ItemEvent>) {
        let index = self.items.len();
        let n = self
            .items
            .iter()
            .filter(|i| matches!(i, Item::Call(..)))
            .count();
        let item = Item::Call(n, call);
        let mut added = self.item_json(&item, "in_progress");
        added["arguments"] = "".into();
        let done = self.item_json(&item, "completed");
        let id = done["id"].clone();
        let arguments = done["arguments"].clone();
        events.push((
            "response.output_item.added",
            json!({"output_index": index, "item": added}),
        ));
        events.push((
            "response.function_call_arguments.delta",
            json!({"item_id": id, "output_index": index, "delta": arguments}),
        ));
        events.push((
            "response.function_call_arguments.done",
            json!({"item_id": id, "output_index": index, "arguments": arguments}),
        ));
        events.push((
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        ));
        self.items.push(item);
    }

    /// Unique within the server's run: the response number and the call's position.
    fn call_id(&self, n: usize) -> String {
        format!("call_{}_{n}", self.number)
    }

    fn item_json(&self, item: &Item, status: &str) -> Value {
        match item {
            Item::Message(text) => {
                let content = if status == "completed" {
                    json!([output_text(text)])
                } else {
                    json!([])
                };
                json!({
                    "type": "message",
                    "id": self.message_id,
                    "status": status,
                    "role": "assistant",
                    "content": content,
                })
            }
            Item::Call(n, call) => json!({
                "type": "function_call",
                "id": format!("fc_{}_{n}", self.number),
                "call_id": self.call_id(*n),
                "name": call.name,
                "arguments": call.arguments,
                "status": status,
            }),
        }
    }
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

#[cfg(test)]
mod tests {
    use super::*;

    const CALL: &str = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>";

    fn whole(text: &str, format: Option<ToolFormat>, cut: bool) -> OutputItems {
        OutputItems::new(format, "msg_7".into(), 7).whole(text, cut)
    }

    /// The streamed events of `pieces`, and the output the builder ends with.
    fn streamed(pieces: &[&str], cut: bool) -> (Vec<ItemEvent>, Value) {
        let mut items = OutputItems::new(Some(ToolFormat::Hermes), "msg_7".into(), 7);
        let mut events = items.opening();
        for piece in pieces {
            events.extend(items.push(piece));
        }
        events.extend(items.finish(cut));
        (events, items.output())
    }

    #[test]
    fn text_then_calls_become_a_message_then_function_calls() {
        let text = format!("Checking.\n{CALL}\n{CALL}");
        let output = whole(&text, Some(ToolFormat::Hermes), false).output();
        let types: Vec<_> = output
            .as_array()
            .unwrap()
            .iter()
            .map(|i| &i["type"])
            .collect();
        assert_eq!(types, ["message", "function_call", "function_call"]);
        // The newline between the calls is no text.
        assert_eq!(output[0]["content"][0]["text"], "Checking.\n");
        assert_eq!(output[1]["name"], "f");
        assert_eq!(output[1]["status"], "completed");
        assert_eq!(output[1]["id"], "fc_7_0");
        assert_eq!(output[2]["call_id"], "call_7_1");
        let arguments: Value =
            serde_json::from_str(output[1]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(arguments, json!({"a": 1}));
    }

    #[test]
    fn a_call_alone_has_no_message_and_the_stored_turn_keeps_it() {
        let items = whole(&format!("\n{CALL}"), Some(ToolFormat::Hermes), false);
        let output = items.output();
        assert_eq!(output.as_array().unwrap().len(), 1, "{output}");
        assert_eq!(output[0]["type"], "function_call");
        let turn = items.assistant_message();
        assert_eq!(turn["content"], "");
        assert_eq!(turn["tool_calls"][0]["id"], "call_7_0");
        assert_eq!(
            turn["tool_calls"][0]["function"]["arguments"],
            json!({"a": 1})
        );
    }

    #[test]
    fn a_call_cut_by_the_limit_is_dropped_and_an_empty_message_remains() {
        let cut = &CALL[..30];
        let output = whole(cut, Some(ToolFormat::Hermes), true).output();
        assert_eq!(
            output,
            json!([{"type": "message", "id": "msg_7", "status": "completed",
            "role": "assistant", "content": [output_text("")]}])
        );
        // Canary: the same text not cut is not a call either, but stays as text.
        let output = whole(cut, Some(ToolFormat::Hermes), false).output();
        assert_eq!(output[0]["content"][0]["text"], cut);
    }

    #[test]
    fn without_tools_the_text_is_one_message_even_if_it_looks_like_a_call() {
        let output = whole(CALL, None, false).output();
        assert_eq!(output.as_array().unwrap().len(), 1);
        assert_eq!(output[0]["content"][0]["text"], CALL);
        let turn = whole(CALL, None, false).assistant_message();
        assert_eq!(turn, json!({"role": "assistant", "content": CALL}));
    }

    #[test]
    fn the_stream_ends_with_the_whole_output_and_consistent_indices() {
        let text = format!("Hi {CALL}");
        let (split, half) = CALL.split_at(20);
        let (events, output) = streamed(&["Hi ", split, half], false);
        assert_eq!(
            output,
            whole(&text, Some(ToolFormat::Hermes), false).output()
        );
        let kinds: Vec<_> = events
            .iter()
            .map(|(k, e)| (*k, e["output_index"].clone()))
            .collect();
        assert_eq!(
            kinds,
            [
                ("response.output_item.added", json!(0)),
                ("response.content_part.added", json!(0)),
                ("response.output_text.delta", json!(0)),
                ("response.output_item.added", json!(1)),
                ("response.function_call_arguments.delta", json!(1)),
                ("response.function_call_arguments.done", json!(1)),
                ("response.output_item.done", json!(1)),
                ("response.output_text.done", json!(0)),
                ("response.content_part.done", json!(0)),
                ("response.output_item.done", json!(0)),
            ]
        );
        assert_eq!(events[3].1["item"]["arguments"], "");
        assert_eq!(events[3].1["item"]["status"], "in_progress");
        assert_eq!(events[4].1["delta"], output[1]["arguments"]);
    }

    #[test]
    fn blank_text_before_a_call_opens_no_message_in_the_stream() {
        let (events, output) = streamed(&["\n", CALL, "\n"], false);
        assert_eq!(output.as_array().unwrap().len(), 1);
        assert!(
            events.iter().all(|(_, e)| e["output_index"] == 0),
            "{events:?}"
        );
        assert!(
            events.iter().all(|(k, _)| !k.contains("output_text")),
            "{events:?}"
        );
    }
}
