// A CPU emulation of the CUDA execution model, just enough for ggml-cuda/sparse-attn.cu (tests/test_cuda_emulated.py):
// every CUDA thread of a block is a fiber (started with ucontext, switched with _setjmp/_longjmp) in one OS thread, blocks run one after another, __syncthreads
// and __syncwarp are barriers (a block barrier opens when every thread that has not exited waits at it), warp
// shuffles and ballots exchange values through a per-block buffer between two warp barriers, and between barriers
// the fibers run in a random order, so a read that misses a barrier can show. __shared__ variables become function
// statics (one block at a time), dynamic shared memory one buffer of 48 KiB, filled with 0xFF bytes before each
// block, as is the pool's scratch (NaN floats, -1 ints), so that a read of something not written shows. A launch
// with more than 1024 threads, more dynamic shared memory than 48 KiB or a grid dimension above 65535 aborts.
// What it cannot show: anything of the hardware (coalescing, bank conflicts, occupancy, registers), the fp32
// rounding of the GPU's own exp/sqrt/division under -use_fast_math, and races within a warp's lockstep execution.
#pragma once

#include <algorithm>
#include <atomic>
#include <functional>
#include <csetjmp>
#include <ucontext.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "ggml.h"
#include "ggml-impl.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __CUDA_ARCH__ 900 // the code paths of current GPUs
#define GGML_CUDA_CC_VOLTA 700
#define WARP_SIZE 32
#define CUDA_CHECK(x) (void) (x)

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x = 1, unsigned y = 1, unsigned z = 1) : x(x), y(y), z(z) {}
};
struct emu_fiber;
inline std::vector<emu_fiber> * g_fibers = nullptr;
inline int g_cur = 0;
#define threadIdx ((*g_fibers)[g_cur].tidx)
inline dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

typedef void * cudaStream_t;
inline int cudaGetLastError() { return 0; }

struct int4 { int x, y, z, w; };
inline int4 make_int4(int x, int y, int z, int w) { return { x, y, z, w }; }
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return { x, y }; }
struct half { uint16_t bits; };
inline float __half2float(half h) { return ggml_fp16_to_fp32(h.bits); }
struct half2 { half x, y; };
inline float2 __half22float2(half2 h) { return { __half2float(h.x), __half2float(h.y) }; }

inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int) x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
// shared and global memory alike (blocks run one after another, so a grid's atomics on global memory are exact)
inline int atomicAdd(int * p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicOr(unsigned * p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicMax(unsigned * p, unsigned v) { unsigned o = *p; *p = o > v ? o : v; return o; }

// one OS thread: the CUDA threads of a block are fibers run in turn until each is done or waits at a barrier;
// a warp barrier opens when every lane of the warp that has not exited waits at it, the block barrier when every
// thread that has not exited waits at it
struct emu_fiber {
    ucontext_t ctx;     // to start the fiber on its stack
    jmp_buf    env;     // where it waits: switches by _setjmp/_longjmp, without swapcontext's system calls
    dim3 tidx;
    bool started = false;
    bool done = false;
    int  wait = 0; // 1: __syncthreads, 2: __syncwarp
    char * stack = nullptr;
};
struct emu_block {
    uint64_t slot[1024];
};
inline emu_block g_blk_storage;
inline emu_block * g_blk = &g_blk_storage;
alignas(16) inline char emu_dyn_smem_buf[48*1024];
inline char * emu_dyn_smem = emu_dyn_smem_buf;
inline jmp_buf g_sched;
inline std::function<void()> g_body;

inline void emu_wait(int kind) {
    emu_fiber & f = (*g_fibers)[g_cur];
    f.wait = kind;
    if (!_setjmp(f.env)) {
        _longjmp(g_sched, 1);
    }
}
inline void __syncthreads() { emu_wait(1); }
inline void __syncwarp(unsigned = 0xFFFFFFFF) { emu_wait(2); }

template <typename T> inline T emu_from_lane(T v, int src_lane) {
    static_assert(sizeof(T) <= 8, "slot");
    const int tid = threadIdx.x;
    memcpy(&g_blk->slot[tid], &v, sizeof(T));
    __syncwarp();
    T r;
    memcpy(&r, &g_blk->slot[(tid & ~31) + src_lane], sizeof(T));
    __syncwarp();
    return r;
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int off, int width = 32) {
    const int lane = threadIdx.x % 32;
    (void) width;
    return emu_from_lane(v, lane ^ off);
}
template <typename T> inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
    (void) width;
    return emu_from_lane(v, src);
}
template <typename T> inline T __shfl_up_sync(unsigned, T v, int off, int width = 32) {
    const int lane = threadIdx.x % 32;
    (void) width;
    return emu_from_lane(v, lane >= off ? lane - off : lane);
}
// the lanes whose value equals this lane's
inline unsigned __match_any_sync(unsigned, int v) {
    const int tid = threadIdx.x;
    g_blk->slot[tid] = (uint64_t) (uint32_t) v;
    __syncwarp();
    unsigned r = 0;
    for (int l = 0; l < 32; ++l) {
        r |= (g_blk->slot[(tid & ~31) + l] == (uint64_t) (uint32_t) v ? 1u : 0u) << l;
    }
    __syncwarp();
    return r;
}
inline unsigned __ballot_sync(unsigned, int pred) {
    const int tid = threadIdx.x;
    g_blk->slot[tid] = pred ? 1 : 0;
    __syncwarp();
    unsigned r = 0;
    for (int l = 0; l < 32; ++l) {
        r |= (g_blk->slot[(tid & ~31) + l] ? 1u : 0u) << l;
    }
    __syncwarp();
    return r;
}

// common.cuh
template <int width = WARP_SIZE> inline float warp_reduce_sum(float x) {
    for (int o = width/2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o, width);
    return x;
}
template <int width = WARP_SIZE> inline int warp_reduce_sum(int x) {
    for (int o = width/2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffff, x, o, width);
    return x;
}
template <int width = WARP_SIZE> inline float warp_reduce_max(float x) {
    for (int o = width/2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, o, width));
    return x;
}
template <typename T, int width = WARP_SIZE> inline T warp_prefix_inclusive_sum(T x) {
    const int lane = threadIdx.x % width;
    for (int o = 1; o < width; o <<= 1) {
        const T t = __shfl_up_sync(0xffffffff, x, o, width);
        if (lane >= o) x += t;
    }
    return x;
}
enum class block_reduce_method { MAX, SUM };
template <block_reduce_method m, const unsigned int bs = 0, typename T> inline T block_reduce(T val, T * shared_vals) {
    auto red = [](T v) {
        if constexpr (m == block_reduce_method::SUM) return warp_reduce_sum(v); else return warp_reduce_max(v);
    };
    const T sentinel = m == block_reduce_method::SUM ? T(0) : T(-INFINITY);
    val = red(val);
    const unsigned block_size = bs == 0 ? blockDim.x : bs;
    if (blockDim.x != block_size) { fprintf(stderr, "block_reduce: blockDim %u != %u\n", blockDim.x, block_size); abort(); }
    if (block_size > 32) {
        const int w = threadIdx.x / 32, l = threadIdx.x % 32;
        if (l == 0) shared_vals[w] = val;
        __syncthreads();
        val = sentinel;
        if (l < (int) (block_size/32)) val = shared_vals[l];
        return red(val);
    }
    return val;
}

// fattn-common.cuh dequantizers (host)
typedef void (*dequantize_V_t)(const void *, void *, const int64_t);
struct emu_block_q8_0 { uint16_t d; int8_t qs[32]; };
static_assert(sizeof(emu_block_q8_0) == 34, "q8_0");
template <typename T, int ne> inline void emu_dq_f16(const void * vx, void * dst, const int64_t i0) {
    const uint16_t * x = (const uint16_t *) vx + i0;
    if (((uintptr_t) x) % (ne*2) != 0) { fprintf(stderr, "misaligned f16 load\n"); abort(); }
    for (int l = 0; l < ne; ++l) ((float *) dst)[l] = ggml_fp16_to_fp32(x[l]);
}
template <typename T, int ne> inline void emu_dq_q8_0(const void * vx, void * dst, const int64_t i0) {
    const emu_block_q8_0 * x = (const emu_block_q8_0 *) vx;
    const int64_t ib = i0/32; const int iqs = i0%32;
    if (iqs + ne > 32) { fprintf(stderr, "q8_0 load crosses a block\n"); abort(); }
    const float d = ggml_fp16_to_fp32(x[ib].d);
    for (int l = 0; l < ne; ++l) ((float *) dst)[l] = d*x[ib].qs[iqs + l];
}
template <ggml_type type_V, typename T, int ne> constexpr dequantize_V_t get_dequantize_V() {
    if constexpr (type_V == GGML_TYPE_F16) return emu_dq_f16<T, ne>;
    else if constexpr (type_V == GGML_TYPE_Q8_0) return emu_dq_q8_0<T, ne>;
    else return nullptr;
}

