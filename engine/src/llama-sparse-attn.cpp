#include "llama-sparse-attn.h"

#include "llama-impl.h"
#include "llama-model.h"

#include <cerrno>
#include <cinttypes>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

// sparse attention (SparQ, Loki, ALISA): the parameters and their setting string, the checks of a model,
// the fingerprint of a Loki basis; the context applies them (llama-context.cpp)

llama_sparse_attn_params llama_sparse_attn_default_params() {
    llama_sparse_attn_params result = {
        /*.mode          =*/ LLAMA_SPARSE_ATTN_DENSE,
        /*.r             =*/ 16,
        /*.k             =*/ 128,
        /*.l             =*/ -1,
        /*.sink          =*/ 0,
        /*.mean_value    =*/ true,
        /*.min_n_kv      =*/ 0,
        /*.sparse_prompt =*/ false,
        /*.d             =*/ 32,
        /*.loki_proj     =*/ nullptr,
        /*.loki_pre_rope =*/ false,
        /*.c             =*/ 0.125f,
    };

    return result;
}

// a fingerprint of a Loki basis (FNV-1a over its values and the RoPE side), kept in the states of the cache it rotates
uint64_t llama_loki_basis_id(const std::vector<ggml_tensor *> & basis, bool pre_rope) {
    uint64_t h = 0xcbf29ce484222325ull;
    auto mix = [&](const uint8_t * p, size_t n) {
        for (size_t i = 0; i < n; ++i) {
            h = (h ^ p[i])*0x100000001b3ull;
        }
    };

    const uint8_t side = pre_rope ? 1 : 0;
    mix(&side, 1);

    std::vector<uint8_t> data;
    for (const ggml_tensor * t : basis) {
        if (!t) {
            continue;
        }
        data.resize(ggml_nbytes(t));
        ggml_backend_tensor_get(t, data.data(), 0, data.size());
        mix(data.data(), data.size());
    }

    return h;
}

// parse a sparse attention setting: "dense", "", "sparq[:key=value,...]", "loki[:key=value,...]" or "alisa[:...]"
// returns false and sets err (naming the key) on a malformed value; enabled is false for "dense" and ""
// proj receives the Loki projection path (out.loki_proj is left NULL)
// a value as it goes into an error message: at most 64 characters, the rest elided
static std::string llama_sparse_attn_quote(const std::string & s) {
    return s.size() <= 64 ? "'" + s + "'" : "'" + s.substr(0, 61) + "...' (" + std::to_string(s.size()) + " characters)";
}

