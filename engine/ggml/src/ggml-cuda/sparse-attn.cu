// GGML_OP_SPARSE_ATTN on CUDA: SparQ and Loki sparse attention (the algorithm of the CPU kernel in ggml-cpu/sparse-attn.cpp).
//
// Per query row (one token of one sequence) and kv head h with its group of g query heads:
//
//   1. prepare  (grid: kv head x row)
//        SparQ: the r components with the largest sum_j |q_j| over the group (ties: the lower index), and each query
//        head's r components scaled by scale*sqrt(|q_j|_1/|q_j[comp]|_1); Loki: the first d components times scale
//   2. score    (grid: chunk of CHUNK cells x kv head x row)
//        approximate scores of the visible cells (SparQ: r rows of the transposed copy kt, read coalesced; Loki: the
//        d-prefix of each K row), written to scratch, and per chunk and query head the max and sum of exp(score - max)
//   2b. vsum    (only for the mean value without a vmean tensor) the sum of V over each chunk's visible cells
//   3. select   (3a-3c grid: tile of cells x kv head x row; 3d: kv head x row, one block)
//        the softmax over all visible cells from the chunk statistics, s = sum_j softmax_j, then the n_local most
//        recent visible cells (by position, then cell) and the top (top_k - n_local) of the others by (s, position,
//        cell), the cells at positions below n_sink first (their key is the largest), both by a deterministic radix
//        select: two 11-bit digits of s and one of the distance to the largest position by histograms over the
//        whole grid (global atomics on integer counts), then the candidates that these leave (about top_k and n_local) finished by one block; the selection is written in cell order, with
//        alpha_j = the approximate mass it holds (details above sparse_attn_sel_keys)
//   4. attend   (grid: split of the selection x kv head x row)
//        exact attention of the whole group over a slice of the selected rows: each K and V row is read from global
//        memory once per kv head and converted once (fattn-common.cuh's dequantizers), then used by all g heads
//   5. combine  (grid: query head x row) merges the slices (flash-decoding style), mixes in the mean of V
//
// Every value is computed in a fixed order (no float atomics), so the result is deterministic. Scratch comes from
// the pool, nothing is copied to the host, so the op can be captured in a CUDA graph.

#include "sparse-attn.cuh"
#include "fattn-common.cuh"

#define SPARSE_ATTN_CHUNK          256   // kv cells per scoring block
#define SPARSE_ATTN_SCORE_THREADS  128   // SPARSE_ATTN_CHUNK/2 cells per thread
#define SPARSE_ATTN_SELECT_THREADS 512
#define SPARSE_ATTN_TILE_THREADS   256   // the selection's tile kernels
#define SPARSE_ATTN_SEL_TILE_MAX   4096  // kv cells per tile of the selection (at least SPARSE_ATTN_TILE_THREADS)
// the selection's state per (kv head, row): three histograms of 11-bit digits, then the counters
#define SPARSE_ATTN_SEL_BINS       2048
#define SPARSE_ATTN_SEL_H0         0
#define SPARSE_ATTN_SEL_H1         SPARSE_ATTN_SEL_BINS
#define SPARSE_ATTN_SEL_HL         (2*SPARSE_ATTN_SEL_BINS)
#define SPARSE_ATTN_SEL_CNT        (3*SPARSE_ATTN_SEL_BINS)   // n_vis, n_valid, largest position key, n TC, n LC, LC's bin
#define SPARSE_ATTN_SEL_STATE_INTS (3*SPARSE_ATTN_SEL_BINS + 8)
#define SPARSE_ATTN_ATTEND_THREADS 128
#define SPARSE_ATTN_COMBINE_THREADS 128
#define SPARSE_ATTN_PREP_THREADS   256
#define SPARSE_ATTN_MAX_G          32    // query heads per kv head
#define SPARSE_ATTN_MAX_D          512   // head size (DK and DV)
#define SPARSE_ATTN_SMEM_MAX       (48*1024)
#ifndef SPARSE_ATTN_SCRATCH_ROWS_BYTES
#define SPARSE_ATTN_SCRATCH_ROWS_BYTES (256ull*1024*1024) // scratch per launch group of rows (at least one row)
#endif

static_assert(SPARSE_ATTN_CHUNK == 2*SPARSE_ATTN_SCORE_THREADS, "two cells per scoring thread");

// f16 bits of -INF: the mask value of a cell that is not visible (the CPU kernel compares the same bits)
#define SPARSE_ATTN_MASK_NINF 0xFC00u

struct sparse_attn_params {
    const char * q;
    const char * k;
    const char * kt;
    const char * v;
    const char * mask;
    const char * pos;
    const char * vmean;
    char       * dst;

    size_t nbq1, nbq2, nbq3;
    size_t nbk1, nbk2, nbk3;
    size_t nbkt1, nbkt2, nbkt3;
    size_t nbv1, nbv2, nbv3;
    size_t nbm1, nbm3;
    size_t nbp1;
    size_t nbvm1, nbvm2, nbvm3;
    size_t nbd1, nbd2, nbd3;

    int mask_ne3;
    int pos_ne1;

    int DK, DV, n_kv, n_batch, n_head, n_head_kv, g;

    float scale;
    int   r;          // SparQ's r, Loki's d
    int   r_pad;      // length of a query head's row of scaled components (Loki: d rounded up to 2, zero padded)
    int   top_k;
    int   n_local;
    int   n_sink;     // positions below this rank above every other (their key is the largest)
    int   mean_value;
    int   rank;       // enum ggml_sparse_attn_rank

    int row0;         // first row (iq3*n_batch + iq1) of this launch group
    int n_chunk;      // scoring chunks
    int n_sel_max;    // min(top_k, n_kv)
    int split;        // selected rows per block of the exact attention
    int n_split;
    int sel_tile;     // kv cells per block of the selection's tile kernels (a multiple of SPARSE_ATTN_TILE_THREADS)
    int n_tile;
    int n_words;      // 32-bit words of a bitmap over the cells
    int kt_vec;       // kt's rows and strides allow loads of two adjacent cells
};

struct sparse_attn_row {
    int iq1;
    int iq3;
};

static __device__ __forceinline__ sparse_attn_row sparse_attn_row_of(const sparse_attn_params & p, const int rl) {
    const int row = p.row0 + rl;
    return { row % p.n_batch, row / p.n_batch };
}

static __device__ __forceinline__ const uint16_t * sparse_attn_mask_row(const sparse_attn_params & p, const sparse_attn_row rw) {
    return (const uint16_t *) (p.mask + rw.iq1*p.nbm1 + (rw.iq3 % p.mask_ne3)*p.nbm3);
}

static __device__ __forceinline__ const int32_t * sparse_attn_pos_row(const sparse_attn_params & p, const sparse_attn_row rw) {
    return (const int32_t *) (p.pos + (rw.iq3 % p.pos_ne1)*p.nbp1);
}

static __device__ __forceinline__ const float * sparse_attn_q_row(const sparse_attn_params & p, const sparse_attn_row rw, const int hq) {
    return (const float *) (p.q + rw.iq1*p.nbq1 + hq*p.nbq2 + rw.iq3*p.nbq3);
}

static __device__ __forceinline__ float sparse_attn_to_f32(const half x) {
    return __half2float(x);
}

static __device__ __forceinline__ float sparse_attn_to_f32(const float x) {
    return x;
}

// cells i and i + 1 (i even) of a row of kt, in one load (kt_vec: the row is aligned to two cells)
static __device__ __forceinline__ float2 sparse_attn_load_pair(const half * row, const int i) {
    return __half22float2(*(const half2 *) (row + i));
}

static __device__ __forceinline__ float2 sparse_attn_load_pair(const float * row, const int i) {
    return *(const float2 *) (row + i);
}

// elements i0 and i0 + 1 (i0 even) of a K or V row as f32, with the dequantizers of the flash attention kernels
template <ggml_type type>
static __device__ __forceinline__ float2 sparse_attn_load2(const char * __restrict__ row, const int i0) {
    if constexpr (type == GGML_TYPE_F32) {
        const float * x = (const float *) row;
        return make_float2(x[i0 + 0], x[i0 + 1]);
    } else {
        float2 res;
        constexpr dequantize_V_t dequantize = get_dequantize_V<type, float, 2>();
        dequantize(row, &res, i0);
        return res;
    }
}

// ------------------------------------------------------------------------------------------------------------------
// 1. prepare: the ranking components and the scaled query components of every query head of the group

