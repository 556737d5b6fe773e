//! The CUDA backend's weights on the device: read from a checkpoint (converted to bf16) or
//! synthesized for benchmarks of shapes without files.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Instant;

use half::bf16;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;
use std::ops::Range;
use strata_kernels::BlockFormat;
use strata_kernels::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};
use strata_kernels::tiles::TileFormat;

use strata_model::ModelConfig;
use strata_model::cpu::TpLayout;
use strata_model::weights::{
    Checkpoint, GatedMlp, LayerSpec, MlpSpec, TensorRef, TensorSpec, WeightDtype, embed_spec,
    final_norm_spec, lm_head_spec,
};

use super::CudaError;
use super::moe::{Experts, Mlp};
use super::quant_blocks::{HostTiles, gate_up_tiles, safetensors_blocks, tiles_of};

/// A projection's weight on the device, `[n, k]` row-major (the HF Linear layout): bf16, or a
/// GGUF block format kept as stored (each row `format.row_bytes(k)` bytes), which the block
/// kernels dequantize in registers to the bf16 the widening would give, or NVFP4 / FP8 in
/// fragment-ordered tiles with one output scale per row (`strata_kernels::tiles`: their own
/// arithmetic, the tensor's or channel's scale applied once per output).
pub(super) enum Matrix {
    Bf16(CudaSlice<bf16>),
    Blocks {
        format: BlockFormat,
        data: CudaSlice<u8>,
    },
    Tiles {
        format: TileFormat,
        data: CudaSlice<u8>,
        scales: CudaSlice<f32>,
    },
}

impl Matrix {
    /// Bytes on the device.
    pub(super) fn bytes(&self) -> usize {
        match self {
            Matrix::Bf16(w) => w.len() * 2,
            Matrix::Blocks { data, .. } => data.len(),
            Matrix::Tiles { data, scales, .. } => data.len() + scales.len() * 4,
        }
    }

    /// The quantized format, `None` for bf16 (tiles report their format's blocks: NVFP4, FP8).
    pub(super) fn format(&self) -> Option<BlockFormat> {
        match self {
            Matrix::Bf16(_) => None,
            Matrix::Blocks { format, .. } => Some(*format),
            Matrix::Tiles { format, .. } => Some(match format {
                TileFormat::Fp8 => BlockFormat::Fp8,
                TileFormat::Nvfp4 | TileFormat::Twin => BlockFormat::Nvfp4,
            }),
        }
    }

    /// How the weight is held, for reports: `bf16`, a block format's name, `nvfp4 tiles`,
    /// `fp8 tiles`.
    pub(super) fn layout(&self) -> &'static str {
        match self {
            Matrix::Bf16(_) => "bf16",
            Matrix::Blocks { format, .. } => format.kernel_name(),
            Matrix::Tiles { format, .. } => match format {
                TileFormat::Fp8 => "fp8 tiles",
                TileFormat::Nvfp4 | TileFormat::Twin => "nvfp4 tiles",
            },
        }
    }
}

/// An RMSNorm weight on the device: bf16 as HF's Llama family rounds it, or Gemma 3's f32
/// `offset + w` (see `strata_kernels::NormWeight`).
pub(super) enum Norm {
    Bf16(CudaSlice<bf16>),
    F32(CudaSlice<f32>),
}

impl Norm {
    pub(super) fn bytes(&self) -> usize {
        match self {
            Norm::Bf16(w) => w.len() * 2,
            Norm::F32(w) => w.len() * 4,
        }
    }
}

pub(super) struct Layer {
    pub(super) input_norm: Norm,
    pub(super) q: Matrix,
    pub(super) k: Matrix,
    pub(super) v: Matrix,
    pub(super) o: Matrix,
    pub(super) qkv_bias: Option<[CudaSlice<bf16>; 3]>,
    pub(super) o_bias: Option<CudaSlice<bf16>>,
    pub(super) qk_norm: Option<[Norm; 2]>,
    /// The norm before the MLP (Gemma 3's `pre_feedforward_layernorm`).
    pub(super) post_norm: Norm,
    /// Gemma 3's norms of the attention and MLP outputs, before each is added to the residual.
    pub(super) sandwich: Option<[CudaSlice<f32>; 2]>,
    /// Dense: gate and up stacked (`[2 * intermediate, hidden]`, so one product gives
    /// `[gate | up]`) and down; or a mixture of experts.
    pub(super) mlp: Mlp,
}

