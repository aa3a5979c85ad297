#include "llama-kv-cache.h"

#include "llama-context.h"
#include "llama-impl.h"
#include "llama-io.h"
#include "llama-model.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <stdexcept>

// llama_kv_cache: what sparse attention keeps beside K and V (llama-kv-cache.h)
// - SparQ: K^T and the per-sequence V sums, the graph inputs that keep them in step, the upkeep graph
// - ALISA: the window of the last steps' attention weights
// - the sparse attention layout of a state, SparQ's K^T and ALISA's ring in it

// SparQ upkeep: which cells belong to the sequences whose sums of V are recomputed, and where the sums go
class llm_graph_input_sparq_upkeep : public llm_graph_input_i {
public:
    llm_graph_input_sparq_upkeep(const llama_kv_cache * kv_self) : kv_self(kv_self) {}
    virtual ~llm_graph_input_sparq_upkeep() = default;

    void set_input(const llama_ubatch * ubatch) override;

    struct stream_sums {
        uint32_t strm;
        uint32_t n_cells;

        std::vector<llama_seq_id> seq_ids;

        ggml_tensor * member = nullptr; // F32 [n_seq, n_cells]: 1 where the cell belongs to the sequence
        ggml_tensor * rows   = nullptr; // I64 [n_seq]: the sequences, the rows of the sums to write
    };

    std::vector<stream_sums> sums;

    // the rows of V that edits added to or removed from the sums of other sequences than the above
    struct edit_sums {
        std::vector<int32_t>      cells;   // cells of the edited rows, as rows of V's streams
        std::vector<llama_seq_id> seq_ids; // sequences whose sums change
        std::vector<float>        coef;    // [n_seq, n_cells]: +1 where the cell joined the sequence, -1 where it left

        ggml_tensor * rows_v = nullptr; // I32 [n_cells]
        ggml_tensor * coefs  = nullptr; // F32 [n_seq, n_cells]
        ggml_tensor * rows   = nullptr; // I32 [n_seq]
    } edits;

    const llama_kv_cache * kv_self;
};

bool llama_kv_cache::alisa_seq_rm_ok(llama_pos p0, llama_pos p1) const {
    const auto & cells = v_cells[0];

    uint32_t n_rm    = 0;
    bool     kept_p1 = false; // a cell at or past p1 stays: the removal is not the end of the sequence
    for (uint32_t i = 0; i < cells.size(); ++i) {
        if (cells.is_empty(i)) {
            continue;
        }
        const llama_pos p = cells.pos_get(i);
        n_rm    += p >= p0 && p < p1;
        kept_p1 |= p >= p1;
    }

    const uint32_t n_used = cells.get_used();
    if (n_rm == 0 || n_rm == n_used) {
        return true;
    }

    if (kept_p1) {
        LLAMA_LOG_WARN("%s: ALISA: removing positions [%d, %d) from the middle of the sequence: its window of past weights "
                "would no longer follow the steps taken; process the sequence again\n", __func__, p0, p1);
        return false;
    }

    // the steps of the next window must still be in the ring
    const uint32_t n_keep = n_used - n_rm;
    if (alisa_window_start(n_keep, alisa_c) + alisa_n_ring < n_used) {
        LLAMA_LOG_WARN("%s: ALISA: removing the last %u of %u positions: the window of position %u needs steps no longer "
                "held (the last %u are); process the sequence again\n", __func__, n_rm, n_used, n_keep, alisa_n_ring);
        return false;
    }

    return true;
}

uint32_t llama_kv_cache::alisa_window_start(uint32_t t, float c) {
    const uint64_t k = std::max<uint64_t>(1, (uint64_t) std::floor((double) (t + 1)*(double) c/2));
    return t > k ? (uint32_t) (t - k) : 0;
}

float llama_kv_cache::get_alisa_c() const {
    return alisa_c;
}

uint32_t llama_kv_cache::get_alisa_n_ring() const {
    return alisa_n_ring;
}

ggml_tensor * llama_kv_cache::get_alisa_sums(int32_t il) const {
    return layers[map_layer_ids.at(il)].alisa_sums;
}

ggml_tensor * llama_kv_cache::get_alisa_ring(int32_t il) const {
    return layers[map_layer_ids.at(il)].alisa_ring;
}

bool llama_kv_cache::get_alisa_resum() const {
    return alisa_resum;
}

std::vector<std::pair<int32_t, float>> llama_kv_cache::alisa_rewind_rows(float c) const {
    std::vector<std::pair<int32_t, float>> res;

    const uint32_t n_steps = v_cells[0].get_used();
    if (alisa_resum || alisa_rewind_from == 0 || n_steps == 0 || n_steps > alisa_rewind_from) {
        return res;
    }

    // the window of the step being decoded, [a0, a1), and the window the sums hold, [b0, b1)
    const uint32_t a0 = alisa_window_start(n_steps - 1, c);
    const uint32_t a1 = n_steps - 1;
    const uint32_t b0 = alisa_window_start(alisa_rewind_from, c);
    const uint32_t b1 = alisa_rewind_from;

    // alisa_seq_rm_ok() kept the rows of [a0, b1) in the ring: no two of them share a ring row
    for (uint32_t r = std::min(a0, b0); r < std::max(a1, b1); ++r) {
        const int32_t d = (int32_t) (r >= a0 && r < a1) - (int32_t) (r >= b0 && r < b1);
        if (d != 0) {
            res.emplace_back((int32_t) (r % alisa_n_ring), (float) d);
        }
    }

    return res;
}

void llama_kv_cache::set_input_alisa_rewind(ggml_tensor * rows, ggml_tensor * coef, float c) const {
    GGML_ASSERT(ggml_backend_buffer_is_host(rows->buffer));
    GGML_ASSERT(ggml_backend_buffer_is_host(coef->buffer));

    const auto rr = alisa_rewind_rows(c);
    GGML_ASSERT((int64_t) rr.size() == rows->ne[0]);

    for (size_t i = 0; i < rr.size(); ++i) {
        ((int32_t *) rows->data)[i] = rr[i].first;
        ((float   *) coef->data)[i] = rr[i].second;
    }
}

void llama_kv_cache::alisa_mark_resum() {
    alisa_resum = alisa_c > 0.0f;
}

uint32_t llama_kv_cache::alisa_n_record(uint32_t n_tokens) const {
    return std::min(n_tokens, alisa_n_ring);
}

