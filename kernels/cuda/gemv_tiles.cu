// The decode GEMV over weights re-laid at load time in the order the tensor cores consume them
// (issue 36): y[m, n] = s[n] * sum_k x[m, k] * w'[n, k] with the weight w' decoded in registers
// from a 16-byte load per lane and the k-step, with no shuffles, and the row's output scale s[n]
// (its tensor's) applied once per output after the sum (one rounding). Names:
// `gemv_tiles_<format>_<out>_m<MT>_r<R>_p<P>_u<U>`.
//
// Shape: the weight is the MMA's A operand (16 rows x 16 k per m16n8k16), x its B operand (8 rows
// of x per column tile, MT tiles for up to 8 MT rows), so one decoded weight fragment feeds the
// MMAs of every x tile and a row of x costs no weight decoding. A tile is 16 rows x 64 k. Lane
// (g = lane / 4, t = lane % 4) holds rows g and g + 8 at k 16 t .. 16 t + 16 of it (NVFP4: one
// scale group per row), and MMA h (0..4) of the tile takes k 16 t + 4 h .. + 4 of those rows in
// its k slots {2t, 2t + 1, 2t + 8, 2t + 9}; x's fragment is permuted the same way, so a lane's x is
// the 16 contiguous values x[row][16 t .. 16 t + 16) of the tile: two 16-byte loads, no shuffles.
//
// A block has P warps over k (warp p takes tiles p, p + P, ... of its rows) and R row tiles per
// warp; per (m, n) the order is the k tiles of each phase in ascending order, then the P phase
// totals in phase order, the MMA's own order inside a tile: fixed by K and P alone, so a row of x
// gets the same bits from every M, MT and grid (rows of x past M are zeros, and a column of an
// MMA's result reads only its own column of B).
#include "common.cuh"

typedef unsigned char u8;

