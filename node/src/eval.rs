//! Model quality measured through a backend's own steps: perplexity over a token stream, on
//! whatever device the backend runs.
//!
//! The method is llama.cpp's `llama-perplexity`, so the two numbers compare directly: the text's
//! tokens (with the BOS the model adds, if any) are cut into chunks of `context` tokens (a partial
//! last chunk is dropped); when the model adds BOS, each chunk's first token is replaced by it; every chunk is evaluated from its start and
//! only its second half is scored (position `j` for `j` in `context/2 .. context-1` predicts token
//! `j + 1`), so every scored token sees at least half a context. Perplexity is
//! `exp(mean negative log-likelihood)` over all scored tokens, with log-softmax in f64.
//!
//! Only a backend's last-token logits are needed: a chunk's first half is prefilled, then its
//! second half is fed one token per step, with several chunks decoding side by side.

use crate::backend::{Backend, BackendError, StepSeq};
use crate::kv::BlockId;

/// Prompt tokens one sequence computes per step while a chunk is prefilled.
const PREFILL_PIECE: usize = 256;
/// Chunks that decode side by side (KV blocks permitting).
const MAX_PARALLEL_CHUNKS: usize = 16;

/// Why a perplexity run could not be made.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("the context must be at least 4 tokens, got {0}")]
    Context(usize),
    #[error(
        "the text is {tokens} tokens, less than one context of {context}: give a longer text or \
         a smaller --context"
    )]
    TooShort { tokens: usize, context: usize },
    #[error(
        "the KV cache holds {blocks} blocks of {block_size} tokens, less than one context of \
         {context}: give it more memory"
    )]
    KvTooSmall {
        blocks: usize,
        block_size: usize,
        context: usize,
    },
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// The outcome of [`perplexity`].
#[derive(Debug, Clone, PartialEq)]
pub struct Perplexity {
    pub context: usize,
    pub chunks: usize,
    /// Tokens whose likelihood was scored.
    pub scored: usize,
    /// Sum of −ln p over the scored tokens.
    pub nll: f64,
    /// Perplexity after each chunk (the running value llama.cpp prints).
    pub running: Vec<f64>,
}

impl Perplexity {
    pub fn value(&self) -> f64 {
        (self.nll / self.scored as f64).exp()
    }
}

/// Perplexity of `tokens` under the backend's model, chunked as described in the module docs.
/// `bos`: the id that replaces each chunk's first token, when the model adds BOS. `max_chunks`
/// limits the run to the text's first chunks.
pub fn perplexity(
    backend: &mut dyn Backend,
    tokens: &[u32],
    context: usize,
    bos: Option<u32>,
    max_chunks: Option<usize>,
) -> Result<Perplexity, EvalError> {
    let mut nll = 0.0;
    let (chunks, scored, running) = schedule(
        &mut [backend],
        tokens,
        (context, bos, max_chunks),
        |rows, target| {
            let n = neg_log_softmax(rows[0], target);
            nll += n;
            n
        },
    )?;
    Ok(Perplexity {
        context,
        chunks,
        scored,
        nll,
        running,
    })
}

/// How a candidate model's next-token distributions differ from a reference's over the same
/// scored positions ([`compare`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    pub context: usize,
    pub chunks: usize,
    pub scored: usize,
    /// Sums of −ln p of the text's tokens under the reference and the candidate.
    pub reference_nll: f64,
    pub candidate_nll: f64,
    /// Sum over scored positions of KL(reference ‖ candidate), in nats.
    pub kl: f64,
    /// The largest KL at one position.
    pub kl_max: f64,
    /// Positions where both models' most likely next token is the same.
    pub top1_agreements: usize,
}

impl Comparison {
    pub fn mean_kl(&self) -> f64 {
        self.kl / self.scored as f64
    }

    pub fn top1_agreement(&self) -> f64 {
        self.top1_agreements as f64 / self.scored as f64
    }

    pub fn perplexities(&self) -> (f64, f64) {
        let n = self.scored as f64;
        (
            (self.reference_nll / n).exp(),
            (self.candidate_nll / n).exp(),
        )
    }
}

