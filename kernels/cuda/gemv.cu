// Small-M GEMM for decode: y[m, n] = sum_k x[m, k] * w[n, k] for M = 1..64 rows of x, with W
// row-major [N, K] (the HF Linear layout), bf16 in, f32 accumulation, bf16 or f32 out.
//
// Two variants, each batch-invariant on its own (a backend uses one; src/gemv.rs picks the
// default): the FMA kernels here, one per M up to 16, and the tensor-core kernels further down,
// up to 64 rows.
//
// Memory-bound: every weight byte is read once per launch, with 16-byte streaming loads, several
// in flight per thread, for all M rows at once. A block of 256 threads owns R consecutive rows
// of W (R depends on M, for registers only); thread t owns the 8-element chunks
// c = t, t + 256, t + 512, ... of every row it touches.
//
// Batch invariance: for each (m, n) the sum is thread-sequential over that thread's chunks in
// ascending order (8 explicit fused multiply-adds per chunk, in element order), then a fixed warp
// butterfly, then the 8 warp totals in warp order. That order depends on K alone: the same for
// any M, any R and any grid.
#include "gemv_mma.cuh"

constexpr int GEMV_THREADS = 256;
constexpr int GEMV_WARPS = GEMV_THREADS / 32;
constexpr int GEMV_UNROLL = 2;

// Rows of W per block for M rows of x; mirrored by `gemv_rows_per_block` in src/gemv.rs.
template <int M>
struct GemvRows {
    static constexpr int R = M <= 4 ? 8 : (M <= 8 ? 4 : 2);
};


template <int M, typename Out>
__device__ __forceinline__ void gemv_body(Out* __restrict__ y, const __nv_bfloat16* __restrict__ x,
                                          const __nv_bfloat16* __restrict__ w, u32 n_rows,
                                          u32 k) {
    constexpr int R = GemvRows<M>::R;
    __shared__ float partial[GEMV_WARPS][M * R];
    const u32 n0 = blockIdx.x * R;
    const u32 chunks = k / 8;

    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
    }

    for (u32 c0 = threadIdx.x; c0 < chunks; c0 += GEMV_THREADS * GEMV_UNROLL) {
        // Issue every weight load of this step before the first use.
        uint4 wv[GEMV_UNROLL][R];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const u32 c = c0 + u * GEMV_THREADS;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const bool live = c < chunks && n0 + r < n_rows;
                wv[u][r] = live ? load_stream(w + (u64)(n0 + r) * k + (u64)c * 8)
                                : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const u32 c = c0 + u * GEMV_THREADS;
            if (c < chunks) {
#pragma unroll
            for (int m = 0; m < M; ++m) {
                float xv[8];
                unpack8(load16(x + (u64)m * k + (u64)c * 8), xv);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float wf[8];
                    unpack8(wv[u][r], wf);
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[m][r] = __fmaf_rn(xv[j], wf[j], acc[m][r]);
                }
            }
            }
        }
    }

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float v = warp_sum(acc[m][r]);
            if (lane == 0) partial[warp][m * R + r] = v;
        }
    }
    __syncthreads();
    if (threadIdx.x < M * R) {
        const int m = threadIdx.x / R;
        const int r = threadIdx.x % R;
        float total = 0.0f;
#pragma unroll
        for (int wi = 0; wi < GEMV_WARPS; ++wi) total += partial[wi][threadIdx.x];
        const u32 n = n0 + r;
        if (n < n_rows) store_out(y + (u64)m * n_rows + n, total);
    }
}

#define GEMV_ENTRIES(M)                                                                            \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                     \
        gemv_bf16_m##M(__nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ x,         \
                       const __nv_bfloat16* __restrict__ w, u32 n, u32 k) {                        \
        gemv_body<M>(y, x, w, n, k);                                                               \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                     \
        gemv_f32_m##M(float* __restrict__ y, const __nv_bfloat16* __restrict__ x,                  \
                      const __nv_bfloat16* __restrict__ w, u32 n, u32 k) {                         \
        gemv_body<M>(y, x, w, n, k);                                                               \
    }

GEMV_ENTRIES(1)
GEMV_ENTRIES(2)
GEMV_ENTRIES(3)
GEMV_ENTRIES(4)
GEMV_ENTRIES(5)
GEMV_ENTRIES(6)
GEMV_ENTRIES(7)
GEMV_ENTRIES(8)
GEMV_ENTRIES(9)
GEMV_ENTRIES(10)
GEMV_ENTRIES(11)
GEMV_ENTRIES(12)
GEMV_ENTRIES(13)
GEMV_ENTRIES(14)
GEMV_ENTRIES(15)
GEMV_ENTRIES(16)

