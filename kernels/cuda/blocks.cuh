// Weight formats of the projections, as loaders the GEMV, the dequantizer and the embedding
// gather share: `w.load(n, col)` gives the 8 bf16 values of row n at columns col .. col + 8
// (col % 8 == 0), packed in a uint4 in memory order, whatever the storage.
//
// Bf16W reads them as stored. BlockW<F> reads a GGUF block format (F is the ggml type number)
// and dequantizes the chunk in registers: the f32 value the CPU reference computes (the same
// IEEE single-precision operations in the same order as model/src/gguf/dequant.rs, f16 scales
// widened exactly, no fused multiply-add), rounded once to bf16 (nearest even). That is bit for
// bit the bf16 tensor the checkpoint loader widens a block tensor to, so a kernel over BlockW<F>
// computes exactly what the same kernel computes over the widened bf16 copy.
#pragma once
#include "common.cuh"

typedef unsigned char u8;
typedef unsigned short u16;

__device__ __forceinline__ u32 ld_u8(const u8* p) { return __ldg(p); }
__device__ __forceinline__ u32 ld_u16(const u8* p) {  // p 2-byte aligned
    return __ldg(reinterpret_cast<const u16*>(p));
}
// Eight bytes at a 2-byte aligned address, little-endian, as two words.
__device__ __forceinline__ uint2 ld8_a2(const u8* p) {
    return make_uint2(ld_u16(p) | (ld_u16(p + 2) << 16), ld_u16(p + 4) | (ld_u16(p + 6) << 16));
}
// Eight bytes at an 8-byte aligned address.
__device__ __forceinline__ uint2 ld8_a8(const u8* p) {
    return __ldg(reinterpret_cast<const uint2*>(p));
}
// Four bytes at a 2-byte aligned address.
__device__ __forceinline__ u32 ld4_a2(const u8* p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }

// IEEE half (at a 2-byte aligned address) to single: exact.
__device__ __forceinline__ float f16_at(const u8* p) {
    const unsigned short h = (unsigned short)ld_u16(p);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Byte i (0..8) of an 8-byte run held as two words.
__device__ __forceinline__ u32 byte_of(uint2 v, int i) {
    return ((i < 4 ? v.x : v.y) >> (8 * (i & 3))) & 0xffu;
}

__device__ __forceinline__ uint4 pack8_bf16(const float v[8]) {
    return make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                      pack_bf16x2(v[6], v[7]));
}

struct Bf16W {
    const __nv_bfloat16* w;
    u32 ld;  // elements between rows
    __device__ __forceinline__ uint4 load(u32 n, u32 col) const {
        return load_stream(w + (u64)n * ld + col);
    }
    // The same rows from column `col` on (a K-slice).
    __device__ __forceinline__ Bf16W from_col(u32 col) const { return Bf16W{w + col, ld}; }
};

// One GGUF block format: QK elements in BYTES bytes; chunk(b, e) dequantizes elements
// e .. e + 8 (e % 8 == 0) of the block at b.
template <int F>
struct Fmt;

// Q4_0: f16 d, 16 bytes of nibbles (elements 0..16 low, 16..32 high); d * (q - 8).
template <>
struct Fmt<2> {
    static constexpr u32 QK = 32, BYTES = 18;
    static __device__ __forceinline__ uint4 chunk(const u8* b, u32 e) {
        const float d = f16_at(b);
        const uint2 qs = ld8_a2(b + 2 + (e & 15));
        const int shift = e < 16 ? 0 : 4;
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int q = (int)((byte_of(qs, i) >> shift) & 15) - 8;
            v[i] = __fmul_rn(d, (float)q);
        }
        return pack8_bf16(v);
    }
};

