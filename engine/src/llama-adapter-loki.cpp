#include "llama-adapter-loki.h"

#include "llama-impl.h"
#include "llama-mmap.h"
#include "llama-model.h"

#include "gguf.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstring>
#include <stdexcept>

// SHA-256 (FIPS 180-4), for the model fingerprint a projection file records
struct llama_loki_sha256 {
    uint32_t h[8] = { 0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19 };
    uint8_t  block[64];
    size_t   n_block = 0;
    uint64_t n_bits  = 0;

    void update(const void * data, size_t size) {
        const uint8_t * p = (const uint8_t *) data;
        n_bits += (uint64_t) size * 8;
        while (size > 0) {
            const size_t n = std::min(size, sizeof(block) - n_block);
            memcpy(block + n_block, p, n);
            n_block += n;
            p       += n;
            size    -= n;
            if (n_block == sizeof(block)) {
                compress();
                n_block = 0;
            }
        }
    }

    void update(const std::string & s) {
        update(s.data(), s.size());
    }

    std::string hex() {
        const uint64_t bits = n_bits;
        const uint8_t one = 0x80, zero = 0;
        update(&one, 1);
        while (n_block != 56) {
            update(&zero, 1);
        }
        uint8_t len[8];
        for (int i = 0; i < 8; ++i) {
            len[i] = (uint8_t) (bits >> (56 - 8*i));
        }
        update(len, 8);

        std::string out;
        for (uint32_t w : h) {
            out += format("%08x", w);
        }
        return out;
    }

private:
    static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

    void compress() {
        static const uint32_t k[64] = {
            0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
            0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
            0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
            0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
            0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
            0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
            0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
            0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
        };
        uint32_t w[64];
        for (int i = 0; i < 16; ++i) {
            w[i] = (uint32_t) block[4*i] << 24 | (uint32_t) block[4*i + 1] << 16 | (uint32_t) block[4*i + 2] << 8 | block[4*i + 3];
        }
        for (int i = 16; i < 64; ++i) {
            const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
            const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
        for (int i = 0; i < 64; ++i) {
            const uint32_t t1 = hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
            const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
        }
        h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
    }
};

static size_t llama_loki_gguf_scalar_size(gguf_type type) {
    switch (type) {
        case GGUF_TYPE_UINT8:  case GGUF_TYPE_INT8:  case GGUF_TYPE_BOOL:    return 1;
        case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16:                         return 2;
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
        case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
        default:                                                             return 0;
    }
}

// the fingerprint `sparq-cpp calibrate` records of the model a projection is made for: SHA-256 over the model's
// metadata (each key as stored, in the order of their names), its tensor infos with the first 4 KiB of each
// tensor's data, and the size of its data; loki.* keys and Loki tensors are left out, so that a model with a
// projection embedded keeps the fingerprint of the model it came from
static std::string llama_loki_model_fingerprint(const std::string & path) {
    static constexpr size_t sample_bytes = 4096;

    ggml_context * ctx_meta = nullptr;
    gguf_init_params params = {
        /*.no_alloc =*/ true,
        /*.ctx      =*/ &ctx_meta,
    };
    gguf_context_ptr gguf { gguf_init_from_file(path.c_str(), params) };
    ggml_context_ptr meta { ctx_meta };
    if (!gguf) {
        throw std::runtime_error(format("cannot read the model file '%s'", path.c_str()));
    }
    const gguf_context * g = gguf.get();

    llama_loki_sha256 sha;
    auto put_u32 = [&](uint32_t v) { sha.update(&v, sizeof(v)); };
    auto put_u64 = [&](uint64_t v) { sha.update(&v, sizeof(v)); };
    auto put_str = [&](const char * str) { put_u64(strlen(str)); sha.update(str, strlen(str)); };

    std::vector<int64_t> keys(gguf_get_n_kv(g));
    for (size_t i = 0; i < keys.size(); ++i) {
        keys[i] = i;
    }
    std::sort(keys.begin(), keys.end(), [&](int64_t a, int64_t b) { return strcmp(gguf_get_key(g, a), gguf_get_key(g, b)) < 0; });

    for (int64_t id : keys) {
        const char * key = gguf_get_key(g, id);
        if (strncmp(key, "loki.", 5) == 0) {
            continue;
        }
        const gguf_type type = gguf_get_kv_type(g, id);
        put_str(key);
        put_u32(type);
        if (type == GGUF_TYPE_STRING) {
            put_str(gguf_get_val_str(g, id));
        } else if (type == GGUF_TYPE_ARRAY) {
            const gguf_type item = gguf_get_arr_type(g, id);
            const size_t    n    = gguf_get_arr_n(g, id);
            put_u32(item);
            put_u64(n);
            if (item == GGUF_TYPE_STRING) {
                for (size_t i = 0; i < n; ++i) {
                    put_str(gguf_get_arr_str(g, id, i));
                }
            } else {
                sha.update(gguf_get_arr_data(g, id), n*llama_loki_gguf_scalar_size(item));
            }
        } else {
            sha.update(gguf_get_val_data(g, id), llama_loki_gguf_scalar_size(type));
        }
    }

    llama_file file(path.c_str(), "rb");
    std::vector<uint8_t> sample(sample_bytes);
    size_t end = 0;

    for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
        const char * name = gguf_get_tensor_name(g, i);
        if (strstr(name, ".loki_") != nullptr) {
            continue;
        }
        const ggml_tensor * t = ggml_get_tensor(meta.get(), name);
        std::string shape = "[";
        for (int d = 0; d < ggml_n_dims(t); ++d) {
            shape += format(d ? ", %" PRId64 : "%" PRId64, t->ne[d]);
        }
        shape += "]";

        const size_t rel  = gguf_get_tensor_offset(g, i);
        const size_t size = gguf_get_tensor_size(g, i);
        sha.update(format("%s|%d|%s|%zu", name, (int) gguf_get_tensor_type(g, i), shape.c_str(), rel));

        const size_t n = std::min(sample_bytes, size);
        file.seek(gguf_get_data_offset(g) + rel, SEEK_SET);
        file.read_raw(sample.data(), n);
        sha.update(sample.data(), n);

        end = std::max(end, rel + size);
    }
    sha.update(format("data_size=%zu", end));

