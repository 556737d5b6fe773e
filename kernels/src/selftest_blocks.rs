//! Device self-test of the block-format kernels (`cuda/gemv_blocks.cu`), for every format:
//!
//! - the dequantizer gives, bit for bit, the bf16 rounding of a CPU reference dequantizer's f32
//!   (the caller's: the checkpoint loader's, itself bit-exact against the `gguf` package);
//! - the block GEMV (bf16 and f32 out, 1 to 64 rows), the shard GEMV and the embedding gather
//!   give bit for bit what the bf16 kernels give on the dequantized weights.
//!
//! Canaries: the reference of the same bytes with one scale changed, and the bf16 GEMV on those
//! changed weights, must both differ.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use half::{bf16, f16};

use crate::selftest::{Rng, download, poisoned_bf16, poisoned_f32, upload};
use crate::selftest_gemv::{bit_mismatches, invariance_result};
use crate::{BlockFormat, CheckResult, GemvVariant, KernelError, Kernels};

/// A CPU dequantizer: `(format, bytes of whole blocks, elements)` → the f32 values.
pub type Dequantizer<'a> = &'a dyn Fn(BlockFormat, &[u8], usize) -> Vec<f32>;

/// Byte offsets of a block's f16 scales (d, and dmin or m where the format has one).
fn scale_offsets(format: BlockFormat) -> &'static [usize] {
    match format {
        BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0 => &[0],
        BlockFormat::Q4_1 | BlockFormat::Q5_1 | BlockFormat::Q4_K | BlockFormat::Q5_K => &[0, 2],
        BlockFormat::Q6_K => &[208],
        // The f32 tensor / block scale's two high bytes (the canary flips an exponent bit).
        BlockFormat::Nvfp4 | BlockFormat::Nvfp4Modelopt | BlockFormat::Fp8 => &[2],
    }
}

/// A random finite e4m3 byte of magnitude 2^-6 .. 2^2 (either sign).
fn e4m3_byte(rng: &mut Rng) -> u8 {
    let exponent = 1 + rng.below(9) as u8;
    (rng.next_u64() as u8 & 0x87) | (exponent << 3)
}

/// `n` rows of `k` weights of random blocks (file layout): random quant bytes, scales drawn as f16 of
/// magnitude 1e-3 .. 3e-2 (either sign), so every weight is finite and of a model's size.
pub(crate) fn random_blocks(rng: &mut Rng, format: BlockFormat, n: usize, k: usize) -> Vec<u8> {
    let mut bytes: Vec<u8> = (0..n * k / format.block_elems() * format.block_bytes())
        .map(|_| rng.next_u64() as u8)
        .collect();
    for block in bytes.chunks_exact_mut(format.block_bytes()) {
        match format {
            // Tensor scale 0.5 .. 2 (the group scales are divided by it or multiplied), finite
            // group scales.
            BlockFormat::Nvfp4 | BlockFormat::Nvfp4Modelopt => {
                let t = (0.5 + 1.5 * rng.unit()) as f32;
                block[..4].copy_from_slice(&t.to_le_bytes());
                for g in &mut block[4..8] {
                    *g = e4m3_byte(rng);
                }
                continue;
            }
            // Scale 1e-3 .. 3e-2, finite weights (no e4m3 NaN).
            BlockFormat::Fp8 => {
                let scale = (1e-3 + 2.9e-2 * rng.unit()) as f32;
                block[..4].copy_from_slice(&scale.to_le_bytes());
                for q in &mut block[4..] {
                    if *q & 0x7f == 0x7f {
                        *q &= 0xfe;
                    }
                }
                continue;
            }
            _ => {}
        }
        for &at in scale_offsets(format) {
            let magnitude = 1e-3 + 2.9e-2 * rng.unit();
            let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
            let d = f16::from_f64(sign * magnitude).to_le_bytes();
            block[at..at + 2].copy_from_slice(&d);
        }
    }
    bytes
}