void llama_kv_cache::set_input_alisa(ggml_tensor * slots, ggml_tensor * leave, ggml_tensor * window, float c, uint32_t n_tokens, bool decode) const {
    // the steps taken: the cells of the sequence, this ubatch's included
    const uint32_t n_steps = v_cells[0].get_used();
    GGML_ASSERT(n_steps >= n_tokens);

    const uint32_t R = alisa_n_ring;

    if (slots) {
        GGML_ASSERT(ggml_backend_buffer_is_host(slots->buffer));
        int32_t * data = (int32_t *) slots->data;

        const int64_t m = slots->ne[0];
        for (int64_t i = 0; i < m; ++i) {
            data[i] = (int32_t) ((n_steps - m + i) % R);
        }
    }

    // decode: step t; the step leaving the window after it, if any; its window (resum) or the next one (record)
    const uint32_t t = n_steps - 1;

    if (leave) {
        GGML_ASSERT(decode && ggml_backend_buffer_is_host(leave->buffer));
        const uint32_t ws0 = alisa_window_start(t,     c);
        const uint32_t ws1 = alisa_window_start(t + 1, c);
        ((int32_t *) leave->data)[0] = (int32_t) (ws1 > ws0 ? ws0 % R : R);
    }

    if (window) {
        GGML_ASSERT(ggml_backend_buffer_is_host(window->buffer));
        float * data = (float *) window->data;

        std::fill(data, data + R + 1, 0.0f);

        const uint32_t t_win = decode ? t : n_steps;
        for (uint32_t r = alisa_window_start(t_win, c); r < t_win; ++r) {
            data[r % R] = 1.0f;
        }
    }

    alisa_resum       = false;
    alisa_rewind_from = 0;
}

bool llama_kv_cache::get_has_sparq() const {
    return sparq;
}

ggml_tensor * llama_kv_cache::get_kt(ggml_context * ctx, int32_t il, uint32_t n_kv, const slot_info & sinfo) const {
    GGML_ASSERT(sparq);

    const int32_t ikv = map_layer_ids.at(il);

    auto * kt = layers[ikv].kt;

    const uint32_t ns = sinfo.s1 - sinfo.s0 + 1;

    const int64_t n_embd_head_k = hparams.n_embd_head_k(il);

    // note: kt->nb[1] is the stride of one K component (kv_size elements)
    return ggml_view_4d(ctx, kt,
            n_kv, n_embd_head_k, hparams.n_head_kv(il), ns,
            kt->nb[1],
            kt->nb[1]*n_embd_head_k,
            kt->nb[2],
            kt->nb[2]*sinfo.s0);
}

ggml_tensor * llama_kv_cache::cpy_kt(ggml_context * ctx, ggml_tensor * k_stored, ggml_tensor * kv_rows, ggml_tensor * kt_idxs, int32_t il) const {
    GGML_ASSERT(sparq);

    const int32_t ikv = map_layer_ids.at(il);

    auto * kt = layers[ikv].kt;

    const int64_t n_embd_k_gqa = kt->ne[1];
    const int64_t n_tokens     = kv_rows->ne[0];

    // read back the stored rows, so that the copy holds the stored (rounded, dequantized) values
    ggml_tensor * k_rows = ggml_reshape_2d(ctx, k_stored, n_embd_k_gqa, ggml_nelements(k_stored)/n_embd_k_gqa);
    k_rows = ggml_get_rows(ctx, k_rows, kv_rows); // F32 [n_embd_k_gqa, n_tokens]

    // scatter each element to its place in the transposed copy, as cpy_v does for a transposed V
    ggml_tensor * kt_view = ggml_reshape_2d(ctx, kt, 1, ggml_nelements(kt));

    k_rows = ggml_reshape_2d(ctx, k_rows, 1, n_embd_k_gqa*n_tokens);

    return ggml_set_rows(ctx, kt_view, k_rows, kt_idxs);
}

ggml_tensor * llama_kv_cache::get_vsum_edits(ggml_context * ctx, ggml_tensor * edit_rows, ggml_tensor * edit_coef, int32_t il) const {
    GGML_ASSERT(sparq);

    ggml_tensor * v = layers[map_layer_ids.at(il)].v;

    ggml_tensor * rows = ggml_get_rows(ctx, ggml_reshape_2d(ctx, v, v->ne[0], v->ne[1]*v->ne[2]), edit_rows);

    // [n_embd_v_gqa, n_cells] x [n_seq_max, n_cells]^T -> [n_embd_v_gqa, n_seq_max]
    return ggml_out_prod(ctx, rows, edit_coef);
}

ggml_tensor * llama_kv_cache::build_input_kv_rows(ggml_context * ctx, const llama_ubatch & ubatch) const {
    ggml_tensor * res = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, ubatch.n_tokens);

    ggml_set_input(res);
    ggml_set_name(res, "attn_inp_kv_rows");

    return res;
}

ggml_tensor * llama_kv_cache::build_input_kt_idxs(ggml_context * ctx, const llama_ubatch & ubatch) const {
    GGML_ASSERT(sparq && !layers.empty());

    ggml_tensor * res = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, (int64_t) ubatch.n_tokens*layers[0].kt->ne[1]);

    ggml_set_input(res);
    ggml_set_name(res, "attn_inp_kt_idxs");

    return res;
}

ggml_tensor * llama_kv_cache::build_input_seq_tok(ggml_context * ctx, const llama_ubatch & ubatch) const {
    ggml_tensor * res = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_seq_max, ubatch.n_tokens);

    ggml_set_input(res);
    ggml_set_name(res, "attn_inp_seq_tok");

    return res;
}

ggml_tensor * llama_kv_cache::build_input_edit_rows(ggml_context * ctx) const {
    ggml_tensor * res = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, SPARQ_GRAPH_EDIT_CELLS);

    ggml_set_input(res);
    ggml_set_name(res, "attn_inp_edit_rows");

    return res;
}

ggml_tensor * llama_kv_cache::build_input_edit_coef(ggml_context * ctx) const {
    ggml_tensor * res = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_seq_max, SPARQ_GRAPH_EDIT_CELLS);

    ggml_set_input(res);
    ggml_set_name(res, "attn_inp_edit_coef");

    return res;
}

