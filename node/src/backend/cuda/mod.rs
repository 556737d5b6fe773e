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
//!
//! Tensor parallelism (DESIGN.md §5, `tp.rs` runs the ranks): a backend can be rank `r` of `N`,
//! holding only its slices of the weights ([`TpLayout`]). The row-parallel o and down
//! projections then run in the *shard order*: each output is the sum of eight f32 partials over
//! fixed K-slices, added in shard order; a rank computes its `8 / N` partials, an all-gather puts
//! all eight on every rank, and every rank adds them as one GPU holding all eight does. A K-slice's
//! partial is bitwise the same whoever computes it (the shard GEMV and the sliced GEMM), so TP = N
//! is byte-identical to TP = 1 in the shard order ([`CudaOptions::sharded_reduction`]).

use std::collections::HashMap;
use std::sync::Arc;

use half::bf16;
use strata_collective::{CollectiveError, DeviceCommunicator};
use strata_kernels::cudarc::driver::sys::CU_MEMHOSTALLOC_PORTABLE;
use strata_kernels::cudarc::driver::{CudaContext, CudaEvent, CudaGraph, CudaSlice, CudaStream};
use strata_kernels::{
    ATTENTION_HEAD_DIMS, KernelError, Kernels, LtGemm, MOE_MAX_EXPERTS, MOE_MAX_TOP_K,
};
use strata_model::ModelConfig;
use strata_model::cpu::{PartialsFault, TpLayout};
use strata_model::rope::Rope;
use strata_model::weights::{Checkpoint, WeightError};

mod forward;
mod kv_copy;
mod matmul;
mod moe;
mod quant_blocks;
mod readback;
mod row_parallel;
mod scratch;
mod step;
mod tp;
mod weights;

pub use quant_blocks::safetensors_block_values;
pub use row_parallel::ROW_SHARDS;
use row_parallel::gemm_shapes;

pub use tp::{CudaTpBackend, TpTransport};

use super::{Backend, BackendError, RowSampling, StepOutput, StepSeq};
use crate::kv::{BlockId, HostMemory, KvBlockIo, KvError};
use forward::mark;
use scratch::Scratch;
use weights::{BlockPolicy, LayerDims, Matrix, Weights, synthesize, upload_checkpoint};

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
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error(
        "this backend is a rank of a tensor-parallel group and has no communicator yet \
         (CudaBackend::attach_communicator)"
    )]
    NoCommunicator,
}

impl From<strata_kernels::cudarc::driver::DriverError> for CudaError {
    fn from(e: strata_kernels::cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e.to_string())
    }
}

/// Where the weights come from.
#[derive(Clone, Copy)]
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
    /// Bytes of device memory for the KV cache (unless `kv_memory_fraction` is given).
    pub kv_cache_bytes: usize,
    /// Size the KV cache from the device instead: of this fraction of the GPU's memory, what
    /// the weights (and everything else already allocated) and [`ACTIVATION_RESERVE`] leave.
    pub kv_memory_fraction: Option<f64>,
    /// Where compiled kernels are cached (default: the user cache directory).
    pub kernel_cache: Option<std::path::PathBuf>,
    /// Rows of the cos/sin table; positions beyond it are refused. Default: the context window.
    pub max_positions: Option<usize>,
    /// Replay decode-only steps through CUDA graphs, one per row bucket ([`GRAPH_BUCKETS`]) and
    /// block-table width; the same launches as the eager path, so the same bits.
    pub graphs: bool,
    /// This backend's place in a tensor-parallel group: rank `tp_rank` of `tp_world` (0 of 1
    /// alone). A rank of a larger group loads only its slices of the weights and must be given
    /// the group's communicator ([`CudaBackend::attach_communicator`]) before its first step.
    pub tp_rank: usize,
    pub tp_world: usize,
    /// Compute o and down in the shard order every TP degree shares (eight K-slice partials
    /// added in order; the module docs), so that TP = N is byte-identical to TP = 1. Always on
    /// when `tp_world > 1`; off at TP = 1 the projections are one GEMV / GEMM each (faster,
    /// other bits). Needs `q_dim` and `intermediate` to be multiples of 256.
    pub sharded_reduction: bool,
    /// Widen GGUF block weights to bf16 at load instead of keeping them in their formats (the
    /// comparison arm of the block kernels: the same bits, more bytes per step).
    pub widen_blocks: bool,
    /// Keep an FP8 or NVFP4 safetensors checkpoint's projections in strata's device blocks
    /// (`BlockFormat::SAFETENSORS`) instead of widening them to bf16: the same bits.
    pub keep_quantized: bool,
    /// With `keep_quantized`, NVFP4 and FP8 in blocks (the widened model's bits), never in tiles.
    pub quant_blocks: bool,
    /// With `keep_quantized` and not `quant_blocks`: FP8 (a scale per tensor or per channel) in
    /// fragment-ordered tiles too, else in blocks.
    pub fp8_tiles: bool,
    /// Every row of a step in the run order ([`CudaBackend::set_run_order`]); a model or
    /// layout the order does not take is refused at construction.
    pub run_order: bool,
}

