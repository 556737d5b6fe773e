//! Self-test checks of the matrix kernels (gemv, cuBLASLt GEMM) and greedy argmax, including the
//! bitwise batch-invariance checks: row `m` must not depend on how many rows ran with it.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use half::bf16;

use crate::gemm::{GemmOut, LtGemm};
use crate::selftest::{
    Rng, TOL_BF16, TOL_F32, compare_with_canary, download, poisoned_bf16, poisoned_f32, round_bf16,
    to_f64, upload,
};
use crate::{CheckResult, GEMV_FMA_MAX_M, GEMV_MAX_M, GemvVariant, KernelError, Kernels, NO_TOKEN};

const VARIANTS: [GemvVariant; 5] = [
    GemvVariant::Fma,
    GemvVariant::Mma,
    GemvVariant::Mma2,
    GemvVariant::MmaRuns,
    GemvVariant::Mma2Runs,
];

/// `y[m, n] = Σ_k x[m, k] · w[(n + shift) % rows, k]` in f64 (`shift` 1 is the canary).
pub(crate) fn matmul_ref(
    x: &[bf16],
    w: &[bf16],
    (m, n, k): (usize, usize, usize),
    shift: usize,
) -> Vec<f64> {
    let (xf, wf) = (to_f64(x), to_f64(w));
    let mut y = vec![0.0; m * n];
    for (i, row) in xf.chunks(k).take(m).enumerate() {
        for j in 0..n {
            let wr = &wf[((j + shift) % n) * k..][..k];
            y[i * n + j] = row.iter().zip(wr).map(|(a, b)| a * b).sum();
        }
    }
    y
}

/// Each value rounded to bf16, as a bf16 output holds it.
pub(crate) fn rounded(v: &[f64]) -> Vec<f64> {
    v.iter().map(|&x| round_bf16(x)).collect()
}

pub(crate) fn check_gemv(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let mut results = Vec::new();
    let shapes = [
        (1, 1030, 4096),
        (3, 1030, 4096),
        (8, 515, 1056),
        (16, 1030, 4096),
        (17, 515, 1056),
        (40, 515, 1056),
        (64, 1030, 4096),
    ];
    for (variant, (m, n, k)) in VARIANTS
        .into_iter()
        .flat_map(|v| shapes.map(|shape| (v, shape)))
        .filter(|&(v, (m, _, _))| m <= max_rows(v))
    {
        let x = rng.bf16_vec(m * k, 1.0, 0.0);
        let w = rng.bf16_vec(n * k, 1.0, 0.0);
        let (dx, dw) = (upload(s, &x)?, upload(s, &w)?);
        let (right, wrong) = (
            matmul_ref(&x, &w, (m, n, k), 0),
            matmul_ref(&x, &w, (m, n, k), 1),
        );
        let case = format!("{variant:?} m={m} n={n} k={k}");

        let mut y = poisoned_bf16(s, m * n)?;
        kernels.gemv_with(variant, s, &mut y, &dx, &dw, (m, n, k))?;
        let y = to_f64(&download(s, &y)?);
        results.extend(compare_with_canary(
            "gemv",
            format!("{case} bf16"),
            &y,
            &rounded(&right),
            &rounded(&wrong),
            TOL_BF16,
        ));

        let mut y = poisoned_f32(s, m * n)?;
        kernels.gemv_with(variant, s, &mut y, &dx, &dw, (m, n, k))?;
        let y: Vec<f64> = download(s, &y)?.iter().map(|&v| v as f64).collect();
        results.extend(compare_with_canary(
            "gemv_f32",
            format!("{case} f32"),
            &y,
            &right,
            &wrong,
            TOL_F32,
        ));
    }
    Ok(results)
}

/// Positions where `a` and `b` differ bitwise (NaN counts as different).
pub(crate) fn bit_mismatches(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits() || x.is_nan())
        .count()
}

/// The result of comparing rows against the same rows of a wider launch, bit for bit.
pub(crate) fn invariance_result(
    kernel: &str,
    case: String,
    canary: bool,
    mismatches: usize,
) -> CheckResult {
    CheckResult::compare(
        kernel,
        case,
        canary,
        mismatches as f64,
        0.0,
        true,
        format!("{mismatches} elements differ bitwise"),
    )
}

/// The most rows one launch of `variant` takes.
fn max_rows(variant: GemvVariant) -> usize {
    match variant {
        GemvVariant::Fma => GEMV_FMA_MAX_M,
        _ => GEMV_MAX_M,
    }
}

