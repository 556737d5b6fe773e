//! Causal self-attention over a contiguous per-layer KV cache, with grouped-query heads and an
//! optional sliding window. Each (token, head) output is computed alone, keys in ascending order,
//! so it is the same whether its token came in a prefill chunk of 1 or of 4096.

use rayon::prelude::*;

use super::ops::dot;

/// Shape of the attention computation.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub sliding_window: Option<usize>,
}

/// `q` holds `n` tokens × `num_heads · head_dim`, at positions `first_position..first_position+n`.
/// `k_cache` / `v_cache` hold positions `0..first_position+n` × `num_kv_heads · head_dim`.
pub fn causal_attention(
    shape: AttentionShape,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    first_position: usize,
    out: &mut [f32],
) {
    let AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim,
        sliding_window,
    } = shape;
    let kv_dim = num_kv_heads * head_dim;
    let group = num_heads / num_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    out.par_chunks_mut(head_dim)
        .enumerate()
        .for_each_init(Vec::new, |scores, (idx, o)| {
            let (t, h) = (idx / num_heads, idx % num_heads);
            let position = first_position + t;
            let first_key = sliding_window.map_or(0, |w| (position + 1).saturating_sub(w));
            let qh = &q[idx * head_dim..(idx + 1) * head_dim];
            let kv_off = (h / group) * head_dim;
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for p in first_key..=position {
                let k = &k_cache[p * kv_dim + kv_off..p * kv_dim + kv_off + head_dim];
                let s = dot(qh, k) * scale;
                max = max.max(s);
                scores.push(s);
            }
            let mut sum = 0.0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            o.fill(0.0);
            for (p, s) in (first_key..=position).zip(scores.iter()) {
                let v = &v_cache[p * kv_dim + kv_off..p * kv_dim + kv_off + head_dim];
                let w = s / sum;
                for (oi, vi) in o.iter_mut().zip(v) {
                    *oi += w * vi;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_key_returns_its_value_and_window_limits_keys() {
        let shape = AttentionShape {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 2,
            sliding_window: None,
        };
        let k = [1.0, 0.0, 0.0, 1.0, 5.0, 5.0];
        let v = [1.0, 2.0, 3.0, 4.0, 10.0, 20.0];
        let mut out = [0.0; 4];
        causal_attention(shape, &[1.0, 0.0, 0.0, 1.0], &k, &v, 0, &mut out);
        assert_eq!(out, [1.0, 2.0, 1.0, 2.0]);
        let windowed = AttentionShape {
            sliding_window: Some(1),
            ..shape
        };
        causal_attention(windowed, &[1.0, 0.0, 0.0, 1.0], &k, &v, 2, &mut out);
        assert_eq!(out, [10.0, 20.0, 10.0, 20.0]);
        // Without the window, position 2 mixes all three values.
        causal_attention(shape, &[1.0, 0.0, 0.0, 1.0], &k, &v, 2, &mut out);
        assert!(out[0] > 3.0 && out[0] < 10.0);
    }
}
