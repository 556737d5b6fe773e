//! Launchers for `cuda/elementwise.cu`: embedding gather, RMSNorm variants (bf16 weights as
//! HF's Llama family, f32 weights as Gemma 3), bias add, rotary embedding with the paged KV
//! write, SiLU- and GELU-tanh-gated products, the embedding scale.
//!
//! All tensors are row-major and contiguous; "holds at least" means a buffer may be longer than
//! the shape (preallocated workspaces), never shorter. Buffers read or written with 16-byte
//! vectors must start 16-byte aligned (a fresh allocation always is; a view must start at a
//! multiple of 8 bf16 elements).

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, PushKernelArg};
use half::bf16;

use crate::launch::{aligned16, grid, need_len, product, stride_blocks, to_u32};
use crate::{KernelError, Kernels, ensure_shape};

const MODULE: &str = "elementwise";
const NORM_THREADS: u32 = 256;
const HEAD_NORM_WARPS: u32 = 4;
const THREADS: u32 = 256;

/// The shape of one [`Kernels::rope_kv_write`] launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeKvShape {
    pub tokens: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    /// Even and a multiple of 8.
    pub head_dim: usize,
    /// Rows of the cos/sin table.
    pub max_positions: usize,
    pub num_blocks: usize,
    pub block_size: usize,
}

/// An RMSNorm weight's element type, which also picks the norm's rounding: bf16 weights round the
/// normalised value to bf16 before the weight multiplies it (HF's Llama-family RMSNorm); f32
/// weights (Gemma 3's, holding `1 + w`) multiply the unrounded value.
pub trait NormWeight: DeviceRepr + sealed::Sealed {
    /// The kernel name's suffix.
    const SUFFIX: &'static str;
}

impl NormWeight for bf16 {
    const SUFFIX: &'static str = "";
}

impl NormWeight for f32 {
    const SUFFIX: &'static str = "_f32w";
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for f32 {}
}

/// The gate activation of [`Kernels::gated_mul`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateActivation {
    /// `x · sigmoid(x)` (Llama, Qwen, Mistral).
    Silu,
    /// PyTorch's `gelu(approximate="tanh")` (Gemma 3).
    GeluTanh,
}

impl GateActivation {
    fn kernel(self) -> &'static str {
        match self {
            GateActivation::Silu => "silu_mul",
            GateActivation::GeluTanh => "gelu_tanh_mul",
        }
    }
}

// Launchers mirror their kernel's signature: buffers then shape, so argument lists are long.
#[allow(clippy::too_many_arguments)]
impl Kernels {
    /// `out[t, :] = table[ids[t], :]` for `t < tokens`.
    ///
    /// `table` `[vocab, hidden]`, `out` `[tokens, hidden]`, `ids` `[tokens]`; `hidden % 8 == 0`;
    /// `table` and `out` 16-byte aligned. An id `>= vocab` (unchecked on the host: ids live on
    /// the device) yields a zero row, never an out-of-bounds read.
    pub fn embed(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<bf16>,
        table: &impl DevicePtr<bf16>,
        ids: &impl DevicePtr<u32>,
        tokens: usize,
        hidden: usize,
        vocab: usize,
    ) -> Result<(), KernelError> {
        self.embed_rows(
            stream,
            out,
            table,
            ids,
            tokens,
            hidden,
            0..vocab,
            bf16::ZERO,
        )
    }

