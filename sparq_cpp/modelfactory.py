"""Synthetic GGUF models of llama.cpp architectures with ordinary attention (llama, qwen2, qwen3, phi3,
gemma3, olmo2, granite): real shapes, random weights, a working tokenizer.

No weights can be downloaded, so tests and benchmarks run on models written here. Weights are
uniform int8 codes times a per-row scale, so the f32 and q8_0 files of one seed hold exactly the
same model (f16 rounds it). q and k projections get a per-head spectrum and a gain so that
attention is peaked and keys are roughly low-rank, as in trained models, which SparQ and Loki
rely on. Tensors are generated and written one at a time, each from its own RNG stream, so memory
stays bounded by the largest tensor and `layers=2` gives the first two layers of the full model.
Architectures whose q and k pass through an RMS norm (qwen3, gemma3, olmo2) get the gain in the norm
weights, since the norm removes any scale the projection had; their other norms are near-1 noise, so
a norm applied in the wrong place shows in the logits.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.constants import GGML_QUANT_VERSION
from tqdm import tqdm

from sparq_cpp.errors import SparqError
from sparq_cpp.geometry import ModelGeometry, add_geometry
from sparq_cpp.gguf_check import MAX_LAYERS, SUPPORTED_ARCHS
from sparq_cpp.outfile import atomic_write, check_space, fmt_bytes
from sparq_cpp import system
from sparq_cpp.tokenizer import BOS_ID, EOS_ID, UNK_ID, build_vocab, min_vocab_size

# Bump whenever the bytes written for the same arguments change (it keys the model cache).
FACTORY_VERSION = 2

WTYPES = ("f32", "f16", "q8_0")
QK8_0 = 32  # q8_0 block: one f16 scale and 32 int8 codes

# Standard deviation of int8 codes uniform on [-127, 127].
_CODE_STD = float(np.sqrt((255**2 - 1) / 12))
# Target std of the attention logits q.k/sqrt(D) for random inputs: 3 puts ~85% of the attention
# mass on the top 64 of 2048 keys, peaked but not one-hot.
QK_LOGIT_STD = 3.0
# Per-head spectrum of q and k: the variance of rotary pair i falls as (i+1)^-SPECTRUM_POWER, in a
# random order per KV head. 0.75 puts ~60% of the key variance in a quarter of the dimensions.
SPECTRUM_POWER = 0.75
_CHUNK = 1 << 24  # elements generated at a time

# chat=True: ChatML, as SmolLM2 and Qwen use it. The end-of-turn token is not EOS (</s> stays EOS), as
# Llama 3's <|eot_id|> is not, so a loop that stops only on EOS runs past the end of a turn.
CHAT_START, CHAT_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")
# The end-of-turn row of output.weight is scaled by this: random weights rarely pick one token of
# thousands; at 3.5 times the others' logit spread a greedy answer ends after a few dozen tokens.
CHAT_END_GAIN = 3.5


# q projection width is n_embd in these graphs (llama.cpp loads attn_q as {n_embd, n_embd})
_Q_IS_N_EMBD = ("qwen2", "phi3", "olmo2")


PRESETS: dict[str, ModelGeometry] = {
    "tiny": ModelGeometry(2, 256, 4, 4, 512, 2048, 4096),
    "tiny-gqa": ModelGeometry(2, 512, 4, 2, 1024, 2048, 4096),
    "llama2-7b": ModelGeometry(32, 4096, 32, 32, 11008, 32000, 4096),
    "llama3-8b": ModelGeometry(32, 4096, 32, 8, 14336, 128256, 8192, rope_freq_base=500000.0),
    "mistral-7b": ModelGeometry(32, 4096, 32, 8, 14336, 32000, 32768),
    # one small model per architecture, head sizes spread over 64..256
    "tiny-qwen2": ModelGeometry(2, 256, 4, 2, 512, 2048, 4096, rope_freq_base=1000000.0, rms_eps=1e-6,
                                arch="qwen2"),
    "tiny-qwen3": ModelGeometry(2, 256, 4, 2, 512, 2048, 4096, rope_freq_base=1000000.0, rms_eps=1e-6,
                                arch="qwen3", key_length=128),
    "tiny-phi3": ModelGeometry(2, 384, 4, 4, 512, 2048, 4096, arch="phi3"),
    "tiny-gemma3": ModelGeometry(4, 256, 2, 1, 512, 2048, 4096, rope_freq_base=1000000.0, rms_eps=1e-6,
                                 arch="gemma3", key_length=256, n_swa=32, swa_pattern=2),
    "tiny-olmo2": ModelGeometry(2, 320, 4, 2, 512, 2048, 4096, rms_eps=1e-6, arch="olmo2"),
    "tiny-granite": ModelGeometry(2, 448, 4, 2, 768, 2048, 4096, arch="granite", embedding_scale=12.0,
                                  residual_scale=0.22, attention_scale=0.015625, logit_scale=8.0),
}

_FILE_TYPES = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16,
               "q8_0": LlamaFileType.MOSTLY_Q8_0}


# ---- arguments ----------------------------------------------------------------------------

def resolve_geometry(preset: str = "tiny", *, layers: int | None = None, wtype: str = "f32",
                     **overrides) -> ModelGeometry:
    """The preset's geometry with overrides applied, checked; SparqError names a bad argument."""
    if preset not in PRESETS:
        raise SparqError(f"preset: unknown {preset!r} (choose from {', '.join(PRESETS)})")
    if wtype not in WTYPES:
        raise SparqError(f"wtype: unknown {wtype!r} (choose from {', '.join(WTYPES)})")
    fields = {f.name for f in dataclasses.fields(ModelGeometry)}
    for key in overrides:
        if key not in fields:
            raise SparqError(f"{key}: not a geometry field (choose from {', '.join(sorted(fields))})")
    if layers is not None:
        if not _is_int(layers) or layers < 1:
            raise SparqError(f"layers: must be an integer >= 1, got {layers!r}")
        overrides["n_layer"] = layers
    geo = dataclasses.replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})
    _check_geometry(geo, wtype)
    return geo


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_geometry(g: ModelGeometry, wtype: str) -> None:
    for name in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "n_vocab", "n_ctx_train"):
        value = getattr(g, name)
        if not _is_int(value) or value < 1:
            raise SparqError(f"{name}: must be an integer >= 1, got {value!r}")
    if g.n_layer > MAX_LAYERS:
        raise SparqError(f"n_layer: llama.cpp loads at most {MAX_LAYERS} layers, got {g.n_layer}")
    for name in ("rope_freq_base", "rms_eps"):
        if not float(getattr(g, name)) > 0:
            raise SparqError(f"{name}: must be > 0, got {getattr(g, name)!r}")
    if g.arch not in SUPPORTED_ARCHS:
        raise SparqError(f"arch: unknown {g.arch!r} (choose from {', '.join(SUPPORTED_ARCHS)})")
    if g.key_length is not None:
        if not _is_int(g.key_length) or g.key_length < 1:
            raise SparqError(f"key_length: must be an integer >= 1, got {g.key_length!r}")
        if g.arch in _Q_IS_N_EMBD and g.key_length * g.n_head != g.n_embd:
            raise SparqError(f"key_length: {g.arch} needs n_head * key_length == n_embd ({g.n_embd})")
    elif g.n_embd % g.n_head:
        raise SparqError(f"n_embd: {g.n_embd} is not divisible by n_head {g.n_head}")
    if g.swa_layers:
        raise SparqError("swa_layers: the factory writes a window pattern; give n_swa and swa_pattern")
    if g.n_swa or g.swa_pattern:
        if g.arch != "gemma3":
            raise SparqError(f"n_swa: the factory writes sliding-window layers for gemma3 only, not {g.arch}")
        if not (_is_int(g.n_swa) and g.n_swa >= 1 and _is_int(g.swa_pattern) and g.swa_pattern >= 1):
            raise SparqError(f"n_swa, swa_pattern: must be integers >= 1, got {g.n_swa!r}, {g.swa_pattern!r}")
    for name in ("embedding_scale", "residual_scale", "attention_scale", "logit_scale"):
        value = getattr(g, name)
        if value and g.arch != "granite":
            raise SparqError(f"{name}: only granite models have it")
        if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
            raise SparqError(f"{name}: must be a finite number >= 0, got {value!r}")
    if g.arch == "granite" and not g.logit_scale > 0:
        raise SparqError("logit_scale: granite needs one > 0 (llama.cpp requires the key)")
    if g.head_dim % 2:
        raise SparqError(f"n_head: head size n_embd/n_head = {g.head_dim} must be even for RoPE")
    if g.n_head % g.n_head_kv:
        raise SparqError(f"n_head_kv: n_head {g.n_head} is not divisible by n_head_kv {g.n_head_kv}")
    if g.n_vocab < min_vocab_size():
        raise SparqError(f"n_vocab: must be at least {min_vocab_size()}, got {g.n_vocab}")
    if wtype == "q8_0":
        for name in ("n_embd", "n_ff"):
            if getattr(g, name) % QK8_0:
                raise SparqError(f"{name}: must be a multiple of {QK8_0} for wtype q8_0")
        if g.n_head * g.head_dim % QK8_0:
            raise SparqError(f"key_length: n_head * head size must be a multiple of {QK8_0} for wtype q8_0")


