//! One step's launches (`CudaBackend::forward`): the embedding, each layer as its four
//! operations (q/k/v, attention, its output into the residual, the MLP) over the step's buffers,
//! and the logits of the gathered rows. Launches only — no allocation, copy or synchronization —
//! so a decode step can be captured into a graph.

use std::sync::Arc;

use half::bf16;
use strata_collective::DeviceCommunicator;
use strata_kernels::cudarc::driver::sys::CUevent_flags;
use strata_kernels::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView};
use strata_kernels::tiles::tile_config;
use strata_kernels::{
    AttentionHeads, DecodeBatch, GEMV_MAX_M, GateActivation, Kernels, LtGemm, PagedKv,
    PrefillChunk, RopeKvShape, decode_workspace_elems,
};
use strata_model::ModelConfig;
use strata_model::cpu::{PartialsFault, TpLayout};

use super::matmul::{Role, gemm_weight, gemv, linear, runs};
use super::moe::{self, Mlp};
use super::row_parallel::{GemmShapes, RowParallel, gemm_shapes};
use super::scratch::{Activations, LogitBuffers};
use super::weights::{Layer, Matrix, Norm, Weights};
use super::{CudaBackend, CudaError, Plan};

impl CudaBackend {
    /// Every launch of one step, reading the packed inputs already on the device. Launches
    /// only (no allocation, copy or synchronization), so it can be captured into a graph.
    pub(super) fn forward(&mut self, plan: &Plan) -> Result<(), CudaError> {
        let Self {
            config,
            shard,
            row_shards,
            fault,
            stream,
            kernels,
            gemm,
            weights: w,
            k_cache,
            v_cache,
            cos_sin,
            cos_sin_local,
            max_positions,
            block_size,
            num_blocks,
            scratch,
            profile,
            comm,
            decode_gemm,
            run_order,
            moe_grouped,
            dequant,
            ..
        } = self;
        let buffers = scratch.step()?;
        let a = buffers.act;
        let mut step = Launch {
            c: config,
            d: shard,
            k: kernels,
            stream,
            gemm,
            dequant: dequant.as_mut(),
            comm: comm.as_deref_mut(),
            profile,
            plan,
            inputs: buffers.inputs,
            shapes: gemm_shapes(config, shard, *row_shards),
            row_shards: *row_shards,
            fault: *fault,
            decode_gemm: *decode_gemm,
            run_order: *run_order,
            moe_grouped: *moe_grouped,
            eps: config.rms_norm_eps as f32,
            block_size: *block_size,
            // The reserved scratch block is addressable too (padding rows write into it).
            blocks: *num_blocks + 1,
            max_positions: *max_positions,
        };
        step.embed(w, a)?;
        for (l, layer) in w.layers.iter().enumerate() {
            let rope = match cos_sin_local {
                Some(local) if config.local_rope(l) => &*local,
                _ => &*cos_sin,
            };
            step.qkv(layer, a)?;
            let cache = (&mut k_cache[l], &mut v_cache[l]);
            step.attention(l, layer, a, cache, rope, buffers.workspace)?;
            step.attention_out(layer, a)?;
            let next = w.layers.get(l + 1).map_or(&w.final_norm, |n| &n.input_norm);
            step.mlp(layer, next, a)?;
        }
        step.logits(w, a, buffers.logits)
    }
}

/// The backend's parts one step's launches read, borrowed apart from its buffers.
struct Launch<'a> {
    c: &'a ModelConfig,
    d: &'a TpLayout,
    k: &'a Kernels,
    stream: &'a Arc<CudaStream>,
    gemm: &'a mut LtGemm,
    dequant: Option<&'a mut CudaSlice<bf16>>,
    comm: Option<&'a mut (dyn DeviceCommunicator + 'static)>,
    profile: &'a mut Option<Vec<(&'static str, CudaEvent)>>,
    plan: &'a Plan,
    inputs: &'a CudaSlice<u32>,
    shapes: GemmShapes,
    row_shards: usize,
    fault: PartialsFault,
    /// Decode rows through the pinned GEMM too.
    decode_gemm: bool,
    /// Every row in the run order (`CudaBackend::set_run_order`).
    run_order: bool,
    /// Experts through the grouped launches (`CudaBackend::set_moe_grouped`).
    moe_grouped: bool,
    eps: f32,
    block_size: usize,
    /// KV blocks addressable by the kernels (the reserved scratch block included).
    blocks: usize,
    max_positions: usize,
}

