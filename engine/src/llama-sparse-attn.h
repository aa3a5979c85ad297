#pragma once

#include "llama.h"

#include <cstdint>
#include <string>
#include <vector>

struct ggml_tensor;
struct llama_model;

// the checks of sparse attention that depend only on the model and the KV cache types
// returns 0 or a negative LLAMA_SPARSE_ATTN_ERR_* code, why gets the details
int32_t llama_sparse_attn_check_model(const llama_model & model, ggml_type type_k, ggml_type type_v, std::string & why);

// a fingerprint of a Loki basis (FNV-1a over its values and the RoPE side), kept in the states of the cache it rotates
uint64_t llama_loki_basis_id(const std::vector<ggml_tensor *> & basis, bool pre_rope);
