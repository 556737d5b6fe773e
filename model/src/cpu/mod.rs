//! The CPU reference forward pass: the oracle.
//!
//! f32 throughout (weights widened from the checkpoint dtype), deterministic, and batch-invariant:
//! a token's logits do not depend on how many tokens were computed with it (see `ops`). One
//! decoder serves all four families; what differs between them is data in [`ModelConfig`]:
//! - Llama / Mistral: the plain pre-norm block (Mistral may restrict attention to a window);
//! - Qwen2: biases on the q/k/v projections;
//! - Qwen3: RMSNorm of each q and k head before the rotary embedding.
//!
//! The row-parallel projections (o and down) reduce in the canonical tensor-parallel order: as
//! [`ROW_PARALLEL_SHARDS`] contiguous K-shards added in shard order (`ops`), so [`TpShard`] ranks
//! reproduce this pass bit for bit.

mod attention;
mod moe;
mod ops;
mod tp;
mod weights;

use std::borrow::Cow;
use std::convert::Infallible;
use std::path::Path;

pub use attention::{AttentionShape, KvAccess, QueryPos, causal_attention};
pub use ops::{
    Matrix, ROW_PARALLEL_SHARDS, dot, dot_bf16, linear, linear_partials, linear_row_parallel,
    rms_norm, row_parallel_shards, sum_partials,
};
pub use tp::{PartialsFault, TpCollectives, TpError, TpLayout, TpShard};
pub use weights::{CpuWeights, GatedWeights, LayerWeights, MlpWeights};

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

/// The input a decoder block's Linear projections read: what calibration observes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinearInput {
    /// The input-normed rows q, k and v read.
    Attention,
    /// The attention output o reads.
    Output,
    /// The post-attention-normed rows gate and up read.
    Mlp,
    /// The gated activation down reads.
    Down,
}

impl LinearInput {
    /// The input the projection of `role` (`q`, `k`, `v`, `o`, `gate`, `up`, `down`) reads.
    pub fn of(role: &str) -> Option<Self> {
        Some(match role {
            "q" | "k" | "v" => Self::Attention,
            "o" => Self::Output,
            "gate" | "up" => Self::Mlp,
            "down" => Self::Down,
            _ => return None,
        })
    }
}

/// What a pass shows an observer: the layer, which input, and its rows (`n × width`).
pub type Observer<'a> = dyn FnMut(usize, LinearInput, &[f32]) + 'a;

/// Which positions of a forward pass get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// None (a prefill chunk that does not end the prompt).
    None,
    /// Only the last token (decode, or the end of a prefill).
    Last,
    /// The last `n` tokens (speculative verification: one row per proposed token and the row
    /// after them).
    Tail(usize),
    /// Every token of the pass (parity tests).
    All,
}

/// One sequence's share of a batched forward pass.
#[derive(Debug, Clone, Copy)]
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    /// Absolute position of `tokens[0]`; K/V of every earlier position must already be in the
    /// cache the pass reads.
    pub first_position: usize,
    pub logits: LogitRows,
}

/// K and V of one sequence, every layer, contiguous: the cache of single-sequence generation.
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

impl KvAccess for KvCache {
    fn key(&self, _seq: usize, layer: usize, position: usize) -> &[f32] {
        &self.k[layer][position * self.kv_dim..(position + 1) * self.kv_dim]
    }

    fn value(&self, _seq: usize, layer: usize, position: usize) -> &[f32] {
        &self.v[layer][position * self.kv_dim..(position + 1) * self.kv_dim]
    }

    fn key_run(&self, _seq: usize, layer: usize, position: usize) -> &[f32] {
        &self.k[layer][position * self.kv_dim..]
    }

    fn value_run(&self, _seq: usize, layer: usize, position: usize) -> &[f32] {
        &self.v[layer][position * self.kv_dim..]
    }

    fn write(&mut self, _seq: usize, layer: usize, position: usize, key: &[f32], value: &[f32]) {
        let end = (position + 1) * self.kv_dim;
        for (store, data) in [(&mut self.k[layer], key), (&mut self.v[layer], value)] {
            if store.len() < end {
                store.resize(end, 0.0);
            }
            store[end - self.kv_dim..end].copy_from_slice(data);
        }
    }
}

pub struct CpuModel {
    config: ModelConfig,
    weights: CpuWeights,
    ropes: Ropes,
}

