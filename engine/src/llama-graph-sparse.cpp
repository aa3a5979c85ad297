#include "llama-graph.h"

#include "llama-impl.h"
#include "llama-batch.h"
#include "llama-cparams.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>

// the graph of sparse attention (SparQ, Loki, ALISA): which rows of a ubatch attend sparsely, their inputs, and
// the attention itself with the cache's K^T, V sums and ALISA window (llama-kv-cache-sparse.cpp)

// SparQ, Loki: a sequence with one token in a ubatch, or with at most this many that all ask for their logits (a
// speculative verification), is decoding: its rows attend sparsely, each to the cells it sees, as they would one at
// a time; a sequence with more tokens or with rows that ask for none (a prompt, also its small chunks) attends
// densely unless the prompt is sparse too
static constexpr uint32_t LLM_GRAPH_SPARSE_DECODE_MAX_TOKENS = 16;

// SparQ, Loki: whether token i of the ubatch is a decode row (its one sequence is decoding, see above)
static std::vector<bool> llm_graph_sparse_decode_rows(const llama_ubatch & ubatch) {
    std::vector<uint32_t> n_tok(LLAMA_MAX_SEQ, 0);
    std::vector<uint32_t> n_out(LLAMA_MAX_SEQ, 0);

    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        for (int32_t s = 0; s < ubatch.n_seq_id[i]; ++s) {
            n_tok[ubatch.seq_id[i][s]]++;
            n_out[ubatch.seq_id[i][s]] += ubatch.output && ubatch.output[i] ? 1 : 0;
        }
    }

    std::vector<bool> res(ubatch.n_tokens);

    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        if (ubatch.n_seq_id[i] != 1) {
            continue;
        }

        const llama_seq_id seq_id = ubatch.seq_id[i][0];

        res[i] = n_tok[seq_id] == 1 || (n_tok[seq_id] <= LLM_GRAPH_SPARSE_DECODE_MAX_TOKENS && n_out[seq_id] == n_tok[seq_id]);
    }

    return res;
}

// SparQ, Loki: every row of the ubatch is a decode row
static bool llm_graph_sparse_all_decode(const llama_ubatch & ubatch) {
    if (ubatch.n_tokens > 0 && ubatch.n_seq_id[0] == 0) {
        // a worst-case ubatch of the graph reserve has no sequence ids (and asks for no logits)
        return ubatch.n_seq_tokens == 1;
    }

    const auto decode = llm_graph_sparse_decode_rows(ubatch);

    return std::all_of(decode.begin(), decode.end(), [](bool d) { return d; });
}

// SparQ: some sequence has several decode rows in the ubatch: each row's mean of V leaves out its later tokens
static bool llm_graph_sparq_several_rows_per_seq(const llama_ubatch & ubatch) {
    std::bitset<LLAMA_MAX_SEQ> seen;

    const auto decode = llm_graph_sparse_decode_rows(ubatch);

    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        if (!decode[i]) {
            continue;
        }

        const llama_seq_id seq_id = ubatch.seq_id[i][0];

        if (seen[seq_id]) {
            return true;
        }

        seen[seq_id] = true;
    }

    return false;
}

// SparQ, Loki: a ubatch (of a unified cache) with both decode rows and others: each row's attention then depends
// only on its own sequence, as it would alone: the decode rows sparse, the others dense
static bool llm_graph_sparse_split(const llama_cparams & cparams, const llama_ubatch & ubatch) {
    if (cparams.sparse_attn.sparse_prompt || !cparams.kv_unified || ubatch.n_tokens < 2) {
        return false;
    }

    bool any_decode = false;
    bool any_other  = false;

    for (const bool d : llm_graph_sparse_decode_rows(ubatch)) {
        any_decode |=  d;
        any_other  |= !d;
    }

    return any_decode && any_other;
}

