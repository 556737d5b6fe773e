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

// A token's k choices, largest first, finished: divided by their sum (added largest first) when
// `normalize`, then put in ascending expert order (insertion sort of at most 32).
__device__ __forceinline__ void finish_route(int* chosen, float* prob, u32 k, u32 normalize) {
    if (normalize) {
        float total = 0.0f;
        for (u32 j = 0; j < k; ++j) total += prob[j];
        for (u32 j = 0; j < k; ++j) prob[j] = __fdiv_rn(prob[j], total);
    }
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
    finish_route(chosen, prob, k, normalize);
}

// Each token's k experts and weights, by ascending expert: the softmax of its logits (less the
// maximum, summed in expert order), the k largest probabilities (ties to the lower expert), their
// sum taken from the largest and divided out when `normalize`: moe_route's results, one warp per
// token (ROUTE_WARPS a block) instead of one thread. Lane l computes the probabilities of experts
// l, l + 32, ...; one lane sums them in expert order; each choice is a warp-wide arg-max. Exactly
// the serial rule's results, NaN rows included: a NaN probability ranks as -1 (below every
// number), so a row of NaNs still names the first k experts, each with weight -1 / sum. k <= 32,
// experts <= 1024.
#define ROUTE_WARPS 4
extern "C" __global__ void __launch_bounds__(ROUTE_WARPS * 32)
moe_route_warp(int* __restrict__ ids, float* __restrict__ weights,
               const float* __restrict__ logits, u32 tokens, u32 experts, u32 k, u32 normalize) {
    __shared__ float prob_of[ROUTE_WARPS][1024];
    __shared__ int chosen[ROUTE_WARPS][32];
    __shared__ float picked[ROUTE_WARPS][32];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 t = blockIdx.x * ROUTE_WARPS + warp;
    if (t >= tokens) return;  // uniform across the warp
    const float* row = logits + (u64)t * experts;
    // fmaxf ignores NaN and is exact, so any order gives the serial maximum (-inf for all NaN).
    float max = __int_as_float(0xff800000u);
    for (u32 e = lane; e < experts; e += 32) max = fmaxf(max, row[e]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, off));
    float* p = prob_of[warp];
    for (u32 e = lane; e < experts; e += 32) p[e] = expf(row[e] - max);
    __syncwarp();
    float sum = 0.0f;
    if (lane == 0)
        for (u32 e = 0; e < experts; ++e) sum += p[e];
    sum = __shfl_sync(0xffffffffu, sum, 0);
    u32 taken = 0;  // bit j: expert lane + 32 j chosen
    for (u32 j = 0; j < k; ++j) {
        float top = __int_as_float(0xff800000u);  // no candidate
        int best = 0x7fffffff;
        for (u32 e = lane, b = 0; e < experts; e += 32, ++b) {
            if (taken >> b & 1u) continue;
            const float v = p[e];
            const float key = v == v ? v : -1.0f;
            if (key > top) {  // ascending e: ties stay with the lower expert
                top = key;
                best = (int)e;
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float ot = __shfl_xor_sync(0xffffffffu, top, off);
            const int ob = __shfl_xor_sync(0xffffffffu, best, off);
            if (ot > top || (ot == top && ob < best)) {
                top = ot;
                best = ob;
            }
        }
        if ((u32)best % 32 == lane) taken |= 1u << ((u32)best / 32);
        if (lane == 0) {
            chosen[warp][j] = best;
            picked[warp][j] = __fdiv_rn(top, sum);
        }
    }
    __syncwarp();
    if (lane != 0) return;
    int* c = chosen[warp];
    float* w = picked[warp];
    finish_route(c, w, k, normalize);
    for (u32 j = 0; j < k; ++j) {
        ids[(u64)t * k + j] = c[j];
        weights[(u64)t * k + j] = w[j];
    }
}

