//! What one streamed `/v1/completions` response looked like to the client: when each content
//! chunk arrived, the usage the server reported, and whether the stream ended properly.
//!
//! A content chunk is a chunk whose `choices[0].text` is not empty. The time to first token is
//! the arrival of the first one; the inter-token latencies are the gaps between successive ones.
//! A server may put several tokens in one chunk (a detokenizer holding back a partial character,
//! or a batching proxy): that chunk is one gap, not several, so ITL is per chunk as the user sees
//! text arrive, and TPOT (from the token count) is the per-token figure.

use std::time::{Duration, Instant};

use serde::Deserialize;

/// The usage chunk's counts (`stream_options.include_usage`).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    usage: Option<Usage>,
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Choice {
    text: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StreamError {
    #[error("error event in the stream: {0}")]
    ErrorEvent(String),
    #[error("a stream chunk is not a completion chunk: {0}")]
    BadChunk(String),
    #[error("the stream ended without [DONE]")]
    NoDone,
}

/// One streamed request's measurements, finished.
#[derive(Clone, Debug)]
pub struct Completion {
    /// Send to the first content chunk; `None` when no chunk carried text.
    pub ttft: Option<Duration>,
    /// Send to the end of the response.
    pub e2e: Duration,
    /// Gaps between successive content chunks.
    pub itls: Vec<Duration>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl Completion {
    /// Time per output token after the first: `(e2e - ttft) / (tokens - 1)`.
    pub fn tpot(&self) -> Option<Duration> {
        let ttft = self.ttft?;
        let after_first = u32::try_from(self.completion_tokens.checked_sub(1)?).ok()?;
        (after_first > 0).then(|| self.e2e.saturating_sub(ttft) / after_first)
    }
}

/// Accumulates a stream's events as they arrive.
#[derive(Default)]
pub struct StreamRecord {
    content: Vec<Instant>,
    usage: Option<Usage>,
    done: bool,
}

impl StreamRecord {
    /// Takes one event's data, arrived at `at`. Events after `[DONE]` are ignored.
    pub fn on_event(&mut self, data: &str, at: Instant) -> Result<(), StreamError> {
        if self.done {
            return Ok(());
        }
        if data.trim() == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let chunk: Chunk =
            serde_json::from_str(data).map_err(|_| StreamError::BadChunk(clip(data)))?;
        if let Some(error) = chunk.error {
            return Err(StreamError::ErrorEvent(clip(&error.to_string())));
        }
        let text = chunk.choices.first().and_then(|c| c.text.as_deref());
        if text.is_some_and(|t| !t.is_empty()) {
            self.content.push(at);
        }
        if chunk.usage.is_some() {
            self.usage = chunk.usage;
        }
        Ok(())
    }

    /// The measurements of a response that ended at `finished`; `sent_prompt_len` stands in for
    /// the prompt count, and the content chunks for the completion count, when the server sent no
    /// usage.
    pub fn finish(
        self,
        sent: Instant,
        finished: Instant,
        sent_prompt_len: u64,
    ) -> Result<Completion, StreamError> {
        if !self.done {
            return Err(StreamError::NoDone);
        }
        let usage = self.usage.unwrap_or(Usage {
            prompt_tokens: sent_prompt_len,
            completion_tokens: self.content.len() as u64,
        });
        Ok(Completion {
            ttft: self
                .content
                .first()
                .map(|&t| t.saturating_duration_since(sent)),
            e2e: finished.saturating_duration_since(sent),
            itls: self.content.windows(2).map(|w| w[1] - w[0]).collect(),
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
        })
    }
}

/// Error text short enough for a report line.
pub fn clip(text: &str) -> String {
    const MAX: usize = 300;
    match text.char_indices().nth(MAX) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn text(t: &str) -> String {
        serde_json::json!({"choices": [{"index": 0, "text": t, "finish_reason": null}]}).to_string()
    }

    #[test]
    fn ttft_itl_and_usage_from_a_stream() {
        let sent = Instant::now();
        let mut r = StreamRecord::default();
        r.on_event(&text(""), sent + 5 * MS).unwrap();
        r.on_event(&text("a"), sent + 10 * MS).unwrap();
        r.on_event(&text("bc"), sent + 13 * MS).unwrap();
        r.on_event(&text("d"), sent + 20 * MS).unwrap();
        let usage = r#"{"choices": [], "usage": {"prompt_tokens": 16, "completion_tokens": 4}}"#;
        r.on_event(usage, sent + 21 * MS).unwrap();
        r.on_event("[DONE]", sent + 21 * MS).unwrap();
        let c = r.finish(sent, sent + 22 * MS, 99).unwrap();
        assert_eq!(c.ttft, Some(10 * MS));
        assert_eq!(c.itls, [3 * MS, 7 * MS]);
        assert_eq!((c.prompt_tokens, c.completion_tokens), (16, 4));
        assert_eq!(c.e2e, 22 * MS);
        assert_eq!(c.tpot(), Some(4 * MS));
    }

    #[test]
    fn without_usage_the_sent_prompt_and_the_content_chunks_count() {
        let sent = Instant::now();
        let mut r = StreamRecord::default();
        r.on_event(&text("a"), sent + MS).unwrap();
        r.on_event(r#"{"choices":[{"text":"b"}],"usage":null}"#, sent + 2 * MS)
            .unwrap();
        r.on_event("[DONE]", sent + 2 * MS).unwrap();
        let c = r.finish(sent, sent + 2 * MS, 7).unwrap();
        assert_eq!((c.prompt_tokens, c.completion_tokens), (7, 2));
    }

    #[test]
    fn a_stream_without_done_or_with_an_error_event_fails() {
        let sent = Instant::now();
        let mut r = StreamRecord::default();
        r.on_event(&text("a"), sent).unwrap();
        assert_eq!(r.finish(sent, sent, 1).unwrap_err(), StreamError::NoDone);

        let mut r = StreamRecord::default();
        let err = r.on_event(r#"{"error": {"message": "boom"}}"#, sent);
        assert!(matches!(err, Err(StreamError::ErrorEvent(m)) if m.contains("boom")));
        let err = r.on_event("not json", sent);
        assert!(matches!(err, Err(StreamError::BadChunk(_))));
    }

    #[test]
    fn one_token_or_no_text_has_no_tpot() {
        let one = Completion {
            ttft: Some(MS),
            e2e: MS,
            itls: Vec::new(),
            prompt_tokens: 1,
            completion_tokens: 1,
        };
        assert_eq!(one.tpot(), None);
        let silent = Completion {
            ttft: None,
            completion_tokens: 5,
            ..one
        };
        assert_eq!(silent.tpot(), None);
    }
}
