//! Launchers for `cuda/gemv.cu`: the small-M GEMM of the decode path,
//! `y[m, n] = Σ_k x[m, k] · w[n, k]` for 1 ≤ M ≤ 16.
//!
//! The reduction order of every output element depends on K alone, so row `m` of a launch with
//! any M is bitwise identical to the same row computed alone (the self-test checks it).

use std::sync::Arc;

use cudarc::driver::{
    CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, PushKernelArg,
};
use half::bf16;

use crate::launch::{aligned16, grid, need_len, product, to_u32};
use crate::{KernelError, Kernels, ensure_shape};

const MODULE: &str = "gemv";
const THREADS: u32 = 256;
/// The variant [`Kernels::gemv`] and [`Kernels::gemv_f32`] use: MMA, one kernel for every M.
/// Measured on an H200 (Llama-3-8B shapes, bf16 weights rotated past L2, median of 15 × 20
/// launches): MMA streams 2.4–4.0 TB/s for every M in {1, 4, 8, 16}, while FMA falls from
/// 2.6–4.6 TB/s at M = 1 to 0.9–1.1 TB/s at M = 16 (its x reads grow with M).
pub const DEFAULT_VARIANT: GemvVariant = GemvVariant::Mma;

/// Output element types of the GEMV: bf16 or f32.
pub trait GemvOut: DeviceRepr {
    #[doc(hidden)]
    const PREFIX: &'static str;
    /// The output type's part of kernel names: `bf16` or `f32`.
    #[doc(hidden)]
    const OUT: &'static str;
    #[doc(hidden)]
    const MMA_NAME: &'static str;
    #[doc(hidden)]
    const MMA2_NAME: &'static str;
}

impl GemvOut for bf16 {
    const PREFIX: &'static str = "gemv_bf16";
    const OUT: &'static str = "bf16";
    const MMA_NAME: &'static str = "gemv_mma_bf16_x";
    const MMA2_NAME: &'static str = "gemv_mma2_bf16_x";
}

impl GemvOut for f32 {
    const PREFIX: &'static str = "gemv_f32";
    const OUT: &'static str = "f32";
    const MMA_NAME: &'static str = "gemv_mma_f32_x";
    const MMA2_NAME: &'static str = "gemv_mma2_f32_x";
}

/// The largest M one launch of the default (tensor-core) variant takes.
pub const GEMV_MAX_M: usize = 64;

/// The largest M one launch of the FMA variant takes.
pub const GEMV_FMA_MAX_M: usize = 16;

/// Rows of x per MMA tile; a launch of M rows runs the kernel for `ceil(M / 16)` tiles.
pub(crate) const MMA_X_ROWS: usize = 16;

/// The two implementations of the decode GEMV. Each is batch-invariant on its own; mixing them
/// across launches is not (their reduction orders differ), so a backend uses one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvVariant {
    /// f32 fused multiply-adds, one kernel per M (`gemv_{bf16,f32}_m{M}`); `k % 8 == 0`.
    Fma,
    /// Tensor-core m16n8k16 MMAs, one kernel per 16-row tile count (`gemv_mma_{bf16,f32}_x{1..4}`),
    /// every row's reduction order the same in all of them; `k % 32 == 0`.
    Mma,
    /// The same MMAs split into 4 k-phases instead of 16, so a block holds 64 or 128 rows of W
    /// and repeats its x loads a quarter as often (`gemv_mma2_*`): the wide projections' GEMV
    /// (gate/up and the LM head; the 4096-row ones make too few blocks of it). Its own bits, the
    /// same for every M; `k % 32 == 0`.
    Mma2,
    /// [`GemvVariant::Mma`] in the run order: each of the 16 k-phases is one contiguous run of
    /// k-steps (`runs_gemv_*_p16_*`), so that [`Kernels::gemm_runs`] computes the same bits
    /// for any number of rows. Its own bits, the same for every M; `k % 32 == 0`.
    MmaRuns,
    /// [`GemvVariant::Mma2`] in the run order (4 runs, `runs_gemv_*_p4_*`).
    Mma2Runs,
}

impl GemvVariant {
    /// The number of k-phases (runs) of a tensor-core variant; `None` for [`GemvVariant::Fma`].
    pub fn phases(self) -> Option<u32> {
        match self {
            GemvVariant::Fma => None,
            GemvVariant::Mma | GemvVariant::MmaRuns => Some(16),
            GemvVariant::Mma2 | GemvVariant::Mma2Runs => Some(4),
        }
    }

