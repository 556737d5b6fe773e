// Projections whose weights stay in a GGUF block format on the device (blocks.cuh): the decode
// GEMV (both phase counts), the row-parallel shard GEMV, a dequantizer to bf16 for the cuBLASLt
// GEMM of prompt rows, and the embedding gather, for one format per module (below). Names carry
// the format: `gemv_mma_q4_k_bf16_x2`, `dequant_q6_k`, ...
//
// The GEMVs run gemv_mma.cuh's body unchanged with a BlockW<F> loader, and a BlockW<F> chunk is
// bit for bit the bf16 the checkpoint loader would widen the block to: every output equals the
// bf16-weight kernel's on the widened tensor (`strata kernels selftest` checks it), so the batch
// invariance of the bf16 path holds here as it is. With one x tile (XT = 1, up to 16 rows) a GEMV
// is built for two blocks per SM.
#include "gemv_mma.cuh"

#define GEMV_BLOCK_ENTRIES(F, NAME, XT)                                                            \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, XT == 1 ? 2 : 1)                  \
        gemv_mma_##NAME##_bf16_x##XT(__nv_bfloat16* __restrict__ y,                                \
                                     const __nv_bfloat16* __restrict__ x, const u8* __restrict__ w, \
                                     u32 m, u32 n, u32 k) {                                        \
        gemv_mma_body<XT, MMA_WARPS, false>(y, x, BlockW<F>{w, block_row_bytes<F>(k)}, m, n, k, k, \
                                            blockIdx.x);                                           \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, XT == 1 ? 2 : 1)                  \
        gemv_mma_##NAME##_f32_x##XT(float* __restrict__ y, const __nv_bfloat16* __restrict__ x,    \
                                    const u8* __restrict__ w, u32 m, u32 n, u32 k) {               \
        gemv_mma_body<XT, MMA_WARPS, false>(y, x, BlockW<F>{w, block_row_bytes<F>(k)}, m, n, k, k, \
                                            blockIdx.x);                                           \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, XT == 1 ? 2 : 1)                  \
        gemv_mma2_##NAME##_bf16_x##XT(__nv_bfloat16* __restrict__ y,                               \
                                      const __nv_bfloat16* __restrict__ x,                         \
                                      const u8* __restrict__ w, u32 m, u32 n, u32 k) {             \
        gemv_mma_body<XT, MMA2_PHASES, false>(y, x, BlockW<F>{w, block_row_bytes<F>(k)}, m, n, k,  \
                                              k, blockIdx.x);                                      \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, XT == 1 ? 2 : 1)                  \
        gemv_mma2_##NAME##_f32_x##XT(float* __restrict__ y, const __nv_bfloat16* __restrict__ x,   \
                                     const u8* __restrict__ w, u32 m, u32 n, u32 k) {              \
        gemv_mma_body<XT, MMA2_PHASES, false>(y, x, BlockW<F>{w, block_row_bytes<F>(k)}, m, n, k,  \
                                              k, blockIdx.x);                                      \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32, XT == 1 ? 2 : 1)                  \
        gemv_mma_shards_##NAME##_f32_x##XT(float* __restrict__ y,                                  \
                                           const __nv_bfloat16* __restrict__ x,                    \
                                           const u8* __restrict__ w, u32 m, u32 n, u32 kslice,     \
                                           u32 ld, u64 y_stride) {                                 \
        const u32 s = blockIdx.y;                                                                  \
        gemv_mma_body<XT, MMA_WARPS, true>(y + (u64)s * y_stride, x + (u64)s * kslice,             \
                                           BlockW<F>{w, block_row_bytes<F>(ld)}.from_col(s * kslice), \
                                           m, n, kslice, ld, blockIdx.x);                          \
    }

// out[n, k] (bf16, row-major) = the rows of w, dequantized: grid-stride over 8-element chunks.
// out[t, :] = row ids[t] - first of the table, dequantized, for ids in first .. first + rows;
// any other id writes a row of `fill` (as the bf16 `embed` kernel).
#define BLOCK_FORMAT_KERNELS(F, NAME)                                                              \
    GEMV_BLOCK_ENTRIES(F, NAME, 1)                                                                 \
    GEMV_BLOCK_ENTRIES(F, NAME, 2)                                                                 \
    GEMV_BLOCK_ENTRIES(F, NAME, 3)                                                                 \
    GEMV_BLOCK_ENTRIES(F, NAME, 4)                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        dequant_##NAME(__nv_bfloat16* __restrict__ out, const u8* __restrict__ w, u32 n, u32 k) {  \
        const BlockW<F> src{w, block_row_bytes<F>(k)};                                             \
        const u32 chunks = k / 8;                                                                  \
        const u64 total = (u64)n * chunks;                                                         \
        const u64 step = (u64)gridDim.x * blockDim.x;                                              \
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {           \
            const u32 row = (u32)(i / chunks), c = (u32)(i % chunks);                              \
            store16(out + (u64)row * k + (u64)c * 8, src.load(row, c * 8));                        \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                              \
        embed_##NAME(__nv_bfloat16* __restrict__ out, const u8* __restrict__ table,                \
                     const u32* __restrict__ ids, u32 hidden, u32 first, u32 rows, u32 fill) {     \
        const u32 t = blockIdx.x;                                                                  \
        const u32 id = ids[t];                                                                     \
        const u32 chunks = hidden / 8;                                                             \
        uint4* dst = reinterpret_cast<uint4*>(out + (u64)t * hidden);                              \
        if (id < first || id - first >= rows) {                                                    \
            const u32 word = fill | (fill << 16);                                                  \
            for (u32 c = threadIdx.x; c < chunks; c += blockDim.x) {                               \
                dst[c] = make_uint4(word, word, word, word);                                       \
            }                                                                                      \
            return;                                                                                \
        }                                                                                          \
        const BlockW<F> src{table, block_row_bytes<F>(hidden)};                                    \
        for (u32 c = threadIdx.x; c < chunks; c += blockDim.x) dst[c] = src.load(id - first, c * 8); \
    }

// One format per compilation unit: src/lib.rs prepends `#define BLOCK_FORMAT(MACRO) MACRO(id, name)`
// for each of FOR_EACH_BLOCK_FORMAT's formats (module `gemv_blocks_<name>`).
BLOCK_FORMAT(BLOCK_FORMAT_KERNELS)
