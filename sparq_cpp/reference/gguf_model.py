"""Read a GGUF of one of llama.cpp's ordinary-attention architectures into numpy: hyperparameters and
float32 weights. llama, qwen2 (QKV biases), qwen3 (per-head q/k norms), phi3 (fused QKV and gate/up,
split here into the separate matrices: a row of a fused product is the same dot product), gemma3
(interleaved sliding window, pre and post norms, GELU), olmo2 (post norms, q/k norms over the whole
projection) and granite (embedding, residual, attention and logit scales).

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
from sparq_cpp.geometry import ModelGeometry
from sparq_cpp.gguf_check import SUPPORTED_ARCHS, open_gguf

_Q = GGMLQuantizationType
# The types gguf.quants dequantizes and whose matmul activations forward.round_activation rounds as
# ggml-cpu does (vec_dot_type: q4_0/q5_0/q8_0 -> Q8_0, q4_1/q5_1 -> Q8_1, K-quants -> Q8_K).
SUPPORTED_WTYPES = (_Q.F32, _Q.F16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1,
                    _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K)


@dataclass(frozen=True, kw_only=True)
class ModelHParams(ModelGeometry):
    """A model's geometry (any architecture in SUPPORTED_ARCHS) and the numerics the forward pass applies."""
    rope_freq_scale: float = 1.0  # 1/factor for linear scaling, else 1
    rope_freq_scale_swa: float = 1.0
    n_rot: int
    kq_scale: float  # the score scale build_attn gets (1 where the graph scales q itself)
    q_scale: float = 0.0  # phi3, gemma3: q *= q_scale after RoPE (ggml_scale), kq_scale is then 1
    ffn_gelu: bool = False  # gemma3: GELU-gated FFN instead of SiLU

    @property
    def embd_scale(self) -> float:
        """What the token embeddings are multiplied by (0: nothing): gemma3 sqrt(n_embd), granite its
        embedding_scale."""
        if self.arch == "gemma3":
            return float(np.sqrt(np.float32(self.n_embd), dtype=np.float32))
        return self.embedding_scale


@dataclass
class LlamaLayer:
    attn_norm: np.ndarray | None  # None: olmo2 (post norms only)
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray | None
    ffn_gate: np.ndarray
    ffn_up: np.ndarray
    ffn_down: np.ndarray
    bq: np.ndarray | None = None  # qwen2 biases
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # [D] per head (qwen3, gemma3) or [n_head * D] (olmo2)
    k_norm: np.ndarray | None = None
    attn_post_norm: np.ndarray | None = None  # gemma3, olmo2
    ffn_post_norm: np.ndarray | None = None


@dataclass
class LlamaModel:
    path: str
    hparams: ModelHParams
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


def dequant_tensor(t) -> np.ndarray:
    if t.tensor_type not in SUPPORTED_WTYPES:
        raise SparqError(
            f"tensor {t.name} has type {t.tensor_type.name}; the reference supports only "
            f"{', '.join(w.name for w in SUPPORTED_WTYPES)}")
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    # gguf.quants dequantizes block by block in float32, f16 scales widened (q4_1: d * q + m)
    return np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)


