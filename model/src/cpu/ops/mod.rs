//! The arithmetic of the reference forward pass.
//!
//! Invariant kept here: every output element is reduced in an order that depends only on its own
//! inputs — never on how many rows are computed together, how work is split across threads, or
//! which CPU features are present. The dot product uses 32 independent f32 lanes summed by a fixed
//! tree; the AVX variant executes the same operations (Rust never fuses mul+add on its own), so
//! results are bit-identical with and without it. That is what lets greedy outputs stay
//! byte-identical across batching, chunked prefill and restore.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod avx512;

const LANES: usize = 32;

/// The portable definition: `LANES` running sums (lane `l` takes elements `l, l + LANES, …`), then
/// a fixed pairwise tree, then the tail.
#[inline(always)]
fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0.0f32; LANES];
    let chunks = n / LANES;
    for c in 0..chunks {
        let (x, y) = (
            &a[c * LANES..(c + 1) * LANES],
            &b[c * LANES..(c + 1) * LANES],
        );
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    finish_dot(acc, &a[chunks * LANES..n], &b[chunks * LANES..n])
}

#[inline(always)]
fn finish_dot(mut acc: [f32; LANES], a_tail: &[f32], b_tail: &[f32]) -> f32 {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] += acc[l + width];
        }
    }
    acc[0] + tail_dot(a_tail, b_tail)
}

/// The elements past the last full group of lanes, summed in order.
#[inline(always)]
fn tail_dot(a_tail: &[f32], b_tail: &[f32]) -> f32 {
    let mut tail = 0.0f32;
    for (x, y) in a_tail.iter().zip(b_tail) {
        tail += x * y;
    }
    tail
}

/// `finish_dot`'s pairwise tree on the four registers holding lanes 0–7, 8–15, 16–23, 24–31:
/// the same additions of the same lanes, so the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn tree_avx(s: [std::arch::x86_64::__m256; 4]) -> f32 {
    use std::arch::x86_64::*;
    // Width 16, then 8: lanes l += l + 16, then l += l + 8.
    let w16 = [_mm256_add_ps(s[0], s[2]), _mm256_add_ps(s[1], s[3])];
    tree_from_width8(_mm256_add_ps(w16[0], w16[1]))
}

/// The rest of `finish_dot`'s tree once lanes 0–7 hold the width-8 sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn tree_from_width8(w8: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    // Width 4: lanes 0–3 += lanes 4–7.
    let w4 = _mm_add_ps(_mm256_castps256_ps128(w8), _mm256_extractf128_ps(w8, 1));
    // Width 2: lanes 0–1 += lanes 2–3.
    let w2 = _mm_add_ps(w4, _mm_movehl_ps(w4, w4));
    // Width 1: lane 0 += lane 1.
    let w1 = _mm_add_ss(w2, _mm_shuffle_ps(w2, w2, 1));
    _mm_cvtss_f32(w1)
}

/// The same lanes held in four 8-wide AVX registers: separate multiply and add, no FMA, so each
/// lane rounds exactly as in `dot_portable`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn dot_avx(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let chunks = n / LANES;
    let acc0;
    // SAFETY: every load reads 8 floats at offsets below `chunks * LANES <= n` of both slices;
    // `tree_avx` needs only the AVX feature of this function.
    unsafe {
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut s = [_mm256_setzero_ps(); 4];
        for c in 0..chunks {
            let base = c * LANES;
            for (r, sr) in s.iter_mut().enumerate() {
                let x = _mm256_loadu_ps(pa.add(base + 8 * r));
                let y = _mm256_loadu_ps(pb.add(base + 8 * r));
                *sr = _mm256_add_ps(*sr, _mm256_mul_ps(x, y));
            }
        }
        acc0 = tree_avx(s);
    }
    acc0 + tail_dot(&a[chunks * LANES..n], &b[chunks * LANES..n])
}

/// `Σ a[i]·w[i]` with `w` in bf16 bits: the same lanes and order as `dot_portable` over the
/// exactly widened weights, so results equal `dot(a, widened(w))` bit for bit.
#[inline(always)]
fn dot_bf16_portable(a: &[f32], w: &[u16]) -> f32 {
    let n = a.len().min(w.len());
    let mut acc = [0.0f32; LANES];
    let chunks = n / LANES;
    for c in 0..chunks {
        let (x, y) = (
            &a[c * LANES..(c + 1) * LANES],
            &w[c * LANES..(c + 1) * LANES],
        );
        for l in 0..LANES {
            acc[l] += x[l] * bf16_to_f32(y[l]);
        }
    }
    finish_dot_bf16(acc, &a[chunks * LANES..n], &w[chunks * LANES..n])
}

