//! One assistant turn through the engine, as Anthropic reports it: text pieces, then why it
//! ended (`end_turn`, `max_tokens`, `stop_sequence`) and *which* stop sequence matched.
//!
//! The shared [`Generation`] applies stop strings but only says "stop", the same word it uses
//! for an end-of-sequence token. So the stop sequences are not handed to it: this turn runs them
//! through the same [`StopStrings`] matcher over the released text, keeps that text, and on a
//! match asks it which sequence won by the matcher's own rule (earliest end, then earliest
//! start). It then cancels the engine request and drains the `Generation` to its `Finished`, so
//! usage still comes from the engine (it may count the few tokens decoded before the cancel
//! landed).

use strata_engine_api::submit::RequestStream;
use strata_model::stop::StopStrings;
use strata_protocol::{Constraint, GenerateRequest, SamplingParams};

use super::generation::{Generation, Step};
use crate::error::ApiError;
use crate::parking::Park;
use crate::state::AppState;
use crate::tools::ToolFormat;

#[derive(Debug, Clone, PartialEq)]
pub enum TurnStep {
    Text(String),
    Finished(Ending),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Ending {
    pub stop_reason: &'static str,
    pub stop_sequence: Option<String>,
    /// Every prompt token, whether computed, read from the cache or written to it.
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// Prompt tokens read from the prefix cache.
    pub cache_read_tokens: u32,
    /// Prompt tokens this request parked in the cache (its marked prefix, less what it read).
    pub cache_write_tokens: u32,
}

impl Ending {
    /// Prompt tokens neither read from the cache nor written to it: what Anthropic reports as
    /// `input_tokens` and Converse as `inputTokens`, beside the two cache counts.
    pub fn uncached_input_tokens(&self) -> u32 {
        self.input_tokens
            .saturating_sub(self.cache_read_tokens)
            .saturating_sub(self.cache_write_tokens)
    }
}

pub struct Turn {
    state: AppState,
    request_id: u64,
    generation: Generation,
    matcher: StopStrings,
    sequences: Vec<String>,
    /// Every piece fed to `matcher`, to name the sequence that matched.
    seen: String,
    matched: Option<String>,
    pending: Option<Ending>,
    done: bool,
    /// The marked prefix to park once the request has run.
    park: Option<Park>,
}

impl Turn {
    /// Submits `prompt` under the tenant's `cache_salt`; `sampling.stop` is taken over by the
    /// turn (see the module docs). `format`, the rendered tool format, decides whether the
    /// answer is decoded with special tokens kept.
    pub fn start(
        state: AppState,
        prompt: Vec<u32>,
        mut sampling: SamplingParams,
        cache_salt: u64,
        constraint: Option<Constraint>,
        format: Option<ToolFormat>,
    ) -> Result<Self, ApiError> {
        let sequences = std::mem::take(&mut sampling.stop);
        let stream: RequestStream = state.submit(
            GenerateRequest {
                resume: None,
                embed: None,
                prompt: prompt.clone(),
                sampling,
                cache_salt,
                deadline: None,
                constraint,
            },
            "messages",
        )?;
        let request_id = stream.id;
        let keep_special = format
            .as_ref()
            .is_some_and(ToolFormat::keeps_special_tokens);
        let generation = Generation::new(state.clone(), stream, &prompt, &[], keep_special);
        Ok(Self {
            state,
            request_id,
            generation,
            matcher: StopStrings::new(&sequences),
            sequences,
            seen: String::new(),
            matched: None,
            pending: None,
            done: false,
            park: None,
        })
    }

    /// Parks `park` (the request's marked prefix) when the request finishes.
    pub fn parking(mut self, park: Option<Park>) -> Self {
        self.park = park;
        self
    }

