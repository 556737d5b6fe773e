//! Launchers for `cuda/runs.cu`: the run order of a bf16 projection as a tiled GEMM for any
//! number of rows ([`Kernels::gemm_runs`]); its GEMV entries are [`GemvVariant::MmaRuns`] and
//! [`GemvVariant::Mma2Runs`] of [`Kernels::gemv_with`].
//!
//! Row `m` of `gemm_runs` is bitwise row `m` of the run-order GEMV with the same phase count, for
//! any M on either side: the step of a server that carries decode rows and prompt rows can read
//! each weight once (one GEMM for all of them) without a decode row's bits depending on the
//! prompts beside it (docs/DECISIONS.md).

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::launch::{aligned16, need_len, product, to_u32};
use crate::{GemvOut, GemvVariant, KernelError, Kernels, ensure_shape};

pub(crate) const MODULE: &str = "runs";
/// x rows, W rows and threads of one block; mirrors `RG_BM`, `RG_BN` and `RG_THREADS`.
const BLOCK_M: u32 = 64;
const BLOCK_N: u32 = 128;
const THREADS: u32 = 128;
/// Dynamic shared memory of one block: 3 stages of (64 + 128) rows × 64 bf16; mirrors `RG_SMEM`.
pub(crate) const RUNS_GEMM_SMEM: u32 = 3 * (64 + 128) * 64 * 2;

impl Kernels {
    /// Lets every run-order GEMM entry take its [`RUNS_GEMM_SMEM`] bytes of dynamic shared
    /// memory (above the default 48 KiB); called once by [`Kernels::load`].
    pub(crate) fn allow_runs_gemm_smem(&self) -> Result<(), KernelError> {
        for out in ["bf16", "f32"] {
            for phases in [16, 4] {
                self.function(MODULE, &format!("runs_gemm_{out}_p{phases}"))?
                    .set_attribute(
                        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        RUNS_GEMM_SMEM as i32,
                    )?;
            }
        }
        Ok(())
    }

    /// `y[m, n] = Σ_k x[m, k] · w[n, k]` in the run order of `variant` ([`GemvVariant::MmaRuns`]:
    /// 16 runs, [`GemvVariant::Mma2Runs`]: 4), for any `m ≥ 1`: every row bitwise what
    /// [`Kernels::gemv_with`] of the same variant gives it (`T` = bf16 or f32 output).
    ///
    /// `x` `[m, k]`, `w` `[n, k]` row-major, `y` `[m, n]`; `k % 32 == 0`, `x` and `w` 16-byte
    /// aligned.
    pub fn gemm_runs<T: GemvOut>(
        &self,
        variant: GemvVariant,
        stream: &Arc<CudaStream>,
        y: &mut impl DevicePtrMut<T>,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        (m, n, k): (usize, usize, usize),
    ) -> Result<(), KernelError> {
        const K: &str = "runs_gemm";
        let phases = match variant {
            GemvVariant::MmaRuns => 16,
            GemvVariant::Mma2Runs => 4,
            other => {
                return Err(KernelError::Shape {
                    kernel: K,
                    message: format!("{other:?} is not a run-order variant (MmaRuns, Mma2Runs)"),
                });
            }
        };
        ensure_shape!(
            k.is_multiple_of(32) && k > 0,
            K,
            "k = {k} is not a positive multiple of 32"
        );
        need_len(K, "y", y.len(), product(K, &[m, n])?)?;
        need_len(K, "x", x.len(), product(K, &[m, k])?)?;
        need_len(K, "w", w.len(), product(K, &[n, k])?)?;
        let (m32, n32, k32) = (to_u32(K, "m", m)?, to_u32(K, "n", n)?, to_u32(K, "k", k)?);
        let n_tiles = n32.div_ceil(BLOCK_N);
        ensure_shape!(
            n_tiles <= 65_535,
            K,
            "n = {n} needs {n_tiles} tiles of {BLOCK_N} rows (at most 65 535)"
        );
        if m == 0 || n == 0 {
            return Ok(());
        }
        let f = self.function(MODULE, &format!("runs_gemm_{}_p{phases}", T::OUT))?;
        let (yp, _y) = y.device_ptr_mut(stream);
        let (xp, _x) = x.device_ptr(stream);
        let (wp, _w) = w.device_ptr(stream);
        aligned16(K, "x", xp)?;
        aligned16(K, "w", wp)?;
        let mut b = stream.launch_builder(f);
        b.arg(&yp).arg(&xp).arg(&wp).arg(&m32).arg(&n32).arg(&k32);
        let config = LaunchConfig {
            grid_dim: (m32.div_ceil(BLOCK_M), n_tiles, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: RUNS_GEMM_SMEM,
        };
        // SAFETY: lengths, alignment and argument types checked above match the kernel; the
        // shared memory size is the kernel's RG_SMEM, allowed at load.
        unsafe { b.launch(config) }?;
        Ok(())
    }
}