static __global__ void __launch_bounds__(SPARSE_ATTN_PREP_THREADS) sparse_attn_prepare(
        const sparse_attn_params p, int * __restrict__ comp, float * __restrict__ qsel, int * __restrict__ state) {
    const int h  = blockIdx.x;
    const int rl = blockIdx.y;
    const int g  = p.g;
    const int DK = p.DK;

    const int tid   = threadIdx.x;
    const int lane  = tid % WARP_SIZE;
    const int warp  = tid / WARP_SIZE;
    const int nwarp = blockDim.x / WARP_SIZE;

    const sparse_attn_row rw = sparse_attn_row_of(p, rl);

    float * qs = qsel + ((size_t) rl*p.n_head + (size_t) h*g)*p.r_pad;

    // the selection's histograms and counters, added to by its tile kernels
    int * st = state + ((size_t) rl*p.n_head_kv + h)*SPARSE_ATTN_SEL_STATE_INTS;
    for (int t = tid; t < SPARSE_ATTN_SEL_STATE_INTS; t += blockDim.x) {
        st[t] = 0;
    }

    if (p.rank == GGML_SPARSE_ATTN_RANK_LOKI) {
        // q is in the principal basis already: its first d components
        for (int t = tid; t < g*p.r_pad; t += blockDim.x) {
            const int j = t / p.r_pad;
            const int c = t % p.r_pad;
            qs[t] = c < p.r ? sparse_attn_q_row(p, rw, h*g + j)[c]*p.scale : 0.0f;
        }
        return;
    }

    extern __shared__ float sparse_attn_prep_smem[];
    float * asum = sparse_attn_prep_smem;          // [DK]
    int   * flag = (int *) (asum + DK);           // [DK]
    int   * cs   = flag + DK;                     // [DK]

    for (int d = tid; d < DK; d += blockDim.x) {
        float s = 0.0f;
        for (int j = 0; j < g; ++j) {
            s += fabsf(sparse_attn_q_row(p, rw, h*g + j)[d]);
        }
        asum[d] = s;
    }
    __syncthreads();

    // component d is taken if fewer than r components come before it (a larger sum, or an equal sum and a lower index)
    for (int d = tid; d < DK; d += blockDim.x) {
        const float a = asum[d];
        int n_before = 0;
        for (int e = 0; e < DK; ++e) {
            const float b = asum[e];
            n_before += b > a || (b == a && e < d);
        }
        flag[d] = n_before < p.r;
    }
    __syncthreads();

    if (tid == 0) {
        int n = 0;
        for (int d = 0; d < DK && n < p.r; ++d) {
            if (flag[d]) {
                cs[n++] = d;
            }
        }
        // only with sums that are NaN: fill up with the first components not taken
        for (int d = 0; d < DK && n < p.r; ++d) {
            if (!flag[d]) {
                cs[n++] = d;
            }
        }
    }
    __syncthreads();

    int * cr = comp + ((size_t) rl*p.n_head_kv + h)*DK;
    for (int c = tid; c < p.r; c += blockDim.x) {
        cr[c] = cs[c];
    }

    for (int j = warp; j < g; j += nwarp) {
        const float * qj = sparse_attn_q_row(p, rw, h*g + j);
        float l1  = 0.0f;
        float l1s = 0.0f;
        for (int d = lane; d < DK; d += WARP_SIZE) {
            l1 += fabsf(qj[d]);
        }
        for (int c = lane; c < p.r; c += WARP_SIZE) {
            l1s += fabsf(qj[cs[c]]);
        }
        l1  = warp_reduce_sum(l1);
        l1s = warp_reduce_sum(l1s);

        const float s = l1s > 0.0f ? p.scale*sqrtf(l1/l1s) : 0.0f;
        for (int c = lane; c < p.r_pad; c += WARP_SIZE) {
            qs[j*p.r_pad + c] = c < p.r ? qj[cs[c]]*s : 0.0f;
        }
    }
}

// ------------------------------------------------------------------------------------------------------------------
// 2. score: approximate scores of a chunk of cells for the g query heads of kv head h, and the chunk statistics

template <int rank, typename kt_t, ggml_type type_K>
static __global__ void __launch_bounds__(SPARSE_ATTN_SCORE_THREADS) sparse_attn_score(
        const sparse_attn_params p, const int * __restrict__ comp, const float * __restrict__ qsel,
        float * __restrict__ scores, float2 * __restrict__ stats) {
    constexpr int GS = 8; // query heads scored per pass over the chunk

    const int chunk = blockIdx.x;
    const int h     = blockIdx.y;
    const int rl    = blockIdx.z;
    const int g     = p.g;
    const int tid   = threadIdx.x;

    extern __shared__ float sparse_attn_score_smem[];
    float * qs = sparse_attn_score_smem;      // [g][r_pad]
    int   * cs = (int *) (qs + g*p.r_pad);   // [r] (SparQ)
    __shared__ float red[WARP_SIZE];

    const float * qsrc = qsel + ((size_t) rl*p.n_head + (size_t) h*g)*p.r_pad;
    for (int t = tid; t < g*p.r_pad; t += blockDim.x) {
        qs[t] = qsrc[t];
    }
    if constexpr (rank == GGML_SPARSE_ATTN_RANK_SPARQ) {
        const int * csrc = comp + ((size_t) rl*p.n_head_kv + h)*p.DK;
        for (int t = tid; t < p.r; t += blockDim.x) {
            cs[t] = csrc[t];
        }
    }
    __syncthreads();

    const sparse_attn_row rw = sparse_attn_row_of(p, rl);
    const uint16_t * mrow = sparse_attn_mask_row(p, rw);

    // SparQ: two adjacent cells per thread, one load of both from each row of kt; Loki: cells tid and tid + 128 (each
    // thread reads whole K rows)
    int  ic[2];
    bool vis[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        ic[u]  = chunk*SPARSE_ATTN_CHUNK + (rank == GGML_SPARSE_ATTN_RANK_SPARQ ? 2*tid + u : u*SPARSE_ATTN_SCORE_THREADS + tid);
        vis[u] = ic[u] < p.n_kv && mrow[ic[u]] != SPARSE_ATTN_MASK_NINF;
    }
    const bool pair = p.kt_vec && ic[1] < p.n_kv;

    float * sc = scores + ((size_t) rl*p.n_head + (size_t) h*g)*p.n_kv;
    float2 * st = stats + ((size_t) rl*p.n_head + (size_t) h*g)*p.n_chunk + chunk;

    for (int j0 = 0; j0 < g; j0 += GS) {
        float acc[2][GS];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
#pragma unroll
            for (int jj = 0; jj < GS; ++jj) {
                acc[u][jj] = 0.0f;
            }
        }

        if constexpr (rank == GGML_SPARSE_ATTN_RANK_SPARQ) {
            // r rows of kt: consecutive threads read consecutive cells
            const char * ktb = p.kt + h*p.nbkt2 + rw.iq3*p.nbkt3;
#pragma unroll 4
            for (int c = 0; c < p.r; ++c) {
                const kt_t * row = (const kt_t *) (ktb + (size_t) cs[c]*p.nbkt1);
                float x[2];
                if (pair) {
                    const float2 xx = sparse_attn_load_pair(row, ic[0]);
                    x[0] = xx.x;
                    x[1] = xx.y;
                } else {
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        x[u] = ic[u] < p.n_kv ? sparse_attn_to_f32(row[ic[u]]) : 0.0f;
                    }
                }
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    x[u] = vis[u] ? x[u] : 0.0f;
                }
#pragma unroll
                for (int jj = 0; jj < GS; ++jj) {
                    if (j0 + jj < g) {
                        const float w = qs[(j0 + jj)*p.r_pad + c];
#pragma unroll
                        for (int u = 0; u < 2; ++u) {
                            acc[u][jj] += w*x[u];
                        }
                    }
                }
            }
        } else {
            // the d-prefix of each K row
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                if (!vis[u]) {
                    continue;
                }
                const char * krow = p.k + (size_t) ic[u]*p.nbk1 + h*p.nbk2 + rw.iq3*p.nbk3;
                for (int c = 0; c < p.r; c += 2) {
                    const float2 x = sparse_attn_load2<type_K>(krow, c);
#pragma unroll
                    for (int jj = 0; jj < GS; ++jj) {
                        if (j0 + jj < g) {
                            const float * w = qs + (j0 + jj)*p.r_pad + c;
                            acc[u][jj] += w[0]*x.x + w[1]*x.y; // w[1] is 0 past d
                        }
                    }
                }
            }
        }

#pragma unroll
        for (int jj = 0; jj < GS; ++jj) {
            const int j = j0 + jj;
            if (j >= g) {
                break;
            }
            float s[2];
            float m = -INFINITY;
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                s[u] = vis[u] ? acc[u][jj] : -INFINITY;
                if (ic[u] < p.n_kv) {
                    sc[(size_t) j*p.n_kv + ic[u]] = s[u];
                }
                m = fmaxf(m, s[u]);
            }
            m = block_reduce<block_reduce_method::MAX, SPARSE_ATTN_SCORE_THREADS>(m, red);
            __syncthreads();
            float z = 0.0f;
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                z += vis[u] ? expf(s[u] - m) : 0.0f;
            }
            z = block_reduce<block_reduce_method::SUM, SPARSE_ATTN_SCORE_THREADS>(z, red);
            __syncthreads();
            if (tid == 0) {
                st[(size_t) j*p.n_chunk] = make_float2(m, z);
            }
        }
    }
}

