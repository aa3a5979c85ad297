// Runs ggml-cuda/sparse-attn.cu, made host code by transform.py and emu.h, against ggml's CPU SPARSE_ATTN op: the
// shapes of test-backend-ops with its planted inputs (the generator is copied from there) and with uniform random
// inputs, and the model's layout. A case passes with a normalized mean squared error within test-backend-ops's 5e-4,
// no value that is not finite, and all scratch returned.
#include "sparse-attn-emu.inc"
#include "ggml-cpu.h"
#include <random>
#include <string>

struct sparse_attn_test_data { std::vector<int32_t> pos; std::vector<float> mask; };

static sparse_attn_test_data init_pos_mask(int64_t kv, int64_t nb, int n_seq, int swa, std::mt19937 & gen) {
    sparse_attn_test_data td;
    td.pos.resize(kv);
    for (int64_t i = 0; i < kv; ++i) td.pos[i] = (int32_t) i;
    std::shuffle(td.pos.begin(), td.pos.end(), gen);
    td.mask.assign(nb*kv, 0.0f);
    if (n_seq > 1 || swa > 0) {
        td.mask.assign(nb*kv, -INFINITY);
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t s  = b % n_seq;
            const int64_t pb = kv - 1 - (b*37) % std::max<int64_t>(1, kv/4);
            for (int64_t i = 0; i < kv; ++i) {
                if (i % n_seq == s && td.pos[i] <= pb && (swa == 0 || td.pos[i] > pb - swa)) td.mask[b*kv + i] = 0.0f;
            }
        }
    } else {
        // like init_tensor_kq_mask: random values, about 20% in -INF blocks of 128 cells x 64 rows (here: per row)
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        for (auto & x : td.mask) x = u(gen);
        for (int64_t b = 0; b < nb; ++b) {
            for (int64_t i0 = 0; i0 < kv; i0 += 128) {
                if (gen() % 5 == 0) for (int64_t i = i0; i < std::min(kv, i0 + 128); ++i) td.mask[b*kv + i] = -INFINITY;
            }
        }
    }
    return td;
}

static void set_f32(ggml_tensor * t, const std::vector<float> & x) {
    GGML_ASSERT((int64_t) x.size() == ggml_nelements(t));
    if (t->type == GGML_TYPE_F32) memcpy(t->data, x.data(), x.size()*4);
    else if (t->type == GGML_TYPE_F16) ggml_fp32_to_fp16_row(x.data(), (ggml_fp16_t *) t->data, x.size());
    else ggml_quantize_chunk(t->type, x.data(), t->data, 0, ggml_nrows(t), t->ne[0], nullptr);
}

static void init_qk_planted(ggml_tensor * q, ggml_tensor * k, ggml_tensor * kt, int64_t hs, int64_t nh, int64_t nr,
        int64_t kv, int64_t nb, int32_t r, bool loki, std::mt19937 & gen) {
    const int   n_bin = (int) std::min<int64_t>(5, std::max<int64_t>(1, (kv + 1023)/1024));
    const float scale = 1.0f/sqrtf((float) hs);
    std::vector<float> vals;
    for (int e = 0; e < n_bin; ++e) for (int m = 0; m < 1024; ++m) vals.push_back(ldexpf(1.0f + m/1024.0f, e - n_bin));
    std::uniform_real_distribution<float> mag(0.75f, 1.0f);
    const float alpha = loki ? 0.25f*(1 << n_bin)/(scale*0.875f*r) : 0.25f*(1 << n_bin)/(scale*sqrtf(0.875f*hs*r));
    std::vector<float> qd(hs*nb*nh*nr), kd(hs*kv*nh), ktd(kt ? kv*hs*nh : 0);
    for (int64_t h = 0; h < nh; ++h) {
        std::vector<float> sign(hs);
        for (int64_t d = 0; d < hs; ++d) sign[d] = gen() & 1 ? 1.0f : -1.0f;
        std::shuffle(vals.begin(), vals.end(), gen);
        for (int64_t i = 0; i < kv; ++i) {
            float lvl = vals[i % vals.size()];
            if (loki && k->type == GGML_TYPE_Q8_0) lvl *= 127.0f/128.0f;
            for (int64_t d = 0; d < hs; ++d) {
                kd[(h*kv + i)*hs + d] = sign[d]*lvl;
                if (kt) ktd[(h*hs + d)*kv + i] = sign[d]*lvl;
            }
        }
        for (int64_t j = 0; j < nr; ++j) for (int64_t b = 0; b < nb; ++b) for (int64_t d = 0; d < hs; ++d)
            qd[((h*nr + j)*nb + b)*hs + d] = sign[d]*alpha*mag(gen);
    }
    set_f32(q, qd); set_f32(k, kd);
    if (kt) set_f32(kt, ktd);
}

