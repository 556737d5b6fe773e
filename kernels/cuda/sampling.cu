// On-device greedy sampling: the argmax of each row of f32 logits, in the CPU sampler's order.
#include "common.cuh"

constexpr int ARGMAX_THREADS = 1024;
constexpr u32 NO_TOKEN = 0xffffffffu;

#define STRATA_POS_INF __int_as_float(0x7f800000)
#define STRATA_NEG_INF __int_as_float(0xff800000)
#define STRATA_FLT_MAX __int_as_float(0x7f7fffff)

// The sampler's sanitizing (strata_model::sampler): NaN ranks as -inf, +inf as FLT_MAX.
__device__ __forceinline__ float sanitize(float v) {
    if (isnan(v)) return STRATA_NEG_INF;
    return v == STRATA_POS_INF ? STRATA_FLT_MAX : v;
}

// The total order argmax follows: only finite sanitized values compete, a larger value wins,
// equal values go to the lower index. Because it is a total order, the result does not depend on
// how the row is split.
__device__ __forceinline__ bool beats(float v, u32 i, float best, u32 best_i) {
    if (v == STRATA_NEG_INF) return false;
    if (best_i == NO_TOKEN) return true;
    return v > best || (v == best && i < best_i);
}

__device__ __forceinline__ void consider(float raw, u32 i, float& best, u32& best_i) {
    const float v = sanitize(raw);
    if (beats(v, i, best, best_i)) {
        best = v;
        best_i = i;
    }
}

// out[m] = argmax over logits[m * stride + 0..vocab) (one block per row). A row with no finite
// value after sanitizing gives 0xffffffff.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_f32(u32* __restrict__ out, const float* __restrict__ logits, u32 vocab, u32 stride) {
    __shared__ float best_v[ARGMAX_THREADS / 32];
    __shared__ u32 best_ix[ARGMAX_THREADS / 32];
    const float* row = logits + (u64)blockIdx.x * stride;
    float best = 0.0f;
    u32 best_i = NO_TOKEN;
    u32 start = 0;
    if ((reinterpret_cast<u64>(row) & 15) == 0) {
        const u32 quads = vocab / 4;
        const float4* row4 = reinterpret_cast<const float4*>(row);
        for (u32 q = threadIdx.x; q < quads; q += ARGMAX_THREADS) {
            const float4 v = row4[q];
            consider(v.x, q * 4 + 0, best, best_i);
            consider(v.y, q * 4 + 1, best, best_i);
            consider(v.z, q * 4 + 2, best, best_i);
            consider(v.w, q * 4 + 3, best, best_i);
        }
        start = quads * 4;
    }
    for (u32 i = start + threadIdx.x; i < vocab; i += ARGMAX_THREADS) consider(row[i], i, best, best_i);

#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, best, offset);
        const u32 i = __shfl_xor_sync(0xffffffffu, best_i, offset);
        if (i != NO_TOKEN) consider(v, i, best, best_i);
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) {
        best_v[warp] = best;
        best_ix[warp] = best_i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < ARGMAX_THREADS / 32; ++w) {
            if (best_ix[w] != NO_TOKEN) consider(best_v[w], best_ix[w], best, best_i);
        }
        out[blockIdx.x] = best_i;
    }
}

// ---------------------------------------------------------------------------------------------
// Seeded sampling on the device: the row pass of strata_model::sampler::row, bit for bit.
//
// `sample_shape` applies a row plan's grammar bitmask and sparse shaping (masks, logit bias,
// repetition penalty, presence/frequency amounts) in place; `sample_rows` then reads each shaped row once per need and
// writes its summary: the top logit, the count of finite tokens, the greedy or id-order choice,
// the fixed-point weight totals and a rank prefix of candidates. Everything that must agree with
// the host is IEEE-exact (`__d*_rn` / `__f*_rn`, never contracted into an FMA) or an integer.

constexpr int SAMPLE_THREADS = 1024;
constexpr int SAMPLE_WARPS = SAMPLE_THREADS / 32;
constexpr u32 SAMPLE_NO_FINITE = 1;

// One shaping entry; `op` is the phase: 0 mask (-inf), 1 add bias, 2 repetition penalty,
// 3 subtract (presence/frequency amount). Phases run in that order.
struct ShapeEntry {
    u32 token;
    u32 op;
    float value;
};