// 2b. the sum of V over the visible cells of a chunk (mean value without a vmean tensor)
template <ggml_type type_V>
static __global__ void __launch_bounds__(SPARSE_ATTN_SCORE_THREADS) sparse_attn_vsum(const sparse_attn_params p, float * __restrict__ vpart) {
    const int chunk = blockIdx.x;
    const int h     = blockIdx.y;
    const int rl    = blockIdx.z;
    const int tid   = threadIdx.x;

    __shared__ int vis[SPARSE_ATTN_CHUNK];

    const sparse_attn_row rw = sparse_attn_row_of(p, rl);
    const uint16_t * mrow = sparse_attn_mask_row(p, rw);

    for (int c = tid; c < SPARSE_ATTN_CHUNK; c += blockDim.x) {
        const int i = chunk*SPARSE_ATTN_CHUNK + c;
        vis[c] = i < p.n_kv && mrow[i] != SPARSE_ATTN_MASK_NINF;
    }
    __syncthreads();

    const char * vb = p.v + h*p.nbv2 + rw.iq3*p.nbv3;
    float * dst = vpart + (((size_t) rl*p.n_head_kv + h)*p.n_chunk + chunk)*p.DV;

    for (int d = 2*tid; d < p.DV; d += 2*blockDim.x) {
        float2 s = make_float2(0.0f, 0.0f);
        for (int c = 0; c < SPARSE_ATTN_CHUNK; ++c) {
            if (vis[c]) {
                const float2 x = sparse_attn_load2<type_V>(vb + (size_t) (chunk*SPARSE_ATTN_CHUNK + c)*p.nbv1, d);
                s.x += x.x;
                s.y += x.y;
            }
        }
        dst[d + 0] = s.x;
        dst[d + 1] = s.y;
    }
}

// ------------------------------------------------------------------------------------------------------------------
// 3. select

// lexicographic a >= b over NW words
template <int NW>
static __device__ __forceinline__ bool sparse_attn_key_ge(const uint32_t * a, const uint32_t * b) {
#pragma unroll
    for (int w = 0; w < NW; ++w) {
        if (a[w] != b[w]) {
            return a[w] > b[w];
        }
    }
    return true;
}

// the k-th largest composite key (NW 32-bit words, the first the most significant) of the elements i < n for
// which get(i, key) is true, by radix select: one 8-bit digit per pass, a histogram of the digit over the elements
// that match the digits found so far, the digit of the k-th from the top. Keys are distinct in their last word, so the
// elements >= res are exactly k. When the matching elements of the chosen digit are exactly the ones still needed,
// the lower digits stay 0. Every thread returns the same res. Integer counts only: deterministic.
template <int NW, typename F>
static __device__ void sparse_attn_kth_largest(const F & get, const int n, int k, uint32_t * res, int * hist, int * sh) {
    const int tid  = threadIdx.x;
    const int lane = tid % WARP_SIZE;
    const int warp = tid / WARP_SIZE;

    uint32_t pre[NW];
    uint32_t msk[NW];
#pragma unroll
    for (int w = 0; w < NW; ++w) {
        pre[w] = 0;
        msk[w] = 0;
    }

    bool done = false;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
        for (int shift = 24; shift >= 0 && !done; shift -= 8) {
            for (int b = tid; b < 256; b += blockDim.x) {
                hist[b] = 0;
            }
            __syncthreads();

            // whole warps per step: most elements fall into few bins in the first digits, so the lanes of a warp
            // that count the same bin add once (shared atomics on one address are serialized)
            for (int i0 = 0; i0 < n; i0 += blockDim.x) {
                const int i = i0 + tid;
                uint32_t x[NW];
                bool match = i < n && get(i, x);
#pragma unroll
                for (int ww = 0; ww < NW; ++ww) {
                    match = match && (x[ww] & msk[ww]) == pre[ww];
                }
                const int bin = match ? (int) ((x[w] >> shift) & 0xFF) : -1;
#if __CUDA_ARCH__ >= GGML_CUDA_CC_VOLTA
                const unsigned same = __match_any_sync(0xFFFFFFFF, bin);
                if (match && lane == __ffs(same) - 1) {
                    atomicAdd(&hist[bin], __popc(same));
                }
#else
                if (match) {
                    atomicAdd(&hist[bin], 1);
                }
#endif // __CUDA_ARCH__ >= GGML_CUDA_CC_VOLTA
            }
            __syncthreads();

            if (warp == 0) {
                // lane l holds bins 255 - 8*l down to 248 - 8*l
                int c[8];
                int tot = 0;
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    c[u] = hist[255 - 8*lane - u];
                    tot += c[u];
                }
                const int incl = warp_prefix_inclusive_sum<int>(tot);
                const unsigned bal = __ballot_sync(0xFFFFFFFF, incl >= k);
                if (bal == 0) {
                    // fewer than k elements match (not reached with a consistent k): take them all
                    if (lane == 0) {
                        sh[0] = 0;
                        sh[1] = 0;
                        sh[2] = -1;
                    }
                } else if (lane == __ffs(bal) - 1) {
                    int above = incl - tot;
#pragma unroll
                    for (int u = 0; u < 8; ++u) {
                        if (above + c[u] >= k) {
                            sh[0] = 255 - 8*lane - u;
                            sh[1] = above;
                            sh[2] = c[u];
                            break;
                        }
                        above += c[u];
                    }
                }
            }
            __syncthreads();

            const int b     = sh[0];
            const int above = sh[1];
            const int cnt   = sh[2];
            if (cnt < 0) {
#pragma unroll
                for (int ww = 0; ww < NW; ++ww) {
                    pre[ww] = 0;
                }
                done = true;
                break;
            }
            pre[w] |= (uint32_t) b << shift;
            msk[w] |= 0xFFu << shift;
            k -= above;
            done = cnt == k;
        }
    }

#pragma unroll
    for (int w = 0; w < NW; ++w) {
        res[w] = pre[w];
    }
    __syncthreads(); // hist and sh are reused
}

// key of a visible cell: 0 not visible, 1 visible with a score that is NaN, else 2 + the bits of s (s >= 0, so the
// bits order like the values)
static __device__ __forceinline__ uint32_t sparse_attn_score_key(const float s) {
    const uint32_t u = __float_as_uint(s);
    return u > 0x7F800000u ? 1u : u + 2u;
}

// a cell's position as an unsigned word that orders like the signed position
static __device__ __forceinline__ uint32_t sparse_attn_pos_key(const int32_t pos) {
    return (uint32_t) pos ^ 0x80000000u;
}

// the softmax over the visible cells, per query head of the group, from the chunk statistics: max and 1/sum
static __device__ void sparse_attn_softmax_factors(const sparse_attn_params & p, const float2 * __restrict__ stats,
        const int h, const int rl, float * sM, float * siZ) {
    const int lane  = threadIdx.x % WARP_SIZE;
    const int warp  = threadIdx.x / WARP_SIZE;
    const int nwarp = blockDim.x / WARP_SIZE;
    for (int j = warp; j < p.g; j += nwarp) {
        const float2 * st = stats + ((size_t) rl*p.n_head + (size_t) h*p.g + j)*p.n_chunk;
        float m = -INFINITY;
        for (int c = lane; c < p.n_chunk; c += WARP_SIZE) {
            if (st[c].y > 0.0f) {
                m = fmaxf(m, st[c].x);
            }
        }
        m = warp_reduce_max(m);
        float z = 0.0f;
        for (int c = lane; c < p.n_chunk; c += WARP_SIZE) {
            if (st[c].y > 0.0f) {
                z += st[c].y*expf(st[c].x - m);
            }
        }
        z = warp_reduce_sum(z);
        if (lane == 0) {
            sM[j]  = m;
            siZ[j] = z > 0.0f ? 1.0f/z : 0.0f;
        }
    }
    __syncthreads();
}

// The selection is split over the whole grid (tile kernels: tiles of sel_tile cells x kv head x row), so that one
// row at batch 1 fills the GPU, with a global histogram of 11-bit digits per (kv head, row) in scratch (state):
//
//   3a. keys    s = sum_j softmax_j of every visible cell as a key, the visibility bitmap, the counts of visible
//               cells and of cells with a score that is not NaN ("valid"), the largest position, and the histogram
//               H0 of the key's bits 31..21 over the valid cells
//   3b. hist    the boundary bin b0 of the M-th largest valid key (M = min(top_k, n_valid)) from H0, the histogram
//               H1 of bits 20..10 over the valid cells of bin b0; the histogram HL of the distance to the largest
//               position (2047 and above in one bin) over the visible cells
//   3c. gather  the cells whose 22-bit key prefix is at least that of the M-th largest (TC: the top M and the
//               boundary bin's cells), and the visible cells no farther from the largest position than the n_local-th
//               nearest (LC), appended to two lists (in no particular order: nothing later depends on it)
//   3d. select  (one block per kv head and row) over the lists only: the n_local most recent visible cells
//               (position, cell) from LC, the top n_top of the valid others by (key, position, cell) from TC, both by
//               the block radix select; marked in a bitmap and written in cell order, alpha_j
//
// TC holds the top n_top of the cells that are not local: each of those has fewer than n_top others and at most n_local
// local cells above it, and n_top + n_local <= top_k. Integer counts only: every result is deterministic, whatever
// the order of the atomics.

static_assert(SPARSE_ATTN_SEL_BINS == 8*SPARSE_ATTN_TILE_THREADS, "8 bins per thread in sparse_attn_pick");

