//! The arithmetic of the reference forward pass.
//!
//! Invariant kept here: every output element is reduced in an order that depends only on its own
//! inputs — never on how many rows are computed together, how work is split across threads, or
//! which CPU features are present. The dot product uses 16 independent f32 lanes summed by a fixed
//! tree; the AVX variant executes the same operations (Rust never fuses mul+add on its own), so
//! results are bit-identical with and without it. That is what lets greedy outputs stay
//! byte-identical across batching, chunked prefill and restore.

use rayon::prelude::*;

const LANES: usize = 16;

#[inline(always)]
fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] += acc[l + width];
        }
    }
    acc[0] + tail
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn dot_avx(a: &[f32], b: &[f32]) -> f32 {
    dot_body(a, b)
}

/// `Σ a[i]·b[i]` over the common length, in the fixed order described above.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the feature was detected at run time just above.
        return unsafe { dot_avx(a, b) };
    }
    dot_body(a, b)
}

/// Output features computed per task when the batch has few rows.
const COLUMN_BLOCK: usize = 64;
/// Rows of `x` computed per task when the batch has many.
const ROW_BLOCK: usize = 4;

/// `y[m][n] = Σ_k x[m][k] · w[n][k] (+ bias[n])` — `w` in HF `[out, in]` layout.
///
/// Few rows (decode): parallel over blocks of output features. Many rows (prefill): parallel over
/// blocks of rows, each walking `w` once per block. Every element is one `dot` either way.
pub fn linear(x: &[f32], w: &[f32], bias: Option<&[f32]>, k: usize, y: &mut [f32]) {
    let m = x.len() / k;
    let n = w.len() / k;
    debug_assert_eq!(y.len(), m * n);
    let finish = |v: f32, j: usize| bias.map_or(v, |b| v + b[j]);
    if m < 2 * rayon::current_num_threads() {
        let blocks: Vec<Vec<f32>> = w
            .par_chunks(COLUMN_BLOCK * k)
            .enumerate()
            .map(|(bi, wb)| {
                let cols = wb.len() / k;
                let mut out = Vec::with_capacity(m * cols);
                for xr in x.chunks_exact(k) {
                    for (c, wr) in wb.chunks_exact(k).enumerate() {
                        out.push(finish(dot(xr, wr), bi * COLUMN_BLOCK + c));
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
    } else {
        y.par_chunks_mut(ROW_BLOCK * n)
            .zip(x.par_chunks(ROW_BLOCK * k))
            .for_each(|(yb, xb)| {
                for (j, wr) in w.chunks_exact(k).enumerate() {
                    for (r, xr) in xb.chunks_exact(k).enumerate() {
                        yb[r * n + j] = finish(dot(xr, wr), j);
                    }
                }
            });
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
        (0..n as u32).map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0).collect()
    }

    #[test]
    fn linear_matches_f64_and_is_row_invariant() {
        let (k, n) = (77, 150);
        let w = fill(n * k, 7);
        let bias = fill(n, 3);
        for m in [1, 3, 9, 33] {
            let x = fill(m * k, 11);
            let mut y = vec![0.0; m * n];
            linear(&x, &w, Some(&bias), k, &mut y);
            let want = naive(&x, &w, k);
            for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                let b = b + bias[i % n] as f64;
                assert!((*a as f64 - b).abs() < 1e-4, "m={m} i={i}: {a} vs {b}");
            }
            // Each row alone gives the very same bits as inside the batch.
            for (r, xr) in x.chunks_exact(k).enumerate() {
                let mut one = vec![0.0; n];
                linear(xr, &w, Some(&bias), k, &mut one);
                assert_eq!(one.as_slice(), &y[r * n..(r + 1) * n], "row {r} of m={m}");
            }
        }
    }

    #[test]
    fn dot_avx_and_portable_agree_bitwise() {
        let a = fill(1000, 1);
        let b = fill(1000, 2);
        assert_eq!(dot(&a, &b).to_bits(), dot_body(&a, &b).to_bits());
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
