#pragma once

#include "llama.h"

#include "ggml-cpp.h"

#include <map>
#include <mutex>
#include <string>
#include <vector>

struct llama_model;

// the version of the projection file format (loki.version) this build reads
#define LLAMA_LOKI_VERSION 1

//
// llama_adapter_loki
//

// Loki attention: the bases of the keys' principal components (P^T per layer and KV head) that a model's contexts
// rotate their keys by, from a projection file or from the tensors embedded in the model; like a LoRA adapter, a
// basis is loaded once per (file, RoPE side) on first use and kept until the model is freed
struct llama_adapter_loki {
    // the per-layer basis ([head_dim, head_dim, n_head_kv] f32) of the projection file at path (NULL: the tensors
    // embedded in the model), calibrated before or after RoPE; NULL for the sliding-window layers, which stay dense
    // returns 0 or a negative LLAMA_SPARSE_ATTN_ERR_* code and sets why
    int32_t get(const llama_model & model, const char * path, bool pre_rope, const std::vector<ggml_tensor *> ** out, std::string & why);

private:
    struct basis_data {
        ggml_context_ptr           ctx;
        ggml_backend_buffer_ptr    buf;
        std::vector<ggml_tensor *> proj;
    };

    // by "<path>|<variant>"
    std::map<std::string, basis_data> bases;
    std::mutex mutex;
};
