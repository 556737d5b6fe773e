//! Quantized safetensors checkpoints: FP8 (e4m3) weights with a scale per tensor, per output
//! channel or per 2-D block — compressed-tensors' `float-quantized` / `naive-quantized`, NVIDIA
//! ModelOpt's FP8, Hugging Face's `fp8` (`weight_scale_inv`) — and NVFP4: e2m1 values two to a
//! byte (the even column in the low nibble), an e4m3 scale per 16 values and an f32 tensor scale,
//! which compressed-tensors (`nvfp4-pack-quantized`: `weight_packed`, `weight_scale`,
//! `weight_global_scale`, divided) and ModelOpt (`weight`, `weight_scale`, `weight_scale_2`,
//! multiplied) store differently.
//!
//! A quantized Linear is folded at open time into one tensor under its plain `…weight` name, of its
//! logical shape, read as f32 the first time it is asked for — the values the producing library
//! dequantizes to, computed in the same f32 operations (rounded to bf16 they equal the library's
//! bf16 bit for bit: `model/tests/quantized.rs`). Activation and KV scales (`input_scale`,
//! `input_global_scale`, `k_scale`, `v_scale`) are set aside: the forward pass keeps activations
//! and the KV cache in its own precision.

use safetensors::Dtype;

/// How one folded tensor is dequantized.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum QuantKind {
    /// `weight` (e4m3) times `scale` broadcast over it: one value, one per row, or one per
    /// `block` of rows × columns.
    Fp8 { block: (usize, usize) },
    /// Packed e2m1 values, an e4m3 scale per 16 of a row, and a tensor scale the group scales are
    /// divided by (compressed-tensors) or multiplied by (ModelOpt).
    Nvfp4 { divide: bool },
}

/// A stored part of a folded tensor.
#[derive(Debug, Clone)]
pub(super) struct Part {
    pub(super) file: usize,
    pub(super) offsets: (usize, usize),
    pub(super) dtype: Dtype,
    pub(super) shape: Vec<usize>,
    pub(super) name: String,
}

/// Names of the tensors that belong to a quantized Linear besides its data.
pub(super) const SET_ASIDE: [&str; 5] = [
    ".input_scale",
    ".input_global_scale",
    ".k_scale",
    ".v_scale",
    ".output_scale",
];

/// The FP8 block when a 2-D scale does not say it: the size every FP8 block checkpoint uses.
pub(super) const DEFAULT_BLOCK: (usize, usize) = (128, 128);

/// e4m3 (`float8_e4m3fn`: no infinities, NaN at `S.1111.111`) to f32, exactly.
pub fn e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let exponent = (byte >> 3) & 0x0f;
    let mantissa = f32::from(byte & 0x07);
    if exponent == 0x0f && byte & 0x07 == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exponent == 0 {
        mantissa / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + mantissa / 8.0) * 2f32.powi(i32::from(exponent) - 7)
    };
    sign * magnitude
}

/// e2m1 (FP4) from the low four bits of `nibble`, exactly.
pub fn e2m1_to_f32(nibble: u8) -> f32 {
    const MAGNITUDE: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let magnitude = MAGNITUDE[usize::from(nibble & 0x07)];
    if nibble & 0x08 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// e2m1 as NVIDIA ModelOpt decodes it: its table has no negative zero, so the code `0b1000` is
/// +0 (what its exporter writes for a value that rounded to zero from below).
pub fn e2m1_to_f32_modelopt(nibble: u8) -> f32 {
    if nibble & 0x0f == 0x08 {
        0.0
    } else {
        e2m1_to_f32(nibble)
    }
}

/// A scale tensor's values as f32 (stored as f32, bf16, f16 or e4m3), refused if one is not
/// finite.
fn scales(part: &Part, bytes: &[u8]) -> Result<Vec<f32>, String> {
    let values: Vec<f32> = match part.dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F8_E4M3 => bytes.iter().map(|&b| e4m3_to_f32(b)).collect(),
        other => {
            return Err(format!(
                "scale {} is {other:?}; scales are F32, BF16, F16 or F8_E4M3",
                part.name
            ));
        }
    };
    if let Some(bad) = values.iter().position(|v| !v.is_finite()) {
        return Err(format!(
            "scale {} holds a non-finite value ({}) at element {bad}",
            part.name, values[bad]
        ));
    }
    Ok(values)
}