// SparQ, Loki: whether the attention of the ubatch uses ggml_sparq_attn / ggml_loki_attn (for all rows, or for the
// decode rows of a split ubatch)
static bool llm_graph_sparse_use(const llama_cparams & cparams, const llama_ubatch & ubatch, uint32_t n_kv) {
    const auto & sa = cparams.sparse_attn;

    const bool sparq = cparams.sparse_attn_kt && sa.mode == LLAMA_SPARSE_ATTN_SPARQ;
    const bool loki  = cparams.loki_proj      && sa.mode == LLAMA_SPARSE_ATTN_LOKI;

    if (!(sparq || loki) || !cparams.flash_attn || cparams.training) {
        return false;
    }

    if ((int64_t) n_kv < sa.min_n_kv) {
        return false;
    }

    return sa.sparse_prompt || llm_graph_sparse_all_decode(ubatch) || llm_graph_sparse_split(cparams, ubatch);
}

// ALISA: whether the ubatch is a decode step by ggml_alisa_attn (else its rows attend densely and their weights are
// recorded); one sequence, so a decode step is a ubatch of one token
static bool llm_graph_alisa_decode(const llama_cparams & cparams, const llama_ubatch & ubatch, uint32_t n_kv) {
    const auto & sa = cparams.sparse_attn;

    return cparams.alisa_c > 0.0f && sa.mode == LLAMA_SPARSE_ATTN_ALISA && cparams.flash_attn && !cparams.training &&
        ubatch.n_tokens == 1 && (int64_t) n_kv >= sa.min_n_kv;
}

// SparQ: whether the mean of V can come from the per-sequence sums
// true when every sparse row is a decode row (its sums less its sequence's later tokens in the ubatch), no M-RoPE
static bool llm_graph_sparq_vmean(const llama_hparams & hparams, const llama_cparams & cparams, const llama_ubatch & ubatch) {
    if (cparams.sparse_attn.mode != LLAMA_SPARSE_ATTN_SPARQ || !cparams.sparse_attn.mean_value || hparams.n_pos_per_embd() > 1) {
        return false;
    }

    if (llm_graph_sparse_split(cparams, ubatch)) {
        return true; // only the decode rows use it, and each sees all the cells of its one sequence
    }

    return llm_graph_sparse_all_decode(ubatch);
}

void llm_graph_input_sparse_attn::set_input(const llama_ubatch * ubatch, const llama_kv_cache_context * mctx) const {
    if (kv_rows && kv_rows->buffer) {
        mctx->set_input_kv_rows(kv_rows, ubatch);
    }

    if (kt_idxs && kt_idxs->buffer) {
        mctx->set_input_kt_idxs(kt_idxs, ubatch);
    }

    if (seq_tok && seq_tok->buffer) {
        mctx->set_input_seq_tok(seq_tok, ubatch);
    }

    // the graph applies the pending cache edits (each graph once: they are taken from the cache here)
    if (edit_rows && edit_rows->buffer) {
        mctx->set_input_edits(edit_rows, edit_coef);
    }

    if (kv_pos && kv_pos->buffer) {
        mctx->set_input_kv_pos(kv_pos);
    }

    if (vmean_seq && vmean_seq->buffer) {
        mctx->set_input_vmean_seq(vmean_seq, ubatch);
    }

    if (vmean_scale && vmean_scale->buffer) {
        mctx->set_input_vmean_scale(vmean_scale, ubatch);
    }

    if (vmean_later && vmean_later->buffer) {
        mctx->set_input_vmean_later(vmean_later, ubatch);
    }

    // before set_input_alisa(), which clears the rewind
    if (alisa_rewind_rows && alisa_rewind_rows->buffer) {
        mctx->set_input_alisa_rewind(alisa_rewind_rows, alisa_rewind_coef, alisa_c_cur);
    }

    if (alisa_slots && alisa_slots->buffer) {
        mctx->set_input_alisa(alisa_slots, alisa_leave, alisa_window, alisa_c_cur, alisa_n_tok, alisa_decode);
    }

    if (alisa_ones && alisa_ones->buffer) {
        GGML_ASSERT(ggml_backend_buffer_is_host(alisa_ones->buffer));
        std::fill((float *) alisa_ones->data, (float *) alisa_ones->data + alisa_ones->ne[0]*alisa_ones->ne[1], 1.0f);
    }

    if (rows_order && rows_order->buffer) {
        GGML_ASSERT(ggml_backend_buffer_is_host(rows_sparse->buffer));
        GGML_ASSERT(ggml_backend_buffer_is_host(rows_dense->buffer));
        GGML_ASSERT(ggml_backend_buffer_is_host(rows_order->buffer));

        const auto decode = llm_graph_sparse_decode_rows(*ubatch);

        int32_t * sp = (int32_t *) rows_sparse->data;
        int32_t * dn = (int32_t *) rows_dense ->data;
        int32_t * od = (int32_t *) rows_order ->data;

        const int32_t n_sp = rows_sparse->ne[0];
        GGML_ASSERT(n_sp + rows_dense->ne[0] == (int64_t) ubatch->n_tokens);

        int32_t i_sp = 0;
        int32_t i_dn = 0;
        for (uint32_t i = 0; i < ubatch->n_tokens; ++i) {
            if (decode[i]) {
                od[i] = i_sp;
                sp[i_sp++] = i;
            } else {
                od[i] = n_sp + i_dn;
                dn[i_dn++] = i;
            }
        }
        GGML_ASSERT(i_sp == n_sp);
    }
}

