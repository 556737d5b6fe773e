//! FP8 and NVFP4 projections of a safetensors checkpoint in strata's device blocks (64 weights
//! of a row each: `BlockFormat::nvfp4_blocks`, `BlockFormat::fp8_blocks`), which the block
//! kernels dequantize in registers to the bf16 the checkpoint loader widens to; NVFP4 and FP8 in
//! fragment-ordered tiles (`strata_kernels::tiles`) where the policy keeps them so; and the
//! blocks' values computed on the host, the kernels' reference.

use std::sync::Arc;

use strata_kernels::BlockFormat;
use strata_kernels::cudarc::driver::CudaStream;
use strata_kernels::tiles::{TILE_K, TileFormat, fp8_tiles, nvfp4_tiles, output_scale};
use strata_model::weights::{
    Checkpoint, EMBED, QuantizedLinear, e2m1_to_f32, e2m1_to_f32_modelopt, e4m3_to_f32,
};

use super::CudaError;
use super::weights::{BlockPolicy, Matrix};

/// A quantized Linear in device blocks, when its layout allows: rows a multiple of 64 wide and,
/// for FP8, each scale covering whole blocks (a scale per tensor, per row, or per block at least
/// 64 columns wide). The two NVFP4 conventions are two formats.
pub(super) fn safetensors_blocks(q: &QuantizedLinear<'_>) -> Option<(BlockFormat, Vec<u8>)> {
    match q {
        QuantizedLinear::Nvfp4 {
            shape: [rows, cols],
            packed,
            group_scales,
            tensor_scale,
            divide,
        } => {
            let format = if *divide {
                BlockFormat::Nvfp4
            } else {
                BlockFormat::Nvfp4Modelopt
            };
            BlockFormat::nvfp4_blocks(packed, group_scales, *tensor_scale, (*rows, *cols))
                .map(|b| (format, b))
        }
        QuantizedLinear::Fp8 {
            shape: [rows, cols],
            data,
            scales,
            block: (bh, bw),
        } => {
            let per_row = cols.div_ceil(*bw);
            let scale = |r: usize, c: usize| scales[(r / bh) * per_row + c / bw];
            BlockFormat::fp8_blocks(data, (*rows, *cols), *bw, scale).map(|b| (BlockFormat::Fp8, b))
        }
    }
}

/// An NVFP4 or FP8 Linear in fragment-ordered tiles on the host, and one output scale per row.
pub(super) struct HostTiles {
    pub(super) format: TileFormat,
    pub(super) data: Vec<u8>,
    pub(super) scales: Vec<f32>,
}

impl HostTiles {
    /// The tiles and their scales on the device.
    pub(super) fn upload(self, stream: &Arc<CudaStream>) -> Result<Matrix, CudaError> {
        Ok(Matrix::Tiles {
            format: self.format,
            data: stream.clone_htod(&self.data)?,
            scales: stream.clone_htod(&self.scales)?,
        })
    }
}

/// An NVFP4 or FP8 Linear in fragment-ordered tiles (`strata_kernels::tiles`): `None` for a
/// width that is no multiple of 64 or FP8 scales per block narrower than a row; an error for a
/// value the tiles cannot hold (a NaN or negative group scale, a NaN weight).
pub(super) fn safetensors_tiles(q: &QuantizedLinear<'_>) -> Result<Option<HostTiles>, String> {
    if !q.shape()[1].is_multiple_of(TILE_K) {
        return Ok(None);
    }
    match q {
        QuantizedLinear::Nvfp4 {
            shape: [rows, cols],
            packed,
            group_scales,
            tensor_scale,
            divide,
        } => Ok(Some(HostTiles {
            format: TileFormat::Nvfp4,
            data: nvfp4_tiles(packed, group_scales, *rows, *cols, !divide)?,
            scales: vec![output_scale(*tensor_scale, *divide); *rows],
        })),
        QuantizedLinear::Fp8 {
            shape: [rows, cols],
            data,
            ..
        } => {
            let Some(scales) = q.fp8_row_scales() else {
                return Ok(None);
            };
            Ok(Some(HostTiles {
                format: TileFormat::Fp8,
                data: fp8_tiles(data, *rows, *cols)?,
                scales,
            }))
        }
    }
}

