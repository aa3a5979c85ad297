// The floor of SparQ's scoring pass: stream r = 16 of the 128 rows of K^T of every kv head (f16, n_kv = 16k,
// 32 kv heads, 8 layers' worth of buffers so nothing stays in cache), as the SPARQ_ATTN kernel reads them.
// mode 0: 64 cells of the 16 rows per step, prefetching 512 bytes ahead (the kernel's order)
// mode 1: each row from start to end, no prefetch
// Build and run: cc -O2 -march=native -fopenmp kt_stream.c -o kt_stream && ./kt_stream MODE [THREADS]
// Needs AVX-512 (F16C conversions on 512-bit vectors).
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec*1e-9;
}

int main(int argc, char ** argv) {
    const int mode = argc > 1 ? atoi(argv[1]) : 0;
    const int nth  = argc > 2 ? atoi(argv[2]) : 2;
    const size_t n = 16384, D = 128, H = 32, r = 16;
    const int L = 8;
    const size_t head = D*n*2, layer = H*head;
    char * buf = aligned_alloc(4096, L*layer);
    memset(buf, 1, L*layer);
    double best = 1e9;
    for (int rep = 0; rep < 15; rep++) {
        const double t0 = now();
        float tot = 0;
        #pragma omp parallel num_threads(nth) reduction(+:tot)
        {
            const int th = omp_get_thread_num();
            __m512 acc = _mm512_setzero_ps();
            for (int l = 0; l < L; l++) {
                for (size_t h = th*(H/nth); h < (th + 1)*(H/nth); h++) {
                    const unsigned short * rows[16];
                    for (size_t c = 0; c < r; c++) {
                        rows[c] = (const unsigned short *) (buf + l*layer + h*head + ((c*7 + h) % D)*n*2);
                    }
                    const __m512 w = _mm512_set1_ps(0.5f);
                    if (mode == 0) {
                        for (size_t i = 0; i < n; i += 64) {
                            __m512 y[4] = { _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps() };
                            for (size_t c = 0; c < r; c++) {
                                const unsigned short * x = rows[c] + i;
                                __builtin_prefetch(x + 256, 0, 2);
                                __builtin_prefetch(x + 256 + 32, 0, 2);
                                for (int u = 0; u < 4; u++) {
                                    y[u] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (x + 16*u))), w, y[u]);
                                }
                            }
                            acc = _mm512_add_ps(acc, _mm512_add_ps(_mm512_add_ps(y[0], y[1]), _mm512_add_ps(y[2], y[3])));
                        }
                    } else {
                        for (size_t c = 0; c < r; c++) {
                            for (size_t i = 0; i < n; i += 16) {
                                acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (rows[c] + i))), w, acc);
                            }
                        }
                    }
                }
            }
            tot += _mm512_reduce_add_ps(acc);
        }
        const double t = now() - t0;
        best = t < best ? t : best;
        if (tot == 1.2345f) {
            printf("-");
        }
    }
    const double bytes = (double) L*H*r*n*2;
    printf("mode %d, %d threads: %.3f ms per layer (best of 15), %.1f GB/s\n", mode, nth, best/L*1e3, bytes/best/1e9);
    return 0;
}
