//! Self-test checks of the run order (`cuda/runs.cu`): the tiled GEMM against the f64 reference,
//! and the property it exists for — every row of it bitwise the run-order GEMV's row, at any
//! number of rows on either side.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::selftest::{
    Rng, TOL_BF16, TOL_F32, compare_with_canary, download, poisoned_bf16, poisoned_f32, to_f64,
    upload,
};
use crate::selftest_gemv::{bit_mismatches, invariance_result, matmul_ref, rounded};
use crate::{CheckResult, GEMV_MAX_M, GemvVariant, KernelError, Kernels};

const RUN_VARIANTS: [GemvVariant; 2] = [GemvVariant::MmaRuns, GemvVariant::Mma2Runs];

/// [`Kernels::gemm_runs`] against the f64 reference (bf16 and f32 outputs, canary: the
/// reference with W's rows shifted), on shapes whose K leaves runs of odd length and empty runs
/// (1056 = 33 steps, 576 = 18) and whose M and N are not multiples of the block's 64 × 128.
pub(crate) fn check_gemm_runs(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let mut results = Vec::new();
    let shapes = [
        (1, 1030, 4096),
        (37, 515, 1056),
        (200, 1030, 4096),
        (70, 300, 576),
    ];
    for variant in RUN_VARIANTS {
        for (m, n, k) in shapes {
            let x = rng.bf16_vec(m * k, 1.0, 0.0);
            let w = rng.bf16_vec(n * k, 1.0, 0.0);
            let (dx, dw) = (upload(s, &x)?, upload(s, &w)?);
            let right = matmul_ref(&x, &w, (m, n, k), 0);
            let wrong = matmul_ref(&x, &w, (m, n, k), 1);
            let case = format!("{variant:?} m={m} n={n} k={k}");

            let mut y = poisoned_bf16(s, m * n)?;
            kernels.gemm_runs(variant, s, &mut y, &dx, &dw, (m, n, k))?;
            let y = to_f64(&download(s, &y)?);
            results.extend(compare_with_canary(
                "runs_gemm",
                format!("{case} bf16"),
                &y,
                &rounded(&right),
                &rounded(&wrong),
                TOL_BF16,
            ));

            let mut y = poisoned_f32(s, m * n)?;
            kernels.gemm_runs(variant, s, &mut y, &dx, &dw, (m, n, k))?;
            let y: Vec<f64> = download(s, &y)?.iter().map(|&v| v as f64).collect();
            results.extend(compare_with_canary(
                "runs_gemm_f32",
                format!("{case} f32"),
                &y,
                &right,
                &wrong,
                TOL_F32,
            ));
        }
    }
    Ok(results)
}

