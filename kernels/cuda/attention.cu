// Paged attention over the bf16 KV cache: decode (split-KV, one query token per sequence) and
// prefill (one sequence's chunk of query tokens, causal), both with GQA and an optional sliding
// window.
//
// Cache layout per layer: k_cache, v_cache [num_blocks, block_size, n_kv, D]; position p of a
// sequence lives in block table[p / block_size] at offset p % block_size.
//
// One canonical computation per (query row, head), shared by both kernels through one body:
//   - keys are visited in tiles of TK = 8192 / D positions aligned at absolute multiples of TK,
//     grouped into splits of SPLIT = 128 positions aligned at absolute multiples of 128;
//   - score s = (sum over dims 0..D-1, one fma chain in dim order) * (scale * log2 e);
//   - per tile: m' = max(m, tile max); alpha = 2^(m - m'); p = 2^(s - m');
//     l = l * alpha, then + p key by key; acc = acc * alpha, then fma(p, v, acc) key by key;
//   - per split, in split order: (M, L, A) merged with (m, l, acc) by merge_factors/merge_value;
//   - out = A / L rounded to bf16.
// Every arithmetic step is an explicit intrinsic (__fmaf_rn, __fmul_rn, __fadd_rn, __fsub_rn,
// __fdiv_rn, fmaxf, ex2.approx: nothing the compiler could contract differently per kernel),
// masked keys are skipped rather than multiplied by zero, and no step depends on other rows, the
// grid, the batch or the chunking. So a row's output is bit-identical between decode and prefill
// and across prefill chunkings and batch compositions (on one GPU architecture and compiler).
// The thread mapping (NT, R) only decides which thread runs which chain, never the chain.
// TK and SPLIT are part of the numerics: changing either changes every result's rounding.
#include <cuda_bf16.h>