#[inline(always)]
fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

#[inline(always)]
fn finish_dot_bf16(acc: [f32; LANES], a_tail: &[f32], w_tail: &[u16]) -> f32 {
    let mut tail = [0.0f32; LANES];
    for (t, w) in tail.iter_mut().zip(w_tail) {
        *t = bf16_to_f32(*w);
    }
    finish_dot(acc, a_tail, &tail[..w_tail.len()])
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn dot_bf16_avx2(a: &[f32], w: &[u16]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(w.len());
    let chunks = n / LANES;
    let acc0;
    // SAFETY: loads read 8 floats / 8 u16 at offsets below `chunks * LANES <= n` of both slices;
    // `tree_avx` needs only the AVX feature of this function.
    unsafe {
        let (pa, pw) = (a.as_ptr(), w.as_ptr());
        let mut s = [_mm256_setzero_ps(); 4];
        for c in 0..chunks {
            let base = c * LANES;
            for (r, sr) in s.iter_mut().enumerate() {
                let x = _mm256_loadu_ps(pa.add(base + 8 * r));
                let half = _mm_loadu_si128(pw.add(base + 8 * r) as *const __m128i);
                let y = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
                *sr = _mm256_add_ps(*sr, _mm256_mul_ps(x, y));
            }
        }
        acc0 = tree_avx(s);
    }
    let mut tail = [0.0f32; LANES];
    let w_tail = &w[chunks * LANES..n];
    for (t, w) in tail.iter_mut().zip(w_tail) {
        *t = bf16_to_f32(*w);
    }
    acc0 + tail_dot(&a[chunks * LANES..n], &tail[..w_tail.len()])
}

/// [`dot`] with bf16 weights.
#[inline]
pub fn dot_bf16(a: &[f32], w: &[u16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the feature was detected at run time just above.
        return unsafe { avx512::dot_bf16(a, w) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the feature was detected at run time just above.
        return unsafe { dot_bf16_avx2(a, w) };
    }
    dot_bf16_portable(a, w)
}

/// A weight matrix in HF `[out, in]` layout, kept in the checkpoint's dtype where the reference
/// can read it directly (bf16 halves the bytes each decode step streams); f16 and f32 are widened
/// to f32 at load. Widening is exact, so the arithmetic is the same either way.
pub enum Matrix {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    /// bf16 weights whose row `r`'s output sum is multiplied by `scales[r]` once (before any
    /// bias): kept NVFP4's and FP8's arithmetic (`QuantizedLinear::nvfp4_kept`, `fp8_kept`), what
    /// the CUDA backend's tiles compute.
    Scaled {
        weights: Vec<u16>,
        scales: Vec<f32>,
    },
}

impl Matrix {
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(v) | Self::Scaled { weights: v, .. } => v.len(),
        }
    }

    /// The scale each row's output sum is multiplied by, when there are some.
    fn output_scales(&self) -> Option<&[f32]> {
        match self {
            Self::Scaled { scales, .. } => Some(scales),
            Self::F32(_) | Self::Bf16(_) => None,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row `r` of a matrix with `k` columns, widened into `out` (a scaled matrix's row times its
    /// scale).
    pub fn row_into(&self, r: usize, k: usize, out: &mut [f32]) {
        match self {
            Self::F32(v) => out.copy_from_slice(&v[r * k..(r + 1) * k]),
            Self::Bf16(v) => {
                for (o, b) in out.iter_mut().zip(&v[r * k..(r + 1) * k]) {
                    *o = bf16_to_f32(*b);
                }
            }
            Self::Scaled { weights, scales } => {
                for (o, b) in out.iter_mut().zip(&weights[r * k..(r + 1) * k]) {
                    *o = bf16_to_f32(*b) * scales[r];
                }
            }
        }
    }
}

/// `Σ a[i]·b[i]` over the common length, in the fixed order of `dot_portable`.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the feature was detected at run time just above.
        return unsafe { avx512::dot(a, b) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the feature was detected at run time just above.
        return unsafe { dot_avx(a, b) };
    }
    dot_portable(a, b)
}

/// Output features computed per task: 64 rows of `w` (≤ 1 MiB at hidden 4096) stay in cache
/// while every row of `x` passes over them, so `w` is read from memory once per call.
const COLUMN_BLOCK: usize = 64;

/// `y[m][n] = Σ_k x[m][k] · w[n][k] (× scale[n]) (+ bias[n])` — `w` in HF `[out, in]` layout.
///
/// Parallel over blocks of output features; every element is one `dot`, whatever `m` is.
pub fn linear(x: &[f32], w: &Matrix, bias: Option<&[f32]>, k: usize, y: &mut [f32]) {
    let scale = w.output_scales();
    match w {
        Matrix::F32(w) => linear_with(x, w, (scale, bias), k, y, dot),
        Matrix::Bf16(w) | Matrix::Scaled { weights: w, .. } => {
            linear_with(x, w, (scale, bias), k, y, dot_bf16)
        }
    }
}

fn linear_with<W: Sync>(
    x: &[f32],
    w: &[W],
    (scale, bias): (Option<&[f32]>, Option<&[f32]>),
    k: usize,
    y: &mut [f32],
    dot: impl Fn(&[f32], &[W]) -> f32 + Sync,
) {
    let m = x.len() / k;
    let n = w.len() / k;
    debug_assert_eq!(y.len(), m * n);
    let blocks: Vec<Vec<f32>> = w
        .par_chunks(COLUMN_BLOCK * k)
        .enumerate()
        .map(|(bi, wb)| {
            let mut out = Vec::with_capacity(m * wb.len() / k);
            for xr in x.chunks_exact(k) {
                for (c, wr) in wb.chunks_exact(k).enumerate() {
                    let v = dot(xr, wr);
                    let v = scale.map_or(v, |s| v * s[bi * COLUMN_BLOCK + c]);
                    out.push(bias.map_or(v, |b| v + b[bi * COLUMN_BLOCK + c]));
                }
            }
            out
        })
        .collect();
    for (bi, block) in blocks.iter().enumerate() {
        let cols = block.len() / m.max(1);
        for (r, vals) in block.chunks_exact(cols.max(1)).enumerate() {
            let start = r * n + bi * COLUMN_BLOCK;
            y[start..start + cols].copy_from_slice(vals);
        }
    }
}

/// The number of K-shards of every row-parallel reduction (the o and down projections): the
/// largest tensor-parallel degree supported. Each output element is the sum, in shard order, of
/// the dots over `ROW_PARALLEL_SHARDS` contiguous K-ranges — at any TP degree, including 1 — so a
/// rank holding some of the shards computes exactly the partials TP=1 computes, and adding all of
/// them in shard order reproduces TP=1 bit for bit (docs/DECISIONS.md).
pub const ROW_PARALLEL_SHARDS: usize = 8;

/// The shard count of a row-parallel reduction over `k`: [`ROW_PARALLEL_SHARDS`] when it divides
/// `k`, else 1 (one plain dot; such a model cannot be split for tensor parallelism).
pub fn row_parallel_shards(k: usize) -> usize {
    if k.is_multiple_of(ROW_PARALLEL_SHARDS) {
        ROW_PARALLEL_SHARDS
    } else {
        1
    }
}

/// Shard partials of `y = x · wᵀ` without summing them: `w` is `[n, k]`, `x` is `[m, k]`, and
/// `partials[s][r][c]` (`shards × m × n`) is the dot of row `r` of `x` with row `c` of `w` over
/// the `s`-th of `shards` contiguous K-ranges, in the order of [`dot`] (a scaled matrix's
/// partials unscaled: its scale applies to the sum).
pub fn linear_partials(x: &[f32], w: &Matrix, k: usize, shards: usize, partials: &mut [f32]) {
    match w {
        Matrix::F32(w) => partials_with(x, w, k, shards, partials, dot),
        Matrix::Bf16(w) | Matrix::Scaled { weights: w, .. } => {
            partials_with(x, w, k, shards, partials, dot_bf16)
        }
    }
}

fn partials_with<W: Sync>(
    x: &[f32],
    w: &[W],
    k: usize,
    shards: usize,
    partials: &mut [f32],
    dot: impl Fn(&[f32], &[W]) -> f32 + Sync,
) {
    let m = x.len() / k;
    let n = w.len() / k;
    let ks = k / shards;
    debug_assert_eq!(ks * shards, k);
    debug_assert_eq!(partials.len(), shards * m * n);
    let blocks: Vec<Vec<f32>> = w
        .par_chunks(COLUMN_BLOCK * k)
        .map(|wb| {
            let mut out = Vec::with_capacity(shards * m * wb.len() / k);
            for s in 0..shards {
                for xr in x.chunks_exact(k) {
                    let xs = &xr[s * ks..(s + 1) * ks];
                    for wr in wb.chunks_exact(k) {
                        out.push(dot(xs, &wr[s * ks..(s + 1) * ks]));
                    }
                }
            }
            out
        })
        .collect();
    for (bi, block) in blocks.iter().enumerate() {
        let cols = block.len() / (shards * m).max(1);
        for (sr, vals) in block.chunks_exact(cols.max(1)).enumerate() {
            // `sr` runs over (shard, row) pairs, which is also the row of `partials` seen as
            // `[shards · m, n]`.
            let start = sr * n + bi * COLUMN_BLOCK;
            partials[start..start + cols].copy_from_slice(vals);
        }
    }
}

/// `y[i] = ((p₀[i] + p₁[i]) + …) + p₍ₛ₋₁₎[i]`, then `+ bias` once: the shard partials of
/// [`linear_partials`] (`shards × y.len()`) added in shard order, starting from shard 0's value.
pub fn sum_partials(partials: &[f32], shards: usize, bias: Option<&[f32]>, y: &mut [f32]) {
    let len = y.len();
    debug_assert_eq!(partials.len(), shards * len);
    y.copy_from_slice(&partials[..len]);
    for p in partials.chunks_exact(len).skip(1) {
        add_in_place(y, p);
    }
    if let Some(b) = bias {
        for row in y.chunks_exact_mut(b.len()) {
            add_in_place(row, b);
        }
    }
}

/// A row-parallel projection (o, down) in the canonical order: [`row_parallel_shards`]`(k)`
/// shard partials, added in shard order, then a scaled matrix's scale, then the bias. With one
/// shard it is [`linear`].
pub fn linear_row_parallel(x: &[f32], w: &Matrix, bias: Option<&[f32]>, k: usize, y: &mut [f32]) {
    let shards = row_parallel_shards(k);
    if shards == 1 {
        return linear(x, w, bias, k, y);
    }
    let mut partials = vec![0.0; shards * y.len()];
    linear_partials(x, w, k, shards, &mut partials);
    let Some(scales) = w.output_scales() else {
        return sum_partials(&partials, shards, bias, y);
    };
    sum_partials(&partials, shards, None, y);
    for row in y.chunks_exact_mut(scales.len()) {
        row.iter_mut().zip(scales).for_each(|(v, s)| *v *= s);
    }
    if let Some(b) = bias {
        for row in y.chunks_exact_mut(b.len()) {
            add_in_place(row, b);
        }
    }
}

/// RMSNorm of each `weight.len()`-long row of `x` into `out`: `x / sqrt(mean(x²) + eps) · weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let inv = 1.0 / (dot(xr, xr) / d as f32 + eps).sqrt();
        for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
            *o = w * (v * inv);
        }
    }
}

