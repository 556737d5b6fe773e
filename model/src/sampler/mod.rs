//! Turning one row of logits into one token, deterministically from a seed.
//!
//! The chain, in order (each step sees the previous step's output):
//!
//! 1. `logit_bias`: added to the raw logit of each listed token.
//! 2. Repetition penalty (HF): for every token seen in the prompt or the output, a positive logit
//!    is divided by the penalty and a non-positive one multiplied by it.
//! 3. Presence / frequency penalties (OpenAI), over *output* tokens only:
//!    `logit -= presence * [count > 0] + frequency * count`.
//! 4. Greedy (`temperature == 0`): argmax, lowest id on ties; done. The reported logprob is the
//!    log-softmax of the shaped logits at temperature 1.
//! 5. Temperature, then top-k, then top-p (the smallest most-likely set whose mass reaches `top_p`,
//!    never empty), then min-p (drop tokens below `min_p` × the top probability).
//! 6. One draw from the ChaCha8 stream over what is left; the logprob reported is the
//!    log-probability of the chosen token in exactly that distribution.
//!
//! Non-finite logits are made harmless before ranking: NaN counts as `-inf` (never chosen), `+inf`
//! as `f32::MAX` (so several `+inf` tokens share the mass evenly instead of producing NaN).
//!
//! Determinism: ranking uses a total order (logit, then token id); weights are fixed-point
//! integers from a portable exponential, so sums do not depend on the order they run in
//! ([`row`]); every non-greedy step consumes exactly one `u64` of the RNG, which is what makes
//! [`SamplerState`] a word position and nothing more.
//!
//! Steps 1–3 are a [`RowPlan`]'s shaping lists and steps 4–6 its [`DrawParams`]. A backend that
//! holds the logits elsewhere (the GPU) applies the plan and summarizes the row there
//! ([`RowSummary`]); [`Sampler::finish`] completes the draw exactly as [`Sampler::sample`] would.

pub mod row;

use std::collections::HashMap;

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
pub use row::{DrawParams, Finished, RowSummary};
use serde::{Deserialize, Serialize};
use strata_protocol::{SamplingParams, SamplingParamsError, TokenLogprobs};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplerError {
    #[error(transparent)]
    InvalidParams(#[from] SamplingParamsError),
    #[error("a vocabulary of {0} tokens is too large to sample from (at most 8 388 608)")]
    VocabTooLarge(usize),
    #[error("logits row has {got} entries but the sampler's vocabulary has {expected}")]
    LengthMismatch { expected: usize, got: usize },
    #[error("no finite logit to sample from (every entry is NaN or -inf after shaping)")]
    NoFiniteLogit,
    #[error("sampler state was taken with seed {state} but the parameters carry seed {params}")]
    SeedMismatch { state: u64, params: u64 },
    #[error("sampler state holds token {token}, outside the vocabulary of {vocab_size}")]
    TokenOutOfVocab { token: u32, vocab_size: usize },
    #[error("the row summary's candidates stop short of the {0} cut (a backend bug)")]
    IncompleteSummary(&'static str),
}

/// One sampled token and its log-probability under the distribution it was drawn from.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// The drawn token's log-probability; `None` under greedy decoding unless the parameters ask
    /// for log-probabilities (the log-softmax of a whole vocabulary is not free).
    pub logprob: Option<f32>,
    /// When the parameters ask for log-probabilities (see [`TokenLogprobs`]).
    pub logprobs: Option<Box<TokenLogprobs>>,
}

/// Everything needed to continue a sequence's sampling elsewhere with identical results: the RNG
/// position and the penalty histories. The parameters themselves travel with the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// Checked on restore: a word position means nothing under another seed.
    pub seed: u64,
    /// Position in the ChaCha8 stream, in 32-bit words.
    pub word_pos: u128,
    /// Distinct prompt tokens (in-vocabulary ones only), sorted.
    pub prompt_tokens: Vec<u32>,
    /// Every sampled token, in order.
    pub output_tokens: Vec<u32>,
}