/// A one-value scale tensor's value (activation scales: `input_scale`, `input_global_scale`).
pub(super) fn scale_value(part: &Part, bytes: &[u8]) -> Result<f32, String> {
    let values = scales(part, bytes)?;
    match values.as_slice() {
        [value] => Ok(*value),
        _ => Err(format!(
            "scale {} must hold one value; it has shape {:?}",
            part.name, part.shape
        )),
    }
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// A kept projection's arithmetic: its weights `[rows, cols]` as bf16 bits and the scale each
/// row's output sum is multiplied by once ([`QuantizedLinear::kept`]).
pub type Kept = (Vec<u16>, Vec<f32>);

/// A quantized Linear's stored parts, checked against its logical shape `[rows, cols]`: what a
/// backend that keeps the weight quantized needs ([`super::Checkpoint::quantized`]).
#[derive(Debug, Clone, PartialEq)]
pub enum QuantizedLinear<'a> {
    /// e4m3 bytes, row-major, and their scales: each covers `block.0` rows × `block.1` columns
    /// (all of them for a scale per tensor, one row for a scale per row), row-major over the
    /// grid of blocks.
    Fp8 {
        shape: [usize; 2],
        data: &'a [u8],
        scales: Vec<f32>,
        block: (usize, usize),
    },
    /// Packed e2m1 pairs (`[rows, cols / 2]`, the even column in the low nibble), e4m3 group
    /// scales (`[rows, cols / 16]`) and the tensor scale, which the group scales are divided by
    /// (compressed-tensors) or multiplied by (ModelOpt, whose code 0b1000 reads as +0).
    Nvfp4 {
        shape: [usize; 2],
        packed: &'a [u8],
        group_scales: &'a [u8],
        tensor_scale: f32,
        divide: bool,
    },
}