/// RMSNorm in place (per-head q/k normalisation).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    for xr in x.chunks_exact_mut(d) {
        let inv = 1.0 / (dot(xr, xr) / d as f32 + eps).sqrt();
        for (v, w) in xr.iter_mut().zip(weight) {
            *v = w * (*v * inv);
        }
    }
}

/// `gate ← silu(gate) · up`, elementwise.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `gate ← gelu_tanh(gate) · up`, elementwise (PyTorch's `gelu(approximate="tanh")`, f32).
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    const BETA: f32 = 0.797_884_6; // sqrt(2/pi)
    const KAPPA: f32 = 0.044_715;
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g;
        let inner = BETA * (x + KAPPA * x * x * x);
        *g = 0.5 * x * (1.0 + inner.tanh()) * u;
    }
}

/// `o ← o + w · v`, elementwise: one rounded product, then one rounded sum (never fused), so the
/// AVX path gives the portable loop's bits.
#[inline]
pub fn axpy(o: &mut [f32], w: f32, v: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the feature was detected at run time just above.
        return unsafe { axpy_avx(o, w, v) };
    }
    for (oi, vi) in o.iter_mut().zip(v) {
        *oi += w * vi;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn axpy_avx(o: &mut [f32], w: f32, v: &[f32]) {
    use std::arch::x86_64::*;
    let n = o.len().min(v.len());
    let chunks = n / 8;
    // SAFETY: every load and store covers 8 floats below `chunks * 8 <= n` of both slices.
    unsafe {
        let wv = _mm256_set1_ps(w);
        let (po, pv) = (o.as_mut_ptr(), v.as_ptr());
        for c in 0..chunks {
            let at = c * 8;
            let sum = _mm256_add_ps(
                _mm256_loadu_ps(po.add(at)),
                _mm256_mul_ps(wv, _mm256_loadu_ps(pv.add(at))),
            );
            _mm256_storeu_ps(po.add(at), sum);
        }
    }
    for (oi, vi) in o[chunks * 8..n].iter_mut().zip(&v[chunks * 8..n]) {
        *oi += w * vi;
    }
}

pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], k: usize) -> Vec<f64> {
        let mut y = Vec::new();
        for xr in x.chunks_exact(k) {
            for wr in w.chunks_exact(k) {
                y.push(xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum());
            }
        }
        y
    }

    fn fill(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    #[test]
    fn linear_matches_f64_and_is_row_invariant() {
        let (k, n) = (77, 150);
        let w = fill(n * k, 7);
        let bias = fill(n, 3);
        for m in [1, 3, 9, 33] {
            let x = fill(m * k, 11);
            let mut y = vec![0.0; m * n];
            linear(&x, &Matrix::F32(w.clone()), Some(&bias), k, &mut y);
            let bf: Vec<u16> = w
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_bits())
                .collect();
            let widened: Vec<f32> = bf.iter().map(|b| bf16_to_f32(*b)).collect();
            let (mut yb, mut yw) = (vec![0.0; m * n], vec![0.0; m * n]);
            linear(&x, &Matrix::Bf16(bf), Some(&bias), k, &mut yb);
            linear(&x, &Matrix::F32(widened), Some(&bias), k, &mut yw);
            assert_eq!(
                yb, yw,
                "bf16 weights compute exactly like their f32 widening"
            );
            let want = naive(&x, &w, k);
            for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                let b = b + bias[i % n] as f64;
                assert!((*a as f64 - b).abs() < 1e-4, "m={m} i={i}: {a} vs {b}");
            }
            // Each row alone gives the very same bits as inside the batch.
            for (r, xr) in x.chunks_exact(k).enumerate() {
                let mut one = vec![0.0; n];
                linear(xr, &Matrix::F32(w.clone()), Some(&bias), k, &mut one);
                assert_eq!(one.as_slice(), &y[r * n..(r + 1) * n], "row {r} of m={m}");
            }
        }
    }

    #[test]
    fn row_parallel_is_the_shard_sum_in_order_and_row_invariant() {
        let (k, n) = (8 * 40, 70);
        let w = fill(n * k, 5);
        let bias = fill(n, 9);
        let ks = k / ROW_PARALLEL_SHARDS;
        for m in [1, 4] {
            let x = fill(m * k, 13);
            let mut y = vec![0.0; m * n];
            linear_row_parallel(&x, &Matrix::F32(w.clone()), Some(&bias), k, &mut y);
            for r in 0..m {
                for c in 0..n {
                    let (xr, wr) = (&x[r * k..(r + 1) * k], &w[c * k..(c + 1) * k]);
                    let mut want = dot(&xr[..ks], &wr[..ks]);
                    for s in 1..ROW_PARALLEL_SHARDS {
                        want += dot(&xr[s * ks..(s + 1) * ks], &wr[s * ks..(s + 1) * ks]);
                    }
                    want += bias[c];
                    assert_eq!(y[r * n + c].to_bits(), want.to_bits(), "m={m} r={r} c={c}");
                }
            }
        }
        // A K that 8 does not divide falls back to one plain dot.
        let (k, x) = (77, fill(77, 1));
        let w = fill(3 * 77, 2);
        let (mut a, mut b) = (vec![0.0; 3], vec![0.0; 3]);
        linear_row_parallel(&x, &Matrix::F32(w.clone()), None, k, &mut a);
        linear(&x, &Matrix::F32(w), None, k, &mut b);
        assert_eq!(a, b);
    }

    /// Every vector form this machine can run, beside the portable definition: `dot`'s
    /// dispatch takes only the widest, so each is called by name here.
    #[allow(clippy::type_complexity)]
    fn dot_forms() -> Vec<(
        &'static str,
        fn(&[f32], &[f32]) -> f32,
        fn(&[f32], &[u16]) -> f32,
    )> {
        let mut forms: Vec<(&str, fn(&[f32], &[f32]) -> f32, fn(&[f32], &[u16]) -> f32)> =
            vec![("dispatch", dot, dot_bf16)];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY (both): the features were detected just above.
                forms.push((
                    "avx",
                    |a, b| unsafe { dot_avx(a, b) },
                    |a, w| unsafe { dot_bf16_avx2(a, w) },
                ));
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                forms.push((
                    "avx512",
                    |a, b| unsafe { avx512::dot(a, b) },
                    |a, w| unsafe { avx512::dot_bf16(a, w) },
                ));
            }
        }
        forms
    }

    #[test]
    fn dot_avx_tree_matches_portable_over_many_inputs() {
        for (name, dot, _) in dot_forms() {
            for seed in 0..64 {
                let (a, b) = (fill(640, seed), fill(640, seed ^ 0x5bd1));
                for n in [32, 64, 96, 100, 640] {
                    assert_eq!(
                        dot(&a[..n], &b[..n]).to_bits(),
                        dot_portable(&a[..n], &b[..n]).to_bits(),
                        "{name} seed={seed} n={n}"
                    );
                }
            }
        }
    }

    #[test]
    fn dot_avx_and_portable_agree_bitwise() {
        let a = fill(1000, 1);
        let b = fill(1000, 2);
        for (name, dot, dot_bf16) in dot_forms() {
            for n in [0, 5, 31, 32, 33, 100, 1000] {
                assert_eq!(
                    dot(&a[..n], &b[..n]).to_bits(),
                    dot_portable(&a[..n], &b[..n]).to_bits(),
                    "{name} n={n}"
                );
                let w: Vec<u16> = b[..n]
                    .iter()
                    .map(|v| half::bf16::from_f32(*v).to_bits())
                    .collect();
                assert_eq!(
                    dot_bf16(&a[..n], &w).to_bits(),
                    dot_bf16_portable(&a[..n], &w).to_bits(),
                    "{name} n={n}"
                );
            }
        }
        // The canary: these inputs tell summation orders apart (one running sum is not the
        // 32 lanes' order).
        let chained = a.iter().zip(&b).fold(0.0f32, |s, (x, y)| s + x * y);
        assert_ne!(chained.to_bits(), dot_portable(&a, &b).to_bits());
    }

    #[test]
    fn axpy_matches_the_unfused_loop_bit_for_bit() {
        let v = fill(77, 5);
        let mut fast = fill(77, 6);
        let mut portable = fast.clone();
        for w in [0.37f32, -1.9e-3, 3.1e4] {
            axpy(&mut fast, w, &v);
            for (oi, vi) in portable.iter_mut().zip(&v) {
                *oi += w * vi;
            }
        }
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fast), bits(&portable));
        // The fused form rounds once: other bits somewhere (the test can tell them apart).
        let mut fused = fill(77, 6);
        for w in [0.37f32, -1.9e-3, 3.1e4] {
            for (oi, vi) in fused.iter_mut().zip(&v) {
                *oi = w.mul_add(*vi, *oi);
            }
        }
        assert_ne!(bits(&fast), bits(&fused));
    }

    #[test]
    fn rms_norm_unit_rows() {
        let x = [3.0, 4.0, 0.0, 0.0];
        let mut out = [0.0; 4];
        rms_norm(&x, &[1.0, 1.0, 1.0, 1.0], 0.0, &mut out);
        let expected = [3.0 / 2.5, 4.0 / 2.5, 0.0, 0.0];
        for (a, b) in out.iter().zip(expected) {
            assert!((a - b).abs() < 1e-6);
        }
    }
}
