// The tensor-core GEMV body, shared by cuda/gemv.cu (bf16 weights) and cuda/gemv_blocks.cu
// (GGUF block formats): y[m, n] = sum_k x[m, k] * w[n, k] with the weight read through a loader
// of blocks.cuh (`w.load(n, col)`: 8 bf16 values of row n from column col).
#pragma once
#include "blocks.cuh"

__device__ __forceinline__ void store_out(__nv_bfloat16* y, float v) { *y = f32_to_bf16(v); }
__device__ __forceinline__ void store_out(float* y, float v) { *y = v; }

// ---------------------------------------------------------------------------------------------
// Tensor-core variant: one kernel family for every M in 1..=64, rows padded to the m16n8k16 MMA
// shape in XT = ceil(M / 16) tiles of 16 rows (`gemv_mma_{bf16,f32}_x{XT}`).
//
// A block has 16 warps in PHASES k-phases × GROUPS = 16 / PHASES row groups: warp w takes phase
// w % PHASES and row group w / PHASES. A group owns 8 * TILES consecutive rows of W (TILES =
// MmaTiles<XT>: 2 for one x tile, 4 for more), so a block owns 8 * TILES * GROUPS rows; a warp runs
// the 32-wide k-steps phase, phase + PHASES, phase + 2 PHASES, ... of its group's rows. Lane
// (g = lane / 4, t = lane % 4) streams 16 bytes of W row n0 + g at k = 32 s + 8 t, and for every x
// tile j the matching 16 bytes of x rows 16 j + g and 16 j + g + 8. Each weight fragment feeds the
// MMAs of every x tile, so W is read once for up to 64 rows. The MMA's k slots are a permutation
// of the actual k (the same for A and B, so the dot product is unchanged): the first MMA of a step
// takes each lane's elements 0..3, the second its elements 4..7.
//
// Two phase counts are built (src/gemv.rs `GemvVariant`): 16 (`Mma`: one row group; every block
// repeats the x loads of its 8 * TILES rows) and 4 (`Mma2`: four row groups, whose warps of one
// phase read the same x, so a block's x loads are amortized over four times the weights; for the
// wide projections, where 4 × the rows still make enough blocks).
//
// The run order (RUNS, `GemvVariant::MmaRuns` / `Mma2Runs`): phase p takes one contiguous run of
// k-steps, [p L, min((p + 1) L, steps)) with L = ceil(steps / PHASES), instead of every PHASES-th
// step. Per (m, n) that is a chain of MMAs over each run in ascending k, then the run totals in
// run order: an order a tiled GEMM can follow too (cuda/runs.cu), so prompt rows and decode rows
// can share one weight read and still get each other's bits.
//
// Batch invariance: rows of x beyond M are zeros, a tensor-core dot product of one output row
// never reads another row, and per (m, n) the order is fixed by K and PHASES alone: the k-steps
// of each phase in ascending order (UNROLL only changes how many loads are in flight), then the
// PHASES phase totals in phase order. So row m gets the same bits from every XT, every M, every
// TILES and every grid; the two phase counts give different bits, so a projection always takes
// the same one.
constexpr int MMA_WARPS = 16;
// The phase count of `GemvVariant::Mma2` (MMA_WARPS is `Mma`'s); mirrored by `mma_rows` in
// src/gemv.rs.
constexpr int MMA2_PHASES = 4;

// Tiles of 8 W rows per block for XT x tiles; mirrored by `mma_rows` in `src/gemv.rs`.
template <int XT>
struct MmaTiles {
    static constexpr int T = XT == 1 ? 2 : 4;
};

// Loads in flight per warp step for XT x tiles: fewer as the x fragments take registers.
template <int XT>
struct MmaUnroll {
    static constexpr int U = XT == 1 ? 4 : (XT == 2 ? 2 : 1);
};

