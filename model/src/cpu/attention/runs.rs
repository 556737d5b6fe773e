//! The two inner loops of attention over a run of contiguous K or V rows, each the per-row
//! operation of [`super::super::ops`] repeated — the same bits — with the row loop inside one
//! vector routine: a query's scores against a run of keys ([`dot_rows`], `dot` per key) and the
//! weighted sum of a run of values ([`axpy_rows`], `axpy` per value).
//!
//! The AVX `dot_rows` takes eight keys at a time through `dot`'s 32-lane sums, then does the
//! pairwise tree of all eight at once (one transpose), so each key's score is the additions of
//! `dot` in its order. The AVX `axpy_rows` keeps 64 output elements in registers across the
//! run; every element still receives one rounded product and one rounded sum per value, in
//! ascending position.

use super::super::ops::{axpy, dot};

/// `out.push(dot(q, key_i) * scale)` for the `n` keys `key_i = rows[i * stride..][..q.len()]`;
/// returns the largest of them (`-inf` for none).
///
/// The maximum is taken in no particular order. Over scores without NaN its value is unique but
/// for the sign of a zero, and a softmax subtracting either zero gets the same bits; a NaN score
/// makes its query's sum, and so every weight, NaN whatever the maximum is.
pub fn dot_rows(
    q: &[f32],
    rows: &[f32],
    stride: usize,
    n: usize,
    scale: f32,
    out: &mut Vec<f32>,
) -> f32 {
    if n == 0 {
        return f32::NEG_INFINITY;
    }
    let hd = q.len();
    assert!(
        (n - 1) * stride + hd <= rows.len(),
        "{n} rows of {hd} at a stride of {stride} exceed the run"
    );
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(32) && std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the feature was detected just above; the bounds were asserted.
        return unsafe { dot_rows_avx512(q, rows, stride, n, scale, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(32) && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the feature was detected just above; the bounds were asserted.
        return unsafe { dot_rows_avx(q, rows, stride, n, scale, out) };
    }
    let first = out.len();
    out.extend((0..n).map(|i| dot(q, &rows[i * stride..i * stride + hd]) * scale));
    out[first..]
        .iter()
        .fold(f32::NEG_INFINITY, |m, &s| m.max(s))
}

/// `axpy(o, weights[i], value_i)` for each `value_i = rows[i * stride..][..o.len()]`, in
/// ascending `i`.
pub fn axpy_rows(o: &mut [f32], weights: &[f32], rows: &[f32], stride: usize) {
    let (hd, n) = (o.len(), weights.len());
    if n == 0 {
        return;
    }
    assert!(
        (n - 1) * stride + hd <= rows.len(),
        "{n} rows of {hd} at a stride of {stride} exceed the run"
    );
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(64) && std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the feature was detected just above; the bounds were asserted.
        return unsafe { axpy_rows_avx512(o, weights, rows, stride) };
    }
    #[cfg(target_arch = "x86_64")]
    if hd.is_multiple_of(64) && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the feature was detected just above; the bounds were asserted.
        return unsafe { axpy_rows_avx(o, weights, rows, stride) };
    }
    for (i, &w) in weights.iter().enumerate() {
        axpy(o, w, &rows[i * stride..i * stride + hd]);
    }
}

/// `dot_avx`'s four 8-lane sums of one key (lanes 0-7, 8-15, 16-23, 24-31 of the 32), folded to
/// the tree's width 8: `(s0 + s2) + (s1 + s3)`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn width8(q: *const f32, k: *const f32, hd: usize) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: the caller holds `hd` floats at both pointers.
    unsafe {
        let mut s = [_mm256_setzero_ps(); 4];
        for base in (0..hd).step_by(32) {
            for (r, sr) in s.iter_mut().enumerate() {
                let x = _mm256_loadu_ps(q.add(base + 8 * r));
                let y = _mm256_loadu_ps(k.add(base + 8 * r));
                *sr = _mm256_add_ps(*sr, _mm256_mul_ps(x, y));
            }
        }
        _mm256_add_ps(_mm256_add_ps(s[0], s[2]), _mm256_add_ps(s[1], s[3]))
    }
}

