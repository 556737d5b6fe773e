//! Causal self-attention with grouped-query heads and an optional sliding window, reading K/V
//! through [`KvAccess`] so the same code serves a contiguous cache and a paged block pool.
//! Each (token, head) output is computed alone, keys in ascending order, so it is the same whether
//! its token came in a prefill chunk of 1 or of 4096, alone or in a batch of 64 sequences.

use rayon::prelude::*;

use super::ops::dot;

/// Shape of the attention computation.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub sliding_window: Option<usize>,
    /// Scores are `q · k · scale` ([`crate::ModelConfig::attention_scale`]).
    pub scale: f32,
}

/// Where the forward pass keeps K and V: per sequence of a batch (`seq` is the index of the
/// sequence in the batch), per layer, per absolute position, `num_kv_heads · head_dim` values.
pub trait KvAccess: Sync {
    fn key(&self, seq: usize, layer: usize, position: usize) -> &[f32];
    fn value(&self, seq: usize, layer: usize, position: usize) -> &[f32];
    fn write(&mut self, seq: usize, layer: usize, position: usize, key: &[f32], value: &[f32]);
}

/// One query token: which sequence of the batch it belongs to and its absolute position.
#[derive(Debug, Clone, Copy)]
pub struct QueryPos {
    pub seq: usize,
    pub position: usize,
}

/// `q` holds one row of `num_heads · head_dim` per entry of `queries`; the K/V of every position
/// up to each query's own must already be in `kv` for `layer`.
pub fn causal_attention(
    shape: AttentionShape,
    layer: usize,
    q: &[f32],
    queries: &[QueryPos],
    kv: &dyn KvAccess,
    out: &mut [f32],
) {
    let AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim,
        sliding_window,
        scale,
    } = shape;
    let group = num_heads / num_kv_heads;
    out.par_chunks_mut(head_dim)
        .enumerate()
        .for_each_init(Vec::new, |scores, (idx, o)| {
            let QueryPos { seq, position } = queries[idx / num_heads];
            let h = idx % num_heads;
            let first_key = sliding_window.map_or(0, |w| (position + 1).saturating_sub(w));
            let qh = &q[idx * head_dim..(idx + 1) * head_dim];
            let kv_off = (h / group) * head_dim;
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for p in first_key..=position {
                let k = &kv.key(seq, layer, p)[kv_off..kv_off + head_dim];
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
                let v = &kv.value(seq, layer, p)[kv_off..kv_off + head_dim];
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

    /// One sequence, one layer, contiguous rows.
    struct Rows {
        k: Vec<f32>,
        v: Vec<f32>,
        dim: usize,
    }

    impl KvAccess for Rows {
        fn key(&self, _: usize, _: usize, p: usize) -> &[f32] {
            &self.k[p * self.dim..(p + 1) * self.dim]
        }
        fn value(&self, _: usize, _: usize, p: usize) -> &[f32] {
            &self.v[p * self.dim..(p + 1) * self.dim]
        }
        fn write(&mut self, _: usize, _: usize, _: usize, _: &[f32], _: &[f32]) {}
    }

    #[test]
    fn single_key_returns_its_value_and_window_limits_keys() {
        let shape = AttentionShape {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 2,
            sliding_window: None,
            scale: 1.0 / 2f32.sqrt(),
        };
        let kv = Rows {
            k: vec![1.0, 0.0, 0.0, 1.0, 5.0, 5.0],
            v: vec![1.0, 2.0, 3.0, 4.0, 10.0, 20.0],
            dim: 2,
        };
        let q = [1.0, 0.0, 0.0, 1.0];
        let at = |position| [QueryPos { seq: 0, position }];
        let mut out = [0.0; 4];
        causal_attention(shape, 0, &q, &at(0), &kv, &mut out);
        assert_eq!(out, [1.0, 2.0, 1.0, 2.0]);
        let windowed = AttentionShape {
            sliding_window: Some(1),
            ..shape
        };
        causal_attention(windowed, 0, &q, &at(2), &kv, &mut out);
        assert_eq!(out, [10.0, 20.0, 10.0, 20.0]);
        // Without the window, position 2 mixes all three values.
        causal_attention(shape, 0, &q, &at(2), &kv, &mut out);
        assert!(out[0] > 3.0 && out[0] < 10.0);
    }
}