    return sha.hex();
}

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
        if (gguf_find_key(gguf.get(), "loki.version") < 0) {
            why = format("'%s' is not a Loki projection file (no loki.version key)", path);
            return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
        }
        if (!get_u32("loki.version", version) || version != LLAMA_LOKI_VERSION) {
            why = format("'%s': loki.version is not %d, the version this build reads", path, LLAMA_LOKI_VERSION);
            return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
        }

        // the variants the file lists: the keys before RoPE ("pre"), after it ("post")
        {
            const int64_t id = gguf_find_key(gguf.get(), "loki.variants");
            bool found = false;
            std::string listed;
            if (id >= 0 && gguf_get_kv_type(gguf.get(), id) == GGUF_TYPE_ARRAY && gguf_get_arr_type(gguf.get(), id) == GGUF_TYPE_STRING) {
                for (size_t i = 0; i < gguf_get_arr_n(gguf.get(), id); ++i) {
                    const char * v = gguf_get_arr_str(gguf.get(), id, i);
                    found = found || strcmp(v, variant) == 0;
                    listed += (listed.empty() ? "" : ", ") + std::string(v);
                }
            }
            if (!found) {
                why = format("'%s' has no '%s' projection (it has %s)", path, variant, listed.empty() ? "none" : listed.c_str());
                return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
            }
        }

        // the model the projection was made for: its name, size and fingerprint are recorded
        {
            const int64_t id_tokens = gguf_find_key(gguf.get(), "loki.calibration_tokens");
            const int64_t id_fp     = gguf_find_key(gguf.get(), "loki.model.fingerprint");
            const bool is_int = id_tokens >= 0 &&
                (gguf_get_kv_type(gguf.get(), id_tokens) == GGUF_TYPE_UINT64 || gguf_get_kv_type(gguf.get(), id_tokens) == GGUF_TYPE_UINT32);
            if (!is_int) {
                why = format("'%s': missing key loki.calibration_tokens (an integer)", path);
                return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
            }
            const char * fp = id_fp >= 0 && gguf_get_kv_type(gguf.get(), id_fp) == GGUF_TYPE_STRING ? gguf_get_val_str(gguf.get(), id_fp) : "";
            if (strlen(fp) != 64 || strspn(fp, "0123456789abcdef") != 64) {
                why = format("'%s': loki.model.fingerprint is not the sha256 of a model (64 hex digits): the file is damaged", path);
                return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
            }
        }

        // every tensor's data must lie within the file: gguf reads the tensor infos, not the data
        {
            size_t n_file = 0;
            try {
                n_file = llama_file(path, "rb").size();
            } catch (const std::exception & e) {
                why = format("'%s': %s", path, e.what());
                return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
            }
            const size_t data_offset = gguf_get_data_offset(gguf.get());
            for (int64_t i = 0; i < gguf_get_n_tensors(gguf.get()); ++i) {
                const size_t end = data_offset + gguf_get_tensor_offset(gguf.get(), i) + gguf_get_tensor_size(gguf.get(), i);
                if (end > n_file) {
                    why = format("'%s': %s ends at byte %zu, past the end of the file (%zu bytes): is it truncated?",
                            path, gguf_get_tensor_name(gguf.get(), i), end, n_file);
                    return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
                }
            }
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

        // the model's name first: it says the common mistake plainly
        const int64_t id_name = gguf_find_key(gguf.get(), "loki.model.name");
        if (id_name >= 0 && gguf_get_kv_type(gguf.get(), id_name) == GGUF_TYPE_STRING && name != "n/a") {
            const std::string f_name = gguf_get_val_str(gguf.get(), id_name);
            if (!f_name.empty() && f_name != name) {
                why = format("'%s' was made for the model '%s', not '%s'", path, f_name.c_str(), name.c_str());
                return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
            }
        }

        for (int64_t il = 0; il < n_layer; ++il) {
            const std::string pname = format("blk.%" PRId64 ".loki_proj_%s", il, variant);
            const std::string vname = format("blk.%" PRId64 ".loki_var_%s",  il, variant);

            const ggml_tensor * p = ggml_get_tensor(meta.get(), pname.c_str());
            const ggml_tensor * v = ggml_get_tensor(meta.get(), vname.c_str());
            if (!p || !v) {
                why = format("'%s' has no tensor %s", path, (!p ? pname : vname).c_str());
                return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
            }
            if (p->type != GGML_TYPE_F32 || p->ne[0] != head_dim || p->ne[1] != head_dim || p->ne[2] != n_head_kv || p->ne[3] != 1) {
                why = format("'%s': %s is %s [%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "], expected f32 [%" PRId64 ", %" PRId64 ", %" PRId64 ", 1]",
                        path, pname.c_str(), ggml_type_name(p->type), p->ne[0], p->ne[1], p->ne[2], p->ne[3], head_dim, head_dim, n_head_kv);
                return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
            }
            if (v->type != GGML_TYPE_F32 || v->ne[0] != head_dim || v->ne[1] != n_head_kv || v->ne[2] != 1 || v->ne[3] != 1) {
                why = format("'%s': %s is %s [%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "], expected f32 [%" PRId64 ", %" PRId64 ", 1, 1]",
                        path, vname.c_str(), ggml_type_name(v->type), v->ne[0], v->ne[1], v->ne[2], v->ne[3], head_dim, n_head_kv);
                return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
            }
        }

        // then its identity, where libllama knows the model's file (it was loaded from one path)
        if (!model.path.empty()) {
            const std::string f_fp = gguf_get_val_str(gguf.get(), gguf_find_key(gguf.get(), "loki.model.fingerprint"));
            std::string m_fp;
            try {
                m_fp = llama_loki_model_fingerprint(model.path);
            } catch (const std::exception & e) {
                why = format("'%s': the model's fingerprint could not be computed: %s", path, e.what());
                return LLAMA_SPARSE_ATTN_ERR_PROJECTION;
            }
            if (f_fp != m_fp) {
                why = format("'%s' was made for another model (fingerprint %.12s), not '%s' (fingerprint %.12s)",
                        path, f_fp.c_str(), model.path.c_str(), m_fp.c_str());
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
