"""Task files for `sparq-cpp eval` from the held-out Austen text, in the formats it reads
(`sparq-cpp eval --help-formats`), phrased like the training mixture's key-value sentences so the
trained model can be asked: the needle is one such sentence, the question its first half."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from sparq_cpp.outfile import atomic_write
from sparq_cpp.train import corpus
from sparq_cpp.train.tasks import random_name

NEEDLE = {"needle": "The password of Dekedi is lantern.", "question": "What is the password of Dekedi?",
          "answer": "lantern", "answer_prefix": "The password of Dekedi is"}


def _keys(n: int, seed: int) -> list[str]:
    rng, keys = np.random.default_rng(seed), []
    while len(keys) < n:
        k = random_name(rng)
        if k not in keys:
            keys.append(k)
    return keys


CALIB_CHARS = 40_000  # of each novel's training part: ~6 x 10k tokens, more than calibrate's default 16k


def _head(text: str, n: int) -> str:
    """The whole paragraphs within the first n characters (or the first n characters if one is longer)."""
    if len(text) <= n:
        return text.strip()
    cut = text.rfind("\n\n", 0, n)
    return text[:cut if cut > 0 else n].strip()


def write(out: str | Path, deb=None, n_kv: int = 400, seed: int = 7) -> dict[str, Path]:
    """Writes heldout.txt (bpc, repetition), needle.txt and kv.txt under `out`, and calib.txt
    (training text, for `sparq-cpp calibrate`: Loki's bases must not be fitted on the held-out
    text they are scored on); returns {task: path}, "calib" included."""
    out = Path(out)
    train, val = corpus.split(corpus.load_novels(deb))
    heldout = "\n\n".join(t.strip() for t in val) + "\n"
    calib = "\n\n".join(_head(t, CALIB_CHARS) for t in train) + "\n"
    rng = np.random.default_rng(seed)
    files = {
        "heldout.txt": heldout,
        "needle.txt": "".join(f"{k}: {v}\n" for k, v in NEEDLE.items()) + "---\n" + heldout,
        "kv.txt": "".join(f"{k}\t{int(rng.integers(100, 2000))}\n" for k in _keys(n_kv, seed)),
        "calib.txt": calib,
    }
    paths = {name: atomic_write(out / name, lambda tmp, t=text: tmp.write_text(t, encoding="utf-8"), "--out",
                                 make_parents=True)
             for name, text in files.items()}
    return {"bpc": paths["heldout.txt"], "repetition": paths["heldout.txt"], "needle": paths["needle.txt"],
            "kv": paths["kv.txt"], "calib": paths["calib.txt"]}