def load_llama(path: str | os.PathLike) -> LlamaModel:
    """Load a model of any architecture in SUPPORTED_ARCHS."""
    reader = open_gguf(path)
    arch = _field_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise SparqError(f"unsupported architecture {arch!r} (the reference has "
                         f"{', '.join(SUPPORTED_ARCHS)}): {path}")

    def kv(key, default=None, required=False):
        v = _field_value(reader, f"{arch}.{key}", default)
        if v is None and required:
            raise SparqError(f"GGUF key {arch}.{key} missing: {path}")
        return v

    tensors = {t.name: t for t in reader.tensors}

    def get(name, required=True):
        t = tensors.get(name)
        if t is None:
            if required:
                raise SparqError(f"GGUF tensor {name} missing: {path}")
            return None
        return dequant_tensor(t)

    n_layer = int(kv("block_count", required=True))
    n_embd = int(kv("embedding_length", required=True))
    n_head = int(kv("attention.head_count", required=True))
    n_head_kv = int(kv("attention.head_count_kv", n_head))
    if n_head_kv < 1 or n_head % n_head_kv:
        raise SparqError(f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    key_length = kv("attention.key_length")
    head_dim = int(key_length or n_embd // n_head)
    if int(kv("attention.value_length", head_dim)) != head_dim:
        raise SparqError("attention.value_length differs from key_length (unsupported)")
    n_rot = int(kv("rope.dimension_count", head_dim))
    if n_rot != head_dim:  # the graphs assert it (llama, qwen*, olmo2, granite); the RoPE here rotates all of D
        raise SparqError(f"invalid n_rot {n_rot}, expected {head_dim}")
    scaling = kv("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise SparqError(f"rope scaling type {scaling!r} is not supported by the reference")
    factor = float(kv("rope.scaling.factor", 0.0) or 0.0)
    freq_scale = 1.0 / factor if scaling == "linear" and factor > 0 else 1.0
    if kv("expert_count", 0):
        raise SparqError("MoE models are not supported by the reference")
    if float(kv("final_logit_softcapping", 0.0) or 0.0) or float(kv("attn_logit_softcapping", 0.0) or 0.0):
        raise SparqError("logit soft-capping is not supported by the reference")
    attn_scale = float(kv("attention.scale", 0.0) or 0.0) if arch in ("llama", "granite") else 0.0
    inv_sqrt_d = float(np.float32(1.0) / np.sqrt(np.float32(head_dim)))
    kq_scale, q_scale = (attn_scale if attn_scale != 0.0 else inv_sqrt_d), 0.0
    if arch in ("phi3", "gemma3"):  # the graph scales q by 1/sqrt(D) itself and attends with scale 1
        kq_scale, q_scale = 1.0, inv_sqrt_d
        if arch == "gemma3" and n_layer == 62:  # llama.cpp's 27B rule: 1/sqrt(n_embd / n_head)
            q_scale = float(np.float32(1.0) / np.sqrt(np.float32(n_embd // n_head)))

    swa_layers, n_swa = (), 0
    if arch == "gemma3" and int(kv("attention.sliding_window", 0) or 0) > 0:
        n_swa = int(kv("attention.sliding_window"))
        pattern = kv("attention.sliding_window_pattern", 6)
        if isinstance(pattern, (list, tuple)):  # per-layer flags
            swa_layers = tuple(bool(x) for x in pattern[:n_layer])
        else:  # llama_hparams::set_swa_pattern
            pattern = int(pattern)
            swa_layers = tuple(pattern == 0 or il % pattern < pattern - 1 for il in range(n_layer))
    elif int(kv("attention.sliding_window", 0) or 0) > 0 and arch == "olmo2":
        raise SparqError("olmo2 with sliding-window layers is not supported by the reference")

    tok_embd = get("token_embd.weight")
    n_vocab = int(kv("vocab_size", 0) or tok_embd.shape[0])
    n_ff = int(kv("feed_forward_length", required=True))
    hp = ModelHParams(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        n_ff=n_ff, n_vocab=n_vocab,
        n_ctx_train=int(kv("context_length", 0) or 0),
        rms_eps=float(kv("attention.layer_norm_rms_epsilon", required=True)),
        rope_freq_base=float(kv("rope.freq_base", 10000.0)), rope_freq_scale=freq_scale,
        arch=arch, key_length=int(key_length) if key_length else None,
        n_swa=n_swa, swa_layers=swa_layers,
        rope_freq_base_swa=float(kv("rope.freq_base_swa", 10000.0)), rope_freq_scale_swa=1.0,
        embedding_scale=float(kv("embedding_scale", 0.0) or 0.0) if arch == "granite" else 0.0,
        residual_scale=float(kv("residual_scale", 0.0) or 0.0) if arch == "granite" else 0.0,
        attention_scale=attn_scale,
        logit_scale=float(kv("logit_scale", required=True)) if arch == "granite" else 0.0,
        n_rot=n_rot, kq_scale=kq_scale, q_scale=q_scale, ffn_gelu=arch == "gemma3",
    )

    wtypes = {name: t.tensor_type for name, t in tensors.items()}
    output = get("output.weight", required=False)
    if output is None:  # tied embeddings
        output = tok_embd
        wtypes["output.weight"] = wtypes["token_embd.weight"]
    if "output.bias" in tensors:
        raise SparqError("tensor output.bias: an LM-head bias is not supported by the reference")

    n_q, n_kv = n_head * head_dim, n_head_kv * head_dim
    layers = []
    for i in range(n_layer):
        p = f"blk.{i}."
        for bias in ("attn_output.bias", "ffn_up.bias", "ffn_gate.bias", "ffn_down.bias", "attn_qkv.bias"):
            if p + bias in tensors:
                raise SparqError(f"tensor {p + bias}: bias terms are not supported by the reference")
        if arch != "qwen2":
            for bias in ("attn_q.bias", "attn_k.bias", "attn_v.bias"):
                if p + bias in tensors:
                    raise SparqError(f"tensor {p + bias}: bias terms are not supported by the reference")
        if p + "attn_qkv.weight" in tensors:
            if arch != "phi3":
                raise SparqError(f"tensor {p}attn_qkv.weight: fused QKV is supported for phi3 only")
            qkv = get(p + "attn_qkv.weight")
            if qkv.shape != (n_q + 2 * n_kv, n_embd):
                raise SparqError(f"{p}attn_qkv.weight: shape {qkv.shape}, expected {(n_q + 2 * n_kv, n_embd)}")
            wq, wk, wv = qkv[:n_q], qkv[n_q:n_q + n_kv], qkv[n_q + n_kv:]
            for t in ("attn_q", "attn_k", "attn_v"):  # the rounding of the activation follows the fused type
                wtypes[p + t + ".weight"] = wtypes[p + "attn_qkv.weight"]
        else:
            wq, wk, wv = get(p + "attn_q.weight"), get(p + "attn_k.weight"), get(p + "attn_v.weight")
        if arch == "phi3":  # ffn_up holds gate (first n_ff rows) and up: ggml_swiglu silus the first half
            up = get(p + "ffn_up.weight")
            if up.shape != (2 * n_ff, n_embd):
                raise SparqError(f"{p}ffn_up.weight: shape {up.shape}, expected {(2 * n_ff, n_embd)}")
            ffn_gate, ffn_up = up[:n_ff], up[n_ff:]
            wtypes[p + "ffn_gate.weight"] = wtypes[p + "ffn_up.weight"]
        else:
            ffn_gate, ffn_up = get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")
        norms = arch in ("qwen3", "gemma3", "olmo2")
        layers.append(LlamaLayer(
            attn_norm=get(p + "attn_norm.weight", required=arch != "olmo2"), wq=wq, wk=wk, wv=wv,
            wo=get(p + "attn_output.weight"),
            ffn_norm=get(p + "ffn_norm.weight", required=arch != "olmo2"), ffn_gate=ffn_gate, ffn_up=ffn_up,
            ffn_down=get(p + "ffn_down.weight"),
            bq=get(p + "attn_q.bias", required=False), bk=get(p + "attn_k.bias", required=False),
            bv=get(p + "attn_v.bias", required=False),
            q_norm=get(p + "attn_q_norm.weight", required=norms),
            k_norm=get(p + "attn_k_norm.weight", required=norms),
            attn_post_norm=get(p + "post_attention_norm.weight", required=arch in ("gemma3", "olmo2")),
            ffn_post_norm=get(p + "post_ffw_norm.weight", required=arch in ("gemma3", "olmo2")),
        ))
        L = layers[-1]
        shapes = {"wq": (n_q, n_embd), "wk": (n_kv, n_embd), "wv": (n_kv, n_embd), "wo": (n_embd, n_q)}
        if arch == "olmo2":
            shapes.update(q_norm=(n_q,), k_norm=(n_kv,))
        elif norms:
            shapes.update(q_norm=(head_dim,), k_norm=(head_dim,))
        for attr, shape in shapes.items():
            if getattr(L, attr).shape != shape:
                raise SparqError(f"{p}{attr}: shape {getattr(L, attr).shape}, expected {shape}")

    metadata = {name: f.contents() for name, f in reader.fields.items()
                if not name.startswith("GGUF.") and not name.startswith("tokenizer.ggml.")}
    return LlamaModel(
        path=os.fspath(path), hparams=hp, tok_embd=tok_embd, output_norm=get("output_norm.weight"),
        output=output, layers=layers, rope_freqs=get("rope_freqs.weight", required=False),
        wtypes=wtypes, metadata=metadata,
    )

