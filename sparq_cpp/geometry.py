"""A model's hyperparameters: the one type every part of the package describes a model with.

The model factory writes a ModelGeometry, gguf_check reads one from a GGUF's metadata (GGUFSummary),
the reference adds the numerics its forward pass applies (ModelHParams), the converter reads one from
a Hugging Face config.json (CheckpointConfig) and the benchmarks add the weight bytes (ModelShape):
each of those is a ModelGeometry with a few fields of its own. add_geometry writes one's GGUF keys.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

# llama_model_rope_type: these rotate pairs (x[i], x[i + n_rot/2]) (NEOX), the others (x[2i], x[2i+1])
_ROPE_NEOX_ARCHS = ("qwen2", "qwen3", "phi3", "gemma3", "olmo2")


@dataclass(frozen=True)
class ModelGeometry:
    n_layer: int
    n_embd: int
    n_head: int  # 0 for a model without attention heads (recurrent models, as gguf_check reads them)
    n_head_kv: int
    n_ff: int  # 0 where a file gives none or one per layer
    n_vocab: int
    n_ctx_train: int
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-5
    arch: str = "llama"
    key_length: int | None = None  # head size when it is not n_embd / n_head ({arch}.attention.key_length)
    # interleaved sliding window (gemma3): n_swa positions visible in a window layer. The factory gives
    # swa_pattern (layer il is a window layer when il % swa_pattern < swa_pattern - 1); a model read
    # from a file gives swa_layers, one flag per layer, which then decide.
    n_swa: int = 0
    swa_pattern: int = 0
    rope_freq_base_swa: float = 10000.0
    swa_layers: tuple = ()
    # granite: 0 = not written
    embedding_scale: float = 0.0
    residual_scale: float = 0.0
    attention_scale: float = 0.0
    logit_scale: float = 0.0

    @property
    def head_dim(self) -> int:
        if self.key_length:
            return self.key_length
        return self.n_embd // self.n_head if self.n_head else 0

    @property
    def rope_neox(self) -> bool:
        return self.arch in _ROPE_NEOX_ARCHS

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim

    def is_swa(self, il: int) -> bool:
        """Whether layer il attends through the sliding window (llama.cpp's set_swa_pattern, dense_first
        false, where no per-layer flags are given)."""
        if self.swa_layers:
            return bool(self.swa_layers[il])
        return self.n_swa > 0 and self.swa_pattern > 0 and il % self.swa_pattern < self.swa_pattern - 1


def add_geometry(w, g: ModelGeometry) -> None:
    """Write g's metadata keys with the gguf.GGUFWriter w (whose architecture is g.arch)."""
    w.add_context_length(g.n_ctx_train)
    w.add_embedding_length(g.n_embd)
    w.add_block_count(g.n_layer)
    w.add_feed_forward_length(g.n_ff)
    w.add_head_count(g.n_head)
    w.add_head_count_kv(g.n_head_kv)
    w.add_layer_norm_rms_eps(float(g.rms_eps))
    w.add_rope_freq_base(float(g.rope_freq_base))
    w.add_rope_dimension_count(g.head_dim)
    w.add_vocab_size(g.n_vocab)
    if g.key_length:
        w.add_key_length(g.head_dim)
        w.add_value_length(g.head_dim)
    if g.n_swa:
        w.add_sliding_window(g.n_swa)
        w.add_uint32(f"{g.arch}.attention.sliding_window_pattern", g.swa_pattern)
        w.add_rope_freq_base_swa(float(g.rope_freq_base_swa))
    for key, value in (("embedding_scale", g.embedding_scale), ("residual_scale", g.residual_scale),
                       ("attention.scale", g.attention_scale), ("logit_scale", g.logit_scale)):
        if value:
            w.add_float32(f"{g.arch}.{key}", float(value))


def geometry_fields(g: ModelGeometry) -> dict:
    """g's ModelGeometry fields by name, to build a type that extends ModelGeometry from it."""
    return {f.name: getattr(g, f.name) for f in fields(ModelGeometry)}
