//! The CPU reference forward pass: the oracle.
//!
//! f32 throughout (weights widened from the checkpoint dtype), deterministic, and batch-invariant:
//! a token's logits do not depend on how many tokens were computed with it (see `ops`). One
//! decoder serves all four families; what differs between them is data in [`ModelConfig`]:
//! - Llama / Mistral: the plain pre-norm block (Mistral may restrict attention to a window);
//! - Qwen2: biases on the q/k/v projections;
//! - Qwen3: RMSNorm of each q and k head before the rotary embedding.

mod attention;
mod ops;
mod weights;

use std::path::Path;

pub use attention::{AttentionShape, causal_attention};
pub use ops::{Matrix, dot, dot_bf16, linear, rms_norm};
pub use weights::{CpuWeights, LayerWeights};

use crate::config::{ConfigError, ModelConfig};
use crate::rope::Rope;
use crate::weights::{Checkpoint, WeightError};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightError),
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ForwardError {
    #[error("token id {token} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange { token: u32, vocab_size: usize },
    #[error("{cached} cached + {new} new tokens exceed the context window of {window} positions")]
    ContextOverflow {
        cached: usize,
        new: usize,
        window: usize,
    },
    #[error("a forward pass needs at least one token")]
    Empty,
}

/// Which positions of a forward pass get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// Only the last token (decode, or the end of a prefill).
    Last,
    /// Every token of the pass (parity tests).
    All,
}

/// K and V of every layer for the positions seen so far, contiguous per layer.
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
    kv_dim: usize,
}

impl KvCache {
    pub fn new(config: &ModelConfig) -> Self {
        Self {
            k: vec![Vec::new(); config.num_layers],
            v: vec![Vec::new(); config.num_layers],
            len: 0,
            kv_dim: config.kv_dim(),
        }
    }

    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every position from `len` on.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            for layer in self.k.iter_mut().chain(self.v.iter_mut()) {
                layer.truncate(len * self.kv_dim);
            }
            self.len = len;
        }
    }
}

pub struct CpuModel {
    config: ModelConfig,
    weights: CpuWeights,
    rope: Rope,
}

impl CpuModel {
    /// Loads `dir/config.json` and the safetensors weights beside it.
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let config = ModelConfig::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        Ok(Self::from_checkpoint(config, &ckpt)?)
    }

    pub fn from_checkpoint(config: ModelConfig, ckpt: &Checkpoint) -> Result<Self, WeightError> {
        let weights = CpuWeights::load(&config, ckpt)?;
        let rope = Rope::new(&config);
        Ok(Self {
            config,
            weights,
            rope,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(&self.config)
    }

    /// Runs `tokens` at the positions following `cache`, appends their K/V to it, and returns the
    /// logits of the requested rows (`rows × vocab_size`, row-major).
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        rows: LogitRows,
    ) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 {
            return Err(ForwardError::Empty);
        }
        if cache.len + n > c.max_position_embeddings {
            return Err(ForwardError::ContextOverflow {
                cached: cache.len,
                new: n,
                window: c.max_position_embeddings,
            });
        }
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(ForwardError::TokenOutOfRange {
                token,
                vocab_size: c.vocab_size,
            });
        }
        let h = c.hidden_size;
        let mut x = vec![0.0; n * h];
        for (&t, row) in tokens.iter().zip(x.chunks_exact_mut(h)) {
            self.weights.embed.row_into(t as usize, h, row);
        }
        let (cos, sin) = self.rope_tables(cache.len, n);
        for (i, layer) in self.weights.layers.iter().enumerate() {
            self.layer(i, layer, &mut x, cache, &cos, &sin);
        }
        cache.len += n;

        let keep = match rows {
            LogitRows::Last => &x[(n - 1) * h..],
            LogitRows::All => &x[..],
        };
        let mut normed = vec![0.0; keep.len()];
        rms_norm(
            keep,
            &self.weights.final_norm,
            c.rms_norm_eps as f32,
            &mut normed,
        );
        let mut logits = vec![0.0; keep.len() / h * c.vocab_size];
        linear(&normed, self.weights.lm_head(), None, h, &mut logits);
        Ok(logits)
    }

    /// cos/sin for `n` positions from `first`, `n × head_dim/2` each.
    fn rope_tables(&self, first: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        let half = self.config.head_dim / 2;
        let mut cos = vec![0.0; n * half];
        let mut sin = vec![0.0; n * half];
        for (t, (c, s)) in cos
            .chunks_exact_mut(half)
            .zip(sin.chunks_exact_mut(half))
            .enumerate()
        {
            self.rope.cos_sin(first + t, c, s);
        }
        (cos, sin)
    }

    /// One pre-norm decoder block, updating the residual stream `x` (`n × hidden`) in place.
    fn layer(
        &self,
        index: usize,
        w: &LayerWeights,
        x: &mut [f32],
        cache: &mut KvCache,
        cos: &[f32],
        sin: &[f32],
    ) {
        let c = &self.config;
        let (h, qd, kvd, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.head_dim);
        let n = x.len() / h;
        let eps = c.rms_norm_eps as f32;

        let mut normed = vec![0.0; n * h];
        rms_norm(x, &w.input_norm, eps, &mut normed);
        let mut q = vec![0.0; n * qd];
        let mut k = vec![0.0; n * kvd];
        let mut v = vec![0.0; n * kvd];
        let bias = |i: usize| w.qkv_bias.as_ref().map(|b| b[i].as_slice());
        linear(&normed, &w.q, bias(0), h, &mut q);
        linear(&normed, &w.k, bias(1), h, &mut k);
        linear(&normed, &w.v, bias(2), h, &mut v);
        if let Some([qn, kn]) = &w.qk_norm {
            ops::rms_norm_in_place(&mut q, qn, eps);
            ops::rms_norm_in_place(&mut k, kn, eps);
        }
        let half = hd / 2;
        for t in 0..n {
            let (ct, st) = (
                &cos[t * half..(t + 1) * half],
                &sin[t * half..(t + 1) * half],
            );
            Rope::apply(&mut q[t * qd..(t + 1) * qd], hd, ct, st);
            Rope::apply(&mut k[t * kvd..(t + 1) * kvd], hd, ct, st);
        }
        cache.k[index].extend_from_slice(&k);
        cache.v[index].extend_from_slice(&v);

        let shape = AttentionShape {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: hd,
            sliding_window: c.sliding_window,
        };
        let mut attn = vec![0.0; n * qd];
        causal_attention(
            shape,
            &q,
            &cache.k[index],
            &cache.v[index],
            cache.len,
            &mut attn,
        );
        let mut o = vec![0.0; n * h];
        linear(&attn, &w.o, w.o_bias.as_deref(), qd, &mut o);
        ops::add_in_place(x, &o);

        rms_norm(x, &w.post_attention_norm, eps, &mut normed);
        let mut gate = vec![0.0; n * c.intermediate_size];
        let mut up = vec![0.0; n * c.intermediate_size];
        linear(&normed, &w.gate, None, h, &mut gate);
        linear(&normed, &w.up, None, h, &mut up);
        ops::silu_mul(&mut gate, &up);
        linear(&gate, &w.down, None, c.intermediate_size, &mut o);
        ops::add_in_place(x, &o);
    }
}
