//! The row-parallel projections (o and down) and the GEMM shapes of a tensor-parallel rank.
//!
//! In the shard order (DESIGN.md §5), `y = x · wᵀ` is the sum of [`ROW_SHARDS`] f32 partials over
//! fixed K-slices of `w`'s columns, added in shard order from shard 0 and rounded to bf16 once. A
//! rank holding `8 / world` of the slices computes its partials (the shard GEMV for decode rows,
//! one sliced GEMM per shard for prompt rows), an all-gather puts all eight in shard order on
//! every rank, and every rank adds them. A K-slice's partial is bitwise the same on any rank and
//! at any TP degree (`strata kernels selftest` checks both kernels), so are the sums.

use std::sync::Arc;

use half::bf16;
use strata_collective::DeviceCommunicator;
use strata_kernels::cudarc::driver::{CudaSlice, CudaStream};
use strata_kernels::{GEMV_MAX_M, GemmOut, GemmShape, Kernels, LtGemm};
use strata_model::ModelConfig;
use strata_model::cpu::{PartialsFault, TpLayout};

use super::CudaError;
use super::matmul::{Role, gemm_weight, linear};
use super::weights::Matrix;

/// K-slices of a row-parallel projection in the shard order: its partials are the same at every
/// TP degree that divides it.
pub const ROW_SHARDS: usize = 8;

/// The weight shapes a backend multiplies by, each with the algorithm of the whole model's shape
/// (`algo_n`), so a rank's GEMM of a column slice runs TP = 1's algorithm.
pub(super) struct GemmShapes {
    pub(super) q: GemmShape,
    pub(super) kv: GemmShape,
    pub(super) gate_up: GemmShape,
    pub(super) lm_head: GemmShape,
    /// o and down: whole (fused order) or one K-slice (shard order).
    pub(super) o: GemmShape,
    pub(super) down: GemmShape,
}

impl GemmShapes {
    pub(super) fn all(&self) -> [GemmShape; 6] {
        [
            self.q,
            self.kv,
            self.gate_up,
            self.lm_head,
            self.o,
            self.down,
        ]
    }
}

pub(super) fn gemm_shapes(c: &ModelConfig, d: &TpLayout, row_shards: usize) -> GemmShapes {
    let h = c.hidden_size;
    let column = |n: usize, algo_n: usize, out| GemmShape {
        n,
        k: h,
        ld: h,
        out,
        algo_n,
    };
    let row = |k_local: usize, k_full: usize| {
        if row_shards == 0 {
            GemmShape::new(h, k_full, GemmOut::Bf16)
        } else {
            GemmShape {
                n: h,
                k: k_full / ROW_SHARDS,
                ld: k_local,
                out: GemmOut::F32,
                algo_n: h,
            }
        }
    };
    let inter = d.inter_rows.len();
    GemmShapes {
        q: column(d.q_rows.len(), c.q_dim(), GemmOut::Bf16),
        kv: column(d.kv_rows.len(), c.kv_dim(), GemmOut::Bf16),
        gate_up: column(2 * inter, 2 * c.intermediate_size, GemmOut::Bf16),
        lm_head: column(
            d.vocab_per_rank,
            c.vocab_size.next_multiple_of(8),
            GemmOut::F32,
        ),
        o: row(d.q_rows.len(), c.q_dim()),
        down: row(inter, c.intermediate_size),
    }
}

/// One row-parallel projection's view of the backend.
pub(super) struct RowParallel<'a> {
    pub(super) kernels: &'a Kernels,
    pub(super) gemm: &'a mut LtGemm,
    pub(super) stream: &'a Arc<CudaStream>,
    /// The backend's buffer block weights are dequantized into for the GEMM.
    pub(super) dequant: Option<&'a mut CudaSlice<bf16>>,
    pub(super) comm: Option<&'a mut (dyn DeviceCommunicator + 'static)>,
    /// `[8][rows][n]` f32 (shard order only).
    pub(super) partials: Option<&'a mut CudaSlice<f32>>,
    /// `[8 / world][rows][n]` f32 (shard order, TP > 1).
    pub(super) local: Option<&'a mut CudaSlice<f32>>,
    /// Shards this rank computes, 0 for the fused order.
    pub(super) shards: usize,
    pub(super) world: usize,
    pub(super) fault: PartialsFault,
    pub(super) rows: usize,
    pub(super) prompt: usize,
    /// Every row in the run order (fused order only: the backend refuses it with shards).
    pub(super) run_order: bool,
}