// the bin of the k-th largest element of a global histogram (bins in increasing order of their elements), 1 <= k <= its
// total: sh[0] the bin, sh[1] the elements in higher bins, sh[2] those in the bin. sh holds WARP_SIZE + 3 ints.
static __device__ void sparse_attn_pick(const int * __restrict__ hist, const int k, int * sh) {
    const int tid  = threadIdx.x;
    const int lane = tid % WARP_SIZE;
    const int warp = tid / WARP_SIZE;
    constexpr int nwarp = SPARSE_ATTN_TILE_THREADS/WARP_SIZE;

    // thread t holds bins 2047 - 8*t down to 2040 - 8*t
    int c[8];
    int tot = 0;
#pragma unroll
    for (int u = 0; u < 8; ++u) {
        c[u] = hist[SPARSE_ATTN_SEL_BINS - 1 - 8*tid - u];
        tot += c[u];
    }
    int incl = warp_prefix_inclusive_sum<int>(tot);
    if (lane == WARP_SIZE - 1) {
        sh[3 + warp] = incl;
    }
    if (tid == 0) {
        sh[0] = 0;
        sh[1] = 0;
        sh[2] = 0;
    }
    __syncthreads();
    if (warp == 0) {
        const int v  = lane < nwarp ? sh[3 + lane] : 0;
        const int vi = warp_prefix_inclusive_sum<int>(v);
        if (lane < nwarp) {
            sh[3 + lane] = vi - v;
        }
    }
    __syncthreads();
    incl += sh[3 + warp];
    int above = incl - tot;
    if (above < k && incl >= k) {
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            if (above + c[u] >= k) {
                sh[0] = SPARSE_ATTN_SEL_BINS - 1 - 8*tid - u;
                sh[1] = above;
                sh[2] = c[u];
                break;
            }
            above += c[u];
        }
    }
    __syncthreads();
}

// adds a shared histogram to the global one (only the bins that are not 0)
static __device__ __forceinline__ void sparse_attn_hist_flush(const int * hist, int * __restrict__ ghist) {
    for (int b = threadIdx.x; b < SPARSE_ATTN_SEL_BINS; b += blockDim.x) {
        if (hist[b] != 0) {
            atomicAdd(&ghist[b], hist[b]);
        }
    }
}

// counts bin (-1: nothing) in a shared histogram, once per group of lanes of the warp with the same bin
static __device__ __forceinline__ void sparse_attn_hist_add(int * hist, const int bin) {
#if __CUDA_ARCH__ >= GGML_CUDA_CC_VOLTA
    const int lane = threadIdx.x % WARP_SIZE;
    const unsigned same = __match_any_sync(0xFFFFFFFF, bin);
    if (bin >= 0 && lane == __ffs(same) - 1) {
        atomicAdd(&hist[bin], __popc(same));
    }
#else
    if (bin >= 0) {
        atomicAdd(&hist[bin], 1);
    }
#endif // __CUDA_ARCH__ >= GGML_CUDA_CC_VOLTA
}

// appends i to a global list when pred (all lanes of the warp call it): one atomic per warp
static __device__ __forceinline__ void sparse_attn_append(const bool pred, const int i, int * __restrict__ count, int * __restrict__ list) {
    const int lane = threadIdx.x % WARP_SIZE;
    const unsigned b = __ballot_sync(0xFFFFFFFF, pred);
    int base = 0;
    if (lane == 0 && b != 0) {
        base = atomicAdd(count, __popc(b));
    }
    base = __shfl_sync(0xFFFFFFFF, base, 0);
    if (pred) {
        list[base + __popc(b & ((1u << lane) - 1u))] = i;
    }
}

static __device__ __forceinline__ int * sparse_attn_sel_state(const sparse_attn_params & p, int * state, const int h, const int rl) {
    return state + ((size_t) rl*p.n_head_kv + h)*SPARSE_ATTN_SEL_STATE_INTS;
}

// the bin of a visible cell in the local window's histogram: 2047 - its distance to the largest position pmax (a key),
// all at a distance of 2047 or more in bin 0: nearer, a higher bin
static __device__ __forceinline__ int sparse_attn_near_bin(const uint32_t pmax, const int32_t pos) {
    const uint32_t d = pmax - sparse_attn_pos_key(pos);
    return SPARSE_ATTN_SEL_BINS - 1 - (int) min(d, (uint32_t) SPARSE_ATTN_SEL_BINS - 1);
}

// M: the number of top valid cells that TC must hold (0: no top cells to select)
static __device__ __forceinline__ int sparse_attn_sel_m(const sparse_attn_params & p, const int n_valid) {
    return p.top_k > p.n_local ? min(p.top_k, n_valid) : 0;
}

// 3a
static __global__ void __launch_bounds__(SPARSE_ATTN_TILE_THREADS) sparse_attn_sel_keys(
        const sparse_attn_params p, const float * __restrict__ scores, const float2 * __restrict__ stats,
        uint32_t * __restrict__ keys, uint32_t * __restrict__ bits, int * __restrict__ state, float2 * __restrict__ smz) {
    const int tile = blockIdx.x;
    const int h    = blockIdx.y;
    const int rl   = blockIdx.z;
    const int g    = p.g;
    const int tid  = threadIdx.x;
    const int lane = tid % WARP_SIZE;

    __shared__ float sM[SPARSE_ATTN_MAX_G];
    __shared__ float siZ[SPARSE_ATTN_MAX_G];
    __shared__ int   hist[SPARSE_ATTN_SEL_BINS];
    __shared__ int   redi[WARP_SIZE];

    for (int b = tid; b < SPARSE_ATTN_SEL_BINS; b += blockDim.x) {
        hist[b] = 0;
    }
    sparse_attn_softmax_factors(p, stats, h, rl, sM, siZ); // ends with a barrier
    if (tile == 0 && tid < g) {
        smz[(size_t) rl*p.n_head + (size_t) h*g + tid] = make_float2(sM[tid], siZ[tid]);
    }

    const sparse_attn_row rw = sparse_attn_row_of(p, rl);
    const uint16_t * mrow = sparse_attn_mask_row(p, rw);
    const int32_t  * prow = sparse_attn_pos_row(p, rw);

    const int     n_kv = p.n_kv;
    const float * sc   = scores + ((size_t) rl*p.n_head + (size_t) h*g)*n_kv;
    uint32_t    * key  = keys   + ((size_t) rl*p.n_head_kv + h)*n_kv;
    uint32_t    * vbit = bits   + ((size_t) rl*p.n_head_kv + h)*2*p.n_words;
    uint32_t    * sbit = vbit + p.n_words;
    int         * st   = sparse_attn_sel_state(p, state, h, rl);

    int      nv = 0;
    int      nd = 0;
    uint32_t pm = 0;
    // a whole number of warps of 32 consecutive cells per step: each warp writes its bitmap word
    for (int i = tile*p.sel_tile + tid; i < (tile + 1)*p.sel_tile; i += blockDim.x) {
        uint32_t kk = 0;
        const bool vis = i < n_kv && mrow[i] != SPARSE_ATTN_MASK_NINF;
        if (vis) {
            float s = 0.0f;
            for (int j = 0; j < g; ++j) {
                s += expf(sc[(size_t) j*n_kv + i] - sM[j])*siZ[j];
            }
            kk = prow[i] < p.n_sink ? 0xFFFFFFFFu : sparse_attn_score_key(s);
            nv++;
            nd += kk >= 2;
            pm = max(pm, sparse_attn_pos_key(prow[i]));
        }
        if (i < n_kv) {
            key[i] = kk;
        }
        const unsigned vb = __ballot_sync(0xFFFFFFFF, vis);
        if (lane == 0 && (i >> 5) < p.n_words) {
            vbit[i >> 5] = vb;
            sbit[i >> 5] = 0;
        }
        sparse_attn_hist_add(hist, kk >= 2 ? (int) (kk >> 21) : -1);
    }
    __syncthreads();
    sparse_attn_hist_flush(hist, st + SPARSE_ATTN_SEL_H0);

    nv = block_reduce<block_reduce_method::SUM, SPARSE_ATTN_TILE_THREADS>(nv, redi);
    __syncthreads();
    nd = block_reduce<block_reduce_method::SUM, SPARSE_ATTN_TILE_THREADS>(nd, redi);
#pragma unroll
    for (int o = WARP_SIZE/2; o > 0; o >>= 1) {
        pm = max(pm, __shfl_xor_sync(0xFFFFFFFF, pm, o, WARP_SIZE));
    }
    if (tid == 0) {
        if (nv > 0) {
            atomicAdd(&st[SPARSE_ATTN_SEL_CNT + 0], nv);
        }
        if (nd > 0) {
            atomicAdd(&st[SPARSE_ATTN_SEL_CNT + 1], nd);
        }
    }
    if (lane == 0 && pm != 0) {
        atomicMax((unsigned int *) &st[SPARSE_ATTN_SEL_CNT + 2], pm);
    }
}