ggml_tensor * llama_kv_cache::build_input_kv_pos(ggml_context * ctx, uint32_t n_kv, const slot_info & sinfo) const {
    const uint32_t ns = sinfo.s1 - sinfo.s0 + 1;

    ggml_tensor * res = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_kv, ns);

    ggml_set_input(res);
    ggml_set_name(res, "attn_inp_kv_pos");

    return res;
}

ggml_tensor * llama_kv_cache::build_input_vmean_seq(ggml_context * ctx, const llama_ubatch & ubatch) const {
    ggml_tensor * res = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, ubatch.n_tokens);

    ggml_set_input(res);
    ggml_set_name(res, "attn_inp_vmean_seq");

    return res;
}

ggml_tensor * llama_kv_cache::build_input_vmean_later(ggml_context * ctx, const llama_ubatch & ubatch) const {
    ggml_tensor * res = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, ubatch.n_tokens, ubatch.n_tokens);

    ggml_set_input(res);
    ggml_set_name(res, "attn_inp_vmean_later");

    return res;
}

ggml_tensor * llama_kv_cache::build_input_vmean_scale(ggml_context * ctx, const llama_ubatch & ubatch) const {
    ggml_tensor * res = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, ubatch.n_tokens);

    ggml_set_input(res);
    ggml_set_name(res, "attn_inp_vmean_scale");

    return res;
}

void llama_kv_cache::set_input_kv_rows(ggml_tensor * dst, const llama_ubatch * ubatch, const slot_info & sinfo) const {
    const uint32_t n_tokens = ubatch->n_tokens;
    GGML_ASSERT(n_tokens == (int64_t) sinfo.size()*sinfo.n_stream());

    GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer));
    int32_t * data = (int32_t *) dst->data;

    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        const int64_t offs = sinfo.strm[s]*get_size();

        for (uint32_t i = 0; i < sinfo.size(); ++i) {
            data[s*sinfo.size() + i] = offs + sinfo.idxs[s][i];
        }
    }
}

void llama_kv_cache::set_input_kt_idxs(ggml_tensor * dst, const llama_ubatch * ubatch, const slot_info & sinfo) const {
    const uint32_t n_tokens = ubatch->n_tokens;
    GGML_ASSERT(n_tokens == (int64_t) sinfo.size()*sinfo.n_stream());

    GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer));
    int64_t * data = (int64_t *) dst->data;

    // element j of the key of token i goes to kt[cell, j, strm]
    const int64_t kv_size      = get_size();
    const int64_t n_embd_k_gqa = layers[0].kt->ne[1];

    for (uint32_t s = 0; s < sinfo.n_stream(); ++s) {
        const int64_t offs = sinfo.strm[s]*kv_size*n_embd_k_gqa;

        for (uint32_t i = 0; i < sinfo.size(); ++i) {
            for (int64_t j = 0; j < n_embd_k_gqa; ++j) {
                data[(s*sinfo.size() + i)*n_embd_k_gqa + j] = offs + j*kv_size + sinfo.idxs[s][i];
            }
        }
    }
}

void llama_kv_cache::set_input_seq_tok(ggml_tensor * dst, const llama_ubatch * ubatch) const {
    GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer));
    float * data = (float *) dst->data;

    std::fill(data, data + ggml_nelements(dst), 0.0f);

    for (uint32_t i = 0; i < ubatch->n_tokens; ++i) {
        for (int32_t s = 0; s < ubatch->n_seq_id[i]; ++s) {
            const llama_seq_id seq_id = ubatch->seq_id[i][s];
            GGML_ASSERT(seq_id >= 0 && (uint32_t) seq_id < n_seq_max);

            data[i*n_seq_max + seq_id] = 1.0f;
        }
    }
}

void llama_kv_cache::set_input_edits(ggml_tensor * rows, ggml_tensor * coef) {
    GGML_ASSERT(ggml_backend_buffer_is_host(rows->buffer));
    GGML_ASSERT(ggml_backend_buffer_is_host(coef->buffer));

    int32_t * r = (int32_t *) rows->data;
    float   * c = (float   *) coef->data;

    // unused slots: row 0 times 0
    std::fill(r, r + SPARQ_GRAPH_EDIT_CELLS, 0);
    std::fill(c, c + ggml_nelements(coef), 0.0f);

    std::map<int32_t, uint32_t> slot_of_row;

    for (uint32_t s = 0; s < n_stream; ++s) {
        for (const auto & [key, d] : sparq_vsum_delta[s]) {
            if (sparq_vsum_pending[key.second]) {
                continue; // summed again anyway
            }

            const int32_t row = (int32_t) (s*get_size() + key.first);

            auto it = slot_of_row.find(row);
            if (it == slot_of_row.end()) {
                GGML_ASSERT(slot_of_row.size() < SPARQ_GRAPH_EDIT_CELLS && "larger edits go to the upkeep graph");
                it = slot_of_row.emplace(row, (uint32_t) slot_of_row.size()).first;
                r[it->second] = row;
            }

            c[it->second*n_seq_max + key.second] += (float) d;
        }
    }

    // the graph applies them now
    sparq_upkeep_n_cells += slot_of_row.size();

    sparq_vsum_delta.assign(n_stream, {});
}

void llama_kv_cache::set_input_kv_pos(ggml_tensor * dst, const slot_info & sinfo) const {
    GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer));
    int32_t * data = (int32_t *) dst->data;

    const int64_t n_kv = dst->ne[0];
    const uint32_t ns  = sinfo.s1 - sinfo.s0 + 1;

    GGML_ASSERT(dst->ne[1] == ns);

    for (uint32_t s = 0; s < ns; ++s) {
        const auto & cells = v_cells[sinfo.s0 + s];

        for (int64_t j = 0; j < n_kv; ++j) {
            data[s*n_kv + j] = cells.is_empty(j) ? -1 : cells.pos_get(j);
        }
    }
}

void llama_kv_cache::set_input_vmean_seq(ggml_tensor * dst, const llama_ubatch * ubatch) const {
    GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer));
    int32_t * data = (int32_t *) dst->data;

    for (uint32_t i = 0; i < ubatch->n_tokens; ++i) {
        data[i] = ubatch->seq_id[i][0];
    }
}

