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
    let block_size = backend.block_size();
    let per_chunk = context.div_ceil(block_size);
    let parallel = (backend.num_blocks() / per_chunk).min(MAX_PARALLEL_CHUNKS);
    if parallel == 0 {
        return Err(EvalError::KvTooSmall {
            blocks: backend.num_blocks(),
            block_size,
            context,
        });
    }
    let vocab = backend.model_config().vocab_size;
    let first = context / 2;
    let mut result = Perplexity {
        context,
        chunks,
        scored: 0,
        nll: 0.0,
        running: Vec::with_capacity(chunks),
    };
    let chunk_tokens = |c: usize| {
        let mut t = tokens[c * context..(c + 1) * context].to_vec();
        if let Some(bos) = bos {
            t[0] = bos;
        }
        t
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
                    want_logits: end == head.len(),
                };
                let logits = backend.step(&[step])?;
                if end == head.len() {
                    nll[s] += neg_log_softmax(&logits[..vocab], text[first + 1]);
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
                    want_logits: true,
                })
                .collect();
            let logits = backend.step(&steps)?;
            for (s, row) in logits.chunks_exact(vocab).enumerate() {
                nll[s] += neg_log_softmax(row, texts[s][j + 1]);
            }
        }
        for n in nll {
            result.nll += n;
            result.scored += context - 1 - first;
            result.running.push(result.value());
        }
    }
    Ok(result)
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
}
