//! Timing on the device: the decode GEMV's achieved bandwidth against the bytes it must move (and
//! the pinned cuBLASLt GEMM's on the same shapes), and prefill attention's achieved FLOP rate,
//! each variant in the same run.
//!
//! GEMV weights are random (never zeros: they can run faster than real data) and rotate over
//! enough copies to exceed the L2 cache, so every launch streams its weights from device memory.
//! Times come from CUDA events around batches of launches after a warm-up; the median batch is
//! reported.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

use crate::gemm::{GemmOut, LtGemm};
use crate::selftest::{Rng, upload};
use crate::selftest_blocks::random_blocks;
use crate::{
    AttentionHeads, BlockFormat, GemvVariant, KernelError, Kernels, PagedKv, PrefillChunk,
    PrefillVariant,
};

/// One timed shape.
#[derive(Debug, Clone)]
pub struct GemvTiming {
    pub variant: GemvVariant,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub f32_out: bool,
    /// Median time per launch, microseconds.
    pub micros: f64,
    /// Bytes that must move per launch (W, x, y) over the median time, GB/s.
    pub gbytes_per_s: f64,
}

/// Bytes of weights the rotation must cover to defeat the L2 cache (H200: 50 MB of L2).
const ROTATION_BYTES: usize = 256 << 20;
const BATCH: usize = 20;
const BATCHES: usize = 15;

/// Random values tiled to fill the weights: random enough for timing, cheap to make.
const PATTERN: usize = 1 << 20;

/// Times the GEMV for each `(m, n, k, f32_out)` with each variant, in the same run, handing
/// each timing to `report` as soon as it is measured.
pub fn gemv_timings(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    shapes: &[(usize, usize, usize, bool)],
    variants: &[GemvVariant],
    report: &mut dyn FnMut(&GemvTiming),
) -> Result<Vec<GemvTiming>, KernelError> {
    let mut rng = Rng::new(0xbe4c);
    let pattern = rng.bf16_vec(PATTERN + 1, 1.0, 0.0);
    let mut out = Vec::new();
    let mut cache: HashMap<(usize, usize), Vec<CudaSlice<bf16>>> = HashMap::new();
    for (&(m, n, k, f32_out), &variant) in shapes
        .iter()
        .flat_map(|s| variants.iter().map(move |v| (s, v)))
    {
        let weights = match cache.entry((n, k)) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(rotated_copies(stream, &pattern, n * k)?),
        };
        let copies = weights.len();
        let x = upload(stream, &rng.bf16_vec(m * k, 1.0, 0.0))?;
        let mut y16 = stream.alloc_zeros::<bf16>(m * n)?;
        let mut y32 = stream.alloc_zeros::<f32>(m * n)?;
        let mut launch = |i: usize| -> Result<(), KernelError> {
            let w = &weights[i % copies];
            if f32_out {
                kernels.gemv_with(variant, stream, &mut y32, &x, w, (m, n, k))
            } else {
                kernels.gemv_with(variant, stream, &mut y16, &x, w, (m, n, k))
            }
        };
        let micros = median_micros(stream, &mut launch)?;
        let bytes = (n * k + m * k) * 2 + m * n * if f32_out { 4 } else { 2 };
        let timing = GemvTiming {
            variant,
            m,
            n,
            k,
            f32_out,
            micros,
            gbytes_per_s: bytes as f64 / (micros * 1e-6) / 1e9,
        };
        report(&timing);
        out.push(timing);
    }
    Ok(out)
}

/// One timed block-format GEMV shape: [`Kernels::gemv_blocks`] over random blocks.
#[derive(Debug, Clone)]
pub struct BlockGemvTiming {
    pub format: BlockFormat,
    pub variant: GemvVariant,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Median time per launch, microseconds.
    pub micros: f64,
    /// Bytes that must move per launch (the blocks, x, bf16 y) over the median time, GB/s.
    pub gbytes_per_s: f64,
}