void llama_kv_cache::set_input_vmean_scale(ggml_tensor * dst, const llama_ubatch * ubatch) const {
    GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer));
    float * data = (float *) dst->data;

    // the mean of V over the cells of the sequence that the row sees: all of them (the ubatch is already placed in
    // the cells) but the sequence's later tokens in the ubatch
    for (uint32_t i = 0; i < ubatch->n_tokens; ++i) {
        const llama_seq_id seq_id = ubatch->seq_id[i][0];

        size_t n = v_cells[seq_to_stream[seq_id]].seq_pos_get(seq_id).size();

        for (uint32_t j = 0; j < ubatch->n_tokens; ++j) {
            if (ubatch->seq_id[j][0] == seq_id && ubatch->pos[j] > ubatch->pos[i]) {
                n--;
            }
        }

        data[i] = n > 0 ? 1.0f/n : 0.0f;
    }
}

void llama_kv_cache::set_input_vmean_later(ggml_tensor * dst, const llama_ubatch * ubatch) const {
    GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer));
    float * data = (float *) dst->data;

    const uint32_t n_tokens = ubatch->n_tokens;

    // [n_tokens (row j), n_tokens (token i)], as ggml_out_prod takes it
    for (uint32_t i = 0; i < n_tokens; ++i) {
        for (uint32_t j = 0; j < n_tokens; ++j) {
            const bool later = ubatch->seq_id[i][0] == ubatch->seq_id[j][0] && ubatch->pos[i] > ubatch->pos[j];

            data[i*n_tokens + j] = later ? 1.0f : 0.0f;
        }
    }
}

// a plain state starts with n_stream (at most LLAMA_MAX_SEQ), a state with a sparse attention layout with this tag
static constexpr uint32_t LLAMA_KV_STATE_LAYOUT_MAGIC   = 0x54415053; // "SPAT"
static constexpr uint32_t LLAMA_KV_STATE_LAYOUT_VERSION = 1;

static std::string llama_kv_state_layout_name(uint32_t layout, float alisa_c, uint64_t loki_basis_id) {
    if (layout & LLAMA_KV_STATE_LOKI) {
        return format("Loki (basis %016" PRIx64 ")", loki_basis_id);
    }
    if (layout & LLAMA_KV_STATE_ALISA) {
        return format("ALISA (c = %g)", (double) alisa_c);
    }
    return layout & LLAMA_KV_STATE_KT ? "SparQ" : "dense";
}

void llama_kv_cache::state_write_layout(llama_io_write_i & io) const {
    const uint32_t layout =
        (sparq         ? LLAMA_KV_STATE_KT    : 0) |
        (loki          ? LLAMA_KV_STATE_LOKI  : 0) |
        (alisa_c > 0.0f ? LLAMA_KV_STATE_ALISA : 0);

    if (layout == 0) {
        return;
    }

    io.write(&LLAMA_KV_STATE_LAYOUT_MAGIC,   sizeof(LLAMA_KV_STATE_LAYOUT_MAGIC));
    io.write(&LLAMA_KV_STATE_LAYOUT_VERSION, sizeof(LLAMA_KV_STATE_LAYOUT_VERSION));
    io.write(&layout,        sizeof(layout));
    io.write(&alisa_c,       sizeof(alisa_c));
    io.write(&loki_basis_id, sizeof(loki_basis_id));
}

uint32_t llama_kv_cache::state_read_layout(llama_io_read_i & io, uint32_t & n_stream_cur, float & state_alisa_c) const {
    uint32_t first;
    io.read(&first, sizeof(first));

    uint32_t layout         = 0;
    uint64_t state_basis_id = 0;

    state_alisa_c = 0.0f;

    if (first == LLAMA_KV_STATE_LAYOUT_MAGIC) {
        uint32_t version;
        io.read(&version, sizeof(version));
        if (version != LLAMA_KV_STATE_LAYOUT_VERSION) {
            throw std::runtime_error(format("the state's sparse attention section has version %u, this build reads %u",
                        version, LLAMA_KV_STATE_LAYOUT_VERSION));
        }
        io.read(&layout,         sizeof(layout));
        io.read(&state_alisa_c,  sizeof(state_alisa_c));
        io.read(&state_basis_id, sizeof(state_basis_id));

        // a header is written only for a sparse layout, and ALISA's c is a share of the positions
        const uint32_t known = LLAMA_KV_STATE_KT | LLAMA_KV_STATE_LOKI | LLAMA_KV_STATE_ALISA;
        if (layout == 0 || (layout & ~known) != 0) {
            throw std::runtime_error(format("the state's sparse attention layout 0x%x is not one this build writes", layout));
        }
        const bool alisa_state = (layout & LLAMA_KV_STATE_ALISA) != 0;
        if (alisa_state ? !(state_alisa_c > 0.0f && state_alisa_c <= 1.0f) : state_alisa_c != 0.0f) {
            throw std::runtime_error(format("the state's ALISA c is %g, which its layout 0x%x cannot hold",
                        (double) state_alisa_c, layout));
        }

        io.read(&n_stream_cur, sizeof(n_stream_cur));
    } else {
        n_stream_cur = first;
    }

    // Loki's keys are rotated by its basis and ALISA's state holds its window: either side must match; K^T is
    // an extra (rebuilt when absent, skipped when unused), so SparQ and dense states load into each other
    const uint32_t self = (loki ? LLAMA_KV_STATE_LOKI : 0) | (alisa_c > 0.0f ? LLAMA_KV_STATE_ALISA : 0);
    const uint32_t mask = LLAMA_KV_STATE_LOKI | LLAMA_KV_STATE_ALISA;

    if ((layout & mask) != self || ((layout & LLAMA_KV_STATE_LOKI) && state_basis_id != loki_basis_id)) {
        const uint32_t self_all = self | (sparq ? LLAMA_KV_STATE_KT : 0);
        throw std::runtime_error(format("the state was saved with %s attention, this context uses %s attention",
                    llama_kv_state_layout_name(layout, state_alisa_c, state_basis_id).c_str(),
                    llama_kv_state_layout_name(self_all, alisa_c, loki_basis_id).c_str()));
    }

    return layout;
}