/// Device memory kept free beside the weights and the KV cache when the cache is sized from a
/// fraction of the GPU: step buffers (an 8B model's 2 048-row step takes about 0.3 GB, 256
/// rows of f32 logits over a 128k vocabulary 0.13 GB), cuBLASLt's workspace and graph memory.
pub const ACTIVATION_RESERVE: usize = 3 << 29;

/// Row counts of decode-only steps that are replayed through CUDA graphs. A step is padded up to
/// the next bucket with rows that write to the reserved scratch block and whose outputs are
/// dropped; steps with more rows, or with any prompt row, run eagerly.
pub const GRAPH_BUCKETS: &[usize] = &[1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128];

/// Where each per-step index array sits in the packed input buffer. A function of the step's
/// shape only, so a graph captured for a shape reads the right places on every replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    ids: usize,
    positions: usize,
    slots: usize,
    context_lens: usize,
    gather: usize,
    decode_tables: usize,
    prefill_tables: usize,
    len: usize,
}

impl Layout {
    fn new(rows: usize, decode: usize, width: usize, logits: usize, prefill_blocks: usize) -> Self {
        let ids = 0;
        let positions = ids + rows;
        let slots = positions + rows;
        let context_lens = slots + rows;
        let gather = context_lens + decode;
        let decode_tables = gather + logits;
        let prefill_tables = decode_tables + decode * width;
        Layout {
            ids,
            positions,
            slots,
            context_lens,
            gather,
            decode_tables,
            prefill_tables,
            len: prefill_tables + prefill_blocks,
        }
    }
}

/// One sequence's prompt rows in a step.
#[derive(Debug, Clone)]
struct Segment {
    /// First row, in device order.
    first: usize,
    rows: usize,
    /// Position of the first row.
    start: usize,
    /// The sequence's block table in the packed inputs: `offset..offset + blocks`.
    table: (usize, usize),
}

/// The shape of one forward pass: everything the launches need besides the packed inputs.
#[derive(Debug, Clone)]
struct Plan {
    /// Device rows, padding included.
    rows: usize,
    /// Prompt rows (the first `prompt` device rows).
    prompt: usize,
    segments: Vec<Segment>,
    /// Width of the decode rows' block tables.
    width: usize,
    /// Upper bound of the decode rows' context lengths (sets the split-KV grid).
    max_context: usize,
    /// Rows whose logits are computed; the first `logits_prompt` take the prompt path.
    logits: usize,
    logits_prompt: usize,
    layout: Layout,
}

/// Key of a captured decode graph: rows (a [`GRAPH_BUCKETS`] entry) and the table width.
type GraphKey = (usize, usize);