static bool llama_sparse_attn_parse_impl(const char * str, llama_sparse_attn_params & out, bool & enabled, std::string & proj, std::string & err) {
    out     = llama_sparse_attn_default_params();
    enabled = false;

    std::string s(str);

    // the setting is parsed as written: a space is part of a key or value, never ignored
    for (const char c : s) {
        if (std::isspace((unsigned char) c)) {
            err = "white space in " + llama_sparse_attn_quote(s) + " (expected MODE:key=value,... with no spaces)";
            return false;
        }
    }

    const size_t colon = s.find(':');
    const std::string mode = s.substr(0, colon);

    if (mode.empty() || mode == "dense") {
        if (colon != std::string::npos) {
            err = "mode '" + mode + "' takes no parameters";
            return false;
        }
        return true;
    }

    if (mode != "sparq" && mode != "loki" && mode != "alisa") {
        err = "unknown mode " + llama_sparse_attn_quote(mode) + " (expected 'sparq', 'loki', 'alisa' or 'dense')";
        return false;
    }

    const bool loki  = mode == "loki";
    const bool alisa = mode == "alisa";

    out.mode = loki ? LLAMA_SPARSE_ATTN_LOKI : alisa ? LLAMA_SPARSE_ATTN_ALISA : LLAMA_SPARSE_ATTN_SPARQ;
    enabled  = true;
    proj.clear();

    if (loki) {
        out.l = 0; // Loki has no local window by default
    }

    if (colon == std::string::npos) {
        return true;
    }

    auto parse_i32 = [&](const std::string & key, const std::string & val, int32_t & dst) {
        char * end = nullptr;
        errno = 0;
        const long v = std::strtol(val.c_str(), &end, 10);
        if (val.empty() || *end != '\0' || errno != 0 || v < INT32_MIN || v > INT32_MAX) {
            err = "invalid value " + llama_sparse_attn_quote(val) + " for key '" + key + "' (expected an integer)";
            return false;
        }
        dst = (int32_t) v;
        return true;
    };

    auto parse_f32 = [&](const std::string & key, const std::string & val, float & dst) {
        char * end = nullptr;
        errno = 0;
        const float v = std::strtof(val.c_str(), &end);
        if (val.empty() || *end != '\0' || errno != 0 || !std::isfinite(v)) {
            err = "invalid value " + llama_sparse_attn_quote(val) + " for key '" + key + "' (expected a number)";
            return false;
        }
        dst = v;
        return true;
    };

    auto parse_bool = [&](const std::string & key, const std::string & val, bool & dst) {
        if (val == "1" || val == "on" || val == "true") {
            dst = true;
            return true;
        }
        if (val == "0" || val == "off" || val == "false") {
            dst = false;
            return true;
        }
        err = "invalid value " + llama_sparse_attn_quote(val) + " for key '" + key + "' (expected 0 or 1)";
        return false;
    };

    std::set<std::string> seen;

    size_t pos = colon + 1;
    while (pos <= s.size()) {
        size_t next = s.find(',', pos);
        if (next == std::string::npos) {
            next = s.size();
        }

        const std::string item = s.substr(pos, next - pos);
        pos = next + 1;

        if (item.empty()) {
            if (next == s.size()) {
                break;
            }
            err = "empty item";
            return false;
        }

        const size_t eq = item.find('=');
        if (eq == std::string::npos) {
            err = "missing value for key " + llama_sparse_attn_quote(item) + " (expected key=value)";
            return false;
        }

        const std::string key = item.substr(0, eq);
        const std::string val = item.substr(eq + 1);

        if (!seen.insert(key).second) {
            err = "key " + llama_sparse_attn_quote(key) + " given more than once";
            return false;
        }

        bool ok;
        if (alisa && key != "c" && key != "min_n_kv") {
            err = key == "r" || key == "k" || key == "l" || key == "sink" || key == "mv" || key == "d" || key == "proj" || key == "variant" || key == "prompt"
                ? "key '" + key + "' is not for alisa (expected c or min_n_kv)"
                : "unknown key " + llama_sparse_attn_quote(key) + " (expected c or min_n_kv)";
            ok = false;
        } else if (!alisa && key == "c") {
            err = "key 'c' is for alisa, not " + mode;
            ok = false;
        } else if (key == "c") {
            ok = parse_f32(key, val, out.c);
            // a share of the positions: at most 1 as written (1.0000001 reads as the float 1.0)
            if (ok && !(out.c > 0.0f)) {
                err = "c must be a finite number > 0 (ALISA's caching ratio), got " + llama_sparse_attn_quote(val);
                ok = false;
            } else if (ok && std::strtod(val.c_str(), nullptr) > 1.0) {
                err = "c must be at most 1 (ALISA's caching ratio, a share of the positions in (0, 1]), got " + val.substr(0, 64);
                ok = false;
            }
        } else if (loki && (key == "r" || key == "mv")) {
            err = "key '" + key + "' is for sparq, not loki";
            ok = false;
        } else if (!loki && (key == "d" || key == "proj" || key == "variant")) {
            err = "key '" + key + "' is for loki, not sparq";
            ok = false;
        } else if (key == "d") {
            ok = parse_i32(key, val, out.d);
        } else if (key == "proj") {
            proj = val;
            ok = !val.empty();
            if (!ok) {
                err = "empty value for key 'proj' (expected the path of a projection GGUF)";
            }
        } else if (key == "variant") {
            ok = val == "pre" || val == "post";
            out.loki_pre_rope = val == "pre";
            if (!ok) {
                err = "invalid value " + llama_sparse_attn_quote(val) + " for key 'variant' (expected 'pre' or 'post')";
            }
        } else if (key == "r") {
            ok = parse_i32(key, val, out.r);
        } else if (key == "k") {
            ok = parse_i32(key, val, out.k);
        } else if (key == "l") {
            ok = parse_i32(key, val, out.l);
        } else if (key == "sink") {
            ok = parse_i32(key, val, out.sink);
        } else if (key == "mv") {
            ok = parse_bool(key, val, out.mean_value);
        } else if (key == "min_n_kv") {
            ok = parse_i32(key, val, out.min_n_kv);
        } else if (key == "prompt") {
            if (val == "dense") {
                out.sparse_prompt = false;
                ok = true;
            } else if (val == "sparse") {
                out.sparse_prompt = true;
                ok = true;
            } else {
                err = "invalid value " + llama_sparse_attn_quote(val) + " for key 'prompt' (expected 'dense' or 'sparse')";
                ok = false;
            }
        } else {
            err = loki ? "unknown key " + llama_sparse_attn_quote(key) + " (expected d, k, l, sink, min_n_kv, prompt, proj or variant)"
                       : "unknown key " + llama_sparse_attn_quote(key) + " (expected r, k, l, sink, mv, min_n_kv or prompt)";
            ok = false;
        }

        if (!ok) {
            return false;
        }
    }

    return true;
}

