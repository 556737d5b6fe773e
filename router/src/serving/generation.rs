//! One request's run through the engine as text: token events → detokenized pieces with stop
//! strings applied → a finish reason and usage. Dropping a `Generation` drops the engine stream,
//! which cancels the request and frees its KV blocks (this is how a client disconnect cancels).

use strata_engine_api::submit::RequestStream;
use strata_model::text_stream::TextStream;
use strata_protocol::{FinishReason, TokenEvent, TokenLogprobs};

use super::usage::UsageBody;
use crate::error::ApiError;
use crate::state::AppState;

/// One generated token's log-probability with its alternatives.
pub type TokenLogprob = (u32, TokenLogprobs);

/// What the next step of a generation released.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    Text(String),
    Finished {
        reason: &'static str,
        usage: UsageBody,
    },
}

pub struct Generation {
    state: AppState,
    stream: RequestStream,
    text: TextStream,
    prompt_tokens: u32,
    completion_tokens: u32,
    cached_tokens: u32,
    /// When the request was submitted; taken (for the TTFT histogram) at the first token.
    submitted: Option<std::time::Instant>,
    /// When the request was submitted, for the end-to-end latency of a finished generation.
    started: std::time::Instant,
    /// When the last token arrived (for the inter-token latency histogram).
    last_token: Option<std::time::Instant>,
    /// When the first token arrived (for the decode-time histogram), and how long after
    /// submission (the prefill histogram takes the engine's queue out of it).
    first_token: Option<(std::time::Instant, std::time::Duration)>,
    /// Log-probabilities of the tokens behind the text released since the last
    /// [`Generation::take_logprobs`] (when the request asked for them).
    logprobs: Vec<TokenLogprob>,
    /// Set once the request ended; the next call reports it.
    pending_finish: Option<&'static str>,
    done: bool,
}

impl Generation {
    /// `keep_special`: decode with the tokenizer's special tokens kept (a tool-call format whose
    /// markers are special tokens, [`crate::tools::ToolFormat::keeps_special_tokens`]).
    pub fn new(
        state: AppState,
        stream: RequestStream,
        prompt: &[u32],
        stops: &[String],
        keep_special: bool,
    ) -> Self {
        Self {
            state,
            stream,
            text: TextStream::with_special_tokens(prompt, stops, keep_special),
            prompt_tokens: prompt.len() as u32,
            completion_tokens: 0,
            cached_tokens: 0,
            submitted: Some(std::time::Instant::now()),
            started: std::time::Instant::now(),
            last_token: None,
            first_token: None,
            logprobs: Vec::new(),
            pending_finish: None,
            done: false,
        }
    }

    /// The next non-empty piece of text, then `Finished` once, then `None`.
    pub async fn next(&mut self) -> Option<Result<Step, ApiError>> {
        if self.done {
            return None;
        }
        if let Some(reason) = self.pending_finish.take() {
            return Some(Ok(self.finish(reason)));
        }
        loop {
            let Some(event) = self.stream.events.recv().await else {
                self.done = true;
                return Some(Err(ApiError::internal("the engine stopped mid-request")));
            };
            match event {
                TokenEvent::Token { id, logprobs, .. } => {
                    self.completion_tokens += 1;
                    if let Some(info) = logprobs {
                        self.logprobs.push((id, *info));
                    }
                    let now = std::time::Instant::now();
                    if let Some(submitted) = self.submitted.take() {
                        self.state.metrics.observe_ttft(now - submitted);
                        self.first_token = Some((now, now - submitted));
                    } else if let Some(last) = self.last_token {
                        self.state.metrics.observe_inter_token(now - last);
                    }
                    self.last_token = Some(now);
                    let piece = match self.text.push(&self.state.tokenizer, id) {
                        Ok(piece) => piece,
                        Err(e) => return Some(Err(self.fail(e.into()))),
                    };
                    if piece.stopped {
                        // A stop string ended it: the engine need not run further.
                        let _ = self.state.engine.cancel(self.stream.id);
                        return Some(Ok(self.release(piece.text, "stop")));
                    }
                    if !piece.text.is_empty() {
                        return Some(Ok(Step::Text(piece.text)));
                    }
                }
                TokenEvent::Finished { reason, usage } => {
                    if let Some((_, ttft)) = self.first_token {
                        let queued = std::time::Duration::from_millis(u64::from(usage.queued_ms));
                        self.state
                            .metrics
                            .observe_prefill_time(ttft.saturating_sub(queued));
                    }
                    self.completion_tokens = usage.completion_tokens;
                    self.cached_tokens = usage.cached_tokens;
                    let tail = match self.text.finish(&self.state.tokenizer) {
                        Ok(tail) => tail,
                        Err(e) => return Some(Err(self.fail(e.into()))),
                    };
                    let reason = match reason {
                        _ if tail.stopped => "stop",
                        FinishReason::Stop => "stop",
                        FinishReason::Length | FinishReason::Cancelled | FinishReason::Timeout => {
                            "length"
                        }
                    };
                    return Some(Ok(self.release(tail.text, reason)));
                }
                TokenEvent::Failed { message } => {
                    return Some(Err(
                        self.fail(ApiError::internal(format!("generation failed: {message}")))
                    ));
                }
                TokenEvent::Unavailable { message } => {
                    return Some(Err(self.fail(ApiError::unavailable(message))));
                }
                TokenEvent::Embedding { .. } => {
                    return Some(Err(self.fail(ApiError::internal(
                        "the engine answered a generation with an embedding",
                    ))));
                }
            }
        }
    }

    /// Runs to the end: the whole text, the finish reason and usage.
    pub async fn collect(self) -> Result<(String, &'static str, UsageBody), ApiError> {
        let (text, reason, usage, _) = self.collect_all().await?;
        Ok((text, reason, usage))
    }

    /// [`Generation::collect`], with every token's log-probabilities (if asked for).
    pub async fn collect_all(
        mut self,
    ) -> Result<(String, &'static str, UsageBody, Vec<TokenLogprob>), ApiError> {
        let mut text = String::new();
        while let Some(step) = self.next().await {
            match step? {
                Step::Text(piece) => text.push_str(&piece),
                Step::Finished { reason, usage } => {
                    return Ok((text, reason, usage, self.take_logprobs()));
                }
            }
        }
        Err(ApiError::internal("the generation ended without a finish"))
    }

    /// The log-probabilities gathered since the last call, in token order.
    pub fn take_logprobs(&mut self) -> Vec<TokenLogprob> {
        std::mem::take(&mut self.logprobs)
    }

    fn release(&mut self, text: String, reason: &'static str) -> Step {
        if text.is_empty() {
            self.finish(reason)
        } else {
            self.pending_finish = Some(reason);
            Step::Text(text)
        }
    }

    fn finish(&mut self, reason: &'static str) -> Step {
        self.done = true;
        self.state.metrics.observe_e2e(self.started.elapsed());
        if let Some((first, _)) = self.first_token {
            self.state.metrics.observe_decode_time(first.elapsed());
        }
        self.state.metrics.record_usage(
            self.prompt_tokens,
            self.cached_tokens,
            self.completion_tokens,
        );
        Step::Finished {
            reason,
            usage: UsageBody::new(self.prompt_tokens, self.completion_tokens)
                .with_cached(self.cached_tokens),
        }
    }

    fn fail(&mut self, e: ApiError) -> ApiError {
        self.done = true;
        e
    }
}