// Q4_1: f16 d, f16 m, 16 bytes of nibbles; d * q + m.
template <>
struct Fmt<3> {
    static constexpr u32 QK = 32, BYTES = 20;
    static __device__ __forceinline__ uint4 chunk(const u8* b, u32 e) {
        const float d = f16_at(b), m = f16_at(b + 2);
        const uint2 qs = ld8_a2(b + 4 + (e & 15));
        const int shift = e < 16 ? 0 : 4;
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float q = (float)((byte_of(qs, i) >> shift) & 15);
            v[i] = __fadd_rn(__fmul_rn(d, q), m);
        }
        return pack8_bf16(v);
    }
};

// Q5_0: f16 d, 32 high bits, 16 bytes of nibbles; d * (q - 16).
template <>
struct Fmt<6> {
    static constexpr u32 QK = 32, BYTES = 22;
    static __device__ __forceinline__ uint4 chunk(const u8* b, u32 e) {
        const float d = f16_at(b);
        const u32 qh = ld4_a2(b + 2);
        const uint2 qs = ld8_a2(b + 6 + (e & 15));
        const int shift = e < 16 ? 0 : 4;
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u32 hi = (qh >> (e + i)) & 1;
            const int q = (int)(((byte_of(qs, i) >> shift) & 15) | (hi << 4)) - 16;
            v[i] = __fmul_rn(d, (float)q);
        }
        return pack8_bf16(v);
    }
};

// Q5_1: f16 d, f16 m, 32 high bits, 16 bytes of nibbles; d * q + m.
template <>
struct Fmt<7> {
    static constexpr u32 QK = 32, BYTES = 24;
    static __device__ __forceinline__ uint4 chunk(const u8* b, u32 e) {
        const float d = f16_at(b), m = f16_at(b + 2);
        const u32 qh = ld4_a2(b + 4);
        const uint2 qs = ld8_a2(b + 8 + (e & 15));
        const int shift = e < 16 ? 0 : 4;
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u32 hi = (qh >> (e + i)) & 1;
            const float q = (float)(((byte_of(qs, i) >> shift) & 15) | (hi << 4));
            v[i] = __fadd_rn(__fmul_rn(d, q), m);
        }
        return pack8_bf16(v);
    }
};

// Q8_0: f16 d, 32 signed bytes; q * d.
template <>
struct Fmt<8> {
    static constexpr u32 QK = 32, BYTES = 34;
    static __device__ __forceinline__ uint4 chunk(const u8* b, u32 e) {
        const float d = f16_at(b);
        const uint2 qs = ld8_a2(b + 2 + e);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int q = (int)(signed char)byte_of(qs, i);
            v[i] = __fmul_rn((float)q, d);
        }
        return pack8_bf16(v);
    }
};

// Q4_K/Q5_K scale and min of sub-block j (0..8), from 12 bytes of 6-bit fields at s.
__device__ __forceinline__ void k_scale_min(const u8* s, u32 j, u32& sc, u32& m) {
    if (j < 4) {
        sc = ld_u8(s + j) & 63;
        m = ld_u8(s + j + 4) & 63;
    } else {
        sc = (ld_u8(s + j + 4) & 15) | ((ld_u8(s + j - 4) >> 2) & 0x30);
        m = (ld_u8(s + j + 4) >> 4) | ((ld_u8(s + j) >> 2) & 0x30);
    }
}

// Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, then 128
// bytes of nibbles (sub-blocks 2i and 2i + 1 share 32 bytes, low then high nibbles);
// (d * sc) * q - dmin * m.
template <>
struct Fmt<12> {
    static constexpr u32 QK = 256, BYTES = 144;
    static __device__ __forceinline__ uint4 chunk(const u8* b, u32 e) {
        const u32 j = e / 32, l = e % 32;
        u32 sc, mn;
        k_scale_min(b + 4, j, sc, mn);
        const float dl = __fmul_rn(f16_at(b), (float)sc);
        const float ml = __fmul_rn(f16_at(b + 2), (float)mn);
        const uint2 qs = ld8_a8(b + 16 + 32 * (j / 2) + l);
        const int shift = 4 * (j % 2);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float q = (float)((byte_of(qs, i) >> shift) & 15);
            v[i] = __fsub_rn(__fmul_rn(dl, q), ml);
        }
        return pack8_bf16(v);
    }
};

