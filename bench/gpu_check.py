"""A bundle that checks the sparse attention op's CUDA kernels on a machine with a GPU (`make gpu-check`).

The CUDA kernels of GGML_OP_SPARSE_ATTN are compiled in CI (tests/test_cuda_compile.py) and run there under an
emulation of CUDA's thread model, but only a GPU can run them. This writes a self-contained folder (default
`.sparq-build/gpu-check`, about 4 MiB) that such a machine needs, with no network and no package index:

  llama-trimmed.tar.gz  the patched llama.cpp of the current series, trimmed to what the checks build: ggml (CPU and
                        CUDA backends), libllama (src/, include/), common/, tools/llama-bench,
                        tests/test-backend-ops.cpp and the vendored libraries common needs, with CMake lists cut
                        down to those targets (tests/, tools/, vendor/) and `sparq-ops/` (ggml and test-backend-ops
                        alone, the fallback when the whole tree does not configure); `sparq/` holds a copy-bandwidth
                        program (bw.cu), the model writer (write_model.py) and the Python it runs: this checkout's
                        sparq_cpp package and the gguf package it writes with (numpy, tqdm, pyyaml and requests
                        come from the machine's Python)
  run.sh                the check as stages under one deadline (`run.sh --help`): env, unpack, model (an 8-layer
                        Llama 2 7B-shaped q8_0 model, written there in the background), configure, build
                        (ggml-cuda and test-backend-ops), test (`test-backend-ops -o SPARSE_ATTN -b CUDA0`),
                        opbench (the op's perf cases beside flash attention), bandwidth, build-e2e (libllama, common,
                        llama-bench, in the background), e2e (llama-bench dense against SparQ at 4k-64k); each stage
                        has its own time limit from what is left, every stage runs whatever failed before it, logs
                        grow as written and summary.json (stage, status, seconds, key numbers) is rewritten after
                        each stage, into $OUT; `run.sh --dry-run` plans every stage and runs nothing
  SERIES                series hash, tarball digest, patch names (the work folder `<bundle>-work` is reused when
                        it matches)

On the GPU machine: `OUT=/some/dir .sparq-build/gpu-check/run.sh` (at most 570 s by default, `--budget`). Here:
`python -m bench.gpu_check --dry-run` writes the bundle and prints the plan; `dry_run(bundle)` returns it.

The patched tree is taken as tests/test_cuda_compile.py takes it: `--tree DIR` (a `make tree` checkout), else the
installed build's tree if it was built from the current series, else the pinned sdist unpacked with the series
applied.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import click
import gguf

from sparq_cpp.pyext.build import installed_build
from sparq_cpp.pyext.patchtree import patch_tree, series, series_hash
from sparq_cpp.pyext.upstream import REPO_ROOT, fetch_sdist, unpack_sdist

DEFAULT_OUT = REPO_ROOT / ".sparq-build" / "gpu-check"
DEFAULT_BUDGET = 570  # seconds: the device runs one command for at most 600
# what travels to the device with the working tree, at most
TREE_LIMIT = 64 * 2**20

# what of ggml/src a CPU + CUDA build reads: its own files and these backend folders
GGML_SRC_DIRS = ("ggml-cpu", "ggml-cuda")
# the parts of the patched tree the bundle carries (folders whole, except ggml/src's other backends)
TREE_PARTS = ("CMakeLists.txt", "LICENSE", "cmake", "include", "src", "common", "ggml", "tools/llama-bench",
              "tests/test-backend-ops.cpp", "vendor/nlohmann", "vendor/sheredom", "vendor/cpp-httplib")
# sparq_cpp.calib's modules the model writer needs (the Loki projection), and the package's __init__ in the bundle
CALIB_FILES = ("pca.py", "projection.py")
CALIB_INIT = '''"""Loki projection writing (the bundle's copy of sparq_cpp.calib: pca and projection only)."""\n'''
STAGES = ("env", "unpack", "model", "configure", "build", "build-e2e", "test", "opbench", "bandwidth", "e2e", "profile")
BACKGROUND_STAGES = ("model", "build-e2e")

# CMake lists that replace the upstream ones of the folders the bundle trims
TESTS_CMAKELISTS = """\
# test-backend-ops and the GPU check's op bench only (the sparq-cpp GPU check); they need ggml alone
add_executable(test-backend-ops test-backend-ops.cpp)
target_link_libraries(test-backend-ops PRIVATE ggml)
target_compile_features(test-backend-ops PRIVATE cxx_std_17)
add_executable(sparq-op-bench ${CMAKE_SOURCE_DIR}/sparq/op-bench.cpp)
target_link_libraries(sparq-op-bench PRIVATE ggml)
target_compile_features(sparq-op-bench PRIVATE cxx_std_17)
"""

TOOLS_CMAKELISTS = """\
# llama-bench only (the sparq-cpp GPU check)
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(llama-bench)
"""

VENDOR_CMAKELISTS = """\
# what libllama and common need (the sparq-cpp GPU check)
add_subdirectory(nlohmann)
add_subdirectory(sheredom)
if (LLAMA_BUILD_COMMON)
    add_subdirectory(cpp-httplib)
endif()
"""

OPS_CMAKELISTS = """\
# ggml (CPU and CUDA backends) and test-backend-ops alone: the GPU check's fallback when the whole tree does not configure
cmake_minimum_required(VERSION 3.14)
project(sparq-gpu-check-ops C CXX)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_subdirectory(../ggml ggml)
add_executable(test-backend-ops ../tests/test-backend-ops.cpp)
target_link_libraries(test-backend-ops PRIVATE ggml)
target_compile_features(test-backend-ops PRIVATE cxx_std_17)
add_executable(sparq-op-bench ../sparq/op-bench.cpp)
target_link_libraries(sparq-op-bench PRIVATE ggml)
target_compile_features(sparq-op-bench PRIVATE cxx_std_17)
"""

BW_CU = r"""// The GPU's copy bandwidth (the sparq-cpp GPU check): device-to-device copies of one buffer, counting the bytes
// read and written, by cudaMemcpyAsync and by a plain 16-byte-per-thread kernel. bw [MiB] [repeats]
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void copy16(const int4 * __restrict__ a, int4 * __restrict__ b, size_t n) {
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n; i += (size_t) gridDim.x * blockDim.x) {
        b[i] = a[i];
    }
}

int main(int argc, char ** argv) {
    const size_t mib  = argc > 1 ? strtoull(argv[1], nullptr, 10) : 1024;
    const int    reps = argc > 2 ? atoi(argv[2]) : 20;
    const size_t bytes = mib << 20;
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    printf("device %s, cc %d.%d, %d SMs, L2 %d MiB, %zu MiB global\n", p.name, p.major, p.minor,
           p.multiProcessorCount, p.l2CacheSize >> 20, p.totalGlobalMem >> 20);
    void * a = nullptr;
    void * b = nullptr;
    CK(cudaMalloc(&a, bytes));
    CK(cudaMalloc(&b, bytes));
    CK(cudaMemset(a, 1, bytes));
    CK(cudaMemset(b, 0, bytes));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float ms = 0.0f;

    CK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e0));
    for (int i = 0; i < reps; i++) {
        CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    }
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&ms, e0, e1));
    printf("copy_gb_s %.1f (cudaMemcpy device to device, %zu MiB x %d, bytes read + written)\n",
           2.0 * bytes * reps / (ms * 1e-3) / 1e9, mib, reps);

    const size_t n = bytes / sizeof(int4);
    const int blocks = p.multiProcessorCount * 8;
    copy16<<<blocks, 512>>>((const int4 *) a, (int4 *) b, n);
    CK(cudaGetLastError());
    CK(cudaEventRecord(e0));
    for (int i = 0; i < reps; i++) {
        copy16<<<blocks, 512>>>((const int4 *) a, (int4 *) b, n);
    }
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&ms, e0, e1));
    printf("kernel_copy_gb_s %.1f (16-byte loads and stores, %d blocks of 512, bytes read + written)\n",
           2.0 * bytes * reps / (ms * 1e-3) / 1e9, blocks);
    return 0;
}
"""

OP_BENCH_CPP = r"""// The sparse attention op beside flash attention at batch 1, over many layers' caches (the sparq-cpp GPU check). Each
// timed pass runs the op once per layer, each layer on its own K, V, K^T and mean of V, so that what a pass reads is
// larger than the GPU's L2 cache, as in a model's decode step (test-backend-ops perf repeats the op on one set of
// tensors, whose parts that fit stay in L2). Inputs are random (K^T is not K's transpose: timing only).
//
// Three ops per case: "sparq", the fused GGML_OP_SPARSE_ATTN; "sparq-composed", the same SparQ step built from
// existing ggml ops only (build_sparq_composed below: it runs on any backend that has them); "flash",
// ggml_flash_attn_ext over the whole cache.
//
//   sparq-op-bench [-b CUDA0] [-l LAYERS] [-r REPS] [-t THREADS] [--types f16,q8_0] [--kv 4096,16384,32768]
//                  [--nh 8,32] [--hq 32] [--hs 128] [--r 16] [--k 128] [--local 32]
//                  [--ops sparq,sparq-composed,flash]
//   sparq-op-bench --check DIR [-b CPU] [--types f16] [--kv N] [--nh N] [--hq N] [--hs D] [--r R] [--k K]
//                  [--local L] [--mean 1]
// -l 0 (the default): per case, enough layers (at least 8) that SparQ reads 256 MiB per pass, five times an H100's
// L2, within half the device's free memory.
// One line per case and op: op, cache type, KV heads, cells, layers, microseconds per layer, the bytes the op reads
// from the cache per layer (SparQ, fused or composed: r rows of K^T and k rows of K and V per KV head; flash
// attention: K and V) and the rate they give; the composed op also gives scratch_bytes_per_layer, the bytes its
// intermediate tensors take (each written once and read at least once, beside the cache reads).
// --check DIR: one case (the first of each list), on the inputs in DIR: q.f32 [hq][hs], k.f32 and v.f32
// [nh][kv][hs] (float32, little endian); K and V stored in the cache type, K^T the f16 transpose of K, the mean of V
// computed from V as stored, every cell visible, token position = cell index. Writes DIR/fused.f32 and
// DIR/composed.f32 (the results, [hq][hs]), DIR/sel.i32 (the composed path's selected cells, [nh][min(k, kv)], in
// top_k's order), DIR/k_stored.f32 and DIR/v_stored.f32 (K and V as the cache holds them, in f32).
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static std::vector<std::string> split(const std::string & s) {
    std::vector<std::string> out;
    size_t a = 0;
    while (a <= s.size()) {
        size_t b = s.find(',', a);
        if (b == std::string::npos) {
            b = s.size();
        }
        if (b > a) {
            out.push_back(s.substr(a, b - a));
        }
        a = b + 1;
    }
    return out;
}

// a random byte pattern of the type (whole blocks, made once per type), tiled over the tensor
static void fill_random(ggml_tensor * t) {
    static std::vector<uint8_t> pats[GGML_TYPE_COUNT];
    const size_t blck_bytes = ggml_type_size(t->type);
    const size_t chunk      = (size_t(8) << 20) / blck_bytes * blck_bytes;
    std::vector<uint8_t> & pat = pats[t->type];
    if (pat.empty()) {
        std::mt19937 gen(42 + t->type);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        std::uniform_int_distribution<int> code(-127, 127);
        pat.resize(chunk);
        if (t->type == GGML_TYPE_F32) {
            for (size_t i = 0; i < chunk / 4; ++i) {
                const float x = u(gen);
                memcpy(&pat[4*i], &x, 4);
            }
        } else if (t->type == GGML_TYPE_F16) {
            for (size_t i = 0; i < chunk / 2; ++i) {
                const ggml_fp16_t x = ggml_fp32_to_fp16(u(gen));
                memcpy(&pat[2*i], &x, 2);
            }
        } else if (t->type == GGML_TYPE_Q8_0) {
            const ggml_fp16_t d = ggml_fp32_to_fp16(1.0f/127.0f);
            for (size_t b = 0; b < chunk / blck_bytes; ++b) {
                memcpy(&pat[b*blck_bytes], &d, 2);
                for (size_t i = 2; i < blck_bytes; ++i) {
                    pat[b*blck_bytes + i] = (uint8_t) (int8_t) code(gen);
                }
            }
        } else {
            fprintf(stderr, "fill_random: type %s\n", ggml_type_name(t->type));
            exit(1);
        }
    }
    const size_t n = ggml_nbytes(t);
    for (size_t off = 0; off < n; off += chunk) {
        ggml_backend_tensor_set(t, pat.data(), off, std::min(chunk, n - off));
    }
}

// SparQ (SPEC.md steps 1-5) for one token (n_batch 1) from existing ggml ops, every cell visible, token position =
// cell index (the n_local most recent cells are the last ones: local_bias, [n_kv, 1] f32, holds a value larger than
// any group sum there and 0 elsewhere; NULL when n_local = 0). Shapes as in ggml_sparq_attn; query head h*g + j
// belongs to KV head h. Returns the result [DV, n_head, 1, 1] and, in *sel, the selected cells [min(top_k, n_kv),
// n_head_kv] (i32, in top_k's order). Differences from the fused op: ties (ggml_top_k's order is unspecified, the
// op breaks them towards the more recent position) and float rounding; a group whose selected |q| components are
// all 0 gives NaN here (the op uses a zero scale).
static ggml_tensor * build_sparq_composed(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * kt,
                                          ggml_tensor * v, ggml_tensor * vmean, ggml_tensor * local_bias, float scale,
                                          int r, int top_k, bool mean_value, ggml_tensor ** sel) {
    const int64_t D    = k->ne[0];
    const int64_t n_kv = k->ne[1];
    const int64_t nh   = k->ne[2];
    const int64_t hq   = q->ne[2];
    const int64_t g    = hq / nh;
    const int64_t kk   = std::min<int64_t>(top_k, n_kv);

    ggml_tensor * q3 = ggml_reshape_3d(ctx, q, D, g, nh);                                      // [D, g, nh]
    ggml_tensor * qt = ggml_cont(ctx, ggml_transpose(ctx, q3));                                // [g, D, nh]: a row per component

    // 1. the r components with the largest sum of |q_j| over the group
    ggml_tensor * a     = ggml_sum_rows(ctx, ggml_abs(ctx, qt));                               // [1, D, nh]
    ggml_tensor * comps = ggml_top_k(ctx, ggml_reshape_2d(ctx, a, D, nh), r);                  // [r, nh] i32

    // 2. approximate scores q_j[i1] . K^T[i1] * scale*sqrt(D)/tau_j, tau_j = sqrt(D*|q_j[i1]|_1/|q_j|_1), and their
    //    softmax over the cells
    ggml_tensor * qs  = ggml_get_rows(ctx, qt, comps);                                         // [g, r, nh]
    ggml_tensor * l1  = ggml_sum_rows(ctx, ggml_abs(ctx, q3));                                 // [1, g, nh]
    ggml_tensor * l1s = ggml_sum_rows(ctx, ggml_abs(ctx, ggml_cont(ctx, ggml_transpose(ctx, qs))));
    ggml_tensor * s   = ggml_scale(ctx, ggml_sqrt(ctx, ggml_div(ctx, l1, l1s)), scale);        // [1, g, nh]
    qs = ggml_mul(ctx, qs, ggml_reshape_3d(ctx, s, g, 1, nh));
    ggml_tensor * ktr = ggml_get_rows(ctx, kt, comps);                                         // [n_kv, r, nh] f32
    ggml_tensor * p   = ggml_soft_max(ctx, ggml_out_prod(ctx, ktr, qs));                       // [n_kv, g, nh]

    // 3. the group sum of s_hat, the n_local most recent cells forced in, the top k
    ggml_tensor * pt   = g > 1 ? ggml_cont(ctx, ggml_transpose(ctx, p)) : ggml_reshape_3d(ctx, p, 1, n_kv, nh);  // [g, n_kv, nh]
    ggml_tensor * ssum = g > 1 ? ggml_reshape_2d(ctx, ggml_sum_rows(ctx, pt), n_kv, nh) : ggml_reshape_2d(ctx, p, n_kv, nh);
    if (local_bias && kk < n_kv) {
        ssum = ggml_add(ctx, ssum, local_bias);
    }
    *sel = ggml_top_k(ctx, ssum, (int) kk);                                                    // [kk, nh] i32

    // 4. exact attention over the selected cells
    ggml_tensor * ks = ggml_get_rows(ctx, k, *sel);                                            // [D, kk, nh] f32
    ggml_tensor * vs = ggml_get_rows(ctx, v, *sel);                                            // [DV, kk, nh] f32
    ggml_tensor * kq = ggml_soft_max_ext(ctx, ggml_mul_mat(ctx, ks, q3), nullptr, scale, 0.0f); // [kk, g, nh]
    ggml_tensor * y  = ggml_mul_mat(ctx, ggml_cont(ctx, ggml_transpose(ctx, vs)), kq);         // [DV, g, nh]

    // 5. y = alpha*y + (1 - alpha)*mean of V, alpha_j = the approximate score mass of the selected cells (1 when every
    //    cell is selected)
    if (mean_value && kk < n_kv) {
        ggml_tensor * alpha = ggml_sum_rows(ctx, ggml_cont(ctx, ggml_transpose(ctx, ggml_get_rows(ctx, pt, *sel))));  // [1, g, nh]
        ggml_tensor * vm    = ggml_reshape_3d(ctx, vmean, v->ne[0], 1, nh);
        y = ggml_add(ctx, ggml_mul(ctx, ggml_sub(ctx, y, vm), alpha), vm);
    }
    return ggml_reshape_4d(ctx, y, v->ne[0], hq, 1, 1);
}

enum bench_op { OP_SPARQ, OP_COMPOSED, OP_FLASH };
static const char * op_name(bench_op op) {
    return op == OP_SPARQ ? "sparq" : op == OP_COMPOSED ? "sparq-composed" : "flash";
}

struct result {
    bool   ok = false;
    double us_per_layer = 0.0;
    double bytes_per_layer = 0.0;
    double scratch_bytes_per_layer = 0.0;
};

static double sparq_bytes(ggml_type type, int64_t hs, int64_t nh, int64_t kv, int r, int top_k) {
    return nh*(double(kv)*r*2 + 2.0*std::min<int64_t>(top_k, kv)*(double) ggml_row_size(type, hs));
}

// layers <= 0: enough that SparQ reads 256 MiB per pass (at least 8, at most 1024), within half the free memory
static int layers_for(ggml_backend_t be, int layers, ggml_type type, int64_t hs, int64_t nh, int64_t kv, int r, int top_k) {
    if (layers > 0) {
        return layers;
    }
    const double per_pass = 256.0*1024*1024;
    int n = (int) std::ceil(per_pass / sparq_bytes(type, hs, nh, kv, r, top_k));
    n = std::max(8, std::min(1024, n));
    size_t free_mem = 0, total_mem = 0;
    ggml_backend_dev_t dev = ggml_backend_get_device(be);
    if (dev) {
        ggml_backend_dev_memory(dev, &free_mem, &total_mem);
    }
    const double per_layer = 2.0*nh*kv*(double) ggml_row_size(type, hs) + 2.0*nh*kv*hs;  // K, V, K^T
    if (free_mem > 0) {
        n = std::max(1, std::min(n, (int) (0.5*free_mem / per_layer)));
    }
    return n;
}

static bool is_view(const ggml_tensor * t) {
    return t->op == GGML_OP_NONE || t->op == GGML_OP_VIEW || t->op == GGML_OP_RESHAPE || t->op == GGML_OP_PERMUTE ||
           t->op == GGML_OP_TRANSPOSE;
}

// the case's tensors: inputs (their own buffer) and the graph (placed by the graph allocator, which reuses the
// memory of intermediate tensors from layer to layer, as llama.cpp's graphs do)
struct bench_graph {
    ggml_context * ctx_in = nullptr;
    ggml_context * ctx_g  = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    ggml_gallocr_t galloc = nullptr;
    ggml_cgraph * gf = nullptr;
    ggml_tensor * q = nullptr, * m = nullptr, * pos = nullptr, * bias = nullptr;
    std::vector<std::vector<ggml_tensor *>> per_layer;  // K, V (, K^T, mean of V) of each layer
    std::vector<ggml_tensor *> outs, sels;
    double scratch_bytes = 0.0;  // the intermediate tensors of one layer (composed)

    ~bench_graph() {
        if (galloc) ggml_gallocr_free(galloc);
        if (buf) ggml_backend_buffer_free(buf);
        if (ctx_g) ggml_free(ctx_g);
        if (ctx_in) ggml_free(ctx_in);
    }
};

// builds and allocates the graph; false if the backend lacks an op or memory runs out
static bool build_case(bench_graph & bg, ggml_backend_t be, bench_op op, ggml_type type, int64_t hs, int64_t nh,
                       int64_t hq, int64_t kv, int layers, int r, int top_k, int n_local, bool mean_value) {
    const size_t n_nodes = (size_t) layers*(op == OP_COMPOSED ? 64 : 4) + 16;
    ggml_init_params pi = { ggml_tensor_overhead()*(8*(size_t) layers + 8), nullptr, true };
    ggml_init_params pg = { ggml_tensor_overhead()*(2*n_nodes) + ggml_graph_overhead_custom(n_nodes, false), nullptr, true };
    bg.ctx_in = ggml_init(pi);
    bg.ctx_g  = ggml_init(pg);
    const float scale = 1.0f/sqrtf((float) hs);

    bg.q   = ggml_new_tensor_4d(bg.ctx_in, GGML_TYPE_F32, hs, 1, hq, 1);
    bg.m   = ggml_new_tensor_4d(bg.ctx_in, GGML_TYPE_F16, kv, 1, 1, 1);
    bg.pos = ggml_new_tensor_1d(bg.ctx_in, GGML_TYPE_I32, kv);
    if (op == OP_COMPOSED && n_local > 0) {
        bg.bias = ggml_new_tensor_2d(bg.ctx_in, GGML_TYPE_F32, kv, 1);
    }
    bg.per_layer.resize(layers);
    bg.gf = ggml_new_graph_custom(bg.ctx_g, n_nodes, false);
    for (int l = 0; l < layers; ++l) {
        ggml_tensor * k = ggml_new_tensor_4d(bg.ctx_in, type, hs, kv, nh, 1);
        ggml_tensor * v = ggml_new_tensor_4d(bg.ctx_in, type, hs, kv, nh, 1);
        bg.per_layer[l] = { k, v };
        ggml_tensor * out;
        ggml_tensor * sel = nullptr;
        if (op == OP_FLASH) {
            out = ggml_flash_attn_ext(bg.ctx_g, bg.q, k, v, bg.m, scale, 0.0f, 0.0f);
            ggml_prec_set_acc(out, GGML_PREC_F32);
        } else {
            ggml_tensor * kt = ggml_new_tensor_4d(bg.ctx_in, GGML_TYPE_F16, kv, hs, nh, 1);
            ggml_tensor * vm = ggml_new_tensor_4d(bg.ctx_in, GGML_TYPE_F32, hs, nh, 1, 1);
            bg.per_layer[l].push_back(kt);
            bg.per_layer[l].push_back(vm);
            if (op == OP_SPARQ) {
                out = ggml_sparq_attn(bg.ctx_g, bg.q, k, kt, v, bg.m, bg.pos, vm, scale, r, top_k, n_local, mean_value);
            } else {
                out = build_sparq_composed(bg.ctx_g, bg.q, k, kt, v, vm, bg.bias, scale, r, top_k, mean_value, &sel);
                ggml_set_output(sel);
            }
        }
        ggml_set_output(out);
        bg.outs.push_back(out);
        bg.sels.push_back(sel);
        ggml_build_forward_expand(bg.gf, out);
        if (l == 0) {
            for (int i = 0; i < ggml_graph_n_nodes(bg.gf); ++i) {
                ggml_tensor * t = ggml_graph_node(bg.gf, i);
                if (!is_view(t)) {
                    bg.scratch_bytes += (double) ggml_nbytes(t);
                }
            }
            bg.scratch_bytes -= (double) ggml_nbytes(out);
        }
    }
    for (int i = 0; i < ggml_graph_n_nodes(bg.gf); ++i) {
        ggml_tensor * t = ggml_graph_node(bg.gf, i);
        if (!ggml_backend_supports_op(be, t)) {
            fprintf(stderr, "%s: the backend does not support %s (%s)\n", op_name(op), ggml_op_desc(t), t->name);
            return false;
        }
    }
    bg.buf = ggml_backend_alloc_ctx_tensors(bg.ctx_in, be);
    if (!bg.buf) {
        fprintf(stderr, "could not allocate the tensors of %d layers\n", layers);
        return false;
    }
    bg.galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(be));
    if (!ggml_gallocr_alloc_graph(bg.galloc, bg.gf)) {
        fprintf(stderr, "could not allocate the graph of %d layers\n", layers);
        return false;
    }
    ggml_backend_tensor_memset(bg.m, 0, 0, ggml_nbytes(bg.m));  // every cell visible
    std::vector<int32_t> p(kv);
    for (int64_t i = 0; i < kv; ++i) {
        p[i] = (int32_t) i;
    }
    ggml_backend_tensor_set(bg.pos, p.data(), 0, ggml_nbytes(bg.pos));
    if (bg.bias) {
        // the n_local cells with the largest positions (here the last ones): above any group sum (at most g)
        std::vector<float> b(kv, 0.0f);
        for (int64_t i = std::max<int64_t>(0, kv - n_local); i < kv; ++i) {
            b[i] = 2.0f*(float) (hq/nh) + 1.0f;
        }
        ggml_backend_tensor_set(bg.bias, b.data(), 0, ggml_nbytes(bg.bias));
    }
    return true;
}

// random data in layer 0, copied on the device into the other layers (same values, their own memory)
static void fill_layers(bench_graph & bg) {
    fill_random(bg.q);
    for (ggml_tensor * t : bg.per_layer[0]) {
        fill_random(t);
    }
    for (size_t l = 1; l < bg.per_layer.size(); ++l) {
        for (size_t i = 0; i < bg.per_layer[l].size(); ++i) {
            ggml_backend_tensor_copy(bg.per_layer[0][i], bg.per_layer[l][i]);
        }
    }
}

static result run_case(ggml_backend_t be, bench_op op, ggml_type type, int64_t hs, int64_t nh, int64_t hq, int64_t kv,
                       int layers, int reps, int r, int top_k, int n_local) {
    result res;
    bench_graph bg;
    if (!build_case(bg, be, op, type, hs, nh, hq, kv, layers, r, top_k, n_local, true)) {
        return res;
    }
    fill_layers(bg);
    for (int i = 0; i < 2; ++i) {
        if (ggml_backend_graph_compute(be, bg.gf) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "graph compute failed\n");
            return res;
        }
    }
    const int64_t t0 = ggml_time_us();
    for (int i = 0; i < reps; ++i) {
        ggml_backend_graph_compute(be, bg.gf);
    }
    ggml_backend_synchronize(be);
    const int64_t t1 = ggml_time_us();

    const double row = (double) ggml_row_size(type, hs);
    res.ok = true;
    res.us_per_layer = double(t1 - t0) / (double(reps) * layers);
    res.bytes_per_layer = op == OP_FLASH ? 2.0*nh*kv*row : sparq_bytes(type, hs, nh, kv, r, top_k);
    res.scratch_bytes_per_layer = bg.scratch_bytes;
    return res;
}

static bool read_file(const std::string & path, void * data, size_t n) {
    FILE * f = fopen(path.c_str(), "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path.c_str());
        return false;
    }
    const size_t got = fread(data, 1, n, f);
    const bool extra = fgetc(f) != EOF;
    fclose(f);
    if (got != n || extra) {
        fprintf(stderr, "%s: expected %zu bytes\n", path.c_str(), n);
        return false;
    }
    return true;
}

static bool write_file(const std::string & path, const void * data, size_t n) {
    FILE * f = fopen(path.c_str(), "wb");
    const bool ok = f && fwrite(data, 1, n, f) == n;
    if (f) {
        fclose(f);
    }
    if (!ok) {
        fprintf(stderr, "cannot write %s\n", path.c_str());
    }
    return ok;
}

// the fused op and the composed path on the inputs in dir (see the top of this file)
static int run_check(ggml_backend_t be, const std::string & dir, ggml_type type, int64_t hs, int64_t nh, int64_t hq,
                     int64_t kv, int r, int top_k, int n_local, bool mean_value) {
    const size_t nq = (size_t) hq*hs, nk = (size_t) nh*kv*hs;
    std::vector<float> q(nq), k(nk), v(nk);
    if (!read_file(dir + "/q.f32", q.data(), 4*nq) || !read_file(dir + "/k.f32", k.data(), 4*nk) ||
        !read_file(dir + "/v.f32", v.data(), 4*nk)) {
        return 1;
    }
    // K and V as the cache stores them, and back in f32
    const size_t row = ggml_row_size(type, hs);
    std::vector<uint8_t> ks(row*nh*kv), vs(row*nh*kv);
    std::vector<float> k_st(nk), v_st(nk);
    for (int which = 0; which < 2; ++which) {
        const std::vector<float> & src = which ? v : k;
        std::vector<uint8_t> & dst = which ? vs : ks;
        if (type == GGML_TYPE_F32) {
            memcpy(dst.data(), src.data(), 4*nk);
        } else if (type == GGML_TYPE_F16) {
            ggml_fp32_to_fp16_row(src.data(), (ggml_fp16_t *) dst.data(), (int64_t) nk);
        } else {
            ggml_quantize_chunk(type, src.data(), dst.data(), 0, nh*kv, hs, nullptr);
        }
        if (type == GGML_TYPE_F32) {
            memcpy(which ? v_st.data() : k_st.data(), dst.data(), 4*nk);
        } else {
            ggml_get_type_traits(type)->to_float(dst.data(), which ? v_st.data() : k_st.data(), (int64_t) nk);
        }
    }
    // K^T: f16 of the keys as computed (llama.cpp writes it from the same f32 key as K); the mean of V as stored
    std::vector<ggml_fp16_t> kt((size_t) nh*hs*kv);
    std::vector<float> vm((size_t) nh*hs);
    for (int64_t h = 0; h < nh; ++h) {
        for (int64_t i = 0; i < kv; ++i) {
            for (int64_t c = 0; c < hs; ++c) {
                kt[((size_t) h*hs + c)*kv + i] = ggml_fp32_to_fp16(k[((size_t) h*kv + i)*hs + c]);
            }
        }
        for (int64_t c = 0; c < hs; ++c) {
            double s = 0.0;
            for (int64_t i = 0; i < kv; ++i) {
                s += v_st[((size_t) h*kv + i)*hs + c];
            }
            vm[(size_t) h*hs + c] = (float) (s / (double) kv);
        }
    }

    std::vector<float> res[2];
    std::vector<int32_t> sel;
    const int64_t kk = std::min<int64_t>(top_k, kv);
    for (const bench_op op : { OP_SPARQ, OP_COMPOSED }) {
        bench_graph bg;
        if (!build_case(bg, be, op, type, hs, nh, hq, kv, 1, r, top_k, n_local, mean_value)) {
            printf("check op=%s not supported or failed\n", op_name(op));
            return 1;
        }
        const std::vector<ggml_tensor *> & t = bg.per_layer[0];
        ggml_backend_tensor_set(bg.q, q.data(), 0, 4*nq);
        ggml_backend_tensor_set(t[0], ks.data(), 0, ks.size());
        ggml_backend_tensor_set(t[1], vs.data(), 0, vs.size());
        ggml_backend_tensor_set(t[2], kt.data(), 0, 2*kt.size());
        ggml_backend_tensor_set(t[3], vm.data(), 0, 4*vm.size());
        if (ggml_backend_graph_compute(be, bg.gf) != GGML_STATUS_SUCCESS) {
            printf("check op=%s graph compute failed\n", op_name(op));
            return 1;
        }
        std::vector<float> & y = res[op == OP_COMPOSED];
        y.resize(nq);
        ggml_backend_tensor_get(bg.outs[0], y.data(), 0, 4*nq);
        if (op == OP_COMPOSED) {
            sel.resize((size_t) kk*nh);
            ggml_backend_tensor_get(bg.sels[0], sel.data(), 0, 4*sel.size());
        }
    }
    double max_diff = 0.0, max_abs = 0.0;
    for (size_t i = 0; i < nq; ++i) {
        max_diff = std::max(max_diff, (double) std::fabs(res[0][i] - res[1][i]));
        max_abs  = std::max(max_abs, (double) std::fabs(res[0][i]));
    }
    const bool ok = write_file(dir + "/fused.f32", res[0].data(), 4*nq) && write_file(dir + "/composed.f32", res[1].data(), 4*nq) &&
                    write_file(dir + "/sel.i32", sel.data(), 4*sel.size()) &&
                    write_file(dir + "/k_stored.f32", k_st.data(), 4*nk) && write_file(dir + "/v_stored.f32", v_st.data(), 4*nk);
    printf("check type=%s hq=%lld nh=%lld kv=%lld hs=%lld r=%d k=%d l=%d mean=%d max_abs_diff=%.3g max_abs=%.3g\n",
           ggml_type_name(type), (long long) hq, (long long) nh, (long long) kv, (long long) hs, r, top_k, n_local,
           (int) mean_value, max_diff, max_abs);
    return ok ? 0 : 1;
}

static void set_threads(ggml_backend_t be, int n) {
    ggml_backend_dev_t dev = ggml_backend_get_device(be);
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    auto fn = reg ? (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads") : nullptr;
    if (fn) {
        fn(be, n);
    }
}

static ggml_type type_of(const std::string & s) {
    return s == "q8_0" ? GGML_TYPE_Q8_0 : s == "f32" ? GGML_TYPE_F32 : GGML_TYPE_F16;
}

int main(int argc, char ** argv) {
    std::string dev = "CUDA0", check_dir;
    int layers = 0, reps = 20, r = 16, top_k = 128, n_local = 32, threads = 0, mean_value = 1;
    int64_t hs = 128, n_head = 32;
    std::vector<std::string> types = { "f16", "q8_0" }, kvs = { "4096", "16384", "32768" }, nhs = { "8", "32" };
    std::vector<std::string> ops = { "sparq", "sparq-composed", "flash" };
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        const char * val = i + 1 < argc ? argv[i + 1] : nullptr;
        if (!val) {
            fprintf(stderr, "%s needs a value\n", a.c_str());
            return 2;
        }
        ++i;
        if (a == "-b") { dev = val; }
        else if (a == "-l") { layers = atoi(val); }
        else if (a == "-r") { reps = atoi(val); }
        else if (a == "-t") { threads = atoi(val); }
        else if (a == "--types") { types = split(val); }
        else if (a == "--kv") { kvs = split(val); }
        else if (a == "--nh") { nhs = split(val); }
        else if (a == "--hq") { n_head = atoll(val); }
        else if (a == "--hs") { hs = atoll(val); }
        else if (a == "--r") { r = atoi(val); }
        else if (a == "--k") { top_k = atoi(val); }
        else if (a == "--local") { n_local = atoi(val); }
        else if (a == "--mean") { mean_value = atoi(val); }
        else if (a == "--ops") { ops = split(val); }
        else if (a == "--check") { check_dir = val; }
        else { fprintf(stderr, "unknown argument %s\n", a.c_str()); return 2; }
    }
    std::vector<bench_op> bops;
    for (const std::string & o : ops) {
        if (o == "sparq") { bops.push_back(OP_SPARQ); }
        else if (o == "sparq-composed") { bops.push_back(OP_COMPOSED); }
        else if (o == "flash") { bops.push_back(OP_FLASH); }
        else { fprintf(stderr, "unknown op %s (sparq, sparq-composed, flash)\n", o.c_str()); return 2; }
    }
    if (types.empty() || kvs.empty() || nhs.empty() || r < 1 || r > hs || top_k < 1 || n_local < 0 || n_local > top_k) {
        fprintf(stderr, "bad arguments (1 <= r <= head size, k >= 1, 0 <= local <= k)\n");
        return 2;
    }
    ggml_time_init();
    ggml_backend_load_all();
    ggml_backend_t be = ggml_backend_init_by_name(dev.c_str(), nullptr);
    if (!be) {
        fprintf(stderr, "no backend %s\n", dev.c_str());
        return 1;
    }
    if (threads > 0) {
        set_threads(be, threads);
    }
    if (!check_dir.empty()) {
        const int64_t nh = atoll(nhs[0].c_str());
        if (nh < 1 || n_head % nh) {
            fprintf(stderr, "--hq must be a multiple of --nh\n");
            return 2;
        }
        const int rc = run_check(be, check_dir, type_of(types[0]), hs, nh, n_head, atoll(kvs[0].c_str()), r, top_k,
                                 n_local, mean_value != 0);
        ggml_backend_free(be);
        return rc;
    }
    printf("backend %s, %d passes, head size %lld, %lld query heads, r=%d k=%d l=%d\n", ggml_backend_name(be),
           reps, (long long) hs, (long long) n_head, r, top_k, n_local);
    fflush(stdout);
    int failed = 0;
    for (const std::string & ts : types) {
        const ggml_type type = type_of(ts);
        for (const std::string & nhs_i : nhs) {
            const int64_t nh = atoll(nhs_i.c_str());
            for (const std::string & kvs_i : kvs) {
                const int64_t kv = atoll(kvs_i.c_str());
                const int nl = layers_for(be, layers, type, hs, nh, kv, r, top_k);
                for (const bench_op op : bops) {
                    const result res = run_case(be, op, type, hs, nh, n_head, kv, nl, reps, r, top_k, n_local);
                    if (!res.ok) {
                        printf("op=%s type=%s nh=%lld kv=%lld layers=%d not supported or failed\n", op_name(op),
                               ts.c_str(), (long long) nh, (long long) kv, nl);
                        failed++;
                    } else {
                        printf("op=%s type=%s nh=%lld kv=%lld layers=%d us_per_layer=%.2f bytes_per_layer=%.0f gb_s=%.1f",
                               op_name(op), ts.c_str(), (long long) nh, (long long) kv, nl, res.us_per_layer,
                               res.bytes_per_layer, res.bytes_per_layer / (res.us_per_layer * 1e3));
                        if (op == OP_COMPOSED) {
                            printf(" scratch_bytes_per_layer=%.0f", res.scratch_bytes_per_layer);
                        }
                        printf("\n");
                    }
                    fflush(stdout);
                }
            }
        }
    }
    ggml_backend_free(be);
    return failed ? 1 : 0;
}
"""

WRITE_MODEL_PY = '''\
\"\"\"Writes the GPU check's model: an n-layer q8_0 GGUF of a sparq_cpp.modelfactory preset (default: 8 layers of
llama2-7b), seed 0, with the bundle's copies of sparq_cpp and gguf (py/ beside this file); numpy, tqdm, pyyaml and
requests come from the Python that runs it. --loki also writes <model stem>.loki.gguf, a Loki projection for timing:
per layer and KV head, the basis that orders the key dimensions by the factory's per-row scale of attn_k (largest
first; rotary pairs stay together), for both variants. Prints one JSON line.

    python3 write_model.py OUT.gguf [LAYERS] [PRESET] [--loki]
\"\"\"
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "py"))

import numpy as np  # noqa: E402

from sparq_cpp.modelfactory import qk_row_std, resolve_geometry, write_model  # noqa: E402


def write_loki(model: Path, preset: str, layers: int, seed: int = 0) -> Path:
    from sparq_cpp.calib.pca import LokiPCA
    from sparq_cpp.calib.projection import write_projection

    g = resolve_geometry(preset, layers=layers, wtype="q8_0")
    D, H, L = g.head_dim, g.n_head_kv, g.n_layer
    P = np.zeros((L, H, D, D))
    var = np.zeros((L, H, D))
    for il in range(L):
        std = qk_row_std(g, seed, il, H).reshape(H, D)
        for h in range(H):
            order = np.argsort(-std[h], kind="stable")
            P[il, h, order, np.arange(D)] = 1.0
            var[il, h] = std[h][order] ** 2
    pca = LokiPCA(components={"pre": P, "post": P}, explained_variance={"pre": var, "post": var}, n_tokens=1)
    return write_projection(model.parent / (model.stem + ".loki.gguf"), pca, model, ctx_size=g.n_ctx_train)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = Path(args[0])
    layers = int(args[1]) if len(args) > 1 else 8
    preset = args[2] if len(args) > 2 else "llama2-7b"
    t0 = time.time()
    path = write_model(out, preset, layers=layers, wtype="q8_0", seed=0, make_parents=True)
    info = {"model": str(path), "bytes": path.stat().st_size, "seconds": round(time.time() - t0, 1),
            "preset": preset, "layers": layers}
    if "--loki" in sys.argv[1:]:
        info["loki"] = str(write_loki(path, preset, layers))
    info["modules"] = {m: sys.modules[m].__file__ for m in ("gguf", "sparq_cpp", "numpy")}
    print(json.dumps(info))


if __name__ == "__main__":
    main()
'''

RUN_SH = r"""#!/usr/bin/env bash
# sparq-cpp GPU check, written by bench/gpu_check.py (`make gpu-check`): builds the patched llama.cpp of the bundle
# with CUDA, checks GGML_OP_SPARSE_ATTN against the CPU, times it beside flash attention, measures the copy
# bandwidth, writes an 8-layer Llama 2 7B-shaped q8_0 model and runs llama-bench dense against SparQ.
#
#   run.sh [--dry-run] [--budget SECONDS] [STAGE ...]
#
# Stages, in order (default: all): env unpack model configure build build-e2e test opbench bandwidth e2e profile.
# `model` (the model writer) and `build-e2e` (libllama, common, llama-bench) run in the background beside the stages
# after them; e2e waits for both. The whole run has one deadline, --budget seconds from the start (default 570,
# GPU_CHECK_BUDGET): each stage's time limit is min(its own maximum, what is left minus what the stages after it
# keep back), and a stage with less than its minimum left is skipped. A stage that fails or times out does not stop
# the run: every later stage runs unless what it needs is missing (then it is "skipped" with the reason).
# Logs are appended as they grow; $OUT (else <bundle>/out) gets summary.json (rewritten after every stage) and at
# most 7 logs. --dry-run prints every stage, its limit and its commands, with each earlier stage taking its typical
# time on a 16-core H100 machine (--dry-run=worst: its whole limit), writes summary.json with status "planned", and
# runs nothing (no GPU needed).
#
# Environment: CUDACXX (nvcc; else /usr/local/cuda/bin/nvcc, else PATH's), CUDA_ARCH (else the GPU's compute
# capability from nvidia-smi), GPU_CHECK_LIMITS ("stage=max[:reserve[:minimum]],..." seconds), CUBLAS_ROOT (a
# folder holding cublas_v2.h, libcublas.so* and libcublasLt.so*; else the toolkit's cuBLAS, else an nvidia cuBLAS
# wheel in python3's site-packages, as PyTorch installs one), JOBS (build jobs, default nproc), PYTHON (default python3), GPU_CHECK_WORK (sources, build and
# model; default <bundle>-work, kept between runs), E2E_DEPTHS, E2E_SPARSE, E2E_LOKI, E2E_LOKI_DEPTHS, E2E_LAYERS.
set -u -o pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DRY=0
WORST=0
BUDGET="${GPU_CHECK_BUDGET:-570}"
ALL_STAGES=(env unpack model configure build build-e2e test opbench bandwidth e2e profile)
SELECTED=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --dry-run=worst) DRY=1; WORST=1 ;;
        --budget) BUDGET="${2:-}"; shift ;;
        --budget=*) BUDGET="${1#*=}" ;;
        -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *)  if [[ " ${ALL_STAGES[*]} " == *" $1 "* ]]; then SELECTED+=("$1")
            else echo "run.sh: unknown argument '$1' (stages: ${ALL_STAGES[*]})" >&2; exit 2; fi ;;
    esac
    shift
done
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "run.sh: --budget takes whole seconds, got '$BUDGET'" >&2; exit 2; }
[ ${#SELECTED[@]} -gt 0 ] || SELECTED=("${ALL_STAGES[@]}")

LOGS="${OUT:-$HERE/out}"
WORK="${GPU_CHECK_WORK:-$HERE-work}"
SRC="$WORK/src"
BUILD="$WORK/build"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 16)}"
E2E_LAYERS="${E2E_LAYERS:-8}"
MODEL="$WORK/llama2-7b-L${E2E_LAYERS}.q8_0.gguf"
PROJ="${MODEL%.gguf}.loki.gguf"
E2E_DEPTHS="${E2E_DEPTHS:-32768,4096,16384,65536,8192}"  # 32k first: the depth the targets name
E2E_SPARSE="${E2E_SPARSE:-sparq:r=16,k=128}"
E2E_LOKI="${E2E_LOKI:-loki:d=32,k=128}"          # through LLAMA_SPARSE_ATTN, with proj= the model writer's projection
E2E_LOKI_DEPTHS="${E2E_LOKI_DEPTHS:-32768}"
mkdir -p "$LOGS"
[ $DRY = 1 ] || mkdir -p "$WORK"

# ---- time: one deadline for the run ---------------------------------------------------------------------------
T0=$(date +%s)
VCLOCK=0   # the dry run's clock: each planned stage takes its typical time (--dry-run=worst: its whole limit)
elapsed() { if [ $DRY = 1 ]; then echo $VCLOCK; else echo $(( $(date +%s) - T0 )); fi; }

# stage: maximum seconds, seconds kept back for the stages after it, minimum worth starting; bg: background
declare -A MAX=( [env]=30 [unpack]=60 [model]=300 [configure]=120 [build]=480 [test]=120 [opbench]=180 [bandwidth]=45 [build-e2e]=300 [e2e]=600 [profile]=120 )
declare -A RESERVE=( [env]=0 [unpack]=0 [model]=20 [configure]=0 [build]=160 [test]=100 [opbench]=50 [bandwidth]=30 [build-e2e]=30 [e2e]=5 [profile]=0 )
declare -A MINIMUM=( [env]=5 [unpack]=5 [model]=30 [configure]=10 [build]=60 [test]=15 [opbench]=15 [bandwidth]=5 [build-e2e]=20 [e2e]=20 [profile]=30 )
# typical seconds on a 16-core H100 machine, for the dry run's clock (--dry-run=worst: each stage its whole limit)
declare -A EXPECT=( [env]=5 [unpack]=3 [model]=90 [configure]=30 [build]=300 [test]=40 [opbench]=90 [bandwidth]=10 [build-e2e]=150 [e2e]=120 [profile]=60 )
declare -A BG=( [model]=1 [build-e2e]=1 )
# GPU_CHECK_LIMITS="stage=max[:reserve[:minimum]],...": other limits
for spec in ${GPU_CHECK_LIMITS:+${GPU_CHECK_LIMITS//,/ }}; do
    st=${spec%%=*}; IFS=: read -r mx rs mn <<< "${spec#*=}"
    [ -n "${MAX[$st]:-}" ] && [[ "$mx" =~ ^[0-9]+$ ]] || { echo "run.sh: GPU_CHECK_LIMITS: bad '$spec'" >&2; exit 2; }
    MAX[$st]=$mx; [[ "${rs:-}" =~ ^[0-9]+$ ]] && RESERVE[$st]=$rs; [[ "${mn:-}" =~ ^[0-9]+$ ]] && MINIMUM[$st]=$mn
done

declare -A ST_STATUS ST_RC ST_START ST_SECS ST_LIMIT ST_NOTE ST_CMDS ST_NUMS ST_LOG ST_PID
for s in "${ALL_STAGES[@]}"; do ST_STATUS[$s]="not selected"; ST_RC[$s]=""; ST_START[$s]=""; ST_SECS[$s]=""; ST_LIMIT[$s]=""; ST_NOTE[$s]=""; ST_CMDS[$s]=""; ST_NUMS[$s]=""; ST_LOG[$s]=""; done
for s in "${SELECTED[@]}"; do ST_STATUS[$s]="pending"; done

limit_for() {  # the stage's time limit now (0: not enough time left)
    local s=$1 left lim
    left=$(( BUDGET - $(elapsed) - ${RESERVE[$s]} ))
    lim=${MAX[$s]}
    [ $left -lt $lim ] && lim=$left
    [ $lim -lt ${MINIMUM[$s]} ] && lim=0
    echo $lim
}

# ---- JSON ----------------------------------------------------------------------------------------------------
jstr() { local s=${1//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\t'/\\t}; s=${s//$'\r'/}; s=${s//$'\n'/\\n}; s=${s//$'\e'/}; printf '"%s"' "$s"; }
jnum() { if [[ "${1:-}" =~ ^-?[0-9]+([.][0-9]+)?([eE][-+]?[0-9]+)?$ ]]; then printf '%s' "$1"; else printf 'null'; fi; }
num() {  # num KEY VALUE: a number (or null) into the current stage's numbers
    ST_NUMS[$STAGE]+="${ST_NUMS[$STAGE]:+, }$(jstr "$1"): $(jnum "${2:-}")"; }
str() {  # str KEY VALUE: a string into the current stage's numbers
    ST_NUMS[$STAGE]+="${ST_NUMS[$STAGE]:+, }$(jstr "$1"): $(jstr "${2:-}")"; }
raw() {  # raw KEY JSON
    ST_NUMS[$STAGE]+="${ST_NUMS[$STAGE]:+, }$(jstr "$1"): $2"; }

# the same into REPLY, without a subshell (the summary is written often)
jstr_r() { local s=${1//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\t'/\\t}; s=${s//$'\r'/}; s=${s//$'\n'/\\n}; s=${s//$'\e'/}; REPLY="\"$s\""; }
jnum_r() { if [[ "${1:-}" =~ ^-?[0-9]+([.][0-9]+)?([eE][-+]?[0-9]+)?$ ]]; then REPLY=$1; else REPLY=null; fi; }

SERIES_LINE=""
[ -f "$HERE/SERIES" ] && SERIES_LINE=$(tr '\n' ' ' < "$HERE/SERIES" | cut -c1-400)

write_summary() {
    local f="$LOGS/summary.json" s c cmds body="" e
    for s in "${ALL_STAGES[@]}"; do
        cmds=""
        while IFS= read -r c; do [ -n "$c" ] && { jstr_r "$c"; cmds+="${cmds:+, }$REPLY"; }; done <<< "${ST_CMDS[$s]}"
        jstr_r "$s"; e="{\"name\": $REPLY"
        jstr_r "${ST_STATUS[$s]}"; e+=", \"status\": $REPLY"
        [ -n "${BG[$s]:-}" ] && e+=", \"background\": true" || e+=", \"background\": false"
        jnum_r "${ST_RC[$s]}"; e+=", \"rc\": $REPLY"
        jnum_r "${ST_START[$s]}"; e+=", \"start_s\": $REPLY"
        jnum_r "${ST_SECS[$s]}"; e+=", \"seconds\": $REPLY"
        jnum_r "${ST_LIMIT[$s]}"; e+=", \"limit_s\": $REPLY"
        jstr_r "${ST_LOG[$s]}"; e+=", \"log\": $REPLY"
        jstr_r "${ST_NOTE[$s]}"; e+=", \"note\": $REPLY"
        e+=", \"commands\": [$cmds], \"numbers\": {${ST_NUMS[$s]}}}"
        body+="${body:+,}"$'\n  '"$e"
    done
    local head
    jstr_r "$SERIES_LINE"; head="{\"schema\": 1, \"dry_run\": $([ $DRY = 1 ] && echo true || echo false), \"budget_s\": $BUDGET, \"elapsed_s\": $(elapsed), \"bundle\": $REPLY"
    jstr_r "$WORK"; head+=", \"work\": $REPLY"
    jstr_r "$LOGS"; head+=", \"out\": $REPLY"
    printf '%s,\n "stages": [%s\n]}\n' "$head" "$body" > "$f.tmp" && mv -f "$f.tmp" "$f"
}

# ---- running commands ----------------------------------------------------------------------------------------
STAGE=""
STAGE_END=0
note() { ST_NOTE[$STAGE]+="${ST_NOTE[$STAGE]:+; }$*"; }

record() { ST_CMDS[$STAGE]+="$*"$'\n'; }

exec_cmd() {  # exec_cmd LOG CMD...: run CMD, killed at the stage's deadline, its output appended to LOG
    local log=$1; shift
    if [ $DRY = 1 ]; then echo "      \$ $*    >> $log"; return 0; fi
    local left=$(( STAGE_END - $(date +%s) ))
    if [ $left -le 0 ]; then echo "[$STAGE: deadline passed before: $*]" >> "$LOGS/$log"; return 124; fi
    echo "[$STAGE +$(elapsed)s, ${left}s left] \$ $*" >> "$LOGS/$log"
    timeout -k 10 "$left" "$@" >> "$LOGS/$log" 2>&1 < /dev/null
    local rc=$?
    echo "[$STAGE +$(elapsed)s] rc=$rc" >> "$LOGS/$log"
    return $rc
}

run() { record "${@:2}"; exec_cmd "$@"; }  # run LOG CMD...: one command of the current stage

bg_run() {  # bg_run LOG CMD...: as run, in the background; its exit status goes to $WORK/.<stage>.rc
    record "${@:2}"
    if [ $DRY = 1 ]; then exec_cmd "$@"; finish 0; return; fi
    rm -f "$WORK/.$STAGE.rc"
    ( exec_cmd "$@"; echo $? > "$WORK/.$STAGE.rc.tmp"; mv "$WORK/.$STAGE.rc.tmp" "$WORK/.$STAGE.rc" ) &
    ST_PID[$STAGE]=$!
}

run_to() {  # run_to FILE LOG CMD...: as run, stdout to FILE (kept as it grows, then appended to LOG), stderr to LOG
    local file=$1 log=$2; shift 2
    record "$* > $(basename "$file")"
    if [ $DRY = 1 ]; then echo "      \$ $* > $(basename "$file")  2>> $log"; return 0; fi
    local left=$(( STAGE_END - $(date +%s) ))
    if [ $left -le 0 ]; then echo "[$STAGE: deadline passed before: $*]" >> "$LOGS/$log"; return 124; fi
    echo "[$STAGE +$(elapsed)s, ${left}s left] \$ $* > $file" >> "$LOGS/$log"
    timeout -k 10 "$left" "$@" > "$file" 2>> "$LOGS/$log" < /dev/null
    local rc=$?
    cat "$file" >> "$LOGS/$log"
    echo "[$STAGE +$(elapsed)s] rc=$rc" >> "$LOGS/$log"
    return $rc
}

q() {  # a quick probe whose output is a value: at most 20 s, and not past the stage's deadline
    local left=$(( STAGE_END - $(date +%s) ))
    [ $left -gt 20 ] && left=20
    [ $left -lt 1 ] && left=1
    timeout -k 2 "$left" "$@" 2>/dev/null
}

status_of() { case $1 in 0) echo ok ;; 124|137) echo timeout ;; *) echo failed ;; esac; }

begin() {  # begin STAGE LOG: 0 when the stage is to run (its limit set), 1 when skipped
    STAGE=$1
    ST_LOG[$STAGE]=$2
    local lim; lim=$(limit_for "$STAGE")
    ST_START[$STAGE]=$(elapsed)
    ST_LIMIT[$STAGE]=$lim
    if [ "$lim" -le 0 ]; then
        ST_STATUS[$STAGE]="skipped"; note "not enough time left ($(( BUDGET - $(elapsed) ))s of ${BUDGET}s, minimum ${MINIMUM[$STAGE]}s, ${RESERVE[$STAGE]}s kept for later stages)"
        echo "== $STAGE: skipped (time)"
        write_summary; return 1
    fi
    STAGE_END=$(( $(date +%s) + lim ))
    ST_STATUS[$STAGE]=$([ $DRY = 1 ] && echo planned || echo running)
    echo "== $STAGE: limit ${lim}s, starts at +${ST_START[$STAGE]}s$([ -n "${BG[$STAGE]:-}" ] && echo ' (background)')"
    write_summary
    return 0
}

finish() {  # finish RC: the current stage's status from the exit status of its last (or first failing) command
    local rc=$1
    if [ $DRY = 1 ]; then
        local t=${EXPECT[$STAGE]}
        [ $WORST = 1 ] || [ "$t" -gt "${ST_LIMIT[$STAGE]}" ] && t=${ST_LIMIT[$STAGE]}
        ST_STATUS[$STAGE]=planned; ST_SECS[$STAGE]=$t
        [ -n "${BG[$STAGE]:-}" ] || VCLOCK=$(( VCLOCK + t ))
    else
        ST_RC[$STAGE]=$rc; ST_STATUS[$STAGE]=$(status_of "$rc"); ST_SECS[$STAGE]=$(( $(elapsed) - ST_START[$STAGE] ))
        echo "== $STAGE: ${ST_STATUS[$STAGE]} (rc $rc, ${ST_SECS[$STAGE]}s)"
        [ -n "${ST_LOG[$STAGE]}" ] && [ -f "$LOGS/${ST_LOG[$STAGE]}" ] && tail -n 6 "$LOGS/${ST_LOG[$STAGE]}" | sed 's/^/   | /' | cut -c1-220
    fi
    write_summary
}

skip() {  # skip REASON: the current stage cannot run (what it needs is missing)
    ST_STATUS[$STAGE]=skipped; note "$*"; echo "== $STAGE: skipped: $*"; write_summary; }

selected() { [[ " ${SELECTED[*]} " == *" $1 "* ]]; }

# ---- what env finds (placeholders in a dry run) --------------------------------------------------------------
NVCC="<nvcc>"; CUDA_ROOT="<toolkit>"; ARCH="${CUDA_ARCH:-<compute capability from nvidia-smi>}"
CUBLAS_ARGS=(); VMM_ARGS=(); CUBLAS_LIB=""; GEN=(-G Ninja)
[ $DRY = 1 ] && CUBLAS_ARGS=("<cuBLAS: the toolkit's, or -DCMAKE_CUDA_FLAGS=-I<wheel>/include -DCUDA_cublas_LIBRARY=... -DCUDA_cublasLt_LIBRARY=...>") \
             && VMM_ARGS=("<-DGGML_CUDA_NO_VMM=ON when no libcuda.so is found>")
BIN="$BUILD/bin"
RUN_LD() { echo "LD_LIBRARY_PATH=$BIN${CUBLAS_LIB:+:$CUBLAS_LIB}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; }

CUBLAS_WHERE=""; DRIVER_WHERE=""; CUBLAS_INC=""
find_cublas() {  # sets CUBLAS_WHERE, CUBLAS_ARGS, CUBLAS_LIB
    local d inc lib lt cand=()
    [ -n "${CUBLAS_ROOT:-}" ] && from_wheel "$CUBLAS_ROOT" && { CUBLAS_WHERE="CUBLAS_ROOT $CUBLAS_ROOT"; return 0; }
    for d in "$CUDA_ROOT" "$CUDA_ROOT/targets/x86_64-linux"; do
        [ -f "$d/include/cublas_v2.h" ] || continue
        for lib in "$d/lib64" "$d/lib"; do
            if compgen -G "$lib/libcublas.so*" > /dev/null; then CUBLAS_WHERE="toolkit $d"; CUBLAS_LIB=$lib; return 0; fi
        done
    done
    while IFS= read -r d; do [ -d "$d/nvidia" ] && cand+=("$d/nvidia"); done < <(q "$PYTHON" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()] + sys.path[1:]))')
    for d in /opt/*/.venv/lib/python3*/site-packages /usr/local/lib/python3*/dist-packages /usr/lib/python3/dist-packages; do
        [ -d "$d/nvidia" ] && cand+=("$d/nvidia")
    done
    for d in "${cand[@]}"; do
        from_wheel "$d" && { CUBLAS_WHERE="wheel $(dirname "$CUBLAS_INC")"; return 0; }
    done
    CUBLAS_WHERE="none found (CUBLAS_ROOT, toolkit, python site-packages)"; return 1
}

from_wheel() {  # from_wheel DIR: cuBLAS's header and libraries under DIR (a wheel's layout) -> CUBLAS_ARGS, CUBLAS_LIB
    local d=$1 inc lib lt
    [ -d "$d" ] || return 1
    inc=$(find -L "$d" -maxdepth 4 -name cublas_v2.h 2>/dev/null | sort | head -1)
    lib=$(find -L "$d" -maxdepth 4 -name 'libcublas.so*' 2>/dev/null | sort | head -1)
    lt=$(find -L "$d" -maxdepth 4 -name 'libcublasLt.so*' 2>/dev/null | sort | head -1)
    [ -n "$inc" ] && [ -n "$lib" ] && [ -n "$lt" ] || return 1
    # cuBLAS's headers alone: a wheel folder can hold other CUDA headers, of another version than nvcc's
    local only="$WORK/cublas-include" h
    rm -rf "$only"; mkdir -p "$only"
    for h in "$(dirname "$inc")"/cublas*.h; do ln -s "$h" "$only/"; done
    CUBLAS_ARGS=("-DCMAKE_CUDA_FLAGS=-I$only" "-DCUDA_cublas_LIBRARY=$lib" "-DCUDA_cublasLt_LIBRARY=$lt")
    CUBLAS_LIB=$(dirname "$lib")
    CUBLAS_INC=$(dirname "$inc")
}

find_driver_lib() {  # sets DRIVER_WHERE, VMM_ARGS: the driver library that ggml's VMM pool links, else NO_VMM
    local d p
    for d in lib64 lib targets/x86_64-linux/lib; do
        [ -f "$CUDA_ROOT/$d/stubs/libcuda.so" ] && { DRIVER_WHERE="stub $CUDA_ROOT/$d/stubs/libcuda.so"; return 0; }
    done
    p=$(q ldconfig -p | awk '$1 == "libcuda.so" {print $NF; exit}')
    for d in "$p" /usr/lib/x86_64-linux-gnu/libcuda.so /usr/lib64/libcuda.so /usr/local/nvidia/lib64/libcuda.so /usr/local/nvidia/lib/libcuda.so; do
        [ -n "$d" ] && [ -e "$d" ] && { VMM_ARGS=("-DCUDA_cuda_driver_LIBRARY=$d"); DRIVER_WHERE="driver $d"; return 0; }
    done
    VMM_ARGS=(-DGGML_CUDA_NO_VMM=ON)
    DRIVER_WHERE="none (GGML_CUDA_NO_VMM=ON)"; return 1
}

# ---- stages --------------------------------------------------------------------------------------------------
stage_env() {
    begin env env.log || return
    run env.log uname -a
    run env.log nvidia-smi
    run env.log nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
    run env.log bash -c 'nproc; free -g; df -h .; command -v nvcc cmake ninja gcc g++ python3 ncu; cmake --version; ninja --version; g++ --version; nvcc --version; ldconfig -p | grep -E "libcuda\.so|libcublas" || true'
    if [ $DRY = 1 ]; then finish 0; return; fi
    local cap gpu drv cub drvlib
    gpu=$(q nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    cap=$(q nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' ')
    drv=$(q nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
    if [ -n "${CUDA_ARCH:-}" ]; then ARCH=$CUDA_ARCH; note "CUDA_ARCH=$CUDA_ARCH given"
    elif [[ "$cap" =~ ^[0-9]+\.[0-9]+$ ]]; then ARCH=${cap/./}
    else ARCH=90; note "no compute capability from nvidia-smi: building sm_90"; fi
    if [ -n "${CUDACXX:-}" ]; then NVCC=$CUDACXX
    elif [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc
    else NVCC=$(command -v nvcc || echo ""); fi
    [ -n "$NVCC" ] && CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$NVCC")")") || { NVCC=nvcc; CUDA_ROOT=/usr/local/cuda; note "nvcc not found"; }
    command -v ninja > /dev/null || GEN=()
    find_cublas; cub=$CUBLAS_WHERE
    find_driver_lib; drvlib=$DRIVER_WHERE
    { echo "gpu: $gpu"; echo "compute capability: $cap -> CMAKE_CUDA_ARCHITECTURES=$ARCH"; echo "driver: $drv";
      echo "nvcc: $NVCC (toolkit $CUDA_ROOT)"; echo "cuBLAS: $cub ${CUBLAS_ARGS[*]}"; echo "driver library: $drvlib ${VMM_ARGS[*]}"; } >> "$LOGS/env.log"
    str gpu "$gpu"; str compute_cap "$cap"; str cuda_arch "$ARCH"; str driver "$drv"
    str nvcc "$NVCC"; str nvcc_version "$(q "$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
    str cmake_version "$(q cmake --version | head -1 | awk '{print $3}')"; str ninja "$(q ninja --version)"
    str cxx "$(q g++ --version | head -1)"; str python "$(q "$PYTHON" -c 'import sys, numpy; print(sys.executable, sys.version.split()[0], "numpy", numpy.__version__)')"
    str cublas "$cub"; str driver_library "$drvlib"; num jobs "$JOBS"; num nproc "$(nproc)"
    num gpu_memory_mib "$(q nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)"
    [ -n "$gpu" ] || note "nvidia-smi found no GPU"
    finish 0
}

stage_unpack() {
    begin unpack env.log || return
    if [ $DRY = 0 ] && cmp -s "$HERE/SERIES" "$WORK/SERIES" && [ -f "$SRC/CMakeLists.txt" ]; then
        note "sources of this bundle already unpacked"; finish 0; return
    fi
    # new sources: the builds go too (the tarball's file times may be older than objects built from other sources)
    run env.log rm -rf "$SRC" "$WORK/SERIES" "$BUILD" "$WORK/build-ops"
    run env.log mkdir -p "$SRC"
    run env.log tar xzf "$HERE/llama-trimmed.tar.gz" -C "$SRC"
    local rc=$?
    [ $rc = 0 ] && [ $DRY = 0 ] && cp "$HERE/SERIES" "$WORK/SERIES"
    finish $rc
}

stage_model() {  # background: the model writer (numpy, the bundle's copy of gguf and sparq_cpp)
    begin model model.log || return
    if [ $DRY = 0 ] && [ -f "$MODEL" ] && [ -f "$PROJ" ]; then note "model already written: $MODEL"; finish 0; return; fi
    if [ $DRY = 0 ] && [ ! -f "$SRC/sparq/write_model.py" ]; then skip "no model writer (unpack failed)"; return; fi
    bg_run model.log "$PYTHON" "$SRC/sparq/write_model.py" "$MODEL" "$E2E_LAYERS" --loki
}

stage_configure() {
    begin configure configure.log || return
    if [ $DRY = 0 ] && [ ! -f "$SRC/CMakeLists.txt" ]; then skip "no sources (unpack failed)"; return; fi
    local common=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DGGML_CUDA=ON
        "-DCMAKE_CUDA_ARCHITECTURES=$ARCH" "-DCMAKE_CUDA_COMPILER=$NVCC" -DGGML_CUDA_GRAPHS=ON
        -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_CUDA_FA_QUANTS=f16-f16,q8_0-q8_0 -DGGML_CUDA_NCCL=OFF
        "${CUBLAS_ARGS[@]}" "${VMM_ARGS[@]}")
    run configure.log cmake -S "$SRC" -B "$BUILD" "${GEN[@]}" "${common[@]}" -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TESTS=ON \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF
    local rc=$?
    str tree "llama.cpp (ggml, libllama, common, test-backend-ops, sparq-op-bench, llama-bench)"
    if [ $rc != 0 ] || [ $DRY = 1 ]; then
        # ggml and test-backend-ops alone (the bundle's sparq-ops/CMakeLists.txt), without the VMM pool
        [ $DRY = 1 ] && echo "      (if that fails:)" || { note "the whole tree did not configure (rc $rc): ggml and test-backend-ops only, GGML_CUDA_NO_VMM=ON"; BUILD="$WORK/build-ops"; BIN="$BUILD/bin"; E2E_OK=0; }
        local ops=() a
        for a in "${common[@]}"; do [[ "$a" == -DCUDA_cuda_driver_LIBRARY=* || "$a" == -DGGML_CUDA_NO_VMM* || "$a" == "<-D"* ]] || ops+=("$a"); done
        run configure.log cmake -S "$SRC/sparq-ops" -B "$WORK/build-ops" "${GEN[@]}" "${ops[@]}" -DGGML_CUDA_NO_VMM=ON
        local rc2=$?
        [ $DRY = 1 ] || { rc=$rc2; ST_NUMS[configure]=""; str tree "ggml, test-backend-ops, sparq-op-bench (sparq-ops)"; }
    fi
    finish $rc
}
E2E_OK=1

stage_build() {
    begin build build.log || return
    if [ $DRY = 0 ] && [ ! -f "$BUILD/CMakeCache.txt" ]; then skip "not configured"; return; fi
    run build.log cmake --build "$BUILD" --target test-backend-ops -j "$JOBS"
    local rc=$?
    run build.log cmake --build "$BUILD" --target sparq-op-bench -j "$JOBS"  # one file more, after the one that matters
    [ $DRY = 1 ] || { num objects_built "$(grep -cE '^\[[0-9]+/[0-9]+\] ' "$LOGS/build.log")"
                      str test_backend_ops "$([ -x "$BIN/test-backend-ops" ] && echo built || echo missing)"
                      str sparq_op_bench "$([ -x "$BIN/sparq-op-bench" ] && echo built || echo missing)"; }
    finish $rc
}

stage_test() {
    begin test test.log || return
    if [ $DRY = 0 ] && [ ! -x "$BIN/test-backend-ops" ]; then skip "test-backend-ops not built"; return; fi
    run test.log env "$(RUN_LD)" "$BIN/test-backend-ops" test -o SPARSE_ATTN -b CUDA0
    local rc=$?
    if [ $DRY = 0 ]; then
        local line; line=$(grep -oE '[0-9]+/[0-9]+ tests passed' "$LOGS/test.log" | tail -1)
        num passed "${line%%/*}"; line=${line#*/}; num total "${line%% *}"
        num failed "$(grep -cE '^ +[A-Z_]+\(.*FAIL' "$LOGS/test.log")"; num not_supported "$(grep -c 'not supported' "$LOGS/test.log")"
    fi
    finish $rc
}

perf_cases() {  # perf_cases FILE: the timed cases of a test-backend-ops perf log as a JSON list
    local out="" line name us gbs
    while IFS= read -r line; do
        name=$(sed -E 's/^ *([A-Z_]+\([^)]*\)):.*/\1/' <<< "$line")
        us=$(sed -nE 's/.* ([0-9.]+) us\/run.*/\1/p' <<< "$line")
        gbs=$(sed -nE 's/.* ([0-9.]+) GB\/s.*/\1/p' <<< "$line")
        out+="${out:+, }{\"case\": $(jstr "$name"), \"us_per_run\": $(jnum "$us"), \"gb_s\": $(jnum "$gbs")}"
    done < <(grep -E 'us/run' "$1" 2>/dev/null)
    echo "[$out]"
}

layered_cases() {  # layered_cases FILE: sparq-op-bench's lines as a JSON list: SparQ's speed-up over flash attention
    # (fused and composed), and the composed path's against the fused op (fused us / composed us: above 1, composed is faster)
    local out="" line key op us gbs scratch
    declare -A flash=() fused=()
    ratio() {  # ratio A B: A / B to 3 decimals, empty unless both are positive
        [ -n "${1:-}" ] && [ -n "${2:-}" ] && awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.3f", a / b }'
    }
    while IFS= read -r line; do
        key=$(sed -nE 's/^op=(flash|sparq) (type=[^ ]+ nh=[0-9]+ kv=[0-9]+).*us_per_layer=([0-9.]+).*/\1 \2 \3/p' <<< "$line")
        case "$key" in
            flash\ *) key=${key#flash }; flash[${key% *}]=${key##* } ;;
            sparq\ *) key=${key#sparq }; fused[${key% *}]=${key##* } ;;
        esac
    done < <(grep -E '^op=(flash|sparq) .*us_per_layer=' "$1" 2>/dev/null)
    while IFS= read -r line; do
        op=$(sed -nE 's/^op=([a-z-]+) .*/\1/p' <<< "$line")
        key=$(sed -nE 's/^op=[a-z-]+ (type=[^ ]+ nh=[0-9]+ kv=[0-9]+).*/\1/p' <<< "$line")
        us=$(sed -nE 's/.*us_per_layer=([0-9.]+).*/\1/p' <<< "$line")
        gbs=$(sed -nE 's/.*gb_s=([0-9.]+).*/\1/p' <<< "$line")
        local extra=""
        if [ "$op" != flash ]; then
            extra=", \"speedup_over_flash\": $(jnum "$(ratio "${flash[$key]:-}" "$us")")"
        fi
        if [ "$op" = sparq-composed ]; then
            scratch=$(sed -nE 's/.*scratch_bytes_per_layer=([0-9]+).*/\1/p' <<< "$line")
            extra+=", \"speedup_over_fused\": $(jnum "$(ratio "${fused[$key]:-}" "$us")"), \"scratch_bytes_per_layer\": $(jnum "$scratch")"
        fi
        out+="${out:+, }{\"op\": $(jstr "$op"), \"case\": $(jstr "$key"), \"us_per_layer\": $(jnum "$us"), \"gb_s\": $(jnum "$gbs")$extra}"
    done < <(grep -E '^op=[a-z-]+ .*us_per_layer=' "$1" 2>/dev/null)
    echo "[$out]"
}

stage_opbench() {
    begin opbench bench.log || return
    if [ $DRY = 0 ] && [ ! -x "$BIN/test-backend-ops" ]; then skip "test-backend-ops not built"; return; fi
    # SparQ and Loki at the decode shapes (4k-32k cells; each case repeats the op on one set of tensors, so the parts
    # of the cache that fit in L2 stay there), then flash attention there
    run_to "$WORK/perf-sparse.txt" bench.log env "$(RUN_LD)" "$BIN/test-backend-ops" perf -o SPARSE_ATTN -b CUDA0
    local rc1=$?
    run_to "$WORK/perf-fa.txt" bench.log env "$(RUN_LD)" "$BIN/test-backend-ops" perf -o FLASH_ATTN_EXT -b CUDA0 \
        -p 'hsk=128,hsv=128,nh=(32|8),nr23=\[(1|4),1\],kv=(4096|16384|32768),nb=1,'
    local rc2=$?
    [ $DRY = 1 ] || { raw sparse_attn "$(perf_cases "$WORK/perf-sparse.txt")"; raw flash_attn "$(perf_cases "$WORK/perf-fa.txt")"; }
    # the same shapes over many layers' caches (SparQ reads 256 MiB per pass, more than L2 holds), beside flash attention
    local rc3=0
    if [ $DRY = 1 ] || [ -x "$BIN/sparq-op-bench" ]; then
        run_to "$WORK/op-bench.txt" bench.log env "$(RUN_LD)" "$BIN/sparq-op-bench" -b CUDA0 -r 20
        rc3=$?
        [ $DRY = 1 ] || raw layered "$(layered_cases "$WORK/op-bench.txt")"
    else
        note "sparq-op-bench not built"
    fi
    finish $(( rc1 != 0 ? rc1 : rc2 != 0 ? rc2 : rc3 ))
}

stage_bandwidth() {
    begin bandwidth bench.log || return
    if [ $DRY = 0 ] && [ ! -f "$SRC/sparq/bw.cu" ]; then skip "no sources"; return; fi
    run bench.log "$NVCC" -O2 "-arch=sm_$ARCH" -o "$WORK/sparq-bw" "$SRC/sparq/bw.cu"
    local rc=$?
    run_to "$WORK/bw.txt" bench.log "$WORK/sparq-bw" 1024 20
    rc=$(( rc != 0 ? rc : $? ))
    [ $DRY = 1 ] || { num copy_gb_s "$(sed -nE 's/^copy_gb_s ([0-9.]+).*/\1/p' "$WORK/bw.txt" 2>/dev/null)"
                      num kernel_copy_gb_s "$(sed -nE 's/^kernel_copy_gb_s ([0-9.]+).*/\1/p' "$WORK/bw.txt" 2>/dev/null)"
                      str device "$(sed -n 's/^device //p' "$WORK/bw.txt" 2>/dev/null)"; }
    finish $rc
}

stage_build_e2e() {  # background, niced, beside test/opbench/bandwidth (which use the GPU)
    begin build-e2e build.log || return
    note "runs beside test, opbench and bandwidth at nice 19 with 2 cores left free"
    if [ $DRY = 0 ] && { [ $E2E_OK = 0 ] || [ ! -f "$BUILD/CMakeCache.txt" ]; }; then skip "the tree with libllama did not configure"; return; fi
    local j=$(( JOBS > 4 ? JOBS - 2 : JOBS ))
    bg_run build.log nice -n 19 cmake --build "$BUILD" --target llama-bench -j "$j"
}

wait_bg() {  # wait_bg STAGE: the background stage's result
    local s=$1 pid=${ST_PID[$1]:-} rc
    [ -n "$pid" ] || return 0
    wait "$pid"
    rc=$(cat "$WORK/.$s.rc" 2>/dev/null || echo 1)
    local keep=$STAGE; STAGE=$s
    ST_RC[$s]=$rc; ST_STATUS[$s]=$(status_of "$rc"); ST_SECS[$s]=$(( $(stat -c %Y "$WORK/.$s.rc" 2>/dev/null || date +%s) - T0 - ST_START[$s] ))
    [ $s = build-e2e ] && str llama_bench "$([ -x "$BIN/llama-bench" ] && echo built || echo missing)"
    [ $s = model ] && { str model "$MODEL"; num bytes "$(stat -c %s "$MODEL" 2>/dev/null)"; }
    echo "== $s (background): ${ST_STATUS[$s]} (rc $rc, ${ST_SECS[$s]}s)"
    STAGE=$keep
    ST_PID[$s]=""
    write_summary
}

stage_e2e() {
    begin e2e e2e.log || return
    [ $DRY = 1 ] && echo "      (waits for model and build-e2e)"
    [ $DRY = 1 ] || { wait_bg model; wait_bg build-e2e; STAGE=e2e; }
    if [ $DRY = 0 ]; then
        [ -x "$BIN/llama-bench" ] || { skip "llama-bench not built"; return; }
        [ -f "$MODEL" ] || { skip "no model"; return; }
    fi
    local d rc=0 r dense sparse loki depths="" dl="" sl="" su="" ll="" lu=""
    # per depth, dense then sparse, so that a deadline cuts the last pairs only
    for d in ${E2E_DEPTHS//,/ }; do
        run_to "$WORK/e2e-dense-$d.jsonl" e2e.log env "$(RUN_LD)" "$BIN/llama-bench" -m "$MODEL" -ngl 99 -fa 1 -p 0 -n 32 -r 3 -d "$d" -o jsonl
        r=$?; [ $r != 0 ] && rc=$r
        run_to "$WORK/e2e-sparse-$d.jsonl" e2e.log env "$(RUN_LD)" "$BIN/llama-bench" -m "$MODEL" -ngl 99 -fa 1 -p 0 -n 32 -r 3 -d "$d" -o jsonl --sparse-attn "$E2E_SPARSE"
        r=$?; [ $r != 0 ] && rc=$r
        if [[ ",$E2E_LOKI_DEPTHS," == *",$d,"* ]] && { [ $DRY = 1 ] || [ -f "$PROJ" ]; }; then
            run_to "$WORK/e2e-loki-$d.jsonl" e2e.log env "$(RUN_LD)" "LLAMA_SPARSE_ATTN=$E2E_LOKI,proj=$PROJ" "$BIN/llama-bench" -m "$MODEL" -ngl 99 -fa 1 -p 0 -n 32 -r 3 -d "$d" -o jsonl
            r=$?; [ $r != 0 ] && rc=$r
        fi
        [ $DRY = 1 ] && continue
        loki=$(sed -nE 's/.*"avg_ts": *([0-9.eE+-]+).*/\1/p' "$WORK/e2e-loki-$d.jsonl" 2>/dev/null | head -1)
        [ -n "$loki" ] && { ll+="${ll:+, }\"$d\": $(jnum "$loki")"
            lu+="${lu:+, }\"$d\": $(jnum "$(awk -v a="$(sed -nE 's/.*"avg_ts": *([0-9.eE+-]+).*/\1/p' "$WORK/e2e-dense-$d.jsonl" 2>/dev/null | head -1)" -v b="$loki" 'BEGIN { if (a > 0 && b > 0) printf "%.3f", b / a }')")"; }
        dense=$(sed -nE 's/.*"avg_ts": *([0-9.eE+-]+).*/\1/p' "$WORK/e2e-dense-$d.jsonl" 2>/dev/null | head -1)
        sparse=$(sed -nE 's/.*"avg_ts": *([0-9.eE+-]+).*/\1/p' "$WORK/e2e-sparse-$d.jsonl" 2>/dev/null | head -1)
        depths+="${depths:+, }$d"; dl+="${dl:+, }\"$d\": $(jnum "$dense")"; sl+="${sl:+, }\"$d\": $(jnum "$sparse")"
        su+="${su:+, }\"$d\": $(jnum "$(awk -v a="$dense" -v b="$sparse" 'BEGIN { if (a > 0 && b > 0) printf "%.3f", b / a }')")"
        ST_NUMS[e2e]=""; str sparse_attn "$E2E_SPARSE"; str model "$MODEL"; raw depths "[$depths]"
        raw dense_tg_ts "{$dl}"; raw sparse_tg_ts "{$sl}"; raw speedup "{$su}"
        [ -n "$ll" ] && { str loki "$E2E_LOKI"; raw loki_tg_ts "{$ll}"; raw loki_speedup "{$lu}"; }
        write_summary
    done
    finish $rc
}

stage_profile() {  # what time e2e leaves: Nsight Compute's per-kernel summary of both ops at 32k (one layer, f16 and q8_0)
    begin profile bench.log || return
    local ncu="<ncu>"
    if [ $DRY = 0 ]; then
        ncu=$(command -v ncu || ls -d /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
        [ -n "$ncu" ] && [ -x "$ncu" ] || { skip "ncu not found"; return; }
        [ -x "$BIN/sparq-op-bench" ] || { skip "sparq-op-bench not built"; return; }
    fi
    run_to "$WORK/ncu.txt" bench.log env "$(RUN_LD)" "$ncu" --clock-control none --print-summary per-kernel --section SpeedOfLight --launch-count 200 \
        -k 'regex:sparse_attn|flash_attn' "$BIN/sparq-op-bench" -b CUDA0 --types f16,q8_0 --nh 8,32 --kv 32768 -l 1 -r 1 --ops sparq,flash
    finish $?
}

echo "sparq-cpp GPU check: budget ${BUDGET}s, logs in $LOGS$([ $DRY = 1 ] && echo ', dry run: nothing is executed')"
write_summary
for s in "${ALL_STAGES[@]}"; do
    selected "$s" || continue
    case $s in
        env) stage_env ;; unpack) stage_unpack ;; model) stage_model ;; configure) stage_configure ;;
        build) stage_build ;; build-e2e) stage_build_e2e ;; test) stage_test ;; opbench) stage_opbench ;;
        bandwidth) stage_bandwidth ;; e2e) stage_e2e ;; profile) stage_profile ;;
    esac
done
[ $DRY = 1 ] || { wait_bg model; wait_bg build-e2e; }
write_summary
echo "summary: $LOGS/summary.json ($(elapsed)s of ${BUDGET}s)"
"""


def installed_tree() -> Path | None:
    rec = installed_build()
    if not rec or rec.get("series_hash") != series_hash():
        return None
    for top in (Path(rec["root"]) / "src").glob("*"):
        llama = top / "vendor" / "llama.cpp"
        if (llama / "ggml" / "src" / "ggml-cuda").is_dir():
            return llama
    return None


def _keep(rel: Path, is_dir: bool) -> bool:
    """Whether a path of the patched tree (relative to it, inside TREE_PARTS) goes into the bundle."""
    parts = rel.parts
    if "__pycache__" in parts or ".git" in parts:
        return False
    if parts[:2] == ("ggml", "src") and len(parts) >= 3 and (is_dir or len(parts) > 3):
        return parts[2] in GGML_SRC_DIRS
    return True


def _python_files(root: Path, skip: tuple[str, ...] = ()) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix in (".py", ".typed") and not any(s in p.relative_to(root).parts for s in skip))


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    tar.addfile(info, io.BytesIO(data))


