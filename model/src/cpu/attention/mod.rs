//! Causal self-attention with grouped-query heads and an optional sliding window, reading K/V
//! through [`KvAccess`] so the same code serves a contiguous cache and a paged block pool.
//! Each (token, head) output is computed alone, keys in ascending order, so it is the same whether
//! its token came in a prefill chunk of 1 or of 4096, alone or in a batch of 64 sequences.
//!
//! What is shared is only the reading: one task takes up to [`ROWS_PER_TASK`] consecutive rows of
//! one sequence and every query head of one KV head, and walks the keys and values once, in runs
//! of contiguous slots, handing each key to every query that sees it. Each query still gets its
//! own scores in ascending position, its own maximum, sum and weighted values in the order the
//! one-query loop used, so its bits do not depend on which rows share its task (the verification
//! rows of speculative decoding, a prefill chunk) — the tests hold it to that loop.

use rayon::prelude::*;

mod runs;

use runs::{axpy_rows, dot_rows};

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

    /// The keys of `position` and of the positions after it stored contiguously with it (the rest
    /// of its block in a paged pool): a whole number of rows, at least one. What lies past the
    /// last written position is not read.
    fn key_run(&self, seq: usize, layer: usize, position: usize) -> &[f32] {
        self.key(seq, layer, position)
    }

    /// [`KvAccess::key_run`] for values.
    fn value_run(&self, seq: usize, layer: usize, position: usize) -> &[f32] {
        self.value(seq, layer, position)
    }
}

/// One query token: which sequence of the batch it belongs to and its absolute position.
#[derive(Debug, Clone, Copy)]
pub struct QueryPos {
    pub seq: usize,
    pub position: usize,
}

/// Rows of one sequence that share one walk over its keys and values.
const ROWS_PER_TASK: usize = 16;

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
        ..
    } = shape;
    let group = num_heads / num_kv_heads;
    // Tasks: runs of consecutive rows of one sequence, at most ROWS_PER_TASK, times KV heads.
    let mut tasks = Vec::new();
    let mut start = 0;
    while start < queries.len() {
        let seq = queries[start].seq;
        let mut end = start + 1;
        while end < queries.len() && end - start < ROWS_PER_TASK && queries[end].seq == seq {
            end += 1;
        }
        tasks.extend((0..num_kv_heads).map(|g| (start, end, g * group..(g + 1) * group)));
        start = end;
    }
    // Too few tasks to keep every thread busy (one decode row, few KV heads): one query head a
    // task, each walking the keys alone. Which heads share a walk never changes a query's bits.
    if tasks.len() < 2 * rayon::current_num_threads() {
        tasks = tasks
            .into_iter()
            .flat_map(|(start, end, heads)| heads.map(move |h| (start, end, h..h + 1)))
            .collect();
    }
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|(start, end, heads)| {
            let rows = Rows {
                first: *start,
                positions: &queries[*start..*end],
                heads: heads.clone(),
            };
            SCRATCH.with_borrow_mut(|scratch| attend(shape, layer, q, rows, kv, scratch))
        })
        .collect();
    // A row's heads of one task are contiguous in `out`.
    for ((start, end, heads), result) in tasks.iter().zip(&results) {
        let width = heads.len() * head_dim;
        for (i, row) in (*start..*end).enumerate() {
            let at = (row * num_heads + heads.start) * head_dim;
            out[at..at + width].copy_from_slice(&result[i * width..(i + 1) * width]);
        }
    }
}

/// One task's rows: consecutive entries of the step's queries, all of one sequence, and the query
/// heads it computes for them (all of one KV head).
struct Rows<'a> {
    /// Index of the first row in the step's queries (and in `q`).
    first: usize,
    positions: &'a [QueryPos],
    heads: std::ops::Range<usize>,
}

