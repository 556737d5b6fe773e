// A mixture of experts' decode and prompt rows (Qwen2-MoE, Qwen3-MoE, Mixtral): the router's
// logits, each token's top-k experts, the chosen experts' gated MLPs gathered by expert id from
// stacked weights, and the per-token sum in ascending expert order. Every output row depends on
// its own token alone (one warp per output element, a reduction order fixed by the row length),
// so a token's result is the same bits whichever tokens share the step, and prompt rows equal
// decode rows. Launches read only device memory: a step can be captured into a graph.
#include "common.cuh"

// The dot product of two bf16 rows of `len` values (len % 8 == 0) in f32: lane l takes the
// 16-byte chunks l, l + 32, ... in order, then the warp's fixed butterfly. Every lane returns it.
__device__ __forceinline__ float warp_dot(const __nv_bfloat16* __restrict__ a,
                                          const __nv_bfloat16* __restrict__ w, u32 len) {
    const u32 lane = threadIdx.x & 31;
    float acc = 0.0f;
    for (u32 c = lane; c < len / 8; c += 32) {
        float x[8], y[8];
        unpack8(load16(a + (u64)c * 8), x);
        unpack8(load_stream(w + (u64)c * 8), y);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc = fmaf(x[j], y[j], acc);
    }
    return warp_sum(acc);
}

// logits[t, e] = x[t] · w[e] in f32, one warp per (t, e): the router's scores (or Qwen2-MoE's
// shared-expert gate with experts = 1). x [tokens, hidden], w [experts, hidden].
extern "C" __global__ void __launch_bounds__(256)
moe_logits(float* __restrict__ logits, const __nv_bfloat16* __restrict__ x,
           const __nv_bfloat16* __restrict__ w, u32 tokens, u32 experts, u32 hidden) {
    const u64 item = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (item >= (u64)tokens * experts) return;  // uniform across the warp
    const u64 t = item / experts, e = item % experts;
    const float v = warp_dot(x + t * hidden, w + e * hidden, hidden);
    if ((threadIdx.x & 31) == 0) logits[item] = v;
}

// Each token's k experts and weights, by ascending expert: the softmax of its logits (less the
// maximum, summed in expert order), the k largest probabilities (ties to the lower expert), their
// sum taken from the largest and divided out when `normalize`. One thread per token; k <= 32.
extern "C" __global__ void __launch_bounds__(128)
moe_route(int* __restrict__ ids, float* __restrict__ weights, const float* __restrict__ logits,
          u32 tokens, u32 experts, u32 k, u32 normalize) {
    const u32 t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    const float* row = logits + (u64)t * experts;
    float max = __int_as_float(0xff800000u);  // -inf
    for (u32 e = 0; e < experts; ++e) max = fmaxf(max, row[e]);
    float sum = 0.0f;
    for (u32 e = 0; e < experts; ++e) sum += expf(row[e] - max);
    // The choices are kept in the outputs themselves (no local arrays: no stack).
    int* chosen = ids + (u64)t * k;
    float* prob = weights + (u64)t * k;
    for (u32 j = 0; j < k; ++j) {
        int best = -1;
        float top = -1.0f;
        for (u32 e = 0; e < experts; ++e) {
            const float p = expf(row[e] - max);
            if (!(p > top) && best >= 0) continue;
            bool taken = false;
            for (u32 i = 0; i < j; ++i) taken |= chosen[i] == (int)e;
            // The first expert not taken stands in until a larger one is found, so a row of
            // NaNs (a padding row's leftovers) still names k distinct experts in range.
            if (!taken && (p > top || best < 0)) {
                top = p > top ? p : top;
                best = (int)e;
            }
        }
        chosen[j] = best;
        prob[j] = __fdiv_rn(top, sum);
    }
    if (normalize) {
        float total = 0.0f;
        for (u32 j = 0; j < k; ++j) total += prob[j];
        for (u32 j = 0; j < k; ++j) prob[j] = __fdiv_rn(prob[j], total);
    }
    // Ascending expert order (insertion sort of at most 32).
    for (u32 j = 1; j < k; ++j) {
        const int e = chosen[j];
        const float p = prob[j];
        int i = (int)j - 1;
        while (i >= 0 && chosen[i] > e) {
            chosen[i + 1] = chosen[i];
            prob[i + 1] = prob[i];
            --i;
        }
        chosen[i + 1] = e;
        prob[i + 1] = p;
    }
}

