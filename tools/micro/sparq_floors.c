// Floors of the CPU SPARSE_ATTN kernel's two memory phases at batch 1, n_kv = 16k, 32 kv heads of D = 128 (the op
// bench's setting), 8 layers' worth of buffers so nothing stays in the last-level cache.
//   stream: the scoring pass, r = 16 of the 128 rows of K^T of every kv head (f16);
//           mode 0: 64 cells of the 16 rows per step, prefetching 512 bytes ahead (the first kernel's order),
//           mode 1: each row from start to end, no prefetch,
//           mode 2: 1024-cell chunks, the rows 4 at a time, partial sums through a buffer, each row's next chunk
//                   requested into L1 non-temporally (the kernel's order),
//           mode 3: each row from start to end, 4 accumulators, no prefetch (what the hardware prefetchers carry),
//           mode 4: mode 3, with each row's last 2048 cells requesting the next row's first 2048;
//           ADJACENT=1 in the environment puts a kv head's 16 rows next to each other (one 512 KiB run);
//           mode 5: mode 2 with CHUNK (default 1024), GROUP (4) and REQUEST_MASK (15: which rows of a group get
//           requests) from the environment
//   gather: per kv head, k = 128 random cells' K and V rows (256 bytes of f16 each) at the 8 KiB cell stride of a
//           llama.cpp cache; mode 0: every line requested first (prefetch), then read; mode 1: read, no prefetch
// Build and run (needs AVX-512):
//   cc -O2 -march=native -fopenmp sparq_floors.c -o sparq_floors && ./sparq_floors stream|gather [MODE] [THREADS] [PASSES]
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { N_CELL = 16384, D = 128, H = 32, R = 16, TOP_K = 128, L = 8, CELL_STRIDE = H*D*2 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec*1e-9;
}

static char * filled(size_t n) {
    char * p = aligned_alloc(4096, n);
    memset(p, 1, n);
    return p;
}

// settings from the environment, read once in main (not in the timed loops)
static int    adjacent  = 0;    // ADJACENT
static size_t chunk     = 1024; // CHUNK, mode 5
static size_t group     = 4;    // GROUP, mode 5
static int    requested = 15;   // REQUEST_MASK, mode 5

// a positive integer from the environment, or the default
static int env_int(const char * name, int def) {
    const char * v = getenv(name);
    return v && atoi(v) > 0 ? atoi(v) : def;
}

// the component rows a kv head's scoring reads: spread over the head's 128 rows, or (ADJACENT) its first 16
static const unsigned short * kt_row(const char * kt_layer, size_t h, size_t c) {
    const size_t row = (size_t) N_CELL*2;
    return (const unsigned short *) (kt_layer + h*D*row + (adjacent ? c : (c*7 + h) % D)*row);
}

// the K^T rows of a kv head in chunks of `chunk` cells, `group` rows at a time, partial sums through a buffer, the rows
// in the mask `requested` (bit c: row c of a group) requesting their next chunk into L1. Inlined, so that mode 2's
// constant arguments give constant loop bounds: with runtime bounds the same order reads ~6% slower
static inline __attribute__((always_inline)) __m512 stream_chunks(const unsigned short * const * rows, size_t chunk,
        size_t group, int requested, __m512 acc) {
    static __thread float e[N_CELL];
    const __m512 w = _mm512_set1_ps(0.5f);
    for (size_t i0 = 0; i0 < N_CELL; i0 += chunk) {
        const int next = i0 + 2*chunk <= N_CELL;
        for (size_t c0 = 0; c0 < R; c0 += group) {
            for (size_t i = i0; i < i0 + chunk; i += 64) {
                __m512 y[4];
                for (int u = 0; u < 4; u++) {
                    y[u] = c0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(e + (i - i0) + 16*u);
                }
                for (size_t c = c0; c < c0 + group && c < R; c++) {
                    const unsigned short * x = rows[c] + i;
                    if (next && ((requested >> (c - c0)) & 1)) {
                        __builtin_prefetch(x + chunk, 0, 0);
                        __builtin_prefetch(x + chunk + 32, 0, 0);
                    }
                    for (int u = 0; u < 4; u++) {
                        y[u] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (x + 16*u))), w, y[u]);
                    }
                }
                for (int u = 0; u < 4; u++) {
                    _mm512_storeu_ps(e + (i - i0) + 16*u, y[u]);
                }
            }
        }
        acc = _mm512_add_ps(acc, _mm512_loadu_ps(e));
    }
    return acc;
}