static void init_uniform(ggml_tensor * t, std::mt19937 & gen) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> x(ggml_nelements(t));
    for (auto & v : x) v = u(gen);
    set_f32(t, x);
}

struct tcase { int64_t hs, nh, nr, kv, nb; int r, top_k, n_local; bool mv, vmean; ggml_type type; int n_seq, swa; bool loki; int n_sink = 0; };

static bool run(const tcase & c, bool planted, unsigned seed) {
    ggml_init_params ip = { (size_t) 512*1024*1024, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, c.hs, c.nb, c.nh*c.nr, 1);
    ggml_tensor * k = ggml_new_tensor_4d(ctx, c.type, c.hs, c.kv, c.nh, 1);
    ggml_tensor * v = ggml_new_tensor_4d(ctx, c.type, c.hs, c.kv, c.nh, 1);
    ggml_tensor * m = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, c.kv, c.nb, 1, 1);
    ggml_tensor * p = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, c.kv);
    ggml_tensor * kt = nullptr, * vm = nullptr, * ktsrc = nullptr;
    if (!c.loki) {
        if (ggml_is_quantized(c.type)) { kt = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, c.kv, c.hs, c.nh, 1); ktsrc = kt; }
        else kt = ggml_cont(ctx, ggml_permute(ctx, k, 1, 0, 2, 3));
        if (c.vmean) vm = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, c.hs, c.nh, c.nb, 1);
    }
    const float scale = 1.0f/sqrtf((float) c.hs);
    ggml_tensor * out = c.loki ? ggml_loki_attn(ctx, q, k, v, m, p, scale, c.r, c.top_k, c.n_local)
                               : ggml_sparq_attn(ctx, q, k, kt, v, m, p, vm, scale, c.r, c.top_k, c.n_local, c.mv);
    if (c.n_sink > 0) {
        ggml_sparse_attn_set_sink(out, c.n_sink);
    }

    std::mt19937 gen(seed);
    sparse_attn_test_data td = init_pos_mask(c.kv, c.nb, c.n_seq, c.swa, gen);
    if (planted) init_qk_planted(q, k, ktsrc, c.hs, c.nh, c.nr, c.kv, c.nb, c.r, c.loki, gen);
    else { init_uniform(q, gen); init_uniform(k, gen); if (ktsrc) init_uniform(ktsrc, gen); }
    init_uniform(v, gen);
    if (vm) init_uniform(vm, gen);
    set_f32(m, td.mask);
    memcpy(p->data, td.pos.data(), c.kv*4);

    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_graph_compute_with_ctx(ctx, gf, 2);
    std::vector<float> ref((float *) out->data, (float *) out->data + ggml_nelements(out));

    char name[256];
    snprintf(name, sizeof(name), "%s hs=%lld nh=%lld nr=%lld kv=%lld nb=%lld r=%d top_k=%d n_local=%d n_sink=%d mv=%d vmean=%d %s n_seq=%d swa=%d %s",
        c.loki ? "loki " : "sparq", (long long) c.hs, (long long) c.nh, (long long) c.nr, (long long) c.kv, (long long) c.nb, c.r, c.top_k,
        c.n_local, c.n_sink, c.mv, c.vmean, ggml_type_name(c.type), c.n_seq, c.swa, planted ? "planted" : "uniform");
    if (!ggml_cuda_sparse_attn_supported(0, out)) {
        printf("NOT SUPPORTED %s\n", name);
        ggml_free(ctx);
        return true;
    }
    memset(out->data, 0xFF, ggml_nbytes(out));
    ggml_backend_cuda_context cctx;
    ggml_cuda_sparse_attn(cctx, out);
    const float * y = (const float *) out->data;
    double num = 0, den = 0, maxd = 0;
    int n_nan = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        if (!std::isfinite(y[i])) n_nan++;
        num += (double) (y[i] - ref[i])*(y[i] - ref[i]);
        den += (double) ref[i]*ref[i];
        maxd = std::max(maxd, (double) fabsf(y[i] - ref[i]));
    }
    const double nmse = num/std::max(den, 1e-30);
    const bool ok = n_nan == 0 && nmse <= 5e-4 && cctx.p.in_use == 0;
    printf("%s nmse=%.3e maxdiff=%.3e %s\n", ok ? "OK  " : "FAIL", nmse, maxd, name);
    fflush(stdout);
    ggml_free(ctx);
    return ok;
}