/// Device time per kernel family of one eager step, from CUDA events between launches.
#[derive(Debug, Clone, Default)]
pub struct StepProfile {
    /// `(family, milliseconds, launches)` in first-seen order.
    pub families: Vec<(&'static str, f64, usize)>,
}

pub struct CudaBackend {
    config: ModelConfig,
    /// This backend's slices of the model ([`CudaOptions::tp_rank`]).
    shard: TpLayout,
    /// Row-parallel shards this backend computes (`8 / world`), or 0: one fused GEMV / GEMM.
    row_shards: usize,
    /// A deliberately wrong reduction of the partials, for canaries.
    fault: PartialsFault,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    gemm: LtGemm,
    weights: Weights,
    k_cache: Vec<CudaSlice<bf16>>,
    v_cache: Vec<CudaSlice<bf16>>,
    /// Moves whole blocks between the caches and host memory (the tiers, KV fetches).
    kv_copy: kv_copy::BlockCopy,
    cos_sin: CudaSlice<f32>,
    /// Gemma 3's sliding-window layers rotate by their own base.
    cos_sin_local: Option<CudaSlice<f32>>,
    max_positions: usize,
    block_size: usize,
    /// Blocks the scheduler may use; block `num_blocks` is the reserved scratch block that
    /// padding rows write to.
    num_blocks: usize,
    scratch: Scratch,
    graphs_enabled: bool,
    /// Decode rows through the pinned GEMM too (see [`CudaBackend::set_decode_gemm`]).
    decode_gemm: bool,
    /// Every row in the run order (see [`CudaBackend::set_run_order`]).
    run_order: bool,
    /// Experts through the grouped launches (see [`CudaBackend::set_moe_grouped`]).
    moe_grouped: bool,
    /// The bf16 buffer a block-format projection is dequantized into for the GEMM of prompt
    /// rows, sized for the largest; `None` when every projection is bf16.
    dequant: Option<CudaSlice<bf16>>,
    graphs: HashMap<GraphKey, SendGraph>,
    /// The tensor-parallel group this backend is a rank of: the row-parallel o and down
    /// projections are all-reduced through it. `None` runs alone with no collective calls.
    comm: Option<Box<dyn DeviceCommunicator>>,
    /// Host staging of the packed inputs.
    host_inputs: Vec<u32>,
    /// Set by [`CudaBackend::profile_next_step`]: the next step runs eagerly with events.
    profile: Option<Vec<(&'static str, CudaEvent)>>,
    last_profile: Option<StepProfile>,
}

/// A captured decode graph. cudarc's `CudaGraph` holds raw driver handles and is not `Send`.
struct SendGraph(CudaGraph);

// SAFETY: a graph is created, launched and dropped only through `&mut CudaBackend`, so at most
// one thread touches it at a time, and the CUDA driver allows graph execs to be launched from
// any thread that makes their context current (cudarc binds the context before each launch).
unsafe impl Send for SendGraph {}

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
        check_model_shape(config).map_err(CudaError::Unsupported)?;
        let (rank, world) = (options.tp_rank, options.tp_world);
        let shard = TpLayout::new(config, rank, world, 8)
            .map_err(|e| CudaError::Unsupported(e.to_string()))?;
        let row_shards = row_shards(config, options)?;
        strata_kernels::libs::ensure_driver()?;
        let ctx = CudaContext::new(options.device)?;
        // One stream does the compute; the KV block copies' streams order themselves against it
        // with events of their own (`kv_copy`), so cudarc's cross-stream event tracking is not
        // needed. A stream of our own (not the legacy default stream) is what graph capture
        // requires.
        // SAFETY: every buffer of this context is used on `stream` only, but the block copies'
        // staging buffers, which `kv_copy` orders explicitly.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let kernels = Kernels::load(&ctx, options.kernel_cache.as_deref())?;
        let gemm = LtGemm::new(&stream)?;
        let weights = match source {
            WeightSource::Checkpoint(ckpt) => {
                ckpt.validate(config)?;
                let policy = BlockPolicy::of(options, config, row_shards > 0);
                upload_checkpoint(&stream, config, ckpt, &shard, policy)?
            }
            WeightSource::Synthetic { seed } => synthesize(&stream, config, &shard, seed)?,
        };
        let max_positions = options
            .max_positions
            .unwrap_or(config.max_position_embeddings)
            .min(config.max_position_embeddings)
            .max(1);
        let (cos_sin, cos_sin_local) = rope_tables(&stream, config, max_positions)?;
        let dequant_elems = weights.dequant_elems(LayerDims {
            hidden: config.hidden_size,
            q: shard.q_rows.len(),
            kv: shard.kv_rows.len(),
            inter: shard.inter_rows.len(),
        });
        let dequant = match dequant_elems {
            0 => None,
            n => Some(stream.alloc_zeros::<bf16>(n)?),
        };
        let formats = weights.formats();
        if formats.iter().any(|(name, _)| *name != "bf16") {
            let held: Vec<String> = formats.iter().map(|(f, n)| format!("{f} ×{n}")).collect();
            tracing::info!("projections held as {}", held.join(", "));
        }

