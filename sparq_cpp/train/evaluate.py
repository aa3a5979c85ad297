"""Validation loss and long-range task accuracy of a torch model."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from sparq_cpp.train.tasks import Sample, merge, score


@torch.no_grad()
def val_loss(model, windows: np.ndarray, batch: int = 4) -> float:
    """Mean next-token cross-entropy (nats/token) over plain-text windows."""
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(windows), batch):
        ids = torch.from_numpy(windows[i:i + batch]).long()
        logits = model(ids[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
        n += ids[:, 1:].numel()
    return total / n


@torch.no_grad()
def task_accuracy(model, samples: list[Sample]) -> dict[str, float]:
    """Greedy accuracy per task kind (see tasks.score) over held-out sequences."""
    model.eval()
    results = []
    for s in samples:
        logits = model(torch.from_numpy(s.tokens).long()[None])[0].numpy()
        results.append(score(s, logits))
    return merge(results)
