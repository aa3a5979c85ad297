// GGML_OP_SPARSE_ATTN: attention over a selection of the kv cells (SparQ and Loki)
//
// The kv cells are split in chunks of a fixed size, so the result does not depend on the thread count.
// phase 1, per (kv head, chunk): approximate scores, exp(score - chunk max), chunk sums
// phase 2, per kv head: top-k of the group sum of the normalized scores, exact attention, mean value
//
// Every loop has a plain path (any type, any instruction set) and, where it pays, one vectorised body written
// against the small vector layer below (AVX-512, AVX2, NEON), which computes each value the same way.

#define GGML_COMMON_DECL_CPP
#include "ggml-common.h"

#include "ops.h"

#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#ifdef GGML_SPARSE_ATTN_PROFILE
#include <atomic>
#include <chrono>
#endif

static constexpr int64_t GGML_SPARSE_ATTN_CHUNK     = 1024;
static constexpr int64_t GGML_SPARSE_ATTN_TILE      = 256;  // kt cells converted at a time on the plain path
static constexpr int64_t GGML_SPARSE_ATTN_STRIDE    = 32;   // the top-k threshold is estimated from at most every 32nd visible cell
static constexpr int64_t GGML_SPARSE_ATTN_STEP      = 64;   // cells scored together on the vector path
static constexpr int64_t GGML_SPARSE_ATTN_ROW_GROUP = 4;    // rows of kt read together on the vector path

#if defined(__GNUC__)
#define GGML_SPARSE_ATTN_PREFETCH(p)    __builtin_prefetch((p), 0, 2)
#define GGML_SPARSE_ATTN_PREFETCH_NT(p) __builtin_prefetch((p), 0, 0)
#else
#define GGML_SPARSE_ATTN_PREFETCH(p)
#define GGML_SPARSE_ATTN_PREFETCH_NT(p)
#endif

// requests every cache line of [p, p + n): a q8_0 row (34 bytes a block) may start anywhere in a line, so stepping
// 64 bytes from p would miss its last line half the time
static inline void ggml_sparse_attn_prefetch_bytes(const char * p, size_t n) {
    const uintptr_t a1 = (uintptr_t) p + n;
    for (uintptr_t a = (uintptr_t) p & ~(uintptr_t) 63; a < a1; a += 64) {
        GGML_SPARSE_ATTN_PREFETCH((const char *) a);
    }
}

static inline int ggml_sparse_attn_ctz(uint64_t x) {
#if defined(__GNUC__)
    return __builtin_ctzll(x);
#else
    int n = 0;
    while (!(x & 1)) {
        x >>= 1;
        n++;
    }
    return n;
#endif
}

//
// vector layer: a vector of W floats and the operations the kernel uses
//

namespace ggml_sparse_attn_simd {

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define GGML_SPARSE_ATTN_SIMD

using vec = __m512;
static constexpr int W = 16;

static inline vec  zero()                       { return _mm512_setzero_ps(); }
static inline vec  set1(float x)                { return _mm512_set1_ps(x); }
static inline vec  load(const float * p)        { return _mm512_loadu_ps(p); }
static inline vec  load(const ggml_fp16_t * p)  { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) p)); }
static inline vec  load(const int8_t * p)       { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) p))); }
static inline void store(float * p, vec x)      { _mm512_storeu_ps(p, x); }
static inline vec  add(vec a, vec b)            { return _mm512_add_ps(a, b); }
static inline vec  sub(vec a, vec b)            { return _mm512_sub_ps(a, b); }
static inline vec  mul(vec a, vec b)            { return _mm512_mul_ps(a, b); }
static inline vec  max(vec a, vec b)            { return _mm512_max_ps(a, b); }
static inline vec  fma(vec a, vec b, vec c)     { return _mm512_fmadd_ps(a, b, c); } // a*b + c
static inline vec  exp(vec x)                   { return ggml_v_expf(x); }
static inline float reduce_add(vec x)           { return _mm512_reduce_add_ps(x); }
static inline float reduce_max(vec x)           { return _mm512_reduce_max_ps(x); }
static inline uint32_t mask_ge(vec x, vec t)    { return _mm512_cmp_ps_mask(x, t, _CMP_GE_OQ); } // bit u: x[u] >= t[u]

// the first n lanes
static inline void store_first(float * p, vec x, int n) {
    _mm512_mask_storeu_ps(p, (__mmask16) ((1u << n) - 1), x);
}

