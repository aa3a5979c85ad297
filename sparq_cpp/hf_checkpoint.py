"""Read a Hugging Face Llama-family checkpoint directory with numpy: config, tensors, tokenizer.

No torch and no transformers: safetensors files are a JSON header plus raw little-endian arrays,
so tensors are memory-mapped one at a time (a 7B checkpoint converts in bounded memory).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparq_cpp import spm_model
from sparq_cpp.errors import SparqError
from sparq_cpp.geometry import ModelGeometry

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig(ModelGeometry):
    """config.json's geometry and what conversion needs besides."""
    tied_embeddings: bool
    name: str


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SparqError(f"{path}: invalid {what} ({e})") from None
    if not isinstance(data, dict):
        raise SparqError(f"{path}: invalid {what} (not a JSON object)")
    return data


def read_config(model_dir: Path) -> CheckpointConfig:
    """config.json, checked: a Llama-family architecture whose features llama.cpp's LLAMA arch has."""
    if not model_dir.exists():
        raise SparqError(f"model directory not found: {model_dir}")
    if not model_dir.is_dir():
        raise SparqError(f"{model_dir} is not a directory (give a Hugging Face checkpoint directory)")
    path = model_dir / "config.json"
    if not path.is_file():
        raise SparqError(f"{model_dir}: no config.json; not a Hugging Face checkpoint directory")
    c = _read_json(path, "config.json")
    archs = c.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise SparqError(f"{path}: architecture {', '.join(map(str, archs)) or '(none given)'} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    for key, ok in (("hidden_act", "silu"),):
        if c.get(key, ok) != ok:
            raise SparqError(f"{path}: {key} {c[key]!r} is not supported (only {ok!r})")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise SparqError(f"{path}: {key} is not supported")
    if c.get("rope_scaling"):
        raise SparqError(f"{path}: rope_scaling {c['rope_scaling']!r} is not supported")

    def need(key, default=None):
        v = c.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SparqError(f"{path}: {key} must be a positive integer, got {v!r}")
        return v

    n_embd, n_head = need("hidden_size"), need("num_attention_heads")
    n_head_kv = need("num_key_value_heads", n_head)
    head_dim = c.get("head_dim") or n_embd // n_head
    if head_dim * n_head != n_embd:
        raise SparqError(f"{path}: head_dim * num_attention_heads != hidden_size is not supported")
    if n_head % n_head_kv:
        raise SparqError(f"{path}: num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_head_kv}")
    if head_dim % 2:
        raise SparqError(f"{path}: head size {head_dim} must be even for RoPE")
    return CheckpointConfig(
        n_vocab=need("vocab_size"), n_embd=n_embd, n_layer=need("num_hidden_layers"), n_head=n_head,
        n_head_kv=n_head_kv, n_ff=need("intermediate_size"), n_ctx_train=need("max_position_embeddings", 4096),
        rms_eps=float(c.get("rms_norm_eps", 1e-6)), rope_freq_base=float(c.get("rope_theta", 10000.0)),
        tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        name=str(c.get("_name_or_path") or model_dir.resolve().name))


# ---- tensors ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class Tensors:
    """Name -> float32 array, read lazily from model.safetensors or its shards."""

    def __init__(self, model_dir: Path):
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            other = [p.name for p in model_dir.glob("*.bin")] + [p.name for p in model_dir.glob("*.pth")]
            hint = f" (found {', '.join(other)}: only safetensors weights are supported)" if other else ""
            raise SparqError(f"{model_dir}: no *.safetensors weights{hint}")
        self.entries: dict[str, _Entry] = {}
        for f in files:
            self._index(f)

    def _index(self, f: Path) -> None:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise SparqError(f"{f}: truncated safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise SparqError(f"{f}: not a safetensors file (bad header length)")
            try:
                header = json.loads(fh.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise SparqError(f"{f}: not a safetensors file (bad header)") from None
        for name, info in header.items():
            if name == "__metadata__":
                continue
            b, e = info["data_offsets"]
            entry = _Entry(f, info["dtype"], tuple(info["shape"]), 8 + n + b, 8 + n + e)
            if entry.end > size:
                raise SparqError(f"{f}: truncated (tensor {name} ends past the end of the file)")
            if name in self.entries:
                raise SparqError(f"{f}: tensor {name} appears in two files")
            self.entries[name] = entry

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def get(self, name: str) -> np.ndarray:
        e = self.entries[name]
        if e.dtype not in _DTYPES:
            raise SparqError(f"{e.file}: tensor {name} has dtype {e.dtype}; supported: {', '.join(_DTYPES)}")
        raw = np.memmap(e.file, dtype=_DTYPES[e.dtype], mode="r", offset=e.begin,
                        shape=(e.end - e.begin) // np.dtype(_DTYPES[e.dtype]).itemsize)
        if e.dtype == "BF16":  # bfloat16 is the top half of a float32
            arr = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.asarray(raw, dtype=np.float32)
        return arr.reshape(e.shape)


# ---- tokenizer --------------------------------------------------------------------------------

@dataclass
class Vocabulary:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    add_space_prefix: bool
    unk_id: int


def read_vocabulary(model_dir: Path, n_vocab: int) -> Vocabulary:
    """The SentencePiece vocabulary, padded to n_vocab like upstream's converter, with the
    tokenizer_config.json's added tokens applied."""
    path = model_dir / "tokenizer.model"
    if not path.is_file():
        if (model_dir / "tokenizer.json").is_file():
            raise SparqError(f"{model_dir}: only tokenizer.json (a BPE tokenizer, e.g. Llama 3) is present; "
                             "this converter reads SentencePiece tokenizer.model vocabularies")
        raise SparqError(f"{model_dir}: no tokenizer.model")
    try:
        m = spm_model.loads(path.read_bytes())
    except SparqError as e:
        raise SparqError(f"{path}: {e}") from None
    if m.model_type != spm_model.BPE:
        raise SparqError(f"{path}: a SentencePiece unigram model; llama.cpp's llama tokenizer needs BPE")
    if len(m.pieces) > n_vocab:
        raise SparqError(f"{path}: {len(m.pieces)} pieces but config.json vocab_size is {n_vocab}")
    pad = n_vocab - len(m.pieces)
    vocab = Vocabulary(m.pieces + [f"[PAD{i}]" for i in range(len(m.pieces), n_vocab)],
                       m.scores + [-10000.0] * pad, m.types + [spm_model.UNUSED] * pad,
                       m.add_dummy_prefix, m.unk_id)
    cfg_path = model_dir / "tokenizer_config.json"
    if cfg_path.is_file():
        cfg = _read_json(cfg_path, "tokenizer_config.json")
        if cfg.get("add_prefix_space") is not None:
            vocab.add_space_prefix = bool(cfg["add_prefix_space"])
        for tid, tok in (cfg.get("added_tokens_decoder") or {}).items():
            tid = int(tid)
            if not 0 <= tid < n_vocab:
                continue
            if vocab.tokens[tid] == tok["content"] and vocab.types[tid] not in (spm_model.NORMAL, spm_model.UNUSED):
                continue  # already this special piece (<unk> stays UNKNOWN)
            vocab.tokens[tid] = tok["content"]
            vocab.scores[tid] = -1000.0
            vocab.types[tid] = spm_model.CONTROL if tok.get("special") else spm_model.USER_DEFINED
    return vocab