    /// The run-order variant with this variant's phase count: what prompt rows sharing a step
    /// with this variant's decode rows would take through [`Kernels::gemm_runs`].
    pub fn in_runs(self) -> Option<GemvVariant> {
        match self.phases()? {
            16 => Some(GemvVariant::MmaRuns),
            _ => Some(GemvVariant::Mma2Runs),
        }
    }
}

/// Rows of W per block of [`GemvVariant::Mma2`]; mirrors `MmaTiles` × the row groups of
/// `MMA2_PHASES` in `cuda/gemv_mma.cuh`.
pub(crate) fn mma2_rows(m: usize) -> u32 {
    if m.div_ceil(MMA_X_ROWS) == 1 { 64 } else { 128 }
}

/// Rows of W per block of the MMA variant for `m` rows of x; mirrors `MmaTiles` in
/// `cuda/gemv_mma.cuh` (two tiles of 8 for one x tile of 16 rows, four for more).
pub(crate) fn mma_rows(m: usize) -> u32 {
    if m.div_ceil(MMA_X_ROWS) == 1 { 16 } else { 32 }
}
/// Threads per block of the MMA variant (16 warps); mirrors `MMA_WARPS` in `cuda/gemv.cu`.
pub(crate) const MMA_THREADS: u32 = 512;

/// Rows of W per block for `m` rows of x; mirrors `GemvRows<M>` in `cuda/gemv.cu`.
fn rows_per_block(m: usize) -> u32 {
    match m {
        0..=4 => 8,
        5..=8 => 4,
        _ => 2,
    }
}

/// The rows of x one tensor-core GEMV launch takes: 1 ..= [`GEMV_MAX_M`].
pub(crate) fn check_rows(kernel: &'static str, m: usize) -> Result<(), KernelError> {
    ensure_shape!(
        (1..=GEMV_MAX_M).contains(&m),
        kernel,
        "m = {m} is outside 1..={GEMV_MAX_M} (use the cuBLASLt GEMM for more rows)"
    );
    Ok(())
}

/// The shard GEMV's layout (bf16 or block weights): `m` rows of x `ld` wide, `shards` K-slices
/// of `kslice` columns (a positive multiple of `step`) inside them, each shard's `m × n` outputs
/// `y_stride` apart in `y_len` f32.
pub(crate) fn check_shards(
    kernel: &'static str,
    (m, n): (usize, usize),
    (shards, kslice, ld): (usize, usize, usize),
    (step, y_stride): (usize, usize),
    (x_len, y_len): (usize, usize),
) -> Result<(), KernelError> {
    check_rows(kernel, m)?;
    ensure_shape!(
        kslice > 0 && kslice.is_multiple_of(step) && ld.is_multiple_of(8),
        kernel,
        "kslice = {kslice} must be a positive multiple of {step} and ld = {ld} a multiple of 8"
    );
    ensure_shape!(
        shards > 0 && shards * kslice <= ld && y_stride >= m * n,
        kernel,
        "{shards} shards of {kslice} columns do not fit rows of {ld}, or a stride of \
         {y_stride} cannot hold {m} x {n} outputs"
    );
    need_len(kernel, "x", x_len, product(kernel, &[m, ld])?)?;
    need_len(
        kernel,
        "y",
        y_len,
        product(kernel, &[shards - 1, y_stride])? + m * n,
    )
}

