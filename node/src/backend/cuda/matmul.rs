//! Products with a projection's weight in whichever format it is held ([`Matrix`]): the one
//! place the forward pass meets the weight formats.
//!
//! Decode rows take the GEMV of the weight's format (the bf16 tensor-core GEMV, or the same
//! kernel body over a block loader, bitwise the bf16 GEMV on the widened weight, or the tiled
//! NVFP4 GEMV with its own arithmetic), in the variant of the projection's role ([`Role`]).
//! Prompt rows take the pinned cuBLASLt GEMM on bf16: a block weight is first dequantized into
//! one bf16 buffer of the backend (the widened tensor, bit for bit; tiles to `bf16(w' × s)`). In
//! the run order (`CudaBackend::set_run_order`) every row takes the run-order kernels instead
//! ([`runs`]).

use std::sync::Arc;

use half::bf16;
use strata_kernels::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
};
use strata_kernels::{
    DEFAULT_VARIANT, GEMV_MAX_M, GemmShape, GemvOut, GemvVariant, Kernels, LtGemm,
};

use super::CudaError;
use super::weights::Matrix;

/// The bf16 `[n, k]` weight a GEMM multiplies by: `w` itself, or `w` dequantized into `buffer`
/// (the backend's, sized for its largest block projection).
pub(super) fn gemm_weight<'a>(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    buffer: Option<&'a mut CudaSlice<bf16>>,
    w: &'a Matrix,
    (n, k): (usize, usize),
) -> Result<&'a CudaSlice<bf16>, CudaError> {
    match w {
        Matrix::Bf16(w) => Ok(w),
        Matrix::Blocks { format, data } => {
            let buffer = buffer.ok_or_else(|| {
                CudaError::Unsupported("no dequantization buffer for a block weight".into())
            })?;
            kernels.dequantize(stream, buffer, data, *format, (n, k))?;
            Ok(buffer)
        }
        Matrix::Tiles {
            format,
            data,
            scales,
        } => {
            let buffer = buffer.ok_or_else(|| {
                CudaError::Unsupported("no dequantization buffer for a tiled weight".into())
            })?;
            kernels.dequantize_tiles(stream, buffer, (data, scales), *format, (n, k))?;
            Ok(buffer)
        }
    }
}

/// Which GEMV variant a projection's decode rows take. Chosen by the projection's role, never by a
/// rank's row count, so that a tensor-parallel rank's rows get the bits one GPU gives them (the
/// two variants' reduction orders differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    /// q/k/v, o and down: 4 096–6 144 rows on an 8B shape, too few for the four-phase kernel's
    /// 64–128-row blocks to fill the GPU.
    Narrow,
    /// gate/up and the LM head (28 672 and 128 256 rows on an 8B shape): the four-phase kernel,
    /// which repeats each block's x loads a quarter as often (docs/DECISIONS.md).
    Wide,
}

impl Role {
    fn variant(self) -> GemvVariant {
        match self {
            Role::Narrow => DEFAULT_VARIANT,
            Role::Wide => GemvVariant::Mma2,
        }
    }
}

/// `y[rows, n] = x[rows, k] · wᵀ` for every row of a step in the run order of `role`'s variant
/// (`CudaBackend::set_run_order`): the run-order GEMV up to [`GEMV_MAX_M`] rows, the run-order
/// GEMM above, one weight read for decode and prompt rows alike and each row the same bits in
/// both. bf16 weights only (the backend refuses the order for a model with others).
pub(super) fn runs<T: GemvOut>(
    kernels: &Kernels,
    role: Role,
    stream: &Arc<CudaStream>,
    y: &mut CudaViewMut<'_, T>,
    x: &CudaView<'_, bf16>,
    w: &Matrix,
    (rows, n, k): (usize, usize, usize),
) -> Result<(), CudaError> {
    let Matrix::Bf16(w) = w else {
        return Err(CudaError::Unsupported(
            "the run order takes bf16 weights only".into(),
        ));
    };
    let variant = role
        .variant()
        .in_runs()
        .ok_or_else(|| CudaError::Unsupported(format!("{:?} has no run order", role.variant())))?;
    if rows <= GEMV_MAX_M {
        kernels.gemv_with(variant, stream, y, x, w, (rows, n, k))?;
    } else {
        kernels.gemm_runs(variant, stream, y, x, w, (rows, n, k))?;
    }
    Ok(())
}

/// `y[m, n] = x[m, k] · wᵀ` for `1 ≤ m ≤ 64` decode rows, by the GEMV of `w`'s format in the
/// variant of `role`.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemv<T: GemvOut>(
    kernels: &Kernels,
    role: Role,
    stream: &Arc<CudaStream>,
    y: &mut impl DevicePtrMut<T>,
    x: &impl DevicePtr<bf16>,
    w: &Matrix,
    (m, n, k): (usize, usize, usize),
) -> Result<(), CudaError> {
    match w {
        Matrix::Bf16(w) => kernels.gemv_with(role.variant(), stream, y, x, w, (m, n, k))?,
        Matrix::Blocks { format, data } => {
            kernels.gemv_blocks(role.variant(), stream, y, x, data, *format, (m, n, k))?
        }
        Matrix::Tiles {
            format,
            data,
            scales,
        } => kernels.gemv_tiles_at(stream, y, x, (data, scales), *format, (m, n, k))?,
    }
    Ok(())
}

/// `y[rows, n] = x[rows, k] · wᵀ`: in the run order when `run_order` (all rows, [`runs`]), else
/// rows `..prompt` through the pinned GEMM and the rest through the GEMV of `w`'s format for
/// `role` in groups of at most [`GEMV_MAX_M`] (see the module docs).
#[allow(clippy::too_many_arguments)]
pub(super) fn linear(
    kernels: &Kernels,
    role: Role,
    gemm: &mut LtGemm,
    stream: &Arc<CudaStream>,
    dequant: Option<&mut CudaSlice<bf16>>,
    y: &mut CudaSlice<bf16>,
    x: &CudaSlice<bf16>,
    w: &Matrix,
    (rows, prompt, run_order): (usize, usize, bool),
    shape: GemmShape,
) -> Result<(), CudaError> {
    let (n, k) = (shape.n, shape.k);
    if run_order {
        let (mut out, input) = (y.slice_mut(..rows * n), x.slice(..rows * k));
        return runs(kernels, role, stream, &mut out, &input, w, (rows, n, k));
    }
    if prompt > 0 {
        let wide = gemm_weight(kernels, stream, dequant, w, (n, k))?;
        let mut out = y.slice_mut(..prompt * n);
        let input = x.slice(..prompt * k);
        gemm.matmul_shape(&mut out, &input, wide, prompt, shape)?;
    }
    let mut row = prompt;
    while row < rows {
        let m = (rows - row).min(GEMV_MAX_M);
        let mut out = y.slice_mut(row * n..(row + m) * n);
        let input = x.slice(row * k..(row + m) * k);
        gemv(kernels, role, stream, &mut out, &input, w, (m, n, k))?;
        row += m;
    }
    Ok(())
}