/// One step's sampling of one row, prepared before the row exists: the shaping (steps 1–3, plus
/// tokens masked out first) as sparse lists, and the draw's parameters with its random word
/// already taken from the stream.
#[derive(Debug, Clone, PartialEq)]
pub struct RowPlan {
    pub draw: DrawParams,
    /// A grammar's allowed tokens (see `ConstrainedDecoder::allowed`): every other logit is set
    /// to `-inf` before anything else.
    pub allowed: Option<Vec<u32>>,
    /// Set to `-inf` before the shaping (stop tokens before `min_tokens`).
    pub masked: Vec<u32>,
    /// `logit += bias`, distinct tokens.
    pub bias: Vec<(u32, f32)>,
    /// The repetition penalty and the distinct tokens it applies to (empty when it is 1).
    pub penalty: f32,
    pub penalized: Vec<u32>,
    /// `logit -= amount` (presence and frequency penalties), distinct tokens.
    pub subtract: Vec<(u32, f32)>,
}

impl RowPlan {
    /// Applies the shaping to a row, in the chain's order; tokens outside the row are ignored.
    pub fn shape(&self, row: &mut [f32]) {
        if let Some(allowed) = &self.allowed {
            crate::grammar::apply_allowed(allowed, row);
        }
        for &token in &self.masked {
            if let Some(logit) = row.get_mut(token as usize) {
                *logit = f32::NEG_INFINITY;
            }
        }
        for &(token, bias) in &self.bias {
            if let Some(logit) = row.get_mut(token as usize) {
                *logit += bias;
            }
        }
        for &token in &self.penalized {
            if let Some(logit) = row.get_mut(token as usize) {
                *logit = if *logit > 0.0 {
                    *logit / self.penalty
                } else {
                    *logit * self.penalty
                };
            }
        }
        for &(token, amount) in &self.subtract {
            if let Some(logit) = row.get_mut(token as usize) {
                *logit -= amount;
            }
        }
    }
}

/// A sequence's sampler: its [`SamplingParams`], its RNG and its penalty history.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    vocab_size: usize,
    rng: ChaCha8Rng,
    history: History,
}

impl Sampler {
    pub fn new(params: &SamplingParams, vocab_size: usize) -> Result<Self, SamplerError> {
        params.validate()?;
        if vocab_size > row::MAX_VOCAB {
            return Err(SamplerError::VocabTooLarge(vocab_size));
        }
        Ok(Self {
            params: params.clone(),
            vocab_size,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            history: History::new(vocab_size),
        })
    }

    /// Rebuilds a sampler from [`Sampler::state`]; the next token drawn is the one the original
    /// would have drawn next for the same logits.
    pub fn restore(
        params: &SamplingParams,
        vocab_size: usize,
        state: &SamplerState,
    ) -> Result<Self, SamplerError> {
        let mut sampler = Self::new(params, vocab_size)?;
        if state.seed != params.seed {
            return Err(SamplerError::SeedMismatch {
                state: state.seed,
                params: params.seed,
            });
        }
        let tokens = state.prompt_tokens.iter().chain(&state.output_tokens);
        if let Some(&token) = tokens.into_iter().find(|&&t| t as usize >= vocab_size) {
            return Err(SamplerError::TokenOutOfVocab { token, vocab_size });
        }
        sampler.history.observe_prompt(&state.prompt_tokens);
        for &token in &state.output_tokens {
            sampler.history.observe_output(token);
        }
        sampler.rng.set_word_pos(state.word_pos);
        Ok(sampler)
    }

    pub fn state(&self) -> SamplerState {
        let mut prompt_tokens = self.history.prompt_tokens.clone();
        prompt_tokens.sort_unstable();
        SamplerState {
            seed: self.params.seed,
            word_pos: self.rng.get_word_pos(),
            prompt_tokens,
            output_tokens: self.history.output.clone(),
        }
    }

