//! CPU dequantizers: ggml blocks widened to f32, bit-exact against the `gguf` Python package.
//!
//! The oracle is `gguf.quants.dequantize` (gguf-py 0.19.0), which computes in numpy float32. Each
//! kernel here performs the same IEEE single-precision operations in the same order — f16 scales
//! widened first, the per-group scale `d * sc` formed before it multiplies the quant, the offset
//! added or subtracted last, no fused multiply-add — so the results agree bit for bit, NaN
//! payloads included. `tests/gguf_dequant.rs` holds the fixtures that prove it.

use super::{GgmlType, GgufError, QK_K};

/// Widens `n_elements` elements of type `ty` stored in `bytes` to f32, in storage order.
///
/// `bytes` must be exactly the tensor's size: `n_elements / block_size * type_size`.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n_elements: u64) -> Result<Vec<f32>, GgufError> {
    check_length(ty, bytes, n_elements)?;
    if !is_supported(ty) {
        return Err(GgufError::UnsupportedDequant { ty });
    }
    // The length check bounds n_elements by the bytes present times the block ratio.
    let n = usize::try_from(n_elements).map_err(|_| GgufError::DequantLength {
        ty,
        n_elements,
        n_bytes: bytes.len() as u64,
    })?;
    let mut out = vec![0.0; n];
    dequantize_into(ty, bytes, &mut out)?;
    Ok(out)
}

/// Like [`dequantize`], writing `out.len()` elements into `out` instead of allocating.
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), GgufError> {
    check_length(ty, bytes, out.len() as u64)?;
    match ty {
        GgmlType::F32 => blocks::<1, 4>(bytes, out, |b, o| o[0] = f32::from_le_bytes(*b)),
        GgmlType::F16 => blocks::<1, 2>(bytes, out, |b, o| o[0] = f16_to_f32(*b)),
        GgmlType::BF16 => blocks::<1, 2>(bytes, out, |b, o| {
            o[0] = f32::from_bits(u32::from(u16::from_le_bytes(*b)) << 16);
        }),
        GgmlType::Q4_0 => blocks(bytes, out, q4_0),
        GgmlType::Q4_1 => blocks(bytes, out, q4_1),
        GgmlType::Q5_0 => blocks(bytes, out, q5_0),
        GgmlType::Q5_1 => blocks(bytes, out, q5_1),
        GgmlType::Q8_0 => blocks(bytes, out, q8_0),
        GgmlType::Q2_K => blocks(bytes, out, q2_k),
        GgmlType::Q3_K => blocks(bytes, out, q3_k),
        GgmlType::Q4_K => blocks(bytes, out, q4_k),
        GgmlType::Q5_K => blocks(bytes, out, q5_k),
        GgmlType::Q6_K => blocks(bytes, out, q6_k),
        _ => return Err(GgufError::UnsupportedDequant { ty }),
    }
    Ok(())
}

/// Whether [`dequantize`] handles `ty`.
pub fn is_supported(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K
    )
}

fn check_length(ty: GgmlType, bytes: &[u8], n_elements: u64) -> Result<(), GgufError> {
    if ty.byte_len(n_elements) == Some(bytes.len() as u64) {
        Ok(())
    } else {
        Err(GgufError::DequantLength {
            ty,
            n_elements,
            n_bytes: bytes.len() as u64,
        })
    }
}

/// Runs `kernel` over each `T`-byte block and its `B` outputs. The caller has checked that
/// `bytes` and `out` hold the same whole number of blocks.
fn blocks<const B: usize, const T: usize>(
    bytes: &[u8],
    out: &mut [f32],
    kernel: impl Fn(&[u8; T], &mut [f32; B]),
) {
    let (blocks, _) = bytes.as_chunks::<T>();
    let (outs, _) = out.as_chunks_mut::<B>();
    for (block, out) in blocks.iter().zip(outs) {
        kernel(block, out);
    }
}

/// IEEE half to single, exact, keeping a NaN's payload and signalling bit as numpy's cast does.
pub fn f16_to_f32(le: [u8; 2]) -> f32 {
    let h = u16::from_le_bytes(le);
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // Subnormal: shift the leading one into the implicit-bit position (bit 10).
            let shift = man.leading_zeros() - 21;
            sign | ((113 - shift) << 23) | (((man << shift) & 0x3ff) << 13)
        }
        (0x1f, _) => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// The f16 at `bytes[at..at + 2]`, widened. `at + 2 <= N` at every call site (constant offsets
/// inside a fixed-size block).
fn f16_at<const N: usize>(block: &[u8; N], at: usize) -> f32 {
    f16_to_f32([block[at], block[at + 1]])
}

/// Low nibbles of `qs` are elements 0..16, high nibbles 16..32.
fn nibble(qs: &[u8], j: usize) -> u8 {
    let half = qs.len();
    (qs[j % half] >> (4 * (j / half))) & 0x0f
}

fn q4_0(b: &[u8; 18], out: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for (j, o) in out.iter_mut().enumerate() {
        let q = nibble(&b[2..], j) as i8 - 8;
        *o = d * f32::from(q);
    }
}

fn q4_1(b: &[u8; 20], out: &mut [f32; 32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (j, o) in out.iter_mut().enumerate() {
        *o = d * f32::from(nibble(&b[4..], j)) + m;
    }
}

/// The 5-bit quant `j` of a Q5_0/Q5_1 block: a nibble from `qs`, the fifth bit from `qh`.
fn five_bit(qh: u32, qs: &[u8], j: usize) -> u8 {
    nibble(qs, j) | ((((qh >> j) & 1) as u8) << 4)
}

fn q5_0(b: &[u8; 22], out: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, o) in out.iter_mut().enumerate() {
        let q = five_bit(qh, &b[6..], j) as i8 - 16;
        *o = d * f32::from(q);
    }
}