    /// The next non-empty piece of text, then `Finished` once, then `None`.
    pub async fn next(&mut self) -> Option<Result<TurnStep, ApiError>> {
        if self.done {
            return None;
        }
        if let Some(ending) = self.pending.take() {
            self.done = true;
            return Some(Ok(TurnStep::Finished(ending)));
        }
        loop {
            let step = match self.generation.next().await {
                Some(Ok(step)) => step,
                Some(Err(e)) => {
                    self.done = true;
                    return Some(Err(e));
                }
                None => {
                    self.done = true;
                    return Some(Err(ApiError::internal("the generation ended early")));
                }
            };
            match step {
                // After a match the engine is being cancelled: what it still sends is dropped.
                Step::Text(_) if self.matched.is_some() => {}
                Step::Text(piece) => {
                    self.seen.push_str(&piece);
                    let outcome = self.matcher.push(&piece);
                    let emit = outcome.emit.to_string();
                    if outcome.stopped {
                        self.matched = winning_sequence(&self.seen, &self.sequences);
                        let _ = self.state.engine.cancel(self.request_id);
                    }
                    if !emit.is_empty() {
                        return Some(Ok(TurnStep::Text(emit)));
                    }
                }
                Step::Finished { reason, usage } => {
                    let stop_reason = match (&self.matched, reason) {
                        (Some(_), _) => "stop_sequence",
                        (None, "length") => "max_tokens",
                        (None, _) => "end_turn",
                    };
                    let read = usage.prompt_tokens_details.cached_tokens;
                    let written = self.park.take().map_or(0, |p| p.apply(&self.state, read));
                    let ending = Ending {
                        stop_reason,
                        stop_sequence: self.matched.clone(),
                        input_tokens: usage.prompt_tokens,
                        output_tokens: usage.completion_tokens,
                        cache_read_tokens: read,
                        cache_write_tokens: written,
                    };
                    let held = self.matcher.finish();
                    if held.is_empty() {
                        self.done = true;
                        return Some(Ok(TurnStep::Finished(ending)));
                    }
                    self.pending = Some(ending);
                    return Some(Ok(TurnStep::Text(held)));
                }
            }
        }
    }

    /// Runs to the end: the whole text and how it ended.
    pub async fn collect(mut self) -> Result<(String, Ending), ApiError> {
        let mut text = String::new();
        while let Some(step) = self.next().await {
            match step? {
                TurnStep::Text(piece) => text.push_str(&piece),
                TurnStep::Finished(ending) => return Ok((text, ending)),
            }
        }
        Err(ApiError::internal("the generation ended without a finish"))
    }
}

/// The sequence [`StopStrings`] stopped on in `text`: of those that occur, the one whose first
/// occurrence ends earliest, then starts earliest (empty sequences never match).
fn winning_sequence(text: &str, sequences: &[String]) -> Option<String> {
    sequences
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            text.find(s.as_str())
                .map(|start| ((start + s.len(), start), s))
        })
        .min_by_key(|(key, _)| *key)
        .map(|(_, s)| s.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn winner(text: &str, sequences: &[&str]) -> Option<String> {
        let sequences: Vec<String> = sequences.iter().map(|s| s.to_string()).collect();
        winning_sequence(text, &sequences)
    }

    #[test]
    fn the_sequence_ending_first_wins() {
        assert_eq!(
            winner("one two three", &["three", "two"]).as_deref(),
            Some("two")
        );
        assert_eq!(winner("abcd", &["bcd", "abc"]).as_deref(), Some("abc"));
        assert_eq!(winner("xyz", &["xyz", "y"]).as_deref(), Some("y"));
    }

    #[test]
    fn nothing_matches_when_no_sequence_occurs() {
        assert_eq!(winner("hello", &["", "bye"]), None);
    }

    #[test]
    fn agrees_with_the_matcher_on_where_text_stops() {
        let sequences: Vec<String> = ["lo w", "o"].iter().map(|s| s.to_string()).collect();
        let mut matcher = StopStrings::new(&sequences);
        let mut seen = String::new();
        let mut emitted = String::new();
        for piece in ["hel", "lo w", "orld"] {
            seen.push_str(piece);
            let outcome = matcher.push(piece);
            emitted.push_str(outcome.emit);
            if outcome.stopped {
                break;
            }
        }
        let won = winning_sequence(&seen, &sequences).unwrap();
        assert_eq!(won, "o");
        assert!(
            seen[emitted.len()..].starts_with(&won),
            "{seen:?} {emitted:?}"
        );
    }
}