__device__ __forceinline__ void mma_bf16_16816(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                               u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Loads in flight per warp step for the weight loader W: MmaUnroll, except a block format with
// one x tile, which takes 2 so that its kernel fits in 64 registers and two blocks share an SM
// (the in-register dequantization needs the warps more than the loads in flight).
template <typename W, int XT>
struct BodyUnroll {
    static constexpr int U = MmaUnroll<XT>::U;
};
template <int F>
struct BodyUnroll<BlockW<F>, 1> {
    static constexpr int U = sizeof(typename BlockW<F>::Raw) > 24 ? 1 : 2;
};

template <bool B, typename T, typename F>
struct Pick {
    typedef T type;
};
template <typename T, typename F>
struct Pick<false, T, F> {
    typedef F type;
};

// What a step holds of each weight fragment until its MMAs: the loader's raw loads, decoded just
// before the MMAs so every load of the step is in flight first; or, where raw loads wider than
// 12 bytes would not fit the registers beside two or more x tiles, the decoded values (decoded
// as they arrive; for bf16 the same thing). Either way the MMAs see the same values, so the bits do not change.
template <typename W, int XT>
struct MmaSlot {
    static constexpr bool RAW = sizeof(typename W::Raw) <= 12 || XT == 1;
    typedef typename Pick<RAW, typename W::Raw, uint4>::type Slot;
    static __device__ __forceinline__ Slot fetch(const W& w, u32 n, u32 col) {
        if constexpr (RAW) {
            return w.fetch(n, col);
        } else {
            return W::decode(w.fetch(n, col), col);
        }
    }
    static __device__ __forceinline__ uint4 decode(const Slot& s, u32 col) {
        if constexpr (RAW) {
            return W::decode(s, col);
        } else {
            return s;
        }
    }
};

// Rows of x are `ld` apart when SLICED (a K-slice of wider rows), else `k` apart; `w` is a
// loader of blocks.cuh over the same columns. Every weight chunk the body multiplies is the
// loader's 8 bf16 values, so the body gives the same bits for a block format as for its bf16
// widening.
template <int XT, int PHASES, bool SLICED, typename Out, typename W, bool RUNS = false>
__device__ __forceinline__ void gemv_mma_body(Out* __restrict__ y,
                                              const __nv_bfloat16* __restrict__ x, const W w,
                                              u32 m_rows, u32 n_rows, u32 k, u32 ld_arg,
                                              u32 block) {
    static_assert(MMA_WARPS % PHASES == 0, "the warps split evenly into phases");
    constexpr int GROUPS = MMA_WARPS / PHASES;
    const u32 ld = SLICED ? ld_arg : k;
    constexpr int U = BodyUnroll<W, XT>::U;
    constexpr int MMA_TILES = MmaTiles<XT>::T;
    constexpr int GROUP_ROWS = 8 * MMA_TILES;
    constexpr int BLOCK_ROWS = GROUP_ROWS * GROUPS;
    __shared__ float partial[PHASES][16][BLOCK_ROWS + 1];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int phase = warp % PHASES;
    const int group = warp / PHASES;
    const int g = lane >> 2;
    const int t = lane & 3;
    const u32 n0 = block * BLOCK_ROWS + group * GROUP_ROWS;
    const u32 steps = k / 32;
    // This warp's k-steps: first, first + STRIDE, ... below end.
    constexpr u32 STRIDE = RUNS ? 1 : PHASES;
    const u32 run = (steps + PHASES - 1) / PHASES;
    const u32 first = RUNS ? phase * run : phase;
    const u32 end = RUNS ? min(first + run, steps) : steps;

    float c[XT][MMA_TILES][4];
#pragma unroll
    for (int j = 0; j < XT; ++j) {
#pragma unroll
        for (int i = 0; i < MMA_TILES; ++i) c[j][i][0] = c[j][i][1] = c[j][i][2] = c[j][i][3] = 0.0f;
    }

    for (u32 s0 = first; s0 < end; s0 += STRIDE * U) {
        typedef MmaSlot<W, XT> Slots;
        typename Slots::Slot wv[U][MMA_TILES];
        uint4 xl[U][XT], xh[U][XT];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u32 s = s0 + u * STRIDE;
            const bool live = s < end;
#pragma unroll
            for (int i = 0; i < MMA_TILES; ++i) {
                const u32 n = n0 + i * 8 + g;
                wv[u][i] = live && n < n_rows ? Slots::fetch(w, n, s * 32 + t * 8)
                                              : typename Slots::Slot{};
            }
#pragma unroll
            for (int j = 0; j < XT; ++j) {
                const u32 lo = 16 * j + g;
                const u32 hi = lo + 8;
                xl[u][j] = live && lo < m_rows ? load16(x + (u64)lo * ld + (u64)s * 32 + t * 8)
                                               : make_uint4(0, 0, 0, 0);
                xh[u][j] = live && hi < m_rows ? load16(x + (u64)hi * ld + (u64)s * 32 + t * 8)
                                               : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (s0 + u * STRIDE < end) {
#pragma unroll
                for (int i = 0; i < MMA_TILES; ++i) {
                    const uint4 wf = Slots::decode(wv[u][i], (s0 + u * STRIDE) * 32 + t * 8);
#pragma unroll
                    for (int j = 0; j < XT; ++j) {
                        mma_bf16_16816(c[j][i], xl[u][j].x, xh[u][j].x, xl[u][j].y, xh[u][j].y,
                                       wf.x, wf.y);
                        mma_bf16_16816(c[j][i], xl[u][j].z, xh[u][j].z, xl[u][j].w, xh[u][j].w,
                                       wf.z, wf.w);
                    }
                }
            }
        }
    }

    // One x tile at a time through the same shared buffer: the phase totals in phase order.
#pragma unroll
    for (int j = 0; j < XT; ++j) {
        if (j > 0) __syncthreads();  // the previous tile's reads are done
#pragma unroll
        for (int i = 0; i < MMA_TILES; ++i) {
            const int col = group * GROUP_ROWS + i * 8 + t * 2;
            partial[phase][g][col] = c[j][i][0];
            partial[phase][g][col + 1] = c[j][i][1];
            partial[phase][g + 8][col] = c[j][i][2];
            partial[phase][g + 8][col + 1] = c[j][i][3];
        }
        __syncthreads();
        for (int e = threadIdx.x; e < 16 * BLOCK_ROWS; e += blockDim.x) {
            const int row = e / BLOCK_ROWS;
            const int col = e % BLOCK_ROWS;
            float total = 0.0f;
#pragma unroll
            for (int p = 0; p < PHASES; ++p) total += partial[p][row][col];
            const u32 m = 16 * j + row;
            const u32 n = block * BLOCK_ROWS + col;
            if (m < m_rows && n < n_rows) store_out(y + (u64)m * n_rows + n, total);
        }
    }
}