// 3b
static __global__ void __launch_bounds__(SPARSE_ATTN_TILE_THREADS) sparse_attn_sel_hist(
        const sparse_attn_params p, const uint32_t * __restrict__ keys, int * __restrict__ state) {
    const int tile = blockIdx.x;
    const int h    = blockIdx.y;
    const int rl   = blockIdx.z;
    const int tid  = threadIdx.x;

    __shared__ int hist1[SPARSE_ATTN_SEL_BINS];
    __shared__ int histl[SPARSE_ATTN_SEL_BINS];
    __shared__ int sh[WARP_SIZE + 3];

    int * st = sparse_attn_sel_state(p, state, h, rl);
    const int n_vis   = st[SPARSE_ATTN_SEL_CNT + 0];
    const int n_valid = st[SPARSE_ATTN_SEL_CNT + 1];
    if (n_vis <= p.top_k) {
        return; // all visible cells are selected (or none is visible)
    }
    const int M = sparse_attn_sel_m(p, n_valid);
    const bool has_local = p.n_local > 0;
    const uint32_t pmax = (uint32_t) st[SPARSE_ATTN_SEL_CNT + 2];

    int b0 = -1;
    if (M > 0) {
        sparse_attn_pick(st + SPARSE_ATTN_SEL_H0, M, sh);
        b0 = sh[0];
    }
    for (int b = tid; b < SPARSE_ATTN_SEL_BINS; b += blockDim.x) {
        hist1[b] = 0;
        histl[b] = 0;
    }
    __syncthreads();

    const sparse_attn_row rw = sparse_attn_row_of(p, rl);
    const int32_t  * prow = sparse_attn_pos_row(p, rw);
    const uint32_t * key  = keys + ((size_t) rl*p.n_head_kv + h)*p.n_kv;

    for (int i = tile*p.sel_tile + tid; i < (tile + 1)*p.sel_tile; i += blockDim.x) {
        const uint32_t kk = i < p.n_kv ? key[i] : 0;
        sparse_attn_hist_add(hist1, kk >= 2 && (int) (kk >> 21) == b0 ? (int) ((kk >> 10) & 0x7FF) : -1);
        int bl = -1;
        if (has_local && kk != 0) {
            bl = sparse_attn_near_bin(pmax, prow[i]);
        }
        sparse_attn_hist_add(histl, bl);
    }
    __syncthreads();
    if (M > 0) {
        sparse_attn_hist_flush(hist1, st + SPARSE_ATTN_SEL_H1);
    }
    if (has_local) {
        sparse_attn_hist_flush(histl, st + SPARSE_ATTN_SEL_HL);
    }
}

// 3c
static __global__ void __launch_bounds__(SPARSE_ATTN_TILE_THREADS) sparse_attn_sel_gather(
        const sparse_attn_params p, const uint32_t * __restrict__ keys, int * __restrict__ state,
        int * __restrict__ tc, int * __restrict__ lc) {
    const int tile = blockIdx.x;
    const int h    = blockIdx.y;
    const int rl   = blockIdx.z;
    const int tid  = threadIdx.x;

    __shared__ int sh[WARP_SIZE + 3];

    int * st = sparse_attn_sel_state(p, state, h, rl);
    const int n_vis   = st[SPARSE_ATTN_SEL_CNT + 0];
    const int n_valid = st[SPARSE_ATTN_SEL_CNT + 1];
    if (n_vis <= p.top_k) {
        return;
    }
    const int M = sparse_attn_sel_m(p, n_valid);
    const bool has_local = p.n_local > 0;
    const uint32_t pmax = (uint32_t) st[SPARSE_ATTN_SEL_CNT + 2];

    // the 22-bit key prefix of the M-th largest valid cell
    uint32_t pre = 0xFFFFFFFFu;
    if (M > 0) {
        sparse_attn_pick(st + SPARSE_ATTN_SEL_H0, M, sh);
        const int b0 = sh[0];
        const int a0 = sh[1];
        __syncthreads();
        sparse_attn_pick(st + SPARSE_ATTN_SEL_H1, M - a0, sh);
        pre = ((uint32_t) b0 << 11) | (uint32_t) sh[0];
        __syncthreads();
    }
    // the bin of the n_local-th nearest visible cell
    int bl = SPARSE_ATTN_SEL_BINS;
    if (has_local) {
        sparse_attn_pick(st + SPARSE_ATTN_SEL_HL, p.n_local, sh);
        bl = sh[0];
        if (tile == 0 && tid == 0) {
            st[SPARSE_ATTN_SEL_CNT + 5] = bl; // every block finds the same
        }
    }

    const size_t o = ((size_t) rl*p.n_head_kv + h)*p.n_kv;
    const sparse_attn_row rw = sparse_attn_row_of(p, rl);
    const int32_t  * prow = sparse_attn_pos_row(p, rw);
    const uint32_t * key  = keys + o;

    for (int i = tile*p.sel_tile + tid; i < (tile + 1)*p.sel_tile; i += blockDim.x) {
        const uint32_t kk = i < p.n_kv ? key[i] : 0;
        sparse_attn_append(kk >= 2 && (kk >> 10) >= pre, i, &st[SPARSE_ATTN_SEL_CNT + 3], tc + o);
        bool near = false;
        if (has_local && kk != 0) {
            near = sparse_attn_near_bin(pmax, prow[i]) >= bl;
        }
        sparse_attn_append(near, i, &st[SPARSE_ATTN_SEL_CNT + 4], lc + o);
    }
}

// the cells of the set bits of words[0, n_words), in increasing order, to out; returns their number. Each thread takes
// a contiguous range of words: it counts, one block scan gives its offset, it writes
static __device__ int sparse_attn_compact_bits(const uint32_t * words, const int n_words, int * __restrict__ out, int * sh) {
    const int tid   = threadIdx.x;
    const int lane  = tid % WARP_SIZE;
    const int warp  = tid / WARP_SIZE;
    const int nwarp = blockDim.x / WARP_SIZE;

    const int per = (n_words + blockDim.x - 1)/blockDim.x;
    const int w0  = min(n_words, tid*per);
    const int w1  = min(n_words, w0 + per);

    int c = 0;
    for (int w = w0; w < w1; ++w) {
        c += __popc(words[w]);
    }

    const int incl = warp_prefix_inclusive_sum<int>(c);
    if (lane == WARP_SIZE - 1) {
        sh[warp] = incl;
    }
    __syncthreads();
    if (warp == 0) {
        const int v  = lane < nwarp ? sh[lane] : 0;
        const int vi = warp_prefix_inclusive_sum<int>(v);
        if (lane < nwarp) {
            sh[lane] = vi - v;
        }
        if (lane == WARP_SIZE - 1) {
            sh[WARP_SIZE] = vi;
        }
    }
    __syncthreads();

    int o = sh[warp] + incl - c;
    for (int w = w0; w < w1; ++w) {
        uint32_t m = words[w];
        while (m != 0) {
            out[o++] = w*32 + __ffs(m) - 1;
            m &= m - 1;
        }
    }
    const int total = sh[WARP_SIZE];
    __syncthreads(); // sh is reused
    return total;
}