impl RowParallel<'_> {
    /// `y[rows, n] = x[rows, k_local] · wᵀ` with `w` `[n, k_local]`, this rank's columns of a
    /// `[n, k_full]` weight.
    pub(super) fn project(
        &mut self,
        y: &mut CudaSlice<bf16>,
        x: &CudaSlice<bf16>,
        w: &Matrix,
        n: usize,
        (k_local, k_full): (usize, usize),
    ) -> Result<(), CudaError> {
        let (rows, prompt) = (self.rows, self.prompt);
        if self.shards == 0 {
            let shape = GemmShape::new(n, k_full, GemmOut::Bf16);
            linear(
                self.kernels,
                Role::Narrow,
                self.gemm,
                self.stream,
                self.dequant.as_deref_mut(),
                y,
                x,
                w,
                (rows, prompt, self.run_order),
                shape,
            )?;
            // One rank through a communicator: the all-reduce of a one-rank group.
            if let Some(comm) = self.comm.as_deref_mut() {
                comm.all_reduce_sum(y.slice_mut(..rows * n).into())?;
            }
            return Ok(());
        }
        let (shards, kslice, stride) = (self.shards, k_full / ROW_SHARDS, rows * n);
        let partials = self.partials.as_deref_mut().expect("scratch allocated");
        let target = match self.local.as_deref_mut() {
            Some(local) if self.world > 1 => local,
            _ => &mut *partials,
        };
        let shape = GemmShape {
            n,
            k: kslice,
            ld: k_local,
            out: GemmOut::F32,
            algo_n: n,
        };
        if prompt > 0 {
            let wide = gemm_weight(
                self.kernels,
                self.stream,
                self.dequant.as_deref_mut(),
                w,
                (n, k_local),
            )?;
            for s in 0..shards {
                let mut out = target.slice_mut(s * stride..s * stride + prompt * n);
                let (xs, ws) = (x.slice(s * kslice..), wide.slice(s * kslice..));
                self.gemm.matmul_shape(&mut out, &xs, &ws, prompt, shape)?;
            }
        }
        let mut row = prompt;
        while row < rows {
            let m = (rows - row).min(GEMV_MAX_M);
            let mut out = target.slice_mut(row * n..);
            let xs = x.slice(row * k_local..);
            match w {
                Matrix::Bf16(w) => self.kernels.gemv_shards(
                    self.stream,
                    &mut out,
                    &xs,
                    w,
                    (m, n),
                    (shards, kslice, k_local),
                    stride,
                )?,
                Matrix::Tiles { .. } => {
                    return Err(CudaError::Unsupported(
                        "a tiled weight in the shard order (the loader keeps blocks there)".into(),
                    ));
                }
                Matrix::Blocks { format, data } => self.kernels.gemv_shards_blocks(
                    self.stream,
                    &mut out,
                    &xs,
                    data,
                    *format,
                    (m, n),
                    (shards, kslice, k_local),
                    stride,
                )?,
            }
            row += m;
        }
        let mut y = y.slice_mut(..stride);
        if self.world == 1 {
            self.kernels
                .sum_shards(self.stream, &mut y, &*partials, ROW_SHARDS, stride, stride)?;
            return Ok(());
        }
        let local = self.local.as_deref().expect("scratch allocated");
        if self.fault == PartialsFault::LocalSumOnly {
            // The canary: each rank adds only its own shards.
            self.kernels
                .sum_shards(self.stream, &mut y, local, shards, stride, stride)?;
            return Ok(());
        }
        let comm = self.comm.as_deref_mut().ok_or(CudaError::NoCommunicator)?;
        comm.all_gather(
            local.slice(..shards * stride).into(),
            partials.slice_mut(..ROW_SHARDS * stride).into(),
        )?;
        self.kernels
            .sum_shards(self.stream, &mut y, &*partials, ROW_SHARDS, stride, stride)?;
        Ok(())
    }
}
