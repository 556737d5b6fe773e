//! Device self-test of the paged attention kernels against an f64 CPU reference.
//!
//! Every case draws fresh seeded random inputs (never zeros), scatters each sequence's blocks
//! over a shuffled cache whose unused slots hold NaN (a read of the wrong block or past a context
//! shows up as NaN), poisons outputs and the decode workspace with NaN, and compares with an f64
//! softmax computed from the same bf16 values. Besides accuracy it checks the bit-identities the
//! kernels promise (see `attention.rs`): a decode row alone vs in a batch, prefill chunked vs
//! whole (both prefill variants), and the f32 prefill's row vs decode at the same position.
//! Canaries prove the comparisons fail.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

use crate::attention::{
    AttentionHeads, DECODE_SPLIT_TOKENS, DecodeBatch, PagedKv, PrefillChunk, PrefillVariant,
    decode_workspace_elems,
};
use crate::selftest::{
    Rng, download, poisoned_bf16, poisoned_f32, rel_err, round_bf16, to_f64, upload,
};
use crate::{CheckResult, KernelError, Kernels};

const DECODE: &str = "decode_attention";
const PREFILL: &str = "prefill_attention";
/// bf16 output against an f64 reference, relative to the reference's largest magnitude.
const TOLERANCE: f64 = 1e-2;
/// The tensor-core prefill against the f64 reference: ‖out − ref‖₂ / ‖ref‖₂. Each probability is
/// rounded to bf16 (relative error ≤ 2⁻⁹) before P·V while the normaliser sums the f32 values,
/// and the output is rounded to bf16 (≤ 2⁻⁹): independent roundings of that size give a relative
/// L2 error of a few 1e-3 (the CPU emulation in the tests measures 1.7e-3 to 2.4e-3 on these
/// shapes). A scale wrong by 1.25 moves the output by 6.5e-2 to 9.4e-2 on the same shapes, so
/// 1e-2 separates the two with a margin of 4 on either side.
const MMA_TOLERANCE: f64 = 1e-2;
/// Context lengths that are not multiples of the block or split size.
const LENS: [usize; 4] = [1, 15, DECODE_SPLIT_TOKENS + 1, 2000];

/// Runs every attention check.
pub(crate) fn checks(kernels: &Kernels, stream: &Arc<CudaStream>) -> Vec<CheckResult> {
    let mut results = Vec::new();
    let mut rng = Rng::new(0x5eed_a77e_4710_0001);
    for (d, n_q, n_kv, block_size, window) in [
        (128, 32, 8, 16, 0),
        (128, 28, 4, 32, 0),
        (64, 16, 2, 16, 100),
        (256, 8, 1, 16, 0),
        (128, 32, 2, 16, 700),
        (128, 24, 2, 32, 0),
        (128, 40, 2, 16, 0),
        (64, 32, 2, 16, 0),
        (64, 4, 4, 32, 0),
    ] {
        let heads = heads(n_q, n_kv, d, window);
        results.extend(decode_accuracy(
            kernels, stream, &mut rng, heads, block_size,
        ));
    }
    results.extend(decode_batch_invariance(kernels, stream, &mut rng));
    results.push(decode_guards(kernels, stream, &mut rng));
    for (d, n_q, n_kv, block_size, window, chunks) in [
        (128, 8, 2, 16, 0, &[200, 217, 143][..]),
        (64, 14, 2, 32, 100, &[90, 1, 209][..]),
        (256, 4, 1, 16, 0, &[64, 66][..]),
    ] {
        let heads = heads(n_q, n_kv, d, window);
        results.extend(prefill_checks(
            kernels, stream, &mut rng, heads, block_size, chunks,
        ));
    }
    for case in MMA_CASES {
        results.extend(mma_accuracy(kernels, stream, &mut rng, case));
    }
    for (d, n_q, n_kv, block_size, window) in [(128, 8, 2, 16, 0), (64, 8, 1, 16, 100)] {
        let heads = heads(n_q, n_kv, d, window);
        results.extend(mma_chunking(
            kernels,
            stream,
            &mut rng,
            heads,
            block_size,
            &[77, 123, 100],
        ));
    }
    results.push(mma_guard(kernels, stream, &mut rng));
    results
}

