//! Launchers for `cuda/gemv_blocks.cu`: projections whose weights stay in a GGUF block format on
//! the device. Each kernel is the bf16 kernel's body over a loader that dequantizes a chunk of 8
//! weights in registers to exactly the bf16 the checkpoint loader widens the block to, so every
//! output is bitwise what the bf16 kernel gives on the widened tensor (the self-test checks it),
//! and batch invariance carries over unchanged.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use crate::gemv::{MMA_THREADS, MMA_X_ROWS, check_rows, check_shards, mma_rows, mma2_rows};
use crate::launch::{aligned16, grid, need_len, product, stride_blocks, to_u32};
use crate::{GemvOut, GemvVariant, KernelError, Kernels, ensure_shape};

/// A GGUF block format the device kernels read: `block_elems` weights of a row in `block_bytes`
/// bytes (layouts in `cuda/blocks.cuh`, the same as llama.cpp's files).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum BlockFormat {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
    /// NVFP4 as compressed-tensors stores it (group scales divided by the tensor scale), in
    /// strata's device blocks ([`BlockFormat::nvfp4_blocks`]).
    Nvfp4,
    /// NVFP4 as ModelOpt stores it (group scales multiplied by the tensor scale).
    Nvfp4Modelopt,
    /// FP8 e4m3 with one scale per tensor, row or 128 × 128 block, in strata's device blocks
    /// ([`BlockFormat::fp8_blocks`]).
    Fp8,
}

impl BlockFormat {
    pub const ALL: [BlockFormat; 8] = [
        BlockFormat::Q4_0,
        BlockFormat::Q4_1,
        BlockFormat::Q5_0,
        BlockFormat::Q5_1,
        BlockFormat::Q8_0,
        BlockFormat::Q4_K,
        BlockFormat::Q5_K,
        BlockFormat::Q6_K,
    ];

    /// The formats of quantized safetensors checkpoints, kept in strata's own device blocks.
    pub const SAFETENSORS: [BlockFormat; 3] = [
        BlockFormat::Nvfp4,
        BlockFormat::Nvfp4Modelopt,
        BlockFormat::Fp8,
    ];

    /// Every format the kernels take: the GGUF ones, then the safetensors ones.
    pub fn every() -> impl Iterator<Item = BlockFormat> {
        Self::ALL.into_iter().chain(Self::SAFETENSORS)
    }