namespace attn {

constexpr int SPLIT = 128;  // keys per split: a constant, never derived from the batch or grid
constexpr float LOG2E = 1.4426950408889634f;

template <int D>
struct Shape {
    static constexpr int TK = 8192 / D;  // keys per tile: 16 KB of bf16 per K (or V) tile
    static constexpr int ROW = D + 8;    // smem row stride in bf16: 16-byte aligned, and an odd
                                         // number of 16-byte units so 16-byte row reads of 8
                                         // consecutive rows hit distinct banks
    static_assert(SPLIT % TK == 0, "tiles nest in splits");
    static_assert(TK >= 32, "softmax lanes cover a tile");
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000u); }

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float lo_bf16(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf16(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ unsigned int bf16x2_bits(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned int*>(&v);
}

// 16-byte global -> shared copy; `valid == false` writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all_but_one() {
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

// Merging a state (M, L, A) with a split's (m, l, acc): the one definition used by the prefill
// kernel's split loop and by the decode combine kernel.
struct MergeFactors {
    float old_scale;
    float new_scale;
};
__device__ __forceinline__ MergeFactors merge_factors(float& M, float m) {
    const float merged = fmaxf(M, m);
    MergeFactors f;
    f.old_scale = ex2(__fsub_rn(M, merged));  // 2^-inf = 0 for the first split
    f.new_scale = ex2(__fsub_rn(m, merged));
    M = merged;
    return f;
}
__device__ __forceinline__ float merge_value(float X, float x, MergeFactors f) {
    return __fadd_rn(__fmul_rn(X, f.old_scale), __fmul_rn(x, f.new_scale));
}

// What one block attends: R rows = (token i, head g) with r = i * gc + g, tokens at consecutive
// positions from pos0, heads head0 .. head0 + gc - 1 of one kv head.
struct BlockWork {
    const __nv_bfloat16* q;  // row (i, g) at q + i * q_tok_stride + (head0 + g) * D
    long long q_tok_stride;
    int head0;
    int gc;     // heads per token in this block (rows per token)
    int live_heads;  // heads that exist (<= gc; the last chunk of a large group may be short)
    int n_tok;  // live tokens
    int pos0;
    int window;
    int key_first;  // keys this block visits, inclusive (already cut to the split for decode)
    int key_last;
    const __nv_bfloat16* k_cache;
    const __nv_bfloat16* v_cache;
    const unsigned int* table;
    int block_size;
    unsigned int num_blocks;
    int n_kv;
    int kvh;
    float scale;
};

// Where the finished rows go: decode writes the split's partial state, prefill the output.
struct BlockOut {
    // decode: partial state of row (head g) at ml + g * ml_head_stride (m, l) and
    // acc + g * acc_head_stride (D floats)
    float* ml;
    float* acc;
    long long ml_head_stride;
    long long acc_head_stride;
    // prefill: row (i, g) at out + i * out_tok_stride + (head0 + g) * D
    __nv_bfloat16* out;
    long long out_tok_stride;
};

template <int D, int R, int NT, bool DECODE>
__device__ __forceinline__ void attend(const BlockWork& w, const BlockOut& o) {
    constexpr int TK = Shape<D>::TK;
    constexpr int ROW = Shape<D>::ROW;
    constexpr int CHUNKS = D / 8;            // 16-byte chunks per row
    constexpr int RG_S = NT / TK;            // score phase: row groups
    constexpr int RPS = R / RG_S;            // score phase: rows per thread
    constexpr int DP = D / 2;                // PV phase: dim pairs
    constexpr int RG_V = NT / DP;            // PV phase: row groups
    constexpr int RPT = R / RG_V;            // PV phase: rows per thread
    constexpr int WARPS = NT / 32;
    static_assert(NT % TK == 0 && R % RG_S == 0, "score mapping");
    static_assert(NT % DP == 0 && R % RG_V == 0, "PV mapping");
    static_assert(DP >= 32, "a warp shares its PV rows");

    // Dynamic shared memory, mirrored by `smem_bytes` in src/attention.rs:
    //   2*TK i64 row offsets | TK*ROW bf16 K | TK*ROW bf16 V | R*D f32 queries | R*TK f32 scores
    //   | prefill only: R*D f32 running output accumulators (each slot owned by one thread)
    extern __shared__ __align__(16) unsigned char smem[];
    long long* row_off = reinterpret_cast<long long*>(smem);                       // [2][TK]
    __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(smem + 2 * TK * 8);        // [TK][ROW]
    __nv_bfloat16* Vs = Ks + TK * ROW;                                              // [TK][ROW]
    float* qs = reinterpret_cast<float*>(Vs + TK * ROW);                            // [R][D]
    float* S = qs + R * D;                                                          // [R][TK]
    float* run_A = S + R * TK;                                                      // [R][D]
    __shared__ float m_run[R];
    // Prefill's running (M, L) per row, double-buffered by split parity: split k reads slot k & 1
    // and writes slot (k + 1) & 1, so no barrier is needed between readers and the writer.
    __shared__ float run_M[2][R];
    __shared__ float run_L[2][R];
    __shared__ float alpha[R];
    __shared__ int row_lo[R];
    __shared__ int row_hi[R];
    __shared__ int bad_table;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int qt = R / w.gc;

    // Rows: live ones get their key interval, dead ones an empty interval and zero queries.
    for (int r = tid; r < R; r += NT) {
        const int i = r / w.gc;
        const int g = r % w.gc;
        const bool live = i < qt && i < w.n_tok && g < w.live_heads;
        const int pos = w.pos0 + i;
        row_lo[r] = live ? (w.window > 0 ? max(0, pos - w.window + 1) : 0) : 1;
        row_hi[r] = live ? pos : 0;
        m_run[r] = neg_inf();
        run_M[0][r] = neg_inf();
        run_M[1][r] = neg_inf();
        run_L[0][r] = 0.f;
        run_L[1][r] = 0.f;
    }
    if (tid == 0) bad_table = 0;
    __syncthreads();  // bad_table is cleared before any thread may set it
    for (int c = tid; c < R * CHUNKS; c += NT) {
        const int r = c / CHUNKS;
        const int part = c % CHUNKS;
        const int i = r / w.gc;
        const int g = r % w.gc;
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (i < qt && i < w.n_tok && g < w.live_heads) {
            const uint4 raw = *reinterpret_cast<const uint4*>(
                w.q + i * w.q_tok_stride + (long long)(w.head0 + g) * D + part * 8);
            v[0] = lo_bf16(raw.x); v[1] = hi_bf16(raw.x);
            v[2] = lo_bf16(raw.y); v[3] = hi_bf16(raw.y);
            v[4] = lo_bf16(raw.z); v[5] = hi_bf16(raw.z);
            v[6] = lo_bf16(raw.w); v[7] = hi_bf16(raw.w);
        }
        float4* dst = reinterpret_cast<float4*>(qs + r * D + part * 8);
        dst[0] = make_float4(v[0], v[1], v[2], v[3]);
        dst[1] = make_float4(v[4], v[5], v[6], v[7]);
    }

    const float scale_log2 = __fmul_rn(w.scale, LOG2E);
    const int tile_first = w.key_first / TK;
    const int tile_last = w.key_last / TK;

    // Key row offsets of a tile, in two steps so the block-table read of tile t + 2 is in flight
    // while tile t is computed: `fetch` reads the physical block of this thread's key (threads
    // tid < TK own one key each), `place` turns it into an element offset, -1 outside the visited
    // keys, flagging entries >= num_blocks.
    static_assert(TK <= NT, "one key per thread");
    auto visited = [&](int tile) {
        const int kp = tile * TK + tid;
        return tid < TK && tile <= tile_last && kp >= w.key_first && kp <= w.key_last;
    };
    auto fetch = [&](int tile) -> unsigned int {
        return visited(tile) ? w.table[(tile * TK + tid) / w.block_size] : 0u;
    };
    auto place = [&](int tile, unsigned int phys, long long* dst) {
        if (tid >= TK) return;
        const int kp = tile * TK + tid;
        long long off = -1;
        if (visited(tile)) {
            if (phys < w.num_blocks) {
                off = (((long long)phys * w.block_size + kp % w.block_size) * w.n_kv + w.kvh) *
                      (long long)D;
            } else {
                bad_table = 1;
            }
        }
        dst[tid] = off;
    };
    auto load_tile = [&](__nv_bfloat16* buf, const __nv_bfloat16* cache, const long long* offs) {
        for (int c = tid; c < TK * CHUNKS; c += NT) {
            const int t = c / CHUNKS;
            const int part = c % CHUNKS;
            const long long off = offs[t];
            const __nv_bfloat16* src = off >= 0 ? cache + off + part * 8 : cache;
            cp_async16(buf + t * ROW + part * 8, src, off >= 0);
        }
    };

    // PV-phase state of this thread: rows pv_row0 .. pv_row0 + RPT - 1, dims 2 * dp, 2 * dp + 1.
    const int dp = tid % DP;
    const int pv_row0 = (tid / DP) * RPT;
    float acc0[RPT], acc1[RPT], lsum[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        acc0[i] = 0.f;
        acc1[i] = 0.f;
        lsum[i] = 0.f;
        if constexpr (!DECODE) {
            reinterpret_cast<float2*>(run_A + (pv_row0 + i) * D)[dp] = make_float2(0.f, 0.f);
        }
    }

    place(tile_first, fetch(tile_first), row_off);
    unsigned int phys_next = fetch(tile_first + 1);
    __syncthreads();
    load_tile(Ks, w.k_cache, row_off);
    cp_async_commit();

    for (int tile = tile_first; tile <= tile_last; ++tile) {
        const int slot = (tile - tile_first) & 1;
        const int base = tile * TK;
        const bool split_first = tile == tile_first || base % SPLIT == 0;
        const bool split_last = tile == tile_last || (base + TK) % SPLIT == 0;

        load_tile(Vs, w.v_cache, row_off + slot * TK);
        cp_async_commit();
        cp_async_wait_all_but_one();  // K of this tile has landed
        __syncthreads();

        // Scores: thread (key kt, rows srow0..) runs one fma chain per row over the dims.
        {
            const int kt = tid % TK;
            const int srow0 = (tid / TK) * RPS;
            float s[RPS];
#pragma unroll
            for (int i = 0; i < RPS; ++i) s[i] = 0.f;
            const __nv_bfloat16* krow = Ks + kt * ROW;
#pragma unroll 2
            for (int c = 0; c < CHUNKS; ++c) {
                const uint4 raw = *reinterpret_cast<const uint4*>(krow + c * 8);
                const float k[8] = {lo_bf16(raw.x), hi_bf16(raw.x), lo_bf16(raw.y), hi_bf16(raw.y),
                                    lo_bf16(raw.z), hi_bf16(raw.z), lo_bf16(raw.w), hi_bf16(raw.w)};
#pragma unroll
                for (int i = 0; i < RPS; ++i) {
                    const float4* qp = reinterpret_cast<const float4*>(qs + (srow0 + i) * D + c * 8);
                    const float4 a = qp[0];
                    const float4 b = qp[1];
                    float acc = s[i];
                    acc = __fmaf_rn(a.x, k[0], acc);
                    acc = __fmaf_rn(a.y, k[1], acc);
                    acc = __fmaf_rn(a.z, k[2], acc);
                    acc = __fmaf_rn(a.w, k[3], acc);
                    acc = __fmaf_rn(b.x, k[4], acc);
                    acc = __fmaf_rn(b.y, k[5], acc);
                    acc = __fmaf_rn(b.z, k[6], acc);
                    acc = __fmaf_rn(b.w, k[7], acc);
                    s[i] = acc;
                }
            }
            const int kp = base + kt;
            const bool in_block = kp >= w.key_first && kp <= w.key_last;
#pragma unroll
            for (int i = 0; i < RPS; ++i) {
                const int r = srow0 + i;
                const bool valid = in_block && kp >= row_lo[r] && kp <= row_hi[r];
                S[r * TK + kt] = valid ? __fmul_rn(s[i], scale_log2) : neg_inf();
            }
        }
        if (tile < tile_last) {
            place(tile + 1, phys_next, row_off + (slot ^ 1) * TK);
            phys_next = fetch(tile + 2);
        }
        __syncthreads();  // K tile free, scores complete, next row offsets visible

        if (tile < tile_last) load_tile(Ks, w.k_cache, row_off + (slot ^ 1) * TK);
        cp_async_commit();  // possibly empty: keeps the group count uniform

        // Online softmax: one warp per row.
        for (int r = warp; r < R; r += WARPS) {
            const float m_old = split_first ? neg_inf() : m_run[r];
            float tmax = neg_inf();
            for (int t = lane; t < TK; t += 32) tmax = fmaxf(tmax, S[r * TK + t]);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
            if (tmax == neg_inf()) {  // no key of this tile is visible to the row: state unchanged
                if (lane == 0) {
                    m_run[r] = m_old;
                    alpha[r] = 1.f;
                }
                continue;
            }
            const float m_new = fmaxf(m_old, tmax);
            for (int t = lane; t < TK; t += 32) S[r * TK + t] = ex2(__fsub_rn(S[r * TK + t], m_new));
            if (lane == 0) {
                m_run[r] = m_new;
                alpha[r] = ex2(__fsub_rn(m_old, m_new));
            }
        }
        cp_async_wait_all_but_one();  // V of this tile has landed
        __syncthreads();

        // P·V: each (row, dim) accumulates key by key in key order; masked keys are skipped.
        {
            // Row i sees tile keys lo .. hi, packed as lo | (hi + 1) << 16 (both in 0 .. TK).
            int span[RPT];
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                const int r = pv_row0 + i;
                const float a = alpha[r];
                acc0[i] = __fmul_rn(acc0[i], a);
                acc1[i] = __fmul_rn(acc1[i], a);
                lsum[i] = __fmul_rn(lsum[i], a);
                const int lo = min(max(max(row_lo[r], w.key_first), base) - base, TK);
                const int hi = max(min(min(row_hi[r], w.key_last), base + TK - 1) - base, -1);
                span[i] = lo | ((hi + 1) << 16);
            }
            const unsigned int* vcol = reinterpret_cast<const unsigned int*>(Vs) + dp;
            constexpr int ROW_WORDS = ROW / 2;
            for (int t0 = 0; t0 < TK; t0 += 4) {
                unsigned int v[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) v[j] = vcol[(t0 + j) * ROW_WORDS];
#pragma unroll
                for (int i = 0; i < RPT; ++i) {
                    const int lo = span[i] & 0xffff;
                    const int hi = (span[i] >> 16) - 1;
                    if (t0 + 3 < lo || t0 > hi) continue;
                    const float4 p = *reinterpret_cast<const float4*>(S + (pv_row0 + i) * TK + t0);
                    const float pj[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        if (t0 + j >= lo && t0 + j <= hi) {
                            acc0[i] = __fmaf_rn(pj[j], lo_bf16(v[j]), acc0[i]);
                            acc1[i] = __fmaf_rn(pj[j], hi_bf16(v[j]), acc1[i]);
                            lsum[i] = __fadd_rn(lsum[i], pj[j]);
                        }
                    }
                }
            }
        }
        __syncthreads();  // V tile, S and alpha free for the next tile

        if (split_last) {
            const bool bad = bad_table != 0;
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                const int r = pv_row0 + i;
                const float m = m_run[r];
                if constexpr (DECODE) {
                    // One split per block: its partial state goes to the workspace.
                    const int g = r % w.gc;
                    if (r < w.gc && g < w.live_heads) {
                        float* ml = o.ml + g * o.ml_head_stride;
                        float* acc = o.acc + g * o.acc_head_stride;
                        if (dp == 0) {
                            ml[0] = m;
                            ml[1] = bad ? quiet_nan() : lsum[i];
                        }
                        reinterpret_cast<float2*>(acc)[dp] = make_float2(acc0[i], acc1[i]);
                    }
                } else {
                    const int cur = (base / SPLIT) & 1;
                    float M = run_M[cur][r];
                    float L = run_L[cur][r];
                    if (m != neg_inf()) {  // the row saw a key in this split
                        const MergeFactors f = merge_factors(M, m);
                        L = merge_value(L, lsum[i], f);
                        float2* a = reinterpret_cast<float2*>(run_A + r * D) + dp;
                        const float2 prev = *a;
                        *a = make_float2(merge_value(prev.x, acc0[i], f), merge_value(prev.y, acc1[i], f));
                    }
                    if (dp == 0) {
                        run_M[cur ^ 1][r] = M;
                        run_L[cur ^ 1][r] = L;
                    }
                }
                acc0[i] = 0.f;
                acc1[i] = 0.f;
                lsum[i] = 0.f;
            }
        }
    }

    if constexpr (!DECODE) {
        __syncthreads();  // the last split's (M, L) are visible
        const bool bad = bad_table != 0;
        const int fin = (tile_last * TK / SPLIT + 1) & 1;
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            const int r = pv_row0 + i;
            const int tok = r / w.gc;
            const int g = r % w.gc;
            if (tok < qt && tok < w.n_tok && g < w.live_heads) {
                const float nan = quiet_nan();
                const float L = run_L[fin][r];
                const float2 a = reinterpret_cast<const float2*>(run_A + r * D)[dp];
                const float o0 = bad ? nan : __fdiv_rn(a.x, L);
                const float o1 = bad ? nan : __fdiv_rn(a.y, L);
                unsigned int* dst = reinterpret_cast<unsigned int*>(
                    o.out + tok * o.out_tok_stride + (long long)(w.head0 + g) * D);
                dst[dp] = bf16x2_bits(o0, o1);
            }
        }
    }
}