pub(super) struct Weights {
    pub(super) embed: Matrix,
    pub(super) layers: Vec<Layer>,
    pub(super) final_norm: Norm,
    /// `None` when tied to the embedding.
    pub(super) lm_head: Option<Matrix>,
}

impl Weights {
    /// The most elements of one layer projection kept in a block format: the bf16 buffer the
    /// prompt rows' GEMM dequantizes into (0 when every projection is bf16).
    pub(super) fn dequant_elems(&self, d: LayerDims) -> usize {
        let dims = |m: &Matrix, n: usize, k: usize| if m.format().is_some() { n * k } else { 0 };
        self.layers
            .iter()
            .flat_map(|l| {
                [
                    dims(&l.q, d.q, d.hidden),
                    dims(&l.k, d.kv, d.hidden),
                    dims(&l.v, d.kv, d.hidden),
                    dims(&l.o, d.hidden, d.q),
                    match &l.mlp {
                        Mlp::Dense([gate_up, down]) => {
                            dims(gate_up, 2 * d.inter, d.hidden).max(dims(down, d.hidden, d.inter))
                        }
                        Mlp::Sparse(_) => 0,
                    },
                ]
            })
            .max()
            .unwrap_or(0)
    }

    /// Bytes a decode step reads (see [`super::CudaBackend::step_weight_bytes`]).
    pub(super) fn step_bytes(&self) -> usize {
        let vector = |v: &CudaSlice<bf16>| v.len() * 2;
        let opt = |v: &Option<CudaSlice<bf16>>| v.as_ref().map_or(0, vector);
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.q, &l.k, &l.v, &l.o]
                    .into_iter()
                    .chain(l.mlp.matrices())
                    .map(Matrix::bytes)
                    .sum::<usize>()
                    + match &l.mlp {
                        Mlp::Sparse(experts) => experts.token_bytes(),
                        Mlp::Dense(_) => 0,
                    }
                    + l.input_norm.bytes()
                    + l.post_norm.bytes()
                    + l.qkv_bias
                        .as_ref()
                        .map_or(0, |b| b.iter().map(vector).sum())
                    + opt(&l.o_bias)
                    + l.qk_norm
                        .as_ref()
                        .map_or(0, |n| n.iter().map(Norm::bytes).sum())
                    + l.sandwich
                        .as_ref()
                        .map_or(0, |n| n.iter().map(|w| w.len() * 4).sum())
            })
            .sum();
        layers + self.final_norm.bytes() + self.lm_head.as_ref().unwrap_or(&self.embed).bytes()
    }

    /// Tensors by how they are held: `(format name, count)`, bf16 first.
    pub(super) fn formats(&self) -> Vec<(&'static str, usize)> {
        let mut counts: Vec<(&'static str, usize)> = Vec::new();
        let mut add = |name: &'static str, n: usize| match counts
            .iter_mut()
            .find(|(have, _)| *have == name)
        {
            Some(entry) => entry.1 += n,
            None => counts.push((name, n)),
        };
        add(self.embed.layout(), 1);
        for l in &self.layers {
            for m in [&l.q, &l.k, &l.v, &l.o].into_iter().chain(l.mlp.matrices()) {
                add(m.layout(), 1);
            }
            if let Mlp::Sparse(experts) = &l.mlp {
                add("bf16", experts.tensors());
            }
        }
        if let Some(head) = &self.lm_head {
            add(head.layout(), 1);
        }
        counts
    }
}

/// A layer's projection widths on a rank.
#[derive(Clone, Copy)]
pub(super) struct LayerDims {
    pub(super) hidden: usize,
    pub(super) q: usize,
    pub(super) kv: usize,
    pub(super) inter: usize,
}

/// Rows `rows` and columns `cols` of a row-major tensor `width` wide, as bf16, padded with zero
/// rows to `out_rows` rows. Reads only those elements of the mapping, so a tensor-parallel rank
/// touches only its slice of the checkpoint; the conversion is the CPU reference's (exact widening
/// to f32, then round to nearest even), and bf16 is copied as it is.
fn slice_bf16(
    t: &TensorRef<'_>,
    width: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    out_rows: usize,
) -> Vec<bf16> {
    let (size, dtype) = (t.dtype.size(), t.dtype);
    let convert = |b: &[u8]| match dtype {
        WeightDtype::BF16 => bf16::from_le_bytes([b[0], b[1]]),
        WeightDtype::F16 | WeightDtype::F32 => bf16::from_f32(dtype.widen(b)),
    };
    let len = out_rows.max(rows.len()) * cols.len();
    let mut out = Vec::with_capacity(len);
    for run in t.runs(width, rows, cols) {
        match as_bf16(dtype, run) {
            Some(values) => out.extend_from_slice(values),
            None => out.extend(run.chunks_exact(size).map(convert)),
        }
    }
    out.resize(len, bf16::ZERO);
    out
}