    /// A vocabulary shard's embedding: `out[t, :] = table[ids[t] - rows.start, :]` for ids in
    /// `rows`, a row of `fill` for any other id (`-0.0` for tensor-parallel ranks: the exact
    /// additive identity). `table` `[rows.len(), hidden]`; otherwise as [`Kernels::embed`].
    pub fn embed_rows(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<bf16>,
        table: &impl DevicePtr<bf16>,
        ids: &impl DevicePtr<u32>,
        tokens: usize,
        hidden: usize,
        rows: std::ops::Range<usize>,
        fill: bf16,
    ) -> Result<(), KernelError> {
        const K: &str = "embed";
        ensure_shape!(
            hidden.is_multiple_of(8),
            K,
            "hidden = {hidden} is not a multiple of 8"
        );
        need_len(K, "out", out.len(), product(K, &[tokens, hidden])?)?;
        need_len(K, "table", table.len(), product(K, &[rows.len(), hidden])?)?;
        need_len(K, "ids", ids.len(), tokens)?;
        let hidden32 = to_u32(K, "hidden", hidden)?;
        let (first, count) = (
            to_u32(K, "first row", rows.start)?,
            to_u32(K, "rows", rows.len())?,
        );
        let fill_bits = u32::from(fill.to_bits());
        let blocks = to_u32(K, "tokens", tokens)?;
        if tokens == 0 {
            return Ok(());
        }
        let f = self.function(MODULE, K)?;
        let (o, _o) = out.device_ptr_mut(stream);
        let (t, _t) = table.device_ptr(stream);
        let (i, _i) = ids.device_ptr(stream);
        aligned16(K, "out", o)?;
        aligned16(K, "table", t)?;
        let mut b = stream.launch_builder(f);
        b.arg(&o).arg(&t).arg(&i).arg(&hidden32);
        b.arg(&first).arg(&count).arg(&fill_bits);
        // SAFETY: lengths, alignment and argument types checked above match the kernel.
        unsafe { b.launch(grid(blocks, THREADS)) }?;
        Ok(())
    }

    /// `out[i] = bf16(Σ_s partials[s * stride + i])` for `i < n`, added in f32 in shard order
    /// starting from shard 0 and rounded once: the row-parallel projections' shard partials
    /// (DESIGN.md §5). `partials` holds `shards` runs of `stride ≥ n` values.
    pub fn sum_shards(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<bf16>,
        partials: &impl DevicePtr<f32>,
        shards: usize,
        stride: usize,
        n: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "sum_shards_bf16";
        ensure_shape!(
            shards > 0 && stride >= n,
            K,
            "{shards} shards of stride {stride} cannot hold {n} values"
        );
        need_len(K, "out", out.len(), n)?;
        need_len(
            K,
            "partials",
            partials.len(),
            product(K, &[shards - 1, stride])? + n,
        )?;
        if n == 0 {
            return Ok(());
        }
        let shards32 = to_u32(K, "shards", shards)?;
        let (stride64, n64) = (stride as u64, n as u64);
        let f = self.function(MODULE, K)?;
        let (o, _o) = out.device_ptr_mut(stream);
        let (p, _p) = partials.device_ptr(stream);
        let mut b = stream.launch_builder(f);
        b.arg(&o).arg(&p).arg(&shards32).arg(&stride64).arg(&n64);
        // SAFETY: lengths and argument types checked above match the kernel.
        unsafe { b.launch(grid(stride_blocks(n, THREADS), THREADS)) }?;
        Ok(())
    }

