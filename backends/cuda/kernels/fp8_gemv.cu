// Small-M fp8 linear (decode: M <= 16 tokens) on CUDA cores, every family.
// The weight is streamed exactly once in 16-byte chunks and decoded in registers; each decoded
// weight is multiplied by its own block scale (w * sw), so every K-block keeps its scale. The
// activation operand xd [M, ldx] f32 is prepared by fp8nsa_act_quant_* (quantize-dequantize
// xq * sx for Group / Block2d, plain x for None) and is small enough to stay in L1/L2.
// Requires bk % 16 == 0 (a chunk never straddles two K-blocks) and ldw % 16 == 0.
//
// Two forms of one computation:
// - fp8_gemv (up to 8 tokens, dense): threads form groups of `tpg` (a multiple of 32); a group
//   owns ROWS consecutive output rows, its threads split the rows' K chunks, each thread
//   accumulates all MT tokens x ROWS rows, and the group reduces through warp shuffles and
//   shared memory. A CTA of 256 threads holds 256 / tpg groups. The host picks tpg from N and
//   K (build.rs, gemv_launch): wide groups for a few long rows, narrow ones for many short
//   rows, so that few threads idle for lack of chunks and the grid has CTAs enough to keep
//   every SM streaming (the H100 sweep, benches/gpu/gemv_sweep.cu: 1.0-1.3x the CTA form's
//   speed at one and two tokens).
// - fp8_gemv_cta (16 tokens, and the grouped expert form): the CTA is the one group of its
//   ROWS rows, a thread per chunk up to 256.

#include "common.cuh"

struct GemvParams {
    const float* xd;    // [M, ldx] f32, zeros in [K, ldx)
    const uint8_t* w;   // [N, ldw] e4m3, zeros in [K, ldw)
    const float* sw;    // sw[(n / bn) * sw_rs + kb]
    const float* bias;  // [N] or null
    void* out;          // [M, N] in the output type
    int64_t ldx, ldw, sw_rs;
    int M, N, K, bn, bk;
    int tpg;  // fp8_gemv: threads per group of ROWS rows, a multiple of 32 dividing blockDim.x
};

// Word q of a 16-byte chunk.
FP8NSA_DEVICE uint32_t chunk_word(const uint4& v, int q) {
    return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}

template <int MT, int ROWS, typename OutT> FP8NSA_DEVICE void fp8_gemv(const GemvParams& p) {
    const int tpg = p.tpg;
    const int g = threadIdx.x / tpg, t = threadIdx.x % tpg;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpg = tpg >> 5;
    const int n0 = (blockIdx.x * (blockDim.x / tpg) + g) * ROWS;
    const int chunks = (int)((p.K + 15) / 16);  // chunks holding data; the rest are zeros
    float acc[MT][ROWS];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.0f;

#pragma unroll 1
    for (int c = t; c < chunks; c += tpg) {
        const int64_t k = (int64_t)c * 16;
        // 32-bit division (K < 2^31): the 64-bit one calls a subroutine, and registers live
        // across a call spill
        const int kb = c * 16 / p.bk;
        uint4 wv[ROWS];
        float s[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int n = n0 + r;
            if (n < p.N) {
                wv[r] = __ldg(reinterpret_cast<const uint4*>(p.w + (int64_t)n * p.ldw + k));
                s[r] = __ldg(p.sw + (int64_t)(n / p.bn) * p.sw_rs + kb);
            } else {
                wv[r] = make_uint4(0, 0, 0, 0);
                s[r] = 0.0f;
            }
        }
        // Up to 4 tokens: per row, decode four codes and take every token's product (the
        // tokens' activations stay in registers); more tokens: decode every row's four codes
        // first, then load each token's activations once for all rows. Either keeps ptxas
        // within its register budget without spills; each accumulator sums the same terms in
        // the same order.
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            if (MT <= 4) {
                float4 xv[MT];
#pragma unroll
                for (int m = 0; m < MT; ++m)
                    xv[m] = m < p.M ? __ldg(reinterpret_cast<const float4*>(p.xd + (int64_t)m * p.ldx + k) + q)
                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    float wf[4];
                    e4m3x4_to_f32(chunk_word(wv[r], q), wf);
#pragma unroll
                    for (int e = 0; e < 4; ++e) wf[e] *= s[r];
#pragma unroll
                    for (int m = 0; m < MT; ++m)
                        if (m < p.M)
                            acc[m][r] += xv[m].x * wf[0] + xv[m].y * wf[1] + xv[m].z * wf[2] + xv[m].w * wf[3];
                }
            } else {
                float wf[ROWS][4];
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    e4m3x4_to_f32(chunk_word(wv[r], q), wf[r]);
#pragma unroll
                    for (int e = 0; e < 4; ++e) wf[r][e] *= s[r];
                }
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    if (m < p.M) {
                        const float4 xv = __ldg(reinterpret_cast<const float4*>(p.xd + (int64_t)m * p.ldx + k) + q);
#pragma unroll
                        for (int r = 0; r < ROWS; ++r)
                            acc[m][r] += xv.x * wf[r][0] + xv.y * wf[r][1] + xv.z * wf[r][2] + xv.w * wf[r][3];
                    }
                }
            }
        }
    }

    // group reduction: warp sums, then one partial per warp in shared memory
    FP8NSA_SHARED(float, red, [8][MT * ROWS]);
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float v = warp_sum(acc[m][r]);
            if (lane == 0) red[warp][m * ROWS + r] = v;
        }
    __syncthreads();
    for (int i = t; i < MT * ROWS; i += tpg) {
        const int m = i / ROWS, r = i % ROWS, n = n0 + r;
        if (m >= p.M || n >= p.N) continue;
        float v = p.bias != nullptr ? p.bias[n] : 0.0f;
#pragma unroll
        for (int w = 0; w < 8; ++w)
            if (w < wpg) v += red[g * wpg + w][i];
        reinterpret_cast<OutT*>(p.out)[(int64_t)m * p.N + n] = from_f32<OutT>(v);
    }
}

