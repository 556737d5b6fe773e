//! Launcher for `cuda/sampling.cu`: on-device greedy sampling.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};

use crate::launch::{grid, need_len, product, to_u32};
use crate::{KernelError, Kernels, ensure_shape};

const THREADS: u32 = 1024;

/// What [`Kernels::argmax`] writes for a row with no non-NaN logit.
pub const NO_TOKEN: u32 = u32::MAX;

impl Kernels {
    /// `out[r] = argmax_i logits[r, i]` for `r < rows`: the lowest index among equal maxima;
    /// NaN never wins; a row of only NaN gives [`NO_TOKEN`].
    ///
    /// `logits` `[rows, vocab]` f32, `out` `[rows]`; `vocab ≥ 1`. The result does not depend on
    /// how the row is split across threads (a total order is reduced).
    pub fn argmax(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<u32>,
        logits: &impl DevicePtr<f32>,
        rows: usize,
        vocab: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "argmax_f32";
        ensure_shape!(vocab > 0, K, "vocab is 0");
        need_len(K, "out", out.len(), rows)?;
        need_len(K, "logits", logits.len(), product(K, &[rows, vocab])?)?;
        let (rows32, vocab32) = (to_u32(K, "rows", rows)?, to_u32(K, "vocab", vocab)?);
        if rows == 0 {
            return Ok(());
        }
        let f = self.function("sampling", K)?;
        let (o, _o) = out.device_ptr_mut(stream);
        let (l, _l) = logits.device_ptr(stream);
        let mut b = stream.launch_builder(f);
        b.arg(&o).arg(&l).arg(&vocab32);
        // SAFETY: lengths and argument types checked above match the kernel.
        unsafe { b.launch(grid(rows32, THREADS)) }?;
        Ok(())
    }
}