    /// Continues after `output` was generated elsewhere with this sampler's parameters: records
    /// it as output (penalties) and moves the RNG to `rng_pos` (see [`Sampler::rng_pos`]).
    pub fn resume(&mut self, output: &[u32], rng_pos: u64) -> Result<(), SamplerError> {
        if let Some(&token) = output.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(SamplerError::TokenOutOfVocab {
                token,
                vocab_size: self.vocab_size,
            });
        }
        for &token in output {
            self.history.observe_output(token);
        }
        self.rng.set_word_pos(u128::from(rng_pos));
        Ok(())
    }

    /// The RNG's position in 32-bit words: after a token, where a continuation resumes.
    pub fn rng_pos(&self) -> u64 {
        // Two words per draw, at most one draw per token: far below 2^64.
        u64::try_from(self.rng.get_word_pos()).unwrap_or(u64::MAX)
    }

    /// Records prompt tokens for the repetition penalty; may be called more than once (chunks).
    /// Tokens outside the vocabulary are ignored: no logit exists for them to penalize.
    pub fn observe_prompt(&mut self, prompt: &[u32]) {
        self.history.observe_prompt(prompt);
    }

    /// The output tokens sampled so far, in order.
    pub fn output(&self) -> &[u32] {
        &self.history.output
    }

    /// Samples the next token and records it in the output history.
    ///
    /// `logits` is used as scratch: on return it holds the shaped logits (after bias and
    /// penalties, before temperature), which is also what tests and debug dumps inspect.
    pub fn sample(&mut self, logits: &mut [f32]) -> Result<Sampled, SamplerError> {
        if logits.len() != self.vocab_size {
            return Err(SamplerError::LengthMismatch {
                expected: self.vocab_size,
                got: logits.len(),
            });
        }
        let plan = self.plan(Vec::new());
        plan.shape(logits);
        let summary = RowSummary::of(logits, &plan.draw)?;
        self.finish(&plan, summary)
    }

    /// Prepares this step's sampling: the shaping lists from the history, `masked` tokens first,
    /// and the draw's parameters. A non-greedy plan takes its random word from the stream now, so
    /// exactly one plan must be finished (or the sequence abandoned) per step.
    pub fn plan(&mut self, masked: Vec<u32>) -> RowPlan {
        let p = &self.params;
        let vocab = self.vocab_size;
        let in_vocab = |t: &u32| (*t as usize) < vocab;
        let greedy = p.temperature == 0.0;
        let bias = p
            .logit_bias
            .iter()
            .filter(|(t, _)| in_vocab(t))
            .map(|(&t, &b)| (t, b))
            .collect();
        let penalized = if p.repetition_penalty != 1.0 {
            self.history.seen_tokens.clone()
        } else {
            Vec::new()
        };
        let (presence, frequency) = (p.presence_penalty, p.frequency_penalty);
        let subtract = if presence != 0.0 || frequency != 0.0 {
            // Each entry touches a distinct logit, so the map's iteration order cannot matter.
            self.history
                .output_counts
                .iter()
                .map(|(&t, &count)| (t, presence + frequency * count as f32))
                .collect()
        } else {
            Vec::new()
        };
        let draw = DrawParams {
            inv_t: if greedy {
                0.0
            } else {
                1.0 / f64::from(p.temperature)
            },
            top_k: p.top_k,
            top_p: (f64::from(p.top_p) * row::TOP_P_ONE as f64).round() as u64,
            min_p_ln: if p.min_p > 0.0 {
                f64::from(p.min_p).ln()
            } else {
                f64::NEG_INFINITY
            },
            logprobs: p.logprobs,
            random: if greedy { 0 } else { self.rng.next_u64() },
        };
        RowPlan {
            draw,
            allowed: None,
            masked: masked.into_iter().filter(in_vocab).collect(),
            bias,
            penalty: p.repetition_penalty,
            penalized,
            subtract,
        }
    }

    /// Completes `plan`'s draw from the summary of its shaped row (computed by
    /// [`RowSummary::of`] or by a backend that reproduces it) and records the token.
    pub fn finish(&mut self, plan: &RowPlan, summary: RowSummary) -> Result<Sampled, SamplerError> {
        let finished = summary.finish(&plan.draw)?;
        if finished.token as usize >= self.vocab_size {
            return Err(SamplerError::TokenOutOfVocab {
                token: finished.token,
                vocab_size: self.vocab_size,
            });
        }
        let logprobs = finished.logprobs.map(Box::new);
        let sampled = Sampled {
            token: finished.token,
            logprob: finished
                .logprob
                .or_else(|| logprobs.as_ref().map(|l| l.logprob)),
            logprobs,
        };
        self.history.observe_output(sampled.token);
        Ok(sampled)
    }

    /// Whether [`Sampler::sample`] would return exactly [`greedy_token`] of the raw logits and
    /// nothing else: greedy, no bias, no penalty, no log-probabilities. Such a row can be
    /// sampled where the logits are (on the GPU) and only its token id brought back; the token
    /// is then recorded with [`Sampler::accept`].
    pub fn is_plain_greedy(&self) -> bool {
        let p = &self.params;
        p.temperature == 0.0
            && p.logit_bias.is_empty()
            && p.repetition_penalty == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && p.logprobs.is_none()
    }

    /// Records `token`, chosen elsewhere by [`greedy_token`] over this row's logits (see
    /// [`Sampler::is_plain_greedy`]), as [`Sampler::sample`] would have: same history, same
    /// RNG position (greedy draws nothing).
    pub fn accept(&mut self, token: u32) -> Result<Sampled, SamplerError> {
        if token as usize >= self.vocab_size {
            return Err(SamplerError::TokenOutOfVocab {
                token,
                vocab_size: self.vocab_size,
            });
        }
        self.history.observe_output(token);
        Ok(Sampled {
            token,
            logprob: None,
            logprobs: None,
        })
    }
}

