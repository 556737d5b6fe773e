//! The scheduler's side of speculative decoding: which decoding sequences of a planned step
//! carry proposals, and how many (`crate::speculative` holds the proposers and the policy).

use super::{Planned, Scheduler};
use crate::backend::Backend;
use crate::kv::KvError;
use crate::speculative::{ProposeInput, choose};

/// What a step may propose: per decoding sequence of the plan, (plan entry, longest draft it
/// may take), and the step's decode rows and decoding sequences before proposals.
struct Candidates {
    entries: Vec<(usize, usize)>,
    base_rows: usize,
    decoding: usize,
}

impl Scheduler {
    /// Appends proposals to the decoding sequences of `plan` where they are expected to pay:
    /// each sequence's draft length follows its acceptance, within its `max_tokens`, the
    /// context window, the step's token budget and the blocks obtainable without preempting
    /// anyone; the proposer is asked only for the lengths expected to pay for their rows and its
    /// own measured rounds, and of what it proposes the step keeps the ones that raise its
    /// expected tokens per second by the measured cost of steps of that many rows ([`choose`]).
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
        spec.cost.set_group(backend.decode_rows_per_weight_read());
        let budget = self
            .limits
            .max_batch_tokens
            .saturating_sub(plan.iter().map(|p| p.chunk).sum());
        let mut c = self.candidates(plan);
        if c.entries.is_empty() || budget == 0 || !self.affordable(plan, &mut c) {
            return Ok(());
        }
        let lens = self.propose(plan, &c, backend);
        self.take_proposals(plan, &c.entries, &lens, budget, backend)
    }

    /// The decoding sequences of `plan` that may propose, and how many tokens each at most.
    fn candidates(&self, plan: &[Planned]) -> Candidates {
        let spec = self.speculator.as_ref().expect("speculating");
        let k = spec.config.num_speculative_tokens;
        // A sequence not yet verified is expected to accept what the engine's have so far
        // (smoothed: one rejection does not end speculation for everyone).
        let prior = spec.counters.prior();
        // The step's cost is priced by its decode rows (prompt chunks take the GEMM and are
        // not what proposals add to).
        let base_rows: usize = plan
            .iter()
            .filter(|p| {
                self.running[p.index].computed >= self.running[p.index].request.prompt.len()
            })
            .map(|p| p.chunk)
            .sum();
        let mut entries = Vec::new();
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
                entries.push((i, max));
            }
        }
        Candidates {
            entries,
            base_rows,
            decoding,
        }
    }

    /// Before paying for proposals: shortens `c`'s lengths to those expected to pay for the
    /// rows they add and for the proposer's rounds (a draft model's steps), were every proposal
    /// full-length; false when none does.
    fn affordable(&self, plan: &[Planned], c: &mut Candidates) -> bool {
        let spec = self.speculator.as_ref().expect("speculating");
        if spec.unconditional {
            return true;
        }
        let prior = spec.counters.prior();
        let round = spec.round_cost.estimate(c.entries.len()).unwrap_or(0.0);
        let mut drafts: Vec<(usize, f64)> = c
            .entries
            .iter()
            .map(|&(i, max)| (max, self.running[plan[i].index].acceptance.rate(prior)))
            .collect();
        choose(
            &spec.cost,
            c.base_rows,
            c.decoding as f64,
            &mut drafts,
            round,
        );
        for (e, d) in c.entries.iter_mut().zip(drafts) {
            e.1 = d.0;
        }
        c.entries.retain(|e| e.1 > 0);
        !c.entries.is_empty()
    }

    /// Asks the proposer for `c`'s drafts (into the speculator's buffers) and keeps the
    /// lengths that pay, by the costs measured so far, now that its rounds are paid; measures
    /// its rounds.
    fn propose(&mut self, plan: &[Planned], c: &Candidates, backend: &dyn Backend) -> Vec<usize> {
        let spec = self.speculator.as_mut().expect("speculating");
        let n = c.entries.len();
        if spec.drafts.len() < n {
            spec.drafts.resize_with(n, Vec::new);
        }
        let inputs: Vec<ProposeInput<'_>> = c
            .entries
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
        let started = std::time::Instant::now();
        spec.proposer.propose(&inputs, &mut spec.drafts[..n]);
        drop(inputs);
        let rounds = spec.drafts[..n].iter().map(Vec::len).max().unwrap_or(0);
        if rounds > 0 {
            let per_round = started.elapsed().as_secs_f64() / rounds as f64;
            spec.round_cost.observe(n, per_round);
        }
        // A proposal outside the target's vocabulary (a draft model's larger one) ends the draft.
        let vocab = backend.model_config().vocab_size;
        let mut lens: Vec<usize> = c
            .entries
            .iter()
            .zip(&spec.drafts)
            .map(|(&(_, max), d)| {
                let valid = d.iter().take_while(|&&t| (t as usize) < vocab).count();
                valid.min(max)
            })
            .collect();
        // (the gates' arm, `unconditional`: every proposal verified, whatever it costs)
        if !spec.unconditional {
            let prior = spec.counters.prior();
            let mut drafts: Vec<(usize, f64)> = c
                .entries
                .iter()
                .zip(&lens)
                .map(|(&(i, _), &n)| (n, self.running[plan[i].index].acceptance.rate(prior)))
                .collect();
            // (the proposer's rounds are paid by now)
            choose(&spec.cost, c.base_rows, c.decoding as f64, &mut drafts, 0.0);
            for (n, d) in lens.iter_mut().zip(drafts) {
                *n = d.0;
            }
        }
        lens
    }

    /// Appends each candidate's kept proposals (`lens`) to its sequence, within the step's token
    /// `budget` and the blocks obtainable without preempting anyone.
    fn take_proposals(
        &mut self,
        plan: &mut [Planned],
        entries: &[(usize, usize)],
        lens: &[usize],
        mut budget: usize,
        backend: &mut dyn Backend,
    ) -> Result<(), KvError> {
        let bs = self.blocks.block_size();
        for (c, &(i, _)) in entries.iter().enumerate() {
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
            let spec = self.speculator.as_mut().expect("speculating");
            let seq = &mut self.running[index];
            seq.tokens.extend_from_slice(&spec.drafts[c][..n]);
            seq.draft = n;
            plan[i].chunk += n;
            budget -= n;
        }
        Ok(())
    }
}
