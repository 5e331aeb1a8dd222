// Kernel-only sweep of the small-M fp8 kernel (kernels/fp8_gemv.cu) on a real GPU (issue 32,
// step 4: the decode path toward the weight-read floor). Times, with CUDA events, weights
// cycled through 256 MiB of copies (HBM, not L2), f32 activations and outputs, for the
// DeepSeek-V3 shapes at M = 1, 2, 4:
//   - the activation kernel alone (fp8nsa_act_quant_f32, Group 1 x 128);
//   - the small-M kernel at every group width tpg, each with the grid build.rs gives that
//     width; the width build.rs picks (gemv_launch) is marked `*`;
//   - the activation kernel + the kernel at the picked width: the two launches of a call.
// With -DFP8NSA_SWEEP_OLD and old_gemv.cuh (the kernel of another revision, renamed; see
// gemv_sweep.sh) it also times that kernel, with its own launch shape, in the same run.
// (A first form of this file also timed a kernel that quantized the activations itself, to
// save the activation kernel's launch: 1.4-5x slower than the two launches on the H100, the
// per-group division and conversions costing more than the launch; not kept.)
//   nvcc -O3 -std=c++17 -arch=sm_90 benches/gpu/gemv_sweep.cu -o gemv_sweep && ./gemv_sweep
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>

#include "../../backends/cuda/kernels/fp8_gemv.cu"
#include "../../backends/cuda/kernels/fp8_quant.cu"
#ifdef FP8NSA_SWEEP_OLD
#include "old_gemv.cuh"
#endif

#define CK(x)                                                                                    \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) {                                                                 \
            fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));           \
            exit(1);                                                                             \
        }                                                                                        \
    } while (0)

struct Bench {
    cudaEvent_t a, b;
    Bench() {
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
    }
    // median over 11 samples of `reps` calls, ms per call
    template <typename F> float time(F f, int reps = 50) {
        for (int i = 0; i < 3; ++i) f(i);
        CK(cudaDeviceSynchronize());
        std::vector<float> s;
        int it = 0;
        for (int j = 0; j < 11; ++j) {
            CK(cudaEventRecord(a));
            for (int i = 0; i < reps; ++i) f(it++);
            CK(cudaEventRecord(b));
            CK(cudaEventSynchronize(b));
            float ms;
            CK(cudaEventElapsedTime(&ms, a, b));
            s.push_back(ms / reps);
        }
        CK(cudaGetLastError());
        std::sort(s.begin(), s.end());
        return s[s.size() / 2];
    }
};

// build.rs, gemv_launch (up to 8 tokens): the narrowest group giving >= 396 CTAs of 256 threads
// and <= 8 chunks per thread, among the widths up to the row's chunk count rounded up to a
// power of two (at least 32); that widest one where none meets both.
static int picked_tpg(int n, int k) {
    const int chunks = std::max(1, (k + 15) / 16), groups = std::max(1, (n + 3) / 4);
    int widest = 32;
    while (widest < chunks && widest < 256) widest *= 2;
    for (int tpg = 32; tpg <= widest; tpg *= 2) {
        const int ctas = (groups + 256 / tpg - 1) / (256 / tpg);
        if (ctas >= 396 && (chunks + tpg - 1) / tpg <= 8) return tpg;
    }
    return widest;
}

static void launch(const GemvParams& p, int mt, int tpg) {
    const int groups = (p.N + 3) / 4, ctas = (groups + 256 / tpg - 1) / (256 / tpg);
    GemvParams q = p;
    q.tpg = tpg;
    if (mt == 1) fp8nsa_fp8_gemv_m1_f32<<<ctas, 256>>>(q);
    if (mt == 2) fp8nsa_fp8_gemv_m2_f32<<<ctas, 256>>>(q);
    if (mt == 4) fp8nsa_fp8_gemv_m4_f32<<<ctas, 256>>>(q);
}

struct Case {
    int n, k, m;
};

