// The checksum of llama.cpp's state files (patch "llama : state files are written atomically and checked when
// read": Fletcher's two sums in four lanes of 64-bit words), timed alone over a buffer: what it adds to a save or
// a restore of that many bytes. Usage: state_checksum BYTES [PASSES]; prints the best pass in ms and GB/s.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char ** argv) {
    const size_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t) 100 << 20;
    const int passes = argc > 2 ? atoi(argv[2]) : 7;
    uint8_t * buf = malloc(n + 32);
    for (size_t i = 0; i < n; ++i) {
        buf[i] = (uint8_t) ((i * 2654435761u) >> 13);
    }
    double best = 1e30;
    uint64_t keep = 0;
    for (int p = 0; p < passes; ++p) {
        const double t0 = now_s();
        uint64_t a[4] = {0}, b[4] = {0};
        size_t i = 0;
        for (; i + 32 <= n; i += 32) {
            uint64_t w[4];
            memcpy(w, buf + i, sizeof(w));
            for (int l = 0; l < 4; ++l) {
                a[l] += w[l];
                b[l] += a[l];
            }
        }
        keep ^= a[0] + 3*a[1] + 5*a[2] + 7*a[3] + b[0] + 3*b[1] + 5*b[2] + 7*b[3] + i;
        const double dt = now_s() - t0;
        best = dt < best ? dt : best;
    }
    printf("%.3f ms, %.2f GB/s (%zu bytes, best of %d; %llx)\n", 1e3 * best, n / best / 1e9, n, passes,
           (unsigned long long) keep);
    free(buf);
    return 0;
}
