// Device helpers shared by the fp8nsa kernels: element types, fp8 e4m3 codec, cp.async,
// ldmatrix and the warp-level MMA wrappers. Inline PTX lives here only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#ifdef FP8NSA_EMU
// Host build for the CPU emulator (backends/cuda/emu): CUDA keywords and builtins come from it.
#include "emu.h"
#define FP8NSA_DEVICE inline
#define FP8NSA_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(fp8nsa_emu::dynamic_smem())
#define FP8NSA_SHARED(T, name, ...)                                                              \
    static char name##_key_;                                                                     \
    using name##_type_ = T __VA_ARGS__;                                                          \
    name##_type_& name = *fp8nsa_emu::shared<name##_type_>(&name##_key_)
#define FP8NSA_REGISTER(NAME) static fp8nsa_emu::Registrar NAME##_registrar_(#NAME, &NAME);
#else
#define FP8NSA_DEVICE __device__ __forceinline__
#define FP8NSA_DYNAMIC_SMEM(T, name) extern __shared__ T name[]
#define FP8NSA_SHARED(T, name, ...) __shared__ T name __VA_ARGS__
#define FP8NSA_REGISTER(NAME)
#endif

// ---------------------------------------------------------------------------------------------
// Element types: load as f32, store from f32 (round to nearest even).

FP8NSA_DEVICE float to_f32(float x) { return x; }
FP8NSA_DEVICE float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
FP8NSA_DEVICE float to_f32(__half x) { return __half2float(x); }

template <typename T> FP8NSA_DEVICE T from_f32(float x);
template <> FP8NSA_DEVICE float from_f32<float>(float x) { return x; }
template <> FP8NSA_DEVICE __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> FP8NSA_DEVICE __half from_f32<__half>(float x) { return __float2half_rn(x); }

// ---------------------------------------------------------------------------------------------
// fp8 e4m3fn. Encoding is the contract's q = sat(rne(x)): round to nearest even, saturate to
// +-448, NaN stays NaN. cuda_fp8.h uses the hardware cvt on sm_89+ and an exact software path
// below, so every family encodes identically.

FP8NSA_DEVICE uint8_t f32_to_e4m3(float x) {
    return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

FP8NSA_DEVICE float e4m3_to_f32(uint8_t b) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
    return __half2float(__half(h));
}

// Four packed e4m3 bytes (lowest byte first) to f32.
FP8NSA_DEVICE void e4m3x4_to_f32(uint32_t w, float out[4]) {
    __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w & 0xffffu), __NV_E4M3);
    __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w >> 16), __NV_E4M3);
    float2 a = __half22float2(__half2(lo));
    float2 b = __half22float2(__half2(hi));
    out[0] = a.x;
    out[1] = a.y;
    out[2] = b.x;
    out[3] = b.y;
}

// The contract's scale of a group or block: max(amax, 1e-12) / 448, an IEEE f32 division.
FP8NSA_DEVICE float fp8_scale(float amax) { return __fdiv_rn(fmaxf(amax, 1e-12f), 448.0f); }

// ---------------------------------------------------------------------------------------------
// Warp reductions.

FP8NSA_DEVICE float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

FP8NSA_DEVICE float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---------------------------------------------------------------------------------------------
// cp.async (sm_80+): 16-byte global -> shared copies. `valid == false` zero-fills the
// destination without reading the source (the source address must still be a valid pointer).

#ifdef FP8NSA_EMU
FP8NSA_DEVICE void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
    fp8nsa_emu::cp_async_16(smem_dst, gmem_src, valid);
}
FP8NSA_DEVICE void cp_async_commit() { fp8nsa_emu::cp_async_commit(); }
template <int N> FP8NSA_DEVICE void cp_async_wait() { fp8nsa_emu::cp_async_wait(N); }
#else
FP8NSA_DEVICE uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

FP8NSA_DEVICE void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
    const int src_size = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem_dst)),
                 "l"(gmem_src), "r"(src_size)
                 : "memory");
}

FP8NSA_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N> FP8NSA_DEVICE void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

// ---------------------------------------------------------------------------------------------
// ldmatrix: four 8x8 matrices of 16-bit elements (8 rows of 16 bytes each). Lanes 8i..8i+7
// give the row addresses of matrix i; lane l receives, from each matrix, row l/4, 16-bit
// columns 2(l%4) and 2(l%4)+1 (bytes 4(l%4)..4(l%4)+3). `.trans` transposes each matrix.

#ifdef FP8NSA_EMU
FP8NSA_DEVICE void ldmatrix_x4(uint32_t r[4], const void* row_addr) {
    fp8nsa_emu::ldmatrix_x4(r, row_addr, false);
}
FP8NSA_DEVICE void ldmatrix_x4_trans(uint32_t r[4], const void* row_addr) {
    fp8nsa_emu::ldmatrix_x4(r, row_addr, true);
}
#else
FP8NSA_DEVICE void ldmatrix_x4(uint32_t r[4], const void* row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row_addr)));
}

FP8NSA_DEVICE void ldmatrix_x4_trans(uint32_t r[4], const void* row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(row_addr)));
}
#endif

// ---------------------------------------------------------------------------------------------
// Warp MMAs, f32 accumulate: d += a * b. Fragment layouts (g = lane / 4, t = lane % 4):
//   A 16xK row-major: a0 (row g, k-lo), a1 (row g+8, k-lo), a2 (row g, k-hi), a3 (row g+8, k-hi)
//   B Kx8 "col" (stored n-major, i.e. [n][k]): b0 (n g, k-lo), b1 (n g, k-hi)
//   C/D 16x8: c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, cols 2t, 2t+1)
// k-lo / k-hi: for 16-bit types k = 2t, 2t+1 / 2t+8, 2t+9; for e4m3 (k32) k = 4t..4t+3 /
// 16+4t..16+4t+3, the lowest k in the lowest bits of the register.

#ifdef FP8NSA_EMU
FP8NSA_DEVICE void mma_bf16_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    fp8nsa_emu::mma(d, a, b, fp8nsa_emu::MmaKind::Bf16);
}
FP8NSA_DEVICE void mma_f16_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    fp8nsa_emu::mma(d, a, b, fp8nsa_emu::MmaKind::F16);
}
#define FP8NSA_HAS_FP8_MMA 1
FP8NSA_DEVICE void mma_e4m3_16832(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    fp8nsa_emu::mma(d, a, b, fp8nsa_emu::MmaKind::E4m3);
}
#else
FP8NSA_DEVICE void mma_bf16_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

FP8NSA_DEVICE void mma_f16_16816(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define FP8NSA_HAS_FP8_MMA 1
FP8NSA_DEVICE void mma_e4m3_16832(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif
#endif  // FP8NSA_EMU

// Packs two f32 into a bf16x2 / f16x2 register, the first in the low half.
FP8NSA_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    uint32_t r;
    memcpy(&r, &v, 4);  // not a pointer cast: the emulator's host build must not break aliasing
    return r;
}

FP8NSA_DEVICE uint32_t pack_f16x2(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    uint32_t r;
    memcpy(&r, &v, 4);
    return r;
}