void llama_kv_cache::state_write_kt(llama_io_write_i & io, const cell_ranges_t & cr) const {
    // a K^T still to be rebuilt (a load whose upkeep has not run) is not written: the reader rebuilds it too
    const uint32_t has_kt = sparq_kt_pending[cr.strm] ? 0 : 1;
    io.write(&has_kt, sizeof(has_kt));

    if (!has_kt) {
        return;
    }

    for (const auto & layer : layers) {
        ggml_tensor * kt = layer.kt_stream[cr.strm];

        const int32_t  type   = kt->type;
        const uint32_t n_comp = kt->ne[1];

        io.write(&type,   sizeof(type));
        io.write(&n_comp, sizeof(n_comp));

        // row c of K^T is component c of every cell: the ranges of each row in turn
        const size_t es = ggml_type_size(kt->type);
        for (uint32_t c = 0; c < n_comp; ++c) {
            for (const auto & range : cr.data) {
                io.write_tensor(kt, c*kt->nb[1] + range.first*es, (range.second - range.first)*es);
            }
        }
    }
}

bool llama_kv_cache::state_read_kt(llama_io_read_i & io, uint32_t strm, uint32_t cell_count, const slot_info & sinfo, bool & loaded) {
    loaded = false;

    uint32_t has_kt;
    io.read(&has_kt, sizeof(has_kt));

    if (!has_kt) {
        return true;
    }

    // the runs of consecutive destination cells, as in state_read_data()
    std::vector<std::pair<uint32_t, uint32_t>> runs;
    {
        const auto & idxs = sinfo.idxs[0];
        for (uint32_t i0 = 0; i0 < cell_count; ) {
            uint32_t i1 = i0 + 1;
            while (i1 < cell_count && idxs[i1] == idxs[i1 - 1] + 1) {
                ++i1;
            }
            runs.emplace_back(i0, i1);
            i0 = i1;
        }
    }

    for (const auto & layer : layers) {
        int32_t  type;
        uint32_t n_comp;

        io.read(&type,   sizeof(type));
        io.read(&n_comp, sizeof(n_comp));

        if (type != GGML_TYPE_F16 && type != GGML_TYPE_F32) {
            LLAMA_LOG_ERROR("%s: the state's K^T has type %d, expected F16 or F32\n", __func__, type);
            return false;
        }

        const size_t es = ggml_type_size((ggml_type) type);

        // a context without K^T skips it
        if (!sparq) {
            std::vector<uint8_t> skip(std::min<size_t>((size_t) n_comp*cell_count*es, 1u << 20));
            for (size_t left = (size_t) n_comp*cell_count*es; left > 0; left -= std::min(left, skip.size())) {
                io.read(skip.data(), std::min(left, skip.size()));
            }
            continue;
        }

        ggml_tensor * kt = layer.kt_stream[strm];

        if (type != (int32_t) kt->type || n_comp != kt->ne[1]) {
            LLAMA_LOG_ERROR("%s: the state's K^T is %s [%u], this cache's %s [%" PRId64 "]\n", __func__,
                    ggml_type_name((ggml_type) type), n_comp, ggml_type_name(kt->type), kt->ne[1]);
            return false;
        }

        const auto & idxs = sinfo.idxs[0];
        for (uint32_t c = 0; c < n_comp; ++c) {
            for (const auto & [i0, i1] : runs) {
                io.read_tensor(kt, c*kt->nb[1] + idxs[i0]*es, (i1 - i0)*es);
            }
        }
    }

    loaded = sparq;

    return true;
}

void llama_kv_cache::state_write_alisa(llama_io_write_i & io, const cell_ranges_t & cr) const {
    // the steps are the written cells in order of position; the ring holds the last of them
    const uint32_t n_steps   = v_cells[cr.strm].get_used();
    const uint32_t n_written = std::min(n_steps, alisa_n_ring);

    io.write(&n_written, sizeof(n_written));

    const size_t kv_size = v_cells[cr.strm].size();

    std::vector<float> row(kv_size);
    for (const auto & layer : layers) {
        for (uint32_t j = n_steps - n_written; j < n_steps; ++j) {
            ggml_backend_tensor_get(layer.alisa_ring, row.data(), (j % alisa_n_ring)*layer.alisa_ring->nb[1], kv_size*sizeof(float));
            for (const auto & range : cr.data) {
                io.write(row.data() + range.first, (range.second - range.first)*sizeof(float));
            }
        }
    }
}

bool llama_kv_cache::state_read_alisa(llama_io_read_i & io, uint32_t cell_count, const slot_info & sinfo, float state_alisa_c) {
    uint32_t n_written;
    io.read(&n_written, sizeof(n_written));

    // the read cells are the steps: the window of the next one needs its steps
    if (n_written > cell_count || alisa_window_start(cell_count, alisa_c) < cell_count - n_written) {
        LLAMA_LOG_ERROR("%s: ALISA: the state holds the weights of %u of %u steps (saved with c = %g), the window of "
                "this context (c = %g) needs more\n", __func__, n_written, cell_count, (double) state_alisa_c, (double) alisa_c);
        return false;
    }

    const auto & idxs    = sinfo.idxs[0];
    const size_t kv_size = v_cells[0].size();

    std::vector<float> vals(cell_count);
    std::vector<float> row(kv_size);
    for (const auto & layer : layers) {
        for (uint32_t j = cell_count - n_written; j < cell_count; ++j) {
            io.read(vals.data(), cell_count*sizeof(float));
            if (j + alisa_n_ring < cell_count) {
                continue; // older than this context's ring
            }
            std::fill(row.begin(), row.end(), 0.0f);
            for (uint32_t i = 0; i < cell_count; ++i) {
                row[idxs[i]] = vals[i];
            }
            ggml_backend_tensor_set(layer.alisa_ring, row.data(), (j % alisa_n_ring)*layer.alisa_ring->nb[1], kv_size*sizeof(float));
        }
    }

    alisa_resum = true;

    return true;
}

void llama_kv_cache::sparq_vsum_edit(uint32_t strm, uint32_t i, const llama_kv_cells::seq_set_t & seqs_old) {
    if (!sparq) {
        return;
    }

    const auto & seqs_new = v_cells[strm].seq_get_all(i);

    if (seqs_new == seqs_old) {
        return;
    }

    auto & delta = sparq_vsum_delta[strm];

    for (uint32_t s = 0; s < n_seq_max; ++s) {
        const int32_t d = (int32_t) seqs_new.test(s) - (int32_t) seqs_old.test(s);

        if (d == 0) {
            continue;
        }

        const auto key = std::make_pair(i, (llama_seq_id) s);

        auto it = delta.emplace(key, 0).first;

        it->second += d;

        if (it->second == 0) {
            delta.erase(it);
        }
    }
}

void llama_kv_cache::sparq_invalidate() {
    if (!sparq) {
        return;
    }

    std::fill(sparq_vsum_pending.begin(), sparq_vsum_pending.end(), true);

    sparq_vsum_delta.assign(n_stream, {});
}