/// bf16 bytes of the mapping as values, when they can be read in place: bf16 on a little-endian
/// host, 2-byte aligned.
fn as_bf16(dtype: WeightDtype, bytes: &[u8]) -> Option<&[bf16]> {
    (dtype == WeightDtype::BF16 && cfg!(target_endian = "little"))
        .then(|| bytemuck::try_cast_slice::<u8, bf16>(bytes).ok())
        .flatten()
}

/// Values per staging buffer (64 MiB of bf16).
const STAGE_VALUES: usize = 32 << 20;

/// Host-to-device copies through two page-locked staging buffers: each chunk is written into one
/// by all cores at once (page faults of a mapped checkpoint are taken in parallel) and copied by
/// DMA while the next chunk fills the other, instead of one thread filling a pageable vector the
/// driver then copies again. A copy from page-locked memory is asynchronous, so a buffer is
/// written again only after the event recorded behind its last copy (without that wait a tensor
/// of more than one chunk was uploaded with later chunks' values in earlier chunks' places).
struct Staging {
    stream: Arc<CudaStream>,
    buffers: [PinnedHostSlice<bf16>; 2],
    /// Per buffer: the event behind the last copy out of it.
    pending: [Option<CudaEvent>; 2],
    next: usize,
    /// Bytes uploaded so far.
    bytes: usize,
}

impl Staging {
    fn new(stream: &Arc<CudaStream>) -> Result<Self, CudaError> {
        // SAFETY: plain page-locked memory (not write-combined: written by the host, read by DMA).
        let alloc = || unsafe {
            stream
                .context()
                .alloc_pinned_with_flags::<bf16>(STAGE_VALUES, 0)
        };
        Ok(Self {
            stream: stream.clone(),
            buffers: [alloc()?, alloc()?],
            pending: [None, None],
            next: 0,
            bytes: 0,
        })
    }

    /// A device copy of `source`.
    fn upload(&mut self, source: &[bf16]) -> Result<CudaSlice<bf16>, CudaError> {
        self.upload_parts(&[source])
    }

    /// A device copy of the concatenation of `parts`.
    fn upload_parts(&mut self, parts: &[&[bf16]]) -> Result<CudaSlice<bf16>, CudaError> {
        let len = parts.iter().map(|p| p.len()).sum::<usize>();
        let mut device = self.stream.alloc_zeros::<bf16>(len.max(1))?;
        let mut at = 0;
        for chunk in parts.iter().flat_map(|p| p.chunks(STAGE_VALUES)) {
            let i = self.next;
            self.next ^= 1;
            if let Some(copied) = self.pending[i].take() {
                copied.synchronize()?;
            }
            let staged = &mut self.buffers[i].as_mut_slice()?[..chunk.len()];
            staged
                .par_chunks_mut(1 << 16)
                .zip(chunk.par_chunks(1 << 16))
                .for_each(|(to, from)| to.copy_from_slice(from));
            self.stream
                .memcpy_htod(&*staged, &mut device.slice_mut(at..at + chunk.len()))?;
            self.pending[i] = Some(self.stream.record_event(None)?);
            at += chunk.len();
        }
        self.bytes += len * 2;
        Ok(device)
    }
}

impl Drop for Staging {
    /// The buffers are freed only after the copies out of them.
    fn drop(&mut self) {
        for copied in self.pending.iter_mut().filter_map(Option::take) {
            if let Err(e) = copied.synchronize() {
                tracing::error!("waiting for a weight upload: {e}");
            }
        }
    }
}

/// What [`upload_checkpoint`] keeps in block formats.
#[derive(Debug, Clone, Copy)]
pub(super) struct BlockPolicy {
    /// Keep projections stored in a block format the kernels read as stored (else widen
    /// everything to bf16).
    pub(super) keep: bool,
    /// Keep FP8 and NVFP4 projections of a safetensors checkpoint in strata's device blocks
    /// (else widen them to bf16).
    pub(super) keep_quantized: bool,
    /// The row-parallel projections (o, down) are computed as K-slices of this many columns
    /// (the shard order), which must be whole blocks; `None` in the fused order.
    pub(super) row_kslice: Option<(usize, usize)>,
    /// Keep NVFP4 in fragment-ordered tiles where the layout allows (whole tensors, the fused
    /// order) instead of in blocks.
    pub(super) tiles: bool,
    /// And FP8 with a scale per tensor or per channel.
    pub(super) fp8_tiles: bool,
}

