//! Launchers for `cuda/sampling.cu`: greedy argmax and the row pass of seeded sampling on the
//! device.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};

use crate::launch::{grid, need_len, product, to_u32};
use crate::{KernelError, Kernels, ensure_shape};

const THREADS: u32 = 1024;

/// What [`Kernels::argmax`] writes for a row with no finite logit.
pub const NO_TOKEN: u32 = u32::MAX;

impl Kernels {
    /// `out[r] = argmax_i logits[r * stride + i]` for `r < rows`, `i < vocab`, in the CPU
    /// sampler's order (`strata_model::sampler::greedy_token`): NaN ranks as -inf and never wins,
    /// +inf ranks as `f32::MAX`, the lowest index among equal maxima; a row with no finite value
    /// gives [`NO_TOKEN`].
    ///
    /// `logits` `[rows, stride]` f32 (columns from `vocab` on are ignored), `out` `[rows]`;
    /// `1 ≤ vocab ≤ stride`. The result does not depend on how the row is split across threads
    /// (a total order is reduced).
    pub fn argmax(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<u32>,
        logits: &impl DevicePtr<f32>,
        rows: usize,
        vocab: usize,
        stride: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "argmax_f32";
        ensure_shape!(vocab > 0, K, "vocab is 0");
        ensure_shape!(
            vocab <= stride,
            K,
            "vocab {vocab} exceeds the row stride {stride}"
        );
        need_len(K, "out", out.len(), rows)?;
        if rows > 0 {
            let last = product(K, &[rows - 1, stride])? + vocab;
            need_len(K, "logits", logits.len(), last)?;
        }
        let (rows32, vocab32) = (to_u32(K, "rows", rows)?, to_u32(K, "vocab", vocab)?);
        let stride32 = to_u32(K, "stride", stride)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function("sampling", K)?;
        let (o, _o) = out.device_ptr_mut(stream);
        let (l, _l) = logits.device_ptr(stream);
        let mut b = stream.launch_builder(f);
        b.arg(&o).arg(&l).arg(&vocab32).arg(&stride32);
        // SAFETY: lengths and argument types checked above match the kernel.
        unsafe { b.launch(grid(rows32, THREADS)) }?;
        Ok(())
    }
}

/// u32 words per row plan of [`Kernels::sample_rows`] (`SamplePlan` in `cuda/sampling.cu`).
pub const SAMPLE_PLAN_WORDS: usize = 12;
/// u32 words per row head [`Kernels::sample_rows`] writes (`SampleHead`).
pub const SAMPLE_HEAD_WORDS: usize = 10;
/// u32 words per candidate (`SampleCandidate`: id, logit bits).
pub const SAMPLE_CANDIDATE_WORDS: usize = 2;
/// u32 words per shaping entry of [`Kernels::sample_shape`] (`ShapeEntry`: token, op, value bits).
pub const SHAPE_ENTRY_WORDS: usize = 3;

/// A shaping entry's phase; phases run in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ShapeOp {
    /// The logit becomes `-inf`.
    Mask = 0,
    /// `logit += value`.
    Add = 1,
    /// Repetition penalty: `logit > 0 ? logit / value : logit * value`.
    Penalize = 2,
    /// `logit -= value`.
    Subtract = 3,
}

/// One row's draw parameters, as `strata_model::sampler::row::DrawParams` holds them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplePlan {
    /// 0 = greedy.
    pub inv_t: f64,
    /// `-inf` = off.
    pub min_p_ln: f64,
    pub random: u64,
    /// Fixed point, `1 << 32` = off.
    pub top_p: u64,
    /// 0 = off.
    pub top_k: u32,
    pub logprobs: Option<u32>,
    /// The logits row to read.
    pub row: u32,
}

impl SamplePlan {
    /// Appends the plan's [`SAMPLE_PLAN_WORDS`] words.
    pub fn write(&self, out: &mut Vec<u32>) {
        for v in [
            self.inv_t.to_bits(),
            self.min_p_ln.to_bits(),
            self.random,
            self.top_p,
        ] {
            out.extend([v as u32, (v >> 32) as u32]);
        }
        out.extend([self.top_k, self.logprobs.unwrap_or(u32::MAX), self.row, 0]);
    }
}

/// What [`Kernels::sample_rows`] reports for a row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleHead {
    pub total: u64,
    pub total_unit: u64,
    pub max: f32,
    pub finite: u32,
    /// Greedy: the argmax; direct: the token drawn.
    pub chosen: Option<u32>,
    pub chosen_logit: f32,
    /// Candidates found; more than the list holds means the list overflowed.
    pub count: u32,
    /// No finite logit: nothing else is meaningful.
    pub no_finite: bool,
}

impl SampleHead {
    /// Reads one head from its [`SAMPLE_HEAD_WORDS`] words.
    pub fn read(w: &[u32]) -> Self {
        let u64_at = |i: usize| u64::from(w[i]) | (u64::from(w[i + 1]) << 32);
        Self {
            total: u64_at(0),
            total_unit: u64_at(2),
            max: f32::from_bits(w[4]),
            finite: w[5],
            chosen: (w[6] != NO_TOKEN).then_some(w[6]),
            chosen_logit: f32::from_bits(w[7]),
            count: w[8],
            no_finite: w[9] == 1,
        }
    }
}

