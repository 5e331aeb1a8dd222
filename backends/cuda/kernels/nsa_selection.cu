// NSA selection attention (flash-attention style, mma.sync m16n8k16 bf16/f16, f32 softmax).
//
// One CTA per (query token, kv head, split). Its warps own 16 query heads each: the G heads of
// the kv head, padded to 16, form the MMA rows, so every key loaded is shared by all G heads.
// The CTA first turns its selection row into spans: block ids (a token is a block of one) or
// [start, end) ranges, clamped to the keys the query may see ([0, min(k_len, pos + 1))),
// sorted (bitonic, all threads) and merged (warp 0), so whatever the indices say nothing is
// read out of bounds and every key counts once. The spans' keys are then packed end to end
// and walked in tiles of KT keys, a tile taking keys of several spans where they are short
// (2048 single tokens are 64 full tiles, not 2048 mostly empty ones); K/V tiles are
// double-buffered with cp.async, online softmax in f32 (base 2). Keys are read from a
// token-packed k / v, or from a page pool through a block table (pages of any size; a page id
// outside the pool is clamped into it, never read past it; callers check tables on the host).
// With splits > 1 (decode) each split takes a share of the tiles and writes f32 partials
// (normalized o and lse) that fp8nsa_nsa_merge_* combines with the log-sum-exp.

#include "common.cuh"

#include <math_constants.h>

struct NsaParams {
    const void* q;      // [total_q, hq, d]
    const void* k;      // [total_k, hkv, d]
    const void* v;      // [total_k, hkv, dv]
    const int* sel;     // blocks [total_q * hkv, per_row] or ranges [total_q * hkv, per_row, 2]
    const int* cu_q;    // [batch + 1] token offsets of the queries
    const int* cu_k;    // [batch + 1] token offsets of the keys
    const int* q_off;   // [batch] absolute position of each sequence's first query
    void* o;            // [total_q, hq, dv] (splits == 1)
    float* lse;         // [total_q, hq] natural log (splits == 1)
    float* ws_o;        // [splits, total_q, hq, dv] f32 (splits > 1)
    float* ws_lse;      // [splits, total_q, hq] (splits > 1)
    float scale_log2;   // softmax scale * log2(e)
    int total_q, batch, hq, hkv, per_row, block_size /* 0: ranges */, splits;
    // page_size > 0: k and v are page pools [num_pages * page_size, hkv, *] and key j of
    // sequence b is row table[b * max_pages + j / page_size] * page_size + j % page_size
    // (cu_k then only gives each sequence's length)
    const int* table;
    int max_pages, page_size, num_pages;
};

constexpr int KT = 32;            // keys per tile
constexpr int MAX_PER_ROW = 2048; // selection entries per row the CTA can normalize

// Span slots for `per_row` entries: a power of two (the bitonic sort), at least 32 (the merge
// gives each lane of a warp an equal share).
__device__ __forceinline__ int span_cap(int per_row) {
    int cap = 32;
    while (cap < per_row && cap < MAX_PER_ROW) cap <<= 1;
    return cap;
}

template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float d[4], const uint32_t a[4], const uint32_t b[2]) {
        mma_bf16_16816(d, a, b);
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return pack_bf16x2(lo, hi); }
    static constexpr uint32_t EXP = 0x7F80u;  // exponent bits: all ones for NaN and Inf
};
template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float d[4], const uint32_t a[4], const uint32_t b[2]) {
        mma_f16_16816(d, a, b);
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return pack_f16x2(lo, hi); }
    static constexpr uint32_t EXP = 0x7C00u;
};

// Whether either 16-bit float of `w` is NaN or Inf.
template <typename T> __device__ __forceinline__ bool non_finite2(uint32_t w) {
    constexpr uint32_t E = Mma<T>::EXP;
    return (w & E) == E || ((w >> 16) & E) == E;
}

// Byte offset of 16-byte chunk c of row r in a tile with `chunks` chunks per row; XOR swizzle
// on the low three chunk bits (ldmatrix reads 8 rows of one chunk column conflict-free).
__device__ __forceinline__ int tswz(int r, int c, int chunks) { return (r * chunks + (c ^ (r & 7))) << 4; }