bool llm_graph_input_sparse_attn::can_reuse(const llm_graph_params & params, const llama_kv_cache_context * mctx) const {
    // ALISA: the ring rows, the step leaving and the resum change with every step
    if (params.cparams.alisa_c > 0.0f) {
        return false;
    }

    if (!use && !kv_rows && !params.cparams.loki_proj) {
        return true;
    }

    bool res = true;

    res &= use == llm_graph_sparse_use(params.cparams, params.ubatch, mctx->get_n_kv());
    // the split's row counts are part of the graph
    res &= rows_order == nullptr && !llm_graph_sparse_split(params.cparams, params.ubatch);
    res &= (vmean_seq != nullptr) == (use && llm_graph_sparq_vmean(params.hparams, params.cparams, params.ubatch));
    res &= (vmean_later != nullptr) == (vmean_seq != nullptr && llm_graph_sparq_several_rows_per_seq(params.ubatch));

    return res;
}

void llm_graph_input_sparse_attn::build(
        ggml_context * ctx0, const llama_ubatch & ubatch, const llama_hparams & hparams, const llama_cparams & cparams,
        const llama_kv_cache_context * mctx) {
    if (cparams.training) {
        return;
    }

    // ALISA: a decode step by the op, or the weights of the rows recorded
    if (mctx->get_alisa_c() > 0.0f) {
        alisa_decode = llm_graph_alisa_decode(cparams, ubatch, mctx->get_n_kv());
        alisa_n_tok  = ubatch.n_tokens;
        alisa_c_cur  = cparams.alisa_c_window;

        if (alisa_decode) {
            kv_pos      = mctx->build_input_kv_pos(ctx0);
            alisa_resum = mctx->get_alisa_resum();

            // after removing the end: the few ring rows between the sums' window and this step's, or all of it
            if (!alisa_resum) {
                const auto rr = mctx->alisa_rewind_rows(alisa_c_cur);
                if (rr.size() > llama_kv_cache::ALISA_REWIND_MAX_ROWS) {
                    alisa_resum = true;
                } else if (!rr.empty()) {
                    alisa_rewind_rows = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, rr.size());
                    alisa_rewind_coef = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, 1, rr.size());
                    ggml_set_input(alisa_rewind_rows);
                    ggml_set_input(alisa_rewind_coef);
                    ggml_set_name(alisa_rewind_rows, "attn_inp_alisa_rewind_rows");
                    ggml_set_name(alisa_rewind_coef, "attn_inp_alisa_rewind_coef");
                }
            }
            alisa_slots = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, 1);
            alisa_leave = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, 1);
            ggml_set_input(alisa_slots);
            ggml_set_input(alisa_leave);
            ggml_set_name(alisa_slots, "attn_inp_alisa_slots");
            ggml_set_name(alisa_leave, "attn_inp_alisa_leave");
        } else {
            alisa_slots = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, mctx->alisa_n_record(ubatch.n_tokens));
            uint32_t n_head_max = 0;
            for (uint32_t il = 0; il < hparams.n_layer(); ++il) {
                n_head_max = std::max(n_head_max, hparams.n_head(il));
            }
            alisa_ones  = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, 1, n_head_max);
            ggml_set_input(alisa_slots);
            ggml_set_input(alisa_ones);
            ggml_set_name(alisa_slots, "attn_inp_alisa_slots");
            ggml_set_name(alisa_ones,  "attn_inp_alisa_ones");
        }

        if (!alisa_decode || alisa_resum) {
            alisa_window = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, 1, mctx->get_alisa_n_ring() + 1);
            ggml_set_input(alisa_window);
            ggml_set_name(alisa_window, "attn_inp_alisa_window");
        }
        return;
    }

    // Loki: only the cell positions (for the local window and ties)
    if (cparams.loki_proj) {
        use = llm_graph_sparse_use(cparams, ubatch, mctx->get_n_kv());

        if (use) {
            kv_pos = mctx->build_input_kv_pos(ctx0);
        }
    }

    if (mctx->get_has_sparq()) {
        kv_rows = mctx->build_input_kv_rows(ctx0, ubatch);
        kt_idxs = mctx->build_input_kt_idxs(ctx0, ubatch);
        seq_tok = mctx->build_input_seq_tok(ctx0, ubatch);

        edit_rows = mctx->build_input_edit_rows(ctx0);
        edit_coef = mctx->build_input_edit_coef(ctx0);

        use = llm_graph_sparse_use(cparams, ubatch, mctx->get_n_kv());

        if (use) {
            kv_pos = mctx->build_input_kv_pos(ctx0);

            if (llm_graph_sparq_vmean(hparams, cparams, ubatch)) {
                vmean_seq   = mctx->build_input_vmean_seq  (ctx0, ubatch);
                vmean_scale = mctx->build_input_vmean_scale(ctx0, ubatch);

                if (llm_graph_sparq_several_rows_per_seq(ubatch)) {
                    vmean_later = mctx->build_input_vmean_later(ctx0, ubatch);
                }
            }
        }
    }

    if (use && llm_graph_sparse_split(cparams, ubatch)) {
        const auto    decode = llm_graph_sparse_decode_rows(ubatch);
        const int64_t n_sp   = std::count(decode.begin(), decode.end(), true);

        rows_sparse = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, n_sp);
        rows_dense  = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, ubatch.n_tokens - n_sp);
        rows_order  = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, ubatch.n_tokens);

        ggml_set_input(rows_sparse);
        ggml_set_input(rows_dense);
        ggml_set_input(rows_order);

        ggml_set_name(rows_sparse, "attn_inp_rows_sparse");
        ggml_set_name(rows_dense,  "attn_inp_rows_dense");
        ggml_set_name(rows_order,  "attn_inp_rows_order");
    }
}