/// The run order's batch invariance across its two kernels, f32 outputs compared bit for bit:
/// a 320-row GEMM (a serving step's decode and prompt rows) against the same rows through the
/// GEMV in launches of 64, of 1, and of 37 from an offset, and against GEMM launches of 1 and of
/// 100 from an offset; the bf16 output of the GEMM against the GEMV's for 64 rows. Canaries: the
/// strided-phase GEMV of the same phase count (other bits, same mathematics), and row 0 against
/// row 1.
pub(crate) fn check_runs_invariance(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let mut results = Vec::new();
    // k = 4096: 128 steps, runs of 8 (16 phases) or 32 (4); k = 1056: 33 steps, runs of 3 with
    // five empty ones (16) or of 9 with a short last one (4).
    for (variant, k) in RUN_VARIANTS
        .into_iter()
        .flat_map(|v| [(v, 4096), (v, 1056)])
    {
        let (n, big) = (1030, 320);
        let x = rng.bf16_vec(big * k, 1.0, 0.0);
        let w = rng.bf16_vec(n * k, 1.0, 0.0);
        let (dx, dw) = (upload(s, &x)?, upload(s, &w)?);
        let case = format!("{variant:?} n={n} k={k}");
        let rows = |first: usize, m: usize| dx.slice(first * k..(first + m) * k);
        let gemm = |first: usize, m: usize| -> Result<Vec<f32>, KernelError> {
            let mut y = poisoned_f32(s, m * n)?;
            kernels.gemm_runs(variant, s, &mut y, &rows(first, m), &dw, (m, n, k))?;
            download(s, &y)
        };
        let gemv = |v: GemvVariant, first: usize, m: usize| -> Result<Vec<f32>, KernelError> {
            let mut y = poisoned_f32(s, m * n)?;
            kernels.gemv_with(v, s, &mut y, &rows(first, m), &dw, (m, n, k))?;
            download(s, &y)
        };
        let full = gemm(0, big)?;
        let mut by_64 = Vec::new();
        for first in (0..big).step_by(GEMV_MAX_M) {
            by_64.extend(gemv(variant, first, GEMV_MAX_M.min(big - first))?);
        }
        results.push(invariance_result(
            "runs_gemm_f32",
            format!("{case} M={big} vs the GEMV in launches of {GEMV_MAX_M}"),
            false,
            bit_mismatches(&full, &by_64),
        ));
        let mut ones = Vec::new();
        for m in 0..GEMV_MAX_M {
            ones.extend(gemv(variant, m, 1)?);
        }
        results.push(invariance_result(
            "runs_gemm_f32",
            format!("{case} M={big} rows 0..{GEMV_MAX_M} vs GEMV M=1 rows"),
            false,
            bit_mismatches(&full[..GEMV_MAX_M * n], &ones),
        ));
        let first = 101;
        results.push(invariance_result(
            "runs_gemm_f32",
            format!("{case} M={big} vs GEMV M=37 rows {first}.."),
            false,
            bit_mismatches(
                &full[first * n..(first + 37) * n],
                &gemv(variant, first, 37)?,
            ),
        ));
        let first = 7;
        results.push(invariance_result(
            "runs_gemm_f32",
            format!("{case} M={big} vs GEMM M=100 rows {first}.."),
            false,
            bit_mismatches(&full[first * n..(first + 100) * n], &gemm(first, 100)?),
        ));
        results.push(invariance_result(
            "runs_gemm_f32",
            format!("{case} M={big} row 250 vs GEMM M=1"),
            false,
            bit_mismatches(&full[250 * n..251 * n], &gemm(250, 1)?),
        ));
        let strided = match variant {
            GemvVariant::MmaRuns => GemvVariant::Mma,
            _ => GemvVariant::Mma2,
        };
        results.push(invariance_result(
            "runs_gemm_f32",
            format!("{case} M={big} rows 0..{GEMV_MAX_M} vs the strided {strided:?} GEMV"),
            true,
            bit_mismatches(&full[..GEMV_MAX_M * n], &gemv(strided, 0, GEMV_MAX_M)?),
        ));
        results.push(invariance_result(
            "runs_gemm_f32",
            format!("{case} M={big} row 0 vs row 1"),
            true,
            bit_mismatches(&full[..n], &full[n..2 * n]),
        ));

        // bf16 outputs: the GEMM's first 64 rows against one GEMV launch of them.
        let m = GEMV_MAX_M;
        let mut a = poisoned_bf16(s, m * n)?;
        kernels.gemm_runs(variant, s, &mut a, &rows(0, m), &dw, (m, n, k))?;
        let mut b = poisoned_bf16(s, m * n)?;
        kernels.gemv_with(variant, s, &mut b, &rows(0, m), &dw, (m, n, k))?;
        let (a, b) = (download(s, &a)?, download(s, &b)?);
        let differ = a
            .iter()
            .zip(&b)
            .filter(|(p, q)| p.to_bits() != q.to_bits() || p.is_nan())
            .count();
        results.push(invariance_result(
            "runs_gemm",
            format!("{case} M={m} bf16 vs the GEMV"),
            false,
            differ,
        ));
    }
    Ok(results)
}
