// Weight formats of the projections, as loaders the GEMV, the dequantizer and the embedding
// gather share. A loader gives the 8 bf16 values of row n at columns col .. col + 8 (col % 8 ==
// 0), packed in a uint4 in memory order, whatever the storage, in two halves: `fetch(n, col)`
// issues the loads (a small `Raw` of registers) and `decode(raw, col)` does the arithmetic, so a
// kernel can put every load of an unrolled step in flight before the first use.
//
// Bf16W reads them as stored. BlockW<F> reads a GGUF block format (F is the ggml type number)
// and dequantizes the chunk in registers: the f32 value the CPU reference computes (the same
// IEEE single-precision operations in the same order as model/src/gguf/dequant.rs, f16 scales
// widened exactly, small integers converted exactly, no fused multiply-add), rounded once to
// bf16 (nearest even). That is bit for bit the bf16 tensor the checkpoint loader widens a block
// tensor to, so a kernel over BlockW<F> computes exactly what the same kernel computes over the
// widened bf16 copy.
//
// Device layout: the file's blocks, with the f16 header of Q4_0, Q5_0 and Q8_0 padded from 2 to
// 4 bytes and Q6_K's 210-byte blocks padded to 224, so every load below is naturally aligned
// (src/blocks.rs repacks at upload: `BlockFormat::device_block_bytes`).
#pragma once
#include "common.cuh"

typedef unsigned char u8;
typedef unsigned short u16;

__device__ __forceinline__ u32 ld32(const u8* p) { return __ldg(reinterpret_cast<const u32*>(p)); }
__device__ __forceinline__ uint2 ld64(const u8* p) {
    return __ldg(reinterpret_cast<const uint2*>(p));
}
__device__ __forceinline__ uint4 ld128(const u8* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
}

// The low (hi = false) or high half of a word as an IEEE half, widened to single: exact.
__device__ __forceinline__ float f16_of(u32 word, bool hi) {
    const unsigned short h = (unsigned short)(hi ? word >> 16 : word & 0xffffu);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// q (0 <= q < 2^23) minus `bias` as a float, exactly: the float with q in its mantissa is
// 2^23 + q, and subtracting 2^23 + bias is exact.
template <int BIAS>
__device__ __forceinline__ float int_of(u32 q) {
    return __fsub_rn(__uint_as_float(0x4B000000u | q), 8388608.0f + (float)BIAS);
}
// A signed byte (the low 8 bits of b) as a float, exactly.
__device__ __forceinline__ float i8_of(u32 b) { return int_of<128>((b & 0xffu) ^ 0x80u); }

// Byte i (0..8) of an 8-byte run held as two words.
__device__ __forceinline__ u32 byte_of(uint2 v, int i) {
    return ((i < 4 ? v.x : v.y) >> (8 * (i & 3))) & 0xffu;
}

__device__ __forceinline__ uint4 pack8_bf16(const float v[8]) {
    return make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                      pack_bf16x2(v[6], v[7]));
}

struct Bf16W {
    typedef uint4 Raw;
    const __nv_bfloat16* w;
    u32 ld;  // elements between rows
    __device__ __forceinline__ Raw fetch(u32 n, u32 col) const {
        return load_stream(w + (u64)n * ld + col);
    }
    static __device__ __forceinline__ uint4 decode(const Raw& r, u32) { return r; }
    __device__ __forceinline__ uint4 load(u32 n, u32 col) const { return fetch(n, col); }
    // The same rows from column `col` on (a K-slice).
    __device__ __forceinline__ Bf16W from_col(u32 col) const { return Bf16W{w + col, ld}; }
};

// One GGUF block format: QK elements in BYTES bytes (device layout); fetch(b, e) loads what
// elements e .. e + 8 (e % 8 == 0) of the block at b need, decode(raw, e) dequantizes them.
template <int F>
struct Fmt;

// Q4_0 [d f16, pad 2, 16 bytes of nibbles: elements 0..16 low, 16..32 high]: d * (q - 8).
template <>
struct Fmt<2> {
    static constexpr u32 QK = 32, BYTES = 20;
    struct Raw {
        u32 d, lo, hi;
    };
    static __device__ __forceinline__ Raw fetch(const u8* b, u32 e) {
        const u8* q = b + 4 + (e & 15);
        return Raw{ld32(b), ld32(q), ld32(q + 4)};
    }
    static __device__ __forceinline__ uint4 decode(const Raw& r, u32 e) {
        const float d = f16_of(r.d, false);
        const uint2 qs = make_uint2(r.lo, r.hi);
        const int shift = e < 16 ? 0 : 4;
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(d, int_of<8>((byte_of(qs, i) >> shift) & 15));
        return pack8_bf16(v);
    }
};

