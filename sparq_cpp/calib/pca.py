"""Per-layer, per-KV-head PCA of keys from streamed second moments (Loki's calibration).

Only sum(x), sum(x x^T) and the count are kept (float64), so memory is bounded by
2 variants x n_layer x n_head_kv x D^2 doubles however many keys are seen. The covariance is
centred, as sklearn's PCA (which Loki's code uses) fits it; at inference the mean is not subtracted.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparq_cpp.errors import SparqError
from sparq_cpp.projection import VARIANTS, explained_variance_ratio, rank_at


class KeyMoments:
    """Running first and second moments of keys, both variants in one pass."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int):
        self.shape = (n_layer, n_head_kv, head_dim)
        self.sum = np.zeros((len(VARIANTS), n_layer, n_head_kv, head_dim))
        self.sumsq = np.zeros((len(VARIANTS), n_layer, n_head_kv, head_dim, head_dim))
        self.count = np.zeros((len(VARIANTS), n_layer), np.int64)

    def add(self, variant: str, il: int, keys: np.ndarray) -> None:
        """keys [n_tokens, n_head_kv, D] of layer il."""
        v = VARIANTS.index(variant)
        x = np.asarray(keys, np.float64)
        if x.ndim != 3 or x.shape[1:] != self.shape[1:]:
            raise SparqError(f"keys of shape {keys.shape}, expected [n, {self.shape[1]}, {self.shape[2]}]")
        for h in range(x.shape[1]):  # one 2-d product per head: BLAS's fast path
            xh = np.ascontiguousarray(x[:, h])
            self.sum[v, il, h] += xh.sum(axis=0)
            self.sumsq[v, il, h] += xh.T @ xh
        self.count[v, il] += x.shape[0]

    def fit(self, layers=None) -> "LokiPCA":
        """The PCA of every layer, or only of `layers` (indices): the others (sliding-window layers,
        which attend densely) get the identity basis and zero variance."""
        L, H, D = self.shape
        fitted = np.zeros(L, bool)
        fitted[list(range(L)) if layers is None else list(layers)] = True
        count = np.where(fitted, self.count, 2)  # layers left out divide by a dummy count
        if (count < 2).any():
            raise SparqError("PCA needs at least 2 keys per layer and head; calibrate on more tokens")
        n = count[:, :, None, None]
        mean = self.sum / n
        cov = (self.sumsq - n[..., None] * mean[..., :, None] * mean[..., None, :]) / (n[..., None] - 1)
        cov = 0.5 * (cov + np.swapaxes(cov, -1, -2))  # exact symmetry for eigh
        w, vecs = np.linalg.eigh(cov)  # ascending, columns are eigenvectors
        w, vecs = w[..., ::-1], vecs[..., ::-1]
        w = np.clip(w, 0.0, None)  # rounding can leave tiny negatives
        # Eigenvectors are defined up to sign: make each one's largest-|.| component positive
        # (the first such on ties) so the same keys always give the same file.
        big = np.argmax(np.abs(vecs), axis=-2)[..., None, :]
        sign = np.where(np.take_along_axis(vecs, big, axis=-2) < 0, -1.0, 1.0)
        vecs = vecs * sign
        vecs[:, ~fitted] = np.eye(D)
        w[:, ~fitted] = 0.0
        first = int(np.argmax(fitted))
        return LokiPCA(components={v: vecs[i] for i, v in enumerate(VARIANTS)},
                       explained_variance={v: w[i] for i, v in enumerate(VARIANTS)},
                       n_tokens=int(self.count[0, first]),
                       layers=None if layers is None else tuple(int(il) for il in np.flatnonzero(fitted)))


@dataclass
class LokiPCA:
    """components[variant]: P, float64 [n_layer, n_head_kv, D, D], column c = component c, sorted by
    decreasing explained_variance[variant] [n_layer, n_head_kv, D] (eigenvalues of the covariance)."""

    components: dict
    explained_variance: dict
    n_tokens: int
    layers: tuple | None = None  # the calibrated layers when not all (the others hold the identity)

    def explained_variance_ratio(self, variant: str) -> np.ndarray:
        return explained_variance_ratio(self.explained_variance[variant])

    def rank_at(self, variant: str, fraction: float = 0.9) -> np.ndarray:
        """int [n_layer, n_head_kv]: components needed to explain `fraction` of the variance."""
        return rank_at(self.explained_variance[variant], fraction)