// r[t] = column t of the W x W block r
static inline void transpose(vec r[W]) {
    __m512 t[16];
    __m512 u[16];
    __m512 v[16];
    for (int k = 0; k < 8; ++k) {
        t[2*k + 0] = _mm512_unpacklo_ps(r[2*k], r[2*k + 1]);
        t[2*k + 1] = _mm512_unpackhi_ps(r[2*k], r[2*k + 1]);
    }
    for (int k = 0; k < 4; ++k) {
        u[4*k + 0] = _mm512_shuffle_ps(t[4*k + 0], t[4*k + 2], 0x44);
        u[4*k + 1] = _mm512_shuffle_ps(t[4*k + 0], t[4*k + 2], 0xEE);
        u[4*k + 2] = _mm512_shuffle_ps(t[4*k + 1], t[4*k + 3], 0x44);
        u[4*k + 3] = _mm512_shuffle_ps(t[4*k + 1], t[4*k + 3], 0xEE);
    }
    for (int k = 0; k < 2; ++k) {
        for (int j = 0; j < 4; ++j) {
            v[8*k + j]     = _mm512_shuffle_f32x4(u[8*k + j], u[8*k + 4 + j], 0x88);
            v[8*k + 4 + j] = _mm512_shuffle_f32x4(u[8*k + j], u[8*k + 4 + j], 0xDD);
        }
    }
    for (int j = 0; j < 8; ++j) {
        r[j]     = _mm512_shuffle_f32x4(v[j], v[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(v[j], v[8 + j], 0xDD);
    }
}

// lane t = the sum of the lanes of y[t]: W horizontal sums at once, halving the partial sums of every vector 4 times
static inline vec sum_each(const vec y[W]) {
    // in this slot order the halvings leave the sum of y[t] in lane t
    static constexpr int slot[16] = { 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15 };
    __m512 z[16];
    for (int t = 0; t < 16; ++t) {
        z[slot[t]] = y[t];
    }
    __m512 w[8];
    for (int u = 0; u < 8; ++u) {
        w[u] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2*u], z[2*u + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(z[2*u], z[2*u + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    __m512 x4[4];
    for (int u = 0; u < 4; ++u) {
        x4[u] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2*u], w[2*u + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(w[2*u], w[2*u + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    }
    __m512 x2[2];
    for (int u = 0; u < 2; ++u) {
        x2[u] = _mm512_add_ps(_mm512_shuffle_ps(x4[2*u], x4[2*u + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_ps(x4[2*u], x4[2*u + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    }
    return _mm512_add_ps(_mm512_shuffle_ps(x2[0], x2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(x2[0], x2[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define GGML_SPARSE_ATTN_SIMD

using vec = __m256;
static constexpr int W = 8;

static inline vec  zero()                       { return _mm256_setzero_ps(); }
static inline vec  set1(float x)                { return _mm256_set1_ps(x); }
static inline vec  load(const float * p)        { return _mm256_loadu_ps(p); }
static inline vec  load(const ggml_fp16_t * p)  { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p)); }
static inline vec  load(const int8_t * p)       { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) p))); }
static inline void store(float * p, vec x)      { _mm256_storeu_ps(p, x); }
static inline vec  add(vec a, vec b)            { return _mm256_add_ps(a, b); }
static inline vec  sub(vec a, vec b)            { return _mm256_sub_ps(a, b); }
static inline vec  mul(vec a, vec b)            { return _mm256_mul_ps(a, b); }
static inline vec  max(vec a, vec b)            { return _mm256_max_ps(a, b); }
static inline vec  fma(vec a, vec b, vec c)     { return _mm256_fmadd_ps(a, b, c); }
static inline vec  exp(vec x)                   { return ggml_v_expf(x); }
static inline uint32_t mask_ge(vec x, vec t)    { return (uint32_t) _mm256_movemask_ps(_mm256_cmp_ps(x, t, _CMP_GE_OQ)); }

// the order of ggml's GGML_F32x8_REDUCE
static inline float reduce_add(vec x) {
    const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 t1 = _mm_hadd_ps(t0, t0);
    return _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
}

static inline float reduce_max(vec x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

static inline void store_first(float * p, vec x, int n) {
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), x);
}

static inline void transpose(vec r[W]) {
    __m256 t[8];
    __m256 u[8];
    for (int k = 0; k < 4; ++k) {
        t[2*k + 0] = _mm256_unpacklo_ps(r[2*k], r[2*k + 1]);
        t[2*k + 1] = _mm256_unpackhi_ps(r[2*k], r[2*k + 1]);
    }
    for (int k = 0; k < 2; ++k) {
        u[4*k + 0] = _mm256_shuffle_ps(t[4*k + 0], t[4*k + 2], 0x44);
        u[4*k + 1] = _mm256_shuffle_ps(t[4*k + 0], t[4*k + 2], 0xEE);
        u[4*k + 2] = _mm256_shuffle_ps(t[4*k + 1], t[4*k + 3], 0x44);
        u[4*k + 3] = _mm256_shuffle_ps(t[4*k + 1], t[4*k + 3], 0xEE);
    }
    for (int j = 0; j < 4; ++j) {
        r[j]     = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
        r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
    }
}

static inline vec sum_each(const vec y[W]) {
    const __m256 t0 = _mm256_hadd_ps(y[0], y[1]);
    const __m256 t1 = _mm256_hadd_ps(y[2], y[3]);
    const __m256 t2 = _mm256_hadd_ps(y[4], y[5]);
    const __m256 t3 = _mm256_hadd_ps(y[6], y[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1); // vectors 0-3, low halves then high halves
    const __m256 u1 = _mm256_hadd_ps(t2, t3); // vectors 4-7
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#elif defined(__ARM_NEON) && defined(__aarch64__)
#define GGML_SPARSE_ATTN_SIMD

using vec = float32x4_t;
static constexpr int W = 4;

static inline vec  zero()                       { return vdupq_n_f32(0.0f); }
static inline vec  set1(float x)                { return vdupq_n_f32(x); }
static inline vec  load(const float * p)        { return vld1q_f32(p); }
static inline vec  load(const ggml_fp16_t * p)  { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *) p))); }
static inline vec  load(const int8_t * p) {
    int32_t x;
    memcpy(&x, p, sizeof(x)); // 4 bytes: the last lanes of a block end where the block does
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(x))))));
}
static inline void store(float * p, vec x)      { vst1q_f32(p, x); }
static inline vec  add(vec a, vec b)            { return vaddq_f32(a, b); }
static inline vec  sub(vec a, vec b)            { return vsubq_f32(a, b); }
static inline vec  mul(vec a, vec b)            { return vmulq_f32(a, b); }
static inline vec  max(vec a, vec b)            { return vmaxq_f32(a, b); }
static inline vec  fma(vec a, vec b, vec c)     { return vfmaq_f32(c, a, b); }
static inline float reduce_add(vec x)           { return vaddvq_f32(x); }
static inline float reduce_max(vec x)           { return vmaxvq_f32(x); }

static inline vec exp(vec x) {
#if !defined(__ARM_FEATURE_SVE)
    return ggml_v_expf(x);
#else
    // ggml's NEON expf is not built beside its SVE one
    float v[4];
    vst1q_f32(v, x);
    for (int u = 0; u < 4; ++u) {
        v[u] = expf(v[u]);
    }
    return vld1q_f32(v);
#endif
}

static inline uint32_t mask_ge(vec x, vec t) {
    static const uint32_t bit[4] = { 1, 2, 4, 8 };
    return vaddvq_u32(vandq_u32(vcgeq_f32(x, t), vld1q_u32(bit)));
}

static inline void store_first(float * p, vec x, int n) {
    float v[4];
    vst1q_f32(v, x);
    memcpy(p, v, n*sizeof(float));
}

static inline void transpose(vec r[W]) {
    const float32x4x2_t t01 = vtrnq_f32(r[0], r[1]);
    const float32x4x2_t t23 = vtrnq_f32(r[2], r[3]);
    r[0] = vcombine_f32(vget_low_f32 (t01.val[0]), vget_low_f32 (t23.val[0]));
    r[1] = vcombine_f32(vget_low_f32 (t01.val[1]), vget_low_f32 (t23.val[1]));
    r[2] = vcombine_f32(vget_high_f32(t01.val[0]), vget_high_f32(t23.val[0]));
    r[3] = vcombine_f32(vget_high_f32(t01.val[1]), vget_high_f32(t23.val[1]));
}

static inline vec sum_each(const vec y[W]) {
    return vpaddq_f32(vpaddq_f32(y[0], y[1]), vpaddq_f32(y[2], y[3]));
}

#endif

} // namespace ggml_sparse_attn_simd

#if defined(GGML_SPARSE_ATTN_SIMD)
// the K and V row types the vector paths read: W elements of a row from element e (a multiple of W) in F32, and the
// bytes of a row's first n elements. q8_0 gives the values of dequantize_row_q8_0 (scale times int8, exact in F32),
// so every result is the plain path's; W divides QK8_0, a vector never straddles two blocks.
struct ggml_sparse_attn_f16_rows {
    static inline ggml_sparse_attn_simd::vec at(const char * row, int64_t e) {
        return ggml_sparse_attn_simd::load((const ggml_fp16_t *) row + e);
    }
    static constexpr size_t bytes(int64_t n) { return n*sizeof(ggml_fp16_t); }
};

struct ggml_sparse_attn_q8_0_rows {
    static inline ggml_sparse_attn_simd::vec at(const char * row, int64_t e) {
        using namespace ggml_sparse_attn_simd;
        const block_q8_0 * b = (const block_q8_0 *) row + e/QK8_0;
        return mul(load(b->qs + e%QK8_0), set1(GGML_CPU_FP16_TO_FP32(b->d)));
    }
    static constexpr size_t bytes(int64_t n) { return (n + QK8_0 - 1)/QK8_0*sizeof(block_q8_0); }
};

static_assert(QK8_0 % ggml_sparse_attn_simd::W == 0, "a vector of q8_0 values within one block");
#endif

//
// scratch
//

struct ggml_sparse_attn_cand {
    float   s;
    int32_t pos;
    int32_t cell;
};

// total order: higher score, then more recent position, then higher cell index
struct ggml_sparse_attn_cand_greater {
    bool operator()(const ggml_sparse_attn_cand & a, const ggml_sparse_attn_cand & b) const {
        if (a.s != b.s) {
            return a.s > b.s;
        }
        if (a.pos != b.pos) {
            return a.pos > b.pos;
        }
        return a.cell > b.cell;
    }
};

// byte offsets of the buffers in the work data: first those shared by the threads, then one block per thread
struct ggml_sparse_attn_layout {
    int64_t chunk;   // kv cells per chunk
    int64_t n_chunk;
    int64_t n_sel;   // max number of selected cells

    // shared
    size_t scores;           // f32  [n_head][n_kv]           exp(score - chunk max)
    size_t chunk_stats;      // f32  [n_head][n_chunk][2]     chunk max, chunk sum
    size_t chunk_n_vis;      // i32  [n_chunk]                visible cells per chunk
    size_t chunk_v_sums;     // f32  [n_head_kv][n_chunk][DV] sum of V over the visible cells
    size_t local_cells;      // i32  [n_local]                the most recent visible cells
    size_t local_last;       // cand                          the least recent of them
    size_t sink_cells;       // i32  [1 + n_sel]              the number of sink cells kept, then those cells
    size_t set_sel;          // i32  [n_set][n_sel]           ALISA: the selection of each set
    size_t set_n_sel;        // i32  [n_set]
    size_t head_weights;     // f32  [n_head_kv][n_sel]       ALISA: each kv head's weights, summed over its group

    // per thread
    size_t thread_base;
    size_t thread_size;
    size_t runs;             // i32  [n_chunk][chunk + 2]     visible runs [a, b) of each chunk
    size_t n_runs;           // i32  [n_chunk]                (-1: not computed yet for this row)
    size_t comps;            // i32  [DK]                     SparQ: the r components of the kv head
    size_t comp_sums;        // f32  [DK]                     sum of |q| over the group (room for DK rounded up to 16)
    size_t q_ranked;         // f32  [n_hq][r]                the scaled query components the ranking uses
    size_t kt_rows;          // ptr  [r]                      the r rows of kt being scored
    size_t kt_tile;          // f32  [r][TILE]                kt rows converted to f32 (plain path)
    size_t chunk_factors;    // f32  [g][n_chunk]             exp(chunk max - max)/sum
    size_t samples;          // f32  [n_kv]                   sampled scores, then the candidates' scores (room for
                             //                               n_kv rounded up to 16)
    size_t run_scores;       // f32  [chunk]                  group scores of a run
    size_t candidates;       // cand [max(n_kv, 2*n_local) + 1]
    size_t selection;        // i32  [n_sel]
    size_t head_local_cells; // i32  [n_local]                local_cells and local_last, kv heads per thread
    size_t head_local_last;  // cand
    size_t head_sink_cells;  // i32  [1 + n_sel]              sink_cells, kv heads per thread
    size_t head_scores;      // f32  [g][n_kv]                scores, chunk_stats and chunk_v_sums of the thread's
    size_t head_chunk_stats; // f32  [g][n_chunk][2]          kv head, kv heads per thread
    size_t head_v_sums;      // f32  [n_chunk][DV]
    size_t weights;          // f32  [g][n_sel]               exact attention weights of the selection
    size_t out;              // f32  [g][DV]
    size_t alpha;            // f32  [g]                      approximate score mass of the selection
    size_t score_max;        // f32  [n_hq]                   max of a chunk's scores per query head
    size_t exp_sums;         // f32  [2][g]                   sums of exp(score - reference) of a chunk, references
    size_t row;              // f32  [max(DK, DV)]            a K or V row converted to f32
    size_t v_mean;           // f32  [DV]

    size_t size;
};

static ggml_sparse_attn_layout ggml_sparse_attn_get_layout(const ggml_tensor * dst, int nth) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[3];

    const int64_t DK        = k->ne[0];
    const int64_t DV        = v->ne[0];
    const int64_t n_kv      = k->ne[1];
    const int64_t n_head_kv = k->ne[2];
    const int64_t n_head    = q->ne[2];
    const int64_t g         = n_head/n_head_kv;

    // the local window is only selected when n_local < n_vis <= n_kv: its scratch never needs more
    const int64_t r       = ggml_get_op_params_i32(dst, 1);
    const int64_t top_k   = ggml_get_op_params_i32(dst, 2);
    const int64_t n_local = std::min<int64_t>(ggml_get_op_params_i32(dst, 3), n_kv);
    const int64_t n_sink  = ggml_get_op_params_i32(dst, 7);

    // Loki scores every kv head of a chunk in one pass: its queries and maxes are for all heads
    const bool    loki = ggml_get_op_params_i32(dst, 5) == GGML_SPARSE_ATTN_RANK_LOKI;
    const int64_t n_hq = loki ? n_head : g;

    ggml_sparse_attn_layout l;

    l.chunk   = std::max<int64_t>(1, std::min(n_kv, GGML_SPARSE_ATTN_CHUNK));
    l.n_chunk = (n_kv + l.chunk - 1)/l.chunk;
    l.n_sel   = std::min(top_k, n_kv);

    size_t off = 0;
    auto alloc = [&](size_t size) {
        const size_t res = off;
        off += GGML_PAD(size, CACHE_LINE_SIZE);
        return res;
    };

    l.scores       = alloc(sizeof(float)*n_head*n_kv);
    l.chunk_stats  = alloc(sizeof(float)*n_head*l.n_chunk*2);
    l.chunk_n_vis  = alloc(sizeof(int32_t)*l.n_chunk);
    l.chunk_v_sums = alloc(sizeof(float)*n_head_kv*l.n_chunk*DV);
    l.local_cells  = alloc(sizeof(int32_t)*std::max<int64_t>(n_local, 1));
    l.local_last   = alloc(sizeof(ggml_sparse_attn_cand));
    l.sink_cells   = alloc(sizeof(int32_t)*(1 + (n_sink > 0 ? l.n_sel : 0)));

    const bool    alisa = ggml_get_op_params_i32(dst, 5) == GGML_SPARSE_ATTN_RANK_ALISA;
    const int64_t n_set = alisa ? dst->src[7]->ne[1] : 0;
    l.set_sel      = alloc(sizeof(int32_t)*n_set*l.n_sel);
    l.set_n_sel    = alloc(sizeof(int32_t)*n_set);
    l.head_weights = alloc(sizeof(float)*(alisa ? n_head_kv : 0)*l.n_sel);

    l.thread_base = off;
    off = 0;

    l.runs             = alloc(sizeof(int32_t)*l.n_chunk*(l.chunk + 2));
    l.n_runs           = alloc(sizeof(int32_t)*l.n_chunk);
    l.comps            = alloc(sizeof(int32_t)*DK);
    l.comp_sums        = alloc(sizeof(float)*GGML_PAD(DK, 16));
    l.q_ranked         = alloc(sizeof(float)*n_hq*r);
    l.kt_rows          = alloc(sizeof(float *)*r);
    l.kt_tile          = alloc(sizeof(float)*r*GGML_SPARSE_ATTN_TILE);
    l.chunk_factors    = alloc(sizeof(float)*g*l.n_chunk);
    l.samples          = alloc(sizeof(float)*GGML_PAD(n_kv, 16));
    l.run_scores       = alloc(sizeof(float)*l.chunk);
    l.candidates       = alloc(sizeof(ggml_sparse_attn_cand)*(std::max(n_kv, 2*n_local) + 1));
    l.selection        = alloc(sizeof(int32_t)*l.n_sel);
    l.head_local_cells = alloc(sizeof(int32_t)*std::max<int64_t>(n_local, 1));
    l.head_local_last  = alloc(sizeof(ggml_sparse_attn_cand));
    l.head_sink_cells  = alloc(sizeof(int32_t)*(1 + (n_sink > 0 ? l.n_sel : 0)));
    l.head_scores      = alloc(sizeof(float)*g*n_kv);
    l.head_chunk_stats = alloc(sizeof(float)*g*l.n_chunk*2);
    l.head_v_sums      = alloc(sizeof(float)*l.n_chunk*DV);
    l.weights          = alloc(sizeof(float)*g*l.n_sel);
    l.out              = alloc(sizeof(float)*g*DV);
    l.alpha            = alloc(sizeof(float)*g);
    l.score_max        = alloc(sizeof(float)*n_hq);
    l.exp_sums         = alloc(sizeof(float)*2*g);
    l.row              = alloc(sizeof(float)*std::max(DK, DV));
    l.v_mean           = alloc(sizeof(float)*DV);

    l.thread_size = off;
    l.size = l.thread_base + nth*l.thread_size;

    return l;
}

size_t ggml_sparse_attn_work_size(const ggml_tensor * dst, int n_tasks) {
    return ggml_sparse_attn_get_layout(dst, n_tasks).size;
}

// requests for the kt rows that the thread's next kv head will score first, one cache line at a time from inside
// the selection's scan of the current head: the scan's arithmetic then runs while those lines arrive. One line per
// 32 scanned cells, in the order the next head reads them (line l of each of its r rows, then line l + 1); a higher
// rate left the scan waiting for the requests, and requests from the other phases slowed them as much as they saved.
struct ggml_sparse_attn_lookahead {
    const char    * kt      = nullptr; // the next kv head's kt, at its first visible cell
    const int32_t * comps   = nullptr; // its r components
    size_t          nb1     = 0;
    int64_t         r       = 0;
    int64_t         c       = 0;
    int64_t         line    = 0;
    int64_t         n_lines = 0;       // per row

    void next() {
        if (line < n_lines) {
            GGML_SPARSE_ATTN_PREFETCH(kt + comps[c]*nb1 + line*64);
            if (++c == r) {
                c = 0;
                ++line;
            }
        }
    }
};

struct ggml_sparse_attn_ctx {
    const ggml_tensor * q;
    const ggml_tensor * k;
    const ggml_tensor * kt;
    const ggml_tensor * v;
    const ggml_tensor * mask;
    const ggml_tensor * pos;
    const ggml_tensor * vmean;
    const ggml_tensor * sums;  // ALISA
    ggml_tensor       * dst;
    size_t              y_nb1, y_nb2, y_nb3; // the attention result in dst

    int64_t DK, DV, n_kv, n_batch, n_head, n_head_kv, g, ne3;

    float   scale;
    int64_t r, top_k, n_local;
    int64_t n_sink;  // positions below this rank above every other (the attention sink)
    bool    mean_value;
    int32_t rank;    // enum ggml_sparse_attn_rank; r is Loki's d
    float   c;       // ALISA's caching ratio

    ggml_to_float_t k_to_float;
    ggml_to_float_t v_to_float;

    ggml_sparse_attn_layout l;
    char * wdata;

    // kv heads per thread: the scores, chunk stats and V sums of the current kv head are in thread storage
    int ith_head = -1;

    // set per row
    const int32_t               * local_cells; // the n_local most recent visible cells
    const ggml_sparse_attn_cand * local_last;  // the least recent of them
    const int32_t               * sink_cells;  // [0]: the number of visible cells below n_sink kept, then those cells
    int64_t                       n_vis;       // visible cells
    int64_t                       i_vis;       // the first of them

    ggml_sparse_attn_lookahead * la = nullptr; // kv heads per thread: the next head's kt requests

    template <typename T> T * shared(size_t off) const {
        return (T *) (wdata + off);
    }
    template <typename T> T * local(int ith, size_t off) const {
        return (T *) (wdata + l.thread_base + ith*l.thread_size + off);
    }

    float * scores_of(int64_t h) const {
        return ith_head >= 0 ? local<float>(ith_head, l.head_scores) : shared<float>(l.scores) + h*g*n_kv;
    }
    float * stats_of(int64_t h) const {
        return ith_head >= 0 ? local<float>(ith_head, l.head_chunk_stats) : shared<float>(l.chunk_stats) + h*g*l.n_chunk*2;
    }
    float * v_sums_of(int64_t h) const {
        return ith_head >= 0 ? local<float>(ith_head, l.head_v_sums) : shared<float>(l.chunk_v_sums) + h*l.n_chunk*DV;
    }

    const float * q_row(int64_t iq1, int64_t hq, int64_t iq3) const {
        return (const float *) ((const char *) q->data + iq1*q->nb[1] + hq*q->nb[2] + iq3*q->nb[3]);
    }
    const char * k_row(int64_t i, int64_t h, int64_t iq3) const {
        return (const char *) k->data + i*k->nb[1] + h*k->nb[2] + iq3*k->nb[3];
    }
    const char * v_row(int64_t i, int64_t h, int64_t iq3) const {
        return (const char *) v->data + i*v->nb[1] + h*v->nb[2] + iq3*v->nb[3];
    }
    float * dst_row(int64_t iq1, int64_t hq, int64_t iq3) const {
        return (float *) ((char *) dst->data + hq*y_nb1 + iq1*y_nb2 + iq3*y_nb3);
    }
};

//
// small helpers
//

static inline bool ggml_sparse_attn_masked(ggml_fp16_t m) {
    return m == GGML_CPU_FP32_TO_FP16(-INFINITY);
}

// a K or V row in F32: the row itself, or its conversion in buf
static inline const float * ggml_sparse_attn_row_f32(const ggml_tensor * t, ggml_to_float_t to_float, const char * row, float * buf, int64_t n) {
    switch (t->type) {
        case GGML_TYPE_F32: return (const float *) row;
        case GGML_TYPE_F16: ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) row, buf, n); return buf;
        default:            to_float(row, buf, n); return buf;
    }
}

static float ggml_sparse_attn_max(const float * x, int64_t n) {
    // independent lanes, no dependency between consecutive elements
    float m[16];
    for (int u = 0; u < 16; ++u) {
        m[u] = -INFINITY;
    }
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        for (int u = 0; u < 16; ++u) {
            m[u] = x[i + u] > m[u] ? x[i + u] : m[u];
        }
    }
    for (; i < n; ++i) {
        m[0] = x[i] > m[0] ? x[i] : m[0];
    }
    for (int u = 1; u < 16; ++u) {
        m[0] = m[u] > m[0] ? m[u] : m[0];
    }
    return m[0];
}

// y[i] = sum_c x[c][i]*w[c], one multiply-add per row in row order (the scores of the vector path are the same)
static void ggml_sparse_attn_mad_rows(const int64_t n, const int64_t nr, const float * const * x, const float * w, float * y) {
    int64_t i = 0;
#if defined(GGML_SIMD) && !defined(__ARM_FEATURE_SVE) && !defined(__riscv_v_intrinsic)
    const int64_t epr = GGML_F32_EPR;
    for (; i + epr <= n; i += epr) {
        GGML_F32_VEC y0 = GGML_F32_VEC_ZERO;
        for (int64_t c = 0; c < nr; ++c) {
            y0 = GGML_F32_VEC_FMA(y0, GGML_F32_VEC_LOAD(x[c] + i), GGML_F32_VEC_SET1(w[c]));
        }
        GGML_F32_VEC_STORE(y + i, y0);
    }
#endif
    for (; i < n; ++i) {
        float s = 0.0f;
        for (int64_t c = 0; c < nr; ++c) {
            s += x[c][i]*w[c];
        }
        y[i] = s;
    }
}