        let kv_dim = shard.kv_rows.len();
        let (num_blocks, k_cache, v_cache) = kv_caches(&stream, config, options, kv_dim)?;
        // One block beyond the budget's count is the scratch block of padding rows.
        let allocated = num_blocks + 1;
        let kv_copy = kv_copy::BlockCopy::new(
            &stream,
            &k_cache,
            &v_cache,
            options.block_size * kv_dim,
            allocated,
        )?;
        let mut backend = Self {
            config: config.clone(),
            shard,
            row_shards,
            fault: PartialsFault::None,
            stream,
            kernels,
            gemm,
            weights,
            k_cache,
            v_cache,
            kv_copy,
            cos_sin,
            cos_sin_local,
            max_positions,
            block_size: options.block_size,
            num_blocks,
            scratch: Scratch::default(),
            graphs_enabled: options.graphs,
            decode_gemm: false,
            run_order: false,
            moe_grouped: false,
            dequant,
            graphs: HashMap::new(),
            comm: None,
            host_inputs: Vec::new(),
            profile: None,
            last_profile: None,
        };
        backend.set_run_order(options.run_order)?;
        backend.pin_gemms()?;
        backend.stream.synchronize()?;
        Ok(backend)
    }

    /// Bytes of weights a decode step reads: every layer's, the final norm and the LM head (the
    /// embedding table only where tied to the head: a step gathers a few of its rows).
    pub fn step_weight_bytes(&self) -> usize {
        self.weights.step_bytes()
    }

