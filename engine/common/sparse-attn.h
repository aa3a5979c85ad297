#pragma once

#include "llama.h"

#include <string>

// --sparse-attn auto[:ratio=R,proj=FILE,max_loss=B]: the SparQ or Loki setting that a calibration of the model measured to
// compute the attention output best within R of dense attention's reads. The calibration (a Loki projection GGUF,
// by default <model stem>.loki.gguf next to the model) holds, per candidate setting measured at some ratios, the
// relative error of the attention output (and the attention mass kept) in each full-attention layer
// (loki.fidelity.*), and for the best rank of each method, sink and local window the bits per character lost end
// to end on text (per domain, where the probe scored several) and on a retrieval. The choice: among the candidates at
// the largest measured ratio not above R (else the smallest), the probed one that loses least on the text's worst
// domain (relative to dense's bits per character there) and the retrieval together (without domains: the bits per
// character lost on text and retrieval; without a probe: the smallest mean error over the layers);
// its rank is scaled to R, k is the largest whose reads at the context size stay within R of dense reads, l keeps its
// share of k and the sink its size. With max_loss = B, a choice whose probe measured more than B (relative to dense)
// lost on any domain is refused, naming the smallest measured ratio whose choice stays within B.

struct common_sparse_attn_auto {
    double      ratio = 0.125; // reads / dense reads, in (0, 1)
    std::string proj;          // the calibration GGUF, empty = <model stem>.loki.gguf next to the model
    double      max_loss = 0.0; // > 0: refuse a choice measured to lose more bits per character than this (relative)
};

// whether spec asks for auto ("auto" or "auto:...")
bool common_sparse_attn_is_auto(const std::string & spec);

// parse "auto[:ratio=R,proj=FILE,max_loss=B]" (R a number or a fraction such as 1/8); false with a message in err if malformed
bool common_sparse_attn_auto_parse(const std::string & spec, common_sparse_attn_auto & out, std::string & err);

// the setting auto stands for on model (loaded from model_path) at n_ctx positions per sequence: out (and proj,
// the Loki calibration path that out.loki_proj must point to) and a line saying why; false with a message in err
bool common_sparse_attn_auto_resolve(
        const common_sparse_attn_auto & req,
                        llama_model * model,
                  const std::string & model_path,
                            int32_t   n_ctx,
           llama_sparse_attn_params & out,
                        std::string & proj,
                        std::string & why,
                        std::string & err);

// <model stem>.loki.gguf next to the model: where `sparq-cpp calibrate` writes a model's Loki projection
std::string common_sparse_attn_default_projection(const std::string & model_path);

// one line naming a context's setting, as the tools log it: "sparq (r = 16, k = 128, l = 32, sink = 0, mean value on)";
// l = -1 (the default) is shown as the k/4 it stands for
std::string common_sparse_attn_describe(const llama_sparse_attn_params & p);
