//! Fragment-ordered weight tiles and their decode GEMV (`cuda/gemv_tiles.cu`, issue 36): NVFP4
//! and FP8 re-laid at load time so that each lane's 16-byte (NVFP4) or two 16-byte (FP8) loads
//! are exactly the A registers of four tensor-core MMAs, decoded by rotations, shifts and masks
//! and one bf16 multiply per pair, the tensor (NVFP4) or channel (FP8) scale applied once per
//! output.
//!
//! FP8's arithmetic: the weight is the e4m3 value itself (exact in bf16), the sum the MMA's f32
//! sum, the output `sum × s` with `s` the row's scale (per channel or the tensor's) — where the
//! widened model rounds `bf16(q × s)` per weight.
//!
//! The arithmetic (what [`reference`] computes and the twin kernel checks bit for bit): the
//! weight is `bf16(e2m1 × group scale × 2^-7)` — exact, at most 6 significant bits — the sum is
//! the MMA's f32 sum over it, and the output is `sum × s` in one rounding, `s = 128 × (1 / t)`
//! for compressed-tensors (`t` the global scale the group scales are divided by, its reciprocal
//! rounded to f32 once) or `128 × t` for ModelOpt ([`output_scale`]). That differs from the
//! widened bf16 model (`bf16(q × g / t)` per weight) in where `t` is applied: once per output
//! instead of once per weight, one rounding instead of `k`.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;
use rayon::prelude::*;

use crate::gemv::GemvOut;
use crate::launch::{aligned16, grid, need_len, product, to_u32};
use crate::{KernelError, Kernels, ensure_shape};

const MODULE: &str = "gemv_tiles";
/// Rows of a tile (one MMA's M).
pub const TILE_ROWS: usize = 16;
/// Columns of a tile: four MMAs' k.
pub const TILE_K: usize = 64;
/// Bytes of one NVFP4 tile: 512 of codes, 64 of scales.
pub const NVFP4_TILE_BYTES: usize = 576;
/// Bytes of one FP8 tile: one byte a weight.
pub const FP8_TILE_BYTES: usize = 1024;
/// Bytes of one twin (bf16) tile.
pub const TWIN_TILE_BYTES: usize = 2048;
/// The largest M one launch takes (8 x tiles of 8 rows).
pub const TILES_MAX_M: usize = 64;

/// The k phases (warps over k) of every tiles launch: they fix a row's reduction order, so they
/// are one number for every shape and M. 8 won over 16 at every 8B projection and M measured
/// (H100, docs/receipts/tiles-nvfp4.json) except the down projection (k = 14336) at 9-16 rows.
pub const TILE_PHASES: usize = 8;

/// The (row tiles per warp, warps over k, k tiles per warp step) shapes built; the launcher picks
/// one by M and n ([`tile_config`]) and a row keeps its bits (the phases are [`TILE_PHASES`]).
/// Two row tiles per warp halve the x fragments each decoded weight tile's warp loads: at 64 rows
/// x is 14 times the NVFP4 bytes a band reads, from L2, and one row tile per warp ran at 0.5-0.9x
/// the bf16 GEMV there. Both fit sm_90a's registers at eight x tiles (150 and 184).
pub const TILE_CONFIGS: [(usize, usize, usize); 2] = [(1, TILE_PHASES, 2), (2, TILE_PHASES, 1)];

/// Whether the twin kernel is built for `config`: one row tile per warp only (the self-test holds
/// the other shape to its bits).
pub fn has_twin((r, _, _): (usize, usize, usize)) -> bool {
    r == 1
}

/// The shape a launch of `m` rows of `n` outputs takes ([`TILE_CONFIGS`]): two row tiles per warp
/// past 16 rows, and for wide projections (n >= 16384, the fused gate/up) at any M; one row tile
/// with two k tiles in flight otherwise (measured on the four 8B projections at M = 1-64, H100).
pub fn tile_config(m: usize, n: usize) -> (usize, usize, usize) {
    if m > 16 || n >= 16384 {
        TILE_CONFIGS[1]
    } else {
        TILE_CONFIGS[0]
    }
}

/// The kernels the instruction budget reads (format name, function): each built shape.
pub const BUDGETED: [(&str, &str); 4] = [
    ("nvfp4_tiles", "gemv_tiles_nvfp4_bf16_m1_r1_p8_u2"),
    ("nvfp4_tiles_r2", "gemv_tiles_nvfp4_bf16_m1_r2_p8_u1"),
    ("fp8_tiles", "gemv_tiles_fp8_bf16_m1_r1_p8_u2"),
    ("fp8_tiles_r2", "gemv_tiles_fp8_bf16_m1_r2_p8_u1"),
];

