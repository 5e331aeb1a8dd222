// Block-scaled fp8 GEMM on tensor cores (mma.sync m16n8k32 e4m3, sm_89+):
//   y[m, n] = sum_kb sx(m, kb) * sw(n, kb) * sum_{k in kb} xq[m, k] * w[n, k]  (+ bias[n])
// Each 128-wide K tile accumulates into a fresh partial, which is then scaled by its K-block's
// sx * sw in registers and added to the f32 output accumulator, so any block shape with
// bk % 128 == 0 (128x128, 256x256, 512x512, 64x128, ...) gets its own scales.
// Operands stream through a multi-stage cp.async pipeline into XOR-swizzled shared memory and
// reach the MMAs through ldmatrix. Rows and columns past M / N are zero-filled, never read.
// K: both operands have row strides that are multiples of 16 with zeros in [K, ld), so whole
// 16-byte chunks below ld are valid; chunks at or past ld are zero-filled.
// Split-K (grid.z > 1) writes f32 partials to `ws`, reduced by fp8nsa_splitk_reduce_*.

#include "common.cuh"

struct GemmParams {
    const uint8_t* xq;  // [M, ldq] e4m3
    const float* sx;    // scale of row m, k-block kb: sx[(m / bm_act) * sx_rs + kb * sx_cs]
    const uint8_t* w;   // [N, ldw] e4m3
    const float* sw;    // scale of row n, k-block kb: sw[(n / bn) * sw_rs + kb]
    const float* bias;  // [N] or null
    void* out;          // [M, N] in the output type (splits == 1)
    float* ws;          // [splits, M, N] f32 (splits > 1)
    int64_t ldq, ldw, sx_rs, sx_cs, sw_rs;
    int M, N, K, bm_act, bn, bk, kb_per_split, splits;
};

#if defined(FP8NSA_HAS_FP8_MMA)

constexpr int BK = 128;  // bytes of K per pipeline stage (one row = 8 chunks of 16 bytes)

// Byte offset of 16-byte chunk `c` of tile row `r`: chunks are XOR-swizzled by r % 8 so that
// the 8 rows read by one ldmatrix phase land in 8 different bank groups.
__device__ __forceinline__ int swz(int r, int c) { return r * BK + ((c ^ (r & 7)) << 4); }

template <typename T> __device__ __forceinline__ void store2(T* p, float a, float b, bool pair) {
    p[0] = from_f32<T>(a);
    if (pair) p[1] = from_f32<T>(b);
}

// `mtile`: the CTA's tile of M (blockIdx.y for one weight; the tile within its expert's group
// for the grouped form).
template <int BM, int BN, int WM, int WN, int STAGES, typename OutT>
__device__ void fp8_gemm(const GemmParams& p, int mtile) {
    constexpr int THREADS = WM * WN * 32;
    constexpr int TM = BM / WM, TN = BN / WN;  // warp tile
    constexpr int MI = TM / 16, NI = TN / 8;   // MMA tiles per warp
    static_assert(TM % 16 == 0 && TN % 16 == 0, "warp tile must be a multiple of 16 x 16");
    constexpr int STAGE_BYTES = (BM + BN) * BK;

    FP8NSA_DYNAMIC_SMEM(uint4, smem_raw);
    uint8_t* smem = reinterpret_cast<uint8_t*>(smem_raw);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    const int g = lane >> 2, t4 = lane & 3;
    const int m_block = mtile * BM, n_block = blockIdx.x * BN;

    const int KB = (p.K + p.bk - 1) / p.bk;
    const int kb0 = blockIdx.z * p.kb_per_split;
    const int kb1 = min(KB, kb0 + p.kb_per_split);
    const int tiles_per_kb = p.bk / BK;
    const int64_t k_begin = (int64_t)kb0 * p.bk;
    // tiles wholly past K hold zeros only: skip them
    int nk = kb1 > kb0 ? (kb1 - kb0) * tiles_per_kb : 0;
    nk = min(nk, (int)((p.K - k_begin + BK - 1) / BK));
    if (nk < 0) nk = 0;

    auto load_tile = [&](int t, int stage) {
        uint8_t* a_s = smem + stage * STAGE_BYTES;
        uint8_t* b_s = a_s + BM * BK;
        const int64_t k0 = k_begin + (int64_t)t * BK;
        for (int i = tid; i < BM * 8; i += THREADS) {
            const int r = i >> 3, c = i & 7;
            const int m = m_block + r;
            const int64_t k = k0 + c * 16;
            const bool ok = m < p.M && k < p.ldq;
            cp_async_16(a_s + swz(r, c), ok ? p.xq + (int64_t)m * p.ldq + k : p.xq, ok);
        }
        for (int i = tid; i < BN * 8; i += THREADS) {
            const int r = i >> 3, c = i & 7;
            const int n = n_block + r;
            const int64_t k = k0 + c * 16;
            const bool ok = n < p.N && k < p.ldw;
            cp_async_16(b_s + swz(r, c), ok ? p.w + (int64_t)n * p.ldw + k : p.w, ok);
        }
    };

    float acc[MI][NI][4];
    float part[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = part[i][j][e] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nk) load_tile(s, s);
        cp_async_commit();
    }

    for (int t = 0; t < nk; ++t) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        // refill the stage consumed one iteration ago (every thread is past it: the barrier)
        if (t + STAGES - 1 < nk) load_tile(t + STAGES - 1, (t + STAGES - 1) % STAGES);
        cp_async_commit();

        const uint8_t* a_s = smem + (t % STAGES) * STAGE_BYTES;
        const uint8_t* b_s = a_s + BM * BK;
        // one k-step at a time: each has MI x NI independent MMAs, and unrolling the four
        // lets sm_90's scheduler hoist every fragment load and spill
