// The floor of SparQ's gather: per kv head, k = 128 random cells' K and V rows (256 bytes of f16 each), at the
// 8 KiB cell stride of a llama.cpp cache with 32 kv heads of D = 128, n_kv = 16k, 8 layers' worth of buffers.
// mode 0: every line of the head's rows requested first (prefetch), then read; mode 1: read, no prefetch.
// Build and run: cc -O2 -march=native -fopenmp kv_gather.c -o kv_gather && ./kv_gather MODE [THREADS]
// Needs AVX-512.
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
    const size_t n_cell = 16384, stride = 8192, H = 32, k = 128;
    const int L = 8;
    char * K[8];
    char * V[8];
    for (int l = 0; l < L; l++) {
        K[l] = aligned_alloc(4096, n_cell*stride);
        V[l] = aligned_alloc(4096, n_cell*stride);
        memset(K[l], 1, n_cell*stride);
        memset(V[l], 1, n_cell*stride);
    }
    double best = 1e9;
    for (int rep = 0; rep < 20; rep++) {
        const double t0 = now();
        float tot = 0;
        #pragma omp parallel num_threads(nth) reduction(+:tot)
        {
            const int th = omp_get_thread_num();
            unsigned s = rep*7 + th*13 + 1;
            __m512 acc = _mm512_setzero_ps();
            for (int l = 0; l < L; l++) {
                for (size_t h = th*(H/nth); h < (th + 1)*(H/nth); h++) {
                    size_t sel[128];
                    for (size_t i = 0; i < k; i++) {
                        s = s*1103515245u + 12345u;
                        sel[i] = (s >> 8) % n_cell;
                    }
                    const char * kb = K[l] + h*256;
                    const char * vb = V[l] + h*256;
                    if (mode == 0) {
                        for (size_t i = 0; i < k; i++) {
                            for (int o = 0; o < 256; o += 64) {
                                __builtin_prefetch(kb + sel[i]*stride + o, 0, 2);
                                __builtin_prefetch(vb + sel[i]*stride + o, 0, 2);
                            }
                        }
                    }
                    for (size_t i = 0; i < k; i++) {
                        for (int o = 0; o < 256; o += 64) {
                            acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float *) (kb + sel[i]*stride + o)));
                            acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float *) (vb + sel[i]*stride + o)));
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
    const double bytes = (double) L*H*k*2*256;
    printf("mode %d, %d threads: %.3f ms per layer (best of 20), %.1f GB/s gathered\n", mode, nth, best/L*1e3, bytes/best/1e9);
    return 0;
}
