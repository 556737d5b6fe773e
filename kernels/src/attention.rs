//! Attention over the paged KV cache: decode (one query token per sequence, split-KV) and prefill
//! (one sequence's chunk of query tokens, causal), both with GQA and an optional sliding window.
//! Kernels in `cuda/attention.cu`.
//!
//! # Layouts
//! - Q, K, V and the output are bf16; scores, softmax and accumulation are f32.
//! - Per layer, `k_cache` and `v_cache` are `[num_blocks, block_size, n_kv_heads, head_dim]`;
//!   position `p` of a sequence lives in block `table[p / block_size]` at offset
//!   `p % block_size`. Any positive `block_size` works (16 is the default).
//! - Query head `h` reads kv head `h / (n_q_heads / n_kv_heads)`. A sliding window `W > 0` lets
//!   the query at position `p` see keys in `(p - W, p]`; `W = 0` is full causal attention.
//!
//! # Numerics: what is bit-identical
//! Decode and the f32 prefill kernel ([`PrefillVariant::F32`]) run one canonical computation
//! per (query row, head), whichever kernel, batch or chunk it is in: keys in tiles of
//! `8192 / head_dim` positions aligned at absolute multiples of the tile, grouped in splits of
//! [`DECODE_SPLIT_TOKENS`] aligned at absolute multiples of 128; each score a single fma chain over
//! the dims in order; an online softmax per tile with per-key sequential sums; splits merged in
//! split order. All of it uses explicit round-to-nearest operations, and masked keys are skipped,
//! not multiplied by zero.
//!
//! The tensor-core prefill kernel ([`PrefillVariant::Mma`], the default for head_dim 64 and 128)
//! is FlashAttention-2 style: keys in tiles of 64 positions aligned at absolute multiples of 64,
//! visited in ascending order; scores and P·V by m16n8k16 bf16 MMAs with f32 accumulation; an
//! online softmax per tile and row in f32; the probabilities rounded to bf16 for P·V. Masked
//! keys get probability exactly 0 and a tile a row cannot see leaves its state unchanged, and an
//! MMA output row depends on its own query row only. Hence, for the same cache contents, scale,
//! window and head shape:
//! - decode output of a sequence is bit-identical whatever the batch size, the other sequences
//!   and `max_context` (it depends on its own context length only);
//! - prefill output of a token is bit-identical however the prompt is chunked (`start`, `n_new`),
//!   with either variant;
//! - with [`PrefillVariant::F32`] only, prefill's row for position `p` is bit-identical to decode
//!   with context length `p + 1`. The engine does not rely on it: prompt rows always take the
//!   prefill kernel and generated rows the decode kernel (DECISIONS: batch invariance by row
//!   role).
//!
//! Not identical: results across GPU architectures or CUDA versions (`ex2.approx`, the MMA unit
//! and the compiler's instruction choice may differ), across head dims or prefill variants, or
//! after any change to the tile/split constants; and the result only ever equals the exact
//! softmax to within bf16/f32 rounding (the self-test measures it against an f64 reference).
//!
//! Invalid device-side data never reads out of bounds: a decode context length of 0 or beyond the
//! block table or `max_context`, or a block-table entry `>= num_blocks`, yields NaN rows instead
//! (in prefill, every row of the kernel block that met the bad entry: up to 64 query rows).
//!
//! # Performance shape
//! Decode: one block per (split, kv head, sequence) reads each K/V byte of the split once for the
//! whole GQA group (up to 8 query heads per block, 16 at head_dim 128; larger groups take
//! several blocks, each reading the split again), staging
//! 16 KB tiles through `cp.async`; the grid is `ceil(max_context / 128)` splits, so a small batch
//! of short contexts fills few SMs. Prefill (tensor cores): one block of 4 warps per (64 query
//! tokens, q head), each warp 16 rows; K/V tiles double-buffered through `cp.async` and read by
//! `ldmatrix`; a warp skips the tiles none of its rows can see (the causal upper triangle, keys
//! before the window). Prefill (f32): plain FMA, 32 query rows (16 at head_dim 256) per block
//! sharing each K/V tile.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::launch::aligned16;
use crate::{KernelError, Kernels, ensure_shape};

/// Keys per decode split: a constant, so a sequence's reduction order never depends on the batch.
pub const DECODE_SPLIT_TOKENS: usize = 128;