/// Row `m` of M=1 launches and of narrower launches (M=8, and for the MMA variant M=16, 33 and
/// 48, each a different tile count) equals row `m` of the widest launch (M=16 FMA, M=64 MMA),
/// bitwise, for the f32 and the bf16 output. The canary perturbs one x element by one bf16 ulp
/// per row.
pub(crate) fn check_gemv_invariance(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let mut results = Vec::new();
    for variant in VARIANTS {
        results.extend(gemv_invariance(kernels, s, rng, variant)?);
    }
    Ok(results)
}

fn gemv_invariance(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
    variant: GemvVariant,
) -> Result<Vec<CheckResult>, KernelError> {
    let (n, k) = (1030, 4096);
    let wide = max_rows(variant);
    let x = rng.bf16_vec(wide * k, 1.0, 0.0);
    let w = rng.bf16_vec(n * k, 1.0, 0.0);
    let (dx, dw) = (upload(s, &x)?, upload(s, &w)?);
    let mut perturbed = x.clone();
    for m in 0..wide {
        let e = &mut perturbed[m * k + rng.below(k)];
        *e = bf16::from_bits(e.to_bits() ^ 1);
    }
    let dp = upload(s, &perturbed)?;

    // f32 outputs: row-by-row M=1 and the narrower launches against the widest.
    let launch = |x: &cudarc::driver::CudaSlice<bf16>, first: usize, m: usize| {
        let mut y = poisoned_f32(s, m * n)?;
        let input = x.slice(first * k..(first + m) * k);
        kernels.gemv_with(variant, s, &mut y, &input, &dw, (m, n, k))?;
        download(s, &y)
    };
    let full = launch(&dx, 0, wide)?;
    let (mut ones, mut ones_canary) = (Vec::new(), Vec::new());
    for m in 0..wide {
        ones.extend(launch(&dx, m, 1)?);
        ones_canary.extend(launch(&dp, m, 1)?);
    }
    let mut results = vec![
        invariance_result(
            "gemv_f32",
            format!("{variant:?} n={n} k={k} M=1 rows vs M={wide}"),
            false,
            bit_mismatches(&ones, &full),
        ),
        invariance_result(
            "gemv_f32",
            format!("{variant:?} n={n} k={k} M=1 rows (x perturbed) vs M={wide}"),
            true,
            bit_mismatches(&ones_canary, &full),
        ),
    ];
    for narrow in [8, 16, 33, 48].into_iter().filter(|&m| m < wide) {
        // Rows from an offset, so a row sits at another place of its tile than in the wide launch.
        let first = (wide - narrow).min(5);
        let got = launch(&dx, first, narrow)?;
        results.push(invariance_result(
            "gemv_f32",
            format!("{variant:?} n={n} k={k} M={narrow} rows {first}.. vs M={wide}"),
            false,
            bit_mismatches(&got, &full[first * n..(first + narrow) * n]),
        ));
    }

    // bf16 outputs: M=1 rows against the widest launch.
    let mut y16 = poisoned_bf16(s, wide * n)?;
    kernels.gemv_with(variant, s, &mut y16, &dx, &dw, (wide, n, k))?;
    let y16 = download(s, &y16)?;
    let mut mismatches = 0;
    for m in 0..wide {
        let mut y1 = poisoned_bf16(s, n)?;
        kernels.gemv_with(
            variant,
            s,
            &mut y1,
            &dx.slice(m * k..(m + 1) * k),
            &dw,
            (1, n, k),
        )?;
        let y1 = download(s, &y1)?;
        mismatches += y1
            .iter()
            .zip(&y16[m * n..][..n])
            .filter(|(a, b)| a.to_bits() != b.to_bits() || a.is_nan())
            .count();
    }
    results.push(invariance_result(
        "gemv",
        format!("{variant:?} n={n} k={k} M=1 rows vs M={wide} (bf16)"),
        false,
        mismatches,
    ));
    Ok(results)
}

