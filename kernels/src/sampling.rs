//! Launcher for `cuda/sampling.cu`: on-device greedy sampling.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};

use crate::launch::{grid, need_len, product, to_u32};
use crate::{KernelError, Kernels, ensure_shape};

const THREADS: u32 = 1024;

/// What [`Kernels::argmax`] writes for a row with no finite logit.
pub const NO_TOKEN: u32 = u32::MAX;

impl Kernels {
    /// `out[r] = argmax_i logits[r * stride + i]` for `r < rows`, `i < vocab`, in the CPU
    /// sampler's order (`strata_model::sampler::greedy_token`): NaN ranks as -inf and never wins,
    /// +inf ranks as `f32::MAX`, the lowest index among equal maxima; a row with no finite value
    /// gives [`NO_TOKEN`].
    ///
    /// `logits` `[rows, stride]` f32 (columns from `vocab` on are ignored), `out` `[rows]`;
    /// `1 ≤ vocab ≤ stride`. The result does not depend on how the row is split across threads
    /// (a total order is reduced).
    pub fn argmax(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<u32>,
        logits: &impl DevicePtr<f32>,
        rows: usize,
        vocab: usize,
        stride: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "argmax_f32";
        ensure_shape!(vocab > 0, K, "vocab is 0");
        ensure_shape!(
            vocab <= stride,
            K,
            "vocab {vocab} exceeds the row stride {stride}"
        );
        need_len(K, "out", out.len(), rows)?;
        if rows > 0 {
            let last = product(K, &[rows - 1, stride])? + vocab;
            need_len(K, "logits", logits.len(), last)?;
        }
        let (rows32, vocab32) = (to_u32(K, "rows", rows)?, to_u32(K, "vocab", vocab)?);
        let stride32 = to_u32(K, "stride", stride)?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function("sampling", K)?;
        let (o, _o) = out.device_ptr_mut(stream);
        let (l, _l) = logits.device_ptr(stream);
        let mut b = stream.launch_builder(f);
        b.arg(&o).arg(&l).arg(&vocab32).arg(&stride32);
        // SAFETY: lengths and argument types checked above match the kernel.
        unsafe { b.launch(grid(rows32, THREADS)) }?;
        Ok(())
    }
}