__device__ __forceinline__ void mma_tile(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 rotr(u32 q, u32 s) { return __funnelshift_r(q, q, s); }

__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// NVFP4 tiles (src/tiles.rs `Nvfp4Tiles` writes them): per tile 512 bytes of codes (lane L's 16 at
// 16 L) then 64 bytes of scales (lane L's two at 512 + 2 L: row g's, then row g + 8's), tiles of
// one 16-row band contiguous along k. Word h of a lane's codes holds MMA h's eight e2m1 codes,
// bit-placed so that each A register is one or two rotations and masks away from a bf16 pair:
// a register's two codes land with e1 e0 m in bits 8..6 / 24..22 and the sign in bit 15 / 31,
// the bf16 of the code times 2^-126 (e2m1's subnormal is bf16's). A scale byte is bits 11..4 of
// the bf16 of the e4m3 group scale times 2^119 (bits 14..12 set: every e4m3 scale, subnormals
// normalized, fits), so one multiply gives bf16(code * scale * 2^-7) exactly (at most 6
// significant bits) and the output takes s = 2^7 / t (or 2^7 * t) after the sum.
struct Nvfp4Tiles {
    static constexpr u32 TILE_BYTES = 576;
    struct Raw {
        uint4 q;
        u32 s;
    };
    const u8* w;
    u32 k_tiles;
    // The tiles from band `band` on (a block's first band), whose fetches take a band a few past
    // it: their offsets fit in 32 bits.
    __device__ __forceinline__ Nvfp4Tiles at_band(u32 band) const {
        return Nvfp4Tiles{w + (u64)band * k_tiles * TILE_BYTES, k_tiles};
    }
    __device__ __forceinline__ Raw fetch(u32 band, u32 kt, u32 lane) const {
        const u8* tile = w + (band * k_tiles + kt) * TILE_BYTES;
        Raw r;
        r.q = __ldg(reinterpret_cast<const uint4*>(tile + 16 * lane));
        r.s = __ldg(reinterpret_cast<const unsigned short*>(tile + 512 + 2 * lane));
        return r;
    }
    static __device__ __forceinline__ void decode(const Raw& r, u32 a[4][4]) {
        const u32 MAG = 0x01C001C0u, SGN = 0x80008000u;
        const u32 s0 = __byte_perm(r.s, 0, 0x4040) * 16u + 0x70007000u;  // row g's scale, twice
        const u32 s1 = __byte_perm(r.s, 0, 0x4141) * 16u + 0x70007000u;  // row g + 8's
        const u32 words[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            const u32 q = words[h];
            a[h][0] = bf16x2_mul((q & MAG) | (rotr(q, 4) & SGN), s0);
            a[h][1] = bf16x2_mul(rotr(q, 3) & (MAG | SGN), s1);
            a[h][2] = bf16x2_mul(rotr(q, 6) & (MAG | SGN), s0);
            a[h][3] = bf16x2_mul((rotr(q, 9) & MAG) | (rotr(q, 5) & SGN), s1);
        }
    }
};

// FP8 (e4m3) tiles (src/tiles.rs `fp8_tiles` writes them): per tile 1024 bytes, lane L's 32 at
// 32 L; words 2 h and 2 h + 1 hold MMA h's registers 0, 1 and 2, 3. A word's bytes are placed so
// that shifts and masks make two bf16 pairs of it: register 2 i from bytes 1 and 3 (the
// `(q & S) | (q >> 4 & E)` pair: sign in place, exponent and mantissa four bits down), register
// 2 i + 1 from bytes 0 and 2 (`(q << 8 & S) | (q << 4 & E)`). Each half is then the bf16 of the
// e4m3 value times 2^-120 (e4m3's subnormals are bf16's), and one multiply by 2^120 makes it
// exact; the output takes the row's scale s (per channel or per tensor) after the sum.
struct Fp8Tiles {
    static constexpr u32 TILE_BYTES = 1024;
    struct Raw {
        uint4 q[2];
    };
    const u8* w;
    u32 k_tiles;
    __device__ __forceinline__ Fp8Tiles at_band(u32 band) const {
        return Fp8Tiles{w + (u64)band * k_tiles * TILE_BYTES, k_tiles};
    }
    __device__ __forceinline__ Raw fetch(u32 band, u32 kt, u32 lane) const {
        const uint4* tile = reinterpret_cast<const uint4*>(w + (band * k_tiles + kt) * TILE_BYTES);
        Raw r;
        r.q[0] = __ldg(tile + 2 * lane);
        r.q[1] = __ldg(tile + 2 * lane + 1);
        return r;
    }
    static __device__ __forceinline__ void decode(const Raw& r, u32 a[4][4]) {
        const u32 S = 0x80008000u, E = 0x07F007F0u, TWO_120 = 0x7B807B80u;
        const u32 words[8] = {r.q[0].x, r.q[0].y, r.q[0].z, r.q[0].w,
                              r.q[1].x, r.q[1].y, r.q[1].z, r.q[1].w};
#pragma unroll
        for (int h = 0; h < 4; ++h)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const u32 q = words[2 * h + i];
                a[h][2 * i] = bf16x2_mul((q & S) | ((q >> 4) & E), TWO_120);
                a[h][2 * i + 1] = bf16x2_mul(((q << 8) & S) | ((q << 4) & E), TWO_120);
            }
    }
};

// The same tiles as bf16 A registers, stored (64 bytes per lane: MMA h's four at 16 h): the
// kernel's twin, whose weights the CPU decodes — the oracle of the decoding above. Its speed does
// not matter, so a step holds only where its tiles are and loads them where they are decoded
// (64 bytes a lane per tile in flight would spill the wider shapes). Built with one row tile per
// warp only, where every fetched step that is decoded was fetched (a skipped one is past k).
struct Bf16Tiles {
    static constexpr u32 TILE_BYTES = 2048;
    struct Raw {
        const uint4* p;
    };
    const u8* w;
    u32 k_tiles;
    __device__ __forceinline__ Bf16Tiles at_band(u32 band) const {
        return Bf16Tiles{w + (u64)band * k_tiles * TILE_BYTES, k_tiles};
    }
    __device__ __forceinline__ Raw fetch(u32 band, u32 kt, u32 lane) const {
        return Raw{reinterpret_cast<const uint4*>(w + (band * k_tiles + kt) * TILE_BYTES + 64 * lane)};
    }
    static __device__ __forceinline__ void decode(const Raw& r, u32 a[4][4]) {
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            const uint4 v = __ldg(r.p + h);
            a[h][0] = v.x;
            a[h][1] = v.y;
            a[h][2] = v.z;
            a[h][3] = v.w;
        }
    }
};