/// Threads of a decode block and of a prefill block (fixed by the kernels' launch bounds).
const DECODE_THREADS: u32 = 128;
const PREFILL_THREADS: u32 = 256;
const COMBINE_THREADS: u32 = 128;
/// Dynamic shared memory a launch may use without opting in.
const DEFAULT_SMEM_LIMIT: usize = 48 * 1024;
/// Threads, query rows per block and keys per tile of the tensor-core prefill kernel (mirrors
/// `attn_mma::THREADS`, `BQ` and `BK` in attention.cu).
const MMA_THREADS: u32 = 128;
const MMA_QUERY_ROWS: usize = 64;
const MMA_TILE_KEYS: usize = 64;

/// The two prefill kernels. Each is chunk- and batch-invariant on its own; their results differ
/// in the last bits, so a backend uses one for every prompt row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillVariant {
    /// Tensor cores (m16n8k16 bf16 MMA, FlashAttention-2 style; P rounded to bf16 for P·V) for
    /// head_dim 64 and 128; the f32 kernel for head_dim 256.
    Mma,
    /// f32 FMA, the same canonical computation as decode: its row for position `p` is
    /// bit-identical to decode at context length `p + 1`.
    F32,
}

/// The prefill kernel [`Kernels::prefill_attention`] uses.
pub const DEFAULT_PREFILL_VARIANT: PrefillVariant = PrefillVariant::Mma;

/// Whether the tensor-core prefill kernel exists for `head_dim`.
fn mma_applies(head_dim: usize) -> bool {
    matches!(head_dim, 64 | 128)
}

/// Dynamic shared memory of the tensor-core prefill kernel: double-buffered K and V tiles of
/// [`MMA_TILE_KEYS`] rows of `head_dim + 8` bf16 (`attn_mma::Shape::SMEM`).
fn mma_smem_bytes(head_dim: usize) -> usize {
    4 * MMA_TILE_KEYS * (head_dim + 8) * 2
}

/// The head geometry of one layer's attention (per tensor-parallel rank).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionHeads {
    pub n_q_heads: usize,
    pub n_kv_heads: usize,
    /// 64, 128 or 256.
    pub head_dim: usize,
    /// Sliding window in tokens; 0 = none.
    pub window: usize,
    /// Score scale, normally `1 / sqrt(head_dim)`.
    pub scale: f32,
}

/// One layer's paged KV cache: `k` and `v` are `[num_blocks, block_size, n_kv_heads, head_dim]`.
#[derive(Debug)]
pub struct PagedKv<'a> {
    pub k: CudaView<'a, bf16>,
    pub v: CudaView<'a, bf16>,
    pub block_size: usize,
    pub num_blocks: usize,
}

/// A decode step: one query token for each of `batch` sequences.
#[derive(Debug)]
pub struct DecodeBatch<'a> {
    /// `[batch, n_q_heads, head_dim]`.
    pub q: CudaView<'a, bf16>,
    /// `[batch, max_blocks_per_seq]` physical block ids.
    pub block_tables: CudaView<'a, u32>,
    pub max_blocks_per_seq: usize,
    /// `[batch]`: keys `0 .. len` are attended, the current token's K/V already in the cache.
    pub context_lens: CudaView<'a, u32>,
    /// Upper bound on every context length; sizes the grid and the workspace. A length above it
    /// yields a NaN row.
    pub max_context: usize,
}

/// A prefill chunk of one sequence: query tokens at positions `start .. start + n_new`, whose
/// keys and values (positions `0 .. start + n_new`) are already in the cache.
#[derive(Debug)]
pub struct PrefillChunk<'a> {
    /// `[n_new, n_q_heads, head_dim]`.
    pub q: CudaView<'a, bf16>,
    /// The sequence's block table; must cover `start + n_new` positions.
    pub block_table: CudaView<'a, u32>,
    pub start: usize,
    pub n_new: usize,
}

/// f32 elements of the decode workspace for `batch` sequences of at most `max_context` tokens:
/// per (sequence, query head, split) a max, a sum and `head_dim` accumulators.
pub fn decode_workspace_elems(
    batch: usize,
    n_q_heads: usize,
    head_dim: usize,
    max_context: usize,
) -> usize {
    batch * n_q_heads * max_context.div_ceil(DECODE_SPLIT_TOKENS) * (head_dim + 2)
}