impl QuantizedLinear<'_> {
    /// The logical `[rows, cols]`.
    pub fn shape(&self) -> [usize; 2] {
        match self {
            QuantizedLinear::Fp8 { shape, .. } | QuantizedLinear::Nvfp4 { shape, .. } => *shape,
        }
    }

    /// The kept arithmetic of either format (the CUDA backend's tiles, issue 36): the weights
    /// `[rows, cols]` as bf16 bits and the scale each row's output sum is multiplied by once
    /// ([`QuantizedLinear::nvfp4_kept`], [`QuantizedLinear::fp8_kept`]); `None` where the tiles
    /// do not hold the layout (FP8 with scales per block narrower than a row).
    pub fn kept(&self) -> Result<Option<Kept>, String> {
        if let Some((weights, scale)) = self.nvfp4_kept()? {
            return Ok(Some((weights, vec![scale; self.shape()[0]])));
        }
        self.fp8_kept()
    }

    /// Each row's scale of an FP8 Linear whose scales cover whole rows (one per tensor or per
    /// row, or blocks at least a row wide): what the tiles multiply each output by. `None` for
    /// NVFP4 and for scales per block narrower than a row.
    pub fn fp8_row_scales(&self) -> Option<Vec<f32>> {
        let QuantizedLinear::Fp8 {
            shape: [rows, cols],
            scales,
            block: (bh, bw),
            ..
        } = self
        else {
            return None;
        };
        (*bw >= *cols && *bh > 0).then(|| (0..*rows).map(|r| scales[r / bh]).collect())
    }

    /// Kept FP8's arithmetic (the CUDA backend's tiles, issue 36), `None` for NVFP4 and for
    /// scales per block narrower than a row: the weights `[rows, cols]` as the bf16 bits of
    /// their e4m3 values (exact) and each row's scale, which its output sum is multiplied by once
    /// (where the widened model rounds `q × s` per weight). A NaN weight is refused.
    pub fn fp8_kept(&self) -> Result<Option<Kept>, String> {
        let (
            QuantizedLinear::Fp8 {
                shape: [_, cols],
                data,
                ..
            },
            Some(row_scales),
        ) = (self, self.fp8_row_scales())
        else {
            return Ok(None);
        };
        if let Some(at) = data.iter().position(|&b| b & 0x7f == 0x7f) {
            return Err(format!(
                "NaN weight at row {}, column {}",
                at / cols.max(&1),
                at % cols.max(&1)
            ));
        }
        let weights = data
            .iter()
            .map(|&b| half::bf16::from_f32(e4m3_to_f32(b)).to_bits())
            .collect();
        Ok(Some((weights, row_scales)))
    }

    /// Kept NVFP4's arithmetic (the CUDA backend's tiles, issue 36), `None` for FP8: the weights
    /// `[rows, cols]` as bf16 bits of `code × group scale × 2^-7` — exact, at most 6 significant
    /// bits; a zero group scale gives +0 — and the scale each output's sum is multiplied by once:
    /// `128 × f32(1 / t)` when the group scales are divided by the tensor scale `t`
    /// (compressed-tensors), `128 × t` when multiplied (ModelOpt, whose code `0b1000` is +0). A
    /// negative or NaN group scale is refused.
    pub fn nvfp4_kept(&self) -> Result<Option<(Vec<u16>, f32)>, String> {
        let QuantizedLinear::Nvfp4 {
            shape: [rows, cols],
            packed,
            group_scales,
            tensor_scale,
            divide,
        } = self
        else {
            return Ok(None);
        };
        let code = if *divide {
            e2m1_to_f32
        } else {
            e2m1_to_f32_modelopt
        };
        let mut weights = Vec::with_capacity(rows * cols);
        for (row, codes) in packed.chunks_exact(cols / 2).enumerate() {
            for (group, pairs) in codes.chunks_exact(8).enumerate() {
                let byte = group_scales[row * cols / 16 + group];
                let scale = e4m3_to_f32(byte);
                if scale.is_nan() || scale.is_sign_negative() && scale != 0.0 {
                    return Err(format!(
                        "group scale {byte:#04x} of row {row}, group {group} is negative or NaN"
                    ));
                }
                for &pair in pairs {
                    for nibble in [pair & 0x0f, pair >> 4] {
                        let w = if scale == 0.0 {
                            0.0
                        } else {
                            code(nibble) * scale * 2f32.powi(-7)
                        };
                        weights.push(half::bf16::from_f32(w).to_bits());
                    }
                }
            }
        }
        let scale = if *divide {
            128.0 * (1.0 / tensor_scale)
        } else {
            128.0 * tensor_scale
        };
        Ok(Some((weights, scale)))
    }
}