def write_run_sh(out: Path) -> Path:
    """run.sh alone (the dry run needs nothing else)."""
    out.mkdir(parents=True, exist_ok=True)
    run = out / "run.sh"
    run.write_text(RUN_SH)
    run.chmod(0o755)
    return run


def make_bundle(tree: Path, out: Path, package: Path | None = None, gguf_dir: Path | None = None,
                calib: Path | None = None) -> Path:
    """Write the bundle for the patched tree into out (replaced). package: the sparq_cpp folder to carry (default
    this checkout's), gguf_dir: the gguf package's (default the installed one), calib: the calib folder."""
    calib = calib or REPO_ROOT / "calib"
    if not (tree / "ggml" / "src" / "ggml-cuda" / "sparse-attn.cu").is_file():
        raise click.ClickException(f"{tree} has no ggml/src/ggml-cuda/sparse-attn.cu: the series has no CUDA kernel yet")
    missing = [p for p in TREE_PARTS if not (tree / p).exists()]
    if missing:
        raise click.ClickException(f"{tree} lacks {', '.join(missing)}")
    package = package or REPO_ROOT / "sparq_cpp"
    gguf_dir = gguf_dir or Path(gguf.__file__).parent
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    # gzip's header without a time: the same files give the same digest, and a second run on the same machine
    # keeps its build (run.sh's unpack stage compares SERIES)
    with open(out / "llama-trimmed.tar.gz", "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w") as tar:
        for part in TREE_PARTS:
            def filt(info: tarfile.TarInfo):
                return info if _keep(Path(info.name), info.isdir()) else None
            tar.add(tree / part, arcname=part, filter=filt)
        for name, text in (("tests/CMakeLists.txt", TESTS_CMAKELISTS), ("tools/CMakeLists.txt", TOOLS_CMAKELISTS),
                           ("vendor/CMakeLists.txt", VENDOR_CMAKELISTS), ("sparq-ops/CMakeLists.txt", OPS_CMAKELISTS),
                           ("sparq/bw.cu", BW_CU), ("sparq/op-bench.cpp", OP_BENCH_CPP),
                           ("sparq/write_model.py", WRITE_MODEL_PY)):
            _add_bytes(tar, name, text.encode())
        for root, arc, skip in ((package, "sparq/py/sparq_cpp", ()), (gguf_dir, "sparq/py/gguf", ("scripts",))):
            for f in _python_files(root, skip):
                tar.add(f, arcname=f"{arc}/{f.relative_to(root).as_posix()}")
        # the Loki projection writer (sparq_cpp.calib maps to calib/), without the calibration that needs llama.cpp
        for name in CALIB_FILES:
            tar.add(calib / name, arcname=f"sparq/py/sparq_cpp/calib/{name}")
        _add_bytes(tar, "sparq/py/sparq_cpp/calib/__init__.py", CALIB_INIT.encode())
    write_run_sh(out)
    digest = hashlib.sha256((out / "llama-trimmed.tar.gz").read_bytes()).hexdigest()
    (out / "SERIES").write_text(f"series_hash {series_hash()}\ntree_tar_sha256 {digest}\n"
                                + "".join(p.name + "\n" for p in series()))
    return out


