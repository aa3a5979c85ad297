"""The reference backend of the evaluation: methods.py's session interface over the numpy/Numba forward pass
(sparq_cpp.reference), for every method. Needs numba (the [reference] extra): the runner loads this module
through sparq_cpp.lazy when a run asks for a reference method.
"""
from __future__ import annotations

import numpy as np

from sparq_cpp.errors import SparqError
from sparq_cpp.projection import read_projection
from sparq_cpp.reference.alisa import SWAAttention
from sparq_cpp.reference.attention import DenseAttention, ExactTopKAttention, SparQAttention
from sparq_cpp.reference.baselines import DensePrompt, H2OAttention, LMInfiniteAttention, RecordPrompt
from sparq_cpp.reference.forward import LlamaReference
from sparq_cpp.reference.gguf_model import load_llama  # noqa: F401 (the runner reads the model with it)
from sparq_cpp.reference.loki import LokiAttention


class RefSession:
    """The reference forward pass; one prefill per sample serves every method and setting. The prompt
    goes in batches of PREFILL_BATCH tokens (the reference's results do not depend on the batch size),
    which bounds the memory of an 8k-token prompt."""

    PREFILL_BATCH = 512

    def __init__(self, model, *, cache_type: str, loki_projection=None, model_path=None):
        self._prompt = DensePrompt(H2OAttention(1))  # dense rows; records the prompt's H2O scores
        self.ref = LlamaReference(model, attention=self._prompt, cache_type=cache_type)
        self.loki_projection, self.model_path = loki_projection, model_path
        self._loki_bases = None
        self.n_prefill = 0
        self._alisa = None  # ALISA's record of the prompt's attention weights, once alisa is asked for
        self._tokens = []

    def prefill(self, tokens):
        self.ref.reset()
        self._prompt.reset()
        self.ref.attention = self._prompt
        if self._alisa is not None:
            self._alisa.reset()
            self.ref.attention = RecordPrompt(self._prompt, self._alisa)
        self._tokens = list(tokens)
        for pos in range(0, len(tokens), self.PREFILL_BATCH):  # batches of llama.cpp's size; no logits
            self.ref.forward(list(tokens[pos: pos + self.PREFILL_BATCH]), logits=False)
        self.n_prefill = self.ref.n_cells

    def rewind(self):
        self.ref.n_cells = self.n_prefill  # later cells are overwritten; earlier ones never change

    def _bases(self):
        if self._loki_bases is None:
            if self.loki_projection is None:
                raise SparqError("loki on the reference needs a projection: pass --loki-pca FILE "
                                 "(made by `sparq-cpp calibrate`)")
            self._loki_bases = read_projection(self.loki_projection, model_path=self.model_path)
        return self._loki_bases

    def make(self, method: str, params: dict):
        if method == "dense":
            return DenseAttention()
        if method == "sparq":
            att = SparQAttention(params["r"], params["k"], params["l"], params.get("mean_value", True), params.get("sink", 0))
        elif method == "exact-topk":
            att = ExactTopKAttention(params["k"])
        elif method == "lm-infinite":
            att = LMInfiniteAttention(params["k"])
        elif method == "loki":
            att = LokiAttention(self._bases(), params["d"], params["k"], params.get("l", 0), params.get("sink", 0))
        elif method == "h2o":
            att = self._prompt.method.with_budget(params["k"], params["l"])  # the prompt's scores
        elif method == "alisa":
            if self._alisa is None or params["c"] > self._alisa.keep_c:
                # first use (or a larger ratio): prefill again, recording the prompt's weights from now on,
                # only the rows a window of this ratio or smaller can reach (memory ~ n*k, not n**2)
                self._alisa = SWAAttention(params["c"], keep_c=params["c"])
                self.prefill(self._tokens)
            att = self._alisa.with_ratio(params["c"])  # the prompt's weights seed the window sums
        else:
            raise SparqError(f"unknown method {method!r}")
        wrapped = DensePrompt(att)
        wrapped.prompt = False
        return wrapped

    def use_attention(self, attention):
        self.ref.attention = attention

    def feed(self, tokens) -> np.ndarray:
        return self.ref.forward(list(tokens))

    def close(self):
        pass
