//! Device self-test of `cuda/fp4.cu`:
//!
//! - the NVFP4 activation quantizer, bit for bit the CPU reference's W4A4 input arithmetic (the
//!   caller's: `ActivationQuant::Nvfp4`, itself compressed-tensors' forward bit for bit), on rows
//!   with a zero group and values past the e4m3 and e2m1 ranges; canary: the reference under
//!   another global scale;
//! - on sm_120a / sm_121a, the block-scaled FP4 tensor-core product against an f64 product of
//!   the same dequantized operands (within bf16 rounding); canary: weights with a changed group
//!   scale. Elsewhere, that its launcher refuses the architecture by name.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use half::bf16;

use crate::selftest::{Rng, download, poisoned_bf16, rel_err, round_bf16, upload};
use crate::selftest_blocks::{Dequantizer, random_blocks};
use crate::selftest_gemv::invariance_result;
use crate::{BlockFormat, CheckResult, KernelError, Kernels, has_fp4_mma};

/// The CPU reference of W4A4 inputs: rows of values (groups of 16) and the global scale → the
/// quantized and dequantized values.
pub type W4a4Reference<'a> = &'a dyn Fn(&[f32], f32) -> Vec<f32>;

/// An e4m3 byte as f32 (finite codes).
fn e4m3(b: u8) -> f32 {
    let (exponent, mantissa) = (i32::from((b >> 3) & 15), f32::from(b & 7));
    let magnitude = if exponent == 0 {
        mantissa * 2f32.powi(-9)
    } else {
        (1.0 + mantissa / 8.0) * 2f32.powi(exponent - 7)
    };
    if b & 0x80 != 0 { -magnitude } else { magnitude }
}

/// An e2m1 nibble as f32 (negative zero as +0, as the reference's values compare).
fn e2m1(q: u8) -> f32 {
    const TABLE: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let v = TABLE[usize::from(q & 7)];
    if q & 8 != 0 { -v } else { v }
}

/// The values the quantizer's codes and scales stand for: `code · (s8 / global)` in f32, as the
/// reference computes them.
fn decode(codes: &[u8], scales: &[u8], global: f32) -> Vec<f32> {
    codes
        .iter()
        .flat_map(|&b| [b & 15, b >> 4])
        .enumerate()
        .map(|(i, q)| e2m1(q) * (e4m3(scales[i / 16]) / global))
        .collect()
}

/// Every FP4 check, with `reference` as the CPU W4A4 input arithmetic and `dequantize` as the
/// CPU dequantizer of the weight blocks.
pub fn check_fp4(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    seed: u64,
    reference: W4a4Reference<'_>,
    dequantize: Dequantizer<'_>,
) -> Vec<CheckResult> {
    let mut rng = Rng::new(seed ^ 0xf4);
    let mut results = Vec::new();
    match check_quantizer(kernels, s, &mut rng, reference) {
        Ok(mut r) => results.append(&mut r),
        Err(e) => results.push(CheckResult::error(
            "nvfp4_quantize_rows",
            format!("seed {seed:#x}"),
            false,
            e,
        )),
    }
    match check_mma(kernels, s, &mut rng, dequantize) {
        Ok(mut r) => results.append(&mut r),
        Err(e) => results.push(CheckResult::error(
            "nvfp4_mma_gemm",
            format!("seed {seed:#x}"),
            false,
            e,
        )),
    }
    results
}

fn check_quantizer(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
    reference: W4a4Reference<'_>,
) -> Result<Vec<CheckResult>, KernelError> {
    let (m, k) = (37, 1024);
    let mut x = rng.bf16_vec(m * k, 8.0, 0.0);
    // A row of zeros (every group's scale stands in as 0.125) and a few large values.
    x[3 * k..4 * k].fill(bf16::ZERO);
    for i in (0..m * k).step_by(997) {
        x[i] = bf16::from_f32(3000.0);
    }
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    // A global scale that maps a typical group maximum near e4m3's top, so that some groups'
    // scales saturate at 448 (their codes at 6).
    let global = 448.0 * 6.0 / 40.0;
    let dx = upload(s, &x)?;
    let mut codes = upload(s, &vec![0u8; m * k / 2])?;
    let mut scales = upload(s, &vec![0u8; m * k / 16])?;
    kernels.nvfp4_quantize_rows(s, &dx, &mut codes, &mut scales, m, k, global)?;
    let got = decode(&download(s, &codes)?, &download(s, &scales)?, global);
    let mismatches = |want: &[f32]| {
        got.iter()
            .zip(want)
            .filter(|(a, b)| a.to_bits() != b.to_bits() && !(**a == 0.0 && **b == 0.0))
            .count()
    };
    let case = format!("m={m} k={k} global={global}");
    Ok(vec![
        invariance_result(
            "nvfp4_quantize_rows",
            format!("{case}: vs the CPU W4A4 reference"),
            false,
            mismatches(&reference(&xf, global)),
        ),
        invariance_result(
            "nvfp4_quantize_rows",
            format!("{case}: vs the reference under global x 1.5 (canary)"),
            true,
            mismatches(&reference(&xf, global * 1.5)),
        ),
    ])
}