impl Launch<'_> {
    fn mark(&mut self, family: &'static str) -> Result<(), CudaError> {
        mark(self.profile, self.stream, family)
    }

    /// `len` words of the packed inputs from `offset`.
    fn at(&self, offset: usize, len: usize) -> CudaView<'_, u32> {
        self.inputs.slice(offset..offset + len)
    }

    /// Rows whose projections take the pinned GEMM: the prompt rows, every row, or none (the
    /// run order).
    fn gemm_rows(&self) -> usize {
        if self.run_order {
            0
        } else if self.decode_gemm {
            self.plan.rows
        } else {
            self.plan.prompt
        }
    }

    /// The row-parallel projection of the step's rows, through `partials` when in the shard
    /// order.
    fn row_parallel<'b>(
        &'b mut self,
        partials: Option<&'b mut CudaSlice<f32>>,
        local: Option<&'b mut CudaSlice<f32>>,
    ) -> RowParallel<'b> {
        let prompt = self.gemm_rows();
        RowParallel {
            kernels: self.k,
            gemm: self.gemm,
            stream: self.stream,
            dequant: self.dequant.as_deref_mut(),
            comm: self.comm.as_deref_mut(),
            partials,
            local,
            shards: self.row_shards,
            world: self.d.world,
            fault: self.fault,
            rows: self.plan.rows,
            prompt,
            run_order: self.run_order,
        }
    }

    /// The embedded rows into the residual (scaled for Gemma 3), and the first layer's norm.
    fn embed(&mut self, w: &Weights, a: &mut Activations) -> Result<(), CudaError> {
        let (k, stream, d) = (self.k, self.stream, self.d);
        let (t, h) = (self.plan.rows, self.c.hidden_size);
        let ids = self.at(self.plan.layout.ids, t);
        // Vocabulary-parallel: a rank fills foreign ids' rows with -0.0, and the all-reduce
        // returns the owner's row bit for bit.
        let fill = if d.world > 1 {
            bf16::NEG_ZERO
        } else {
            bf16::ZERO
        };
        match &w.embed {
            Matrix::Bf16(table) => k.embed_rows(
                stream,
                &mut a.residual,
                table,
                &ids,
                t,
                h,
                d.vocab.clone(),
                fill,
            )?,
            Matrix::Tiles { .. } => {
                return Err(CudaError::Unsupported(
                    "an embedding table in tiles (tiles hold projections only)".into(),
                ));
            }
            Matrix::Blocks { format, data } => k.embed_rows_blocks(
                stream,
                &mut a.residual,
                data,
                *format,
                &ids,
                t,
                h,
                d.vocab.clone(),
                fill,
            )?,
        }
        if d.world > 1 {
            let comm = self.comm.as_deref_mut().ok_or(CudaError::NoCommunicator)?;
            comm.all_reduce_sum(a.residual.slice_mut(..t * h).into())?;
        }
        if self.c.gemma3.is_some() {
            // √hidden rounded once to f32, as the CPU reference and llama.cpp scale.
            let scale = (h as f64).sqrt() as f32;
            k.scale(stream, &mut a.residual, t * h, scale)?;
        }
        let first = &w.layers[0].input_norm;
        norm(
            k,
            stream,
            &mut a.normed,
            &a.residual,
            first,
            (t, h),
            self.eps,
        )?;
        self.mark("embed+norm")
    }

    /// q, k and v of the normed rows: the pinned GEMM for the GEMM rows, the GEMV (one fused
    /// launch when all three are bf16) for the rest.
    fn qkv(&mut self, layer: &Layer, a: &mut Activations) -> Result<(), CudaError> {
        let (k, stream) = (self.k, self.stream);
        let (t, h) = (self.plan.rows, self.c.hidden_size);
        let (qd, kvd) = (self.d.q_rows.len(), self.d.kv_rows.len());
        if self.run_order {
            let x = a.normed.slice(..t * h);
            for (y, wt, n) in [
                (&mut a.q, &layer.q, qd),
                (&mut a.k, &layer.k, kvd),
                (&mut a.v, &layer.v, kvd),
            ] {
                runs(
                    k,
                    Role::Narrow,
                    stream,
                    &mut y.slice_mut(..t * n),
                    &x,
                    wt,
                    (t, n, h),
                )?;
            }
            return self.mark("qkv");
        }
        let gp = self.gemm_rows();
        if gp > 0 {
            let x = a.normed.slice(..gp * h);
            for (y, wt, shape) in [
                (&mut a.q, &layer.q, self.shapes.q),
                (&mut a.k, &layer.k, self.shapes.kv),
                (&mut a.v, &layer.v, self.shapes.kv),
            ] {
                let wide = gemm_weight(k, stream, self.dequant.as_deref_mut(), wt, (shape.n, h))?;
                let mut out = y.slice_mut(..gp * shape.n);
                self.gemm.matmul_shape(&mut out, &x, wide, gp, shape)?;
            }
        }
        let mut row = gp;
        while row < t {
            let m = (t - row).min(GEMV_MAX_M);
            let [mut yq, mut yk, mut yv] = [
                a.q.slice_mut(row * qd..(row + m) * qd),
                a.k.slice_mut(row * kvd..(row + m) * kvd),
                a.v.slice_mut(row * kvd..(row + m) * kvd),
            ];
            let x = a.normed.slice(row * h..(row + m) * h);
            if let (Matrix::Bf16(wq), Matrix::Bf16(wk), Matrix::Bf16(wv)) =
                (&layer.q, &layer.k, &layer.v)
            {
                // One launch for the three: the narrow k and v alone leave SMs idle.
                k.gemv3(
                    stream,
                    [&mut yq, &mut yk, &mut yv],
                    &x,
                    [&wq.as_view(), &wk.as_view(), &wv.as_view()],
                    m,
                    [qd, kvd, kvd],
                    h,
                )?;
            } else if let (
                Matrix::Tiles {
                    format,
                    data: wq,
                    scales: sq,
                },
                Matrix::Tiles {
                    format: fk,
                    data: wk,
                    scales: sk,
                },
                Matrix::Tiles {
                    format: fv,
                    data: wv,
                    scales: sv,
                },
            ) = (&layer.q, &layer.k, &layer.v)
                && fk == format
                && fv == format
            {
                // The same for tiles: each part's rows are the bits of its own launch.
                k.gemv_tiles_parts(
                    stream,
                    [&mut yq, &mut yk, &mut yv],
                    &x,
                    [(wq, sq), (wk, sk), (wv, sv)],
                    *format,
                    (m, [qd, kvd, kvd], h),
                    tile_config(m, qd + 2 * kvd),
                )?;
            } else {
                gemv(k, Role::Narrow, stream, &mut yq, &x, &layer.q, (m, qd, h))?;
                gemv(k, Role::Narrow, stream, &mut yk, &x, &layer.k, (m, kvd, h))?;
                gemv(k, Role::Narrow, stream, &mut yv, &x, &layer.v, (m, kvd, h))?;
            }
            row += m;
        }
        self.mark("qkv")
    }

    /// Biases and q/k norms, rope and the paged KV write, then attention of the prompt
    /// segments and the decode rows into `a.attn`.
    fn attention(
        &mut self,
        l: usize,
        layer: &Layer,
        a: &mut Activations,
        (k_cache, v_cache): (&mut CudaSlice<bf16>, &mut CudaSlice<bf16>),
        rope: &CudaSlice<f32>,
        workspace: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (k, stream, c, d, eps) = (self.k, self.stream, self.c, self.d, self.eps);
        let plan = self.plan;
        let lay = plan.layout;
        let (t, p) = (plan.rows, plan.prompt);
        let (qd, kvd) = (d.q_rows.len(), d.kv_rows.len());
        if let Some([bq, bk, bv]) = &layer.qkv_bias {
            k.add_bias(stream, &mut a.q, bq, t, qd)?;
            k.add_bias(stream, &mut a.k, bk, t, kvd)?;
            k.add_bias(stream, &mut a.v, bv, t, kvd)?;
        }
        if let Some([nq, nk]) = &layer.qk_norm {
            head_norm(k, stream, &mut a.q, nq, (t * d.heads, c.head_dim), eps)?;
            head_norm(k, stream, &mut a.k, nk, (t * d.kv_heads, c.head_dim), eps)?;
        }
        let shape = RopeKvShape {
            tokens: t,
            q_heads: d.heads,
            kv_heads: d.kv_heads,
            head_dim: c.head_dim,
            max_positions: self.max_positions,
            num_blocks: self.blocks,
            block_size: self.block_size,
        };
        let (positions, slots) = (self.at(lay.positions, t), self.at(lay.slots, t));
        k.rope_kv_write(
            stream, &mut a.q, &mut a.k, &a.v, k_cache, v_cache, rope, &positions, &slots, shape,
        )?;
        self.mark("bias+norm+rope")?;

        // This layer's window (Gemma 3 interleaves sliding and global layers).
        let heads = AttentionHeads {
            n_q_heads: d.heads,
            n_kv_heads: d.kv_heads,
            head_dim: c.head_dim,
            window: c.layer_window(l).unwrap_or(0),
            scale: c.attention_scale(),
        };
        let cache = PagedKv {
            k: k_cache.as_view(),
            v: v_cache.as_view(),
            block_size: self.block_size,
            num_blocks: self.blocks,
        };
        for seg in &plan.segments {
            let (first, n) = (seg.first, seg.rows);
            let chunk = PrefillChunk {
                q: a.q.slice(first * qd..(first + n) * qd),
                block_table: self.at(seg.table.0, seg.table.1),
                start: seg.start,
                n_new: n,
            };
            let mut out = a.attn.slice_mut(first * qd..(first + n) * qd);
            k.prefill_attention(stream, &heads, &cache, &chunk, &mut out)?;
        }
        if !plan.segments.is_empty() {
            self.mark("prefill attention")?;
        }
        if t > p {
            let batch = DecodeBatch {
                q: a.q.slice(p * qd..t * qd),
                block_tables: self.at(lay.decode_tables, (t - p) * plan.width),
                max_blocks_per_seq: plan.width,
                context_lens: self.at(lay.context_lens, t - p),
                max_context: plan.max_context,
            };
            let work = decode_workspace_elems(t - p, d.heads, c.head_dim, plan.max_context);
            let mut work = workspace.slice_mut(..work);
            let mut out = a.attn.slice_mut(p * qd..t * qd);
            k.decode_attention(stream, &heads, &cache, &batch, &mut work, &mut out)?;
            self.mark("decode attention")?;
        }
        Ok(())
    }

    /// The o projection of `a.attn` into the residual, and the residual normed for the MLP.
    fn attention_out(&mut self, layer: &Layer, a: &mut Activations) -> Result<(), CudaError> {
        let (t, h) = (self.plan.rows, self.c.hidden_size);
        let k_full = self.c.q_dim();
        let qd = self.d.q_rows.len();
        // Before the bias, which is added once.
        self.row_parallel(a.partials.as_mut(), a.local_partials.as_mut())
            .project(&mut a.proj, &a.attn, &layer.o, h, (qd, k_full))?;
        if let Some(bias) = &layer.o_bias {
            self.k.add_bias(self.stream, &mut a.proj, bias, t, h)?;
        }
        self.mark("o")?;
        let out_norm = layer.sandwich.as_ref().map(|[attn, _]| attn);
        add_norm(
            self.k,
            self.stream,
            (&mut a.normed, &mut a.residual),
            &a.proj,
            out_norm,
            &layer.post_norm,
            (t, h),
            self.eps,
        )?;
        self.mark("add+norm")
    }

    /// The gated MLP of `a.normed` into the residual, and the residual normed by `next` (the
    /// next layer's input norm, or the final norm).
    fn mlp(&mut self, layer: &Layer, next: &Norm, a: &mut Activations) -> Result<(), CudaError> {
        let (k, stream) = (self.k, self.stream);
        let (t, h) = (self.plan.rows, self.c.hidden_size);
        match &layer.mlp {
            Mlp::Dense([gate_up, down]) => self.dense_mlp(gate_up, down, a)?,
            Mlp::Sparse(experts) => {
                let moe = self.c.moe.as_ref().ok_or_else(|| {
                    CudaError::Unsupported("experts without a routing config".into())
                })?;
                let scratch = a.moe.as_mut().ok_or_else(|| {
                    CudaError::Unsupported("experts without their step buffers".into())
                })?;
                let parts = (moe, experts, self.moe_grouped);
                moe::launch(k, stream, parts, scratch, &a.normed, &mut a.proj, (t, h))?;
                self.mark("experts")?;
            }
        }
        let out_norm = layer.sandwich.as_ref().map(|[_, mlp]| mlp);
        add_norm(
            k,
            stream,
            (&mut a.normed, &mut a.residual),
            &a.proj,
            out_norm,
            next,
            (t, h),
            self.eps,
        )?;
        self.mark("add+norm")
    }

    /// A dense MLP's gate/up, gated product and down of the step's rows into `a.proj`.
    fn dense_mlp(
        &mut self,
        gate_up: &Matrix,
        down: &Matrix,
        a: &mut Activations,
    ) -> Result<(), CudaError> {
        let (k, stream) = (self.k, self.stream);
        let (t, h) = (self.plan.rows, self.c.hidden_size);
        let inter = self.d.inter_rows.len();
        let gp = self.gemm_rows();
        let shape = self.shapes.gate_up;
        let dequant = self.dequant.as_deref_mut();
        linear(
            k,
            Role::Wide,
            self.gemm,
            stream,
            dequant,
            &mut a.gate_up,
            &a.normed,
            gate_up,
            (t, gp, self.run_order),
            shape,
        )?;
        self.mark("gate_up")?;
        let act = if self.c.gemma3.is_some() {
            GateActivation::GeluTanh
        } else {
            GateActivation::Silu
        };
        k.gated_mul(stream, act, &mut a.act, &a.gate_up, t, inter)?;
        self.mark("act_mul")?;
        let k_full = self.c.intermediate_size;
        self.row_parallel(a.partials.as_mut(), a.local_partials.as_mut())
            .project(&mut a.proj, &a.act, down, h, (inter, k_full))?;
        self.mark("down")
    }

    /// Logits of the gathered rows, through the path of each row's role; all-gathered over the
    /// vocabulary ranks when there are several.
    fn logits(
        &mut self,
        w: &Weights,
        a: &Activations,
        out: &mut LogitBuffers,
    ) -> Result<(), CudaError> {
        let (k, stream) = (self.k, self.stream);
        let plan = self.plan;
        let (r, h) = (plan.logits, self.c.hidden_size);
        if r == 0 {
            return Ok(());
        }
        let gather = self.at(plan.layout.gather, r);
        k.embed(
            stream,
            &mut out.gathered,
            &a.normed,
            &gather,
            r,
            h,
            plan.rows,
        )?;
        let head = w.lm_head.as_ref().unwrap_or(&w.embed);
        // This rank's vocabulary rows (padded): all-gathered below when there are several ranks.
        let v = self.d.vocab_per_rank;
        if self.run_order {
            let mut y = out.device.slice_mut(..r * v);
            let x = out.gathered.slice(..r * h);
            runs(k, Role::Wide, stream, &mut y, &x, head, (r, v, h))?;
        } else {
            self.split_logits(head, out, (r, v, h))?;
        }
        let world = self.d.world;
        if let Some(all) = out.all.as_mut() {
            let comm = self.comm.as_deref_mut().ok_or(CudaError::NoCommunicator)?;
            comm.all_gather(
                out.device.slice(..r * v).into(),
                all.slice_mut(..world * r * v).into(),
            )?;
        }
        self.mark("lm head")
    }

    /// The logits rows of the split order: the GEMM rows of a bf16 head through the pinned
    /// GEMM, the rest through the GEMV.
    fn split_logits(
        &mut self,
        head: &Matrix,
        out: &mut LogitBuffers,
        (r, v, h): (usize, usize, usize),
    ) -> Result<(), CudaError> {
        let (k, stream, plan) = (self.k, self.stream, self.plan);
        // A head in a block format or tiles takes the GEMV for every row (logits rows are few; a
        // dequantized vocabulary-sized copy would not be).
        let lp = match head {
            Matrix::Blocks { .. } | Matrix::Tiles { .. } => 0,
            Matrix::Bf16(_) if self.decode_gemm => r,
            Matrix::Bf16(_) => plan.logits_prompt,
        };
        if let (true, Matrix::Bf16(head)) = (lp > 0, head) {
            let mut y = out.device.slice_mut(..lp * v);
            let x = out.gathered.slice(..lp * h);
            self.gemm
                .matmul_shape(&mut y, &x, head, lp, self.shapes.lm_head)?;
        }
        let mut row = lp;
        while row < r {
            let m = (r - row).min(GEMV_MAX_M);
            let mut y = out.device.slice_mut(row * v..(row + m) * v);
            let x = out.gathered.slice(row * h..(row + m) * h);
            gemv(k, Role::Wide, stream, &mut y, &x, head, (m, v, h))?;
            row += m;
        }
        Ok(())
    }
}

