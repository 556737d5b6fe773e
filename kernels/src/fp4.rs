//! Launchers for `cuda/fp4.cu`: NVFP4 activations (W4A4) — the quantizer of a Linear's input
//! rows (every architecture, compressed-tensors' arithmetic bit for bit) and Blackwell's
//! block-scaled FP4 tensor-core product (sm_120a / sm_121a only; written and compile-checked,
//! not yet run: no Blackwell GPU is lent here).

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use crate::launch::{aligned16, grid, need_len, positive_scale, product, stride_blocks, to_u32};
use crate::{BlockFormat, KernelError, Kernels, ensure_shape};

const MODULE: &str = "fp4";
const THREADS: u32 = 256;
/// Warps of one `nvfp4_mma_gemm` block (`FP4_WARPS` in the source), each a 16 × 8 tile.
const MMA_WARPS: u32 = 4;

/// Whether `arch` has the block-scaled FP4 `mma.sync` (`kind::mxf4nvf4`).
pub fn has_fp4_mma(arch: &str) -> bool {
    matches!(arch, "sm_120a" | "sm_121a")
}

// Launchers mirror their kernel's signature: buffers then shape.
#[allow(clippy::too_many_arguments)]
impl Kernels {
    /// `x` `[m, k]` (k % 16 == 0, 16-byte aligned) quantized to NVFP4 under the static global
    /// scale `global`: `codes` `[m, k / 2]` (two e2m1 a byte, the even element in the low nibble),
    /// `scales` `[m, k / 16]` (e4m3 bytes), per group of 16 `s8 = e4m3(global · amax / 6)`
    /// (0.125 for zero) and `code = e2m1(x / (s8 / global))`.
    pub fn nvfp4_quantize_rows(
        &self,
        stream: &Arc<CudaStream>,
        x: &impl DevicePtr<bf16>,
        codes: &mut impl DevicePtrMut<u8>,
        scales: &mut impl DevicePtrMut<u8>,
        m: usize,
        k: usize,
        global: f32,
    ) -> Result<(), KernelError> {
        const K: &str = "nvfp4_quantize_rows";
        ensure_shape!(k.is_multiple_of(16), K, "k = {k} is not a multiple of 16");
        positive_scale(K, "global scale", global)?;
        need_len(K, "x", x.len(), product(K, &[m, k])?)?;
        need_len(K, "codes", codes.len(), product(K, &[m, k / 2])?)?;
        need_len(K, "scales", scales.len(), product(K, &[m, k / 16])?)?;
        let (m32, k32) = (to_u32(K, "m", m)?, to_u32(K, "k", k)?);
        if m == 0 || k == 0 {
            return Ok(());
        }
        let f = self.function(MODULE, K)?;
        let (x_ptr, _x) = x.device_ptr(stream);
        let (c_ptr, _c) = codes.device_ptr_mut(stream);
        let (s_ptr, _s) = scales.device_ptr_mut(stream);
        aligned16(K, "x", x_ptr)?;
        ensure_shape!(c_ptr.is_multiple_of(8), K, "codes are not 8-byte aligned");
        let blocks = stride_blocks(m * k / 16, THREADS);
        let mut launch = stream.launch_builder(f);
        launch
            .arg(&x_ptr)
            .arg(&c_ptr)
            .arg(&s_ptr)
            .arg(&m32)
            .arg(&k32)
            .arg(&global);
        // SAFETY: every buffer holds the shape's elements (checked above) and the kernel writes
        // only inside them.
        unsafe { launch.launch(grid(blocks, THREADS)) }?;
        Ok(())
    }

    /// `y` `[m, n]` bf16 = the W4A4 product of NVFP4 activations (`codes`, `scales` as
    /// [`Kernels::nvfp4_quantize_rows`] writes them under `global`) and an NVFP4 weight `w`
    /// `[n, k]` in device blocks of `format` ([`BlockFormat::Nvfp4`] or
    /// [`BlockFormat::Nvfp4Modelopt`]), on Blackwell's block-scaled FP4 tensor cores.
    /// k % 64 == 0, n % 8 == 0; the weight's group scales non-negative. Refused on any
    /// architecture without the instruction ([`has_fp4_mma`]).
    pub fn nvfp4_mma_gemm(
        &self,
        stream: &Arc<CudaStream>,
        codes: &impl DevicePtr<u8>,
        scales: &impl DevicePtr<u8>,
        w: &impl DevicePtr<u8>,
        format: BlockFormat,
        y: &mut impl DevicePtrMut<bf16>,
        (m, n, k): (usize, usize, usize),
        global: f32,
    ) -> Result<(), KernelError> {
        const K: &str = "nvfp4_mma_gemm";
        ensure_shape!(
            has_fp4_mma(self.arch()),
            K,
            "block-scaled FP4 MMA needs sm_120a or sm_121a; this GPU is {}",
            self.arch()
        );
        let kernel = match format {
            BlockFormat::Nvfp4 => "nvfp4_mma_gemm",
            BlockFormat::Nvfp4Modelopt => "nvfp4_mma_gemm_modelopt",
            other => {
                return Err(KernelError::Shape {
                    kernel: K,
                    message: format!("{} weights are not NVFP4", other.kernel_name()),
                });
            }
        };
        ensure_shape!(k.is_multiple_of(64), K, "k = {k} is not a multiple of 64");
        ensure_shape!(n.is_multiple_of(8), K, "n = {n} is not a multiple of 8");
        positive_scale(K, "global scale", global)?;
        let row_bytes = k / format.block_elems() * format.device_block_bytes();
        need_len(K, "codes", codes.len(), product(K, &[m, k / 2])?)?;
        need_len(K, "scales", scales.len(), product(K, &[m, k / 16])?)?;
        need_len(K, "w", w.len(), product(K, &[n, row_bytes])?)?;
        need_len(K, "y", y.len(), product(K, &[m, n])?)?;
        let (m32, n32, k32) = (to_u32(K, "m", m)?, to_u32(K, "n", n)?, to_u32(K, "k", k)?);
        if m == 0 || n == 0 || k == 0 {
            return Ok(());
        }
        let f = self.function(MODULE, kernel)?;
        let (c_ptr, _c) = codes.device_ptr(stream);
        let (s_ptr, _s) = scales.device_ptr(stream);
        let (w_ptr, _w) = w.device_ptr(stream);
        let (y_ptr, _y) = y.device_ptr_mut(stream);
        for (what, ptr) in [
            ("codes", c_ptr),
            ("scales", s_ptr),
            ("w", w_ptr),
            ("y", y_ptr),
        ] {
            ensure_shape!(ptr.is_multiple_of(4), K, "{what} is not 4-byte aligned");
        }
        let row_bytes = row_bytes as u64;
        let config = cudarc::driver::LaunchConfig {
            grid_dim: (n32.div_ceil(8 * MMA_WARPS), m32.div_ceil(16), 1),
            block_dim: (32 * MMA_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(f);
        launch
            .arg(&c_ptr)
            .arg(&s_ptr)
            .arg(&w_ptr)
            .arg(&row_bytes)
            .arg(&y_ptr)
            .arg(&m32)
            .arg(&n32)
            .arg(&k32)
            .arg(&global);
        // SAFETY: every buffer holds the shape's elements (checked above), the kernel reads rows
        // below m only and writes y inside [m, n]; the architecture has the instruction.
        unsafe { launch.launch(config) }?;
        Ok(())
    }
}