    /// Tensors by how they are held on the device: `(format, count)`, e.g. `("q4_k", 193)`.
    pub fn weight_formats(&self) -> Vec<(&'static str, usize)> {
        self.weights.formats()
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

    /// Turns CUDA-graph replay of decode-only steps on or off (on by default, see
    /// [`CudaOptions::graphs`]). Both paths launch the same kernels on the same shapes, so a
    /// step's logits are bitwise the same either way (`strata gpu decode` checks it).
    pub fn set_graphs(&mut self, enabled: bool) {
        self.graphs_enabled = enabled;
    }

    /// Sends decode rows' projections (q/k/v, o, gate/up, down, LM head) through the pinned
    /// cuBLASLt GEMM that prompt rows take, instead of the tensor-core GEMV (an experiment for
    /// `strata gpu decode --decode-gemm`: the GEMM's rows are the same bits for every row count,
    /// so it is batch-invariant too, but not the GEMV's bits). Cached graphs are dropped.
    pub fn set_decode_gemm(&mut self, enabled: bool) {
        self.decode_gemm = enabled;
        self.graphs.clear();
    }

    /// Runs a mixture of experts' layers through the grouped launches (an experiment for
    /// `strata gpu decode --moe-grouped` until the GPU self-test has passed them: routing a
    /// warp a token, the step's slots grouped by expert so each chosen expert's rows are read
    /// once however many rows chose it — the same bits as the default launches by
    /// construction, checked bit for bit by the self-test). Cached graphs are dropped.
    pub fn set_moe_grouped(&mut self, enabled: bool) {
        self.moe_grouped = enabled;
        self.graphs.clear();
    }

    /// Sends every row of a step — decode and prompt rows alike — through the run-order kernels
    /// (`strata_kernels::Kernels::gemm_runs`): a step reads each weight once, and a row's bits are
    /// the same whatever other rows share its step, but they are not the default order's bits
    /// (docs/DECISIONS.md). Refused, leaving the backend as it was, for a model with any weight
    /// not in bf16, in the shard order (tensor parallelism or `sharded_reduction`), or with
    /// decode rows on the pinned GEMM. Cached graphs are dropped.
    pub fn set_run_order(&mut self, enabled: bool) -> Result<(), CudaError> {
        if enabled {
            let refuse = |why: &str| Err(CudaError::Unsupported(format!("the run order: {why}")));
            if self.row_shards > 0 {
                return refuse("not in the shard order (tensor parallelism, sharded reduction)");
            }
            if self.decode_gemm {
                return refuse("decode rows are on the pinned GEMM");
            }
            let w = &self.weights;
            // The embedding table matters only as the LM head (its rows are gathered, not
            // multiplied).
            let mut matrices: Vec<&Matrix> = vec![w.lm_head.as_ref().unwrap_or(&w.embed)];
            for l in &w.layers {
                matrices.extend([&l.q, &l.k, &l.v, &l.o]);
                matrices.extend(l.mlp.matrices());
            }
            if let Some(format) = matrices.iter().find_map(|m| m.format()) {
                return refuse(&format!("a {format:?} weight (bf16 weights only)"));
            }
        }
        self.run_order = enabled;
        self.graphs.clear();
        Ok(())
    }

    /// Makes this backend rank `tp_rank` of `comm`'s group ([`CudaOptions::tp_rank`]): from the
    /// next step on, the embedding rows are all-reduced and the row-parallel partials and the
    /// logits all-gathered through it (with one rank and the fused order, the o and down outputs
    /// are all-reduced, the one-rank path the battery runs over NCCL). The communicator must
    /// enqueue on this backend's stream, so the collectives need no cross-stream waits and are
    /// captured into the decode graphs with everything else; a communicator that cannot be
    /// captured (the host-staged one) turns the graphs off.
    pub fn attach_communicator(
        &mut self,
        comm: Box<dyn DeviceCommunicator>,
    ) -> Result<(), CudaError> {
        if (comm.rank(), comm.world_size()) != (self.shard.rank, self.shard.world) {
            return Err(CudaError::Unsupported(format!(
                "this backend holds the weights of rank {} of {}; the communicator is rank {} \
                 of {}",
                self.shard.rank,
                self.shard.world,
                comm.rank(),
                comm.world_size()
            )));
        }
        if **comm.stream() != *self.stream {
            return Err(CudaError::Unsupported(
                "the communicator must enqueue on the backend's stream \
                 (make it with NcclGroup::on_streams(vec![backend.stream().clone()]))"
                    .into(),
            ));
        }
        if !comm.capturable() {
            self.graphs_enabled = false;
        }
        self.graphs.clear();
        self.comm = Some(comm);
        Ok(())
    }

    /// Makes the row-parallel partials be reduced the wrong way, for canaries.
    #[doc(hidden)]
    pub fn inject_partials_fault(&mut self, fault: PartialsFault) {
        self.fault = fault;
        self.graphs.clear();
    }

    /// Whether the row-parallel outputs go through a communicator.
    pub fn has_communicator(&self) -> bool {
        self.comm.is_some()
    }

    /// Decode graphs captured so far.
    pub fn captured_graphs(&self) -> usize {
        self.graphs.len()
    }

    /// Runs the next step eagerly with a CUDA event after every launch; its per-family device
    /// times are then in [`CudaBackend::take_profile`].
    pub fn profile_next_step(&mut self) {
        self.profile = Some(Vec::new());
    }

    pub fn take_profile(&mut self) -> Option<StepProfile> {
        self.last_profile.take()
    }

    /// Chooses every GEMM algorithm now, so the first prompt does not pay for it.
    fn pin_gemms(&mut self) -> Result<(), CudaError> {
        for shape in gemm_shapes(&self.config, &self.shard, self.row_shards).all() {
            self.gemm.pin_shape(shape)?;
        }
        Ok(())
    }

    /// Grows the step buffers for `plan`. Growing moves buffers that captured graphs point
    /// at, so it drops every graph.
    fn ensure_scratch(&mut self, plan: &Plan) -> Result<(), CudaError> {
        let moved = self.scratch.ensure(
            &self.stream,
            &self.config,
            &self.shard,
            self.row_shards,
            plan,
        )?;
        if moved {
            self.graphs.clear();
        }
        Ok(())
    }
}

/// Refuses, at startup, a model whose shapes the kernels do not take — rather than loading it and
/// failing every request: the attention kernels' head dimensions, and the tensor-core GEMV's
/// `k % 32` for every projection's input width (hidden, q, intermediate).
pub fn check_model_shape(config: &ModelConfig) -> Result<(), String> {
    if let Some(moe) = &config.moe {
        let widths = [moe.expert_intermediate]
            .into_iter()
            .chain(moe.shared_expert_intermediate);
        if moe.experts > MOE_MAX_EXPERTS
            || moe.experts_per_token > MOE_MAX_TOP_K
            || widths.into_iter().any(|w| !w.is_multiple_of(8))
        {
            return Err(format!(
                "the CUDA expert kernels take at most {MOE_MAX_TOP_K} of {MOE_MAX_EXPERTS} \
                 experts with widths that are multiples of 8 (this {}: {} of {}, \
                 moe_intermediate_size {}); the CPU backend runs it (--device cpu)",
                config.architecture, moe.experts_per_token, moe.experts, moe.expert_intermediate
            ));
        }
    }
    let d = config.head_dim;
    if !ATTENTION_HEAD_DIMS.contains(&d) {
        return Err(format!(
            "the CUDA backend does not run head_dim {d} (its attention kernels take \
             {ATTENTION_HEAD_DIMS:?}); the CPU backend does (--device cpu)"
        ));
    }
    for (what, k) in [
        ("hidden_size", config.hidden_size),
        ("q_dim", config.q_dim()),
        ("intermediate_size", config.intermediate_size),
    ] {
        if !k.is_multiple_of(32) {
            return Err(format!(
                "the CUDA backend needs {what} ({k}) to be a multiple of 32; the CPU backend \
                 runs it (--device cpu)"
            ));
        }
    }
    Ok(())
}

/// Shards of the row-parallel reduction's fixed order a rank sums (0: the fused order), and
/// whether the shapes allow it.
fn row_shards(config: &ModelConfig, options: &CudaOptions) -> Result<usize, CudaError> {
    let world = options.tp_world;
    Ok(if world > 1 || options.sharded_reduction {
        let kslices = [
            config.q_dim() / ROW_SHARDS,
            config.intermediate_size / ROW_SHARDS,
        ];
        if kslices.iter().any(|k| !k.is_multiple_of(32)) {
            return Err(CudaError::Unsupported(format!(
                "the shard order needs q_dim ({}) and intermediate ({}) to be multiples of \
                 {}",
                config.q_dim(),
                config.intermediate_size,
                32 * ROW_SHARDS
            )));
        }
        ROW_SHARDS / world
    } else {
        0
    })
}

/// The rope's cos/sin table, and Gemma 3's local-attention one.
fn rope_tables(
    stream: &Arc<CudaStream>,
    config: &ModelConfig,
    max_positions: usize,
) -> Result<(CudaSlice<f32>, Option<CudaSlice<f32>>), CudaError> {
    let cos_sin = stream.clone_htod(&cos_sin_table(
        &Rope::new(config),
        config.head_dim,
        max_positions,
    ))?;
    let cos_sin_local = match &config.gemma3 {
        Some(g) => {
            let rope = Rope::with_theta(config.head_dim, g.rope_local_theta, None);
            Some(stream.clone_htod(&cos_sin_table(&rope, config.head_dim, max_positions))?)
        }
        None => None,
    };
    Ok((cos_sin, cos_sin_local))
}

/// The paged KV cache, per layer K and V of `kv_dim` values a slot: as many blocks as the
/// budget (bytes, or a fraction of the free memory) holds, plus the scratch block of padding
/// rows; returns the budget's block count.
#[allow(clippy::type_complexity)]
fn kv_caches(
    stream: &Arc<CudaStream>,
    config: &ModelConfig,
    options: &CudaOptions,
    kv_dim: usize,
) -> Result<(usize, Vec<CudaSlice<bf16>>, Vec<CudaSlice<bf16>>), CudaError> {
    let per_block = config.num_layers * 2 * options.block_size * kv_dim * 2;
    let kv_cache_bytes = match options.kv_memory_fraction {
        None => options.kv_cache_bytes,
        Some(fraction) => {
            stream.context().bind_to_thread()?;
            let (free, total) = strata_kernels::cudarc::driver::result::mem_get_info()?;
            kv_bytes_from_fraction(fraction, free, total, per_block)?
        }
    };
    // One block beyond the budget's count is the scratch block of padding rows.
    let num_blocks = (kv_cache_bytes / per_block.max(1)).max(1);
    let allocated = num_blocks + 1;
    let mut k_cache = Vec::with_capacity(config.num_layers);
    let mut v_cache = Vec::with_capacity(config.num_layers);
    for _ in 0..config.num_layers {
        k_cache.push(stream.alloc_zeros::<bf16>(allocated * options.block_size * kv_dim)?);
        v_cache.push(stream.alloc_zeros::<bf16>(allocated * options.block_size * kv_dim)?);
    }
    Ok((num_blocks, k_cache, v_cache))
}

/// The KV cache of `fraction` of a GPU with `free` of `total` bytes free after the weights:
/// the fraction's bytes less what is in use and [`ACTIVATION_RESERVE`], refused when that is
/// not one block of `per_block` bytes.
fn kv_bytes_from_fraction(
    fraction: f64,
    free: usize,
    total: usize,
    per_block: usize,
) -> Result<usize, CudaError> {
    let allowed = (fraction * total as f64) as usize;
    let used = total.saturating_sub(free);
    let kv = allowed.saturating_sub(used + ACTIVATION_RESERVE).min(free);
    if kv < per_block {
        return Err(CudaError::Unsupported(format!(
            "gpu memory utilization {fraction} allows {:.2} GiB of this GPU's {:.2} GiB, but              {:.2} GiB are in use (weights) and {:.2} GiB are kept for activations: no room              for a KV block of {per_block} bytes",
            allowed as f64 / GIB,
            total as f64 / GIB,
            used as f64 / GIB,
            ACTIVATION_RESERVE as f64 / GIB,
        )));
    }
    Ok(kv)
}

const GIB: f64 = (1u64 << 30) as f64;

/// `[max_positions, head_dim]`: cos in the first half of a row, sin in the second, from the same
/// f64 angles as the CPU reference.
fn cos_sin_table(rope: &Rope, head_dim: usize, max_positions: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut table = vec![0f32; max_positions * head_dim];
    let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
    for (p, row) in table.chunks_exact_mut(head_dim).enumerate() {
        rope.cos_sin(p, &mut cos, &mut sin);
        row[..half].copy_from_slice(&cos);
        row[half..].copy_from_slice(&sin);
    }
    table
}

/// Page-locked host memory for the host tier (see [`CudaBackend::host_memory`]).
struct PinnedHostMemory {
    /// Owns the allocation (freed through its context on drop).
    _slice: strata_kernels::cudarc::driver::PinnedHostSlice<u8>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the allocation is plain host memory owned by this value; `PinnedHostSlice` is Send.
unsafe impl Send for PinnedHostMemory {}

impl HostMemory for PinnedHostMemory {
    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is `len` bytes this value owns, zeroed at allocation.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// `bytes` of page-locked host memory in `ctx` (plain memory, with a warning, when refused).
pub(crate) fn pinned_host_memory(
    ctx: &Arc<CudaContext>,
    bytes: usize,
) -> Result<Box<dyn HostMemory>, KvError> {
    if bytes == 0 {
        return Ok(Box::new(Vec::new()));
    }
    // SAFETY: the memory is zeroed below before anything reads it.
    let allocated = unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, CU_MEMHOSTALLOC_PORTABLE) };
    let mut slice = match allocated {
        Ok(slice) => slice,
        Err(e) => {
            eprintln!(
                "warning: cannot page-lock {} MiB for the KV host tier ({e}); using pageable \
                 memory (its copies are staged, slower)",
                bytes >> 20
            );
            return Ok(Box::new(vec![0u8; bytes]));
        }
    };
    let ptr = slice
        .as_mut_ptr()
        .map_err(|e| KvError::Config(format!("pinned memory: {e}")))?;
    // SAFETY: `ptr` is `bytes` long, just allocated.
    unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
    Ok(Box::new(PinnedHostMemory {
        _slice: slice,
        ptr,
        len: bytes,
    }))
}

impl KvBlockIo for CudaBackend {
    fn block_bytes(&self) -> usize {
        self.config.num_layers * 2 * self.block_size * self.shard.kv_rows.len() * 2
    }