// the k-th largest of n non-negative floats x, *res; x needs room for n rounded up to 16 (the rest is zeroed here).
// The bits of non-negative floats order like their values, so it is found bit by bit from the highest bit in which
// the values differ: a bit is set if at least k values are >= the prefix with it set, each step one count over x, a
// loop without branches. false if a value is negative or NaN.
static bool ggml_sparse_attn_kth_largest(float * x, int64_t n, int64_t k, float * res) {
    static_assert(sizeof(float) == sizeof(uint32_t), "float must be 32 bits");

    auto bits = [&](int64_t i) {
        uint32_t u;
        memcpy(&u, x + i, sizeof(u));
        return u;
    };

    uint32_t bor  = 0;
    uint32_t band = ~0u;
    uint32_t bmax = 0;
    for (int64_t i = 0; i < n; ++i) {
        bor  |= bits(i);
        band &= bits(i);
        bmax  = std::max(bmax, bits(i));
    }
    // above the bits of +inf: a NaN or a sign bit
    if (bmax > 0x7f800000u) {
        return false;
    }

    // padded with zeros to whole vectors; a count never tests a threshold of 0
    const int64_t n_pad = GGML_PAD(n, 16);
    for (int64_t i = n; i < n_pad; ++i) {
        x[i] = 0.0f;
    }
    auto count_ge = [&](uint32_t t) {
        int32_t c = 0;
        for (int64_t i = 0; i < n_pad; ++i) {
            c += bits(i) >= t;
        }
        return c;
    };

    // the bits that are the same in every value are those of the result
    uint32_t r = band;
    const uint32_t diff = bor ^ band;
    for (int b = 31; b >= 0; --b) {
        const uint32_t bit = 1u << b;
        if ((diff & bit) && count_ge(r | bit) >= k) {
            r |= bit;
        }
    }
    memcpy(res, &r, sizeof(r));
    return true;
}

//
// visible cells
//

// the first cell in [i, n) that is not masked (masked = true) or not visible (masked = false), n if none;
// masks are mostly long runs of one kind, so four cells at a time, as one 64-bit word
static int64_t ggml_sparse_attn_skip(const ggml_fp16_t * mp, int64_t i, int64_t n, bool masked) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    const uint64_t ones = 0x0001000100010001ull;
    const uint64_t inf4 = ones*(uint16_t) GGML_CPU_FP32_TO_FP16(-INFINITY);
    for (; i + 4 <= n; i += 4) {
        uint64_t w;
        memcpy(&w, mp + i, sizeof(w));
        const uint64_t x  = w ^ inf4; // zero lanes: masked cells
        // the lanes where the run of this kind ends: non-zero lanes, or zero lanes (the lowest flag is exact)
        const uint64_t go = masked ? x : (x - ones) & ~x & 0x8000800080008000ull;
        if (go) {
            return i + ggml_sparse_attn_ctz(go)/16;
        }
    }
#endif
    while (i < n && ggml_sparse_attn_masked(mp[i]) == masked) {
        i++;
    }
    return i;
}

// visible runs [a, b) of chunk c, computed once per row and thread
static const int32_t * ggml_sparse_attn_runs(const ggml_sparse_attn_ctx & ctx, int ith, const ggml_fp16_t * mp, int64_t c, int32_t * n_runs) {
    int32_t * nruns = ctx.local<int32_t>(ith, ctx.l.n_runs);
    int32_t * runs  = ctx.local<int32_t>(ith, ctx.l.runs) + c*(ctx.l.chunk + 2);

    if (nruns[c] < 0) {
        const int64_t c0 = c*ctx.l.chunk;
        const int64_t c1 = std::min(c0 + ctx.l.chunk, ctx.n_kv);

        int32_t n = 0;
        for (int64_t i = c0; i < c1; ) {
            i = ggml_sparse_attn_skip(mp, i, c1, true);
            const int64_t a = i;
            i = ggml_sparse_attn_skip(mp, i, c1, false);
            if (i > a) {
                runs[2*n + 0] = (int32_t) a;
                runs[2*n + 1] = (int32_t) i;
                n++;
            }
        }
        nruns[c] = n;
    }

    *n_runs = nruns[c];
    return runs;
}

// a new row: the visible runs of each chunk are computed again, their number and the first visible cell
static void ggml_sparse_attn_begin_row(ggml_sparse_attn_ctx & ctx, int ith, const ggml_fp16_t * mp) {
    int32_t * nruns = ctx.local<int32_t>(ith, ctx.l.n_runs);

    int64_t n_vis = 0;
    int64_t i_vis = ctx.n_kv;
    for (int64_t c = 0; c < ctx.l.n_chunk; ++c) {
        nruns[c] = -1;
        int32_t n_runs;
        const int32_t * runs = ggml_sparse_attn_runs(ctx, ith, mp, c, &n_runs);
        for (int32_t ir = 0; ir < n_runs; ++ir) {
            n_vis += runs[2*ir + 1] - runs[2*ir + 0];
            i_vis  = std::min<int64_t>(i_vis, runs[2*ir + 0]);
        }
    }
    ctx.n_vis = n_vis;
    ctx.i_vis = i_vis;
}

// the visible cells at positions below n_sink that are not local, at most top_k - n_local of them (the greatest
// (pos, cell) first, as if their scores were all above every other): sink[0] their number, then the cells
static void ggml_sparse_attn_select_sink(const ggml_sparse_attn_ctx & ctx, int ith, const ggml_fp16_t * mp, const int32_t * pp,
        const ggml_sparse_attn_cand * last, int32_t * sink) {
    const ggml_fp16_t masked = GGML_CPU_FP32_TO_FP16(-INFINITY);
    ggml_sparse_attn_cand * buf = ctx.local<ggml_sparse_attn_cand>(ith, ctx.l.candidates);
    const ggml_sparse_attn_cand_greater gt;

    int64_t n = 0;
    for (int64_t i = 0; i < ctx.n_kv; ++i) {
        if (pp[i] < ctx.n_sink && mp[i] != masked) {
            const ggml_sparse_attn_cand x = { 0.0f, pp[i], (int32_t) i };
            if (last == nullptr || gt(*last, x)) {
                buf[n++] = x;
            }
        }
    }
    const int64_t n_keep = std::min<int64_t>(n, ctx.top_k - ctx.n_local);
    if (n_keep > 0 && n_keep < n) {
        std::nth_element(buf, buf + n_keep - 1, buf + n, gt);
    }
    sink[0] = (int32_t) n_keep;
    for (int64_t i = 0; i < n_keep; ++i) {
        sink[1 + i] = buf[i].cell;
    }
}

// the n_local visible cells with the largest positions, then the sink cells, only needed when not all visible cells
// are selected
static void ggml_sparse_attn_select_local(const ggml_sparse_attn_ctx & ctx, int ith, const ggml_fp16_t * mp, const int32_t * pp,
        int32_t * local, ggml_sparse_attn_cand * last, int32_t * sink) {
    const int64_t n_local = ctx.n_local;
    sink[0] = 0;

    // the visible cells and their largest position, in a loop without branches (the compiler vectorises it)
    const ggml_fp16_t masked = GGML_CPU_FP32_TO_FP16(-INFINITY);
    int32_t n_vis = 0;
    int32_t pmax  = INT32_MIN;
    for (int64_t i = 0; i < ctx.n_kv; ++i) {
        const int32_t vis = -(int32_t) (mp[i] != masked); // all bits set: visible
        pmax   = std::max(pmax, (pp[i] & vis) | (INT32_MIN & ~vis));
        n_vis -= vis;
    }

    if (n_vis <= ctx.top_k) {
        return;
    }
    if (n_local == 0) {
        if (ctx.n_sink > 0) {
            ggml_sparse_attn_select_sink(ctx, ith, mp, pp, nullptr, sink);
        }
        return;
    }

    // keep the n_local greatest (pos, cell) with pos in [pmax - w + 1, pmax], widen the window until it holds n_local cells
    ggml_sparse_attn_cand * buf = ctx.local<ggml_sparse_attn_cand>(ith, ctx.l.candidates);
    const ggml_sparse_attn_cand_greater gt;

    int64_t n = 0;
    for (int64_t w = 2*n_local; ; w *= 4) {
        const int32_t pmin = (int32_t) std::max<int64_t>((int64_t) pmax - w + 1, INT32_MIN);

        int64_t n_win = 0;
        n = 0;
        for (int64_t i0 = 0; i0 < ctx.n_kv; i0 += 16) {
            const int64_t i1 = std::min<int64_t>(i0 + 16, ctx.n_kv);
            // few cells are in the window: most blocks of 16 are passed after one test without branches
            if (i1 - i0 == 16) {
                int32_t hit = 0;
                for (int u = 0; u < 16; ++u) {
                    hit |= (pp[i0 + u] >= pmin) & (mp[i0 + u] != masked);
                }
                if (!hit) {
                    continue;
                }
            }
            for (int64_t i = i0; i < i1; ++i) {
                if (pp[i] >= pmin && mp[i] != masked) {
                    buf[n++] = { 0.0f, pp[i], (int32_t) i };
                    n_win++;
                    if (n == 2*n_local) {
                        std::nth_element(buf, buf + n_local - 1, buf + n, gt);
                        n = n_local;
                    }
                }
            }
        }
        if (n_win >= n_local) {
            break;
        }
    }
    std::nth_element(buf, buf + n_local - 1, buf + n, gt);

    *last = buf[n_local - 1];
    for (int64_t i = 0; i < n_local; ++i) {
        local[i] = buf[i].cell;
    }
    if (ctx.n_sink > 0) {
        ggml_sparse_attn_select_sink(ctx, ith, mp, pp, last, sink);
    }
}

//
// phase 1: approximate scores
//

// SparQ step 1: the r largest components of sum_j |q_j| over the group of kv head h (ties: lower index)
// q_ranked[j][c] = q_j[comps[c]] * scale*sqrt(DK)/tau_j, tau_j = sqrt(DK * |q_j[comps]|_1 / |q_j|_1)
static void ggml_sparse_attn_prepare_sparq(const ggml_sparse_attn_ctx & ctx, int ith, int64_t iq1, int64_t iq3, int64_t h) {
    const int64_t DK = ctx.DK;
    const int64_t r  = ctx.r;

    int32_t * comps = ctx.local<int32_t>(ith, ctx.l.comps);
    float   * sums  = ctx.local<float>  (ith, ctx.l.comp_sums);
    float   * qr    = ctx.local<float>  (ith, ctx.l.q_ranked);

    for (int64_t d = 0; d < DK; ++d) {
        sums[d]  = 0.0f;
        comps[d] = d;
    }
    for (int64_t j = 0; j < ctx.g; ++j) {
        const float * qj = ctx.q_row(iq1, h*ctx.g + j, iq3);
        for (int64_t d = 0; d < DK; ++d) {
            sums[d] += fabsf(qj[d]);
        }
    }

    // the r largest sums, of equal ones the lowest components, in order of component: those above the r-th largest
    // sum and the first of those equal to it (nth_element only if a sum is NaN)
    float thr;
    if (r < DK && ggml_sparse_attn_kth_largest(sums, DK, r, &thr)) {
        int64_t n_eq = r;
        for (int64_t d = 0; d < DK; ++d) {
            n_eq -= sums[d] > thr;
        }
        int64_t n = 0;
        for (int64_t d = 0; d < DK; ++d) {
            const bool eq = sums[d] == thr && n_eq > 0;
            n_eq -= eq;
            comps[n] = (int32_t) d;
            n += (sums[d] > thr) | eq;
        }
        GGML_ASSERT(n == r);
    } else if (r < DK) {
        std::nth_element(comps, comps + r - 1, comps + DK, [sums](int32_t a, int32_t b) {
            return sums[a] > sums[b] || (sums[a] == sums[b] && a < b);
        });
        std::sort(comps, comps + r);
    }

    for (int64_t j = 0; j < ctx.g; ++j) {
        const float * qj = ctx.q_row(iq1, h*ctx.g + j, iq3);

        float l1 = 0.0f;
        for (int64_t d = 0; d < DK; ++d) {
            l1 += fabsf(qj[d]);
        }
        float l1s = 0.0f;
        for (int64_t c = 0; c < r; ++c) {
            l1s += fabsf(qj[comps[c]]);
        }

        const float s = l1s > 0.0f ? ctx.scale*sqrtf(l1/l1s) : 0.0f;

        for (int64_t c = 0; c < r; ++c) {
            qr[j*r + c] = qj[comps[c]]*s;
        }
    }
}

// the fused exponentials of a chunk's scores (see ggml_sparse_attn_rank_sparq): exp(score - ref) and their sum,
// with ref the max of the first block of scores
struct ggml_sparse_attn_exp_state {
    float * ref;  // nullptr: the scores are stored as they are
    float * sum;
};

#if defined(GGML_SPARSE_ATTN_SIMD)
// a query head's running max of its scores and, with ref, the sum of their exponentials
struct ggml_sparse_attn_score_acc {
    ggml_sparse_attn_simd::vec vmax;
    ggml_sparse_attn_simd::vec vsum;
    ggml_sparse_attn_simd::vec vref;
    float * ref; // nullptr: the scores are stored as they are
};

// N vectors of finished scores y: into the max, and with ref replaced by exp(y - ref) and summed (in pairs of
// neighbours); ref is the max of the first of them
template <int N>
static inline void ggml_sparse_attn_finish(ggml_sparse_attn_simd::vec * y, ggml_sparse_attn_score_acc & acc) {
    using namespace ggml_sparse_attn_simd;
    vec m = y[0];
    for (int u = 1; u < N; ++u) {
        m = max(m, y[u]);
    }
    acc.vmax = max(acc.vmax, m);
    if (acc.ref) {
        if (*acc.ref == -INFINITY) {
            *acc.ref = reduce_max(m);
            acc.vref = set1(*acc.ref);
        }
        vec s[N];
        for (int u = 0; u < N; ++u) {
            y[u] = exp(sub(y[u], acc.vref));
            s[u] = y[u];
        }
        for (int w = 1; w < N; w *= 2) {
            for (int u = 0; u + w < N; u += 2*w) {
                s[u] = add(s[u], s[u + w]);
            }
        }
        acc.vsum = add(acc.vsum, s[0]);
    }
}

