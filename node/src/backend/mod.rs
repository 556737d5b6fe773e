//! The step interface every backend implements (DESIGN.md §3): a batch of sequences — prefill
//! chunks and decode tokens — with their KV block tables in, logits of the requested rows out.

mod cpu;
mod cpu_tp;
mod cuda;

pub use cpu::CpuBackend;
pub use cpu_tp::CpuTpBackend;
pub use cuda::{
    CudaBackend, CudaError, CudaOptions, CudaTpBackend, ROW_SHARDS, TpTransport, WeightSource,
    safetensors_block_values,
};

use strata_model::ModelConfig;
use strata_model::sampler::{RowPlan, RowSummary, greedy_token};

use crate::kv::{BlockId, KvBlockIo};

/// Writes `values` into `out` (`size_of_val(values)` bytes) little-endian: the byte layout of
/// exported KV blocks. One copy on little-endian hosts.
pub(crate) fn to_le_bytes<T: bytemuck::Pod + LeBytes>(values: &[T], out: &mut [u8]) {
    if cfg!(target_endian = "little") {
        out.copy_from_slice(bytemuck::cast_slice(values));
    } else {
        for (o, v) in out.chunks_exact_mut(size_of::<T>()).zip(values) {
            v.write_le(o);
        }
    }
}

/// Reads `values` back from little-endian `data`, as [`to_le_bytes`] wrote them.
pub(crate) fn from_le_bytes<T: bytemuck::Pod + LeBytes>(data: &[u8], values: &mut [T]) {
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice_mut::<T, u8>(values).copy_from_slice(data);
    } else {
        for (v, b) in values.iter_mut().zip(data.chunks_exact(size_of::<T>())) {
            *v = T::read_le(b);
        }
    }
}

/// The element types of KV blocks, byte by byte (for big-endian hosts).
pub(crate) trait LeBytes: Sized {
    fn write_le(&self, out: &mut [u8]);
    fn read_le(bytes: &[u8]) -> Self;
}

impl LeBytes for f32 {
    fn write_le(&self, out: &mut [u8]) {
        out.copy_from_slice(&self.to_le_bytes());
    }
    fn read_le(b: &[u8]) -> Self {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl LeBytes for half::bf16 {
    fn write_le(&self, out: &mut [u8]) {
        out.copy_from_slice(&self.to_le_bytes());
    }
    fn read_le(b: &[u8]) -> Self {
        half::bf16::from_le_bytes([b[0], b[1]])
    }
}

/// One sequence's part of a step.
#[derive(Debug, Clone, Copy)]
pub struct StepSeq<'a> {
    /// Tokens to compute, at positions `first_position..first_position + tokens.len()`.
    pub tokens: &'a [u32],
    pub first_position: usize,
    /// The sequence's prompt length: positions below it are prompt rows, the others generated
    /// (decode) rows. A backend may compute the two kinds differently, but each kind the same
    /// way whatever else is in the step (batch invariance, DESIGN.md §3).
    pub prompt_len: usize,
    /// The sequence's blocks: position `p` lives in `block_table[p / block_size]`, which must
    /// cover every position up to the last token of this step.
    pub block_table: &'a [BlockId],
    /// How many of this step's last rows of the sequence get logits: 0 (a prefill chunk that
    /// does not end the prompt), 1 (the next token), or more (speculative verification: the
    /// row before each proposed token, and the proposed tokens' own rows). At most
    /// `tokens.len()`.
    pub logit_rows: usize,
}

impl StepSeq<'_> {
    /// Whether the step returns any logits for this sequence.
    pub fn wants_logits(&self) -> bool {
        self.logit_rows > 0
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Forward(#[from] strata_model::cpu::ForwardError),
    #[error("device: {0}")]
    Device(String),
    #[error(
        "block table of {blocks} blocks cannot hold position {position} (block size {block_size})"
    )]
    BlockTable {
        blocks: usize,
        position: usize,
        block_size: usize,
    },
}

