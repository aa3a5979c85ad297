"""The same measurements as evaluate.py, through llama.cpp on a GGUF (no torch needed)."""
from __future__ import annotations

import numpy as np

from sparq_cpp.llm import open_model
from sparq_cpp.train.tasks import Sample, merge, score


def _log_softmax_nll(logits: np.ndarray, targets: np.ndarray) -> float:
    z = logits - logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(z).sum(axis=-1))
    return float((lse - z[np.arange(len(targets)), targets]).sum())


class GGUFScorer:
    """All-position logits of token sequences from one llama.cpp context (dense by default)."""

    def __init__(self, path, n_ctx: int, *, attention=None, n_threads: int = 1, cache_type: str = "f32"):
        self.llm, self.summary = open_model(path, attention=attention, n_ctx=n_ctx, n_threads=n_threads,
                                            cache_type=cache_type, logits_all=True)

    def logits(self, tokens) -> np.ndarray:
        self.llm.reset()
        self.llm.eval([int(t) for t in tokens])
        return np.array(self.llm.scores[:len(tokens)], np.float32)

    def val_loss(self, windows: np.ndarray) -> float:
        total, n = 0.0, 0
        for w in windows:
            total += _log_softmax_nll(self.logits(w[:-1]), w[1:])
            n += len(w) - 1
        return total / n

    def task_accuracy(self, samples: list[Sample]) -> dict[str, float]:
        return merge([score(s, self.logits(s.tokens)) for s in samples])

    def close(self) -> None:
        self.llm.close()
