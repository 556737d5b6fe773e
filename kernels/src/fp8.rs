//! Launcher for `cuda/fp8.cu`: FP8 activations (W8A8) — the quantizer of a Linear's input rows,
//! compressed-tensors' arithmetic bit for bit (static or per-token scales).

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use crate::launch::{aligned16, grid, need_len, positive_scale, product, stride_blocks, to_u32};
use crate::{KernelError, Kernels, ensure_shape};

const MODULE: &str = "fp8";
/// `FP8_QUANT_THREADS` in the source.
const THREADS: u32 = 256;

impl Kernels {
    /// `x` `[m, k]` (k % 8 == 0, 16-byte aligned) quantized to e4m3: `codes` `[m, k]` and each
    /// row's scale in `scales` `[m]`, `code = e4m3(x / s)` with `s` = `scale` for every row
    /// (a checkpoint's static `input_scale`), or with `scale` = None the row's largest magnitude
    /// / 448 (f32's epsilon for a row of zeros).
    #[allow(clippy::too_many_arguments)]
    pub fn fp8_quantize_rows(
        &self,
        stream: &Arc<CudaStream>,
        x: &impl DevicePtr<bf16>,
        codes: &mut impl DevicePtrMut<u8>,
        scales: &mut impl DevicePtrMut<f32>,
        m: usize,
        k: usize,
        scale: Option<f32>,
    ) -> Result<(), KernelError> {
        const K: &str = "fp8_quantize_rows";
        ensure_shape!(k.is_multiple_of(8), K, "k = {k} is not a multiple of 8");
        if let Some(s) = scale {
            positive_scale(K, "static scale", s)?;
        }
        need_len(K, "x", x.len(), product(K, &[m, k])?)?;
        need_len(K, "codes", codes.len(), product(K, &[m, k])?)?;
        need_len(K, "scales", scales.len(), m)?;
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
        let scale = scale.unwrap_or(0.0);
        let mut launch = stream.launch_builder(f);
        launch
            .arg(&x_ptr)
            .arg(&c_ptr)
            .arg(&s_ptr)
            .arg(&m32)
            .arg(&k32)
            .arg(&scale);
        // SAFETY: every buffer holds the shape's elements (checked above); one block a row
        // writes only its row.
        unsafe { launch.launch(grid(m32, THREADS)) }?;
        Ok(())
    }

    /// `y[r, c] = bf16(acc[r, c] · x_scale[r] · w_scale[c])`: the scales of an FP8 product
    /// ([`crate::LtGemm::matmul_fp8`]'s unscaled f32 sums), `acc` `[m, n]`, `x_scale` `[m]`,
    /// `w_scale` `[n]`, `y` `[m, n]`.
    #[allow(clippy::too_many_arguments)]
    pub fn fp8_scale_out(
        &self,
        stream: &Arc<CudaStream>,
        acc: &impl DevicePtr<f32>,
        x_scale: &impl DevicePtr<f32>,
        w_scale: &impl DevicePtr<f32>,
        y: &mut impl DevicePtrMut<bf16>,
        m: usize,
        n: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "fp8_scale_out";
        need_len(K, "acc", acc.len(), product(K, &[m, n])?)?;
        need_len(K, "x_scale", x_scale.len(), m)?;
        need_len(K, "w_scale", w_scale.len(), n)?;
        need_len(K, "y", y.len(), product(K, &[m, n])?)?;
        let (m32, n32) = (to_u32(K, "m", m)?, to_u32(K, "n", n)?);
        if m == 0 || n == 0 {
            return Ok(());
        }
        let f = self.function(MODULE, K)?;
        let (a_ptr, _a) = acc.device_ptr(stream);
        let (xs_ptr, _xs) = x_scale.device_ptr(stream);
        let (ws_ptr, _ws) = w_scale.device_ptr(stream);
        let (y_ptr, _y) = y.device_ptr_mut(stream);
        let mut launch = stream.launch_builder(f);
        launch
            .arg(&a_ptr)
            .arg(&xs_ptr)
            .arg(&ws_ptr)
            .arg(&y_ptr)
            .arg(&m32)
            .arg(&n32);
        // SAFETY: every buffer holds the shape's elements (checked above).
        unsafe { launch.launch(grid(stride_blocks(m * n, THREADS), THREADS)) }?;
        Ok(())
    }
}