// Decode, pass 1: block (split, kv head x head chunk, sequence) writes the split's partial state.
template <int D, int R>
__device__ __forceinline__ void decode_split(
    const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
    const unsigned int* block_tables, const unsigned int* context_lens, float* workspace,
    int batch, int n_q, int n_kv, int gc, int n_chunks, int max_blocks_per_seq, int block_size,
    unsigned int num_blocks, int max_splits, int window, float scale) {
    const int split = blockIdx.x;
    const int kvh = blockIdx.y / n_chunks;
    const int chunk = blockIdx.y % n_chunks;
    const int b = blockIdx.z;
    const int group = n_q / n_kv;
    const int len = static_cast<int>(context_lens[b]);
    // Unservable lengths leave no partial; the combine kernel writes NaN for them.
    if (len <= 0 || len > max_blocks_per_seq * block_size || len > max_splits * SPLIT) return;
    const int pos = len - 1;
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    const int key_first = max(lo, split * SPLIT);
    const int key_last = min(pos, split * SPLIT + SPLIT - 1);
    if (key_first > key_last) return;

    BlockWork w;
    w.q = q + (long long)b * n_q * D;
    w.q_tok_stride = (long long)n_q * D;
    w.head0 = kvh * group + chunk * gc;
    w.gc = gc;
    w.live_heads = min(gc, group - chunk * gc);
    w.n_tok = 1;
    w.pos0 = pos;
    w.window = window;
    w.key_first = key_first;
    w.key_last = key_last;
    w.k_cache = k_cache;
    w.v_cache = v_cache;
    w.table = block_tables + (long long)b * max_blocks_per_seq;
    w.block_size = block_size;
    w.num_blocks = num_blocks;
    w.n_kv = n_kv;
    w.kvh = kvh;
    w.scale = scale;

    // Workspace: m, l at [b][h][split][2], then acc at [b][h][split][D].
    const long long rows = (long long)batch * n_q * max_splits;
    const long long first = ((long long)b * n_q + w.head0) * max_splits + split;
    BlockOut o;
    o.ml = workspace + first * 2;
    o.acc = workspace + rows * 2 + first * D;
    o.ml_head_stride = (long long)max_splits * 2;
    o.acc_head_stride = (long long)max_splits * D;
    o.out = nullptr;
    o.out_tok_stride = 0;
    attend<D, R, 128, true>(w, o);
}

