//! Speculative decoding that changes speed and never a byte of output.
//!
//! A [`Proposer`] drafts up to k tokens for a decoding sequence; the scheduler appends them to
//! the sequence's step as generated-role rows (positions past the prompt, computed exactly as
//! plain decoding computes them, causal within the step) and asks for logits at every row. The
//! sequence's own sampler then draws row by row, with the same random word and penalty history
//! plain decoding would have at that position: a proposed token is accepted only if it equals the
//! token drawn there, and the first draw that differs (or the draw after the last proposal) is
//! emitted as plain decoding would emit it. So greedy and seeded sampled output are byte-identical
//! to decoding without speculation; only the number of steps changes.
//!
//! Rollback: the rows after the first rejection wrote K/V into slots past the committed length;
//! the sequence's computed length stops before them (the next step overwrites them), blocks that
//! hold only such slots are released, and no block is hashed into the prefix cache (or reported
//! in a KV event) until committed tokens fill it.

mod config;
mod draft;
mod ngram;
mod policy;

#[cfg(test)]
mod gates;

pub use config::{
    MAX_PROMPT_LOOKUP, MAX_SPECULATIVE_TOKENS, SpecMethod, SpecPolicy, SpeculativeConfig,
};
pub use draft::DraftModelProposer;
pub use ngram::NgramProposer;
pub use policy::{Acceptance, StepCost, choose};
pub use strata_engine_api::load::SpecCounters;

/// One sequence asking for proposals.
#[derive(Debug, Clone, Copy)]
pub struct ProposeInput<'a> {
    /// The sequence's id in the engine (a proposer with per-sequence state keys it by this).
    pub id: u64,
    /// The prompt and every committed generated token, in order.
    pub tokens: &'a [u32],
    /// Propose at most this many.
    pub max: usize,
}

/// Drafts the tokens a step verifies. The n-gram lookup is stateless; a draft model keeps a KV
/// cache per sequence and a checkpoint's own prediction heads (MTP / EAGLE) read the target's
/// hidden states — both fit behind this seam: proposals for a batch at once, told which
/// sequences ended.
pub trait Proposer: Send {
    /// The method's name, as configured and as metrics label it.
    fn name(&self) -> &'static str;

    /// Writes into `out[i]` up to `inputs[i].max` tokens that may follow `inputs[i].tokens`
    /// (empty: nothing to propose, the sequence decodes one token).
    fn propose(&mut self, inputs: &[ProposeInput<'_>], out: &mut [Vec<u32>]);

    /// The sequence ended or was preempted: forget what was kept for it.
    fn forget(&mut self, _id: u64) {}
}

/// The proposer `config` names.
pub fn proposer(config: &SpeculativeConfig) -> Result<Box<dyn Proposer>, String> {
    config.validate()?;
    match config.method {
        SpecMethod::Ngram => {
            let (min, max) = config.lookup();
            Ok(Box::new(NgramProposer::new(min, max)))
        }
        SpecMethod::DraftModel => Err(
            "speculative method draft_model needs its model loaded: the engine is started with \
             its proposer (strata_node::start_engine does that)"
                .into(),
        ),
    }
}

/// The scheduler's speculation: the proposer, its settings and the cost measurements.
pub struct Speculator {
    pub(crate) config: SpeculativeConfig,
    pub(crate) proposer: Box<dyn Proposer>,
    pub(crate) cost: StepCost,
    /// The proposer's seconds per proposed token of its longest proposal, by the number of
    /// sequences asking (a draft model runs one step per token; prompt lookup next to nothing).
    pub(crate) round_cost: StepCost,
    pub(crate) counters: SpecCounters,
    /// Reused proposal buffers, one per sequence asking.
    pub(crate) drafts: Vec<Vec<u32>>,
    /// Verify every proposal whatever it costs (`"policy": "always"`, and the gates, which test
    /// identity, not policy).
    pub(crate) unconditional: bool,
}

impl Speculator {
    pub fn new(config: SpeculativeConfig) -> Result<Self, String> {
        let proposer = proposer(&config)?;
        Ok(Self::with_proposer(config, proposer))
    }

    /// Speculation through `proposer` (tests, and proposers built outside this crate).
    pub fn with_proposer(config: SpeculativeConfig, proposer: Box<dyn Proposer>) -> Self {
        Self {
            unconditional: config.policy == Some(SpecPolicy::Always),
            config,
            proposer,
            cost: StepCost::default(),
            round_cost: StepCost::default(),
            counters: SpecCounters::default(),
            drafts: Vec::new(),
        }
    }

    /// Every proposal verified, the cost policy off (for gates of identity).
    #[cfg(test)]
    pub(crate) fn unconditional(mut self) -> Self {
        self.unconditional = true;
        self
    }

    pub fn counters(&self) -> SpecCounters {
        self.counters
    }
}
