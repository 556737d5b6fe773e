//! The CUDA backend: the same step interface as the CPU reference, on one GPU, through the
//! NVRTC kernels and cuBLASLt of `strata-kernels`.
//!
//! Numerics (DESIGN.md §3): weights and activations in bf16, f32 accumulation, the KV cache in
//! bf16 laid out per layer `[num_blocks, block_size, n_kv_heads, head_dim]`.
//!
//! Batch invariance is kept by giving every row a path that depends only on the row itself:
//! a row at a position inside its sequence's prompt is a *prompt row* (linear layers through the
//! cuBLASLt GEMM with one pinned algorithm per weight shape, attention through the prefill
//! kernel); a row at a generated position is a *decode row* (linear layers through the GEMV
//! kernel, attention through split-KV decode). Neither path's per-row arithmetic depends on how
//! many rows share the step, so a sequence's tokens are the same alone or in any batch, and a
//! preempted sequence recomputing its generated tokens takes the decode path again.

use std::sync::Arc;

use half::bf16;
use strata_kernels::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use strata_kernels::{
    AttentionHeads, DecodeBatch, GEMV_MAX_M, GemmOut, KernelError, Kernels, LtGemm, PagedKv,
    PrefillChunk, RopeKvShape, decode_workspace_elems,
};
use strata_model::ModelConfig;
use strata_model::rope::Rope;
use strata_model::weights::{Checkpoint, WeightError};

mod weights;

use super::{Backend, BackendError, StepSeq};
use crate::kv::{BlockId, KvBlockIo};
use weights::{Weights, synthesize, upload_checkpoint};

/// Why the CUDA backend could not start or run a step.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error("CUDA: {0}")]
    Driver(String),
    #[error(transparent)]
    Weights(#[from] WeightError),
    #[error("{0}")]
    Unsupported(String),
}

impl From<strata_kernels::cudarc::driver::DriverError> for CudaError {
    fn from(e: strata_kernels::cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e.to_string())
    }
}

/// Where the weights come from.
pub enum WeightSource<'a> {
    /// A checkpoint (bf16, f16 or f32 tensors; stored as bf16 on the device).
    Checkpoint(&'a Checkpoint),
    /// Random weights made on the device from `seed` (for benchmarks of shapes without files):
    /// projections drawn from a pool of N(0, 0.02²) values, norms 1, biases small.
    Synthetic { seed: u64 },
}

/// Options of a [`CudaBackend`].
#[derive(Debug, Clone)]
pub struct CudaOptions {
    /// CUDA device ordinal.
    pub device: usize,
    pub block_size: usize,
    /// Bytes of device memory for the KV cache.
    pub kv_cache_bytes: usize,
    /// Where compiled kernels are cached (default: the user cache directory).
    pub kernel_cache: Option<std::path::PathBuf>,
    /// Rows of the cos/sin table; positions beyond it are refused. Default: the context window.
    pub max_positions: Option<usize>,
}

/// Per-step device buffers, grown to the largest step seen.
#[derive(Default)]
struct Scratch {
    rows: usize,
    residual: Option<CudaSlice<bf16>>,
    normed: Option<CudaSlice<bf16>>,
    q: Option<CudaSlice<bf16>>,
    k: Option<CudaSlice<bf16>>,
    v: Option<CudaSlice<bf16>>,
    attn: Option<CudaSlice<bf16>>,
    proj: Option<CudaSlice<bf16>>,
    gate_up: Option<CudaSlice<bf16>>,
    act: Option<CudaSlice<bf16>>,
    logits_rows: usize,
    gathered: Option<CudaSlice<bf16>>,
    logits: Option<CudaSlice<f32>>,
    workspace: Option<CudaSlice<f32>>,
}

pub struct CudaBackend {
    config: ModelConfig,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    gemm: LtGemm,
    weights: Weights,
    k_cache: Vec<CudaSlice<bf16>>,
    v_cache: Vec<CudaSlice<bf16>>,
    cos_sin: CudaSlice<f32>,
    max_positions: usize,
    block_size: usize,
    num_blocks: usize,
    scratch: Scratch,
}

