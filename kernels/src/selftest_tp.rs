//! Self-test checks of the tensor-parallel pieces (DESIGN.md §5): a rank's slice of a weight
//! must give bitwise what the whole weight gives for the same outputs.
//!
//! - the shard GEMV: the partials of a rank's K-slice (its own contiguous copy, rows `K / 2`
//!   apart) equal the same shards of a launch over the whole K, and each partial is the matmul of
//!   its slice;
//! - the GEMM on a K-slice (`ld > k`) and on a column slice (`algo_n > n`) equals the GEMM of a
//!   contiguous copy / the whole weight;
//! - the shard sum adds every shard in shard order and rounds once (the host's f32 sum, bit for
//!   bit);
//! - the vocabulary-shard embedding writes `-0.0` rows for foreign ids.
//!
//! Every bitwise check has a canary that compares against a different slice and must fail.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

use crate::GemvVariant::{Mma, Mma2};
use crate::gemm::{GemmOut, GemmShape, LtGemm};
use crate::selftest::{
    Rng, TOL_F32, compare_with_canary, download, poisoned_bf16, poisoned_f32, upload,
};
use crate::selftest_gemv::{bit_mismatches, invariance_result, matmul_ref};
use crate::{CheckResult, KernelError, Kernels};

const SHARDS: usize = 8;

/// Columns `cols` of every row of a row-major `[rows, width]` matrix, as a contiguous copy.
fn columns(m: &[bf16], width: usize, cols: std::ops::Range<usize>) -> Vec<bf16> {
    m.chunks(width)
        .flat_map(|row| row[cols.clone()].iter().copied())
        .collect()
}

fn bf16_mismatches(a: &[bf16], b: &[bf16]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits() || x.is_nan())
        .count()
}

pub(crate) fn check_gemv_shards(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let mut results = Vec::new();
    let (n, kslice) = (264, 128);
    let k = SHARDS * kslice;
    for (variant, m) in [(Mma, 1), (Mma, 40), (Mma2, 1), (Mma2, 40)] {
        let x = rng.bf16_vec(m * k, 1.0, 0.0);
        let w = rng.bf16_vec(n * k, 1.0, 0.0);
        let (dx, dw) = (upload(s, &x)?, upload(s, &w)?);
        let stride = m * n;
        let mut whole = poisoned_f32(s, SHARDS * stride)?;
        let layout = (SHARDS, kslice, k);
        kernels.gemv_shards(variant, s, &mut whole, &dx, &dw, (m, n), layout, stride)?;
        let whole = download(s, &whole)?;
        let case = format!("m={m} n={n} {SHARDS}x{kslice} {variant:?}");

        if m > 1 {
            // Batch invariance: x's first row alone gives row 0 of every shard bit for bit
            // (the canary compares with row 1).
            let mut alone = poisoned_f32(s, SHARDS * n)?;
            let first = dx.slice(..k);
            kernels.gemv_shards(variant, s, &mut alone, &first, &dw, (1, n), layout, n)?;
            let alone = download(s, &alone)?;
            let row = |r: usize| -> Vec<f32> {
                (0..SHARDS)
                    .flat_map(|sh| whole[sh * stride + r * n..][..n].iter().copied())
                    .collect()
            };
            for (r, canary) in [(0, false), (1, true)] {
                results.push(invariance_result(
                    "gemv_shards",
                    format!("{case}: row {r} vs x's first row alone"),
                    canary,
                    bit_mismatches(&alone, &row(r)),
                ));
            }
        }

        // Each partial is its slice's matmul (the canary reads the next row of w).
        for shard in [0, SHARDS - 1] {
            let cols = shard * kslice..(shard + 1) * kslice;
            let (xs, ws) = (columns(&x, k, cols.clone()), columns(&w, k, cols));
            let got: Vec<f64> = whole[shard * stride..][..stride]
                .iter()
                .map(|&v| v as f64)
                .collect();
            results.extend(compare_with_canary(
                "gemv_shards",
                format!("{case} shard {shard}"),
                &got,
                &matmul_ref(&xs, &ws, (m, n, kslice), 0),
                &matmul_ref(&xs, &ws, (m, n, kslice), 1),
                TOL_F32,
            ));
        }

        // Rank 1 of 2: its own copy of the second half of K, four shards.
        let half = k / 2;
        let xr = upload(s, &columns(&x, k, half..k))?;
        let wr = upload(s, &columns(&w, k, half..k))?;
        let mut rank = poisoned_f32(s, SHARDS / 2 * stride)?;
        kernels.gemv_shards(
            variant,
            s,
            &mut rank,
            &xr,
            &wr,
            (m, n),
            (SHARDS / 2, kslice, half),
            stride,
        )?;
        let rank = download(s, &rank)?;
        results.push(invariance_result(
            "gemv_shards",
            format!("{case}: rank 1 of 2 vs shards 4..8 of the whole"),
            false,
            bit_mismatches(&rank, &whole[SHARDS / 2 * stride..]),
        ));
        results.push(invariance_result(
            "gemv_shards",
            format!("{case}: rank 1 of 2 vs shards 0..4 (canary)"),
            true,
            bit_mismatches(&rank, &whole[..SHARDS / 2 * stride]),
        ));

        // The shard sum: the host's f32 sum in shard order, rounded once.
        let partials = upload(s, &whole)?;
        let mut sum = poisoned_bf16(s, stride)?;
        kernels.sum_shards(s, &mut sum, &partials, SHARDS, stride, stride)?;
        let sum = download(s, &sum)?;
        let host = |order: &mut dyn Iterator<Item = usize>| -> Vec<bf16> {
            let order: Vec<usize> = order.collect();
            (0..stride)
                .map(|i| {
                    let mut acc = whole[order[0] * stride + i];
                    for &sh in &order[1..] {
                        acc += whole[sh * stride + i];
                    }
                    bf16::from_f32(acc)
                })
                .collect()
        };
        results.push(invariance_result(
            "sum_shards",
            format!("{case}: vs the host sum in shard order"),
            false,
            bf16_mismatches(&sum, &host(&mut (0..SHARDS))),
        ));
        // Reversing the order changes too few bf16 results to be a dependable canary; a shard
        // left out (the bug the canary of `strata gpu tp` injects) changes most.
        results.push(invariance_result(
            "sum_shards",
            format!("{case}: vs the host sum without the last shard (canary)"),
            true,
            bf16_mismatches(&sum, &host(&mut (0..SHARDS - 1))),
        ));
    }
    Ok(results)
}