// Q4_1 [d f16, m f16, 16 bytes of nibbles]: d * q + m.
template <>
struct Fmt<3> {
    static constexpr u32 QK = 32, BYTES = 20;
    struct Raw {
        u32 dm, lo, hi;
    };
    static __device__ __forceinline__ Raw fetch(const u8* b, u32 e) {
        const u8* q = b + 4 + (e & 15);
        return Raw{ld32(b), ld32(q), ld32(q + 4)};
    }
    static __device__ __forceinline__ uint4 decode(const Raw& r, u32 e) {
        const float d = f16_of(r.dm, false), m = f16_of(r.dm, true);
        const uint2 qs = make_uint2(r.lo, r.hi);
        const int shift = e < 16 ? 0 : 4;
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            v[i] = __fadd_rn(__fmul_rn(d, int_of<0>((byte_of(qs, i) >> shift) & 15)), m);
        }
        return pack8_bf16(v);
    }
};

// Q5_0 [d f16, pad 2, 32 fifth bits, 16 bytes of nibbles]: d * (q - 16).
template <>
struct Fmt<6> {
    static constexpr u32 QK = 32, BYTES = 24;
    struct Raw {
        u32 d, qh;
        uint2 qs;
    };
    static __device__ __forceinline__ Raw fetch(const u8* b, u32 e) {
        return Raw{ld32(b), ld32(b + 4), ld64(b + 8 + (e & 15))};
    }
    static __device__ __forceinline__ uint4 decode(const Raw& r, u32 e) {
        const float d = f16_of(r.d, false);
        const int shift = e < 16 ? 0 : 4;
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u32 q = ((byte_of(r.qs, i) >> shift) & 15) | (((r.qh >> (e + i)) & 1) << 4);
            v[i] = __fmul_rn(d, int_of<16>(q));
        }
        return pack8_bf16(v);
    }
};

// Q5_1 [d f16, m f16, 32 fifth bits, 16 bytes of nibbles]: d * q + m.
template <>
struct Fmt<7> {
    static constexpr u32 QK = 32, BYTES = 24;
    struct Raw {
        u32 dm, qh;
        uint2 qs;
    };
    static __device__ __forceinline__ Raw fetch(const u8* b, u32 e) {
        return Raw{ld32(b), ld32(b + 4), ld64(b + 8 + (e & 15))};
    }
    static __device__ __forceinline__ uint4 decode(const Raw& r, u32 e) {
        const float d = f16_of(r.dm, false), m = f16_of(r.dm, true);
        const int shift = e < 16 ? 0 : 4;
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u32 q = ((byte_of(r.qs, i) >> shift) & 15) | (((r.qh >> (e + i)) & 1) << 4);
            v[i] = __fadd_rn(__fmul_rn(d, int_of<0>(q)), m);
        }
        return pack8_bf16(v);
    }
};

// Q8_0 [d f16, pad 2, 32 signed bytes]: q * d.
template <>
struct Fmt<8> {
    static constexpr u32 QK = 32, BYTES = 36;
    struct Raw {
        u32 d, lo, hi;
    };
    static __device__ __forceinline__ Raw fetch(const u8* b, u32 e) {
        return Raw{ld32(b), ld32(b + 4 + e), ld32(b + 8 + e)};
    }
    static __device__ __forceinline__ uint4 decode(const Raw& r, u32) {
        const float d = f16_of(r.d, false);
        const uint2 qs = make_uint2(r.lo, r.hi);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(i8_of(byte_of(qs, i)), d);
        return pack8_bf16(v);
    }
};

// Q4_K/Q5_K scale and min of sub-block j (0..8), from the 16-byte head [d, dmin, 12 bytes of
// 6-bit fields]: head words 1, 2, 3 hold scale bytes 0..4, 4..8, 8..12.
__device__ __forceinline__ void k_scale_min(const uint4& head, u32 j, u32& sc, u32& m) {
    auto byte = [&](u32 i) {
        const u32 word = i < 4 ? head.y : (i < 8 ? head.z : head.w);
        return (word >> (8 * (i % 4))) & 0xffu;
    };
    if (j < 4) {
        sc = byte(j) & 63;
        m = byte(j + 4) & 63;
    } else {
        sc = (byte(j + 4) & 15) | ((byte(j - 4) >> 2) & 0x30);
        m = (byte(j + 4) >> 4) | ((byte(j) >> 2) & 0x30);
    }
}

