// The run order of a bf16 projection, y[m, n] = sum_k x[m, k] * w[n, k], as a GEMV for decode
// rows and as a tiled GEMM for any number of rows, with the same bits for a row in both.
//
// The order (gemv_mma.cuh, RUNS): K is cut into 32-wide k-steps and the steps into PHASES runs
// of L = ceil(steps / PHASES) consecutive steps (the last ones shorter or empty). Per (m, n):
// for each run, a chain of m16n8k16 MMAs starting from 0 over the run's steps in ascending
// order, each step two MMAs whose k slots are the lane permutation of gemv_mma.cuh (lane (g, t)
// holds elements 32 s + 8 t .. + 8 of its x and W rows; the first MMA takes elements 0..3, the
// second 4..7); then the run totals added in run order, starting from 0. A tensor-core MMA's
// output element depends only on its own row of x, column of W and accumulator, so any kernel
// that runs this chain per element gets the same bits, whatever tile it computes it in.
//
// The GEMV entries (`runs_gemv_{bf16,f32}_p{16,4}_x{XT}`, up to 64 rows) are gemv_mma.cuh's body
// in that order. The GEMM entries (`runs_gemm_{bf16,f32}_p{16,4}`, any number of rows) are what
// lets a step's prompt rows and decode rows read each weight once (docs/DECISIONS.md, "Served ≥
// 85 % of the decode microbenchmark ... needs decode and prompt rows to share one weight read"):
//
// A block computes RG_BM = 64 rows of x against RG_BN = 128 rows of W with RG_WARPS = 4 warps,
// warp w owning W rows 32 w .. 32 w + 32 of the block (four n-tiles of 8) for all four x tiles of
// 16 rows. K goes through shared memory in chunks of RG_KC = 64 (two steps) on a RG_STAGES-deep
// cp.async pipeline; out-of-range rows and columns are zero-filled. Each warp keeps two sets of
// accumulators: the current run's chain and the total of the finished runs; at the last step of
// a run the chain is added to the total and restarted from 0. Shared rows are 128 bytes (8
// units of 16); unit u of row r is stored at u ^ 4 (r & 1), so that the eight lanes of a
// quarter-warp (rows 2q and 2q + 1, units t or 4 + t) hit 32 different banks.
//
// Grid: x = the 64-row tiles of x (fastest, so the blocks reading one W tile run together and
// share it through L2), y = the 128-row tiles of W.
#include "gemv_mma.cuh"

constexpr int RG_BM = 64;
constexpr int RG_BN = 128;
constexpr int RG_WARPS = 4;
constexpr int RG_THREADS = RG_WARPS * 32;
constexpr int RG_KC = 64;
constexpr int RG_UNITS = RG_KC / 8;  // 16-byte units per shared row
constexpr int RG_STAGES = 3;
// Shared bytes: mirrored by `RUNS_GEMM_SMEM` in src/runs.rs.
constexpr int RG_STAGE_ROWS = RG_BM + RG_BN;
constexpr int RG_SMEM = RG_STAGES * RG_STAGE_ROWS * RG_KC * 2;
static_assert(RG_STAGE_ROWS * RG_UNITS % RG_THREADS == 0, "a stage splits evenly over the threads");

__device__ __forceinline__ void cp_async16(u32 smem, const void* gmem, bool valid) {
    const int bytes = valid ? 16 : 0;  // 0: nothing is read, the 16 bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
                 "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ uint4 lds128(u32 smem) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(smem));
    return v;
}
// The shared address of unit u of row r of a stage (rows 0..RG_BM are x, then W).
__device__ __forceinline__ u32 rg_unit(u32 stage, int r, int u) {
    return stage + (u32)((r * RG_UNITS + (u ^ ((r & 1) << 2))) * 16);
}

template <int PHASES, typename Out>
__device__ __forceinline__ void runs_gemm_body(Out* __restrict__ y,
                                               const __nv_bfloat16* __restrict__ x,
                                               const __nv_bfloat16* __restrict__ w, u32 m_rows,
                                               u32 n_rows, u32 k) {
    extern __shared__ __align__(128) unsigned char rg_smem[];
    const u32 base = (u32)__cvta_generic_to_shared(rg_smem);
    constexpr u32 STAGE_BYTES = RG_STAGE_ROWS * RG_KC * 2;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const u32 m0 = blockIdx.x * RG_BM;
    const u32 n0 = blockIdx.y * RG_BN;
    const u32 steps = k / 32;
    const u32 run = (steps + PHASES - 1) / PHASES;
    const u32 chunks = (steps + 1) / 2;

    // Chunk `ch` into stage `st`: every thread copies its share of the (RG_BM + RG_BN) rows x 8
    // units, zero-filling rows past M or N and columns past K.
    auto load_chunk = [&](u32 ch, u32 st) {
        const u32 col0 = ch * RG_KC;
#pragma unroll
        for (int it = 0; it < RG_STAGE_ROWS * RG_UNITS / RG_THREADS; ++it) {
            const int e = threadIdx.x + it * RG_THREADS;
            const int r = e / RG_UNITS;
            const int u = e % RG_UNITS;
            const u32 col = col0 + u * 8;
            const bool is_x = r < RG_BM;
            const u32 row = is_x ? m0 + r : n0 + (r - RG_BM);
            const bool valid = (is_x ? row < m_rows : row < n_rows) && col < k;
            const __nv_bfloat16* src = is_x ? x : w;
            const __nv_bfloat16* p = valid ? src + (u64)row * k + col : src;
            cp_async16(rg_unit(base + st * STAGE_BYTES, r, u), p, valid);
        }
    };

    float c[4][4][4];
    float total[4][4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) c[j][i][e] = total[j][i][e] = 0.0f;
        }
    }