// SparQ, f16 kt: the scores of the cells [i0, i1) of one query head from its r rows (q: the r query components),
// 64 cells per step in independent multiply-add chains, converted and accumulated in registers; the same
// multiply-add order per cell as ggml_sparse_attn_mad_rows, so the scores are the same. Returns the first cell not
// scored (fewer than W are left).
// The r rows are read GGML_SPARSE_ATTN_ROW_GROUP at a time over the run (partial sums go through e, which stays in
// L1), and with prefetch each row's cells one chunk ahead are requested as it is read: with all r rows streaming at
// once the core keeps too few of their lines in flight, this way the next chunk's lines arrive while the current
// chunk's scores and exponentials are computed. Non-temporal, so that the stream does not evict the previous head's
// gathered K/V rows from L2. The last group of rows also takes the max and the exponentials of the finished scores.
static int64_t ggml_sparse_attn_score_run_f16(const ggml_fp16_t * const * rows, int64_t r, const float * q, float * e,
        int64_t i0, int64_t i1, bool prefetch, int64_t pf_dist, float * emax, ggml_sparse_attn_exp_state ex) {
    using namespace ggml_sparse_attn_simd;
    constexpr int U = GGML_SPARSE_ATTN_STEP/W;

    ggml_sparse_attn_score_acc acc = { set1(-INFINITY), zero(), set1(ex.ref ? *ex.ref : 0.0f), ex.ref };

    int64_t i = i0;
    for (int64_t c0 = 0; c0 < r; c0 += GGML_SPARSE_ATTN_ROW_GROUP) {
        const int64_t c1 = std::min(r, c0 + GGML_SPARSE_ATTN_ROW_GROUP);
        for (i = i0; i + GGML_SPARSE_ATTN_STEP <= i1; i += GGML_SPARSE_ATTN_STEP) {
            vec y[U];
            for (int u = 0; u < U; ++u) {
                y[u] = c0 > 0 ? load(e + i + u*W) : zero();
            }
            for (int64_t c = c0; c < c1; ++c) {
                const ggml_fp16_t * x = rows[c] + i;
                if (prefetch) {
                    GGML_SPARSE_ATTN_PREFETCH_NT(x + pf_dist);
                    GGML_SPARSE_ATTN_PREFETCH_NT(x + pf_dist + 32);
                }
                const vec w = set1(q[c]);
                for (int u = 0; u < U; ++u) {
                    y[u] = fma(load(x + u*W), w, y[u]);
                }
            }
            if (c1 == r) {
                ggml_sparse_attn_finish<U>(y, acc);
            }
            for (int u = 0; u < U; ++u) {
                store(e + i + u*W, y[u]);
            }
        }
    }
    for (; i + W <= i1; i += W) {
        vec y = zero();
        for (int64_t c = 0; c < r; ++c) {
            y = fma(load(rows[c] + i), set1(q[c]), y);
        }
        ggml_sparse_attn_finish<1>(&y, acc);
        store(e + i, y);
    }

    *emax = std::max(*emax, reduce_max(acc.vmax));
    if (ex.ref) {
        *ex.sum += reduce_add(acc.vsum);
    }
    return i;
}
#endif

// SparQ, plain path: the cells [i0, i1) of every query head of the group, TILE cells at a time
static void ggml_sparse_attn_score_run_tiles(const ggml_sparse_attn_ctx & ctx, int ith, const char * kt_data, int64_t i0, int64_t i1,
        float * e, float * emax, float * ref, float * zsum) {
    const int64_t r = ctx.r;

    const int32_t * comps = ctx.local<int32_t>(ith, ctx.l.comps);
    const float   * qr    = ctx.local<float>  (ith, ctx.l.q_ranked);
    const float  ** rows  = ctx.local<const float *>(ith, ctx.l.kt_rows);
    float         * tile  = ctx.local<float>  (ith, ctx.l.kt_tile);

    const ggml_tensor * kt = ctx.kt;

    for (; i0 < i1; i0 += GGML_SPARSE_ATTN_TILE) {
        const int64_t n = std::min<int64_t>(GGML_SPARSE_ATTN_TILE, i1 - i0);

        for (int64_t c = 0; c < r; ++c) {
            const char * row = kt_data + comps[c]*kt->nb[1];
            if (kt->type == GGML_TYPE_F16) {
                ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) row + i0, tile + c*GGML_SPARSE_ATTN_TILE, n);
                rows[c] = tile + c*GGML_SPARSE_ATTN_TILE;
            } else {
                rows[c] = (const float *) row + i0;
            }
        }

        for (int64_t j = 0; j < ctx.g; ++j) {
            float * ej = e + j*ctx.n_kv + i0;
            ggml_sparse_attn_mad_rows(n, r, rows, qr + j*r, ej);
            const float mj = ggml_sparse_attn_max(ej, n);
            emax[j] = std::max(emax[j], mj);
            if (ref) {
                if (ref[j] == -INFINITY) {
                    ref[j] = mj;
                }
                for (int64_t i = 0; i < n; ++i) {
                    ej[i] = expf(ej[i] - ref[j]);
                    zsum[j] += ej[i];
                }
            }
        }
    }
}

// SparQ step 2: approximate scores of the visible cells from r rows of kt, and their max per query head (emax[j])
// returns 0: e receives the scores, emax[j] their max per query head
// with zsum ([2*g] floats) and f16 kt on the vector path, returns 1: e receives exp(score - ref_j) instead and
// zsum[j] their sum, with ref_j the max of the first scored block of cells of query head j, so the exponentials are
// computed while the kt rows stream in; emax[j] = ref_j; or -1 (nothing usable written) when a score exceeds ref_j by
// so much that exp could overflow
static constexpr float GGML_SPARSE_ATTN_REF_MARGIN = 64.0f;

static int ggml_sparse_attn_rank_sparq(const ggml_sparse_attn_ctx & ctx, int ith, int64_t iq3, int64_t h, const int32_t * runs, int32_t n_runs,
        float * emax, float * zsum) {
    const int64_t g = ctx.g;

    float * e = ctx.scores_of(h);

    const ggml_tensor * kt = ctx.kt;
    const char * kt_data = (const char *) kt->data + h*kt->nb[2] + iq3*kt->nb[3];

    for (int64_t j = 0; j < g; ++j) {
        emax[j] = -INFINITY;
    }

#if defined(GGML_SPARSE_ATTN_SIMD)
    const bool vector = kt->type == GGML_TYPE_F16;
#else
    const bool vector = false;
#endif
    const bool fuse = zsum != nullptr && vector;
    float    * ref  = fuse ? zsum + g : nullptr;
    if (fuse) {
        for (int64_t j = 0; j < g; ++j) {
            ref[j]  = -INFINITY;
            zsum[j] = 0.0f;
        }
    }

    for (int32_t ir = 0; ir < n_runs; ++ir) {
        int64_t       i0 = runs[2*ir + 0];
        const int64_t i1 = runs[2*ir + 1];

#if defined(GGML_SPARSE_ATTN_SIMD)
        if (vector) {
            const int32_t      * comps = ctx.local<int32_t>(ith, ctx.l.comps);
            const float        * qr    = ctx.local<float>  (ith, ctx.l.q_ranked);
            const ggml_fp16_t ** rows  = ctx.local<const ggml_fp16_t *>(ith, ctx.l.kt_rows);
            for (int64_t c = 0; c < ctx.r; ++c) {
                rows[c] = (const ggml_fp16_t *) (kt_data + comps[c]*kt->nb[1]);
            }
            const int64_t pf_dist = ctx.l.chunk;
            int64_t i = i0;
            for (int64_t j = 0; j < g; ++j) {
                const ggml_sparse_attn_exp_state ex = { fuse ? ref + j : nullptr, fuse ? zsum + j : nullptr };
                i = ggml_sparse_attn_score_run_f16(rows, ctx.r, qr + j*ctx.r, e + j*ctx.n_kv, i0, i1,
                        j == 0 && i1 + pf_dist <= ctx.n_kv, pf_dist, emax + j, ex);
            }
            i0 = i;
        }
#endif
        // the rest of the run (all of it on the plain path)
        if (i0 < i1) {
            ggml_sparse_attn_score_run_tiles(ctx, ith, kt_data, i0, i1, e, emax, ref, zsum);
        }
    }

    if (fuse) {
        for (int64_t j = 0; j < g; ++j) {
            if (emax[j] > ref[j] + GGML_SPARSE_ATTN_REF_MARGIN) {
                return -1;
            }
        }
        for (int64_t j = 0; j < g; ++j) {
            emax[j] = ref[j];
        }
        return 1;
    }
    return 0;
}

// Loki: q is already in the principal basis, the ranking uses its first d components
// q_ranked[hq][c] = q_hq[c] * scale, for every query head
static void ggml_sparse_attn_prepare_loki(const ggml_sparse_attn_ctx & ctx, int ith, int64_t iq1, int64_t iq3) {
    const int64_t d = ctx.r;

    float * qr = ctx.local<float>(ith, ctx.l.q_ranked);

    for (int64_t hq = 0; hq < ctx.n_head; ++hq) {
        const float * q = ctx.q_row(iq1, hq, iq3);
        for (int64_t c = 0; c < d; ++c) {
            qr[hq*d + c] = q[c]*ctx.scale;
        }
    }
}

#if defined(GGML_SPARSE_ATTN_SIMD)
// Loki, f16 or q8_0 K rows (R), d = W*NB: the scores of up to W query heads for one cell, lane t = query head t of
// the group; k_row + koff[t] is the row part of query head t's kv head, q their scaled queries (d floats each). The
// W dot products are reduced together: one horizontal sum each would dominate the loop.
template <int NB, typename R>
static inline ggml_sparse_attn_simd::vec ggml_sparse_attn_loki_heads(const char * k_row, const size_t * koff, const float * q, int n) {
    using namespace ggml_sparse_attn_simd;

    auto dot = [&](int t) {
        const char  * x  = k_row + koff[t];
        const float * qt = q + t*W*NB;
        vec acc = mul(R::at(x, 0), load(qt));
        for (int b = 1; b < NB; ++b) {
            acc = fma(R::at(x, W*b), load(qt + W*b), acc);
        }
        return acc;
    };

    vec y[W];
    if (n == W) {
        for (int t = 0; t < W; ++t) {
            y[t] = dot(t);
        }
    } else {
        for (int t = 0; t < W; ++t) {
            y[t] = t < n ? dot(t) : zero();
        }
    }
    return sum_each(y);
}

// Loki, the visible cells [i, i1): e0 + hq*n_kv receives the scores of query head hq, vmax[G] their max per lane.
// The scores of W cells are kept (tile row c: cell c, lane t: head t) and stored head by head, a cache line each.
// Stored cell by cell (a scatter), every score went to another line, n_kv floats apart: when n_kv is a multiple
// of 1024 the lines being filled share an L1 set (at multiples of 8k an L2 set too), evicted each other, and
// held up the loop more than the K reads.
template <int NB, typename R>
static void ggml_sparse_attn_loki_cells(const char * k_data, size_t nb1, size_t nb2, int64_t i, int64_t i1, const size_t * koff, const float * qr,
        int64_t n_head, int64_t n_head_kv, int64_t n_kv, float * e0, ggml_sparse_attn_simd::vec * vmax) {
    using namespace ggml_sparse_attn_simd;

    // the hardware prefetcher does not follow d elements every DK: request the rows a few cells ahead
    static constexpr int64_t ahead = 3;
    static constexpr size_t  d_bytes = R::bytes(NB*W);

    alignas(64) float tile[128/W][W][W];

    for (int64_t ib = i; ib < i1; ib += W) {
        const int m = (int) std::min<int64_t>(W, i1 - ib);
        for (int c = 0; c < m; ++c) {
            const int64_t ic = ib + c;
            const char * k_row = k_data + ic*nb1;
            if (ic + ahead < i1) {
                for (int64_t h = 0; h < n_head_kv; ++h) {
                    ggml_sparse_attn_prefetch_bytes(k_row + ahead*nb1 + h*nb2, d_bytes);
                }
            }
            for (int64_t hq0 = 0, G = 0; hq0 < n_head; hq0 += W, ++G) {
                const int n  = (int) std::min<int64_t>(W, n_head - hq0);
                const vec sv = ggml_sparse_attn_loki_heads<NB, R>(k_row, koff + hq0, qr + hq0*W*NB, n);
                store(tile[G][c], sv);
                vmax[G] = max(vmax[G], sv);
            }
        }
        for (int64_t hq0 = 0, G = 0; hq0 < n_head; hq0 += W, ++G) {
            vec rt[W];
            for (int c = 0; c < W; ++c) {
                rt[c] = c < m ? load(tile[G][c]) : zero();
            }
            transpose(rt);
            const int n = (int) std::min<int64_t>(W, n_head - hq0);
            for (int t = 0; t < n; ++t) {
                if (m == W) {
                    store(e0 + (hq0 + t)*n_kv + ib, rt[t]);
                } else {
                    store_first(e0 + (hq0 + t)*n_kv + ib, rt[t], m);
                }
            }
        }
    }
}

template <typename R>
static void ggml_sparse_attn_loki_run(int64_t d, const char * k_data, size_t nb1, size_t nb2, int64_t i, int64_t i1, const size_t * koff,
        const float * qr, int64_t n_head, int64_t n_head_kv, int64_t n_kv, float * e0, ggml_sparse_attn_simd::vec * vmax) {
    switch (d/ggml_sparse_attn_simd::W) {
        case 1: ggml_sparse_attn_loki_cells<1, R>(k_data, nb1, nb2, i, i1, koff, qr, n_head, n_head_kv, n_kv, e0, vmax); break;
        case 2: ggml_sparse_attn_loki_cells<2, R>(k_data, nb1, nb2, i, i1, koff, qr, n_head, n_head_kv, n_kv, e0, vmax); break;
        case 3: ggml_sparse_attn_loki_cells<3, R>(k_data, nb1, nb2, i, i1, koff, qr, n_head, n_head_kv, n_kv, e0, vmax); break;
        case 4: ggml_sparse_attn_loki_cells<4, R>(k_data, nb1, nb2, i, i1, koff, qr, n_head, n_head_kv, n_kv, e0, vmax); break;
        case 5: ggml_sparse_attn_loki_cells<5, R>(k_data, nb1, nb2, i, i1, koff, qr, n_head, n_head_kv, n_kv, e0, vmax); break;
        case 6: ggml_sparse_attn_loki_cells<6, R>(k_data, nb1, nb2, i, i1, koff, qr, n_head, n_head_kv, n_kv, e0, vmax); break;
        case 7: ggml_sparse_attn_loki_cells<7, R>(k_data, nb1, nb2, i, i1, koff, qr, n_head, n_head_kv, n_kv, e0, vmax); break;
        case 8: ggml_sparse_attn_loki_cells<8, R>(k_data, nb1, nb2, i, i1, koff, qr, n_head, n_head_kv, n_kv, e0, vmax); break;
        default: GGML_ABORT("fatal error");
    }
}
#endif

