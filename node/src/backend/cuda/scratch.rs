//! A step's device buffers, grouped by what is allocated together: the activations of its rows,
//! the logits rows with their way to the host, attention's decode workspace, the packed inputs,
//! and the sampling buffers the readback grows itself. Each group is grown to the largest step
//! seen; growing moves buffers captured graphs point at, so it drops every graph.

use std::sync::Arc;

use half::bf16;
use strata_kernels::cudarc::driver::{CudaSlice, CudaStream, PinnedHostSlice};
use strata_kernels::decode_workspace_elems;
use strata_model::ModelConfig;
use strata_model::cpu::TpLayout;

use super::moe::MoeScratch;
use super::row_parallel::ROW_SHARDS;
use super::{CudaError, Plan};

/// The activations of a step's rows (`rows` of each, this rank's widths).
pub(super) struct Activations {
    pub(super) rows: usize,
    /// The residual stream, `[rows][hidden]`.
    pub(super) residual: CudaSlice<bf16>,
    /// The residual stream normed for the next projection, `[rows][hidden]`.
    pub(super) normed: CudaSlice<bf16>,
    pub(super) q: CudaSlice<bf16>,
    pub(super) k: CudaSlice<bf16>,
    pub(super) v: CudaSlice<bf16>,
    /// Attention's output, `[rows][q]`.
    pub(super) attn: CudaSlice<bf16>,
    /// A block's output (o or down), `[rows][hidden]`.
    pub(super) proj: CudaSlice<bf16>,
    /// `[rows][2 · inter]`: gate then up.
    pub(super) gate_up: CudaSlice<bf16>,
    /// The gated product, `[rows][inter]`.
    pub(super) act: CudaSlice<bf16>,
    /// The eight shard partials of a row-parallel projection, `[8][rows][hidden]` f32, when the
    /// backend computes the shard order.
    pub(super) partials: Option<CudaSlice<f32>>,
    /// This rank's own partials before the all-gather, `[8 / world][rows][hidden]` (TP > 1).
    pub(super) local_partials: Option<CudaSlice<f32>>,
    /// Routing and expert outputs of a mixture of experts.
    pub(super) moe: Option<MoeScratch>,
}

impl Activations {
    fn new(
        stream: &Arc<CudaStream>,
        c: &ModelConfig,
        d: &TpLayout,
        row_shards: usize,
        rows: usize,
    ) -> Result<Self, CudaError> {
        let alloc = |n: usize| stream.alloc_zeros::<bf16>(rows * n);
        let h = c.hidden_size;
        let (partials, local_partials) = if row_shards > 0 {
            let local = if d.world > 1 {
                Some(stream.alloc_zeros::<f32>(row_shards * rows * h)?)
            } else {
                None
            };
            (
                Some(stream.alloc_zeros::<f32>(ROW_SHARDS * rows * h)?),
                local,
            )
        } else {
            (None, None)
        };
        Ok(Self {
            rows,
            residual: alloc(h)?,
            normed: alloc(h)?,
            q: alloc(d.q_rows.len())?,
            k: alloc(d.kv_rows.len())?,
            v: alloc(d.kv_rows.len())?,
            attn: alloc(d.q_rows.len())?,
            proj: alloc(h)?,
            gate_up: alloc(2 * d.inter_rows.len())?,
            act: alloc(d.inter_rows.len())?,
            partials,
            local_partials,
            moe: c
                .moe
                .as_ref()
                .map(|moe| MoeScratch::new(stream, moe, h, rows))
                .transpose()?,
        })
    }
}

/// The logits rows of a step: gathered hidden rows, this rank's vocabulary columns, every
/// rank's (TP > 1), and the page-locked host buffer they are copied into.
pub(super) struct LogitBuffers {
    pub(super) rows: usize,
    pub(super) gathered: CudaSlice<bf16>,
    /// This rank's vocabulary columns, `[rows][vocab_per_rank]`.
    pub(super) device: CudaSlice<f32>,
    /// Every rank's, all-gathered in rank order, `[world][rows][vocab_per_rank]` (TP > 1).
    pub(super) all: Option<CudaSlice<f32>>,
    pub(super) host: PinnedHostSlice<f32>,
}