ggml_tensor * llm_graph_context::build_attn_sparq(
         ggml_tensor * q,
         ggml_tensor * k,
         ggml_tensor * kt,
         ggml_tensor * v,
         ggml_tensor * kq_mask,
         ggml_tensor * kv_pos,
         ggml_tensor * vmean,
               float   kq_scale,
                 int   il) const {
    GGML_ASSERT(v->nb[1] <= v->nb[2] && "SparQ requires a V cache that is not transposed");

    // split the batch into streams, as build_attn_mha does
    const auto n_stream = k->ne[3];

    q = ggml_view_4d(ctx0, q, q->ne[0], q->ne[1], q->ne[2]/n_stream, n_stream, q->nb[1], q->nb[2], q->nb[2]*(q->ne[2]/n_stream), 0);

    q = ggml_permute(ctx0, q, 0, 2, 1, 3);
    k = ggml_permute(ctx0, k, 0, 2, 1, 3);
    v = ggml_permute(ctx0, v, 0, 2, 1, 3);

    const auto & sa = cparams.sparse_attn;

    const int32_t n_local = sa.l < 0 ? sa.k/4 : sa.l;

    ggml_tensor * cur;

    if (sa.mode == LLAMA_SPARSE_ATTN_LOKI) {
        GGML_ASSERT(kt == nullptr && vmean == nullptr);

        cur = ggml_loki_attn(ctx0, q, k, v, kq_mask, kv_pos, kq_scale, sa.d, sa.k, n_local);
        cb(cur, "loki_attn", il);
    } else {
        cur = ggml_sparq_attn(ctx0, q, k, kt, v, kq_mask, kv_pos, vmean, kq_scale, sa.r, sa.k, n_local, sa.mean_value);
        cb(cur, "sparq_attn", il);
    }
    if (sa.sink > 0) {
        ggml_sparse_attn_set_sink(cur, sa.sink);
    }

    // [n_embd_head_v, n_head, n_tokens/n_stream, n_stream] -> [n_embd_head_v*n_head, n_tokens]
    cur = ggml_reshape_2d(ctx0, cur, cur->ne[0]*cur->ne[1], cur->ne[2]*cur->ne[3]);

    ggml_build_forward_expand(gf, cur);

    return cur;
}