__device__ __forceinline__ void store_tile_out(__nv_bfloat16* y, float v) { *y = f32_to_bf16(v); }
__device__ __forceinline__ void store_tile_out(float* y, float v) { *y = v; }

// y[m, n] = s[n] * sum_k x[m, k] w'[n, k]; x [m, k] bf16 (16-byte aligned), k % 64 == 0, n rows
// in ceil(n / 16) bands.
// A warp step is U k tiles of its R bands; the loads of the next step are issued before the
// current one is decoded (two register buffers), so 2 U R tiles per warp are in flight. With one
// x tile (MT = 1, up to 8 rows) the step's x fragments are loaded with its weights too, so no
// load waits between the decode and the MMAs; wider x loads them in the step.
template <int MT, int U, int R, typename W>
struct TileStep {
    typename W::Raw raw[U][R];
    uint4 xs[MT == 1 ? U : 1][2];
};

template <int MT, int U, int R, typename W>
__device__ __forceinline__ void fetch_step(TileStep<MT, U, R, W>& st, const W& w,
                                           const __nv_bfloat16* __restrict__ x, u32 m, u32 k,
                                           u32 kt0, u32 stride, u32 k_tiles, u32 band0,
                                           u32 bands, u32 lane) {
    const u32 g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const u32 kt = kt0 + u * stride;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            // A block's first band always exists (the grid covers each part's bands exactly).
            if (kt < k_tiles && (r == 0 || band0 + r < bands))
                st.raw[u][r] = w.fetch(r, kt, lane);
        }
        if constexpr (MT == 1) {
            st.xs[u][0] = st.xs[u][1] = make_uint4(0, 0, 0, 0);
            if (kt < k_tiles && g < m) {
                const __nv_bfloat16* p = x + (u64)g * k + (u64)kt * 64 + 16 * tq;
                st.xs[u][0] = load16(p);
                st.xs[u][1] = load16(p + 8);
            }
        }
    }
}

template <int MT, int U, int R, typename W>
__device__ __forceinline__ void mma_step(float c[R][MT][4], const TileStep<MT, U, R, W>& st,
                                         const __nv_bfloat16* __restrict__ x, u32 m, u32 k,
                                         u32 kt0, u32 stride, u32 k_tiles, u32 g, u32 tq) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const u32 kt = kt0 + u * stride;
        if (kt >= k_tiles) break;
        u32 a[R][4][4];
#pragma unroll
        for (int r = 0; r < R; ++r) W::decode(st.raw[u][r], a[r]);
#pragma unroll
        for (int j = 0; j < MT; ++j) {
            uint4 lo, hi;
            if constexpr (MT == 1) {
                lo = st.xs[u][0];
                hi = st.xs[u][1];
            } else {
                const u32 row = 8 * j + g;
                lo = hi = make_uint4(0, 0, 0, 0);
                if (row < m) {
                    const __nv_bfloat16* p = x + (u64)row * k + (u64)kt * 64 + 16 * tq;
                    lo = load16(p);
                    hi = load16(p + 8);
                }
            }
            const u32 b[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int h = 0; h < 4; ++h) mma_tile(c[r][j], a[r][h], b[2 * h], b[2 * h + 1]);
        }
    }
}

