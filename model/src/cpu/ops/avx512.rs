//! AVX-512 forms of the dot products: `dot_portable`'s 32 lanes held in two 16-lane registers
//! (lanes 0–15 and 16–31), the same separate multiply and add per lane, then the tree's first
//! step (lane l += lane l + 16) as one addition of the two registers and the rest as the AVX
//! form does it. Half the instructions of the AVX form per weight, the same bits.

use std::arch::x86_64::*;

use super::{LANES, bf16_to_f32, tail_dot, tree_from_width8};

/// Width 16 and 8 of the tree, then the rest.
#[target_feature(enable = "avx512f")]
fn tree(s: [__m512; 2]) -> f32 {
    let w16 = _mm512_add_ps(s[0], s[1]);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(w16)));
    tree_from_width8(_mm256_add_ps(_mm512_castps512_ps256(w16), hi))
}

/// [`super::dot`].
#[target_feature(enable = "avx512f")]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let chunks = n / LANES;
    // SAFETY: every load reads 16 floats at offsets below `chunks * LANES <= n` of both slices.
    let acc0 = unsafe {
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut s = [_mm512_setzero_ps(); 2];
        for c in 0..chunks {
            let base = c * LANES;
            for (r, sr) in s.iter_mut().enumerate() {
                let x = _mm512_loadu_ps(pa.add(base + 16 * r));
                let y = _mm512_loadu_ps(pb.add(base + 16 * r));
                *sr = _mm512_add_ps(*sr, _mm512_mul_ps(x, y));
            }
        }
        tree(s)
    };
    acc0 + tail_dot(&a[chunks * LANES..n], &b[chunks * LANES..n])
}

/// [`super::dot_bf16`]: each bf16 weight widened exactly (shifted into the high half).
#[target_feature(enable = "avx512f")]
pub(super) fn dot_bf16(a: &[f32], w: &[u16]) -> f32 {
    let n = a.len().min(w.len());
    let chunks = n / LANES;
    // SAFETY: loads read 16 floats / 16 u16 at offsets below `chunks * LANES <= n` of both
    // slices.
    let acc0 = unsafe {
        let (pa, pw) = (a.as_ptr(), w.as_ptr());
        let mut s = [_mm512_setzero_ps(); 2];
        for c in 0..chunks {
            let base = c * LANES;
            for (r, sr) in s.iter_mut().enumerate() {
                let x = _mm512_loadu_ps(pa.add(base + 16 * r));
                let half = _mm256_loadu_si256(pw.add(base + 16 * r) as *const __m256i);
                let y = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(half)));
                *sr = _mm512_add_ps(*sr, _mm512_mul_ps(x, y));
            }
        }
        tree(s)
    };
    let mut tail = [0.0f32; LANES];
    let w_tail = &w[chunks * LANES..n];
    for (t, w) in tail.iter_mut().zip(w_tail) {
        *t = bf16_to_f32(*w);
    }
    acc0 + tail_dot(&a[chunks * LANES..n], &tail[..w_tail.len()])
}
