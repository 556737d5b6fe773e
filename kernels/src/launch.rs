//! Small checks shared by the launchers: sizes that must fit the kernels' 32-bit indices,
//! buffers long enough for the shape, and 16-byte alignment for vector loads.

use cudarc::driver::LaunchConfig;

use crate::{KernelError, ensure_shape};

/// `value` as a kernel's u32 argument, or a shape error naming it.
pub(crate) fn to_u32(kernel: &'static str, what: &str, value: usize) -> Result<u32, KernelError> {
    u32::try_from(value).map_err(|_| KernelError::Shape {
        kernel,
        message: format!("{what} = {value} does not fit in 32 bits"),
    })
}

/// `a * b * ...` without overflow, or a shape error.
pub(crate) fn product(kernel: &'static str, factors: &[usize]) -> Result<usize, KernelError> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| KernelError::Shape {
            kernel,
            message: format!("shape {factors:?} overflows"),
        })
}

/// Checks that a buffer of `have` elements holds the `need` the shape addresses.
pub(crate) fn need_len(
    kernel: &'static str,
    what: &str,
    have: usize,
    need: usize,
) -> Result<(), KernelError> {
    ensure_shape!(
        have >= need,
        kernel,
        "{what} holds {have} elements, the shape needs {need}"
    );
    Ok(())
}

/// Checks that a quantization scale is a positive finite number.
pub(crate) fn positive_scale(kernel: &'static str, what: &str, v: f32) -> Result<(), KernelError> {
    ensure_shape!(
        v.is_finite() && v > 0.0,
        kernel,
        "the {what} {v} is not a positive finite number"
    );
    Ok(())
}

/// Checks that a device address is 16-byte aligned (the kernels' vector loads need it).
pub(crate) fn aligned16(kernel: &'static str, what: &str, ptr: u64) -> Result<(), KernelError> {
    ensure_shape!(
        ptr.is_multiple_of(16),
        kernel,
        "{what} at device address {ptr:#x} is not 16-byte aligned (offset views must start at \
         a multiple of 8 bf16 elements)"
    );
    Ok(())
}

/// A 1-D launch of `blocks` blocks of `threads` threads.
pub(crate) fn grid(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Blocks of `threads` for a grid-stride loop over `work` items, capped (the loop covers the rest).
pub(crate) fn stride_blocks(work: usize, threads: u32) -> u32 {
    const MAX_BLOCKS: usize = 1 << 16;
    work.div_ceil(threads as usize).clamp(1, MAX_BLOCKS) as u32
}