// the model's layout: K, V (and kt) views of a longer cache with all kv heads in one row, q a permuted view, two
// sequences in dim 3 (pos per sequence, the mask broadcast), the mask padded in rows; uniform random data
static bool run_layout(bool loki, ggml_type type, bool vmean_t, unsigned seed) {
    const int64_t hs = 128, nh = 2, nr = 4, kv = 700, kv_size = 777, nb = 5, ne3 = 2;
    const int r = loki ? 24 : 16, top_k = 64, n_local = 8;
    ggml_init_params ip = { (size_t) 256*1024*1024, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * kc = ggml_new_tensor_3d(ctx, type, hs*nh, kv_size, ne3);
    ggml_tensor * vc = ggml_new_tensor_3d(ctx, type, hs*nh, kv_size, ne3);
    ggml_tensor * qc = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, hs, nh*nr, nb, ne3);
    ggml_tensor * m  = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, kv, nb + 3, 1, 1);
    ggml_tensor * p  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, kv, ne3);
    ggml_tensor * k = ggml_view_4d(ctx, kc, hs, kv, nh, ne3, kc->nb[1], ggml_row_size(type, hs), kc->nb[2], 0);
    ggml_tensor * v = ggml_view_4d(ctx, vc, hs, kv, nh, ne3, vc->nb[1], ggml_row_size(type, hs), vc->nb[2], 0);
    ggml_tensor * q = ggml_permute(ctx, qc, 0, 2, 1, 3);
    ggml_tensor * ktc = nullptr, * kt = nullptr, * vm = nullptr;
    if (!loki) {
        ktc = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, kv_size, hs, nh, ne3);
        kt  = ggml_view_4d(ctx, ktc, kv, hs, nh, ne3, ktc->nb[1], ktc->nb[2], ktc->nb[3], 0);
        if (vmean_t) vm = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, hs, nh, nb, ne3);
    }
    const float scale = 1.0f/sqrtf((float) hs);
    ggml_tensor * out = loki ? ggml_loki_attn(ctx, q, k, v, m, p, scale, r, top_k, n_local)
                             : ggml_sparq_attn(ctx, q, k, kt, v, m, p, vm, scale, r, top_k, n_local, true);
    std::mt19937 gen(seed);
    init_uniform(kc, gen); init_uniform(vc, gen); init_uniform(qc, gen);
    if (ktc) init_uniform(ktc, gen);
    if (vm) init_uniform(vm, gen);
    std::vector<int32_t> pos(kv*ne3);
    for (int64_t s = 0; s < ne3; ++s) {
        for (int64_t i = 0; i < kv; ++i) pos[s*kv + i] = (int32_t) i;
        std::shuffle(pos.begin() + s*kv, pos.begin() + (s + 1)*kv, gen);
    }
    memcpy(p->data, pos.data(), pos.size()*4);
    std::vector<float> mk((nb + 3)*kv, -INFINITY);
    for (int64_t b = 0; b < nb; ++b) for (int64_t i = 0; i < kv; ++i) if (pos[i] <= kv - 1 - b*50) mk[b*kv + i] = 0.0f;
    set_f32(m, mk);

    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_graph_compute_with_ctx(ctx, gf, 2);
    std::vector<float> ref((float *) out->data, (float *) out->data + ggml_nelements(out));
    if (!ggml_cuda_sparse_attn_supported(0, out)) { printf("NOT SUPPORTED layout\n"); return false; }
    memset(out->data, 0xFF, ggml_nbytes(out));
    ggml_backend_cuda_context cctx;
    ggml_cuda_sparse_attn(cctx, out);
    const float * y = (const float *) out->data;
    double num = 0, den = 0; int n_nan = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        if (!std::isfinite(y[i])) n_nan++;
        num += (double) (y[i] - ref[i])*(y[i] - ref[i]);
        den += (double) ref[i]*ref[i];
    }
    const double nmse = num/std::max(den, 1e-30);
    const bool ok = n_nan == 0 && nmse <= 5e-4;
    printf("%s nmse=%.3e layout %s %s ne3=2 vmean=%d nsm=%d\n", ok ? "OK  " : "FAIL", nmse, loki ? "loki" : "sparq", ggml_type_name(type), vm != nullptr, g_emu_nsm);
    fflush(stdout);
    ggml_free(ctx);
    return ok;
}