/// [`width8`] with the 32 lanes in two 16-lane registers (`[s0 | s1]` and `[s2 | s3]`): their
/// sum is `[s0 + s2 | s1 + s3]`, whose halves added are the same `(s0 + s2) + (s1 + s3)`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn width8_avx512(q: *const f32, k: *const f32, hd: usize) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // SAFETY: the caller holds `hd` floats at both pointers.
    unsafe {
        let mut s = [_mm512_setzero_ps(); 2];
        for base in (0..hd).step_by(32) {
            for (r, sr) in s.iter_mut().enumerate() {
                let x = _mm512_loadu_ps(q.add(base + 16 * r));
                let y = _mm512_loadu_ps(k.add(base + 16 * r));
                *sr = _mm512_add_ps(*sr, _mm512_mul_ps(x, y));
            }
        }
        let w16 = _mm512_add_ps(s[0], s[1]);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(w16)));
        _mm256_add_ps(_mm512_castps512_ps256(w16), hi)
    }
}

/// The scores of eight keys from their width-8 sums `w` (lane l of `w[j]`: key j's lane l):
/// one transpose, then the tree's widths 4, 2 and 1 for the eight at once, `dot`'s empty tail
/// (+ 0.0) and the scale.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn eight_scores(
    w: [std::arch::x86_64::__m256; 8],
    scale8: std::arch::x86_64::__m256,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // Transpose: t[l] holds lane l of the eight keys' width-8 sums.
    let a0 = _mm256_unpacklo_ps(w[0], w[1]);
    let a1 = _mm256_unpackhi_ps(w[0], w[1]);
    let a2 = _mm256_unpacklo_ps(w[2], w[3]);
    let a3 = _mm256_unpackhi_ps(w[2], w[3]);
    let a4 = _mm256_unpacklo_ps(w[4], w[5]);
    let a5 = _mm256_unpackhi_ps(w[4], w[5]);
    let a6 = _mm256_unpacklo_ps(w[6], w[7]);
    let a7 = _mm256_unpackhi_ps(w[6], w[7]);
    let b0 = _mm256_shuffle_ps::<0x44>(a0, a2);
    let b1 = _mm256_shuffle_ps::<0xEE>(a0, a2);
    let b2 = _mm256_shuffle_ps::<0x44>(a1, a3);
    let b3 = _mm256_shuffle_ps::<0xEE>(a1, a3);
    let b4 = _mm256_shuffle_ps::<0x44>(a4, a6);
    let b5 = _mm256_shuffle_ps::<0xEE>(a4, a6);
    let b6 = _mm256_shuffle_ps::<0x44>(a5, a7);
    let b7 = _mm256_shuffle_ps::<0xEE>(a5, a7);
    let t = [
        _mm256_permute2f128_ps::<0x20>(b0, b4),
        _mm256_permute2f128_ps::<0x20>(b1, b5),
        _mm256_permute2f128_ps::<0x20>(b2, b6),
        _mm256_permute2f128_ps::<0x20>(b3, b7),
        _mm256_permute2f128_ps::<0x31>(b0, b4),
        _mm256_permute2f128_ps::<0x31>(b1, b5),
        _mm256_permute2f128_ps::<0x31>(b2, b6),
        _mm256_permute2f128_ps::<0x31>(b3, b7),
    ];
    // The tree's widths 4, 2 and 1, for eight keys at once; then `dot`'s empty tail
    // (+ 0.0) and the scale.
    let w4 = [
        _mm256_add_ps(t[0], t[4]),
        _mm256_add_ps(t[1], t[5]),
        _mm256_add_ps(t[2], t[6]),
        _mm256_add_ps(t[3], t[7]),
    ];
    let w2 = [_mm256_add_ps(w4[0], w4[2]), _mm256_add_ps(w4[1], w4[3])];
    let w1 = _mm256_add_ps(w2[0], w2[1]);
    _mm256_mul_ps(_mm256_add_ps(w1, _mm256_setzero_ps()), scale8)
}