    /// The format of ggml type number `id` (the GGUF tensor-info type), if the kernels take it.
    pub fn from_ggml_type(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.ggml_type() == id)
    }

    /// The ggml type number (the template argument of `BlockW` in `cuda/blocks.cuh`); the
    /// safetensors formats take numbers from 1001 on, which no ggml type has.
    pub fn ggml_type(self) -> u32 {
        match self {
            BlockFormat::Q4_0 => 2,
            BlockFormat::Q4_1 => 3,
            BlockFormat::Q5_0 => 6,
            BlockFormat::Q5_1 => 7,
            BlockFormat::Q8_0 => 8,
            BlockFormat::Q4_K => 12,
            BlockFormat::Q5_K => 13,
            BlockFormat::Q6_K => 14,
            BlockFormat::Nvfp4 => 1001,
            BlockFormat::Nvfp4Modelopt => 1002,
            BlockFormat::Fp8 => 1003,
        }
    }

    /// The format's part of kernel names: `q4_k` in `gemv_mma_q4_k_bf16_x1`.
    pub fn kernel_name(self) -> &'static str {
        match self {
            BlockFormat::Q4_0 => "q4_0",
            BlockFormat::Q4_1 => "q4_1",
            BlockFormat::Q5_0 => "q5_0",
            BlockFormat::Q5_1 => "q5_1",
            BlockFormat::Q8_0 => "q8_0",
            BlockFormat::Q4_K => "q4_k",
            BlockFormat::Q5_K => "q5_k",
            BlockFormat::Q6_K => "q6_k",
            BlockFormat::Nvfp4 => "nvfp4",
            BlockFormat::Nvfp4Modelopt => "nvfp4_modelopt",
            BlockFormat::Fp8 => "fp8",
        }
    }

    /// The module holding this format's kernels (`gemv_blocks_<name>`, one per format; see
    /// `SOURCES` in src/lib.rs).
    pub fn module(self) -> &'static str {
        match self {
            BlockFormat::Q4_0 => "gemv_blocks_q4_0",
            BlockFormat::Q4_1 => "gemv_blocks_q4_1",
            BlockFormat::Q5_0 => "gemv_blocks_q5_0",
            BlockFormat::Q5_1 => "gemv_blocks_q5_1",
            BlockFormat::Q8_0 => "gemv_blocks_q8_0",
            BlockFormat::Q4_K => "gemv_blocks_q4_k",
            BlockFormat::Q5_K => "gemv_blocks_q5_k",
            BlockFormat::Q6_K => "gemv_blocks_q6_k",
            BlockFormat::Nvfp4 => "gemv_blocks_nvfp4",
            BlockFormat::Nvfp4Modelopt => "gemv_blocks_nvfp4_modelopt",
            BlockFormat::Fp8 => "gemv_blocks_fp8",
        }
    }

    /// Weights per block.
    pub fn block_elems(self) -> usize {
        match self {
            BlockFormat::Q4_K | BlockFormat::Q5_K | BlockFormat::Q6_K => 256,
            BlockFormat::Nvfp4 | BlockFormat::Nvfp4Modelopt | BlockFormat::Fp8 => 64,
            _ => 32,
        }
    }

    /// Bytes per block in a GGUF file (for the safetensors formats: in the device layout).
    pub fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q4_0 => 18,
            BlockFormat::Q4_1 => 20,
            BlockFormat::Q5_0 => 22,
            BlockFormat::Q5_1 => 24,
            BlockFormat::Q8_0 => 34,
            BlockFormat::Q4_K => 144,
            BlockFormat::Q5_K => 176,
            BlockFormat::Q6_K => 210,
            BlockFormat::Nvfp4 | BlockFormat::Nvfp4Modelopt => 40,
            BlockFormat::Fp8 => 68,
        }
    }

    /// Bytes per block on the device: the file's block with Q4_0's, Q5_0's and Q8_0's f16 scale
    /// padded to 4 bytes and Q6_K padded to 224 bytes, so the kernels' loads are aligned
    /// (`cuda/blocks.cuh`).
    pub fn device_block_bytes(self) -> usize {
        match self {
            BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0 => self.block_bytes() + 2,
            BlockFormat::Q6_K => 224,
            _ => self.block_bytes(),
        }
    }

    /// Device bytes of one row of `k` weights (`k` a multiple of [`BlockFormat::block_elems`]).
    pub fn row_bytes(self, k: usize) -> usize {
        k / self.block_elems() * self.device_block_bytes()
    }

    /// Whole blocks as a GGUF file stores them, in the device layout (zero padding).
    pub fn to_device(self, file: &[u8]) -> Vec<u8> {
        let (from, to) = (self.block_bytes(), self.device_block_bytes());
        if from == to {
            return file.to_vec();
        }
        let mut out = Vec::with_capacity(file.len() / from * to);
        for block in file.chunks_exact(from) {
            match self {
                // The f16 scale, two bytes of padding, the rest.
                BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0 => {
                    out.extend_from_slice(&block[..2]);
                    out.extend_from_slice(&[0, 0]);
                    out.extend_from_slice(&block[2..]);
                }
                _ => {
                    out.extend_from_slice(block);
                    out.resize(out.len() + to - from, 0);
                }
            }
        }
        out
    }
}

impl BlockFormat {
    /// A `[rows, cols]` NVFP4 weight in device blocks ([`BlockFormat::Nvfp4`] or
    /// [`BlockFormat::Nvfp4Modelopt`]): `packed` is `[rows, cols / 2]` (two e2m1 a byte, the even
    /// column in the low nibble), `group_scales` `[rows, cols / 16]` e4m3 bytes, `tensor_scale`
    /// the f32 tensor scale. Each 64 weights of a row become a block: the tensor scale, their 4
    /// group scales, their 32 bytes. `None` unless `cols` is a multiple of 64 and the parts
    /// have those sizes.
    pub fn nvfp4_blocks(
        packed: &[u8],
        group_scales: &[u8],
        tensor_scale: f32,
        (rows, cols): (usize, usize),
    ) -> Option<Vec<u8>> {
        if !cols.is_multiple_of(64)
            || packed.len() != rows * cols / 2
            || group_scales.len() != rows * cols / 16
        {
            return None;
        }
        let mut out = Vec::with_capacity(rows * cols / 64 * 40);
        for (data, scales) in packed.chunks_exact(32).zip(group_scales.chunks_exact(4)) {
            out.extend_from_slice(&tensor_scale.to_le_bytes());
            out.extend_from_slice(scales);
            out.extend_from_slice(data);
        }
        Some(out)
    }

