// Shared helpers, included as `#include "common.cuh"` (served from memory by src/compile.rs).
#pragma once
//
// Conventions: bf16 storage, f32 arithmetic, one explicit rounding (round to nearest even) where
// a value is stored. Every reduction runs in an order fixed by the row length and the kernel's
// compile-time block size alone, never by the number of rows or the grid: batch invariance.
#include <cuda_bf16.h>

typedef unsigned int u32;
typedef unsigned long long u64;

// bf16 bits -> f32 is exact: the bf16 is the high half of the f32.
__device__ __forceinline__ float bf16_lo(u32 word) { return __uint_as_float(word << 16); }
__device__ __forceinline__ float bf16_hi(u32 word) { return __uint_as_float(word & 0xffff0000u); }

__device__ __forceinline__ float bf16_to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ __nv_bfloat16 f32_to_bf16(float v) { return __float2bfloat16_rn(v); }

// f32 -> bf16 (round to nearest even), as the low or high half of a packed word.
__device__ __forceinline__ u32 bf16_bits(float v) {
    __nv_bfloat16 b = __float2bfloat16_rn(v);
    return (u32)(*reinterpret_cast<unsigned short*>(&b));
}
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    return bf16_bits(lo) | (bf16_bits(hi) << 16);
}

// The f32 value a bf16 store of `v` would hold.
__device__ __forceinline__ float round_bf16(float v) {
    return __bfloat162float(__float2bfloat16_rn(v));
}

// Eight bf16 values (16 bytes) unpacked to f32, in memory order.
__device__ __forceinline__ void unpack8(uint4 v, float out[8]) {
    out[0] = bf16_lo(v.x); out[1] = bf16_hi(v.x);
    out[2] = bf16_lo(v.y); out[3] = bf16_hi(v.y);
    out[4] = bf16_lo(v.z); out[5] = bf16_hi(v.z);
    out[6] = bf16_lo(v.w); out[7] = bf16_hi(v.w);
}

__device__ __forceinline__ uint4 pack8(const float in[8]) {
    uint4 v;
    v.x = pack_bf16x2(in[0], in[1]);
    v.y = pack_bf16x2(in[2], in[3]);
    v.z = pack_bf16x2(in[4], in[5]);
    v.w = pack_bf16x2(in[6], in[7]);
    return v;
}

// 16-byte load that bypasses L1 allocation: for data read exactly once (weights).
__device__ __forceinline__ uint4 load_stream(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ uint4 load16(const void* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ void store16(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

// Sum over a warp by a fixed butterfly: every lane ends with the same bits, and the order of the
// additions is the same on every call.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// Sum over a block of THREADS threads (a multiple of 32, at most 1024): warp butterflies, then
// the warp totals added in warp order. Every thread gets the result. `scratch` holds 32 floats;
// the function may be called repeatedly with the same scratch.
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    constexpr int WARPS = THREADS / 32;
    v = warp_sum(v);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    __syncthreads();  // the previous call's readers are done with scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total += scratch[w];
    return total;
}