// the ALISA ranking has no CUDA kernel: supports_op must refuse it, so the scheduler runs it on the CPU
static bool run_alisa_refused() {
    ggml_init_params ip = { 16*1024*1024, nullptr, false };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 128, 1, 8, 1);
    ggml_tensor * k = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, 128, 1000, 2, 1);
    ggml_tensor * v = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, 128, 1000, 2, 1);
    ggml_tensor * m = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, 1000, 1, 1, 1);
    ggml_tensor * p = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, 1000);
    ggml_tensor * s = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1000, 1);
    ggml_tensor * out = ggml_alisa_attn(ctx, q, k, v, m, p, s, 0.088f, 0.125f);
    const bool refused = !ggml_cuda_sparse_attn_supported(0, out);
    printf("%s alisa ranking refused by supports_op\n", refused ? "OK  " : "FAIL");
    ggml_free(ctx);
    return refused;
}

// emu_main all|planted|uniform|layout|quick: the cases of test-backend-ops (planted and uniform inputs), the model
// layout (at 132 and 1 SMs, so both the smallest and the largest slices of the exact attention), or a quick subset
int main(int argc, char ** argv) {
    const std::string what = argc > 1 ? argv[1] : "all";
    const bool quick = what == "quick";
    std::vector<tcase> cs;
    for (ggml_type t : { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0 }) {
        for (bool loki : { false, true }) {
            const int r = loki ? 32 : 16;
            const bool mv = !loki;
            for (int hs : { 64, 128 }) for (int nr : { 1, 4 }) for (int nb : { 1, 3 })
                cs.push_back({ hs, 2, nr, 1000, nb, loki ? 32 : 8, 64, loki ? 0 : 16, mv, false, t, 1, 0, loki });
            cs.push_back({ 128, 2, 4, 1000, 1, r, 64, 16, mv, !loki, t, 1, 0, loki });
            cs.push_back({ 128, 16, 1, 1000, 1, r, 64, 16, mv, false, t, 1, 0, loki });
            cs.push_back({ 128, 2, 4, 1000, 1, r, 64, 16, false, false, t, 1, 0, loki });
            cs.push_back({ 128, 2, 4, 1000, 1, r, 64, 0, mv, false, t, 1, 0, loki });
            cs.push_back({ 128, 2, 4, 1000, 1, r, 64, 64, mv, false, t, 1, 0, loki });
            cs.push_back({ 128, 2, 4, 1000, 1, 1, 1, 1, mv, false, t, 1, 0, loki });
            cs.push_back({ 128, 2, 4, 1000, 1, 128, 64, 16, mv, false, t, 1, 0, loki });
            cs.push_back({ 128, 2, 4, 1000, 2, r, 1000, 16, mv, false, t, 1, 0, loki });
            cs.push_back({ 128, 2, 4, 5000, 1, r, 128, 32, mv, !loki, t, 1, 0, loki });
            cs.push_back({ 256, 2, 4, 1000, 2, r, 64, 16, mv, false, t, 1, 0, loki });
            cs.push_back({ 128, 2, 8, 1000, 1, r, 64, 16, mv, false, t, 1, 0, loki });
            cs.push_back({ 128, 1, 12, 1000, 3, r, 64, 16, mv, false, t, 1, 0, loki });
            cs.push_back({ 64, 1, 32, 1000, 1, loki ? 7 : 8, 64, 16, mv, false, t, 1, 0, loki });
            cs.push_back({ 128, 2, 4, 100, 3, r, 32, 8, mv, false, t, 1, 0, loki });
            cs.push_back({ 128, 2, 4, 300, 37, r, 64, 16, mv, !loki, t, 1, 0, loki });
            cs.push_back({ 128, 2, 4, 1000, 4, r, 64, 16, mv, false, t, 2, 0, loki });
            cs.push_back({ 128, 2, 4, 1000, 6, r, 64, 16, mv, false, t, 3, 400, loki });
            cs.push_back({ 128, 2, 4, 1000, 4, r, 64, 16, mv, false, t, 2, 100, loki });
            // the selection over many tiles (79 at 132 SMs), planted scores tied in groups of about 4 cells
            cs.push_back({ 128, 2, 4, 20000, 1, r, 128, 32, mv, !loki, t, 1, 0, loki });
            // a local window wider than the 2047 near bins of its histogram: its boundary is the far bin
            cs.push_back({ 128, 2, 4, 6000, 2, r, 3000, 2500, mv, false, t, 1, 0, loki });
            // top_k above n_kv, and l = k over many tiles
            cs.push_back({ 128, 2, 4, 1000, 1, r, 2000, 16, mv, false, t, 1, 0, loki });
            cs.push_back({ 128, 2, 4, 9000, 1, r, 100, 100, mv, false, t, 1, 0, loki });
            // the first positions kept (an attention sink): one, several sequences, no local window, all of the budget
            cs.push_back({ 128, 2, 4, 20000, 1, r, 128, 32, mv, false, t, 1, 0, loki, 1 });
            cs.push_back({ 128, 2, 4, 1000, 4, r, 64, 16, mv, false, t, 2, 0, loki, 4 });
            cs.push_back({ 128, 2, 4, 1000, 2, r, 64, 0, mv, false, t, 1, 0, loki, 64 });
            cs.push_back({ 128, 2, 4, 1000, 3, r, 64, 16, mv, false, t, 3, 400, loki, 48 });
        }
    }
    int n_fail = 0, n = 0;
    for (bool planted : { true, false }) {
        if (what != "all" && what != (planted ? "planted" : "uniform") && !(quick && planted)) continue;
        for (size_t i = 0; i < cs.size(); ++i) {
            // and in the quick tier the large shapes (many tiles of the selection) and the sinks of the f16 cache
            if (quick && i % 9 != 0 && !((cs[i].kv >= 6000 || cs[i].n_sink > 0) && cs[i].type == GGML_TYPE_F16)) continue;
            n++;
            n_fail += !run(cs[i], planted, 1234 + (unsigned) i);
        }
    }
    if (what == "all" || what == "layout" || quick) {
        for (int nsm : { 132, 1 }) {
            if (quick && nsm != 1) continue;
            g_emu_nsm = nsm;
            for (ggml_type t : { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q8_0 }) {
                if (quick && t == GGML_TYPE_F32) continue;
                for (bool loki : { false, true }) {
                    n++;
                    n_fail += !run_layout(loki, t, false, 77);
                    if (!loki) { n++; n_fail += !run_layout(loki, t, true, 78); }
                }
            }
        }
        g_emu_nsm = 132;
    }
    n++;
    n_fail += !run_alisa_refused();
    printf("%d of %d failed, %ld blocks emulated\n", n_fail, n, g_emu_blocks);
    return n == 0 || n_fail != 0;
}