#pragma unroll 1
        for (int ks = 0; ks < BK / 32; ++ks) {
            uint32_t af[MI][4], bf[NI][2];
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                // matrices: rows 0-7 / 8-15 (lane bit 3) x k bytes 0-15 / 16-31 (lane bit 4)
                const int r = wm * TM + i * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                const int c = ks * 2 + (lane >> 4);
                ldmatrix_x4(af[i], a_s + swz(r, c));
            }
#pragma unroll
            for (int j = 0; j < NI; j += 2) {
                // matrices: (n 0-7, k lo), (n 0-7, k hi), (n 8-15, k lo), (n 8-15, k hi)
                const int r = wn * TN + j * 8 + (lane & 7) + (lane >> 4) * 8;
                const int c = ks * 2 + ((lane >> 3) & 1);
                uint32_t q[4];
                ldmatrix_x4(q, b_s + swz(r, c));
                bf[j][0] = q[0];
                bf[j][1] = q[1];
                bf[j + 1][0] = q[2];
                bf[j + 1][1] = q[3];
            }
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int j = 0; j < NI; ++j) mma_e4m3_16832(part[i][j], af[i], bf[j]);
        }

        // every 128-wide K tile: scale the tensor-core partial by its K-block's scales and add
        // it in f32 (Hopper's fp8 MMA accumulates with reduced precision, so partials never
        // span more than 128 K, whatever the block)
        {
            const int kb = kb0 + t / tiles_per_kb;
            float sxv[MI][2];
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int m = m_block + wm * TM + i * 16 + g + h * 8;
                    sxv[i][h] = m < p.M ? p.sx[(int64_t)(m / p.bm_act) * p.sx_rs + kb * p.sx_cs] : 0.0f;
                }
#pragma unroll
            for (int j = 0; j < NI; ++j) {
                const int n = n_block + wn * TN + j * 8 + t4 * 2;
                const float sw0 = n < p.N ? p.sw[(int64_t)(n / p.bn) * p.sw_rs + kb] : 0.0f;
                const float sw1 = n + 1 < p.N ? p.sw[(int64_t)((n + 1) / p.bn) * p.sw_rs + kb] : 0.0f;
#pragma unroll
                for (int i = 0; i < MI; ++i) {
                    acc[i][j][0] += part[i][j][0] * (sxv[i][0] * sw0);
                    acc[i][j][1] += part[i][j][1] * (sxv[i][0] * sw1);
                    acc[i][j][2] += part[i][j][2] * (sxv[i][1] * sw0);
                    acc[i][j][3] += part[i][j][3] * (sxv[i][1] * sw1);
#pragma unroll
                    for (int e = 0; e < 4; ++e) part[i][j][e] = 0.0f;
                }
            }
        }
    }
    cp_async_wait<0>();

    // epilogue: (row g, cols 2t, 2t+1) and (row g + 8, same cols) of every MMA tile
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int m = m_block + wm * TM + i * 16 + g + h * 8;
            if (m >= p.M) continue;
#pragma unroll
            for (int j = 0; j < NI; ++j) {
                const int n = n_block + wn * TN + j * 8 + t4 * 2;
                if (n >= p.N) continue;
                const bool pair = n + 1 < p.N;
                float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
                if (p.splits > 1) {
                    float* dst = p.ws + ((int64_t)blockIdx.z * p.M + m) * p.N + n;
                    dst[0] = v0;
                    if (pair) dst[1] = v1;
                } else {
                    if (p.bias != nullptr) {
                        v0 += p.bias[n];
                        if (pair) v1 += p.bias[n + 1];
                    }
                    store2(reinterpret_cast<OutT*>(p.out) + (int64_t)m * p.N + n, v0, v1, pair);
                }
            }
        }
}

