// Conversions of f32 to the low-precision codes activations are quantized to, as the CPU
// reference (model/src/quantize/mod.rs: `f32_to_e4m3`, `f32_to_e2m1`) computes them: the same
// search over the same ascending tables, the same f32 subtractions, ties to the even code.
#pragma once
#include "blocks.cuh"

// The positive e4m3 values, codes 0 .. 0x7e, ascending.
__device__ __forceinline__ float e4m3_positive(u32 code) { return e4m3_of(code); }

// The CPU reference's `nearest` over an ascending table `value(i)`, i < n: the index of the
// first value not below x (a binary search), then the closer neighbour, ties to the even index.
template <typename V>
__device__ __forceinline__ u32 nearest_code(V value, u32 n, float x) {
    u32 lo = 0, hi = n;  // partition point: values below x come first
    while (lo < hi) {
        const u32 mid = (lo + hi) / 2;
        if (value(mid) < x) lo = mid + 1;
        else hi = mid;
    }
    if (lo == 0) return 0;
    if (lo == n) return n - 1;
    const float below = __fsub_rn(x, value(lo - 1)), above = __fsub_rn(value(lo), x);
    return (below < above || (below == above && (lo - 1) % 2 == 0)) ? lo - 1 : lo;
}

// x as e4m3 (to nearest, ties to even, saturating at 448); the sign bit of a negative x, -0
// included, as the reference's `f32_to_e4m3`.
__device__ __forceinline__ u32 to_e4m3(float x) {
    const u32 sign = (__float_as_uint(x) >> 24) & 0x80u;
    const float a = fminf(fabsf(x), 448.0f);
    return sign | nearest_code([](u32 i) { return e4m3_positive(i); }, 0x7f, a);
}

// x as an e2m1 nibble (to nearest, ties to even, saturating at 6); negative zero has no sign.
__device__ __forceinline__ u32 to_e2m1(float x) {
    const u32 sign = (x < 0.0f) ? 0x8u : 0u;
    const float a = fminf(fabsf(x), 6.0f);
    return sign | nearest_code([](u32 i) { return e2m1_of<false>(i); }, 8, a);
}
