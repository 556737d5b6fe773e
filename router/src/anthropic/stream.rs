//! The SSE answer to `"stream": true`: `message_start`, then the content blocks
//! (`content_block_start`, `content_block_delta` per piece, `content_block_stop`; without tools
//! the one text block opens before `ping`), `message_delta` (stop reason, output tokens),
//! `message_stop`. A text block's deltas are `text_delta`; a `tool_use` block starts with its
//! id, name and `input: {}` and gets its input as one `input_json_delta`. A failure midway sends
//! an `error` event and ends the stream. The body owns the [`Turn`], so a client that disconnects
//! drops it and so cancels the request.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::{Value, json};

use super::error::AnthropicError;
use super::messages::MessageHeader;
use crate::serving::turn::{Ending, Turn, TurnStep};
use crate::tools::blocks::{BlockEvent, BlockFramer};

pub(crate) fn respond(turn: Turn, header: MessageHeader, framer: BlockFramer) -> Response {
    let state = StreamState {
        turn,
        encoder: MessageEncoder { header, framer },
        queued: VecDeque::new(),
        started: false,
    };
    let events = stream::unfold(state, |mut state| async move {
        let event = state.next_event().await?;
        Some((Ok::<_, Infallible>(event), state))
    });
    Sse::new(events).into_response()
}

/// One named SSE event.
type Named = (&'static str, Value);

/// The events of one answer, from its text pieces and ending; no I/O, so it is checked offline.
pub(crate) struct MessageEncoder {
    pub header: MessageHeader,
    pub framer: BlockFramer,
}

impl MessageEncoder {
    pub fn start(&mut self) -> Vec<Named> {
        let message = self.header.message(json!([]), None);
        let mut out = vec![(
            "message_start",
            json!({"type": "message_start", "message": message}),
        )];
        out.extend(self.framer.opening().into_iter().map(block_event));
        out.push(("ping", json!({"type": "ping"})));
        out
    }

    pub fn text(&mut self, text: &str) -> Vec<Named> {
        self.framer
            .push(text)
            .into_iter()
            .map(block_event)
            .collect()
    }

    pub fn finish(&mut self, ending: &Ending) -> Vec<Named> {
        // Cut by the token limit: a call it cut off is dropped and the stop is `max_tokens`.
        let cut = ending.stop_reason == "max_tokens";
        let mut out: Vec<Named> = self
            .framer
            .finish(cut)
            .into_iter()
            .map(block_event)
            .collect();
        let stop_reason = if self.framer.called() && !cut {
            "tool_use"
        } else {
            ending.stop_reason
        };
        out.push((
            "message_delta",
            json!({
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": ending.stop_sequence},
                // The whole usage: the prompt's split over the cache is known only now.
                "usage": super::messages::usage(ending),
            }),
        ));
        out.push(("message_stop", json!({"type": "message_stop"})));
        out
    }
}

fn block_event(event: BlockEvent) -> Named {
    let delta = |index: usize, delta: Value| {
        let event = json!({"type": "content_block_delta", "index": index, "delta": delta});
        ("content_block_delta", event)
    };
    let start = |index: usize, block: Value| {
        let event = json!({"type": "content_block_start", "index": index, "content_block": block});
        ("content_block_start", event)
    };
    match event {
        BlockEvent::TextStart { index } => start(index, json!({"type": "text", "text": ""})),
        BlockEvent::Text { index, text } => {
            delta(index, json!({"type": "text_delta", "text": text}))
        }
        BlockEvent::ToolUseStart { index, id, name } => start(
            index,
            json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
        ),
        BlockEvent::Input { index, json } => delta(
            index,
            json!({"type": "input_json_delta", "partial_json": json}),
        ),
        BlockEvent::Stop { index } => (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ),
    }
}

struct StreamState {
    turn: Turn,
    encoder: MessageEncoder,
    /// Events made together, sent one at a time before the next step is read.
    queued: VecDeque<Named>,
    started: bool,
}

impl StreamState {
    async fn next_event(&mut self) -> Option<Event> {
        loop {
            if let Some((name, data)) = self.queued.pop_front() {
                return Some(Event::default().event(name).data(data.to_string()));
            }
            if !self.started {
                self.started = true;
                self.queued.extend(self.encoder.start());
                continue;
            }
            // `None` once the turn has finished or failed: the stream ends.
            match self.turn.next().await? {
                Ok(TurnStep::Text(text)) => self.queued.extend(self.encoder.text(&text)),
                Ok(TurnStep::Finished(ending)) => self.queued.extend(self.encoder.finish(&ending)),
                Err(e) => self
                    .queued
                    .push_back(("error", AnthropicError::from(e).body())),
            }
        }
    }
}

/// The framing the handler applies to generated text, offline: the whole message for the
/// concatenated `pieces` and the stream's events for them (each piece as one engine step), with
/// tool calls parsed in `format` and the turn ending `stop_reason`. For checking what clients
/// parse without a model that writes calls.
pub fn frame_offline(
    pieces: &[&str],
    stop_reason: &'static str,
    format: Option<crate::tools::ToolFormat>,
) -> (Value, Vec<(String, Value)>) {
    let header = || MessageHeader {
        id: "msg_offline".into(),
        model: "offline".into(),
        input_tokens: 1,
    };
    let ending = Ending {
        stop_reason,
        stop_sequence: None,
        input_tokens: 1,
        output_tokens: pieces.len() as u32,
        cache_read_tokens: 0,
        cache_write_tokens: 0,
    };
    let framer = || BlockFramer::new(format.clone(), "toolu_offline".into());
    let cut = ending.stop_reason == "max_tokens";
    let whole = header().whole(framer().whole(&pieces.concat(), cut), ending.clone());
    let mut encoder = MessageEncoder {
        header: header(),
        framer: framer(),
    };
    let mut events = encoder.start();
    for piece in pieces {
        events.extend(encoder.text(piece));
    }
    events.extend(encoder.finish(&ending));
    let events = events
        .into_iter()
        .map(|(name, data)| (name.to_string(), data))
        .collect();
    (whole, events)
}