/// One tensor-core prefill accuracy case: a chunk of `n_new` tokens from position `start`.
#[derive(Debug, Clone, Copy)]
struct MmaCase {
    head_dim: usize,
    n_q_heads: usize,
    n_kv_heads: usize,
    block_size: usize,
    window: usize,
    start: usize,
    n_new: usize,
}

const fn mma_case(
    (head_dim, n_q_heads, n_kv_heads): (usize, usize, usize),
    block_size: usize,
    window: usize,
    start: usize,
    n_new: usize,
) -> MmaCase {
    MmaCase {
        head_dim,
        n_q_heads,
        n_kv_heads,
        block_size,
        window,
        start,
        n_new,
    }
}

/// Head dims 64 and 128, GQA ratios 1, 4 and 8, chunks from 0 and from positions that are not
/// multiples of 64, 1, 17 and 300 tokens, sliding windows, block sizes that do not divide 64.
const MMA_CASES: [MmaCase; 8] = [
    mma_case((128, 32, 8), 16, 0, 0, 300),
    mma_case((128, 8, 8), 16, 0, 100, 17),
    mma_case((128, 4, 1), 7, 0, 1000, 1),
    mma_case((64, 8, 1), 16, 0, 130, 300),
    mma_case((64, 16, 2), 32, 0, 0, 17),
    mma_case((64, 4, 4), 16, 0, 777, 1),
    mma_case((128, 16, 2), 16, 100, 70, 300),
    mma_case((64, 8, 2), 32, 50, 0, 300),
];

fn heads(n_q_heads: usize, n_kv_heads: usize, head_dim: usize, window: usize) -> AttentionHeads {
    AttentionHeads {
        n_q_heads,
        n_kv_heads,
        head_dim,
        window,
        scale: 1.0 / (head_dim as f32).sqrt(),
    }
}

fn describe(heads: &AttentionHeads, block_size: usize) -> String {
    format!(
        "d={} q_heads={} kv_heads={} block={} window={}",
        heads.head_dim, heads.n_q_heads, heads.n_kv_heads, block_size, heads.window
    )
}

/// Decode of sequences with [`LENS`] against the reference, plus a wrong-scale canary.
fn decode_accuracy(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    rng: &mut Rng,
    heads: AttentionHeads,
    block_size: usize,
) -> Vec<CheckResult> {
    let case = format!("{} lens={LENS:?}", describe(&heads, block_size));
    let cache = HostCache::new(rng, heads, block_size, &LENS);
    let q = random_bf16s(rng, LENS.len() * heads.n_q_heads * heads.head_dim);
    let seqs: Vec<usize> = (0..LENS.len()).collect();
    let out = match cache
        .upload(stream)
        .and_then(|dev| run_decode(kernels, stream, &cache, &dev, &seqs, &q, 2048))
    {
        Ok(out) => out,
        Err(e) => return vec![CheckResult::error(DECODE, case, false, e)],
    };
    let reference = |scale: f32| -> Vec<f64> {
        let row = heads.n_q_heads * heads.head_dim;
        (0..LENS.len())
            .flat_map(|s| cache.decode_reference(s, &q[s * row..(s + 1) * row], scale))
            .collect()
    };
    let (err, written, detail) = compare(&out, &reference(heads.scale));
    let (canary_err, canary_written, canary_detail) = compare(&out, &reference(heads.scale * 1.25));
    vec![
        CheckResult::compare(DECODE, case.clone(), false, err, TOLERANCE, written, detail),
        CheckResult::compare(
            DECODE,
            format!("{case} reference scale x1.25"),
            true,
            canary_err,
            TOLERANCE,
            canary_written,
            canary_detail,
        ),
    ]
}