/// NVFP4 or FP8 tensor `name` (`shape`, all of it: `whole`) in tiles when `policy` keeps it so
/// (one GPU, the fused order); never the embedding table.
pub(super) fn tiles_of(
    ckpt: &Checkpoint,
    policy: BlockPolicy,
    name: &str,
    shape: [usize; 2],
    whole: bool,
) -> Result<Option<HostTiles>, CudaError> {
    let kept = policy.keep_quantized && policy.tiles && policy.row_kslice.is_none();
    if !(kept && whole) || name == EMBED {
        return Ok(None);
    }
    let Some(q) = ckpt.quantized(name)? else {
        return Ok(None);
    };
    if q.shape() != shape || matches!(q, QuantizedLinear::Fp8 { .. }) && !policy.fp8_tiles {
        return Ok(None);
    }
    safetensors_tiles(&q).map_err(|e| CudaError::Unsupported(format!("{name}: {e}")))
}

/// Gate then up (`[inter, h]` each, all rows: `whole`) as one tiled matrix: whole bands of 16
/// rows each, one format, one output scale per row.
pub(super) fn gate_up_tiles(
    ckpt: &Checkpoint,
    policy: BlockPolicy,
    (gate, up): (&str, &str),
    shape: [usize; 2],
    whole: bool,
) -> Result<Option<HostTiles>, CudaError> {
    if !shape[0].is_multiple_of(16) {
        return Ok(None);
    }
    Ok(
        match (
            tiles_of(ckpt, policy, gate, shape, whole)?,
            tiles_of(ckpt, policy, up, shape, whole)?,
        ) {
            (Some(mut g), Some(u)) if g.format == u.format => {
                g.data.extend_from_slice(&u.data);
                g.scales.extend_from_slice(&u.scales);
                Some(g)
            }
            _ => None,
        },
    )
}

