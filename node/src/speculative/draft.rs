//! Draft-model proposals: a smaller checkpoint with the target's tokenizer, run on a backend of
//! its own (the same device, its own paged KV), proposes greedily.
//!
//! Per sequence the draft keeps the tokens whose K/V it holds. Before proposing it keeps the
//! longest prefix they share with the sequence's committed tokens (the target may have rejected
//! what the draft proposed last time: those slots are past the prefix and overwritten), computes
//! the rest in one chunk, then one greedy token per step until the draft length; every sequence
//! asking shares each of those steps. The draft's arithmetic never reaches the output: a poor or
//! failing draft costs speed only (a draft step that fails proposes nothing, and is logged).

use std::collections::HashMap;

use crate::backend::{Backend, RowSampling, StepSeq};
use crate::kv::BlockId;

use super::{ProposeInput, Proposer};

pub struct DraftModelProposer {
    backend: Box<dyn Backend>,
    free: Vec<BlockId>,
    seqs: HashMap<u64, DraftSeq>,
}

#[derive(Default)]
struct DraftSeq {
    /// Tokens whose K/V the draft holds at their positions (and, during a proposal, the ones
    /// being computed).
    tokens: Vec<u32>,
    blocks: Vec<BlockId>,
}

impl DraftModelProposer {
    pub fn new(backend: Box<dyn Backend>) -> Self {
        let free = (0..backend.num_blocks() as BlockId).rev().collect();
        Self {
            backend,
            free,
            seqs: HashMap::new(),
        }
    }

    /// Makes `seq` hold blocks for `len` positions; false when the draft's pool ran out.
    fn reserve(free: &mut Vec<BlockId>, seq: &mut DraftSeq, len: usize, bs: usize) -> bool {
        while seq.blocks.len() < len.div_ceil(bs) {
            match free.pop() {
                Some(b) => seq.blocks.push(b),
                None => return false,
            }
        }
        true
    }
}

impl Proposer for DraftModelProposer {
    fn name(&self) -> &'static str {
        "draft_model"
    }

    fn propose(&mut self, inputs: &[ProposeInput<'_>], out: &mut [Vec<u32>]) {
        let bs = self.backend.block_size();
        let vocab = self.backend.model_config().vocab_size;
        // Catch up: keep the shared prefix, compute the rest (at least the last token, whose
        // logits propose the first token).
        let mut active: Vec<usize> = Vec::new();
        let mut starts: Vec<usize> = Vec::new();
        let mut shared_of = vec![0; inputs.len()];
        for (i, input) in inputs.iter().enumerate() {
            out[i].clear();
            if input.max == 0 || input.tokens.is_empty() {
                continue;
            }
            let seq = self.seqs.entry(input.id).or_default();
            let shared = seq
                .tokens
                .iter()
                .zip(input.tokens)
                .take_while(|(a, b)| a == b)
                .count()
                .min(input.tokens.len() - 1);
            seq.tokens.truncate(shared);
            seq.tokens.extend_from_slice(&input.tokens[shared..]);
            if !Self::reserve(&mut self.free, seq, seq.tokens.len() + input.max - 1, bs) {
                // No room in the draft's cache: this sequence decodes without proposals.
                seq.tokens.truncate(shared);
                continue;
            }
            active.push(i);
            starts.push(shared);
            shared_of[i] = shared;
        }
        let mut round = 0;
        while !active.is_empty() {
            let steps: Vec<StepSeq<'_>> = active
                .iter()
                .zip(&starts)
                .map(|(&i, &start)| {
                    let seq = &self.seqs[&inputs[i].id];
                    StepSeq {
                        tokens: &seq.tokens[start..],
                        first_position: start,
                        // The draft's rows need no particular path: catch-up chunks take the
                        // prompt path (fast for long prompts), single rows the decode path.
                        prompt_len: if round == 0 { seq.tokens.len() } else { start },
                        block_table: &seq.blocks,
                        logit_rows: 1,
                    }
                })
                .collect();
            let sampling = vec![RowSampling::Greedy; steps.len()];
            let tokens = match self.backend.step_sampling(&steps, &sampling) {
                Ok(output) if output.tokens.len() == steps.len() => output.tokens,
                Ok(output) => {
                    tracing::warn!(
                        "the draft model returned {} tokens for {} sequences",
                        output.tokens.len(),
                        steps.len()
                    );
                    break;
                }
                Err(e) => {
                    tracing::warn!("the draft model's step failed: {e}");
                    break;
                }
            };
            drop(steps);
            let mut next = Vec::with_capacity(active.len());
            let mut next_starts = Vec::with_capacity(active.len());
            for (&i, token) in active.iter().zip(tokens) {
                let Some(token) = token.filter(|&t| (t as usize) < vocab) else {
                    continue;
                };
                out[i].push(token);
                let seq = self
                    .seqs
                    .get_mut(&inputs[i].id)
                    .expect("an active sequence");
                if out[i].len() < inputs[i].max {
                    next_starts.push(seq.tokens.len());
                    seq.tokens.push(token);
                    next.push(i);
                }
            }
            active = next;
            starts = next_starts;
            round += 1;
        }
        // The draft's tokens end at the last one computed: the last proposal was never fed
        // back, and what a failed step was given is dropped (without a proposal, only the
        // shared prefix is sure).
        for (i, input) in inputs.iter().enumerate() {
            if let Some(seq) = self.seqs.get_mut(&input.id) {
                let computed = match out[i].len() {
                    0 => shared_of[i],
                    n => input.tokens.len() + n - 1,
                };
                seq.tokens.truncate(computed);
            }
        }
    }

    fn forget(&mut self, id: u64) {
        if let Some(seq) = self.seqs.remove(&id) {
            self.free.extend(seq.blocks);
        }
    }
}
