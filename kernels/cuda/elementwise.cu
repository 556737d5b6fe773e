// Row-wise and elementwise kernels: embedding gather, RMSNorm (plain, fused residual add, per
// head, Gemma 3's sandwich), bias add, rotary embedding + paged KV write, gated SiLU / GELU-tanh
// products, the embedding scale.
//
// Rounding follows HF transformers in bf16: each value HF materialises as a bf16 tensor is
// rounded here at the same point; everything between two such points is f32.
#include "common.cuh"

constexpr int NORM_THREADS = 256;

// out[t, :] = table[ids[t] - first, :] for ids in first .. first + rows. One block per token,
// 16-byte copies (hidden % 8 == 0). Any other id writes a row of `fill` (bf16 bits): zero for a
// whole table (the launcher cannot see device ids; zero is detectable upstream and never reads
// out of bounds), -0.0 for a rank's vocabulary shard, the exact additive identity, so the
// all-reduce of the ranks' rows returns the owner's row bit for bit.
extern "C" __global__ void __launch_bounds__(256)
embed(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ table,
      const u32* __restrict__ ids, u32 hidden, u32 first, u32 rows, u32 fill) {
    const u32 t = blockIdx.x;
    const u32 id = ids[t];
    const u32 chunks = hidden / 8;
    uint4* dst = reinterpret_cast<uint4*>(out + (u64)t * hidden);
    if (id < first || id - first >= rows) {
        const u32 word = fill | (fill << 16);
        for (u32 c = threadIdx.x; c < chunks; c += blockDim.x) {
            dst[c] = make_uint4(word, word, word, word);
        }
        return;
    }
    const uint4* src = reinterpret_cast<const uint4*>(table + (u64)(id - first) * hidden);
    for (u32 c = threadIdx.x; c < chunks; c += blockDim.x) dst[c] = src[c];
}

// out[i] = bf16(((p[0][i] + p[1][i]) + p[2][i]) + ...) for i < n, shard s at p + s * stride:
// the row-parallel partials added in shard order, in f32, rounded once.
extern "C" __global__ void __launch_bounds__(256)
sum_shards_bf16(__nv_bfloat16* __restrict__ out, const float* __restrict__ partials, u32 shards,
                u64 stride, u64 n) {
    const u64 step = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        float acc = partials[i];
        for (u32 s = 1; s < shards; ++s) acc += partials[(u64)s * stride + i];
        out[i] = f32_to_bf16(acc);
    }
}

// 1 / sqrt(mean + eps) with IEEE sqrt and division (no approximate rsqrt).
__device__ __forceinline__ float inv_rms(float sum_sq, u32 n, float eps) {
    return 1.0f / sqrtf(sum_sq / (float)n + eps);
}

// The two RMSNorm weightings. bf16 weights (HF's Llama-family RMSNorm): the normalised value is
// rounded to bf16, then times the weight. f32 weights (Gemma 3's RMSNorm, the weight already
// `1 + w` in f32): the normalised value times the weight, unrounded between.
__device__ __forceinline__ void load_weight8(const __nv_bfloat16* w, float g[8]) {
    unpack8(load16(w), g);
}
__device__ __forceinline__ void load_weight8(const float* w, float g[8]) {
    const float4 a = reinterpret_cast<const float4*>(w)[0];
    const float4 b = reinterpret_cast<const float4*>(w)[1];
    g[0] = a.x; g[1] = a.y; g[2] = a.z; g[3] = a.w;
    g[4] = b.x; g[5] = b.y; g[6] = b.z; g[7] = b.w;
}
template <typename W> __device__ __forceinline__ float weight_f32(W w);
template <> __device__ __forceinline__ float weight_f32(float w) { return w; }
template <> __device__ __forceinline__ float weight_f32(__nv_bfloat16 w) { return bf16_to_f32(w); }
// x * inv weighted by g (the weight widened to f32) under W's rule.
template <typename W> __device__ __forceinline__ float norm_out(float x, float inv, float g);
template <> __device__ __forceinline__ float norm_out<__nv_bfloat16>(float x, float inv, float g) {
    return round_bf16(x * inv) * g;
}
template <> __device__ __forceinline__ float norm_out<float>(float x, float inv, float g) {
    return __fmul_rn(__fmul_rn(x, inv), g);
}

