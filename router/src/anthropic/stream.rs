//! The SSE answer to `"stream": true`: `message_start`, `content_block_start`, `ping`, one
//! `content_block_delta` per piece, `content_block_stop`, `message_delta` (stop reason, output
//! tokens), `message_stop`. A failure midway sends an `error` event and ends the stream. The body
//! owns the [`Turn`], so a client that disconnects drops it and so cancels the request.

use std::convert::Infallible;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::{Value, json};

use super::messages::MessageHeader;
use super::turn::{Ending, Turn, TurnStep};

pub(crate) fn respond(turn: Turn, header: MessageHeader) -> Response {
    let state = StreamState {
        turn,
        header,
        phase: Phase::MessageStart,
    };
    let events = stream::unfold(state, |mut state| async move {
        let event = state.next_event().await?;
        Some((Ok::<_, Infallible>(event), state))
    });
    Sse::new(events).into_response()
}

enum Phase {
    MessageStart,
    BlockStart,
    Ping,
    Text,
    MessageDelta(Ending),
    MessageStop,
    Closed,
}

struct StreamState {
    turn: Turn,
    header: MessageHeader,
    phase: Phase,
}

impl StreamState {
    async fn next_event(&mut self) -> Option<Event> {
        let (name, data) = match std::mem::replace(&mut self.phase, Phase::Closed) {
            Phase::MessageStart => {
                self.phase = Phase::BlockStart;
                let message = self.header.message(json!([]), None);
                (
                    "message_start",
                    json!({"type": "message_start", "message": message}),
                )
            }
            Phase::BlockStart => {
                self.phase = Phase::Ping;
                (
                    "content_block_start",
                    json!({
                        "type": "content_block_start",
                        "index": 0,
                        "content_block": {"type": "text", "text": ""},
                    }),
                )
            }
            Phase::Ping => {
                self.phase = Phase::Text;
                ("ping", json!({"type": "ping"}))
            }
            Phase::Text => match self.turn.next().await? {
                Ok(TurnStep::Text(text)) => {
                    self.phase = Phase::Text;
                    (
                        "content_block_delta",
                        json!({
                            "type": "content_block_delta",
                            "index": 0,
                            "delta": {"type": "text_delta", "text": text},
                        }),
                    )
                }
                Ok(TurnStep::Finished(ending)) => {
                    self.phase = Phase::MessageDelta(ending);
                    (
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": 0}),
                    )
                }
                Err(e) => ("error", e.body()),
            },
            Phase::MessageDelta(ending) => {
                self.phase = Phase::MessageStop;
                ("message_delta", message_delta(&ending))
            }
            Phase::MessageStop => ("message_stop", json!({"type": "message_stop"})),
            Phase::Closed => return None,
        };
        Some(Event::default().event(name).data(data.to_string()))
    }
}

fn message_delta(ending: &Ending) -> Value {
    json!({
        "type": "message_delta",
        "delta": {"stop_reason": ending.stop_reason, "stop_sequence": ending.stop_sequence},
        "usage": {"output_tokens": ending.output_tokens},
    })
}