/// Runs `reference` and `candidate` (the same tokenizer and vocabulary) over the positions
/// [`perplexity`] scores, side by side: both perplexities, KL(reference ‖ candidate) per position
/// and how often their most likely tokens agree.
pub fn compare(
    reference: &mut dyn Backend,
    candidate: &mut dyn Backend,
    tokens: &[u32],
    context: usize,
    bos: Option<u32>,
    max_chunks: Option<usize>,
) -> Result<Comparison, EvalError> {
    let (mut ref_nll, mut cand_nll, mut kl, mut kl_max, mut agree) = (0.0, 0.0, 0.0, 0.0f64, 0);
    let (chunks, scored, _) = schedule(
        &mut [reference, candidate],
        tokens,
        (context, bos, max_chunks),
        |rows, target| {
            let (p, q) = (log_softmax(rows[0]), log_softmax(rows[1]));
            ref_nll -= p[target as usize];
            cand_nll -= q[target as usize];
            let d: f64 = p.iter().zip(&q).map(|(lp, lq)| lp.exp() * (lp - lq)).sum();
            kl += d;
            kl_max = kl_max.max(d);
            agree += usize::from(argmax(rows[0]) == argmax(rows[1]));
            -p[target as usize]
        },
    )?;
    Ok(Comparison {
        context,
        chunks,
        scored,
        reference_nll: ref_nll,
        candidate_nll: cand_nll,
        kl,
        kl_max,
        top1_agreements: agree,
    })
}

/// How far two models' greedy continuations of the same prompts agree ([`greedy_agreement`]):
/// each model continues each prompt with its own most likely tokens, `length` of them.
#[derive(Debug, Clone, PartialEq)]
pub struct GreedyAgreement {
    pub length: usize,
    /// Per prompt, how many leading tokens the two continuations share (`length` when equal).
    pub shared_prefix: Vec<usize>,
    /// Per prompt, the positions where the two continuations hold the same token.
    pub same_positions: Vec<usize>,
    /// Per prompt that diverged, the reference's margin between its chosen token and the
    /// candidate's choice at the first divergence (in logits): near zero is a near-tie.
    pub divergence_margins: Vec<f32>,
}

impl GreedyAgreement {
    /// Prompts whose `length` tokens are identical.
    pub fn identical(&self) -> usize {
        self.shared_prefix
            .iter()
            .filter(|&&n| n == self.length)
            .count()
    }

    /// The mean length of the shared prefix, over prompts.
    pub fn mean_shared_prefix(&self) -> f64 {
        self.shared_prefix.iter().sum::<usize>() as f64 / self.shared_prefix.len().max(1) as f64
    }

    /// The fraction of generated positions holding the same token.
    pub fn positional(&self) -> f64 {
        let total = self.length * self.same_positions.len();
        self.same_positions.iter().sum::<usize>() as f64 / total.max(1) as f64
    }
}

/// Greedy continuations of `length` tokens of every prompt by `reference` and by `candidate`
/// (the same tokenizer and vocabulary), compared token by token.
pub fn greedy_agreement(
    reference: &mut dyn Backend,
    candidate: &mut dyn Backend,
    prompts: &[Vec<u32>],
    length: usize,
) -> Result<GreedyAgreement, EvalError> {
    let (theirs, _) = greedy(candidate, prompts, length, |_, _, _| 0.0)?;
    // The reference runs second, keeping at each position the margin between its choice and the
    // candidate's: up to a divergence both saw the same context, so the margin there says how
    // close the two choices were.
    let (ours, margins) = greedy(reference, prompts, length, |p, i, row| {
        row[argmax(row)] - row[theirs[p][i] as usize]
    })?;
    let mut agreement = GreedyAgreement {
        length,
        shared_prefix: Vec::with_capacity(prompts.len()),
        same_positions: Vec::with_capacity(prompts.len()),
        divergence_margins: Vec::new(),
    };
    for (p, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        let prefix = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        agreement.shared_prefix.push(prefix);
        agreement
            .same_positions
            .push(a.iter().zip(b).filter(|(x, y)| x == y).count());
        if prefix < length {
            agreement.divergence_margins.push(margins[p][prefix]);
        }
    }
    Ok(agreement)
}

/// Per prompt, its generated tokens and what the observer returned at each.
type Continuations = (Vec<Vec<u32>>, Vec<Vec<f32>>);

