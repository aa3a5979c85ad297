"""Read a Llama-family GGUF into numpy: hyperparameters and float32 weights.

Weights keep their GGUF type (``LlamaModel.wtypes``) so the forward pass can mimic how ggml's CPU
matmul rounds activations for that type. numpy shapes are ggml ``ne`` reversed, so a matmul weight
``{n_in, n_out}`` arrives as ``[n_out, n_in]`` and ``y = W @ x``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import open_gguf

SUPPORTED_WTYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0)


@dataclass
class LlamaHParams:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_freq_base: float
    rope_freq_scale: float  # 1/factor for linear scaling, else 1
    n_rot: int
    head_dim: int
    kq_scale: float  # llama.cpp: attention.scale if set, else 1/sqrt(head_dim)

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv


@dataclass
class LlamaLayer:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    ffn_gate: np.ndarray
    ffn_up: np.ndarray
    ffn_down: np.ndarray


@dataclass
class LlamaModel:
    path: str
    hparams: LlamaHParams
    tok_embd: np.ndarray  # [n_vocab, n_embd]
    output_norm: np.ndarray
    output: np.ndarray  # [n_vocab, n_embd]; token_embd when tied
    layers: list[LlamaLayer]
    rope_freqs: np.ndarray | None  # llama3-style per-pair frequency divisors, or None
    wtypes: dict[str, GGMLQuantizationType] = field(default_factory=dict)  # by tensor name
    metadata: dict[str, object] = field(default_factory=dict)

    def wtype(self, name: str) -> GGMLQuantizationType:
        return self.wtypes[name]


def _field_value(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _dequant(t) -> np.ndarray:
    if t.tensor_type not in SUPPORTED_WTYPES:
        raise SparqError(
            f"tensor {t.name} has type {t.tensor_type.name}; the reference supports only "
            f"{', '.join(w.name for w in SUPPORTED_WTYPES)}")
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)


def load_llama(path: str | os.PathLike) -> LlamaModel:
    reader = open_gguf(path)
    arch = _field_value(reader, "general.architecture")
    if arch != "llama":
        raise SparqError(f"unsupported architecture {arch!r} (only 'llama'): {path}")

    def kv(key, default=None, required=False):
        v = _field_value(reader, f"llama.{key}", default)
        if v is None and required:
            raise SparqError(f"GGUF key llama.{key} missing: {path}")
        return v

    tensors = {t.name: t for t in reader.tensors}

    def get(name, required=True):
        t = tensors.get(name)
        if t is None:
            if required:
                raise SparqError(f"GGUF tensor {name} missing: {path}")
            return None
        return _dequant(t)

    n_layer = int(kv("block_count", required=True))
    n_embd = int(kv("embedding_length", required=True))
    n_head = int(kv("attention.head_count", required=True))
    n_head_kv = int(kv("attention.head_count_kv", n_head))
    if n_head_kv < 1 or n_head % n_head_kv:
        raise SparqError(f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    head_dim = int(kv("attention.key_length", n_embd // n_head))
    if int(kv("attention.value_length", head_dim)) != head_dim:
        raise SparqError("attention.value_length differs from key_length (unsupported)")
    n_rot = int(kv("rope.dimension_count", head_dim))
    if n_rot != head_dim:  # llama.cpp refuses this for LLM_ARCH_LLAMA too
        raise SparqError(f"invalid n_rot {n_rot}, expected {head_dim}")
    scaling = kv("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise SparqError(f"rope scaling type {scaling!r} is not supported by the reference")
    factor = float(kv("rope.scaling.factor", 0.0) or 0.0)
    freq_scale = 1.0 / factor if scaling == "linear" and factor > 0 else 1.0
    if kv("expert_count", 0):
        raise SparqError("MoE llama models are not supported by the reference")
    attn_scale = float(kv("attention.scale", 0.0) or 0.0)

    tok_embd = get("token_embd.weight")
    n_vocab = int(kv("vocab_size", 0) or tok_embd.shape[0])
    hp = LlamaHParams(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        n_ff=int(kv("feed_forward_length", required=True)), n_vocab=n_vocab,
        n_ctx_train=int(kv("context_length", 0) or 0),
        rms_eps=float(kv("attention.layer_norm_rms_epsilon", required=True)),
        rope_freq_base=float(kv("rope.freq_base", 10000.0)), rope_freq_scale=freq_scale,
        n_rot=n_rot, head_dim=head_dim,
        kq_scale=attn_scale if attn_scale != 0.0 else float(np.float32(1.0) / np.sqrt(np.float32(head_dim))),
    )

    wtypes = {name: t.tensor_type for name, t in tensors.items()}
    output = get("output.weight", required=False)
    if output is None:  # tied embeddings
        output = tok_embd
        wtypes["output.weight"] = wtypes["token_embd.weight"]

    layers = []
    for i in range(n_layer):
        p = f"blk.{i}."
        for bias in ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias", "ffn_up.bias"):
            if p + bias in tensors:
                raise SparqError(f"tensor {p + bias}: bias terms are not supported by the reference")
        if p + "attn_qkv.weight" in tensors:
            raise SparqError(f"tensor {p}attn_qkv.weight: fused QKV is not supported by the reference")
        layers.append(LlamaLayer(
            attn_norm=get(p + "attn_norm.weight"), wq=get(p + "attn_q.weight"),
            wk=get(p + "attn_k.weight"), wv=get(p + "attn_v.weight"), wo=get(p + "attn_output.weight"),
            ffn_norm=get(p + "ffn_norm.weight"), ffn_gate=get(p + "ffn_gate.weight"),
            ffn_up=get(p + "ffn_up.weight"), ffn_down=get(p + "ffn_down.weight"),
        ))
        shapes = {"wq": (n_head * head_dim, n_embd), "wk": (n_head_kv * head_dim, n_embd),
                  "wv": (n_head_kv * head_dim, n_embd), "wo": (n_embd, n_head * head_dim)}
        for attr, shape in shapes.items():
            if getattr(layers[-1], attr).shape != shape:
                raise SparqError(f"{p}{attr}: shape {getattr(layers[-1], attr).shape}, expected {shape}")

    metadata = {name: f.contents() for name, f in reader.fields.items()
                if not name.startswith("GGUF.") and not name.startswith("tokenizer.ggml.")}
    return LlamaModel(
        path=os.fspath(path), hparams=hp, tok_embd=tok_embd, output_norm=get("output_norm.weight"),
        output=output, layers=layers, rope_freqs=get("rope_freqs.weight", required=False),
        wtypes=wtypes, metadata=metadata,
    )