// Each thread owns the 8-element chunks c = threadIdx.x + i * NORM_THREADS, so the sum of
// squares runs in an order fixed by `hidden` alone.
template <typename W>
__device__ __forceinline__ void rmsnorm_row(__nv_bfloat16* __restrict__ out,
                                            const __nv_bfloat16* __restrict__ x,
                                            const W* __restrict__ w, u32 hidden, float eps,
                                            float* scratch) {
    const u32 chunks = hidden / 8;
    float sum_sq = 0.0f;
    for (u32 c = threadIdx.x; c < chunks; c += NORM_THREADS) {
        float v[8];
        unpack8(load16(x + c * 8), v);
#pragma unroll
        for (int j = 0; j < 8; ++j) sum_sq = __fmaf_rn(v[j], v[j], sum_sq);
    }
    const float inv = inv_rms(block_sum<NORM_THREADS>(sum_sq, scratch), hidden, eps);
    for (u32 c = threadIdx.x; c < chunks; c += NORM_THREADS) {
        float v[8], g[8], o[8];
        unpack8(load16(x + c * 8), v);
        load_weight8(w + c * 8, g);
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = norm_out<W>(v[j], inv, g[j]);
        store16(out + c * 8, pack8(o));
    }
}

// out[r, :] = RMSNorm(x[r, :]) * w. One block per row; hidden % 8 == 0.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
rmsnorm(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ x,
        const __nv_bfloat16* __restrict__ w, u32 hidden, float eps) {
    __shared__ float scratch[32];
    const u64 row = (u64)blockIdx.x * hidden;
    rmsnorm_row(out + row, x + row, w, hidden, eps, scratch);
}

// As rmsnorm, with f32 weights (Gemma 3).
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
rmsnorm_f32w(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ x,
             const float* __restrict__ w, u32 hidden, float eps) {
    __shared__ float scratch[32];
    const u64 row = (u64)blockIdx.x * hidden;
    rmsnorm_row(out + row, x + row, w, hidden, eps, scratch);
}

// Gemma 3's sandwich: the block output x is normed (f32 weight wx) and rounded, added to the
// residual in bf16, and the sum normed for the next block (f32 weight w):
//   residual[r, :] = bf16(residual[r, :] + bf16(RMSNorm(x[r, :]) * wx))
//   out[r, :] = bf16(RMSNorm(residual[r, :]) * w)
// Each thread re-reads only the chunks it wrote itself.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
sandwich_add_rmsnorm(__nv_bfloat16* __restrict__ out, __nv_bfloat16* __restrict__ residual,
                     const __nv_bfloat16* __restrict__ x, const float* __restrict__ wx,
                     const float* __restrict__ w, u32 hidden, float eps) {
    __shared__ float scratch[32];
    const u64 row = (u64)blockIdx.x * hidden;
    __nv_bfloat16* res = residual + row;
    const __nv_bfloat16* xr = x + row;
    const u32 chunks = hidden / 8;
    float x_sq = 0.0f;
    for (u32 c = threadIdx.x; c < chunks; c += NORM_THREADS) {
        float b[8];
        unpack8(load16(xr + c * 8), b);
#pragma unroll
        for (int j = 0; j < 8; ++j) x_sq = __fmaf_rn(b[j], b[j], x_sq);
    }
    const float inv_x = inv_rms(block_sum<NORM_THREADS>(x_sq, scratch), hidden, eps);
    float sum_sq = 0.0f;
    for (u32 c = threadIdx.x; c < chunks; c += NORM_THREADS) {
        float a[8], b[8], g[8], s[8];
        unpack8(load16(res + c * 8), a);
        unpack8(load16(xr + c * 8), b);
        load_weight8(wx + c * 8, g);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            s[j] = round_bf16(a[j] + round_bf16(norm_out<float>(b[j], inv_x, g[j])));
            sum_sq = __fmaf_rn(s[j], s[j], sum_sq);
        }
        store16(res + c * 8, pack8(s));
    }
    const float inv = inv_rms(block_sum<NORM_THREADS>(sum_sq, scratch), hidden, eps);
    for (u32 c = threadIdx.x; c < chunks; c += NORM_THREADS) {
        float v[8], g[8], o[8];
        unpack8(load16(res + c * 8), v);
        load_weight8(w + c * 8, g);
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = norm_out<float>(v[j], inv, g[j]);
        store16(out + (row + c * 8), pack8(o));
    }
}