// 3d
static __global__ void __launch_bounds__(SPARSE_ATTN_SELECT_THREADS) sparse_attn_select(
        const sparse_attn_params p, const float * __restrict__ scores, const float2 * __restrict__ smz,
        const uint32_t * __restrict__ keys, uint32_t * __restrict__ bits, const int * __restrict__ state,
        const int * __restrict__ tc, const int * __restrict__ lc,
        int * __restrict__ sel, int4 * __restrict__ info, float * __restrict__ alpha) {
    const int h  = blockIdx.x;
    const int rl = blockIdx.y;
    const int g  = p.g;
    const int tid = threadIdx.x;

    __shared__ int   hist[256];
    __shared__ int   sh[WARP_SIZE + 1];
    __shared__ int   redi[WARP_SIZE];
    __shared__ float redf[WARP_SIZE];

    const sparse_attn_row rw = sparse_attn_row_of(p, rl);
    const int32_t * prow = sparse_attn_pos_row(p, rw);

    const int       n_kv = p.n_kv;
    const size_t    o    = ((size_t) rl*p.n_head_kv + h)*n_kv;
    const float   * sc   = scores + ((size_t) rl*p.n_head + (size_t) h*g)*n_kv;
    const float2  * mz   = smz + (size_t) rl*p.n_head + (size_t) h*g;
    const uint32_t * key = keys + o;
    uint32_t      * vbit = bits + ((size_t) rl*p.n_head_kv + h)*2*p.n_words;
    uint32_t      * sbit = vbit + p.n_words;
    const int     * st   = state + ((size_t) rl*p.n_head_kv + h)*SPARSE_ATTN_SEL_STATE_INTS;
    const int     * tcl  = tc + o;
    const int     * lcl  = lc + o;
    int           * out  = sel + ((size_t) rl*p.n_head_kv + h)*p.n_sel_max;

    const int n_vis   = st[SPARSE_ATTN_SEL_CNT + 0];
    const int n_valid = st[SPARSE_ATTN_SEL_CNT + 1];
    const int n_tc    = st[SPARSE_ATTN_SEL_CNT + 3];
    const int n_lc    = st[SPARSE_ATTN_SEL_CNT + 4];

    float * al = alpha + (size_t) rl*p.n_head + (size_t) h*g;
    int4  * nf = info + (size_t) rl*p.n_head_kv + h;

    if (n_vis == 0) {
        if (tid == 0) {
            *nf = make_int4(0, 0, 1, 0);
        }
        for (int j = tid; j < g; j += blockDim.x) {
            al[j] = 1.0f;
        }
        return;
    }

    const bool all = n_vis <= p.top_k;

    if (!all) {
        // the n_local most recent visible cells: those of LC with (position, cell) >= tl (the threshold orders LC only:
        // a cell must be in LC too, its bin at least LC's)
        uint32_t tl[2] = { 0, 0 };
        const uint32_t pmax = (uint32_t) st[SPARSE_ATTN_SEL_CNT + 2];
        const int      bl   = st[SPARSE_ATTN_SEL_CNT + 5];
        const bool has_local = p.n_local > 0;
        if (has_local) {
            auto get_local = [&](const int u, uint32_t * x) {
                const int i = lcl[u];
                x[0] = sparse_attn_pos_key(prow[i]);
                x[1] = (uint32_t) i;
                return true;
            };
            sparse_attn_kth_largest<2>(get_local, n_lc, p.n_local, tl, hist, sh);
        }
        auto is_local = [&](const int i) {
            const uint32_t x[2] = { sparse_attn_pos_key(prow[i]), (uint32_t) i };
            return has_local && sparse_attn_near_bin(pmax, prow[i]) >= bl && sparse_attn_key_ge<2>(x, tl);
        };

        // the others with a score that is not NaN: n_rest = n_valid - the local ones among them
        int nl = 0;
        for (int u = tid; u < n_lc; u += blockDim.x) {
            const int i = lcl[u];
            nl += key[i] >= 2 && is_local(i);
        }
        const int n_loc_valid = block_reduce<block_reduce_method::SUM, SPARSE_ATTN_SELECT_THREADS>(nl, redi);
        __syncthreads();
        // fewer than asked for only when scores are NaN: those there are, as the CPU kernel
        const int n_top = min(p.top_k - p.n_local, n_valid - n_loc_valid);

        // their top n_top: those of TC with (key, position, cell) >= tt (all of them are in TC)
        uint32_t tt[3] = { 0, 0, 0 };
        auto get_rest = [&](const int u, uint32_t * x) {
            const int i = tcl[u];
            x[0] = key[i];
            x[1] = sparse_attn_pos_key(prow[i]);
            x[2] = (uint32_t) i;
            return !is_local(i);
        };
        if (n_top > 0) {
            sparse_attn_kth_largest<3>(get_rest, n_tc, n_top, tt, hist, sh);
        }

        // mark the selection in the bitmap (zeroed by sparse_attn_sel_keys)
        if (has_local) {
            for (int u = tid; u < n_lc; u += blockDim.x) {
                const int i = lcl[u];
                if (is_local(i)) {
                    atomicOr(&sbit[i >> 5], 1u << (i & 31));
                }
            }
        }
        if (n_top > 0) {
            for (int u = tid; u < n_tc; u += blockDim.x) {
                uint32_t x[3];
                if (get_rest(u, x) && sparse_attn_key_ge<3>(x, tt)) {
                    const int i = x[2];
                    atomicOr(&sbit[i >> 5], 1u << (i & 31));
                }
            }
        }
        __syncthreads();
    }

    const int n_sel = sparse_attn_compact_bits(all ? vbit : sbit, p.n_words, out, sh);

    // alpha_j: the approximate score mass of the selection
    for (int j = 0; j < g; ++j) {
        float a = 1.0f;
        if (!all && p.mean_value) {
            const float2 f = mz[j];
            float t = 0.0f;
            for (int u = tid; u < n_sel; u += blockDim.x) {
                t += expf(sc[(size_t) j*n_kv + out[u]] - f.x)*f.y;
            }
            a = block_reduce<block_reduce_method::SUM, SPARSE_ATTN_SELECT_THREADS>(t, redf);
            __syncthreads();
        }
        if (tid == 0) {
            al[j] = a;
        }
    }
    if (tid == 0) {
        *nf = make_int4(n_sel, n_vis, all ? 1 : 0, 0);
    }
}

// ------------------------------------------------------------------------------------------------------------------
// 4. attend: exact attention of the group over one slice of the selection

template <ggml_type type_K, ggml_type type_V>
static __global__ void __launch_bounds__(SPARSE_ATTN_ATTEND_THREADS) sparse_attn_attend(
        const sparse_attn_params p, const int * __restrict__ sel, const int4 * __restrict__ info,
        float * __restrict__ ypart, float2 * __restrict__ meta) {
    const int split = blockIdx.x;
    const int h     = blockIdx.y;
    const int rl    = blockIdx.z;
    const int g     = p.g;
    const int DK    = p.DK;
    const int DV    = p.DV;
    const int S     = p.split;

    const int tid   = threadIdx.x;
    const int lane  = tid % WARP_SIZE;
    const int warp  = tid / WARP_SIZE;
    const int nwarp = blockDim.x / WARP_SIZE;

    extern __shared__ float sparse_attn_attend_smem[];
    float * qs = sparse_attn_attend_smem; // [g][DK]
    float * kq = qs + g*DK;              // [g][S]
    float * vs = kq + g*S;               // [S][DV]
    float * ks = vs + S*DV;              // [nwarp][DK]

    const int n_sel = info[(size_t) rl*p.n_head_kv + h].x;
    const int s0    = split*S;
    const int ns    = min(S, n_sel - s0);

    // (query head j: + j*n_split)
    const size_t o = ((size_t) rl*p.n_head + (size_t) h*g)*p.n_split + split;

    if (ns <= 0) {
        for (int j = tid; j < g; j += blockDim.x) {
            meta[o + (size_t) j*p.n_split] = make_float2(-INFINITY, 0.0f);
        }
        return;
    }

    const sparse_attn_row rw = sparse_attn_row_of(p, rl);
    const int * sl = sel + ((size_t) rl*p.n_head_kv + h)*p.n_sel_max + s0;

    for (int t = tid; t < g*DK; t += blockDim.x) {
        const int j = t / DK;
        qs[t] = sparse_attn_q_row(p, rw, h*g + j)[t - j*DK];
    }

    // the slice's V rows, converted once
    const char * vb = p.v + h*p.nbv2 + rw.iq3*p.nbv3;
    for (int t = 2*tid; t < ns*DV; t += 2*blockDim.x) {
        const int c = t / DV;
        const float2 x = sparse_attn_load2<type_V>(vb + (size_t) sl[c]*p.nbv1, t - c*DV);
        vs[t + 0] = x.x;
        vs[t + 1] = x.y;
    }
    __syncthreads();

    // one warp per selected K row: converted once into shared memory, dotted with every query head of the group
    const char * kb = p.k + h*p.nbk2 + rw.iq3*p.nbk3;
    float * kw = ks + warp*DK;
    for (int c = warp; c < ns; c += nwarp) {
        const char * krow = kb + (size_t) sl[c]*p.nbk1;
        for (int d = 2*lane; d < DK; d += 2*WARP_SIZE) {
            const float2 x = sparse_attn_load2<type_K>(krow, d);
            kw[d + 0] = x.x;
            kw[d + 1] = x.y;
        }
        __syncwarp();
        for (int j = 0; j < g; ++j) {
            float s = 0.0f;
            for (int d = lane; d < DK; d += WARP_SIZE) {
                s += qs[j*DK + d]*kw[d];
            }
            s = warp_reduce_sum(s);
            if (lane == 0) {
                kq[j*S + c] = s*p.scale;
            }
        }
        __syncwarp();
    }
    __syncthreads();

    // softmax of the slice, per query head
    for (int j = warp; j < g; j += nwarp) {
        float m = -INFINITY;
        for (int c = lane; c < ns; c += WARP_SIZE) {
            m = fmaxf(m, kq[j*S + c]);
        }
        m = warp_reduce_max(m);
        float l = 0.0f;
        for (int c = lane; c < ns; c += WARP_SIZE) {
            const float e = expf(kq[j*S + c] - m);
            kq[j*S + c] = e;
            l += e;
        }
        l = warp_reduce_sum(l);
        if (lane == 0) {
            meta[o + (size_t) j*p.n_split] = make_float2(m, l);
        }
    }
    __syncthreads();

    for (int t = tid; t < g*DV; t += blockDim.x) {
        const int j = t / DV;
        const int d = t - j*DV;
        float acc = 0.0f;
        for (int c = 0; c < ns; ++c) {
            acc += kq[j*S + c]*vs[c*DV + d];
        }
        ypart[(o + (size_t) j*p.n_split)*DV + d] = acc;
    }
}

// ------------------------------------------------------------------------------------------------------------------
// 5. combine the slices, mean value