impl BlockPolicy {
    /// The policy of `options`; `shard_order` when o and down are computed as K-slices.
    pub(super) fn of(
        options: &super::CudaOptions,
        config: &ModelConfig,
        shard_order: bool,
    ) -> Self {
        let slices = (
            config.q_dim() / super::ROW_SHARDS,
            config.intermediate_size / super::ROW_SHARDS,
        );
        BlockPolicy {
            keep: !options.widen_blocks,
            keep_quantized: options.keep_quantized,
            tiles: !options.quant_blocks,
            fp8_tiles: !options.quant_blocks && options.fp8_tiles,
            row_kslice: shard_order.then_some(slices),
        }
    }
}

/// Gate then up (`[inter, h]` each, rows `ir` of each) as one bf16 matrix: read in place when
/// both are bf16 and whole, else sliced and widened.
fn gate_up_bf16(
    ckpt: &Checkpoint,
    staging: &mut Staging,
    (gate, up): (&str, &str),
    ir: &Range<usize>,
    [inter, h]: [usize; 2],
) -> Result<Matrix, CudaError> {
    let gate = ckpt.get_shaped(gate, &[inter, h])?;
    let up = ckpt.get_shaped(up, &[inter, h])?;
    let whole = ir.start == 0 && ir.end == inter;
    Ok(Matrix::Bf16(
        match (as_bf16(gate.dtype, gate.bytes), as_bf16(up.dtype, up.bytes)) {
            (Some(g), Some(u)) if whole => staging.upload_parts(&[g, u])?,
            _ => {
                let mut host = slice_bf16(&gate, h, ir.clone(), 0..h, 0);
                host.extend(slice_bf16(&up, h, ir.clone(), 0..h, 0));
                staging.upload(&host)?
            }
        },
    ))
}

/// Rows `rows` and columns `cols` of a `[n, width]` block tensor (row `r`'s blocks: `row(r)`),
/// padded with zero rows (which dequantize to zeros) to `out_rows`; `None` when `cols` does not
/// cut whole blocks.
fn slice_blocks<'a>(
    row: impl Fn(usize) -> &'a [u8],
    format: BlockFormat,
    rows: Range<usize>,
    cols: Range<usize>,
    out_rows: usize,
) -> Option<Vec<u8>> {
    let q = format.block_elems();
    if !cols.start.is_multiple_of(q) || !cols.end.is_multiple_of(q) {
        return None;
    }
    let bytes = cols.start / q * format.block_bytes()..cols.end / q * format.block_bytes();
    let len = out_rows.max(rows.len()) * bytes.len();
    let mut out = Vec::with_capacity(len);
    for r in rows {
        out.extend_from_slice(&row(r)[bytes.clone()]);
    }
    out.resize(len, 0);
    Some(out)
}

/// Uploads rank `shard.rank`'s slices of the checkpoint (the whole model at TP = 1), as the
/// layer description splits them (`LayerSpec`): q/k/v rows of its heads, gate/up rows of its
/// intermediate slice, the matching o/down columns, its vocabulary rows of the embedding and LM
/// head (padded with zero rows to `vocab_per_rank`); norms and the o bias whole. Projections
/// stored in a block format the kernels read stay in it (per `policy`); every other weight is
/// widened to bf16.
pub(super) fn upload_checkpoint(
    stream: &Arc<CudaStream>,
    config: &ModelConfig,
    ckpt: &Checkpoint,
    shard: &TpLayout,
    policy: BlockPolicy,
) -> Result<Weights, CudaError> {
    let started = Instant::now();
    let up = Upload {
        stream,
        config,
        ckpt,
        shard,
        policy,
        staging: RefCell::new(Staging::new(stream)?),
    };
    // A progress bar on a terminal (stderr); nothing otherwise.
    let bar = ProgressBar::with_draw_target(
        Some(config.num_layers as u64 + 2),
        ProgressDrawTarget::stderr(),
    );
    if let Ok(style) = ProgressStyle::with_template("uploading weights {bar:30} {pos}/{len}") {
        bar.set_style(style);
    }
    let (h, per) = (config.hidden_size, shard.vocab_per_rank);
    let embed = up.matrix(&embed_spec(config), per, h)?;
    bar.inc(1);
    let mut layers = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        bar.inc(1);
        layers.push(up.layer(&LayerSpec::new(config, i))?);
    }
    let final_norm = up.norm(&final_norm_spec(config))?;
    let lm_head = lm_head_spec(config)
        .map(|t| up.matrix(&t, per, h))
        .transpose()?;
    bar.finish_and_clear();
    let (bytes, seconds) = (up.staging.borrow().bytes, started.elapsed().as_secs_f64());
    tracing::info!(
        "uploaded {:.2} GB of weights in {seconds:.2} s ({:.2} GB/s)",
        bytes as f64 / 1e9,
        bytes as f64 / 1e9 / seconds
    );
    Ok(Weights {
        embed,
        layers,
        final_norm,
        lm_head,
    })
}