// residual[r, :] = bf16(residual[r, :] + x[r, :]); out[r, :] = RMSNorm(residual[r, :]) * w.
// The sum is rounded to bf16 before the norm reads it (HF adds in bf16). Each thread re-reads
// only the chunks it wrote itself, so no barrier is needed between the two passes.
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
add_rmsnorm(__nv_bfloat16* __restrict__ out, __nv_bfloat16* __restrict__ residual,
            const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, u32 hidden,
            float eps) {
    __shared__ float scratch[32];
    const u64 row = (u64)blockIdx.x * hidden;
    __nv_bfloat16* res = residual + row;
    const __nv_bfloat16* xr = x + row;
    const u32 chunks = hidden / 8;
    float sum_sq = 0.0f;
    for (u32 c = threadIdx.x; c < chunks; c += NORM_THREADS) {
        float a[8], b[8], s[8];
        unpack8(load16(res + c * 8), a);
        unpack8(load16(xr + c * 8), b);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            s[j] = round_bf16(a[j] + b[j]);
            sum_sq = __fmaf_rn(s[j], s[j], sum_sq);
        }
        store16(res + c * 8, pack8(s));
    }
    const float inv = inv_rms(block_sum<NORM_THREADS>(sum_sq, scratch), hidden, eps);
    for (u32 c = threadIdx.x; c < chunks; c += NORM_THREADS) {
        float v[8], g[8], o[8];
        unpack8(load16(res + c * 8), v);
        unpack8(load16(w + c * 8), g);
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = norm_out<__nv_bfloat16>(v[j], inv, g[j]);
        store16(out + (row + c * 8), pack8(o));
    }
}

// In-place RMSNorm of each head_dim-long vector of x [vectors, head_dim] (Qwen3's and Gemma 3's
// q/k norm). One warp per vector; lane l owns elements l*PER .. l*PER+PER-1 (PER = head_dim / 32,
// at most 8), so the sum runs lane-sequential then by the fixed warp butterfly.
constexpr int HEAD_NORM_WARPS = 4;
template <typename W>
__device__ __forceinline__ void head_rmsnorm_vec(__nv_bfloat16* __restrict__ x,
                                                 const W* __restrict__ w, u32 vectors,
                                                 u32 head_dim, float eps) {
    const u32 vec = blockIdx.x * HEAD_NORM_WARPS + (threadIdx.x >> 5);
    if (vec >= vectors) return;
    const u32 lane = threadIdx.x & 31;
    const u32 per = head_dim / 32;
    __nv_bfloat16* v = x + (u64)vec * head_dim + lane * per;
    float vals[8];
    float sum_sq = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        if (j < (int)per) {
            vals[j] = bf16_to_f32(v[j]);
            sum_sq = __fmaf_rn(vals[j], vals[j], sum_sq);
        }
    }
    const float inv = inv_rms(warp_sum(sum_sq), head_dim, eps);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        if (j < (int)per) {
            v[j] = f32_to_bf16(norm_out<W>(vals[j], inv, weight_f32(w[lane * per + j])));
        }
    }
}

extern "C" __global__ void __launch_bounds__(HEAD_NORM_WARPS * 32)
head_rmsnorm(__nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, u32 vectors,
             u32 head_dim, float eps) {
    head_rmsnorm_vec(x, w, vectors, head_dim, eps);
}