/// `dot_rows` for keys whose head dim 32 divides, eight keys a step: `$width8` gives each key's
/// width-8 sums, [`eight_scores`] the rest of the tree for all eight.
macro_rules! dot_rows_x86 {
    ($name:ident, $feature:literal, $width8:ident) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feature)]
        unsafe fn $name(
            q: &[f32],
            rows: &[f32],
            stride: usize,
            n: usize,
            scale: f32,
            out: &mut Vec<f32>,
        ) -> f32 {
            use std::arch::x86_64::*;
            let hd = q.len();
            out.reserve(n);
            let mut max = f32::NEG_INFINITY;
            let (pq, pk) = (q.as_ptr(), rows.as_ptr());
            let eights = n / 8;
            // SAFETY: key `i < n` spans `i * stride..i * stride + hd`, inside `rows`
            // (asserted by the caller); `q` holds `hd` floats.
            unsafe {
                let (zero, scale8) = (_mm256_setzero_ps(), _mm256_set1_ps(scale));
                let mut max8 = _mm256_set1_ps(f32::NEG_INFINITY);
                for e in 0..eights {
                    // (Plain loops, not `array::from_fn`: a closure does not inherit the target
                    // feature, so the width-8 sums would not be inlined into it.)
                    let mut w = [zero; 8];
                    for (j, wj) in w.iter_mut().enumerate() {
                        *wj = $width8(pq, pk.add((8 * e + j) * stride), hd);
                    }
                    let s = eight_scores(w, scale8);
                    max8 = _mm256_max_ps(max8, s);
                    let mut lanes = [0.0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), s);
                    out.extend_from_slice(&lanes);
                }
                let mut lanes = [0.0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), max8);
                max = lanes.iter().fold(max, |m, &l| m.max(l));
            }
            for i in 8 * eights..n {
                let s = dot(q, &rows[i * stride..i * stride + hd]) * scale;
                max = max.max(s);
                out.push(s);
            }
            max
        }
    };
}

dot_rows_x86!(dot_rows_avx, "avx", width8);
dot_rows_x86!(dot_rows_avx512, "avx512f", width8_avx512);

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn axpy_rows_avx(o: &mut [f32], weights: &[f32], rows: &[f32], stride: usize) {
    use std::arch::x86_64::*;
    let po = o.as_mut_ptr();
    let pv = rows.as_ptr();
    // SAFETY: `o` holds a multiple of 64 floats; value `i < weights.len()` spans
    // `i * stride..i * stride + o.len()` inside `rows` (asserted by the caller).
    unsafe {
        for base in (0..o.len()).step_by(64) {
            let mut acc = [_mm256_setzero_ps(); 8];
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(po.add(base + 8 * r));
            }
            for (i, &w) in weights.iter().enumerate() {
                let wv = _mm256_set1_ps(w);
                let v = pv.add(i * stride + base);
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(wv, _mm256_loadu_ps(v.add(8 * r))));
                }
            }
            for (r, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(po.add(base + 8 * r), *a);
            }
        }
    }
}