// Per row: the draw parameters (strata_model::sampler::row::DrawParams) and the logits row.
struct SamplePlan {
    double inv_t;     // 0: greedy
    double min_p_ln;  // -inf: off
    u64 random;
    u64 top_p;        // fixed point, 2^32 = off
    u32 top_k;        // 0: off
    u32 logprobs;     // 0xffffffff: none
    u32 row;          // logits row
    u32 pad;
};

struct SampleHead {
    u64 total;
    u64 total_unit;
    float max;
    u32 finite;
    u32 chosen;
    float chosen_logit;
    u32 count;   // candidates found (more than the list holds means it overflowed)
    u32 status;  // 0 ok, SAMPLE_NO_FINITE
};

struct SampleCandidate {
    u32 id;
    float logit;
};

// Per row b, `rows[4 b ..]` = {logits row, first entry, end entry, bitmask offset}: the row's
// grammar bitmask (bit i % 32 of word i / 32 allows token i; offset 0xffffffff = none) sits at
// `words[offset]`, its entries at `words[3 * first ..]` as ShapeEntry. The bitmask goes first,
// then the entries phase by phase.
extern "C" __global__ void __launch_bounds__(256)
sample_shape(float* __restrict__ logits, u32 stride, u32 vocab, const u32* __restrict__ rows,
             const u32* __restrict__ words) {
    const u32* r = rows + 4 * blockIdx.x;
    float* row = logits + (u64)r[0] * stride;
    const u32 lo = r[1], hi = r[2], bits_at = r[3];
    if (bits_at != 0xffffffffu) {
        const u32* bits = words + bits_at;
        for (u32 i = threadIdx.x; i < vocab; i += blockDim.x) {
            if (((bits[i >> 5] >> (i & 31)) & 1u) == 0) row[i] = STRATA_NEG_INF;
        }
    }
    __syncthreads();
    const ShapeEntry* entries = reinterpret_cast<const ShapeEntry*>(words);
    for (u32 op = 0; op < 4; ++op) {
        for (u32 e = lo + threadIdx.x; e < hi; e += blockDim.x) {
            const ShapeEntry s = entries[e];
            if (s.op != op) continue;
            float* l = row + s.token;
            if (op == 0) {
                *l = STRATA_NEG_INF;
            } else if (op == 1) {
                *l = __fadd_rn(*l, s.value);
            } else if (op == 2) {
                *l = *l > 0.0f ? __fdiv_rn(*l, s.value) : __fmul_rn(*l, s.value);
            } else {
                *l = __fsub_rn(*l, s.value);
            }
        }
        __syncthreads();
    }
}

// strata_model::sampler::row::portable_exp: e^x for x <= 0 from IEEE operations in a fixed order.
__device__ __forceinline__ double portable_exp(double x) {
    if (!(x > -40.0)) return 0.0;
    const double k = rint(__dmul_rn(x, 0x1.71547652b82fep+0));
    const double r = __dsub_rn(__dsub_rn(x, __dmul_rn(k, 0x1.62e42fee00000p-1)),
                               __dmul_rn(k, 0x1.a39ef35793c76p-33));
    double p = 0x1.6124613a86d09p-33;
    p = __dadd_rn(__dmul_rn(p, r), 0x1.1eed8eff8d898p-29);
    p = __dadd_rn(__dmul_rn(p, r), 0x1.ae64567f544e4p-26);
    p = __dadd_rn(__dmul_rn(p, r), 0x1.27e4fb7789f5cp-22);
    p = __dadd_rn(__dmul_rn(p, r), 0x1.71de3a556c734p-19);
    p = __dadd_rn(__dmul_rn(p, r), 0x1.a01a01a01a01ap-16);
    p = __dadd_rn(__dmul_rn(p, r), 0x1.a01a01a01a01ap-13);
    p = __dadd_rn(__dmul_rn(p, r), 0x1.6c16c16c16c17p-10);
    p = __dadd_rn(__dmul_rn(p, r), 0x1.1111111111111p-7);
    p = __dadd_rn(__dmul_rn(p, r), 0x1.5555555555555p-5);
    p = __dadd_rn(__dmul_rn(p, r), 0x1.5555555555555p-3);
    p = __dadd_rn(__dmul_rn(p, r), 0x1.0000000000000p-1);
    p = __dadd_rn(__dmul_rn(p, r), 1.0);
    p = __dadd_rn(__dmul_rn(p, r), 1.0);
    return __dmul_rn(p, __longlong_as_double((long long)(1023 + (int)k) << 52));
}