/// Times the block-format GEMV (bf16 out) for each format, `(m, n, k)` and variant, like
/// [`gemv_timings`] (weights rotated past the L2 cache, batches, median), handing each timing to
/// `report`.
pub fn gemv_block_timings(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    formats: &[BlockFormat],
    shapes: &[(usize, usize, usize)],
    variants: &[GemvVariant],
    report: &mut dyn FnMut(&BlockGemvTiming),
) -> Result<Vec<BlockGemvTiming>, KernelError> {
    let mut rng = Rng::new(0xb10c);
    let mut out = Vec::new();
    for &format in formats {
        let mut cache: HashMap<(usize, usize), Vec<CudaSlice<u8>>> = HashMap::new();
        for &(m, n, k) in shapes {
            let weights = match cache.entry((n, k)) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => {
                    let host = format.to_device(&random_blocks(&mut rng, format, n, k));
                    let copies = ROTATION_BYTES.div_ceil(host.len()).clamp(2, 16);
                    let copies: Result<Vec<_>, _> =
                        (0..copies).map(|_| upload(stream, &host)).collect();
                    e.insert(copies?)
                }
            };
            let copies = weights.len();
            let x = upload(stream, &rng.bf16_vec(m * k, 1.0, 0.0))?;
            let mut y = stream.alloc_zeros::<bf16>(m * n)?;
            for &variant in variants {
                let mut launch = |i: usize| -> Result<(), KernelError> {
                    let w = &weights[i % copies];
                    kernels.gemv_blocks(variant, stream, &mut y, &x, w, format, (m, n, k))
                };
                let micros = median_micros(stream, &mut launch)?;
                let bytes = n * format.row_bytes(k) + (m * k + m * n) * 2;
                let timing = BlockGemvTiming {
                    format,
                    variant,
                    m,
                    n,
                    k,
                    micros,
                    gbytes_per_s: bytes as f64 / (micros * 1e-6) / 1e9,
                };
                report(&timing);
                out.push(timing);
            }
        }
    }
    Ok(out)
}

/// One timed cuBLASLt GEMM shape, through the algorithm [`LtGemm`] pins per weight shape (the one
/// prompt rows use; its rows are the same bits for every M, `check_gemm`).
#[derive(Debug, Clone)]
pub struct GemmTiming {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub f32_out: bool,
    /// Median time per launch, microseconds.
    pub micros: f64,
    /// Bytes that must move per launch (W, x, y) over the median time, GB/s.
    pub gbytes_per_s: f64,
}

/// Times the pinned cuBLASLt GEMM for each `(m, n, k, f32_out)`, like [`gemv_timings`] (the same
/// weight rotation, batches and median), handing each timing to `report`.
pub fn gemm_timings(
    stream: &Arc<CudaStream>,
    shapes: &[(usize, usize, usize, bool)],
    report: &mut dyn FnMut(&GemmTiming),
) -> Result<Vec<GemmTiming>, KernelError> {
    let mut gemm = LtGemm::new(stream)?;
    let mut rng = Rng::new(0xbe4d);
    let pattern = rng.bf16_vec(PATTERN + 1, 1.0, 0.0);
    let mut out = Vec::new();
    let mut cache: HashMap<(usize, usize), Vec<CudaSlice<bf16>>> = HashMap::new();
    for &(m, n, k, f32_out) in shapes {
        let weights = match cache.entry((n, k)) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(rotated_copies(stream, &pattern, n * k)?),
        };
        let copies = weights.len();
        let x = upload(stream, &rng.bf16_vec(m * k, 1.0, 0.0))?;
        let mut y16 = stream.alloc_zeros::<bf16>(m * n)?;
        let mut y32 = stream.alloc_zeros::<f32>(m * n)?;
        let micros = median_micros(stream, |i| {
            let w = &weights[i % copies];
            if f32_out {
                gemm.matmul(&mut y32, &x, w, m, n, k, GemmOut::F32)
            } else {
                gemm.matmul(&mut y16, &x, w, m, n, k, GemmOut::Bf16)
            }
        })?;
        let bytes = (n * k + m * k) * 2 + m * n * if f32_out { 4 } else { 2 };
        let timing = GemmTiming {
            m,
            n,
            k,
            f32_out,
            micros,
            gbytes_per_s: bytes as f64 / (micros * 1e-6) / 1e9,
        };
        report(&timing);
        out.push(timing);
    }
    Ok(out)
}

/// One timed shape of the run-order GEMM ([`Kernels::gemm_runs`], bf16 out) or of the pinned
/// cuBLASLt GEMM beside it (`kernel` says which).
#[derive(Debug, Clone)]
pub struct RunsTiming {
    pub kernel: &'static str,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Median time per launch, microseconds.
    pub micros: f64,
    /// Bytes that must move per launch (W, x, y) over the median time, GB/s.
    pub gbytes_per_s: f64,
    /// 2·m·n·k over the median time, TFLOP/s.
    pub tflops: f64,
}