uint64_t llama_kv_cache::get_sparq_upkeep_n_cells() const {
    return sparq_upkeep_n_cells;
}

bool llama_kv_cache::get_has_sparq_upkeep() const {
    if (!sparq || hparams.no_alloc) {
        return false;
    }

    if (std::find(sparq_kt_pending.begin(),   sparq_kt_pending.end(),   true) != sparq_kt_pending.end() ||
        std::find(sparq_vsum_pending.begin(), sparq_vsum_pending.end(), true) != sparq_vsum_pending.end()) {
        return true;
    }

    // edits of a few cells are left to the next decode graph
    std::set<std::pair<uint32_t, uint32_t>> edited;

    for (uint32_t s = 0; s < n_stream; ++s) {
        for (const auto & [key, _] : sparq_vsum_delta[s]) {
            edited.emplace(s, key.first);

            if (edited.size() > SPARQ_GRAPH_EDIT_CELLS) {
                return true;
            }
        }
    }

    return false;
}

void llm_graph_input_sparq_upkeep::set_input(const llama_ubatch * ubatch) {
    GGML_UNUSED(ubatch);

    for (const auto & ss : sums) {
        kv_self->set_input_sparq_member(ss.member, ss.strm, ss.seq_ids);

        GGML_ASSERT(ggml_backend_buffer_is_host(ss.rows->buffer));
        int64_t * data = (int64_t *) ss.rows->data;

        for (size_t i = 0; i < ss.seq_ids.size(); ++i) {
            data[i] = ss.seq_ids[i];
        }
    }

    if (edits.rows_v) {
        GGML_ASSERT(ggml_backend_buffer_is_host(edits.rows_v->buffer));
        GGML_ASSERT(ggml_backend_buffer_is_host(edits.coefs ->buffer));
        GGML_ASSERT(ggml_backend_buffer_is_host(edits.rows  ->buffer));

        std::copy(edits.cells  .begin(), edits.cells  .end(), (int32_t *) edits.rows_v->data);
        std::copy(edits.coef   .begin(), edits.coef   .end(), (float   *) edits.coefs ->data);
        std::copy(edits.seq_ids.begin(), edits.seq_ids.end(), (int32_t *) edits.rows  ->data);
    }
}

void llama_kv_cache::set_input_sparq_member(ggml_tensor * dst, uint32_t strm, const std::vector<llama_seq_id> & seq_ids) const {
    GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer));
    float * data = (float *) dst->data;

    const auto & cells = v_cells[strm];

    const int64_t n_seq   = seq_ids.size();
    const int64_t n_cells = dst->ne[1];
    const int64_t n_used  = std::min<int64_t>(cells.used_max_p1(), n_cells);

    std::fill(data, data + ggml_nelements(dst), 0.0f);

    for (int64_t i = 0; i < n_used; ++i) {
        if (cells.is_empty(i)) {
            continue;
        }

        for (int64_t j = 0; j < n_seq; ++j) {
            if (cells.seq_has(i, seq_ids[j])) {
                data[i*n_seq + j] = 1.0f;
            }
        }
    }
}

// cells of a quantized K dequantized at a time for the transposed copy (F32 scratch of at most this size)
static constexpr size_t SPARQ_UPKEEP_CHUNK_BYTES = 64u*1024u*1024u;

// the V sums are summed in this many parts of the cells, so that every thread has work, then added
static constexpr int64_t SPARQ_UPKEEP_VSUM_PARTS = 16;