/// Keys per tile for a head dim (16 KB of bf16 per K or V tile), as in the kernels.
fn tile_keys(head_dim: usize) -> usize {
    8192 / head_dim
}

/// Dynamic shared memory of one block, mirroring the layout in `attend` (attention.cu).
fn smem_bytes(head_dim: usize, rows: usize, prefill: bool) -> usize {
    let tk = tile_keys(head_dim);
    let row_offsets = 2 * tk * 8;
    let kv_tiles = 2 * tk * (head_dim + 8) * 2;
    let queries = rows * head_dim * 4;
    let scores = rows * tk * 4;
    let running = if prefill { rows * head_dim * 4 } else { 0 };
    row_offsets + kv_tiles + queries + scores + running
}

/// Query heads per block (`gc`) and head chunks per kv head for a block of `rows` rows.
fn head_chunks(group: usize, rows: usize) -> (usize, usize) {
    let gc = group.min(rows);
    (gc, group.div_ceil(gc))
}

fn to_i32(value: usize, kernel: &'static str, what: &str) -> Result<i32, KernelError> {
    i32::try_from(value).map_err(|_| KernelError::Shape {
        kernel,
        message: format!("{what} = {value} does not fit the kernel's 32-bit index"),
    })
}

/// The device address of a view (for alignment checks).
fn address<T>(view: &CudaView<'_, T>, stream: &CudaStream) -> u64 {
    let (ptr, _sync) = view.device_ptr(stream);
    ptr
}

fn address_mut<T>(view: &CudaViewMut<'_, T>, stream: &CudaStream) -> u64 {
    let (ptr, _sync) = view.device_ptr(stream);
    ptr
}

/// The head dimensions the attention kernels are compiled for.
pub const ATTENTION_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Checks shared by both kernels: head geometry and the cache's shape and alignment.
fn check_heads_and_cache(
    kernel: &'static str,
    heads: &AttentionHeads,
    cache: &PagedKv<'_>,
    stream: &CudaStream,
) -> Result<(), KernelError> {
    ensure_shape!(
        ATTENTION_HEAD_DIMS.contains(&heads.head_dim),
        kernel,
        "head_dim {} unsupported (64, 128 or 256)",
        heads.head_dim
    );
    ensure_shape!(
        heads.n_kv_heads > 0
            && heads.n_q_heads > 0
            && heads.n_q_heads.is_multiple_of(heads.n_kv_heads),
        kernel,
        "n_q_heads {} is not a positive multiple of n_kv_heads {}",
        heads.n_q_heads,
        heads.n_kv_heads
    );
    ensure_shape!(
        heads.scale.is_finite() && heads.scale > 0.0,
        kernel,
        "scale {} must be finite and positive",
        heads.scale
    );
    ensure_shape!(
        cache.block_size > 0 && cache.num_blocks > 0,
        kernel,
        "block_size {} and num_blocks {} must be positive",
        cache.block_size,
        cache.num_blocks
    );
    ensure_shape!(
        u32::try_from(cache.num_blocks).is_ok(),
        kernel,
        "num_blocks {} exceeds u32",
        cache.num_blocks
    );
    let elems = cache
        .num_blocks
        .checked_mul(cache.block_size)
        .and_then(|n| n.checked_mul(heads.n_kv_heads * heads.head_dim));
    ensure_shape!(
        elems == Some(cache.k.len()) && elems == Some(cache.v.len()),
        kernel,
        "k/v cache lengths {} / {} != num_blocks {} x block_size {} x n_kv_heads {} x head_dim {}",
        cache.k.len(),
        cache.v.len(),
        cache.num_blocks,
        cache.block_size,
        heads.n_kv_heads,
        heads.head_dim
    );
    aligned16(kernel, "k_cache", address(&cache.k, stream))?;
    aligned16(kernel, "v_cache", address(&cache.v, stream))?;
    Ok(())
}