/// Where a code's bits go in its lane word: for register `j` of an MMA (a0..a3), the rotations
/// (right) that bring its magnitude bits and its sign bit into place — mirrored by
/// `Nvfp4Tiles::decode` in `cuda/gemv_tiles.cu`.
const MAGNITUDE_ROTATION: [u32; 4] = [0, 3, 6, 9];
const SIGN_ROTATION: [u32; 4] = [4, 3, 6, 5];

/// The e2m1 value of a code's low four bits (sign in bit 3).
pub fn e2m1(code: u8) -> f32 {
    const MAGNITUDE: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let v = MAGNITUDE[(code & 7) as usize];
    if code & 8 != 0 { -v } else { v }
}

/// The value of an e4m3 byte (`float8_e4m3fn`); `None` for NaN.
pub fn e4m3(byte: u8) -> Option<f32> {
    let (sign, exponent, mantissa) = (byte >> 7, (byte >> 3) & 15, byte & 7);
    if exponent == 15 && mantissa == 7 {
        return None;
    }
    let magnitude = if exponent == 0 {
        mantissa as f32 * 2f32.powi(-9)
    } else {
        (1.0 + mantissa as f32 / 8.0) * 2f32.powi(exponent as i32 - 7)
    };
    Some(if sign == 1 { -magnitude } else { magnitude })
}

/// A group scale's tile byte: bits 11..4 of `bf16(scale × 2^119)`, whose bits 14..12 are set for
/// every positive e4m3 value. Zero scales give `None` (their group's codes are zeroed instead).
fn scale_byte(e4m3_byte: u8) -> Result<Option<u8>, String> {
    let scale = e4m3(e4m3_byte).ok_or_else(|| format!("NaN group scale {e4m3_byte:#04x}"))?;
    if scale < 0.0 {
        return Err(format!("negative group scale {scale}"));
    }
    if scale == 0.0 {
        return Ok(None);
    }
    let bits = bf16::from_f64(scale as f64 * 2f64.powi(119)).to_bits();
    debug_assert_eq!(bits & 0xf00f, 0x7000, "scale {scale}");
    Ok(Some((bits >> 4) as u8))
}

/// The bf16 a scale byte stands for (`scale × 2^119`).
fn scale_of_byte(byte: u8) -> bf16 {
    bf16::from_bits(0x7000 | (byte as u16) << 4)
}

/// The output scale of an NVFP4 tensor whose group scales are divided by its tensor scale `t`
/// (`divide`, compressed-tensors) or multiplied by it (ModelOpt): what [`Kernels::gemv_tiles`]
/// multiplies each sum by.
pub fn output_scale(t: f32, divide: bool) -> f32 {
    128.0 * if divide { 1.0 / t } else { t }
}

/// NVFP4 weights `[n, k]` in tiles: `codes` `[n, k / 2]` (the even weight in the low nibble),
/// `scales` `[n, k / 16]` e4m3 group scales; `k % 64 == 0`. Rows past `n` up to the tile are
/// zeros. `unsigned_zero` reads the code `0b1000` as +0 (ModelOpt's table), else as -0.
pub fn nvfp4_tiles(
    codes: &[u8],
    scales: &[u8],
    n: usize,
    k: usize,
    unsigned_zero: bool,
) -> Result<Vec<u8>, String> {
    check_nvfp4(codes, scales, n, k)?;
    let k_tiles = k / TILE_K;
    // Each code's bits in its lane word, per register and half: one lookup per code.
    let mut placed = [[[0u32; 16]; 2]; 4];
    for (j, by_half) in placed.iter_mut().enumerate() {
        for (half, table) in by_half.iter_mut().enumerate() {
            for (c, bits) in table.iter_mut().enumerate() {
                let c = if unsigned_zero && c == 8 { 0 } else { c as u8 };
                *bits = place(c, j, half);
            }
        }
    }
    let band_bytes = k_tiles * NVFP4_TILE_BYTES;
    let mut out = vec![0u8; n.div_ceil(TILE_ROWS) * band_bytes];
    out.par_chunks_mut(band_bytes)
        .enumerate()
        .try_for_each(|(band, out)| {
            for kt in 0..k_tiles {
                let tile = &mut out[kt * NVFP4_TILE_BYTES..][..NVFP4_TILE_BYTES];
                for lane in 0..32 {
                    let (g, t) = (lane / 4, lane % 4);
                    let group = kt * 4 + t;
                    // The lane's two rows' 16 codes (8 bytes each) where the row and its scale
                    // exist; a zero scale zeroes its group.
                    let mut rows = [0u64; 2];
                    for (half, bits) in rows.iter_mut().enumerate() {
                        let row = band * TILE_ROWS + g + 8 * half;
                        if row >= n {
                            continue;
                        }
                        if let Some(byte) = scale_byte(scales[row * k / 16 + group])? {
                            tile[512 + 2 * lane + half] = byte;
                            let at = row * k / 2 + group * 8;
                            let mut word = [0u8; 8];
                            word.copy_from_slice(&codes[at..at + 8]);
                            *bits = u64::from_le_bytes(word);
                        }
                    }
                    for h in 0..4 {
                        let mut word = 0u32;
                        for (j, by_half) in placed.iter().enumerate() {
                            let (rowhalf, kk) = (j % 2, 2 * (j / 2));
                            for (half, table) in by_half.iter().enumerate() {
                                let col = 4 * h + kk + half;
                                let c = (rows[rowhalf] >> (4 * col)) & 15;
                                word |= table[c as usize];
                            }
                        }
                        tile[16 * lane + 4 * h..][..4].copy_from_slice(&word.to_le_bytes());
                    }
                }
            }
            Ok::<_, String>(())
        })?;
    Ok(out)
}