// Prefill: block (token tile, kv head x head chunk) of one sequence's chunk of n_new tokens.
template <int D, int R>
__device__ __forceinline__ void prefill_tile(
    const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
    const unsigned int* block_table, __nv_bfloat16* out, int n_new, int start, int n_q, int n_kv,
    int gc, int n_chunks, int block_size, unsigned int num_blocks, int window, float scale) {
    const int kvh = blockIdx.y / n_chunks;
    const int chunk = blockIdx.y % n_chunks;
    const int group = n_q / n_kv;
    const int qt = R / gc;
    const int tok0 = blockIdx.x * qt;
    const int pos0 = start + tok0;
    const int n_tok = min(qt, n_new - tok0);

    BlockWork w;
    w.q = q + (long long)tok0 * n_q * D;
    w.q_tok_stride = (long long)n_q * D;
    w.head0 = kvh * group + chunk * gc;
    w.gc = gc;
    w.live_heads = min(gc, group - chunk * gc);
    w.n_tok = n_tok;
    w.pos0 = pos0;
    w.window = window;
    w.key_first = window > 0 ? max(0, pos0 - window + 1) : 0;
    w.key_last = pos0 + n_tok - 1;
    w.k_cache = k_cache;
    w.v_cache = v_cache;
    w.table = block_table;
    w.block_size = block_size;
    w.num_blocks = num_blocks;
    w.n_kv = n_kv;
    w.kvh = kvh;
    w.scale = scale;

    BlockOut o;
    o.ml = nullptr;
    o.acc = nullptr;
    o.ml_head_stride = 0;
    o.acc_head_stride = 0;
    o.out = out + (long long)tok0 * n_q * D;
    o.out_tok_stride = (long long)n_q * D;
    attend<D, R, 256, false>(w, o);
}

}  // namespace attn

