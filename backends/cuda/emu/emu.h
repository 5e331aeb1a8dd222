// CPU emulator of the CUDA subset the fp8nsa kernels use, for testing them without a GPU.
// Every CUDA thread of a block is a fiber; blocks run one after another. Warp collectives
// (shuffles, ldmatrix, mma.sync) wait for all 32 lanes and are computed from the PTX ISA's
// fragment layouts; __syncthreads is a block barrier; cp.async copies are deferred until the
// cp.async.wait_group that covers them, so a missing wait reads stale shared memory. Shared
// memory and uninitialised temporaries start as 0xFF bytes (NaN for floats), so reading what
// nothing wrote shows up in the results. Divergent collectives, deadlocks and out-of-range
// shared-memory accesses by ldmatrix / cp.async are reported as launch errors.
#pragma once

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
// CUDA's own headers first: the macros below must not reach their declarations.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <math_constants.h>
#include <vector_types.h>

// CUDA's headers give these attributes meanings g++ does not have: plain host code here.
#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __forceinline__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)
// the device spelling uses __int_as_float
#undef CUDART_INF_F
#define CUDART_INF_F INFINITY
#undef CUDART_NAN_F
#define CUDART_NAN_F NAN

namespace fp8nsa_emu {

struct Dim3 {
    unsigned x, y, z;
};

const Dim3& thread_idx();
const Dim3& block_idx();
const Dim3& block_dim();
const Dim3& grid_dim();

void syncthreads();
int syncthreads_or(int pred);
void syncwarp();
float shfl_xor(float v, int lane_mask);

void cp_async_16(void* smem_dst, const void* gmem_src, bool valid);
void cp_async_commit();
void cp_async_wait(int pending);

void ldmatrix_x4(uint32_t r[4], const void* row_addr, bool trans);

enum class MmaKind { Bf16, F16, E4m3 };
void mma(float d[4], const uint32_t a[4], const uint32_t b[2], MmaKind kind);

void* dynamic_smem();
void* static_smem(const void* key, size_t bytes);
template <typename T> T* shared(const void* key) {
    return static_cast<T*>(static_smem(key, sizeof(T)));
}

// Kernel registry: NAME -> a thunk unpacking cuLaunchKernel-style argument pointers.
using Thunk = std::function<void(void**)>;
void register_kernel(const char* name, Thunk thunk);

template <typename... P, size_t... I>
void call_with(void (*f)(P...), void** args, std::index_sequence<I...>) {
    f(*static_cast<std::decay_t<P>*>(args[I])...);
}

struct Registrar {
    template <typename... P> Registrar(const char* name, void (*f)(P...)) {
        register_kernel(name, [f](void** args) { call_with(f, args, std::index_sequence_for<P...>{}); });
    }
};

}  // namespace fp8nsa_emu

#define threadIdx (fp8nsa_emu::thread_idx())
#define blockIdx (fp8nsa_emu::block_idx())
#define blockDim (fp8nsa_emu::block_dim())
#define gridDim (fp8nsa_emu::grid_dim())

inline void __syncthreads() { fp8nsa_emu::syncthreads(); }
inline int __syncthreads_or(int pred) { return fp8nsa_emu::syncthreads_or(pred); }
inline void __syncwarp(unsigned = 0xffffffffu) { fp8nsa_emu::syncwarp(); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) { return fp8nsa_emu::shfl_xor(v, lane_mask); }
template <typename T> inline T __ldg(const T* p) { return *p; }
inline float __fdiv_rn(float a, float b) { return a / b; }

// CUDA's device min / max overloads (same-type arguments only, as the kernels use them)
inline int min(int a, int b) { return b < a ? b : a; }
inline int max(int a, int b) { return a < b ? b : a; }
inline long min(long a, long b) { return b < a ? b : a; }
inline long max(long a, long b) { return a < b ? b : a; }
inline unsigned min(unsigned a, unsigned b) { return b < a ? b : a; }
inline unsigned max(unsigned a, unsigned b) { return a < b ? b : a; }

