"""sparq_cpp.Llama: llama-cpp-python's Llama with the sparse attention of the patch series switched on.

This module imports llama_cpp (which loads libllama) at its top: `import sparq_cpp` does not import it, and
sparq_cpp.Llama is this class, imported on first use (sparq_cpp.llm.llama_class). The checks before a context
is created are sparq_cpp.llm.prepare's, which `sparq-cpp serve` runs too.
"""
from __future__ import annotations

import os
from typing import Any

from sparq_cpp import lazy
from sparq_cpp.attention import ALISA, Attention, Auto, Dense, parse_attention
from sparq_cpp.bindings import sparse_api
from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import GGUFSummary
from sparq_cpp.llm import CACHE_TYPES, c_params, check_alisa_memory, check_context_memory, prepare

lazy.llama_cpp()  # chooses OpenMP's wait policy before libllama loads; without a build, says how to make one
import llama_cpp  # noqa: E402  (loaded by the line above)

__all__ = ["Llama"]

# A cached prompt's tail is evaluated again as this many rows (or the whole prompt, if shorter). Measured on the
# demo model: in a SparQ or Loki context, a tail of 2-63 rows gives the last row's logits up to 0.2 apart from the
# prompt's first evaluation, 64 or more bit for bit the same (a dense or ALISA context: the same for any tail).
# 64 is ggml's CPU flash-attention tile (GGML_FA_TILE_Q), from which it computes rows in tiles.
PROMPT_TAIL = 64


class Llama(llama_cpp.Llama):
    """llama_cpp.Llama with an `attention` setting: Dense(), SparQ(...), Loki(...) or ALISA(...), or the
    same as a string in LLAMA_SPARSE_ATTN's syntax ("sparq:r=8,k=32", "loki:d=32,proj=m.loki.gguf",
    "alisa:c=0.125", "dense"); or Auto(ratio=0.125) ("auto:ratio=0.125"): the setting with the best fidelity
    the model's calibration measured within that budget (sparq_cpp.auto; `auto_choice` says which and why).

    What a mode keeps in the cache (SparQ: a transposed copy of K and the V sums; Loki: keys in the
    projection's basis; ALISA: a window of past attention weights) is decided when the context is
    created, so pass the attention here; `set_attention` then changes the settings between decode
    calls without recreating the context. The KV cache types are `cache_type` for both, or
    llama-cpp-python's `type_k`/`type_v` (names or ggml type numbers): f32, f16 (default) or q8_0.
    Errors are SparqError, a ValueError whose message names what is wrong.
    """

    def __init__(self, model_path: str | os.PathLike, attention: Attention | Auto | str | None = None, *,
                 cache_type: str | None = None, **kwargs: Any) -> None:
        opening = prepare(model_path, attention, n_ctx=kwargs.get("n_ctx", 512), cache_type=cache_type,
                          type_k=kwargs.pop("type_k", None), type_v=kwargs.pop("type_v", None))
        attention, summary, n_ctx = opening.attention, opening.summary, opening.n_ctx
        self.auto_choice: str | None = opening.auto_choice  # why Auto resolved to what it did
        kwargs.setdefault("verbose", False)
        kwargs.update(type_k=CACHE_TYPES[opening.type_k], type_v=CACHE_TYPES[opening.type_v])
        if isinstance(attention, ALISA):
            check_alisa_memory(summary, -(-n_ctx // 256) * 256, attention.c)  # llama.cpp pads to 256 cells
        if not isinstance(attention, Dense):
            if kwargs.get("flash_attn") is False:
                raise SparqError(f"{attention.name} needs flash attention (V stored row-major); "
                                 "do not pass flash_attn=False")
            kwargs["flash_attn"] = True
            # the mode the context is created for, in llama_context_params (patches/bindings)
            kwargs["sparse_attn"] = c_params(attention, creation=True)
        check_context_memory(model_path, summary, attention, n_ctx=n_ctx, type_k=opening.type_k,
                             type_v=opening.type_v, flash_attn=bool(kwargs.get("flash_attn")),
                             n_batch=kwargs.get("n_batch", 512), ubatch_size=kwargs.get("n_ubatch", 512))
        try:
            super().__init__(model_path=str(model_path), **kwargs)
        except (ValueError, RuntimeError) as e:
            raise SparqError(f"llama.cpp could not load {model_path} with {attention.name} attention: {e}") from None
        self.summary: GGUFSummary = summary
        self.cache_type_k, self.cache_type_v = opening.type_k, opening.type_v
        self.cache_type: str | None = opening.type_k if opening.type_k == opening.type_v else None  # None: K and V differ
        self.attention: Attention = attention
        self._alisa_window = isinstance(attention, ALISA)  # the context keeps ALISA's window of past weights
        self._prompt_next = False  # set by generate: its next eval is the part of a prompt not cached

    def generate(self, tokens, *args, **kwargs):
        self._prompt_next = True  # the next eval is this prompt's (what llama_cpp did not find cached)
        return super().generate(tokens, *args, **kwargs)

    def eval(self, tokens) -> None:
        """llama_cpp's eval, which first removes the cached positions from n_tokens on. An ALISA context
        refuses to remove what its window cannot follow (the middle, or too much of the end): then the
        kept tokens are processed again as a prompt, as llama-server does, before `tokens`.

        A prompt that was all cached but its last token (llama_cpp's prefix reuse re-evaluates that one for
        its logits) is evaluated with the PROMPT_TAIL - 1 tokens before it, as one batch: alone it would be a
        sparse decode step where the first time the prompt batch attended densely, and a short batch computes
        its rows otherwise than the prompt did; either way the same request would give another text."""
        if self._prompt_next:
            self._prompt_next = False
            if len(tokens) == 1 and self.n_tokens > 0 and not isinstance(self.attention, Dense):
                back = min(self.n_tokens, PROMPT_TAIL - 1)
                self.n_tokens -= back
                tokens = [int(t) for t in self.input_ids[self.n_tokens:self.n_tokens + back]] + list(tokens)
        if self._alisa_window and not self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1):
            keep = [int(t) for t in self.input_ids[: self.n_tokens]]
            self._ctx.kv_cache_clear()
            self.n_tokens = 0
            if keep:
                super().eval(keep)
        super().eval(tokens)

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """llama_cpp's tokenize, with a buffer sized by the text: llama-cpp-python sizes it by the model's
        training context, 8 GiB for a file that claims 2^31 tokens. A text of n bytes has at most n + 2."""
        lc = llama_cpp
        n_max = len(text) + 8
        while True:
            buf = (lc.llama_token * n_max)()
            n = lc.llama_tokenize(self._model.vocab, text, len(text), buf, n_max, add_bos, special)
            if n >= 0:
                return list(buf[:n])
            if -n <= n_max:
                raise SparqError(f"llama.cpp could not tokenize the text ({n})")
            n_max = -n

    def close(self) -> None:
        if hasattr(self, "_stack"):  # a constructor that raised leaves nothing to close
            super().close()

    def set_attention(self, attention: Attention | str) -> None:
        """Change the attention between decode calls, without a new context (a settings object or a string
        as in the constructor). Within what the context was created with: a SparQ context switches to other
        SparQ settings or Dense(); a Loki context to other d, k, l (its basis stays) or Dense(); an ALISA
        context to Dense() or a c no larger than the one it was created with; a dense context stays dense.
        What the context cannot do is refused with SparqError."""
        if isinstance(attention, str):
            attention = parse_attention(attention)
        attention.check(self.summary.head_dim)
        sparse_api.set_params(self._ctx.ctx, c_params(attention))
        self.attention = attention
