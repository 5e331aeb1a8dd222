// Throughput and latency of the 512-bit dot-product instructions the CPU kernels and their peers
// use: vdpbf16ps (ours on the AVX512-BF16 tier: 32 bf16 products per instruction) and vpdpbusd
// (candle's and llama.cpp's Q8_0 kernels on AVX512-VNNI: 64 int8 products per instruction),
// with 1..12 independent accumulator chains per loop, on one core.
//
//   gcc -O2 -march=native -o /tmp/rates benches/microbench/rates.c && /tmp/rates
//
// Zen 4 (2 vCPU, 2026-11-27): both 0.273 ns per instruction from 8 chains on (one per cycle at
// ~3.65 GHz), 1.64 ns (vdpbf16ps) and 1.09 ns (vpdpbusd) with one chain: per cycle, int8 does
// twice the multiply-adds of bf16.
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

#define N 200000000L
// the accumulators stay in registers only if the chain loop is unrolled at compile time
#define BF16(NA)                                                                              \
    {                                                                                         \
        __m512 acc[NA];                                                                       \
        for (int i = 0; i < NA; i++) acc[i] = _mm512_setzero_ps();                            \
        double t0 = now();                                                                    \
        for (long i = 0; i < N / NA; i++) {                                                   \
            _Pragma("GCC unroll 32") for (int j = 0; j < NA; j++) acc[j] =                    \
                _mm512_dpbf16_ps(acc[j], (__m512bh)a, (__m512bh)b);                           \
            __asm__ volatile("" : "+v"(a));                                                   \
        }                                                                                     \
        double s = now() - t0;                                                                \
        float t = 0;                                                                          \
        for (int i = 0; i < NA; i++) t += _mm512_reduce_add_ps(acc[i]);                       \
        printf("vdpbf16ps %2d chains: %.3f ns per instruction (%g)\n", NA, s / N * 1e9, t);  \
    }
#define INT8(NA)                                                                              \
    {                                                                                         \
        __m512i acc[NA];                                                                      \
        for (int i = 0; i < NA; i++) acc[i] = _mm512_setzero_si512();                         \
        double t0 = now();                                                                    \
        for (long i = 0; i < N / NA; i++) {                                                   \
            _Pragma("GCC unroll 32") for (int j = 0; j < NA; j++) acc[j] =                    \
                _mm512_dpbusd_epi32(acc[j], a, b);                                            \
            __asm__ volatile("" : "+v"(a));                                                   \
        }                                                                                     \
        double s = now() - t0;                                                                \
        long t = 0;                                                                           \
        for (int i = 0; i < NA; i++) t += _mm512_reduce_add_epi32(acc[i]);                    \
        printf("vpdpbusd  %2d chains: %.3f ns per instruction (%ld)\n", NA, s / N * 1e9, t); \
    }

int main(void) {
    __m512i a = _mm512_set1_epi32(0x3f803f80), b = a;
    BF16(1) BF16(4) BF16(8) BF16(12)
    INT8(1) INT8(4) INT8(8) INT8(12)
    return 0;
}
