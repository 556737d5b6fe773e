//! The `converse-stream` body: eventstream frames `messageStart`, one `contentBlockDelta` per
//! piece, `contentBlockStop`, `messageStop` (stop reason), `metadata` (usage, latency).
//!
//! No `contentBlockStart` is sent: its `start` member is a union of `toolUse` and `toolResult`
//! only (botocore's bedrock-runtime service model), so Bedrock opens only tool blocks with it,
//! and this surface answers in text only. A failure midway sends an exception frame and ends the body. The body owns the
//! [`Turn`], so a client that disconnects drops it and so cancels the request.

use std::convert::Infallible;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::json;

use super::error::ConverseError;
use super::eventstream::ConverseStreamEncoder;
use super::messages::{latency_ms, usage};
use crate::anthropic::turn::{Ending, Turn, TurnStep};

pub(crate) fn respond(turn: Turn, started: Instant) -> Response {
    let state = StreamState {
        turn,
        started,
        encoder: ConverseStreamEncoder,
        phase: Phase::MessageStart,
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

enum Phase {
    MessageStart,
    Text,
    MessageStop(Ending),
    Metadata(Ending),
    Closed,
}

struct StreamState {
    turn: Turn,
    started: Instant,
    encoder: ConverseStreamEncoder,
    phase: Phase,
}

impl StreamState {
    async fn next_frame(&mut self) -> Option<Bytes> {
        let e = self.encoder;
        let frame = match std::mem::replace(&mut self.phase, Phase::Closed) {
            Phase::MessageStart => {
                self.phase = Phase::Text;
                e.event("messageStart", &json!({"role": "assistant"}))
            }
            Phase::Text => match self.turn.next().await? {
                Ok(TurnStep::Text(text)) => {
                    self.phase = Phase::Text;
                    e.event(
                        "contentBlockDelta",
                        &json!({"contentBlockIndex": 0, "delta": {"text": text}}),
                    )
                }
                Ok(TurnStep::Finished(ending)) => {
                    self.phase = Phase::MessageStop(ending);
                    e.event("contentBlockStop", &json!({"contentBlockIndex": 0}))
                }
                Err(err) => {
                    let err = ConverseError::from(err);
                    e.exception(err.stream_exception_type(), &err.body())
                }
            },
            Phase::MessageStop(ending) => {
                let frame = e.event("messageStop", &json!({"stopReason": ending.stop_reason}));
                self.phase = Phase::Metadata(ending);
                frame
            }
            Phase::Metadata(ending) => e.event(
                "metadata",
                &json!({
                    "usage": usage(&ending),
                    "metrics": {"latencyMs": latency_ms(self.started)},
                }),
            ),
            Phase::Closed => return None,
        };
        Some(frame)
    }
}