// A step's slots grouped by expert, so each chosen expert's weights are read once however many
// tokens chose it: group g (< the number of experts chosen) is expert group_expert[g], its slots
// order[group_start[g] .. group_start[g + 1]); groups past the last hold expert -1 and no slots.
// One block of 1024 threads (experts <= 1024). Within a group the slots' order varies from run to
// run (atomics); no result depends on it (each slot's outputs are its own warp's fixed-order sums).
extern "C" __global__ void __launch_bounds__(1024)
moe_sort(int* __restrict__ order, int* __restrict__ group_expert, int* __restrict__ group_start,
         const int* __restrict__ ids, u32 slots, u32 experts, u32 groups) {
    __shared__ int count[1024];
    __shared__ int cursor[1024];
    __shared__ int warp_slots[32];
    __shared__ int warp_groups[32];
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    count[tid] = 0;
    __syncthreads();
    for (u32 s = tid; s < slots; s += 1024) {
        const int e = ids[s];
        if ((u32)e < experts) atomicAdd(&count[e], 1);
    }
    __syncthreads();
    const int c = tid < experts ? count[tid] : 0;
    const int used = c > 0;
    int at = c, g = used;  // inclusive scans within the warp
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int a = __shfl_up_sync(0xffffffffu, at, off);
        const int b = __shfl_up_sync(0xffffffffu, g, off);
        if ((int)lane >= off) {
            at += a;
            g += b;
        }
    }
    if (lane == 31) {
        warp_slots[warp] = at;
        warp_groups[warp] = g;
    }
    __syncthreads();
    if (warp == 0) {  // exclusive scans of the 32 warp totals
        const int a0 = warp_slots[lane], b0 = warp_groups[lane];
        int a = a0, b = b0;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int x = __shfl_up_sync(0xffffffffu, a, off);
            const int y = __shfl_up_sync(0xffffffffu, b, off);
            if ((int)lane >= off) {
                a += x;
                b += y;
            }
        }
        warp_slots[lane] = a - a0;
        warp_groups[lane] = b - b0;
    }
    __syncthreads();
    const int first = at - c + warp_slots[warp];
    const int group = g - used + warp_groups[warp];
    cursor[tid] = first;
    if (used && (u32)group < groups) {
        group_expert[group] = (int)tid;
        group_start[group] = first;
    }
    // The last thread's inclusive count is the number of groups.
    if (tid == 1023) {
        for (u32 rest = (u32)(group + used); rest < groups; ++rest) {
            group_expert[rest] = -1;
            group_start[rest] = (int)slots;
        }
        group_start[groups] = (int)slots;
    }
    __syncthreads();
    for (u32 s = tid; s < slots; s += 1024) {
        const int e = ids[s];
        if ((u32)e < experts) order[atomicAdd(&cursor[e], 1)] = (int)s;
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

// Up to SLOT_BATCH slots of one expert share each weight load of a grouped launch.
#define SLOT_BATCH 4

// moe_gate_up over grouped slots (moe_sort): one warp per (group, i) reads the expert's gate and
// up rows once for all the group's slots, SLOT_BATCH at a time; each slot's sums run in
// warp_dot's order, so every activation has the bits moe_gate_up gives it.
extern "C" __global__ void __launch_bounds__(256)
moe_gate_up_grouped(__nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ x,
                    const __nv_bfloat16* __restrict__ w, const int* __restrict__ order,
                    const int* __restrict__ group_expert, const int* __restrict__ group_start,
                    u32 groups, u32 per_token, u32 inter, u32 hidden) {
    const u64 item = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (item >= (u64)groups * inter) return;  // uniform across the warp
    const u32 g = (u32)(item / inter), i = (u32)(item % inter), lane = threadIdx.x & 31;
    const int e = group_expert[g];
    if (e < 0) return;
    const int end = group_start[g + 1];
    const __nv_bfloat16* wg = w + ((u64)e * 2 * inter + i) * hidden;
    const __nv_bfloat16* wu = wg + (u64)inter * hidden;
    for (int s0 = group_start[g]; s0 < end; s0 += SLOT_BATCH) {
        const int n = min(SLOT_BATCH, end - s0);
        int slot[SLOT_BATCH];
        const __nv_bfloat16* xr[SLOT_BATCH];
        float ag[SLOT_BATCH], au[SLOT_BATCH];
#pragma unroll
        for (int b = 0; b < SLOT_BATCH; ++b) {
            slot[b] = order[s0 + min(b, n - 1)];
            xr[b] = x + (u64)(slot[b] / per_token) * hidden;
            ag[b] = 0.0f;
            au[b] = 0.0f;
        }
#pragma unroll 2
        for (u32 c = lane; c < hidden / 8; c += 32) {
            float yg[8], yu[8];
            unpack8(load_stream(wg + (u64)c * 8), yg);
            unpack8(load_stream(wu + (u64)c * 8), yu);
#pragma unroll
            for (int b = 0; b < SLOT_BATCH; ++b) {
                if (b >= n) break;
                float v[8];
                unpack8(load16(xr[b] + (u64)c * 8), v);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    ag[b] = fmaf(v[j], yg[j], ag[b]);
                    au[b] = fmaf(v[j], yu[j], au[b]);
                }
            }
        }
#pragma unroll
        for (int b = 0; b < SLOT_BATCH; ++b) {
            if (b >= n) break;
            const float gv = round_bf16(warp_sum(ag[b]));
            const float uv = round_bf16(warp_sum(au[b]));
            if (lane == 0) {
                const float a = round_bf16(__fdiv_rn(gv, 1.0f + expf(-gv)));
                act[(u64)slot[b] * inter + i] = f32_to_bf16(a * uv);
            }
        }
    }
}