/// A sequence decoded alone (small grid) and inside a batch of 8 (large grid): bitwise equal.
fn decode_batch_invariance(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Vec<CheckResult> {
    let heads = heads(32, 8, 128, 0);
    let lens = [700, 1, 15, 513, 2000, 37, 1024, 129];
    let case = format!("{} batch of 8 lens={lens:?}", describe(&heads, 16));
    let cache = HostCache::new(rng, heads, 16, &lens);
    let row = heads.n_q_heads * heads.head_dim;
    let q = random_bf16s(rng, lens.len() * row);
    let all: Vec<usize> = (0..lens.len()).collect();
    let runs = cache.upload(stream).and_then(|dev| {
        let batch = run_decode(kernels, stream, &cache, &dev, &all, &q, 4096)?;
        let alone0 = run_decode(kernels, stream, &cache, &dev, &[0], &q[..row], 700)?;
        let alone4 = run_decode(
            kernels,
            stream,
            &cache,
            &dev,
            &[4],
            &q[4 * row..5 * row],
            2000,
        )?;
        Ok((batch, alone0, alone4))
    });
    let (batch, alone0, alone4) = match runs {
        Ok(runs) => runs,
        Err(e) => return vec![CheckResult::error(DECODE, case, false, e)],
    };
    let reference: Vec<f64> = (0..lens.len())
        .flat_map(|s| cache.decode_reference(s, &q[s * row..(s + 1) * row], heads.scale))
        .collect();
    let (err, written, detail) = compare(&batch, &reference);
    vec![
        CheckResult::compare(DECODE, case.clone(), false, err, TOLERANCE, written, detail),
        bitwise(
            DECODE,
            format!("{case}: seq len 700 alone vs in batch"),
            false,
            &alone0,
            &batch[..row],
        ),
        bitwise(
            DECODE,
            format!("{case}: seq len 2000 alone vs in batch"),
            false,
            &alone4,
            &batch[4 * row..5 * row],
        ),
        bitwise(
            DECODE,
            format!("{case}: seq len 700 alone vs seq len 1 in batch (canary)"),
            true,
            &alone0,
            &batch[row..2 * row],
        ),
    ]
}

/// Device-side data the launcher cannot see: a block-table entry past `num_blocks`, a zero
/// length and a length beyond the table must give NaN rows, leaving the others correct.
fn decode_guards(kernels: &Kernels, stream: &Arc<CudaStream>, rng: &mut Rng) -> CheckResult {
    let heads = heads(8, 2, 128, 0);
    let case = format!(
        "{} guards: bad table entry, len 0, len 3000 > table",
        describe(&heads, 16)
    );
    let mut cache = HostCache::new(rng, heads, 16, &[40, 40, 40, 40]);
    cache.tables[1][1] = cache.num_blocks as u32;
    cache.lens[2] = 0;
    cache.lens[3] = 3000;
    let row = heads.n_q_heads * heads.head_dim;
    let q = random_bf16s(rng, 4 * row);
    let out = match cache
        .upload(stream)
        .and_then(|dev| run_decode(kernels, stream, &cache, &dev, &[0, 1, 2, 3], &q, 2048))
    {
        Ok(out) => out,
        Err(e) => return CheckResult::error(DECODE, case, false, e),
    };
    let (err, written, _) = compare(
        &out[..row],
        &cache.decode_reference(0, &q[..row], heads.scale),
    );
    let nan_rows = (1..4)
        .filter(|s| out[s * row..(s + 1) * row].iter().all(|x| x.is_nan()))
        .count();
    // The measure: the good row's error, or infinity when a guarded row is not all NaN.
    let measure = if nan_rows == 3 { err } else { f64::INFINITY };
    CheckResult::compare(
        DECODE,
        case,
        false,
        measure,
        TOLERANCE,
        written,
        format!("good row error {err:e}; {nan_rows} of 3 guarded rows all NaN"),
    )
}

/// The f32 prefill: whole vs reference, chunked vs whole (bitwise), last row vs decode (bitwise).
fn prefill_checks(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    rng: &mut Rng,
    heads: AttentionHeads,
    block_size: usize,
    chunks: &[usize],
) -> Vec<CheckResult> {
    let total: usize = chunks.iter().sum();
    let case = format!(
        "f32 {} tokens={total} chunks={chunks:?}",
        describe(&heads, block_size)
    );
    let cache = HostCache::new(rng, heads, block_size, &[total]);
    let row = heads.n_q_heads * heads.head_dim;
    let q = random_bf16s(rng, total * row);
    let f32 = PrefillVariant::F32;
    let runs = cache.upload(stream).and_then(|dev| {
        let whole = run_prefill(kernels, f32, stream, &cache, &dev, &q, 0, &[total])?;
        let chunked = run_prefill(kernels, f32, stream, &cache, &dev, &q, 0, chunks)?;
        let last = &q[(total - 1) * row..];
        let decode = run_decode(kernels, stream, &cache, &dev, &[0], last, total)?;
        Ok((whole, chunked, decode))
    });
    let (whole, chunked, decode) = match runs {
        Ok(runs) => runs,
        Err(e) => return vec![CheckResult::error(PREFILL, case, false, e)],
    };
    let reference: Vec<f64> = (0..total)
        .flat_map(|t| cache.reference(0, t, &q[t * row..(t + 1) * row], heads.scale))
        .collect();
    let (err, written, detail) = compare(&whole, &reference);
    let wrong: Vec<f64> = (0..total)
        .flat_map(|t| cache.reference(0, t, &q[t * row..(t + 1) * row], heads.scale * 1.25))
        .collect();
    let (canary_err, canary_written, canary_detail) = compare(&whole, &wrong);
    vec![
        CheckResult::compare(
            PREFILL,
            case.clone(),
            false,
            err,
            TOLERANCE,
            written,
            detail,
        ),
        CheckResult::compare(
            PREFILL,
            format!("{case} reference scale x1.25"),
            true,
            canary_err,
            TOLERANCE,
            canary_written,
            canary_detail,
        ),
        bitwise(
            PREFILL,
            format!("{case}: chunked vs whole"),
            false,
            &chunked,
            &whole,
        ),
        bitwise(
            PREFILL,
            format!("{case}: last row vs decode at len {total}"),
            false,
            &whole[(total - 1) * row..],
            &decode,
        ),
        bitwise(
            PREFILL,
            format!("{case}: second-to-last row vs decode at len {total} (canary)"),
            true,
            &whole[(total - 2) * row..(total - 1) * row],
            &decode,
        ),
    ]
}

/// The tensor-core prefill of one chunk against the f64 reference, plus a wrong-scale canary.
fn mma_accuracy(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    rng: &mut Rng,
    case: MmaCase,
) -> Vec<CheckResult> {
    let heads = heads(case.n_q_heads, case.n_kv_heads, case.head_dim, case.window);
    let (start, n_new) = (case.start, case.n_new);
    let name = format!(
        "mma {} start={start} n_new={n_new}",
        describe(&heads, case.block_size)
    );
    let cache = HostCache::new(rng, heads, case.block_size, &[start + n_new]);
    let row = heads.n_q_heads * heads.head_dim;
    let q = random_bf16s(rng, n_new * row);
    let mma = PrefillVariant::Mma;
    let out = match cache
        .upload(stream)
        .and_then(|dev| run_prefill(kernels, mma, stream, &cache, &dev, &q, start, &[n_new]))
    {
        Ok(out) => out,
        Err(e) => return vec![CheckResult::error(PREFILL, name, false, e)],
    };
    let reference = |scale: f32| cache.chunk_reference(start, &q, scale);
    let (err, written, detail) = compare_l2(&out, &reference(heads.scale));
    let (canary_err, canary_written, canary_detail) =
        compare_l2(&out, &reference(heads.scale * 1.25));
    vec![
        CheckResult::compare(
            PREFILL,
            name.clone(),
            false,
            err,
            MMA_TOLERANCE,
            written,
            detail,
        ),
        CheckResult::compare(
            PREFILL,
            format!("{name} reference scale x1.25"),
            true,
            canary_err,
            MMA_TOLERANCE,
            canary_written,
            canary_detail,
        ),
    ]
}

/// The tensor-core prefill of one prompt as a whole and in `chunks` (which do not start at
/// multiples of 64): bitwise equal, and the whole against the reference.
fn mma_chunking(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    rng: &mut Rng,
    heads: AttentionHeads,
    block_size: usize,
    chunks: &[usize],
) -> Vec<CheckResult> {
    let total: usize = chunks.iter().sum();
    let case = format!(
        "mma {} tokens={total} chunks={chunks:?}",
        describe(&heads, block_size)
    );
    let cache = HostCache::new(rng, heads, block_size, &[total]);
    let row = heads.n_q_heads * heads.head_dim;
    let q = random_bf16s(rng, total * row);
    let mma = PrefillVariant::Mma;
    let runs = cache.upload(stream).and_then(|dev| {
        let whole = run_prefill(kernels, mma, stream, &cache, &dev, &q, 0, &[total])?;
        let chunked = run_prefill(kernels, mma, stream, &cache, &dev, &q, 0, chunks)?;
        Ok((whole, chunked))
    });
    let (whole, chunked) = match runs {
        Ok(runs) => runs,
        Err(e) => return vec![CheckResult::error(PREFILL, case, false, e)],
    };
    let (err, written, detail) = compare_l2(&whole, &cache.chunk_reference(0, &q, heads.scale));
    vec![
        CheckResult::compare(
            PREFILL,
            case.clone(),
            false,
            err,
            MMA_TOLERANCE,
            written,
            detail,
        ),
        bitwise(
            PREFILL,
            format!("{case}: chunked vs whole"),
            false,
            &chunked,
            &whole,
        ),
        bitwise(
            PREFILL,
            format!("{case}: chunked vs whole shifted by one token (canary)"),
            true,
            &chunked[row..],
            &whole[..(total - 1) * row],
        ),
    ]
}

/// A block-table entry past `num_blocks` (positions 16..32) must give NaN for the query tile
/// that reads it (tokens 0..64) and leave the tile that the window keeps away from it correct.
fn mma_guard(kernels: &Kernels, stream: &Arc<CudaStream>, rng: &mut Rng) -> CheckResult {
    let heads = heads(8, 2, 128, 16);
    let total = 100;
    let case = format!(
        "mma {} tokens={total} guard: bad table entry for positions 16..32",
        describe(&heads, 16)
    );
    let mut cache = HostCache::new(rng, heads, 16, &[total]);
    cache.tables[0][1] = cache.num_blocks as u32;
    let row = heads.n_q_heads * heads.head_dim;
    let q = random_bf16s(rng, total * row);
    let run = cache.upload(stream).and_then(|dev| {
        run_prefill(
            kernels,
            PrefillVariant::Mma,
            stream,
            &cache,
            &dev,
            &q,
            0,
            &[total],
        )
    });
    let out = match run {
        Ok(out) => out,
        Err(e) => return CheckResult::error(PREFILL, case, false, e),
    };
    // The reference never reads the bad entry: rows 64.. see positions 49.. only.
    let good: Vec<f64> = (64..total)
        .flat_map(|t| cache.reference(0, t, &q[t * row..(t + 1) * row], heads.scale))
        .collect();
    let (err, written, _) = compare_l2(&out[64 * row..], &good);
    let guarded = out[..64 * row].iter().all(|x| x.is_nan());
    let measure = if guarded { err } else { f64::INFINITY };
    CheckResult::compare(
        PREFILL,
        case,
        false,
        measure,
        MMA_TOLERANCE,
        written,
        format!("good rows error {err:e}; guarded rows all NaN: {guarded}"),
    )
}

/// A paged KV cache on the host: sequences' blocks scattered over a shuffled pool; every slot
/// that holds no sequence position is NaN.
struct HostCache {
    heads: AttentionHeads,
    block_size: usize,
    num_blocks: usize,
    lens: Vec<usize>,
    tables: Vec<Vec<u32>>,
    k: Vec<bf16>,
    v: Vec<bf16>,
}

/// The cache on the device.
struct DeviceCache {
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
}

impl HostCache {
    fn new(rng: &mut Rng, heads: AttentionHeads, block_size: usize, lens: &[usize]) -> HostCache {
        let needed: usize = lens.iter().map(|l| l.div_ceil(block_size).max(1)).sum();
        let num_blocks = needed + 5; // spare NaN blocks no table points at
        let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
        shuffle(rng, &mut pool);
        let mut next = pool.into_iter();
        let tables: Vec<Vec<u32>> = lens
            .iter()
            .map(|l| next.by_ref().take(l.div_ceil(block_size).max(1)).collect())
            .collect();
        let slot = heads.n_kv_heads * heads.head_dim;
        let mut k = vec![bf16::NAN; num_blocks * block_size * slot];
        let mut v = k.clone();
        for (table, &len) in tables.iter().zip(lens) {
            for pos in 0..len {
                let at = (table[pos / block_size] as usize * block_size + pos % block_size) * slot;
                for i in at..at + slot {
                    k[i] = rng.bf16(1.0, 0.0);
                    v[i] = rng.bf16(1.0, 0.0);
                }
            }
        }
        HostCache {
            heads,
            block_size,
            num_blocks,
            lens: lens.to_vec(),
            tables,
            k,
            v,
        }
    }

    fn upload(&self, stream: &Arc<CudaStream>) -> Result<DeviceCache, KernelError> {
        Ok(DeviceCache {
            k: upload(stream, &self.k)?,
            v: upload(stream, &self.v)?,
        })
    }

    fn view<'a>(&self, dev: &'a DeviceCache) -> PagedKv<'a> {
        PagedKv {
            k: dev.k.as_view(),
            v: dev.v.as_view(),
            block_size: self.block_size,
            num_blocks: self.num_blocks,
        }
    }

    /// K or V of sequence `seq` at `pos` for kv head `kvh`, as f64.
    fn row(&self, cache: &[bf16], seq: usize, pos: usize, kvh: usize) -> Vec<f64> {
        let d = self.heads.head_dim;
        let phys = self.tables[seq][pos / self.block_size] as usize;
        let at =
            ((phys * self.block_size + pos % self.block_size) * self.heads.n_kv_heads + kvh) * d;
        cache[at..at + d].iter().map(|x| x.to_f64()).collect()
    }

    /// Exact attention output of the query token at `pos` of `seq` (`q`: all its heads).
    fn reference(&self, seq: usize, pos: usize, q: &[bf16], scale: f32) -> Vec<f64> {
        self.reference_rounding(seq, pos, q, scale, false)
    }

    /// [`HostCache::reference`]; with `bf16_p`, the tensor-core kernel's roundings: each weight
    /// rounded to bf16 in P·V (not in the normaliser) and the output rounded to bf16.
    fn reference_rounding(
        &self,
        seq: usize,
        pos: usize,
        q: &[bf16],
        scale: f32,
        bf16_p: bool,
    ) -> Vec<f64> {
        let round = |x: f64| if bf16_p { round_bf16(x) } else { x };
        let d = self.heads.head_dim;
        let group = self.heads.n_q_heads / self.heads.n_kv_heads;
        let lo = match self.heads.window {
            0 => 0,
            w => (pos + 1).saturating_sub(w),
        };
        let mut out = Vec::with_capacity(q.len());
        for h in 0..self.heads.n_q_heads {
            let kvh = h / group;
            let qh: Vec<f64> = q[h * d..(h + 1) * d].iter().map(|x| x.to_f64()).collect();
            let scores: Vec<f64> = (lo..=pos)
                .map(|t| {
                    let k = self.row(&self.k, seq, t, kvh);
                    qh.iter().zip(&k).map(|(a, b)| a * b).sum::<f64>() * f64::from(scale)
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            let mut acc = vec![0.0; d];
            for (t, w) in (lo..=pos).zip(&weights) {
                let w = round(*w);
                for (a, x) in acc.iter_mut().zip(self.row(&self.v, seq, t, kvh)) {
                    *a += w * x;
                }
            }
            out.extend(acc.iter().map(|a| round(a / total)));
        }
        out
    }

    /// The reference for decoding `seq`'s last position.
    fn decode_reference(&self, seq: usize, q: &[bf16], scale: f32) -> Vec<f64> {
        self.reference(seq, self.lens[seq] - 1, q, scale)
    }

    /// The reference for sequence 0's tokens from position `start`, `q` holding all their heads.
    fn chunk_reference(&self, start: usize, q: &[bf16], scale: f32) -> Vec<f64> {
        let row = self.heads.n_q_heads * self.heads.head_dim;
        q.chunks(row)
            .enumerate()
            .flat_map(|(i, qt)| self.reference(0, start + i, qt, scale))
            .collect()
    }
}

/// Decodes sequences `seqs` of `cache` (queries `q`, one token each) with `max_context`.
fn run_decode(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    cache: &HostCache,
    dev: &DeviceCache,
    seqs: &[usize],
    q: &[bf16],
    max_context: usize,
) -> Result<Vec<bf16>, KernelError> {
    let heads = &cache.heads;
    let max_blocks = seqs
        .iter()
        .map(|&s| cache.tables[s].len())
        .max()
        .unwrap_or(1);
    // Table padding is never read: positions stay below each sequence's length.
    let mut tables = vec![u32::MAX; seqs.len() * max_blocks];
    for (i, &s) in seqs.iter().enumerate() {
        tables[i * max_blocks..i * max_blocks + cache.tables[s].len()]
            .copy_from_slice(&cache.tables[s]);
    }
    let lens: Vec<u32> = seqs.iter().map(|&s| cache.lens[s] as u32).collect();
    let q_dev = upload(stream, q)?;
    let tables_dev = upload(stream, &tables)?;
    let lens_dev = upload(stream, &lens)?;
    let ws_len = decode_workspace_elems(seqs.len(), heads.n_q_heads, heads.head_dim, max_context);
    let mut workspace = poisoned_f32(stream, ws_len)?;
    let mut out = poisoned_bf16(stream, q.len())?;
    let batch = DecodeBatch {
        q: q_dev.as_view(),
        block_tables: tables_dev.as_view(),
        max_blocks_per_seq: max_blocks,
        context_lens: lens_dev.as_view(),
        max_context,
    };
    kernels.decode_attention(
        stream,
        heads,
        &cache.view(dev),
        &batch,
        &mut workspace.as_view_mut(),
        &mut out.as_view_mut(),
    )?;
    download(stream, &out)
}

/// Prefills sequence 0 of `cache` from position `first` in consecutive chunks of the given
/// sizes; `q` holds the queries of positions `first ..`.
#[allow(clippy::too_many_arguments)]
fn run_prefill(
    kernels: &Kernels,
    variant: PrefillVariant,
    stream: &Arc<CudaStream>,
    cache: &HostCache,
    dev: &DeviceCache,
    q: &[bf16],
    first: usize,
    chunks: &[usize],
) -> Result<Vec<bf16>, KernelError> {
    let heads = &cache.heads;
    let row = heads.n_q_heads * heads.head_dim;
    let q_dev = upload(stream, q)?;
    let table_dev = upload(stream, &cache.tables[0])?;
    let mut out = poisoned_bf16(stream, q.len())?;
    let mut at = 0;
    for &n_new in chunks {
        let chunk = PrefillChunk {
            q: q_dev.slice(at * row..(at + n_new) * row),
            block_table: table_dev.as_view(),
            start: first + at,
            n_new,
        };
        let mut out_view = out.slice_mut(at * row..(at + n_new) * row);
        kernels.prefill_attention_with(
            variant,
            stream,
            heads,
            &cache.view(dev),
            &chunk,
            &mut out_view,
        )?;
        at += n_new;
    }
    download(stream, &out)
}

/// (max |out − ref| / max |ref|, no NaN left in `out`, where the worst element is).
fn compare(out: &[bf16], reference: &[f64]) -> (f64, bool, String) {
    let scale = reference
        .iter()
        .fold(0.0f64, |m, r| m.max(r.abs()))
        .max(1e-30);
    let mut worst = (0.0f64, 0usize);
    let mut unwritten = 0usize;
    for (i, (o, r)) in out.iter().zip(reference).enumerate() {
        let o = o.to_f64();
        if o.is_nan() {
            unwritten += 1;
        }
        let err = if o.is_nan() {
            f64::INFINITY
        } else {
            (o - r).abs() / scale
        };
        if err > worst.0 {
            worst = (err, i);
        }
    }
    let (err, at) = worst;
    let detail = format!(
        "worst element {at}: out {} ref {:.6}; {unwritten} NaN of {}",
        out.get(at).map_or(f64::NAN, |x| x.to_f64()),
        reference.get(at).copied().unwrap_or(f64::NAN),
        out.len()
    );
    (err, unwritten == 0 && out.len() == reference.len(), detail)
}

/// (‖out − ref‖₂ / ‖ref‖₂, no NaN left in `out`, the max-norm error for the detail).
fn compare_l2(out: &[bf16], reference: &[f64]) -> (f64, bool, String) {
    let err = rel_err(&to_f64(out), reference);
    let (max_err, written, detail) = compare(out, reference);
    (
        err,
        written,
        format!("max-norm error {max_err:e}, {detail}"),
    )
}

/// A bit-identity check: `ok` when `a` and `b` hold the same bits (differing, for a canary).
fn bitwise(kernel: &str, case: String, canary: bool, a: &[bf16], b: &[bf16]) -> CheckResult {
    let mismatches = a
        .iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
        + a.len().abs_diff(b.len());
    let max_diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x.to_f64() - y.to_f64()).abs())
        .fold(
            0.0f64,
            |m, d| if d.is_nan() { f64::INFINITY } else { m.max(d) },
        );
    let written = !a.iter().chain(b).any(|x| x.is_nan());
    // Any mismatch, however small, fails: the measure is the mismatch count.
    CheckResult::compare(
        kernel,
        case,
        canary,
        mismatches as f64,
        0.0,
        written,
        format!(
            "{mismatches} of {} elements differ bitwise, max |diff| {max_diff:e}",
            a.len()
        ),
    )
}