fn q5_1(b: &[u8; 24], out: &mut [f32; 32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, o) in out.iter_mut().enumerate() {
        *o = d * f32::from(five_bit(qh, &b[8..], j)) + m;
    }
}

fn q8_0(b: &[u8; 34], out: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..]) {
        *o = f32::from(q as i8) * d;
    }
}

/// Element `i` of a 256-element super-block whose quants are packed `bits` wide, `32` per byte
/// lane: within each 128-element half, the four (or two) shifts of one 32-byte run.
fn packed(qs: &[u8], i: usize, bits: u32) -> u8 {
    let per_byte = 8 / bits as usize;
    let half_len = 32 * per_byte;
    let (half, r) = (i / half_len, i % half_len);
    let byte = qs[half * 32 + r % 32];
    (byte >> (bits as usize * (r / 32))) & ((1 << bits) - 1)
}

fn q2_k(b: &[u8; 84], out: &mut [f32; QK_K]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (g, group) in out.chunks_exact_mut(16).enumerate() {
        let dl = d * f32::from(scales[g] & 0x0f);
        let ml = dmin * f32::from(scales[g] >> 4);
        for (k, o) in group.iter_mut().enumerate() {
            let q = packed(qs, g * 16 + k, 2);
            *o = dl * f32::from(q) - ml;
        }
    }
}

fn q3_k(b: &[u8; 110], out: &mut [f32; QK_K]) {
    let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    for (g, group) in out.chunks_exact_mut(16).enumerate() {
        // 6-bit scales: low nibbles from bytes 0..8 (low then high halves), top two bits from
        // bytes 8..12, two bits per group, four groups per shift.
        let low = (sc[g % 8] >> (4 * (g / 8))) & 0x0f;
        let high = (sc[8 + g % 4] >> (2 * (g / 4))) & 0x03;
        let dl = d * f32::from((low | (high << 4)) as i8 - 32);
        for (k, o) in group.iter_mut().enumerate() {
            let i = g * 16 + k;
            let low_bits = packed(qs, i, 2) as i8;
            // A clear hmask bit subtracts 4; a set one leaves the quant as is.
            let hbit = (hmask[i % 32] >> (i / 32)) & 1;
            let q = low_bits - (((hbit ^ 1) << 2) as i8);
            *o = dl * f32::from(q);
        }
    }
}

/// Q4_K/Q5_K scale and min of sub-block `j` (0..8), unpacked from 12 bytes of 6-bit fields.
fn k_scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 0x3f, s[j + 4] & 0x3f)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30),
            (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30),
        )
    }
}

fn q4_k(b: &[u8; 144], out: &mut [f32; QK_K]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (j, group) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = k_scale_min(scales, j);
        let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
        let run = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        for (o, &byte) in group.iter_mut().zip(run) {
            let q = (byte >> (4 * (j % 2))) & 0x0f;
            *o = dl * f32::from(q) - ml;
        }
    }
}

fn q5_k(b: &[u8; 176], out: &mut [f32; QK_K]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (j, group) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = k_scale_min(scales, j);
        let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
        let run = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        for (l, (o, &byte)) in group.iter_mut().zip(run).enumerate() {
            let q = ((byte >> (4 * (j % 2))) & 0x0f) | (((qh[l] >> j) & 1) << 4);
            *o = dl * f32::from(q) - ml;
        }
    }
}

fn q6_k(b: &[u8; 210], out: &mut [f32; QK_K]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (g, group) in out.chunks_exact_mut(16).enumerate() {
        let dl = d * f32::from(scales[g] as i8);
        for (k, o) in group.iter_mut().enumerate() {
            let i = g * 16 + k;
            let (half, r) = (i / 128, i % 128);
            let low = (ql[half * 64 + r % 64] >> (4 * (r / 64))) & 0x0f;
            let high = packed(qh, i, 2);
            let q = (low | (high << 4)) as i8 - 32;
            *o = dl * f32::from(q);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_widening_matches_half_for_every_non_nan() {
        for bits in 0..=u16::MAX {
            let h = half::f16::from_bits(bits);
            if h.is_nan() {
                continue;
            }
            let ours = f16_to_f32(bits.to_le_bytes());
            assert_eq!(ours.to_bits(), h.to_f32().to_bits(), "{bits:#06x}");
        }
    }

    #[test]
    fn f16_nan_keeps_its_payload() {
        assert_eq!(f16_to_f32(0x7c01u16.to_le_bytes()).to_bits(), 0x7f80_2000);
        assert_eq!(f16_to_f32(0xfe00u16.to_le_bytes()).to_bits(), 0xffc0_0000);
    }

    #[test]
    fn length_and_support_are_checked() {
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 17], 32),
            Err(GgufError::DequantLength { .. })
        ));
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 18], 31),
            Err(GgufError::DequantLength { .. })
        ));
        assert!(matches!(
            dequantize(GgmlType::Q8_K, &[0; 292], 256),
            Err(GgufError::UnsupportedDequant { .. })
        ));
        assert_eq!(dequantize(GgmlType::Q4_0, &[], 0).ok(), Some(vec![]));
    }
}