fn check_nvfp4(codes: &[u8], scales: &[u8], n: usize, k: usize) -> Result<(), String> {
    if !k.is_multiple_of(TILE_K) || k == 0 {
        return Err(format!("k = {k} is not a positive multiple of {TILE_K}"));
    }
    if codes.len() != n * k / 2 || scales.len() != n * k / 16 {
        return Err(format!(
            "{} code bytes and {} scales for [{n}, {k}] (want {} and {})",
            codes.len(),
            scales.len(),
            n * k / 2,
            n * k / 16
        ));
    }
    Ok(())
}

/// Code `c`'s bits in its lane word, as register `j`'s low (`half` 0) or high value.
fn place(c: u8, j: usize, half: usize) -> u32 {
    let c = c as u32;
    let base = 16 * half as u32;
    let mut word = 0;
    // e1 e0 m into bits 8, 7, 6 of the half; the sign into bit 15.
    for (bit, target) in [(2, 8), (1, 7), (0, 6)] {
        word |= ((c >> bit) & 1) << ((base + target + MAGNITUDE_ROTATION[j]) % 32);
    }
    word | ((c >> 3) & 1) << ((base + 15 + SIGN_ROTATION[j]) % 32)
}

/// The weights the kernel multiplies, `bf16(e2m1 × scale × 2^-7)` `[n, k]` (zero-scale groups
/// zero): what the twin tiles hold and [`reference`] sums.
pub fn nvfp4_weights(codes: &[u8], scales: &[u8], n: usize, k: usize) -> Result<Vec<bf16>, String> {
    check_nvfp4(codes, scales, n, k)?;
    let mut out = Vec::with_capacity(n * k);
    for row in 0..n {
        for col in 0..k {
            let c = (codes[row * k / 2 + col / 2] >> (4 * (col % 2))) & 15;
            let w = match scale_byte(scales[row * k / 16 + col / 16])? {
                None => 0.0,
                // Exact: e2m1 has 2 significant bits, the scale 4.
                Some(byte) => {
                    (e2m1(c) as f64 * scale_of_byte(byte).to_f64() * 2f64.powi(-126)) as f32
                }
            };
            out.push(bf16::from_f32(w));
        }
    }
    Ok(out)
}

/// The e4m3 bytes a tile cannot hold: NaN (`0x7f`, `0xff`).
fn check_fp8(data: &[u8], n: usize, k: usize) -> Result<(), String> {
    if !k.is_multiple_of(TILE_K) || k == 0 {
        return Err(format!("k = {k} is not a positive multiple of {TILE_K}"));
    }
    if data.len() != n * k {
        return Err(format!(
            "{} bytes for [{n}, {k}] (want {})",
            data.len(),
            n * k
        ));
    }
    match data.iter().position(|&b| b & 0x7f == 0x7f) {
        Some(at) => Err(format!("NaN weight at row {}, column {}", at / k, at % k)),
        None => Ok(()),
    }
}

/// Where lane (`g`, `t`)'s word `2 h + i` of a tile takes its four bytes from: (row offset in the
/// band, column in the tile) of bytes 0..4 — register `2 i + 1`'s pair in bytes 0 and 2 (row
/// `g + 8`), register `2 i`'s in bytes 1 and 3 (row `g`), columns `16 t + 4 h + 2 i` and the next
/// (mirrored by `Fp8Tiles::decode` in `cuda/gemv_tiles.cu`).
fn fp8_sources(g: usize, t: usize, h: usize, i: usize) -> [(usize, usize); 4] {
    let col = 16 * t + 4 * h + 2 * i;
    [(g + 8, col), (g, col), (g + 8, col + 1), (g, col + 1)]
}