/// Each prompt continued greedily (first index of the largest logit) for `length` tokens, all
/// prompts side by side as the KV blocks allow; with `observe(prompt, i, logits)` of each
/// generated position `i`.
fn greedy(
    backend: &mut dyn Backend,
    prompts: &[Vec<u32>],
    length: usize,
    mut observe: impl FnMut(usize, usize, &[f32]) -> f32,
) -> Result<Continuations, EvalError> {
    let block_size = backend.block_size();
    let vocab = backend.model_config().vocab_size;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0) + length;
    let per_seq = longest.div_ceil(block_size);
    let parallel = (backend.num_blocks() / per_seq.max(1)).min(MAX_PARALLEL_CHUNKS);
    if parallel == 0 {
        return Err(EvalError::KvTooSmall {
            blocks: backend.num_blocks(),
            block_size,
            context: longest,
        });
    }
    if prompts.iter().any(Vec::is_empty) {
        return Err(EvalError::Context(0));
    }
    let (mut outputs, mut observed) = (Vec::new(), Vec::new());
    for (g, group) in prompts.chunks(parallel).enumerate() {
        let first = g * parallel;
        let tables: Vec<Vec<BlockId>> = (0..group.len())
            .map(|s| {
                let start = (s * per_seq) as BlockId;
                (start..start + per_seq as BlockId).collect()
            })
            .collect();
        let mut texts: Vec<Vec<u32>> = group.to_vec();
        let mut seen: Vec<Vec<f32>> = vec![Vec::with_capacity(length); group.len()];
        // Each prompt prefilled in pieces; the last piece's logits choose the first token.
        for (s, prompt) in group.iter().enumerate() {
            let mut at = 0;
            while at < prompt.len() {
                let end = (at + PREFILL_PIECE).min(prompt.len());
                let step = StepSeq {
                    tokens: &prompt[at..end],
                    first_position: at,
                    prompt_len: prompt.len(),
                    block_table: &tables[s],
                    logit_rows: usize::from(end == prompt.len()),
                };
                let out = backend.step(&[step])?;
                if end == prompt.len() {
                    let row = &out[..vocab];
                    texts[s].push(argmax(row) as u32);
                    seen[s].push(observe(first + s, 0, row));
                }
                at = end;
            }
        }
        // Then every sequence one generated token per step.
        for i in 1..length {
            let out = {
                let steps: Vec<StepSeq<'_>> = texts
                    .iter()
                    .zip(group)
                    .zip(&tables)
                    .map(|((text, prompt), table)| StepSeq {
                        tokens: &text[text.len() - 1..],
                        first_position: text.len() - 1,
                        prompt_len: prompt.len(),
                        block_table: table,
                        logit_rows: 1,
                    })
                    .collect();
                backend.step(&steps)?
            };
            for (s, text) in texts.iter_mut().enumerate() {
                let row = &out[s * vocab..(s + 1) * vocab];
                text.push(argmax(row) as u32);
                seen[s].push(observe(first + s, i, row));
            }
        }
        for (text, prompt) in texts.into_iter().zip(group) {
            outputs.push(text[prompt.len()..].to_vec());
        }
        observed.extend(seen);
    }
    Ok((outputs, observed))
}

/// The chunk schedule of the module docs over every backend of `backends` at once (same steps,
/// same block tables): `score(rows, target)` gets each backend's logits row for a scored
/// position and the token that follows, and returns the −ln p the running perplexity adds.
/// Returns the chunks, the scored positions and the running perplexity after each chunk.
fn schedule(
    backends: &mut [&mut dyn Backend],
    tokens: &[u32],
    (context, bos, max_chunks): (usize, Option<u32>, Option<usize>),
    mut score: impl FnMut(&[&[f32]], u32) -> f64,
) -> Result<(usize, usize, Vec<f64>), EvalError> {
    if context < 4 {
        return Err(EvalError::Context(context));
    }
    let mut chunks = tokens.len() / context;
    if chunks == 0 {
        return Err(EvalError::TooShort {
            tokens: tokens.len(),
            context,
        });
    }
    if let Some(max) = max_chunks {
        chunks = chunks.min(max.max(1));
    }
    let block_size = backends[0].block_size();
    let per_chunk = context.div_ceil(block_size);
    let blocks = backends.iter().map(|b| b.num_blocks()).min().unwrap_or(0);
    let parallel = (blocks / per_chunk).min(MAX_PARALLEL_CHUNKS);
    if parallel == 0 {
        return Err(EvalError::KvTooSmall {
            blocks,
            block_size,
            context,
        });
    }
    let vocab = backends[0].model_config().vocab_size;
    let first = context / 2;
    let (mut scored, mut total, mut running) = (0, 0.0f64, Vec::with_capacity(chunks));
    let chunk_tokens = |c: usize| {
        let mut t = tokens[c * context..(c + 1) * context].to_vec();
        if let Some(bos) = bos {
            t[0] = bos;
        }
        t
    };
    // One step on every backend: each one's logits.
    let mut step_all = |steps: &[StepSeq<'_>]| -> Result<Vec<Vec<f32>>, EvalError> {
        backends
            .iter_mut()
            .map(|b| b.step(steps).map_err(EvalError::from))
            .collect()
    };
    for group in (0..chunks).collect::<Vec<_>>().chunks(parallel) {
        let texts: Vec<Vec<u32>> = group.iter().map(|&c| chunk_tokens(c)).collect();
        let tables: Vec<Vec<BlockId>> = (0..group.len())
            .map(|s| {
                let start = (s * per_chunk) as BlockId;
                (start..start + per_chunk as BlockId).collect()
            })
            .collect();
        // The first half and one more token, in pieces; the last piece's logits score `first`.
        let mut nll = vec![0.0f64; group.len()];
        for (s, text) in texts.iter().enumerate() {
            let head = &text[..=first];
            let mut at = 0;
            while at < head.len() {
                let end = (at + PREFILL_PIECE).min(head.len());
                let step = StepSeq {
                    tokens: &head[at..end],
                    first_position: at,
                    prompt_len: first + 1,
                    block_table: &tables[s],
                    logit_rows: usize::from(end == head.len()),
                };
                let logits = step_all(&[step])?;
                if end == head.len() {
                    let rows: Vec<&[f32]> = logits.iter().map(|l| &l[..vocab]).collect();
                    nll[s] += score(&rows, text[first + 1]);
                }
                at = end;
            }
        }
        // Then one token per step for every chunk of the group, side by side.
        for j in first + 1..context - 1 {
            let steps: Vec<StepSeq<'_>> = texts
                .iter()
                .zip(&tables)
                .map(|(text, table)| StepSeq {
                    tokens: &text[j..=j],
                    first_position: j,
                    prompt_len: first + 1,
                    block_table: table,
                    logit_rows: 1,
                })
                .collect();
            let logits = step_all(&steps)?;
            for (s, text) in texts.iter().enumerate() {
                let rows: Vec<&[f32]> = logits
                    .iter()
                    .map(|l| &l[s * vocab..(s + 1) * vocab])
                    .collect();
                nll[s] += score(&rows, text[j + 1]);
            }
        }
        for n in nll {
            total += n;
            scored += context - 1 - first;
            running.push((total / scored as f64).exp());
        }
    }
    Ok((chunks, scored, running))
}

