"""The Loki paper's Figure 2 for one model: rank at 90% explained variance per layer, pre and post RoPE."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from sparq_cpp import lazy
from sparq_cpp.outfile import atomic_write


def rank_figure(path, rank_pre: np.ndarray, rank_post: np.ndarray, head_dim: int, model_name: str,
                fraction: float = 0.9, what: str = "output") -> Path:
    """rank_*: [n_layer, n_head_kv]; each panel plots the mean over KV heads per layer. `what` (the option
    that named `path`) starts an error's message."""
    plt = lazy.pyplot()
    MaxNLocator = lazy.need("matplotlib.ticker", "a plot").MaxNLocator
    pct = round(100 * fraction)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, rank, label in ((axes[0], rank_pre, "Pre-Rotary"), (axes[1], rank_post, "Post-Rotary")):
        mean = rank.mean(axis=1)
        ax.plot(np.arange(len(mean)), mean, marker="o", ms=3)
        ax.axhline(head_dim, color="grey", ls="--", lw=0.8, label=f"full dimensionality ({head_dim})")
        ax.set_title(f"{model_name} Attention Keys ({label})", fontsize=9)
        ax.set_xlabel("Layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, head_dim * 1.1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"Rank at {pct}% explained variance")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120), what)
    finally:
        plt.close(fig)