ggml_cgraph * llama_kv_cache::build_graph_sparq_upkeep(llm_graph_result * res, size_t il0, size_t & il1) const {
    auto * ctx = res->get_ctx();
    auto * gf  = res->get_gf();

    auto inp = std::make_unique<llm_graph_input_sparq_upkeep>(this);

    const int64_t kv_size = get_size();
    const int64_t n_parts = kv_size % SPARQ_UPKEEP_VSUM_PARTS == 0 ? SPARQ_UPKEEP_VSUM_PARTS : 1;

    for (uint32_t s = 0; s < n_stream; ++s) {
        llm_graph_input_sparq_upkeep::stream_sums ss;

        for (uint32_t seq_id = 0; seq_id < n_seq_max; ++seq_id) {
            if (sparq_vsum_pending[seq_id] && seq_to_stream[seq_id] == s) {
                ss.seq_ids.push_back(seq_id);
            }
        }

        if (ss.seq_ids.empty()) {
            continue;
        }

        // at least one part of cells, so that a stream without cells gets sums of zero
        const int64_t n_used = std::max<int64_t>(v_cells[s].used_max_p1(), 1);

        ss.strm    = s;
        ss.n_cells = std::min(kv_size, (n_used + n_parts - 1)/n_parts*n_parts);

        ss.member = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, ss.seq_ids.size(), ss.n_cells);
        ss.rows   = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, ss.seq_ids.size());

        ggml_set_input(ss.member);
        ggml_set_input(ss.rows);

        inp->sums.push_back(std::move(ss));
    }

    // the edits of the other sequences: O(cells edited)
    {
        auto & ed = inp->edits;

        std::map<int32_t, int32_t>      col_of_cell;
        std::map<llama_seq_id, int32_t> row_of_seq;

        for (uint32_t s = 0; s < n_stream; ++s) {
            for (const auto & [key, d] : sparq_vsum_delta[s]) {
                if (sparq_vsum_pending[key.second]) {
                    continue;
                }

                col_of_cell.emplace((int32_t) (s*kv_size + key.first), 0);
                row_of_seq .emplace(key.second, 0);
            }
        }

        for (auto & [cell, col] : col_of_cell) {
            col = ed.cells.size();
            ed.cells.push_back(cell);
        }

        for (auto & [seq_id, row] : row_of_seq) {
            row = ed.seq_ids.size();
            ed.seq_ids.push_back(seq_id);
        }

        const int64_t n_seq = ed.seq_ids.size();

        ed.coef.assign(n_seq*ed.cells.size(), 0.0f);

        for (uint32_t s = 0; s < n_stream; ++s) {
            for (const auto & [key, d] : sparq_vsum_delta[s]) {
                if (sparq_vsum_pending[key.second]) {
                    continue;
                }

                const int32_t col = col_of_cell.at((int32_t) (s*kv_size + key.first));

                ed.coef[col*n_seq + row_of_seq.at(key.second)] += (float) d;
            }
        }

        if (!ed.cells.empty()) {
            ed.rows_v = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, ed.cells.size());
            ed.coefs  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_seq, ed.cells.size());
            ed.rows   = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_seq);

            ggml_set_input(ed.rows_v);
            ggml_set_input(ed.coefs);
            ggml_set_input(ed.rows);
        }
    }

    // nodes one layer may add, to split the layers over several graphs if needed
    auto n_nodes_layer = [&](const kv_layer & layer) {
        int64_t n = 0;

        for (uint32_t s = 0; s < n_stream; ++s) {
            if (!sparq_kt_pending[s]) {
                continue;
            }

            const int64_t n_used  = v_cells[s].used_max_p1();
            const int64_t chunk   = std::max<int64_t>(256, SPARQ_UPKEEP_CHUNK_BYTES/(layer.k->ne[0]*sizeof(float)));
            const int64_t n_chunk = ggml_is_quantized(layer.k->type) ? (n_used + chunk - 1)/chunk : 1;

            n += 5*n_chunk;
        }

        return n + 8*(int64_t) inp->sums.size() + (inp->edits.rows_v ? 8 : 0);
    };

    il1 = il0;

    while (il1 < layers.size()) {
        const auto & layer = layers[il1];

        if (il1 > il0 && ggml_graph_n_nodes(gf) + n_nodes_layer(layer) > ggml_graph_size(gf)) {
            break;
        }

        ggml_tensor * k    = layer.k;
        ggml_tensor * v    = layer.v;
        ggml_tensor * kt   = layer.kt;
        ggml_tensor * vsum = layer.vsum;

        const int64_t n_embd_k_gqa = k->ne[0];
        const int64_t n_embd_v_gqa = v->ne[0];

        // K^T from K: a transposed copy of the used cells, through F32 chunks for a quantized K
        for (uint32_t s = 0; s < n_stream; ++s) {
            if (!sparq_kt_pending[s]) {
                continue;
            }

            const int64_t n_used = v_cells[s].used_max_p1();
            const int64_t chunk  = ggml_is_quantized(k->type) ?
                std::max<int64_t>(256, SPARQ_UPKEEP_CHUNK_BYTES/(n_embd_k_gqa*sizeof(float))) : n_used;

            for (int64_t c0 = 0; c0 < n_used; c0 += chunk) {
                const int64_t n = std::min(chunk, n_used - c0);

                ggml_tensor * src = ggml_view_2d(ctx, k, n_embd_k_gqa, n, k->nb[1], s*k->nb[2] + c0*k->nb[1]);

                if (ggml_is_quantized(src->type)) {
                    src = ggml_cast(ctx, src, GGML_TYPE_F32);
                }

                ggml_tensor * dst = ggml_view_2d(ctx, kt, n, n_embd_k_gqa, kt->nb[1], s*kt->nb[2] + c0*kt->nb[0]);

                ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_transpose(ctx, src), dst));
            }
        }

        // the sums of V of the pending sequences: the cells times a sequence membership matrix, in parts
        for (const auto & ss : inp->sums) {
            const int64_t n_seq  = ss.seq_ids.size();
            const int64_t n_part = ss.n_cells/n_parts;

            ggml_tensor * v_parts = ggml_view_3d(ctx, v, n_embd_v_gqa, n_part, n_parts, v->nb[1], n_part*v->nb[1], ss.strm*v->nb[2]);
            ggml_tensor * m_parts = ggml_reshape_3d(ctx, ss.member, n_seq, n_part, n_parts);

            ggml_tensor * cur = ggml_out_prod(ctx, v_parts, m_parts);                   // [n_embd_v_gqa, n_seq, n_parts]
            cur = ggml_sum_rows(ctx, ggml_cont(ctx, ggml_permute(ctx, cur, 1, 2, 0, 3))); // [1, n_embd_v_gqa, n_seq]
            cur = ggml_reshape_2d(ctx, cur, n_embd_v_gqa, n_seq);

            ggml_build_forward_expand(gf, ggml_set_rows(ctx, vsum, cur, ss.rows));
        }

        // the edits: the sums plus the edited rows of V times their +1/-1
        if (inp->edits.rows_v) {
            const auto & ed = inp->edits;

            ggml_tensor * v_rows = ggml_get_rows(ctx, ggml_reshape_2d(ctx, v, n_embd_v_gqa, kv_size*n_stream), ed.rows_v);

            ggml_tensor * cur = ggml_get_rows(ctx, vsum, ed.rows);             // [n_embd_v_gqa, n_seq]
            cur = ggml_add(ctx, cur, ggml_out_prod(ctx, v_rows, ed.coefs));

            ggml_build_forward_expand(gf, ggml_set_rows(ctx, vsum, cur, ed.rows));
        }

        ++il1;
    }

    res->add_input(std::move(inp));

    return gf;
}

bool llama_kv_cache::sparq_upkeep(llama_context * lctx) {
    auto * sched = lctx->get_sched();

    // the rows of K and of V the upkeep reads (per layer): K of the streams whose K^T is rebuilt, V of the
    // streams with sums to recompute, else V of the edited cells
    {
        std::set<std::pair<uint32_t, uint32_t>> edited;

        for (uint32_t s = 0; s < n_stream; ++s) {
            if (sparq_kt_pending[s]) {
                sparq_upkeep_n_cells += v_cells[s].used_max_p1();
            }

            bool whole = false;
            for (uint32_t seq_id = 0; seq_id < n_seq_max; ++seq_id) {
                whole = whole || (sparq_vsum_pending[seq_id] && seq_to_stream[seq_id] == s);
            }

            if (whole) {
                sparq_upkeep_n_cells += v_cells[s].used_max_p1();
                continue;
            }

            for (const auto & [key, _] : sparq_vsum_delta[s]) {
                if (!sparq_vsum_pending[key.second]) {
                    edited.emplace(s, key.first);
                }
            }
        }

        sparq_upkeep_n_cells += edited.size();
    }

    for (size_t il0 = 0; il0 < layers.size(); ) {
        ggml_backend_sched_reset(sched);

        auto * res = lctx->get_gf_res_reserve();

        res->reset();

        size_t il1 = il0;

        auto * gf = build_graph_sparq_upkeep(res, il0, il1);
        if (!ggml_backend_sched_alloc_graph(sched, gf)) {
            LLAMA_LOG_ERROR("%s: failed to allocate compute graph for the SparQ cache upkeep\n", __func__);
            return false;
        }

        res->set_inputs(nullptr);

        if (lctx->graph_compute(gf, false) != GGML_STATUS_SUCCESS) {
            LLAMA_LOG_ERROR("%s: failed to compute the SparQ cache upkeep\n", __func__);
            return false;
        }

        il0 = il1;
    }

    std::fill(sparq_kt_pending.begin(),   sparq_kt_pending.end(),   false);
    std::fill(sparq_vsum_pending.begin(), sparq_vsum_pending.end(), false);

    sparq_vsum_delta.assign(n_stream, {});

    return true;
}

