"""A llama.cpp context with several sequences, driven through the C API (llama_cpp's Llama class
decodes one sequence only): batches of (token, position, sequence), cache edits, state blobs."""
from __future__ import annotations

import contextlib
import ctypes

import numpy as np

from sparq_cpp.attention import Dense
from sparq_cpp.llm import CACHE_TYPES, c_params
from sparq_cpp.bindings import sparse_api

FLASH_ATTN_ENABLED = 1


@contextlib.contextmanager
def captured_log():
    """llama.cpp's log lines while the block runs (llama_cpp's own callback restored after)."""
    from llama_cpp import _logger, llama_cpp as C

    lines = []

    @C.llama_log_callback
    def cb(level, text, user_data):
        lines.append(text.decode(errors="replace"))

    C.llama_log_set(cb, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        C.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


class Session:
    def __init__(self, path, attention=None, *, cache_type="f32", n_ctx=512, n_seq=1, unified=True,
                 n_batch=256, n_threads=1, devices=None, n_gpu_layers: int = 0):
        from llama_cpp import llama_cpp as C

        self.C = C
        attention = attention or Dense()
        C.llama_backend_init()
        mp = C.llama_model_default_params()
        if devices is not None:  # a NULL-terminated ggml_backend_dev_t array, kept alive by the caller
            mp.devices = devices
        mp.n_gpu_layers = n_gpu_layers
        self.model = C.llama_model_load_from_file(str(path).encode(), mp)
        assert self.model, f"could not load {path}"
        cp = C.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
        cp.n_seq_max, cp.kv_unified = n_seq, unified
        cp.type_k = cp.type_v = CACHE_TYPES[cache_type]
        cp.flash_attn_type = FLASH_ATTN_ENABLED
        cp.n_threads = cp.n_threads_batch = n_threads
        if isinstance(attention, sparse_api.llama_sparse_attn_params):  # as llama.cpp parsed it
            cp.sparse_attn = attention
        elif not isinstance(attention, Dense):
            cp.sparse_attn = c_params(attention, creation=True)
        self.ctx = C.llama_init_from_model(self.model, cp)
        assert self.ctx, "could not create the context"
        self.mem = C.llama_get_memory(self.ctx)
        self.n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = C.llama_batch_init(n_batch, 0, n_seq)

    def close(self):
        C = self.C
        if self.batch is not None:
            C.llama_batch_free(self.batch)
            C.llama_free(self.ctx)
            C.llama_model_free(self.model)
            self.batch = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def decode(self, items):
        """items: (token, pos, seq_id, want_logits); returns the logits asked for, in order."""
        C, b = self.C, self.batch
        assert len(items) <= self.n_batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(out)
            b.seq_id[i][0] = seq
        rc = C.llama_decode(self.ctx, b)
        assert rc == 0, f"llama_decode returned {rc}"
        got = []
        for i, item in enumerate(items):
            if item[3]:
                ptr = C.llama_get_logits_ith(self.ctx, i)
                got.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
        return got

    def prompt(self, tokens, seq=0, pos0=0):
        """The prompt in batches of n_batch; the logits of its last token."""
        out = None
        for i0 in range(0, len(tokens), self.n_batch):
            chunk = tokens[i0: i0 + self.n_batch]
            last = i0 + len(chunk) == len(tokens)
            items = [(t, pos0 + i0 + j, seq, last and j == len(chunk) - 1) for j, t in enumerate(chunk)]
            got = self.decode(items)
            out = got[0] if got else out
        return out

    def steps(self, tokens, seq=0, pos0=0):
        """One token per decode call (the sparse path); the logits of each step."""
        return [self.decode([(t, pos0 + i, seq, True)])[0] for i, t in enumerate(tokens)]

    def upkeep_n_cells(self) -> int:
        return sparse_api.upkeep_n_cells(self.ctx)

    # cache edits
    def seq_rm(self, seq, p0=-1, p1=-1):
        assert self.C.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def seq_cp(self, src, dst, p0=-1, p1=-1):
        self.C.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_keep(self, seq):
        self.C.llama_memory_seq_keep(self.mem, seq)

    def seq_add(self, seq, p0, p1, delta):
        self.C.llama_memory_seq_add(self.mem, seq, p0, p1, delta)

    def clear(self, data=True):
        self.C.llama_memory_clear(self.mem, data)

    # state
    def state(self) -> bytes:
        C = self.C
        buf = (ctypes.c_uint8 * C.llama_state_get_size(self.ctx))()
        n = C.llama_state_get_data(self.ctx, buf, len(buf))
        return bytes(buf[:n])

    def set_state(self, blob: bytes):
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        assert self.C.llama_state_set_data(self.ctx, buf, len(blob)) == len(blob)

    def seq_state(self, seq) -> bytes:
        C = self.C
        buf = (ctypes.c_uint8 * C.llama_state_seq_get_size(self.ctx, seq))()
        n = C.llama_state_seq_get_data(self.ctx, buf, len(buf), seq)
        return bytes(buf[:n])

    def set_seq_state(self, blob: bytes, seq):
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        assert self.C.llama_state_seq_set_data(self.ctx, buf, len(blob), seq) == len(blob)

    def save_file(self, path, tokens):
        arr = (self.C.llama_token * len(tokens))(*tokens)
        assert self.C.llama_state_save_file(self.ctx, str(path).encode(), arr, len(tokens))

    def save_seq_file(self, path, seq, tokens):
        arr = (self.C.llama_token * len(tokens))(*tokens)
        assert self.C.llama_state_seq_save_file(self.ctx, str(path).encode(), seq, arr, len(tokens)) > 0

    def load_seq_file(self, path, seq, n_max=8192):
        arr = (self.C.llama_token * n_max)()
        n = ctypes.c_size_t(0)
        assert self.C.llama_state_seq_load_file(self.ctx, str(path).encode(), seq, arr, n_max, ctypes.byref(n)) > 0
        return list(arr[: n.value])

    def load_file(self, path, n_max=8192):
        arr = (self.C.llama_token * n_max)()
        n = ctypes.c_size_t(0)
        assert self.C.llama_state_load_file(self.ctx, str(path).encode(), arr, n_max, ctypes.byref(n))
        return list(arr[: n.value])