// Q4_K [f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
// nibbles (sub-blocks 2i and 2i + 1 share 32 bytes, low then high nibbles)]:
// (d * sc) * q - dmin * m.
template <>
struct Fmt<12> {
    static constexpr u32 QK = 256, BYTES = 144;
    struct Raw {
        uint4 head;
        uint2 qs;
    };
    static __device__ __forceinline__ Raw fetch(const u8* b, u32 e) {
        const u32 j = e / 32, l = e % 32;
        return Raw{ld128(b), ld64(b + 16 + 32 * (j / 2) + l)};
    }
    static __device__ __forceinline__ uint4 decode(const Raw& r, u32 e) {
        const u32 j = e / 32;
        u32 sc, mn;
        k_scale_min(r.head, j, sc, mn);
        const float dl = __fmul_rn(f16_of(r.head.x, false), int_of<0>(sc));
        const float ml = __fmul_rn(f16_of(r.head.x, true), int_of<0>(mn));
        const int shift = 4 * (j % 2);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            v[i] = __fsub_rn(__fmul_rn(dl, int_of<0>((byte_of(r.qs, i) >> shift) & 15)), ml);
        }
        return pack8_bf16(v);
    }
};

// Q5_K: as Q4_K with 32 bytes of fifth bits (bit j of byte l for element l of sub-block j)
// between the head and the nibbles.
template <>
struct Fmt<13> {
    static constexpr u32 QK = 256, BYTES = 176;
    struct Raw {
        uint4 head;
        uint2 qh, qs;
    };
    static __device__ __forceinline__ Raw fetch(const u8* b, u32 e) {
        const u32 j = e / 32, l = e % 32;
        return Raw{ld128(b), ld64(b + 16 + l), ld64(b + 48 + 32 * (j / 2) + l)};
    }
    static __device__ __forceinline__ uint4 decode(const Raw& r, u32 e) {
        const u32 j = e / 32;
        u32 sc, mn;
        k_scale_min(r.head, j, sc, mn);
        const float dl = __fmul_rn(f16_of(r.head.x, false), int_of<0>(sc));
        const float ml = __fmul_rn(f16_of(r.head.x, true), int_of<0>(mn));
        const int shift = 4 * (j % 2);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u32 q = ((byte_of(r.qs, i) >> shift) & 15) | (((byte_of(r.qh, i) >> j) & 1) << 4);
            v[i] = __fsub_rn(__fmul_rn(dl, int_of<0>(q)), ml);
        }
        return pack8_bf16(v);
    }
};

// Q6_K [128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 signed scales (one per 16
// elements), f16 d, pad 14]: (d * sc) * (q - 32). In each 128-element half, element r's low
// nibble is byte r % 64 of the half's 64 (low nibble for r < 64), its high bits the 2-bit field
// r / 32 of byte r % 32 of the half's 32.
template <>
struct Fmt<14> {
    static constexpr u32 QK = 256, BYTES = 224;
    struct Raw {
        uint2 ql, qh;
        u32 sc, d;
    };
    static __device__ __forceinline__ Raw fetch(const u8* b, u32 e) {
        const u32 half = e / 128, r = e % 128;
        return Raw{ld64(b + half * 64 + r % 64), ld64(b + 128 + half * 32 + r % 32),
                   ld32(b + 192 + (e / 16 & ~3u)), ld32(b + 208)};
    }
    static __device__ __forceinline__ uint4 decode(const Raw& raw, u32 e) {
        const float sc = i8_of(raw.sc >> (8 * (e / 16 % 4)));
        const float dl = __fmul_rn(f16_of(raw.d, false), sc);
        const u32 r = e % 128;
        const int lo_shift = 4 * (r / 64), hi_shift = 2 * (r / 32);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u32 low = (byte_of(raw.ql, i) >> lo_shift) & 15;
            const u32 high = (byte_of(raw.qh, i) >> hi_shift) & 3;
            v[i] = __fmul_rn(dl, int_of<32>(low | (high << 4)));
        }
        return pack8_bf16(v);
    }
};

// Formats of quantized safetensors checkpoints, in strata's own device blocks of 64 weights
// (src/blocks.rs writes them from the checkpoint's parts; ids from 1000 on are no ggml types).
// Each decodes to the f32 the CPU reference computes (model/src/weights/quant.rs: the same IEEE
// single-precision operations, no fused multiply-add), rounded once to bf16.

