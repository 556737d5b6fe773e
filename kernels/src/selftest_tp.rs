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
    for m in [1, 40] {
        let x = rng.bf16_vec(m * k, 1.0, 0.0);
        let w = rng.bf16_vec(n * k, 1.0, 0.0);
        let (dx, dw) = (upload(s, &x)?, upload(s, &w)?);
        let stride = m * n;
        let mut whole = poisoned_f32(s, SHARDS * stride)?;
        kernels.gemv_shards(s, &mut whole, &dx, &dw, (m, n), (SHARDS, kslice, k), stride)?;
        let whole = download(s, &whole)?;
        let case = format!("m={m} n={n} {SHARDS}x{kslice}");

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