fn bf16_mismatches(a: &[bf16], b: &[bf16]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits() || x.is_nan())
        .count()
}

/// Every block-format check, with `reference` as the CPU dequantizer.
pub fn check_blocks(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    seed: u64,
    reference: Dequantizer<'_>,
) -> Vec<CheckResult> {
    let mut rng = Rng::new(seed);
    let mut results = Vec::new();
    for format in BlockFormat::every() {
        match check_format(kernels, s, &mut rng, format, reference) {
            Ok(mut r) => results.append(&mut r),
            Err(e) => results.push(CheckResult::error(
                &format!("blocks {}", format.kernel_name()),
                format!("seed {seed:#x}"),
                false,
                e,
            )),
        }
    }
    results
}

/// The row-parallel shards the checks cut K into.
const SHARDS: usize = 8;

fn check_format(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
    format: BlockFormat,
    reference: Dequantizer<'_>,
) -> Result<Vec<CheckResult>, KernelError> {
    // SHARDS shards of 256 columns (a K-quant block each); a row count that is no multiple of
    // the GEMV's 16 or 32 rows per block.
    let (n, k) = (72, SHARDS * 256);
    let name = format.kernel_name();
    let mut results = Vec::new();
    let bytes = random_blocks(rng, format, n, k);
    // The canary's bytes: the first scale of every block of row 0 with its exponent changed (one
    // block alone can vanish in the bf16 rounding of a whole row's sum when its scale is small).
    let mut changed = bytes.clone();
    for block in changed[..format.block_bytes() * (k / format.block_elems())]
        .chunks_exact_mut(format.block_bytes())
    {
        block[scale_offsets(format)[0] + 1] ^= 0x04;
    }
    let widen = |b: &[u8]| -> Vec<bf16> {
        reference(format, b, n * k)
            .into_iter()
            .map(bf16::from_f32)
            .collect()
    };
    let (expected, expected_changed) = (widen(&bytes), widen(&changed));

    let dw = upload(s, &format.to_device(&bytes))?;
    let mut wide = poisoned_bf16(s, n * k)?;
    kernels.dequantize(s, &mut wide, &dw, format, (n, k))?;
    let got = download(s, &wide)?;
    let case = format!("{name} n={n} k={k}");
    results.push(invariance_result(
        "dequant",
        format!("{case}: vs the CPU dequantizer rounded to bf16"),
        false,
        bf16_mismatches(&got, &expected),
    ));
    results.push(invariance_result(
        "dequant",
        format!("{case}: vs the CPU dequantizer of a changed scale (canary)"),
        true,
        bf16_mismatches(&got, &expected_changed),
    ));
    let wide_changed = upload(s, &expected_changed)?;

    for m in [1, 17, 64] {
        let x = rng.bf16_vec(m * k, 1.0, 0.0);
        let dx = upload(s, &x)?;
        for variant in [GemvVariant::Mma, GemvVariant::Mma2] {
            let mut q = poisoned_bf16(s, m * n)?;
            kernels.gemv_blocks(variant, s, &mut q, &dx, &dw, format, (m, n, k))?;
            let mut b = poisoned_bf16(s, m * n)?;
            kernels.gemv_with(variant, s, &mut b, &dx, &wide, (m, n, k))?;
            let (q, b) = (download(s, &q)?, download(s, &b)?);
            results.push(invariance_result(
                "gemv_blocks",
                format!("{case} m={m} {variant:?}: vs the bf16 GEMV on the dequantized weights"),
                false,
                bf16_mismatches(&q, &b),
            ));
            if m == 1 {
                let mut c = poisoned_bf16(s, m * n)?;
                kernels.gemv_with(variant, s, &mut c, &dx, &wide_changed, (m, n, k))?;
                results.push(invariance_result(
                    "gemv_blocks",
                    format!(
                        "{case} m={m} {variant:?}: vs the bf16 GEMV on a changed scale (canary)"
                    ),
                    true,
                    bf16_mismatches(&q, &download(s, &c)?),
                ));
            }
        }
    }

    let held = Held {
        format,
        blocks: &dw,
        wide: &wide,
        case: &case,
        n,
        k,
    };
    results.extend(check_f32_and_shards(kernels, s, rng, &held)?);
    results.push(check_embed(kernels, s, rng, &held)?);
    Ok(results)
}