static __global__ void __launch_bounds__(SPARSE_ATTN_COMBINE_THREADS) sparse_attn_combine(
        const sparse_attn_params p, const int4 * __restrict__ info, const float * __restrict__ alpha,
        const float * __restrict__ ypart, const float2 * __restrict__ meta, const float * __restrict__ vpart) {
    const int hq = blockIdx.x;
    const int rl = blockIdx.y;
    const int h  = hq / p.g;
    const int DV = p.DV;

    const int4 nf    = info[(size_t) rl*p.n_head_kv + h];
    const int  n_sel = nf.x;
    const int  n_vis = nf.y;
    const bool all   = nf.z != 0;

    const sparse_attn_row rw = sparse_attn_row_of(p, rl);
    float * y = (float *) (p.dst + hq*p.nbd1 + rw.iq1*p.nbd2 + rw.iq3*p.nbd3);

    if (n_sel == 0) {
        for (int d = threadIdx.x; d < DV; d += blockDim.x) {
            y[d] = 0.0f;
        }
        return;
    }

    const size_t   o  = ((size_t) rl*p.n_head + hq)*p.n_split;
    const float2 * mt = meta + o;
    const int      ns = min(p.n_split, (n_sel + p.split - 1)/p.split);

    float M = -INFINITY;
    for (int s = 0; s < ns; ++s) {
        if (mt[s].y > 0.0f) {
            M = fmaxf(M, mt[s].x);
        }
    }
    float L = 0.0f;
    for (int s = 0; s < ns; ++s) {
        if (mt[s].y > 0.0f) {
            L += mt[s].y*expf(mt[s].x - M);
        }
    }

    const bool  mix = p.mean_value && !all;
    const float a   = mix ? alpha[(size_t) rl*p.n_head + hq] : 1.0f;
    const float f   = L > 0.0f ? a/L : 0.0f;

    const float * vm = p.vmean ? (const float *) (p.vmean + h*p.nbvm1 + rw.iq1*p.nbvm2 + rw.iq3*p.nbvm3) : nullptr;
    const float * vp = vpart + ((size_t) rl*p.n_head_kv + h)*p.n_chunk*DV;

    for (int d = threadIdx.x; d < DV; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < ns; ++s) {
            if (mt[s].y > 0.0f) {
                acc += expf(mt[s].x - M)*ypart[(o + s)*DV + d];
            }
        }
        float res = acc*f;
        if (mix) {
            float v;
            if (vm) {
                v = vm[d];
            } else {
                v = 0.0f;
                for (int c = 0; c < p.n_chunk; ++c) {
                    v += vp[(size_t) c*DV + d];
                }
                v /= n_vis;
            }
            res += (1.0f - a)*v;
        }
        y[d] = res;
    }
}

// ------------------------------------------------------------------------------------------------------------------
// host

static size_t sparse_attn_attend_smem_size(const int g, const int DK, const int DV, const int S) {
    return sizeof(float)*((size_t) g*DK + (size_t) g*S + (size_t) S*DV + (size_t) (SPARSE_ATTN_ATTEND_THREADS/WARP_SIZE)*DK);
}

static size_t sparse_attn_score_smem_size(const int g, const int r_pad, const int DK) {
    return sizeof(float)*(size_t) g*r_pad + sizeof(int)*(size_t) DK;
}

bool ggml_cuda_sparse_attn_supported(int device, const ggml_tensor * op) {
    GGML_UNUSED(device);
#if defined(GGML_USE_HIP) || defined(GGML_USE_MUSA)
    // the selection assumes 32-thread warps
    GGML_UNUSED(op);
    return false;
#else
    const ggml_tensor * q     = op->src[0];
    const ggml_tensor * k     = op->src[1];
    const ggml_tensor * kt    = op->src[2];
    const ggml_tensor * v     = op->src[3];
    const ggml_tensor * mask  = op->src[4];
    const ggml_tensor * pos   = op->src[5];
    const ggml_tensor * vmean = op->src[6];

    if (op->type != GGML_TYPE_F32 || q->type != GGML_TYPE_F32 || mask->type != GGML_TYPE_F16 || pos->type != GGML_TYPE_I32) {
        return false;
    }

    const int32_t rank       = ggml_get_op_params_i32(op, 5);
    const int32_t r          = ggml_get_op_params_i32(op, 1);
    const int32_t top_k      = ggml_get_op_params_i32(op, 2);
    const int32_t n_local    = ggml_get_op_params_i32(op, 3);
    const bool    mean_value = ggml_get_op_params_i32(op, 4) != 0;
    const int32_t n_sink     = ggml_get_op_params_i32(op, 7);

    // K and V of the same type: f32, f16 or q8_0
    if (k->type != v->type || (k->type != GGML_TYPE_F32 && k->type != GGML_TYPE_F16 && k->type != GGML_TYPE_Q8_0)) {
        return false;
    }

    if (rank == GGML_SPARSE_ATTN_RANK_SPARQ) {
        if (!kt || (kt->type != GGML_TYPE_F16 && kt->type != GGML_TYPE_F32) || kt->nb[0] != ggml_type_size(kt->type)) {
            return false;
        }
    } else if (rank == GGML_SPARSE_ATTN_RANK_LOKI) {
        if (kt || vmean || mean_value) {
            return false;
        }
    } else {
        return false;
    }

    const int64_t DK        = k->ne[0];
    const int64_t DV        = v->ne[0];
    const int64_t n_kv      = k->ne[1];
    const int64_t n_head    = q->ne[2];
    const int64_t n_head_kv = k->ne[2];

    if (DK % 2 != 0 || DV % 2 != 0 || DK > SPARSE_ATTN_MAX_D || DV > SPARSE_ATTN_MAX_D) {
        return false;
    }
    if (n_head_kv < 1 || n_head % n_head_kv != 0 || n_head/n_head_kv > SPARSE_ATTN_MAX_G) {
        return false;
    }
    const int64_t g = n_head/n_head_kv;

    if (r < 1 || r > DK || top_k < 1 || n_local < 0 || n_local > top_k || n_sink < 0 || n_sink > top_k - n_local) {
        return false;
    }

    // rows contiguous; cells and rows indexed with 32-bit integers
    if (q->nb[0] != sizeof(float) || k->nb[0] != ggml_type_size(k->type) || v->nb[0] != ggml_type_size(v->type) ||
        op->nb[0] != sizeof(float) || (vmean && (vmean->type != GGML_TYPE_F32 || vmean->nb[0] != sizeof(float)))) {
        return false;
    }
    if (!ggml_is_contiguous(mask) || !ggml_is_contiguous(pos)) {
        return false;
    }
    if (n_kv < 1 || n_kv > INT32_MAX - SPARSE_ATTN_SEL_TILE_MAX || q->ne[1]*q->ne[3] > INT32_MAX) {
        return false;
    }

    // shared memory of the scoring and the exact attention kernels (at their smallest split)
    const int64_t r_pad = rank == GGML_SPARSE_ATTN_RANK_LOKI ? GGML_PAD(r, 2) : r;
    if (sparse_attn_score_smem_size(g, r_pad, DK) > SPARSE_ATTN_SMEM_MAX || sparse_attn_attend_smem_size(g, DK, DV, 8) > SPARSE_ATTN_SMEM_MAX) {
        return false;
    }

    return true;
#endif // defined(GGML_USE_HIP) || defined(GGML_USE_MUSA)
}

template <ggml_type type>
static void sparse_attn_launch_typed(ggml_backend_cuda_context & ctx, const sparse_attn_params & p0, const ggml_tensor * kt,
        const int n_rows, const int NR, const bool need_vsum) {
    cudaStream_t stream = ctx.stream();
    ggml_cuda_pool & pool = ctx.pool();

    const int H = p0.n_head_kv;

    ggml_cuda_pool_alloc<int>      comp  (pool, (size_t) NR*H*p0.DK);
    ggml_cuda_pool_alloc<float>    qsel  (pool, (size_t) NR*p0.n_head*p0.r_pad);
    ggml_cuda_pool_alloc<float>    scores(pool, (size_t) NR*p0.n_head*p0.n_kv);
    ggml_cuda_pool_alloc<float2>   stats (pool, (size_t) NR*p0.n_head*p0.n_chunk);
    ggml_cuda_pool_alloc<float>    vpart (pool, need_vsum ? (size_t) NR*H*p0.n_chunk*p0.DV : 1);
    ggml_cuda_pool_alloc<uint32_t> keys  (pool, (size_t) NR*H*p0.n_kv);
    ggml_cuda_pool_alloc<uint32_t> bits  (pool, (size_t) NR*H*2*p0.n_words);
    ggml_cuda_pool_alloc<int>      state (pool, (size_t) NR*H*SPARSE_ATTN_SEL_STATE_INTS);
    ggml_cuda_pool_alloc<int>      tc    (pool, (size_t) NR*H*p0.n_kv);
    ggml_cuda_pool_alloc<int>      lc    (pool, (size_t) NR*H*p0.n_kv);
    ggml_cuda_pool_alloc<float2>   smz   (pool, (size_t) NR*p0.n_head);
    ggml_cuda_pool_alloc<int>      sel   (pool, (size_t) NR*H*p0.n_sel_max);
    ggml_cuda_pool_alloc<int4>     info  (pool, (size_t) NR*H);
    ggml_cuda_pool_alloc<float>    alpha (pool, (size_t) NR*p0.n_head);
    ggml_cuda_pool_alloc<float>    ypart (pool, (size_t) NR*p0.n_head*p0.n_split*p0.DV);
    ggml_cuda_pool_alloc<float2>   meta  (pool, (size_t) NR*p0.n_head*p0.n_split);

    const size_t smem_prep   = 3*sizeof(int)*(size_t) p0.DK;
    const size_t smem_score  = sparse_attn_score_smem_size(p0.g, p0.r_pad, p0.DK);
    const size_t smem_attend = sparse_attn_attend_smem_size(p0.g, p0.DK, p0.DV, p0.split);

    for (int row0 = 0; row0 < n_rows; row0 += NR) {
        sparse_attn_params p = p0;
        p.row0 = row0;
        const int nr = std::min(NR, n_rows - row0);

        sparse_attn_prepare<<<dim3(H, nr), SPARSE_ATTN_PREP_THREADS, smem_prep, stream>>>(p, comp.get(), qsel.get(), state.get());

        const dim3 grid_chunks(p.n_chunk, H, nr);
        // SparQ's scoring reads kt only: one instance per kt type
        if (p.rank == GGML_SPARSE_ATTN_RANK_SPARQ) {
            if (kt->type == GGML_TYPE_F16) {
                sparse_attn_score<GGML_SPARSE_ATTN_RANK_SPARQ, half, GGML_TYPE_F16><<<grid_chunks, SPARSE_ATTN_SCORE_THREADS, smem_score, stream>>>(
                    p, comp.get(), qsel.get(), scores.get(), stats.get());
            } else {
                sparse_attn_score<GGML_SPARSE_ATTN_RANK_SPARQ, float, GGML_TYPE_F16><<<grid_chunks, SPARSE_ATTN_SCORE_THREADS, smem_score, stream>>>(
                    p, comp.get(), qsel.get(), scores.get(), stats.get());
            }
        } else {
            sparse_attn_score<GGML_SPARSE_ATTN_RANK_LOKI, half, type><<<grid_chunks, SPARSE_ATTN_SCORE_THREADS, smem_score, stream>>>(
                p, comp.get(), qsel.get(), scores.get(), stats.get());
        }
        if (need_vsum) {
            sparse_attn_vsum<type><<<grid_chunks, SPARSE_ATTN_SCORE_THREADS, 0, stream>>>(p, vpart.get());
        }

        const dim3 grid_tiles(p.n_tile, H, nr);
        sparse_attn_sel_keys<<<grid_tiles, SPARSE_ATTN_TILE_THREADS, 0, stream>>>(
            p, scores.get(), stats.get(), keys.get(), bits.get(), state.get(), smz.get());
        sparse_attn_sel_hist<<<grid_tiles, SPARSE_ATTN_TILE_THREADS, 0, stream>>>(p, keys.get(), state.get());
        sparse_attn_sel_gather<<<grid_tiles, SPARSE_ATTN_TILE_THREADS, 0, stream>>>(p, keys.get(), state.get(), tc.get(), lc.get());
        sparse_attn_select<<<dim3(H, nr), SPARSE_ATTN_SELECT_THREADS, 0, stream>>>(
            p, scores.get(), smz.get(), keys.get(), bits.get(), state.get(), tc.get(), lc.get(), sel.get(), info.get(), alpha.get());

        sparse_attn_attend<type, type><<<dim3(p.n_split, H, nr), SPARSE_ATTN_ATTEND_THREADS, smem_attend, stream>>>(
            p, sel.get(), info.get(), ypart.get(), meta.get());

        sparse_attn_combine<<<dim3(p.n_head, nr), SPARSE_ATTN_COMBINE_THREADS, 0, stream>>>(
            p, info.get(), alpha.get(), ypart.get(), meta.get(), vpart.get());
    }
    CUDA_CHECK(cudaGetLastError());
}