/// `out = rmsnorm(x) · w` over `rows × hidden`, rounded as the weight's kind says.
fn norm(
    k: &Kernels,
    stream: &Arc<CudaStream>,
    out: &mut CudaSlice<bf16>,
    x: &CudaSlice<bf16>,
    w: &Norm,
    (rows, hidden): (usize, usize),
    eps: f32,
) -> Result<(), CudaError> {
    match w {
        Norm::Bf16(w) => k.rmsnorm(stream, out, x, w, rows, hidden, eps)?,
        Norm::F32(w) => k.rmsnorm(stream, out, x, w, rows, hidden, eps)?,
    }
    Ok(())
}

/// In-place RMSNorm of each of `vectors` head vectors of `x`.
fn head_norm(
    k: &Kernels,
    stream: &Arc<CudaStream>,
    x: &mut CudaSlice<bf16>,
    w: &Norm,
    (vectors, head_dim): (usize, usize),
    eps: f32,
) -> Result<(), CudaError> {
    match w {
        Norm::Bf16(w) => k.head_rmsnorm(stream, x, w, vectors, head_dim, eps)?,
        Norm::F32(w) => k.head_rmsnorm(stream, x, w, vectors, head_dim, eps)?,
    }
    Ok(())
}

/// A block's output `x` into the residual, and the residual normed for the next block by
/// `next`: `residual += x` (Llama family), or `residual += rmsnorm(x) · out_norm` (Gemma 3's
/// sandwich, f32 weights throughout).
#[allow(clippy::too_many_arguments)]
fn add_norm(
    k: &Kernels,
    stream: &Arc<CudaStream>,
    (out, residual): (&mut CudaSlice<bf16>, &mut CudaSlice<bf16>),
    x: &CudaSlice<bf16>,
    out_norm: Option<&CudaSlice<f32>>,
    next: &Norm,
    (rows, hidden): (usize, usize),
    eps: f32,
) -> Result<(), CudaError> {
    match (out_norm, next) {
        (None, Norm::Bf16(w)) => k.add_rmsnorm(stream, out, residual, x, w, rows, hidden, eps)?,
        (Some(wx), Norm::F32(w)) => {
            k.sandwich_add_rmsnorm(stream, out, residual, x, wx, w, rows, hidden, eps)?
        }
        _ => {
            return Err(CudaError::Unsupported(
                "a residual add between norms of two kinds (bf16 and Gemma 3's f32)".to_string(),
            ));
        }
    }
    Ok(())
}

/// Records a CUDA event on `stream` after the launches of `family`, when profiling.
pub(super) fn mark(
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