// act[s, i] = bf16(bf16(silu(bf16(gate))) * bf16(up)) for slot s (token s / per_token, expert
// ids[s], or expert 0 when ids is null), gate = x · w[e][i], up = x · w[e][inter + i]: the dense
// path's rounding (the GEMV stores gate and up in bf16, silu_mul rounds the activation). One warp
// per (s, i). w [experts][2 * inter][hidden].
extern "C" __global__ void __launch_bounds__(256)
moe_gate_up(__nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
            const __nv_bfloat16* __restrict__ w, const int* __restrict__ ids, u32 slots,
            u32 per_token, u32 inter, u32 hidden) {
    const u64 item = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (item >= (u64)slots * inter) return;
    const u64 s = item / inter, i = item % inter;
    const u64 e = ids ? (u64)ids[s] : 0;
    const __nv_bfloat16* xr = x + (s / per_token) * hidden;
    const __nv_bfloat16* we = w + e * 2 * inter * hidden;
    const float g = round_bf16(warp_dot(xr, we + i * hidden, hidden));
    const float u = round_bf16(warp_dot(xr, we + (inter + i) * hidden, hidden));
    if ((threadIdx.x & 31) == 0) {
        const float a = round_bf16(__fdiv_rn(g, 1.0f + expf(-g)));
        act[item] = f32_to_bf16(a * u);
    }
}

// out[s, n] = bf16(act[s] · w[e][n]) * weights[s] (1 when weights is null), f32: slot s's
// expert output scaled by its routing weight. One warp per (s, n). w [experts][hidden][inter].
extern "C" __global__ void __launch_bounds__(256)
moe_down(float* __restrict__ out, const __nv_bfloat16* __restrict__ act,
         const __nv_bfloat16* __restrict__ w, const int* __restrict__ ids,
         const float* __restrict__ weights, u32 slots, u32 hidden, u32 inter) {
    const u64 item = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (item >= (u64)slots * hidden) return;
    const u64 s = item / hidden, n = item % hidden;
    const u64 e = ids ? (u64)ids[s] : 0;
    const float y = round_bf16(warp_dot(act + s * inter, w + (e * hidden + n) * inter, inter));
    if ((threadIdx.x & 31) == 0) out[item] = weights ? __fmul_rn(y, weights[s]) : y;
}

// out[t, n] = bf16(((0 + slots[t, 0, n]) + ... + slots[t, k-1, n]) + sigmoid(gate[t]) *
// shared[t, n]), the shared term only when `shared` is given: the experts' outputs summed in
// ascending expert order from zero, then Qwen2-MoE's gated shared expert. No contraction.
extern "C" __global__ void __launch_bounds__(256)
moe_combine(__nv_bfloat16* __restrict__ out, const float* __restrict__ slots,
            const float* __restrict__ shared, const float* __restrict__ gate, u32 tokens, u32 k,
            u32 hidden) {
    const u64 total = (u64)tokens * hidden;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        const u64 t = i / hidden, n = i % hidden;
        float acc = 0.0f;
        for (u32 j = 0; j < k; ++j) acc = __fadd_rn(acc, slots[(t * k + j) * hidden + n]);
        if (shared) {
            const float scale = __fdiv_rn(1.0f, 1.0f + expf(-gate[t]));
            acc = __fadd_rn(acc, __fmul_rn(scale, shared[i]));
        }
        out[i] = f32_to_bf16(acc);
    }
}
