//! The scheduler's side of speculative decoding: which decoding sequences of a planned step
//! carry proposals, and how many (`crate::speculative` holds the proposers and the policy).

use super::{Planned, Scheduler};
use crate::backend::Backend;
use crate::kv::KvError;
use crate::speculative::{ProposeInput, choose};

impl Scheduler {
    /// Appends proposals to the decoding sequences of `plan` where they are expected to pay:
    /// each sequence's draft length follows its acceptance, within its `max_tokens`, the
    /// context window, the step's token budget and the blocks obtainable without preempting
    /// anyone; of those, the step keeps the ones that raise its expected tokens per second by the
    /// measured cost of steps of that many rows ([`choose`]).
    pub(super) fn speculate(
        &mut self,
        plan: &mut [Planned],
        backend: &mut dyn Backend,
    ) -> Result<(), KvError> {
        let Some(spec) = self.speculator.as_mut() else {
            return Ok(());
        };
        if spec
            .config
            .disable_by_batch_size
            .is_some_and(|n| self.running.len() > n)
        {
            return Ok(());
        }
        let k = spec.config.num_speculative_tokens;
        // A sequence not yet verified is expected to accept what the engine's have so far
        // (smoothed: one rejection does not end speculation for everyone).
        let prior = spec.counters.prior();
        let base_rows: usize = plan.iter().map(|p| p.chunk).sum();
        let mut budget = self.limits.max_batch_tokens.saturating_sub(base_rows);
        // (plan entry, longest draft it may take)
        let mut candidates: Vec<(usize, usize)> = Vec::new();
        let mut decoding = 0usize;
        for (i, p) in plan.iter().enumerate() {
            let s = &self.running[p.index];
            if p.chunk != 1 || s.pending() != 1 || s.request.embed.is_some() {
                continue;
            }
            decoding += 1;
            let left = s.request.sampling.max_tokens.saturating_sub(s.generated) as usize;
            let room = self.context_window.saturating_sub(s.tokens.len());
            let max = s
                .acceptance
                .draft_len(k, prior)
                .min(left.saturating_sub(1))
                .min(room);
            if max > 0 {
                candidates.push((i, max));
            }
        }
        if candidates.is_empty() || budget == 0 {
            return Ok(());
        }
        if spec.drafts.len() < candidates.len() {
            spec.drafts.resize_with(candidates.len(), Vec::new);
        }
        let inputs: Vec<ProposeInput<'_>> = candidates
            .iter()
            .map(|&(i, max)| {
                let s = &self.running[plan[i].index];
                ProposeInput {
                    id: s.id,
                    tokens: &s.tokens,
                    max,
                }
            })
            .collect();
        spec.proposer
            .propose(&inputs, &mut spec.drafts[..candidates.len()]);
        drop(inputs);
        // A proposal outside the target's vocabulary (a draft model's larger one) ends the draft.
        let vocab = backend.model_config().vocab_size;
        let mut lens: Vec<usize> = candidates
            .iter()
            .zip(&spec.drafts)
            .map(|(&(_, max), d)| {
                let valid = d.iter().take_while(|&&t| (t as usize) < vocab).count();
                valid.min(max)
            })
            .collect();
        // Only the proposals that pay, by the costs measured so far, stay in the step.
        if spec.unconditional {
            // (the gates' arm: every proposal verified, whatever it costs)
        } else {
            let mut drafts: Vec<(usize, f64)> = candidates
                .iter()
                .zip(&lens)
                .map(|(&(i, _), &n)| (n, self.running[plan[i].index].acceptance.rate(prior)))
                .collect();
            choose(&spec.cost, base_rows, decoding as f64, &mut drafts);
            for (n, d) in lens.iter_mut().zip(drafts) {
                *n = d.0;
            }
        }
        let bs = self.blocks.block_size();
        for (c, &(i, _)) in candidates.iter().enumerate() {
            let index = plan[i].index;
            let seq = &self.running[index];
            // Blocks beyond those held: only what can be had without preempting.
            let held = seq.blocks.len() + self.blocks.obtainable();
            let fits = (held * bs).saturating_sub(seq.tokens.len());
            let n = lens[c].min(budget).min(fits);
            if n == 0 {
                continue;
            }
            if !self.reserve(index, 1 + n, backend)? {
                // Obtainable said otherwise; the sequence decodes its one token.
                continue;
            }
            let spec = self.speculator.as_mut().expect("checked above");
            let seq = &mut self.running[index];
            seq.tokens.extend_from_slice(&spec.drafts[c][..n]);
            seq.draft = n;
            plan[i].chunk += n;
            budget -= n;
        }
        Ok(())
    }
}