/// The tokens the penalties look at. Distinct-token lists sit beside bitsets so applying the
/// repetition penalty walks only the tokens seen, never the whole vocabulary.
#[derive(Debug, Clone)]
struct History {
    prompt_bits: Vec<u64>,
    /// Distinct in-vocabulary prompt tokens, in first-seen order.
    prompt_tokens: Vec<u32>,
    seen_bits: Vec<u64>,
    /// Distinct in-vocabulary tokens of prompt and output, in first-seen order.
    seen_tokens: Vec<u32>,
    output: Vec<u32>,
    output_counts: HashMap<u32, u32>,
}

impl History {
    fn new(vocab_size: usize) -> Self {
        let words = vocab_size.div_ceil(64);
        Self {
            prompt_bits: vec![0; words],
            prompt_tokens: Vec::new(),
            seen_bits: vec![0; words],
            seen_tokens: Vec::new(),
            output: Vec::new(),
            output_counts: HashMap::new(),
        }
    }

    fn observe_prompt(&mut self, prompt: &[u32]) {
        for &token in prompt {
            if insert_bit(&mut self.prompt_bits, token) {
                self.prompt_tokens.push(token);
            }
            if insert_bit(&mut self.seen_bits, token) {
                self.seen_tokens.push(token);
            }
        }
    }

    fn observe_output(&mut self, token: u32) {
        self.output.push(token);
        *self.output_counts.entry(token).or_insert(0) += 1;
        if insert_bit(&mut self.seen_bits, token) {
            self.seen_tokens.push(token);
        }
    }
}

/// Sets `token`'s bit; true when it was newly set. Out-of-range tokens are never set.
fn insert_bit(bits: &mut [u64], token: u32) -> bool {
    let (word, bit) = (token as usize / 64, token % 64);
    match bits.get_mut(word) {
        Some(w) if *w & (1 << bit) == 0 => {
            *w |= 1 << bit;
            true
        }
        _ => false,
    }
}

/// NaN → -inf (never chosen), +inf → `f32::MAX`, -0 → +0 (so `total_cmp` sees one zero).
fn sanitize(logit: f32) -> f32 {
    if logit.is_nan() {
        f32::NEG_INFINITY
    } else if logit == f32::INFINITY {
        f32::MAX
    } else if logit == 0.0 {
        0.0
    } else {
        logit
    }
}

/// Greedy decoding's choice: the argmax of `logits` in the sampler's order (NaN never wins,
/// `+inf` ties with `f32::MAX`, the lowest id among equals), or `None` when no entry is finite
/// after sanitizing. The GPU's greedy kernel follows the same order; this is its reference.
pub fn greedy_token(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(u32, f32)> = None;
    for (id, &raw) in (0u32..).zip(logits) {
        let logit = sanitize(raw);
        if logit > f32::NEG_INFINITY && best.is_none_or(|(_, top)| logit > top) {
            best = Some((id, logit));
        }
    }
    best.map(|(token, _)| token)
}

#[cfg(test)]
mod tests;