void ggml_cuda_sparse_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * q     = dst->src[0];
    const ggml_tensor * k     = dst->src[1];
    const ggml_tensor * kt    = dst->src[2];
    const ggml_tensor * v     = dst->src[3];
    const ggml_tensor * mask  = dst->src[4];
    const ggml_tensor * pos   = dst->src[5];
    const ggml_tensor * vmean = dst->src[6];

    GGML_ASSERT(ggml_cuda_sparse_attn_supported(ctx.device, dst));

    sparse_attn_params p = {};

    p.q     = (const char *) q->data;
    p.k     = (const char *) k->data;
    p.kt    = kt ? (const char *) kt->data : nullptr;
    p.v     = (const char *) v->data;
    p.mask  = (const char *) mask->data;
    p.pos   = (const char *) pos->data;
    p.vmean = vmean ? (const char *) vmean->data : nullptr;
    p.dst   = (char *) dst->data;

    p.nbq1 = q->nb[1]; p.nbq2 = q->nb[2]; p.nbq3 = q->nb[3];
    p.nbk1 = k->nb[1]; p.nbk2 = k->nb[2]; p.nbk3 = k->nb[3];
    if (kt) {
        p.nbkt1 = kt->nb[1]; p.nbkt2 = kt->nb[2]; p.nbkt3 = kt->nb[3];
    }
    p.nbv1 = v->nb[1]; p.nbv2 = v->nb[2]; p.nbv3 = v->nb[3];
    p.nbm1 = mask->nb[1]; p.nbm3 = mask->nb[3];
    p.nbp1 = pos->nb[1];
    if (vmean) {
        p.nbvm1 = vmean->nb[1]; p.nbvm2 = vmean->nb[2]; p.nbvm3 = vmean->nb[3];
    }
    p.nbd1 = dst->nb[1]; p.nbd2 = dst->nb[2]; p.nbd3 = dst->nb[3];

    p.mask_ne3 = (int) mask->ne[3];
    p.pos_ne1  = (int) pos->ne[1];

    p.DK        = (int) k->ne[0];
    p.DV        = (int) v->ne[0];
    p.n_kv      = (int) k->ne[1];
    p.n_batch   = (int) q->ne[1];
    p.n_head    = (int) q->ne[2];
    p.n_head_kv = (int) k->ne[2];
    p.g         = p.n_head/p.n_head_kv;

    p.scale      = ggml_get_op_params_f32(dst, 0);
    p.r          = ggml_get_op_params_i32(dst, 1);
    p.top_k      = ggml_get_op_params_i32(dst, 2);
    p.n_local    = ggml_get_op_params_i32(dst, 3);
    p.n_sink     = ggml_get_op_params_i32(dst, 7);
    p.mean_value = ggml_get_op_params_i32(dst, 4);
    p.rank       = ggml_get_op_params_i32(dst, 5);
    p.r_pad      = p.rank == GGML_SPARSE_ATTN_RANK_LOKI ? GGML_PAD(p.r, 2) : p.r;

    p.n_chunk   = (p.n_kv + SPARSE_ATTN_CHUNK - 1)/SPARSE_ATTN_CHUNK;
    p.n_sel_max = std::min(p.top_k, p.n_kv);

    const int n_rows = p.n_batch*(int) q->ne[3];
    const int H      = p.n_head_kv;
    const int nsm    = ggml_cuda_info().devices[ctx.device].nsm;

    // the exact attention: the largest slice that fits, smaller while the blocks do not fill the GPU twice over
    int S = 64;
    while (S > 8 && sparse_attn_attend_smem_size(p.g, p.DK, p.DV, S) > SPARSE_ATTN_SMEM_MAX) {
        S /= 2;
    }
    while (S > 8 && (int64_t) ((p.n_sel_max + S - 1)/S)*H*n_rows < 2*nsm) {
        S /= 2;
    }
    p.split   = S;
    p.n_split = (p.n_sel_max + S - 1)/S;

    // the selection's tiles: the largest that still gives two blocks per SM
    int T = SPARSE_ATTN_SEL_TILE_MAX;
    while (T > SPARSE_ATTN_TILE_THREADS && (int64_t) ((p.n_kv + T - 1)/T)*H*n_rows < 2*nsm) {
        T /= 2;
    }
    p.sel_tile = T;
    p.n_tile   = (p.n_kv + T - 1)/T;
    p.n_words  = (p.n_kv + 31)/32;

    // pair loads of kt need rows (and the views' offsets) aligned to two cells
    if (kt) {
        const size_t a = 2*ggml_type_size(kt->type);
        p.kt_vec = (uintptr_t) kt->data % a == 0 && kt->nb[1] % a == 0 && kt->nb[2] % a == 0 && kt->nb[3] % a == 0;
    }

    const bool need_vsum = p.mean_value && !vmean;

    // rows per launch group: bounded scratch
    const size_t row_bytes =
        sizeof(int)*(size_t) H*p.DK + sizeof(float)*(size_t) p.n_head*p.r_pad +
        sizeof(float)*(size_t) p.n_head*p.n_kv + sizeof(float2)*(size_t) p.n_head*p.n_chunk +
        (need_vsum ? sizeof(float)*(size_t) H*p.n_chunk*p.DV : 0) +
        sizeof(uint32_t)*(size_t) H*p.n_kv + sizeof(int)*(size_t) H*p.n_sel_max + sizeof(int4)*(size_t) H +
        sizeof(uint32_t)*(size_t) H*2*p.n_words + sizeof(int)*(size_t) H*SPARSE_ATTN_SEL_STATE_INTS +
        sizeof(int)*(size_t) H*2*p.n_kv + sizeof(float2)*(size_t) p.n_head +
        sizeof(float)*(size_t) p.n_head + (sizeof(float)*p.DV + sizeof(float2))*(size_t) p.n_head*p.n_split;
    const int NR = (int) std::max<size_t>(1, std::min<size_t>({ (size_t) n_rows, (size_t) 65535, SPARSE_ATTN_SCRATCH_ROWS_BYTES/row_bytes }));

    switch (k->type) {
        case GGML_TYPE_F32:  sparse_attn_launch_typed<GGML_TYPE_F32> (ctx, p, kt, n_rows, NR, need_vsum); break;
        case GGML_TYPE_F16:  sparse_attn_launch_typed<GGML_TYPE_F16> (ctx, p, kt, n_rows, NR, need_vsum); break;
        case GGML_TYPE_Q8_0: sparse_attn_launch_typed<GGML_TYPE_Q8_0>(ctx, p, kt, n_rows, NR, need_vsum); break;
        default: GGML_ABORT("fatal error");
    }
}
