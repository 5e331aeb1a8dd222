// Small-M fp8 linear (decode: M <= 16 tokens) on CUDA cores, every family.
// The weight is streamed exactly once in 16-byte chunks and decoded in registers; each decoded
// weight is multiplied by its own block scale (w * sw), so every K-block keeps its scale. The
// activation operand xd [M, ldx] f32 is prepared by fp8nsa_act_quant_* (quantize-dequantize
// xq * sx for Group / Block2d, plain x for None) and is small enough to stay in L1/L2.
//
// A CTA owns ROWS consecutive output rows; its threads split the row's K chunks, each thread
// accumulates all MT tokens x ROWS rows, and the CTA reduces through shared memory.
// Requires bk % 16 == 0 (a chunk never straddles two K-blocks) and ldw % 16 == 0.

#include "common.cuh"

struct GemvParams {
    const float* xd;    // [M, ldx] f32, zeros in [K, ldx)
    const uint8_t* w;   // [N, ldw] e4m3, zeros in [K, ldw)
    const float* sw;    // sw[(n / bn) * sw_rs + kb]
    const float* bias;  // [N] or null
    void* out;          // [M, N] in the output type
    int64_t ldx, ldw, sw_rs;
    int M, N, K, bn, bk;
};

template <int MT, int ROWS, typename OutT> __device__ void fp8_gemv(const GemvParams& p) {
    const int n0 = blockIdx.x * ROWS;
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
        fp8_gemv<MT, ROWS, OutT>(p);
        __syncthreads();  // the next chunk reuses the reduction's shared memory
    }
}

#define GEMV(NAME, MT, ROWS, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(256) NAME(const GemvParams p) {                 \
        fp8_gemv<MT, ROWS, T>(p);                                                                \
    }                                                                                           \
    FP8NSA_REGISTER(NAME)
// (tokens up to MT, ROWS rows per CTA): more tokens, fewer rows, to bound the registers.
#define GEMV_TYPES(SUFFIX, T)                                                                    \
    GEMV(fp8nsa_fp8_gemv_m1_##SUFFIX, 1, 8, T)                                                   \
    GEMV(fp8nsa_fp8_gemv_m2_##SUFFIX, 2, 8, T)                                                   \
    GEMV(fp8nsa_fp8_gemv_m4_##SUFFIX, 4, 8, T)                                                   \
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