    /// `out[r, :] = bf16(bf16(x[r, :] / sqrt(mean(x[r, :]²) + eps)) · weight)` for `r < rows`
    /// (HF RMSNorm rounding: the normalised value is rounded before the weight multiplies it);
    /// with an f32 weight, `bf16(x[r, :] / sqrt(…) · weight)` (Gemma 3's, see [`NormWeight`]).
    ///
    /// `x`, `out` `[rows, hidden]`, `weight` `[hidden]`; `hidden % 8 == 0`; all 16-byte aligned.
    /// The sum of squares runs in an order fixed by `hidden` alone.
    pub fn rmsnorm<W: NormWeight>(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<bf16>,
        x: &impl DevicePtr<bf16>,
        weight: &impl DevicePtr<W>,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<(), KernelError> {
        const K: &str = "rmsnorm";
        let (blocks, hidden32) = norm_shape(K, out.len(), x.len(), weight.len(), rows, hidden)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(MODULE, &format!("{K}{}", W::SUFFIX))?;
        let (o, _o) = out.device_ptr_mut(stream);
        let (xp, _x) = x.device_ptr(stream);
        let (w, _w) = weight.device_ptr(stream);
        for (what, p) in [("out", o), ("x", xp), ("weight", w)] {
            aligned16(K, what, p)?;
        }
        let mut b = stream.launch_builder(f);
        b.arg(&o).arg(&xp).arg(&w).arg(&hidden32).arg(&eps);
        // SAFETY: as in `embed`.
        unsafe { b.launch(grid(blocks, NORM_THREADS)) }?;
        Ok(())
    }

    /// Fused residual add and RMSNorm: `residual[r, :] = bf16(residual[r, :] + x[r, :])`, then
    /// `out[r, :] = rmsnorm(residual[r, :]) · weight` as [`Kernels::rmsnorm`] (the norm reads the
    /// rounded sum, as HF does).
    ///
    /// `residual`, `x`, `out` `[rows, hidden]`, `weight` `[hidden]`; `hidden % 8 == 0`; all
    /// 16-byte aligned.
    pub fn add_rmsnorm(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<bf16>,
        residual: &mut impl DevicePtrMut<bf16>,
        x: &impl DevicePtr<bf16>,
        weight: &impl DevicePtr<bf16>,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<(), KernelError> {
        const K: &str = "add_rmsnorm";
        let (blocks, hidden32) = norm_shape(K, out.len(), x.len(), weight.len(), rows, hidden)?;
        need_len(K, "residual", residual.len(), product(K, &[rows, hidden])?)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(MODULE, K)?;
        let (o, _o) = out.device_ptr_mut(stream);
        let (r, _r) = residual.device_ptr_mut(stream);
        let (xp, _x) = x.device_ptr(stream);
        let (w, _w) = weight.device_ptr(stream);
        for (what, p) in [("out", o), ("residual", r), ("x", xp), ("weight", w)] {
            aligned16(K, what, p)?;
        }
        let mut b = stream.launch_builder(f);
        b.arg(&o).arg(&r).arg(&xp).arg(&w).arg(&hidden32).arg(&eps);
        // SAFETY: as in `embed`.
        unsafe { b.launch(grid(blocks, NORM_THREADS)) }?;
        Ok(())
    }

    /// Gemma 3's sandwich around a block's output `x`, fused with the next block's norm:
    /// `residual[r, :] = bf16(residual[r, :] + bf16(rmsnorm(x[r, :]) · x_weight))`, then
    /// `out[r, :] = bf16(rmsnorm(residual[r, :]) · weight)`, both norms with f32 weights (as
    /// [`Kernels::rmsnorm`] with an f32 weight).
    ///
    /// `residual`, `x`, `out` `[rows, hidden]`, weights `[hidden]`; `hidden % 8 == 0`; all
    /// 16-byte aligned.
    pub fn sandwich_add_rmsnorm(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<bf16>,
        residual: &mut impl DevicePtrMut<bf16>,
        x: &impl DevicePtr<bf16>,
        x_weight: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<(), KernelError> {
        const K: &str = "sandwich_add_rmsnorm";
        let (blocks, hidden32) = norm_shape(K, out.len(), x.len(), weight.len(), rows, hidden)?;
        need_len(K, "residual", residual.len(), product(K, &[rows, hidden])?)?;
        need_len(K, "x_weight", x_weight.len(), hidden)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(MODULE, K)?;
        let (o, _o) = out.device_ptr_mut(stream);
        let (r, _r) = residual.device_ptr_mut(stream);
        let (xp, _x) = x.device_ptr(stream);
        let (wx, _wx) = x_weight.device_ptr(stream);
        let (w, _w) = weight.device_ptr(stream);
        for (what, p) in [
            ("out", o),
            ("residual", r),
            ("x", xp),
            ("x_weight", wx),
            ("weight", w),
        ] {
            aligned16(K, what, p)?;
        }
        let mut b = stream.launch_builder(f);
        b.arg(&o)
            .arg(&r)
            .arg(&xp)
            .arg(&wx)
            .arg(&w)
            .arg(&hidden32)
            .arg(&eps);
        // SAFETY: as in `embed`.
        unsafe { b.launch(grid(blocks, NORM_THREADS)) }?;
        Ok(())
    }

    /// In-place RMSNorm of each `head_dim`-long vector (Qwen3's and Gemma 3's q/k norm):
    /// `x[v, :] = rmsnorm(x[v, :]) · weight` for `v < vectors` (= tokens × heads), rounded as
    /// [`Kernels::rmsnorm`] for the weight's type.
    ///
    /// `x` `[vectors, head_dim]`, `weight` `[head_dim]`; `head_dim` a multiple of 32, at most 256.
    pub fn head_rmsnorm<W: NormWeight>(
        &self,
        stream: &Arc<CudaStream>,
        x: &mut impl DevicePtrMut<bf16>,
        weight: &impl DevicePtr<W>,
        vectors: usize,
        head_dim: usize,
        eps: f32,
    ) -> Result<(), KernelError> {
        const K: &str = "head_rmsnorm";
        ensure_shape!(
            head_dim.is_multiple_of(32) && (32..=256).contains(&head_dim),
            K,
            "head_dim = {head_dim} must be a multiple of 32 in 32..=256"
        );
        need_len(K, "x", x.len(), product(K, &[vectors, head_dim])?)?;
        need_len(K, "weight", weight.len(), head_dim)?;
        let vectors32 = to_u32(K, "vectors", vectors)?;
        let head_dim32 = to_u32(K, "head_dim", head_dim)?;
        if vectors == 0 {
            return Ok(());
        }
        let f = self.function(MODULE, &format!("{K}{}", W::SUFFIX))?;
        let (xp, _x) = x.device_ptr_mut(stream);
        let (w, _w) = weight.device_ptr(stream);
        let mut b = stream.launch_builder(f);
        b.arg(&xp)
            .arg(&w)
            .arg(&vectors32)
            .arg(&head_dim32)
            .arg(&eps);
        let blocks = vectors32.div_ceil(HEAD_NORM_WARPS);
        // SAFETY: as in `embed`.
        unsafe { b.launch(grid(blocks, HEAD_NORM_WARPS * 32)) }?;
        Ok(())
    }

    /// `x[r, n] = bf16(x[r, n] + bias[n])` (Qwen2's q/k/v bias).
    ///
    /// `x` `[rows, cols]`, `bias` `[cols]`; `cols % 8 == 0`; both 16-byte aligned.
    pub fn add_bias(
        &self,
        stream: &Arc<CudaStream>,
        x: &mut impl DevicePtrMut<bf16>,
        bias: &impl DevicePtr<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "add_bias";
        ensure_shape!(
            cols.is_multiple_of(8),
            K,
            "cols = {cols} is not a multiple of 8"
        );
        let total = product(K, &[rows, cols])?;
        need_len(K, "x", x.len(), total)?;
        need_len(K, "bias", bias.len(), cols)?;
        let (rows32, cols32) = (to_u32(K, "rows", rows)?, to_u32(K, "cols", cols)?);
        if total == 0 {
            return Ok(());
        }
        let f = self.function(MODULE, K)?;
        let (xp, _x) = x.device_ptr_mut(stream);
        let (bp, _b) = bias.device_ptr(stream);
        aligned16(K, "x", xp)?;
        aligned16(K, "bias", bp)?;
        let mut b = stream.launch_builder(f);
        b.arg(&xp).arg(&bp).arg(&rows32).arg(&cols32);
        // SAFETY: as in `embed`.
        unsafe { b.launch(grid(stride_blocks(total / 8, THREADS), THREADS)) }?;
        Ok(())
    }

    /// Rotary embedding and paged KV write for `shape.tokens` tokens.
    ///
    /// - `q` `[tokens, q_heads, head_dim]` and `k` `[tokens, kv_heads, head_dim]` are rotated in
    ///   place in HF's rotate-half layout (pairs `i`, `i + head_dim/2`), in f32, rounded once.
    /// - `cos_sin` `[max_positions, head_dim]` f32: row `p` holds `cos` in `[0, head_dim/2)` and
    ///   `sin` in `[head_dim/2, head_dim)`; token `t` uses row `positions[t]`.
    /// - The rotated `k[t]` and `v[t]` (`v` `[tokens, kv_heads, head_dim]`) are copied into
    ///   `k_cache`, `v_cache` `[num_blocks, block_size, kv_heads, head_dim]` at slot
    ///   `slot_mapping[t]` (= block · block_size + offset).
    ///
    /// Device-side values are guarded, not trusted: a position `>= max_positions` leaves the
    /// token untouched, a slot `>= num_blocks · block_size` (use `u32::MAX` for padding) is not
    /// written. `head_dim % 8 == 0`; `k`, `v` and both caches 16-byte aligned.
    pub fn rope_kv_write(
        &self,
        stream: &Arc<CudaStream>,
        q: &mut impl DevicePtrMut<bf16>,
        k: &mut impl DevicePtrMut<bf16>,
        v: &impl DevicePtr<bf16>,
        k_cache: &mut impl DevicePtrMut<bf16>,
        v_cache: &mut impl DevicePtrMut<bf16>,
        cos_sin: &impl DevicePtr<f32>,
        positions: &impl DevicePtr<u32>,
        slot_mapping: &impl DevicePtr<u32>,
        shape: RopeKvShape,
    ) -> Result<(), KernelError> {
        const K: &str = "rope_kv_write";
        let s = shape;
        ensure_shape!(
            s.head_dim.is_multiple_of(8) && s.head_dim > 0,
            K,
            "head_dim = {} is not a positive multiple of 8",
            s.head_dim
        );
        let slots = product(K, &[s.num_blocks, s.block_size])?;
        need_len(
            K,
            "q",
            q.len(),
            product(K, &[s.tokens, s.q_heads, s.head_dim])?,
        )?;
        let kv_len = product(K, &[s.tokens, s.kv_heads, s.head_dim])?;
        need_len(K, "k", k.len(), kv_len)?;
        need_len(K, "v", v.len(), kv_len)?;
        let cache_len = product(K, &[slots, s.kv_heads, s.head_dim])?;
        need_len(K, "k_cache", k_cache.len(), cache_len)?;
        need_len(K, "v_cache", v_cache.len(), cache_len)?;
        need_len(
            K,
            "cos_sin",
            cos_sin.len(),
            product(K, &[s.max_positions, s.head_dim])?,
        )?;
        need_len(K, "positions", positions.len(), s.tokens)?;
        need_len(K, "slot_mapping", slot_mapping.len(), s.tokens)?;
        let tokens = to_u32(K, "tokens", s.tokens)?;
        let n_q = to_u32(K, "q_heads", s.q_heads)?;
        let n_kv = to_u32(K, "kv_heads", s.kv_heads)?;
        let d = to_u32(K, "head_dim", s.head_dim)?;
        let max_positions = to_u32(K, "max_positions", s.max_positions)?;
        to_u32(K, "q_heads * head_dim", s.q_heads * s.head_dim)?;
        let num_slots = slots as u64;
        if tokens == 0 {
            return Ok(());
        }
        let f = self.function(MODULE, K)?;
        let (qp, _q) = q.device_ptr_mut(stream);
        let (kp, _k) = k.device_ptr_mut(stream);
        let (vp, _v) = v.device_ptr(stream);
        let (kc, _kc) = k_cache.device_ptr_mut(stream);
        let (vc, _vc) = v_cache.device_ptr_mut(stream);
        let (cs, _cs) = cos_sin.device_ptr(stream);
        let (pos, _pos) = positions.device_ptr(stream);
        let (slot, _slot) = slot_mapping.device_ptr(stream);
        for (what, p) in [("k", kp), ("v", vp), ("k_cache", kc), ("v_cache", vc)] {
            aligned16(K, what, p)?;
        }
        let mut b = stream.launch_builder(f);
        b.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&kc)
            .arg(&vc)
            .arg(&cs)
            .arg(&pos)
            .arg(&slot);
        b.arg(&n_q)
            .arg(&n_kv)
            .arg(&d)
            .arg(&max_positions)
            .arg(&num_slots);
        // SAFETY: as in `embed`.
        unsafe { b.launch(grid(tokens, THREADS)) }?;
        Ok(())
    }

    /// `out[t, i] = bf16(bf16(act(gate_up[t, i])) · gate_up[t, inter + i])` (HF rounds the
    /// activation before the product).
    ///
    /// `gate_up` `[tokens, 2·inter]` (gate then up, as a fused gate/up projection writes it),
    /// `out` `[tokens, inter]`; `inter % 8 == 0`; both 16-byte aligned.
    pub fn gated_mul(
        &self,
        stream: &Arc<CudaStream>,
        act: GateActivation,
        out: &mut impl DevicePtrMut<bf16>,
        gate_up: &impl DevicePtr<bf16>,
        tokens: usize,
        inter: usize,
    ) -> Result<(), KernelError> {
        let name = act.kernel();
        ensure_shape!(
            inter.is_multiple_of(8),
            name,
            "inter = {inter} is not a multiple of 8"
        );
        let total = product(name, &[tokens, inter])?;
        need_len(name, "out", out.len(), total)?;
        need_len(name, "gate_up", gate_up.len(), product(name, &[total, 2])?)?;
        let (tokens32, inter32) = (
            to_u32(name, "tokens", tokens)?,
            to_u32(name, "inter", inter)?,
        );
        if total == 0 {
            return Ok(());
        }
        let f = self.function(MODULE, name)?;
        let (o, _o) = out.device_ptr_mut(stream);
        let (g, _g) = gate_up.device_ptr(stream);
        aligned16(name, "out", o)?;
        aligned16(name, "gate_up", g)?;
        let mut b = stream.launch_builder(f);
        b.arg(&o).arg(&g).arg(&tokens32).arg(&inter32);
        // SAFETY: as in `embed`.
        unsafe { b.launch(grid(stride_blocks(total / 8, THREADS), THREADS)) }?;
        Ok(())
    }

    /// `x[i] = bf16(x[i] · scale)` for `i < len` (Gemma 3's embedding scale).
    ///
    /// `x` holds at least `len` values, 16-byte aligned; `len % 8 == 0`.
    pub fn scale(
        &self,
        stream: &Arc<CudaStream>,
        x: &mut impl DevicePtrMut<bf16>,
        len: usize,
        scale: f32,
    ) -> Result<(), KernelError> {
        const K: &str = "scale_bf16";
        ensure_shape!(
            len.is_multiple_of(8),
            K,
            "len = {len} is not a multiple of 8"
        );
        need_len(K, "x", x.len(), len)?;
        if len == 0 {
            return Ok(());
        }
        let f = self.function(MODULE, K)?;
        let (xp, _x) = x.device_ptr_mut(stream);
        aligned16(K, "x", xp)?;
        let chunks = (len / 8) as u64;
        let mut b = stream.launch_builder(f);
        b.arg(&xp).arg(&chunks).arg(&scale);
        // SAFETY: as in `embed`.
        unsafe { b.launch(grid(stride_blocks(len / 8, THREADS), THREADS)) }?;
        Ok(())
    }
}

/// Shared shape checks of the row norms; returns (blocks, hidden) as kernel arguments.
fn norm_shape(
    kernel: &'static str,
    out_len: usize,
    x_len: usize,
    weight_len: usize,
    rows: usize,
    hidden: usize,
) -> Result<(u32, u32), KernelError> {
    ensure_shape!(
        hidden.is_multiple_of(8) && hidden > 0,
        kernel,
        "hidden = {hidden} is not a positive multiple of 8"
    );
    let len = product(kernel, &[rows, hidden])?;
    need_len(kernel, "out", out_len, len)?;
    need_len(kernel, "x", x_len, len)?;
    need_len(kernel, "weight", weight_len, hidden)?;
    Ok((
        to_u32(kernel, "rows", rows)?,
        to_u32(kernel, "hidden", hidden)?,
    ))
}
