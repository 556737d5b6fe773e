//! Generated text as content blocks, for the surfaces whose answers are lists of blocks
//! (Anthropic's `content`, Converse's `output.message.content`): text blocks and tool-use
//! blocks, streamed as block starts, deltas and stops, and the whole answer folded from the same
//! events, so the two always agree.
//!
//! Without tools there is one text block, opened before any text, holding the output exactly.
//! With tools, blocks open as the [`ToolCallSplitter`] releases pieces: a call is a tool-use block
//! (start, its whole input as one delta, stop); text is a text block. Whitespace-only text between
//! or after calls makes no block (Hermes writes a newline between calls); an output without calls
//! is still one text block holding it exactly.

use serde_json::Value;

use super::calls::{Piece, ToolCallSplitter, ToolFormat};

/// One step of a streamed answer; `index` counts blocks from 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlockEvent {
    TextStart {
        index: usize,
    },
    Text {
        index: usize,
        text: String,
    },
    ToolUseStart {
        index: usize,
        id: String,
        name: String,
    },
    /// The call's input, whole, as JSON text.
    Input {
        index: usize,
        json: String,
    },
    Stop {
        index: usize,
    },
}

/// One block of a whole answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Block {
    Text(String),
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
}

/// Turns released text into block events, for one answer.
#[derive(Debug)]
pub struct BlockFramer {
    splitter: Option<ToolCallSplitter>,
    /// Call ids are `<id_prefix>_<n>`: unique when the prefix is unique per answer.
    id_prefix: String,
    /// Blocks opened so far; the open one, if any, is the last.
    opened: usize,
    text_open: bool,
    /// With tools, whitespace held while no text block is open.
    held: String,
    calls: usize,
}

impl BlockFramer {
    /// `format` is the call format when tools were rendered; `None` parses no calls.
    pub fn new(format: Option<ToolFormat>, id_prefix: String) -> Self {
        Self {
            splitter: format.map(ToolCallSplitter::new),
            id_prefix,
            opened: 0,
            text_open: false,
            held: String::new(),
            calls: 0,
        }
    }

    /// The events before any text: without tools, the text block opens at once.
    pub fn opening(&mut self) -> Vec<BlockEvent> {
        let mut out = Vec::new();
        if self.splitter.is_none() {
            self.open_text(&mut out);
        }
        out
    }

    /// The events one released piece of text makes; none while a call may be forming.
    pub fn push(&mut self, text: &str) -> Vec<BlockEvent> {
        let mut out = Vec::new();
        match self.splitter.as_mut() {
            None => self.text(text, &mut out),
            Some(splitter) => {
                for piece in splitter.push(text) {
                    self.piece(piece, &mut out);
                }
            }
        }
        out
    }

    /// The events that end the answer: whatever was held, then the open block's stop. `cut`:
    /// the token limit ended the output, so a call it cut off is dropped (see
    /// [`ToolCallSplitter::finish`]).
    pub fn finish(&mut self, cut: bool) -> Vec<BlockEvent> {
        let mut out = Vec::new();
        let pieces = self
            .splitter
            .as_mut()
            .map(|s| s.finish(cut))
            .unwrap_or_default();
        for piece in pieces {
            self.piece(piece, &mut out);
        }
        if self.opened == 0 {
            // No block yet: the (whitespace or empty) output is the answer's one text block. It
            // carries one text event even when empty, so that a stream that opens text blocks
            // with no start event (Converse) still shows the block.
            self.open_text(&mut out);
            if self.held.is_empty() {
                out.push(BlockEvent::Text {
                    index: self.opened - 1,
                    text: String::new(),
                });
            }
        }
        if self.text_open {
            let held = std::mem::take(&mut self.held);
            self.text(&held, &mut out);
            self.close_text(&mut out);
        }
        out
    }

    /// Whether the answer made any call (its stop reason is then `tool_use`, unless the token
    /// limit ended it).
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// The whole answer for `text`, folded from the streamed events; `cut` as for
    /// [`BlockFramer::finish`].
    pub fn whole(mut self, text: &str, cut: bool) -> Vec<Block> {
        let mut events = self.opening();
        events.extend(self.push(text));
        events.extend(self.finish(cut));
        let mut blocks = Vec::new();
        for event in events {
            match event {
                BlockEvent::TextStart { .. } => blocks.push(Block::Text(String::new())),
                BlockEvent::Text { text, .. } => {
                    if let Some(Block::Text(t)) = blocks.last_mut() {
                        t.push_str(&text);
                    }
                }
                BlockEvent::ToolUseStart { id, name, .. } => blocks.push(Block::ToolUse {
                    id,
                    name,
                    input: Value::Null,
                }),
                BlockEvent::Input { json, .. } => {
                    if let Some(Block::ToolUse { input, .. }) = blocks.last_mut() {
                        // The splitter releases only calls whose arguments parse as JSON.
                        *input = serde_json::from_str(&json).unwrap_or(Value::String(json));
                    }
                }
                BlockEvent::Stop { .. } => {}
            }
        }
        blocks
    }

    fn piece(&mut self, piece: Piece, out: &mut Vec<BlockEvent>) {
        match piece {
            Piece::Text(text) if self.text_open => self.text(&text, out),
            Piece::Text(text) if text.trim().is_empty() => self.held.push_str(&text),
            Piece::Text(text) => {
                self.open_text(out);
                let held = std::mem::take(&mut self.held);
                self.text(&held, out);
                self.text(&text, out);
            }
            Piece::Call(call) => {
                self.close_text(out);
                self.held.clear();
                let index = self.opened;
                self.opened += 1;
                let id = format!("{}_{}", self.id_prefix, self.calls);
                self.calls += 1;
                out.push(BlockEvent::ToolUseStart {
                    index,
                    id,
                    name: call.name,
                });
                out.push(BlockEvent::Input {
                    index,
                    json: call.arguments,
                });
                out.push(BlockEvent::Stop { index });
            }
        }
    }