// The CTA is the one group of its ROWS rows (p.tpg unused): the kernel as it first ran on the
// H100, kept for 16 tokens (the group form with 16 accumulators per row makes ptxas spill on
// some targets, and at 16 tokens the kernel is bound by arithmetic, where the shape matters
// little) and for the grouped experts (most CTAs of a grouped launch belong to unrouted experts
// and return at once: fewer, narrower CTAs cost less; the group form measured 0.030 against
// 0.019 ms for a one-token MoE step on the H100). Its chunk loop repeats fp8_gemv's on purpose:
// one shared chunk function changed ptxas's register choices enough to spill on sm_90.
template <int MT, int ROWS, typename OutT> __device__ void fp8_gemv_cta(const GemvParams& p) {
    const int n0 = blockIdx.x * ROWS;  // the CTA is one group: tpg = blockDim.x
    const int chunks = (int)((p.K + 15) / 16);  // chunks holding data; the rest are zeros
    float acc[MT][ROWS];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.0f;

    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        const int64_t k = (int64_t)c * 16;
        const int kb = (int)(k / p.bk);
        uint4 wv[ROWS];
        float s[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int n = n0 + r;
            if (n < p.N) {
                wv[r] = __ldg(reinterpret_cast<const uint4*>(p.w + (int64_t)n * p.ldw + k));
                s[r] = __ldg(p.sw + (int64_t)(n / p.bn) * p.sw_rs + kb);
            } else {
                wv[r] = make_uint4(0, 0, 0, 0);
                s[r] = 0.0f;
            }
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            float wf[ROWS][4];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const uint32_t word = q == 0 ? wv[r].x : q == 1 ? wv[r].y : q == 2 ? wv[r].z : wv[r].w;
                e4m3x4_to_f32(word, wf[r]);
#pragma unroll
                for (int e = 0; e < 4; ++e) wf[r][e] *= s[r];
            }
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                if (m < p.M) {
                    const float4 xv = __ldg(reinterpret_cast<const float4*>(p.xd + (int64_t)m * p.ldx + k) + q);
#pragma unroll
                    for (int r = 0; r < ROWS; ++r)
                        acc[m][r] += xv.x * wf[r][0] + xv.y * wf[r][1] + xv.z * wf[r][2] + xv.w * wf[r][3];
                }
            }
        }
    }

    // CTA reduction: warp sums, then one partial per warp in shared memory
    FP8NSA_SHARED(float, red, [32][MT * ROWS]);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float v = warp_sum(acc[m][r]);
            if (lane == 0) red[warp][m * ROWS + r] = v;
        }
    __syncthreads();
    for (int i = threadIdx.x; i < MT * ROWS; i += blockDim.x) {
        const int m = i / ROWS, r = i % ROWS, n = n0 + r;
        if (m >= p.M || n >= p.N) continue;
        float v = p.bias != nullptr ? p.bias[n] : 0.0f;
        for (int w = 0; w < warps; ++w) v += red[w][i];
        reinterpret_cast<OutT*>(p.out)[(int64_t)m * p.N + n] = from_f32<OutT>(v);
    }
}

