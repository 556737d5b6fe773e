//! Device self-test of the fragment-ordered NVFP4 tiles (`cuda/gemv_tiles.cu`), for every built
//! shape of the kernel:
//!
//! - the NVFP4 tiles give, bit for bit, what the twin kernel gives on the weights the CPU decodes
//!   (`tiles::nvfp4_weights`: `bf16(e2m1 × scale × 2^-7)`), bf16 and f32 out, 1 to 64 rows, in
//!   every built shape against the twin's shape of the same phase count (so the shapes the
//!   launcher picks by M give a row the same bits);
//! - the twin agrees with the f64 reference (`tiles::reference`) to f32 summation error;
//! - row 0 of every launch is the bits of the one-row launch (batch invariance);
//! - q, k and v in one launch give each part the bits of its own launch.
//!
//! Canaries: tiles written with the two nibbles of every code byte of one row swapped, and with
//! one row's group scales changed, must differ from the twin.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;

use crate::bench::random_nvfp4;
use crate::selftest::{Rng, download, poisoned_bf16, poisoned_f32, upload};
use crate::selftest_gemv::{bit_mismatches, invariance_result};
use crate::tiles::{
    TILE_CONFIGS, TileFormat, has_twin, nvfp4_tiles, nvfp4_weights, nvfp4_widened, output_scale,
    reference, twin_tiles,
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
    n: usize,
    k: usize,
    case: String,
    /// The CPU-decoded weights `[n, k]` the twin holds.
    weights: Vec<bf16>,
    tiles: CudaSlice<u8>,
    twin: CudaSlice<u8>,
    /// Canaries: row 0's nibbles swapped, row 0's group scales changed.
    swapped: CudaSlice<u8>,
    rescaled: CudaSlice<u8>,
    /// One output scale per row (two tensors' worth, as a fused gate/up), host and device.
    t: Vec<f32>,
    ds: CudaSlice<f32>,
    /// 64 rows of x.
    x_all: Vec<bf16>,
}

fn fixture(s: &Arc<CudaStream>, rng: &mut Rng) -> Result<Fixture, KernelError> {
    // A row count that is no multiple of a tile's 16 nor of a block's rows; five k tiles.
    let (n, k) = (72, 320);
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
    let tiles = encode(&codes, &scales)?;
    let twin = upload(s, &twin_tiles(&weights, n, k))?;
    let mut swapped = codes.clone();
    for b in &mut swapped[..k / 2] {
        *b = b.rotate_left(4);
    }
    let mut rescaled = scales.clone();
    for sc in &mut rescaled[..k / 16] {
        *sc = if *sc >= 0x70 { *sc - 0x08 } else { *sc + 0x08 };
    }
    let (t0, t1) = (
        output_scale((0.5 + rng.unit()) as f32, true),
        output_scale((0.5 + rng.unit()) as f32, false),
    );
    let t: Vec<f32> = (0..n)
        .map(|row| if row < n / 2 { t0 } else { t1 })
        .collect();
    Ok(Fixture {
        n,
        k,
        case: format!("nvfp4 tiles n={n} k={k}"),
        swapped: encode(&swapped, &scales)?,
        rescaled: encode(&codes, &rescaled)?,
        ds: upload(s, &t)?,
        t,
        weights,
        tiles,
        twin,
        x_all: rng.bf16_vec(64 * k, 1.0, 0.0),
    })
}

/// The shape of `phases` phases the twin is built for.
fn twin_config(phases: usize) -> Result<(usize, usize, usize), KernelError> {
    TILE_CONFIGS
        .into_iter()
        .find(|&c| c.1 == phases && has_twin(c))
        .ok_or_else(|| shape_error(format!("no twin is built for {phases} phases")))
}

/// Every tile check.
pub(crate) fn check_tiles(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
) -> Result<Vec<CheckResult>, KernelError> {
    let fx = fixture(s, rng)?;
    let (n, k, case) = (fx.n, fx.k, &fx.case);
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
        let one = launch_bf16(&fx.tiles, TileFormat::Nvfp4, 1, config)?;
        for m in [1, 9, 16, 33, 64] {
            let q = launch_bf16(&fx.tiles, TileFormat::Nvfp4, m, config)?;
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
        for (what, canary) in [
            ("nibbles swapped", &fx.swapped),
            ("scales changed", &fx.rescaled),
        ] {
            let c = launch_bf16(canary, TileFormat::Nvfp4, 1, config)?;
            results.push(invariance_result(
                "gemv_tiles",
                format!("{case} m=1 r{r}p{p}u{u}: {what} in row 0 vs the twin (canary)"),
                true,
                bf16_mismatches(&c[..n], &b),
            ));
        }
        results.extend(check_f32(kernels, s, &fx, config)?);
        results.extend(check_parts(kernels, s, &fx, config)?);
    }
    results.extend(check_dequant(kernels, s, &fx)?);
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
    let q = launch(&fx.tiles, TileFormat::Nvfp4, config)?;
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
    let ws = [&fx.tiles, &fx.swapped, &fx.rescaled];
    let ns = [fx.n, 40, 24];
    let mut results = Vec::new();
    for m in [1, 33, 64] {
        let dx = upload(s, &fx.x_all[..m * k])?;
        let alone = |i: usize| -> Result<Vec<bf16>, KernelError> {
            let mut y = poisoned_bf16(s, m * ns[i])?;
            let shape = (m, ns[i], k);
            kernels.gemv_tiles(
                s,
                &mut y,
                &dx,
                (ws[i], &fx.ds),
                TileFormat::Nvfp4,
                shape,
                config,
            )?;
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
                TileFormat::Nvfp4,
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
    kernels.dequantize_tiles(s, &mut wide, (&fx.tiles, &fx.ds), (n, k))?;
    let wide = download(s, &wide)?;
    Ok(vec![
        invariance_result(
            "dequant_tiles",
            format!("{case}: vs the host's bf16(w' x s)"),
            false,
            bf16_mismatches(&wide, &nvfp4_widened(&fx.weights, &fx.t, (n, k))),
        ),
        invariance_result(
            "dequant_tiles",
            format!("{case}: vs the host's without the output scale (canary)"),
            true,
            bf16_mismatches(&wide, &fx.weights),
        ),
    ])
}