impl LogitBuffers {
    fn new(
        stream: &Arc<CudaStream>,
        c: &ModelConfig,
        d: &TpLayout,
        rows: usize,
    ) -> Result<Self, CudaError> {
        let per_rank = rows * d.vocab_per_rank;
        Ok(Self {
            rows,
            gathered: stream.alloc_zeros::<bf16>(rows * c.hidden_size)?,
            device: stream.alloc_zeros::<f32>(per_rank)?,
            all: if d.world > 1 {
                Some(stream.alloc_zeros::<f32>(d.world * per_rank)?)
            } else {
                None
            },
            // SAFETY: plain page-locked memory (not write-combined: the host reads it).
            host: unsafe {
                stream
                    .context()
                    .alloc_pinned_with_flags::<f32>(d.world * per_rank, 0)
            }?,
        })
    }
}

/// Per-step device buffers, grown to the largest step seen.
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) act: Option<Activations>,
    pub(super) logits: Option<LogitBuffers>,
    /// Decode attention's split-K workspace.
    pub(super) workspace: Option<CudaSlice<f32>>,
    /// Every per-step index (token ids, positions, slots, block tables, gather rows) packed
    /// into one buffer, uploaded with one copy; see `Layout`.
    pub(super) inputs: Option<CudaSlice<u32>>,
    /// The greedy token of each logits row, when the step samples greedily on the device.
    pub(super) tokens: Option<CudaSlice<u32>>,
    /// Seeded sampling's per-row inputs (plans, rows, shaping) and outputs (heads, candidates).
    pub(super) sample_in: Option<CudaSlice<u32>>,
    pub(super) sample_out: Option<CudaSlice<u32>>,
}

/// The buffers a step's launches use, borrowed apart so each can be mutated alone.
pub(super) struct StepBuffers<'a> {
    pub(super) act: &'a mut Activations,
    pub(super) logits: &'a mut LogitBuffers,
    pub(super) workspace: &'a mut CudaSlice<f32>,
    pub(super) inputs: &'a CudaSlice<u32>,
}

impl Scratch {
    /// Grows the buffers for `plan`; true when any moved (captured graphs then point at freed
    /// memory and must be dropped).
    pub(super) fn ensure(
        &mut self,
        stream: &Arc<CudaStream>,
        c: &ModelConfig,
        d: &TpLayout,
        row_shards: usize,
        plan: &Plan,
    ) -> Result<bool, CudaError> {
        let mut moved = false;
        if self.act.as_ref().is_none_or(|a| a.rows < plan.rows) {
            // The old buffers go first: two copies of a large step's need not fit together.
            self.act = None;
            self.act = Some(Activations::new(stream, c, d, row_shards, plan.rows)?);
            moved = true;
        }
        let decode = plan.rows - plan.prompt;
        let work = decode_workspace_elems(decode, d.heads, c.head_dim, plan.max_context).max(1);
        if self.workspace.as_ref().is_none_or(|w| w.len() < work) {
            self.workspace = None;
            self.workspace = Some(stream.alloc_zeros::<f32>(work)?);
            moved = true;
        }
        let rows = plan.logits.max(1);
        if self.logits.as_ref().is_none_or(|l| l.rows < rows) {
            self.logits = None;
            self.logits = Some(LogitBuffers::new(stream, c, d, rows)?);
            moved = true;
        }
        let have = self.inputs.as_ref().map_or(0, |b| b.len());
        if plan.layout.len > have {
            self.inputs = Some(stream.alloc_zeros::<u32>(plan.layout.len.max(2 * have))?);
            moved = true;
        }
        Ok(moved)
    }

    /// The buffers of a step [`Scratch::ensure`] has sized.
    pub(super) fn step(&mut self) -> Result<StepBuffers<'_>, CudaError> {
        match (
            self.act.as_mut(),
            self.logits.as_mut(),
            self.workspace.as_mut(),
            self.inputs.as_ref(),
        ) {
            (Some(act), Some(logits), Some(workspace), Some(inputs)) => Ok(StepBuffers {
                act,
                logits,
                workspace,
                inputs,
            }),
            _ => Err(CudaError::Unsupported(
                "a step's buffers were used before they were sized".to_string(),
            )),
        }
    }

    /// The logits buffers of the last step.
    pub(super) fn logits(&mut self) -> Result<&mut LogitBuffers, CudaError> {
        self.logits.as_mut().ok_or_else(|| {
            CudaError::Unsupported("logits were read before any step ran".to_string())
        })
    }
}