template <int MT, int R, int P, int U, typename W, typename Out>
__device__ __forceinline__ void gemv_tiles_body(Out* __restrict__ y,
                                                const __nv_bfloat16* __restrict__ x, const W w,
                                                u32 m, u32 n, u32 k,
                                                const float* __restrict__ s, u32 block) {
    __shared__ float partial[P][16 * R][8 + 1];
    const u32 lane = threadIdx.x & 31;
    const u32 phase = threadIdx.x >> 5;
    const u32 g = lane >> 2, tq = lane & 3;
    const u32 band0 = block * R;
    const u32 bands = (n + 15) / 16;
    const u32 k_tiles = k / 64;
    float c[R][MT][4];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < MT; ++j) c[r][j][0] = c[r][j][1] = c[r][j][2] = c[r][j][3] = 0.0f;

    constexpr u32 STEP = P * U;
    TileStep<MT, U, R, W> sa, sb;
    const W wb = w.at_band(band0);
    fetch_step(sa, wb, x, m, k, phase, P, k_tiles, band0, bands, lane);
    for (u32 kt0 = phase; kt0 < k_tiles; kt0 += 2 * STEP) {
        fetch_step(sb, wb, x, m, k, kt0 + STEP, P, k_tiles, band0, bands, lane);
        mma_step(c, sa, x, m, k, kt0, P, k_tiles, g, tq);
        if (kt0 + STEP >= k_tiles) break;
        fetch_step(sa, wb, x, m, k, kt0 + 2 * STEP, P, k_tiles, band0, bands, lane);
        mma_step(c, sb, x, m, k, kt0 + STEP, P, k_tiles, g, tq);
    }

    // One x tile at a time through shared memory: the phase totals in phase order.
#pragma unroll
    for (int j = 0; j < MT; ++j) {
        if (j > 0) __syncthreads();
#pragma unroll
        for (int r = 0; r < R; ++r) {
            partial[phase][16 * r + g][2 * tq] = c[r][j][0];
            partial[phase][16 * r + g][2 * tq + 1] = c[r][j][1];
            partial[phase][16 * r + g + 8][2 * tq] = c[r][j][2];
            partial[phase][16 * r + g + 8][2 * tq + 1] = c[r][j][3];
        }
        __syncthreads();
        for (u32 i = threadIdx.x; i < 16 * R * 8; i += P * 32) {
            const u32 row = i / 8, col = i % 8;
            const u32 out_n = band0 * 16 + row, out_m = 8 * j + col;
            float v = partial[0][row][col];
#pragma unroll
            for (int p = 1; p < P; ++p) v += partial[p][row][col];
            if (out_n < n && out_m < m) {
                store_tile_out(y + (u64)out_m * n + out_n, __fmul_rn(v, __ldg(s + out_n)));
            }
        }
    }
}

// Up to three projections of one x in one launch (q, k and v: the narrow k and v alone leave SMs
// idle): the first blocks take part 0's bands, the next part 1's, the rest part 2's; each part has
// its own y [m, n_i], tiles and output scales, and a part's rows are the bits a launch of that part
// alone gives (a block reads one part, the reduction order is K's and P's). A part with n_i = 0
// takes no block.
#define TILES_ENTRY(NAME, W, OUTN, OUT, MT, R, P, U)                                       \
    extern "C" __global__ void __launch_bounds__(P * 32)                                           \
        gemv_tiles_##NAME##_##OUTN##_m##MT##_r##R##_p##P##_u##U(                                   \
            OUT* y0, OUT* y1, OUT* y2, const __nv_bfloat16* __restrict__ x, const u8* w0,          \
            const u8* w1, const u8* w2, const float* s0, const float* s1, const float* s2, u32 m,  \
            u32 n0, u32 n1, u32 n2, u32 k) {                                                       \
        const u32 b0 = (n0 + 16 * R - 1) / (16 * R), b01 = b0 + (n1 + 16 * R - 1) / (16 * R);   \
        const u32 bx = blockIdx.x;                                                                 \
        const u32 part = bx >= b01 ? 2 : bx >= b0 ? 1 : 0;                                         \
        const u32 block = bx - (part == 2 ? b01 : part == 1 ? b0 : 0);                             \
        gemv_tiles_body<MT, R, P, U>(part == 2 ? y2 : part == 1 ? y1 : y0, x,                      \
                                     W{part == 2 ? w2 : part == 1 ? w1 : w0, k / 64}, m,           \
                                     part == 2 ? n2 : part == 1 ? n1 : n0, k,                      \
                                     part == 2 ? s2 : part == 1 ? s1 : s0, block);                 \
    }