/// Checks a quantized Linear's stored parts (`bytes[i]` is `parts[i]`'s data: FP8 data then its
/// scale; NVFP4 packed data, group scales, tensor scale) against its logical shape.
pub(super) fn describe<'a>(
    kind: &QuantKind,
    (rows, cols): (usize, usize),
    parts: &[Part],
    bytes: &[&'a [u8]],
) -> Result<QuantizedLinear<'a>, String> {
    match kind {
        QuantKind::Fp8 { block } => {
            let (data, scale) = (&parts[0], &parts[1]);
            if data.dtype != Dtype::F8_E4M3 || data.shape != [rows, cols] {
                return Err(format!(
                    "{} must be F8_E4M3 of shape [{rows}, {cols}]; it is {:?} {:?}",
                    data.name, data.dtype, data.shape
                ));
            }
            let s = scales(scale, bytes[1])?;
            // Which scale each element takes, from the scale's shape.
            let block = if s.len() == 1 {
                (rows.max(1), cols.max(1))
            } else if s.len() == rows && scale.shape.iter().filter(|&&d| d != 1).count() == 1 {
                (1, cols.max(1))
            } else if scale.shape.len() == 2
                && scale.shape == [rows.div_ceil(block.0), cols.div_ceil(block.1)]
            {
                *block
            } else {
                return Err(format!(
                    "scale {} has shape {:?}, which is neither one value, one per row of {rows}, \
                     nor one per {}x{} block of [{rows}, {cols}]",
                    scale.name, scale.shape, block.0, block.1
                ));
            };
            Ok(QuantizedLinear::Fp8 {
                shape: [rows, cols],
                data: bytes[0],
                scales: s,
                block,
            })
        }
        QuantKind::Nvfp4 { divide } => {
            let (data, group, tensor) = (&parts[0], &parts[1], &parts[2]);
            if data.dtype != Dtype::U8 || data.shape != [rows, cols / 2] || cols % 16 != 0 {
                return Err(format!(
                    "{} must be U8 of shape [{rows}, {}] (two e2m1 values a byte, rows a \
                     multiple of 16 wide); it is {:?} {:?}",
                    data.name,
                    cols / 2,
                    data.dtype,
                    data.shape
                ));
            }
            if group.dtype != Dtype::F8_E4M3 || group.shape != [rows, cols / 16] {
                return Err(format!(
                    "scale {} must be F8_E4M3 of shape [{rows}, {}] (one per 16 values); it is \
                     {:?} {:?}",
                    group.name,
                    cols / 16,
                    group.dtype,
                    group.shape
                ));
            }
            if numel(&tensor.shape) != 1 {
                return Err(format!(
                    "tensor scale {} must hold one value; it has shape {:?}",
                    tensor.name, tensor.shape
                ));
            }
            // Checked for non-finite values, as every scale.
            scales(group, bytes[1])?;
            let t = scales(tensor, bytes[2])?[0];
            if t == 0.0 && *divide {
                return Err(format!("tensor scale {} is zero", tensor.name));
            }
            Ok(QuantizedLinear::Nvfp4 {
                shape: [rows, cols],
                packed: bytes[0],
                group_scales: bytes[1],
                tensor_scale: t,
                divide: *divide,
            })
        }
    }
}