    /// A `[rows, cols]` FP8 weight in device blocks ([`BlockFormat::Fp8`]): `data` is its e4m3
    /// bytes, one scale for each `scale_cols` columns of a row (`cols` for a scale per tensor or
    /// per row, 128 for 128 × 128 blocks), `scale(r, c)` the f32 scale of row `r`, column `c`.
    /// `None` unless `cols` and `scale_cols` are multiples of 64 (a device block has one scale)
    /// and `data` has `rows × cols` bytes.
    pub fn fp8_blocks(
        data: &[u8],
        (rows, cols): (usize, usize),
        scale_cols: usize,
        scale: impl Fn(usize, usize) -> f32,
    ) -> Option<Vec<u8>> {
        if !cols.is_multiple_of(64)
            || scale_cols == 0
            || !scale_cols.is_multiple_of(64)
            || data.len() != rows * cols
        {
            return None;
        }
        let mut out = Vec::with_capacity(rows * cols / 64 * 68);
        for (i, chunk) in data.chunks_exact(64).enumerate() {
            let (r, c) = (i / (cols / 64), i % (cols / 64) * 64);
            out.extend_from_slice(&scale(r, c).to_le_bytes());
            out.extend_from_slice(chunk);
        }
        Some(out)
    }
}

/// Checks a block weight of `n` rows of `k` columns: whole blocks, the MMA's `k % 32`, enough
/// bytes, a 16-byte aligned start.
fn check_weight(
    kernel: &'static str,
    format: BlockFormat,
    w_len: usize,
    w_ptr: u64,
    n: usize,
    k: usize,
) -> Result<(), KernelError> {
    ensure_shape!(
        k > 0 && k.is_multiple_of(format.block_elems()) && k.is_multiple_of(32),
        kernel,
        "k = {k} is not a positive multiple of {format:?}'s {} weights per block",
        format.block_elems()
    );
    need_len(
        kernel,
        "w",
        w_len,
        product(kernel, &[n, format.row_bytes(k)])?,
    )?;
    aligned16(kernel, "w", w_ptr)
}

