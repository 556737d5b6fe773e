//! The canonical generation request every surface is translated into, and the events that stream
//! back from an engine.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{FinishReason, SamplingParams};

/// A request as an engine sees it: token ids in, token ids out. Templates, detokenization and
/// stop strings belong to the front door.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Salts every KV block hash of this request: tenants with different salts never share
    /// cached prefixes.
    pub cache_salt: u64,
    /// Time allowed from submission to the last token; `None` = no limit.
    pub deadline: Option<Duration>,
    /// A grammar every generated token must keep the output inside; `None` = free text.
    #[serde(default)]
    pub constraint: Option<Constraint>,
    /// Set when the request continues on this node after another generated part of it.
    #[serde(default)]
    pub resume: Option<Resume>,
    /// Set when the request asks for its prompt's embedding instead of generated tokens: the
    /// engine computes the prompt and answers one [`TokenEvent::Embedding`], then `Finished`.
    #[serde(default)]
    pub embed: Option<Pooling>,
}

/// How a prompt's final hidden states (after the model's last norm) become one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// The last token's hidden state (decoder embedding models: Qwen3-Embedding, e5-mistral).
    Last,
    /// The mean of every prompt token's hidden state.
    Mean,
}

/// Where a request continued from another node stands (mid-stream failover, DESIGN.md §6): the
/// node takes `output` as tokens it generated itself — in the KV it computes, the penalty
/// history, the `max_tokens` budget, the grammar's position and the usage — and draws its next
/// random number at `rng_pos`, so the rest of the stream is the one the first node would have
/// sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resume {
    pub output: Vec<u32>,
    /// The sampler's RNG position after the last token of `output` (the last token event's
    /// `rng_pos`).
    pub rng_pos: u64,
}

/// A grammar the output must follow, enforced while decoding: at each step only tokens that keep
/// the output a valid prefix of the language can be sampled, and end-of-sequence only once the
/// output is complete.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Constraint {
    /// Any JSON object.
    JsonObject,
    /// A JSON value valid under this JSON Schema (the schema as JSON text).
    JsonSchema(String),
    /// A grammar in llguidance's Lark dialect (it may embed JSON schemas with `%json`).
    Lark(String),
}

/// Token counts of a finished or running request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens whose KV came from the prefix cache instead of being computed.
    pub cached_tokens: u32,
    /// Milliseconds the request waited in the engine (for KV blocks or a running slot) before
    /// its first step: its time to first token less this is its prefill.
    #[serde(default)]
    pub queued_ms: u32,
}

/// One event of a request's stream: a token, then eventually the end.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TokenEvent {
    Token {
        id: u32,
        /// Present when the request asked for log-probabilities.
        logprobs: Option<Box<TokenLogprobs>>,
        /// The sampler's RNG position after drawing this token: what a continuation of the
        /// request on another node resumes from ([`Resume`]).
        #[serde(default)]
        rng_pos: u64,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    /// The pooled hidden state of an embedding request ([`GenerateRequest::embed`]), as the
    /// model computed it (not normalized): `hidden_size` values.
    Embedding {
        vector: Vec<f32>,
    },
    /// The engine could not continue this request (the message says why).
    Failed {
        message: String,
    },
    /// No engine is left to continue this request (a router whose every node is gone): the
    /// client may retry later, as a new request is told at once (a 503 with Retry-After).
    Unavailable {
        message: String,
    },
}

impl TokenEvent {
    /// Whether this is a stream's last event (`Finished`, `Failed` or `Unavailable`).
    pub fn ends_stream(&self) -> bool {
        matches!(
            self,
            TokenEvent::Finished { .. }
                | TokenEvent::Failed { .. }
                | TokenEvent::Unavailable { .. }
        )
    }
}

/// A generated token's log-probability and its most likely alternatives, under the model's
/// distribution after logit bias, penalties and any grammar mask, at temperature 1 and before
/// top-k / top-p / min-p filtering.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The most likely tokens, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}
