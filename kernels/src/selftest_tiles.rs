//! Device self-test of the fragment-ordered NVFP4 and FP8 tiles (`cuda/gemv_tiles.cu`), for every
//! built shape of the kernel:
//!
//! - each format's tiles give, bit for bit, what the twin kernel gives on the weights the CPU
//!   decodes (`tiles::nvfp4_weights`: `bf16(e2m1 × scale × 2^-7)`; `tiles::fp8_weights`: the e4m3
//!   values), bf16 and f32 out, 1 to 64 rows, in
//!   every built shape against the twin's shape of the same phase count (so the shapes the
//!   launcher picks by M give a row the same bits);
//! - the twin agrees with the f64 reference (`tiles::reference`) to f32 summation error;
//! - row 0 of every launch is the bits of the one-row launch (batch invariance);
//! - q, k and v in one launch give each part the bits of its own launch.
//!
//! Canaries: NVFP4 tiles written with the two nibbles of every code byte of one row swapped, and
//! with one row's group scales changed; FP8 tiles with one row's neighbouring bytes swapped, and
//! with one row's signs flipped: each must differ from the twin.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

use crate::bench::random_nvfp4;
use crate::selftest::{Rng, download, poisoned_bf16, poisoned_f32, upload};
use crate::selftest_gemv::{bit_mismatches, invariance_result};
use crate::tiles::{
    TILE_CONFIGS, TileFormat, fp8_tiles, fp8_weights, has_twin, nvfp4_tiles, nvfp4_weights,
    output_scale, reference, tiles_widened, twin_tiles,
};
use crate::{CheckResult, KernelError, Kernels};

fn shape_error(message: String) -> KernelError {
    KernelError::Shape {
        kernel: "gemv_tiles",
        message,
    }
}

fn bf16_mismatches(a: &[bf16], b: &[bf16]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits() || x.is_nan())
        .count()
}