/// The split q/k/v launch ([`Kernels::gemv3_split`]): each projection's slices equal the
/// four-phase shard GEMV of that projection alone, bit for bit (the canary swaps k and v), and
/// [`Kernels::sum_split3`] equals [`Kernels::sum_shards`] of each part.
pub(crate) fn check_gemv3_split(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    const SLICES: usize = 4;
    let (kslice, ns) = (256, [520, 136, 136]);
    let k = SLICES * kslice;
    let n_all: usize = ns.iter().sum();
    let mut results = Vec::new();
    for m in [1, 17, 64] {
        let x = upload(s, &rng.bf16_vec(m * k, 1.0, 0.0))?;
        let ws = ns
            .iter()
            .map(|&n| upload(s, &rng.bf16_vec(n * k, 1.0, 0.0)))
            .collect::<Result<Vec<_>, _>>()?;
        let stride = m * n_all;
        let mut split = poisoned_f32(s, SLICES * stride)?;
        let views = [&ws[0].as_view(), &ws[1].as_view(), &ws[2].as_view()];
        let layout = (SLICES, kslice);
        kernels.gemv3_split(s, &mut split, &x, views, (m, ns), layout, stride)?;
        let split = download(s, &split)?;
        let case = format!("m={m} n={ns:?} {SLICES}x{kslice}");
        let mut single = vec![Vec::new(); 2];
        let mut at = 0;
        for (i, &n) in ns.iter().enumerate() {
            // w1 and w2 have the same shape: the canary reads the other one.
            for (j, w) in [i, [0, 2, 1][i]].into_iter().enumerate() {
                let mut y = poisoned_f32(s, SLICES * m * n)?;
                let shape = ((m, n), (SLICES, kslice, k), m * n);
                kernels.gemv_shards(Mma2, s, &mut y, &x, &ws[w], shape.0, shape.1, shape.2)?;
                let y = download(s, &y)?;
                // Into the split layout: slice-major, the three parts side by side.
                single[j].resize(SLICES * stride, 0.0);
                for sl in 0..SLICES {
                    single[j][sl * stride + at..][..m * n]
                        .copy_from_slice(&y[sl * m * n..][..m * n]);
                }
            }
            at += m * n;
        }
        for (j, canary) in [(0, false), (1, true)] {
            results.push(invariance_result(
                "gemv3_split",
                format!(
                    "{case} vs Mma2 shard launches{}",
                    ["", " with w1, w2 swapped"][j]
                ),
                canary,
                bit_mismatches(&split, &single[j]),
            ));
        }

        let partials = upload(s, &split)?;
        let mut outs = Vec::new();
        for &n in &ns {
            outs.push(poisoned_bf16(s, m * n)?);
        }
        {
            let [a, b, c] = &mut outs[..] else {
                unreachable!("three outputs")
            };
            let targets = [
                &mut a.as_view_mut(),
                &mut b.as_view_mut(),
                &mut c.as_view_mut(),
            ];
            kernels.sum_split3(s, targets, &partials, SLICES, stride, ns.map(|n| m * n))?;
        }
        let mut got = Vec::new();
        for o in &outs {
            got.extend(download(s, o)?);
        }
        let mut want = poisoned_bf16(s, m * n_all)?;
        kernels.sum_shards(s, &mut want, &partials, SLICES, stride, m * n_all)?;
        let mut short = poisoned_bf16(s, m * n_all)?;
        kernels.sum_shards(s, &mut short, &partials, SLICES - 1, stride, m * n_all)?;
        let (want, short) = (download(s, &want)?, download(s, &short)?);
        for (reference, canary, what) in [
            (&want, false, ""),
            (&short, true, " without the last slice"),
        ] {
            results.push(invariance_result(
                "sum_split3",
                format!("{case} vs sum_shards{what}"),
                canary,
                bf16_mismatches(&got, reference),
            ));
        }
    }
    Ok(results)
}

