//! Sampling parameters in their canonical form, independent of any API surface.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// How the next token is chosen from a row of logits, and when generation stops.
///
/// `temperature == 0.0` means greedy (argmax, lowest token id on ties); every other knob is then
/// irrelevant except the penalties and the logit bias, which still shape the argmax.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the smallest set of most likely tokens whose probability mass reaches `top_p` (1.0 = off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: u32,
    /// Drop tokens whose probability is below `min_p` × the top probability (0.0 = off).
    pub min_p: f32,
    /// HF-style: logits of tokens already seen (prompt and output) are divided by this when
    /// positive and multiplied when negative (1.0 = off).
    pub repetition_penalty: f32,
    /// OpenAI-style: subtracted once from the logit of every token present in the output.
    pub presence_penalty: f32,
    /// OpenAI-style: subtracted per occurrence of a token in the output.
    pub frequency_penalty: f32,
    /// Added to the logit of the given token id before anything else.
    pub logit_bias: BTreeMap<u32, f32>,
    /// Seed of the sampling RNG; the same seed with the same logits gives the same tokens.
    pub seed: u64,
    pub max_tokens: u32,
    /// Stop token ids (the request's and, unless `ignore_eos`, the model's end-of-sequence ids)
    /// cannot be generated before this many tokens were (vLLM's `min_tokens`; 0 = off).
    pub min_tokens: u32,
    /// Token ids that end generation (in addition to the model's end-of-sequence ids, unless
    /// `ignore_eos`). The stop token is not part of the returned text.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation; the matched string is not part of the returned text.
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Report log-probabilities: `Some(k)` sends each token's log-probability and the `k` most
    /// likely alternatives (at most [`MAX_TOP_LOGPROBS`]); `None` sends none.
    pub logprobs: Option<u32>,
}

/// The most alternatives a token's log-probabilities may list (OpenAI's bound).
pub const MAX_TOP_LOGPROBS: u32 = 20;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: BTreeMap::new(),
            seed: 0,
            max_tokens: 256,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Rejects values no surface should let through; the message names the field and the range.
    pub fn validate(&self) -> Result<(), SamplingParamsError> {
        let check = |field: &'static str, value: f32, ok: bool, range: &'static str| {
            if ok && value.is_finite() {
                Ok(())
            } else {
                Err(SamplingParamsError {
                    field,
                    value,
                    range,
                })
            }
        };
        check(
            "temperature",
            self.temperature,
            self.temperature >= 0.0,
            ">= 0",
        )?;
        check(
            "top_p",
            self.top_p,
            self.top_p > 0.0 && self.top_p <= 1.0,
            "in (0, 1]",
        )?;
        check(
            "min_p",
            self.min_p,
            (0.0..=1.0).contains(&self.min_p),
            "in [0, 1]",
        )?;
        check(
            "repetition_penalty",
            self.repetition_penalty,
            self.repetition_penalty > 0.0,
            "> 0",
        )?;
        check("presence_penalty", self.presence_penalty, true, "finite")?;
        check("frequency_penalty", self.frequency_penalty, true, "finite")?;
        for bias in self.logit_bias.values() {
            check("logit_bias", *bias, true, "finite")?;
        }
        if self.min_tokens > self.max_tokens {
            return Err(SamplingParamsError {
                field: "min_tokens",
                value: self.min_tokens as f32,
                range: "<= max_tokens",
            });
        }
        if let Some(k) = self.logprobs {
            check(
                "top_logprobs",
                k as f32,
                k <= MAX_TOP_LOGPROBS,
                "in [0, 20]",
            )?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("sampling parameter `{field}` = {value} is out of range (must be {range})")]
pub struct SamplingParamsError {
    pub field: &'static str,
    pub value: f32,
    pub range: &'static str,
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token, a stop token id or a stop string.
    Stop,
    /// `max_tokens` or the context window was reached.
    Length,
    Cancelled,
    /// The request's deadline passed.
    Timeout,
}