ggml_tensor * llm_graph_context::build_loki_rotate(ggml_tensor * x, ggml_tensor * proj) const {
    // [D, n_head, n_tokens] -> [D, n_tokens, n_head]: ggml_mul_mat broadcasts proj's n_head_kv matrices over the
    // heads in groups, head h uses matrix h/(n_head/n_head_kv), as GQA does
    x = ggml_permute(ctx0, x, 0, 2, 1, 3);
    x = ggml_mul_mat(ctx0, proj, x);
    x = ggml_permute(ctx0, x, 0, 2, 1, 3);

    return ggml_cont(ctx0, x);
}

ggml_tensor * llm_graph_context::build_attn_sparse_edits(
        const llm_graph_input_sparse_attn & sparse,
        const llama_kv_cache_context * mctx_cur,
                int   il) const {
    if (!sparse.edit_rows) {
        return nullptr;
    }

    ggml_tensor * edits = mctx_cur->get_vsum_edits(ctx0, sparse.edit_rows, sparse.edit_coef, il);
    ggml_build_forward_expand(gf, edits);

    return edits;
}

ggml_tensor * llm_graph_context::build_attn_sparse_upkeep(
        const llm_graph_input_sparse_attn & sparse,
        const llama_kv_cache_context * mctx_cur,
        ggml_tensor * k_stored,
        ggml_tensor * v_stored,
        ggml_tensor * edits,
                int   il) const {
    if (!sparse.kv_rows) {
        return nullptr;
    }

    ggml_build_forward_expand(gf, mctx_cur->cpy_kt(ctx0, k_stored, sparse.kv_rows, sparse.kt_idxs, il));

    ggml_tensor * v_rows = nullptr;

    ggml_tensor * vsum = mctx_cur->upd_vsum(ctx0, v_stored, sparse.kv_rows, sparse.seq_tok, edits, il, &v_rows);
    ggml_build_forward_expand(gf, vsum);

    if (!sparse.vmean_seq) {
        return nullptr;
    }

    // the sum of V over the cells each row sees: its sequence's sum, less the sequence's later tokens in the ubatch
    ggml_tensor * res = ggml_get_rows(ctx0, vsum, sparse.vmean_seq); // [n_embd_v_gqa, n_tokens]

    if (sparse.vmean_later) {
        res = ggml_sub(ctx0, res, ggml_out_prod(ctx0, v_rows, sparse.vmean_later));
    }

    return res;
}