// Loki: approximate scores of the visible cells of some runs from the first d components of each K row, for
// every kv head, and their max per query head (emax[hq]). A cell's row holds the keys of all kv heads, so the
// cells are the outer loop: each row is visited once (the kv heads' prefixes are d elements every DK)
static void ggml_sparse_attn_rank_loki(const ggml_sparse_attn_ctx & ctx, int ith, int64_t iq3, const int32_t * runs, int32_t n_runs, float * emax) {
    const int64_t d = ctx.r;
    const int64_t g = ctx.g;

    const float * qr  = ctx.local<float>(ith, ctx.l.q_ranked);
    float       * row = ctx.local<float>(ith, ctx.l.row);

    const ggml_tensor * k = ctx.k;
    const char * k_data = (const char *) k->data + iq3*k->nb[3];

    for (int64_t hq = 0; hq < ctx.n_head; ++hq) {
        emax[hq] = -INFINITY;
    }

#if defined(GGML_SPARSE_ATTN_SIMD)
    using namespace ggml_sparse_attn_simd;

    // f16 or q8_0 rows, d a multiple of W: per cell, the scores of W query heads at a time
    const int64_t n_grp  = (ctx.n_head + W - 1)/W;
    const bool    vector = (k->type == GGML_TYPE_F16 || k->type == GGML_TYPE_Q8_0) && d % W == 0 && d <= 8*W && n_grp*W <= 128 && ctx.n_head*ctx.n_kv <= INT32_MAX;
    if (vector) {
        // byte offset of the K row part of each query head's kv head (no division in the cell loop)
        size_t koff[128];
        for (int64_t hq = 0; hq < ctx.n_head; ++hq) {
            koff[hq] = (hq/g)*k->nb[2];
        }
        vec vmax[128/W];
        for (int64_t G = 0; G < n_grp; ++G) {
            vmax[G] = set1(-INFINITY);
        }

        float * e0 = ctx.scores_of(0);
        for (int32_t ir = 0; ir < n_runs; ++ir) {
            const int64_t i  = runs[2*ir + 0];
            const int64_t i1 = runs[2*ir + 1];
            if (k->type == GGML_TYPE_F16) {
                ggml_sparse_attn_loki_run<ggml_sparse_attn_f16_rows>(d, k_data, k->nb[1], k->nb[2], i, i1, koff, qr, ctx.n_head, ctx.n_head_kv, ctx.n_kv, e0, vmax);
            } else {
                ggml_sparse_attn_loki_run<ggml_sparse_attn_q8_0_rows>(d, k_data, k->nb[1], k->nb[2], i, i1, koff, qr, ctx.n_head, ctx.n_head_kv, ctx.n_kv, e0, vmax);
            }
        }
        for (int64_t G = 0; G < n_grp; ++G) {
            float m[W];
            store(m, vmax[G]);
            for (int64_t t = 0; t < W && W*G + t < ctx.n_head; ++t) {
                emax[W*G + t] = m[t];
            }
        }
        return;
    }
#endif

    // quantized rows are converted in whole blocks
    const int64_t blck = ggml_blck_size(k->type);
    const int64_t n_cv = std::min(ctx.DK, (d + blck - 1)/blck*blck);

    for (int32_t ir = 0; ir < n_runs; ++ir) {
        for (int64_t i = runs[2*ir + 0]; i < runs[2*ir + 1]; ++i) {
            for (int64_t h = 0; h < ctx.n_head_kv; ++h) {
                const float * kf = ggml_sparse_attn_row_f32(k, ctx.k_to_float, k_data + i*k->nb[1] + h*k->nb[2], row, n_cv);
                float       * e  = ctx.scores_of(h);
                for (int64_t j = 0; j < g; ++j) {
                    float s;
                    ggml_vec_dot_f32(d, &s, 0, kf, 0, qr + (h*g + j)*d, 0, 1);
                    e[j*ctx.n_kv + i] = s;
                    emax[h*g + j] = std::max(emax[h*g + j], s);
                }
            }
        }
    }
}

// exp(score - chunk max) in place, and the chunk max and sum of each query head of kv head h
// (with zsum: e holds exp(score - emax) already, zsum their sums)
static void ggml_sparse_attn_chunk_stats(const ggml_sparse_attn_ctx & ctx, int64_t h, int64_t c, const int32_t * runs, int32_t n_runs,
        const float * emax, const float * zsum = nullptr) {
    float * e     = ctx.scores_of(h);
    float * stats = ctx.stats_of(h);

    int64_t nvis = 0;
    for (int32_t ir = 0; ir < n_runs; ++ir) {
        nvis += runs[2*ir + 1] - runs[2*ir + 0];
    }

    for (int64_t j = 0; j < ctx.g; ++j) {
        float * ej = e + j*ctx.n_kv;

        const float M = emax[j];

        ggml_float Z = 0.0;
        if (zsum) {
            Z = zsum[j];
        } else {
            for (int32_t ir = 0; ir < n_runs; ++ir) {
                Z += ggml_vec_soft_max_f32(runs[2*ir + 1] - runs[2*ir + 0], ej + runs[2*ir + 0], ej + runs[2*ir + 0], M);
            }
        }

        stats[2*(j*ctx.l.n_chunk + c) + 0] = M;
        stats[2*(j*ctx.l.n_chunk + c) + 1] = (float) Z;
    }

    if (h == 0 && ctx.ith_head < 0) {
        ctx.shared<int32_t>(ctx.l.chunk_n_vis)[c] = nvis;
    }
}

// the sum of V over the visible cells of chunk c, for the mean value
static void ggml_sparse_attn_chunk_v_sum(const ggml_sparse_attn_ctx & ctx, int ith, int64_t iq3, int64_t h, int64_t c, const int32_t * runs, int32_t n_runs) {
    float * vsum = ctx.v_sums_of(h) + c*ctx.DV;
    float * row  = ctx.local<float>(ith, ctx.l.row);

    memset(vsum, 0, ctx.DV*sizeof(float));
    for (int32_t ir = 0; ir < n_runs; ++ir) {
        for (int64_t i = runs[2*ir + 0]; i < runs[2*ir + 1]; ++i) {
            ggml_vec_acc_f32(ctx.DV, vsum, ggml_sparse_attn_row_f32(ctx.v, ctx.v_to_float, ctx.v_row(i, h, iq3), row, ctx.DV));
        }
    }
}

// Loki phase 1 for chunk c: the approximate scores of every kv head (one pass over the chunk's K rows), chunk stats
static void ggml_sparse_attn_phase1_loki(const ggml_sparse_attn_ctx & ctx, int ith, int64_t iq3, int64_t c, const ggml_fp16_t * mp) {
    int32_t n_runs;
    const int32_t * runs = ggml_sparse_attn_runs(ctx, ith, mp, c, &n_runs);

    float * emax = ctx.local<float>(ith, ctx.l.score_max);
    ggml_sparse_attn_rank_loki(ctx, ith, iq3, runs, n_runs, emax);

    for (int64_t h = 0; h < ctx.n_head_kv; ++h) {
        ggml_sparse_attn_chunk_stats(ctx, h, c, runs, n_runs, emax + h*ctx.g);
    }
}

// SparQ phase 1 for (kv head h, chunk c)
static void ggml_sparse_attn_phase1_sparq(const ggml_sparse_attn_ctx & ctx, int ith, int64_t iq3, int64_t h, int64_t c, const ggml_fp16_t * mp) {
    int32_t n_runs;
    const int32_t * runs = ggml_sparse_attn_runs(ctx, ith, mp, c, &n_runs);

    float * emax = ctx.local<float>(ith, ctx.l.score_max);
    float * zsum = ctx.local<float>(ith, ctx.l.exp_sums);
    int fused = ggml_sparse_attn_rank_sparq(ctx, ith, iq3, h, runs, n_runs, emax, zsum);
    if (fused < 0) {
        // a score too far above the reference: the scores again, then their exponentials
        fused = ggml_sparse_attn_rank_sparq(ctx, ith, iq3, h, runs, n_runs, emax, nullptr);
    }
    ggml_sparse_attn_chunk_stats(ctx, h, c, runs, n_runs, emax, fused ? zsum : nullptr);

    if (ctx.mean_value && !ctx.vmean) {
        ggml_sparse_attn_chunk_v_sum(ctx, ith, iq3, h, c, runs, n_runs);
    }
}

//
// phase 2: selection and exact attention
//

static int64_t ggml_sparse_attn_n_visible(const ggml_sparse_attn_ctx & ctx) {
    const int32_t * nvis = ctx.shared<int32_t>(ctx.l.chunk_n_vis);

    int64_t n = 0;
    for (int64_t c = 0; c < ctx.l.n_chunk; ++c) {
        n += nvis[c];
    }
    return n;
}

// fact[j][c] = exp(M_jc - M_j)/Z_j turns exp(score - chunk max) into the softmax over the visible cells
static void ggml_sparse_attn_factors(const ggml_sparse_attn_ctx & ctx, int64_t h, float * fact) {
    const float * stats = ctx.stats_of(h);
    const int64_t n_chunk = ctx.l.n_chunk;

    for (int64_t j = 0; j < ctx.g; ++j) {
        const float * sj = stats + 2*j*n_chunk;

        float M = -INFINITY;
        for (int64_t c = 0; c < n_chunk; ++c) {
            if (sj[2*c + 1] > 0.0f) {
                M = std::max(M, sj[2*c + 0]);
            }
        }
        float Z = 0.0f;
        for (int64_t c = 0; c < n_chunk; ++c) {
            if (sj[2*c + 1] > 0.0f) {
                Z += sj[2*c + 1]*expf(sj[2*c + 0] - M);
            }
        }
        for (int64_t c = 0; c < n_chunk; ++c) {
            fact[j*n_chunk + c] = sj[2*c + 1] > 0.0f ? expf(sj[2*c + 0] - M)/Z : 0.0f;
        }
    }
}

// the group score s[i] = sum_j softmax_j[i] of the cells [a, b) of chunk c: sc[i - a] (e: the scores of kv head h)
static void ggml_sparse_attn_group_scores(const ggml_sparse_attn_ctx & ctx, const float * e, const float * fact, int64_t c, int64_t a, int64_t b, float * sc) {
    const float f0 = fact[c];
    for (int64_t i = a; i < b; ++i) {
        sc[i - a] = e[i]*f0;
    }
    for (int64_t j = 1; j < ctx.g; ++j) {
        const float   fj = fact[j*ctx.l.n_chunk + c];
        const float * ej = e + j*ctx.n_kv;
        for (int64_t i = a; i < b; ++i) {
            sc[i - a] += ej[i]*fj;
        }
    }
}

// a sample of the group scores, about every stride-th visible cell, in smp; returns their number
static int64_t ggml_sparse_attn_sample(const ggml_sparse_attn_ctx & ctx, int ith, const ggml_fp16_t * mp, const float * e, const float * fact,
        int64_t stride, float * smp) {
    const int64_t n_kv    = ctx.n_kv;
    const int64_t n_chunk = ctx.l.n_chunk;

    int64_t n_smp = 0;
    int64_t u = 0;
    for (int64_t c = 0; c < n_chunk; ++c) {
        int32_t n_runs;
        const int32_t * runs = ggml_sparse_attn_runs(ctx, ith, mp, c, &n_runs);
        for (int32_t ir = 0; ir < n_runs; ++ir) {
            const int64_t a = runs[2*ir + 0];
            const int64_t b = runs[2*ir + 1];
            // visible cells number u, u + 1, ...: sample those with a number divisible by stride
            for (int64_t i = a + (stride - u % stride) % stride; i < b; i += stride) {
                float si = 0.0f;
                for (int64_t j = 0; j < ctx.g; ++j) {
                    si += e[j*n_kv + i]*fact[j*n_chunk + c];
                }
                smp[n_smp++] = si;
            }
            u += b - a;
        }
    }
    return n_smp;
}

// the cells [a, b) of chunk c with a group score >= thr appended to cand (sc: room for the run's scores)
static int64_t ggml_sparse_attn_collect_run(const ggml_sparse_attn_ctx & ctx, const int32_t * pp, const float * e, const float * fact,
        int64_t c, int64_t a, int64_t b, float thr, float * sc, ggml_sparse_attn_cand * cand, int64_t n_cand) {
    const int64_t g       = ctx.g;
    const int64_t n_kv    = ctx.n_kv;
    const int64_t n_chunk = ctx.l.n_chunk;

    ggml_sparse_attn_lookahead * la = ctx.la;

    int64_t i0 = a;
#if defined(GGML_SPARSE_ATTN_SIMD)
    // the scores of W cells in registers (the operations of ggml_sparse_attn_group_scores); most blocks have no
    // candidate, the blocks with one are noted and their scores read back after the loop (a scalar load right after
    // the vector store would wait for the store)
    {
        using namespace ggml_sparse_attn_simd;

        const vec vthr = set1(thr);
        const vec vf0  = set1(fact[c]);

        int32_t  hit_i[GGML_SPARSE_ATTN_CHUNK/W];
        uint32_t hit_m[GGML_SPARSE_ATTN_CHUNK/W];
        int      n_hit = 0;
        for (; i0 + W <= b; i0 += W) {
            if (la && (i0 & 31) == 0) {
                la->next();
            }
            vec vs = mul(load(e + i0), vf0);
            for (int64_t j = 1; j < g; ++j) {
                vs = add(vs, mul(load(e + j*n_kv + i0), set1(fact[j*n_chunk + c])));
            }
            const uint32_t mk = mask_ge(vs, vthr);
            store(sc + (i0 - a), vs);
            hit_i[n_hit] = (int32_t) i0;
            hit_m[n_hit] = mk;
            n_hit += mk != 0;
        }
        for (int u = 0; u < n_hit; ++u) {
            for (uint32_t mk = hit_m[u]; mk; mk &= mk - 1) {
                const int64_t i = hit_i[u] + ggml_sparse_attn_ctz(mk);
                cand[n_cand++] = { sc[i - a], pp[i], (int32_t) i };
            }
        }
    }
#endif
    // the rest (all of the run on the plain path), without a branch: whether a cell passes is hard to predict
    ggml_sparse_attn_group_scores(ctx, e, fact, c, i0, b, sc + (i0 - a));
    for (int64_t i = i0; i < b; ++i) {
        cand[n_cand] = { sc[i - a], pp[i], (int32_t) i };
        n_cand += sc[i - a] >= thr;
    }
    return n_cand;
}