thread_local! {
    /// Kept across steps: a long context's scores are megabytes, and fresh pages cost more than
    /// the arithmetic that fills them.
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// Per-thread buffers: each query's scores (then weights) and maximum.
#[derive(Default)]
struct Scratch {
    scores: Vec<Vec<f32>>,
    max: Vec<f32>,
}

/// The outputs of `rows` × `rows.heads`, row-major then head.
fn attend(
    shape: AttentionShape,
    layer: usize,
    q: &[f32],
    rows: Rows<'_>,
    kv: &dyn KvAccess,
    scratch: &mut Scratch,
) -> Vec<f32> {
    let AttentionShape {
        num_heads,
        num_kv_heads,
        head_dim,
        sliding_window,
        scale,
    } = shape;
    let per_row = rows.heads.len();
    let seq = rows.positions[0].seq;
    let kv_dim = num_kv_heads * head_dim;
    let kv_off = rows.heads.start / (num_heads / num_kv_heads) * head_dim;
    // Each row's keys: first..=position.
    let ranges: Vec<(usize, usize)> = rows
        .positions
        .iter()
        .map(|r| {
            let first = sliding_window.map_or(0, |w| (r.position + 1).saturating_sub(w));
            (first, r.position)
        })
        .collect();
    let queries = ranges.len() * per_row;
    let query = |qi: usize| {
        let (r, h) = (qi / per_row, rows.heads.start + qi % per_row);
        let at = ((rows.first + r) * num_heads + h) * head_dim;
        &q[at..at + head_dim]
    };
    let Scratch { scores, max } = scratch;
    scores.resize_with(queries.max(scores.len()), Vec::new);
    scores.iter_mut().for_each(Vec::clear);
    max.clear();
    max.resize(queries, f32::NEG_INFINITY);

    // Scores: every run of keys once, to each query whose range holds part of it.
    walk(
        &ranges,
        (kv_dim, kv_off),
        |p| kv.key_run(seq, layer, p),
        |r, _, n, keys| {
            for qi in r * per_row..(r + 1) * per_row {
                let run_max = dot_rows(query(qi), keys, kv_dim, n, scale, &mut scores[qi]);
                max[qi] = max[qi].max(run_max);
            }
        },
    );
    for (s, &m) in scores.iter_mut().zip(max.iter()).take(queries) {
        let mut total = 0.0f32;
        for e in s.iter_mut() {
            *e = (*e - m).exp();
            total += *e;
        }
        // Each value's weight, `exp / sum`, once.
        s.iter_mut().for_each(|e| *e /= total);
    }

    // Values, in ascending position for every query.
    let mut out = vec![0.0f32; queries * head_dim];
    walk(
        &ranges,
        (kv_dim, kv_off),
        |p| kv.value_run(seq, layer, p),
        |r, at, n, values| {
            for qi in r * per_row..(r + 1) * per_row {
                let o = &mut out[qi * head_dim..(qi + 1) * head_dim];
                axpy_rows(o, &scores[qi][at..at + n], values, kv_dim);
            }
        },
    );
    out
}

/// Walks the positions every row's range (`first..=last`) covers in ascending order, a
/// contiguous run of `row_len`-value K or V rows at a time, and calls `each(r, at, n, rows)` for
/// each row `r` whose range holds part of the run: its `n` positions from `first + at`, `rows`
/// starting at the first one's values at `offset` (one KV head's).
fn walk<'a>(
    ranges: &[(usize, usize)],
    (row_len, offset): (usize, usize),
    run: impl Fn(usize) -> &'a [f32],
    mut each: impl FnMut(usize, usize, usize, &[f32]),
) {
    let lo = ranges.iter().map(|r| r.0).min().unwrap_or(0);
    let hi = ranges.iter().map(|r| r.1).max().unwrap_or(0);
    let mut p = lo;
    while p <= hi {
        let rows = run(p);
        let n = (rows.len() / row_len).min(hi + 1 - p);
        assert!(n > 0, "a K/V run holds at least one position");
        for (r, &(first, last)) in ranges.iter().enumerate() {
            let (from, to) = (first.max(p), last.min(p + n - 1));
            if from <= to {
                let at = (from - p) * row_len + offset;
                each(r, from - first, to + 1 - from, &rows[at..n * row_len]);
            }
        }
        p += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::ops::dot;

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

    /// A pool of `block` slots per block, blocks handed out in a shuffled order per sequence: runs
    /// end at every block boundary.
    struct Paged {
        k: Vec<f32>,
        v: Vec<f32>,
        dim: usize,
        block: usize,
        tables: Vec<Vec<usize>>,
    }

    impl Paged {
        fn at(&self, seq: usize, p: usize) -> usize {
            (self.tables[seq][p / self.block] * self.block + p % self.block) * self.dim
        }
        fn run_end(&self, seq: usize, p: usize) -> usize {
            self.at(seq, p) + (self.block - p % self.block) * self.dim
        }
    }

    impl KvAccess for Paged {
        fn key(&self, s: usize, _: usize, p: usize) -> &[f32] {
            &self.k[self.at(s, p)..self.at(s, p) + self.dim]
        }
        fn value(&self, s: usize, _: usize, p: usize) -> &[f32] {
            &self.v[self.at(s, p)..self.at(s, p) + self.dim]
        }
        fn key_run(&self, s: usize, _: usize, p: usize) -> &[f32] {
            &self.k[self.at(s, p)..self.run_end(s, p)]
        }
        fn value_run(&self, s: usize, _: usize, p: usize) -> &[f32] {
            &self.v[self.at(s, p)..self.run_end(s, p)]
        }
        fn write(&mut self, _: usize, _: usize, _: usize, _: &[f32], _: &[f32]) {}
    }

    /// The one-query loop the shared walk must reproduce bit for bit; `reversed` sums the values
    /// from the last key down (the canary: another order, other bits).
    fn one_query(
        shape: AttentionShape,
        q: &[f32],
        queries: &[QueryPos],
        kv: &dyn KvAccess,
        reversed: bool,
    ) -> Vec<f32> {
        let (hd, group) = (shape.head_dim, shape.num_heads / shape.num_kv_heads);
        let mut out = vec![0.0; queries.len() * shape.num_heads * hd];
        for (idx, o) in out.chunks_mut(hd).enumerate() {
            let QueryPos { seq, position } = queries[idx / shape.num_heads];
            let kv_off = (idx % shape.num_heads / group) * hd;
            let first = shape
                .sliding_window
                .map_or(0, |w| (position + 1).saturating_sub(w));
            let qh = &q[idx * hd..(idx + 1) * hd];
            let scores: Vec<f32> = (first..=position)
                .map(|p| dot(qh, &kv.key(seq, 0, p)[kv_off..kv_off + hd]) * shape.scale)
                .collect();
            let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum = exps.iter().fold(0.0f32, |a, &e| a + e);
            let mut order: Vec<usize> = (first..=position).collect();
            if reversed {
                order.reverse();
            }
            for p in order {
                let v = &kv.value(seq, 0, p)[kv_off..kv_off + hd];
                let w = exps[p - first] / sum;
                for (oi, vi) in o.iter_mut().zip(v) {
                    *oi += w * vi;
                }
            }
        }
        out
    }

    /// Head dim 40 takes the portable loops, 64 and 128 the vector runs of `runs.rs` (eight keys
    /// at a time once a block holds more than 7).
    #[test]
    fn shared_walk_equals_the_one_query_loop_bit_for_bit() {
        for (hd, block) in [(40, 7), (64, 7), (64, 19), (128, 19)] {
            shared_walk_case(hd, block);
        }
    }

    fn shared_walk_case(hd: usize, block: usize) {
        let mut state = 0x2545_f491_u32;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state % 2000) as f32 / 1000.0 - 1.0
        };
        let (kv_heads, blocks) = (2, 24);
        let dim = kv_heads * hd;
        let kv = Paged {
            k: (0..blocks * block * dim).map(|_| next()).collect(),
            v: (0..blocks * block * dim).map(|_| next()).collect(),
            dim,
            block,
            // Two sequences of up to 84 positions on interleaved, out-of-order blocks.
            tables: vec![
                (0..12).map(|b| (b * 7 + 3) % 24).collect(),
                (0..12).map(|b| (b * 7 + 10) % 24).collect(),
            ],
        };
        // Sequence 0: 21 consecutive rows (two tasks), then sequence 1: one decode row and a
        // verification run of 5, then sequence 0 again (not merged with the first run).
        let mut queries: Vec<QueryPos> = (40..61)
            .map(|p| QueryPos {
                seq: 0,
                position: p,
            })
            .collect();
        queries.push(QueryPos {
            seq: 1,
            position: 9,
        });
        queries.extend((70..75).map(|p| QueryPos {
            seq: 1,
            position: p,
        }));
        queries.push(QueryPos {
            seq: 0,
            position: 83,
        });
        for window in [None, Some(16)] {
            let shape = AttentionShape {
                num_heads: 6,
                num_kv_heads: kv_heads,
                head_dim: hd,
                sliding_window: window,
                scale: 0.158,
            };
            let q: Vec<f32> = (0..queries.len() * 6 * hd).map(|_| next()).collect();
            let mut out = vec![f32::NAN; q.len()];
            causal_attention(shape, 0, &q, &queries, &kv, &mut out);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&out),
                bits(&one_query(shape, &q, &queries, &kv, false)),
                "head dim {hd}, block {block}, window {window:?}"
            );
            // Each row alone gives its bits in the batch.
            for (i, row) in queries.iter().enumerate() {
                let mut alone = vec![0.0; 6 * hd];
                let qr = &q[i * 6 * hd..(i + 1) * 6 * hd];
                causal_attention(shape, 0, qr, &[*row], &kv, &mut alone);
                assert_eq!(bits(&alone), bits(&out[i * 6 * hd..(i + 1) * 6 * hd]));
            }
            let canary = one_query(shape, &q, &queries, &kv, true);
            assert_ne!(
                bits(&out),
                bits(&canary),
                "another summation order must change bits"
            );
        }
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