/// Times, for each `(m, n, k)`, the run-order GEMM in both phase counts and the pinned cuBLASLt
/// GEMM, bf16 out, with the weight rotation and median of [`gemv_timings`]: what a step whose
/// decode and prompt rows share one weight read costs against the prompt rows' kernel today.
pub fn runs_gemm_timings(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    shapes: &[(usize, usize, usize)],
    report: &mut dyn FnMut(&RunsTiming),
) -> Result<Vec<RunsTiming>, KernelError> {
    let mut gemm = LtGemm::new(stream)?;
    let mut rng = Rng::new(0x2a5);
    let pattern = rng.bf16_vec(PATTERN + 1, 1.0, 0.0);
    let mut out = Vec::new();
    let mut cache: HashMap<(usize, usize), Vec<CudaSlice<bf16>>> = HashMap::new();
    for &(m, n, k) in shapes {
        let weights = match cache.entry((n, k)) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(rotated_copies(stream, &pattern, n * k)?),
        };
        let copies = weights.len();
        let x = upload(stream, &rng.bf16_vec(m * k, 1.0, 0.0))?;
        let mut y = stream.alloc_zeros::<bf16>(m * n)?;
        let kernels_timed = [
            ("runs p16", Some(GemvVariant::MmaRuns)),
            ("runs p4", Some(GemvVariant::Mma2Runs)),
            ("cublaslt", None),
        ];
        for (kernel, variant) in kernels_timed {
            let micros = median_micros(stream, |i| {
                let w = &weights[i % copies];
                match variant {
                    Some(v) => kernels.gemm_runs(v, stream, &mut y, &x, w, (m, n, k)),
                    None => gemm.matmul(&mut y, &x, w, m, n, k, GemmOut::Bf16),
                }
            })?;
            let bytes = (n * k + m * k + m * n) * 2;
            let timing = RunsTiming {
                kernel,
                m,
                n,
                k,
                micros,
                gbytes_per_s: bytes as f64 / (micros * 1e-6) / 1e9,
                tflops: 2.0 * (m * n * k) as f64 / (micros * 1e-6) / 1e12,
            };
            report(&timing);
            out.push(timing);
        }
    }
    Ok(out)
}

/// One timed prompt-row GEMM: bf16 (the pinned cuBLASLt GEMM, bf16 out) or FP8 (the pinned
/// e4m3 GEMM, f32 out, scales not applied), with its rate.
#[derive(Debug, Clone)]
pub struct PrefillGemmTiming {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub fp8: bool,
    pub micros: f64,
    pub tflops: f64,
}

/// Times bf16 and FP8 prompt-row GEMMs of each `(m, n, k)` side by side (the same batches and
/// median as [`gemv_timings`]; one weight copy: at prompt widths the GEMM is compute-bound).
pub fn prefill_gemm_timings(
    stream: &Arc<CudaStream>,
    shapes: &[(usize, usize, usize)],
    report: &mut dyn FnMut(&PrefillGemmTiming),
) -> Result<Vec<PrefillGemmTiming>, KernelError> {
    let mut gemm = LtGemm::new(stream)?;
    let mut rng = Rng::new(0xf8);
    let mut out = Vec::new();
    // Random finite e4m3 codes (no NaN byte).
    let mut codes = |len: usize| -> Vec<u8> {
        (0..len)
            .map(|_| {
                let b = rng.next_u64() as u8;
                if b & 0x7f == 0x7f { b & 0xfe } else { b }
            })
            .collect()
    };
    for &(m, n, k) in shapes {
        let (w8, x8) = (
            upload(stream, &codes(n * k))?,
            upload(stream, &codes(m * k))?,
        );
        let mut y32 = stream.alloc_zeros::<f32>(m * n)?;
        let fp8 = median_micros(stream, |_| gemm.matmul_fp8(&mut y32, &x8, &w8, (m, n, k)))?;
        drop((w8, x8, y32));
        let mut rng16 = Rng::new(0xb16);
        let w = upload(stream, &rng16.bf16_vec(n * k, 1.0, 0.0))?;
        let x = upload(stream, &rng16.bf16_vec(m * k, 1.0, 0.0))?;
        let mut y16 = stream.alloc_zeros::<bf16>(m * n)?;
        let bf = median_micros(stream, |_| {
            gemm.matmul(&mut y16, &x, &w, m, n, k, GemmOut::Bf16)
        })?;
        for (fp8, micros) in [(false, bf), (true, fp8)] {
            let timing = PrefillGemmTiming {
                m,
                n,
                k,
                fp8,
                micros,
                tflops: 2.0 * (m * n * k) as f64 / (micros * 1e-6) / 1e12,
            };
            report(&timing);
            out.push(timing);
        }
    }
    Ok(out)
}