// the checks that depend only on the model and the KV cache types
// returns 0 or a negative LLAMA_SPARSE_ATTN_ERR_* code, why gets the details
int32_t llama_sparse_attn_check_model(const llama_model & model, ggml_type type_k, ggml_type type_v, std::string & why) {
    const auto & hparams = model.hparams;

    if (hparams.use_alibi || hparams.f_max_alibi_bias != 0.0f) {
        why = format("the model uses ALiBi (f_max_alibi_bias = %g)", hparams.f_max_alibi_bias);
        return LLAMA_SPARSE_ATTN_ERR_ALIBI;
    }

    // grok soft-caps its logits by architecture, without attn_soft_cap
    if (hparams.attn_soft_cap || model.arch == LLM_ARCH_GROK) {
        why = format("the model (%s) uses attention logit soft-capping (%g)", llm_arch_name(model.arch), hparams.f_attn_logit_softcapping);
        return LLAMA_SPARSE_ATTN_ERR_SOFTCAP;
    }

    for (const auto & layer : model.layers) {
        if (layer.attn_sinks) {
            why = "the model uses attention sinks";
            return LLAMA_SPARSE_ATTN_ERR_SINKS;
        }
    }

    if (llm_arch_is_recurrent(model.arch) || llm_arch_is_hybrid(model.arch)) {
        why = format("the model (%s) has recurrent or hybrid memory", llm_arch_name(model.arch));
        return LLAMA_SPARSE_ATTN_ERR_MEMORY;
    }

    // interleaved sliding-window models: sparse on the full-attention layers, dense on the window layers
    if (hparams.swa_type != LLAMA_SWA_TYPE_NONE) {
        bool any_full = false;
        for (uint32_t il = 0; il < hparams.n_layer(); ++il) {
            any_full |= !hparams.is_swa(il);
        }
        if (!any_full) {
            why = format("every layer of the model (%s) uses sliding window attention, which reads a bounded window already",
                    llm_arch_name(model.arch));
            return LLAMA_SPARSE_ATTN_ERR_MEMORY;
        }
    }

    if (hparams.n_layer_kv_from_start >= 0) {
        why = format("the layers of the model (%s) share KV caches", llm_arch_name(model.arch));
        return LLAMA_SPARSE_ATTN_ERR_MEMORY;
    }

    if (hparams.is_mla()) {
        why = "the model uses MLA";
        return LLAMA_SPARSE_ATTN_ERR_HEAD_SIZE;
    }

    for (uint32_t il = 0; il < hparams.n_layer(); ++il) {
        if (hparams.n_embd_head_k(il) != hparams.n_embd_head_v(il) || hparams.n_embd_head_k(il) != hparams.n_embd_head_k(0)) {
            why = format("layer %u has K head size %u and V head size %u (layer 0: %u), they must all be equal",
                    il, hparams.n_embd_head_k(il), hparams.n_embd_head_v(il), hparams.n_embd_head_k(0));
            return LLAMA_SPARSE_ATTN_ERR_HEAD_SIZE;
        }

        if (hparams.n_head_kv(il) != hparams.n_head_kv(0)) {
            why = format("layer %u has %u KV heads (layer 0: %u), the count must not vary",
                    il, hparams.n_head_kv(il), hparams.n_head_kv(0));
            return LLAMA_SPARSE_ATTN_ERR_HEAD_SIZE;
        }
    }

    auto type_ok = [](ggml_type type) {
        return type == GGML_TYPE_F16 || type == GGML_TYPE_Q8_0 || type == GGML_TYPE_F32;
    };

    if (!type_ok(type_k) || !type_ok(type_v)) {
        why = format("the KV cache types are K = %s, V = %s", ggml_type_name(type_k), ggml_type_name(type_v));
        return LLAMA_SPARSE_ATTN_ERR_CACHE_TYPE;
    }

    return LLAMA_SPARSE_ATTN_OK;
}

