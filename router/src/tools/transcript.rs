//! A block-based conversation (text, tool calls, tool results) as the template-shaped messages
//! OpenAI's chat path renders, so a tool conversation reaches the template the same way from
//! every surface: an assistant turn is one message with `content` and `tool_calls` (`arguments`
//! an object, as chat's normalisation leaves them), and each tool result is a `tool` message
//! with `tool_call_id`, in the order the blocks came.

use serde_json::{Value, json};

/// The messages built so far.
#[derive(Debug, Default)]
pub struct Transcript {
    messages: Vec<Value>,
}

impl Transcript {
    pub fn system(&mut self, text: String) {
        self.messages
            .push(json!({"role": "system", "content": text}));
    }

    /// Starts one message of the request: its blocks are added in order, then
    /// [`PendingMessage::end`].
    pub fn message(&mut self, role: &'static str) -> PendingMessage<'_> {
        PendingMessage {
            transcript: self,
            role,
            text: String::new(),
            calls: Vec::new(),
            emitted: false,
        }
    }

    pub fn into_messages(self) -> Vec<Value> {
        self.messages
    }
}

/// One request message being translated.
#[derive(Debug)]
pub struct PendingMessage<'a> {
    transcript: &'a mut Transcript,
    role: &'static str,
    /// Text since the last message was emitted (text blocks join with no separator).
    text: String,
    calls: Vec<Value>,
    /// Whether this request message has produced a template message yet.
    emitted: bool,
}

impl PendingMessage<'_> {
    pub fn text(&mut self, text: &str) {
        self.text.push_str(text);
    }

    /// A call the assistant made; `input` is its arguments object.
    pub fn call(&mut self, id: &str, name: &str, input: Value) {
        self.calls.push(json!({
            "id": id,
            "type": "function",
            "function": {"name": name, "arguments": input},
        }));
    }

    /// A tool's answer: the text before it stays before it, as its own message.
    pub fn tool_result(&mut self, call_id: &str, content: String) {
        self.flush();
        self.transcript.messages.push(json!({
            "role": "tool",
            "tool_call_id": call_id,
            "content": content,
        }));
        self.emitted = true;
    }

    /// Ends the message. One that produced nothing still renders, as an empty message.
    pub fn end(mut self) {
        if self.text.is_empty() && self.calls.is_empty() && !self.emitted {
            self.transcript
                .messages
                .push(json!({"role": self.role, "content": ""}));
        }
        self.flush();
    }

    /// Emits the text and calls gathered since the last message, if any.
    fn flush(&mut self) {
        if self.text.is_empty() && self.calls.is_empty() {
            return;
        }
        let mut message = json!({"role": self.role, "content": std::mem::take(&mut self.text)});
        if !self.calls.is_empty() {
            message["tool_calls"] = std::mem::take(&mut self.calls).into();
        }
        self.transcript.messages.push(message);
        self.emitted = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_assistant_turn_is_one_message_with_its_calls() {
        let mut t = Transcript::default();
        let mut pending = t.message("assistant");
        pending.text("Checking.");
        pending.call("toolu_1", "get_weather", json!({"city": "Paris"}));
        pending.call("toolu_2", "get_time", json!({}));
        pending.end();
        assert_eq!(
            t.into_messages(),
            [
                json!({"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "toolu_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"id": "toolu_2", "type": "function",
                     "function": {"name": "get_time", "arguments": {}}},
                ]})
            ]
        );
    }

    #[test]
    fn tool_results_become_tool_messages_in_block_order() {
        let mut t = Transcript::default();
        t.system("Be brief.".into());
        let mut pending = t.message("user");
        pending.tool_result("toolu_1", "18°C".into());
        pending.tool_result("toolu_2", "noon".into());
        pending.text("And ");
        pending.text("tomorrow?");
        pending.end();
        assert_eq!(
            t.into_messages(),
            [
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "tool", "tool_call_id": "toolu_1", "content": "18°C"}),
                json!({"role": "tool", "tool_call_id": "toolu_2", "content": "noon"}),
                json!({"role": "user", "content": "And tomorrow?"}),
            ]
        );
    }

    #[test]
    fn text_before_a_result_stays_before_it_and_empty_messages_remain() {
        let mut t = Transcript::default();
        let mut pending = t.message("user");
        pending.text("first");
        pending.tool_result("c", String::new());
        pending.end();
        t.message("assistant").end();
        assert_eq!(
            t.into_messages(),
            [
                json!({"role": "user", "content": "first"}),
                json!({"role": "tool", "tool_call_id": "c", "content": ""}),
                json!({"role": "assistant", "content": ""}),
            ]
        );
    }
}