// Grouped (mixture-of-experts) form: E experts' weights stacked, token rows grouped by expert
// (expert e owns rows offsets[e] .. offsets[e + 1] of xd and out). One launch for all experts:
// grid.y is the expert, and a CTA of an expert with no rows returns at once, so a decode step
// reads only the routed experts' weights. Groups longer than MT run in chunks of MT tokens,
// each a pass over the CTA's rows (the chunks after the first find them in L2).
struct GroupedGemvParams {
    GemvParams base;  // xd / out over all rows, w / sw of expert 0, bias null; M unused
    const int* offsets;  // [E + 1]
    int64_t w_stride, sw_stride;  // codes / scales between consecutive experts
};

template <int MT, int ROWS, typename OutT> __device__ void fp8_gemv_grouped(const GroupedGemvParams& gp) {
    const int e = blockIdx.y;
    const int r0 = gp.offsets[e], r1 = gp.offsets[e + 1];
    GemvParams p = gp.base;
    p.w += e * gp.w_stride;
    p.sw += e * gp.sw_stride;
    for (int t0 = r0; t0 < r1; t0 += MT) {
        p.xd = gp.base.xd + (int64_t)t0 * p.ldx;
        p.out = reinterpret_cast<OutT*>(gp.base.out) + (int64_t)t0 * p.N;
        p.M = min(MT, r1 - t0);
        fp8_gemv_cta<MT, ROWS, OutT>(p);
        __syncthreads();  // the next chunk reuses the reduction's shared memory
    }
}

#define GEMV(NAME, MT, ROWS, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(256) NAME(const GemvParams p) {                 \
        if (MT > 8)                                                                              \
            fp8_gemv_cta<MT, ROWS, T>(p);                                                        \
        else                                                                                     \
            fp8_gemv<MT, ROWS, T>(p);                                                            \
    }                                                                                           \
    FP8NSA_REGISTER(NAME)
// (tokens up to MT, ROWS rows per group): up to 8 tokens 4 rows (the H100 sweep's best at one
// token, within 10% of 8 rows at four, and without spills), 16 tokens 2 rows per CTA.
#define GEMV_TYPES(SUFFIX, T)                                                                    \
    GEMV(fp8nsa_fp8_gemv_m1_##SUFFIX, 1, 4, T)                                                   \
    GEMV(fp8nsa_fp8_gemv_m2_##SUFFIX, 2, 4, T)                                                   \
    GEMV(fp8nsa_fp8_gemv_m4_##SUFFIX, 4, 4, T)                                                   \
    GEMV(fp8nsa_fp8_gemv_m8_##SUFFIX, 8, 4, T)                                                   \
    GEMV(fp8nsa_fp8_gemv_m16_##SUFFIX, 16, 2, T)
#define GROUPED_GEMV(NAME, MT, ROWS, T)                                                          \
    extern "C" __global__ void __launch_bounds__(256) NAME(const GroupedGemvParams p) {          \
        fp8_gemv_grouped<MT, ROWS, T>(p);                                                        \
    }                                                                                           \
    FP8NSA_REGISTER(NAME)
#define GROUPED_GEMV_TYPES(SUFFIX, T)                                                            \
    GROUPED_GEMV(fp8nsa_fp8_grouped_gemv_m1_##SUFFIX, 1, 8, T)                                   \
    GROUPED_GEMV(fp8nsa_fp8_grouped_gemv_m2_##SUFFIX, 2, 8, T)                                   \
    GROUPED_GEMV(fp8nsa_fp8_grouped_gemv_m4_##SUFFIX, 4, 8, T)                                   \
    GROUPED_GEMV(fp8nsa_fp8_grouped_gemv_m8_##SUFFIX, 8, 4, T)                                   \
    GROUPED_GEMV(fp8nsa_fp8_grouped_gemv_m16_##SUFFIX, 16, 2, T)
GEMV_TYPES(f32, float)
GEMV_TYPES(bf16, __nv_bfloat16)
GEMV_TYPES(f16, __half)
GROUPED_GEMV_TYPES(f32, float)
GROUPED_GEMV_TYPES(bf16, __nv_bfloat16)
GROUPED_GEMV_TYPES(f16, __half)