const char * llama_sparse_attn_strerror(int32_t code) {
    switch (code) {
        case LLAMA_SPARSE_ATTN_OK:             return "success";
        case LLAMA_SPARSE_ATTN_ERR_ARG:        return "ctx and out must not be NULL";
        case LLAMA_SPARSE_ATTN_ERR_MODE:       return "mode must be LLAMA_SPARSE_ATTN_DENSE, LLAMA_SPARSE_ATTN_SPARQ, LLAMA_SPARSE_ATTN_LOKI or LLAMA_SPARSE_ATTN_ALISA";
        case LLAMA_SPARSE_ATTN_ERR_R:          return "r must be in 1..head_dim";
        case LLAMA_SPARSE_ATTN_ERR_K:          return "k must be >= 1";
        case LLAMA_SPARSE_ATTN_ERR_L:          return "l must be in 0..k (or -1 for k/4), and sink in 0..k - l";
        case LLAMA_SPARSE_ATTN_ERR_MIN_N_KV:   return "min_n_kv must be >= 0";
        case LLAMA_SPARSE_ATTN_ERR_NO_SUPPORT: return "the context was created without support for this mode (SparQ: no transposed K cache; Loki: keys not in a Loki basis; ALISA: no window of past weights)";
        case LLAMA_SPARSE_ATTN_ERR_FLASH_ATTN: return "SparQ attention requires flash attention (flash_attn must be on)";
        case LLAMA_SPARSE_ATTN_ERR_ALIBI:      return "SparQ attention does not support ALiBi models";
        case LLAMA_SPARSE_ATTN_ERR_SOFTCAP:    return "SparQ attention does not support attention logit soft-capping";
        case LLAMA_SPARSE_ATTN_ERR_SINKS:      return "SparQ attention does not support attention sinks";
        case LLAMA_SPARSE_ATTN_ERR_HEAD_SIZE:  return "SparQ attention requires equal K and V head sizes and KV head counts in all layers (no MLA)";
        case LLAMA_SPARSE_ATTN_ERR_MEMORY:     return "sparse attention requires a KV cache with full-attention layers (not recurrent or hybrid memory, not only sliding-window layers, no KV shared between layers)";
        case LLAMA_SPARSE_ATTN_ERR_CACHE_TYPE: return "SparQ attention requires K and V cache types f16, q8_0 or f32";
        case LLAMA_SPARSE_ATTN_ERR_D:          return "d must be in 1..head_dim";
        case LLAMA_SPARSE_ATTN_ERR_PROJECTION: return "Loki attention needs a projection made for this model (a calibrated basis of its keys)";
        case LLAMA_SPARSE_ATTN_ERR_C:          return "c must be a finite number > 0, at most the c the context was created with (ALISA's window memory)";
        case LLAMA_SPARSE_ATTN_ERR_N_SEQ:      return "ALISA attention keeps one window of past weights: the context must have n_seq_max = 1 (one sequence, e.g. llama-server -np 1)";
        case LLAMA_SPARSE_ATTN_ERR_SPEC:       return "malformed sparse attention setting (expected MODE[:key=value,...], e.g. sparq:r=16,k=128)";
    }

    return "unknown sparse attention error code";
}

int32_t llama_sparse_attn_parse(const char * spec, llama_sparse_attn_params * out, char * proj, size_t proj_size, char * err, size_t err_size) {
    auto fail = [&](int32_t code, const std::string & msg) {
        if (err && err_size > 0) {
            snprintf(err, err_size, "%s", msg.c_str());
        }
        return code;
    };

    if (!spec || !out) {
        return fail(LLAMA_SPARSE_ATTN_ERR_ARG, llama_sparse_attn_strerror(LLAMA_SPARSE_ATTN_ERR_ARG));
    }

    llama_sparse_attn_params res;
    bool        enabled;
    std::string path;
    std::string msg;

    if (!llama_sparse_attn_parse_impl(spec, res, enabled, path, msg)) {
        return fail(LLAMA_SPARSE_ATTN_ERR_SPEC, msg);
    }

    if (!path.empty()) {
        if (!proj || path.size() + 1 > proj_size) {
            return fail(LLAMA_SPARSE_ATTN_ERR_SPEC, format("the projection path (%zu bytes) does not fit the buffer (%zu bytes)",
                        path.size() + 1, proj ? proj_size : (size_t) 0));
        }
        memcpy(proj, path.c_str(), path.size() + 1);
        res.loki_proj = proj;
    }

    *out = res;

    return LLAMA_SPARSE_ATTN_OK;
}

int32_t llama_sparse_attn_load_projection(llama_model * model, const char * path, bool pre_rope) {
    if (!model) {
        LLAMA_LOG_ERROR("%s: %s\n", __func__, llama_sparse_attn_strerror(LLAMA_SPARSE_ATTN_ERR_ARG));
        return LLAMA_SPARSE_ATTN_ERR_ARG;
    }

    std::string why;
    const std::vector<ggml_tensor *> * basis = nullptr;

    const int32_t rc = model->loki_basis(path, pre_rope, &basis, why);
    if (rc != LLAMA_SPARSE_ATTN_OK) {
        LLAMA_LOG_ERROR("%s: %s (%s)\n", __func__, llama_sparse_attn_strerror(rc), why.c_str());
    }

    return rc;
}
