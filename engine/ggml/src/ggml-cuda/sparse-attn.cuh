#pragma once

#include "common.cuh"

// GGML_OP_SPARSE_ATTN: SparQ (ranking from r rows of the transposed copy of K) and Loki (ranking from the
// d-prefix of each rotated K row), the top-k selection and the exact attention over the selected rows
void ggml_cuda_sparse_attn(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// exactly the cases ggml_cuda_sparse_attn computes, anything else is refused
bool ggml_cuda_sparse_attn_supported(int device, const ggml_tensor * dst);