template <typename T, int D, int DV, int NW> __device__ void nsa_selection(const NsaParams& p) {
    constexpr int THREADS = NW * 32;
    constexpr int DC = D / 8, VC = DV / 8;  // 16-byte chunks per K / V row
    constexpr int K_TILE = KT * D * 2, V_TILE = KT * DV * 2;
    static_assert(D % 16 == 0 && DV % 16 == 0, "head dims must be multiples of 16");

    FP8NSA_DYNAMIC_SMEM(uint4, smem_raw);
    uint8_t* smem = reinterpret_cast<uint8_t*>(smem_raw);
    // The row's spans and the packed key count up to each (inclusive), span_cap(per_row)
    // slots, then 2 x (K tile, V tile) at a 16-byte-aligned offset. (Spans after the tiles
    // made sm_90's ptxas spill.)
    const int cap = span_cap(p.per_row);
    int2* spans = reinterpret_cast<int2*>(smem);                // [cap]
    int* key_end = reinterpret_cast<int*>(spans + cap);         // [cap]
    uint8_t* kv = smem + cap * 12;                              // cap * 12 is a multiple of 16
    // the merge's scratch, before any tile is loaded
    static_assert(2 * (K_TILE + V_TILE) >= MAX_PER_ROW * 8, "merge scratch fits the tiles");
    FP8NSA_SHARED(int, n_spans);
    FP8NSA_SHARED(int, n_keys);
    FP8NSA_SHARED(int, lane_acc, [32]);
    FP8NSA_SHARED(int64_t, tile_rows, [2][KT]);  // each stage's key rows in k / v, -1 past the end

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int G = p.hq / p.hkv;
    const int item = blockIdx.x;  // token * hkv + head
    const int tok = item / p.hkv, h = item % p.hkv;
    const int split = blockIdx.y;

    // the token's sequence: last b with cu_q[b] <= tok
    int lo = 0, hi = p.batch - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (p.cu_q[mid] <= tok) lo = mid; else hi = mid - 1;
    }
    const int seq = lo;
    const int64_t k_start = p.cu_k[seq];
    const int k_len = p.cu_k[seq + 1] - p.cu_k[seq];
    const int64_t pos = (int64_t)p.q_off[seq] + (tok - p.cu_q[seq]);
    const int limit = (int)min((int64_t)k_len, pos + 1);  // keys [0, limit) are visible

    // ---- selection row -> clamped spans (empty ones INT_MAX, sorted to the end)
    {
        const int* row = p.sel + (int64_t)item * p.per_row * (p.block_size > 0 ? 1 : 2);
        const int n = min(p.per_row, MAX_PER_ROW);
        for (int e = tid; e < cap; e += THREADS) {
            int2 span = make_int2(INT_MAX, INT_MAX);
            if (e < n) {
                int64_t a, b;
                if (p.block_size > 0) {
                    const int idx = row[e];
                    a = (int64_t)idx * p.block_size;
                    b = a + p.block_size;
                    if (idx < 0) a = b = 0;
                } else {
                    a = row[2 * e];
                    b = row[2 * e + 1];
                }
                a = max(a, (int64_t)0);
                b = min(b, (int64_t)limit);
                if (a < b) span = make_int2((int)a, (int)b);
            }
            spans[e] = span;
        }
        __syncthreads();
        // bitonic sort by start
        for (int k = 2; k <= cap; k <<= 1)
            for (int j = k >> 1; j > 0; j >>= 1) {
                for (int i = tid; i < cap; i += THREADS) {
                    const int l = i ^ j;
                    if (l > i) {
                        const int2 x = spans[i], y = spans[l];
                        if ((x.x > y.x) == ((i & k) == 0)) {
                            spans[i] = y;
                            spans[l] = x;
                        }
                    }
                }
                __syncthreads();
            }
    }
    // ---- merge overlapping or touching spans (warp 0, each lane `c` consecutive slots): a
    // span starts a merged one when it begins past every earlier span's end
    if (warp == 0) {
        const int c = cap / 32, e0 = lane * c;
        int2* merged = reinterpret_cast<int2*>(kv);
        // the furthest end of this lane's spans, then of all earlier lanes'
        int reach = -1;
        for (int e = e0; e < e0 + c && spans[e].x != INT_MAX; ++e) reach = max(reach, spans[e].y);
        lane_acc[lane] = reach;
        __syncwarp();
        int before = -1;
        for (int l = 0; l < lane; ++l) before = max(before, lane_acc[l]);
        // merged spans starting in this lane's slots, then the count before this lane
        int starts = 0;
        reach = before;
        for (int e = e0; e < e0 + c && spans[e].x != INT_MAX; ++e) {
            starts += spans[e].x > reach;
            reach = max(reach, spans[e].y);
        }
        __syncwarp();
        lane_acc[lane] = starts;
        __syncwarp();
        int out = 0;
        for (int l = 0; l < lane; ++l) out += lane_acc[l];
        reach = before;
        out -= 1;  // index of the merged span being extended
        for (int e = e0; e < e0 + c && spans[e].x != INT_MAX; ++e) {
            if (spans[e].x > reach) merged[++out].x = spans[e].x;
            reach = max(reach, spans[e].y);
            // the merged span ends here when the next slot is empty or starts a new one
            if (e + 1 == cap || spans[e + 1].x > reach) merged[out].y = reach;
        }
        __syncwarp();
        int ns = 0;
        for (int l = 0; l < 32; ++l) ns += lane_acc[l];
        // copy back with the packed key count up to each merged span
        int keys = 0;
        for (int i = e0; i < min(e0 + c, ns); ++i) keys += merged[i].y - merged[i].x;
        __syncwarp();
        lane_acc[lane] = keys;
        __syncwarp();
        int run = 0;
        for (int l = 0; l < lane; ++l) run += lane_acc[l];
        for (int i = e0; i < min(e0 + c, ns); ++i) {
            spans[i] = merged[i];
            run += merged[i].y - merged[i].x;
            key_end[i] = run;
        }
        if (lane == 31) {
            n_spans = ns;
            n_keys = run;
        }
    }
    __syncthreads();
    const int ns = n_spans, total_keys = n_keys;
    const int total_tiles = (total_keys + KT - 1) / KT;
    const int t_begin = (int)((int64_t)total_tiles * split / p.splits);
    const int t_end = (int)((int64_t)total_tiles * (split + 1) / p.splits);

    // packed key pk (pk < total_keys) -> its row in k / v
    auto key_row = [&](int pk) -> int64_t {
        int a = 0, b = ns - 1;
        while (a < b) {
            const int mid = (a + b) >> 1;
            if (key_end[mid] <= pk) a = mid + 1; else b = mid;
        }
        const int key = spans[a].y - (key_end[a] - pk);
        if (p.page_size == 0) return k_start + key;
        const int slot = min(key / p.page_size, p.max_pages - 1);
        const int page = min(max(p.table[(int64_t)seq * p.max_pages + slot], 0), p.num_pages - 1);
        return (int64_t)page * p.page_size + key % p.page_size;
    };

    const T* kg = reinterpret_cast<const T*>(p.k);
    const T* vg = reinterpret_cast<const T*>(p.v);
    auto load_tile = [&](int t, int stage) {
        const int first = t * KT, len = min(KT, total_keys - first);
        if (tid < KT) tile_rows[stage][tid] = tid < len ? key_row(first + tid) : -1;
        __syncthreads();
        uint8_t* ks = kv + stage * (K_TILE + V_TILE);
        uint8_t* vs = ks + K_TILE;
        for (int i = tid; i < KT * DC; i += THREADS) {
            const int r = i / DC, c = i % DC;
            const int64_t kr = tile_rows[stage][r];
            const T* src = kg + ((kr >= 0 ? kr : 0) * p.hkv + h) * D + c * 8;
            cp_async_16(ks + tswz(r, c, DC), src, kr >= 0);
        }
        for (int i = tid; i < KT * VC; i += THREADS) {
            const int r = i / VC, c = i % VC;
            const int64_t kr = tile_rows[stage][r];
            const T* src = vg + ((kr >= 0 ? kr : 0) * p.hkv + h) * DV + c * 8;
            cp_async_16(vs + tswz(r, c, VC), src, kr >= 0);
        }
    };

    // ---- Q fragments of this warp's 16 heads, straight from global memory
    const T* qg = reinterpret_cast<const T*>(p.q);
    const int head0 = warp * 16;  // within the group
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = head0 + g + (r & 1) * 8;         // a0/a2: row g, a1/a3: row g + 8
            const int col = kk * 16 + t4 * 2 + (r >> 1) * 8;  // a0/a1: k lo, a2/a3: k hi
            qf[kk][r] = row < G ? *reinterpret_cast<const uint32_t*>(
                                      qg + ((int64_t)tok * p.hq + h * G + row) * D + col)
                                : 0u;
        }

    float o[DV / 8][4];