pub trait Backend: KvBlockIo + Send {
    fn model_config(&self) -> &ModelConfig;
    /// Tokens per KV block.
    fn block_size(&self) -> usize;
    /// Blocks in the device pool.
    fn num_blocks(&self) -> usize;
    /// How a block's bytes ([`KvBlockIo::export_block`]) are laid out: element type, rank
    /// order. Two backends exchange KV blocks only if their layouts (and models) are equal.
    fn kv_layout(&self) -> String;
    /// Computes one step. Returns `vocab_size` logits per row asked for ([`StepSeq::logit_rows`]), sequence
    /// by sequence, rows in position order.
    fn step(&mut self, seqs: &[StepSeq<'_>]) -> Result<Vec<f32>, BackendError>;

    /// Decode rows that share one read of the weights: a step of more rows reads them once per
    /// group of this many (the CUDA GEMV takes at most 64 rows a launch), so its cost jumps at
    /// each multiple. `None` where the rows of a step share one read whatever their count.
    fn decode_rows_per_weight_read(&self) -> Option<usize> {
        None
    }

    /// Whether [`Backend::step_sampling`] returns final hidden states ([`RowSampling::Hidden`]),
    /// which embeddings pool.
    fn embeds(&self) -> bool {
        false
    }

    /// Computes one step like [`Backend::step`], but each row asked for ([`StepSeq::logit_rows`])
    /// comes back as its sequence's entry in `sampling` asks (indexed like `seqs`; missing entries mean
    /// [`RowSampling::Host`]): its logits row, its greedy token ([`greedy_token`] of its logits),
    /// or the summary of its row after its plan's shaping ([`RowSummary::of`]). A backend whose
    /// logits live on a device computes tokens and summaries there and brings back a few bytes
    /// instead of a vocabulary's row; they equal the host's bit for bit.
    fn step_sampling(
        &mut self,
        seqs: &[StepSeq<'_>],
        sampling: &[RowSampling<'_>],
    ) -> Result<StepOutput, BackendError> {
        if sampling.iter().any(|s| matches!(s, RowSampling::Hidden(_))) {
            return Err(BackendError::Device(
                "this backend does not return hidden states (embeddings)".into(),
            ));
        }
        let logits = self.step(seqs)?;
        Ok(StepOutput::split(
            logits,
            seqs,
            sampling,
            self.model_config().vocab_size,
        ))
    }
}

/// How [`Backend::step_sampling`] returns a sequence that wants logits.
#[derive(Debug, Clone, Copy, Default)]
pub enum RowSampling<'a> {
    /// The raw logits row (the host samples: grammars, anything else).
    #[default]
    Host,
    /// [`greedy_token`] of the raw logits.
    Greedy,
    /// The plan's shaping applied, then [`RowSummary::of`] the shaped row.
    Summary(&'a RowPlan),
    /// No logits (the sequence must not want them): the final hidden states of these rows of
    /// its chunk instead, after the model's last norm, as f32 ([`StepOutput::hidden`]).
    Hidden(HiddenRows),
}

/// Which rows of a chunk [`RowSampling::Hidden`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HiddenRows {
    /// The chunk's last row (last-token pooling, on the chunk that ends the prompt).
    Last,
    /// Every row of the chunk, in order (mean pooling).
    All,
}

impl HiddenRows {
    /// How many rows a chunk of `tokens` tokens returns.
    pub fn count(self, tokens: usize) -> usize {
        match self {
            HiddenRows::Last => usize::from(tokens > 0),
            HiddenRows::All => tokens,
        }
    }
}

impl RowSampling<'_> {
    fn of<'s>(sampling: &'s [RowSampling<'s>], seq: usize) -> RowSampling<'s> {
        sampling.get(seq).copied().unwrap_or_default()
    }
}

/// What [`Backend::step_sampling`] returns, per row asked for, in order, by kind.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutput {
    /// `vocab_size` logits per wanting [`RowSampling::Host`] sequence.
    pub logits: Vec<f32>,
    /// Per wanting greedy sequence: [`greedy_token`] of its logits (`None`: no finite logit).
    pub tokens: Vec<Option<u32>>,
    /// Per wanting [`RowSampling::Summary`] sequence (`None`: no finite logit after shaping).
    pub summaries: Vec<Option<RowSummary>>,
    /// `hidden_size` values per row [`RowSampling::Hidden`] asked for, sequence by sequence.
    pub hidden: Vec<f32>,
}

impl StepOutput {
    /// Sorts `logits` (one row per wanting sequence) into what `sampling` asks, on the host.
    pub fn split(
        mut logits: Vec<f32>,
        seqs: &[StepSeq<'_>],
        sampling: &[RowSampling<'_>],
        vocab: usize,
    ) -> Self {
        let wanting = || {
            seqs.iter()
                .enumerate()
                .flat_map(|(i, s)| std::iter::repeat_n(RowSampling::of(sampling, i), s.logit_rows))
        };
        if wanting().all(|r| matches!(r, RowSampling::Host)) {
            return Self {
                logits,
                ..Self::default()
            };
        }
        let mut out = Self::default();
        for (how, row) in wanting().zip(logits.chunks_exact_mut(vocab)) {
            match how {
                // A sequence with hidden rows wants no logits; one that does gets its row.
                RowSampling::Host | RowSampling::Hidden(_) => out.logits.extend_from_slice(row),
                RowSampling::Greedy => out.tokens.push(greedy_token(row)),
                RowSampling::Summary(plan) => {
                    // The row is this step's own: shaped in place, as the GPU does.
                    plan.shape(row);
                    out.summaries.push(RowSummary::of(row, &plan.draw).ok());
                }
            }
        }
        out
    }
}

/// One sequence of a step, owned, so that it can be shared with tensor-parallel rank threads.
pub(crate) struct OwnedSeq {
    tokens: Vec<u32>,
    first_position: usize,
    prompt_len: usize,
    block_table: Vec<BlockId>,
    logit_rows: usize,
}

impl OwnedSeq {
    pub(crate) fn from_step(s: &StepSeq<'_>) -> Self {
        OwnedSeq {
            tokens: s.tokens.to_vec(),
            first_position: s.first_position,
            prompt_len: s.prompt_len,
            block_table: s.block_table.to_vec(),
            logit_rows: s.logit_rows,
        }
    }

    pub(crate) fn step(&self) -> StepSeq<'_> {
        StepSeq {
            tokens: &self.tokens,
            first_position: self.first_position,
            prompt_len: self.prompt_len,
            block_table: &self.block_table,
            logit_rows: self.logit_rows,
        }
    }
}

/// What a tensor-parallel rank thread answers for one step.
pub(crate) type RankResult = Result<Vec<f32>, BackendError>;

/// Every rank's answer to one step, in rank order: the first rank's logits (all ranks compute
/// the same), or the first error. Every rank answers every step (an error included), so the
/// channels stay in step.
pub(crate) fn join_ranks<'a>(
    results: impl Iterator<Item = &'a std::sync::mpsc::Receiver<RankResult>>,
) -> Result<Vec<f32>, BackendError> {
    let mut logits = None;
    let mut first_error = None;
    for rx in results {
        match rx.recv() {
            Ok(Ok(l)) => {
                logits.get_or_insert(l);
            }
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(_) => {
                first_error.get_or_insert(BackendError::Device(
                    "a tensor-parallel rank thread ended".into(),
                ));
            }
        }
    }
    match (first_error, logits) {
        (Some(e), _) => Err(e),
        (None, Some(l)) => Ok(l),
        (None, None) => Err(BackendError::Device("no tensor-parallel ranks".into())),
    }
}
