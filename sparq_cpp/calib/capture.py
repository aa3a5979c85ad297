"""Run a GGUF model through llama.cpp and capture every layer's keys before and after RoPE.

llama.cpp's eval callback (llama_context_params.cb_eval) is asked about every graph node before it
is computed; answering "yes" makes the scheduler stop the graph right after that node, so its
output is intact (no fusion with the next op, e.g. RoPE into the KV-cache store) and readable in
the second call. The Llama graph names the key projection "Kcur-<il>" (a MUL_MAT, or an ADD with
a bias) and names the RoPE output "Kcur-<il>" again; the ROPE op tells the second from the first.
Where the graph normalizes k before RoPE (qwen3, gemma3, olmo2) the RoPE input is "Kcur_normed-<il>";
where it fuses QKV into one matmul (phi3) the keys before RoPE are a slice of "wqkv-<il>". The last
of these seen before the RoPE is the "pre" key.
"""
from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np

from sparq_cpp import lazy
from sparq_cpp.bindings.ggml_ops import ggml_tensor, lib_dir
from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import GGUFSummary, check_gguf
from sparq_cpp.llm import default_threads

GGML_TYPE_F32 = 0
# size of struct ggml_object, which ggml_tensor_overhead() adds to sizeof(struct ggml_tensor)
_GGML_OBJECT_SIZE = 32

# on_keys(il, pre, post, pos): keys float32 [n_tokens, n_head_kv, D] of one layer and ubatch,
# before and after RoPE, and the token positions int64 [n_tokens].
KeySink = Callable[[int, np.ndarray, np.ndarray, np.ndarray], None]


class GGMLFunctions:
    """The few libggml-base functions the callback needs, from the library llama_cpp loaded."""

    def __init__(self):
        self.tensor_t = ggml_tensor
        try:
            lib = ctypes.CDLL(str(lib_dir() / "libggml-base.so"))
        except OSError as e:
            raise SparqError(f"cannot load libggml-base.so next to llama_cpp: {e}") from None
        tp = ctypes.POINTER(ggml_tensor)
        for name, res, args in [
            ("ggml_op_name", ctypes.c_char_p, [ctypes.c_int]),
            ("ggml_get_name", ctypes.c_char_p, [tp]),
            ("ggml_nbytes", ctypes.c_size_t, [tp]),
            ("ggml_tensor_overhead", ctypes.c_size_t, []),
            ("ggml_backend_buffer_is_host", ctypes.c_bool, [ctypes.c_void_p]),
            ("ggml_backend_tensor_get", None, [tp, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]),
        ]:
            f = getattr(lib, name)
            f.restype, f.argtypes = res, args
            setattr(self, name[5:], f)
        # Our ctypes mirror of struct ggml_tensor must match the library's layout.
        if ctypes.sizeof(ggml_tensor) != self.tensor_overhead() - _GGML_OBJECT_SIZE:
            raise SparqError("the ctypes mirror of struct ggml_tensor does not match this ggml build")
        # Look the op up by name: the enum value shifts when a patch adds ops before it.
        self.op_rope = next((i for i in range(1024) if self.op_name(i) == b"ROPE"), None)
        if self.op_rope is None:
            raise SparqError("this ggml build has no ROPE op")

    def read(self, tp) -> np.ndarray:
        """The tensor's f32 data as numpy, shape ne reversed, copied out of its (maybe device) buffer."""
        t = tp.contents
        if t.type != GGML_TYPE_F32:
            raise SparqError(f"key tensor {t.name.decode()} has ggml type {t.type}; only f32 activations are supported")
        nbytes = self.nbytes(tp)
        raw = np.empty(nbytes, np.uint8)
        if t.buffer and not self.backend_buffer_is_host(t.buffer):
            self.backend_tensor_get(tp, raw.ctypes.data, 0, nbytes)
        else:
            ctypes.memmove(raw.ctypes.data, t.data, nbytes)
        shape = tuple(t.ne[i] for i in reversed(range(4)))
        strides = tuple(t.nb[i] for i in reversed(range(4)))
        return np.lib.stride_tricks.as_strided(raw.view(np.float32), shape, strides).copy()


