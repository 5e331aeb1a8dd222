// The CPU emulator's runtime (see emu.h) and the kernels, compiled as C++ in this one
// translation unit so that every kernel's registrar is linked.

#include "emu.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace fp8nsa_emu {

/// Bytes that end exactly at a PROT_NONE page, so a read or write past the end faults.
struct Guarded {
    char* map = nullptr;
    size_t map_len = 0;
    char* data = nullptr;
    size_t bytes = 0;

    Guarded() = default;
    explicit Guarded(size_t n) : bytes(n) {
        const size_t page = (size_t)sysconf(_SC_PAGESIZE);
        const size_t body = (n + page - 1) / page * page;
        map_len = body + page;
        map = (char*)mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (map == MAP_FAILED) {
            perror("fp8nsa_emu: mmap");
            abort();
        }
        mprotect(map + body, page, PROT_NONE);
        data = map + body - ((n + 15) / 16 * 16);
        memset(data, 0xff, n);
    }
    Guarded(Guarded&& o) noexcept { *this = std::move(o); }
    Guarded& operator=(Guarded&& o) noexcept {
        std::swap(map, o.map);
        std::swap(map_len, o.map_len);
        std::swap(data, o.data);
        std::swap(bytes, o.bytes);
        return *this;
    }
    ~Guarded() {
        if (map) munmap(map, map_len);
    }
    bool holds(const void* p, size_t n) const {
        const char* c = static_cast<const char*>(p);
        return data && c >= data && c + n <= data + bytes;
    }
};

namespace {

constexpr size_t kStack = 128 * 1024;

struct Copy {
    void* dst;
    const void* src;
    bool valid;
};

enum class Op { None, Sync, Shfl, Ldm, LdmT, MmaBf16, MmaF16, MmaE4m3 };

const char* op_name(Op op) {
    switch (op) {
        case Op::None: return "none";
        case Op::Sync: return "__syncwarp";
        case Op::Shfl: return "__shfl_xor_sync";
        case Op::Ldm: return "ldmatrix";
        case Op::LdmT: return "ldmatrix.trans";
        case Op::MmaBf16: return "mma.bf16";
        case Op::MmaF16: return "mma.f16";
        case Op::MmaE4m3: return "mma.e4m3";
    }
    return "?";
}

struct Payload {
    uint32_t a[4];
    uint32_t b[2];
    float c[4];
    const void* addr;
    float f;
    int mask;
};

struct Result {
    uint32_t r[4];
    float d[4];
    float f;
};

struct Fiber {
    ucontext_t ctx;
    std::unique_ptr<char[]> stack;
    Dim3 tid{0, 0, 0};
    int lane = 0, warp = 0;
    bool done = false;
    const unsigned* wait_on = nullptr;
    unsigned wait_gen = 0;
    const char* waiting_at = "";
    std::vector<std::vector<Copy>> groups;
    std::vector<Copy> open;
};

struct WarpState {
    Op op = Op::None;
    int arrived = 0;
    int lanes = 0;
    unsigned gen = 0;
    Payload in[32];
    Result out[32];
};

struct Launch {
    Dim3 grid, block;
    unsigned smem;
    const Thunk* thunk;
    void** args;
    std::mutex err_mu;
    std::string error;
    std::atomic<bool> failed{false};
};

struct BlockState {
    Dim3 idx{0, 0, 0};
    std::vector<Fiber> fibers;
    std::vector<WarpState> warps;
    int alive = 0;
    int bar_arrived = 0;
    unsigned bar_gen = 0;
    // __syncthreads_or: the predicates of the barrier being filled, and the last one's result
    // (read by the waiters after the release, before any thread can complete another barrier)
    int bar_or = 0, bar_or_result = 0;
    Guarded dyn;
    std::map<const void*, Guarded> statics;
    std::string error;
};

thread_local Launch* L = nullptr;
thread_local BlockState* B = nullptr;
thread_local Fiber* F = nullptr;
thread_local ucontext_t sched;

std::map<std::string, Thunk>& registry() {
    static std::map<std::string, Thunk> r;
    return r;
}

/// Records the first error of the block and parks the fiber for good.
void fail(const std::string& msg) {
    if (B->error.empty()) {
        char where[96];
        snprintf(where, sizeof where, " (block %u,%u,%u thread %u)", B->idx.x, B->idx.y, B->idx.z, F->tid.x);
        B->error = msg + where;
    }
    static const unsigned never = 0;
    F->wait_on = &never;
    F->wait_gen = 0;
    swapcontext(&F->ctx, &sched);
    abort();  // never resumed
}

/// Parks the fiber until `*gen` moves on.
void wait(const unsigned* gen, const char* at) {
    F->wait_on = gen;
    F->wait_gen = *gen;
    F->waiting_at = at;
    swapcontext(&F->ctx, &sched);
}

bool in_smem(const void* p, size_t n) {
    if (B->dyn.holds(p, n)) return true;
    for (auto& kv : B->statics)
        if (kv.second.holds(p, n)) return true;
    return false;
}

float bf16_bits(uint32_t bits) {
    uint32_t w = bits << 16;
    float f;
    memcpy(&f, &w, 4);
    return f;
}

float f16_bits(uint32_t bits) {
    __half_raw h;
    h.x = (unsigned short)bits;
    return __half2float(__half(h));
}

float e4m3_bits(uint32_t bits) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)bits, __NV_E4M3);
    return __half2float(__half(h));
}