/// The values of device blocks of a safetensors format, computed on the host as the checkpoint
/// loader computes them (`strata_model::weights`: `q * (g / t)` for compressed-tensors' NVFP4,
/// `q * (g * t)` with ModelOpt's unsigned zero, `q * s` for FP8, each one f32 operation): the
/// reference of the block kernels (`strata kernels selftest`).
pub fn safetensors_block_values(format: BlockFormat, bytes: &[u8]) -> Vec<f32> {
    let f32_at = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let mut out = Vec::with_capacity(bytes.len() / format.block_bytes() * 64);
    for block in bytes.chunks_exact(format.block_bytes()) {
        match format {
            BlockFormat::Nvfp4 | BlockFormat::Nvfp4Modelopt => {
                let t = f32_at(&block[..4]);
                for (i, &byte) in block[8..].iter().enumerate() {
                    let g = e4m3_to_f32(block[4 + i / 8]);
                    let (scale, decode): (f32, fn(u8) -> f32) = if format == BlockFormat::Nvfp4 {
                        (g / t, e2m1_to_f32)
                    } else {
                        (g * t, e2m1_to_f32_modelopt)
                    };
                    for nibble in [byte & 0x0f, byte >> 4] {
                        out.push(decode(nibble) * scale);
                    }
                }
            }
            _ => {
                let s = f32_at(&block[..4]);
                out.extend(block[4..].iter().map(|&q| e4m3_to_f32(q) * s));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use strata_model::weights::{Checkpoint, WeightDtype};

    use super::*;

    fn fixtures() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/oracle/quant")
    }

    /// Every quantized Linear of `dir` in device blocks (where its layout allows), read back on
    /// the host: the f32 values the checkpoint loader gives, bit for bit. Returns how many
    /// Linears went into blocks and how many were left to widening.
    fn blocks_read_back_as_the_loader(dir: &Path, tamper: bool) -> (usize, usize, usize) {
        let ckpt = Checkpoint::open(dir).unwrap();
        let names: Vec<String> = ckpt.names().map(str::to_string).collect();
        let (mut kept, mut widened, mut differing) = (0, 0, 0);
        for name in names {
            let Some(q) = ckpt.quantized(&name).unwrap() else {
                continue;
            };
            let Some((format, mut blocks)) = safetensors_blocks(&q) else {
                widened += 1;
                continue;
            };
            kept += 1;
            if tamper {
                blocks[1] ^= 0x01; // the first block's scale, its lowest mantissa bits
            }
            let t = ckpt.get(&name).unwrap();
            assert_eq!(t.dtype, WeightDtype::F32, "{name}");
            let want: Vec<u32> = t
                .bytes
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let got: Vec<u32> = safetensors_block_values(format, &blocks)
                .iter()
                .map(|v| v.to_bits())
                .collect();
            assert_eq!(got.len(), want.len(), "{name}");
            assert_eq!(q.shape(), [t.shape[0], t.shape[1]], "{name}");
            differing += got.iter().zip(&want).filter(|(a, b)| a != b).count();
        }
        (kept, widened, differing)
    }

    #[test]
    fn device_blocks_of_quantized_checkpoints_hold_the_loaders_values() {
        // compressed-tensors' and ModelOpt's own files: NVFP4 both conventions, FP8 per tensor
        // and per channel in blocks; the 32x32-block FP8 file has scales narrower than a device
        // block and stays widened.
        for (dir, blocks) in [
            ("ct-nvfp4", true),
            ("ct-fp8-tensor", true),
            ("ct-fp8-channel", true),
            ("ct-fp8-block", false),
            ("modelopt-nvfp4", true),
            ("modelopt-fp8", true),
        ] {
            let (kept, widened, differing) =
                blocks_read_back_as_the_loader(&fixtures().join(dir), false);
            assert_eq!(differing, 0, "{dir}");
            if blocks {
                assert!(
                    kept > 0 && widened == 0,
                    "{dir}: {kept} kept, {widened} widened"
                );
            } else {
                assert!(
                    kept == 0 && widened > 0,
                    "{dir}: {kept} kept, {widened} widened"
                );
            }
            // The canary: one scale bit changed in the blocks is seen.
            if blocks {
                let (_, _, differing) = blocks_read_back_as_the_loader(&fixtures().join(dir), true);
                assert!(differing > 0, "{dir}: a changed scale went unseen");
            }
        }
    }

    /// The CPU reference's kept arithmetic (`QuantizedLinear::kept`) is what the tiles hold:
    /// every weight as the kernel decodes it, bit for bit, and the same output scales, on
    /// compressed-tensors' and ModelOpt's own NVFP4 and FP8 files; the canary, a byte changed in
    /// the tiles (NVFP4: row 0's scale byte; FP8: a weight), is seen.
    #[test]
    fn tiles_hold_the_cpu_references_kept_arithmetic() {
        use strata_kernels::tiles::{decode_fp8_tiles, decode_nvfp4_tiles};
        for dir in [
            "ct-nvfp4",
            "modelopt-nvfp4",
            "ct-fp8-tensor",
            "ct-fp8-channel",
            "modelopt-fp8",
        ] {
            let ckpt = Checkpoint::open(&fixtures().join(dir)).unwrap();
            let names: Vec<String> = ckpt.names().map(str::to_string).collect();
            let mut checked = 0;
            for name in names {
                let Some(q) = ckpt.quantized(&name).unwrap() else {
                    continue;
                };
                let (Some(mut tiles), Some((weights, scales))) =
                    (safetensors_tiles(&q).unwrap(), q.kept().unwrap())
                else {
                    panic!("{dir}: {name} has no tiles or no kept arithmetic");
                };
                let [n, k] = q.shape();
                let format = tiles.format;
                let bits = |tiles: &[u8]| -> Vec<u16> {
                    match format {
                        TileFormat::Fp8 => decode_fp8_tiles(tiles, n, k),
                        _ => decode_nvfp4_tiles(tiles, n, k),
                    }
                    .iter()
                    .map(|w| w.to_bits())
                    .collect()
                };
                assert_eq!(bits(&tiles.data), weights, "{dir}: {name}");
                assert_eq!(tiles.scales, scales, "{dir}: {name}");
                // NVFP4: row 0's scale byte in the first tile; FP8: a weight byte.
                tiles.data[512] ^= 0x10;
                assert_ne!(bits(&tiles.data), weights, "{dir}: {name}: canary unseen");
                checked += 1;
            }
            assert_eq!(checked, 14, "{dir}");
        }
    }
}