// As head_rmsnorm, with f32 weights (Gemma 3).
extern "C" __global__ void __launch_bounds__(HEAD_NORM_WARPS * 32)
head_rmsnorm_f32w(__nv_bfloat16* __restrict__ x, const float* __restrict__ w, u32 vectors,
                  u32 head_dim, float eps) {
    head_rmsnorm_vec(x, w, vectors, head_dim, eps);
}

// x[r, n] = bf16(x[r, n] + bias[n]) over x [rows, cols], 8 elements per thread (cols % 8 == 0).
extern "C" __global__ void __launch_bounds__(256)
add_bias(__nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ bias, u32 rows,
         u32 cols) {
    const u32 chunks_per_row = cols / 8;
    const u64 total = (u64)rows * chunks_per_row;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        const u32 c = (u32)(i % chunks_per_row);
        float a[8], b[8];
        unpack8(load16(x + i * 8), a);
        unpack8(load16(bias + c * 8), b);
#pragma unroll
        for (int j = 0; j < 8; ++j) a[j] = a[j] + b[j];
        store16(x + i * 8, pack8(a));
    }
}

// Rotary embedding in HF's rotate-half layout, in place over `heads` vectors of one token:
//   lo' = lo * cos - hi * sin,  hi' = hi * cos + lo * sin   (pairs i and i + d/2)
// in f32 with the f32 table, each result rounded once to bf16.
__device__ __forceinline__ void rope_heads(__nv_bfloat16* __restrict__ x, u32 heads, u32 d,
                                           const float* __restrict__ cs) {
    const u32 half = d / 2;
    for (u32 p = threadIdx.x; p < heads * half; p += blockDim.x) {
        const u32 h = p / half, i = p % half;
        __nv_bfloat16* head = x + (u64)h * d;
        const float lo = bf16_to_f32(head[i]);
        const float hi = bf16_to_f32(head[i + half]);
        const float c = cs[i], s = cs[half + i];
        head[i] = f32_to_bf16(__fsub_rn(__fmul_rn(lo, c), __fmul_rn(hi, s)));
        head[i + half] = f32_to_bf16(__fadd_rn(__fmul_rn(hi, c), __fmul_rn(lo, s)));
    }
}

// For token t (one block each): rotate q[t] ([n_q, d]) and k[t] ([n_kv, d]) in place by the
// cos/sin row positions[t] of cos_sin [max_positions, d]; then copy the rotated k[t] and v[t]
// into the paged caches [num_blocks, block_size, n_kv, d] at slot slot_mapping[t]
// (block * block_size + offset). A position >= max_positions leaves q and k unrotated and
// writes nothing; a slot >= num_slots (e.g. 0xffffffff for padding) is not written.
extern "C" __global__ void __launch_bounds__(256)
rope_kv_write(__nv_bfloat16* __restrict__ q, __nv_bfloat16* __restrict__ k,
              const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ k_cache,
              __nv_bfloat16* __restrict__ v_cache, const float* __restrict__ cos_sin,
              const u32* __restrict__ positions, const u32* __restrict__ slot_mapping, u32 n_q,
              u32 n_kv, u32 d, u32 max_positions, u64 num_slots) {
    const u32 t = blockIdx.x;
    const u32 pos = positions[t];
    if (pos >= max_positions) return;
    const float* cs = cos_sin + (u64)pos * d;
    __nv_bfloat16* kt = k + (u64)t * n_kv * d;
    rope_heads(q + (u64)t * n_q * d, n_q, d, cs);
    rope_heads(kt, n_kv, d, cs);
    const u64 slot = slot_mapping[t];
    if (slot >= num_slots) return;
    __syncthreads();  // the rotated k of this token is complete before it is copied
    const u32 chunks = n_kv * d / 8;
    const uint4* ks = reinterpret_cast<const uint4*>(kt);
    const uint4* vs = reinterpret_cast<const uint4*>(v + (u64)t * n_kv * d);
    uint4* kd = reinterpret_cast<uint4*>(k_cache + slot * n_kv * d);
    uint4* vd = reinterpret_cast<uint4*>(v_cache + slot * n_kv * d);
    for (u32 c = threadIdx.x; c < chunks; c += blockDim.x) {
        kd[c] = ks[c];
        vd[c] = vs[c];
    }
}

