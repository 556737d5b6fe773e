//! A step's results back to the host: the greedy tokens reduced on the device (4 bytes a row),
//! the summaries of seeded-sampling rows (a few kilobytes a row), and the logits rows the host
//! still samples from, through the page-locked buffer.

use strata_kernels::{
    SAMPLE_CANDIDATE_WORDS, SAMPLE_HEAD_WORDS, SAMPLE_PLAN_WORDS, SHAPE_ENTRY_WORDS, SampleHead,
    SamplePlan, ShapeOp,
};
use strata_model::sampler::{RowPlan, RowSummary};

use super::{CudaBackend, CudaError, mark};

impl CudaBackend {
    /// The greedy token of each of the first `logits` rows of this (single) rank's logits,
    /// reduced on the device; only the tokens cross to the host.
    pub(super) fn greedy_tokens(&mut self, logits: usize) -> Result<Vec<u32>, CudaError> {
        let (v, per) = (self.config.vocab_size, self.shard.vocab_per_rank);
        let s = &mut self.scratch;
        if s.tokens.as_ref().is_none_or(|t| t.len() < logits) {
            s.tokens = Some(self.stream.alloc_zeros::<u32>(logits)?);
        }
        let tokens = s.tokens.as_mut().expect("allocated just above");
        let device = &s.logits.as_ref().ok_or_else(no_step)?.device;
        let mut view = tokens.slice_mut(..logits);
        self.kernels.argmax(
            &self.stream,
            &mut view,
            &device.slice(..logits * per),
            logits,
            v,
            per,
        )?;
        mark(&mut self.profile, &self.stream, "greedy")?;
        let mut host = vec![0u32; logits];
        self.stream
            .memcpy_dtoh(&tokens.slice(..logits), &mut host)?;
        self.stream.synchronize()?;
        Ok(host)
    }

    /// The final hidden states (the last norm's output, before the LM head) of device rows
    /// `rows`, in order, as f32: one copy of the range that holds them.
    pub(super) fn hidden_states(&mut self, rows: &[usize]) -> Result<Vec<f32>, CudaError> {
        let h = self.config.hidden_size;
        let (Some(&first), Some(&last)) = (rows.iter().min(), rows.iter().max()) else {
            return Ok(Vec::new());
        };
        let normed = &self.scratch.step()?.act.normed;
        let mut host = vec![half::bf16::ZERO; (last + 1 - first) * h];
        self.stream
            .memcpy_dtoh(&normed.slice(first * h..(last + 1) * h), &mut host)?;
        self.stream.synchronize()?;
        let mut out = Vec::with_capacity(rows.len() * h);
        for &row in rows {
            let at = (row - first) * h;
            out.extend(host[at..at + h].iter().map(|v| v.to_f32()));
        }
        Ok(out)
    }

    /// The logits rows of `order` (sequence, device row) that `skip` does not name, in order,
    /// through the page-locked buffer: every row in one copy when all are wanted, else row by
    /// row.
    pub(super) fn download_logits(
        &mut self,
        order: &[(usize, usize)],
        logits: usize,
        skip: impl Fn(usize) -> bool,
    ) -> Result<Vec<f32>, CudaError> {
        let v = self.config.vocab_size;
        let (world, per) = (self.shard.world, self.shard.vocab_per_rank);
        let kept: Vec<usize> = order
            .iter()
            .filter(|&&(seq, _)| !skip(seq))
            .map(|&(_, j)| j)
            .collect();
        if kept.is_empty() {
            // The greedy tokens' copy already waited for the stream.
            return Ok(Vec::new());
        }
        let buffers = self.scratch.logits()?;
        let (device, logits_host) = (
            buffers.all.as_ref().unwrap_or(&buffers.device),
            &mut buffers.host,
        );
        if kept.len() == order.len() || world > 1 {
            self.stream
                .memcpy_dtoh(&device.slice(..world * logits * per), logits_host)?;
        } else {
            // One rank: row `j` sits at `j * per`; copy just the kept rows to the same places.
            let host = logits_host.as_mut_slice()?;
            for &j in &kept {
                self.stream.memcpy_dtoh(
                    &device.slice(j * per..(j + 1) * per),
                    &mut host[j * per..(j + 1) * per],
                )?;
            }
        }
        // Event tracking is off, so the pinned slice cannot wait for its own copy: wait for the
        // stream before reading it.
        self.stream.synchronize()?;
        let host = logits_host.as_slice()?;
        // Rank `q`'s vocabulary columns of row `j` sit at `(q * logits + j) * per`.
        let mut out = Vec::with_capacity(kept.len() * v);
        for j in kept {
            for q in 0..world {
                let cols = (q * per).min(v)..((q + 1) * per).min(v);
                let at = (q * logits + j) * per;
                out.extend_from_slice(&host[at..at + cols.len()]);
            }
        }
        Ok(out)
    }
}

/// Candidates each summarized row can return; a row with more (a flat distribution under top-p,
/// a top-k above this) comes back whole and is summarized on the host instead.
const SUMMARY_CAP: usize = 1024;