#pragma unroll
    for (int j = 0; j < DV / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[j][e] = 0.0f;
    float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F}, l_run[2] = {0.0f, 0.0f};

    if (t_begin < t_end) load_tile(t_begin, 0);
    cp_async_commit();
    for (int t = t_begin; t < t_end; ++t) {
        const int stage = (t - t_begin) & 1;
        if (t + 1 < t_end) load_tile(t + 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        const uint8_t* ks = kv + stage * (K_TILE + V_TILE);
        const uint8_t* vs = ks + K_TILE;
        // A non-finite element in an attended key makes the row NaN (docs/nsa.md): a score of
        // -inf would otherwise vanish as exp2(-inf) = 0. Every row of the tile is attended
        // (rows past the row's last key are zero-filled), and so by every head of the CTA: each thread
        // checks the key chunks it copied (visible to it after its wait), and the barrier the
        // tile needs anyway ORs the answers. Off the score loop, where registers are tight.
        bool bad_key = false;
        for (int i = tid; i < KT * DC; i += THREADS) {
            const uint4 w = *reinterpret_cast<const uint4*>(ks + tswz(i / DC, i % DC, DC));
            bad_key |= non_finite2<T>(w.x) | non_finite2<T>(w.y) | non_finite2<T>(w.z) |
                       non_finite2<T>(w.w);
        }
        if (__syncthreads_or(bad_key)) {
            l_run[0] = CUDART_NAN_F;
            l_run[1] = CUDART_NAN_F;
        }

        const int len = min(KT, total_keys - t * KT);  // keys in this tile; the rest masked

        // S = Q K^T: 16 heads x KT keys
        float s[KT / 8][4];
#pragma unroll
        for (int j = 0; j < KT / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
            for (int j = 0; j < KT / 8; j += 2) {
                // matrices: (keys 0-7, dims lo), (keys 0-7, dims hi), (keys 8-15, lo), (8-15, hi)
                const int r = j * 8 + (lane & 7) + (lane >> 4) * 8;
                const int c = kk * 2 + ((lane >> 3) & 1);
                uint32_t b[4];
                ldmatrix_x4(b, ks + tswz(r, c, DC));
                Mma<T>::run(s[j], qf[kk], b);
                Mma<T>::run(s[j + 1], qf[kk], b + 2);
            }

        // online softmax over this tile (rows g and g + 8 of the warp's heads)
        float mx[2] = {-CUDART_INF_F, -CUDART_INF_F};
#pragma unroll
        for (int j = 0; j < KT / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = j * 8 + t4 * 2 + (e & 1);
                const float x = key < len ? s[j][e] * p.scale_log2 : -CUDART_INF_F;
                s[j][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        float corr[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float m_new = fmaxf(m_run[r], mx[r]);
            const float base = m_new == -CUDART_INF_F ? 0.0f : m_new;  // no inf - inf
            corr[r] = exp2f(m_run[r] - base);
            m_run[r] = m_new;
            mx[r] = base;
        }
        float rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < KT / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[j][e] = exp2f(s[j][e] - mx[e >> 1]);
                rs[e >> 1] += s[j][e];
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 1);
            rs[r] += __shfl_xor_sync(0xffffffffu, rs[r], 2);
            l_run[r] = l_run[r] * corr[r] + rs[r];
        }
#pragma unroll
        for (int j = 0; j < DV / 8; ++j) {
            o[j][0] *= corr[0];
            o[j][1] *= corr[0];
            o[j][2] *= corr[1];
            o[j][3] *= corr[1];
        }

        // O += P V: P's accumulator layout is the A layout of the next MMA (keys as k)
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {
            uint32_t a[4];
            a[0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
            a[1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
            a[2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int j = 0; j < DV / 8; j += 2) {
                // transposed matrices: (keys 0-7, dv lo), (keys 8-15, dv lo), (0-7, hi), (8-15, hi)
                const int r = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                const int c = j + (lane >> 4);
                uint32_t b[4];
                ldmatrix_x4_trans(b, vs + tswz(r, c, VC));
                Mma<T>::run(o[j], a, b);
                Mma<T>::run(o[j + 1], a, b + 2);
            }
        }
        __syncthreads();  // the next iteration refills this stage
    }
    cp_async_wait<0>();

    // ---- epilogue: normalize, natural-log lse; a row that saw nothing gets o = 0, lse = -inf
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = head0 + g + r * 8;
        if (row >= G) continue;
        const int64_t qh = (int64_t)tok * p.hq + h * G + row;
        // l = 0 only when the row saw nothing; a NaN l (NaN query, non-finite attended key)
        // stays NaN rather than reading as "saw nothing"
        const float inv = l_run[r] != 0.0f ? 1.0f / l_run[r] : 0.0f;
        const float lse = l_run[r] != 0.0f ? (m_run[r] + log2f(l_run[r])) * CUDART_LN2_F : -CUDART_INF_F;
        if (p.splits > 1) {
            float* dst = p.ws_o + ((int64_t)split * p.total_q * p.hq + qh) * DV;
#pragma unroll
            for (int j = 0; j < DV / 8; ++j) {
                dst[j * 8 + t4 * 2] = o[j][2 * r] * inv;
                dst[j * 8 + t4 * 2 + 1] = o[j][2 * r + 1] * inv;
            }
            if (t4 == 0) p.ws_lse[(int64_t)split * p.total_q * p.hq + qh] = lse;
        } else {
            T* dst = reinterpret_cast<T*>(p.o) + qh * DV;
#pragma unroll
            for (int j = 0; j < DV / 8; ++j) {
                dst[j * 8 + t4 * 2] = from_f32<T>(o[j][2 * r] * inv);
                dst[j * 8 + t4 * 2 + 1] = from_f32<T>(o[j][2 * r + 1] * inv);
            }
            if (t4 == 0) p.lse[qh] = lse;
        }
    }
}

#define NSA(NAME, T, D, DV, NW)                                                                  \
    extern "C" __global__ void __launch_bounds__(NW * 32) NAME(const NsaParams p) {              \
        nsa_selection<T, D, DV, NW>(p);                                                          \
    }                                                                                           \
    FP8NSA_REGISTER(NAME)
#define NSA_WARPS(SUFFIX, T, D, DV)                                                              \
    NSA(fp8nsa_nsa_selection_##SUFFIX##_d##D##_dv##DV##_w1, T, D, DV, 1)                         \
    NSA(fp8nsa_nsa_selection_##SUFFIX##_d##D##_dv##DV##_w2, T, D, DV, 2)                         \
    NSA(fp8nsa_nsa_selection_##SUFFIX##_d##D##_dv##DV##_w4, T, D, DV, 4)
#define NSA_DIMS(SUFFIX, T)                                                                      \
    NSA_WARPS(SUFFIX, T, 64, 64)                                                                 \
    NSA_WARPS(SUFFIX, T, 64, 128)                                                                \
    NSA_WARPS(SUFFIX, T, 128, 64)                                                                \
    NSA_WARPS(SUFFIX, T, 128, 128)                                                               \
    NSA_WARPS(SUFFIX, T, 192, 64)                                                                \
    NSA_WARPS(SUFFIX, T, 192, 128)
NSA_DIMS(bf16, __nv_bfloat16)
NSA_DIMS(f16, __half)

// Combines the splits of every (token, head) row: lse = log sum_s exp(lse_s),
// o = sum_s exp(lse_s - lse) o_s. Splits that saw nothing have lse_s = -inf and weigh 0.
template <typename T>
__device__ void nsa_merge(const float* __restrict__ ws_o, const float* __restrict__ ws_lse,
                          T* __restrict__ o, float* __restrict__ lse, int rows, int dv, int splits) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    float m = -CUDART_INF_F;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, ws_lse[(int64_t)s * rows + row]);
    float sum = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float l = ws_lse[(int64_t)s * rows + row];
        sum += l == -CUDART_INF_F ? 0.0f : expf(l - m);
    }
    // a NaN split lse makes sum NaN, and the row NaN (not "saw nothing")
    const float total = sum != 0.0f ? m + logf(sum) : -CUDART_INF_F;
    for (int c = threadIdx.x; c < dv; c += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const float l = ws_lse[(int64_t)s * rows + row];
            if (l != -CUDART_INF_F) acc += expf(l - total) * ws_o[((int64_t)s * rows + row) * dv + c];
        }
        o[(int64_t)row * dv + c] = from_f32<T>(acc);
    }
    if (threadIdx.x == 0) lse[row] = total;
}

#define MERGE(NAME, T)                                                                           \
    extern "C" __global__ void NAME(const float* ws_o, const float* ws_lse, T* o, float* lse,    \
                                    int rows, int dv, int splits) {                              \
        nsa_merge<T>(ws_o, ws_lse, o, lse, rows, dv, splits);                                    \
    }                                                                                           \
    FP8NSA_REGISTER(NAME)
MERGE(fp8nsa_nsa_merge_bf16, __nv_bfloat16)
MERGE(fp8nsa_nsa_merge_f16, __half)