/// The dequantized weight of logical shape `[rows, cols]` as little-endian f32 bytes, from its
/// stored parts (as [`describe`] takes them).
pub(super) fn dequantize(
    kind: &QuantKind,
    shape: (usize, usize),
    parts: &[Part],
    bytes: &[&[u8]],
) -> Result<Vec<u8>, String> {
    let (rows, cols) = shape;
    let mut out = Vec::with_capacity(rows * cols * 4);
    match describe(kind, shape, parts, bytes)? {
        QuantizedLinear::Fp8 {
            data,
            scales: s,
            block: (bh, bw),
            ..
        } => {
            let per_row = cols.div_ceil(bw);
            for (r, row) in data.chunks_exact(cols).enumerate() {
                for (c, &q) in row.iter().enumerate() {
                    let v = e4m3_to_f32(q) * s[(r / bh) * per_row + c / bw];
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        QuantizedLinear::Nvfp4 {
            packed,
            group_scales,
            tensor_scale: t,
            divide,
            ..
        } => {
            // Each producer's own decoding: compressed-tensors keeps the sign of zero, ModelOpt
            // does not.
            let decode = if divide {
                e2m1_to_f32
            } else {
                e2m1_to_f32_modelopt
            };
            for (r, row) in packed.chunks_exact(cols / 2).enumerate() {
                for (pair, &byte) in row.iter().enumerate() {
                    let g = e4m3_to_f32(group_scales[r * (cols / 16) + pair * 2 / 16]);
                    let scale = if divide { g / t } else { g * t };
                    for nibble in [byte & 0x0f, byte >> 4] {
                        let v = decode(nibble) * scale;
                        out.extend_from_slice(&v.to_le_bytes());
                    }
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kept NVFP4: each weight `bf16(code × group scale × 2^-7)` exactly, the tensor scale once
    /// per output (`128 / t` or `128 t`), zero scales zero their group, ModelOpt's `0b1000` is
    /// +0, and a NaN or negative group scale is refused.
    #[test]
    fn kept_nvfp4_is_the_exact_group_scaled_code_and_one_output_scale() {
        // Row 0: codes 0..16 then 16 codes of 0b1111 (-6); row 1: 0b1000 (-0) then 0b0111 (6).
        let mut packed: Vec<u8> = (0..8u8).map(|i| (2 * i) | (2 * i + 1) << 4).collect();
        packed.extend([0xff; 8]);
        packed.extend([0x88; 8]);
        packed.extend([0x77; 8]);
        // Group scales: 1.875 (0x3f), 2^-9 (0x01, the smallest subnormal), 0 (0x00), 448 (0x7e).
        let group_scales = [0x3f, 0x01, 0x00, 0x7e];
        let q = |divide, group_scales: &[u8]| {
            QuantizedLinear::Nvfp4 {
                shape: [2, 32],
                packed: &packed,
                group_scales,
                tensor_scale: 3.0,
                divide,
            }
            .nvfp4_kept()
        };
        let (weights, scale) = q(true, &group_scales).unwrap().unwrap();
        assert_eq!(scale, 128.0 * (1.0f32 / 3.0));
        let value = |i: usize| half::bf16::from_bits(weights[i]).to_f32();
        for c in 0..16u8 {
            assert_eq!(
                value(c as usize),
                e2m1_to_f32(c) * 1.875 / 128.0,
                "code {c}"
            );
        }
        assert_eq!(value(16), -6.0 * 2f32.powi(-16));
        assert_eq!(weights[32], 0, "a zero group scale gives +0");
        assert_eq!(
            weights[48],
            half::bf16::from_f32(6.0 * 448.0 / 128.0).to_bits()
        );
        assert_eq!(value(48), 21.0);
        let (modelopt, scale) = q(false, &[0x38, 0x38, 0x38, 0x38]).unwrap().unwrap();
        assert_eq!(scale, 384.0);
        assert_eq!(modelopt[32], 0, "ModelOpt's 0b1000 is +0");
        let (signed, _) = q(true, &[0x38, 0x38, 0x38, 0x38]).unwrap().unwrap();
        assert_eq!(signed[32], 0x8000, "compressed-tensors' 0b1000 is -0");
        for bad in [0x7f, 0xb8] {
            let err = q(true, &[0x38, bad, 0x38, 0x38]).unwrap_err();
            assert!(err.contains("group 1"), "{err}");
        }
        let fp8 = QuantizedLinear::Fp8 {
            shape: [1, 1],
            data: &[0],
            scales: vec![1.0],
            block: (1, 1),
        };
        assert_eq!(fp8.nvfp4_kept(), Ok(None));
    }

    #[test]
    fn e4m3_decodes_every_byte_as_its_definition_says() {
        // Known points: the largest finite, the smallest normal and subnormal, NaN, signed zero.
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
        // Every finite value is exact in bf16 (3 mantissa bits) and the positive ones increase.
        let positive: Vec<f32> = (0u8..0x7f).map(e4m3_to_f32).collect();
        assert!(positive.windows(2).all(|w| w[0] < w[1]));
        for v in positive {
            assert_eq!(half::bf16::from_f32(v).to_f32(), v);
        }
    }

    #[test]
    fn e2m1_decodes_the_sixteen_codes() {
        let all: Vec<f32> = (0u8..16).map(e2m1_to_f32).collect();
        assert_eq!(
            all,
            [
                0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0,
                -6.0
            ]
        );
    }

    fn part(name: &str, dtype: Dtype, shape: &[usize]) -> Part {
        Part {
            file: 0,
            offsets: (0, 0),
            dtype,
            shape: shape.to_vec(),
            name: name.into(),
        }
    }

    fn f32s(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn fp8_scales_broadcast_by_their_shape_and_bad_ones_are_named() {
        let data = [0x38u8, 0x40, 0xb8, 0x48]; // 1, 2, -1, 4
        let w = part("w.weight", Dtype::F8_E4M3, &[2, 2]);
        let run = |scale: Part, bytes: &[u8]| {
            dequantize(
                &QuantKind::Fp8 { block: (1, 1) },
                (2, 2),
                &[w.clone(), scale],
                &[&data, bytes],
            )
        };
        let tensor: Vec<u8> = 0.5f32.to_le_bytes().to_vec();
        let out = run(part("w.weight_scale", Dtype::F32, &[1]), &tensor).unwrap();
        assert_eq!(f32s(&out), [0.5, 1.0, -0.5, 2.0]);
        let rows: Vec<u8> = [1.0f32, 10.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let out = run(part("w.weight_scale", Dtype::F32, &[2, 1]), &rows).unwrap();
        assert_eq!(f32s(&out), [1.0, 2.0, -10.0, 40.0]);
        let blocks: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let out = run(part("w.weight_scale", Dtype::F32, &[2, 2]), &blocks).unwrap();
        assert_eq!(f32s(&out), [1.0, 4.0, -3.0, 16.0]);
        let err = run(part("w.weight_scale", Dtype::F32, &[3]), &[0; 12]).unwrap_err();
        assert!(
            err.contains("w.weight_scale") && err.contains("[3]"),
            "{err}"
        );
        let nan: Vec<u8> = f32::NAN.to_le_bytes().to_vec();
        let err = run(part("w.weight_scale", Dtype::F32, &[1]), &nan).unwrap_err();
        assert!(
            err.contains("w.weight_scale") && err.contains("non-finite"),
            "{err}"
        );
    }

    #[test]
    fn nvfp4_takes_the_low_nibble_first_and_both_tensor_scale_conventions() {
        // One row of 16 values: codes 0..15 (0x10 packs code 0 then code 1, and so on).
        let packed: Vec<u8> = (0..8u8).map(|i| (2 * i) | ((2 * i + 1) << 4)).collect();
        let group = [0x40u8]; // 2.0
        let parts = |global: f32| {
            (
                [
                    part("w.weight_packed", Dtype::U8, &[1, 8]),
                    part("w.weight_scale", Dtype::F8_E4M3, &[1, 1]),
                    part("w.weight_global_scale", Dtype::F32, &[1]),
                ],
                global.to_le_bytes(),
            )
        };
        let (p, g) = parts(4.0);
        let divided = dequantize(
            &QuantKind::Nvfp4 { divide: true },
            (1, 16),
            &p,
            &[&packed, &group, &g],
        )
        .unwrap();
        let multiplied = dequantize(
            &QuantKind::Nvfp4 { divide: false },
            (1, 16),
            &p,
            &[&packed, &group, &g],
        )
        .unwrap();
        let codes: Vec<f32> = (0u8..16).map(e2m1_to_f32).collect();
        assert_eq!(
            f32s(&divided),
            codes.iter().map(|c| c * 0.5).collect::<Vec<_>>()
        );
        assert_eq!(
            f32s(&multiplied),
            codes.iter().map(|c| c * 8.0).collect::<Vec<_>>()
        );
        let wrong = [
            part("w.weight_packed", Dtype::U8, &[1, 8]),
            part("w.weight_scale", Dtype::F8_E4M3, &[1, 2]),
            part("w.weight_global_scale", Dtype::F32, &[1]),
        ];
        let err = dequantize(
            &QuantKind::Nvfp4 { divide: true },
            (1, 16),
            &wrong,
            &[&packed, &group, &g],
        )
        .unwrap_err();
        assert!(err.contains("w.weight_scale"), "{err}");
    }
}