    /// Layout: `[layer][k|v][slot][kv_dim]` bf16, little-endian ([`kv_copy`]).
    fn export_block(&self, id: BlockId, out: &mut [u8]) -> Result<(), KvError> {
        self.kv_copy.export(&self.kernels, &self.stream, id, out)
    }

    /// Queued on the copy stream out without waiting ([`kv_copy`]).
    fn export_block_queued(&self, id: BlockId, out: &mut [u8]) -> Result<(), KvError> {
        self.kv_copy
            .export_queued(&self.kernels, &self.stream, id, out)
    }

    fn settle(&self) -> Result<(), KvError> {
        self.kv_copy.settle()
    }

    /// Queued on the copy stream in without waiting; the device's stream waits for it
    /// ([`kv_copy`]).
    fn import_block(&mut self, id: BlockId, data: &[u8]) -> Result<(), KvError> {
        self.kv_copy.import(&self.kernels, &self.stream, id, data)
    }

    /// Page-locked (portable: every device's context may copy from it), zeroed once, so the
    /// host tier's copies are DMA. When the driver refuses, plain memory, with a warning: the
    /// tier works, its copies staged.
    fn host_memory(&mut self, bytes: usize) -> Result<Box<dyn HostMemory>, KvError> {
        pinned_host_memory(self.stream.context(), bytes)
    }
}

impl Backend for CudaBackend {
    fn kv_layout(&self) -> String {
        "cuda bf16 [layer][k|v][slot][kv_dim]".into()
    }