// The gate activations, in f32. silu: IEEE expf and division. gelu_tanh: PyTorch's
// gelu(approximate="tanh") in its order, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), no FMA.
struct Silu {
    static __device__ __forceinline__ float apply(float g) {
        return __fdiv_rn(g, 1.0f + expf(-g));
    }
};
struct GeluTanh {
    static __device__ __forceinline__ float apply(float x) {
        const float beta = 0.7978845608028654f;  // sqrt(2 / pi)
        const float kappa = 0.044715f;
        const float cube = __fmul_rn(__fmul_rn(x, x), x);
        const float inner = __fmul_rn(beta, __fadd_rn(x, __fmul_rn(kappa, cube)));
        return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, tanhf(inner)));
    }
};

// out[t, i] = bf16(bf16(act(gate_up[t, i])) * gate_up[t, I + i]) with gate_up [T, 2I],
// out [T, I], I % 8 == 0 (HF rounds the activation before the product).
template <typename Act>
__device__ __forceinline__ void gated(__nv_bfloat16* __restrict__ out,
                                      const __nv_bfloat16* __restrict__ gate_up, u32 tokens,
                                      u32 inter) {
    const u32 chunks_per_row = inter / 8;
    const u64 total = (u64)tokens * chunks_per_row;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        const u64 t = i / chunks_per_row;
        const u32 c = (u32)(i % chunks_per_row);
        const __nv_bfloat16* row = gate_up + t * 2 * inter;
        float g[8], u[8], o[8];
        unpack8(load16(row + c * 8), g);
        unpack8(load16(row + inter + c * 8), u);
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = round_bf16(Act::apply(g[j])) * u[j];
        store16(out + t * inter + c * 8, pack8(o));
    }
}

extern "C" __global__ void __launch_bounds__(256)
silu_mul(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ gate_up, u32 tokens,
         u32 inter) {
    gated<Silu>(out, gate_up, tokens, inter);
}

extern "C" __global__ void __launch_bounds__(256)
gelu_tanh_mul(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ gate_up,
              u32 tokens, u32 inter) {
    gated<GeluTanh>(out, gate_up, tokens, inter);
}

// x[i] = bf16(x[i] * scale) for i < 8 * chunks (Gemma 3's embedding scale, an f32).
extern "C" __global__ void __launch_bounds__(256)
scale_bf16(__nv_bfloat16* __restrict__ x, u64 chunks, float scale) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < chunks;
         i += (u64)gridDim.x * blockDim.x) {
        float v[8];
        unpack8(load16(x + i * 8), v);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(v[j], scale);
        store16(x + i * 8, pack8(v));
    }
}

// A KV block's parts between one contiguous staging buffer and the per-layer caches it lives in:
// part p (blockIdx.y) is `vecs` 16-byte vectors at staging + p * vecs and at bases[p] + offset.
// One launch moves a whole block, where one copy per part would pay the driver's per-call cost
// 2 x layers times (docs/DECISIONS.md, "Host-tier restores are bound by per-layer copies").
extern "C" __global__ void __launch_bounds__(256)
kv_scatter(const uint4* __restrict__ staging, const u64* __restrict__ bases, u64 offset, u64 vecs) {
    const u64 part = blockIdx.y;
    uint4* dst = reinterpret_cast<uint4*>(bases[part] + offset);
    const uint4* src = staging + part * vecs;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < vecs;
         i += (u64)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}

extern "C" __global__ void __launch_bounds__(256)
kv_gather(uint4* __restrict__ staging, const u64* __restrict__ bases, u64 offset, u64 vecs) {
    const u64 part = blockIdx.y;
    const uint4* src = reinterpret_cast<const uint4*>(bases[part] + offset);
    uint4* dst = staging + part * vecs;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < vecs;
         i += (u64)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}