static void run(Bench& bench, Case c, double copy_gbs) {
    const int n = c.n, k = c.k, m = c.m, bk = 128, bn = 128;
    const int ld = (k + 15) / 16 * 16, kb = (k + bk - 1) / bk, nb = (n + bn - 1) / bn;
    const size_t wbytes = (size_t)n * ld;
    const int copies = std::max<int>(2, (int)((256ull << 20) / wbytes + 1));
    std::vector<uint8_t> hw(wbytes);
    srand(1234 + n + k);
    for (size_t i = 0; i < wbytes; ++i) {
        uint8_t v = (uint8_t)(rand() & 0xff);
        if ((v & 0x7f) == 0x7f) v = 0x38;  // no NaN codes
        hw[i] = (i % ld) < (size_t)k ? v : 0;
    }
    std::vector<float> hs((size_t)nb * kb);
    for (auto& s : hs) s = std::ldexp(1.0f, rand() % 20 - 10);
    std::vector<uint8_t*> ws(copies);
    std::vector<float*> sws(copies);
    for (int i = 0; i < copies; ++i) {
        CK(cudaMalloc(&ws[i], wbytes));
        CK(cudaMalloc(&sws[i], hs.size() * 4));
        CK(cudaMemcpy(ws[i], hw.data(), wbytes, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(sws[i], hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
    }
    std::vector<float> hx((size_t)m * k);
    for (auto& v : hx) v = std::ldexp((rand() / (float)RAND_MAX) * 2.0f - 1.0f, rand() % 8 - 4);
    float *x, *xd, *out;
    CK(cudaMalloc(&x, hx.size() * 4));
    CK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&xd, (size_t)16 * ld * 4));
    CK(cudaMalloc(&out, (size_t)16 * n * 4));
    auto act = [&]() {
        const int tiles = m * kb;
        fp8nsa_act_quant_f32<<<(tiles + 7) / 8, 256>>>(x, nullptr, xd, nullptr, m, k, ld, 1, bk, kb, 1, 0);
    };
    act();
    CK(cudaDeviceSynchronize());
    GemvParams p{xd, ws[0], sws[0], nullptr, out, ld, ld, kb, m, n, k, bn, bk, 256};
    const double floor_ms = (double)n * k / (copy_gbs * 1e6);
    const int pick = picked_tpg(n, k);
    auto at = [&](int i) {
        GemvParams q = p;
        q.w = ws[i % copies];
        q.sw = sws[i % copies];
        return q;
    };
    const int mt = m;  // 1, 2 or 4: the kernels' template sizes
    const float t_act = bench.time([&](int) { act(); });
    printf("M=%d N=%-5d K=%-5d floor %.4f ms, activation kernel %.4f ms, picked tpg %d\n", m, n, k, floor_ms, t_act,
           pick);
    for (int tpg = 32; tpg <= 256; tpg *= 2) {
        const float ms = bench.time([&](int i) { launch(at(i), mt, tpg); });
        printf("   kernel tpg %3d%s  %8.4f ms  %6.0f GB/s  x%.2f floor\n", tpg, tpg == pick ? "*" : " ", ms,
               (double)n * k / ms / 1e6, ms / floor_ms);
    }
    const float t_two = bench.time([&](int i) {
        act();
        launch(at(i), mt, pick);
    });
    printf("   picked: activation kernel + kernel %.4f ms (%.0f GB/s, x%.2f floor)\n", t_two,
           (double)n * k / t_two / 1e6, t_two / floor_ms);
#ifdef FP8NSA_SWEEP_OLD
    {
        // the kernel before: ROWS 8, one group per CTA of min(256, chunks rounded to 32) threads
        const int threads = std::min(256, std::max(32, ((k + 15) / 16 + 31) / 32 * 32));
        OldGemvParams o{xd, ws[0], sws[0], nullptr, out, ld, ld, kb, m, n, k, bn, bk};
        auto old_launch = [&](int i) {
            OldGemvParams q = o;
            q.w = ws[i % copies];
            q.sw = sws[i % copies];
            if (mt == 1) old_gemv_f32<1, 8><<<(n + 7) / 8, threads>>>(q);
            if (mt == 2) old_gemv_f32<2, 8><<<(n + 7) / 8, threads>>>(q);
            if (mt == 4) old_gemv_f32<4, 8><<<(n + 7) / 8, threads>>>(q);
        };
        const float t_old = bench.time(old_launch);
        const float t_old_two = bench.time([&](int i) {
            act();
            old_launch(i);
        });
        printf("   before: kernel %.4f ms, activation kernel + kernel %.4f ms (%.0f GB/s); now x%.2f faster\n",
               t_old, t_old_two, (double)n * k / t_old_two / 1e6, t_old_two / t_two);
    }
#endif
    fflush(stdout);
    for (int i = 0; i < copies; ++i) {
        CK(cudaFree(ws[i]));
        CK(cudaFree(sws[i]));
    }
    CK(cudaFree(x));
    CK(cudaFree(xd));
    CK(cudaFree(out));
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    Bench bench;
    const size_t bytes = 1ull << 30;
    void *src, *dst;
    CK(cudaMalloc(&src, bytes));
    CK(cudaMalloc(&dst, bytes));
    const float copy_ms =
        bench.time([&](int) { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); }, 5);
    CK(cudaFree(src));
    CK(cudaFree(dst));
    const double copy_gbs = 2.0 * bytes / copy_ms / 1e6;
    printf("%s, %d SMs, copy bandwidth %.0f GB/s\n", prop.name, prop.multiProcessorCount, copy_gbs);
    const int shapes[][2] = {{2112, 7168}, {24576, 1536}, {7168, 16384}, {4096, 7168}, {7168, 2048}};
    for (int m : {1, 2, 4})
        for (auto& s : shapes) run(bench, Case{s[0], s[1], m}, copy_gbs);
    return 0;
}