/// The rope frequencies of a model: one set, or Gemma 3's two (its sliding-window layers
/// rotate with their own base).
#[derive(Debug, Clone)]
pub(crate) struct Ropes {
    global: Rope,
    local: Option<Rope>,
}

/// cos/sin rows of a pass's queries for every rope of a model ([`Ropes::tables`]).
pub(crate) struct RopeTables {
    global: (Vec<f32>, Vec<f32>),
    local: Option<(Vec<f32>, Vec<f32>)>,
}

impl Ropes {
    pub(crate) fn new(config: &ModelConfig) -> Self {
        Self {
            global: Rope::new(config),
            local: config
                .gemma3
                .as_ref()
                .map(|g| Rope::with_theta(config.head_dim, g.rope_local_theta, None)),
        }
    }

    pub(crate) fn tables(&self, head_dim: usize, queries: &[QueryPos]) -> RopeTables {
        RopeTables {
            global: rope_tables(&self.global, head_dim, queries),
            local: self
                .local
                .as_ref()
                .map(|rope| rope_tables(rope, head_dim, queries)),
        }
    }
}

impl RopeTables {
    /// The (cos, sin) rows layer `layer` rotates with.
    pub(crate) fn for_layer(&self, config: &ModelConfig, layer: usize) -> (&[f32], &[f32]) {
        let (cos, sin) = match &self.local {
            Some(local) if config.local_rope(layer) => local,
            _ => &self.global,
        };
        (cos, sin)
    }
}

