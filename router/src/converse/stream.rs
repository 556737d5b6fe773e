//! The `converse-stream` body: eventstream frames `messageStart`, then the content blocks,
//! `messageStop` (stop reason), `metadata` (usage, latency).
//!
//! A text block is its `contentBlockDelta`s (`{"text"}`) and a `contentBlockStop`, with no
//! `contentBlockStart`: its `start` member is a union of `toolUse` and `toolResult` only
//! (botocore's bedrock-runtime service model), so Bedrock opens only tool blocks with it. A tool
//! call is `contentBlockStart` (`{"toolUse": {"toolUseId", "name"}}`), one `contentBlockDelta`
//! holding its whole input as a JSON string (`{"toolUse": {"input"}}`) and `contentBlockStop`.
//! A failure midway sends an exception frame and ends the body. The body owns the [`Turn`], so
//! a client that disconnects drops it and so cancels the request.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::{Value, json};

use super::error::ConverseError;
use super::eventstream::ConverseStreamEncoder;
use super::messages::{latency_ms, usage, whole};
use crate::serving::turn::{Ending, Turn, TurnStep};
use crate::tools::ToolFormat;
use crate::tools::blocks::{BlockEvent, BlockFramer};

pub(crate) fn respond(turn: Turn, framer: BlockFramer, started: Instant) -> Response {
    let state = StreamState {
        turn,
        events: EventEncoder { framer },
        started,
        frames: ConverseStreamEncoder,
        queued: VecDeque::new(),
        opened: false,
    };
    let frames = stream::unfold(state, |mut state| async move {
        let frame = state.next_frame().await?;
        Some((Ok::<_, Infallible>(frame), state))
    });
    (
        [(header::CONTENT_TYPE, "application/vnd.amazon.eventstream")],
        Body::from_stream(frames),
    )
        .into_response()
}

/// One event: its `:event-type` and payload.
type Typed = (&'static str, Value);

/// The events of one answer, from its text pieces and ending; no I/O, so it is checked offline.
struct EventEncoder {
    framer: BlockFramer,
}

impl EventEncoder {
    fn start(&mut self) -> Vec<Typed> {
        let mut out = vec![("messageStart", json!({"role": "assistant"}))];
        out.extend(self.framer.opening().into_iter().filter_map(block_event));
        out
    }

    fn text(&mut self, text: &str) -> Vec<Typed> {
        self.framer
            .push(text)
            .into_iter()
            .filter_map(block_event)
            .collect()
    }

    fn finish(&mut self, ending: &Ending, latency_ms: u64) -> Vec<Typed> {
        // Cut by the token limit: a call it cut off is dropped and the stop is `max_tokens`.
        let cut = ending.stop_reason == "max_tokens";
        let mut out: Vec<Typed> = self
            .framer
            .finish(cut)
            .into_iter()
            .filter_map(block_event)
            .collect();
        let stop_reason = if self.framer.called() && !cut {
            "tool_use"
        } else {
            ending.stop_reason
        };
        out.push(("messageStop", json!({"stopReason": stop_reason})));
        out.push((
            "metadata",
            json!({"usage": usage(ending), "metrics": {"latencyMs": latency_ms}}),
        ));
        out
    }
}

/// A block event as a Converse event; a text block's start has none.
fn block_event(event: BlockEvent) -> Option<Typed> {
    let delta = |index: usize, delta: Value| {
        (
            "contentBlockDelta",
            json!({"contentBlockIndex": index, "delta": delta}),
        )
    };
    Some(match event {
        BlockEvent::TextStart { .. } => return None,
        BlockEvent::Text { index, text } => delta(index, json!({"text": text})),
        BlockEvent::ToolUseStart { index, id, name } => (
            "contentBlockStart",
            json!({
                "contentBlockIndex": index,
                "start": {"toolUse": {"toolUseId": id, "name": name}},
            }),
        ),
        BlockEvent::Input { index, json } => delta(index, json!({"toolUse": {"input": json}})),
        BlockEvent::Stop { index } => ("contentBlockStop", json!({"contentBlockIndex": index})),
    })
}

struct StreamState {
    turn: Turn,
    events: EventEncoder,
    started: Instant,
    frames: ConverseStreamEncoder,
    /// Events made together, sent one frame at a time before the next step is read.
    queued: VecDeque<Typed>,
    opened: bool,
}

impl StreamState {
    async fn next_frame(&mut self) -> Option<Bytes> {
        loop {
            if let Some((event_type, payload)) = self.queued.pop_front() {
                return Some(self.frames.event(event_type, &payload));
            }
            if !self.opened {
                self.opened = true;
                self.queued.extend(self.events.start());
                continue;
            }
            // `None` once the turn has finished or failed: the body ends.
            match self.turn.next().await? {
                Ok(TurnStep::Text(text)) => self.queued.extend(self.events.text(&text)),
                Ok(TurnStep::Finished(ending)) => {
                    let latency = latency_ms(self.started);
                    self.queued.extend(self.events.finish(&ending, latency));
                }
                Err(err) => {
                    let err = ConverseError::from(err);
                    return Some(
                        self.frames
                            .exception(err.stream_exception_type(), &err.body()),
                    );
                }
            }
        }
    }
}

/// The framing the handlers apply to generated text, offline: the `converse` answer for the
/// concatenated `pieces` and the `converse-stream` body for them (each piece as one engine
/// step), with tool calls parsed in `format` and the turn ending `stop_reason`. For checking
/// what clients parse without a model that writes calls.
pub fn frame_offline(
    pieces: &[&str],
    stop_reason: &'static str,
    format: Option<ToolFormat>,
) -> (Value, Vec<u8>) {
    let ending = Ending {
        stop_reason,
        stop_sequence: None,
        input_tokens: 1,
        output_tokens: pieces.len() as u32,
        cache_read_tokens: 0,
        cache_write_tokens: 0,
    };
    let framer = || BlockFramer::new(format.clone(), "tooluse_offline".into());
    let cut = ending.stop_reason == "max_tokens";
    let answer = whole(framer().whole(&pieces.concat(), cut), &ending, 0);
    let mut events = EventEncoder { framer: framer() };
    let mut typed = events.start();
    for piece in pieces {
        typed.extend(events.text(piece));
    }
    typed.extend(events.finish(&ending, 0));
    let body = typed
        .iter()
        .flat_map(|(event_type, payload)| ConverseStreamEncoder.event(event_type, payload))
        .collect();
    (answer, body)
}