class KeyCapture:
    """A llama.cpp model and context whose eval callback sends each layer's keys to `on_keys`.

    `run(tokens)` evaluates one chunk as one sequence from position 0 (the cache is cleared first).
    """

    def __init__(self, model_path, on_keys: KeySink, *, ctx_size: int = 2048, n_threads: int | None = None,
                 n_ubatch: int = 512):
        self.summary: GGUFSummary = check_gguf(model_path)
        self.on_keys = on_keys
        self.ctx_size = ctx_size
        llama_cpp = lazy.llama_cpp()
        lazy.llama_cpp("_logger").set_verbose(False)
        self._L = llama_cpp
        self._ggml = GGMLFunctions()
        s = self.summary
        self._n_layer, self._shape = s.n_layer, (s.n_head_kv, s.head_dim)
        n_q = s.n_head * s.head_dim
        self._k_cols = slice(n_q, n_q + s.n_head_kv * s.head_dim)  # K's columns of a fused QKV row
        self._pending: dict[int, np.ndarray] = {}  # layer -> pre-RoPE keys of the current ubatch
        self._pos = np.zeros(s.n_layer, np.int64)  # next position per layer
        self._error: BaseException | None = None
        # The C side keeps only a pointer: hold the ctypes callback for the context's lifetime.
        self._cb = llama_cpp.ggml_backend_sched_eval_callback(self._eval)

        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        self._model = llama_cpp.llama_model_load_from_file(str(s.path).encode(), mparams)
        if not self._model:
            raise SparqError(f"llama.cpp could not load {s.path}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = ctx_size
        cparams.n_batch = ctx_size  # one llama_decode per chunk; ubatches split it
        cparams.n_ubatch = min(n_ubatch, ctx_size)
        cparams.n_threads = cparams.n_threads_batch = n_threads or default_threads()
        cparams.cb_eval = self._cb
        cparams.cb_eval_user_data = None
        cparams.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            self.close()
            raise SparqError(f"llama.cpp could not create a context of {ctx_size} tokens for {s.path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)

    # ---- tokens ----
    @property
    def bos(self) -> int | None:
        """The BOS token each chunk starts with, or None when the model adds none."""
        L = self._L
        return int(L.llama_vocab_bos(self._vocab)) if L.llama_vocab_get_add_bos(self._vocab) else None

    def tokenize(self, text: str) -> list[int]:
        """Tokens of text, without BOS and without parsing special tokens."""
        data = text.encode("utf-8")
        buf = (self._L.llama_token * (len(data) + 8))()
        n = self._L.llama_tokenize(self._vocab, data, len(data), buf, len(buf), False, False)
        if n < 0:
            raise SparqError(f"tokenizing the calibration text failed ({n})")
        return list(buf[:n])

    # ---- evaluation ----
    def run(self, tokens) -> None:
        """Evaluate one chunk (at most ctx_size tokens) as a fresh sequence."""
        L = self._L
        n = len(tokens)
        if not 0 < n <= self.ctx_size:
            raise SparqError(f"a chunk must have 1..{self.ctx_size} tokens, got {n}")
        L.llama_memory_clear(L.llama_get_memory(self._ctx), True)
        self._pos[:] = 0
        self._pending.clear()
        arr = (L.llama_token * n)(*tokens)
        rc = L.llama_decode(self._ctx, L.llama_batch_get_one(arr, n))
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if rc != 0:
            raise SparqError(f"llama_decode failed with code {rc}")
        missing = [il for il in range(self._n_layer) if self._pos[il] != n]
        if missing:
            raise SparqError(f"no keys captured for layers {missing[:8]} (the graph has no RoPE'd 'Kcur-<il>' "
                             "there); this architecture is not supported for calibration")

    _PREFIXES = (b"Kcur-", b"Kcur_normed-", b"wqkv-")

    def _layer(self, name: bytes) -> tuple[int, bytes] | None:
        for prefix in self._PREFIXES:
            if name.startswith(prefix):
                tail = name[len(prefix):]
                return (int(tail), prefix) if tail.isdigit() else None
        return None

    def _eval(self, t, ask, _user_data) -> bool:
        # Exceptions cannot cross the C boundary: keep the first, stop the graph, re-raise in run().
        try:
            tp = ctypes.cast(t, ctypes.POINTER(self._ggml.tensor_t))
            hit = self._layer(tp.contents.name)
            if hit is None:
                return False if ask else True
            if ask:
                return True
            il, prefix = hit
            keys = self._ggml.read(tp)
            if prefix == b"wqkv-":  # [.., n_tokens, n_q + 2 n_kv]: the K columns
                self._pending[il] = np.ascontiguousarray(keys[..., self._k_cols])
                return True
            if tp.contents.op != self._ggml.op_rope or prefix != b"Kcur-":
                self._pending[il] = keys  # the last key tensor before the RoPE wins
                return True
            pre = self._pending.pop(il, None)
            if pre is None:
                raise SparqError(f"layer {il}: RoPE'd keys without the keys before RoPE")
            post = keys.reshape(-1, *self._shape)
            pre = pre.reshape(-1, *self._shape)
            n = post.shape[0]
            if pre.shape[0] != n:
                raise SparqError(f"layer {il}: {pre.shape[0]} keys before RoPE but {n} after")
            pos = np.arange(self._pos[il], self._pos[il] + n)
            self._pos[il] += n
            self.on_keys(il, pre, post, pos)
            return True
        except BaseException as e:  # noqa: BLE001 (re-raised in run)
            if self._error is None:
                self._error = e
            return False

    def close(self) -> None:
        L = self._L
        if getattr(self, "_ctx", None):
            L.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            L.llama_model_free(self._model)
            self._model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
