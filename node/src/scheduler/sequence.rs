//! A request inside the engine: its tokens, blocks, sampler and grammar state, and what it has
//! reported so far. The scheduler and its step's helpers read the fields directly.

use std::time::Instant;

use strata_model::grammar::ConstrainedDecoder;
use strata_model::sampler::Sampler;
use strata_protocol::{GenerateRequest, Pooling, TokenEvent, Usage};
use tokio::sync::mpsc::UnboundedSender;

use crate::backend::HiddenRows;
use crate::kv::{BlockHash, BlockId};
use crate::speculative::Acceptance;

/// A request inside the engine.
pub struct Sequence {
    pub id: u64,
    pub(super) arrival: u64,
    pub(super) request: GenerateRequest,
    /// Prompt followed by every generated token.
    pub(super) tokens: Vec<u32>,
    /// Leading tokens whose K/V is in `blocks`.
    pub(super) computed: usize,
    pub(super) blocks: Vec<BlockId>,
    /// Hashes of the leading full blocks registered so far (`hashes.len()` ≤ `blocks.len()`).
    pub(super) hashes: Vec<BlockHash>,
    pub(super) sampler: Sampler,
    /// The output grammar's position, when the request has one.
    pub(super) constraint: Option<ConstrainedDecoder>,
    pub(super) generated: u32,
    /// Tokens generated elsewhere before this request continued here.
    pub(super) resumed: u32,
    pub(super) cached_tokens: u32,
    pub(super) deadline: Option<Instant>,
    /// When the engine took the request, and when it first ran (the engine's queue between).
    pub(super) submitted: Instant,
    pub(super) started: Option<Instant>,
    pub(super) events: UnboundedSender<TokenEvent>,
    /// An embedding request's pooled hidden states so far: their sum, and how many rows.
    pub(super) pooled: (Vec<f64>, usize),
    /// Proposed tokens at the end of `tokens` that this step verifies (0 outside a step).
    pub(super) draft: usize,
    /// How many of this sequence's proposals were accepted lately.
    pub(super) acceptance: Acceptance,
}

impl Sequence {
    pub fn new(
        id: u64,
        request: GenerateRequest,
        sampler: Sampler,
        events: UnboundedSender<TokenEvent>,
    ) -> Self {
        // A deadline past what the clock can name (a hostile peer's `u64::MAX` seconds) is none.
        let deadline = request.deadline.and_then(|d| Instant::now().checked_add(d));
        let mut sampler = sampler;
        sampler.observe_prompt(&request.prompt);
        // A continued request's output so far is computed like its prompt, and counts as
        // generated (the sampler was resumed over it at admission).
        let output = request.resume.as_ref().map_or(&[][..], |r| &r.output[..]);
        let tokens = [&request.prompt[..], output].concat();
        let generated = output.len() as u32;
        Self {
            id,
            arrival: id,
            tokens,
            request,
            computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            sampler,
            constraint: None,
            generated,
            resumed: generated,
            cached_tokens: 0,
            deadline,
            submitted: Instant::now(),
            started: None,
            events,
            pooled: (Vec::new(), 0),
            draft: 0,
            acceptance: Acceptance::default(),
        }
    }

    /// Every token this sequence samples must keep its output inside `constraint`.
    pub fn with_constraint(mut self, constraint: Option<ConstrainedDecoder>) -> Self {
        self.constraint = constraint;
        self
    }

    pub(super) fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Whether the prefix cache may stand in for computing this sequence's prompt: not when
    /// every prompt row's hidden state is pooled.
    pub(super) fn reads_cache(&self) -> bool {
        self.request.embed != Some(Pooling::Mean)
    }

    /// The hidden rows a chunk of `chunk` tokens returns for this sequence, if it embeds.
    pub(super) fn hidden_rows(&self, chunk: usize) -> Option<HiddenRows> {
        match self.request.embed? {
            Pooling::Mean => Some(HiddenRows::All),
            Pooling::Last if self.computed + chunk == self.tokens.len() => Some(HiddenRows::Last),
            Pooling::Last => None,
        }
    }

    /// Adds `rows` (whole hidden rows of `hidden` values) to the pool.
    pub(super) fn pool(&mut self, rows: &[f32], hidden: usize) {
        let (sum, n) = &mut self.pooled;
        sum.resize(hidden, 0.0);
        for row in rows.chunks_exact(hidden) {
            for (s, &v) in sum.iter_mut().zip(row) {
                *s += f64::from(v);
            }
            *n += 1;
        }
    }

    /// The pooled vector: the mean of the rows pooled (the one row, for last-token pooling).
    pub(super) fn pooled_vector(&self) -> Vec<f32> {
        let (sum, n) = &self.pooled;
        sum.iter()
            .map(|s| (s / (*n).max(1) as f64) as f32)
            .collect()
    }

    pub(super) fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.request.prompt.len() as u32,
            completion_tokens: self.generated,
            cached_tokens: self.cached_tokens,
            queued_ms: self.started.map_or(0, |started| {
                let waited = started
                    .saturating_duration_since(self.submitted)
                    .as_millis();
                u32::try_from(waited).unwrap_or(u32::MAX)
            }),
        }
    }
}