/// [`axpy_rows_avx`] with 64 output elements in four 16-lane registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpy_rows_avx512(o: &mut [f32], weights: &[f32], rows: &[f32], stride: usize) {
    use std::arch::x86_64::*;
    let po = o.as_mut_ptr();
    let pv = rows.as_ptr();
    // SAFETY: as `axpy_rows_avx`.
    unsafe {
        for base in (0..o.len()).step_by(64) {
            let mut acc = [_mm512_setzero_ps(); 4];
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(po.add(base + 16 * r));
            }
            for (i, &w) in weights.iter().enumerate() {
                let wv = _mm512_set1_ps(w);
                let v = pv.add(i * stride + base);
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_add_ps(*a, _mm512_mul_ps(wv, _mm512_loadu_ps(v.add(16 * r))));
                }
            }
            for (r, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(po.add(base + 16 * r), *a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                // Wide exponents, both signs, and exact zeros of either sign now and then.
                match s % 97 {
                    0 => 0.0,
                    1 => -0.0,
                    r => ((s >> 8) % 4000) as f32 / 1000.0 - 2.0 * (r as f32 / 50.0),
                }
            })
            .collect()
    }

    type DotRows = fn(&[f32], &[f32], usize, usize, f32, &mut Vec<f32>) -> f32;
    type AxpyRows = fn(&mut [f32], &[f32], &[f32], usize);

    /// The dispatching functions, then each vector form this machine runs, by name (the
    /// dispatch takes only the widest): the forms for head dims 32 and 64 divide.
    fn forms() -> Vec<(&'static str, DotRows, AxpyRows)> {
        let mut forms: Vec<(&str, DotRows, AxpyRows)> = vec![("dispatch", dot_rows, axpy_rows)];
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY (all four): the features were detected just before.
            if std::arch::is_x86_feature_detected!("avx") {
                forms.push((
                    "avx",
                    |q, r, st, n, sc, o| unsafe { dot_rows_avx(q, r, st, n, sc, o) },
                    |o, w, r, st| unsafe { axpy_rows_avx(o, w, r, st) },
                ));
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                forms.push((
                    "avx512",
                    |q, r, st, n, sc, o| unsafe { dot_rows_avx512(q, r, st, n, sc, o) },
                    |o, w, r, st| unsafe { axpy_rows_avx512(o, w, r, st) },
                ));
            }
        }
        forms
    }

    #[test]
    fn dot_rows_is_dot_per_key_bit_for_bit() {
        for (name, dot_rows, _) in forms() {
            for hd in [32usize, 64, 128, 256, 40, 80] {
                if name != "dispatch" && !hd.is_multiple_of(32) {
                    continue;
                }
                for n in [1, 7, 8, 9, 16, 23] {
                    let stride = 3 * hd + 8;
                    let rows = fill((n - 1) * stride + hd, (hd * 31 + n) as u32);
                    let q = fill(hd, hd as u32 + 7);
                    let mut got = vec![7.0];
                    let max = dot_rows(&q, &rows, stride, n, 0.125, &mut got);
                    let got = got.split_off(1);
                    let want_max = got.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                    assert_eq!(
                        max, want_max,
                        "{name} hd {hd} n {n}: the run's maximum, not the kept 7.0"
                    );
                    let want: Vec<u32> = (0..n)
                        .map(|i| (dot(&q, &rows[i * stride..i * stride + hd]) * 0.125).to_bits())
                        .collect();
                    let got: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
                    assert_eq!(got, want, "{name} hd {hd} n {n}");
                }
            }
            // A zero query against negative keys: every product is -0.0, and `dot`'s lanes
            // start at +0.0, so every score is +0.0.
            let (q, k) = (vec![0.0f32; 64], vec![-1.0f32; 64 * 8]);
            let mut got = Vec::new();
            dot_rows(&q, &k, 64, 8, 1.0, &mut got);
            assert!(got.iter().all(|s| s.to_bits() == 0), "{name}: {got:?}");
        }
    }

    #[test]
    fn axpy_rows_is_axpy_per_value_bit_for_bit() {
        for (name, _, axpy_rows) in forms() {
            for hd in [64usize, 128, 256, 40] {
                if name != "dispatch" && !hd.is_multiple_of(64) {
                    continue;
                }
                for n in [1, 5, 16, 33] {
                    let stride = 2 * hd + 16;
                    let rows = fill((n - 1) * stride + hd, (hd * 17 + n) as u32);
                    let weights: Vec<f32> = fill(n, 3).iter().map(|w| w.abs() / 7.0).collect();
                    let start = fill(hd, 11);
                    let mut got = start.clone();
                    axpy_rows(&mut got, &weights, &rows, stride);
                    let mut want = start.clone();
                    for (i, &w) in weights.iter().enumerate() {
                        for (o, v) in want.iter_mut().zip(&rows[i * stride..i * stride + hd]) {
                            *o += w * v;
                        }
                    }
                    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{name} hd {hd} n {n}");
                }
            }
        }
    }
}