fn check_mma(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
    dequantize: Dequantizer<'_>,
) -> Result<Vec<CheckResult>, KernelError> {
    let format = BlockFormat::Nvfp4;
    let (n, k) = (64, 512);
    let mut bytes = random_blocks(rng, format, n, k);
    // Non-negative group scales (the MMA's ue4m3 has no sign; checkpoints' scales are positive).
    for block in bytes.chunks_exact_mut(format.block_bytes()) {
        block[4..8].iter_mut().for_each(|g| *g &= 0x7f);
    }
    let mut changed = bytes.clone();
    for block in changed.chunks_exact_mut(format.block_bytes()) {
        block[4] ^= 0x08;
    }
    let dw = upload(s, &format.to_device(&bytes))?;
    let global = 448.0 * 6.0 / 4.0;
    if !has_fp4_mma(kernels.arch()) {
        let (codes, scales) = (upload(s, &[0u8; 256])?, upload(s, &[0u8; 32])?);
        let mut y = poisoned_bf16(s, n)?;
        let refused = kernels
            .nvfp4_mma_gemm(s, &codes, &scales, &dw, format, &mut y, (1, n, k), global)
            .is_err_and(|e| e.to_string().contains("needs sm_120a"));
        return Ok(vec![invariance_result(
            "nvfp4_mma_gemm",
            format!(
                "{}: the launcher refuses an architecture without FP4 MMA",
                kernels.arch()
            ),
            false,
            usize::from(!refused),
        )]);
    }
    let (w, w_changed) = (
        dequantize(format, &bytes, n * k),
        dequantize(format, &changed, n * k),
    );
    let mut results = Vec::new();
    for m in [1, 17, 64] {
        let x = rng.bf16_vec(m * k, 1.0, 0.0);
        let dx = upload(s, &x)?;
        let mut codes = upload(s, &vec![0u8; m * k / 2])?;
        let mut scales = upload(s, &vec![0u8; m * k / 16])?;
        kernels.nvfp4_quantize_rows(s, &dx, &mut codes, &mut scales, m, k, global)?;
        let mut y = poisoned_bf16(s, m * n)?;
        kernels.nvfp4_mma_gemm(s, &codes, &scales, &dw, format, &mut y, (m, n, k), global)?;
        let got: Vec<f64> = download(s, &y)?.iter().map(|v| v.to_f64()).collect();
        let xa = decode(&download(s, &codes)?, &download(s, &scales)?, global);
        let product = |w: &[f32]| -> Vec<f64> {
            (0..m * n)
                .map(|i| {
                    let (r, c) = (i / n, i % n);
                    let dot: f64 = (0..k)
                        .map(|j| f64::from(xa[r * k + j]) * f64::from(w[c * k + j]))
                        .sum();
                    round_bf16(dot)
                })
                .collect()
        };
        let (want, wrong) = (product(&w), product(&w_changed));
        let written = got.iter().all(|v| !v.is_nan());
        let case = format!("nvfp4 m={m} n={n} k={k}");
        let tolerance = 1e-2;
        results.push(CheckResult::compare(
            "nvfp4_mma_gemm",
            format!("{case}: vs the f64 product of the dequantized operands"),
            false,
            rel_err(&got, &want),
            tolerance,
            written,
            String::new(),
        ));
        results.push(CheckResult::compare(
            "nvfp4_mma_gemm",
            format!("{case}: vs weights with a changed group scale (canary)"),
            true,
            rel_err(&got, &wrong),
            tolerance,
            written,
            String::new(),
        ));
    }
    Ok(results)
}