/// Gemma 3 scales the embedded rows by √hidden (as transformers: rounded once to f32, one f32
/// product per element); other architectures leave them.
pub(crate) fn scale_embeddings(config: &ModelConfig, x: &mut [f32]) {
    if config.gemma3.is_some() {
        let scale = (config.hidden_size as f64).sqrt() as f32;
        x.iter_mut().for_each(|v| *v *= scale);
    }
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
        Ok(Self {
            ropes: Ropes::new(&config),
            config,
            weights,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Computes the checkpoint's activation quantization (W8A8, W4A4: each projection's input
    /// quantized and dequantized before its product, `crate::quantize::ActivationQuant`) instead
    /// of strata's weight-only arithmetic; returns how many projections quantize their input.
    pub fn quantize_activations(&mut self, ckpt: &Checkpoint) -> Result<usize, WeightError> {
        self.weights.quantize_activations(&self.config, ckpt)
    }

    /// Computes kept NVFP4's arithmetic, and with `fp8` kept FP8's (what the CUDA backend's
    /// tiles compute with `keep_quantized`), instead of the widened weights'
    /// (`CpuWeights::keep_tiled`); returns how many projections changed.
    pub fn keep_tiled(&mut self, ckpt: &Checkpoint, fp8: bool) -> Result<usize, WeightError> {
        self.weights.keep_tiled(&self.config, ckpt, fp8)
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
        let chunk = SeqChunk {
            tokens,
            first_position: cache.len,
            logits: rows,
        };
        let logits = self.forward_batch(&[chunk], cache)?;
        cache.len += tokens.len();
        Ok(logits)
    }

    /// One pass over several sequences' chunks: their tokens share every projection (row-wise, so
    /// each token's result is what it would be alone), attention reads each sequence's own K/V
    /// through `kv`. Returns the requested logit rows of all chunks, in order.
    pub fn forward_batch(
        &self,
        chunks: &[SeqChunk<'_>],
        kv: &mut dyn KvAccess,
    ) -> Result<Vec<f32>, ForwardError> {
        Ok(self.forward_batch_rows(chunks, &[], kv)?.logits)
    }

    /// [`CpuModel::forward_batch`], also returning the final hidden states (after the model's
    /// last norm, before the LM head) of the rows `hidden` asks per chunk (indexed like
    /// `chunks`; missing entries ask none): what embeddings pool.
    pub fn forward_batch_rows(
        &self,
        chunks: &[SeqChunk<'_>],
        hidden: &[LogitRows],
        kv: &mut dyn KvAccess,
    ) -> Result<PassRows, ForwardError> {
        self.pass(chunks, hidden, kv, &mut |_, _, _| {})
    }

    /// Runs `tokens` as one fresh sequence, showing `observe` every Linear projection's input
    /// rows, layer by layer (what `strata quantize --calibrate` measures activations with).
    pub fn observe_linear_inputs(
        &self,
        tokens: &[u32],
        observe: &mut Observer<'_>,
    ) -> Result<(), ForwardError> {
        let chunk = SeqChunk {
            tokens,
            first_position: 0,
            logits: LogitRows::None,
        };
        let mut cache = self.new_cache();
        self.pass(&[chunk], &[], &mut cache, observe).map(|_| ())
    }

    fn pass(
        &self,
        chunks: &[SeqChunk<'_>],
        hidden: &[LogitRows],
        kv: &mut dyn KvAccess,
        observe: &mut Observer<'_>,
    ) -> Result<PassRows, ForwardError> {
        let c = &self.config;
        let (tokens, queries) = validate_chunks(c, chunks)?;
        let h = c.hidden_size;
        let mut x = vec![0.0; tokens.len() * h];
        for (&t, row) in tokens.iter().zip(x.chunks_exact_mut(h)) {
            self.weights.embed.row_into(t as usize, h, row);
        }
        scale_embeddings(c, &mut x);
        let tables = self.ropes.tables(c.head_dim, &queries);
        let heads = LayerHeads {
            heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            inter: c.intermediate_size,
        };
        for (i, layer) in self.weights.layers.iter().enumerate() {
            let rope = tables.for_layer(c, i);
            let mut seen = |input, rows: &[f32]| observe(i, input, rows);
            // The whole model adds its shard partials itself: nothing can fail.
            let Ok(()) = decoder_layer(
                c, heads, i, layer, &mut x, &queries, kv, rope, &Whole, &mut seen,
            );
        }

        let keep = logit_rows(chunks, &x, h);
        let mut normed = vec![0.0; keep.len()];
        rms_norm(
            &keep,
            &self.weights.final_norm,
            c.rms_norm_eps as f32,
            &mut normed,
        );
        let mut logits = vec![0.0; keep.len() / h * c.vocab_size];
        linear(&normed, self.weights.lm_head(), None, h, &mut logits);
        let asked = chunks
            .iter()
            .enumerate()
            .map(|(i, chunk)| SeqChunk {
                logits: hidden.get(i).copied().unwrap_or(LogitRows::None),
                ..*chunk
            })
            .collect::<Vec<_>>();
        let keep = logit_rows(&asked, &x, h);
        let mut hidden = vec![0.0; keep.len()];
        rms_norm(
            &keep,
            &self.weights.final_norm,
            c.rms_norm_eps as f32,
            &mut hidden,
        );
        Ok(PassRows { logits, hidden })
    }
}

/// What one forward pass returns: the logits rows and the final hidden rows asked for.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PassRows {
    /// `vocab_size` values per logits row, in order.
    pub logits: Vec<f32>,
    /// `hidden_size` values per hidden row, in order.
    pub hidden: Vec<f32>,
}

/// The heads and intermediate rows a layer's weights hold: the whole model's, or a
/// tensor-parallel rank's share.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerHeads {
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) inter: usize,
}

/// What a layer's ranks share, and how: the whole model shares nothing; a tensor-parallel rank
/// gathers from its group (which can fail with `E`).
pub(crate) trait Group<E> {
    /// A row-parallel projection `y = x · wᵀ (+ bias)` over `k` input columns: the whole model
    /// adds its shard partials itself, a rank gathers them from the group first.
    fn row_parallel(
        &self,
        x: &[f32],
        w: &Matrix,
        bias: Option<&[f32]>,
        k: usize,
        y: &mut [f32],
    ) -> Result<(), E>;

    /// Completes the experts' weighted outputs `slots` (each rank wrote those of the experts it
    /// holds, `-0.0` elsewhere): summed element-wise over the ranks, which adds exactly one real
    /// value to identities. The whole model holds every expert: nothing to do.
    fn expert_outputs(&self, slots: &mut [f32]) -> Result<(), E>;
}

/// The whole model: every shard partial and every expert is here.
struct Whole;

impl Group<Infallible> for Whole {
    fn row_parallel(
        &self,
        x: &[f32],
        w: &Matrix,
        bias: Option<&[f32]>,
        k: usize,
        y: &mut [f32],
    ) -> Result<(), Infallible> {
        ops::linear_row_parallel(x, w, bias, k, y);
        Ok(())
    }

    fn expert_outputs(&self, _slots: &mut [f32]) -> Result<(), Infallible> {
        Ok(())
    }
}

/// One pre-norm decoder block over the weights `w` hold (the whole model's or a rank's),
/// updating the residual stream `x` (`n × hidden`) in place: the one layer forward of the CPU
/// reference, alone and under tensor parallelism (`group` is the only difference). `observe` is
/// shown each projection input as it is computed.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decoder_layer<E>(
    c: &ModelConfig,
    heads: LayerHeads,
    index: usize,
    w: &LayerWeights,
    x: &mut [f32],
    queries: &[QueryPos],
    kv: &mut dyn KvAccess,
    (cos, sin): (&[f32], &[f32]),
    group: &dyn Group<E>,
    observe: &mut dyn FnMut(LinearInput, &[f32]),
) -> Result<(), E> {
    let hd = c.head_dim;
    let (h, qd, kvd) = (c.hidden_size, heads.heads * hd, heads.kv_heads * hd);
    let n = x.len() / h;
    let eps = c.rms_norm_eps as f32;

    let (mut normed, mut q, mut k, v) = project_qkv(w, x, h, qd, kvd, eps);
    observe(LinearInput::Attention, &normed);
    rotate_and_cache(index, &mut q, &mut k, &v, queries, kv, hd, cos, sin);

    let shape = AttentionShape {
        num_heads: heads.heads,
        num_kv_heads: heads.kv_heads,
        head_dim: hd,
        sliding_window: c.layer_window(index),
        scale: c.attention_scale(),
    };
    let mut attn = vec![0.0; n * qd];
    causal_attention(shape, index, &q, queries, kv, &mut attn);
    let mut o = vec![0.0; n * h];
    observe(LinearInput::Output, &attn);
    group.row_parallel(
        &input(w, 3, &attn, qd),
        &w.o,
        w.o_bias.as_deref(),
        qd,
        &mut o,
    )?;
    if let Some([attn_out, _]) = &w.sandwich {
        ops::rms_norm_in_place(&mut o, attn_out, eps);
    }
    ops::add_in_place(x, &o);

    rms_norm(x, &w.post_attention_norm, eps, &mut normed);
    observe(LinearInput::Mlp, &normed);
    match &w.mlp {
        MlpWeights::Dense(m) => {
            let mut gate = vec![0.0; n * heads.inter];
            let mut up = vec![0.0; n * heads.inter];
            linear(&input(w, 4, &normed, h), &m.gate, None, h, &mut gate);
            linear(&input(w, 5, &normed, h), &m.up, None, h, &mut up);
            if c.gemma3.is_some() {
                ops::gelu_tanh_mul(&mut gate, &up);
            } else {
                ops::silu_mul(&mut gate, &up);
            }
            observe(LinearInput::Down, &gate);
            group.row_parallel(
                &input(w, 6, &gate, heads.inter),
                &m.down,
                None,
                heads.inter,
                &mut o,
            )?;
        }
        MlpWeights::Sparse {
            router,
            experts,
            shared,
        } => {
            let moe = c
                .moe
                .as_ref()
                .expect("sparse weights come from a MoE config");
            let weights = moe::SparseWeights {
                router,
                experts,
                shared: shared.as_ref(),
            };
            moe::sparse_mlp(moe, &weights, &normed, h, group, &mut o)?;
        }
    }
    if let Some([_, mlp_out]) = &w.sandwich {
        ops::rms_norm_in_place(&mut o, mlp_out, eps);
    }
    ops::add_in_place(x, &o);
    Ok(())
}

/// The input projection `i` of `w` (`LayerWeights::activations`' order) multiplies: `x` (rows of
/// `width`) itself, or quantized and dequantized as the checkpoint asks.
fn input<'a>(w: &LayerWeights, i: usize, x: &'a [f32], width: usize) -> Cow<'a, [f32]> {
    match &w.activations[i] {
        Some(quant) => Cow::Owned(quant.apply(x, width)),
        None => Cow::Borrowed(x),
    }
}