/// The fused q/k/v launch ([`Kernels::gemv3`]) equals three single launches bitwise, for a
/// GQA-like shape with narrow k and v; the canary compares against the launches with w1 and w2
/// swapped.
pub(crate) fn check_gemv3(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let k = 1024;
    let ns = [1024, 264, 264];
    let mut results = Vec::new();
    for m in [1, 5, 16, 40, 64] {
        let x = upload(s, &rng.bf16_vec(m * k, 1.0, 0.0))?;
        let ws = ns
            .iter()
            .map(|&n| upload(s, &rng.bf16_vec(n * k, 1.0, 0.0)))
            .collect::<Result<Vec<_>, _>>()?;
        let mut fused = Vec::new();
        for &n in &ns {
            fused.push(poisoned_bf16(s, m * n)?);
        }
        {
            let [a, b, c] = &mut fused[..] else {
                unreachable!("three outputs")
            };
            kernels.gemv3(
                s,
                [
                    &mut a.as_view_mut(),
                    &mut b.as_view_mut(),
                    &mut c.as_view_mut(),
                ],
                &x,
                [&ws[0].as_view(), &ws[1].as_view(), &ws[2].as_view()],
                m,
                ns,
                k,
            )?;
        }
        let mut single = Vec::new();
        let mut swapped = Vec::new();
        for (i, &n) in ns.iter().enumerate() {
            let mut y = poisoned_bf16(s, m * n)?;
            kernels.gemv(s, &mut y, &x, &ws[i], m, n, k)?;
            single.extend(download(s, &y)?);
            // w1 and w2 have the same shape: the canary reads the other one.
            let other = [0, 2, 1][i];
            let mut y = poisoned_bf16(s, m * n)?;
            kernels.gemv(s, &mut y, &x, &ws[other], m, n, k)?;
            swapped.extend(download(s, &y)?);
        }
        let mut got = Vec::new();
        for y in &fused {
            got.extend(download(s, y)?);
        }
        let differ = |a: &[bf16], b: &[bf16]| {
            a.iter()
                .zip(b)
                .filter(|(x, y)| x.to_bits() != y.to_bits() || x.is_nan())
                .count()
        };
        let case = format!("m={m} n={ns:?} k={k}");
        results.push(invariance_result(
            "gemv3",
            format!("{case} vs three gemv launches"),
            false,
            differ(&got, &single),
        ));
        results.push(invariance_result(
            "gemv3",
            format!("{case} vs launches with w1, w2 swapped"),
            true,
            differ(&got, &swapped),
        ));
    }
    Ok(results)
}

/// The reference argmax, the CPU sampler's greedy order: NaN ranks as -inf and never wins, +inf
/// ranks as `f32::MAX`, lowest index on ties (`highest_on_ties` is the canary).
fn argmax_ref(row: &[f32], highest_on_ties: bool) -> u32 {
    let mut best: Option<(f32, usize)> = None;
    for (i, &raw) in row.iter().enumerate() {
        let v = if raw == f32::INFINITY { f32::MAX } else { raw };
        if v.is_nan() || v == f32::NEG_INFINITY {
            continue;
        }
        best = match best {
            Some((b, _)) if v > b || (highest_on_ties && v == b) => Some((v, i)),
            Some(kept) => Some(kept),
            None => Some((v, i)),
        };
    }
    best.map_or(NO_TOKEN, |(_, i)| i as u32)
}

pub(crate) fn check_argmax(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let mut results = Vec::new();
    // offset 1 makes the rows 4-byte but not 16-byte aligned: the scalar path. A stride above
    // the vocabulary is the padded layout of the LM head's logits: the pad must never win.
    for (rows, vocab, stride, offset) in [
        (7, 151_936, 151_936, 0),
        (6, 1001, 1001, 1),
        (6, 1001, 1008, 0),
    ] {
        let mut logits: Vec<f32> = (0..rows * stride + offset)
            .map(|_| (rng.unit() * 20.0 - 10.0) as f32)
            .collect();
        let row = |r: usize| offset + r * stride;
        // Row 0: a tie for the maximum; row 1: NaNs, one at the front; row 2: all NaN;
        // row 3: a tie of large values near the end; row 4: +inf ties with f32::MAX (the lower
        // index wins); row 5: -inf and NaN only, but for one value at the end.
        let (i, j) = (rng.below(vocab / 2), vocab / 2 + rng.below(vocab / 2));
        logits[row(0) + i] = 50.0;
        logits[row(0) + j] = 50.0;
        logits[row(1)] = f32::NAN;
        logits[row(1) + rng.below(vocab)] = f32::NAN;
        logits[row(1) + vocab - 1] = 60.0;
        logits[row(2)..row(2) + vocab].fill(f32::NAN);
        logits[row(3) + vocab - 2] = 70.0;
        logits[row(3) + vocab - 1] = 70.0;
        logits[row(4) + j] = f32::MAX;
        logits[row(4) + i] = f32::INFINITY;
        logits[row(4) + vocab - 1] = f32::INFINITY;
        logits[row(5)..row(5) + vocab].fill(f32::NEG_INFINITY);
        logits[row(5) + 1] = f32::NAN;
        logits[row(5) + vocab - 1] = -1e30;
        for r in 0..rows {
            // The pad columns hold the largest value of the row: read, they would win.
            logits[row(r) + vocab..row(r) + stride].fill(1e9);
        }
        let d_logits = upload(s, &logits)?;
        let mut out = upload(s, &vec![0xdead_beefu32; rows])?;
        let view = d_logits.slice(offset..);
        kernels.argmax(s, &mut out, &view, rows, vocab, stride)?;
        let out = download(s, &out)?;
        let expect = |ties: bool| -> Vec<u32> {
            (0..rows)
                .map(|r| argmax_ref(&logits[row(r)..][..vocab], ties))
                .collect()
        };
        let count = |reference: &[u32]| out.iter().zip(reference).filter(|(a, b)| a != b).count();
        let written = out.iter().all(|&v| v != 0xdead_beef);
        let case = format!("rows={rows} vocab={vocab} stride={stride} offset={offset}");
        let detail = format!("got {out:?}, expected {:?}", expect(false));
        results.push(CheckResult::compare(
            "argmax",
            case.clone(),
            false,
            count(&expect(false)) as f64,
            0.0,
            written,
            detail,
        ));
        results.push(CheckResult::compare(
            "argmax",
            case,
            true,
            count(&expect(true)) as f64,
            0.0,
            written,
            "against highest-index-on-ties".to_string(),
        ));
    }
    Ok(results)
}