    fn open_text(&mut self, out: &mut Vec<BlockEvent>) {
        out.push(BlockEvent::TextStart { index: self.opened });
        self.opened += 1;
        self.text_open = true;
    }

    fn text(&mut self, text: &str, out: &mut Vec<BlockEvent>) {
        if !text.is_empty() {
            out.push(BlockEvent::Text {
                index: self.opened - 1,
                text: text.to_string(),
            });
        }
    }

    fn close_text(&mut self, out: &mut Vec<BlockEvent>) {
        if self.text_open {
            self.text_open = false;
            out.push(BlockEvent::Stop {
                index: self.opened - 1,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn streamed(format: Option<ToolFormat>, pieces: &[&str]) -> Vec<BlockEvent> {
        let mut framer = BlockFramer::new(format, "toolu_7".into());
        let mut events = framer.opening();
        for piece in pieces {
            events.extend(framer.push(piece));
        }
        events.extend(framer.finish(false));
        events
    }

    fn text(index: usize, text: &str) -> BlockEvent {
        BlockEvent::Text {
            index,
            text: text.into(),
        }
    }

    #[test]
    fn without_tools_one_text_block_opens_first_and_holds_everything() {
        let events = streamed(None, &["<tool_call>", "{}</tool_call>"]);
        assert_eq!(
            events,
            [
                BlockEvent::TextStart { index: 0 },
                text(0, "<tool_call>"),
                text(0, "{}</tool_call>"),
                BlockEvent::Stop { index: 0 },
            ]
        );
        let empty = streamed(None, &[]);
        assert_eq!(
            empty,
            [
                BlockEvent::TextStart { index: 0 },
                BlockEvent::Stop { index: 0 }
            ]
        );
    }

    #[test]
    fn text_then_calls_become_ordered_blocks_and_whitespace_between_is_dropped() {
        let pieces = [
            "Checking.\n<tool_",
            "call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>\n",
            "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>\n",
        ];
        let events = streamed(Some(ToolFormat::Hermes), &pieces);
        assert_eq!(
            events,
            [
                BlockEvent::TextStart { index: 0 },
                text(0, "Checking.\n"),
                BlockEvent::Stop { index: 0 },
                BlockEvent::ToolUseStart {
                    index: 1,
                    id: "toolu_7_0".into(),
                    name: "get_weather".into()
                },
                BlockEvent::Input {
                    index: 1,
                    json: r#"{"city":"Paris"}"#.into()
                },
                BlockEvent::Stop { index: 1 },
                BlockEvent::ToolUseStart {
                    index: 2,
                    id: "toolu_7_1".into(),
                    name: "get_time".into()
                },
                BlockEvent::Input {
                    index: 2,
                    json: "{}".into()
                },
                BlockEvent::Stop { index: 2 },
            ]
        );
        let whole = BlockFramer::new(Some(ToolFormat::Hermes), "toolu_7".into())
            .whole(&pieces.concat(), false);
        assert_eq!(
            whole,
            [
                Block::Text("Checking.\n".into()),
                Block::ToolUse {
                    id: "toolu_7_0".into(),
                    name: "get_weather".into(),
                    input: json!({"city": "Paris"})
                },
                Block::ToolUse {
                    id: "toolu_7_1".into(),
                    name: "get_time".into(),
                    input: json!({})
                },
            ]
        );
    }

    #[test]
    fn with_tools_but_no_call_the_text_is_kept_exactly_in_one_block() {
        for text in [
            "  \n",
            "",
            " plain <tool text",
            "<tool_call>{bad}</tool_call>",
            "[TOOL_CALLS]bad name[ARGS]{}",
            "[f(1)]",
        ] {
            for format in [
                ToolFormat::Hermes,
                ToolFormat::LlamaJson,
                ToolFormat::Mistral,
                ToolFormat::QwenXml(Default::default()),
                ToolFormat::Pythonic,
            ] {
                let mut framer = BlockFramer::new(Some(format.clone()), "t".into());
                let blocks = BlockFramer::new(Some(format.clone()), "t".into()).whole(text, false);
                assert_eq!(blocks, [Block::Text(text.into())], "{format:?} {text:?}");
                let mut events = framer.opening();
                for c in text.chars() {
                    events.extend(framer.push(&c.to_string()));
                }
                events.extend(framer.finish(false));
                assert!(!framer.called());
                assert_eq!(events.first(), Some(&BlockEvent::TextStart { index: 0 }));
                assert_eq!(events.last(), Some(&BlockEvent::Stop { index: 0 }));
            }
        }
    }

    #[test]
    fn text_after_a_call_opens_a_new_block_and_the_whole_agrees_with_the_stream() {
        let text = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n  Done.";
        let mut framer = BlockFramer::new(Some(ToolFormat::Hermes), "t".into());
        let mut events = framer.opening();
        for c in text.chars() {
            events.extend(framer.push(&c.to_string()));
        }
        events.extend(framer.finish(false));
        assert!(framer.called());
        let streamed: String = events
            .iter()
            .filter_map(|e| match e {
                BlockEvent::Text { index: 1, text } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(streamed, "\n  Done.");
        let whole = BlockFramer::new(Some(ToolFormat::Hermes), "t".into()).whole(text, false);
        assert_eq!(whole[1], Block::Text("\n  Done.".into()));
        assert_eq!(events.last(), Some(&BlockEvent::Stop { index: 1 }));
    }
}