#define GEMM(NAME, BM, BN, WM, WN, ST, T)                                                       \
    extern "C" __global__ void __launch_bounds__(WM * WN * 32) NAME(const GemmParams p) {       \
        fp8_gemm<BM, BN, WM, WN, ST, T>(p, blockIdx.y);                                         \
    }                                                                                           \
    FP8NSA_REGISTER(NAME)

// Grouped (mixture-of-experts) form: E experts' weights stacked, token rows grouped by expert
// (expert e owns rows offsets[e] .. offsets[e + 1] of xq and out). One launch for all experts:
// grid.y counts the row tiles of every group, expert by expert (the host sizes it from the
// same counts), and each CTA finds its expert by walking the offsets. Activation scale rows
// restart at every expert (Block2d row blocks never straddle two groups): expert e's start
// after sum_{i<e} ceil(count_i / bm_act) rows. No K split.
struct GroupedGemmParams {
    GemmParams base;  // xq / sx / out over all rows, w / sw of expert 0, bias null; M unused
    const int* offsets;  // [E + 1]
    int64_t w_stride, sw_stride;  // codes / scales between consecutive experts
    int experts;
};

template <int BM, int BN, int WM, int WN, int STAGES, typename OutT>
__device__ void fp8_gemm_grouped(const GroupedGemmParams& gp) {
    int tile = blockIdx.y, e = 0, srow = 0, rows = 0;
    for (;; ++e) {
        if (e == gp.experts) return;  // past the last group's tiles
        rows = gp.offsets[e + 1] - gp.offsets[e];
        const int tiles = (rows + BM - 1) / BM;
        if (tile < tiles) break;
        tile -= tiles;
        srow += (rows + gp.base.bm_act - 1) / gp.base.bm_act;
    }
    const int r0 = gp.offsets[e];
    GemmParams p = gp.base;
    p.xq += (int64_t)r0 * p.ldq;
    p.sx += (int64_t)srow * p.sx_rs;
    p.w += e * gp.w_stride;
    p.sw += e * gp.sw_stride;
    p.out = reinterpret_cast<OutT*>(gp.base.out) + (int64_t)r0 * p.N;
    p.M = rows;
    fp8_gemm<BM, BN, WM, WN, STAGES, OutT>(p, tile);
}

#define GROUPED_GEMM(NAME, BM, BN, WM, WN, ST, T)                                               \
    extern "C" __global__ void __launch_bounds__(WM * WN * 32) NAME(const GroupedGemmParams p) { \
        fp8_gemm_grouped<BM, BN, WM, WN, ST, T>(p);                                             \
    }                                                                                           \
    FP8NSA_REGISTER(NAME)

// (BM, BN, warps M x N, stages): large M, medium M, and M <= 16 (decode batches, split-K).
// 3 stages of the large tile take 96 KB of shared memory, within sm_89's 99 KB.
#define GEMM_TYPES(SUFFIX, T)                                                                   \
    GEMM(fp8nsa_fp8_gemm_128x128_##SUFFIX, 128, 128, 2, 4, 3, T)                                \
    GEMM(fp8nsa_fp8_gemm_64x128_##SUFFIX, 64, 128, 2, 2, 4, T)                                  \
    GEMM(fp8nsa_fp8_gemm_16x128_##SUFFIX, 16, 128, 1, 4, 4, T)
GEMM_TYPES(f32, float)
GEMM_TYPES(bf16, __nv_bfloat16)
GEMM_TYPES(f16, __half)
#define GROUPED_GEMM_TYPES(SUFFIX, T)                                                           \
    GROUPED_GEMM(fp8nsa_fp8_grouped_gemm_128x128_##SUFFIX, 128, 128, 2, 4, 3, T)                \
    GROUPED_GEMM(fp8nsa_fp8_grouped_gemm_64x128_##SUFFIX, 64, 128, 2, 2, 4, T)                  \
    GROUPED_GEMM(fp8nsa_fp8_grouped_gemm_16x128_##SUFFIX, 16, 128, 1, 4, 4, T)
GROUPED_GEMM_TYPES(f32, float)
GROUPED_GEMM_TYPES(bf16, __nv_bfloat16)
GROUPED_GEMM_TYPES(f16, __half)

#endif  // FP8NSA_HAS_FP8_MMA
