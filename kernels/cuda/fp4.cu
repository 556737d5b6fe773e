// NVFP4 activations (W4A4): the quantizer of a Linear's input rows, on every architecture, and
// the block-scaled FP4 tensor-core product of Blackwell (sm_120a / sm_121a: `mma.sync ...
// kind::mxf4nvf4.block_scale`), compiled everywhere but computing only there.
//
// The quantizer is compressed-tensors' W4A4 input arithmetic, bit for bit the CPU reference's
// (model/src/quantize/activations.rs): per group of 16 values of a row, under the checkpoint's
// static global scale g (`input_global_scale`),
//     s8 = e4m3(g * (amax / 6))   (0.125, e4m3's step at 1, where that is zero)
//     code = e2m1(x / (s8 / g))
// each conversion to nearest with ties to even, saturating (e4m3 at 448, e2m1 at 6). It writes
// the codes (two a byte, the even element in the low nibble) and the group scales' e4m3 bytes:
// the operands the FP4 MMA multiplies, where code * s8 / g is the reference's dequantized value.
#include "lowp.cuh"

// One thread per group of 16: x `[m, k]` bf16 (k % 16 == 0); codes `[m, k / 2]`, scales
// `[m, k / 16]` (e4m3 bytes).
extern "C" __global__ void nvfp4_quantize_rows(const __nv_bfloat16* __restrict__ x,
                                               u8* __restrict__ codes, u8* __restrict__ scales,
                                               u32 m, u32 k, float global) {
    const u64 groups = (u64)m * (k / 16);
    for (u64 gi = (u64)blockIdx.x * blockDim.x + threadIdx.x; gi < groups;
         gi += (u64)gridDim.x * blockDim.x) {
        const uint4* src = reinterpret_cast<const uint4*>(x + gi * 16);
        float v[16];
        unpack8(src[0], v);
        unpack8(src[1], v + 8);
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
        u32 s8 = to_e4m3(__fmul_rn(global, __fdiv_rn(amax, 6.0f)));
        // A zero scale stands in as e4m3's 0.125 (code 0x20).
        if ((s8 & 0x7fu) == 0) s8 = 0x20u;
        const float s = __fdiv_rn(e4m3_of(s8), global);
        u32 packed[2] = {0u, 0u};
#pragma unroll
        for (int i = 0; i < 16; ++i) packed[i / 8] |= to_e2m1(__fdiv_rn(v[i], s)) << (4 * (i % 8));
        reinterpret_cast<uint2*>(codes)[gi] = make_uint2(packed[0], packed[1]);
        scales[gi] = (u8)s8;
    }
}

// The W4A4 product on Blackwell's block-scaled FP4 tensor cores:
//     y[r, c] = bf16( (sum_k code_x[r, k] s8_x[r, k / 16] * q_w[c, k] g_w[c, k / 16]) / global
//                     * (1 / t_w or t_w) )
// x as nvfp4_quantize_rows wrote it (codes `[m, k / 2]`, e4m3 scales `[m, k / 16]`, global scale
// `global`), w `[n, k]` in strata's NVFP4 device blocks (64 values a block: tensor scale t_w f32,
// four e4m3 group scales g_w, 32 bytes of codes; DIVIDE: compressed-tensors' q * g / t, else
// ModelOpt's q * g * t), y `[m, n]` bf16. k % 64 == 0, n % 8 == 0; group scales non-negative
// (the MMA's ue4m3 has no sign).
//
// One warp computes a 16 x 8 tile of y, one `mma.sync.m16n8k64 ... kind::mxf4nvf4.block_scale
// .scale_vec::4X` per 64 columns of k (one weight block); FP4_WARPS warps a block side by side
// along n. Operand layouts (PTX ISA, "Matrix fragments for mma.m16n8k64", with g = lane / 4,
// t = lane % 4): A register i holds row g + 8 (i & 1), k = 8 t + 32 (i >> 1) + nibble; B register
// i holds column g, k = 8 t + 32 i + nibble; C/D i holds row g + 8 (i >> 1), column 2 t + (i & 1).
// Scales (thread-id 0 for both): lane L with L % 4 < 2 gives row g + 8 (L & 1) of A, lane L with
// L % 4 == 0 column g of B, byte j the scale of k = 16 j .. 16 j + 15 of the step (CUTLASS's
// SM120 scale-factor layout; the PTX text shows it only as figures).
//
// Written and compile-checked for sm_120a, not yet run on a Blackwell GPU (none is lent here):
// the launcher refuses other architectures and the self-test gates it where one exists.
#define FP4_WARPS 4