/// FP8 (e4m3) weights `[n, k]` (`k % 64 == 0`) in tiles; rows past `n` up to the tile are zeros.
/// A NaN weight is refused.
pub fn fp8_tiles(data: &[u8], n: usize, k: usize) -> Result<Vec<u8>, String> {
    check_fp8(data, n, k)?;
    let k_tiles = k / TILE_K;
    let band_bytes = k_tiles * FP8_TILE_BYTES;
    let mut out = vec![0u8; n.div_ceil(TILE_ROWS) * band_bytes];
    out.par_chunks_mut(band_bytes)
        .enumerate()
        .for_each(|(band, out)| {
            for kt in 0..k_tiles {
                let tile = &mut out[kt * FP8_TILE_BYTES..][..FP8_TILE_BYTES];
                for lane in 0..32 {
                    let (g, t) = (lane / 4, lane % 4);
                    for word in 0..8 {
                        for (b, (dr, col)) in
                            fp8_sources(g, t, word / 2, word % 2).iter().enumerate()
                        {
                            let row = band * TILE_ROWS + dr;
                            if row < n {
                                tile[32 * lane + 4 * word + b] = data[row * k + kt * TILE_K + col];
                            }
                        }
                    }
                }
            }
        });
    Ok(out)
}

/// The weights the FP8 kernel multiplies: each e4m3 value in bf16 (exact), `[n, k]`.
pub fn fp8_weights(data: &[u8], n: usize, k: usize) -> Result<Vec<bf16>, String> {
    check_fp8(data, n, k)?;
    Ok(data
        .iter()
        .map(|&b| bf16::from_f32(e4m3(b).unwrap_or(f32::NAN)))
        .collect())
}