// Fixed-point weight of a log-weight: floor(e^lw * 2^40).
__device__ __forceinline__ u64 fixed_weight(double lw) {
    return (u64)__dmul_rn(portable_exp(lw), 1099511627776.0);
}

__device__ __forceinline__ double log_weight(float l, float max, double inv_t) {
    return __dmul_rn(__dsub_rn((double)l, (double)max), inv_t);
}

// strata_model::sampler::row::order_key.
__device__ __forceinline__ u32 order_key(float l) {
    const u32 bits = __float_as_uint(l);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The sampler's sanitizing for ranking: as `sanitize`, and -0 as +0 so equal logits have one key.
__device__ __forceinline__ float sample_sanitize(float v) {
    const float s = sanitize(v);
    return s == 0.0f ? 0.0f : s;
}

// Block reductions over SAMPLE_THREADS threads; every thread gets the result. `scratch` holds
// SAMPLE_WARPS entries and is reused, so each call synchronizes before and after.
__device__ float block_max_f32(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    v = scratch[0];
    for (int w = 1; w < SAMPLE_WARPS; ++w) v = fmaxf(v, scratch[w]);
    return v;
}

__device__ u64 block_sum_u64(u64 v, u64* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    v = 0;
    for (int w = 0; w < SAMPLE_WARPS; ++w) v += scratch[w];
    return v;
}

__device__ u32 block_min_u32(u32 v, u64* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    u64 m = scratch[0];
    for (int w = 1; w < SAMPLE_WARPS; ++w) m = min(m, scratch[w]);
    return (u32)m;
}

// Exclusive prefix sum of one u64 per thread, in thread order; `total` gets the sum.
__device__ u64 block_scan_u64(u64 v, u64* scratch, u64& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 inclusive = v;
    for (int o = 1; o < 32; o <<= 1) {
        const u64 n = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += n;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = inclusive;
    __syncthreads();
    u64 before = 0;
    total = 0;
    for (int w = 0; w < SAMPLE_WARPS; ++w) {
        if (w < warp) before += scratch[w];
        total += scratch[w];
    }
    return before + inclusive - v;
}

// One block per row: the summary strata_model::sampler::row::RowSummary::of computes. `lists`
// holds `cap` candidates per row; `heads[b].count` may exceed `cap` (the host then reads the row).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_rows(SampleHead* __restrict__ heads, SampleCandidate* __restrict__ lists, u32 cap,
            const float* __restrict__ logits, u32 vocab, u32 stride,
            const SamplePlan* __restrict__ plans) {
    __shared__ float fscratch[SAMPLE_WARPS];
    __shared__ u64 scratch[SAMPLE_WARPS];
    __shared__ u32 hist[256];
    __shared__ u32 found;
    __shared__ u32 chosen_id;
    const SamplePlan plan = plans[blockIdx.x];
    const float* row = logits + (u64)plan.row * stride;
    SampleHead* head = heads + blockIdx.x;
    SampleCandidate* list = lists + (u64)blockIdx.x * cap;
    const u32 tid = threadIdx.x;

    float top = STRATA_NEG_INF;
    u64 finite = 0;
    for (u32 i = tid; i < vocab; i += SAMPLE_THREADS) {
        const float l = sample_sanitize(row[i]);
        if (l != STRATA_NEG_INF) {
            finite += 1;
            top = fmaxf(top, l);
        }
    }
    top = block_max_f32(top, fscratch);
    const u32 n = (u32)block_sum_u64(finite, scratch);
    if (n == 0) {
        if (tid == 0) {
            *head = SampleHead{0, 0, top, 0, NO_TOKEN, 0.0f, 0, SAMPLE_NO_FINITE};
        }
        return;
    }
    const bool greedy = plan.inv_t == 0.0;
    const bool topk = !greedy && plan.top_k > 0 && plan.top_k < n;
    const bool nucleus = !greedy && !topk && plan.top_p < (1ull << 32);
    const bool direct = !greedy && !topk && !nucleus;
    const bool unit = plan.logprobs != 0xffffffffu;

    u32 chosen = NO_TOKEN;
    float chosen_logit = 0.0f;
    u64 total = 0, total_unit = 0;
    if (greedy) {
        u32 first = NO_TOKEN;
        for (u32 i = tid; i < vocab; i += SAMPLE_THREADS) {
            if (sample_sanitize(row[i]) == top) {
                first = i;
                break;
            }
        }
        chosen = block_min_u32(first, scratch);
        chosen_logit = top;
    }
    if (direct) {
        // Contiguous segments in thread order, so an exclusive scan finds the segment the draw
        // lands in; integer sums make the grouping irrelevant.
        const u32 seg = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
        const u32 lo = min(vocab, tid * seg), hi = min(vocab, lo + seg);
        u64 mine = 0;
        for (u32 i = lo; i < hi; ++i) {
            const float l = sample_sanitize(row[i]);
            if (l == STRATA_NEG_INF) continue;
            const double lw = log_weight(l, top, plan.inv_t);
            if (lw >= plan.min_p_ln) mine += fixed_weight(lw);
        }
        const u64 before = block_scan_u64(mine, scratch, total);
        const u64 target = __umul64hi(plan.random, total);
        if (tid == 0) chosen_id = NO_TOKEN;
        __syncthreads();
        if (before <= target && target < before + mine) {
            u64 mass = before;
            for (u32 i = lo; i < hi; ++i) {
                const float l = sample_sanitize(row[i]);
                if (l == STRATA_NEG_INF) continue;
                const double lw = log_weight(l, top, plan.inv_t);
                if (lw >= plan.min_p_ln) mass += fixed_weight(lw);
                if (mass > target) {
                    chosen_id = i;
                    break;
                }
            }
        }
        __syncthreads();
        chosen = chosen_id;
        if (chosen != NO_TOKEN) chosen_logit = sample_sanitize(row[chosen]);
    }
    if (nucleus || unit) {
        u64 t = 0, u = 0;
        for (u32 i = tid; i < vocab; i += SAMPLE_THREADS) {
            const float l = sample_sanitize(row[i]);
            if (l == STRATA_NEG_INF) continue;
            if (nucleus) t += fixed_weight(log_weight(l, top, plan.inv_t));
            if (unit) u += fixed_weight(__dsub_rn((double)l, (double)top));
        }
        if (nucleus) total = block_sum_u64(t, scratch);
        if (unit) total_unit = block_sum_u64(u, scratch);
    }

    // The prefix: every finite token at or above the k-th largest key, and under top-p every
    // token heavier than the nucleus floor.
    u32 k = topk ? plan.top_k : 0;
    if (unit) k = max(k, plan.logprobs);
    k = min(k, n);
    u32 threshold = 0xffffffffu;
    if (k > 0) {
        u32 prefix = 0, mask = 0, remaining = k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (u32 d = tid; d < 256; d += SAMPLE_THREADS) hist[d] = 0;
            __syncthreads();
            for (u32 i = tid; i < vocab; i += SAMPLE_THREADS) {
                const float l = sample_sanitize(row[i]);
                if (l == STRATA_NEG_INF) continue;
                const u32 key = order_key(l);
                if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (tid == 0) {
                u32 above = 0;
                for (int d = 255; d >= 0; --d) {
                    if (above + hist[d] >= remaining) {
                        prefix |= (u32)d << shift;
                        remaining -= above;
                        break;
                    }
                    above += hist[d];
                }
                found = prefix;
            }
            __syncthreads();
            prefix = found;
            mask |= 255u << shift;
            __syncthreads();
        }
        threshold = prefix;
    }
    u64 floor = 0xffffffffffffffffull;
    if (nucleus) {
        const u64 a = (1ull << 32) - plan.top_p;
        const u64 hi = __umul64hi(a, total), lo = a * total;
        floor = ((hi << 31) | (lo >> 33)) / (u64)n;
    }
    if (tid == 0) found = 0;
    __syncthreads();
    for (u32 i = tid; i < vocab; i += SAMPLE_THREADS) {
        const float l = sample_sanitize(row[i]);
        if (l == STRATA_NEG_INF) continue;
        bool take = k > 0 && order_key(l) >= threshold;
        if (!take && nucleus) take = fixed_weight(log_weight(l, top, plan.inv_t)) > floor;
        if (take) {
            const u32 at = atomicAdd(&found, 1u);
            if (at < cap) list[at] = SampleCandidate{i, l};
        }
    }
    __syncthreads();
    if (tid == 0) {
        *head = SampleHead{total, total_unit, top, n, chosen, chosen_logit, found, 0};
    }
}