#define TILES_MT(NAME, W, R, P, U)                                                         \
    TILES_ENTRY(NAME, W, bf16, __nv_bfloat16, 1, R, P, U)                                  \
    TILES_ENTRY(NAME, W, bf16, __nv_bfloat16, 2, R, P, U)                                  \
    TILES_ENTRY(NAME, W, bf16, __nv_bfloat16, 4, R, P, U)                                  \
    TILES_ENTRY(NAME, W, bf16, __nv_bfloat16, 8, R, P, U)                                  \
    TILES_ENTRY(NAME, W, f32, float, 1, R, P, U)                                           \
    TILES_ENTRY(NAME, W, f32, float, 2, R, P, U)                                           \
    TILES_ENTRY(NAME, W, f32, float, 4, R, P, U)                                           \
    TILES_ENTRY(NAME, W, f32, float, 8, R, P, U)

// The built shapes (src/tiles.rs `TILE_CONFIGS`). P fixes a row's reduction order; R and U only
// how the work is spread and how many loads are in flight, so the launcher picks them by M and n
// (src/tiles.rs `tile_config`) and a row keeps its bits. The twin is built for the one-row-tile
// shape only (the self-test holds the other to its bits).
#define TILES_CONFIG(R, P, U)                  \
    TILES_MT(nvfp4, Nvfp4Tiles, R, P, U) \
    TILES_MT(fp8, Fp8Tiles, R, P, U)     \
    TILES_MT(twin, Bf16Tiles, R, P, U)

TILES_CONFIG(1, 8, 2)
TILES_MT(nvfp4, Nvfp4Tiles, 2, 8, 1)
TILES_MT(fp8, Fp8Tiles, 2, 8, 1)

// out[n, k] (bf16, row-major) = bf16(w'[n, k] * s[n]): tiles widened for the prompt rows' GEMM
// (NVFP4: the value the checkpoint loader widens to, up to where the tensor scale rounds; FP8:
// exactly the loader's `bf16(q * s)`). One thread per lane slot of a tile: its 32 weights.
template <typename W>
__device__ __forceinline__ void dequant_tiles_body(__nv_bfloat16* __restrict__ out,
                                                   const u8* __restrict__ w,
                                                   const float* __restrict__ s, u32 n, u32 k) {
    const u32 k_tiles = k / 64, bands = (n + 15) / 16;
    const W tiles{w, k_tiles};
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)bands * k_tiles * 32;
         i += (u64)gridDim.x * blockDim.x) {
        const u32 lane = i % 32, tile = i / 32;
        const u32 band = tile / k_tiles, kt = tile % k_tiles;
        const u32 g = lane >> 2, tq = lane & 3;
        u32 a[4][4];
        W::decode(tiles.at_band(band).fetch(0, kt, lane), a);
#pragma unroll
        for (int h = 0; h < 4; ++h)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 row = band * 16 + g + 8 * (j % 2);
                if (row >= n) continue;
                const float sr = __ldg(s + row);
                const u32 col = kt * 64 + 16 * tq + 4 * h + 2 * (j / 2);
                const u32 pair = a[h][j];
                const float lo = __uint_as_float(pair << 16), hi = __uint_as_float(pair & 0xffff0000u);
                *reinterpret_cast<u32*>(out + (u64)row * k + col) =
                    pack_bf16x2(__fmul_rn(lo, sr), __fmul_rn(hi, sr));
            }
    }
}

#define DEQUANT_TILES(NAME, W)                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        dequant_tiles_##NAME(__nv_bfloat16* __restrict__ out, const u8* __restrict__ w,         \
                             const float* __restrict__ s, u32 n, u32 k) {                      \
        dequant_tiles_body<W>(out, w, s, n, k);                                                 \
    }

DEQUANT_TILES(nvfp4, Nvfp4Tiles)
DEQUANT_TILES(fp8, Fp8Tiles)