#pragma unroll
    for (int st = 0; st < RG_STAGES - 1; ++st) {
        if ((u32)st < chunks) load_chunk(st, st);
        cp_async_commit();
    }

    for (u32 ch = 0; ch < chunks; ++ch) {
        cp_async_wait<RG_STAGES - 2>();
        __syncthreads();  // chunk ch is in; every warp is done with the stage refilled below
        const u32 next = ch + RG_STAGES - 1;
        if (next < chunks) load_chunk(next, next % RG_STAGES);
        cp_async_commit();

        const u32 stage = base + (ch % RG_STAGES) * STAGE_BYTES;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 s = 2 * ch + h;
            if (s < steps) {
                const int u = 4 * h + t;
                uint4 wf[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    wf[i] = lds128(rg_unit(stage, RG_BM + warp * 32 + i * 8 + g, u));
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const uint4 xl = lds128(rg_unit(stage, 16 * j + g, u));
                    const uint4 xh = lds128(rg_unit(stage, 16 * j + g + 8, u));
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        mma_bf16_16816(c[j][i], xl.x, xh.x, xl.y, xh.y, wf[i].x, wf[i].y);
                        mma_bf16_16816(c[j][i], xl.z, xh.z, xl.w, xh.w, wf[i].z, wf[i].w);
                    }
                }
                if ((s + 1) % run == 0 || s + 1 == steps) {
                    // The run ends: its chain joins the total in run order.
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                total[j][i][e] += c[j][i][e];
                                c[j][i][e] = 0.0f;
                            }
                        }
                    }
                }
            }
        }
    }
    cp_async_wait<0>();

    // c[j][i][e] is row 16 j + g + 8 (e / 2), column 8 i + 2 t + e % 2 of the warp's tile.
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u32 m = m0 + 16 * j + g + 8 * (e >> 1);
                const u32 n = n0 + warp * 32 + i * 8 + 2 * t + (e & 1);
                if (m < m_rows && n < n_rows) store_out(y + (u64)m * n_rows + n, total[j][i][e]);
            }
        }
    }
}

#define RUNS_ENTRIES(P)                                                                            \
    extern "C" __global__ void __launch_bounds__(RG_THREADS) runs_gemm_bf16_p##P(                  \
        __nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ x,                        \
        const __nv_bfloat16* __restrict__ w, u32 m, u32 n, u32 k) {                                \
        runs_gemm_body<P>(y, x, w, m, n, k);                                                       \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(RG_THREADS)                                       \
        runs_gemm_f32_p##P(float* __restrict__ y, const __nv_bfloat16* __restrict__ x,             \
                           const __nv_bfloat16* __restrict__ w, u32 m, u32 n, u32 k) {             \
        runs_gemm_body<P>(y, x, w, m, n, k);                                                       \
    }

RUNS_ENTRIES(16)
RUNS_ENTRIES(4)

#define RUNS_GEMV_ENTRIES(P, XT)                                                                   \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) runs_gemv_bf16_p##P##_x##XT(      \
        __nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ x,                        \
        const __nv_bfloat16* __restrict__ w, u32 m, u32 n, u32 k) {                                \
        gemv_mma_body<XT, P, false, __nv_bfloat16, Bf16W, true>(y, x, Bf16W{w, k}, m, n, k, k,     \
                                                                 blockIdx.x);                      \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(MMA_WARPS * 32) runs_gemv_f32_p##P##_x##XT(       \
        float* __restrict__ y, const __nv_bfloat16* __restrict__ x,                                \
        const __nv_bfloat16* __restrict__ w, u32 m, u32 n, u32 k) {                                \
        gemv_mma_body<XT, P, false, float, Bf16W, true>(y, x, Bf16W{w, k}, m, n, k, k,             \
                                                         blockIdx.x);                              \
    }

RUNS_GEMV_ENTRIES(16, 1)
RUNS_GEMV_ENTRIES(16, 2)
RUNS_GEMV_ENTRIES(16, 3)
RUNS_GEMV_ENTRIES(16, 4)
RUNS_GEMV_ENTRIES(4, 1)
RUNS_GEMV_ENTRIES(4, 2)
RUNS_GEMV_ENTRIES(4, 3)
RUNS_GEMV_ENTRIES(4, 4)
