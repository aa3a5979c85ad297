// The GPU's copy bandwidth (the sparq-cpp GPU check): device-to-device copies of one buffer, counting the bytes
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
