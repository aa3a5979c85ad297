#include "llama-adapter-loki.h"

#include "llama-impl.h"
#include "llama-mmap.h"
#include "llama-model.h"

#include "gguf.h"

#include <cinttypes>
#include <cmath>

// the index of the first value of a basis that is not finite, or -1: such a basis would rotate q and k into
// NaN or inf, which no ranking can order
static int64_t llama_loki_first_not_finite(const float * x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        if (!std::isfinite(x[i])) {
            return i;
        }
    }
    return -1;
}

int32_t llama_adapter_loki::get(const llama_model & model, const char * path, bool pre_rope, const std::vector<ggml_tensor *> ** out, std::string & why) {
    const auto & hparams = model.hparams;
    const auto & layers  = model.layers;
    const auto & name    = model.name;

    const char * variant = pre_rope ? "pre" : "post";

    const int64_t n_layer   = hparams.n_layer();
    const int64_t head_dim  = hparams.n_embd_head_k();
    const int64_t n_head_kv = hparams.n_head_kv();

    std::lock_guard<std::mutex> lock(mutex);

    const std::string key = std::string(path ? path : "") + "|" + variant;

    auto it = bases.find(key);
    if (it != bases.end()) {
        *out = &it->second.proj;
        return LLAMA_SPARSE_ATTN_OK;
    }

    basis_data basis;

    // the sliding-window layers of an iSWA model stay dense: they have no projection
    auto needs_proj = [&](int64_t il) { return !hparams.is_swa(il); };

    if (!path) {
        for (int64_t il = 0; il < n_layer; ++il) {
            if (!needs_proj(il)) {
                basis.proj.push_back(nullptr);
                continue;
            }
            ggml_tensor * t = pre_rope ? layers[il].loki_proj_pre : layers[il].loki_proj_post;
            if (!t) {
                why = format("the model has no embedded Loki projection (blk.%" PRId64 ".loki_proj_%s); "
                        "calibrate one (the principal components of the keys per layer and KV head) and load the projection file", il, variant);
                return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
            }
            if (t->type == GGML_TYPE_F32) {
                std::vector<float> data(ggml_nelements(t));
                ggml_backend_tensor_get(t, data.data(), 0, ggml_nbytes(t));
                const int64_t i = llama_loki_first_not_finite(data.data(), data.size());
                if (i >= 0) {
                    why = format("the embedded Loki projection %s holds a value that is not finite (%g at element %" PRId64 ")",
                            ggml_get_name(t), data[i], i);
                    return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
                }
            }
            basis.proj.push_back(t);
        }
    } else {
        ggml_context * ctx_meta = nullptr;

        gguf_init_params params_meta = {
            /*.no_alloc =*/ true,
            /*.ctx      =*/ &ctx_meta,
        };

        gguf_context_ptr gguf { gguf_init_from_file(path, params_meta) };
        ggml_context_ptr meta { ctx_meta };

        if (!gguf) {
            why = format("cannot read '%s' as a GGUF file", path);
            return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
        }

        auto get_u32 = [&](const char * k, int64_t & v) {
            const int64_t id = gguf_find_key(gguf.get(), k);
            if (id < 0 || gguf_get_kv_type(gguf.get(), id) != GGUF_TYPE_UINT32) {
                return false;
            }
            v = gguf_get_val_u32(gguf.get(), id);
            return true;
        };

        int64_t version = 0;
        if (!get_u32("loki.version", version)) {
            why = format("'%s' is not a Loki projection file (no loki.version key)", path);
            return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
        }

        int64_t f_layer = -1, f_head_kv = -1, f_head_dim = -1;
        get_u32("loki.n_layer",   f_layer);
        get_u32("loki.n_head_kv", f_head_kv);
        get_u32("loki.head_dim",  f_head_dim);

        if (f_layer != n_layer || f_head_kv != n_head_kv || f_head_dim != head_dim) {
            why = format("'%s' was made for a model with %" PRId64 " layers and %" PRId64 " KV heads of size %" PRId64
                    ", this model has %" PRId64 ", %" PRId64 " and %" PRId64, path, f_layer, f_head_kv, f_head_dim, n_layer, n_head_kv, head_dim);
            return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
        }

        // the full identity (a hash of the model file) is checked by the tools that write and load projections;
        // here the model name catches the common mistake
        const int64_t id_name = gguf_find_key(gguf.get(), "loki.model.name");
        if (id_name >= 0 && gguf_get_kv_type(gguf.get(), id_name) == GGUF_TYPE_STRING && name != "n/a") {
            const std::string f_name = gguf_get_val_str(gguf.get(), id_name);
            if (!f_name.empty() && f_name != name) {
                why = format("'%s' was made for the model '%s', not '%s'", path, f_name.c_str(), name.c_str());
                return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
            }
        }

        ggml_init_params params_ctx = {
            /*.mem_size   =*/ ggml_tensor_overhead()*n_layer,
            /*.mem_buffer =*/ nullptr,
            /*.no_alloc   =*/ true,
        };

        basis.ctx.reset(ggml_init(params_ctx));

        std::vector<size_t> offs;

        for (int64_t il = 0; il < n_layer; ++il) {
            if (!needs_proj(il)) {
                basis.proj.push_back(nullptr);
                offs.push_back(0);
                continue;
            }

            const std::string tname = format("blk.%" PRId64 ".loki_proj_%s", il, variant);

            const ggml_tensor * src = ggml_get_tensor(meta.get(), tname.c_str());
            if (!src) {
                why = format("'%s' has no tensor %s", path, tname.c_str());
                return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
            }
            if (src->type != GGML_TYPE_F32 || src->ne[0] != head_dim || src->ne[1] != head_dim || src->ne[2] != n_head_kv || src->ne[3] != 1) {
                why = format("'%s': %s is %s [%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "], expected f32 [%" PRId64 ", %" PRId64 ", %" PRId64 ", 1]",
                        path, tname.c_str(), ggml_type_name(src->type), src->ne[0], src->ne[1], src->ne[2], src->ne[3], head_dim, head_dim, n_head_kv);
                return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
            }

            ggml_tensor * t = ggml_dup_tensor(basis.ctx.get(), src);
            ggml_set_name(t, tname.c_str());
            basis.proj.push_back(t);

            offs.push_back(gguf_get_data_offset(gguf.get()) + gguf_get_tensor_offset(gguf.get(), gguf_find_tensor(gguf.get(), tname.c_str())));
        }

        ggml_backend_dev_t cpu_dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        basis.buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(basis.ctx.get(), ggml_backend_dev_buffer_type(cpu_dev)));
        if (!basis.buf) {
            why = "failed to allocate the Loki projection buffer";
            return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
        }

        try {
            llama_file file(path, "rb");
            std::vector<uint8_t> data;
            for (int64_t il = 0; il < n_layer; ++il) {
                ggml_tensor * t = basis.proj[il];
                if (!t) {
                    continue;
                }
                data.resize(ggml_nbytes(t));
                // llama_file reads short at the end of a file without an error: a truncated file is caught here
                if (offs[il] + data.size() > file.size()) {
                    why = format("'%s': %s ends at byte %zu, past the end of the file (%zu bytes): is it truncated?",
                            path, ggml_get_name(t), offs[il] + data.size(), file.size());
                    return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
                }
                file.seek(offs[il], SEEK_SET);
                file.read_raw(data.data(), data.size());
                const int64_t i = llama_loki_first_not_finite((const float *) data.data(), ggml_nelements(t));
                if (i >= 0) {
                    why = format("'%s': %s holds a value that is not finite (%g at element %" PRId64 ")",
                            path, ggml_get_name(t), ((const float *) data.data())[i], i);
                    return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
                }
                ggml_backend_tensor_set(t, data.data(), 0, data.size());
            }
        } catch (const std::exception & e) {
            why = format("'%s': reading the Loki projection failed: %s", path, e.what());
            return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
        }
    }

    LLAMA_LOG_INFO("%s: Loki basis (%s RoPE) from %s\n", __func__, variant, path ? path : "the model");

    it = bases.emplace(key, std::move(basis)).first;
    *out = &it->second.proj;

    return LLAMA_SPARSE_ATTN_OK;
}
