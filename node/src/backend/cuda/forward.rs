//! One step's launches (`CudaBackend::forward`): embedding, every layer through the kernels and
//! the projections of `matmul.rs`, the logits of the gathered rows. Launches only — no
//! allocation, copy or synchronization — so a decode step can be captured into a graph.

use std::sync::Arc;

use half::bf16;
use strata_kernels::cudarc::driver::sys::CUevent_flags;
use strata_kernels::cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use strata_kernels::{
    AttentionHeads, DecodeBatch, GEMV_MAX_M, GateActivation, Kernels, PagedKv, PrefillChunk,
    RopeKvShape, decode_workspace_elems,
};

use super::matmul::{gemm_weight, gemv, linear};
use super::row_parallel::{RowParallel, gemm_shapes};
use super::weights::{Matrix, Norm};
use super::{CudaBackend, CudaError, Plan};

impl CudaBackend {
    /// Every launch of one step, reading the packed inputs already on the device. Launches
    /// only (no allocation, copy or synchronization), so it can be captured into a graph.
    pub(super) fn forward(&mut self, plan: &Plan) -> Result<(), CudaError> {
        let Self {
            config: c,
            shard: d,
            row_shards,
            fault,
            stream,
            kernels: k,
            gemm,
            weights: w,
            k_cache,
            v_cache,
            cos_sin,
            cos_sin_local,
            max_positions,
            block_size: bs,
            num_blocks,
            scratch: s,
            profile,
            comm,
            decode_gemm,
            dequant,
            ..
        } = self;
        let bs = *bs;
        let (t, p) = (plan.rows, plan.prompt);
        // Rows whose projections take the GEMM: the prompt rows, or every row.
        let gp = if *decode_gemm { t } else { p };
        let h = c.hidden_size;
        let (qd, kvd, inter) = (d.q_rows.len(), d.kv_rows.len(), d.inter_rows.len());
        let shapes = gemm_shapes(c, d, *row_shards);
        let eps = c.rms_norm_eps as f32;
        // Per layer: its window (Gemma 3 interleaves sliding and global layers).
        let heads = |layer: usize| AttentionHeads {
            n_q_heads: d.heads,
            n_kv_heads: d.kv_heads,
            head_dim: c.head_dim,
            window: c.layer_window(layer).unwrap_or(0),
            scale: c.attention_scale(),
        };
        let act = if c.gemma3.is_some() {
            GateActivation::GeluTanh
        } else {
            GateActivation::Silu
        };
        // The reserved scratch block is addressable too (padding rows write into it).
        let blocks = *num_blocks + 1;
        let rope_shape = RopeKvShape {
            tokens: t,
            q_heads: d.heads,
            kv_heads: d.kv_heads,
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
                buf!(residual),
                table,
                &ids,
                t,
                h,
                d.vocab.clone(),
                fill,
            )?,
            Matrix::Blocks { format, data } => k.embed_rows_blocks(
                stream,
                buf!(residual),
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
            let comm = comm.as_deref_mut().ok_or(CudaError::NoCommunicator)?;
            comm.all_reduce_sum(buf!(residual).slice_mut(..t * h).into())?;
        }
        if c.gemma3.is_some() {
            // √hidden rounded once to f32, as the CPU reference and llama.cpp scale.
            let scale = (h as f64).sqrt() as f32;
            k.scale(stream, buf!(residual), t * h, scale)?;
        }
        let normed = s.normed.as_mut().expect("scratch allocated");
        norm(
            k,
            stream,
            normed,
            get!(residual),
            &w.layers[0].input_norm,
            (t, h),
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
                if gp > 0 {
                    let x = normed.slice(..gp * h);
                    for (y, wt, shape) in [
                        (q, &layer.q, shapes.q),
                        (kk, &layer.k, shapes.kv),
                        (v, &layer.v, shapes.kv),
                    ] {
                        let wide = gemm_weight(k, stream, dequant.as_mut(), wt, (shape.n, h))?;
                        let mut out = y.slice_mut(..gp * shape.n);
                        gemm.matmul_shape(&mut out, &x, wide, gp, shape)?;
                    }
                }
                let (q, kk, v) = (
                    s.q.as_mut().expect("scratch allocated"),
                    s.k.as_mut().expect("scratch allocated"),
                    s.v.as_mut().expect("scratch allocated"),
                );
                let mut row = gp;
                while row < t {
                    let m = (t - row).min(GEMV_MAX_M);
                    let [mut yq, mut yk, mut yv] = [
                        q.slice_mut(row * qd..(row + m) * qd),
                        kk.slice_mut(row * kvd..(row + m) * kvd),
                        v.slice_mut(row * kvd..(row + m) * kvd),
                    ];
                    let x = normed.slice(row * h..(row + m) * h);
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
                    } else {
                        gemv(k, stream, &mut yq, &x, &layer.q, (m, qd, h))?;
                        gemv(k, stream, &mut yk, &x, &layer.k, (m, kvd, h))?;
                        gemv(k, stream, &mut yv, &x, &layer.v, (m, kvd, h))?;
                    }
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
                head_norm(k, stream, buf!(q), nq, (t * d.heads, c.head_dim), eps)?;
                head_norm(k, stream, buf!(k), nk, (t * d.kv_heads, c.head_dim), eps)?;
            }
            let rope = match cos_sin_local {
                Some(local) if c.local_rope(l) => &*local,
                _ => &*cos_sin,
            };
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
                    rope,
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
                    k.prefill_attention(stream, &heads(l), &cache, &chunk, &mut out)?;
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
                    let work = decode_workspace_elems(t - p, d.heads, c.head_dim, plan.max_context);
                    let mut workspace = s
                        .workspace
                        .as_mut()
                        .expect("scratch allocated")
                        .slice_mut(..work);
                    let mut out = attn.slice_mut(p * qd..t * qd);
                    k.decode_attention(
                        stream,
                        &heads(l),
                        &cache,
                        &batch,
                        &mut workspace,
                        &mut out,
                    )?;
                    mark(profile, stream, "decode attention")?;
                }
            }
            let mut rp = RowParallel {
                kernels: k,
                gemm,
                stream,
                dequant: dequant.as_mut(),
                comm: comm.as_deref_mut(),
                partials: s.partials.as_mut(),
                local: s.local_partials.as_mut(),
                shards: *row_shards,
                world: d.world,
                fault: *fault,
                rows: t,
                prompt: gp,
            };
            // Before the bias, which is added once.
            rp.project(buf!(proj), get!(attn), &layer.o, h, (qd, c.q_dim()))?;
            if let Some(bias) = &layer.o_bias {
                k.add_bias(stream, buf!(proj), bias, t, h)?;
            }
            mark(profile, stream, "o")?;
            {
                let (normed, residual) = (
                    s.normed.as_mut().expect("scratch allocated"),
                    s.residual.as_mut().expect("scratch allocated"),
                );
                let out_norm = layer.sandwich.as_ref().map(|[a, _]| a);
                add_norm(
                    k,
                    stream,
                    (normed, residual),
                    get!(proj),
                    out_norm,
                    &layer.post_norm,
                    (t, h),
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
                    dequant.as_mut(),
                    gate_up,
                    get!(normed),
                    &layer.gate_up,
                    t,
                    gp,
                    shapes.gate_up,
                )?;
            }
            mark(profile, stream, "gate_up")?;
            {
                let out = s.act.as_mut().expect("scratch allocated");
                k.gated_mul(stream, act, out, get!(gate_up), t, inter)?;
            }
            mark(profile, stream, "act_mul")?;
            {
                let mut rp = RowParallel {
                    kernels: k,
                    gemm,
                    stream,
                    dequant: dequant.as_mut(),
                    comm: comm.as_deref_mut(),
                    partials: s.partials.as_mut(),
                    local: s.local_partials.as_mut(),
                    shards: *row_shards,
                    world: d.world,
                    fault: *fault,
                    rows: t,
                    prompt: gp,
                };
                let proj = s.proj.as_mut().expect("scratch allocated");
                rp.project(
                    proj,
                    get!(act),
                    &layer.down,
                    h,
                    (inter, c.intermediate_size),
                )?;
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
            let out_norm = layer.sandwich.as_ref().map(|[_, b]| b);
            add_norm(
                k,
                stream,
                (normed, residual),
                get!(proj),
                out_norm,
                next_norm,
                (t, h),
                eps,
            )?;
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
        // This rank's vocabulary rows (padded): all-gathered below when there are several ranks.
        let v = d.vocab_per_rank;
        let logits = s.logits.as_mut().expect("scratch allocated");
        let gathered = get!(gathered);
        // A head in a block format takes the GEMV for every row (logits rows are few; a
        // dequantized vocabulary-sized copy would not be).
        let lp = match head {
            Matrix::Blocks { .. } => 0,
            Matrix::Bf16(_) if *decode_gemm => r,
            Matrix::Bf16(_) => plan.logits_prompt,
        };
        if let (true, Matrix::Bf16(head)) = (lp > 0, head) {
            let mut y = logits.slice_mut(..lp * v);
            let x = gathered.slice(..lp * h);
            gemm.matmul_shape(&mut y, &x, head, lp, shapes.lm_head)?;
        }
        let mut row = lp;
        while row < r {
            let m = (r - row).min(GEMV_MAX_M);
            let mut y = logits.slice_mut(row * v..(row + m) * v);
            let x = gathered.slice(row * h..(row + m) * h);
            gemv(k, stream, &mut y, &x, head, (m, v, h))?;
            row += m;
        }
        if d.world > 1 {
            let comm = comm.as_deref_mut().ok_or(CudaError::NoCommunicator)?;
            let all = s.logits_all.as_mut().expect("scratch allocated");
            comm.all_gather(
                logits.slice(..r * v).into(),
                all.slice_mut(..d.world * r * v).into(),
            )?;
        }
        mark(profile, stream, "lm head")?;
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