/// Median microseconds per launch of `launch(i)` over [`BATCHES`] event-timed batches of
/// [`BATCH`] launches, after one warm-up batch.
fn median_micros(
    stream: &Arc<CudaStream>,
    mut launch: impl FnMut(usize) -> Result<(), KernelError>,
) -> Result<f64, KernelError> {
    for i in 0..BATCH {
        launch(i)?;
    }
    let ctx = stream.context();
    let mut per_launch = Vec::with_capacity(BATCHES);
    for b in 0..BATCHES {
        let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        start.record(stream)?;
        for i in 0..BATCH {
            launch(b * BATCH + i)?;
        }
        end.record(stream)?;
        end.synchronize()?;
        per_launch.push(start.elapsed_ms(&end)? as f64 * 1e3 / BATCH as f64);
    }
    per_launch.sort_by(f64::total_cmp);
    Ok(per_launch[BATCHES / 2])
}

/// Enough device copies of `len` weights to exceed the L2 cache, each a different phase of the
/// random `pattern` (one longer than [`PATTERN`]).
fn rotated_copies(
    stream: &Arc<CudaStream>,
    pattern: &[bf16],
    len: usize,
) -> Result<Vec<CudaSlice<bf16>>, KernelError> {
    let copies = ROTATION_BYTES.div_ceil(len * 2).clamp(2, 16);
    (0..copies)
        .map(|c| {
            let host: Vec<bf16> = pattern[c % PATTERN..]
                .iter()
                .chain(pattern.iter().cycle())
                .take(len)
                .copied()
                .collect();
            upload(stream, &host)
        })
        .collect()
}

/// One timed prefill attention shape: a whole prompt of `tokens` as one chunk from position 0.
#[derive(Debug, Clone)]
pub struct PrefillTiming {
    pub variant: PrefillVariant,
    pub n_q_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub tokens: usize,
    /// Median time per launch, microseconds.
    pub micros: f64,
    /// Causal attention FLOPs (QKᵀ and PV over the visible keys only) over the median time.
    pub tflops: f64,
}

const PREFILL_BATCH: usize = 5;
const PREFILL_BATCHES: usize = 9;
const PREFILL_BLOCK: usize = 16;

/// Times prefill attention for each `(n_q_heads, n_kv_heads, head_dim, tokens)` (no window, scale
/// `1 / sqrt(head_dim)`, block size 16, blocks in order) with each variant, in the same run,
/// handing each timing to `report` as soon as it is measured.
pub fn prefill_attention_timings(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    shapes: &[(usize, usize, usize, usize)],
    variants: &[PrefillVariant],
    report: &mut dyn FnMut(&PrefillTiming),
) -> Result<Vec<PrefillTiming>, KernelError> {
    let mut rng = Rng::new(0xa77e);
    let mut out = Vec::new();
    for &(n_q, n_kv, d, tokens) in shapes {
        let heads = AttentionHeads {
            n_q_heads: n_q,
            n_kv_heads: n_kv,
            head_dim: d,
            window: 0,
            scale: 1.0 / (d as f32).sqrt(),
        };
        let num_blocks = tokens.div_ceil(PREFILL_BLOCK).max(1);
        let cache_len = num_blocks * PREFILL_BLOCK * n_kv * d;
        let k = upload(stream, &rng.bf16_vec(cache_len, 1.0, 0.0))?;
        let v = upload(stream, &rng.bf16_vec(cache_len, 1.0, 0.0))?;
        let table: Vec<u32> = (0..num_blocks as u32).collect();
        let table = upload(stream, &table)?;
        let q = upload(stream, &rng.bf16_vec(tokens * n_q * d, 1.0, 0.0))?;
        let mut o = stream.alloc_zeros::<bf16>(tokens * n_q * d)?;
        let cache = PagedKv {
            k: k.as_view(),
            v: v.as_view(),
            block_size: PREFILL_BLOCK,
            num_blocks,
        };
        let chunk = PrefillChunk {
            q: q.as_view(),
            block_table: table.as_view(),
            start: 0,
            n_new: tokens,
        };
        // Row i sees keys 0..=i: tokens (tokens + 1) / 2 score and PV products per head, each
        // 2 d FLOPs twice.
        let flops = (tokens * (tokens + 1) / 2 * n_q * d * 4) as f64;
        for &variant in variants {
            let mut launch = || {
                kernels.prefill_attention_with(
                    variant,
                    stream,
                    &heads,
                    &cache,
                    &chunk,
                    &mut o.as_view_mut(),
                )
            };
            for _ in 0..PREFILL_BATCH {
                launch()?;
            }
            let ctx = stream.context();
            let mut per_launch = Vec::with_capacity(PREFILL_BATCHES);
            for _ in 0..PREFILL_BATCHES {
                let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                start.record(stream)?;
                for _ in 0..PREFILL_BATCH {
                    launch()?;
                }
                end.record(stream)?;
                end.synchronize()?;
                per_launch.push(start.elapsed_ms(&end)? as f64 * 1e3 / PREFILL_BATCH as f64);
            }
            per_launch.sort_by(f64::total_cmp);
            let micros = per_launch[PREFILL_BATCHES / 2];
            let timing = PrefillTiming {
                variant,
                n_q_heads: n_q,
                n_kv_heads: n_kv,
                head_dim: d,
                tokens,
                micros,
                tflops: flops / (micros * 1e-6) / 1e12,
            };
            report(&timing);
            out.push(timing);
        }
    }
    Ok(out)
}

