//! Device self-test of the activation quantizers and the FP4 product (`cuda/fp8.cu`,
//! `cuda/fp4.cu`):
//!
//! - the FP8 quantizer (a static scale, and a scale per row) and the NVFP4 quantizer, bit for bit
//!   the CPU reference's W8A8 / W4A4 input arithmetic (the caller's: `ActivationQuant`, itself
//!   compressed-tensors' forward bit for bit), on rows with zeros and values past the formats'
//!   ranges; canaries: the reference under another scale;
//! - the FP8 product (cuBLASLt's e4m3 GEMM, then the row and column scales) against an f64
//!   product of the same dequantized operands (within bf16 rounding), each row's bits the same
//!   at 1 row and at 64 (the pinned algorithm); canary: changed weight scales;
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

/// How activation rows are quantized (the CPU reference's `ActivationQuant`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowQuant {
    /// e4m3 with one static scale.
    Fp8Static(f32),
    /// e4m3 with a scale per row.
    Fp8Token,
    /// NVFP4 under a static global scale.
    Nvfp4(f32),
}

/// The CPU reference: the scheme, rows of `width` values → the quantized and dequantized values.
pub type RowQuantReference<'a> = &'a dyn Fn(RowQuant, &[f32], usize) -> Vec<f32>;

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

/// Every check, with `reference` as the CPU activation arithmetic and `dequantize` as the CPU
/// dequantizer of the weight blocks.
pub fn check_lowp(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    seed: u64,
    reference: RowQuantReference<'_>,
    dequantize: Dequantizer<'_>,
) -> Vec<CheckResult> {
    let mut rng = Rng::new(seed ^ 0xf4);
    let mut results = Vec::new();
    let mut keep = |kernel: &str, outcome: Result<Vec<CheckResult>, KernelError>| match outcome {
        Ok(mut r) => results.append(&mut r),
        Err(e) => results.push(CheckResult::error(
            kernel,
            format!("seed {seed:#x}"),
            false,
            e,
        )),
    };
    keep(
        "fp8_quantize_rows",
        check_fp8_quantizer(kernels, s, &mut rng, reference),
    );
    keep("gemm_fp8", check_fp8_gemm(kernels, s, &mut rng));
    keep(
        "nvfp4_quantize_rows",
        check_quantizer(kernels, s, &mut rng, reference),
    );
    keep(
        "nvfp4_mma_gemm",
        check_mma(kernels, s, &mut rng, dequantize),
    );
    results
}

/// Values that differ bit for bit (either zero equal to the other).
fn value_mismatches(got: &[f32], want: &[f32]) -> usize {
    got.iter()
        .zip(want)
        .filter(|(a, b)| a.to_bits() != b.to_bits() && !(**a == 0.0 && **b == 0.0))
        .count()
        + got.len().abs_diff(want.len())
}

fn check_fp8_quantizer(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
    reference: RowQuantReference<'_>,
) -> Result<Vec<CheckResult>, KernelError> {
    let (m, k) = (19, 1000);
    let mut x = rng.bf16_vec(m * k, 4.0, 0.0);
    // A row of zeros (its scale is f32's epsilon) and values past e4m3's 448 under the static
    // scale.
    x[2 * k..3 * k].fill(bf16::ZERO);
    for i in (0..m * k).step_by(331) {
        x[i] = bf16::from_f32(-900.0);
    }
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let dx = upload(s, &x)?;
    let mut results = Vec::new();
    for (scheme, wrong) in [
        (RowQuant::Fp8Static(0.75), RowQuant::Fp8Static(0.8)),
        (RowQuant::Fp8Token, RowQuant::Fp8Static(0.75)),
    ] {
        let mut codes = upload(s, &vec![0u8; m * k])?;
        let mut scales = upload(s, &vec![f32::NAN; m])?;
        let scale = match scheme {
            RowQuant::Fp8Static(v) => Some(v),
            _ => None,
        };
        kernels.fp8_quantize_rows(s, &dx, &mut codes, &mut scales, m, k, scale)?;
        let (codes, scales) = (download(s, &codes)?, download(s, &scales)?);
        let got: Vec<f32> = codes
            .iter()
            .enumerate()
            .map(|(i, &c)| e4m3(c) * scales[i / k])
            .collect();
        let case = format!("{scheme:?} m={m} k={k}");
        results.push(invariance_result(
            "fp8_quantize_rows",
            format!("{case}: vs the CPU W8A8 reference"),
            false,
            value_mismatches(&got, &reference(scheme, &xf, k)),
        ));
        results.push(invariance_result(
            "fp8_quantize_rows",
            format!("{case}: vs the reference as {wrong:?} (canary)"),
            true,
            value_mismatches(&got, &reference(wrong, &xf, k)),
        ));
    }
    Ok(results)
}