/// FP8 tiles decoded as the kernel decodes them (shifts and masks, one bf16 multiply by 2^120):
/// every weight of `[n, k]`, the oracle of the encoder and of the CPU reference's kept FP8.
pub fn decode_fp8_tiles(tiles: &[u8], n: usize, k: usize) -> Vec<bf16> {
    const S: u32 = 0x8000_8000;
    const E: u32 = 0x07F0_07F0;
    let two_120 = bf16::from_bits(0x7B80);
    let k_tiles = k / TILE_K;
    let mut out = vec![bf16::NAN; n * k];
    for band in 0..n.div_ceil(TILE_ROWS) {
        for kt in 0..k_tiles {
            let tile = &tiles[(band * k_tiles + kt) * FP8_TILE_BYTES..];
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                for word in 0..8 {
                    let at = 32 * lane + 4 * word;
                    let q =
                        u32::from_le_bytes([tile[at], tile[at + 1], tile[at + 2], tile[at + 3]]);
                    let pairs = [(q & S) | ((q >> 4) & E), ((q << 8) & S) | ((q << 4) & E)];
                    let sources = fp8_sources(g, t, word / 2, word % 2);
                    // Register 2 i (row g) from bytes 1 and 3, register 2 i + 1 from 0 and 2.
                    for (pair, [lo, hi]) in pairs.into_iter().zip([[1, 3], [0, 2]]) {
                        for (half, b) in [lo, hi].into_iter().enumerate() {
                            let (dr, col) = sources[b];
                            let row = band * TILE_ROWS + dr;
                            let raw = bf16::from_bits((pair >> (16 * half)) as u16);
                            // Exact: a power of two times a value of at most 4 significant bits.
                            let w = bf16::from_f64(raw.to_f64() * two_120.to_f64());
                            if row < n {
                                out[row * k + kt * TILE_K + col] = w;
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// bf16 weights `[n, k]` in the twin's tiles (each lane's A registers as stored).
pub fn twin_tiles(w: &[bf16], n: usize, k: usize) -> Vec<u8> {
    let (bands, k_tiles) = (n.div_ceil(TILE_ROWS), k / TILE_K);
    let mut out = vec![0u8; bands * k_tiles * TWIN_TILE_BYTES];
    for band in 0..bands {
        for kt in 0..k_tiles {
            let tile = &mut out[(band * k_tiles + kt) * TWIN_TILE_BYTES..][..TWIN_TILE_BYTES];
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                for h in 0..4 {
                    for j in 0..4 {
                        let row = band * TILE_ROWS + g + 8 * (j % 2);
                        for half in 0..2 {
                            let col = kt * TILE_K + 16 * t + 4 * h + 2 * (j / 2) + half;
                            let v = if row < n {
                                w[row * k + col]
                            } else {
                                bf16::ZERO
                            };
                            let at = 64 * lane + 16 * h + 4 * j + 2 * half;
                            tile[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
                        }
                    }
                }
            }
        }
    }
    out
}

/// What the kernel computes, up to the order of its f32 sum: `y[m, n] = s[n] × Σ_k x · w`.
pub fn reference(x: &[bf16], w: &[bf16], (m, n, k): (usize, usize, usize), s: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let sum: f64 = (0..k)
                .map(|c| x[i * k + c].to_f64() * w[j * k + c].to_f64())
                .sum();
            y[i * n + j] = sum as f32 * s[j];
        }
    }
    y
}

/// Which tiles a launch reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TileFormat {
    /// [`nvfp4_tiles`].
    Nvfp4,
    /// [`fp8_tiles`].
    Fp8,
    /// [`twin_tiles`] of a format's weights ([`nvfp4_weights`], [`fp8_weights`]): its oracle.
    Twin,
}

impl TileFormat {
    pub fn name(self) -> &'static str {
        match self {
            TileFormat::Nvfp4 => "nvfp4",
            TileFormat::Fp8 => "fp8",
            TileFormat::Twin => "twin",
        }
    }

    /// Device bytes of `[n, k]` (`k` a multiple of 64).
    pub fn bytes(self, n: usize, k: usize) -> usize {
        let tiles = n.div_ceil(TILE_ROWS) * (k / TILE_K);
        tiles
            * match self {
                TileFormat::Nvfp4 => NVFP4_TILE_BYTES,
                TileFormat::Fp8 => FP8_TILE_BYTES,
                TileFormat::Twin => TWIN_TILE_BYTES,
            }
    }
}

impl Kernels {
    /// `y[m, n] = s[n] × Σ_k x[m, k] · w'[n, k]` over tiles of `format` ([`reference`]), through
    /// the kernel shape `config` (one of [`TILE_CONFIGS`]): `1 ≤ m ≤ 64`, `k % 64 == 0`, x 16-byte
    /// aligned, `s` one output scale per row ([`output_scale`]). Row `m` of `y` is the same bits
    /// for any M.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_tiles<T: GemvOut>(
        &self,
        stream: &Arc<CudaStream>,
        y: &mut impl DevicePtrMut<T>,
        x: &impl DevicePtr<bf16>,
        w: (&impl DevicePtr<u8>, &impl DevicePtr<f32>),
        format: TileFormat,
        (m, n, k): (usize, usize, usize),
        config: (usize, usize, usize),
    ) -> Result<(), KernelError> {
        self.gemv_tiles_parts(stream, [y], x, [w], format, (m, [n], k), config)
    }

    /// [`Kernels::gemv_tiles`] of up to three projections of one `x` in one launch (q, k and v:
    /// the narrow k and v alone leave SMs idle): `ys[i][m, ns[i]]` from `ws[i]`, each part's rows
    /// the bits its own launch gives.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_tiles_parts<
        T: GemvOut,
        Y: DevicePtrMut<T>,
        W: DevicePtr<u8>,
        S: DevicePtr<f32>,
        const P: usize,
    >(
        &self,
        stream: &Arc<CudaStream>,
        ys: [&mut Y; P],
        x: &impl DevicePtr<bf16>,
        ws: [(&W, &S); P],
        format: TileFormat,
        (m, ns, k): (usize, [usize; P], usize),
        config: (usize, usize, usize),
    ) -> Result<(), KernelError> {
        const K: &str = "gemv_tiles";
        ensure_shape!(
            (1..=3).contains(&P),
            K,
            "{P} parts in one launch (one to three are built)"
        );
        ensure_shape!(
            (1..=TILES_MAX_M).contains(&m),
            K,
            "m = {m} is outside 1..={TILES_MAX_M}"
        );
        ensure_shape!(
            TILE_CONFIGS.contains(&config) && (format != TileFormat::Twin || has_twin(config)),
            K,
            "no {} kernel is built for {config:?} (built: {TILE_CONFIGS:?}, the twin with one \
             row tile)",
            format.name()
        );
        need_len(K, "x", x.len(), product(K, &[m, k])?)?;
        let k32 = to_u32(K, "k", k)?;
        let (r, p, u) = config;
        let (mut y_at, mut w_at, mut s_at, mut n_at) = ([0u64; 3], [0u64; 3], [0u64; 3], [0u32; 3]);
        let mut blocks = 0u32;
        let mut guards = Vec::with_capacity(3 * P);
        for (i, (y, (w, s))) in ys.into_iter().zip(ws).enumerate() {
            let n = ns[i];
            check_tiles(K, format, (w.len(), s.len()), (n, k))?;
            need_len(K, "y", y.len(), product(K, &[m, n])?)?;
            n_at[i] = to_u32(K, "n", n)?;
            blocks += n_at[i].div_ceil((TILE_ROWS * r) as u32);
            let (yp, yg) = y.device_ptr_mut(stream);
            let (wp, wg) = w.device_ptr(stream);
            let (sp, sg) = s.device_ptr(stream);
            aligned16(K, "w", wp)?;
            (y_at[i], w_at[i], s_at[i]) = (yp, wp, sp);
            guards.push((yg, wg, sg));
        }
        if blocks == 0 {
            return Ok(());
        }
        let (xp, _x) = x.device_ptr(stream);
        aligned16(K, "x", xp)?;
        let mt = m.div_ceil(8).next_power_of_two();
        let name = format!(
            "gemv_tiles_{}_{}_m{mt}_r{r}_p{p}_u{u}",
            format.name(),
            T::OUT
        );
        let f = self.function(MODULE, &name)?;
        let m32 = m as u32;
        let mut b = stream.launch_builder(f);
        b.arg(&y_at[0]).arg(&y_at[1]).arg(&y_at[2]).arg(&xp);
        b.arg(&w_at[0]).arg(&w_at[1]).arg(&w_at[2]);
        b.arg(&s_at[0]).arg(&s_at[1]).arg(&s_at[2]);
        b.arg(&m32)
            .arg(&n_at[0])
            .arg(&n_at[1])
            .arg(&n_at[2])
            .arg(&k32);
        // SAFETY: lengths, alignment and argument types checked above match the kernel; parts
        // past P have no rows and take no block.
        unsafe { b.launch(grid(blocks, (32 * p) as u32)) }?;
        drop(guards);
        Ok(())
    }

    /// [`Kernels::gemv_tiles`] in the shape [`tile_config`] picks for M and n: a row's bits are
    /// the same for every M.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_tiles_at<T: GemvOut>(
        &self,
        stream: &Arc<CudaStream>,
        y: &mut impl DevicePtrMut<T>,
        x: &impl DevicePtr<bf16>,
        w: (&impl DevicePtr<u8>, &impl DevicePtr<f32>),
        format: TileFormat,
        (m, n, k): (usize, usize, usize),
    ) -> Result<(), KernelError> {
        let config = tile_config(m, n);
        self.gemv_tiles(stream, y, x, w, format, (m, n, k), config)
    }

    /// `out[n, k] = bf16(w'[n, k] × s[n])` ([`tiles_widened`]): NVFP4 or FP8 tiles in bf16 for a
    /// GEMM.
    pub fn dequantize_tiles(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<bf16>,
        (w, s): (&impl DevicePtr<u8>, &impl DevicePtr<f32>),
        format: TileFormat,
        (n, k): (usize, usize),
    ) -> Result<(), KernelError> {
        let kernel = match format {
            TileFormat::Nvfp4 => "dequant_tiles_nvfp4",
            TileFormat::Fp8 => "dequant_tiles_fp8",
            TileFormat::Twin => {
                return Err(KernelError::Shape {
                    kernel: "dequant_tiles",
                    message: "the twin holds bf16 already".into(),
                });
            }
        };
        const K: &str = "dequant_tiles";
        check_tiles(K, format, (w.len(), s.len()), (n, k))?;
        need_len(K, "out", out.len(), product(K, &[n, k])?)?;
        let (n32, k32) = (to_u32(K, "n", n)?, to_u32(K, "k", k)?);
        if n == 0 {
            return Ok(());
        }
        let (op, _o) = out.device_ptr_mut(stream);
        let (wp, _w) = w.device_ptr(stream);
        let (sp, _s) = s.device_ptr(stream);
        aligned16(K, "w", wp)?;
        let slots = (n.div_ceil(TILE_ROWS) * (k / TILE_K) * 32) as u32;
        let f = self.function(MODULE, kernel)?;
        let mut b = stream.launch_builder(f);
        b.arg(&op).arg(&wp).arg(&sp).arg(&n32).arg(&k32);
        // SAFETY: lengths, alignment and argument types checked above match the kernel.
        unsafe { b.launch(grid(slots.div_ceil(256).min(1 << 16), 256)) }?;
        Ok(())
    }
}

/// The tiles of `[n, k]` in `format` and one output scale per row.
fn check_tiles(
    kernel: &'static str,
    format: TileFormat,
    (w_len, s_len): (usize, usize),
    (n, k): (usize, usize),
) -> Result<(), KernelError> {
    ensure_shape!(
        k > 0 && k.is_multiple_of(TILE_K),
        kernel,
        "k = {k} is not a positive multiple of {TILE_K}"
    );
    need_len(kernel, "w", w_len, format.bytes(n, k))?;
    need_len(kernel, "s", s_len, n)
}

/// The bf16 [`Kernels::dequantize_tiles`] writes: `bf16(f32(w') × s[row])`, `[n, k]`.
pub fn tiles_widened(weights: &[bf16], s: &[f32], (n, k): (usize, usize)) -> Vec<bf16> {
    weights
        .iter()
        .enumerate()
        .map(|(i, w)| bf16::from_f32(w.to_f32() * s[i / k.max(1)]))
        .take(n * k)
        .collect()
}

/// NVFP4 tiles decoded as the kernel decodes them (rotations, masks, one bf16 multiply by the
/// lane's scale byte): every weight of `[n, k]`, the oracle of the encoder and of the CPU
/// reference's kept NVFP4 weights.
pub fn decode_nvfp4_tiles(tiles: &[u8], n: usize, k: usize) -> Vec<bf16> {
    const MAG: u32 = 0x01C0_01C0;
    const SGN: u32 = 0x8000_8000;
    let k_tiles = k / TILE_K;
    let mut out = vec![bf16::NAN; n * k];
    for band in 0..n.div_ceil(TILE_ROWS) {
        for kt in 0..k_tiles {
            let tile = &tiles[(band * k_tiles + kt) * NVFP4_TILE_BYTES..];
            for lane in 0..32 {
                let (g, t) = (lane / 4, lane % 4);
                for h in 0..4 {
                    let at = 16 * lane + 4 * h;
                    let q =
                        u32::from_le_bytes([tile[at], tile[at + 1], tile[at + 2], tile[at + 3]]);
                    for j in 0..4 {
                        let a = (q.rotate_right(MAGNITUDE_ROTATION[j]) & MAG)
                            | (q.rotate_right(SIGN_ROTATION[j]) & SGN);
                        let row = band * TILE_ROWS + g + 8 * (j % 2);
                        let scale = scale_of_byte(tile[512 + 2 * lane + j % 2]);
                        for half in 0..2 {
                            let col = kt * TILE_K + 16 * t + 4 * h + 2 * (j / 2) + half;
                            let code = bf16::from_bits((a >> (16 * half)) as u16);
                            // bf16 × bf16, exact: the product has at most 6 significant bits.
                            let w = bf16::from_f64(code.to_f64() * scale.to_f64());
                            if row < n {
                                out[row * k + col] = w;
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_bit_has_its_own_place_in_the_lane_word() {
        let mut seen = 0u32;
        for j in 0..4 {
            for half in 0..2 {
                let bits = place(15, j, half);
                assert_eq!(bits.count_ones(), 4);
                assert_eq!(seen & bits, 0, "register {j} half {half} overlaps");
                seen |= bits;
            }
        }
        assert_eq!(seen, u32::MAX);
    }

    /// The decoding `cuda/gemv_tiles.cu` does, in integers: rotate, mask, and the bf16 the
    /// pair stands for is the code times 2^-126.
    #[test]
    fn rotations_and_masks_give_each_code_its_bf16() {
        const MAG: u32 = 0x01C0_01C0;
        const SGN: u32 = 0x8000_8000;
        for c in 0..16u8 {
            for j in 0..4 {
                for half in 0..2 {
                    let q = place(c, j, half);
                    let r = |s: u32| q.rotate_right(s);
                    let a = (r(MAGNITUDE_ROTATION[j]) & MAG) | (r(SIGN_ROTATION[j]) & SGN);
                    let bits = (a >> (16 * half)) as u16;
                    let v = bf16::from_bits(bits).to_f64() * 2f64.powi(126);
                    let want = e2m1(c) as f64;
                    assert_eq!(v, want, "code {c:#x} register {j} half {half}");
                    if c & 8 != 0 {
                        assert_eq!(bits >> 15, 1, "sign of {c:#x}");
                    }
                }
            }
        }
    }

    #[test]
    fn tiles_decode_to_the_weights_the_twin_holds() {
        let (n, k) = (40, 192);
        let mut state = 0x5eed_u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u8
        };
        let codes: Vec<u8> = (0..n * k / 2).map(|_| next()).collect();
        let mut scales: Vec<u8> = (0..n * k / 16).map(|_| next() % 0x7e).collect();
        scales[7] = 0; // a zero scale zeroes its group
        scales[8] = 1; // the smallest subnormal
        let want = nvfp4_weights(&codes, &scales, n, k).unwrap();
        let tiles = nvfp4_tiles(&codes, &scales, n, k, false).unwrap();
        let got = decode_nvfp4_tiles(&tiles, n, k);
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(differ, 0, "{differ} of {} weights differ", n * k);
        // ModelOpt's table: 0b1000 is +0, so no -0 survives.
        let tiles = nvfp4_tiles(&codes, &scales, n, k, true).unwrap();
        let got = decode_nvfp4_tiles(&tiles, n, k);
        assert!(got.iter().all(|w| w.to_bits() != 0x8000));
        assert!(
            want.iter().any(|w| w.to_bits() == 0x8000),
            "the data has -0 codes"
        );
        // Canary: one row's nibbles swapped decode to other weights.
        let mut swapped = codes.clone();
        swapped[..k / 2]
            .iter_mut()
            .for_each(|b| *b = b.rotate_left(4));
        let tiles = nvfp4_tiles(&swapped, &scales, n, k, false).unwrap();
        let got = decode_nvfp4_tiles(&tiles, n, k);
        assert!(
            got.iter()
                .zip(&want)
                .any(|(a, b)| a.to_bits() != b.to_bits())
        );
    }

    #[test]
    fn the_prompt_rows_widening_is_within_a_rounding_of_the_loaders() {
        // compressed-tensors: the loader widens q × (g / t); the tiles bf16(bf16(q g 2^-7) × s).
        let (n, k) = (16, 64);
        let codes: Vec<u8> = (0..n * k / 2).map(|i| (i * 37 % 256) as u8).collect();
        let scales: Vec<u8> = (0..n * k / 16)
            .map(|i| (0x20 + i * 3 % 0x50) as u8)
            .collect();
        let t = 0.37f32;
        let weights = nvfp4_weights(&codes, &scales, n, k).unwrap();
        let wide = tiles_widened(&weights, &vec![output_scale(t, true); n], (n, k));
        for (i, w) in wide.iter().enumerate() {
            let c = (codes[i / 2] >> (4 * (i % 2))) & 15;
            let loader = bf16::from_f32(e2m1(c) * (e4m3(scales[i / 16]).unwrap() / t));
            let ulps = (w.to_bits() as i32 - loader.to_bits() as i32).abs();
            assert!(ulps <= 1, "weight {i}: {w} vs the loader's {loader}");
        }
    }

    #[test]
    fn every_positive_e4m3_scale_fits_the_tile_byte() {
        for byte in 1..0x7fu8 {
            let scale = e4m3(byte).unwrap();
            let b = scale_byte(byte).unwrap().unwrap();
            assert_eq!(
                scale_of_byte(b).to_f64(),
                scale as f64 * 2f64.powi(119),
                "{byte:#x}"
            );
            // The product the kernel forms is exact and normal for every code.
            for c in 1..8u8 {
                let w = e2m1(c) as f64 * scale as f64 * 2f64.powi(-7);
                assert_eq!(bf16::from_f64(w).to_f64(), w, "{byte:#x} × code {c}");
                assert!(w >= 2f64.powi(-126));
            }
        }
        assert_eq!(scale_byte(0).unwrap(), None);
        assert!(scale_byte(0x7f).is_err(), "NaN");
        assert!(scale_byte(0x88).is_err(), "negative");
    }

    /// Every e4m3 byte, placed in each of a word's four slots, decodes to its own value (signs,
    /// subnormals and both zeros included), and the word's bytes fill all 32 bits.
    #[test]
    fn shifts_and_masks_give_every_e4m3_byte_its_bf16() {
        let mut covered = std::collections::HashSet::new();
        for g in 0..8 {
            for t in 0..4 {
                for word in 0..8 {
                    for (dr, col) in fp8_sources(g, t, word / 2, word % 2) {
                        assert!(covered.insert((g, t, dr, col)), "a weight placed twice");
                    }
                }
            }
        }
        // 32 lanes x 32 bytes: each of the tile's 16 x 64 weights once.
        assert_eq!(covered.len(), TILE_ROWS * TILE_K);
        for byte in (0..=255u8).filter(|b| b & 0x7f != 0x7f) {
            let data = vec![byte; TILE_ROWS * TILE_K];
            let got = decode_fp8_tiles(&fp8_tiles(&data, 16, 64).unwrap(), 16, 64);
            let want = e4m3(byte).unwrap();
            assert!(
                got.iter()
                    .all(|w| w.to_bits() == bf16::from_f32(want).to_bits()),
                "byte {byte:#04x} ({want})"
            );
        }
    }

    #[test]
    fn fp8_tiles_decode_to_the_weights_the_twin_holds() {
        let (n, k) = (40, 192);
        let mut state = 0xf8_u64;
        let data: Vec<u8> = (0..n * k)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                match (state >> 33) as u8 {
                    b if b & 0x7f == 0x7f => 0,
                    b => b,
                }
            })
            .collect();
        let want = fp8_weights(&data, n, k).unwrap();
        let got = decode_fp8_tiles(&fp8_tiles(&data, n, k).unwrap(), n, k);
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        // Canary: row 0's neighbouring bytes swapped decode to other weights.
        let mut swapped = data.clone();
        swapped[..k].chunks_exact_mut(2).for_each(|p| p.swap(0, 1));
        let got = decode_fp8_tiles(&fp8_tiles(&swapped, n, k).unwrap(), n, k);
        assert!(
            got.iter()
                .zip(&want)
                .any(|(a, b)| a.to_bits() != b.to_bits())
        );
        // A NaN weight is refused by place.
        let mut nan = data;
        nan[k + 5] = 0xff;
        let err = fp8_tiles(&nan, n, k).unwrap_err();
        assert!(err.contains("row 1, column 5"), "{err}");
    }
}