/// What one upload reads from and writes through.
pub(super) struct Upload<'a> {
    stream: &'a Arc<CudaStream>,
    config: &'a ModelConfig,
    ckpt: &'a Checkpoint,
    shard: &'a TpLayout,
    policy: BlockPolicy,
    staging: RefCell<Staging>,
}

impl Upload<'_> {
    /// The rank's rows and columns of a tensor.
    fn slice(&self, t: &TensorSpec) -> (Range<usize>, Range<usize>) {
        TpLayout::slice(Some(self.shard), t)
    }

    /// One decoder layer.
    fn layer(&self, n: &LayerSpec) -> Result<Layer, CudaError> {
        let c = self.config;
        // The K-slice the row-parallel projections are cut into (the whole K in the fused order).
        let (o_align, down_align) = self
            .policy
            .row_kslice
            .unwrap_or((c.q_dim(), c.intermediate_size));
        let h = c.hidden_size;
        let mlp = match (&n.mlp, &c.moe) {
            (MlpSpec::Dense(mlp), _) => {
                Mlp::Dense([self.gate_up(mlp)?, self.matrix(&mlp.down, 0, down_align)?])
            }
            (MlpSpec::Sparse(sparse), Some(moe)) => {
                if self.shard.world > 1 {
                    return Err(CudaError::Unsupported(
                        "experts across tensor-parallel ranks on the CUDA backend (the CPU \
                         backend splits them: --device cpu)"
                            .into(),
                    ));
                }
                Mlp::Sparse(Experts::upload(self, self.stream, sparse, moe, h)?)
            }
            (MlpSpec::Sparse(_), None) => {
                return Err(CudaError::Unsupported(
                    "experts without a routing config".into(),
                ));
            }
        };
        Ok(Layer {
            input_norm: self.norm(&n.input_norm)?,
            q: self.matrix(&n.q, 0, h)?,
            k: self.matrix(&n.k, 0, h)?,
            v: self.matrix(&n.v, 0, h)?,
            o: self.matrix(&n.o, 0, o_align)?,
            qkv_bias: n
                .qkv_bias
                .as_ref()
                .map(|[q, k, v]| {
                    Ok::<_, CudaError>([self.vector(q)?, self.vector(k)?, self.vector(v)?])
                })
                .transpose()?,
            o_bias: n.o_bias.as_ref().map(|t| self.vector(t)).transpose()?,
            qk_norm: pair(&n.qk_norm, |t| self.norm(t))?,
            // Gemma 3 norms the MLP input with `pre_feedforward_layernorm`; its
            // `post_attention_layernorm` norms the attention output (the sandwich).
            post_norm: self.norm(&n.mlp_norm)?,
            sandwich: pair(&n.sandwich, |t| self.gemma_norm(t))?,
            mlp,
        })
    }

    /// Gate and up as one matrix (the rank's rows of gate, then of up).
    pub(super) fn gate_up(&self, n: &GatedMlp) -> Result<Matrix, CudaError> {
        let names = (n.gate.name.as_str(), n.up.name.as_str());
        let (dims, (ir, cols)) = (n.gate.dims(), self.slice(&n.gate));
        let whole = ir.start == 0 && ir.end == dims[0];
        if let Some(t) = gate_up_tiles(self.ckpt, self.policy, names, dims, whole)? {
            return self.upload_tiles(t);
        }
        match (
            self.blocks(names.0, dims, &ir, &cols, 0, dims[1])?,
            self.blocks(names.1, dims, &ir, &cols, 0, dims[1])?,
        ) {
            (Some((fg, mut g)), Some((fu, u))) if fg == fu => {
                g.extend_from_slice(&u);
                self.upload_blocks(fg, &g)
            }
            _ => gate_up_bf16(self.ckpt, &mut self.staging.borrow_mut(), names, &ir, dims),
        }
    }

    /// A vector (a bias, a norm outside Gemma 3): the rank's part, as bf16.
    fn vector(&self, t: &TensorSpec) -> Result<CudaSlice<bf16>, CudaError> {
        let (len, part) = (t.numel(), self.slice(t).0);
        let r = self.ckpt.get_shaped(&t.name, &t.shape)?;
        Ok(self
            .stream
            .clone_htod(&slice_bf16(&r, len, 0..1, part, 1))?)
    }

    /// A Gemma 3 norm: f32 with its offset added (as the CPU reference).
    fn gemma_norm(&self, t: &TensorSpec) -> Result<CudaSlice<f32>, CudaError> {
        let offset = self.config.gemma3.as_ref().map_or(0.0, |g| g.norm_offset);
        let mut w = self.ckpt.get_shaped(&t.name, &t.shape)?.to_f32();
        w.iter_mut().for_each(|v| *v += offset);
        Ok(self.stream.clone_htod(&w)?)
    }

    /// RMSNorm weights: bf16, or for Gemma 3 f32 with its offset added.
    fn norm(&self, t: &TensorSpec) -> Result<Norm, CudaError> {
        Ok(if self.config.gemma3.is_some() {
            Norm::F32(self.gemma_norm(t)?)
        } else {
            Norm::Bf16(self.vector(t)?)
        })
    }

    /// The stored blocks of `rows` × `cols` of `name` (`[n, width]`), when kept: a block format
    /// the kernels read, cut at whole blocks, with `align` columns per K-slice.
    fn blocks(
        &self,
        name: &str,
        shape: [usize; 2],
        rows: &Range<usize>,
        cols: &Range<usize>,
        out_rows: usize,
        align: usize,
    ) -> Result<Option<(BlockFormat, Vec<u8>)>, CudaError> {
        let fits = |format: BlockFormat, stored: &[usize]| {
            stored == shape
                && cols.len().is_multiple_of(32)
                && align.is_multiple_of(format.block_elems())
        };
        if self.policy.keep
            && let Some(t) = self.ckpt.blocks(name)?
        {
            let Some(format) = BlockFormat::from_ggml_type(t.ty.id()) else {
                return Ok(None);
            };
            if !fits(format, t.shape) {
                return Ok(None);
            }
            let sliced = slice_blocks(|r| t.row(r), format, rows.clone(), cols.clone(), out_rows);
            return Ok(sliced.map(|b| (format, b)));
        }
        if !self.policy.keep_quantized {
            return Ok(None);
        }
        let Some(q) = self.ckpt.quantized(name)? else {
            return Ok(None);
        };
        let Some((format, device)) = safetensors_blocks(&q) else {
            return Ok(None);
        };
        if !fits(format, &q.shape()) {
            return Ok(None);
        }
        let row_bytes = format.row_bytes(shape[1]);
        let row = |r: usize| &device[r * row_bytes..(r + 1) * row_bytes];
        Ok(slice_blocks(row, format, rows.clone(), cols.clone(), out_rows).map(|b| (format, b)))
    }

    fn upload_tiles(&self, t: HostTiles) -> Result<Matrix, CudaError> {
        self.staging.borrow_mut().bytes += t.data.len() + t.scales.len() * 4;
        t.upload(self.stream)
    }

    /// Blocks as the file stores them, uploaded in the device layout.
    fn upload_blocks(&self, format: BlockFormat, file: &[u8]) -> Result<Matrix, CudaError> {
        let device = format.to_device(file);
        self.staging.borrow_mut().bytes += device.len();
        Ok(Matrix::Blocks {
            format,
            data: self.stream.clone_htod(&device)?,
        })
    }

    /// The rank's rows × columns of matrix `t`, padded with zero rows to `out_rows`: kept in
    /// its block format where it can be, else as bf16 (a whole bf16 tensor goes from the mapping
    /// to the staging buffer without a vector between).
    pub(super) fn matrix(
        &self,
        t: &TensorSpec,
        out_rows: usize,
        align: usize,
    ) -> Result<Matrix, CudaError> {
        let (name, shape, (rows, cols)) = (t.name.as_str(), t.dims(), self.slice(t));
        let whole = rows == (0..shape[0]) && cols == (0..shape[1]) && out_rows <= shape[0];
        if let Some(t) = tiles_of(self.ckpt, self.policy, name, shape, whole)? {
            return self.upload_tiles(t);
        }
        if let Some((format, bytes)) = self.blocks(name, shape, &rows, &cols, out_rows, align)? {
            return self.upload_blocks(format, &bytes);
        }
        let t = self.ckpt.get_shaped(name, &shape)?;
        let mut staging = self.staging.borrow_mut();
        if whole && let Some(values) = as_bf16(t.dtype, t.bytes) {
            return Ok(Matrix::Bf16(staging.upload(values)?));
        }
        let host = slice_bf16(&t, shape[1], rows, cols, out_rows);
        Ok(Matrix::Bf16(staging.upload(&host)?))
    }
}