/// The weights, inputs and tiles every shape is checked on.
struct Fixture {
    format: TileFormat,
    n: usize,
    k: usize,
    case: String,
    /// The CPU-decoded weights `[n, k]` the twin holds.
    weights: Vec<bf16>,
    tiles: CudaSlice<u8>,
    twin: CudaSlice<u8>,
    /// Canaries of row 0: NVFP4's nibbles swapped and group scales changed; FP8's neighbouring
    /// bytes swapped and signs flipped.
    canaries: [(&'static str, CudaSlice<u8>); 2],
    /// One output scale per row (two tensors' worth, as a fused gate/up), host and device.
    t: Vec<f32>,
    ds: CudaSlice<f32>,
    /// 64 rows of x.
    x_all: Vec<bf16>,
}

/// A row count that is no multiple of a tile's 16 nor of a block's rows; five k tiles.
const N: usize = 72;
const K: usize = 320;

fn fixture(s: &Arc<CudaStream>, rng: &mut Rng, format: TileFormat) -> Result<Fixture, KernelError> {
    let (n, k) = (N, K);
    let (weights, tiles, canaries, t) = match format {
        TileFormat::Fp8 => fp8_fixture(s, rng)?,
        _ => nvfp4_fixture(s, rng)?,
    };
    Ok(Fixture {
        format,
        n,
        k,
        case: format!("{} tiles n={n} k={k}", format.name()),
        canaries,
        ds: upload(s, &t)?,
        t,
        twin: upload(s, &twin_tiles(&weights, n, k))?,
        weights,
        tiles,
        x_all: rng.bf16_vec(64 * k, 1.0, 0.0),
    })
}

/// A format's CPU-decoded weights, tiles, canaries and output scales.
type Parts = (
    Vec<bf16>,
    CudaSlice<u8>,
    [(&'static str, CudaSlice<u8>); 2],
    Vec<f32>,
);

fn nvfp4_fixture(s: &Arc<CudaStream>, rng: &mut Rng) -> Result<Parts, KernelError> {
    let (n, k) = (N, K);
    let (mut codes, mut scales) = random_nvfp4(rng, n, k);
    // Zero scales (whose groups the tiles zero) and the smallest subnormal.
    scales[3] = 0;
    scales[5] = 1;
    codes[..8].fill(0x19); // 0.5 and -0.5: the codes bf16 holds as subnormals
    let weights = nvfp4_weights(&codes, &scales, n, k).map_err(shape_error)?;
    let encode = |codes: &[u8], scales: &[u8]| -> Result<CudaSlice<u8>, KernelError> {
        upload(
            s,
            &nvfp4_tiles(codes, scales, n, k, false).map_err(shape_error)?,
        )
    };
    let mut swapped = codes.clone();
    for b in &mut swapped[..k / 2] {
        *b = b.rotate_left(4);
    }
    let mut rescaled = scales.clone();
    for sc in &mut rescaled[..k / 16] {
        *sc = if *sc >= 0x70 { *sc - 0x08 } else { *sc + 0x08 };
    }
    // Two tensors' scales, as a fused gate/up.
    let (t0, t1) = (
        output_scale((0.5 + rng.unit()) as f32, true),
        output_scale((0.5 + rng.unit()) as f32, false),
    );
    let t = (0..n)
        .map(|row| if row < n / 2 { t0 } else { t1 })
        .collect();
    Ok((
        weights,
        encode(&codes, &scales)?,
        [
            ("nibbles swapped", encode(&swapped, &scales)?),
            ("scales changed", encode(&codes, &rescaled)?),
        ],
        t,
    ))
}

fn fp8_fixture(s: &Arc<CudaStream>, rng: &mut Rng) -> Result<Parts, KernelError> {
    let (n, k) = (N, K);
    // Every finite e4m3 byte is likely; zeros of both signs and subnormals are placed.
    let mut data: Vec<u8> = (0..n * k)
        .map(|_| match rng.below(256) as u8 {
            b if b & 0x7f == 0x7f => 0x3f,
            b => b,
        })
        .collect();
    data[..8].copy_from_slice(&[0x00, 0x80, 0x01, 0x81, 0x07, 0x87, 0x7e, 0xfe]);
    let weights = fp8_weights(&data, n, k).map_err(shape_error)?;
    let encode = |data: &[u8]| -> Result<CudaSlice<u8>, KernelError> {
        upload(s, &fp8_tiles(data, n, k).map_err(shape_error)?)
    };
    let mut swapped = data.clone();
    swapped[..k].chunks_exact_mut(2).for_each(|p| p.swap(0, 1));
    let mut negated = data.clone();
    negated[..k].iter_mut().for_each(|b| *b ^= 0x80);
    // One scale per channel.
    let t = (0..n).map(|_| (0.01 + rng.unit() * 0.05) as f32).collect();
    Ok((
        weights,
        encode(&data)?,
        [
            ("bytes swapped", encode(&swapped)?),
            ("signs flipped", encode(&negated)?),
        ],
        t,
    ))
}

/// The shape of `phases` phases the twin is built for.
fn twin_config(phases: usize) -> Result<(usize, usize, usize), KernelError> {
    TILE_CONFIGS
        .into_iter()
        .find(|&c| c.1 == phases && has_twin(c))
        .ok_or_else(|| shape_error(format!("no twin is built for {phases} phases")))
}

/// Every tile check, for each format.
pub(crate) fn check_tiles(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let mut results = Vec::new();
    for format in [TileFormat::Nvfp4, TileFormat::Fp8] {
        let fx = fixture(s, rng, format)?;
        results.extend(check_format(kernels, s, &fx)?);
    }
    Ok(results)
}

/// Every tile check of one format.
fn check_format(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    fx: &Fixture,
) -> Result<Vec<CheckResult>, KernelError> {
    let (n, k, case, format) = (fx.n, fx.k, &fx.case, fx.format);
    let mut results = Vec::new();
    for config in TILE_CONFIGS {
        let (r, p, u) = config;
        // The shape of this phase count the twin is built for: a row's bits are P's alone.
        let twin = twin_config(p)?;
        let launch_bf16 = |w, format, m: usize, config| -> Result<Vec<bf16>, KernelError> {
            let dx = upload(s, &fx.x_all[..m * k])?;
            let mut y = poisoned_bf16(s, m * n)?;
            kernels.gemv_tiles(s, &mut y, &dx, (w, &fx.ds), format, (m, n, k), config)?;
            download(s, &y)
        };
        let one = launch_bf16(&fx.tiles, format, 1, config)?;
        for m in [1, 9, 16, 33, 64] {
            let q = launch_bf16(&fx.tiles, format, m, config)?;
            let b = launch_bf16(&fx.twin, TileFormat::Twin, m, twin)?;
            let (tr, _, tu) = twin;
            results.push(invariance_result(
                "gemv_tiles",
                format!(
                    "{case} m={m} r{r}p{p}u{u}: vs the twin (r{tr}p{p}u{tu}) on the CPU-decoded \
                     weights"
                ),
                false,
                bf16_mismatches(&q, &b),
            ));
            results.push(invariance_result(
                "gemv_tiles",
                format!("{case} m={m} r{r}p{p}u{u}: row 0 vs the one-row launch"),
                false,
                bf16_mismatches(&q[..n], &one),
            ));
        }
        let b = launch_bf16(&fx.twin, TileFormat::Twin, 1, twin)?;
        for (what, canary) in &fx.canaries {
            let c = launch_bf16(canary, format, 1, config)?;
            results.push(invariance_result(
                "gemv_tiles",
                format!("{case} m=1 r{r}p{p}u{u}: {what} in row 0 vs the twin (canary)"),
                true,
                bf16_mismatches(&c[..n], &b),
            ));
        }
        results.extend(check_f32(kernels, s, fx, config)?);
        results.extend(check_parts(kernels, s, fx, config)?);
    }
    results.extend(check_dequant(kernels, s, fx)?);
    Ok(results)
}

/// f32 out at one shape: bit for bit against the twin, and the twin against the f64 sum.
fn check_f32(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    fx: &Fixture,
    config: (usize, usize, usize),
) -> Result<Vec<CheckResult>, KernelError> {
    let ((n, k, m), (r, p, u), case) = ((fx.n, fx.k, 5), config, &fx.case);
    let dx = upload(s, &fx.x_all[..m * k])?;
    let launch = |w, format, config| -> Result<Vec<f32>, KernelError> {
        let mut y = poisoned_f32(s, m * n)?;
        kernels.gemv_tiles(s, &mut y, &dx, (w, &fx.ds), format, (m, n, k), config)?;
        download(s, &y)
    };
    let q = launch(&fx.tiles, fx.format, config)?;
    let b = launch(&fx.twin, TileFormat::Twin, twin_config(p)?)?;
    let mismatches = invariance_result(
        "gemv_tiles",
        format!("{case} m={m} f32 r{r}p{p}u{u}: vs the twin"),
        false,
        bit_mismatches(&q, &b),
    );
    let (x, w, t) = (&fx.x_all, &fx.weights, &fx.t);
    let want = reference(&x[..m * k], w, (m, n, k), t);
    // f32 summation of k products: relative to the sum of their magnitudes.
    let worst = (0..m * n)
        .map(|i| {
            let (row, col) = (i / n, i % n);
            let magnitude: f64 = (0..k)
                .map(|c| (x[row * k + c].to_f64() * w[col * k + c].to_f64()).abs())
                .sum::<f64>()
                * t[col] as f64;
            (b[i] as f64 - want[i] as f64).abs() / magnitude.max(f64::MIN_POSITIVE)
        })
        .fold(0.0, f64::max);
    let reference = CheckResult::compare(
        "gemv_tiles",
        format!("{case} m={m} f32 r{r}p{p}u{u}: twin vs the f64 reference"),
        false,
        worst,
        1e-5,
        b.iter().all(|v| !v.is_nan()),
        format!("worst error {worst:.2e} of the products' magnitude"),
    );
    Ok(vec![mismatches, reference])
}

/// Three projections in one launch (q, k, v): each part's rows bit for bit its own launch's, at
/// three row counts (the fixture's tiles, its two canaries as other weights, cut to 72, 40 and 24
/// rows); the canary: part 1 against part 0's own launch must differ.
fn check_parts(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    fx: &Fixture,
    config: (usize, usize, usize),
) -> Result<Vec<CheckResult>, KernelError> {
    let ((k, case), (r, p, u)) = ((fx.k, &fx.case), config);
    let ws = [&fx.tiles, &fx.canaries[0].1, &fx.canaries[1].1];
    let ns = [fx.n, 40, 24];
    let mut results = Vec::new();
    for m in [1, 33, 64] {
        let dx = upload(s, &fx.x_all[..m * k])?;
        let alone = |i: usize| -> Result<Vec<bf16>, KernelError> {
            let mut y = poisoned_bf16(s, m * ns[i])?;
            let shape = (m, ns[i], k);
            kernels.gemv_tiles(s, &mut y, &dx, (ws[i], &fx.ds), fx.format, shape, config)?;
            download(s, &y)
        };
        let mut ys = [
            poisoned_bf16(s, m * ns[0])?,
            poisoned_bf16(s, m * ns[1])?,
            poisoned_bf16(s, m * ns[2])?,
        ];
        {
            let [y0, y1, y2] = &mut ys;
            kernels.gemv_tiles_parts(
                s,
                [y0, y1, y2],
                &dx,
                ws.map(|w| (w, &fx.ds)),
                fx.format,
                (m, ns, k),
                config,
            )?;
        }
        let mut mismatches = 0;
        for (i, y) in ys.iter().enumerate() {
            mismatches += bf16_mismatches(&download(s, y)?, &alone(i)?);
        }
        results.push(invariance_result(
            "gemv_tiles",
            format!("{case} m={m} r{r}p{p}u{u}: q, k, v parts ({ns:?} rows) vs their own launches"),
            false,
            mismatches,
        ));
        if m == 1 {
            let part1 = download(s, &ys[1])?;
            results.push(invariance_result(
                "gemv_tiles",
                format!("{case} m=1 r{r}p{p}u{u}: part 1 vs part 0's own launch (canary)"),
                true,
                bf16_mismatches(&part1, &alone(0)?[..ns[1]]),
            ));
        }
    }
    Ok(results)
}

/// The prompt rows' widening: bit for bit the host's, and not the weights without the output
/// scale (canary).
fn check_dequant(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    fx: &Fixture,
) -> Result<Vec<CheckResult>, KernelError> {
    let (n, k, case) = (fx.n, fx.k, &fx.case);
    let mut wide = poisoned_bf16(s, n * k)?;
    kernels.dequantize_tiles(s, &mut wide, (&fx.tiles, &fx.ds), fx.format, (n, k))?;
    let wide = download(s, &wide)?;
    Ok(vec![
        invariance_result(
            "dequant_tiles",
            format!("{case}: vs the host's bf16(w' x s)"),
            false,
            bf16_mismatches(&wide, &tiles_widened(&fx.weights, &fx.t, (n, k))),
        ),
        invariance_result(
            "dequant_tiles",
            format!("{case}: vs the host's without the output scale (canary)"),
            true,
            bf16_mismatches(&wide, &fx.weights),
        ),
    ])
}