// the n_top greatest candidates (ggml_sparse_attn_cand_greater) appended to sel: the n_top-th largest score
// (ggml_sparse_attn_kth_largest on a copy of the scores in keys), then the candidates above it and, of those equal to
// it, the greatest by position and cell; cand is reordered. Much cheaper than nth_element over the candidates, which
// mispredicts most of its comparisons. false (nothing done) if a score is negative or NaN.
static bool ggml_sparse_attn_top_by_bits(ggml_sparse_attn_cand * cand, int64_t n, int64_t n_top, float * keys, int32_t * sel, int64_t * n_sel) {
    for (int64_t i = 0; i < n; ++i) {
        keys[i] = cand[i].s;
    }
    float thr;
    if (!ggml_sparse_attn_kth_largest(keys, n, n_top, &thr)) {
        return false;
    }

    // the scores above the threshold are selected; of the equal ones (moved to the front of cand) the greatest.
    // No branches: which keys pass is hard to predict.
    int32_t * out     = sel + *n_sel;
    int64_t   n_above = 0;
    int64_t   n_eq    = 0;
    for (int64_t i = 0; i < n; ++i) {
        const ggml_sparse_attn_cand c = cand[i];
        out[n_above] = c.cell;
        n_above += keys[i] > thr;
        cand[n_eq] = c;
        n_eq += keys[i] == thr;
    }
    *n_sel += n_above;
    const int64_t k = n_top - n_above;
    GGML_ASSERT(k >= 1 && n_eq >= k);
    if (k < n_eq) {
        std::nth_element(cand, cand + k - 1, cand + n_eq, ggml_sparse_attn_cand_greater());
    }
    for (int64_t i = 0; i < k; ++i) {
        sel[(*n_sel)++] = cand[i].cell;
    }
    return true;
}

// SparQ step 3: the n_local most recent cells, then the top (top_k - n_local) of the other cells by
// s = sum_j softmax_j over the group, ties to the more recent position
static void ggml_sparse_attn_select_top(const ggml_sparse_attn_ctx & ctx, int ith, int64_t h, const ggml_fp16_t * mp, const int32_t * pp,
        int32_t * sel, int64_t * n_sel) {
    float * fact = ctx.local<float>(ith, ctx.l.chunk_factors);
    ggml_sparse_attn_factors(ctx, h, fact);

    const float * e    = ctx.scores_of(h);
    float       * sc   = ctx.local<float>(ith, ctx.l.run_scores);
    float       * smp  = ctx.local<float>(ith, ctx.l.samples);
    ggml_sparse_attn_cand * cand = ctx.local<ggml_sparse_attn_cand>(ith, ctx.l.candidates);

    // threshold: a sampled score, chosen so that about 1.5*top_k cells are above it
    const int64_t stride = std::max<int64_t>(1, std::min(GGML_SPARSE_ATTN_STRIDE, ctx.n_vis/(4*ctx.top_k)));
    const int64_t n_smp  = ggml_sparse_attn_sample(ctx, ith, mp, e, fact, stride, smp);

    // if the sample was unlucky: a lower threshold, then every visible cell
    int64_t n_cand = 0;
    for (int pass = 0; pass < 3; ++pass) {
        float thr = -INFINITY;
        const int64_t n_thr = std::min(n_smp, (3*ctx.top_k/(2*stride) + 4) << (2*pass));
        if (pass < 2 && n_thr < n_smp) {
            // the n_thr-th largest sample
            if (!ggml_sparse_attn_kth_largest(smp, n_smp, n_thr, &thr)) {
                std::nth_element(smp, smp + n_thr - 1, smp + n_smp, [](float x, float y) { return x > y; });
                thr = smp[n_thr - 1];
            }
        }

        n_cand = 0;
        for (int64_t c = 0; c < ctx.l.n_chunk; ++c) {
            int32_t n_runs;
            const int32_t * runs = ggml_sparse_attn_runs(ctx, ith, mp, c, &n_runs);
            for (int32_t ir = 0; ir < n_runs; ++ir) {
                n_cand = ggml_sparse_attn_collect_run(ctx, pp, e, fact, c, runs[2*ir + 0], runs[2*ir + 1], thr, sc, cand, n_cand);
            }
        }
        if (n_cand >= ctx.top_k) {
            break;
        }
    }

    const ggml_sparse_attn_cand_greater gt;

    int64_t n_rest = n_cand;
    if (ctx.n_local > 0) {
        const ggml_sparse_attn_cand last = *ctx.local_last;

        for (int64_t i = 0; i < ctx.n_local; ++i) {
            sel[(*n_sel)++] = ctx.local_cells[i];
        }

        // drop the candidates that are already selected as local
        n_rest = 0;
        for (int64_t i = 0; i < n_cand; ++i) {
            if (gt(last, { 0.0f, cand[i].pos, cand[i].cell })) {
                cand[n_rest++] = cand[i];
            }
        }
    }

    // the sink cells rank above every candidate: selected, and dropped from the candidates
    const int64_t n_sink = ctx.n_sink > 0 ? ctx.sink_cells[0] : 0;
    if (ctx.n_sink > 0) {
        for (int64_t i = 0; i < n_sink; ++i) {
            sel[(*n_sel)++] = ctx.sink_cells[1 + i];
        }
        const int64_t n = n_rest;
        n_rest = 0;
        for (int64_t i = 0; i < n; ++i) {
            if (cand[i].pos >= ctx.n_sink) {
                cand[n_rest++] = cand[i];
            }
        }
    }

    // fewer candidates than asked for only when scores are not finite (NaN is never above a threshold):
    // attend to those there are, the result is as undefined as the scores, but the process goes on
    const int64_t n_top = std::min<int64_t>(ctx.top_k - ctx.n_local - n_sink, n_rest);
    // the sampled scores are no longer needed: their buffer holds the keys
    if (n_top > 0 && ggml_sparse_attn_top_by_bits(cand, n_rest, n_top, smp, sel, n_sel)) {
        return;
    }
    if (n_top > 0) {
        std::nth_element(cand, cand + n_top - 1, cand + n_rest, gt);
    }
    for (int64_t i = 0; i < n_top; ++i) {
        sel[(*n_sel)++] = cand[i].cell;
    }
}

// phase 2a: the selection of kv head h (sorted by cell) and alpha_j; false when nothing is visible (dst is zeroed)
static bool ggml_sparse_attn_select(const ggml_sparse_attn_ctx & ctx, int ith, int64_t iq1, int64_t iq3, int64_t h, const ggml_fp16_t * mp, const int32_t * pp,
        int32_t * sel, int64_t * n_sel_out, float * alpha) {
    const int64_t g  = ctx.g;
    const int64_t DV = ctx.DV;

    if (ctx.n_vis == 0) {
        for (int64_t j = 0; j < g; ++j) {
            memset(ctx.dst_row(iq1, h*g + j, iq3), 0, DV*sizeof(float));
        }
        return false;
    }

    const bool all = ctx.n_vis <= ctx.top_k;

    int64_t n_sel = 0;

    if (all) {
        for (int64_t c = 0; c < ctx.l.n_chunk; ++c) {
            int32_t n_runs;
            const int32_t * runs = ggml_sparse_attn_runs(ctx, ith, mp, c, &n_runs);
            for (int32_t ir = 0; ir < n_runs; ++ir) {
                for (int32_t i = runs[2*ir + 0]; i < runs[2*ir + 1]; ++i) {
                    sel[n_sel++] = i;
                }
            }
        }
    } else {
        ggml_sparse_attn_select_top(ctx, ith, h, mp, pp, sel, &n_sel);
    }

    std::sort(sel, sel + n_sel);

    // alpha_j: approximate score mass of the selection
    if (all || !ctx.mean_value) {
        for (int64_t j = 0; j < g; ++j) {
            alpha[j] = 1.0f;
        }
    } else {
        float * fact = ctx.local<float>(ith, ctx.l.chunk_factors);
        ggml_sparse_attn_factors(ctx, h, fact);

        const float * e = ctx.scores_of(h);
        for (int64_t j = 0; j < g; ++j) {
            float a = 0.0f;
            for (int64_t i = 0; i < n_sel; ++i) {
                a += e[j*ctx.n_kv + sel[i]]*fact[j*ctx.l.n_chunk + sel[i]/ctx.l.chunk];
            }
            alpha[j] = a;
        }
    }

    // the mean of V over the visible cells, from the chunk sums of phase 1
    if (ctx.mean_value && !all && !ctx.vmean) {
        float       * vm   = ctx.local<float>(ith, ctx.l.v_mean);
        const float * vsum = ctx.v_sums_of(h);
        memset(vm, 0, DV*sizeof(float));
        for (int64_t c = 0; c < ctx.l.n_chunk; ++c) {
            ggml_vec_acc_f32(DV, vm, vsum + c*DV);
        }
        ggml_vec_scale_f32(DV, vm, 1.0f/ctx.n_vis);
    }

    *n_sel_out = n_sel;
    return true;
}

// the exact attention's f16 and q8_0 K and V rows (R), converted in registers instead of through a buffer: x . y and
// y += sum_i w[i]*x_i for n a multiple of GGML_SPARSE_ATTN_ROW_BLOCK, with the operations of ggml_vec_dot_f32 and
// ggml_vec_mad_f32 (4 accumulators, the same reduction; one multiply-add per element and row, rows in order), so
// the results are the same. The sum over the rows keeps a block of y in registers for all rows: row by row, y
// went through memory, a store and a load of it per row, and each row's multiply-adds waited for the last row's.
#if defined(GGML_SPARSE_ATTN_SIMD)
#define GGML_SPARSE_ATTN_ROW_BLOCK (4*ggml_sparse_attn_simd::W)

template <typename R>
static inline float ggml_sparse_attn_dot_rows(int64_t n, const float * x, const char * y) {
    using namespace ggml_sparse_attn_simd;
    vec s[4] = { zero(), zero(), zero(), zero() };
    for (int64_t i = 0; i < n; i += 4*W) {
        for (int j = 0; j < 4; ++j) {
            s[j] = fma(load(x + i + W*j), R::at(y, i + W*j), s[j]);
        }
    }
    s[0] = add(s[0], s[2]);
    s[1] = add(s[1], s[3]);
    s[0] = add(s[0], s[1]);
    return reduce_add(s[0]);
}

// rows x + sel[i]*nb1, elements [i0, i0 + W*NV) of them
template <int NV, typename R>
static inline void ggml_sparse_attn_mad_rows_block(int64_t i0, float * y, const char * x, size_t nb1, const int32_t * sel, int64_t n_rows, const float * w) {
    using namespace ggml_sparse_attn_simd;
    vec acc[NV];
    for (int u = 0; u < NV; ++u) {
        acc[u] = load(y + i0 + W*u);
    }
    for (int64_t i = 0; i < n_rows; ++i) {
        const char * xi = x + sel[i]*nb1;
        const vec vw = set1(w[i]);
        for (int u = 0; u < NV; ++u) {
            acc[u] = fma(R::at(xi, i0 + W*u), vw, acc[u]);
        }
    }
    for (int u = 0; u < NV; ++u) {
        store(y + i0 + W*u, acc[u]);
    }
}

template <typename R>
static void ggml_sparse_attn_mad_rows(int64_t n, float * y, const char * x, size_t nb1, const int32_t * sel, int64_t n_rows, const float * w) {
    using namespace ggml_sparse_attn_simd;
    int64_t i0 = 0;
    for (; i0 + 8*W <= n; i0 += 8*W) {
        ggml_sparse_attn_mad_rows_block<8, R>(i0, y, x, nb1, sel, n_rows, w);
    }
    if (i0 < n) {
        ggml_sparse_attn_mad_rows_block<4, R>(i0, y, x, nb1, sel, n_rows, w);
    }
}
#endif

// request the K and V rows of a selection: they are scattered, the gather is bound by memory latency, so
// all requests go out at once, and the rows are used only after the next kv head has been scored
static void ggml_sparse_attn_prefetch_rows(const ggml_sparse_attn_ctx & ctx, int64_t iq3, int64_t h, const int32_t * sel, int64_t n_sel) {
    const size_t k_bytes = ggml_row_size(ctx.k->type, ctx.DK);
    const size_t v_bytes = ggml_row_size(ctx.v->type, ctx.DV);
    for (int64_t i = 0; i < n_sel; ++i) {
        ggml_sparse_attn_prefetch_bytes(ctx.k_row(sel[i], h, iq3), k_bytes);
    }
    for (int64_t i = 0; i < n_sel; ++i) {
        ggml_sparse_attn_prefetch_bytes(ctx.v_row(sel[i], h, iq3), v_bytes);
    }
}

