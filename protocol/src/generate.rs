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
}

/// Token counts of a finished or running request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens whose KV came from the prefix cache instead of being computed.
    pub cached_tokens: u32,
}

/// One event of a request's stream: a token, then eventually the end.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TokenEvent {
    Token {
        id: u32,
        logprob: f32,
    },
    Finished {
        reason: FinishReason,
        usage: Usage,
    },
    /// The engine could not continue this request (the message says why).
    Failed {
        message: String,
    },
}