// An e4m3 byte (float8_e4m3fn, finite: loaders refuse NaN scales) as a float, exactly.
__device__ __forceinline__ float e4m3_of(u32 b) {
    const u32 sign = (b & 0x80u) << 24, exponent = (b >> 3) & 15u, mantissa = b & 7u;
    const float magnitude = exponent == 0
                                ? __fmul_rn(int_of<0>(mantissa), 0.001953125f)  // m * 2^-9
                                : __uint_as_float(((exponent + 120u) << 23) | (mantissa << 20));
    return __uint_as_float(__float_as_uint(magnitude) | sign);
}

// An e2m1 nibble (the low four bits of q) as a float, exactly: 0, 0.5, 1, 1.5, 2, 3, 4, 6, signed;
// the code 0b1000 is -0 with SIGNED_ZERO, else +0 (ModelOpt's table has no negative zero).
template <bool SIGNED_ZERO>
__device__ __forceinline__ float e2m1_of(u32 q) {
    const u32 e = (q >> 1) & 3u, m = q & 1u;
    const u32 bits = e != 0 ? ((e + 126u) << 23) | (m << 22) : (m != 0 ? 0x3F000000u : 0u);
    const u32 sign = (q & 8u) << 28;
    return __uint_as_float(bits | (SIGNED_ZERO || bits != 0 ? sign : 0u));
}

// NVFP4 [tensor scale f32, 4 e4m3 group scales, 32 bytes of e2m1 pairs (the even weight in the
// low nibble)]: q * (g / t) (compressed-tensors, DIVIDE) or q * (g * t) (ModelOpt, whose e2m1
// has no negative zero).
template <bool DIVIDE>
struct Nvfp4Fmt {
    static constexpr u32 QK = 64, BYTES = 40;
    struct Raw {
        uint2 tg;
        u32 q;
    };
    static __device__ __forceinline__ Raw fetch(const u8* b, u32 e) {
        return Raw{ld64(b), ld32(b + 8 + e / 2)};
    }
    static __device__ __forceinline__ uint4 decode(const Raw& r, u32 e) {
        const float t = __uint_as_float(r.tg.x);
        const float g = e4m3_of((r.tg.y >> (8 * (e / 16))) & 0xffu);
        const float scale = DIVIDE ? __fdiv_rn(g, t) : __fmul_rn(g, t);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(e2m1_of<DIVIDE>(r.q >> (4 * i)), scale);
        return pack8_bf16(v);
    }
};
template <>
struct Fmt<1001> : Nvfp4Fmt<true> {};
template <>
struct Fmt<1002> : Nvfp4Fmt<false> {};

// FP8 [scale f32, 64 e4m3 weights]: q * s, the scale of the block's row and columns (one per
// tensor, per row, or per 128 x 128 block in the checkpoint).
template <>
struct Fmt<1003> {
    static constexpr u32 QK = 64, BYTES = 68;
    struct Raw {
        u32 s, lo, hi;
    };
    static __device__ __forceinline__ Raw fetch(const u8* b, u32 e) {
        return Raw{ld32(b), ld32(b + 4 + e), ld32(b + 8 + e)};
    }
    static __device__ __forceinline__ uint4 decode(const Raw& r, u32) {
        const float s = __uint_as_float(r.s);
        const uint2 q = make_uint2(r.lo, r.hi);
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(e4m3_of(byte_of(q, i)), s);
        return pack8_bf16(v);
    }
};

template <int F>
struct BlockW {
    typedef typename Fmt<F>::Raw Raw;
    const u8* w;
    u64 row_bytes;
    __device__ __forceinline__ Raw fetch(u32 n, u32 col) const {
        const u8* b = w + (u64)n * row_bytes + (u64)(col / Fmt<F>::QK) * Fmt<F>::BYTES;
        return Fmt<F>::fetch(b, col % Fmt<F>::QK);
    }
    static __device__ __forceinline__ uint4 decode(const Raw& r, u32 col) {
        return Fmt<F>::decode(r, col % Fmt<F>::QK);
    }
    __device__ __forceinline__ uint4 load(u32 n, u32 col) const {
        return decode(fetch(n, col), col);
    }
    // The same rows from column `col` on (col % QK == 0).
    __device__ __forceinline__ BlockW from_col(u32 col) const {
        return BlockW{w + (u64)(col / Fmt<F>::QK) * Fmt<F>::BYTES, row_bytes};
    }
};

// The device bytes of one row of k elements.
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
    MACRO(14, q6_k)                  \
    MACRO(1001, nvfp4)               \
    MACRO(1002, nvfp4_modelopt)      \
    MACRO(1003, fp8)