/// ln softmax(row), in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    let norm = max + sum.ln();
    row.iter().map(|&v| v as f64 - norm).collect()
}

/// The first index of the largest value.
fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 { (i, v) } else { best }
        })
        .0
}

/// −ln softmax(row)[target], in f64.
fn neg_log_softmax(row: &[f32], target: u32) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    max + sum.ln() - row[target as usize] as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;
    use strata_model::cpu::{CpuModel, LogitRows};
    use strata_model::synth::{SynthSpec, synthesize};

    fn model(dir: &std::path::Path) -> CpuModel {
        let spec = SynthSpec::tiny(strata_model::config::Architecture::Llama, 3);
        synthesize(&spec, dir, None).unwrap();
        CpuModel::load(dir).unwrap()
    }

    /// The stepped evaluation equals scoring one full forward pass per chunk.
    #[test]
    fn equals_a_full_forward_per_chunk() {
        let tmp = tempfile::tempdir().unwrap();
        let reference = model(tmp.path());
        let vocab = reference.config().vocab_size;
        let tokens: Vec<u32> = (0..100u32).map(|i| (i * 37 + 11) % vocab as u32).collect();
        let (context, bos) = (24, Some(1));
        let mut backend = CpuBackend::new(model(tmp.path()), 4, 4 << 20);
        let got = perplexity(&mut backend, &tokens, context, bos, None).unwrap();
        assert_eq!(got.chunks, 4);
        assert_eq!(got.scored, 4 * (context - 1 - context / 2));

        let mut nll = 0.0;
        for c in 0..4 {
            let mut t = tokens[c * context..(c + 1) * context].to_vec();
            t[0] = 1;
            let mut cache = reference.new_cache();
            let all = reference.forward(&t, &mut cache, LogitRows::All).unwrap();
            for j in context / 2..context - 1 {
                nll += neg_log_softmax(&all[j * vocab..(j + 1) * vocab], t[j + 1]);
            }
        }
        let want = (nll / got.scored as f64).exp();
        assert!(
            (got.value() - want).abs() <= 1e-6 * want,
            "{} vs {want}",
            got.value()
        );
        assert_eq!(got.running.len(), 4);
        assert!((got.running[3] - got.value()).abs() < 1e-12);
    }

    /// A model against itself: no divergence, full agreement, one perplexity; against a model
    /// with a perturbed rope base (the canary): a divergence and a different perplexity.
    #[test]
    fn compare_measures_divergence_and_agreement() {
        let tmp = tempfile::tempdir().unwrap();
        let m = model(tmp.path());
        let vocab = m.config().vocab_size;
        let tokens: Vec<u32> = (0..100u32).map(|i| (i * 37 + 11) % vocab as u32).collect();
        let mut a = CpuBackend::new(model(tmp.path()), 4, 4 << 20);
        let mut b = CpuBackend::new(model(tmp.path()), 4, 4 << 20);
        let same = compare(&mut a, &mut b, &tokens, 24, Some(1), None).unwrap();
        assert_eq!(same.kl, 0.0);
        assert_eq!(same.top1_agreement(), 1.0);
        let (p, q) = same.perplexities();
        assert_eq!(p, q);
        let alone = perplexity(&mut a, &tokens, 24, Some(1), None).unwrap();
        assert!(
            (alone.value() - p).abs() <= 1e-9 * p,
            "{} vs {p}",
            alone.value()
        );

        let mut config = m.config().clone();
        config.rope_theta *= 3.0;
        let ckpt = strata_model::weights::Checkpoint::open(tmp.path()).unwrap();
        let perturbed = CpuModel::from_checkpoint(config, &ckpt).unwrap();
        let mut c = CpuBackend::new(perturbed, 4, 4 << 20);
        let differ = compare(&mut a, &mut c, &tokens, 24, Some(1), None).unwrap();
        assert!(differ.mean_kl() > 1e-4, "{}", differ.mean_kl());
        assert!(differ.kl_max >= differ.mean_kl());
        assert_ne!(differ.perplexities().0, differ.perplexities().1);
        assert_eq!(differ.perplexities().0, p);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let tmp = tempfile::tempdir().unwrap();
        let mut backend = CpuBackend::new(model(tmp.path()), 4, 4 << 20);
        assert!(matches!(
            perplexity(&mut backend, &[1; 10], 2, None, None),
            Err(EvalError::Context(2))
        ));
        assert!(matches!(
            perplexity(&mut backend, &[1; 10], 16, None, None),
            Err(EvalError::TooShort { .. })
        ));
        let mut small = CpuBackend::new(model(tmp.path()), 4, 1 << 10);
        assert!(matches!(
            perplexity(&mut small, &[1; 4000], 2048, None, None),
            Err(EvalError::KvTooSmall { .. })
        ));
    }

    /// Greedy continuations equal recomputing the whole text at every token; a model agrees with
    /// itself everywhere; a perturbed model (the canary) diverges, each divergence with the
    /// reference's margin for its own choice (never negative).
    #[test]
    fn greedy_agreement_follows_each_models_own_continuation() {
        let tmp = tempfile::tempdir().unwrap();
        let m = model(tmp.path());
        let vocab = m.config().vocab_size as u32;
        let prompts: Vec<Vec<u32>> = (0..5u32)
            .map(|p| (0..7 + p).map(|i| (i * 31 + p * 17 + 3) % vocab).collect())
            .collect();
        let length = 12;
        // Two sequences' blocks at a time: the prompts run in three groups.
        let mut a = CpuBackend::new(model(tmp.path()), 4, 4 << 20);
        let per_seq = (prompts[4].len() + length).div_ceil(4);
        let mut narrow = CpuBackend::with_blocks(model(tmp.path()), 4, 2 * per_seq + 1);
        let (ours, _) = greedy(&mut narrow, &prompts, length, |_, _, _| 0.0).unwrap();
        for (prompt, got) in prompts.iter().zip(&ours) {
            let mut text = prompt.clone();
            for _ in 0..length {
                let mut cache = m.new_cache();
                let last = m.forward(&text, &mut cache, LogitRows::Last).unwrap();
                text.push(argmax(&last[..vocab as usize]) as u32);
            }
            assert_eq!(&text[prompt.len()..], got.as_slice());
        }

        let mut b = CpuBackend::new(model(tmp.path()), 4, 4 << 20);
        let same = greedy_agreement(&mut a, &mut b, &prompts, length).unwrap();
        assert_eq!(same.identical(), prompts.len());
        assert_eq!(same.positional(), 1.0);
        assert!(same.divergence_margins.is_empty());

        let mut config = m.config().clone();
        config.rope_theta *= 3.0;
        let ckpt = strata_model::weights::Checkpoint::open(tmp.path()).unwrap();
        let mut c = CpuBackend::new(
            CpuModel::from_checkpoint(config, &ckpt).unwrap(),
            4,
            4 << 20,
        );
        let differ = greedy_agreement(&mut a, &mut c, &prompts, length).unwrap();
        assert!(differ.identical() < prompts.len(), "{differ:?}");
        assert!(differ.positional() < 1.0);
        assert_eq!(
            differ.divergence_margins.len(),
            prompts.len() - differ.identical()
        );
        assert!(
            differ.divergence_margins.iter().all(|&m| m >= 0.0),
            "{differ:?}"
        );
    }
}