impl Kernels {
    /// Applies each row's grammar bitmask and shaping entries in place. Row `b` is described by
    /// `rows[4 b .. 4 b + 4]` = (logits row, first entry, end entry, bitmask offset): tokens
    /// below `vocab` whose bit is clear in `words[offset ..]` (bit `i % 32` of word `i / 32`;
    /// offset `u32::MAX` = no bitmask) become `-inf`, then the entries `first..end` of `words` read
    /// as [`SHAPE_ENTRY_WORDS`]-word entries (token, op, value bits) apply phase by phase in
    /// [`ShapeOp`] order, with IEEE-rounded f32 arithmetic. Within a row and phase the tokens must
    /// be distinct; tokens below `vocab`, rows below the rows `logits` holds, offsets inside
    /// `words` (the caller built them: the kernel cannot check device contents).
    pub fn sample_shape(
        &self,
        stream: &Arc<CudaStream>,
        logits: &mut impl DevicePtrMut<f32>,
        stride: usize,
        vocab: usize,
        rows: &impl DevicePtr<u32>,
        words: &impl DevicePtr<u32>,
    ) -> Result<(), KernelError> {
        const K: &str = "sample_shape";
        ensure_shape!(
            vocab <= stride,
            K,
            "vocab {vocab} exceeds the row stride {stride}"
        );
        ensure_shape!(
            rows.len() % 4 == 0,
            K,
            "rows holds {} words, not 4 per row",
            rows.len()
        );
        let n = rows.len() / 4;
        let (n32, stride32) = (to_u32(K, "rows", n)?, to_u32(K, "stride", stride)?);
        let vocab32 = to_u32(K, "vocab", vocab)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("sampling", K)?;
        let (l, _l) = logits.device_ptr_mut(stream);
        let (r, _r) = rows.device_ptr(stream);
        let (w, _w) = words.device_ptr(stream);
        let mut b = stream.launch_builder(f);
        b.arg(&l).arg(&stride32).arg(&vocab32).arg(&r).arg(&w);
        // SAFETY: argument types match the kernel; indices are the caller's contract above.
        unsafe { b.launch(grid(n32, 256)) }?;
        Ok(())
    }

    /// The row pass of seeded sampling (`strata_model::sampler::row::RowSummary::of`), one block
    /// per row: for plan `b` ([`SAMPLE_PLAN_WORDS`] words of `plans`), reads
    /// `logits[plan.row * stride .. + vocab]` and writes its [`SampleHead`] to `heads` and up to
    /// `cap` candidates to `lists[b * cap ..]` ([`SAMPLE_CANDIDATE_WORDS`] words each, any order).
    /// `plans` and `heads` must be 8-byte aligned; every `plan.row` must be a row `logits` holds.
    #[allow(clippy::too_many_arguments)]
    pub fn sample_rows(
        &self,
        stream: &Arc<CudaStream>,
        heads: &mut impl DevicePtrMut<u32>,
        lists: &mut impl DevicePtrMut<u32>,
        cap: usize,
        logits: &impl DevicePtr<f32>,
        vocab: usize,
        stride: usize,
        plans: &impl DevicePtr<u32>,
        n: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "sample_rows";
        ensure_shape!(vocab > 0, K, "vocab is 0");
        ensure_shape!(
            vocab <= stride,
            K,
            "vocab {vocab} exceeds the row stride {stride}"
        );
        need_len(
            K,
            "heads",
            heads.len(),
            product(K, &[n, SAMPLE_HEAD_WORDS])?,
        )?;
        let list_words = product(K, &[n, cap, SAMPLE_CANDIDATE_WORDS])?;
        need_len(K, "lists", lists.len(), list_words)?;
        need_len(
            K,
            "plans",
            plans.len(),
            product(K, &[n, SAMPLE_PLAN_WORDS])?,
        )?;
        need_len(K, "logits", logits.len(), vocab)?;
        let (n32, cap32) = (to_u32(K, "rows", n)?, to_u32(K, "cap", cap)?);
        let (vocab32, stride32) = (to_u32(K, "vocab", vocab)?, to_u32(K, "stride", stride)?);
        if n == 0 {
            return Ok(());
        }
        let f = self.function("sampling", K)?;
        let (h, _h) = heads.device_ptr_mut(stream);
        let (li, _li) = lists.device_ptr_mut(stream);
        let (lo, _lo) = logits.device_ptr(stream);
        let (p, _p) = plans.device_ptr(stream);
        ensure_shape!(
            h % 8 == 0 && p % 8 == 0,
            K,
            "heads and plans must be 8-byte aligned"
        );
        let mut b = stream.launch_builder(f);
        b.arg(&h)
            .arg(&li)
            .arg(&cap32)
            .arg(&lo)
            .arg(&vocab32)
            .arg(&stride32)
            .arg(&p);
        // SAFETY: lengths and argument types checked above match the kernel; plan rows are the
        // caller's contract.
        unsafe { b.launch(grid(n32, THREADS)) }?;
        Ok(())
    }
}