impl Kernels {
    /// [`Kernels::gemv_with`] with `w` `[n, k]` in block format `format` (`n` rows of
    /// `format.row_bytes(k)` bytes): bitwise the bf16 GEMV of the same variant on the widened
    /// weights. `variant` is [`GemvVariant::Mma`] or [`GemvVariant::Mma2`]; `1 ≤ m ≤ 64`, `k` a
    /// multiple of the block and of 32.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_blocks<T: GemvOut>(
        &self,
        variant: GemvVariant,
        stream: &Arc<CudaStream>,
        y: &mut impl DevicePtrMut<T>,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<u8>,
        format: BlockFormat,
        (m, n, k): (usize, usize, usize),
    ) -> Result<(), KernelError> {
        const K: &str = "gemv_mma_blocks";
        check_rows(K, m)?;
        let (prefix, rows) = match variant {
            GemvVariant::Mma => ("gemv_mma", mma_rows(m)),
            GemvVariant::Mma2 => ("gemv_mma2", mma2_rows(m)),
            GemvVariant::Fma | GemvVariant::MmaRuns | GemvVariant::Mma2Runs => {
                return Err(KernelError::Shape {
                    kernel: K,
                    message: format!(
                        "block formats take the Mma and Mma2 variants only, not {variant:?}"
                    ),
                });
            }
        };
        need_len(K, "y", y.len(), product(K, &[m, n])?)?;
        need_len(K, "x", x.len(), product(K, &[m, k])?)?;
        let n32 = to_u32(K, "n", n)?;
        to_u32(K, "k", k)?;
        let (yp, _y) = y.device_ptr_mut(stream);
        let (xp, _x) = x.device_ptr(stream);
        let (wp, _w) = w.device_ptr(stream);
        check_weight(K, format, w.len(), wp, n, k)?;
        aligned16(K, "x", xp)?;
        if n == 0 {
            return Ok(());
        }
        let name = format!(
            "{prefix}_{}_{}_x{}",
            format.kernel_name(),
            T::OUT,
            m.div_ceil(MMA_X_ROWS)
        );
        let f = self.function(format.module(), &name)?;
        let (m32, k32) = (m as u32, k as u32);
        let mut b = stream.launch_builder(f);
        b.arg(&yp).arg(&xp).arg(&wp).arg(&m32).arg(&n32).arg(&k32);
        // SAFETY: lengths, alignment and argument types checked above match the kernel.
        unsafe { b.launch(grid(n32.div_ceil(rows), MMA_THREADS)) }?;
        Ok(())
    }

    /// [`Kernels::gemv_shards`] with `w` `[n, ld]` in block format `format`: shard `s`'s
    /// partial over columns `s * kslice ..` is bitwise the bf16 kernel's on the widened weights.
    /// `kslice` a multiple of the block and of 32; otherwise as there.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_shards_blocks(
        &self,
        stream: &Arc<CudaStream>,
        y: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<u8>,
        format: BlockFormat,
        (m, n): (usize, usize),
        (shards, kslice, ld): (usize, usize, usize),
        y_stride: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "gemv_mma_shards_blocks";
        // Whole blocks and whole 32-column MMA steps per slice (32 divides every block size).
        check_shards(
            K,
            (m, n),
            (shards, kslice, ld),
            (format.block_elems(), y_stride),
            (x.len(), y.len()),
        )?;
        let n32 = to_u32(K, "n", n)?;
        let (yp, _y) = y.device_ptr_mut(stream);
        let (xp, _x) = x.device_ptr(stream);
        let (wp, _w) = w.device_ptr(stream);
        check_weight(K, format, w.len(), wp, n, ld)?;
        aligned16(K, "x", xp)?;
        if n == 0 {
            return Ok(());
        }
        let (m32, kslice32, ld32) = (m as u32, to_u32(K, "kslice", kslice)?, to_u32(K, "ld", ld)?);
        let shards32 = to_u32(K, "shards", shards)?;
        let stride64 = y_stride as u64;
        let name = format!(
            "gemv_mma_shards_{}_f32_x{}",
            format.kernel_name(),
            m.div_ceil(MMA_X_ROWS)
        );
        let f = self.function(format.module(), &name)?;
        let mut b = stream.launch_builder(f);
        b.arg(&yp).arg(&xp).arg(&wp);
        b.arg(&m32)
            .arg(&n32)
            .arg(&kslice32)
            .arg(&ld32)
            .arg(&stride64);
        let mut config = grid(n32.div_ceil(mma_rows(m)), MMA_THREADS);
        config.grid_dim.1 = shards32;
        // SAFETY: lengths, alignment and argument types checked above match the kernel.
        unsafe { b.launch(config) }?;
        Ok(())
    }

    /// `out[n, k]` (bf16) = `w` `[n, k]` in block format `format`, dequantized: the widened
    /// tensor the cuBLASLt GEMM of prompt rows multiplies by.
    pub fn dequantize(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<bf16>,
        w: &impl DevicePtr<u8>,
        format: BlockFormat,
        (n, k): (usize, usize),
    ) -> Result<(), KernelError> {
        const K: &str = "dequant";
        need_len(K, "out", out.len(), product(K, &[n, k])?)?;
        let (n32, k32) = (to_u32(K, "n", n)?, to_u32(K, "k", k)?);
        let (op, _o) = out.device_ptr_mut(stream);
        let (wp, _w) = w.device_ptr(stream);
        check_weight(K, format, w.len(), wp, n, k)?;
        aligned16(K, "out", op)?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function(
            format.module(),
            &format!("dequant_{}", format.kernel_name()),
        )?;
        let mut b = stream.launch_builder(f);
        b.arg(&op).arg(&wp).arg(&n32).arg(&k32);
        // SAFETY: lengths, alignment and argument types checked above match the kernel.
        unsafe { b.launch(grid(stride_blocks(n * k / 8, 256), 256)) }?;
        Ok(())
    }

    /// [`Kernels::embed_rows`] from a table in block format `format` (`rows.len()` rows of
    /// `hidden` weights): each gathered row is the widened table's row bit for bit.
    #[allow(clippy::too_many_arguments)]
    pub fn embed_rows_blocks(
        &self,
        stream: &Arc<CudaStream>,
        out: &mut impl DevicePtrMut<bf16>,
        table: &impl DevicePtr<u8>,
        format: BlockFormat,
        ids: &impl DevicePtr<u32>,
        tokens: usize,
        hidden: usize,
        rows: std::ops::Range<usize>,
        fill: bf16,
    ) -> Result<(), KernelError> {
        const K: &str = "embed_blocks";
        need_len(K, "out", out.len(), product(K, &[tokens, hidden])?)?;
        need_len(K, "ids", ids.len(), tokens)?;
        let hidden32 = to_u32(K, "hidden", hidden)?;
        let (first, count) = (
            to_u32(K, "first row", rows.start)?,
            to_u32(K, "rows", rows.len())?,
        );
        let blocks = to_u32(K, "tokens", tokens)?;
        let (o, _o) = out.device_ptr_mut(stream);
        let (t, _t) = table.device_ptr(stream);
        let (i, _i) = ids.device_ptr(stream);
        check_weight(K, format, table.len(), t, rows.len(), hidden)?;
        aligned16(K, "out", o)?;
        if tokens == 0 {
            return Ok(());
        }
        let f = self.function(format.module(), &format!("embed_{}", format.kernel_name()))?;
        let fill_bits = u32::from(fill.to_bits());
        let mut b = stream.launch_builder(f);
        b.arg(&o).arg(&t).arg(&i).arg(&hidden32);
        b.arg(&first).arg(&count).arg(&fill_bits);
        // SAFETY: lengths, alignment and argument types checked above match the kernel.
        unsafe { b.launch(grid(blocks, 256)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_format_has_its_own_module_built_for_it_alone() {
        for format in BlockFormat::every() {
            let source = crate::SOURCES
                .iter()
                .find(|s| s.module == format.module())
                .unwrap_or_else(|| panic!("no module for {format:?}"));
            let first = source.text.lines().next().unwrap_or_default();
            let want = format!("MACRO({}, {})", format.ggml_type(), format.kernel_name());
            assert_eq!(first, format!("#define BLOCK_FORMAT(MACRO) {want}"));
        }
        let blocks = crate::SOURCES
            .iter()
            .filter(|s| s.module.starts_with("gemv_blocks_"));
        assert_eq!(blocks.count(), BlockFormat::every().count());
    }

    #[test]
    fn formats_round_trip_through_their_ggml_numbers_and_size_rows() {
        for f in BlockFormat::ALL {
            assert_eq!(BlockFormat::from_ggml_type(f.ggml_type()), Some(f));
        }
        assert_eq!(BlockFormat::from_ggml_type(0), None); // F32 is not a block format
        for f in BlockFormat::SAFETENSORS {
            // Not ggml types: a GGUF tensor never takes these kernels.
            assert_eq!(BlockFormat::from_ggml_type(f.ggml_type()), None);
            assert_eq!(f.device_block_bytes(), f.block_bytes());
        }
        assert_eq!(BlockFormat::Q4_K.row_bytes(4096), 16 * 144);
        assert_eq!(BlockFormat::Q8_0.row_bytes(576), 18 * 36);
        assert_eq!(BlockFormat::Q6_K.row_bytes(512), 2 * 224);
    }

    #[test]
    fn the_device_layout_pads_headers_and_keeps_every_byte() {
        let file: Vec<u8> = (0..68).map(|b| b as u8 + 1).collect(); // two Q8_0 blocks
        let dev = BlockFormat::Q8_0.to_device(&file);
        assert_eq!(dev.len(), 72);
        assert_eq!(&dev[..4], &[1, 2, 0, 0]);
        assert_eq!(&dev[4..36], &file[2..34]);
        assert_eq!(&dev[36..40], &[35, 36, 0, 0]);
        let q6: Vec<u8> = (0..210).map(|b| b as u8).collect();
        let dev = BlockFormat::Q6_K.to_device(&q6);
        assert_eq!((&dev[..210], &dev[210..]), (&q6[..], &[0u8; 14][..]));
        let q4k = vec![7u8; 144];
        assert_eq!(BlockFormat::Q4_K.to_device(&q4k), q4k);
        for f in BlockFormat::ALL {
            assert_eq!(f.device_block_bytes() % 4, 0, "{f:?}");
        }
    }
}
