// Runs one ggml_sparq_attn, ggml_loki_attn or ggml_alisa_attn on the CPU backend from a file and writes the result.
//
// Built for another architecture (aarch64) and run under emulation, it checks the op there against the
// reference on the host: tests/op_runner.py writes the inputs, this program computes, Python compares.
//
// Input (little-endian):
//   "SQOP" u32 version=2
//   u32 rank (0 = SparQ, 1 = Loki, 2 = ALISA), u32 n_threads
//   f32 scale, i32 r_or_d, i32 top_k, i32 n_local, i32 mean_value, f32 c (ALISA's caching ratio)
//   7 slots (q, k, kt, v, mask, pos, vmean or ALISA's window sums), each:
//     u32 present; if present: u32 type, i64 ne[4], u64 nb[4], u64 offset, u64 nbytes, nbytes of data
//     (the tensor is a view of ne/nb at offset into its own buffer of nbytes)
// Output: i64 ne[4] of the result, then its f32 data (contiguous).
#include "ggml.h"
#include "ggml-cpu.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { SLOT_Q, SLOT_K, SLOT_KT, SLOT_V, SLOT_MASK, SLOT_POS, SLOT_VMEAN, N_SLOTS };

struct slot {
    uint32_t present;
    uint32_t type;
    int64_t  ne[4];
    uint64_t nb[4];
    uint64_t offset;
    uint64_t nbytes;
    void *   data;
};

static void die(const char * msg) {
    fprintf(stderr, "op_runner: %s\n", msg);
    exit(2);
}

static void read_exact(FILE * f, void * dst, size_t n) {
    if (fread(dst, 1, n, f) != n) {
        die("input file is truncated");
    }
}

static void read_slot(FILE * f, struct slot * s) {
    read_exact(f, &s->present, 4);
    if (!s->present) {
        return;
    }
    read_exact(f, &s->type, 4);
    read_exact(f, s->ne, sizeof(s->ne));
    read_exact(f, s->nb, sizeof(s->nb));
    read_exact(f, &s->offset, 8);
    read_exact(f, &s->nbytes, 8);
    if (s->type >= GGML_TYPE_COUNT) {
        die("unknown tensor type");
    }
    s->data = malloc(s->nbytes ? s->nbytes : 1);
    if (!s->data) {
        die("out of memory");
    }
    read_exact(f, s->data, s->nbytes);
}

// a view of the slot's buffer, as the caller laid it out
static struct ggml_tensor * slot_tensor(struct ggml_context * ctx, const struct slot * s) {
    if (!s->present) {
        return NULL;
    }
    const enum ggml_type type = (enum ggml_type) s->type;
    const int64_t n_elem = (int64_t) (s->nbytes / ggml_type_size(type)) * ggml_blck_size(type);
    struct ggml_tensor * buf = ggml_new_tensor_1d(ctx, type, n_elem);
    memcpy(buf->data, s->data, ggml_nbytes(buf));
    return ggml_view_4d(ctx, buf, s->ne[0], s->ne[1], s->ne[2], s->ne[3], s->nb[1], s->nb[2], s->nb[3], s->offset);
}

int main(int argc, char ** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s INPUT OUTPUT\n", argv[0]);
        return 2;
    }

    FILE * f = fopen(argv[1], "rb");
    if (!f) {
        die("cannot open the input file");
    }

    char magic[4];
    uint32_t version, rank, n_threads;
    float scale;
    int32_t r_or_d, top_k, n_local, mean_value;
    read_exact(f, magic, 4);
    if (memcmp(magic, "SQOP", 4) != 0) {
        die("not an op_runner input file");
    }
    read_exact(f, &version, 4);
    if (version != 2) {
        die("unknown input version");
    }
    read_exact(f, &rank, 4);
    read_exact(f, &n_threads, 4);
    read_exact(f, &scale, 4);
    read_exact(f, &r_or_d, 4);
    read_exact(f, &top_k, 4);
    read_exact(f, &n_local, 4);
    read_exact(f, &mean_value, 4);
    float c;
    read_exact(f, &c, 4);

    struct slot slots[N_SLOTS];
    memset(slots, 0, sizeof(slots));
    size_t total = 0;
    for (int i = 0; i < N_SLOTS; ++i) {
        read_slot(f, &slots[i]);
        total += slots[i].nbytes + 64;
    }
    fclose(f);

    const int64_t * qne = slots[SLOT_Q].ne;
    // ALISA's result also holds each row's weights over the cells
    const size_t out_bytes = (size_t) (slots[SLOT_V].ne[0] * qne[2] * qne[1] * qne[3]) * sizeof(float) +
        (rank == 2 ? (size_t) (slots[SLOT_VMEAN].ne[0] * slots[SLOT_VMEAN].ne[1] * qne[1]) * sizeof(float) : 0);

    struct ggml_init_params params = {
        /*.mem_size   =*/ total + 2*out_bytes + 64*ggml_tensor_overhead() + ggml_graph_overhead() + (1u << 20),
        /*.mem_buffer =*/ NULL,
        /*.no_alloc   =*/ false,
    };
    struct ggml_context * ctx = ggml_init(params);
    if (!ctx) {
        die("ggml_init failed");
    }

    struct ggml_tensor * t[N_SLOTS];
    for (int i = 0; i < N_SLOTS; ++i) {
        t[i] = slot_tensor(ctx, &slots[i]);
    }

    struct ggml_tensor * out = NULL;
    switch (rank) {
        case 0:
            out = ggml_sparq_attn(ctx, t[SLOT_Q], t[SLOT_K], t[SLOT_KT], t[SLOT_V], t[SLOT_MASK], t[SLOT_POS],
                    t[SLOT_VMEAN], scale, r_or_d, top_k, n_local, mean_value != 0);
            break;
        case 1:
            out = ggml_loki_attn(ctx, t[SLOT_Q], t[SLOT_K], t[SLOT_V], t[SLOT_MASK], t[SLOT_POS], scale, r_or_d,
                    top_k, n_local);
            break;
        case 2:
            out = ggml_alisa_attn(ctx, t[SLOT_Q], t[SLOT_K], t[SLOT_V], t[SLOT_MASK], t[SLOT_POS], t[SLOT_VMEAN],
                    scale, c);
            break;
        default:
            die("unknown rank");
    }

    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    if (ggml_graph_compute_with_ctx(ctx, gf, (int) n_threads) != GGML_STATUS_SUCCESS) {
        die("ggml_graph_compute failed");
    }

    FILE * o = fopen(argv[2], "wb");
    if (!o) {
        die("cannot open the output file");
    }
    fwrite(out->ne, sizeof(int64_t), 4, o);
    fwrite(out->data, 1, ggml_nbytes(out), o);
    fclose(o);

    ggml_free(ctx);
    for (int i = 0; i < N_SLOTS; ++i) {
        free(slots[i].data);
    }
    return 0;
}