impl Kernels {
    /// `y[m, n] = bf16(Σ_k x[m, k] · w[n, k])`, f32 accumulation.
    ///
    /// `x` `[m, k]`, `w` `[n, k]` row-major (HF Linear layout), `y` `[m, n]`; `1 ≤ m ≤ 64`,
    /// `k % 32 == 0` ([`DEFAULT_VARIANT`]; the FMA variant needs `k % 8 == 0`), `x` and `w`
    /// 16-byte aligned. Row `m` of `y` is bitwise the same for any `m` count (same variant).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv(
        &self,
        stream: &Arc<CudaStream>,
        y: &mut impl DevicePtrMut<bf16>,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), KernelError> {
        self.gemv_with(DEFAULT_VARIANT, stream, y, x, w, (m, n, k))
    }

    /// [`Kernels::gemv`] with f32 output (logits): `y[m, n] = Σ_k x[m, k] · w[n, k]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_f32(
        &self,
        stream: &Arc<CudaStream>,
        y: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), KernelError> {
        self.gemv_with(DEFAULT_VARIANT, stream, y, x, w, (m, n, k))
    }

    /// [`Kernels::gemv`] (`T` = bf16) or [`Kernels::gemv_f32`] (`T` = f32) through an explicit
    /// variant, for comparing them; `(m, n, k)` as there.
    pub fn gemv_with<T: GemvOut>(
        &self,
        variant: GemvVariant,
        stream: &Arc<CudaStream>,
        y: &mut impl DevicePtrMut<T>,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        (m, n, k): (usize, usize, usize),
    ) -> Result<(), KernelError> {
        let prefix = T::PREFIX;
        let (step, max_m) = match variant {
            GemvVariant::Fma => (8, GEMV_FMA_MAX_M),
            _ => (32, GEMV_MAX_M),
        };
        ensure_shape!(
            (1..=max_m).contains(&m),
            prefix,
            "m = {m} is outside 1..={max_m} for the {variant:?} variant (use the cuBLASLt GEMM \
             for more rows)"
        );
        ensure_shape!(
            k.is_multiple_of(step) && k > 0,
            prefix,
            "k = {k} is not a positive multiple of {step} ({variant:?} variant)"
        );
        need_len(prefix, "y", y.len(), product(prefix, &[m, n])?)?;
        need_len(prefix, "x", x.len(), product(prefix, &[m, k])?)?;
        need_len(prefix, "w", w.len(), product(prefix, &[n, k])?)?;
        let (n32, k32) = (to_u32(prefix, "n", n)?, to_u32(prefix, "k", k)?);
        if n == 0 {
            return Ok(());
        }
        let tiles = m.div_ceil(MMA_X_ROWS);
        let (module, name, blocks, threads) = match variant {
            GemvVariant::Fma => (
                MODULE,
                format!("{prefix}_m{m}"),
                n32.div_ceil(rows_per_block(m)),
                THREADS,
            ),
            GemvVariant::Mma => (
                MODULE,
                format!("{}{tiles}", T::MMA_NAME),
                n32.div_ceil(mma_rows(m)),
                MMA_THREADS,
            ),
            GemvVariant::Mma2 => (
                MODULE,
                format!("{}{tiles}", T::MMA2_NAME),
                n32.div_ceil(mma2_rows(m)),
                MMA_THREADS,
            ),
            GemvVariant::MmaRuns => (
                crate::runs::MODULE,
                format!("runs_gemv_{}_p16_x{tiles}", T::OUT),
                n32.div_ceil(mma_rows(m)),
                MMA_THREADS,
            ),
            GemvVariant::Mma2Runs => (
                crate::runs::MODULE,
                format!("runs_gemv_{}_p4_x{tiles}", T::OUT),
                n32.div_ceil(mma2_rows(m)),
                MMA_THREADS,
            ),
        };
        let f = self.function(module, &name)?;
        let (yp, _y) = y.device_ptr_mut(stream);
        let (xp, _x) = x.device_ptr(stream);
        let (wp, _w) = w.device_ptr(stream);
        aligned16(prefix, "x", xp)?;
        aligned16(prefix, "w", wp)?;
        let m32 = m as u32;
        let mut b = stream.launch_builder(f);
        b.arg(&yp).arg(&xp).arg(&wp);
        if variant != GemvVariant::Fma {
            b.arg(&m32);
        }
        b.arg(&n32).arg(&k32);
        // SAFETY: lengths, alignment and argument types checked above match the kernel.
        unsafe { b.launch(grid(blocks, threads)) }?;
        Ok(())
    }

    /// Three bf16 GEMVs of one `x` in a single launch: `ys[i][m, ns[i]] = x[m, k] · ws[i]ᵀ`
    /// (the q, k and v projections). Every output is bitwise what [`Kernels::gemv`] gives for
    /// the same operands; one launch fills the GPU where the narrow k and v projections alone
    /// would not. Same contract as [`Kernels::gemv`] for each of the three.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv3(
        &self,
        stream: &Arc<CudaStream>,
        ys: [&mut CudaViewMut<'_, bf16>; 3],
        x: &impl DevicePtr<bf16>,
        ws: [&CudaView<'_, bf16>; 3],
        m: usize,
        ns: [usize; 3],
        k: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "gemv_mma3_bf16_x";
        check_rows(K, m)?;
        ensure_shape!(
            k.is_multiple_of(32) && k > 0,
            K,
            "k = {k} is not a positive multiple of 32"
        );
        need_len(K, "x", x.len(), product(K, &[m, k])?)?;
        let mut blocks = 0u32;
        for i in 0..3 {
            need_len(K, "y", ys[i].len(), product(K, &[m, ns[i]])?)?;
            need_len(K, "w", ws[i].len(), product(K, &[ns[i], k])?)?;
            blocks += to_u32(K, "n", ns[i])?.div_ceil(mma_rows(m));
        }
        if blocks == 0 {
            return Ok(());
        }
        let f = self.function(MODULE, &format!("{K}{}", m.div_ceil(MMA_X_ROWS)))?;
        let [y0, y1, y2] = ys;
        let (y0p, _y0) = y0.device_ptr_mut(stream);
        let (y1p, _y1) = y1.device_ptr_mut(stream);
        let (y2p, _y2) = y2.device_ptr_mut(stream);
        let (xp, _x) = x.device_ptr(stream);
        let (w0p, _w0) = ws[0].device_ptr(stream);
        let (w1p, _w1) = ws[1].device_ptr(stream);
        let (w2p, _w2) = ws[2].device_ptr(stream);
        aligned16(K, "x", xp)?;
        for (what, p) in [("w0", w0p), ("w1", w1p), ("w2", w2p)] {
            aligned16(K, what, p)?;
        }
        let (m32, k32) = (m as u32, k as u32);
        let (n0, n1, n2) = (ns[0] as u32, ns[1] as u32, ns[2] as u32);
        let mut b = stream.launch_builder(f);
        b.arg(&y0p).arg(&y1p).arg(&y2p).arg(&xp);
        b.arg(&w0p).arg(&w1p).arg(&w2p);
        b.arg(&m32).arg(&n0).arg(&n1).arg(&n2).arg(&k32);
        // SAFETY: lengths, alignment and argument types checked above match the kernel.
        unsafe { b.launch(grid(blocks, MMA_THREADS)) }?;
        Ok(())
    }

    /// The row-parallel shard partials (DESIGN.md §5): for every shard `s < shards`,
    /// `y[s * y_stride + i * n + j] = Σ_{c < kslice} x[i, s * kslice + c] · w[j, s * kslice + c]`
    /// in f32, with `x` `[m, ld]` and `w` `[n, ld]` row-major (`shards * kslice ≤ ld`). Shard
    /// `s`'s partial depends only on its K-slice, never on `ld`, `shards` or `m` (the same
    /// reduction order as [`Kernels::gemv`] over `kslice` columns), so a rank holding some of
    /// the shards computes bitwise what one GPU holding all of them does.
    /// `1 ≤ m ≤ 64`, `kslice % 32 == 0`, `ld % 8 == 0`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_shards(
        &self,
        stream: &Arc<CudaStream>,
        y: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        (m, n): (usize, usize),
        (shards, kslice, ld): (usize, usize, usize),
        y_stride: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "gemv_mma_shards_f32_x";
        check_shards(
            K,
            (m, n),
            (shards, kslice, ld),
            (32, y_stride),
            (x.len(), y.len()),
        )?;
        need_len(K, "w", w.len(), product(K, &[n, ld])?)?;
        let n32 = to_u32(K, "n", n)?;
        if n == 0 {
            return Ok(());
        }
        let (m32, kslice32, ld32) = (m as u32, kslice as u32, to_u32(K, "ld", ld)?);
        let shards32 = to_u32(K, "shards", shards)?;
        let stride64 = y_stride as u64;
        let f = self.function(MODULE, &format!("{K}{}", m.div_ceil(MMA_X_ROWS)))?;
        let (yp, _y) = y.device_ptr_mut(stream);
        let (xp, _x) = x.device_ptr(stream);
        let (wp, _w) = w.device_ptr(stream);
        aligned16(K, "x", xp)?;
        aligned16(K, "w", wp)?;
        let mut b = stream.launch_builder(f);
        b.arg(&yp).arg(&xp).arg(&wp);
        b.arg(&m32)
            .arg(&n32)
            .arg(&kslice32)
            .arg(&ld32)
            .arg(&stride64);
        let mut config = grid(n32.div_ceil(mma_rows(m)), MMA_THREADS);
        config.grid_dim.1 = shards32;
        // SAFETY: lengths, alignment and argument types checked above match the kernel.
        unsafe { b.launch(config) }?;
        Ok(())
    }
}