/// The collective's results for every lane, from every lane's inputs (PTX ISA semantics).
void compute(WarpState& w) {
    switch (w.op) {
        case Op::None:
        case Op::Sync:
            break;
        case Op::Shfl:
            for (int l = 0; l < 32; ++l) {
                if (w.in[l].mask != w.in[0].mask) fail("__shfl_xor_sync: lanes disagree on the lane mask");
                w.out[l].f = w.in[l ^ w.in[l].mask].f;
            }
            break;
        case Op::Ldm:
        case Op::LdmT: {
            for (int l = 0; l < 32; ++l) {
                const uintptr_t a = (uintptr_t)w.in[l].addr;
                if (a % 16 != 0 || !in_smem(w.in[l].addr, 16))
                    fail("ldmatrix: row address not 16-byte aligned inside shared memory");
            }
            auto row = [&](int m, int r) { return static_cast<const uint8_t*>(w.in[8 * m + r].addr); };
            for (int l = 0; l < 32; ++l)
                for (int m = 0; m < 4; ++m) {
                    uint32_t v;
                    if (w.op == Op::Ldm) {
                        memcpy(&v, row(m, l / 4) + 4 * (l % 4), 4);
                    } else {
                        uint16_t lo, hi;
                        memcpy(&lo, row(m, 2 * (l % 4)) + 2 * (l / 4), 2);
                        memcpy(&hi, row(m, 2 * (l % 4) + 1) + 2 * (l / 4), 2);
                        v = (uint32_t)lo | ((uint32_t)hi << 16);
                    }
                    w.out[l].r[m] = v;
                }
            break;
        }
        case Op::MmaBf16:
        case Op::MmaF16:
        case Op::MmaE4m3: {
            const bool fp8 = w.op == Op::MmaE4m3;
            const int K = fp8 ? 32 : 16;
            double A[16][32], Bm[32][8], C[16][8];
            for (int l = 0; l < 32; ++l) {
                const int g = l / 4, t = l % 4;
                const Payload& p = w.in[l];
                if (fp8) {
                    for (int j = 0; j < 4; ++j) {
                        auto byte = [&](uint32_t r) { return e4m3_bits((r >> (8 * j)) & 0xff); };
                        A[g][4 * t + j] = byte(p.a[0]);
                        A[g + 8][4 * t + j] = byte(p.a[1]);
                        A[g][16 + 4 * t + j] = byte(p.a[2]);
                        A[g + 8][16 + 4 * t + j] = byte(p.a[3]);
                        Bm[4 * t + j][g] = byte(p.b[0]);
                        Bm[16 + 4 * t + j][g] = byte(p.b[1]);
                    }
                } else {
                    auto half = [&](uint32_t r, int hi) {
                        const uint32_t bits = hi ? r >> 16 : r & 0xffff;
                        return w.op == Op::MmaBf16 ? bf16_bits(bits) : f16_bits(bits);
                    };
                    for (int h = 0; h < 2; ++h) {
                        A[g][2 * t + h] = half(p.a[0], h);
                        A[g + 8][2 * t + h] = half(p.a[1], h);
                        A[g][8 + 2 * t + h] = half(p.a[2], h);
                        A[g + 8][8 + 2 * t + h] = half(p.a[3], h);
                        Bm[2 * t + h][g] = half(p.b[0], h);
                        Bm[8 + 2 * t + h][g] = half(p.b[1], h);
                    }
                }
                C[g][2 * t] = p.c[0];
                C[g][2 * t + 1] = p.c[1];
                C[g + 8][2 * t] = p.c[2];
                C[g + 8][2 * t + 1] = p.c[3];
            }
            for (int l = 0; l < 32; ++l) {
                const int g = l / 4, t = l % 4;
                const int rows[4] = {g, g, g + 8, g + 8};
                const int cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
                for (int e = 0; e < 4; ++e) {
                    double acc = C[rows[e]][cols[e]];
                    for (int k = 0; k < K; ++k) acc += A[rows[e]][k] * Bm[k][cols[e]];
                    w.out[l].d[e] = (float)acc;
                }
            }
            break;
        }
    }
}

