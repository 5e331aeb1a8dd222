// Activation quantization, weight dequantization and the split-K / bias epilogue.
// Every family (sm_80 included): the fp8 codec of cuda_fp8.h is exact on all of them.

#include "common.cuh"

// docs/numerics.md, non-finite activations: the amax is taken over finite elements, so one
// bad token cannot move a scale it shares (Block2d), and a non-finite element becomes the NaN
// code (0x7f) rather than saturating to 448, so its own token's outputs turn NaN.
// (|v| <= FLT_MAX is false for NaN and for ±Inf: one test for both.)
__device__ __forceinline__ float finite_abs(float v) { return fabsf(v) <= 3.40282347e38f ? fabsf(v) : 0.0f; }
__device__ __forceinline__ uint8_t act_code(float v, float s) {
    return fabsf(v) <= 3.40282347e38f ? f32_to_e4m3(__fdiv_rn(v, s)) : (uint8_t)0x7f;
}

// Dynamic activation quantization, a warp per scale tile of `bm` rows x `bk` columns
// (Group is bm = 1). Pass 1 takes the tile's amax, pass 2 writes
//   xq[m * ldq + k] = sat(rne(x / s)),   s = max(amax, 1e-12) / 448
// and the scale to sx[mb * sx_rs + kb * sx_cs] (row-major for our kernels, token-contiguous
// for cuBLASLt). The warp of the last k-block also zeroes the row tail [K, ldq), so consumers
// may read whole 16-byte chunks. With `deq` set, it writes xq * s as f32 to xd[m * ldq + k]
// instead (the small-M kernel's operand, or in T the last-resort path's), tail zeroed the same
// way. act_none: no quantization, xd = x (W8A16).
template <typename T, typename OT>
__device__ void act_tile(const T* __restrict__ x, uint8_t* __restrict__ xq, OT* __restrict__ xd,
                         float* __restrict__ sx, int M, int K, int ldq, int bm, int bk, int64_t sx_rs,
                         int64_t sx_cs, int act_none, int64_t tile, int lane) {
    const int KB = (K + bk - 1) / bk;
    const int mb = (int)(tile / KB), kb = (int)(tile % KB);
    const int m0 = mb * bm, m1 = min(M, m0 + bm);
    const int k0 = kb * bk, k1 = min(K, k0 + bk);
    const int tail = (kb == KB - 1) ? ldq : k1;  // the last k-block also covers [K, ldq)

    // Groups of one row and at most 128 columns (DeepSeek's 1x128, the common case): one pass,
    // each lane keeping its 4 consecutive columns in registers, 4-byte stores of the codes.
    if (bm == 1 && bk <= 128) {
        const int c0 = k0 + 4 * lane;
        const int64_t row = (int64_t)m0 * K;
        float v[4];
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            v[j] = c0 + j < k1 ? to_f32(x[row + c0 + j]) : 0.0f;
            amax = fmaxf(amax, finite_abs(v[j]));
        }
        const float s = act_none ? 1.0f : fp8_scale(warp_max(amax));
        if (!act_none && lane == 0 && sx != nullptr) sx[mb * sx_rs + kb * sx_cs] = s;
        uint8_t q[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) q[j] = act_none ? 0 : act_code(v[j], s);
        const int64_t out = (int64_t)m0 * ldq + c0;
        if (c0 < k1) {
            if (xd != nullptr) {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (c0 + j < k1) xd[out + j] = from_f32<OT>(act_none ? v[j] : e4m3_to_f32(q[j]) * s);
            } else if (c0 + 4 <= k1 && out % 4 == 0) {
                *reinterpret_cast<uint32_t*>(xq + out) =
                    (uint32_t)q[0] | ((uint32_t)q[1] << 8) | ((uint32_t)q[2] << 16) | ((uint32_t)q[3] << 24);
            } else {
                for (int j = 0; j < 4 && c0 + j < k1; ++j) xq[out + j] = q[j];
            }
        }
        // the last k-block also zeroes the row tail [K, ldq)
        if (kb == KB - 1)
            for (int k = k1 + lane; k < ldq; k += 32) {
                if (xd != nullptr)
                    xd[(int64_t)m0 * ldq + k] = from_f32<OT>(0.0f);
                else
                    xq[(int64_t)m0 * ldq + k] = 0;
            }
        return;
    }

    float s = 1.0f;
    if (!act_none) {
        float amax = 0.0f;
        for (int m = m0; m < m1; ++m)
            for (int k = k0 + lane; k < k1; k += 32) amax = fmaxf(amax, finite_abs(to_f32(x[(int64_t)m * K + k])));
        s = fp8_scale(warp_max(amax));
        if (lane == 0 && sx != nullptr) sx[mb * sx_rs + kb * sx_cs] = s;
    }
    for (int m = m0; m < m1; ++m) {
        for (int k = k0 + lane; k < tail; k += 32) {
            const float v = k < k1 ? to_f32(x[(int64_t)m * K + k]) : 0.0f;
            if (act_none) {
                xd[(int64_t)m * ldq + k] = from_f32<OT>(v);
            } else {
                const uint8_t q = act_code(v, s);
                if (xd != nullptr)
                    xd[(int64_t)m * ldq + k] = from_f32<OT>(e4m3_to_f32(q) * s);
                else
                    xq[(int64_t)m * ldq + k] = q;
            }
        }
    }
}