/// Checks every chunk against `config` and flattens them: the tokens of the pass and each one's
/// (sequence, position).
fn validate_chunks(
    config: &ModelConfig,
    chunks: &[SeqChunk<'_>],
) -> Result<(Vec<u32>, Vec<QueryPos>), ForwardError> {
    let mut queries = Vec::new();
    let mut tokens = Vec::new();
    for (seq, chunk) in chunks.iter().enumerate() {
        if chunk.tokens.is_empty() {
            return Err(ForwardError::Empty);
        }
        if chunk.first_position + chunk.tokens.len() > config.max_position_embeddings {
            return Err(ForwardError::ContextOverflow {
                cached: chunk.first_position,
                new: chunk.tokens.len(),
                window: config.max_position_embeddings,
            });
        }
        if let Some(&token) = chunk
            .tokens
            .iter()
            .find(|&&t| t as usize >= config.vocab_size)
        {
            return Err(ForwardError::TokenOutOfRange {
                token,
                vocab_size: config.vocab_size,
            });
        }
        tokens.extend_from_slice(chunk.tokens);
        queries.extend((0..chunk.tokens.len()).map(|i| QueryPos {
            seq,
            position: chunk.first_position + i,
        }));
    }
    if tokens.is_empty() {
        return Err(ForwardError::Empty);
    }
    Ok((tokens, queries))
}

/// cos/sin for each query's position, `head_dim/2` each.
fn rope_tables(rope: &Rope, head_dim: usize, queries: &[QueryPos]) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let mut cos = vec![0.0; queries.len() * half];
    let mut sin = vec![0.0; queries.len() * half];
    for ((c, s), q) in cos
        .chunks_exact_mut(half)
        .zip(sin.chunks_exact_mut(half))
        .zip(queries)
    {
        rope.cos_sin(q.position, c, s);
    }
    (cos, sin)
}