// pool, context, device info
struct ggml_cuda_pool {
    size_t in_use = 0;
    void * alloc(size_t size, size_t * actual) {
        *actual = size;
        in_use += size;
        void * p = malloc(size);
        memset(p, 0xFF, size);
        return p;
    }
    void free(void * p, size_t size) { in_use -= size; ::free(p); }
};
template <typename T> struct ggml_cuda_pool_alloc {
    ggml_cuda_pool * pool = nullptr;
    T * ptr = nullptr;
    size_t actual_size = 0;
    ggml_cuda_pool_alloc(ggml_cuda_pool & pool, size_t size) : pool(&pool) { ptr = (T *) pool.alloc(size*sizeof(T), &actual_size); }
    ~ggml_cuda_pool_alloc() { if (ptr) pool->free(ptr, actual_size); }
    T * get() { return ptr; }
};
struct ggml_backend_cuda_context {
    int device = 0;
    ggml_cuda_pool p;
    ggml_cuda_pool & pool() { return p; }
    cudaStream_t stream() { return nullptr; }
};
struct ggml_cuda_device_info { struct { int nsm; } devices[1]; };
inline int g_emu_nsm = 132;
inline const ggml_cuda_device_info & ggml_cuda_info() { static ggml_cuda_device_info i; i.devices[0].nsm = g_emu_nsm; return i; }

inline long g_emu_blocks = 0;

inline void emu_trampoline() {
    g_body();
    (*g_fibers)[g_cur].done = true;
    _longjmp(g_sched, 1);
}

inline void emu_run_block(unsigned nthreads) {
    static std::vector<emu_fiber> fibers(1024);
    constexpr size_t STACK = 256*1024;
    g_fibers = &fibers;
    for (unsigned t = 0; t < nthreads; ++t) {
        emu_fiber & f = fibers[t];
        if (!f.stack) {
            f.stack = (char *) malloc(STACK);
            getcontext(&f.ctx);
        }
        f.tidx = dim3(t);
        f.started = false;
        f.done = false;
        f.wait = 0;
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, emu_trampoline, 0);
    }
    // the fibers run in a random order between barriers, so a read that misses a barrier can show
    static std::vector<unsigned> order;
    static uint64_t rng = 0x9E3779B97F4A7C15ull;
    order.resize(nthreads);
    for (unsigned t = 0; t < nthreads; ++t) order[t] = t;
    for (;;) {
        for (unsigned t = nthreads - 1; t > 0; --t) {
            rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
            std::swap(order[t], order[rng % (t + 1)]);
        }
        for (unsigned u = 0; u < nthreads; ++u) {
            const unsigned t = order[u];
            if (!fibers[t].done && fibers[t].wait == 0) {
                g_cur = (int) t;
                if (!_setjmp(g_sched)) {
                    if (!fibers[t].started) {
                        fibers[t].started = true;
                        setcontext(&fibers[t].ctx);
                    }
                    _longjmp(fibers[t].env, 1);
                }
            }
        }
        bool all_done = true, released = false;
        for (unsigned w = 0; w < nthreads/32; ++w) {
            bool any = false, all = true;
            for (unsigned l = 0; l < 32; ++l) {
                const emu_fiber & f = fibers[w*32 + l];
                if (f.done) continue;
                any = true;
                all = all && f.wait == 2;
            }
            if (any && all) {
                for (unsigned l = 0; l < 32; ++l) fibers[w*32 + l].wait = 0;
                released = true;
            }
        }
        if (!released) {
            bool any = false, all = true;
            for (unsigned t = 0; t < nthreads; ++t) {
                if (fibers[t].done) continue;
                any = true;
                all = all && fibers[t].wait == 1;
            }
            if (any && all) {
                for (unsigned t = 0; t < nthreads; ++t) fibers[t].wait = 0;
                released = true;
            }
        }
        for (unsigned t = 0; t < nthreads; ++t) all_done = all_done && fibers[t].done;
        if (all_done) break;
        if (!released) {
            fprintf(stderr, "deadlock in block %u %u %u: threads wait at different barriers\n", blockIdx.x, blockIdx.y, blockIdx.z);
            abort();
        }
    }
}

template <typename... KA, typename... A>
inline void emu_launch(void (*k)(KA...), dim3 grid, dim3 block, size_t smem, cudaStream_t, A &&... args) {
    if (block.x > 1024 || block.x % 32 != 0 || block.y != 1 || smem > sizeof(emu_dyn_smem_buf) || grid.y > 65535 || grid.z > 65535 || grid.x == 0) {
        fprintf(stderr, "bad launch: grid %u %u %u block %u smem %zu\n", grid.x, grid.y, grid.z, block.x, smem);
        abort();
    }
    blockDim = block;
    gridDim  = grid;
    g_body = [&]() { k(args...); };
    for (unsigned z = 0; z < grid.z; ++z) for (unsigned y = 0; y < grid.y; ++y) for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = dim3(x, y, z);
        memset(emu_dyn_smem_buf, 0xFF, sizeof(emu_dyn_smem_buf));
        emu_run_block(block.x);
        g_emu_blocks++;
    }
}