# ---- weights ------------------------------------------------------------------------------

def _rng(seed: int, name: str) -> np.random.Generator:
    """One independent stream per tensor: a tensor does not depend on which others are written."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _row_scales(row_std: np.ndarray) -> np.ndarray:
    """Per-row scale of the int8 codes, rounded to f16 so that q8_0 stores it exactly."""
    return (np.asarray(row_std, np.float32) / _CODE_STD).astype(np.float16).astype(np.float32)


def _encode(codes: np.ndarray, scales: np.ndarray, wtype: str) -> np.ndarray:
    """Rows of int8 codes times their scales, in wtype's storage (q8_0: uint8 blocks)."""
    if wtype == "q8_0":
        rows, cols = codes.shape
        blocks = np.empty((rows, cols // QK8_0, 2 + QK8_0), np.uint8)
        blocks[:, :, :2] = scales.astype(np.float16).view(np.uint8).reshape(rows, 1, 2)
        blocks[:, :, 2:] = codes.view(np.uint8).reshape(rows, -1, QK8_0)
        return blocks.reshape(rows, -1)
    values = codes.astype(np.float32)
    values *= scales[:, None]
    return values.astype(np.float16) if wtype == "f16" else values


def _storage(rows: int, cols: int, wtype: str) -> tuple[tuple[int, int], np.dtype]:
    if wtype == "q8_0":
        return (rows, cols // QK8_0 * (2 + QK8_0)), np.dtype(np.uint8)
    return (rows, cols), np.dtype(np.float16 if wtype == "f16" else np.float32)


def _matrix(rng: np.random.Generator, row_std: np.ndarray, cols: int, wtype: str) -> np.ndarray:
    """A (rows, cols) weight with the given per-row std, generated in chunks of rows."""
    rows = len(row_std)
    scales = _row_scales(row_std)
    shape, dtype = _storage(rows, cols, wtype)
    out = np.empty(shape, dtype)
    step = max(1, _CHUNK // cols)
    for r in range(0, rows, step):
        codes = rng.integers(-127, 128, (min(step, rows - r), cols), dtype=np.int8)
        out[r:r + len(codes)] = _encode(codes, scales[r:r + len(codes)], wtype)
    return out


def _qk_gain(g: ModelGeometry, base: np.ndarray) -> float:
    """The factor on q and k components (spectrum `base`, mean square 1) that puts the attention logits'
    std at QK_LOGIT_STD: var(kq_scale * q.k) = kq_scale^2 * D * gain^4 * mean(s^4)."""
    if not g.attention_scale:  # kq_scale = 1/sqrt(D): the formula the llama presets were written with
        return np.sqrt(QK_LOGIT_STD / np.sqrt(np.mean(base**4)))
    return np.sqrt(QK_LOGIT_STD / (np.sqrt(np.mean(base**4)) * g.attention_scale * np.sqrt(g.head_dim)))


def _spectrum_base(g: ModelGeometry) -> np.ndarray:
    base = (np.arange(g.head_dim // 2) + 1.0) ** (-SPECTRUM_POWER / 2)
    return base / np.sqrt(np.mean(base**2))


def qk_row_std(g: ModelGeometry, seed: int, il: int, n_heads: int) -> np.ndarray:
    """Per-row std of attn_q or attn_k: a spectrum over rotary pairs shared by q and k heads.

    RoPE rotates pairs of dimensions (adjacent ones in llama.cpp's normal mode, i and i + D/2 in NeoX
    mode), and both members of a pair get one scale. A query head uses the spectrum of the KV head
    it reads. The gain puts the attention logits' std at QK_LOGIT_STD: with q_j, k_j ~ gain * s_j,
    var(q.k / sqrt(D)) = gain^4 * mean(s^4).
    """
    base = _spectrum_base(g)
    rng = _rng(seed, f"blk.{il}.qk_spectrum")
    spectra = np.stack([rng.permutation(base) for _ in range(g.n_head_kv)])  # (kv heads, pairs)
    gain = _qk_gain(g, base)
    per_head = np.repeat(spectra, n_heads // g.n_head_kv, axis=0)  # q heads share their KV head's
    if g.rope_neox:
        per_row = np.concatenate([per_head, per_head], axis=1).reshape(-1)
    else:
        per_row = np.repeat(per_head, 2, axis=1).reshape(-1)
    return gain * per_row / np.sqrt(g.n_embd)


@dataclass(frozen=True)
class _Vec:
    """An f32 vector tensor (norm weight or bias): `mean` plus N(0, std) noise from the tensor's stream."""
    mean: float
    std: float = 0.0

    def values(self, seed: int, name: str, n: int) -> np.ndarray:
        v = np.full(n, self.mean, np.float32)
        if self.std:
            v += (self.std * _rng(seed, name).standard_normal(n)).astype(np.float32)
        return v


def _is_vector(row_std) -> bool:
    return row_std is None or isinstance(row_std, _Vec)


def _tensors(g: ModelGeometry, seed: int) -> Iterator[tuple[str, int, int, object]]:
    """(name, rows, cols, row std) in llama.cpp's order. The row std is a function that makes it, so
    the list of all tensors takes no memory until one is written; None is an f32 norm of ones, a
    _Vec another f32 vector.

    Row stds are 1/sqrt(fan_in) so every projection keeps unit-scale activations; the embedding
    has unit std (after the architecture's embedding scale) so the first layer sees inputs like
    the residual stream's.
    """
    D = g.head_dim
    n_q, n_kv = g.n_head * D, g.n_head_kv * D
    arch = g.arch
    norm = None if arch == "llama" else _Vec(1.0, 0.1)  # llama keeps the ones its files always had

    def flat(rows: int, fan_in: int):
        return lambda: np.full(rows, 1.0 / np.sqrt(fan_in))

    def qk(il: int, n_heads: int):
        return lambda: qk_row_std(g, seed, il, n_heads)

    def qkv(il: int):
        return lambda: np.concatenate([qk_row_std(g, seed, il, g.n_head), qk_row_std(g, seed, il, g.n_head_kv),
                                       np.full(n_kv, 1.0 / np.sqrt(g.n_embd))])

    embd_std = 1.0 / np.sqrt(g.n_embd) if arch == "gemma3" else 1.0 / g.embedding_scale if g.embedding_scale else 1.0
    qk_norm = _Vec(float(_qk_gain(g, _spectrum_base(g))))  # the norm removes the projection's scale
    yield "token_embd.weight", g.n_vocab, g.n_embd, lambda: np.full(g.n_vocab, embd_std)
    for il in range(g.n_layer):
        b = f"blk.{il}."
        if arch != "olmo2":  # olmo2 has post-norms only
            yield b + "attn_norm.weight", 1, g.n_embd, norm
        if arch == "phi3":
            yield b + "attn_qkv.weight", n_q + 2 * n_kv, g.n_embd, qkv(il)
        else:
            yield b + "attn_q.weight", n_q, g.n_embd, qk(il, g.n_head)
            yield b + "attn_k.weight", n_kv, g.n_embd, qk(il, g.n_head_kv)
            yield b + "attn_v.weight", n_kv, g.n_embd, flat(n_kv, g.n_embd)
        if arch == "qwen2":
            for t, n in (("q", n_q), ("k", n_kv), ("v", n_kv)):
                yield b + f"attn_{t}.bias", 1, n, _Vec(0.0, 0.1)
        yield b + "attn_output.weight", g.n_embd, n_q, flat(g.n_embd, n_q)
        if arch in ("qwen3", "gemma3"):  # per head
            yield b + "attn_q_norm.weight", 1, D, qk_norm
            yield b + "attn_k_norm.weight", 1, D, qk_norm
        elif arch == "olmo2":  # over the whole projection
            yield b + "attn_q_norm.weight", 1, n_q, qk_norm
            yield b + "attn_k_norm.weight", 1, n_kv, qk_norm
        if arch in ("gemma3", "olmo2"):
            yield b + "post_attention_norm.weight", 1, g.n_embd, norm
        if arch != "olmo2":
            yield b + "ffn_norm.weight", 1, g.n_embd, norm
        if arch == "phi3":  # gate and up fused: rows [0, n_ff) are the gate
            yield b + "ffn_up.weight", 2 * g.n_ff, g.n_embd, flat(2 * g.n_ff, g.n_embd)
        else:
            yield b + "ffn_gate.weight", g.n_ff, g.n_embd, flat(g.n_ff, g.n_embd)
            yield b + "ffn_up.weight", g.n_ff, g.n_embd, flat(g.n_ff, g.n_embd)
        yield b + "ffn_down.weight", g.n_embd, g.n_ff, flat(g.n_embd, g.n_ff)
        if arch in ("gemma3", "olmo2"):
            yield b + "post_ffw_norm.weight", 1, g.n_embd, norm
    yield "output_norm.weight", 1, g.n_embd, norm
    yield "output.weight", g.n_vocab, g.n_embd, flat(g.n_vocab, g.n_embd)


# ---- file ---------------------------------------------------------------------------------

def _add_metadata(w: GGUFWriter, g: ModelGeometry, preset: str, wtype: str, seed: int) -> None:
    # llama.cpp's vocab loader expects Phi-3's special tokens in a model whose name contains "phi3"
    w.add_name(f"sparq-synthetic-{preset}".replace("phi3", "phi-iii"))
    w.add_file_type(int(_FILE_TYPES[wtype]))
    w.add_quantization_version(GGML_QUANT_VERSION)
    add_geometry(w, g)
    w.add_string("sparq.preset", preset)
    w.add_uint64("sparq.seed", seed)
    w.add_uint32("sparq.factory_version", FACTORY_VERSION)


def chat_token_ids(n_vocab: int) -> tuple[int, int]:
    """(start, end) of a chat model's turns: the last two tokens (fillers in other models)."""
    return n_vocab - 2, n_vocab - 1


def _add_tokenizer(w: GGUFWriter, n_vocab: int, chat: bool = False) -> None:
    vocab = build_vocab(n_vocab)
    if chat:
        for tid, text in zip(chat_token_ids(n_vocab), (CHAT_START, CHAT_END)):
            vocab.tokens[tid], vocab.types[tid], vocab.scores[tid] = text, int(TokenType.CONTROL), 0.0
    w.add_tokenizer_model("llama")
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    # No implicit leading space: detokenize(tokenize(text)) == text with or without BOS.
    w.add_add_space_prefix(False)
    if chat:
        w.add_eot_token_id(chat_token_ids(n_vocab)[1])
        w.add_chat_template(CHAT_TEMPLATE)


def _add_tensor_infos(w: GGUFWriter, specs: list, wtype: str) -> None:
    qtype = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16,
             "q8_0": GGMLQuantizationType.Q8_0}[wtype]
    for name, rows, cols, row_std in specs:
        if _is_vector(row_std):  # norms and biases are always f32 vectors
            w.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
            continue
        shape, dtype = _storage(rows, cols, wtype)
        w.add_tensor_info(name, (rows, cols), np.dtype(np.float32), shape[0] * shape[1] * dtype.itemsize,
                          raw_dtype=qtype)


def write_model(path, preset: str = "tiny", *, layers: int | None = None, wtype: str = "f32",
                seed: int = 0, progress: bool = False, make_parents: bool = False, chat: bool = False,
                **overrides) -> Path:
    """Write a synthetic GGUF (the preset's architecture) to path (atomically) and return the path.

    overrides replace ModelGeometry fields of the preset; `layers` replaces n_layer. The same
    arguments always give a byte-identical file. path's directory must exist unless make_parents.
    chat: an instruct model: ChatML special tokens and template, an end-of-turn token apart from EOS
    (CHAT_TEMPLATE, CHAT_END_GAIN).
    """
    g = resolve_geometry(preset, layers=layers, wtype=wtype, **overrides)
    if chat and wtype == "q8_0":
        raise SparqError("chat: the end-of-turn row is written as floats; use wtype f32 or f16")
    if not _is_int(seed) or not 0 <= seed < 2**63:
        raise SparqError(f"seed: must be an integer in [0, 2**63), got {seed!r}")
    path = Path(path).expanduser()
    if path.is_dir():
        raise SparqError(f"path: {path} is a directory")
    check_resources(g, wtype, path)
    specs = list(_tensors(g, seed))
    return atomic_write(path, lambda tmp: _write(tmp, g, specs, preset, wtype, seed, progress and path.name, chat),
                        "path", make_parents=make_parents)


# Writing holds the tokenizer's strings, scores and types twice (as Python objects and packed).
_VOCAB_BYTES_PER_TOKEN = 512


def write_footprint(g: ModelGeometry, wtype: str) -> dict:
    """What writing the model takes, in bytes: `memory` at the peak (the largest tensor, its row
    scales and the chunk of codes being encoded, plus the vocabulary), `disk` (the tensor data;
    the metadata is a few bytes per token more), and the `largest` tensor's name and size."""
    peak, disk, largest = 0, 0, ("", 0)
    for name, rows, cols, row_std in _tensors(g, 0):
        if _is_vector(row_std):
            disk += cols * 4
            continue
        shape, dtype = _storage(rows, cols, wtype)
        nbytes = shape[0] * shape[1] * dtype.itemsize
        chunk = min(rows, max(1, _CHUNK // cols)) * cols  # int8 codes, then f32 and f16 copies
        peak = max(peak, nbytes + rows * 12 + chunk * 9)
        largest = max(largest, (name, nbytes), key=lambda t: t[1])
        disk += nbytes
    return {"memory": peak + g.n_vocab * _VOCAB_BYTES_PER_TOKEN, "disk": disk + g.n_vocab * 32,
            "largest": largest}


def check_resources(g: ModelGeometry, wtype: str, path: Path) -> None:
    """Refuse up front a model this machine cannot write: more memory than is available now, or a
    bigger file than the disk has room for (else a MemoryError, or a full disk, halfway through)."""
    need = write_footprint(g, wtype)
    name, nbytes = need["largest"]
    avail = system.mem_available()  # 0: unknown
    if avail and need["memory"] > avail:
        raise SparqError(f"writing this model needs about {fmt_bytes(need['memory'])} of memory (its largest "
                         f"tensor, {name}, is {fmt_bytes(nbytes)}); {fmt_bytes(avail)} is available")
    check_space(path, need["disk"], "path")


def _write(tmp: Path, g: ModelGeometry, specs: list, preset: str, wtype: str, seed: int,
           progress: str | bool, chat: bool = False) -> None:
    w = GGUFWriter(tmp, g.arch)
    try:
        _add_metadata(w, g, preset, wtype, seed)
        _add_tokenizer(w, g.n_vocab, chat)
        _add_tensor_infos(w, specs, wtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, rows, cols, row_std in _progress(specs, progress):
            if row_std is None:
                w.write_tensor_data(np.ones(cols, np.float32))
            elif isinstance(row_std, _Vec):
                w.write_tensor_data(row_std.values(seed, name, cols))
            else:
                m = _matrix(_rng(seed, name), row_std(), cols, wtype)
                if chat and name == "output.weight":
                    m[chat_token_ids(g.n_vocab)[1]] *= CHAT_END_GAIN
                w.write_tensor_data(m)
    finally:
        w.close()


def _progress(specs: list, desc: str | bool):
    """specs, with a tqdm bar over them when desc (the bar's label) is set."""
    if not desc:
        return specs
    return tqdm(specs, desc=desc, unit="tensor")


# ---- cache --------------------------------------------------------------------------------

def cache_dir() -> Path:
    root = os.environ.get("SPARQ_CPP_CACHE") or "~/.cache/sparq-cpp"
    return Path(root).expanduser() / "models"


def default_model_path(preset: str = "tiny", wtype: str = "f32", layers: int | None = None,
                       chat: bool = False) -> Path:
    """A cached model (seed 0), written on first use. Concurrent callers may both write it; each
    writes its own temporary file and replaces atomically, and the bytes are identical."""
    resolve_geometry(preset, layers=layers, wtype=wtype)  # fail before touching the cache
    key = json.dumps([FACTORY_VERSION, preset, wtype, layers] + (["chat"] if chat else []))
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    suffix = f"-L{layers}" if layers is not None else ""
    suffix += "-chat" if chat else ""
    path = cache_dir() / f"{preset}-{wtype}{suffix}-{digest}.gguf"
    if not path.exists():
        write_model(path, preset, layers=layers, wtype=wtype, seed=0, make_parents=True, chat=chat)
    return path