ggml_tensor * llm_graph_context::build_attn_sparse(
        const llm_graph_input_sparse_attn & sparse,
        const llama_kv_cache_context * mctx_cur,
        ggml_tensor * q,
        ggml_tensor * k,
        ggml_tensor * v,
        ggml_tensor * vsum,
        ggml_tensor * kq_b,
        ggml_tensor * kq_mask,
        ggml_tensor * sinks,
        ggml_tensor * v_mla,
              float   kq_scale,
                int   il) const {
    GGML_ASSERT(kq_b == nullptr && sinks == nullptr && "SparQ does not support KQ bias or attention sinks");

    // Loki ranks from the rotated K itself
    ggml_tensor * kt = cparams.loki_proj ? nullptr : mctx_cur->get_kt(ctx0, il);

    // the mean of V over the sequence of each row: [n_embd_head_v, n_head_kv, n_tokens/n_stream, n_stream]
    ggml_tensor * vmean = nullptr;

    if (sparse.vmean_seq) {
        GGML_ASSERT(vsum);

        const int64_t n_stream = k->ne[3];

        vmean = ggml_mul(ctx0, vsum, sparse.vmean_scale);
        vmean = ggml_reshape_4d(ctx0, vmean, v->ne[0], v->ne[1], vmean->ne[1]/n_stream, n_stream);
        cb(vmean, "sparq_vmean", il);
    }

    if (sparse.rows_order) {
        // decode rows sparse, the others dense: each row as it would be without the others
        GGML_ASSERT(k->ne[3] == 1 && "a split ubatch needs a unified KV cache");

        const int64_t n_tok = q->ne[2];
        const int64_t n_sp  = sparse.rows_sparse->ne[0];
        const int64_t n_dn  = sparse.rows_dense ->ne[0];

        ggml_tensor * q2 = ggml_reshape_2d(ctx0, ggml_is_contiguous(q) ? q : ggml_cont(ctx0, q), q->ne[0]*q->ne[1], n_tok);
        ggml_tensor * m2 = ggml_reshape_2d(ctx0, kq_mask, kq_mask->ne[0], kq_mask->ne[1]);

        auto rows = [&](ggml_tensor * x, ggml_tensor * idx) { return ggml_get_rows(ctx0, x, idx); };

        ggml_tensor * q_sp = ggml_reshape_3d(ctx0, rows(q2, sparse.rows_sparse), q->ne[0], q->ne[1], n_sp);
        ggml_tensor * q_dn = ggml_reshape_3d(ctx0, rows(q2, sparse.rows_dense),  q->ne[0], q->ne[1], n_dn);

        // the mask rows come back as F32 (0 and -INF, exact in F16)
        ggml_tensor * m_sp = ggml_reshape_4d(ctx0, ggml_cast(ctx0, rows(m2, sparse.rows_sparse), kq_mask->type), kq_mask->ne[0], n_sp, 1, 1);
        ggml_tensor * m_dn = ggml_reshape_4d(ctx0, ggml_cast(ctx0, rows(m2, sparse.rows_dense),  kq_mask->type), kq_mask->ne[0], n_dn, 1, 1);

        ggml_tensor * vmean_sp = nullptr;
        if (vmean) {
            vmean_sp = rows(ggml_reshape_2d(ctx0, vmean, vmean->ne[0]*vmean->ne[1], n_tok), sparse.rows_sparse);
            vmean_sp = ggml_reshape_4d(ctx0, vmean_sp, vmean->ne[0], vmean->ne[1], n_sp, 1);
        }

        ggml_tensor * cur_sp = build_attn_sparq(q_sp, k, kt, v, m_sp, sparse.kv_pos, vmean_sp, kq_scale, il);
        ggml_tensor * cur_dn = build_attn_mha(q_dn, k, v, kq_b, m_dn, sinks, v_mla, 0, kq_scale, il);

        return rows(ggml_concat(ctx0, cur_sp, cur_dn, 1), sparse.rows_order);
    }

    return build_attn_sparq(q, k, kt, v, kq_mask, sparse.kv_pos, vmean, kq_scale, il);
}