    fn model_config(&self) -> &ModelConfig {
        &self.config
    }

    fn decode_rows_per_weight_read(&self) -> Option<usize> {
        Some(strata_kernels::GEMV_MAX_M)
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn step(&mut self, seqs: &[StepSeq<'_>]) -> Result<Vec<f32>, BackendError> {
        self.run(seqs, &[])
            .map(|out| out.logits)
            .map_err(|e| BackendError::Device(e.to_string()))
    }

    /// One rank's hidden states are whole (the residual stream is replicated), but the
    /// tensor-parallel backend does not gather them yet: a single GPU embeds.
    fn embeds(&self) -> bool {
        self.shard.world == 1
    }

    fn step_sampling(
        &mut self,
        seqs: &[StepSeq<'_>],
        sampling: &[RowSampling<'_>],
    ) -> Result<StepOutput, BackendError> {
        self.run(seqs, sampling)
            .map_err(|e| BackendError::Device(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_the_kernels_do_not_take_are_refused_at_startup() {
        let text = include_str!("../../../../configs/llama-3.1-8b.json");
        let mut config = ModelConfig::from_json(text).unwrap();
        assert_eq!(check_model_shape(&config), Ok(()));
        for d in [32, 80, 96] {
            config.head_dim = d;
            let err = check_model_shape(&config).unwrap_err();
            assert!(err.contains(&format!("head_dim {d}")), "{err}");
        }
        config.head_dim = 64;
        config.intermediate_size = 1000;
        let err = check_model_shape(&config).unwrap_err();
        assert!(err.contains("intermediate_size (1000)"), "{err}");
        // Gemma 3 runs (its head_dim 256 too).
        config.intermediate_size = 14336;
        config.head_dim = 256;
        config.architecture = strata_model::config::Architecture::Gemma3;
        config.gemma3 = Some(strata_model::config::Gemma3 {
            query_pre_attn_scalar: 128.0,
            rope_local_theta: 10_000.0,
            sliding_layers: vec![true; config.num_layers],
            norm_offset: 0.0,
        });
        assert_eq!(check_model_shape(&config), Ok(()));
    }

    #[test]
    fn the_kv_cache_takes_what_the_fraction_leaves() {
        const G: usize = 1 << 30;
        // 140 GiB GPU, 16 GiB of weights in use: 90 % is 126 GiB, less 16 and the reserve.
        let kv = kv_bytes_from_fraction(0.9, 124 * G, 140 * G, 2 << 20).unwrap();
        let expected = (0.9 * (140 * G) as f64) as usize - 16 * G - ACTIVATION_RESERVE;
        assert_eq!(kv, expected);
        // Never more than is free, whatever the fraction says.
        let kv = kv_bytes_from_fraction(1.0, G, 140 * G, 2 << 20).unwrap_or(0);
        assert!(kv <= G);
        // A fraction below what the weights take is refused by name.
        let err = kv_bytes_from_fraction(0.1, 124 * G, 140 * G, 2 << 20).unwrap_err();
        assert!(
            err.to_string().contains("gpu memory utilization 0.1"),
            "{err}"
        );
    }
}