fn check_fp8_gemm(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let (n, k) = (256, 1024);
    // Weight codes: random finite e4m3 (no NaN byte), a scale per row.
    let w: Vec<u8> = (0..n * k)
        .map(|_| {
            let b = rng.next_u64() as u8;
            if b & 0x7f == 0x7f { b & 0xfe } else { b }
        })
        .collect();
    let w_scale: Vec<f32> = (0..n).map(|_| (1e-3 + 1e-2 * rng.unit()) as f32).collect();
    let mut w_wrong = w_scale.clone();
    w_wrong[..n / 2].iter_mut().for_each(|v| *v *= 1.25);
    let (dw, dws, dws_wrong) = (upload(s, &w)?, upload(s, &w_scale)?, upload(s, &w_wrong)?);
    let mut gemm = crate::LtGemm::new(s)?;
    let mut results = Vec::new();
    let mut first_rows: Vec<Vec<bf16>> = Vec::new();
    let x = rng.bf16_vec(64 * k, 2.0, 0.0);
    for m in [1, 64] {
        let dx = upload(s, &x[..m * k])?;
        let mut codes = upload(s, &vec![0u8; m * k])?;
        let mut x_scale = upload(s, &vec![f32::NAN; m])?;
        kernels.fp8_quantize_rows(s, &dx, &mut codes, &mut x_scale, m, k, None)?;
        let mut acc = upload(s, &vec![f32::NAN; m * n])?;
        gemm.matmul_fp8(&mut acc, &codes, &dw, (m, n, k))?;
        let mut y = poisoned_bf16(s, m * n)?;
        kernels.fp8_scale_out(s, &acc, &x_scale, &dws, &mut y, m, n)?;
        let mut y_wrong = poisoned_bf16(s, m * n)?;
        kernels.fp8_scale_out(s, &acc, &x_scale, &dws_wrong, &mut y_wrong, m, n)?;
        let got = download(s, &y)?;
        let (codes, x_scale) = (download(s, &codes)?, download(s, &x_scale)?);
        let want: Vec<f64> = (0..m * n)
            .map(|i| {
                let (r, c) = (i / n, i % n);
                let dot: f64 = (0..k)
                    .map(|j| {
                        f64::from(e4m3(codes[r * k + j]) * x_scale[r])
                            * f64::from(e4m3(w[c * k + j]) * w_scale[c])
                    })
                    .sum();
                round_bf16(dot)
            })
            .collect();
        let got64: Vec<f64> = got.iter().map(|v| v.to_f64()).collect();
        let wrong64: Vec<f64> = download(s, &y_wrong)?.iter().map(|v| v.to_f64()).collect();
        let case = format!("m={m} n={n} k={k} per-token x, per-row w");
        let written = got64.iter().all(|v| !v.is_nan());
        results.push(CheckResult::compare(
            "gemm_fp8",
            format!("{case}: vs the f64 product of the dequantized operands"),
            false,
            rel_err(&got64, &want),
            1e-2,
            written,
            String::new(),
        ));
        results.push(CheckResult::compare(
            "gemm_fp8",
            format!("{case}: with changed weight scales (canary)"),
            true,
            rel_err(&wrong64, &want),
            1e-2,
            written,
            String::new(),
        ));
        first_rows.push(got[..n].to_vec());
    }
    results.push(invariance_result(
        "gemm_fp8",
        format!("n={n} k={k}: row 0 at m=1 vs at m=64, bit for bit"),
        false,
        first_rows[0]
            .iter()
            .zip(&first_rows[1])
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count(),
    ));
    Ok(results)
}

fn check_quantizer(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
    reference: RowQuantReference<'_>,
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
    let mismatches = |want: &[f32]| value_mismatches(&got, want);
    let case = format!("m={m} k={k} global={global}");
    Ok(vec![
        invariance_result(
            "nvfp4_quantize_rows",
            format!("{case}: vs the CPU W4A4 reference"),
            false,
            mismatches(&reference(RowQuant::Nvfp4(global), &xf, k)),
        ),
        invariance_result(
            "nvfp4_quantize_rows",
            format!("{case}: vs the reference under global x 1.5 (canary)"),
            true,
            mismatches(&reference(RowQuant::Nvfp4(global * 1.5), &xf, k)),
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