// Q5_K: as Q4_K with 32 bytes of fifth bits (bit j of byte l for element l of sub-block j)
// between the scales and the nibbles.
template <>
struct Fmt<13> {
    static constexpr u32 QK = 256, BYTES = 176;
    static __device__ __forceinline__ uint4 chunk(const u8* b, u32 e) {
        const u32 j = e / 32, l = e % 32;
        u32 sc, mn;
        k_scale_min(b + 4, j, sc, mn);
        const float dl = __fmul_rn(f16_at(b), (float)sc);
        const float ml = __fmul_rn(f16_at(b + 2), (float)mn);
        const uint2 qh = ld8_a8(b + 16 + l);
        const uint2 qs = ld8_a8(b + 48 + 32 * (j / 2) + l);
        const int shift = 4 * (j % 2);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u32 q = ((byte_of(qs, i) >> shift) & 15) | (((byte_of(qh, i) >> j) & 1) << 4);
            v[i] = __fsub_rn(__fmul_rn(dl, (float)q), ml);
        }
        return pack8_bf16(v);
    }
};

// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 signed scales (one per 16
// elements), f16 d last; (d * sc) * (q - 32). In each 128-element half, element r's low nibble is
// byte r % 64 of the half's 64 (low nibble for r < 64), its high bits the 2-bit field r / 32 of
// byte r % 32 of the half's 32.
template <>
struct Fmt<14> {
    static constexpr u32 QK = 256, BYTES = 210;
    static __device__ __forceinline__ uint4 chunk(const u8* b, u32 e) {
        const float dl = __fmul_rn(f16_at(b + 208), (float)(int)(signed char)ld_u8(b + 192 + e / 16));
        const u32 half = e / 128, r = e % 128;
        const uint2 ql = ld8_a2(b + half * 64 + r % 64);
        const uint2 qh = ld8_a2(b + 128 + half * 32 + r % 32);
        const int lo_shift = 4 * (r / 64), hi_shift = 2 * (r / 32);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u32 low = (byte_of(ql, i) >> lo_shift) & 15;
            const u32 high = (byte_of(qh, i) >> hi_shift) & 3;
            const int q = (int)(low | (high << 4)) - 32;
            v[i] = __fmul_rn(dl, (float)q);
        }
        return pack8_bf16(v);
    }
};

template <int F>
struct BlockW {
    const u8* w;
    u64 row_bytes;
    __device__ __forceinline__ uint4 load(u32 n, u32 col) const {
        const u8* b = w + (u64)n * row_bytes + (u64)(col / Fmt<F>::QK) * Fmt<F>::BYTES;
        return Fmt<F>::chunk(b, col % Fmt<F>::QK);
    }
    // The same rows from column `col` on (col % QK == 0).
    __device__ __forceinline__ BlockW from_col(u32 col) const {
        return BlockW{w + (u64)(col / Fmt<F>::QK) * Fmt<F>::BYTES, row_bytes};
    }
};

// The bytes of one row of k elements.
template <int F>
__device__ __forceinline__ u64 block_row_bytes(u32 k) {
    return (u64)(k / Fmt<F>::QK) * Fmt<F>::BYTES;
}

// Invokes MACRO(F, NAME) for every block format the kernels take.
#define FOR_EACH_BLOCK_FORMAT(MACRO) \
    MACRO(2, q4_0)                   \
    MACRO(3, q4_1)                   \
    MACRO(6, q5_0)                   \
    MACRO(7, q5_1)                   \
    MACRO(8, q8_0)                   \
    MACRO(12, q4_k)                  \
    MACRO(13, q5_k)                  \
    MACRO(14, q6_k)