/// cuBLASLt GEMM against the f64 reference, and its batch invariance: the rows of M=1 and M=37
/// launches equal the same rows of an M=256 launch bitwise.
pub(crate) fn check_gemm(
    _kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let mut gemm = LtGemm::new(s)?;
    let (n, k, big) = (1024, 4096, 256);
    let x = rng.bf16_vec(big * k, 1.0, 0.0);
    let w = rng.bf16_vec(n * k, 1.0, 0.0);
    let (dx, dw) = (upload(s, &x)?, upload(s, &w)?);
    let mut results = Vec::new();
    let m = 37;
    let (right, wrong) = (
        matmul_ref(&x, &w, (m, n, k), 0),
        matmul_ref(&x, &w, (m, n, k), 1),
    );

    let mut y = poisoned_bf16(s, m * n)?;
    gemm.matmul(&mut y, &dx.slice(..m * k), &dw, m, n, k, GemmOut::Bf16)?;
    let y = to_f64(&download(s, &y)?);
    let case = format!("m={m} n={n} k={k}");
    results.extend(compare_with_canary(
        "gemm",
        format!("{case} bf16"),
        &y,
        &rounded(&right),
        &rounded(&wrong),
        TOL_BF16,
    ));

    let mut launch = |rows: usize| -> Result<Vec<f32>, KernelError> {
        let mut y = poisoned_f32(s, rows * n)?;
        gemm.matmul(&mut y, &dx.slice(..rows * k), &dw, rows, n, k, GemmOut::F32)?;
        download(s, &y)
    };
    let y37 = launch(m)?;
    let y37f: Vec<f64> = y37.iter().map(|&v| v as f64).collect();
    results.extend(compare_with_canary(
        "gemm_f32",
        format!("{case} f32"),
        &y37f,
        &right,
        &wrong,
        TOL_F32,
    ));
    let y256 = launch(big)?;
    let y1 = launch(1)?;
    results.push(invariance_result(
        "gemm_f32",
        format!("n={n} k={k} M=37 rows vs M={big}"),
        false,
        bit_mismatches(&y37, &y256[..m * n]),
    ));
    results.push(invariance_result(
        "gemm_f32",
        format!("n={n} k={k} M=1 row vs M={big}"),
        false,
        bit_mismatches(&y1, &y256[..n]),
    ));
    // Canary: a different row of the wide launch must not match.
    results.push(invariance_result(
        "gemm_f32",
        format!("n={n} k={k} row 0 vs row 1 of M={big}"),
        true,
        bit_mismatches(&y1, &y256[n..2 * n]),
    ));
    if let Some(algo) = gemm.describe(n, k, GemmOut::F32)
        && let Some(last) = results.last_mut()
    {
        last.detail = format!("{}; pinned {algo}", last.detail);
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_reference_skips_nan_and_takes_the_lowest_tie() {
        assert_eq!(argmax_ref(&[1.0, 3.0, f32::NAN, 3.0], false), 1);
        assert_eq!(argmax_ref(&[1.0, 3.0, f32::NAN, 3.0], true), 3);
        assert_eq!(argmax_ref(&[f32::NAN, f32::NAN], false), NO_TOKEN);
        assert_eq!(argmax_ref(&[f32::NEG_INFINITY, f32::NAN], false), NO_TOKEN);
        assert_eq!(argmax_ref(&[f32::MAX, f32::INFINITY], false), 0);
    }

    #[test]
    fn matmul_reference_is_x_times_w_transposed() {
        let b = |v: &[f64]| v.iter().map(|&x| bf16::from_f64(x)).collect::<Vec<_>>();
        let x = b(&[1.0, 2.0]);
        let w = b(&[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        assert_eq!(matmul_ref(&x, &w, (1, 3, 2), 0), vec![1.0, 2.0, 3.0]);
        assert_eq!(matmul_ref(&x, &w, (1, 3, 2), 1), vec![2.0, 3.0, 1.0]);
    }
}