// moe_down over grouped slots: one warp per (group, n) reads the expert's row n once for the
// group's slots; each output has the bits moe_down gives it.
extern "C" __global__ void __launch_bounds__(256)
moe_down_grouped(float* __restrict__ out, const __nv_bfloat16* __restrict__ act,
                 const __nv_bfloat16* __restrict__ w, const int* __restrict__ order,
                 const int* __restrict__ group_expert, const int* __restrict__ group_start,
                 const float* __restrict__ weights, u32 groups, u32 hidden, u32 inter) {
    const u64 item = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (item >= (u64)groups * hidden) return;
    const u32 g = (u32)(item / hidden), n = (u32)(item % hidden), lane = threadIdx.x & 31;
    const int e = group_expert[g];
    if (e < 0) return;
    const int end = group_start[g + 1];
    const __nv_bfloat16* wr = w + ((u64)e * hidden + n) * inter;
    for (int s0 = group_start[g]; s0 < end; s0 += SLOT_BATCH) {
        const int m = min(SLOT_BATCH, end - s0);
        int slot[SLOT_BATCH];
        float acc[SLOT_BATCH];
#pragma unroll
        for (int b = 0; b < SLOT_BATCH; ++b) {
            slot[b] = order[s0 + min(b, m - 1)];
            acc[b] = 0.0f;
        }
#pragma unroll 2
        for (u32 c = lane; c < inter / 8; c += 32) {
            float y[8];
            unpack8(load_stream(wr + (u64)c * 8), y);
#pragma unroll
            for (int b = 0; b < SLOT_BATCH; ++b) {
                if (b >= m) break;
                float v[8];
                unpack8(load16(act + (u64)slot[b] * inter + (u64)c * 8), v);
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[b] = fmaf(v[j], y[j], acc[b]);
            }
        }
#pragma unroll
        for (int b = 0; b < SLOT_BATCH; ++b) {
            if (b >= m) break;
            const float y = round_bf16(warp_sum(acc[b]));
            if (lane == 0) {
                const u64 o = (u64)slot[b] * hidden + n;
                out[o] = weights ? __fmul_rn(y, weights[slot[b]]) : y;
            }
        }
    }
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
