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

use std::collections::HashMap;
use std::sync::Arc;

use half::bf16;
use strata_collective::{CollectiveError, DeviceCommunicator};
use strata_kernels::cudarc::driver::sys::{
    CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use strata_kernels::cudarc::driver::{
    CudaContext, CudaEvent, CudaGraph, CudaSlice, CudaStream, PinnedHostSlice,
};
use strata_kernels::{
    AttentionHeads, DECODE_SPLIT_TOKENS, DecodeBatch, GEMV_MAX_M, GemmOut, KernelError, Kernels,
    LtGemm, PagedKv, PrefillChunk, RopeKvShape, decode_workspace_elems,
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
    #[error(transparent)]
    Collective(#[from] CollectiveError),
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
    /// Replay decode-only steps through CUDA graphs, one per row bucket ([`GRAPH_BUCKETS`]) and
    /// block-table width; the same launches as the eager path, so the same bits.
    pub graphs: bool,
}

/// Row counts of decode-only steps that are replayed through CUDA graphs. A step is padded up to
/// the next bucket with rows that write to the reserved scratch block and whose outputs are
/// dropped; steps with more rows, or with any prompt row, run eagerly.
pub const GRAPH_BUCKETS: &[usize] = &[1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128];

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
    workspace_elems: usize,
    workspace: Option<CudaSlice<f32>>,
    /// Every per-step index (token ids, positions, slots, block tables, gather rows) packed
    /// into one buffer, uploaded with one copy; see [`Layout`].
    inputs: Option<CudaSlice<u32>>,
    /// Page-locked host memory the logits are copied into.
    logits_host: Option<PinnedHostSlice<f32>>,
}

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
    stream: Arc<CudaStream>,
    kernels: Kernels,
    gemm: LtGemm,
    weights: Weights,
    k_cache: Vec<CudaSlice<bf16>>,
    v_cache: Vec<CudaSlice<bf16>>,
    cos_sin: CudaSlice<f32>,
    max_positions: usize,
    block_size: usize,
    /// Blocks the scheduler may use; block `num_blocks` is the reserved scratch block that
    /// padding rows write to.
    num_blocks: usize,
    scratch: Scratch,
    graphs_enabled: bool,
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
        // One stream does all the work, so cudarc's cross-stream event tracking is not needed;
        // a stream of our own (not the legacy default stream) is what graph capture requires.
        // SAFETY: every buffer of this context is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
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
        // One block beyond the budget's count is the scratch block of padding rows.
        let num_blocks = (options.kv_cache_bytes / per_block.max(1)).max(1);
        let allocated = num_blocks + 1;
        let mut k_cache = Vec::with_capacity(config.num_layers);
        let mut v_cache = Vec::with_capacity(config.num_layers);
        for _ in 0..config.num_layers {
            k_cache.push(stream.alloc_zeros::<bf16>(allocated * options.block_size * kv_dim)?);
            v_cache.push(stream.alloc_zeros::<bf16>(allocated * options.block_size * kv_dim)?);
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
            graphs_enabled: options.graphs,
            graphs: HashMap::new(),
            comm: None,
            host_inputs: Vec::new(),
            profile: None,
            last_profile: None,
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

    /// Turns CUDA-graph replay of decode-only steps on or off (on by default, see
    /// [`CudaOptions::graphs`]). Both paths launch the same kernels on the same shapes, so a
    /// step's logits are bitwise the same either way (`strata gpu decode` checks it).
    pub fn set_graphs(&mut self, enabled: bool) {
        self.graphs_enabled = enabled;
    }

    /// Makes this backend a rank of `comm`'s group: from the next step on, the outputs of the
    /// row-parallel o and down projections are all-reduced through it (DESIGN.md §5). The
    /// communicator must enqueue on this backend's stream, so the collectives need no
    /// cross-stream waits and are captured into the decode graphs with everything else. This
    /// backend holds every weight, so only a one-rank group is accepted; a rank of a larger
    /// group needs weights sharded to its slice, which the backend does not load yet.
    pub fn attach_communicator(
        &mut self,
        comm: Box<dyn DeviceCommunicator>,
    ) -> Result<(), CudaError> {
        if comm.world_size() != 1 {
            return Err(CudaError::Unsupported(format!(
                "a CUDA backend holds every weight, so it can only be the one rank of a group; \
                 this group has {} ranks (sharded CUDA weights are not built yet)",
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
        self.graphs.clear();
        self.comm = Some(comm);
        Ok(())
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
        let c = &self.config;
        let (h, q, kv, i) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        for (n, k) in [(q, h), (kv, h), (h, q), (2 * i, h), (h, i)] {
            self.gemm.pin(n, k, GemmOut::Bf16)?;
        }
        self.gemm.pin(c.vocab_size, h, GemmOut::F32)?;
        Ok(())
    }

    /// Grows the step buffers for `plan`. Growing moves buffers that captured graphs point
    /// at, so it drops every graph.
    fn ensure_scratch(&mut self, plan: &Plan) -> Result<(), CudaError> {
        let c = &self.config;
        let s = &mut self.scratch;
        let stream = &self.stream;
        let mut moved = false;
        let rows = plan.rows;
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
            s.rows = rows;
            moved = true;
        }
        let decode = rows - plan.prompt;
        let work = decode_workspace_elems(decode, c.num_heads, c.head_dim, plan.max_context);
        if work > s.workspace_elems {
            s.workspace = Some(stream.alloc_zeros::<f32>(work)?);
            s.workspace_elems = work;
            moved = true;
        }
        if plan.logits > s.logits_rows {
            s.gathered = Some(stream.alloc_zeros::<bf16>(plan.logits * c.hidden_size)?);
            s.logits = Some(stream.alloc_zeros::<f32>(plan.logits * c.vocab_size)?);
            // SAFETY: plain page-locked memory (not write-combined: the host reads it).
            s.logits_host = Some(unsafe {
                stream
                    .context()
                    .alloc_pinned_with_flags::<f32>(plan.logits * c.vocab_size, 0)
            }?);
            s.logits_rows = plan.logits;
            moved = true;
        }
        let have = s.inputs.as_ref().map_or(0, |b| b.len());
        if plan.layout.len > have {
            s.inputs = Some(stream.alloc_zeros::<u32>(plan.layout.len.max(2 * have))?);
            moved = true;
        }
        if moved {
            self.graphs.clear();
        }
        Ok(())
    }

    fn run(&mut self, seqs: &[StepSeq<'_>]) -> Result<Vec<f32>, CudaError> {
        let bs = self.block_size;
        // Rows in device order: every sequence's prompt rows, then every decode row.
        let mut prompt_rows = Vec::new();
        let mut decode_rows = Vec::new();
        // Per prompt segment: (sequence, first row index in device order, rows).
        let mut segment_rows: Vec<(usize, usize, usize)> = Vec::new();
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
                if block as usize >= self.num_blocks {
                    return Err(CudaError::Unsupported(format!(
                        "block {block} is beyond the {} blocks of this backend",
                        self.num_blocks
                    )));
                }
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
                segment_rows.push((i, start, prompt_rows.len() - start));
            }
        }
        let p = prompt_rows.len();
        let mut rows: Vec<Row> = prompt_rows.into_iter().chain(decode_rows).collect();
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

        // A decode-only step replays a graph captured for its bucket: padded to the bucket's
        // rows, logits for every row, block tables as wide as the context's power-of-two split
        // count. Otherwise the step runs eagerly at its own shape.
        let bucket = (self.graphs_enabled && p == 0 && self.profile.is_none())
            .then(|| GRAPH_BUCKETS.iter().copied().find(|&b| b >= t))
            .flatten();
        let max_context = rows[p..].iter().map(|r| r.position + 1).max().unwrap_or(1);
        let (device_rows, max_context, width) = match bucket {
            Some(b) => {
                let splits = max_context
                    .div_ceil(DECODE_SPLIT_TOKENS)
                    .next_power_of_two();
                let context = (splits * DECODE_SPLIT_TOKENS).min(self.max_positions);
                (b, context, context.div_ceil(bs))
            }
            None => (t, max_context, max_context.div_ceil(bs)),
        };
        let scratch_slot = (self.num_blocks * bs) as u32;
        rows.extend((t..device_rows).map(|_| Row {
            seq: usize::MAX,
            token: 0,
            position: 0,
            slot: scratch_slot,
        }));
        let logits = if bucket.is_some() {
            device_rows
        } else {
            wanted.len()
        };
        let logits_prompt = wanted.iter().filter(|&&(_, row)| row < p).count();

        // Pack every index array into one upload.
        let decode = device_rows - p;
        let prefill_blocks: usize = segment_rows
            .iter()
            .map(|&(_, first, n)| rows[first + n - 1].position / bs + 1)
            .sum();
        let layout = Layout::new(device_rows, decode, width, logits, prefill_blocks);
        let host = &mut self.host_inputs;
        host.clear();
        host.resize(layout.len, 0);
        for (i, r) in rows.iter().enumerate() {
            host[layout.ids + i] = r.token;
            host[layout.positions + i] = r.position as u32;
            host[layout.slots + i] = r.slot;
        }
        for (d, r) in rows[p..].iter().enumerate() {
            host[layout.context_lens + d] = r.position as u32 + 1;
            let table = &mut host[layout.decode_tables + d * width..][..width];
            if r.seq == usize::MAX {
                table.fill(self.num_blocks as u32);
            } else {
                let n = r.position / bs + 1;
                table[..n].copy_from_slice(&seqs[r.seq].block_table[..n]);
            }
        }
        if bucket.is_some() {
            for (j, g) in host[layout.gather..][..logits].iter_mut().enumerate() {
                *g = j as u32;
            }
        } else {
            for (j, &(_, row)) in wanted.iter().enumerate() {
                host[layout.gather + j] = row as u32;
            }
        }
        let mut segments = Vec::with_capacity(segment_rows.len());
        let mut at = layout.prefill_tables;
        for &(i, first, n) in &segment_rows {
            let blocks = rows[first + n - 1].position / bs + 1;
            host[at..at + blocks].copy_from_slice(&seqs[i].block_table[..blocks]);
            segments.push(Segment {
                first,
                rows: n,
                start: rows[first].position,
                table: (at, blocks),
            });
            at += blocks;
        }
        let plan = Plan {
            rows: device_rows,
            prompt: p,
            segments,
            width,
            max_context,
            logits,
            logits_prompt,
            layout,
        };
        self.ensure_scratch(&plan)?;
        {
            let inputs = self.scratch.inputs.as_mut().expect("scratch allocated");
            self.stream
                .memcpy_htod(&self.host_inputs, &mut inputs.slice_mut(..layout.len))?;
        }

        match bucket {
            Some(b) => {
                let key = (b, width);
                if !self.graphs.contains_key(&key) {
                    let stream = self.stream.clone();
                    stream
                        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
                    let forward = self.forward(&plan);
                    // End the capture whatever happened, so the stream is usable again.
                    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
                    forward?;
                    let graph = graph?.ok_or_else(|| {
                        CudaError::Driver("stream capture produced no graph".into())
                    })?;
                    self.graphs.insert(key, SendGraph(graph));
                }
                self.graphs[&key].0.launch()?;
            }
            None => {
                if self.profile.is_some() {
                    self.mark("inputs")?;
                }
                self.forward(&plan)?;
            }
        }

        // Logits of the wanted rows, back to the order of `seqs`.
        let r = wanted.len();
        if r == 0 {
            self.finish_profile()?;
            return Ok(Vec::new());
        }
        let v = self.config.vocab_size;
        let s = &mut self.scratch;
        let logits_host = s.logits_host.as_mut().expect("scratch allocated");
        self.stream.memcpy_dtoh(
            &s.logits
                .as_ref()
                .expect("scratch allocated")
                .slice(..logits * v),
            logits_host,
        )?;
        // Event tracking is off, so the pinned slice cannot wait for its own copy: wait for the
        // stream before reading it.
        self.stream.synchronize()?;
        let host = logits_host.as_slice()?;
        // Device logits row of each wanted entry.
        let mut order: Vec<(usize, usize)> = wanted
            .iter()
            .enumerate()
            .map(|(j, &(seq, row))| (seq, if bucket.is_some() { row } else { j }))
            .collect();
        order.sort_unstable();
        let mut out = Vec::with_capacity(r * v);
        for (_, j) in order {
            out.extend_from_slice(&host[j * v..(j + 1) * v]);
        }
        self.finish_profile()?;
        Ok(out)
    }

    /// Records a profiling event after the launches of `family` (when profiling).
    fn mark(&mut self, family: &'static str) -> Result<(), CudaError> {
        mark(&mut self.profile, &self.stream, family)
    }

    fn finish_profile(&mut self) -> Result<(), CudaError> {
        let Some(events) = self.profile.take() else {
            return Ok(());
        };
        self.stream.synchronize()?;
        let mut profile = StepProfile::default();
        for pair in events.windows(2) {
            let ms = f64::from(pair[0].1.elapsed_ms(&pair[1].1)?);
            let family = pair[1].0;
            match profile.families.iter_mut().find(|f| f.0 == family) {
                Some(f) => {
                    f.1 += ms;
                    f.2 += 1;
                }
                None => profile.families.push((family, ms, 1)),
            }
        }
        self.last_profile = Some(profile);
        Ok(())
    }

    /// Every launch of one step, reading the packed inputs already on the device. Launches
    /// only (no allocation, copy or synchronization), so it can be captured into a graph.
    fn forward(&mut self, plan: &Plan) -> Result<(), CudaError> {
        let Self {
            config: c,
            stream,
            kernels: k,
            gemm,
            weights: w,
            k_cache,
            v_cache,
            cos_sin,
            max_positions,
            block_size: bs,
            num_blocks,
            scratch: s,
            profile,
            comm,
            ..
        } = self;
        let bs = *bs;
        let (t, p) = (plan.rows, plan.prompt);
        let (h, qd, kvd, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let eps = c.rms_norm_eps as f32;
        let heads = AttentionHeads {
            n_q_heads: c.num_heads,
            n_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            window: c.sliding_window.unwrap_or(0),
            scale: 1.0 / (c.head_dim as f32).sqrt(),
        };
        // The reserved scratch block is addressable too (padding rows write into it).
        let blocks = *num_blocks + 1;
        let rope_shape = RopeKvShape {
            tokens: t,
            q_heads: c.num_heads,
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            max_positions: *max_positions,
            num_blocks: blocks,
            block_size: bs,
        };
        let lay = plan.layout;
        let inputs = s.inputs.as_ref().expect("scratch allocated");
        let at = |offset: usize, len: usize| inputs.slice(offset..offset + len);
        let ids = at(lay.ids, t);
        let positions = at(lay.positions, t);
        let slots = at(lay.slots, t);
        macro_rules! buf {
            ($name:ident) => {
                s.$name.as_mut().expect("scratch allocated")
            };
        }
        macro_rules! get {
            ($name:ident) => {
                s.$name.as_ref().expect("scratch allocated")
            };
        }

        k.embed(stream, buf!(residual), &w.embed, &ids, t, h, c.vocab_size)?;
        let normed = s.normed.as_mut().expect("scratch allocated");
        k.rmsnorm(
            stream,
            normed,
            get!(residual),
            &w.layers[0].input_norm,
            t,
            h,
            eps,
        )?;
        mark(profile, stream, "embed+norm")?;
        for (l, layer) in w.layers.iter().enumerate() {
            {
                let normed = get!(normed);
                let (q, kk, v) = (
                    s.q.as_mut().expect("scratch allocated"),
                    s.k.as_mut().expect("scratch allocated"),
                    s.v.as_mut().expect("scratch allocated"),
                );
                if p > 0 {
                    let x = normed.slice(..p * h);
                    for (y, wt, n) in [(q, &layer.q, qd), (kk, &layer.k, kvd), (v, &layer.v, kvd)] {
                        let mut out = y.slice_mut(..p * n);
                        gemm.matmul(&mut out, &x, wt, p, n, h, GemmOut::Bf16)?;
                    }
                }
                let (q, kk, v) = (
                    s.q.as_mut().expect("scratch allocated"),
                    s.k.as_mut().expect("scratch allocated"),
                    s.v.as_mut().expect("scratch allocated"),
                );
                let mut row = p;
                while row < t {
                    let m = (t - row).min(GEMV_MAX_M);
                    k.gemv3(
                        stream,
                        [
                            &mut q.slice_mut(row * qd..(row + m) * qd),
                            &mut kk.slice_mut(row * kvd..(row + m) * kvd),
                            &mut v.slice_mut(row * kvd..(row + m) * kvd),
                        ],
                        &normed.slice(row * h..(row + m) * h),
                        [&layer.q.as_view(), &layer.k.as_view(), &layer.v.as_view()],
                        m,
                        [qd, kvd, kvd],
                        h,
                    )?;
                    row += m;
                }
            }
            mark(profile, stream, "qkv")?;
            if let Some([bq, bk, bv]) = &layer.qkv_bias {
                k.add_bias(stream, buf!(q), bq, t, qd)?;
                k.add_bias(stream, buf!(k), bk, t, kvd)?;
                k.add_bias(stream, buf!(v), bv, t, kvd)?;
            }
            if let Some([nq, nk]) = &layer.qk_norm {
                k.head_rmsnorm(stream, buf!(q), nq, t * c.num_heads, c.head_dim, eps)?;
                k.head_rmsnorm(stream, buf!(k), nk, t * c.num_kv_heads, c.head_dim, eps)?;
            }
            {
                let (q, kk, v) = (
                    s.q.as_mut().expect("scratch allocated"),
                    s.k.as_mut().expect("scratch allocated"),
                    s.v.as_ref().expect("scratch allocated"),
                );
                k.rope_kv_write(
                    stream,
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
            mark(profile, stream, "bias+norm+rope")?;
            {
                let cache = PagedKv {
                    k: k_cache[l].as_view(),
                    v: v_cache[l].as_view(),
                    block_size: bs,
                    num_blocks: blocks,
                };
                let q = get!(q);
                let attn = s.attn.as_mut().expect("scratch allocated");
                for seg in &plan.segments {
                    let (first, n) = (seg.first, seg.rows);
                    let chunk = PrefillChunk {
                        q: q.slice(first * qd..(first + n) * qd),
                        block_table: at(seg.table.0, seg.table.1),
                        start: seg.start,
                        n_new: n,
                    };
                    let mut out = attn.slice_mut(first * qd..(first + n) * qd);
                    k.prefill_attention(stream, &heads, &cache, &chunk, &mut out)?;
                }
                if !plan.segments.is_empty() {
                    mark(profile, stream, "prefill attention")?;
                }
                if t > p {
                    let batch = DecodeBatch {
                        q: q.slice(p * qd..t * qd),
                        block_tables: at(lay.decode_tables, (t - p) * plan.width),
                        max_blocks_per_seq: plan.width,
                        context_lens: at(lay.context_lens, t - p),
                        max_context: plan.max_context,
                    };
                    let work =
                        decode_workspace_elems(t - p, c.num_heads, c.head_dim, plan.max_context);
                    let mut workspace = s
                        .workspace
                        .as_mut()
                        .expect("scratch allocated")
                        .slice_mut(..work);
                    let mut out = attn.slice_mut(p * qd..t * qd);
                    k.decode_attention(stream, &heads, &cache, &batch, &mut workspace, &mut out)?;
                    mark(profile, stream, "decode attention")?;
                }
            }
            linear(
                k,
                gemm,
                stream,
                buf!(proj),
                get!(attn),
                &layer.o,
                t,
                p,
                h,
                qd,
            )?;
            // Row-parallel: each rank holds a partial sum until the all-reduce (before the
            // bias, which is added once).
            if let Some(comm) = comm.as_deref_mut() {
                comm.all_reduce_sum(buf!(proj).slice_mut(..t * h).into())?;
            }
            if let Some(bias) = &layer.o_bias {
                k.add_bias(stream, buf!(proj), bias, t, h)?;
            }
            mark(profile, stream, "o")?;
            {
                let (normed, residual) = (
                    s.normed.as_mut().expect("scratch allocated"),
                    s.residual.as_mut().expect("scratch allocated"),
                );
                k.add_rmsnorm(
                    stream,
                    normed,
                    residual,
                    get!(proj),
                    &layer.post_norm,
                    t,
                    h,
                    eps,
                )?;
            }
            mark(profile, stream, "add+norm")?;
            {
                let gate_up = s.gate_up.as_mut().expect("scratch allocated");
                linear(
                    k,
                    gemm,
                    stream,
                    gate_up,
                    get!(normed),
                    &layer.gate_up,
                    t,
                    p,
                    2 * inter,
                    h,
                )?;
            }
            mark(profile, stream, "gate_up")?;
            {
                let act = s.act.as_mut().expect("scratch allocated");
                k.silu_mul(stream, act, get!(gate_up), t, inter)?;
            }
            mark(profile, stream, "silu_mul")?;
            {
                let proj = s.proj.as_mut().expect("scratch allocated");
                linear(
                    k,
                    gemm,
                    stream,
                    proj,
                    get!(act),
                    &layer.down,
                    t,
                    p,
                    h,
                    inter,
                )?;
            }
            if let Some(comm) = comm.as_deref_mut() {
                comm.all_reduce_sum(buf!(proj).slice_mut(..t * h).into())?;
            }
            mark(profile, stream, "down")?;
            let next_norm = w
                .layers
                .get(l + 1)
                .map_or(&w.final_norm, |next| &next.input_norm);
            let (normed, residual) = (
                s.normed.as_mut().expect("scratch allocated"),
                s.residual.as_mut().expect("scratch allocated"),
            );
            k.add_rmsnorm(stream, normed, residual, get!(proj), next_norm, t, h, eps)?;
            mark(profile, stream, "add+norm")?;
        }

        // Logits of the gathered rows, through the path of each row's role.
        let r = plan.logits;
        if r == 0 {
            return Ok(());
        }
        {
            let gathered = s.gathered.as_mut().expect("scratch allocated");
            k.embed(stream, gathered, get!(normed), &at(lay.gather, r), r, h, t)?;
        }
        let head = w.lm_head.as_ref().unwrap_or(&w.embed);
        let v = c.vocab_size;
        let logits = s.logits.as_mut().expect("scratch allocated");
        let gathered = get!(gathered);
        let lp = plan.logits_prompt;
        if lp > 0 {
            let mut y = logits.slice_mut(..lp * v);
            let x = gathered.slice(..lp * h);
            gemm.matmul(&mut y, &x, head, lp, v, h, GemmOut::F32)?;
        }
        let mut row = lp;
        while row < r {
            let m = (r - row).min(GEMV_MAX_M);
            let mut y = logits.slice_mut(row * v..(row + m) * v);
            let x = gathered.slice(row * h..(row + m) * h);
            k.gemv_f32(stream, &mut y, &x, head, m, v, h)?;
            row += m;
        }
        mark(profile, stream, "lm head")?;
        Ok(())
    }
}

/// Records a CUDA event on `stream` after the launches of `family`, when profiling.
fn mark(
    profile: &mut Option<Vec<(&'static str, CudaEvent)>>,
    stream: &Arc<CudaStream>,
    family: &'static str,
) -> Result<(), CudaError> {
    if let Some(events) = profile.as_mut() {
        events.push((
            family,
            stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
        ));
    }
    Ok(())
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