impl CudaBackend {
    /// The [`RowSummary`] of each `(device row, plan)`, computed on the device: the plan's
    /// shaping applied to the row in place, then the row pass; a few kilobytes per row cross to
    /// the host. Equal to [`RowSummary::of`] the shaped row, bit for bit (the `gpu decode` gate).
    pub(super) fn row_summaries(
        &mut self,
        rows: &[(usize, &RowPlan)],
    ) -> Result<Vec<Option<RowSummary>>, CudaError> {
        let n = rows.len();
        let (v, per) = (self.config.vocab_size, self.shard.vocab_per_rank);
        let SampleInput {
            words,
            rows_at,
            words_at,
            shaping,
        } = sample_input(rows, v);
        let out_words = n * (SAMPLE_HEAD_WORDS + SUMMARY_CAP * SAMPLE_CANDIDATE_WORDS);
        let s = &mut self.scratch;
        if s.sample_in.as_ref().is_none_or(|b| b.len() < words.len()) {
            s.sample_in = Some(
                self.stream
                    .alloc_zeros::<u32>(words.len().next_power_of_two())?,
            );
        }
        if s.sample_out.as_ref().is_none_or(|b| b.len() < out_words) {
            s.sample_out = Some(self.stream.alloc_zeros::<u32>(out_words)?);
        }
        let input = s.sample_in.as_mut().expect("allocated just above");
        self.stream
            .memcpy_htod(&words, &mut input.slice_mut(..words.len()))?;
        let input = s.sample_in.as_ref().expect("allocated just above");
        let logits = &mut s.logits.as_mut().ok_or_else(no_step)?.device;
        if shaping {
            self.kernels.sample_shape(
                &self.stream,
                logits,
                per,
                v,
                &input.slice(rows_at..words_at),
                &input.slice(words_at..),
            )?;
        }
        let output = s.sample_out.as_mut().expect("allocated just above");
        let (mut heads, mut lists) = output.split_at_mut(n * SAMPLE_HEAD_WORDS);
        self.kernels.sample_rows(
            &self.stream,
            &mut heads,
            &mut lists,
            SUMMARY_CAP,
            logits,
            v,
            per,
            &input.slice(..rows_at),
            n,
        )?;
        mark(&mut self.profile, &self.stream, "sample")?;
        let mut host = vec![0u32; out_words];
        self.stream
            .memcpy_dtoh(&output.slice(..out_words), &mut host)?;
        self.stream.synchronize()?;

        self.read_summaries(rows, &host)
    }

    /// The rows' summaries from the sampling kernel's output read back (`host`): a row with
    /// more candidates than the list holds is read whole and summarized on the host.
    fn read_summaries(
        &mut self,
        rows: &[(usize, &RowPlan)],
        host: &[u32],
    ) -> Result<Vec<Option<RowSummary>>, CudaError> {
        let (n, v, per) = (
            rows.len(),
            self.config.vocab_size,
            self.shard.vocab_per_rank,
        );
        let (heads, lists) = host.split_at(n * SAMPLE_HEAD_WORDS);
        let mut summaries = Vec::with_capacity(n);
        for (b, &(row, plan)) in rows.iter().enumerate() {
            let head = SampleHead::read(&heads[b * SAMPLE_HEAD_WORDS..][..SAMPLE_HEAD_WORDS]);
            if head.no_finite {
                summaries.push(None);
                continue;
            }
            if head.count as usize > SUMMARY_CAP {
                // Too many candidates for the list: read the shaped row and summarize it here.
                let mut shaped = vec![0f32; v];
                let logits = &self.scratch.logits()?.device;
                self.stream
                    .memcpy_dtoh(&logits.slice(row * per..row * per + v), &mut shaped)?;
                self.stream.synchronize()?;
                summaries.push(RowSummary::of(&shaped, &plan.draw).ok());
                continue;
            }
            let list = &lists[b * SUMMARY_CAP * SAMPLE_CANDIDATE_WORDS..];
            let prefix = list
                .chunks_exact(SAMPLE_CANDIDATE_WORDS)
                .take(head.count as usize)
                .map(|c| (c[0], f32::from_bits(c[1])))
                .collect();
            summaries.push(Some(RowSummary {
                max: head.max,
                finite: head.finite,
                chosen: head.chosen.map(|t| (t, head.chosen_logit)),
                total: head.total,
                total_unit: head.total_unit,
                prefix,
            }));
        }
        Ok(summaries)
    }
}

/// One upload for the sampling kernels: the rows' plans, then per row its descriptor (logits
/// row, entry range, bitmask offset), then every shaping entry, then the grammar bitmasks.
struct SampleInput {
    words: Vec<u32>,
    /// Where the descriptors start, and the entries.
    rows_at: usize,
    words_at: usize,
    /// Whether any row has shaping entries or a bitmask.
    shaping: bool,
}