/// One row of a step, in device order (prompt rows first).
#[derive(Debug, Clone, Copy)]
struct Row {
    seq: usize,
    token: u32,
    position: usize,
    slot: u32,
}

impl CudaBackend {
    pub fn new(
        config: &ModelConfig,
        source: WeightSource<'_>,
        options: &CudaOptions,
    ) -> Result<Self, CudaError> {
        if options.block_size == 0 {
            return Err(CudaError::Unsupported(
                "block size must be at least 1".into(),
            ));
        }
        strata_kernels::libs::ensure_driver()?;
        let ctx = CudaContext::new(options.device)?;
        let stream = ctx.default_stream();
        let kernels = Kernels::load(&ctx, options.kernel_cache.as_deref())?;
        let gemm = LtGemm::new(&stream)?;
        let weights = match source {
            WeightSource::Checkpoint(ckpt) => {
                ckpt.validate(config)?;
                upload_checkpoint(&stream, config, ckpt)?
            }
            WeightSource::Synthetic { seed } => synthesize(&stream, config, seed)?,
        };
        let max_positions = options
            .max_positions
            .unwrap_or(config.max_position_embeddings)
            .min(config.max_position_embeddings)
            .max(1);
        let cos_sin = stream.clone_htod(&cos_sin_table(config, max_positions))?;

        let kv_dim = config.kv_dim();
        let per_block = config.num_layers * 2 * options.block_size * kv_dim * 2;
        let num_blocks = (options.kv_cache_bytes / per_block.max(1)).max(1);
        let mut k_cache = Vec::with_capacity(config.num_layers);
        let mut v_cache = Vec::with_capacity(config.num_layers);
        for _ in 0..config.num_layers {
            k_cache.push(stream.alloc_zeros::<bf16>(num_blocks * options.block_size * kv_dim)?);
            v_cache.push(stream.alloc_zeros::<bf16>(num_blocks * options.block_size * kv_dim)?);
        }
        let mut backend = Self {
            config: config.clone(),
            stream,
            kernels,
            gemm,
            weights,
            k_cache,
            v_cache,
            cos_sin,
            max_positions,
            block_size: options.block_size,
            num_blocks,
            scratch: Scratch::default(),
        };
        backend.pin_gemms()?;
        backend.stream.synchronize()?;
        Ok(backend)
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn device_name(&self) -> String {
        self.stream.context().name().unwrap_or_default()
    }

    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Chooses every GEMM algorithm now, so the first prompt does not pay for it.
    fn pin_gemms(&mut self) -> Result<(), CudaError> {
        let c = &self.config;
        let (h, q, kv, i) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        for (n, k) in [(q, h), (kv, h), (h, q), (2 * i, h), (h, i)] {
            self.gemm.pin(n, k, GemmOut::Bf16)?;
        }
        self.gemm.pin(c.vocab_size, h, GemmOut::F32)?;
        Ok(())
    }

    fn ensure_scratch(&mut self, rows: usize, logits_rows: usize) -> Result<(), CudaError> {
        let c = &self.config;
        let s = &mut self.scratch;
        let stream = &self.stream;
        if rows > s.rows {
            let alloc = |n: usize| stream.alloc_zeros::<bf16>(rows * n);
            s.residual = Some(alloc(c.hidden_size)?);
            s.normed = Some(alloc(c.hidden_size)?);
            s.q = Some(alloc(c.q_dim())?);
            s.k = Some(alloc(c.kv_dim())?);
            s.v = Some(alloc(c.kv_dim())?);
            s.attn = Some(alloc(c.q_dim())?);
            s.proj = Some(alloc(c.hidden_size)?);
            s.gate_up = Some(alloc(2 * c.intermediate_size)?);
            s.act = Some(alloc(c.intermediate_size)?);
            let work = decode_workspace_elems(rows, c.num_heads, c.head_dim, self.max_positions);
            s.workspace = Some(stream.alloc_zeros::<f32>(work.max(1))?);
            s.rows = rows;
        }
        if logits_rows > s.logits_rows {
            s.gathered = Some(stream.alloc_zeros::<bf16>(logits_rows * c.hidden_size)?);
            s.logits = Some(stream.alloc_zeros::<f32>(logits_rows * c.vocab_size)?);
            s.logits_rows = logits_rows;
        }
        Ok(())
    }

    fn run(&mut self, seqs: &[StepSeq<'_>]) -> Result<Vec<f32>, CudaError> {
        let c = self.config.clone();
        let bs = self.block_size;
        // Rows in device order: every sequence's prompt rows, then every decode row.
        let mut prompt_rows = Vec::new();
        let mut decode_rows = Vec::new();
        // Per prompt segment: (sequence, first row index in device order, rows).
        let mut segments: Vec<(usize, usize, usize)> = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            let start = prompt_rows.len();
            for (j, &token) in s.tokens.iter().enumerate() {
                let position = s.first_position + j;
                if position >= self.max_positions {
                    return Err(CudaError::Unsupported(format!(
                        "position {position} is beyond the {} positions this backend was \
                         started for",
                        self.max_positions
                    )));
                }
                let block = *s.block_table.get(position / bs).ok_or_else(|| {
                    CudaError::Unsupported(format!(
                        "block table of {} blocks cannot hold position {position}",
                        s.block_table.len()
                    ))
                })?;
                let row = Row {
                    seq: i,
                    token,
                    position,
                    slot: block * bs as u32 + (position % bs) as u32,
                };
                if position < s.prompt_len {
                    prompt_rows.push(row);
                } else {
                    decode_rows.push(row);
                }
            }
            if prompt_rows.len() > start {
                segments.push((i, start, prompt_rows.len() - start));
            }
        }
        let p = prompt_rows.len();
        let rows: Vec<Row> = prompt_rows.into_iter().chain(decode_rows).collect();
        let t = rows.len();
        if t == 0 {
            return Ok(Vec::new());
        }
        // The logits rows: each wanting sequence's last row, prompt-path rows first.
        let mut wanted: Vec<(usize, usize)> = Vec::new(); // (sequence, device row)
        for (i, s) in seqs.iter().enumerate() {
            if s.want_logits && !s.tokens.is_empty() {
                let last = s.first_position + s.tokens.len() - 1;
                let row = rows
                    .iter()
                    .position(|r| r.seq == i && r.position == last)
                    .expect("every token has a row");
                wanted.push((i, row));
            }
        }
        wanted.sort_by_key(|&(_, row)| (row >= p, row));
        let logits_prompt = wanted.iter().filter(|&&(_, row)| row < p).count();
        self.ensure_scratch(t, wanted.len())?;

        let stream = self.stream.clone();
        let ids = stream.clone_htod(&rows.iter().map(|r| r.token).collect::<Vec<_>>())?;
        let positions =
            stream.clone_htod(&rows.iter().map(|r| r.position as u32).collect::<Vec<_>>())?;
        let slots = stream.clone_htod(&rows.iter().map(|r| r.slot).collect::<Vec<_>>())?;
        // Decode rows' block tables, padded to the longest, and their context lengths.
        let decode = &rows[p..];
        let max_blocks = decode
            .iter()
            .map(|r| r.position / bs + 1)
            .max()
            .unwrap_or(1);
        let mut tables = vec![0u32; decode.len() * max_blocks];
        for (d, r) in decode.iter().enumerate() {
            let table = seqs[r.seq].block_table;
            let n = r.position / bs + 1;
            tables[d * max_blocks..d * max_blocks + n].copy_from_slice(&table[..n]);
        }
        let decode_tables = stream.clone_htod(&tables)?;
        let context_lens = stream.clone_htod(
            &decode
                .iter()
                .map(|r| r.position as u32 + 1)
                .collect::<Vec<_>>(),
        )?;
        let max_context = decode.iter().map(|r| r.position + 1).max().unwrap_or(1);
        let mut prefill_tables = Vec::with_capacity(segments.len());
        for &(i, first, n) in &segments {
            let last = rows[first + n - 1].position;
            let blocks = last / bs + 1;
            prefill_tables.push(stream.clone_htod(&seqs[i].block_table[..blocks])?);
        }
        let gather = stream.clone_htod(
            &wanted
                .iter()
                .map(|&(_, row)| row as u32)
                .collect::<Vec<_>>(),
        )?;

        let Self {
            kernels,
            gemm,
            weights,
            k_cache,
            v_cache,
            cos_sin,
            scratch,
            ..
        } = self;
        let s = scratch;
        let (h, qd, kvd, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let eps = c.rms_norm_eps as f32;
        let k = kernels;
        macro_rules! buf {
            ($name:ident) => {
                s.$name.as_mut().expect("scratch allocated")
            };
        }

        // Embedding into the residual stream, then the first norm.
        k.embed(
            &stream,
            buf!(residual),
            &weights.embed,
            &ids,
            t,
            h,
            c.vocab_size,
        )?;
        {
            let residual = s.residual.as_ref().expect("scratch allocated");
            k.rmsnorm(
                &stream,
                s.normed.as_mut().expect("scratch allocated"),
                residual,
                &weights.layers[0].input_norm,
                t,
                h,
                eps,
            )?;
        }
        let heads = AttentionHeads {
            n_q_heads: c.num_heads,
            n_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            window: c.sliding_window.unwrap_or(0),
            scale: 1.0 / (c.head_dim as f32).sqrt(),
        };
        let rope_shape = RopeKvShape {
            tokens: t,
            q_heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            max_positions: self.max_positions,
            num_blocks: self.num_blocks,
            block_size: bs,
        };
        for (l, layer) in weights.layers.iter().enumerate() {
            let normed = s.normed.as_ref().expect("scratch allocated");
            linear(k, gemm, &stream, buf!(q), normed, &layer.q, t, p, qd, h)?;
            linear(k, gemm, &stream, buf!(k), normed, &layer.k, t, p, kvd, h)?;
            linear(k, gemm, &stream, buf!(v), normed, &layer.v, t, p, kvd, h)?;
            if let Some([bq, bk, bv]) = &layer.qkv_bias {
                k.add_bias(&stream, buf!(q), bq, t, qd)?;
                k.add_bias(&stream, buf!(k), bk, t, kvd)?;
                k.add_bias(&stream, buf!(v), bv, t, kvd)?;
            }
            if let Some([nq, nk]) = &layer.qk_norm {
                k.head_rmsnorm(&stream, buf!(q), nq, t * c.num_heads, c.head_dim, eps)?;
                k.head_rmsnorm(&stream, buf!(k), nk, t * c.num_kv_heads, c.head_dim, eps)?;
            }
            {
                let (q, kk, v) = (
                    s.q.as_mut().expect("scratch allocated"),
                    s.k.as_mut().expect("scratch allocated"),
                    s.v.as_ref().expect("scratch allocated"),
                );
                k.rope_kv_write(
                    &stream,
                    q,
                    kk,
                    v,
                    &mut k_cache[l],
                    &mut v_cache[l],
                    cos_sin,
                    &positions,
                    &slots,
                    rope_shape,
                )?;
            }
            {
                let cache = PagedKv {
                    k: k_cache[l].as_view(),
                    v: v_cache[l].as_view(),
                    block_size: bs,
                    num_blocks: self.num_blocks,
                };
                let q = s.q.as_ref().expect("scratch allocated");
                let attn = s.attn.as_mut().expect("scratch allocated");
                for (seg, &(_, first, n)) in segments.iter().enumerate() {
                    let chunk = PrefillChunk {
                        q: q.slice(first * qd..(first + n) * qd),
                        block_table: prefill_tables[seg].as_view(),
                        start: rows[first].position,
                        n_new: n,
                    };
                    let mut out = attn.slice_mut(first * qd..(first + n) * qd);
                    k.prefill_attention(&stream, &heads, &cache, &chunk, &mut out)?;
                }
                if t > p {
                    let batch = DecodeBatch {
                        q: q.slice(p * qd..t * qd),
                        block_tables: decode_tables.as_view(),
                        max_blocks_per_seq: max_blocks,
                        context_lens: context_lens.as_view(),
                        max_context,
                    };
                    let work = decode_workspace_elems(t - p, c.num_heads, c.head_dim, max_context);
                    let mut workspace = s
                        .workspace
                        .as_mut()
                        .expect("scratch allocated")
                        .slice_mut(..work);
                    let mut out = attn.slice_mut(p * qd..t * qd);
                    k.decode_attention(&stream, &heads, &cache, &batch, &mut workspace, &mut out)?;
                }
            }
            {
                let attn = s.attn.as_ref().expect("scratch allocated");
                linear(k, gemm, &stream, buf!(proj), attn, &layer.o, t, p, h, qd)?;
            }
            if let Some(bias) = &layer.o_bias {
                k.add_bias(&stream, buf!(proj), bias, t, h)?;
            }
            {
                let (normed, residual, proj) = (
                    s.normed.as_mut().expect("scratch allocated"),
                    s.residual.as_mut().expect("scratch allocated"),
                    s.proj.as_ref().expect("scratch allocated"),
                );
                k.add_rmsnorm(&stream, normed, residual, proj, &layer.post_norm, t, h, eps)?;
            }
            {
                let normed = s.normed.as_ref().expect("scratch allocated");
                linear(
                    k,
                    gemm,
                    &stream,
                    buf!(gate_up),
                    normed,
                    &layer.gate_up,
                    t,
                    p,
                    2 * inter,
                    h,
                )?;
            }
            {
                let (act, gate_up) = (
                    s.act.as_mut().expect("scratch allocated"),
                    s.gate_up.as_ref().expect("scratch allocated"),
                );
                k.silu_mul(&stream, act, gate_up, t, inter)?;
            }
            {
                let act = s.act.as_ref().expect("scratch allocated");
                linear(
                    k,
                    gemm,
                    &stream,
                    buf!(proj),
                    act,
                    &layer.down,
                    t,
                    p,
                    h,
                    inter,
                )?;
            }
            let next_norm = weights
                .layers
                .get(l + 1)
                .map_or(&weights.final_norm, |next| &next.input_norm);
            let (normed, residual, proj) = (
                s.normed.as_mut().expect("scratch allocated"),
                s.residual.as_mut().expect("scratch allocated"),
                s.proj.as_ref().expect("scratch allocated"),
            );
            k.add_rmsnorm(&stream, normed, residual, proj, next_norm, t, h, eps)?;
        }

        // Logits of the wanted rows, through the path of each row's role.
        let r = wanted.len();
        if r == 0 {
            return Ok(Vec::new());
        }
        {
            let (gathered, normed) = (
                s.gathered.as_mut().expect("scratch allocated"),
                s.normed.as_ref().expect("scratch allocated"),
            );
            k.embed(&stream, gathered, normed, &gather, r, h, t)?;
        }
        let head = weights.lm_head.as_ref().unwrap_or(&weights.embed);
        let v = c.vocab_size;
        {
            let (logits, gathered) = (
                s.logits.as_mut().expect("scratch allocated"),
                s.gathered.as_ref().expect("scratch allocated"),
            );
            if logits_prompt > 0 {
                let mut y = logits.slice_mut(..logits_prompt * v);
                let x = gathered.slice(..logits_prompt * h);
                gemm.matmul(&mut y, &x, head, logits_prompt, v, h, GemmOut::F32)?;
            }
            let mut row = logits_prompt;
            while row < r {
                let m = (r - row).min(GEMV_MAX_M);
                let mut y = logits.slice_mut(row * v..(row + m) * v);
                let x = gathered.slice(row * h..(row + m) * h);
                k.gemv_f32(&stream, &mut y, &x, head, m, v, h)?;
                row += m;
            }
        }
        let mut host = vec![0f32; r * v];
        let logits = s.logits.as_ref().expect("scratch allocated");
        stream.memcpy_dtoh(&logits.slice(..r * v), &mut host)?;
        stream.synchronize()?;
        // Back to the order of `seqs`.
        let mut order: Vec<(usize, usize)> = wanted
            .iter()
            .enumerate()
            .map(|(j, &(seq, _))| (seq, j))
            .collect();
        order.sort_unstable();
        let mut out = Vec::with_capacity(r * v);
        for (_, j) in order {
            out.extend_from_slice(&host[j * v..(j + 1) * v]);
        }
        Ok(out)
    }
}

/// `y[rows, n] = x[rows, k] · wᵀ`: rows `..prompt` through the pinned GEMM, the rest through the
/// GEMV kernel in groups of at most [`GEMV_MAX_M`] (see the module docs).
#[allow(clippy::too_many_arguments)]
fn linear(
    kernels: &Kernels,
    gemm: &mut LtGemm,
    stream: &Arc<CudaStream>,
    y: &mut CudaSlice<bf16>,
    x: &CudaSlice<bf16>,
    w: &CudaSlice<bf16>,
    rows: usize,
    prompt: usize,
    n: usize,
    k: usize,
) -> Result<(), CudaError> {
    if prompt > 0 {
        let mut out = y.slice_mut(..prompt * n);
        let input = x.slice(..prompt * k);
        gemm.matmul(&mut out, &input, w, prompt, n, k, GemmOut::Bf16)?;
    }
    let mut row = prompt;
    while row < rows {
        let m = (rows - row).min(GEMV_MAX_M);
        let mut out = y.slice_mut(row * n..(row + m) * n);
        let input = x.slice(row * k..(row + m) * k);
        kernels.gemv(stream, &mut out, &input, w, m, n, k)?;
        row += m;
    }
    Ok(())
}

/// `[max_positions, head_dim]`: cos in the first half of a row, sin in the second, from the same
/// f64 angles as the CPU reference.
fn cos_sin_table(config: &ModelConfig, max_positions: usize) -> Vec<f32> {
    let rope = Rope::new(config);
    let half = config.head_dim / 2;
    let mut table = vec![0f32; max_positions * config.head_dim];
    let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
    for (p, row) in table.chunks_exact_mut(config.head_dim).enumerate() {
        rope.cos_sin(p, &mut cos, &mut sin);
        row[..half].copy_from_slice(&cos);
        row[half..].copy_from_slice(&sin);
    }
    table
}

impl KvBlockIo for CudaBackend {
    fn block_bytes(&self) -> usize {
        self.config.num_layers * 2 * self.block_size * self.config.kv_dim() * 2
    }

    /// Layout: `[layer][k|v][slot][kv_dim]` bf16, little-endian.
    fn export_block(&self, id: BlockId, out: &mut [u8]) {
        let n = self.block_size * self.config.kv_dim();
        let start = id as usize * n;
        let mut host = vec![bf16::ZERO; n];
        for (l, (k, v)) in self.k_cache.iter().zip(&self.v_cache).enumerate() {
            for (kind, cache) in [k, v].into_iter().enumerate() {
                self.stream
                    .memcpy_dtoh(&cache.slice(start..start + n), &mut host)
                    .expect("device-to-host copy of a KV block");
                self.stream.synchronize().expect("stream synchronize");
                let at = (l * 2 + kind) * n * 2;
                for (i, x) in host.iter().enumerate() {
                    out[at + 2 * i..at + 2 * i + 2].copy_from_slice(&x.to_le_bytes());
                }
            }
        }
    }

    fn import_block(&mut self, id: BlockId, data: &[u8]) {
        let n = self.block_size * self.config.kv_dim();
        let start = id as usize * n;
        for l in 0..self.config.num_layers {
            for kind in 0..2 {
                let at = (l * 2 + kind) * n * 2;
                let host: Vec<bf16> = data[at..at + n * 2]
                    .chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                    .collect();
                let cache = if kind == 0 {
                    &mut self.k_cache[l]
                } else {
                    &mut self.v_cache[l]
                };
                self.stream
                    .memcpy_htod(&host, &mut cache.slice_mut(start..start + n))
                    .expect("host-to-device copy of a KV block");
            }
        }
        self.stream.synchronize().expect("stream synchronize");
    }
}

impl Backend for CudaBackend {
    fn model_config(&self) -> &ModelConfig {
        &self.config
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn step(&mut self, seqs: &[StepSeq<'_>]) -> Result<Vec<f32>, BackendError> {
        self.run(seqs)
            .map_err(|e| BackendError::Device(e.to_string()))
    }
}