#define ATTN_DECODE(D, R)                                                                           \
    extern "C" __global__ void __launch_bounds__(128, 4) attn_decode_d##D##_r##R(                   \
        const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,         \
        const unsigned int* block_tables, const unsigned int* context_lens, float* workspace,       \
        int batch, int n_q, int n_kv, int gc, int n_chunks, int max_blocks_per_seq,                 \
        int block_size, unsigned int num_blocks, int max_splits, int window, float scale) {         \
        attn::decode_split<D, R>(q, k_cache, v_cache, block_tables, context_lens, workspace, batch, \
                                 n_q, n_kv, gc, n_chunks, max_blocks_per_seq, block_size,           \
                                 num_blocks, max_splits, window, scale);                            \
    }

#define ATTN_PREFILL(D, R)                                                                      \
    extern "C" __global__ void __launch_bounds__(256, 2) attn_prefill_d##D##_r##R(              \
        const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,     \
        const unsigned int* block_table, __nv_bfloat16* out, int n_new, int start, int n_q,     \
        int n_kv, int gc, int n_chunks, int block_size, unsigned int num_blocks, int window,    \
        float scale) {                                                                          \
        attn::prefill_tile<D, R>(q, k_cache, v_cache, block_table, out, n_new, start, n_q, n_kv, \
                                 gc, n_chunks, block_size, num_blocks, window, scale);          \
    }

ATTN_DECODE(64, 4)
ATTN_DECODE(64, 8)
ATTN_DECODE(128, 4)
ATTN_DECODE(128, 8)
ATTN_DECODE(128, 16)
ATTN_DECODE(256, 4)
ATTN_DECODE(256, 8)
ATTN_PREFILL(64, 32)
ATTN_PREFILL(128, 32)
ATTN_PREFILL(256, 16)