/// The attention inputs of a decoder block over the residual stream `x` (`n × hidden`): the
/// input-normed rows, then q, k and v (`qd`, `kvd` wide: the whole model's, or one rank's
/// heads) with their biases and q/k norms. Shared by the reference and its TP shards, so both
/// compute these in one order.
pub(crate) fn project_qkv(
    w: &LayerWeights,
    x: &[f32],
    h: usize,
    qd: usize,
    kvd: usize,
    eps: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let n = x.len() / h;
    let mut normed = vec![0.0; n * h];
    rms_norm(x, &w.input_norm, eps, &mut normed);
    let mut q = vec![0.0; n * qd];
    let mut k = vec![0.0; n * kvd];
    let mut v = vec![0.0; n * kvd];
    let bias = |i: usize| w.qkv_bias.as_ref().map(|b| b[i].as_slice());
    linear(&input(w, 0, &normed, h), &w.q, bias(0), h, &mut q);
    linear(&input(w, 1, &normed, h), &w.k, bias(1), h, &mut k);
    linear(&input(w, 2, &normed, h), &w.v, bias(2), h, &mut v);
    if let Some([qn, kn]) = &w.qk_norm {
        ops::rms_norm_in_place(&mut q, qn, eps);
        ops::rms_norm_in_place(&mut k, kn, eps);
    }
    (normed, q, k, v)
}

/// Applies the rotary embedding to each token's q and k heads and writes its K/V to the cache.
#[allow(clippy::too_many_arguments)]
fn rotate_and_cache(
    layer: usize,
    q: &mut [f32],
    k: &mut [f32],
    v: &[f32],
    queries: &[QueryPos],
    kv: &mut dyn KvAccess,
    head_dim: usize,
    cos: &[f32],
    sin: &[f32],
) {
    let (qd, kvd) = (q.len() / queries.len(), k.len() / queries.len());
    let half = head_dim / 2;
    for (t, query) in queries.iter().enumerate() {
        let (ct, st) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        Rope::apply(&mut q[t * qd..(t + 1) * qd], head_dim, ct, st);
        Rope::apply(&mut k[t * kvd..(t + 1) * kvd], head_dim, ct, st);
        let (kt, vt) = (&k[t * kvd..(t + 1) * kvd], &v[t * kvd..(t + 1) * kvd]);
        kv.write(query.seq, layer, query.position, kt, vt);
    }
}

/// The residual rows of `x` (`hidden` wide) that the chunks want logits for, in order.
fn logit_rows(chunks: &[SeqChunk<'_>], x: &[f32], hidden: usize) -> Vec<f32> {
    let mut keep = Vec::new();
    let mut start = 0;
    for chunk in chunks {
        let n = chunk.tokens.len();
        match chunk.logits {
            LogitRows::None => {}
            LogitRows::Last => {
                keep.extend_from_slice(&x[(start + n - 1) * hidden..(start + n) * hidden])
            }
            LogitRows::Tail(t) => {
                let t = t.min(n);
                keep.extend_from_slice(&x[(start + n - t) * hidden..(start + n) * hidden])
            }
            LogitRows::All => keep.extend_from_slice(&x[start * hidden..(start + n) * hidden]),
        }
        start += n;
    }
    keep
}