//
// llama_kv_cache_context: the same, for the graph of one ubatch
//

float llama_kv_cache_context::get_alisa_c() const {
    return kv->get_alisa_c();
}

uint32_t llama_kv_cache_context::get_alisa_n_ring() const {
    return kv->get_alisa_n_ring();
}

bool llama_kv_cache_context::get_alisa_resum() const {
    return kv->get_alisa_resum();
}

std::vector<std::pair<int32_t, float>> llama_kv_cache_context::alisa_rewind_rows(float c) const {
    return kv->alisa_rewind_rows(c);
}

void llama_kv_cache_context::set_input_alisa_rewind(ggml_tensor * rows, ggml_tensor * coef, float c) const {
    kv->set_input_alisa_rewind(rows, coef, c);
}

ggml_tensor * llama_kv_cache_context::get_alisa_sums(int32_t il) const {
    return kv->get_alisa_sums(il);
}

ggml_tensor * llama_kv_cache_context::get_alisa_ring(int32_t il) const {
    return kv->get_alisa_ring(il);
}

uint32_t llama_kv_cache_context::alisa_n_record(uint32_t n_tokens) const {
    return kv->alisa_n_record(n_tokens);
}

void llama_kv_cache_context::set_input_alisa(ggml_tensor * slots, ggml_tensor * leave, ggml_tensor * window, float c, uint32_t n_tokens, bool decode) const {
    kv->set_input_alisa(slots, leave, window, c, n_tokens, decode);
}

bool llama_kv_cache_context::get_has_sparq() const {
    return kv->get_has_sparq();
}

ggml_tensor * llama_kv_cache_context::get_kt(ggml_context * ctx, int32_t il) const {
    return kv->get_kt(ctx, il, n_kv, sinfos[i_cur]);
}

ggml_tensor * llama_kv_cache_context::cpy_kt(ggml_context * ctx, ggml_tensor * k_stored, ggml_tensor * kv_rows, ggml_tensor * kt_idxs, int32_t il) const {
    return kv->cpy_kt(ctx, k_stored, kv_rows, kt_idxs, il);
}

ggml_tensor * llama_kv_cache_context::get_vsum_edits(ggml_context * ctx, ggml_tensor * edit_rows, ggml_tensor * edit_coef, int32_t il) const {
    return kv->get_vsum_edits(ctx, edit_rows, edit_coef, il);
}

ggml_tensor * llama_kv_cache_context::build_input_kv_rows(ggml_context * ctx, const llama_ubatch & ubatch) const {
    return kv->build_input_kv_rows(ctx, ubatch);
}

ggml_tensor * llama_kv_cache_context::build_input_kt_idxs(ggml_context * ctx, const llama_ubatch & ubatch) const {
    return kv->build_input_kt_idxs(ctx, ubatch);
}

ggml_tensor * llama_kv_cache_context::build_input_seq_tok(ggml_context * ctx, const llama_ubatch & ubatch) const {
    return kv->build_input_seq_tok(ctx, ubatch);
}

ggml_tensor * llama_kv_cache_context::build_input_edit_rows(ggml_context * ctx) const {
    return kv->build_input_edit_rows(ctx);
}

ggml_tensor * llama_kv_cache_context::build_input_edit_coef(ggml_context * ctx) const {
    return kv->build_input_edit_coef(ctx);
}

ggml_tensor * llama_kv_cache_context::build_input_kv_pos(ggml_context * ctx) const {
    return kv->build_input_kv_pos(ctx, n_kv, sinfos[i_cur]);
}

ggml_tensor * llama_kv_cache_context::build_input_vmean_seq(ggml_context * ctx, const llama_ubatch & ubatch) const {
    return kv->build_input_vmean_seq(ctx, ubatch);
}

ggml_tensor * llama_kv_cache_context::build_input_vmean_scale(ggml_context * ctx, const llama_ubatch & ubatch) const {
    return kv->build_input_vmean_scale(ctx, ubatch);
}

ggml_tensor * llama_kv_cache_context::build_input_vmean_later(ggml_context * ctx, const llama_ubatch & ubatch) const {
    return kv->build_input_vmean_later(ctx, ubatch);
}

void llama_kv_cache_context::set_input_kv_rows(ggml_tensor * dst, const llama_ubatch * ubatch) const {
    kv->set_input_kv_rows(dst, ubatch, sinfos[i_cur]);
}

void llama_kv_cache_context::set_input_kt_idxs(ggml_tensor * dst, const llama_ubatch * ubatch) const {
    kv->set_input_kt_idxs(dst, ubatch, sinfos[i_cur]);
}

void llama_kv_cache_context::set_input_seq_tok(ggml_tensor * dst, const llama_ubatch * ubatch) const {
    kv->set_input_seq_tok(dst, ubatch);
}

void llama_kv_cache_context::set_input_edits(ggml_tensor * rows, ggml_tensor * coef) const {
    kv->set_input_edits(rows, coef);
}

void llama_kv_cache_context::set_input_kv_pos(ggml_tensor * dst) const {
    kv->set_input_kv_pos(dst, sinfos[i_cur]);
}

void llama_kv_cache_context::set_input_vmean_seq(ggml_tensor * dst, const llama_ubatch * ubatch) const {
    kv->set_input_vmean_seq(dst, ubatch);
}

void llama_kv_cache_context::set_input_vmean_scale(ggml_tensor * dst, const llama_ubatch * ubatch) const {
    kv->set_input_vmean_scale(dst, ubatch);
}

void llama_kv_cache_context::set_input_vmean_later(ggml_tensor * dst, const llama_ubatch * ubatch) const {
    kv->set_input_vmean_later(dst, ubatch);
}
