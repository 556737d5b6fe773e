// On-device greedy sampling: the argmax of each row of f32 logits, in the CPU sampler's order.
#include "common.cuh"

constexpr int ARGMAX_THREADS = 1024;
constexpr u32 NO_TOKEN = 0xffffffffu;

#define STRATA_POS_INF __int_as_float(0x7f800000)
#define STRATA_NEG_INF __int_as_float(0xff800000)
#define STRATA_FLT_MAX __int_as_float(0x7f7fffff)

// The sampler's sanitizing (strata_model::sampler): NaN ranks as -inf, +inf as FLT_MAX.
__device__ __forceinline__ float sanitize(float v) {
    if (isnan(v)) return STRATA_NEG_INF;
    return v == STRATA_POS_INF ? STRATA_FLT_MAX : v;
}

// The total order argmax follows: only finite sanitized values compete, a larger value wins,
// equal values go to the lower index. Because it is a total order, the result does not depend on
// how the row is split.
__device__ __forceinline__ bool beats(float v, u32 i, float best, u32 best_i) {
    if (v == STRATA_NEG_INF) return false;
    if (best_i == NO_TOKEN) return true;
    return v > best || (v == best && i < best_i);
}

__device__ __forceinline__ void consider(float raw, u32 i, float& best, u32& best_i) {
    const float v = sanitize(raw);
    if (beats(v, i, best, best_i)) {
        best = v;
        best_i = i;
    }
}

// out[m] = argmax over logits[m * stride + 0..vocab) (one block per row). A row with no finite
// value after sanitizing gives 0xffffffff.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_f32(u32* __restrict__ out, const float* __restrict__ logits, u32 vocab, u32 stride) {
    __shared__ float best_v[ARGMAX_THREADS / 32];
    __shared__ u32 best_ix[ARGMAX_THREADS / 32];
    const float* row = logits + (u64)blockIdx.x * stride;
    float best = 0.0f;
    u32 best_i = NO_TOKEN;
    u32 start = 0;
    if ((reinterpret_cast<u64>(row) & 15) == 0) {
        const u32 quads = vocab / 4;
        const float4* row4 = reinterpret_cast<const float4*>(row);
        for (u32 q = threadIdx.x; q < quads; q += ARGMAX_THREADS) {
            const float4 v = row4[q];
            consider(v.x, q * 4 + 0, best, best_i);
            consider(v.y, q * 4 + 1, best, best_i);
            consider(v.z, q * 4 + 2, best, best_i);
            consider(v.w, q * 4 + 3, best, best_i);
        }
        start = quads * 4;
    }
    for (u32 i = start + threadIdx.x; i < vocab; i += ARGMAX_THREADS) consider(row[i], i, best, best_i);

#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, best, offset);
        const u32 i = __shfl_xor_sync(0xffffffffu, best_i, offset);
        if (i != NO_TOKEN) consider(v, i, best, best_i);
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
        best_v[warp] = best;
        best_ix[warp] = best_i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < ARGMAX_THREADS / 32; ++w) {
            if (best_ix[w] != NO_TOKEN) consider(best_v[w], best_ix[w], best, best_i);
        }
        out[blockIdx.x] = best_i;
    }
}