/// `n` bf16 uniform in ±[0.01, 1): never zero.
fn random_bf16s(rng: &mut Rng, n: usize) -> Vec<bf16> {
    rng.bf16_vec(n, 1.0, 0.0)
}

/// Fisher–Yates.
fn shuffle<T>(rng: &mut Rng, items: &mut [T]) {
    for i in (1..items.len()).rev() {
        items.swap(i, rng.below(i + 1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_of_one_key_is_its_value() {
        let mut rng = Rng::new(7);
        let heads = heads(4, 2, 64, 0);
        let cache = HostCache::new(&mut rng, heads, 16, &[1]);
        let q = random_bf16s(&mut rng, 4 * 64);
        let out = cache.reference(0, 0, &q, heads.scale);
        let v = cache.row(&cache.v, 0, 0, 1);
        assert_eq!(&out[2 * 64..3 * 64], &v[..]);
    }

    #[test]
    fn window_limits_the_keys() {
        let mut rng = Rng::new(9);
        let windowed = heads(2, 1, 64, 1);
        let cache = HostCache::new(&mut rng, windowed, 16, &[40]);
        let q = random_bf16s(&mut rng, 2 * 64);
        // A window of 1 sees only the query's own position.
        let out = cache.reference(0, 39, &q, windowed.scale);
        assert_eq!(&out[..64], &cache.row(&cache.v, 0, 39, 0)[..]);
    }

    #[test]
    fn cache_scatters_blocks_and_poisons_the_rest() {
        let mut rng = Rng::new(11);
        let cache = HostCache::new(&mut rng, heads(2, 1, 64, 0), 16, &[17, 3]);
        let mut used: Vec<u32> = cache.tables.concat();
        assert_eq!(used.len(), 3);
        used.sort_unstable();
        used.dedup();
        assert_eq!(used.len(), 3, "no block is shared");
        let nan = cache.k.iter().filter(|x| x.is_nan()).count();
        assert_eq!(nan, cache.k.len() - 20 * 64);
    }

    #[test]
    fn mma_tolerance_separates_bf16_rounding_from_a_wrong_scale() {
        // Per tensor-core case (two q heads of one kv head: GQA does not change a row's
        // numerics), the emulated kernel roundings stay well under the tolerance and the canary's
        // wrong scale well over it.
        let mut rng = Rng::new(0x7e45_0c0e);
        for case in MMA_CASES {
            let heads = heads(2, 1, case.head_dim, case.window);
            let cache =
                HostCache::new(&mut rng, heads, case.block_size, &[case.start + case.n_new]);
            let q = random_bf16s(&mut rng, case.n_new * 2 * case.head_dim);
            let exact = cache.chunk_reference(case.start, &q, heads.scale);
            let emulated: Vec<f64> = q
                .chunks(2 * case.head_dim)
                .enumerate()
                .flat_map(|(i, qt)| {
                    cache.reference_rounding(0, case.start + i, qt, heads.scale, true)
                })
                .collect();
            let wrong = cache.chunk_reference(case.start, &q, heads.scale * 1.25);
            let rounding = rel_err(&emulated, &exact);
            let canary = rel_err(&wrong, &exact);
            eprintln!("{case:?}: bf16 roundings {rounding:e}, scale x1.25 {canary:e}");
            assert!(rounding <= MMA_TOLERANCE / 3.0, "{case:?}: {rounding:e}");
            assert!(canary >= 2.0 * MMA_TOLERANCE, "{case:?}: {canary:e}");
        }
    }

    #[test]
    fn compare_flags_nan_and_error() {
        let out = [bf16::from_f32(1.0), bf16::NAN];
        let (err, written, _) = compare(&out, &[1.0, 2.0]);
        assert!(err.is_infinite() && !written);
        let (err, written, _) = compare(&[bf16::from_f32(1.0)], &[1.01]);
        assert!(written && err > 0.009 && err < 0.011);
    }
}