/// Both tensors of an optional pair, each as `each` uploads it.
fn pair<T>(
    p: &Option<[TensorSpec; 2]>,
    each: impl Fn(&TensorSpec) -> Result<T, CudaError>,
) -> Result<Option<[T; 2]>, CudaError> {
    p.as_ref()
        .map(|[a, b]| Ok([each(a)?, each(b)?]))
        .transpose()
}

/// Random weights for benchmarks: every projection is a window of one device pool of
/// N(0, 0.02²) bf16 values (a different offset per tensor), so nothing is zero and nothing is
/// drawn twice in a row; norms are ones.
///
/// A tensor-parallel rank synthesizes weights of its slices' shapes (not slices of one model:
/// benchmarks only need the shapes).
pub(super) fn synthesize(
    stream: &Arc<CudaStream>,
    config: &ModelConfig,
    shard: &TpLayout,
    seed: u64,
) -> Result<Weights, CudaError> {
    const POOL: usize = 1 << 26; // 64 Mi values, 128 MiB
    let mut state = seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        // splitmix64
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let pool_host: Vec<bf16> = (0..POOL)
        .map(|_| {
            // Sum of four uniforms: near-normal, mean 0, variance 4/12; scaled to σ = 0.02.
            let u: f32 = (0..4)
                .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
                .sum();
            bf16::from_f32(u * 0.02 / (1.0f32 / 3.0).sqrt())
        })
        .collect();
    let pool = stream.clone_htod(&pool_host)?;
    let mut offset = (next() as usize) % POOL;
    let mut matrix = |len: usize| -> Result<CudaSlice<bf16>, CudaError> {
        let mut out = stream.alloc_zeros::<bf16>(len)?;
        let mut done = 0;
        while done < len {
            let take = (len - done).min(POOL - offset);
            stream.memcpy_dtod(
                &pool.slice(offset..offset + take),
                &mut out.slice_mut(done..done + take),
            )?;
            done += take;
            offset = (offset + take + 7919) % POOL;
        }
        Ok(out)
    };
    let ones = |len: usize| stream.clone_htod(&vec![bf16::ONE; len]);
    let f32_ones = |len: usize| stream.clone_htod(&vec![1f32; len]);
    let gemma = config.gemma3.is_some();
    let norm = |len: usize| -> Result<Norm, CudaError> {
        Ok(if gemma {
            Norm::F32(f32_ones(len)?)
        } else {
            Norm::Bf16(ones(len)?)
        })
    };
    let (h, q, kv, inter, hd) = (
        config.hidden_size,
        shard.q_rows.len(),
        shard.kv_rows.len(),
        shard.inter_rows.len(),
        config.head_dim,
    );
    let embed = Matrix::Bf16(matrix(shard.vocab_per_rank * h)?);
    let mut layers = Vec::with_capacity(config.num_layers);
    for l in 0..config.num_layers {
        layers.push(Layer {
            input_norm: norm(h)?,
            q: Matrix::Bf16(matrix(q * h)?),
            k: Matrix::Bf16(matrix(kv * h)?),
            v: Matrix::Bf16(matrix(kv * h)?),
            o: Matrix::Bf16(matrix(h * q)?),
            qkv_bias: if config.qkv_bias {
                Some([matrix(q)?, matrix(kv)?, matrix(kv)?])
            } else {
                None
            },
            o_bias: if config.o_bias {
                Some(matrix(h)?)
            } else {
                None
            },
            qk_norm: if config.qk_norm {
                Some([norm(hd)?, norm(hd)?])
            } else {
                None
            },
            post_norm: norm(h)?,
            sandwich: if gemma {
                Some([f32_ones(h)?, f32_ones(h)?])
            } else {
                None
            },
            mlp: match &config.moe {
                Some(moe) if moe.is_sparse(l) => {
                    if shard.world > 1 {
                        return Err(CudaError::Unsupported(
                            "experts across tensor-parallel ranks on the CUDA backend".into(),
                        ));
                    }
                    Mlp::Sparse(Experts::synthesize(moe, h, &mut matrix)?)
                }
                _ => Mlp::Dense([
                    Matrix::Bf16(matrix(2 * inter * h)?),
                    Matrix::Bf16(matrix(h * inter)?),
                ]),
            },
        });
    }
    let final_norm = norm(h)?;
    let lm_head = if config.tie_word_embeddings {
        None
    } else {
        Some(Matrix::Bf16(matrix(shard.vocab_per_rank * h)?))
    };
    Ok(Weights {
        embed,
        layers,
        final_norm,
        lm_head,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor<'a>(dtype: WeightDtype, shape: &'a [usize], bytes: &'a [u8]) -> TensorRef<'a> {
        TensorRef {
            name: "t",
            path: std::path::Path::new("t.safetensors"),
            dtype,
            shape,
            bytes,
        }
    }

    #[test]
    fn the_model_crates_device_block_types_are_the_kernels_formats() {
        let kernels: Vec<u32> = BlockFormat::ALL.iter().map(|f| f.ggml_type()).collect();
        let model: Vec<u32> = strata_model::gguf::CUDA_BLOCK_TYPES
            .iter()
            .map(|t| t.id())
            .collect();
        assert_eq!(kernels, model);
        for (f, t) in BlockFormat::ALL
            .iter()
            .zip(strata_model::gguf::CUDA_BLOCK_TYPES)
        {
            assert_eq!(
                (f.block_elems(), f.block_bytes()),
                (t.block_size(), t.type_size())
            );
        }
    }

    #[test]
    fn a_block_slice_cuts_whole_blocks_and_pads_with_zero_rows() {
        // A [3, 64] Q8_0 tensor: two 34-byte blocks per row, byte b of row r is 100 r + b / 34.
        let bytes: Vec<u8> = (0..3)
            .flat_map(|r| (0..68).map(move |b| (100 * r + b / 34) as u8))
            .collect();
        let blocks = strata_model::weights::BlockTensor::for_test(
            strata_model::gguf::GgmlType::Q8_0,
            &[3, 64],
            &bytes,
        );
        let f = BlockFormat::Q8_0;
        let got = slice_blocks(|r| blocks.row(r), f, 1..3, 32..64, 3).unwrap();
        assert_eq!(got.len(), 3 * 34);
        assert!(got[..34].iter().all(|&b| b == 101));
        assert!(got[34..68].iter().all(|&b| b == 201));
        assert!(got[68..].iter().all(|&b| b == 0));
        // Columns that cut a block are not taken as stored.
        assert!(slice_blocks(|r| blocks.row(r), f, 0..3, 16..64, 0).is_none());
    }

    #[test]
    fn a_slice_reads_its_rows_and_columns_and_pads_with_zero_rows() {
        // A [3, 4] f32 tensor holding 0..12.
        let values: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = tensor(WeightDtype::F32, &[3, 4], &bytes);
        let got: Vec<f32> = slice_bf16(&t, 4, 1..3, 1..3, 3)
            .iter()
            .map(|v| v.to_f32())
            .collect();
        assert_eq!(got, vec![5.0, 6.0, 9.0, 10.0, 0.0, 0.0]);
        // bf16 is copied bit for bit, f16 widened exactly then rounded like the reference.
        let b: Vec<u8> = [bf16::from_f32(1.5), bf16::from_f32(-3.0)]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let t = tensor(WeightDtype::BF16, &[2], &b);
        assert_eq!(slice_bf16(&t, 2, 0..1, 1..2, 1), vec![bf16::from_f32(-3.0)]);
        let h: Vec<u8> = half::f16::from_f32(0.1).to_le_bytes().to_vec();
        let t = tensor(WeightDtype::F16, &[1], &h);
        assert_eq!(
            slice_bf16(&t, 1, 0..1, 0..1, 1),
            vec![bf16::from_f32(half::f16::from_f32(0.1).to_f32())]
        );
    }
}
