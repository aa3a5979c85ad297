"""A GGUF Llama model back into a training checkpoint (Hugging Face layout): the inverse of
`sparq-cpp convert`, so a committed model can be trained on when its torch checkpoint is gone.

Quantized tensors are dequantized (a q8_0 model gives its rounded weights, a fine start for more
training); the q/k rows are permuted back from llama.cpp's adjacent-pair RoPE to HF's rotate_half.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, MODEL_ARCH, get_tensor_name_map
from gguf.quants import dequantize

from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import open_gguf
from sparq_cpp.train.model import LlamaConfig, LlamaForCausalLM


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of sparq_cpp.convert.permute_qk."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: GGUFReader, key: str):
    f = reader.get_field(key)
    if f is None:
        raise SparqError(f"GGUF has no {key}: not a Llama model this importer knows")
    return f.contents()


def config_of(reader: GGUFReader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise SparqError(f"GGUF architecture is {arch!r}; only 'llama' models can be imported")
    names = {t.name for t in reader.tensors}
    n_head = int(_field(reader, "llama.attention.head_count"))
    kv = reader.get_field("llama.attention.head_count_kv")
    eps = reader.get_field("llama.attention.layer_norm_rms_epsilon")
    theta = reader.get_field("llama.rope.freq_base")
    return LlamaConfig(
        vocab_size=len(_field(reader, "tokenizer.ggml.tokens")),
        hidden_size=int(_field(reader, "llama.embedding_length")),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=int(kv.contents()) if kv is not None else n_head,
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        # stored as float32: 6 significant digits give back the value written (1e-05, not 9.99999975e-06)
        rms_norm_eps=float(f"{eps.contents():.6g}") if eps is not None else 1e-5,
        rope_theta=float(f"{theta.contents():.6g}") if theta is not None else 10000.0,
        tie_word_embeddings="output.weight" not in names)


def load_model(path) -> LlamaForCausalLM:
    """The torch model with the GGUF's weights (float32)."""
    reader = open_gguf(Path(path))
    cfg = config_of(reader)
    model = LlamaForCausalLM(cfg)
    tensors = {t.name: t for t in reader.tensors}
    name_map = get_tensor_name_map(MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    sd = {}
    for hf_name, param in model.hf_state_dict().items():
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name not in tensors:
            raise SparqError(f"{path}: no tensor {gguf_name} (for {hf_name})")
        t = tensors[gguf_name]
        arr = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(tuple(param.shape))
        if gguf_name.endswith("attn_q.weight"):
            arr = unpermute_qk(arr, cfg.num_attention_heads)
        elif gguf_name.endswith("attn_k.weight"):
            arr = unpermute_qk(arr, cfg.num_key_value_heads)
        sd[hf_name] = torch.from_numpy(arr.copy())
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(sd)
    return model.eval()