/// One timed tile GEMV shape ([`Kernels::gemv_tiles`], bf16 out).
#[derive(Debug, Clone)]
pub struct TileGemvTiming {
    pub format: crate::tiles::TileFormat,
    /// (row tiles per warp, warps over k).
    pub config: (usize, usize, usize),
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Median time per launch, microseconds.
    pub micros: f64,
    /// Bytes that must move per launch (the tiles, x, bf16 y) over the median time, GB/s.
    pub gbytes_per_s: f64,
}

/// Random NVFP4 codes and finite positive e4m3 group scales (2^-9 .. 2^2, subnormals included)
/// for `[n, k]`.
pub(crate) fn random_nvfp4(rng: &mut Rng, n: usize, k: usize) -> (Vec<u8>, Vec<u8>) {
    let codes = (0..n * k / 2).map(|_| rng.next_u64() as u8).collect();
    let scales = (0..n * k / 16)
        .map(|_| ((rng.below(10) as u8) << 3) | (rng.next_u64() as u8 & 7))
        .collect();
    (codes, scales)
}

/// Random finite e4m3 bytes (NaN bytes made zero) for `[n, k]`.
pub(crate) fn random_fp8(rng: &mut Rng, n: usize, k: usize) -> Vec<u8> {
    (0..n * k)
        .map(|_| match rng.next_u64() as u8 {
            b if b & 0x7f == 0x7f => 0,
            b => b,
        })
        .collect()
}

/// Times the tile GEMV of `format` (NVFP4 or FP8) for each `(m, n, k)` and tile config, like
/// [`gemv_timings`] (weights rotated past the L2 cache, batches, median), handing each timing to
/// `report`.
pub fn tile_timings(
    kernels: &Kernels,
    stream: &Arc<CudaStream>,
    format: crate::tiles::TileFormat,
    shapes: &[(usize, usize, usize)],
    configs: &[(usize, usize, usize)],
    report: &mut dyn FnMut(&TileGemvTiming),
) -> Result<Vec<TileGemvTiming>, KernelError> {
    use crate::tiles::{TileFormat, fp8_tiles, nvfp4_tiles};
    let mut rng = Rng::new(0x711e);
    let mut out = Vec::new();
    let mut cache: HashMap<(usize, usize), Vec<CudaSlice<u8>>> = HashMap::new();
    for &(m, n, k) in shapes {
        let weights = match cache.entry((n, k)) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                let host = match format {
                    TileFormat::Fp8 => fp8_tiles(&random_fp8(&mut rng, n, k), n, k),
                    _ => {
                        let (codes, scales) = random_nvfp4(&mut rng, n, k);
                        nvfp4_tiles(&codes, &scales, n, k, false)
                    }
                }
                .map_err(|message| KernelError::Shape {
                    kernel: "gemv_tiles",
                    message,
                })?;
                let copies = ROTATION_BYTES.div_ceil(host.len()).clamp(2, 16);
                let copies: Result<Vec<_>, _> =
                    (0..copies).map(|_| upload(stream, &host)).collect();
                e.insert(copies?)
            }
        };
        let copies = weights.len();
        let x = upload(stream, &rng.bf16_vec(m * k, 1.0, 0.0))?;
        let s = upload(stream, &vec![0.75f32; n])?;
        let mut y = stream.alloc_zeros::<bf16>(m * n)?;
        for &config in configs {
            let mut launch = |i: usize| -> Result<(), KernelError> {
                let w = &weights[i % copies];
                kernels.gemv_tiles(stream, &mut y, &x, (w, &s), format, (m, n, k), config)
            };
            let micros = median_micros(stream, &mut launch)?;
            let bytes = format.bytes(n, k) + (m * k + m * n) * 2;
            let timing = TileGemvTiming {
                format,
                config,
                m,
                n,
                k,
                micros,
                gbytes_per_s: bytes as f64 / (micros * 1e-6) / 1e9,
            };
            report(&timing);
            out.push(timing);
        }
    }
    Ok(out)
}