// phase 2b: exact attention over the selection of kv head h, mean value
static void ggml_sparse_attn_attend(const ggml_sparse_attn_ctx & ctx, int ith, int64_t iq1, int64_t iq3, int64_t h, const int32_t * sel, int64_t n_sel, const float * alpha) {
    const int64_t g  = ctx.g;
    const int64_t DK = ctx.DK;
    const int64_t DV = ctx.DV;

    const bool all = ctx.n_vis <= ctx.top_k;

    // the selected rows are scattered: request K rows a few rows ahead, V rows one loop ahead
    const size_t k_bytes = ggml_row_size(ctx.k->type, DK);
    const size_t v_bytes = ggml_row_size(ctx.v->type, DV);
    for (int64_t i = 0; i < std::min<int64_t>(n_sel, 8); ++i) {
        ggml_sparse_attn_prefetch_bytes(ctx.k_row(sel[i], h, iq3), k_bytes);
    }

    float * kq  = ctx.local<float>(ith, ctx.l.weights);
    float * row = ctx.local<float>(ith, ctx.l.row);
    float * y   = ctx.local<float>(ith, ctx.l.out);

#if defined(GGML_SPARSE_ATTN_ROW_BLOCK)
    const bool k_vec = (ctx.k->type == GGML_TYPE_F16 || ctx.k->type == GGML_TYPE_Q8_0) && DK % GGML_SPARSE_ATTN_ROW_BLOCK == 0;
    const bool v_vec = (ctx.v->type == GGML_TYPE_F16 || ctx.v->type == GGML_TYPE_Q8_0) && DV % GGML_SPARSE_ATTN_ROW_BLOCK == 0;
#else
    const bool k_vec = false;
    const bool v_vec = false;
#endif

    for (int64_t i = 0; i < n_sel; ++i) {
        if (i + 8 < n_sel) {
            ggml_sparse_attn_prefetch_bytes(ctx.k_row(sel[i + 8], h, iq3), k_bytes);
        }
        ggml_sparse_attn_prefetch_bytes(ctx.v_row(sel[i], h, iq3), v_bytes);
#if defined(GGML_SPARSE_ATTN_ROW_BLOCK)
        if (k_vec) {
            const char * k_row = ctx.k_row(sel[i], h, iq3);
            for (int64_t j = 0; j < g; ++j) {
                const float * q = ctx.q_row(iq1, h*g + j, iq3);
                const float   s = ctx.k->type == GGML_TYPE_F16 ? ggml_sparse_attn_dot_rows<ggml_sparse_attn_f16_rows>(DK, q, k_row)
                                                               : ggml_sparse_attn_dot_rows<ggml_sparse_attn_q8_0_rows>(DK, q, k_row);
                kq[j*n_sel + i] = s*ctx.scale;
            }
            continue;
        }
#endif
        const float * kf = ggml_sparse_attn_row_f32(ctx.k, ctx.k_to_float, ctx.k_row(sel[i], h, iq3), row, DK);
        for (int64_t j = 0; j < g; ++j) {
            float sk;
            ggml_vec_dot_f32(DK, &sk, 0, ctx.q_row(iq1, h*g + j, iq3), 0, kf, 0, 1);
            kq[j*n_sel + i] = sk*ctx.scale;
        }
    }
    GGML_UNUSED(k_vec);

    for (int64_t j = 0; j < g; ++j) {
        float M;
        ggml_vec_max_f32(n_sel, &M, kq + j*n_sel);
        const ggml_float S = ggml_vec_soft_max_f32(n_sel, kq + j*n_sel, kq + j*n_sel, M);
        ggml_vec_scale_f32(n_sel, kq + j*n_sel, alpha[j]/(float) S);
    }

    memset(y, 0, g*DV*sizeof(float));
    if (v_vec) {
#if defined(GGML_SPARSE_ATTN_ROW_BLOCK)
        const char * v = (const char *) ctx.v->data + h*ctx.v->nb[2] + iq3*ctx.v->nb[3];
        for (int64_t j = 0; j < g; ++j) {
            if (ctx.v->type == GGML_TYPE_F16) {
                ggml_sparse_attn_mad_rows<ggml_sparse_attn_f16_rows>(DV, y + j*DV, v, ctx.v->nb[1], sel, n_sel, kq + j*n_sel);
            } else {
                ggml_sparse_attn_mad_rows<ggml_sparse_attn_q8_0_rows>(DV, y + j*DV, v, ctx.v->nb[1], sel, n_sel, kq + j*n_sel);
            }
        }
#endif
    } else {
        for (int64_t i = 0; i < n_sel; ++i) {
            const float * vf = ggml_sparse_attn_row_f32(ctx.v, ctx.v_to_float, ctx.v_row(sel[i], h, iq3), row, DV);
            for (int64_t j = 0; j < g; ++j) {
                ggml_vec_mad_f32(DV, y + j*DV, vf, kq[j*n_sel + i]);
            }
        }
    }

    // mean value reallocation
    if (ctx.mean_value && !all) {
        const float * vm;
        if (ctx.vmean) {
            vm = (const float *) ((const char *) ctx.vmean->data + h*ctx.vmean->nb[1] + iq1*ctx.vmean->nb[2] + iq3*ctx.vmean->nb[3]);
        } else {
            // computed by ggml_sparse_attn_select, the sums of this kv head may be overwritten by now
            vm = ctx.local<float>(ith, ctx.l.v_mean);
        }
        for (int64_t j = 0; j < g; ++j) {
            ggml_vec_mad_f32(DV, y + j*DV, vm, 1.0f - alpha[j]);
        }
    }

    for (int64_t j = 0; j < g; ++j) {
        memcpy(ctx.dst_row(iq1, h*g + j, iq3), y + j*DV, DV*sizeof(float));
    }
}

//
// scheduling
//

// kv heads per thread: (row, kv head) items, handed out one at a time. Each thread scores, selects and attends
// whole kv heads, and the gather of one head's selected K/V rows overlaps with the scoring of the thread's next head.
#ifdef GGML_SPARSE_ATTN_PROFILE
// a profile of the kernel's phases, for the op bench's --phases (a build with -DGGML_SPARSE_ATTN_PROFILE): the
// nanoseconds spent in each, summed over the threads and the calls; the phases overlap a little (the next kv head's
// first requests are made while this one's are selected)
enum ggml_sparse_attn_phase {
    GGML_SPARSE_ATTN_RANK,   // choosing the query's components and scoring every visible cell (K^T rows, Loki's prefixes)
    GGML_SPARSE_ATTN_SELECT, // the local window, the sink and the top-k
    GGML_SPARSE_ATTN_ATTEND, // gathering the selected K and V rows, the exact attention and the mean value
    GGML_SPARSE_ATTN_N_PHASES,
};

static std::atomic<int64_t> ggml_sparse_attn_phase_ns[GGML_SPARSE_ATTN_N_PHASES];

static int64_t ggml_sparse_attn_now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

#define GGML_SPARSE_ATTN_PHASE(phase, ...) do {                                  \
        const int64_t t0_ = ggml_sparse_attn_now_ns();                            \
        __VA_ARGS__;                                                              \
        ggml_sparse_attn_phase_ns[phase] += ggml_sparse_attn_now_ns() - t0_;      \
    } while (0)

// the nanoseconds of each phase (rank, select, attend) since the last call, which zeroes them
extern "C" {
GGML_BACKEND_API void ggml_cpu_sparse_attn_phases(int64_t * ns);
}

void ggml_cpu_sparse_attn_phases(int64_t * ns) {
    for (int i = 0; i < GGML_SPARSE_ATTN_N_PHASES; ++i) {
        ns[i] = ggml_sparse_attn_phase_ns[i].exchange(0);
    }
}
#else
#define GGML_SPARSE_ATTN_PHASE(phase, ...) __VA_ARGS__
#endif

static void ggml_sparse_attn_forward_per_head(ggml_sparse_attn_ctx & ctx, const ggml_compute_params * params) {
    const int ith = params->ith;
    const int nth = params->nth;

    int32_t * sel   = ctx.local<int32_t>(ith, ctx.l.selection);
    float   * alpha = ctx.local<float>  (ith, ctx.l.alpha);

    ctx.ith_head = ith;
    if (ith == 0) {
        // every thread starts at item ith
        ggml_threadpool_chunk_set(params->threadpool, nth);
    }
    ggml_barrier(params->threadpool);

    int64_t row    = -1;
    int64_t iq1    = 0;
    int64_t iq3    = 0;
    int64_t h_pend = -1; // the kv head whose selection waits for its exact attention
    int64_t h_prep = -1; // the kv head whose r components are chosen (the next one, once the current is scored)
    int64_t n_sel  = 0;

    const ggml_fp16_t * mp = nullptr;
    const int32_t     * pp = nullptr;

    ggml_sparse_attn_lookahead la;

    const int64_t n_items = ctx.ne3*ctx.n_batch*ctx.n_head_kv;

    // the next item is claimed as soon as the current kv head is scored, for the look-ahead
    for (int64_t it = ith, it_next; it < n_items; it = it_next) {
        const int64_t h = it % ctx.n_head_kv;

        if (it/ctx.n_head_kv != row) {
            if (h_pend >= 0) {
                GGML_SPARSE_ATTN_PHASE(GGML_SPARSE_ATTN_ATTEND, ggml_sparse_attn_attend(ctx, ith, iq1, iq3, h_pend, sel, n_sel, alpha));
                h_pend = -1;
            }

            row = it/ctx.n_head_kv;
            iq1 = row % ctx.n_batch;
            iq3 = row / ctx.n_batch;
            pp  = (const int32_t *) ((const char *) ctx.pos->data + (iq3 % ctx.pos->ne[1])*ctx.pos->nb[1]);
            mp  = (const ggml_fp16_t *) ((const char *) ctx.mask->data + iq1*ctx.mask->nb[1] + (iq3 % ctx.mask->ne[3])*ctx.mask->nb[3]);

            ggml_sparse_attn_begin_row(ctx, ith, mp);
            h_prep = -1;

            int32_t               * local = ctx.local<int32_t>(ith, ctx.l.head_local_cells);
            ggml_sparse_attn_cand * last  = ctx.local<ggml_sparse_attn_cand>(ith, ctx.l.head_local_last);
            int32_t               * sink  = ctx.local<int32_t>(ith, ctx.l.head_sink_cells);
            GGML_SPARSE_ATTN_PHASE(GGML_SPARSE_ATTN_SELECT, ggml_sparse_attn_select_local(ctx, ith, mp, pp, local, last, sink));
            ctx.local_cells = local;
            ctx.local_last  = last;
            ctx.sink_cells  = sink;
        }

        if (h_prep != h) {
            GGML_SPARSE_ATTN_PHASE(GGML_SPARSE_ATTN_RANK, ggml_sparse_attn_prepare_sparq(ctx, ith, iq1, iq3, h));
        }
        for (int64_t c = 0; c < ctx.l.n_chunk; ++c) {
            GGML_SPARSE_ATTN_PHASE(GGML_SPARSE_ATTN_RANK, ggml_sparse_attn_phase1_sparq(ctx, ith, iq3, h, c, mp));
        }

        // the next kv head of the same row: its components (the selection and the exact attention below do
        // not use those of this head) and the requests for its first kt lines
        it_next = ggml_threadpool_chunk_add(params->threadpool, 1);
        h_prep  = -1;
        ctx.la  = nullptr;
        if (it_next < n_items && it_next/ctx.n_head_kv == row && ctx.i_vis < ctx.n_kv) {
            h_prep = it_next % ctx.n_head_kv;
            GGML_SPARSE_ATTN_PHASE(GGML_SPARSE_ATTN_RANK, ggml_sparse_attn_prepare_sparq(ctx, ith, iq1, iq3, h_prep));

            const ggml_tensor * kt = ctx.kt;
            la.kt      = (const char *) kt->data + h_prep*kt->nb[2] + iq3*kt->nb[3] + ctx.i_vis*kt->nb[0];
            la.comps   = ctx.local<int32_t>(ith, ctx.l.comps);
            la.nb1     = kt->nb[1];
            la.r       = ctx.r;
            la.c       = 0;
            la.line    = 0;
            la.n_lines = (int64_t) ((ctx.n_kv - ctx.i_vis)*kt->nb[0]/64);
            ctx.la     = &la;
        }

        if (h_pend >= 0) {
            GGML_SPARSE_ATTN_PHASE(GGML_SPARSE_ATTN_ATTEND, ggml_sparse_attn_attend(ctx, ith, iq1, iq3, h_pend, sel, n_sel, alpha));
            h_pend = -1;
        }
        bool selected;
        GGML_SPARSE_ATTN_PHASE(GGML_SPARSE_ATTN_SELECT, selected = ggml_sparse_attn_select(ctx, ith, iq1, iq3, h, mp, pp, sel, &n_sel, alpha));
        if (selected) {
            h_pend = h;
            ggml_sparse_attn_prefetch_rows(ctx, iq3, h, sel, n_sel);
        }
        ctx.la = nullptr;
    }
    if (h_pend >= 0) {
        GGML_SPARSE_ATTN_PHASE(GGML_SPARSE_ATTN_ATTEND, ggml_sparse_attn_attend(ctx, ith, iq1, iq3, h_pend, sel, n_sel, alpha));
    }
}

// few items (fewer kv heads than threads), and Loki: the (kv head, chunk) pairs of a row are split between the
// threads (Loki: the chunks, all kv heads at once, their K row prefixes are interleaved in memory), then the kv
// heads, with a barrier in between. Every value is computed as in ggml_sparse_attn_forward_per_head.
static void ggml_sparse_attn_forward_per_chunk(ggml_sparse_attn_ctx & ctx, const ggml_compute_params * params) {
    const int ith = params->ith;
    const int nth = params->nth;

    const int64_t n_chunk = ctx.l.n_chunk;
    const bool    loki    = ctx.rank == GGML_SPARSE_ATTN_RANK_LOKI;

    int32_t * nruns = ctx.local<int32_t>(ith, ctx.l.n_runs);
    int32_t * sel   = ctx.local<int32_t>(ith, ctx.l.selection);
    float   * alpha = ctx.local<float>  (ith, ctx.l.alpha);

    for (int64_t iq3 = 0; iq3 < ctx.ne3; ++iq3) {
        const int32_t * pp = (const int32_t *) ((const char *) ctx.pos->data + (iq3 % ctx.pos->ne[1])*ctx.pos->nb[1]);

        for (int64_t iq1 = 0; iq1 < ctx.n_batch; ++iq1) {
            const ggml_fp16_t * mp = (const ggml_fp16_t *) ((const char *) ctx.mask->data + iq1*ctx.mask->nb[1] + (iq3 % ctx.mask->ne[3])*ctx.mask->nb[3]);

            for (int64_t c = 0; c < n_chunk; ++c) {
                nruns[c] = -1;
            }

            // phase 1 work items of this thread, every nth: the visible cells of a row may be a few neighbouring
            // chunks (a sequence's own cells in a cache that several share), which one contiguous share of the
            // chunks would give to one thread
            const int64_t n_items = loki ? n_chunk : ctx.n_head_kv*n_chunk;

            if (ith == 0) {
                GGML_SPARSE_ATTN_PHASE(GGML_SPARSE_ATTN_SELECT, ggml_sparse_attn_select_local(ctx, ith, mp, pp,
                        ctx.shared<int32_t>(ctx.l.local_cells), ctx.shared<ggml_sparse_attn_cand>(ctx.l.local_last),
                        ctx.shared<int32_t>(ctx.l.sink_cells)));
            }

            if (loki && ith < n_items) {
                GGML_SPARSE_ATTN_PHASE(GGML_SPARSE_ATTN_RANK, ggml_sparse_attn_prepare_loki(ctx, ith, iq1, iq3));
            }

            int64_t h_prep = -1;
            for (int64_t it = ith; it < n_items; it += nth) {
                if (loki) {
                    GGML_SPARSE_ATTN_PHASE(GGML_SPARSE_ATTN_RANK, ggml_sparse_attn_phase1_loki(ctx, ith, iq3, it, mp));
                    continue;
                }
                const int64_t h = it/n_chunk;
                if (h != h_prep) {
                    GGML_SPARSE_ATTN_PHASE(GGML_SPARSE_ATTN_RANK, ggml_sparse_attn_prepare_sparq(ctx, ith, iq1, iq3, h));
                    h_prep = h;
                }
                GGML_SPARSE_ATTN_PHASE(GGML_SPARSE_ATTN_RANK, ggml_sparse_attn_phase1_sparq(ctx, ith, iq3, h, it%n_chunk, mp));
            }

            ggml_barrier(params->threadpool);

            ctx.n_vis       = ggml_sparse_attn_n_visible(ctx);
            ctx.local_cells = ctx.shared<int32_t>(ctx.l.local_cells);
            ctx.local_last  = ctx.shared<ggml_sparse_attn_cand>(ctx.l.local_last);
            ctx.sink_cells  = ctx.shared<int32_t>(ctx.l.sink_cells);

            // phase 2: the kv heads, a contiguous share per thread
            for (int64_t h = (ctx.n_head_kv*ith)/nth; h < (ctx.n_head_kv*(ith + 1))/nth; ++h) {
                int64_t n_sel = 0;
                bool selected;
                GGML_SPARSE_ATTN_PHASE(GGML_SPARSE_ATTN_SELECT, selected = ggml_sparse_attn_select(ctx, ith, iq1, iq3, h, mp, pp, sel, &n_sel, alpha));
                if (selected) {
                    // nothing to overlap the gather with here: all of its requests at once
                    ggml_sparse_attn_prefetch_rows(ctx, iq3, h, sel, n_sel);
                    GGML_SPARSE_ATTN_PHASE(GGML_SPARSE_ATTN_ATTEND, ggml_sparse_attn_attend(ctx, ith, iq1, iq3, h, sel, n_sel, alpha));
                }
            }

            if (iq1 + 1 < ctx.n_batch || iq3 + 1 < ctx.ne3) {
                ggml_barrier(params->threadpool);
            }
        }
    }
}

