"""The model's own queries, keys and values, captured from llama.cpp, and the attention weights over them.

- `QKVCapture` runs a GGUF model through llama.cpp and copies out, per layer, the RoPE'd q (times the
  q scale the graph applies after RoPE) and k, and optionally v and the sparse op's output (the eval
  callback, as sparq_cpp/calib/capture.py uses it for Loki's keys).
- `exact_weights`, `sparq_weights` and `loki_weights`: the exact softmax weights of query rows over keys, and
  SparQ's and Loki's approximations of them.

sparq_cpp/calib/budget.py measures calibrate's fidelity with these; tools/fidelity.py and tools/output_error.py
(research measurements, run from a checkout) do too.
"""
from __future__ import annotations

import ctypes
import math

import gguf
import numpy as np

from sparq_cpp import lazy
from sparq_cpp.calib.capture import GGMLFunctions
from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import check_gguf, swa_layers
from sparq_cpp.llm import c_params, default_threads


# ---- the model's scales ------------------------------------------------------------------------------

def score_scales(model_path) -> tuple[float, float]:
    """(q_scale, kq_scale) as llama.cpp applies them: the RoPE'd q is multiplied by q_scale (1.0: not
    scaled) and attention scores by kq_scale. The same rules as sparq_cpp.reference.gguf_model.load_llama,
    without loading the weights."""
    s = check_gguf(model_path)
    D = s.head_dim
    inv_sqrt_d = float(np.float32(1.0) / np.sqrt(np.float32(D)))
    if s.arch in ("phi3", "gemma3"):  # the graph scales q by 1/sqrt(D) itself and attends with scale 1
        q_scale = inv_sqrt_d
        if s.arch == "gemma3" and s.n_layer == 62:  # llama.cpp's 27B rule
            q_scale = float(np.float32(1.0) / np.sqrt(np.float32(s.n_embd // s.n_head)))
        return q_scale, 1.0
    attn_scale = 0.0
    if s.arch in ("llama", "granite"):
        f = gguf.GGUFReader(str(model_path)).fields.get(f"{s.arch}.attention.scale")
        attn_scale = float(f.contents()) if f is not None else 0.0
    return 1.0, (attn_scale if attn_scale != 0.0 else inv_sqrt_d)


def full_attention_layers(model_path) -> list[int]:
    """The layers that attend to the whole context (all but sliding-window layers): where SparQ and Loki run."""
    s = check_gguf(model_path)
    window = swa_layers(model_path)
    return [il for il in range(s.n_layer) if window is None or not window[il]]


# ---- capture -----------------------------------------------------------------------------------------

class QKVCapture:
    """A llama.cpp context (f32 KV cache, flash attention on, `attention` set at creation if given) whose
    eval callback copies out, for `layers`, the RoPE'd q times q_scale ("q", [n, n_head, D]), the RoPE'd k
    ("k", [n, n_head_kv, D]), v ("v") and the sparse op's output ("out", [n, n_head, D]) where the context
    has one. `run(tokens)` evaluates a fresh sequence in ubatches of n_ubatch tokens; `run(tokens,
    fresh=False)` continues it. Both return {layer: {name: array}} for the tokens of that call."""

    PREFIXES = (b"Qcur-", b"Kcur-", b"Vcur-", b"sparq_attn-", b"loki_attn-")

    def __init__(self, model_path, *, layers=None, attention=None, ctx_size: int = 4096, n_ubatch: int = 512,
                 n_threads: int | None = None, want=("q", "k")):
        self.summary = s = check_gguf(model_path)
        self.q_scale, self.kq_scale = score_scales(model_path)
        self.layers = set(full_attention_layers(model_path) if layers is None else layers)
        self.want = set(want)
        self.n_ubatch = n_ubatch
        self.ctx_size = ctx_size
        L = self.L = lazy.llama_cpp()
        lazy.llama_cpp("_logger").set_verbose(False)
        self.g = GGMLFunctions()
        self._cb = L.ggml_backend_sched_eval_callback(self._eval)
        self._got: dict = {}
        self._error: BaseException | None = None
        self._n = 0
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(s.path).encode(), L.llama_model_default_params())
        if not self.model:
            raise SparqError(f"llama.cpp could not load {s.path}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = ctx_size, n_ubatch, n_ubatch
        cp.n_threads = cp.n_threads_batch = n_threads or default_threads()
        cp.type_k = cp.type_v = 0  # f32: the cache holds exactly the captured k and v
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.cb_eval, cp.cb_eval_user_data = self._cb, None
        cp.no_perf = True
        if attention is not None:
            cp.sparse_attn = c_params(attention, creation=True)
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            L.llama_model_free(self.model)
            self.model = None
            raise SparqError(f"llama.cpp could not create a context of {ctx_size} tokens for {s.path}")
        self._vocab = L.llama_model_get_vocab(self.model)

    # ---- tokens ----
    @property
    def bos(self) -> int | None:
        L = self.L
        return int(L.llama_vocab_bos(self._vocab)) if L.llama_vocab_get_add_bos(self._vocab) else None

    def tokenize(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        buf = (self.L.llama_token * (len(data) + 8))()
        n = self.L.llama_tokenize(self._vocab, data, len(data), buf, len(buf), False, False)
        if n < 0:
            raise SparqError(f"tokenizing failed ({n})")
        return list(buf[:n])

    # ---- evaluation ----
    def _eval(self, t, ask, _):
        try:
            tp = ctypes.cast(t, ctypes.POINTER(self.g.tensor_t))
            name = tp.contents.name
            prefix = next((p for p in self.PREFIXES if name.startswith(p)), None)
            if prefix is None or not name[len(prefix):].isdigit():
                return not ask
            il = int(name[len(prefix):])
            key = "out" if prefix in (b"sparq_attn-", b"loki_attn-") else prefix[0:1].decode().lower()
            if il not in self.layers or key not in self.want:
                return not ask
            if ask:
                return True
            if key in ("q", "k") and tp.contents.op != self.g.op_rope:
                return True  # the projection (or its norm) before RoPE
            self._got.setdefault(il, {})[key] = self.g.read(tp)  # the last one of a ubatch wins (v: its reshape)
            return True
        except BaseException as e:  # noqa: BLE001 (re-raised in run)
            self._error = self._error or e
            return False

    def run(self, tokens, fresh: bool = True) -> dict:
        L, s = self.L, self.summary
        if fresh:
            L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
            self._n = 0
        if self._n + len(tokens) > self.ctx_size:
            raise SparqError(f"{self._n} + {len(tokens)} tokens do not fit the context of {self.ctx_size}")
        parts: dict = {}
        for start in range(0, len(tokens), self.n_ubatch):
            chunk = tokens[start:start + self.n_ubatch]
            self._got = {}
            arr = (L.llama_token * len(chunk))(*chunk)
            rc = L.llama_decode(self.ctx, L.llama_batch_get_one(arr, len(chunk)))
            if self._error is not None:
                err, self._error = self._error, None
                raise err
            if rc != 0:
                raise SparqError(f"llama_decode failed with code {rc}")
            n = len(chunk)
            for il, d in self._got.items():
                for key, a in d.items():
                    heads = s.n_head_kv if key in ("k", "v") else s.n_head
                    a = a.reshape(n, heads, s.head_dim)
                    if key == "q" and self.q_scale != 1.0:
                        a = a * np.float32(self.q_scale)  # the graph's ggml_scale after RoPE
                    parts.setdefault(il, {}).setdefault(key, []).append(a)
            self._n += n
        return {il: {k: np.concatenate(v) for k, v in d.items()} for il, d in parts.items()}

    def close(self):
        if getattr(self, "ctx", None):
            self.L.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.L.llama_model_free(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---- rankings ----------------------------------------------------------------------------------------

def _group_softmax(logits: np.ndarray) -> np.ndarray:
    """[R, g, n] logits (-inf where masked) -> [R, g, n] softmax over n."""
    m = logits.max(-1, keepdims=True)
    e = np.exp(logits - m)
    return e / e.sum(-1, keepdims=True)


def _dot(Q, K) -> np.ndarray:
    """[R, g, D] x [n, D] -> [R, g, n] (one BLAS product)."""
    R, g, D = Q.shape
    return (Q.reshape(R * g, D) @ K.T).reshape(R, g, K.shape[0])


def exact_weights(Q, K, kq_scale, mask) -> np.ndarray:
    """Exact softmax weights [R, g, n] of query rows Q [R, g, D] (one KV head's group) over keys K [n, D]."""
    logits = kq_scale * _dot(Q, K)
    return _group_softmax(np.where(mask[:, None, :], logits, -np.inf))


def sparq_weights(Q, K, kq_scale, r, mask) -> np.ndarray:
    """SparQ's approximate softmax s_hat [R, g, n] (docs/spec.md SparQ steps 1-2): the r components with the
    largest |q| summed over the group, temperature kq_scale * sqrt(D) / tau_j."""
    R, g, D = Q.shape
    a = np.abs(Q).sum(1)  # [R, D]
    i1 = np.argsort(-a, axis=1, kind="stable")[:, :r]  # ties to the lower component, as the kernel
    keep = np.zeros((R, D), bool)
    np.put_along_axis(keep, i1, True, axis=1)
    Qm = np.where(keep[:, None, :], Q, 0.0)
    l1_all = np.abs(Q).sum(-1)
    l1_sel = np.abs(Qm).sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(l1_sel > 0, kq_scale * math.sqrt(D) / np.sqrt(D * l1_sel / l1_all), 0.0)
    logits = scale[..., None] * _dot(Qm, K)
    return _group_softmax(np.where(mask[:, None, :], logits, -np.inf))


def loki_weights(Qp, Kp, kq_scale, d, mask) -> np.ndarray:
    """Loki's approximate softmax [R, g, n]: the first d components of the rotated q' and k'."""
    logits = kq_scale * _dot(np.ascontiguousarray(Qp[..., :d]), np.ascontiguousarray(Kp[:, :d]))
    return _group_softmax(np.where(mask[:, None, :], logits, -np.inf))