// Warps stride over the tiles: any grid covers any M x K.
template <typename T, typename OT>
__device__ void act_quant(const T* __restrict__ x, uint8_t* __restrict__ xq, OT* __restrict__ xd,
                          float* __restrict__ sx, int M, int K, int ldq, int bm, int bk, int64_t sx_rs,
                          int64_t sx_cs, int act_none) {
    const int warps = blockDim.x / 32;
    const int64_t tiles = (int64_t)((M + bm - 1) / bm) * ((K + bk - 1) / bk);
    for (int64_t tile = (int64_t)blockIdx.x * warps + threadIdx.x / 32; tile < tiles;
         tile += (int64_t)gridDim.x * warps)
        act_tile<T, OT>(x, xq, xd, sx, M, K, ldq, bm, bk, sx_rs, sx_cs, act_none, tile, threadIdx.x % 32);
}

#define ACT_QUANT(NAME, T, OT)                                                                   \
    extern "C" __global__ void NAME(const T* x, uint8_t* xq, OT* xd, float* sx, int M, int K,      \
                                    int ldq, int bm, int bk, int64_t sx_rs, int64_t sx_cs,               \
                                    int act_none) {                                                \
        act_quant<T, OT>(x, xq, xd, sx, M, K, ldq, bm, bk, sx_rs, sx_cs, act_none);                \
    }                                                                                           \
    FP8NSA_REGISTER(NAME)
// xd in f32 (small-M kernel), and in the input type (dequantize + cuBLAS)
ACT_QUANT(fp8nsa_act_quant_f32, float, float)
ACT_QUANT(fp8nsa_act_quant_bf16, __nv_bfloat16, float)
ACT_QUANT(fp8nsa_act_quant_f16, __half, float)
ACT_QUANT(fp8nsa_act_quant_bf16_to_bf16, __nv_bfloat16, __nv_bfloat16)
ACT_QUANT(fp8nsa_act_quant_f16_to_f16, __half, __half)

// W_real[n, k] = W[n * ldw + k] * sw[(n / bn) * sw_rs + k / bk], written densely [N, K] in T:
// the last-resort path hands it to cuBLAS.
template <typename T>
__device__ void dequant_weight(const uint8_t* __restrict__ w, const float* __restrict__ sw,
                               T* __restrict__ out, int N, int K, int ldw, int bn, int bk,
                               int64_t sw_rs) {
    const int64_t total = (int64_t)N * K;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int n = (int)(i / K), k = (int)(i % K);
        const float s = sw[(n / bn) * sw_rs + k / bk];
        out[i] = from_f32<T>(e4m3_to_f32(w[(int64_t)n * ldw + k]) * s);
    }
}