// ALISA: the top (top_k - n_local) visible cells outside the local window by the window sums of set u, then the local
// ones, into sel (unsorted); ties to the more recent position as in the other rankings
static int64_t ggml_sparse_attn_select_alisa(const ggml_sparse_attn_ctx & ctx, int ith, const ggml_fp16_t * mp, const int32_t * pp,
        const float * sums, int32_t * sel) {
    ggml_sparse_attn_cand * cand = ctx.local<ggml_sparse_attn_cand>(ith, ctx.l.candidates);
    float                 * keys = ctx.local<float>(ith, ctx.l.samples);

    const ggml_sparse_attn_cand_greater gt;
    const ggml_sparse_attn_cand last = *ctx.local_last;

    int64_t n_sel = 0;
    for (int64_t i = 0; i < ctx.n_local; ++i) {
        sel[n_sel++] = ctx.local_cells[i];
    }

    int64_t n_cand = 0;
    for (int64_t c = 0; c < ctx.l.n_chunk; ++c) {
        int32_t n_runs;
        const int32_t * runs = ggml_sparse_attn_runs(ctx, ith, mp, c, &n_runs);
        for (int32_t ir = 0; ir < n_runs; ++ir) {
            for (int32_t i = runs[2*ir + 0]; i < runs[2*ir + 1]; ++i) {
                cand[n_cand] = { sums[i], pp[i], i };
                n_cand += gt(last, { 0.0f, pp[i], i }); // not one of the local cells (by position and cell)
            }
        }
    }

    const int64_t n_top = std::min<int64_t>(ctx.top_k - ctx.n_local, n_cand);
    if (n_top > 0 && !ggml_sparse_attn_top_by_bits(cand, n_cand, n_top, keys, sel, &n_sel)) {
        // a negative or NaN sum (a sum the caller got wrong): the order of ggml_sparse_attn_cand_greater
        std::nth_element(cand, cand + n_top - 1, cand + n_cand, gt);
        for (int64_t i = 0; i < n_top; ++i) {
            sel[n_sel++] = cand[i].cell;
        }
    }
    return n_sel;
}

// ALISA, per row: the sets are selected (a set per thread), then the kv heads attend (a kv head per thread) and their
// weights are summed into the row's weights of each set, in the order of the kv heads, so threads do not change them
static void ggml_sparse_attn_forward_alisa(ggml_sparse_attn_ctx & ctx, const ggml_compute_params * params) {
    const int ith = params->ith;
    const int nth = params->nth;

    const int64_t n_set   = ctx.sums->ne[1];
    const int64_t n_sel_l = ctx.l.n_sel;

    int32_t * set_sel   = ctx.shared<int32_t>(ctx.l.set_sel);
    int32_t * set_n_sel = ctx.shared<int32_t>(ctx.l.set_n_sel);
    float   * head_w    = ctx.shared<float>(ctx.l.head_weights);
    float   * alpha     = ctx.local<float>(ith, ctx.l.alpha);

    for (int64_t j = 0; j < ctx.g; ++j) {
        alpha[j] = 1.0f;
    }

    const float * w_kq = ctx.local<float>(ith, ctx.l.weights);
    char * w_out = (char *) ctx.dst->data + ctx.DV*ctx.n_head*ctx.n_batch*ctx.ne3*sizeof(float);

    int32_t * local = ctx.local<int32_t>(ith, ctx.l.head_local_cells);
    ggml_sparse_attn_cand * last = ctx.local<ggml_sparse_attn_cand>(ith, ctx.l.head_local_last);

    for (int64_t iq3 = 0; iq3 < ctx.ne3; ++iq3) {
        const int32_t * pp = (const int32_t *) ((const char *) ctx.pos->data + (iq3 % ctx.pos->ne[1])*ctx.pos->nb[1]);

        for (int64_t iq1 = 0; iq1 < ctx.n_batch; ++iq1) {
            const ggml_fp16_t * mp = (const ggml_fp16_t *) ((const char *) ctx.mask->data + iq1*ctx.mask->nb[1] + (iq3 % ctx.mask->ne[3])*ctx.mask->nb[3]);

            // every thread: the row's visible cells, k, and the local window
            ggml_sparse_attn_begin_row(ctx, ith, mp);

            const int64_t k = std::max<int64_t>(1, (int64_t) floor((double) ctx.n_vis*(double) ctx.c/2));
            const bool  all = 2*k >= ctx.n_vis;

            ctx.top_k   = all ? ctx.n_vis : 2*k;
            ctx.n_local = all ? 0 : k;
            GGML_ASSERT(ctx.top_k <= n_sel_l);

            float * w_row = (float *) (w_out + (iq1*n_set + iq3*ctx.n_batch*n_set)*ctx.n_kv*sizeof(float));

            if (ctx.n_vis > 0 && !all) {
                ggml_sparse_attn_select_local(ctx, ith, mp, pp, local, last, ctx.local<int32_t>(ith, ctx.l.head_sink_cells));
                ctx.local_cells = local;
                ctx.local_last  = last;
            }

            // phase 1: the selection of each set
            for (int64_t u = ith; u < n_set; u += nth) {
                int32_t * sel = set_sel + u*n_sel_l;
                int64_t n_sel = 0;
                if (all) {
                    for (int64_t c = 0; c < ctx.l.n_chunk; ++c) {
                        int32_t n_runs;
                        const int32_t * runs = ggml_sparse_attn_runs(ctx, ith, mp, c, &n_runs);
                        for (int32_t ir = 0; ir < n_runs; ++ir) {
                            for (int32_t i = runs[2*ir + 0]; i < runs[2*ir + 1]; ++i) {
                                sel[n_sel++] = i;
                            }
                        }
                    }
                } else {
                    const ggml_tensor * s = ctx.sums;
                    const float * su = (const float *) ((const char *) s->data + u*s->nb[1] +
                            (iq1 % s->ne[2])*s->nb[2] + (iq3 % s->ne[3])*s->nb[3]);
                    n_sel = ggml_sparse_attn_select_alisa(ctx, ith, mp, pp, su, sel);
                    std::sort(sel, sel + n_sel);
                }
                set_n_sel[u] = (int32_t) n_sel;
            }

            ggml_barrier(params->threadpool);

            // phase 2: exact attention of each kv head over its set's selection
            for (int64_t h = ith; h < ctx.n_head_kv; h += nth) {
                const int64_t u     = n_set == 1 ? 0 : h;
                const int64_t n_sel = set_n_sel[u];
                float * hw = head_w + h*n_sel_l;
                if (n_sel == 0) {
                    for (int64_t j = 0; j < ctx.g; ++j) {
                        memset(ctx.dst_row(iq1, h*ctx.g + j, iq3), 0, ctx.DV*sizeof(float));
                    }
                    continue;
                }
                ggml_sparse_attn_attend(ctx, ith, iq1, iq3, h, set_sel + u*n_sel_l, n_sel, alpha);
                memcpy(hw, w_kq, n_sel*sizeof(float));
                for (int64_t j = 1; j < ctx.g; ++j) {
                    ggml_vec_acc_f32(n_sel, hw, w_kq + j*n_sel);
                }
            }

            ggml_barrier(params->threadpool);

            // phase 3: the weights of each set, 0 outside its selection
            for (int64_t u = ith; u < n_set; u += nth) {
                const int32_t * sel   = set_sel + u*n_sel_l;
                const int64_t   n_sel = set_n_sel[u];
                float * wu = w_row + u*ctx.n_kv;
                memset(wu, 0, ctx.n_kv*sizeof(float));
                for (int64_t h = (n_set == 1 ? 0 : u); h < (n_set == 1 ? ctx.n_head_kv : u + 1); ++h) {
                    const float * hw = head_w + h*n_sel_l;
                    for (int64_t i = 0; i < n_sel; ++i) {
                        wu[sel[i]] += hw[i];
                    }
                }
            }

            ggml_barrier(params->threadpool);
        }
    }
}

void ggml_compute_forward_sparse_attn(
        const ggml_compute_params * params,
        ggml_tensor * dst) {

    ggml_sparse_attn_ctx ctx;

    ctx.q     = dst->src[0];
    ctx.k     = dst->src[1];
    ctx.kt    = dst->src[2];
    ctx.v     = dst->src[3];
    ctx.mask  = dst->src[4];
    ctx.pos   = dst->src[5];
    ctx.vmean = dst->src[6];
    ctx.sums  = dst->src[7];
    ctx.dst   = dst;

    ctx.DK        = ctx.k->ne[0];
    ctx.DV        = ctx.v->ne[0];
    ctx.n_kv      = ctx.k->ne[1];
    ctx.n_batch   = ctx.q->ne[1];
    ctx.n_head    = ctx.q->ne[2];
    ctx.n_head_kv = ctx.k->ne[2];
    ctx.g         = ctx.n_head/ctx.n_head_kv;
    ctx.ne3       = ctx.q->ne[3];

    ctx.scale      = ggml_get_op_params_f32(dst, 0);
    ctx.r          = ggml_get_op_params_i32(dst, 1);
    ctx.top_k      = ggml_get_op_params_i32(dst, 2);
    ctx.n_local    = ggml_get_op_params_i32(dst, 3);
    ctx.mean_value = ggml_get_op_params_i32(dst, 4) != 0;
    ctx.rank       = ggml_get_op_params_i32(dst, 5);
    ctx.c          = ggml_get_op_params_f32(dst, 6);
    ctx.n_sink     = ggml_get_op_params_i32(dst, 7);

    GGML_ASSERT(dst->type == GGML_TYPE_F32);
    ctx.y_nb1 = dst->nb[1];
    ctx.y_nb2 = dst->nb[2];
    ctx.y_nb3 = dst->nb[3];
    if (ctx.rank == GGML_SPARSE_ATTN_RANK_ALISA) {
        // the attention result is contiguous at the start of the 1-d dst, the weights follow
        GGML_ASSERT(ctx.kt == nullptr && ctx.vmean == nullptr && !ctx.mean_value);
        GGML_ASSERT(ctx.sums && ctx.sums->type == GGML_TYPE_F32 && ctx.sums->nb[0] == sizeof(float));
        ctx.y_nb1 = ctx.DV*sizeof(float);
        ctx.y_nb2 = ctx.y_nb1*ctx.n_head;
        ctx.y_nb3 = ctx.y_nb2*ctx.n_batch;
    } else if (ctx.rank == GGML_SPARSE_ATTN_RANK_LOKI) {
        GGML_ASSERT(ctx.kt == nullptr && !ctx.mean_value);
    } else {
        GGML_ASSERT(ctx.rank == GGML_SPARSE_ATTN_RANK_SPARQ);
        GGML_ASSERT(ctx.kt->type == GGML_TYPE_F16 || ctx.kt->type == GGML_TYPE_F32);
        GGML_ASSERT(ctx.kt->nb[0] == ggml_type_size(ctx.kt->type));
    }

    ctx.k_to_float = ggml_get_type_traits(ctx.k->type)->to_float;
    ctx.v_to_float = ggml_get_type_traits(ctx.v->type)->to_float;
    GGML_ASSERT((ctx.k->type == GGML_TYPE_F32 || ctx.k_to_float) && "sparse_attn: unsupported K-type");
    GGML_ASSERT((ctx.v->type == GGML_TYPE_F32 || ctx.v_to_float) && "sparse_attn: unsupported V-type");

    // rows must be contiguous
    GGML_ASSERT(ctx.q->nb[0]  == ggml_type_size(ctx.q->type));
    GGML_ASSERT(ctx.k->nb[0]  == ggml_type_size(ctx.k->type));
    GGML_ASSERT(ctx.v->nb[0]  == ggml_type_size(ctx.v->type));
    GGML_ASSERT(!ctx.vmean || ctx.vmean->nb[0] == sizeof(float));
    GGML_ASSERT(dst->nb[0] == sizeof(float));

    // cells are stored as int32
    GGML_ASSERT(ctx.n_kv <= INT32_MAX);

    ctx.l     = ggml_sparse_attn_get_layout(dst, params->nth);
    ctx.wdata = (char *) params->wdata;

    GGML_ASSERT(params->wsize >= ctx.l.size);

    const int64_t n_rows = ctx.ne3*ctx.n_batch;
    if (ctx.rank == GGML_SPARSE_ATTN_RANK_ALISA) {
        ggml_sparse_attn_forward_alisa(ctx, params);
    } else if (ctx.n_head_kv*n_rows >= 4*params->nth && ctx.rank != GGML_SPARSE_ATTN_RANK_LOKI) {
        ggml_sparse_attn_forward_per_head(ctx, params);
    } else {
        ggml_sparse_attn_forward_per_chunk(ctx, params);
    }
}