template <bool DIVIDE>
__device__ __forceinline__ void nvfp4_mma_gemm_body(const u8* __restrict__ codes,
                                                    const u8* __restrict__ scales,
                                                    const u8* __restrict__ w, u64 w_row_bytes,
                                                    __nv_bfloat16* __restrict__ y, u32 m, u32 n,
                                                    u32 k, float global) {
#if defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL)
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 g = lane >> 2, t = lane & 3;
    const u32 row0 = blockIdx.y * 16 + g, row1 = row0 + 8;
    const u32 col_base = (blockIdx.x * FP4_WARPS + warp) * 8;
    if (col_base >= n) return;  // uniform across the warp
    const u32 col = col_base + g;
    const u32 srow = blockIdx.y * 16 + g + 8 * (lane & 1);
    const u64 code_row = k / 2, scale_row = k / 16;
    const u8* w_row = w + (u64)col * w_row_bytes;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (u32 step = 0; step < k / 64; ++step) {
        const u64 at = (u64)step * 32 + 4 * t;
        const u32 a0 = row0 < m ? ld32(codes + row0 * code_row + at) : 0u;
        const u32 a1 = row1 < m ? ld32(codes + row1 * code_row + at) : 0u;
        const u32 a2 = row0 < m ? ld32(codes + row0 * code_row + at + 16) : 0u;
        const u32 a3 = row1 < m ? ld32(codes + row1 * code_row + at + 16) : 0u;
        const u8* block = w_row + (u64)step * 40;
        const u32 b0 = ld32(block + 8 + 4 * t), b1 = ld32(block + 24 + 4 * t);
        const u32 sfa = srow < m ? ld32(scales + srow * scale_row + (u64)step * 4) : 0u;
        const u32 sfb = ld32(block + 4) & 0x7f7f7f7fu;
        asm volatile(
            "mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col.f32.e2m1."
            "e2m1.f32.ue4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3}, %10, "
            "{0, 0}, %11, {0, 0};"
            : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(sfa), "r"(sfb));
    }
    // The tensor scale of this thread's two columns (every block of a row holds it).
    float factor[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const u32 c = col_base + 2 * t + i;
        const float tw = __uint_as_float(ld32(w + (u64)c * w_row_bytes));
        factor[i] = DIVIDE ? __frcp_rn(tw) : tw;
    }
    const u32 out_col = col_base + 2 * t;
    if (row0 < m)
        *reinterpret_cast<u32*>(y + (u64)row0 * n + out_col) =
            pack_bf16x2(__fmul_rn(__fdiv_rn(acc[0], global), factor[0]),
                        __fmul_rn(__fdiv_rn(acc[1], global), factor[1]));
    if (row1 < m)
        *reinterpret_cast<u32*>(y + (u64)row1 * n + out_col) =
            pack_bf16x2(__fmul_rn(__fdiv_rn(acc[2], global), factor[0]),
                        __fmul_rn(__fdiv_rn(acc[3], global), factor[1]));
#else
    __trap();  // the launcher admits only sm_120a / sm_121a
#endif
}

extern "C" __global__ void __launch_bounds__(FP4_WARPS * 32)
    nvfp4_mma_gemm(const u8* codes, const u8* scales, const u8* w, u64 w_row_bytes,
                   __nv_bfloat16* y, u32 m, u32 n, u32 k, float global) {
    nvfp4_mma_gemm_body<true>(codes, scales, w, w_row_bytes, y, m, n, k, global);
}

extern "C" __global__ void __launch_bounds__(FP4_WARPS * 32)
    nvfp4_mma_gemm_modelopt(const u8* codes, const u8* scales, const u8* w, u64 w_row_bytes,
                            __nv_bfloat16* y, u32 m, u32 n, u32 k, float global) {
    nvfp4_mma_gemm_body<false>(codes, scales, w, w_row_bytes, y, m, n, k, global);
}