#define DEQUANT(NAME, T)                                                                       \
    extern "C" __global__ void NAME(const uint8_t* w, const float* sw, T* out, int N, int K,    \
                                    int ldw, int bn, int bk, int64_t sw_rs) {                       \
        dequant_weight<T>(w, sw, out, N, K, ldw, bn, bk, sw_rs);                                 \
    }                                                                                           \
    FP8NSA_REGISTER(NAME)
DEQUANT(fp8nsa_dequant_f32, float)
DEQUANT(fp8nsa_dequant_bf16, __nv_bfloat16)
DEQUANT(fp8nsa_dequant_f16, __half)

// out[m, n] = sum_s ws[s, m, n] + bias[n] (bias may be null), in T. Split-K epilogue.
template <typename T>
__device__ void splitk_reduce(const float* __restrict__ ws, const float* __restrict__ bias,
                              T* __restrict__ out, int M, int N, int splits) {
    const int64_t total = (int64_t)M * N;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        float acc = bias != nullptr ? bias[i % N] : 0.0f;
        for (int s = 0; s < splits; ++s) acc += ws[(int64_t)s * total + i];
        out[i] = from_f32<T>(acc);
    }
}

#define SPLITK(NAME, T)                                                                          \
    extern "C" __global__ void NAME(const float* ws, const float* bias, T* out, int M, int N,     \
                                    int splits) {                                                 \
        splitk_reduce<T>(ws, bias, out, M, N, splits);                                            \
    }                                                                                           \
    FP8NSA_REGISTER(NAME)
SPLITK(fp8nsa_splitk_reduce_f32, float)
SPLITK(fp8nsa_splitk_reduce_bf16, __nv_bfloat16)
SPLITK(fp8nsa_splitk_reduce_f16, __half)

// y[m, n] += bias[n] in place (after cuBLAS / cuBLASLt, which run without an epilogue).
template <typename T>
__device__ void add_bias(T* __restrict__ y, const float* __restrict__ bias, int M, int N) {
    const int64_t total = (int64_t)M * N;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = from_f32<T>(to_f32(y[i]) + bias[i % N]);
}

#define ADD_BIAS(NAME, T)                                                                        \
    extern "C" __global__ void NAME(T* y, const float* bias, int M, int N) {                      \
        add_bias<T>(y, bias, M, N);                                                               \
    }                                                                                           \
    FP8NSA_REGISTER(NAME)
ADD_BIAS(fp8nsa_add_bias_f32, float)
ADD_BIAS(fp8nsa_add_bias_bf16, __nv_bfloat16)
ADD_BIAS(fp8nsa_add_bias_f16, __half)

// dst[r * ld + c] = src[r * cols + c] for c < cols, 0 for cols <= c < ld: the prepared weight
// (rows padded to 16 bytes, scale rows to a multiple of 4 as cuBLASLt wants).
template <typename T>
__device__ void pad2d(const T* __restrict__ src, T* __restrict__ dst, int rows, int cols, int64_t ld) {
    const int64_t total = (int64_t)rows * ld;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / ld, c = i % ld;
        dst[i] = c < cols ? src[r * cols + c] : T(0);
    }
}

extern "C" __global__ void fp8nsa_pad2d_u8(const uint8_t* src, uint8_t* dst, int rows, int cols, int64_t ld) {
    pad2d<uint8_t>(src, dst, rows, cols, ld);
}
FP8NSA_REGISTER(fp8nsa_pad2d_u8)
extern "C" __global__ void fp8nsa_pad2d_f32(const float* src, float* dst, int rows, int cols, int64_t ld) {
    pad2d<float>(src, dst, rows, cols, ld);
}
FP8NSA_REGISTER(fp8nsa_pad2d_f32)
