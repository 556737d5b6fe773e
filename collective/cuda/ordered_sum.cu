// The NCCL communicator's all-reduce, second half: NCCL has gathered every rank's buffer into
// `gathered` (rank-major, `world` rows of `n`), and each element is summed here in rank order,
// `((g[0][i] + g[1][i]) + g[2][i]) + ...`, starting from rank 0's value. Every rank runs the same
// additions on the same gathered bits, so every rank gets the same bits.
//
// Plain additions only: no fast-math, no contraction (there is nothing to contract), no
// flush-to-zero (the compile options keep denormals), so the result equals the host reference
// (`strata_collective::ordered`) bit for bit.

// bf16 -> f32 is exact: the bf16 bits are the top half of the f32.
__device__ __forceinline__ float bf16_bits_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

// f32 -> bf16, round to nearest even; a NaN keeps its sign and top payload and becomes quiet.
// Spelled out in integer arithmetic so that it matches the host reference exactly, NaNs included.
__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x0040u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

extern "C" __global__ void ordered_sum_f32(const float* __restrict__ gathered,
                                           float* __restrict__ out,
                                           unsigned long long n,
                                           int world) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float acc = gathered[i];
        for (int r = 1; r < world; ++r) {
            acc += gathered[(unsigned long long)r * n + i];
        }
        out[i] = acc;
    }
}

// bf16 buffers: widened to f32, added in rank order in f32, rounded to bf16 once at the end.
extern "C" __global__ void ordered_sum_bf16(const unsigned short* __restrict__ gathered,
                                            unsigned short* __restrict__ out,
                                            unsigned long long n,
                                            int world) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        float acc = bf16_bits_to_f32(gathered[i]);
        for (int r = 1; r < world; ++r) {
            acc += bf16_bits_to_f32(gathered[(unsigned long long)r * n + i]);
        }
        out[i] = f32_to_bf16_bits(acc);
    }
}
