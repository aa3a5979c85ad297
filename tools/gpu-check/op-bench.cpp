// The sparse attention op beside flash attention at batch 1, over many layers' caches (the sparq-cpp GPU check). Each
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
