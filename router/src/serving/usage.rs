//! What a request used: prompt tokens (and how many came from the prefix cache) and completion
//! tokens, as every surface reports them (OpenAI's `usage` object is its JSON).

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct UsageBody {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// How much of the prompt came from the prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

impl UsageBody {
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails::default(),
        }
    }

    /// Adds one choice's usage: its completion tokens, and its prompt's tokens (cached ones
    /// included) when `counts_prompt` — once per prompt, for the first choice of each.
    pub fn merge_choice(mut self, choice: UsageBody, counts_prompt: bool) -> Self {
        if counts_prompt {
            self.prompt_tokens += choice.prompt_tokens;
            self.prompt_tokens_details.cached_tokens += choice.prompt_tokens_details.cached_tokens;
        }
        self.completion_tokens += choice.completion_tokens;
        self.total_tokens = self.prompt_tokens + self.completion_tokens;
        self
    }

    pub fn with_cached(mut self, cached_tokens: u32) -> Self {
        self.prompt_tokens_details.cached_tokens = cached_tokens;
        self
    }
}