def bundle_size(out: Path) -> int:
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


def dry_run(bundle: Path, budget: int = DEFAULT_BUDGET, worst: bool = False, env: dict | None = None) -> dict:
    """run.sh --dry-run of the bundle: the summary it writes (every stage "planned" or "skipped", its limit and
    commands), with the printed plan as "printed". Runs nothing; needs no GPU."""
    with tempfile.TemporaryDirectory() as tmp:
        e = {**os.environ, **(env or {}), "OUT": tmp}
        e.setdefault("GPU_CHECK_WORK", str(Path(tmp) / "work"))
        proc = subprocess.run(["bash", str(bundle / "run.sh"), "--dry-run=worst" if worst else "--dry-run",
                               "--budget", str(budget)], capture_output=True, text=True, env=e, timeout=60)
        if proc.returncode != 0:
            raise click.ClickException(f"run.sh --dry-run failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
        summary = json.loads((Path(tmp) / "summary.json").read_text())
    summary["printed"] = proc.stdout
    return summary


@click.command()
@click.option("--tree", type=click.Path(file_okay=False, path_type=Path), help="A patched llama.cpp tree (make tree).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_OUT, show_default=True)
@click.option("--dry-run", "dry", is_flag=True, help="Then print run.sh's plan (nothing runs, no GPU needed).")
@click.option("--budget", type=int, default=DEFAULT_BUDGET, show_default=True, help="Seconds, for --dry-run.")
def main(tree: Path | None, out: Path, dry: bool, budget: int):
    """Write the GPU check bundle (see the module's docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        if tree is None:
            tree = installed_tree()
        if tree is None:
            top = unpack_sdist(fetch_sdist(log=lambda *_: None), Path(tmp) / "sdist")
            tree = top / "vendor" / "llama.cpp"
            patch_tree(tree)
        make_bundle(tree, out)
    size = bundle_size(out)
    if size > TREE_LIMIT // 2:
        click.echo(f"warning: the bundle is {size / 2**20:.1f} MiB; with the working tree it must stay under "
                   f"{TREE_LIMIT // 2**20} MiB to travel to the device", err=True)
    if dry:
        click.echo(dry_run(out, budget)["printed"], nl=False)
    try:
        shown = out.relative_to(Path.cwd())
    except ValueError:
        shown = out
    click.echo(f"{out}: {size / 2**20:.1f} MiB. On the GPU machine (one command, {DEFAULT_BUDGET} s by default): "
               f"OUT=<dir> {shown}/run.sh   (carry {shown}; `run.sh --help`)")


if __name__ == "__main__":
    main()