// one layer's scoring reads of kv head h: R rows of K^T (each N_CELL f16 values)
static __m512 stream_head(const char * kt_layer, size_t h, int mode, __m512 acc) {
    const unsigned short * rows[R];
    for (size_t c = 0; c < R; c++) {
        rows[c] = kt_row(kt_layer, h, c);
    }
    const __m512 w = _mm512_set1_ps(0.5f);
    if (mode == 0) {
        for (size_t i = 0; i < N_CELL; i += 64) {
            __m512 y[4] = { _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps() };
            for (size_t c = 0; c < R; c++) {
                const unsigned short * x = rows[c] + i;
                __builtin_prefetch(x + 256, 0, 2);
                __builtin_prefetch(x + 256 + 32, 0, 2);
                for (int u = 0; u < 4; u++) {
                    y[u] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (x + 16*u))), w, y[u]);
                }
            }
            acc = _mm512_add_ps(acc, _mm512_add_ps(_mm512_add_ps(y[0], y[1]), _mm512_add_ps(y[2], y[3])));
        }
    } else if (mode == 2) {
        acc = stream_chunks(rows, 1024, 4, 15, acc); // constants, as in the kernel
    } else if (mode == 5) {
        acc = stream_chunks(rows, chunk, group, requested, acc);
    } else if (mode == 3 || mode == 4) {
        enum { AHEAD = 2048 };
        __m512 y[4] = { _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps() };
        for (size_t c = 0; c < R; c++) {
            // the row after this one: the next component, or the next kv head's first
            const unsigned short * nx = c + 1 < R ? rows[c + 1] : kt_row(kt_layer, (h + 1) % H, 0);
            for (size_t i = 0; i < N_CELL; i += 64) {
                if (mode == 4 && i >= N_CELL - AHEAD) {
                    __builtin_prefetch(nx + (i - (N_CELL - AHEAD)), 0, 3);
                    __builtin_prefetch(nx + (i - (N_CELL - AHEAD)) + 32, 0, 3);
                }
                for (int u = 0; u < 4; u++) {
                    y[u] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (rows[c] + i + 16*u))), w, y[u]);
                }
            }
        }
        acc = _mm512_add_ps(acc, _mm512_add_ps(_mm512_add_ps(y[0], y[1]), _mm512_add_ps(y[2], y[3])));
    } else {
        for (size_t c = 0; c < R; c++) {
            for (size_t i = 0; i < N_CELL; i += 16) {
                acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (rows[c] + i))), w, acc);
            }
        }
    }
    return acc;
}

// one layer's gather of kv head h: the K and V rows of TOP_K random cells
static __m512 gather_head(const char * k_layer, const char * v_layer, size_t h, int mode, unsigned * seed, __m512 acc) {
    size_t sel[TOP_K];
    for (size_t i = 0; i < TOP_K; i++) {
        *seed = *seed*1103515245u + 12345u;
        sel[i] = (*seed >> 8) % N_CELL;
    }
    const char * kb = k_layer + h*D*2;
    const char * vb = v_layer + h*D*2;
    if (mode == 0) {
        for (size_t i = 0; i < TOP_K; i++) {
            for (int o = 0; o < D*2; o += 64) {
                __builtin_prefetch(kb + sel[i]*CELL_STRIDE + o, 0, 2);
                __builtin_prefetch(vb + sel[i]*CELL_STRIDE + o, 0, 2);
            }
        }
    }
    for (size_t i = 0; i < TOP_K; i++) {
        for (int o = 0; o < D*2; o += 64) {
            acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float *) (kb + sel[i]*CELL_STRIDE + o)));
            acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float *) (vb + sel[i]*CELL_STRIDE + o)));
        }
    }
    return acc;
}

int main(int argc, char ** argv) {
    const int gather = argc > 1 && strcmp(argv[1], "gather") == 0;
    if (argc < 2 || (!gather && strcmp(argv[1], "stream") != 0)) {
        fprintf(stderr, "usage: %s stream|gather [MODE 0-5] [THREADS] [PASSES]\n", argv[0]);
        return 2;
    }
    const int mode = argc > 2 ? atoi(argv[2]) : 0;
    adjacent  = env_int("ADJACENT", 0) != 0;
    chunk     = env_int("CHUNK", 1024);
    group     = env_int("GROUP", 4);
    requested = env_int("REQUEST_MASK", 15);
    if (!gather && mode == 5 && (chunk % 64 != 0 || N_CELL % chunk != 0)) {
        fprintf(stderr, "CHUNK=%zu: a multiple of 64 that divides %d\n", chunk, N_CELL);
        return 2;
    }
    const int nth  = argc > 3 ? atoi(argv[3]) : 2;
    const int passes = argc > 4 ? atoi(argv[4]) : 15;
    const size_t layer = (size_t) N_CELL*CELL_STRIDE; // K^T, K and V of a layer are each this large

    char * a[L];
    char * b[L];
    for (int l = 0; l < L; l++) {
        a[l] = filled(layer);                // K^T (stream) or K (gather)
        b[l] = gather ? filled(layer) : NULL; // V
    }

    double best = 1e9;
    for (int rep = 0; rep < passes; rep++) {
        const double t0 = now();
        float tot = 0;
        #pragma omp parallel num_threads(nth) reduction(+:tot)
        {
            const int th = omp_get_thread_num();
            unsigned seed = rep*7 + th*13 + 1;
            __m512 acc = _mm512_setzero_ps();
            for (int l = 0; l < L; l++) {
                for (size_t h = th*(H/nth); h < (th + 1)*(H/nth); h++) {
                    acc = gather ? gather_head(a[l], b[l], h, mode, &seed, acc) : stream_head(a[l], h, mode, acc);
                }
            }
            tot += _mm512_reduce_add_ps(acc);
        }
        const double t = now() - t0;
        best = t < best ? t : best;
        if (tot == 1.2345f) {
            printf("-"); // keeps the reads
        }
    }
    const double bytes = gather ? (double) L*H*TOP_K*2*D*2 : (double) L*H*R*N_CELL*2;
    printf("%s mode %d, %d threads: %.3f ms per layer (best of %d), %.1f GB/s\n", argv[1], mode, nth,
           best/L*1e3, passes, bytes/best/1e9);
    return 0;
}