pub(crate) fn check_gemm_slices(
    _kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let mut gemm = LtGemm::new(s)?;
    let mut results = Vec::new();
    let (m, n, kslice) = (96, 512, 256);
    let k = SHARDS * kslice;
    let x = rng.bf16_vec(m * k, 1.0, 0.0);
    let w = rng.bf16_vec(n * k, 1.0, 0.0);
    let (dx, dw) = (upload(s, &x)?, upload(s, &w)?);

    // K-slices: shard 5 of the whole (ld = K) vs rank 1 of 2's copy (ld = K / 2, its shard 1).
    let half = k / 2;
    let (xr, wr) = (
        upload(s, &columns(&x, k, half..k))?,
        upload(s, &columns(&w, k, half..k))?,
    );
    let shard = |gemm: &mut LtGemm, x: &CudaSlice<bf16>, w: &CudaSlice<bf16>, ld, at: usize| {
        let mut y = poisoned_f32(s, m * n)?;
        let shape = GemmShape {
            n,
            k: kslice,
            ld,
            out: GemmOut::F32,
            algo_n: n,
        };
        gemm.matmul_shape(&mut y, &x.slice(at..), &w.slice(at..), m, shape)?;
        download(s, &y)
    };
    let whole5 = shard(&mut gemm, &dx, &dw, k, 5 * kslice)?;
    let whole4 = shard(&mut gemm, &dx, &dw, k, 4 * kslice)?;
    let rank1 = shard(&mut gemm, &xr, &wr, half, kslice)?;
    let case = format!("m={m} n={n} {SHARDS}x{kslice}");
    results.push(invariance_result(
        "gemm",
        format!("{case}: K-slice of rank 1 of 2 vs shard 5 of the whole"),
        false,
        bit_mismatches(&rank1, &whole5),
    ));
    results.push(invariance_result(
        "gemm",
        format!("{case}: K-slice of rank 1 of 2 vs shard 4 (canary)"),
        true,
        bit_mismatches(&rank1, &whole4),
    ));

    // Column slices: the second half of w's rows, pinned as the whole weight, vs the whole.
    let mut full = poisoned_f32(s, m * n)?;
    gemm.matmul(&mut full, &dx, &dw, m, n, k, GemmOut::F32)?;
    let full = download(s, &full)?;
    let upper = upload(s, &w[n / 2 * k..])?;
    let mut part = poisoned_f32(s, m * n / 2)?;
    let shape = GemmShape {
        n: n / 2,
        k,
        ld: k,
        out: GemmOut::F32,
        algo_n: n,
    };
    gemm.matmul_shape(&mut part, &dx, &upper, m, shape)?;
    let part = download(s, &part)?;
    let columns_of = |from: usize| -> Vec<f32> {
        full.chunks(n)
            .flat_map(|row| row[from..from + n / 2].iter().copied())
            .collect()
    };
    results.push(invariance_result(
        "gemm",
        format!("m={m} n={n} k={k}: rows n/2.. of w vs those columns of the whole"),
        false,
        bit_mismatches(&part, &columns_of(n / 2)),
    ));
    results.push(invariance_result(
        "gemm",
        format!("m={m} n={n} k={k}: rows n/2.. of w vs columns ..n/2 (canary)"),
        true,
        bit_mismatches(&part, &columns_of(0)),
    ));
    Ok(results)
}

pub(crate) fn check_embed_rows(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let (vocab, hidden) = (100, 64);
    let rows = 40..80;
    let table = rng.bf16_vec(rows.len() * hidden, 1.0, 0.0);
    let ids: Vec<u32> = vec![0, 39, 40, 41, 79, 80, 99, 1000, 60];
    let (dt, di) = (upload(s, &table)?, upload(s, &ids)?);
    let mut out = poisoned_bf16(s, ids.len() * hidden)?;
    let neg = bf16::from_bits(0x8000);
    kernels.embed_rows(s, &mut out, &dt, &di, ids.len(), hidden, rows.clone(), neg)?;
    let out = download(s, &out)?;
    let expect = |fill: bf16| -> Vec<bf16> {
        ids.iter()
            .flat_map(|&id| {
                let id = id as usize;
                if rows.contains(&id) {
                    table[(id - rows.start) * hidden..][..hidden].to_vec()
                } else {
                    vec![fill; hidden]
                }
            })
            .collect()
    };
    let case = format!("vocab {vocab} rows {rows:?}");
    Ok(vec![
        invariance_result(
            "embed",
            format!("{case}: shard rows, -0.0 elsewhere"),
            false,
            bf16_mismatches(&out, &expect(neg)),
        ),
        invariance_result(
            "embed",
            format!("{case}: vs +0.0 elsewhere (canary)"),
            true,
            bf16_mismatches(&out, &expect(bf16::ZERO)),
        ),
    ])
}