impl Kernels {
    /// Decode attention for a batch of sequences, one query token each, into `out`
    /// `[batch, n_q_heads, head_dim]`.
    ///
    /// Two launches on `stream`: each (split of [`DECODE_SPLIT_TOKENS`] keys, kv head, sequence)
    /// writes a partial (max, sum, accumulators) into `workspace`, which must hold at least
    /// [`decode_workspace_elems`]`(batch, n_q_heads, head_dim, max_context)` f32; then a combine
    /// merges each row's splits in split order. Nothing is allocated, so the pair can be captured
    /// in a CUDA graph for a fixed `batch` and `max_context`.
    pub fn decode_attention(
        &self,
        stream: &Arc<CudaStream>,
        heads: &AttentionHeads,
        cache: &PagedKv<'_>,
        batch: &DecodeBatch<'_>,
        workspace: &mut CudaViewMut<'_, f32>,
        out: &mut CudaViewMut<'_, bf16>,
    ) -> Result<(), KernelError> {
        const K: &str = "decode_attention";
        let n = check_decode(heads, cache, batch, workspace, out, stream)?;
        if n == 0 {
            return Ok(());
        }
        let d = heads.head_dim;
        let group = heads.n_q_heads / heads.n_kv_heads;
        // Rows per block: the whole group when it fits (each K/V byte read once per group);
        // 16 rows only at head_dim 128, where they still fit the default shared memory.
        let rows = match group {
            0..=4 => 4,
            5..=8 => 8,
            _ if d == 128 => 16,
            _ => 8,
        };
        let (gc, n_chunks) = head_chunks(group, rows);
        let grid_y = heads.n_kv_heads * n_chunks;
        ensure_shape!(
            grid_y <= 65535,
            K,
            "n_kv_heads x head chunks {grid_y} > 65535"
        );
        let max_splits = batch.max_context.div_ceil(DECODE_SPLIT_TOKENS);
        let table_cap = batch.max_blocks_per_seq.checked_mul(cache.block_size);
        ensure_shape!(
            table_cap.is_some_and(|c| i32::try_from(c).is_ok())
                && i32::try_from(max_splits * DECODE_SPLIT_TOKENS).is_ok(),
            K,
            "max_blocks_per_seq x block_size or max_context exceeds i32"
        );

        let batch_i = to_i32(n, K, "batch")?;
        let n_q = to_i32(heads.n_q_heads, K, "n_q_heads")?;
        let n_kv = to_i32(heads.n_kv_heads, K, "n_kv_heads")?;
        let gc_i = to_i32(gc, K, "heads per block")?;
        let n_chunks_i = to_i32(n_chunks, K, "head chunks")?;
        let mbps = to_i32(batch.max_blocks_per_seq, K, "max_blocks_per_seq")?;
        let block_size = to_i32(cache.block_size, K, "block_size")?;
        let num_blocks = cache.num_blocks as u32; // checked above
        let max_splits_i = to_i32(max_splits, K, "max_splits")?;
        let window = to_i32(heads.window, K, "window")?;
        let head_dim = to_i32(d, K, "head_dim")?;
        let scale = heads.scale;

        let name = match (d, rows) {
            (64, 4) => "attn_decode_d64_r4",
            (64, _) => "attn_decode_d64_r8",
            (128, 4) => "attn_decode_d128_r4",
            (128, 8) => "attn_decode_d128_r8",
            (128, _) => "attn_decode_d128_r16",
            (_, 4) => "attn_decode_d256_r4",
            _ => "attn_decode_d256_r8",
        };
        let func = self.function("attention", name)?;
        let cfg = LaunchConfig {
            grid_dim: (max_splits as u32, grid_y as u32, n as u32),
            block_dim: (DECODE_THREADS, 1, 1),
            shared_mem_bytes: smem_bytes(d, rows, false) as u32,
        };
        let mut launch = stream.launch_builder(func);
        launch
            .arg(&batch.q)
            .arg(&cache.k)
            .arg(&cache.v)
            .arg(&batch.block_tables)
            .arg(&batch.context_lens)
            .arg(&mut *workspace)
            .arg(&batch_i)
            .arg(&n_q)
            .arg(&n_kv)
            .arg(&gc_i)
            .arg(&n_chunks_i)
            .arg(&mbps)
            .arg(&block_size)
            .arg(&num_blocks)
            .arg(&max_splits_i)
            .arg(&window)
            .arg(&scale);
        // SAFETY: the argument list matches `attn_decode_d*_r*` in attention.cu; every buffer's
        // length and alignment was checked above against the layout the kernel indexes, and the
        // kernel bounds every device-side value (lengths, table entries) before using it.
        unsafe { launch.launch(cfg) }?;

        let func = self.function("attention", "attn_decode_combine")?;
        let cfg = LaunchConfig {
            grid_dim: (heads.n_q_heads as u32, n as u32, 1),
            block_dim: (COMBINE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(func);
        launch
            .arg(&mut *workspace)
            .arg(&batch.context_lens)
            .arg(&mut *out)
            .arg(&batch_i)
            .arg(&n_q)
            .arg(&head_dim)
            .arg(&mbps)
            .arg(&block_size)
            .arg(&max_splits_i)
            .arg(&window);
        // SAFETY: matches `attn_decode_combine`; it reads only the partials the first launch
        // wrote for each row's splits (recomputed from the same length and window) and writes
        // `out`, whose length was checked.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// Prefill attention for one sequence's chunk into `out` `[n_new, n_q_heads, head_dim]`:
    /// causal over positions `0 ..= start + i` (and the window), keys read from the cache.
    /// Uses [`DEFAULT_PREFILL_VARIANT`].
    pub fn prefill_attention(
        &self,
        stream: &Arc<CudaStream>,
        heads: &AttentionHeads,
        cache: &PagedKv<'_>,
        chunk: &PrefillChunk<'_>,
        out: &mut CudaViewMut<'_, bf16>,
    ) -> Result<(), KernelError> {
        self.prefill_attention_with(DEFAULT_PREFILL_VARIANT, stream, heads, cache, chunk, out)
    }

    /// [`Kernels::prefill_attention`] with an explicit kernel. [`PrefillVariant::Mma`] runs the
    /// f32 kernel where the tensor-core one does not apply (head_dim 256).
    pub fn prefill_attention_with(
        &self,
        variant: PrefillVariant,
        stream: &Arc<CudaStream>,
        heads: &AttentionHeads,
        cache: &PagedKv<'_>,
        chunk: &PrefillChunk<'_>,
        out: &mut CudaViewMut<'_, bf16>,
    ) -> Result<(), KernelError> {
        const K: &str = "prefill_attention";
        check_heads_and_cache(K, heads, cache, stream)?;
        let d = heads.head_dim;
        let row = heads.n_q_heads * d;
        ensure_shape!(
            chunk.q.len() == chunk.n_new * row && out.len() == chunk.n_new * row,
            K,
            "q {} / out {} elements != n_new {} x n_q_heads {} x head_dim {d}",
            chunk.q.len(),
            out.len(),
            chunk.n_new,
            heads.n_q_heads
        );
        if chunk.n_new == 0 {
            return Ok(());
        }
        let end = chunk.start.checked_add(chunk.n_new);
        ensure_shape!(
            end.is_some_and(|e| e <= chunk.block_table.len().saturating_mul(cache.block_size)),
            K,
            "positions up to {} + {} exceed the block table ({} blocks of {})",
            chunk.start,
            chunk.n_new,
            chunk.block_table.len(),
            cache.block_size
        );
        ensure_shape!(
            end.is_some_and(|e| i32::try_from(e).is_ok()),
            K,
            "start + n_new exceeds i32"
        );
        aligned16(K, "q", address(&chunk.q, stream))?;
        ensure_shape!(
            address_mut(out, stream).is_multiple_of(4),
            K,
            "out must be 4-byte aligned"
        );
        let args = PrefillArgs {
            n_new: to_i32(chunk.n_new, K, "n_new")?,
            start: to_i32(chunk.start, K, "start")?,
            n_q: to_i32(heads.n_q_heads, K, "n_q_heads")?,
            n_kv: to_i32(heads.n_kv_heads, K, "n_kv_heads")?,
            block_size: to_i32(cache.block_size, K, "block_size")?,
            num_blocks: cache.num_blocks as u32, // checked in check_heads_and_cache
            window: to_i32(heads.window, K, "window")?,
            scale: heads.scale,
        };
        match variant {
            PrefillVariant::Mma if mma_applies(d) => {
                self.prefill_mma(stream, heads, cache, chunk, out, &args)
            }
            _ => self.prefill_f32(stream, heads, cache, chunk, out, &args),
        }
    }

    /// The tensor-core kernel: one block per (64 query tokens, q head).
    fn prefill_mma(
        &self,
        stream: &Arc<CudaStream>,
        heads: &AttentionHeads,
        cache: &PagedKv<'_>,
        chunk: &PrefillChunk<'_>,
        out: &mut CudaViewMut<'_, bf16>,
        args: &PrefillArgs,
    ) -> Result<(), KernelError> {
        const K: &str = "prefill_attention";
        let d = heads.head_dim;
        ensure_shape!(
            heads.n_q_heads <= 65535,
            K,
            "n_q_heads {} > 65535",
            heads.n_q_heads
        );
        let name = if d == 64 {
            "attn_prefill_mma_d64"
        } else {
            "attn_prefill_mma_d128"
        };
        let func = self.function("attention", name)?;
        let smem = mma_smem_bytes(d);
        if smem > DEFAULT_SMEM_LIMIT {
            func.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        let cfg = LaunchConfig {
            grid_dim: (
                chunk.n_new.div_ceil(MMA_QUERY_ROWS) as u32, // n_new < 2^31 (checked)
                heads.n_q_heads as u32,
                1,
            ),
            block_dim: (MMA_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut launch = stream.launch_builder(func);
        launch
            .arg(&chunk.q)
            .arg(&cache.k)
            .arg(&cache.v)
            .arg(&chunk.block_table)
            .arg(&mut *out)
            .arg(&args.n_new)
            .arg(&args.start)
            .arg(&args.n_q)
            .arg(&args.n_kv)
            .arg(&args.block_size)
            .arg(&args.num_blocks)
            .arg(&args.window)
            .arg(&args.scale);
        // SAFETY: the argument list matches `attn_prefill_mma_d*` in attention.cu; buffer lengths
        // and alignment were checked by the caller, the block table covers every position read,
        // and the kernel bounds each table entry by `num_blocks` before reading the cache.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// The f32 kernel: one block per (tokens, kv head x head chunk), 32 rows (16 at d = 256).
    fn prefill_f32(
        &self,
        stream: &Arc<CudaStream>,
        heads: &AttentionHeads,
        cache: &PagedKv<'_>,
        chunk: &PrefillChunk<'_>,
        out: &mut CudaViewMut<'_, bf16>,
        args: &PrefillArgs,
    ) -> Result<(), KernelError> {
        const K: &str = "prefill_attention";
        let d = heads.head_dim;
        let group = heads.n_q_heads / heads.n_kv_heads;
        let rows = if d == 256 { 16 } else { 32 };
        let (gc, n_chunks) = head_chunks(group, rows);
        let tokens_per_block = rows / gc;
        let grid_x = chunk.n_new.div_ceil(tokens_per_block);
        let grid_y = heads.n_kv_heads * n_chunks;
        ensure_shape!(
            grid_y <= 65535,
            K,
            "n_kv_heads x head chunks {grid_y} > 65535"
        );
        let gc_i = to_i32(gc, K, "heads per block")?;
        let n_chunks_i = to_i32(n_chunks, K, "head chunks")?;

        let name = match d {
            64 => "attn_prefill_d64_r32",
            128 => "attn_prefill_d128_r32",
            _ => "attn_prefill_d256_r16",
        };
        let func = self.function("attention", name)?;
        let smem = smem_bytes(d, rows, true);
        if smem > DEFAULT_SMEM_LIMIT {
            func.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        let cfg = LaunchConfig {
            grid_dim: (grid_x as u32, grid_y as u32, 1),
            block_dim: (PREFILL_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut launch = stream.launch_builder(func);
        launch
            .arg(&chunk.q)
            .arg(&cache.k)
            .arg(&cache.v)
            .arg(&chunk.block_table)
            .arg(&mut *out)
            .arg(&args.n_new)
            .arg(&args.start)
            .arg(&args.n_q)
            .arg(&args.n_kv)
            .arg(&gc_i)
            .arg(&n_chunks_i)
            .arg(&args.block_size)
            .arg(&args.num_blocks)
            .arg(&args.window)
            .arg(&args.scale);
        // SAFETY: the argument list matches `attn_prefill_d*_r*` in attention.cu; buffer lengths
        // and alignment were checked by the caller, the block table covers every position read,
        // and the kernel bounds each table entry by `num_blocks` before reading the cache.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}

/// `decode_attention`'s arguments against the layout its kernels index: the batch's rows, its
/// block tables, the workspace, alignments and the grid's limits. Returns the batch size.
fn check_decode(
    heads: &AttentionHeads,
    cache: &PagedKv<'_>,
    batch: &DecodeBatch<'_>,
    workspace: &mut CudaViewMut<'_, f32>,
    out: &mut CudaViewMut<'_, bf16>,
    stream: &Arc<CudaStream>,
) -> Result<usize, KernelError> {
    const K: &str = "decode_attention";
    check_heads_and_cache(K, heads, cache, stream)?;
    let d = heads.head_dim;
    let n = batch.context_lens.len();
    let row = heads.n_q_heads * d;
    ensure_shape!(
        batch.q.len() == n * row && out.len() == n * row,
        K,
        "q {} / out {} elements != batch {n} x n_q_heads {} x head_dim {d}",
        batch.q.len(),
        out.len(),
        heads.n_q_heads
    );
    ensure_shape!(
        batch.block_tables.len() == n * batch.max_blocks_per_seq,
        K,
        "block_tables {} elements != batch {n} x max_blocks_per_seq {}",
        batch.block_tables.len(),
        batch.max_blocks_per_seq
    );
    if n == 0 {
        return Ok(0);
    }
    ensure_shape!(
        batch.max_context > 0 && batch.max_blocks_per_seq > 0,
        K,
        "max_context {} and max_blocks_per_seq {} must be positive",
        batch.max_context,
        batch.max_blocks_per_seq
    );
    ensure_shape!(n <= 65535, K, "batch {n} exceeds the grid's 65535");
    let need = decode_workspace_elems(n, heads.n_q_heads, d, batch.max_context);
    ensure_shape!(
        workspace.len() >= need,
        K,
        "workspace {} f32 < {need} needed (decode_workspace_elems)",
        workspace.len()
    );
    aligned16(K, "q", address(&batch.q, stream))?;
    ensure_shape!(
        address_mut(workspace, stream).is_multiple_of(8)
            && address_mut(out, stream).is_multiple_of(4),
        K,
        "workspace must be 8-byte and out 4-byte aligned"
    );
    Ok(n)
}

/// The scalar launch arguments both prefill kernels take, converted and checked once.
struct PrefillArgs {
    n_new: i32,
    start: i32,
    n_q: i32,
    n_kv: i32,
    block_size: i32,
    num_blocks: u32,
    window: i32,
    scale: f32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_counts_splits_per_row() {
        assert_eq!(decode_workspace_elems(2, 4, 128, 1), 2 * 4 * 130);
        assert_eq!(decode_workspace_elems(2, 4, 128, 128), 2 * 4 * 130);
        assert_eq!(decode_workspace_elems(2, 4, 128, 129), 2 * 4 * 2 * 130);
        assert_eq!(decode_workspace_elems(0, 4, 128, 4096), 0);
    }

    #[test]
    fn shared_memory_fits_the_targets() {
        // Decode stays under the default limit (no opt-in needed inside a graph); prefill fits
        // the smallest opt-in limit among the targets (99 KB on sm_86/89/120).
        for d in [64, 128, 256] {
            let decode_rows: &[usize] = if d == 128 { &[4, 8, 16] } else { &[4, 8] };
            for &rows in decode_rows {
                // ptxas reports at most 272 bytes of static shared memory beside it.
                assert!(
                    smem_bytes(d, rows, false) + 272 <= DEFAULT_SMEM_LIMIT,
                    "d={d} r={rows}"
                );
            }
            let rows = if d == 256 { 16 } else { 32 };
            assert!(smem_bytes(d, rows, true) <= 99 * 1024, "d={d}");
        }
        // The tensor-core prefill: its 1040 bytes of static shared memory (row offsets) beside.
        for d in [64, 128] {
            assert!(mma_smem_bytes(d) + 1040 <= 99 * 1024, "mma d={d}");
        }
        assert!(mma_smem_bytes(64) <= DEFAULT_SMEM_LIMIT);
    }

    #[test]
    fn the_mma_kernel_takes_head_dims_64_and_128_only() {
        assert!(mma_applies(64) && mma_applies(128));
        assert!(!mma_applies(256) && !mma_applies(96));
        assert_eq!(DEFAULT_PREFILL_VARIANT, PrefillVariant::Mma);
    }

    #[test]
    fn head_chunks_cover_the_group() {
        assert_eq!(head_chunks(1, 4), (1, 1));
        assert_eq!(head_chunks(7, 8), (7, 1));
        assert_eq!(head_chunks(16, 8), (8, 2));
        assert_eq!(head_chunks(48, 32), (32, 2));
    }
}