fn sample_input(rows: &[(usize, &RowPlan)], v: usize) -> SampleInput {
    let n = rows.len();
    let mut words: Vec<u32> = Vec::with_capacity(n * (SAMPLE_PLAN_WORDS + 2) + 1);
    for &(row, plan) in rows {
        let d = &plan.draw;
        SamplePlan {
            inv_t: d.inv_t,
            min_p_ln: d.min_p_ln,
            random: d.random,
            top_p: d.top_p,
            top_k: d.top_k,
            logprobs: d.logprobs,
            row: row as u32,
        }
        .write(&mut words);
    }
    // Per row: logits row, its entries' range, its bitmask's offset (after every entry).
    let rows_at = words.len();
    let mut entries: Vec<u32> = Vec::new();
    let mut bitmasks: Vec<u32> = Vec::new();
    let mut shaping = false;
    let entries_len: usize = rows
        .iter()
        .map(|(_, p)| p.masked.len() + p.bias.len() + p.penalized.len() + p.subtract.len())
        .sum::<usize>()
        * SHAPE_ENTRY_WORDS;
    for &(row, plan) in rows {
        let first = (entries.len() / SHAPE_ENTRY_WORDS) as u32;
        let in_row = |t: u32| (t as usize) < v;
        let mut push = |token: u32, op: ShapeOp, value: f32| {
            if in_row(token) {
                entries.extend([token, op as u32, value.to_bits()]);
            }
        };
        plan.masked
            .iter()
            .for_each(|&t| push(t, ShapeOp::Mask, 0.0));
        plan.bias
            .iter()
            .for_each(|&(t, b)| push(t, ShapeOp::Add, b));
        for &t in &plan.penalized {
            push(t, ShapeOp::Penalize, plan.penalty);
        }
        plan.subtract
            .iter()
            .for_each(|&(t, a)| push(t, ShapeOp::Subtract, a));
        let end = (entries.len() / SHAPE_ENTRY_WORDS) as u32;
        let bits_at = match &plan.allowed {
            Some(bits) => {
                // The kernel reads `v` bits: a shorter mask allows nothing past its end.
                let at = entries_len + bitmasks.len();
                bitmasks.extend(
                    bits.iter()
                        .copied()
                        .chain(std::iter::repeat(0))
                        .take(v.div_ceil(32)),
                );
                at as u32
            }
            None => u32::MAX,
        };
        shaping |= end > first || bits_at != u32::MAX;
        words.extend([row as u32, first, end, bits_at]);
    }
    let words_at = words.len();
    words.extend_from_slice(&entries);
    words.resize(words_at + entries_len, 0);
    words.extend_from_slice(&bitmasks);
    words.push(0); // never an empty buffer
    SampleInput {
        words,
        rows_at,
        words_at,
        shaping,
    }
}

fn no_step() -> CudaError {
    CudaError::Unsupported("logits were read before any step ran".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_model::sampler::DrawParams;

    fn plan(masked: Vec<u32>, bias: Vec<(u32, f32)>, allowed: Option<Vec<u32>>) -> RowPlan {
        RowPlan {
            draw: DrawParams {
                inv_t: 1.0,
                top_k: 0,
                top_p: 0,
                min_p_ln: f64::NEG_INFINITY,
                logprobs: None,
                random: 7,
            },
            allowed,
            masked,
            bias,
            penalty: 1.0,
            penalized: Vec::new(),
            subtract: Vec::new(),
        }
    }

    /// The upload's layout: plans, descriptors, entries (tokens outside the vocabulary dropped,
    /// their room kept), bitmasks padded to the vocabulary.
    #[test]
    fn sample_input_lays_out_plans_descriptors_entries_and_bitmasks() {
        let v = 40;
        let a = plan(vec![3, 99], vec![(5, 0.5)], None);
        let b = plan(Vec::new(), Vec::new(), Some(vec![0b1011]));
        let input = sample_input(&[(2, &a), (0, &b)], v);
        assert_eq!(input.rows_at, 2 * SAMPLE_PLAN_WORDS);
        assert_eq!(input.words_at, input.rows_at + 2 * 4);
        assert!(input.shaping);
        let desc = &input.words[input.rows_at..input.words_at];
        // Row 2: entries 0..2 (token 99 is past the vocabulary), no bitmask.
        assert_eq!(desc[..4], [2, 0, 2, u32::MAX]);
        // Row 0: no entries; its bitmask after the three entries' room.
        assert_eq!(desc[4..], [0, 2, 2, 3 * SHAPE_ENTRY_WORDS as u32]);
        let entries = &input.words[input.words_at..];
        assert_eq!(entries[..3], [3, ShapeOp::Mask as u32, 0]);
        assert_eq!(entries[3..6], [5, ShapeOp::Add as u32, 0.5f32.to_bits()]);
        // The bitmask: one word given, two words for 40 tokens, then the closing zero.
        assert_eq!(entries[9..], [0b1011, 0, 0]);
        // Nothing to shape: the kernel is skipped.
        let plain = plan(Vec::new(), Vec::new(), None);
        assert!(!sample_input(&[(0, &plain)], v).shaping);
    }
}
