// The M = 1 fp8 GEMV's inner loop on AVX512-BF16, four ways, on one core, from wherever the
// weight lives (N x K codes: 4096 x 4096 is 16 MiB, in a 32 MiB L3; 8 x 2048 stays in L1):
//   table   the kernel's form (avx512bf16::dot4_blocks without the block scales): four rows,
//           each step of 64 codes decoded by two vpermi2b lookups, a ternary logic and two
//           byte interleaves, then two vdpbf16ps;
//   arith   the arithmetic decode tried on 2026-11-27 and not kept: shifts and a ternary logic
//           put each code's bits under a bf16 exponent of 128 + e (right for e >= 1); steps
//           holding a code with e = 0 are counted (the kernel would redo them by table);
//   none    the same loop with no decode at all (the codes multiplied as if they were bf16):
//           the floor that moving the codes sets;
//   inter4  the table decode over a weight stored four rows interleaved per 64 codes, so the
//           four rows in flight are one contiguous stream (a repacked layout; not built).
// Rows 8 ahead are prefetched as in the kernel. Prints ns per 64 codes of one row.
//
//   gcc -O3 -march=native -o /tmp/m1_decode benches/microbench/m1_decode.c
//   /tmp/m1_decode 4096 4096 20     # N K repetitions
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define TGT __attribute__((noinline, target("avx512f,avx512bw,avx512vbmi,avx512bf16,avx512vl")))

static uint8_t LO[128], HI[128];

// bf16 pattern of e4m3fn magnitude code c (0x7f is NaN)
static uint16_t bf16_of(uint8_t c) {
    int e = c >> 3, m = c & 7;
    if (c == 0x7f) return 0x7fc0;
    if (e > 0) return ((e + 120) << 7) | (m << 4);
    if (m == 0) return 0;
    int p = 31 - __builtin_clz(m);
    return ((p + 118) << 7) | (((m << (3 - p)) & 7) << 4);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

enum { TABLE, ARITH, NONE, INTER4 };

// inlined into one function per form, so that each loop is compiled for its form alone
static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vbmi,avx512bf16,avx512vl")))
float body(int how, const uint8_t *w, int n, int k, const uint16_t *x, long *special) {
    __m512i lo0 = _mm512_loadu_si512(LO), lo1 = _mm512_loadu_si512(LO + 64);
    __m512i hi0 = _mm512_loadu_si512(HI), hi1 = _mm512_loadu_si512(HI + 64);
    __m512i sign = _mm512_set1_epi8((char)0x80), exp_bits = _mm512_set1_epi8(0x78);
    __m512i keep = _mm512_set1_epi16((short)0x87f0), exp128 = _mm512_set1_epi16(0x4000);
    float tot = 0;
    long sp = 0;
    for (int r = 0; r < n; r += 4) {
        __m512 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
        const uint8_t *ahead = w + (size_t)(r + 8) * k;
        for (int c0 = 0; c0 < k; c0 += 64) {
            __m512bh xa = (__m512bh)_mm512_loadu_si512(x + c0);
            __m512bh xc = (__m512bh)_mm512_loadu_si512(x + c0 + 32);
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++)
                _mm_prefetch((const char *)ahead + 4 * c0 + 64 * j, _MM_HINT_T0);
            __mmask64 any = 0;
            _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) {
                const uint8_t *p = how == INTER4 ? w + (size_t)r * k + 4 * c0 + 64 * q
                                                 : w + (size_t)(r + q) * k + c0;
                __m512i c = _mm512_loadu_si512(p);
                __m512i a, b;
                if (how == ARITH) {
                    any |= _mm512_testn_epi8_mask(c, exp_bits);
                    a = _mm512_ternarylogic_epi32(
                        _mm512_srai_epi16(_mm512_slli_epi16(c, 8), 4), keep, exp128, 0xea);
                    b = _mm512_ternarylogic_epi32(_mm512_srai_epi16(c, 4), keep, exp128, 0xea);
                } else if (how == NONE) {
                    a = c;
                    b = c;
                } else {
                    __m512i l = _mm512_permutex2var_epi8(lo0, c, lo1);
                    __m512i h = _mm512_permutex2var_epi8(hi0, c, hi1);
                    h = _mm512_ternarylogic_epi32(h, c, sign, 0xf8);
                    a = _mm512_unpacklo_epi8(l, h);
                    b = _mm512_unpackhi_epi8(l, h);
                }
                acc[2 * q] = _mm512_dpbf16_ps(acc[2 * q], (__m512bh)a, xa);
                acc[2 * q + 1] = _mm512_dpbf16_ps(acc[2 * q + 1], (__m512bh)b, xc);
            }
            sp += any != 0;
        }
        for (int i = 0; i < 8; i++) tot += _mm512_reduce_add_ps(acc[i]);
    }
    *special = sp;
    return tot;
}

TGT static float run_table(const uint8_t *w, int n, int k, const uint16_t *x, long *sp) {
    return body(TABLE, w, n, k, x, sp);
}
TGT static float run_arith(const uint8_t *w, int n, int k, const uint16_t *x, long *sp) {
    return body(ARITH, w, n, k, x, sp);
}
TGT static float run_none(const uint8_t *w, int n, int k, const uint16_t *x, long *sp) {
    return body(NONE, w, n, k, x, sp);
}
TGT static float run_inter4(const uint8_t *w, int n, int k, const uint16_t *x, long *sp) {
    return body(INTER4, w, n, k, x, sp);
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: m1_decode N K REPS\n");
        return 1;
    }
    int n = atoi(argv[1]), k = atoi(argv[2]), reps = atoi(argv[3]);
    for (int c = 0; c < 128; c++) {
        uint16_t b = bf16_of(c);
        LO[c] = b & 0xff;
        HI[c] = b >> 8;
    }
    // codes as block-scaled weights have them: e = 0 (zero, subnormal) about once in 10^4
    size_t len = (size_t)n * k + (size_t)16 * k;
    uint8_t *w = aligned_alloc(64, (len + 63) / 64 * 64);
    srand(1);
    for (size_t i = 0; i < len; i++) {
        int c;
        do {
            c = rand() & 0xff;
            if (rand() % 10000 != 0) c |= 0x08;
        } while ((c & 0x7f) == 0x7f);
        w[i] = c;
    }
    uint16_t *x = aligned_alloc(64, (size_t)k * 2);
    for (int i = 0; i < k; i++) x[i] = 0x3f80;
    const char *names[] = {"table", "arith", "none", "inter4"};
    float (*runs[])(const uint8_t *, int, int, const uint16_t *, long *) = {
        run_table, run_arith, run_none, run_inter4};
    double steps = (double)n * k / 64;
    for (int round = 0; round < 3; round++) {
        printf("N %d K %d:", n, k);
        for (int how = 0; how < 4; how++) {
            long special = 0;
            float t = 0;
            double t0 = now();
            for (int i = 0; i < reps; i++) {
                __asm__ volatile("" ::: "memory");
                t += runs[how](w, n, k, x, &special);
            }
            double s = (now() - t0) / reps;
            printf(" %s %.2f", names[how], s / steps * 1e9);
            if (how == ARITH) printf(" (%.2f%% steps with e = 0)", 100.0 * special / (steps / 4));
            if (t == 1234.5f) printf("!");
        }
        printf(" ns per 64 codes\n");
    }
    return 0;
}