Result collective(Op op, const Payload& in) {
    WarpState& w = B->warps[F->warp];
    if (w.lanes != 32 && op != Op::Sync) fail(std::string(op_name(op)) + " needs a full warp");
    if (w.arrived == 0) {
        w.op = op;
    } else if (w.op != op) {
        fail(std::string("divergent warp: one lane at ") + op_name(op) + ", others at " + op_name(w.op));
    }
    w.in[F->lane] = in;
    const unsigned gen = w.gen;
    if (++w.arrived == w.lanes) {
        compute(w);
        w.arrived = 0;
        w.op = Op::None;
        ++w.gen;
    } else {
        wait(&w.gen, op_name(op));
    }
    (void)gen;
    return w.out[F->lane];
}

void trampoline() {
    (*L->thunk)(L->args);
    F->done = true;
    --B->alive;
    WarpState& w = B->warps[F->warp];
    --w.lanes;
    if (w.arrived > 0) fail("a lane exited while its warp waits in a collective");
    if (B->bar_arrived > 0 && B->bar_arrived == B->alive) {
        B->bar_arrived = 0;
        B->bar_or_result = B->bar_or;
        B->bar_or = 0;
        ++B->bar_gen;
    }
    swapcontext(&F->ctx, &sched);
    abort();  // never resumed
}

/// Runs every thread of one block to completion (or to the first error).
std::string run_block(Dim3 idx) {
    BlockState b;
    b.idx = idx;
    const unsigned n = L->block.x;
    b.fibers.resize(n);
    b.warps.resize((n + 31) / 32);
    for (unsigned w = 0; w < b.warps.size(); ++w) b.warps[w].lanes = (int)std::min(32u, n - 32 * w);
    if (L->smem > 0) b.dyn = Guarded(L->smem);
    b.alive = (int)n;
    B = &b;
    for (unsigned t = 0; t < n; ++t) {
        Fiber& f = b.fibers[t];
        f.tid = Dim3{t, 0, 0};
        f.lane = (int)(t % 32);
        f.warp = (int)(t / 32);
        f.stack.reset(new char[kStack]);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.get();
        f.ctx.uc_stack.ss_size = kStack;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, trampoline, 0);
    }
    while (b.alive > 0 && b.error.empty()) {
        bool progress = false;
        for (Fiber& f : b.fibers) {
            if (f.done || (f.wait_on && *f.wait_on == f.wait_gen)) continue;
            f.wait_on = nullptr;
            F = &f;
            swapcontext(&sched, &f.ctx);
            progress = true;
            if (!b.error.empty()) break;
        }
        if (!progress && b.error.empty()) {
            std::string msg = "deadlock: threads wait at";
            for (Fiber& f : b.fibers)
                if (!f.done) {
                    msg += std::string(" ") + std::to_string(f.tid.x) + ":" + f.waiting_at;
                    if (msg.size() > 300) break;
                }
            char where[64];
            snprintf(where, sizeof where, " (block %u,%u,%u)", idx.x, idx.y, idx.z);
            b.error = msg + where;
        }
    }
    B = nullptr;
    F = nullptr;
    return b.error;
}

}  // namespace

const Dim3& thread_idx() { return F->tid; }
const Dim3& block_idx() { return B->idx; }
const Dim3& block_dim() { return L->block; }
const Dim3& grid_dim() { return L->grid; }

void syncthreads() { syncthreads_or(0); }

int syncthreads_or(int pred) {
    for (auto& w : B->warps)
        if (w.arrived > 0 && &w == &B->warps[F->warp]) fail("__syncthreads while the warp is in a collective");
    B->bar_or |= pred != 0;
    ++B->bar_arrived;
    if (B->bar_arrived == B->alive) {
        B->bar_arrived = 0;
        B->bar_or_result = B->bar_or;
        B->bar_or = 0;
        ++B->bar_gen;
        return B->bar_or_result;
    }
    wait(&B->bar_gen, "__syncthreads");
    return B->bar_or_result;
}

void syncwarp() {
    Payload p{};
    collective(Op::Sync, p);
}

float shfl_xor(float v, int lane_mask) {
    if (lane_mask < 0 || lane_mask > 31) fail("__shfl_xor_sync: lane mask out of range");
    Payload p{};
    p.f = v;
    p.mask = lane_mask;
    return collective(Op::Shfl, p).f;
}

void cp_async_16(void* dst, const void* src, bool valid) {
    if ((uintptr_t)dst % 16 != 0 || !in_smem(dst, 16))
        fail("cp.async: destination not 16-byte aligned inside shared memory");
    if (src == nullptr) fail("cp.async: null source");
    F->open.push_back(Copy{dst, src, valid});
}