ggml_tensor * llm_graph_context::build_attn_alisa(
        const llm_graph_input_sparse_attn & sparse,
        const llama_kv_cache_context * mctx_cur,
        ggml_tensor * q,
        ggml_tensor * k,
        ggml_tensor * v,
        ggml_tensor * kq_mask,
              float   kq_scale,
                int   il) const {
    GGML_ASSERT(k->ne[3] == 1 && "ALISA keeps the window of one sequence");

    ggml_tensor * ring = mctx_cur->get_alisa_ring(il); // [kv_size, n_ring + 1]
    ggml_tensor * sums = mctx_cur->get_alisa_sums(il); // [kv_size, 1]

    const int64_t kv_size = ring->ne[0];
    const int64_t n_kv    = k->ne[2];
    const int64_t n_tok   = q->ne[2];

    ggml_tensor * cur;

    if (sparse.alisa_decode) {
        ggml_tensor * s = sums;
        if (sparse.alisa_resum) {
            // after a load, a new c or a large removal: the window's steps summed again
            s = ggml_cpy(ctx0, ggml_out_prod(ctx0, ring, sparse.alisa_window), sums);
        } else if (sparse.alisa_rewind_rows) {
            // after removing the end: the window moved back by the ring rows that differ
            ggml_tensor * rows = ggml_get_rows(ctx0, ring, sparse.alisa_rewind_rows); // [kv_size, n]
            s = ggml_cpy(ctx0, ggml_add(ctx0, sums, ggml_out_prod(ctx0, rows, sparse.alisa_rewind_coef)), sums);
        }

        ggml_tensor * qp = ggml_permute(ctx0, q, 0, 2, 1, 3);
        ggml_tensor * kp = ggml_permute(ctx0, k, 0, 2, 1, 3);
        ggml_tensor * vp = ggml_permute(ctx0, v, 0, 2, 1, 3);

        ggml_tensor * res = ggml_alisa_attn(ctx0, qp, kp, vp, kq_mask, sparse.kv_pos,
                ggml_view_2d(ctx0, s, n_kv, 1, s->nb[1], 0), kq_scale, cparams.sparse_attn.c);
        cb(res, "alisa_attn", il);

        // this step's weights join the window, the step leaving it (or the row of zeros) goes
        ggml_tensor * w = ggml_reshape_2d(ctx0, ggml_alisa_attn_weights(ctx0, res), n_kv, 1);
        w = ggml_pad(ctx0, w, kv_size - n_kv, 0, 0, 0);

        ggml_tensor * leave = ggml_get_rows(ctx0, ring, sparse.alisa_leave);

        ggml_build_forward_expand(gf, ggml_cpy(ctx0, ggml_add(ctx0, ggml_sub(ctx0, s, leave), w), sums));
        ggml_build_forward_expand(gf, ggml_set_rows(ctx0, ring, w, sparse.alisa_slots));

        cur = ggml_alisa_attn_out(ctx0, res);
        cur = ggml_reshape_2d(ctx0, cur, cur->ne[0]*cur->ne[1], cur->ne[2]*cur->ne[3]);
    } else {
        // attention without flash attention, its weights at hand: the result from them, and the weights of the
        // last m rows (those a window can still reach) summed over the heads into the ring
        const int64_t m = sparse.alisa_slots->ne[0];

        // V is transposed for the product with the weights: a quantized V is converted first (its rows are blocks)
        ggml_tensor * vf = ggml_is_quantized(v->type) ? ggml_cast(ctx0, v, GGML_TYPE_F32) : v;

        ggml_tensor * kq = ggml_mul_mat(ctx0, ggml_permute(ctx0, k, 0, 2, 1, 3), ggml_permute(ctx0, q, 0, 2, 1, 3));
        ggml_mul_mat_set_prec(kq, GGML_PREC_F32);
        kq = ggml_soft_max_ext(ctx0, kq, kq_mask, kq_scale, 0.0f); // [n_kv, n_tok, n_head]
        cb(kq, "alisa_kq_soft_max", il);

        ggml_tensor * vt = ggml_cont(ctx0, ggml_transpose(ctx0, ggml_permute(ctx0, vf, 0, 2, 1, 3))); // [n_kv, DV, n_head_kv]
        cur = ggml_mul_mat(ctx0, vt, kq);                                                           // [DV, n_tok, n_head]
        cur = ggml_cont(ctx0, ggml_permute(ctx0, cur, 0, 2, 1, 3));
        cur = ggml_reshape_2d(ctx0, cur, cur->ne[0]*cur->ne[1], cur->ne[2]);

        // the row of ones holds the most heads of any layer
        GGML_ASSERT(kq->ne[2] <= sparse.alisa_ones->ne[1]);
        ggml_tensor * ones = ggml_view_2d(ctx0, sparse.alisa_ones, 1, kq->ne[2], sparse.alisa_ones->nb[1], 0);

        ggml_tensor * w = ggml_out_prod(ctx0, ggml_reshape_2d(ctx0, kq, n_kv*n_tok, kq->ne[2]), ones);
        w = ggml_view_2d(ctx0, w, n_kv, m, n_kv*w->nb[0], (n_tok - m)*n_kv*w->nb[0]);
        w = ggml_pad(ctx0, w, kv_size - n_kv, 0, 0, 0);

        ggml_tensor * ring_new = ggml_set_rows(ctx0, ring, w, sparse.alisa_slots);

        // the window of the next step, summed from the ring
        ggml_build_forward_expand(gf, ggml_cpy(ctx0, ggml_out_prod(ctx0, ring_new, sparse.alisa_window), sums));
    }

    ggml_build_forward_expand(gf, cur);

    return cur;
}