// ---------------------------------------------------------------------------------------------
// Tensor-core entries: the body of gemv_mma.cuh over bf16 weights, one kernel per x-tile count.
//
// The fused q/k/v GEMV (`gemv_mma3_bf16_x{XT}`): the first ceil(n0 / ROWS) blocks compute y0, the
// next ceil(n1 / ROWS) y1, the rest y2. Each block runs the single-GEMV body unchanged, so every
// output is bitwise what the single launch gives; the point is one launch wide enough to fill the
// GPU where the narrow k and v projections alone (1024 rows on an 8B shape: 64 blocks) leave half
// of it idle.
//
// The shard GEMV (the row-parallel o and down projections, DESIGN.md §5): block (b, s) computes
// rows b of the f32 partial y_s = x[:, s*kslice .. (s+1)*kslice] * w[:, same]^T, x and w rows
// `ld` apart, y_s at y + s * y_stride. A shard's partial depends only on its own K-slice (the
// steps are counted from the slice's start), so it is bitwise the same whether the launch covers
// all eight shards of the full K (TP = 1) or a rank's share of them (TP = N, ld = its K).
#define GEMV_MMA_ENTRIES(XT)                                                                       \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32)                                   \
        gemv_mma_bf16_x##XT(__nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ x,    \
                            const __nv_bfloat16* __restrict__ w, u32 m, u32 n, u32 k) {            \
        gemv_mma_body<XT, MMA_WARPS, false>(y, x, Bf16W{w, k}, m, n, k, k, blockIdx.x);            \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32)                                   \
        gemv_mma_f32_x##XT(float* __restrict__ y, const __nv_bfloat16* __restrict__ x,             \
                           const __nv_bfloat16* __restrict__ w, u32 m, u32 n, u32 k) {             \
        gemv_mma_body<XT, MMA_WARPS, false>(y, x, Bf16W{w, k}, m, n, k, k, blockIdx.x);            \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) gemv_mma3_bf16_x##XT(             \
        __nv_bfloat16* __restrict__ y0, __nv_bfloat16* __restrict__ y1,                            \
        __nv_bfloat16* __restrict__ y2, const __nv_bfloat16* __restrict__ x,                       \
        const __nv_bfloat16* __restrict__ w0, const __nv_bfloat16* __restrict__ w1,                \
        const __nv_bfloat16* __restrict__ w2, u32 m, u32 n0, u32 n1, u32 n2, u32 k) {              \
        constexpr u32 ROWS = 8 * MmaTiles<XT>::T;                                                  \
        const u32 blocks0 = (n0 + ROWS - 1) / ROWS;                                                \
        const u32 blocks1 = (n1 + ROWS - 1) / ROWS;                                                \
        const u32 b = blockIdx.x;                                                                  \
        if (b < blocks0) {                                                                         \
            gemv_mma_body<XT, MMA_WARPS, false>(y0, x, Bf16W{w0, k}, m, n0, k, k, b);              \
        } else if (b < blocks0 + blocks1) {                                                        \
            gemv_mma_body<XT, MMA_WARPS, false>(y1, x, Bf16W{w1, k}, m, n1, k, k, b - blocks0);    \
        } else {                                                                                   \
            const u32 b2 = b - blocks0 - blocks1;                                                  \
            gemv_mma_body<XT, MMA_WARPS, false>(y2, x, Bf16W{w2, k}, m, n2, k, k, b2);             \
        }                                                                                          \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) gemv_mma_shards_f32_x##XT(        \
        float* __restrict__ y, const __nv_bfloat16* __restrict__ x,                                \
        const __nv_bfloat16* __restrict__ w, u32 m, u32 n, u32 kslice, u32 ld,                     \
        u64 y_stride) {                                                                            \
        const u32 s = blockIdx.y;                                                                  \
        gemv_mma_body<XT, MMA_WARPS, true>(y + (u64)s * y_stride, x + (u64)s * kslice,             \
                                           Bf16W{w, ld}.from_col(s * kslice), m, n, kslice, ld,    \
                                           blockIdx.x);                                            \
    }

GEMV_MMA_ENTRIES(1)
GEMV_MMA_ENTRIES(2)
GEMV_MMA_ENTRIES(3)
GEMV_MMA_ENTRIES(4)

// The four-phase entries (`GemvVariant::Mma2`): the same body with MMA2_PHASES k-phases, for the
// wide projections (gate/up and the LM head).

#define GEMV_MMA2_ENTRIES(XT)                                                                      \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32)                                   \
        gemv_mma2_bf16_x##XT(__nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ x,   \
                             const __nv_bfloat16* __restrict__ w, u32 m, u32 n, u32 k) {           \
        gemv_mma_body<XT, MMA2_PHASES, false>(y, x, Bf16W{w, k}, m, n, k, k, blockIdx.x);          \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32)                                   \
        gemv_mma2_f32_x##XT(float* __restrict__ y, const __nv_bfloat16* __restrict__ x,            \
                            const __nv_bfloat16* __restrict__ w, u32 m, u32 n, u32 k) {            \
        gemv_mma_body<XT, MMA2_PHASES, false>(y, x, Bf16W{w, k}, m, n, k, k, blockIdx.x);          \
    }

GEMV_MMA2_ENTRIES(1)
GEMV_MMA2_ENTRIES(2)
GEMV_MMA2_ENTRIES(3)
GEMV_MMA2_ENTRIES(4)

