// FP8 activations (W8A8): the quantizer of a Linear's input rows, compressed-tensors' input
// arithmetic bit for bit the CPU reference's (model/src/quantize/activations.rs):
//     static:    code = e4m3(x / s) with the checkpoint's `input_scale` s
//     per token: s = amax(row) / 448 (f32's epsilon for a row of zeros), code = e4m3(x / s)
// each conversion to nearest with ties to even, saturating at 448. It writes the e4m3 codes and
// each row's scale: the operands an FP8 GEMM multiplies, where code * s is the reference's
// dequantized value.
#include "lowp.cuh"

#define FP8_QUANT_THREADS 256

// One block per row: x `[m, k]` bf16 (k % 8 == 0, 16-byte aligned); codes `[m, k]`, scales
// `[m]` f32. `scale` > 0: that static scale for every row; 0: a scale per row.
extern "C" __global__ void __launch_bounds__(FP8_QUANT_THREADS)
    fp8_quantize_rows(const __nv_bfloat16* __restrict__ x, u8* __restrict__ codes,
                      float* __restrict__ scales, u32 m, u32 k, float scale) {
    __shared__ float warp_max[FP8_QUANT_THREADS / 32];
    const u32 row = blockIdx.x;
    if (row >= m) return;
    const uint4* src = reinterpret_cast<const uint4*>(x + (u64)row * k);
    float s = scale;
    if (s == 0.0f) {
        // The row's largest magnitude: a maximum, exact in any order.
        float amax = 0.0f;
        for (u32 c = threadIdx.x; c < k / 8; c += blockDim.x) {
            float v[8];
            unpack8(src[c], v);
#pragma unroll
            for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
        __syncthreads();
        amax = 0.0f;
#pragma unroll
        for (int w = 0; w < FP8_QUANT_THREADS / 32; ++w) amax = fmaxf(amax, warp_max[w]);
        s = __fdiv_rn(amax, 448.0f);
        if (s == 0.0f) s = 1.1920929e-07f;  // f32's epsilon, 2^-23
    }
    u8* out = codes + (u64)row * k;
    for (u32 c = threadIdx.x; c < k / 8; c += blockDim.x) {
        float v[8];
        unpack8(src[c], v);
        u32 lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) lo |= to_e4m3(__fdiv_rn(v[i], s)) << (8 * i);
#pragma unroll
        for (int i = 0; i < 4; ++i) hi |= to_e4m3(__fdiv_rn(v[4 + i], s)) << (8 * i);
        reinterpret_cast<uint2*>(out)[c] = make_uint2(lo, hi);
    }
    if (threadIdx.x == 0) scales[row] = s;
}

// The scales of an FP8 product: y[r, c] = bf16(acc[r, c] * x_scale[r] * w_scale[c]) for the
// f32 sums of e4m3 codes `acc` `[m, n]` (cuBLASLt's unscaled FP8 GEMM), each activation row's
// scale and each weight row's (a per-tensor scale repeated).
extern "C" __global__ void fp8_scale_out(const float* __restrict__ acc,
                                         const float* __restrict__ x_scale,
                                         const float* __restrict__ w_scale,
                                         __nv_bfloat16* __restrict__ y, u32 m, u32 n) {
    const u64 total = (u64)m * n;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        const u32 r = (u32)(i / n), c = (u32)(i % n);
        y[i] = f32_to_bf16(__fmul_rn(__fmul_rn(acc[i], x_scale[r]), w_scale[c]));
    }
}