// Decode, pass 2: block (q head, sequence) merges the sequence's splits in split order.
// Threads own dims; every thread runs the same (M, L) recurrence, so all agree bit for bit.
extern "C" __global__ void __launch_bounds__(128) attn_decode_combine(
    const float* workspace, const unsigned int* context_lens, __nv_bfloat16* out, int batch,
    int n_q, int head_dim, int max_blocks_per_seq, int block_size, int max_splits, int window) {
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int len = static_cast<int>(context_lens[b]);
    const bool bad = len <= 0 || len > max_blocks_per_seq * block_size || len > max_splits * attn::SPLIT;
    const int pos = len - 1;
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    const long long rows = (long long)batch * n_q * max_splits;
    const long long first = ((long long)b * n_q + h) * max_splits;
    const float* ml = workspace + first * 2;
    const float* acc = workspace + rows * 2 + first * head_dim;
    __nv_bfloat16* dst = out + ((long long)b * n_q + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        if (bad) {
            dst[d] = __float2bfloat16_rn(attn::quiet_nan());
            continue;
        }
        float M = attn::neg_inf();
        float L = 0.f;
        float A = 0.f;
        for (int s = lo / attn::SPLIT; s <= pos / attn::SPLIT; ++s) {
            const attn::MergeFactors f = attn::merge_factors(M, ml[2 * s]);
            L = attn::merge_value(L, ml[2 * s + 1], f);
            A = attn::merge_value(A, acc[(long long)s * head_dim + d], f);
        }
        dst[d] = __float2bfloat16_rn(__fdiv_rn(A, L));
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core prefill (FlashAttention-2 style), head_dim 64 and 128: the default prefill kernel.
//
// Block (query tile, q head): 4 warps own 64 consecutive tokens of the chunk for one q head;
// warp w owns tokens 16w .. 16w + 15, one m16 MMA row each (lane g = lane / 4 holds rows g and
// g + 8, lane t = lane % 4 holds key/dim columns 2t, 2t + 1 of every n8 tile). Keys are visited in
// tiles of BK = 64 positions aligned at absolute multiples of 64, ascending; each tile's K and V
// ([BK][D + 8] bf16, padded so ldmatrix rows hit distinct banks) are staged by cp.async, double
// buffered, with the row offsets from the block table computed one tile ahead.
// Per tile and row:
//   S = Q·Kᵀ by m16n8k16 bf16 MMAs (f32 accumulate; k-steps over dims in ascending order);
//   s = S * (scale * log2 e), masked keys (outside (pos - W, pos]) set to -inf;
//   m' = max(m, tile max over the row's quad); p = 2^(s - m'); alpha = 2^(m - m');
//   l = l * alpha + (this lane's 16 p in key order); acc = acc * alpha + bf16(P)·V by MMA.
// A tile with no visible key for a row leaves its (m, l, acc) unchanged: alpha is exactly 1,
// every p is 0 (2^-inf), and P·V adds exact zeros (unloaded keys are zero-filled, so 0 · V
// never meets a NaN); no -inf - -inf is ever formed. A warp whose rows all see nothing of a tile
// skips it, which is the same no-op.
// Invariance: an MMA output row depends only on its own A row, the quad reductions (max, final
// l) are fixed butterflies, and the column a lane handles does not depend on the row. So a row's
// output depends on its q, its absolute position, the window and the cache alone: bit-identical
// however the prompt is chunked, wherever the row sits in its tile, and whatever else runs. It
// is not bit-identical to the f32 kernels above (decode included): a different computation.
namespace attn_mma {

constexpr int BQ = 64;  // query rows per block
constexpr int BK = 64;  // keys per tile: part of the numerics (tile boundaries fix the rescales)
constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;

template <int D>
struct Shape {
    static constexpr int ROW = D + 8;  // smem row stride (bf16): 16-byte rows at odd 16-byte units
    static constexpr int CHUNKS = D / 8;
    // Dynamic shared memory, mirrored by `mma_smem_bytes` in src/attention.rs:
    //   [2][BK][ROW] bf16 K | [2][BK][ROW] bf16 V
    static constexpr int SMEM = 4 * BK * ROW * 2;
};

__device__ __forceinline__ void mma16816(float c[4], const unsigned int a[4], unsigned int b0,
                                         unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned int r[4], const void* smem) {
    const unsigned int addr = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int r[4], const void* smem) {
    const unsigned int addr = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

template <int D>
__device__ __forceinline__ void prefill(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_cache,
    const __nv_bfloat16* __restrict__ v_cache, const unsigned int* __restrict__ block_table,
    __nv_bfloat16* __restrict__ out, int n_new, int start, int n_q, int n_kv, int block_size,
    unsigned int num_blocks, int window, float scale) {
    constexpr int ROW = Shape<D>::ROW;
    constexpr int CHUNKS = Shape<D>::CHUNKS;
    constexpr int KSTEPS = D / 16;  // S = Q·Kᵀ: k-steps over dims
    constexpr int DTILES = D / 8;   // P·V: n8 tiles over dims
    extern __shared__ __align__(16) unsigned char smem[];
    __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(smem);  // [2][BK][ROW]
    __nv_bfloat16* Vs = Ks + 2 * BK * ROW;                      // [2][BK][ROW]
    __shared__ long long row_off[2][BK];  // element offset of each key of a tile; -1: not loaded
    __shared__ int bad_table;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    // Heavy (late) query tiles first: causal work grows with the tile index.
    const int tok0 = (gridDim.x - 1 - blockIdx.x) * BQ;
    const int h = blockIdx.y;
    const int kvh = h / (n_q / n_kv);
    const int n_tok = min(BQ, n_new - tok0);
    const int pos0 = start + tok0;
    const int key_first = window > 0 ? max(0, pos0 - window + 1) : 0;
    const int key_last = pos0 + n_tok - 1;
    const int tile_first = key_first / BK;
    const int n_tiles = key_last / BK - tile_first + 1;

    // This lane's rows (i = 0: row g, i = 1: row g + 8 of the warp) and their visible keys.
    int lo[2], hi[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = warp * 16 + g + 8 * i;
        const int pos = pos0 + r;
        hi[i] = r < n_tok ? pos : -1;  // dead rows see nothing
        lo[i] = window > 0 ? pos - window + 1 : 0;
    }
    // The warp's extremes: rows ascend with position, so row 16w has the smallest lo and hi.
    const int w_row0 = warp * 16;
    const int w_last = min(w_row0 + 15, n_tok - 1);  // < w_row0 when the warp has no live row
    const int w_min_lo = window > 0 ? pos0 + w_row0 - window + 1 : 0;
    const int w_max_lo = window > 0 ? pos0 + w_row0 + 15 - window + 1 : 0;
    const int w_min_hi = w_row0 + 15 < n_tok ? pos0 + w_row0 : -1;
    const int w_max_hi = w_last >= w_row0 ? pos0 + w_last : -1;

    // Q fragments (A operand, row-major 16 x 16 per k-step), straight from global memory.
    unsigned int qa[KSTEPS][4];
    {
        const long long tok_stride = (long long)n_q * D;
        const bool live0 = w_row0 + g < n_tok;
        const bool live1 = w_row0 + g + 8 < n_tok;
        const unsigned int* q0 = reinterpret_cast<const unsigned int*>(
            q + (long long)(tok0 + w_row0 + g) * tok_stride + (long long)h * D);
        const unsigned int* q1 = q0 + 8 * tok_stride / 2;
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            const int w0 = ks * 8 + t;  // word of dims ks * 16 + 2t, 2t + 1
            qa[ks][0] = live0 ? q0[w0] : 0u;
            qa[ks][1] = live1 ? q1[w0] : 0u;
            qa[ks][2] = live0 ? q0[w0 + 4] : 0u;
            qa[ks][3] = live1 ? q1[w0 + 4] : 0u;
        }
    }

    // Row offsets of tile i's keys, in two steps so the block-table read runs a tile ahead of its
    // use: `fetch` reads the physical block of this thread's key (threads tid < BK, one key
    // each), `place` turns it into an element offset: -1 outside the block's keys, flagging
    // entries >= num_blocks.
    auto in_range = [&](int i) {
        const int kp = (tile_first + i) * BK + tid;
        return tid < BK && i < n_tiles && kp >= key_first && kp <= key_last;
    };
    auto fetch = [&](int i) -> unsigned int {
        return in_range(i) ? block_table[((tile_first + i) * BK + tid) / block_size] : 0u;
    };
    auto place = [&](int i, unsigned int phys, long long* dst) {
        if (tid >= BK || i >= n_tiles) return;
        const int kp = (tile_first + i) * BK + tid;
        long long off = -1;
        if (in_range(i)) {
            if (phys < num_blocks) {
                off = (((long long)phys * block_size + kp % block_size) * n_kv + kvh) * (long long)D;
            } else {
                bad_table = 1;
            }
        }
        dst[tid] = off;
    };
    auto load = [&](int buf, const long long* offs) {
        static_assert(BK * CHUNKS % THREADS == 0, "whole chunks per thread");
#pragma unroll
        for (int it = 0; it < BK * CHUNKS / THREADS; ++it) {
            const int c = tid + it * THREADS;
            const int key = c / CHUNKS;
            const int part = c % CHUNKS;
            const long long off = offs[key];
            const bool valid = off >= 0;
            const long long src = valid ? off + part * 8 : 0;
            const int dst = (buf * BK + key) * ROW + part * 8;
            attn::cp_async16(Ks + dst, k_cache + src, valid);
            attn::cp_async16(Vs + dst, v_cache + src, valid);
        }
    };

    if (tid == 0) bad_table = 0;
    __syncthreads();  // bad_table is cleared before any thread may set it
    place(0, fetch(0), row_off[0]);
    place(1, fetch(1), row_off[1]);
    unsigned int phys_next = fetch(2);
    __syncthreads();
    load(0, row_off[0]);
    attn::cp_async_commit();

    const float scale_log2 = __fmul_rn(scale, attn::LOG2E);
    float m[2] = {attn::neg_inf(), attn::neg_inf()};
    float l[2] = {0.f, 0.f};
    float acc[DTILES][4];
#pragma unroll
    for (int n = 0; n < DTILES; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

    // ldmatrix lane roles: lane supplies row (lane & 7) of 8x8 matrix (lane >> 3).
    const int mat = lane >> 3;
    const int mrow = lane & 7;

    for (int i = 0; i < n_tiles; ++i) {
        const int buf = i & 1;
        if (i + 1 < n_tiles) load(buf ^ 1, row_off[buf ^ 1]);
        attn::cp_async_commit();  // possibly empty: keeps the group count uniform
        attn::cp_async_wait_all_but_one();  // tile i has landed
        __syncthreads();
        // Tile i's offsets were consumed by its load (before the barrier above); tile i + 2's
        // are read after the barrier that ends this iteration.
        place(i + 2, phys_next, row_off[buf]);
        phys_next = fetch(i + 3);

        const int base = (tile_first + i) * BK;
        const bool skip = base > w_max_hi || base + BK - 1 < w_min_lo;
        if (!skip) {
            const __nv_bfloat16* Kt = Ks + buf * BK * ROW;
            const __nv_bfloat16* Vt = Vs + buf * BK * ROW;

            // S = Q·Kᵀ: s[j] is the n8 tile of keys 8j .. 8j + 7.
            float s[BK / 8][4];
#pragma unroll
            for (int j = 0; j < BK / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ++ks) {
#pragma unroll
                for (int j = 0; j < BK / 8; j += 2) {
                    // Matrices: (keys of tile j, dims lo), (j, dims hi), (j + 1, lo), (j + 1, hi).
                    unsigned int b[4];
                    ldmatrix_x4(b, Kt + ((j + (mat >> 1)) * 8 + mrow) * ROW + ks * 16 + (mat & 1) * 8);
                    mma16816(s[j], qa[ks], b[0], b[1]);
                    mma16816(s[j + 1], qa[ks], b[2], b[3]);
                }
            }

            // Scale, mask, online softmax per row (i = 0: row g, elements 0, 1; i = 1: row g + 8,
            // elements 2, 3).
            const bool full = base >= w_max_lo && base + BK - 1 <= w_min_hi;
            float alpha[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float tmax = attn::neg_inf();
#pragma unroll
                for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int kp = base + j * 8 + 2 * t + e;
                        const bool visible = full || (kp >= lo[r] && kp <= hi[r]);
                        const float v = visible ? __fmul_rn(s[j][2 * r + e], scale_log2) : attn::neg_inf();
                        s[j][2 * r + e] = v;
                        tmax = fmaxf(tmax, v);
                    }
                }
                tmax = quad_max(tmax);
                const float m_new = fmaxf(m[r], tmax);
                const float ref = m_new == attn::neg_inf() ? 0.f : m_new;
                alpha[r] = tmax == attn::neg_inf() ? 1.f : attn::ex2(__fsub_rn(m[r], ref));
                m[r] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = attn::ex2(__fsub_rn(s[j][2 * r + e], ref));
                        s[j][2 * r + e] = p;
                        sum = __fadd_rn(sum, p);
                    }
                }
                l[r] = __fadd_rn(__fmul_rn(l[r], alpha[r]), sum);
            }
#pragma unroll
            for (int n = 0; n < DTILES; ++n) {
                acc[n][0] = __fmul_rn(acc[n][0], alpha[0]);
                acc[n][1] = __fmul_rn(acc[n][1], alpha[0]);
                acc[n][2] = __fmul_rn(acc[n][2], alpha[1]);
                acc[n][3] = __fmul_rn(acc[n][3], alpha[1]);
            }

            // acc += bf16(P)·V: the S accumulators of key tiles 2kk, 2kk + 1 are the A fragment
            // of k-step kk; V fragments by transposing ldmatrix.
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                unsigned int pa[4];
                pa[0] = attn::bf16x2_bits(s[2 * kk][0], s[2 * kk][1]);
                pa[1] = attn::bf16x2_bits(s[2 * kk][2], s[2 * kk][3]);
                pa[2] = attn::bf16x2_bits(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[3] = attn::bf16x2_bits(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
                for (int n = 0; n < DTILES; n += 2) {
                    // Matrices: (keys lo, dims of tile n), (keys hi, n), (lo, n + 1), (hi, n + 1).
                    unsigned int b[4];
                    ldmatrix_x4_trans(b, Vt + (kk * 16 + (mat & 1) * 8 + mrow) * ROW + (n + (mat >> 1)) * 8);
                    mma16816(acc[n], pa, b[0], b[1]);
                    mma16816(acc[n + 1], pa, b[2], b[3]);
                }
            }
        }
        __syncthreads();  // buffer `buf` and row_off[buf ^ 1] are free for the next iteration
    }

    // out = acc / l, rounded to bf16; NaN for every row when the block met a bad table entry.
    const bool bad = bad_table != 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float total = quad_sum(l[r]);
        const int row = w_row0 + g + 8 * r;
        if (row >= n_tok) continue;
        unsigned int* dst = reinterpret_cast<unsigned int*>(
            out + ((long long)(tok0 + row) * n_q + h) * D);
#pragma unroll
        for (int n = 0; n < DTILES; ++n) {
            const float o0 = bad ? attn::quiet_nan() : __fdiv_rn(acc[n][2 * r], total);
            const float o1 = bad ? attn::quiet_nan() : __fdiv_rn(acc[n][2 * r + 1], total);
            dst[n * 4 + t] = attn::bf16x2_bits(o0, o1);
        }
    }
}

}  // namespace attn_mma

#define ATTN_PREFILL_MMA(D)                                                                     \
    extern "C" __global__ void __launch_bounds__(attn_mma::THREADS) attn_prefill_mma_d##D(     \
        const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,     \
        const unsigned int* block_table, __nv_bfloat16* out, int n_new, int start, int n_q,     \
        int n_kv, int block_size, unsigned int num_blocks, int window, float scale) {           \
        attn_mma::prefill<D>(q, k_cache, v_cache, block_table, out, n_new, start, n_q, n_kv,    \
                             block_size, num_blocks, window, scale);                            \
    }

ATTN_PREFILL_MMA(64)
ATTN_PREFILL_MMA(128)