/// A format's weights on the device for its checks: the blocks, their dequantized bf16 copy,
/// the case's name and the shape.
struct Held<'a> {
    format: BlockFormat,
    blocks: &'a CudaSlice<u8>,
    wide: &'a CudaSlice<bf16>,
    case: &'a str,
    n: usize,
    k: usize,
}

/// f32 out (the LM head) and the row-parallel shards, against the bf16-weight kernels.
fn check_f32_and_shards(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
    held: &Held<'_>,
) -> Result<Vec<CheckResult>, KernelError> {
    let &Held {
        format,
        blocks,
        wide,
        case,
        n,
        k,
    } = held;
    let mut results = Vec::new();
    let m = 5;
    let x = upload(s, &rng.bf16_vec(m * k, 1.0, 0.0))?;
    for variant in [GemvVariant::Mma, GemvVariant::Mma2] {
        let mut q = poisoned_f32(s, m * n)?;
        kernels.gemv_blocks(variant, s, &mut q, &x, blocks, format, (m, n, k))?;
        let mut b = poisoned_f32(s, m * n)?;
        kernels.gemv_with(variant, s, &mut b, &x, wide, (m, n, k))?;
        results.push(invariance_result(
            "gemv_blocks",
            format!("{case} m={m} f32 {variant:?}: vs the bf16-weight GEMV"),
            false,
            bit_mismatches(&download(s, &q)?, &download(s, &b)?),
        ));
    }
    let (kslice, stride) = (k / SHARDS, m * n);
    let mut q = poisoned_f32(s, SHARDS * stride)?;
    kernels.gemv_shards_blocks(
        s,
        &mut q,
        &x,
        blocks,
        format,
        (m, n),
        (SHARDS, kslice, k),
        stride,
    )?;
    let mut b = poisoned_f32(s, SHARDS * stride)?;
    kernels.gemv_shards(s, &mut b, &x, wide, (m, n), (SHARDS, kslice, k), stride)?;
    results.push(invariance_result(
        "gemv_shards_blocks",
        format!("{case} m={m} {SHARDS}x{kslice}: vs the bf16-weight shard GEMV"),
        false,
        bit_mismatches(&download(s, &q)?, &download(s, &b)?),
    ));
    Ok(results)
}

/// The embedding gather, ids in and out of the table's rows, against the bf16 gather.
fn check_embed(
    kernels: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
    held: &Held<'_>,
) -> Result<CheckResult, KernelError> {
    let &Held {
        format,
        blocks,
        wide,
        case,
        n,
        k,
    } = held;
    let tokens = 24;
    let ids: Vec<u32> = (0..tokens).map(|_| rng.below(n + 8) as u32).collect();
    let dids = upload(s, &ids)?;
    let mut q = poisoned_bf16(s, tokens * k)?;
    kernels.embed_rows_blocks(
        s,
        &mut q,
        blocks,
        format,
        &dids,
        tokens,
        k,
        0..n,
        bf16::NEG_ZERO,
    )?;
    let mut b = poisoned_bf16(s, tokens * k)?;
    kernels.embed_rows(s, &mut b, wide, &dids, tokens, k, 0..n, bf16::NEG_ZERO)?;
    Ok(invariance_result(
        "embed_blocks",
        format!("{case} {tokens} ids: vs the bf16 gather from the dequantized table"),
        false,
        bf16_mismatches(&download(s, &q)?, &download(s, &b)?),
    ))
}