void cp_async_commit() {
    F->groups.push_back(std::move(F->open));
    F->open.clear();
}

void cp_async_wait(int pending) {
    while ((int)F->groups.size() > pending) {
        for (const Copy& c : F->groups.front()) {
            if (c.valid)
                memcpy(c.dst, c.src, 16);
            else
                memset(c.dst, 0, 16);
        }
        F->groups.erase(F->groups.begin());
    }
}

void ldmatrix_x4(uint32_t r[4], const void* row_addr, bool trans) {
    Payload p{};
    p.addr = row_addr;
    Result res = collective(trans ? Op::LdmT : Op::Ldm, p);
    for (int i = 0; i < 4; ++i) r[i] = res.r[i];
}

void mma(float d[4], const uint32_t a[4], const uint32_t b[2], MmaKind kind) {
    Payload p{};
    for (int i = 0; i < 4; ++i) {
        p.a[i] = a[i];
        p.c[i] = d[i];
    }
    p.b[0] = b[0];
    p.b[1] = b[1];
    const Op op = kind == MmaKind::Bf16 ? Op::MmaBf16 : kind == MmaKind::F16 ? Op::MmaF16 : Op::MmaE4m3;
    Result res = collective(op, p);
    for (int i = 0; i < 4; ++i) d[i] = res.d[i];
}

void* dynamic_smem() { return B->dyn.data; }

void* static_smem(const void* key, size_t bytes) {
    auto it = B->statics.find(key);
    if (it == B->statics.end()) it = B->statics.emplace(key, Guarded(bytes)).first;
    return it->second.data;
}

void register_kernel(const char* name, Thunk thunk) { registry()[name] = std::move(thunk); }

}  // namespace fp8nsa_emu

using fp8nsa_emu::Dim3;

/// Runs kernel `name` over the grid, blocks spread over `workers` threads. `args` as for
/// cuLaunchKernel: one pointer per parameter. Returns 0, or 1 with the first error in `err`.
extern "C" int fp8nsa_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned block,
                                 unsigned smem, void** args, unsigned workers, char* err, size_t err_len) {
    using namespace fp8nsa_emu;
    auto it = registry().find(name);
    if (it == registry().end()) {
        snprintf(err, err_len, "no kernel %s in the emulator", name);
        return 1;
    }
    Launch launch;
    launch.grid = Dim3{gx, gy, gz};
    launch.block = Dim3{block, 1, 1};
    launch.smem = smem;
    launch.thunk = &it->second;
    launch.args = args;
    const unsigned long total = (unsigned long)gx * gy * gz;
    std::atomic<unsigned long> next{0};
    auto work = [&]() {
        L = &launch;
        for (unsigned long i; !launch.failed && (i = next++) < total;) {
            Dim3 idx{(unsigned)(i % gx), (unsigned)(i / gx % gy), (unsigned)(i / gx / gy)};
            std::string e = run_block(idx);
            if (!e.empty()) {
                std::lock_guard<std::mutex> g(launch.err_mu);
                if (launch.error.empty()) launch.error = e;
                launch.failed = true;
            }
        }
        L = nullptr;
    };
    std::vector<std::thread> pool;
    for (unsigned w = 1; w < std::max(1u, workers); ++w) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    if (!launch.error.empty()) {
        snprintf(err, err_len, "%s: %s", name, launch.error.c_str());
        return 1;
    }
    return 0;
}

extern "C" int fp8nsa_emu_has_kernel(const char* name) { return fp8nsa_emu::registry().count(name) ? 1 : 0; }

// The kernels, as C++.
#include "../kernels/fp8_quant.cu"
#include "../kernels/fp8_gemv.cu"
#include "../kernels/fp8_gemm.cu"
#include "../kernels/nsa_selection.cu"

// "Device" memory for the emulator's callers: bytes that end at a PROT_NONE page.
namespace {
std::mutex g_alloc_mu;
std::map<void*, fp8nsa_emu::Guarded>& allocations() {
    static std::map<void*, fp8nsa_emu::Guarded> a;
    return a;
}
}  // namespace

extern "C" void* fp8nsa_emu_alloc(size_t bytes) {
    fp8nsa_emu::Guarded g(bytes == 0 ? 1 : bytes);
    void* p = g.data;
    std::lock_guard<std::mutex> l(g_alloc_mu);
    allocations().emplace(p, std::move(g));
    return p;
}

extern "C" void fp8nsa_emu_free(void* p) {
    std::lock_guard<std::mutex> l(g_alloc_mu);
    allocations().erase(p);
}
